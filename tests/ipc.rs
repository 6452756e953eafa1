//! IPC handles on the simulator: the bytes, opening in the exporting
//! process, the import path (a handle made to look foreign maps the same
//! simulated memory, as another process would see it), and validation.

mod common;

use common::{sim, sim_pooled};
use gpuptr::{Error, IpcHandle};

fn foreign(mut h: IpcHandle) -> IpcHandle {
    // As if another process had exported it, one without a liveness file
    // (the file's check runs in a real second process: tests/test_ipc.py).
    h.process ^= 0x5a5a;
    h.slot = u32::MAX;
    h
}

#[test]
fn test_handle_bytes_round_trip_and_reject_anything_else() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let mem = ctx.alloc(4096).unwrap();
    let h = rt
        .ipc_export(&mem.view_all().view(100, Some(300)).unwrap())
        .unwrap();
    assert_eq!((h.device, h.size, h.pid), (0, 200, std::process::id()));
    let bytes = h.to_bytes();
    assert_eq!(IpcHandle::from_bytes(&bytes).unwrap(), h);
    for bad in [&bytes[..bytes.len() - 1], b"gpuptrI1", &[0u8; 112][..]] {
        assert!(matches!(
            IpcHandle::from_bytes(bad),
            Err(Error::InvalidArgument(_))
        ));
    }
    let mut overflow = bytes.clone();
    overflow[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        IpcHandle::from_bytes(&overflow),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn test_opening_in_the_exporting_process_gives_the_memory_until_it_is_freed() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let mem = ctx.alloc(4096).unwrap();
    mem.view_all().memset(9, None).unwrap();
    let h = rt
        .ipc_export(&mem.view_all().view(1024, Some(2048)).unwrap())
        .unwrap();
    let v = rt.ipc_open(&h).unwrap();
    assert_eq!((v.address(), v.size()), (mem.address() + 1024, 1024));
    assert_eq!(v.to_vec().unwrap(), vec![9u8; 1024]);
    drop(v);
    mem.free().unwrap();
    assert!(matches!(rt.ipc_open(&h), Err(Error::InvalidPointer(_))));
    drop(mem);
    assert!(matches!(rt.ipc_open(&h), Err(Error::InvalidPointer(_))));
}

#[test]
fn test_a_pool_block_carries_its_offset_in_the_driver_allocation() {
    let (drv, rt) = sim_pooled(1, 256 << 20);
    let ctx = rt.context(0).unwrap();
    // A reservation carves many 1 MiB blocks from one driver allocation.
    ctx.reserve(1 << 20, 16 << 20).unwrap();
    let blocks: Vec<_> = (0..8).map(|_| ctx.alloc(1 << 20).unwrap()).collect();
    let inner = blocks.iter().find(|b| {
        let h = rt.ipc_export(&b.view_all()).unwrap();
        h.offset > 0
    });
    let inner = inner.expect("some block lies inside a larger allocation");
    inner.view_all().memset(0x42, None).unwrap();
    let h = foreign(rt.ipc_export(&inner.view_all()).unwrap());
    assert_eq!(h.offset % (1 << 20), 0);
    let v = rt.ipc_open(&h).unwrap();
    assert_eq!(v.address(), inner.address(), "base plus offset");
    assert_eq!(v.to_vec().unwrap()[..4], [0x42; 4]);
    assert_eq!(drv.ipc_mappings(), 1);
    let again = rt.ipc_open(&h).unwrap();
    assert_eq!(drv.ipc_mappings(), 1, "one mapping per handle in a process");
    assert!(std::sync::Arc::ptr_eq(
        &rt.context_of(v.address()).unwrap(),
        &ctx
    ));
    drop((v, again));
    assert_eq!(drv.ipc_mappings(), 0, "unmapped with its last view");
}

#[test]
fn test_a_freed_driver_allocation_fails_to_open_elsewhere() {
    let (_drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    let mem = ctx.alloc(4096).unwrap();
    let h = foreign(rt.ipc_export(&mem.view_all()).unwrap());
    mem.free().unwrap();
    assert!(matches!(rt.ipc_open(&h), Err(Error::Cuda { .. })));
    // Reallocated at the same address: still the old handle's allocation no more.
    let again = ctx.alloc(4096).unwrap();
    assert_eq!(again.address(), mem.address());
    assert!(matches!(rt.ipc_open(&h), Err(Error::Cuda { .. })));
}

#[test]
fn test_handles_of_another_simulator_or_device_do_not_open() {
    let (_a, rt_a) = sim_pooled(2, 64 << 20);
    let (_b, rt_b) = sim_pooled(1, 64 << 20);
    let mem = rt_a.context(1).unwrap().alloc(4096).unwrap();
    let h = foreign(rt_a.ipc_export(&mem.view_all()).unwrap());
    assert_eq!(h.device, 1);
    assert!(
        matches!(rt_b.ipc_open(&h), Err(Error::InvalidArgument(_))),
        "no device 1 there"
    );
    let mut on_0 = h.clone();
    on_0.device = 0;
    assert!(
        matches!(rt_b.ipc_open(&on_0), Err(Error::Cuda { .. })),
        "another simulator"
    );
    assert!(
        matches!(rt_a.ipc_open(&on_0), Err(Error::Cuda { .. })),
        "wrong device"
    );
}

#[test]
fn test_only_gpuptr_device_allocations_are_exported() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let managed = ctx.alloc_managed(4096, true).unwrap();
    assert!(matches!(
        rt.ipc_export(&managed.view_all()),
        Err(Error::InvalidArgument(_))
    ));
    let mem = ctx.alloc(4096).unwrap();
    let wrapped = rt.wrap(mem.address(), 4096, None, None).unwrap();
    assert!(matches!(
        rt.ipc_export(&wrapped.view_all()),
        Err(Error::InvalidArgument(_))
    ));
    let empty = ctx.alloc(0).unwrap();
    assert!(matches!(
        rt.ipc_export(&empty.view_all()),
        Err(Error::InvalidArgument(_))
    ));
    mem.free().unwrap();
    assert!(matches!(
        rt.ipc_export(&mem.view_all()),
        Err(Error::InvalidPointer(_))
    ));
}
