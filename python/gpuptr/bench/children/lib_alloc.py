"""``cp.empty(1 MiB)`` (library ``cupy``), ``torch.empty(1 MiB)``
(``torch``) or ``rmm.DeviceBuffer(size=1 MiB)`` (``rmm``) alloc+free: the
best ns per pair under one allocator.

Arguments: the library, the allocator (``own``: the library's pool;
``gpuptr``; ``gpuptr-ordered``: gpuptr with ``stream_ordered=True``;
``rmm``: RMM's pool, through its allocator for that library; for library
``rmm``, ``gpuptr`` is ``gpuptr.rmm.install()``, its resource on RMM, and
``rmm`` RMM's own pool resource), calls per run, runs."""

import sys
from gpuptr.bench._timing import best_ns

lib, allocator, n, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if allocator == "rmm":
    import rmm

    rmm.reinitialize(pool_allocator=True)
if lib == "rmm":
    import rmm

    if allocator.startswith("gpuptr"):
        import gpuptr.rmm

        gpuptr.rmm.install()
        assert gpuptr.rmm.installed()
    elif allocator != "rmm":
        raise SystemExit(f"lib_alloc.py: RMM has no allocator {allocator!r}")

    def pair() -> object:
        return rmm.DeviceBuffer(size=1 << 20)

elif lib == "cupy":
    import cupy as cp

    if allocator.startswith("gpuptr"):
        import gpuptr.cupy

        gpuptr.cupy.install(stream_ordered=allocator == "gpuptr-ordered")
    elif allocator == "rmm":
        from rmm.allocators.cupy import rmm_cupy_allocator

        cp.cuda.set_allocator(rmm_cupy_allocator)

    def pair() -> object:
        return cp.empty(1 << 20, dtype=cp.uint8)

else:
    import torch

    if allocator.startswith("gpuptr"):
        import gpuptr.torch

        gpuptr.torch.install(stream_ordered=allocator == "gpuptr-ordered")
    elif allocator == "rmm":
        from rmm.allocators.torch import rmm_torch_allocator

        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)

    def pair() -> object:
        return torch.empty(1 << 20, dtype=torch.uint8, device="cuda")


print(best_ns(pair, n, repeat))
