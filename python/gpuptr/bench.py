"""``python -m gpuptr bench``: gpuptr against what users would otherwise
use, measured side by side in one run on the same GPU.

Each row times a gpuptr operation and a named baseline (best of N runs
after a warm-up, the two sides' runs interleaved) and reports the ratio
``baseline / gpuptr`` (above 1: gpuptr is faster). A baseline whose library is missing is reported as skipped. Rows
about numba's memory manager run in child processes, because numba picks
its manager once per process. Results print as a table and go to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

if TYPE_CHECKING:
    from gpuptr._types import DriverInfo

#: A row's two timed callables: gpuptr's and the baseline's.
Pair = Tuple[Callable[[], object], Callable[[], object]]

__all__ = ["run", "main"]


_NULL_HANDLER = __import__("logging").NullHandler()


def runs_ns(fn: Callable[[], object], n: int, repeat: int) -> List[float]:
    """Mean time per call, in ns, of each of ``repeat`` runs of ``n`` calls
    (after a warm-up)."""
    for _ in range(min(n, 200)):
        fn()
    return [_run_ns(fn, n) for _ in range(repeat)]


def _run_ns(fn: Callable[[], object], n: int) -> float:
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
            a.append(_run_ns(ours, n))
            b.append(_run_ns(theirs, n))
        else:
            b.append(_run_ns(theirs, n))
            a.append(_run_ns(ours, n))
    return a, b


def best_ns(fn: Callable[[], object], n: int, repeat: int) -> float:
    """Best mean time per call, in ns, over ``repeat`` runs of ``n`` calls."""
    return min(runs_ns(fn, n, repeat))


@dataclass
class Result:
    row: str
    baseline: str
    gpuptr_ns: Optional[float] = None
    baseline_ns: Optional[float] = None
    ratio: Optional[float] = None
    skipped: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    #: Each run's mean ns per call (the best is ``gpuptr_ns``/``baseline_ns``).
    gpuptr_runs: List[float] = field(default_factory=list)
    baseline_runs: List[float] = field(default_factory=list)


class Bench:
    def __init__(self, quick: bool, out: TextIO = sys.stderr, only: Optional[str] = None) -> None:
        self.n = 2000 if quick else 20000
        self.repeat = 3 if quick else 7
        self.results: list[Result] = []
        self.out = out
        self.only = only.lower() if only else None

    def wants(self, *labels: str) -> bool:
        """Whether a row with these labels runs (``--only`` matches one)."""
        return self.only is None or any(self.only in label.lower() for label in labels)

    def row(self, name: str, baseline: str, setup: Callable[[], Pair], scale: float = 1.0) -> None:
        """``setup()`` returns ``(ours, theirs)`` callables, or raises
        ImportError/RuntimeError to skip the row."""
        if not self.wants(name, baseline):
            return
        print(f"  measuring: {name} vs {baseline} ...", file=self.out, flush=True)
        try:
            ours, theirs = setup()
        except Exception as e:  # a missing peer or an unusable one
            self.results.append(Result(name, baseline, skipped=f"{type(e).__name__}: {e}"))
            return
        n = max(10, int(self.n * scale))
        a_runs, b_runs = interleaved_runs_ns(ours, theirs, n, self.repeat)
        a, b = min(a_runs), min(b_runs)
        self.results.append(
            Result(
                name,
                baseline,
                round(a, 1),
                round(b, 1),
                round(b / a, 2),
                gpuptr_runs=[round(x, 1) for x in a_runs],
                baseline_runs=[round(x, 1) for x in b_runs],
            )
        )

    def add(self, result: Result) -> None:
        self.results.append(result)


def _devarray_ns(
    manager: Optional[str], n: int, repeat: int, path: Optional[str] = None, numba: str = "numba"
) -> float:
    """numba ``device_array(1 MiB)`` alloc+free in a child process under
    ``manager`` (a NUMBA_CUDA_MEMORY_MANAGER value; None for numba's own),
    with ``path`` first on its PYTHONPATH; ``numba`` is the package ``cuda``
    comes from (``"numba"`` or ``"numba_cuda_mlir"``)."""
    code = (
        "import sys, numpy as np\n"
        f"from {numba} import cuda\n"
        "from gpuptr.bench import best_ns\n"
        "cuda.current_context()\n"
        f"ns = best_ns(lambda: cuda.device_array(1 << 18, dtype=np.float32), {n}, {repeat})\n"
        "print(ns)\n"
    )
    env = dict(os.environ)
    env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
    if manager:
        env["NUMBA_CUDA_MEMORY_MANAGER"] = manager
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "child failed")
    return float(out.stdout.strip().splitlines()[-1])


_LIB_CHILD = r"""
import sys
lib, allocator, n, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from gpuptr.bench import best_ns
if allocator == "rmm":
    import rmm
    rmm.reinitialize(pool_allocator=True)
if lib == "cupy":
    import cupy as cp
    if allocator.startswith("gpuptr"):
        import gpuptr.cupy
        gpuptr.cupy.install(stream_ordered=allocator == "gpuptr-ordered")
    elif allocator == "rmm":
        from rmm.allocators.cupy import rmm_cupy_allocator
        cp.cuda.set_allocator(rmm_cupy_allocator)
    pair = lambda: cp.empty(1 << 20, dtype=cp.uint8)
else:
    import torch
    if allocator.startswith("gpuptr"):
        import gpuptr.torch
        gpuptr.torch.install(stream_ordered=allocator == "gpuptr-ordered")
    elif allocator == "rmm":
        from rmm.allocators.torch import rmm_torch_allocator
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    pair = lambda: torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
print(best_ns(pair, n, repeat))
"""


def _launch_kernel(nargs: int, cuda: Any = None) -> Any:
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


def library_alloc_ns(lib: str, allocator: str, n: int, repeat: int) -> float:
    """``cp.empty(1 MiB)`` (``lib="cupy"``) or ``torch.empty(1 MiB)``
    (``"torch"``) alloc+free, in ns, in a child process whose allocator is
    ``allocator``: ``"own"`` (the library's pool), ``"gpuptr"``,
    ``"gpuptr-ordered"`` (``stream_ordered=True``) or ``"rmm"`` (RMM's pool
    through its allocator for that library)."""
    return _child_ns(_LIB_CHILD, lib, allocator, n, repeat)


def _child_ns(script: str, *args: object) -> float:
    """Run ``script`` in a child process with ``args``; the number its last
    line prints. ``RuntimeError`` with its last error line if it fails."""
    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "child failed")
    return float(out.stdout.strip().splitlines()[-1])


_BUSY_CHILD = r"""
import json, sys, time, statistics
import numpy as np
import gc
manager, pairs, keep_gc, reserve = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "gc", int(sys.argv[4])
if manager == "rmm.allocators.numba":
    import rmm
    rmm.reinitialize(pool_allocator=True)
from numba import cuda
import cupy as cp

@cuda.jit
def spin(a, ms):
    for _ in range(ms):
        cuda.nanosleep(1000000)
    a[0] = 1

cs = cp.cuda.Stream(non_blocking=True)  # kept alive: its handle must stay valid
s = cuda.external_stream(cs.ptr)
flag = cuda.device_array(1, np.int32)
for _ in range(20):  # warm up, on an idle GPU
    cuda.device_array(1 << 20, np.uint8)
if reserve:  # gpuptr's pool filled ahead of demand, as RMM's pool is
    import gpuptr
    gpuptr.reserve(reserve, 1 << 20)
cuda.synchronize()
spin[1, 1, s](flag, 1500)
times = []
if not keep_gc:
    gc.collect()
    gc.disable()  # as timeit does: a collection's pause is not the allocator's
t0 = time.perf_counter()
for _ in range(pairs):
    t = time.perf_counter()
    a = cuda.device_array(1 << 20, np.uint8)
    del a
    times.append(time.perf_counter() - t)
total = time.perf_counter() - t0
gc.enable()
busy = not cs.done  # the kernel outlasted the loop
s.synchronize()
slowest = sorted(range(pairs), key=times.__getitem__)[-5:][::-1]
slowest_us = [round(times[i] * 1e6, 1) for i in slowest]
first_us = [round(t * 1e6, 1) for t in times[:12]]
after_first = max(times[1:]) * 1e9
times.sort()
pool = {}
if manager == "gpuptr.numba":
    import gpuptr
    st = gpuptr.stats()[0]
    pool = {k: st.get(k) for k in ("pool_hits", "pool_misses", "fences", "pool_bytes")}
print(json.dumps({"pool": pool, "median_ns": statistics.median(times) * 1e9, "p99_ns": times[int(0.99 * len(times))] * 1e9,
                  "worst_ns": times[-1] * 1e9, "total_ns": total * 1e9, "busy": busy, "gc": keep_gc,
                  "slowest_pairs": slowest, "slowest_us": slowest_us, "worst_after_first_ns": after_first,
                  "first_us": first_us}))
"""


def busy_devarray(manager: Optional[str], pairs: int = 300, keep_gc: bool = False, reserve: int = 0) -> Dict[str, Any]:
    """Host-side numba ``device_array(1 MiB)`` alloc+free while a 1.5 s
    kernel runs on a non-blocking CuPy stream, in a child process under
    ``manager`` (None: numba's own): median, p99, worst and total, in ns.
    Python's garbage collector is off while timing (as in ``timeit``)
    unless ``keep_gc``. ``reserve``: bytes of 1 MiB blocks gpuptr's pool
    is filled with first (``gpuptr.reserve``; RMM's pool reserves up front)."""
    env = dict(os.environ)
    env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
    if manager:
        env["NUMBA_CUDA_MEMORY_MANAGER"] = manager
    out = subprocess.run([sys.executable, "-c", _BUSY_CHILD, manager or "", str(pairs), "gc" if keep_gc else "nogc", str(reserve)], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "child failed")
    row: Dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def run(quick: bool = False, out: TextIO = sys.stderr, only: Optional[str] = None) -> Dict[str, Any]:
    """Run every row (or those whose name or baseline contains ``only``,
    ignoring case); returns ``{"meta": ..., "rows": [...]}``."""
    import gpuptr

    b = Bench(quick, out, only)
    info = gpuptr.driver_info()
    on_gpu = info["driver"] == "cuda"
    print(f"gpuptr bench on {info['driver']} ({'quick' if quick else 'full'})", file=out, flush=True)

    # Held for the whole run: the context rows look up addresses inside it.
    mem = gpuptr.alloc(1 << 22)
    addr = mem.device_pointer_value
    assert addr is not None

    _context_rows(b, on_gpu, addr)
    _cai_rows(b, on_gpu)
    _observability_rows(b)
    _alloc_rows(b, on_gpu)
    _launch_rows(b, on_gpu)
    _numba_manager_rows(b, on_gpu, quick)
    _library_rows(b, on_gpu, quick)
    _torch_stats_rows(b, on_gpu, quick)
    _busy_rows(b, on_gpu)
    _graph_rows(b, on_gpu, quick)
    _next_numba_rows(b, on_gpu, quick)
    _pinned_rows(b, on_gpu, quick)
    _ipc_rows(b)
    return {"meta": _meta(info, quick), "rows": [r.__dict__ for r in b.results]}


def _cupy_array() -> Any:
    """A CuPy array of 1 Mi float32 zeros (the peer rows' foreign array)."""
    import cupy

    return cupy.zeros(1 << 20, dtype=cupy.float32)


def _context_rows(b: Bench, on_gpu: bool, addr: int) -> None:
    """The context of an address (``addr``, inside gpuptr memory): the
    registry against the driver query, and ``wrap`` against numba's
    MemoryPointer."""
    import gpuptr
    from gpuptr import _testing

    # Rows that need only gpuptr: the registry against the driver query.
    b.row(
        "context of an address: registry hit",
        "driver query (cuPointerGetAttributes)",
        lambda: (lambda: gpuptr.context_of(addr + 64), lambda: _testing.query_context(addr + 64)),
    )

    def wrap_setup(known: bool) -> Callable[[], Pair]:
        def setup() -> Pair:
            if not on_gpu:
                raise RuntimeError("needs the GPU")
            from cuda.bindings import driver as cu
            from numba import cuda
            from numba.cuda.cudadrv import driver as nd

            arr = _cupy_array()
            p, n = arr.data.ptr, arr.nbytes
            cuda.current_context()
            keep = gpuptr.wrap(p, n, owner=arr) if known else None
            # `keep` holds the range known for the whole row.
            ours = lambda keep=keep: gpuptr.wrap(p, n, owner=arr).context  # noqa: E731
            theirs = lambda: nd.MemoryPointer(cuda.current_context(), cu.CUdeviceptr(p), n, owner=arr)  # noqa: E731
            return ours, theirs

        return setup

    b.row("wrap + .context, known range", "numba MemoryPointer(current_context())", wrap_setup(True))
    b.row("wrap + .context, first sight", "numba MemoryPointer(current_context())", wrap_setup(False))

    def ctx_setup() -> Pair:
        if not on_gpu:
            raise RuntimeError("needs the GPU")
        from cuda.bindings import driver as cu

        attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT
        return (lambda: gpuptr.context_of(addr + 64)), (lambda: cu.cuPointerGetAttribute(attr, addr + 64))

    b.row("context of an address (cached)", "cuPointerGetAttribute (cuda.bindings)", ctx_setup)


def _cai_rows(b: Bench, on_gpu: bool) -> None:
    """A CUDA Array Interface exporter to a numba array: gpuptr's
    ``as_cuda_array`` against numba's."""

    def cai_setup(sync: bool) -> Callable[[], Pair]:
        def setup() -> Pair:
            if not on_gpu:
                raise RuntimeError("needs the GPU")
            from numba import cuda

            from gpuptr.numba import as_cuda_array

            arr = _cupy_array()
            return (lambda: as_cuda_array(arr, sync=sync)), (lambda: cuda.as_cuda_array(arr, sync=sync))

        return setup

    b.row("CAI object -> numba array", "numba.cuda.as_cuda_array", cai_setup(True), scale=0.25)
    b.row("CAI object -> numba array, sync=False", "numba.cuda.as_cuda_array(sync=False)", cai_setup(False), scale=0.25)


def _alloc_pair() -> Callable[[], None]:
    """gpuptr's side of the allocation rows: ``gpuptr.alloc`` + free, 1 MiB."""
    import gpuptr

    def alloc_pair() -> None:
        gpuptr.alloc(1 << 20).free()

    return alloc_pair


def _observability_rows(b: Bench) -> None:
    """What observability costs: gpuptr.alloc+free with the leak report on,
    with the allocation history on (``--only history``), and with DEBUG
    logging on (records to a NullHandler), each against the same pair with
    it off, measured one after the other."""
    alloc_pair = _alloc_pair()
    _observed(b, "gpuptr.alloc+free 1 MiB, tracking on", _tracking, alloc_pair)
    _observed(b, "gpuptr.alloc+free 1 MiB, history on", _history, alloc_pair)
    _observed(b, "gpuptr.alloc+free 1 MiB, DEBUG logging on", _debug_logging, alloc_pair)


def _observed(b: Bench, name: str, switch: Callable[[bool], None], alloc_pair: Callable[[], None]) -> None:
    """The row ``name``: ``alloc_pair`` with ``switch(True)``, against it
    after ``switch(False)``."""
    if not b.wants(name):
        return
    print(f"  measuring: {name} ...", file=b.out, flush=True)
    n = max(10, b.n // 4)

    def switched_on() -> None:
        # One run with the switch on; the pair runs it n times.
        switch(True)
        try:
            on.append(_run_ns(alloc_pair, n))
        finally:
            switch(False)

    # Runs with it on and off alternate, as in Bench.row.
    on: List[float] = []
    off: List[float] = []
    try:
        switch(True)
        try:
            for _ in range(min(n, 200)):
                alloc_pair()
        finally:
            switch(False)
        for _ in range(min(n, 200)):
            alloc_pair()
        for i in range(b.repeat):
            if i % 2 == 0:
                switched_on()
                off.append(_run_ns(alloc_pair, n))
            else:
                off.append(_run_ns(alloc_pair, n))
                switched_on()
    except Exception as e:
        b.add(Result(name, "the same, off", skipped=f"{type(e).__name__}: {e}"))
        return
    b.add(
        Result(
            name,
            "the same, off",
            round(min(on), 1),
            round(min(off), 1),
            round(min(off) / min(on), 2),
            gpuptr_runs=[round(x, 1) for x in on],
            baseline_runs=[round(x, 1) for x in off],
        )
    )


def _tracking(on: bool) -> None:
    """Turn the leak report on or off (a switch for :func:`_observed`)."""
    import gpuptr

    if on and gpuptr.tracking():
        raise RuntimeError("tracking is already on in this process (GPUPTR_TRACK)")
    gpuptr.track(on)


def _history(on: bool) -> None:
    """Turn the allocation history on (a fresh trace) or off (a switch for
    :func:`_observed`)."""
    import gpuptr

    if on and gpuptr.recording_history():
        raise RuntimeError("the allocation history is already on in this process (GPUPTR_HISTORY)")
    gpuptr.record_history(on)


def _debug_logging(on: bool) -> None:
    """Turn gpuptr's DEBUG logging to a NullHandler on, or back to what it
    was (a switch for :func:`_observed`)."""
    import logging

    logger = logging.getLogger("gpuptr")
    if on:
        _debug_logging.saved = (logger.level, logger.propagate)  # type: ignore[attr-defined]
        logger.addHandler(_NULL_HANDLER)
        logger.propagate = False
        logger.setLevel(logging.DEBUG)
    else:
        level, propagate = _debug_logging.saved  # type: ignore[attr-defined]
        logger.setLevel(level)
        logger.propagate = propagate
        logger.removeHandler(_NULL_HANDLER)


def _alloc_rows(b: Bench, on_gpu: bool) -> None:
    """alloc+free 1 MiB: gpuptr's pool against CuPy's pool, the driver's
    stream-ordered allocator and cuda.core's memory resource."""
    alloc_pair = _alloc_pair()

    def cupy_setup() -> Pair:
        if not on_gpu:
            raise RuntimeError("needs the GPU")
        import cupy

        return alloc_pair, (lambda: cupy.cuda.alloc(1 << 20))

    def async_setup() -> Pair:
        if not on_gpu:
            raise RuntimeError("needs the GPU")
        from cuda.bindings import driver as cu

        s = cu.CUstream(0)

        def pair() -> None:
            _, d = cu.cuMemAllocAsync(1 << 20, s)
            cu.cuMemFreeAsync(d, s)

        return alloc_pair, pair

    def core_setup() -> Pair:
        if not on_gpu:
            raise RuntimeError("needs the GPU")
        from cuda.core import Device

        dev = Device(0)
        dev.set_current()
        mr = dev.memory_resource
        stream = dev.default_stream

        def pair() -> None:
            buf = mr.allocate(1 << 20, stream=stream)
            buf.close(stream)

        return alloc_pair, pair

    b.row("alloc+free 1 MiB", "cupy.cuda.alloc (CuPy pool)", cupy_setup, scale=0.5)
    b.row("alloc+free 1 MiB", "cuMemAllocAsync+FreeAsync (cuda.bindings)", async_setup, scale=0.5)
    b.row("alloc+free 1 MiB", "cuda.core DeviceMemoryResource", core_setup, scale=0.5)


def _launch_setup(lib: str, nargs: int, against: str, on_gpu: bool) -> Callable[[], Pair]:
    """A launch on ``nargs`` ``lib`` arrays through gpuptr.numba.foreign_args,
    and the same kernel given them directly (``against="direct"``) or on
    native numba arrays (``"native"``)."""

    def setup() -> Pair:
        if not on_gpu:
            raise RuntimeError("needs the GPU")
        import numpy as np
        from numba import cuda

        from gpuptr.numba import foreign_args

        kernel = _launch_kernel(nargs)
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


def _launch_rows(b: Bench, on_gpu: bool) -> None:
    """Kernel launches on foreign arrays (the numba-cuda #536 complaint): 1
    and 8 array arguments, CuPy and torch, through gpuptr.numba.foreign_args
    against passing them directly, and against native numba arrays."""
    for nargs in (1, 8):
        for lib in ("cupy", "torch"):
            b.row(f"launch, {nargs} {lib} arg(s) via foreign_args", f"{lib} arrays passed directly",
                  _launch_setup(lib, nargs, "direct", on_gpu), scale=0.05)
            b.row(f"launch, {nargs} {lib} arg(s) via foreign_args", "native numba arrays",
                  _launch_setup(lib, nargs, "native", on_gpu), scale=0.05)


def _numba_manager_rows(b: Bench, on_gpu: bool, quick: bool) -> None:
    """numba device_array under each memory manager, in child processes."""
    n_child = 500 if quick else 5000
    # The pure-Python EMM is a bench fixture, in the checkout's benches/
    # (not in the wheel).
    benches = Path(__file__).resolve().parents[2] / "benches"
    for name, manager in (
        ("numba default manager", None),
        ("pure-Python cuda.bindings EMM", "pyemm"),
    ):
        if not b.wants("numba device_array(1 MiB) alloc+free", name):
            continue
        print(f"  measuring: numba device_array(1 MiB) under gpuptr vs {name} ...", file=b.out, flush=True)
        try:
            if not on_gpu:
                raise RuntimeError("needs the GPU")
            if manager == "pyemm" and not (benches / "pyemm.py").is_file():
                raise RuntimeError("needs benches/pyemm.py from gpuptr's source tree")
            ours = _devarray_ns("gpuptr.numba", n_child, b.repeat)
            theirs = _devarray_ns(manager, n_child, b.repeat, str(benches))
            b.add(Result("numba device_array(1 MiB) alloc+free", name, round(ours, 1), round(theirs, 1),
                         round(theirs / ours, 2)))
        except Exception as e:
            b.add(Result("numba device_array(1 MiB) alloc+free", name, skipped=f"{type(e).__name__}: {e}"))


def _library_rows(b: Bench, on_gpu: bool, quick: bool) -> None:
    """CuPy's and PyTorch's allocation through gpuptr against their own
    pools and RMM's, each in its own process. Processes differ (one
    measured CuPy's own pool at 2.2 and 3.7 us in one run), so each
    allocator runs in alternating rounds and keeps its best."""
    n_lib = 2000 if quick else 20000
    rounds = 2 if quick else 3
    for lib, what in (("cupy", "cp.empty(1 MiB)+free"), ("torch", "torch.empty(1 MiB, cuda)+free")):
        rows = [
            (f"{what}, gpuptr", "gpuptr", "own", f"{lib}'s own pool"),
            (f"{what}, gpuptr", "gpuptr", "rmm", f"RMM pool (rmm.allocators.{lib})"),
            (f"{what}, gpuptr stream_ordered", "gpuptr-ordered", "own", f"{lib}'s own pool"),
        ]
        rows = [r for r in rows if b.wants(r[0], r[3])]
        if not rows:
            continue
        print(f"  measuring: {what} under gpuptr, {lib}'s own pool and RMM ...", file=b.out, flush=True)
        allocators = sorted({r[1] for r in rows} | {r[2] for r in rows})
        best, failed = _best_of_rounds(lib, allocators, rounds, n_lib, b.repeat, on_gpu)
        for row, mine, peer, label in rows:
            if mine in best and peer in best:
                b.add(Result(row, label, round(best[mine], 1), round(best[peer], 1), round(best[peer] / best[mine], 2)))
            else:
                b.add(Result(row, label, skipped=failed.get(mine) or failed.get(peer) or "not measured"))


def _best_of_rounds(
    lib: str,
    allocators: List[str],
    rounds: int,
    n: int,
    repeat: int,
    on_gpu: bool,
    measure: Callable[[str, str, int, int], float] = library_alloc_ns,
) -> Tuple[Dict[str, float], Dict[str, str]]:
    """``measure`` (:func:`library_alloc_ns` by default) of ``lib`` under each
    of ``allocators``, in ``rounds`` alternating rounds: the best ns of each,
    and why each that failed did (a failed one is not tried again)."""
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


_TORCH_STATS_CHILD = r"""
import sys
allocator, n, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from gpuptr.bench import best_ns
import torch
if allocator == "gpuptr":
    import gpuptr.torch
    gpuptr.torch.install()
keep = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
print(best_ns(torch.cuda.memory_allocated, n, repeat))
"""


def torch_stats_ns(lib: str, allocator: str, n: int, repeat: int) -> float:
    """``torch.cuda.memory_allocated()``, in ns, in a child process whose
    PyTorch allocator is ``allocator`` (``"own"`` or ``"gpuptr"``), with
    eight tensors live (``lib`` is ``"torch"``)."""
    return _child_ns(_TORCH_STATS_CHILD, allocator, n, repeat)


def _torch_stats_rows(b: Bench, on_gpu: bool, quick: bool) -> None:
    """``torch.cuda.memory_allocated()`` itself: under gpuptr it reads
    PyTorch's counts in gpuptr's hooks and the pool's segments, where
    PyTorch's own allocator reads its own (both build the whole
    ``memory_stats()`` dict)."""
    row, label = "torch.cuda.memory_allocated()", "torch's own allocator"
    if not b.wants(row, label):
        return
    print(f"  measuring: {row} under gpuptr and torch's own allocator ...", file=b.out, flush=True)
    n = 500 if quick else 5000
    best, failed = _best_of_rounds("torch", ["gpuptr", "own"], 2 if quick else 3, n, b.repeat, on_gpu,
                                   measure=torch_stats_ns)
    if "gpuptr" in best and "own" in best:
        b.add(Result(row, label, round(best["gpuptr"], 1), round(best["own"], 1), round(best["own"] / best["gpuptr"], 2)))
    else:
        b.add(Result(row, label, skipped=failed.get("gpuptr") or failed.get("own") or "not measured"))


def _busy_rows(b: Bench, on_gpu: bool) -> None:
    """A busy GPU: device_array alloc+free while a kernel runs on a
    non-blocking stream. The ratio is of the totals; median and worst are
    in ``extra``."""
    pairs = 300
    ours_busy = None
    for name, manager in (("numba default manager", None), ("RMM pool (rmm.allocators.numba)", "rmm.allocators.numba")):
        row = f"busy GPU: {pairs} device_array(1 MiB) pairs, total"
        if not b.wants(row, name):
            continue
        print(f"  measuring: {row} under gpuptr vs {name} ...", file=b.out, flush=True)
        try:
            if not on_gpu:
                raise RuntimeError("needs the GPU")
            if manager:
                __import__(manager.rsplit(".", 2)[0])
            if ours_busy is None:
                ours_busy = busy_devarray("gpuptr.numba", pairs)
            busy_theirs = busy_devarray(manager, pairs)
            b.add(Result(row, name, round(ours_busy["total_ns"] / pairs, 1),
                         round(busy_theirs["total_ns"] / pairs, 1),
                         round(busy_theirs["total_ns"] / ours_busy["total_ns"], 2),
                         extra={"gpuptr": ours_busy, "baseline": busy_theirs}))
        except Exception as e:
            b.add(Result(row, name, skipped=f"{type(e).__name__}: {e}"))


_GRAPH_CHILD = r"""
import sys, time
what, allocator, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if allocator == "gpuptr":
    import gpuptr
    gpuptr.install(numba=False)
if what == "cupy":
    import cupy as cp
    x = cp.ones(1 << 18, dtype=cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    def cycle():
        # Capture three kernels with two temporaries, replay ten times.
        with s:
            s.begin_capture()
            a = x * 2.0
            b = a + 1.0
            out = b * 3.0
            g = s.end_capture()
        for _ in range(10):
            g.launch(stream=s)
        s.synchronize()
        return out
    sync = s.synchronize
else:
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).cuda()
    step = torch.compile(model, mode="reduce-overhead")
    x = torch.randn(64, 256, device="cuda")
    def cycle():
        with torch.no_grad():
            return step(x)
    sync = torch.cuda.synchronize
for _ in range(20):
    cycle()
sync()
best = float("inf")
for _ in range(5):
    t = time.perf_counter_ns()
    for _ in range(n):
        cycle()
    sync()
    best = min(best, (time.perf_counter_ns() - t) / n)
print(best)
"""


def _graph_rows(b: Bench, on_gpu: bool, quick: bool) -> None:
    """CUDA graphs: a CuPy capture (three kernels, two temporaries) and ten
    replays under gpuptr against CuPy's pool, and a
    ``torch.compile(mode="reduce-overhead")`` step of a 2-layer MLP under
    gpuptr against PyTorch's own allocator; each in its own process, in
    alternating rounds, best of each."""
    rows = (
        ("cupy", "CuPy graph capture + 10 replays", "CuPy's own pool", 200 if quick else 2000),
        ("torch", "torch.compile reduce-overhead (CUDA graph) MLP step", "torch's own allocator", 500 if quick else 5000),
    )
    for what, name, label, n in rows:
        if not b.wants(name, label):
            continue
        print(f"  measuring: {name} under gpuptr vs {label} ...", file=b.out, flush=True)
        # torch.compile takes tens of seconds per process: two rounds.
        rounds = 2 if quick or what == "torch" else 3
        best, failed = _best_of_rounds(what, ["gpuptr", "own"], rounds, n, b.repeat, on_gpu, measure=_graph_ns)
        if "gpuptr" in best and "own" in best:
            b.add(Result(name, label, round(best["gpuptr"], 1), round(best["own"], 1),
                         round(best["own"] / best["gpuptr"], 2)))
        else:
            b.add(Result(name, label, skipped=failed.get("gpuptr") or failed.get("own") or "not measured"))


def _graph_ns(what: str, allocator: str, n: int, repeat: int) -> float:
    """One :data:`_GRAPH_CHILD` process of ``what`` under ``allocator``: ns
    per cycle (the child keeps its best of five; ``repeat`` is unused)."""
    return _child_ns(_GRAPH_CHILD, what, allocator, n)


_MLIR_LAUNCH_CHILD = r"""
import sys
nargs, n, repeat = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
import cupy as cp
from numba_cuda_mlir import cuda
from gpuptr.bench import _launch_kernel, best_ns
kernel = _launch_kernel(nargs, cuda)[4, 256]
args = [cp.zeros(1024, dtype=cp.float32) for _ in range(nargs)]
kernel(*args); cuda.synchronize()
print(best_ns(lambda: kernel(*args), n, repeat))
"""


def _cuda_core_callback_floor() -> Any:
    """What any Python MemoryResource pays in cuda.core when its buffers
    free through it (Buffer.from_handle(mr=), then cuda.core's callback
    into mr.deallocate): a resource handing out one fixed address, whose
    deallocate does nothing. The bench and benches/cuda_core_why.py share
    it."""
    import gpuptr
    from cuda.core import Buffer, MemoryResource as Base

    class Nothing(Base):  # type: ignore[misc]
        fixed = gpuptr.alloc(1 << 20)
        is_device_accessible, is_host_accessible, is_managed, device_id = True, False, False, 0

        def allocate(self, size: int, *, stream: Any = None) -> Any:
            return Buffer.from_handle(self.fixed.device_pointer_value, size, mr=self, stream=stream)

        def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
            pass

    return Nothing()


def _cuda_core_owning_floor() -> Any:
    """cuda.core's own part of a buffer that owns its memory, as gpuptr's
    do: a resource making the same Buffer subclass over one fixed address
    with a plain object as its owner, so nothing is allocated or freed."""
    import gpuptr
    from gpuptr.cuda_core import MemoryResource

    fixed, owner = gpuptr.alloc(1 << 20), object()
    make = MemoryResource(0)._make

    class Floor:
        def allocate(self, size: int, *, stream: Any = None) -> Any:
            return make(fixed.device_pointer_value, size, None, None, owner)

    return Floor()


def _next_numba_rows(b: Bench, on_gpu: bool, quick: bool) -> None:
    """The next numba and cuda.core: a cuda.core ``mr.allocate(1 MiB)`` +
    close through gpuptr.cuda_core against cuda.core's own resource (over the
    driver's memory pool); numba-cuda-mlir ``device_array(1 MiB)`` under
    gpuptr.numba against its default manager (child processes); and a
    numba-cuda-mlir launch on 8 CuPy arrays (its own launcher reads them)
    against numba-cuda's through gpuptr.numba.foreign_args."""

    def against(baseline: Callable[[], Any], ours: str = "MemoryResource") -> Callable[[], Pair]:
        # gpuptr's resource ``ours`` and ``baseline()``, each allocating and
        # closing 1 MiB buffers on one stream.
        def setup() -> Pair:
            if not on_gpu:
                raise RuntimeError("needs the GPU")
            from cuda.core import Device

            from gpuptr import cuda_core

            dev = Device(0)
            dev.set_current()
            stream = dev.create_stream()
            ours_mr, theirs_mr = getattr(cuda_core, ours)(0), baseline()
            return (lambda: ours_mr.allocate(1 << 20, stream=stream).close(),
                    lambda: theirs_mr.allocate(1 << 20, stream=stream).close())

        return setup

    def device_memory_resource() -> Any:
        from cuda.core import DeviceMemoryResource

        return DeviceMemoryResource(0)

    def pinned() -> Any:
        from cuda.core import PinnedMemoryResource

        return PinnedMemoryResource()

    b.row("cuda.core mr.allocate+close 1 MiB, gpuptr.cuda_core", "cuda.core DeviceMemoryResource",
          against(device_memory_resource), scale=0.5)
    b.row("cuda.core mr.allocate+close 1 MiB, gpuptr.cuda_core",
          "cuda.core's floor for an owning Buffer: one that owns a plain object", against(_cuda_core_owning_floor), scale=0.5)
    b.row("cuda.core mr.allocate+close 1 MiB, gpuptr.cuda_core",
          "cuda.core's floor for a resource's Buffer: a Python resource that frees nothing",
          against(_cuda_core_callback_floor), scale=0.5)
    b.row("cuda.core pinned mr.allocate+close 1 MiB, gpuptr.cuda_core", "cuda.core PinnedMemoryResource",
          against(pinned, "PinnedMemoryResource"), scale=0.5)

    name = "numba-cuda-mlir device_array(1 MiB) alloc+free"
    label = "numba-cuda-mlir default manager"
    if b.wants(name, label):
        print(f"  measuring: {name} under gpuptr vs {label} ...", file=b.out, flush=True)
        n_child = 500 if quick else 5000
        try:
            if not on_gpu:
                raise RuntimeError("needs the GPU")
            ours = _devarray_ns("gpuptr.numba", n_child, b.repeat, numba="numba_cuda_mlir")
            theirs = _devarray_ns(None, n_child, b.repeat, numba="numba_cuda_mlir")
            b.add(Result(name, label, round(ours, 1), round(theirs, 1), round(theirs / ours, 2)))
        except Exception as e:
            b.add(Result(name, label, skipped=f"{type(e).__name__}: {e}"))

    name = "launch, 8 cupy arg(s) via foreign_args (numba-cuda)"
    label = "numba-cuda-mlir's own launcher"
    if b.wants(name, label):
        print(f"  measuring: {name} vs {label} ...", file=b.out, flush=True)
        n_child = 200 if quick else 2000
        try:
            if not on_gpu:
                raise RuntimeError("needs the GPU")
            mlir = _child_ns(_MLIR_LAUNCH_CHILD, 8, n_child, b.repeat)
            fast, _ = _launch_setup("cupy", 8, "direct", on_gpu)()
            ours = min(runs_ns(fast, n_child, b.repeat))
            # Above 1: numba-cuda with foreign_args launches faster than
            # numba-cuda-mlir's launcher does on the same kind of arrays.
            b.add(Result(name, label, round(ours, 1), round(mlir, 1), round(mlir / ours, 2)))
        except Exception as e:
            b.add(Result(name, label, skipped=f"{type(e).__name__}: {e}"))


_PINNED_CHILD = r"""
import sys
lib, allocator, n, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from gpuptr.bench import best_ns
import cupy
if allocator == "gpuptr":
    import gpuptr
    gpuptr.install(numba=False, torch=False)
# Nothing else holds the device's context here, as in a script that only
# stages host data: the pair is the whole program's use of the GPU.
pair = lambda: cupy.cuda.alloc_pinned_memory(1 << 20)
print(best_ns(pair, n, repeat))
"""


def _pinned_ns(lib: str, allocator: str, n: int, repeat: int) -> float:
    """One :data:`_PINNED_CHILD` process: ``cupy.cuda.alloc_pinned_memory(1
    MiB)`` + free, in ns, under ``allocator`` (``"gpuptr"``: installed;
    ``"own"``: CuPy's pinned pool)."""
    return _child_ns(_PINNED_CHILD, lib, allocator, n, repeat)


_PINNED_PROBE_CHILD = r"""
import json, sys, time
from cuda.bindings import driver as cu
pairs = int(sys.argv[1])
def ok(r):
    err = r[0] if isinstance(r, tuple) else r
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA error {err}")
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r
def each_ns(fn, n):
    out = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t)
    return sorted(out)[len(out) // 2]
ok(cu.cuInit(0))
dev = ok(cu.cuDeviceGet(0))
res = {}
# 1. The primary context retained and released while no one else holds it:
#    each pair creates and destroys the context (what gpuptr's alloc_host
#    did per pair before the host cache, when nothing else held a context).
def cold():
    ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuDevicePrimaryCtxRelease(dev))
res["retain_release_cold_ns"] = each_ns(cold, 5)
ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
ok(cu.cuCtxSetCurrent(ctx))
res["retain_release_held_ns"] = each_ns(cold, 100)
# 2. cuMemHostAlloc alone and cuMemFreeHost alone, with and without portable.
for name, flags in (("", 0), ("_portable", cu.CU_MEMHOSTALLOC_PORTABLE)):
    for size, label in ((4096, "4k"), (1 << 20, "1m")):
        ptrs = []
        res[f"alloc_{label}{name}_ns"] = each_ns(lambda: ptrs.append(ok(cu.cuMemHostAlloc(size, flags))), pairs)
        res[f"free_{label}{name}_ns"] = each_ns(lambda: ok(cu.cuMemFreeHost(ptrs.pop())), pairs)
# 3. cuMemFreeHost while the device is busy: whether the free waits for it.
stream = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
big = ok(cu.cuMemAlloc(8 << 30))
ptr = ok(cu.cuMemHostAlloc(1 << 20, 0))
for _ in range(4):
    ok(cu.cuMemsetD8Async(big, 1, 8 << 30, stream))
t = time.perf_counter_ns()
ok(cu.cuMemFreeHost(ptr))
res["free_while_busy_ns"] = time.perf_counter_ns() - t
t = time.perf_counter_ns()
ok(cu.cuStreamSynchronize(stream))
res["busy_left_after_free_ns"] = time.perf_counter_ns() - t
ok(cu.cuMemFree(big))
# 4. The whole pair the old way: retain, alloc, free, release, nothing held.
ok(cu.cuDevicePrimaryCtxRelease(dev))
def old_pair():
    c = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(c))
    p = ok(cu.cuMemHostAlloc(1 << 20, cu.CU_MEMHOSTALLOC_PORTABLE))
    ok(cu.cuMemFreeHost(p))
    ok(cu.cuDevicePrimaryCtxRelease(dev))
res["old_pair_ns"] = each_ns(old_pair, 5)
print(json.dumps(res))
"""

_PINNED_GPUPTR_CHILD = r"""
import json, time
import gpuptr
# A fresh process holding no context: alloc_host holds it from its first call.
first = []
for _ in range(5):
    t = time.perf_counter_ns()
    gpuptr.alloc_host(1 << 20, portable=True).free()
    first.append(time.perf_counter_ns() - t)
from gpuptr.bench import best_ns
ns = best_ns(lambda: gpuptr.alloc_host(1 << 20, portable=True).free(), 2000, 5)
print(json.dumps({"first_pairs_ns": first, "pair_ns": ns, "host": gpuptr.stats()[0]["host"]}))
"""


def _pinned_rows(b: Bench, on_gpu: bool, quick: bool) -> None:
    """Pinned host memory: CuPy's ``alloc_pinned_memory`` under gpuptr
    against CuPy's own pinned pool (each in its own process, alternating
    rounds), ``gpuptr.alloc_host`` against raw ``cuMemHostAlloc`` +
    ``cuMemFreeHost``, and the probe of what a pinned pair cost before the
    host cache: the old path timed raw in a fresh process, with alloc
    alone, free alone, portable or not, a free while the device is busy,
    and the context's retain and release when nothing else holds it."""
    name, label = "cupy alloc_pinned_memory(1 MiB)+free, gpuptr", "CuPy's own pinned pool"
    if b.wants(name, label, "pinned"):
        print(f"  measuring: {name} vs {label} ...", file=b.out, flush=True)
        n = 2000 if quick else 20000
        best, failed = _best_of_rounds("cupy", ["gpuptr", "own"], 2 if quick else 3, n, b.repeat, on_gpu,
                                       measure=_pinned_ns)
        if "gpuptr" in best and "own" in best:
            b.add(Result(name, label, round(best["gpuptr"], 1), round(best["own"], 1),
                         round(best["own"] / best["gpuptr"], 2)))
        else:
            b.add(Result(name, label, skipped=failed.get("gpuptr") or failed.get("own") or "not measured"))

    def raw_setup(portable: bool) -> Callable[[], Pair]:
        def setup() -> Pair:
            if not on_gpu:
                raise RuntimeError("needs the GPU")
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

    name, label = "pinned probe: gpuptr pair in a fresh process", "the old path: retain+alloc+free+release"
    if b.wants(name, label):
        print(f"  measuring: {name} vs {label} ...", file=b.out, flush=True)
        try:
            if not on_gpu:
                raise RuntimeError("needs the GPU")
            __import__("cuda.bindings.driver")
            probe = json.loads(_child_out(_PINNED_PROBE_CHILD, 20 if quick else 100))
            ours = json.loads(_child_out(_PINNED_GPUPTR_CHILD))
            b.add(Result(name, label, round(ours["pair_ns"], 1), round(probe["old_pair_ns"], 1),
                         round(probe["old_pair_ns"] / ours["pair_ns"], 2), extra={"probe": probe, "gpuptr": ours}))
        except Exception as e:
            b.add(Result(name, label, skipped=f"{type(e).__name__}: {e}"))


def _child_out(script: str, *args: object) -> str:
    """Run ``script`` in a child process with ``args``; its last line of
    output. ``RuntimeError`` with its last error line if it fails."""
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "child failed")
    return out.stdout.strip().splitlines()[-1]


def _ipc_rows(b: Bench) -> None:
    """What one ``ipc_handle()`` costs after 100,000 exports of one buffer
    (each handle dropped), against the first 1,000: the export's books must
    not grow with the exports made."""
    name, label = "ipc_handle() per export, after 100,000 exports of one buffer", "the first 1,000 exports"
    if not b.wants(name, label, "ipc"):
        return
    print(f"  measuring: {name} ...", file=b.out, flush=True)
    try:
        import gpuptr

        mem = gpuptr.alloc(1 << 20)
        export = mem.ipc_handle
        first = _run_ns(export, 1000)
        for _ in range(98_000):
            export()
        late = min(_run_ns(export, 1000) for _ in range(2))
        b.add(Result(name, label, round(late, 1), round(first, 1), round(first / late, 2)))
    except Exception as e:
        b.add(Result(name, label, skipped=f"{type(e).__name__}: {e}"))


def _meta(info: DriverInfo, quick: bool) -> Dict[str, Any]:
    """The report's ``meta``: when, on what, and the peers' versions."""
    import gpuptr

    meta: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "driver": info["driver"],
        "driver_version": info["version_string"],
        "device": gpuptr.devices()[0].name,
        "gpuptr": gpuptr.__version__,
        "python": platform.python_version(),
        "quick": quick,
    }
    for mod in ("numba_cuda", "cupy", "torch", "rmm", "cuda.bindings", "cuda.core", "numpy"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            meta[mod] = getattr(m, "__version__", "?")
        except Exception:
            meta[mod] = None
    return meta


_SIM_BANNER = (
    "# on gpuptr's simulator (GPUPTR_DRIVER=sim): host-memory stand-ins for the GPU, not GPU measurements"
)


def _ns_cell(ns: float) -> str:
    return f"{ns:.0f} ns"


def _reason(skipped: str) -> str:
    """A skipped row's reason, on one line and of a readable length."""
    line = skipped.strip().splitlines()[0] if skipped.strip() else "skipped"
    return line if len(line) <= 160 else line[:157] + "..."


def format_table(report: Dict[str, Any]) -> str:
    """The report as a table whose columns fit the longest entry. A skipped
    row shows a numbered marker in the ratio column, and the reasons follow
    the table, one per distinct reason. On the simulator the first line
    says so."""
    rows = report["rows"]
    reasons: List[str] = []
    cells: List[Tuple[str, str, str, str, str]] = []
    for r in rows:
        if r["skipped"]:
            reason = _reason(r["skipped"])
            if reason not in reasons:
                reasons.append(reason)
            cells.append((r["row"], "-", r["baseline"], "-", f"skipped [{reasons.index(reason) + 1}]"))
        else:
            cells.append(
                (r["row"], _ns_cell(r["gpuptr_ns"]), r["baseline"], _ns_cell(r["baseline_ns"]), f"{r['ratio']:.2f}x")
            )
    header = ("row", "gpuptr", "baseline", "baseline", "ratio")
    w = [max(len(c[i]) for c in [header, *cells]) for i in range(5)]

    def line(c: Tuple[str, str, str, str, str]) -> str:
        return f"{c[0]:<{w[0]}}  {c[1]:>{w[1]}}  {c[2]:<{w[2]}}  {c[3]:>{w[3]}}  {c[4]:>{w[4]}}"

    lines = [_SIM_BANNER] if report.get("meta", {}).get("driver") == "sim" else []
    lines.append(line(header))
    for r, c in zip(rows, cells):
        lines.append(line(c))
        e = r.get("extra") or {}
        if not r["skipped"] and "gpuptr" in e and "baseline" in e:  # the busy rows
            mine, other = e["gpuptr"], e["baseline"]
            lines.append(
                f"{'':{w[0]}}  median {mine['median_ns'] / 1e3:.1f} vs {other['median_ns'] / 1e3:.1f} us;"
                f" p99 {mine['p99_ns'] / 1e3:.1f} vs {other['p99_ns'] / 1e3:.1f} us;"
                f" worst {mine['worst_ns'] / 1e3:.1f} vs {other['worst_ns'] / 1e3:.1f} us;"
                f" kernel still running after the loop: {mine['busy']} / {other['busy']}"
            )
        if not r["skipped"] and "probe" in e:
            p, g = e["probe"], e["gpuptr"]

            def us(k: str) -> str:
                return f"{p[k] / 1e3:.1f}"

            lines.append(
                f"{'':{w[0]}}  context retain+release with no other holder {us('retain_release_cold_ns')} us"
                f" (held: {us('retain_release_held_ns')}); cuMemHostAlloc 4 KiB/1 MiB {us('alloc_4k_ns')}/{us('alloc_1m_ns')} us"
                f" (portable {us('alloc_4k_portable_ns')}/{us('alloc_1m_portable_ns')}); cuMemFreeHost"
                f" {us('free_4k_ns')}/{us('free_1m_ns')} us (portable {us('free_4k_portable_ns')}/{us('free_1m_portable_ns')});"
                f" free while busy {us('free_while_busy_ns')} us, {us('busy_left_after_free_ns')} us of work left after it;"
                f" gpuptr's first pairs {', '.join(f'{x / 1e3:.0f}' for x in g['first_pairs_ns'])} us"
            )
    if reasons:
        lines.append("")
        lines.append("skipped:")
        for i, reason in enumerate(reasons, 1):
            count = sum(1 for r in rows if r["skipped"] and _reason(r["skipped"]) == reason)
            lines.append(f"  [{i}] {reason} ({count} row{'s' if count != 1 else ''})")
    return "\n".join(lines)


def plot(report: Dict[str, Any], path: str) -> None:
    """Two panels: the speed-up of each row, and the absolute time of both
    sides with the spread of their runs (bar: best run; line: best to worst)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows = [r for r in report["rows"] if not r["skipped"]]
    labels = [f"{r['row']}\nvs {r['baseline']}" for r in rows]
    fig, (ax, at) = plt.subplots(
        1, 2, figsize=(15, 0.6 * len(rows) + 1.8), sharey=True, gridspec_kw={"width_ratios": [1, 1.2]}
    )
    ys = list(range(len(rows)))
    ratios = [r["ratio"] for r in rows]
    ax.barh(ys, ratios, color=["#4a7" if x >= 1 else "#c54" for x in ratios])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(ys, labels, fontsize=7)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    for i, x in enumerate(ratios):
        ax.text(x, i, f" {x:.1f}×", va="center", fontsize=7)
    ax.set_xlabel("speed-up (baseline time / gpuptr time)")

    h = 0.38
    for side, color, dy in (("gpuptr", "#4a7", -h / 2), ("baseline", "#888", h / 2)):
        best = [r[f"{side}_ns"] for r in rows]
        at.barh([y + dy for y in ys], best, height=h, color=color, label=side)
        for y, r in zip(ys, rows):
            runs = r.get(f"{side}_runs") or [r[f"{side}_ns"]]
            at.plot([min(runs), max(runs)], [y + dy, y + dy], color="k", lw=1)
            at.text(max(runs), y + dy, f" {_fmt_ns(r[f'{side}_ns'])}", va="center", fontsize=6)
    at.set_xscale("log")
    at.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _fmt_ns(v)))
    at.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    at.set_xlabel("time per operation (bar: best run; line: spread over the runs)")
    at.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"gpuptr on {report['meta']['device']} ({report['meta']['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _fmt_ns(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} µs"
    return f"{ns:.0f} ns"


DESCRIPTION = (
    "Time gpuptr against numba, CuPy, torch, RMM and cuda.bindings, side by side, and print "
    "a table of ratios (a peer that is not installed, or needs a GPU, is skipped). Progress goes to stderr."
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The bench's options, on its own parser or the CLI's ``bench`` command."""
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--json", metavar="FILE", help="also write the JSON report to FILE ('-': stdout, instead of the table)")
    ap.add_argument("--plot", metavar="FILE.png", help='draw the ratios (needs matplotlib: pip install "gpuptr[plot]")')
    ap.add_argument("--only", metavar="TEXT", help="only the rows whose name or baseline contains TEXT (any case)")


def check_arguments(args: argparse.Namespace) -> Optional[str]:
    """What stops the arguments from working, found before anything is
    measured (None: nothing): ``--plot`` without matplotlib, or a report
    file in a directory that does not exist or cannot be written."""
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return '--plot needs matplotlib: pip install "gpuptr[plot]"'
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if not path or (flag == "--json" and path == "-"):
            continue
        parent = Path(path).parent
        if not parent.is_dir():
            return f"{flag} {path}: the directory {parent} does not exist"
        if not os.access(parent, os.W_OK):
            return f"{flag} {path}: the directory {parent} cannot be written"
    return None


def run_command(args: argparse.Namespace) -> int:
    """Run the bench for parsed (and checked) arguments: the table (or the
    JSON) on stdout, the files asked for; the exit status."""
    report = run(quick=args.quick, only=args.only)
    if args.only and not report["rows"]:
        print(f"error: no row matches {args.only!r} (--only picks the rows whose name or baseline contains it,"
              " in any case; e.g. alloc, launch, context, graph, pinned, ipc)", file=sys.stderr)
        return 1
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    try:
        if args.json and args.json != "-":
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
            print(f"note: wrote {args.json}", file=sys.stderr)
        if args.plot:
            plot(report, args.plot)
            print(f"note: wrote {args.plot}", file=sys.stderr)
    except OSError as e:
        print(f"error: could not write the report: {e}", file=sys.stderr)
        return 1
    if not any(not r["skipped"] for r in report["rows"]):
        print("error: no row could be measured here", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m gpuptr.bench``: the bench on its own (the CLI's ``bench``
    command also picks the driver first)."""
    ap = argparse.ArgumentParser(prog="gpuptr bench", description=DESCRIPTION)
    add_arguments(ap)
    args = ap.parse_args(argv)
    problem = check_arguments(args)
    if problem:
        print(f"gpuptr bench: error: {problem}", file=sys.stderr)
        return 2
    return run_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
