//! What a context allocates: device memory (from the device's pool, or the
//! driver), managed memory, and pinned host memory. These methods of
//! [`Context`] live with the memory they make: the context itself is a
//! leaf that knows no memory type.

use std::sync::Arc;

use super::{AllocRequest, DevicePointer, HostFlags, HostMemory};
use crate::context::Context;
use crate::driver::RawStream;
use crate::error::Result;
use crate::stats::Client;
use crate::track::Site;

impl Context {
    /// Allocate `size` bytes of device memory in this context, for use in
    /// any stream (freed blocks are reused only after all work queued before
    /// their free has finished).
    #[track_caller]
    pub fn alloc(self: &Arc<Self>, size: usize) -> Result<Arc<DevicePointer>> {
        let at = std::panic::Location::caller();
        self.alloc_at(size, None, Client::Direct, || Site::Rust(at))
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
        DevicePointer::allocate(self, AllocRequest::pool(size, stream, client), site)
    }

    /// As [`Context::alloc_at`], made on `seen`, a stream the caller uses
    /// whether or not the allocation is ordered on it: during a CUDA-graph
    /// capture, the block belongs to the capture `seen` takes part in, and
    /// is kept for the graph when freed. PyTorch's
    /// allocator hook passes its current stream.
    ///
    /// # Safety
    /// `seen` is a live stream of this context, or a default-stream handle:
    /// during a capture the driver is asked about it.
    #[inline]
    pub unsafe fn alloc_seen_at(
        self: &Arc<Self>,
        size: usize,
        stream: Option<RawStream>,
        seen: RawStream,
        client: Client,
        site: impl FnOnce() -> Site,
    ) -> Result<Arc<DevicePointer>> {
        let req = AllocRequest {
            seen: Some(seen),
            ..AllocRequest::pool(size, stream, client)
        };
        DevicePointer::allocate(self, req, site)
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
}

impl Context {
    /// Allocate `size` bytes of pinned host memory in this context.
    pub fn alloc_host(self: &Arc<Self>, size: usize, flags: HostFlags) -> Result<Arc<HostMemory>> {
        HostMemory::alloc(self, size, flags)
    }
}
