//! The pool's rung of the out-of-memory ladder: when the driver refuses,
//! seal every shard, wait for the fence, and take a cached block. The next
//! rung, returning the cache to the driver and asking again, is the
//! device's ([`DeviceState`](crate::device::DeviceState)), which keeps the
//! registry entries. [`Pool::seal_all_and_wait`] covers the host cache too.

use super::Pool;
use crate::driver::{DevicePtr, RawContext};

impl Pool {
    /// Seal every shard (stream-held blocks too) and wait for the fence that
    /// covers them all; `false` if it failed. Then make ready what it covers.
    pub(super) fn seal_all_and_wait(&self, context: RawContext) -> bool {
        let mut newest = self.seal_every_shard(context, true);
        // The host cache's blocks wait for the same fence.
        self.host.each(|sh| {
            sh.seal(&self.fencer, context, false);
            newest = newest.max(sh.sealed.back().map_or(0, |b| b.seq));
        });
        let ok = newest == 0 || self.fencer.wait(newest);
        let done = self.promote_every_shard();
        self.host.each(|sh| {
            sh.promote(done);
        });
        ok
    }

    /// Seal every shard's unordered frees (and, with `streams`, its
    /// stream-held blocks); the number of the newest fence a shard's
    /// batches wait for (0: none waits).
    pub(super) fn seal_every_shard(&self, context: RawContext, streams: bool) -> u64 {
        let mut newest = 0;
        for i in 0..self.shards.len() {
            let mut sh = self.shard(i);
            sh.seal(&self.fencer, context, streams);
            newest = newest.max(sh.sealed.back().map_or(0, |b| b.seq));
        }
        newest
    }

    /// Make ready, in every shard, the batches whose fence is done; the
    /// number of the last finished fence.
    pub(super) fn promote_every_shard(&self) -> u64 {
        let done = self.fencer.done();
        for i in 0..self.shards.len() {
            self.shard(i).promote(done);
        }
        done
    }

    /// Out of memory: a cached block of `class` from any shard, waiting for
    /// its fence if it needs one. Every shard is sealed (stream-held blocks
    /// too); a ready block is taken at once, else one block of `class` is
    /// taken out of a sealed batch *before* the wait, so that threads
    /// churning the cache meanwhile cannot take it back (they could take
    /// every block the fence makes ready before this thread looks again).
    /// `None` if no block of `class` is cached, or its fence failed.
    pub(super) fn fence_all_and_take(
        &self,
        context: RawContext,
        own: usize,
        class: usize,
    ) -> Option<DevicePtr> {
        let n = self.shards.len();
        let done = self.fencer.done();
        // One pass, each shard under one lock: a ready block is taken at
        // once; else the first block that waits is claimed (held by no shard
        // from then on, so it is handed out or put back, never lost).
        let mut claimed: Option<(usize, DevicePtr, u64)> = None;
        for d in 0..n {
            let i = (own + d) % n;
            let mut sh = self.shard(i);
            sh.seal(&self.fencer, context, true);
            sh.promote(done);
            if let Some(p) = sh.take_ready(class) {
                drop(sh);
                if let Some((j, q, _)) = claimed {
                    self.wait_again(context, j, q, class);
                }
                return Some(p);
            }
            if claimed.is_none() {
                claimed = sh.claim_sealed(class).map(|(p, seq)| (i, p, seq));
            }
        }
        let (i, p, seq) = claimed?;
        if self.fencer.wait(seq) {
            return Some(p);
        }
        // The fence failed: the block waits for the next one, as before.
        self.wait_again(context, i, p, class);
        None
    }

    /// Put a claimed block back into shard `i`, waiting for the next fence.
    pub(super) fn wait_again(&self, context: RawContext, i: usize, p: DevicePtr, class: usize) {
        let mut sh = self.shard(i);
        sh.put_pending(p, class);
        sh.seal(&self.fencer, context, false);
    }
}
