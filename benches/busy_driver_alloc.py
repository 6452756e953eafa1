"""What a driver allocation costs while the GPU is busy: each of 40
``cuMemAlloc(8 MiB)`` calls timed in order, on an idle GPU and while a
1.5 s kernel runs on a non-blocking stream (the pool's growth on a busy
device is one such call per 8 MiB), and then, with the kernel still running,
while a second thread waits in ``cuCtxSynchronize`` as gpuptr's fence thread
does (whether that wait slows the driver's allocations).
Usage: python benches/busy_driver_alloc.py
"""

from __future__ import annotations

import threading
import time

import cupy as cp
import numpy as np
from cuda.bindings import driver as cu
from numba import cuda


@cuda.jit
def spin(a, ms):
    for _ in range(ms):
        cuda.nanosleep(1000000)
    a[0] = 1


def timed_allocs(n: int, size: int) -> tuple[list[float], list]:
    times, ptrs = [], []
    for _ in range(n):
        t = time.perf_counter()
        err, p = cu.cuMemAlloc(size)
        times.append((time.perf_counter() - t) * 1e6)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        ptrs.append(p)
    return times, ptrs


def main() -> None:
    cuda.current_context()  # numba's primary context, current on this thread
    flag = cuda.device_array(1, np.int32)
    idle, ptrs = timed_allocs(40, 8 << 20)
    for p in ptrs:
        cu.cuMemFree(p)
    cs = cp.cuda.Stream(non_blocking=True)
    s = cuda.external_stream(cs.ptr)
    spin[1, 1, s](flag, 1500)
    busy, ptrs = timed_allocs(40, 8 << 20)
    bigger = {}
    for mib in (32, 64, 128):
        bigger[mib], more = timed_allocs(8, mib << 20)
        ptrs += more
    # A thread in cuCtxSynchronize beside the allocations, as the fence
    # thread is while the GPU is busy.
    _, ctx = cu.cuCtxGetCurrent()
    waiting = threading.Event()

    def fence() -> None:
        cu.cuCtxSetCurrent(ctx)
        waiting.set()
        cu.cuCtxSynchronize()

    t = threading.Thread(target=fence, daemon=True)
    t.start()
    waiting.wait()
    time.sleep(0.001)  # into the driver's wait
    synced, more = timed_allocs(40, 8 << 20)
    ptrs += more
    synced64, more = timed_allocs(8, 64 << 20)
    ptrs += more
    still = not cs.done
    s.synchronize()
    for p in ptrs:
        cu.cuMemFree(p)
    fmt = lambda ts: " ".join(f"{t:.0f}" for t in ts)  # noqa: E731
    print(f"cuMemAlloc(8 MiB), µs each, in order; idle: {fmt(idle)}")
    print(f"busy (kernel still running: {still}): {fmt(busy)}")
    for mib, ts in bigger.items():
        print(f"busy, cuMemAlloc({mib} MiB): {fmt(ts)}")
    print(f"busy, a thread in cuCtxSynchronize: {fmt(synced)}")
    print(f"busy, a thread in cuCtxSynchronize, cuMemAlloc(64 MiB): {fmt(synced64)}")
    t.join()


if __name__ == "__main__":
    main()
