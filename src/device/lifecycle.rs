//! The ends of a device's memory: a trim gives the cache back to the
//! driver, a reset turns every live allocation stale, and the last drop of
//! a context tears its pool down.

use std::sync::atomic::Ordering;

use super::{DeviceState, Handle};
use crate::driver::RawContext;
use crate::error::Result;
use crate::sync::lock;
use crate::track::Watch;

impl DeviceState {
    /// Return the pool's cache of the live context `ctx` to the driver, and
    /// with `host` its cache of pinned host memory (PyTorch's
    /// `empty_cache()` leaves pinned memory alone); the bytes freed.
    pub(crate) fn trim(&self, ctx: &impl Handle, host: bool) -> Result<usize> {
        let _recovering = lock(&self.recovery);
        self.trim_logged(ctx.raw(), Some(ctx), false, host)
    }

    /// [`DeviceState::trim`], with the recovery lock held; `everything`
    /// when the context is ending (see [`Pool::trim`]), and then no `live`
    /// context keeps what a failed free leaves.
    fn trim_logged(
        &self,
        raw: RawContext,
        live: Option<&dyn Handle>,
        everything: bool,
        host: bool,
    ) -> Result<usize> {
        let r = self.trim_locked(raw, live, everything);
        // The host cache too, when asked (not on the out-of-memory ladder:
        // pinned memory is the host's, not the device's).
        let pool = self.pool.as_ref().filter(|_| host);
        let r = match pool.map(|p| p.host_trim(raw, everything)) {
            Some((freed, host)) => r.and_then(|n| host.map(|()| n + freed)),
            None => r,
        };
        match &r {
            Ok(freed) => log::debug!(
                target: "gpuptr::pool",
                "device {}: trim returned {} bytes to the driver",
                self.device,
                freed
            ),
            Err(e) => log::warn!(
                target: "gpuptr::pool",
                "device {}: trim: a driver free failed ({e}); that memory stays cached",
                self.device
            ),
        }
        r
    }

    /// [`DeviceState::trim_logged`]'s device memory: what a failed free
    /// leaves cached is registered again for `live`, if given.
    pub(super) fn trim_locked(
        &self,
        raw: RawContext,
        live: Option<&dyn Handle>,
        everything: bool,
    ) -> Result<usize> {
        let Some(pool) = &self.pool else {
            return Ok(0);
        };
        let (freed, r) = pool.trim(
            raw,
            everything,
            // Before the free: the driver may hand the addresses to another
            // thread's allocation, registered anew, at once after it.
            |a| self.unregister([*a]),
            // A failed free leaves the allocation cached: known again (unless
            // the context is going away).
            |a| {
                if let Some(ctx) = live {
                    self.register(&ctx.owner(), a);
                }
            },
        );
        let bytes = freed.iter().map(|a| a.bytes).sum();
        r.map(|()| bytes)
    }

    /// Prepare for the live context `raw` being reset (numba's
    /// `cuda.close()`): the cache goes back to the driver, every live
    /// allocation turns stale, and the next use retains the primary context
    /// afresh (the runtime empties its slot after this). Never waits for
    /// the pool's fence thread.
    pub(crate) fn reset(&self, raw: RawContext) -> Result<()> {
        self.forget_raw(raw);
        // One recovery hold for the trim, the new epoch and the forget: the
        // pool's helper grows only under it, so it neither stocks blocks of
        // the old context nor records them after the forget.
        let recovering = lock(&self.recovery);
        let trimmed = self.trim_logged(raw, None, true, true);
        // The new epoch and the pool's forget in one step under the pool's
        // locks: no allocation straddles them (see `Pool::forget`). The
        // history: the live allocations go before their segments.
        let bump = || {
            self.invalidate();
            self.counters.forget_live();
        };
        let forget_live = || {
            let recording = self.services.watch.on(Watch::HISTORY);
            self.services.history.forget_device(self.device, recording);
            self.services.tracker.forget_device(self.device);
        };
        match &self.pool {
            Some(pool) => {
                let held = pool.forget(bump, forget_live);
                self.unregister(held);
            }
            None => {
                bump();
                forget_live();
            }
        }
        drop(recovering);
        // After the reset the old CUcontext is dead: the pool is no longer
        // its. Holders of the old context (stale pointers) release their
        // retain when they go.
        *lock(&self.live) = std::sync::Weak::<()>::new();
        log::info!(
            target: "gpuptr::context",
            "device {}: context reset; its live allocations are stale from now on",
            self.device
        );
        trimmed.map(|_| ())
    }

    /// At the last drop of a context born in epoch `born`: give the cache
    /// back before the retain that keeps it valid goes. A context of an
    /// older epoch (detached by a reset) no longer owns the pool while a
    /// newer one lives; if none does, the pool's memory (which a context
    /// kept across the reset may have grown) goes with this retain.
    pub(crate) fn teardown(&self, raw: RawContext, born: u64) {
        // Before the release: the handle may name another context after it.
        // Only while no newer context is live (under the lock its retain
        // takes): a primary context retained again may have the same handle.
        let newer = {
            let live = lock(&self.live);
            let newer = live.strong_count() > 0;
            if !newer {
                self.forget_raw(raw);
            }
            newer
        };
        if born == self.epoch() || !newer {
            let _recovering = lock(&self.recovery);
            let _ = self.trim_logged(raw, None, true, true);
        }
    }

    fn forget_raw(&self, raw: RawContext) {
        let _ = self
            .raw
            .compare_exchange(raw, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}
