//! Device memory: [`DevicePointer`], the owning allocation, and [`View`], a
//! sub-range that keeps its allocation (and so the context) alive.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::context::Context;
use crate::driver::{DevicePtr, RawStream};
use crate::error::{Error, Result};
use crate::registry::Registration;

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
    generation: u64,
    registration: Option<Registration>,
    /// The pool shard a pooled block goes back to.
    pool_shard: u32,
    freed: AtomicBool,
    /// Set once at construction: most pointers keep nothing, and then
    /// releasing them takes no lock.
    has_keepalive: bool,
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

impl DevicePointer {
    /// Allocate `size` bytes in `context`. Zero bytes give a null pointer and
    /// make no driver call.
    pub fn alloc(context: &Arc<Context>, size: usize) -> Result<Arc<Self>> {
        match context.runtime().pool(context.device()) {
            Some(pool) if size != 0 => {
                let block = pool.alloc(context, size)?;
                Ok(DevicePointer::counted(
                    context,
                    block.address,
                    size,
                    Origin::Pool(block.class),
                    false,
                    None,
                    block.shard,
                ))
            }
            _ => DevicePointer::alloc_uncached(context, size),
        }
    }

    /// Allocate `size` bytes straight from the driver (`cuMemAlloc`),
    /// bypassing the pool.
    pub fn alloc_uncached(context: &Arc<Context>, size: usize) -> Result<Arc<Self>> {
        DevicePointer::alloc_with(
            context,
            size,
            |ctx| ctx.driver().mem_alloc(ctx.raw(), size),
            false,
        )
    }

    fn counted(
        context: &Arc<Context>,
        address: DevicePtr,
        size: usize,
        origin: Origin,
        managed: bool,
        registration: Option<Registration>,
        pool_shard: u32,
    ) -> Arc<Self> {
        // The pool counts its own allocations under its shard lock.
        if !matches!(origin, Origin::Pool(_)) {
            let c = context.runtime().counters(context.device());
            c.alloc_count.fetch_add(1, Ordering::Relaxed);
            c.live_count.fetch_add(1, Ordering::Relaxed);
            let live = c.live_bytes.fetch_add(size, Ordering::Relaxed) + size;
            c.peak_bytes.fetch_max(live, Ordering::Relaxed);
        }
        Arc::new(DevicePointer {
            context: context.clone(),
            address,
            size,
            origin,
            managed,
            generation: context.generation(),
            registration,
            pool_shard,
            freed: AtomicBool::new(false),
            has_keepalive: false,
            keepalive: Mutex::new(None),
        })
    }

    /// Allocate with `allocate` (a driver call freed by `cuMemFree`), then
    /// register and count the allocation.
    pub(crate) fn alloc_with(
        context: &Arc<Context>,
        size: usize,
        allocate: impl FnOnce(&Context) -> Result<DevicePtr>,
        managed: bool,
    ) -> Result<Arc<Self>> {
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
        let generation = context.generation();
        Arc::new(DevicePointer {
            context,
            address,
            size,
            origin: Origin::Foreign,
            managed: false,
            generation,
            registration,
            pool_shard: 0,
            freed: AtomicBool::new(false),
            has_keepalive: keepalive.is_some(),
            keepalive: Mutex::new(keepalive),
        })
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

    /// Whether it was freed.
    #[inline]
    pub fn is_freed(&self) -> bool {
        self.freed.load(Ordering::Acquire)
    }

    /// Whether its context was reset since it was made, so its memory is gone.
    #[inline]
    pub fn is_stale(&self) -> bool {
        self.generation != self.context.generation()
    }

    /// `Ok` if the memory may be used now, else [`Error::InvalidPointer`].
    #[inline]
    pub fn check_live(&self) -> Result<()> {
        check_live("memory", self.address, self.is_freed(), self.is_stale())
    }

    /// A view of the whole allocation.
    pub fn view_all(self: &Arc<Self>) -> View {
        View::from(self.clone())
    }

    /// Release the memory now. Returns `Ok(true)` if this call freed it and
    /// `Ok(false)` if it was already free (a second free is a no-op). Foreign
    /// memory is never freed; the pointer just lets go of its owner. Memory
    /// of a reset context is not freed either: its address may now belong to
    /// a newer allocation.
    pub fn free(&self) -> Result<bool> {
        if self.freed.swap(true, Ordering::AcqRel) {
            return Ok(false);
        }
        self.release().map(|()| true)
    }

    /// Release the memory; the caller has just claimed `freed`.
    fn release(&self) -> Result<()> {
        let stale = self.is_stale();
        match self.origin {
            Origin::Driver if self.address != 0 && !stale => {
                if let Err(e) = self
                    .context
                    .driver()
                    .mem_free(self.context.raw(), self.address)
                {
                    // Still allocated: stay live so a later free or drop retries.
                    self.freed.store(false, Ordering::Release);
                    return Err(e);
                }
            }
            Origin::Pool(class) if !stale => {
                if let Some(pool) = self.context.runtime().pool(self.context.device()) {
                    let block = crate::pool::Block {
                        address: self.address,
                        class,
                        shard: self.pool_shard,
                    };
                    pool.release(&self.context, self.generation, block, self.size);
                }
            }
            _ => {}
        }
        if let Some(reg) = self.registration {
            self.context.runtime().registry().remove(reg);
        }
        // A reset already zeroed the counters for stale allocations, and the
        // pool keeps its own.
        if matches!(self.origin, Origin::Driver) && !stale {
            let c = self.context.runtime().counters(self.context.device());
            c.live_count.fetch_sub(1, Ordering::Relaxed);
            c.live_bytes.fetch_sub(self.size, Ordering::Relaxed);
        }
        if self.has_keepalive {
            release_keepalive(&self.keepalive);
        }
        Ok(())
    }
}

impl Drop for DevicePointer {
    fn drop(&mut self) {
        // The last holder: no other thread can free it now, so no atomic
        // swap is needed to claim it.
        let freed = self.freed.get_mut();
        if !*freed {
            *freed = true;
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

    fn check_span(&self, what: &str, count: usize) -> Result<()> {
        self.parent.check_live()?;
        if count > self.size {
            return Err(Error::InvalidPointer(format!(
                "{what} of {count} bytes exceeds the {} bytes at {:#x}",
                self.size,
                self.address()
            )));
        }
        Ok(())
    }

    /// Set `count` bytes (default: all) to `value`, on `stream` (0 = synchronous).
    pub fn memset(&self, value: u8, count: Option<usize>, stream: RawStream) -> Result<()> {
        let count = count.unwrap_or(self.size);
        self.check_span("memset", count)?;
        if count == 0 {
            return Ok(());
        }
        let ctx = self.context();
        ctx.driver()
            .memset_d8(ctx.raw(), self.address(), value, count, stream)
    }

    /// Copy `src` to the start of the view.
    pub fn copy_from_host(&self, src: &[u8]) -> Result<()> {
        self.check_span("copy", src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let ctx = self.context();
        ctx.driver().memcpy_htod(ctx.raw(), self.address(), src)
    }

    /// Copy the start of the view into `dst`.
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        self.check_span("copy", dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let ctx = self.context();
        ctx.driver().memcpy_dtoh(ctx.raw(), dst, self.address())
    }

    /// Copy `count` bytes (default: all of `src`) from `src` to this view.
    pub fn copy_from_device(&self, src: &View, count: Option<usize>) -> Result<()> {
        let count = count.unwrap_or(src.size);
        src.check_span("copy", count)?;
        self.check_span("copy", count)?;
        if count == 0 {
            return Ok(());
        }
        let ctx = self.context();
        ctx.driver()
            .memcpy_dtod(ctx.raw(), self.address(), src.address(), count)
    }

    /// The whole view as a `Vec` (a convenience for tests and tools).
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.size];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }
}
