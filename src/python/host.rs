//! `PinnedMemory`, `MappedMemory` and `ManagedMemory`: numba's host and
//! managed memory types, each exporting its bytes through the buffer
//! protocol (so `numpy.asarray(mem)` and numba's pinned, mapped and managed
//! arrays work).

use std::ffi::{c_int, c_void};
use std::sync::{Arc, OnceLock};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::ffi;
use pyo3::prelude::*;

use super::pointer::{context_arg, keep_finalizer, pointer_arg, PyMemoryPointer};
use super::py_context::{lazy_context, py_context, PyContext};
use super::{device_context, size_arg};
use crate::{Error, HostFlags, HostMemory, KeepAlive};

/// Fill a `Py_buffer` over `[ptr, ptr+len)`, exported by `owner`.
///
/// # Safety
/// `view` is the buffer CPython passed to `__getbuffer__`, and the memory
/// stays valid while `owner` (which the buffer references) lives.
unsafe fn fill_buffer(
    owner: &Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    ptr: usize,
    len: usize,
    flags: c_int,
) -> PyResult<()> {
    static EMPTY: u8 = 0;
    let buf = if len == 0 {
        &EMPTY as *const u8 as *mut c_void
    } else {
        ptr as *mut c_void
    };
    if ffi::PyBuffer_FillInfo(view, owner.as_ptr(), buf, len as ffi::Py_ssize_t, 0, flags) == -1 {
        return Err(PyErr::fetch(owner.py()));
    }
    Ok(())
}

/// Export `host`'s bytes from `owner`'s `__getbuffer__`.
///
/// # Safety
/// As [`fill_buffer`].
unsafe fn export_host(
    owner: &Bound<'_, PyAny>,
    host: &HostMemory,
    view: *mut ffi::Py_buffer,
    flags: c_int,
) -> PyResult<()> {
    host.check_live()?;
    fill_buffer(owner, view, host.host_ptr(), host.size(), flags)
}

/// The Python object for pinned memory: `MappedMemory` when mapped into
/// the device, else `PinnedMemory`. It manages (releases) the memory.
fn host_object(
    py: Python<'_>,
    host: Arc<HostMemory>,
    owned: Option<Py<PyAny>>,
    mapped: bool,
) -> PyResult<Py<PyAny>> {
    if mapped {
        Ok(Bound::new(py, PyMappedMemory::init(host, owned, true)?)?
            .into_any()
            .unbind())
    } else {
        Ok(Bound::new(py, PyPinnedMemory::new(host, owned, true))?
            .into_any()
            .unbind())
    }
}

/// Host memory someone else pinned, from the numba constructor shape
/// ``(context, pointer, size, finalizer)``; managed when a finalizer is given.
fn wrap_pinned(
    context: &Bound<'_, PyAny>,
    pointer: &Bound<'_, PyAny>,
    size: isize,
    finalizer: Option<Py<PyAny>>,
    mapped: bool,
) -> PyResult<(Arc<HostMemory>, bool)> {
    let ctx = match context_arg(context)? {
        Some(c) => c,
        None => device_context(None)?,
    };
    let managed = finalizer.is_some();
    let host = HostMemory::wrap(
        &ctx,
        pointer_arg(pointer)? as usize,
        size_arg(size)?,
        mapped,
        keep_finalizer(finalizer),
    )?;
    Ok((host, managed))
}

/// Page-locked host memory (numba's ``PinnedMemory``). Its bytes are
/// exported through the buffer protocol. ``PinnedMemory(context, pointer,
/// size, owner=None, finalizer=None)`` wraps memory someone else pinned.
#[pyclass(frozen, module = "gpuptr._core", name = "PinnedMemory")]
pub struct PyPinnedMemory {
    host: Arc<HostMemory>,
    owned: Option<Py<PyAny>>,
    managed: bool,
    context: OnceLock<Py<PyContext>>,
}

impl PyPinnedMemory {
    pub(crate) fn new(host: Arc<HostMemory>, owned: Option<Py<PyAny>>, managed: bool) -> Self {
        PyPinnedMemory {
            host,
            owned,
            managed,
            context: OnceLock::new(),
        }
    }
}

#[pymethods]
impl PyPinnedMemory {
    #[new]
    #[pyo3(signature = (context, pointer, size, owner=None, finalizer=None))]
    fn py_new(
        context: &Bound<'_, PyAny>,
        pointer: &Bound<'_, PyAny>,
        size: isize,
        owner: Option<Py<PyAny>>,
        finalizer: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let (host, managed) = wrap_pinned(context, pointer, size, finalizer, false)?;
        Ok(PyPinnedMemory::new(host, owner, managed))
    }

    /// The context the memory is pinned in.
    #[getter]
    fn context(&self, py: Python<'_>) -> PyResult<Py<PyContext>> {
        lazy_context(&self.context, py, self.host.context())
    }

    /// The host address (an int).
    #[getter]
    fn host_pointer(&self) -> usize {
        self.host.host_ptr()
    }

    /// numba's ``handle``: the host address.
    #[getter]
    fn handle(&self) -> usize {
        self.host.host_ptr()
    }

    /// Size in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.host.size()
    }

    /// The object whose memory this is (registered memory), if any.
    #[getter]
    fn owned(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.owned.as_ref().map(|o| o.clone_ref(py))
    }

    /// Whether ``free()`` releases the memory.
    #[getter]
    fn is_managed(&self) -> bool {
        self.managed
    }

    /// numba's ``own()``: pinned memory is its own owner.
    fn own(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// Release (free or unregister) now; a second call does nothing.
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        if self.managed {
            py.detach(|| self.host.free())?;
        }
        Ok(())
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        export_host(slf.as_any(), &slf.get().host, view, flags)
    }

    fn __repr__(&self) -> String {
        format!(
            "<gpuptr.PinnedMemory {:#x} size={}>",
            self.host.host_ptr(),
            self.host.size()
        )
    }
}

/// Host memory mapped into the device (numba's ``MappedMemory``): a
/// MemoryPointer over the device address, whose host bytes are exported
/// through the buffer protocol.
#[pyclass(frozen, extends = PyMemoryPointer, module = "gpuptr._core", name = "MappedMemory")]
pub struct PyMappedMemory {
    host: Arc<HostMemory>,
    owned: Option<Py<PyAny>>,
}

impl PyMappedMemory {
    pub(crate) fn init(
        host: Arc<HostMemory>,
        owned: Option<Py<PyAny>>,
        managed: bool,
    ) -> PyResult<PyClassInitializer<Self>> {
        let view = host.device_view()?;
        let base = PyMemoryPointer::over(view, None).with_managed(managed);
        Ok(PyClassInitializer::from(base).add_subclass(PyMappedMemory { host, owned }))
    }
}

#[pymethods]
impl PyMappedMemory {
    #[new]
    #[pyo3(signature = (context, pointer, size, owner=None, finalizer=None))]
    fn py_new(
        context: &Bound<'_, PyAny>,
        pointer: &Bound<'_, PyAny>,
        size: isize,
        owner: Option<Py<PyAny>>,
        finalizer: Option<Py<PyAny>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let (host, managed) = wrap_pinned(context, pointer, size, finalizer, true)?;
        PyMappedMemory::init(host, owner, managed)
    }

    /// The host address (an int).
    #[getter]
    fn host_pointer(&self) -> usize {
        self.host.host_ptr()
    }

    /// numba's ``handle`` for mapped memory: the host address.
    #[getter]
    fn handle(&self) -> usize {
        self.host.host_ptr()
    }

    /// The object whose memory this is (registered memory), if any.
    #[getter]
    fn owned(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.owned.as_ref().map(|o| o.clone_ref(py))
    }

    /// Release the host memory now (when this pointer manages it).
    fn free(slf: &Bound<'_, Self>) -> PyResult<()> {
        let base = slf.as_super().get();
        if base.is_managed() {
            let host = &slf.get().host;
            slf.py().detach(|| {
                base.view.parent().free()?;
                host.free()
            })?;
        }
        Ok(())
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        export_host(slf.as_any(), &slf.get().host, view, flags)
    }
}

/// Managed (unified) memory (numba's ``ManagedMemory``): a MemoryPointer
/// whose bytes the host can also reach, exported through the buffer protocol.
#[pyclass(frozen, extends = PyMemoryPointer, module = "gpuptr._core", name = "ManagedMemory")]
pub struct PyManagedMemory;

impl PyManagedMemory {
    pub(crate) fn init(base: PyMemoryPointer) -> PyClassInitializer<Self> {
        PyClassInitializer::from(base).add_subclass(PyManagedMemory)
    }
}

#[pymethods]
impl PyManagedMemory {
    #[new]
    #[pyo3(signature = (context, pointer, size, owner=None, finalizer=None))]
    fn py_new(
        context: &Bound<'_, PyAny>,
        pointer: &Bound<'_, PyAny>,
        size: isize,
        owner: Option<Py<PyAny>>,
        finalizer: Option<Py<PyAny>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let base = PyMemoryPointer::py_new(context, pointer, size, owner, finalizer)?;
        Ok(PyManagedMemory::init(base))
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let base = slf.as_super().get();
        base.view.parent().check_live()?;
        fill_buffer(
            slf.as_any(),
            view,
            base.view.address() as usize,
            base.view.size(),
            flags,
        )
    }
}

/// Allocate ``nbytes`` of pinned host memory on ``device`` (default: the
/// current one). With ``mapped``, it is mapped into the device and returned
/// as a `MappedMemory`, else as a `PinnedMemory`.
#[pyfunction]
#[pyo3(signature = (nbytes, mapped=false, portable=false, wc=false, device=None))]
pub(crate) fn alloc_host(
    py: Python<'_>,
    nbytes: isize,
    mapped: bool,
    portable: bool,
    wc: bool,
    device: Option<usize>,
) -> PyResult<Py<PyAny>> {
    let ctx = device_context(device)?;
    let flags = HostFlags {
        mapped,
        portable,
        write_combined: wc,
    };
    let size = size_arg(nbytes)?;
    // Pinning takes a while for large sizes: let other threads run.
    let host = py.detach(|| HostMemory::alloc(&ctx, size, flags))?;
    host_object(py, host, None, mapped)
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
    device: Option<usize>,
) -> PyResult<Py<PyAny>> {
    let buf = PyUntypedBuffer::get(obj)?;
    if !buf.is_c_contiguous() {
        return Err(
            Error::InvalidArgument("only C-contiguous buffers can be pinned".into()).into(),
        );
    }
    let (ptr, len) = (buf.buf_ptr() as usize, buf.len_bytes());
    let ctx = device_context(device)?;
    let flags = HostFlags {
        mapped,
        portable,
        write_combined: false,
    };
    // Holding the buffer keeps obj alive and its memory from moving.
    let keep: KeepAlive = Box::new(buf);
    let host = py.detach(|| HostMemory::register(&ctx, ptr, len, flags, Some(keep)))?;
    let owned = Some(obj.clone().unbind());
    host_object(py, host, owned, mapped)
}

/// Pin ``size`` bytes of host memory at ``address`` in place (numba's
/// ``mempin``), keeping ``owner`` alive until it is unregistered.
#[pyfunction]
#[pyo3(signature = (address, size, owner=None, mapped=false, portable=false, device=None))]
pub(crate) fn register_host_ptr(
    py: Python<'_>,
    address: &Bound<'_, PyAny>,
    size: isize,
    owner: Option<Py<PyAny>>,
    mapped: bool,
    portable: bool,
    device: Option<usize>,
) -> PyResult<Py<PyAny>> {
    let ptr = pointer_arg(address)? as usize;
    let ctx = device_context(device)?;
    let flags = HostFlags {
        mapped,
        portable,
        write_combined: false,
    };
    let keep = owner
        .as_ref()
        .map(|o| Box::new(o.clone_ref(py)) as KeepAlive);
    let size = size_arg(size)?;
    let host = py.detach(|| HostMemory::register(&ctx, ptr, size, flags, keep))?;
    host_object(py, host, owner, mapped)
}

/// Allocate ``nbytes`` of managed (unified) memory on ``device`` (default:
/// the current one), attached globally (or to the host).
#[pyfunction]
#[pyo3(signature = (nbytes, attach_global=true, device=None))]
pub(crate) fn alloc_managed(
    py: Python<'_>,
    nbytes: isize,
    attach_global: bool,
    device: Option<usize>,
) -> PyResult<Py<PyManagedMemory>> {
    let ctx = device_context(device)?;
    let size = size_arg(nbytes)?;
    let mem = py.detach(|| ctx.alloc_managed(size, attach_global))?;
    let pyctx = py_context(py, &ctx)?;
    Py::new(
        py,
        PyManagedMemory::init(PyMemoryPointer::owning(mem, Some(pyctx))),
    )
}
