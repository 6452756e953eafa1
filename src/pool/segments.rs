//! What the pool holds from the driver (segments, sizes, the limit), growth,
//! and giving it back: a trim, a reservation's undo, forgetting after a reset.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::alloc::TRANSIT_WAIT;
use super::arena::{round, BlockState, Kind, SMALL_MAX};
use super::{Pool, SegmentEvents};
use crate::driver::{relaxed, DevicePtr, RawContext};
use crate::error::{Error, Result, CUDA_ERROR_OUT_OF_MEMORY};
use crate::stats::{Client, SegmentStats};
use crate::sync::lock;

/// The segment of a small request (PyTorch's `kSmallBuffer`).
pub(super) const SMALL_SEGMENT: usize = 2 << 20;
/// The segment of a large request under [`MIN_LARGE_ALLOC`] (its
/// `kLargeBuffer`): one segment serves several such requests.
pub(super) const LARGE_SEGMENT: usize = 20 << 20;
/// Requests of at least this many bytes get a segment of their own size,
/// rounded up to [`ROUND_LARGE`] (its `kMinLargeAlloc` and `kRoundLarge`).
pub(super) const MIN_LARGE_ALLOC: usize = 10 << 20;
pub(super) const ROUND_LARGE: usize = 2 << 20;
/// A reservation grows in segments of at most this many bytes.
const RESERVE_SEGMENT: usize = 1 << 30;

/// What a growth costs before one is measured: a `cuMemAlloc` took
/// 39-99 µs on an H100 while kernels ran, 40-60 µs on an idle H200.
const GROW_COST_FIRST: Duration = Duration::from_micros(50);

/// The least a growth is taken to cost: an idle H200's `cuMemAlloc` took
/// at least 20 µs, and a faster driver (the simulator) would make every
/// wait for a fence look dearer than growing.
const GROW_COST_LEAST: Duration = Duration::from_micros(20);

/// The segment a miss of `want` bytes (rounded, [`round`]) grows by.
pub(super) fn segment_size(want: usize) -> usize {
    if want <= SMALL_MAX {
        SMALL_SEGMENT
    } else if want < MIN_LARGE_ALLOC {
        LARGE_SEGMENT
    } else {
        want.div_ceil(ROUND_LARGE).saturating_mul(ROUND_LARGE)
    }
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
    /// The bytes the block takes in its segment (at least `size`).
    pub class: usize,
    /// The arena it goes back to (arenas are at most 1024).
    pub shard: u16,
    /// Its slot in the arena's table, as [`Grant::slot`] (0: find by address).
    pub slot: u32,
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
    /// The bytes the block takes.
    pub class: usize,
    pub shard: u16,
    /// Its slot in the arena's block table: where its release finds it,
    /// if the block there is still at its address.
    pub slot: u32,
    /// The segment this request made, if any: its owner registers it.
    pub new_allocation: Option<Allocation>,
    /// The pool asks its owner to grow this arena ahead of demand
    /// ([`Pool::post_ahead`], then [`Pool::grow_ahead`] on the helper).
    pub ahead: bool,
}

impl Grant {
    pub(super) fn new(
        (address, class, slot): (DevicePtr, usize, u32),
        arena: usize,
        new_allocation: Option<Allocation>,
        ahead: bool,
    ) -> Self {
        Grant {
            address,
            class,
            shard: arena as u16,
            slot,
            new_allocation,
            ahead,
        }
    }
}

/// A segment: one driver allocation of the pool.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Allocation {
    pub base: DevicePtr,
    pub bytes: usize,
    /// The requests it serves (PyTorch's small or large pool).
    pub(crate) kind: Kind,
}

/// A segment as a snapshot sees it: its blocks' address, size, state, in order.
pub(crate) type SegmentView = (Allocation, Vec<(DevicePtr, usize, BlockState)>);

/// The pool's driver memory: what it holds, its limit, growths' cost and those under way.
pub(super) struct Segments {
    pub(super) held: Mutex<Held>,
    /// The most bytes `held` may hold (`usize::MAX`: no limit).
    limit: AtomicUsize,
    /// The pool's `cuMemAlloc` calls' mean time in ns, a moving average.
    pub(super) grow_ns: AtomicU64,
    /// Growths between their driver call and their arena ([`Landing`]):
    /// memory no arena shows yet, which out of memory waits for.
    in_transit: AtomicUsize,
    /// The most [`Segments::wait_in_transit`] waits ([`TRANSIT_WAIT`]; tests lengthen it).
    pub(super) transit_wait: Duration,
    /// Told of each segment made (`true`) or given up (`false`), before any of its blocks is
    /// handed out or the driver may hand its addresses out again ([`Pool::on_segments`]).
    pub(super) events: Option<SegmentEvents>,
}

impl Segments {
    pub(super) fn new() -> Self {
        Segments {
            held: Mutex::default(),
            limit: AtomicUsize::new(usize::MAX),
            grow_ns: AtomicU64::new(GROW_COST_FIRST.as_nanos() as u64),
            in_transit: AtomicUsize::new(0),
            transit_wait: TRANSIT_WAIT,
            events: None,
        }
    }

    /// What a growth costs, so the most a wait for a fence may cost: the
    /// pool's own `cuMemAlloc` calls' mean time, and at least [`GROW_COST_LEAST`].
    #[inline]
    pub(super) fn grow_cost(&self) -> Duration {
        Duration::from_nanos(self.grow_ns.load(Ordering::Relaxed)).max(GROW_COST_LEAST)
    }

    /// Wait a while for growths in transit to reach their arenas (an
    /// allocation out of memory, each round); whether any was under way.
    pub(super) fn wait_in_transit(&self) -> bool {
        let growing = self.in_transit.load(Ordering::Acquire) > 0;
        let until = Instant::now() + self.transit_wait;
        while self.in_transit.load(Ordering::Acquire) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_micros(50));
        }
        growing
    }
}

/// What the pool holds from the driver. Touched on growth, trims and resets.
#[derive(Default)]
pub(super) struct Held {
    /// Segments by base address, with the arena that owns each.
    pub(super) segments: BTreeMap<DevicePtr, (Allocation, usize)>,
    /// Bytes of `segments`.
    pub(super) bytes: usize,
    /// The most `bytes` has been (since the last peak reset).
    pub(super) peak: usize,
    /// Bytes of driver allocations and frees under way: the driver may
    /// hold them beyond `bytes`, so the limit counts them.
    pub(super) pending: usize,
    /// Segments as PyTorch counts them (`bytes`, `peak` by pool, and totals).
    pub(super) segments_stats: SegmentStats,
}

impl Held {
    fn record(&mut self, a: Allocation, arena: usize) {
        self.bytes += a.bytes;
        self.peak = self.peak.max(self.bytes);
        self.segments_stats.made(Self::pool_of(&a), a.bytes);
        self.segments.insert(a.base, (a, arena));
    }

    fn forget(&mut self, base: DevicePtr) -> Option<(Allocation, usize)> {
        let (a, arena) = self.segments.remove(&base)?;
        self.bytes -= a.bytes;
        self.segments_stats.freed(Self::pool_of(&a), a.bytes);
        Some((a, arena))
    }

    /// The block size PyTorch's statistics file a segment under: its small
    /// pool's segments are small.
    fn pool_of(a: &Allocation) -> usize {
        match a.kind {
            Kind::Small => SMALL_MAX,
            Kind::Large => a.bytes.max(SMALL_MAX + 1),
        }
    }

    /// The segment that holds `address`, with its arena.
    fn containing(&self, address: DevicePtr) -> Option<(Allocation, usize)> {
        let (_, &(a, arena)) = self.segments.range(..=address).next_back()?;
        (address < a.base + a.bytes as u64).then_some((a, arena))
    }
}

/// A segment the driver gave a growth, on its way to its arena: counted in
/// the pool's `in_transit` from before the driver call until dropped (once
/// its grower added it to the arena or forgot it), so an allocation out of
/// memory knows not all memory is in view ([`Pool::fence_all_and_take`]).
pub(super) struct Landing<'a> {
    segment: Allocation,
    _transit: InTransit<'a>,
}

impl std::ops::Deref for Landing<'_> {
    type Target = Allocation;
    fn deref(&self) -> &Allocation {
        &self.segment
    }
}

/// One growth counted in the pool's `in_transit` while this lives.
struct InTransit<'a>(&'a AtomicUsize);

impl<'a> InTransit<'a> {
    fn enter(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        InTransit(count)
    }
}

impl Drop for InTransit<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Pool {
    /// One segment of `bytes` for arena `arena`, of `kind`, from the driver,
    /// recorded: the limit is checked and the bytes counted before the call
    /// (two growths at once never both pass it); its time feeds the growth
    /// cost. The caller adds it to its arena before dropping the [`Landing`].
    pub(super) fn grow(
        &self,
        context: RawContext,
        arena: usize,
        bytes: usize,
        kind: Kind,
    ) -> Result<Landing<'_>> {
        let transit = InTransit::enter(&self.segments.in_transit);
        {
            let mut held = lock(&self.segments.held);
            let limit = self.segments.limit.load(Ordering::Relaxed);
            if held.bytes + held.pending + bytes > limit {
                return Err(Error::cuda(
                    "gpuptr pool limit",
                    CUDA_ERROR_OUT_OF_MEMORY,
                    "CUDA_ERROR_OUT_OF_MEMORY",
                ));
            }
            held.pending += bytes;
        }
        let started = Instant::now();
        // Relaxed: a capture under way on some thread neither refuses this
        // allocation nor is invalidated by it.
        // SAFETY: the pool's owner passes its live, retained context.
        let r = relaxed(self.driver.as_ref(), || unsafe {
            self.driver.mem_alloc(context, bytes)
        });
        let took = started.elapsed();
        if r.is_ok() {
            // A moving average over about eight growths.
            let ns = took.as_nanos().min(u64::MAX as u128) as u64;
            let g = &self.segments.grow_ns;
            let old = g.load(Ordering::Relaxed);
            g.store(old - old / 8 + ns / 8, Ordering::Relaxed);
        }
        log::debug!(
            target: "gpuptr::pool",
            "cuMemAlloc of {bytes} bytes took {} us on thread {:?}",
            took.as_micros(),
            std::thread::current().name().unwrap_or("(unnamed)")
        );
        let mut held = lock(&self.segments.held);
        held.pending -= bytes;
        let a = Allocation {
            base: r?,
            bytes,
            kind,
        };
        held.record(a, arena);
        drop(held);
        self.segment_event(true, &a);
        Ok(Landing {
            segment: a,
            _transit: transit,
        })
    }

    /// Forget the segment at `base` without freeing it: its context was
    /// reset while the driver allocated it, and its memory went with it.
    pub(super) fn forget_segment(&self, base: DevicePtr) {
        let gone = lock(&self.segments.held).forget(base);
        if let Some((a, _)) = gone {
            self.segment_event(false, &a);
        }
    }

    /// Fill the cache ahead of demand with about `bytes` free for anyone,
    /// for requests of `size` bytes (their pool), in segments of up to 1 GiB
    /// spread over the arenas; the segments made (the owner registers them).
    /// Out of memory stops it early, keeping what it got. `valid` is asked
    /// as [`Pool::alloc`] asks it: a reset stops it, that segment gone.
    pub(crate) fn reserve(
        &self,
        context: RawContext,
        size: usize,
        bytes: usize,
        valid: impl Fn() -> bool,
    ) -> (Vec<Allocation>, Result<()>) {
        let want = round(size.max(1));
        let kind = Kind::of(want);
        let least = segment_size(want).max(want);
        let mut chunk = RESERVE_SEGMENT.max(least);
        let (mut left, mut made, mut arena) = (bytes, Vec::new(), 0);
        while left > 0 {
            let n = round(left.min(chunk).max(want));
            match self.grow(context, arena, n, kind) {
                Ok(a) => {
                    let mut ar = self.arena(arena);
                    if !valid() {
                        drop(ar);
                        self.forget_segment(a.base);
                        let e = Error::InvalidPointer(
                            "the context was reset during the reservation".into(),
                        );
                        return (made, Err(e));
                    }
                    ar.add_segment(a.base, a.bytes, kind);
                    drop(ar);
                    made.push(*a);
                    left = left.saturating_sub(n);
                    arena = (arena + 1) % self.arenas.len();
                }
                // A tight device: smaller segments may still fit.
                Err(e) if e.is_oom() && n > least => chunk = (n / 2).max(least),
                Err(e) if e.is_oom() && n > want => chunk = want,
                Err(e) => return (made, Err(e)),
            }
        }
        (made, Ok(()))
    }

    /// Give every segment whose memory is all cached back to the driver
    /// (`cuMemFree` waits for the device, so memory waiting for a fence or
    /// free on a stream is safe to free). During a capture (no fence runs,
    /// and whether `cuMemFree` still waits is not known) a segment with a
    /// waiting block stays, unless `everything` (the context ends, by a
    /// reset or its last drop, and its memory with it). `before_free` sees
    /// each segment before its free (the driver may reuse its addresses at
    /// once after), and `failed_free` each whose free failed (cached again,
    /// waiting for a fence). The segments freed, and the first error.
    pub(crate) fn trim(
        &self,
        context: RawContext,
        everything: bool,
        mut before_free: impl FnMut(&Allocation),
        mut failed_free: impl FnMut(&Allocation),
    ) -> (Vec<Allocation>, Result<()>) {
        let waiting = everything || !self.fencer.capturing();
        let done = self.fencer.done();
        let mut by_arena: Vec<Vec<(DevicePtr, usize)>> = vec![Vec::new(); self.arenas.len()];
        for (&base, &(a, arena)) in &lock(&self.segments.held).segments {
            by_arena[arena].push((base, a.bytes));
        }
        let (mut freed, mut first_err) = (Vec::new(), Ok(()));
        for (i, segs) in by_arena.into_iter().enumerate() {
            let mut a = self.arena(i);
            a.promote(done);
            let taken = a.take_free_segments(&segs, waiting);
            drop(a);
            for base in taken {
                let mut held = lock(&self.segments.held);
                let Some((seg, _)) = held.forget(base) else {
                    continue;
                };
                // Still the driver's until the free returns.
                held.pending += seg.bytes;
                drop(held);
                before_free(&seg);
                self.segment_event(false, &seg);
                // SAFETY: a segment this pool made in `context` (the
                // caller's live context), taken out of its arena whole
                // (no block handed out) and out of `held`: no one uses it.
                let r = relaxed(self.driver.as_ref(), || unsafe {
                    self.driver.mem_free(context, seg.base)
                });
                let mut held = lock(&self.segments.held);
                held.pending -= seg.bytes;
                match r {
                    Ok(()) => freed.push(seg),
                    Err(e) => {
                        held.record(seg, i);
                        drop(held);
                        self.segment_event(true, &seg);
                        self.arena(i)
                            .add_waiting_segment(seg.base, seg.bytes, seg.kind);
                        failed_free(&seg);
                        first_err = first_err.and(Err(e));
                    }
                }
            }
        }
        (freed, first_err)
    }

    /// Forget every block, the host cache's too, without freeing it (the
    /// context was reset, its memory gone) and zero the live counts; the
    /// segments held. `bump` (the owner's new epoch) runs with every arena
    /// and the segments locked: no allocation validates against the old
    /// epoch after it, and none that validates against the new finds a
    /// block or segment of the old. `then` runs before the segment events
    /// (the history hears of the live allocations' end before theirs).
    pub(crate) fn forget(&self, bump: impl FnOnce(), then: impl FnOnce()) -> Vec<Allocation> {
        let gone: Vec<Allocation> = {
            let mut arenas: Vec<_> = (0..self.arenas.len()).map(|i| self.arena(i)).collect();
            let mut held = lock(&self.segments.held);
            bump();
            arenas.iter_mut().for_each(|a| a.forget_all());
            held.bytes = 0;
            held.segments_stats.count.clear();
            held.segments_stats.bytes.clear();
            std::mem::take(&mut held.segments)
                .into_values()
                .map(|(a, _)| a)
                .collect()
        };
        self.host_forget();
        then();
        for a in &gone {
            self.segment_event(false, a);
        }
        gone
    }

    /// The segments held, by address, with their blocks' address, size and
    /// state (memory snapshots); one lock at a time, quick lists merged.
    pub(crate) fn allocations(&self) -> Vec<SegmentView> {
        let all: Vec<(Allocation, usize)> = lock(&self.segments.held)
            .segments
            .values()
            .copied()
            .collect();
        all.into_iter()
            .map(|(a, i)| (a, self.arena(i).segment_blocks(a.base, a.bytes)))
            .collect()
    }

    /// `None` if `address` lies in no segment of the pool; else the block
    /// handed out that holds it, its start and size, if one does (a wrap
    /// inside pool memory is bound-checked against its block, not its
    /// segment, and memory cached in the pool is no one's to wrap).
    pub(crate) fn used_block(&self, address: DevicePtr) -> Option<Option<(DevicePtr, usize)>> {
        let (a, arena) = lock(&self.segments.held).containing(address)?;
        Some(self.arena(arena).used_block_at(a.base, address))
    }

    /// Number of segments the pool holds (cached or handed out).
    pub(crate) fn held_blocks(&self) -> usize {
        lock(&self.segments.held).segments.len()
    }

    /// Bytes the pool holds from the driver (handed out or cached).
    pub(crate) fn held_bytes(&self) -> usize {
        lock(&self.segments.held).bytes
    }

    /// Bytes held from the driver, their peak, and the segments as PyTorch
    /// counts them, at one moment.
    pub(crate) fn held_stats(&self) -> (usize, usize, SegmentStats) {
        let held = lock(&self.segments.held);
        (held.bytes, held.peak, held.segments_stats)
    }

    /// Cap the bytes held from the driver (`usize::MAX`: none). Past it an
    /// allocation takes the out-of-memory path (the fence, then returning
    /// the cache), and fails if that makes no room. Nothing held goes back.
    pub(crate) fn set_limit(&self, bytes: usize) {
        self.segments.limit.store(bytes, Ordering::Relaxed);
    }

    pub(crate) fn limit(&self) -> usize {
        self.segments.limit.load(Ordering::Relaxed)
    }
}
