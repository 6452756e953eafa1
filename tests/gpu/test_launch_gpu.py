"""numba kernels launched on torch and CuPy arguments through
``gpuptr.numba.foreign_args``, on the GPU (marked ``gpu``)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cuda = pytest.importorskip("numba.cuda")


@pytest.fixture(scope="module")
def kernels():
    @cuda.jit
    def axpy(out, x, a):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = a * x[i] + out[i]

    @cuda.jit
    def sum8(out, a, b, c, d, e, f, g):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = a[i] + b[i] + c[i] + d[i] + e[i] + f[i] + g[i]

    return axpy, sum8


def _libraries():
    libs = []
    try:
        import cupy as cp

        libs.append(("cupy", lambda n, v: cp.full(n, v, dtype=cp.float32), lambda x: cp.asnumpy(x)))
    except ImportError:
        pass
    try:
        import torch

        libs.append(
            ("torch", lambda n, v: torch.full((n,), v, dtype=torch.float32, device="cuda"), lambda x: x.cpu().numpy())
        )
    except ImportError:
        pass
    return libs


@pytest.mark.parametrize("lib", _libraries(), ids=lambda l: l[0])
def test_one_and_eight_foreign_arguments_give_what_a_direct_launch_gives(kernels, lib):
    from gpuptr.numba import foreign_args

    axpy, sum8 = kernels
    _, make, host = lib
    n = 4096
    x = make(n, 2.0)
    direct, fast = make(n, 1.0), make(n, 1.0)
    axpy[16, 256](direct, x, 3.0)
    foreign_args(axpy)[16, 256](fast, x, 3.0)
    cuda.synchronize()
    assert np.array_equal(host(direct), host(fast)) and host(fast)[0] == 7.0
    ins = [make(n, float(k)) for k in range(6)]
    numba_arg = cuda.to_device(np.full(n, 10.0, dtype=np.float32))
    out_d, out_f = make(n, 0.0), make(n, 0.0)
    sum8[16, 256](out_d, *ins, numba_arg)
    launcher = foreign_args(sum8)
    for _ in range(3):  # later launches come from the cache
        launcher[16, 256](out_f, *ins, numba_arg)
    cuda.synchronize()
    assert np.array_equal(host(out_d), host(out_f)) and host(out_f)[0] == 25.0
    assert launcher.cache.hits >= 2 * 7


@pytest.mark.parametrize("lib", _libraries(), ids=lambda l: l[0])
def test_a_freed_or_reshaped_array_is_never_served_stale(kernels, lib):
    from gpuptr.numba import ArgCache, Launcher

    axpy, _ = kernels
    _, make, host = lib
    launcher = Launcher(axpy, cache=ArgCache())
    x = make(1024, 1.0)
    out = make(1024, 0.0)
    launcher[4, 256](out, x, 1.0)
    del x  # freed: its memory may go to the next array
    y = make(2048, 5.0)
    out2 = make(2048, 0.0)
    launcher[8, 256](out2, y, 2.0)
    cuda.synchronize()
    assert host(out2)[-1] == 10.0, "the new array's own length and values"
    y2 = y.reshape(2, 1024)[0]
    out3 = make(1024, 0.0)
    launcher[4, 256](out3, y2, 1.0)
    cuda.synchronize()
    assert host(out3)[0] == 5.0 and host(out3).shape == (1024,)


@pytest.mark.parametrize("lib", _libraries(), ids=lambda l: l[0])
def test_two_threads_launching_at_once(kernels, lib):
    from gpuptr.numba import foreign_args

    axpy, _ = kernels
    _, make, host = lib
    launcher = foreign_args(axpy)
    results, errors = {}, []

    def work(t):
        try:
            x = make(4096, float(t + 1))
            out = make(4096, 0.0)
            for _ in range(50):
                launcher[16, 256](out, x, 1.0)
            cuda.synchronize()
            results[t] = host(out)[0]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert results == {0: 50.0, 1: 100.0}
