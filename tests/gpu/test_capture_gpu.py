"""Stream capture on the GPU: gpuptr's own driver allocations and frees never
fail, nor invalidate a capture, because another thread captures a stream in
global mode (CUDA's rule, measured by ``benches/capture_probe.py``). A raw
``cuMemAlloc`` from a global-mode thread is the control: it breaks the capture.

What is not covered yet (issue: CUDA graphs and out of memory): the pool's
fence (``cuCtxSynchronize``) is refused, and invalidates the capture, in every
capture mode, so frees that need a fence during a capture still break it.
"""
import threading

import pytest

import gpuptr

pytestmark = pytest.mark.gpu
cu = pytest.importorskip("cuda.bindings.driver")


def _ok(r):
    err = r[0] if isinstance(r, tuple) else r
    return err == cu.CUresult.CUDA_SUCCESS


def _capture_while(work):
    """Capture a memset on a non-blocking stream in global mode on one thread
    while ``work`` runs on another; whether the capture ended intact."""
    ctx = gpuptr.context(0)
    raw = cu.CUcontext(int(ctx.handle))
    buf = gpuptr.alloc(1 << 20)
    started, done = threading.Event(), threading.Event()
    out = {}

    def capture():
        cu.cuCtxSetCurrent(raw)
        err, s = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        assert _ok(err)
        assert _ok(cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
        assert _ok(cu.cuMemsetD8Async(cu.CUdeviceptr(buf.device_pointer_value), 7, 1 << 20, s))
        started.set()
        done.wait(30)
        r = cu.cuStreamEndCapture(s)
        out["intact"] = _ok(r)
        if _ok(r):
            cu.cuGraphDestroy(r[1])
        cu.cuStreamDestroy(s)

    def other():
        cu.cuCtxSetCurrent(raw)
        started.wait(30)
        try:
            out["work"] = work()
        finally:
            done.set()

    threads = [threading.Thread(target=capture), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    buf.free()
    return out["intact"], out["work"]


def test_a_raw_global_mode_allocation_breaks_another_threads_capture():
    def raw_alloc():
        r = cu.cuMemAlloc(1 << 20)
        if _ok(r):
            cu.cuMemFree(r[1])
        return _ok(r)

    intact, allocated = _capture_while(raw_alloc)
    assert not allocated and not intact


def test_gpuptr_allocations_during_another_threads_capture_leave_it_intact():
    gpuptr.trim()

    def allocate():
        # New classes: each a pool miss and a driver allocation. They are
        # freed after the capture (a free now would need the pool's fence).
        return [gpuptr.alloc((5 << 20) + k * (1 << 20)) for k in range(8)]

    intact, held = _capture_while(allocate)
    assert intact, "the capture was invalidated"
    assert len(held) == 8
    for m in held:
        m.free()
    # The trim's driver frees, too, run relaxed; nothing captures now.
    assert gpuptr.trim() >= 8 * (5 << 20)


_CUPY_CAPTURES = r"""
import json, sys, threading
import cupy as cp
if sys.argv[1] == "gpuptr":
    import gpuptr
    print(gpuptr.install(numba=False, torch=False), file=sys.stderr)
stop, failures, pairs = threading.Event(), [], [0]

def churn():
    # cp.empty + a kernel + free on this thread's own non-blocking stream,
    # sizes varied so that the pool misses too.
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        k = 0
        while not stop.is_set():
            try:
                a = cp.empty((1 << 18) + 4096 * (k % 64), dtype=cp.uint8)
                a.fill(3)
                del a
                pairs[0] += 1
            except Exception as e:
                failures.append(repr(e)[:200])
            k += 1

t = threading.Thread(target=churn)
t.start()
x = cp.arange(1 << 20, dtype=cp.float32)
y = cp.zeros_like(x)
s = cp.cuda.Stream(non_blocking=True)
ok = invalidated = wrong = 0
errors = []
for i in range(60):
    try:
        with s:
            s.begin_capture()
            cp.multiply(x, float(i + 1), out=y)
            g = s.end_capture()
        g.launch(stream=s)
        s.synchronize()
        if bool((y == x * (i + 1)).all()):
            ok += 1
        else:
            wrong += 1
    except Exception as e:
        invalidated += 1
        errors.append(repr(e)[:200])
stop.set()
t.join()
print(json.dumps({"ok": ok, "invalidated": invalidated, "wrong": wrong,
                  "alloc_failures": len(failures), "pairs": pairs[0],
                  "errors": errors[:3], "failures": failures[:3]}))
"""


def _run_cupy_captures(allocator):
    import json
    import subprocess
    import sys

    pytest.importorskip("cupy")
    r = subprocess.run(
        [sys.executable, "-c", _CUPY_CAPTURES, allocator], capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_cupy_captures_while_another_thread_allocates_as_under_cupys_own_pool():
    own = _run_cupy_captures("cupy")
    ours = _run_cupy_captures("gpuptr")
    print("CuPy's pool:", own, "gpuptr:", ours)
    assert own["ok"] == 60, own
    assert ours["invalidated"] == 0 and ours["wrong"] == 0, ours
    assert ours["ok"] == 60 and ours["alloc_failures"] == 0, ours
    assert ours["pairs"] > 0, "the other thread allocated meanwhile"
