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

/// A pooled runtime on the simulator without growth ahead (the tests count
/// the allocating thread's own driver calls), fencing as soon as asked.
fn pooled(memory: usize) -> (Arc<SimDriver>, Arc<Runtime>) {
    let drv = Arc::new(SimDriver::new(SimConfig::new(1, memory)));
    let cfg = PoolConfig {
        ahead_bytes: 0,
        fence_pace: std::time::Duration::ZERO,
        ..PoolConfig::default()
    };
    let rt = Runtime::with_pool(drv.clone(), Some(cfg)).unwrap();
    (drv, rt)
}

#[test]
fn test_no_fence_runs_during_a_capture_and_blocks_freed_then_wait_for_the_one_after() {
    let (drv, rt) = pooled(64 << 20);
    let ctx = rt.context(0).unwrap();
    let p = ctx.alloc(4096).unwrap();
    let at = p.address();
    rt.begin_capture(0).unwrap();
    drv.begin_capture(CAPTURING);
    let syncs = drv.calls(gpuptr::CallKind::Synchronize);
    drop(p);
    // A miss seals the freed block and asks for a fence; the fence thread
    // must not run it now.
    let q = ctx.alloc(4096).unwrap();
    assert_ne!(q.address(), at, "never reused before its fence");
    assert_eq!(
        rt.flush_pool(0),
        Ok(false),
        "no fence can run during a capture"
    );
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(drv.calls(gpuptr::CallKind::Synchronize), syncs);
    assert_eq!(drv.end_capture(CAPTURING), Ok(()), "the capture is intact");
    rt.end_capture(0).unwrap();
    assert!(!rt.capturing(0).unwrap());
    // After the capture, the fence runs and the block is reused.
    assert_eq!(rt.flush_pool(0), Ok(true));
    let r = ctx.alloc(4096).unwrap();
    assert_eq!(r.address(), at);
}

#[test]
fn test_a_capture_that_begins_while_a_fence_runs_waits_for_it() {
    let (drv, rt) = pooled(64 << 20);
    let ctx = rt.context(0).unwrap();
    let p = ctx.alloc(4096).unwrap();
    let at = p.address();
    drv.queue_write(NON_BLOCKING, p.address(), &[1; 8]).unwrap();
    let syncs = drv.calls(gpuptr::CallKind::Synchronize);
    // The first free asks for a fence at once, and the fence thread runs it:
    // it waits for the queued write. (The fence watched is this one, so no
    // other thread's request can be held back by the capture instead.)
    drop(p);
    while drv.calls(gpuptr::CallKind::Synchronize) == syncs {
        std::thread::yield_now();
    }
    std::thread::scope(|s| {
        // The capturing thread ends its own capture (an end is taken only
        // from the thread that began it) once told to.
        let (began_tx, began_rx) = std::sync::mpsc::channel();
        let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
        let rt = &rt;
        let capturing = s.spawn(move || {
            rt.begin_capture(0).unwrap();
            began_tx.send(()).unwrap();
            end_rx.recv().unwrap();
            rt.end_capture(0)
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            began_rx.try_recv().is_err(),
            "the capture waits for the running fence"
        );
        drv.complete(None);
        began_rx.recv().unwrap();
        assert!(rt.capturing(0).unwrap());
        // The fence the capture waited for finished: its block is reusable
        // during the capture, with no fence running in it.
        let during = drv.calls(gpuptr::CallKind::Synchronize);
        let q = ctx.alloc(4096).unwrap();
        assert_eq!(q.address(), at, "the fenced block is reused");
        assert_eq!(drv.calls(gpuptr::CallKind::Synchronize), during);
        drop(q);
        end_tx.send(()).unwrap();
        capturing.join().unwrap().unwrap();
    });
    assert!(!rt.capturing(0).unwrap());
    assert_eq!(rt.flush_pool(0), Ok(true));
}

#[test]
fn test_out_of_memory_during_a_capture_fails_at_once_and_frees_no_unfenced_block() {
    let (drv, rt) = pooled(8 << 20);
    let ctx = rt.context(0).unwrap();
    let held: Vec<_> = (0..3).map(|_| ctx.alloc(2 << 20).unwrap()).collect();
    let freed = ctx.alloc(2 << 20).unwrap();
    rt.begin_capture(0).unwrap();
    drv.begin_capture(CAPTURING);
    // Freed once the capture began, so that its fence cannot have run
    // before (freed earlier, a fence thread quick enough would have made
    // it free first): it waits for a fence, and the device is full.
    drop(freed);
    let syncs = drv.calls(gpuptr::CallKind::Synchronize);
    let frees = drv.calls(gpuptr::CallKind::MemFree);
    let r =
        std::thread::scope(|s| s.spawn(|| ctx.alloc(2 << 20).map(|p| p.size())).join()).unwrap();
    // The only cached block waits for a fence that cannot run now: it is
    // neither handed out nor given back to the driver unfenced.
    assert!(matches!(r, Err(Error::OutOfMemory { .. })), "{r:?}");
    assert_eq!(
        drv.calls(gpuptr::CallKind::Synchronize),
        syncs,
        "no fence ran"
    );
    assert_eq!(
        drv.calls(gpuptr::CallKind::MemFree),
        frees,
        "no unfenced free"
    );
    assert_eq!(drv.end_capture(CAPTURING), Ok(()));
    rt.end_capture(0).unwrap();
    // After the capture the fence runs, and the same request succeeds.
    assert_eq!(ctx.alloc(2 << 20).map(|p| p.size()), Ok(2 << 20));
    drop(held);
}

#[test]
fn test_the_last_drop_during_a_capture_still_gives_every_cached_block_back() {
    let (drv, rt) = pooled(64 << 20);
    let ctx = rt.context(0).unwrap();
    let p = ctx.alloc(4096).unwrap();
    rt.begin_capture(0).unwrap();
    drop(p); // waits for a fence that cannot run now
    drop(ctx); // the context ends, and its memory with it
    rt.end_capture(0).unwrap();
    assert_eq!(drv.retain_count(0), 0);
    assert_eq!(drv.live_bytes(), 0);
    assert_eq!(
        rt.pool_held_blocks(0),
        0,
        "no block of the ended context is kept"
    );
    let ctx = rt.context(0).unwrap();
    let q = ctx.alloc(4096).unwrap();
    q.view_all().memset(1, None).unwrap();
}

#[test]
fn test_a_fence_of_one_device_runs_while_another_devices_stream_captures() {
    // CUDA's rule is per context (measured on the H200): a synchronize of
    // device 1 leaves device 0's capture intact; one of device 0 is refused.
    let (drv, rt) = sim_pooled(2, 64 << 20);
    let (c0, c1) = (rt.context(0).unwrap(), rt.context(1).unwrap());
    drv.begin_capture_on(0, NON_BLOCKING);
    // SAFETY: live contexts of the simulator.
    unsafe { drv.synchronize(c1.raw()) }.unwrap();
    drv.end_capture(NON_BLOCKING).unwrap();
    drv.begin_capture_on(0, NON_BLOCKING);
    // SAFETY: as above.
    let e = unsafe { drv.synchronize(c0.raw()) }.unwrap_err();
    assert_eq!(code(e), Some(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED));
    assert_eq!(
        code(drv.end_capture(NON_BLOCKING).unwrap_err()),
        Some(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    );
    // The pool's gate is per device too: device 1 fences meanwhile.
    rt.begin_capture(0).unwrap();
    assert_eq!(rt.flush_pool(1), Ok(true));
    rt.end_capture(0).unwrap();
}

#[test]
fn test_an_unbalanced_end_capture_is_refused_and_closes_no_other_threads_gate() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    assert!(matches!(rt.end_capture(0), Err(Error::InvalidArgument(_))));
    rt.begin_capture(0).unwrap();
    let other = rt.clone();
    let r = std::thread::spawn(move || other.end_capture(0))
        .join()
        .unwrap();
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    assert_eq!(
        rt.capturing(0),
        Ok(true),
        "another thread closed this one's gate"
    );
    rt.end_capture(0).unwrap();
    assert_eq!(rt.capturing(0), Ok(false));
}

/// A thread that exits during a capture it began ends it as it goes: the
/// capture held every fence of the device back for good, and nothing else
/// could end it (an end is taken only from the thread that began it).
#[test]
fn test_a_thread_that_exits_during_its_capture_ends_it() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let other = rt.clone();
    std::thread::spawn(move || {
        other.begin_capture(0).unwrap();
        other.begin_capture(0).unwrap(); // nested: both end
        other.end_capture(0).unwrap();
    })
    .join()
    .unwrap();
    assert_eq!(
        rt.capturing(0),
        Ok(false),
        "the dead thread's capture ended"
    );
    // Fences run again: the device's memory is reused, not exhausted.
    for _ in 0..200 {
        drop(ctx.alloc(8 << 20).unwrap());
    }
    assert!(rt.flush_pool(0).unwrap());
    assert!(drv.live_bytes() <= 32 << 20, "{}", drv.live_bytes());
    // This thread's own captures are its own to end, and a balanced one
    // leaves nothing behind for its exit.
    rt.begin_capture(0).unwrap();
    rt.end_capture(0).unwrap();
    assert_eq!(rt.capturing(0), Ok(false));
}

/// A capture begun from a thread-local's destructor, once the thread's
/// record of its captures is gone, is refused rather than left open for good.
#[test]
fn test_a_capture_begun_as_its_thread_exits_is_not_left_open() {
    struct BeginsOnDrop(Arc<Runtime>, std::sync::mpsc::Sender<gpuptr::Result<()>>);
    impl Drop for BeginsOnDrop {
        fn drop(&mut self) {
            let _ = self.1.send(self.0.begin_capture(0));
        }
    }
    thread_local! {
        static LATE: std::cell::RefCell<Option<BeginsOnDrop>> = const { std::cell::RefCell::new(None) };
    }
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let (tx, rx) = std::sync::mpsc::channel();
    let other = rt.clone();
    std::thread::spawn(move || {
        // Made first, so destroyed after the capture record (the reverse order).
        LATE.with(|l| *l.borrow_mut() = Some(BeginsOnDrop(other.clone(), tx)));
        other.begin_capture(0).unwrap();
        other.end_capture(0).unwrap();
    })
    .join()
    .unwrap();
    let begun = rx.recv().unwrap();
    assert_eq!(rt.capturing(0), Ok(false), "{begun:?}");
}

/// A block freed without a stream on an idle GPU, well before a capture,
/// is reusable inside it, where no fence may run: its free asked for a
/// fence at once, and that fence ended before the capture began. (A pool
/// that gathered small frees into batches, sealed only at a size or a
/// miss, left it unfenced and ran out of memory here.)
#[test]
fn test_a_block_freed_long_before_a_capture_is_reusable_in_it() {
    let (drv, rt) = pooled(8 << 20);
    let ctx = rt.context(0).unwrap();
    let held: Vec<_> = (0..3).map(|_| ctx.alloc(2 << 20).unwrap()).collect();
    drop(ctx.alloc(2 << 20).unwrap());
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(rt.stats()[0].pending_bytes, 0, "fenced before the capture");
    rt.begin_capture(0).unwrap();
    drv.begin_capture(CAPTURING);
    let got =
        std::thread::scope(|s| s.spawn(|| ctx.alloc(2 << 20).map(|p| p.size())).join()).unwrap();
    assert_eq!(drv.end_capture(CAPTURING), Ok(()));
    rt.end_capture(0).unwrap();
    drop(held);
    assert_eq!(got.ok(), Some(2 << 20), "reused inside the capture");
}
