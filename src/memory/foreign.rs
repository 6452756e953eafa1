//! Memory gpuptr does not own: wrapping someone else's device memory
//! (checked against what the driver knows, and registered so its context
//! resolves by address), resolving the context of any address, and the
//! device view of mapped host memory.

use std::sync::{Arc, Mutex};

use super::{DevicePointer, Origin, View};
use crate::context::Context;
use crate::driver::{DevicePtr, MemoryType};
use crate::error::{Error, Result};
use crate::host::HostMemory;
use crate::lifetime::KeepAlive;
use crate::registry::Registration;
use crate::runtime::Runtime;

impl DevicePointer {
    /// Wrap memory someone else owns. `registration` is the registry entry
    /// the wrap holds (if it added one); `keepalive` is kept until release.
    /// It is read-only when `readonly` (the exporter said so), and when any
    /// of its bytes is host memory registered from a read-only object.
    pub(crate) fn foreign(
        context: Arc<Context>,
        address: DevicePtr,
        size: usize,
        registration: Option<Registration>,
        keepalive: Option<KeepAlive>,
        readonly: bool,
    ) -> Arc<Self> {
        let readonly = readonly || context.services().read_only.overlaps(address, size);
        let mut p = DevicePointer::base(context, address, size, Origin::Foreign);
        p.readonly = readonly;
        p.registration = registration;
        p.has_keepalive = keepalive.is_some();
        p.keepalive = Mutex::new(keepalive);
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
}

impl DevicePointer {
    /// The mapping of another process's allocation at `address`, `size`
    /// bytes, made by opening an IPC handle: registered, so its context
    /// resolves by address, and unmapped on release.
    pub(crate) fn ipc_mapping(
        context: &Arc<Context>,
        address: DevicePtr,
        size: usize,
    ) -> Arc<Self> {
        let reg = context.services().registry.insert(address, size, context);
        let mut p = DevicePointer::base(context.clone(), address, size, Origin::Ipc);
        p.registration = Some(reg);
        Arc::new(p)
    }
}

impl HostMemory {
    /// A device view of mapped memory; it keeps this host memory alive, and
    /// its operations hold it. Empty memory gives a null view.
    pub fn device_view(self: &Arc<Self>) -> Result<View> {
        let ctx = self.context().clone();
        if self.size() == 0 && self.is_mapped() {
            // An empty range at address 0 reaches no memory.
            return Ok(DevicePointer::foreign(ctx, 0, 0, None, None, false).view_all());
        }
        let d = self.device_address().ok_or_else(|| {
            Error::InvalidPointer("host memory is not mapped into the device".into())
        })?;
        Ok(DevicePointer::over_host(ctx, d, self.clone()).view_all())
    }
}

impl Runtime {
    /// The context that `address` belongs to, resolved from the address
    /// itself (never from the current context): first the registry of known
    /// ranges, then `cuPointerGetAttributes`. Host and unregistered addresses
    /// are [`Error::InvalidPointer`].
    pub fn context_of(self: &Arc<Self>, address: DevicePtr) -> Result<Arc<Context>> {
        if let Some(ctx) = self.registry().lookup(address) {
            return Ok(ctx);
        }
        Ok(self.resolve(address)?.0)
    }

    /// The context of `address` from the driver alone (no registry): what a
    /// registry hit saves.
    pub fn query_context(self: &Arc<Self>, address: DevicePtr) -> Result<Arc<Context>> {
        Ok(self.resolve(address)?.0)
    }

    /// Ask the driver about `address`: its context and allocation range.
    pub(crate) fn resolve(
        self: &Arc<Self>,
        address: DevicePtr,
    ) -> Result<(Arc<Context>, DevicePtr, usize)> {
        if address == 0 {
            return Err(Error::InvalidPointer("null address".into()));
        }
        let attrs = self
            .driver()
            .pointer_attributes(address)
            .map_err(|e| match e {
                Error::Cuda { code, .. } if code == crate::error::CUDA_ERROR_INVALID_VALUE => {
                    Error::InvalidPointer(format!("{address:#x} is not CUDA memory ({e})"))
                }
                other => other,
            })?;
        match attrs.memory_type {
            MemoryType::Device => {}
            // Mapped (zero-copy) host memory is device memory to a kernel, as
            // numba treats it.
            MemoryType::Host if attrs.device_accessible => {}
            MemoryType::Host => {
                return Err(Error::InvalidPointer(format!(
                    "{address:#x} is page-locked host memory not mapped into the device"
                )))
            }
            MemoryType::Unregistered => {
                return Err(Error::InvalidPointer(format!(
                    "{address:#x} is not device memory (host or unregistered address)"
                )))
            }
        }
        let ctx = self.context(attrs.device)?;
        Ok((ctx, attrs.range_start, attrs.range_size))
    }

    /// Wrap `[address, address+size)` of memory gpuptr does not own, keeping
    /// `keepalive` (its owner) until the pointer is released.
    ///
    /// The range is checked against what the driver knows: it must lie in
    /// one device-accessible allocation, and its context is the one the
    /// memory lives in (`context`, numba's `MemoryPointer(ctx, ...)` call
    /// shape, is used only for a null, empty range). A registry hit costs a
    /// map lookup; a miss asks the driver once and registers the
    /// allocation's range for as long as this pointer lives.
    pub fn wrap(
        self: &Arc<Self>,
        address: DevicePtr,
        size: usize,
        context: Option<Arc<Context>>,
        keepalive: Option<KeepAlive>,
    ) -> Result<Arc<DevicePointer>> {
        self.wrap_as(address, size, context, keepalive, false)
    }

    /// [`Runtime::wrap`], read-only when `readonly` (writes through the
    /// pointer and its views are [`Error::InvalidArgument`]). A wrap over any
    /// byte of host memory registered from a read-only object is read-only
    /// either way.
    pub fn wrap_as(
        self: &Arc<Self>,
        address: DevicePtr,
        size: usize,
        context: Option<Arc<Context>>,
        keepalive: Option<KeepAlive>,
        readonly: bool,
    ) -> Result<Arc<DevicePointer>> {
        crate::fork::check()?;
        let end = address.checked_add(size as u64).ok_or_else(|| {
            Error::InvalidPointer(format!("{address:#x} + {size} overflows the address space"))
        })?;
        if address == 0 {
            if size != 0 {
                return Err(Error::InvalidPointer(format!(
                    "null address with a size of {size} bytes"
                )));
            }
            let ctx = match context {
                Some(c) => c,
                None => {
                    return Err(Error::InvalidPointer(
                        "a null address has no context; pass one explicitly".into(),
                    ))
                }
            };
            return Ok(DevicePointer::foreign(ctx, 0, 0, None, keepalive, readonly));
        }
        let out_of_range = |start: DevicePtr, stop: DevicePtr| {
            Error::InvalidPointer(format!(
                "[{address:#x}, {end:#x}) runs past its allocation [{start:#x}, {stop:#x})"
            ))
        };
        if let Some((ctx, start, stop)) = self.registry().lookup_range(address) {
            if end > stop {
                return Err(out_of_range(start, stop));
            }
            return Ok(DevicePointer::foreign(
                ctx, address, size, None, keepalive, readonly,
            ));
        }
        let (ctx, start, range) = self.resolve(address)?;
        let stop = start + range as u64;
        if range != 0 && end > stop {
            return Err(out_of_range(start, stop));
        }
        let reg = (range != 0).then(|| self.registry().insert(start, range, &ctx));
        Ok(DevicePointer::foreign(
            ctx, address, size, reg, keepalive, readonly,
        ))
    }

    /// `Ok` if `[address, address+size)` is managed (unified) memory inside
    /// one allocation, as far as the driver says: memory the host may read
    /// and write at the same address.
    pub fn check_managed(&self, address: DevicePtr, size: usize) -> Result<()> {
        crate::fork::check()?;
        if size == 0 {
            return Ok(());
        }
        let a = self.driver().pointer_attributes(address)?;
        let inside = a.range_size == 0
            || address
                .checked_add(size as u64)
                .is_some_and(|end| end <= a.range_start + a.range_size as u64);
        if !a.is_managed || !inside {
            return Err(Error::InvalidPointer(format!(
                "[{address:#x}, +{size}) is not managed memory in one allocation"
            )));
        }
        Ok(())
    }

    /// Wrap `[address, address+size)` in `context` without asking the
    /// driver (for memory whose address the driver just handed out).
    ///
    /// # Safety
    /// The range is live device-accessible memory of `context` for as long
    /// as the pointer (and its views) may be used: its memory operations
    /// write there.
    pub unsafe fn wrap_unchecked(
        self: &Arc<Self>,
        address: DevicePtr,
        size: usize,
        context: Arc<Context>,
        keepalive: Option<KeepAlive>,
    ) -> Result<Arc<DevicePointer>> {
        if address.checked_add(size as u64).is_none() || (address == 0 && size != 0) {
            return Err(Error::InvalidPointer(format!(
                "[{address:#x}, +{size}) is not a valid range"
            )));
        }
        Ok(DevicePointer::foreign(
            context, address, size, None, keepalive, false,
        ))
    }

    /// Wrap the memory a strided array spans (see [`Layout`](crate::Layout)) whose element
    /// 0 is at `address`; the returned view starts at element 0. An empty
    /// layout gives a null view in the current device's context. With
    /// `readonly` (the exporter marked the array so), writes through it are
    /// refused, as [`Runtime::wrap_as`] says.
    pub fn wrap_layout(
        self: &Arc<Self>,
        address: DevicePtr,
        layout: &crate::Layout,
        readonly: bool,
        keepalive: Option<KeepAlive>,
    ) -> Result<crate::View> {
        crate::fork::check()?;
        if layout.span == 0 {
            let ctx = self.context(self.current_device()?)?;
            return Ok(crate::View::from(self.wrap_as(
                0,
                0,
                Some(ctx),
                keepalive,
                readonly,
            )?));
        }
        if address == 0 {
            return Err(Error::InvalidPointer(
                "a non-empty array has a null data pointer".into(),
            ));
        }
        let start = address.checked_add_signed(layout.lo).ok_or_else(|| {
            Error::InvalidPointer("negative strides reach below address 0".into())
        })?;
        let mem = self.wrap_as(start, layout.span, None, keepalive, readonly)?;
        crate::View::from(mem).view((-layout.lo) as usize, None)
    }
}
