//! [`SimDriver`]: a deterministic host-memory simulator of the CUDA calls in
//! [`Driver`], with fault injection.
//!
//! Each simulated device owns a 1 TiB slice of a fake address space; blocks
//! are placed first-fit from the bottom, so a freed address is handed out
//! again, as a real allocator does. Device memory is backed by host vectors
//! and never dereferenced through the fake address.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;

use super::{
    CallKind, DevicePtr, Driver, DriverKind, HostPtr, IpcMemHandle, MemoryType, PointerAttributes,
    PrimaryContextState, RawContext, RawStream, HOST_ALLOC_DEVICEMAP, STREAM_LEGACY,
};
use crate::error::{
    cuda_error_name, Error, Result, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
};

/// The byte freed simulator host memory is filled with.
pub const POISON: u8 = 0xDB;
/// Freed host buffers are kept (poisoned, unreachable) up to this many bytes,
/// so a stale access finds poison rather than someone else's new buffer.
const QUARANTINE_BYTES: usize = 64 << 20;
/// `GPUPTR_SIM_DEVICES` above this is refused (each device has state).
const MAX_DEVICES: usize = 1024;

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
/// The first bytes of the simulator's IPC handles.
const SIM_IPC_MAGIC: &[u8; 8] = b"gpuptrSM";

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
        use crate::config::{usize_or as read, SIM_DEVICES, SIM_MEMORY};
        let d = SimConfig::default();
        let devices = read(SIM_DEVICES, d.devices)?;
        if devices > MAX_DEVICES {
            return Err(Error::InvalidArgument(format!(
                "GPUPTR_SIM_DEVICES={devices} is more than the simulator's {MAX_DEVICES}"
            )));
        }
        Ok(SimConfig {
            devices,
            memory_per_device: read(SIM_MEMORY, d.memory_per_device)?,
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

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is our own live allocation of `layout.size()` bytes,
        // borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
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
    /// The block's bytes: a raw pointer, since host blocks may be reached
    /// through other (Python) references at the same time.
    fn base(&mut self, start: DevicePtr) -> *mut u8 {
        match &mut self.storage {
            Storage::Device(v) => v.as_mut_ptr(),
            Storage::Host(h) => h.ptr,
            Storage::Foreign => start as usize as *mut u8,
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

/// Work queued on a stream, done only when the test says so
/// ([`SimDriver::complete`]), as a kernel still running on a GPU.
struct Op {
    seq: u64,
    device: usize,
    stream: RawStream,
    ptr: DevicePtr,
    bytes: Vec<u8>,
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
    ops: VecDeque<Op>,
    next_op: u64,
    /// Queued writes that found their memory freed when they ran.
    lost_writes: u64,
    quarantine: VecDeque<HostBuf>,
    quarantine_bytes: usize,
    /// Quarantined buffers found written after they were freed.
    stale_host_writes: u64,
    /// Device allocations with an IPC handle out: base -> serial (a freed
    /// and reallocated base gets a new one, so old handles fail to open).
    ipc_serials: HashMap<DevicePtr, u64>,
    next_ipc_serial: u64,
    /// Open IPC mappings, by mapped address, with their open count.
    ipc_open: HashMap<DevicePtr, u32>,
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

    fn remove(&mut self, start: DevicePtr) {
        let Some(block) = self.blocks.remove(&start) else {
            return;
        };
        self.ipc_serials.remove(&start);
        if block.counts_as_device() {
            self.used[block.device] -= block.len;
        } else if matches!(block.kind, Kind::Pinned { .. }) {
            self.host_used -= block.len;
        }
        if let Storage::Host(mut buf) = block.storage {
            // Poison and quarantine: a stale read sees POISON, a stale write
            // is found when the buffer leaves quarantine.
            buf.bytes().fill(POISON);
            self.quarantine_bytes += buf.layout.size();
            self.quarantine.push_back(buf);
            while self.quarantine_bytes > QUARANTINE_BYTES {
                let Some(mut old) = self.quarantine.pop_front() else {
                    break;
                };
                self.quarantine_bytes -= old.layout.size();
                if old.bytes().iter().any(|b| *b != POISON) {
                    self.stale_host_writes += 1;
                }
            }
        }
    }

    /// Whether queued work of `device` (on `stream`, or on any stream) from
    /// before `seq` is still outstanding.
    fn busy(&self, device: usize, stream: Option<RawStream>, seq: u64) -> bool {
        self.ops.iter().any(|op| {
            op.seq < seq && op.device == device && stream.map_or(true, |s| s == op.stream)
        })
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
        if !reachable
            || offset
                .checked_add(count)
                .map_or(true, |end| end > block.len)
        {
            return Err(invalid());
        }
        let base = block.base(start);
        // SAFETY: `[offset, offset+count)` lies in the block's `len` bytes:
        // ours, or host memory its registrant keeps alive while registered.
        // The slice lives only while the state lock is held, and the callers
        // copy through temporaries, so it aliases no Rust reference.
        Ok(unsafe { std::slice::from_raw_parts_mut(base.add(offset), count) })
    }
}

/// Whether `[ptr, ptr+size)` is mapped readable and writable in this
/// process (from `/proc/self/maps`): what `cuMemHostRegister` checks.
fn host_range_mapped(ptr: usize, size: usize) -> bool {
    let Some(end) = ptr.checked_add(size) else {
        return false;
    };
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    let mut at = ptr;
    let mut regions: Vec<(usize, usize)> = maps
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (range, perms) = (f.next()?, f.next()?);
            if !perms.starts_with("rw") {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        })
        .collect();
    regions.sort_unstable();
    for (a, b) in regions {
        if a <= at && at < b {
            at = b;
            if at >= end {
                return true;
            }
        }
    }
    false
}

/// The simulator. Thread-safe; every call takes one lock.
pub struct SimDriver {
    config: SimConfig,
    state: Mutex<State>,
    /// Signalled when queued work completes.
    completed: Condvar,
    /// Names this simulator in its IPC handles: another simulator (another
    /// process's) cannot open them.
    instance: u64,
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
        use std::hash::{BuildHasher, Hasher};
        let instance = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        SimDriver {
            config,
            state: Mutex::new(state),
            completed: Condvar::new(),
            instance,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a test thread panicked; the state is intact.
        crate::sync::lock(&self.state)
    }

    fn check_device(&self, device: usize) -> Result<()> {
        crate::error::check_device(device, self.config.devices)
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
    ) -> Result<(MutexGuard<'_, State>, usize)> {
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

    /// Wait until `device`'s work (on `stream`, or all) queued before now is done.
    fn wait_idle<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        device: usize,
        stream: Option<RawStream>,
    ) -> MutexGuard<'a, State> {
        let seq = st.next_op;
        while st.busy(device, stream, seq) {
            st = crate::sync::wait(&self.completed, st);
        }
        st
    }

    /// Queue a write of `bytes` at `ptr` on `stream`, as a kernel that runs
    /// until [`SimDriver::complete`] lets it: a device-side use of memory
    /// that outlives the host's view of it.
    pub fn queue_write(&self, stream: RawStream, ptr: DevicePtr, bytes: &[u8]) -> Result<()> {
        let mut st = self.lock();
        let device = match st.find(ptr) {
            Some((_, b)) => b.device,
            None => return Err(err("queue_write", CUDA_ERROR_INVALID_VALUE)),
        };
        let seq = st.next_op;
        st.next_op += 1;
        st.ops.push_back(Op {
            seq,
            device,
            stream: normal_stream(stream),
            ptr,
            bytes: bytes.to_vec(),
        });
        Ok(())
    }

    /// Run the oldest `n` queued operations (all with `None`), in order, and
    /// wake whoever waits for them. Returns how many ran.
    pub fn complete(&self, n: Option<usize>) -> usize {
        let mut st = self.lock();
        let n = n.unwrap_or(usize::MAX).min(st.ops.len());
        for _ in 0..n {
            let op = st.ops.pop_front().expect("counted");
            match st.span_mut(op.ptr, op.bytes.len(), "kernel") {
                Ok(span) => span.copy_from_slice(&op.bytes),
                Err(_) => st.lost_writes += 1,
            }
        }
        drop(st);
        self.completed.notify_all();
        n
    }

    /// Number of queued operations not yet completed.
    pub fn queued(&self) -> usize {
        self.lock().ops.len()
    }

    /// Queued writes that ran after their memory was freed.
    pub fn lost_writes(&self) -> u64 {
        self.lock().lost_writes
    }

    /// Quarantined (freed) host buffers that were written after their free,
    /// checking the whole quarantine now.
    pub fn stale_host_writes(&self) -> u64 {
        let mut st = self.lock();
        let mut found = st.stale_host_writes;
        for buf in st.quarantine.iter_mut() {
            if buf.bytes().iter().any(|b| *b != POISON) {
                found += 1;
            }
        }
        found
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

    /// IPC mappings opened and not closed yet.
    pub fn ipc_mappings(&self) -> usize {
        self.lock().ipc_open.values().map(|n| *n as usize).sum()
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

/// The legacy stream has two handles; the simulator keys queues by one.
fn normal_stream(stream: RawStream) -> RawStream {
    if stream == STREAM_LEGACY {
        0
    } else {
        stream
    }
}

// The simulator never dereferences device addresses, and checks every host
// range it touches against its own table, so its `unsafe fn`s rely only on
// registrants keeping registered memory alive (`host_register`'s contract)
// and on copy callers passing live host buffers.
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

    unsafe fn primary_context_release(&self, device: usize) -> Result<()> {
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

    unsafe fn set_current_context(&self, context: RawContext) -> Result<()> {
        let mut st = self.lock();
        st.enter(CallKind::ContextCurrent, "cuCtxSetCurrent")?;
        if context != 0 {
            self.device_of(&st, context, "cuCtxSetCurrent")?;
        }
        st.current.insert(std::thread::current().id(), context);
        Ok(())
    }

    unsafe fn synchronize(&self, context: RawContext) -> Result<()> {
        let (st, device) = self.begin(CallKind::Synchronize, "cuCtxSynchronize", context)?;
        drop(self.wait_idle(st, device, None));
        Ok(())
    }

    unsafe fn stream_synchronize(&self, context: RawContext, stream: RawStream) -> Result<()> {
        let (st, device) = self.begin(CallKind::Synchronize, "cuStreamSynchronize", context)?;
        drop(self.wait_idle(st, device, Some(normal_stream(stream))));
        Ok(())
    }

    unsafe fn stream_query(&self, context: RawContext, stream: RawStream) -> Result<bool> {
        let (st, device) = self.begin(CallKind::Synchronize, "cuStreamQuery", context)?;
        Ok(!st.busy(device, Some(normal_stream(stream)), u64::MAX))
    }

    unsafe fn mem_alloc(&self, context: RawContext, size: usize) -> Result<DevicePtr> {
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

    unsafe fn mem_free(&self, context: RawContext, ptr: DevicePtr) -> Result<()> {
        let (st, device) = self.begin(CallKind::MemFree, "cuMemFree", context)?;
        // cuMemFree waits for the device.
        let mut st = self.wait_idle(st, device, None);
        match st.blocks.get(&ptr) {
            Some(b) if b.counts_as_device() => {
                st.remove(ptr);
                Ok(())
            }
            _ => Err(err("cuMemFree", CUDA_ERROR_INVALID_VALUE)),
        }
    }

    unsafe fn mem_alloc_managed(
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

    unsafe fn host_alloc(&self, context: RawContext, size: usize, flags: u32) -> Result<HostPtr> {
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

    unsafe fn host_free(&self, context: RawContext, ptr: HostPtr) -> Result<()> {
        self.free_block(
            CallKind::HostFree,
            "cuMemFreeHost",
            context,
            ptr as DevicePtr,
            |b| matches!(b.kind, Kind::Pinned { .. }),
        )
    }

    unsafe fn host_register(
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
            .range(..start.saturating_add(size as u64))
            .next_back()
            .is_some_and(|(s, b)| *s + b.len as u64 > start);
        // As the driver does, refuse memory that is not mapped in the process.
        if size == 0 || ptr == 0 || overlaps || !host_range_mapped(ptr, size) {
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

    unsafe fn host_unregister(&self, context: RawContext, ptr: HostPtr) -> Result<()> {
        self.free_block(
            CallKind::HostUnregister,
            "cuMemHostUnregister",
            context,
            ptr as DevicePtr,
            |b| matches!(b.kind, Kind::Registered { .. }),
        )
    }

    unsafe fn host_device_pointer(&self, context: RawContext, ptr: HostPtr) -> Result<DevicePtr> {
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

    unsafe fn mem_get_info(&self, context: RawContext) -> Result<(usize, usize)> {
        let (st, device) = self.begin(CallKind::MemGetInfo, "cuMemGetInfo", context)?;
        let total = self.config.memory_per_device;
        Ok((total - st.used[device], total))
    }

    unsafe fn memset_d8(
        &self,
        context: RawContext,
        ptr: DevicePtr,
        value: u8,
        count: usize,
        stream: Option<RawStream>,
    ) -> Result<()> {
        let (mut st, device) = self.begin(CallKind::Memset, "cuMemsetD8", context)?;
        if count == 0 {
            return Ok(());
        }
        let behind = stream
            .map(normal_stream)
            .filter(|s| st.busy(device, Some(*s), u64::MAX));
        let span = st.span_mut(ptr, count, "cuMemsetD8")?;
        match behind {
            None => span.fill(value),
            // Stream order: it runs after the work queued before it.
            Some(s) => {
                let seq = st.next_op;
                st.next_op += 1;
                st.ops.push_back(Op {
                    seq,
                    device,
                    stream: s,
                    ptr,
                    bytes: vec![value; count],
                });
            }
        }
        Ok(())
    }

    unsafe fn memcpy_htod(
        &self,
        context: RawContext,
        dst: DevicePtr,
        src: *const u8,
        count: usize,
        stream: Option<RawStream>,
    ) -> Result<()> {
        let (st, device) = self.begin(CallKind::Memcpy, "cuMemcpyHtoD", context)?;
        let mut st = match stream {
            Some(s) => self.wait_idle(st, device, Some(normal_stream(s))),
            None => st,
        };
        if count == 0 {
            return Ok(());
        }
        // SAFETY: `src` is readable for `count` bytes (this fn's contract).
        // Copy it out first: it may overlap the destination (mapped memory).
        let bytes = unsafe { std::slice::from_raw_parts(src, count) }.to_vec();
        st.span_mut(dst, count, "cuMemcpyHtoD")?
            .copy_from_slice(&bytes);
        Ok(())
    }

    unsafe fn memcpy_dtoh(
        &self,
        context: RawContext,
        dst: *mut u8,
        src: DevicePtr,
        count: usize,
        stream: Option<RawStream>,
    ) -> Result<()> {
        let (st, device) = self.begin(CallKind::Memcpy, "cuMemcpyDtoH", context)?;
        let mut st = match stream {
            Some(s) => self.wait_idle(st, device, Some(normal_stream(s))),
            None => st,
        };
        if count == 0 {
            return Ok(());
        }
        let bytes = st.span_mut(src, count, "cuMemcpyDtoH")?.to_vec();
        // SAFETY: `dst` is writable for `count` bytes (this fn's contract);
        // the source was copied out, so the ranges may overlap.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, count) };
        Ok(())
    }

    unsafe fn memcpy_dtod(
        &self,
        context: RawContext,
        dst: DevicePtr,
        src: DevicePtr,
        count: usize,
        stream: Option<RawStream>,
    ) -> Result<()> {
        let (st, device) = self.begin(CallKind::Memcpy, "cuMemcpy", context)?;
        let mut st = match stream {
            Some(s) => self.wait_idle(st, device, Some(normal_stream(s))),
            None => st,
        };
        if count == 0 {
            return Ok(());
        }
        let bytes = st.span_mut(src, count, "cuMemcpy")?.to_vec();
        st.span_mut(dst, count, "cuMemcpy")?.copy_from_slice(&bytes);
        Ok(())
    }

    unsafe fn ipc_get_handle(&self, context: RawContext, base: DevicePtr) -> Result<IpcMemHandle> {
        let (mut st, device) = self.begin(CallKind::Ipc, "cuIpcGetMemHandle", context)?;
        match st.blocks.get(&base) {
            Some(b) if b.kind == Kind::Device && b.device == device => {}
            _ => return Err(err("cuIpcGetMemHandle", CUDA_ERROR_INVALID_VALUE)),
        }
        let serial = match st.ipc_serials.get(&base) {
            Some(s) => *s,
            None => {
                st.next_ipc_serial += 1;
                let s = st.next_ipc_serial;
                st.ipc_serials.insert(base, s);
                s
            }
        };
        let mut h = [0u8; 64];
        h[..8].copy_from_slice(SIM_IPC_MAGIC);
        h[8..16].copy_from_slice(&self.instance.to_le_bytes());
        h[16..24].copy_from_slice(&base.to_le_bytes());
        h[24..32].copy_from_slice(&serial.to_le_bytes());
        h[32..40].copy_from_slice(&(device as u64).to_le_bytes());
        Ok(h)
    }

    /// A handle of this simulator maps the same memory again (as another
    /// process would see it); another simulator's, or one whose allocation
    /// was freed since, fails.
    unsafe fn ipc_open_handle(
        &self,
        context: RawContext,
        handle: &IpcMemHandle,
    ) -> Result<DevicePtr> {
        let (mut st, device) = self.begin(CallKind::Ipc, "cuIpcOpenMemHandle", context)?;
        let word = |i: usize| u64::from_le_bytes(handle[i..i + 8].try_into().expect("8 bytes"));
        let invalid = || err("cuIpcOpenMemHandle", CUDA_ERROR_INVALID_VALUE);
        if &handle[..8] != SIM_IPC_MAGIC || word(8) != self.instance {
            return Err(invalid());
        }
        let (base, serial, owner) = (word(16), word(24), word(32));
        if st.ipc_serials.get(&base) != Some(&serial) || owner != device as u64 {
            return Err(invalid());
        }
        *st.ipc_open.entry(base).or_insert(0) += 1;
        Ok(base)
    }

    unsafe fn ipc_close_handle(&self, context: RawContext, mapped: DevicePtr) -> Result<()> {
        let (mut st, _) = self.begin(CallKind::Ipc, "cuIpcCloseMemHandle", context)?;
        match st.ipc_open.get_mut(&mapped) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                st.ipc_open.remove(&mapped);
            }
            None => return Err(err("cuIpcCloseMemHandle", CUDA_ERROR_INVALID_VALUE)),
        }
        Ok(())
    }

    fn pointer_attributes(&self, ptr: DevicePtr) -> Result<PointerAttributes> {
        let mut st = self.lock();
        st.enter(CallKind::PointerAttributes, "cuPointerGetAttributes")?;
        Ok(match st.find(ptr) {
            Some((start, block)) => PointerAttributes {
                device: block.device,
                memory_type: match block.kind {
                    Kind::Device | Kind::Managed => MemoryType::Device,
                    Kind::Pinned { .. } | Kind::Registered { .. } => MemoryType::Host,
                },
                is_managed: block.kind == Kind::Managed,
                range_start: start,
                range_size: block.len,
                device_accessible: match block.kind {
                    Kind::Device | Kind::Managed => true,
                    Kind::Pinned { mapped } | Kind::Registered { mapped } => mapped,
                },
            },
            None => PointerAttributes {
                device: 0,
                memory_type: MemoryType::Unregistered,
                is_managed: false,
                range_start: 0,
                range_size: 0,
                device_accessible: false,
            },
        })
    }
}
