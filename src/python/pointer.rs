//! `MemoryPointer`: numba-cuda's MemoryPointer protocol over a core [`View`].

use std::sync::{Arc, OnceLock};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyAny, PyBytes};

use super::py_context::{lazy_context, PyContext};
use super::{runtime, size_arg};
use crate::driver::{DevicePtr, RawStream};
use crate::{Context, DevicePointer, Error, View};

/// Calls a Python finalizer once, when the allocation it guards is released.
/// Never raises; skipped while the interpreter shuts down.
pub(crate) struct PyFinalizer(Option<Py<PyAny>>);

/// What a constructor's ``finalizer`` argument keeps until release.
pub(crate) fn keep_finalizer(finalizer: Option<Py<PyAny>>) -> Option<crate::KeepAlive> {
    finalizer.map(|f| Box::new(PyFinalizer(Some(f))) as crate::KeepAlive)
}

impl Drop for PyFinalizer {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            Python::try_attach(|py| {
                if let Err(e) = f.call0(py) {
                    e.write_unraisable(py, None);
                }
            });
        }
    }
}

/// Device memory as numba-cuda's `MemoryPointer` protocol describes it:
/// an address, a size, the context (a real, retained one), an owner, and
/// views that keep their allocation alive.
///
/// ``MemoryPointer(context, pointer, size, owner=None, finalizer=None)``
/// wraps existing memory (numba's and PyArrow's call shape). ``context`` may
/// be a gpuptr or numba context, or None to resolve it from the address;
/// ``pointer`` an int, ``ctypes.c_void_p`` or ``CUdeviceptr``. A
/// ``finalizer`` is called once when the memory is released.
#[pyclass(
    frozen,
    weakref,
    subclass,
    module = "gpuptr._core",
    name = "MemoryPointer"
)]
pub struct PyMemoryPointer {
    pub(crate) view: View,
    managed: bool,
    owner: Option<Py<PyAny>>,
    context: OnceLock<Py<PyContext>>,
    device_pointer: OnceLock<Py<PyAny>>,
}

impl PyMemoryPointer {
    fn new(
        view: View,
        managed: bool,
        owner: Option<Py<PyAny>>,
        context: Option<Py<PyContext>>,
    ) -> Self {
        PyMemoryPointer {
            view,
            managed,
            owner,
            context: context.map(OnceLock::from).unwrap_or_default(),
            device_pointer: OnceLock::new(),
        }
    }

    /// A pointer that owns (and frees) `mem`.
    pub(crate) fn owning(mem: Arc<DevicePointer>, context: Option<Py<PyContext>>) -> Self {
        Self::new(View::from(mem), true, None, context)
    }

    /// A non-owning pointer over `mem` that keeps `owner` alive.
    pub(crate) fn wrapping(
        mem: Arc<DevicePointer>,
        owner: Option<Py<PyAny>>,
        managed: bool,
    ) -> Self {
        Self::new(View::from(mem), managed, owner, None)
    }

    /// A non-owning pointer over an existing view.
    pub(crate) fn over(view: View, owner: Option<Py<PyAny>>) -> Self {
        Self::new(view, false, owner, None)
    }

    /// The same pointer, managing (freeing) its memory or not.
    pub(crate) fn with_managed(mut self, managed: bool) -> Self {
        self.managed = managed;
        self
    }

    /// A pointer over `view` that shares this one's context object.
    fn sibling(&self, view: View, managed: bool, owner: Option<Py<PyAny>>, py: Python<'_>) -> Self {
        let context = self.context.get().map(|c| c.clone_ref(py));
        Self::new(view, managed, owner, context)
    }

    #[inline]
    fn address(&self) -> DevicePtr {
        self.view.address()
    }
}

/// An address from an int, `ctypes.c_void_p`, `CUdeviceptr` or anything
/// with `__int__`.
pub(crate) fn pointer_arg(obj: &Bound<'_, PyAny>) -> PyResult<DevicePtr> {
    if obj.is_none() {
        return Ok(0);
    }
    if let Ok(v) = obj.extract::<u64>() {
        return Ok(v);
    }
    if let Ok(v) = obj.getattr("value") {
        if v.is_none() {
            return Ok(0);
        }
        if let Ok(v) = v.extract::<u64>() {
            return Ok(v);
        }
    }
    if let Ok(v) = obj.call_method0("__int__") {
        if let Ok(v) = v.extract::<u64>() {
            return Ok(v);
        }
    }
    Err(Error::InvalidPointer(format!(
        "{} is not a device address",
        obj.repr().map(|r| r.to_string()).unwrap_or_default()
    ))
    .into())
}

/// A stream from 0/None, an int handle, or an object with `.handle`
/// (numba) or `.ptr` (CuPy).
pub(crate) fn stream_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<RawStream> {
    let Some(obj) = obj else { return Ok(0) };
    if obj.is_none() {
        return Ok(0);
    }
    if let Ok(v) = obj.extract::<usize>() {
        return Ok(v);
    }
    for attr in ["handle", "ptr"] {
        if let Ok(h) = obj.getattr(attr) {
            return Ok(pointer_arg(&h)? as RawStream);
        }
    }
    Err(Error::InvalidArgument("stream must be 0, an int handle, or a stream object".into()).into())
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
    let id: usize = obj
        .getattr("device")
        .and_then(|d| d.getattr("id"))
        .and_then(|i| i.extract())
        .map_err(|_| {
            Error::InvalidArgument(
                "context must be a gpuptr Context, a numba Context or None".into(),
            )
        })?;
    Ok(Some(runtime()?.context(id)?))
}

fn contiguous(buf: &PyUntypedBuffer) -> PyResult<()> {
    if !buf.is_c_contiguous() {
        return Err(Error::InvalidArgument("the host buffer must be C-contiguous".into()).into());
    }
    Ok(())
}

#[pymethods]
impl PyMemoryPointer {
    #[new]
    #[pyo3(signature = (context, pointer, size, owner=None, finalizer=None))]
    pub(crate) fn py_new(
        context: &Bound<'_, PyAny>,
        pointer: &Bound<'_, PyAny>,
        size: isize,
        owner: Option<Py<PyAny>>,
        finalizer: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let size = size_arg(size)?;
        let address = pointer_arg(pointer)?;
        let ctx = context_arg(context)?;
        let managed = finalizer.is_some();
        let mem = runtime()?.wrap(address, size, ctx, keep_finalizer(finalizer))?;
        Ok(PyMemoryPointer::wrapping(mem, owner, managed))
    }

    /// numba's marker for device memory objects.
    #[classattr]
    fn __cuda_memory__() -> bool {
        true
    }

    /// The context the memory lives in: a real, retained gpuptr `Context`.
    #[getter]
    fn context(&self, py: Python<'_>) -> PyResult<Py<PyContext>> {
        lazy_context(&self.context, py, self.view.context())
    }

    /// The address as an int, or None for a null pointer.
    #[getter]
    fn device_pointer_value(&self) -> Option<DevicePtr> {
        match self.address() {
            0 => None,
            a => Some(a),
        }
    }

    /// The address as a `cuda.bindings.driver.CUdeviceptr` (an int when
    /// cuda-bindings is not installed), made on first use.
    #[getter]
    fn device_pointer(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        if let Some(p) = self.device_pointer.get() {
            return Ok(p.clone_ref(py));
        }
        static CUDEVICEPTR: PyOnceLock<Option<Py<PyAny>>> = PyOnceLock::new();
        let cls = CUDEVICEPTR.get_or_init(py, || {
            py.import("cuda.bindings.driver")
                .and_then(|m| m.getattr("CUdeviceptr"))
                .ok()
                .map(Bound::unbind)
        });
        let p = match cls {
            Some(cls) => cls.bind(py).call1((self.address(),))?.unbind(),
            None => self.address().into_pyobject(py)?.into_any().unbind(),
        };
        Ok(self.device_pointer.get_or_init(|| p).clone_ref(py))
    }

    /// numba's `handle`: the same as `device_pointer`.
    #[getter]
    fn handle(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.device_pointer(py)
    }

    /// The address as a `ctypes.c_size_t`.
    #[getter]
    fn device_ctypes_pointer<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        static C_SIZE_T: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        C_SIZE_T
            .import(py, "ctypes", "c_size_t")?
            .call1((self.address(),))
    }

    /// Size in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.view.size()
    }

    /// Size in bytes (numba's `device_memory_size` reads this).
    #[getter]
    fn _cuda_memsize_(&self) -> usize {
        self.view.size()
    }

    /// The object that owns the memory: the given owner, else this pointer.
    #[getter]
    fn owner(slf: &Bound<'_, Self>) -> Py<PyAny> {
        match &slf.get().owner {
            Some(o) => o.clone_ref(slf.py()),
            None => slf.clone().into_any().unbind(),
        }
    }

    /// How many pointer objects (this one, its views, `own()` handles) share
    /// the allocation.
    #[getter]
    fn refct(&self) -> usize {
        Arc::strong_count(self.view.parent())
    }

    /// Whether `free()` releases the memory (gpuptr allocations, and wraps
    /// made with a finalizer).
    #[getter]
    pub(crate) fn is_managed(&self) -> bool {
        self.managed
    }

    /// Offset of this pointer from the start of its allocation.
    #[getter]
    fn offset(&self) -> usize {
        self.view.offset()
    }

    /// Whether the memory was freed.
    #[getter]
    fn freed(&self) -> bool {
        self.view.parent().is_freed()
    }

    /// Another handle on the same memory; the allocation lives while any does.
    fn own(slf: &Bound<'_, Self>) -> Self {
        let me = slf.get();
        let owner = me.owner.as_ref().map(|o| o.clone_ref(slf.py()));
        me.sibling(me.view.clone(), me.managed, owner, slf.py())
    }

    /// Release the memory now. A second call, or a call on a view or a
    /// non-owning wrap, does nothing. Views of freed memory raise
    /// `InvalidPointerError` when used.
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        if self.managed {
            py.detach(|| self.view.parent().free())?;
        }
        Ok(())
    }

    /// Set ``count`` bytes (default: all) to ``byte``, on ``stream``
    /// (0: synchronously).
    #[pyo3(signature = (byte, count=None, stream=None))]
    fn memset(
        &self,
        py: Python<'_>,
        byte: u8,
        count: Option<isize>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let count = count.map(size_arg).transpose()?;
        let stream = stream_arg(stream)?;
        Ok(py.detach(|| self.view.memset(byte, count, stream))?)
    }

    /// A pointer to bytes ``[start, stop)`` of this one (``stop`` defaults to
    /// the end). It keeps the allocation alive. Out-of-range, reversed or
    /// negative bounds raise `InvalidPointerError`.
    #[pyo3(signature = (start, stop=None))]
    fn view(slf: &Bound<'_, Self>, start: isize, stop: Option<isize>) -> PyResult<Self> {
        let me = slf.get();
        me.view.parent().check_live()?;
        let bad = |v: isize| Error::InvalidPointer(format!("view bound {v} is negative"));
        let start = usize::try_from(start).map_err(|_| bad(start))?;
        let stop = stop
            .map(|s| usize::try_from(s).map_err(|_| bad(s)))
            .transpose()?;
        let view = me.view.view(start, stop)?;
        let owner = Self::owner(slf);
        Ok(me.sibling(view, false, Some(owner), slf.py()))
    }

    /// Copy a C-contiguous host buffer (bytes, numpy array, ...) to the
    /// start of this memory. Other Python threads run during the copy, as
    /// they do during numba's.
    fn copy_from_host(&self, py: Python<'_>, src: &Bound<'_, PyAny>) -> PyResult<()> {
        let buf = PyUntypedBuffer::get(src)?;
        contiguous(&buf)?;
        // SAFETY: the buffer is held (and so valid, and not resized) until
        // `buf` drops, after the copy.
        let bytes =
            unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) };
        Ok(py.detach(|| self.view.copy_from_host(bytes))?)
    }

    /// Copy this memory to the host: into the writable buffer ``dst`` if
    /// given (its length bytes), else into new ``bytes`` of ``size``. Other
    /// Python threads run during the copy.
    #[pyo3(signature = (dst=None))]
    fn copy_to_host<'py>(
        &self,
        py: Python<'py>,
        dst: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        match dst {
            None => {
                let v = py.detach(|| self.view.to_vec())?;
                Ok(PyBytes::new(py, &v).into_any())
            }
            Some(dst) => {
                let buf = PyUntypedBuffer::get(dst)?;
                contiguous(&buf)?;
                if buf.readonly() {
                    return Err(
                        Error::InvalidArgument("the host buffer is read-only".into()).into(),
                    );
                }
                // SAFETY: writable, contiguous, held until `buf` drops.
                let bytes = unsafe {
                    std::slice::from_raw_parts_mut(buf.buf_ptr() as *mut u8, buf.len_bytes())
                };
                py.detach(|| self.view.copy_to_host(bytes))?;
                Ok(dst.clone())
            }
        }
    }

    /// Copy ``count`` bytes (default: all of ``src``) from device memory
    /// ``src`` to the start of this memory.
    #[pyo3(signature = (src, count=None))]
    fn copy_from_device(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyMemoryPointer>,
        count: Option<isize>,
    ) -> PyResult<()> {
        let count = count.map(size_arg).transpose()?;
        let src = &src.get().view;
        Ok(py.detach(|| self.view.copy_from_device(src, count))?)
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        // The class's own name: MappedMemory and ManagedMemory share this.
        let name = slf.get_type().name()?;
        let me = slf.get();
        Ok(format!(
            "<gpuptr.{name} {:#x} size={} device={}{}>",
            me.address(),
            me.view.size(),
            me.view.context().device(),
            if me.view.parent().is_freed() {
                " freed"
            } else {
                ""
            }
        ))
    }
}
