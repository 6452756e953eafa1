//! Rung 1's wait for a better fit (a large request without a stream):
//! what its unlocked wait must survive, and the waits it must not make.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::super::arena::{State, ANY};
use super::batch::block_fences;
use super::claim::{hook, STEPS};
use super::*;

/// A step for this thread's next `blocking` wait that notes it ran; the
/// note reads `true` once a wait came.
fn note_a_wait() -> Rc<Cell<bool>> {
    let waited = Rc::new(Cell::new(false));
    let w = waited.clone();
    STEPS.with(|s| s.borrow_mut().push(Box::new(move || w.set(true))));
    waited
}

/// `size` allocated without a stream: the grant, whether a `blocking`
/// wait came on the way, and how long it took.
fn alloc_noting_wait(pool: &Pool, ctx: RawContext, size: usize) -> (Grant, bool, Duration) {
    let waited = note_a_wait();
    let t = Instant::now();
    let g = alloc(pool, ctx, size, None);
    let took = t.elapsed();
    STEPS.with(|s| s.borrow_mut().clear());
    (g, waited.get(), took)
}

/// A reset during the unlocked wait fails the request, and the new
/// context's block at the old one's address is not handed out.
#[test]
fn a_reset_during_the_better_fit_wait_fails_the_request_and_takes_nothing_new() {
    crate::sync::set_blocking(hook);
    let (sim, ctx, pool) = pool_without_ahead(1 << 30);
    let pool = Arc::new(pool);
    // One 20 MiB segment: a 4 MiB | b 4 MiB | 12 MiB free for anyone.
    let a = alloc(&pool, ctx, 4 * MIB, None);
    let _b = alloc(&pool, ctx, 4 * MIB, None);
    let k = block_fences(&sim, &pool, ctx);
    let at = a.address;
    pool.release(ctx, back(a, 4 * MIB), None, || true);
    let valid = Arc::new(AtomicBool::new(true));
    let (p2, v2, s2) = (pool.clone(), valid.clone(), sim.clone());
    STEPS.with(|s| {
        s.borrow_mut().push(Box::new(move || {
            p2.forget(|| v2.store(false, Ordering::SeqCst), || {});
            // The new context's segment at a's address, free for anyone.
            p2.arena(0).add_segment(at, 20 * MIB, Kind::Large);
            s2.complete(None);
        }))
    });
    let v: &AtomicBool = &valid;
    let got = pool.alloc(ctx, 4 * MIB, None, 0, Client::Direct, move || {
        v.load(Ordering::SeqCst)
    });
    let waited = STEPS.with(|s| s.borrow_mut().drain(..).count()) == 0;
    assert!(waited, "the request waited");
    assert!(
        got.is_err(),
        "the context was reset during the wait: {got:?}"
    );
    let a0 = pool.arena(0);
    let st = a0.blocks.slot(at).map(|s| a0.blocks[s].state);
    assert_eq!(
        st,
        Some(State::Free(ANY)),
        "the new context's block stays free"
    );
    drop(a0);
    let _ = k;
}

/// Another thread of the arena takes the block the wait was for;
/// the request then takes what is free after the fence, never a block
/// still waiting for one.
#[test]
fn a_block_taken_during_the_better_fit_wait_leaves_the_request_a_fenced_block() {
    crate::sync::set_blocking(hook);
    let (sim, ctx, pool) = pool(1 << 30);
    let pool = Arc::new(pool);
    // One 20 MiB segment: a 4 MiB | b 4 MiB | 12 MiB free for anyone.
    let a = alloc(&pool, ctx, 4 * MIB, None);
    let b = alloc(&pool, ctx, 4 * MIB, None);
    let k = block_fences(&sim, &pool, ctx);
    pool.release(ctx, back(a, 4 * MIB), None, || true);
    // During the wait: the fence ends, another thread takes a's block and
    // frees b without a stream (b waits for the next fence, held back).
    let (p2, s2) = (pool.clone(), sim.clone());
    let other = Arc::new(std::sync::Mutex::new(None));
    let o2 = other.clone();
    STEPS.with(|s| {
        s.borrow_mut().push(Box::new(move || {
            s2.complete(None);
            until_fenced(&p2);
            let g = alloc(&p2, ctx, 4 * MIB, None);
            s2.queue_write(S, k.address, &[1; 4]).unwrap();
            p2.release(ctx, back(b, 4 * MIB), None, || true);
            *o2.lock().unwrap() = Some(g);
        }))
    });
    let got = alloc(&pool, ctx, 4 * MIB, None);
    let taken = other.lock().unwrap().take().unwrap();
    assert_eq!(taken.address, a.address, "the other thread took a");
    assert_ne!(got.address, b.address, "b waits for its fence");
    assert_ne!(got.address, taken.address);
    sim.complete(None);
    for g in [got, taken] {
        pool.release(ctx, back(g, 4 * MIB), None, || true);
    }
    pool.release(ctx, back(k, 4096), Some(S), || true);
    emptied(&sim, ctx, &pool);
}

/// Small and large requests never share a segment, so a fence that frees
/// only small blocks cannot give a large request a better fit: rung 1 must
/// not wait for it (nor ask for it): only large waiting bytes count.
#[test]
fn a_large_hit_does_not_wait_for_a_fence_that_frees_only_small_blocks() {
    crate::sync::set_blocking(hook);
    let (sim, ctx, pool) = pool(1 << 30);
    // A 20 MiB large segment: big 4 MiB | 16 MiB free; a 2 MiB small one.
    let big = alloc(&pool, ctx, 4 * MIB, None);
    let small = alloc(&pool, ctx, 64 << 10, None);
    let k = block_fences(&sim, &pool, ctx);
    pool.release(ctx, back(small, 64 << 10), None, || true);
    assert_eq!(
        pool.stats().pending_bytes,
        64 << 10,
        "only a small block waits"
    );
    let (g, waited, took) = alloc_noting_wait(&pool, ctx, 2 * MIB);
    sim.complete(None);
    for (g, n) in [(g, 2 * MIB), (big, 4 * MIB)] {
        pool.release(ctx, back(g, n), None, || true);
    }
    pool.release(ctx, back(k, 4096), Some(S), || true);
    emptied(&sim, ctx, &pool);
    assert!(
        !waited,
        "a 2 MiB request waited {took:?} for a fence that frees only a 64 KiB small block"
    );
}

/// An exact fit on the quick list (not its newest block, so not taken
/// before the look) is taken as it is: rung 1 does not wait for a fence
/// first (the free set alone would say a better fit may come).
#[test]
fn a_large_hit_does_not_wait_when_the_quick_list_holds_an_exact_fit() {
    crate::sync::set_blocking(hook);
    let (sim, ctx, pool) = pool(1 << 30);
    // One 20 MiB segment: a 4 | b 6 | d 2 | 8 MiB free for anyone.
    let a = alloc(&pool, ctx, 4 * MIB, None);
    let b = alloc(&pool, ctx, 6 * MIB, None);
    let d = alloc(&pool, ctx, 2 * MIB, None);
    // k on a stream now: a stream's take merges the quick list.
    let k = alloc(&pool, ctx, 4096, Some(S));
    let at = a.address;
    // Both wait for one fence (held back until both are freed): one batch.
    sim.queue_write(S, k.address, &[1; 4]).unwrap();
    pool.release(ctx, back(a, 4 * MIB), None, || true);
    pool.release(ctx, back(b, 6 * MIB), None, || true);
    sim.complete(None);
    assert!(pool.flush(ctx));
    {
        let a0 = pool.arena(0);
        let quick: Vec<_> = a0
            .quick
            .iter()
            .map(|&s| (a0.blocks[s].at, a0.blocks[s].size))
            .collect();
        assert_eq!(
            quick.len(),
            2,
            "a and b on the quick list, b newest: {quick:?}"
        );
        assert_eq!(quick[0], (at, 4 * MIB));
    }
    // Fences cannot end while k's queued write is pending.
    sim.queue_write(S, k.address, &[1; 4]).unwrap();
    pool.release(ctx, back(d, 2 * MIB), None, || true);
    let (g, waited, took) = alloc_noting_wait(&pool, ctx, 4 * MIB);
    assert_eq!(g.address, at, "the quick list's exact fit");
    sim.complete(None);
    pool.release(ctx, back(g, 4 * MIB), None, || true);
    pool.release(ctx, back(k, 4096), Some(S), || true);
    emptied(&sim, ctx, &pool);
    assert!(
        !waited,
        "waited {took:?} for a fence although the quick list held an exact 4 MiB fit"
    );
}
