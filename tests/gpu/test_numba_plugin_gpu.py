"""The plugin under real numba on a GPU, once under numba-cuda and once under
numba-cuda-mlir. Each test runs in a fresh process with
NUMBA_CUDA_MEMORY_MANAGER=gpuptr.numba, since numba picks its memory
manager once per process."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from helpers import hide_modules
from helpers import run_plugin as _run_plugin

pytestmark = pytest.mark.gpu

NUMBAS = ["numba", "numba_cuda_mlir"]


@pytest.fixture(params=NUMBAS)
def numba(request):
    """The package users import ``cuda`` from: ``numba`` (numba-cuda) or
    ``numba_cuda_mlir``."""
    if importlib.util.find_spec(request.param) is None:
        pytest.skip(f"{request.param} is not installed here")
    return request.param


def run_plugin(code, numba):
    return _run_plugin(code.replace("from numba import cuda", f"from {numba} import cuda"))


def test_every_hook_through_numbas_public_api(numba):
    out = run_plugin(
        """
        import numpy as np, gpuptr
        from numba import cuda
        from gpuptr.numba import MemoryManager
        ctx = cuda.current_context()
        assert isinstance(ctx.memory_manager, MemoryManager)
        d = cuda.device_array(1000, dtype=np.float64)               # memalloc
        assert isinstance(d.gpu_data, gpuptr.MemoryPointer)
        t = cuda.to_device(np.arange(1000.0))                      # memalloc + copy
        assert (t.copy_to_host() == np.arange(1000.0)).all()
        p = cuda.pinned_array(100, dtype=np.int32)                 # memhostalloc
        p[:] = 4
        dp = cuda.to_device(p)
        assert (dp.copy_to_host() == 4).all()
        m = cuda.mapped_array(64, dtype=np.int32)                  # memhostalloc(mapped)
        @cuda.jit
        def inc(a):
            i = cuda.grid(1)
            if i < a.size:
                a[i] += 1
        m[:] = 1
        inc[1, 64](m); cuda.synchronize()
        assert (m == 2).all()
        mm = cuda.managed_array(64, dtype=np.int32)                # memallocmanaged
        mm[:] = 5
        inc[1, 64](mm); cuda.synchronize()
        assert (mm == 6).all()
        host = np.zeros(256, dtype=np.uint8)
        with cuda.pinned(host):                                    # mempin
            dh = cuda.to_device(host)
        with cuda.mapped(host) as mh:                              # mempin(mapped)
            inc2 = cuda.jit(lambda a: None)
        info = ctx.get_memory_info()                               # get_memory_info
        assert 0 < info.free <= info.total
        with ctx.defer_cleanup():                                  # defer_cleanup
            del d
        s = gpuptr.stats()[0]
        print("ok", s["live_count"] > 0, s["pool_hits"] + s["pool_misses"] > 0)
        """,
        numba,
    )
    assert out.split() == ["ok", "True", "True"]


def test_reuse_waits_for_a_kernel_still_using_the_freed_block(numba):
    # A kernel on stream s1 spins, then reads A and writes A. A is freed at
    # once and a batch of same-size allocations is written on another
    # blocking stream s2. If a reused block were handed out before the
    # kernel finished, the kernel would read the new value (B would be 3)
    # or overwrite the new owner's bytes (some block would hold 7).
    #
    # An event recorded after the kernel says whether it still ran once the
    # new blocks were handed out. Reuse after the kernel ended is correct
    # (the fence saw it end), so the check is "no reuse while it runs", and
    # the kernel spins long enough (about a second) that it does run then:
    # a 100 ms spin, with a gc.collect() inside it, could not tell a correct
    # reuse from a wrong one (it saw A's block reused once on the H200).
    out = run_plugin(
        """
        import gc, time, numpy as np, gpuptr
        from numba import cuda
        @cuda.jit
        def spin_then_touch(a, b, naps):
            for _ in range(naps):
                cuda.nanosleep(1000)                            # ~1 us each
            i = cuda.grid(1)
            if i < a.size:
                b[i] = a[i] + 1
                a[i] = 7
        n = 1 << 18
        s1, s2 = cuda.stream(), cuda.stream()
        a = cuda.to_device(np.ones(n, dtype=np.int32))
        b = cuda.device_array(n, dtype=np.int32)
        spin_then_touch[1, 1, s1](b, b, 0); s1.synchronize()      # compile first
        b.copy_to_device(np.zeros(n, dtype=np.int32))
        # More frees than one fence batch (32 blocks or 64 MiB): the pool
        # seals them for its fence at once.
        filler = [cuda.device_array(n, dtype=np.int32) for _ in range(63)]
        a_addr = a.gpu_data.device_pointer_value
        t0 = time.perf_counter()
        spin_then_touch[n // 256, 256, s1](a, b, 1_000_000)     # about 1 s
        ended = cuda.event(); ended.record(s1)
        del a, filler                                           # freed while in use
        gc.collect()                            # numba may hold launch args in a cycle
        new = [cuda.device_array(n, dtype=np.int32) for _ in range(64)]
        running = not ended.query()
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        reused = [x for x in new if x.gpu_data.device_pointer_value == a_addr]
        for x in new:
            x.gpu_data.memset(2, stream=s2)                       # the new owners write
        cuda.synchronize()
        ok_b = (b.copy_to_host() == 2).all()
        ok_new = all((x.copy_to_host().view(np.uint8) == 2).all() for x in new)
        print(len(reused), running, ok_b, ok_new, gpuptr.flush_pool(0), round(elapsed_ms))
        """,
        numba,
    )
    reused, running, ok_b, ok_new, fenced, elapsed_ms = out.split()
    # Meaningful only if the kernel still ran when the blocks were handed out.
    assert running == "True", f"the kernel ended within {elapsed_ms} ms; the check proved nothing"
    # The kernel still used A's block on s1: it is not handed out until the
    # fence (cuCtxSynchronize on the pool's thread) has seen the kernel end.
    assert reused == "0", "A's block was handed out while a kernel still used it"
    assert (ok_b, ok_new, fenced) == ("True", "True", "True")


def test_ipc_handle_of_a_pooled_pointer_opens_in_a_spawned_child(numba):
    out = run_plugin(
        """
        import multiprocessing as mp, numpy as np, gpuptr
        from numba import cuda

        def child(handle, q):
            from numba import cuda
            with handle as arr:
                q.put(arr.copy_to_host().tolist())

        if __name__ == "__main__":
            big = cuda.device_array(1 << 20, dtype=np.uint8)        # a pool block
            arr = big[4096:4096 + 16]                               # offset into it
            arr.copy_to_device(np.arange(16, dtype=np.uint8))
            h = arr.get_ipc_handle()
            assert h._ipc_handle.offset == 4096                     # base + offset
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(h, q))
            p.start(); got = q.get(timeout=120); p.join(120)
            print(got == list(range(16)), p.exitcode)
        """,
        numba,
    )
    assert out.split() == ["True", "0"]


def test_cuda_close_then_allocate_again(numba):
    out = run_plugin(
        """
        import numpy as np, gpuptr
        from numba import cuda
        a = cuda.to_device(np.arange(100))
        ptr = a.gpu_data
        cuda.close()
        try:
            ptr.memset(0)
            print("no error")
        except gpuptr.InvalidPointerError:
            print("stale")
        del a, ptr                                  # stale free: a no-op
        b = cuda.to_device(np.arange(50))
        print(int(b.copy_to_host().sum()), gpuptr.stats()[0]["live_count"])
        """,
        numba,
    )
    assert out.split() == ["stale", "1225", "1"]


def test_a_memset_sized_by_device_memory_size_stays_in_its_array(numba):
    # numba's own cudadrv test does this: size by device_memory_size (the
    # driver allocation's extent under numba's manager), then memset. Under
    # the pool the extent is the segment; the array's own size keeps the
    # memset off its neighbours, wherever the block lies in its segment.
    code = """
        import numpy as np
        from numba import cuda
        from numba.cuda.cudadrv import driver
        a = cuda.to_device(np.full(10, 123, dtype=np.uint32))
        b = cuda.to_device(np.full(10, 7, dtype=np.uint32))
        c = cuda.to_device(np.full(10, 9, dtype=np.uint32))
        for arr in (b, a):
            driver.device_memset(arr, 0, driver.device_memory_size(arr))
        print(driver.device_memory_size(b), int(a.copy_to_host().sum()),
              int(b.copy_to_host().sum()), int(c.copy_to_host().sum()))
        """
    if numba != "numba":  # numba-cuda-mlir keeps numba-cuda's driver one level down
        code = code.replace("numba.cuda.cudadrv", "numba_cuda_mlir.numba_cuda.cudadrv")
    out = run_plugin(code, numba)
    assert out.split() == ["40", "0", "0", "90"]


def test_host_array_arguments_come_from_gpuptrs_pool(numba):
    # A kernel on a host numpy array: numba copies it to the device and back.
    # Measured on the H200: numba-cuda 0.30.4 allocates the copy through its
    # device's cuda.core Device.allocate (outside EMM), which gpuptr.numba
    # points at gpuptr's pool (client "cuda_core"); numba-cuda-mlir 0.6
    # allocates it through EMM (memalloc, client "numba").
    out = run_plugin(
        """
        import numpy as np, gpuptr, gpuptr.cuda_core
        from numba import cuda
        @cuda.jit
        def inc(a):
            i = cuda.grid(1)
            if i < a.size:
                a[i] += 1
        ctx = cuda.current_context()
        mr = ctx.device._dev.memory_resource
        host = np.arange(4096, dtype=np.float32)
        before = {k: v["alloc_count"] for k, v in gpuptr.stats()[0]["clients"].items()}
        for _ in range(3):
            inc[16, 256](host)
        cuda.synchronize()
        after = {k: v["alloc_count"] for k, v in gpuptr.stats()[0]["clients"].items()}
        grew = sorted(k for k in after if after[k] > before[k])
        print(bool((host == np.arange(4096) + 3).all()), ",".join(grew) or "none",
              isinstance(mr, gpuptr.cuda_core.MemoryResource))
        """,
        numba,
    )
    ok, grew, pooled_device = out.split()
    assert ok == "True" and pooled_device == "True"
    assert grew == ("numba" if numba == "numba_cuda_mlir" else "cuda_core"), grew


def test_where_numba_cuda_mlir_is_the_only_numba():
    if importlib.util.find_spec("numba_cuda_mlir") is None:
        pytest.skip("numba_cuda_mlir is not installed here")
    out = _run_plugin(
        hide_modules("numba")
        + textwrap.dedent(
            """
        try:
            import numba
            sys.exit("numba-cuda is still importable")
        except ImportError:
            pass
        import numpy as np, gpuptr
        from numba_cuda_mlir import cuda
        from gpuptr.numba import MemoryManager
        assert isinstance(cuda.current_context().memory_manager, MemoryManager)
        @cuda.jit
        def inc(a):
            i = cuda.grid(1)
            if i < a.size:
                a[i] += 1
        d = cuda.to_device(np.arange(1000, dtype=np.float32))
        inc[4, 256](d)
        host = np.zeros(1000, dtype=np.float32)
        inc[4, 256](host)                                   # a host-array argument
        cuda.synchronize()
        clients = gpuptr.stats()[0]["clients"]
        import gpuptr.cuda_core
        print(bool((d.copy_to_host() == np.arange(1000) + 1).all()), bool((host == 1).all()),
              clients["numba"]["alloc_count"] >= 2,
              isinstance(cuda.current_context().device._dev.memory_resource, gpuptr.cuda_core.MemoryResource))
        """
        )
    )
    assert out.split() == ["True", "True", "True", "True"]
