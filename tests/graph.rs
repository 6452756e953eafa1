//! Graph memory on the simulator: pool blocks that a CUDA graph may touch
//! when it replays are not reused until the graph is destroyed.

mod common;

use std::collections::HashSet;
use std::sync::Arc;

use gpuptr::{Error, PoolConfig, Runtime, SimConfig, SimDriver};

const CAPTURING: usize = 0x7e57_0c02;
const OTHER: usize = 0x7e57_0c03;

fn pooled() -> (Arc<SimDriver>, Arc<Runtime>) {
    let drv = Arc::new(SimDriver::new(SimConfig::new(1, 64 << 20)));
    let cfg = PoolConfig {
        ahead_bytes: 0,
        fence_pace: std::time::Duration::ZERO,
        ..PoolConfig::default()
    };
    let _ = common::sim_pooled;
    (drv.clone(), Runtime::with_pool(drv, Some(cfg)).unwrap())
}

/// Begin a capture of `CAPTURING` as `gpuptr.install()` does around a
/// library's own begin.
fn begin(drv: &SimDriver, rt: &Arc<Runtime>) {
    rt.begin_capture(0).unwrap();
    drv.begin_capture(CAPTURING);
    // SAFETY: the simulator's streams are plain numbers.
    unsafe { rt.capture_started(0, CAPTURING) }.unwrap();
}

fn end(drv: &SimDriver, rt: &Runtime) -> gpuptr::driver::SimGraph {
    let g = drv.end_capture_graph(CAPTURING).unwrap();
    rt.end_capture(0).unwrap();
    g
}

/// The addresses of `n` fresh 4 KiB blocks after a fence (held together,
/// so each is a different block), then freed.
fn fresh(rt: &Arc<Runtime>, n: usize) -> HashSet<u64> {
    assert_eq!(rt.flush_pool(0), Ok(true));
    let ctx = rt.context(0).unwrap();
    let held: Vec<_> = (0..n).map(|_| ctx.alloc(4096).unwrap()).collect();
    held.iter().map(|p| p.address()).collect()
}

#[test]
fn test_a_block_allocated_and_freed_in_a_capture_waits_for_the_graph() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    begin(&drv, &rt);
    let p = ctx.alloc(4096).unwrap();
    let at = p.address();
    drop(p);
    let graph = end(&drv, &rt);
    assert_eq!(rt.graph_kept_bytes(0), Ok(4096));
    assert!(
        !fresh(&rt, 256).contains(&at),
        "reused while the graph lives"
    );
    drop(graph);
    assert!(fresh(&rt, 256).contains(&at), "back once the graph is gone");
    assert_eq!(rt.graph_kept_bytes(0), Ok(0));
}

#[test]
fn test_a_block_made_in_a_capture_and_freed_after_it_still_waits() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    begin(&drv, &rt);
    let out = ctx.alloc(4096).unwrap();
    let graph = end(&drv, &rt);
    let at = out.address();
    drop(out); // the graph's output, freed by its user: the graph still writes it
    assert!(!fresh(&rt, 256).contains(&at));
    drop(graph);
    assert!(fresh(&rt, 256).contains(&at));
}

#[test]
fn test_a_block_the_capturing_thread_frees_during_the_capture_waits() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    let input = ctx.alloc(4096).unwrap();
    let at = input.address();
    begin(&drv, &rt);
    drop(input); // a captured kernel may read it at every replay
    let graph = end(&drv, &rt);
    assert!(!fresh(&rt, 256).contains(&at));
    drop(graph);
    assert!(fresh(&rt, 256).contains(&at));
}

#[test]
fn test_another_threads_memory_is_not_the_graphs() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    begin(&drv, &rt);
    let at = std::thread::scope(|s| {
        s.spawn(|| {
            let p = ctx.alloc(4096).unwrap();
            p.address()
        })
        .join()
        .unwrap()
    });
    let graph = end(&drv, &rt);
    assert_eq!(rt.graph_kept_bytes(0), Ok(0));
    assert!(fresh(&rt, 256).contains(&at), "reused after its fence alone");
    drop(graph);
}

#[test]
fn test_a_stream_that_takes_part_in_the_capture_names_it_without_capture_started() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    // No capture_started: the stream alone names the capture (PyTorch's
    // hook passes its current stream), and no thread is the capture's.
    rt.begin_capture(0).unwrap();
    drv.begin_capture(CAPTURING);
    let site = || gpuptr::Site::Described("test".into());
    // SAFETY: the simulator's streams are plain numbers.
    let a = unsafe { ctx.alloc_seen_at(4096, None, CAPTURING, gpuptr::Client::Torch, site) };
    // SAFETY: as above.
    let b = unsafe { ctx.alloc_seen_at(4096, None, OTHER, gpuptr::Client::Torch, site) };
    let (on_capture, elsewhere) = (a.unwrap().address(), b.unwrap().address());
    let graph = end(&drv, &rt);
    let now = fresh(&rt, 256);
    assert!(
        !now.contains(&on_capture),
        "the capture's block is the graph's"
    );
    assert!(now.contains(&elsewhere), "a block of another stream is not");
    drop(graph);
    assert!(fresh(&rt, 256).contains(&on_capture));
}

#[test]
fn test_an_invalidated_capture_gives_its_memory_back() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    begin(&drv, &rt);
    let at = ctx.alloc(4096).unwrap().address();
    // A refused call by some thread in global mode invalidates the capture.
    // SAFETY: the context is retained by `ctx`.
    let _ = unsafe { gpuptr::driver::Driver::synchronize(drv.as_ref(), ctx.raw()) };
    assert!(drv.end_capture_graph(CAPTURING).is_err());
    rt.end_capture(0).unwrap();
    assert!(
        fresh(&rt, 256).contains(&at),
        "no graph: nothing to wait for"
    );
}

#[test]
fn test_capture_started_refuses_a_stream_that_is_not_capturing() {
    let (_drv, rt) = pooled();
    // SAFETY: the simulator's streams are plain numbers.
    let r = unsafe { rt.capture_started(0, OTHER) };
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    // SAFETY: as above.
    let r = unsafe { rt.capture_started(7, OTHER) };
    assert!(r.is_err());
}

#[test]
fn test_a_graph_outliving_a_reset_never_hands_out_stale_blocks() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    begin(&drv, &rt);
    let p = ctx.alloc(4096).unwrap();
    drop(p);
    let graph = end(&drv, &rt);
    drop(ctx);
    rt.reset(0).unwrap();
    drop(graph); // its blocks belong to the old epoch: refused, never reused
    let ctx = rt.context(0).unwrap();
    let q = ctx.alloc(4096).unwrap();
    q.view_all().memset(1, None).unwrap();
    assert_eq!(rt.graph_kept_bytes(0), Ok(0));
}

#[test]
fn test_the_graph_holds_the_context_so_the_pool_outlives_it() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    begin(&drv, &rt);
    let p = ctx.alloc(4096).unwrap();
    drop(p);
    let graph = end(&drv, &rt);
    drop(ctx);
    // The graph may replay into its block: the context and pool live on.
    assert!(
        drv.live_bytes() > 0,
        "graph memory was freed under the graph"
    );
    drop(graph);
    gpuptr::Runtime::graph_kept_bytes(&rt, 0).unwrap(); // gives it back
    assert_eq!(drv.live_bytes(), 0, "all given back once the graph is gone");
}
