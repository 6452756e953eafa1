//! What the pool holds from the driver: its allocations (one block, or
//! several carved from one), growth under a busy GPU, the limit, and
//! giving memory back (trim, and forgetting it after a reset).

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::class::{size_class, FastMap};
use super::Pool;
use crate::driver::{relaxed, DevicePtr, RawContext};
use crate::error::{Error, Result, CUDA_ERROR_OUT_OF_MEMORY};
use crate::stats::{Client, SegmentStats};
use crate::sync::lock;

/// When the pool grows while frees wait for an outstanding fence (a busy
/// GPU), it carves blocks from allocations of about this many bytes,
/// doubling with each growth under the same fence up to
/// [`CARVE_BYTES_MAX`]: one driver call then serves several misses, and a
/// `cuMemAlloc` costs about the same (40-60 µs on an H200) for 8 MiB as for
/// 128 MiB.
pub(super) const CARVE_BYTES: usize = 8 << 20;
pub(super) const CARVE_BYTES_MAX: usize = 64 << 20;
/// At most this many blocks per allocation.
pub(super) const CARVE_MAX: usize = 64;
/// At most this many blocks per allocation of a reservation.
pub(super) const RESERVE_MAX: usize = 1024;

/// How a growth's size is fitted when it is claimed ([`Pool::claim`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Fit {
    /// As asked (a reservation, a busy GPU's growth, a miss's one block).
    Exact,
    /// Cut to the room the pool's budget leaves, at least `least` blocks
    /// (an idle GPU's growth).
    Budget { least: usize },
}

/// One pool block as its owner gives it back, the same from the pointer
/// through a CUDA graph that keeps it to [`Pool::release`]: where it is,
/// where it goes back, and what it was handed out for.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    /// The device's reset epoch it was handed out in: its device refuses
    /// it after a reset, its memory gone (the pool knows no epochs).
    pub epoch: u64,
    pub address: DevicePtr,
    pub class: usize,
    /// The shard it goes back to (shards are at most 1024).
    pub shard: u16,
    /// The bytes it was handed out for.
    pub size: usize,
    /// Who asked for it (statistics).
    pub client: Client,
}

/// What [`Pool::alloc`] hands out: where the block is and where it goes
/// back, and what its owner does next.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Grant {
    pub address: DevicePtr,
    pub class: usize,
    pub shard: u16,
    /// The driver allocation this request made, if it made one (this block
    /// is its first). Its owner registers each block's range.
    pub new_allocation: Option<Allocation>,
    /// The pool asks its owner to grow this block's class ahead of demand
    /// ([`Pool::post_ahead`], then [`Pool::grow_ahead`] on the helper).
    pub ahead: bool,
    /// The pool grew past its budget for this request: it asks its owner to
    /// give idle cache back on the helper ([`Pool::settle`]).
    pub settle: bool,
}

/// A driver allocation of the pool: at `base`, `blocks` blocks of `class`
/// bytes each (one, or several carved from it).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Allocation {
    pub base: DevicePtr,
    pub class: usize,
    pub blocks: usize,
}

impl Allocation {
    /// The allocation's size in bytes.
    pub fn bytes(&self) -> usize {
        self.class * self.blocks
    }

    /// The addresses of its blocks.
    pub fn block_addresses(self) -> impl Iterator<Item = DevicePtr> {
        (0..self.blocks).map(move |i| self.base + (i * self.class) as u64)
    }
}

/// What the pool holds from the driver. Touched on misses, trims and resets.
#[derive(Default)]
pub(super) struct Held {
    /// Allocations by base address.
    pub(super) allocations: FastMap<DevicePtr, Allocation>,
    /// The base of each carved block that is not its allocation's first.
    pub(super) carved: FastMap<DevicePtr, DevicePtr>,
    /// Bytes of `allocations`.
    pub(super) bytes: usize,
    /// The most `bytes` has been (since the last peak reset).
    pub(super) peak: usize,
    /// Bytes of driver allocations and frees under way: the driver may hold
    /// them beyond `bytes`, so the limit counts them.
    pub(super) pending: usize,
    /// The allocations as PyTorch counts segments (`bytes` and `peak` by
    /// pool, with totals).
    pub(super) segments: SegmentStats,
}

impl Held {
    pub(super) fn base_of(&self, block: DevicePtr) -> DevicePtr {
        self.carved.get(&block).copied().unwrap_or(block)
    }

    pub(super) fn record(&mut self, a: Allocation) {
        self.bytes += a.bytes();
        self.peak = self.peak.max(self.bytes);
        self.segments.made(a.class, a.bytes());
        self.allocations.insert(a.base, a);
        for p in a.block_addresses().skip(1) {
            self.carved.insert(p, a.base);
        }
    }

    /// Take the record of the allocation at `base` out.
    pub(super) fn forget(&mut self, base: DevicePtr) -> Allocation {
        let a = self
            .allocations
            .remove(&base)
            .expect("a recorded allocation");
        self.bytes -= a.bytes();
        self.segments.freed(a.class, a.bytes());
        for p in a.block_addresses().skip(1) {
            self.carved.remove(&p);
        }
        a
    }
}

/// How many times the pool grew under the fence numbered `done`.
#[derive(Default)]
pub(super) struct Growth {
    pub(super) done: u64,
    pub(super) carves: u32,
}

impl Pool {
    /// New memory from the driver for blocks of `class`: one block, or,
    /// while frees wait for an outstanding fence (a busy GPU), several
    /// carved from one allocation, so that one driver call serves several
    /// misses.
    ///
    /// `waiting` is the bytes that wait for a fence ([`Pool::room`]);
    /// `held_back`: some of them wait for an outstanding fence (the carve's
    /// condition); `busy` is the caller's [`Fencer::busy_confirmed`] (asked
    /// whenever `held_back`). On an idle GPU (its fence lags only for a
    /// moment) a carve stays within the room the pool's budget leaves when
    /// it is claimed ([`Fit::Budget`]); on a busy one it is at least what
    /// waits (capped at [`CARVE_BYTES_MAX`]): frees go on being held back
    /// at that rate, and one allocation covers the time the growth helper
    /// needs for its first.
    ///
    /// [`Fencer::busy_confirmed`]: super::fence::Fencer::busy_confirmed
    pub(super) fn alloc_new(
        &self,
        context: RawContext,
        class: usize,
        waiting: usize,
        held_back: bool,
        busy: bool,
    ) -> Result<Allocation> {
        let (carve, fit) = if held_back {
            let mut g = lock(&self.growth);
            let done = self.fencer.done();
            if g.done != done {
                // A fence finished since: start small again.
                *g = Growth { done, carves: 0 };
            }
            let bytes = (CARVE_BYTES << g.carves).min(CARVE_BYTES_MAX);
            g.carves = (g.carves + 1).min(8);
            let (bytes, fit) = if busy {
                (bytes.max(waiting.min(CARVE_BYTES_MAX)), Fit::Exact)
            } else {
                // The miss itself grows by one block in any case.
                (bytes, Fit::Budget { least: 1 })
            };
            ((bytes / class).clamp(1, CARVE_MAX), fit)
        } else {
            (1, Fit::Exact)
        };
        let blocks = self.claim(class, carve, fit)?;
        if blocks > 1 {
            log::debug!(
                target: "gpuptr::pool",
                "a miss carves {blocks} block(s) of class {class} (busy: {busy}, {waiting} bytes wait for a fence)"
            );
        }
        match self.allocate_claimed(context, class, blocks) {
            // Too big a request for a tight device: one block will do.
            Err(e) if blocks > 1 && e.is_oom() => self.allocate(context, class, 1),
            r => r,
        }
    }

    /// Claim `blocks` blocks of `class` for a driver allocation about to
    /// be made ([`Pool::allocate_claimed`]): counted as held from now on,
    /// so that a growth decided meanwhile on another thread (a miss, the
    /// growth helper) sees them. With [`Fit::Budget`] the claim is cut to
    /// the room the pool's budget leaves now ([`Pool::room`]), at least
    /// `least` blocks; the room is read and the claim counted under one
    /// lock, so two growths never spend the same room. The blocks claimed
    /// (0 when the room fits none and `least` is 0), or the pool limit's
    /// out-of-memory error.
    pub(super) fn claim(&self, class: usize, blocks: usize, fit: Fit) -> Result<usize> {
        let _claiming = lock(&self.claiming);
        let blocks = match fit {
            Fit::Exact => blocks,
            Fit::Budget { least } => blocks.min(self.room(class).0 / class).max(least),
        };
        if blocks == 0 {
            return Ok(0);
        }
        let bytes = blocks * class;
        let mut held = lock(&self.held);
        let limit = self.limit.load(Ordering::Relaxed);
        if held.bytes + held.pending + bytes > limit {
            return Err(Error::cuda(
                "gpuptr pool limit",
                CUDA_ERROR_OUT_OF_MEMORY,
                "CUDA_ERROR_OUT_OF_MEMORY",
            ));
        }
        held.pending += bytes;
        Ok(blocks)
    }

    /// One driver allocation of `blocks` blocks of `class`, recorded.
    pub(super) fn allocate(
        &self,
        context: RawContext,
        class: usize,
        blocks: usize,
    ) -> Result<Allocation> {
        let blocks = self.claim(class, blocks, Fit::Exact)?;
        self.allocate_claimed(context, class, blocks)
    }

    /// The driver allocation for `blocks` blocks of `class` claimed by
    /// [`Pool::claim`] (the claim ends here, made or failed), recorded.
    pub(super) fn allocate_claimed(
        &self,
        context: RawContext,
        class: usize,
        blocks: usize,
    ) -> Result<Allocation> {
        let bytes = blocks * class;
        let started =
            log::log_enabled!(target: "gpuptr::pool", log::Level::Debug).then(Instant::now);
        // Relaxed: a capture under way on some thread neither refuses this
        // allocation nor is invalidated by it.
        let r = self.fencer.own_call(|| {
            // SAFETY: the pool's owner passes its live, retained context.
            relaxed(self.driver.as_ref(), || unsafe {
                self.driver.mem_alloc(context, bytes)
            })
        });
        if let Some(t) = started {
            log::debug!(
                target: "gpuptr::pool",
                "cuMemAlloc of {bytes} bytes took {} us",
                t.elapsed().as_micros()
            );
        }
        let mut held = lock(&self.held);
        held.pending -= bytes;
        let a = Allocation {
            base: r?,
            class,
            blocks,
        };
        held.record(a);
        drop(held);
        self.segment_event(true, &a);
        Ok(a)
    }

    /// Fill the cache ahead of demand with blocks of `size`'s class, about
    /// `bytes` in all, ready at once (fresh memory is safe for anyone),
    /// spread over the shards. Returns the driver allocations made (their
    /// owner registers them); stops early, keeping what it got, when the
    /// driver runs out of memory.
    pub(crate) fn reserve(
        &self,
        context: RawContext,
        size: usize,
        bytes: usize,
    ) -> (Vec<Allocation>, Result<()>) {
        let class = size_class(size.max(1));
        let mut want = bytes.div_ceil(class);
        let mut per_chunk = (CARVE_BYTES_MAX / class).clamp(1, RESERVE_MAX);
        let mut made = Vec::new();
        let mut next_shard = 0;
        while want > 0 {
            let blocks = want.min(per_chunk);
            let a = match self.allocate(context, class, blocks) {
                Ok(a) => a,
                // A tight device: smaller allocations may still fit.
                Err(e) if e.is_oom() && blocks > 1 => {
                    per_chunk = blocks / 2;
                    continue;
                }
                Err(e) => return (made, Err(e)),
            };
            for p in a.block_addresses() {
                self.shard(next_shard % self.shards.len())
                    .put_ready(p, class);
                next_shard += 1;
            }
            made.push(a);
            want -= blocks;
        }
        (made, Ok(()))
    }

    /// Give back to the driver whole allocations whose blocks are all ready
    /// (fenced, so no queued work uses them), `want` bytes or more, the
    /// largest first and those of `keep_class` (the class a miss just grew)
    /// last. Each allocation is taken out of the shards in one step with
    /// the check that all its blocks are still there, so the other blocks
    /// stay where they are, for the threads that allocate meanwhile.
    /// Nothing while the GPU is busy (a `cuMemFree` would wait for it) or a
    /// capture is under way, or when the owner set no hook
    /// ([`Pool::on_give_back`]). The owner calls it with its context live
    /// and kept so (under the lock a reset takes). The bytes freed.
    pub(crate) fn give_back(&self, context: RawContext, want: usize, keep_class: usize) -> usize {
        let Some(hook) = &self.forget_hook else {
            return 0;
        };
        if want == 0 || self.fencer.busy_confirmed() || self.fencer.capturing() {
            return 0;
        }
        // Ready blocks by allocation (a copy: the shards go on serving).
        let mut ready: FastMap<DevicePtr, usize> = FastMap::default();
        let mut candidates: Vec<Allocation> = Vec::new();
        {
            let mut found = Vec::new();
            for i in 0..self.shards.len() {
                let sh = self.shard(i);
                found.extend(sh.ready.iter().flatten().copied());
                found.extend(sh.large.values().flatten().copied());
            }
            let held = lock(&self.held);
            for p in found {
                *ready.entry(held.base_of(p)).or_default() += 1;
            }
            for (base, n) in &ready {
                if let Some(a) = held.allocations.get(base) {
                    if a.blocks == *n {
                        candidates.push(*a);
                    }
                }
            }
        }
        // Largest first, those that fit in what is wanted; then, if that
        // fell short, the smallest that make it up: a pool of a busy
        // spell's 64 MiB carves given back largest first alone could end
        // far under its budget, and its next hand-outs would miss.
        candidates.sort_by_key(|a| (a.class == keep_class, std::cmp::Reverse(a.bytes())));
        let (mut fits, mut over) = (Vec::new(), Vec::new());
        let mut planned = 0;
        for a in candidates {
            if planned + a.bytes() <= want {
                planned += a.bytes();
                fits.push(a);
            } else {
                over.push(a);
            }
        }
        over.sort_by_key(|a| (a.class == keep_class, a.bytes()));
        let mut freed = 0;
        for a in fits.into_iter().chain(over) {
            if freed >= want {
                break;
            }
            if !self.take_whole(&a) {
                continue;
            }
            // SAFETY: an allocation this pool made in `context` (the
            // caller's live context) whose blocks were all ready and are now
            // out of every shard and out of `held` (`take_whole`): no owner
            // and no queued work uses it.
            let (r, held) = unsafe { self.free_taken(context, &a, hook) };
            drop(held);
            match r {
                Ok(()) => freed += a.bytes(),
                // Its registry entries are gone: it is not handed out again
                // (the driver keeps it until the context goes).
                Err(e) => log::warn!(
                    target: "gpuptr::pool",
                    "giving {} bytes back failed ({e}); they stay unused",
                    a.bytes()
                ),
            }
        }
        if freed > 0 {
            log::debug!(target: "gpuptr::pool", "gave {freed} bytes of idle cache back to the driver");
        }
        freed
    }

    /// Give `a`, already taken out of `held` (its bytes counted in
    /// `held.pending` meanwhile), back to the driver: `forget` sees it
    /// first (the owner forgets its blocks before the driver may hand the
    /// addresses to another allocation), then the segment event, then
    /// `cuMemFree`. Returns the driver's answer and `held`, locked, with
    /// the pending bytes taken off (a caller whose free failed records `a`
    /// again under the same lock).
    ///
    /// # Safety
    ///
    /// `a` is an allocation this pool made in `context`, a live context,
    /// and no owner, shard or queued work uses any of its blocks.
    unsafe fn free_taken(
        &self,
        context: RawContext,
        a: &Allocation,
        forget: impl FnOnce(&Allocation),
    ) -> (Result<()>, std::sync::MutexGuard<'_, Held>) {
        forget(a);
        self.segment_event(false, a);
        let r = self.fencer.own_call(|| {
            // SAFETY: the caller's promise: `a` is this pool's, in the live
            // `context`, and unused.
            relaxed(self.driver.as_ref(), || unsafe {
                self.driver.mem_free(context, a.base)
            })
        });
        let mut held = lock(&self.held);
        held.pending -= a.bytes();
        (r, held)
    }

    /// Take every block of `a` out of the ready lists and `a` out of
    /// `held`, if all its blocks are still ready (none handed out since);
    /// else leave everything as it was. All shards are locked for it, in
    /// order (no one holds a shard lock while taking another).
    fn take_whole(&self, a: &Allocation) -> bool {
        let mut shards: Vec<_> = (0..self.shards.len()).map(|i| self.shard(i)).collect();
        let mut held = lock(&self.held);
        if held.allocations.get(&a.base) != Some(a) {
            return false;
        }
        let end = a.base + a.bytes() as u64;
        let inside = |p: &DevicePtr| (a.base..end).contains(p);
        let count: usize = shards
            .iter()
            .map(|sh| match super::class::class_index(a.class) {
                Some(i) => sh.ready[i].iter().filter(|p| inside(p)).count(),
                None => sh
                    .large
                    .get(&a.class)
                    .map_or(0, |v| v.iter().filter(|p| inside(p)).count()),
            })
            .sum();
        if count != a.blocks {
            return false;
        }
        for sh in &mut shards {
            let before = sh.ready_bytes;
            let list = match super::class::class_index(a.class) {
                Some(i) => Some(&mut sh.ready[i]),
                None => sh.large.get_mut(&a.class),
            };
            let mut gone = 0;
            if let Some(v) = list {
                let n = v.len();
                v.retain(|p| !inside(p));
                gone = n - v.len();
            }
            sh.ready_bytes = before - gone * a.class;
        }
        held.forget(a.base);
        // Still the driver's until the free returns.
        held.pending += a.bytes();
        true
    }

    /// Return every allocation whose blocks are all cached to the driver
    /// (`cuMemFree`, which waits for the device, so blocks still waiting for
    /// a fence are safe to free too). Blocks handed out, and the other
    /// blocks of their allocations, stay. `before_free` sees each allocation
    /// before its free (the driver may reuse its addresses at once after),
    /// and `failed_free` each one whose free failed: it stays cached, so
    /// nothing is lost, and the others are freed all the same. Returns the
    /// allocations freed, and the first driver error.
    ///
    /// During a stream capture no fence can run, and whether `cuMemFree`
    /// still waits for the device then is not known: an allocation with a
    /// block still waiting for its fence then stays, unless `everything`
    /// (the context is ending, a reset or its last drop, and its memory
    /// goes with it).
    pub(crate) fn trim(
        &self,
        context: RawContext,
        everything: bool,
        mut before_free: impl FnMut(&Allocation),
        mut failed_free: impl FnMut(&Allocation),
    ) -> (Vec<Allocation>, Result<()>) {
        // Each cached block with whether its fence is done.
        let mut cached = Vec::new();
        for i in 0..self.shards.len() {
            self.shard(i).drain(&mut cached);
        }
        // Group the cached blocks by allocation.
        let mut by_base: FastMap<DevicePtr, Vec<(DevicePtr, usize, bool)>> = FastMap::default();
        {
            let held = lock(&self.held);
            for b in cached {
                by_base.entry(held.base_of(b.0)).or_default().push(b);
            }
        }
        let mut freed = Vec::new();
        let mut keep = Vec::new();
        let mut first_err = Ok(());
        for (base, blocks) in by_base {
            // Take the record of an allocation whose blocks are all here
            // out of `held` in one step with the check.
            let taken = {
                let mut held = lock(&self.held);
                // Asked per allocation, just before its free, so that a
                // capture begun during the trim is seen.
                let whole = held
                    .allocations
                    .get(&base)
                    .is_some_and(|a| a.blocks == blocks.len())
                    && (everything || blocks.iter().all(|b| b.2) || !self.fencer.capturing());
                whole.then(|| {
                    let a = held.forget(base);
                    // Still the driver's until the free returns.
                    held.pending += a.bytes();
                    a
                })
            };
            let Some(a) = taken else {
                keep.extend(blocks);
                continue;
            };
            // SAFETY: an allocation this pool made in `context` whose blocks
            // are all cached (none handed out), taken out of `held` above and
            // drained from every shard, so no one uses it after this.
            let (r, mut held) = unsafe { self.free_taken(context, &a, &mut before_free) };
            match r {
                Ok(()) => freed.push(a),
                Err(e) => {
                    held.record(a);
                    drop(held);
                    self.segment_event(true, &a);
                    failed_free(&a);
                    keep.extend(blocks);
                    if first_err.is_ok() {
                        first_err = Err(e);
                    }
                }
            }
        }
        // What stays goes back as it was: a block whose fence is not done
        // is pending again (sealed with the next batch), never ready.
        let mut sh = self.shard(0);
        for (p, class, fenced) in keep {
            if fenced {
                sh.put_ready(p, class);
            } else {
                sh.put_pending(p, class);
            }
        }
        if !sh.pending.is_empty() {
            sh.seal(&self.fencer, context, false);
        }
        (freed, first_err)
    }

    /// Forget every block without freeing it (the context was reset and the
    /// memory is gone), and zero the live counts; the blocks it held (the
    /// host cache's are forgotten too).
    pub(crate) fn forget(&self) -> Vec<Allocation> {
        for i in 0..self.shards.len() {
            let mut sh = self.shard(i);
            sh.drain(&mut Vec::new());
            sh.live_bytes = 0;
            sh.class_live.iter_mut().for_each(|c| c.live = 0);
            sh.large_live.clear();
            for k in &mut sh.clients {
                (k.live_bytes, k.live_count) = (0, 0);
            }
        }
        self.host_forget();
        let gone: Vec<Allocation> = {
            let mut held = lock(&self.held);
            held.carved.clear();
            held.bytes = 0;
            held.segments.count.clear();
            held.segments.bytes.clear();
            held.allocations.drain().map(|(_, a)| a).collect()
        };
        for a in &gone {
            self.segment_event(false, a);
        }
        gone
    }

    /// The driver allocations the pool holds, by address, each with the
    /// state of its blocks: `None` handed out, `Some(true)` cached and
    /// ready, `Some(false)` cached and waiting for a fence (memory
    /// snapshots). One lock at a time; nothing changes.
    pub(crate) fn allocations(&self) -> Vec<(Allocation, Vec<Option<bool>>)> {
        let mut cached = FastMap::default();
        for i in 0..self.shards.len() {
            self.shard(i).cached(&mut cached);
        }
        let mut all: Vec<Allocation> = lock(&self.held).allocations.values().copied().collect();
        all.sort_by_key(|a| a.base);
        all.into_iter()
            .map(|a| {
                let states = a
                    .block_addresses()
                    .map(|p| cached.get(&p).copied())
                    .collect();
                (a, states)
            })
            .collect()
    }

    /// Number of driver allocations the pool holds (cached or handed out).
    pub(crate) fn held_blocks(&self) -> usize {
        lock(&self.held).allocations.len()
    }

    /// Bytes the pool holds from the driver (handed out or cached).
    pub(crate) fn held_bytes(&self) -> usize {
        lock(&self.held).bytes
    }

    /// Bytes held from the driver, their peak, and the driver allocations
    /// as PyTorch counts segments, at one moment.
    pub(crate) fn held_stats(&self) -> (usize, usize, SegmentStats) {
        let held = lock(&self.held);
        (held.bytes, held.peak, held.segments)
    }

    /// Cap the bytes the pool holds from the driver (`usize::MAX`: none).
    /// Past it, an allocation goes through the out-of-memory path (the
    /// fence, then returning the cache) and fails as out of memory if that
    /// does not make room. What it holds already is not given back.
    pub(crate) fn set_limit(&self, bytes: usize) {
        self.limit.store(bytes, Ordering::Relaxed);
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }
}
