"""CUDA Array Interface and DLPack import: parsing, extents and typed errors.
These run on either driver (addresses come from gpuptr allocations)."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import weakref

import pytest

import gpuptr
from helpers import DLDataType, DLDevice, DLManagedTensor


def desc(address, shape, typestr="<i4", strides=None, **extra):
    d = {"version": 3, "shape": shape, "typestr": typestr, "data": (address, False), "strides": strides}
    d.update(extra)
    return d


@pytest.fixture
def mem():
    m = gpuptr.alloc(4096)
    m.copy_from_host(bytes(range(256)) * 16)
    yield m


def test_c_contiguous_2d(mem):
    v = gpuptr.from_cuda_array_interface(desc(mem.device_pointer_value, (4, 8)))
    assert v.shape == (4, 8) and v.strides == (32, 4) and v.itemsize == 4
    assert v.ptr == mem.device_pointer_value and v.pointer.size == 128
    assert v.offset == 0 and not v.readonly and v.nbytes == 128
    assert v.context is gpuptr.context(0)
    assert v.pointer.copy_to_host() == bytes(range(128))


def test_explicit_and_fortran_strides(mem):
    v = gpuptr.from_cuda_array_interface(desc(mem.device_pointer_value, (4, 8), strides=(4, 16)))
    assert v.pointer.size == (3 * 4 + 7 * 16) + 4
    sparse = gpuptr.from_cuda_array_interface(desc(mem.device_pointer_value + 8, (3,), typestr="|u1", strides=(100,)))
    assert sparse.pointer.size == 201


def test_negative_strides_start_the_pointer_at_element_zero(mem):
    base = mem.device_pointer_value
    v = gpuptr.from_cuda_array_interface(desc(base + 36, (10,), strides=(-4,)))
    assert v.ptr == base + 36 and v.offset == 36
    assert v.pointer.size == 4, "from element 0 to the end of the span"


def test_negative_strides_beyond_the_buffer_are_invalid_pointer(mem):
    with pytest.raises(gpuptr.InvalidPointerError):
        gpuptr.from_cuda_array_interface(desc(mem.device_pointer_value, (10,), strides=(-4,)))


def test_extent_past_the_allocation_is_invalid_pointer(mem):
    with pytest.raises(gpuptr.InvalidPointerError):
        gpuptr.from_cuda_array_interface(desc(mem.device_pointer_value + 4000, (100,)))


def test_readonly_and_round_trip_through_the_view(mem):
    d = desc(mem.device_pointer_value + 64, (16,))
    d["data"] = (mem.device_pointer_value + 64, True)
    v = gpuptr.from_cuda_array_interface(d)
    assert v.readonly
    again = gpuptr.from_cuda_array_interface(v)
    assert again.ptr == v.ptr and again.shape == (16,) and again.readonly
    assert again.owner is v


def test_exporter_is_kept_alive_by_the_pointer(mem):
    class Exporter:
        def __init__(self, d):
            self.__cuda_array_interface__ = d

    e = Exporter(desc(mem.device_pointer_value, (8,)))
    r = weakref.ref(e)
    v = gpuptr.from_cuda_array_interface(e)
    p = v.pointer
    del e, v
    gc.collect()
    assert r() is not None
    del p
    gc.collect()
    assert r() is None


def test_empty_array_needs_no_memory():
    v = gpuptr.from_cuda_array_interface(desc(0, (0, 5)))
    assert v.size == 0 and v.ptr == 0 and v.pointer.size == 0


def test_stream_is_synchronized_when_named(mem):
    v = gpuptr.from_cuda_array_interface(desc(mem.device_pointer_value, (4,), stream=1))
    assert v.stream == 1
    v2 = gpuptr.from_cuda_array_interface(desc(mem.device_pointer_value, (4,), stream=2), sync=False)
    assert v2.stream == 2


@pytest.mark.sim
def test_stream_sync_reaches_the_driver(mem):
    from gpuptr import _testing

    before = _testing.sim_calls("synchronize")
    gpuptr.from_cuda_array_interface(desc(mem.device_pointer_value, (4,), stream=1))
    assert _testing.sim_calls("synchronize") == before + 1
    gpuptr.from_cuda_array_interface(desc(mem.device_pointer_value, (4,), stream=1), sync=False)
    gpuptr.from_cuda_array_interface(desc(mem.device_pointer_value, (4,)))
    assert _testing.sim_calls("synchronize") == before + 1


@pytest.mark.parametrize(
    "mutate, error",
    [
        (lambda d: d.pop("data"), gpuptr.InvalidArgumentError),
        (lambda d: d.pop("shape"), gpuptr.InvalidArgumentError),
        (lambda d: d.pop("typestr"), gpuptr.InvalidArgumentError),
        (lambda d: d.update(typestr="float32"), gpuptr.InvalidArgumentError),
        (lambda d: d.update(typestr="<x4"), gpuptr.InvalidArgumentError),
        (lambda d: d.update(typestr="<f0"), gpuptr.InvalidArgumentError),
        (lambda d: d.update(typestr=4), gpuptr.InvalidArgumentError),
        (lambda d: d.update(mask=(1, 2)), gpuptr.InvalidArgumentError),
        (lambda d: d.update(stream=0), gpuptr.InvalidArgumentError),
        (lambda d: d.update(stream="s"), gpuptr.InvalidArgumentError),
        (lambda d: d.update(version=4), gpuptr.InvalidArgumentError),
        (lambda d: d.update(shape=(-1,)), gpuptr.InvalidArgumentError),
        (lambda d: d.update(shape=(2.5,)), gpuptr.InvalidArgumentError),
        (lambda d: d.update(shape=7), gpuptr.InvalidArgumentError),
        (lambda d: d.update(strides=(4, 4)), gpuptr.InvalidArgumentError),
        (lambda d: d.update(data=(None, False)), gpuptr.InvalidPointerError),
        (lambda d: d.update(data=(-8, False)), gpuptr.InvalidPointerError),
        (lambda d: d.update(data=5), gpuptr.InvalidArgumentError),
        (lambda d: d.update(data=(0, False)), gpuptr.InvalidPointerError),
    ],
)
def test_bad_descriptors_get_typed_errors(mem, mutate, error):
    d = desc(mem.device_pointer_value, (8,))
    mutate(d)
    with pytest.raises(error):
        gpuptr.from_cuda_array_interface(d)


def test_host_address_is_invalid_pointer():
    buf = ctypes.create_string_buffer(64)
    with pytest.raises(gpuptr.InvalidPointerError):
        gpuptr.from_cuda_array_interface(desc(ctypes.addressof(buf), (16,)))


def test_object_without_the_interface_is_invalid_argument():
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.from_cuda_array_interface(object())


@pytest.mark.multigpu
def test_device_1_array_resolves_to_device_1_while_device_0_is_current():
    mem1 = gpuptr.alloc(1024, device=1)
    gpuptr.context(0).push()
    v = gpuptr.from_cuda_array_interface(desc(mem1.device_pointer_value, (16,)))
    assert v.context is gpuptr.context(1)


# --- DLPack -----------------------------------------------------------------


class FakeCudaTensor:
    """A DLPack exporter of device memory, built with ctypes (no GPU library
    needed), so the capsule reader is tested on the simulator too."""

    def __init__(self, address, shape, strides=None, code=2, bits=32, byte_offset=0, device_type=2, name=b"dltensor"):
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = (ctypes.c_int64 * len(shape))(*strides) if strides else None
        t = DLManagedTensor()
        t.dl_tensor.data = address
        t.dl_tensor.device = DLDevice(device_type, 0)
        t.dl_tensor.ndim = len(shape)
        t.dl_tensor.dtype = DLDataType(code, bits, 1)
        t.dl_tensor.shape = self._shape
        t.dl_tensor.strides = self._strides
        t.dl_tensor.byte_offset = byte_offset
        self._tensor = t
        self._name = name
        self._device_type = device_type

    def __dlpack_device__(self):
        return (self._device_type, 0)

    def __dlpack__(self, stream=None):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._tensor), self._name, None)


def test_dlpack_capsule_is_read(mem):
    t = FakeCudaTensor(mem.device_pointer_value, (4, 2), strides=(2, 1), code=2, bits=32, byte_offset=64)
    v = gpuptr.from_dlpack(t)
    assert v.ptr == mem.device_pointer_value + 64
    assert v.shape == (4, 2) and v.strides == (8, 4) and v.typestr == "<f4"
    assert v.context is gpuptr.context(0)
    assert v.pointer.copy_to_host() == bytes(range(64, 96))


def test_dlpack_without_strides_is_c_contiguous(mem):
    t = FakeCudaTensor(mem.device_pointer_value, (3, 5), code=1, bits=8)
    v = gpuptr.from_dlpack(t)
    assert v.strides == (5, 1) and v.typestr == "|u1"
    del v


@pytest.mark.parametrize(
    "code, bits, name, typestr",
    [(4, 16, "bfloat16", "<V2"), (10, 8, "float8_e4m3fn", "|V1"), (12, 8, "float8_e5m2", "|V1"), (6, 8, "bool", "|b1")],
)
def test_dlpack_bfloat16_and_float8_are_read_with_their_names(mem, code, bits, name, typestr):
    t = FakeCudaTensor(mem.device_pointer_value, (4,), code=code, bits=bits)
    v = gpuptr.from_dlpack(t)
    assert (v.dtype_name, v.typestr, v.itemsize) == (name, typestr, bits // 8)
    assert v.dtype.itemsize == bits // 8
    del v  # before the producer's tensor, which the capsule points into


def test_dlpack_of_a_host_array_is_refused():
    np = pytest.importorskip("numpy")
    with pytest.raises(gpuptr.InvalidArgumentError, match="CPU"):
        gpuptr.from_dlpack(np.zeros(4))


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"code": 4, "bits": 32}, gpuptr.InvalidArgumentError),  # no 32-bit bfloat
        ({"code": 17, "bits": 4}, gpuptr.InvalidArgumentError),  # fp4: sub-byte
        ({"code": 3, "bits": 64}, gpuptr.InvalidArgumentError),  # opaque handle
        ({"bits": 12}, gpuptr.InvalidArgumentError),
        ({"name": b"used_dltensor"}, gpuptr.InvalidArgumentError),
        ({"device_type": 3}, gpuptr.InvalidArgumentError),  # pinned host
    ],
)
def test_bad_dlpack_tensors_get_typed_errors(mem, kwargs, error):
    with pytest.raises(error):
        gpuptr.from_dlpack(FakeCudaTensor(mem.device_pointer_value, (4,), **kwargs))


def test_dlpack_of_host_memory_address_is_invalid_pointer():
    buf = ctypes.create_string_buffer(64)
    with pytest.raises(gpuptr.InvalidPointerError):
        gpuptr.from_dlpack(FakeCudaTensor(ctypes.addressof(buf), (16,)))


# From an attacker's pass ------------------------------------------------------


def test_a_dimension_past_2_63_is_refused_not_wrapped(mem):
    for shape in (2**64 - 1, 2**63, (2**40, 2**40)):
        with pytest.raises(gpuptr.InvalidArgumentError, match="overflows"):
            gpuptr.as_array(mem, shape, "uint8")


def test_an_exporters_own_attribute_error_is_not_read_as_no_interface():
    # A bug inside the exporter's property read as "does not export".
    class Broken:
        @property
        def __cuda_array_interface__(self):
            return self.missing

    with pytest.raises(AttributeError, match="missing"):
        gpuptr.from_cuda_array_interface(Broken())
    with pytest.raises(gpuptr.InvalidArgumentError, match="does not export"):
        gpuptr.from_cuda_array_interface(object())


def test_the_shape_is_the_one_checked_not_the_exporters_objects(mem):
    # A dimension whose __index__ answers 1 when checked and 2**20 later:
    # the view kept the exporter's object, and re-exported a shape of a
    # million floats over 4 bytes.
    class Dim:
        reads = 0

        def __index__(self):
            Dim.reads += 1
            return 1 if Dim.reads == 1 else 1 << 20

    v = gpuptr.from_cuda_array_interface(desc(mem.device_pointer_value, (Dim(),), "<f4"))
    assert v.pointer.size == 4
    assert v.shape == (1,) and type(v.shape[0]) is int
    assert v.__cuda_array_interface__["shape"] == (1,)
    assert v.size == 1 and v.nbytes == 4


def test_a_freed_pointer_hands_no_address_to_a_consumer():
    p = gpuptr.alloc(64)
    v = gpuptr.as_array(p, 64, "uint8")
    part = p.view(8, 16)
    p.free()
    gpuptr.flush_pool()
    q = gpuptr.alloc(64)            # may take the freed block back
    q.memset(1)
    for exporter in (p, part, v):
        with pytest.raises(gpuptr.InvalidPointerError):
            exporter.__cuda_array_interface__
        with pytest.raises(gpuptr.InvalidPointerError):
            gpuptr.from_cuda_array_interface(exporter)
    with pytest.raises(gpuptr.InvalidPointerError):
        p.record_stream(12345)      # a use declared after the free
    assert set(q.copy_to_host()) == {1}
    q.free()


def test_an_element_type_with_a_lone_surrogate_is_a_typed_error(mem):
    # A str no UTF-8 can hold raised UnicodeEncodeError, no gpuptr error.
    with pytest.raises(gpuptr.InvalidArgumentError, match="typestr"):
        gpuptr.from_cuda_array_interface(desc(mem.device_pointer_value, (4,), "<f\ud8004"))
    with pytest.raises(gpuptr.InvalidArgumentError, match="not supported"):
        gpuptr._core._dtype_info("float\ud800")
    if importlib.util.find_spec("numpy"):  # names outside gpuptr's table go to numpy
        with pytest.raises(gpuptr.InvalidArgumentError, match="not an element type"):
            gpuptr.as_array(mem, 4, "float\ud800")
    v = gpuptr.as_array(mem, 4, "uint8")
    v.dtype_name = "\ud800"
    with pytest.raises(BufferError, match="no DLPack code"):
        v.__dlpack__()


def test_a_crafted_capsule_not_on_a_cuda_device_is_refused(mem):
    for device_type in (1, 4):       # CPU, OpenCL
        t = FakeCudaTensor(mem.device_pointer_value, (4,), device_type=device_type)
        with pytest.raises(gpuptr.InvalidArgumentError, match="not CUDA memory"):
            gpuptr._core._import_dlpack(t.__dlpack__())


@pytest.mark.parametrize("kw", [
    {"max_version": (-1, 0)}, {"max_version": "1.0"}, {"dl_device": (2, 2**40)}, {"dl_device": 2}, {"stream": True},
], ids=repr)
def test_dlpack_arguments_out_of_their_range_are_typed(mem, kw):
    with pytest.raises(gpuptr.InvalidArgumentError):
        mem.__dlpack__(**kw)


def test_what_a_stream_objects_own_code_raises_goes_on():
    class Destroyed:
        def __cuda_stream__(self):
            raise RuntimeError("stream was destroyed")

    class Interrupted:
        @property
        def cuda_stream(self):
            raise KeyboardInterrupt

    with pytest.raises(RuntimeError, match="stream was destroyed"):
        gpuptr.alloc(64, stream=Destroyed())
    with pytest.raises(KeyboardInterrupt):
        gpuptr.alloc(64, stream=Interrupted())
    with pytest.raises(gpuptr.InvalidArgumentError, match="stream must be"):
        gpuptr.alloc(64, stream=object())   # no stream attribute at all: not a stream


@pytest.mark.parametrize("versioned", [False, True])
def test_a_capsule_exported_before_a_reset_does_not_import_after_it(versioned):
    p = gpuptr.alloc(1024)
    cap = p.__dlpack__(max_version=(1, 0)) if versioned else p.__dlpack__()
    gpuptr._core.reset_context(0)
    with pytest.raises(gpuptr.InvalidPointerError, match="reset"):
        gpuptr._core._import_dlpack(cap)
    del cap
    fresh = gpuptr.alloc(1024)      # the new context's memory imports as before
    assert gpuptr._core._import_dlpack(fresh.__dlpack__()).pointer.device_pointer_value == fresh.device_pointer_value
    fresh.free()


def test_an_empty_view_past_the_end_exports_through_dlpack_too():
    m = gpuptr.alloc(64)
    v = m.view(100, 100)                # numba's slicing asks for these
    assert v.__cuda_array_interface__["shape"] == (0,)
    assert gpuptr._core._import_dlpack(v.__dlpack__()).pointer.size == 0
    m.free()
