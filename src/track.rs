//! The leak report: with tracking on, each allocation gpuptr makes records
//! where it was made (a Rust source location, or a Python stack from the
//! binding) until it is released, and [`Runtime::outstanding`] groups the
//! live ones by site.
//!
//! Off (the default), an allocation pays one relaxed load and a release one
//! branch on a field it already reads. On, each allocation and release takes
//! one global lock around a hash-map update.
//!
//! [`Runtime::outstanding`]: crate::Runtime::outstanding

use std::collections::HashMap;
use std::panic::Location;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::driver::DevicePtr;
use crate::stats::Client;

/// Where an allocation was made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Site {
    /// The Rust call site (`#[track_caller]` through gpuptr's allocation
    /// functions).
    Rust(&'static Location<'static>),
    /// A description made by the caller: the binding's Python stack.
    Described(Arc<str>),
}

impl std::fmt::Display for Site {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Site::Rust(l) => write!(f, "{}:{}", l.file(), l.line()),
            Site::Described(s) => f.write_str(s),
        }
    }
}

/// The live allocations made at one site.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outstanding {
    /// Where they were made.
    pub site: String,
    /// How many are live.
    pub count: usize,
    /// Their bytes.
    pub bytes: usize,
    /// The devices they are on, ascending.
    pub devices: Vec<usize>,
    /// The clients that asked for them.
    pub clients: Vec<Client>,
}

struct Entry {
    device: usize,
    size: usize,
    client: Client,
    site: Site,
}

#[derive(Default)]
pub(crate) struct Tracker {
    enabled: AtomicBool,
    live: Mutex<HashMap<DevicePtr, Entry>>,
}

impl Tracker {
    pub(crate) fn new(enabled: bool) -> Self {
        Tracker {
            enabled: AtomicBool::new(enabled),
            live: Mutex::default(),
        }
    }

    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    pub(crate) fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<DevicePtr, Entry>> {
        crate::sync::lock(&self.live)
    }

    /// Note a live allocation (made while tracking was on).
    pub(crate) fn record(
        &self,
        address: DevicePtr,
        device: usize,
        size: usize,
        client: Client,
        site: Site,
    ) {
        let entry = Entry {
            device,
            size,
            client,
            site,
        };
        self.lock().insert(address, entry);
    }

    /// Forget an allocation noted by [`Tracker::record`] (also after tracking
    /// was turned off: what was noted is still forgotten on release).
    pub(crate) fn forget(&self, address: DevicePtr) {
        self.lock().remove(&address);
    }

    /// The live noted allocations grouped by site, the most bytes first.
    pub(crate) fn outstanding(&self) -> Vec<Outstanding> {
        let live = self.lock();
        let mut by: HashMap<String, Outstanding> = HashMap::new();
        for e in live.values() {
            let site = e.site.to_string();
            let o = by.entry(site.clone()).or_insert_with(|| Outstanding {
                site,
                count: 0,
                bytes: 0,
                devices: Vec::new(),
                clients: Vec::new(),
            });
            o.count += 1;
            o.bytes += e.size;
            if !o.devices.contains(&e.device) {
                o.devices.push(e.device);
            }
            if !o.clients.contains(&e.client) {
                o.clients.push(e.client);
            }
        }
        drop(live);
        let mut v: Vec<Outstanding> = by.into_values().collect();
        for o in &mut v {
            o.devices.sort_unstable();
            o.clients.sort_by_key(|c| c.index());
        }
        v.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.site.cmp(&b.site)));
        v
    }
}
