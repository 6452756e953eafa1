//! Memory snapshots in PyTorch's memory-viz format: what each device's pool
//! holds from the driver (its *segments*), the state of every block in them,
//! and the allocation history's trace, as `torch.cuda.memory._snapshot()`
//! gives them, so `python -m torch.cuda._memory_viz` (and the viewer at
//! pytorch.org/memory_viz) reads gpuptr's pool as it reads PyTorch's.
//!
//! [`Snapshot::to_pickle`] writes the pickle itself (protocol 2, the opcodes
//! the viewer's own reader knows), so a snapshot can be written where no
//! Python can be called: when memory runs out inside an allocator hook.
//!
//! The keys, by what reads them in `torch/cuda/_memory_viz.py` and
//! `torch/utils/viz/MemoryViz.js`:
//! - a segment: `device`, `address`, `total_size`, `stream`, `blocks`,
//!   `frames` (the viewer), `allocated_size` (`trace`), `active_size`,
//!   `requested_size`, `segment_type`, `segment_pool_id`, `is_expandable`
//!   (`torch.cuda.memory._snapshot`'s own);
//! - a block: `size`, `state`, `requested_size`, `frames` (`segsum`,
//!   `_write_blocks`, the viewer), `address`; its blocks cover its segment
//!   in address order (`segsum` asserts the sizes add up);
//! - a trace entry: `action`, `addr`, `size`, `stream`, `frames`,
//!   `device_free` (for `oom`), `time_us`;
//! - a frame: `filename`, `line`, `name`.
//!
//! gpuptr adds `client` (`"direct"`, `"numba"`, `"cupy"`, `"torch"`,
//! `"cuda_core"`, `"rmm"`) to
//! each allocation's block and trace entries, and puts it first among their
//! frames as `gpuptr:0:client=NAME`, where the viewer shows frames.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::driver::{DevicePtr, RawStream};
use crate::history::{Live, TraceEntry};
use crate::stats::Client;
use crate::track::{Frame, Site};

/// What a block of a segment is doing, by PyTorch's names.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out (`"active_allocated"`).
    Active,
    /// Freed, waiting for the fence before anyone may reuse it
    /// (`"active_pending_free"`).
    PendingFree,
    /// Cached, ready for reuse (`"inactive"`).
    Inactive,
}

impl BlockState {
    /// PyTorch's name for it.
    pub fn name(self) -> &'static str {
        match self {
            BlockState::Active => "active_allocated",
            BlockState::PendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }
}

/// A block of a [`Segment`].
#[derive(Clone, Debug)]
pub struct SnapshotBlock {
    /// Its address.
    pub address: DevicePtr,
    /// Its bytes (its size class).
    pub size: usize,
    /// The bytes its owner asked for (its size, where the history does not
    /// know).
    pub requested_size: usize,
    /// What it is doing.
    pub state: BlockState,
    /// Who asked for it, where the history knows.
    pub client: Option<Client>,
    /// Where it was allocated, where the history knows.
    pub site: Option<Site>,
}

/// A driver allocation: one of the pool's (carved into blocks), or one made
/// outside the pool while the history was on.
#[derive(Clone, Debug)]
pub struct Segment {
    /// The device.
    pub device: usize,
    /// Its base address.
    pub address: DevicePtr,
    /// Its bytes.
    pub total_size: usize,
    /// The stream it is ordered on (0: none; pool segments serve every
    /// stream).
    pub stream: RawStream,
    /// Its blocks, in address order, covering it.
    pub blocks: Vec<SnapshotBlock>,
}

/// A memory snapshot: every device's segments and the history's trace.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// The segments, by device, then address.
    pub segments: Vec<Segment>,
    /// The trace, oldest first, one list per device.
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// The most entries the trace keeps.
    pub max_entries: usize,
}

impl Segment {
    /// The segments of one device from its pool's allocations (each with
    /// its blocks' states) and the history's live allocations.
    pub(crate) fn of_device(
        device: usize,
        pool: Vec<crate::pool::SegmentView>,
        live: &HashMap<DevicePtr, Live>,
    ) -> Vec<Segment> {
        use crate::pool::BlockState as Pool;
        let mut out: Vec<Segment> = pool
            .into_iter()
            .map(|(a, states)| {
                let blocks = states
                    .into_iter()
                    .map(|(address, size, state)| {
                        let state = match state {
                            Pool::Used => BlockState::Active,
                            Pool::Free => BlockState::Inactive,
                            Pool::Waiting => BlockState::PendingFree,
                        };
                        let known = live
                            .get(&address)
                            .filter(|l| state == BlockState::Active && !l.own_segment);
                        SnapshotBlock {
                            address,
                            size,
                            requested_size: known.map_or(size, |l| l.size.min(size)),
                            state,
                            client: known.map(|l| l.client),
                            site: known.map(|l| l.site.clone()),
                        }
                    })
                    .collect();
                Segment {
                    device,
                    address: a.base,
                    total_size: a.bytes,
                    stream: 0,
                    blocks,
                }
            })
            .collect();
        // Allocations outside the pool: each its own segment.
        out.extend(
            live.iter()
                .filter(|(_, l)| l.own_segment && l.device == device)
                .map(|(address, l)| Segment {
                    device,
                    address: *address,
                    total_size: l.size,
                    stream: l.stream,
                    blocks: vec![SnapshotBlock {
                        address: *address,
                        size: l.size,
                        requested_size: l.size,
                        state: BlockState::Active,
                        client: Some(l.client),
                        site: Some(l.site.clone()),
                    }],
                }),
        );
        out.sort_by_key(|s| s.address);
        out
    }
}

/// A value of the pickle's tree.
enum Value {
    Bool(bool),
    Int(i128),
    Str(String),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    Dict(Vec<(&'static str, Value)>),
}

fn int(n: impl Into<i128>) -> Value {
    Value::Int(n.into())
}

fn usize_value(n: usize) -> Value {
    Value::Int(n as i128)
}

fn frames_value(client: Option<Client>, site: Option<&Site>) -> Value {
    let frame = |f: &Frame| {
        Value::Dict(vec![
            ("filename", Value::Str(f.filename.to_string())),
            ("line", int(f.line)),
            ("name", Value::Str(f.name.to_string())),
        ])
    };
    let mut v = Vec::new();
    if let Some(c) = client {
        v.push(frame(&client_frame(c)));
    }
    if let Some(s) = site {
        v.extend(s.frames().iter().map(frame));
    }
    Value::List(v)
}

/// The frame that names the client: `gpuptr:0:client=NAME` in the viewer.
pub(crate) fn client_frame(c: Client) -> Frame {
    Frame {
        filename: "gpuptr".into(),
        line: 0,
        name: format!("client={}", c.name()).into(),
    }
}

impl Snapshot {
    fn value(&self) -> Value {
        let segments = self.segments.iter().map(|s| {
            let sum = |f: &dyn Fn(&SnapshotBlock) -> bool,
                       size: &dyn Fn(&SnapshotBlock) -> usize| {
                s.blocks.iter().filter(|b| f(b)).map(size).sum::<usize>()
            };
            let active = |b: &SnapshotBlock| b.state == BlockState::Active;
            let held = |b: &SnapshotBlock| b.state != BlockState::Inactive;
            let blocks = s
                .blocks
                .iter()
                .map(|b| {
                    let mut d = vec![
                        ("address", int(b.address)),
                        ("size", usize_value(b.size)),
                        ("requested_size", usize_value(b.requested_size)),
                        ("state", Value::Str(b.state.name().into())),
                        ("frames", frames_value(b.client, b.site.as_ref())),
                    ];
                    if let Some(c) = b.client {
                        d.push(("client", Value::Str(c.name().into())));
                    }
                    Value::Dict(d)
                })
                .collect();
            let largest = s.blocks.iter().map(|b| b.size).max().unwrap_or(0);
            Value::Dict(vec![
                ("device", usize_value(s.device)),
                ("address", int(s.address)),
                ("total_size", usize_value(s.total_size)),
                ("allocated_size", usize_value(sum(&active, &|b| b.size))),
                ("active_size", usize_value(sum(&held, &|b| b.size))),
                (
                    "requested_size",
                    usize_value(sum(&active, &|b| b.requested_size)),
                ),
                ("stream", usize_value(s.stream)),
                (
                    "segment_type",
                    Value::Str(if largest <= 1 << 20 { "small" } else { "large" }.into()),
                ),
                ("segment_pool_id", Value::Tuple(vec![int(0), int(0)])),
                ("is_expandable", Value::Bool(false)),
                ("frames", Value::List(Vec::new())),
                ("blocks", Value::List(blocks)),
            ])
        });
        let traces = self.device_traces.iter().map(|t| {
            Value::List(
                t.iter()
                    .map(|e| {
                        let mut d = vec![
                            ("action", Value::Str(e.action.name().into())),
                            ("addr", int(e.address)),
                            ("size", usize_value(e.size)),
                            ("stream", usize_value(e.stream)),
                            ("frames", frames_value(e.client, e.site.as_ref())),
                            ("time_us", int(e.time_us)),
                        ];
                        if e.action == crate::history::Action::Oom {
                            d.push(("device_free", usize_value(e.device_free)));
                        }
                        if let Some(c) = e.client {
                            d.push(("client", Value::Str(c.name().into())));
                        }
                        Value::Dict(d)
                    })
                    .collect(),
            )
        });
        Value::Dict(vec![
            ("segments", Value::List(segments.collect())),
            ("device_traces", Value::List(traces.collect())),
            (
                "allocator_settings",
                Value::Dict(vec![
                    ("allocator", Value::Str("gpuptr".into())),
                    ("version", Value::Str(env!("CARGO_PKG_VERSION").into())),
                    ("max_entries", usize_value(self.max_entries)),
                    ("expandable_segments", Value::Bool(false)),
                ]),
            ),
            ("external_annotations", Value::List(Vec::new())),
        ])
    }

    /// The snapshot as a pickle (protocol 2) of PyTorch's snapshot dict:
    /// `pickle.load` gives what `torch.cuda.memory._snapshot()` gives.
    pub fn to_pickle(&self) -> Vec<u8> {
        let mut out = vec![0x80, 2];
        write_value(&mut out, &self.value());
        out.push(b'.');
        out
    }

    /// Write [`Snapshot::to_pickle`] to `path`: into a new file beside it,
    /// then renamed over it, so a reader never sees half a snapshot. As
    /// `open(path, "wb")` would: a symlink is followed (the file it names
    /// is replaced, or created if it does not exist yet; the link stays),
    /// a directory (or a link to one) is `EISDIR`, and a file that is not a
    /// regular one (a FIFO, `/dev/null`, a terminal) is written into, never
    /// replaced by a regular file. A regular file the caller may not write
    /// is `EACCES`, and one that is replaced keeps its permission bits (not
    /// its owner, set-ID bits, extended attributes or hard links: the new
    /// file is another, the caller's).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let target = final_target(path)?;
        match std::fs::metadata(&target) {
            Ok(m) if m.is_dir() => Err(std::io::Error::from_raw_os_error(libc::EISDIR)),
            Ok(m) if !m.is_file() => {
                let mut f = std::fs::OpenOptions::new().write(true).open(&target)?;
                f.write_all(&self.to_pickle())
            }
            Ok(m) => {
                // Only a file the caller could open for writing (nothing is
                // written to it here; the new file replaces it).
                drop(std::fs::OpenOptions::new().write(true).open(&target)?);
                // Its permission bits alone: the new file is the caller's,
                // and a set-user-ID bit kept would give it the caller's ID.
                let mode = std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777;
                self.replace(
                    &target,
                    Some(std::os::unix::fs::PermissionsExt::from_mode(mode)),
                )
            }
            Err(_) => self.replace(&target, None),
        }
    }

    /// Write to a new file beside `path` (with `mode`, if given), renamed
    /// over it.
    fn replace(&self, path: &Path, mode: Option<std::fs::Permissions>) -> std::io::Result<()> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        // A path that names no file (`""`, `missing/..`): as `open` finds
        // no such file.
        let name = path
            .file_name()
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOENT))?;
        // A fresh file of our own (O_EXCL: never one someone put there
        // first, nor a symlink's target), under the next free name; a
        // directory that is full of such names is an error, not a spin.
        let mut tries = 0;
        let (tmp, mut f) = loop {
            let suffix = format!(
                ".{}.{}.tmp",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            );
            // `.NAME.PID.N.tmp`, or, where that would pass the 255 bytes a
            // file name may have (NAME_MAX) and `path`'s own name does not,
            // a short name of gpuptr's own.
            let mut tmp_name = std::ffi::OsString::from(".");
            if 1 + name.len() + suffix.len() <= NAME_MAX {
                tmp_name.push(name);
            } else {
                tmp_name.push("gpuptr-snapshot");
            }
            tmp_name.push(suffix);
            let tmp = path.with_file_name(tmp_name);
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
            {
                Ok(f) => break (tmp, f),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 64 => {
                    tries += 1;
                }
                Err(e) => return Err(e),
            }
        };
        let r = (|| {
            if let Some(mode) = mode {
                f.set_permissions(mode)?;
            }
            f.write_all(&self.to_pickle())?;
            f.sync_data()?;
            std::fs::rename(&tmp, path)
        })();
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r
    }
}

/// The most bytes one file name may have on Linux's file systems.
const NAME_MAX: usize = 255;

/// `path` with every symlink in its last component followed, as `open`
/// follows them: the path of the file (existing or not) that writing to
/// `path` writes. A relative link is read from its own directory; a chain
/// of more than 40 links is `ELOOP`, as the kernel's limit.
fn final_target(path: &Path) -> std::io::Result<std::path::PathBuf> {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let t = std::fs::read_link(&p)?;
                p = match p.parent() {
                    Some(dir) if t.is_relative() => dir.join(t),
                    _ => t,
                };
            }
            _ => return Ok(p),
        }
    }
    Err(std::io::Error::from_raw_os_error(libc::ELOOP))
}

fn write_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::Bool(true) => out.push(0x88),
        Value::Bool(false) => out.push(0x89),
        Value::Int(n) => write_int(out, *n),
        Value::Str(s) => {
            out.push(b'X');
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        Value::List(items) => {
            out.push(b']');
            if !items.is_empty() {
                out.push(b'(');
                items.iter().for_each(|i| write_value(out, i));
                out.push(b'e');
            }
        }
        Value::Tuple(items) => {
            out.push(b'(');
            items.iter().for_each(|i| write_value(out, i));
            out.push(b't');
        }
        Value::Dict(items) => {
            out.push(b'}');
            if !items.is_empty() {
                out.push(b'(');
                for (k, v) in items {
                    write_value(out, &Value::Str((*k).into()));
                    write_value(out, v);
                }
                out.push(b'u');
            }
        }
    }
}

fn write_int(out: &mut Vec<u8>, n: i128) {
    match n {
        0..=0xff => out.extend_from_slice(&[b'K', n as u8]),
        0x100..=0xffff => {
            out.push(b'M');
            out.extend_from_slice(&(n as u16).to_le_bytes());
        }
        _ if i32::try_from(n).is_ok() => {
            out.push(b'J');
            out.extend_from_slice(&(n as i32).to_le_bytes());
        }
        _ => {
            // LONG1: the shortest little-endian two's complement.
            let bytes = n.to_le_bytes();
            let mut len = bytes.len();
            while len > 1 {
                let (last, prev) = (bytes[len - 1], bytes[len - 2]);
                let redundant =
                    (last == 0 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0);
                if !redundant {
                    break;
                }
                len -= 1;
            }
            out.extend_from_slice(&[0x8a, len as u8]);
            out.extend_from_slice(&bytes[..len]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_take_the_shortest_opcode_and_round_trip_their_bytes() {
        let enc = |n: i128| {
            let mut v = Vec::new();
            write_int(&mut v, n);
            v
        };
        assert_eq!(enc(7), [b'K', 7]);
        assert_eq!(enc(300), [b'M', 44, 1]);
        assert_eq!(enc(-1), [b'J', 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(enc(1 << 31), [0x8a, 5, 0, 0, 0, 0x80, 0]);
        assert_eq!(enc(0x7f00_0000_0000), [0x8a, 6, 0, 0, 0, 0, 0, 0x7f]);
        assert_eq!(
            enc(u64::MAX as i128),
            [0x8a, 9, 255, 255, 255, 255, 255, 255, 255, 255, 0]
        );
    }
}
