"""RMM on gpuptr's pool, on the GPU (marked ``gpu``; skipped where RMM
cannot be imported): ``rmm.DeviceBuffer``s served from gpuptr's pool,
memory freed through RMM reused by PyTorch and CuPy, a CuPy array
allocated through RMM (``rmm.allocators.cupy``) beside a PyTorch tensor,
and out of memory as RMM raises it.

Each script runs in a fresh process (PyTorch takes a new allocator only
before its first CUDA allocation, and RMM's resources are per process) and
prints one JSON line of what it saw, which the tests below read: two
processes in all, to stay under a minute. Run:
``python -m pytest -m gpu -q tests/gpu/test_rmm_gpu.py``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

pytest.importorskip("rmm")

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- readme-test: skip (needs RMM and a GPU) -->"


def _run(code: str, timeout: int = 240) -> dict:
    """Run ``code`` in a fresh process on the CUDA driver; the JSON object
    its last line prints."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPUPTR_DRIVER", "NUMBA_CUDA_MEMORY_MANAGER")}
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "script.py")
        with open(script, "w") as f:
            f.write(code)
        out = subprocess.run([sys.executable, script], cwd=d, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    result["stdout"] = lines[:-1]
    return result


def _readme_block() -> str:
    """The README's RMM example, as printed there (after its marker)."""
    text = README.read_text()
    m = re.search(re.escape(MARKER) + r"\n```python\n(.*?)```", text, flags=re.S)
    assert m, "the README's RMM example"
    return m.group(1)


# The README's example first, as a user pastes it (gpuptr.install() then
# puts every library that imports on the pool), then what RMM does under
# it, through RMM's own Python API.
ALONE = textwrap.dedent(
    """
    import gc, json
    import numpy as np
    import gpuptr, gpuptr.rmm, rmm
    from gpuptr import _core

    r = {"installed": gpuptr.rmm.installed()}

    def stats(d=0):
        gc.collect()
        return gpuptr.stats()[d]

    def in_pool(ptr):
        # An active block of one of gpuptr's pool segments starts at ptr.
        for seg in gpuptr.snapshot()["segments"]:
            if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                return any(b["address"] == ptr and b["state"] == "active_allocated" for b in seg["blocks"])
        return False

    # DeviceBuffers of several sizes: gpuptr's pool blocks, counted as rmm.
    s0 = stats()
    sizes = [1, 4096, 1 << 20, (3 << 20) + 5, 64 << 20]
    bufs = [rmm.DeviceBuffer(size=n) for n in sizes]
    s1 = stats()
    r["buffers_in_pool"] = [in_pool(b.ptr) for b in bufs]
    r["buffers_context"] = [gpuptr.context_of(b.ptr).device.id for b in bufs]
    r["rmm_live_delta"] = s1["clients"]["rmm"]["live_bytes"] - s0["clients"]["rmm"]["live_bytes"]
    r["rmm_count_delta"] = s1["clients"]["rmm"]["live_count"] - s0["clients"]["rmm"]["live_count"]
    r["sizes_sum"] = sum(sizes)
    # Their memory works: bytes in, bytes out, through RMM's own copies.
    data = (np.arange(1 << 20, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8).tobytes()
    filled = rmm.DeviceBuffer.to_device(data)
    r["roundtrip"] = in_pool(filled.ptr) and filled.tobytes() == data
    del bufs, filled
    s2 = stats()
    r["rmm_live_after_free"] = s2["clients"]["rmm"]["live_bytes"] - s0["clients"]["rmm"]["live_bytes"]

    # RMM's rule: freed on a stream, reused at once on that stream.
    from rmm.pylibrmm.stream import Stream
    s = Stream()
    a = rmm.DeviceBuffer(size=(5 << 20) + 4096, stream=s)
    p = a.ptr
    del a
    b = rmm.DeviceBuffer(size=(5 << 20) + 4096, stream=s)
    r["same_stream_reuse"] = b.ptr == p
    del b
    s.synchronize()

    # Through the resource itself: zero bytes, another library's pointer,
    # a double free. None frees anything; the last two count as failures.
    mr = rmm.mr.get_current_device_resource()
    r["resource_is_gpuptrs"] = isinstance(mr, rmm.mr.CallbackMemoryResource) and mr is gpuptr.rmm._installed[0]
    live0, failures0 = _core._hooks_state()
    r["zero"] = mr.allocate(0)
    mr.deallocate(0, 0)
    own = gpuptr.alloc(4096)
    own.memset(7)
    mr.deallocate(own.device_pointer_value, 4096)
    q = mr.allocate(8192)
    mr.deallocate(q, 8192)
    mr.deallocate(q, 8192)
    r["foreign_untouched"] = (not own.freed) and own.copy_to_host()[:4] == b"\\x07" * 4
    live1, failures1 = _core._hooks_state()
    r["hooks_delta"] = [live1 - live0, failures1 - failures0]
    del own

    # A resource of one's own, passed as mr=.
    mine = gpuptr.rmm.memory_resource(0)
    c = rmm.DeviceBuffer(size=12345, mr=mine)
    r["own_resource_in_pool"] = in_pool(c.ptr)
    del c

    # Out of memory: RMM's MemoryError, with gpuptr's message; the process
    # goes on allocating.
    try:
        rmm.DeviceBuffer(size=1 << 50)
        r["oom"] = None
    except MemoryError as e:
        r["oom"] = [type(e).__module__ + "." + type(e).__qualname__, str(e)]
    except Exception as e:
        r["oom"] = ["not a MemoryError: " + type(e).__module__ + "." + type(e).__qualname__, str(e)]
    after = rmm.DeviceBuffer(size=1 << 20)
    r["after_oom_in_pool"] = in_pool(after.ptr)
    del after

    # A second device, where there is one: its own resource, its own pool.
    n = gpuptr.driver_info()["device_count"]
    r["devices"] = n
    if n > 1:
        from cuda.bindings import runtime
        runtime.cudaSetDevice(1)
        try:
            d1 = rmm.DeviceBuffer(size=1 << 20)
            r["device1"] = [gpuptr.context_of(d1.ptr).device.id, stats(1)["clients"]["rmm"]["live_bytes"]]
            del d1
        finally:
            runtime.cudaSetDevice(0)
    print(json.dumps(r))
    """
)


@pytest.fixture(scope="module")
def alone():
    if not README.is_file():
        pytest.skip("needs gpuptr's source tree (README.md)")
    return _run(_readme_block() + ALONE)


def test_the_readmes_rmm_example_runs_and_prints_what_it_says(alone):
    said = [line[2:] for line in _readme_block().splitlines() if line.startswith("# ")]
    assert alone["stdout"] == said, alone["stdout"]
    assert alone["installed"] and alone["resource_is_gpuptrs"]


def test_device_buffers_are_gpuptr_pool_blocks_counted_as_rmm(alone):
    assert alone["buffers_in_pool"] == [True] * 5
    assert alone["buffers_context"] == [0] * 5
    assert (alone["rmm_live_delta"], alone["rmm_count_delta"]) == (alone["sizes_sum"], 5)
    assert alone["roundtrip"], "bytes copied in through RMM come back"
    assert alone["rmm_live_after_free"] == 0
    assert alone["own_resource_in_pool"]


def test_a_block_freed_on_rmms_stream_is_reused_there_at_once(alone):
    assert alone["same_stream_reuse"]


def test_rmms_free_never_frees_what_it_did_not_hand_out(alone):
    assert alone["zero"] == 0, "zero bytes: null, as RMM's own resources"
    assert alone["foreign_untouched"], "gpuptr.alloc's memory freed through RMM's path stays live"
    assert alone["hooks_delta"] == [0, 2], "a foreign pointer and a double free: two failures, nothing freed"


def test_out_of_memory_is_rmms_memory_error_with_gpuptrs_message(alone):
    kind, message = alone["oom"]
    assert kind == "builtins.MemoryError", alone["oom"]
    assert "out of memory on device 0: could not allocate 1.00 PiB" in message, message
    assert "gpuptr's pool holds" in message, message
    assert message.startswith("std::bad_alloc: "), message  # as the README says
    assert alone["after_oom_in_pool"]


def test_each_device_has_its_own_resource(alone):
    if alone["devices"] < 2:
        pytest.skip("needs two devices")
    assert alone["device1"] == [1, 1 << 20]


WITH_TORCH_AND_CUPY = textwrap.dedent(
    """
    import gc, json
    import gpuptr
    report = gpuptr.install(numba=False)
    import cupy as cp, rmm, torch

    r = {"report": report}
    MB64 = 64 << 20

    def stats():
        gc.collect()
        return gpuptr.stats()[0]

    def settle():
        torch.cuda.synchronize()
        cp.cuda.runtime.deviceSynchronize()
        gc.collect()
        gpuptr.flush_pool()

    # RMM's memory, freed, is PyTorch's next: no new driver memory.
    bufs = [rmm.DeviceBuffer(size=MB64) for _ in range(4)]
    rmm_ptrs = sorted(b.ptr for b in bufs)
    del bufs
    settle()
    pool = stats()["pool_bytes"]
    ts = [torch.empty(MB64, dtype=torch.uint8, device="cuda") for _ in range(4)]
    s = stats()
    r["torch_pool_grew"] = s["pool_bytes"] - pool
    r["torch_took_rmms"] = set(t.data_ptr() for t in ts) <= set(rmm_ptrs)
    r["torch_live"] = s["clients"]["torch"]["live_bytes"]
    del ts
    settle()
    # ... and CuPy's (gpuptr's CuPy allocator) after that.
    arrays = [cp.empty(MB64, dtype=cp.uint8) for _ in range(4)]
    s = stats()
    r["cupy_pool_grew"] = s["pool_bytes"] - pool
    r["cupy_took_rmms"] = set(a.data.ptr for a in arrays) <= set(rmm_ptrs)
    del arrays
    settle()

    # A CuPy array allocated through RMM (rmm.allocators.cupy) and a torch
    # tensor, in one program, on one pool, computing together.
    from rmm.allocators.cupy import rmm_cupy_allocator
    cp.cuda.set_allocator(rmm_cupy_allocator)
    n = 1 << 20
    before = stats()["clients"]
    a = cp.arange(n, dtype=cp.float64)
    t = torch.ones(n, dtype=torch.float64, device="cuda")
    after = stats()["clients"]
    r["rmm_delta"] = after["rmm"]["live_bytes"] - before["rmm"]["live_bytes"]
    r["torch_delta"] = after["torch"]["live_bytes"] - before["torch"]["live_bytes"]
    r["cupy_delta"] = after["cupy"]["live_bytes"] - before["cupy"]["live_bytes"]
    r["contexts"] = [gpuptr.context_of(a.data.ptr).device.id, gpuptr.context_of(t.data_ptr()).device.id]
    x = torch.from_dlpack(a)
    r["zero_copy"] = x.data_ptr() == a.data.ptr
    r["dot"] = float((x * t).sum())
    r["expected"] = float(n * (n - 1) // 2)
    del a, x
    settle()
    r["rmm_after"] = stats()["clients"]["rmm"]["live_bytes"] - before["rmm"]["live_bytes"]
    del t
    print(json.dumps(r))
    """
)


@pytest.fixture(scope="module")
def with_torch_and_cupy():
    pytest.importorskip("torch")
    pytest.importorskip("cupy")
    return _run(WITH_TORCH_AND_CUPY)


def test_install_puts_rmm_beside_cupy_and_torch(with_torch_and_cupy):
    report = with_torch_and_cupy["report"]
    assert (report["cupy"], report["torch"], report["rmm"]) == ("installed",) * 3, report


def test_memory_freed_through_rmm_is_reused_by_pytorch_then_cupy(with_torch_and_cupy):
    r = with_torch_and_cupy
    assert r["torch_pool_grew"] == 0 and r["torch_took_rmms"], r
    assert r["torch_live"] == 4 * (64 << 20)
    assert r["cupy_pool_grew"] == 0 and r["cupy_took_rmms"], r


def test_an_rmm_cupy_array_and_a_torch_tensor_share_the_pool(with_torch_and_cupy):
    r = with_torch_and_cupy
    assert (r["rmm_delta"], r["torch_delta"], r["cupy_delta"]) == (8 << 20, 8 << 20, 0), r
    assert r["contexts"] == [0, 0] and r["zero_copy"]
    assert r["dot"] == r["expected"]
    assert r["rmm_after"] == 0
