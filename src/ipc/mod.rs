//! Sharing device memory with other processes: [`IpcHandle`].
//!
//! A handle names a range of a gpuptr allocation: the driver's handle of the
//! allocation that contains it (a pool block lies inside a larger driver
//! allocation: base plus offset), the device, and the exporting process. It
//! is plain bytes ([`IpcHandle::to_bytes`]), so it pickles and crosses any
//! transport.
//!
//! Opening it in another process maps the allocation there (once per
//! process and handle; later opens share the mapping, and the last holder
//! unmaps it). Opening it in the exporting process itself gives the original
//! memory back, as the driver cannot map a process's own memory, or a typed
//! error if that memory was freed since.
//!
//! Freed memory is caught in other processes too: the exporter keeps a small
//! liveness file (`/dev/shm/gpuptr-ipc-<pid>-<token>`, one 8-byte slot per
//! live export, cleared when the memory is released), and an importer reads
//! the handle's slot before it maps. So a pool block freed back to the pool,
//! whose driver allocation is still mapped, gives `InvalidPointer`, not
//! another owner's bytes. (Memory freed *after* another process mapped it
//! is that process's to stop using.) Without the file (no `/dev/shm`, or
//! 65536 exports live at once) a handle has no slot, and only the driver's
//! own check applies.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::driver::IpcMemHandle;
use crate::error::{Error, Result};
use crate::memory::{DevicePointer, Origin, View};
use crate::runtime::Runtime;
use crate::sync::lock;
use liveness::{check_alive, process_token};

pub(crate) mod liveness;

const MAGIC: &[u8; 8] = b"gpuptrI2";
const LEN: usize = 8 + 4 + 4 + 8 + 8 + 8 + 8 + 4 + 64;
/// No liveness slot.
const NO_SLOT: u32 = u32::MAX;

/// A picklable handle to device memory for another process.
#[derive(Clone, PartialEq, Eq)]
pub struct IpcHandle {
    /// The device the memory is on.
    pub device: usize,
    /// The driver's handle of the allocation that contains the memory.
    pub handle: IpcMemHandle,
    /// Bytes from the start of that allocation to the memory.
    pub offset: usize,
    /// Bytes of memory.
    pub size: usize,
    /// The exporting process's id (for messages).
    pub pid: u32,
    /// The exporting process's random token (pids are reused).
    pub process: u64,
    /// Which export of that process this is.
    pub export: u64,
    /// The export's slot in the exporter's liveness file (`u32::MAX`: none).
    pub slot: u32,
}

impl std::fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcHandle")
            .field("device", &self.device)
            .field("offset", &self.offset)
            .field("size", &self.size)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl IpcHandle {
    /// The handle as bytes (a fixed layout with a magic prefix).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(LEN);
        v.extend_from_slice(MAGIC);
        v.extend_from_slice(&(self.device as u32).to_le_bytes());
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.process.to_le_bytes());
        v.extend_from_slice(&self.export.to_le_bytes());
        v.extend_from_slice(&(self.offset as u64).to_le_bytes());
        v.extend_from_slice(&(self.size as u64).to_le_bytes());
        v.extend_from_slice(&self.slot.to_le_bytes());
        v.extend_from_slice(&self.handle);
        v
    }

    /// A handle from [`IpcHandle::to_bytes`]; anything else is
    /// `InvalidArgument` (the bytes are only parsed, never trusted as an
    /// address: opening asks the driver).
    pub fn from_bytes(b: &[u8]) -> Result<IpcHandle> {
        let bad = || Error::InvalidArgument("not a gpuptr IPC handle".into());
        if b.len() != LEN || &b[..8] != MAGIC {
            return Err(bad());
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let offset = usize::try_from(u64_at(32)).map_err(|_| bad())?;
        let size = usize::try_from(u64_at(40)).map_err(|_| bad())?;
        offset.checked_add(size).ok_or_else(bad)?;
        Ok(IpcHandle {
            device: u32_at(8) as usize,
            pid: u32_at(12),
            process: u64_at(16),
            export: u64_at(24),
            offset,
            size,
            slot: u32_at(48),
            handle: b[52..116].try_into().expect("64 bytes"),
        })
    }
}

/// The runtime's IPC state: what this process exported (for opens in this
/// process) and what it opened (one mapping per handle).
#[derive(Default)]
pub(crate) struct Ipc {
    next_export: AtomicU64,
    /// Export number -> the memory and the view's place in it.
    exports: Mutex<HashMap<u64, (Weak<DevicePointer>, usize)>>,
    /// Driver handle -> the mapping made by opening it.
    opened: Mutex<HashMap<IpcMemHandle, Weak<DevicePointer>>>,
}

impl Runtime {
    /// A handle another process can open to use `view`'s memory. The memory
    /// must be device memory gpuptr allocated (pool or driver), not managed,
    /// host or foreign memory.
    pub fn ipc_export(self: &Arc<Self>, view: &View) -> Result<IpcHandle> {
        crate::fork::check()?;
        let parent = view.parent();
        parent.check_live()?;
        if !matches!(parent.origin(), Origin::Driver | Origin::Pool(_))
            || parent.is_managed()
            || parent.address() == 0
        {
            return Err(Error::InvalidArgument(
                "only device memory gpuptr allocated (not managed, host, foreign or empty memory) can be shared with another process".into(),
            ));
        }
        let ctx = view.context();
        let attrs = self.driver().pointer_attributes(view.address())?;
        let offset = view
            .address()
            .checked_sub(attrs.range_start)
            .filter(|_| attrs.range_size > 0)
            .ok_or_else(|| {
                Error::InvalidPointer(format!("{:#x} is in no allocation", view.address()))
            })? as usize;
        // SAFETY: `range_start` starts the live driver allocation that holds
        // this live gpuptr memory, in its context.
        let handle = unsafe { self.driver().ipc_get_handle(ctx.raw(), attrs.range_start)? };
        let ipc = self.ipc();
        let export = ipc.next_export.fetch_add(1, Ordering::Relaxed) + 1;
        {
            let mut exports = lock(&ipc.exports);
            if exports.len() >= 1024 {
                exports.retain(|_, (w, _)| w.strong_count() > 0);
            }
            exports.insert(export, (Arc::downgrade(parent), view.offset()));
        }
        parent.mark_exported();
        let live = &self.services().exports;
        let slot = live.take(parent.address(), export).unwrap_or(NO_SLOT);
        if parent.is_freed() {
            // Freed while this export was made: its release may have run
            // before the slot was taken.
            live.forget(parent.address());
            return Err(Error::InvalidPointer("the memory was freed".into()));
        }
        Ok(IpcHandle {
            device: ctx.device(),
            handle,
            offset,
            size: view.size(),
            pid: std::process::id(),
            process: process_token(),
            export,
            slot,
        })
    }

    /// The memory `handle` names. In the exporting process: the original
    /// memory, or `InvalidPointer` if it was freed. Elsewhere: the mapping
    /// of the exporter's allocation (made once per handle in this process,
    /// unmapped when its last view goes), or the driver's error for a
    /// handle whose allocation is gone.
    pub fn ipc_open(self: &Arc<Self>, handle: &IpcHandle) -> Result<View> {
        crate::fork::check()?;
        self.check_device(handle.device)?;
        let ipc = self.ipc();
        if handle.process == process_token() {
            let found = lock(&ipc.exports).get(&handle.export).cloned();
            let freed = || {
                Error::InvalidPointer(
                    "the memory this IPC handle names was freed by this process, which exported it"
                        .into(),
                )
            };
            let (weak, at) = found.ok_or_else(freed)?;
            let parent = weak.upgrade().filter(|p| !p.is_freed() && !p.is_stale());
            let parent = parent.ok_or_else(freed)?;
            return parent.view_all().view(at, Some(at + handle.size));
        }
        check_alive(handle)?;
        let ctx = self.context(handle.device)?;
        let mut opened = lock(&ipc.opened);
        let mapping = match opened.get(&handle.handle).and_then(Weak::upgrade) {
            Some(m) if !m.is_freed() && !m.is_stale() => m,
            _ => {
                // SAFETY: `ctx` is retained; the handle is data the driver
                // validates.
                let base = unsafe { self.driver().ipc_open_handle(ctx.raw(), &handle.handle)? };
                let size = self
                    .driver()
                    .pointer_attributes(base)
                    .map(|a| a.range_size)
                    .unwrap_or(0)
                    .max(handle.offset + handle.size);
                let m = DevicePointer::ipc_mapping(&ctx, base, size);
                opened.retain(|_, w| w.strong_count() > 0);
                opened.insert(handle.handle, Arc::downgrade(&m));
                m
            }
        };
        drop(opened);
        mapping
            .view_all()
            .view(handle.offset, Some(handle.offset + handle.size))
    }
}
