//! Each device's context slot: the one live [`Context`] of a device,
//! retained on first use and shared by every caller while anyone holds
//! it, and the runtime's own hold on it (see [`Runtime::held_context`]).
//! The device below knows its live context only by handle.

use std::sync::{Arc, Mutex, Weak};

use super::Runtime;
use crate::context::Context;
use crate::error::Result;
use crate::sync::lock;

/// A device's live context, and the runtime's own hold on it, if taken:
/// while held, `live` always upgrades to it.
#[derive(Default)]
pub(super) struct Slot {
    live: Weak<Context>,
    held: Option<Arc<Context>>,
}

impl Runtime {
    /// The live context of `device` (checked), retained if none is; with
    /// `hold`, also kept alive by the runtime until a reset or
    /// [`Runtime::release_held_contexts`].
    pub(super) fn slot_context(&self, device: usize, hold: bool) -> Result<Arc<Context>> {
        let mut slot = lock(&self.slots[device]);
        let ctx = match slot.live.upgrade() {
            Some(ctx) => ctx,
            None => {
                let state = &self.devices[device];
                let ctx = Arc::new(Context::retain(state.clone())?);
                slot.live = Arc::downgrade(&ctx);
                state.retained(&ctx);
                log::debug!(
                    target: "gpuptr::context",
                    "device {}: retained the primary context {:#x}",
                    device,
                    ctx.raw()
                );
                ctx
            }
        };
        if hold && slot.held.is_none() {
            slot.held = Some(ctx.clone());
        }
        Ok(ctx)
    }

    /// The live context of `device` (checked), if some holder keeps one.
    pub(super) fn existing(&self, device: usize) -> Option<Arc<Context>> {
        lock(&self.slots[device]).live.upgrade()
    }

    /// Empty `device`'s slot (after a reset): the runtime's hold goes, and
    /// the next use retains the primary context afresh.
    pub(super) fn clear_slot(&self, device: usize) {
        let old = std::mem::take(&mut *lock(&self.slots[device]));
        // Outside the lock: the last drop gives the pool back.
        drop(old);
    }

    /// Let `device`'s own hold on its context go (its holders keep it).
    pub(super) fn release_hold(&self, device: usize) {
        let held = lock(&self.slots[device]).held.take();
        drop(held);
    }
}

/// One empty slot per device.
pub(super) fn slots(n: usize) -> Vec<Mutex<Slot>> {
    (0..n).map(|_| Mutex::new(Slot::default())).collect()
}
