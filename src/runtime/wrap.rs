//! The runtime's view of memory it did not make: the context of any
//! address, and wrapping someone else's device memory (checked against what
//! the driver knows, and registered so its context resolves by address).

use std::sync::Arc;

use super::Runtime;
use crate::context::Context;
use crate::driver::{DevicePtr, MemoryType};
use crate::error::{Error, Result};
use crate::lifetime::KeepAlive;
use crate::memory::DevicePointer;

impl Runtime {
    /// The context that `address` belongs to, resolved from the address
    /// itself (never from the current context): first the registry of known
    /// ranges, then `cuPointerGetAttributes`. Host and unregistered addresses
    /// are [`Error::InvalidPointer`].
    pub fn context_of(self: &Arc<Self>, address: DevicePtr) -> Result<Arc<Context>> {
        if let Some((ctx, _, _)) = self.lookup_range(address) {
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
        if let Some((ctx, start, stop)) = self.lookup_range(address) {
            // Pool memory: the block handed out, not its whole segment.
            let (start, stop) = match ctx.state().pool_block(address) {
                None => (start, stop),
                Some(Some((at, size))) => (at, at + size as u64),
                Some(None) => {
                    return Err(Error::InvalidPointer(format!(
                        "{address:#x} is in gpuptr's pool but in no live allocation"
                    )))
                }
            };
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
        let reg = (range != 0).then(|| ctx.register(start, range));
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
