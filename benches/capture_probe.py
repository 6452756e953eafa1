"""What CUDA allows while another thread captures a stream (run on a GPU).

For each case, thread A begins a capture (global mode) on a non-blocking
stream and queues a memset into it; thread B, in the capture mode the case
names, makes one driver call; then A ends the capture. Printed per case:
B's call result and A's end-capture result (invalidated or not). This is
the fact base for gpuptr's capture-aware fence and growth helpers.
"""
import sys
import threading

from cuda.bindings import driver as cu


def ok(r):
    err = r[0] if isinstance(r, tuple) else r
    return err == cu.CUresult.CUDA_SUCCESS, err


def check(r):
    good, err = ok(r)
    if not good:
        raise RuntimeError(err)
    return r[1:] if isinstance(r, tuple) and len(r) > 1 else None


check(cu.cuInit(0))
(dev,) = check(cu.cuDeviceGet(0))
(ctx,) = check(cu.cuDevicePrimaryCtxRetain(dev))
check(cu.cuCtxSetCurrent(ctx))
(buf,) = check(cu.cuMemAlloc(1 << 20))
(spare,) = check(cu.cuMemAlloc(1 << 20))
(other,) = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
(ev,) = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
MODES = {
    "global": cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL,
    "thread_local": cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    "relaxed": cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED,
}


PRE = {}


def call(name):
    if name == "cuMemAlloc":
        r = cu.cuMemAlloc(1 << 20)
        if ok(r)[0]:
            cu.cuMemFree(r[1])
        return r
    if name == "cuMemFree":
        return cu.cuMemFree(PRE.pop("free"))
    if name == "cuCtxSynchronize":
        return cu.cuCtxSynchronize()
    if name == "cuMemGetInfo":
        return cu.cuMemGetInfo()
    if name == "cuStreamSynchronize(other)":
        return cu.cuStreamSynchronize(other)
    if name == "cuEventRecord+Query(other)":
        r = cu.cuEventRecord(ev, other)
        return r if not ok(r)[0] else cu.cuEventQuery(ev)
    if name == "cuStreamQuery(legacy)":
        return cu.cuStreamQuery(cu.CUstream(0))
    raise ValueError(name)


def case(b_mode, name, same_thread=False):
    started, done = threading.Event(), threading.Event()
    out = {}
    if name == "cuMemFree":
        (PRE["free"],) = check(cu.cuMemAlloc(4096))

    def a():
        check(cu.cuCtxSetCurrent(ctx))
        (s,) = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        check(cu.cuStreamBeginCapture(s, MODES["global"]))
        check(cu.cuMemsetD8Async(buf, 1, 1 << 20, s))
        if same_thread:
            (prev,) = check(cu.cuThreadExchangeStreamCaptureMode(MODES[b_mode]))
            out["call"] = ok(call(name))
            cu.cuThreadExchangeStreamCaptureMode(prev)
        else:
            started.set()
            done.wait()
        r = cu.cuStreamEndCapture(s)
        out["end"] = ok(r)
        if ok(r)[0] and r[1]:
            cu.cuGraphDestroy(r[1])
        cu.cuStreamDestroy(s)

    def b():
        check(cu.cuCtxSetCurrent(ctx))
        started.wait()
        check(cu.cuThreadExchangeStreamCaptureMode(MODES[b_mode]))
        out["call"] = ok(call(name))
        done.set()

    ta = threading.Thread(target=a)
    ta.start()
    if not same_thread:
        tb = threading.Thread(target=b)
        tb.start()
        tb.join()
    ta.join()
    cu.cuCtxSynchronize()
    where = "capturing thread" if same_thread else "other thread"
    (cg, ce), (eg, ee) = out["call"], out["end"]
    print(f"{where:16} {b_mode:12} {name:28} call={'ok' if cg else ce.name:45} capture={'ok' if eg else ee.name}")


print(f"driver {check(cu.cuDriverGetVersion())[0]}")
for mode in ("global", "relaxed", "thread_local"):
    for name in ("cuMemAlloc", "cuMemFree", "cuCtxSynchronize", "cuMemGetInfo",
                 "cuStreamSynchronize(other)", "cuEventRecord+Query(other)", "cuStreamQuery(legacy)"):
        case(mode, name)
for mode in ("global", "relaxed"):
    for name in ("cuMemAlloc", "cuMemFree", "cuCtxSynchronize"):
        case(mode, name, same_thread=True)
sys.stdout.flush()
