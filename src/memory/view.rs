//! [`View`]: a byte range of an allocation, and its memory operations.

use std::sync::Arc;

use super::{DevicePointer, InUse};
use crate::context::Context;
use crate::driver::{DevicePtr, MemoryType, RawStream};
use crate::error::{Error, Result};

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
