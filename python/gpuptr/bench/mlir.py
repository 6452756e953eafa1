"""The next numba, numba-cuda-mlir: ``device_array(1 MiB)`` under
gpuptr.numba against its default manager (child processes), and its launch
on 8 CuPy arrays (its own launcher reads them) against numba-cuda's
through gpuptr.numba.foreign_args."""

from __future__ import annotations

from gpuptr.bench._bench import Bench, Measured
from gpuptr.bench._child import child_ns
from gpuptr.bench._timing import runs_ns
from gpuptr.bench.launch import launch_setup
from gpuptr.bench.numba import devarray_ns


def rows(b: Bench) -> None:
    def devarray() -> Measured:
        b.need_gpu()
        n_child = 500 if b.quick else 5000
        ours = devarray_ns("gpuptr.numba", n_child, b.repeat, numba="numba_cuda_mlir")
        theirs = devarray_ns(None, n_child, b.repeat, numba="numba_cuda_mlir")
        return Measured(ours, theirs)

    name, label = "numba-cuda-mlir device_array(1 MiB) alloc+free", "numba-cuda-mlir default manager"
    b.measure(name, label, devarray, say=f"{name} under gpuptr vs {label}")

    def launch() -> Measured:
        b.need_gpu()
        n_child = 200 if b.quick else 2000
        mlir = child_ns("mlir_launch", 8, n_child, b.repeat)
        fast, _ = launch_setup(b, "cupy", 8, "direct")()
        ours = min(runs_ns(fast, n_child, b.repeat))
        # Above 1: numba-cuda with foreign_args launches faster than
        # numba-cuda-mlir's launcher does on the same kind of arrays.
        return Measured(ours, mlir)

    b.measure("launch, 8 cupy arg(s) via foreign_args (numba-cuda)", "numba-cuda-mlir's own launcher", launch)
