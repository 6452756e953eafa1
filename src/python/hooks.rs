//! C entry points of the extension module for allocators that load two
//! functions from a shared library: PyTorch's `CUDAPluggableAllocator`
//! (`void* alloc(ssize_t size, int device, cudaStream_t stream)` and
//! `void free(void* ptr, ssize_t size, int device, cudaStream_t stream)`).
//!
//! They call the core alone (no Python, no GIL): PyTorch calls them from any
//! thread. No panic crosses into C: each body runs under `catch_unwind`,
//! and a failure is a null pointer (PyTorch's own contract for a failed
//! allocation) counted in [`failures`].
//!
//! By default a free is ordered on the allocating stream, PyTorch's own
//! allocator's rule: reused at once there. `record_stream` (told through
//! [`_hooks_record_stream`], as `CUDAPluggableAllocator` cannot forward it)
//! and the strict setting (`stream_ordered` false) send the free through
//! the pool's fence instead: reused only after all work queued before the
//! free, on every stream, is done.

use std::ffi::{c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

use crate::{Client, DevicePointer, RawStream, Runtime, Site};

static STREAM_ORDERED: AtomicBool = AtomicBool::new(true);
static FAILURES: AtomicU64 = AtomicU64::new(0);

/// PyTorch's allocation: `size` bytes on `device` for its current stream
/// `stream` (the allocation's order, with `stream_ordered`; during a
/// capture, the graph it belongs to).
fn alloc(client: Client, size: isize, device: c_int, stream: RawStream) -> crate::Result<u64> {
    let (Ok(size), Ok(device)) = (usize::try_from(size), usize::try_from(device)) else {
        return Err(crate::Error::InvalidArgument(format!(
            "size {size} or device {device} out of range"
        )));
    };
    let ordered = STREAM_ORDERED.load(Ordering::Relaxed).then_some(stream);
    // SAFETY: PyTorch passes its current stream of `device`, live while it
    // allocates on it.
    unsafe { Runtime::global()?.alloc_seen_for(client, device, size, ordered, stream, caller_site) }
}

thread_local! {
    /// The message of the failure being thrown: kept here so that no value
    /// with a destructor lives in the frame the exception unwinds through.
    static MESSAGE: std::cell::RefCell<CString> = std::cell::RefCell::new(CString::default());
}

/// A failed PyTorch allocation on `device`: thrown as PyTorch's own
/// exception when its thrower was found (`c10::OutOfMemoryError` for out of
/// memory, where [`super::torch_throw`] found what that takes, counted in
/// PyTorch's `num_ooms`; else `c10::Error`), else a null pointer (counted).
fn fail(e: &crate::Error, device: c_int) -> *mut c_void {
    FAILURES.fetch_add(1, Ordering::Relaxed);
    let oom = e.is_oom();
    if let (true, Ok(d), Some(rt)) = (oom, usize::try_from(device), Runtime::global_if_open()) {
        rt.library_out_of_memory(d, Client::Torch);
    }
    let as_oom = oom && super::torch_throw::oom_available();
    let thrower = super::torch_throw::check_fail();
    if !as_oom && thrower.is_none() {
        return std::ptr::null_mut();
    }
    // No panic may cross into PyTorch's C++ frames: a failure to build the
    // message gives a plain one.
    let text = std::panic::catch_unwind(|| torch_message(e)).unwrap_or_default();
    let text = CString::new(text.replace('\0', " ")).unwrap_or_default();
    let ptr = MESSAGE.try_with(|m| {
        *m.borrow_mut() = text;
        m.borrow().as_ptr()
    });
    let Ok(ptr) = ptr else {
        // This thread's storage is gone (thread exit): a null pointer.
        return std::ptr::null_mut();
    };
    if as_oom {
        // SAFETY: `ptr` is this thread's message, NUL-terminated with no
        // interior NUL (built so above), alive until this thread's next
        // failure. The exception unwinds through this frame and the hook's
        // as below.
        super::torch_throw::throw_oom(unsafe { CStr::from_ptr(ptr) });
    }
    let Some(throw) = thrower else {
        return std::ptr::null_mut();
    };
    // SAFETY: the thrower is PyTorch's `torchCheckFail`, which copies the
    // strings into a `c10::Error` and throws it; they live past the call
    // (static, and this thread's message). The exception unwinds through
    // this frame (which holds nothing to drop) and the hook's (whose
    // `Result` is dropped on the way, as "C-unwind" allows) into PyTorch.
    unsafe { throw(c"gpuptr_torch_alloc".as_ptr(), c"gpuptr".as_ptr(), 0, ptr) }
}

/// The message PyTorch's exception carries for `e`: "CUDA out of memory."
/// starts PyTorch's own, which tools match.
fn torch_message(e: &crate::Error) -> String {
    match e {
        crate::Error::OutOfMemory {
            device,
            requested,
            detail,
        } => format!(
            "CUDA out of memory. Tried to allocate {} ({requested} bytes) on device {device} through gpuptr{detail}",
            crate::error::bytes(*requested)
        ),
        e if e.is_oom() => format!("CUDA out of memory. {e}"),
        e => format!("gpuptr could not allocate for PyTorch: {e}"),
    }
}

/// The live allocation [`gpuptr_torch_alloc`] handed out at `address`.
pub(crate) fn torch_allocation(address: u64) -> Option<Arc<DevicePointer>> {
    Runtime::global_if_open()?.handed_out(address, Some(Client::Torch))
}

/// The Python stack of the thread allocating: if it holds the GIL now, or,
/// while the allocation history records, if it is a thread Python knows
/// that let the GIL go (PyTorch's operators release it around their work):
/// the GIL is taken back for the walk, as PyTorch's own allocator does to
/// give its history Python frames. Otherwise, and once the interpreter
/// exits, the hooks never wait for the GIL.
fn caller_site() -> Site {
    extern "C" {
        // In every CPython 3 (pyo3's abi3 bindings leave it out): whether
        // the calling thread holds the GIL.
        fn PyGILState_Check() -> c_int;
        // Stable ABI: the calling thread's Python thread state, or null for
        // a thread Python has never run on.
        fn PyGILState_GetThisThreadState() -> *mut c_void;
    }
    let outside = || Site::Described("<a PyTorch allocation outside Python>".into());
    // SAFETY: it only reads the calling thread's state, and the extension
    // module is loaded into a CPython, which exports it.
    if unsafe { PyGILState_Check() } == 1 {
        // Not `attach`: once the interpreter is finalized this check says 1
        // on every thread (its key is gone), and attaching then panicked,
        // failing a thread's allocation that had succeeded.
        return Python::try_attach(super::track::python_site).unwrap_or_else(outside);
    }
    let history = Runtime::global_if_open().is_some_and(|rt| rt.recording_history());
    // SAFETY: as above, a read of the calling thread's state.
    if history && !unsafe { PyGILState_GetThisThreadState() }.is_null() {
        // No gpuptr lock is held here (the site is asked for after the
        // allocation), and once the exit hook closed the regions the walk
        // is skipped instead of waiting for a finalizing interpreter.
        if let Some(_region) = super::shutdown::Region::enter() {
            return Python::attach(super::track::python_site);
        }
    }
    outside()
}

fn free(ptr: *mut c_void, stream: RawStream) {
    if ptr.is_null() {
        return;
    }
    let ordered = STREAM_ORDERED.load(Ordering::Relaxed).then_some(stream);
    give_back(ptr as usize as u64, Client::Torch, ordered);
}

/// `client`'s free of `address`, released by the runtime
/// ([`Runtime::free_for`]); one it did not hand to `client` (another
/// library's, or freed twice) is never touched, and counted as a failure.
fn give_back(address: u64, client: Client, stream: Option<RawStream>) {
    if !Runtime::global_if_open().is_some_and(|rt| rt.free_for(address, client, stream)) {
        FAILURES.fetch_add(1, Ordering::Relaxed);
    }
}

/// PyTorch's allocation hook: `size` bytes on `device` for `stream`; null
/// for zero bytes. A failure (out of memory, no driver, a bad device) is
/// thrown as PyTorch's own exception once `_hooks_torch_errors` found
/// its thrower (an out-of-memory one says "CUDA out of memory.", as
/// PyTorch's does), and is a null pointer only before that, or when this
/// thread's storage is gone; each failure is counted.
///
/// # Safety
/// Called by PyTorch with the arguments its pluggable allocator passes; no
/// pointer argument is dereferenced.
#[no_mangle]
pub unsafe extern "C-unwind" fn gpuptr_torch_alloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let r = std::panic::catch_unwind(|| alloc(Client::Torch, size, device, stream as RawStream));
    match r {
        Ok(Ok(address)) => address as usize as *mut c_void,
        Ok(Err(e)) => fail(&e, device),
        Err(_) => fail(&crate::Error::Panic("in gpuptr_torch_alloc".into()), device),
    }
}

/// PyTorch's free hook: release `ptr`, which [`gpuptr_torch_alloc`]
/// returned. An address it did not return is ignored (and counted as a
/// failure), never freed.
///
/// # Safety
/// As [`gpuptr_torch_alloc`]; `ptr` is only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn gpuptr_torch_free(
    ptr: *mut c_void,
    _size: isize,
    _device: c_int,
    stream: *mut c_void,
) {
    let _ = std::panic::catch_unwind(|| free(ptr, stream as RawStream));
}

/// CuPy's allocation hook, for ``cupy.cuda.PythonFunctionAllocator``:
/// ``nbytes`` on ``device`` from the pool, as an address (0 for zero
/// bytes), counted under ``"cupy"``. With ``stream``, allocated and freed on
/// that stream; without, freed through the fence. Errors are gpuptr's typed
/// exceptions (``OutOfMemoryError`` and so on), which CuPy passes on.
#[pyfunction]
#[pyo3(signature = (nbytes, device, stream=None))]
pub(crate) fn _cupy_malloc(
    py: Python<'_>,
    nbytes: &Bound<'_, PyAny>,
    device: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<u64> {
    let size = super::args::size_arg(nbytes, "nbytes")?;
    let device = super::args::device_arg(device)?;
    cupy_alloc(py, device, size, super::args::stream_arg(stream)?)
}

/// `size` bytes on `device` for CuPy, freed on `stream` (none: through
/// the fence).
fn cupy_alloc(
    py: Python<'_>,
    device: usize,
    size: usize,
    stream: Option<RawStream>,
) -> PyResult<u64> {
    let _log = super::logging::Deliver(py);
    Runtime::global()?
        .alloc_for(Client::Cupy, device, size, stream, caller_site)
        .map_err(cupy_error)
}

/// CuPy's allocation hook on its current stream: ``_cupy_malloc`` with the
/// stream the callable set by ``_cupy_set_stream_source`` returns (CuPy's
/// ``get_current_stream_ptr``), called from here: no Python frame of
/// gpuptr's per allocation. Without a source set, no stream (fenced).
#[pyfunction]
pub(crate) fn _cupy_malloc_current(
    py: Python<'_>,
    nbytes: &Bound<'_, PyAny>,
    device: &Bound<'_, PyAny>,
) -> PyResult<u64> {
    let size = super::args::size_arg(nbytes, "nbytes")?;
    let device = super::args::device_arg(device)?;
    cupy_alloc(py, device, size, cupy_stream(py)?)
}

/// CuPy's current stream, from the callable ``_cupy_set_stream_source``
/// set (none set: no stream, so the free goes through the fence).
fn cupy_stream(py: Python<'_>) -> PyResult<Option<RawStream>> {
    let source = crate::sync::lock(&CUPY_STREAM)
        .as_ref()
        .map(|s| s.clone_ref(py));
    let Some(source) = source else {
        return Ok(None);
    };
    let handle = {
        // Python code run from gpuptr's frames: a region, or a daemon
        // thread that took the GIL back there during exit unwound through
        // them (abort).
        let _region = super::shutdown::Region::enter_or_hang(py);
        source.bind(py).call0()?
    };
    super::args::stream_arg(Some(&handle))
}

/// `param` of the C hooks handed to CuPy's `CFunctionAllocator` (which
/// stream rule, or the install-time probe: fails at once, frees nothing),
/// and what the probe raises, for ``gpuptr.cupy`` to recognise.
const CUPY_C_FENCED: usize = 0;
const CUPY_C_ORDERED: usize = 1;
const CUPY_C_PROBE: usize = 2;
const CUPY_C_PROBE_MESSAGE: &str = "gpuptr's probe of CuPy's CFunctionAllocator";

/// CuPy's `CFunctionAllocator` malloc, `void* malloc(void* param, size_t
/// size, int device)`: `_cupy_malloc_current` (or `_cupy_malloc`, by
/// `param`) without a Python call into gpuptr. CuPy calls it holding the
/// GIL, from its memory object's constructor. A failure sets the Python
/// exception and returns `(void*)-1`: CuPy's `_call_malloc` returns an
/// `intptr_t`, so Cython 3 checks for an exception after a -1
/// (`except? -1`, its default). Whether this CuPy was built so is what
/// ``gpuptr.cupy`` probes before it installs these hooks.
extern "C" fn cupy_c_malloc(param: *mut c_void, size: usize, device: c_int) -> *mut c_void {
    let alloc = |py: Python<'_>| -> PyResult<u64> {
        let stream = match param as usize {
            CUPY_C_FENCED => None,
            CUPY_C_ORDERED => cupy_stream(py)?,
            _ => return Err(crate::Error::InvalidArgument(CUPY_C_PROBE_MESSAGE.into()).into()),
        };
        let device = usize::try_from(device)
            .map_err(|_| crate::Error::InvalidArgument(format!("device {device} out of range")))?;
        cupy_alloc(py, device, size, stream)
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Python::attach(|py| {
            let e = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| alloc(py))) {
                Ok(Ok(address)) => return address as usize as *mut c_void,
                Ok(Err(e)) => e,
                Err(_) => crate::Error::Panic("in gpuptr's CuPy allocation hook".into()).into(),
            };
            e.restore(py);
            usize::MAX as *mut c_void
        })
    }));
    // Only if attaching itself failed: a null pointer, with nothing set
    // that could be read as an address.
    r.unwrap_or(std::ptr::null_mut())
}

/// CuPy's `CFunctionAllocator` free, `void free(void* param, void* ptr, int
/// device)`: `_cupy_free`. Never raises (CuPy calls it from a destructor).
extern "C" fn cupy_c_free(param: *mut c_void, ptr: *mut c_void, _device: c_int) {
    if param as usize == CUPY_C_PROBE || ptr.is_null() {
        return;
    }
    let _ = std::panic::catch_unwind(|| give_back(ptr as usize as u64, Client::Cupy, None));
    // What the free logged reaches Python now, as from `_cupy_free`: the
    // GIL is only asked for then (CuPy holds it; at exit it may not be had).
    if crate::log_queue::pending() {
        let _ = std::panic::catch_unwind(|| Python::try_attach(super::logging::flush));
    }
}

/// ``(malloc, free, fenced, ordered, probe, probe message)``: the C hooks
/// for ``cupy.cuda.memory.CFunctionAllocator`` (addresses), the `param`
/// values that pick each stream rule or the probe, and what the probe raises.
#[pyfunction]
pub(crate) fn _cupy_c_hooks() -> (usize, usize, usize, usize, usize, &'static str) {
    (
        cupy_c_malloc as *const () as usize,
        cupy_c_free as *const () as usize,
        CUPY_C_FENCED,
        CUPY_C_ORDERED,
        CUPY_C_PROBE,
        CUPY_C_PROBE_MESSAGE,
    )
}

/// The callable ``_cupy_malloc_current`` asks for CuPy's current stream
/// (its handle, an int).
static CUPY_STREAM: Mutex<Option<Py<PyAny>>> = Mutex::new(None);

/// Set the callable ``_cupy_malloc_current`` asks for CuPy's current
/// stream handle.
#[pyfunction]
pub(crate) fn _cupy_set_stream_source(source: Bound<'_, PyAny>) {
    *crate::sync::lock(&CUPY_STREAM) = Some(source.unbind());
}

/// CuPy's free hook: release what ``_cupy_malloc`` returned at ``address``
/// (``device`` is CuPy's and unused: the address names the allocation).
/// Anything else is ignored (and counted as a failure), never freed; it
/// never raises (CuPy calls it from a destructor).
#[pyfunction]
#[pyo3(signature = (address, device))]
pub(crate) fn _cupy_free(py: Python<'_>, address: &Bound<'_, PyAny>, device: &Bound<'_, PyAny>) {
    let _ = device;
    let _log = super::logging::Deliver(py);
    free_py(address, Client::Cupy, None);
}

/// RMM's allocation callback, for ``rmm.mr.CallbackMemoryResource``
/// (``gpuptr.rmm`` binds ``device`` and ``ordered`` with
/// ``functools.partial``: one resource per device): ``nbytes`` on
/// ``device`` from the pool, as an address (0 for zero bytes, as RMM's own
/// resources), counted under ``"rmm"``. ``stream`` is RMM's stream (its
/// ``Stream``, or anything ``stream`` arguments take): the allocation is
/// made on it and, with ``ordered``, freed on the stream ``_rmm_free`` is
/// given (reused at once there, by others after a fence: RMM's rule);
/// without ``ordered``, every free waits for the fence. Errors are gpuptr's
/// typed exceptions: out of memory is ``OutOfMemoryError``, a
/// ``MemoryError``, which RMM rethrows as its ``rmm::out_of_memory``
/// (``MemoryError`` in Python again, with this message).
#[pyfunction]
#[pyo3(signature = (device, ordered, nbytes, stream=None))]
pub(crate) fn _rmm_alloc(
    py: Python<'_>,
    device: &Bound<'_, PyAny>,
    ordered: bool,
    nbytes: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<u64> {
    let _log = super::logging::Deliver(py);
    let device = super::args::device_arg(device)?;
    let size = super::args::size_arg(nbytes, "nbytes")?;
    let stream = match ordered {
        true => super::args::stream_arg(stream)?,
        false => None,
    };
    Runtime::global()?
        .alloc_for(Client::Rmm, device, size, stream, caller_site)
        .map_err(PyErr::from)
}

/// RMM's deallocation callback: release what ``_rmm_alloc`` returned at
/// ``address``, on ``stream`` where it was allocated stream-ordered (through
/// the fence otherwise, or when the stream cannot be read). ``nbytes`` is
/// RMM's and unused: the address names the allocation. Null is nothing to
/// free, as RMM's own resources; any other address ``_rmm_alloc`` did not
/// hand out (another library's, or one freed already) is ignored and
/// counted as a failure, never freed. It never raises: RMM calls it from
/// C++ destructors, which cannot take an exception.
#[pyfunction]
#[pyo3(signature = (address, nbytes=None, stream=None))]
pub(crate) fn _rmm_free(
    py: Python<'_>,
    address: &Bound<'_, PyAny>,
    nbytes: Option<&Bound<'_, PyAny>>,
    stream: Option<&Bound<'_, PyAny>>,
) {
    let _ = nbytes;
    let _log = super::logging::Deliver(py);
    // No stream, or one that cannot be read: the per-thread default stream
    // orders nothing another thread can rely on, so the fence decides.
    let on = super::args::stream_arg(stream).ok().flatten();
    free_py(
        address,
        Client::Rmm,
        Some(on.unwrap_or(crate::STREAM_PER_THREAD)),
    );
}

/// `client`'s free of `address`, a Python int ([`give_back`]; 0 is
/// nothing, and what is no int is counted as a failure).
fn free_py(address: &Bound<'_, PyAny>, client: Client, stream: Option<RawStream>) {
    match address.extract::<u64>() {
        Ok(0) => {}
        Ok(a) => give_back(a, client, stream),
        Err(_) => {
            FAILURES.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The exception class CuPy's hook raises for out of memory (set by
/// ``gpuptr.cupy``: a subclass of both CuPy's and gpuptr's
/// ``OutOfMemoryError``), called with ``(message, requested bytes)``.
static CUPY_OOM: Mutex<Option<Py<PyAny>>> = Mutex::new(None);

fn cupy_error(e: crate::Error) -> PyErr {
    let cls = match e.is_oom() {
        true => Python::attach(|py| {
            crate::sync::lock(&CUPY_OOM)
                .as_ref()
                .map(|c| c.clone_ref(py))
        }),
        false => None,
    };
    if let Some(cls) = cls {
        let requested = match &e {
            crate::Error::OutOfMemory { requested, .. } => *requested,
            _ => 0,
        };
        let msg = e.to_string();
        return Python::attach(|py| {
            // Python code (the class's `__init__`): a region, as above.
            let _region = super::shutdown::Region::enter_or_hang(py);
            match cls.bind(py).call1((msg, requested)) {
                Ok(err) => PyErr::from_value(err),
                Err(other) => other,
            }
        });
    }
    e.into()
}

/// Set the class ``_cupy_malloc`` raises for out of memory.
#[pyfunction]
pub(crate) fn _cupy_set_oom_error(cls: Bound<'_, PyAny>) {
    *crate::sync::lock(&CUPY_OOM) = Some(cls.unbind());
}

/// Set how the C entry points free memory: ordered on the allocating
/// stream (``True``, PyTorch's own rule), or through the pool's fence
/// (``False``).
#[pyfunction]
pub(crate) fn _hooks_configure(stream_ordered: bool) {
    STREAM_ORDERED.store(stream_ordered, Ordering::Relaxed);
}

/// Note that the allocation the C entry points handed out at ``address``
/// is also used on ``stream`` (``Tensor.record_stream``): its free then
/// waits for the pool's fence. Whether ``address`` is such an allocation.
#[pyfunction]
pub(crate) fn _hooks_record_stream(address: u64, stream: u64) -> bool {
    match Runtime::global_if_open().and_then(|rt| rt.handed_out(address, None)) {
        Some(mem) => {
            mem.record_stream(stream as RawStream);
            true
        }
        None => false,
    }
}

/// ``(live allocations, failures)`` of the C entry points: allocations
/// handed out and not freed, and calls that returned null or freed an
/// address they did not hand out.
#[pyfunction]
pub(crate) fn _hooks_state() -> (usize, u64) {
    let n = Runtime::global_if_open().map_or(0, |rt| rt.handed_out_count());
    (n, FAILURES.load(Ordering::Relaxed))
}
