"""A stand-in for RMM (``rmm`` and ``rmm.mr``) where RMM cannot be imported:
what ``gpuptr.rmm`` uses of it, behaving as RMM 26's Python layer does.

- ``CallbackMemoryResource(allocate_func, deallocate_func)`` calls
  ``allocate_func(nbytes, stream)`` and ``deallocate_func(ptr, nbytes,
  stream)`` with a new ``Stream`` each call (RMM wraps the C++ stream in
  ``Stream._from_cudaStream_t``), whose handle only ``__cuda_stream__()``
  gives (``value()`` is Cython-only).
- An exception from ``allocate_func`` crosses C++ as RMM's
  ``translate_python_except_to_cpp`` and ``throw_cpp_except`` send it: a
  ``MemoryError`` becomes ``rmm::out_of_memory``, whose ``what()`` is
  ``"std::bad_alloc: "`` + the message, and Cython's ``except +`` raises a
  plain ``MemoryError`` with that text; anything else becomes a
  ``std::runtime_error``, a ``RuntimeError`` with the message. The
  original exception is lost on the way (no chaining through C++).
- An exception from ``deallocate_func`` is propagated here, where RMM's
  ``noexcept`` C++ path would leave it pending: tests assert none happens.
- ``DeviceBuffer(size=n, stream=..., mr=None)`` allocates through ``mr`` (or
  the current device's resource, kept on the buffer) only for ``n > 0``, as
  ``rmm::device_buffer`` does, and deallocates with the same size and stream
  when dropped.
- ``rmm.mr.set_per_device_resource``/``get_per_device_resource`` keep one
  resource per device (a default one for a device never set), and the
  ``current`` ones use :data:`current_device`.

Import it and call :func:`make` for a fresh ``(rmm, rmm.mr)`` pair; the
module's source is also exec'd in Dask workers (see test_dask.py), so it
imports nothing outside the standard library.
"""

from __future__ import annotations

import types
from typing import Any, Dict, Tuple


def make() -> Tuple[types.ModuleType, types.ModuleType]:
    """A fresh fake ``rmm`` module and its ``rmm.mr``."""
    rmm = types.ModuleType("rmm")
    mr = types.ModuleType("rmm.mr")
    rmm.__version__ = "0-fake"
    rmm.mr = mr
    rmm.current_device = 0  # what getDevice() returns
    rmm.calls = []  # every callback call, in order: ("allocate" or "deallocate", nbytes)

    class Stream:
        def __init__(self, handle: int = 0) -> None:
            self._handle = handle

        def __cuda_stream__(self) -> Tuple[int, int]:
            return (0, self._handle)

        def __repr__(self) -> str:
            return f"<fake rmm Stream {self._handle:#x}>"

    default_stream = Stream(0)

    def crossed_cpp(e: BaseException) -> BaseException:
        if isinstance(e, MemoryError):
            return MemoryError("std::bad_alloc: " + str(e))
        return RuntimeError(str(e))

    class DeviceMemoryResource:
        def allocate(self, nbytes: int, stream: Any = default_stream) -> int:
            raise NotImplementedError

        def deallocate(self, ptr: int, nbytes: int, stream: Any = default_stream) -> None:
            raise NotImplementedError

    class CudaMemoryResource(DeviceMemoryResource):
        """RMM's default resource: stands for memory that is not gpuptr's."""

    class CallbackMemoryResource(DeviceMemoryResource):
        def __init__(self, allocate_func: Any, deallocate_func: Any) -> None:
            self._allocate_func = allocate_func
            self._deallocate_func = deallocate_func

        def allocate(self, nbytes: int, stream: Any = default_stream) -> int:
            handle = stream.__cuda_stream__()[1]
            rmm.calls.append(("allocate", nbytes))
            try:
                return int(self._allocate_func(nbytes, Stream(handle)))
            except BaseException as e:  # as RMM: any exception crosses C++
                raise crossed_cpp(e) from None

        def deallocate(self, ptr: int, nbytes: int, stream: Any = default_stream) -> None:
            handle = stream.__cuda_stream__()[1]
            rmm.calls.append(("deallocate", nbytes))
            self._deallocate_func(ptr, nbytes, Stream(handle))

    resources: Dict[int, Any] = {}

    def get_per_device_resource(device: int) -> Any:
        if device not in resources:
            resources[device] = CudaMemoryResource()
        return resources[device]

    def set_per_device_resource(device: int, resource: Any) -> None:
        if not isinstance(resource, DeviceMemoryResource):
            raise TypeError("Argument 'mr' has incorrect type")
        resources[int(device)] = resource

    class DeviceBuffer:
        def __init__(self, *, ptr: int = 0, size: int = 0, stream: Any = default_stream, mr: Any = None) -> None:
            self._c = None
            self.mr = get_per_device_resource(rmm.current_device) if mr is None else mr
            self.stream = stream
            self.size = size
            self.ptr = self.mr.allocate(size, stream) if size else 0
            self._c = True

        def __del__(self) -> None:
            if self._c and self.ptr:
                self.mr.deallocate(self.ptr, self.size, self.stream)

    mr.DeviceMemoryResource = DeviceMemoryResource
    mr.CudaMemoryResource = CudaMemoryResource
    mr.CallbackMemoryResource = CallbackMemoryResource
    mr.get_per_device_resource = get_per_device_resource
    mr.set_per_device_resource = set_per_device_resource
    mr.get_current_device_resource = lambda: get_per_device_resource(rmm.current_device)
    mr.set_current_device_resource = lambda r: set_per_device_resource(rmm.current_device, r)
    rmm.DeviceBuffer = DeviceBuffer
    rmm.Stream = Stream
    rmm.DEFAULT_STREAM = default_stream
    return rmm, mr
