"""Where the CuPy workload's time goes (``benches/workloads.py --only
cupy``: 3,000 ``b = a * 2 + 1`` on fresh arrays of 1 KiB-64 MiB, the last
20 kept), under CuPy's own pool and under ``gpuptr.install()``, each in a
fresh process, alternating:

- ``pass``: the workload's pass; the host's loop alone (``host``), up to
  the last kernel's end (``wall``), and the GPU's time between events
  recorded at its two ends (``gpu``);
- ``kernels``: the same two kernels on views of three arrays allocated
  once (``out=``): CuPy's launches with no allocation at all;
- ``alloc``: the same allocations and frees with no kernel;
- ``hook`` (gpuptr only): gpuptr's CuPy hooks called directly, no CuPy
  object around them.

Each row is ms a pass, median of the passes. ``--spy DIR`` also samples
one run of each under ``py-spy record --native`` into DIR (raw folded
stacks, read with ``--fold DIR``); sampling native stacks slows the
child several times over, so its times are not comparable.

Usage: python benches/cupy_why.py [--rounds N] [--spy DIR]   (on the GPU machine)
       python benches/cupy_why.py --fold DIR                 (anywhere)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time
from collections import deque
import cupy
from gpuptr.bench.children.workload import CUPY_ARRAYS, CUPY_KEEP, CUPY_LOG2, log_uniform

mode, passes = sys.argv[1], int(sys.argv[2])
if mode == "gpuptr":
    import gpuptr
    gpuptr.install(numba=False, torch=False, rmm=False, cupy=True)
# The workload's sizes, as its run_cupy draws them.
counts = [max(1, size // 4) for size in log_uniform(0, CUPY_ARRAYS, *CUPY_LOG2)]
f32 = cupy.float32

def one_pass():
    keep = deque(maxlen=CUPY_KEEP)
    for c in counts:
        a = cupy.empty(c, dtype=f32)
        keep.append(a * 2 + 1)
    return keep

big = max(counts)
bufs = [cupy.zeros(big, dtype=f32) for _ in range(3)]
def kernels():
    a, t, b = bufs
    for c in counts:
        cupy.multiply(a[:c], 2, out=t[:c])
        cupy.add(t[:c], 1, out=b[:c])

def alloc():
    keep = deque(maxlen=CUPY_KEEP)
    for c in counts:
        a = cupy.empty(c, dtype=f32)
        t = cupy.empty(c, dtype=f32)
        del t
        keep.append(cupy.empty(c, dtype=f32))
    return keep

def hook():
    from gpuptr import _core
    m, fr = _core._cupy_malloc_current, _core._cupy_free
    keep = deque()
    for c in counts:
        n = c * 4
        a = m(n, 0); t = m(n, 0); fr(t, 0)
        keep.append(m(n, 0)); fr(a, 0)
        if len(keep) == CUPY_KEEP:
            fr(keep.popleft(), 0)
    for p in keep:
        fr(p, 0)

def timed(fn):
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record()
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    e1.record()
    e1.synchronize()
    t2 = time.perf_counter()
    del out
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3, cupy.cuda.get_elapsed_time(e0, e1)

rows = {}
parts = [("pass", one_pass), ("kernels", kernels), ("alloc", alloc)]
if mode == "gpuptr":
    parts.append(("hook", hook))
for name, fn in parts:
    timed(fn)  # warm-up
    got = [timed(fn) for _ in range(passes)]
    rows[name] = {k: round(statistics.median(g[i] for g in got), 2) for i, k in enumerate(("host", "wall", "gpu"))}
extra = {}
if mode == "gpuptr":
    st = gpuptr.stats()[0]
    extra = {k: st.get(k) for k in ("pool_hits", "pool_misses", "fences")}
print(json.dumps({"mode": mode, "rows": rows, "stats": extra}))
"""


def child(mode: str, passes: int, spy: str | None = None) -> dict | None:
    cmd = [sys.executable, "-c", CHILD, mode, str(passes)]
    if spy:
        exe = shutil.which("py-spy")
        if exe is None:
            print("py-spy not found: no samples")
            return None
        cmd = [exe, "record", "--native", "-r", "1000", "-f", "raw", "-o", os.path.join(spy, f"{mode}.txt"), "--", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        print(mode, "failed:", r.stderr[-1500:])
        return None
    # py-spy writes its own lines to stdout too: the child's is the JSON one.
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])


def fold(spy: str) -> None:
    """The leaf frames (library;function) that take most samples, by mode."""
    for mode in ("own", "gpuptr"):
        path = os.path.join(spy, f"{mode}.txt")
        if not os.path.exists(path):
            continue
        leaf: collections.Counter[str] = collections.Counter()
        lib: collections.Counter[str] = collections.Counter()
        total = 0
        with open(path) as f:
            for line in f:
                stack, _, n = line.rstrip().rpartition(" ")
                frames = stack.split(";")
                total += int(n)
                leaf[frames[-1][:110]] += int(n)
                libs = {fr[fr.rfind("(") + 1:-1] for fr in frames if fr.endswith(")")}
                for name in libs:
                    lib[name] += int(n)
        print(f"== {mode}: {total} samples; libraries on the stack (% of samples):")
        for name, n in lib.most_common(12):
            print(f"   {100 * n / total:5.1f}  {name}")
        print("   leaf frames:")
        for name, n in leaf.most_common(25):
            print(f"   {100 * n / total:5.1f}  {name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--spy", help="also sample each mode once with py-spy into this folder")
    ap.add_argument("--fold", help="summarize the samples in this folder and stop")
    a = ap.parse_args()
    if a.fold:
        fold(a.fold)
        return 0
    for r in range(a.rounds):
        for mode in ("own", "gpuptr"):
            out = child(mode, a.passes)
            if out:
                rows = "; ".join(f"{k} {v['host']}/{v['wall']}/{v['gpu']}" for k, v in out["rows"].items())
                print(f"round {r + 1} {mode:>6}: (ms host/wall/gpu) {rows} {out['stats'] or ''}", flush=True)
    if a.spy:
        os.makedirs(a.spy, exist_ok=True)
        for mode in ("own", "gpuptr"):
            child(mode, a.passes, a.spy)
        fold(a.spy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
