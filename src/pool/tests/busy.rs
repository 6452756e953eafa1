//! How the pool reads a busy GPU and sizes its growths: waits for an idle
//! fence rather than grow, large segments and growth ahead while a fence
//! spins, and what a growth is taken to cost.

use std::time::{Duration, Instant};

use super::*;

/// A miss waits for a fence under way while it has run less than a growth
/// costs (an idle GPU's fence) and reuses what it frees, so a small set
/// churned without a stream stays in a few segments.
#[test]
fn an_idle_churn_waits_for_its_fences_rather_than_grow() {
    let config = PoolConfig {
        shards: 1,
        // Only the allocating thread's own choices count here, past a
        // budget of 1.5 x what is live.
        ahead_bytes: 0,
        headroom_bytes: 0,
        ..PoolConfig::default()
    };
    let (sim, ctx, pool) = pool_with(1 << 30, config);
    for _ in 0..500 {
        let g: Vec<_> = (0..3).map(|_| alloc(&pool, ctx, MIB, None)).collect();
        for b in g {
            pool.release(ctx, back(b, MIB), None, || true);
        }
    }
    // 4 MiB would do; within the budget (4.5 MiB) a miss grows rather
    // than wait, and a fence that lost its CPU for long (a loaded host,
    // valgrind) lets a few more grow.
    let idle = sim.live_bytes();
    assert!(idle <= 16 * MIB, "{idle} bytes held for 3 MiB churned");
    emptied(&sim, ctx, &pool);
}

/// Whether the pool reads its GPU as busy within 5 s (the fence behind a
/// queued kernel spins): at once on an idle host, later on one whose other
/// threads hold the fence thread off its CPU. Once is enough: the reading
/// can flip back where the fence thread gets about a quarter of a CPU (as
/// under valgrind); the fence then spins on 50 ms more, as misses look at
/// its CPU over their own intervals.
fn reads_busy(pool: &Pool) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if pool.gpu_busy() {
            std::thread::sleep(Duration::from_millis(50));
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

/// Make the pool's GPU read busy: a kernel queued on `S` (until
/// `sim.complete`) over a block freed there, then a free without a stream,
/// whose fence spins while the kernel runs: long enough to read as a busy
/// GPU's however slowly the host schedules.
fn turn_busy(sim: &SimDriver, ctx: RawContext, pool: &Pool) {
    let k = alloc(pool, ctx, MIB, Some(S));
    sim.queue_write(S, k.address, &[1; 4]).unwrap();
    pool.release(ctx, back(k, MIB), Some(S), || true);
    let b = alloc(pool, ctx, MIB, None);
    pool.release(ctx, back(b, MIB), None, || true);
    assert!(reads_busy(pool), "the fence behind the kernel spins");
}

/// Past a growth's cost (a busy GPU: a kernel holds every fenced free
/// back), a miss grows at once, by what its arena uses, and
/// hand-outs ask for growth ahead.
#[test]
fn a_busy_gpus_churn_grows_in_large_segments_and_asks_for_growth_ahead() {
    let (sim, ctx, pool) = pool(1 << 30);
    turn_busy(&sim, ctx, &pool);
    let held = sim.live_bytes();
    let mut asked = false;
    for _ in 0..100 {
        let b = alloc(&pool, ctx, MIB, None);
        asked |= b.ahead;
        pool.release(ctx, back(b, MIB), None, || true);
    }
    sim.complete(None);
    assert!(asked, "a busy GPU's churn asks for growth ahead");
    let grown = sim.live_bytes() - held;
    assert!(grown >= PoolConfig::default().ahead_bytes, "{grown}");
    assert!(
        sim.calls(CallKind::MemAlloc) <= 20,
        "{} driver allocations for 100 MiB churned",
        sim.calls(CallKind::MemAlloc)
    );
    emptied(&sim, ctx, &pool);
}

/// A hit asks for growth ahead on a busy GPU once the frees waiting for
/// a fence match what is left free for anyone, or half a growth (an idle
/// GPU's tight loop then mostly skips the fence thread's clock): no ask
/// below that mark, an ask at the first hit past it, and, with a stock
/// under half a growth, an ask well before the stock runs out.
#[test]
fn a_hit_asks_for_growth_ahead_once_frees_waiting_match_the_stock_left() {
    let half = PoolConfig::default().ahead_bytes / 2;
    for stock_mib in [16, 40] {
        let (sim, ctx, pool) = pool(1 << 30);
        let stock: Vec<_> = (0..stock_mib)
            .map(|_| alloc(&pool, ctx, MIB, None))
            .collect();
        stock
            .into_iter()
            .for_each(|b| pool.release(ctx, back(b, MIB), None, || true));
        assert!(pool.flush(ctx));
        let k = alloc(&pool, ctx, MIB, Some(S));
        sim.queue_write(S, k.address, &[1; 4]).unwrap();
        pool.release(ctx, back(k, MIB), Some(S), || true);
        // (waiting, free for anyone once the hit took its block) at each
        // hit; `k`'s block is free on its stream alone.
        let (mut seen, mut first_ask) = (Vec::new(), None);
        for i in 0..stock_mib - 2 {
            let st = pool.stats();
            let free = st.cached_bytes - st.pending_bytes - MIB - MIB;
            let b = alloc(&pool, ctx, MIB, None);
            assert!(b.new_allocation.is_none(), "a hit");
            seen.push((st.pending_bytes, free.min(half)));
            if b.ahead && first_ask.is_none() {
                first_ask = Some(i);
            }
            pool.release(ctx, back(b, MIB), None, || true);
            if i == 0 {
                // The fence now spins behind the kernel: a busy GPU's.
                assert!(reads_busy(&pool), "the fence behind the kernel spins");
            }
        }
        sim.complete(None);
        let i = first_ask.expect("a hit past the mark asks");
        assert!(seen[..i].iter().all(|&(w, mark)| w < mark), "{seen:?} {i}");
        assert!(
            seen[i].0 >= seen[i].1 && seen[i].0 < seen[i].1 + 2 * MIB,
            "{seen:?} {i}"
        );
        assert!(
            i <= stock_mib / 2 + 1,
            "asked with half the stock left: {i} of {stock_mib}"
        );
        assert!(pool.flush(ctx));
    }
}
/// Within the budget, a large request's miss without a stream waits for
/// the fence under way (an idle GPU's ends within microseconds) and reuses
/// what it frees, rather than grow: a large segment stays held as long as
/// the pool lives. (Small requests grow at once within the budget: 2 MiB
/// segments, and a tight loop's misses cost no wait.) Before, a 16 MiB
/// block churned beside 300 MiB live grew the pool by up to the budget's
/// 158 MiB room, one 16 MiB segment a miss.
#[test]
fn a_large_miss_within_the_budget_waits_for_an_idle_fence_rather_than_grow() {
    let (sim, ctx, pool) = pool(1 << 30);
    let live = alloc(&pool, ctx, 300 * MIB, None);
    let before = sim.calls(CallKind::MemAlloc);
    for _ in 0..40 {
        let b = alloc(&pool, ctx, 16 * MIB, None);
        pool.release(ctx, back(b, 16 * MIB), None, || true);
    }
    let grown = sim.calls(CallKind::MemAlloc) - before;
    // One growth for the first block; a wait that ran out (a loaded host,
    // valgrind) may add one or two.
    assert!(grown <= 3, "{grown} growths for one 16 MiB block churned");
    pool.release(ctx, back(live, 300 * MIB), None, || true);
    emptied(&sim, ctx, &pool);
}

/// Growth ahead leaves a quarter of the device's memory free (as
/// [`PoolConfig::ahead_total`] says): it goes on while a growth leaves more
/// than a quarter, and stops where it would leave less, so that it is never
/// why another allocation runs out of memory, and still stocks a device
/// three quarters full.
#[test]
fn growth_ahead_goes_on_until_it_would_leave_less_than_a_quarter_free() {
    const MEMORY: usize = 1 << 30;
    for (free, grows) in [(MEMORY / 4 + 4 * MIB, true), (MEMORY / 4 + MIB, false)] {
        let (sim, ctx, pool) = pool(MEMORY);
        // Nothing waits: growth ahead adds its least, 2 MiB.
        assert_eq!(pool.busy_growth(&pool.arena(0)), 2 * MIB);
        // SAFETY: a live context of the simulator; freed below.
        let filler = unsafe { sim.mem_alloc(ctx, MEMORY - free) }.unwrap();
        let grown = pool.grow_ahead(ctx, 0, Kind::Large, |_| {});
        assert_eq!(
            grown.is_some(),
            grows,
            "{} MiB free of {} MiB",
            free / MIB,
            MEMORY / MIB
        );
        assert_eq!(*lock(&pool.grower.arena), None, "the request is over");
        // SAFETY: allocated above, no longer used.
        unsafe { sim.mem_free(ctx, filler) }.unwrap();
        assert!(pool.trim(ctx, false, |_| {}, |_| {}).1.is_ok());
        assert_eq!(sim.live_bytes(), 0);
    }
}

/// Out of memory while a growth stays in transit (its memory never lands),
/// an allocation waits for it two rounds, the first and one retry (as
/// PyTorch's allocator retries once), each of `transit_wait`, and then
/// fails: not a round more for every growth that might yet land. (The
/// bound has a round and a half of slack, 150 ms, for a slow host:
/// valgrind added 87 ms to the two rounds.)
#[test]
fn out_of_memory_with_a_growth_stuck_in_transit_fails_after_one_retry() {
    const MEMORY: usize = 64 << 20;
    let (sim, ctx, mut pool) = pool(MEMORY);
    pool.segments.transit_wait = Duration::from_millis(100);
    let held = pool.grow(ctx, 0, 2 * MIB, Kind::Large).unwrap();
    // SAFETY: a live context of the simulator; freed below.
    let filler = unsafe { sim.mem_alloc(ctx, MEMORY - 2 * MIB) }.unwrap();
    let t = Instant::now();
    let r = pool.alloc(ctx, 16 * MIB, None, 0, Client::Direct, || true);
    let took = t.elapsed();
    assert!(r.is_err_and(|e| e.is_oom()));
    assert!(
        took >= 2 * pool.segments.transit_wait,
        "{took:?}: fewer than 2 rounds"
    );
    assert!(
        took < 7 * pool.segments.transit_wait / 2,
        "{took:?}: more than 2 rounds"
    );
    pool.arena(0).add_segment(held.base, held.bytes, held.kind);
    drop(held);
    // SAFETY: allocated above, no longer used.
    unsafe { sim.mem_free(ctx, filler) }.unwrap();
    assert!(pool.trim(ctx, false, |_| {}, |_| {}).1.is_ok());
    assert_eq!(sim.live_bytes(), 0);
}

/// A large miss waits for a fence that has not spun a growth's cost (here
/// a fence that never ends, beside a growth taken to cost 10 s: a fence
/// thread that waits for a CPU, or a driver that blocks rather than spins)
/// only for a bounded while ([`FENCE_WAIT_MAX`](super::FENCE_WAIT_MAX)):
/// longer than the 1 ms that let a 3 MiB loop grow to 58 MiB beside a
/// spinning process, and about one period of Linux's scheduler (6 ms), in
/// which a runnable fence thread gets its turn; then it grows. The fastest
/// of three misses must be done within 100 ms (a slow host delays some).
#[test]
fn a_miss_waits_for_a_fence_that_does_not_spin_a_few_milliseconds_then_grows() {
    let (sim, ctx, pool) = pool(1 << 30);
    pool.segments
        .grow_ns
        .store(10_000_000_000, std::sync::atomic::Ordering::Relaxed);
    let k = alloc(&pool, ctx, MIB, Some(S));
    // Queued work that never ends (until completed below): no fence ends.
    sim.queue_write(S, k.address, &[1; 4]).unwrap();
    let first = alloc(&pool, ctx, 16 * MIB, None);
    pool.release(ctx, back(first, 16 * MIB), None, || true);
    let mut fastest = Duration::MAX;
    for _ in 0..3 {
        let calls = sim.calls(CallKind::MemAlloc);
        let t = Instant::now();
        let b = alloc(&pool, ctx, 16 * MIB, None);
        let took = t.elapsed();
        assert!(b.new_allocation.is_some() && sim.calls(CallKind::MemAlloc) == calls + 1);
        assert!(took > Duration::from_millis(1), "waited only {took:?}");
        fastest = fastest.min(took);
        pool.release(ctx, back(b, 16 * MIB), None, || true);
    }
    sim.complete(None);
    assert!(
        fastest < Duration::from_millis(100),
        "a miss waited {fastest:?} for a fence that never ends"
    );
    pool.release(ctx, back(k, MIB), Some(S), || true);
    emptied(&sim, ctx, &pool);
}

/// Before the pool has measured a growth of its own, one is taken to cost
/// what a `cuMemAlloc` took on a GPU: 39-99 µs on an H100 while kernels
/// ran, 40-60 µs on an idle H200. Less, and an idle GPU's fence would
/// read as a busy one's; more, and a busy GPU's first misses would wait
/// for its fences.
#[test]
fn a_growth_is_taken_to_cost_a_gpus_driver_allocation_before_one_is_measured() {
    let (_sim, _ctx, pool) = pool(64 << 20);
    let first = pool.segments.grow_cost();
    assert!(first >= Duration::from_micros(39), "{first:?}");
    assert!(first <= Duration::from_micros(99), "{first:?}");
}

/// A driver measured at 1 µs a growth (faster than any GPU's: a fast
/// simulator's) still makes a growth cost at least 20 µs, the least an
/// idle H200's `cuMemAlloc` took; and the floor stays under the 39 µs
/// that the fastest one took on a busy H100, so that a GPU's own
/// measurements still count.
#[test]
fn a_driver_faster_than_any_gpus_makes_a_growth_cost_20_us_at_least() {
    let (_sim, _ctx, pool) = pool(64 << 20);
    pool.segments
        .grow_ns
        .store(1_000, std::sync::atomic::Ordering::Relaxed);
    let least = pool.segments.grow_cost();
    assert!(least >= Duration::from_micros(20), "{least:?}");
    assert!(least < Duration::from_micros(39), "{least:?}");
}

/// A hit's look at the GPU that finds it idle makes the next seven hits
/// skip theirs (a clock read each: one in eight hits costs about 2% of a
/// hit), and no more: the look after them sees a GPU turned busy (seven
/// hits, about a microsecond, late), and a look that finds it busy skips
/// none. Seven stated here, not read from `IDLE_SKIPS`, so a change to it
/// fails here.
#[test]
fn after_an_idle_look_the_next_hits_skip_theirs_and_no_more() {
    let (sim, ctx, pool) = pool(1 << 30);
    let mut a = Arena::default();
    assert!(!pool.busy_look(&mut a), "an idle GPU");
    turn_busy(&sim, ctx, &pool);
    for i in 0..7 {
        assert!(!pool.busy_look(&mut a), "hit {i} after the idle look skips");
    }
    assert!(pool.busy_look(&mut a), "the next hit looks");
    assert!(
        pool.busy_look(&mut a),
        "and so does the one after a busy look"
    );
    sim.complete(None);
    emptied(&sim, ctx, &pool);
}

/// A growth that found the GPU busy asks for growth ahead even while a
/// hit's earlier idle look left looks to skip (the growth read the GPU
/// itself).
#[test]
fn a_busy_gpus_growth_asks_for_growth_ahead_after_a_hits_idle_look() {
    let (sim, ctx, pool) = pool(1 << 30);
    // A hit's look at an idle GPU (what `Pool::hit` calls).
    assert!(!pool.busy_look(&mut pool.arena(0)), "an idle GPU");
    let k = super::batch::block_fences(&sim, &pool, ctx);
    // 24 MiB freed behind the kernel: more than a growth leaves free.
    let bs: Vec<_> = (0..24).map(|_| alloc(&pool, ctx, MIB, None)).collect();
    bs.into_iter()
        .for_each(|b| pool.release(ctx, back(b, MIB), None, || true));
    assert!(reads_busy(&pool), "the fence behind the kernel spins");
    let g = alloc(&pool, ctx, 2 * MIB, None);
    assert!(g.new_allocation.is_some(), "a busy GPU's growth");
    let grown = g.new_allocation.unwrap().bytes;
    let ahead = g.ahead;
    sim.complete(None);
    pool.release(ctx, back(g, 2 * MIB), None, || true);
    pool.release(ctx, back(k, 4096), Some(S), || true);
    // What the arena used (24 MiB waiting, with the kernel's 4 KiB block
    // in 2 MiB steps), more than the 20 MiB segment the request fits.
    assert!((24 * MIB..=26 * MIB).contains(&grown), "{grown}");
    assert!(ahead, "a busy GPU's growth asks for growth ahead");
    emptied(&sim, ctx, &pool);
}

/// A busy GPU's growth adds what the arena uses, handed out and waiting
/// for its fence (in 2 MiB steps, at most `ahead_bytes`), and so does
/// growth ahead: a fence misread as busy (an idle GPU's, late) made trace
/// (a)'s three 1 MiB blocks a 64 MiB growth and 64 MiB ahead, where now it
/// costs what they used; a long busy spell still takes few growths.
#[test]
fn a_busy_gpus_growth_is_what_its_arena_uses() {
    let config = PoolConfig {
        shards: 1,
        ..PoolConfig::default()
    };
    let (sim, ctx, pool) = pool_with(1 << 30, config);
    let k = super::batch::block_fences(&sim, &pool, ctx);
    let mut growths = Vec::new();
    for round in 0..200 {
        let b = alloc(&pool, ctx, MIB, None);
        if let Some(a) = b.new_allocation {
            growths.push((round, a.bytes / MIB));
        }
        if b.ahead {
            let a = pool.grow_ahead(ctx, 0, Kind::Small, |_| {});
            growths.push((round, a.map_or(0, |a| a.bytes / MIB)));
        }
        pool.release(ctx, back(b, MIB), None, || true);
        if round == 2 {
            assert!(reads_busy(&pool), "the fence behind the kernel spins");
        }
    }
    sim.complete(None);
    pool.release(ctx, back(k, 4096), Some(S), || true);
    // The first growths: a segment, then (busy) what was used by then.
    let waited: Vec<_> = growths.iter().skip(1).take(2).map(|g| g.1).collect();
    assert!(waited.iter().all(|&m| (2..=8).contains(&m)), "{growths:?}");
    let total: usize = growths.iter().map(|g| g.1).sum();
    assert!(total >= 200, "{growths:?}");
    assert!(growths.len() <= 12, "{growths:?}");
    assert!(growths.iter().all(|g| g.1 <= 64), "{growths:?}");
    emptied(&sim, ctx, &pool);
}
