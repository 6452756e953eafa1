"""Contexts, pointers and views through the Python API. These run on the
simulator in CI and on the real driver on the GPU machine."""

from __future__ import annotations

import ctypes
import gc
import weakref

import pytest

import gpuptr


def test_context_is_one_object_per_device():
    a = gpuptr.context(0)
    assert a is gpuptr.context(0)
    assert a.device.id == 0
    assert a == gpuptr.context(0)
    assert a.handle.value == int(a.handle) != 0
    assert a.handle == int(a.handle)


def test_alloc_memset_and_copy_round_trip(no_leaks):
    mem = gpuptr.alloc(4096)
    assert mem.size == 4096 and mem._cuda_memsize_ == 4096
    assert mem.is_managed
    mem.memset(0x5A)
    assert mem.copy_to_host() == b"\x5a" * 4096
    data = bytes(range(256)) * 16
    mem.copy_from_host(data)
    assert mem.copy_to_host() == data
    out = bytearray(100)
    mem.view(10, 110).copy_to_host(out)
    assert bytes(out) == data[10:110]
    del mem


def test_memset_count_sets_only_a_prefix(no_leaks):
    mem = gpuptr.alloc(64)
    mem.memset(0)
    mem.memset(7, count=10)
    assert mem.copy_to_host() == b"\x07" * 10 + b"\x00" * 54


def test_view_address_arithmetic_and_copies(no_leaks):
    mem = gpuptr.alloc(1000)
    base = mem.device_pointer_value
    v = mem.view(100, 300)
    assert v.device_pointer_value == base + 100
    assert v.device_ctypes_pointer.value == base + 100
    assert isinstance(v.device_ctypes_pointer, ctypes.c_size_t)
    assert v.size == 200 and v.offset == 100
    vv = v.view(50)
    assert vv.device_pointer_value == base + 150 and vv.size == 150
    mem.memset(0)
    vv.memset(9, count=5)
    assert mem.copy_to_host()[148:157] == b"\x00\x00" + b"\x09" * 5 + b"\x00\x00"
    dst = gpuptr.alloc(200)
    dst.copy_from_device(v)
    assert dst.copy_to_host() == mem.copy_to_host()[100:300]


def test_view_keeps_parent_alive_after_parent_object_is_gone(no_leaks):
    mem = gpuptr.alloc(512)
    mem.memset(3)
    live = gpuptr.stats()[0]["live_bytes"]
    v = mem.view(256)
    r = weakref.ref(mem)
    del mem
    gc.collect()
    assert r() is not None, "a view holds its root pointer as owner"
    assert gpuptr.stats()[0]["live_bytes"] == live
    assert v.copy_to_host() == b"\x03" * 256
    del v
    gc.collect()
    assert r() is None


def test_refct_counts_views_and_own_handles(no_leaks):
    mem = gpuptr.alloc(64)
    assert mem.refct == 1
    v = mem.view(8)
    assert mem.refct == 2
    o = mem.own()
    assert mem.refct == 3 and o.device_pointer_value == mem.device_pointer_value
    del v, o
    assert mem.refct == 1
    assert mem.view(0).owner is mem


def test_double_free_is_safe(no_leaks):
    mem = gpuptr.alloc(128)
    mem.free()
    mem.free()
    assert mem.freed


def test_freed_pointer_raises_invalid_pointer_on_use(no_leaks):
    mem = gpuptr.alloc(128)
    v = mem.view(0, 64)
    mem.free()
    for use in (
        lambda: mem.memset(0),
        lambda: mem.copy_to_host(),
        lambda: mem.view(0, 1),
        lambda: v.memset(1),
        lambda: v.copy_from_host(b"x"),
    ):
        with pytest.raises(gpuptr.InvalidPointerError):
            use()
    with pytest.raises(ValueError):  # InvalidPointerError is a ValueError
        v.copy_to_host()


def test_numpy_refuses_device_memory_and_says_how_to_read_it(no_leaks):
    # numpy cannot read device memory in place: np.asarray made a 0-d object
    # array holding the pointer, silently.
    np = pytest.importorskip("numpy")
    mem = gpuptr.alloc(16)
    for device in (mem, mem.view(4), gpuptr.as_array(mem, 4, "float32")):
        for to_numpy in (np.asarray, np.array):
            with pytest.raises(TypeError, match="copy_to_host") as e:
                to_numpy(device)
            assert "CuPy" in str(e.value) and "torch" in str(e.value), e.value
    # A view of mapped host memory is read through the memory itself (the
    # message said numpy cannot read device memory).
    mapped = gpuptr.alloc_host(16, mapped=True)
    with pytest.raises(TypeError, match="through the MappedMemory itself"):
        np.asarray(mapped.view(0, 8))
    mapped.free()
    # Host memory is host memory: numpy reads its bytes.
    for host in (gpuptr.alloc_host(16, mapped=True), gpuptr.alloc_managed(16), gpuptr.alloc_host(16)):
        assert np.asarray(host).shape == (16,)
        host.free()
        # Freed, it is refused as freed, not as device memory numpy cannot read.
        for to_numpy in (np.asarray, np.array):
            with pytest.raises(gpuptr.InvalidPointerError, match="freed"):
                to_numpy(host)
    mem.free()
    with pytest.raises(gpuptr.InvalidPointerError, match="freed"):
        np.asarray(mem)


def test_zero_size_alloc_is_a_null_pointer(no_leaks):
    mem = gpuptr.alloc(0)
    assert mem.size == 0
    assert mem.device_pointer_value is None
    assert mem.copy_to_host() == b""
    assert mem.view(0).size == 0
    mem.free()


@pytest.mark.parametrize(
    "start, stop",
    [(101, None), (0, 101), (60, 50), (200, 300)],
)
def test_out_of_range_views_are_invalid_pointer(start, stop, no_leaks):
    mem = gpuptr.alloc(100)
    with pytest.raises(gpuptr.InvalidPointerError):
        mem.view(start, stop)


@pytest.mark.parametrize("start, stop", [(-1, None), (0, -1)])
def test_negative_view_bounds_are_invalid_argument(start, stop, no_leaks):
    # An int out of its argument's range, as a negative size is.
    mem = gpuptr.alloc(100)
    with pytest.raises(gpuptr.InvalidArgumentError, match="view"):
        mem.view(start, stop)


def test_empty_views_at_the_edges(no_leaks):
    mem = gpuptr.alloc(100)
    assert mem.view(100).size == 0
    assert mem.view(40, 40).size == 0
    # numba's slicing asks for empty views past the end; its own view allows them.
    assert mem.view(104, 104).size == 0


def test_memset_and_copies_beyond_the_size_are_refused(no_leaks):
    mem = gpuptr.alloc(16)
    with pytest.raises(gpuptr.InvalidPointerError):
        mem.memset(0, count=17)
    with pytest.raises(gpuptr.InvalidPointerError):
        mem.copy_from_host(b"x" * 17)
    with pytest.raises(gpuptr.InvalidPointerError):
        mem.view(8).copy_to_host(bytearray(9))


def test_bad_sizes_are_typed_errors(no_leaks):
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.alloc(-1)
    with pytest.raises(TypeError):
        gpuptr.alloc(1.5)
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.alloc(8, device=99)
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.context(-1)


def test_huge_alloc_is_out_of_memory(no_leaks):
    with pytest.raises(gpuptr.OutOfMemoryError) as ei:
        gpuptr.alloc(1 << 60)
    assert isinstance(ei.value, MemoryError)
    assert ei.value.code == 2
    assert ei.value.name == "CUDA_ERROR_OUT_OF_MEMORY"


def test_wrap_own_allocation_resolves_context_and_keeps_owner(no_leaks):
    mem = gpuptr.alloc(256)
    mem.copy_from_host(bytes(range(256)))

    class Owner:
        pass

    owner = Owner()
    r = weakref.ref(owner)
    w = gpuptr.wrap(mem.device_pointer_value + 16, 64, owner=owner)
    assert w.context is gpuptr.context(0)
    assert not w.is_managed
    assert w.owner is owner
    assert w.copy_to_host() == bytes(range(16, 80))
    v = w.view(8)
    assert v.owner is owner
    del owner, w
    gc.collect()
    assert r() is not None, "the view keeps the owner"
    del v
    gc.collect()
    assert r() is None


def test_wrap_past_the_allocation_is_refused(no_leaks):
    mem = gpuptr.alloc(256)
    with pytest.raises(gpuptr.InvalidPointerError):
        gpuptr.wrap(mem.device_pointer_value + 200, 1 << 20)


def test_wrap_of_host_memory_is_invalid_pointer():
    buf = ctypes.create_string_buffer(64)
    with pytest.raises(gpuptr.InvalidPointerError):
        gpuptr.wrap(ctypes.addressof(buf), 64)
    with pytest.raises(gpuptr.InvalidPointerError):
        gpuptr.wrap(0, 8)
    with pytest.raises(gpuptr.InvalidPointerError):
        gpuptr.wrap(-5, 8)


def test_numba_and_arrow_constructor_shape(no_leaks):
    mem = gpuptr.alloc(64)
    mem.copy_from_host(bytes(range(64)))
    ctx = gpuptr.context(0)
    # PyArrow's CudaBuffer.to_numba() call shape.
    p = gpuptr.MemoryPointer(ctx, pointer=ctypes.c_void_p(mem.device_pointer_value), size=64)
    assert p.copy_to_host() == bytes(range(64))
    assert p.context is ctx and not p.is_managed
    # numba's positional shape, with an int address and no context.
    q = gpuptr.MemoryPointer(None, mem.device_pointer_value + 32, 32)
    assert q.context.device.id == 0
    assert q.copy_to_host() == bytes(range(32, 64))


def test_finalizer_runs_once_when_the_last_holder_goes(no_leaks):
    mem = gpuptr.alloc(64)
    calls = []
    p = gpuptr.MemoryPointer(gpuptr.context(0), mem.device_pointer_value, 64, finalizer=lambda: calls.append(1))
    assert p.is_managed
    v = p.view(4)
    del p
    gc.collect()
    assert calls == []
    del v
    gc.collect()
    assert calls == [1]


def test_explicit_free_runs_the_finalizer_once(no_leaks):
    mem = gpuptr.alloc(64)
    calls = []
    p = gpuptr.MemoryPointer(gpuptr.context(0), mem.device_pointer_value, 64, finalizer=lambda: calls.append(1))
    p.free()
    p.free()
    del p
    gc.collect()
    assert calls == [1]


def test_context_memalloc_and_memory_info(no_leaks):
    ctx = gpuptr.context(0)
    free0, total = ctx.get_memory_info()
    assert 0 < free0 <= total
    mem = ctx.memalloc(1 << 20)
    assert mem.context is ctx
    info = ctx.get_memory_info()
    assert isinstance(info, gpuptr.MemoryInfo) and info.total == total
    ctx.synchronize()
    del mem


def test_stats_track_live_bytes():
    gc.collect()
    before = gpuptr.stats()[0]
    mem = gpuptr.alloc(1000)
    during = gpuptr.stats()[0]
    assert during["live_bytes"] == before["live_bytes"] + 1000
    assert during["live_count"] == before["live_count"] + 1
    assert during["alloc_count"] == before["alloc_count"] + 1
    assert during["peak_bytes"] >= during["live_bytes"]
    del mem
    gc.collect()
    assert gpuptr.stats()[0]["live_bytes"] == before["live_bytes"]


def test_exception_hierarchy():
    assert issubclass(gpuptr.OutOfMemoryError, gpuptr.CudaError)
    assert issubclass(gpuptr.OutOfMemoryError, MemoryError)
    assert issubclass(gpuptr.InvalidPointerError, ValueError)
    assert issubclass(gpuptr.NoDriverError, gpuptr.GpuptrError)
    for cls in (gpuptr.CudaError, gpuptr.InvalidPointerError, gpuptr.InvalidArgumentError):
        assert issubclass(cls, gpuptr.GpuptrError)


def test_devices_and_driver_info():
    info = gpuptr.driver_info()
    assert info["driver"] in ("cuda", "sim")
    assert info["version"] >= 12000
    devs = gpuptr.devices()
    assert len(devs) == info["device_count"] >= 1
    assert devs[0].id == 0 and devs[0].total_memory > 0 and devs[0].name


@pytest.mark.parametrize("direction", ["to_host", "to_host_new", "from_host"])
def test_other_threads_run_during_a_host_copy(direction, no_leaks):
    """Copies between host and device let go of the GIL, as numba's do. With
    forced GIL switches off, a thread that sleeps between steps can only take
    a step while the copy has let go."""
    import sys
    import threading
    import time

    import numpy as np

    n = 64 << 20
    mem = gpuptr.alloc(n)
    host = np.ones(n, dtype=np.uint8)
    copy = {
        "to_host": lambda: mem.copy_to_host(host),
        "to_host_new": lambda: mem.copy_to_host(),
        "from_host": lambda: mem.copy_from_host(host),
    }[direction]
    steps = 0
    stop = False

    def stepper():
        nonlocal steps
        while not stop:
            steps += 1
            time.sleep(0)  # lets go of the GIL; taking it back needs the main thread to let go

    interval = sys.getswitchinterval()
    t = threading.Thread(target=stepper)
    t.start()
    sys.setswitchinterval(1000)  # no forced switches: the main thread keeps the GIL unless it lets go
    try:
        during = 0
        for _ in range(5):
            before = steps
            copy()
            during += steps - before
    finally:
        sys.setswitchinterval(interval)
        stop = True
        t.join()
        mem.free()
    assert during > 0


def test_reprs_name_the_class_address_size_and_state(no_leaks):
    mem = gpuptr.alloc(1000)
    r = repr(mem)
    assert r.startswith("<gpuptr.MemoryPointer ") and f"{mem.device_pointer_value:#x}" in r and "size=1000" in r
    assert repr(mem.view(10, 20)).endswith("size=10 device=0>")
    mapped = gpuptr.alloc_host(64, mapped=True)
    managed = gpuptr.alloc_managed(64)
    assert repr(mapped).startswith("<gpuptr.MappedMemory ")
    assert repr(managed).startswith("<gpuptr.ManagedMemory ")
    assert repr(gpuptr.alloc_host(64)).startswith("<gpuptr.PinnedMemory ")
    assert repr(mem.context) == f"<gpuptr.Context device=0 handle={int(mem.context.handle):#x}>"
    mem.free()
    assert repr(mem).endswith(" freed>")
    mapped.free()
    managed.free()
