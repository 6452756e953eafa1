//! The pool's cache of pinned host memory on the simulator: reuse after a
//! free, never before the fence says the work queued before the free is
//! done, flags keep blocks apart, the cap, trims, resets and the context's
//! last drop give everything back, and a forked child does nothing.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{sim, sim_pooled, BLOCKING, NON_BLOCKING, STREAMS};
use gpuptr::driver::CallKind;
use gpuptr::{HostFlags, PoolConfig, Runtime, SimConfig, SimDriver};

const MAPPED: HostFlags = HostFlags {
    mapped: true,
    portable: false,
    write_combined: false,
    read_only: false,
};

fn flags(mapped: bool, portable: bool, write_combined: bool) -> HostFlags {
    HostFlags {
        mapped,
        portable,
        write_combined,
        read_only: false,
    }
}

#[test]
fn test_a_freed_host_block_is_reused_after_its_fence() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let a = ctx.alloc_host(1 << 20, HostFlags::default()).unwrap();
    assert!(a.is_pooled());
    let addr = a.host_ptr();
    drop(a);
    assert_eq!(
        drv.calls(CallKind::HostFree),
        0,
        "the free goes to the cache"
    );
    assert_eq!(rt.stats()[0].host.cached_bytes, 1 << 20);
    assert!(rt.flush_pool(0).unwrap());
    let b = ctx.alloc_host(1 << 20, HostFlags::default()).unwrap();
    assert_eq!(b.host_ptr(), addr, "the fenced block is reused");
    assert_eq!(drv.calls(CallKind::HostAlloc), 1);
    let h = rt.stats()[0].host;
    assert_eq!((h.hits, h.misses), (1, 1));
    assert_eq!((h.live_bytes, h.live_count), (1 << 20, 1));
    assert_eq!((h.held_bytes, h.cached_bytes), (1 << 20, 0));
    // A smaller request of the same class takes it too: 1000 bytes is
    // the 1 KiB class, as the device pool rounds.
    drop(b);
    let c = ctx.alloc_host(1000, HostFlags::default()).unwrap();
    let d = ctx.alloc_host(1024, HostFlags::default()).unwrap();
    assert!(rt.flush_pool(0).unwrap());
    drop(c);
    assert!(rt.flush_pool(0).unwrap());
    let e = ctx.alloc_host(900, HostFlags::default()).unwrap();
    assert_eq!(rt.stats()[0].host.live_bytes, 1024 + 900);
    assert_eq!(drv.live_host_bytes(), (1 << 20) + 2 * 1024);
    drop((d, e));
}

#[test]
fn test_a_host_block_used_by_queued_work_is_never_reused_before_that_work_ends() {
    for stream in STREAMS {
        let (drv, rt) = sim_pooled(1, 64 << 20);
        let ctx = rt.context(0).unwrap();
        let a = ctx.alloc_host(1 << 16, MAPPED).unwrap();
        let a_addr = a.host_ptr();
        // An asynchronous copy on `stream` will write A later (a D2H copy
        // into the pinned buffer); A is freed at once.
        drv.queue_write(stream, a_addr as u64, &[0xAB; 1 << 16])
            .unwrap();
        drop(a);
        // Full batches of frees of the same size and flags, then fresh
        // blocks filled with zeros by their new owner.
        for _ in 0..3 {
            let churn: Vec<_> = (0..40)
                .map(|_| ctx.alloc_host(1 << 16, MAPPED).unwrap())
                .collect();
            drop(churn);
        }
        let fresh: Vec<_> = (0..100)
            .map(|_| ctx.alloc_host(1 << 16, MAPPED).unwrap())
            .collect();
        assert!(
            fresh.iter().all(|h| h.host_ptr() != a_addr),
            "stream {stream:#x}: A's block was handed out while work still wrote it"
        );
        for h in &fresh {
            // SAFETY: a live pinned allocation of 64 KiB.
            unsafe { std::ptr::write_bytes(h.host_ptr() as *mut u8, 0, 1 << 16) };
        }
        assert!(rt.stats()[0].host.pending_bytes >= 1 << 16);
        // The late write lands in A's old block, no one else's.
        assert_eq!(drv.complete(None), 1);
        assert_eq!(drv.lost_writes(), 0);
        for h in &fresh {
            // SAFETY: as above.
            let bytes = unsafe { std::slice::from_raw_parts(h.host_ptr() as *const u8, 1 << 16) };
            assert!(bytes.iter().all(|b| *b == 0), "stream {stream:#x}");
        }
        // Once the fence passed, A's block is reused.
        assert!(rt.flush_pool(0).unwrap());
        let h = rt.stats()[0].host;
        assert_eq!(h.pending_bytes, 0);
        let again: Vec<_> = (0..h.cached_bytes >> 16)
            .map(|_| ctx.alloc_host(1 << 16, MAPPED).unwrap())
            .collect();
        assert!(again.iter().any(|h| h.host_ptr() == a_addr));
        assert_eq!(
            rt.stats()[0].host.misses,
            121 + 100,
            "every block of the cache was a hit"
        );
        drop((fresh, again));
    }
}

#[test]
fn test_allocating_pinned_memory_never_waits_for_the_gpu() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let a = ctx.alloc_host(4096, MAPPED).unwrap();
    drv.queue_write(NON_BLOCKING, a.host_ptr() as u64, &[1; 16])
        .unwrap();
    drop(a);
    // The fence waits behind the queued work, which never completes here;
    // allocations and frees go on regardless.
    let t = Instant::now();
    for _ in 0..200 {
        drop(ctx.alloc_host(4096, MAPPED).unwrap());
    }
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(rt.stats()[0].host.pending_bytes > 0);
    drv.complete(None);
    assert_eq!(drv.lost_writes(), 0);
}

#[test]
fn test_host_blocks_of_different_flags_are_never_swapped() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let mut kinds = Vec::new();
    for bits in 0..8u8 {
        kinds.push(flags(bits & 1 != 0, bits & 2 != 0, bits & 4 != 0));
    }
    let first: Vec<_> = kinds
        .iter()
        .map(|f| ctx.alloc_host(8192, *f).unwrap())
        .collect();
    let addresses: Vec<usize> = first.iter().map(|h| h.host_ptr()).collect();
    drop(first);
    assert!(rt.flush_pool(0).unwrap());
    // In reverse order: each kind gets its own block back, never another's.
    for (i, f) in kinds.iter().enumerate().rev() {
        let h = ctx.alloc_host(8192, *f).unwrap();
        assert_eq!(h.host_ptr(), addresses[i], "flags {f:?}");
        assert_eq!(h.device_address().is_some(), f.mapped);
        drop(h);
        assert!(rt.flush_pool(0).unwrap());
    }
    let h = rt.stats()[0].host;
    assert_eq!((h.hits, h.misses), (8, 8));
}

#[test]
fn test_mapped_pooled_memory_is_reachable_from_the_device() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let host = ctx.alloc_host(4096, MAPPED).unwrap();
    let dev = host.device_view().unwrap();
    dev.memset(0x42, Some(16)).unwrap();
    // SAFETY: the pinned allocation is live and 4096 bytes long.
    let bytes = unsafe { std::slice::from_raw_parts(host.host_ptr() as *const u8, 16) };
    assert_eq!(bytes, &[0x42u8; 16]);
    drop(host);
    assert_eq!(rt.stats()[0].host.live_count, 1, "the device view keeps it");
    drop(dev);
    assert_eq!(rt.stats()[0].host.live_count, 0);
}

#[test]
fn test_trim_reset_and_the_last_drop_give_every_host_block_back() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    // A trim waits for the fence, then frees what the cache holds.
    let kept = ctx.alloc_host(4096, HostFlags::default()).unwrap();
    for f in [HostFlags::default(), MAPPED, flags(false, true, true)] {
        drop(ctx.alloc_host(1 << 20, f).unwrap());
    }
    assert_eq!(drv.live_host_bytes(), 3 * (1 << 20) + 4096);
    assert_eq!(rt.trim().unwrap(), 3 << 20);
    assert_eq!(drv.live_host_bytes(), 4096, "the live block stays");
    assert_eq!(rt.stats()[0].host.held_bytes, 4096);
    // A reset gives the cache back (even blocks still waiting for their
    // fence), and the live block turns stale: its free never frees it.
    drop(ctx.alloc_host(8192, HostFlags::default()).unwrap());
    rt.reset(0).unwrap();
    assert_eq!(drv.live_host_bytes(), 4096);
    let frees = drv.calls(CallKind::HostFree);
    drop(kept);
    assert_eq!(drv.calls(CallKind::HostFree), frees);
    let h = rt.stats()[0].host;
    assert_eq!(
        (h.held_bytes, h.live_bytes, h.live_count, h.cached_bytes),
        (0, 0, 0, 0)
    );
    drop(ctx);
    // The last drop of a context gives its cache back before the release.
    let ctx = rt.context(0).unwrap();
    drop(ctx.alloc_host(4096, MAPPED).unwrap());
    drop(ctx.alloc_host(4096, HostFlags::default()).unwrap());
    assert_eq!(drv.live_host_bytes(), 2 * 4096);
    let frees = drv.calls(CallKind::HostFree);
    drop(ctx);
    assert_eq!(drv.calls(CallKind::HostFree), frees + 2);
    assert_eq!(drv.live_host_bytes(), 0);
    assert_eq!(drv.retain_count(0), 0);
}

#[test]
fn test_the_host_cache_keeps_to_its_cap() {
    let drv = Arc::new(SimDriver::new(SimConfig::new(1, 64 << 20)));
    let cfg = PoolConfig {
        host_cache_bytes: 4 << 20,
        ..PoolConfig::default()
    };
    let rt = Runtime::with_pool(drv.clone(), Some(cfg)).unwrap();
    let ctx = rt.context(0).unwrap();
    // Eight 1 MiB blocks live at once, then freed: the cache keeps at
    // most 4 MiB of them once their fence is done.
    let live: Vec<_> = (0..8)
        .map(|_| ctx.alloc_host(1 << 20, HostFlags::default()).unwrap())
        .collect();
    drop(live);
    assert!(rt.flush_pool(0).unwrap());
    drop(ctx.alloc_host(1 << 20, HostFlags::default()).unwrap());
    let h = rt.stats()[0].host;
    assert!(h.cached_bytes <= 4 << 20, "{h:?}");
    assert_eq!(drv.live_host_bytes(), h.held_bytes);
    assert!(h.held_bytes <= 5 << 20, "{h:?}");
    // A class above the cap is not cached: the driver frees it at once.
    let big = ctx.alloc_host(8 << 20, HostFlags::default()).unwrap();
    assert!(!big.is_pooled());
    let frees = drv.calls(CallKind::HostFree);
    drop(big);
    assert_eq!(drv.calls(CallKind::HostFree), frees + 1);
}

#[test]
fn test_the_host_cache_keeps_to_its_cap_once_the_fence_is_done_without_another_free() {
    let drv = Arc::new(SimDriver::new(SimConfig::new(1, 64 << 20)));
    let cfg = PoolConfig {
        host_cache_bytes: 4 << 20,
        ..PoolConfig::default()
    };
    let rt = Runtime::with_pool(drv.clone(), Some(cfg)).unwrap();
    let ctx = rt.context(0).unwrap();
    // 32 blocks of 1 MiB freed: each free finds the cache past its cap
    // with nothing ready yet. Once their fence is done the cache must come
    // down to its cap by itself, with no later host call.
    let live: Vec<_> = (0..32)
        .map(|_| ctx.alloc_host(1 << 20, HostFlags::default()).unwrap())
        .collect();
    drop(live);
    assert!(rt.flush_pool(0).unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut h = rt.stats()[0].host;
    while h.cached_bytes > 4 << 20 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
        h = rt.stats()[0].host;
    }
    assert!(h.cached_bytes <= 4 << 20, "{h:?}");
    assert!(h.held_bytes <= 4 << 20, "{h:?}");
    assert!(drv.live_host_bytes() <= 4 << 20);
}

#[test]
fn test_without_a_pool_host_memory_goes_straight_to_the_driver() {
    let (drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    let h = ctx.alloc_host(4096, HostFlags::default()).unwrap();
    assert!(!h.is_pooled());
    drop(h);
    assert_eq!(drv.calls(CallKind::HostFree), 1);
    assert_eq!(drv.live_host_bytes(), 0);
}

#[test]
fn test_registered_memory_is_never_cached() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let buf = Arc::new(std::sync::Mutex::new(vec![0u8; 4096]));
    let ptr = buf.lock().unwrap().as_ptr() as usize;
    // SAFETY: `buf` is kept alive (and unmoved) by the registration's keepalive.
    let reg = unsafe {
        gpuptr::HostMemory::register(&ctx, ptr, 4096, MAPPED, Some(Box::new(buf.clone())))
    }
    .unwrap();
    assert!(!reg.is_pooled());
    drop(reg);
    assert_eq!(drv.live_registrations(), 0, "unregistered at once");
    let h = rt.stats()[0].host;
    assert_eq!((h.held_bytes, h.cached_bytes, h.misses), (0, 0, 0));
}

#[test]
fn test_out_of_pinned_memory_gives_the_ready_cache_back_and_retries() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    drop(ctx.alloc_host(1 << 20, HostFlags::default()).unwrap());
    assert!(rt.flush_pool(0).unwrap());
    // The next driver allocation fails as out of memory once: a block of
    // another class must come from the driver, which gets the cache back.
    drv.fail_nth(
        CallKind::HostAlloc,
        1,
        gpuptr::codes::CUDA_ERROR_OUT_OF_MEMORY,
    );
    let h = ctx.alloc_host(4096, HostFlags::default()).unwrap();
    assert_eq!(drv.live_host_bytes(), 4096, "the cached 1 MiB went back");
    drop(h);
    // Twice: the error surfaces, typed, and nothing leaks.
    drv.fail_nth(
        CallKind::HostAlloc,
        1,
        gpuptr::codes::CUDA_ERROR_OUT_OF_MEMORY,
    );
    drv.fail_nth(
        CallKind::HostAlloc,
        2,
        gpuptr::codes::CUDA_ERROR_OUT_OF_MEMORY,
    );
    let e = ctx.alloc_host(1 << 20, HostFlags::default()).unwrap_err();
    assert!(e.is_oom(), "{e}");
    drv.clear_faults();
    rt.trim().unwrap();
    assert_eq!(drv.live_host_bytes(), 0);
}

#[test]
fn test_a_failed_host_free_in_a_trim_keeps_the_block_cached_in_its_own_kind() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let a = ctx.alloc_host(4096, MAPPED).unwrap();
    let addr = a.host_ptr();
    drop(a);
    drv.fail_nth(CallKind::HostFree, 1, 999);
    assert!(rt.trim().is_err());
    assert_eq!(rt.stats()[0].host.cached_bytes, 4096);
    drv.clear_faults();
    assert!(rt.flush_pool(0).unwrap());
    // Not handed to an unmapped request; a mapped one gets it back.
    let other = ctx.alloc_host(4096, HostFlags::default()).unwrap();
    assert_ne!(other.host_ptr(), addr);
    let mapped = ctx.alloc_host(4096, MAPPED).unwrap();
    assert_eq!(mapped.host_ptr(), addr);
    drop((other, mapped));
    rt.trim().unwrap();
    assert_eq!(drv.live_host_bytes(), 0);
}

#[test]
fn test_stream_work_on_another_stream_also_holds_the_block() {
    // Work queued on a blocking stream before the free, and more work on a
    // non-blocking one after it: the block waits for the first.
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let a = ctx.alloc_host(4096, MAPPED).unwrap();
    let addr = a.host_ptr();
    drv.queue_write(BLOCKING, addr as u64, &[7; 8]).unwrap();
    drop(a);
    let b = ctx.alloc_host(4096, MAPPED).unwrap();
    assert_ne!(b.host_ptr(), addr);
    drv.complete(None);
    assert_eq!(drv.lost_writes(), 0);
    assert!(rt.flush_pool(0).unwrap());
    assert_eq!(ctx.alloc_host(4096, MAPPED).unwrap().host_ptr(), addr);
    drop(b);
}

#[test]
fn test_a_forked_child_neither_caches_nor_frees_host_memory() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let live = ctx.alloc_host(4096, HostFlags::default()).unwrap();
    drop(ctx.alloc_host(8192, HostFlags::default()).unwrap());
    // No fence in flight: the fence thread holds no lock across the fork.
    assert!(rt.flush_pool(0).unwrap());
    // The child's verdict comes back through a pipe, not its exit status:
    // under valgrind (scripts/memcheck) the child's own leak check at _exit
    // sets the status to --error-exitcode.
    let mut fds = [0; 2];
    // SAFETY: `fds` is a live array of two ints.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the child only calls gpuptr and the simulator (no lock of
    // theirs is held across the fork by this thread) and ends with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // The books as the fork left them (the parent's helper threads may
        // still have been settling a moment before it; none runs here).
        let before = rt.stats()[0].host;
        let frees = drv.calls(CallKind::HostFree);
        let checks = [
            ("free() is a no-op", live.free() == Ok(false)),
            (
                "allocation refused",
                ctx.alloc_host(4096, HostFlags::default()).is_err(),
            ),
            ("trim refused", rt.trim().is_err()),
        ];
        drop(live);
        let after = rt.stats()[0].host;
        drop(ctx);
        let failed: Vec<&str> = checks
            .iter()
            .copied()
            .chain([
                ("books unchanged", after == before),
                // Read without the simulator's lock, which a thread of the
                // parent may have held at the fork: no free, so the driver's
                // bytes are kept.
                ("no host free", drv.calls(CallKind::HostFree) == frees),
            ])
            .filter(|(_, ok)| !ok)
            .map(|(what, _)| what)
            .collect();
        if !failed.is_empty() {
            // Straight to fd 2: the test harness captures eprintln! in memory
            // that the child's exit throws away.
            let msg = format!(
                "forked child: failed {failed:?}; host stats before {before:?}, after {after:?}\n"
            );
            // SAFETY: writes a live buffer of that length to stderr.
            unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
        }
        let verdict = if failed.is_empty() { b"ok" } else { b"no" };
        // SAFETY: writes a live two-byte buffer to the pipe, then ends the
        // child without running the parent's destructors.
        unsafe {
            libc::write(fds[1], verdict.as_ptr().cast(), 2);
            libc::_exit(0)
        };
    }
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is a live local.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    let mut verdict = [0u8; 2];
    // SAFETY: reads at most two bytes into a live local; both ends are ours.
    let n = unsafe {
        libc::close(fds[1]);
        let n = libc::read(fds[0], verdict.as_mut_ptr().cast(), 2);
        libc::close(fds[0]);
        n
    };
    assert!(libc::WIFEXITED(status), "the child did not exit");
    assert_eq!(
        (n, &verdict),
        (2, b"ok"),
        "the child released or cached something"
    );
    // The parent's memory is still there.
    assert_eq!(drv.live_host_bytes(), 4096 + 8192);
    drop(live);
    assert_eq!(rt.stats()[0].host.live_count, 0);
}

#[test]
fn test_a_host_size_near_the_top_of_the_address_space_is_an_error_not_a_panic() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    for size in [usize::MAX, usize::MAX - (1 << 20), usize::MAX / 2 + 1] {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ctx.alloc_host(size, HostFlags::default())
        }));
        let r = r.unwrap_or_else(|_| panic!("alloc_host({size}) panicked"));
        assert!(r.is_err(), "alloc_host({size}) succeeded");
    }
    assert_eq!(rt.stats()[0].host.held_bytes, 0);
}
