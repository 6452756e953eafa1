//! Host memory on the simulator: pinned, mapped, registered and managed memory.

mod common;

use std::sync::Arc;

use common::sim;
use gpuptr::driver::CallKind;
use gpuptr::{codes, Error, HostFlags, HostMemory};

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
