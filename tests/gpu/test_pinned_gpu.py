"""Pinned host memory on the GPU: a block CuPy frees right after queuing an
asynchronous copy from it is not handed out again before the copy ran, under
``gpuptr.install()``; CuPy's own pinned pool, in the same test, is the
control that shows the test can see such a reuse.

Each allocator runs in a fresh process (CuPy's pinned allocator is chosen
before the first pinned allocation); the child prints one JSON line.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

_CHILD = r"""
import json, sys
import numpy as np
import cupy as cp
mode = sys.argv[1]
if mode == "gpuptr":
    import gpuptr
    gpuptr.install(numba=False, torch=False)
N = 1 << 20
OLD, NEW = 0x11, 0x22
spin = cp.RawKernel(r'''
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}''', "spin")
s = cp.cuda.Stream(non_blocking=True)
dev = cp.zeros(N, dtype=cp.uint8)
spin((1,), (1,), (np.int64(1000),), stream=s)   # compile and load it first
s.synchronize()
reps = []
for rep in range(5):
    dev.fill(0)
    cp.cuda.Device().synchronize()
    pinned = cp.cuda.alloc_pinned_memory(N)
    old_ptr = pinned.ptr
    np.frombuffer(pinned, np.uint8, N)[:] = OLD
    # About 0.2 s of spinning on s, then the copy from the pinned block.
    spin((1,), (1,), (np.int64(400_000_000),), stream=s)
    cp.cuda.runtime.memcpyAsync(dev.data.ptr, old_ptr, N, cp.cuda.runtime.memcpyHostToDevice, s.ptr)
    del pinned                                     # freed while the copy waits
    new = cp.cuda.alloc_pinned_memory(N)
    np.frombuffer(new, np.uint8, N)[:] = NEW       # a new owner writes its data
    copy_pending = not s.done
    s.synchronize()
    got = dev.get()
    reps.append({"reused": new.ptr == old_ptr, "copy_pending": copy_pending,
                 "old": bool((got == OLD).all()), "new": int((got == NEW).sum())})
    del new
host = gpuptr.stats()[0]["host"] if mode == "gpuptr" else None
print(json.dumps({"reps": reps, "host": host}))
"""


def _run(mode):
    r = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
    assert r.returncode == 0, f"{mode}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_pinned_block_freed_during_its_async_copy_is_not_reused_before_the_copy_ran():
    pytest.importorskip("cupy")
    ours = _run("gpuptr")
    theirs = _run("native")
    print("gpuptr:", ours)
    print("CuPy's pinned pool:", theirs)
    # The copy was still queued when the block was freed and reallocated.
    assert all(r["copy_pending"] for r in ours["reps"]), ours
    # gpuptr: the device got the old data every time; the freed block was
    # not the new allocation's.
    assert all(r["old"] and r["new"] == 0 and not r["reused"] for r in ours["reps"]), ours
    assert ours["host"]["misses"] >= 2 and ours["host"]["held_bytes"] >= 2 << 20, ours["host"]
    # The control: CuPy's own pool hands the block straight back, and where
    # it did while the copy was pending, the device read the new owner's data.
    hazards = [r for r in theirs["reps"] if r["reused"] and r["copy_pending"]]
    if hazards:
        assert any(r["new"] > 0 for r in hazards), theirs
