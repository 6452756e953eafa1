"""Real-GPU tests (marked ``gpu``): they run where the CUDA driver works and
are skipped on the simulator."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest

import gpuptr

pytestmark = pytest.mark.gpu


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GPUPTR_DRIVER"}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_driver_is_cuda_and_device_is_real():
    info = gpuptr.driver_info()
    assert info["driver"] == "cuda" and info["version"] >= 12000
    dev = gpuptr.devices()[0]
    assert dev.total_memory > 1 << 30 and "simulated" not in dev.name


def test_large_alloc_memset_copy_and_views(no_leaks):
    n = 64 << 20
    mem = gpuptr.alloc(n)
    mem.memset(0xCD)
    tail = mem.view(n - 4096)
    assert tail.copy_to_host() == b"\xcd" * 4096
    src = bytes(range(256)) * 16
    tail.view(1024, 1024 + 4096 - 1024).copy_from_host(src[: 4096 - 1024])
    assert tail.copy_to_host()[1024:] == src[: 4096 - 1024]
    other = gpuptr.alloc(4096)
    other.copy_from_device(tail)
    assert other.copy_to_host() == tail.copy_to_host()


def test_primary_context_retain_count_returns_to_its_start():
    # In a fresh process: inactive before, active while gpuptr holds it,
    # inactive again once every holder is gone.
    out = _run(
        """
        import gc, gpuptr
        from gpuptr import _testing
        print(_testing.primary_context_state(0)[1])
        mem = gpuptr.alloc(1 << 20)
        v = mem.view(10)
        print(_testing.primary_context_state(0)[1])
        del mem
        gpuptr.release_contexts()
        gc.collect()
        print(_testing.primary_context_state(0)[1])
        v.memset(1)
        del v
        gc.collect()
        print(_testing.primary_context_state(0)[1])
        """
    )
    assert out.split() == ["False", "True", "True", "False"]


def test_context_stays_usable_by_cupy_and_numba_after_gpuptr_lets_go():
    out = _run(
        """
        import gc, cupy, gpuptr
        from gpuptr import _testing
        a = cupy.arange(10)
        mem = gpuptr.alloc(1 << 20)
        mem.free(); del mem
        gpuptr.release_contexts(); gc.collect()
        print(_testing.primary_context_state(0)[1], int((a * 2).sum()))
        """
    )
    assert out.split() == ["True", "90"]


def test_wrap_over_a_cupy_array_reads_its_bytes_and_finds_its_context(no_leaks):
    cupy = pytest.importorskip("cupy")
    import numpy as np

    arr = cupy.arange(1000, dtype=cupy.int32)
    w = gpuptr.wrap(arr.data.ptr + 40, 400, owner=arr)
    assert w.owner is arr
    got = np.frombuffer(w.copy_to_host(), dtype=np.int32)
    assert (got == np.arange(10, 110, dtype=np.int32)).all()
    assert w.context is gpuptr.context(0)
    assert w.context.device.id == 0
    # The handle is the primary context CuPy works in.
    from cuda.bindings import driver as cu

    err, dev = cu.cuDeviceGet(0)
    err, handle = cu.cuDevicePrimaryCtxRetain(dev)
    assert w.context.handle == handle and w.context.handle.value == int(handle)
    cu.cuDevicePrimaryCtxRelease(dev)
    w.memset(0, count=4)
    assert int(arr[10]) == 0 and int(arr[11]) == 11


def test_wrap_of_a_torch_tensor(no_leaks):
    torch = pytest.importorskip("torch")
    t = torch.arange(256, dtype=torch.uint8, device="cuda")
    w = gpuptr.wrap(t.data_ptr(), t.numel(), owner=t)
    assert w.copy_to_host() == bytes(range(256))
    assert w.context is gpuptr.context(0)


def test_wrap_of_freed_foreign_memory_after_release_is_refused():
    cupy = pytest.importorskip("cupy")
    arr = cupy.zeros(1 << 20, dtype=cupy.uint8)
    ptr = arr.data.ptr
    w = gpuptr.wrap(ptr, 16, owner=arr)
    assert w.context.device.id == 0
    del w
    gc.collect()
    # The registry entry went with the wrap: a fresh wrap asks the driver.
    w2 = gpuptr.wrap(ptr, 16, owner=arr)
    assert w2.context.device.id == 0
