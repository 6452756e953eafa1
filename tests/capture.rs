//! Stream capture on the simulator: CUDA's rule for calls made while some
//! thread captures (measured on an H200, see `CaptureMode`), and gpuptr's
//! own allocations and frees, which never break a capture.

mod common;

use common::{sim, sim_pooled, NON_BLOCKING};
use gpuptr::codes::{CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED};
use gpuptr::driver::Driver;
use gpuptr::{CaptureMode, Error, PoolConfig, Runtime, SimConfig, SimDriver};
use std::sync::Arc;

const CAPTURING: usize = 0x7e57_0c01;

fn code(e: Error) -> Option<i32> {
    e.cuda_code()
}

#[test]
fn test_a_global_mode_allocation_during_a_capture_fails_and_invalidates_it() {
    let (drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    drv.begin_capture(CAPTURING);
    let r = std::thread::scope(|s| {
        // SAFETY: the context is retained by `ctx`.
        s.spawn(|| unsafe { drv.mem_alloc(ctx.raw(), 4096) })
            .join()
            .unwrap()
    });
    assert_eq!(
        r.map_err(code),
        Err(Some(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED))
    );
    assert_eq!(
        drv.end_capture(CAPTURING).map_err(code),
        Err(Some(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED))
    );
}

#[test]
fn test_relaxed_mode_allows_allocation_but_no_context_synchronize() {
    let (drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    drv.begin_capture(CAPTURING);
    assert_eq!(
        drv.exchange_capture_mode(CaptureMode::Relaxed),
        Ok(CaptureMode::Global)
    );
    // SAFETY: the context is retained by `ctx`; the block is freed below.
    let p = unsafe { drv.mem_alloc(ctx.raw(), 4096) }.unwrap();
    // SAFETY: `p` was allocated just above and is unused.
    unsafe { drv.mem_free(ctx.raw(), p) }.unwrap();
    assert_eq!(
        drv.end_capture(CAPTURING),
        Ok(()),
        "alloc and free leave it intact"
    );
    drv.begin_capture(CAPTURING);
    // SAFETY: the context is retained.
    let r = unsafe { drv.synchronize(ctx.raw()) };
    assert_eq!(
        r.map_err(code),
        Err(Some(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED))
    );
    assert!(
        drv.end_capture(CAPTURING).is_err(),
        "cuCtxSynchronize invalidates in every mode"
    );
    drv.exchange_capture_mode(CaptureMode::Global).unwrap();
}

#[test]
fn test_driver_allocations_and_frees_during_a_capture_leave_it_intact() {
    let (drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    drv.begin_capture(CAPTURING);
    std::thread::scope(|s| {
        s.spawn(|| {
            let p = gpuptr::DevicePointer::alloc_uncached(&ctx, 4096).unwrap();
            p.free().unwrap();
            // The thread's own mode is put back after each call.
            assert_eq!(drv.capture_mode(), CaptureMode::Global);
        });
    });
    assert_eq!(drv.end_capture(CAPTURING), Ok(()));
}

#[test]
fn test_pool_misses_and_trims_during_another_threads_capture_leave_it_intact() {
    // No growth ahead: this checks the allocating thread's own driver calls.
    let drv = Arc::new(SimDriver::new(SimConfig::new(1, 64 << 20)));
    let cfg = PoolConfig {
        ahead_bytes: 0,
        ..PoolConfig::default()
    };
    let rt = Runtime::with_pool(drv.clone(), Some(cfg)).unwrap();
    let ctx = rt.context(0).unwrap();
    drv.begin_capture(CAPTURING);
    std::thread::scope(|s| {
        s.spawn(|| {
            // Misses of three classes, each a driver allocation, freed on a
            // stream (reused on it at once: no fence is needed).
            for size in [4096, 1 << 20, 3 << 20] {
                let p = ctx.alloc_on(size, NON_BLOCKING).unwrap();
                drop(p);
            }
            assert!(rt.trim().unwrap() >= (4 << 20), "the trim's frees ran");
            assert_eq!(drv.capture_mode(), CaptureMode::Global);
        });
    });
    assert_eq!(drv.end_capture(CAPTURING), Ok(()));
    assert_eq!(drv.live_bytes(), 0);
    let _ = sim_pooled; // the common helpers are shared by every test file
}
