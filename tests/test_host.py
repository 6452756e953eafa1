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
    base = _testing.sim_live_bytes()
    host_base, reg_base = _testing.sim_live_host_bytes(), _testing.sim_live_registrations()
    mem = gpuptr.alloc_host(1000, mapped=True)
    assert _testing.sim_live_host_bytes() == host_base + 1000
    v = mem.view(0)
    del mem
    gc.collect()
    assert np.frombuffer(v.copy_to_host(), dtype=np.uint8).size == 1000
    del v
    gc.collect()
    assert _testing.sim_live_host_bytes() == host_base
    arr = np.zeros(16)
    reg = gpuptr.register_host(arr)
    assert _testing.sim_live_registrations() == reg_base + 1
    del reg
    gc.collect()
    assert _testing.sim_live_registrations() == reg_base
    _testing.sim_fail_nth("host_alloc", 1, 2)
    with pytest.raises(gpuptr.OutOfMemoryError):
        gpuptr.alloc_host(64)
    _testing.sim_fail_nth("host_device_pointer", 1, 999)
    with pytest.raises(gpuptr.CudaError):
        gpuptr.alloc_host(64, mapped=True)
    _testing.sim_fail_nth("mem_alloc_managed", 1, 2)
    with pytest.raises(gpuptr.OutOfMemoryError):
        gpuptr.alloc_managed(64)
    assert _testing.sim_live_bytes() == base
    assert _testing.sim_live_host_bytes() == host_base
    assert _testing.sim_calls("host_alloc") >= 3
