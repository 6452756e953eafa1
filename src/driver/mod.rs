//! The driver room: the only code that talks to CUDA.
//!
//! [`Driver`] lists every CUDA call the core makes. [`CudaDriver`] forwards
//! them to libcuda through cudarc; [`SimDriver`] simulates them in host memory
//! with fault injection, so the core's logic is tested without a GPU.

mod cuda;
mod sim;

use std::sync::Arc;

pub use cuda::{probe as probe_cuda, CudaDriver};
pub use sim::{SimConfig, SimDriver, SimGraph};

use crate::error::{Error, Result};

/// A `CUcontext`, as an integer (the handle's address).
pub type RawContext = usize;
/// A `CUdeviceptr`.
pub type DevicePtr = u64;
/// A `CUstream`, as an integer; 0 is the legacy default stream.
pub type RawStream = usize;
/// A CUDA graph handle (`CUgraph`), as an integer.
pub type RawGraph = usize;
/// A host address.
pub type HostPtr = usize;

/// `cuMemHostAlloc` flag: pinned for every context.
pub const HOST_ALLOC_PORTABLE: u32 = 1;
/// `cuMemHostAlloc`/`cuMemHostRegister` flag: map into the device address space.
pub const HOST_ALLOC_DEVICEMAP: u32 = 2;
/// `cuMemHostAlloc` flag: write-combined.
pub const HOST_ALLOC_WRITECOMBINED: u32 = 4;
/// `cuMemAllocManaged` flag: accessible from any stream on any device.
pub const MEM_ATTACH_GLOBAL: u32 = 1;
/// `cuMemAllocManaged` flag: host-attached until a stream attaches it.
pub const MEM_ATTACH_HOST: u32 = 2;

/// Which implementation a [`Driver`] is.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DriverKind {
    /// libcuda through cudarc.
    Cuda,
    /// The host-memory simulator.
    Sim,
}

impl DriverKind {
    /// `"cuda"` or `"sim"`.
    pub fn as_str(self) -> &'static str {
        match self {
            DriverKind::Cuda => "cuda",
            DriverKind::Sim => "sim",
        }
    }
}

/// What an address points at, as `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` says.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum MemoryType {
    /// Device memory (including managed memory).
    Device,
    /// Page-locked host memory registered with or allocated by CUDA.
    Host,
    /// Not known to CUDA: plain host memory or garbage.
    Unregistered,
}

/// What the driver knows about an address (`cuPointerGetAttributes`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PointerAttributes {
    /// The device ordinal the memory lives on.
    pub device: usize,
    /// Device, host or unregistered.
    pub memory_type: MemoryType,
    /// Whether it is managed (unified) memory.
    pub is_managed: bool,
    /// Whether the device can reach it: device and managed memory, and
    /// host memory mapped into the device.
    pub device_accessible: bool,
    /// Start of the allocation that contains the address.
    pub range_start: DevicePtr,
    /// Size of that allocation.
    pub range_size: usize,
}

/// `cuDevicePrimaryCtxGetState`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PrimaryContextState {
    /// The context flags.
    pub flags: u32,
    /// Whether the primary context is active (retained at least once).
    pub active: bool,
}

impl PrimaryContextState {
    /// Whether its `cuCtxSynchronize` sleeps while the GPU works rather than
    /// spinning or yielding (`CU_CTX_SCHED_BLOCKING_SYNC`).
    pub fn blocking_sync(&self) -> bool {
        blocking_sync(self.flags)
    }
}

/// Whether context `flags` schedule a blocking sync
/// (`CU_CTX_SCHED_BLOCKING_SYNC` in `CU_CTX_SCHED_MASK`).
pub(crate) fn blocking_sync(flags: u32) -> bool {
    flags & 0x07 == 0x04
}

/// The kinds of call a driver makes; the simulator can fail the Nth of a kind.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CallKind {
    /// `cuDevicePrimaryCtxRetain`
    ContextRetain,
    /// `cuDevicePrimaryCtxRelease`
    ContextRelease,
    /// `cuCtxSetCurrent`/`cuCtxGetCurrent`
    ContextCurrent,
    /// `cuCtxSynchronize`, `cuStreamSynchronize`, `cuStreamQuery`
    Synchronize,
    /// `cuMemAlloc`
    MemAlloc,
    /// `cuMemFree`
    MemFree,
    /// `cuMemGetInfo`
    MemGetInfo,
    /// `cuMemsetD8[Async]`
    Memset,
    /// `cuMemcpy*`
    Memcpy,
    /// `cuPointerGetAttributes`
    PointerAttributes,
    /// `cuMemHostAlloc`
    HostAlloc,
    /// `cuMemFreeHost`
    HostFree,
    /// `cuMemHostRegister`
    HostRegister,
    /// `cuMemHostUnregister`
    HostUnregister,
    /// `cuMemHostGetDevicePointer`
    HostDevicePointer,
    /// `cuMemAllocManaged`
    MemAllocManaged,
    /// device queries: count, name, total memory
    DeviceQuery,
    /// `cuIpcGetMemHandle`, `cuIpcOpenMemHandle`, `cuIpcCloseMemHandle`
    Ipc,
}

impl CallKind {
    /// Every kind, for tests that fail each in turn.
    pub const ALL: [CallKind; 18] = [
        CallKind::ContextRetain,
        CallKind::ContextRelease,
        CallKind::ContextCurrent,
        CallKind::Synchronize,
        CallKind::MemAlloc,
        CallKind::MemFree,
        CallKind::MemGetInfo,
        CallKind::Memset,
        CallKind::Memcpy,
        CallKind::PointerAttributes,
        CallKind::DeviceQuery,
        CallKind::HostAlloc,
        CallKind::HostFree,
        CallKind::HostRegister,
        CallKind::HostUnregister,
        CallKind::HostDevicePointer,
        CallKind::MemAllocManaged,
        CallKind::Ipc,
    ];

    /// The snake-case name used from Python (`"mem_alloc"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            CallKind::ContextRetain => "context_retain",
            CallKind::ContextRelease => "context_release",
            CallKind::ContextCurrent => "context_current",
            CallKind::Synchronize => "synchronize",
            CallKind::MemAlloc => "mem_alloc",
            CallKind::MemFree => "mem_free",
            CallKind::MemGetInfo => "mem_get_info",
            CallKind::Memset => "memset",
            CallKind::Memcpy => "memcpy",
            CallKind::PointerAttributes => "pointer_attributes",
            CallKind::DeviceQuery => "device_query",
            CallKind::HostAlloc => "host_alloc",
            CallKind::HostFree => "host_free",
            CallKind::HostRegister => "host_register",
            CallKind::HostUnregister => "host_unregister",
            CallKind::HostDevicePointer => "host_device_pointer",
            CallKind::MemAllocManaged => "mem_alloc_managed",
            CallKind::Ipc => "ipc",
        }
    }

    /// The kind named `name`, if any.
    pub fn from_name(name: &str) -> Option<CallKind> {
        CallKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// A `CUstream` handle the pool and copies are ordered on: a raw handle
/// (0 and [`STREAM_LEGACY`] are the legacy default stream,
/// [`STREAM_PER_THREAD`] the calling thread's default stream).
pub const STREAM_LEGACY: RawStream = 1;
/// `CU_STREAM_PER_THREAD`.
pub const STREAM_PER_THREAD: RawStream = 2;

/// A `CUipcMemHandle`: 64 opaque bytes.
pub type IpcMemHandle = [u8; 64];

/// Every CUDA call the core makes. Calls that touch memory take the context
/// they act in; the CUDA implementation makes it current when it is not.
///
/// # Safety of the methods
/// Methods marked `unsafe` trust their arguments as libcuda does: a
/// `context` is a primary context this driver retained and has not released;
/// a device address lies in live device (or mapped host) memory of that
/// context for the whole range; a host address is live host memory the
/// caller may read (or, where written, write) for the whole range, and stays
/// so until the call (or, for a copy on a stream, that stream's copy) is done;
/// a `stream` is a live stream of `context` or one of the default handles.
/// The core upholds these through [`Context`](crate::Context), whose
/// pointers and views check liveness and bounds before they call in.
pub trait Driver: Send + Sync + 'static {
    /// Which implementation this is.
    fn kind(&self) -> DriverKind;
    /// `cuDriverGetVersion` (for example 13000).
    fn version(&self) -> Result<i32>;
    /// `cuDeviceGetCount`.
    fn device_count(&self) -> Result<usize>;
    /// `cuDeviceGetName`.
    fn device_name(&self, device: usize) -> Result<String>;
    /// `cuDeviceTotalMem`.
    fn device_total_memory(&self, device: usize) -> Result<usize>;

    /// `cuDevicePrimaryCtxRetain`.
    fn primary_context_retain(&self, device: usize) -> Result<RawContext>;
    /// `cuDevicePrimaryCtxRelease`.
    ///
    /// # Safety
    /// Balances one earlier [`Driver::primary_context_retain`] of `device`;
    /// nothing may use the context through that retain afterwards.
    unsafe fn primary_context_release(&self, device: usize) -> Result<()>;
    /// `cuDevicePrimaryCtxGetState`.
    fn primary_context_state(&self, device: usize) -> Result<PrimaryContextState>;
    /// `cuCtxGetCurrent` (0 when none).
    fn current_context(&self) -> Result<RawContext>;
    /// The device of the current context (`cuCtxGetDevice`), or `None` when
    /// no context is current.
    fn current_device(&self) -> Result<Option<usize>>;
    /// `cuCtxSetCurrent`.
    ///
    /// # Safety
    /// `context` is 0 or live (see the trait's safety section).
    unsafe fn set_current_context(&self, context: RawContext) -> Result<()>;
    /// `cuCtxSynchronize` in `context`: waits for all work queued before the
    /// call on every stream of the context.
    ///
    /// # Safety
    /// `context` is live.
    unsafe fn synchronize(&self, context: RawContext) -> Result<()>;

    /// `cuStreamSynchronize` of `stream` (0, 1 and 2 are the legacy, legacy
    /// and per-thread default streams) in `context`.
    ///
    /// # Safety
    /// `context` and `stream` are live.
    unsafe fn stream_synchronize(&self, context: RawContext, stream: RawStream) -> Result<()>;
    /// `cuStreamQuery`: whether all work on `stream` is done (no waiting).
    ///
    /// # Safety
    /// `context` and `stream` are live.
    unsafe fn stream_query(&self, context: RawContext, stream: RawStream) -> Result<bool>;

    /// `cuMemAlloc` in `context`.
    ///
    /// # Safety
    /// `context` is live.
    unsafe fn mem_alloc(&self, context: RawContext, size: usize) -> Result<DevicePtr>;
    /// `cuMemFree` in `context` (it waits for the device first).
    ///
    /// # Safety
    /// `ptr` came from [`Driver::mem_alloc`] or [`Driver::mem_alloc_managed`]
    /// in `context`, and nothing uses it afterwards.
    unsafe fn mem_free(&self, context: RawContext, ptr: DevicePtr) -> Result<()>;

    /// `cuMemAllocManaged` in `context` (`flags`: [`MEM_ATTACH_GLOBAL`] or
    /// [`MEM_ATTACH_HOST`]). Freed with [`Driver::mem_free`].
    ///
    /// # Safety
    /// `context` is live.
    unsafe fn mem_alloc_managed(
        &self,
        context: RawContext,
        size: usize,
        flags: u32,
    ) -> Result<DevicePtr>;
    /// `cuMemHostAlloc` in `context` (`flags`: `HOST_ALLOC_*`).
    ///
    /// # Safety
    /// `context` is live.
    unsafe fn host_alloc(&self, context: RawContext, size: usize, flags: u32) -> Result<HostPtr>;
    /// `cuMemFreeHost`.
    ///
    /// # Safety
    /// `ptr` came from [`Driver::host_alloc`] and nothing uses it afterwards.
    unsafe fn host_free(&self, context: RawContext, ptr: HostPtr) -> Result<()>;
    /// `cuMemHostRegister` of `[ptr, ptr+size)` (`flags`: portable, devicemap).
    ///
    /// # Safety
    /// The range is live host memory that stays allocated, and in place,
    /// until [`Driver::host_unregister`].
    unsafe fn host_register(
        &self,
        context: RawContext,
        ptr: HostPtr,
        size: usize,
        flags: u32,
    ) -> Result<()>;
    /// `cuMemHostUnregister`.
    ///
    /// # Safety
    /// `ptr` was registered with [`Driver::host_register`] in `context`.
    unsafe fn host_unregister(&self, context: RawContext, ptr: HostPtr) -> Result<()>;
    /// `cuMemHostGetDevicePointer`: the device address of mapped host memory.
    ///
    /// # Safety
    /// `context` is live.
    unsafe fn host_device_pointer(&self, context: RawContext, ptr: HostPtr) -> Result<DevicePtr>;
    /// `cuMemGetInfo` in `context`: (free, total).
    ///
    /// # Safety
    /// `context` is live.
    unsafe fn mem_get_info(&self, context: RawContext) -> Result<(usize, usize)>;
    /// `cuMemsetD8` (`stream` `None`) or `cuMemsetD8Async` on `stream`.
    ///
    /// # Safety
    /// `[ptr, ptr+count)` is live device memory of `context` (see the trait).
    unsafe fn memset_d8(
        &self,
        context: RawContext,
        ptr: DevicePtr,
        value: u8,
        count: usize,
        stream: Option<RawStream>,
    ) -> Result<()>;
    /// `cuMemcpyHtoD[Async]` of `count` bytes from host `src` to `dst`. On a
    /// stream, it returns once `src` may be reused: the driver stages
    /// pageable memory, and the caller synchronizes for pinned memory.
    ///
    /// # Safety
    /// `src` is readable and `dst` live device memory for `count` bytes.
    unsafe fn memcpy_htod(
        &self,
        context: RawContext,
        dst: DevicePtr,
        src: *const u8,
        count: usize,
        stream: Option<RawStream>,
    ) -> Result<()>;
    /// `cuMemcpyDtoH[Async]` of `count` bytes from `src` to host `dst`.
    ///
    /// # Safety
    /// `dst` is writable and `src` live device memory for `count` bytes.
    unsafe fn memcpy_dtoh(
        &self,
        context: RawContext,
        dst: *mut u8,
        src: DevicePtr,
        count: usize,
        stream: Option<RawStream>,
    ) -> Result<()>;
    /// `cuMemcpy[Async]` between device addresses (unified addressing, so
    /// peers work).
    ///
    /// # Safety
    /// Both ranges are live device memory for `count` bytes.
    unsafe fn memcpy_dtod(
        &self,
        context: RawContext,
        dst: DevicePtr,
        src: DevicePtr,
        count: usize,
        stream: Option<RawStream>,
    ) -> Result<()>;

    /// `cuPointerGetAttributes`: context, device, memory type and range.
    /// Only reads the driver's tables; any address is fine.
    fn pointer_attributes(&self, ptr: DevicePtr) -> Result<PointerAttributes>;

    /// `cuIpcGetMemHandle`: a handle another process can open to map the
    /// allocation that starts at `base`.
    ///
    /// # Safety
    /// `base` is the start of a live `cuMemAlloc` allocation of `context`.
    unsafe fn ipc_get_handle(&self, context: RawContext, base: DevicePtr) -> Result<IpcMemHandle>;
    /// `cuIpcOpenMemHandle` (with lazy peer access): map the allocation a
    /// handle names into `context`; the address it is mapped at. The handle
    /// is only data: a stale or forged one fails, it does not map.
    ///
    /// # Safety
    /// `context` is live.
    unsafe fn ipc_open_handle(
        &self,
        context: RawContext,
        handle: &IpcMemHandle,
    ) -> Result<DevicePtr>;
    /// `cuIpcCloseMemHandle`: unmap what [`Driver::ipc_open_handle`] mapped.
    ///
    /// # Safety
    /// `mapped` was returned by `ipc_open_handle` in `context`, is closed once,
    /// and nothing uses it afterwards.
    unsafe fn ipc_close_handle(&self, context: RawContext, mapped: DevicePtr) -> Result<()>;

    /// `cuThreadExchangeStreamCaptureMode`: set the calling thread's
    /// capture mode to `mode`; the mode it had.
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode>;

    /// `cuStreamGetCaptureInfo`: the capture `stream` takes part in now, if
    /// any, as its id and the graph being captured.
    ///
    /// # Safety
    /// `stream` is a live stream of `context` (or a default-stream handle).
    unsafe fn stream_capture(
        &self,
        context: RawContext,
        stream: RawStream,
    ) -> Result<Option<(u64, RawGraph)>>;

    /// `cuUserObjectCreate` + `cuGraphRetainUserObject`: `graph` owns
    /// `on_destroy`, which runs once the graph and every executable graph
    /// made from it are destroyed and their launches have finished. It may
    /// run on a thread of the driver's, and must make no CUDA call. On
    /// `Err` it either never runs or runs at once; the caller tells which
    /// apart itself (gpuptr arms the destructor only once this returns `Ok`).
    ///
    /// # Safety
    /// `graph` is a live graph of `context` (one [`Driver::stream_capture`]
    /// returned, during that capture).
    unsafe fn graph_on_destroy(
        &self,
        context: RawContext,
        graph: RawGraph,
        on_destroy: Box<dyn FnOnce() + Send>,
    ) -> Result<()>;

    /// The simulator behind this driver, for tests that inject faults.
    fn as_sim(&self) -> Option<&SimDriver> {
        None
    }
}

/// A thread's stream-capture mode (`CUstreamCaptureMode`): which driver
/// calls it may make while a stream captures.
///
/// Measured on an H200 (driver 580, `benches/capture_probe.py`): while one
/// thread captures in global mode, a thread in global mode that calls
/// `cuMemAlloc`, `cuMemFree`, `cuCtxSynchronize`, `cuStreamSynchronize`,
/// `cuStreamQuery` or `cuEventRecord` on any stream gets
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, and the capture is invalidated;
/// in relaxed or thread-local mode all of those succeed and leave the
/// capture intact, except `cuCtxSynchronize`, which fails and invalidates
/// the capture in every mode. `cuMemGetInfo` is allowed in every mode.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// `CU_STREAM_CAPTURE_MODE_GLOBAL`, every thread's default.
    Global = 0,
    /// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`.
    ThreadLocal = 1,
    /// `CU_STREAM_CAPTURE_MODE_RELAXED`.
    Relaxed = 2,
}

/// Run `f` with the calling thread in relaxed capture mode, then put the
/// thread's mode back, as PyTorch's caching allocator guards `cudaMalloc`:
/// gpuptr's own allocations and frees then never fail, nor invalidate a
/// capture, because some thread captures a stream.
pub(crate) fn relaxed<R>(driver: &dyn Driver, f: impl FnOnce() -> R) -> R {
    let before = driver.exchange_capture_mode(CaptureMode::Relaxed);
    let r = f();
    if let Ok(mode) = before {
        if mode != CaptureMode::Relaxed {
            let _ = driver.exchange_capture_mode(mode);
        }
    }
    r
}

/// How to pick the driver: the value of `GPUPTR_DRIVER`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum DriverChoice {
    /// `auto` (or unset): the CUDA driver.
    Auto,
    /// `cuda`: the CUDA driver.
    Cuda,
    /// `sim`: the simulator, configured by `GPUPTR_SIM_DEVICES` and `GPUPTR_SIM_MEMORY`.
    Sim,
}

impl DriverChoice {
    /// Parse a `GPUPTR_DRIVER` value (case-insensitive; empty means auto).
    pub fn parse(value: &str) -> Result<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(DriverChoice::Auto),
            "cuda" => Ok(DriverChoice::Cuda),
            "sim" => Ok(DriverChoice::Sim),
            other => Err(Error::NoDriver(format!(
                "GPUPTR_DRIVER={other:?} is not a driver; use auto, cuda or sim"
            ))),
        }
    }

    /// Read `GPUPTR_DRIVER` from the environment. A value that is no
    /// UTF-8 text names no driver either.
    pub fn from_env() -> Result<Self> {
        match crate::config::text(crate::config::DRIVER) {
            Ok(v) => DriverChoice::parse(&v),
            Err(Error::InvalidArgument(why)) => {
                Err(Error::NoDriver(format!("{why}; use auto, cuda or sim")))
            }
            Err(e) => Err(e),
        }
    }
}

/// Make the driver `choice` asks for. The CUDA driver is probed first, so a
/// missing or too-old libcuda gives [`Error::NoDriver`], never a panic.
pub fn open(choice: DriverChoice) -> Result<Arc<dyn Driver>> {
    match choice {
        DriverChoice::Auto | DriverChoice::Cuda => Ok(Arc::new(CudaDriver::new()?)),
        DriverChoice::Sim => Ok(Arc::new(SimDriver::new(SimConfig::from_env()?))),
    }
}
