//! [`Runtime`]: one driver, its contexts, the pointer registry and the
//! statistics. Python uses [`Runtime::global`]; Rust code and tests can make
//! their own (for example over a [`SimDriver`](crate::SimDriver)).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::context::Context;
use crate::driver::{
    self, DevicePtr, Driver, DriverChoice, DriverKind, MemoryType, RawContext, RawStream, SimDriver,
};
use crate::error::{Error, Result};
use crate::ipc::Ipc;
use crate::memory::{Client, DevicePointer, KeepAlive};
use crate::pool::{Allocation, Block, ClassStats, Pool, PoolConfig};
use crate::registry::{Registration, Registry};
use crate::track::{Outstanding, Tracker};

/// Allocation counters of one device (allocations made outside the pool).
#[derive(Default, Debug)]
pub(crate) struct DeviceCounters {
    pub live_bytes: AtomicUsize,
    pub live_count: AtomicUsize,
    pub peak_bytes: AtomicUsize,
    pub alloc_count: AtomicU64,
    /// Live bytes, live count and allocations per client.
    clients: [[AtomicU64; 3]; 4],
}

impl DeviceCounters {
    /// Count a driver allocation of `size` bytes (pool blocks are counted by
    /// the pool).
    pub(crate) fn allocated(&self, size: usize, client: Client) {
        self.alloc_count.fetch_add(1, Ordering::Relaxed);
        self.live_count.fetch_add(1, Ordering::Relaxed);
        let live = self.live_bytes.fetch_add(size, Ordering::Relaxed) + size;
        self.peak_bytes.fetch_max(live, Ordering::Relaxed);
        let [bytes, count, allocs] = &self.clients[client.index()];
        bytes.fetch_add(size as u64, Ordering::Relaxed);
        count.fetch_add(1, Ordering::Relaxed);
        allocs.fetch_add(1, Ordering::Relaxed);
    }

    /// Count the release of a driver allocation.
    pub(crate) fn released(&self, size: usize, client: Client) {
        self.live_count.fetch_sub(1, Ordering::Relaxed);
        self.live_bytes.fetch_sub(size, Ordering::Relaxed);
        let [bytes, count, _] = &self.clients[client.index()];
        bytes.fetch_sub(size as u64, Ordering::Relaxed);
        count.fetch_sub(1, Ordering::Relaxed);
    }

    fn client_stats(&self, client: Client) -> ClientStats {
        let [bytes, count, allocs] = &self.clients[client.index()];
        ClientStats {
            live_bytes: bytes.load(Ordering::Relaxed) as usize,
            live_count: count.load(Ordering::Relaxed) as usize,
            alloc_count: allocs.load(Ordering::Relaxed),
        }
    }

    /// A reset: nothing is live any more.
    fn forget_live(&self) {
        self.live_bytes.store(0, Ordering::Relaxed);
        self.live_count.store(0, Ordering::Relaxed);
        for [bytes, count, _] in &self.clients {
            bytes.store(0, Ordering::Relaxed);
            count.store(0, Ordering::Relaxed);
        }
    }
}

/// One client's share of a device's allocations ([`Client`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Bytes in its live allocations.
    pub live_bytes: usize,
    /// Its live allocations.
    pub live_count: usize,
    /// Allocations it made so far.
    pub alloc_count: u64,
}

impl std::ops::AddAssign for ClientStats {
    fn add_assign(&mut self, o: ClientStats) {
        self.live_bytes += o.live_bytes;
        self.live_count += o.live_count;
        self.alloc_count += o.alloc_count;
    }
}

/// A snapshot of one device's allocation counters.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Device ordinal.
    pub device: usize,
    /// Bytes in live allocations made by gpuptr.
    pub live_bytes: usize,
    /// Number of live allocations made by gpuptr.
    pub live_count: usize,
    /// The most `live_bytes` has been.
    pub peak_bytes: usize,
    /// Allocations made so far.
    pub alloc_count: u64,
    /// Bytes the pool holds for reuse (ready, on a stream's list, or
    /// waiting for a fence).
    pub cached_bytes: usize,
    /// The part of `cached_bytes` waiting for a fence: freed blocks that
    /// queued work may still use.
    pub pending_bytes: usize,
    /// Allocations served from the pool's cache.
    pub pool_hits: u64,
    /// Allocations that went to the driver.
    pub pool_misses: u64,
    /// Fences completed (each makes a batch of freed blocks reusable).
    pub fences: u64,
    /// The live allocations per client, in [`Client::ALL`] order.
    pub clients: [ClientStats; 4],
    /// Bytes the pool holds from the driver (handed out or cached).
    pub pool_bytes: usize,
    /// The cap on `pool_bytes`, if one is set ([`Runtime::set_pool_limit`]).
    pub pool_limit: Option<usize>,
}

/// Everything gpuptr keeps about one device, in one place: the slot of its
/// live context, its pool (with the registry entries of the pool's blocks)
/// and its counters. Reset and teardown are its methods.
pub(crate) struct DeviceState {
    device: usize,
    slot: Mutex<Slot>,
    pool: Option<Pool>,
    counters: DeviceCounters,
    /// Registry entries of the pool's blocks, by address.
    block_regs: Mutex<HashMap<DevicePtr, Registration>>,
    /// Held while the cache goes back to the driver (a trim, or an
    /// out-of-memory retry), so no thread's trim holds blocks in transit
    /// that another thread's retry looks for.
    recovery: Mutex<()>,
    /// The raw handle of the live context (0: none), so the current
    /// device is found from `cuCtxGetCurrent` alone.
    raw: AtomicUsize,
}

/// A device's live context, and the runtime's own hold on it, if taken
/// ([`Runtime::held_context`]): while held, `live` always upgrades to it.
#[derive(Default)]
struct Slot {
    live: Weak<Context>,
    held: Option<Arc<Context>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DeviceState {
    fn new(device: usize, driver: &Arc<dyn Driver>, pool: Option<PoolConfig>) -> Self {
        DeviceState {
            device,
            slot: Mutex::new(Slot::default()),
            pool: pool.map(|c| Pool::new(c, driver.clone())),
            counters: DeviceCounters::default(),
            block_regs: Mutex::new(HashMap::new()),
            recovery: Mutex::new(()),
            raw: AtomicUsize::new(0),
        }
    }

    pub(crate) fn counters(&self) -> &DeviceCounters {
        &self.counters
    }

    pub(crate) fn pooled(&self) -> bool {
        self.pool.is_some()
    }

    fn existing(&self) -> Option<Arc<Context>> {
        lock(&self.slot).live.upgrade()
    }

    /// The live context, retained if none is; with `hold`, also kept alive
    /// by the runtime until a reset.
    fn context(&self, rt: &Arc<Runtime>, hold: bool) -> Result<Arc<Context>> {
        let mut slot = lock(&self.slot);
        let ctx = match slot.live.upgrade() {
            Some(ctx) => ctx,
            None => {
                let ctx = Arc::new(Context::retain(rt.clone(), self.device)?);
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

    /// A pool block of `size` bytes for an owner on `stream`; new driver
    /// allocations are registered, so their context resolves by address.
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
            // Out of memory even after the fence: return the cache to the
            // driver and ask again, while that frees something (other
            // threads may take what it frees), at least once. One thread
            // at a time.
            let _recovering = lock(&self.recovery);
            let (mut returned, mut rounds) = (0, 0);
            for round in 0..4 {
                let freed = self.trim_locked(ctx)?;
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
        let block = attempt?;
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

    /// Ask the pool's helper to grow `class` ahead of demand in `shard`
    /// (see [`PoolConfig::ahead_bytes`]). The job holds the context only
    /// weakly: it never keeps a context alive, so dropping the last user
    /// handle still gives the pool back at once, on the caller's thread.
    fn post_ahead(&self, pool: &Pool, ctx: &Arc<Context>, shard: usize, class: usize) {
        let (weak, raw) = (Arc::downgrade(ctx), ctx.raw());
        let rt = Arc::downgrade(ctx.runtime());
        let device = self.device;
        pool.post_ahead(Box::new(move || {
            if let Some(rt) = rt.upgrade() {
                rt.device_state(device)
                    .grow_ahead(&rt, &weak, raw, shard, class);
            }
        }));
    }

    /// On the pool's helper: grow `class` ahead in `shard`, register the
    /// new blocks, and stock them, while `weak` is still this device's live
    /// context. All under the recovery lock, which a reset and the last
    /// drop's teardown take before they give memory or the context back
    /// (each first clears `raw`): so the context stays retained through the
    /// driver call, and a reset or teardown waits for at most this one
    /// allocation and then frees its blocks with the rest.
    fn grow_ahead(
        &self,
        rt: &Arc<Runtime>,
        weak: &Weak<Context>,
        raw: RawContext,
        shard: usize,
        class: usize,
    ) {
        let Some(pool) = &self.pool else {
            return;
        };
        let _recovering = lock(&self.recovery);
        let live = weak.strong_count() > 0
            && self.raw.load(Ordering::Acquire) == raw
            && Weak::ptr_eq(&lock(&self.slot).live, weak);
        if !live || crate::fork::forked() {
            pool.ahead_over(shard, class);
            return;
        }
        let Some(a) = pool.grow_ahead(raw, shard, class) else {
            return;
        };
        self.register_weak(rt.registry(), weak, &a);
        // Under the recovery lock nothing can have reset the context since.
        pool.stock(shard, a);
        log::debug!(
            target: "gpuptr::pool",
            "device {}: grew ahead by {} bytes ({} block(s) of {} bytes)",
            self.device,
            a.bytes(),
            a.blocks,
            a.class
        );
    }

    /// Fill the pool with about `bytes` of ready blocks of `size`'s class;
    /// the bytes reserved (an unpooled device reserves nothing).
    pub(crate) fn reserve(&self, ctx: &Arc<Context>, size: usize, bytes: usize) -> Result<usize> {
        let Some(pool) = &self.pool else {
            return Ok(0);
        };
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

    /// Give a block back to the pool (see [`Pool::release`]).
    pub(crate) fn pool_release(
        &self,
        ctx: &Context,
        generation: u64,
        block: Block,
        size: usize,
        stream: Option<RawStream>,
        client: Client,
    ) {
        if let Some(pool) = &self.pool {
            pool.release(ctx.raw(), block, size, stream, client, || {
                ctx.generation() == generation
            });
        }
    }

    /// Register each block of a pool allocation with its own range, so a
    /// wrap inside one is bound-checked against that block, not its
    /// neighbours in the allocation.
    fn register(&self, ctx: &Arc<Context>, a: &Allocation) {
        self.register_weak(ctx.runtime().registry(), &Arc::downgrade(ctx), a);
    }

    /// [`DeviceState::register`] for a context held weakly (the pool's
    /// growth helper).
    fn register_weak(&self, registry: &Registry, ctx: &Weak<Context>, a: &Allocation) {
        let mut regs = lock(&self.block_regs);
        for p in a.block_addresses() {
            regs.insert(p, registry.insert_weak(p, a.class, ctx));
        }
    }

    fn unregister(&self, registry: &Registry, gone: impl IntoIterator<Item = Allocation>) {
        let mut regs = lock(&self.block_regs);
        for p in gone.into_iter().flat_map(Allocation::block_addresses) {
            if let Some(reg) = regs.remove(&p) {
                registry.remove(reg);
            }
        }
    }

    /// Return the pool's cache to the driver; the bytes freed.
    pub(crate) fn trim(&self, ctx: &Context) -> Result<usize> {
        let _recovering = lock(&self.recovery);
        self.trim_logged(ctx)
    }

    /// [`DeviceState::trim`], with the recovery lock held.
    fn trim_logged(&self, ctx: &Context) -> Result<usize> {
        let r = self.trim_locked(ctx);
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

    fn trim_locked(&self, ctx: &Context) -> Result<usize> {
        let Some(pool) = &self.pool else {
            return Ok(0);
        };
        let registry = ctx.runtime().registry();
        let (freed, r) = pool.trim(
            ctx.raw(),
            // Before the free: the driver may hand the addresses to another
            // thread's allocation, registered anew, at once after it.
            |a| self.unregister(registry, [*a]),
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
    fn reset(&self) -> Result<()> {
        let Some(ctx) = self.existing() else {
            return Ok(());
        };
        self.forget_raw(ctx.raw());
        // One recovery hold for the trim, the invalidation and the forget:
        // the pool's helper grows only under it, so it neither stocks
        // blocks of the old context nor records them after the forget.
        let recovering = lock(&self.recovery);
        let trimmed = self.trim_logged(&ctx);
        // Invalidate first: the pool then refuses blocks of this context,
        // and forgets the ones it has under the same locks.
        ctx.invalidate();
        if let Some(pool) = &self.pool {
            let held = pool.forget();
            self.unregister(ctx.runtime().registry(), held);
        }
        drop(recovering);
        // After the reset the old CUcontext is dead. Holders of the old
        // Context (stale pointers) release their retain when they go; the
        // runtime's own hold goes now, outside the lock.
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

    /// At the last drop of the current context: give the cache back before
    /// the retain that keeps it valid goes. A context detached by a reset no
    /// longer owns the pool (its successor does).
    pub(crate) fn teardown(&self, ctx: &Context) {
        // Before the release: the handle may name another context after it.
        self.forget_raw(ctx.raw());
        if ctx.generation() == 0 {
            let _ = self.trim(ctx);
        }
    }

    fn forget_raw(&self, raw: RawContext) {
        let _ = self
            .raw
            .compare_exchange(raw, 0, Ordering::AcqRel, Ordering::Relaxed);
    }

    fn stats(&self) -> DeviceStats {
        let c = &self.counters;
        let p = self.pool.as_ref().map(Pool::stats).unwrap_or_default();
        DeviceStats {
            device: self.device,
            live_bytes: c.live_bytes.load(Ordering::Relaxed) + p.live_bytes,
            live_count: c.live_count.load(Ordering::Relaxed) + p.live_count,
            // Peaks of the two kinds may not coincide: report the larger.
            peak_bytes: c.peak_bytes.load(Ordering::Relaxed).max(p.peak_bytes),
            alloc_count: c.alloc_count.load(Ordering::Relaxed) + p.alloc_count,
            cached_bytes: p.cached_bytes,
            pending_bytes: p.pending_bytes,
            pool_hits: p.hits,
            pool_misses: p.misses,
            fences: p.fences,
            clients: Client::ALL.map(|k| {
                let mut s = c.client_stats(k);
                s += p.clients[k.index()];
                s
            }),
            pool_bytes: self.pool.as_ref().map_or(0, Pool::held_bytes),
            pool_limit: self
                .pool
                .as_ref()
                .map(Pool::limit)
                .filter(|l| *l != usize::MAX),
        }
    }

    fn reset_peak(&self) {
        let c = &self.counters;
        c.peak_bytes
            .store(c.live_bytes.load(Ordering::Relaxed), Ordering::Relaxed);
        if let Some(p) = &self.pool {
            p.reset_peak();
        }
    }
}

/// The driver with everything gpuptr keeps about it.
pub struct Runtime {
    driver: Arc<dyn Driver>,
    registry: Registry,
    devices: Vec<DeviceState>,
    tracker: Tracker,
    ipc: Ipc,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("driver", &self.driver.kind())
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// A runtime over `driver`, with a caching pool per device.
    pub fn new(driver: Arc<dyn Driver>) -> Result<Arc<Self>> {
        Runtime::with_pool(driver, Some(PoolConfig::default()))
    }

    /// A runtime over `driver`; `None` allocates straight from the driver.
    pub fn with_pool(driver: Arc<dyn Driver>, pool: Option<PoolConfig>) -> Result<Arc<Self>> {
        crate::fork::watch();
        let n = driver.device_count()?;
        Ok(Arc::new(Runtime {
            devices: (0..n).map(|d| DeviceState::new(d, &driver, pool)).collect(),
            driver,
            registry: Registry::new(),
            tracker: Tracker::new(false),
            ipc: Ipc::default(),
        }))
    }

    /// The state of `device` (which must exist).
    #[inline]
    pub(crate) fn device_state(&self, device: usize) -> &DeviceState {
        &self.devices[device]
    }

    /// Whether `device` allocates through a caching pool.
    pub fn is_pooled(&self, device: usize) -> bool {
        self.devices.get(device).is_some_and(DeviceState::pooled)
    }

    /// Driver allocations `device`'s pool holds (cached or handed out).
    pub fn pool_held_blocks(&self, device: usize) -> usize {
        self.devices
            .get(device)
            .and_then(|d| d.pool.as_ref())
            .map_or(0, Pool::held_blocks)
    }

    /// Wait for the fence covering every block freed so far on `device`, so
    /// they are ready for reuse (the allocator never needs this; tests and
    /// callers about to measure do). `false` if the fence failed.
    pub fn flush_pool(self: &Arc<Self>, device: usize) -> Result<bool> {
        self.check_device(device)?;
        let d = &self.devices[device];
        match (&d.pool, d.existing()) {
            (Some(pool), Some(ctx)) => Ok(pool.flush(ctx.raw())),
            _ => Ok(true),
        }
    }

    /// Return every cached block of every device to the driver; the bytes freed.
    pub fn trim(self: &Arc<Self>) -> Result<usize> {
        crate::fork::check()?;
        let mut freed = 0;
        for d in &self.devices {
            if let Some(ctx) = d.existing() {
                freed += d.trim(&ctx)?;
            }
        }
        Ok(freed)
    }

    /// Prepare for `device`'s context being reset (numba's `cuda.close()`):
    /// cached blocks go back to the driver, and every live allocation turns
    /// stale. Stale pointers raise `InvalidPointer` on use, and freeing them
    /// is a no-op, so they never free memory a later allocation reuses.
    pub fn reset(self: &Arc<Self>, device: usize) -> Result<()> {
        crate::fork::check()?;
        self.check_device(device)?;
        self.devices[device].reset()
    }

    /// Cap the bytes `device`'s pool holds from the driver (`None`: no cap,
    /// the default), as RMM's maximum pool size: past it an allocation first
    /// reuses and returns the cache, then fails as out of memory. A device
    /// without a pool ignores it.
    pub fn set_pool_limit(&self, device: usize, bytes: Option<usize>) -> Result<()> {
        self.check_device(device)?;
        if let Some(pool) = &self.devices[device].pool {
            pool.set_limit(bytes.unwrap_or(usize::MAX));
        }
        Ok(())
    }

    /// The pool of `device` by size class (empty when it has no pool).
    pub fn class_stats(&self, device: usize) -> Result<Vec<ClassStats>> {
        self.check_device(device)?;
        Ok(self.devices[device]
            .pool
            .as_ref()
            .map(Pool::class_stats)
            .unwrap_or_default())
    }

    /// Make every device's peak equal to its live bytes now.
    pub fn reset_peak_stats(&self) {
        for d in &self.devices {
            d.reset_peak();
        }
    }

    /// Whether the CUDA driver can be used here, without opening it for
    /// use: its version, or why not.
    pub fn probe_cuda() -> Result<i32> {
        driver::probe_cuda()
    }

    /// Which driver is in use.
    pub fn driver_kind(&self) -> DriverKind {
        self.driver.kind()
    }

    /// The driver's CUDA version, as `cuDriverGetVersion` (13000 for 13.0).
    pub fn driver_version(&self) -> Result<i32> {
        self.driver.version()
    }

    /// The name of `device`.
    pub fn device_name(&self, device: usize) -> Result<String> {
        self.check_device(device)?;
        self.driver.device_name(device)
    }

    /// The total memory of `device`, in bytes.
    pub fn device_total_memory(&self, device: usize) -> Result<usize> {
        self.check_device(device)?;
        self.driver.device_total_memory(device)
    }

    /// `cuDevicePrimaryCtxGetState(device)`: `(flags, active)`.
    pub fn primary_context_state(&self, device: usize) -> Result<(u32, bool)> {
        self.check_device(device)?;
        let s = self.driver.primary_context_state(device)?;
        Ok((s.flags, s.active))
    }

    /// The simulator, when it is the driver (tests reach its fault
    /// injection and counters through this).
    pub fn sim(&self) -> Option<&SimDriver> {
        self.driver.as_sim()
    }

    /// The process-wide runtime, over the driver `GPUPTR_DRIVER` names
    /// (`auto`/`cuda`/`sim`). Opened on first use; a failure is remembered.
    pub fn global() -> Result<&'static Arc<Runtime>> {
        crate::fork::check()?;
        static GLOBAL: OnceLock<Result<Arc<Runtime>>> = OnceLock::new();
        GLOBAL
            .get_or_init(|| {
                let pool = match std::env::var("GPUPTR_POOL").as_deref() {
                    Ok("0") | Ok("off") => None,
                    _ => Some(PoolConfig {
                        // Bytes; 0 turns growth ahead of demand off.
                        ahead_bytes: crate::error::env_usize(
                            "GPUPTR_POOL_AHEAD",
                            PoolConfig::default().ahead_bytes,
                        )?,
                        ..PoolConfig::default()
                    }),
                };
                let rt = Runtime::with_pool(driver::open(DriverChoice::from_env()?)?, pool)?;
                if matches!(std::env::var("GPUPTR_TRACK").as_deref(), Ok("1") | Ok("on")) {
                    rt.set_tracking(true);
                }
                Ok(rt)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The driver.
    #[inline]
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// The pointer→context registry.
    #[inline]
    pub(crate) fn registry(&self) -> &Registry {
        &self.registry
    }

    #[inline]
    pub(crate) fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    pub(crate) fn ipc(&self) -> &Ipc {
        &self.ipc
    }

    /// Turn the leak report on or off (`GPUPTR_TRACK=1` turns it on for the
    /// global runtime). On, every allocation records where it was made until
    /// it is released; allocations made while it was off are not listed.
    pub fn set_tracking(&self, on: bool) {
        self.tracker.set_enabled(on);
    }

    /// Whether allocations record where they were made.
    #[inline]
    pub fn tracking(&self) -> bool {
        self.tracker.enabled()
    }

    /// The live allocations made while tracking was on, grouped by where
    /// they were made, the most bytes first.
    pub fn outstanding(&self) -> Vec<Outstanding> {
        self.tracker.outstanding()
    }

    /// Number of address ranges the pointer→context registry knows.
    pub fn registered_ranges(&self) -> usize {
        self.registry.len()
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// `Ok` if `device` exists, else [`Error::InvalidArgument`].
    pub fn check_device(&self, device: usize) -> Result<()> {
        if device >= self.device_count() {
            return Err(Error::InvalidArgument(format!(
                "device {device} does not exist ({} device(s) present)",
                self.device_count()
            )));
        }
        Ok(())
    }

    /// The one live context of `device`, retaining its primary context if no
    /// holder has it now.
    pub fn context(self: &Arc<Self>, device: usize) -> Result<Arc<Context>> {
        crate::fork::check()?;
        self.check_device(device)?;
        self.devices[device].context(self, false)
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
        self.devices[device].context(self, true)
    }

    /// The device of the calling thread's current context, or 0 when none
    /// is current (CuPy's and numba's default device).
    pub fn current_device(&self) -> Result<usize> {
        let raw = self.driver.current_context()?;
        if raw == 0 {
            return Ok(0);
        }
        // A live context gpuptr retained: no second driver call.
        if let Some(d) = self
            .devices
            .iter()
            .position(|d| d.raw.load(Ordering::Acquire) == raw)
        {
            return Ok(d);
        }
        Ok(self.driver.current_device()?.unwrap_or(0))
    }

    /// The live context of `device` if some holder keeps one, without
    /// retaining a new one.
    pub fn existing_context(&self, device: usize) -> Option<Arc<Context>> {
        self.devices.get(device).and_then(DeviceState::existing)
    }

    /// The context that `address` belongs to, resolved from the address
    /// itself (never from the current context): first the registry of known
    /// ranges, then `cuPointerGetAttributes`. Host and unregistered addresses
    /// are [`Error::InvalidPointer`].
    pub fn context_of(self: &Arc<Self>, address: DevicePtr) -> Result<Arc<Context>> {
        if let Some(ctx) = self.registry.lookup(address) {
            return Ok(ctx);
        }
        Ok(self.resolve(address)?.0)
    }

    /// The context of `address` from the driver alone (no registry): what a
    /// registry hit saves.
    pub fn query_context(self: &Arc<Self>, address: DevicePtr) -> Result<Arc<Context>> {
        Ok(self.resolve(address)?.0)
    }

    /// Ask the driver about `address`: its context and allocation range.
    pub(crate) fn resolve(
        self: &Arc<Self>,
        address: DevicePtr,
    ) -> Result<(Arc<Context>, DevicePtr, usize)> {
        if address == 0 {
            return Err(Error::InvalidPointer("null address".into()));
        }
        let attrs = self
            .driver
            .pointer_attributes(address)
            .map_err(|e| match e {
                Error::Cuda { code, .. } if code == crate::error::CUDA_ERROR_INVALID_VALUE => {
                    Error::InvalidPointer(format!("{address:#x} is not CUDA memory ({e})"))
                }
                other => other,
            })?;
        match attrs.memory_type {
            MemoryType::Device => {}
            // Mapped (zero-copy) host memory is device memory to a kernel, as
            // numba treats it.
            MemoryType::Host if attrs.device_accessible => {}
            MemoryType::Host => {
                return Err(Error::InvalidPointer(format!(
                    "{address:#x} is page-locked host memory not mapped into the device"
                )))
            }
            MemoryType::Unregistered => {
                return Err(Error::InvalidPointer(format!(
                    "{address:#x} is not device memory (host or unregistered address)"
                )))
            }
        }
        let ctx = self.context(attrs.device)?;
        Ok((ctx, attrs.range_start, attrs.range_size))
    }

    /// Wrap `[address, address+size)` of memory gpuptr does not own, keeping
    /// `keepalive` (its owner) until the pointer is released.
    ///
    /// The range is checked against what the driver knows: it must lie in
    /// one device-accessible allocation, and its context is the one the
    /// memory lives in (`context`, numba's `MemoryPointer(ctx, ...)` call
    /// shape, is used only for a null, empty range). A registry hit costs a
    /// map lookup; a miss asks the driver once and registers the
    /// allocation's range for as long as this pointer lives.
    pub fn wrap(
        self: &Arc<Self>,
        address: DevicePtr,
        size: usize,
        context: Option<Arc<Context>>,
        keepalive: Option<KeepAlive>,
    ) -> Result<Arc<DevicePointer>> {
        crate::fork::check()?;
        let end = address.checked_add(size as u64).ok_or_else(|| {
            Error::InvalidPointer(format!("{address:#x} + {size} overflows the address space"))
        })?;
        if address == 0 {
            if size != 0 {
                return Err(Error::InvalidPointer(format!(
                    "null address with a size of {size} bytes"
                )));
            }
            let ctx = match context {
                Some(c) => c,
                None => {
                    return Err(Error::InvalidPointer(
                        "a null address has no context; pass one explicitly".into(),
                    ))
                }
            };
            return Ok(DevicePointer::foreign(ctx, 0, 0, None, keepalive));
        }
        let out_of_range = |start: DevicePtr, stop: DevicePtr| {
            Error::InvalidPointer(format!(
                "[{address:#x}, {end:#x}) runs past its allocation [{start:#x}, {stop:#x})"
            ))
        };
        if let Some((ctx, start, stop)) = self.registry.lookup_range(address) {
            if end > stop {
                return Err(out_of_range(start, stop));
            }
            return Ok(DevicePointer::foreign(ctx, address, size, None, keepalive));
        }
        let (ctx, start, range) = self.resolve(address)?;
        let stop = start + range as u64;
        if range != 0 && end > stop {
            return Err(out_of_range(start, stop));
        }
        let reg = (range != 0).then(|| self.registry.insert(start, range, &ctx));
        Ok(DevicePointer::foreign(ctx, address, size, reg, keepalive))
    }

    /// `Ok` if `[address, address+size)` is managed (unified) memory inside
    /// one allocation, as far as the driver says: memory the host may read
    /// and write at the same address.
    pub fn check_managed(&self, address: DevicePtr, size: usize) -> Result<()> {
        crate::fork::check()?;
        if size == 0 {
            return Ok(());
        }
        let a = self.driver.pointer_attributes(address)?;
        let inside = a.range_size == 0
            || address
                .checked_add(size as u64)
                .is_some_and(|end| end <= a.range_start + a.range_size as u64);
        if !a.is_managed || !inside {
            return Err(Error::InvalidPointer(format!(
                "[{address:#x}, +{size}) is not managed memory in one allocation"
            )));
        }
        Ok(())
    }

    /// Wrap `[address, address+size)` in `context` without asking the
    /// driver (for memory whose address the driver just handed out).
    ///
    /// # Safety
    /// The range is live device-accessible memory of `context` for as long
    /// as the pointer (and its views) may be used: its memory operations
    /// write there.
    pub unsafe fn wrap_unchecked(
        self: &Arc<Self>,
        address: DevicePtr,
        size: usize,
        context: Arc<Context>,
        keepalive: Option<KeepAlive>,
    ) -> Result<Arc<DevicePointer>> {
        if address.checked_add(size as u64).is_none() || (address == 0 && size != 0) {
            return Err(Error::InvalidPointer(format!(
                "[{address:#x}, +{size}) is not a valid range"
            )));
        }
        Ok(DevicePointer::foreign(
            context, address, size, None, keepalive,
        ))
    }

    /// Wrap the memory a strided array spans (see [`Layout`](crate::Layout)) whose element
    /// 0 is at `address`; the returned view starts at element 0. An empty
    /// layout gives a null view in the current device's context.
    pub fn wrap_layout(
        self: &Arc<Self>,
        address: DevicePtr,
        layout: &crate::Layout,
        keepalive: Option<KeepAlive>,
    ) -> Result<crate::View> {
        crate::fork::check()?;
        if layout.span == 0 {
            let ctx = self.context(self.current_device()?)?;
            return Ok(crate::View::from(self.wrap(0, 0, Some(ctx), keepalive)?));
        }
        if address == 0 {
            return Err(Error::InvalidPointer(
                "a non-empty array has a null data pointer".into(),
            ));
        }
        let start = address.checked_add_signed(layout.lo).ok_or_else(|| {
            Error::InvalidPointer("negative strides reach below address 0".into())
        })?;
        let mem = self.wrap(start, layout.span, None, keepalive)?;
        crate::View::from(mem).view((-layout.lo) as usize, None)
    }

    /// Allocation statistics of every device.
    pub fn stats(&self) -> Vec<DeviceStats> {
        self.devices.iter().map(DeviceState::stats).collect()
    }
}
