"""Why the pool holds more than its budget: each case in a child process of
its own, gpuptr's pool records counted by kind (``--debug``: DEBUG records,
which slow the loop down and change its timing; default: WARNING and up).

Cases:
  a     trace (a) of the footprint rows (three 1 MiB blocks, 2000 times,
        ``stats()`` after every allocation): the peak the pool held
  b     trace (b) (mixed 512 B to 256 MiB, 2 GiB live): peak held / peak live
  soak  numba ``device_array`` pairs of 256 B to 1 MiB under gpuptr.numba
        (the GPU soak test's sizes), no kernel launched: the bytes the
        device lost against the bytes the pool says it holds, at the end and
        after ``trim()``

Usage: python benches/footprint_why.py [--debug] [--runs N] [case ...]
(on a GPU machine; default: every case, three runs each)
"""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = r"""
import collections, logging, re, sys
import gpuptr
from gpuptr.bench.records import keep
records = keep(logging.DEBUG if sys.argv[2] == "debug" else logging.WARNING)
M = 2 ** 20
case = sys.argv[1]
if case in ("a", "b"):
    from gpuptr.bench.footprint import trace_a, trace_b
    ops = trace_a() if case == "a" else trace_b()
    live, sizes, total, top_live, top = {}, {}, 0, 0, 0
    for k, n in ops:
        if n:
            live[k] = gpuptr.alloc(n)
            sizes[k] = n
            total += n
            top_live = max(top_live, total)
            top = max(top, int(gpuptr.stats()[0]["pool_bytes"]))
        elif k in live:
            del live[k]
            total -= sizes.pop(k)
    top = max(top, int(gpuptr.stats()[0]["peak_pool_bytes"]))
    print(f"{case}: peak held {top / M:.1f} MiB, {top / top_live:.3f}x the peak live")
else:
    import numpy as np
    from numba import cuda
    sizes = [256, 4096, 65536, 1 << 20, 3000, 12345]
    cuda.current_context()
    free0, _ = gpuptr.context(0).get_memory_info()
    for i in range(int(sys.argv[3])):
        a = cuda.device_array(sizes[i % 6], dtype=np.uint8)
        b = cuda.device_array(sizes[(i * 7) % 6], dtype=np.uint8)
        del a, b
    s = gpuptr.stats()[0]
    free1, _ = gpuptr.context(0).get_memory_info()
    gpuptr.trim()
    free2, _ = gpuptr.context(0).get_memory_info()
    print(f"soak: the device lost {(free0 - free1) / M:.1f} MiB, the pool holds {s['pool_bytes'] / M:.1f} MiB"
          f" (peak {s['peak_pool_bytes'] / M:.1f}); after trim() the device lost {(free0 - free2) / M:.1f} MiB")
kinds = collections.Counter((lv, re.sub(r"[0-9]+", "N", m)[:100]) for _, lv, m in records)
for (lv, k), v in kinds.most_common(12):
    print(f"    {v:6d} {lv} {k}")
"""


def main() -> int:
    args = sys.argv[1:]
    debug = "--debug" in args
    runs = 3
    if "--runs" in args:
        runs = int(args[args.index("--runs") + 1])
    cases = [a for a in args if a in ("a", "b", "soak")] or ["a", "b", "soak"]
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="gpuptr.numba")
    for case in cases:
        for _ in range(runs):
            r = subprocess.run([sys.executable, "-c", CHILD, case, "debug" if debug else "quiet", "500000"],
                               env=env, capture_output=True, text=True, timeout=300)
            said = [line for line in r.stderr.splitlines() if line.strip(" :")]
            out = r.stdout.strip() or f"{case}: failed: {said[-1] if said else r.returncode}"
            print(out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
