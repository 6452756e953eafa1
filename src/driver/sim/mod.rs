//! [`SimDriver`]: a deterministic host-memory simulator of the CUDA calls in
//! [`Driver`], with fault injection.
//!
//! Each simulated device owns a 1 TiB slice of a fake address space; blocks
//! are placed first-fit from the bottom, so a freed address is handed out
//! again, as a real allocator does. Device memory is backed by host vectors
//! and never dereferenced through the fake address.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;

use super::{
    CallKind, CaptureMode, DevicePtr, Driver, RawContext, RawGraph, RawStream, STREAM_LEGACY,
};
use crate::error::{
    cuda_error_name, Error, Result, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
};

mod calls;

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

    /// Read `GPUPTR_SIM_DEVICES` (default 1; 0 is no device, a
    /// [`Error::NoDriver`] as the CUDA driver's) and `GPUPTR_SIM_MEMORY`
    /// (bytes, default 1 GiB).
    pub fn from_env() -> Result<Self> {
        use crate::config::{size_or, usize_or as read, SIM_DEVICES, SIM_MEMORY};
        let d = SimConfig::default();
        let devices = read(SIM_DEVICES, d.devices)?;
        if devices == 0 {
            // As the CUDA driver that finds no device (`cuInit`).
            return Err(Error::NoDriver(
                "GPUPTR_SIM_DEVICES=0: the simulator has no CUDA device".into(),
            ));
        }
        if devices > MAX_DEVICES {
            return Err(Error::InvalidArgument(format!(
                "GPUPTR_SIM_DEVICES={devices} is more than the simulator's {MAX_DEVICES}"
            )));
        }
        Ok(SimConfig {
            devices,
            memory_per_device: size_or(SIM_MEMORY, d.memory_per_device)?,
            version: d.version,
        })
    }
}

/// `size` zero bytes of simulated device memory, or `None` where the host
/// cannot give them (`vec![0; size]` would abort the process instead):
/// zeroed pages come lazily, so a large device costs only what is written.
fn zeroed_device_bytes(size: usize) -> Option<Vec<u8>> {
    if size == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(size).ok()?;
    // SAFETY: `layout` has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` is a fresh allocation of the global allocator with the
    // layout of `size` bytes (align 1), all initialised (zeroed): exactly
    // what a Vec<u8> of length and capacity `size` owns and frees.
    Some(unsafe { Vec::from_raw_parts(ptr, size, size) })
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
    /// Each device's primary context flags ([`SimDriver::set_primary_flags`]).
    flags: Vec<u32>,
    current: HashMap<ThreadId, RawContext>,
    calls: HashMap<CallKind, u64>,
    /// The same counts, readable without the lock ([`SimDriver::calls`]):
    /// a forked child reads them although a thread of its parent held the
    /// lock at the fork.
    counted: Arc<[AtomicU64; CallKind::ALL.len()]>,
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
    /// Each thread's capture mode (global unless it exchanged it).
    capture_modes: HashMap<ThreadId, CaptureMode>,
    /// Streams capturing now (in global mode), with their capture.
    captures: HashMap<RawStream, SimCapture>,
    next_capture_id: u64,
}

/// A capture under way in the simulator.
struct SimCapture {
    id: u64,
    /// The device whose context the capturing stream is of.
    device: usize,
    /// A refused call invalidated it.
    invalidated: bool,
    /// What the graph owns (user objects): run when the graph is destroyed.
    owned: Vec<Box<dyn FnOnce() + Send>>,
}

/// A captured graph of the simulator: dropping it destroys the graph, and
/// runs the destructors of the user objects it owns (outside the
/// simulator's lock, as the driver may).
#[must_use = "dropping the graph destroys it"]
pub struct SimGraph(Vec<Box<dyn FnOnce() + Send>>);

impl std::fmt::Debug for SimGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimGraph({} user objects)", self.0.len())
    }
}

impl Drop for SimGraph {
    fn drop(&mut self) {
        for f in self.0.drain(..) {
            f();
        }
    }
}

impl State {
    /// CUDA's rule while a stream captures in global mode (see
    /// [`CaptureMode`]): a calling thread in global mode may make no
    /// "potentially unsafe" call, and `cuCtxSynchronize` (`always`) is
    /// refused in every mode; a refused call invalidates the captures.
    /// The calling thread's capture mode (global unless it exchanged it).
    fn thread_capture_mode(&self) -> CaptureMode {
        let mode = self.capture_modes.get(&std::thread::current().id());
        mode.copied().unwrap_or(CaptureMode::Global)
    }

    fn capture_rule(&mut self, call: &'static str, always: bool) -> Result<()> {
        if self.captures.is_empty() {
            return Ok(());
        }
        let mode = self.thread_capture_mode();
        if always || mode == CaptureMode::Global {
            self.captures
                .values_mut()
                .for_each(|c| c.invalidated = true);
            return Err(err(call, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED));
        }
        Ok(())
    }

    /// The rule for `cuCtxSynchronize` of `device`'s context: refused (and
    /// the captures invalidated) only while a stream of that context
    /// captures, in every mode; another context's capture is no matter,
    /// as on the H200.
    fn sync_capture_rule(&mut self, call: &'static str, device: usize) -> Result<()> {
        let mut hit = false;
        for c in self.captures.values_mut().filter(|c| c.device == device) {
            c.invalidated = true;
            hit = true;
        }
        if hit {
            return Err(err(call, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED));
        }
        Ok(())
    }

    /// Count a call of `kind`, failing it if a fault is armed for this count.
    fn enter(&mut self, kind: CallKind, call: &'static str) -> Result<()> {
        let n = self.calls.entry(kind).or_insert(0);
        *n += 1;
        let n = *n;
        if let Some(i) = CallKind::ALL.iter().position(|k| *k == kind) {
            self.counted[i].fetch_add(1, Ordering::Relaxed);
        }
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
        self.ops
            .iter()
            .any(|op| op.seq < seq && op.device == device && stream.is_none_or(|s| s == op.stream))
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
        if !reachable || offset.checked_add(count).is_none_or(|end| end > block.len) {
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
    /// The state's call counts (see `State::counted`).
    counted: Arc<[AtomicU64; CallKind::ALL.len()]>,
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
            flags: vec![0; config.devices],
            ..State::default()
        };
        use std::hash::{BuildHasher, Hasher};
        let instance = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        SimDriver {
            config,
            counted: state.counted.clone(),
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

    /// [`Self::wait_idle`] for all of `device`'s work as the real driver
    /// waits in `cuCtxSynchronize` under its default scheduling (one
    /// context, spare cores): spinning, yielding the CPU each turn, so the
    /// waiting thread's CPU time grows as the GPU's work runs (the pool
    /// tells a busy GPU from a preempted fence thread by it).
    fn spin_until_idle<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        device: usize,
    ) -> MutexGuard<'a, State> {
        let seq = st.next_op;
        while st.busy(device, None, seq) {
            drop(st);
            std::thread::yield_now();
            st = self.lock();
        }
        st
    }

    /// Set `device`'s primary context flags (`cuDevicePrimaryCtxSetFlags`).
    /// Under `CU_CTX_SCHED_BLOCKING_SYNC` (4) `cuCtxSynchronize` sleeps until
    /// the work is done, as the real driver's blocking sync does, instead of
    /// spinning.
    pub fn set_primary_flags(&self, device: usize, flags: u32) {
        self.lock().flags[device] = flags;
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

    /// Begin a global-mode capture of `stream` (as `cuStreamBeginCapture`
    /// from some thread): until [`SimDriver::end_capture`], the capture
    /// rule of [`CaptureMode`] applies to every thread. The stream is taken
    /// to be of the calling thread's current context (device 0 when none):
    /// see [`SimDriver::begin_capture_on`].
    pub fn begin_capture(&self, stream: RawStream) {
        let device = {
            let st = self.lock();
            let me = std::thread::current().id();
            st.current
                .get(&me)
                .and_then(|c| self.device_of(&st, *c, "").ok())
                .unwrap_or(0)
        };
        self.begin_capture_on(device, stream);
    }

    /// [`SimDriver::begin_capture`] of a stream of `device`'s context: a
    /// `cuCtxSynchronize` of that context is refused until it ends (and
    /// invalidates it), one of another device's is not.
    pub fn begin_capture_on(&self, device: usize, stream: RawStream) {
        let mut st = self.lock();
        st.next_capture_id += 1;
        let id = st.next_capture_id;
        st.captures.insert(
            stream,
            SimCapture {
                id,
                device,
                invalidated: false,
                owned: Vec::new(),
            },
        );
    }

    /// End the capture of `stream` and destroy its graph at once (its user
    /// objects run): `Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)` if a
    /// refused call invalidated it, as `cuStreamEndCapture` does.
    pub fn end_capture(&self, stream: RawStream) -> Result<()> {
        self.end_capture_graph(stream).map(drop)
    }

    /// End the capture of `stream`, keeping its graph: the user objects the
    /// graph owns run when the [`SimGraph`] drops.
    pub fn end_capture_graph(&self, stream: RawStream) -> Result<SimGraph> {
        let capture = self.lock().captures.remove(&stream);
        match capture {
            Some(c) if !c.invalidated => Ok(SimGraph(c.owned)),
            // The graph of an invalidated capture is destroyed at once.
            Some(c) => {
                drop(SimGraph(c.owned));
                Err(err(
                    "cuStreamEndCapture",
                    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                ))
            }
            None => Err(err("cuStreamEndCapture", CUDA_ERROR_INVALID_VALUE)),
        }
    }

    /// The calling thread's capture mode.
    pub fn capture_mode(&self) -> CaptureMode {
        self.lock().thread_capture_mode()
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
        CallKind::ALL
            .iter()
            .position(|k| *k == kind)
            .map_or(0, |i| self.counted[i].load(Ordering::Relaxed))
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

    /// `cuDevicePrimaryCtxReset` of `device`, done behind gpuptr's back (as
    /// numba's `cuda.close()` does after [`Runtime::reset`](crate::Runtime::reset)):
    /// every allocation of the device is gone, whoever still holds it, and
    /// its addresses are free for the next allocations to reuse, as on a
    /// GPU; the retains stay. Nothing happens for a device that does not
    /// exist.
    pub fn reset_primary_context(&self, device: usize) {
        let mut st = self.lock();
        let gone: Vec<DevicePtr> = st
            .blocks
            .iter()
            .filter(|(_, b)| b.device == device && b.counts_as_device())
            .map(|(s, _)| *s)
            .collect();
        for start in gone {
            st.remove(start);
        }
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
