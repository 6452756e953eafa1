"""Where the time of a CuPy capture + 10 replays goes, under gpuptr and
under CuPy's own pool: each phase timed apart (begin_capture, the three
captured kernels, end_capture, the replays, dropping the graph), and, under
gpuptr, the pool's counters per cycle (hits, misses, driver allocations).

Usage: python benches/graph_why.py [cycles]   (on the GPU; runs both, each
in its own process)
"""

import subprocess
import sys

CHILD = r"""
import json, sys, time, statistics
allocator, n = sys.argv[1], int(sys.argv[2])
if allocator == "gpuptr":
    import gpuptr
    gpuptr.install(numba=False)
import cupy as cp
x = cp.ones(1 << 18, dtype=cp.float32)
s = cp.cuda.Stream(non_blocking=True)
phases = {k: [] for k in ("begin", "kernels", "end", "replays", "drop")}
def cycle(record):
    t = [time.perf_counter_ns()]
    with s:
        s.begin_capture(); t.append(time.perf_counter_ns())
        a = x * 2.0
        b = a + 1.0
        out = b * 3.0
        t.append(time.perf_counter_ns())
        g = s.end_capture(); t.append(time.perf_counter_ns())
    for _ in range(10):
        g.launch(stream=s)
    s.synchronize(); t.append(time.perf_counter_ns())
    del g, a, b
    t.append(time.perf_counter_ns())
    if record:
        for k, (t0, t1) in zip(phases, zip(t, t[1:])):
            phases[k].append(t1 - t0)
    return out
for _ in range(50):
    cycle(False)
before = gpuptr.stats()[0] if allocator == "gpuptr" else None
for _ in range(n):
    cycle(True)
report = {k: round(statistics.median(v) / 1e3, 2) for k, v in phases.items()}
report["total_median_us"] = round(sum(report.values()), 2)
if before is not None:
    after = gpuptr.stats()[0]
    report["per_cycle"] = {k: round((after[k] - before[k]) / n, 3) for k in after
                           if isinstance(after[k], int) and after[k] != before[k]}
    report["graph_kept_bytes"] = gpuptr.graph_kept_bytes()
print(json.dumps(report))
"""

if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    for allocator in ("own", "gpuptr", "own", "gpuptr"):
        out = subprocess.run([sys.executable, "-c", CHILD, allocator, str(n)], capture_output=True, text=True, timeout=300)
        print(allocator, out.stdout.strip() or out.stderr.strip()[-800:], flush=True)
