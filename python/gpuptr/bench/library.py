"""CuPy's and PyTorch's allocation through gpuptr against their own pools
and RMM's, and RMM's own (``rmm.DeviceBuffer``) on gpuptr's pool against
RMM's pool, each in its own process. Processes differ, so each allocator
runs in alternating rounds and keeps its best."""

from __future__ import annotations

from functools import partial

from gpuptr.bench._bench import Bench
from gpuptr.bench._child import best_of_rounds, child_ns, gpuptr_vs_own, pick


def library_alloc_ns(lib: str, allocator: str, n: int, repeat: int) -> float:
    """``cp.empty(1 MiB)`` (``lib="cupy"``), ``torch.empty(1 MiB)``
    (``"torch"``) or ``rmm.DeviceBuffer(size=1 MiB)`` (``"rmm"``)
    alloc+free, in ns, in a child process whose allocator is
    ``allocator``: ``"own"`` (the library's pool), ``"gpuptr"``,
    ``"gpuptr-ordered"`` (``stream_ordered=True``) or ``"rmm"`` (RMM's pool
    through its allocator for that library; for ``"rmm"`` itself, RMM's
    pool resource, against ``"gpuptr"``: ``gpuptr.rmm.install()``)."""
    return child_ns("lib_alloc", lib, allocator, n, repeat)


def torch_stats_ns(lib: str, allocator: str, n: int, repeat: int) -> float:
    """``torch.cuda.memory_allocated()``, in ns, in a child process whose
    PyTorch allocator is ``allocator`` (``"own"`` or ``"gpuptr"``), with
    eight tensors live (``lib`` is ``"torch"``)."""
    return child_ns("torch_stats", allocator, n, repeat)


def rows(b: Bench) -> None:
    n_lib = 2000 if b.quick else 20000
    rounds = 2 if b.quick else 3
    for lib, what in (("cupy", "cp.empty(1 MiB)+free"), ("torch", "torch.empty(1 MiB, cuda)+free")):
        rows = [
            (f"{what}, gpuptr", "gpuptr", "own", f"{lib}'s own pool"),
            (f"{what}, gpuptr", "gpuptr", "rmm", f"RMM pool (rmm.allocators.{lib})"),
            (f"{what}, gpuptr stream_ordered", "gpuptr-ordered", "own", f"{lib}'s own pool"),
        ]
        rows = [r for r in rows if b.wants(r[0], r[3])]
        if not rows:
            continue
        b.say(f"{what} under gpuptr, {lib}'s own pool and RMM")
        allocators = sorted({r[1] for r in rows} | {r[2] for r in rows})
        best, failed = best_of_rounds(lib, allocators, rounds, n_lib, b.repeat, b.on_gpu, library_alloc_ns)
        for row, mine, peer, label in rows:
            b.record(row, label, partial(pick, best, failed, mine, peer))
    # RMM's own allocation (cuDF's columns are DeviceBuffers): gpuptr's
    # resource on RMM, called back with the GIL per allocation and free,
    # against RMM's pool resource, a C++ call.
    row, label = "rmm.DeviceBuffer(1 MiB)+free, gpuptr.rmm", "RMM pool (rmm.reinitialize(pool_allocator=True))"
    if b.wants(row, label):
        b.say("rmm.DeviceBuffer(1 MiB)+free under gpuptr.rmm and RMM's own pool")
        best, failed = best_of_rounds("rmm", ["gpuptr", "rmm"], rounds, n_lib, b.repeat, b.on_gpu, library_alloc_ns)
        b.record(row, label, partial(pick, best, failed, "gpuptr", "rmm"))
    # torch.cuda.memory_allocated() itself: under gpuptr it reads PyTorch's
    # counts in gpuptr's hooks and the pool's segments; both build the whole
    # memory_stats() dict and flatten it in Python.
    row, label = "torch.cuda.memory_allocated()", "torch's own allocator"
    if b.wants(row, label):
        b.say(f"{row} under gpuptr and torch's own allocator")
        n = 500 if b.quick else 5000
        b.record(row, label, partial(gpuptr_vs_own, b, "torch", 2 if b.quick else 3, n, torch_stats_ns))
