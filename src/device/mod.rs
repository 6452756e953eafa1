//! [`DeviceState`]: everything gpuptr keeps about one device, with one
//! owner. PyTorch's `DeviceCachingAllocator` is the model: one object per
//! device owns its reset epoch, its pool, the registry entries of the
//! pool's blocks, its counters, its graph memory and the out-of-memory
//! ladder. Reset and teardown are its methods. It knows no context type:
//! a call names its context through [`Handle`] (the raw handle, the epoch
//! it was born in, an opaque registry owner), which the context room above
//! implements; the runtime keeps each device's context slot.
//!
//! It holds the [`Services`] it needs (the driver, the registry, the leak
//! report, the IPC liveness file), never the [`Runtime`](crate::Runtime):
//! calls go from the runtime down to the device, from the device to the
//! pool, and from the pool to the driver.
//!
//! The rooms: this file holds the state, its context slot and reset epoch,
//! and the pool's plain paths; `oom` is the whole out-of-memory ladder above
//! the pool; `ahead` orchestrates growth ahead and reservations;
//! `lifecycle` is trim, reset and teardown.

mod ahead;
mod lifecycle;
mod oom;

use std::any::Any;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::driver::{DevicePtr, Driver, RawContext, RawStream};
use crate::error::{Error, Result};
use crate::graph::GraphMemory;
use crate::history::History;
use crate::ipc::liveness::Exports;
use crate::pool::{Allocation, Block, HostBlock, Pool, PoolConfig};
use crate::registry::{ReadOnlyRanges, Registry};
use crate::stats::{ClassStats, DeviceCounters, DeviceStats};
use crate::sync::lock;
use crate::track::{Tracker, Watch};

/// What owns a registry entry: the context that made the memory, opaque
/// here (the runtime, above, knows it as its context type).
pub(crate) type Owner = dyn Any + Send + Sync;

/// What the device asks of the context a call comes from, implemented by
/// the context room above: the device never names the context type.
pub(crate) trait Handle {
    /// The raw `CUcontext`.
    fn raw(&self) -> RawContext;
    /// The device's reset epoch when the context was retained.
    fn born(&self) -> u64;
    /// The registry's owner of memory made in the context, held weakly.
    fn owner(&self) -> Weak<Owner>;
    /// What a CUDA graph that keeps memory of the context holds until it
    /// is destroyed.
    fn keeper(&self) -> Arc<dyn crate::graph::Owner>;
}

/// What every device of a runtime shares: the driver and the books kept
/// across devices.
pub(crate) struct Services {
    pub(crate) driver: Arc<dyn Driver>,
    /// The pointer→context registry.
    pub(crate) registry: Registry<Owner>,
    /// What allocations note: the leak report, the history, or both.
    pub(crate) watch: Watch,
    /// The leak report.
    pub(crate) tracker: Tracker,
    /// The allocation history.
    pub(crate) history: History,
    /// The IPC liveness slots of this process's exports.
    pub(crate) exports: Exports,
    /// The read-only host ranges: no pointer over them is writable.
    pub(crate) read_only: ReadOnlyRanges,
}

/// One device's state (see the module documentation).
pub(crate) struct DeviceState {
    device: usize,
    services: Arc<Services>,
    pool: Option<Pool>,
    counters: DeviceCounters,
    /// Held while the cache goes back to the driver (a trim, or an
    /// out-of-memory retry), while growth ahead allocates and stocks, and
    /// through a reset: so no thread's trim holds blocks in transit that
    /// another thread's retry looks for, and nothing grows for a context
    /// that a reset or teardown is ending.
    recovery: Mutex<()>,
    /// The raw handle of the live context (0: none), so the current
    /// device is found from `cuCtxGetCurrent` alone.
    raw: AtomicUsize,
    /// The live context, as the runtime's slot holds it (weakly; set when
    /// the runtime retains one, cleared by a reset): at the last drop of
    /// a context kept across a reset, whether a newer one owns the pool
    /// (see [`DeviceState::teardown`]).
    live: Mutex<Weak<Owner>>,
    /// The reset epoch: bumped when the context is reset (or invalidated);
    /// memory made in an older epoch is gone, and is never freed.
    epoch: AtomicU64,
    /// Pool blocks that CUDA graphs keep.
    graphs: GraphMemory,
    /// Captures begun on this device and not ended, by the thread that
    /// began them: an end is only taken from a thread with one open.
    capture_threads: Mutex<Vec<(std::thread::ThreadId, usize)>>,
}

impl DeviceState {
    pub(crate) fn new(device: usize, services: Arc<Services>, pool: Option<PoolConfig>) -> Self {
        DeviceState {
            device,
            pool: pool.map(|c| {
                let s = services.clone();
                Pool::new(c, services.driver.clone()).on_segments(Box::new(move |made, a| {
                    if s.watch.on(Watch::HISTORY) {
                        s.history.segment(made, device, a.base, a.bytes);
                    }
                }))
            }),
            services,
            counters: DeviceCounters::default(),
            recovery: Mutex::new(()),
            raw: AtomicUsize::new(0),
            live: Mutex::new(Weak::<()>::new()),
            epoch: AtomicU64::new(0),
            graphs: GraphMemory::default(),
            capture_threads: Mutex::new(Vec::new()),
        }
    }

    /// The memory CUDA graphs of this device keep.
    #[inline]
    pub(crate) fn graphs(&self) -> &GraphMemory {
        &self.graphs
    }

    /// The device ordinal.
    #[inline]
    pub(crate) fn ordinal(&self) -> usize {
        self.device
    }

    #[inline]
    pub(crate) fn services_arc(&self) -> &Arc<Services> {
        &self.services
    }

    #[inline]
    pub(crate) fn driver(&self) -> &dyn Driver {
        self.services.driver.as_ref()
    }

    #[inline]
    pub(crate) fn counters(&self) -> &DeviceCounters {
        &self.counters
    }

    #[inline]
    pub(crate) fn pooled(&self) -> bool {
        self.pool.is_some()
    }

    /// The current reset epoch.
    #[inline]
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Start a new epoch: everything made so far is stale.
    pub(crate) fn invalidate(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// The raw handle of the live context (0: none).
    #[inline]
    pub(crate) fn live_raw(&self) -> RawContext {
        self.raw.load(Ordering::Acquire)
    }

    /// `ctx` is the device's live context now (the runtime retained it,
    /// under its slot's lock).
    pub(crate) fn retained(&self, ctx: &impl Handle) {
        let mut live = lock(&self.live);
        *live = ctx.owner();
        self.raw.store(ctx.raw(), Ordering::Release);
    }

    /// Whether some holder keeps the device's live context.
    fn has_live(&self) -> bool {
        lock(&self.live).strong_count() > 0
    }

    /// Give `block` of the context `raw` back to the pool, freed on
    /// `stream` (see [`Pool::release`]); a block of an older epoch is
    /// refused, its memory gone with the reset.
    #[inline]
    pub(crate) fn pool_release(&self, raw: RawContext, block: Block, stream: Option<RawStream>) {
        if let Some(pool) = &self.pool {
            pool.release(raw, block, stream, || self.epoch() == block.epoch);
        }
    }

    /// Give back the blocks of this device's destroyed CUDA graphs, if any
    /// (one load when none), through the pool's fence: no driver call here,
    /// no wait.
    #[inline]
    pub(crate) fn bury(&self) {
        self.graphs
            .bury(|raw, blocks| self.give_back_kept(raw, blocks));
    }

    #[cold]
    fn give_back_kept(&self, raw: RawContext, blocks: &mut dyn Iterator<Item = Block>) {
        let (mut n, mut bytes) = (0, 0);
        for b in blocks {
            (n, bytes) = (n + 1, bytes + b.size);
            self.pool_release(raw, b, None);
        }
        if n != 0 {
            log::debug!(
                target: "gpuptr::pool",
                "device {}: a CUDA graph was destroyed; {} block(s) ({} bytes) go back to the pool",
                self.device,
                n,
                bytes
            );
        }
    }

    /// Register a pool segment's range for `owner` (held weakly: the
    /// pool's growth helper never keeps a context alive), so its context
    /// resolves by address (a wrap inside it is bound-checked against its
    /// block by the pool, [`DeviceState::pool_block`]). The registry is the
    /// one record of these entries: they go by address, with the context
    /// that made them.
    fn register(&self, owner: &Weak<Owner>, a: &Allocation) -> crate::registry::Registration {
        self.services.registry.insert_weak(a.base, a.bytes, owner)
    }

    /// Forget the registry entries of the blocks of `gone`, whichever
    /// context made them (one kept across a reset allocates too).
    fn unregister(&self, gone: impl IntoIterator<Item = Allocation>) {
        let bases = gone.into_iter().map(|a| a.base);
        self.services.registry.remove_at(bases);
    }

    /// A pinned host block of `size` bytes made with `flags`
    /// (`HOST_ALLOC_*`) from the pool's host cache; `None` when the device
    /// has no pool or the size is not cached (the caller then asks the
    /// driver itself). A context of an epoch a reset ended (before or
    /// during the call) gets no block: the error a stale context's memory
    /// gives.
    pub(crate) fn host_alloc(
        &self,
        ctx: &impl Handle,
        size: usize,
        flags: u32,
    ) -> Option<Result<HostBlock>> {
        let pool = self.pool.as_ref().filter(|p| p.host_caches(size))?;
        let born = ctx.born();
        Some(
            pool.host_alloc(ctx.raw(), size, flags, || self.epoch() == born)
                .and_then(|b| {
                    b.ok_or_else(|| {
                        Error::InvalidPointer(format!(
                            "the context of device {} was reset; pinned memory comes from the new one",
                            self.device
                        ))
                    })
                }),
        )
    }

    /// Give `block` (handed out for `size` bytes in `epoch`) back to the
    /// host cache of `ctx`, where it waits for the fence; a block of an
    /// older epoch is refused, its memory gone with the reset. When that
    /// leaves the cache past its cap with blocks still waiting for their
    /// fence, the pool's helper gives back what is past the cap once that
    /// fence is done ([`DeviceState::host_settle`]).
    pub(crate) fn host_release(
        self: &Arc<Self>,
        ctx: &impl Handle,
        epoch: u64,
        block: HostBlock,
        size: usize,
    ) {
        let Some(pool) = &self.pool else {
            return;
        };
        if pool.host_release(ctx.raw(), block, size, || self.epoch() == epoch) {
            // Weak, as growth ahead's jobs: the job never keeps a context alive.
            let me = Arc::downgrade(self);
            let (weak, raw, born) = (ctx.owner(), ctx.raw(), ctx.born());
            pool.post_ahead(Box::new(move || {
                if let Some(me) = me.upgrade() {
                    me.host_settle(&weak, raw, born);
                }
            }));
        }
    }

    /// On the pool's helper: seal the host cache, wait for its fence (no
    /// lock held), and give back the ready blocks past the cap, each step
    /// under the recovery lock and only while `weak` (handle `raw`, born in
    /// `epoch`) is still the device's live context, as
    /// [`DeviceState::grow_ahead`] checks: a reset or the last drop frees
    /// the cache itself.
    fn host_settle(&self, weak: &Weak<Owner>, raw: RawContext, epoch: u64) {
        let Some(pool) = &self.pool else {
            return;
        };
        pool.host_settle_begin();
        let live = || self.still_live(weak, raw, epoch);
        let n = {
            let _recovering = lock(&self.recovery);
            if !live() {
                return;
            }
            pool.host_settle_seal(raw)
        };
        if !pool.host_settle_wait(n) {
            return;
        }
        let _recovering = lock(&self.recovery);
        if live() {
            pool.host_settle(raw);
        }
    }

    /// Wait for the fence covering every block freed so far in the live
    /// context `raw`, which the caller holds (`true` when there is nothing
    /// to wait for); `false` if it failed.
    pub(crate) fn flush(&self, raw: RawContext) -> bool {
        match &self.pool {
            Some(pool) => pool.flush(raw),
            None => true,
        }
    }

    /// A stream capture begins (or ends) on this device: see
    /// [`Runtime::begin_capture`](crate::Runtime::begin_capture).
    pub(crate) fn begin_capture(&self) {
        let me = std::thread::current().id();
        {
            let mut open = lock(&self.capture_threads);
            match open.iter_mut().find(|(t, _)| *t == me) {
                Some((_, n)) => *n += 1,
                None => open.push((me, 1)),
            }
        }
        if let Some(pool) = &self.pool {
            pool.begin_capture();
        }
    }

    /// `Err` when the calling thread has no capture begun on this device
    /// under way: an unbalanced end would close another thread's gate.
    pub(crate) fn end_capture(&self) -> Result<()> {
        self.end_capture_of(std::thread::current().id())
    }

    /// [`DeviceState::end_capture`] for thread `me` (an exiting thread's
    /// leftover captures, from its thread-local record).
    pub(crate) fn end_capture_of(&self, me: std::thread::ThreadId) -> Result<()> {
        {
            let mut open = lock(&self.capture_threads);
            let Some(i) = open.iter().position(|(t, _)| *t == me) else {
                return Err(Error::InvalidArgument(format!(
                    "end_capture: no capture begun on this thread is under way on device {}",
                    self.device
                )));
            };
            open[i].1 -= 1;
            if open[i].1 == 0 {
                open.swap_remove(i);
            }
        }
        if let Some(pool) = &self.pool {
            pool.end_capture();
        }
        if self.graphs.watching() {
            let raw = self.live_raw();
            if raw != 0 {
                self.bury();
                self.graphs.end(self.driver(), raw);
            }
        }
        Ok(())
    }

    /// The capture `stream` takes part in keeps its memory for its graph
    /// (see [`Runtime::capture_started`](crate::Runtime::capture_started)),
    /// which holds `ctx` until it is destroyed.
    ///
    /// # Safety
    /// As [`GraphMemory::start`], for a stream of `ctx`.
    pub(crate) unsafe fn capture_started(
        &self,
        ctx: &impl Handle,
        stream: RawStream,
    ) -> Result<()> {
        self.bury();
        // SAFETY: this fn's contract.
        unsafe {
            self.graphs
                .start(self.driver(), ctx.raw(), ctx.keeper(), stream)
        }
    }

    /// Whether a capture begun here is under way (a device without a pool
    /// keeps the record too).
    pub(crate) fn capturing(&self) -> bool {
        !lock(&self.capture_threads).is_empty()
    }

    /// Cap the bytes the pool holds from the driver (`None`: no cap).
    pub(crate) fn set_pool_limit(&self, bytes: Option<usize>) {
        if let Some(pool) = &self.pool {
            pool.set_limit(bytes.unwrap_or(usize::MAX));
        }
    }

    /// This device's segments for a [`Snapshot`](crate::Snapshot): the
    /// pool's allocations and the history's allocations outside it.
    pub(crate) fn segments(
        &self,
        live: &std::collections::HashMap<DevicePtr, crate::history::Live>,
    ) -> Vec<crate::Segment> {
        let pool = self
            .pool
            .as_ref()
            .map(Pool::allocations)
            .unwrap_or_default();
        crate::Segment::of_device(self.device, pool, live)
    }

    /// `None` if `address` is not in this device's pool; else the pool
    /// block handed out that holds it (start and size), if one does.
    pub(crate) fn pool_block(&self, address: DevicePtr) -> Option<Option<(DevicePtr, usize)>> {
        self.pool.as_ref()?.used_block(address)
    }

    /// Driver allocations the pool holds (cached or handed out).
    pub(crate) fn pool_held_blocks(&self) -> usize {
        self.pool.as_ref().map_or(0, Pool::held_blocks)
    }

    /// The primary context was retained: its scheduling flags tell the pool
    /// how its fence waits (a blocking sync spends no CPU while the GPU is
    /// busy). A failed read leaves the pool as it was.
    pub(crate) fn context_retained(&self) {
        if let (Some(pool), Ok(s)) = (&self.pool, self.driver().primary_context_state(self.device))
        {
            pool.set_blocking_sync(s.blocking_sync());
        }
    }

    /// Whether the pool reads its GPU as busy now (false without a pool).
    pub(crate) fn pool_reads_busy(&self) -> bool {
        self.pool.as_ref().is_some_and(Pool::gpu_busy)
    }

    /// The pool by size class (empty without a pool).
    pub(crate) fn class_stats(&self) -> Vec<ClassStats> {
        self.pool
            .as_ref()
            .map(Pool::class_stats)
            .unwrap_or_default()
    }

    pub(crate) fn stats(&self) -> DeviceStats {
        let pool = self.pool.as_ref();
        // One look at what the pool holds: its bytes, peak and segments agree.
        let (held, peak, segments) = pool.map(Pool::held_stats).unwrap_or_default();
        let stats = DeviceStats::combine(
            self.device,
            &self.counters,
            pool.map(Pool::stats).unwrap_or_default(),
            held,
            peak,
            pool.map(Pool::limit).filter(|l| *l != usize::MAX),
            pool.map(Pool::host_stats).unwrap_or_default(),
        );
        DeviceStats { segments, ..stats }
    }

    pub(crate) fn reset_peak(&self) {
        self.counters.reset_peak();
        if let Some(p) = &self.pool {
            p.reset_peak();
        }
    }
}
