//! The pool over a bare simulator, with no device state or Runtime above it.

use std::sync::Arc;
use std::time::{Duration, Instant};

mod access;
mod arena;
mod audit;
mod batch;
mod better_fit;
mod busy;
mod claim;
mod class;
mod fence;
mod freeset;
mod lookup;

use super::ahead::AHEAD_WAIT;
use super::arena::{Arena, Kind};
use super::{Block, Grant, Pool, PoolConfig};
use crate::driver::{CallKind, Driver, RawContext, SimConfig, SimDriver};
use crate::stats::Client;
use crate::sync::lock;

const MIB: usize = 1 << 20;
/// The slowest driver allocation measured on a busy GPU: a `cuMemAlloc`
/// just after a kernel started on an H100 (`benches/RESULTS.md`). The
/// pool's waits for growths under way are sized against it.
const SLOWEST_BUSY_ALLOC: Duration = Duration::from_micros(490);
/// Two streams of the simulator's.
const S: usize = 0x7e57_0001;
const T: usize = 0x7e57_0002;

/// The block that `grant`, handed out for `size` bytes, gives back.
fn back(grant: Grant, size: usize) -> Block {
    Block {
        epoch: 0,
        address: grant.address,
        class: grant.class,
        shard: grant.shard,
        slot: grant.slot,
        size,
        client: Client::Direct,
    }
}

/// A pool over a simulator of `memory` bytes.
fn pool_with(memory: usize, config: PoolConfig) -> (Arc<SimDriver>, RawContext, Pool) {
    let sim = Arc::new(SimDriver::new(SimConfig::new(1, memory)));
    let ctx = sim.primary_context_retain(0).unwrap();
    (sim.clone(), ctx, Pool::new(config, sim))
}

/// [`pool`] with growth ahead off: only the asking threads allocate.
fn pool_without_ahead(memory: usize) -> (Arc<SimDriver>, RawContext, Pool) {
    let config = PoolConfig {
        shards: 1,
        ahead_bytes: 0,
        ..PoolConfig::default()
    };
    pool_with(memory, config)
}

/// A pool of one arena over a simulator of `memory` bytes.
fn pool(memory: usize) -> (Arc<SimDriver>, RawContext, Pool) {
    let config = PoolConfig {
        shards: 1,
        ..PoolConfig::default()
    };
    pool_with(memory, config)
}

/// The end of a test: every block freed so far past its fence, every
/// segment given back, the driver holding nothing of the pool's.
fn emptied(sim: &SimDriver, ctx: RawContext, pool: &Pool) {
    assert!(pool.flush(ctx));
    assert!(pool.trim(ctx, false, |_| {}, |_| {}).1.is_ok());
    assert_eq!((pool.held_blocks(), sim.live_bytes()), (0, 0));
}

impl super::ahead::Grower {
    /// Whether the helper's thread was started.
    fn started(&self) -> bool {
        self.helper.lock().spawned
    }
}

fn alloc(pool: &Pool, ctx: RawContext, size: usize, stream: Option<usize>) -> Grant {
    pool.alloc(ctx, size, stream, 0, Client::Direct, || true)
        .unwrap()
}

/// The growth helper's thread starts on the pool's first growth for memory
/// without a stream, not on the first growth ahead it is asked for: that
/// ask comes from an allocation on a busy GPU, which would wait for the
/// thread's start (50-130 µs on an H100 host). Stream-ordered memory, and a
/// pool with growth ahead off, start no helper.
#[test]
fn the_growth_helper_starts_on_the_first_growth_without_a_stream() {
    let (_sim, ctx, pool) = pool(64 << 20);
    assert!(!pool.grower.started());
    let _ordered = alloc(&pool, ctx, 4096, Some(0x77));
    assert!(
        !pool.grower.started(),
        "stream-ordered memory needs no helper"
    );
    let a = alloc(&pool, ctx, 4 << 20, None);
    assert!(a.new_allocation.is_some() && pool.grower.started());
    let (_sim, ctx, off) = pool_without_ahead(64 << 20);
    let _b = alloc(&off, ctx, 4 << 20, None);
    assert!(!off.grower.started(), "growth ahead is off");
}

/// A driver that allocates faster than an idle GPU's `cuMemAlloc` (the
/// simulator's takes a few microseconds) never makes a growth look cheaper
/// than 20 µs, the least an idle H200's took: a busy GPU is a fence that
/// has spun longer than a growth, so a cheaper growth would make every
/// idle fence read as busy, and a miss grow rather than wait for it.
#[test]
fn a_growth_is_taken_to_cost_at_least_an_idle_gpus_driver_allocation() {
    let (sim, ctx, pool) = pool(256 << 20);
    for _ in 0..40 {
        let seg = *pool.grow(ctx, 0, 2 * MIB, Kind::Small).unwrap();
        pool.arena(0).add_segment(seg.base, seg.bytes, seg.kind);
    }
    let measured = Duration::from_nanos(
        pool.segments
            .grow_ns
            .load(std::sync::atomic::Ordering::Relaxed),
    );
    assert_eq!(
        pool.segments.grow_cost(),
        measured.max(Duration::from_micros(20))
    );
    assert!(
        pool.segments.grow_cost() >= Duration::from_micros(20),
        "{measured:?} measured"
    );
    assert!(pool.trim(ctx, false, |_| {}, |_| {}).1.is_ok());
    assert_eq!(sim.live_bytes(), 0);
}

/// A miss waits for the helper's growth of its arena at most
/// [`AHEAD_WAIT`]: at least a few times what that growth costs on a busy
/// GPU ([`SLOWEST_BUSY_ALLOC`]), or the miss would make a second driver
/// allocation behind the helper's; and no longer than a few of them, or a
/// helper that never delivers would hold the miss up for longer than
/// growing itself costs.
/// (The wait itself: `a_miss_waits_for_the_helpers_growth_of_its_arena_then_takes_from_it`.)
#[test]
fn a_miss_waits_for_the_helper_about_as_long_as_a_busy_gpus_driver_allocation() {
    let (_sim, _ctx, pool) = pool(64 << 20);
    let busy_alloc = SLOWEST_BUSY_ALLOC;
    assert!(pool.grower.wait >= 4 * busy_alloc, "{:?}", pool.grower.wait);
    assert!(
        pool.grower.wait <= 32 * busy_alloc,
        "{:?}",
        pool.grower.wait
    );
}

/// Memory freed without a stream is reused only after its fence.
#[test]
fn pool_reuses_only_after_its_fence_without_a_runtime() {
    let (sim, ctx, pool) = pool(64 << 20);
    let a = alloc(&pool, ctx, 4096, None);
    assert!(a.new_allocation.is_some());
    sim.queue_write(0x99, a.address, &[1; 4]).unwrap();
    pool.release(ctx, back(a, 4096), None, || true);
    let b = alloc(&pool, ctx, 4096, None);
    assert_ne!(b.address, a.address, "queued work still writes a");
    assert_eq!(pool.stats().pending_bytes, 4096);
    sim.complete(None);
    assert!(pool.flush(ctx));
    let c = alloc(&pool, ctx, 4096, None);
    assert_eq!(c.address, a.address);
    assert!(c.new_allocation.is_none());
    pool.release(ctx, back(b, 4096), None, || true);
    pool.release(ctx, back(c, 4096), None, || true);
    assert!(pool.flush(ctx));
    assert!(pool.trim(ctx, false, |_| {}, |_| {}).1.is_ok());
    assert_eq!((pool.held_blocks(), sim.live_bytes()), (0, 0));
}

/// A block freed on a stream is reused at once on that stream, even while
/// the GPU is busy (no fence), as PyTorch's allocator reuses it; another
/// stream, or an owner with no stream, does not get it.
#[test]
fn a_block_freed_on_a_stream_is_reused_there_at_once() {
    let (sim, ctx, pool) = pool(64 << 20);
    let a = alloc(&pool, ctx, 8 * MIB, Some(S));
    // Work queued on the stream keeps the GPU busy: no fence can end.
    sim.queue_write(S, a.address, &[1; 4]).unwrap();
    pool.release(ctx, back(a, 8 * MIB), Some(S), || true);
    let syncs = sim.calls(CallKind::Synchronize);
    let again = alloc(&pool, ctx, 6 * MIB, Some(S));
    assert_eq!(again.address, a.address, "best fit on its own stream");
    assert!(again.new_allocation.is_none());
    // The rest of the segment is the stream's too (it merged into it).
    let other = alloc(&pool, ctx, 6 * MIB, Some(T));
    assert!(other.new_allocation.is_some(), "another stream grows");
    let none = alloc(&pool, ctx, 6 * MIB, None);
    assert_ne!(none.address, a.address + (6 * MIB) as u64);
    assert_eq!(
        sim.calls(CallKind::Synchronize),
        syncs,
        "no fence on the stream's path"
    );
    for (g, s) in [(again, Some(S)), (other, Some(T)), (none, None)] {
        pool.release(ctx, back(g, 6 * MIB), s, || true);
    }
    sim.complete(None);
    emptied(&sim, ctx, &pool);
}

/// Out of memory, a request takes memory another stream freed, after the
/// fence that covers every stream's work: nothing is lost to the
/// per-stream books.
#[test]
fn out_of_memory_reaches_another_streams_free_memory_after_a_fence() {
    let (sim, ctx, pool) = pool(24 * MIB);
    let a = alloc(&pool, ctx, 20 * MIB, Some(S));
    sim.queue_write(S, a.address, &[1; 4]).unwrap();
    pool.release(ctx, back(a, 20 * MIB), Some(S), || true);
    let waited = std::thread::scope(|s| {
        let w = s.spawn(|| alloc(&pool, ctx, 20 * MIB, Some(T)));
        std::thread::sleep(Duration::from_millis(20));
        let waited = !w.is_finished();
        sim.complete(None);
        let b = w.join().unwrap();
        assert_eq!(b.address, a.address);
        pool.release(ctx, back(b, 20 * MIB), Some(T), || true);
        waited
    });
    assert!(waited, "it waited for the stream's queued work first");
    assert_eq!(sim.lost_writes(), 0);
    assert!(pool.trim(ctx, false, |_| {}, |_| {}).1.is_ok());
}

/// A block also used on another stream (`record_stream`) comes back with
/// no stream: it waits for a fence, and queued work on the other stream
/// never sees it reused.
#[test]
fn a_block_freed_without_a_stream_is_safe_from_every_streams_queued_work() {
    let (sim, ctx, pool) = pool(64 << 20);
    let a = alloc(&pool, ctx, MIB, Some(S));
    sim.queue_write(T, a.address, &[7; 64]).unwrap();
    pool.release(ctx, back(a, MIB), None, || true);
    for _ in 0..50 {
        let g = alloc(&pool, ctx, MIB, Some(S));
        assert_ne!(g.address, a.address);
        pool.release(ctx, back(g, MIB), Some(S), || true);
    }
    sim.complete(None);
    assert_eq!(sim.lost_writes(), 0);
    emptied(&sim, ctx, &pool);
}

/// With no trim to fall back on: a thread out of memory while other
/// threads churn the cache still gets a block once the fence is done.
#[test]
fn pool_out_of_memory_takes_a_fenced_block_against_churning_threads() {
    let (sim, ctx, pool) = pool(4 * MIB);
    std::thread::scope(|s| {
        for t in 0..3 {
            let pool = &pool;
            s.spawn(move || {
                for i in 0..20_000 {
                    match pool.alloc(ctx, MIB, None, 0, Client::Direct, || true) {
                        Ok(b) => pool.release(ctx, back(b, MIB), None, || true),
                        Err(e) => panic!("thread {t}, pair {i}: {e:?}"),
                    }
                }
            });
        }
    });
    assert_eq!(pool.stats().live_count, 0);
    assert!(pool.trim(ctx, false, |_| {}, |_| {}).1.is_ok());
    assert_eq!(sim.live_bytes(), 0);
}

/// A miss while the helper grows its arena waits for that growth (the
/// driver would serialise a second one behind it) and takes from it; a
/// helper that never delivers holds a miss up for [`AHEAD_WAIT`] at most.
#[test]
fn a_miss_waits_for_the_helpers_growth_of_its_arena_then_takes_from_it() {
    let (sim, ctx, mut pool) = pool(256 << 20);
    // Delivery 1 ms into the wait must come within the bound however
    // slowly the host schedules (valgrind took over 5 ms in CI).
    pool.grower.wait = Duration::from_secs(30);
    *lock(&pool.grower.arena) = Some(0);
    let calls = || sim.calls(CallKind::MemAlloc);
    // Out of transit at once: the thread below stands in for the helper.
    let seg = *pool.grow(ctx, 0, 8 * MIB, Kind::Small).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(1));
            pool.arena(0).add_segment(seg.base, seg.bytes, seg.kind);
            pool.ahead_over(0);
        });
        let b = alloc(&pool, ctx, 1 << 16, None);
        assert!(b.new_allocation.is_none(), "no driver call of its own");
        assert_eq!(calls(), 1, "the helper's allocation only");
        assert_eq!(b.address, seg.base);
        pool.release(ctx, back(b, 1 << 16), None, || true);
    });
    assert_eq!(*lock(&pool.grower.arena), None, "the request is over");
    // Nobody delivers: the miss goes to the driver after the bound.
    pool.grower.wait = AHEAD_WAIT;
    *lock(&pool.grower.arena) = Some(0);
    let t = Instant::now();
    let c = alloc(&pool, ctx, 2 * MIB, None);
    assert!(t.elapsed() >= AHEAD_WAIT && c.new_allocation.is_some());
    pool.release(ctx, back(c, 2 * MIB), None, || true);
    emptied(&sim, ctx, &pool);
}

/// The bound of that wait is ten times the slowest driver allocation
/// measured ([`SLOWEST_BUSY_ALLOC`]), and still a few milliseconds: out of
/// memory is answered before a user notices.
#[test]
fn out_of_memory_waits_for_growths_in_transit_ten_slow_driver_allocations() {
    let (_sim, _ctx, pool) = pool(64 << 20);
    assert_eq!(pool.segments.transit_wait, super::alloc::TRANSIT_WAIT);
    assert!(
        pool.segments.transit_wait >= 10 * SLOWEST_BUSY_ALLOC,
        "{:?}",
        pool.segments.transit_wait
    );
    assert!(pool.segments.transit_wait <= Duration::from_millis(10));
}

/// An allocation out of memory waits for a growth in transit (allocated by
/// the driver, not yet in its arena) to land, and takes from it, rather
/// than fail while the memory it needs is on its way; with nothing landing
/// it fails after [`TRANSIT_WAIT`](super::alloc::TRANSIT_WAIT) a round.
#[test]
fn out_of_memory_waits_for_a_growth_in_transit_then_takes_from_it() {
    const MEMORY: usize = 64 << 20;
    let (sim, ctx, mut pool) = pool(MEMORY);
    // Landing 2 ms into the wait must come within the bound however slowly
    // the host schedules (valgrind in CI).
    pool.segments.transit_wait = Duration::from_secs(30);
    let calls = || sim.calls(CallKind::MemAlloc);
    // In transit until dropped: the thread below stands in for its grower.
    let landing = pool.grow(ctx, 0, 8 * MIB, Kind::Small).unwrap();
    let seg = *landing;
    // SAFETY: a live context of the simulator; freed below.
    let filler = unsafe { sim.mem_alloc(ctx, MEMORY - 8 * MIB) }.unwrap();
    let before = calls();
    std::thread::scope(|s| {
        s.spawn(|| {
            // The request's own growths have failed: it is in the wait.
            while calls() < before + 2 {
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_millis(2));
            pool.arena(0).add_segment(seg.base, seg.bytes, seg.kind);
            drop(landing);
        });
        let a = alloc(&pool, ctx, MIB, None);
        assert_eq!(a.address, seg.base, "from the growth that landed");
        assert!(a.new_allocation.is_none());
        pool.release(ctx, back(a, MIB), None, || true);
    });
    // Nothing lands: out of memory after the bound, each round.
    pool.segments.transit_wait = Duration::from_millis(20);
    // SAFETY: allocated above, no longer used.
    unsafe { sim.mem_free(ctx, filler) }.unwrap();
    let held = pool.grow(ctx, 0, 2 * MIB, Kind::Large).unwrap();
    // SAFETY: as above; freed below.
    let filler = unsafe { sim.mem_alloc(ctx, MEMORY - 10 * MIB) }.unwrap();
    let t = Instant::now();
    let r = pool.alloc(ctx, 16 * MIB, None, 0, Client::Direct, || true);
    assert!(r.is_err_and(|e| e.is_oom()));
    assert!(
        t.elapsed() >= pool.segments.transit_wait,
        "{:?}",
        t.elapsed()
    );
    pool.arena(0).add_segment(held.base, held.bytes, held.kind);
    drop(held);
    // SAFETY: allocated above, no longer used.
    unsafe { sim.mem_free(ctx, filler) }.unwrap();
    emptied(&sim, ctx, &pool);
}

/// The pool counts its segments as PyTorch does: small (its small pool's)
/// and large, with peaks and totals, and a trim or a forget takes them
/// away.
#[test]
fn pool_counts_its_segments_by_pool_with_peaks_and_totals() {
    let (sim, ctx, pool) = pool(64 << 20);
    let _small = alloc(&pool, ctx, 4096, None);
    let large = alloc(&pool, ctx, 3 * MIB, None);
    let (bytes, peak, s) = pool.held_stats();
    assert_eq!((s.count.small.current, s.count.large.current), (1, 1));
    assert_eq!(s.count.all.current, 2);
    assert_eq!(s.bytes.small.current, 2 * MIB as u64);
    assert_eq!(s.bytes.large.current, 20 * MIB as u64);
    assert_eq!(s.bytes.all.current as usize, bytes);
    assert_eq!(s.bytes.all.peak as usize, peak);
    pool.release(ctx, back(large, 3 * MIB), None, || true);
    sim.complete(None);
    assert!(pool.flush(ctx));
    assert!(pool.trim(ctx, false, |_| {}, |_| {}).1.is_ok());
    let (bytes, _, s) = pool.held_stats();
    assert_eq!(
        (bytes as u64, s.bytes.all.current),
        (2 * MIB as u64, 2 * MIB as u64)
    );
    assert_eq!((s.count.large.allocated, s.count.large.freed), (1, 1));
    assert_eq!(s.bytes.all.peak, 22 * MIB as u64, "the peak stays");
    pool.reset_peak();
    assert_eq!(pool.held_stats().2.bytes.all.peak, 2 * MIB as u64);
    pool.forget(|| {}, || {});
    let s = pool.held_stats().2;
    assert_eq!((s.count.all.current, s.bytes.all.current), (0, 0));
    assert_eq!(s.count.small.freed, 1);
}

/// A trim gives back every segment with nothing handed out, whatever waits
/// in it (its `cuMemFree` waits for the device), and keeps the others: the
/// pool then holds nothing it does not lend but the rest of those.
#[test]
fn a_trim_leaves_only_segments_with_something_handed_out() {
    let (sim, ctx, pool) = pool(256 << 20);
    let kept = alloc(&pool, ctx, 4096, Some(S));
    let mut freed = Vec::new();
    for (n, s) in [
        (MIB, None),
        (3 * MIB, Some(S)),
        (12 * MIB, Some(T)),
        (600 << 10, None),
    ] {
        freed.push((alloc(&pool, ctx, n, s), n, s));
    }
    for (g, n, s) in freed {
        pool.release(ctx, back(g, n), s, || true);
    }
    // Two segments: the small one (4 KiB lent, the rest freed without a
    // stream and waiting), and a large one (free on two streams).
    assert_eq!(pool.held_blocks(), 2);
    let (gone, r) = pool.trim(ctx, false, |_| {}, |_| {});
    assert!(r.is_ok());
    assert_eq!(gone.len(), 1);
    assert_eq!(pool.held_bytes(), 2 * MIB, "the segment lending 4 KiB");
    assert_eq!(sim.live_bytes(), 2 * MIB);
    pool.release(ctx, back(kept, 4096), Some(S), || true);
    assert!(pool.trim(ctx, false, |_| {}, |_| {}).1.is_ok());
    assert_eq!((pool.held_bytes(), sim.live_bytes()), (0, 0));
}

/// A reservation fills the pool with memory anyone may use, spread over
/// the arenas, and a later request takes it with no driver call.
#[test]
fn a_reservation_serves_later_requests_without_the_driver() {
    let (sim, ctx, pool) = pool_with(
        1 << 30,
        PoolConfig {
            shards: 4,
            ..PoolConfig::default()
        },
    );
    let (made, r) = pool.reserve(ctx, MIB, 64 * MIB, || true);
    assert!(r.is_ok());
    assert_eq!(made.iter().map(|a| a.bytes).sum::<usize>(), 64 * MIB);
    let calls = sim.calls(CallKind::MemAlloc);
    let g: Vec<_> = (0..32).map(|_| alloc(&pool, ctx, MIB, None)).collect();
    assert_eq!(sim.calls(CallKind::MemAlloc), calls);
    for b in g {
        pool.release(ctx, back(b, MIB), None, || true);
    }
    emptied(&sim, ctx, &pool);
}

/// Until fence `newest_sealed` of the one arena is done (at most 5 s).
fn until_fenced(pool: &Pool) {
    let since = Instant::now();
    while pool.fencer.done() < pool.arena(0).newest_sealed() {
        assert!(
            since.elapsed() < Duration::from_secs(5),
            "a fence never ended"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A thread that only frees without a stream, one free at a time after
/// the last fence ended, has each free fenced: a free promotes the batch
/// whose fence is done and seals itself for the next (were it left to the
/// next allocation, a thread that never allocates again would leave its
/// frees unfenced, pending, for good).
#[test]
fn frees_without_an_allocation_between_them_are_each_fenced() {
    let (sim, ctx, pool) = pool(256 << 20);
    let g: Vec<_> = (0..10).map(|_| alloc(&pool, ctx, MIB, None)).collect();
    for grant in g {
        until_fenced(&pool);
        pool.release(ctx, back(grant, MIB), None, || true);
    }
    until_fenced(&pool);
    assert_eq!(pool.stats().pending_bytes, 0, "every free fenced");
    emptied(&sim, ctx, &pool);
}

/// The counts by size class see the quick list merged, as a snapshot
/// does, and read the same before and after one.
#[test]
fn class_counts_see_the_quick_list_merged() {
    let (sim, ctx, pool) = pool(256 << 20);
    let g: Vec<_> = [4096, 8192, 4096]
        .iter()
        .map(|&n| (alloc(&pool, ctx, n, None), n))
        .collect();
    for (grant, n) in g {
        pool.release(ctx, back(grant, n), None, || true);
    }
    assert!(pool.flush(ctx));
    let cached = |p: &Pool| {
        p.class_stats()
            .iter()
            .map(|c| c.cached_blocks)
            .sum::<usize>()
    };
    assert_eq!(cached(&pool), 1, "the segment, one free block");
    assert_eq!(pool.allocations()[0].1.len(), 1);
    assert_eq!(cached(&pool), 1);
    emptied(&sim, ctx, &pool);
}
