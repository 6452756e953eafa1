//! Graph memory on the simulator: pool blocks that a CUDA graph may touch
//! when it replays are not reused until the graph is destroyed.

mod common;

use std::collections::HashSet;
use std::sync::Arc;

use gpuptr::driver::Driver;
use gpuptr::{Error, PoolConfig, Runtime, SimConfig, SimDriver};

const CAPTURING: usize = 0x7e57_0c02;
const OTHER: usize = 0x7e57_0c03;

fn pooled() -> (Arc<SimDriver>, Arc<Runtime>) {
    let drv = Arc::new(SimDriver::new(SimConfig::new(1, 64 << 20)));
    // One shard: every freed block is in reach of the test thread's
    // allocations, whichever thread freed it.
    let cfg = PoolConfig {
        ahead_bytes: 0,
        fence_pace: std::time::Duration::ZERO,
        shards: 1,
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
    assert!(
        fresh(&rt, 256).contains(&at),
        "reused after its fence alone"
    );
    drop(graph);
}

#[test]
fn test_a_stream_that_takes_part_in_the_capture_tags_from_another_thread() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    begin(&drv, &rt);
    let site = || gpuptr::Site::Described("test".into());
    let (on_capture, elsewhere) = std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: the simulator's streams are plain numbers.
            let a =
                unsafe { ctx.alloc_seen_at(4096, None, CAPTURING, gpuptr::Client::Torch, site) };
            // SAFETY: as above.
            let b = unsafe { ctx.alloc_seen_at(4096, None, OTHER, gpuptr::Client::Torch, site) };
            (a.unwrap().address(), b.unwrap().address())
        })
        .join()
        .unwrap()
    });
    let graph = end(&drv, &rt);
    let now = fresh(&rt, 256);
    assert!(
        !now.contains(&on_capture),
        "the capture's stream: the graph's"
    );
    assert!(
        now.contains(&elsewhere),
        "another thread, another stream: not"
    );
    drop(graph);
    assert!(fresh(&rt, 256).contains(&on_capture));
}

#[test]
fn test_a_capture_nobody_announced_keeps_nothing() {
    // Only the thread that began a capture may touch its graph, so only an
    // announced capture (capture_started) keeps memory.
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    rt.begin_capture(0).unwrap();
    drv.begin_capture(CAPTURING);
    let site = || gpuptr::Site::Described("test".into());
    // SAFETY: the simulator's streams are plain numbers.
    let a = unsafe { ctx.alloc_seen_at(4096, None, CAPTURING, gpuptr::Client::Torch, site) };
    drop(a.unwrap());
    let graph = end(&drv, &rt);
    assert_eq!(rt.graph_kept_bytes(0), Ok(0));
    drop(graph);
}

#[test]
fn test_an_invalidated_capture_gives_its_memory_back() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    begin(&drv, &rt);
    let at = ctx.alloc(4096).unwrap().address();
    // A refused call by some thread in global mode invalidates the capture.
    // SAFETY: the context is retained by `ctx`.
    let _ = unsafe { drv.synchronize(ctx.raw()) };
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

#[test]
fn test_a_dead_graphs_block_freed_during_a_new_capture_waits_for_the_new_graph() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    begin(&drv, &rt);
    let x = ctx.alloc(4096).unwrap(); // graph 1's output
    let g1 = end(&drv, &rt);
    drop(g1);
    let at = x.address();
    begin(&drv, &rt);
    // ... a kernel captured here reads `x` ...
    drop(x); // freed by the capturing thread during capture 2
    let g2 = end(&drv, &rt);
    assert!(
        !fresh(&rt, 64).contains(&at),
        "reused while graph 2 (which reads it) lives"
    );
    drop(g2);
}

#[test]
fn test_a_block_two_graphs_keep_returns_when_the_last_is_destroyed() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    begin(&drv, &rt);
    let x = ctx.alloc(4096).unwrap();
    let g1 = end(&drv, &rt);
    let at = x.address();
    begin(&drv, &rt);
    drop(x); // freed by the capturing thread during capture 2
    let g2 = end(&drv, &rt);
    drop(g1);
    assert!(!fresh(&rt, 64).contains(&at), "reused while graph 2 lives");
    drop(g2);
}

#[test]
fn test_a_stale_tagged_block_does_not_keep_the_old_context() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    begin(&drv, &rt);
    let x = ctx.alloc(4096).unwrap();
    let g = end(&drv, &rt);
    drop(g); // the graph is gone
    rt.graph_kept_bytes(0).unwrap(); // bury
    rt.reset(0).unwrap();
    drop(ctx);
    drop(x); // stale: its release is skipped, and so is its tag's removal
    rt.graph_kept_bytes(0).unwrap();
    assert_eq!(
        drv.retain_count(0),
        0,
        "the old primary context is still retained (by the tagged map)"
    );
}

#[test]
fn test_a_stale_untagged_block_releases_the_old_context() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    let x = ctx.alloc(4096).unwrap();
    rt.reset(0).unwrap();
    drop(ctx);
    drop(x);
    assert_eq!(drv.retain_count(0), 0);
}

#[test]
fn test_a_stale_tag_never_catches_a_new_block_at_its_address() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    begin(&drv, &rt);
    let x = ctx.alloc(4096).unwrap();
    let g = end(&drv, &rt); // the graph lives on
    let at = x.address();
    rt.reset(0).unwrap();
    // Simulate the driver's reset: the memory is gone, the address is free.
    // SAFETY: simulates the reset; `x` is stale and never used again.
    unsafe { drv.mem_free(ctx.raw(), at) }.unwrap();
    drop(x); // stale: its tag stays
    let ctx2 = rt.context(0).unwrap();
    let y = ctx2.alloc(4096).unwrap();
    assert_eq!(y.address(), at, "the simulator reuses the address");
    drop(y); // no capture anywhere
    assert_eq!(
        rt.graph_kept_bytes(0),
        Ok(0),
        "a block never captured is kept for an old graph"
    );
    drop(g);
}

#[test]
fn test_two_captures_on_one_thread_keep_their_blocks_until_both_graphs_are_gone() {
    let (drv, rt) = pooled();
    let ctx = rt.context(0).unwrap();
    let freed = ctx.alloc(4096).unwrap(); // made before, freed during both
                                          // Two captures under way on this thread at once (two streams).
    begin(&drv, &rt);
    rt.begin_capture(0).unwrap();
    drv.begin_capture(OTHER);
    // SAFETY: the simulator's streams are plain numbers.
    unsafe { rt.capture_started(0, OTHER) }.unwrap();
    let made = ctx.alloc(4096).unwrap(); // allocated during both
    let (made_at, freed_at) = (made.address(), freed.address());
    drop(made);
    drop(freed);
    let second = drv.end_capture_graph(OTHER).unwrap();
    rt.end_capture(0).unwrap();
    let first = end(&drv, &rt);
    assert_eq!(rt.graph_kept_bytes(0), Ok(8192));
    drop(first);
    let after = fresh(&rt, 256);
    assert!(
        !after.contains(&made_at) && !after.contains(&freed_at),
        "reused while the second graph can still replay"
    );
    drop(second);
    let after = fresh(&rt, 256);
    assert!(after.contains(&made_at) && after.contains(&freed_at));
    assert_eq!(rt.graph_kept_bytes(0), Ok(0));
}
