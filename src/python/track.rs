//! The leak report from Python: `track()`, `outstanding()`, and the Python
//! call site each allocation records while tracking (or the allocation
//! history) is on.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString};

use super::args::runtime;
use crate::Runtime;
use crate::{Frame, Site};

/// Frames of the Python stack a site keeps (innermost first) for the leak
/// report, and while the allocation history records.
const FRAMES: usize = 8;
const HISTORY_FRAMES: usize = 32;

/// Where the running Python code allocates: its stack, innermost first,
/// without the frames of gpuptr's own package (so a CuPy or numba
/// allocation names the user's line, not gpuptr's allocator glue). Only
/// called while tracking or the history is on: a walk of at most 8 frames
/// (32 for the history) up from the caller's, reading each one's file,
/// line and function.
pub(crate) fn python_site(py: Python<'_>) -> Site {
    let depth = match Runtime::global_if_open().is_some_and(|rt| rt.recording_history()) {
        true => HISTORY_FRAMES,
        false => FRAMES,
    };
    match python_stack(py, depth) {
        Ok(s) if !s.is_empty() => Site::Stack(s.into()),
        _ => Site::Described("<no Python caller>".into()),
    }
}

fn python_stack(py: Python<'_>, depth: usize) -> PyResult<Vec<Frame>> {
    static GETFRAME: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static PACKAGE: PyOnceLock<String> = PyOnceLock::new();
    let getframe = GETFRAME.import(py, "sys", "_getframe")?;
    let package = PACKAGE.get_or_try_init(py, || -> PyResult<String> {
        // Lossy, as the frames' files are: a path need not be UTF-8.
        let file = py.import("gpuptr")?.getattr("__file__")?;
        let file = file.cast::<PyString>()?.to_string_lossy();
        let dir = std::path::Path::new(file.as_ref())
            .parent()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(format!("{dir}{}", std::path::MAIN_SEPARATOR))
    })?;
    // The innermost frame is the Python code that called into gpuptr.
    let mut frame = getframe.call0()?;
    let mut frames = Vec::new();
    while !frame.is_none() && frames.len() < depth {
        let code = frame.getattr(intern!(py, "f_code"))?;
        let file = code.getattr(intern!(py, "co_filename"))?;
        // A file or function name need not be UTF-8 (a path Python read
        // with surrogate escapes): its frame is kept, lossily, not the
        // whole stack lost.
        let file = file.cast::<PyString>()?.to_string_lossy();
        if !file.starts_with(package.as_str()) {
            let line: u32 = frame
                .getattr(intern!(py, "f_lineno"))?
                .extract()
                .unwrap_or(0);
            let name = code.getattr(intern!(py, "co_name"))?;
            let name = name.cast::<PyString>()?.to_string_lossy();
            frames.push(Frame {
                filename: file.as_ref().into(),
                line,
                name: name.as_ref().into(),
            });
        }
        frame = frame.getattr(intern!(py, "f_back"))?;
    }
    Ok(frames)
}

/// Turn the leak report on (or off): while on, every allocation gpuptr
/// makes records where it was made (the Python stack, or the Rust location
/// for Rust callers) until it is released. ``GPUPTR_TRACK=1`` turns it on at
/// start. Allocations made while it is off are not listed.
#[pyfunction]
#[pyo3(signature = (enabled=true))]
pub(crate) fn track(enabled: bool) -> PyResult<()> {
    runtime()?.set_tracking(enabled);
    Ok(())
}

/// Whether the leak report is on.
#[pyfunction]
pub(crate) fn tracking() -> PyResult<bool> {
    Ok(runtime()?.tracking())
}

/// The live allocations made while tracking was on, grouped by where they
/// were made, the most bytes first: dicts of ``site`` (the stack, innermost
/// first), ``count``, ``bytes``, ``devices`` and ``clients``.
#[pyfunction]
pub(crate) fn outstanding(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let _log = super::logging::Deliver(py);
    let list = PyList::empty(py);
    for o in runtime()?.outstanding() {
        let d = PyDict::new(py);
        d.set_item("site", o.site)?;
        d.set_item("count", o.count)?;
        d.set_item("bytes", o.bytes)?;
        d.set_item("devices", o.devices)?;
        let clients: Vec<&str> = o.clients.iter().map(|c| c.name()).collect();
        d.set_item("clients", clients)?;
        list.append(d)?;
    }
    Ok(list)
}
