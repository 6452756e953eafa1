//! The simulator's side of the [`Driver`] trait: each driver call, on the
//! state that `mod.rs` keeps (devices, contexts, allocations, queued work,
//! faults to inject).

use super::*;
use crate::driver::{
    DriverKind, HostPtr, IpcMemHandle, MemoryType, PointerAttributes, PrimaryContextState,
    HOST_ALLOC_DEVICEMAP,
};

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
            flags: st.flags[device],
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
        let (mut st, device) = self.begin(CallKind::Synchronize, "cuCtxSynchronize", context)?;
        st.sync_capture_rule("cuCtxSynchronize", device)?;
        if crate::driver::blocking_sync(st.flags[device]) {
            drop(self.wait_idle(st, device, None));
        } else {
            drop(self.spin_until_idle(st, device));
        }
        Ok(())
    }

    unsafe fn stream_synchronize(&self, context: RawContext, stream: RawStream) -> Result<()> {
        let (mut st, device) = self.begin(CallKind::Synchronize, "cuStreamSynchronize", context)?;
        st.capture_rule("cuStreamSynchronize", false)?;
        drop(self.wait_idle(st, device, Some(normal_stream(stream))));
        Ok(())
    }

    unsafe fn stream_query(&self, context: RawContext, stream: RawStream) -> Result<bool> {
        let (mut st, device) = self.begin(CallKind::Synchronize, "cuStreamQuery", context)?;
        st.capture_rule("cuStreamQuery", false)?;
        Ok(!st.busy(device, Some(normal_stream(stream)), u64::MAX))
    }

    unsafe fn mem_alloc(&self, context: RawContext, size: usize) -> Result<DevicePtr> {
        let (mut st, device) = self.begin(CallKind::MemAlloc, "cuMemAlloc", context)?;
        st.capture_rule("cuMemAlloc", false)?;
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
        // A simulated device larger than the host's memory runs out here.
        let bytes = zeroed_device_bytes(size).ok_or(err("cuMemAlloc", CUDA_ERROR_OUT_OF_MEMORY))?;
        st.blocks.insert(
            at,
            Block {
                device,
                kind: Kind::Device,
                len: size,
                storage: Storage::Device(bytes),
            },
        );
        st.used[device] += size;
        Ok(at)
    }

    unsafe fn mem_free(&self, context: RawContext, ptr: DevicePtr) -> Result<()> {
        let (mut st, device) = self.begin(CallKind::MemFree, "cuMemFree", context)?;
        st.capture_rule("cuMemFree", false)?;
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
        if overlaps && size != 0 {
            return Err(err(
                "cuMemHostRegister",
                crate::error::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
            ));
        }
        if size == 0 || ptr == 0 || !host_range_mapped(ptr, size) {
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

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        let mut st = self.lock();
        let before = st.thread_capture_mode();
        // Only threads out of the default mode have an entry (every
        // allocation puts its thread's mode back: the map stays small).
        let id = std::thread::current().id();
        if mode == CaptureMode::Global {
            st.capture_modes.remove(&id);
        } else {
            st.capture_modes.insert(id, mode);
        }
        Ok(before)
    }

    unsafe fn stream_capture(
        &self,
        context: RawContext,
        stream: RawStream,
    ) -> Result<Option<(u64, RawGraph)>> {
        let _ = context;
        let st = self.lock();
        // The graph handle is the capture's id: one graph per capture.
        // As the driver: an invalidated capture is not active.
        let c = st.captures.get(&stream).filter(|c| !c.invalidated);
        Ok(c.map(|c| (c.id, c.id as RawGraph)))
    }

    unsafe fn graph_on_destroy(
        &self,
        context: RawContext,
        graph: RawGraph,
        on_destroy: Box<dyn FnOnce() + Send>,
    ) -> Result<()> {
        let _ = context;
        let mut st = self.lock();
        match st.captures.values_mut().find(|c| c.id as RawGraph == graph) {
            Some(c) => {
                c.owned.push(on_destroy);
                Ok(())
            }
            None => Err(err("cuGraphRetainUserObject", CUDA_ERROR_INVALID_VALUE)),
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
        if &handle[..8] != SIM_IPC_MAGIC {
            return Err(invalid());
        }
        if word(8) != self.instance {
            // A real driver maps another process's memory; a simulator's
            // devices are its own host memory, which no other one can see.
            return Err(Error::InvalidArgument(
                "this IPC handle comes from another simulator (another process, or another \
                 SimDriver): gpuptr's simulator cannot share memory between processes; open the \
                 handle in the process that exported it, or use a CUDA driver"
                    .into(),
            ));
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
