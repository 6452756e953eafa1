"""What growing a pool costs while the GPU is busy, by way of each driver
path, each case in a fresh child process (the first busy call is the slow
one). A 1.5 s kernel runs on a non-blocking stream; times are µs per call,
in order. Usage: python benches/busy_probe.py [case ...]   (on the GPU)

Cases:
  alloc        cuMemAlloc(8 MiB) x12 right after the launch
  alloc-late   the same, 5 ms after the launch
  alloc-sync   the same while another thread waits in cuCtxSynchronize
  alloc-small  cuMemAlloc(2 MiB) first, then 8 MiB x8
  alloc-pre    idle: one cuMemAlloc+cuMemFree of 8 MiB just before the launch
  async        cuMemAllocAsync(8 MiB) x12 from the device's default pool
               (release threshold: max) on a private non-blocking stream
  vmm          cuMemCreate + cuMemMap + cuMemSetAccess of 8 MiB x6, per step
  other        the latency another thread sees in cuCtxGetCurrent and
               cuPointerGetAttribute while this one makes the first busy
               cuMemAlloc (does growth on a helper thread stall the others?)
  thread       the first busy cuMemAlloc made on a helper thread, then
               x12 more on the main thread
  growth       (alone) the busy loop under gpuptr.numba with its DEBUG log:
               the slow pairs, and the pool's growths and fences in time
  first        (alone) under gpuptr.numba with a reservation: Python, a
               driver call, gpuptr.alloc+free and device_array, each timed
               right after the launch, in several orders
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

CASES = ["alloc", "alloc-late", "alloc-sync", "alloc-small", "alloc-pre", "async", "vmm", "other", "thread"]

SPIN = r"""
extern "C" __global__ void spin(int ms, int* flag) {
    for (int i = 0; i < ms; ++i) __nanosleep(1000000);
    *flag = 1;
}
"""


def check(r):  # type: ignore[no-untyped-def]
    err = r[0] if isinstance(r, tuple) else r
    from cuda.bindings import driver as cu

    assert err == cu.CUresult.CUDA_SUCCESS, err
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r


def us(t: float) -> float:
    return round((time.perf_counter() - t) * 1e6, 1)


def child(case: str) -> dict:
    import cupy as cp
    from cuda.bindings import driver as cu

    cp.cuda.Device(0).use()
    flag = cp.zeros(1, dtype=cp.int32)
    spin = cp.RawKernel(SPIN, "spin")
    spin((1,), (1,), (cp.int32(0), flag))  # compile and load, on an idle GPU
    cp.cuda.Device(0).synchronize()
    ctx = check(cu.cuCtxGetCurrent())
    mb8 = 8 << 20
    for _ in range(8):  # the driver warm on an idle GPU
        check(cu.cuMemFree(check(cu.cuMemAlloc(mb8))))
    out: dict = {"case": case}
    keep = []
    stream = cp.cuda.Stream(non_blocking=True)

    def launch() -> None:
        with stream:
            spin((1,), (1,), (cp.int32(1500), flag))

    def allocs(n: int, size: int) -> list:
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            keep.append(check(cu.cuMemAlloc(size)))
            ts.append(us(t))
        return ts

    if case == "alloc-pre":
        check(cu.cuMemFree(check(cu.cuMemAlloc(mb8))))
    if case == "async":
        pool = check(cu.cuDeviceGetDefaultMemPool(0))
        check(cu.cuMemPoolSetAttribute(pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                       cu.cuuint64_t(2**64 - 1)))
        private = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    t_launch = time.perf_counter()
    launch()
    out["launch_us"] = us(t_launch)
    if case == "alloc-late":
        time.sleep(0.005)
    if case == "alloc-sync":
        def sync() -> None:
            check(cu.cuCtxSetCurrent(ctx))
            check(cu.cuCtxSynchronize())
        th = threading.Thread(target=sync)
        th.start()
        time.sleep(0.001)
    if case in ("alloc", "alloc-late", "alloc-sync", "alloc-pre"):
        out["times"] = allocs(12, mb8)
    elif case == "alloc-small":
        out["first_2MiB"] = allocs(1, 2 << 20)
        out["times"] = allocs(8, mb8)
    elif case == "async":
        ts = []
        for _ in range(12):
            t = time.perf_counter()
            check(cu.cuMemAllocAsync(mb8, private))
            ts.append(us(t))
        out["times"] = ts
    elif case == "vmm":
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        acc = cu.CUmemAccessDesc()
        acc.location = prop.location
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        va = check(cu.cuMemAddressReserve(mb8 * 8, 0, 0, 0))
        steps = []
        for i in range(6):
            t = time.perf_counter()
            h = check(cu.cuMemCreate(mb8, prop, 0))
            a = us(t)
            t = time.perf_counter()
            check(cu.cuMemMap(int(va) + i * mb8, mb8, 0, h, 0))
            b = us(t)
            t = time.perf_counter()
            check(cu.cuMemSetAccess(int(va) + i * mb8, mb8, [acc], 1))
            steps.append((a, b, us(t)))
        out["create_map_access"] = steps
    elif case == "other":
        probe = keep and keep[0] or check(cu.cuMemAlloc(4096))
        lat: list = []
        stop = threading.Event()

        def spinner() -> None:
            check(cu.cuCtxSetCurrent(ctx))
            attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT
            while not stop.is_set():
                t = time.perf_counter()
                cu.cuCtxGetCurrent()
                a = us(t)
                t = time.perf_counter()
                cu.cuPointerGetAttribute(attr, probe)
                lat.append((a, us(t)))
        th = threading.Thread(target=spinner)
        th.start()
        time.sleep(0.002)
        n0 = len(lat)
        out["times"] = allocs(3, mb8)
        time.sleep(0.001)
        stop.set()
        th.join()
        during = lat[n0:]
        out["other_max_us"] = [max(x[0] for x in during), max(x[1] for x in during)]
        out["other_calls"] = len(during)
    elif case == "thread":
        res: list = []

        def grow() -> None:
            check(cu.cuCtxSetCurrent(ctx))
            t = time.perf_counter()
            res.append(check(cu.cuMemAlloc(mb8)))
            res.append(us(t))
        th = threading.Thread(target=grow)
        th.start()
        th.join()
        keep.append(res[0])
        out["helper_first"] = res[1]
        out["times"] = allocs(12, mb8)
    out["still_busy"] = not stream.done
    stream.synchronize()
    for p in keep:
        check(cu.cuMemFree(p))
    return out


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return 0
    if sys.argv[1:] == ["first"]:
        first_pairs()
        return 0
    if sys.argv[1:] == ["growth"]:
        growth()
        return 0
    for case in sys.argv[1:] or CASES:
        for rep in range(2):
            r = subprocess.run([sys.executable, __file__, "--child", case], capture_output=True, text=True, timeout=120)
            line = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else \
                f"failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
            print(f"{case} #{rep}: {line}", flush=True)
    return 0



FIRST = r"""
# What is slow in the first pair after a launch (every manager's pair 0 is):
# each operation timed alone right after the launch, in the order given.
import json, sys, time, gc
import numpy as np
from numba import cuda
from gpuptr.bench.spin import Spinner
order = sys.argv[1].split(",")
delay = float(sys.argv[2])
busy = Spinner()  # the bench's busy rows' start: and 20 idle device_array pairs
import gpuptr
from cuda.bindings import driver as cu
gpuptr.reserve(64 << 20, 1 << 20)
cuda.synchronize()
busy.launch(5)  # launch once on an idle GPU: compiled and loaded
cuda.synchronize()
def py():
    x = [i for i in range(20)]
def drv():
    cu.cuCtxGetCurrent()
def gp():
    gpuptr.alloc(1 << 20).free()
def dev():
    a = cuda.device_array(1 << 20, np.uint8)
    del a
ops = {"py": py, "drv": drv, "gpuptr": gp, "devarray": dev}
gc.collect(); gc.disable()
busy.launch(1500)
if delay:
    time.sleep(delay)
out = {}
for name in order:
    ts = []
    for _ in range(4):
        t = time.perf_counter(); ops[name](); ts.append(round((time.perf_counter() - t) * 1e6, 1))
    out[name] = ts
out["still_busy"] = busy.busy
busy.synchronize()
print(json.dumps(out))
"""


GROWTH = r"""
# The busy-GPU loop of `gpuptr bench` under gpuptr.numba, with gpuptr's DEBUG
# log on: where the time of the slow pairs goes (growth, the driver, fences).
import json, sys, time, gc, logging
import numpy as np
from numba import cuda
import gpuptr
recs = []
class H(logging.Handler):
    def emit(self, r):
        recs.append((r.created, r.threadName, r.getMessage()))
lg = logging.getLogger("gpuptr"); lg.addHandler(H()); lg.setLevel(logging.DEBUG); lg.propagate = False
from gpuptr.bench.spin import Spinner
busy = Spinner()  # the bench's busy rows' start: and 20 idle device_array pairs
cuda.synchronize()
busy.launch(1500)
gc.collect(); gc.disable()
recs.clear()
wall0, pc0 = time.time(), time.perf_counter()
times, starts = [], []
for _ in range(300):
    t = time.perf_counter()
    a = cuda.device_array(1 << 20, np.uint8)
    del a
    times.append(time.perf_counter() - t); starts.append(t - pc0)
gpuptr.stats()  # an entry point: delivers the queued records
still_busy = busy.busy
busy.synchronize()
slow = sorted(range(300), key=times.__getitem__)[-6:][::-1]
print("slow pairs:", [(i, round(starts[i] * 1e6), round(times[i] * 1e6, 1)) for i in slow])
print("first:", [round(x * 1e6, 1) for x in times[:16]], "busy", still_busy)
for c, th, m in recs:
    print(f"  {(c - wall0) * 1e6:9.0f} us {th}: {m}")
"""


def growth() -> None:
    import os
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="gpuptr.numba")
    for rep in range(2):
        r = subprocess.run([sys.executable, "-c", GROWTH], env=env, capture_output=True, text=True, timeout=120)
        print(f"growth #{rep}:\n{r.stdout[-6000:]}{r.stderr[-500:] if r.returncode else ''}", flush=True)


def first_pairs() -> None:
    import os
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="gpuptr.numba")
    for order, delay in (("devarray,py,drv,gpuptr", 0), ("py,drv,gpuptr,devarray", 0),
                         ("gpuptr,devarray,py,drv", 0), ("devarray,py,drv,gpuptr", 0.005)):
        for rep in range(2):
            r = subprocess.run([sys.executable, "-c", FIRST, order, str(delay)], env=env,
                               capture_output=True, text=True, timeout=120)
            line = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else r.stderr[-300:]
            print(f"first {order} delay {delay} #{rep}: {line}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
