//! The pointer→context registry on the simulator: foreign wraps resolve by address, register their range and keep their owner.

mod common;

use std::sync::Arc;

use common::sim;
use gpuptr::driver::{CallKind, Driver};
use gpuptr::Error;

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
