//! The leak report: with tracking on, each allocation gpuptr makes records
//! where it was made (a Rust source location, or a Python stack from the
//! binding) until it is released, and [`Runtime::outstanding`] groups the
//! live ones by site.
//!
//! Off (the default), an allocation pays one relaxed load and a release one
//! branch on a field it already reads. On, each allocation and release takes
//! one global lock around a hash-map update. The load is [`Watch`]'s, which
//! the allocation history ([`crate::history`]) shares: one load for both.
//!
//! [`Runtime::outstanding`]: crate::Runtime::outstanding

use std::collections::HashMap;
use std::panic::Location;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use crate::driver::DevicePtr;
use crate::stats::Client;

/// What allocations note while it is on: the leak report, the allocation
/// history, or both. One relaxed load tells an allocation both.
#[derive(Default)]
pub(crate) struct Watch(AtomicU8);

impl Watch {
    /// The leak report ([`Tracker`]).
    pub(crate) const TRACK: u8 = 1;
    /// The allocation history ([`crate::history::History`]).
    pub(crate) const HISTORY: u8 = 2;

    /// The bits that are on.
    #[inline]
    pub(crate) fn get(&self) -> u8 {
        self.0.load(Ordering::Relaxed)
    }

    /// Whether `bit` is on.
    #[inline]
    pub(crate) fn on(&self, bit: u8) -> bool {
        self.get() & bit != 0
    }

    pub(crate) fn set(&self, bit: u8, on: bool) {
        if on {
            self.0.fetch_or(bit, Ordering::Relaxed);
        } else {
            self.0.fetch_and(!bit, Ordering::Relaxed);
        }
    }
}

/// One frame of a caller's stack: a file, a line and a function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// The source file.
    pub filename: Arc<str>,
    /// The line in it (0: unknown).
    pub line: u32,
    /// The function (or `<module>`, or empty when unknown).
    pub name: Arc<str>,
}

/// The frames of a stack a [`Site`] shows as text (the leak report's
/// sites); a history entry keeps all it was given.
const SITE_FRAMES: usize = 8;

/// Where an allocation was made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Site {
    /// The Rust call site (`#[track_caller]` through gpuptr's allocation
    /// functions).
    Rust(&'static Location<'static>),
    /// A description made by the caller.
    Described(Arc<str>),
    /// A stack given by the caller, innermost first: the binding's Python
    /// stack.
    Stack(Arc<[Frame]>),
}

impl Site {
    /// Its frames, innermost first: one for a Rust call site (function
    /// `<rust>`) or a description (as the file name, line 0).
    pub fn frames(&self) -> Vec<Frame> {
        match self {
            Site::Rust(l) => vec![Frame {
                filename: l.file().into(),
                line: l.line(),
                name: "<rust>".into(),
            }],
            Site::Described(s) => vec![Frame {
                filename: s.clone(),
                line: 0,
                name: "".into(),
            }],
            Site::Stack(frames) => frames.to_vec(),
        }
    }
}

impl std::fmt::Display for Site {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Site::Rust(l) => write!(f, "{}:{}", l.file(), l.line()),
            Site::Described(s) => f.write_str(s),
            Site::Stack(frames) => {
                for (i, fr) in frames.iter().take(SITE_FRAMES).enumerate() {
                    if i > 0 {
                        f.write_str(" <- ")?;
                    }
                    write!(f, "{}:{} in {}", fr.filename, fr.line, fr.name)?;
                }
                Ok(())
            }
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

/// The live allocations noted while tracking was on (whether it is on is
/// [`Watch::TRACK`]).
#[derive(Default)]
pub(crate) struct Tracker {
    live: Mutex<HashMap<DevicePtr, Entry>>,
}

impl Tracker {
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

    /// Forget every allocation noted on `device` (its context was reset:
    /// their memory is gone, and their addresses may come back).
    pub(crate) fn forget_device(&self, device: usize) {
        self.lock().retain(|_, e| e.device != device);
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
