"""numba, CuPy and PyTorch on one gpuptr pool, on the GPU (marked ``gpu``).

Each test runs in a fresh process: PyTorch takes a new allocator only
before its first CUDA allocation."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytestmark = pytest.mark.gpu


def _run(code: str, timeout: int = 300) -> str:
    # A script file, not -c: a spawned child imports the parent's __main__
    # by path to find the functions it runs.
    env = {k: v for k, v in os.environ.items() if k not in ("GPUPTR_DRIVER", "NUMBA_CUDA_MEMORY_MANAGER")}
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "script.py")
        with open(script, "w") as f:
            f.write(textwrap.dedent(code))
        out = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


@pytest.fixture(autouse=True)
def _libraries():
    pytest.importorskip("numba.cuda")
    pytest.importorskip("cupy")
    pytest.importorskip("torch")


PIPELINE = """
import gc, json
import numpy as np
import gpuptr
report = gpuptr.install(stream_ordered=STREAM_ORDERED)
assert set(report.values()) == {"installed"}, report
from numba import cuda
import cupy as cp
import torch
from gpuptr.numba import as_cuda_array

@cuda.jit
def fill(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = (i % 97) * 0.01

@cuda.jit
def twice(src, dst):
    i, j = cuda.grid(2)
    if i < dst.shape[0] and j < dst.shape[1]:
        dst[i, j] = 2 * src[i, j]

n = 1 << 20
d = cuda.device_array(n, dtype=np.float32)            # numba allocates from gpuptr
fill[(n + 255) // 256, 256](d)
host = (np.arange(n) % 97 * 0.01).astype(np.float32)

c = cp.asarray(d)                                      # CAI, no copy
assert c.data.ptr == d.device_ctypes_pointer.value
total = float(c.sum(dtype=cp.float64))                 # CuPy reduces
assert abs(total - host.astype(np.float64).sum()) < 1e-3 * total, total
kept = cp.cumsum(c)                                    # CuPy allocates from gpuptr

t = torch.from_dlpack(c).reshape(1024, 1024)           # DLPack, no copy
assert t.data_ptr() == c.data.ptr
side = torch.cuda.Stream()                             # non-blocking
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    r = t @ t.T                                        # torch allocates from gpuptr
torch.cuda.current_stream().wait_stream(side)
r.record_stream(torch.cuda.current_stream())

back = as_cuda_array(r)                                # back into numba (CAI)
out = cuda.device_array((1024, 1024), dtype=np.float32)
twice[(64, 64), (16, 16)](back, out)
m = host.reshape(1024, 1024).astype(np.float64)
expect = 2 * (m @ m.T)
got = out.copy_to_host()
err = float(np.max(np.abs(got - expect) / np.maximum(np.abs(expect), 1)))
assert err < 1e-3, err

# gpuptr memory straight into each library.
g = gpuptr.alloc(4096)
g.memset(3)
assert int(cp.asarray(g).sum()) == 3 * 4096
assert int(torch.from_dlpack(g).sum()) == 3 * 4096
typed = gpuptr.as_array(g, (16, 64), "float32")
assert torch.from_dlpack(typed).shape == (16, 64)
assert cp.asarray(typed).shape == (16, 64)

during = {k: v["live_bytes"] for k, v in gpuptr.stats()[0]["clients"].items()}
del d, c, t, r, back, out, g, typed, kept
torch.cuda.synchronize()
# cuBLAS keeps a workspace per handle and stream, allocated through torch's
# allocator (32 MiB on the H200) until it is cleared.
torch._C._cuda_clearCublasWorkspaces()
gc.collect()
after = {k: v["live_bytes"] for k, v in gpuptr.stats()[0]["clients"].items()}
print(json.dumps({"during": during, "after": after}))
"""


@pytest.mark.parametrize("stream_ordered", [False, True], ids=["fenced", "stream_ordered"])
def test_numba_cupy_torch_pipeline_on_one_pool(stream_ordered):
    import json

    out = _run(PIPELINE.replace("STREAM_ORDERED", str(stream_ordered)))
    stats = json.loads(out.strip().splitlines()[-1])
    for client in ("numba", "cupy", "torch"):
        assert stats["during"][client] > 0, (client, stats)
        assert stats["after"][client] == 0, (client, stats)


def test_ipc_of_pool_memory_after_install():
    out = _run(
        """
        import multiprocessing as mp, numpy as np

        def child(h, q):
            with h as arr:
                q.put(arr.copy_to_host().tolist())

        if __name__ == "__main__":
            import gpuptr
            gpuptr.install()
            from numba import cuda
            arr = cuda.to_device(np.arange(8, dtype=np.int64))
            import torch
            t = torch.arange(4, device="cuda")  # torch on the pool too
            h = arr.get_ipc_handle()
            q = mp.get_context("spawn").Queue()
            p = mp.get_context("spawn").Process(target=child, args=(h, q))
            p.start()
            print(q.get(timeout=120) == list(range(8)), int(t.sum()))
            p.join(60)
        """
    )
    assert out.split() == ["True", "6"]


def test_memory_one_library_frees_is_there_for_another():
    # Fill the device through CuPy until it runs out, free through CuPy, then
    # allocate the same amount through torch and numba: separate pools would
    # fail, since CuPy's would keep what it freed.
    out = _run(
        """
        import gc
        import gpuptr
        gpuptr.install()
        import cupy as cp, torch, numpy as np
        from numba import cuda
        chunk = 1 << 30
        held = []
        try:
            while True:
                held.append(cp.empty(chunk, dtype=cp.uint8))
        except (cp.cuda.memory.OutOfMemoryError, MemoryError, gpuptr.OutOfMemoryError):
            pass
        n = len(held)
        assert n > 8, n
        del held
        gc.collect()
        # torch takes most of it back, then numba the rest.
        ts = [torch.empty(chunk, dtype=torch.uint8, device="cuda") for _ in range(n - 2)]
        ds = [cuda.device_array(chunk, dtype=np.uint8) for _ in range(1)]
        print(n, len(ts), len(ds))
        """,
        timeout=600,
    )
    n, ts, ds = map(int, out.split())
    assert ts == n - 2 and ds == 1
