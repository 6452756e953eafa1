"""gpuptr for numba-cuda users.

``as_cuda_array(obj)`` is a drop-in for ``numba.cuda.as_cuda_array``: it
returns a numba ``DeviceNDArray`` whose ``gpu_data`` is a gpuptr
MemoryPointer, holding the real context of the memory (resolved from the
address, not from numba's current context), at a fraction of numba's cost.
``foreign_args(kernel)`` launches a kernel on torch and CuPy arrays through
the same importer and a conversion cache. Both live in ``gpuptr._launch``
and are re-exported here.

This module itself is numba's External Memory Management plugin,
:class:`MemoryManager`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

try:
    from numba.cuda.cudadrv.driver import (
        BaseCUDAMemoryManager,
        CudaAPIError,
        GetIpcHandleMixin,
        MemoryInfo,
    )
except ImportError as _e:  # numba-cuda (or what it needs) is missing
    raise ImportError(
        f'gpuptr.numba needs numba-cuda: pip install "gpuptr[numba]" ({_e})', name=_e.name
    ) from _e

import gpuptr as _gpuptr
from gpuptr import _core
from gpuptr._launch import (
    ArgCache,
    Launcher,
    as_cuda_array,
    foreign_args,
    from_cuda_array_interface_numba,
)

__all__ = [
    "ArgCache",
    "Launcher",
    "MemoryManager",
    "OutOfMemoryError",
    "as_cuda_array",
    "foreign_args",
    "from_cuda_array_interface_numba",
]


class OutOfMemoryError(CudaAPIError, _gpuptr.OutOfMemoryError):  # type: ignore[misc]  # numba ships no types
    """Out of device memory, as numba's own manager reports it: a numba
    ``CudaAPIError`` with ``code`` 2 (``CUDA_ERROR_OUT_OF_MEMORY``), and
    also gpuptr's :class:`~gpuptr.OutOfMemoryError` (a ``MemoryError``).
    Raised after gpuptr has waited for its fence and returned its cache;
    the message says what the pool held."""

    def __init__(self, message: str) -> None:
        CudaAPIError.__init__(self, 2, message)
        # CudaAPIError's super().__init__(code, msg) reaches gpuptr's
        # __init__(message, code) along the MRO: set both sides' fields.
        self.code, self.msg, self.name = 2, message, "CUDA_ERROR_OUT_OF_MEMORY"
        self.args = (2, message)

    def __str__(self) -> str:
        return f"[2] {self.msg}"

    def __reduce__(self) -> Any:
        # Pickled across processes (Dask workers) as what __init__ takes.
        return (type(self), (self.msg,))


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
        """Device memory from gpuptr's pool; :class:`OutOfMemoryError` (a
        numba ``CudaAPIError``) when none is left."""
        try:
            return _core._alloc_for("numba", size, device=self._dev())
        except _gpuptr.OutOfMemoryError as e:
            raise OutOfMemoryError(str(e)) from None

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
