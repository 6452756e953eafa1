//! The pool's budget on an idle GPU: it holds at most `max(live + live /
//! 2, headroom)` bytes ([`PoolConfig::headroom_bytes`]). Past it a miss
//! waits briefly for the fence of a freed block of its class and reuses it,
//! or else takes a ready block of a class at most 1.5x its own
//! ([`Pool::take_larger`]); if none can be had, it grows, and asks its
//! owner to *settle* the pool
//! on the helper thread: fence what waits, then give whole idle
//! allocations back to the driver until the pool is within its budget
//! again. A busy GPU (a fence running [`FENCE_BUSY`] or more) is exempt:
//! its queued work holds freed blocks back, so the pool grows. Such a
//! growth also marks the fence after it ([`Pool::grew_past_budget`]):
//! the first hand-out once that fence is done asks for a settle
//! ([`Pool::settle_due`]), so what a busy spell grew goes back once the GPU
//! is idle, though no miss follows.
//!
//! [`PoolConfig::headroom_bytes`]: super::PoolConfig::headroom_bytes
//! [`FENCE_BUSY`]: super::fence::FENCE_BUSY

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::Pool;
use crate::driver::{DevicePtr, RawContext};
use crate::sync::lock;

/// The longest a miss of an idle GPU past the pool's budget waits for the
/// fence of a freed block of its class (a fence of an idle GPU takes a few
/// microseconds; a longer one means work is queued, and the pool grows).
/// With a busy `cuMemAlloc` after it (40-60 µs on an H200), a miss that
/// meets a GPU turning busy stays under 100 µs.
pub(crate) const FENCE_WAIT: Duration = Duration::from_micros(20);

/// How much longer such a miss waits while its fence has not even started
/// (its thread waits for a CPU: a loaded host, not a busy GPU). On the
/// simulator with two CPUs and a third thread spinning beside them, misses
/// that grew after 20 µs held three 1 MiB blocks churned 2000 times in up to
/// 654 MiB.
pub(crate) const FENCE_START_WAIT: Duration = Duration::from_millis(1);

/// The most a miss past the budget takes of a larger class's ready block
/// ([`Pool::take_larger`]): the request's class and this fraction (1/n)
/// of it more. A request is at most 20% under its class already, so a
/// block used this way is more than half in use (at least 4/7: a request
/// just over 4 x 2^k bytes, class 5 x 2^k, in a block of 7 x 2^k).
const LARGER_FIT_DIV: usize = 2;

/// How long a settle waits for the fence of what waits, before it gives
/// back what is ready by then.
const SETTLE_WAIT: Duration = Duration::from_millis(1);

/// Settles in a row that may give nothing back while the pool stays past
/// its budget, each after the next fence, before no more is asked.
const FRUITLESS: u32 = 4;

impl Pool {
    /// What the pool may still grow by within its budget with `extra`
    /// bytes more counted live (a request's class), and the bytes that wait
    /// for a fence. The budget is `max(live + live / 2, headroom)`: the
    /// most an idle GPU's pool holds. A look at every shard: misses and
    /// the helper only.
    pub(super) fn room(&self, extra: usize) -> (usize, usize) {
        let (mut live, mut waiting) = (extra, 0);
        for i in 0..self.shards.len() {
            let sh = self.shard(i);
            live += sh.live_bytes;
            waiting += sh.pending_bytes + sh.sealed_bytes;
        }
        let held = {
            let h = lock(&self.held);
            h.bytes + h.pending
        };
        (self.budget(live).saturating_sub(held), waiting)
    }

    /// The bytes the pool holds past its budget (see [`Pool::room`]).
    pub(super) fn over_budget(&self) -> usize {
        let live: usize = (0..self.shards.len())
            .map(|i| self.shard(i).live_bytes)
            .sum();
        lock(&self.held).bytes.saturating_sub(self.budget(live))
    }

    /// The budget for `live` bytes handed out: `max(1.5 x live, headroom)`.
    fn budget(&self, live: usize) -> usize {
        live.saturating_add(live / 2)
            .max(self.config.headroom_bytes)
    }

    /// A miss past the budget on an idle GPU: a block of `class` that waits
    /// for a fence, claimed (out of every shard's reach) and handed out once
    /// its fence is done, if that takes at most [`FENCE_WAIT`]; else it is
    /// put back, waiting as before, and `None` (the pool grows).
    pub(super) fn wait_fence_and_take(
        &self,
        context: RawContext,
        own: usize,
        class: usize,
    ) -> Option<DevicePtr> {
        let n = self.shards.len();
        let done = self.fencer.done();
        let mut claimed = None;
        for d in 0..n {
            let i = (own + d) % n;
            let mut sh = self.shard(i);
            sh.promote(done);
            if let Some(p) = sh.take_ready(class) {
                return Some(p);
            }
            if let Some((p, seq)) = sh.claim_sealed(class) {
                claimed = Some((i, p, seq));
                break;
            }
        }
        let (i, p, seq) = claimed?;
        if self
            .fencer
            .wait_for_started(seq, FENCE_WAIT, FENCE_START_WAIT)
        {
            return Some(p);
        }
        self.wait_again(context, i, p, class);
        None
    }

    /// A miss past the budget on an idle GPU that found no block of its
    /// class: a ready block of a larger class, at most 1.5x its class of
    /// it, from any shard (its own first), with that class. A block that
    /// fits loosely costs nothing now, where a growth past the budget costs
    /// a `cuMemAlloc`, and the settle after it a `cuMemFree`: on a mixed
    /// trace, freed blocks of the classes just above a request are what the
    /// pool holds most of.
    pub(super) fn take_larger(&self, own: usize, class: usize) -> Option<(DevicePtr, usize)> {
        let max = class.saturating_add(class / LARGER_FIT_DIV);
        let n = self.shards.len();
        let done = self.fencer.done();
        (0..n).find_map(|d| {
            let mut sh = self.shard((own + d) % n);
            sh.promote(done);
            sh.take_ready_larger(class, max)
        })
    }

    /// Whether the owner should settle the pool now: no settle is asked
    /// for or under way, and the owner can give memory back (its hook is
    /// set). Claims the settle: the owner must call [`Pool::settle`].
    pub(super) fn want_settle(&self) -> bool {
        self.forget_hook.is_some() && !self.settling.swap(true, Ordering::AcqRel)
    }

    /// The first step of a settle, on the helper after a miss grew the
    /// pool past its budget (the owner calls it while `context` is live):
    /// seal every shard's unordered frees; the number of the fence that
    /// covers them (0: none).
    pub(crate) fn settle_seal(&self, context: RawContext) -> u64 {
        self.seal_every_shard(context, false)
    }

    /// Wait (no lock held, at most [`SETTLE_WAIT`]) for fence `n` and make
    /// ready what it covers.
    pub(crate) fn settle_wait(&self, n: u64) {
        if n > 0 && self.fencer.wait_for(n, SETTLE_WAIT) {
            self.promote_every_shard();
        }
    }

    /// The last step (the owner calls it while `context` is live): give
    /// idle allocations back until the pool is within its budget, those of
    /// `class` last.
    pub(crate) fn settle(&self, context: RawContext, class: usize) {
        let after_busy = self.after_busy.swap(false, Ordering::AcqRel);
        let freed = self.give_back(context, self.over_budget(), class);
        // Still past the budget: settle again after the next fence if the
        // GPU turned busy again (nothing goes back while it is), and, after
        // a busy spell, while settles give something back (blocks in use or
        // waiting for a fence kept the rest: they may be ready then) or for
        // a few that give nothing (a block in use keeps its allocation). An
        // idle GPU's settles ask for no more: each miss past the budget asks
        // for its own, and more of them, each waiting for a fence on the
        // helper, took the CPU its fence thread needed (on the simulator
        // with two CPUs, trace (a) then held up to 351 MiB).
        if freed > 0 {
            self.fruitless.store(0, Ordering::Relaxed);
        }
        if self.over_budget() == 0 {
            return;
        }
        // Cheapest first: `busy_confirmed` may watch the fence thread for a
        // while. A settle during a busy spell is not counted fruitless.
        let may_again =
            after_busy && (freed > 0 || self.fruitless.load(Ordering::Relaxed) < FRUITLESS);
        if (may_again && freed > 0) || self.fencer.busy_confirmed() {
            self.grew_past_budget();
        } else if may_again {
            self.fruitless.fetch_add(1, Ordering::Relaxed);
            self.grew_past_budget();
        }
    }

    /// The pool just grew for a busy GPU: once a fence that starts after
    /// now is done, and with it the work that held frees back, the pool
    /// settles.
    pub(super) fn grew_past_budget(&self) {
        self.grew_past
            .fetch_max(self.fencer.started() + 1, Ordering::AcqRel);
    }

    /// On a hand-out: whether to ask the owner for a settle now, because the
    /// pool grew for a busy GPU, and that work has since ended. A busy spell grows the pool far past its budget, and
    /// an idle GPU after it would keep all of that for as long as no miss
    /// asks for a settle, which a stock that big never needs. One load of a
    /// line written only by such growths while there is nothing to settle.
    #[inline]
    pub(super) fn settle_due(&self) -> bool {
        let grew = self.grew_past.load(Ordering::Relaxed);
        if grew == 0 || self.fencer.done() < grew || self.fencer.busy_fence() != 0 {
            // A settle waits for a fence on the growth helper: not while
            // the GPU looks busy, when the helper grows ahead.
            return false;
        }
        // Claimed here, or a settle is under way; either way this growth is
        // the settle's to give back (a growth since keeps its mark).
        let _ = self
            .grew_past
            .compare_exchange(grew, 0, Ordering::AcqRel, Ordering::Relaxed);
        let asked = self.want_settle();
        if asked {
            self.after_busy.store(true, Ordering::Release);
        }
        asked
    }

    /// The settle is over (done, or given up): a later miss may ask again.
    pub(crate) fn settle_over(&self) {
        self.settling.store(false, Ordering::Release);
    }
}
