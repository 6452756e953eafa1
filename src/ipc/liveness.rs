//! The exporter's liveness file: freed memory is caught in other
//! processes too. The exporter keeps a small file
//! (`/dev/shm/gpuptr-ipc-<pid>-<token>`, one 8-byte slot per live export,
//! cleared when the memory is released), and an importer reads the handle's
//! slot before it maps. This file knows addresses and numbers only, not
//! pointers: the device's [`Services`](crate::device::Services) hold its
//! [`Exports`], and a pointer's release clears its slots.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use super::{IpcHandle, NO_SLOT};
use crate::driver::DevicePtr;
use crate::error::{Error, Result};
use crate::sync::lock;

/// Slots in a liveness file (8 bytes each; the file is sparse).
const SLOTS: u32 = 1 << 16;

/// This process's token: random, made once.
pub(crate) fn process_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish() | 1
    })
}

/// This process's liveness slots, made at the first export.
#[derive(Default)]
pub(crate) struct Exports {
    liveness: OnceLock<Option<Liveness>>,
}

impl Exports {
    fn liveness(&self) -> Option<&Liveness> {
        self.liveness.get_or_init(Liveness::create).as_ref()
    }

    /// A slot holding `export` for the allocation at `address`, if the file
    /// exists and has one left.
    pub(crate) fn take(&self, address: DevicePtr, export: u64) -> Option<u32> {
        self.liveness().and_then(|l| l.take(address, export))
    }

    /// The allocation at `address` was released: clear its slots.
    pub(crate) fn forget(&self, address: DevicePtr) {
        if let Some(Some(l)) = self.liveness.get() {
            l.clear(address);
        }
    }
}

/// The exporter's liveness file: slot `i` holds the export number of a live
/// export, or 0.
struct Liveness {
    file: std::fs::File,
    slots: Mutex<Slots>,
}

#[derive(Default)]
struct Slots {
    next: u32,
    free: Vec<u32>,
    /// The slots of each exported allocation, by address.
    by_address: HashMap<DevicePtr, Vec<u32>>,
}

fn liveness_path(pid: u32, process: u64) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("/dev/shm/gpuptr-ipc-{pid}-{process:016x}"))
}

/// The path to unlink at exit, and the process that made it (a forked child
/// inherits the exit handler, and must not remove its parent's file).
static LIVENESS_FILE: OnceLock<(u32, std::ffi::CString)> = OnceLock::new();

extern "C" fn remove_liveness_file() {
    if let Some((pid, path)) = LIVENESS_FILE.get() {
        if *pid == std::process::id() {
            // SAFETY: a NUL-terminated path that lives for the process.
            unsafe { libc::unlink(path.as_ptr()) };
        }
    }
}

impl Liveness {
    fn create() -> Option<Liveness> {
        let path = liveness_path(std::process::id(), process_token());
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .ok()?;
        file.set_len(u64::from(SLOTS) * 8).ok()?;
        let c = std::ffi::CString::new(path.into_os_string().into_encoded_bytes()).ok()?;
        if LIVENESS_FILE.set((std::process::id(), c)).is_ok() {
            // SAFETY: registers a plain `extern "C" fn()` that only unlinks.
            unsafe { libc::atexit(remove_liveness_file) };
        }
        Some(Liveness {
            file,
            slots: Mutex::default(),
        })
    }

    fn write(&self, slot: u32, value: u64) -> bool {
        use std::os::unix::fs::FileExt;
        self.file
            .write_at(&value.to_le_bytes(), u64::from(slot) * 8)
            .is_ok()
    }

    /// A slot holding `export` for the allocation at `address`, if any left.
    fn take(&self, address: DevicePtr, export: u64) -> Option<u32> {
        let mut s = lock(&self.slots);
        let slot = match s.free.pop() {
            Some(slot) => slot,
            None if s.next < SLOTS => {
                s.next += 1;
                s.next - 1
            }
            None => return None,
        };
        if !self.write(slot, export) {
            s.free.push(slot);
            return None;
        }
        s.by_address.entry(address).or_default().push(slot);
        Some(slot)
    }

    fn clear(&self, address: DevicePtr) {
        let mut s = lock(&self.slots);
        for slot in s.by_address.remove(&address).unwrap_or_default() {
            self.write(slot, 0);
            s.free.push(slot);
        }
    }
}

/// Whether the exporter of `handle` still has it live: its slot holds its
/// export number. `Err` for a handle whose exporter says it is freed, or
/// whose exporter is gone.
pub(crate) fn check_alive(handle: &IpcHandle) -> Result<()> {
    use std::os::unix::fs::FileExt;
    if handle.slot == NO_SLOT {
        return Ok(());
    }
    let path = liveness_path(handle.pid, handle.process);
    let file = std::fs::File::open(&path).map_err(|_| {
        Error::InvalidPointer(format!(
            "the process that exported this memory (pid {}) has exited",
            handle.pid
        ))
    })?;
    let mut word = [0u8; 8];
    file.read_exact_at(&mut word, u64::from(handle.slot) * 8)
        .map_err(|e| Error::InvalidPointer(format!("unreadable IPC liveness file: {e}")))?;
    if u64::from_le_bytes(word) != handle.export {
        return Err(Error::InvalidPointer(format!(
            "the memory this IPC handle names was freed by the process that exported it (pid {})",
            handle.pid
        )));
    }
    Ok(())
}
