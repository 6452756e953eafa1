"""A numba-cuda-mlir launch of a trivial kernel on CuPy arrays (its own
launcher reads them): the best ns per launch.

Arguments: array arguments, launches per run, runs."""

import sys
from typing import Any

import cupy as cp
import numba_cuda_mlir.cuda

from gpuptr.bench._timing import best_ns
from gpuptr.bench.launch import launch_kernel

# (Any: mypy, which reads none of numba-cuda-mlir, sees a module without
# synchronize.)
cuda: Any = numba_cuda_mlir.cuda
nargs, n, repeat = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
kernel = launch_kernel(nargs, cuda)[4, 256]
args = [cp.zeros(1024, dtype=cp.float32) for _ in range(nargs)]
kernel(*args)
cuda.synchronize()
print(best_ns(lambda: kernel(*args), n, repeat))
