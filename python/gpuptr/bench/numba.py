"""numba ``device_array(1 MiB)`` alloc+free under gpuptr.numba against
numba's default manager and a pure-Python cuda.bindings EMM, each in its
own child process (numba picks its manager once per process)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from gpuptr.bench._bench import Bench, Measured
from gpuptr.bench._child import child_ns, manager_env

#: The pure-Python EMM is a bench fixture, in the checkout's benches/ (not
#: in the wheel).
BENCHES = Path(__file__).resolve().parents[3] / "benches"


def devarray_ns(
    manager: Optional[str], n: int, repeat: int, path: Optional[str] = None, numba: str = "numba"
) -> float:
    """numba ``device_array(1 MiB)`` alloc+free in a child process under
    ``manager`` (a NUMBA_CUDA_MEMORY_MANAGER value; None for numba's own),
    with ``path`` first on its PYTHONPATH; ``numba`` is the package ``cuda``
    comes from (``"numba"`` or ``"numba_cuda_mlir"``)."""
    return child_ns("devarray", numba, n, repeat, env=manager_env(manager, path))


def rows(b: Bench) -> None:
    n_child = 500 if b.quick else 5000
    row = "numba device_array(1 MiB) alloc+free"
    for name, manager in (
        ("numba default manager", None),
        ("pure-Python cuda.bindings EMM", "pyemm"),
    ):

        def measure(manager: Optional[str] = manager) -> Measured:
            b.need_gpu()
            if manager == "pyemm" and not (BENCHES / "pyemm.py").is_file():
                raise RuntimeError("needs benches/pyemm.py from gpuptr's source tree")
            ours = devarray_ns("gpuptr.numba", n_child, b.repeat)
            theirs = devarray_ns(manager, n_child, b.repeat, str(BENCHES))
            return Measured(ours, theirs)

        b.measure(row, name, measure, say=f"numba device_array(1 MiB) under gpuptr vs {name}")
