//! [`Context`]: a device's primary CUDA context, retained while any holder
//! (a pointer, a view, a Python object) keeps it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::driver::{Driver, RawContext, RawStream};
use crate::error::Result;
use crate::memory::{Client, DevicePointer};
use crate::track::Site;

use crate::runtime::Runtime;

/// A retained primary context. Shared through `Arc`: creating the first one
/// for a device calls `cuDevicePrimaryCtxRetain`, and dropping the last one
/// calls `cuDevicePrimaryCtxRelease`. [`Runtime::context`] hands out one live
/// `Context` per device.
// Aligned so that the fields every pointer reads (runtime, device, raw,
// generation) do not share a cache line with the `Arc` counts that every
// pointer writes: threads allocating at once then only contend on the count.
#[repr(align(128))]
pub struct Context {
    runtime: Arc<Runtime>,
    device: usize,
    raw: RawContext,
    /// Bumped when the context is reset behind gpuptr's back; allocations
    /// from an older generation are never freed.
    generation: AtomicU64,
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
    /// Retain `device`'s primary context. Use [`Runtime::context`], which
    /// shares one `Context` per device.
    pub(crate) fn retain(runtime: Arc<Runtime>, device: usize) -> Result<Self> {
        let raw = runtime.driver().primary_context_retain(device)?;
        Ok(Context {
            runtime,
            device,
            raw,
            generation: AtomicU64::new(0),
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

    /// The runtime this context belongs to.
    #[inline]
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    #[inline]
    pub(crate) fn driver(&self) -> &dyn Driver {
        self.runtime.driver().as_ref()
    }

    /// The current generation (see [`Context::invalidate`]).
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Mark every allocation made so far as stale, after the context was
    /// reset outside gpuptr (numba's `cuda.close()`): their memory is gone,
    /// and freeing them later must not touch whatever reuses their addresses.
    pub fn invalidate(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The state gpuptr keeps for this context's device.
    #[inline]
    pub(crate) fn state(&self) -> &crate::runtime::DeviceState {
        self.runtime.device_state(self.device)
    }

    /// Allocate `size` bytes of device memory in this context, for use in
    /// any stream (freed blocks are reused only after all work queued before
    /// their free has finished).
    #[track_caller]
    pub fn alloc(self: &Arc<Self>, size: usize) -> Result<Arc<DevicePointer>> {
        let at = std::panic::Location::caller();
        self.alloc_at(size, None, Client::Direct, || Site::Rust(at))
    }

    /// Fill this device's pool ahead of demand with about `bytes` of ready
    /// blocks the size of `size` (as RMM's initial pool size): allocations
    /// of that size then make no driver call until the blocks are used,
    /// also while the GPU is busy and freed blocks wait for their fence.
    /// Returns the bytes reserved, fewer if the device ran out of memory
    /// part way. [`Runtime::trim`] gives them back.
    pub fn reserve(self: &Arc<Self>, size: usize, bytes: usize) -> Result<usize> {
        crate::fork::check()?;
        self.state().reserve(self, size, bytes)
    }

    /// Allocate `size` bytes for use on `stream` (stream-ordered, as
    /// `cudaMallocAsync`): a block freed on `stream` is reused at once, and
    /// dropping the pointer frees it on `stream`. Use
    /// [`DevicePointer::record_stream`] for other streams it is used on.
    #[track_caller]
    pub fn alloc_on(
        self: &Arc<Self>,
        size: usize,
        stream: RawStream,
    ) -> Result<Arc<DevicePointer>> {
        let at = std::panic::Location::caller();
        self.alloc_at(size, Some(stream), Client::Direct, || Site::Rust(at))
    }

    /// Allocate `size` bytes for `client` (per-client statistics), for an
    /// owner on `stream` (as [`Context::alloc_on`]) or on any stream (as
    /// [`Context::alloc`]).
    #[track_caller]
    pub fn alloc_for(
        self: &Arc<Self>,
        size: usize,
        stream: Option<RawStream>,
        client: Client,
    ) -> Result<Arc<DevicePointer>> {
        let at = std::panic::Location::caller();
        self.alloc_at(size, stream, client, || Site::Rust(at))
    }

    /// As [`Context::alloc_for`], made at `site` for the leak report (a
    /// binding passes its own language's call site; `site` is called only
    /// while tracking is on).
    #[inline]
    pub fn alloc_at(
        self: &Arc<Self>,
        size: usize,
        stream: Option<RawStream>,
        client: Client,
        site: impl FnOnce() -> Site,
    ) -> Result<Arc<DevicePointer>> {
        let p = DevicePointer::alloc(self, size, stream, client)?;
        p.note_site(site);
        Ok(p)
    }

    /// Allocate `size` bytes of managed (unified) memory in this context.
    #[track_caller]
    pub fn alloc_managed(
        self: &Arc<Self>,
        size: usize,
        attach_global: bool,
    ) -> Result<Arc<DevicePointer>> {
        let at = std::panic::Location::caller();
        DevicePointer::alloc_managed_at(self, size, attach_global, || Site::Rust(at))
    }

    /// Allocate `size` bytes of pinned host memory in this context.
    pub fn alloc_host(
        self: &Arc<Self>,
        size: usize,
        flags: crate::HostFlags,
    ) -> Result<Arc<crate::HostMemory>> {
        crate::HostMemory::alloc(self, size, flags)
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
        self.state().teardown(self);
        // SAFETY: balances the retain in `Context::retain`; this is the last
        // holder, so nothing uses the context through it afterwards.
        let r = unsafe { self.runtime.driver().primary_context_release(self.device) };
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
