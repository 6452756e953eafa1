"""Pinned host memory: CuPy's ``alloc_pinned_memory`` under gpuptr
against CuPy's own pinned pool (each in its own process, alternating
rounds), ``gpuptr.alloc_host`` against raw ``cuMemHostAlloc`` +
``cuMemFreeHost``, and the probe of what a pinned pair cost before the
host cache: the old path timed raw in a fresh process, with alloc alone,
free alone, portable or not, a free while the device is busy, and the
context's retain and release when nothing else holds it."""

from __future__ import annotations

from functools import partial
from typing import Callable

from gpuptr.bench._bench import Bench, Measured, Pair
from gpuptr.bench._child import child_json, child_ns, gpuptr_vs_own


def pinned_ns(lib: str, allocator: str, n: int, repeat: int) -> float:
    """One ``children/pinned_cupy.py`` process: ``cupy.cuda.alloc_pinned_memory(1
    MiB)`` + free, in ns, under ``allocator`` (``"gpuptr"``: installed;
    ``"own"``: CuPy's pinned pool)."""
    return child_ns("pinned_cupy", lib, allocator, n, repeat)


def rows(b: Bench) -> None:
    n = 2000 if b.quick else 20000
    b.measure("cupy alloc_pinned_memory(1 MiB)+free, gpuptr", "CuPy's own pinned pool",
              partial(gpuptr_vs_own, b, "cupy", 2 if b.quick else 3, n, pinned_ns), labels=("pinned",))

    def raw_setup(portable: bool) -> Callable[[], Pair]:
        def setup() -> Pair:
            b.need_gpu()
            import gpuptr
            from cuda.bindings import driver as cu

            ctx = gpuptr.context(0)
            ctx.push()  # gpuptr's context (the primary one) is current for the raw calls
            flags = cu.CU_MEMHOSTALLOC_PORTABLE if portable else 0

            def theirs() -> None:
                _, p = cu.cuMemHostAlloc(1 << 20, flags)
                cu.cuMemFreeHost(p)

            def ours() -> None:
                gpuptr.alloc_host(1 << 20, portable=portable).free()

            setup.keep = ctx  # type: ignore[attr-defined]  # held for the row
            return ours, theirs

        return setup

    b.row("gpuptr.alloc_host(1 MiB)+free (pinned)", "cuMemHostAlloc+cuMemFreeHost (cuda.bindings)",
          raw_setup(False), scale=0.1)
    b.row("gpuptr.alloc_host(1 MiB, portable=True)+free (pinned)",
          "cuMemHostAlloc(PORTABLE)+cuMemFreeHost (cuda.bindings)", raw_setup(True), scale=0.1)

    def probe() -> Measured:
        b.need_gpu()
        __import__("cuda.bindings.driver")
        old = child_json("pinned_probe", 20 if b.quick else 100)
        ours = child_json("pinned_gpuptr")
        return Measured(ours["pair_ns"], old["old_pair_ns"], extra={"probe": old, "gpuptr": ours})

    b.measure("pinned probe: gpuptr pair in a fresh process", "the old path: retain+alloc+free+release", probe)
