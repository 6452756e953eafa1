"""Busy-GPU benchmark alone (it is also a pair of rows in
``python -m gpuptr bench``): host-side numba ``device_array(1 MiB)``
alloc+free while a 1.5 s kernel runs on a non-blocking stream, under
numba's default manager, RMM's pool and gpuptr, each in its own process.

Usage: python benches/busy_gpu.py [pairs] [--gc]   (on the GPU machine)

Python's garbage collector is off while timing (as in ``timeit``); with
``--gc`` it stays on, and its pauses land in the worst case of every manager.
The ``gpuptr+r`` row fills gpuptr's pool with 512 MiB first
(``gpuptr.reserve``), as RMM's pool reserves memory up front.
"""

from __future__ import annotations

import sys

from gpuptr.bench import busy_devarray


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--gc"]
    keep_gc = "--gc" in sys.argv[1:]
    pairs = int(args[0]) if args else 300
    rows = {}
    for name, manager, reserve in (("numba", None, 0), ("rmm", "rmm.allocators.numba", 0),
                                   ("gpuptr", "gpuptr.numba", 0), ("gpuptr+r", "gpuptr.numba", 512 << 20)):
        try:
            rows[name] = busy_devarray(manager, pairs, keep_gc, reserve)
        except Exception as e:
            print(f"{name}: failed: {e}", file=sys.stderr)
    print(f"busy GPU (1.5 s kernel on a non-blocking stream), {pairs} device_array(1 MiB) alloc+free pairs,"
          f" garbage collector {'on' if keep_gc else 'off'} while timing")
    print(f"{'manager':8s} {'median µs':>10s} {'p99 µs':>8s} {'worst µs':>12s} {'total ms':>10s}  kernel still running")
    for name, r in rows.items():
        print(f"{name:8s} {r['median_ns'] / 1e3:10.1f} {r['p99_ns'] / 1e3:8.1f} {r['worst_ns'] / 1e3:12.1f}"
              f" {r['total_ns'] / 1e6:10.2f}  {r['busy']}  slowest pairs {r['slowest_pairs']} ({r['slowest_us']} µs)")
        print(f"{'':8s} first pairs, µs: {r.get('first_us')}")
    g = rows.get("gpuptr")
    print("worst after the first pair (slow under every manager):",
          ", ".join(f"{n} {r['worst_after_first_ns'] / 1e3:.1f} µs" for n, r in rows.items()))
    for other in ("numba", "rmm"):
        if g and other in rows:
            o = rows[other]
            print(f"gpuptr vs {other}: total {o['total_ns'] / g['total_ns']:.2f}x, "
                  f"median {o['median_ns'] / g['median_ns']:.2f}x, worst {o['worst_ns'] / g['worst_ns']:.2f}x")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
