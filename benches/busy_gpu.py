"""Busy-GPU benchmark: host-side numba ``device_array(1 MiB)`` alloc+free
latency while a long kernel runs on a non-blocking stream, under numba's
default manager, RMM's pool and gpuptr, each in its own process.

Usage: python benches/busy_gpu.py [pairs]   (on the GPU machine)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time, statistics
import numpy as np
mgr = sys.argv[1]
pairs = int(sys.argv[2])
if mgr == "rmm":
    import rmm
    rmm.reinitialize(pool_allocator=True)
from numba import cuda
import cupy as cp

@cuda.jit
def spin(a, ms):
    for _ in range(ms):
        cuda.nanosleep(1000000)
    a[0] = 1

cs = cp.cuda.Stream(non_blocking=True)  # kept alive: the handle must stay valid
s = cuda.external_stream(cs.ptr)
flag = cuda.device_array(1, np.int32)
for _ in range(20):  # warm up (and let the pool grow as an idle GPU lets it)
    cuda.device_array(1 << 20, np.uint8)
cuda.synchronize()
spin[1, 1, s](flag, 1500)
times = []
t0 = time.perf_counter()
for _ in range(pairs):
    t = time.perf_counter()
    a = cuda.device_array(1 << 20, np.uint8)
    del a
    times.append(time.perf_counter() - t)
total = time.perf_counter() - t0
s.synchronize()
print(json.dumps({"manager": mgr, "median_us": statistics.median(times) * 1e6,
                  "worst_us": max(times) * 1e6, "total_ms": total * 1e3}))
"""


def run(mgr: str, pairs: int) -> dict | None:
    env = dict(os.environ)
    env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
    if mgr == "gpuptr":
        env["NUMBA_CUDA_MEMORY_MANAGER"] = "gpuptr.numba"
    elif mgr == "rmm":
        env["NUMBA_CUDA_MEMORY_MANAGER"] = "rmm.allocators.numba"
    p = subprocess.run([sys.executable, "-c", CHILD, mgr, str(pairs)], env=env,
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        print(f"{mgr}: failed\n{p.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    rows = [r for r in (run(m, pairs) for m in ("numba", "rmm", "gpuptr")) if r]
    print(f"busy GPU (1.5 s kernel on a non-blocking stream), {pairs} device_array(1 MiB) alloc+free pairs")
    print(f"{'manager':8s} {'median µs':>10s} {'worst µs':>12s} {'total ms':>10s}")
    for r in rows:
        print(f"{r['manager']:8s} {r['median_us']:10.1f} {r['worst_us']:12.1f} {r['total_ms']:10.2f}")
    by = {r["manager"]: r for r in rows}
    if "gpuptr" in by:
        g = by["gpuptr"]
        for other in ("numba", "rmm"):
            if other in by:
                o = by[other]
                print(f"gpuptr vs {other}: total {o['total_ms'] / g['total_ms']:.2f}x faster, "
                      f"median {o['median_us'] / g['median_us']:.2f}x")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
