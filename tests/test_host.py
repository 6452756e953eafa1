"""Pinned, mapped, registered and managed memory, with numba's constructor
shapes and the buffer protocol. Runs on the simulator and on the GPU."""

from __future__ import annotations

import ctypes
import gc

import pytest

import gpuptr

np = pytest.importorskip("numpy")


def test_pinned_memory_exports_its_bytes():
    mem = gpuptr.alloc_host(64)
    assert isinstance(mem, gpuptr.PinnedMemory) and mem.size == 64 and mem.is_managed
    view = np.frombuffer(mem, dtype=np.uint8)
    view[:] = np.arange(64, dtype=np.uint8)
    assert bytes(memoryview(mem))[:4] == b"\x00\x01\x02\x03"
    assert mem.handle == mem.host_pointer == view.ctypes.data
    assert mem.context is gpuptr.context(0)
    assert mem.own() is mem
    del view
    mem.free()
    mem.free()
    with pytest.raises(gpuptr.InvalidPointerError):
        memoryview(mem)


def test_mapped_memory_is_device_memory_over_host_bytes():
    mem = gpuptr.alloc_host(256, mapped=True)
    assert isinstance(mem, gpuptr.MappedMemory) and isinstance(mem, gpuptr.MemoryPointer)
    host = np.frombuffer(mem, dtype=np.uint8)
    mem.memset(0x11)  # through the device address
    assert (host == 0x11).all()
    host[:4] = 5
    assert mem.copy_to_host()[:5] == b"\x05\x05\x05\x05\x11"
    assert mem.handle == mem.host_pointer
    assert mem.device_pointer_value is not None
    v = mem.view(128)
    assert v.size == 128 and v.copy_to_host() == b"\x11" * 128


def test_register_host_pins_a_numpy_array_in_place():
    arr = np.zeros(1024, dtype=np.uint8)
    mem = gpuptr.register_host(arr, mapped=True)
    assert isinstance(mem, gpuptr.MappedMemory) and mem.owned is arr
    assert mem.host_pointer == arr.ctypes.data and mem.size == 1024
    mem.view(10, 20).memset(3)
    assert arr[9] == 0 and (arr[10:20] == 3).all() and arr[20] == 0
    mem.free()
    plain = gpuptr.register_host(bytearray(32))
    assert isinstance(plain, gpuptr.PinnedMemory) and plain.size == 32


def test_register_host_refuses_non_contiguous_buffers():
    arr = np.zeros((4, 4))[:, ::2]
    with pytest.raises((gpuptr.InvalidArgumentError, BufferError)):
        gpuptr.register_host(arr)


def test_managed_memory_is_reachable_from_host_and_device(no_leaks):
    mem = gpuptr.alloc_managed(4096)
    assert isinstance(mem, gpuptr.ManagedMemory) and isinstance(mem, gpuptr.MemoryPointer)
    assert mem.context is gpuptr.context(0) and mem.is_managed
    mem.memset(7)
    gpuptr.context(0).synchronize()
    host = np.frombuffer(mem, dtype=np.uint8)
    assert (host == 7).all()
    host[0] = 1
    assert mem.view(0, 2).copy_to_host(bytearray(2)) == bytearray(b"\x01\x07")
    assert gpuptr.context_of(mem.device_pointer_value + 100) is gpuptr.context(0)
    del host
    mem.free()


def test_numba_constructor_shapes_wrap_existing_memory():
    ctx = gpuptr.context(0)
    owner_mapped = gpuptr.alloc_host(64, mapped=True)
    m = gpuptr.MappedMemory(ctx, ctypes.c_void_p(owner_mapped.host_pointer), 64)
    assert m.device_pointer_value == owner_mapped.device_pointer_value and not m.is_managed
    m.memset(2)
    assert bytes(memoryview(owner_mapped)) == b"\x02" * 64
    owner_pinned = gpuptr.alloc_host(32)
    p = gpuptr.PinnedMemory(ctx, owner_pinned.host_pointer, 32, owner=owner_pinned)
    assert p.owned is owner_pinned and not p.is_managed
    np.frombuffer(p, dtype=np.uint8)[:] = 9
    assert bytes(memoryview(owner_pinned)) == b"\x09" * 32
    owner_managed = gpuptr.alloc_managed(128)
    calls = []
    mm = gpuptr.ManagedMemory(ctx, owner_managed.device_pointer_value, 128, finalizer=lambda: calls.append(1))
    mm.memset(4)
    assert bytes(memoryview(owner_managed)) == b"\x04" * 128
    del mm
    gc.collect()
    assert calls == [1]


def test_zero_byte_host_allocations():
    mem = gpuptr.alloc_host(0)
    assert bytes(memoryview(mem)) == b""
    assert gpuptr.alloc_managed(0).size == 0


@pytest.mark.sim
def test_host_memory_is_released_and_faults_leak_nothing():
    from gpuptr import _testing

    gc.collect()
    gpuptr.trim()  # an empty pinned cache: the allocation below goes to the driver
    base = _testing.sim_live_bytes()
    host_base, reg_base = _testing.sim_live_host_bytes(), _testing.sim_live_registrations()
    mem = gpuptr.alloc_host(1000, mapped=True)
    assert _testing.sim_live_host_bytes() == host_base + 1024  # its size class
    v = mem.view(0)
    del mem
    gc.collect()
    assert np.frombuffer(v.copy_to_host(), dtype=np.uint8).size == 1000
    del v
    gc.collect()
    # Released into the pinned cache (its 1 KiB class), then by a trim to
    # the driver.
    assert _testing.sim_live_host_bytes() == host_base + 1024
    gpuptr.trim()
    assert _testing.sim_live_host_bytes() == host_base
    arr = np.zeros(16)
    reg = gpuptr.register_host(arr)
    assert _testing.sim_live_registrations() == reg_base + 1
    del reg
    gc.collect()
    assert _testing.sim_live_registrations() == reg_base
    _testing.sim_fail_nth("host_alloc", 1, 2)
    _testing.sim_fail_nth("host_alloc", 2, 2)  # beat the cache's one retry
    with pytest.raises(gpuptr.OutOfMemoryError):
        gpuptr.alloc_host(64)
    _testing.sim_fail_nth("host_device_pointer", 1, 999)
    with pytest.raises(gpuptr.CudaError):
        gpuptr.alloc_host(64, mapped=True)
    _testing.sim_fail_nth("mem_alloc_managed", 1, 2)
    with pytest.raises(gpuptr.OutOfMemoryError):
        gpuptr.alloc_managed(64)
    gc.collect()
    gpuptr.trim()  # the mapped block whose device pointer failed went back to the cache
    assert _testing.sim_live_bytes() == base
    assert _testing.sim_live_host_bytes() == host_base
    assert _testing.sim_calls("host_alloc") >= 3


# --- the pinned host cache ----------------------------------------------------

NON_BLOCKING = 0x7E57_0001  # a simulator stream handle


def _host_stats():
    return gpuptr.stats()[0]["host"]


@pytest.mark.sim
def test_pinned_memory_is_cached_and_reused_after_the_fence():
    gc.collect()
    before = _host_stats()
    assert set(before) == {
        "held_bytes", "live_bytes", "live_count", "cached_bytes", "pending_bytes", "hits", "misses", "cache_limit"
    }
    mem = gpuptr.alloc_host(5000)
    addr = mem.host_pointer
    live = _host_stats()
    assert live["live_bytes"] == before["live_bytes"] + 5000
    assert live["live_count"] == before["live_count"] + 1
    del mem
    gc.collect()
    freed = _host_stats()
    assert freed["live_count"] == before["live_count"]
    assert freed["cached_bytes"] >= 5000
    assert gpuptr.flush_pool()
    again = gpuptr.alloc_host(5000)
    assert again.host_pointer == addr
    assert _host_stats()["hits"] == before["hits"] + 1
    del again


@pytest.mark.sim
def test_a_pinned_block_used_by_queued_work_waits_for_it_and_flags_stay_apart():
    from gpuptr import _testing

    gc.collect()
    stale = _testing.sim_stale_writes()
    mem = gpuptr.alloc_host(4096, mapped=True)
    addr = mem.host_pointer
    # A copy on a non-blocking stream writes the block later; it is freed now.
    _testing.sim_queue_write(NON_BLOCKING, addr, b"\xab" * 4096)
    del mem
    gc.collect()
    fresh = [gpuptr.alloc_host(4096, mapped=True) for _ in range(50)]
    other = [gpuptr.alloc_host(4096, **kw) for kw in ({}, {"portable": True}, {"wc": True})]
    assert all(h.host_pointer != addr for h in fresh + other)
    for h in fresh:
        np.asarray(h)[:] = 0
    assert _host_stats()["pending_bytes"] >= 4096
    assert _testing.sim_complete() == 1
    assert _testing.sim_stale_writes() == stale
    assert all(not np.asarray(h).any() for h in fresh)
    assert gpuptr.flush_pool()
    # Ready now, but only for its own flags.
    unmapped = gpuptr.alloc_host(4096)
    assert unmapped.host_pointer != addr
    again = [gpuptr.alloc_host(4096, mapped=True) for _ in range(60)]
    assert any(h.host_pointer == addr for h in again)
    del fresh, other, unmapped, again


@pytest.mark.sim
def test_trim_gives_the_pinned_cache_back_and_summary_shows_it():
    from gpuptr import _testing

    gc.collect()
    gpuptr.trim()
    base, held = _testing.sim_live_host_bytes(), _host_stats()["held_bytes"]
    mems = [gpuptr.alloc_host(1 << 16, mapped=bool(i % 2)) for i in range(4)]
    del mems
    gc.collect()
    assert _testing.sim_live_host_bytes() == base + 4 * (1 << 16), "cached, not freed"
    summary = gpuptr.memory_summary(0)
    assert "pinned host: holds" in summary and "cached 256.0 KiB" in summary, summary
    gpuptr.trim()
    assert _testing.sim_live_host_bytes() == base
    h = _host_stats()
    assert (h["cached_bytes"], h["pending_bytes"]) == (0, 0)
    assert h["held_bytes"] == held


@pytest.mark.sim
def test_registered_memory_is_not_cached():
    from gpuptr import _testing

    gc.collect()
    regs = _testing.sim_live_registrations()
    held = _host_stats()["held_bytes"]
    reg = gpuptr.register_host(np.zeros(4096, np.uint8))
    assert _host_stats()["held_bytes"] == held
    del reg
    gc.collect()
    assert _testing.sim_live_registrations() == regs
