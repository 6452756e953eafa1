//! [`Fencer`]: the per-device helper that makes freed blocks safe to reuse.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::helper::{Helper, Shared};
use super::spin::{own_cpu_clock, thread_cpu_ns, Probe, NO_CLOCK};
use crate::driver::{Driver, RawContext};
use crate::sync::{lock, wait, wait_timeout};

/// How long a wait for the fence thread yields the CPU before it sleeps
/// instead ([`wait_turn`]): an idle GPU's fence ends within it.
const YIELD_FIRST: Duration = Duration::from_micros(50);

/// One turn of a wait for the fence thread begun at `since`: a yield for
/// the first [`YIELD_FIRST`], then a 50 µs sleep. With fewer free CPUs than
/// runnable threads, a yield hands the CPU straight back when nothing else
/// waits on it, while the fence thread waits on another CPU behind the
/// thread that allocates; a sleep lets it run here.
fn wait_turn(since: Instant) {
    if since.elapsed() < YIELD_FIRST {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Nanoseconds since the first call (0 is never returned: it means "not
/// running" in [`FenceExt::started_ns`]).
pub(super) fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    let base = *BASE.get_or_init(Instant::now);
    (base.elapsed().as_nanos() as u64).max(1)
}

/// The per-device helper that makes freed blocks safe to reuse: it runs
/// `cuCtxSynchronize` on its own thread, so no allocating thread waits for
/// the GPU. [`Fencer::request`] returns the number of a synchronize that
/// starts after the call, [`Fencer::done`] that of the last one finished:
/// a batch sealed with number `n` is ready once `done() >= n`.
pub(crate) struct Fencer {
    pub(super) helper: Helper<FenceState, FenceExt>,
}

/// A value on cache lines of its own (two: adjacent-line prefetch), so
/// that writes to its neighbours do not evict it from readers' caches.
#[repr(align(128))]
pub(crate) struct Line<T>(pub(crate) T);

impl<T> std::ops::Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// What the fence thread and its users read without the lock, in order
/// (`repr(C)`) on three sets of lines: `done` (read by allocations that find
/// a batch sealed), the request fields (written by requests and each fence's
/// start), and `started_ns` (written around each fence, read by misses).
#[repr(C)]
pub(crate) struct FenceExt {
    driver: Arc<dyn Driver>,
    pace: Duration,
    done: Line<AtomicU64>,
    /// The newest number handed out: a request shares it while it has not
    /// started (no lock), else takes the next by compare-and-swap.
    pub(super) requested: AtomicU64,
    /// The number the running (or last) synchronize covers (set under lock).
    pub(super) started: AtomicU64,
    /// The newest request's context (as `FenceState::context`, which the
    /// fence thread reads under the lock): a request for another locks.
    context: std::sync::atomic::AtomicUsize,
    /// The fence thread sleeps, or is about to: a new number's ask wakes it.
    sleeping: std::sync::atomic::AtomicBool,
    /// When the running synchronize started ([`now_ns`]); 0: none runs.
    started_ns: Line<AtomicU64>,
    /// The fence thread's CPU time when it started ([`thread_cpu_ns`]).
    started_cpu: AtomicU64,
    /// The fence thread's CPU-time clock ([`NO_CLOCK`] until it starts).
    cpu_clock: std::sync::atomic::AtomicI64,
    /// The context's sync blocks (`CU_CTX_SCHED_BLOCKING_SYNC`): no CPU spent.
    pub(super) blocking_sync: std::sync::atomic::AtomicBool,
    /// The last look at the running fence's CPU ([`Fencer::spun`]).
    probe: Probe,
}

#[derive(Default)]
pub(crate) struct FenceState {
    /// The newest number whose synchronize failed.
    failed: u64,
    context: RawContext,
    /// Threads waiting on `done` (out of memory, or a capture's start).
    pub(super) waiters: usize,
    /// Captures under way ([`Fencer::begin_capture`]): no fence runs then
    /// (`cuCtxSynchronize` would fail and invalidate them, in any mode).
    captures: usize,
    /// A synchronize is running now.
    pub(super) syncing: bool,
}

/// After a fence the helper polls for a request every [`FENCE_POLL`] (or
/// pace, if longer) for this long before it sleeps until woken: a busy
/// allocator asks again within microseconds, and waking a sleeper costs it
/// a system call; timed sleeps, not spins, leave it the CPU.
const FENCE_IDLE_POLL: Duration = Duration::from_millis(2);
const FENCE_POLL: Duration = Duration::from_micros(5);

impl Fencer {
    pub(crate) fn new(driver: Arc<dyn Driver>, pace: Duration) -> Self {
        let ext = FenceExt {
            driver,
            pace,
            done: Line(AtomicU64::new(0)),
            requested: AtomicU64::new(0),
            started: AtomicU64::new(0),
            context: std::sync::atomic::AtomicUsize::new(0),
            sleeping: std::sync::atomic::AtomicBool::new(false),
            started_ns: Line(AtomicU64::new(0)),
            started_cpu: AtomicU64::new(0),
            cpu_clock: std::sync::atomic::AtomicI64::new(NO_CLOCK),
            blocking_sync: std::sync::atomic::AtomicBool::new(false),
            probe: Probe::default(),
        };
        Fencer {
            helper: Helper::new("gpuptr-fence", ext),
        }
    }

    pub(super) fn ext(&self) -> &FenceExt {
        &self.helper.shared.ext
    }

    /// The number of the last finished fence.
    #[inline]
    pub(crate) fn done(&self) -> u64 {
        self.ext().done.load(Ordering::Acquire)
    }

    /// The number of the fence started last (0: none yet).
    #[inline]
    pub(crate) fn started(&self) -> u64 {
        self.ext().started.load(Ordering::SeqCst)
    }

    /// Whether the fence running now has run `cost` and spins
    /// ([`Probe::spins`]): a busy GPU (its `cuCtxSynchronize` spins), not a
    /// loaded host (a thread waiting for a CPU spends none). Wall time alone
    /// without a CPU clock or for a blocking sync; no clock read before `cost`.
    pub(crate) fn spun(&self, cost: Duration) -> bool {
        let ext = self.ext();
        let started = ext.started_ns.load(Ordering::Relaxed);
        if started == 0 {
            return false;
        }
        let now = now_ns();
        if now.saturating_sub(started) < cost.as_nanos() as u64 {
            return false;
        }
        if ext.blocking_sync.load(Ordering::Relaxed) {
            return true;
        }
        let start_cpu = ext.started_cpu.load(Ordering::Acquire);
        match thread_cpu_ns(ext.cpu_clock.load(Ordering::Relaxed)) {
            Some(cpu) => ext.probe.spins((started, start_cpu), (now, cpu), cost),
            None => true,
        }
    }

    /// Wait until fence `n` is done (whether it is), or the fence running
    /// has spun `cost` (a busy GPU: [`Fencer::spun`]), or `limit` passed. A
    /// fence thread waiting for a CPU is waited for (this one yields and
    /// sleeps so it runs): on a loaded host misses would grow at every wait.
    /// (Under a blocking sync, wall time alone tells: a late one reads busy.)
    pub(crate) fn wait_unless_busy(&self, n: u64, cost: Duration, limit: Duration) -> bool {
        let since = Instant::now();
        loop {
            if self.done() >= n {
                return true;
            }
            if self.spun(cost) || since.elapsed() >= limit || !self.may_start(n) {
                return false;
            }
            if self.started() < n {
                // Cut the helper's rest (or its poll) short.
                self.helper.shared.work.notify_one();
            }
            wait_turn(since);
        }
    }

    /// Whether fence `n` may still start, or has: the fence thread exists,
    /// and neither a failure nor a capture (before its start) holds it back.
    fn may_start(&self, n: u64) -> bool {
        let st = lock(&self.helper.shared.state);
        let held_back = st.s.captures > 0 && self.started() < n;
        st.spawned && !st.shutdown && !held_back && st.s.failed < n
    }

    /// Ask for a fence of `context` that starts after now; its number.
    /// Requests made before the helper picks them up share one fence.
    pub(crate) fn request(&self, context: RawContext) -> u64 {
        let ext = self.ext();
        // The fast path: no lock, as a hot loop seals every few frees and
        // the fence thread takes the lock around each fence.
        if context != 0 && ext.context.load(Ordering::SeqCst) == context {
            loop {
                let r = ext.requested.load(Ordering::SeqCst);
                // SeqCst: this load comes before the fence thread's store of
                // `started` that starts fence `r`, so that fence starts
                // after this call (and after the frees before it).
                if r > ext.started.load(Ordering::SeqCst) {
                    return r;
                }
                if ext
                    .requested
                    .compare_exchange(r, r + 1, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    // The fence thread sets `sleeping`, then reads `requested`
                    // again before sleeping: one side sees the other's store.
                    if ext.sleeping.load(Ordering::SeqCst) {
                        drop(self.helper.lock());
                        self.helper.shared.work.notify_one();
                    }
                    return r + 1;
                }
            }
        }
        let mut st = self.helper.lock();
        let r = ext.requested.load(Ordering::SeqCst);
        let n = if r == ext.started.load(Ordering::SeqCst) || st.s.context != context {
            r + 1
        } else {
            r
        };
        st.s.context = context;
        ext.context.store(context, Ordering::SeqCst);
        ext.requested.store(n, Ordering::SeqCst);
        // No thread: the next waiter fences inline instead.
        self.helper.start(&mut st, fence_loop);
        self.helper.wake(st);
        n
    }

    /// A stream capture begins: until its [`Fencer::end_capture`] no fence
    /// starts, and one running is waited for first (no `cuCtxSynchronize`
    /// during a capture); frees wait, sealed, for the fence after it.
    pub(crate) fn begin_capture(&self) {
        let sh = &self.helper.shared;
        let mut st = lock(&sh.state);
        st.s.captures += 1;
        // Out-of-memory waiters for a fence that has not started now cannot
        // have it until the capture ends: let them go on without it.
        sh.done.notify_all();
        while st.s.syncing && !st.shutdown {
            st.s.waiters += 1;
            st = wait(&sh.done, st);
            st.s.waiters -= 1;
        }
    }

    /// A capture begun with [`Fencer::begin_capture`] ended: fences may run
    /// again once no other capture is under way.
    pub(crate) fn end_capture(&self) {
        let mut st = self.helper.lock();
        st.s.captures = st.s.captures.saturating_sub(1);
        if st.s.captures == 0 && asked(self.ext()) {
            self.helper.shared.work.notify_one();
        }
    }

    /// Whether a capture is under way (no fence can run now).
    pub(crate) fn capturing(&self) -> bool {
        self.helper.lock().s.captures > 0
    }

    /// Wait until fence `n` is done (out-of-memory paths only); `false` if
    /// it failed or cannot happen (shut down, or a capture under way).
    pub(crate) fn wait(&self, n: u64) -> bool {
        let sh = &self.helper.shared;
        let mut st = lock(&sh.state);
        loop {
            if self.done() >= n {
                return true;
            }
            // A fence not started yet cannot start during a capture (one
            // under way goes on, and a capture's start waits for it).
            let held_back = st.s.captures > 0 && self.ext().started.load(Ordering::SeqCst) < n;
            if st.s.failed >= n || st.shutdown || held_back {
                return false;
            }
            if !st.spawned {
                // The helper could not start: synchronize here (a capture
                // that begins meanwhile waits for it, as for the helper's).
                let (target, context) = (sh.ext.requested.load(Ordering::SeqCst), st.s.context);
                st.s.syncing = true;
                drop(st);
                // SAFETY: `context` is the live context the pool's owner
                // passed with the request.
                let ok = unsafe { sh.ext.driver.synchronize(context) }.is_ok();
                if ok {
                    sh.ext.done.fetch_max(target, Ordering::AcqRel);
                }
                let mut st = lock(&sh.state);
                st.s.syncing = false;
                if st.s.waiters > 0 {
                    sh.done.notify_all();
                }
                drop(st);
                return ok && self.done() >= n;
            }
            st.s.waiters += 1;
            // Cut the helper's rest short: this thread needs the fence now.
            sh.work.notify_one();
            st = wait(&sh.done, st);
            st.s.waiters -= 1;
        }
    }
}

/// A fence that runs this long is logged, whoever asked for it.
const LOG_LONG: Duration = Duration::from_micros(20);

/// How long the fence thread spins for a new request after a fence, before
/// it polls with timed waits ([`FENCE_POLL`]).
const FENCE_SPIN: Duration = Duration::from_micros(100);

/// For this long after a fence that someone asked for, the fence thread
/// (with a spare CPU) asks for the next one itself as each starts, so a
/// free that seals finds a fence asked for and not started and takes its
/// number without writing the lines the fence thread reads (an idle GPU's
/// fence takes about 0.3 µs on an H200; a write costs the line's trips).
const FENCE_HOT: Duration = Duration::from_micros(100);

/// Whether a fence is asked for that has not started.
fn asked(ext: &FenceExt) -> bool {
    ext.requested.load(Ordering::SeqCst) != ext.started.load(Ordering::SeqCst)
}

/// Spin until a number past `started` is asked for, or [`FENCE_SPIN`] past
/// `since`, yielding now and then so one CPU still runs the allocators.
fn spin_for_request(ext: &FenceExt, started: u64, since: Instant) {
    let mut n = 0u32;
    while ext.requested.load(Ordering::Relaxed) == started && since.elapsed() < FENCE_SPIN {
        n = n.wrapping_add(1);
        if n.is_multiple_of(64) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

fn fence_loop(sh: &Shared<FenceState, FenceExt>) {
    sh.ext.cpu_clock.store(own_cpu_clock(), Ordering::Relaxed);
    // With one CPU a spin only takes it from the thread that would ask.
    let spare_cpus = std::thread::available_parallelism().is_ok_and(|n| n.get() > 1);
    let pace = sh.ext.pace;
    let poll = pace.max(FENCE_POLL);
    // The number the fence thread asked for itself last, until when it goes
    // on asking (see `FENCE_HOT`), and whether the threads waiting saw a log.
    let (mut own_ask, mut hot_until, mut waited_logged) = (0u64, None::<Instant>, false);
    let mut st = lock(&sh.state);
    loop {
        // Wait for a request: poll a while (no wake-up needed), then sleep.
        let idle = Instant::now();
        if spare_cpus && !asked(&sh.ext) && st.s.captures == 0 && !st.shutdown {
            // First spin, without the lock: a fast loop of pairs asks again
            // within microseconds, and a fence that answers at once keeps
            // the pool within its budget with no miss waiting for it.
            let started = sh.ext.started.load(Ordering::SeqCst);
            drop(st);
            spin_for_request(&sh.ext, started, idle);
            st = lock(&sh.state);
        }
        while (!asked(&sh.ext) || st.s.captures > 0) && !st.shutdown {
            if spare_cpus && idle.elapsed() < FENCE_IDLE_POLL {
                st = wait_timeout(&sh.work, st, poll);
            } else {
                // Announce the sleep, then look again (see `request`).
                sh.ext.sleeping.store(true, Ordering::SeqCst);
                if !asked(&sh.ext) || st.s.captures > 0 {
                    st = sh.sleep(st);
                }
                sh.ext.sleeping.store(false, Ordering::SeqCst);
            }
        }
        if st.shutdown {
            return;
        }
        let (target, context) = (sh.ext.requested.load(Ordering::SeqCst), st.s.context);
        sh.ext.started.store(target, Ordering::SeqCst);
        let now = Instant::now();
        let asked_for = target != own_ask;
        if asked_for {
            hot_until = Some(now + FENCE_HOT);
        }
        if spare_cpus && pace.is_zero() && hot_until.is_some_and(|t| now < t) {
            // Ask for the next fence now, after this one's start: frees sealed
            // from here on take its number (a racing request may have asked).
            let _ = sh.ext.requested.compare_exchange(
                target,
                target + 1,
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
            own_ask = target + 1;
        }
        // A capture that begins from now waits for this synchronize.
        st.s.syncing = true;
        drop(st);
        if crate::fork::forked() {
            return;
        }
        let started =
            log::log_enabled!(target: "gpuptr::fence", log::Level::Debug).then(Instant::now);
        let clock = sh.ext.cpu_clock.load(Ordering::Relaxed);
        sh.ext
            .started_cpu
            .store(thread_cpu_ns(clock).unwrap_or(0), Ordering::Release);
        sh.ext.started_ns.store(now_ns(), Ordering::Release);
        // SAFETY: `context` is a primary context the pool's owner retained and
        // passed with a request; a teardown may release it during the helper's
        // own run of fences (a failure ends it). A primary context's handle
        // stays its device's, so the call then touches no memory: it fails on
        // the released context, or synchronizes it if someone retained it.
        let r = unsafe { sh.ext.driver.synchronize(context) };
        sh.ext.started_ns.store(0, Ordering::Relaxed);
        st = lock(&sh.state);
        st.s.syncing = false;
        // The logger only queues the record (no GIL), before the fence reads
        // as done, so a caller that waited (`flush_pool`) delivers it. Back-to-
        // back fences (`FENCE_HOT`) are logged if asked for, long, or the first
        // that threads waiting now saw (they may wake only after several): a
        // waiter that came later may find an earlier fence's record only.
        let waited = st.s.waiters > 0 && !std::mem::replace(&mut waited_logged, true);
        waited_logged &= st.s.waiters > 0;
        let logged = started.filter(|t| asked_for || waited || t.elapsed() >= LOG_LONG);
        match (&r, logged) {
            (Ok(()), Some(t)) => log::debug!(
                target: "gpuptr::fence",
                "fence {target} done in {} us",
                t.elapsed().as_micros()
            ),
            (Err(e), _) => log::warn!(
                target: "gpuptr::fence",
                "fence {target} failed ({e}); its blocks wait for the next one"
            ),
            _ => {}
        }
        match r {
            Ok(()) => {
                sh.ext.done.fetch_max(target, Ordering::AcqRel);
            }
            // Batches stay sealed for a later request's fence; the helper's own
            // run ends (on a released context: two warnings, not 70).
            Err(_) => (st.s.failed, hot_until) = (st.s.failed.max(target), None),
        }
        if st.s.waiters > 0 {
            sh.done.notify_all();
        } else if !pace.is_zero() && !st.shutdown {
            // Rest, so frees gather for the next fence; a waiter cuts it short.
            st = wait_timeout(&sh.work, st, pace);
        }
    }
}
