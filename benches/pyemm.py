"""A minimal pure-Python numba EMM plugin over cuda.bindings, as a baseline
for ``gpuptr bench``: device memory from the driver's stream-ordered pool
(``cuMemAllocAsync``/``cuMemFreeAsync`` on the default stream), everything
else from numba's host-only manager. Not for use outside benchmarks."""

from __future__ import annotations

from cuda.bindings import driver as cu
from numba.cuda import HostOnlyCUDAMemoryManager, MemoryInfo, MemoryPointer
from numba.cuda.cudadrv.driver import GetIpcHandleMixin

_STREAM = cu.CUstream(0)


def _check(err):
    if err != cu.CUresult.CUDA_SUCCESS:
        raise MemoryError(f"cuda.bindings call failed: {err}")


class BindingsMemoryManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
    def initialize(self):
        pass

    def memalloc(self, size):
        err, ptr = cu.cuMemAllocAsync(size, _STREAM)
        _check(err)

        def finalizer(ptr=ptr):
            cu.cuMemFreeAsync(ptr, _STREAM)

        return MemoryPointer(self.context, ptr, size, finalizer=finalizer)

    def get_memory_info(self):
        err, free, total = cu.cuMemGetInfo()
        _check(err)
        return MemoryInfo(free=free, total=total)

    @property
    def interface_version(self):
        return 1


_numba_memory_manager = BindingsMemoryManager
