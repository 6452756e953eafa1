//! Context resets and teardown on the simulator: stale pointers never free reused memory, and the cache goes back with the context.

mod common;

use std::sync::Arc;

use common::{sim, sim_pooled};
use gpuptr::driver::Driver;
use gpuptr::Error;

#[test]
fn test_stale_free_after_reset_never_frees_a_reused_address() {
    let (drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    let old = ctx.alloc(1024).unwrap();
    let addr = old.address();
    // Simulate a reset behind gpuptr's back: the memory is gone, and the
    // driver hands the same address to the next allocation.
    // SAFETY: simulates the reset; gpuptr treats `old` as stale from here.
    unsafe { drv.mem_free(ctx.raw(), addr) }.unwrap();
    ctx.invalidate();
    let new = ctx.alloc(1024).unwrap();
    assert_eq!(new.address(), addr, "the simulator reuses the address");
    assert!(matches!(old.check_live(), Err(Error::InvalidPointer(_))));
    assert_eq!(old.free(), Ok(true));
    assert_eq!(drv.live_bytes(), 1024, "the new block survived");
    new.view_all().memset(1, None).unwrap();
    assert_eq!(rt.context_of(addr).unwrap().device(), 0);
    drop(new);
    assert_eq!(drv.live_bytes(), 0);
}

#[test]
fn test_reset_invalidates_live_pointers_and_stale_free_never_frees_a_newer_block() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let old = ctx.alloc(4096).unwrap();
    let old_addr = old.address();
    rt.reset(0).unwrap();
    assert!(matches!(old.check_live(), Err(Error::InvalidPointer(_))));
    // Simulate the driver reset that follows: the memory is gone, and the
    // same address comes back for a new allocation.
    // SAFETY: simulates the reset; `old` is stale and never used again.
    unsafe { drv.mem_free(ctx.raw(), old_addr) }.unwrap();
    let new = ctx.alloc(4096).unwrap();
    assert_eq!(new.address(), old_addr, "the simulator reuses the address");
    old.free().unwrap();
    drop(old);
    new.view_all().memset(1, None).unwrap();
    assert_eq!(
        drv.live_bytes(),
        2 << 20,
        "the new block's segment is intact"
    );
    assert_eq!(rt.stats()[0].live_count, 1);
    drop(new);
    // The stale block was never taken back by the pool: it holds the new one only.
    assert_eq!(rt.pool_held_blocks(0), 1);
    assert_eq!(rt.stats()[0].live_count, 0);
}

#[test]
fn test_context_drop_returns_cached_blocks() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    drop(ctx.alloc(1 << 20).unwrap());
    assert_eq!(drv.live_bytes(), 2 << 20);
    drop(ctx);
    assert_eq!(drv.live_bytes(), 0);
    assert_eq!(drv.retain_count(0), 0);
}

#[test]
fn test_reset_detaches_the_context_so_the_next_use_retains_afresh() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let old = rt.context(0).unwrap();
    let p = old.alloc(4096).unwrap();
    rt.reset(0).unwrap();
    let new = rt.context(0).unwrap();
    assert!(!Arc::ptr_eq(&old, &new), "a fresh Context after the reset");
    assert_eq!(drv.retain_count(0), 2, "the old one still holds its retain");
    drop(p);
    drop(old);
    assert_eq!(drv.retain_count(0), 1, "and releases it when it goes");
    let q = new.alloc(4096).unwrap();
    q.view_all().memset(3, None).unwrap();
}

#[test]
fn test_a_trim_forgets_the_blocks_a_context_kept_across_a_reset_made() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let stale = rt.context(0).unwrap();
    rt.reset(0).unwrap();
    // The context kept across the reset still allocates, from the pool.
    let p = stale.alloc(1 << 20).unwrap();
    let at = p.address();
    drop(p);
    let _live = rt.context(0).unwrap();
    rt.trim().unwrap();
    assert_eq!(drv.live_bytes(), 0);
    assert_eq!(
        rt.registered_ranges(),
        0,
        "no entry outlives the freed memory"
    );
    assert!(rt.context_of(at).is_err());
}

/// Resets racing threads that allocate (with and without a stream),
/// reserve and free, 200 rounds: no reset is straddled. Every pointer that
/// is not stale at the end lies in a segment the pool holds at the end
/// (none in memory a reset gave up: a block, a segment grown or reserved
/// across the reset, or a pointer built from the old epoch's block), every
/// fresh pointer could be written as it was made, the pool's counts never
/// go below zero, and once everything is dropped a trim gives back every
/// segment and registration.
#[test]
fn test_resets_racing_allocations_reservations_and_frees_leave_nothing_stale() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let (_drv, rt) = sim_pooled(1, 4 << 30);
    let stop = AtomicBool::new(false);
    let (made, unwritable) = (AtomicU64::new(0), AtomicU64::new(0));
    let kept = std::thread::scope(|s| {
        let workers: Vec<_> = (0..3u64)
            .map(|t| {
                let (rt, stop, made, unwritable) = (&rt, &stop, &made, &unwritable);
                s.spawn(move || {
                    let mut held = std::collections::VecDeque::new();
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let Ok(ctx) = rt.context(0) else { continue };
                        let size = [4096usize, 1 << 20, 3 << 20, 12 << 20][((i + t) % 4) as usize];
                        let stream = (t == 1).then_some(0x7e57_0001);
                        let Ok(p) = ctx.alloc_for(size, stream, gpuptr::Client::Direct) else {
                            continue;
                        };
                        made.fetch_add(1, Ordering::Relaxed);
                        if p.view_all().memset(7, Some(64)).is_err() && !p.is_stale() {
                            unwritable.fetch_add(1, Ordering::Relaxed);
                        }
                        held.push_back(p);
                        if held.len() > 4 {
                            held.pop_front();
                        }
                    }
                    held
                })
            })
            .collect();
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(ctx) = rt.context(0) {
                    let _ = ctx.reserve(1 << 20, 4 << 20);
                }
            }
        });
        // The workers stop however this thread ends (a failed assertion
        // too), so that the scope ends.
        struct Stop<'a>(&'a AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let stopping = Stop(&stop);
        for _ in 0..200 {
            std::thread::sleep(std::time::Duration::from_micros(500));
            rt.reset(0).unwrap();
            let s = rt.stats()[0];
            assert!(
                s.live_bytes < 1 << 40 && s.pool_bytes < 1 << 40,
                "a count went below zero: {s:?}"
            );
        }
        drop(stopping);
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(made.load(Ordering::Relaxed) > 0);
    assert_eq!(unwritable.load(Ordering::Relaxed), 0);
    let segments = rt.snapshot().segments;
    for p in kept.iter().filter(|p| !p.is_stale()) {
        let inside = segments.iter().any(|g| {
            p.address() >= g.address
                && p.address() + p.size() as u64 <= g.address + g.total_size as u64
        });
        assert!(inside, "{p:?} lies in no segment of the pool's epoch");
    }
    drop(kept);
    let s = rt.stats()[0];
    assert_eq!((s.live_bytes, s.live_count), (0, 0));
    rt.trim().unwrap();
    assert_eq!(rt.stats()[0].pool_bytes, 0, "every segment given back");
    assert_eq!(rt.registered_ranges(), 0);
}

#[test]
fn test_a_context_kept_across_a_reset_going_last_leaves_the_new_contexts_fence_and_lookup_alone() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let old = rt.context(0).unwrap();
    let stale = old.alloc(4096).unwrap();
    rt.reset(0).unwrap();
    drop(old);
    // The new context (the simulator's primary context has the same
    // handle after a reset, as CUDA's may).
    let ctx = rt.context(0).unwrap();
    assert_eq!(ctx.raw(), stale.context().raw());
    // The old context's last holder goes now, after the new one is live.
    drop(stale);
    // The device still knows its live context: a free waits for the fence
    // a flush runs, and the block is reused after it.
    assert_eq!(rt.current_device().unwrap(), 0);
    ctx.make_current().unwrap();
    let p = ctx.alloc(4096).unwrap();
    let at = p.address();
    drop(p);
    assert_eq!(rt.flush_pool(0), Ok(true));
    assert!(rt.stats()[0].pending_bytes == 0, "the flush ran the fence");
    assert_eq!(ctx.alloc(4096).unwrap().address(), at);
}
