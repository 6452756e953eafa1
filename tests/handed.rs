//! Allocations handed to another library's allocator interface
//! (`Runtime::hand_out`), on the simulator: kept alive until that client
//! takes them back, never by another client, and counted as PyTorch counts
//! its own (exact peaks across threads).

mod common;

use common::sim_pooled;
use gpuptr::{Client, Error};

const MIB: usize = 1 << 20;

#[test]
fn test_a_handed_out_allocation_lives_until_its_own_client_takes_it_back() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let mem = ctx.alloc(3000).unwrap();
    let at = rt.hand_out(mem, Client::Torch);
    assert_eq!(rt.handed_out_count(), 1);
    // Another client's free of the address is refused, and nothing moves.
    assert!(rt.take_back(at, Client::Cupy).is_none());
    assert!(rt.handed_out(at, Some(Client::Cupy)).is_none());
    assert!(rt.handed_out(at, None).is_some());
    let held = drv.live_bytes();
    let s = rt.library_stats(0, Client::Torch).unwrap();
    assert_eq!(
        (s.allocation.all.current, s.requested_bytes.all.current),
        (1, 3000)
    );
    assert!(
        s.allocated_bytes.small.current >= 3000,
        "the block's bytes, in the small pool"
    );
    assert_eq!(
        rt.library_stats(0, Client::Cupy).unwrap(),
        Default::default()
    );
    // Its own client takes it back once; a second time finds nothing.
    let mem = rt.take_back(at, Client::Torch).expect("handed out");
    assert!(rt.take_back(at, Client::Torch).is_none());
    assert_eq!(rt.handed_out_count(), 0);
    drop(mem);
    assert!(rt.flush_pool(0).unwrap());
    assert_eq!(drv.live_bytes(), held, "back in the pool, not the driver");
    let s = rt.library_stats(0, Client::Torch).unwrap();
    assert_eq!((s.allocation.all.current, s.allocation.all.peak), (0, 1));
    assert_eq!((s.allocation.all.allocated, s.allocation.all.freed), (1, 1));
}

#[test]
fn test_library_peaks_are_exact_across_threads_and_reset_to_now() {
    let (_drv, rt) = sim_pooled(1, 256 << 20);
    let ctx = rt.context(0).unwrap();
    // Four threads each hold at most two 1 MiB allocations at a time: the
    // peak can never pass eight, and each thread's own peak is reached.
    std::thread::scope(|s| {
        for _ in 0..4 {
            let (rt, ctx) = (&rt, &ctx);
            s.spawn(move || {
                for _ in 0..500 {
                    let a = rt.hand_out(ctx.alloc(MIB).unwrap(), Client::Torch);
                    let b = rt.hand_out(ctx.alloc(MIB).unwrap(), Client::Torch);
                    drop(rt.take_back(a, Client::Torch).unwrap());
                    drop(rt.take_back(b, Client::Torch).unwrap());
                }
            });
        }
    });
    let s = rt.library_stats(0, Client::Torch).unwrap();
    assert_eq!(s.allocation.all.current, 0);
    assert!((2..=8).contains(&s.allocation.all.peak), "{s:?}");
    assert_eq!(s.allocation.all.allocated, 4000);
    assert_eq!(s.allocated_bytes.large.current, 0);
    assert!(s.allocated_bytes.large.peak <= 8 * MIB as u64);
    // A reset of the peaks makes them the values now; one of the totals
    // starts the totals again.
    let kept = rt.hand_out(ctx.alloc(MIB).unwrap(), Client::Torch);
    rt.reset_library_peaks(0, Client::Torch).unwrap();
    assert_eq!(
        rt.library_stats(0, Client::Torch)
            .unwrap()
            .allocation
            .all
            .peak,
        1
    );
    rt.library_out_of_memory(0, Client::Torch);
    rt.reset_library_accumulated(0, Client::Torch).unwrap();
    let s = rt.library_stats(0, Client::Torch).unwrap();
    assert_eq!(
        (
            s.allocation.all.allocated,
            s.allocation.all.freed,
            s.num_ooms
        ),
        (0, 0, 0)
    );
    assert_eq!(s.allocation.all.current, 1);
    assert_eq!(s.segments_base, rt.stats()[0].segments);
    drop(rt.take_back(kept, Client::Torch));
}

#[test]
fn test_library_stats_of_a_device_that_does_not_exist_are_an_error() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    assert!(matches!(
        rt.library_stats(1, Client::Torch),
        Err(Error::InvalidArgument(_))
    ));
    rt.library_out_of_memory(7, Client::Torch); // ignored, never a panic
}

#[test]
fn test_a_library_pool_tags_what_this_thread_hands_out_and_forgets_it_when_taken_back() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    let pool = (0, 7);
    let outside = rt.hand_out(ctx.alloc(MIB).unwrap(), Client::Torch);
    rt.begin_pool(Client::Torch, 0, pool, false);
    let inside = rt.hand_out(ctx.alloc(2 * MIB).unwrap(), Client::Torch);
    // Another client, or another thread, is not in the pool.
    let cupy = rt.hand_out(ctx.alloc(MIB).unwrap(), Client::Cupy);
    let other = std::thread::scope(|s| {
        s.spawn(|| rt.hand_out(ctx.alloc(MIB).unwrap(), Client::Torch))
            .join()
            .unwrap()
    });
    assert!(rt.end_pool(Client::Torch, 0, pool));
    assert!(!rt.end_pool(Client::Torch, 0, pool), "ended once");
    let after = rt.hand_out(ctx.alloc(MIB).unwrap(), Client::Torch);
    assert_eq!(rt.pool_live(0, pool), vec![(inside, 2 * MIB)]);
    // A wrong client's free neither takes it nor untags it.
    assert!(rt.take_back(inside, Client::Cupy).is_none());
    assert_eq!(rt.pool_live(0, pool).len(), 1);
    drop(rt.take_back(inside, Client::Torch).unwrap());
    assert_eq!(rt.pool_live(0, pool), vec![]);
    let s = rt.pool_stats(Client::Torch, 0, pool);
    assert_eq!((s.live, s.allocations, s.frees), (0, 1, 1));
    assert_eq!(
        (s.peak_bytes, s.freed_bytes),
        (2 * MIB as u64, 2 * MIB as u64)
    );
    // Every thread's pool tags the others' allocations too.
    rt.begin_pool(Client::Torch, 0, pool, true);
    let theirs = std::thread::scope(|s| {
        s.spawn(|| rt.hand_out(ctx.alloc(MIB).unwrap(), Client::Torch))
            .join()
            .unwrap()
    });
    assert!(rt.end_pool(Client::Torch, 0, pool));
    assert_eq!(rt.pool_live(0, pool), vec![(theirs, MIB)]);
    for (a, c) in [
        (outside, Client::Torch),
        (cupy, Client::Cupy),
        (other, Client::Torch),
        (after, Client::Torch),
        (theirs, Client::Torch),
    ] {
        drop(rt.take_back(a, c).unwrap());
    }
    assert_eq!(rt.handed_out_count(), 0);
    assert_eq!(rt.pool_live(0, pool), vec![]);
}

#[test]
fn test_no_tag_outlives_its_allocation_when_another_thread_takes_it_back_at_once() {
    // One thread hands out under a pool, another takes each back as soon
    // as it sees the address (as PyTorch frees on autograd's thread), and
    // two more list the pool meanwhile: no tag outlives its allocation,
    // and the pool's counts balance.
    let (_drv, rt) = sim_pooled(1, 256 << 20);
    let ctx = rt.context(0).unwrap();
    let pool = (1, 1);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    std::thread::scope(|s| {
        s.spawn(|| {
            rt.begin_pool(Client::Torch, 0, pool, false);
            for _ in 0..3000 {
                tx.send(rt.hand_out(ctx.alloc(4096).unwrap(), Client::Torch))
                    .unwrap();
            }
            rt.end_pool(Client::Torch, 0, pool);
            drop(tx);
        });
        let taker = s.spawn(|| {
            for a in rx {
                drop(rt.take_back(a, Client::Torch).expect("handed out"));
            }
            stop.store(true, std::sync::atomic::Ordering::Release);
        });
        for _ in 0..2 {
            s.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Acquire) {
                    // Every listed allocation was handed out in the pool.
                    for (_, size) in rt.pool_live(0, pool) {
                        assert_eq!(size, 4096);
                    }
                }
            });
        }
        taker.join().unwrap();
    });
    assert_eq!(
        rt.pool_live(0, pool),
        vec![],
        "a tag outlived its allocation"
    );
    let s = rt.pool_stats(Client::Torch, 0, pool);
    assert_eq!((s.allocations, s.frees, s.live), (3000, 3000, 0));
    assert_eq!(rt.handed_out_count(), 0);
}

#[test]
fn test_alloc_for_holds_the_context_and_free_for_releases_on_the_stream_given() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    assert_eq!(
        rt.alloc_for(Client::Cupy, 0, 0, None, || gpuptr::Site::Described(
            "test".into()
        ))
        .unwrap(),
        0,
        "zero bytes: null, as the libraries' own allocators"
    );
    let s: gpuptr::RawStream = 0x5000;
    let a = rt
        .alloc_for(Client::Cupy, 0, MIB, Some(s), || {
            gpuptr::Site::Described("test".into())
        })
        .unwrap();
    // No caller holds a context: the runtime does, so the pool stays.
    assert_eq!(rt.handed_out(a, Some(Client::Cupy)).unwrap().size(), MIB);
    assert!(
        !rt.free_for(a, Client::Torch, None),
        "another client's free"
    );
    assert!(rt.free_for(a, Client::Cupy, Some(s)));
    assert!(!rt.free_for(a, Client::Cupy, Some(s)), "freed once");
    // Freed on its stream: reused there at once, with no fence and no
    // driver call.
    let allocs = drv.calls(gpuptr::CallKind::MemAlloc);
    let b = rt
        .alloc_for(Client::Cupy, 0, MIB, Some(s), || {
            gpuptr::Site::Described("test".into())
        })
        .unwrap();
    assert_eq!(b, a);
    assert_eq!(drv.calls(gpuptr::CallKind::MemAlloc), allocs);
    assert!(rt.free_for(b, Client::Cupy, Some(s)));
    assert!(matches!(
        rt.alloc_for(Client::Cupy, 3, MIB, None, || gpuptr::Site::Described(
            "test".into()
        )),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn test_a_pool_begun_under_a_dropped_runtime_never_reaches_the_next_one() {
    let (_d1, rt1) = sim_pooled(1, 64 << 20);
    rt1.begin_pool(Client::Torch, 0, (9, 1), false);
    drop(rt1); // never ended: the thread's list still names it
    for _ in 0..50 {
        let (_d2, rt2) = sim_pooled(1, 64 << 20);
        assert!(
            !rt2.end_pool(Client::Torch, 0, (9, 1)),
            "another runtime's pool"
        );
        rt2.begin_pool(Client::Torch, 0, (9, 2), false);
        let a = rt2
            .alloc_for(Client::Torch, 0, 4096, None, || {
                gpuptr::Site::Described("t".into())
            })
            .unwrap();
        assert!(rt2.end_pool(Client::Torch, 0, (9, 2)));
        assert_eq!(rt2.pool_live(0, (9, 2)), vec![(a, 4096)]);
        assert_eq!(rt2.pool_live(0, (9, 1)), vec![]);
        assert!(rt2.free_for(a, Client::Torch, None));
    }
}

#[test]
fn test_memory_handed_out_twice_is_recorded_and_counted_once() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let mem = rt.context(0).unwrap().alloc(4096).unwrap();
    let a = rt.hand_out(mem.clone(), Client::Torch);
    assert_eq!(rt.hand_out(mem, Client::Torch), a);
    assert_eq!(rt.handed_out_count(), 1);
    assert_eq!(
        rt.library_stats(0, Client::Torch)
            .unwrap()
            .allocation
            .all
            .current,
        1
    );
    drop(rt.take_back(a, Client::Torch).unwrap());
    let s = rt.library_stats(0, Client::Torch).unwrap();
    assert_eq!((s.allocation.all.current, rt.handed_out_count()), (0, 0));
}

#[test]
fn test_free_for_on_a_stream_leaves_memory_made_with_no_stream_to_the_fence() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let s: gpuptr::RawStream = 0x5000;
    let site = || gpuptr::Site::Described("t".into());
    let a = rt.alloc_for(Client::Rmm, 0, MIB, None, site).unwrap();
    // Work queued on another stream still writes it.
    drv.queue_write(0x6000, a, &[1; 8]).unwrap();
    assert!(rt.free_for(a, Client::Rmm, Some(s)));
    let b = rt.alloc_for(Client::Rmm, 0, MIB, Some(s), site).unwrap();
    assert_ne!(b, a, "made with no stream: reused only after the fence");
    drv.complete(None);
    assert_eq!(drv.lost_writes(), 0);
    assert!(rt.free_for(b, Client::Rmm, Some(s)));
}

/// numba's `cuda.close()` resets the context under live allocations of
/// another library (their memory goes with it); when the driver hands an
/// address out again, the new allocation is recorded as the live one, not
/// passed off as another handle of the dead entry and freed on the spot.
#[test]
fn test_an_address_reused_after_a_reset_is_the_new_allocations() {
    let (drv, rt) = sim_pooled(1, 64 << 20);
    let site = || gpuptr::Site::Described("test".into());
    let old = rt.alloc_for(Client::Torch, 0, MIB, None, site).unwrap();
    rt.reset(0).unwrap();
    drv.reset_primary_context(0);
    let new = rt.alloc_for(Client::Torch, 0, MIB, None, site).unwrap();
    assert_eq!(new, old, "the driver gave the same address again");
    assert_eq!(rt.stats()[0].live_count, 1, "the new allocation is live");
    rt.flush_pool(0).unwrap();
    let other = rt.alloc_for(Client::Cupy, 0, MIB, None, site).unwrap();
    assert_ne!(other, new, "two live allocations would share one block");
    let s = rt.library_stats(0, Client::Torch).unwrap();
    assert_eq!(
        s.allocation.all.current, 1,
        "the dead entry is no longer counted"
    );
    assert!(rt.free_for(new, Client::Torch, None) && rt.free_for(other, Client::Cupy, None));
    assert_eq!(rt.handed_out_count(), 0);
}
