"""Host-side numba ``device_array(1 MiB)`` alloc+free pairs while a 1.5 s
kernel runs on a non-blocking stream (``gpuptr.bench.spin``), under the
memory manager NUMBA_CUDA_MEMORY_MANAGER names: a JSON object with the
median, p99, worst and total ns, the slowest pairs, and whether the kernel
outlasted the loop.

Arguments: the manager (as in the environment; ``""`` for numba's own),
pairs, ``gc`` to leave Python's garbage collector on while timing (else
``nogc``), and bytes of 1 MiB blocks to fill gpuptr's pool with first."""

import gc
import json
import statistics
import sys
import time
from typing import Any, Dict

import numpy as np

manager, pairs, keep_gc, reserve = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "gc", int(sys.argv[4])
if manager == "rmm.allocators.numba":
    import rmm

    rmm.reinitialize(pool_allocator=True)
from numba import cuda  # noqa: E402  (after RMM's pool is set up)

from gpuptr.bench.spin import Spinner  # noqa: E402

busy = Spinner()  # and 20 pairs, on an idle GPU
if reserve:  # gpuptr's pool filled ahead of demand, as RMM's pool is
    import gpuptr

    gpuptr.reserve(reserve, 1 << 20)
cuda.synchronize()
busy.launch(1500)
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
still_busy = busy.busy  # the kernel outlasted the loop
busy.synchronize()
slowest = sorted(range(pairs), key=times.__getitem__)[-5:][::-1]
slowest_us = [round(times[i] * 1e6, 1) for i in slowest]
first_us = [round(t * 1e6, 1) for t in times[:12]]
after_first = max(times[1:]) * 1e9
times.sort()
pool: Dict[str, Any] = {}
if manager == "gpuptr.numba":
    import gpuptr

    st = gpuptr.stats()[0]
    pool = {k: st.get(k) for k in ("pool_hits", "pool_misses", "fences", "pool_bytes")}
print(json.dumps({
    "pool": pool, "median_ns": statistics.median(times) * 1e9, "p99_ns": times[int(0.99 * len(times))] * 1e9,
    "worst_ns": times[-1] * 1e9, "total_ns": total * 1e9, "busy": still_busy, "gc": keep_gc,
    "slowest_pairs": slowest, "slowest_us": slowest_us, "worst_after_first_ns": after_first, "first_us": first_us,
}))
