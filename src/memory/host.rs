//! Page-locked host memory: allocated by CUDA (`cuMemHostAlloc`, through
//! the device pool's host cache where the device has a pool) or registered
//! in place (`cuMemHostRegister`, never cached), optionally mapped into the
//! device address space.

use std::sync::{Arc, Mutex};

use crate::context::Context;
use crate::driver::{
    DevicePtr, HostPtr, MemoryType, HOST_ALLOC_DEVICEMAP, HOST_ALLOC_PORTABLE,
    HOST_ALLOC_WRITECOMBINED,
};
use crate::error::{Error, Result};
use crate::lifetime::{check_live, release_keepalive, KeepAlive, Lifetime};
use crate::pool::HostBlock;

/// How the host memory came to be pinned.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HostKind {
    /// `cuMemHostAlloc`: gpuptr allocated it and frees it (into the pool's
    /// host cache, where the device has a pool).
    Allocated,
    /// `cuMemHostRegister`: someone else's memory, pinned in place; gpuptr
    /// unregisters it and keeps its owner alive meanwhile.
    Registered,
    /// Memory that is already pinned by someone else (numba's constructor
    /// shapes): gpuptr only keeps the owner alive and never releases it.
    Foreign,
}

/// Options for [`HostMemory::alloc`] and [`HostMemory::register`].
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct HostFlags {
    /// Map into the device address space (a device address is available).
    pub mapped: bool,
    /// Pinned for every context, not just this one.
    pub portable: bool,
    /// Write-combined (fast host writes, slow host reads); allocation only.
    pub write_combined: bool,
    /// The memory is read-only (a `bytes` object): it is exported read-only
    /// and device-side writes into it are refused.
    pub read_only: bool,
}

impl HostFlags {
    fn bits(self) -> u32 {
        let mut bits = 0;
        if self.mapped {
            bits |= HOST_ALLOC_DEVICEMAP;
        }
        if self.portable {
            bits |= HOST_ALLOC_PORTABLE;
        }
        if self.write_combined {
            bits |= HOST_ALLOC_WRITECOMBINED;
        }
        bits
    }
}

/// Pinned host memory, released exactly once (freed or unregistered) when
/// its last holder drops it, or by [`HostMemory::free`] once no buffer
/// export and no operation uses it. Holds its context.
pub struct HostMemory {
    context: Arc<Context>,
    ptr: HostPtr,
    size: usize,
    kind: HostKind,
    mapped: bool,
    readonly: bool,
    /// Its ranges are marked in the runtime's read-only ranges (a read-only
    /// registration), and are unmarked on release.
    marked: bool,
    device_address: Option<DevicePtr>,
    /// The host cache's block this memory is (allocated memory of a pooled
    /// device): its release gives it back there instead of to the driver.
    block: Option<HostBlock>,
    generation: u64,
    life: Lifetime,
    keepalive: Mutex<Option<KeepAlive>>,
    /// The gpuptr host memory a wrap lies in ([`HostMemory::wrap_within`]):
    /// this is live only while that is, and each use and export of this
    /// counts on that too, so its free waits for them or refuses.
    within: Option<Arc<HostMemory>>,
}

impl std::fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMemory")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .field("kind", &self.kind)
            .field("mapped", &self.mapped)
            .field("readonly", &self.readonly)
            .finish()
    }
}

/// An operation (a device view's copy) in flight on host memory.
pub(crate) struct HostUse<'a>(&'a HostMemory);

impl Drop for HostUse<'_> {
    fn drop(&mut self) {
        self.0.end(Lifetime::OP);
    }
}

/// A hold on host memory for as long as a loan of its device side lasts
/// (a DLPack export, [`DevicePointer::lend`](crate::DevicePointer::lend)):
/// its free waits for the hold to go.
#[derive(Debug)]
pub(crate) struct HostHold(Arc<HostMemory>);

impl Drop for HostHold {
    fn drop(&mut self) {
        self.0.end(Lifetime::OP);
    }
}

impl HostMemory {
    fn new(
        context: &Arc<Context>,
        ptr: HostPtr,
        size: usize,
        kind: HostKind,
        flags: HostFlags,
        keepalive: Option<KeepAlive>,
    ) -> Result<Arc<Self>> {
        Self::new_block(context, ptr, None, size, kind, flags, keepalive)
    }

    fn new_block(
        context: &Arc<Context>,
        ptr: HostPtr,
        block: Option<HostBlock>,
        size: usize,
        kind: HostKind,
        flags: HostFlags,
        keepalive: Option<KeepAlive>,
    ) -> Result<Arc<Self>> {
        let mut mem = HostMemory {
            context: context.clone(),
            ptr,
            block,
            size,
            kind,
            mapped: flags.mapped,
            readonly: flags.read_only,
            marked: false,
            device_address: None,
            // The epoch the context was retained in, not the device's
            // epoch now: memory pinned through a context is that context's,
            // and a reset between the pinning and this line (another
            // thread's) must leave it stale, never let its release put an
            // old context's block into the new context's cache.
            generation: context.born(),
            life: Lifetime::default(),
            keepalive: Mutex::new(keepalive),
            within: None,
        };
        if flags.mapped && size != 0 {
            // SAFETY: the context is retained; only the driver's tables are
            // read. On failure `mem` drops here and releases what was pinned.
            mem.device_address =
                Some(unsafe { context.driver().host_device_pointer(context.raw(), ptr) }?);
        }
        if kind == HostKind::Registered && mem.readonly {
            // Every route to these bytes (a wrap of the device address, an
            // import, numba's constructor shapes) now finds them read-only.
            let ranges = &context.services().read_only;
            ranges.mark(ptr as u64, size);
            if let Some(d) = mem.device_address {
                ranges.mark(d, size);
            }
            mem.marked = true;
        }
        Ok(Arc::new(mem))
    }

    /// Allocate `size` bytes of pinned host memory in `context`. Zero bytes
    /// give a null allocation and make no driver call.
    ///
    /// Where the device has a pool, the memory comes from its host cache:
    /// a block of `size`'s class made with the same `mapped`, `portable`
    /// and `write_combined` flags, reused only once all work queued before
    /// its last free, on every stream of the context, is done (the device
    /// pool's fence). Its release gives it back to the cache, which goes
    /// back to the driver at a trim, a reset, or the context's last drop.
    ///
    /// A context that is no longer current (a reset came since it was
    /// retained, before or during this call) is refused with
    /// [`Error::InvalidPointer`]: allocate through the device's new one.
    pub fn alloc(context: &Arc<Context>, size: usize, flags: HostFlags) -> Result<Arc<Self>> {
        crate::fork::check()?;
        Error::check_request(context.device(), size)?;
        if context.born() != context.generation() {
            return Err(Error::InvalidPointer(format!(
                "the context of device {} was reset; pinned memory comes from the new one",
                context.device()
            )));
        }
        let oom = |e: Error| e.oom_on(context.device(), size);
        let (ptr, block) = if size == 0 {
            (0, None)
        } else {
            match context.state().host_alloc(context, size, flags.bits()) {
                Some(r) => r.map(|b| (b.address, Some(b))).map_err(oom)?,
                // SAFETY: the context is retained by `context`.
                None => unsafe {
                    context
                        .driver()
                        .host_alloc(context.raw(), size, flags.bits())
                }
                .map(|p| (p, None))
                .map_err(oom)?,
            }
        };
        let flags = HostFlags {
            read_only: false,
            ..flags
        };
        Self::new_block(context, ptr, block, size, HostKind::Allocated, flags, None)
    }

    /// Whether it is a block of the pool's host cache (its release gives
    /// it back there).
    pub fn is_pooled(&self) -> bool {
        self.block.is_some()
    }

    /// Pin `[ptr, ptr+size)` of existing host memory in place, keeping
    /// `keepalive` (its owner) until it is unregistered.
    ///
    /// # Safety
    /// The range is live host memory that stays allocated, in place, and
    /// (unless `flags.read_only`) writable until the registration is
    /// released; `keepalive` is what keeps it so.
    pub unsafe fn register(
        context: &Arc<Context>,
        ptr: HostPtr,
        size: usize,
        flags: HostFlags,
        keepalive: Option<KeepAlive>,
    ) -> Result<Arc<Self>> {
        crate::fork::check()?;
        if size != 0 {
            if ptr == 0 {
                return Err(Error::InvalidPointer(
                    "cannot register a null host address".into(),
                ));
            }
            ptr.checked_add(size).ok_or_else(|| {
                Error::InvalidPointer(format!("{ptr:#x} + {size} overflows the address space"))
            })?;
            // (Already-pinned memory cannot be registered again: a range
            // that is read-only stays so.)
            let bits = flags.bits() & (HOST_ALLOC_DEVICEMAP | HOST_ALLOC_PORTABLE);
            // SAFETY: the range stays live and in place while registered
            // (this fn's contract); the context is retained.
            unsafe {
                context
                    .driver()
                    .host_register(context.raw(), ptr, size, bits)
            }
            .map_err(|e| match e.cuda_code() {
                Some(crate::error::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) => {
                    Error::InvalidArgument(format!(
                        "[{ptr:#x}, +{size}) overlaps host memory that is already \
                             registered (pinned): register a range once"
                    ))
                }
                _ => e,
            })?;
        }
        Self::new(context, ptr, size, HostKind::Registered, flags, keepalive)
    }

    /// Wrap host memory that is already pinned (and, with `mapped`, mapped)
    /// by someone else. Nothing is released; `keepalive` is kept until drop.
    /// The driver is asked what the range is: it must be page-locked host
    /// memory (mapped into the device when `mapped`), and lie inside one
    /// allocation where the driver reports its extent. It is read-only when
    /// `read_only` (its owner is a read-only object), and when any of its
    /// bytes is host memory registered from a read-only object.
    ///
    /// # Safety
    /// The memory stays pinned and allocated while `keepalive` lives.
    pub unsafe fn wrap(
        context: &Arc<Context>,
        ptr: HostPtr,
        size: usize,
        mapped: bool,
        read_only: bool,
        keepalive: Option<KeepAlive>,
    ) -> Result<Arc<Self>> {
        crate::fork::check()?;
        if size != 0 {
            check_pinned_range(context, ptr, size, mapped)?;
        }
        // Memory someone registered from a read-only object stays read-only
        // through every wrap of any of its bytes.
        let flags = HostFlags {
            mapped,
            read_only: read_only || context.services().read_only.overlaps(ptr as u64, size),
            ..HostFlags::default()
        };
        Self::new(context, ptr, size, HostKind::Foreign, flags, keepalive)
    }

    /// A wrap of `size` bytes at `ptr` inside `within`, gpuptr host memory
    /// (numba's constructor shape with a gpuptr object as owner): read-only
    /// as `within` is, live only while `within` is, and each of
    /// its uses and exports counts on `within` too. Safe: the range is
    /// checked against `within`, which holds the bytes. `Err` if the range
    /// is not inside it or `within` is not live; with `mapped`, the driver
    /// is asked for the device address (with unified addressing every
    /// pinned allocation has one, mapped or not). `keepalive` is released
    /// with the wrap, as [`HostMemory::wrap`]'s.
    pub fn wrap_within(
        within: &Arc<HostMemory>,
        ptr: HostPtr,
        size: usize,
        mapped: bool,
        keepalive: Option<KeepAlive>,
    ) -> Result<Arc<Self>> {
        crate::fork::check()?;
        within.check_live()?;
        let inside = ptr >= within.ptr
            && ptr
                .checked_add(size)
                .is_some_and(|end| end <= within.ptr + within.size);
        if !inside {
            return Err(Error::InvalidPointer(format!(
                "[{ptr:#x}, +{size}) is not inside its owner's pinned memory [{:#x}, +{})",
                within.ptr, within.size
            )));
        }
        let flags = HostFlags {
            mapped,
            read_only: within.readonly,
            ..HostFlags::default()
        };
        let mut mem = Self::new(
            &within.context,
            ptr,
            size,
            HostKind::Foreign,
            flags,
            keepalive,
        )?;
        Arc::get_mut(&mut mem).expect("made just now").within = Some(within.clone());
        Ok(mem)
    }

    /// Whether gpuptr pinned it (allocated or registered), or it is a wrap
    /// that lies in such memory ([`HostMemory::wrap_within`]): memory whose
    /// free gpuptr sees, which a wrap can follow.
    pub fn is_gpuptrs(&self) -> bool {
        self.kind != HostKind::Foreign || self.within.is_some()
    }

    /// The host address.
    pub fn host_ptr(&self) -> HostPtr {
        self.ptr
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Allocated or registered.
    pub fn kind(&self) -> HostKind {
        self.kind
    }

    /// Whether it is read-only: registered from a read-only object, or a
    /// wrap of bytes that such a registration pinned.
    pub fn is_readonly(&self) -> bool {
        self.readonly
    }

    /// The context it belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// Whether it is mapped into the device address space.
    pub(crate) fn is_mapped(&self) -> bool {
        self.mapped
    }

    /// The device address of mapped memory.
    pub fn device_address(&self) -> Option<DevicePtr> {
        self.device_address
    }

    /// Whether it was released.
    pub fn is_freed(&self) -> bool {
        self.life.is_freed()
    }

    /// `Ok` while the memory may be used.
    pub fn check_live(&self) -> Result<()> {
        let stale = self.generation != self.context.generation();
        check_live("host memory", self.ptr as u64, self.is_freed(), stale)?;
        self.within.as_ref().map_or(Ok(()), |w| w.check_live())
    }

    pub(crate) fn begin_use(&self) -> Result<HostUse<'_>> {
        self.begin(Lifetime::OP)?;
        Ok(HostUse(self))
    }

    /// Hold the memory until the [`HostHold`] drops (a loan of its device
    /// side). `Err` if it is not live.
    pub(crate) fn hold(self: &Arc<Self>) -> Result<HostHold> {
        self.begin(Lifetime::OP)?;
        Ok(HostHold(self.clone()))
    }

    /// Count `unit` (an operation or an export) here and on the memory
    /// this lies in, if any.
    fn begin(&self, unit: u64) -> Result<()> {
        self.check_live()?;
        if let Some(w) = &self.within {
            w.begin(unit)?;
        }
        let live = self.life.begin(unit, || self.release());
        if !live {
            if let Some(w) = &self.within {
                w.end(unit);
            }
        }
        check_live("host memory", self.ptr as u64, !live, false)
    }

    /// End what [`HostMemory::begin`] counted.
    fn end(&self, unit: u64) {
        self.life.end(unit, || self.release());
        if let Some(w) = &self.within {
            w.end(unit);
        }
    }

    /// Count a buffer export of the bytes: [`HostMemory::free`] refuses
    /// while any is alive. `Err` if the memory is not live.
    pub fn begin_export(&self) -> Result<()> {
        self.begin(Lifetime::EXPORT)
    }

    /// End an export counted by [`HostMemory::begin_export`].
    pub fn end_export(&self) {
        self.end(Lifetime::EXPORT);
    }

    /// Release now (free or unregister). `Ok(false)` if already released.
    /// While buffer exports of it are alive this is
    /// [`Error::BufferExported`]; a device operation in flight defers the
    /// release to its end.
    pub fn free(&self) -> Result<bool> {
        if crate::fork::forked() {
            return Ok(false);
        }
        self.life.free("host memory", || self.release())
    }

    /// Free or unregister; the caller has claimed the release. In a forked
    /// child this does nothing, wherever it is called from (see
    /// [`DevicePointer`](crate::DevicePointer)'s release).
    fn release(&self) -> Result<()> {
        if crate::fork::forked() {
            return Ok(());
        }
        if self.size != 0 && self.generation == self.context.generation() {
            let drv = self.context.driver();
            let raw = self.context.raw();
            // SAFETY: ours to release, claimed once; no export or operation
            // uses it (the lifetime counts them).
            unsafe {
                match (self.kind, self.block) {
                    // Back to the cache, where it waits for the fence.
                    (HostKind::Allocated, Some(b)) => self.context.state().host_release(
                        &self.context,
                        self.generation,
                        b,
                        self.size,
                    ),
                    (HostKind::Allocated, None) => drv.host_free(raw, self.ptr)?,
                    (HostKind::Registered, _) => drv.host_unregister(raw, self.ptr)?,
                    (HostKind::Foreign, _) => {}
                }
            }
        }
        // Only once it is unregistered: until then a wrap of its bytes is
        // still refused writes (a failed unregister leaves it marked).
        if self.marked {
            let ranges = &self.context.services().read_only;
            ranges.unmark(self.ptr as u64, self.size);
            if let Some(d) = self.device_address {
                ranges.unmark(d, self.size);
            }
        }
        release_keepalive(&self.keepalive);
        Ok(())
    }
}

/// `Ok` if `[ptr, ptr+size)` is page-locked host memory (mapped into the
/// device when `mapped`) inside one allocation, as far as the driver says.
fn check_pinned_range(context: &Context, ptr: HostPtr, size: usize, mapped: bool) -> Result<()> {
    if ptr == 0 {
        return Err(Error::InvalidPointer(format!(
            "null host address with a size of {size} bytes"
        )));
    }
    let end = (ptr as u64).checked_add(size as u64).ok_or_else(|| {
        Error::InvalidPointer(format!("{ptr:#x} + {size} overflows the address space"))
    })?;
    let a = context.driver().pointer_attributes(ptr as DevicePtr)?;
    if a.memory_type != MemoryType::Host {
        return Err(Error::InvalidPointer(format!(
            "{ptr:#x} is not page-locked host memory"
        )));
    }
    if mapped && !a.device_accessible {
        return Err(Error::InvalidPointer(format!(
            "{ptr:#x} is not mapped into the device"
        )));
    }
    if a.range_size != 0 && end > a.range_start + a.range_size as u64 {
        return Err(Error::InvalidPointer(format!(
            "[{ptr:#x}, {end:#x}) runs past its allocation of {} bytes",
            a.range_size
        )));
    }
    Ok(())
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        if crate::fork::forked() {
            return;
        }
        if self.life.owed() {
            let _ = self.release();
        }
    }
}
