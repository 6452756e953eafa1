"""gpuptr's pinned pair, ``alloc_host(1 MiB, portable=True)`` + free, in a
fresh process that holds no context (``alloc_host`` holds it from its first
call): the first five pairs' ns, the best ns per pair after them, and the
host cache's counters, as a JSON object."""

import json
import time

import gpuptr

first = []
for _ in range(5):
    t = time.perf_counter_ns()
    gpuptr.alloc_host(1 << 20, portable=True).free()
    first.append(time.perf_counter_ns() - t)
from gpuptr.bench._timing import best_ns  # noqa: E402  (after the first pairs: nothing else runs before them)

ns = best_ns(lambda: gpuptr.alloc_host(1 << 20, portable=True).free(), 2000, 5)
print(json.dumps({"first_pairs_ns": first, "pair_ns": ns, "host": gpuptr.stats()[0]["host"]}))
