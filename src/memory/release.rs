//! Giving memory back, one function per origin that gpuptr releases
//! ([`Origin`](super::Origin)): a driver allocation is freed, an IPC mapping
//! closed, and a pool block handed back to its device's pool. Foreign
//! memory and mapped host memory release nothing here (their owners and
//! [`HostMemory`](crate::HostMemory) do).

use crate::context::Context;
use crate::driver::{DevicePtr, RawStream};
use crate::error::Result;
use crate::graph::KeptBlock;
use crate::stats::Client;

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

/// Hand the pool block at `address` back to `ctx`'s device: no driver
/// call, no wait. The pool refuses it if the device was reset since
/// `epoch`.
#[allow(clippy::too_many_arguments)]
pub(super) fn pool(
    ctx: &Context,
    epoch: u64,
    address: DevicePtr,
    class: usize,
    shard: u16,
    size: usize,
    stream: Option<RawStream>,
    client: Client,
) {
    // A block a CUDA graph may still touch waits for the graph.
    let block = KeptBlock {
        epoch,
        address,
        class,
        shard,
        size,
        client,
    };
    let Some(KeptBlock { address, .. }) = ctx.state().graphs().keep(block) else {
        return;
    };
    ctx.state().pool_release(
        ctx.raw(),
        epoch,
        address,
        class,
        u32::from(shard),
        size,
        stream,
        client,
    );
}
