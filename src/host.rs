//! Page-locked host memory: allocated by CUDA (`cuMemHostAlloc`) or
//! registered in place (`cuMemHostRegister`), optionally mapped into the
//! device address space.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::context::Context;
use crate::driver::{
    DevicePtr, HostPtr, HOST_ALLOC_DEVICEMAP, HOST_ALLOC_PORTABLE, HOST_ALLOC_WRITECOMBINED,
};
use crate::error::{Error, Result};
use crate::memory::{check_live, release_keepalive, DevicePointer, KeepAlive, View};

/// How the host memory came to be pinned.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HostKind {
    /// `cuMemHostAlloc`: gpuptr allocated it and frees it.
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
}

impl HostFlags {
    fn bits(self) -> u32 {
        (if self.mapped { HOST_ALLOC_DEVICEMAP } else { 0 })
            | (if self.portable {
                HOST_ALLOC_PORTABLE
            } else {
                0
            })
            | (if self.write_combined {
                HOST_ALLOC_WRITECOMBINED
            } else {
                0
            })
    }
}

/// Pinned host memory, released exactly once (freed or unregistered) when
/// its last holder drops it. Holds its context.
pub struct HostMemory {
    context: Arc<Context>,
    ptr: HostPtr,
    size: usize,
    kind: HostKind,
    flags: HostFlags,
    device_address: Option<DevicePtr>,
    generation: u64,
    freed: AtomicBool,
    keepalive: Mutex<Option<KeepAlive>>,
}

impl std::fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMemory")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .field("kind", &self.kind)
            .field("flags", &self.flags)
            .finish()
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
        let mem = Arc::new(HostMemory {
            context: context.clone(),
            ptr,
            size,
            kind,
            flags,
            device_address: None,
            generation: context.generation(),
            freed: AtomicBool::new(false),
            keepalive: Mutex::new(keepalive),
        });
        if !flags.mapped || size == 0 {
            return Ok(mem);
        }
        // On failure `mem` drops here and releases what was pinned.
        let d = context.driver().host_device_pointer(context.raw(), ptr)?;
        let mut mem = mem;
        Arc::get_mut(&mut mem)
            .expect("not shared yet")
            .device_address = Some(d);
        Ok(mem)
    }

    /// Allocate `size` bytes of pinned host memory in `context`. Zero bytes
    /// give a null allocation and make no driver call.
    pub fn alloc(context: &Arc<Context>, size: usize, flags: HostFlags) -> Result<Arc<Self>> {
        let ptr = if size == 0 {
            0
        } else {
            context
                .driver()
                .host_alloc(context.raw(), size, flags.bits())
                .map_err(|e| e.oom_on(context.device(), size))?
        };
        Self::new(context, ptr, size, HostKind::Allocated, flags, None)
    }

    /// Pin `[ptr, ptr+size)` of existing host memory in place, keeping
    /// `keepalive` (its owner) until it is unregistered.
    pub fn register(
        context: &Arc<Context>,
        ptr: HostPtr,
        size: usize,
        flags: HostFlags,
        keepalive: Option<KeepAlive>,
    ) -> Result<Arc<Self>> {
        if size != 0 {
            if ptr == 0 {
                return Err(Error::InvalidPointer(
                    "cannot register a null host address".into(),
                ));
            }
            let bits = flags.bits() & (HOST_ALLOC_DEVICEMAP | HOST_ALLOC_PORTABLE);
            context
                .driver()
                .host_register(context.raw(), ptr, size, bits)?;
        }
        Self::new(context, ptr, size, HostKind::Registered, flags, keepalive)
    }

    /// Wrap host memory that is already pinned (and, with `mapped`, mapped)
    /// by someone else. Nothing is released; `keepalive` is kept until drop.
    pub fn wrap(
        context: &Arc<Context>,
        ptr: HostPtr,
        size: usize,
        mapped: bool,
        keepalive: Option<KeepAlive>,
    ) -> Result<Arc<Self>> {
        let flags = HostFlags {
            mapped,
            ..HostFlags::default()
        };
        Self::new(context, ptr, size, HostKind::Foreign, flags, keepalive)
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

    /// The flags it was made with.
    pub fn flags(&self) -> HostFlags {
        self.flags
    }

    /// The context it belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// The device address of mapped memory.
    pub fn device_address(&self) -> Option<DevicePtr> {
        self.device_address
    }

    /// Whether it was released.
    pub fn is_freed(&self) -> bool {
        self.freed.load(Ordering::Acquire)
    }

    /// `Ok` while the memory may be used.
    pub fn check_live(&self) -> Result<()> {
        let stale = self.generation != self.context.generation();
        check_live("host memory", self.ptr as u64, self.is_freed(), stale)
    }

    /// A device view of mapped memory; it keeps this host memory alive.
    pub fn device_view(self: &Arc<Self>) -> Result<View> {
        let d = self.device_address.ok_or_else(|| {
            Error::InvalidPointer("host memory is not mapped into the device".into())
        })?;
        let keep: KeepAlive = Box::new(self.clone());
        let ctx = self.context.clone();
        Ok(ctx
            .runtime()
            .wrap(d, self.size, Some(ctx.clone()), Some(keep))?
            .view_all())
    }

    /// Release now (free or unregister). `Ok(false)` if already released.
    pub fn free(&self) -> Result<bool> {
        if self.freed.swap(true, Ordering::AcqRel) {
            return Ok(false);
        }
        if self.size != 0 && self.generation == self.context.generation() {
            let drv = self.context.driver();
            let r = match self.kind {
                HostKind::Allocated => drv.host_free(self.context.raw(), self.ptr),
                HostKind::Registered => drv.host_unregister(self.context.raw(), self.ptr),
                HostKind::Foreign => Ok(()),
            };
            if let Err(e) = r {
                self.freed.store(false, Ordering::Release);
                return Err(e);
            }
        }
        release_keepalive(&self.keepalive);
        Ok(true)
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        let _ = self.free();
    }
}

impl DevicePointer {
    /// Allocate `size` bytes of managed (unified) memory in `context`,
    /// attached globally or to the host.
    pub fn alloc_managed(
        context: &Arc<Context>,
        size: usize,
        attach_global: bool,
    ) -> Result<Arc<Self>> {
        let flags = if attach_global {
            crate::driver::MEM_ATTACH_GLOBAL
        } else {
            crate::driver::MEM_ATTACH_HOST
        };
        DevicePointer::alloc_with(
            context,
            size,
            |ctx| ctx.driver().mem_alloc_managed(ctx.raw(), size, flags),
            true,
        )
    }
}
