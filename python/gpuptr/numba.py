"""gpuptr for numba-cuda users.

``as_cuda_array(obj)`` is a drop-in for ``numba.cuda.as_cuda_array``: it
returns a numba ``DeviceNDArray`` whose ``gpu_data`` is a gpuptr
MemoryPointer, holding the real context of the memory (resolved from the
address, not from numba's current context), at a fraction of numba's cost.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
from numba import cuda
from numba.cuda import config
from numba.cuda.cudadrv import dummyarray
from numba.cuda.cudadrv.devicearray import DeviceNDArray

from gpuptr.interop import from_cuda_array_interface

__all__ = ["as_cuda_array", "from_cuda_array_interface_numba"]


@lru_cache(maxsize=1024)
def _dummy(shape: tuple, strides: tuple, itemsize: int):
    # numba builds this index descriptor for every array; it is immutable,
    # so one per (shape, strides, itemsize) serves them all.
    return dummyarray.Array.from_desc(0, shape, strides, itemsize)


@lru_cache(maxsize=256)
def _dtype(typestr: str):
    return np.dtype(typestr)


@lru_cache(maxsize=64)
def _external_stream(handle: int, device: int):
    # External streams own nothing, so one numba Stream per handle serves.
    with cuda.gpus[device]:
        return cuda.external_stream(handle)


def _device_ndarray(shape, strides, dtype, gpu_data, alloc_size, stream) -> DeviceNDArray:
    """Build the DeviceNDArray that ``DeviceNDArray(shape, strides, dtype,
    stream, gpu_data)`` would, without re-deriving what is already known."""
    arr = DeviceNDArray.__new__(DeviceNDArray)
    dummy = _dummy(shape, strides, dtype.itemsize)
    arr.ndim = len(shape)
    arr._dummy = dummy
    arr.shape = dummy.shape
    arr.strides = dummy.strides
    arr.dtype = dtype
    arr.size = dummy.size
    arr.alloc_size = alloc_size if dummy.size else 0
    arr.gpu_data = gpu_data
    arr.stream = stream
    return arr


def from_cuda_array_interface_numba(desc: dict, owner: Any = None, sync: bool = True) -> DeviceNDArray:
    """``numba.cuda.from_cuda_array_interface`` over a gpuptr pointer."""
    view = from_cuda_array_interface(desc, owner=owner, sync=sync and config.CUDA_ARRAY_INTERFACE_SYNC)
    stream = 0 if view.stream is None else _external_stream(view.stream, view.context.device.id)
    return _device_ndarray(
        view.shape, view.strides, _dtype(view.typestr), view.pointer, view.offset + view.pointer.size, stream
    )


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
