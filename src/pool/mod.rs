//! The caching pool in front of `cuMemAlloc`, one per device.
//!
//! **The reuse rule.** A freed block is handed to a new owner only after
//! all work queued before its free, on *every* stream of its context, has
//! finished; or, for a block freed on a known stream, at once to a new owner
//! on that same stream (stream order then puts the new owner's work after
//! the old owner's).
//!
//! - A block freed without a stream (numba's `memalloc` knows none) is
//!   *pending*. Pending blocks are *sealed* into a batch, and the device's
//!   fence thread calls `cuCtxSynchronize`, which returns once every
//!   task queued before the call, on every stream (legacy, per-thread,
//!   blocking and non-blocking), is done. Then the batch is *ready* for
//!   anyone. The allocating thread never waits: a miss meanwhile takes
//!   another ready block or goes to the driver.
//! - A block freed on stream `s` (`free(stream=s)`, or dropped after
//!   `alloc(n, stream=s)`) is kept on `s`'s list, reused at once by
//!   allocations on `s`, and sealed with the next batch for everyone else.
//!   A block also used on another stream (`record_stream`) takes the
//!   unordered path.
//! - A batch is sealed when [`PoolConfig::fence_count`] blocks or
//!   [`PoolConfig::fence_bytes`] bytes are pending, at [`SEAL_IDLE_BYTES`]
//!   if no batch of the shard waits for its fence as they reach it, at
//!   [`SEAL_BYTES`] in any case, and on any miss that finds blocks pending. Out of memory seals every
//!   shard, *waits* for the fence, and retries; past that rung its owner (the device's ladder,
//!   `device/oom.rs`) gives the cache back to the driver and asks again, up
//!   to four rounds while each trim frees something.
//!
//! **Growth.** On an idle device a miss allocates one block
//! (`cuMemAlloc`), within the pool's budget (`budget.rs`). While freed
//! blocks wait for an outstanding fence (a busy GPU holds them back), a
//! miss allocates up to [`CARVE_MAX`] blocks of its class in one
//! allocation of [`CARVE_BYTES`], doubling with each growth under
//! the same fence up to [`CARVE_BYTES_MAX`], and keeps the rest ready:
//! fresh memory is safe for anyone, and one driver call serves several
//! misses. A carved block lies inside one driver allocation, so IPC
//! (`cuMemGetAddressRange` gives the base, plus an offset) works for pooled
//! pointers, and [`Pool::trim`] frees an allocation once all its blocks are
//! cached. Each block is registered with its own range.
//!
//! **Shards.** The cache is split into shards, each behind its own lock, so
//! threads do not queue on one mutex. A thread allocates from its own shard
//! (threads are dealt out to shards round-robin), and a block returns to the
//! shard it was handed out from, even when another thread frees it. A miss
//! looks in the other shards before it calls the driver.
//!
//! The pool talks to the driver alone (no [`Runtime`](crate::Runtime)), so
//! it is tested on a bare simulator.

//! The pool's rooms: `class` (size classes), `shard` (one lock's cache),
//! `fence` (the fence thread), `ahead` (growth ahead, on its own thread),
//! `helper` (the skeleton both threads share), `held` (driver allocations,
//! carving, the limit, trim, and [`Block`]), `oom` (the fence rung of out
//! of memory), `host` (the cache of pinned host memory, one shard per flag
//! combination under the same fence), and this façade. It knows nothing of
//! pointers: a release hands it a [`Block`].

mod ahead;
mod budget;
mod class;
mod fence;
mod held;
mod helper;
mod host;
mod oom;
mod shard;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::driver::{DevicePtr, Driver, RawContext, RawStream};
use crate::error::Result;
use crate::stats::{ClassStats, Client, PoolStats};
use crate::sync::lock;
use ahead::{Grower, AHEAD_WAIT};
pub use class::size_class;
use class::{class_index, class_of_index, FastMap, SMALL_CLASSES};
use fence::{Fencer, Line};
pub(crate) use held::{Allocation, Block, Grant};
use held::{Growth, Held, CARVE_MAX};
pub(crate) use host::HostBlock;
use host::HostCache;
use shard::{ticket, Padded, Shard};

/// A free seals its shard's pending blocks as they reach this many bytes,
/// if no batch of the shard waits for its fence then (see
/// [`Pool::release`]). The shard's own list, not the fence count: the
/// fence thread writes that at every fence.
const SEAL_IDLE_BYTES: usize = 4 << 20;
/// ... and once they are at least this many bytes in any case: half of the
/// default budget, so that a pool within it keeps half its stock ready
/// while a fence runs. A tight loop of 1 MiB pairs on an idle H200 fenced
/// once per 16 pairs at this size against once per 8 at 8 MiB.
const SEAL_BYTES: usize = 16 << 20;

/// How a pool batches fences and splits its cache.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Seal a batch for the fence once this many blocks are pending (per shard).
    pub fence_count: usize,
    /// Seal a batch once this many bytes are pending (per shard).
    pub fence_bytes: usize,
    /// Number of shards, rounded up to a power of two. The default is the
    /// number of CPUs, at most 16.
    pub shards: usize,
    /// The least time between the starts of two fences: after each one the
    /// helper thread rests this long (unless an out-of-memory waiter needs
    /// the next), so frees gather into fewer fences and the helper takes
    /// little CPU from the threads that allocate. Zero (the default): back
    /// to back, which keeps an idle GPU's pool within its budget.
    pub fence_pace: Duration,
    /// Growth ahead of demand: while frees wait for a fence, each shard
    /// keeps up to this many bytes (at most 64 blocks) of every class it
    /// churns ready, grown on a helper thread, so that an allocation on a
    /// busy GPU finds a block instead of waiting for the driver. Classes
    /// larger than this are not grown ahead. Zero: off.
    pub ahead_bytes: usize,
    /// The most ready bytes the pool holds before it stops growing ahead.
    /// Growth ahead also stops while it would leave less than a quarter of
    /// the device's memory free.
    pub ahead_total: usize,
    /// The least budget of the pool while the GPU is idle: it holds at most
    /// `max(1.5 x live, headroom_bytes)` bytes then (`live`: what its
    /// users hold). Past that, a miss waits (at most 20 µs) for the fence
    /// of a freed block of its class and reuses it; else it grows, and the
    /// helper gives idle cache back until the pool is within the budget
    /// again (see the `budget` module). A busy GPU (a fence its thread has
    /// run in for 20 µs) grows past it: the blocks its queued work holds
    /// back are never handed out.
    pub headroom_bytes: usize,
    /// The most bytes of pinned host memory (`cuMemHostAlloc`) the pool
    /// caches for reuse, under the same fence as device memory; classes
    /// larger than this are not cached. Zero: no host cache (every free
    /// goes to the driver).
    pub host_cache_bytes: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            // One fence request per 32 frees; the byte cap bounds how much
            // memory waits for a fence.
            fence_count: 32,
            fence_bytes: 64 << 20,
            shards: std::thread::available_parallelism().map_or(1, |n| n.get().min(16)),
            fence_pace: Duration::ZERO,
            ahead_bytes: 64 << 20,
            ahead_total: 512 << 20,
            headroom_bytes: 32 << 20,
            host_cache_bytes: 512 << 20,
        }
    }
}

/// A device's caching pool, over the driver alone.
pub(crate) struct Pool {
    config: PoolConfig,
    driver: Arc<dyn Driver>,
    shards: Box<[Padded]>,
    fencer: Fencer,
    held: Mutex<Held>,
    growth: Mutex<Growth>,
    /// Held while a growth is claimed ([`Pool::claim`]): the room the
    /// budget leaves is read and spent in one step.
    claiming: Mutex<()>,
    /// The most bytes `held` may hold (`usize::MAX`: no limit).
    limit: AtomicUsize,
    grower: Grower,
    /// The shard and class the helper is allocating for now; a miss of
    /// that class in that shard waits on `grown` rather than ask the driver
    /// too (the driver makes one allocation at a time).
    ahead: Mutex<Option<(usize, usize)>>,
    grown: Condvar,
    /// How long such a miss waits at most ([`AHEAD_WAIT`]; tests on slow
    /// hosts lengthen it).
    ahead_wait: Duration,
    /// Per class index: the ready blocks a shard keeps while it churns that
    /// class (0: not grown ahead).
    ahead_blocks: Box<[u32]>,
    /// Told of each driver allocation the pool records (`true`) or gives up
    /// (`false`), before any of its blocks is handed out and before the
    /// driver may hand its addresses to someone else ([`Pool::on_segments`]).
    segments: Option<SegmentEvents>,
    /// Told of each allocation the pool gives back on its own (idle cache
    /// past its budget, [`Pool::give_back`]) before its free: the owner
    /// forgets its blocks' registry entries. Without it nothing is given
    /// back but by a trim.
    forget_hook: Option<ForgetHook>,
    /// A settle ([`Pool::settle`]) is asked for or under way: one at a time.
    settling: AtomicBool,
    /// The fence (by its start, `Fencer::busy_fence`) the growth helper last
    /// found running long but not busy.
    idle_verdict: AtomicU64,
    /// The pool grew for a busy GPU (past its budget): the number of a
    /// fence that ends after the work that held frees back then (0: nothing
    /// to settle). Once it is done, the next hand-out asks for a settle, so
    /// that the growth goes back once the GPU is idle, even where no miss
    /// follows to ask for it (see [`Pool::settle_due`]).
    /// On a cache line of its own: every hand-out reads it.
    grew_past: Line<AtomicU64>,
    /// Settles in a row that gave nothing back (see `budget.rs`).
    fruitless: std::sync::atomic::AtomicU32,
    /// The settle asked for or under way is one after a busy spell
    /// ([`Pool::settle_due`]): it asks for the next while it gives back.
    after_busy: AtomicBool,
    /// The cache of pinned host memory (`host.rs`), fenced by `fencer` too.
    host: HostCache,
}

/// What [`Pool::on_give_back`] calls.
pub(crate) type ForgetHook = Box<dyn Fn(&Allocation) + Send + Sync>;

/// What [`Pool::on_segments`] calls.
pub(crate) type SegmentEvents = Box<dyn Fn(bool, &Allocation) + Send + Sync>;

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Pool {
    pub(crate) fn new(config: PoolConfig, driver: Arc<dyn Driver>) -> Self {
        let n = config.shards.clamp(1, 1 << 10).next_power_of_two();
        Pool {
            config: PoolConfig {
                shards: n,
                ..config
            },
            fencer: Fencer::new(driver.clone(), config.fence_pace),
            driver,
            shards: (0..n)
                .map(|_| Padded(Mutex::new(Shard::default())))
                .collect(),
            held: Mutex::new(Held::default()),
            growth: Mutex::new(Growth::default()),
            claiming: Mutex::new(()),
            limit: AtomicUsize::new(usize::MAX),
            grower: Grower::new(),
            ahead: Mutex::new(None),
            grown: Condvar::new(),
            ahead_wait: AHEAD_WAIT,
            ahead_blocks: (0..SMALL_CLASSES)
                .map(|i| {
                    let class = class_of_index(i);
                    if config.ahead_bytes < class {
                        0
                    } else {
                        (config.ahead_bytes / class).min(CARVE_MAX) as u32
                    }
                })
                .collect(),
            segments: None,
            forget_hook: None,
            settling: AtomicBool::new(false),
            idle_verdict: AtomicU64::new(0),
            grew_past: Line(AtomicU64::new(0)),
            fruitless: std::sync::atomic::AtomicU32::new(0),
            after_busy: AtomicBool::new(false),
            host: HostCache::new(config.host_cache_bytes),
        }
    }

    /// Call `f` with each driver allocation the pool makes (`true`) or
    /// gives up (`false`): the allocation history's segment events.
    pub(crate) fn on_segments(mut self, f: SegmentEvents) -> Self {
        self.segments = Some(f);
        self
    }

    /// Let the pool give idle cache back to the driver past its budget,
    /// calling `f` with each allocation before its free (see
    /// [`PoolConfig::headroom_bytes`]).
    pub(crate) fn on_give_back(mut self, f: ForgetHook) -> Self {
        self.forget_hook = Some(f);
        self
    }

    #[inline]
    fn segment_event(&self, made: bool, a: &Allocation) {
        if let Some(f) = &self.segments {
            f(made, a);
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
        let done = self.fencer.done();
        for i in 0..self.shards.len() {
            let mut sh = self.shard(i);
            // Batches whose fence is done no longer wait: a shard whose
            // thread stopped allocating would report them pending forever.
            sh.promote(done);
            s.live_bytes += sh.live_bytes;
            s.live_count += sh.live_count();
            s.peak_bytes += sh.peak_bytes;
            s.alloc_count += sh.alloc_count;
            let waiting = sh.pending_bytes + sh.sealed_bytes;
            s.pending_bytes += waiting;
            s.cached_bytes += sh.ready_bytes + sh.stream_bytes + waiting;
            s.hits += sh.hits;
            s.misses += sh.misses;
            s.fences += sh.fences;
            for (t, c) in s.clients.iter_mut().zip(&sh.clients) {
                *t += *c;
            }
        }
        s
    }

    /// Forget the peaks: each shard's peak becomes its live bytes.
    pub(crate) fn reset_peak(&self) {
        {
            let mut held = lock(&self.held);
            held.peak = held.bytes;
            held.segments.reset_peak();
        }
        for i in 0..self.shards.len() {
            let mut sh = self.shard(i);
            sh.peak_bytes = sh.live_bytes;
            sh.class_live.iter_mut().for_each(|c| c.peak = c.live);
            sh.large_live.values_mut().for_each(|c| c.peak = c.live);
        }
    }

    /// Per size class: blocks handed out now, the most at once (the sum of
    /// the shards' peaks: exact with one thread, an upper bound with
    /// several), and blocks cached. Classes with none of these are left out.
    pub(crate) fn class_stats(&self) -> Vec<ClassStats> {
        let mut by: FastMap<usize, ClassStats> = FastMap::default();
        let mut cached = FastMap::default();
        fn entry(by: &mut FastMap<usize, ClassStats>, class: usize) -> &mut ClassStats {
            by.entry(class).or_insert(ClassStats {
                class,
                ..ClassStats::default()
            })
        }
        for i in 0..self.shards.len() {
            let sh = self.shard(i);
            let counts = sh
                .class_live
                .iter()
                .enumerate()
                .map(|(i, c)| (class_of_index(i), *c))
                .chain(sh.large_live.iter().map(|(k, c)| (*k, *c)));
            for (class, c) in counts.filter(|(_, c)| c.peak > 0) {
                let e = entry(&mut by, class);
                e.live_blocks += c.live;
                e.peak_blocks += c.peak;
            }
            sh.cached_by_class(&mut cached);
        }
        for (class, n) in cached {
            entry(&mut by, class).cached_blocks += n;
        }
        let mut v: Vec<ClassStats> = by.into_values().collect();
        v.sort_by_key(|c| c.class);
        v
    }

    fn handed_out(sh: &mut Shard, size: usize, class: usize, hit: bool, client: Client) {
        let c = sh.class_count(class);
        c.live += 1;
        c.peak = c.peak.max(c.live);
        let k = &mut sh.clients[client.index()];
        k.live_bytes += size;
        k.live_count += 1;
        k.alloc_count += 1;
        sh.live_bytes += size;
        sh.peak_bytes = sh.peak_bytes.max(sh.live_bytes);
        sh.alloc_count += 1;
        if hit {
            sh.hits += 1;
        } else {
            sh.misses += 1;
        }
    }

    /// A block of `class` for `stream` from any shard but `own`, which
    /// becomes its new home. Busy shards are skipped rather than waited for.
    fn steal(
        &self,
        context: RawContext,
        own: usize,
        class: usize,
        stream: Option<RawStream>,
    ) -> Option<DevicePtr> {
        let n = self.shards.len();
        let done = self.fencer.done();
        (1..n).find_map(|d| {
            let mut sh = self.shards[(own + d) % n].0.try_lock().ok()?;
            let p = sh.take(class, stream, || done);
            if p.is_none() && sh.fence_due(&self.config) {
                // Its own thread may never allocate again: start its fence.
                sh.seal(&self.fencer, context, false);
            }
            p
        })
    }

    /// A block of at least `size` bytes for an owner on `stream` (`None`:
    /// no stream known) in `context`.
    pub(crate) fn alloc(
        &self,
        context: RawContext,
        size: usize,
        stream: Option<RawStream>,
        device: usize,
        client: Client,
    ) -> Result<Grant> {
        let class = size_class(size);
        let index = class_index(class);
        let own = self.own_shard();
        let block = |address, new_allocation, ahead| Grant {
            address,
            class,
            shard: own as u16,
            new_allocation,
            ahead,
            settle: false,
        };
        {
            // The fast path: one lock, the thread's own shard, no driver call.
            let mut sh = self.shard(own);
            if let Some(p) = sh.take(class, stream, || self.fencer.done()) {
                Self::handed_out(&mut sh, size, class, true, client);
                if self.fencer.take_rest() {
                    self.back_from_rest(&mut sh, context);
                }
                let ahead = self.ahead_wanted(&mut sh, index);
                drop(sh);
                return Ok(Grant {
                    settle: self.settle_due(),
                    ..block(p, None, ahead)
                });
            }
            // A miss: start a fence for what this shard holds back, so that
            // it is ready for a later request. Nothing waits for it now.
            // And growth ahead is welcome again: a pause that an idle GPU's
            // quick fences earned (the helper found the stock made up)
            // must not outlast the GPU turning busy (measured on an H200:
            // a pause taken in a warm-up left 300 busy pairs to grow on
            // the allocating thread, p99 141 us instead of about 30).
            sh.ahead_cooldown = 0;
            let streams = sh.streams_due(&self.config);
            sh.seal(&self.fencer, context, streams);
        }
        if let Some(p) = self.steal(context, own, class, stream) {
            Self::handed_out(&mut self.shard(own), size, class, true, client);
            return Ok(block(p, None, false));
        }
        if self.wait_ahead(own, class) {
            // The helper grew this class meanwhile.
            let mut sh = self.shard(own);
            if let Some(p) = sh.take(class, stream, || self.fencer.done()) {
                Self::handed_out(&mut sh, size, class, true, client);
                return Ok(block(p, None, false));
            }
        }
        // Past its budget on an idle GPU, the pool reuses rather than grows.
        let (room, waiting) = self.room(class);
        // Frees held back by a fence not yet done: a miss carves (a fence
        // the fence thread asked for itself, running back to back, holds
        // nothing back).
        let held_back = waiting > 0 && self.fencer.outstanding();
        // Asked once (it may watch the fence thread for a while), and only
        // where it decides: past the budget, or for a carve.
        let busy = (room < class || held_back) && self.fencer.busy_confirmed();
        let mut settle = false;
        if room < class && !busy {
            // A block of this class that waits for a fence is worth the
            // microseconds an idle GPU's fence takes.
            if let Some(p) = self.wait_fence_and_take(context, own, class) {
                Self::handed_out(&mut self.shard(own), size, class, true, client);
                return Ok(block(p, None, false));
            }
            // Else a ready block a little larger, rather than grow.
            if let Some((p, larger)) = self.take_larger(own, class) {
                Self::handed_out(&mut self.shard(own), size, larger, true, client);
                return Ok(Grant {
                    class: larger,
                    ..block(p, None, false)
                });
            }
            // Else it grows, and idle cache goes back to the driver behind
            // it, on the helper: a `cuMemFree` waits for the GPU, so the
            // allocating thread never makes one.
            settle = self.want_settle();
        }
        let new = match self.alloc_new(context, class, waiting, held_back, busy) {
            Ok(new) => {
                if busy {
                    self.grew_past_budget();
                }
                new
            }
            Err(e) if e.is_oom() => match self.fence_all_and_take(context, own, class) {
                Some(p) => {
                    Self::handed_out(&mut self.shard(own), size, class, true, client);
                    return Ok(block(p, None, false));
                }
                // Returning the cache to the driver and retrying is the
                // owner's step (`trim`): it keeps the registry entries.
                None => return Err(e.oom_on(device, size)),
            },
            Err(e) => return Err(e.oom_on(device, size)),
        };
        let mut sh = self.shard(own);
        for p in new.block_addresses().skip(1) {
            // Never used: ready for anyone at once.
            sh.put_ready(p, class);
        }
        Self::handed_out(&mut sh, size, class, false, client);
        let ahead = self.ahead_wanted(&mut sh, index);
        Ok(Grant {
            settle,
            ..block(new.base, Some(new), ahead)
        })
    }

    /// The first hand-out after a rest of the pool ([`Fencer::take_rest`]):
    /// ask for a fence now (sealing what waits in the shard), and welcome
    /// growth ahead again. A GPU that turned busy during the rest (a kernel
    /// launched while nothing allocated) holds back every free from here
    /// on, and the stock an idle GPU's budget allows lasts a few hundred
    /// µs of a tight loop: the fence thread and the growth helper (asked at
    /// the next hand-out that finds a free waiting) wake side by side, and
    /// the helper's first busy growth lands about when the stock runs out
    /// rather than a wake-up or two after it. On an idle GPU it costs one
    /// fence and the helper's look, once per rest.
    #[cold]
    fn back_from_rest(&self, sh: &mut Shard, context: RawContext) {
        if sh.pending.is_empty() {
            let _ = self.fencer.request(context);
        } else {
            sh.seal(&self.fencer, context, false);
        }
        sh.ahead_cooldown = 0;
    }

    /// Take back `block`, handed out by [`Pool::alloc`], freed on `stream`
    /// (`None`: no stream known). No driver call, and no wait.
    /// `still_valid` is asked under the shard lock, which a reset's
    /// [`Pool::forget`] takes too: a block of a context reset since is
    /// refused, its memory gone.
    pub(crate) fn release(
        &self,
        context: RawContext,
        block: Block,
        stream: Option<RawStream>,
        still_valid: impl FnOnce() -> bool,
    ) {
        let mut sh = self.shard(block.shard as usize & (self.shards.len() - 1));
        if !still_valid() {
            return;
        }
        let (size, client) = (block.size, block.client);
        // Saturating: a reset racing an allocation on another thread may have
        // zeroed the counts after this block was counted (no panic in a deleter).
        sh.live_bytes = sh.live_bytes.saturating_sub(size);
        let c = sh.class_count(block.class);
        c.live = c.live.saturating_sub(1);
        let k = &mut sh.clients[client.index()];
        k.live_bytes = k.live_bytes.saturating_sub(size);
        k.live_count = k.live_count.saturating_sub(1);
        match stream {
            Some(s) => {
                sh.on_stream
                    .entry((s, block.class))
                    .or_default()
                    .push(block.address);
                sh.stream_bytes += block.class;
            }
            None => {
                sh.put_pending(block.address, block.class);
                // Also by bytes, sooner than the configured batch: the fence
                // then runs while the rest of the stock is handed out, and a
                // pool kept within its budget rarely has a miss wait for it.
                // The fence count is read once a batch, as the pending bytes
                // cross the idle threshold: the fence thread writes it at
                // every fence, and a free that read it each time would fetch
                // its line from that thread's core.
                let crossed = sh.pending_bytes >= SEAL_IDLE_BYTES
                    && sh.pending_bytes - block.class < SEAL_IDLE_BYTES;
                if sh.fence_due(&self.config)
                    || sh.pending_bytes >= SEAL_BYTES
                    || (crossed && sh.sealed.is_empty())
                {
                    sh.seal(&self.fencer, context, false);
                }
            }
        }
    }

    /// A stream capture begins on this pool's device: no fence runs until
    /// it ends (see [`Fencer::begin_capture`]); blocks freed meanwhile wait
    /// for the fence after it, and an allocation that runs out of memory
    /// meanwhile does not wait for one.
    pub(crate) fn begin_capture(&self) {
        self.fencer.begin_capture();
    }

    /// The capture begun with [`Pool::begin_capture`] ended.
    pub(crate) fn end_capture(&self) {
        self.fencer.end_capture();
    }

    /// Whether a capture is under way on the device.
    pub(crate) fn capturing(&self) -> bool {
        self.fencer.capturing()
    }

    /// Let growth ahead under way finish, then wait for the fence that
    /// covers every block freed so far, and make those blocks ready (tests
    /// and `synchronize` callers). `false` if the fence failed.
    pub(crate) fn flush(&self, context: RawContext) -> bool {
        // Growth ahead under way finishes first, so that what the pool
        // holds then stays put (statistics, trims).
        self.grower.quiesce(Duration::from_secs(1));
        self.seal_all_and_wait(context)
    }
}
