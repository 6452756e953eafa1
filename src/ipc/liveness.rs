//! The exporter's liveness file: freed memory is caught in other
//! processes too. Each process that exports keeps one small file,
//! `/dev/shm/gpuptr-ipc-<pid>-<token>`, with one 32-byte record per live
//! exported allocation (its export number, and its bounds in its driver
//! allocation), cleared when the memory is released; an importer reads the
//! handle's record before it maps. This file knows addresses and numbers
//! only, not pointers: each runtime's [`Services`](crate::device::Services)
//! hold its [`Exports`], and a pointer's release clears its record.
//!
//! What holds for the file:
//! - It is made with mode `0o644` whatever the umask (`fchmod`), `O_EXCL`
//!   and `O_NOFOLLOW`, so only its exporter writes it. An importer opens it
//!   with `O_NOFOLLOW | O_NONBLOCK` and reads it only if `fstat` finds a
//!   regular file of the right size that no one else may write: a symlink,
//!   FIFO or any other file at that path fails with `InvalidPointer`, and
//!   never blocks.
//! - The exporter holds an exclusive `flock` on it for its life, which dies
//!   with the process however it ends (`os._exit`, a signal, abort); a
//!   child forked from it closes its copy at once. An importer that finds
//!   the lock free knows the exporter is gone.
//! - The exporter removes it at a normal exit; the first export of any
//!   later process of the same user removes the files whose exporter is
//!   gone (their lock is free).

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use super::{IpcHandle, NO_SLOT};
use crate::driver::DevicePtr;
use crate::error::{Error, Result};
use crate::sync::lock;

/// Records in a liveness file (the file is sparse).
const SLOTS: u32 = 1 << 16;
/// Bytes per record: the export number, then the exported allocation's
/// offset in its driver allocation and its size (little-endian `u64`s),
/// then 8 reserved bytes.
const RECORD: u64 = 32;
/// Bytes of a liveness file.
const FILE_LEN: u64 = SLOTS as u64 * RECORD;
/// Where liveness files live, and how their names start.
const DIR: &str = "/dev/shm";
const PREFIX: &str = "gpuptr-ipc-";
/// The file's mode, whatever the umask: the exporter writes, anyone may
/// read (an importer may run as another user).
const MODE: libc::mode_t = 0o644;

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

/// The export number of an exported allocation and its slot (`NO_SLOT`:
/// none). Every export of one live allocation shares both.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Export {
    pub(crate) number: u64,
    pub(crate) slot: u32,
}

/// What names one exported allocation for as long as it lives: its
/// address, device and reset epoch (a stale pointer of an older epoch may
/// outlive a reset, while a new allocation takes its address).
pub(crate) type ExportKey = (DevicePtr, usize, u64);

/// A runtime's exported allocations, by [`ExportKey`]. The numbers are
/// process-wide (and never reused), as is the liveness file.
#[derive(Default)]
pub(crate) struct Exports {
    live: Mutex<HashMap<ExportKey, Export>>,
}

impl Exports {
    /// The export of the live allocation `key` (`size` bytes at `start` in
    /// its driver allocation): the one it has, or a new number with a slot
    /// if the file has one left. Constant cost: a re-export reuses the
    /// allocation's number and slot.
    pub(crate) fn export(&self, key: ExportKey, start: usize, size: usize) -> Export {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let mut live = lock(&self.live);
        let e = live.entry(key).or_insert_with(|| Export {
            number: NEXT.fetch_add(1, Ordering::Relaxed),
            slot: NO_SLOT,
        });
        if e.slot == NO_SLOT {
            if let Some(l) = Liveness::get_or_create() {
                e.slot = l
                    .take(e.number, start as u64, size as u64)
                    .unwrap_or(NO_SLOT);
            }
        }
        *e
    }

    /// The allocation `key` was released: clear its record. In a forked
    /// child, nothing: the record is the parent's (and a lock another
    /// parent thread held at the fork would never be let go).
    pub(crate) fn forget(&self, key: ExportKey) {
        if crate::fork::forked() {
            return;
        }
        let Some(e) = lock(&self.live).remove(&key) else {
            return;
        };
        if let (Some(Some(l)), true) = (LIVENESS.get(), e.slot != NO_SLOT) {
            l.give_back(e.slot);
        }
    }
}

/// This process's liveness file, made at its first export (`None`: no
/// `/dev/shm`, or it could not be made).
static LIVENESS: OnceLock<Option<Liveness>> = OnceLock::new();

/// The liveness file's descriptor, for the at-fork hook to close in a child.
static LIVENESS_FD: AtomicI32 = AtomicI32::new(-1);

/// The path to unlink at exit, and the process that made it (a forked child
/// inherits the exit handler, and must not remove its parent's file).
static LIVENESS_FILE: OnceLock<(u32, CString)> = OnceLock::new();

extern "C" fn remove_liveness_file() {
    if let Some((pid, path)) = LIVENESS_FILE.get() {
        if *pid == std::process::id() {
            // SAFETY: a NUL-terminated path that lives for the process.
            unsafe { libc::unlink(path.as_ptr()) };
        }
    }
}

/// In a forked child: let go of the parent's liveness file, so its lock
/// dies with the parent (the child's gpuptr does nothing, and never writes
/// the file).
extern "C" fn close_liveness_in_child() {
    let fd = LIVENESS_FD.load(Ordering::Relaxed);
    if fd >= 0 {
        // SAFETY: `close` is async-signal-safe, as a child handler must be;
        // the descriptor is the file's, and the child never uses it again
        // (`Liveness::write` does nothing in a forked child).
        unsafe { libc::close(fd) };
    }
}

fn liveness_path(pid: u32, process: u64) -> PathBuf {
    PathBuf::from(format!("{DIR}/{PREFIX}{pid}-{process:016x}"))
}

fn last_os_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// The exporter's liveness file: record `i` holds the export number of a
/// live exported allocation and its bounds, or 0.
struct Liveness {
    file: File,
    slots: Mutex<Slots>,
}

#[derive(Default)]
struct Slots {
    next: u32,
    free: Vec<u32>,
}

impl Liveness {
    fn get_or_create() -> Option<&'static Liveness> {
        LIVENESS.get_or_init(Liveness::create).as_ref()
    }

    fn create() -> Option<Liveness> {
        if crate::fork::forked() {
            return None;
        }
        let path = liveness_path(std::process::id(), process_token());
        sweep(&path);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(MODE)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .ok()?;
        let fd = file.as_raw_fd();
        // Locked while still empty: a sweeper passes over an empty file, and
        // finds a full one locked. Never waiting: if another process locked
        // it in between (anyone may open it to read), this process goes
        // without a file rather than hang.
        // SAFETY: `fd` is this open file's; `flock` and `fchmod` touch
        // nothing else.
        let ready = unsafe {
            libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) == 0 && libc::fchmod(fd, MODE) == 0
        };
        if !ready || file.set_len(FILE_LEN).is_err() {
            let _ = std::fs::remove_file(&path);
            return None;
        }
        let c = CString::new(path.into_os_string().into_encoded_bytes()).ok()?;
        if LIVENESS_FILE.set((std::process::id(), c)).is_ok() {
            LIVENESS_FD.store(fd, Ordering::Relaxed);
            // SAFETY: registers plain `extern "C" fn()`s: one only unlinks,
            // the other only closes a descriptor.
            unsafe {
                libc::atexit(remove_liveness_file);
                libc::pthread_atfork(None, None, Some(close_liveness_in_child));
            }
        }
        Some(Liveness {
            file,
            slots: Mutex::default(),
        })
    }

    fn write(&self, slot: u32, at: u64, bytes: &[u8]) -> bool {
        // A forked child's copy of the file is closed (and is its parent's).
        if crate::fork::forked() {
            return false;
        }
        self.file
            .write_at(bytes, u64::from(slot) * RECORD + at)
            .is_ok()
    }

    /// A slot holding `number` and its bounds, if any is left. The bounds
    /// are written first, the number last, so a reader that finds the
    /// number finds its bounds.
    fn take(&self, number: u64, start: u64, size: u64) -> Option<u32> {
        let mut s = lock(&self.slots);
        let slot = match s.free.pop() {
            Some(slot) => slot,
            None if s.next < SLOTS => {
                s.next += 1;
                s.next - 1
            }
            None => return None,
        };
        let mut bounds = [0u8; 16];
        bounds[..8].copy_from_slice(&start.to_le_bytes());
        bounds[8..].copy_from_slice(&size.to_le_bytes());
        if !self.write(slot, 8, &bounds) || !self.write(slot, 0, &number.to_le_bytes()) {
            s.free.push(slot);
            return None;
        }
        Some(slot)
    }

    fn give_back(&self, slot: u32) {
        let mut s = lock(&self.slots);
        // The number first: from now on no reader finds it.
        if self.write(slot, 0, &0u64.to_le_bytes()) {
            s.free.push(slot);
        }
    }
}

/// Open `path` to read, never following a symlink nor blocking on a FIFO
/// or device, and check that it is a liveness file: a regular file of the
/// right size that only its owner may write. `Ok(None)`: no file there.
fn open_liveness(path: &Path) -> std::io::Result<Option<(File, std::fs::Metadata)>> {
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(std::io::Error::other("writable by others than its owner"));
    }
    Ok(Some((file, meta)))
}

/// Whether a process holds `file`'s lock (its exporter is alive).
fn locked(file: &File) -> bool {
    let fd = file.as_raw_fd();
    // SAFETY: `flock` on this open file's descriptor; a shared lock taken
    // here is let go at once (and with the descriptor).
    if unsafe { libc::flock(fd, libc::LOCK_SH | libc::LOCK_NB) } == 0 {
        // SAFETY: as above.
        unsafe { libc::flock(fd, libc::LOCK_UN) };
        return false;
    }
    last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK)
}

/// Remove the liveness files of this user's exporters that are gone (no
/// process holds their lock); `own` is this process's, left alone.
fn sweep(own: &Path) {
    let Ok(dir) = std::fs::read_dir(DIR) else {
        return;
    };
    // SAFETY: `geteuid` reads the process's credentials.
    let uid = unsafe { libc::geteuid() };
    for entry in dir.flatten() {
        let name = entry.file_name();
        if !name.as_encoded_bytes().starts_with(PREFIX.as_bytes()) {
            continue;
        }
        let path = entry.path();
        if path == own {
            continue;
        }
        let Ok(Some((file, meta))) = open_liveness(&path) else {
            continue;
        };
        // A file being made is empty until its exporter holds the lock; a
        // file of another size is another version's, left to it.
        if meta.uid() != uid || meta.len() != FILE_LEN || locked(&file) {
            continue;
        }
        // Still that file (not one made since at that path): remove it.
        let same = std::fs::symlink_metadata(&path)
            .is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino());
        if same {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// The exported allocation's bounds in its driver allocation (offset,
/// size), if the exporter of `handle` still has it live: its record holds
/// the handle's export number. `Err` ([`Error::InvalidPointer`]) for a
/// handle without a slot (gpuptr exports none: it was altered, and nothing
/// would bound it to its allocation inside a pool segment), whose exporter
/// says it is freed, whose exporter is gone, or whose file is not a
/// liveness file.
pub(crate) fn check_alive(handle: &IpcHandle) -> Result<(usize, usize)> {
    if handle.slot == NO_SLOT {
        return Err(Error::InvalidPointer(
            "this IPC handle has no liveness record, which every handle gpuptr makes has: it was altered".into(),
        ));
    }
    let exited = || {
        Error::InvalidPointer(format!(
            "the process that exported this memory (pid {}) has exited",
            handle.pid
        ))
    };
    let path = liveness_path(handle.pid, handle.process);
    let bad = |why: &dyn std::fmt::Display| {
        Error::InvalidPointer(format!(
            "the IPC liveness file {} is unusable ({why})",
            path.display()
        ))
    };
    if handle.slot >= SLOTS {
        return Err(bad(&format!("no slot {}", handle.slot)));
    }
    let (file, meta) = match open_liveness(&path) {
        Ok(Some(f)) => f,
        Ok(None) => return Err(exited()),
        Err(e) => return Err(bad(&e)),
    };
    if meta.len() != FILE_LEN {
        return Err(bad(&format!("{} bytes, not {FILE_LEN}", meta.len())));
    }
    if !locked(&file) {
        return Err(exited());
    }
    let at = u64::from(handle.slot) * RECORD;
    let mut record = [0u8; 24];
    let mut again = [0u8; 8];
    file.read_exact_at(&mut record, at)
        .and_then(|()| file.read_exact_at(&mut again, at))
        .map_err(|e| bad(&e))?;
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    // The number read before and after the bounds: a record given back and
    // taken again meanwhile has another number.
    if word(&record[..8]) != handle.export || word(&again) != handle.export {
        return Err(Error::InvalidPointer(format!(
            "the memory this IPC handle names was freed by the process that exported it (pid {})",
            handle.pid
        )));
    }
    let start = usize::try_from(word(&record[8..16])).map_err(|e| bad(&e))?;
    let size = usize::try_from(word(&record[16..24])).map_err(|e| bad(&e))?;
    Ok((start, size))
}
