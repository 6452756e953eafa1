//! Device pointers and views on the simulator: lifetimes, double frees, bounds, zero sizes, out of memory, failed frees, copies.

mod common;

use common::sim;
use gpuptr::driver::CallKind;
use gpuptr::{codes, Error};

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
    assert!(
        matches!(
            err,
            Error::OutOfMemory {
                device: 0,
                requested: 200,
                ..
            }
        ),
        "{err:?}"
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

#[test]
fn test_a_free_while_lent_leaves_the_release_to_the_last_loan() {
    let (drv, rt) = sim(1);
    let mem = rt.context(0).unwrap().alloc(4096).unwrap();
    let loan = mem.lend().unwrap();
    let second = mem.lend().unwrap();
    assert_eq!(mem.free(), Ok(true), "the free is accepted");
    assert!(mem.is_freed());
    assert!(mem.lend().is_err(), "freed memory is not lent again");
    drop(mem);
    assert_eq!(drv.live_bytes(), 4096, "the consumers still hold it");
    drop(loan);
    assert_eq!(drv.live_bytes(), 4096);
    assert_eq!(second.pointer().size(), 4096);
    drop(second);
    assert_eq!(
        (drv.live_bytes(), drv.calls(CallKind::MemFree)),
        (0, 1),
        "released once, by the last loan"
    );
}

#[test]
fn test_stream_ordered_memory_names_its_stream_until_used_on_another() {
    let (_drv, rt) = common::sim_pooled(1, 1 << 20);
    let ctx = rt.context(0).unwrap();
    assert_eq!(ctx.alloc(64).unwrap().stream(), None);
    let mem = ctx.alloc_on(64, 0x5000).unwrap();
    assert_eq!(mem.stream(), Some(0x5000));
    mem.record_stream(0x5000);
    assert_eq!(mem.stream(), Some(0x5000), "its own stream changes nothing");
    mem.record_stream(0x6000);
    assert_eq!(mem.stream(), None, "used on two streams: ordered on none");
    assert_eq!(
        ctx.alloc_on(64, 1).unwrap().stream(),
        Some(0),
        "legacy is 0"
    );
}

#[test]
fn test_a_lent_pool_block_is_not_reused_until_the_loan_ends() {
    let (drv, rt) = common::sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let mem = ctx.alloc(1 << 20).unwrap();
    let addr = mem.address();
    let loan = mem.lend().unwrap();
    mem.free().unwrap();
    drop(mem);
    rt.flush_pool(0).unwrap();
    let other = ctx.alloc(1 << 20).unwrap();
    assert_ne!(other.address(), addr, "the consumer still reads it");
    drop(loan);
    drv.complete(None);
    rt.flush_pool(0).unwrap();
    let again = ctx.alloc(1 << 20).unwrap();
    assert_eq!(
        again.address(),
        addr,
        "back in the pool once the loan ended"
    );
}
