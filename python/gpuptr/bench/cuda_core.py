"""cuda.core: ``mr.allocate(1 MiB)`` + close through gpuptr.cuda_core
against cuda.core's own resources (device memory over the driver's pool,
and pinned host memory), and against cuda.core's floors: what a buffer
costs in cuda.core itself when nothing is allocated."""

from __future__ import annotations

from typing import Any, Callable

from gpuptr.bench._bench import Bench, Pair


def callback_floor() -> Any:
    """What any Python MemoryResource pays in cuda.core when its buffers
    free through it (Buffer.from_handle(mr=), then cuda.core's callback
    into mr.deallocate): a resource handing out one fixed address, whose
    deallocate does nothing. The bench and benches/cuda_core_why.py share
    it."""
    import gpuptr
    from cuda.core import Buffer, MemoryResource as Base

    class Nothing(Base):  # type: ignore[misc]
        fixed = gpuptr.alloc(1 << 20)
        is_device_accessible, is_host_accessible, is_managed, device_id = True, False, False, 0

        def allocate(self, size: int, *, stream: Any = None) -> Any:
            return Buffer.from_handle(self.fixed.device_pointer_value, size, mr=self, stream=stream)

        def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
            pass

    return Nothing()


def owning_floor() -> Any:
    """cuda.core's own part of a buffer that owns its memory, as gpuptr's
    do: a resource making the same Buffer subclass over one fixed address
    with a plain object as its owner, so nothing is allocated or freed."""
    import gpuptr
    from gpuptr.cuda_core import MemoryResource

    fixed, owner = gpuptr.alloc(1 << 20), object()
    make = MemoryResource(0)._make

    class Floor:
        def allocate(self, size: int, *, stream: Any = None) -> Any:
            return make(fixed.device_pointer_value, size, None, None, owner)

    return Floor()


def rows(b: Bench) -> None:
    def against(baseline: Callable[[], Any], ours: str = "MemoryResource") -> Callable[[], Pair]:
        # gpuptr's resource ``ours`` and ``baseline()``, each allocating and
        # closing 1 MiB buffers on one stream.
        def setup() -> Pair:
            b.need_gpu()
            from cuda.core import Device

            from gpuptr import cuda_core

            dev = Device(0)
            dev.set_current()
            stream = dev.create_stream()
            ours_mr, theirs_mr = getattr(cuda_core, ours)(0), baseline()
            return (lambda: ours_mr.allocate(1 << 20, stream=stream).close(),
                    lambda: theirs_mr.allocate(1 << 20, stream=stream).close())

        return setup

    def device_memory_resource() -> Any:
        from cuda.core import DeviceMemoryResource

        return DeviceMemoryResource(0)

    def pinned() -> Any:
        from cuda.core import PinnedMemoryResource

        return PinnedMemoryResource()

    b.row("cuda.core mr.allocate+close 1 MiB, gpuptr.cuda_core", "cuda.core DeviceMemoryResource",
          against(device_memory_resource), scale=0.5)
    b.row("cuda.core mr.allocate+close 1 MiB, gpuptr.cuda_core",
          "cuda.core's floor for an owning Buffer: one that owns a plain object", against(owning_floor), scale=0.5)
    b.row("cuda.core mr.allocate+close 1 MiB, gpuptr.cuda_core",
          "cuda.core's floor for a resource's Buffer: a Python resource that frees nothing",
          against(callback_floor), scale=0.5)
    b.row("cuda.core pinned mr.allocate+close 1 MiB, gpuptr.cuda_core", "cuda.core PinnedMemoryResource",
          against(pinned, "PinnedMemoryResource"), scale=0.5)
