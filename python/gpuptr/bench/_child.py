"""Rows measured in child processes: a script of ``children/`` run with
arguments, and the number (or JSON) its last line prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import resources
from typing import Any, Callable, Dict, List, Optional, Tuple

from gpuptr.bench._bench import Bench, Measured, Skipped

__all__ = ["best_of_rounds", "child_json", "child_ns", "child_out", "gpuptr_vs_own", "manager_env", "pick"]


def child_out(script: str, *args: object, env: Optional[Dict[str, str]] = None) -> str:
    """Run ``children/<script>.py`` in a child process with ``args`` (and
    ``env``, default: this one's); its last line of output.
    ``RuntimeError`` with its last error line if it fails."""
    source = resources.files("gpuptr.bench.children").joinpath(f"{script}.py")
    with resources.as_file(source) as path:
        # -P: the script's folder does not go first on the child's sys.path.
        out = subprocess.run(
            [sys.executable, "-P", str(path), *map(str, args)], env=env, capture_output=True, text=True, timeout=600
        )
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "child failed")
    if not out.stdout.strip():
        raise RuntimeError(f"the child {script}.py printed nothing")
    return out.stdout.strip().splitlines()[-1]


def child_ns(script: str, *args: object, env: Optional[Dict[str, str]] = None) -> float:
    """:func:`child_out` for a script whose last line is a number of ns."""
    return float(child_out(script, *args, env=env))


def child_json(script: str, *args: object, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """:func:`child_out` for a script whose last line is a JSON object."""
    row: Dict[str, Any] = json.loads(child_out(script, *args, env=env))
    return row


def manager_env(manager: Optional[str], path: Optional[str] = None) -> Dict[str, str]:
    """This process's environment for a child under numba memory manager
    ``manager`` (a NUMBA_CUDA_MEMORY_MANAGER value; None for numba's own),
    with ``path`` first on its PYTHONPATH."""
    env = dict(os.environ)
    env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
    if manager:
        env["NUMBA_CUDA_MEMORY_MANAGER"] = manager
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    return env


def best_of_rounds(
    lib: str,
    allocators: List[str],
    rounds: int,
    n: int,
    repeat: int,
    on_gpu: bool,
    measure: Callable[[str, str, int, int], float],
) -> Tuple[Dict[str, float], Dict[str, str]]:
    """``measure(lib, allocator, n, repeat)`` (one child process) of ``lib``
    under each of ``allocators``, in ``rounds`` alternating rounds (child
    processes differ: one measured CuPy's own pool at 2.2 and 3.7 us in one
    run): the best ns of each, and why each that failed did (a failed one
    is not tried again)."""
    best: Dict[str, float] = {}
    failed: Dict[str, str] = {}
    for _ in range(rounds):
        for allocator in allocators:
            if allocator in failed:
                continue
            try:
                if not on_gpu:
                    raise RuntimeError("needs the GPU")
                __import__("rmm" if allocator == "rmm" else lib)
                ns = measure(lib, allocator, n, repeat)
                best[allocator] = min(best.get(allocator, ns), ns)
            except Exception as e:
                failed[allocator] = f"{type(e).__name__}: {e}"
    return best, failed


def pick(best: Dict[str, float], failed: Dict[str, str], mine: str, peer: str) -> Measured:
    """From :func:`best_of_rounds`: the row of ``mine`` against ``peer``;
    ``Skipped`` with why one failed if either did."""
    if mine in best and peer in best:
        return Measured(best[mine], best[peer])
    raise Skipped(failed.get(mine) or failed.get(peer) or "not measured")


def gpuptr_vs_own(
    b: Bench, lib: str, rounds: int, n: int, measure: Callable[[str, str, int, int], float]
) -> Measured:
    """A row of ``lib`` under gpuptr (``"gpuptr"``) against its own
    allocator (``"own"``), each measured by ``measure`` in ``rounds``
    alternating rounds of child processes."""
    best, failed = best_of_rounds(lib, ["gpuptr", "own"], rounds, n, b.repeat, b.on_gpu, measure)
    return pick(best, failed, "gpuptr", "own")
