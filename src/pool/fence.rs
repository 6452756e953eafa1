//! [`Fencer`]: the per-device helper that makes freed blocks safe to reuse.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::helper::{Helper, Shared};
use crate::driver::{Driver, RawContext};
use crate::sync::{lock, wait, wait_timeout};

/// A fence that has run (been in `cuCtxSynchronize`) this long means a busy
/// GPU: queued work holds the freed blocks back, and waiting for them would
/// be slow. A fence of an idle GPU takes a few microseconds (an H200: 2-5
/// µs; the simulator: less than one).
pub(crate) const FENCE_BUSY: Duration = Duration::from_micros(20);

/// A fence that has run this long means a busy GPU, whatever its thread's
/// CPU time (a driver set to block rather than spin while it waits; a
/// preempted thread waits a few ms at most), unless a driver call of the
/// pool's own holds it up (see [`Fencer::busy_confirmed`]).
pub(crate) const FENCE_BUSY_SURE: Duration = Duration::from_millis(10);

/// A fence that has run this long means a busy GPU even while a driver call
/// of the pool's own is under way: some of those wait for the GPU
/// themselves (a `cuMemFree` of a trim), and a busy GPU must not hide
/// behind them for as long as its work runs. A fence the pool's own
/// allocation held up on a loaded simulator ran at most 33 ms.
const FENCE_BUSY_CERTAIN: Duration = Duration::from_millis(50);

/// The CPU time the fence thread spends in a fence, watched by
/// [`Fencer::busy_confirmed`], that makes a busy GPU; and the longest it
/// watches. Well past what an idle GPU's fence costs in all (about 0.3 µs
/// on an H200): a fence thread preempted in the middle of an idle fence
/// spends a few µs more to end it once it runs again, which 2 µs took for
/// a busy GPU (the simulator on two CPUs: a 73 µs fence read as busy, and
/// the growth helper grew 36 MiB ahead for a 3 MiB working set).
const FENCE_SPUN: Duration = Duration::from_micros(10);
const CONFIRM_WINDOW: Duration = Duration::from_micros(50);

/// How long a wait for the fence thread yields the CPU each turn before it
/// sleeps instead ([`wait_turn`]).
const YIELD_FIRST: Duration = Duration::from_micros(50);

/// One turn of a wait for the fence thread that began at `since`: yield the
/// CPU for the first [`YIELD_FIRST`] (an idle GPU's fence ends within it,
/// and a busy one is confirmed), then sleep 50 µs a turn. On a host with
/// fewer free CPUs than runnable threads a yield hands the CPU back to the
/// thread that yields whenever nothing else waits on that CPU, while the
/// fence thread waits on another behind the thread that allocates; a sleep
/// lets it run here. With yields alone, on the simulator with two CPUs, the
/// growth helper's waits kept fences from starting for milliseconds, and
/// three 1 MiB blocks churned 2000 times held up to 563 MiB.
fn wait_turn(since: Instant) {
    if since.elapsed() < YIELD_FIRST {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// No thread CPU clock ([`FenceExt::cpu_clock`]).
const NO_CLOCK: i64 = i64::MIN;

/// The calling thread's CPU-time clock, for other threads to read.
fn own_cpu_clock() -> i64 {
    #[cfg(target_os = "linux")]
    {
        let mut id: libc::clockid_t = 0;
        // SAFETY: pthread_self() is the calling thread, alive for the call;
        // `id` is a valid place for the result.
        if unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut id) } == 0 {
            return i64::from(id);
        }
    }
    NO_CLOCK
}

/// The CPU time of the thread whose clock is `clock` ([`own_cpu_clock`]),
/// in nanoseconds; `None` if it cannot be read (no clock, or the thread
/// ended).
fn thread_cpu_ns(clock: i64) -> Option<u64> {
    if clock == NO_CLOCK {
        return None;
    }
    #[cfg(target_os = "linux")]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid place for the result; an id of a thread
        // that ended makes the call fail (EINVAL), never touch memory.
        if unsafe { libc::clock_gettime(clock as libc::clockid_t, &mut ts) } == 0 {
            return Some(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64);
        }
    }
    None
}

/// Nanoseconds since the first call (0 is never returned: it means "not
/// running" in [`FenceExt::started_ns`]).
pub(super) fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    let base = *BASE.get_or_init(Instant::now);
    (base.elapsed().as_nanos() as u64).max(1)
}

/// The per-device helper that makes freed blocks safe to reuse: it runs
/// `cuCtxSynchronize` on its own thread for every batch sealed before the
/// call, so no allocating thread waits for the GPU.
///
/// Sequence numbers order it: [`Fencer::request`] returns the number of a
/// synchronize that starts after the call; [`Fencer::done`] is the number of
/// the last one that finished. A batch sealed with number `n` is ready once
/// `done() >= n`.
pub(crate) struct Fencer {
    helper: Helper<FenceState, FenceExt>,
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

/// What the fence thread and its users read without the lock. In order
/// (`repr(C)`), on four sets of lines: `done` (read by every allocation),
/// the request fields (written by requests and by each fence's start),
/// `started_ns` with the rest (written around each fence, read by
/// decisions that grow the pool), and `resting` (read by every hand-out).
#[repr(C)]
pub(crate) struct FenceExt {
    driver: Arc<dyn Driver>,
    pace: Duration,
    done: Line<AtomicU64>,
    /// The newest number handed out (a request that finds it not started
    /// yet shares it, without the lock; one that finds it started takes
    /// the next with a compare-and-swap).
    requested: AtomicU64,
    /// The number the running (or last) synchronize covers (written by the
    /// fence thread, under the lock).
    started: AtomicU64,
    /// The context of the newest request (also `FenceState::context`,
    /// which the fence thread reads under the lock): a request for another
    /// one takes the lock.
    context: std::sync::atomic::AtomicUsize,
    /// The fence thread is about to sleep, or sleeps, until woken: a
    /// request that takes a new number wakes it.
    sleeping: std::sync::atomic::AtomicBool,
    /// When the running synchronize started ([`now_ns`]); 0: none runs.
    started_ns: Line<AtomicU64>,
    /// The fence thread's CPU-time clock ([`own_cpu_clock`]; [`NO_CLOCK`]
    /// until it starts).
    cpu_clock: std::sync::atomic::AtomicI64,
    /// The fence (by its start) found busy: it stays so until it ends.
    busy_verdict: AtomicU64,
    /// The pool's own driver calls under way ([`Fencer::own_call`]), and
    /// when the last one ended.
    own_calls: std::sync::atomic::AtomicUsize,
    own_call_end: AtomicU64,
    /// The fence thread sleeps after a rest of the pool (no request for
    /// [`FENCE_IDLE_POLL`], no capture under way), and no allocation has
    /// taken it up yet ([`Fencer::take_rest`]). On a line of its own: every
    /// hand-out reads it, and it is written only as the thread sleeps and
    /// wakes.
    resting: Line<std::sync::atomic::AtomicBool>,
}

#[derive(Default)]
pub(crate) struct FenceState {
    /// The newest number whose synchronize failed.
    failed: u64,
    context: RawContext,
    /// Threads waiting on `done` (out of memory, or a capture's start).
    waiters: usize,
    /// Stream captures under way on the device ([`Fencer::begin_capture`]):
    /// while any is, no fence runs (`cuCtxSynchronize` would fail and
    /// invalidate them, in every capture mode).
    captures: usize,
    /// A synchronize is running now.
    syncing: bool,
}

/// After its last fence the helper looks for a new request every
/// [`FENCE_POLL`] (or every pace, if longer) for this long before it sleeps
/// until woken: a busy allocator asks again within microseconds, and waking
/// a sleeping thread would cost the allocating thread a system call. Polling
/// with timed sleeps, not spinning, leaves the CPU to the allocating threads.
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
            cpu_clock: std::sync::atomic::AtomicI64::new(NO_CLOCK),
            busy_verdict: AtomicU64::new(0),
            own_calls: std::sync::atomic::AtomicUsize::new(0),
            own_call_end: AtomicU64::new(0),
            resting: Line(std::sync::atomic::AtomicBool::new(false)),
        };
        Fencer {
            helper: Helper::new("gpuptr-fence", FenceState::default(), ext),
        }
    }

    fn ext(&self) -> &FenceExt {
        &self.helper.shared.ext
    }

    /// The number of the last finished fence.
    #[inline]
    pub(crate) fn done(&self) -> u64 {
        self.ext().done.load(Ordering::Acquire)
    }

    /// The newest fence number asked for.
    #[cfg(test)]
    pub(crate) fn requested(&self) -> u64 {
        self.ext().requested.load(Ordering::SeqCst)
    }

    /// The number of the fence started last (0: none yet).
    #[inline]
    pub(crate) fn started(&self) -> u64 {
        self.ext().started.load(Ordering::SeqCst)
    }

    /// Whether a requested fence has not finished yet: freed memory is held
    /// back now (the GPU is busy, or the fence is on its way).
    #[inline]
    pub(crate) fn outstanding(&self) -> bool {
        self.ext().requested.load(Ordering::Relaxed) > self.done()
    }

    /// Whether the GPU looks busy: a fence has been running for at least
    /// [`FENCE_BUSY`] (queued work holds freed blocks back). A fence asked
    /// for but not started says nothing of the GPU. Returns when the running
    /// fence started (its identity for verdicts), or 0 if it does not look
    /// busy. A clock read: cheap, but a preempted fence thread looks busy
    /// too ([`Fencer::busy_confirmed`] tells them apart).
    #[inline]
    pub(crate) fn busy_fence(&self) -> u64 {
        let t = self.ext().started_ns.load(Ordering::Relaxed);
        if t != 0 && now_ns().saturating_sub(t) >= FENCE_BUSY.as_nanos() as u64 {
            t
        } else {
            0
        }
    }

    /// [`Fencer::busy_fence`], confirmed: the fence thread runs in this
    /// fence and it does not end ([`Fencer::fence_thread_spins`]), and no
    /// driver call of the pool's own held it up; or the fence has run
    /// [`FENCE_BUSY_SURE`], and no driver call of the pool's own held it up
    /// either, or [`FENCE_BUSY_CERTAIN`] in any case. A fence thread that
    /// was only preempted (one CPU, a loaded host) either gets no CPU or
    /// ends its fence at once: not busy. A verdict of busy holds until the
    /// fence ends. Costs the caller a few µs (up to 50 on a loaded host): for decisions that grow
    /// the pool, off the fast path.
    pub(crate) fn busy_confirmed(&self) -> bool {
        let ext = self.ext();
        let t = ext.started_ns.load(Ordering::Relaxed);
        if t == 0 {
            return false;
        }
        if ext.busy_verdict.load(Ordering::Relaxed) == t {
            // This fence was found busy already: it stays so until it ends.
            return true;
        }
        let now = now_ns();
        let ran = now.saturating_sub(t);
        if ran < FENCE_BUSY.as_nanos() as u64 {
            return false;
        }
        // The pool's own driver calls (an allocation, a free) hold the
        // driver, and so the fence, up: that is not the GPU.
        let quiet = ext.own_calls.load(Ordering::Acquire) == 0
            && now.saturating_sub(ext.own_call_end.load(Ordering::Acquire))
                >= FENCE_BUSY.as_nanos() as u64;
        let busy = if ran >= FENCE_BUSY_SURE.as_nanos() as u64 {
            // This long, whatever its thread's CPU time (a driver that
            // blocks while it waits spends none), unless the pool's own
            // driver call holds it up. On the simulator (two CPUs, a
            // process spinning beside them, a mixed trace's allocations, no
            // GPU work at all) 3 to 19 fences a run read as busy by their
            // length alone while an allocation of the pool's own ran, each
            // followed by growth ahead for a busy GPU; with this check, none
            // in three runs. Past FENCE_BUSY_CERTAIN, busy in any case.
            quiet || ran >= FENCE_BUSY_CERTAIN.as_nanos() as u64
        } else {
            quiet && self.fence_thread_spins(t)
        };
        if busy {
            ext.busy_verdict.store(t, Ordering::Relaxed);
            log::debug!(
                target: "gpuptr::fence",
                "the fence that started {} us ago reads as a busy GPU",
                ran / 1000
            );
        }
        busy
    }

    /// Whether the fence thread, in the fence that started at `t`, runs: it
    /// gets [`FENCE_SPUN`] of CPU time within [`CONFIRM_WINDOW`] and the
    /// fence still has not ended (on an idle GPU a fence thread that gets
    /// the CPU back ends its fence within a microsecond; the driver spins
    /// while the GPU works). The caller yields the CPU meanwhile, so that
    /// on one CPU the fence thread runs.
    fn fence_thread_spins(&self, t: u64) -> bool {
        let ext = self.ext();
        let clock = ext.cpu_clock.load(Ordering::Relaxed);
        let Some(c1) = thread_cpu_ns(clock) else {
            // No clock to read: the wall time alone.
            return true;
        };
        let since = Instant::now();
        loop {
            std::thread::yield_now();
            let Some(c2) = thread_cpu_ns(clock) else {
                return true;
            };
            if ext.started_ns.load(Ordering::Acquire) != t {
                return false;
            }
            if c2.saturating_sub(c1) >= FENCE_SPUN.as_nanos() as u64 {
                return true;
            }
            if since.elapsed() >= CONFIRM_WINDOW {
                return false;
            }
        }
    }

    /// Run `f`, one of the pool's own driver calls that may hold the driver
    /// up (an allocation or a free), so that a fence it delays does not
    /// read as a busy GPU ([`Fencer::busy_confirmed`]).
    pub(crate) fn own_call<T>(&self, f: impl FnOnce() -> T) -> T {
        let ext = self.ext();
        ext.own_calls.fetch_add(1, Ordering::AcqRel);
        let r = f();
        ext.own_call_end.store(now_ns(), Ordering::Release);
        ext.own_calls.fetch_sub(1, Ordering::AcqRel);
        r
    }

    /// Wait until fence `n` is done, for at most `limit`; whether it is.
    /// Unlike [`Fencer::wait`] it never synchronizes on this thread (with
    /// no helper it returns `false` at once): a bounded wait, for a miss of
    /// an idle GPU that would rather reuse a block than grow.
    pub(crate) fn wait_for(&self, n: u64, limit: Duration) -> bool {
        if self.done() >= n {
            return true;
        }
        let sh = &self.helper.shared;
        // Fence `n` has started: the thread exists, is awake and runs it (no
        // capture holds it back), so neither the lock nor a wake-up is
        // needed, only the wait. A hot loop's fence is mostly started by the
        // time a miss waits for it, and the lock it would take is the one
        // the fence thread takes as each fence ends. A fence that fails
        // never becomes done: the wait runs out, as below.
        if self.started() < n {
            if !self.may_start(n) {
                return false;
            }
            // Cut the helper's rest (or its poll) short.
            sh.work.notify_one();
        }
        // An idle GPU's fence ends within a microsecond or two (an H200:
        // 0.3 us): spin for it, yielding the CPU each turn so that, on one
        // CPU, the fence thread runs. A sleep on a condition variable would
        // cost more than the fence (the wake-up, and Linux's timer slack of
        // 50 us on a timed wait).
        let since = Instant::now();
        loop {
            if self.done() >= n {
                return true;
            }
            if since.elapsed() >= limit {
                return false;
            }
            wait_turn(since);
        }
    }

    /// [`Fencer::wait_for`] with `limit`, and if fence `n` had not even
    /// started by then, on for at most `unstarted` more while it has not:
    /// the fence thread waits for a CPU (a host with fewer free CPUs than
    /// runnable threads), which says nothing of the GPU. A fence that
    /// starts meanwhile gets `limit` more. Whether fence `n` is done.
    pub(crate) fn wait_for_started(&self, n: u64, limit: Duration, unstarted: Duration) -> bool {
        if self.wait_for(n, limit) {
            return true;
        }
        let since = Instant::now();
        while self.started() < n {
            if since.elapsed() >= unstarted || !self.may_start(n) {
                return false;
            }
            wait_turn(since);
        }
        self.wait_for(n, limit)
    }

    /// Whether fence `n` may still start, or has: the fence thread exists,
    /// and no failure, nor a capture while it has not started, holds it
    /// back.
    fn may_start(&self, n: u64) -> bool {
        let st = lock(&self.helper.shared.state);
        let held_back = st.s.captures > 0 && self.started() < n;
        st.spawned && !st.shutdown && !held_back && st.s.failed < n
    }

    /// On a helper thread: whether the GPU is busy, judged once the fence
    /// asked for by now has ended (not busy) or has been confirmed busy
    /// ([`Fencer::busy_confirmed`]), waiting (yielding) at most
    /// [`FENCE_BUSY_SURE`], when a fence that long counts as busy anyway.
    /// A growth decided while a fence has only just started, or while the
    /// fence thread waits for a CPU on a loaded host, would read an idle GPU
    /// where the GPU is turning busy, and put the helper's first busy growth
    /// off to a later hand-out. During a capture no fence runs: no wait.
    pub(crate) fn busy_judged(&self) -> bool {
        let n = self.ext().requested.load(Ordering::SeqCst);
        let since = Instant::now();
        let capturing = self.capturing();
        while self.done() < n && !capturing && since.elapsed() < FENCE_BUSY_SURE {
            if self.busy_confirmed() {
                return true;
            }
            wait_turn(since);
        }
        self.busy_confirmed()
    }

    /// Whether the pool comes back from a rest: the fence thread sleeps (no
    /// request for [`FENCE_IDLE_POLL`]) and this caller is the first to
    /// see it since. A load of a line only the thread's sleep and wake
    /// write, then one swap per rest. The caller asks for a fence at once
    /// ([`Fencer::request`] wakes the thread): whether the GPU turned busy
    /// meanwhile is then known a wake-up earlier than at the first seal,
    /// and the growth helper, woken beside it, judges it without waiting
    /// for a second wake-up (about 60 µs each on an H200's host).
    #[inline]
    pub(crate) fn take_rest(&self) -> bool {
        let r = &self.ext().resting;
        r.load(Ordering::Relaxed) && r.swap(false, Ordering::AcqRel)
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
                    // The fence thread sets `sleeping` and then looks at
                    // `requested` again before it sleeps: one of the two
                    // sees the other's store.
                    if ext.sleeping.load(Ordering::SeqCst) {
                        let st = self.helper.lock();
                        drop(st);
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

    /// A stream capture begins on the device: from now until the matching
    /// [`Fencer::end_capture`], no fence starts, and a fence already
    /// running is waited for first, so that no `cuCtxSynchronize` runs while
    /// the capture does. Freed blocks wait, sealed, for the fence after it.
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
        let ext = self.ext();
        if st.s.captures == 0
            && ext.requested.load(Ordering::SeqCst) != ext.started.load(Ordering::SeqCst)
        {
            self.helper.shared.work.notify_one();
        }
    }

    /// Whether a capture is under way (no fence can run now).
    pub(crate) fn capturing(&self) -> bool {
        self.helper.lock().s.captures > 0
    }

    /// Wait until fence `n` is done. `false` if it failed or cannot happen
    /// (no helper, shut down, or a capture under way). Only out-of-memory
    /// paths wait.
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

/// How long the fence thread spins for a new request after a fence, before
/// it polls with timed waits ([`FENCE_POLL`]).
const FENCE_SPIN: Duration = Duration::from_micros(100);

/// For this long after a fence that someone asked for, the fence thread
/// (with a spare CPU) asks for the next one itself as each starts: fences
/// run back to back, and a free that seals finds a fence asked for that
/// has not started, which covers it, and takes its number without a write
/// to the lines the fence thread reads. An idle GPU's fence takes about
/// 0.3 µs on an H200, and a request that wrote `requested` cost the
/// allocating thread the cache line's trips to the fence thread's core and
/// back. Past the window the fence thread waits for a request again.
const FENCE_HOT: Duration = Duration::from_micros(100);

/// Spin (yielding the CPU now and then, so that one CPU still runs the
/// threads that allocate) until a number past `started` is asked for, or
/// for [`FENCE_SPIN`] after `since`.
fn spin_for_request(ext: &FenceExt, started: u64, since: Instant) {
    let mut n = 0u32;
    while ext.requested.load(Ordering::Relaxed) == started && since.elapsed() < FENCE_SPIN {
        n = n.wrapping_add(1);
        if n % 64 == 0 {
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
    // The number the fence thread asked for itself last, and until when it
    // goes on asking (see `FENCE_HOT`).
    let (mut own_ask, mut hot_until) = (0u64, None::<Instant>);
    let mut st = lock(&sh.state);
    loop {
        // Wait for a request: poll for a while (a request then needs no
        // wake-up), then sleep until a request wakes this thread.
        let idle = Instant::now();
        let asked = |ext: &FenceExt| {
            ext.requested.load(Ordering::SeqCst) != ext.started.load(Ordering::SeqCst)
        };
        if spare_cpus && !asked(&sh.ext) && st.s.captures == 0 && !st.shutdown {
            // First spin, without the lock, on the newest number asked for:
            // a loop that allocates and frees fast asks again within
            // microseconds, and a fence that answers at once keeps the
            // pool within its budget without a miss waiting for it.
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
                    // A rest: no request for the whole poll, and no
                    // capture holding the fences back (an allocation's
                    // fence could not run then). A thread that sleeps at
                    // once (one CPU) tells nothing of a rest.
                    let rest = st.s.captures == 0 && idle.elapsed() >= FENCE_IDLE_POLL;
                    sh.ext.resting.store(rest, Ordering::Release);
                    st = sh.sleep(st);
                    sh.ext.resting.store(false, Ordering::Relaxed);
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
            // Someone asked for this one.
            hot_until = Some(now + FENCE_HOT);
        }
        if spare_cpus && pace.is_zero() && hot_until.is_some_and(|t| now < t) {
            // Ask for the next fence now, after this one's start: frees
            // sealed from here on take its number. A request that raced
            // ahead of this one asked for it already.
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
        sh.ext.started_ns.store(now_ns(), Ordering::Release);
        // SAFETY: `context` is live: the pool's owner passes its retained
        // context with each request, and a reset or teardown (which ends
        // it) shuts this helper down or drains every batch first; a call
        // on a context gone since fails with an error, never touches memory.
        let r = unsafe { sh.ext.driver.synchronize(context) };
        sh.ext.started_ns.store(0, Ordering::Relaxed);
        st = lock(&sh.state);
        st.s.syncing = false;
        // The logger only queues the record (no GIL, no lock but its own),
        // and before the fence reads as done: a caller that waited for it
        // (`flush_pool`) then delivers its record before it returns.
        // Fences run back to back (`FENCE_HOT`) are not logged one by one:
        // only those someone asked for or waits for, and long ones.
        let logged = started.filter(|t| asked_for || st.s.waiters > 0 || t.elapsed() >= FENCE_BUSY);
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
            // The batches stay sealed (never handed out unfenced); a later
            // request retries and covers them.
            Err(_) => st.s.failed = st.s.failed.max(target),
        }
        if st.s.waiters > 0 {
            sh.done.notify_all();
        } else if !pace.is_zero() && !st.shutdown {
            // Rest, so that frees gather into the next fence; an
            // out-of-memory waiter cuts this short.
            st = wait_timeout(&sh.work, st, pace);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::{SimConfig, SimDriver};

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

    /// Past [`FENCE_BUSY_SURE`] a fence is a busy GPU, unless a driver
    /// call of the pool's own is under way: that call, not the GPU, may
    /// hold it up. Once the call has ended, the same fence is busy; and
    /// past [`FENCE_BUSY_CERTAIN`] it is busy though the call goes on (a
    /// free that waits for the busy GPU itself).
    #[test]
    fn a_long_fence_is_no_busy_gpu_while_the_pools_own_call_holds_it_up() {
        for call_ends in [true, false] {
            own_call_and_long_fence(call_ends);
        }
    }

    fn own_call_and_long_fence(call_ends: bool) {
        let sim = Arc::new(SimDriver::new(SimConfig::new(1, 1 << 20)));
        let ctx = sim.primary_context_retain(0).unwrap();
        let f = Arc::new(Fencer::new(sim.clone(), Duration::ZERO));
        assert!(f.wait(f.request(ctx)), "the fence thread runs");
        // SAFETY: a live context of this simulator; freed below.
        let p = unsafe { sim.mem_alloc(ctx, 4096) }.unwrap();
        sim.queue_write(0x7e57_0001, p, &[1; 8]).unwrap();
        let n = f.request(ctx);
        // A fence runs now and cannot end (the thread's own next fence may
        // be the one that waits for the write, ahead of fence `n`).
        let deadline = Instant::now() + Duration::from_secs(5);
        while f.ext().started_ns.load(Ordering::Acquire) == 0 && Instant::now() < deadline {
            std::thread::yield_now();
        }
        let (end, ended) = std::sync::mpsc::channel::<()>();
        let caller = f.clone();
        let mut call = Some(std::thread::spawn(move || caller.own_call(|| ended.recv())));
        std::thread::sleep(FENCE_BUSY_SURE + Duration::from_millis(5));
        let held_up = f.busy_confirmed();
        if call_ends {
            end.send(()).unwrap();
            call.take().unwrap().join().unwrap().unwrap();
            std::thread::sleep(FENCE_BUSY * 2);
        } else {
            std::thread::sleep(FENCE_BUSY_CERTAIN);
        }
        let after = (f.busy_confirmed(), f.busy_confirmed());
        if let Some(call) = call {
            end.send(()).unwrap();
            call.join().unwrap().unwrap();
        }
        // The queued work ends before any assertion, so that a failing one
        // leaves no fence thread spinning for ever.
        sim.complete(None);
        assert!(f.wait(n));
        assert!(
            !held_up,
            "the pool's own call holds the fence up, not the GPU"
        );
        assert_eq!(
            after,
            (true, true),
            "busy once it has ended (or has run {FENCE_BUSY_CERTAIN:?}), until the fence ends; the call ends: {call_ends}"
        );
        // SAFETY: allocated above, its queued write done.
        unsafe { sim.mem_free(ctx, p) }.unwrap();
    }
}
