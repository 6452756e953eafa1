//! Allocations of gpuptr's own memory: a pool block, a driver allocation,
//! or managed memory, all made from one [`AllocRequest`].

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{ordering_stream, DevicePointer, Origin};
use crate::context::Context;
use crate::driver::{DevicePtr, RawStream, MEM_ATTACH_GLOBAL, MEM_ATTACH_HOST};
use crate::error::{Error, Result};
use crate::stats::Client;
use crate::track::Site;

/// What an allocation asks for: every `alloc*` entry point builds one.
#[derive(Copy, Clone, Debug)]
pub(crate) struct AllocRequest {
    /// Bytes; zero gives a null pointer and makes no driver call.
    pub size: usize,
    /// The owner's stream (`None`: any stream).
    pub stream: Option<RawStream>,
    /// Who asks (statistics).
    pub client: Client,
    /// Where the memory comes from.
    pub source: Source,
    /// The stream the caller allocates on, ordering or not: during a
    /// capture, the block belongs to the capture this stream takes part in
    /// (see [`crate::graph`]). Set only where the stream is known live.
    pub seen: Option<RawStream>,
}

/// Where an allocation's memory comes from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// The device's pool, or the driver when the device has none.
    Pool,
    /// `cuMemAlloc`, bypassing the pool.
    Driver,
    /// `cuMemAllocManaged`, attached globally or to the host.
    Managed {
        /// `CU_MEM_ATTACH_GLOBAL` rather than `CU_MEM_ATTACH_HOST`.
        attach_global: bool,
    },
}

impl AllocRequest {
    /// `size` bytes from the pool for `client`, for an owner on `stream`.
    pub(crate) fn pool(size: usize, stream: Option<RawStream>, client: Client) -> Self {
        AllocRequest {
            size,
            stream,
            client,
            source: Source::Pool,
            seen: None,
        }
    }
}

impl DevicePointer {
    /// Make the allocation `req` asks for in `context`, noted at `site` for
    /// the leak report (`site` is called only while tracking is on).
    #[inline]
    pub(crate) fn allocate(
        context: &Arc<Context>,
        req: AllocRequest,
        site: impl FnOnce() -> Site,
    ) -> Result<Arc<Self>> {
        let p = DevicePointer::make(context, req)?;
        p.note_site(site);
        Ok(p)
    }

    /// [`DevicePointer::allocate`] before the leak report hears of it.
    fn make(context: &Arc<Context>, req: AllocRequest) -> Result<Arc<Self>> {
        crate::fork::check()?;
        Error::check_request(context.device(), req.size)?;
        let state = context.state();
        state.bury();
        // The epoch this allocation is made in: a reset during it makes
        // the memory stale, whenever the reset came.
        let epoch = state.epoch();
        let p = match req.source {
            Source::Pool if state.pooled() && req.size != 0 => {
                let stream = req.stream.and_then(ordering_stream);
                let block = state.pool_alloc(context, req.size, stream, req.client, epoch)?;
                if state.graphs().watching() {
                    // The block belongs to an announced capture under way, if
                    // its stream takes part in one (or, with no stream
                    // known, if this thread began one).
                    state.graphs().tag(
                        context.driver(),
                        context.raw(),
                        block.address,
                        context.generation(),
                        req.seen,
                    );
                }
                let origin = Origin::Pool(block.class);
                let mut p = DevicePointer::base(context.clone(), block.address, req.size, origin);
                // The epoch the pool checked under its lock, not the one
                // now: a reset since makes this block stale, and its
                // release touches nothing of the new epoch's.
                p.generation = epoch;
                p.pool_shard = block.shard;
                p.pool_slot = block.slot;
                p.client = req.client;
                if let Some(s) = stream {
                    *p.stream.get_mut() = s;
                }
                DevicePointer::counted(context, p)
            }
            Source::Pool | Source::Driver => {
                DevicePointer::from_driver(context, req, epoch, |ctx| {
                    // SAFETY: `ctx.raw()` is retained by the Context.
                    unsafe { ctx.driver().mem_alloc(ctx.raw(), req.size) }
                })?
            }
            Source::Managed { attach_global } => {
                let flags = if attach_global {
                    MEM_ATTACH_GLOBAL
                } else {
                    MEM_ATTACH_HOST
                };
                DevicePointer::from_driver(context, req, epoch, |ctx| {
                    // SAFETY: `ctx.raw()` is retained by the Context.
                    unsafe { ctx.driver().mem_alloc_managed(ctx.raw(), req.size, flags) }
                })?
            }
        };
        Ok(p)
    }

    /// Allocate `size` bytes straight from the driver (`cuMemAlloc`),
    /// bypassing the pool.
    #[track_caller]
    pub fn alloc_uncached(context: &Arc<Context>, size: usize) -> Result<Arc<Self>> {
        let at = std::panic::Location::caller();
        let req = AllocRequest {
            source: Source::Driver,
            ..AllocRequest::pool(size, None, Client::Direct)
        };
        DevicePointer::allocate(context, req, || Site::Rust(at))
    }

    /// Allocate `size` bytes of managed (unified) memory in `context`,
    /// attached globally or to the host.
    #[track_caller]
    pub fn alloc_managed(
        context: &Arc<Context>,
        size: usize,
        attach_global: bool,
    ) -> Result<Arc<Self>> {
        let at = std::panic::Location::caller();
        DevicePointer::alloc_managed_at(context, size, attach_global, || Site::Rust(at))
    }

    /// As [`DevicePointer::alloc_managed`], made at `site` for the leak
    /// report.
    pub fn alloc_managed_at(
        context: &Arc<Context>,
        size: usize,
        attach_global: bool,
        site: impl FnOnce() -> Site,
    ) -> Result<Arc<Self>> {
        let req = AllocRequest {
            source: Source::Managed { attach_global },
            ..AllocRequest::pool(size, None, Client::Direct)
        };
        DevicePointer::allocate(context, req, site)
    }

    /// The allocation `allocate` makes (a driver call freed by `cuMemFree`),
    /// registered and counted.
    fn from_driver(
        context: &Arc<Context>,
        req: AllocRequest,
        epoch: u64,
        allocate: impl FnOnce(&Context) -> Result<DevicePtr>,
    ) -> Result<Arc<Self>> {
        let (address, registration) = if req.size == 0 {
            (0, None)
        } else {
            // Relaxed: a capture under way on some thread neither refuses
            // this allocation nor is invalidated by it.
            let address =
                crate::driver::relaxed(context.driver(), || allocate(context)).map_err(|e| {
                    if !e.is_oom() {
                        return e;
                    }
                    let ooms = &context.state().counters().ooms;
                    ooms.fetch_add(1, Ordering::Relaxed);
                    context.state().driver_oom(context, e, req.size)
                })?;
            let reg = context.register(address, req.size);
            (address, Some(reg))
        };
        let mut p = DevicePointer::base(context.clone(), address, req.size, Origin::Driver);
        // Stale if a reset came during the allocation.
        p.generation = epoch;
        p.managed = matches!(req.source, Source::Managed { .. });
        p.registration = registration;
        p.client = req.client;
        Ok(DevicePointer::counted(context, p))
    }

    /// `p`, new memory of gpuptr's, counted (the pool counts its own blocks
    /// under its shard lock) and noted for the leak report. Always inlined:
    /// `p` is then built in place (a pool pair pays for a copy).
    #[inline(always)]
    fn counted(context: &Context, mut p: DevicePointer) -> Arc<Self> {
        if !matches!(p.origin, Origin::Pool(_)) {
            context.state().counters().allocated(p.size, p.client);
        }
        // Noted by the leak report and the history once the caller gives
        // the site ([`DevicePointer::note_site`]): one load here while both
        // are off.
        if p.address != 0 {
            p.observed = context.services().watch.get();
        }
        Arc::new(p)
    }
}
