//! [`SimDriver`]: a deterministic host-memory simulator of the CUDA calls in
//! [`Driver`], with fault injection.
//!
//! Each simulated device owns a 1 TiB slice of a fake address space; blocks
//! are placed first-fit from the bottom, so a freed address is handed out
//! again, as a real allocator does. Device memory is backed by host vectors
//! and never dereferenced through the fake address.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::thread::ThreadId;

use super::{
    CallKind, DevicePtr, Driver, DriverKind, HostPtr, MemoryType, PointerAttributes,
    PrimaryContextState, RawContext, RawEvent, RawStream, HOST_ALLOC_DEVICEMAP,
};
use crate::error::{
    cuda_error_name, Error, Result, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY,
};

// Below where Linux puts the heap and mmaps, so simulated device addresses
// never collide with the real host addresses of simulated pinned memory.
const SPACE_BASE: u64 = 0x2000_0000_0000;
const SPACE_PER_DEVICE: u64 = 1 << 40;

/// The error a failed driver call `call` returns with `code`.
fn err(call: &'static str, code: i32) -> Error {
    Error::cuda(call, code, cuda_error_name(code))
}
const ALIGN: u64 = 512;
const CONTEXT_BASE: RawContext = 0x5100_0000;

/// How the simulator is set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// Number of simulated devices.
    pub devices: usize,
    /// Memory of each device, in bytes.
    pub memory_per_device: usize,
    /// The driver version reported (`cuDriverGetVersion`).
    pub version: i32,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            devices: 1,
            memory_per_device: 1 << 30,
            version: 13000,
        }
    }
}

impl SimConfig {
    /// `devices` devices of `memory_per_device` bytes each.
    pub fn new(devices: usize, memory_per_device: usize) -> Self {
        SimConfig {
            devices,
            memory_per_device,
            ..SimConfig::default()
        }
    }

    /// Read `GPUPTR_SIM_DEVICES` (default 1) and `GPUPTR_SIM_MEMORY` (bytes,
    /// default 1 GiB).
    pub fn from_env() -> Result<Self> {
        fn read(name: &str, default: usize) -> Result<usize> {
            match std::env::var(name) {
                Ok(v) if !v.trim().is_empty() => v.trim().parse().map_err(|_| {
                    Error::InvalidArgument(format!("{name}={v:?} is not a non-negative integer"))
                }),
                _ => Ok(default),
            }
        }
        let d = SimConfig::default();
        Ok(SimConfig {
            devices: read("GPUPTR_SIM_DEVICES", d.devices)?,
            memory_per_device: read("GPUPTR_SIM_MEMORY", d.memory_per_device)?,
            version: d.version,
        })
    }
}

/// Host memory the simulator allocated itself (pinned or managed), at a
/// real, stable address.
struct HostBuf {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: the buffer is plain bytes owned by the simulator's state, and all
// access goes through the state's lock.
unsafe impl Send for HostBuf {}

impl HostBuf {
    fn new(size: usize) -> Option<HostBuf> {
        let layout = std::alloc::Layout::from_size_align(size.max(1), 4096).ok()?;
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        (!ptr.is_null()).then_some(HostBuf { ptr, layout })
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Kind {
    Device,
    Managed,
    Pinned { mapped: bool },
    Registered { mapped: bool },
}

enum Storage {
    /// Simulated device memory, only reachable through the driver.
    Device(Vec<u8>),
    /// Real host memory the simulator owns.
    Host(HostBuf),
    /// Real host memory someone else owns (registered).
    Foreign,
}

struct Block {
    device: usize,
    kind: Kind,
    len: usize,
    storage: Storage,
}

impl Block {
    fn bytes_mut(&mut self, start: DevicePtr) -> &mut [u8] {
        match &mut self.storage {
            Storage::Device(v) => v,
            // SAFETY: host blocks are live host memory of `len` bytes at
            // `start` (ours, or registered by a caller who keeps it alive).
            Storage::Host(h) => unsafe { std::slice::from_raw_parts_mut(h.ptr, self.len) },
            Storage::Foreign => unsafe {
                std::slice::from_raw_parts_mut(start as usize as *mut u8, self.len)
            },
        }
    }

    fn counts_as_device(&self) -> bool {
        matches!(self.kind, Kind::Device | Kind::Managed)
    }
}

struct Fault {
    kind: CallKind,
    at: u64,
    code: i32,
}

#[derive(Default)]
struct State {
    blocks: BTreeMap<DevicePtr, Block>,
    used: Vec<usize>,
    host_used: usize,
    retains: Vec<u32>,
    current: HashMap<ThreadId, RawContext>,
    calls: HashMap<CallKind, u64>,
    faults: Vec<Fault>,
    /// Live events (the simulator completes all work at once, so a recorded
    /// event is always done).
    events: HashMap<RawEvent, usize>,
    next_event: RawEvent,
}

impl State {
    /// Count a call of `kind`, failing it if a fault is armed for this count.
    fn enter(&mut self, kind: CallKind, call: &'static str) -> Result<()> {
        let n = self.calls.entry(kind).or_insert(0);
        *n += 1;
        let n = *n;
        if let Some(i) = self.faults.iter().position(|f| f.kind == kind && f.at == n) {
            let code = self.faults.remove(i).code;
            return Err(err(call, code));
        }
        Ok(())
    }

    fn find(&self, ptr: DevicePtr) -> Option<(DevicePtr, &Block)> {
        self.blocks
            .range(..=ptr)
            .next_back()
            .filter(|(start, b)| ptr < **start + b.len as u64)
            .map(|(s, b)| (*s, b))
    }

    fn remove(&mut self, start: DevicePtr) -> Option<Block> {
        let block = self.blocks.remove(&start)?;
        if block.counts_as_device() {
            self.used[block.device] -= block.len;
        } else if matches!(block.kind, Kind::Pinned { .. }) {
            self.host_used -= block.len;
        }
        Some(block)
    }

    /// The bytes `[ptr, ptr+count)`, which must lie in one device-accessible
    /// block (device, managed, or mapped host memory).
    fn span_mut(&mut self, ptr: DevicePtr, count: usize, call: &'static str) -> Result<&mut [u8]> {
        let invalid = || err(call, CUDA_ERROR_INVALID_VALUE);
        let start = self.find(ptr).map(|(s, _)| s).ok_or_else(invalid)?;
        let block = self.blocks.get_mut(&start).ok_or_else(invalid)?;
        let reachable = match block.kind {
            Kind::Device | Kind::Managed => true,
            Kind::Pinned { mapped } | Kind::Registered { mapped } => mapped,
        };
        let offset = (ptr - start) as usize;
        if !reachable || offset + count > block.len {
            return Err(invalid());
        }
        Ok(&mut block.bytes_mut(start)[offset..offset + count])
    }
}

/// The simulator. Thread-safe; every call takes one lock.
pub struct SimDriver {
    config: SimConfig,
    state: Mutex<State>,
}

impl std::fmt::Debug for SimDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDriver")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl SimDriver {
    /// A simulator set up as `config` says.
    pub fn new(config: SimConfig) -> Self {
        let state = State {
            used: vec![0; config.devices],
            retains: vec![0; config.devices],
            ..State::default()
        };
        SimDriver {
            config,
            state: Mutex::new(state),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A poisoned lock only means a test thread panicked; the state is intact.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_device(&self, device: usize) -> Result<()> {
        if device >= self.config.devices {
            return Err(Error::InvalidArgument(format!(
                "device {device} does not exist ({} device(s) present)",
                self.config.devices
            )));
        }
        Ok(())
    }

    fn context_of(device: usize) -> RawContext {
        CONTEXT_BASE + device * 0x1000
    }

    /// Start a call on a context: take the state, count the call (failing
    /// it if a fault is due) and check the context is live. Returns the
    /// state and the context's device.
    fn begin(
        &self,
        kind: CallKind,
        call: &'static str,
        context: RawContext,
    ) -> Result<(std::sync::MutexGuard<'_, State>, usize)> {
        let mut st = self.lock();
        st.enter(kind, call)?;
        let device = self.device_of(&st, context, call)?;
        Ok((st, device))
    }

    /// Free the block starting at `ptr` if `is_kind` accepts it.
    fn free_block(
        &self,
        kind: CallKind,
        call: &'static str,
        context: RawContext,
        ptr: DevicePtr,
        is_kind: impl Fn(&Block) -> bool,
    ) -> Result<()> {
        let (mut st, _) = self.begin(kind, call, context)?;
        match st.blocks.get(&ptr) {
            Some(b) if is_kind(b) => {
                st.remove(ptr);
                Ok(())
            }
            _ => Err(err(call, CUDA_ERROR_INVALID_VALUE)),
        }
    }

    /// The device whose primary context is `context`, if it is live.
    fn device_of(&self, st: &State, context: RawContext, call: &'static str) -> Result<usize> {
        let invalid = || err(call, CUDA_ERROR_INVALID_CONTEXT);
        let off = context.checked_sub(CONTEXT_BASE).ok_or_else(invalid)?;
        if off % 0x1000 != 0 {
            return Err(invalid());
        }
        let device = off / 0x1000;
        if device >= self.config.devices || st.retains[device] == 0 {
            return Err(invalid());
        }
        Ok(device)
    }

    fn event_op(&self, context: RawContext, event: RawEvent, call: &'static str) -> Result<()> {
        let (st, _) = self.begin(CallKind::Event, call, context)?;
        if !st.events.contains_key(&event) {
            return Err(err(call, CUDA_ERROR_INVALID_HANDLE));
        }
        Ok(())
    }

    /// Number of live events.
    pub fn live_events(&self) -> usize {
        self.lock().events.len()
    }

    /// Fail the `nth` call of `kind` from now on (1 = the next one) with `code`.
    pub fn fail_nth(&self, kind: CallKind, nth: u64, code: i32) {
        let mut st = self.lock();
        let base = st.calls.get(&kind).copied().unwrap_or(0);
        st.faults.push(Fault {
            kind,
            at: base + nth.max(1),
            code,
        });
    }

    /// Drop every armed fault.
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// How many calls of `kind` were made.
    pub fn calls(&self, kind: CallKind) -> u64 {
        self.lock().calls.get(&kind).copied().unwrap_or(0)
    }

    /// Bytes of simulated device memory allocated now, over all devices.
    pub fn live_bytes(&self) -> usize {
        self.lock().used.iter().sum()
    }

    /// Number of live simulated device allocations (device and managed).
    pub fn live_allocations(&self) -> usize {
        self.lock()
            .blocks
            .values()
            .filter(|b| b.counts_as_device())
            .count()
    }

    /// Bytes of pinned host memory allocated now.
    pub fn live_host_bytes(&self) -> usize {
        self.lock().host_used
    }

    /// Number of host ranges registered now.
    pub fn live_registrations(&self) -> usize {
        self.lock()
            .blocks
            .values()
            .filter(|b| matches!(b.kind, Kind::Registered { .. }))
            .count()
    }

    /// The primary-context retain count of `device`.
    pub fn retain_count(&self, device: usize) -> u32 {
        self.lock().retains.get(device).copied().unwrap_or(0)
    }

    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }
}

impl Driver for SimDriver {
    fn kind(&self) -> DriverKind {
        DriverKind::Sim
    }

    fn as_sim(&self) -> Option<&SimDriver> {
        Some(self)
    }

    fn version(&self) -> Result<i32> {
        Ok(self.config.version)
    }

    fn device_count(&self) -> Result<usize> {
        self.lock()
            .enter(CallKind::DeviceQuery, "cuDeviceGetCount")?;
        Ok(self.config.devices)
    }

    fn device_name(&self, device: usize) -> Result<String> {
        self.check_device(device)?;
        self.lock()
            .enter(CallKind::DeviceQuery, "cuDeviceGetName")?;
        Ok(format!("gpuptr simulated device {device}"))
    }

    fn device_total_memory(&self, device: usize) -> Result<usize> {
        self.check_device(device)?;
        self.lock()
            .enter(CallKind::DeviceQuery, "cuDeviceTotalMem")?;
        Ok(self.config.memory_per_device)
    }

    fn primary_context_retain(&self, device: usize) -> Result<RawContext> {
        self.check_device(device)?;
        let mut st = self.lock();
        st.enter(CallKind::ContextRetain, "cuDevicePrimaryCtxRetain")?;
        st.retains[device] += 1;
        Ok(Self::context_of(device))
    }

    fn primary_context_release(&self, device: usize) -> Result<()> {
        self.check_device(device)?;
        let mut st = self.lock();
        st.enter(CallKind::ContextRelease, "cuDevicePrimaryCtxRelease")?;
        if st.retains[device] == 0 {
            return Err(err("cuDevicePrimaryCtxRelease", CUDA_ERROR_INVALID_CONTEXT));
        }
        st.retains[device] -= 1;
        if st.retains[device] == 0 {
            // The context is destroyed, and with it every allocation in it.
            let gone: Vec<DevicePtr> = st
                .blocks
                .iter()
                .filter(|(_, b)| b.device == device)
                .map(|(s, _)| *s)
                .collect();
            for start in gone {
                st.remove(start);
            }
            let ctx = Self::context_of(device);
            st.current.retain(|_, c| *c != ctx);
        }
        Ok(())
    }

    fn primary_context_state(&self, device: usize) -> Result<PrimaryContextState> {
        self.check_device(device)?;
        let st = self.lock();
        Ok(PrimaryContextState {
            flags: 0,
            active: st.retains[device] > 0,
        })
    }

    fn current_context(&self) -> Result<RawContext> {
        let mut st = self.lock();
        st.enter(CallKind::ContextCurrent, "cuCtxGetCurrent")?;
        Ok(st
            .current
            .get(&std::thread::current().id())
            .copied()
            .unwrap_or(0))
    }

    fn current_device(&self) -> Result<Option<usize>> {
        let raw = self.current_context()?;
        Ok((raw != 0).then(|| (raw - CONTEXT_BASE) / 0x1000))
    }

    fn set_current_context(&self, context: RawContext) -> Result<()> {
        let mut st = self.lock();
        st.enter(CallKind::ContextCurrent, "cuCtxSetCurrent")?;
        if context != 0 {
            self.device_of(&st, context, "cuCtxSetCurrent")?;
        }
        st.current.insert(std::thread::current().id(), context);
        Ok(())
    }

    fn synchronize(&self, context: RawContext) -> Result<()> {
        self.begin(CallKind::Synchronize, "cuCtxSynchronize", context)
            .map(|_| ())
    }

    fn stream_synchronize(&self, context: RawContext, _stream: RawStream) -> Result<()> {
        // The simulator runs everything synchronously.
        self.begin(CallKind::Synchronize, "cuStreamSynchronize", context)
            .map(|_| ())
    }

    fn stream_query(&self, context: RawContext, _stream: RawStream) -> Result<bool> {
        self.begin(CallKind::Synchronize, "cuStreamQuery", context)
            .map(|_| true)
    }

    fn mem_alloc(&self, context: RawContext, size: usize) -> Result<DevicePtr> {
        let (mut st, device) = self.begin(CallKind::MemAlloc, "cuMemAlloc", context)?;
        if size == 0 {
            return Err(err("cuMemAlloc", CUDA_ERROR_INVALID_VALUE));
        }
        if st.used[device].saturating_add(size) > self.config.memory_per_device {
            return Err(err("cuMemAlloc", CUDA_ERROR_OUT_OF_MEMORY));
        }
        // First fit from the bottom of this device's slice.
        let lo = SPACE_BASE + device as u64 * SPACE_PER_DEVICE;
        let hi = lo + SPACE_PER_DEVICE;
        let span = (size as u64).div_ceil(ALIGN) * ALIGN;
        let mut at = lo;
        for (start, block) in st.blocks.range(lo..hi) {
            if *start >= at + span {
                break;
            }
            at = (*start + block.len as u64).div_ceil(ALIGN) * ALIGN;
        }
        if at + span > hi {
            return Err(err("cuMemAlloc", CUDA_ERROR_OUT_OF_MEMORY));
        }
        st.blocks.insert(
            at,
            Block {
                device,
                kind: Kind::Device,
                len: size,
                storage: Storage::Device(vec![0; size]),
            },
        );
        st.used[device] += size;
        Ok(at)
    }

    fn mem_alloc_async(
        &self,
        context: RawContext,
        size: usize,
        _stream: RawStream,
    ) -> Result<DevicePtr> {
        self.mem_alloc(context, size)
    }

    fn mem_free_async(
        &self,
        context: RawContext,
        ptr: DevicePtr,
        _stream: RawStream,
    ) -> Result<()> {
        self.mem_free(context, ptr)
    }

    fn event_create(&self, context: RawContext) -> Result<RawEvent> {
        let (mut st, device) = self.begin(CallKind::Event, "cuEventCreate", context)?;
        st.next_event += 1;
        let e = 0xE000_0000 + st.next_event;
        st.events.insert(e, device);
        Ok(e)
    }

    fn event_record(&self, context: RawContext, event: RawEvent, _stream: RawStream) -> Result<()> {
        self.event_op(context, event, "cuEventRecord")
    }

    fn event_query(&self, context: RawContext, event: RawEvent) -> Result<bool> {
        self.event_op(context, event, "cuEventQuery").map(|_| true)
    }

    fn event_synchronize(&self, context: RawContext, event: RawEvent) -> Result<()> {
        self.event_op(context, event, "cuEventSynchronize")
    }

    fn event_destroy(&self, context: RawContext, event: RawEvent) -> Result<()> {
        self.event_op(context, event, "cuEventDestroy")?;
        self.lock().events.remove(&event);
        Ok(())
    }

    fn mem_alloc_managed(
        &self,
        context: RawContext,
        size: usize,
        _flags: u32,
    ) -> Result<DevicePtr> {
        let (mut st, device) =
            self.begin(CallKind::MemAllocManaged, "cuMemAllocManaged", context)?;
        let oom = || err("cuMemAllocManaged", CUDA_ERROR_OUT_OF_MEMORY);
        if size == 0 {
            return Err(err("cuMemAllocManaged", CUDA_ERROR_INVALID_VALUE));
        }
        if st.used[device].saturating_add(size) > self.config.memory_per_device {
            return Err(oom());
        }
        // Managed memory is reachable from the host at the same address.
        let buf = HostBuf::new(size).ok_or_else(oom)?;
        let at = buf.ptr as DevicePtr;
        st.blocks.insert(
            at,
            Block {
                device,
                kind: Kind::Managed,
                len: size,
                storage: Storage::Host(buf),
            },
        );
        st.used[device] += size;
        Ok(at)
    }

    fn host_alloc(&self, context: RawContext, size: usize, flags: u32) -> Result<HostPtr> {
        let (mut st, device) = self.begin(CallKind::HostAlloc, "cuMemHostAlloc", context)?;
        if size == 0 {
            return Err(err("cuMemHostAlloc", CUDA_ERROR_INVALID_VALUE));
        }
        let buf =
            HostBuf::new(size).ok_or_else(|| err("cuMemHostAlloc", CUDA_ERROR_OUT_OF_MEMORY))?;
        let at = buf.ptr as HostPtr;
        let mapped = flags & HOST_ALLOC_DEVICEMAP != 0;
        st.blocks.insert(
            at as DevicePtr,
            Block {
                device,
                kind: Kind::Pinned { mapped },
                len: size,
                storage: Storage::Host(buf),
            },
        );
        st.host_used += size;
        Ok(at)
    }

    fn host_free(&self, context: RawContext, ptr: HostPtr) -> Result<()> {
        self.free_block(
            CallKind::HostFree,
            "cuMemFreeHost",
            context,
            ptr as DevicePtr,
            |b| matches!(b.kind, Kind::Pinned { .. }),
        )
    }

    fn host_register(
        &self,
        context: RawContext,
        ptr: HostPtr,
        size: usize,
        flags: u32,
    ) -> Result<()> {
        let (mut st, device) = self.begin(CallKind::HostRegister, "cuMemHostRegister", context)?;
        let start = ptr as DevicePtr;
        let overlaps = st
            .blocks
            .range(..start + size as u64)
            .next_back()
            .is_some_and(|(s, b)| *s + b.len as u64 > start);
        if size == 0 || ptr == 0 || overlaps {
            // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED is 712; the sim keeps it simple.
            return Err(err("cuMemHostRegister", CUDA_ERROR_INVALID_VALUE));
        }
        let mapped = flags & HOST_ALLOC_DEVICEMAP != 0;
        st.blocks.insert(
            start,
            Block {
                device,
                kind: Kind::Registered { mapped },
                len: size,
                storage: Storage::Foreign,
            },
        );
        Ok(())
    }

    fn host_unregister(&self, context: RawContext, ptr: HostPtr) -> Result<()> {
        self.free_block(
            CallKind::HostUnregister,
            "cuMemHostUnregister",
            context,
            ptr as DevicePtr,
            |b| matches!(b.kind, Kind::Registered { .. }),
        )
    }

    fn host_device_pointer(&self, context: RawContext, ptr: HostPtr) -> Result<DevicePtr> {
        let (st, _) = self.begin(
            CallKind::HostDevicePointer,
            "cuMemHostGetDevicePointer",
            context,
        )?;
        let invalid = || err("cuMemHostGetDevicePointer", CUDA_ERROR_INVALID_VALUE);
        let (_, block) = st.find(ptr as DevicePtr).ok_or_else(invalid)?;
        match block.kind {
            // Unified addressing: the device sees mapped host memory at its host address.
            Kind::Pinned { mapped: true } | Kind::Registered { mapped: true } => {
                Ok(ptr as DevicePtr)
            }
            _ => Err(invalid()),
        }
    }

    fn mem_free(&self, context: RawContext, ptr: DevicePtr) -> Result<()> {
        self.free_block(
            CallKind::MemFree,
            "cuMemFree",
            context,
            ptr,
            Block::counts_as_device,
        )
    }

    fn mem_get_info(&self, context: RawContext) -> Result<(usize, usize)> {
        let (st, device) = self.begin(CallKind::MemGetInfo, "cuMemGetInfo", context)?;
        let total = self.config.memory_per_device;
        Ok((total - st.used[device], total))
    }

    fn memset_d8(
        &self,
        context: RawContext,
        ptr: DevicePtr,
        value: u8,
        count: usize,
        _stream: RawStream,
    ) -> Result<()> {
        let (mut st, _) = self.begin(CallKind::Memset, "cuMemsetD8", context)?;
        if count == 0 {
            return Ok(());
        }
        st.span_mut(ptr, count, "cuMemsetD8")?.fill(value);
        Ok(())
    }

    fn memcpy_htod(&self, context: RawContext, dst: DevicePtr, src: &[u8]) -> Result<()> {
        let (mut st, _) = self.begin(CallKind::Memcpy, "cuMemcpyHtoD", context)?;
        if src.is_empty() {
            return Ok(());
        }
        st.span_mut(dst, src.len(), "cuMemcpyHtoD")?
            .copy_from_slice(src);
        Ok(())
    }

    fn memcpy_dtoh(&self, context: RawContext, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        let (mut st, _) = self.begin(CallKind::Memcpy, "cuMemcpyDtoH", context)?;
        if dst.is_empty() {
            return Ok(());
        }
        let n = dst.len();
        dst.copy_from_slice(st.span_mut(src, n, "cuMemcpyDtoH")?);
        Ok(())
    }

    fn memcpy_dtod(
        &self,
        context: RawContext,
        dst: DevicePtr,
        src: DevicePtr,
        count: usize,
    ) -> Result<()> {
        let (mut st, _) = self.begin(CallKind::Memcpy, "cuMemcpy", context)?;
        if count == 0 {
            return Ok(());
        }
        let bytes = st.span_mut(src, count, "cuMemcpy")?.to_vec();
        st.span_mut(dst, count, "cuMemcpy")?.copy_from_slice(&bytes);
        Ok(())
    }

    fn pointer_attributes(&self, ptr: DevicePtr) -> Result<PointerAttributes> {
        let mut st = self.lock();
        st.enter(CallKind::PointerAttributes, "cuPointerGetAttributes")?;
        Ok(match st.find(ptr) {
            Some((start, block)) => PointerAttributes {
                context: Self::context_of(block.device),
                device: block.device,
                memory_type: match block.kind {
                    Kind::Device | Kind::Managed => MemoryType::Device,
                    Kind::Pinned { .. } | Kind::Registered { .. } => MemoryType::Host,
                },
                is_managed: block.kind == Kind::Managed,
                range_start: start,
                range_size: block.len,
            },
            None => PointerAttributes {
                context: 0,
                device: 0,
                memory_type: MemoryType::Unregistered,
                is_managed: false,
                range_start: 0,
                range_size: 0,
            },
        })
    }
}
