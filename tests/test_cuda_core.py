"""gpuptr.cuda_core's memory resources on the simulator. cuda.core imports
without a GPU, but its Buffer needs the CUDA driver to record a stream, so
here a stand-in for Buffer.from_handle records what the resource passes
and calls back as cuda.core does; the real Buffer is in
gpu/test_cuda_core_gpu.py."""

from __future__ import annotations

import gc

import pytest

import gpuptr

cc = pytest.importorskip("cuda.core", reason="cuda.core is in the test extra")
from gpuptr import cuda_core  # noqa: E402


class FakeBuffer:
    """What cuda.core's Buffer does with a resource: keeps it, and calls
    ``mr.deallocate(ptr, size, stream=...)`` once, on close."""

    made: list = []

    def __init__(self, ptr, size, mr, stream):
        self.ptr, self.size, self.mr, self.stream, self.closed = ptr, size, mr, stream, False

    @classmethod
    def from_handle(cls, ptr, size, mr=None, owner=None, *, stream=None):
        b = cls(ptr, size, mr, stream)
        cls.made.append(b)
        return b

    def close(self, stream=None):
        if not self.closed:
            self.closed = True
            self.mr.deallocate(self.ptr, self.size, stream=stream or self.stream)


@pytest.fixture
def fake_buffer(monkeypatch):
    FakeBuffer.made = []
    monkeypatch.setattr(cuda_core, "_Buffer", FakeBuffer)
    return FakeBuffer


def test_the_resources_are_cuda_core_memory_resources_with_the_right_properties():
    for cls, dev, host, managed in [
        (cuda_core.MemoryResource, True, False, False),
        (cuda_core.PinnedMemoryResource, True, True, False),
        (cuda_core.ManagedMemoryResource, True, True, True),
    ]:
        mr = cls(1)
        assert isinstance(mr, cc.MemoryResource)
        assert (mr.device_id, mr.is_device_accessible, mr.is_host_accessible, mr.is_managed) == (1, dev, host, managed)
        assert repr(mr) == f"gpuptr.cuda_core.{cls.__name__}(device=1)"


def test_a_device_that_does_not_exist_or_is_not_a_device_is_refused():
    with pytest.raises(gpuptr.GpuptrError):
        cuda_core.MemoryResource(99)
    with pytest.raises(TypeError):
        cuda_core.MemoryResource("0")
    with pytest.raises(TypeError):
        cuda_core.MemoryResource(True)


def test_allocate_gives_a_pool_block_and_closing_the_buffer_frees_it(fake_buffer, no_leaks):
    mr = cuda_core.MemoryResource(0)
    before = gpuptr.stats()[0]["clients"]["cuda_core"]
    buf = mr.allocate(1 << 20, stream=None)
    assert buf.size == 1 << 20 and buf.mr is mr and buf.ptr != 0
    s = gpuptr.stats()[0]
    assert s["clients"]["cuda_core"]["live_bytes"] == before["live_bytes"] + (1 << 20)
    assert s["clients"]["cuda_core"]["alloc_count"] == before["alloc_count"] + 1
    # The address is gpuptr's: memory written through it reads back.
    gpuptr.wrap(buf.ptr, 16).memset(9)
    assert gpuptr.wrap(buf.ptr, 4).copy_to_host() == b"\t\t\t\t"
    buf.close()
    assert gpuptr.stats()[0]["clients"]["cuda_core"]["live_bytes"] == before["live_bytes"]
    buf.close()  # once only: cuda.core's close is idempotent, and so is the free


def test_the_pool_reuses_what_a_closed_buffer_gave_back(fake_buffer):
    mr = cuda_core.MemoryResource(0)
    a = mr.allocate(4096, stream=None)
    addr = a.ptr
    a.close()
    gpuptr.flush_pool(0)
    b = mr.allocate(4096, stream=None)
    assert b.ptr == addr, "the freed block went back to the pool"
    b.close()


def test_deallocate_of_an_address_it_does_not_own_frees_nothing(fake_buffer, no_leaks):
    mr = cuda_core.MemoryResource(0)
    keep = gpuptr.alloc(4096)
    mr.deallocate(keep.device_pointer_value, 4096, stream=None)  # not mr's
    keep.memset(1)  # still live and usable
    other = cuda_core.MemoryResource(0)
    buf = other.allocate(64, stream=None)
    mr.deallocate(buf.ptr, 64, stream=None)  # another resource's buffer
    assert gpuptr.stats()[0]["clients"]["cuda_core"]["live_bytes"] >= 64
    buf.close()
    del keep


def test_a_failed_buffer_leaves_nothing_allocated(monkeypatch, no_leaks):
    class Broken:
        @staticmethod
        def from_handle(*a, **k):
            raise RuntimeError("cuda.core refused")

    monkeypatch.setattr(cuda_core, "_Buffer", Broken)
    mr = cuda_core.MemoryResource(0)
    with pytest.raises(RuntimeError, match="refused"):
        mr.allocate(1 << 16, stream=None)
    assert mr._live == {}


def test_out_of_memory_is_gpuptrs_typed_error_and_nothing_is_kept(fake_buffer, no_leaks):
    mr = cuda_core.MemoryResource(0)
    with pytest.raises(gpuptr.OutOfMemoryError):
        mr.allocate(1 << 50, stream=None)
    assert mr._live == {} and fake_buffer.made == []


def test_streams_are_passed_as_cuda_core_takes_them(fake_buffer, monkeypatch):
    seen = []
    class FakeStream:  # cuda.core's Stream.from_handle needs the driver
        @staticmethod
        def from_handle(h):
            seen.append(h)
            return ("stream", h)

    monkeypatch.setattr(cuda_core, "_Stream", FakeStream)
    mr = cuda_core.MemoryResource(0)

    class NumbaLike:
        handle = 0x1234

    class Protocol:
        def __cuda_stream__(self):
            return (0, 0x5678)

    for stream, want in [(None, None), (0x42, ("stream", 0x42)), (NumbaLike(), ("stream", 0x1234)), (Protocol(), ("stream", 0x5678))]:
        buf = mr.allocate(256, stream=stream)
        assert buf.stream == want
        buf.close()
    assert seen == [0x42, 0x1234, 0x5678]
    with pytest.raises(TypeError, match="stream"):
        mr.allocate(256, stream="s")
    assert mr._live == {}


def test_pinned_and_managed_resources_give_host_accessible_memory(fake_buffer, no_leaks):
    import ctypes

    for cls in (cuda_core.PinnedMemoryResource, cuda_core.ManagedMemoryResource):
        mr = cls(0)
        buf = mr.allocate(64, stream=None)
        ctypes.memset(buf.ptr, 7, 64)  # host-accessible at the address cuda.core gets
        assert ctypes.string_at(buf.ptr, 4) == b"\x07" * 4
        buf.close()
        gc.collect()
        assert mr._live == {}


def test_many_threads_allocate_and_close_through_one_resource(fake_buffer, no_leaks):
    import threading

    mr = cuda_core.MemoryResource(0)
    errors = []

    def work():
        try:
            for _ in range(200):
                mr.allocate(512, stream=None).close()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == [] and mr._live == {}


def test_deallocate_takes_the_address_as_cuda_core_may_pass_it(fake_buffer, no_leaks):
    # cuda.core passes an int; a user (or a cuda.bindings CUdeviceptr) may pass
    # anything int() takes. Either frees exactly once.
    class DevPtr:
        def __init__(self, v):
            self.v = v

        def __int__(self):
            return self.v

    mr = cuda_core.MemoryResource(0)
    buf = mr.allocate(4096, stream=None)
    mr.deallocate(DevPtr(buf.ptr), 4096, stream=None)
    assert mr._live == {}
    mr.deallocate(buf.ptr, 4096, stream=None)  # again: ignored


def test_pool_free_never_frees_what_cupys_or_torchs_hook_handed_out(no_leaks):
    import ctypes

    from gpuptr import _core

    lib = ctypes.CDLL(_core.__file__)
    lib.gpuptr_torch_alloc.restype = ctypes.c_void_p
    lib.gpuptr_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.gpuptr_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    cupy_block = _core._cupy_malloc(4096, 0)
    torch_block = lib.gpuptr_torch_alloc(4096, 0, None)
    live, failures = _core._hooks_state()
    # A cuda.core resource's free (or a stale address it still holds) of
    # another library's live memory releases nothing.
    assert not _core._pool_free(cupy_block)
    assert not _core._pool_free(torch_block)
    assert _core._hooks_state() == (live, failures + 2)
    # And each library's own free still releases its own, once.
    ours = _core._pool_malloc("cuda_core", 4096, 0)
    _core._cupy_free(ours, 0)
    lib.gpuptr_torch_free(ours, 0, 0, None)
    assert _core._hooks_state()[0] == live + 1, "CuPy's and torch's frees left the pool's block alone"
    assert _core._pool_free(ours)
    _core._cupy_free(cupy_block, 0)
    lib.gpuptr_torch_free(torch_block, 4096, 0, None)
    assert _core._hooks_state()[0] == live - 2


@pytest.mark.parametrize("kind", ["float", "numpy"])
def test_deallocate_of_an_address_that_hashes_as_the_int_frees_it_once(fake_buffer, no_leaks, kind):
    # A float or a numpy integer equal to the address finds its entry as the
    # int does; the free must then go through, not raise with the entry gone.
    import numpy as np

    mr = cuda_core.MemoryResource(0)
    buf = mr.allocate(4096, stream=None)
    ptr = float(buf.ptr) if kind == "float" else np.uint64(buf.ptr)
    mr.deallocate(ptr, 4096, stream=None)
    assert mr._live == {}
    assert gpuptr.stats()[0]["clients"]["cuda_core"]["live_bytes"] == 0
