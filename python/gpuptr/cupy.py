"""CuPy on gpuptr's pool.

``gpuptr.cupy.install()`` sets gpuptr as CuPy's device allocator
(``cupy.cuda.set_allocator``) and pinned-host allocator
(``cupy.cuda.set_pinned_memory_allocator``), so CuPy arrays come from the
same per-device pool as numba, PyTorch and ``gpuptr.alloc``.

Safety on every stream needs no call from you: by default memory CuPy frees
is reused only after all work queued before the free, on every stream, is
done. ``install(stream_ordered=True)`` allocates and frees on CuPy's current
stream instead, as CuPy's own pool does: a block freed on a stream is reused
at once there (and by other streams after the fence), for code that keeps
each array on its stream.
"""

from __future__ import annotations

from typing import Any

from gpuptr import _core
from gpuptr._errors import InstallError

__all__ = ["install", "installed", "malloc", "malloc_pinned"]

_stream_ordered = False
_installed = False


def malloc(nbytes: int) -> Any:
    """A ``cupy.cuda.MemoryPointer`` of ``nbytes`` from gpuptr's pool on CuPy's
    current device (and, with ``stream_ordered``, its current stream). The
    gpuptr memory is the owner: it goes back to the pool when CuPy drops it."""
    device = _get_device()
    stream = _current_stream_ptr() if _stream_ordered else None
    mem = _core._alloc_for("cupy", nbytes, device, stream)
    return _MemoryPointer(_UnownedMemory(mem.device_pointer_value or 0, nbytes, mem, device), 0)


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
    host memory from gpuptr, freed when CuPy drops it."""
    import cupy

    mem = _core.alloc_host(nbytes, portable=True, device=_get_device())
    return cupy.cuda.PinnedMemoryPointer(_Pinned(mem, nbytes), 0)


def installed() -> bool:
    """Whether ``install()`` put CuPy on gpuptr in this process."""
    return _installed


def install(*, stream_ordered: bool = False, pinned: bool = True) -> None:
    """Make gpuptr CuPy's device allocator (and, with ``pinned``, its pinned
    host allocator). Arrays CuPy allocated before keep their memory.
    ``ImportError`` without CuPy."""
    global _installed, _stream_ordered, _get_device, _current_stream_ptr, _MemoryPointer, _UnownedMemory
    import cupy

    try:
        _get_device = cupy.cuda.runtime.getDevice
        stream_mod = cupy.cuda.stream
        _current_stream_ptr = getattr(stream_mod, "get_current_stream_ptr", None) or (
            lambda: cupy.cuda.get_current_stream().ptr
        )
        _MemoryPointer = cupy.cuda.MemoryPointer
        _UnownedMemory = cupy.cuda.UnownedMemory
    except AttributeError as e:  # pragma: no cover - a CuPy without these
        raise InstallError(f"this CuPy ({cupy.__version__}) lacks {e.name}") from e
    _stream_ordered = bool(stream_ordered)
    cupy.cuda.set_allocator(malloc)
    if pinned:
        cupy.cuda.set_pinned_memory_allocator(malloc_pinned)
    _installed = True


# Bound by install() to CuPy's own functions (looked up once, not per call).
_get_device: Any = None
_current_stream_ptr: Any = None
_MemoryPointer: Any = None
_UnownedMemory: Any = None
