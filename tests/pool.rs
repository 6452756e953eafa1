//! The caching pool on the simulator: best fit in segments, fences, out of memory, statistics, arenas and trims.

mod common;

use std::sync::Arc;

use common::{sim_pooled, sim_sharded};
use gpuptr::driver::CallKind;
use gpuptr::{codes, size_class, Error, PoolConfig, Runtime, SimConfig, SimDriver};

#[test]
fn test_pool_reuses_freed_blocks_best_fit_after_a_fence() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let cfg = PoolConfig::default();
    let held: Vec<_> = (0..cfg.fence_count)
        .map(|_| ctx.alloc(1000).unwrap())
        .collect();
    // Rounded to 1 KiB, cut from one 2 MiB segment, one after the other.
    assert_eq!(drv.calls(CallKind::MemAlloc), 1);
    assert!(held
        .windows(2)
        .all(|w| w[1].address() == w[0].address() + 1024));
    let (base, freed): (u64, Vec<u64>) = (
        held[0].address(),
        held.iter().map(|m| m.address()).collect(),
    );
    let syncs = drv.calls(CallKind::Synchronize);
    drop(held);
    assert!(rt.flush_pool(0).unwrap());
    assert!(drv.calls(CallKind::Synchronize) > syncs, "a fence ran");
    assert_eq!(rt.stats()[0].pending_bytes, 0);
    // Freed and fenced, the blocks come back: a request of a freed block's
    // size takes the one freed last back whole (the quick list), and other
    // sizes up to 1 MiB are cut from the rest, merged again, with no
    // driver call.
    let again: Vec<_> = [900, 5000, 1 << 20]
        .iter()
        .map(|&n| ctx.alloc(n).unwrap())
        .collect();
    assert_eq!(drv.calls(CallKind::MemAlloc), 1, "served from the pool");
    assert_eq!(
        again[0].address(),
        freed[freed.len() - 1],
        "taken back whole"
    );
    assert_eq!(
        again[1].address(),
        base,
        "the rest merged: best fit from its start"
    );
    assert_eq!(
        again[2].address(),
        freed[freed.len() - 1] + 1024,
        "the only free block left that fits 1 MiB: the segment's end"
    );
    let s = rt.stats()[0];
    assert!(s.pool_hits >= 3 && s.fences >= 1);
    // A request over 1 MiB never takes a small segment's memory.
    drop(again);
    assert!(rt.flush_pool(0).unwrap());
    let _large = ctx.alloc((1 << 20) + 1).unwrap();
    assert_eq!(drv.calls(CallKind::MemAlloc), 2);
}

#[test]
fn test_pool_oom_releases_cache_and_retries_once() {
    let (drv, rt) = sim_pooled(1, 8 << 20);
    let ctx = rt.context(0).unwrap();
    // Fill the cache with 1 MiB blocks, then ask for a size that only fits
    // once the cache is returned to the driver.
    let blocks: Vec<_> = (0..6).map(|_| ctx.alloc(1 << 20).unwrap()).collect();
    drop(blocks);
    assert_eq!(rt.stats()[0].cached_bytes, 6 << 20);
    assert_eq!(drv.live_bytes(), 6 << 20);
    let big = ctx.alloc(5 << 20).unwrap();
    assert_eq!(rt.stats()[0].cached_bytes, 0, "the cache was released");
    assert_eq!(drv.live_bytes(), 5 << 20);
    drop(big);
    // A request that cannot fit even then is a typed OOM, and nothing leaks.
    let err = ctx.alloc(9 << 20).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { requested, .. } if requested == 9 << 20));
    assert_eq!(rt.stats()[0].live_bytes, 0);
    assert_eq!(
        rt.stats()[0].cached_bytes,
        0,
        "the retry released the cache"
    );
    assert_eq!(drv.live_bytes(), 0);
}

#[test]
fn test_pool_stats_return_to_zero_and_trim_frees_everything() {
    let (drv, rt) = sim_pooled(2, 64 << 20);
    let ctx0 = rt.context(0).unwrap();
    let ctx1 = rt.context(1).unwrap();
    let a: Vec<_> = (0..20)
        .map(|i| ctx0.alloc(100 + i * 1000).unwrap())
        .collect();
    let b: Vec<_> = (0..5).map(|_| ctx1.alloc(4096).unwrap()).collect();
    assert_eq!(rt.stats()[1].live_count, 5);
    assert_eq!(rt.stats()[1].live_bytes, 5 * 4096);
    drop(a);
    drop(b);
    for s in rt.stats() {
        assert_eq!((s.live_bytes, s.live_count), (0, 0), "device {}", s.device);
    }
    assert!(rt.stats()[0].cached_bytes > 0);
    rt.trim().unwrap();
    assert_eq!(drv.live_bytes(), 0);
    assert_eq!(rt.stats()[0].cached_bytes, 0);
    assert!(rt.registered_ranges() == 0);
}

#[test]
fn test_pool_fence_failure_hands_out_nothing_unfenced_and_loses_no_block() {
    // Paced: a fence thread that runs fences back to back (unpaced, with a
    // spare CPU) would retry the failed one at once, and the batch would be
    // ready again before the allocation below looks.
    let drv = Arc::new(SimDriver::new(SimConfig::new(1, 64 << 20)));
    let config = PoolConfig {
        fence_pace: std::time::Duration::from_millis(50),
        ..PoolConfig::default()
    };
    let rt = Runtime::with_pool(drv.clone(), Some(config)).unwrap();
    let ctx = rt.context(0).unwrap();
    let n = PoolConfig::default().fence_count;
    drv.fail_nth(CallKind::Synchronize, 1, codes::CUDA_ERROR_LAUNCH_FAILED);
    let held: Vec<_> = (0..n).map(|_| ctx.alloc(1000).unwrap()).collect();
    let addrs: Vec<_> = held.iter().map(|p| p.address()).collect();
    drop(held);
    // The fence failed: the batch stays held back, and allocations go on
    // from the driver.
    assert!(!rt.flush_pool(0).unwrap() || drv.calls(CallKind::Synchronize) >= 2);
    let p = ctx.alloc(1000).unwrap();
    assert_eq!(rt.stats()[0].live_count, 1);
    drop(p);
    // A later fence succeeds and covers the held-back batch: nothing lost.
    assert!(rt.flush_pool(0).unwrap());
    let s = rt.stats()[0];
    assert_eq!(s.pending_bytes, 0);
    assert!(s.cached_bytes >= (n + 1) * size_class(1000));
    assert_eq!(
        s.cached_bytes,
        drv.live_bytes(),
        "all the pool holds is cached"
    );
    let again: Vec<_> = (0..n).map(|_| ctx.alloc(1000).unwrap()).collect();
    assert!(again.iter().any(|p| addrs.contains(&p.address())));
    drop(again);
    rt.trim().unwrap();
    assert_eq!(drv.live_bytes(), 0);
}

#[test]
fn test_blocks_freed_by_another_thread_go_home_and_are_reused_there() {
    let (drv, rt) = sim_sharded(256 << 20);
    let ctx = rt.context(0).unwrap();
    let n = PoolConfig::default().fence_count;
    let (to_consumer, from_producer) =
        std::sync::mpsc::channel::<Vec<Arc<gpuptr::DevicePointer>>>();
    let consumer = std::thread::spawn(move || drop(from_producer.recv().unwrap()));
    let producer = {
        let ctx = ctx.clone();
        let drv = drv.clone();
        let rt2 = rt.clone();
        std::thread::spawn(move || {
            let batch: Vec<_> = (0..n).map(|_| ctx.alloc(4096).unwrap()).collect();
            let first: std::collections::HashSet<_> = batch.iter().map(|p| p.address()).collect();
            let grown = drv.calls(CallKind::MemAlloc);
            to_consumer.send(batch).unwrap();
            consumer.join().unwrap();
            // The consumer's frees went back to this thread's arena: once
            // fenced, the same blocks come back, no new memory.
            assert!(rt2.flush_pool(0).unwrap());
            let again: Vec<_> = (0..n).map(|_| ctx.alloc(4096).unwrap()).collect();
            assert_eq!(drv.calls(CallKind::MemAlloc), grown);
            assert!(again.iter().all(|p| first.contains(&p.address())));
        })
    };
    producer.join().unwrap();
    assert!(rt.flush_pool(0).unwrap());
    let s = rt.stats()[0];
    assert_eq!((s.live_count, s.live_bytes), (0, 0));
    // Everything cached, fenced.
    assert_eq!(s.pending_bytes, 0);
    assert!(s.cached_bytes >= n * 4096);
    assert_eq!(s.cached_bytes, drv.live_bytes());
    // At least one fence for the consumer's frees and one for the second
    // batch's.
    assert!(s.fences >= 2, "{} fences", s.fences);
}

#[test]
fn test_a_miss_takes_ready_blocks_from_another_shard_before_the_driver() {
    let (drv, rt) = sim_sharded(256 << 20);
    let ctx = rt.context(0).unwrap();
    let n = PoolConfig::default().fence_count;
    {
        let ctx = ctx.clone();
        std::thread::spawn(move || {
            drop(
                (0..n)
                    .map(|_| ctx.alloc(1 << 16).unwrap())
                    .collect::<Vec<_>>(),
            );
        })
        .join()
        .unwrap();
    }
    assert!(rt.flush_pool(0).unwrap());
    let allocs = drv.calls(CallKind::MemAlloc);
    let hits = rt.stats()[0].pool_hits;
    let held: Vec<_> = (0..n).map(|_| ctx.alloc(1 << 16).unwrap()).collect();
    assert_eq!(
        drv.calls(CallKind::MemAlloc),
        allocs,
        "all taken from the other arena"
    );
    assert_eq!((rt.stats()[0].pool_hits - hits) as usize, n);
    // Nothing is free anywhere now: the driver.
    let extra = ctx.alloc(1 << 16).unwrap();
    assert_eq!(drv.calls(CallKind::MemAlloc), allocs + 1);
    drop(extra);
    drop(held);
    assert!(rt.flush_pool(0).unwrap());
    let s = rt.stats()[0];
    assert_eq!((s.cached_bytes, s.live_bytes), (s.pool_bytes, 0));
}

#[test]
fn test_out_of_memory_fences_and_reclaims_every_shard() {
    let (drv, rt) = sim_sharded(8 << 20);
    let ctx = rt.context(0).unwrap();
    {
        // Another thread's shard holds 6 MiB, pending (never fenced).
        let ctx = ctx.clone();
        std::thread::spawn(move || {
            drop(
                (0..6)
                    .map(|_| ctx.alloc(1 << 20).unwrap())
                    .collect::<Vec<_>>(),
            )
        })
        .join()
        .unwrap();
    }
    assert_eq!(drv.live_bytes(), 6 << 20);
    // 1 MiB fits in what the device has left; 4 MiB needs the other
    // arena's memory, fenced, then given back to the driver.
    let small = ctx.alloc(1 << 20).unwrap();
    let big = ctx.alloc(4 << 20).unwrap();
    assert_eq!(rt.stats()[0].live_bytes, 5 << 20);
    assert_eq!(drv.live_bytes(), rt.stats()[0].pool_bytes, "no leak");
    assert!(drv.live_bytes() <= 6 << 20, "cache returned");
    drop((small, big));
    rt.trim().unwrap();
    assert_eq!(drv.live_bytes(), 0);
}

#[test]
fn test_sixteen_threads_on_a_sharded_pool_balance_the_books() {
    let (drv, rt) = sim_pooled(1, 512 << 20);
    let ctx = rt.context(0).unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<Arc<gpuptr::DevicePointer>>();
    let rx = Arc::new(std::sync::Mutex::new(rx));
    std::thread::scope(|s| {
        for t in 0..16 {
            let (ctx, tx, rx) = (ctx.clone(), tx.clone(), rx.clone());
            s.spawn(move || {
                for i in 0..2000 {
                    let p = ctx.alloc(512 + (t * 977 + i * 131) % 200_000).unwrap();
                    if i % 3 == 0 {
                        tx.send(p).unwrap(); // freed by whichever thread takes it
                    }
                    if let Ok(q) = rx.lock().unwrap().try_recv() {
                        drop(q);
                    }
                }
            });
        }
    });
    drop(tx);
    drop(rx);
    let s = rt.stats()[0];
    assert_eq!((s.live_count, s.live_bytes), (0, 0));
    assert_eq!(s.alloc_count, 16 * 2000);
    assert_eq!(s.pool_hits + s.pool_misses, 16 * 2000);
    rt.trim().unwrap();
    assert_eq!(drv.live_bytes(), 0);
    assert!(rt.registered_ranges() == 0);
}

#[test]
fn test_a_failed_free_during_trim_still_unregisters_the_blocks_that_were_freed() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    // Four segments of their own (12 MiB requests).
    drop(
        (0..4)
            .map(|_| ctx.alloc(12 << 20).unwrap())
            .collect::<Vec<_>>(),
    );
    assert_eq!(rt.registered_ranges(), 4);
    drv.fail_nth(CallKind::MemFree, 2, codes::CUDA_ERROR_UNKNOWN);
    assert!(rt.trim().is_err());
    // Three segments went back to the driver; only the one still cached is known.
    assert_eq!(drv.live_bytes(), 12 << 20);
    assert_eq!(rt.registered_ranges(), 1);
    rt.trim().unwrap();
    assert_eq!((drv.live_bytes(), rt.registered_ranges()), (0, 0));
}

#[test]
fn test_a_pool_limit_caps_what_the_pool_holds_and_reuses_first() {
    let (drv, rt) = sim_pooled(1, 256 << 20);
    let ctx = rt.context(0).unwrap();
    rt.set_pool_limit(0, Some(8 << 20)).unwrap();
    assert_eq!(rt.stats()[0].pool_limit, Some(8 << 20));
    let held: Vec<_> = (0..8).map(|_| ctx.alloc(1 << 20).unwrap()).collect();
    assert_eq!(rt.stats()[0].pool_bytes, 8 << 20);
    let over = ctx.alloc(1 << 20);
    assert!(
        matches!(over, Err(gpuptr::Error::OutOfMemory { .. })),
        "{over:?}"
    );
    assert_eq!(drv.live_bytes(), 8 << 20, "nothing past the cap");
    drop(held);
    // Freed blocks come back through the fence; then the cache is reused,
    // and a different size class makes room by returning the cache.
    for _ in 0..100 {
        let p = ctx.alloc(1 << 20).unwrap();
        drop(p);
    }
    let big = ctx.alloc(6 << 20).unwrap();
    assert!(rt.stats()[0].pool_bytes <= 8 << 20);
    drop(big);
    // A reservation stops at the cap with what fitted.
    let got = ctx.reserve(1 << 20, 64 << 20).unwrap();
    assert!(
        got <= 8 << 20 && rt.stats()[0].pool_bytes <= 8 << 20,
        "{got}"
    );
    rt.set_pool_limit(0, None).unwrap();
    assert_eq!(rt.stats()[0].pool_limit, None);
    let _more: Vec<_> = (0..16).map(|_| ctx.alloc(1 << 20).unwrap()).collect();
    assert!(rt.stats()[0].pool_bytes > 8 << 20);
}

#[test]
fn test_threads_under_a_pool_limit_never_hold_more_than_it() {
    let (drv, rt) = sim_pooled(1, 256 << 20);
    rt.set_pool_limit(0, Some(16 << 20)).unwrap();
    let ctx = rt.context(0).unwrap();
    std::thread::scope(|s| {
        for t in 0..4 {
            let (ctx, drv) = (ctx.clone(), &drv);
            s.spawn(move || {
                let mut held = Vec::new();
                for i in 0..2000 {
                    match ctx.alloc(64 << 10 << ((t + i) % 4)) {
                        Ok(p) => held.push(p),
                        Err(gpuptr::Error::OutOfMemory { .. }) => {
                            held.clear();
                        }
                        Err(e) => panic!("{e:?}"),
                    }
                    if held.len() > 3 {
                        held.remove(0);
                    }
                    assert!(drv.live_bytes() <= 16 << 20, "{}", drv.live_bytes());
                }
            });
        }
    });
    assert!(rt.stats()[0].pool_bytes <= 16 << 20);
}

#[test]
fn test_the_out_of_memory_message_names_the_request_the_pool_and_its_limit() {
    let (_drv, rt) = sim_pooled(1, 8 << 20);
    let ctx = rt.context(0).unwrap();
    let live = ctx.alloc(1 << 20).unwrap();
    rt.set_pool_limit(0, Some(2 << 20)).unwrap();
    let msg = ctx.alloc(3 << 20).unwrap_err().to_string();
    for part in [
        "out of memory on device 0: could not allocate 3.00 MiB (3145728 bytes)",
        "gpuptr's pool holds 2.00 MiB from the driver (1.00 MiB in use, 1.00 MiB cached, 0 bytes kept by CUDA graphs)",
        "its limit is 2.00 MiB",
        "the device has 6.00 MiB free of 8.00 MiB",
    ] {
        assert!(msg.contains(part), "{part:?} not in {msg:?}");
    }
    drop(live);
}

#[test]
fn test_a_device_size_near_the_top_of_the_address_space_is_an_error_not_a_panic() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    for size in [usize::MAX, usize::MAX - (1 << 20), usize::MAX / 2 + 1] {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ctx.alloc(size)));
        let r = r.unwrap_or_else(|_| panic!("alloc({size}) panicked"));
        assert!(r.is_err(), "alloc({size}) succeeded");
    }
    assert_eq!(rt.stats()[0].live_bytes, 0);
}

#[test]
fn test_a_simulated_device_larger_than_the_host_runs_out_of_memory_rather_than_abort() {
    // A segment of almost 1 TiB (the simulator's address space per device)
    // on a simulated device of 16 TiB: more than the host can give (Linux
    // refuses one allocation larger than its memory and swap), so the
    // simulator's allocation fails; it aborted the process before.
    // Only where Linux refuses it: with overcommit's heuristic (mode 0) and
    // under 1 TiB of memory and swap (an allocation that succeeds is fine,
    // but proves nothing here).
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib = |key: &str| -> u64 {
        let line = meminfo.lines().find(|l| l.starts_with(key)).unwrap_or("");
        let n = line.split_whitespace().nth(1).and_then(|n| n.parse().ok());
        n.unwrap_or(u64::MAX / 4)
    };
    let heuristic =
        std::fs::read_to_string("/proc/sys/vm/overcommit_memory").is_ok_and(|m| m.trim() == "0");
    if !heuristic || kib("MemTotal:") + kib("SwapTotal:") >= 1 << 30 {
        eprintln!("not run: this host may give a 1 TiB allocation");
        return;
    }
    let (drv, rt) = sim_pooled(1, 1 << 44);
    let ctx = rt.context(0).unwrap();
    let err = ctx
        .alloc((1 << 40) - (2 << 20))
        .expect_err("no host backs 1 TiB");
    assert!(err.is_oom(), "{err}");
    assert_eq!((rt.stats()[0].live_bytes, drv.live_bytes()), (0, 0));
    assert!(
        ctx.alloc(1 << 20).is_ok(),
        "the device still serves what fits"
    );
}

#[test]
fn test_reserving_blocks_of_a_size_near_the_top_of_the_address_space_is_an_error() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ctx.reserve(usize::MAX, 1 << 20)
    }));
    assert!(r.expect("reserve panicked").is_err());
}
