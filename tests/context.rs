//! Contexts on the simulator: one retained primary context per device, shared and released with its last holder; contexts resolved from addresses; driver choice, probing and every fault kind.

mod common;

use std::sync::Arc;

use common::sim;
use gpuptr::driver::{CallKind, Driver};
use gpuptr::{codes, Error};

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
fn test_a_held_context_outlives_its_holders_until_a_reset() {
    let (drv, rt) = sim(2);
    let held = rt.held_context(0).unwrap();
    let ptr = Arc::as_ptr(&held);
    drop(held);
    assert_eq!(drv.retain_count(0), 1, "the runtime keeps it");
    let again = rt.context(0).unwrap();
    assert_eq!(Arc::as_ptr(&again), ptr, "the same context, and its pool");
    assert_eq!(Arc::as_ptr(&rt.held_context(0).unwrap()), ptr, "held once");
    drop(again);
    assert_eq!(drv.retain_count(1), 0, "only the device asked for");
    rt.reset(0).unwrap();
    assert_eq!(drv.retain_count(0), 0, "a reset lets it go");
    let fresh = rt.context(0).unwrap();
    assert_eq!(drv.retain_count(0), 1, "retained afresh");
    drop(fresh);
    assert_eq!(drv.retain_count(0), 0, "context() alone holds nothing");
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
