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

/// After a fence someone asked for, the fence thread (with a spare CPU
/// and no pace) asks for the next one itself as that one starts: a free
/// that seals meanwhile finds a fence asked for and not started, and takes
/// its number without a write to the line the fence thread reads. With
/// one CPU it asks for nothing itself.
#[test]
fn the_fence_thread_asks_for_the_next_fence_itself_after_one_asked_for() {
    let sim = Arc::new(SimDriver::new(SimConfig::new(1, 1 << 20)));
    let ctx = sim.primary_context_retain(0).unwrap();
    let f = Fencer::new(sim.clone(), Duration::ZERO);
    let n = f.request(ctx);
    assert!(f.wait(n));
    let requested = f.ext().requested.load(Ordering::SeqCst);
    if std::thread::available_parallelism().is_ok_and(|c| c.get() > 1) {
        assert!(requested > n, "fence {n} done, {requested} asked for");
    } else {
        assert_eq!(requested, n);
    }
}

/// With nothing asked for, the fence thread sleeps until a request wakes
/// it, within a few milliseconds of its last fence: it runs fences back to
/// back for a while after one asked for, spins for a request, then polls
/// until 2 ms after that fence (a busy loop asks again within
/// microseconds, and then needs no wake-up), and no longer: spinning or
/// polling on would keep a CPU from the threads that allocate. The
/// fastest of five rounds must sleep within 50 ms (a loaded host delays
/// some; delays only shorten the poll, measured from its start).
#[test]
fn an_idle_fence_thread_sleeps_within_milliseconds_of_its_last_fence() {
    let sim = Arc::new(SimDriver::new(SimConfig::new(1, 1 << 20)));
    let ctx = sim.primary_context_retain(0).unwrap();
    let f = Fencer::new(sim.clone(), Duration::ZERO);
    let mut fastest = Duration::MAX;
    for _ in 0..5 {
        assert!(f.wait(f.request(ctx)));
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(300) {
            if f.helper.lock().sleeping {
                fastest = fastest.min(t.elapsed());
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    assert!(
        fastest < Duration::from_millis(50),
        "the fence thread stayed awake (fastest sleep: {fastest:?})"
    );
}
