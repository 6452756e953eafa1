"""Reuse safety on every stream kind, on the GPU: a kernel that sleeps and
then writes a block freed at once must never write into a fresh allocation
(issue: non-blocking CuPy and torch side streams). Runs under the numba
plugin and through ``gpuptr.alloc``."""

from __future__ import annotations

import pytest

from helpers import run_plugin

pytestmark = pytest.mark.gpu

SCRIPT = r"""
import gc, sys
import numpy as np
from numba import cuda
from numba.cuda.cudadrv.devicearray import DeviceNDArray
import gpuptr

REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
N = 1 << 20

@cuda.jit
def late_write(a, ms, value):
    for _ in range(ms):
        cuda.nanosleep(1000000)
    i = cuda.grid(1)
    if i < a.size:
        a[i] = value

streams = {
    "legacy": cuda.default_stream(),
    "per-thread": cuda.per_thread_default_stream(),
    "numba-blocking": cuda.stream(),
}
try:
    import cupy as cp
    cs = cp.cuda.Stream(non_blocking=True)
    streams["cupy-non-blocking"] = cuda.external_stream(cs.ptr)
except Exception as e:
    print("no cupy:", e)
try:
    import torch
    ts = torch.cuda.Stream()
    streams["torch-side"] = cuda.external_stream(ts.cuda_stream)
except Exception as e:
    print("no torch:", e)

fill_cs = cp.cuda.Stream(non_blocking=True)   # kept alive: the handle must stay valid
fill = cuda.external_stream(fill_cs.ptr)
zeros = np.zeros(N, np.uint8)

def numba_array():
    return cuda.device_array(N, dtype=np.uint8)

def gpuptr_array():
    return DeviceNDArray(shape=(N,), strides=(1,), dtype=np.uint8, gpu_data=gpuptr.alloc(N))

bad_total = 0
for path, make in (("plugin", numba_array), ("gpuptr.alloc", gpuptr_array)):
    for name, s in streams.items():
        corrupted = 0
        for rep in range(REPS):
            a = make()
            late_write[N // 256, 256, s](a, 40, 0xAB)
            del a
            gc.collect()
            for _ in range(40):
                x = make(); del x
            gc.collect()
            fresh = [make() for _ in range(200)]
            for f in fresh:
                f.copy_to_device(zeros, stream=fill)
            cuda.synchronize()
            corrupted += sum(int(f.copy_to_host().any()) for f in fresh)
            del fresh
            gc.collect()
        print(f"{path:13s} {name:18s} reps={REPS} corrupted={corrupted}", flush=True)
        bad_total += corrupted
print("stats", gpuptr.stats()[0])
print("TOTAL_CORRUPTED", bad_total)
"""


def test_no_fresh_allocation_is_written_by_a_kernel_still_using_a_freed_block(tmp_path):
    out = run_plugin(SCRIPT.replace("sys.argv[1]", "'20'"), timeout=900)
    print(out)
    assert "TOTAL_CORRUPTED 0" in out, out
    # Every stream kind ran, on both paths.
    assert out.count("reps=20 corrupted=0") >= 6, out
