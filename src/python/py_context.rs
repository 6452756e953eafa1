//! `Context`, `Device` and `ContextHandle`: the context as consumers read it
//! (`ctx.device.id`, `ctx.handle.value`, `int(ctx.handle)`).

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::pyclass::CompareOp;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyAny;

use super::args::runtime;
use crate::Context;

/// A device, as numba's `Device` is read: `.id`, plus its name and memory.
#[pyclass(frozen, module = "gpuptr._core", name = "Device")]
pub struct PyDevice {
    /// The device ordinal.
    #[pyo3(get)]
    id: usize,
}

impl PyDevice {
    pub(crate) fn from_id(id: usize) -> Self {
        PyDevice { id }
    }
}

#[pymethods]
impl PyDevice {
    #[new]
    fn new(id: &Bound<'_, PyAny>) -> PyResult<Self> {
        let id = super::args::device_arg(id)?;
        runtime()?.check_device(id)?;
        Ok(PyDevice { id })
    }

    /// The device's name (`cuDeviceGetName`).
    #[getter]
    fn name(&self) -> PyResult<String> {
        Ok(runtime()?.device_name(self.id)?)
    }

    /// Total device memory in bytes (`cuDeviceTotalMem`).
    #[getter]
    fn total_memory(&self) -> PyResult<usize> {
        Ok(runtime()?.device_total_memory(self.id)?)
    }

    fn __int__(&self) -> usize {
        self.id
    }

    fn __index__(&self) -> usize {
        self.id
    }

    fn __hash__(&self) -> usize {
        self.id
    }

    fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> Option<bool> {
        let other_id = match other.cast::<PyDevice>() {
            Ok(d) => Some(d.get().id),
            Err(_) => other.extract::<usize>().ok(),
        };
        compare(other_id.map(|o| (self.id, o)), op)
    }

    fn __repr__(&self) -> String {
        format!("<gpuptr.Device {}>", self.id)
    }
}

/// An int, or what `__int__` gives (numba's and cuda-bindings' handles).
fn int_like(obj: &Bound<'_, PyAny>) -> Option<usize> {
    obj.extract()
        .ok()
        .or_else(|| obj.call_method0("__int__").ok()?.extract().ok())
}

fn compare<T: PartialEq>(pair: Option<(T, T)>, op: CompareOp) -> Option<bool> {
    // None is NotImplemented, so Python tries the reflected comparison.
    let (a, b) = pair?;
    match op {
        CompareOp::Eq => Some(a == b),
        CompareOp::Ne => Some(a != b),
        _ => None,
    }
}

/// A `CUcontext` handle. `.value` is the integer address (the attribute
/// PyArrow reads); `int(handle)` gives the same (what code written for
/// numba-cuda >= 0.28 does), and it compares equal to numba's or
/// cuda-bindings' `CUcontext` for the same context.
#[pyclass(frozen, module = "gpuptr._core", name = "ContextHandle")]
pub struct PyContextHandle {
    /// The `CUcontext` as an integer.
    #[pyo3(get)]
    value: usize,
}

#[pymethods]
impl PyContextHandle {
    fn __int__(&self) -> usize {
        self.value
    }

    fn __index__(&self) -> usize {
        self.value
    }

    fn __hash__(&self) -> usize {
        self.value
    }

    fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> Option<bool> {
        let other = match other.cast::<PyContextHandle>() {
            Ok(h) => Some(h.get().value),
            Err(_) => int_like(other),
        };
        compare(other.map(|o| (self.value, o)), op)
    }

    fn __repr__(&self) -> String {
        format!("<gpuptr.ContextHandle {:#x}>", self.value)
    }
}

/// A device's primary context, retained while this object or any pointer
/// into its memory lives. `gpuptr.context(d)` returns the same object for
/// the same device.
#[pyclass(frozen, weakref, module = "gpuptr._core", name = "Context")]
pub struct PyContext {
    pub(crate) inner: Arc<Context>,
    /// The device (`ctx.device.id` is its ordinal).
    #[pyo3(get)]
    device: Py<PyDevice>,
    /// The `CUcontext` handle (`.value`, `int()`).
    #[pyo3(get)]
    handle: Py<PyContextHandle>,
}

#[pymethods]
impl PyContext {
    /// `MemoryInfo(free, total)` from `cuMemGetInfo`.
    fn get_memory_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        static MEMORY_INFO: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let (free, total) = py.detach(|| self.inner.memory_info())?;
        MEMORY_INFO
            .import(py, "gpuptr._types", "MemoryInfo")?
            .call1((free, total))
    }

    /// Wait for all work in this context to finish.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        Ok(py.detach(|| self.inner.synchronize())?)
    }

    /// Wait for the work queued on ``stream`` (an int handle, or a numba or
    /// CuPy stream object) to finish.
    fn stream_synchronize(&self, py: Python<'_>, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        let Some(stream) = super::args::stream_arg(Some(stream))? else {
            return Ok(());
        };
        // An idle stream (the common case) costs a query, without letting
        // go of the GIL.
        // SAFETY: a stream handle is the caller's, as numba and CuPy take
        // them; stream objects give their own live handle.
        if unsafe { self.inner.stream_is_idle(stream) }? {
            return Ok(());
        }
        // SAFETY: as above.
        Ok(py.detach(|| unsafe { self.inner.stream_synchronize(stream) })?)
    }

    /// Make this context current on the calling thread.
    fn push(&self) -> PyResult<()> {
        Ok(self.inner.make_current()?)
    }

    fn __hash__(&self) -> usize {
        self.inner.raw()
    }

    fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> Option<bool> {
        // Equal to another gpuptr context of the same device, or to a numba
        // context (anything with .device.id and .handle) for the same one.
        let other = match other.cast::<PyContext>() {
            Ok(c) => Some((c.get().inner.device(), c.get().inner.raw())),
            Err(_) => (|| {
                let id: usize = other
                    .getattr("device")
                    .ok()?
                    .getattr("id")
                    .ok()?
                    .extract()
                    .ok()?;
                let raw = int_like(&other.getattr("handle").ok()?)?;
                Some((id, raw))
            })(),
        };
        compare(
            other.map(|o| ((self.inner.device(), self.inner.raw()), o)),
            op,
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "<gpuptr.Context device={} handle={:#x}>",
            self.inner.device(),
            self.inner.raw()
        )
    }
}

/// The Python object for each device's context: one per device, so
/// `context(0) is context(0)`. gpuptr holds it (and so the primary context)
/// until `release_contexts()`, as numba and CuPy hold theirs: dropping the
/// last retain destroys a primary context and everything in it.
static PY_CONTEXTS: Mutex<Vec<Option<Py<PyContext>>>> = Mutex::new(Vec::new());

fn cached(ctx: &Arc<Context>, py: Python<'_>) -> Option<Py<PyContext>> {
    let slots = crate::sync::lock(&PY_CONTEXTS);
    let c = slots.get(ctx.device())?.as_ref()?;
    Arc::ptr_eq(&c.get().inner, ctx).then(|| c.clone_ref(py))
}

/// `device`'s live context and its Python object: with the Python object
/// of a context still current cached, one lock and no other lookup (the
/// allocation's hot path); else through the runtime's slot.
pub(crate) fn device_py_context(
    py: Python<'_>,
    device: usize,
) -> PyResult<(Arc<Context>, Py<PyContext>)> {
    {
        let slots = crate::sync::lock(&PY_CONTEXTS);
        // The cached object holds its context: while no reset came since,
        // it is the runtime's live one.
        if let Some(c) = slots.get(device).and_then(Option::as_ref) {
            if c.get().inner.is_current() {
                return Ok((c.get().inner.clone(), c.clone_ref(py)));
            }
        }
    }
    let ctx = super::args::runtime()?.context(device)?;
    let pyctx = py_context(py, &ctx)?;
    Ok((ctx, pyctx))
}

/// The Python object of a core context.
pub(crate) fn py_context(py: Python<'_>, ctx: &Arc<Context>) -> PyResult<Py<PyContext>> {
    if let Some(c) = cached(ctx, py) {
        return Ok(c);
    }
    // Build outside the lock: creating Python objects can run arbitrary code.
    let made = Py::new(
        py,
        PyContext {
            inner: ctx.clone(),
            device: Py::new(py, PyDevice { id: ctx.device() })?,
            handle: Py::new(py, PyContextHandle { value: ctx.raw() })?,
        },
    )?;
    let mut slots = crate::sync::lock(&PY_CONTEXTS);
    if slots.len() <= ctx.device() {
        slots.resize_with(ctx.device() + 1, || None);
    }
    let slot = &mut slots[ctx.device()];
    match slot {
        Some(c) if Arc::ptr_eq(&c.get().inner, ctx) => Ok(c.clone_ref(py)),
        _ => {
            let old = slot.replace(made.clone_ref(py));
            drop(slots);
            drop(old);
            Ok(made)
        }
    }
}

/// A pointer's context object, made on first use and kept in `cell`.
pub(crate) fn lazy_context(
    cell: &std::sync::OnceLock<Py<PyContext>>,
    py: Python<'_>,
    ctx: &Arc<Context>,
) -> PyResult<Py<PyContext>> {
    if let Some(c) = cell.get() {
        return Ok(c.clone_ref(py));
    }
    let c = py_context(py, ctx)?;
    Ok(cell.get_or_init(|| c).clone_ref(py))
}

/// Drop gpuptr's own holds on every context, the Python objects cached
/// here and the runtime's hold for the allocator hooks alike: a context is
/// then released once no pointer or other object holds it.
pub(crate) fn release_contexts() {
    let old = std::mem::take(&mut *crate::sync::lock(&PY_CONTEXTS));
    drop(old);
    if let Some(rt) = crate::Runtime::global_if_open() {
        rt.release_held_contexts();
    }
}

/// The context a constructor argument names: a gpuptr context, a numba
/// context (read through `.device.id`), or None (resolve by address).
pub(crate) fn context_arg(obj: &Bound<'_, PyAny>) -> PyResult<Option<Arc<Context>>> {
    if obj.is_none() {
        return Ok(None);
    }
    if let Ok(c) = obj.cast::<PyContext>() {
        return Ok(Some(c.get().inner.clone()));
    }
    // A numba context's attributes may be Python code.
    let _region = super::shutdown::Region::enter_or_hang(obj.py());
    let id: usize = obj
        .getattr("device")
        .and_then(|d| d.getattr("id"))
        .and_then(|i| i.extract())
        .map_err(|_| {
            // A value of the wrong type (the error rule): a TypeError.
            let name = obj
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default();
            pyo3::exceptions::PyTypeError::new_err(format!(
                "context must be a gpuptr Context, a numba Context or None, not {name}"
            ))
        })?;
    Ok(Some(runtime()?.context(id)?))
}
