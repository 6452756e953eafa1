//! IPC handles on the simulator: the bytes, opening in the exporting
//! process, the import path (a handle made to look foreign maps the same
//! simulated memory, as another process would see it), and validation.

mod common;

use common::{sim, sim_pooled};
use gpuptr::{Driver, Error, IpcHandle};

/// As if another process had exported a handle: the handle under a new
/// process token, whose liveness file holds a copy of the real record,
/// planted here (a regular file locked by this process, as a live
/// exporter's is) and removed when this drops. Opening it runs the import
/// path in this process, which maps the same simulated memory as another
/// process would see it (the real file's own checks run in a second
/// process: tests/test_ipc_safety.py).
struct Foreign {
    handle: IpcHandle,
    path: std::path::PathBuf,
    _file: std::fs::File,
}

impl std::ops::Deref for Foreign {
    type Target = IpcHandle;
    fn deref(&self) -> &IpcHandle {
        &self.handle
    }
}

impl Drop for Foreign {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn foreign(mut h: IpcHandle) -> Foreign {
    use std::os::unix::fs::FileExt;
    use std::os::unix::io::AsRawFd;
    const RECORD: u64 = 32;
    let path = |process: u64| format!("/dev/shm/gpuptr-ipc-{}-{process:016x}", h.pid);
    let real = std::fs::File::open(path(h.process)).expect("the exporter's liveness file");
    let mut record = [0u8; 24];
    real.read_exact_at(&mut record, u64::from(h.slot) * RECORD)
        .unwrap();
    // A token of its own per call: the tests run at once in one process.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    h.process ^= NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) << 32;
    let path = std::path::PathBuf::from(path(h.process));
    let file = std::fs::File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .unwrap();
    file.set_len(real.metadata().unwrap().len()).unwrap();
    // As the exporter's: only its owner may write it, whatever the umask.
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .unwrap();
    file.write_all_at(&record, u64::from(h.slot) * RECORD)
        .unwrap();
    // SAFETY: a valid descriptor this function owns; `flock` only locks it.
    assert_eq!(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) }, 0);
    Foreign {
        handle: h,
        path,
        _file: file,
    }
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
    match rt_b.ipc_open(&on_0) {
        Err(Error::InvalidArgument(m)) => assert!(
            m.contains("simulator cannot share memory between processes"),
            "another simulator says why: {m}"
        ),
        other => panic!("another simulator: {other:?}"),
    }
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

// Handles that no input can turn against their owner ----------------------

#[test]
fn test_a_handle_is_bounded_by_the_drivers_range_not_its_own_size() {
    let (_drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    let mem = ctx.alloc(4096).unwrap();
    let neighbour = ctx.alloc(4096).unwrap();
    assert_eq!(neighbour.address(), mem.address() + 4096, "adjacent");
    neighbour.view_all().memset(7, None).unwrap();
    let h = foreign(rt.ipc_export(&mem.view_all()).unwrap());
    assert!(rt.ipc_open(&h).is_ok(), "the handle as exported opens");
    for (offset, size) in [(0, 8192), (4096, 16), (4000, 200), (1 << 62, 16)] {
        let mut bad = h.clone();
        bad.offset = offset;
        bad.size = size;
        let opened = rt.ipc_open(&bad);
        assert!(
            matches!(opened, Err(Error::InvalidPointer(_))),
            "offset {offset} size {size}: {opened:?}"
        );
    }
    assert_eq!(neighbour.view_all().to_vec().unwrap(), vec![7u8; 4096]);
}

#[test]
fn test_a_handle_without_its_liveness_record_does_not_open_elsewhere() {
    // A pool block's handle with its slot cleared and its offset moved to
    // the next block of the same segment: the driver's range (the whole
    // segment) would have let it open there, and read the other block.
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let mine = ctx.alloc(4096).unwrap();
    let theirs = ctx.alloc(4096).unwrap();
    theirs.view_all().memset(0xbb, None).unwrap();
    let h = foreign(rt.ipc_export(&mine.view_all()).unwrap());
    let (a, b) = (
        rt.ipc_export(&mine.view_all()).unwrap(),
        rt.ipc_export(&theirs.view_all()).unwrap(),
    );
    assert_eq!(a.handle, b.handle, "one segment");
    assert!(rt.ipc_open(&h).is_ok(), "the handle as exported opens");
    let mut bad = h.clone();
    bad.slot = u32::MAX;
    for (offset, size) in [(b.offset, 4096), (a.offset, 4096), (0, 8192)] {
        bad.offset = offset;
        bad.size = size;
        match rt.ipc_open(&bad) {
            Err(Error::InvalidPointer(m)) => assert!(m.contains("no liveness record"), "{m}"),
            other => panic!("offset {offset} size {size}: {other:?}"),
        }
    }
    assert_eq!(theirs.view_all().to_vec().unwrap(), vec![0xbb; 4096]);
}

#[test]
fn test_a_handle_opened_in_its_exporter_names_its_memorys_device() {
    let (_drv, rt) = sim_pooled(2, 64 << 20);
    let mem = rt.context(0).unwrap().alloc(4096).unwrap();
    let mut h = rt.ipc_export(&mem.view_all()).unwrap();
    assert!(rt.ipc_open(&h).is_ok());
    h.device = 1;
    match rt.ipc_open(&h) {
        Err(Error::InvalidPointer(m)) => assert!(m.contains("device 1"), "{m}"),
        other => panic!("a handle altered to name device 1: {other:?}"),
    }
}

#[test]
fn test_a_handle_opened_in_its_exporter_is_bounded_by_the_exported_memory() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let mem = ctx.alloc(4096).unwrap();
    let h = rt.ipc_export(&mem.view_all()).unwrap();
    for (offset, size) in [(h.offset, 8192), (h.offset + 4096, 16), (1 << 62, 16)] {
        let mut bad = h.clone();
        bad.offset = offset;
        bad.size = size;
        let opened = rt.ipc_open(&bad);
        assert!(
            matches!(opened, Err(Error::InvalidPointer(_))),
            "offset {offset} size {size}: {opened:?}"
        );
    }
}

#[test]
fn test_reexports_of_a_live_buffer_share_one_liveness_slot() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let mem = ctx.alloc(4096).unwrap();
    let first = rt.ipc_export(&mem.view_all()).unwrap();
    assert_ne!(first.slot, u32::MAX, "the first export has a slot");
    let mut last = first.clone();
    for i in 0..70_000usize {
        let v = mem.view_all().view(i % 4096, None).unwrap();
        last = rt.ipc_export(&v).unwrap();
    }
    assert_eq!(
        last.slot, first.slot,
        "re-exports reuse the allocation's slot"
    );
    assert_eq!(last.export, first.export);
    // Another live buffer still gets a slot of its own.
    let other = ctx.alloc(4096).unwrap();
    let h = rt.ipc_export(&other.view_all()).unwrap();
    assert!(h.slot != u32::MAX && h.slot != first.slot);
}

#[test]
fn test_the_cost_of_an_export_does_not_grow_with_the_exports_before_it() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let mem = ctx.alloc(4096).unwrap();
    let batch = || {
        let t = std::time::Instant::now();
        for _ in 0..1000 {
            rt.ipc_export(&mem.view_all()).unwrap();
        }
        t.elapsed()
    };
    let first = (0..3).map(|_| batch()).min().unwrap();
    for _ in 0..20 {
        batch();
    }
    let later = (0..3).map(|_| batch()).min().unwrap();
    assert!(
        later < first * 4 + std::time::Duration::from_millis(20),
        "1000 exports took {first:?} at first and {later:?} after 23,000"
    );
}

#[test]
fn test_an_empty_view_at_an_allocations_end_never_exports_the_neighbour() {
    let (_drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    let mem = ctx.alloc(4096).unwrap();
    let neighbour = ctx.alloc(4096).unwrap();
    assert_eq!(neighbour.address(), mem.address() + 4096, "adjacent");
    let of_mem = rt.ipc_export(&mem.view_all()).unwrap();
    let of_neighbour = rt.ipc_export(&neighbour.view_all()).unwrap();
    for start in [4096, 5000] {
        let empty = mem.view_all().view(start, Some(start)).unwrap();
        let h = match rt.ipc_export(&empty) {
            Ok(h) => h,
            Err(e) => {
                assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
                continue;
            }
        };
        assert_ne!(
            h.handle, of_neighbour.handle,
            "never the neighbour's handle"
        );
        assert_eq!((h.handle, h.size), (of_mem.handle, 0));
        let elsewhere = foreign(h.clone());
        for h in [&h, &*elsewhere] {
            let v = rt.ipc_open(h).unwrap();
            assert_eq!(v.size(), 0, "opens to nothing");
            assert!(
                std::sync::Arc::ptr_eq(v.parent(), &mem) || v.parent().address() == mem.address()
            );
        }
    }
}

#[test]
fn test_an_export_after_a_reset_never_shares_a_stale_pointers_record() {
    let (drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    let old = ctx.alloc(4096).unwrap();
    let old_handle = rt.ipc_export(&old.view_all()).unwrap();
    rt.reset(0).unwrap();
    // Simulate the driver reset that follows: the same address comes back.
    // SAFETY: simulates the reset; `old` is stale and never used again.
    unsafe { drv.mem_free(ctx.raw(), old.address()) }.unwrap();
    let new = rt.context(0).unwrap().alloc(4096).unwrap();
    assert_eq!(
        new.address(),
        old.address(),
        "the simulator reuses the address"
    );
    let h = rt.ipc_export(&new.view_all()).unwrap();
    assert_ne!(
        h.export, old_handle.export,
        "a new allocation, a new export"
    );
    assert!(rt.ipc_open(&h).is_ok());
    assert!(matches!(
        rt.ipc_open(&old_handle),
        Err(Error::InvalidPointer(_))
    ));
    drop(old); // the stale pointer's release leaves the new one's record
    let again = rt.ipc_export(&new.view_all()).unwrap();
    assert_eq!((again.export, again.slot), (h.export, h.slot));
    assert!(rt.ipc_open(&h).is_ok());
}

/// The export number in `h`'s record of its exporter's liveness file (this
/// process's, read as an importer would).
fn record_number(h: &IpcHandle) -> u64 {
    use std::os::unix::fs::FileExt;
    let path = format!("/dev/shm/gpuptr-ipc-{}-{:016x}", h.pid, h.process);
    let file = std::fs::File::open(path).unwrap();
    let mut word = [0u8; 8];
    file.read_exact_at(&mut word, u64::from(h.slot) * 32)
        .unwrap();
    u64::from_le_bytes(word)
}

#[test]
fn test_an_export_racing_a_free_never_leaves_a_live_record() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    for round in 0..200 {
        let mem = ctx.alloc(4096).unwrap();
        let handles = std::thread::scope(|s| {
            let exporter = s.spawn(|| {
                let mut out = Vec::new();
                while let Ok(h) = rt.ipc_export(&mem.view_all().view(round % 64, None).unwrap()) {
                    out.push(h);
                }
                out
            });
            for _ in 0..round % 7 * 50 {
                std::hint::spin_loop();
            }
            mem.free().unwrap();
            exporter.join().unwrap()
        });
        for h in handles {
            assert_ne!(h.slot, u32::MAX);
            assert_ne!(
                record_number(&h),
                h.export,
                "round {round}: freed, still live"
            );
        }
    }
}
