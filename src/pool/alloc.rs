//! The miss ladder: [`Pool::alloc`], top to bottom in one function, and
//! its rungs (see the module documentation of `pool`).

use std::sync::MutexGuard;
use std::time::Instant;

use super::arena::{round, Arena, Kind, Slot, Tag, ANY};
use super::segments::{self, Grant};
use super::{Pool, FENCE_WAIT_MAX};
use crate::driver::{DevicePtr, RawContext, RawStream};
use crate::error::Result;
use crate::stats::Client;

/// The most fences an allocation out of memory waits for (rung 6), while
/// other threads free blocks behind each: the first and one retry, as
/// PyTorch's allocator retries once after it frees its cache (the device's
/// ladder above trims and asks again, so each round multiplies there).
const OOM_FENCE_ROUNDS: usize = 2;

/// How long it waits each round for growths to reach their arenas (see
/// [`Landing`](super::segments::Landing)): ten times the slowest driver
/// allocation measured (490 µs on a busy H100 just after a kernel started),
/// so a growth under way lands, yet out of memory still answers at once.
pub(super) const TRANSIT_WAIT: std::time::Duration = std::time::Duration::from_millis(5);

/// One request on its way down the miss ladder ([`Pool::alloc`]).
struct Ask<V> {
    /// The arena it goes to first (its stream's, or its thread's).
    home: usize,
    /// Its stream, or [`ANY`].
    tag: Tag,
    /// Its size rounded ([`round`]), and as asked.
    want: usize,
    size: usize,
    client: Client,
    /// Whether its context is still the device's (see [`Pool::alloc`]).
    valid: V,
}

impl<V: Fn() -> bool> Ask<V> {
    /// The best fit for it on `tag` in arena `i` (locked as `a`), handed
    /// out, if its context is still valid.
    #[inline]
    fn take(&self, a: &mut Arena, i: usize, tag: Tag) -> Option<Grant> {
        if !(self.valid)() {
            return None;
        }
        let got = a.take_slot(tag, self.want)?;
        Some(self.grant(a, i, got))
    }

    /// Its claim at `p` in arena `i` (locked as `a`), fence waited for or
    /// not: handed out, or put back. Neither after a reset, which forgot
    /// the claim (a block at `p` now is the new context's).
    fn take_claim(
        &self,
        a: &mut Arena,
        i: usize,
        (p, got): (DevicePtr, usize),
        fenced: bool,
    ) -> Option<Grant> {
        if !(self.valid)() {
            return None;
        }
        match fenced.then(|| a.take_claimed(p)).flatten() {
            Some(s) => Some(self.grant(a, i, (p, got, s))),
            None => {
                a.unclaim(p);
                None
            }
        }
    }

    /// Large and without a stream: it waits for a fence (rungs 1 and 3).
    #[inline]
    fn large_fenced(&self) -> bool {
        self.tag == ANY && Kind::of(self.want) == Kind::Large
    }

    /// Hand out `got` (address, size, slot) of arena `i`, counted as a hit.
    #[inline]
    fn grant(&self, a: &mut Arena, i: usize, got: (DevicePtr, usize, Slot)) -> Grant {
        a.handed_out(self.size, self.client, true);
        Grant::new(got, i, None, false)
    }
}

impl Pool {
    /// A block of at least `size` bytes for an owner on `stream` (`None`: no
    /// stream) in `context`: rungs 1 to 6 of the module's ladder; past them,
    /// out of memory is the caller's (give free segments back, ask again).
    /// `valid` (no reset of `context` since) is asked under the arena lock,
    /// which a reset's [`Pool::forget`] takes too, before a block is handed
    /// out or a segment joins an arena: a reset comes either before (the
    /// request fails, a segment grown meanwhile goes with its context) or
    /// after (the block is the old context's, and goes with it).
    #[inline]
    pub(crate) fn alloc(
        &self,
        context: RawContext,
        size: usize,
        stream: Option<RawStream>,
        device: usize,
        client: Client,
        valid: impl Fn() -> bool + Copy,
    ) -> Result<Grant> {
        let ask = Ask {
            home: self.arena_for(stream),
            tag: stream.unwrap_or(ANY),
            want: round(size),
            size,
            client,
            valid,
        };
        // 1. The best fit in the caller's arena: one lock (two if a large
        // request waits for a better fit), no driver call; inline, the rest
        // out of line (a hit runs no more than it needs).
        match self.hit(context, &ask) {
            Some(g) => Ok(g),
            None => self.climb(context, ask, device),
        }
    }

    /// Rung 1 of [`Pool::alloc`]: the best fit in the asker's arena if its
    /// context is still valid (after [`Pool::wait_for_better_fit`] where it
    /// applies); a miss seals what waits there for a fence.
    #[inline]
    fn hit(&self, context: RawContext, ask: &Ask<impl Fn() -> bool>) -> Option<Grant> {
        let mut a = self.arena(ask.home);
        if !(ask.valid)() {
            return None;
        }
        // Before reading the fences done (a line the fence thread writes at
        // every fence), the quick list's newest block if it fits (one size).
        let newest = (ask.tag == ANY).then(|| a.quick_take_newest(ask.want));
        let got = match newest.flatten() {
            Some(s) => Some((a.blocks[s].at, ask.want, s)),
            None => {
                if a.has_sealed() {
                    a.promote(self.fencer.done());
                }
                if ask.large_fenced() && a.better_fit_waits(ask.want) {
                    a = self.wait_for_better_fit(context, a, ask)?;
                }
                a.take_slot(ask.tag, ask.want)
            }
        };
        if let Some(mut g) = got.map(|got| ask.grant(&mut a, ask.home, got)) {
            // Growth ahead only once the frees waiting for a fence match what
            // is free for anyone, or half a growth: an idle GPU's tight loop
            // then mostly skips the look at the fence thread's shared line.
            g.ahead = ask.tag == ANY
                && a.waiting_bytes() >= a.free_any_bytes().min(self.config.ahead_bytes / 2)
                && self.wants_ahead(&mut a, |a| self.busy_look(a));
            return Some(g);
        }
        self.seal_pending(context, &mut a);
        None
    }

    /// Rung 1 for a large request without a stream whose best fit is larger
    /// than it while large blocks wait: wait for their fence as rung 3 does
    /// (not past a busy GPU's reading or [`FENCE_WAIT_MAX`], nor in a capture)
    /// and take the block it fits, not a cut of a larger one (the cuts left
    /// trace (b) at 1.90-2.04x its live bytes; 1.79x so, as PyTorch's). `a` is
    /// unlocked as it waits; `None` if the asker's context was reset meanwhile.
    #[inline(never)]
    fn wait_for_better_fit<'p>(
        &'p self,
        context: RawContext,
        mut a: MutexGuard<'p, Arena>,
        ask: &Ask<impl Fn() -> bool>,
    ) -> Option<MutexGuard<'p, Arena>> {
        self.seal_pending(context, &mut a);
        let newest = a.newest_sealed();
        if newest == 0 || self.fencer.capturing() {
            return Some(a);
        }
        drop(a);
        self.wait_fence(newest, FENCE_WAIT_MAX);
        let mut a = self.arena(ask.home);
        if !(ask.valid)() {
            return None;
        }
        a.promote(self.fencer.done());
        Some(a)
    }

    /// Seal what waits in arena `a` for a fence, if anything does.
    #[inline]
    fn seal_pending(&self, context: RawContext, a: &mut Arena) {
        if a.pending_count() > 0 {
            a.seal(self.fencer.request(context));
        }
    }

    /// Wait (at most `limit`) for fence `n` unless a busy GPU's; whether done.
    fn wait_fence(&self, n: u64, limit: std::time::Duration) -> bool {
        let cost = self.segments.grow_cost();
        crate::sync::blocking(|| self.fencer.wait_unless_busy(n, cost, limit))
    }

    /// Rungs 2 to 6 of [`Pool::alloc`], after a miss in the asker's arena
    /// (or a reset of its context), top to bottom.
    #[inline(never)]
    fn climb(
        &self,
        context: RawContext,
        ask: Ask<impl Fn() -> bool + Copy>,
        device: usize,
    ) -> Result<Grant> {
        let (size, client, valid) = (ask.size, ask.client, ask.valid);
        let reset = || {
            crate::error::Error::InvalidPointer(format!(
                "the context of device {device} was reset; memory comes from the new one"
            ))
        };
        if !valid() {
            return Err(reset());
        }
        // 2. Memory anyone may use, in another arena.
        if ask.tag == ANY {
            if let Some(g) = self.take_elsewhere(context, &ask) {
                return Ok(g);
            }
        }
        // 3. A fence that ends sooner than a growth would: wait, and reuse.
        if let Some(g) = self.wait_fence_and_take(context, &ask) {
            return Ok(g);
        }
        // 4. The helper is growing this arena: the driver makes one
        // allocation at a time, so wait for it rather than queue behind it.
        if crate::sync::blocking(|| self.wait_ahead(ask.home)) {
            if let Some(g) = ask.take(&mut self.arena(ask.home), ask.home, ask.tag) {
                return Ok(g);
            }
        }
        // 5. Grow by a segment, on a busy GPU by what the arena uses
        // ([`Pool::busy_growth`]): its fenced frees come back only later.
        let busy = ask.tag == ANY && self.gpu_busy();
        let fit = segments::segment_size(ask.want);
        let used = busy.then(|| self.busy_growth(&self.arena(ask.home)));
        let first = fit.max(used.unwrap_or(0));
        let kind = Kind::of(ask.want);
        let mut grown = self.grow(context, ask.home, first, kind);
        // A device too full for a whole segment may still fit less.
        let mut tried = first;
        for smaller in [fit, ask.want] {
            if smaller < tried && grown.as_ref().is_err_and(|e| e.is_oom()) {
                tried = smaller;
                grown = self.grow(context, ask.home, smaller, kind);
            }
        }
        match grown {
            Ok(new) => {
                if ask.tag == ANY && self.config.ahead_bytes > 0 {
                    // Memory freed without a stream may need growth ahead
                    // later: its helper starts now, on a miss.
                    self.grower.prestart();
                }
                let mut a = self.arena(ask.home);
                if !valid() {
                    // Its context (and so the segment) went meanwhile.
                    drop(a);
                    self.forget_segment(new.base);
                    return Err(reset());
                }
                a.add_segment(new.base, new.bytes, new.kind);
                let Some(got) = a.take_slot(ask.tag, ask.want) else {
                    // Unreachable (the new segment fits), but deleter-safe.
                    return Err(crate::error::Error::InvalidArgument(
                        "a new segment did not fit its request".into(),
                    ));
                };
                a.handed_out(size, client, false);
                let ahead = busy && self.wants_ahead(&mut a, |_| true);
                Ok(Grant::new(got, ask.home, Some(*new), ahead))
            }
            // 6. Out of memory: every free block, after a fence.
            Err(e) if e.is_oom() => self
                .fence_all_and_take(context, &ask)
                .ok_or_else(|| e.oom_on(device, size)),
            Err(e) => Err(e.oom_on(device, size)),
        }
    }

    /// Rung 2: a free block anyone may use from another arena, which keeps
    /// it (it goes back there); arenas busy now are skipped, not waited for.
    fn take_elsewhere(&self, context: RawContext, ask: &Ask<impl Fn() -> bool>) -> Option<Grant> {
        let n = self.arenas.len();
        let done = self.fencer.done();
        (1..n).find_map(|d| {
            let i = (ask.home + d) & (n - 1);
            let mut a = self.arenas[i].0.try_lock().ok()?;
            a.promote(done);
            let found = ask.take(&mut a, i, ANY);
            if found.is_none() && !a.has_sealed() && a.pending_count() > 0 {
                // Its own thread may never free again: start its fence.
                a.seal(self.fencer.request(context));
            }
            found
        })
    }

    /// Rung 3: if the asker's arena has blocks sealed for a fence, and the
    /// request is large without a stream or the pool past its budget, wait for
    /// the fence unless a busy GPU's, then take the best fit. If the arena's
    /// other threads, churning it meanwhile, took all it freed, claim a waiting
    /// block of at most twice the request, as rung 6 does, and wait for its
    /// fence within the same limit: a host whose fence thread waits for a CPU
    /// then grows the pool no more than its threads hold, not at each wait.
    fn wait_fence_and_take(
        &self,
        context: RawContext,
        ask: &Ask<impl Fn() -> bool>,
    ) -> Option<Grant> {
        let newest = self.arena(ask.home).newest_sealed();
        if newest == 0 || self.fencer.capturing() {
            return None;
        }
        // Within the budget, a small request grows at once, and so does a
        // stream's (as its library's own pool would).
        if !ask.large_fenced() && self.budget_room(ask.size) > 0 {
            return None;
        }
        let since = Instant::now();
        if !self.wait_fence(newest, FENCE_WAIT_MAX) {
            return None;
        }
        let (p, got, seq) = {
            let mut a = self.arena(ask.home);
            a.promote(self.fencer.done());
            if let Some(g) = ask.take(&mut a, ask.home, ask.tag) {
                return Some(g);
            }
            if !(ask.valid)() {
                return None;
            }
            self.seal_pending(context, &mut a);
            a.claim_waiting(ask.want, ask.want.saturating_mul(2))?
        };
        let fenced = self.wait_fence(seq, FENCE_WAIT_MAX.saturating_sub(since.elapsed()));
        ask.take_claim(&mut self.arena(ask.home), ask.home, (p, got), fenced)
    }

    /// Rung 6, out of memory: every free block of every arena, on any
    /// stream, waits for one fence with what was freed without a stream;
    /// wait for it (a host-side wait, on this rung alone; none during a
    /// capture), then take the best fit, the asker's arena first.
    fn fence_all_and_take(
        &self,
        context: RawContext,
        ask: &Ask<impl Fn() -> bool>,
    ) -> Option<Grant> {
        // Other threads may take what a fence frees and free more behind it
        // (for the next fence), or hold memory the driver gave them that
        // their arena does not show yet: another round while either is so.
        for _ in 0..OOM_FENCE_ROUNDS {
            if let Some(g) = self.fence_once_and_take(context, ask) {
                return Some(g);
            }
            if self.fencer.capturing() || !(ask.valid)() {
                break;
            }
            let growing = self.segments.wait_in_transit();
            let waiting = (0..self.arenas.len()).any(|i| self.arena(i).waiting_bytes() > 0);
            if !waiting && !growing {
                break;
            }
        }
        None
    }

    /// One round of [`Pool::fence_all_and_take`]: a waiting block that fits is
    /// claimed before the wait (so threads churning the cache cannot take it)
    /// and handed out once its fence is done; else any block free after it.
    fn fence_once_and_take(
        &self,
        context: RawContext,
        ask: &Ask<impl Fn() -> bool>,
    ) -> Option<Grant> {
        let n = self.arenas.len();
        let mut claimed = None;
        let fenced = crate::sync::blocking(|| {
            self.fence_everything(context, |i, a| {
                // Only while the context is valid: after a reset the arena
                // holds a new context's blocks.
                if claimed.is_none() && (ask.valid)() {
                    claimed = a
                        .claim_waiting(ask.want, usize::MAX)
                        .map(|(p, got, _)| (i, p, got));
                }
            })
        });
        if let Some((i, p, got)) = claimed {
            if let Some(g) = ask.take_claim(&mut self.arena(i), i, (p, got), fenced) {
                return Some(g);
            }
        }
        let done = self.fencer.done();
        (0..n).find_map(|d| {
            let i = (ask.home + d) & (n - 1);
            let mut a = self.arena(i);
            a.promote(done);
            ask.take(&mut a, i, ask.tag)
        })
    }

    /// Seal every arena's waiting blocks and its blocks free on a stream
    /// ([`Arena::wait_all_tagged`]), calling `also` with each arena locked
    /// once sealed, and the host cache's; wait for the fence covering them
    /// all. Whether it ran (not during a capture, nor if it failed). Each
    /// arena asks for its fence under its lock, after every free it seals.
    pub(super) fn fence_everything(
        &self,
        context: RawContext,
        mut also: impl FnMut(usize, &mut Arena),
    ) -> bool {
        if self.fencer.capturing() {
            return false;
        }
        let mut newest = 0;
        for i in 0..self.arenas.len() {
            let mut a = self.arena(i);
            a.wait_all_tagged();
            self.seal_pending(context, &mut a);
            newest = newest.max(a.newest_sealed());
            also(i, &mut a);
        }
        newest = newest.max(self.host_settle_seal(context));
        newest == 0 || self.fencer.wait(newest)
    }
}
