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
