//! The fence's reading of a busy GPU ([`Probe::spins`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::fence::Fencer;
use super::super::spin::Probe;
use crate::driver::{Driver, SimConfig, SimDriver};

const US: u64 = 1_000;

/// A fence spins when it has spent a growth's cost of CPU and keeps
/// spending: on a CPU for a quarter of its run, or, sharing one more
/// thinly (valgrind runs one thread at a time: a sixth to an eighth), its
/// CPU grew by a sixteenth of the time between two looks. Not one that
/// lost its CPU after a little work (measured on the simulator beside
/// spinning processes: 20.8 µs of CPU, then 2 ms without), however often
/// it is looked at; nor one that has not yet spent the cost. One that spent
/// milliseconds spinning and then lost its CPU still does.
#[test]
fn a_fence_spins_only_while_it_spends_its_cpu_not_while_it_waits_for_one() {
    let cost = Duration::from_micros(20);
    let p = Probe::default();
    // Alone on a CPU, and sharing one with three other threads.
    assert!(p.spins((1, 0), (1 + 2_050 * US, 2_000 * US), cost));
    assert!(p.spins((1, 0), (1 + 2_000 * US, 500 * US), cost));
    // Under the cost, however long it ran on a CPU.
    assert!(!p.spins((1, 0), (1 + 19 * US, 19 * US), cost));
    // Waiting for a CPU since it spent 20.8 µs: never, look after look.
    let frozen = (2, 0);
    for ms in 1..5 {
        assert!(
            !p.spins(frozen, (2 + ms * 1_000 * US, 20_800), cost),
            "{ms} ms"
        );
    }
    // Starved after 19 ms of CPU (valgrind beside an allocating loop):
    // a busy GPU's, look after look.
    let starved = (4, 0);
    for ms in [30, 90, 100] {
        assert!(p.spins(starved, (4 + ms * 1_000 * US, 18_971 * US), cost));
    }
    // A seventh of a CPU: not at the first look; at a look 1 ms later,
    // not one 10 µs later.
    let thin = (3, 0);
    assert!(!p.spins(thin, (3 + 1_000 * US, 143 * US), cost));
    assert!(!p.spins(thin, (3 + 1_010 * US, 144 * US), cost));
    assert!(p.spins(thin, (3 + 2_000 * US, 286 * US), cost));
}

/// A thread already waiting for a fence that has not started when a
/// capture begins goes on without it (it would otherwise wait through
/// the capture, which a thread holding the device's recovery lock
/// cannot afford: the capturing thread may need that lock to end it).
#[test]
fn a_waiter_for_a_fence_not_yet_started_goes_on_when_a_capture_begins() {
    let sim = Arc::new(SimDriver::new(SimConfig::new(1, 1 << 20)));
    let ctx = sim.primary_context_retain(0).unwrap();
    let (mut caught, mut stuck) = (0, 0);
    for _ in 0..40 {
        let f = Arc::new(Fencer::new(sim.clone(), Duration::ZERO));
        assert!(f.wait(f.request(ctx)));
        let waiter = f.clone();
        let w = std::thread::spawn(move || waiter.wait(waiter.request(ctx)));
        // Begin the capture while the waiter waits and its fence has not
        // started (the helper polls between fences).
        let began = loop {
            let st = f.helper.lock();
            let (started, requested) = (
                f.ext().started.load(Ordering::SeqCst),
                f.ext().requested.load(Ordering::SeqCst),
            );
            let fenced = started == requested && requested > 1;
            if w.is_finished() || st.s.syncing || fenced {
                break false;
            }
            if st.s.waiters > 0 && started < requested {
                drop(st);
                f.begin_capture();
                break true;
            }
            drop(st);
            // Let the other threads run (valgrind runs one at a time).
            std::thread::yield_now();
        };
        if began {
            caught += 1;
            let deadline = Instant::now() + Duration::from_secs(2);
            while !w.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            stuck += usize::from(!w.is_finished());
            f.end_capture();
        }
        let _ = w.join();
    }
    assert_eq!(
        stuck, 0,
        "{stuck} of {caught} waiters stayed through a capture"
    );
}
