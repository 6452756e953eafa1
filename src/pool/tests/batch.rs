//! How frees without a stream are batched for fences.

use std::time::Duration;

use super::*;

/// A fence that cannot end while `k`'s queued write on `S` is pending.
pub(super) fn block_fences(sim: &SimDriver, pool: &Pool, ctx: RawContext) -> Grant {
    let k = alloc(pool, ctx, 4096, Some(S));
    sim.queue_write(S, k.address, &[1; 4]).unwrap();
    k
}

/// A `stats()` call (a monitoring thread) that promotes the batch under
/// way leaves the frees gathered behind it for the next free to seal: an
/// allocation then reuses them rather than grow the pool.
#[test]
fn frees_gathered_behind_a_fence_a_stats_call_promoted_are_fenced_at_the_next_free() {
    let (sim, ctx, pool) = pool(1 << 30);
    let k = block_fences(&sim, &pool, ctx);
    let mut x: Vec<_> = (0..8).map(|_| alloc(&pool, ctx, 64 << 10, None)).collect();
    let last = x.pop().unwrap();
    // x0 asks for fence f1 (held back by k's queued work); x1..x6 gather.
    for g in x {
        pool.release(ctx, back(g, 64 << 10), None, || true);
    }
    sim.complete(None);
    until_fenced(&pool);
    let st = pool.stats(); // promotes f1 (x0); x1..x6 still pending
    pool.release(ctx, back(last, 64 << 10), None, || true);
    std::thread::sleep(Duration::from_millis(50));
    let calls = sim.calls(CallKind::MemAlloc);
    // What is free for anyone, then the 7 blocks freed a while ago.
    let free_any = (st.cached_bytes - st.pending_bytes) / (64 << 10);
    let n = free_any + 7;
    let got: Vec<_> = (0..n).map(|_| alloc(&pool, ctx, 64 << 10, None)).collect();
    let grew = sim.calls(CallKind::MemAlloc) - calls;
    for g in got {
        pool.release(ctx, back(g, 64 << 10), None, || true);
    }
    pool.release(ctx, back(k, 4096), Some(S), || true);
    assert_eq!(
        grew, 0,
        "{n} blocks of 64 KiB: {free_any} free for anyone, 7 freed 50 ms before"
    );
    emptied(&sim, ctx, &pool);
}

/// Frees gathered while a fence ran are sealed for the next fence by the
/// first free after it ended, with no allocation between: a thread that
/// frees and goes idle leaves nothing unfenced.
#[test]
fn frees_gathered_behind_a_fence_that_ended_are_fenced_at_the_next_free() {
    let (sim, ctx, pool) = pool(1 << 30);
    let k = block_fences(&sim, &pool, ctx);
    // 8 x 64 KiB without a stream: one 2 MiB segment, 1.5 MiB free for anyone.
    let x: Vec<_> = (0..8).map(|_| alloc(&pool, ctx, 64 << 10, None)).collect();
    let mut x = x.into_iter();
    // x0 asks for fence f1 (held back by k's queued work); x1, x2 gather.
    for g in x.by_ref().take(3) {
        pool.release(ctx, back(g, 64 << 10), None, || true);
    }
    sim.complete(None);
    until_fenced(&pool);
    // f1 is done: this free finds it so (old) and seals x1..x3 for f2.
    pool.release(ctx, back(x.next().unwrap(), 64 << 10), None, || true);
    until_fenced(&pool);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(pool.stats().pending_bytes, 0, "every free fenced");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(pool.stats().pending_bytes, 0, "every free fenced");
    for g in x {
        pool.release(ctx, back(g, 64 << 10), None, || true);
    }
    pool.release(ctx, back(k, 4096), Some(S), || true);
    emptied(&sim, ctx, &pool);
}

/// A hit that promotes the last sealed batch asks for no fence when no
/// free waits for one (a request would start a run of fences for nothing).
#[test]
fn a_hit_that_promotes_the_last_batch_asks_for_no_fence_when_nothing_waits() {
    let (sim, ctx, pool) = pool(1 << 30);
    let x = alloc(&pool, ctx, 4096, None);
    pool.release(ctx, back(x, 4096), None, || true);
    until_fenced(&pool);
    std::thread::sleep(Duration::from_millis(20));
    let syncs = sim.calls(CallKind::Synchronize);
    let y = alloc(&pool, ctx, 8192, None); // promotes x's batch; nothing pending
    std::thread::sleep(Duration::from_millis(50));
    let more = sim.calls(CallKind::Synchronize) - syncs;
    pool.release(ctx, back(y, 8192), None, || true);
    assert_eq!(more, 0, "fences run with nothing freed since the last one");
    emptied(&sim, ctx, &pool);
}

/// A large request without a stream whose best fit is larger than it,
/// while a block it fits waits for a fence, waits for that fence and takes
/// the block, not a cut of the larger one (the cuts left the replayed mixed
/// trace holding up to 2.04x its live bytes, 1.79x with reuse after every
/// fence). The fence's queued work ends as the request starts its wait.
#[test]
fn a_large_request_waits_for_the_fence_of_a_block_it_fits_rather_than_cut_a_larger_one() {
    crate::sync::set_blocking(super::claim::hook);
    let (sim, ctx, pool) = pool(1 << 30);
    // One 20 MiB segment: a 4 MiB | b 4 MiB | 12 MiB free for anyone.
    let a = alloc(&pool, ctx, 4 * MIB, None);
    let b = alloc(&pool, ctx, 4 * MIB, None);
    let k = block_fences(&sim, &pool, ctx);
    let at = a.address;
    pool.release(ctx, back(a, 4 * MIB), None, || true);
    assert_eq!(pool.stats().pending_bytes, 4 * MIB, "a waits for its fence");
    let calls = sim.calls(CallKind::MemAlloc);
    let s2 = sim.clone();
    super::claim::STEPS.with(|s| {
        s.borrow_mut().push(Box::new(move || {
            s2.complete(None);
        }))
    });
    let again = alloc(&pool, ctx, 4 * MIB, None);
    let waited = super::claim::STEPS.with(|s| s.borrow_mut().drain(..).count()) == 0;
    assert!(waited, "the request waited for the fence");
    assert_eq!(again.address, at, "a's block, not a cut of the 12 MiB one");
    assert_eq!(sim.calls(CallKind::MemAlloc), calls, "no growth");
    for (g, n) in [(again, 4 * MIB), (b, 4 * MIB)] {
        pool.release(ctx, back(g, n), None, || true);
    }
    pool.release(ctx, back(k, 4096), Some(S), || true);
    emptied(&sim, ctx, &pool);
}
