//! The entry points that make host and managed memory: `alloc_host`,
//! `register_host`, `register_host_ptr` and `alloc_managed`.

use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;

use super::{host_object, owner_is_read_only, Owned, PyManagedMemory};

use crate::python::args::{device_context, held_device_context, pointer_arg, runtime, size_arg};
use crate::python::pointer::PyMemoryPointer;
use crate::python::py_context::py_context;
use crate::{Error, HostFlags, HostMemory};

/// Allocate ``nbytes`` of pinned host memory on ``device`` (default: the
/// current one). With ``mapped``, it is mapped into the device and returned
/// as a `MappedMemory`, else as a `PinnedMemory`.
///
/// It comes from the device pool's cache of pinned memory: a block freed
/// earlier with the same ``mapped``, ``portable`` and ``wc`` flags, reused
/// only once all work queued before its free, on every stream, is done.
#[pyfunction]
#[pyo3(signature = (nbytes, mapped=false, portable=false, wc=false, device=None))]
pub(crate) fn alloc_host(
    py: Python<'_>,
    nbytes: &Bound<'_, PyAny>,
    mapped: bool,
    portable: bool,
    wc: bool,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    // Held: without the hold, freeing the last block would end the context
    // (cuDevicePrimaryCtxRelease, and the next allocation's retain creates
    // it again, when no one else holds it) and give the cache back with it.
    let mut ctx = held_device_context(device)?;
    let flags = HostFlags {
        mapped,
        portable,
        write_combined: wc,
        read_only: false,
    };
    let size = size_arg(nbytes, "nbytes")?;
    // Pinning takes a while for large sizes: let other threads run. A
    // reset on another thread meanwhile refuses the old context: the
    // memory then comes from the new one.
    let host = py.detach(|| {
        let mut tries = 0;
        loop {
            match HostMemory::alloc(&ctx, size, flags) {
                Err(_) if !ctx.is_current() && tries < 16 => {
                    tries += 1;
                    ctx = runtime()?.held_context(ctx.device())?;
                }
                r => return r.map_err(PyErr::from),
            }
        }
    })?;
    host_object(py, host, Owned::default(), mapped)
}

/// Pin the memory of ``obj`` (any writable or read-only C-contiguous
/// buffer: numpy array, bytearray, ...) in place, keeping ``obj`` alive until
/// it is unregistered. With ``mapped``, returns a `MappedMemory`.
#[pyfunction]
#[pyo3(signature = (obj, mapped=false, portable=false, device=None))]
pub(crate) fn register_host(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    mapped: bool,
    portable: bool,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    // A memoryview holds the buffer export that keeps obj's memory from
    // moving (a bytearray cannot resize meanwhile); it is a Python object, so
    // the garbage collector sees it.
    let export = pyo3::types::PyMemoryView::from(obj)?;
    let buf = PyUntypedBuffer::get(export.as_any())?;
    if !buf.is_c_contiguous() {
        return Err(
            Error::InvalidArgument("only C-contiguous buffers can be pinned".into()).into(),
        );
    }
    let (ptr, len, readonly) = (buf.buf_ptr() as usize, buf.len_bytes(), buf.readonly());
    drop(buf);
    let ctx = device_context(device)?;
    let flags = HostFlags {
        mapped,
        portable,
        write_combined: false,
        read_only: readonly,
    };
    // SAFETY: the memoryview, held by the returned object until the
    // registration is released (its Drop and `__clear__` unregister first),
    // keeps the memory alive and in place.
    let host = py.detach(|| unsafe { HostMemory::register(&ctx, ptr, len, flags, None) })?;
    let owned = Owned::new(Some(obj.clone().unbind()), Some(export.into_any().unbind()));
    host_object(py, host, owned, mapped)
}

/// Pin ``size`` bytes of host memory at ``address`` in place (numba's
/// ``mempin``), keeping ``owner`` alive until it is unregistered. When
/// ``owner`` exports a read-only buffer (``bytes``, a read-only array), the
/// memory is read-only, as ``register_host`` makes it.
#[pyfunction]
#[pyo3(signature = (address, size, owner=None, mapped=false, portable=false, device=None))]
pub(crate) fn register_host_ptr(
    py: Python<'_>,
    address: &Bound<'_, PyAny>,
    size: &Bound<'_, PyAny>,
    owner: Option<Py<PyAny>>,
    mapped: bool,
    portable: bool,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let ptr = pointer_arg(address)? as usize;
    let ctx = device_context(device)?;
    let read_only = owner_is_read_only(py, owner.as_ref());
    let flags = HostFlags {
        mapped,
        portable,
        write_combined: false,
        read_only,
    };
    let size = size_arg(size, "size")?;
    // SAFETY: numba's `mempin` shape: `owner` (held by the returned object,
    // which unregisters before letting it go) keeps the memory alive; the
    // driver refuses ranges that are not mapped host memory.
    let host = py.detach(|| unsafe { HostMemory::register(&ctx, ptr, size, flags, None) })?;
    host_object(py, host, Owned::new(owner, None), mapped)
}

/// Allocate ``nbytes`` of managed (unified) memory on ``device`` (default:
/// the current one), attached globally (or to the host).
#[pyfunction]
#[pyo3(signature = (nbytes, attach_global=true, device=None))]
pub(crate) fn alloc_managed(
    py: Python<'_>,
    nbytes: &Bound<'_, PyAny>,
    attach_global: bool,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyManagedMemory>> {
    let ctx = device_context(device)?;
    let size = size_arg(nbytes, "nbytes")?;
    // Allocated without the GIL; its Python site is noted once it is back.
    let mem = py.detach(|| ctx.alloc_managed(size, attach_global))?;
    mem.note_site(|| crate::python::track::python_site(py));
    let pyctx = py_context(py, &ctx)?;
    Py::new(
        py,
        PyManagedMemory::init(PyMemoryPointer::owning(mem, Some(pyctx))),
    )
}
