//! [`Runtime`]: the top of the house, the façade that Rust users and the
//! binding call. It owns one [`DeviceState`] per device and the
//! [`Services`] they share (the driver, the pointer registry, the leak
//! report), plus this process's IPC exports; everything below it (devices,
//! contexts, pointers, the pool) holds what it needs, never the runtime.
//! Python uses [`Runtime::global`]; Rust code and tests can make their own
//! (for example over a [`SimDriver`](crate::SimDriver)).

mod handed;
pub use handed::PoolId;
mod ipc;
mod slot;
mod wrap;

use std::cell::RefCell;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::context::Context;
use crate::device::{DeviceState, Owner, Services};
use crate::driver::{self, Driver, DriverChoice, DriverKind, RawStream, SimDriver};
use crate::error::Result;
use crate::history::History;
use crate::ipc::liveness::Exports;
use crate::pool::PoolConfig;
use crate::registry::Registry;
use crate::snapshot::Snapshot;
use crate::stats::{ClassStats, DeviceStats};
use crate::track::{Outstanding, Tracker, Watch};
use ipc::Ipc;

/// The process-wide runtime ([`Runtime::global`]).
static GLOBAL: OnceLock<Result<Arc<Runtime>>> = OnceLock::new();

/// The driver with everything gpuptr keeps about it.
pub struct Runtime {
    services: Arc<Services>,
    devices: Vec<Arc<DeviceState>>,
    /// Each device's live context (see `slot`).
    slots: Vec<Mutex<slot::Slot>>,
    /// Allocations handed to other libraries' allocator interfaces.
    handed: handed::HandedOut,
    ipc: Ipc,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // A device's destroyed graphs hold its context (and so the device)
        // until their blocks are given back on a caller's thread: with no
        // runtime left to give them back later, do it now.
        if crate::fork::forked() {
            return;
        }
        for d in &self.devices {
            d.bury();
        }
    }
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("driver", &self.driver().kind())
            .finish_non_exhaustive()
    }
}

/// The captures this thread began on each runtime's devices and has not
/// ended ([`Runtime::begin_capture`]), ended when the thread exits: a capture
/// left under way holds every fence of its device back for good. Each is
/// kept by its device, which may outlive its runtime (contexts hold it).
struct OpenCaptures(RefCell<Vec<Weak<DeviceState>>>, std::thread::ThreadId);

impl Drop for OpenCaptures {
    fn drop(&mut self) {
        self.end_all();
    }
}

impl OpenCaptures {
    /// End every capture on the record, with a warning each.
    fn end_all(&self) {
        // In a forked child the parent's locks may be held by threads that
        // are gone, and nothing of the parent's is ours to end.
        if crate::fork::forked() {
            return;
        }
        for device in self.0.take() {
            // A thread-local destructor must not unwind (that aborts): the
            // end, its log and the device's last drop all run inside.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let Some(device) = device.upgrade() else {
                    return;
                };
                if device.end_capture_of(self.1).is_ok() {
                    log::warn!(
                        target: "gpuptr::context",
                        "device {}: a thread exited during a capture it began; the capture is ended",
                        device.ordinal()
                    );
                }
            }));
        }
    }
}

thread_local! {
    static OPEN_CAPTURES: OpenCaptures =
        OpenCaptures(RefCell::new(Vec::new()), std::thread::current().id());
}

impl Runtime {
    /// End every capture the calling thread began, on any runtime's devices,
    /// and has not ended, with a warning each, as the thread's exit does: for
    /// a binding whose threads end, as its users see it (Python's
    /// `Thread.join()` returns), before their thread-locals are destroyed.
    pub fn end_thread_captures() {
        let _ = OPEN_CAPTURES.try_with(OpenCaptures::end_all);
    }

    /// A runtime over `driver`, with a caching pool per device.
    pub fn new(driver: Arc<dyn Driver>) -> Result<Arc<Self>> {
        Runtime::with_pool(driver, Some(PoolConfig::default()))
    }

    /// A runtime over `driver`; `None` allocates straight from the driver.
    pub fn with_pool(driver: Arc<dyn Driver>, pool: Option<PoolConfig>) -> Result<Arc<Self>> {
        crate::fork::watch();
        let n = driver.device_count()?;
        let services = Arc::new(Services {
            driver,
            registry: Registry::new(),
            watch: Watch::default(),
            tracker: Tracker::default(),
            history: History::default(),
            exports: Exports::default(),
            read_only: Default::default(),
        });
        Ok(Arc::new(Runtime {
            devices: (0..n)
                .map(|d| Arc::new(DeviceState::new(d, services.clone(), pool)))
                .collect(),
            slots: slot::slots(n),
            handed: handed::HandedOut::new(n),
            services,
            ipc: Ipc::default(),
        }))
    }

    /// Driver allocations `device`'s pool holds (cached or handed out).
    pub fn pool_held_blocks(&self, device: usize) -> usize {
        self.devices.get(device).map_or(0, |d| d.pool_held_blocks())
    }

    /// Whether `device`'s pool reads its GPU as busy now: its fence has
    /// spun on its CPU longer than a growth costs, work queued on the GPU
    /// holding fenced frees back. Misses then grow by a whole growth ahead,
    /// and the helper grows ahead of demand. False without a pool.
    pub fn pool_reads_busy(&self, device: usize) -> bool {
        self.devices
            .get(device)
            .is_some_and(|d| d.pool_reads_busy())
    }

    /// Wait for the fence covering every block freed so far on `device`, so
    /// they are ready for reuse (the allocator never needs this; tests and
    /// callers about to measure do). `false` if the fence failed.
    pub fn flush_pool(self: &Arc<Self>, device: usize) -> Result<bool> {
        self.check_device(device)?;
        // A forked child never gives back its parent's memory.
        crate::fork::check()?;
        self.devices[device].bury();
        // The context held through the fence (its last holder may go meanwhile).
        Ok(match self.existing(device) {
            Some(ctx) => self.devices[device].flush(ctx.raw()),
            None => true,
        })
    }

    /// Return every cached block of every device to the driver; the bytes freed.
    pub fn trim(self: &Arc<Self>) -> Result<usize> {
        self.trim_with(true)
    }

    /// [`Runtime::trim`] of device memory alone: each device's cache of
    /// pinned host memory stays.
    pub fn trim_device_memory(self: &Arc<Self>) -> Result<usize> {
        self.trim_with(false)
    }

    fn trim_with(self: &Arc<Self>, host: bool) -> Result<usize> {
        crate::fork::check()?;
        let mut freed = 0;
        for (i, d) in self.devices.iter().enumerate() {
            d.bury();
            if let Some(ctx) = self.existing(i) {
                freed += d.trim(&ctx, host)?;
            }
        }
        Ok(freed)
    }

    /// Prepare for `device`'s context being reset (numba's `cuda.close()`):
    /// cached blocks go back to the driver, and every live allocation turns
    /// stale. Stale pointers raise `InvalidPointer` on use, and freeing them
    /// is a no-op, so they never free memory a later allocation reuses. The
    /// memory of live allocations is left to the reset that follows: without
    /// one it stays allocated until the context is reset or released by every
    /// holder (after a reset it may be another owner's).
    pub fn reset(self: &Arc<Self>, device: usize) -> Result<()> {
        crate::fork::check()?;
        self.check_device(device)?;
        let Some(ctx) = self.existing(device) else {
            return Ok(());
        };
        let r = self.devices[device].reset(ctx.raw());
        self.clear_slot(device);
        r
    }

    /// Tell the pool that a stream capture (a CUDA graph) begins on
    /// `device`. Until the matching [`Runtime::end_capture`], the pool runs
    /// no fence: CUDA refuses `cuCtxSynchronize` of a context while any
    /// stream of it captures, in every capture mode, and the refusal
    /// invalidates the capture (another device's context is not held). A
    /// fence already running is waited for first. Blocks freed meanwhile
    /// wait for the fence after the capture (they are never handed out
    /// early), and an allocation that runs out of memory meanwhile returns
    /// the cache and fails rather than wait for a fence. Calls nest: one
    /// end per begin. gpuptr's own allocations and frees need no call: they
    /// run in relaxed capture mode.
    /// A thread that exits with captures it began still under way ends
    /// them as it goes (with a warning): no fence could run again otherwise.
    /// A thread whose thread-locals are being destroyed cannot keep that
    /// record: a begin there is refused ([`Error::InvalidArgument`](crate::Error::InvalidArgument)).
    pub fn begin_capture(&self, device: usize) -> Result<()> {
        self.check_device(device)?;
        self.devices[device].begin_capture();
        let state = Arc::downgrade(&self.devices[device]);
        let kept = OPEN_CAPTURES.try_with(|o| o.0.borrow_mut().push(state));
        if kept.is_err() {
            let _ = self.devices[device].end_capture();
            return Err(crate::Error::InvalidArgument(
                "begin_capture: this thread is exiting, and could not end the capture".into(),
            ));
        }
        Ok(())
    }

    /// End a capture begun with [`Runtime::begin_capture`] on the calling
    /// thread. [`Error::InvalidArgument`](crate::Error::InvalidArgument) (and nothing ends) when this
    /// thread has no such capture under way on `device`: an unbalanced end
    /// would otherwise close the gate of another thread's capture.
    pub fn end_capture(&self, device: usize) -> Result<()> {
        self.check_device(device)?;
        self.devices[device].end_capture()?;
        let mine =
            |d: &Weak<DeviceState>| std::ptr::eq(d.as_ptr(), Arc::as_ptr(&self.devices[device]));
        let _ = OPEN_CAPTURES.try_with(|o| {
            let mut open = o.0.borrow_mut();
            if let Some(i) = open.iter().rposition(mine) {
                open.swap_remove(i);
            }
        });
        Ok(())
    }

    /// The capture `stream` takes part in (begun after
    /// [`Runtime::begin_capture`]) keeps its memory for its graph: pool
    /// blocks allocated during it, on a stream that takes part in it or by
    /// this thread with no stream given, and blocks this thread frees
    /// during it, are reused only after the graph, and every executable
    /// graph made from it, is destroyed (CUDA runs a user object the graph
    /// owns then).
    /// `gpuptr.install()` calls it for CuPy's and PyTorch's captures. A
    /// capture nobody announced keeps nothing. `Err` if `stream` is not
    /// capturing.
    ///
    /// # Safety
    /// `stream` is a live stream of `device`'s primary context, whose
    /// capture the calling thread began (only that thread may touch the
    /// graph being captured), and it stays alive until the matching
    /// [`Runtime::end_capture`].
    pub unsafe fn capture_started(
        self: &Arc<Self>,
        device: usize,
        stream: RawStream,
    ) -> Result<()> {
        self.check_device(device)?;
        let ctx = self.context(device)?;
        // SAFETY: this fn's contract.
        unsafe { ctx.state().capture_started(&ctx, stream) }
    }

    /// Bytes of `device`'s pool that CUDA graphs keep: freed, and reused
    /// once their graph is destroyed.
    pub fn graph_kept_bytes(&self, device: usize) -> Result<usize> {
        self.check_device(device)?;
        crate::fork::check()?;
        let d = &self.devices[device];
        d.bury();
        Ok(d.graphs().kept_bytes())
    }

    /// Whether a capture begun with [`Runtime::begin_capture`] is under way
    /// on `device`.
    pub fn capturing(&self, device: usize) -> Result<bool> {
        self.check_device(device)?;
        Ok(self.devices[device].capturing())
    }

    /// Cap the bytes `device`'s pool holds from the driver (`None`: no cap,
    /// the default), as RMM's maximum pool size: past it an allocation first
    /// reuses and returns the cache, then fails as out of memory. A device
    /// without a pool (`GPUPTR_POOL=0`) has nothing to cap: a limit there is
    /// an [`Error::InvalidArgument`](crate::Error::InvalidArgument), `None` a no-op.
    pub fn set_pool_limit(&self, device: usize, bytes: Option<usize>) -> Result<()> {
        self.check_device(device)?;
        if bytes.is_some() && !self.devices[device].pooled() {
            return Err(crate::Error::InvalidArgument(format!(
                "device {device} has no pool to limit (GPUPTR_POOL=0 turned it off): \
                 its allocations go to the driver as they come"
            )));
        }
        self.devices[device].set_pool_limit(bytes);
        Ok(())
    }

    /// The pool of `device` by size class (empty when it has no pool).
    pub fn class_stats(&self, device: usize) -> Result<Vec<ClassStats>> {
        self.check_device(device)?;
        Ok(self.devices[device].class_stats())
    }

    /// Make every device's peak equal to its live bytes now.
    pub fn reset_peak_stats(&self) {
        for d in &self.devices {
            d.reset_peak();
        }
    }

    /// Make device `device`'s peaks equal to its values now (PyTorch's
    /// `reset_peak_memory_stats(device)`).
    pub fn reset_device_peak_stats(&self, device: usize) -> Result<()> {
        self.check_device(device)?;
        self.devices[device].reset_peak();
        Ok(())
    }

    /// Whether the CUDA driver can be used here, without opening it for
    /// use: its version, or why not.
    pub fn probe_cuda() -> Result<i32> {
        driver::probe_cuda()
    }

    /// Which driver is in use.
    pub fn driver_kind(&self) -> DriverKind {
        self.driver().kind()
    }

    /// The driver's CUDA version, as `cuDriverGetVersion` (13000 for 13.0).
    pub fn driver_version(&self) -> Result<i32> {
        self.driver().version()
    }

    /// The name of `device`.
    pub fn device_name(&self, device: usize) -> Result<String> {
        self.check_device(device)?;
        self.driver().device_name(device)
    }

    /// The total memory of `device`, in bytes.
    pub fn device_total_memory(&self, device: usize) -> Result<usize> {
        self.check_device(device)?;
        self.driver().device_total_memory(device)
    }

    /// `cuDevicePrimaryCtxGetState(device)`: `(flags, active)`.
    pub fn primary_context_state(&self, device: usize) -> Result<(u32, bool)> {
        self.check_device(device)?;
        let s = self.driver().primary_context_state(device)?;
        Ok((s.flags, s.active))
    }

    /// The simulator, when it is the driver (tests reach its fault
    /// injection and counters through this).
    pub fn sim(&self) -> Option<&SimDriver> {
        self.driver().as_sim()
    }

    /// The process-wide runtime if [`Runtime::global`] opened it already
    /// (this never opens a driver); none in a forked child, where a lock of
    /// it may be held for good by a parent thread the fork left behind.
    pub fn global_if_open() -> Option<&'static Arc<Runtime>> {
        if crate::fork::forked() {
            return None;
        }
        GLOBAL.get().and_then(|r| r.as_ref().ok())
    }

    /// The process-wide runtime, over the driver `GPUPTR_DRIVER` names
    /// (`auto`/`cuda`/`sim`). Opened on first use; a failure is remembered.
    pub fn global() -> Result<&'static Arc<Runtime>> {
        crate::fork::check()?;
        GLOBAL
            .get_or_init(|| {
                use crate::config;
                let pool = if !config::switch_or(config::POOL, true)? {
                    None
                } else {
                    Some(PoolConfig {
                        // Bytes; 0 turns growth ahead of demand off.
                        ahead_bytes: config::size_or(
                            config::POOL_AHEAD,
                            PoolConfig::default().ahead_bytes,
                        )?,
                        // Bytes past the live set before a miss waits for a fence.
                        headroom_bytes: config::size_or(
                            config::POOL_HEADROOM,
                            PoolConfig::default().headroom_bytes,
                        )?,
                        // Bytes; 0 turns the pinned host cache off.
                        host_cache_bytes: config::size_or(
                            config::HOST_CACHE,
                            PoolConfig::default().host_cache_bytes,
                        )?,
                        ..PoolConfig::default()
                    })
                };
                let rt = Runtime::with_pool(driver::open(DriverChoice::from_env()?)?, pool)?;
                if config::switch_or(config::TRACK, false)? {
                    rt.set_tracking(true);
                }
                if config::switch_or(config::HISTORY, false)? {
                    rt.record_history(true, crate::history::DEFAULT_MAX_ENTRIES);
                }
                if let Some(oom) = config::path(config::OOM_SNAPSHOT) {
                    rt.set_oom_snapshot(Some(oom));
                }
                Ok(rt)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The driver.
    #[inline]
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.services.driver
    }

    /// The pointer→context registry.
    #[inline]
    pub(crate) fn registry(&self) -> &Registry<Owner> {
        &self.services.registry
    }

    /// The context of the known range holding `address`, with the range
    /// `[start, end)`, from the registry.
    #[inline]
    pub(crate) fn lookup_range(
        &self,
        address: crate::driver::DevicePtr,
    ) -> Option<(
        Arc<Context>,
        crate::driver::DevicePtr,
        crate::driver::DevicePtr,
    )> {
        let (owner, start, end) = self.registry().lookup_range(address)?;
        // Every owner gpuptr registers is a context.
        Some((owner.downcast::<Context>().ok()?, start, end))
    }

    #[inline]
    pub(crate) fn tracker(&self) -> &Tracker {
        &self.services.tracker
    }

    #[inline]
    pub(crate) fn services(&self) -> &Services {
        &self.services
    }

    pub(crate) fn ipc(&self) -> &Ipc {
        &self.ipc
    }

    /// Turn the leak report on or off (`GPUPTR_TRACK=1` turns it on for the
    /// global runtime). On, every allocation records where it was made until
    /// it is released; allocations made while it was off are not listed.
    pub fn set_tracking(&self, on: bool) {
        self.services.watch.set(Watch::TRACK, on);
    }

    /// Whether allocations record where they were made.
    #[inline]
    pub fn tracking(&self) -> bool {
        self.services.watch.on(Watch::TRACK)
    }

    /// Start (or stop) the allocation history (see [`crate::history`]).
    /// Started, the trace begins afresh and keeps at most `max_entries`
    /// events, the oldest going first; stopped, nothing more is recorded
    /// and what was stays for [`Runtime::snapshot`]. `GPUPTR_HISTORY=1`
    /// starts it for the global runtime.
    pub fn record_history(&self, on: bool, max_entries: usize) {
        if on {
            self.services.history.start(max_entries);
        }
        self.services.watch.set(Watch::HISTORY, on);
    }

    /// Whether the allocation history records.
    #[inline]
    pub fn recording_history(&self) -> bool {
        self.services.watch.on(Watch::HISTORY)
    }

    /// Where a snapshot is written when an allocation runs out of memory
    /// (`None`: nowhere; `GPUPTR_OOM_SNAPSHOT` sets it for the global
    /// runtime). The out-of-memory error then names the file; a snapshot
    /// that cannot be written is logged (a warning) and named in the error,
    /// never raised.
    pub fn set_oom_snapshot(&self, path: Option<std::path::PathBuf>) {
        self.services.history.set_oom_snapshot(path);
    }

    /// Where a snapshot is written on out of memory, if anywhere.
    pub fn oom_snapshot(&self) -> Option<std::path::PathBuf> {
        self.services.history.oom_snapshot()
    }

    /// Every device's segments and blocks now, and the history's trace.
    pub fn snapshot(&self) -> Snapshot {
        let history = &self.services.history;
        let live = history.live();
        Snapshot {
            segments: self
                .devices
                .iter()
                .flat_map(|d| d.segments(&live))
                .collect(),
            device_traces: history.traces(self.devices.len()),
            max_entries: history.max_entries(),
        }
    }

    /// The live allocations made while tracking was on, grouped by where
    /// they were made, the most bytes first.
    pub fn outstanding(&self) -> Vec<Outstanding> {
        self.tracker().outstanding()
    }

    /// Number of address ranges the pointer→context registry knows.
    pub fn registered_ranges(&self) -> usize {
        self.registry().len()
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// `Ok` if `device` exists, else [`Error::InvalidArgument`](crate::Error::InvalidArgument).
    pub fn check_device(&self, device: usize) -> Result<()> {
        crate::error::check_device(device, self.device_count())
    }

    /// The one live context of `device`, retaining its primary context if no
    /// holder has it now.
    pub fn context(self: &Arc<Self>, device: usize) -> Result<Arc<Context>> {
        crate::fork::check()?;
        self.check_device(device)?;
        self.slot_context(device, false)
    }

    /// [`Runtime::context`], and the runtime keeps the context alive from
    /// now until a reset of the device (or the end of the process), so that
    /// its pool outlives the caller's allocations: for callers that hold no
    /// context between them, such as allocator hooks and reservations. A
    /// context otherwise ends, and its pool with it, when its last holder
    /// goes.
    pub fn held_context(self: &Arc<Self>, device: usize) -> Result<Arc<Context>> {
        crate::fork::check()?;
        self.check_device(device)?;
        self.slot_context(device, true)
    }

    /// The device of the calling thread's current context, or 0 when none
    /// is current (CuPy's and numba's default device).
    pub fn current_device(&self) -> Result<usize> {
        let raw = self.driver().current_context()?;
        if raw == 0 {
            return Ok(0);
        }
        // A live context gpuptr retained: no second driver call.
        if let Some(d) = self.devices.iter().position(|d| d.live_raw() == raw) {
            return Ok(d);
        }
        Ok(self.driver().current_device()?.unwrap_or(0))
    }

    /// Let go of the runtime's own holds on its contexts
    /// ([`Runtime::held_context`]): each context then ends with its last
    /// other holder, and its pool with it.
    pub fn release_held_contexts(&self) {
        for d in 0..self.devices.len() {
            self.release_hold(d);
        }
    }

    /// Allocation statistics of every device.
    pub fn stats(&self) -> Vec<DeviceStats> {
        self.devices.iter().map(|d| d.stats()).collect()
    }

    /// Device `device`'s statistics (one entry of [`Runtime::stats`]).
    pub fn device_stats(&self, device: usize) -> Result<DeviceStats> {
        self.check_device(device)?;
        Ok(self.devices[device].stats())
    }
}
