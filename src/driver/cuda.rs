//! [`CudaDriver`]: the CUDA driver API through cudarc's `sys` and `result`
//! layers, loaded dynamically.
//!
//! cudarc panics when libcuda or a symbol is missing, so [`probe`] checks for
//! the library and the driver version before any other call, and every call
//! runs under `catch_unwind`: a panic becomes [`Error::Panic`], never an unwind.

use std::ffi::{c_int, c_uint, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::{
    DevicePtr, Driver, DriverKind, HostPtr, MemoryType, PointerAttributes, PrimaryContextState,
    RawContext, RawEvent, RawStream,
};
use crate::error::{Error, Result, CUDA_ERROR_NO_DEVICE};

/// The oldest driver API gpuptr's bindings (cudarc `cuda-12000`) are built for.
const MIN_DRIVER_VERSION: i32 = 12000;

const NO_DRIVER_HINT: &str =
    "install the NVIDIA driver (libcuda.so.1 must be on the loader path), \
or set GPUPTR_DRIVER=sim to run on gpuptr's simulator";

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

fn cuda_error(call: &'static str, e: DriverError) -> Error {
    // The enum's Debug is the CUresult's name, e.g. CUDA_ERROR_OUT_OF_MEMORY.
    Error::cuda(call, e.0 as i32, format!("{:?}", e.0))
}

/// A query's answer: `CUDA_ERROR_NOT_READY` means "not done yet", not failure.
fn done(r: Result<()>) -> Result<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(Error::Cuda { code, .. }) if code == crate::error::CUDA_ERROR_NOT_READY => Ok(false),
        Err(e) => Err(e),
    }
}

/// Run one FFI call; a panic inside it is caught and returned as an error.
#[inline]
fn guard<T>(call: &'static str, f: impl FnOnce() -> Result<T, DriverError>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(cuda_error(call, e)),
        Err(payload) => Err(Error::Panic(format!("{call}: {}", panic_message(payload)))),
    }
}

/// Check that libcuda loads, initialises and is new enough, and return the
/// driver version. The answer is computed once per process.
pub fn probe() -> Result<i32> {
    static PROBE: OnceLock<Result<i32>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            let found = catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
            if !found {
                return Err(Error::NoDriver(format!(
                    "libcuda was not found; {NO_DRIVER_HINT}"
                )));
            }
            match guard("cuInit", result::init) {
                Ok(()) => {}
                Err(Error::Cuda { code, name, .. }) if code == CUDA_ERROR_NO_DEVICE => {
                    return Err(Error::NoDriver(format!(
                        "cuInit found no CUDA device ({name}); {NO_DRIVER_HINT}"
                    )))
                }
                Err(e) => return Err(Error::NoDriver(format!("{e}; {NO_DRIVER_HINT}"))),
            }
            let mut version: c_int = 0;
            guard("cuDriverGetVersion", || unsafe {
                sys::cuDriverGetVersion(&mut version).result()
            })
            .map_err(|e| Error::NoDriver(format!("{e}; {NO_DRIVER_HINT}")))?;
            if version < MIN_DRIVER_VERSION {
                return Err(Error::NoDriver(format!(
                    "the driver supports CUDA {}.{}, gpuptr needs 12.0 or newer; {NO_DRIVER_HINT}",
                    version / 1000,
                    (version % 1000) / 10
                )));
            }
            Ok(version)
        })
        .clone()
}

/// The CUDA driver API. Construct it with [`CudaDriver::new`], which probes.
#[derive(Debug)]
pub struct CudaDriver {
    version: i32,
    device_count: usize,
}

impl CudaDriver {
    /// Probe libcuda and open the driver, or fail with [`Error::NoDriver`].
    pub fn new() -> Result<Self> {
        let version = probe()?;
        let count = guard("cuDeviceGetCount", result::device::get_count)?;
        Ok(CudaDriver {
            version,
            device_count: count.max(0) as usize,
        })
    }

    fn device(&self, ordinal: usize) -> Result<sys::CUdevice> {
        if ordinal >= self.device_count {
            return Err(Error::InvalidArgument(format!(
                "device {ordinal} does not exist ({} device(s) present)",
                self.device_count
            )));
        }
        guard("cuDeviceGet", || result::device::get(ordinal as c_int))
    }

    /// Make `context` current on this thread unless it already is.
    #[inline]
    fn enter(&self, context: RawContext) -> Result<()> {
        guard("cuCtxSetCurrent", || unsafe {
            let mut current: sys::CUcontext = std::ptr::null_mut();
            sys::cuCtxGetCurrent(&mut current).result()?;
            if current as RawContext != context {
                result::ctx::set_current(context as sys::CUcontext)?;
            }
            Ok(())
        })
    }
}

impl Driver for CudaDriver {
    fn kind(&self) -> DriverKind {
        DriverKind::Cuda
    }

    fn version(&self) -> Result<i32> {
        Ok(self.version)
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.device_count)
    }

    fn device_name(&self, device: usize) -> Result<String> {
        let dev = self.device(device)?;
        guard("cuDeviceGetName", || result::device::get_name(dev))
    }

    fn device_total_memory(&self, device: usize) -> Result<usize> {
        let dev = self.device(device)?;
        guard("cuDeviceTotalMem", || unsafe {
            result::device::total_mem(dev)
        })
    }

    fn primary_context_retain(&self, device: usize) -> Result<RawContext> {
        let dev = self.device(device)?;
        guard("cuDevicePrimaryCtxRetain", || unsafe {
            result::primary_ctx::retain(dev)
        })
        .map(|c| c as RawContext)
    }

    fn primary_context_release(&self, device: usize) -> Result<()> {
        let dev = self.device(device)?;
        guard("cuDevicePrimaryCtxRelease", || unsafe {
            result::primary_ctx::release(dev)
        })
    }

    fn primary_context_state(&self, device: usize) -> Result<PrimaryContextState> {
        let dev = self.device(device)?;
        let mut flags: c_uint = 0;
        let mut active: c_int = 0;
        guard("cuDevicePrimaryCtxGetState", || unsafe {
            sys::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active).result()
        })?;
        Ok(PrimaryContextState {
            flags,
            active: active != 0,
        })
    }

    fn current_context(&self) -> Result<RawContext> {
        guard("cuCtxGetCurrent", result::ctx::get_current).map(|c| c.map_or(0, |c| c as RawContext))
    }

    fn current_device(&self) -> Result<Option<usize>> {
        if self.current_context()? == 0 {
            return Ok(None);
        }
        let mut dev: sys::CUdevice = 0;
        guard("cuCtxGetDevice", || unsafe {
            sys::cuCtxGetDevice(&mut dev).result()
        })?;
        Ok(Some(dev as usize))
    }

    fn set_current_context(&self, context: RawContext) -> Result<()> {
        guard("cuCtxSetCurrent", || unsafe {
            result::ctx::set_current(context as sys::CUcontext)
        })
    }

    fn synchronize(&self, context: RawContext) -> Result<()> {
        self.enter(context)?;
        guard("cuCtxSynchronize", result::ctx::synchronize)
    }

    fn stream_synchronize(&self, context: RawContext, stream: RawStream) -> Result<()> {
        self.enter(context)?;
        guard("cuStreamSynchronize", || unsafe {
            result::stream::synchronize(stream as sys::CUstream)
        })
    }

    fn stream_query(&self, context: RawContext, stream: RawStream) -> Result<bool> {
        self.enter(context)?;
        done(guard("cuStreamQuery", || unsafe {
            sys::cuStreamQuery(stream as sys::CUstream).result()
        }))
    }

    fn mem_alloc(&self, context: RawContext, size: usize) -> Result<DevicePtr> {
        self.enter(context)?;
        guard("cuMemAlloc", || unsafe { result::malloc_sync(size) })
    }

    fn mem_free(&self, context: RawContext, ptr: DevicePtr) -> Result<()> {
        self.enter(context)?;
        guard("cuMemFree", || unsafe { result::free_sync(ptr) })
    }

    fn mem_alloc_async(
        &self,
        context: RawContext,
        size: usize,
        stream: RawStream,
    ) -> Result<DevicePtr> {
        self.enter(context)?;
        guard("cuMemAllocAsync", || unsafe {
            result::malloc_async(stream as sys::CUstream, size)
        })
    }

    fn mem_free_async(&self, context: RawContext, ptr: DevicePtr, stream: RawStream) -> Result<()> {
        self.enter(context)?;
        guard("cuMemFreeAsync", || unsafe {
            result::free_async(ptr, stream as sys::CUstream)
        })
    }

    fn event_create(&self, context: RawContext) -> Result<RawEvent> {
        self.enter(context)?;
        guard("cuEventCreate", || {
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        })
        .map(|e| e as RawEvent)
    }

    fn event_record(&self, context: RawContext, event: RawEvent, stream: RawStream) -> Result<()> {
        self.enter(context)?;
        guard("cuEventRecord", || unsafe {
            result::event::record(event as sys::CUevent, stream as sys::CUstream)
        })
    }

    fn event_query(&self, context: RawContext, event: RawEvent) -> Result<bool> {
        self.enter(context)?;
        done(guard("cuEventQuery", || unsafe {
            result::event::query(event as sys::CUevent)
        }))
    }

    fn event_synchronize(&self, context: RawContext, event: RawEvent) -> Result<()> {
        self.enter(context)?;
        guard("cuEventSynchronize", || unsafe {
            result::event::synchronize(event as sys::CUevent)
        })
    }

    fn event_destroy(&self, context: RawContext, event: RawEvent) -> Result<()> {
        self.enter(context)?;
        guard("cuEventDestroy", || unsafe {
            result::event::destroy(event as sys::CUevent)
        })
    }

    fn mem_alloc_managed(&self, context: RawContext, size: usize, flags: u32) -> Result<DevicePtr> {
        self.enter(context)?;
        let mut ptr: sys::CUdeviceptr = 0;
        guard("cuMemAllocManaged", || unsafe {
            sys::cuMemAllocManaged(&mut ptr, size, flags).result()
        })?;
        Ok(ptr)
    }

    fn host_alloc(&self, context: RawContext, size: usize, flags: u32) -> Result<HostPtr> {
        self.enter(context)?;
        guard("cuMemHostAlloc", || unsafe {
            result::malloc_host(size, flags)
        })
        .map(|p| p as HostPtr)
    }

    fn host_free(&self, context: RawContext, ptr: HostPtr) -> Result<()> {
        self.enter(context)?;
        guard("cuMemFreeHost", || unsafe {
            result::free_host(ptr as *mut c_void)
        })
    }

    fn host_register(
        &self,
        context: RawContext,
        ptr: HostPtr,
        size: usize,
        flags: u32,
    ) -> Result<()> {
        self.enter(context)?;
        guard("cuMemHostRegister", || unsafe {
            sys::cuMemHostRegister_v2(ptr as *mut c_void, size, flags).result()
        })
    }

    fn host_unregister(&self, context: RawContext, ptr: HostPtr) -> Result<()> {
        self.enter(context)?;
        guard("cuMemHostUnregister", || unsafe {
            sys::cuMemHostUnregister(ptr as *mut c_void).result()
        })
    }

    fn host_device_pointer(&self, context: RawContext, ptr: HostPtr) -> Result<DevicePtr> {
        self.enter(context)?;
        let mut d: sys::CUdeviceptr = 0;
        guard("cuMemHostGetDevicePointer", || unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut d, ptr as *mut c_void, 0).result()
        })?;
        Ok(d)
    }

    fn mem_get_info(&self, context: RawContext) -> Result<(usize, usize)> {
        self.enter(context)?;
        guard("cuMemGetInfo", result::mem_get_info)
    }

    fn memset_d8(
        &self,
        context: RawContext,
        ptr: DevicePtr,
        value: u8,
        count: usize,
        stream: RawStream,
    ) -> Result<()> {
        self.enter(context)?;
        if stream == 0 {
            guard("cuMemsetD8", || unsafe {
                result::memset_d8_sync(ptr, value, count)
            })
        } else {
            guard("cuMemsetD8Async", || unsafe {
                result::memset_d8_async(ptr, value, count, stream as sys::CUstream)
            })
        }
    }

    fn memcpy_htod(&self, context: RawContext, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.enter(context)?;
        guard("cuMemcpyHtoD", || unsafe {
            result::memcpy_htod_sync(dst, src)
        })
    }

    fn memcpy_dtoh(&self, context: RawContext, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        self.enter(context)?;
        guard("cuMemcpyDtoH", || unsafe {
            result::memcpy_dtoh_sync(dst, src)
        })
    }

    fn memcpy_dtod(
        &self,
        context: RawContext,
        dst: DevicePtr,
        src: DevicePtr,
        count: usize,
    ) -> Result<()> {
        self.enter(context)?;
        // cuMemcpy infers the direction from unified addresses, so it also
        // copies between devices' memory.
        guard("cuMemcpy", || unsafe {
            sys::cuMemcpy(dst, src, count).result()
        })
    }

    fn pointer_attributes(&self, ptr: DevicePtr) -> Result<PointerAttributes> {
        use sys::CUpointer_attribute_enum as A;
        let mut context: sys::CUcontext = std::ptr::null_mut();
        let mut memory_type: c_uint = 0;
        let mut ordinal: c_int = -1;
        // IS_MANAGED is a C bool; read it through a zeroed word.
        let mut managed: u64 = 0;
        let mut start: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        let mut attrs = [
            A::CU_POINTER_ATTRIBUTE_CONTEXT,
            A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ];
        let mut data: [*mut c_void; 6] = [
            &mut context as *mut _ as *mut c_void,
            &mut memory_type as *mut _ as *mut c_void,
            &mut ordinal as *mut _ as *mut c_void,
            &mut managed as *mut _ as *mut c_void,
            &mut start as *mut _ as *mut c_void,
            &mut size as *mut _ as *mut c_void,
        ];
        guard("cuPointerGetAttributes", || unsafe {
            sys::cuPointerGetAttributes(
                attrs.len() as c_uint,
                attrs.as_mut_ptr(),
                data.as_mut_ptr(),
                ptr,
            )
            .result()
        })?;
        let memory_type = match memory_type {
            1 => MemoryType::Host,
            2..=4 => MemoryType::Device,
            _ => MemoryType::Unregistered,
        };
        Ok(PointerAttributes {
            context: context as RawContext,
            device: ordinal.max(0) as usize,
            memory_type,
            is_managed: managed & 0xff != 0,
            range_start: start,
            range_size: size,
        })
    }
}
