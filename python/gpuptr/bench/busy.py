"""A busy GPU: numba device_array alloc+free while a kernel runs on a
non-blocking stream (``children/busy.py``), under gpuptr.numba against
numba's default manager and RMM's pool. The speed-up is of the totals;
median, p99 and worst are in ``extra``."""

from __future__ import annotations

from typing import Any, Dict, Optional

from gpuptr.bench._bench import Bench, Measured
from gpuptr.bench._child import child_json, manager_env


def busy_devarray(manager: Optional[str], pairs: int = 300, keep_gc: bool = False, reserve: int = 0) -> Dict[str, Any]:
    """Host-side numba ``device_array(1 MiB)`` alloc+free while a 1.5 s
    kernel runs on a non-blocking CuPy stream, in a child process under
    ``manager`` (None: numba's own): median, p99, worst and total, in ns.
    Python's garbage collector is off while timing (as in ``timeit``)
    unless ``keep_gc``. ``reserve``: bytes of 1 MiB blocks gpuptr's pool
    is filled with first (``gpuptr.reserve``; RMM's pool reserves up front)."""
    return child_json("busy", manager or "", pairs, "gc" if keep_gc else "nogc", reserve, env=manager_env(manager))


def rows(b: Bench) -> None:
    pairs = 300
    row = f"busy GPU: {pairs} device_array(1 MiB) pairs, total"
    ours: Dict[str, Any] = {}  # gpuptr's run, measured once for both rows
    for name, manager in (("numba default manager", None), ("RMM pool (rmm.allocators.numba)", "rmm.allocators.numba")):

        def measure(manager: Optional[str] = manager) -> Measured:
            b.need_gpu()
            if manager:
                __import__(manager.rsplit(".", 2)[0])
            if not ours:
                ours.update(busy_devarray("gpuptr.numba", pairs))
            theirs = busy_devarray(manager, pairs)
            return Measured(ours["total_ns"] / pairs, theirs["total_ns"] / pairs,
                            extra={"gpuptr": ours, "baseline": theirs})

        b.measure(row, name, measure, say=f"{row} under gpuptr vs {name}")
