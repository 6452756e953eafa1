"""A CUDA Array Interface exporter to a numba array: gpuptr's
``as_cuda_array`` against numba's."""

from __future__ import annotations

from typing import Callable

from gpuptr.bench._bench import Bench, Pair
from gpuptr.bench.context import cupy_array


def rows(b: Bench) -> None:
    def cai_setup(sync: bool) -> Callable[[], Pair]:
        def setup() -> Pair:
            b.need_gpu()
            from numba import cuda

            from gpuptr.numba import as_cuda_array

            arr = cupy_array()
            return (lambda: as_cuda_array(arr, sync=sync)), (lambda: cuda.as_cuda_array(arr, sync=sync))

        return setup

    b.row("CAI object -> numba array", "numba.cuda.as_cuda_array", cai_setup(True), scale=0.25)
    b.row("CAI object -> numba array, sync=False", "numba.cuda.as_cuda_array(sync=False)", cai_setup(False), scale=0.25)
