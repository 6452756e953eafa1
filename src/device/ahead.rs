//! Growth ahead of demand, as the device orchestrates it: the pool's
//! helper grows a class while the context is still the device's live one,
//! and reservations fill the pool up front.

use std::sync::{Arc, Weak};

use super::{DeviceState, Handle, Owner};
use crate::driver::RawContext;
use crate::error::{Error, Result};
use crate::pool::{Kind, Pool};
use crate::sync::lock;

impl DeviceState {
    /// Ask the pool's helper to grow arena `arena` ahead of demand with a
    /// segment of `kind` (see [`PoolConfig::ahead_bytes`]). The job holds the device and the
    /// context only weakly: it never keeps a context alive, so dropping the
    /// last user handle still gives the pool back at once, on the caller's
    /// thread.
    pub(super) fn post_ahead(
        self: &Arc<Self>,
        pool: &Pool,
        ctx: &impl Handle,
        arena: usize,
        kind: Kind,
    ) {
        let me = Arc::downgrade(self);
        let (weak, raw, epoch) = (ctx.owner(), ctx.raw(), ctx.born());
        let asked = std::time::Instant::now();
        pool.post_ahead(Box::new(move || {
            if let Some(me) = me.upgrade() {
                me.grow_ahead(&weak, raw, epoch, arena, kind, asked);
            }
        }));
    }

    /// Whether `weak` (whose handle is `raw`) is still this device's live
    /// context in `epoch`, and this process is not a forked child: the
    /// check of every job on the pool's helper, made under the recovery
    /// lock. A live context born in the current epoch is the slot's (a
    /// successor needs this one gone, or a reset: a new epoch; a context
    /// kept across a reset was born in an older one), and one whose handle
    /// is still the device's is not being reset (a reset clears the handle
    /// before it takes the recovery lock).
    pub(super) fn still_live(&self, weak: &Weak<Owner>, raw: RawContext, epoch: u64) -> bool {
        weak.strong_count() > 0
            && self.epoch() == epoch
            && self.live_raw() == raw
            && !crate::fork::forked()
    }

    /// On the pool's helper: grow arena `arena` ahead, register the new
    /// segment, and stock it, while `weak` (whose handle is `raw`) is
    /// still this device's live context in `epoch`. All under the recovery lock, which a reset and
    /// the last drop's teardown take before they give memory or the
    /// context back: so the context stays retained through the driver
    /// call, and a reset or teardown waits for at most this one allocation
    /// and then frees its blocks with the rest.
    fn grow_ahead(
        &self,
        weak: &Weak<Owner>,
        raw: RawContext,
        epoch: u64,
        arena: usize,
        kind: Kind,
        asked: std::time::Instant,
    ) {
        let Some(pool) = &self.pool else {
            return;
        };
        let began = asked.elapsed();
        let _recovering = lock(&self.recovery);
        if !self.still_live(weak, raw, epoch) {
            pool.ahead_over(arena);
            return;
        }
        let grown = pool.grow_ahead(raw, arena, kind, |a| {
            self.register(weak, a);
        });
        if let Some(a) = grown {
            // When it began and ended, from the hand-out that asked: where a
            // busy GPU's first growth lands against the stock.
            log::debug!(
                target: "gpuptr::pool",
                "device {}: grew ahead by {} bytes, begun {} us and done {} us after the ask",
                self.device,
                a.bytes,
                began.as_micros(),
                asked.elapsed().as_micros()
            );
        }
    }

    /// Fill the pool with about `bytes` of ready blocks of `size`'s class;
    /// the bytes reserved (an unpooled device reserves nothing).
    pub(crate) fn reserve(&self, ctx: &impl Handle, size: usize, bytes: usize) -> Result<usize> {
        Error::check_request(self.device, size)?;
        let Some(pool) = &self.pool else {
            return Ok(0);
        };
        // More than the device has free would take all of it and still
        // fall short: refused whole, naming what there is. A block larger
        // than the reservation is what must fit (a reservation of nothing
        // needs nothing).
        let need = if bytes == 0 { 0 } else { bytes.max(size) };
        // SAFETY: `ctx` is retained by its holder, the caller.
        if let Ok((free, total)) = unsafe { self.driver().mem_get_info(ctx.raw()) } {
            if need > free {
                use crate::error::bytes as human;
                let blocks = match size > bytes {
                    true => format!(" in blocks of {}", human(size)),
                    false => String::new(),
                };
                return Err(Error::OutOfMemory {
                    device: self.device,
                    requested: need,
                    detail: format!(
                        " for a reservation{blocks}; the device has {} free of {} (reserve less, or a share such as \"80%\" of what is free)",
                        human(free),
                        human(total)
                    ),
                });
            }
        }
        // Under the recovery lock a reset takes: none can come between a
        // segment and its registration.
        let _recovering = lock(&self.recovery);
        let epoch = self.epoch();
        let (made, r) = pool.reserve(ctx.raw(), size, bytes, || self.epoch() == epoch);
        let owner = ctx.owner();
        for a in &made {
            self.register(&owner, a);
        }
        let reserved = made.iter().map(|a| a.bytes).sum();
        log::debug!(
            target: "gpuptr::pool",
            "device {}: reserved {} of {} bytes for blocks of {} bytes ({} driver allocation(s))",
            self.device,
            reserved,
            bytes,
            size,
            made.len()
        );
        match r {
            // Out of memory part way: what was reserved stays; say so only
            // when nothing could be.
            Err(e) if e.is_oom() && reserved > 0 => Ok(reserved),
            // Nothing: the message an allocation's would be (what the pool
            // holds, its limit, what the device has free).
            Err(e) if e.is_oom() => Err(self.out_of_memory(ctx, need)),
            r => r.map(|()| reserved),
        }
    }
}
