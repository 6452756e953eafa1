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
    CallKind, DevicePtr, Driver, DriverKind, MemoryType, PointerAttributes, PrimaryContextState,
    RawContext, RawStream,
};
use crate::error::{
    cuda_error_name, Error, Result, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
};

const SPACE_BASE: u64 = 0x7000_0000_0000;
const SPACE_PER_DEVICE: u64 = 1 << 40;
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

struct Block {
    device: usize,
    data: Vec<u8>,
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
    retains: Vec<u32>,
    current: HashMap<ThreadId, RawContext>,
    calls: HashMap<CallKind, u64>,
    faults: Vec<Fault>,
}

impl State {
    /// Count a call of `kind`, failing it if a fault is armed for this count.
    fn enter(&mut self, kind: CallKind, call: &'static str) -> Result<()> {
        let n = self.calls.entry(kind).or_insert(0);
        *n += 1;
        let n = *n;
        if let Some(i) = self.faults.iter().position(|f| f.kind == kind && f.at == n) {
            let code = self.faults.remove(i).code;
            return Err(Error::cuda(call, code, cuda_error_name(code)));
        }
        Ok(())
    }

    fn find(&self, ptr: DevicePtr) -> Option<(DevicePtr, &Block)> {
        self.blocks
            .range(..=ptr)
            .next_back()
            .filter(|(start, b)| ptr < **start + b.data.len() as u64)
            .map(|(s, b)| (*s, b))
    }

    /// The block holding `[ptr, ptr+count)`, and the offset of `ptr` in it.
    fn span_mut(
        &mut self,
        ptr: DevicePtr,
        count: usize,
        call: &'static str,
    ) -> Result<(&mut Block, usize)> {
        let invalid = || Error::cuda(call, CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE");
        let start = self.find(ptr).map(|(s, _)| s).ok_or_else(invalid)?;
        let block = self.blocks.get_mut(&start).ok_or_else(invalid)?;
        let offset = (ptr - start) as usize;
        if offset + count > block.data.len() {
            return Err(invalid());
        }
        Ok((block, offset))
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

    /// The device whose primary context is `context`, if it is live.
    fn device_of(&self, st: &State, context: RawContext, call: &'static str) -> Result<usize> {
        let invalid = || {
            Error::cuda(
                call,
                CUDA_ERROR_INVALID_CONTEXT,
                "CUDA_ERROR_INVALID_CONTEXT",
            )
        };
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

    /// Number of live simulated device allocations.
    pub fn live_allocations(&self) -> usize {
        self.lock().blocks.len()
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
            return Err(Error::cuda(
                "cuDevicePrimaryCtxRelease",
                CUDA_ERROR_INVALID_CONTEXT,
                "CUDA_ERROR_INVALID_CONTEXT",
            ));
        }
        st.retains[device] -= 1;
        if st.retains[device] == 0 {
            // The context is destroyed, and with it every allocation in it.
            st.blocks.retain(|_, b| b.device != device);
            st.used[device] = 0;
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
        let mut st = self.lock();
        st.enter(CallKind::Synchronize, "cuCtxSynchronize")?;
        self.device_of(&st, context, "cuCtxSynchronize").map(|_| ())
    }

    fn stream_synchronize(&self, context: RawContext, _stream: RawStream) -> Result<()> {
        // The simulator runs everything synchronously.
        let mut st = self.lock();
        st.enter(CallKind::Synchronize, "cuStreamSynchronize")?;
        self.device_of(&st, context, "cuStreamSynchronize")
            .map(|_| ())
    }

    fn stream_query(&self, context: RawContext, _stream: RawStream) -> Result<bool> {
        let mut st = self.lock();
        st.enter(CallKind::Synchronize, "cuStreamQuery")?;
        self.device_of(&st, context, "cuStreamQuery").map(|_| true)
    }

    fn mem_alloc(&self, context: RawContext, size: usize) -> Result<DevicePtr> {
        let mut st = self.lock();
        st.enter(CallKind::MemAlloc, "cuMemAlloc")?;
        let device = self.device_of(&st, context, "cuMemAlloc")?;
        if size == 0 {
            return Err(Error::cuda(
                "cuMemAlloc",
                CUDA_ERROR_INVALID_VALUE,
                "CUDA_ERROR_INVALID_VALUE",
            ));
        }
        if st.used[device].saturating_add(size) > self.config.memory_per_device {
            return Err(Error::cuda(
                "cuMemAlloc",
                CUDA_ERROR_OUT_OF_MEMORY,
                "CUDA_ERROR_OUT_OF_MEMORY",
            ));
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
            at = (*start + block.data.len() as u64).div_ceil(ALIGN) * ALIGN;
        }
        if at + span > hi {
            return Err(Error::cuda(
                "cuMemAlloc",
                CUDA_ERROR_OUT_OF_MEMORY,
                "CUDA_ERROR_OUT_OF_MEMORY",
            ));
        }
        st.blocks.insert(
            at,
            Block {
                device,
                data: vec![0; size],
            },
        );
        st.used[device] += size;
        Ok(at)
    }

    fn mem_free(&self, context: RawContext, ptr: DevicePtr) -> Result<()> {
        let mut st = self.lock();
        st.enter(CallKind::MemFree, "cuMemFree")?;
        self.device_of(&st, context, "cuMemFree")?;
        match st.blocks.remove(&ptr) {
            Some(block) => {
                st.used[block.device] -= block.data.len();
                Ok(())
            }
            None => Err(Error::cuda(
                "cuMemFree",
                CUDA_ERROR_INVALID_VALUE,
                "CUDA_ERROR_INVALID_VALUE",
            )),
        }
    }

    fn mem_get_info(&self, context: RawContext) -> Result<(usize, usize)> {
        let mut st = self.lock();
        st.enter(CallKind::MemGetInfo, "cuMemGetInfo")?;
        let device = self.device_of(&st, context, "cuMemGetInfo")?;
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
        let mut st = self.lock();
        st.enter(CallKind::Memset, "cuMemsetD8")?;
        self.device_of(&st, context, "cuMemsetD8")?;
        if count == 0 {
            return Ok(());
        }
        let (block, off) = st.span_mut(ptr, count, "cuMemsetD8")?;
        block.data[off..off + count].fill(value);
        Ok(())
    }

    fn memcpy_htod(&self, context: RawContext, dst: DevicePtr, src: &[u8]) -> Result<()> {
        let mut st = self.lock();
        st.enter(CallKind::Memcpy, "cuMemcpyHtoD")?;
        self.device_of(&st, context, "cuMemcpyHtoD")?;
        if src.is_empty() {
            return Ok(());
        }
        let (block, off) = st.span_mut(dst, src.len(), "cuMemcpyHtoD")?;
        block.data[off..off + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn memcpy_dtoh(&self, context: RawContext, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        let mut st = self.lock();
        st.enter(CallKind::Memcpy, "cuMemcpyDtoH")?;
        self.device_of(&st, context, "cuMemcpyDtoH")?;
        if dst.is_empty() {
            return Ok(());
        }
        let n = dst.len();
        let (block, off) = st.span_mut(src, n, "cuMemcpyDtoH")?;
        dst.copy_from_slice(&block.data[off..off + n]);
        Ok(())
    }

    fn memcpy_dtod(
        &self,
        context: RawContext,
        dst: DevicePtr,
        src: DevicePtr,
        count: usize,
    ) -> Result<()> {
        let mut st = self.lock();
        st.enter(CallKind::Memcpy, "cuMemcpy")?;
        self.device_of(&st, context, "cuMemcpy")?;
        if count == 0 {
            return Ok(());
        }
        let (block, off) = st.span_mut(src, count, "cuMemcpy")?;
        let bytes = block.data[off..off + count].to_vec();
        let (block, off) = st.span_mut(dst, count, "cuMemcpy")?;
        block.data[off..off + count].copy_from_slice(&bytes);
        Ok(())
    }

    fn pointer_attributes(&self, ptr: DevicePtr) -> Result<PointerAttributes> {
        let mut st = self.lock();
        st.enter(CallKind::PointerAttributes, "cuPointerGetAttributes")?;
        Ok(match st.find(ptr) {
            Some((start, block)) => PointerAttributes {
                context: Self::context_of(block.device),
                device: block.device,
                memory_type: MemoryType::Device,
                is_managed: false,
                range_start: start,
                range_size: block.data.len(),
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
