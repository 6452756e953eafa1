"""gpuptr for cuda.core users: memory resources over gpuptr's pool.

:class:`MemoryResource` is a real ``cuda.core`` ``MemoryResource``:
``mr.allocate(size, stream=s)`` returns a ``cuda.core`` ``Buffer`` over a
block of gpuptr's per-device pool, and closing the buffer (or dropping it)
frees the block back into the pool. :func:`install` makes it a device's
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

from typing import Any, Dict, Optional, Tuple

try:
    import cuda.core as _cc
    from cuda.core import Buffer as _Buffer
    from cuda.core import Stream as _Stream
except ImportError as _e:
    raise ImportError(f'gpuptr.cuda_core needs cuda.core: pip install "gpuptr[cuda-core]" ({_e})', name=_e.name) from _e

import gpuptr as _gpuptr
from gpuptr import _core
from gpuptr._core import _pool_free, _pool_malloc

__all__ = ["ManagedMemoryResource", "MemoryResource", "PinnedMemoryResource", "install"]

_GraphBuilder: Any = getattr(getattr(_cc, "graph", None), "GraphBuilder", None) or getattr(_cc, "GraphBuilder", None)
_STREAM_TYPES: Tuple[type, ...] = tuple(t for t in (_Stream, _GraphBuilder) if isinstance(t, type))


def _device_id(device: Any) -> int:
    if device is None:
        return _core._current_device()
    if hasattr(device, "device_id"):  # a cuda.core Device
        return int(device.device_id)
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"device must be an int or a cuda.core Device, not {type(device).__name__}")
    return device


def _stream(stream: Any) -> Any:
    """``stream`` as cuda.core's ``Buffer.from_handle`` takes it: a cuda.core
    ``Stream`` or ``GraphBuilder`` as is, None for cuda.core's default, an
    int handle, or an object with ``__cuda_stream__`` or ``handle`` (numba's,
    CuPy's and torch's streams)."""
    if stream is None or isinstance(stream, _STREAM_TYPES):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return _Stream.from_handle(int(stream.__cuda_stream__()[1]))
    handle = getattr(stream, "handle", getattr(stream, "cuda_stream", stream))
    value = getattr(handle, "value", handle)  # numba's ctypes handles
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(value)  # cuda.bindings CUstream
        except (TypeError, ValueError):
            raise TypeError(f"stream must be a cuda.core Stream or a stream handle, not {type(stream).__name__}") from None
    return _Stream.from_handle(value)


_MISSING = object()


class _Resource(_cc.MemoryResource):  # type: ignore[misc]  # cuda.core ships a Cython base
    """What the three resources share: the addresses this resource handed
    out, each freed once, when cuda.core deallocates it."""

    def __init__(self, device: Any = None) -> None:
        self._device = _device_id(device)
        _gpuptr.context(self._device)  # fails here, typed, if there is no such device
        # address -> what keeps it (None where the pool's entry points do)
        self._live: Dict[int, Any] = {}

    def _new(self, size: int) -> Tuple[int, Any]:
        raise NotImplementedError

    def _release(self, address: int, kept: Any) -> None:
        kept.free()

    def allocate(self, size: int, *, stream: Any = None) -> Any:
        """A ``cuda.core`` ``Buffer`` of ``size`` bytes, freed back to gpuptr
        when it is closed or dropped. ``stream`` orders its deallocation as
        cuda.core records it; gpuptr's memory is usable on every stream at
        once. :class:`gpuptr.OutOfMemoryError` when none is left."""
        address, kept = self._new(size)
        live = self._live
        if address:
            live[address] = kept
        try:
            if stream is not None and type(stream) not in _STREAM_TYPES:
                stream = _stream(stream)
            return _Buffer.from_handle(address, size, mr=self, stream=stream)
        except BaseException:
            if address and live.pop(address, _MISSING) is not _MISSING:
                self._release(address, kept)
            raise

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        """Free what :meth:`allocate` gave at ``ptr`` back to gpuptr. Safe on
        any stream: the block is reused only after the work queued before
        this call, on every stream, is done. An address this resource did not
        hand out (or freed already) is ignored: cuda.core never passes one."""
        # Made an int first: a float or numpy integer equal to the address
        # would find its entry too, and then fail the free.
        address = ptr if type(ptr) is int else int(ptr)
        kept = self._live.pop(address, _MISSING)
        if kept is not _MISSING:
            self._release(address, kept)

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


def _host_address(mem: Any) -> Tuple[int, Any]:
    value = mem.device_pointer_value
    if value is None:
        value = getattr(mem, "host_pointer", 0)
    return int(value or 0), mem


class MemoryResource(_Resource):
    """Device memory from gpuptr's pool on ``device`` (an int or a cuda.core
    ``Device``; default: the current one), as a cuda.core memory resource.
    Counted under the client ``"cuda_core"`` in :func:`gpuptr.stats`."""

    def _new(self, size: int) -> Tuple[int, Any]:
        # The pool's raw entry points (as CuPy's hooks): no Python object per
        # buffer, and the free is one call.
        return _pool_malloc("cuda_core", size, self._device), None

    def _release(self, address: int, kept: Any) -> None:
        _pool_free(address)


class PinnedMemoryResource(_Resource):
    """Pinned host memory from gpuptr (portable, mapped into every device's
    address space), as a cuda.core memory resource: host and device
    accessible."""

    _host_accessible = True

    def _new(self, size: int) -> Tuple[int, Any]:
        return _host_address(_gpuptr.alloc_host(size, mapped=True, portable=True, device=self._device))


class ManagedMemoryResource(_Resource):
    """Managed (unified) memory from gpuptr, attached globally, as a
    cuda.core memory resource."""

    _host_accessible, _managed = True, True

    def _new(self, size: int) -> Tuple[int, Any]:
        return _host_address(_gpuptr.alloc_managed(size, attach_global=True, device=self._device))


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
