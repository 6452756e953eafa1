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
