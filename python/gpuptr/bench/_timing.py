"""The timing primitives: mean ns per call over runs of ``n`` calls, after
a warm-up. Child scripts and ``benches/`` import them from here (or from
``gpuptr.bench``)."""

from __future__ import annotations

import time
from typing import Callable, List, Tuple

__all__ = ["best_ns", "interleaved_runs_ns", "run_ns", "runs_ns"]


def runs_ns(fn: Callable[[], object], n: int, repeat: int) -> List[float]:
    """Mean time per call, in ns, of each of ``repeat`` runs of ``n`` calls
    (after a warm-up)."""
    for _ in range(min(n, 200)):
        fn()
    return [run_ns(fn, n) for _ in range(repeat)]


def run_ns(fn: Callable[[], object], n: int) -> float:
    """Mean time per call, in ns, of one run of ``n`` calls."""
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e9


def interleaved_runs_ns(
    ours: Callable[[], object], theirs: Callable[[], object], n: int, repeat: int
) -> Tuple[List[float], List[float]]:
    """:func:`runs_ns` of two callables, their runs interleaved after a
    warm-up of each: ours, theirs, then theirs, ours, and so on (so a drift
    of the machine, its clock or other load, falls on both sides alike)."""
    for fn in (ours, theirs):
        for _ in range(min(n, 200)):
            fn()
    a: List[float] = []
    b: List[float] = []
    for i in range(repeat):
        if i % 2 == 0:
            a.append(run_ns(ours, n))
            b.append(run_ns(theirs, n))
        else:
            b.append(run_ns(theirs, n))
            a.append(run_ns(ours, n))
    return a, b


def best_ns(fn: Callable[[], object], n: int, repeat: int) -> float:
    """Best mean time per call, in ns, over ``repeat`` runs of ``n`` calls."""
    return min(runs_ns(fn, n, repeat))
