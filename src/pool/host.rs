//! The pool's cache of pinned host memory (`cuMemHostAlloc`): size classes, a
//! shard per flag combination (mapped, portable, write-combined), and the
//! device cache's fence: a freed block is *pending* until a `cuCtxSynchronize`
//! returns after the free (a copy queued before it may still use it), then
//! *ready*. Registered memory is never cached. Past
//! [`host_cache_bytes`](super::PoolConfig::host_cache_bytes) a free gives ready
//! blocks back, and the helper what was pending once its fence is done
//! ([`Pool::host_settle`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::class::{size_class, FastMap};
use super::Pool;
use crate::driver::{relaxed, DevicePtr, HostPtr, RawContext};
use crate::error::Result;
use crate::stats::HostStats;
use crate::sync::lock;

/// A host shard: ready blocks by size class, and blocks waiting for a
/// fence, pending and then sealed in batches.
#[derive(Default)]
pub(super) struct Shard {
    ready: FastMap<usize, Vec<DevicePtr>>,
    ready_bytes: usize,
    pending: Vec<(DevicePtr, usize)>,
    pending_bytes: usize,
    sealed: VecDeque<(u64, Vec<(DevicePtr, usize)>)>,
    sealed_bytes: usize,
    live_bytes: usize,
    live_count: usize,
    hits: u64,
    misses: u64,
}

impl Shard {
    fn take(&mut self, class: usize, done: u64) -> Option<DevicePtr> {
        self.promote(done);
        let p = self.ready.get_mut(&class)?.pop()?;
        self.ready_bytes -= class;
        Some(p)
    }

    fn put_ready(&mut self, p: DevicePtr, class: usize) {
        self.ready.entry(class).or_default().push(p);
        self.ready_bytes += class;
    }

    fn take_any_ready(&mut self) -> Option<(DevicePtr, usize)> {
        let (p, class) = self
            .ready
            .iter_mut()
            .find_map(|(&class, v)| v.pop().map(|p| (p, class)))?;
        self.ready_bytes -= class;
        Some((p, class))
    }

    fn put_pending(&mut self, p: DevicePtr, class: usize) {
        self.pending.push((p, class));
        self.pending_bytes += class;
    }

    pub(super) fn newest_sealed(&self) -> u64 {
        self.sealed.back().map_or(0, |b| b.0)
    }

    /// Seal the pending blocks for fence `seq` (asked for under this
    /// shard's lock, after every free in it).
    pub(super) fn seal(&mut self, seq: u64) {
        if self.pending.is_empty() {
            return;
        }
        let blocks = std::mem::take(&mut self.pending);
        self.sealed_bytes += std::mem::take(&mut self.pending_bytes);
        self.sealed.push_back((seq, blocks));
    }

    pub(super) fn promote(&mut self, done: u64) {
        while self.sealed.front().is_some_and(|b| b.0 <= done) {
            let (_, blocks) = self.sealed.pop_front().expect("checked");
            for (p, class) in blocks {
                self.sealed_bytes -= class;
                self.put_ready(p, class);
            }
        }
    }

    fn handed_out(&mut self, size: usize, hit: bool) {
        self.live_bytes += size;
        self.live_count += 1;
        self.hits += u64::from(hit);
        self.misses += u64::from(!hit);
    }

    /// Empty the cache into `out`: (block, class, whether its fence is done).
    fn drain(&mut self, out: &mut Vec<(DevicePtr, usize, bool)>) {
        for (class, v) in self.ready.drain() {
            out.extend(v.into_iter().map(|p| (p, class, true)));
        }
        let waiting = self
            .pending
            .drain(..)
            .chain(self.sealed.drain(..).flat_map(|b| b.1));
        out.extend(waiting.map(|(p, class)| (p, class, false)));
        (self.ready_bytes, self.pending_bytes, self.sealed_bytes) = (0, 0, 0);
    }
}

/// Flag combinations (`HOST_ALLOC_PORTABLE | DEVICEMAP | WRITECOMBINED`
/// are bits 0 to 2): one shard each.
const HOST_KINDS: usize = 8;

/// A pinned host block handed out by [`Pool::host_alloc`]: where it is, its
/// size class, and the `HOST_ALLOC_*` flags it was made with (its shard).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct HostBlock {
    pub address: HostPtr,
    pub class: usize,
    pub flags: u32,
}

/// The host cache of one device's pool.
pub(super) struct HostCache {
    shards: Box<[Mutex<Shard>]>,
    /// Bytes of pinned blocks held from the driver (handed out or cached).
    held: AtomicUsize,
    /// Bytes of cached blocks (ready or waiting for a fence).
    cached: AtomicUsize,
    /// The most `cached` may be ([`PoolConfig::host_cache_bytes`](super::PoolConfig::host_cache_bytes)).
    cap: usize,
    /// A settle (the cap enforced after a fence) is posted and has not
    /// started yet: later frees past the cap need not post another.
    settle_posted: AtomicBool,
}

impl HostCache {
    pub(super) fn new(cap: usize) -> Self {
        HostCache {
            shards: (0..HOST_KINDS).map(|_| Mutex::default()).collect(),
            held: AtomicUsize::new(0),
            cached: AtomicUsize::new(0),
            cap,
            settle_posted: AtomicBool::new(false),
        }
    }

    fn shard(&self, flags: u32) -> MutexGuard<'_, Shard> {
        lock(&self.shards[flags as usize & (HOST_KINDS - 1)])
    }

    /// Every shard, one after the other.
    pub(super) fn each(&self, mut f: impl FnMut(&mut Shard)) {
        for s in self.shards.iter() {
            f(&mut lock(s));
        }
    }
}

impl Pool {
    /// Whether a host allocation of `size` bytes comes from the cache (its
    /// class fits under the cap).
    pub(crate) fn host_caches(&self, size: usize) -> bool {
        size != 0 && size_class(size) <= self.host.cap
    }

    /// A pinned host block of at least `size` bytes made with `flags`
    /// (`HOST_ALLOC_*`): a ready cached block of its class and flags, else a
    /// new one from the driver; out of memory gives the ready cache back once
    /// and asks again. `still_valid` is asked under the shard lock, which a
    /// reset's [`Pool::forget`] takes too, before a block is handed out:
    /// `false` (a reset since the caller retained its context) is `Ok(None)`,
    /// nothing taken, counted or kept (a new block goes back to the driver),
    /// so a block handed out is counted in the caller's context's statistics.
    pub(crate) fn host_alloc(
        &self,
        context: RawContext,
        size: usize,
        flags: u32,
        still_valid: impl Fn() -> bool,
    ) -> Result<Option<HostBlock>> {
        let class = size_class(size);
        let block = |address| HostBlock {
            address,
            class,
            flags,
        };
        {
            let mut sh = self.host.shard(flags);
            if !still_valid() {
                return Ok(None);
            }
            if let Some(p) = sh.take(class, self.fencer.done()) {
                self.host.cached.fetch_sub(class, Ordering::Relaxed);
                sh.handed_out(size, true);
                return Ok(Some(block(p as HostPtr)));
            }
            // A miss: fence what this shard holds back, for later (no wait).
            self.host_seal(&mut sh, context);
        }
        let p = match self.host_new(context, class, flags) {
            Err(e) if e.is_oom() => {
                // Pinned memory is the host's: free the ready ones, ask again.
                let _ = self.host_shrink(context, 0);
                self.host_new(context, class, flags)?
            }
            r => r?,
        };
        {
            let mut sh = self.host.shard(flags);
            if still_valid() {
                // Counted held here, under the lock a reset's forget takes
                // after its new epoch: never after the forget zeroed it.
                self.host.held.fetch_add(class, Ordering::Relaxed);
                sh.handed_out(size, false);
                return Ok(Some(block(p)));
            }
        }
        // Reset while the driver pinned it: no cache's, never counted.
        // SAFETY: pinned just now in `context`, still retained by the
        // caller, and handed to no one.
        let _ = relaxed(self.driver.as_ref(), || unsafe {
            self.driver.host_free(context, p)
        });
        Ok(None)
    }

    /// Seal what `sh` holds back, for a fence asked for now (under its
    /// lock, after every free it seals).
    fn host_seal(&self, sh: &mut Shard, context: RawContext) {
        if !sh.pending.is_empty() {
            sh.seal(self.fencer.request(context));
        }
    }

    /// One `cuMemHostAlloc` of `class` bytes (the caller counts it held).
    fn host_new(&self, context: RawContext, class: usize, flags: u32) -> Result<HostPtr> {
        // Relaxed: a capture under way on another thread neither refuses
        // this allocation nor is invalidated by it.
        // SAFETY: the pool's owner passes its live, retained context.
        relaxed(self.driver.as_ref(), || unsafe {
            self.driver.host_alloc(context, class, flags)
        })
    }

    /// Take back `block`, handed out by [`Pool::host_alloc`] for `size`
    /// bytes: it waits for the next fence. A block of a context reset since
    /// (`still_valid`, asked under the shard lock a reset takes) is refused.
    /// No wait; a driver call only past the cap (ready blocks go back). `true`
    /// when still past it with no settle posted: the owner then posts one
    /// ([`Pool::host_settle_begin`] to [`Pool::host_settle`]), so the cap
    /// holds once the fence is done, with no later free needed.
    pub(crate) fn host_release(
        &self,
        context: RawContext,
        block: HostBlock,
        size: usize,
        still_valid: impl FnOnce() -> bool,
    ) -> bool {
        {
            let mut sh = self.host.shard(block.flags);
            if !still_valid() {
                return false;
            }
            // Saturating: no panic in a deleter.
            sh.live_bytes = sh.live_bytes.saturating_sub(size);
            sh.live_count = sh.live_count.saturating_sub(1);
            sh.put_pending(block.address as DevicePtr, block.class);
            self.host.cached.fetch_add(block.class, Ordering::Relaxed);
            if sh.pending.len() >= self.config.fence_count
                || sh.pending_bytes >= self.config.fence_bytes
            {
                self.host_seal(&mut sh, context);
            }
        }
        self.host_settle(context);
        self.host.cached.load(Ordering::Relaxed) > self.host.cap
            && !self.host.settle_posted.swap(true, Ordering::AcqRel)
    }

    /// A settle posted after [`Pool::host_release`] starts (live context or
    /// not): frees from now on post their own if they need one.
    pub(crate) fn host_settle_begin(&self) {
        self.host.settle_posted.store(false, Ordering::Release);
    }

    /// A settle's first step (while `context` is live): seal what every
    /// shard holds back; the number of the fence covering it (0: none).
    pub(crate) fn host_settle_seal(&self, context: RawContext) -> u64 {
        let mut newest = 0;
        self.host.each(|sh| {
            self.host_seal(sh, context);
            newest = newest.max(sh.newest_sealed());
        });
        newest
    }

    /// Wait for fence `n` (from [`Pool::host_settle_seal`]; no lock held);
    /// whether it is done (`false` during a capture or on a failed fence:
    /// the next free past the cap settles again).
    pub(crate) fn host_settle_wait(&self, n: u64) -> bool {
        n == 0 || self.fencer.wait(n)
    }

    /// The second half of a settle: give back the ready blocks past the
    /// cap (the owner calls it while `context` is live).
    pub(crate) fn host_settle(&self, context: RawContext) {
        if self.host.cached.load(Ordering::Relaxed) > self.host.cap {
            let _ = self.host_shrink(context, self.host.cap);
        }
    }

    /// Give ready blocks back until the cache holds at most `keep` bytes;
    /// the bytes freed, and the first driver error (that block stays).
    fn host_shrink(&self, context: RawContext, keep: usize) -> (usize, Result<()>) {
        let done = self.fencer.done();
        let (mut freed, mut first_err) = (0, Ok(()));
        for flags in 0..HOST_KINDS as u32 {
            while self.host.cached.load(Ordering::Relaxed) > keep {
                let mut sh = self.host.shard(flags);
                sh.promote(done);
                let Some((p, class)) = sh.take_any_ready() else {
                    break;
                };
                drop(sh);
                self.host.cached.fetch_sub(class, Ordering::Relaxed);
                match self.host_free(context, p, class) {
                    Ok(()) => freed += class,
                    Err(e) => {
                        self.host.shard(flags).put_ready(p, class);
                        self.host.cached.fetch_add(class, Ordering::Relaxed);
                        first_err = first_err.and(Err(e));
                        break;
                    }
                }
            }
        }
        (freed, first_err)
    }

    /// One `cuMemFreeHost` of a cached block, counted.
    fn host_free(&self, context: RawContext, p: DevicePtr, class: usize) -> Result<()> {
        // SAFETY: a block this pool made in `context`, cached (no owner),
        // so no one uses it after this.
        relaxed(self.driver.as_ref(), || unsafe {
            self.driver.host_free(context, p as HostPtr)
        })?;
        // Saturating: a reset's forget may have zeroed it meanwhile.
        let (held, r) = (&self.host.held, Ordering::Relaxed);
        let _ = held.fetch_update(r, r, |h| Some(h.saturating_sub(class)));
        Ok(())
    }

    /// Return the host cache to the driver; the bytes freed, and the first
    /// error (what failed stays). Unless `everything` (the context ends),
    /// waiting blocks are fenced first; during a capture they stay.
    pub(crate) fn host_trim(&self, context: RawContext, everything: bool) -> (usize, Result<()>) {
        if everything {
            // Every block, whatever its fence: the context and its memory go.
            let (mut freed, mut first_err) = (0, Ok(()));
            for flags in 0..HOST_KINDS as u32 {
                let mut cached = Vec::new();
                self.host.shard(flags).drain(&mut cached);
                for (p, class, fenced) in cached {
                    self.host.cached.fetch_sub(class, Ordering::Relaxed);
                    if let Err(e) = self.host_free(context, p, class) {
                        // Cached again in its own shard; the next trim retries.
                        let mut sh = self.host.shard(flags);
                        if fenced {
                            sh.put_ready(p, class);
                        } else {
                            sh.put_pending(p, class);
                            self.host_seal(&mut sh, context);
                        }
                        self.host.cached.fetch_add(class, Ordering::Relaxed);
                        first_err = first_err.and(Err(e));
                    } else {
                        freed += class;
                    }
                }
            }
            return (freed, first_err);
        }
        // `false` (a capture, a failed fence): what waits stays.
        let _ = self.host_settle_wait(self.host_settle_seal(context));
        self.host_shrink(context, 0)
    }

    /// Forget every cached host block without freeing it (the context was
    /// reset and its pinned memory is gone), and zero the live counts.
    pub(super) fn host_forget(&self) {
        self.host.each(|sh| {
            sh.drain(&mut Vec::new());
            (sh.live_bytes, sh.live_count) = (0, 0);
        });
        self.host.held.store(0, Ordering::Relaxed);
        self.host.cached.store(0, Ordering::Relaxed);
    }

    /// The host cache's statistics.
    pub(crate) fn host_stats(&self) -> HostStats {
        let done = self.fencer.done();
        let mut s = HostStats {
            held_bytes: self.host.held.load(Ordering::Relaxed),
            cache_limit: self.host.cap,
            ..HostStats::default()
        };
        self.host.each(|sh| {
            sh.promote(done);
            s.live_bytes += sh.live_bytes;
            s.live_count += sh.live_count;
            let waiting = sh.pending_bytes + sh.sealed_bytes;
            s.pending_bytes += waiting;
            s.cached_bytes += sh.ready_bytes + waiting;
            s.hits += sh.hits;
            s.misses += sh.misses;
        });
        s
    }
}
