"""CuPy on gpuptr's pool.

``gpuptr.cupy.install()`` sets gpuptr as CuPy's device allocator
(``cupy.cuda.set_allocator``) and pinned-host allocator
(``cupy.cuda.set_pinned_memory_allocator``), so CuPy arrays come from the
same per-device pool as numba, PyTorch and ``gpuptr.alloc``.

Streams: as under CuPy's own pool, memory is allocated and freed on CuPy's
current stream and reused at once there (other streams get it after a
fence, or when the device runs out of memory). ``install(stream_ordered=False)``
makes every free wait until all work queued before it, on every stream, is
done, for code that uses an array on a stream other than the one it was
allocated on.
"""

from __future__ import annotations

from typing import Any

from gpuptr import _core
from gpuptr._errors import InstallError

__all__ = ["OutOfMemoryError", "install", "installed", "malloc", "malloc_pinned"]

_stream_ordered = True
_installed = False
_allocator: Any = None  # CuPy's CFunctionAllocator (or PythonFunctionAllocator) over gpuptr's hooks
_c_hooks_pass_errors: dict[Any, bool] = {}  # per CFunctionAllocator class: what the probe found


def _c_hooks_usable(cls: Any) -> bool:
    """Whether CuPy's ``CFunctionAllocator`` passes on an exception that
    gpuptr's C hook sets. Its ``_call_malloc`` is Cython returning an
    ``intptr_t``: built with Cython 3's defaults it checks for an exception
    after a -1, built otherwise it would take -1 for an address. The probe
    hook fails at once and frees nothing, so asking costs no memory."""
    if cls not in _c_hooks_pass_errors:
        malloc, free, _, _, probe, message = _core._cupy_c_hooks()
        ok = False
        try:
            cls(probe, malloc, free, _core).malloc(1)
        except Exception as e:  # not ours (e.g. SystemError: a result with an exception set): unusable
            ok = isinstance(e, ValueError) and message in str(e)
        _c_hooks_pass_errors[cls] = ok
    return _c_hooks_pass_errors[cls]


def _make_allocator(cupy: Any, stream_ordered: bool, c_hooks: bool = True) -> Any:
    # CuPy's own Cython allocator classes build the memory objects. With
    # CFunctionAllocator it calls gpuptr's C hooks directly: no Python call
    # per allocation or free. Where the probe finds that it would not pass
    # on the hook's errors, PythonFunctionAllocator calls gpuptr's compiled
    # Python functions instead: no Python frame, but a call each way.
    mem: Any = getattr(cupy.cuda, "memory", None)
    c_cls = getattr(cupy.cuda, "CFunctionAllocator", None) or getattr(mem, "CFunctionAllocator", None)
    if c_hooks and c_cls is not None and _c_hooks_usable(c_cls):
        malloc, free, fenced, ordered, _, _ = _core._cupy_c_hooks()
        return c_cls(ordered if stream_ordered else fenced, malloc, free, _core)
    cls = getattr(cupy.cuda, "PythonFunctionAllocator", None) or mem.PythonFunctionAllocator
    malloc_func = _core._cupy_malloc_current if stream_ordered else _core._cupy_malloc
    return cls(malloc_func, _core._cupy_free)


def malloc(nbytes: int) -> Any:
    """A ``cupy.cuda.MemoryPointer`` of ``nbytes`` from gpuptr's pool on CuPy's
    current device (and, with ``stream_ordered``, its current stream). It goes
    back to the pool when CuPy drops it."""
    global _allocator
    if _allocator is None:
        import cupy

        _bind(cupy)
        _allocator = _make_allocator(cupy, _stream_ordered)
    return _allocator.malloc(nbytes)


class _Pinned:
    """What ``cupy.cuda.PinnedMemoryPointer`` needs of its memory (``ptr``,
    ``size``), holding gpuptr's pinned allocation."""

    __slots__ = ("mem", "ptr", "size")

    def __init__(self, mem: Any, size: int) -> None:
        self.mem = mem
        self.ptr = mem.host_pointer if size else 0
        self.size = size


def malloc_pinned(nbytes: int) -> Any:
    """A ``cupy.cuda.PinnedMemoryPointer`` of ``nbytes`` of portable pinned
    host memory from gpuptr (its pinned cache), freed when CuPy drops it."""
    if _pinned_pointer is None:
        import cupy

        _bind(cupy)
    # Positional (mapped, portable, wc, device): CuPy allocates pinned
    # buffers in loops, and keyword parsing is a third of the call.
    mem = _alloc_host(nbytes, False, True, False, _get_device())
    # gpuptr's PinnedMemory has the ``ptr`` and ``size`` CuPy reads; a
    # zero-byte one is given a null address, as CuPy's own.
    return _pinned_pointer(mem if nbytes else _Pinned(mem, 0), 0)


def installed() -> bool:
    """Whether ``install()`` put CuPy on gpuptr in this process."""
    return _installed


def install(*, stream_ordered: bool = True, pinned: bool = True) -> None:
    """Make gpuptr CuPy's device allocator (and, with ``pinned``, its pinned
    host allocator). Arrays CuPy allocated before keep their memory.
    Raises :class:`~gpuptr.InstallError`, with what to install, where CuPy
    cannot be imported."""
    global _installed, _stream_ordered, _allocator
    from gpuptr._needs import flag

    stream_ordered = flag(stream_ordered, "stream_ordered")
    pinned = flag(pinned, "pinned")
    try:
        import cupy
    except ImportError as e:
        from gpuptr._needs import NEEDS  # the hint gpuptr.install() gives

        raise InstallError(
            f"gpuptr.cupy.install() needs CuPy, which cannot be imported ({e}): pip install {NEEDS['cupy'][1]}"
        ) from e

    _bind(cupy)
    try:
        allocator = _make_allocator(cupy, bool(stream_ordered))
    except AttributeError as e:  # pragma: no cover - a CuPy without it
        raise InstallError(f"this CuPy ({cupy.__version__}) lacks {e.name}") from e
    _stream_ordered = bool(stream_ordered)
    _allocator = allocator
    cupy.cuda.set_allocator(allocator.malloc)
    if pinned:
        cupy.cuda.set_pinned_memory_allocator(malloc_pinned)
    _answer_default_pool(cupy)
    _installed = True


class _PoolView:
    """``cupy.get_default_memory_pool()`` under ``install()``: CuPy's
    ``MemoryPool`` methods, answered by gpuptr's pool on CuPy's current
    device. ``used_bytes()`` is CuPy's live memory in it (as requested),
    ``free_bytes()`` what the pool caches for reuse by any library,
    ``total_bytes()`` their sum; ``free_all_blocks()`` gives the cache back
    to the driver (``gpuptr.trim()``, every device); ``set_limit()`` caps
    what the pool holds from the driver (``gpuptr.set_pool_limit``, for every
    library on the pool); ``malloc()`` allocates from gpuptr."""

    def _stats(self) -> Any:
        d = _get_device()
        for s in _core.stats():
            if s["device"] == d:
                return s
        raise InstallError(f"gpuptr has no device {d}")  # pragma: no cover - stats() lists every device

    def malloc(self, size: int) -> Any:
        return malloc(size)

    def used_bytes(self) -> int:
        return int(self._stats()["clients"]["cupy"]["live_bytes"])

    def free_bytes(self) -> int:
        return int(self._stats()["cached_bytes"])

    def total_bytes(self) -> int:
        s = self._stats()
        return int(s["clients"]["cupy"]["live_bytes"]) + int(s["cached_bytes"])

    def n_free_blocks(self) -> int:
        return sum(c["cached_blocks"] for c in _core.pool_classes(_get_device()))

    def free_all_blocks(self, stream: Any = None) -> None:
        _core.trim()

    def free_all_free(self) -> None:
        _core.trim()

    def set_limit(self, size: Any = None, fraction: Any = None) -> None:
        if size is not None and fraction is not None:
            raise ValueError("size and fraction cannot be specified at one time")
        if fraction is not None:
            if not 0 <= fraction <= 1:
                raise ValueError(f"fraction must be between 0 and 1, not {fraction}")
            limit: Any = float(fraction) if fraction else None
        else:
            limit = int(size) if size else None
        _core.set_pool_limit(limit, _get_device())

    def get_limit(self) -> int:
        return int(self._stats()["pool_limit"] or 0)


def _pool_view_class(cupy: Any) -> Any:
    """:class:`_PoolView`, also a ``cupy.cuda.MemoryPool`` where CuPy lets
    it be subclassed (so ``isinstance`` checks hold)."""
    base = getattr(cupy.cuda, "MemoryPool", None)
    if isinstance(base, type):
        try:
            return type("MemoryPool", (_PoolView, base), {"__module__": __name__})
        except TypeError:  # pragma: no cover - a CuPy whose MemoryPool is final
            pass
    return _PoolView


def _answer_default_pool(cupy: Any) -> None:
    """Make ``cupy.get_default_memory_pool()`` answer from gpuptr (it
    returns ``cupy._default_memory_pool``, unused once the allocator is
    gpuptr's)."""
    if isinstance(getattr(cupy, "_default_memory_pool", None), _PoolView):
        return
    pool = _pool_view_class(cupy)()
    cupy._default_memory_pool = pool
    getter = getattr(cupy, "get_default_memory_pool", None)
    if getter is None or getter() is not pool:
        cupy.get_default_memory_pool = lambda: pool


_oom: Any = None  # the class OutOfMemoryError names, made when CuPy is first bound


def __getattr__(name: str) -> Any:
    """``OutOfMemoryError``: out of device memory, as CuPy reports it, a
    subclass of both ``cupy.cuda.memory.OutOfMemoryError`` and
    :class:`gpuptr.OutOfMemoryError` (so a ``MemoryError``). Raised after
    gpuptr has waited for its fence and returned its cache; the message says
    what the pool held. Made when first asked for or when CuPy is bound, so
    ``except gpuptr.cupy.OutOfMemoryError`` works before ``install()``;
    without CuPy it is :class:`gpuptr.OutOfMemoryError`."""
    if name != "OutOfMemoryError":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from gpuptr._errors import OutOfMemoryError as plain

    if _oom is None:
        try:
            import cupy
        except ImportError:
            return plain
        _bind_oom(cupy)
    return _oom if _oom is not None else plain


def _bind_oom(cupy: Any) -> None:
    """Make CuPy's hook raise :data:`OutOfMemoryError` (once): a CuPy
    without ``cupy.cuda.memory.OutOfMemoryError`` keeps gpuptr's own."""
    global _oom
    if _oom is None and hasattr(getattr(cupy.cuda, "memory", None), "OutOfMemoryError"):
        _oom = _oom_class(cupy)
        _core._cupy_set_oom_error(_oom)


def _oom_class(cupy: Any) -> Any:
    """The class CuPy's hook raises for out of memory (see
    :data:`OutOfMemoryError`)."""
    from gpuptr import _errors

    class OutOfMemoryError(cupy.cuda.memory.OutOfMemoryError, _errors.OutOfMemoryError):  # type: ignore[misc]
        """Out of device memory: CuPy's and gpuptr's ``OutOfMemoryError``."""

        def __init__(self, message: str, requested: int = 0) -> None:
            # CuPy's own __init__ formats (size, total, limit); gpuptr's
            # message already says more.
            _errors.OutOfMemoryError.__init__(self, message)
            self.requested = requested

        def __str__(self) -> str:
            return str(self.args[0])

    OutOfMemoryError.__module__ = __name__
    OutOfMemoryError.__qualname__ = "OutOfMemoryError"
    return OutOfMemoryError


def _bind(cupy: Any) -> None:
    """Look up the CuPy functions gpuptr calls (once, not per call)."""
    global _get_device, _current_stream_ptr, _pinned_pointer
    _bind_oom(cupy)
    try:
        _get_device = cupy.cuda.runtime.getDevice
        _pinned_pointer = cupy.cuda.PinnedMemoryPointer
        stream_mod = cupy.cuda.stream
        _current_stream_ptr = getattr(stream_mod, "get_current_stream_ptr", None) or (
            lambda: cupy.cuda.get_current_stream().ptr
        )
        _core._cupy_set_stream_source(_current_stream_ptr)
    except AttributeError as e:  # pragma: no cover - a CuPy without these
        raise InstallError(f"this CuPy ({cupy.__version__}) lacks {e.name}") from e


# Bound by install() to CuPy's own functions (looked up once, not per call).
_get_device: Any = None
_current_stream_ptr: Any = None
_pinned_pointer: Any = None
_alloc_host = _core.alloc_host
