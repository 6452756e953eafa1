//! [`Runtime`]: one driver, its contexts, the pointer registry and the
//! statistics. Python uses [`Runtime::global`]; Rust code and tests can make
//! their own (for example over a [`SimDriver`](crate::SimDriver)).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::context::Context;
use crate::driver::{self, DevicePtr, Driver, DriverChoice, MemoryType};
use crate::error::{Error, Result};
use crate::memory::{DevicePointer, KeepAlive};
use crate::pool::{Pool, PoolConfig};
use crate::registry::Registry;

/// Allocation counters of one device.
#[derive(Default, Debug)]
pub(crate) struct DeviceCounters {
    pub live_bytes: AtomicUsize,
    pub live_count: AtomicUsize,
    pub peak_bytes: AtomicUsize,
    pub alloc_count: AtomicU64,
}

/// A snapshot of one device's allocation counters.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Device ordinal.
    pub device: usize,
    /// Bytes in live allocations made by gpuptr.
    pub live_bytes: usize,
    /// Number of live allocations made by gpuptr.
    pub live_count: usize,
    /// The most `live_bytes` has been.
    pub peak_bytes: usize,
    /// Allocations made so far.
    pub alloc_count: u64,
    /// Bytes the pool holds for reuse.
    pub cached_bytes: usize,
    /// Allocations served from the pool's cache.
    pub pool_hits: u64,
    /// Allocations that went to the driver.
    pub pool_misses: u64,
    /// Fences recorded (each makes a batch of freed blocks reusable).
    pub fences: u64,
}

/// The driver with everything gpuptr keeps about it.
pub struct Runtime {
    driver: Arc<dyn Driver>,
    contexts: Mutex<Vec<Weak<Context>>>,
    registry: Registry,
    counters: Vec<DeviceCounters>,
    pools: Option<Vec<Pool>>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("driver", &self.driver.kind())
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// A runtime over `driver`, with a caching pool per device.
    pub fn new(driver: Arc<dyn Driver>) -> Result<Arc<Self>> {
        Runtime::with_pool(driver, Some(PoolConfig::default()))
    }

    /// A runtime over `driver`; `None` allocates straight from the driver.
    pub fn with_pool(driver: Arc<dyn Driver>, pool: Option<PoolConfig>) -> Result<Arc<Self>> {
        let n = driver.device_count()?;
        Ok(Arc::new(Runtime {
            driver,
            contexts: Mutex::new((0..n).map(|_| Weak::new()).collect()),
            registry: Registry::new(),
            counters: (0..n).map(|_| DeviceCounters::default()).collect(),
            pools: pool.map(|c| (0..n).map(|_| Pool::new(c)).collect()),
        }))
    }

    /// The caching pool of `device`, unless pooling is off.
    #[inline]
    pub fn pool(&self, device: usize) -> Option<&Pool> {
        self.pools.as_ref().map(|p| &p[device])
    }

    /// Return every cached block of every device to the driver; the bytes freed.
    pub fn trim(self: &Arc<Self>) -> Result<usize> {
        let mut freed = 0;
        for d in 0..self.device_count() {
            if let (Some(pool), Some(ctx)) = (self.pool(d), self.existing_context(d)) {
                freed += pool.trim(&ctx)?;
            }
        }
        Ok(freed)
    }

    /// Prepare for `device`'s context being reset (numba's `cuda.close()`):
    /// cached blocks go back to the driver, and every live allocation turns
    /// stale. Stale pointers raise `InvalidPointer` on use, and freeing them
    /// is a no-op, so they never free memory a later allocation reuses.
    pub fn reset(self: &Arc<Self>, device: usize) -> Result<()> {
        self.check_device(device)?;
        let Some(ctx) = self.existing_context(device) else {
            return Ok(());
        };
        let trimmed = self.pool(device).map(|p| p.trim(&ctx));
        // Invalidate first: the pool then refuses blocks of this context,
        // and forgets the ones it has under the same locks.
        ctx.invalidate();
        if let Some(pool) = self.pool(device) {
            pool.close(&ctx);
            pool.forget(&ctx);
        }
        // After the reset the old CUcontext is dead: the next use retains the
        // primary context afresh. Holders of the old Context (stale
        // pointers) release their retain when they go.
        self.contexts.lock().unwrap_or_else(|p| p.into_inner())[device] = Weak::new();
        let c = &self.counters[device];
        c.live_bytes.store(0, Ordering::Relaxed);
        c.live_count.store(0, Ordering::Relaxed);
        trimmed.transpose().map(|_| ())
    }

    /// The process-wide runtime, over the driver `GPUPTR_DRIVER` names
    /// (`auto`/`cuda`/`sim`). Opened on first use; a failure is remembered.
    pub fn global() -> Result<&'static Arc<Runtime>> {
        static GLOBAL: OnceLock<Result<Arc<Runtime>>> = OnceLock::new();
        GLOBAL
            .get_or_init(|| {
                let pool = match std::env::var("GPUPTR_POOL").as_deref() {
                    Ok("0") | Ok("off") => None,
                    _ => Some(PoolConfig::default()),
                };
                Runtime::with_pool(driver::open(DriverChoice::from_env()?)?, pool)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The driver.
    #[inline]
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// The pointer→context registry.
    #[inline]
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.counters.len()
    }

    /// `Ok` if `device` exists, else [`Error::InvalidArgument`].
    pub fn check_device(&self, device: usize) -> Result<()> {
        if device >= self.device_count() {
            return Err(Error::InvalidArgument(format!(
                "device {device} does not exist ({} device(s) present)",
                self.device_count()
            )));
        }
        Ok(())
    }

    /// The one live context of `device`, retaining its primary context if no
    /// holder has it now.
    pub fn context(self: &Arc<Self>, device: usize) -> Result<Arc<Context>> {
        self.check_device(device)?;
        let mut slots = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ctx) = slots[device].upgrade() {
            return Ok(ctx);
        }
        let ctx = Arc::new(Context::retain(self.clone(), device)?);
        slots[device] = Arc::downgrade(&ctx);
        Ok(ctx)
    }

    /// The device of the calling thread's current context, or 0 when none
    /// is current (CuPy's and numba's default device).
    pub fn current_device(&self) -> Result<usize> {
        Ok(self.driver.current_device()?.unwrap_or(0))
    }

    /// The live context of `device` if some holder keeps one, without
    /// retaining a new one.
    pub fn existing_context(&self, device: usize) -> Option<Arc<Context>> {
        let slots = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
        slots.get(device).and_then(Weak::upgrade)
    }

    /// The context that `address` belongs to, resolved from the address
    /// itself (never from the current context): first the registry of known
    /// ranges, then `cuPointerGetAttributes`. Host and unregistered addresses
    /// are [`Error::InvalidPointer`].
    pub fn context_of(self: &Arc<Self>, address: DevicePtr) -> Result<Arc<Context>> {
        if let Some(ctx) = self.registry.lookup(address) {
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
            .driver
            .pointer_attributes(address)
            .map_err(|e| match e {
                Error::Cuda { code, .. } if code == crate::error::CUDA_ERROR_INVALID_VALUE => {
                    Error::InvalidPointer(format!("{address:#x} is not CUDA memory ({e})"))
                }
                other => other,
            })?;
        match attrs.memory_type {
            MemoryType::Device => {}
            MemoryType::Host => {
                return Err(Error::InvalidPointer(format!(
                    "{address:#x} is page-locked host memory, not device memory"
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
    /// With `context` given, it is trusted (numba's `MemoryPointer(ctx, ...)`
    /// call shape). Without it, the context is resolved from the address: a
    /// registry hit costs a map lookup; a miss asks the driver once and
    /// registers the allocation's range for as long as this pointer lives.
    pub fn wrap(
        self: &Arc<Self>,
        address: DevicePtr,
        size: usize,
        context: Option<Arc<Context>>,
        keepalive: Option<KeepAlive>,
    ) -> Result<Arc<DevicePointer>> {
        let end = address.checked_add(size as u64).ok_or_else(|| {
            Error::InvalidPointer(format!("{address:#x} + {size} overflows the address space"))
        })?;
        if let Some(ctx) = context {
            if address == 0 && size != 0 {
                return Err(Error::InvalidPointer(format!(
                    "null address with a size of {size} bytes"
                )));
            }
            return Ok(DevicePointer::foreign(ctx, address, size, None, keepalive));
        }
        if address == 0 {
            return Err(Error::InvalidPointer(
                "a null address has no context; pass one explicitly".into(),
            ));
        }
        let out_of_range = |start: DevicePtr, stop: DevicePtr| {
            Error::InvalidPointer(format!(
                "[{address:#x}, {end:#x}) runs past its allocation [{start:#x}, {stop:#x})"
            ))
        };
        if let Some((ctx, start, stop)) = self.registry.lookup_range(address) {
            if end > stop {
                return Err(out_of_range(start, stop));
            }
            return Ok(DevicePointer::foreign(ctx, address, size, None, keepalive));
        }
        let (ctx, start, range) = self.resolve(address)?;
        let stop = start + range as u64;
        if range != 0 && end > stop {
            return Err(out_of_range(start, stop));
        }
        let reg = (range != 0).then(|| self.registry.insert(start, range, &ctx));
        Ok(DevicePointer::foreign(ctx, address, size, reg, keepalive))
    }

    /// Wrap the memory a strided array spans (see [`Layout`]) whose element
    /// 0 is at `address`; the returned view starts at element 0. An empty
    /// layout gives a null view in the current device's context.
    pub fn wrap_layout(
        self: &Arc<Self>,
        address: DevicePtr,
        layout: &crate::Layout,
        keepalive: Option<KeepAlive>,
    ) -> Result<crate::View> {
        if layout.span == 0 {
            let ctx = self.context(self.current_device()?)?;
            return Ok(crate::View::from(self.wrap(0, 0, Some(ctx), keepalive)?));
        }
        if address == 0 {
            return Err(Error::InvalidPointer(
                "a non-empty array has a null data pointer".into(),
            ));
        }
        let start = address.checked_add_signed(layout.lo).ok_or_else(|| {
            Error::InvalidPointer("negative strides reach below address 0".into())
        })?;
        let mem = self.wrap(start, layout.span, None, keepalive)?;
        crate::View::from(mem).view((-layout.lo) as usize, None)
    }

    pub(crate) fn counters(&self, device: usize) -> &DeviceCounters {
        &self.counters[device]
    }

    /// Allocation statistics of every device.
    pub fn stats(&self) -> Vec<DeviceStats> {
        self.counters
            .iter()
            .enumerate()
            .map(|(device, c)| {
                let p = self.pool(device).map(Pool::stats).unwrap_or_default();
                DeviceStats {
                    device,
                    live_bytes: c.live_bytes.load(Ordering::Relaxed) + p.live_bytes,
                    live_count: c.live_count.load(Ordering::Relaxed) + p.live_count,
                    // Peaks of the two kinds may not coincide: report the larger.
                    peak_bytes: c.peak_bytes.load(Ordering::Relaxed).max(p.peak_bytes),
                    alloc_count: c.alloc_count.load(Ordering::Relaxed) + p.alloc_count,
                    cached_bytes: p.cached_bytes,
                    pool_hits: p.hits,
                    pool_misses: p.misses,
                    fences: p.fences,
                }
            })
            .collect()
    }
}
