//! `PinnedMemory`, `MappedMemory` and `ManagedMemory`: numba's host and
//! managed memory types, each exporting its bytes through the buffer
//! protocol (so `numpy.asarray(mem)` and numba's pinned, mapped and managed
//! arrays work).

use std::ffi::{c_int, c_void};
use std::sync::{Arc, OnceLock};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::ffi;
use pyo3::prelude::*;

use super::args::{device_context, pointer_arg, runtime, size_arg};
use super::pointer::{keep_finalizer, PyMemoryPointer};
use super::py_context::{context_arg, lazy_context, PyContext};
use crate::HostMemory;

mod entry;
pub(crate) use entry::{alloc_host, alloc_managed, register_host, register_host_ptr};

/// Fill a `Py_buffer` over `[ptr, ptr+len)`, exported by `owner`
/// (read-only when `readonly`: a request for a writable buffer then fails
/// with `BufferError`).
///
/// # Safety
/// `view` is the buffer CPython passed to `__getbuffer__`, and the memory
/// stays valid while the export is counted (see [`HostMemory::begin_export`]).
unsafe fn fill_buffer(
    owner: &Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    ptr: usize,
    len: usize,
    readonly: bool,
    flags: c_int,
) -> PyResult<()> {
    static EMPTY: u8 = 0;
    let buf = if len == 0 {
        &EMPTY as *const u8 as *mut c_void
    } else {
        ptr as *mut c_void
    };
    // SAFETY: `view` is CPython's; the range is valid (this fn's contract).
    let r = unsafe {
        ffi::PyBuffer_FillInfo(
            view,
            owner.as_ptr(),
            buf,
            len as ffi::Py_ssize_t,
            c_int::from(readonly),
            flags,
        )
    };
    if r == -1 {
        return Err(PyErr::fetch(owner.py()));
    }
    Ok(())
}

/// Export `host`'s bytes from `owner`'s `__getbuffer__`, counting the
/// export so that `free()` refuses while it is alive.
///
/// # Safety
/// As [`fill_buffer`]; `__releasebuffer__` calls [`HostMemory::end_export`].
unsafe fn export_host(
    owner: &Bound<'_, PyAny>,
    host: &HostMemory,
    view: *mut ffi::Py_buffer,
    flags: c_int,
) -> PyResult<()> {
    host.begin_export()?;
    // SAFETY: counted above, so the memory stays until the release.
    let r = unsafe {
        fill_buffer(
            owner,
            view,
            host.host_ptr(),
            host.size(),
            host.is_readonly(),
            flags,
        )
    };
    if r.is_err() {
        host.end_export();
    }
    r
}

/// The Python object for pinned memory: `MappedMemory` when mapped into
/// the device, else `PinnedMemory`. It manages (releases) the memory.
fn host_object(
    py: Python<'_>,
    host: Arc<HostMemory>,
    owned: Owned,
    mapped: bool,
) -> PyResult<Py<PyAny>> {
    let inner = HostInner { host, owned };
    if mapped {
        Ok(Bound::new(py, PyMappedMemory::init(inner, true)?)?
            .into_any()
            .unbind())
    } else {
        Ok(Bound::new(py, PyPinnedMemory::init(inner, true)?)?
            .into_any()
            .unbind())
    }
}

/// Whether `owner` exports a read-only buffer (``bytes``, a read-only numpy
/// array or memoryview): memory it owns is then read-only through gpuptr.
fn owner_is_read_only(py: Python<'_>, owner: Option<&Py<PyAny>>) -> bool {
    let Some(owner) = owner else { return false };
    // SAFETY: a live object; the check only reads its type's buffer slot.
    if unsafe { ffi::PyObject_CheckBuffer(owner.as_ptr()) } == 0 {
        return false;
    }
    // A class's `__buffer__` may be Python code.
    let _region = super::shutdown::Region::enter_or_hang(py);
    PyUntypedBuffer::get(owner.bind(py)).is_ok_and(|b| b.readonly())
}

/// Host memory someone else pinned, from the numba constructor shape
/// ``(context, pointer, size, owner, finalizer)``; managed when a finalizer
/// is given. Read-only when ``owner`` is a read-only object.
fn wrap_pinned(
    context: &Bound<'_, PyAny>,
    pointer: &Bound<'_, PyAny>,
    size: &Bound<'_, PyAny>,
    owner: Option<Py<PyAny>>,
    finalizer: Option<Py<PyAny>>,
    mapped: bool,
) -> PyResult<(HostInner, bool)> {
    let ctx = match context_arg(context)? {
        Some(c) => c,
        None => device_context(None)?,
    };
    let managed = finalizer.is_some();
    let (ptr, bytes) = (pointer_arg(pointer)? as usize, size_arg(size, "size")?);
    let keep = keep_finalizer(pointer.py(), finalizer)?;
    if let Some(within) = owner
        .as_ref()
        .and_then(|o| gpuptr_host(o.bind(pointer.py())))
    {
        // Pinned memory of gpuptr's as owner: a wrap of it goes stale with
        // it, rather than outlive its free over memory reused since, and
        // its exports count on it (with a finalizer too).
        let host = HostMemory::wrap_within(&within, ptr, bytes, mapped, keep)?;
        return Ok((
            HostInner {
                host,
                owned: Owned::new(owner, None),
            },
            managed,
        ));
    }
    let read_only = owner_is_read_only(pointer.py(), owner.as_ref());
    // SAFETY: numba's constructor shape: the caller's memory, pinned by its
    // owner, which `keep` and the Python object hold. The driver is asked
    // that the range is pinned (and mapped) host memory in one allocation.
    let host = unsafe { HostMemory::wrap(&ctx, ptr, bytes, mapped, read_only, keep) }?;
    let owned = Owned::new(owner, None);
    Ok((HostInner { host, owned }, managed))
}

/// The pinned memory of `owner` if it is gpuptr's (see
/// [`HostMemory::is_gpuptrs`]): a `PinnedMemory` or `MappedMemory`, or any
/// pointer over mapped memory (an ``own()`` handle, a view, a wrap).
fn gpuptr_host(owner: &Bound<'_, PyAny>) -> Option<Arc<HostMemory>> {
    let host = if let Ok(p) = owner.cast::<PyPinnedMemory>() {
        p.get().inner.host.clone()
    } else if let Ok(m) = owner.cast::<PyMappedMemory>() {
        m.get().inner.host.clone()
    } else {
        let p = owner.cast::<PyMemoryPointer>().ok()?;
        p.get().view.parent().host()?.clone()
    };
    host.is_gpuptrs().then_some(host)
}

/// The Python objects a host-memory object holds: the object whose memory
/// it is, and (for registered buffers) the buffer export that keeps that
/// memory from moving. Both visible to the garbage collector, and cleared by
/// it only after the memory is released.
#[derive(Default)]
pub(crate) struct Owned(std::sync::Mutex<OwnedPair>);

/// The owner and the buffer export.
type OwnedPair = (Option<Py<PyAny>>, Option<Py<PyAny>>);

impl Owned {
    pub(crate) fn new(owner: Option<Py<PyAny>>, export: Option<Py<PyAny>>) -> Self {
        Owned(std::sync::Mutex::new((owner, export)))
    }

    fn owner(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        let g = crate::sync::lock(&self.0);
        g.0.as_ref().map(|o| o.clone_ref(py))
    }

    fn traverse(&self, visit: &pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        if let Ok(g) = self.0.try_lock() {
            for o in [&g.0, &g.1].into_iter().flatten() {
                visit.call(o)?;
            }
        }
        Ok(())
    }

    /// Let go of the objects (once the memory is released).
    fn release(&self) {
        let taken = std::mem::take(&mut *crate::sync::lock(&self.0));
        drop(taken);
    }

    /// Release `host` (unregister), then let go of the objects. Memory that
    /// cannot be released now (buffer exports alive) keeps them.
    fn clear(&self, host: &HostMemory) {
        if host.free().is_ok() {
            self.release();
        }
    }
}

/// What `PinnedMemory` and `MappedMemory` share: the pinned memory and the
/// Python objects it holds, with what both classes do with them (the host
/// getters, the garbage collector's hooks, the buffer export, the release).
/// Each class holds one and delegates to it.
struct HostInner {
    host: Arc<HostMemory>,
    owned: Owned,
}

impl Drop for HostInner {
    fn drop(&mut self) {
        // Unregister before the buffer export that pins the memory goes.
        let _ = self.host.free();
    }
}

impl HostInner {
    fn host_pointer(&self) -> usize {
        self.host.host_ptr()
    }

    fn owned(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.owned.owner(py)
    }

    fn readonly(&self) -> bool {
        self.host.is_readonly()
    }

    fn traverse(&self, visit: &pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        self.owned.traverse(visit)
    }

    fn clear(&self) {
        self.owned.clear(&self.host);
    }

    /// Release the memory, then `also` (both without the GIL), then let go
    /// of the export that pinned the owner's memory.
    fn free(
        &self,
        py: Python<'_>,
        also: impl FnOnce() -> crate::Result<()> + Send,
    ) -> PyResult<()> {
        py.detach(|| {
            self.host.free()?;
            also()
        })?;
        self.owned.release();
        Ok(())
    }

    /// `__getbuffer__` of `owner`, the object holding this.
    ///
    /// # Safety
    /// As [`export_host`].
    unsafe fn get_buffer(
        &self,
        owner: &Bound<'_, PyAny>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        // SAFETY: CPython's buffer; the export is counted.
        unsafe { export_host(owner, &self.host, view, flags) }
    }

    fn release_buffer(&self) {
        self.host.end_export();
    }
}

/// The methods `PinnedMemory` and `MappedMemory` share, for a class that
/// holds a [`HostInner`] as `inner` and makes itself from one with `init`:
/// numba's constructor shape (memory someone else pinned, `mapped` into the
/// device or not), the host getters, the garbage collector's hooks and the
/// buffer protocol, each delegating to the [`HostInner`]. `handle` is the
/// class's docstring for its ``handle``. A macro because a `#[pymethods]`
/// block belongs to one class (the `multiple-pymethods` feature lets a class
/// have this one beside its own).
macro_rules! host_methods {
    ($class:ident, mapped: $mapped:literal, handle: $handle:tt) => {
        #[pymethods]
        impl $class {
            #[new]
            #[pyo3(signature = (context, pointer, size, owner=None, finalizer=None))]
            fn py_new(
                context: &Bound<'_, PyAny>,
                pointer: &Bound<'_, PyAny>,
                size: &Bound<'_, PyAny>,
                owner: Option<Py<PyAny>>,
                finalizer: Option<Py<PyAny>>,
            ) -> PyResult<PyClassInitializer<Self>> {
                let (inner, managed) =
                    wrap_pinned(context, pointer, size, owner, finalizer, $mapped)?;
                $class::init(inner, managed)
            }

            /// The host address (an int).
            #[getter]
            fn host_pointer(&self) -> usize {
                self.inner.host_pointer()
            }

            #[doc = $handle]
            #[getter]
            fn handle(&self) -> usize {
                self.inner.host_pointer()
            }

            /// The object whose memory this is (registered memory), if any.
            #[getter]
            fn owned(&self, py: Python<'_>) -> Option<Py<PyAny>> {
                self.inner.owned(py)
            }

            /// Whether the bytes are read-only (registered from a read-only object).
            #[getter]
            fn readonly(&self) -> bool {
                self.inner.readonly()
            }

            fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
                self.inner.traverse(&visit)
            }

            fn __clear__(&self) {
                self.inner.clear();
            }

            unsafe fn __getbuffer__(
                slf: Bound<'_, Self>,
                view: *mut ffi::Py_buffer,
                flags: c_int,
            ) -> PyResult<()> {
                // SAFETY: CPython's buffer, for this object.
                unsafe { slf.get().inner.get_buffer(slf.as_any(), view, flags) }
            }

            unsafe fn __releasebuffer__(slf: Bound<'_, Self>, _view: *mut ffi::Py_buffer) {
                slf.get().inner.release_buffer();
            }

            /// numpy reads the bytes through the buffer, and comes here only
            /// if the buffer refused it: freed memory raises
            /// ``InvalidPointerError`` (not a 0-d object array of the pointer).
            #[pyo3(signature = (*_args, **_kwargs))]
            fn __array__(
                &self,
                _args: &Bound<'_, pyo3::types::PyTuple>,
                _kwargs: Option<&Bound<'_, pyo3::types::PyDict>>,
            ) -> PyResult<()> {
                self.inner.host.check_live()?;
                Err(pyo3::exceptions::PyTypeError::new_err(
                    "numpy reads pinned memory through its buffer: numpy.frombuffer(mem, dtype)",
                ))
            }
        }
    };
}

/// Page-locked host memory (numba's ``PinnedMemory``). Its bytes are
/// exported through the buffer protocol. ``PinnedMemory(context, pointer,
/// size, owner=None, finalizer=None)`` wraps memory someone else pinned;
/// with gpuptr's pinned memory as ``owner`` the wrap shares its owner's
/// life: stale once it is freed, and its exports keep the owner's
/// ``free()`` refusing.
#[pyclass(frozen, module = "gpuptr._core", name = "PinnedMemory")]
pub struct PyPinnedMemory {
    inner: HostInner,
    managed: bool,
    context: OnceLock<Py<PyContext>>,
}

impl PyPinnedMemory {
    fn init(inner: HostInner, managed: bool) -> PyResult<PyClassInitializer<Self>> {
        Ok(PyClassInitializer::from(PyPinnedMemory {
            inner,
            managed,
            context: OnceLock::new(),
        }))
    }
}

#[pymethods]
impl PyPinnedMemory {
    /// The host address (an int): CuPy's name for it (``host_pointer``), so
    /// a ``cupy.cuda.PinnedMemoryPointer`` can hold this memory directly.
    #[getter]
    fn ptr(&self) -> usize {
        self.inner.host_pointer()
    }

    /// The context the memory is pinned in.
    #[getter]
    fn context(&self, py: Python<'_>) -> PyResult<Py<PyContext>> {
        lazy_context(&self.context, py, self.inner.host.context())
    }

    /// Size in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.inner.host.size()
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

    /// Release (free or unregister) now; a second call does nothing. While
    /// numpy arrays or memoryviews of it are alive this raises
    /// ``BufferError`` (as ``mmap.close()`` does) and releases nothing.
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        if self.managed {
            self.inner.free(py, || Ok(()))?;
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "<gpuptr.PinnedMemory {:#x} size={}>",
            self.inner.host.host_ptr(),
            self.inner.host.size()
        )
    }
}

host_methods!(
    PyPinnedMemory,
    mapped: false,
    handle: "numba's ``handle``: the host address."
);

/// Host memory mapped into the device (numba's ``MappedMemory``): a
/// MemoryPointer over the device address, whose host bytes are exported
/// through the buffer protocol. Made with gpuptr's pinned memory as
/// ``owner``, it shares that memory's life, as ``PinnedMemory`` does.
#[pyclass(frozen, extends = PyMemoryPointer, module = "gpuptr._core", name = "MappedMemory")]
pub struct PyMappedMemory {
    inner: HostInner,
}

impl PyMappedMemory {
    fn init(inner: HostInner, managed: bool) -> PyResult<PyClassInitializer<Self>> {
        let view = inner.host.device_view()?;
        let base = PyMemoryPointer::over(view, None).with_managed(managed);
        Ok(PyClassInitializer::from(base).add_subclass(PyMappedMemory { inner }))
    }
}

#[pymethods]
impl PyMappedMemory {
    /// numba's ``own()``: mapped memory is its own owner, as pinned memory
    /// is, so a handle keeps it alive and its ``free()`` is this one's.
    fn own(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// Release the host memory now (when this pointer manages it). While
    /// numpy arrays or memoryviews of it are alive this raises
    /// ``BufferError`` and releases nothing.
    pub(crate) fn free(slf: &Bound<'_, Self>) -> PyResult<()> {
        let base = slf.as_super().get();
        if base.is_managed() {
            // The host memory first: it refuses while exports are alive, and
            // a device operation in flight defers its release.
            slf.get()
                .inner
                .free(slf.py(), || base.view.parent().free().map(drop))?;
        }
        Ok(())
    }
}

host_methods!(
    PyMappedMemory,
    mapped: true,
    handle: "numba's ``handle`` for mapped memory: the host address."
);

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
        size: &Bound<'_, PyAny>,
        owner: Option<Py<PyAny>>,
        finalizer: Option<Py<PyAny>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        // The host reads its bytes at the address: it must be managed memory.
        runtime()?.check_managed(pointer_arg(pointer)?, size_arg(size, "size")?)?;
        let base = PyMemoryPointer::py_new(context, pointer, size, owner, finalizer)?;
        Ok(PyManagedMemory::init(base))
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let base = slf.as_super().get();
        let parent = base.view.parent();
        parent.begin_export()?;
        // SAFETY: managed memory of a live allocation, counted as exported
        // until `__releasebuffer__`, so `free()` cannot release it meanwhile.
        let r = unsafe {
            fill_buffer(
                slf.as_any(),
                view,
                base.view.address() as usize,
                base.view.size(),
                false,
                flags,
            )
        };
        if r.is_err() {
            parent.end_export();
        }
        r
    }

    unsafe fn __releasebuffer__(slf: Bound<'_, Self>, _view: *mut ffi::Py_buffer) {
        slf.as_super().get().view.parent().end_export();
    }
}
