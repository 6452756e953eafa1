//! Growth ahead of demand ([`PoolConfig::ahead_bytes`]): while frees wait
//! for a fence, a helper thread ([`Grower`]) grows the classes a shard
//! churns, so that an allocation on a busy GPU finds a block instead of
//! waiting for the driver. The pool decides when to ask and what to grow;
//! its owner posts the job (it registers the new blocks and knows whether
//! its context is still live).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::class::class_index;
use super::fence::now_ns;
use super::held::Allocation;
use super::held::Fit;
use super::helper::{Helper, Shared};
use super::shard::Shard;
use super::Pool;
use crate::driver::RawContext;
use crate::sync::{lock, wait_while};

/// A job for the pool's growth helper (see [`Pool::post_ahead`]).
pub(crate) type GrowJob = Box<dyn FnOnce() + Send>;

/// Hand-outs a shard lets pass before it asks for growth ahead again,
/// after the helper found a fence had made the stock up (see
/// `Shard::ahead_cooldown`).
pub(super) const AHEAD_COOLDOWN: u32 = 1024;

/// Growth ahead leaves at least this fraction (1/n) of the device's memory
/// free.
const AHEAD_HEADROOM: usize = 4;

/// How often a shard paused in growth ahead looks whether the GPU turned
/// busy: half of [`FENCE_BUSY`](super::fence::FENCE_BUSY), so that a turn
/// to busy ends the pause within a busy fence's first microseconds.
const BUSY_LOOK: Duration = Duration::from_micros(10);

/// A miss waits at most this long for the helper's growth of its class.
pub(super) const AHEAD_WAIT: Duration = Duration::from_millis(5);

/// The per-device helper that grows the pool ahead of demand
/// ([`PoolConfig::ahead_bytes`]): it runs the jobs the pool's owner posts,
/// one at a time, so the driver's allocation (90-270 µs on a busy H200) is
/// never made by the thread that allocates.
pub(super) struct Grower {
    helper: Helper<GrowState, ()>,
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
            helper: Helper::new("gpuptr-grow", GrowState::default(), ()),
        }
    }

    /// Wait until the helper has run every job posted so far (at most
    /// `limit`: a job is one driver allocation, so this never hangs);
    /// whether it had.
    pub(super) fn quiesce(&self, limit: Duration) -> bool {
        let sh = &self.helper.shared;
        wait_while(&sh.done, lock(&sh.state), limit, |st| {
            (st.s.running || !st.s.jobs.is_empty()) && !st.shutdown && !crate::fork::forked()
        })
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
    /// After a hand-out from the calling thread's shard (locked as `sh`):
    /// whether to ask for growth of the class at `index` (`class_index`)
    /// ahead of demand. It is asked when the shard's ready blocks of that
    /// class ran below the target while frees wait for a fence, once until
    /// served (the helper grows an idle GPU's pool only within its budget).
    /// A handful of loads and compares; no shared atomic (four threads paid
    /// 50 ns a pair when this also started fences early).
    #[inline]
    pub(super) fn ahead_wanted(&self, sh: &mut Shard, index: Option<usize>) -> bool {
        let Some(i) = index else {
            return false;
        };
        if sh.ready[i].len() >= self.ahead_blocks[i] as usize
            || sh.wanted & (1 << i) != 0
            // No free waits for a fence: a pool that only allocates (or is
            // served from a reservation) grows nothing ahead.
            || sh.pending_bytes + sh.sealed_bytes == 0
        {
            return false;
        }
        if sh.ahead_cooldown > 0 {
            // The pause ends early once the GPU turns busy: the stock an
            // idle GPU's budget allows then lasts only until the helper's
            // first growth.
            if sh.alloc_count % 4 != 0 || !self.busy_look(sh) {
                sh.ahead_cooldown -= 1;
                return false;
            }
            sh.ahead_cooldown = 0;
        }
        sh.wanted |= 1 << i;
        true
    }

    /// [`Pool::busy_unjudged`], asked at most once per [`BUSY_LOOK`] per
    /// shard (a clock read otherwise). The fence's start time is written by
    /// the fence thread at every fence, which an idle GPU runs every few
    /// frees in a tight loop: a hand-out that read it each time would fetch
    /// its cache line from the fence thread's core.
    #[inline]
    fn busy_look(&self, sh: &mut Shard) -> bool {
        let now = now_ns();
        if now.saturating_sub(sh.busy_look_ns) < BUSY_LOOK.as_nanos() as u64 {
            return false;
        }
        sh.busy_look_ns = now;
        self.busy_unjudged()
    }

    /// Whether the GPU reads as busy by a fence not yet judged idle by
    /// [`Fencer::busy_confirmed`](super::fence::Fencer::busy_confirmed) (a
    /// fence thread that was preempted reads as busy by its length alone;
    /// one verdict per fence keeps the shards from asking at every look).
    #[inline]
    fn busy_unjudged(&self) -> bool {
        let f = self.fencer.busy_fence();
        f != 0 && f != self.idle_verdict.load(Ordering::Relaxed)
    }

    /// Run `job` on the pool's growth helper: the owner's call of
    /// [`Pool::grow_ahead`] for a block whose [`Grant::ahead`] was set.
    pub(crate) fn post_ahead(&self, job: GrowJob) {
        self.grower.post(job);
    }

    /// On the helper: one driver allocation that brings shard `shard`'s
    /// ready blocks of `class` to the target, recorded as held, handed to
    /// `register` (the owner registers its blocks), then stocked ready in
    /// the shard, and the request is over. `None` (and the request is over
    /// too) when a fence made enough blocks ready meanwhile, when the
    /// pool's ready bytes would pass [`PoolConfig::ahead_total`], when the
    /// device would be left with less than a quarter of its memory free, or
    /// when the driver refuses (the pool limit): misses go to the driver
    /// themselves then, as without growth ahead, and the shard asks again
    /// only after [`AHEAD_COOLDOWN`] more hand-outs that would.
    ///
    /// The owner calls it under the lock that a reset of its context takes,
    /// so the context cannot go between the allocation and the stocking.
    pub(crate) fn grow_ahead(
        &self,
        context: RawContext,
        shard: usize,
        class: usize,
        register: impl FnOnce(&Allocation),
    ) -> Option<Allocation> {
        let shard = shard & (self.shards.len() - 1);
        let grown = self.ahead_allocation(context, shard, class);
        let Ok(a) = grown.inspect_err(|why| {
            log::debug!(target: "gpuptr::pool", "no growth ahead of class {class}: {why}");
        }) else {
            // Without a pause, a shard that stays short (past the budget, an
            // idle GPU's lagging fence) would ask at every hand-out, and each
            // ask costs the helper a look at every shard.
            self.shard(shard).ahead_cooldown = AHEAD_COOLDOWN;
            self.ahead_over(shard, class);
            return None;
        };
        register(&a);
        self.stock(shard, a);
        Some(a)
    }

    /// [`Pool::grow_ahead`]'s checks and allocation.
    fn ahead_allocation(
        &self,
        context: RawContext,
        shard: usize,
        class: usize,
    ) -> Result<Allocation, &'static str> {
        let i = class_index(class).ok_or("not a small class")?;
        let mut want = self.ahead_blocks[i] as usize;
        {
            let mut sh = self.shard(shard);
            sh.promote(self.fencer.done());
            // Not when a fence made the stock up meanwhile (an idle GPU).
            if sh.ready[i].len() >= want {
                return Err("a fence made the stock up");
            }
            // Nor when a trim emptied the shard since it asked.
            if sh.pending_bytes + sh.sealed_bytes + sh.ready_bytes == 0 {
                return Err("the shard holds no freed block");
            }
            want -= sh.ready[i].len();
        }
        // A GPU whose fence has not run long (idle, or turning busy just
        // now) gets growth within the pool's budget only: enough to carry
        // a turn to busy past the helper's first growth, and no more than
        // the pool may hold anyway. The budget is applied as the growth is
        // claimed, against misses that grow meanwhile.
        let busy = self.fencer.busy_judged();
        let fence = self.fencer.busy_fence();
        if !busy {
            // This fence is judged: its length alone no longer ends a
            // shard's pause in growth ahead.
            self.idle_verdict.store(fence, Ordering::Relaxed);
        } else if log::log_enabled!(target: "gpuptr::pool", log::Level::Debug) {
            log::debug!(
                target: "gpuptr::pool",
                "growth ahead of class {class} for a busy GPU: the fence has run {} us",
                now_ns().saturating_sub(fence) / 1000
            );
        }
        // A busy GPU gets the whole target: its queued work holds every
        // free back for as long as it runs, and a growth made early keeps
        // the driver's busy `cuMemAlloc` (90-270 µs on an H200) off the
        // allocating thread.
        let bytes = want * class;
        let ready: usize = (0..self.shards.len())
            .map(|i| self.shard(i).ready_bytes)
            .sum();
        if ready + bytes > self.config.ahead_total {
            return Err("the pool's ready bytes would pass ahead_total");
        }
        // Leave room: growth ahead must never be why another allocation runs
        // out of memory (which would then wait for the busy GPU's fence).
        // One of the pool's own calls: a fence it holds up in the driver
        // must not read as a busy GPU.
        let (free, total) = self
            .fencer
            .own_call(|| {
                // SAFETY: the owner passes its live context, kept retained
                // across this call (see `DeviceState::grow_ahead`).
                unsafe { self.driver.mem_get_info(context) }
            })
            .map_err(|_| "cuMemGetInfo failed")?;
        if free < bytes.saturating_add(total / AHEAD_HEADROOM) {
            return Err("the device would be left with less than a quarter free");
        }
        let fit = if busy {
            Fit::Exact
        } else {
            Fit::Budget { least: 0 }
        };
        match self.claim(class, want, fit) {
            Ok(0) => return Err("past the pool's budget, and the GPU is not busy"),
            Ok(blocks) => want = blocks,
            Err(_) => return Err("the pool limit refused"),
        }
        *lock(&self.ahead) = Some((shard, class));
        let grown = self
            .allocate_claimed(context, class, want)
            .map_err(|_| "the driver refused")?;
        if busy {
            // Only a growth that happened has anything to give back.
            self.grew_past_budget();
        }
        Ok(grown)
    }

    /// Put the blocks of `a` in shard `shard`, ready for anyone (fresh
    /// memory), and end the request.
    pub(super) fn stock(&self, shard: usize, a: Allocation) {
        let shard = shard & (self.shards.len() - 1);
        {
            let mut sh = self.shard(shard);
            for p in a.block_addresses() {
                sh.put_ready(p, a.class);
            }
        }
        self.ahead_over(shard, a.class);
    }

    /// A request for growth of `class` ahead in `shard` is over: it may be
    /// asked again, and a miss waiting for it goes on.
    pub(crate) fn ahead_over(&self, shard: usize, class: usize) {
        let shard = shard & (self.shards.len() - 1);
        if let Some(i) = class_index(class) {
            self.shard(shard).wanted &= !(1 << i);
        }
        let mut a = lock(&self.ahead);
        if *a == Some((shard, class)) {
            *a = None;
        }
        drop(a);
        self.grown.notify_all();
    }

    /// A miss of `class` in shard `own` while the helper allocates that
    /// class for it: wait for the helper (at most `ahead_wait`) rather
    /// than make a second driver allocation behind it. Whether it waited.
    pub(super) fn wait_ahead(&self, own: usize, class: usize) -> bool {
        let a = lock(&self.ahead);
        if *a != Some((own, class)) || crate::fork::forked() {
            return false;
        }
        let started = std::time::Instant::now();
        let _ = wait_while(&self.grown, a, self.ahead_wait, |a| {
            *a == Some((own, class))
        });
        log::debug!(
            target: "gpuptr::pool",
            "a miss of class {class} waited {} us for growth ahead",
            started.elapsed().as_micros()
        );
        true
    }
}
