//! [`CudaDriver`]: the CUDA driver API through cudarc's `sys` and `result`
//! layers, loaded dynamically.
//!
//! cudarc panics when libcuda or a symbol is missing, so [`probe`] checks for
//! the library and the driver version before any other call, and every call
//! runs under `catch_unwind`: a panic becomes [`Error::Panic`], never an unwind.

mod probe;

use std::ffi::{c_int, c_uint, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::result;
use cudarc::driver::sys;

pub use probe::probe;
use probe::{done, guard};

use super::{
    DevicePtr, Driver, DriverKind, HostPtr, IpcMemHandle, MemoryType, PointerAttributes,
    PrimaryContextState, RawContext, RawStream,
};
use crate::error::Result;

/// The CUDA driver API. Construct it with [`CudaDriver::new`], which probes.
#[derive(Debug)]
pub struct CudaDriver {
    version: i32,
    device_count: usize,
}

impl CudaDriver {
    /// Probe libcuda and open the driver, or fail with [`Error::NoDriver`](crate::Error::NoDriver).
    pub fn new() -> Result<Self> {
        let version = probe()?;
        let count = guard("cuDeviceGetCount", result::device::get_count)?;
        Ok(CudaDriver {
            version,
            device_count: count.max(0) as usize,
        })
    }

    fn device(&self, ordinal: usize) -> Result<sys::CUdevice> {
        crate::error::check_device(ordinal, self.device_count)?;
        guard("cuDeviceGet", || result::device::get(ordinal as c_int))
    }

    /// Make `context` current on this thread unless it already is.
    ///
    /// # Safety
    /// `context` is live (the trait's contract for every caller).
    #[inline]
    unsafe fn enter(&self, context: RawContext) -> Result<()> {
        // SAFETY: the out-pointer is a live local; `context` is live.
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
        // SAFETY: `dev` is a valid device handle from cuDeviceGet.
        guard("cuDeviceTotalMem", || unsafe {
            result::device::total_mem(dev)
        })
    }

    fn primary_context_retain(&self, device: usize) -> Result<RawContext> {
        let dev = self.device(device)?;
        // SAFETY: `dev` is a valid device handle; the retain is balanced by
        // the caller's later release (the trait's contract).
        guard("cuDevicePrimaryCtxRetain", || unsafe {
            result::primary_ctx::retain(dev)
        })
        .map(|c| c as RawContext)
    }

    unsafe fn primary_context_release(&self, device: usize) -> Result<()> {
        let dev = self.device(device)?;
        // SAFETY: the caller balances an earlier retain (this fn's contract).
        guard("cuDevicePrimaryCtxRelease", || unsafe {
            result::primary_ctx::release(dev)
        })
    }

    fn primary_context_state(&self, device: usize) -> Result<PrimaryContextState> {
        let dev = self.device(device)?;
        let mut flags: c_uint = 0;
        let mut active: c_int = 0;
        // SAFETY: the out-pointers are live locals; `dev` is valid.
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
        // SAFETY: the out-pointer is a live local.
        guard("cuCtxGetDevice", || unsafe {
            sys::cuCtxGetDevice(&mut dev).result()
        })?;
        Ok(Some(dev as usize))
    }

    unsafe fn set_current_context(&self, context: RawContext) -> Result<()> {
        // SAFETY: `context` is 0 or live (this fn's contract).
        guard("cuCtxSetCurrent", || unsafe {
            result::ctx::set_current(context as sys::CUcontext)
        })
    }

    unsafe fn synchronize(&self, context: RawContext) -> Result<()> {
        self.enter(context)?;
        guard("cuCtxSynchronize", result::ctx::synchronize)
    }

    unsafe fn stream_synchronize(&self, context: RawContext, stream: RawStream) -> Result<()> {
        self.enter(context)?;
        // SAFETY: `stream` is live in `context` (this fn's contract).
        guard("cuStreamSynchronize", || unsafe {
            result::stream::synchronize(stream as sys::CUstream)
        })
    }

    unsafe fn stream_query(&self, context: RawContext, stream: RawStream) -> Result<bool> {
        self.enter(context)?;
        // SAFETY: `stream` is live in `context` (this fn's contract).
        done(guard("cuStreamQuery", || unsafe {
            sys::cuStreamQuery(stream as sys::CUstream).result()
        }))
    }

    unsafe fn mem_alloc(&self, context: RawContext, size: usize) -> Result<DevicePtr> {
        // Where a slow growth's time goes, when asked for: the context check
        // apart from the allocation (an atomic load when the log is off).
        let timed = log::log_enabled!(target: "gpuptr::driver", log::Level::Debug)
            .then(std::time::Instant::now);
        self.enter(context)?;
        let entered = timed.map(|t| t.elapsed());
        // SAFETY: `context` is current; cuMemAlloc only writes its out-pointer.
        let r = guard("cuMemAlloc", || unsafe { result::malloc_sync(size) });
        if let (Some(t), Some(entered)) = (timed, entered) {
            log::debug!(
                target: "gpuptr::driver",
                "cuMemAlloc({size}): {} us, after {} us making the context current",
                (t.elapsed() - entered).as_micros(),
                entered.as_micros()
            );
        }
        r
    }

    unsafe fn mem_free(&self, context: RawContext, ptr: DevicePtr) -> Result<()> {
        self.enter(context)?;
        // SAFETY: `ptr` is a live allocation of `context` no one uses after
        // this (this fn's contract).
        guard("cuMemFree", || unsafe { result::free_sync(ptr) })
    }

    unsafe fn mem_alloc_managed(
        &self,
        context: RawContext,
        size: usize,
        flags: u32,
    ) -> Result<DevicePtr> {
        self.enter(context)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the out-pointer is a live local.
        guard("cuMemAllocManaged", || unsafe {
            sys::cuMemAllocManaged(&mut ptr, size, flags).result()
        })?;
        Ok(ptr)
    }

    unsafe fn host_alloc(&self, context: RawContext, size: usize, flags: u32) -> Result<HostPtr> {
        self.enter(context)?;
        // SAFETY: `context` is current; cuMemHostAlloc only writes its out-pointer.
        guard("cuMemHostAlloc", || unsafe {
            result::malloc_host(size, flags)
        })
        .map(|p| p as HostPtr)
    }

    unsafe fn host_free(&self, context: RawContext, ptr: HostPtr) -> Result<()> {
        self.enter(context)?;
        // SAFETY: `ptr` came from cuMemHostAlloc and is not used afterwards
        // (this fn's contract).
        guard("cuMemFreeHost", || unsafe {
            result::free_host(ptr as *mut c_void)
        })
    }

    unsafe fn host_register(
        &self,
        context: RawContext,
        ptr: HostPtr,
        size: usize,
        flags: u32,
    ) -> Result<()> {
        self.enter(context)?;
        // SAFETY: the range is live host memory kept in place until it is
        // unregistered (this fn's contract).
        guard("cuMemHostRegister", || unsafe {
            sys::cuMemHostRegister_v2(ptr as *mut c_void, size, flags).result()
        })
    }

    unsafe fn host_unregister(&self, context: RawContext, ptr: HostPtr) -> Result<()> {
        self.enter(context)?;
        // SAFETY: `ptr` was registered in `context` (this fn's contract).
        guard("cuMemHostUnregister", || unsafe {
            sys::cuMemHostUnregister(ptr as *mut c_void).result()
        })
    }

    unsafe fn host_device_pointer(&self, context: RawContext, ptr: HostPtr) -> Result<DevicePtr> {
        self.enter(context)?;
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: only the driver's tables are read; the out-pointer is a live local.
        guard("cuMemHostGetDevicePointer", || unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut d, ptr as *mut c_void, 0).result()
        })?;
        Ok(d)
    }

    fn exchange_capture_mode(&self, mode: super::CaptureMode) -> Result<super::CaptureMode> {
        use sys::CUstreamCaptureMode as M;
        let mut m = match mode {
            super::CaptureMode::Global => M::CU_STREAM_CAPTURE_MODE_GLOBAL,
            super::CaptureMode::ThreadLocal => M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            super::CaptureMode::Relaxed => M::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        guard("cuThreadExchangeStreamCaptureMode", || {
            // SAFETY: `m` is a valid, writable mode for the call's lifetime;
            // the call changes only the calling thread's capture mode.
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) }.result()
        })?;
        Ok(match m {
            M::CU_STREAM_CAPTURE_MODE_GLOBAL => super::CaptureMode::Global,
            M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => super::CaptureMode::ThreadLocal,
            _ => super::CaptureMode::Relaxed,
        })
    }

    unsafe fn stream_capture(
        &self,
        context: RawContext,
        stream: RawStream,
    ) -> Result<Option<(u64, super::RawGraph)>> {
        self.enter(context)?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let (mut id, mut graph): (sys::cuuint64_t, sys::CUgraph) = (0, std::ptr::null_mut());
        guard("cuStreamGetCaptureInfo", || {
            // SAFETY: `stream` is live in `context` (this fn's contract);
            // the out-pointers are valid for the call, and the dependency
            // outputs are optional (null).
            unsafe {
                sys::cuStreamGetCaptureInfo_v2(
                    stream as sys::CUstream,
                    &mut status,
                    &mut id,
                    &mut graph,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                )
            }
            .result()
        })?;
        Ok(
            (status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE)
                .then_some((id, graph as super::RawGraph)),
        )
    }

    unsafe fn graph_on_destroy(
        &self,
        context: RawContext,
        graph: super::RawGraph,
        on_destroy: Box<dyn FnOnce() + Send>,
    ) -> Result<()> {
        self.enter(context)?;
        /// The user object's destructor: runs the boxed callback once; a
        /// panic never unwinds into the driver.
        unsafe extern "C" fn run(data: *mut c_void) {
            // SAFETY: `data` is the `Box::into_raw` below, handed to the
            // driver once; the driver calls the destructor once.
            let f = unsafe { Box::from_raw(data as *mut Box<dyn FnOnce() + Send>) };
            let _ = catch_unwind(AssertUnwindSafe(f));
        }
        let data = Box::into_raw(Box::new(on_destroy)) as *mut c_void;
        let mut object: sys::CUuserObject = std::ptr::null_mut();
        let created = guard("cuUserObjectCreate", || {
            // SAFETY: `run` takes ownership of `data` when it is called;
            // the flag is the one CUDA requires.
            unsafe {
                sys::cuUserObjectCreate(
                    &mut object,
                    data,
                    Some(run),
                    1,
                    sys::CUuserObject_flags::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as u32,
                )
            }
            .result()
        });
        if let Err(e) = created {
            // SAFETY: the driver refused the object, so it never calls
            // `run`: the box is still ours.
            drop(unsafe { Box::from_raw(data as *mut Box<dyn FnOnce() + Send>) });
            return Err(e);
        }
        guard("cuGraphRetainUserObject", || {
            // SAFETY: `graph` is live in `context` (this fn's contract), and
            // the move hands the graph our one reference.
            unsafe {
                sys::cuGraphRetainUserObject(
                    graph as sys::CUgraph,
                    object,
                    1,
                    sys::CUuserObjectRetain_flags::CU_GRAPH_USER_OBJECT_MOVE as u32,
                )
            }
            .result()
        })
        .inspect_err(|_| {
            // SAFETY: our one reference, not moved: releasing it runs `run`.
            let _ = unsafe { sys::cuUserObjectRelease(object, 1) };
        })
    }

    unsafe fn mem_get_info(&self, context: RawContext) -> Result<(usize, usize)> {
        self.enter(context)?;
        guard("cuMemGetInfo", result::mem_get_info)
    }

    unsafe fn memset_d8(
        &self,
        context: RawContext,
        ptr: DevicePtr,
        value: u8,
        count: usize,
        stream: Option<RawStream>,
    ) -> Result<()> {
        self.enter(context)?;
        match stream {
            // SAFETY: `[ptr, ptr+count)` is live device memory (this fn's contract).
            None => guard("cuMemsetD8", || unsafe {
                result::memset_d8_sync(ptr, value, count)
            }),
            // SAFETY: as above, and `s` is a live stream.
            Some(s) => guard("cuMemsetD8Async", || unsafe {
                result::memset_d8_async(ptr, value, count, s as sys::CUstream)
            }),
        }
    }

    unsafe fn memcpy_htod(
        &self,
        context: RawContext,
        dst: DevicePtr,
        src: *const u8,
        count: usize,
        stream: Option<RawStream>,
    ) -> Result<()> {
        self.enter(context)?;
        match stream {
            // SAFETY: `src` is readable and `dst` live for `count` bytes (this
            // fn's contract); the raw call avoids building a slice that could
            // alias the destination (mapped memory).
            None => guard("cuMemcpyHtoD", || unsafe {
                sys::cuMemcpyHtoD_v2(dst, src as *const c_void, count).result()
            }),
            // SAFETY: as above, and `s` is a live stream.
            Some(s) => guard("cuMemcpyHtoDAsync", || unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, count, s as sys::CUstream)
                    .result()
            }),
        }
    }

    unsafe fn memcpy_dtoh(
        &self,
        context: RawContext,
        dst: *mut u8,
        src: DevicePtr,
        count: usize,
        stream: Option<RawStream>,
    ) -> Result<()> {
        self.enter(context)?;
        match stream {
            // SAFETY: `dst` is writable and `src` live for `count` bytes.
            None => guard("cuMemcpyDtoH", || unsafe {
                sys::cuMemcpyDtoH_v2(dst as *mut c_void, src, count).result()
            }),
            // SAFETY: as above, and `s` is a live stream.
            Some(s) => guard("cuMemcpyDtoHAsync", || unsafe {
                sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, count, s as sys::CUstream)
                    .result()
            }),
        }
    }

    unsafe fn memcpy_dtod(
        &self,
        context: RawContext,
        dst: DevicePtr,
        src: DevicePtr,
        count: usize,
        stream: Option<RawStream>,
    ) -> Result<()> {
        self.enter(context)?;
        // cuMemcpy infers the direction from unified addresses, so it also
        // copies between devices' memory.
        match stream {
            // SAFETY: both ranges are live device memory (this fn's contract).
            None => guard("cuMemcpy", || unsafe {
                sys::cuMemcpy(dst, src, count).result()
            }),
            // SAFETY: as above, and `s` is a live stream.
            Some(s) => guard("cuMemcpyAsync", || unsafe {
                sys::cuMemcpyAsync(dst, src, count, s as sys::CUstream).result()
            }),
        }
    }

    unsafe fn ipc_get_handle(&self, context: RawContext, base: DevicePtr) -> Result<IpcMemHandle> {
        self.enter(context)?;
        let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `base` starts a live allocation of the current context (this
        // fn's contract); the call writes only the local handle.
        guard("cuIpcGetMemHandle", || unsafe {
            sys::cuIpcGetMemHandle(&mut handle, base).result()
        })?;
        Ok(handle.reserved.map(|b| b as u8))
    }

    unsafe fn ipc_open_handle(
        &self,
        context: RawContext,
        handle: &IpcMemHandle,
    ) -> Result<DevicePtr> {
        self.enter(context)?;
        let h = sys::CUipcMemHandle_st {
            reserved: handle.map(|b| b as ::core::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint;
        // SAFETY: `context` is current; the handle is passed by value (the
        // driver validates it) and the call writes only the local pointer.
        guard("cuIpcOpenMemHandle", || unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags).result()
        })?;
        Ok(ptr)
    }

    unsafe fn ipc_close_handle(&self, context: RawContext, mapped: DevicePtr) -> Result<()> {
        self.enter(context)?;
        // SAFETY: `mapped` came from ipc_open_handle in this context and is
        // closed once, with no user left (this fn's contract).
        guard("cuIpcCloseMemHandle", || unsafe {
            sys::cuIpcCloseMemHandle(mapped).result()
        })
    }

    fn pointer_attributes(&self, ptr: DevicePtr) -> Result<PointerAttributes> {
        use sys::CUpointer_attribute_enum as A;
        let mut memory_type: c_uint = 0;
        let mut ordinal: c_int = -1;
        // IS_MANAGED is a C bool; read it through a zeroed word.
        let mut managed: u64 = 0;
        let mut start: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        let mut device_pointer: sys::CUdeviceptr = 0;
        let mut attrs = [
            A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            A::CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
        ];
        let mut data: [*mut c_void; 6] = [
            &mut memory_type as *mut _ as *mut c_void,
            &mut ordinal as *mut _ as *mut c_void,
            &mut managed as *mut _ as *mut c_void,
            &mut start as *mut _ as *mut c_void,
            &mut size as *mut _ as *mut c_void,
            &mut device_pointer as *mut _ as *mut c_void,
        ];
        // SAFETY: `attrs` and `data` have the same length, and each data slot
        // is a live local of the type its attribute writes. The call reads
        // only the driver's tables, for any `ptr`.
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
            device: ordinal.max(0) as usize,
            memory_type,
            is_managed: managed & 0xff != 0,
            range_start: start,
            range_size: size,
            device_accessible: match memory_type {
                MemoryType::Device => true,
                MemoryType::Host => device_pointer != 0,
                MemoryType::Unregistered => false,
            },
        })
    }
}
