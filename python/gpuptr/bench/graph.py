"""CUDA graphs: a CuPy capture (three kernels, two temporaries) and ten
replays under gpuptr against CuPy's pool, and a
``torch.compile(mode="reduce-overhead")`` step of a 2-layer MLP under
gpuptr against PyTorch's own allocator; each in its own process
(``children/graph.py``), in alternating rounds, best of each."""

from __future__ import annotations

from functools import partial

from gpuptr.bench._bench import Bench
from gpuptr.bench._child import child_ns, gpuptr_vs_own


def graph_ns(what: str, allocator: str, n: int, repeat: int) -> float:
    """One ``children/graph.py`` process of ``what`` under ``allocator``:
    ns per cycle (the child keeps its best of five; ``repeat`` is unused)."""
    return child_ns("graph", what, allocator, n)


def rows(b: Bench) -> None:
    for what, name, label, n in (
        ("cupy", "CuPy graph capture + 10 replays", "CuPy's own pool", 200 if b.quick else 2000),
        ("torch", "torch.compile reduce-overhead (CUDA graph) MLP step", "torch's own allocator",
         500 if b.quick else 5000),
    ):
        # torch.compile takes tens of seconds per process: two rounds.
        rounds = 2 if b.quick or what == "torch" else 3
        b.measure(name, label, partial(gpuptr_vs_own, b, what, rounds, n, graph_ns),
                  say=f"{name} under gpuptr vs {label}")
