"""Kernel launches on foreign arrays (the numba-cuda #536 complaint): 1
and 8 array arguments, CuPy and torch, through gpuptr.numba.foreign_args
against passing them directly, and against native numba arrays."""

from __future__ import annotations

from typing import Any, Callable, Dict

from gpuptr.bench._bench import Bench, Pair


def launch_kernel(nargs: int, cuda: Any = None) -> Any:
    """A trivial ``@cuda.jit`` kernel of ``nargs`` float32 array arguments,
    from ``cuda`` (default: numba-cuda's ``numba.cuda``)."""
    if cuda is None:
        import numba.cuda

        cuda = numba.cuda
    names = ", ".join(f"a{i}" for i in range(nargs))
    body = " + ".join(f"a{i}[i]" for i in range(nargs))
    src = f"def k({names}):\n    i = cuda.grid(1)\n    if i < a0.size:\n        a0[i] = {body}\n"
    ns: Dict[str, Any] = {"cuda": cuda}
    exec(src, ns)
    return cuda.jit(ns["k"])


def launch_setup(b: Bench, lib: str, nargs: int, against: str) -> Callable[[], Pair]:
    """A launch on ``nargs`` ``lib`` arrays through gpuptr.numba.foreign_args,
    and the same kernel given them directly (``against="direct"``) or on
    native numba arrays (``"native"``)."""

    def setup() -> Pair:
        b.need_gpu()
        import numpy as np
        from numba import cuda

        from gpuptr.numba import foreign_args

        kernel = launch_kernel(nargs)
        if lib == "cupy":
            import cupy as cp

            args = [cp.zeros(1024, dtype=cp.float32) for _ in range(nargs)]
        else:
            import torch

            args = [torch.zeros(1024, dtype=torch.float32, device="cuda") for _ in range(nargs)]
        fast = foreign_args(kernel)[4, 256]
        if against == "direct":
            direct = kernel[4, 256]
            return (lambda: fast(*args)), (lambda: direct(*args))
        native = [cuda.to_device(np.zeros(1024, dtype=np.float32)) for _ in range(nargs)]
        direct = kernel[4, 256]
        return (lambda: fast(*args)), (lambda: direct(*native))

    return setup


def rows(b: Bench) -> None:
    for nargs in (1, 8):
        for lib in ("cupy", "torch"):
            b.row(f"launch, {nargs} {lib} arg(s) via foreign_args", f"{lib} arrays passed directly",
                  launch_setup(b, lib, nargs, "direct"), scale=0.05)
            b.row(f"launch, {nargs} {lib} arg(s) via foreign_args", "native numba arrays",
                  launch_setup(b, lib, nargs, "native"), scale=0.05)
