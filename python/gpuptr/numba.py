"""gpuptr for numba-cuda users.

``as_cuda_array(obj)`` is a drop-in for ``numba.cuda.as_cuda_array``: it
returns a numba ``DeviceNDArray`` whose ``gpu_data`` is a gpuptr
MemoryPointer, holding the real context of the memory (resolved from the
address, not from numba's current context), at a fraction of numba's cost.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, Optional, Tuple

import numpy as np
from numba import cuda
from numba.cuda import config
from numba.cuda.cudadrv import dummyarray
from numba.cuda.cudadrv.devicearray import DeviceNDArray

from gpuptr import _core

__all__ = ["MemoryManager", "as_cuda_array", "from_cuda_array_interface_numba"]


@lru_cache(maxsize=1024)
def _array_attrs(shape: Tuple[int, ...], strides: Tuple[int, ...], typestr: str) -> Dict[str, Any]:
    """What ``DeviceNDArray.__init__`` derives from a layout. numba builds the
    index descriptor (``_dummy``) for every array; it is never mutated, so one
    per layout serves them all."""
    dtype = np.dtype(typestr)
    dummy = dummyarray.Array.from_desc(0, shape, strides, dtype.itemsize)
    return {
        "ndim": len(shape),
        "_dummy": dummy,
        "shape": dummy.shape,
        "strides": dummy.strides,
        "dtype": dtype,
        "size": dummy.size,
    }


@lru_cache(maxsize=64)
def _external_stream(handle: int, device: int) -> Any:
    # External streams own nothing, so one numba Stream per handle serves.
    with cuda.gpus[device]:
        return cuda.external_stream(handle)


def from_cuda_array_interface_numba(desc: Dict[str, Any], owner: Any = None, sync: bool = True) -> DeviceNDArray:
    """``numba.cuda.from_cuda_array_interface`` over a gpuptr pointer: the
    DeviceNDArray that ``DeviceNDArray(shape, strides, dtype, stream,
    gpu_data)`` would build, without re-deriving what is already known."""
    # _import_cai checks every field, and that desc is a dict.
    imp = _core._import_cai(desc, owner, bool(sync and config.CUDA_ARRAY_INTERFACE_SYNC))
    ptr, stream = imp.pointer, imp.stream
    attrs = dict(_array_attrs(imp.shape, imp.strides, imp.typestr))
    attrs["alloc_size"] = imp.offset + ptr.size if attrs["size"] else 0
    attrs["gpu_data"] = ptr
    attrs["stream"] = 0 if stream is None else _external_stream(stream, ptr.context.device.id)
    arr = _new(DeviceNDArray)
    arr.__dict__ = attrs
    return arr


_new = object.__new__


def as_cuda_array(obj: Any, sync: bool = True) -> DeviceNDArray:
    """Create a numba ``DeviceNDArray`` from any object implementing the CUDA
    Array Interface, as ``numba.cuda.as_cuda_array`` does. Its ``gpu_data``
    is a gpuptr MemoryPointer that keeps ``obj`` alive and carries the
    memory's own context. With ``sync``, the exporter's stream (if any) is
    synchronized first."""
    try:
        desc = obj.__cuda_array_interface__
    except AttributeError:
        raise TypeError("*obj* doesn't implement the cuda array interface.") from None
    return from_cuda_array_interface_numba(desc, owner=obj, sync=sync)


# --- the External Memory Management plugin -----------------------------------

import contextlib  # noqa: E402

from numba.cuda.cudadrv.driver import (  # noqa: E402
    BaseCUDAMemoryManager,
    GetIpcHandleMixin,
    MemoryInfo,
)

import gpuptr as _gpuptr  # noqa: E402


class MemoryManager(GetIpcHandleMixin, BaseCUDAMemoryManager):  # type: ignore[misc]  # numba ships no types
    """numba-cuda External Memory Management plugin (interface version 1)
    over gpuptr: device memory comes from gpuptr's per-device caching pool,
    host memory is pinned by gpuptr, and every pointer holds its real,
    retained context.

    Enable it with ``NUMBA_CUDA_MEMORY_MANAGER=gpuptr.numba`` or
    ``numba.cuda.set_memory_manager(gpuptr.numba.MemoryManager)``.

    Reuse of freed device memory follows gpuptr's pool rule: a freed block is
    handed out again only after all work queued before its free, on every
    stream (non-blocking CuPy and torch streams included), has finished; a
    helper thread waits for that, never the allocating thread.

    ``get_memory_info()`` counts the bytes the pool caches as free: they are
    available to the next allocation.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._device: Optional[int] = None

    def initialize(self) -> None:
        # numba calls this on every context push: after the first call it is
        # one attribute test.
        if self._device is None and self.context is not None:
            dev = self.context.device
            # numba's own contexts have a Device (.id); contexts it attaches
            # to from a third party carry a bare CUdevice (int()).
            self._device = dev.id if hasattr(dev, "id") else int(dev)
            _gpuptr.context(self._device)

    def _dev(self) -> int:
        if self._device is None:
            self.initialize()
        assert self._device is not None, "numba initialises a manager with its context"
        return self._device

    def memalloc(self, size: int) -> _core.MemoryPointer:
        """Device memory from gpuptr's pool."""
        return _core._alloc_for("numba", size, device=self._dev())

    def memhostalloc(self, size: int, mapped: bool = False, portable: bool = False, wc: bool = False) -> Any:
        """Pinned host memory (mapped into the device when ``mapped``)."""
        return _gpuptr.alloc_host(size, mapped=mapped, portable=portable, wc=wc, device=self._dev())

    def mempin(self, owner: Any, pointer: Any, size: int, mapped: bool = False) -> Any:
        """Pin ``size`` bytes of ``owner``'s memory at ``pointer`` in place."""
        return _core.register_host_ptr(pointer, size, owner, mapped=mapped, device=self._dev())

    def memallocmanaged(self, size: int, attach_global: bool) -> _core.ManagedMemory:
        """Managed (unified) memory."""
        return _gpuptr.alloc_managed(size, attach_global=attach_global, device=self._dev())

    def get_memory_info(self) -> Any:
        """``MemoryInfo(free, total)``, counting pool-cached bytes as free."""
        free, total = _gpuptr.context(self._dev()).get_memory_info()
        cached = _gpuptr.stats()[self._dev()]["cached_bytes"]
        return MemoryInfo(free=min(free + cached, total), total=total)

    def reset(self) -> None:
        """Give cached blocks back and turn live pointers stale: numba resets
        the context next (``cuda.close()``), and a stale pointer's free
        never touches memory a later allocation reuses."""
        if self._device is not None:
            _core.reset_context(self._device)

    def defer_cleanup(self) -> Any:
        """gpuptr frees into its fenced pool at once, and safely on every
        stream, so there is nothing to defer."""
        return contextlib.nullcontext()

    @property
    def interface_version(self) -> int:
        return 1


_numba_memory_manager = MemoryManager
