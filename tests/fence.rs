//! The pool's reuse rule on the simulator's queued stream work: a block is
//! never handed to a new owner while work queued before its free may still
//! write it, on any stream; stream-ordered frees are reused at once on their
//! own stream; out of memory waits for the fence. The fence itself never
//! holds up the allocating thread, a reset or a teardown, and memory held
//! back for fences never makes an allocation fail.

use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::{sim_pooled, BLOCKING, NON_BLOCKING, STREAMS};
use gpuptr::driver::CallKind;
use gpuptr::{codes, PoolConfig, Runtime, SimConfig, SimDriver};

#[test]
fn test_a_block_written_by_queued_work_is_never_reused_before_that_work_ends() {
    for stream in STREAMS {
        let (drv, rt) = sim_pooled(1, 256 << 20);
        let ctx = rt.context(0).unwrap();
        let a = ctx.alloc(1 << 16).unwrap();
        let a_addr = a.address();
        // A "kernel" on `stream` will write A later; A is freed at once.
        drv.queue_write(stream, a_addr, &[0xAB; 1 << 16]).unwrap();
        drop(a);
        // Many frees of the same size (several full batches), then fresh
        // allocations filled with zeros.
        for _ in 0..3 {
            let churn: Vec<_> = (0..40).map(|_| ctx.alloc(1 << 16).unwrap()).collect();
            drop(churn);
        }
        let fresh: Vec<_> = (0..200).map(|_| ctx.alloc(1 << 16).unwrap()).collect();
        for p in &fresh {
            p.view_all().memset(0, None).unwrap();
        }
        assert!(
            fresh.iter().all(|p| p.address() != a_addr),
            "stream {stream:#x}: A's block was handed out while work still wrote it"
        );
        assert!(rt.stats()[0].pending_bytes >= 1 << 16);
        // The late write lands in A's old block, no one else's.
        assert_eq!(drv.complete(None), 1);
        assert_eq!(drv.lost_writes(), 0);
        for p in &fresh {
            assert!(p.view_all().to_vec().unwrap().iter().all(|b| *b == 0));
        }
        // Once the fence passed, the block is reused.
        assert!(rt.flush_pool(0).unwrap());
        assert_eq!(rt.stats()[0].pending_bytes, 0);
        drop(fresh);
    }
}

#[test]
fn test_the_allocating_thread_never_waits_for_the_gpu() {
    let (drv, rt) = sim_pooled(1, 256 << 20);
    let ctx = rt.context(0).unwrap();
    let a = ctx.alloc(4096).unwrap();
    drv.queue_write(NON_BLOCKING, a.address(), &[1; 16])
        .unwrap();
    // Freed blocks wait behind the queued work, which never completes here;
    // allocations go on regardless.
    drop(a);
    let t = Instant::now();
    for _ in 0..500 {
        drop(ctx.alloc(4096).unwrap());
    }
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(rt.stats()[0].pending_bytes > 0);
    drv.complete(None);
}

#[test]
fn test_a_stream_ordered_free_is_reused_at_once_on_its_own_stream_only() {
    let (drv, rt) = sim_pooled(1, 256 << 20);
    let ctx = rt.context(0).unwrap();
    let s = NON_BLOCKING;
    let a = ctx.alloc_on(4096, s).unwrap();
    let a_addr = a.address();
    drv.queue_write(s, a_addr, &[0xCD; 4096]).unwrap();
    a.free_on(s).unwrap();
    drop(a);
    // Another stream must not get it before the fence.
    let other = ctx.alloc_on(4096, BLOCKING).unwrap();
    assert_ne!(other.address(), a_addr);
    // Its own stream gets it at once: stream order runs the new owner's
    // work after the old owner's.
    let b = ctx.alloc_on(4096, s).unwrap();
    assert_eq!(b.address(), a_addr);
    // SAFETY: `s` is a simulator stream handle.
    unsafe { b.view_all().memset_on(0, None, Some(s)) }.unwrap();
    assert_eq!(drv.complete(None), 2, "the write, then the memset");
    assert!(b.view_all().to_vec().unwrap().iter().all(|x| *x == 0));
}

#[test]
fn test_a_pointer_allocated_on_a_stream_is_freed_on_it_when_dropped() {
    let (_drv, rt) = sim_pooled(1, 256 << 20);
    let ctx = rt.context(0).unwrap();
    let a = ctx.alloc_on(4096, NON_BLOCKING).unwrap();
    let addr = a.address();
    drop(a);
    assert_eq!(ctx.alloc_on(4096, NON_BLOCKING).unwrap().address(), addr);
}

#[test]
fn test_record_stream_holds_the_block_for_the_fence() {
    let (drv, rt) = sim_pooled(1, 256 << 20);
    let ctx = rt.context(0).unwrap();
    let a = ctx.alloc_on(4096, NON_BLOCKING).unwrap();
    let addr = a.address();
    a.record_stream(BLOCKING);
    drv.queue_write(BLOCKING, addr, &[9; 8]).unwrap();
    drop(a);
    let b = ctx.alloc_on(4096, NON_BLOCKING).unwrap();
    assert_ne!(
        b.address(),
        addr,
        "used on another stream: no same-stream reuse"
    );
    drv.complete(None);
    drop(b);
    assert!(rt.flush_pool(0).unwrap());
}

#[test]
fn test_out_of_memory_waits_for_the_fence_and_retries() {
    let (drv, rt) = sim_pooled(1, 8 << 20);
    let ctx = rt.context(0).unwrap();
    let blocks: Vec<_> = (0..8).map(|_| ctx.alloc(1 << 20).unwrap()).collect();
    let busy = blocks[3].address();
    drv.queue_write(NON_BLOCKING, busy, &[7; 64]).unwrap();
    drop(blocks);
    // The device is full and every free block waits behind queued work.
    let completer = {
        let drv = drv.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drv.complete(None)
        })
    };
    let t = Instant::now();
    let p = ctx.alloc(1 << 20).unwrap();
    assert!(
        t.elapsed() >= Duration::from_millis(150),
        "it waited for the fence"
    );
    assert_eq!(completer.join().unwrap(), 1);
    assert_eq!(drv.lost_writes(), 0);
    assert_eq!(rt.stats()[0].live_bytes, 1 << 20);
    drop(p);
}

#[test]
fn test_a_failed_fence_is_retried_and_teardown_never_hangs_on_the_fence_thread() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let a = ctx.alloc(4096).unwrap();
    drv.queue_write(NON_BLOCKING, a.address(), &[1; 8]).unwrap();
    let n = PoolConfig::default().fence_count;
    drop(a);
    drop((0..n).map(|_| ctx.alloc(4096).unwrap()).collect::<Vec<_>>());
    // The fence thread is now blocked in cuCtxSynchronize behind the queued
    // work. Tearing down waits for the GPU work (cuMemFree does), not for a
    // deadlock: complete it from another thread.
    let syncs = drv.calls(CallKind::Synchronize);
    let completer = {
        let drv = drv.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drv.complete(None)
        })
    };
    let t = Instant::now();
    drop(ctx);
    drop(rt);
    completer.join().unwrap();
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(drv.calls(CallKind::Synchronize) >= syncs);
    assert_eq!(drv.live_bytes(), 0);
    assert_eq!(drv.retain_count(0), 0);
}

#[test]
fn test_reset_does_not_wait_for_the_fence_thread() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let a = ctx.alloc(4096).unwrap();
    drv.queue_write(NON_BLOCKING, a.address(), &[1; 8]).unwrap();
    drop(a);
    drop(ctx.alloc(4096).unwrap()); // a miss seals the batch: the fence thread blocks
    let completer = {
        let drv = drv.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drv.complete(None)
        })
    };
    rt.reset(0).unwrap();
    completer.join().unwrap();
    // The next context works, and the old fence did not hand anything out.
    let fresh = rt.context(0).unwrap().alloc(4096).unwrap();
    fresh.view_all().memset(0, None).unwrap();
    assert_eq!(drv.lost_writes(), 0);
}

#[test]
fn test_threads_churning_a_small_live_set_never_run_out_of_memory() {
    // Four threads each hold one 1 MiB block at a time, on a device of
    // 64 MiB: whatever the cache holds back (pending, sealed, carved, on
    // other shards), an allocation must wait, trim and retry, not fail. (It
    // failed when one thread's trim freed an allocation and forgot its
    // record after another thread's new allocation took the same address.)
    for pace_us in [0u64, 20] {
        let drv = Arc::new(SimDriver::new(SimConfig::new(1, 64 << 20)));
        let config = PoolConfig {
            fence_pace: Duration::from_micros(pace_us),
            shards: 4,
            ..PoolConfig::default()
        };
        let rt = Runtime::with_pool(drv.clone(), Some(config)).unwrap();
        let ctx = rt.context(0).unwrap();
        std::thread::scope(|s| {
            for _ in 0..4 {
                let ctx = ctx.clone();
                let (rt, drv) = (&rt, &drv);
                s.spawn(move || {
                    for i in 0..5_000 {
                        if let Err(e) = ctx.alloc(1 << 20) {
                            let (stats, live) = (rt.stats(), drv.live_bytes());
                            panic!("pace {pace_us} µs, pair {i}: {e:?}; {stats:?}, driver {live}");
                        }
                    }
                });
            }
        });
        assert_eq!(rt.stats()[0].live_bytes, 0);
        rt.trim().unwrap();
        assert_eq!((drv.live_bytes(), rt.registered_ranges()), (0, 0));
    }
}

#[test]
fn test_a_trim_that_cannot_free_a_block_keeps_it_waiting_for_its_fence() {
    let (drv, rt) = sim_pooled(1, 256 << 20);
    let ctx = rt.context(0).unwrap();
    // A is freed while a kernel still writes it: it waits for a fence.
    let a = ctx.alloc(1 << 20).unwrap();
    let a_addr = a.address();
    drv.queue_write(NON_BLOCKING, a_addr, &[0xAB; 64]).unwrap();
    drop(a);
    // Every free fails, so the trim keeps what it took from the cache
    // (a carved allocation with a block still live is kept the same way).
    for n in 1..=8 {
        drv.fail_nth(CallKind::MemFree, n, codes::CUDA_ERROR_UNKNOWN);
    }
    assert!(rt.trim().is_err());
    drv.clear_faults();
    let fresh: Vec<_> = (0..64).map(|_| ctx.alloc(1 << 20).unwrap()).collect();
    let reused = fresh.iter().any(|p| p.address() == a_addr);
    for p in &fresh {
        p.view_all().memset(0, None).unwrap();
    }
    // Let the kernel finish before asserting (a failing test then ends
    // instead of waiting for it at the context's teardown).
    drv.complete(None);
    assert!(!reused, "the trim made a block ready before its fence");
    assert_eq!(drv.lost_writes(), 0);
    assert!(fresh
        .iter()
        .all(|p| p.view_all().to_vec().unwrap().iter().all(|b| *b == 0)));
}

/// `pending_bytes` counts only what still waits for a fence: batches whose
/// fence is done are ready, even in a shard whose thread stopped
/// allocating (its blocks were reported pending forever before).
#[test]
fn test_stats_stop_counting_a_batch_as_pending_once_its_fence_is_done() {
    let (_drv, rt) = sim_pooled(1, 256 << 20);
    let ctx = rt.context(0).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            let held: Vec<_> = (0..41).map(|_| ctx.alloc(1 << 20).unwrap()).collect();
            // A free seals at once while no batch waits for a fence, and
            // once `fence_bytes` are pending in any case.
            drop(held);
        });
    });
    assert_eq!(rt.stats()[0].live_bytes, 0);
    let start = Instant::now();
    let unsealed = PoolConfig::default().fence_bytes;
    let mut pending = rt.stats()[0].pending_bytes;
    while pending >= unsealed && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
        pending = rt.stats()[0].pending_bytes;
    }
    assert!(
        pending < unsealed,
        "only unsealed blocks wait: {pending} bytes"
    );
    let s = rt.stats()[0];
    assert_eq!(s.cached_bytes, s.pool_bytes);
    assert!(s.cached_bytes >= 41 << 20);
}
