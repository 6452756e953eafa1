"""alloc+free 1 MiB: gpuptr's pool against CuPy's pool, the driver's
stream-ordered allocator and cuda.core's memory resource."""

from __future__ import annotations

from typing import Callable

from gpuptr.bench._bench import Bench, Pair


def alloc_pair() -> Callable[[], None]:
    """gpuptr's side of the allocation rows: ``gpuptr.alloc`` + free, 1 MiB."""
    import gpuptr

    def pair() -> None:
        gpuptr.alloc(1 << 20).free()

    return pair


def rows(b: Bench) -> None:
    ours = alloc_pair()

    def cupy_setup() -> Pair:
        b.need_gpu()
        import cupy

        return ours, (lambda: cupy.cuda.alloc(1 << 20))

    def async_setup() -> Pair:
        b.need_gpu()
        from cuda.bindings import driver as cu

        s = cu.CUstream(0)

        def pair() -> None:
            _, d = cu.cuMemAllocAsync(1 << 20, s)
            cu.cuMemFreeAsync(d, s)

        return ours, pair

    def core_setup() -> Pair:
        b.need_gpu()
        from cuda.core import Device

        dev = Device(0)
        dev.set_current()
        mr = dev.memory_resource
        stream = dev.default_stream

        def pair() -> None:
            buf = mr.allocate(1 << 20, stream=stream)
            buf.close(stream)

        return ours, pair

    b.row("alloc+free 1 MiB", "cupy.cuda.alloc (CuPy pool)", cupy_setup, scale=0.5)
    b.row("alloc+free 1 MiB", "cuMemAllocAsync+FreeAsync (cuda.bindings)", async_setup, scale=0.5)
    b.row("alloc+free 1 MiB", "cuda.core DeviceMemoryResource", core_setup, scale=0.5)
