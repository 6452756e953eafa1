"""CUDA graphs and out of memory on the GPU, through each library as its users
write it, against that library's own allocator in the same test run.

Each case runs in a fresh process (an allocator is chosen before the first
allocation): ``native`` is the library's own allocator, ``gpuptr`` is
``gpuptr.install()``. The child prints one JSON line.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def _run(script, mode, timeout=300, env=None):
    e = dict(os.environ)
    e.update(env or {})
    r = subprocess.run(
        [sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=timeout, env=e
    )
    assert r.returncode == 0, f"{mode}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


_TORCH_GRAPH = r"""
import gc, json, sys, time
import torch
if sys.argv[1] == "gpuptr":
    import gpuptr
    gpuptr.install(numba=False, cupy=False)
N = 1 << 20
x = torch.randn(N, device="cuda")

def f(x):
    a = x * 2.0          # intermediates allocated (and freed) during capture
    b = a + 1.0
    return b * 3.0       # the graph's output: 6x + 3

s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        f(x)
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    out = f(x)
kept_during = 0
if sys.argv[1] == "gpuptr":
    kept_during = gpuptr.graph_kept_bytes(0)
# Other tensors, made while the graph replays: none may share its memory.
sentinels = [torch.full((N,), 7.0, device="cuda") for _ in range(40)]
wrong_outputs = 0
for r in range(10):
    x.copy_(torch.full((N,), float(r), device="cuda"))
    g.replay()
    sentinels.append(torch.full((N,), 7.0, device="cuda"))
    torch.cuda.synchronize()
    if not torch.allclose(out, torch.full((N,), 6.0 * r + 3.0, device="cuda")):
        wrong_outputs += 1
torch.cuda.synchronize()
corrupted = sum(int(not bool((t == 7.0).all())) for t in sentinels)
kept_after = -1
if sys.argv[1] == "gpuptr":
    del g, out
    gc.collect()
    torch.cuda.synchronize()
    for _ in range(200):  # the graph's destructor may run on a driver thread
        kept_after = gpuptr.graph_kept_bytes(0)
        if kept_after == 0:
            break
        time.sleep(0.01)
print(json.dumps({"corrupted": corrupted, "sentinels": len(sentinels), "wrong_outputs": wrong_outputs,
                  "kept_during": kept_during, "kept_after": kept_after}))
"""


def test_torch_cuda_graph_memory_is_not_reused_while_the_graph_replays():
    pytest.importorskip("torch")
    native = _run(_TORCH_GRAPH, "native")
    ours = _run(_TORCH_GRAPH, "gpuptr")
    print("torch's allocator:", native, "gpuptr:", ours)
    assert native["corrupted"] == 0 and native["wrong_outputs"] == 0, native
    assert ours["corrupted"] == 0, ours
    assert ours["wrong_outputs"] == 0, ours
    assert ours["kept_during"] >= 2 * 4 << 20, "the capture's intermediates are the graph's"
    assert ours["kept_after"] == 0, "given back once the graph is destroyed"


_TORCH_COMPILE = r"""
import json, sys
import torch
if sys.argv[1] == "gpuptr":
    import gpuptr
    gpuptr.install(numba=False, cupy=False)
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
).cuda()
compiled = torch.compile(model, mode="reduce-overhead")
kept, mismatches = [], 0
with torch.no_grad():
    for step in range(8):   # warm-up, recording, then replays
        x = torch.randn(64, 256, device="cuda")
        y = compiled(x).clone()
        if not torch.allclose(y, model(x), atol=1e-4, rtol=1e-4):
            mismatches += 1
        kept.append((torch.full((64, 256), float(step), device="cuda"), y, model(x)))
    torch.cuda.synchronize()
    broken = sum(int(not bool((s == float(i)).all())) for i, (s, _, _) in enumerate(kept))
    drifted = sum(int(not torch.allclose(y, e, atol=1e-4, rtol=1e-4)) for _, y, e in kept)
print(json.dumps({"mismatches": mismatches, "broken_sentinels": broken, "drifted_outputs": drifted}))
"""


def test_torch_compile_reduce_overhead_matches_eager_and_keeps_tensors_intact():
    pytest.importorskip("torch")
    native = _run(_TORCH_COMPILE, "native", timeout=400)
    ours = _run(_TORCH_COMPILE, "gpuptr", timeout=400)
    print("torch's allocator:", native, "gpuptr:", ours)
    assert native == {"mismatches": 0, "broken_sentinels": 0, "drifted_outputs": 0}, native
    assert ours == {"mismatches": 0, "broken_sentinels": 0, "drifted_outputs": 0}, ours


_OOM = r"""
import json, sys
lib, mode = sys.argv[1].split(":")
if mode == "gpuptr":
    import gpuptr
    gpuptr.install()
HUGE = 400 << 30
out = {}
def caught(fn):
    try:
        fn()
    except BaseException as e:
        out.update(type=type(e).__module__ + "." + type(e).__qualname__,
                   mro=[c.__module__ + "." + c.__qualname__ for c in type(e).__mro__],
                   message=str(e)[:600])
        return True
    return False
if lib == "torch":
    import torch
    out["raised"] = caught(lambda: torch.empty(HUGE, dtype=torch.uint8, device="cuda"))
    out["after"] = float(torch.ones(1 << 20, device="cuda").sum().item())
    torch.cuda.synchronize()
elif lib == "cupy":
    import cupy as cp
    out["raised"] = caught(lambda: cp.empty(HUGE, dtype=cp.uint8))
    out["after"] = float(cp.ones(1 << 20, dtype=cp.float32).sum().item())
    cp.cuda.Device().synchronize()
else:
    import numpy as np
    from numba import cuda
    out["raised"] = caught(lambda: cuda.device_array(HUGE, dtype=np.uint8))
    a = cuda.to_device(np.ones(1 << 20, dtype=np.float32))
    out["after"] = float(a.copy_to_host().sum())
    from numba.cuda.cudadrv.driver import CudaAPIError
    out["numba_code"] = None
    try:
        cuda.device_array(HUGE, dtype=np.uint8)
    except CudaAPIError as e:
        out["numba_code"] = e.code
print(json.dumps(out))
"""


@pytest.mark.parametrize("lib", ["torch", "cupy", "numba"])
def test_out_of_memory_is_the_librarys_own_error_and_the_process_goes_on(lib):
    pytest.importorskip({"torch": "torch", "cupy": "cupy", "numba": "numba.cuda"}[lib])
    env = {"NUMBA_CUDA_MEMORY_MANAGER": "gpuptr.numba"} if lib == "numba" else {}
    native = _run(_OOM, f"{lib}:native")
    ours = _run(_OOM, f"{lib}:gpuptr", env=env)
    print(f"{lib} native:", native, "\ngpuptr:", ours)
    assert native["raised"] and ours["raised"]
    assert ours["after"] == native["after"] == float(1 << 20), "the process goes on"
    assert "out of memory" in ours["message"].lower()
    assert "device 0" in ours["message"] and "gpuptr's pool holds" in ours["message"], ours["message"]
    assert "400.00 GiB" in ours["message"] and "free of" in ours["message"]
    if lib == "torch":
        # PyTorch's own torch.OutOfMemoryError (a RuntimeError), with its
        # "CUDA out of memory." prefix.
        assert ours["type"] == native["type"] and "builtins.RuntimeError" in ours["mro"], ours
        assert ours["message"].startswith("CUDA out of memory.")
    elif lib == "cupy":
        assert "cupy.cuda.memory.OutOfMemoryError" in ours["mro"], ours
        assert "gpuptr.OutOfMemoryError" in ours["mro"]
    else:
        assert "numba.cuda.cudadrv.driver.CudaAPIError" in ours["mro"], ours
        assert ours["numba_code"] == native["numba_code"] == 2


_NUMBA_IN_CUPY_GRAPH = r"""
import json, sys
import numpy as np
if sys.argv[1] == "gpuptr":
    import gpuptr
    gpuptr.install(torch=False)
import cupy as cp
from numba import cuda

@cuda.jit
def add(a, v):
    i = cuda.grid(1)
    if i < a.size:
        a[i] += v

n = 1 << 20
a = cp.zeros(n, dtype=cp.float32)
s = cp.cuda.Stream(non_blocking=True)
ns = cuda.external_stream(s.ptr)
add[n // 256, 256, ns](a, 1.0)       # compiled and run outside the capture
s.synchronize()
with s:
    s.begin_capture()
    tmp = cp.empty(n, dtype=cp.float32)   # scratch allocated in the capture
    add[n // 256, 256, ns](a, 1.0)
    del tmp
    g = s.end_capture()
others = []
for _ in range(5):
    g.launch(stream=s)
    others.append(cp.full(n, 9.0, dtype=cp.float32))
s.synchronize()
cp.cuda.Device().synchronize()
print(json.dumps({"value": float(a[0].item()), "all": bool((a == 6.0).all()),
                  "others_intact": sum(int(bool((o == 9.0).all())) for o in others)}))
"""


def test_a_numba_kernel_captured_into_a_cupy_graph_over_gpuptr_memory():
    pytest.importorskip("cupy")
    pytest.importorskip("numba.cuda")
    env = {"NUMBA_CUDA_ARRAY_INTERFACE_SYNC": "0"}
    native = _run(_NUMBA_IN_CUPY_GRAPH, "native", env=env)
    ours = _run(_NUMBA_IN_CUPY_GRAPH, "gpuptr", env={**env, "NUMBA_CUDA_MEMORY_MANAGER": "gpuptr.numba"})
    print("numba+CuPy native:", native, "gpuptr:", ours)
    assert native == {"value": 6.0, "all": True, "others_intact": 5}, native
    assert ours == {"value": 6.0, "all": True, "others_intact": 5}, ours
