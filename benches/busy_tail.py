"""Where the busy-GPU tail goes: 300 numba ``device_array(1 MiB)`` pairs
under gpuptr.numba while a 1.5 s kernel runs on a non-blocking stream (the
busy rows of ``python -m gpuptr bench``), each slow pair (over 50 µs) put
down to what happened in it: a miss that called the driver on the
allocating thread, a wait for the growth helper, a growth on the helper
(the driver busy with it), or nothing of the pool's (the scheduler, the
interpreter). The pool's DEBUG records give the growths and waits; its
counters, read between pairs (outside the timed region), the misses.

Usage: python benches/busy_tail.py [runs]   (on the GPU machine; on the
simulator the kernel cannot run, so the script says so and stops)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import gc, json, logging, time
import numpy as np
from numba import cuda
import gpuptr
from gpuptr.bench.records import keep
records = keep(logging.DEBUG)
from gpuptr.bench.spin import Spinner

spinner = Spinner()
cuda.synchronize()
gc.collect(); gc.disable()
spinner.launch(1500)
pairs = []
t0 = time.time()
for _ in range(300):
    m = gpuptr.stats()[0]["pool_misses"]
    t = time.time()
    a = cuda.device_array(1 << 20, np.uint8)
    del a
    pairs.append((t - t0, time.time() - t, gpuptr.stats()[0]["pool_misses"] - m))
gc.enable()
busy = spinner.busy
spinner.synchronize()
print(json.dumps({"pairs": pairs, "busy": busy, "pool_bytes": gpuptr.stats()[0]["pool_bytes"],
                  "records": [(c - t0, m) for c, _, m in records if c >= t0 - 0.001]}))
"""


def classify(out: dict) -> dict:
    """Each pair over 50 µs after the first, by cause."""
    growth = [(t, m) for t, m in out["records"] if "cuMemAlloc of" in m]
    waits = [(t, m) for t, m in out["records"] if "waited" in m]
    causes: dict = {}
    for i, (start, took, missed) in enumerate(out["pairs"][1:], 1):
        if took < 50e-6:
            continue
        end = start + took
        if missed:
            why = "a miss: the driver, on the allocating thread"
        elif any(start - 1e-4 <= t <= end + 1e-4 for t, _ in waits):
            why = "waited for the growth helper"
        elif any(start - 1e-4 <= t <= end + 3e-4 for t, _ in growth):
            why = "a growth on the helper meanwhile"
        else:
            why = "nothing of the pool's (scheduler, interpreter)"
        causes.setdefault(why, []).append((i, round(took * 1e6, 1)))
    return causes


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    if os.environ.get("GPUPTR_DRIVER") == "sim":
        print("busy_tail: needs a GPU (the simulator runs no kernel to be busy with)")
        return 0
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="gpuptr.numba")
    for run in range(runs):
        r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            print("failed:", r.stderr[-1500:])
            return 1
        out = json.loads(r.stdout.strip().splitlines()[-1])
        times = sorted(p[1] for p in out["pairs"])
        after = max(p[1] for p in out["pairs"][1:])
        print(f"run {run}: median {times[150] * 1e6:.1f} us, p99 {times[296] * 1e6:.1f} us, "
              f"worst after the first {after * 1e6:.1f} us, total {sum(times) * 1e3:.2f} ms, "
              f"misses {sum(p[2] for p in out['pairs'])}, pool {out['pool_bytes'] >> 20} MiB, busy {out['busy']}")
        for why, which in classify(out).items():
            print(f"   {len(which):3d} slow pair(s): {why}: {which[:8]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
