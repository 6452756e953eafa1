"""Two real GPUs (marked ``gpu`` and ``multigpu``): contexts come from the
address, never from the current device."""

from __future__ import annotations

import pytest
from helpers import run_plugin

import gpuptr

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

if gpuptr.driver_info()["driver"] != "cuda" or gpuptr.driver_info()["device_count"] < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

np = pytest.importorskip("numpy")
cupy = pytest.importorskip("cupy")
cuda = pytest.importorskip("numba.cuda")


def test_cupy_array_on_device_1_wrapped_while_device_0_is_current():
    with cupy.cuda.Device(1):
        c = cupy.arange(256, dtype=cupy.int32)
    cupy.cuda.Device(0).use()
    gpuptr.context(0).push()
    w = gpuptr.wrap(c.data.ptr, c.nbytes, owner=c)
    assert w.context.device.id == 1
    assert w.context is gpuptr.context(1)
    assert np.frombuffer(w.copy_to_host(), dtype=np.int32).tolist() == list(range(256))
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    with cuda.gpus[1]:
        arr = DeviceNDArray((256,), (4,), np.dtype(np.int32), gpu_data=w)
        assert (arr.copy_to_host() == np.arange(256)).all()


def test_as_cuda_array_and_a_kernel_on_device_1():
    from gpuptr.numba import as_cuda_array

    @cuda.jit
    def double(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] *= 2

    with cupy.cuda.Device(1):
        c = cupy.arange(1000, dtype=cupy.float64)
    cupy.cuda.Device(0).use()
    arr = as_cuda_array(c)
    assert arr.gpu_data.context.device.id == 1
    with cuda.gpus[1]:
        double[4, 256](arr)
        cuda.synchronize()
    with cupy.cuda.Device(1):
        assert float(c[999]) == 1998.0


def test_peer_copy_between_devices():
    a = gpuptr.alloc(1 << 20, device=0)
    b = gpuptr.alloc(1 << 20, device=1)
    assert a.context.device.id == 0 and b.context.device.id == 1
    data = bytes(range(256)) * 4096
    a.copy_from_host(data)
    b.copy_from_device(a)
    assert b.copy_to_host() == data
    b.view(100, 200).memset(7)
    a.copy_from_device(b.view(0, 300), 300)
    assert a.copy_to_host()[100:200] == b"\x07" * 100


def test_context_of_each_device_by_address():
    a = gpuptr.alloc(64, device=0)
    b = gpuptr.alloc(64, device=1)
    gpuptr.context(1).push()
    assert gpuptr.context_of(a.device_pointer_value).device.id == 0
    gpuptr.context(0).push()
    assert gpuptr.context_of(b.device_pointer_value).device.id == 1


def test_plugin_allocations_under_gpus_1_come_from_device_1_and_return_there_from_another_thread():
    out = run_plugin(
        """
        import threading, gc, numpy as np, gpuptr
        from numba import cuda
        with cuda.gpus[1]:
            arrs = [cuda.device_array(1 << 18, dtype=np.float32) for _ in range(4)]
        assert all(a.gpu_data.context.device.id == 1 for a in arrs)
        s0, s1 = gpuptr.stats()[0], gpuptr.stats()[1]
        assert s1["live_bytes"] >= 4 << 20, s1
        def free_from_device_0():
            cuda.select_device(0)
            gpuptr.context(0).push()
            arrs.clear(); gc.collect()
        t = threading.Thread(target=free_from_device_0); t.start(); t.join()
        a0, a1 = gpuptr.stats()[0], gpuptr.stats()[1]
        print(a1["live_bytes"] == s1["live_bytes"] - (4 << 20),
              a1["cached_bytes"] >= s1["cached_bytes"] + (4 << 20),
              a0["cached_bytes"] == s0["cached_bytes"])
        """
    )
    assert out.split() == ["True", "True", "True"]


def test_ipc_of_a_device_1_pointer_opens_in_a_spawned_child():
    out = run_plugin(
        """
        import multiprocessing as mp, numpy as np

        def child(h, q):
            from numba import cuda
            with cuda.gpus[1]:
                with h as arr:
                    q.put(arr.copy_to_host().tolist())

        if __name__ == "__main__":
            from numba import cuda
            with cuda.gpus[1]:
                arr = cuda.to_device(np.arange(32, dtype=np.int32))
                assert arr.gpu_data.context.device.id == 1
                h = arr.get_ipc_handle()
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(h, q))
            p.start(); got = q.get(timeout=120); p.join(120)
            print(got == list(range(32)), p.exitcode)
        """
    )
    assert out.split() == ["True", "0"]
