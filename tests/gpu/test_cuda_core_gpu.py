"""gpuptr.cuda_core's memory resources with the real cuda.core on the GPU:
Buffers used by a cuda.core kernel launch, through DLPack into CuPy and
torch, as the device's memory resource, and freed while a kernel on another
stream still uses them. Each against cuda.core's own DeviceMemoryResource
in the same test."""

from __future__ import annotations

import time

import pytest

import gpuptr

pytestmark = pytest.mark.gpu

cc = pytest.importorskip("cuda.core")
np = pytest.importorskip("numpy")

_SOURCE = r"""
extern "C" __global__ void fill(unsigned char* p, unsigned char v, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}
extern "C" __global__ void spin_fill(unsigned char* p, unsigned char v, unsigned long long n,
                                     long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}
"""


@pytest.fixture(scope="module")
def dev():
    d = cc.Device(0)
    d.set_current()
    return d


@pytest.fixture(scope="module")
def kernels(dev):
    arch = "".join(str(x) for x in dev.compute_capability)
    prog = cc.Program(_SOURCE, code_type="c++", options=cc.ProgramOptions(arch=f"sm_{arch}"))
    mod = prog.compile("cubin")
    return mod.get_kernel("fill"), mod.get_kernel("spin_fill")


def _fill(stream, kernel, buf, value, n):
    cfg = cc.LaunchConfig(grid=(n + 255) // 256, block=256)
    cc.launch(stream, cfg, kernel, buf, np.uint8(value), np.uint64(n))


def test_buffers_feed_a_cuda_core_kernel_and_cupy_and_torch_through_dlpack(dev, kernels):
    from gpuptr import cuda_core

    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    fill, _ = kernels
    stream = dev.create_stream()
    n = 1 << 20
    got = {}
    for name, mr in [("gpuptr", cuda_core.MemoryResource(0)), ("cuda.core", cc.DeviceMemoryResource(0))]:
        live_before = gpuptr.stats()[0]["clients"]["cuda_core"]["live_bytes"]
        buf = mr.allocate(n, stream=stream)
        assert buf.memory_resource is mr and buf.device_id == 0 and buf.size == n
        assert buf.is_device_accessible and not buf.is_host_accessible
        _fill(stream, fill, buf, 7, n)
        stream.sync()
        c = cupy.from_dlpack(buf).view(cupy.uint8)
        t = torch.from_dlpack(buf).view(torch.uint8)
        grew = gpuptr.stats()[0]["clients"]["cuda_core"]["live_bytes"] - live_before
        got[name] = (int(c.sum()), int(t.sum()), c.data.ptr == int(buf.handle), grew)
        del c, t
        buf.close()
    assert got["gpuptr"][:3] == got["cuda.core"][:3] == (7 * n, 7 * n, True), got
    assert got["gpuptr"][3] == n and got["cuda.core"][3] == 0, "only gpuptr's resource uses gpuptr's pool"


def test_buffers_copy_close_on_a_stream_and_own_their_memory_as_cuda_cores_do(dev, kernels):
    # What a cuda.core user does with a buffer beyond allocate: copy_to with
    # no destination (a new buffer from the same resource), copy_from,
    # close on a given stream, set_deallocation_stream.
    from gpuptr import cuda_core

    fill, _ = kernels
    stream = dev.create_stream()
    n = 1 << 16
    host = np.empty(n, dtype=np.uint8)
    before = gpuptr.stats()[0]["clients"]["cuda_core"]["live_bytes"]
    for name, mr in [("gpuptr", cuda_core.MemoryResource(0)), ("cuda.core", cc.DeviceMemoryResource(0))]:
        src = mr.allocate(n, stream=stream)
        _fill(stream, fill, src, 4, n)
        dst = src.copy_to(stream=stream)
        assert dst.memory_resource is mr and dst.size == n, name
        back = mr.allocate(n, stream=stream)
        back.copy_from(dst, stream=stream)
        _copy_out(back, host, stream)
        assert (host == 4).all(), name
        src.set_deallocation_stream(stream)
        for b in (src, dst, back):
            b.close(stream)
        assert src.is_closed and src.memory_resource is None, name
    stream.sync()
    assert gpuptr.stats()[0]["clients"]["cuda_core"]["live_bytes"] == before


def test_installed_as_the_devices_resource_device_allocate_uses_the_pool(dev, kernels):
    from gpuptr import cuda_core

    fill, _ = kernels
    saved = dev.memory_resource
    try:
        mr = cuda_core.install(cuda_device=dev)
        assert dev.memory_resource is mr and cuda_core.install(cuda_device=dev) is mr
        stream = dev.create_stream()
        before = gpuptr.stats()[0]["clients"]["cuda_core"]["alloc_count"]
        bufs = [dev.allocate(4096, stream=stream) for _ in range(10)]
        assert gpuptr.stats()[0]["clients"]["cuda_core"]["alloc_count"] == before + 10
        for b in bufs:
            _fill(stream, fill, b, 3, 4096)
        stream.sync()
        host = np.empty(4096, dtype=np.uint8)
        for b in bufs:
            gpuptr.wrap(int(b.handle), 4096).copy_to_host(host)
            assert (host == 3).all()
            b.close()
    finally:
        dev.memory_resource = saved


def test_pinned_and_managed_buffers_are_seen_by_host_and_kernel(dev, kernels):
    from gpuptr import cuda_core

    fill, _ = kernels
    stream = dev.create_stream()
    for mr in (cuda_core.PinnedMemoryResource(0), cuda_core.ManagedMemoryResource(0)):
        buf = mr.allocate(4096, stream=stream)
        assert buf.is_host_accessible and buf.is_device_accessible
        assert buf.is_managed == isinstance(mr, cuda_core.ManagedMemoryResource)
        _fill(stream, fill, buf, 5, 4096)
        stream.sync()
        import ctypes

        assert ctypes.string_at(int(buf.handle), 4096) == b"\x05" * 4096, type(mr).__name__
        buf.close()


def test_a_buffer_closed_while_a_kernel_on_another_stream_uses_it_is_not_reused(dev, kernels):
    # cuda.core orders a buffer's free on its deallocation stream only: a
    # buffer closed on s2 while a kernel on s1 still writes it may be handed
    # to the next allocation on s2 at once (the user's duty is to order s1
    # before s2). gpuptr's pool waits for the work on every stream.
    from gpuptr import cuda_core

    fill, spin_fill = kernels
    s1, s2 = dev.create_stream(), dev.create_stream()
    n = 1 << 20
    cfg = cc.LaunchConfig(grid=(n + 255) // 256, block=256)
    outcome = {}
    for name, mr in [("gpuptr", cuda_core.MemoryResource(0)), ("cuda.core", cc.DeviceMemoryResource(0))]:
        # Warm both the kernel (lazy loading) and the resource's size class.
        warm = [mr.allocate(n, stream=s2) for _ in range(9)]
        cc.launch(s1, cfg, spin_fill, warm[0], np.uint8(0), np.uint64(n), np.int64(0))
        dev.sync()
        for w in warm:
            w.close()
        if name == "gpuptr":
            gpuptr.flush_pool(0)
        a = mr.allocate(n, stream=s1)
        a_addr = int(a.handle)
        cc.launch(s1, cfg, spin_fill, a, np.uint8(9), np.uint64(n), np.int64(1 << 30))
        ended = s1.record()
        t = [time.perf_counter()]
        a.close(s2)  # freed on another stream while the kernel runs
        t.append(time.perf_counter())
        new = [mr.allocate(n, stream=s2) for _ in range(8)]
        t.append(time.perf_counter())
        running = not ended.is_done
        for x in new:
            _fill(s2, fill, x, 2, n)
        dev.sync()
        t.append(time.perf_counter())
        reused = [x for x in new if int(x.handle) == a_addr]
        host = np.empty(n, dtype=np.uint8)
        corrupted = 0
        for x in new:
            _copy_out(x, host, s2)
            corrupted += int((host != 2).any())
        ms = [round((b - a_) * 1e3, 2) for a_, b in zip(t, t[1:])]
        outcome[name] = (len(reused), corrupted, running, ms)
        for x in new:
            x.close()
    print("(reused, corrupted, kernel still running, ms close/allocs/rest):", outcome)
    assert outcome["gpuptr"][2], f"the kernel ended before the new buffers were made; proved nothing: {outcome}"
    assert outcome["gpuptr"][:2] == (0, 0), outcome


def _copy_out(buf, host, stream):
    from cuda.bindings import driver as cu

    stream.sync()
    (err,) = cu.cuMemcpyDtoH(host.ctypes.data, int(buf.handle), host.nbytes)
    assert int(err) == 0, err
