//! The caching pool in front of `cuMemAlloc`, one per device.
//!
//! **The reuse rule.** numba's `memalloc` gets no stream, so a freed block
//! may still be in use by work queued on any stream. A freed block is first
//! *pending*. Before pending blocks are handed out again, the pool records
//! one event on the legacy default stream (a *fence*). The legacy stream
//! waits for all earlier work on every blocking stream, and all later work
//! on blocking streams (and on the legacy stream) waits for it. So whatever
//! the new owner queues on the legacy stream or on any blocking stream runs
//! after every use of the old owner. Work on non-blocking streams or the
//! per-thread default stream is not covered: synchronize such a stream
//! before dropping memory it uses.
//!
//! One fence covers a whole batch: it is recorded when a miss finds at least
//! [`PoolConfig::fence_count`] blocks or [`PoolConfig::fence_bytes`] pending,
//! or when the driver is out of memory. Smaller misses get fresh memory from
//! the driver, so in steady state one fence serves a batch of frees and the
//! common path makes no driver call.
//!
//! Blocks are whole `cuMemAlloc` allocations, never carved, so IPC
//! (`cuIpcGetMemHandle` on the block) works for pooled pointers.
//!
//! **Shards.** The cache is split into shards, each behind its own lock, so
//! threads do not queue on one mutex. A thread allocates from its own shard
//! (threads are dealt out to shards round-robin), and a block returns to the
//! shard it was handed out from, even when another thread frees it: the
//! allocating thread's next miss fences it, so producer/consumer patterns do
//! not strand memory. Each shard fences its own pending blocks, so the reuse
//! rule holds per shard. A miss looks in the other shards before it calls
//! the driver (fencing one whose batch is due), and out of memory fences and
//! searches every shard.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::context::Context;
use crate::driver::{DevicePtr, RawEvent};
use crate::error::Result;
use crate::registry::Registration;

/// How a pool batches fences and splits its cache.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Fence once this many blocks are pending (per shard).
    pub fence_count: usize,
    /// Fence once this many bytes are pending (per shard).
    pub fence_bytes: usize,
    /// Number of shards, rounded up to a power of two. The default is the
    /// number of CPUs, at most 16.
    pub shards: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            // One ~0.4 us event record per 32 frees; the byte cap bounds how
            // much memory waits for a fence.
            fence_count: 32,
            fence_bytes: 64 << 20,
            shards: std::thread::available_parallelism().map_or(1, |n| n.get().min(16)),
        }
    }
}

const MIN_CLASS: usize = 512;
const LARGE: usize = 256 << 20;
/// Classes up to [`LARGE`]: 512, then four per power of two.
const SMALL_CLASSES: usize = 1 + 4 * (LARGE.trailing_zeros() - MIN_CLASS.trailing_zeros()) as usize;

/// The size class of a request: at least 512 bytes; up to 256 MiB, four
/// classes per power of two (waste under 25%); above, a multiple of 2 MiB.
pub fn size_class(size: usize) -> usize {
    if size <= MIN_CLASS {
        return MIN_CLASS;
    }
    if size > LARGE {
        return size.div_ceil(2 << 20) * (2 << 20);
    }
    let pow = usize::BITS - 1 - (size - 1).leading_zeros(); // 2^pow < size <= 2^(pow+1)
    let step = 1usize << (pow - 2);
    size.div_ceil(step) * step
}

/// The slot of a class up to 256 MiB in a shard's `ready` table.
fn class_index(class: usize) -> Option<usize> {
    if class > LARGE {
        return None;
    }
    if class <= MIN_CLASS {
        return Some(0);
    }
    // class = k * 2^(pow-2) with 2^pow < class <= 2^(pow+1), k in 5..=8.
    let pow = (usize::BITS - 1 - (class - 1).leading_zeros()) as usize;
    let k = class >> (pow - 2);
    Some(1 + 4 * (pow - MIN_CLASS.trailing_zeros() as usize) + (k - 5))
}

/// Addresses are already well spread integers: hash them as they are
/// (SipHash costs more than the rest of an allocation).
#[derive(Default)]
struct IdentityHasher(u64);

impl std::hash::Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        // Classes and blocks are multiples of 512: drop the always-zero bits.
        self.0 >> 9 ^ self.0.rotate_left(29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = n as u64;
    }
}

type FastMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdentityHasher>>;

/// One shard's cache and statistics.
struct Shard {
    /// Ready blocks by class index; classes above 256 MiB live in `large`.
    ready: Vec<Vec<DevicePtr>>,
    large: FastMap<usize, Vec<DevicePtr>>,
    pending: Vec<(DevicePtr, usize)>,
    pending_bytes: usize,
    ready_bytes: usize,
    event: Option<RawEvent>,
    // Statistics, kept under the lock the allocation takes anyway (an atomic
    // counter shared by all threads would cost more than the rest of the
    // fast path). A block comes back to the shard that handed it out, so
    // each shard's live counts stay exact.
    live_bytes: usize,
    live_count: usize,
    peak_bytes: usize,
    alloc_count: u64,
    hits: u64,
    misses: u64,
    fences: u64,
}

impl Default for Shard {
    fn default() -> Self {
        Shard {
            ready: vec![Vec::new(); SMALL_CLASSES],
            large: FastMap::default(),
            pending: Vec::new(),
            pending_bytes: 0,
            ready_bytes: 0,
            event: None,
            live_bytes: 0,
            live_count: 0,
            peak_bytes: 0,
            alloc_count: 0,
            hits: 0,
            misses: 0,
            fences: 0,
        }
    }
}

impl Shard {
    fn take_ready(&mut self, class: usize) -> Option<DevicePtr> {
        let p = match class_index(class) {
            Some(i) => self.ready[i].pop()?,
            None => self.large.get_mut(&class)?.pop()?,
        };
        self.ready_bytes -= class;
        Some(p)
    }

    fn put_ready(&mut self, ptr: DevicePtr, class: usize) {
        match class_index(class) {
            Some(i) => self.ready[i].push(ptr),
            None => self.large.entry(class).or_default().push(ptr),
        }
        self.ready_bytes += class;
    }

    fn fence_due(&self, config: &PoolConfig) -> bool {
        self.pending.len() >= config.fence_count || self.pending_bytes >= config.fence_bytes
    }

    /// Record the fence and make every pending block ready.
    fn fence(&mut self, ctx: &Context) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let drv = ctx.driver();
        let event = match self.event {
            Some(e) => e,
            None => {
                let e = drv.event_create(ctx.raw())?;
                self.event = Some(e);
                e
            }
        };
        drv.event_record(ctx.raw(), event, 0)?;
        for (ptr, class) in std::mem::take(&mut self.pending) {
            self.put_ready(ptr, class);
        }
        self.pending_bytes = 0;
        self.fences += 1;
        Ok(())
    }

    /// A ready block of `class`; failing that, if a batch is due, fence it
    /// and try again.
    fn take_or_fence(
        &mut self,
        ctx: &Context,
        config: &PoolConfig,
        class: usize,
    ) -> Result<Option<DevicePtr>> {
        if let Some(p) = self.take_ready(class) {
            return Ok(Some(p));
        }
        if !self.fence_due(config) {
            return Ok(None);
        }
        self.fence(ctx)?;
        Ok(self.take_ready(class))
    }

    /// Empty the cache: every pending and ready block, with its class.
    fn drain(&mut self) -> Vec<(DevicePtr, usize)> {
        let mut out = std::mem::take(&mut self.pending);
        for (i, v) in self.ready.iter_mut().enumerate() {
            let class = class_of_index(i);
            out.extend(v.drain(..).map(|p| (p, class)));
        }
        for (class, v) in self.large.drain() {
            out.extend(v.into_iter().map(|p| (p, class)));
        }
        self.pending_bytes = 0;
        self.ready_bytes = 0;
        out
    }
}

/// The class stored at `index` of a shard's `ready` table.
fn class_of_index(index: usize) -> usize {
    if index == 0 {
        return MIN_CLASS;
    }
    let pow = (index - 1) / 4 + MIN_CLASS.trailing_zeros() as usize;
    let k = (index - 1) % 4 + 5;
    k << (pow - 2)
}

/// A shard on its own cache lines, so threads on neighbouring shards do not
/// slow each other down.
#[repr(align(128))]
struct Padded(Mutex<Shard>);

thread_local! {
    /// This thread's ticket; its shard in a pool of `n` is `ticket % n`
    /// (`n` is a power of two).
    static TICKET: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn ticket() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    TICKET.with(|t| {
        let mut v = t.get();
        if v == usize::MAX {
            v = NEXT.fetch_add(1, Ordering::Relaxed);
            t.set(v);
        }
        v
    })
}

/// A snapshot of one pool's statistics.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PoolStats {
    pub live_bytes: usize,
    pub live_count: usize,
    /// The sum of the shards' peaks: the peak of `live_bytes` when one
    /// thread allocates, an upper bound of it when several do.
    pub peak_bytes: usize,
    pub alloc_count: u64,
    pub cached_bytes: usize,
    pub hits: u64,
    pub misses: u64,
    pub fences: u64,
}

/// A block handed out by [`Pool::alloc`]: where it is and where it goes back.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub address: DevicePtr,
    pub class: usize,
    pub shard: u32,
}

/// A device's caching pool. Use it through [`Context::alloc`].
pub struct Pool {
    config: PoolConfig,
    shards: Box<[Padded]>,
    /// Registry entries of the blocks this pool holds from the driver
    /// (cached or handed out). Touched on misses, trims and resets only.
    blocks: Mutex<FastMap<DevicePtr, (usize, Registration)>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pool {
    pub(crate) fn new(config: PoolConfig) -> Self {
        let n = config.shards.clamp(1, 1 << 10).next_power_of_two();
        Pool {
            config: PoolConfig {
                shards: n,
                ..config
            },
            shards: (0..n)
                .map(|_| Padded(Mutex::new(Shard::default())))
                .collect(),
            blocks: Mutex::new(FastMap::default()),
        }
    }

    fn shard(&self, i: usize) -> MutexGuard<'_, Shard> {
        lock(&self.shards[i].0)
    }

    /// The shard the calling thread allocates from.
    #[inline]
    fn own_shard(&self) -> usize {
        if self.shards.len() == 1 {
            0
        } else {
            ticket() & (self.shards.len() - 1)
        }
    }

    pub(crate) fn stats(&self) -> PoolStats {
        let mut s = PoolStats::default();
        for i in 0..self.shards.len() {
            let sh = self.shard(i);
            s.live_bytes += sh.live_bytes;
            s.live_count += sh.live_count;
            s.peak_bytes += sh.peak_bytes;
            s.alloc_count += sh.alloc_count;
            s.cached_bytes += sh.ready_bytes + sh.pending_bytes;
            s.hits += sh.hits;
            s.misses += sh.misses;
            s.fences += sh.fences;
        }
        s
    }

    fn handed_out(sh: &mut Shard, size: usize, hit: bool) {
        sh.live_bytes += size;
        sh.peak_bytes = sh.peak_bytes.max(sh.live_bytes);
        sh.live_count += 1;
        sh.alloc_count += 1;
        if hit {
            sh.hits += 1;
        } else {
            sh.misses += 1;
        }
    }

    /// A ready block of `class` from any shard but `own`, which becomes its
    /// new home. A shard whose batch of pending blocks is due is fenced
    /// first (its own thread may never allocate again). Busy shards are
    /// skipped rather than waited for; a failed fence leaves the blocks
    /// pending for their own shard's next miss.
    fn steal(&self, ctx: &Context, own: usize, class: usize) -> Option<DevicePtr> {
        let n = self.shards.len();
        (1..n).find_map(|d| {
            let mut sh = self.shards[(own + d) % n].0.try_lock().ok()?;
            sh.take_or_fence(ctx, &self.config, class).ok().flatten()
        })
    }

    /// A block of at least `size` bytes.
    pub(crate) fn alloc(&self, ctx: &std::sync::Arc<Context>, size: usize) -> Result<Block> {
        let class = size_class(size);
        let own = self.own_shard();
        let block = |address| Block {
            address,
            class,
            shard: own as u32,
        };
        {
            // The fast path: one lock, the thread's own shard.
            let mut sh = self.shard(own);
            if let Some(p) = sh.take_or_fence(ctx, &self.config, class)? {
                Self::handed_out(&mut sh, size, true);
                return Ok(block(p));
            }
        }
        let (p, hit) = match self.steal(ctx, own, class) {
            Some(p) => (p, true),
            None => self.alloc_new_or_reclaim(ctx, own, class, size)?,
        };
        Self::handed_out(&mut self.shard(own), size, hit);
        Ok(block(p))
    }

    /// A fresh block from the driver; out of memory, what every shard caches
    /// is reclaimed and the driver asked once more. Returns the block and
    /// whether it came from the cache.
    fn alloc_new_or_reclaim(
        &self,
        ctx: &std::sync::Arc<Context>,
        own: usize,
        class: usize,
        size: usize,
    ) -> Result<(DevicePtr, bool)> {
        let typed = |e: crate::Error| e.oom_on(ctx.device(), size);
        match self.alloc_new(ctx, class) {
            Ok(p) => Ok((p, false)),
            Err(e) if e.is_oom() => {
                if let Some(p) = self.fence_all_and_take(ctx, own, class)? {
                    return Ok((p, true));
                }
                self.trim(ctx)?;
                self.alloc_new(ctx, class)
                    .map(|p| (p, false))
                    .map_err(typed)
            }
            Err(e) => Err(typed(e)),
        }
    }

    /// Fence every shard, then take a ready block of `class` from any.
    fn fence_all_and_take(
        &self,
        ctx: &Context,
        own: usize,
        class: usize,
    ) -> Result<Option<DevicePtr>> {
        let n = self.shards.len();
        for d in 0..n {
            let mut sh = self.shard((own + d) % n);
            sh.fence(ctx)?;
            if let Some(p) = sh.take_ready(class) {
                return Ok(Some(p));
            }
        }
        Ok(None)
    }

    fn alloc_new(&self, ctx: &std::sync::Arc<Context>, class: usize) -> Result<DevicePtr> {
        let p = ctx.driver().mem_alloc(ctx.raw(), class)?;
        let reg = ctx.runtime().registry().insert(p, class, ctx);
        lock(&self.blocks).insert(p, (class, reg));
        Ok(p)
    }

    /// Take back `block`, handed out by [`Pool::alloc`] for `size` bytes to
    /// a pointer of `ctx` made at `generation`. No driver call. A block of a
    /// context reset since is refused: its memory is gone (the check is
    /// under the shard lock, which a reset's [`Pool::forget`] takes too).
    pub(crate) fn release(&self, ctx: &Context, generation: u64, block: Block, size: usize) {
        let mut sh = self.shard(block.shard as usize & (self.shards.len() - 1));
        if ctx.generation() != generation {
            return;
        }
        // Saturating: a reset racing an allocation on another thread may have
        // zeroed the counts after this block was counted (no panic in a deleter).
        sh.live_bytes = sh.live_bytes.saturating_sub(size);
        sh.live_count = sh.live_count.saturating_sub(1);
        sh.pending.push((block.address, block.class));
        sh.pending_bytes += block.class;
    }

    /// Return every cached block to the driver (`cuMemFree`). Blocks still
    /// handed out are kept.
    pub fn trim(&self, ctx: &Context) -> Result<usize> {
        let mut cached = Vec::new();
        for i in 0..self.shards.len() {
            cached.extend(self.shard(i).drain());
        }
        let blocks: Vec<(DevicePtr, usize, Registration)> = {
            let mut held = lock(&self.blocks);
            cached
                .into_iter()
                .filter_map(|(ptr, class)| held.remove(&ptr).map(|(_, reg)| (ptr, class, reg)))
                .collect()
        };
        let mut freed = 0;
        let mut first_err = None;
        for (ptr, class, reg) in blocks {
            // cuMemFree waits for the device, so pending blocks are safe too.
            match ctx.driver().mem_free(ctx.raw(), ptr) {
                Ok(()) => {
                    ctx.runtime().registry().remove(reg);
                    freed += class;
                }
                Err(e) => {
                    // Still allocated: keep it cached, so nothing is lost.
                    lock(&self.blocks).insert(ptr, (class, reg));
                    self.shard(0).put_ready(ptr, class);
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(freed),
        }
    }

    /// Forget every block without freeing it: the context was reset and the
    /// memory is gone. Call after [`Context::invalidate`]: blocks handed out
    /// before are then refused on release.
    pub(crate) fn forget(&self, ctx: &Context) {
        for i in 0..self.shards.len() {
            let mut sh = self.shard(i);
            sh.drain();
            sh.event = None;
            sh.live_bytes = 0;
            sh.live_count = 0;
        }
        for (_, (_, reg)) in lock(&self.blocks).drain() {
            ctx.runtime().registry().remove(reg);
        }
    }

    /// Bytes the pool holds for reuse (pending and ready).
    pub fn cached_bytes(&self) -> usize {
        self.stats().cached_bytes
    }

    /// Number of blocks the pool holds from the driver (cached or handed out).
    pub fn held_blocks(&self) -> usize {
        lock(&self.blocks).len()
    }

    /// Destroy the shards' events (at context teardown).
    pub(crate) fn close(&self, ctx: &Context) {
        for i in 0..self.shards.len() {
            if let Some(e) = self.shard(i).event.take() {
                let _ = ctx.driver().event_destroy(ctx.raw(), e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_indexes_are_dense_and_round_trip() {
        let mut seen = std::collections::HashSet::new();
        let mut size = 1;
        while size <= LARGE {
            let c = size_class(size);
            let i = class_index(c).unwrap();
            assert!(i < SMALL_CLASSES, "{c} -> {i}");
            assert_eq!(class_of_index(i), c);
            seen.insert(i);
            size += size / 9 + 1;
        }
        assert_eq!(seen.len(), SMALL_CLASSES, "every slot is used");
        assert_eq!(class_index(size_class(LARGE + 1)), None);
    }

    #[test]
    fn size_classes_round_up_with_bounded_waste() {
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(512), 512);
        assert_eq!(size_class(513), 640);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), (1 << 20) + (1 << 18));
        assert_eq!(size_class((256 << 20) + 1), (256 << 20) + (2 << 20));
        for s in [600usize, 1000, 4097, 123_457, 9_999_999, 300 << 20] {
            let c = size_class(s);
            assert!(c >= s && (c - s) * 4 <= s.max(2 << 20), "{s} -> {c}");
        }
    }
}
