//! The out-of-memory ladder above the pool, in one place (as PyTorch's
//! `malloc`): the pool's own rungs, then the cache back to the driver and
//! the pool asked again, then the typed error with what the pool holds and
//! the snapshot.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{DeviceState, Handle};
use crate::driver::RawStream;
use crate::error::{Error, Result};
use crate::pool::Grant;
use crate::stats::Client;
use crate::sync::lock;
use crate::track::Watch;

impl DeviceState {
    /// A pool block of `size` bytes for an owner on `stream`, up the
    /// out-of-memory ladder as far as it takes:
    /// 1. the cache, or the driver (the pool's fast path and growth);
    /// 2. the driver refused: the fence, then a cached block that it made
    ///    safe (the pool's rung, [`Pool::alloc`]);
    /// 3. still none: the cache goes back to the driver, and the pool asks
    ///    again, while that frees something (other threads may take what it
    ///    frees), at least once, one thread at a time;
    /// 4. then [`Error::OutOfMemory`].
    ///
    /// New driver allocations are registered, so their context resolves by
    /// address.
    pub(crate) fn pool_alloc(
        self: &Arc<Self>,
        ctx: &impl Handle,
        size: usize,
        stream: Option<RawStream>,
        client: Client,
        epoch: u64,
    ) -> Result<Grant> {
        let pool = self.pool.as_ref().expect("pooled device");
        // No reset since the caller read `epoch`: asked under the pool's
        // locks, which a reset takes too (see `Pool::alloc`).
        let valid = || self.epoch() == epoch;
        let block = match pool.alloc(ctx.raw(), size, stream, self.device, client, valid) {
            Ok(block) => block,
            Err(e) => self.pool_alloc_failed(ctx, size, stream, client, valid, e)?,
        };
        if block.ahead {
            let kind = crate::pool::Kind::of(block.class.min(size.max(1)));
            self.post_ahead(pool, ctx, usize::from(block.shard), kind);
        }
        if let Some(new) = block.new_allocation {
            let reg = self.register(&ctx.owner(), &new);
            if !valid() {
                // A reset between the hand-out and the registration: its
                // forget may have run before the registration was there.
                self.services.registry.remove(reg);
                return Err(Error::InvalidPointer(format!(
                    "the context of device {} was reset; memory comes from the new one",
                    self.device
                )));
            }
            log::debug!(
                target: "gpuptr::pool",
                "device {}: the pool grew by a segment of {} bytes for a {}-byte allocation",
                self.device,
                new.bytes,
                size
            );
        }
        Ok(block)
    }

    /// [`DeviceState::pool_alloc`] after the pool's own ladder failed with
    /// `e`: out of memory climbs on ([`DeviceState::recover`]), and what
    /// still fails is the typed error.
    #[cold]
    fn pool_alloc_failed(
        &self,
        ctx: &impl Handle,
        size: usize,
        stream: Option<RawStream>,
        client: Client,
        valid: impl Fn() -> bool + Copy,
        e: Error,
    ) -> Result<Grant> {
        let attempt = match e.is_oom() {
            // Trims wait for the GPU (`cuMemFree`), and for the recovery
            // lock another thread's trim holds.
            true => crate::sync::blocking(|| self.recover(ctx, size, stream, client, valid)),
            false => Err(e),
        };
        attempt.map_err(|e| match e.is_oom() {
            true => {
                self.counters.ooms.fetch_add(1, Ordering::Relaxed);
                self.out_of_memory(ctx, size)
            }
            false => e,
        })
    }

    /// Rungs 3 and 4 of [`DeviceState::pool_alloc`]: give the cache back
    /// to the driver and ask the pool again, while that frees something,
    /// at least once, one thread at a time.
    fn recover(
        &self,
        ctx: &impl Handle,
        size: usize,
        stream: Option<RawStream>,
        client: Client,
        valid: impl Fn() -> bool + Copy,
    ) -> Result<Grant> {
        let pool = self.pool.as_ref().expect("pooled device");
        self.counters.alloc_retries.fetch_add(1, Ordering::Relaxed);
        let _recovering = lock(&self.recovery);
        let (mut returned, mut rounds) = (0, 0);
        let mut attempt = Err(Error::OutOfMemory {
            device: self.device,
            requested: size,
            detail: String::new(),
        });
        for round in 0..4 {
            // What a failed free leaves is kept for `ctx` if it is live.
            let live =
                (ctx.born() == self.epoch() && self.has_live()).then_some(ctx as &dyn Handle);
            let freed = self.trim_locked(ctx.raw(), live, false)?;
            returned += freed;
            rounds += 1;
            if freed == 0 && round > 0 {
                break;
            }
            attempt = pool.alloc(ctx.raw(), size, stream, self.device, client, valid);
            if !attempt.as_ref().is_err_and(Error::is_oom) {
                break;
            }
        }
        log::info!(
            target: "gpuptr::pool",
            "device {}: out of memory for {} bytes; returned {} bytes of cache to the driver in {} round(s), then {}",
            self.device,
            size,
            returned,
            rounds,
            if attempt.is_ok() { "succeeded" } else { "failed" }
        );
        attempt
    }

    /// The out-of-memory error for `size` bytes, naming what the pool holds
    /// (in use, cached, kept by CUDA graphs), its limit if one is set, and
    /// what the device has free, as PyTorch's message does.
    #[cold]
    pub(super) fn out_of_memory(&self, ctx: &impl Handle, size: usize) -> Error {
        use crate::error::bytes;
        let mut detail = String::new();
        if let Some(pool) = &self.pool {
            let s = pool.stats();
            detail = format!(
                "; gpuptr's pool holds {} from the driver ({} in use, {} cached, {} kept by CUDA graphs)",
                bytes(pool.held_bytes()),
                bytes(s.live_bytes),
                bytes(s.cached_bytes),
                bytes(self.graphs.kept_bytes())
            );
            if pool.limit() != usize::MAX {
                detail += &format!(", and its limit is {}", bytes(pool.limit()));
            }
        }
        // cuMemGetInfo is allowed even during a capture.
        // SAFETY: `ctx` is retained by its holder, the caller.
        let info = unsafe { self.driver().mem_get_info(ctx.raw()) }.ok();
        if let Some((free, total)) = info {
            detail += &format!("; the device has {} free of {}", bytes(free), bytes(total));
        }
        detail += &self.oom_snapshot(size, info.map_or(0, |i| i.0));
        Error::OutOfMemory {
            device: self.device,
            requested: size,
            detail,
        }
    }

    /// An allocation outside the pool failed with `e`: if it ran out of
    /// memory, the typed error, with the history's `oom` entry and the
    /// snapshot (see [`DeviceState::oom_snapshot`]).
    #[cold]
    pub(crate) fn driver_oom(&self, ctx: &impl Handle, e: Error, size: usize) -> Error {
        match e.oom_on(self.device, size) {
            Error::OutOfMemory {
                device,
                requested,
                mut detail,
            } => {
                // SAFETY: `ctx` is retained by its holder, the caller.
                let free = unsafe { self.driver().mem_get_info(ctx.raw()) }.map_or(0, |i| i.0);
                detail += &self.oom_snapshot(size, free);
                Error::OutOfMemory {
                    device,
                    requested,
                    detail,
                }
            }
            e => e,
        }
    }

    /// Out of memory for `size` bytes with `device_free` free: the
    /// history's `oom` entry (while it records, or a snapshot path is set),
    /// then the snapshot of this device written to the path set with
    /// [`Runtime::set_oom_snapshot`](crate::Runtime::set_oom_snapshot), if
    /// any. What the error message adds: the file written, or why it could
    /// not be (also logged as a warning; never an error of its own). No
    /// lock of the pool is held while the file is written.
    #[cold]
    fn oom_snapshot(&self, size: usize, device_free: usize) -> String {
        let s = &self.services;
        let path = s.history.oom_snapshot();
        if s.watch.on(Watch::HISTORY) || path.is_some() {
            s.history.oom(self.device, size, device_free);
        }
        let Some(path) = path else {
            return String::new();
        };
        let live = s.history.live();
        let snapshot = crate::Snapshot {
            segments: self.segments(&live),
            device_traces: s.history.traces(self.device + 1),
            max_entries: s.history.max_entries(),
        };
        drop(live);
        match snapshot.write(&path) {
            Ok(()) => {
                log::info!(
                    target: "gpuptr::pool",
                    "device {}: out of memory; wrote a memory snapshot to {}",
                    self.device,
                    path.display()
                );
                format!("; a memory snapshot was written to {}", path.display())
            }
            Err(e) => {
                log::warn!(
                    target: "gpuptr::pool",
                    "device {}: out of memory; could not write a memory snapshot to {}: {e}",
                    self.device,
                    path.display()
                );
                format!(
                    "; a memory snapshot could not be written to {}: {e}",
                    path.display()
                )
            }
        }
    }
}
