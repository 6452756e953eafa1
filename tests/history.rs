//! The allocation history and memory snapshots: a bounded, ordered trace of
//! allocations, frees and segments, and the pool's segments and blocks.

mod common;

use std::sync::Arc;

use common::sim;
use gpuptr::history::Action;
use gpuptr::{
    BlockState, Client, Frame, PoolConfig, Runtime, SimConfig, SimDriver, Site, Snapshot,
};

/// A pooled runtime without growth ahead of demand: its helper thread would
/// add segments to the trace at times of its own.
fn sim_pooled(devices: usize, memory: usize) -> (Arc<SimDriver>, Arc<Runtime>) {
    let drv = Arc::new(SimDriver::new(SimConfig::new(devices, memory)));
    let cfg = PoolConfig {
        ahead_bytes: 0,
        ..PoolConfig::default()
    };
    (drv.clone(), Runtime::with_pool(drv, Some(cfg)).unwrap())
}

fn actions(s: &Snapshot, device: usize) -> Vec<(Action, u64, usize)> {
    s.device_traces[device]
        .iter()
        .map(|e| (e.action, e.address, e.size))
        .collect()
}

fn flush(rt: &Arc<Runtime>) {
    assert!(rt.flush_pool(0).unwrap());
}

#[test]
fn test_off_records_nothing() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    assert!(!rt.recording_history(), "off by default");
    let ctx = rt.context(0).unwrap();
    let a = ctx.alloc(1 << 20).unwrap();
    drop(a);
    let s = rt.snapshot();
    assert_eq!(s.device_traces.len(), 1, "one list per device");
    assert!(s.device_traces[0].is_empty(), "{:?}", s.device_traces);
    // The segments are there all the same, with no history behind them.
    assert_eq!(s.segments.len(), 1);
    let b = &s.segments[0].blocks[0];
    assert!(b.site.is_none() && b.client.is_none());
}

#[test]
fn test_alloc_and_free_pair_in_order_with_their_segment_first() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    rt.record_history(true, 1000);
    let line = line!() + 1;
    let a = ctx.alloc(1000).unwrap();
    let b = ctx.alloc_for(3000, None, Client::Cupy).unwrap();
    let (aa, ba) = (a.address(), b.address());
    drop(a);
    let s = rt.snapshot();
    let t = actions(&s, 0);
    // The segment comes before the allocation it was made for (the pool
    // had none); the second allocation fits in the same segment.
    assert_eq!(t[0].0, Action::SegmentAlloc);
    assert_eq!((t[1].0, t[1].1, t[1].2), (Action::Alloc, aa, 1000));
    assert_eq!((t[2].0, t[2].1, t[2].2), (Action::Alloc, ba, 3000));
    assert_eq!(
        &t[3..],
        &[
            (Action::FreeRequested, aa, 1000),
            (Action::FreeCompleted, aa, 1000)
        ]
    );
    let e = &s.device_traces[0][1];
    assert_eq!(e.client, Some(Client::Direct));
    let frames = e.site.as_ref().unwrap().frames();
    assert_eq!(
        (&*frames[0].filename, frames[0].line),
        ("tests/history.rs", line)
    );
    assert_eq!(s.device_traces[0][2].client, Some(Client::Cupy));
    // Times never go back.
    let times: Vec<u64> = s.device_traces[0].iter().map(|e| e.time_us).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    // One segment: a's block, b's, and the rest, free.
    assert_eq!(s.segments.len(), 1);
    let seg = &s.segments[0];
    assert_eq!(seg.address, aa);
    assert_eq!(seg.blocks.len(), 3);
    let blk = seg.blocks.iter().find(|b| b.address == ba).unwrap();
    assert_eq!(blk.state, BlockState::Active);
    // Sizes round up to 512 bytes.
    assert_eq!((blk.requested_size, blk.size), (3000, 3072));
    assert_eq!(blk.client, Some(Client::Cupy));
    // a waits for the fence, then is cached and ready.
    assert_eq!(seg.blocks[0].state, BlockState::PendingFree);
    assert_eq!(seg.blocks[2].state, BlockState::Inactive);
    flush(&rt);
    let s = rt.snapshot();
    let seg_a = s.segments.iter().find(|g| g.address == aa).unwrap();
    assert_eq!(seg_a.blocks[0].state, BlockState::Inactive);
    assert!(seg_a.blocks[0].site.is_none());
    drop(b);
}

#[test]
fn test_the_ring_keeps_the_newest_max_entries() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let warm = ctx.alloc(4096).unwrap(); // its segment is made before the history
    drop(warm);
    flush(&rt);
    rt.record_history(true, 10);
    let sizes: Vec<usize> = (1..=20).map(|i| 4000 + i).collect();
    for &n in &sizes {
        drop(ctx.alloc_for(n, Some(0), Client::Direct).unwrap());
    }
    let t = actions(&rt.snapshot(), 0);
    assert_eq!(t.len(), 10, "{t:?}");
    // The newest ten: the last five allocations and their frees, in order.
    let want: Vec<(Action, usize)> = sizes[15..]
        .iter()
        .flat_map(|&n| {
            [
                (Action::Alloc, n),
                (Action::FreeRequested, n),
                (Action::FreeCompleted, n),
            ]
        })
        .skip(5)
        .collect();
    let got: Vec<(Action, usize)> = t.iter().map(|e| (e.0, e.2)).collect();
    assert_eq!(got, want);
    // Started again, the ring starts afresh.
    rt.record_history(true, 10);
    assert!(actions(&rt.snapshot(), 0).is_empty());
}

#[test]
fn test_stopping_keeps_the_trace_and_records_no_more() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    rt.record_history(true, 100);
    let a = ctx.alloc(4096).unwrap();
    let before = actions(&rt.snapshot(), 0);
    rt.record_history(false, 100);
    assert!(!rt.recording_history());
    let b = ctx.alloc(8192).unwrap();
    drop(a); // made while on, freed while off: forgotten, not recorded
    drop(b);
    assert_eq!(actions(&rt.snapshot(), 0), before);
    let s = rt.snapshot();
    assert!(s
        .segments
        .iter()
        .flat_map(|g| &g.blocks)
        .all(|b| b.site.is_none()));
}

#[test]
fn test_trims_and_resets_record_their_segment_frees_after_the_blocks() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    rt.record_history(true, 100);
    let a = ctx.alloc(1 << 20).unwrap();
    let aa = a.address();
    drop(a);
    rt.trim().unwrap();
    let t = actions(&rt.snapshot(), 0);
    assert_eq!(t.last(), Some(&(Action::SegmentFree, aa, 2 << 20)), "{t:?}");
    assert!(rt.snapshot().segments.is_empty());

    let live = ctx.alloc(5000).unwrap();
    let la = live.address();
    rt.reset(0).unwrap();
    let t = actions(&rt.snapshot(), 0);
    let n = t.len();
    assert_eq!(
        &t[n - 3..],
        &[
            (Action::FreeRequested, la, 5000),
            (Action::FreeCompleted, la, 5000),
            (Action::SegmentFree, la, 2 << 20),
        ]
    );
    drop(live); // stale: its release records nothing more
    assert_eq!(actions(&rt.snapshot(), 0).len(), n);
}

#[test]
fn test_allocations_outside_the_pool_are_their_own_segments() {
    let (_drv, rt) = sim(1);
    let ctx = rt.context(0).unwrap();
    rt.record_history(true, 100);
    let a = ctx
        .alloc_at(777, None, Client::Torch, || {
            Site::Stack(
                vec![Frame {
                    filename: "model.py".into(),
                    line: 7,
                    name: "forward".into(),
                }]
                .into(),
            )
        })
        .unwrap();
    let s = rt.snapshot();
    assert_eq!(s.segments.len(), 1);
    let seg = &s.segments[0];
    assert_eq!((seg.address, seg.total_size), (a.address(), 777));
    assert_eq!(seg.blocks[0].client, Some(Client::Torch));
    let aa = a.address();
    drop(a);
    assert_eq!(
        actions(&rt.snapshot(), 0),
        vec![
            (Action::SegmentAlloc, aa, 777),
            (Action::Alloc, aa, 777),
            (Action::FreeRequested, aa, 777),
            (Action::FreeCompleted, aa, 777),
            (Action::SegmentFree, aa, 777),
        ]
    );
}

#[test]
fn test_out_of_memory_writes_the_snapshot_and_names_it() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let dir = std::env::temp_dir().join(format!("gpuptr-history-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("oom.pickle");
    rt.set_oom_snapshot(Some(path.clone()));
    let keep = ctx.alloc(1 << 20).unwrap();
    let err = ctx.alloc(1 << 30).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&format!(
            "a memory snapshot was written to {}",
            path.display()
        )),
        "{msg}"
    );
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[..2], &[0x80, 2], "a protocol-2 pickle");
    assert_eq!(bytes.last(), Some(&b'.'));
    // History off: the trace has the one oom entry.
    let t = actions(&rt.snapshot(), 0);
    assert_eq!(t, vec![(Action::Oom, 0, 1 << 30)]);
    // A path that cannot be written is named in the error, never raised.
    let bad = dir.join("missing").join("oom.pickle");
    rt.set_oom_snapshot(Some(bad.clone()));
    let msg = ctx.alloc(1 << 30).unwrap_err().to_string();
    assert!(msg.contains("could not be written"), "{msg}");
    assert!(!bad.exists());
    rt.set_oom_snapshot(None);
    let msg = ctx.alloc(1 << 30).unwrap_err().to_string();
    assert!(!msg.contains("snapshot"), "{msg}");
    drop(keep);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn test_blocks_cover_their_segment_in_address_order() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    // Blocks carved from one allocation: a reservation.
    ctx.reserve(4096, 16 * 4096).unwrap();
    let held: Vec<_> = (0..5).map(|_| ctx.alloc(4096).unwrap()).collect();
    let s = rt.snapshot();
    for seg in &s.segments {
        let mut at = seg.address;
        for b in &seg.blocks {
            assert_eq!(b.address, at);
            at += b.size as u64;
        }
        assert_eq!(at, seg.address + seg.total_size as u64);
    }
    let active = s
        .segments
        .iter()
        .flat_map(|g| &g.blocks)
        .filter(|b| b.state == BlockState::Active)
        .count();
    assert_eq!(active, 5);
    drop(held);
}

#[test]
fn test_a_stale_free_after_a_reset_keeps_the_history_of_the_allocation_that_reuses_its_address() {
    let (drv, rt) = sim(1);
    rt.record_history(true, 1000);
    let ctx = rt.context(0).unwrap();
    let old = ctx.alloc(4096).unwrap();
    let addr = old.address();
    rt.reset(0).unwrap();
    drv.reset_primary_context(0);
    let ctx = rt.context(0).unwrap();
    let new = ctx.alloc(4096).unwrap();
    assert_eq!(
        new.address(),
        addr,
        "the simulator reuses the address after a reset"
    );
    let frees_before = rt.snapshot().device_traces[0]
        .iter()
        .filter(|e| e.action == Action::FreeCompleted && e.address == addr)
        .count();
    old.free().unwrap();
    drop(old);
    let s = rt.snapshot();
    let seg = s.segments.iter().find(|g| g.address == addr);
    assert!(
        seg.is_some_and(|g| g.blocks.iter().any(|b| b.site.is_some())),
        "the new allocation dropped out of the snapshot: {:?}",
        s.segments
    );
    let frees = s.device_traces[0]
        .iter()
        .filter(|e| e.action == Action::FreeCompleted && e.address == addr)
        .count();
    assert_eq!(
        frees, frees_before,
        "the stale free put a false free in the trace"
    );
    drop(new);
}
