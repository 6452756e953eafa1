//! One device's caching pool in front of `cuMemAlloc`: PyTorch's caching
//! allocator's design, plus a reuse rule for memory freed without a stream.
//!
//! **Blocks fit the request.** A request takes the smallest free block that
//! fits (sizes round up to 512 bytes) and splits off the rest; a freed block
//! merges with its free neighbours (`arena.rs`). A miss grows the pool by a
//! driver allocation (*segment*) sized as PyTorch's: 2 MiB for requests up to
//! 1 MiB (the *small* pool, never serving larger ones), 20 MiB under 10 MiB,
//! else the request rounded up to 2 MiB. Nothing goes back to the driver
//! until a user asks ([`Pool::trim`]) or it runs out of memory.
//!
//! **Two reuse rules.**
//! - *Stream-ordered* (allocated for, or freed on, a known stream: PyTorch,
//!   CuPy, RMM, cuda.core, `alloc(n, stream=s)`): a block freed on stream `s`
//!   is free on `s` at once (stream order puts later work on `s` after the
//!   old owner's); other streams get it after a fence, or out of memory.
//! - *Fenced* (freed with no stream known: numba's plugin, `gpuptr.alloc`, or
//!   memory also used on another stream, `record_stream`): the block *waits*
//!   for the fence thread's next `cuCtxSynchronize`, which returns once every
//!   task queued before it on every stream is done. It is then free for
//!   anyone, kept whole on the arena's quick list for a request of its size
//!   (`quick.rs`). An arena asks for a fence as soon as a block waits and
//!   none is under way; frees meanwhile gather for the next.
//!
//! **A miss** ([`Pool::alloc`]: rung 1 inline, the rest in one function):
//! 1. the best fit in the caller's arena; for a large request without a
//!    stream whose best fit is larger while large blocks wait (none of its
//!    size on the quick list), after their fence as in rung 3;
//! 2. (no stream) memory anyone may use in another arena;
//! 3. for a large request (over 1 MiB) without a stream, or past the pool's
//!    budget (`max(1.5 x live, 32 MiB)`), a fence under way: wait for it and
//!    reuse what it frees, unless it has spun longer than a growth costs (the
//!    pool's own `cuMemAlloc` time): a busy GPU. If other threads took what
//!    it freed, claim a waiting block and wait for its fence once more;
//! 4. the growth helper allocating for this arena: wait for it;
//! 5. grow by one segment; without a stream on a busy GPU by what the arena
//!    uses (up to [`PoolConfig::ahead_bytes`]), and the helper grows it ahead;
//! 6. the driver refused: seal every arena, wait for one fence for all, take
//!    the best fit anywhere; the device then gives free segments back and
//!    asks again (`device/oom.rs`).
//!
//! **Parts.** The *arenas*, each behind its own lock: stream-ordered requests
//! go to their stream's, others to their thread's (round-robin); a block
//! goes back to its own. The *fencer* (`fence.rs`), the *segments* held from
//! the driver (`segments.rs`), the *grower* ahead of demand (`ahead.rs`) and
//! the pinned *host* cache (`host.rs`). The pool talks to the driver alone
//! (no [`Runtime`](crate::Runtime)), so it is tested on a bare simulator.

mod ahead;
mod alloc;
mod arena;
mod blocks;
mod books;
mod class;
mod fence;
mod freeset;
mod helper;
mod host;
mod quick;
mod segments;
mod spin;
#[cfg(test)]
mod tests;

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::driver::{Driver, RawContext, RawStream};
use crate::stats::{ClassStats, PoolStats};
use crate::sync::lock;
use ahead::Grower;
use arena::Arena;
pub(crate) use arena::{BlockState, Kind};
pub use class::size_class;
pub(crate) use class::FastMap;
use fence::Fencer;
pub(crate) use host::HostBlock;
use host::HostCache;
use segments::Segments;
pub(crate) use segments::{Allocation, Block, Grant, SegmentView};

/// How a pool batches fences and splits its cache.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// An arena seals its frees without a stream into a batch for a fence
    /// once none of its batches waits for one, or at this many pending.
    pub fence_count: usize,
    /// ... or at this many bytes.
    pub fence_bytes: usize,
    /// Number of arenas, a power of two (rounded up); default: CPUs, at most 16.
    pub shards: usize,
    /// The least time between two fences' starts: the fence thread rests
    /// this long after each (unless an out-of-memory waiter needs the
    /// next), so frees gather into fewer fences. Zero (default): no rest.
    pub fence_pace: Duration,
    /// Growth ahead of demand: while a busy GPU holds frees without a
    /// stream back, an arena that churns them is grown on a helper thread by
    /// what it uses (handed out and waiting), at most this many bytes at a
    /// time (as is a busy GPU's miss), so an allocation need not wait for
    /// the driver. Zero: off.
    pub ahead_bytes: usize,
    /// The pool's budget is `max(1.5 x live, headroom_bytes)`: past it a
    /// miss of memory freed without a stream waits for its fence rather
    /// than grow (a request over 1 MiB without a stream always waits), so
    /// an idle GPU's pool stays close to what is live.
    pub headroom_bytes: usize,
    /// Growth ahead stops at this many bytes free for anyone in the pool, or
    /// while it would leave under a quarter of the device's memory free.
    pub ahead_total: usize,
    /// The most bytes of pinned host memory (`cuMemHostAlloc`) the pool
    /// caches, under the same fence as device memory; larger classes are
    /// not cached. Zero: no host cache (frees go to the driver).
    pub host_cache_bytes: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            fence_count: 64,
            fence_bytes: 16 << 20,
            shards: std::thread::available_parallelism().map_or(1, |n| n.get().min(16)),
            fence_pace: Duration::ZERO,
            ahead_bytes: 64 << 20,
            ahead_total: 512 << 20,
            headroom_bytes: 32 << 20,
            host_cache_bytes: 512 << 20,
        }
    }
}

/// The longest a miss waits for a fence that has not spun enough to mean a
/// busy GPU ([`Fencer::wait_unless_busy`]): its thread waits for a CPU, or
/// the driver blocks rather than spins. Linux gives every runnable thread a
/// turn within its latency period (6 ms by default, sooner with fewer); on
/// the simulator with two CPUs and a spinning process beside, a 1 ms wait
/// let a 3 MiB loop grow to 58 MiB in one run of eight.
const FENCE_WAIT_MAX: Duration = Duration::from_millis(4);

/// A device's caching pool, over the driver alone: its parts are named in the module doc.
pub(crate) struct Pool {
    config: PoolConfig,
    driver: Arc<dyn Driver>,
    arenas: Box<[Padded]>,
    fencer: Fencer,
    segments: Segments,
    grower: Grower,
    /// The cache of pinned host memory (`host.rs`), fenced by `fencer` too.
    host: HostCache,
}

/// What [`Pool::on_segments`] calls.
pub(crate) type SegmentEvents = Box<dyn Fn(bool, &Allocation) + Send + Sync>;

/// An arena on cache lines of its own: no false sharing between arenas.
#[repr(align(128))]
struct Padded(Mutex<Arena>);

thread_local! {
    /// This thread's ticket; its arena in a pool of `n` is `ticket % n`.
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
            arenas: (0..n).map(|_| Padded(Mutex::default())).collect(),
            segments: Segments::new(),
            grower: Grower::new(),
            host: HostCache::new(config.host_cache_bytes),
        }
    }

    /// Call `f` with each driver allocation the pool makes (`true`) or
    /// gives up (`false`): the allocation history's segment events.
    pub(crate) fn on_segments(mut self, f: SegmentEvents) -> Self {
        self.segments.events = Some(f);
        self
    }

    #[inline]
    fn segment_event(&self, made: bool, a: &Allocation) {
        if let Some(f) = &self.segments.events {
            f(made, a);
        }
    }

    #[inline]
    fn arena(&self, i: usize) -> MutexGuard<'_, Arena> {
        lock(&self.arenas[i & (self.arenas.len() - 1)].0)
    }

    /// The arena a request on `stream` (`None`: no stream) goes to: its
    /// stream's, else its thread's.
    #[inline]
    fn arena_for(&self, stream: Option<RawStream>) -> usize {
        let n = self.arenas.len();
        if n == 1 {
            return 0;
        }
        let key = match stream {
            // Stream handles are pointers: mix their bits.
            Some(s) => (s as u64)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .rotate_left(29) as usize,
            None => ticket(),
        };
        key & (n - 1)
    }

    /// Whether the context's sync blocks (read at each retain; [`Fencer::spun`]).
    pub(crate) fn set_blocking_sync(&self, on: bool) {
        self.fencer.ext().blocking_sync.store(on, Ordering::Relaxed);
    }

    /// Whether a fence spun longer than a growth costs ([`Fencer::spun`]):
    /// queued GPU work holds fenced frees back longer than the driver takes.
    #[inline]
    pub(crate) fn gpu_busy(&self) -> bool {
        self.fencer.spun(self.segments.grow_cost())
    }

    /// What the pool may grow by within its budget, `max(1.5 x live,
    /// headroom)` ([`PoolConfig::headroom_bytes`]), with `size` more live:
    /// 0 past it. Locks every arena: misses only.
    fn budget_room(&self, size: usize) -> usize {
        let live: usize = size
            + (0..self.arenas.len())
                .map(|i| self.arena(i).live_bytes)
                .sum::<usize>();
        let budget = (live + live / 2).max(self.config.headroom_bytes);
        budget.saturating_sub(self.held_bytes())
    }

    pub(crate) fn stats(&self) -> PoolStats {
        let mut s = PoolStats::default();
        let done = self.fencer.done();
        for i in 0..self.arenas.len() {
            let mut a = self.arena(i);
            // Batches whose fence is done no longer wait: an arena whose
            // thread stopped allocating would report them pending forever.
            a.promote(done);
            s.live_bytes += a.live_bytes;
            s.live_count += a.live_count;
            s.peak_bytes += a.peak_bytes;
            s.alloc_count += a.alloc_count;
            s.pending_bytes += a.waiting_bytes();
            s.cached_bytes += a.free_bytes() + a.waiting_bytes();
            s.hits += a.hits;
            s.misses += a.misses;
            s.fences += a.fences;
            for (t, c) in s.clients.iter_mut().zip(&a.clients) {
                *t += *c;
            }
        }
        s
    }

    /// Forget the peaks: each arena's peak becomes its live bytes.
    pub(crate) fn reset_peak(&self) {
        let mut held = lock(&self.segments.held);
        held.peak = held.bytes;
        held.segments_stats.reset_peak();
        drop(held);
        for i in 0..self.arenas.len() {
            let mut a = self.arena(i);
            a.peak_bytes = a.live_bytes;
            a.class_live.0.iter_mut().for_each(|c| c.peak = c.live);
            a.large_live.values_mut().for_each(|c| c.peak = c.live);
        }
    }

    /// Per request size class: blocks handed out now and at most (the sum
    /// of the arenas' peaks: exact with one arena, else an upper bound),
    /// and cached blocks by their size's class; empty classes left out.
    pub(crate) fn class_stats(&self) -> Vec<ClassStats> {
        let mut by = FastMap::default();
        (0..self.arenas.len()).for_each(|i| self.arena(i).class_counts(&mut by));
        let mut v: Vec<ClassStats> = by
            .into_iter()
            .map(|(class, c)| ClassStats { class, ..c })
            .collect();
        v.sort_by_key(|c| c.class);
        v
    }

    /// Take back `block`, handed out by [`Pool::alloc`], freed on `stream`
    /// (`None`: no stream known); no driver call, no wait. `still_valid` is
    /// asked under the arena lock, which a reset's [`Pool::forget`] takes
    /// too: a block of a context reset since is refused, its memory gone.
    pub(crate) fn release(
        &self,
        context: RawContext,
        block: Block,
        stream: Option<RawStream>,
        still_valid: impl FnOnce() -> bool,
    ) {
        let mut a = self.arena(usize::from(block.shard));
        // A block this arena does not hold as handed out (its context was
        // reset, or it was given back already) is never freed twice.
        let Some(slot) = a
            .used_at(block.slot, block.address)
            .filter(|_| still_valid())
        else {
            return;
        };
        a.returned(block.size, block.client);
        match stream {
            Some(s) => a.free_slot(slot, s),
            None => {
                a.wait_slot(slot);
                if a.has_sealed() {
                    a.promote(self.fencer.done());
                }
                // One fence under way per arena: the first free asks for
                // it, and the frees while it runs gather for the next.
                if !a.has_sealed()
                    || a.pending_count() >= self.config.fence_count
                    || a.pending_bytes() >= self.config.fence_bytes
                {
                    a.seal(self.fencer.request(context));
                }
            }
        }
    }

    /// A stream capture begins on the device: no fence runs until it ends
    /// ([`Fencer::begin_capture`]); frees meanwhile wait for the fence
    /// after it, and an allocation out of memory waits for none.
    pub(crate) fn begin_capture(&self) {
        self.fencer.begin_capture();
    }

    /// The capture begun with [`Pool::begin_capture`] ended.
    pub(crate) fn end_capture(&self) {
        self.fencer.end_capture();
    }

    /// Let growth ahead under way finish (so what the pool holds stays put for
    /// statistics and trims), wait for the fence after every free so far, and
    /// make those blocks free (tests, `synchronize`); `false` if it failed.
    pub(crate) fn flush(&self, context: RawContext) -> bool {
        self.grower.quiesce(Duration::from_secs(1));
        let ok = match self.fencer.capturing() {
            // No fence runs now: flushed only if nothing waits for one.
            true => self.stats().pending_bytes == 0,
            false => self.fence_everything(context, |_, _| {}),
        };
        let done = self.fencer.done();
        for i in 0..self.arenas.len() {
            self.arena(i).promote(done);
        }
        self.host.each(|sh| sh.promote(done));
        ok
    }
}
