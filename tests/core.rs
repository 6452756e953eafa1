//! Core logic on the simulator: contexts, pointers, views, the registry and
//! error paths. Runs with `cargo test`, no GPU and no Python.

use std::sync::Arc;

use gpuptr::driver::{CallKind, Driver};
use gpuptr::{codes, Error, Runtime, SimConfig, SimDriver};

/// A simulator and a runtime without the pool, so driver-side counters
/// show each allocation and free directly.
fn sim(devices: usize) -> (Arc<SimDriver>, Arc<Runtime>) {
    let drv = Arc::new(SimDriver::new(SimConfig::new(devices, 1 << 20)));
    let rt = Runtime::with_pool(drv.clone(), None).unwrap();
    (drv, rt)
}

/// A simulator and a runtime with the default caching pool.
fn sim_pooled(devices: usize, memory: usize) -> (Arc<SimDriver>, Arc<Runtime>) {
    let drv = Arc::new(SimDriver::new(SimConfig::new(devices, memory)));
    let rt = Runtime::new(drv.clone()).unwrap();
    (drv, rt)
}

#[test]
fn test_context_is_shared_and_released_with_last_holder() {
    let (drv, rt) = sim(1);
    assert_eq!(drv.retain_count(0), 0);
    let a = rt.context(0).unwrap();
    let b = rt.context(0).unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    assert_eq!(drv.retain_count(0), 1, "one retain per live Context");
    drop(a);
    assert_eq!(drv.retain_count(0), 1);
    drop(b);
    assert_eq!(drv.retain_count(0), 0, "released when the last holder goes");
    let c = rt.context(0).unwrap();
    assert_eq!(drv.retain_count(0), 1, "retained afresh");
    drop(c);
}

#[test]
fn test_pointer_keeps_context_alive() {
    let (drv, rt) = sim(1);
    let mem = rt.context(0).unwrap().alloc(1000).unwrap();
    assert_eq!(drv.retain_count(0), 1);
    assert_eq!(drv.live_bytes(), 1000);
    drop(mem);
    assert_eq!(drv.live_bytes(), 0);
    assert_eq!(drv.retain_count(0), 0);
}

#[test]
fn test_view_keeps_parent_alive() {
    let (drv, rt) = sim(1);
    let mem = rt.context(0).unwrap().alloc(4096).unwrap();
    let base = mem.address();
    let view = mem.view_all().view(1024, Some(2048)).unwrap();
    drop(mem);
    assert_eq!(drv.live_bytes(), 4096, "the view holds the allocation");
    assert_eq!(view.address(), base + 1024);
    view.memset(7, None).unwrap();
    assert_eq!(view.to_vec().unwrap(), vec![7u8; 1024]);
    drop(view);
    assert_eq!(drv.live_bytes(), 0);
    assert_eq!(drv.retain_count(0), 0);
}

#[test]
fn test_double_free_is_safe_and_use_after_free_is_invalid_pointer() {
    let (drv, rt) = sim(1);
    let mem = rt.context(0).unwrap().alloc(64).unwrap();
    let view = mem.view_all();
    assert_eq!(mem.free(), Ok(true));
    assert_eq!(mem.free(), Ok(false));
    assert_eq!(drv.calls(CallKind::MemFree), 1, "freed exactly once");
    assert_eq!(drv.live_bytes(), 0);
    assert!(matches!(
        view.memset(0, None),
        Err(Error::InvalidPointer(_))
    ));
    assert!(matches!(view.to_vec(), Err(Error::InvalidPointer(_))));
    drop(view);
    drop(mem);
    assert_eq!(
        drv.calls(CallKind::MemFree),
        1,
        "drop after free frees nothing"
    );
}

#[test]
fn test_zero_size_and_out_of_range_views() {
    let (_drv, rt) = sim(1);
    let mem = rt.context(0).unwrap().alloc(100).unwrap();
    let all = mem.view_all();
    let empty = all.view(100, None).unwrap();
    assert_eq!(empty.size(), 0);
    assert_eq!(all.view(10, Some(10)).unwrap().size(), 0);
    assert!(matches!(all.view(101, None), Err(Error::InvalidPointer(_))));
    assert!(matches!(
        all.view(0, Some(101)),
        Err(Error::InvalidPointer(_))
    ));
    assert!(matches!(
        all.view(50, Some(40)),
        Err(Error::InvalidPointer(_))
    ));
    let nested = all.view(10, Some(90)).unwrap().view(5, Some(15)).unwrap();
    assert_eq!(nested.offset(), 15);
    assert_eq!(nested.size(), 10);
    assert!(matches!(
        nested.view(0, Some(11)),
        Err(Error::InvalidPointer(_))
    ));
    assert!(matches!(
        nested.memset(0, Some(11)),
        Err(Error::InvalidPointer(_))
    ));
}

#[test]
fn test_zero_size_alloc_is_null_and_makes_no_driver_call() {
    let (drv, rt) = sim(1);
    let mem = rt.context(0).unwrap().alloc(0).unwrap();
    assert_eq!(mem.address(), 0);
    assert_eq!(drv.calls(CallKind::MemAlloc), 0);
    assert_eq!(mem.free(), Ok(true));
    assert_eq!(drv.calls(CallKind::MemFree), 0);
}

#[test]
fn test_injected_oom_is_typed_and_leaks_nothing() {
    let (drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    let keep = ctx.alloc(100).unwrap();
    drv.fail_nth(CallKind::MemAlloc, 1, codes::CUDA_ERROR_OUT_OF_MEMORY);
    let err = ctx.alloc(200).unwrap_err();
    assert_eq!(
        err,
        Error::OutOfMemory {
            device: 0,
            requested: 200
        }
    );
    assert_eq!(drv.live_bytes(), 100);
    assert_eq!(rt.stats()[0].live_bytes, 100);
    drop(keep);
    assert_eq!(drv.live_bytes(), 0);
    assert_eq!(rt.stats()[0].live_bytes, 0);
    assert_eq!(rt.stats()[0].live_count, 0);
    assert!(rt.registered_ranges() == 0);
}

#[test]
fn test_real_oom_from_simulated_capacity() {
    let (drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    let err = ctx.alloc(2 << 20).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { requested, .. } if requested == 2 << 20));
    assert_eq!(drv.live_bytes(), 0);
}

#[test]
fn test_failed_free_stays_live_and_drop_retries() {
    let (drv, rt) = sim(1);
    let mem = rt.context(0).unwrap().alloc(256).unwrap();
    drv.fail_nth(CallKind::MemFree, 1, codes::CUDA_ERROR_LAUNCH_FAILED);
    let err = mem.free().unwrap_err();
    assert_eq!(err.cuda_code(), Some(codes::CUDA_ERROR_LAUNCH_FAILED));
    assert!(!mem.is_freed());
    assert_eq!(drv.live_bytes(), 256);
    assert_eq!(rt.stats()[0].live_bytes, 256);
    drop(mem);
    assert_eq!(drv.live_bytes(), 0);
    assert_eq!(rt.stats()[0].live_bytes, 0);
}

#[test]
fn test_failed_retain_is_a_cuda_error_and_retry_works() {
    let (drv, rt) = sim(1);
    drv.fail_nth(CallKind::ContextRetain, 1, codes::CUDA_ERROR_UNKNOWN);
    let err = rt.context(0).unwrap_err();
    assert!(matches!(err, Error::Cuda { code, ref name, .. }
        if code == codes::CUDA_ERROR_UNKNOWN && name == "CUDA_ERROR_UNKNOWN"));
    assert_eq!(drv.retain_count(0), 0);
    let ctx = rt.context(0).unwrap();
    assert_eq!(drv.retain_count(0), 1);
    drop(ctx);
}

#[test]
fn test_copy_round_trip_and_device_to_device() {
    let (_drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    let a = ctx.alloc(16).unwrap().view_all();
    let b = ctx.alloc(16).unwrap().view_all();
    let data: Vec<u8> = (0..16).collect();
    a.copy_from_host(&data).unwrap();
    b.view(8, None)
        .unwrap()
        .copy_from_device(&a.view(0, Some(8)).unwrap(), None)
        .unwrap();
    let out = b.to_vec().unwrap();
    assert_eq!(&out[8..], &data[..8]);
    assert_eq!(&out[..8], &[0u8; 8]);
    assert!(matches!(
        a.copy_from_host(&[0u8; 17]),
        Err(Error::InvalidPointer(_))
    ));
}

#[test]
fn test_address_on_device_1_resolves_to_device_1_while_device_0_is_current() {
    let (drv, rt) = sim(2);
    let ctx0 = rt.context(0).unwrap();
    let ctx1 = rt.context(1).unwrap();
    let mem1 = ctx1.alloc(4096).unwrap();
    ctx0.make_current().unwrap();
    assert_eq!(drv.current_context().unwrap(), ctx0.raw());
    // Through the registry (gpuptr's own allocation).
    let found = rt.context_of(mem1.address() + 100).unwrap();
    assert!(Arc::ptr_eq(&found, &ctx1));
    assert_eq!(found.device(), 1);
    assert_eq!(drv.calls(CallKind::PointerAttributes), 0, "a registry hit");
}

#[test]
fn test_foreign_wrap_resolves_by_address_and_registers_its_range() {
    let (drv, rt) = sim(2);
    // Memory allocated "by someone else": straight from the driver.
    let ctx1 = rt.context(1).unwrap();
    // SAFETY: the context is retained by `ctx1`.
    let foreign = unsafe { drv.mem_alloc(ctx1.raw(), 8192) }.unwrap();
    rt.context(0).unwrap().make_current().unwrap();
    let w = rt.wrap(foreign + 512, 1024, None, None).unwrap();
    assert_eq!(w.context().device(), 1);
    assert!(Arc::ptr_eq(w.context(), &ctx1));
    assert_eq!(drv.calls(CallKind::PointerAttributes), 1);
    // A second wrap inside the same allocation hits the registry.
    let w2 = rt.wrap(foreign + 4096, 4096, None, None).unwrap();
    assert_eq!(w2.context().device(), 1);
    assert_eq!(drv.calls(CallKind::PointerAttributes), 1);
    // Past the allocation's end is refused.
    assert!(matches!(
        rt.wrap(foreign + 4096, 4097, None, None),
        Err(Error::InvalidPointer(_))
    ));
    drop(w2);
    drop(w);
    assert!(
        rt.registered_ranges() == 0,
        "the range goes with its last wrap"
    );
    // Wrapping never frees foreign memory.
    assert_eq!(drv.live_allocations(), 1);
    // SAFETY: allocated above; the wraps over it are gone.
    unsafe { drv.mem_free(ctx1.raw(), foreign) }.unwrap();
}

#[test]
fn test_wrap_of_unregistered_or_null_address_is_invalid_pointer() {
    let (_drv, rt) = sim(1);
    let host = [0u8; 64];
    let err = rt.wrap(host.as_ptr() as u64, 64, None, None).unwrap_err();
    assert!(matches!(err, Error::InvalidPointer(_)), "{err:?}");
    assert!(matches!(
        rt.wrap(0, 0, None, None),
        Err(Error::InvalidPointer(_))
    ));
    assert!(matches!(
        rt.wrap(u64::MAX - 4, 64, None, None),
        Err(Error::InvalidPointer(_))
    ));
}

#[test]
fn test_wrap_keeps_owner_until_released() {
    let (_drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    let owner = Arc::new(());
    let w = rt
        .wrap(0, 0, Some(ctx), Some(Box::new(owner.clone())))
        .unwrap();
    assert_eq!(Arc::strong_count(&owner), 2);
    let v = w.view_all();
    drop(w);
    assert_eq!(Arc::strong_count(&owner), 2, "the view keeps the wrap");
    drop(v);
    assert_eq!(Arc::strong_count(&owner), 1);
}

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
fn test_every_fault_kind_surfaces_as_its_code() {
    for kind in [
        CallKind::MemAlloc,
        CallKind::Memset,
        CallKind::Memcpy,
        CallKind::Synchronize,
        CallKind::MemGetInfo,
    ] {
        let (drv, rt) = sim(1);
        let ctx = rt.context(0).unwrap();
        drv.fail_nth(kind, 1, codes::CUDA_ERROR_LAUNCH_FAILED);
        let r = match kind {
            CallKind::MemAlloc => ctx.alloc(8).map(|_| ()),
            CallKind::Memset => ctx.alloc(8).unwrap().view_all().memset(0, None),
            CallKind::Memcpy => ctx.alloc(8).unwrap().view_all().to_vec().map(|_| ()),
            CallKind::Synchronize => ctx.synchronize(),
            CallKind::MemGetInfo => ctx.memory_info().map(|_| ()),
            _ => unreachable!(),
        };
        let err = r.unwrap_err();
        assert_eq!(
            err.cuda_code(),
            Some(codes::CUDA_ERROR_LAUNCH_FAILED),
            "{kind:?}"
        );
        assert_eq!(drv.live_bytes(), 0, "{kind:?} leaked");
        assert_eq!(rt.stats()[0].live_count, 0, "{kind:?} miscounted");
    }
}

#[test]
fn test_unknown_device_is_invalid_argument() {
    let (_drv, rt) = sim(2);
    assert!(matches!(rt.context(2), Err(Error::InvalidArgument(_))));
}

#[test]
fn test_driver_choice_parsing() {
    use gpuptr::driver::DriverChoice;
    assert_eq!(DriverChoice::parse("").unwrap(), DriverChoice::Auto);
    assert_eq!(DriverChoice::parse("SIM").unwrap(), DriverChoice::Sim);
    assert_eq!(DriverChoice::parse("cuda").unwrap(), DriverChoice::Cuda);
    assert!(matches!(
        DriverChoice::parse("rocm"),
        Err(Error::NoDriver(_))
    ));
}

#[test]
fn test_cuda_probe_without_libcuda_is_no_driver_not_a_panic() {
    // This machine class (CI) has no libcuda; on a GPU box it returns Ok.
    match gpuptr::driver::probe_cuda() {
        Ok(version) => assert!(version >= 12000),
        Err(e) => assert!(matches!(e, Error::NoDriver(ref m) if m.contains("GPUPTR_DRIVER=sim"))),
    }
}

// --- host and managed memory ----------------------------------------------

use gpuptr::{HostFlags, HostMemory};

#[test]
fn test_mapped_host_memory_is_reachable_from_the_device_and_freed_once() {
    let (drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    let flags = HostFlags {
        mapped: true,
        ..HostFlags::default()
    };
    let host = ctx.alloc_host(4096, flags).unwrap();
    assert_eq!(drv.live_host_bytes(), 4096);
    let dev = host.device_view().unwrap();
    dev.memset(0x42, Some(16)).unwrap();
    // SAFETY: the pinned allocation is live and 4096 bytes long.
    let bytes = unsafe { std::slice::from_raw_parts(host.host_ptr() as *const u8, 16) };
    assert_eq!(bytes, &[0x42u8; 16]);
    drop(host);
    assert_eq!(drv.live_host_bytes(), 4096, "the device view keeps it");
    drop(dev);
    assert_eq!(drv.live_host_bytes(), 0);
    assert_eq!(drv.calls(CallKind::HostFree), 1);
}

#[test]
fn test_unmapped_host_memory_has_no_device_view() {
    let (_drv, rt) = sim(1);
    let host = rt
        .context(0)
        .unwrap()
        .alloc_host(64, HostFlags::default())
        .unwrap();
    assert!(host.device_address().is_none());
    assert!(matches!(host.device_view(), Err(Error::InvalidPointer(_))));
    assert_eq!(host.free(), Ok(true));
    assert_eq!(host.free(), Ok(false));
}

#[test]
fn test_registered_memory_is_pinned_in_place_and_keeps_its_owner() {
    let (drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    let buf = Arc::new(std::sync::Mutex::new(vec![0u8; 256]));
    let ptr = buf.lock().unwrap().as_ptr() as usize;
    let flags = HostFlags {
        mapped: true,
        ..HostFlags::default()
    };
    // SAFETY: `buf` is kept alive (and unmoved) by the registration's keepalive.
    let reg = unsafe { HostMemory::register(&ctx, ptr, 256, flags, Some(Box::new(buf.clone()))) }
        .unwrap();
    assert_eq!(drv.live_registrations(), 1);
    assert_eq!(Arc::strong_count(&buf), 2);
    reg.device_view()
        .unwrap()
        .copy_from_host(&[7u8; 8])
        .unwrap();
    assert_eq!(&buf.lock().unwrap()[..9], &[7, 7, 7, 7, 7, 7, 7, 7, 0]);
    // Registering an overlapping range again is refused by the driver.
    // SAFETY: refused by the driver before anything could use it.
    assert!(unsafe { HostMemory::register(&ctx, ptr + 8, 8, flags, None) }.is_err());
    drop(reg);
    assert_eq!(drv.live_registrations(), 0);
    assert_eq!(Arc::strong_count(&buf), 1, "the owner is let go");
}

#[test]
fn test_failed_mapping_releases_the_pinned_allocation() {
    let (drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    drv.fail_nth(CallKind::HostDevicePointer, 1, codes::CUDA_ERROR_UNKNOWN);
    let flags = HostFlags {
        mapped: true,
        ..HostFlags::default()
    };
    assert!(ctx.alloc_host(128, flags).is_err());
    assert_eq!(drv.live_host_bytes(), 0);
    drv.fail_nth(CallKind::HostAlloc, 1, codes::CUDA_ERROR_OUT_OF_MEMORY);
    assert!(matches!(
        ctx.alloc_host(128, flags),
        Err(Error::OutOfMemory { requested: 128, .. })
    ));
}

#[test]
fn test_managed_memory_is_device_memory_reachable_from_the_host() {
    let (drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    let m = ctx.alloc_managed(1024, true).unwrap();
    assert!(m.is_managed());
    assert_eq!(drv.live_bytes(), 1024);
    m.view_all().memset(9, None).unwrap();
    // SAFETY: managed memory is host-accessible at its address, 1024 bytes.
    let bytes = unsafe { std::slice::from_raw_parts(m.address() as *const u8, 1024) };
    assert!(bytes.iter().all(|b| *b == 9));
    assert_eq!(rt.context_of(m.address() + 10).unwrap().device(), 0);
    drop(m);
    assert_eq!(drv.live_bytes(), 0);
    assert_eq!(rt.stats()[0].live_bytes, 0);
}

// --- the pool -----------------------------------------------------------------

use gpuptr::{size_class, PoolConfig};

#[test]
fn test_pool_reuses_blocks_by_size_class_after_a_fence() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let cfg = PoolConfig::default();
    let held: Vec<_> = (0..cfg.fence_count)
        .map(|_| ctx.alloc(1000).unwrap())
        .collect();
    assert_eq!(drv.calls(CallKind::MemAlloc), cfg.fence_count as u64);
    let syncs = drv.calls(CallKind::Synchronize);
    drop(held);
    // A full batch is sealed at once, and the fence thread synchronizes.
    assert!(rt.flush_pool(0).unwrap());
    assert!(drv.calls(CallKind::Synchronize) > syncs, "a fence ran");
    assert_eq!(rt.stats()[0].pending_bytes, 0);
    let before = drv.calls(CallKind::MemAlloc);
    let again: Vec<_> = (0..cfg.fence_count)
        .map(|_| ctx.alloc(900).unwrap())
        .collect();
    assert_eq!(
        drv.calls(CallKind::MemAlloc),
        before,
        "served from the pool"
    );
    assert!(again.iter().all(|p| p.size() == 900));
    let s = rt.stats()[0];
    assert!(s.pool_hits >= cfg.fence_count as u64 && s.fences >= 1);
    assert_eq!(size_class(900), size_class(1000));
    // Another size class does not take these blocks.
    let other = ctx.alloc(5000).unwrap();
    assert!(!again.iter().any(|p| p.address() == other.address()));
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
    assert_eq!(drv.live_bytes(), 4096, "the new block is intact");
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
    assert_eq!(drv.live_bytes(), 1 << 20);
    drop(ctx);
    assert_eq!(drv.live_bytes(), 0);
    assert_eq!(drv.retain_count(0), 0);
}

#[test]
fn test_pool_fence_failure_hands_out_nothing_unfenced_and_loses_no_block() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
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
fn test_empty_views_may_start_past_the_end_like_numbas() {
    let (_drv, rt) = sim(1);
    let mem = rt.context(0).unwrap().alloc(96).unwrap();
    let v = mem.view_all().view(104, Some(104)).unwrap();
    assert_eq!(v.size(), 0);
    assert_eq!(v.address(), mem.address() + 104);
    v.memset(1, None).unwrap(); // nothing to do
    assert!(matches!(
        mem.view_all().view(104, Some(105)),
        Err(Error::InvalidPointer(_))
    ));
}

// --- pool shards ----------------------------------------------------------------

/// A pool with so many shards that two threads started one after the other
/// always land in different ones.
fn sim_sharded(memory: usize) -> (Arc<SimDriver>, Arc<Runtime>) {
    let drv = Arc::new(SimDriver::new(SimConfig::new(1, memory)));
    let cfg = PoolConfig {
        shards: 1024,
        ..PoolConfig::default()
    };
    let rt = Runtime::with_pool(drv.clone(), Some(cfg)).unwrap();
    (drv, rt)
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
            to_consumer.send(batch).unwrap();
            consumer.join().unwrap();
            // The consumer's frees went back to this thread's shard: once
            // fenced, the same blocks come back, no new memory.
            assert!(rt2.flush_pool(0).unwrap());
            let again: Vec<_> = (0..n).map(|_| ctx.alloc(4096).unwrap()).collect();
            assert_eq!(drv.calls(CallKind::MemAlloc), n as u64);
            assert!(again.iter().all(|p| first.contains(&p.address())));
        })
    };
    producer.join().unwrap();
    let s = rt.stats()[0];
    assert_eq!((s.live_count, s.live_bytes), (0, 0));
    assert_eq!(s.cached_bytes, n * 4096);
    assert_eq!(s.fences, 1);
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
    let held: Vec<_> = (0..n).map(|_| ctx.alloc(1 << 16).unwrap()).collect();
    assert_eq!(
        drv.calls(CallKind::MemAlloc),
        allocs,
        "all taken from the other shard"
    );
    assert_eq!(rt.stats()[0].pool_hits as usize, n);
    // Nothing is ready anywhere now: the driver.
    let extra = ctx.alloc(1 << 16).unwrap();
    assert_eq!(drv.calls(CallKind::MemAlloc), allocs + 1);
    drop(extra);
    drop(held);
    assert_eq!(rt.stats()[0].cached_bytes, (n + 1) * (1 << 16));
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
    // A 1 MiB block is there to reuse once fenced; 4 MiB needs the trim.
    let small = ctx.alloc(1 << 20).unwrap();
    let big = ctx.alloc(4 << 20).unwrap();
    assert_eq!(drv.live_bytes(), 5 << 20, "cache returned, no leak");
    assert_eq!(rt.stats()[0].live_bytes, 5 << 20);
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
    drop((0..4).map(|_| ctx.alloc(4096).unwrap()).collect::<Vec<_>>());
    assert_eq!(rt.registered_ranges(), 4);
    drv.fail_nth(CallKind::MemFree, 2, codes::CUDA_ERROR_UNKNOWN);
    assert!(rt.trim().is_err());
    // Three blocks went back to the driver; only the one still cached is known.
    assert_eq!(drv.live_bytes(), 4096);
    assert_eq!(rt.registered_ranges(), 1);
    rt.trim().unwrap();
    assert_eq!((drv.live_bytes(), rt.registered_ranges()), (0, 0));
}
