//! Growth ahead of demand ([`ahead_bytes`](super::PoolConfig::ahead_bytes)):
//! while a busy GPU holds frees without a stream back, a helper thread
//! ([`Grower`]) grows an arena that churns them, so an allocation finds a block
//! rather than wait for the driver. The pool decides when and what; its owner
//! posts the job (it registers the segment and knows if its context is live).

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use super::arena::{Arena, Kind};
use super::helper::{Helper, Shared};
use super::segments::{Allocation, ROUND_LARGE, SMALL_SEGMENT};
use super::Pool;
use crate::driver::RawContext;
use crate::sync::{lock, wait_while};

/// A job for the pool's growth helper (see [`Pool::post_ahead`]).
pub(crate) type GrowJob = Box<dyn FnOnce() + Send>;

/// Growth ahead leaves at least this fraction (1/n) of the device's memory
/// free: it must never be why another allocation runs out of memory.
const AHEAD_HEADROOM: usize = 4;

/// After a hit's look found the GPU idle, the hits that skip the next
/// look ([`Pool::busy_look`]): one clock read in eight hits costs about 2%
/// of a hit, and a GPU that turns busy is seen at most seven hits late
/// (about a microsecond of a tight loop; a growth takes 40 to 500 µs).
pub(super) const IDLE_SKIPS: u32 = 7;

/// A miss waits at most this long for the helper's growth of its arena
/// (a `cuMemAlloc` on a busy H200 took up to 400 µs).
pub(super) const AHEAD_WAIT: Duration = Duration::from_millis(5);

/// The per-device helper that grows the pool ahead of demand: it runs the
/// jobs the pool's owner posts, one at a time, so no allocating thread
/// makes the driver's allocation (90-270 µs on a busy H200).
pub(super) struct Grower {
    pub(super) helper: Helper<GrowState, ()>,
    /// The arena the helper allocates for now: a miss there waits on `grown`
    /// ([`Pool::wait_ahead`]), not queue its own driver allocation behind it.
    pub(super) arena: Mutex<Option<usize>>,
    grown: Condvar,
    /// How long such a miss waits at most ([`AHEAD_WAIT`]; tests lengthen it).
    pub(super) wait: Duration,
}

#[derive(Default)]
pub(super) struct GrowState {
    jobs: VecDeque<GrowJob>,
    /// A job is running now.
    running: bool,
}

impl Grower {
    pub(super) fn new() -> Self {
        Grower {
            helper: Helper::new("gpuptr-grow", ()),
            arena: Mutex::new(None),
            grown: Condvar::new(),
            wait: AHEAD_WAIT,
        }
    }

    /// Wait (at most `limit`: a job is one driver allocation) until the
    /// helper has run every job posted so far; whether it had.
    pub(super) fn quiesce(&self, limit: Duration) -> bool {
        let sh = &self.helper.shared;
        wait_while(&sh.done, lock(&sh.state), limit, |st| {
            (st.s.running || !st.s.jobs.is_empty()) && !st.shutdown && !crate::fork::forked()
        })
    }

    /// Start the helper's thread if it is not running, so the first growth
    /// ahead does not pay for its start on the asking thread (50-130 µs on
    /// an H100 host, the busy GPU's slowest pair). Called on growths for
    /// memory without a stream (misses: a lock and a look once it runs).
    pub(super) fn prestart(&self) {
        let mut st = self.helper.lock();
        if !st.shutdown {
            self.helper.start(&mut st, grow_loop);
        }
    }

    pub(super) fn post(&self, job: GrowJob) {
        let mut st = self.helper.lock();
        if st.shutdown {
            return;
        }
        if !self.helper.start(&mut st, grow_loop) {
            // No thread: grow on this one (as a miss would).
            drop(st);
            job();
            return;
        }
        st.s.jobs.push_back(job);
        self.helper.wake(st);
    }

    /// Stop the helper after the job it runs (if any); queued jobs are
    /// dropped undone (outside the lock). Nobody waits for it.
    pub(super) fn shutdown(&self) {
        drop(self.helper.shutdown(|s| std::mem::take(&mut s.jobs)));
    }
}

impl Drop for Grower {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn grow_loop(sh: &Shared<GrowState, ()>) {
    let mut st = lock(&sh.state);
    loop {
        // Sleep until a post wakes it: posts are rare (one per growth), and
        // a polling helper would take CPU from the threads that allocate.
        while st.s.jobs.is_empty() && !st.shutdown {
            st = sh.sleep(st);
        }
        if st.shutdown || crate::fork::forked() {
            return;
        }
        let job = st.s.jobs.pop_front().expect("checked");
        st.s.running = true;
        drop(st);
        // A job never panics by design; if one did, the helper lives on
        // (no unwinding out of a thread others post to).
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        st = lock(&sh.state);
        st.s.running = false;
        if st.s.jobs.is_empty() {
            sh.done.notify_all();
        }
    }
}

impl Pool {
    /// After a hand-out without a stream from arena `a` (locked): whether to ask
    /// for growth ahead, once until served: while a busy GPU holds such frees back
    /// (`busy`, asked last) and `a` has less free for anyone than [`Pool::busy_growth`].
    #[inline]
    pub(super) fn wants_ahead(&self, a: &mut Arena, busy: impl FnOnce(&mut Arena) -> bool) -> bool {
        let wanted = !a.ahead_asked
            && self.config.ahead_bytes > 0
            && a.waiting_bytes() > 0
            && a.free_any_bytes() < self.busy_growth(a)
            && busy(a);
        a.ahead_asked |= wanted;
        wanted
    }

    /// [`Pool::gpu_busy`] for a hit in arena `a`: after a look that found
    /// the GPU idle, the next [`IDLE_SKIPS`] hits do not look. A look
    /// reads the clock (about 20 ns, a sixth of a hit's time) and the
    /// fence thread's start time (a cache line its core writes at every
    /// fence, which an idle GPU runs every few frees in a tight loop).
    #[inline]
    pub(super) fn busy_look(&self, a: &mut Arena) -> bool {
        if a.idle_skips > 0 {
            a.idle_skips -= 1;
            return false;
        }
        let busy = self.gpu_busy();
        a.idle_skips = if busy { 0 } else { IDLE_SKIPS };
        busy
    }

    /// Run `job`, the owner's call of [`Pool::grow_ahead`] for a grant that
    /// asked for it, on the pool's growth helper.
    pub(crate) fn post_ahead(&self, job: GrowJob) {
        self.grower.post(job);
    }

    /// On the helper: one segment of [`ahead_bytes`](super::PoolConfig::ahead_bytes)
    /// of `kind` for arena `arena`, recorded as held, handed to `register` (the
    /// owner registers it), then free for anyone there. `None` if a fence freed
    /// enough meanwhile, past [`ahead_total`](super::PoolConfig::ahead_total),
    /// if the device would keep under a quarter free, or if the driver refuses
    /// (misses then grow themselves). Either way the request is over. Called
    /// under the lock a reset of the context takes: it cannot go meanwhile.
    pub(crate) fn grow_ahead(
        &self,
        context: RawContext,
        arena: usize,
        kind: Kind,
        register: impl FnOnce(&Allocation),
    ) -> Option<Allocation> {
        let arena = arena & (self.arenas.len() - 1);
        let grown = self.ahead_segment(context, arena, kind);
        match &grown {
            Ok(a) => {
                register(a);
                self.arena(arena).add_segment(a.base, a.bytes, a.kind);
            }
            Err(why) => {
                log::debug!(target: "gpuptr::pool", "no growth ahead for arena {arena}: {why}")
            }
        }
        self.ahead_over(arena);
        grown.ok().map(|a| *a)
    }

    /// [`Pool::grow_ahead`]'s checks and allocation.
    fn ahead_segment(
        &self,
        context: RawContext,
        arena: usize,
        kind: Kind,
    ) -> Result<super::segments::Landing<'_>, &'static str> {
        let bytes = {
            let mut a = self.arena(arena);
            a.promote(self.fencer.done());
            let bytes = self.busy_growth(&a);
            if a.free_any_bytes() >= bytes {
                return Err("a fence made the stock up");
            }
            bytes
        };
        let free: usize = (0..self.arenas.len())
            .map(|i| self.arena(i).free_any_bytes())
            .sum();
        if free + bytes > self.config.ahead_total {
            return Err("the pool's free bytes would pass ahead_total");
        }
        // SAFETY: the owner passes its live context, kept retained across
        // this call (see `DeviceState::grow_ahead`).
        let (free, total) =
            unsafe { self.driver.mem_get_info(context) }.map_err(|_| "cuMemGetInfo failed")?;
        if free < bytes.saturating_add(total / AHEAD_HEADROOM) {
            return Err("the device would be left with less than a quarter free");
        }
        *lock(&self.grower.arena) = Some(arena);
        self.grow(context, arena, bytes, kind)
            .map_err(|_| "the driver or the pool limit refused")
    }

    /// What a busy GPU's growth (and growth ahead) adds to arena `a`: what
    /// it uses, handed out and waiting for a fence, in 2 MiB steps, from 2
    /// to [`ahead_bytes`](super::PoolConfig::ahead_bytes). Each doubles the
    /// arena (a busy spell's driver calls, 60-490 µs each, stay few), and a
    /// fence misread as busy costs what was used, not 64 MiB.
    pub(super) fn busy_growth(&self, a: &Arena) -> usize {
        let used = (a.live_bytes + a.waiting_bytes()).div_ceil(ROUND_LARGE) * ROUND_LARGE;
        used.clamp(SMALL_SEGMENT, self.config.ahead_bytes.max(SMALL_SEGMENT))
    }

    /// A request for growth ahead in `arena` is over: it may be asked
    /// again, and a miss waiting for it goes on.
    pub(crate) fn ahead_over(&self, arena: usize) {
        let arena = arena & (self.arenas.len() - 1);
        self.arena(arena).ahead_asked = false;
        lock(&self.grower.arena).take_if(|a| *a == arena);
        self.grower.grown.notify_all();
    }

    /// A miss in arena `home` while the helper allocates for it: wait for
    /// it (at most `ahead_wait`), not queue behind it; whether it waited.
    pub(super) fn wait_ahead(&self, home: usize) -> bool {
        let a = lock(&self.grower.arena);
        if *a != Some(home) || crate::fork::forked() {
            return false;
        }
        let started = std::time::Instant::now();
        let _ = wait_while(&self.grower.grown, a, self.grower.wait, |a| {
            *a == Some(home)
        });
        log::debug!(
            target: "gpuptr::pool",
            "a miss waited {} us for growth ahead",
            started.elapsed().as_micros()
        );
        true
    }
}
