"""The bench's run: every row group of :data:`GROUPS`, in order."""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any, Callable, Dict, Optional, TextIO

from gpuptr.bench._bench import Bench

#: The row groups, in the order their rows run and print: modules of this
#: package, each with a ``rows(b: Bench) -> None``.
GROUPS = (
    "context",
    "cai",
    "observability",
    "alloc",
    "launch",
    "numba",
    "library",
    "busy",
    "graph",
    "cuda_core",
    "mlir",
    "pinned",
    "ipc",
    "footprint",
    "workloads",
)


def run(quick: bool = False, out: TextIO = sys.stderr, only: Optional[str] = None) -> Dict[str, Any]:
    """Run every row (or those whose name or baseline contains ``only``,
    ignoring case); returns ``{"meta": ..., "rows": [...]}``."""
    import gpuptr
    from gpuptr.bench.report import meta

    info = gpuptr.driver_info()
    b = Bench(quick, out, only, on_gpu=info["driver"] == "cuda")
    print(f"gpuptr bench on {info['driver']} ({'quick' if quick else 'full'})", file=out, flush=True)

    # Held for the whole run: the context rows look up addresses inside it.
    mem = gpuptr.alloc(1 << 22)
    addr = mem.device_pointer_value
    assert addr is not None
    b.addr = addr

    for group in GROUPS:
        rows: Callable[[Bench], None] = import_module(f"gpuptr.bench.{group}").rows
        rows(b)
    return {"meta": meta(info, quick), "rows": [r.__dict__ for r in b.results]}

