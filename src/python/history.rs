//! The allocation history and memory snapshots from Python:
//! `record_history()`, `snapshot()` and `dump_snapshot()`. The core keeps
//! the trace and writes the pickle; this room gives it the Python stacks
//! (through the allocation sites, `track::python_site`) and turns a failed
//! write into the `OSError` Python code expects.

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::PyAny;

use super::args::{fs_path, runtime, size_arg};
use crate::Error;

/// Start (or stop) recording the allocation history, as PyTorch's
/// ``torch.cuda.memory._record_memory_history``, for every library on
/// gpuptr's pool: each allocation and free (with the Python stack of the
/// allocation and the client that asked: ``direct``, ``numba``, ``cupy``,
/// ``torch``, ``cuda_core`` or ``rmm``), each driver allocation of the
/// pool, and each out of memory. Started, the trace begins afresh and
/// keeps the newest ``max_entries`` events; stopped, nothing more is
/// recorded and what was stays for ``snapshot()``. ``GPUPTR_HISTORY=1``
/// starts it at start-up.
///
/// ``oom_snapshot``: a path (``str``, ``bytes`` or ``os.PathLike``) where a snapshot is
/// written when an allocation runs out of memory (its error then names the
/// file), as ``GPUPTR_OOM_SNAPSHOT`` does; ``""`` writes none; ``None``
/// (the default) leaves the setting as it is. A snapshot that cannot be
/// written is logged and named in the error, never raised.
///
/// Off, an allocation pays one relaxed load (shared with ``track()``); on,
/// about the cost of the leak report (the stack walk, 32 frames at most).
#[pyfunction]
#[pyo3(signature = (enabled=true, max_entries=None, oom_snapshot=None))]
pub(crate) fn record_history(
    enabled: bool,
    max_entries: Option<&Bound<'_, PyAny>>,
    oom_snapshot: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let oom_snapshot = oom_snapshot.map(fs_path).transpose()?;
    let max_entries = match max_entries {
        Some(n) => size_arg(n, "max_entries")?,
        None => crate::history::DEFAULT_MAX_ENTRIES,
    };
    let rt = runtime()?;
    if let Some(path) = oom_snapshot {
        // Refused now, not at the first out of memory: no file has a NUL
        // in its name.
        if std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()).contains(&0) {
            return Err(Error::InvalidArgument(format!(
                "oom_snapshot {path:?} has a NUL byte: no file can have that name"
            ))
            .into());
        }
        rt.set_oom_snapshot((!path.as_os_str().is_empty()).then_some(path));
    }
    rt.record_history(enabled, max_entries);
    Ok(())
}

/// Whether the allocation history records.
#[pyfunction]
pub(crate) fn recording_history() -> PyResult<bool> {
    Ok(runtime()?.recording_history())
}

/// The memory snapshot now, as ``torch.cuda.memory._snapshot()`` gives it:
/// a dict of ``segments`` (each driver allocation of every device's pool,
/// its blocks with their ``state``, sizes and ``frames``),
/// ``device_traces`` (the history, one list per device),
/// ``allocator_settings`` and ``external_annotations``. Each allocation's
/// block and trace entries also have ``client``, and their first frame is
/// ``{"filename": "gpuptr", "line": 0, "name": "client=NAME"}``.
#[pyfunction]
pub(crate) fn snapshot(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let _log = super::logging::Deliver(py);
    let rt = runtime()?;
    let bytes = py.detach(|| rt.snapshot().to_pickle());
    let pickle = py.import("pickle")?;
    pickle.call_method1("loads", (pyo3::types::PyBytes::new(py, &bytes),))
}

/// Write the memory snapshot (see ``snapshot()``) to ``path`` as a pickle,
/// the file ``python -m torch.cuda._memory_viz trace_plot`` (and the viewer
/// at pytorch.org/memory_viz) reads. It is written beside ``path`` and
/// renamed over it, so no reader sees half of it. A directory that does not
/// exist, or one that cannot be written, raises the ``OSError`` that says
/// so (``FileNotFoundError``, ``PermissionError``, ...), naming ``path``.
/// ``path`` is a ``str``, ``bytes`` or path-like object, as ``open`` takes.
#[pyfunction]
pub(crate) fn dump_snapshot(py: Python<'_>, path: &Bound<'_, PyAny>) -> PyResult<()> {
    let path = fs_path(path)?;
    let _log = super::logging::Deliver(py);
    let rt = runtime()?;
    let r = py.detach(|| rt.snapshot().write(&path));
    r.map_err(|e| match e.raw_os_error() {
        Some(code) => {
            let strerror = py
                .import("os")
                .and_then(|os| os.call_method1("strerror", (code,)))
                .and_then(|s| s.extract::<String>())
                .unwrap_or_else(|_| e.to_string());
            PyOSError::new_err((code, strerror, path.display().to_string()))
        }
        None => Error::InvalidArgument(format!(
            "cannot write a memory snapshot to {}: {e}",
            path.display()
        ))
        .into(),
    })
}
