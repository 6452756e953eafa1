"""gpuptr.cuda_core's memory resources on the simulator, with cuda.core's
real Buffer: a gpuptr buffer owns its allocation (cuda.core's ``owner``), so
making and closing one needs no driver. What needs one (a stream, a kernel,
DLPack) is in gpu/test_cuda_core_gpu.py."""

from __future__ import annotations

import gc

import pytest

import gpuptr

cc = pytest.importorskip("cuda.core", reason="cuda.core is in the test extra")
from gpuptr import cuda_core  # noqa: E402


def live(device: int = 0) -> int:
    gc.collect()
    return gpuptr.stats()[device]["clients"]["cuda_core"]["live_bytes"]


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
        buf = mr.allocate(256)
        # The buffer answers as its resource, with no driver query.
        assert isinstance(buf, cc.Buffer) and buf.memory_resource is mr
        assert (buf.device_id, buf.is_device_accessible, buf.is_host_accessible, buf.is_managed) == (1, dev, host, managed)
        buf.close()


def test_a_device_that_does_not_exist_or_is_not_a_device_is_refused():
    with pytest.raises(gpuptr.GpuptrError):
        cuda_core.MemoryResource(99)
    with pytest.raises(TypeError):
        cuda_core.MemoryResource("0")
    with pytest.raises(TypeError):
        cuda_core.MemoryResource(True)


def test_allocate_gives_a_pool_block_that_closing_the_buffer_frees(no_leaks):
    mr = cuda_core.MemoryResource(0)
    before = gpuptr.stats()[0]["clients"]["cuda_core"]
    buf = mr.allocate(1 << 20, stream=None)
    assert type(buf).__mro__[-2] is cc.Buffer
    assert buf.size == 1 << 20 and buf.handle != 0
    # Its owner is the gpuptr allocation, at the buffer's address.
    assert isinstance(buf.owner, gpuptr.MemoryPointer)
    assert buf.owner.device_pointer_value == buf.handle and buf.owner.size == 1 << 20
    s = gpuptr.stats()[0]["clients"]["cuda_core"]
    assert s["live_bytes"] == before["live_bytes"] + (1 << 20)
    assert s["alloc_count"] == before["alloc_count"] + 1
    # The address is gpuptr's: memory written through it reads back.
    gpuptr.wrap(buf.handle, 16).memset(9)
    assert gpuptr.wrap(buf.handle, 4).copy_to_host() == b"\t\t\t\t"
    buf.close()
    assert live() == before["live_bytes"]
    assert buf.is_closed and buf.memory_resource is None and buf.owner is None
    with pytest.raises(RuntimeError, match="closed"):
        buf.device_id
    buf.close()  # once only: cuda.core's close is idempotent, and so is the free
    assert live() == before["live_bytes"]


def test_a_dropped_buffer_frees_its_block_too(no_leaks):
    mr = cuda_core.MemoryResource(0)
    base = live()
    bufs = [mr.allocate(4096) for _ in range(10)]
    assert live() == base + 10 * 4096
    del bufs
    assert live() == base


def test_the_pool_reuses_what_a_closed_buffer_gave_back():
    mr = cuda_core.MemoryResource(0)
    a = mr.allocate(4096, stream=None)
    a.close()
    gpuptr.flush_pool(0)
    misses = gpuptr.stats()[0]["pool_misses"]
    b = mr.allocate(4096, stream=None)
    assert gpuptr.stats()[0]["pool_misses"] == misses, "the freed block went back to the pool"
    b.close()


def test_deallocate_frees_nothing_so_no_address_can_free_live_memory(no_leaks):
    mr = cuda_core.MemoryResource(0)
    keep = gpuptr.alloc(4096)
    mr.deallocate(keep.device_pointer_value, 4096, stream=None)  # not mr's
    keep.memset(1)  # still live and usable
    buf = mr.allocate(64, stream=None)
    base = live()
    # Its own buffer's address, as an int, a float or a numpy integer, twice:
    # the buffer keeps its block until it is closed.
    import numpy as np

    for ptr in (buf.handle, float(buf.handle), np.uint64(buf.handle), buf.handle):
        mr.deallocate(ptr, 64, stream=None)
    assert live() == base
    gpuptr.wrap(buf.handle, 64).memset(3)
    buf.close()
    assert live() == base - 64
    del keep


def test_a_buffer_made_before_a_reset_never_frees_one_made_after(no_leaks):
    # The buffer owns its exact allocation, not an address: after a reset a
    # new allocation may get the same address, and closing the old buffer
    # must leave the new one alone.
    mr = cuda_core.MemoryResource(0)
    old = mr.allocate(1 << 16)
    gpuptr.reset_context(0)
    new = mr.allocate(1 << 16)
    base = live()
    old.close()
    assert live() == base, "the stale buffer freed nothing"
    gpuptr.wrap(new.handle, 16).memset(5)
    assert gpuptr.wrap(new.handle, 2).copy_to_host() == b"\x05\x05"
    new.close()


def test_a_failed_buffer_leaves_nothing_allocated(monkeypatch, no_leaks):
    mr = cuda_core.MemoryResource(0)

    def broken(*a, **k):
        raise RuntimeError("cuda.core refused")

    monkeypatch.setattr(mr, "_make", broken)
    base = live()
    with pytest.raises(RuntimeError, match="refused"):
        mr.allocate(1 << 16, stream=None)
    assert live() == base


def test_out_of_memory_is_gpuptrs_typed_error_and_nothing_is_kept(no_leaks):
    mr = cuda_core.MemoryResource(0)
    base = live()
    with pytest.raises(gpuptr.OutOfMemoryError):
        mr.allocate(1 << 50, stream=None)
    with pytest.raises((OverflowError, ValueError, TypeError)):
        mr.allocate(-1)
    assert live() == base


def test_streams_of_any_library_are_taken_and_anything_else_refused(no_leaks):
    mr = cuda_core.MemoryResource(0)

    class NumbaLike:
        handle = 0x1234

    class Protocol:
        def __cuda_stream__(self):
            return (0, 0x5678)

    for stream in (None, 0x42, NumbaLike(), Protocol()):
        mr.allocate(256, stream=stream).close()
    for junk in ("s", 1.5, object()):
        with pytest.raises(TypeError, match="stream"):
            mr.allocate(256, stream=junk)


def test_pinned_and_managed_resources_give_host_accessible_memory(no_leaks):
    import ctypes

    for cls, owner in ((cuda_core.PinnedMemoryResource, "Memory"), (cuda_core.ManagedMemoryResource, "ManagedMemory")):
        mr = cls(0)
        buf = mr.allocate(64, stream=None)
        assert type(buf.owner).__name__.endswith(owner)
        ctypes.memset(buf.handle, 7, 64)  # host-accessible at the address cuda.core gets
        assert ctypes.string_at(buf.handle, 4) == b"\x07" * 4
        buf.close()
        assert buf.owner is None


def test_managed_buffers_are_cuda_cores_managed_buffers():
    managed = getattr(cc, "ManagedBuffer", None)
    if managed is None:
        pytest.skip("this cuda.core has no ManagedBuffer")
    buf = cuda_core.ManagedMemoryResource(0).allocate(4096)
    assert isinstance(buf, managed) and buf.is_managed
    buf.close()


def test_zero_bytes_give_an_empty_buffer_that_owns_nothing(no_leaks):
    for cls in (cuda_core.MemoryResource, cuda_core.PinnedMemoryResource, cuda_core.ManagedMemoryResource):
        buf = cls(0).allocate(0)
        assert buf.size == 0 and buf.handle == 0 and buf.owner is None
        buf.close()


def test_buffers_outlive_their_resource(no_leaks):
    buf = cuda_core.MemoryResource(0).allocate(4096)
    gc.collect()
    assert buf.memory_resource.device_id == 0
    gpuptr.wrap(buf.handle, 8).memset(1)
    buf.close()


def test_many_threads_allocate_and_close_through_one_resource(no_leaks):
    import threading

    mr = cuda_core.MemoryResource(0)
    errors = []
    base = live()

    def work():
        try:
            for _ in range(200):
                mr.allocate(512, stream=None).close()
                b = mr.allocate(256)
                del b
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == [] and live() == base


def test_without_cuda_cores_private_entry_point_buffers_still_own_their_memory(no_leaks):
    # Another cuda.core version may lack Buffer._init: the public
    # from_handle is used then, and the buffer still frees its block.
    mr = cuda_core.MemoryResource(0)
    make = cuda_core._buffer_maker(mr, type("Buffer", (), {}))
    base = live()
    buf = cuda_core._core._cuda_core_buffer(make, 4096, 0)
    assert type(buf) is cc.Buffer and isinstance(buf.owner, gpuptr.MemoryPointer)
    assert live() == base + 4096
    buf.close()
    assert live() == base
