"""gpuptr for cuda.core users: memory resources over gpuptr's pool.

:class:`MemoryResource` is a real ``cuda.core`` ``MemoryResource``:
``mr.allocate(size, stream=s)`` returns a ``cuda.core`` ``Buffer`` over a
block of gpuptr's per-device pool, and closing the buffer (or dropping it)
frees the block back into the pool. The buffer owns its block (its
``owner`` is the gpuptr allocation), so the free runs no Python code. :func:`install` makes it a device's
memory resource, so ``Device.allocate`` (and numba-cuda-mlir's copies of
host-array kernel arguments, which allocate through it) use the pool too.
:class:`PinnedMemoryResource` and :class:`ManagedMemoryResource` give
pinned host and managed memory from gpuptr.

Stream order: cuda.core frees a buffer "on" its deallocation stream, and
its own pools may hand the memory to the next allocation on that stream at
once. gpuptr's pool is stricter: a freed block is reused only after all work
queued before the free, on every stream, is done. So a buffer may be
closed on any stream, or none, while kernels on other streams still use it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

try:
    import cuda.core as _cc
    from cuda.core import Buffer as _Buffer
    from cuda.core import Stream as _Stream
except ImportError as _e:
    raise ImportError(f"gpuptr.cuda_core needs cuda.core: pip install cuda-core cuda-bindings (gpuptr's [cuda-core] extra) ({_e})", name=_e.name) from _e

import gpuptr as _gpuptr
from gpuptr import _core
from gpuptr._core import _cuda_core_buffer

__all__ = ["ManagedMemoryResource", "MemoryResource", "PinnedMemoryResource", "install"]

_GraphBuilder: Any = getattr(getattr(_cc, "graph", None), "GraphBuilder", None) or getattr(_cc, "GraphBuilder", None)
_STREAM_TYPES: Tuple[type, ...] = tuple(t for t in (_Stream, _GraphBuilder) if isinstance(t, type))
_ManagedBuffer: Any = getattr(_cc, "ManagedBuffer", None)


def _device_id(device: Any) -> int:
    if device is None:
        return _core._current_device()
    if hasattr(device, "device_id"):  # a cuda.core Device
        return int(device.device_id)
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"device must be an int or a cuda.core Device, not {type(device).__name__}")
    return device


def _check_stream(stream: Any) -> None:
    """Refuse what is not a stream: a cuda.core ``Stream`` or
    ``GraphBuilder``, None, an int handle, or an object with
    ``__cuda_stream__`` or ``handle`` (numba's, CuPy's and torch's streams).
    gpuptr's memory needs no stream to be freed safely, so none is kept."""
    if stream is None or isinstance(stream, _STREAM_TYPES) or hasattr(stream, "__cuda_stream__"):
        return
    handle = getattr(stream, "handle", getattr(stream, "cuda_stream", stream))
    value = getattr(handle, "value", handle)  # numba's ctypes handles
    if isinstance(value, int) and not isinstance(value, bool):
        return
    try:
        if isinstance(value, (bool, float)):
            raise TypeError
        int(value)  # cuda.bindings CUstream
    except (TypeError, ValueError):
        raise TypeError(f"stream must be a cuda.core Stream or a stream handle, not {type(stream).__name__}") from None


class _Buffers:
    """What the buffers of a gpuptr resource add to cuda.core's ``Buffer``:
    their memory resource, and its properties, without a driver query.

    Each buffer owns its gpuptr allocation (cuda.core's ``owner``), so
    closing or dropping it frees the memory with no Python call, which is
    where most of the time of a Python memory resource goes in cuda.core.
    """

    __slots__ = ()
    _resource: Any = None  # set on each resource's own subclass

    def _open(self) -> Any:
        if self.is_closed:  # type: ignore[attr-defined]
            raise RuntimeError("Buffer has been closed")  # cuda.core's words
        return self._resource

    @property
    def memory_resource(self) -> Any:
        """The gpuptr resource that allocated this buffer (None once closed)."""
        return None if self.is_closed else self._resource  # type: ignore[attr-defined]

    @property
    def device_id(self) -> int:
        """The device the memory belongs to."""
        return int(self._open().device_id)

    @property
    def is_device_accessible(self) -> bool:
        """Whether the GPU can access the memory (always)."""
        return bool(self._open().is_device_accessible)

    @property
    def is_host_accessible(self) -> bool:
        """Whether the CPU can access the memory (pinned and managed)."""
        return bool(self._open().is_host_accessible)

    @property
    def is_managed(self) -> bool:
        """Whether the memory is CUDA managed memory."""
        return bool(self._open().is_managed)

    def copy_to(self, dst: Any = None, *, stream: Any, **options: Any) -> Any:
        """cuda.core's ``copy_to``; without ``dst``, the copy goes into a new
        buffer from this buffer's resource, as cuda.core's own buffers do."""
        if dst is None and not self.is_closed:  # type: ignore[attr-defined]
            dst = self._resource.allocate(self.size, stream=stream)  # type: ignore[attr-defined]
        return super().copy_to(dst, stream=stream, **options)  # type: ignore[misc]


def _buffer_maker(resource: Any, base: Any) -> Callable[..., Any]:
    """``make(address, size, None, None, owner)``: a Buffer of ``resource``
    (cuda.core's ``Buffer._init`` on a subclass of ``base`` that knows its
    resource), or, where this cuda.core lacks that entry point, a plain
    ``Buffer.from_handle(address, size, owner=owner)``, whose
    ``memory_resource`` is None."""
    cls = type(
        base.__name__,
        (_Buffers, base),
        {"__slots__": (), "_resource": resource, "__module__": __name__, "__qualname__": f"{type(resource).__name__}.Buffer"},
    )
    make: Any = getattr(cls, "_init", None)
    if make is not None:
        try:
            probe: Any = make(0, 0, None, None, resource)
            ok = probe.owner is resource and probe.size == 0 and type(probe) is cls
            probe.close()
        except Exception:  # noqa: BLE001 - another cuda.core: the public path then
            ok = False
        if ok:
            return make  # type: ignore[no-any-return]

    def from_handle(address: int, size: int, mr: None, ipc: None, owner: Any) -> Any:
        return _Buffer.from_handle(address, size, None, owner)

    return from_handle


class _Resource(_cc.MemoryResource):  # type: ignore[misc]  # cuda.core ships a Cython base
    """What the three resources share."""

    _buffer_base: Any = _Buffer

    def __init__(self, device: Any = None) -> None:
        self._device = _device_id(device)
        _gpuptr.context(self._device)  # fails here, typed, if there is no such device
        self._make = _buffer_maker(self, self._buffer_base)

    def _buffer(self, size: int) -> Any:
        raise NotImplementedError

    def allocate(self, size: int, *, stream: Any = None) -> Any:
        """A ``cuda.core`` ``Buffer`` of ``size`` bytes that owns its gpuptr
        memory: closing or dropping it frees the memory back to gpuptr.
        ``stream`` may be any stream (or None): gpuptr's memory is usable on
        every stream at once, and freed safely whichever stream used it, so
        no stream is recorded. :class:`gpuptr.OutOfMemoryError` when none is
        left."""
        if stream is not None and type(stream) not in _STREAM_TYPES:
            _check_stream(stream)
        return self._buffer(size)

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        """Does nothing: a gpuptr resource's buffer frees its own memory when
        it is closed or dropped, and cuda.core never calls this for one. So
        neither a stray address nor a repeated call can free memory a live
        buffer (or another library) still uses."""

    # What the resource's buffers are, per class.
    _device_accessible, _host_accessible, _managed = True, False, False

    @property
    def device_id(self) -> int:
        """The device the memory belongs to."""
        return self._device

    @property
    def is_device_accessible(self) -> bool:
        """Whether buffers are device-accessible (True for all three)."""
        return self._device_accessible

    @property
    def is_host_accessible(self) -> bool:
        """Whether buffers are host-accessible (pinned and managed memory)."""
        return self._host_accessible

    @property
    def is_managed(self) -> bool:
        """Whether buffers are CUDA managed (unified) memory."""
        return self._managed

    def __repr__(self) -> str:
        return f"gpuptr.cuda_core.{type(self).__name__}(device={self._device})"


class MemoryResource(_Resource):
    """Device memory from gpuptr's pool on ``device`` (an int or a cuda.core
    ``Device``; default: the current one), as a cuda.core memory resource.
    Counted under the client ``"cuda_core"`` in :func:`gpuptr.stats`.
    A buffer's ``owner`` is its gpuptr ``MemoryPointer``."""

    def _buffer(self, size: int) -> Any:
        return _cuda_core_buffer(self._make, size, self._device)


class _HostResource(_Resource):
    def _alloc(self, size: int) -> Any:
        raise NotImplementedError

    def _buffer(self, size: int) -> Any:
        mem = self._alloc(size)
        value = mem.device_pointer_value
        if value is None:
            value = getattr(mem, "host_pointer", 0)
        address = int(value or 0)
        return self._make(address, size, None, None, mem if address else None)


class PinnedMemoryResource(_HostResource):
    """Pinned host memory from gpuptr (portable, mapped into every device's
    address space), as a cuda.core memory resource: host and device
    accessible. A buffer's ``owner`` is its gpuptr ``PinnedMemory``."""

    _host_accessible = True

    def _alloc(self, size: int) -> Any:
        return _gpuptr.alloc_host(size, mapped=True, portable=True, device=self._device)


class ManagedMemoryResource(_HostResource):
    """Managed (unified) memory from gpuptr, attached globally, as a
    cuda.core memory resource. Its buffers are cuda.core ``ManagedBuffer``
    objects where cuda.core has them (``read_mostly``, ``prefetch`` ...); a
    buffer's ``owner`` is its gpuptr ``ManagedMemory``."""

    _host_accessible, _managed = True, True
    _buffer_base = _ManagedBuffer or _Buffer

    def _alloc(self, size: int) -> Any:
        return _gpuptr.alloc_managed(size, attach_global=True, device=self._device)


_installed: Dict[int, MemoryResource] = {}


def install(device: Optional[Any] = None, *, cuda_device: Any = None) -> MemoryResource:
    """Make gpuptr's pool the memory resource of a cuda.core ``Device``, so
    ``Device.allocate`` uses it; returns the resource. ``device`` (an int or
    a ``Device``; default: the current one) picks the device; pass
    ``cuda_device`` to set it on that very ``Device`` object (cuda.core keeps
    ``Device`` objects per thread: ``Device(0)`` on another thread is
    another object, with its own memory resource). One resource serves each
    device. gpuptr.numba does this for numba-cuda-mlir's devices by itself.
    """
    target = cuda_device if cuda_device is not None else _cc.Device(_device_id(device) if device is not None else None)
    dev = int(target.device_id)
    mr = _installed.get(dev)
    if mr is None:
        mr = _installed.setdefault(dev, MemoryResource(dev))
    if target.memory_resource is not mr:
        target.memory_resource = mr
    return mr
