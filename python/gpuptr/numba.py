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

from gpuptr import _core
from gpuptr._errors import InvalidArgumentError

__all__ = ["as_cuda_array", "from_cuda_array_interface_numba"]


@lru_cache(maxsize=1024)
def _array_attrs(shape: tuple, strides: tuple, typestr: str) -> dict:
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
def _external_stream(handle: int, device: int):
    # External streams own nothing, so one numba Stream per handle serves.
    with cuda.gpus[device]:
        return cuda.external_stream(handle)


def from_cuda_array_interface_numba(desc: dict, owner: Any = None, sync: bool = True) -> DeviceNDArray:
    """``numba.cuda.from_cuda_array_interface`` over a gpuptr pointer: the
    DeviceNDArray that ``DeviceNDArray(shape, strides, dtype, stream,
    gpu_data)`` would build, without re-deriving what is already known."""
    if not isinstance(desc, dict):
        raise InvalidArgumentError("__cuda_array_interface__ must be a dict")
    ptr, shape, strides, typestr, _itemsize, _ro, offset, stream = _core._import_cai(
        desc, owner, bool(sync and config.CUDA_ARRAY_INTERFACE_SYNC)
    )
    attrs = dict(_array_attrs(shape, strides, typestr))
    attrs["alloc_size"] = offset + ptr.size if attrs["size"] else 0
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
