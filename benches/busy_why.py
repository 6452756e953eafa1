"""Where the busy-GPU tail goes: gpuptr's busy-GPU child (numba
``device_array(1 MiB)`` alloc+free pairs while a 1.5 s kernel runs on a
non-blocking stream) run alone, and run while this process holds a CUDA
context of its own on the same GPU (as ``python -m gpuptr bench`` does),
with gpuptr's pool records (growth, growth ahead, refused growth) and the
slow pairs on one clock.

Usage: python benches/busy_why.py   (on the GPU machine)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, logging, sys, time
import numpy as np
from numba import cuda
import gpuptr
from gpuptr.bench.records import keep
records = keep(logging.DEBUG)
from gpuptr.bench.spin import Spinner

busy = Spinner()  # the bench's busy rows' start: and 20 idle device_array pairs
cuda.synchronize()
import gc
gc.collect(); gc.disable()
busy.launch(1500)
pairs = []
t0 = time.time()
for _ in range(300):
    t = time.time()
    a = cuda.device_array(1 << 20, np.uint8)
    del a
    pairs.append((t, time.time() - t))
gc.enable()
busy.synchronize()
gpuptr.flush_pool()
st = gpuptr.stats()[0]
slow = sorted(range(300), key=lambda i: pairs[i][1])[-8:][::-1]
times = sorted(p[1] for p in pairs)
print(json.dumps({
    "p99_us": times[int(0.99 * 300)] * 1e6, "median_us": times[150] * 1e6,
    "slow": [(i, round((pairs[i][0] - t0) * 1e6), round(pairs[i][1] * 1e6, 1)) for i in slow],
    "records": [(round((c - t0) * 1e6), m[:150]) for c, _, m in records if c >= t0 - 0.01],
    "misses": st["pool_misses"], "hits": st["pool_hits"], "pool_bytes": st["pool_bytes"],
}))
"""


def child(label: str) -> None:
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="gpuptr.numba")
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        print(label, "failed:", r.stderr[-1500:])
        return
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"== {label}: p99 {out['p99_us']:.1f} us, median {out['median_us']:.1f} us, "
          f"misses {out['misses']}, hits {out['hits']}, pool {out['pool_bytes'] >> 20} MiB")
    print("   slowest pairs (index, start us, took us):", out["slow"])
    for t, m in out["records"][:40]:
        print(f"   {t:>9} us  {m}")


def main() -> int:
    child("alone")
    import gpuptr

    held = gpuptr.alloc(4 << 20)  # this process now holds a context on the GPU
    child("with another process's context on the GPU")
    del held
    gpuptr.release_contexts()
    child("alone again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
