//! Sharing device memory with other processes: [`IpcHandle`].
//!
//! A handle names a range of a gpuptr allocation: the driver's handle of the
//! allocation that contains it (a pool block lies inside a larger driver
//! allocation: base plus offset), the device, and the exporting process. It
//! is plain bytes ([`IpcHandle::to_bytes`]), so it pickles and crosses any
//! transport, and it is trusted for nothing: the memory a handle opens to
//! lies inside the driver's own range of the mapped allocation, and inside
//! the allocation that was exported, whatever its offset and size say.
//!
//! Opening it in another process maps the allocation there (once per
//! process and handle; later opens share the mapping, and the last holder
//! unmaps it). Opening it in the exporting process itself gives the original
//! memory back, as the driver cannot map a process's own memory, or a typed
//! error if that memory was freed since.
//!
//! Freed memory is caught in other processes too: the exporter keeps a
//! small liveness file (see [`liveness`]), one record per live exported
//! allocation (every export of one allocation shares it), cleared when the
//! memory is released, and an importer reads the handle's record before it
//! maps. So a pool block freed back to the pool, whose driver allocation is
//! still mapped, gives `InvalidPointer`, not another owner's bytes. (Memory
//! freed *after* another process mapped it is that process's to stop
//! using.) Memory is exported only with a record (so never without
//! `/dev/shm`, nor past 65536 allocations exported and live at once), and
//! another process opens a handle only with one: the record also bounds
//! the handle to its allocation, which the driver's range (a whole pool
//! segment) does not.

use crate::driver::IpcMemHandle;
use crate::error::{Error, Result};

pub(crate) mod liveness;

const MAGIC: &[u8; 8] = b"gpuptrI3";
const LEN: usize = 8 + 4 + 4 + 8 + 8 + 8 + 8 + 4 + 64;
/// No liveness slot.
pub(crate) const NO_SLOT: u32 = u32::MAX;

/// A picklable handle to device memory for another process.
#[derive(Clone, PartialEq, Eq, Hash)]
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
    /// The export number of the exported allocation in that process (every
    /// export of one live allocation shares it; never reused).
    pub export: u64,
    /// The allocation's slot in the exporter's liveness file (`u32::MAX`: none).
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
