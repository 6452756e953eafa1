"""The export side: gpuptr memory through the CUDA Array Interface and
DLPack (both ABIs), typed views with ``as_array``, and what an export keeps
alive. These run on either driver; the consumer is gpuptr's own importer
(numpy takes host tensors only), and the raw capsule is read with ctypes."""

from __future__ import annotations

import ctypes
import gc
import threading
import time

import pytest

import gpuptr
from gpuptr import _testing
from helpers import DLManagedTensor, DLManagedTensorVersioned

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_set_name = ctypes.pythonapi.PyCapsule_SetName
_set_name.restype = ctypes.c_int
_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]


def tensor_of(capsule, name=b"dltensor"):
    kind = DLManagedTensor if name == b"dltensor" else DLManagedTensorVersioned
    return kind.from_address(_get_pointer(capsule, name))


def live():
    gc.collect()
    return gpuptr.stats()[0]["live_bytes"]


class Producer:
    """An object exporting a capsule it was given (as torch would)."""

    def __init__(self, capsule, device=(2, 0)):
        self.capsule, self.device = capsule, device

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None):
        return self.capsule


def test_memory_pointer_exports_the_cuda_array_interface_as_bytes():
    m = gpuptr.alloc(300)
    cai = m.__cuda_array_interface__
    assert cai == {
        "version": 3,
        "shape": (300,),
        "typestr": "|u1",
        "data": (m.device_pointer_value, False),
        "strides": None,
        "stream": None,
    }
    v = gpuptr.from_cuda_array_interface(m)
    assert (v.ptr, v.nbytes, v.owner) == (m.device_pointer_value, 300, m)
    empty = gpuptr.alloc(0).__cuda_array_interface__
    assert empty["shape"] == (0,) and empty["data"] == (0, False)


def test_stream_ordered_memory_names_its_stream_in_both_protocols():
    m = gpuptr.alloc(256, stream=0x7000)
    assert m.stream == 0x7000
    assert m.__cuda_array_interface__["stream"] == 0x7000
    assert gpuptr.alloc(256, stream=1).stream == 1, "the legacy stream is 1, never 0"
    m.record_stream(0x8000)
    assert m.stream is None and m.__cuda_array_interface__["stream"] is None
    assert gpuptr.alloc(256).stream is None


@pytest.mark.sim
def test_dlpack_export_makes_the_memory_ready_on_the_consumers_stream():
    m = gpuptr.alloc(256, stream=0x7000)
    # A kernel on the producer's stream still writes the memory.
    _testing.sim_queue_write(0x7000, m.device_pointer_value, b"\x01" * 16)
    safety = threading.Timer(5, _testing.sim_complete)  # a wrong wait ends
    safety.start()
    try:
        t0 = time.monotonic()
        m.__dlpack__(stream=0x7000)  # the producer's own stream: ordered
        m.__dlpack__(stream=-1)  # the consumer asked for no synchronization
        assert time.monotonic() - t0 < 2, "neither waits for the kernel"
        threading.Timer(0.3, _testing.sim_complete).start()
        t0 = time.monotonic()
        m.__dlpack__(stream=0x8000)  # another stream waits for the producer's
        assert time.monotonic() - t0 >= 0.25
        assert m.copy_to_host()[:16] == b"\x01" * 16
        _testing.sim_queue_write(0x7000, m.device_pointer_value, b"\x02" * 16)
        threading.Timer(0.3, _testing.sim_complete).start()
        t0 = time.monotonic()
        m.__dlpack__()  # None: the legacy default stream, not the producer's
        assert time.monotonic() - t0 >= 0.25
    finally:
        safety.cancel()
        _testing.sim_complete()
    with pytest.raises(gpuptr.InvalidArgumentError, match="stream"):
        m.__dlpack__(stream=0)


def test_legacy_capsule_describes_the_bytes_and_round_trips():
    m = gpuptr.alloc(4096)
    m.copy_from_host(bytes(range(256)) * 16)
    cap = m.__dlpack__()
    t = tensor_of(cap).dl_tensor
    assert (t.data, t.device.device_type, t.device.device_id, t.ndim) == (m.device_pointer_value, 2, 0, 1)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes, t.shape[0], t.strides[0], t.byte_offset) == (1, 8, 1, 4096, 1, 0)
    v = gpuptr.from_dlpack(Producer(cap))
    assert (v.shape, v.dtype_name, v.readonly) == ((4096,), "uint8", False)
    assert v.pointer.copy_to_host()[:256] == bytes(range(256))
    with pytest.raises(gpuptr.InvalidArgumentError, match="consumed"):
        gpuptr.from_dlpack(Producer(cap))


def test_versioned_capsule_only_for_consumers_that_ask():
    m = gpuptr.alloc(64)
    assert b"dltensor\"" in repr(m.__dlpack__()).encode()
    assert b"dltensor\"" in repr(m.__dlpack__(max_version=(0, 8))).encode()
    cap = m.__dlpack__(max_version=(1, 3))
    vt = tensor_of(cap, b"dltensor_versioned")
    assert (vt.major, vt.minor, vt.flags) == (1, 1, 0)
    assert vt.dl_tensor.data == m.device_pointer_value
    v = gpuptr.from_dlpack(Producer(cap))
    assert v.ptr == m.device_pointer_value and not v.readonly


def test_read_only_memory_exports_only_versioned_with_the_flag():
    m = gpuptr.alloc(64)
    ro = gpuptr.from_cuda_array_interface(
        {"version": 3, "shape": (16,), "typestr": "<f4", "data": (m.device_pointer_value, True)}
    )
    with pytest.raises(BufferError, match="read-only"):
        ro.__dlpack__()
    cap = ro.__dlpack__(max_version=(1, 0))
    assert tensor_of(cap, b"dltensor_versioned").flags & 1
    back = gpuptr.from_dlpack(Producer(cap))
    assert back.readonly and back.dtype_name == "float32"


def test_a_newer_major_version_is_refused_and_left_unconsumed():
    m = gpuptr.alloc(64)
    cap = m.__dlpack__(max_version=(1, 0))
    tensor_of(cap, b"dltensor_versioned").major = 2
    with pytest.raises(gpuptr.InvalidArgumentError, match="2.1"):
        gpuptr.from_dlpack(Producer(cap))
    tensor_of(cap, b"dltensor_versioned").major = 1
    assert gpuptr.from_dlpack(Producer(cap)).ptr == m.device_pointer_value


def test_export_refuses_copies_and_other_devices():
    m = gpuptr.alloc(64)
    with pytest.raises(BufferError, match="without copying"):
        m.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="device"):
        m.__dlpack__(dl_device=(1, 0))
    with pytest.raises(BufferError, match="device"):
        m.__dlpack__(dl_device=(2, 5))
    m.__dlpack__(dl_device=(2, 0), copy=False)
    assert m.__dlpack_device__() == (2, 0)


def test_an_unconsumed_capsule_lets_go_when_dropped():
    base = live()
    m = gpuptr.alloc(1 << 16)
    cap = m.__dlpack__()
    m.free()
    assert m.freed
    assert live() == base + (1 << 16), "the capsule still holds the memory"
    del cap
    assert live() == base


def test_a_consumer_keeps_freed_memory_until_it_lets_go():
    base = live()
    m = gpuptr.alloc(1 << 16)
    m.copy_from_host(b"\x5a" * (1 << 16))
    v = gpuptr.from_dlpack(m)
    m.free()
    del m
    # The consumer reads what was written: the block was not reused.
    other = gpuptr.alloc(1 << 16)
    other.memset(0)
    assert v.pointer.copy_to_host() == b"\x5a" * (1 << 16)
    assert live() == base + (2 << 16)
    del v
    assert live() == base + (1 << 16)
    del other


def test_the_deleter_runs_on_a_thread_without_the_gil():
    base = live()
    m = gpuptr.alloc(4096)
    cap = m.__dlpack__()
    t = tensor_of(cap)
    deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(t.deleter)
    address = ctypes.addressof(t)
    # Consumed, as a consumer would: renamed, so the capsule no longer frees it.
    assert _set_name(cap, b"used_dltensor") == 0
    del m
    th = threading.Thread(target=deleter, args=(address,))  # ctypes drops the GIL
    th.start()
    th.join()
    del cap
    assert live() == base


@pytest.mark.parametrize(
    "dtype,typestr,code,bits",
    [
        ("float32", "<f4", 2, 32),
        ("<i8", "<i8", 0, 64),
        (bool, "|b1", 6, 8),
        ("complex64", "<c8", 5, 64),
        ("bfloat16", "<V2", 4, 16),
        ("float8_e4m3fn", "|V1", 10, 8),
        ("float8_e5m2", "|V1", 12, 8),
    ],
)
def test_as_array_types_travel_through_dlpack(dtype, typestr, code, bits):
    m = gpuptr.alloc(1024)
    a = gpuptr.as_array(m, (4, 8), dtype)
    assert a.typestr == typestr and a.shape == (4, 8)
    assert a.__cuda_array_interface__["typestr"] == typestr
    cap = a.__dlpack__()
    t = tensor_of(cap).dl_tensor
    assert (t.dtype.code, t.dtype.bits, t.ndim, t.shape[0], t.shape[1]) == (code, bits, 2, 4, 8)
    assert (t.strides[0], t.strides[1]) == (8, 1), "DLPack counts elements"
    back = gpuptr.from_dlpack(Producer(cap))
    assert back.typestr == typestr and back.strides == a.strides and back.ptr == m.device_pointer_value


def test_as_array_strides_and_negative_strides():
    m = gpuptr.alloc(1024)
    f = gpuptr.as_array(m, (4, 8), "float32", strides=(4, 16))
    assert f.pointer.size == 3 * 4 + 7 * 16 + 4 and f.offset == 0
    rev = gpuptr.as_array(m, 10, "int32", strides=(-4,))
    assert rev.offset == 36 and rev.ptr == m.device_pointer_value + 36
    assert rev.pointer.size == 4, "from element 0 to the end of the span"
    cap = rev.__dlpack__()
    t = tensor_of(cap).dl_tensor
    assert (t.data, t.strides[0]) == (m.device_pointer_value + 36, -1)
    back = gpuptr.from_dlpack(Producer(rev.__dlpack__()))
    assert (back.ptr, back.strides, back.offset) == (m.device_pointer_value + 36, (-4,), 36)


def test_as_array_refuses_what_does_not_fit_or_is_not_a_type():
    m = gpuptr.alloc(256)
    # An array past the end of its memory is out of its bounds, as a view is.
    with pytest.raises(gpuptr.InvalidPointerError, match="does not fit"):
        gpuptr.as_array(m, (9, 8), "float32")
    with pytest.raises(gpuptr.InvalidPointerError, match="does not fit"):
        gpuptr.as_array(m, 2, "float32", strides=(1 << 62,))
    with pytest.raises(gpuptr.InvalidArgumentError, match="element type"):
        gpuptr.as_array(m, 4, "not-a-type")
    with pytest.raises(gpuptr.InvalidArgumentError, match="big-endian"):
        gpuptr.as_array(m, 4, ">f4")
    with pytest.raises(gpuptr.InvalidArgumentError, match="shape"):
        gpuptr.as_array(m, (-1,), "float32")
    with pytest.raises(gpuptr.InvalidArgumentError, match="strides"):
        gpuptr.as_array(m, (4, 4), "float32", strides=(4,))
    with pytest.raises(TypeError, match="MemoryPointer"):
        gpuptr.as_array(bytearray(64), 4, "float32")
    odd = gpuptr.as_array(m, 4, "float32", strides=(6,))
    with pytest.raises(BufferError, match="whole elements"):
        odd.__dlpack__()
    assert gpuptr.as_array(m, (0, 5), "float64").pointer.size == 0


def test_as_array_over_freed_memory_cannot_export():
    m = gpuptr.alloc(256)
    a = gpuptr.as_array(m, 64, "float32")
    m.free()
    with pytest.raises(gpuptr.InvalidPointerError):
        a.__dlpack__()
