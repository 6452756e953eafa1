//! The leak report: allocations made with tracking on name their Rust call
//! site until they are released.

mod common;

use common::{sim, sim_pooled};
use gpuptr::{Client, Site};

#[test]
fn test_outstanding_names_the_rust_call_site_until_release() {
    let (_drv, rt) = sim_pooled(1, 64 << 20);
    let ctx = rt.context(0).unwrap();
    assert!(!rt.tracking(), "off by default");
    let untracked = ctx.alloc(4096).unwrap();
    rt.set_tracking(true);
    let line = line!() + 1;
    let leaked: Vec<_> = (0..3).map(|_| ctx.alloc(1 << 20).unwrap()).collect();
    let other = ctx.alloc_for(512, None, Client::Cupy).unwrap();
    let report = rt.outstanding();
    assert_eq!(report.len(), 2, "{report:?}");
    assert_eq!(report[0].site, format!("tests/track.rs:{line}"));
    assert_eq!(
        (report[0].count, report[0].bytes),
        (3, 3 << 20),
        "most bytes first"
    );
    assert_eq!(report[1].clients, vec![Client::Cupy]);
    assert_eq!(report[0].devices, vec![0]);
    drop(untracked);
    assert_eq!(rt.outstanding().len(), 2, "made while off: never listed");
    rt.set_tracking(false);
    drop(leaked);
    drop(other);
    assert!(
        rt.outstanding().is_empty(),
        "forgotten on release, also once off"
    );
}

#[test]
fn test_driver_allocations_and_described_sites_are_tracked_too() {
    let (_drv, rt) = sim(1);
    rt.set_tracking(true);
    let ctx = rt.context(0).unwrap();
    let a = ctx.alloc(100).unwrap(); // unpooled: a driver allocation
    let b = ctx
        .alloc_at(200, None, Client::Torch, || {
            Site::Described("model.py:7 in forward".into())
        })
        .unwrap();
    let zero = ctx.alloc(0).unwrap();
    let report = rt.outstanding();
    let sites: Vec<_> = report.iter().map(|o| (o.site.as_str(), o.bytes)).collect();
    assert_eq!(
        sites.len(),
        2,
        "zero-byte allocations hold nothing: {sites:?}"
    );
    assert_eq!(sites[0], ("model.py:7 in forward", 200));
    assert!(sites[1].0.starts_with("tests/track.rs:"));
    a.free().unwrap();
    assert_eq!(
        rt.outstanding().len(),
        1,
        "an explicit free forgets it at once"
    );
    drop((b, zero));
    assert!(rt.outstanding().is_empty());
}

#[test]
fn test_threads_tracking_at_once_balance() {
    let (_drv, rt) = sim_pooled(1, 256 << 20);
    rt.set_tracking(true);
    let ctx = rt.context(0).unwrap();
    std::thread::scope(|s| {
        for t in 0..8 {
            let ctx = ctx.clone();
            s.spawn(move || {
                let mut held = Vec::new();
                for i in 0..2000 {
                    held.push(ctx.alloc(512 + (t * 131 + i * 17) % 70_000).unwrap());
                    if held.len() > 4 {
                        held.remove(0);
                    }
                }
            });
        }
    });
    assert!(rt.outstanding().is_empty());
}
