//! How the pool grows on the simulator: a segment a miss, sized as PyTorch
//! sizes them; on a busy device (a kernel holds every freed block back
//! behind its fence) never into a block the kernel still writes; a
//! reservation serves a busy device with no driver call.

use std::sync::Arc;

mod common;

use common::{sim_pooled, EndsKernels, NON_BLOCKING};
use gpuptr::driver::CallKind;
use gpuptr::{Context, Runtime, SimDriver};

/// Free a 1 MiB block that a queued kernel still writes, then miss: from
/// here a fence is outstanding behind the kernel (until `drv.complete`).
fn fence_behind_a_kernel(drv: &SimDriver, ctx: &Arc<Context>) {
    let first = ctx.alloc(1 << 20).unwrap();
    drv.queue_write(NON_BLOCKING, first.address(), &[1; 8])
        .unwrap();
    drop(first);
    drop(ctx.alloc(1 << 20).unwrap());
}

/// Whether device 0's pool reads its GPU as busy within `limit`.
fn reads_busy_within(rt: &Runtime, limit: std::time::Duration) -> bool {
    let t = std::time::Instant::now();
    while !rt.pool_reads_busy(0) {
        if t.elapsed() > limit {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    true
}

#[test]
fn test_growth_on_a_busy_device_never_hands_out_a_block_its_work_still_writes() {
    let (drv, rt) = sim_pooled(1, 256 << 20);
    let ctx = rt.context(0).unwrap();
    let _ends = EndsKernels(&drv);
    let a = ctx.alloc(1 << 20).unwrap();
    let a_addr = a.address();
    drv.queue_write(NON_BLOCKING, a_addr, &[1; 8]).unwrap();
    drop(a);
    drop(ctx.alloc(1 << 20).unwrap()); // a miss seals A: a fence is outstanding
    let calls = drv.calls(CallKind::MemAlloc);
    let blocks: Vec<_> = (0..40).map(|_| ctx.alloc(1 << 20).unwrap()).collect();
    // At most PyTorch's one 2 MiB segment per two blocks; fewer once the
    // fence reads as a busy GPU's (segments of `ahead_bytes`), when the
    // miss that grows so also asks the helper for one growth ahead (the
    // blocks are kept, so no hit asks again): that reading can come late
    // on a slow host (valgrind on a loaded one), after 19 small segments.
    let fresh_calls = drv.calls(CallKind::MemAlloc) - calls;
    assert!(
        fresh_calls <= 20 + 1,
        "{fresh_calls} driver calls for 40 blocks"
    );
    let mut addrs: Vec<_> = blocks.iter().map(|p| p.address()).collect();
    addrs.sort_unstable();
    addrs.dedup();
    assert_eq!(addrs.len(), 40, "distinct blocks");
    assert!(
        !addrs.contains(&a_addr),
        "never A's block while the write is queued"
    );
    for p in &blocks {
        assert!(Arc::ptr_eq(&rt.context_of(p.address() + 7).unwrap(), &ctx));
        p.view_all().memset(3, None).unwrap();
    }
    // Blocks do not overlap: each still holds its own bytes.
    blocks[0].view_all().memset(9, None).unwrap();
    assert!(blocks[1]
        .view_all()
        .to_vec()
        .unwrap()
        .iter()
        .all(|b| *b == 3));
    drv.complete(None);
    // Trim frees only allocations none of whose blocks is handed out.
    let keep = blocks[5].address();
    let kept: Vec<_> = blocks.into_iter().filter(|p| p.address() == keep).collect();
    assert!(rt.flush_pool(0).unwrap());
    rt.trim().unwrap();
    assert!(
        drv.live_bytes() >= 1 << 20,
        "the allocation of the kept block stays"
    );
    assert!(
        rt.registered_ranges() >= 1,
        "the kept allocation's blocks stay registered"
    );
    kept[0].view_all().memset(1, None).unwrap();
    drop(kept);
    rt.trim().unwrap();
    assert_eq!((drv.live_bytes(), rt.registered_ranges()), (0, 0));
}

#[test]
fn test_growth_under_a_busy_fence_doubles_what_the_arena_uses() {
    let (drv, rt) = sim_pooled(1, 1 << 30);
    let ctx = rt.context(0).unwrap();
    fence_behind_a_kernel(&drv, &ctx);
    // Let it spin long enough to read as busy whatever the host's load:
    // misses before that grow a segment or a few at a time.
    // (Once: the reading can flip back where the fence thread gets about
    // a quarter of a CPU, as under valgrind.)
    let busy = reads_busy_within(&rt, std::time::Duration::from_secs(5));
    if !busy {
        // A failed assertion must not leave the teardown waiting.
        drv.complete(None);
    }
    assert!(busy, "the fence behind the kernel spins");
    // And spins on: misses look at its CPU over their own intervals.
    std::thread::sleep(std::time::Duration::from_millis(30));
    let calls = drv.calls(CallKind::MemAlloc);
    let blocks: Vec<_> = (0..300).map(|_| ctx.alloc(1 << 20).unwrap()).collect();
    // Each call (the miss's own, or the helper's growth ahead) doubles what
    // the arena uses, up to 64 MiB: a few, not 150 of 2 MiB.
    let grew = drv.calls(CallKind::MemAlloc) - calls;
    let live = drv.live_bytes();
    // Let the queued work end first: a failed assertion must not leave the
    // teardown's cuMemFree waiting for it.
    drop(blocks);
    drv.complete(None);
    assert!(grew <= 10, "{grew} driver calls for 300 blocks");
    assert!(
        live <= (300 + 2 + 64 + 64) << 20,
        "{live}: at most one growth and one growth ahead past the blocks"
    );
}

/// Under `CU_CTX_SCHED_BLOCKING_SYNC` the driver sleeps in
/// `cuCtxSynchronize` while the GPU works, so a busy GPU's fence spends no
/// CPU: the pool tells it by wall time alone, or every large request and
/// every miss past the budget would wait up to 4 ms for a kernel.
#[test]
fn test_a_busy_fence_under_a_blocking_sync_reads_busy_by_its_wall_time() {
    let (drv, rt) = sim_pooled(1, 1 << 30);
    drv.set_primary_flags(0, 0x4);
    let ctx = rt.context(0).unwrap();
    fence_behind_a_kernel(&drv, &ctx);
    let busy = reads_busy_within(&rt, std::time::Duration::from_secs(2));
    drv.complete(None);
    assert!(
        busy,
        "a sleeping fence behind a kernel reads as a busy GPU's"
    );
}

#[test]
fn test_a_reservation_serves_a_busy_device_without_driver_calls() {
    let (drv, rt) = sim_pooled(1, 1 << 30);
    let ctx = rt.context(0).unwrap();
    assert_eq!(ctx.reserve(1 << 20, 100 << 20).unwrap(), 100 << 20);
    assert_eq!(rt.stats()[0].cached_bytes, 100 << 20);
    // A kernel holds every freed block back (the fence cannot finish).
    let first = ctx.alloc(1 << 20).unwrap();
    drv.queue_write(NON_BLOCKING, first.address(), &[1; 8])
        .unwrap();
    drop(first);
    let misses = rt.stats()[0].pool_misses;
    let mut resolved = true;
    for _ in 0..90 {
        let p = ctx.alloc(1 << 20).unwrap();
        resolved &= Arc::ptr_eq(&rt.context_of(p.address() + 5).unwrap(), &ctx);
    }
    // End the queued work before asserting (a failed assertion must not
    // leave the teardown's cuMemFree waiting for it).
    drv.complete(None);
    assert!(resolved);
    // The allocating thread made no driver call (the pool's helper may
    // have grown ahead meanwhile: frees are held back).
    assert_eq!(rt.stats()[0].pool_misses, misses, "no driver call");
    // A reservation past what the device has free is refused whole, as
    // RMM's initial pool is, naming what is free, and takes nothing (it
    // used to take the whole device and still fall short).
    let (small_drv, small) = sim_pooled(1, 10 << 20);
    let err = small
        .context(0)
        .unwrap()
        .reserve(4 << 20, 64 << 20)
        .unwrap_err();
    assert!(matches!(err, gpuptr::Error::OutOfMemory { requested, .. } if requested == 64 << 20));
    assert!(
        err.to_string().contains("the device has 10.00 MiB free"),
        "{err}"
    );
    assert_eq!(small_drv.live_bytes(), 0);
    small.trim().unwrap();
    rt.trim().unwrap();
    assert_eq!((drv.live_bytes(), rt.registered_ranges()), (0, 0));
}

#[test]
fn test_an_idle_device_grows_one_segment_a_miss_sized_as_pytorch_sizes_them() {
    let (drv, rt) = sim_pooled(1, 256 << 20);
    let ctx = rt.context(0).unwrap();
    // At most 1 MiB: 2 MiB segments, two blocks each.
    let held: Vec<_> = (0..10).map(|_| ctx.alloc(1 << 20).unwrap()).collect();
    assert_eq!(drv.calls(CallKind::MemAlloc), 5);
    assert_eq!(
        drv.live_bytes(),
        10 << 20,
        "no GPU busy: nothing grown ahead"
    );
    // Up to 10 MiB: 20 MiB segments, shared; from 10 MiB: their own size,
    // rounded up to 2 MiB.
    let mid: Vec<_> = (0..4).map(|_| ctx.alloc(5 << 20).unwrap()).collect();
    assert_eq!(drv.calls(CallKind::MemAlloc), 6);
    let big = ctx.alloc((11 << 20) + 1).unwrap();
    assert_eq!(drv.calls(CallKind::MemAlloc), 7);
    assert_eq!(drv.live_bytes(), (10 + 20 + 12) << 20);
    drop((held, mid, big));
}

#[test]
fn test_more_threads_than_cpus_churning_fenced_blocks_grow_the_pool_no_more_than_they_hold() {
    // Sixteen threads on two arenas alloc and free 1 MiB with no stream.
    // On a host with fewer CPUs than threads, the fence thread waits for a
    // CPU, so a miss's wait for its fence often ends with the blocks it
    // freed taken by the arena's other threads, which churn them
    // meanwhile; if each such miss grew the pool, it would grow with every
    // fence until the device was full (4 GiB in 800,000 pairs, before a
    // miss claimed a waiting block instead). Live: 16 MiB at most.
    let drv = Arc::new(gpuptr::SimDriver::new(gpuptr::SimConfig::new(1, 4 << 30)));
    let config = gpuptr::PoolConfig {
        shards: 2,
        ..gpuptr::PoolConfig::default()
    };
    let rt = gpuptr::Runtime::with_pool(drv.clone(), Some(config)).unwrap();
    let ctx = rt.context(0).unwrap();
    std::thread::scope(|s| {
        for _ in 0..16 {
            let ctx = ctx.clone();
            s.spawn(move || {
                for _ in 0..25_000 {
                    drop(ctx.alloc(1 << 20).unwrap());
                }
            });
        }
    });
    let st = &rt.stats()[0];
    // Under valgrind (scripts/memcheck) one thread runs at a time, and the
    // fence thread gets a seventeenth of the CPU: 386-680 MiB in five runs,
    // where a native 2-CPU host holds 40-228 MiB.
    let bound = match std::env::var_os("GPUPTR_UNDER_VALGRIND") {
        Some(_) => 1 << 30,
        None => 512 << 20,
    };
    assert!(
        st.peak_pool_bytes <= bound,
        "the pool grew to {} MiB for 16 MiB live ({} misses)",
        st.peak_pool_bytes >> 20,
        st.pool_misses
    );
}
