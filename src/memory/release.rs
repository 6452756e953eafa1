//! Giving memory back, one function per origin that gpuptr releases
//! ([`Origin`](super::Origin)): a driver allocation is freed, an IPC mapping
//! closed, and a pool block handed back to its device's pool. Foreign
//! memory and mapped host memory release nothing here (their owners and
//! [`HostMemory`](crate::HostMemory) do).

use crate::context::Context;
use crate::driver::{DevicePtr, RawStream};
use crate::error::Result;
use crate::pool::Block;

/// Free a `cuMemAlloc[Managed]` allocation.
///
/// # Safety
/// `address` is a live driver allocation of `ctx` that gpuptr made, whose
/// release is claimed once, with no operation in flight on it.
pub(super) unsafe fn driver(ctx: &Context, address: DevicePtr) -> Result<()> {
    // Relaxed, as the allocation: a capture on some thread neither refuses
    // the free nor is invalidated by it.
    crate::driver::relaxed(ctx.driver(), || {
        // SAFETY: this fn's contract; the context is retained by `ctx`.
        unsafe { ctx.driver().mem_free(ctx.raw(), address) }
    })
}

/// Close the mapping `ipc_open_handle` made at `address`.
///
/// # Safety
/// `address` is a live mapping of `ctx` made by opening an IPC handle,
/// released once, with no operation in flight on it.
pub(super) unsafe fn ipc(ctx: &Context, address: DevicePtr) -> Result<()> {
    // SAFETY: this fn's contract; the context is retained by `ctx`.
    unsafe { ctx.driver().ipc_close_handle(ctx.raw(), address) }
}

/// Hand `block` back to `ctx`'s device, freed on `stream`: no driver
/// call, no wait. The pool refuses it if the device was reset since the
/// block's epoch.
#[inline]
pub(super) fn pool(ctx: &Context, block: Block, stream: Option<RawStream>) {
    // A block a CUDA graph may still touch waits for the graph.
    if let Some(block) = ctx.state().graphs().keep(block) {
        ctx.state().pool_release(ctx.raw(), block, stream);
    }
}
