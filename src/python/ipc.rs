//! `IpcHandle`: sharing gpuptr memory with another process, without numba.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use super::args::runtime;
use super::pointer::PyMemoryPointer;
use crate::IpcHandle;

/// A handle another process opens to use this memory: picklable (it is
/// bytes: the device, the offset in the driver's allocation, the size and
/// the exporting process). ``open()`` (or ``gpuptr.open_ipc(h)``) gives a
/// MemoryPointer: in another process, the mapped memory (unmapped when the
/// last pointer over it goes); in the exporting process, the original
/// memory. Memory the exporter freed before the open, a gone exporter, and
/// a handle whose offset and size run outside the allocation it was made
/// from raise ``InvalidPointerError`` in any process.
#[pyclass(frozen, eq, hash, module = "gpuptr._core", name = "IpcHandle")]
#[derive(PartialEq, Hash)]
pub(crate) struct PyIpcHandle(IpcHandle);

#[pymethods]
impl PyIpcHandle {
    /// The device the memory is on.
    #[getter]
    fn device(&self) -> usize {
        self.0.device
    }

    /// Bytes from the start of the exporter's driver allocation (a pool
    /// block lies inside a larger one).
    #[getter]
    fn offset(&self) -> usize {
        self.0.offset
    }

    /// Bytes of memory.
    #[getter]
    fn size(&self) -> usize {
        self.0.size
    }

    /// The exporting process's id.
    #[getter]
    fn pid(&self) -> u32 {
        self.0.pid
    }

    /// The handle as bytes (what pickling stores).
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.to_bytes())
    }

    /// A handle from ``to_bytes()``; other bytes raise
    /// ``InvalidArgumentError``.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        Ok(PyIpcHandle(IpcHandle::from_bytes(data)?))
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let from_bytes = slf.get_type().getattr("from_bytes")?;
        let args = PyTuple::new(py, [slf.get().to_bytes(py)])?;
        PyTuple::new(py, [from_bytes.into_any(), args.into_any()])
    }

    /// The memory this handle names (see the class).
    fn open(&self, py: Python<'_>) -> PyResult<PyMemoryPointer> {
        let rt = runtime()?;
        let view = py.detach(|| rt.ipc_open(&self.0))?;
        Ok(PyMemoryPointer::over(view, None))
    }

    fn __repr__(&self) -> String {
        format!(
            "<gpuptr.IpcHandle {} bytes at offset {} on device {} from pid {}>",
            self.0.size, self.0.offset, self.0.device, self.0.pid
        )
    }
}

/// Sharing from the pointer's side: here, so that the pointer's module does
/// not depend on this one.
#[pymethods]
impl PyMemoryPointer {
    /// A picklable ``IpcHandle`` another process opens to use this memory
    /// (device memory gpuptr allocated, or a wrap of it with its pointer as
    /// owner; not managed, host or other wrapped memory, which raise
    /// ``InvalidArgumentError``, as any memory does when no liveness record
    /// is left: 65,536 allocations exported and live at once, or no
    /// ``/dev/shm``). Every handle of one allocation shares its record,
    /// which bounds it to the allocation in another process (a handle
    /// without one does not open there); an empty view's handle opens to
    /// an empty view.
    fn ipc_handle(&self) -> PyResult<PyIpcHandle> {
        Ok(PyIpcHandle(runtime()?.ipc_export(&self.view)?))
    }
}

/// ``handle.open()``: the memory an ``IpcHandle`` names.
#[pyfunction]
pub(crate) fn open_ipc(py: Python<'_>, handle: &PyIpcHandle) -> PyResult<PyMemoryPointer> {
    handle.open(py)
}
