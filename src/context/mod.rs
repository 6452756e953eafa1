//! [`Context`]: a device's primary CUDA context, retained while any holder
//! (a pointer, a view, a Python object) keeps it.

use std::sync::Arc;

use crate::device::{DeviceState, Handle, Owner, Services};
use crate::driver::{Driver, RawContext, RawStream};
use crate::error::Result;

/// A retained primary context. Shared through `Arc`: creating the first one
/// for a device calls `cuDevicePrimaryCtxRetain`, and dropping the last one
/// calls `cuDevicePrimaryCtxRelease`. [`Runtime::context`](crate::Runtime::context)
/// hands out one live `Context` per device.
///
/// A context is a leaf handle: its device's state (the pool, the epoch,
/// the counters) is owned by that device, which the context holds, so the
/// device outlives every context and pointer of it.
// Aligned so that the fields every pointer reads (state, device, raw) do
// not share a cache line with the `Arc` counts that every pointer writes:
// threads allocating at once then only contend on the count.
#[repr(align(128))]
pub struct Context {
    state: Arc<DeviceState>,
    /// The device's services, one load away (every allocation asks the
    /// leak report whether it is on).
    services: Arc<Services>,
    device: usize,
    raw: RawContext,
    /// The device's reset epoch when this context was retained: it owns the
    /// device's pool while the epoch is still that.
    born: u64,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.device)
            .field("raw", &format_args!("{:#x}", self.raw))
            .finish()
    }
}

impl Context {
    /// Retain the primary context of `state`'s device. Use
    /// [`Runtime::context`](crate::Runtime::context), which shares one
    /// `Context` per device.
    pub(crate) fn retain(state: Arc<DeviceState>) -> Result<Self> {
        let device = state.ordinal();
        let raw = state.driver().primary_context_retain(device)?;
        state.context_retained();
        Ok(Context {
            born: state.epoch(),
            services: state.services_arc().clone(),
            state,
            device,
            raw,
        })
    }

    /// The device ordinal.
    #[inline]
    pub fn device(&self) -> usize {
        self.device
    }

    /// The raw `CUcontext`, as an integer.
    #[inline]
    pub fn raw(&self) -> RawContext {
        self.raw
    }

    #[inline]
    pub(crate) fn driver(&self) -> &dyn Driver {
        self.services.driver.as_ref()
    }

    /// The current generation: the device's reset epoch (see
    /// [`Context::invalidate`]).
    #[inline]
    pub fn generation(&self) -> u64 {
        self.state.epoch()
    }

    /// Mark every allocation made so far on this device as stale, after the
    /// context was reset outside gpuptr (numba's `cuda.close()`): their
    /// memory is gone, and freeing them later must not touch whatever
    /// reuses their addresses.
    pub fn invalidate(&self) {
        self.state.invalidate();
    }

    /// Whether this is still the device's context: no reset (see
    /// [`Context::invalidate`]) happened since it was retained. Memory
    /// allocated through a context that is not current is refused.
    pub fn is_current(&self) -> bool {
        self.born == self.state.epoch()
    }

    /// The device's reset epoch when this context was retained.
    #[inline]
    pub(crate) fn born(&self) -> u64 {
        self.born
    }

    /// The state gpuptr keeps for this context's device.
    #[inline]
    pub(crate) fn state(&self) -> &Arc<DeviceState> {
        &self.state
    }

    /// Record `[start, start+size)` as memory of this context in the
    /// pointer→context registry (see [`Registry::insert_weak`](crate::registry::Registry::insert_weak)).
    pub(crate) fn register(
        self: &Arc<Self>,
        start: crate::driver::DevicePtr,
        size: usize,
    ) -> crate::registry::Registration {
        self.services
            .registry
            .insert_weak(start, size, &Handle::owner(self))
    }

    /// The services of this context's device (its driver, the registry,
    /// the leak report).
    #[inline]
    pub(crate) fn services(&self) -> &Services {
        &self.services
    }

    /// Fill this device's pool ahead of demand with about `bytes` of ready
    /// blocks the size of `size` (as RMM's initial pool size): allocations
    /// of that size then make no driver call until the blocks are used,
    /// also while the GPU is busy and freed blocks wait for their fence.
    /// Returns the bytes reserved, fewer if the device ran out of memory
    /// part way. [`Runtime::trim`](crate::Runtime::trim) gives them back.
    pub fn reserve(self: &Arc<Self>, size: usize, bytes: usize) -> Result<usize> {
        crate::fork::check()?;
        self.state().reserve(self, size, bytes)
    }

    /// Wait for all work in this context (`cuCtxSynchronize`).
    pub fn synchronize(&self) -> Result<()> {
        crate::fork::check()?;
        // SAFETY: `self.raw` is retained by this Context until it drops.
        unsafe { self.driver().synchronize(self.raw) }
    }

    /// Wait for the work queued on `stream` to finish.
    ///
    /// # Safety
    /// `stream` is a live stream of this context, or a default-stream handle
    /// (0, 1, 2).
    pub unsafe fn stream_synchronize(&self, stream: RawStream) -> Result<()> {
        crate::fork::check()?;
        // SAFETY: `self.raw` is retained; `stream` is live (this fn's contract).
        unsafe { self.driver().stream_synchronize(self.raw, stream) }
    }

    /// Whether all work on `stream` is done, without waiting.
    ///
    /// # Safety
    /// As [`Context::stream_synchronize`].
    pub unsafe fn stream_is_idle(&self, stream: RawStream) -> Result<bool> {
        crate::fork::check()?;
        // SAFETY: as in `stream_synchronize`.
        unsafe { self.driver().stream_query(self.raw, stream) }
    }

    /// `(free, total)` device memory, from `cuMemGetInfo`.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        crate::fork::check()?;
        // SAFETY: `self.raw` is retained by this Context.
        unsafe { self.driver().mem_get_info(self.raw) }
    }

    /// Make this context current on the calling thread.
    pub fn make_current(&self) -> Result<()> {
        crate::fork::check()?;
        // SAFETY: `self.raw` is retained by this Context.
        unsafe { self.driver().set_current_context(self.raw) }
    }
}

impl crate::graph::Owner for Context {
    fn graph_memory(&self) -> &crate::graph::GraphMemory {
        self.state.graphs()
    }

    fn device(&self) -> usize {
        self.device
    }
}

/// What the device asks of a context (see [`Handle`]): the device never
/// names the context type; an `Arc` is what owns its memory.
impl Handle for Arc<Context> {
    #[inline]
    fn raw(&self) -> RawContext {
        self.raw
    }

    #[inline]
    fn born(&self) -> u64 {
        self.born
    }

    fn owner(&self) -> std::sync::Weak<Owner> {
        let owner: Arc<Owner> = self.clone();
        Arc::downgrade(&owner)
    }

    fn keeper(&self) -> Arc<dyn crate::graph::Owner> {
        self.clone()
    }
}

impl PartialEq for Context {
    fn eq(&self, other: &Self) -> bool {
        self.raw == other.raw && self.device == other.device
    }
}
impl Eq for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // Deleters never fail: at process exit the driver may already be
        // deinitialised, and there is nobody to report to. Every allocation
        // holds its context, so only cached pool blocks are left: give them
        // back before the retain that keeps them valid goes.
        // A context detached by a reset no longer owns the pool (its
        // successor does), and its memory is gone with the reset. In a forked
        // child nothing here is ours to release.
        if crate::fork::forked() {
            return;
        }
        self.state.teardown(self.raw, self.born);
        // SAFETY: balances the retain in `Context::retain`; this is the last
        // holder, so nothing uses the context through it afterwards.
        let r = unsafe { self.driver().primary_context_release(self.device) };
        match r {
            Ok(()) => log::debug!(
                target: "gpuptr::context",
                "device {}: released the primary context {:#x}",
                self.device,
                self.raw
            ),
            Err(e) => log::warn!(
                target: "gpuptr::context",
                "device {}: releasing the primary context failed: {e}",
                self.device
            ),
        }
    }
}
