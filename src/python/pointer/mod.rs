//! `MemoryPointer`: numba-cuda's MemoryPointer protocol over a core [`View`].

use std::sync::{Arc, OnceLock};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyAny, PyDict, PyTuple};

use super::args::runtime;
use super::args::{pointer_arg, size_arg, stream_arg};
use super::dlpack::{self, ArraySpec, Request};
use super::py_context::{context_arg, lazy_context, PyContext};
use crate::{DevicePointer, DevicePtr, Error, RawStream, View};

mod copy;

/// A stream as the protocols name it: the legacy default stream is 1 (0 is
/// ambiguous in the CUDA Array Interface).
pub(crate) fn legacy_as_one(stream: RawStream) -> RawStream {
    if stream == 0 {
        crate::STREAM_LEGACY
    } else {
        stream
    }
}

/// Calls a Python finalizer once, when the allocation it guards is released.
/// Never raises; skipped while the interpreter shuts down, and in a forked
/// child (the memory it releases is the parent's).
///
/// The callable sits in a small Python object, its guard, whose `__del__`
/// calls it too ([`fire`]): when the garbage collector frees a cycle through
/// the pointer, CPython finalizes the guard before it clears anything in the
/// cycle (PEP 442), so the call comes while the finalizer is whole. Called
/// from the pointer's own `__clear__`, it came after the collector may have
/// cleared the function (no globals), and crashed the interpreter. As under
/// numba, whose finalizers are `weakref.finalize` callbacks, a cycle that
/// another object's `__del__` brings back to life has had its finalizer
/// called.
pub(crate) struct PyFinalizer(Option<Py<PyAny>>);

/// The guard of finalizer `f` (see [`PyFinalizer`]).
fn guard(py: Python<'_>, f: Py<PyAny>) -> PyResult<Py<PyAny>> {
    static GUARD: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let class = GUARD.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        // Defined in a namespace of its own, not a module: nothing in
        // `sys.modules`, no source file named.
        let ns = PyDict::new(py);
        ns.set_item("fire", wrap_pyfunction!(fire, py)?)?;
        ns.set_item("__name__", "gpuptr")?;
        let code = c"class FinalizerGuard:\n    __slots__ = ('f',)\n    def __init__(self, f):\n        self.f = f\n    def __del__(self):\n        fire(self)\n";
        py.run(code, Some(&ns), None)?;
        Ok(ns.as_any().get_item("FinalizerGuard")?.unbind())
    })?;
    Ok(class.bind(py).call1((f,))?.unbind())
}

/// Call the finalizer `guard` holds, once (the guard lets go of it), unless
/// this is a forked child or Python is exiting. An error it raises is
/// printed as unraisable; an exception already set is kept.
#[pyfunction]
fn fire(guard: &Bound<'_, PyAny>) {
    let py = guard.py();
    let Some(_region) = (!crate::fork::forked())
        .then(super::shutdown::Region::enter)
        .flatten()
    else {
        return;
    };
    let pending = PyErr::take(py);
    if let Ok(f) = guard.getattr(intern!(py, "f")) {
        if !f.is_none() && guard.setattr(intern!(py, "f"), py.None()).is_ok() {
            if let Err(e) = f.call0() {
                e.write_unraisable(py, Some(guard));
            }
        }
    }
    if let Some(e) = pending {
        e.restore(py);
    }
}

/// What a constructor's ``finalizer`` argument keeps until release; a
/// non-callable is an `InvalidArgumentError`.
pub(crate) fn keep_finalizer(
    py: Python<'_>,
    finalizer: Option<Py<PyAny>>,
) -> PyResult<Option<crate::KeepAlive>> {
    match finalizer {
        Some(f) if !f.bind(py).is_callable() => {
            Err(Error::InvalidArgument("finalizer must be callable".into()).into())
        }
        Some(f) => Ok(Some(Box::new(PyFinalizer(Some(guard(py, f)?))))),
        None => Ok(None),
    }
}

impl Drop for PyFinalizer {
    fn drop(&mut self) {
        let Some(guard) = self.0.take() else {
            return;
        };
        // The call comes here, at release (whoever else holds the guard:
        // `gc.get_referents` hands it out). Where it must not run, the
        // guard is leaked: letting it go would run its `__del__`.
        let mut guard = Some(guard);
        let region = (!crate::fork::forked())
            .then(super::shutdown::Region::enter)
            .flatten();
        if region.is_some() {
            Python::try_attach(|py| {
                if let Some(g) = guard.take() {
                    fire(g.bind(py));
                }
            });
        }
        std::mem::forget(guard);
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
/// ``finalizer`` is called once when the memory is released. Without a
/// finalizer, an ``owner`` that is a gpuptr pointer holding the range
/// makes this a view of it, stale once ``owner`` is freed (see ``wrap``).
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
    /// Behind a lock so the garbage collector can clear it (`__clear__`).
    owner: std::sync::Mutex<Option<Py<PyAny>>>,
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
            owner: std::sync::Mutex::new(owner),
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

    /// The view a wrap of `[address, address + size)` with `owner` is:
    /// where `owner` is a gpuptr pointer over memory gpuptr allocated (pool
    /// or driver, or pinned host memory it allocated or registered, mapped)
    /// that holds that range, the range of it, in its context,
    /// so that freeing `owner` turns the wrap stale as it does every view,
    /// rather than leave it over memory the pool may hand to someone else;
    /// `InvalidPointer` if `owner` was freed already. `None` for any other
    /// owner (the caller keeps its memory alive, as numba's rule is).
    /// Wraps are excluded: they may carry a finalizer, which the garbage
    /// collector traverses only while its pointer is the sole holder, and
    /// a view would hide it.
    pub(crate) fn owner_view(
        py: Python<'_>,
        owner: Option<&Py<PyAny>>,
        address: DevicePtr,
        size: usize,
    ) -> PyResult<Option<View>> {
        let Some(o) = owner.and_then(|o| o.bind(py).cast::<PyMemoryPointer>().ok()) else {
            return Ok(None);
        };
        let v = &o.get().view;
        // The device side of pinned memory gpuptr allocated or registered
        // is ours too (a wrapped one may hold a finalizer).
        let ours = match v.parent().origin() {
            crate::Origin::Pool(_) | crate::Origin::Driver => true,
            crate::Origin::Foreign => v.parent().host().is_some_and(|h| h.is_gpuptrs()),
            crate::Origin::Ipc => false,
        };
        let start = address
            .checked_sub(v.address())
            .and_then(|s| usize::try_from(s).ok());
        let range = start.and_then(|s| Some((s, s.checked_add(size)?)));
        let Some((start, stop)) = range.filter(|&(_, stop)| ours && stop <= v.size()) else {
            return Ok(None);
        };
        if v.parent().is_freed() {
            let e = format!("the owner of [{address:#x}, +{size}) was freed");
            return Err(Error::InvalidPointer(e).into());
        }
        Ok(Some(v.view(start, Some(stop))?))
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

    fn owner_ref(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        crate::sync::lock(&self.owner)
            .as_ref()
            .map(|o| o.clone_ref(py))
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

    /// Whether this object is the only holder of its allocation.
    fn sole_holder(&self) -> bool {
        Arc::strong_count(self.view.parent()) == 1
    }
}

pub(super) fn contiguous(buf: &PyUntypedBuffer) -> PyResult<()> {
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
        size: &Bound<'_, PyAny>,
        owner: Option<Py<PyAny>>,
        finalizer: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let size = size_arg(size, "size")?;
        let address = pointer_arg(pointer)?;
        let ctx = context_arg(context)?;
        if finalizer.is_none() {
            let py = pointer.py();
            if let Some(view) = Self::owner_view(py, owner.as_ref(), address, size)? {
                return Ok(Self::over(view, owner));
            }
        }
        let managed = finalizer.is_some();
        let keep = keep_finalizer(pointer.py(), finalizer)?;
        let mem = runtime()?.wrap(address, size, ctx, keep)?;
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

    /// Size in bytes (CuPy's and numpy's name; the same as ``size``).
    #[getter]
    fn nbytes(&self) -> usize {
        self.view.size()
    }

    /// ``with gpuptr.alloc(n) as m:``: the memory itself, freed when the
    /// block ends (as ``free()``; a view frees nothing), like cuda.core's
    /// ``Buffer`` and files.
    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// Free the memory (as ``free()``); exceptions from the block pass on.
    /// When the block raised, a free that cannot run now (``BufferError``:
    /// an export of host-reachable memory is alive) is logged, not raised
    /// over the block's exception, and the memory is released with its last
    /// holder.
    #[pyo3(signature = (*exc))]
    fn __exit__(slf: &Bound<'_, Self>, exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        let raised = exc.get_item(0).is_ok_and(|t| !t.is_none());
        match Self::free(slf, None) {
            Err(e) if raised => log::warn!(
                target: "gpuptr",
                "a `with` block that raised could not free its memory ({e}); it is released with its last holder"
            ),
            r => r?,
        }
        Ok(false)
    }

    /// Size in bytes (numba's `device_memory_size` reads this).
    #[getter]
    fn _cuda_memsize_(&self) -> usize {
        self.view.size()
    }

    /// The stream the memory is ordered on (allocated with ``stream=`` and
    /// used on no other): work queued there may still use it. None for
    /// memory any stream may use now. The legacy default stream is 1.
    #[getter]
    fn stream(&self) -> Option<RawStream> {
        self.view.parent().stream().map(legacy_as_one)
    }

    /// The CUDA Array Interface (v3): the memory as a one-dimensional
    /// ``uint8`` array, so numba, CuPy and torch take it without a copy.
    /// ``stream`` is the stream to synchronize with before use (see
    /// ``stream``), or None. Freed or stale memory raises
    /// ``InvalidPointerError``: a consumer is never handed an address that
    /// may be another allocation's by now.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.view.parent().check_live()?;
        let d = PyDict::new(py);
        d.set_item(intern!(py, "version"), 3)?;
        d.set_item(intern!(py, "shape"), (self.view.size(),))?;
        d.set_item(intern!(py, "typestr"), intern!(py, "|u1"))?;
        d.set_item(
            intern!(py, "data"),
            (self.address(), self.view.parent().is_readonly()),
        )?;
        d.set_item(intern!(py, "strides"), py.None())?;
        d.set_item(intern!(py, "stream"), self.stream())?;
        Ok(d)
    }

    /// Export the memory through DLPack as a one-dimensional ``uint8``
    /// tensor (``torch.from_dlpack``, ``cupy.from_dlpack``). ``stream`` is
    /// the consumer's: the memory is made ready on it (None: the legacy
    /// default stream; -1: no synchronization). A ``max_version`` of
    /// (1, 0) or later gets a versioned capsule. The tensor keeps the
    /// memory alive, and a ``free()`` meanwhile waits for the consumer to
    /// let go before the memory is reused.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<&Bound<'py, PyAny>>,
        dl_device: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let me = slf.get();
        let parent = me.view.parent();
        let mut spec = ArraySpec::bytes(me.view.size(), parent.stream());
        spec.readonly = parent.is_readonly();
        let request = Request {
            stream,
            max_version,
            dl_device,
            copy,
        };
        dlpack::export(&me.view, slf.as_any(), spec, request)
    }

    /// ``(2, device_id)``: CUDA memory of the context's device.
    fn __dlpack_device__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        dlpack::device_of(py, &self.view)
    }

    /// numpy cannot read device memory: ``numpy.asarray`` and
    /// ``numpy.array`` raise ``TypeError``, saying how to read it
    /// (``copy_to_host``, or CuPy or torch for an array on the device),
    /// rather than make an object array that holds the pointer. Host memory
    /// (``MappedMemory``, ``ManagedMemory``) is read through its buffer.
    /// Freed or stale memory raises ``InvalidPointerError`` (numpy comes
    /// here once a freed host block's buffer refused it).
    #[pyo3(signature = (*_args, **_kwargs))]
    fn __array__(
        &self,
        _args: &Bound<'_, PyTuple>,
        _kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        self.view.parent().check_live()?;
        if self.view.parent().host().is_some() {
            // A view of mapped host memory: the memory itself exports it.
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "numpy reads mapped memory through the MappedMemory itself \
                 (numpy.frombuffer(mapped, dtype), then slice it), not through a view of it",
            ));
        }
        Err(pyo3::exceptions::PyTypeError::new_err(
            "numpy cannot read device memory: copy it to the host with copy_to_host() \
             (numpy.frombuffer(mem.copy_to_host(), dtype)), or make a device array of it \
             with CuPy (cupy.asarray(mem)) or torch (torch.from_dlpack(mem))",
        ))
    }

    /// The object that owns the memory: the given owner, else this pointer.
    #[getter]
    fn owner(slf: &Bound<'_, Self>) -> Py<PyAny> {
        match slf.get().owner_ref(slf.py()) {
            Some(o) => o,
            None => slf.clone().into_any().unbind(),
        }
    }

    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        // Only references this object holds alone: its owner, and the
        // finalizer its allocation keeps while no other pointer (a view, an
        // `own()` handle) shares the allocation. A reference visited from
        // two objects would make the collector miscount.
        if let Ok(owner) = self.owner.try_lock() {
            if let Some(o) = owner.as_ref() {
                visit.call(o)?;
            }
        }
        if self.sole_holder() {
            let finalizer = self.view.parent().inspect_keepalive(|k| {
                k.downcast_ref::<PyFinalizer>()
                    .and_then(|f| f.0.as_ref())
                    .map(|f| visit.call(f))
            });
            if let Some(Some(r)) = finalizer {
                r?;
            }
        }
        Ok(())
    }

    fn __clear__(&self) {
        let owner = crate::sync::lock(&self.owner).take();
        drop(owner);
        // The collector breaks a cycle through the finalizer: release the
        // memory as its last holder's deallocation would (which calls the
        // finalizer once and lets go of it).
        if self.sole_holder() && self.managed {
            let _ = self.view.parent().free();
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

    /// Whether the memory may be used now: not freed, its context not
    /// reset (and, for mapped memory, its host memory not released).
    #[getter]
    fn live(&self) -> bool {
        self.view.parent().check_live().is_ok()
    }

    /// Another handle on the same memory; the allocation lives while any does.
    fn own(slf: &Bound<'_, Self>) -> Self {
        let me = slf.get();
        let owner = me.owner_ref(slf.py());
        me.sibling(me.view.clone(), me.managed, owner, slf.py())
    }

    /// Release the memory now. A second call, or a call on a view or a
    /// non-owning wrap, does nothing. Views of freed memory raise
    /// `InvalidPointerError` when used.
    ///
    /// With ``stream``, the free is stream-ordered (as ``cudaFreeAsync``):
    /// every use was queued on ``stream`` (or declared with
    /// ``record_stream``), so the block is reused at once on that stream and
    /// by others after a fence. Without it, the block is reused only once all
    /// work queued before now, on every stream, is done. While numpy arrays
    /// or memoryviews of host-reachable memory are alive this raises
    /// ``BufferError``. On mapped memory gpuptr pinned, or another handle of
    /// it (``own()``), its host memory goes too, as ``MappedMemory.free()``.
    #[pyo3(signature = (stream=None))]
    fn free(slf: &Bound<'_, Self>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let py = slf.py();
        let _log = super::logging::Deliver(py);
        let stream = stream_arg(stream)?;
        if let Ok(mapped) = slf.cast::<super::host::PyMappedMemory>() {
            // `with`, or the base class's method called on it: its host
            // memory goes too, as its own ``free()`` lets it go.
            return super::host::PyMappedMemory::free(mapped);
        }
        let me = slf.get();
        if me.managed {
            let parent = me.view.parent();
            let free = || {
                // Another handle of mapped memory it manages (the base
                // class's ``own()``): the host memory first, which refuses
                // while exported, as ``MappedMemory.free()`` does.
                if let Some(h) = parent.host() {
                    h.free()?;
                }
                match stream {
                    Some(s) => parent.free_on(s),
                    None => parent.free(),
                }
            };
            // A pool block goes back to the cache without a driver call:
            // releasing the GIL would cost more than the free.
            if parent.release_may_block() {
                py.detach(free)?;
            } else {
                free()?;
            }
        }
        Ok(())
    }

    /// Declare that the memory is also used on ``stream`` (as torch's
    /// ``record_stream``): its block is then reused only after all work on
    /// every stream queued before its free is done.
    fn record_stream(&self, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        // A use declared after the free is the ordering mistake itself.
        self.view.parent().check_live()?;
        if let Some(s) = stream_arg(Some(stream))? {
            self.view.parent().record_stream(s);
        }
        Ok(())
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

/// numba's `Context.memalloc` lives here, beside the type it returns (the
/// context module does not depend on this one).
#[pymethods]
impl PyContext {
    /// Allocate `size` bytes in this context (numba's `Context.memalloc`).
    fn memalloc(slf: &Bound<'_, Self>, size: &Bound<'_, PyAny>) -> PyResult<PyMemoryPointer> {
        let size = size_arg(size, "size")?;
        let ctx = &slf.get().inner;
        let py = slf.py();
        let mem = ctx.alloc_at(size, None, crate::Client::Direct, || {
            super::track::python_site(py)
        })?;
        Ok(PyMemoryPointer::owning(mem, Some(slf.clone().unbind())))
    }
}
