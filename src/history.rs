//! The allocation history: while it is on, every allocation and free gpuptr
//! makes, every driver allocation of the pool (a *segment*) and every out of
//! memory goes into a bounded ring of [`TraceEntry`]s, in the order they
//! happened, and each live allocation keeps its [`Site`] (the binding's
//! Python stack), so a [`Snapshot`](crate::Snapshot) can say where every
//! block in the pool came from. It is PyTorch's `_record_memory_history`
//! for every library on gpuptr's pool.
//!
//! Off (the default), an allocation pays the one relaxed load of the
//! switches it pays for the leak report anyway (one atomic for both), and a
//! release one branch on a field it already reads. On, each event takes one
//! global lock around a ring push (and a hash-map update for allocations).
//!
//! A segment event is recorded before the first allocation in it and after
//! the last free from it; a free is recorded before its memory can go to
//! another owner, so a replay of the trace in order never sees an address
//! in use twice.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::driver::{DevicePtr, RawStream};
use crate::stats::Client;
use crate::sync::lock;
use crate::track::Site;

/// The most entries the ring keeps unless told otherwise (PyTorch's
/// default too).
pub const DEFAULT_MAX_ENTRIES: usize = 100_000;

/// What a [`TraceEntry`] records; the names are PyTorch's.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// An allocation was handed out.
    Alloc,
    /// Its owner freed it.
    FreeRequested,
    /// It went back to the pool (or the driver): gpuptr records this with
    /// [`Action::FreeRequested`], at once, since the pool, not the owner,
    /// waits for the fence (a block waiting for one is
    /// [`BlockState::PendingFree`](crate::BlockState::PendingFree) in a
    /// snapshot).
    FreeCompleted,
    /// The pool (or an allocation outside it) took memory from the driver.
    SegmentAlloc,
    /// It gave memory back to the driver (or a reset took it).
    SegmentFree,
    /// An allocation ran out of memory.
    Oom,
}

impl Action {
    /// PyTorch's name for it: `"alloc"`, `"free_requested"`,
    /// `"free_completed"`, `"segment_alloc"`, `"segment_free"`, `"oom"`.
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::Oom => "oom",
        }
    }
}

/// One event of the history.
#[derive(Clone, Debug)]
pub struct TraceEntry {
    /// What happened.
    pub action: Action,
    /// On which device.
    pub device: usize,
    /// The allocation's (or segment's) address; 0 for out of memory.
    pub address: DevicePtr,
    /// The bytes asked for (a segment's: its bytes).
    pub size: usize,
    /// The stream the memory is ordered on (0: none, or the legacy stream).
    pub stream: RawStream,
    /// The library that asked (allocations and their frees).
    pub client: Option<Client>,
    /// Where the allocation was made (its free names the same place).
    pub site: Option<Site>,
    /// Bytes the device had free ([`Action::Oom`] only).
    pub device_free: usize,
    /// When, in microseconds since the Unix epoch.
    pub time_us: u64,
}

/// A live allocation made while the history was on.
#[derive(Clone, Debug)]
pub(crate) struct Live {
    pub device: usize,
    pub size: usize,
    pub stream: RawStream,
    pub client: Client,
    pub site: Site,
    /// A driver allocation of its own (not a pool block): its own segment.
    pub own_segment: bool,
}

struct Ring {
    entries: VecDeque<TraceEntry>,
    max_entries: usize,
    /// Live allocations made while it was on, by address.
    live: HashMap<DevicePtr, Live>,
}

impl Default for Ring {
    fn default() -> Self {
        Ring {
            entries: VecDeque::new(),
            max_entries: DEFAULT_MAX_ENTRIES,
            live: HashMap::new(),
        }
    }
}

impl Ring {
    fn push(&mut self, e: TraceEntry) {
        if self.max_entries == 0 {
            return;
        }
        while self.entries.len() >= self.max_entries {
            self.entries.pop_front();
        }
        self.entries.push_back(e);
    }
}

/// The history's ring and live allocations (whether it records is
/// [`Watch::HISTORY`](crate::track::Watch::HISTORY)), and where to write a
/// snapshot when memory runs out.
#[derive(Default)]
pub(crate) struct History {
    ring: Mutex<Ring>,
    oom_snapshot: Mutex<Option<PathBuf>>,
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn entry(action: Action, device: usize, address: DevicePtr, size: usize) -> TraceEntry {
    TraceEntry {
        action,
        device,
        address,
        size,
        stream: 0,
        client: None,
        site: None,
        device_free: 0,
        time_us: now_us(),
    }
}

impl History {
    /// Start recording afresh: the ring is emptied and keeps at most
    /// `max_entries` from now on (the oldest go first). Live allocations
    /// recorded before stay known.
    pub(crate) fn start(&self, max_entries: usize) {
        let mut r = lock(&self.ring);
        r.entries.clear();
        r.max_entries = max_entries;
    }

    /// The most entries the ring keeps.
    pub(crate) fn max_entries(&self) -> usize {
        lock(&self.ring).max_entries
    }

    /// An allocation was handed out (its segment, for one of its own, first).
    pub(crate) fn alloc(&self, address: DevicePtr, live: Live) {
        let mut r = lock(&self.ring);
        if live.own_segment {
            let mut seg = entry(Action::SegmentAlloc, live.device, address, live.size);
            seg.stream = live.stream;
            r.push(seg);
        }
        let mut e = entry(Action::Alloc, live.device, address, live.size);
        e.stream = live.stream;
        e.client = Some(live.client);
        e.site = Some(live.site.clone());
        r.push(e);
        r.live.insert(address, live);
    }

    /// The allocation at `address` is freed: forgotten, and, while
    /// `recording`, its free (and its segment's, for one of its own)
    /// recorded. Nothing for an address it does not know.
    pub(crate) fn free(&self, address: DevicePtr, recording: bool) {
        let mut r = lock(&self.ring);
        let Some(live) = r.live.remove(&address) else {
            return;
        };
        if recording {
            Self::push_free(&mut r, address, &live);
        }
    }

    fn push_free(r: &mut Ring, address: DevicePtr, live: &Live) {
        for action in [Action::FreeRequested, Action::FreeCompleted] {
            let mut e = entry(action, live.device, address, live.size);
            e.stream = live.stream;
            e.client = Some(live.client);
            e.site = Some(live.site.clone());
            r.push(e);
        }
        if live.own_segment {
            let mut seg = entry(Action::SegmentFree, live.device, address, live.size);
            seg.stream = live.stream;
            r.push(seg);
        }
    }

    /// A segment of the pool came (`alloc`) or went.
    pub(crate) fn segment(&self, alloc: bool, device: usize, base: DevicePtr, bytes: usize) {
        let action = match alloc {
            true => Action::SegmentAlloc,
            false => Action::SegmentFree,
        };
        lock(&self.ring).push(entry(action, device, base, bytes));
    }

    /// `device` was reset: its live allocations are gone (their frees are
    /// recorded, while `recording`, before the segments that a reset takes).
    pub(crate) fn forget_device(&self, device: usize, recording: bool) {
        let mut r = lock(&self.ring);
        let mut gone: Vec<(DevicePtr, Live)> = Vec::new();
        r.live.retain(|a, l| {
            if l.device == device {
                gone.push((*a, l.clone()));
            }
            l.device != device
        });
        if recording {
            gone.sort_by_key(|g| g.0);
            for (a, l) in &gone {
                Self::push_free(&mut r, *a, l);
            }
        }
    }

    /// An allocation of `size` bytes ran out of memory with `device_free`
    /// bytes free on the device.
    pub(crate) fn oom(&self, device: usize, size: usize, device_free: usize) {
        let mut e = entry(Action::Oom, device, 0, size);
        e.device_free = device_free;
        lock(&self.ring).push(e);
    }

    /// The entries, oldest first, one list per device: at least `devices`
    /// lists, more where the ring has entries of devices past them.
    pub(crate) fn traces(&self, devices: usize) -> Vec<Vec<TraceEntry>> {
        let mut out = vec![Vec::new(); devices];
        let r = lock(&self.ring);
        for e in &r.entries {
            if out.len() <= e.device {
                out.resize(e.device + 1, Vec::new());
            }
            out[e.device].push(e.clone());
        }
        out
    }

    /// The live allocations it knows of.
    pub(crate) fn live(&self) -> HashMap<DevicePtr, Live> {
        lock(&self.ring).live.clone()
    }

    /// Where a snapshot goes when memory runs out (`None`: nowhere).
    pub(crate) fn set_oom_snapshot(&self, path: Option<PathBuf>) {
        *lock(&self.oom_snapshot) = path;
    }

    pub(crate) fn oom_snapshot(&self) -> Option<PathBuf> {
        lock(&self.oom_snapshot).clone()
    }
}
