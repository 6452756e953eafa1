"""CuPy's ``alloc_pinned_memory(1 MiB)`` + free: the best ns per pair,
under gpuptr (``gpuptr``: installed) or CuPy's pinned pool (``own``).
Nothing else holds the device's context here, as in a script that only
stages host data: the pair is the whole program's use of the GPU.

Arguments: ``cupy``, the allocator, calls per run, runs."""

import sys

from gpuptr.bench._timing import best_ns

lib, allocator, n, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import cupy  # noqa: E402

if allocator == "gpuptr":
    import gpuptr

    gpuptr.install(numba=False, torch=False)
print(best_ns(lambda: cupy.cuda.alloc_pinned_memory(1 << 20), n, repeat))
