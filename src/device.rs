//! [`DeviceState`]: everything gpuptr keeps about one device, with one
//! owner. PyTorch's `DeviceCachingAllocator` is the model: one object per
//! device owns its context slot and hold, its reset epoch, its pool, the
//! registry entries of the pool's blocks, its counters, and the
//! out-of-memory ladder. Reset and teardown are its methods.
//!
//! It holds the [`Services`] it needs (the driver, the registry, the leak
//! report, the IPC liveness file), never the [`Runtime`](crate::Runtime):
//! calls go from the runtime down to the device, from the device to the
//! pool, and from the pool to the driver.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::context::Context;
use crate::driver::{DevicePtr, Driver, RawContext, RawStream};
use crate::error::{Error, Result};
use crate::graph::GraphMemory;
use crate::history::History;
use crate::ipc::liveness::Exports;
use crate::pool::{Allocation, Block, HostBlock, Pool, PoolConfig};
use crate::registry::{ReadOnlyRanges, Registry};
use crate::stats::{ClassStats, Client, DeviceCounters, DeviceStats};
use crate::sync::lock;
use crate::track::{Tracker, Watch};

/// What every device of a runtime shares: the driver and the books kept
/// across devices.
pub(crate) struct Services {
    pub(crate) driver: Arc<dyn Driver>,
    /// The pointer→context registry.
    pub(crate) registry: Registry<Context>,
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
    slot: Mutex<Slot>,
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
    /// The reset epoch: bumped when the context is reset (or invalidated);
    /// memory made in an older epoch is gone, and is never freed.
    epoch: AtomicU64,
    /// Pool blocks that CUDA graphs keep.
    graphs: GraphMemory,
}

/// A device's live context, and the runtime's own hold on it, if taken
/// ([`DeviceState::context`] with `hold`): while held, `live` always
/// upgrades to it.
#[derive(Default)]
struct Slot {
    live: Weak<Context>,
    held: Option<Arc<Context>>,
}

impl DeviceState {
    pub(crate) fn new(device: usize, services: Arc<Services>, pool: Option<PoolConfig>) -> Self {
        DeviceState {
            device,
            pool: pool.map(|c| {
                let s = services.clone();
                Pool::new(c, services.driver.clone()).on_segments(Box::new(move |made, a| {
                    if s.watch.on(Watch::HISTORY) {
                        s.history.segment(made, device, a.base, a.bytes());
                    }
                }))
            }),
            services,
            slot: Mutex::new(Slot::default()),
            counters: DeviceCounters::default(),
            recovery: Mutex::new(()),
            raw: AtomicUsize::new(0),
            epoch: AtomicU64::new(0),
            graphs: GraphMemory::default(),
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

    /// The live context, if some holder keeps one.
    pub(crate) fn existing(&self) -> Option<Arc<Context>> {
        lock(&self.slot).live.upgrade()
    }

    /// The live context, retained if none is; with `hold`, also kept alive
    /// by the device until a reset or [`DeviceState::release_hold`].
    pub(crate) fn context(self: &Arc<Self>, hold: bool) -> Result<Arc<Context>> {
        let mut slot = lock(&self.slot);
        let ctx = match slot.live.upgrade() {
            Some(ctx) => ctx,
            None => {
                let ctx = Arc::new(Context::retain(self.clone())?);
                slot.live = Arc::downgrade(&ctx);
                self.raw.store(ctx.raw(), Ordering::Release);
                log::debug!(
                    target: "gpuptr::context",
                    "device {}: retained the primary context {:#x}",
                    self.device,
                    ctx.raw()
                );
                ctx
            }
        };
        if hold && slot.held.is_none() {
            slot.held = Some(ctx.clone());
        }
        Ok(ctx)
    }

    /// Let the device's own hold on its context go (its holders keep it).
    pub(crate) fn release_hold(&self) {
        let held = lock(&self.slot).held.take();
        drop(held);
    }

    /// A pool block of `size` bytes for an owner on `stream`, up the
    /// out-of-memory ladder as far as it takes:
    /// 1. the cache, or the driver (the pool's fast path and growth);
    /// 2. the driver refused: the fence, then a cached block that it made
    ///    safe (the pool's rung, [`Pool::alloc`]);
    /// 3. still none: the cache goes back to the driver, and the pool asks
    ///    again, while that frees something (other threads may take what it
    ///    frees), at least once, one thread at a time;
    /// 4. then [`Error::OutOfMemory`].
    ///
    /// New driver allocations are registered, so their context resolves by
    /// address.
    pub(crate) fn pool_alloc(
        &self,
        ctx: &Arc<Context>,
        size: usize,
        stream: Option<RawStream>,
        client: Client,
    ) -> Result<Block> {
        let pool = self.pool.as_ref().expect("pooled device");
        let mut attempt = pool.alloc(ctx.raw(), size, stream, self.device, client);
        if attempt.as_ref().is_err_and(Error::is_oom) {
            self.counters.alloc_retries.fetch_add(1, Ordering::Relaxed);
            let _recovering = lock(&self.recovery);
            let (mut returned, mut rounds) = (0, 0);
            for round in 0..4 {
                let freed = self.trim_locked(ctx, false)?;
                returned += freed;
                rounds += 1;
                if freed == 0 && round > 0 {
                    break;
                }
                attempt = pool.alloc(ctx.raw(), size, stream, self.device, client);
                if !attempt.as_ref().is_err_and(Error::is_oom) {
                    break;
                }
            }
            log::info!(
                target: "gpuptr::pool",
                "device {}: out of memory for {} bytes; returned {} bytes of cache to the driver in {} round(s), then {}",
                self.device,
                size,
                returned,
                rounds,
                if attempt.is_ok() { "succeeded" } else { "failed" }
            );
        }
        let block = attempt.map_err(|e| match e.is_oom() {
            true => {
                self.counters.ooms.fetch_add(1, Ordering::Relaxed);
                self.out_of_memory(ctx, size)
            }
            false => e,
        })?;
        if block.ahead {
            self.post_ahead(pool, ctx, block.shard as usize, block.class);
        }
        if let Some(new) = block.new_allocation {
            self.register(ctx, &new);
            log::debug!(
                target: "gpuptr::pool",
                "device {}: the pool grew by {} bytes ({} block(s) of {} bytes) for a {}-byte allocation",
                self.device,
                new.bytes(),
                new.blocks,
                new.class,
                size
            );
        }
        Ok(block)
    }

    /// The out-of-memory error for `size` bytes, naming what the pool holds
    /// (in use, cached, kept by CUDA graphs), its limit if one is set, and
    /// what the device has free, as PyTorch's message does.
    #[cold]
    fn out_of_memory(&self, ctx: &Context, size: usize) -> Error {
        use crate::error::bytes;
        let mut detail = String::new();
        if let Some(pool) = &self.pool {
            let s = pool.stats();
            detail = format!(
                "; gpuptr's pool holds {} from the driver ({} in use, {} cached, {} kept by CUDA graphs)",
                bytes(pool.held_bytes()),
                bytes(s.live_bytes),
                bytes(s.cached_bytes),
                bytes(self.graphs.kept_bytes())
            );
            if pool.limit() != usize::MAX {
                detail += &format!(", and its limit is {}", bytes(pool.limit()));
            }
        }
        // cuMemGetInfo is allowed even during a capture.
        let info = ctx.memory_info().ok();
        if let Some((free, total)) = info {
            detail += &format!("; the device has {} free of {}", bytes(free), bytes(total));
        }
        detail += &self.oom_snapshot(size, info.map_or(0, |i| i.0));
        Error::OutOfMemory {
            device: self.device,
            requested: size,
            detail,
        }
    }

    /// An allocation outside the pool failed with `e`: if it ran out of
    /// memory, the typed error, with the history's `oom` entry and the
    /// snapshot (see [`DeviceState::oom_snapshot`]).
    #[cold]
    pub(crate) fn driver_oom(&self, ctx: &Context, e: Error, size: usize) -> Error {
        match e.oom_on(self.device, size) {
            Error::OutOfMemory {
                device,
                requested,
                mut detail,
            } => {
                let free = ctx.memory_info().map_or(0, |i| i.0);
                detail += &self.oom_snapshot(size, free);
                Error::OutOfMemory {
                    device,
                    requested,
                    detail,
                }
            }
            e => e,
        }
    }

    /// Out of memory for `size` bytes with `device_free` free: the
    /// history's `oom` entry (while it records, or a snapshot path is set),
    /// then the snapshot of this device written to the path set with
    /// [`Runtime::set_oom_snapshot`](crate::Runtime::set_oom_snapshot), if
    /// any. What the error message adds: the file written, or why it could
    /// not be (also logged as a warning; never an error of its own). No
    /// lock of the pool is held while the file is written.
    #[cold]
    fn oom_snapshot(&self, size: usize, device_free: usize) -> String {
        let s = &self.services;
        let path = s.history.oom_snapshot();
        if s.watch.on(Watch::HISTORY) || path.is_some() {
            s.history.oom(self.device, size, device_free);
        }
        let Some(path) = path else {
            return String::new();
        };
        let live = s.history.live();
        let snapshot = crate::Snapshot {
            segments: self.segments(&live),
            device_traces: s.history.traces(self.device + 1),
            max_entries: s.history.max_entries(),
        };
        drop(live);
        match snapshot.write(&path) {
            Ok(()) => {
                log::info!(
                    target: "gpuptr::pool",
                    "device {}: out of memory; wrote a memory snapshot to {}",
                    self.device,
                    path.display()
                );
                format!("; a memory snapshot was written to {}", path.display())
            }
            Err(e) => {
                log::warn!(
                    target: "gpuptr::pool",
                    "device {}: out of memory; could not write a memory snapshot to {}: {e}",
                    self.device,
                    path.display()
                );
                format!(
                    "; a memory snapshot could not be written to {}: {e}",
                    path.display()
                )
            }
        }
    }

    /// Ask the pool's helper to grow `class` ahead of demand in `shard`
    /// (see [`PoolConfig::ahead_bytes`]). The job holds the device and the
    /// context only weakly: it never keeps a context alive, so dropping the
    /// last user handle still gives the pool back at once, on the caller's
    /// thread.
    fn post_ahead(&self, pool: &Pool, ctx: &Arc<Context>, shard: usize, class: usize) {
        let me = Arc::downgrade(ctx.state());
        let (weak, raw, epoch) = (Arc::downgrade(ctx), ctx.raw(), ctx.born());
        pool.post_ahead(Box::new(move || {
            if let Some(me) = me.upgrade() {
                me.grow_ahead(&weak, raw, epoch, shard, class);
            }
        }));
    }

    /// On the pool's helper: grow `class` ahead in `shard`, register the
    /// new blocks, and stock them, while `weak` (whose handle is `raw`) is
    /// still this device's live context in `epoch`. All under the recovery lock, which a reset and
    /// the last drop's teardown take before they give memory or the
    /// context back: so the context stays retained through the driver
    /// call, and a reset or teardown waits for at most this one allocation
    /// and then frees its blocks with the rest.
    fn grow_ahead(
        &self,
        weak: &Weak<Context>,
        raw: RawContext,
        epoch: u64,
        shard: usize,
        class: usize,
    ) {
        let Some(pool) = &self.pool else {
            return;
        };
        let _recovering = lock(&self.recovery);
        // A live context born in the current epoch is the slot's (a
        // successor needs this one gone, or a reset: a new epoch; a context
        // kept across a reset was born in an older one), and one whose
        // handle is still the device's is not being reset (a reset clears
        // the handle before it takes the recovery lock).
        let live = weak.strong_count() > 0 && self.epoch() == epoch && self.live_raw() == raw;
        if !live || crate::fork::forked() {
            pool.ahead_over(shard, class);
            return;
        }
        let grown = pool.grow_ahead(raw, shard, class, |a| self.register_weak(weak, a));
        if let Some(a) = grown {
            log::debug!(
                target: "gpuptr::pool",
                "device {}: grew ahead by {} bytes ({} block(s) of {} bytes)",
                self.device,
                a.bytes(),
                a.blocks,
                a.class
            );
        }
    }

    /// Fill the pool with about `bytes` of ready blocks of `size`'s class;
    /// the bytes reserved (an unpooled device reserves nothing).
    pub(crate) fn reserve(&self, ctx: &Arc<Context>, size: usize, bytes: usize) -> Result<usize> {
        Error::check_request(self.device, size)?;
        let Some(pool) = &self.pool else {
            return Ok(0);
        };
        // More than the device has free would take all of it and still
        // fall short: refused whole, naming what there is.
        if let Ok((free, total)) = ctx.memory_info() {
            if bytes > free {
                use crate::error::bytes as human;
                return Err(Error::OutOfMemory {
                    device: self.device,
                    requested: bytes,
                    detail: format!(
                        " for a reservation; the device has {} free of {} (reserve less, or a share such as \"80%\" of what is free)",
                        human(free),
                        human(total)
                    ),
                });
            }
        }
        let (made, r) = pool.reserve(ctx.raw(), size, bytes);
        for a in &made {
            self.register(ctx, a);
        }
        let reserved = made.iter().map(Allocation::bytes).sum();
        log::debug!(
            target: "gpuptr::pool",
            "device {}: reserved {} of {} bytes in blocks of {} bytes ({} driver allocation(s))",
            self.device,
            reserved,
            bytes,
            crate::size_class(size.max(1)),
            made.len()
        );
        match r {
            // Out of memory part way: what was reserved stays; say so only
            // when nothing could be.
            Err(e) if e.is_oom() && reserved > 0 => Ok(reserved),
            r => r.map(|()| reserved),
        }
    }

    /// Give the block at `address` (of size class `class`, from shard
    /// `shard`, handed out for `size` bytes in `epoch`) back to the pool
    /// (see [`Pool::release`]); a block of an older epoch is refused, its
    /// memory gone with the reset.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pool_release(
        &self,
        raw: RawContext,
        epoch: u64,
        address: DevicePtr,
        class: usize,
        shard: u32,
        size: usize,
        stream: Option<RawStream>,
        client: Client,
    ) {
        if let Some(pool) = &self.pool {
            let block = Block {
                address,
                class,
                shard,
                new_allocation: None,
                ahead: false,
            };
            pool.release(raw, block, size, stream, client, || self.epoch() == epoch);
        }
    }

    /// Register each block of a pool allocation with its own range, so a
    /// wrap inside one is bound-checked against that block, not its
    /// neighbours in the allocation. The registry is the one record of
    /// these entries: they go by address, with the context that made them.
    fn register(&self, ctx: &Arc<Context>, a: &Allocation) {
        self.register_weak(&Arc::downgrade(ctx), a);
    }

    /// [`DeviceState::register`] for a context held weakly (the pool's
    /// growth helper).
    fn register_weak(&self, ctx: &Weak<Context>, a: &Allocation) {
        let registry = &self.services.registry;
        for p in a.block_addresses() {
            registry.insert_weak(p, a.class, ctx);
        }
    }

    /// Forget the registry entries of the blocks of `gone`, whichever
    /// context made them (one kept across a reset allocates too).
    fn unregister(&self, gone: impl IntoIterator<Item = Allocation>) {
        let addresses = gone.into_iter().flat_map(Allocation::block_addresses);
        self.services.registry.remove_at(addresses);
    }

    /// A pinned host block of `size` bytes made with `flags`
    /// (`HOST_ALLOC_*`) from the pool's host cache; `None` when the device
    /// has no pool or the size is not cached (the caller then asks the
    /// driver itself). A context of an epoch a reset ended (before or
    /// during the call) gets no block: the error a stale context's memory
    /// gives.
    pub(crate) fn host_alloc(
        &self,
        ctx: &Context,
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
    /// host cache, where it waits for the fence; a block of an older epoch
    /// is refused, its memory gone with the reset.
    pub(crate) fn host_release(&self, raw: RawContext, epoch: u64, block: HostBlock, size: usize) {
        if let Some(pool) = &self.pool {
            pool.host_release(raw, block, size, || self.epoch() == epoch);
        }
    }

    /// Return the pool's cache to the driver; the bytes freed.
    pub(crate) fn trim(&self, ctx: &Context) -> Result<usize> {
        let _recovering = lock(&self.recovery);
        self.trim_logged(ctx, false)
    }

    /// [`DeviceState::trim`], with the recovery lock held; `everything`
    /// when the context is ending (see [`Pool::trim`]).
    fn trim_logged(&self, ctx: &Context, everything: bool) -> Result<usize> {
        let r = self.trim_locked(ctx, everything);
        // The host cache too (not on the out-of-memory ladder: pinned
        // memory is the host's, not the device's).
        let r = match self
            .pool
            .as_ref()
            .map(|p| p.host_trim(ctx.raw(), everything))
        {
            Some((freed, host)) => r.and_then(|n| host.map(|()| n + freed)),
            None => r,
        };
        match &r {
            Ok(freed) => log::debug!(
                target: "gpuptr::pool",
                "device {}: trim returned {} bytes to the driver",
                self.device,
                freed
            ),
            Err(e) => log::warn!(
                target: "gpuptr::pool",
                "device {}: trim: a driver free failed ({e}); that memory stays cached",
                self.device
            ),
        }
        r
    }

    fn trim_locked(&self, ctx: &Context, everything: bool) -> Result<usize> {
        let Some(pool) = &self.pool else {
            return Ok(0);
        };
        let (freed, r) = pool.trim(
            ctx.raw(),
            everything,
            // Before the free: the driver may hand the addresses to another
            // thread's allocation, registered anew, at once after it.
            |a| self.unregister([*a]),
            // A failed free leaves the allocation cached: known again (unless
            // the context is going away).
            |a| {
                if let Some(live) = self.existing().filter(|c| std::ptr::eq(&**c, ctx)) {
                    self.register(&live, a);
                }
            },
        );
        let bytes = freed.iter().map(Allocation::bytes).sum();
        r.map(|()| bytes)
    }

    /// Prepare for the context being reset (numba's `cuda.close()`): the
    /// cache goes back to the driver, every live allocation turns stale, and
    /// the next use retains the primary context afresh. Never waits for the
    /// pool's fence thread.
    pub(crate) fn reset(&self) -> Result<()> {
        let Some(ctx) = self.existing() else {
            return Ok(());
        };
        self.forget_raw(ctx.raw());
        // One recovery hold for the trim, the new epoch and the forget: the
        // pool's helper grows only under it, so it neither stocks blocks of
        // the old context nor records them after the forget.
        let recovering = lock(&self.recovery);
        let trimmed = self.trim_logged(&ctx, true);
        // A new epoch first: the pool then refuses blocks of the old one,
        // and forgets the ones it has under the same locks.
        self.invalidate();
        // The history: the live allocations go before their segments.
        let recording = self.services.watch.on(Watch::HISTORY);
        self.services.history.forget_device(self.device, recording);
        if let Some(pool) = &self.pool {
            let held = pool.forget();
            self.unregister(held);
        }
        drop(recovering);
        // After the reset the old CUcontext is dead. Holders of the old
        // Context (stale pointers) release their retain when they go; the
        // device's own hold goes now, outside the lock.
        let old = std::mem::take(&mut *lock(&self.slot));
        drop(old);
        self.counters.forget_live();
        log::info!(
            target: "gpuptr::context",
            "device {}: context reset; its live allocations are stale from now on",
            self.device
        );
        trimmed.map(|_| ())
    }

    /// At the last drop of a context born in epoch `born`: give the cache
    /// back before the retain that keeps it valid goes. A context of an
    /// older epoch (detached by a reset) no longer owns the pool.
    pub(crate) fn teardown(&self, ctx: &Context, born: u64) {
        // Before the release: the handle may name another context after it.
        self.forget_raw(ctx.raw());
        if born == self.epoch() {
            let _recovering = lock(&self.recovery);
            let _ = self.trim_logged(ctx, true);
        }
    }

    fn forget_raw(&self, raw: RawContext) {
        let _ = self
            .raw
            .compare_exchange(raw, 0, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// Wait for the fence covering every block freed so far (`true` when
    /// there is nothing to wait for); `false` if it failed.
    pub(crate) fn flush(&self) -> bool {
        match (&self.pool, self.existing()) {
            (Some(pool), Some(ctx)) => pool.flush(ctx.raw()),
            _ => true,
        }
    }

    /// A stream capture begins (or ends) on this device: see
    /// [`Runtime::begin_capture`](crate::Runtime::begin_capture).
    pub(crate) fn begin_capture(&self) {
        if let Some(pool) = &self.pool {
            pool.begin_capture();
        }
    }

    pub(crate) fn end_capture(&self) {
        if let Some(pool) = &self.pool {
            pool.end_capture();
        }
        if self.graphs.watching() {
            if let Some(ctx) = self.existing() {
                self.graphs.end(&ctx);
            }
        }
    }

    pub(crate) fn capturing(&self) -> bool {
        self.pool.as_ref().is_some_and(Pool::capturing)
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

    /// Driver allocations the pool holds (cached or handed out).
    pub(crate) fn pool_held_blocks(&self) -> usize {
        self.pool.as_ref().map_or(0, Pool::held_blocks)
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
