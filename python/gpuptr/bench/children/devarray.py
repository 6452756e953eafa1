"""numba ``device_array(1 MiB)`` alloc+free: the best ns per pair, under
the memory manager NUMBA_CUDA_MEMORY_MANAGER names (numba's own if unset).

Arguments: the package ``cuda`` comes from (``numba`` for numba-cuda, or
``numba_cuda_mlir``), calls per run, runs."""

import sys

import numpy as np

package, n, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if package == "numba":
    from numba import cuda
elif package == "numba_cuda_mlir":
    from numba_cuda_mlir import cuda
else:
    raise SystemExit(f"devarray.py: no numba package {package!r}")

from gpuptr.bench._timing import best_ns  # noqa: E402  (after numba, as a user's program would)

cuda.current_context()
print(best_ns(lambda: cuda.device_array(1 << 18, dtype=np.float32), n, repeat))
