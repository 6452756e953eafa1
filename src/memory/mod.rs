//! Device memory: [`DevicePointer`], the owning allocation, and [`View`], a
//! sub-range that keeps its allocation (and so the context) alive.
//!
//! The rooms: this file holds the pointer, its lifetime and its one
//! release; `alloc` makes pointers of gpuptr's own memory (the pool, the
//! driver, managed memory) from one [`AllocRequest`](alloc::AllocRequest);
//! `foreign` wraps memory someone else owns (and mapped host memory);
//! `release` gives each origin's memory back; `view` is [`View`] and its
//! copies.

mod alloc;
mod context;
mod foreign;
mod host;
mod release;
mod view;

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::context::Context;
use crate::driver::{DevicePtr, RawStream, STREAM_LEGACY, STREAM_PER_THREAD};
use crate::error::Result;
use crate::history::Live;
use crate::lifetime::{check_live, release_keepalive, KeepAlive, Lifetime};
use crate::pool::Block;
use crate::registry::Registration;
use crate::stats::Client;
use crate::track::{Site, Watch};
pub(crate) use alloc::AllocRequest;
pub use host::{HostFlags, HostKind, HostMemory};
pub use view::View;

/// Memory lent to a consumer outside gpuptr ([`DevicePointer::lend`]): it
/// holds the allocation, and the release of a free asked for meanwhile runs
/// when the last loan or operation ends. Dropping it never blocks on Python.
/// Over mapped host memory, the loan holds that memory too, so that
/// freeing it waits for the consumer as well.
#[derive(Debug)]
pub struct Loan {
    ptr: Arc<DevicePointer>,
    _host: Option<host::HostHold>,
}

impl Loan {
    /// The memory lent.
    pub fn pointer(&self) -> &Arc<DevicePointer> {
        &self.ptr
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        let p = &self.ptr;
        p.life.end(Lifetime::OP, || p.release());
    }
}

/// Who frees the memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// `cuMemAlloc` by gpuptr; gpuptr frees it.
    Driver,
    /// Someone else's memory (wrapped); gpuptr never frees it.
    Foreign,
    /// A block of the device's caching pool, of the given size class; it
    /// goes back to the pool when freed.
    Pool(usize),
    /// Another process's allocation, mapped by opening its IPC handle;
    /// unmapped when freed.
    Ipc,
}

/// No stream known: the pool's unordered (fenced) path.
const NO_STREAM: usize = usize::MAX;
/// Used on several streams: the unordered path too.
const MANY_STREAMS: usize = usize::MAX - 1;

/// The stream that orders work queued on `stream`, as the pool compares
/// them (a block freed there may be reused at once there), if any: the
/// legacy stream's two handles (0 and [`STREAM_LEGACY`]) are one, `0`; the
/// per-thread default stream differs per thread, so it orders nothing that
/// can be relied on elsewhere (`None`).
pub fn ordering_stream(stream: RawStream) -> Option<RawStream> {
    match stream {
        STREAM_LEGACY => Some(0),
        STREAM_PER_THREAD => None,
        s if s >= MANY_STREAMS => None,
        s => Some(s),
    }
}

/// An allocation: address, size and the context it lives in. Shared through
/// `Arc`; freed exactly once, by [`DevicePointer::free`] or when the last
/// holder drops it.
pub struct DevicePointer {
    context: Arc<Context>,
    address: DevicePtr,
    size: usize,
    origin: Origin,
    managed: bool,
    readonly: bool,
    generation: u64,
    registration: Option<Registration>,
    /// The pool shard a pooled block goes back to.
    /// (A u16: shards are at most 1024, and a u32 would make the struct a
    /// word longer, which a pool pair measurably pays for.)
    pool_shard: u16,
    /// Its slot in the shard's block table: a release finds it there
    /// without hashing its address (a hint, checked against the address).
    pool_slot: u32,
    life: Lifetime,
    /// The stream it is released on ([`NO_STREAM`], [`MANY_STREAMS`] or a handle).
    stream: AtomicUsize,
    /// Mapped host memory this device view reaches: its operations hold it too.
    host: Option<Arc<HostMemory>>,
    /// Set once at construction: most pointers keep nothing, and then
    /// releasing them takes no lock.
    has_keepalive: bool,
    /// The library that asked for it (statistics).
    client: Client,
    /// Noted by the leak report and/or the history ([`Watch`] bits as they
    /// were when it was made; forgotten on release).
    observed: u8,
    /// Shared with another process (its IPC liveness record is cleared on
    /// release).
    exported: AtomicBool,
    keepalive: Mutex<Option<KeepAlive>>,
}

impl std::fmt::Debug for DevicePointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePointer")
            .field("address", &format_args!("{:#x}", self.address))
            .field("size", &self.size)
            .field("device", &self.context.device())
            .field("origin", &self.origin)
            .field("freed", &self.is_freed())
            .finish()
    }
}

/// An operation in flight on a pointer (and on the mapped host memory under
/// it): the memory is not released until it drops.
pub(crate) struct InUse<'a> {
    ptr: &'a DevicePointer,
    _host: Option<host::HostUse<'a>>,
}

impl Drop for InUse<'_> {
    fn drop(&mut self) {
        // The last operation after a deferred free releases.
        self.ptr.life.end(Lifetime::OP, || self.ptr.release());
    }
}

impl DevicePointer {
    /// A pointer with nothing optional set: not managed, writable, no
    /// registration, keepalive or host memory, released without a stream.
    fn base(context: Arc<Context>, address: DevicePtr, size: usize, origin: Origin) -> Self {
        DevicePointer {
            generation: context.generation(),
            context,
            address,
            size,
            origin,
            managed: false,
            readonly: false,
            registration: None,
            pool_shard: 0,
            pool_slot: 0,
            life: Lifetime::default(),
            stream: AtomicUsize::new(NO_STREAM),
            host: None,
            has_keepalive: false,
            keepalive: Mutex::new(None),
            client: Client::Direct,
            observed: 0,
            exported: AtomicBool::new(false),
        }
    }

    /// The start address.
    #[inline]
    pub fn address(&self) -> DevicePtr {
        self.address
    }

    /// The size in bytes.
    #[inline]
    pub fn size(&self) -> usize {
        self.size
    }

    /// The context the memory lives in.
    #[inline]
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// Who frees it.
    #[inline]
    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// Whether it is managed (unified) memory.
    #[inline]
    pub fn is_managed(&self) -> bool {
        self.managed
    }

    /// Whether writes through it are refused: memory over any byte of host
    /// memory registered from a read-only object, or imported from an
    /// exporter that marked it read-only.
    #[inline]
    pub fn is_readonly(&self) -> bool {
        self.readonly
    }

    /// Whether it was freed.
    #[inline]
    pub fn is_freed(&self) -> bool {
        self.life.is_freed()
    }

    /// Whether its context was reset since it was made, so its memory is gone.
    #[inline]
    pub fn is_stale(&self) -> bool {
        self.generation != self.context.generation()
    }

    /// `Ok` if the memory may be used now, else [`Error::InvalidPointer`](crate::Error::InvalidPointer).
    #[inline]
    pub fn check_live(&self) -> Result<()> {
        check_live("memory", self.address, self.is_freed(), self.is_stale())?;
        match &self.host {
            Some(h) => h.check_live(),
            None => Ok(()),
        }
    }

    /// Hold the memory for one operation: a free meanwhile is deferred
    /// until it ends. `Err` if it is not live.
    pub(crate) fn begin_use(&self) -> Result<InUse<'_>> {
        crate::fork::check()?;
        let host = match &self.host {
            Some(h) => Some(h.begin_use()?),
            None => None,
        };
        self.begin(Lifetime::OP)?;
        let guard = InUse {
            ptr: self,
            _host: host,
        };
        check_live("memory", self.address, false, self.is_stale())?;
        Ok(guard)
    }

    fn begin(&self, unit: u64) -> Result<()> {
        let live = self.life.begin(unit, || self.release());
        check_live("memory", self.address, !live, false)
    }

    /// Count a buffer export (host-reachable managed memory): `free()`
    /// refuses while any is alive. `Err` if the memory is not live.
    pub fn begin_export(&self) -> Result<()> {
        self.check_live()?;
        self.begin(Lifetime::EXPORT)
    }

    /// End a buffer export counted by [`DevicePointer::begin_export`].
    pub fn end_export(&self) {
        self.life.end(Lifetime::EXPORT, || self.release());
    }

    /// Lend the memory to a consumer outside gpuptr (a DLPack tensor): until
    /// the [`Loan`] drops, a [`DevicePointer::free`] leaves the release to it,
    /// so the consumer never reads memory that was reused under it. `Err` if
    /// the memory is not live.
    pub fn lend(self: &Arc<Self>) -> Result<Loan> {
        self.check_live()?;
        let host = self.host.as_ref().map(|h| h.hold()).transpose()?;
        self.begin(Lifetime::OP)?;
        Ok(Loan {
            ptr: self.clone(),
            _host: host,
        })
    }

    /// The pinned host memory this is the device side of (mapped memory),
    /// if any.
    pub fn host(&self) -> Option<&Arc<HostMemory>> {
        self.host.as_ref()
    }

    /// The stream the memory is ordered on (allocated or freed with one, and
    /// used on no other): work queued there may still use it. `None` for
    /// memory any stream may use now. The legacy default stream is 0.
    pub fn stream(&self) -> Option<RawStream> {
        match self.stream.load(Ordering::Relaxed) {
            NO_STREAM | MANY_STREAMS => None,
            s => Some(s),
        }
    }

    /// Call `f` with what the pointer keeps alive until release, if anything
    /// and if no other thread holds it now (it never waits: a garbage
    /// collector's traversal calls this).
    pub fn inspect_keepalive<R>(&self, f: impl FnOnce(&(dyn Any + Send + Sync)) -> R) -> Option<R> {
        if !self.has_keepalive {
            return None;
        }
        let slot = self.keepalive.try_lock().ok()?;
        slot.as_deref().map(f)
    }

    /// A view of the whole allocation.
    pub fn view_all(self: &Arc<Self>) -> View {
        View::from(self.clone())
    }

    /// Note that the memory is also used on `stream`: it is then released
    /// on the unordered path (reused only after all earlier work on every
    /// stream is done), unless `stream` is the one it was allocated on.
    pub fn record_stream(&self, stream: RawStream) {
        let s = ordering_stream(stream);
        let cur = self.stream.load(Ordering::Relaxed);
        if cur != NO_STREAM && Some(cur) != s {
            self.stream.store(MANY_STREAMS, Ordering::Relaxed);
        }
    }

    /// Whether releasing this memory may wait for the device (a
    /// `cuMemFree`): a pool block's release never does.
    pub fn release_may_block(&self) -> bool {
        !matches!(self.origin, Origin::Pool(_))
    }

    /// Release the memory now. Returns `Ok(true)` if this call freed it and
    /// `Ok(false)` if it was already free (a second free is a no-op). Foreign
    /// memory is never freed; the pointer just lets go of its owner. Memory
    /// of a reset context is not freed either: its address may now belong to
    /// a newer allocation. An operation in flight on another thread keeps
    /// the memory until it ends. Freed memory goes back to the pool, and is
    /// reused once all work queued before now, on every stream, is done.
    pub fn free(&self) -> Result<bool> {
        if crate::fork::forked() {
            return Ok(false);
        }
        // A failed release leaves it live, so a later free or drop retries.
        self.life.free("memory", || self.release())
    }

    /// Release the memory on `stream` (stream-ordered, as `cudaFreeAsync`):
    /// the caller promises every use was queued on `stream` (or recorded
    /// with [`DevicePointer::record_stream`]). Its block is reused at once by
    /// allocations on `stream`, and by others after a fence.
    pub fn free_on(&self, stream: RawStream) -> Result<bool> {
        self.release_on(stream);
        self.free()
    }

    /// Release the memory on `stream` when it is released (freed, or its
    /// last holder lets go), as [`DevicePointer::free_on`] does, without
    /// freeing it now: an owner that lets go while others (a loan, a view)
    /// still hold it.
    pub fn release_on(&self, stream: RawStream) {
        match ordering_stream(stream) {
            Some(s) if self.stream.load(Ordering::Relaxed) != MANY_STREAMS => {
                self.stream.store(s, Ordering::Relaxed)
            }
            _ => self.stream.store(MANY_STREAMS, Ordering::Relaxed),
        }
    }

    /// The pool block this memory is, of size class `class`, as it goes
    /// back to the pool.
    #[inline]
    fn pool_block(&self, class: usize) -> Block {
        Block {
            epoch: self.generation,
            address: self.address,
            class,
            shard: self.pool_shard,
            slot: self.pool_slot,
            size: self.size,
            client: self.client,
        }
    }

    /// Note that an IPC handle of this memory went out (its liveness record
    /// is cleared when it is released).
    pub(crate) fn mark_exported(&self) {
        self.exported.store(true, Ordering::Release);
    }

    /// What names this allocation among a runtime's IPC exports.
    pub(crate) fn export_key(&self) -> crate::ipc::liveness::ExportKey {
        (self.address, self.context.device(), self.generation)
    }

    /// Record where this allocation was made, for the leak report and the
    /// allocation history, if either was on when it was made (`site` is
    /// called only then, once for both).
    #[inline]
    pub fn note_site(&self, site: impl FnOnce() -> Site) {
        if self.observed != 0 {
            self.record_site(site());
        }
    }

    #[cold]
    fn record_site(&self, site: Site) {
        let device = self.context.device();
        let services = self.context.services();
        if self.observed & Watch::HISTORY != 0 {
            let live = Live {
                device,
                size: self.size,
                stream: self.stream().unwrap_or(0),
                client: self.client,
                site: site.clone(),
                own_segment: !matches!(self.origin, Origin::Pool(_)),
            };
            services.history.alloc(self.address, live);
        }
        if self.observed & Watch::TRACK != 0 {
            services
                .tracker
                .record(self.address, device, self.size, self.client, site);
        }
    }

    /// The history hears of the free before the memory can go to another
    /// owner (the pool, or the driver, may hand the address out at once).
    #[cold]
    #[inline(never)]
    fn forget_history(&self) {
        let services = self.context.services();
        let recording = services.watch.on(Watch::HISTORY);
        services.history.free(self.address, recording);
    }

    #[cold]
    #[inline(never)]
    fn forget_site(&self) {
        self.context.services().tracker.forget(self.address);
    }

    /// Release the memory; the caller has claimed the release. In a forked
    /// child this does nothing, wherever it is called from (a free, the
    /// last holder, or the end of a loan, an operation or an export that a
    /// free in the parent left the release to): the memory, its pool block,
    /// its IPC liveness slots and its owner's finalizer are the parent's.
    fn release(&self) -> Result<()> {
        if crate::fork::forked() {
            return Ok(());
        }
        let ctx = &self.context;
        if self.exported.load(Ordering::Acquire) {
            // First, before the memory can be reused: another process that
            // opens a handle of it from now on gets a typed error.
            ctx.services().exports.forget(self.export_key());
        }
        // A stale allocation's history and tracking entries went with the
        // reset; its address may be a newer allocation's now, whose
        // entries stay.
        let stale = self.is_stale();
        if self.observed & Watch::HISTORY != 0 && !stale {
            self.forget_history();
        }
        match self.origin {
            Origin::Driver if self.address != 0 && !stale => {
                // SAFETY: a gpuptr `cuMemAlloc[Managed]` allocation of this
                // live context; the release is claimed once, and no operation
                // is in flight (the lifetime counts them), so nothing uses it.
                unsafe { release::driver(ctx, self.address)? }
            }
            // SAFETY: a mapping `ipc_open_handle` made in this live context;
            // the release is claimed once, and no operation is in flight.
            Origin::Ipc if !stale => unsafe { release::ipc(ctx, self.address)? },
            Origin::Pool(class) if !stale => {
                release::pool(ctx, self.pool_block(class), self.stream())
            }
            // A stale block goes back to no pool; a graph's tag of it goes.
            Origin::Pool(_) => ctx.state().graphs().untag(self.address, self.generation),
            _ => {}
        }
        if let Some(reg) = self.registration {
            ctx.services().registry.remove(reg);
        }
        // A reset already zeroed the counters for stale allocations, and the
        // pool keeps its own.
        if matches!(self.origin, Origin::Driver) && !stale {
            ctx.state().counters().released(self.size, self.client);
        }
        if self.observed & Watch::TRACK != 0 && !stale {
            self.forget_site();
        }
        if self.has_keepalive {
            release_keepalive(&self.keepalive);
        }
        Ok(())
    }
}

impl Drop for DevicePointer {
    fn drop(&mut self) {
        // In a forked child, the parent's memory is not ours to release.
        if crate::fork::forked() {
            return;
        }
        // The last holder: no other thread can free or use it now.
        if self.life.owed() {
            // Deleters never fail; a driver error here has no one to go to.
            let _ = self.release();
        }
    }
}
