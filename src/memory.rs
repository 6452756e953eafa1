//! Device memory: [`DevicePointer`], the owning allocation, and [`View`], a
//! sub-range that keeps its allocation (and so the context) alive.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::context::Context;
use crate::driver::{DevicePtr, MemoryType, RawStream, STREAM_LEGACY, STREAM_PER_THREAD};
use crate::error::{Error, Result};
use crate::host::HostMemory;
use crate::registry::Registration;
use crate::track::Site;

/// Anything a pointer must keep alive until its memory is released (a
/// foreign owner, a finalizer object). Dropped when the pointer is freed.
pub type KeepAlive = Box<dyn Any + Send + Sync>;

/// Drop whatever `slot` keeps alive (outside the lock: a finalizer may run).
pub(crate) fn release_keepalive(slot: &Mutex<Option<KeepAlive>>) {
    let keep = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
    drop(keep);
}

/// `Ok` for usable memory; else why `what` at `address` is not: freed, or
/// made in a context that was reset since (`stale`).
pub(crate) fn check_live(what: &str, address: u64, freed: bool, stale: bool) -> Result<()> {
    crate::fork::check()?;
    if freed {
        Err(Error::InvalidPointer(format!(
            "{what} at {address:#x} was freed"
        )))
    } else if stale {
        Err(Error::InvalidPointer(format!(
            "{what} at {address:#x} belongs to a context that was reset"
        )))
    } else {
        Ok(())
    }
}

/// The lifetime of a piece of memory, in one atomic word: whether a free
/// was asked for, whether the release was claimed, and how many operations
/// and buffer exports use it now. A free waits for neither: it refuses while
/// exports are alive (a `BufferError`, as `mmap.close()` does), and it
/// leaves the release to the last operation in flight when there is one. So
/// no copy that passed its liveness check ever writes into memory that was
/// released, or reused, under it.
#[derive(Debug, Default)]
pub(crate) struct Lifetime(AtomicU64);

const FREED: u64 = 1 << 63;
const RELEASED: u64 = 1 << 62;
const EXPORT: u64 = 1 << 32;
const EXPORTS: u64 = ((1 << 30) - 1) << 32;
const OPS: u64 = (1 << 32) - 1;

impl Lifetime {
    #[inline]
    pub(crate) fn is_freed(&self) -> bool {
        self.0.load(Ordering::Acquire) & FREED != 0
    }

    /// Ask for a free. `release` runs now, or is left to the last operation
    /// in flight (`Ok(true)` either way); `Ok(false)` if already freed, and
    /// `Err` while buffer exports are alive or if `release` failed (the
    /// memory then stays live, for a later retry).
    pub(crate) fn free(&self, what: &str, release: impl FnOnce() -> Result<()>) -> Result<bool> {
        let mut s = self.0.load(Ordering::Acquire);
        loop {
            if s & FREED != 0 {
                return Ok(false);
            }
            if s & EXPORTS != 0 {
                return Err(Error::BufferExported(format!(
                    "{what} cannot be freed while {} buffer export(s) of it are alive \
(release the numpy arrays or memoryviews first)",
                    (s & EXPORTS) >> 32
                )));
            }
            match self
                .0
                .compare_exchange_weak(s, s | FREED, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if s & OPS == 0 && self.claim() => return self.run(release).map(|()| true),
                Ok(_) if s & OPS == 0 => return Ok(false),
                Ok(_) => return Ok(true),
                Err(now) => s = now,
            }
        }
    }

    /// Claim the release; `true` for exactly one caller.
    fn claim(&self) -> bool {
        self.0.fetch_or(RELEASED, Ordering::AcqRel) & RELEASED == 0
    }

    /// Run a claimed release; if it fails, the memory is live again (a
    /// later free or the deleter retries).
    fn run(&self, release: impl FnOnce() -> Result<()>) -> Result<()> {
        release().inspect_err(|_| {
            self.0.fetch_and(!(FREED | RELEASED), Ordering::AcqRel);
        })
    }

    /// Start a use (`unit` is one op, [`Lifetime::OP`], or one export,
    /// [`Lifetime::EXPORT`]). `false` if freed; a free that saw this
    /// transient use left the release to it, so `release` may run here.
    #[inline]
    pub(crate) fn begin(&self, unit: u64, release: impl FnOnce() -> Result<()>) -> bool {
        let prev = self.0.fetch_add(unit, Ordering::Acquire);
        if prev & FREED != 0 {
            self.end(unit, release);
            return false;
        }
        true
    }

    /// One operation.
    pub(crate) const OP: u64 = 1;
    /// One buffer export.
    pub(crate) const EXPORT: u64 = EXPORT;

    /// End a use; the last use after a deferred free runs `release` (a
    /// deleter has no one to report a failure to).
    #[inline]
    pub(crate) fn end(&self, unit: u64, release: impl FnOnce() -> Result<()>) {
        let prev = self.0.fetch_sub(unit, Ordering::AcqRel);
        let after = prev - unit;
        if after & FREED != 0 && after & (OPS | EXPORTS) == 0 && self.claim() {
            let _ = self.run(release);
        }
    }

    /// Whether the release is still owed (for a deleter).
    pub(crate) fn owed(&mut self) -> bool {
        *self.0.get_mut() & RELEASED == 0
    }
}

/// Memory lent to a consumer outside gpuptr ([`DevicePointer::lend`]): it
/// holds the allocation, and the release of a free asked for meanwhile runs
/// when the last loan or operation ends. Dropping it never blocks on Python.
#[derive(Debug)]
pub struct Loan(Arc<DevicePointer>);

impl Loan {
    /// The memory lent.
    pub fn pointer(&self) -> &Arc<DevicePointer> {
        &self.0
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        let p = &self.0;
        p.life.end(Lifetime::OP, || p.release());
    }
}

/// Which library asked for an allocation, for per-client statistics.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Client {
    /// gpuptr's own API (Python `gpuptr.alloc`, Rust `Context::alloc`).
    #[default]
    Direct = 0,
    /// numba, through the `gpuptr.numba` memory manager.
    Numba = 1,
    /// CuPy, through `gpuptr.cupy`.
    Cupy = 2,
    /// PyTorch, through `gpuptr.torch`.
    Torch = 3,
}

impl Client {
    /// Every client, in index order.
    pub const ALL: [Client; 4] = [Client::Direct, Client::Numba, Client::Cupy, Client::Torch];

    /// Its name: `"direct"`, `"numba"`, `"cupy"` or `"torch"`.
    pub fn name(self) -> &'static str {
        match self {
            Client::Direct => "direct",
            Client::Numba => "numba",
            Client::Cupy => "cupy",
            Client::Torch => "torch",
        }
    }

    /// The client of that name.
    pub fn from_name(name: &str) -> Option<Client> {
        Client::ALL.into_iter().find(|c| c.name() == name)
    }

    pub(crate) fn index(self) -> usize {
        self as usize
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
    /// Noted by the leak report (forgotten on release).
    tracked: bool,
    /// Shared with another process (its IPC liveness slots are cleared on
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
    _host: Option<crate::host::HostUse<'a>>,
}

impl Drop for InUse<'_> {
    fn drop(&mut self) {
        // The last operation after a deferred free releases.
        self.ptr.life.end(Lifetime::OP, || self.ptr.release());
    }
}

impl DevicePointer {
    /// Allocate `size` bytes in `context`, for an owner on `stream` (`None`:
    /// any stream). Zero bytes give a null pointer and make no driver call.
    pub(crate) fn alloc(
        context: &Arc<Context>,
        size: usize,
        stream: Option<RawStream>,
        client: Client,
    ) -> Result<Arc<Self>> {
        crate::fork::check()?;
        let state = context.state();
        if !state.pooled() || size == 0 {
            return DevicePointer::alloc_driver(context, size, client);
        }
        let stream = stream.and_then(ordering_stream);
        let block = state.pool_alloc(context, size, stream, client)?;
        let p = DevicePointer::counted(
            context,
            block.address,
            size,
            Origin::Pool(block.class),
            false,
            None,
            block.shard,
            client,
        );
        if let Some(s) = stream {
            p.stream.store(s, Ordering::Relaxed);
        }
        Ok(p)
    }

    /// Allocate `size` bytes straight from the driver (`cuMemAlloc`),
    /// bypassing the pool.
    #[track_caller]
    pub fn alloc_uncached(context: &Arc<Context>, size: usize) -> Result<Arc<Self>> {
        let at = std::panic::Location::caller();
        let p = DevicePointer::alloc_driver(context, size, Client::Direct)?;
        p.note_site(|| Site::Rust(at));
        Ok(p)
    }

    /// `size` bytes from `cuMemAlloc` for `client`, registered and counted.
    fn alloc_driver(context: &Arc<Context>, size: usize, client: Client) -> Result<Arc<Self>> {
        DevicePointer::alloc_with(
            context,
            size,
            // SAFETY: `ctx.raw()` is retained by the Context.
            |ctx| unsafe { ctx.driver().mem_alloc(ctx.raw(), size) },
            false,
            client,
        )
    }

    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn counted(
        context: &Arc<Context>,
        address: DevicePtr,
        size: usize,
        origin: Origin,
        managed: bool,
        registration: Option<Registration>,
        pool_shard: u32,
        client: Client,
    ) -> Arc<Self> {
        // The pool counts its own allocations under its shard lock.
        if !matches!(origin, Origin::Pool(_)) {
            context.state().counters().allocated(size, client);
        }
        let mut p = DevicePointer::base(context.clone(), address, size, origin);
        p.managed = managed;
        p.registration = registration;
        p.pool_shard = pool_shard as u16;
        p.client = client;
        // Noted by the leak report once the caller gives the site
        // ([`DevicePointer::note_site`]): one load here while it is off.
        p.tracked = address != 0 && context.runtime().tracker().enabled();
        Arc::new(p)
    }

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
            life: Lifetime::default(),
            stream: AtomicUsize::new(NO_STREAM),
            host: None,
            has_keepalive: false,
            keepalive: Mutex::new(None),
            client: Client::Direct,
            tracked: false,
            exported: AtomicBool::new(false),
        }
    }

    /// Allocate with `allocate` (a driver call freed by `cuMemFree`), then
    /// register and count the allocation.
    pub(crate) fn alloc_with(
        context: &Arc<Context>,
        size: usize,
        allocate: impl FnOnce(&Context) -> Result<DevicePtr>,
        managed: bool,
        client: Client,
    ) -> Result<Arc<Self>> {
        crate::fork::check()?;
        let device = context.device();
        let (address, registration) = if size == 0 {
            (0, None)
        } else {
            let address = allocate(context).map_err(|e| e.oom_on(device, size))?;
            let reg = context.runtime().registry().insert(address, size, context);
            (address, Some(reg))
        };
        Ok(DevicePointer::counted(
            context,
            address,
            size,
            Origin::Driver,
            managed,
            registration,
            0,
            client,
        ))
    }

    /// Wrap memory someone else owns. `registration` is the registry entry
    /// the wrap holds (if it added one); `keepalive` is kept until release.
    pub(crate) fn foreign(
        context: Arc<Context>,
        address: DevicePtr,
        size: usize,
        registration: Option<Registration>,
        keepalive: Option<KeepAlive>,
    ) -> Arc<Self> {
        let mut p = DevicePointer::base(context, address, size, Origin::Foreign);
        p.registration = registration;
        p.has_keepalive = keepalive.is_some();
        p.keepalive = Mutex::new(keepalive);
        Arc::new(p)
    }

    /// The mapping of another process's allocation at `address`, `size`
    /// bytes, made by opening an IPC handle: registered, so its context
    /// resolves by address, and unmapped on release.
    pub(crate) fn ipc_mapping(
        context: &Arc<Context>,
        address: DevicePtr,
        size: usize,
    ) -> Arc<Self> {
        let reg = context.runtime().registry().insert(address, size, context);
        let mut p = DevicePointer::base(context.clone(), address, size, Origin::Ipc);
        p.registration = Some(reg);
        Arc::new(p)
    }

    /// The device view of mapped host memory: its operations hold `host`,
    /// and it is read-only when `host` is.
    pub(crate) fn over_host(
        context: Arc<Context>,
        address: DevicePtr,
        host: Arc<HostMemory>,
    ) -> Arc<Self> {
        let mut p = DevicePointer::base(context, address, host.size(), Origin::Foreign);
        p.readonly = host.is_readonly();
        p.host = Some(host);
        Arc::new(p)
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

    /// Whether writes through it are refused (a device view of read-only
    /// host memory).
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

    /// `Ok` if the memory may be used now, else [`Error::InvalidPointer`].
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
        self.begin(Lifetime::OP)?;
        Ok(Loan(self.clone()))
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
        match ordering_stream(stream) {
            Some(s) if self.stream.load(Ordering::Relaxed) != MANY_STREAMS => {
                self.stream.store(s, Ordering::Relaxed)
            }
            _ => self.stream.store(MANY_STREAMS, Ordering::Relaxed),
        }
        self.free()
    }

    /// Note that an IPC handle of this memory went out (its liveness slots
    /// are cleared when it is released).
    pub(crate) fn mark_exported(&self) {
        self.exported.store(true, Ordering::Release);
    }

    /// Record where this allocation was made, for the leak report, if
    /// tracking was on when it was made (`site` is called only then).
    #[inline]
    pub fn note_site(&self, site: impl FnOnce() -> Site) {
        if self.tracked {
            self.record_site(site());
        }
    }

    #[cold]
    fn record_site(&self, site: Site) {
        let device = self.context.device();
        self.context
            .runtime()
            .tracker()
            .record(self.address, device, self.size, self.client, site);
    }

    #[cold]
    #[inline(never)]
    fn forget_site(&self) {
        self.context.runtime().tracker().forget(self.address);
    }

    /// Release the memory; the caller has claimed the release.
    fn release(&self) -> Result<()> {
        if self.exported.load(Ordering::Acquire) {
            // First, before the memory can be reused: another process that
            // opens a handle of it from now on gets a typed error.
            self.context.runtime().ipc().forget_exports(self.address);
        }
        let stale = self.is_stale();
        match self.origin {
            Origin::Driver if self.address != 0 && !stale => {
                // SAFETY: a gpuptr `cuMemAlloc[Managed]` allocation of this
                // live context; the release is claimed once, and no operation
                // is in flight (the lifetime counts them), so nothing uses it.
                unsafe {
                    self.context
                        .driver()
                        .mem_free(self.context.raw(), self.address)?
                }
            }
            Origin::Ipc if !stale => {
                // SAFETY: a mapping this pointer's `ipc_open_handle` made in
                // its live context; the release is claimed once, and no
                // operation is in flight.
                unsafe {
                    self.context
                        .driver()
                        .ipc_close_handle(self.context.raw(), self.address)?
                }
            }
            Origin::Pool(class) if !stale => {
                let block = crate::pool::Block {
                    address: self.address,
                    class,
                    shard: u32::from(self.pool_shard),
                    new_allocation: None,
                    ahead: false,
                };
                let stream = self.stream();
                self.context.state().pool_release(
                    &self.context,
                    self.generation,
                    block,
                    self.size,
                    stream,
                    self.client,
                );
            }
            _ => {}
        }
        if let Some(reg) = self.registration {
            self.context.runtime().registry().remove(reg);
        }
        // A reset already zeroed the counters for stale allocations, and the
        // pool keeps its own.
        if matches!(self.origin, Origin::Driver) && !stale {
            self.context
                .state()
                .counters()
                .released(self.size, self.client);
        }
        if self.tracked {
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

/// A byte range `[offset, offset+size)` of an allocation. Holding a view
/// keeps the allocation, and through it the context, alive.
#[derive(Clone, Debug)]
pub struct View {
    parent: Arc<DevicePointer>,
    offset: usize,
    size: usize,
}

impl From<Arc<DevicePointer>> for View {
    /// A view of the whole allocation, taking over the caller's reference.
    fn from(parent: Arc<DevicePointer>) -> Self {
        let size = parent.size;
        View {
            parent,
            offset: 0,
            size,
        }
    }
}

/// After a host copy queued on `stream`: the driver stages pageable memory
/// before it returns, but reads or writes page-locked memory later, so for
/// that, wait for the stream. Either way the caller may reuse the buffer.
///
/// # Safety
/// `stream` is `None`, a default-stream handle or a live stream of `ctx`.
unsafe fn settle_host_copy(ctx: &Context, host: usize, stream: Option<RawStream>) -> Result<()> {
    let Some(s) = stream else { return Ok(()) };
    let pinned = ctx
        .driver()
        .pointer_attributes(host as DevicePtr)
        .is_ok_and(|a| a.memory_type == MemoryType::Host);
    if pinned {
        // SAFETY: the stream is this fn's contract; the context is retained.
        unsafe { ctx.driver().stream_synchronize(ctx.raw(), s)? };
    }
    Ok(())
}

impl View {
    /// The allocation this view is part of.
    #[inline]
    pub fn parent(&self) -> &Arc<DevicePointer> {
        &self.parent
    }

    /// The context the memory lives in.
    #[inline]
    pub fn context(&self) -> &Arc<Context> {
        self.parent.context()
    }

    /// The start address of the view (0 for a null pointer).
    #[inline]
    pub fn address(&self) -> DevicePtr {
        if self.parent.address == 0 {
            0
        } else {
            self.parent.address + self.offset as u64
        }
    }

    /// Offset from the start of the allocation.
    #[inline]
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Size of the view in bytes.
    #[inline]
    pub fn size(&self) -> usize {
        self.size
    }

    /// The sub-view `[start, stop)` of this view (`stop` defaults to the
    /// end). Reversed bounds, and non-empty ranges past the end, are
    /// [`Error::InvalidPointer`]. An empty view may start past the end, as
    /// numba's own `view` allows (its slicing asks for such views); it
    /// covers no byte, so nothing can reach memory through it.
    pub fn view(&self, start: usize, stop: Option<usize>) -> Result<View> {
        let stop = stop.unwrap_or(self.size);
        let empty = start == stop;
        if start > stop || (stop > self.size && !empty) {
            return Err(Error::InvalidPointer(format!(
                "view [{start}, {stop}) is out of range for {} bytes",
                self.size
            )));
        }
        // An empty view may lie past the end: keep its address arithmetic
        // from overflowing.
        let offset = self
            .offset
            .checked_add(start)
            .filter(|o| self.parent.address.checked_add(*o as u64).is_some())
            .ok_or_else(|| {
                Error::InvalidPointer(format!("view offset {start} overflows the address space"))
            })?;
        Ok(View {
            parent: self.parent.clone(),
            offset,
            size: stop - start,
        })
    }

    /// Hold the allocation for an operation on `count` bytes; checks that
    /// it is live, that `count` fits, and (for `write`) that it is writable.
    fn hold(&self, what: &str, count: usize, write: bool) -> Result<InUse<'_>> {
        let guard = self.parent.begin_use()?;
        if count > self.size {
            return Err(Error::InvalidPointer(format!(
                "{what} of {count} bytes exceeds the {} bytes at {:#x}",
                self.size,
                self.address()
            )));
        }
        if write && self.parent.readonly {
            return Err(Error::InvalidArgument(format!(
                "{what} into read-only memory at {:#x}",
                self.address()
            )));
        }
        Ok(guard)
    }

    /// Set `count` bytes (default: all) to `value`, synchronously.
    pub fn memset(&self, value: u8, count: Option<usize>) -> Result<()> {
        // SAFETY: no stream: nothing to trust.
        unsafe { self.memset_on(value, count, None) }
    }

    /// Set `count` bytes (default: all) to `value`, queued on `stream`.
    ///
    /// # Safety
    /// `stream` is `None`, a default-stream handle (0, 1, 2) or a live
    /// stream of this view's context.
    pub unsafe fn memset_on(
        &self,
        value: u8,
        count: Option<usize>,
        stream: Option<RawStream>,
    ) -> Result<()> {
        let count = count.unwrap_or(self.size);
        let _held = self.hold("memset", count, true)?;
        if count == 0 {
            return Ok(());
        }
        let ctx = self.context();
        // SAFETY: the range is live device memory of `ctx` (held and
        // bound-checked above); the stream is the caller's contract.
        unsafe {
            ctx.driver()
                .memset_d8(ctx.raw(), self.address(), value, count, stream)
        }
    }

    /// Copy `src` to the start of the view.
    pub fn copy_from_host(&self, src: &[u8]) -> Result<()> {
        // SAFETY: `src` is a live slice of `src.len()` bytes; no stream.
        unsafe { self.copy_from_host_raw(src.as_ptr(), src.len(), None) }
    }

    /// Copy `len` bytes at host address `src` to the start of the view, on
    /// `stream` if given. It returns once `src` may be reused.
    ///
    /// # Safety
    /// `src` is readable for `len` bytes until the call returns (it may
    /// overlap the view: mapped memory); `stream` as in [`View::memset_on`].
    pub unsafe fn copy_from_host_raw(
        &self,
        src: *const u8,
        len: usize,
        stream: Option<RawStream>,
    ) -> Result<()> {
        let _held = self.hold("copy", len, true)?;
        if len == 0 {
            return Ok(());
        }
        let ctx = self.context();
        // SAFETY: destination held and bound-checked; `src` and the stream
        // are the caller's contract.
        unsafe {
            ctx.driver()
                .memcpy_htod(ctx.raw(), self.address(), src, len, stream)?
        };
        // SAFETY: the stream is the caller's contract.
        unsafe { settle_host_copy(ctx, src as usize, stream) }
    }

    /// Copy the start of the view into `dst`.
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        // SAFETY: `dst` is a live, exclusive slice; no stream.
        unsafe { self.copy_to_host_raw(dst.as_mut_ptr(), dst.len(), None) }
    }

    /// Copy the start of the view into `len` bytes at host address `dst`, on
    /// `stream` if given. It returns once the bytes are in `dst`.
    ///
    /// # Safety
    /// `dst` is writable for `len` bytes until the call returns; `stream`
    /// as in [`View::memset_on`].
    pub unsafe fn copy_to_host_raw(
        &self,
        dst: *mut u8,
        len: usize,
        stream: Option<RawStream>,
    ) -> Result<()> {
        let _held = self.hold("copy", len, false)?;
        if len == 0 {
            return Ok(());
        }
        let ctx = self.context();
        // SAFETY: source held and bound-checked; `dst` and the stream are
        // the caller's contract.
        unsafe {
            ctx.driver()
                .memcpy_dtoh(ctx.raw(), dst, self.address(), len, stream)?
        };
        // SAFETY: the stream is the caller's contract.
        unsafe { settle_host_copy(ctx, dst as usize, stream) }
    }

    /// Copy `count` bytes (default: all of `src`) from `src` to this view.
    pub fn copy_from_device(&self, src: &View, count: Option<usize>) -> Result<()> {
        // SAFETY: no stream.
        unsafe { self.copy_from_device_on(src, count, None) }
    }

    /// Copy `count` bytes (default: all of `src`) from `src`, on `stream`.
    ///
    /// # Safety
    /// `stream` as in [`View::memset_on`].
    pub unsafe fn copy_from_device_on(
        &self,
        src: &View,
        count: Option<usize>,
        stream: Option<RawStream>,
    ) -> Result<()> {
        let count = count.unwrap_or(src.size);
        let _src = src.hold("copy", count, false)?;
        let _dst = self.hold("copy", count, true)?;
        if count == 0 {
            return Ok(());
        }
        let ctx = self.context();
        // SAFETY: both ranges held and bound-checked; the stream is the
        // caller's contract.
        unsafe {
            ctx.driver()
                .memcpy_dtod(ctx.raw(), self.address(), src.address(), count, stream)
        }
    }

    /// The whole view as a `Vec` (a convenience for tests and tools). The
    /// memory is checked first, and the `Vec` allocated fallibly: a size
    /// larger than the host can give is [`Error::HostOutOfMemory`].
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let _held = self.hold("copy", self.size, false)?;
        let mut v = Vec::new();
        v.try_reserve_exact(self.size)
            .map_err(|_| Error::HostOutOfMemory(self.size))?;
        // SAFETY: the Vec has `size` bytes of capacity, written in full by
        // the copy before `set_len` exposes them.
        unsafe {
            self.copy_to_host_raw(v.as_mut_ptr(), self.size, None)?;
            v.set_len(self.size);
        }
        Ok(v)
    }
}
