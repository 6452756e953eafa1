"""What a pinned host pair cost before gpuptr's host cache, timed raw
through cuda.bindings in a fresh process (no context held): the primary
context's retain and release with no other holder and held, cuMemHostAlloc
alone and cuMemFreeHost alone (4 KiB and 1 MiB, portable or not), a free
while the device is busy, and the old path's whole pair; a JSON object of
median ns.

Arguments: pairs per measurement."""

import json
import sys
import time
from typing import Any, Callable, Dict, List

from cuda.bindings import driver as cu

pairs = int(sys.argv[1])


def ok(r: Any) -> Any:
    err = r[0] if isinstance(r, tuple) else r
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA error {err}")
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r


def each_ns(fn: Callable[[], object], n: int) -> int:
    out = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t)
    return sorted(out)[len(out) // 2]


ok(cu.cuInit(0))
dev = ok(cu.cuDeviceGet(0))
res: Dict[str, int] = {}


# 1. The primary context retained and released while no one else holds it:
#    each pair creates and destroys the context (what gpuptr's alloc_host
#    did per pair before the host cache, when nothing else held a context).
def cold() -> None:
    ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuDevicePrimaryCtxRelease(dev))


res["retain_release_cold_ns"] = each_ns(cold, 5)
ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
ok(cu.cuCtxSetCurrent(ctx))
res["retain_release_held_ns"] = each_ns(cold, 100)
# 2. cuMemHostAlloc alone and cuMemFreeHost alone, with and without portable.
for name, flags in (("", 0), ("_portable", cu.CU_MEMHOSTALLOC_PORTABLE)):
    for size, label in ((4096, "4k"), (1 << 20, "1m")):
        ptrs: List[Any] = []
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


def old_pair() -> None:
    c = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(c))
    p = ok(cu.cuMemHostAlloc(1 << 20, cu.CU_MEMHOSTALLOC_PORTABLE))
    ok(cu.cuMemFreeHost(p))
    ok(cu.cuDevicePrimaryCtxRelease(dev))


res["old_pair_ns"] = each_ns(old_pair, 5)
print(json.dumps(res))
