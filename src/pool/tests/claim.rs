//! A claim of a waiting block (rungs 3 and 6) across a context reset: the
//! asker whose context went never touches the new context's blocks.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::super::arena::{State, ANY};
use super::*;

thread_local! {
    /// Steps run, one per wait, before this thread's next `blocking` waits.
    pub(super) static STEPS: RefCell<Vec<Box<dyn FnOnce()>>> = const { RefCell::new(Vec::new()) };
}

pub(super) fn hook(f: &mut dyn FnMut()) {
    let step = STEPS.with(|s| {
        let mut s = s.borrow_mut();
        (!s.is_empty()).then(|| s.remove(0))
    });
    if let Some(step) = step {
        step();
    }
    f();
}

fn state_at(pool: &Pool, at: u64) -> Option<State> {
    let a = pool.arena(0);
    a.blocks.slot(at).map(|s| a.blocks[s].state)
}

/// A asks for 4 MiB and, at rung 3, claims the waiting block P. While it
/// waits for P's fence the context is reset; the new context's segment
/// lands at P's address (CUDA and the simulator reuse addresses), and B,
/// of the new context, claims the new block at P at its own rung 3. A's
/// wait ends, A finds its context gone and puts "its" claim back: it is
/// B's. P then circulates while B still counts on its claim: E takes P,
/// frees it (its kernel's fence not run), C claims P, and B, its own fence
/// done, takes C's claim: P handed out before the fence after E's free.
#[test]
fn a_claim_put_back_after_a_reset_is_not_the_new_contexts() {
    crate::sync::set_blocking(hook);
    let (_sim, ctx, pool) = pool_without_ahead(1 << 30);
    let pool = Arc::new(pool);
    // One 20 MiB segment: g1 4 MiB | g2 2 MiB | g3 14 MiB, all used.
    let g1 = alloc(&pool, ctx, 4 * MIB, None);
    let g2 = alloc(&pool, ctx, 2 * MIB, None);
    let _g3 = alloc(&pool, ctx, 14 * MIB, None);
    let p = g1.address;
    {
        // g2 freed without a stream, not sealed yet (A's miss seals it).
        let mut a = pool.arena(0);
        let s = a.used_at(g2.slot, g2.address).unwrap();
        a.wait_slot(s);
    }
    let valid_a = Arc::new(AtomicBool::new(true));
    let fence_b = Arc::new(AtomicU64::new(0));
    // A's first wait: g1 is freed meanwhile (another thread of the arena).
    let p1 = pool.clone();
    let step1 = move || {
        let mut a = p1.arena(0);
        let s = a.used_at(g1.slot, g1.address).unwrap();
        a.wait_slot(s);
    };
    // A's second wait (A holds the claim of g1 at P): reset, new segment
    // at P, B claims it.
    let (p2, v2, fb) = (pool.clone(), valid_a.clone(), fence_b.clone());
    let step2 = move || {
        assert_eq!(state_at(&p2, p), Some(State::Claimed), "A claimed P");
        p2.forget(|| v2.store(false, Ordering::SeqCst), || {});
        let mut a = p2.arena(0);
        a.add_segment(p, 4 * MIB, Kind::Large);
        let (at, _, s) = a.take_slot(ANY, 4 * MIB).unwrap();
        assert_eq!(at, p);
        a.wait_slot(s);
        let rb = p2.fencer.request(ctx);
        a.seal(rb);
        assert_eq!(
            a.claim_waiting(4 * MIB, 8 * MIB).map(|(at, n, _)| (at, n)),
            Some((p, 4 * MIB))
        );
        fb.store(a.newest_sealed(), Ordering::SeqCst);
    };
    STEPS.with(|s| {
        s.borrow_mut().push(Box::new(step1));
        s.borrow_mut().push(Box::new(step2));
    });
    let va: &AtomicBool = &valid_a;
    let got = pool.alloc(ctx, 4 * MIB, None, 0, Client::Direct, move || {
        va.load(Ordering::SeqCst)
    });
    STEPS.with(|s| s.borrow_mut().clear());
    assert!(got.is_err(), "A's context was reset");
    let b_state = state_at(&pool, p);
    // Go on to the consequence: B's fence ends.
    let rb = fence_b.load(Ordering::SeqCst);
    assert!(rb > 0 && pool.fencer.wait(rb));
    assert!(pool.flush(ctx));
    // E takes a 4 MiB block (P, if it is free) and frees it without a
    // stream while a capture holds its fence back (its kernel runs).
    let e = alloc(&pool, ctx, 4 * MIB, None);
    pool.begin_capture();
    pool.release(ctx, back(e, 4 * MIB), None, || true);
    let fence_e = pool.arena(0).newest_sealed();
    // C, at its rung 3, claims a waiting 4 MiB block.
    let c = pool.arena(0).claim_waiting(4 * MIB, 8 * MIB);
    // B, its fence done, takes its claim.
    let b_took = pool.arena(0).take_claimed(p).is_some();
    let p_fence = if e.address == p { fence_e } else { rb };
    let done = pool.fencer.done();
    pool.end_capture();
    assert!(
        !b_took || done >= p_fence,
        "B took P before the fence after its last free (fence {p_fence}, done {done}); C's claim: {c:?}"
    );
    assert_eq!(
        b_state,
        Some(State::Claimed),
        "B's claim survives A's return (A put it back)"
    );
}
