//! The binding room: `gpuptr._core`. Thin wrappers over the core; every
//! error goes through one `From<Error> for PyErr`. `mod _core`, at the end,
//! lists what Python sees.

mod args;
mod dlpack;
mod errors;
mod history;
mod hooks;
mod host;
mod interop;
mod ipc;
mod logging;
mod pointer;
mod py_context;
mod shutdown;
mod sizes;
mod testing;
mod torch_pools;
mod torch_share;
mod torch_stats;
mod torch_throw;
mod track;

use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict, PyList};

use crate::{Error, Runtime};
use args::{device_arg, device_context, optional_device, pointer_arg, runtime, size_arg};
use pointer::PyMemoryPointer;
use py_context::{py_context, PyContext, PyDevice};

/// The context of `device` (default, or None: 0): one object per device.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn context(py: Python<'_>, device: Option<&Bound<'_, PyAny>>) -> PyResult<Py<PyContext>> {
    let _log = logging::Deliver(py);
    let device = optional_device(device)?.unwrap_or(0);
    py_context(py, &runtime()?.context(device)?)
}

/// Allocate ``nbytes`` of device memory on ``device`` (default: the current
/// context's device, else 0), from the device's pool.
///
/// Without ``stream`` the memory may be used on any stream: when it is
/// freed, its block is reused only after all work queued before the free,
/// on every stream, is done. With ``stream`` (an int handle, or a numba,
/// CuPy or torch stream) the allocation is stream-ordered, as
/// ``cudaMallocAsync``: a block freed on that stream is reused at once, and
/// the memory is freed on it when dropped (``record_stream`` declares other
/// streams it is used on).
#[pyfunction]
#[pyo3(signature = (nbytes, device=None, stream=None))]
fn alloc(
    py: Python<'_>,
    nbytes: &Bound<'_, PyAny>,
    device: Option<&Bound<'_, PyAny>>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyMemoryPointer> {
    alloc_as(
        py,
        crate::Client::Direct,
        size_arg(nbytes, "nbytes")?,
        device,
        stream,
    )
}

/// ``alloc`` of `size` bytes (already parsed) counted under `client`.
fn alloc_as(
    py: Python<'_>,
    client: crate::Client,
    size: usize,
    device: Option<&Bound<'_, PyAny>>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyMemoryPointer> {
    let _log = logging::Deliver(py);
    let device = args::device_ordinal(device)?;
    let stream = args::stream_arg(stream)?;
    let (ctx, pyctx) = py_context::device_py_context(py, device)?;
    let mem = ctx.alloc_at(size, stream, client, || track::python_site(py))?;
    Ok(PyMemoryPointer::owning(mem, Some(pyctx)))
}

/// ``alloc`` on behalf of ``client`` (``"numba"``, ``"cupy"``, ``"torch"``, ``"cuda_core"``,
/// ``"rmm"`` or ``"direct"``), counted under that client in ``stats()``. The hook
/// for gpuptr's own allocator plugins.
#[pyfunction]
#[pyo3(signature = (client, nbytes, device=None, stream=None))]
fn _alloc_for(
    py: Python<'_>,
    client: &str,
    nbytes: &Bound<'_, PyAny>,
    device: Option<&Bound<'_, PyAny>>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyMemoryPointer> {
    let client = crate::Client::from_name(client)
        .ok_or_else(|| Error::InvalidArgument(format!("unknown client {client:?}")))?;
    alloc_as(py, client, size_arg(nbytes, "nbytes")?, device, stream)
}

/// gpuptr.cuda_core's allocation: ``nbytes`` from ``device``'s pool under
/// the ``"cuda_core"`` client, handed to ``make(address, nbytes, None, None,
/// owner)`` (the shape of cuda.core's ``Buffer._init``: no memory resource,
/// an owner), whose result is returned. ``owner`` is the MemoryPointer that
/// owns the block: the Buffer frees it into the pool (through the fence)
/// when cuda.core drops the owner, with no Python call. Zero bytes give
/// ``make(0, 0, None, None, None)``. If ``make`` raises, the block is freed.
#[pyfunction]
fn _cuda_core_buffer<'py>(
    py: Python<'py>,
    make: &Bound<'py, PyAny>,
    nbytes: &Bound<'py, PyAny>,
    device: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let size = size_arg(nbytes, "nbytes")?;
    let none = py.None();
    if size == 0 {
        return make.call1((0u64, 0usize, &none, &none, &none));
    }
    let mem = alloc_as(py, crate::Client::CudaCore, size, Some(device), None)?;
    let address = mem.view.address();
    let owner = Bound::new(py, mem)?;
    make.call1((address, size, &none, &none, owner))
}

/// Wrap ``nbytes`` at ``address`` as a MemoryPointer that keeps ``owner``
/// alive. Without ``context``, the context is resolved from the address
/// itself, never from the current one. Where ``owner`` is a gpuptr pointer
/// over memory gpuptr allocated that holds the range, the wrap is a view
/// of it, in its context: freeing ``owner`` turns the wrap stale
/// (``InvalidPointerError``), as it does every view. Any other wrap is
/// numba's non-owning MemoryPointer: its memory is the caller's to keep
/// alive.
#[pyfunction]
#[pyo3(signature = (address, nbytes, owner=None, context=None))]
fn wrap(
    address: &Bound<'_, PyAny>,
    nbytes: &Bound<'_, PyAny>,
    owner: Option<Py<PyAny>>,
    context: Option<&Bound<'_, PyContext>>,
) -> PyResult<PyMemoryPointer> {
    let size = size_arg(nbytes, "nbytes")?;
    let address = pointer_arg(address)?;
    let ctx = context.map(|c| c.get().inner.clone());
    let py = nbytes.py();
    if let Some(view) = PyMemoryPointer::owner_view(py, owner.as_ref(), address, size)? {
        return Ok(PyMemoryPointer::over(view, owner));
    }
    let mem = runtime()?.wrap(address, size, ctx, None)?;
    Ok(PyMemoryPointer::wrapping(mem, owner, false))
}

/// The context of the memory at ``address``: a registry lookup for memory
/// gpuptr knows, one driver query otherwise.
#[pyfunction]
fn context_of(py: Python<'_>, address: &Bound<'_, PyAny>) -> PyResult<Py<PyContext>> {
    let address = pointer_arg(address)?;
    py_context(py, &runtime()?.context_of(address)?)
}

/// Which driver is in use, its version and the device count.
#[pyfunction]
fn driver_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let rt = runtime()?;
    let d = PyDict::new(py);
    let version = rt.driver_version()?;
    d.set_item("driver", rt.driver_kind().as_str())?;
    d.set_item("version", version)?;
    d.set_item(
        "version_string",
        format!("{}.{}", version / 1000, (version % 1000) / 10),
    )?;
    d.set_item("device_count", rt.device_count())?;
    Ok(d)
}

/// The devices, as `Device` objects.
#[pyfunction]
fn devices(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let n = runtime()?.device_count();
    let list = PyList::empty(py);
    for id in 0..n {
        list.append(Py::new(py, PyDevice::from_id(id))?)?;
    }
    Ok(list)
}

/// Whether the CUDA driver can be used here, without opening it for use:
/// ``(True, version)`` or ``(False, reason)``.
#[pyfunction]
fn probe_cuda(py: Python<'_>) -> PyResult<(bool, Py<PyAny>)> {
    Ok(match Runtime::probe_cuda() {
        Ok(v) => (true, v.into_pyobject(py)?.into_any().unbind()),
        Err(e) => (false, e.to_string().into_pyobject(py)?.into_any().unbind()),
    })
}

/// Allocation statistics per device: live bytes and count, peak, the number
/// of allocations made, the pool's cached bytes, hits, misses and fences,
/// ``clients``: live bytes and count, and allocations made, per client
/// (``"direct"``, ``"numba"``, ``"cupy"``, ``"torch"``, ``"cuda_core"``,
/// ``"rmm"``), and
/// ``host``: the cache of pinned host memory (held, live, cached and pending
/// bytes, hits, misses, and its limit), and ``segments``: the pool's driver
/// allocations as PyTorch counts segments (``count`` and ``bytes``, each
/// ``all``/``small_pool``/``large_pool`` of
/// ``current``/``peak``/``allocated``/``freed``; small: blocks of at most
/// 1 MiB).
#[pyfunction]
fn stats(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let _log = logging::Deliver(py);
    let list = PyList::empty(py);
    for s in runtime()?.stats() {
        let d = PyDict::new(py);
        d.set_item("device", s.device)?;
        d.set_item("live_bytes", s.live_bytes)?;
        d.set_item("live_count", s.live_count)?;
        d.set_item("peak_bytes", s.peak_bytes)?;
        d.set_item("alloc_count", s.alloc_count)?;
        d.set_item("cached_bytes", s.cached_bytes)?;
        d.set_item("pending_bytes", s.pending_bytes)?;
        d.set_item("pool_hits", s.pool_hits)?;
        d.set_item("pool_misses", s.pool_misses)?;
        d.set_item("fences", s.fences)?;
        let clients = PyDict::new(py);
        for (k, c) in crate::Client::ALL.iter().zip(&s.clients) {
            let e = PyDict::new(py);
            e.set_item("live_bytes", c.live_bytes)?;
            e.set_item("live_count", c.live_count)?;
            e.set_item("alloc_count", c.alloc_count)?;
            clients.set_item(k.name(), e)?;
        }
        d.set_item("clients", clients)?;
        d.set_item("pool_bytes", s.pool_bytes)?;
        d.set_item("pool_limit", s.pool_limit)?;
        d.set_item("peak_pool_bytes", s.peak_pool_bytes)?;
        d.set_item("reserved_bytes", s.reserved_bytes)?;
        d.set_item("num_ooms", s.num_ooms)?;
        d.set_item("num_alloc_retries", s.num_alloc_retries)?;
        let h = &s.host;
        let host = PyDict::new(py);
        host.set_item("held_bytes", h.held_bytes)?;
        host.set_item("live_bytes", h.live_bytes)?;
        host.set_item("live_count", h.live_count)?;
        host.set_item("cached_bytes", h.cached_bytes)?;
        host.set_item("pending_bytes", h.pending_bytes)?;
        host.set_item("hits", h.hits)?;
        host.set_item("misses", h.misses)?;
        host.set_item("cache_limit", h.cache_limit)?;
        d.set_item("host", host)?;
        d.set_item("segments", torch_stats::segments_dict(py, &s.segments)?)?;
        list.append(d)?;
    }
    Ok(list)
}

/// Wait until every block freed so far on ``device`` (default: all devices
/// with a context) has passed its fence and is ready for reuse; the
/// allocator itself never waits. ``False`` if a fence failed.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn flush_pool(py: Python<'_>, device: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
    let _log = logging::Deliver(py);
    let rt = runtime()?;
    let devices: Vec<usize> = match optional_device(device)? {
        Some(d) => vec![d],
        None => (0..rt.device_count()).collect(),
    };
    py.detach(|| {
        devices
            .into_iter()
            .try_fold(true, |ok, d| Ok(rt.flush_pool(d)? && ok))
    })
    .map_err(|e: Error| e.into())
}

/// The device a capture call names: ``device``, else the current one.
fn capture_device(device: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    match optional_device(device)? {
        Some(d) => Ok(d),
        None => Ok(runtime()?.current_device()?),
    }
}

/// Tell gpuptr that a stream capture (a CUDA graph) begins on ``device``
/// (default: the current device). Until the matching ``end_capture``, the
/// pool runs no fence: CUDA refuses ``cuCtxSynchronize`` of a context while
/// any stream of it captures, in every capture mode, and that invalidates
/// the capture. A
/// fence already running is waited for first. Blocks freed meanwhile wait
/// for the fence after the capture; an allocation that runs out of memory
/// meanwhile raises ``OutOfMemoryError`` without waiting for a fence. Calls
/// nest. ``gpuptr.install()`` makes these calls around CuPy's and PyTorch's
/// own captures; gpuptr's allocations and frees need none (they run in
/// relaxed capture mode).
/// A thread that ends with captures it began still under way ends them, with
/// a warning, before ``Thread.join()`` returns.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn begin_capture(py: Python<'_>, device: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
    let d = capture_device(device)?;
    let rt = runtime()?;
    ThreadCaptures::watch_this_thread(py)?;
    py.detach(|| rt.begin_capture(d)).map_err(Into::into)
}

/// End a capture begun with ``begin_capture`` on ``device`` (default: the
/// current device) by the calling thread. ``InvalidArgumentError`` (and
/// nothing ends) when this thread has no such capture under way there.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn end_capture(device: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
    let d = capture_device(device)?;
    Ok(runtime()?.end_capture(d)?)
}

/// Kept in a ``threading.local`` by a thread that began a capture: Python
/// clears a thread's locals as the thread ends, before ``Thread.join()``
/// returns, and its drop then ends the thread's open captures
/// ([`crate::Runtime::end_thread_captures`]); the core's record would end
/// them only at the OS thread's exit, later (a join could return with the
/// capture still holding every fence back).
#[pyclass(frozen, module = "gpuptr._core")]
struct ThreadCaptures;

impl ThreadCaptures {
    fn watch_this_thread(py: Python<'_>) -> PyResult<()> {
        static LOCAL: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
        let local = LOCAL
            .get_or_try_init(py, || {
                py.import("threading")?
                    .call_method0("local")
                    .map(Bound::unbind)
            })?
            .bind(py);
        if !local.hasattr("gpuptr_captures")? {
            local.setattr("gpuptr_captures", Bound::new(py, ThreadCaptures)?)?;
        }
        Ok(())
    }
}

impl Drop for ThreadCaptures {
    fn drop(&mut self) {
        crate::Runtime::end_thread_captures();
    }
}

/// Tell gpuptr that the capture ``stream`` takes part in has begun (call
/// it after ``begin_capture`` and the library's own begin): its memory is
/// then kept for its graph. Pool blocks allocated during the capture (on a
/// stream that takes part in it, or by this thread), and blocks this thread
/// frees during it, are reused only after the graph, and every executable
/// graph made from it, is destroyed. ``gpuptr.install()`` calls it for
/// CuPy's and PyTorch's captures. ``stream`` is a live stream handle (an
/// int or a stream object) of ``device``; ``InvalidArgumentError`` if it is
/// not capturing.
#[pyfunction]
#[pyo3(signature = (stream, device=None))]
fn capture_started(
    py: Python<'_>,
    stream: &Bound<'_, PyAny>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let d = capture_device(device)?;
    let Some(s) = args::stream_arg(Some(stream))? else {
        return Err(crate::Error::InvalidArgument(
            "capture_started needs a stream, not None".into(),
        )
        .into());
    };
    let rt = runtime()?;
    // SAFETY: the caller passes a live stream of `d` (documented above), as
    // every CUDA library's stream arguments require.
    py.detach(|| unsafe { rt.capture_started(d, s) })
        .map_err(Into::into)
}

/// The current device (``device=None`` in the functions that take one).
#[pyfunction]
fn _current_device() -> PyResult<usize> {
    capture_device(None)
}

/// Bytes of ``device``'s pool (default: the current device) that CUDA
/// graphs keep: freed, and reused once their graph is destroyed.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn graph_kept_bytes(device: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    let d = capture_device(device)?;
    Ok(runtime()?.graph_kept_bytes(d)?)
}

/// Whether a capture begun with ``begin_capture`` is under way on
/// ``device`` (default: the current device).
#[pyfunction]
#[pyo3(signature = (device=None))]
fn is_capturing(device: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
    let d = capture_device(device)?;
    Ok(runtime()?.capturing(d)?)
}

/// Cap the bytes the pool of ``device`` (default: every device) holds from
/// the driver at ``nbytes`` (None: no cap, the default), as RMM's maximum
/// pool size. ``nbytes`` is an int of bytes, a size (``"40GB"``,
/// ``"40GiB"``, ``"512M"``), or a share of each device's memory (``0.8``,
/// ``"80%"``). Past it an allocation reuses and returns the cache first,
/// then raises ``OutOfMemoryError``, whose message names the limit.
/// ``stats()`` shows ``pool_bytes`` and ``pool_limit``. Without a pool
/// (``GPUPTR_POOL=0``) a limit raises ``InvalidArgumentError``.
#[pyfunction]
#[pyo3(signature = (nbytes, device=None))]
fn set_pool_limit(
    nbytes: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let limit = match nbytes.filter(|n| !n.is_none()) {
        Some(n) => Some(sizes::size_of(n, "nbytes")?),
        None => None,
    };
    let rt = runtime()?;
    let devices = match optional_device(device)? {
        Some(d) => d..d + 1,
        None => 0..rt.device_count(),
    };
    for d in devices {
        // A share is of each device's own memory.
        let bytes = match limit {
            Some(l) => Some(l.bytes_on(rt.device_total_memory(d)?, "nbytes")?),
            None => None,
        };
        rt.set_pool_limit(d, bytes)?;
    }
    Ok(())
}

/// Fill the pool ahead of demand with about ``nbytes`` of ready blocks of
/// ``block_size`` bytes (default 1 MiB; as RMM's initial pool size), on ``device`` (default:
/// the current one). Allocations of that size then make no driver call
/// until the blocks are used, also while a busy GPU holds freed blocks back.
/// ``nbytes`` is an int, a size (``"2GiB"``) or a share of what the device
/// has free (``0.5``, ``"50%"``). More than the device has free raises
/// ``OutOfMemoryError`` and reserves nothing. Returns the bytes reserved
/// (fewer if the pool limit stops it part way; none at all raises
/// ``OutOfMemoryError``, naming the limit); ``trim()`` gives them back.
#[pyfunction]
#[pyo3(signature = (nbytes, block_size=None, device=None))]
fn reserve(
    py: Python<'_>,
    nbytes: &Bound<'_, PyAny>,
    block_size: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<usize> {
    let _log = logging::Deliver(py);
    let wanted = sizes::size_of(nbytes, "nbytes")?;
    let size = match block_size.filter(|b| !b.is_none()) {
        Some(b) => sizes::bytes_of(b, "block_size")?,
        None => 1 << 20,
    };
    if size == 0 {
        return Err(Error::InvalidArgument("block_size must be positive".into()).into());
    }
    // Held by the runtime: the reservation lives with the context, which
    // would otherwise end with this call and give the blocks back.
    let ctx = runtime()?.held_context(device_context(device)?.device())?;
    // A share of a reservation is of what the device has free now: of
    // nothing free, nothing (not an error about a share under one byte).
    let bytes = match wanted {
        crate::sizes::Size::Bytes(n) => n,
        share => match ctx.memory_info()?.0 {
            0 => 0,
            free => share.bytes_on(free, "nbytes")?,
        },
    };
    Ok(py.detach(|| ctx.reserve(size, bytes))?)
}

/// The pool of ``device`` by size class: a list of dicts with ``class``
/// (the block size), ``live_blocks``, ``peak_blocks`` and ``cached_blocks``,
/// smallest class first.
#[pyfunction]
fn pool_classes<'py>(py: Python<'py>, device: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
    let _log = logging::Deliver(py);
    let device = device_arg(device)?;
    let list = PyList::empty(py);
    for c in runtime()?.class_stats(device)? {
        let d = PyDict::new(py);
        d.set_item("class", c.class)?;
        d.set_item("live_blocks", c.live_blocks)?;
        d.set_item("peak_blocks", c.peak_blocks)?;
        d.set_item("cached_blocks", c.cached_blocks)?;
        list.append(d)?;
    }
    Ok(list)
}

/// Make every device's peak bytes equal to its live bytes now.
#[pyfunction]
fn reset_peak_stats() -> PyResult<()> {
    runtime()?.reset_peak_stats();
    Ok(())
}

/// Return every block the pool caches to the driver; the bytes freed
/// (CuPy's ``free_all_blocks``). With ``host=False`` the cache of pinned
/// host memory stays (PyTorch's ``empty_cache()`` leaves pinned memory
/// alone).
#[pyfunction]
#[pyo3(signature = (*, host=true))]
fn trim(py: Python<'_>, host: bool) -> PyResult<usize> {
    let _log = logging::Deliver(py);
    let rt = runtime()?;
    Ok(py.detach(|| match host {
        true => rt.trim(),
        false => rt.trim_device_memory(),
    })?)
}

/// gpuptr's side of a reset of ``device``'s context (numba's
/// ``cuda.close()``, before numba resets it): cached blocks go back to the
/// driver, and every live pointer turns stale (using it raises
/// `InvalidPointerError`; freeing it does nothing). Call it only when the
/// context is reset next (``cuDevicePrimaryCtxReset``): the memory of live
/// pointers and pinned registrations is left to that reset, which frees it
/// (gpuptr must not free it, as it may already be another owner's after a
/// reset). Without a reset it stays allocated until the context is reset or
/// released by every holder, or the process ends.
#[pyfunction]
fn reset_context(py: Python<'_>, device: &Bound<'_, PyAny>) -> PyResult<()> {
    let _log = logging::Deliver(py);
    let device = device_arg(device)?;
    let rt = runtime()?;
    Ok(py.detach(|| rt.reset(device))?)
}

/// Drop gpuptr's own hold on contexts; each is released once no pointer
/// holds it.
#[pyfunction]
fn release_contexts() {
    py_context::release_contexts();
}

/// Run `f`, a wait of the core's ([`crate::sync::blocking`]), with the GIL
/// let go if the calling thread holds it: a Python thread whose work ends
/// the wait (a stream callback, a thread that feeds the GPU) runs
/// meanwhile. The core's waits touch no Python object.
fn without_the_gil(f: &mut dyn FnMut()) {
    extern "C" {
        // In every CPython 3 (pyo3's abi3 bindings leave it out).
        fn PyGILState_Check() -> std::ffi::c_int;
    }
    // SAFETY: it only reads the calling thread's state; the extension is
    // loaded into a CPython, which exports it.
    if unsafe { PyGILState_Check() } != 1 {
        return f();
    }
    // SAFETY: this thread holds the GIL (checked above); it is let go for
    // `f`, which touches no Python object, and taken back with the same
    // thread state before anything Python runs here again. A panic in `f`
    // is caught so that the GIL is always taken back.
    let state = unsafe { pyo3::ffi::PyEval_SaveThread() };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    // SAFETY: `state` is this thread's, saved just above.
    unsafe { pyo3::ffi::PyEval_RestoreThread(state) };
    if let Err(p) = r {
        std::panic::resume_unwind(p);
    }
}

/// The native core of gpuptr. Use the `gpuptr` package, which re-exports it.
#[pymodule(gil_used = false)]
mod _core {
    use pyo3::prelude::*;

    // The classes.
    #[pymodule_export]
    use super::{
        dlpack::DLPackOwner,
        host::{PyManagedMemory, PyMappedMemory, PyPinnedMemory},
        interop::ImportedArray,
        ipc::PyIpcHandle,
        pointer::PyMemoryPointer,
        py_context::{PyContext, PyContextHandle, PyDevice},
    };

    // Contexts, allocation and the pool.
    #[pymodule_export]
    use super::{
        _current_device, alloc, begin_capture, capture_started, context, context_of, devices,
        driver_info, end_capture, flush_pool, graph_kept_bytes, is_capturing, pool_classes,
        probe_cuda, release_contexts, reserve, reset_context, reset_peak_stats, set_pool_limit,
        stats, trim, wrap,
    };

    // Host and managed memory, IPC.
    #[pymodule_export]
    use super::{
        host::{alloc_host, alloc_managed, register_host, register_host_ptr},
        ipc::open_ipc,
    };

    // Tracking, the allocation history and logging.
    #[pymodule_export]
    use super::{
        history::{dump_snapshot, record_history, recording_history, snapshot},
        logging::{_flush_log, _set_log_level},
        track::{outstanding, track, tracking},
    };

    // The hooks of gpuptr's own Python modules: allocator plugins, interop.
    #[pymodule_export]
    use super::{
        _alloc_for, _cuda_core_buffer,
        dlpack::{_dlpack_consume, _dtype_info},
        hooks::{
            _cupy_c_hooks, _cupy_free, _cupy_malloc, _cupy_malloc_current, _cupy_set_oom_error,
            _cupy_set_stream_source, _hooks_configure, _hooks_record_stream, _hooks_state,
            _rmm_alloc, _rmm_free,
        },
        interop::{_dlpack_export, _import_cai, _import_dlpack, _layout},
        torch_stats::{_torch_counts, _torch_reset_accumulated, _torch_reset_peak},
        torch_throw::{_hooks_torch_errors, _hooks_torch_oom_missing},
    };

    // PyTorch's memory pools and tensor sharing (gpuptr._torch_pool, _torch_ipc).
    #[pymodule_export]
    use super::{
        torch_pools::{_torch_pool_begin, _torch_pool_counts, _torch_pool_end, _torch_pool_live},
        torch_share::{_torch_is_live, _torch_lend, TorchLoan},
    };

    #[pymodule_export]
    #[allow(non_upper_case_globals)]
    const __version__: &str = env!("CARGO_PKG_VERSION");

    /// Route the core's log records to Python, close the calls into Python
    /// from other threads at exit (see `shutdown`), and make
    /// `gpuptr._testing` (importable by that name, not an attribute of this
    /// module).
    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        super::logging::init();
        crate::sync::set_blocking(super::without_the_gil);
        super::shutdown::register(m)?;
        super::testing::register(m.py())
    }
}
