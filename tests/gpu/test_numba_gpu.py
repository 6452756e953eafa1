"""numba-cuda and the Arrow access pattern over gpuptr pointers, on a GPU."""

from __future__ import annotations

import ctypes
import gc

import pytest

import gpuptr

pytestmark = pytest.mark.gpu

if gpuptr.driver_info()["driver"] != "cuda":
    # numba.cuda cannot even be imported without the CUDA runtime.
    pytest.skip("needs the CUDA driver", allow_module_level=True)

np = pytest.importorskip("numpy")
cuda = pytest.importorskip("numba.cuda")


@pytest.fixture(scope="module")
def fill():
    @cuda.jit
    def fill(a, value):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = value + i

    return fill


def test_device_ndarray_over_a_gpuptr_pointer(fill):
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    mem = gpuptr.alloc(1024 * 4)
    arr = DeviceNDArray((1024,), (4,), np.dtype(np.int32), gpu_data=mem)
    arr.copy_to_device(np.arange(1024, dtype=np.int32))
    assert (arr.copy_to_host() == np.arange(1024)).all()
    sl = arr[100:200]
    assert sl.gpu_data.device_pointer_value == mem.device_pointer_value + 400
    assert (sl.copy_to_host() == np.arange(100, 200)).all()
    arr[5] = -1
    arr[10:20] = np.full(10, 7, dtype=np.int32)
    fill[4, 256](arr[512:], 1000)
    cuda.synchronize()
    host = arr.copy_to_host()
    assert host[5] == -1 and (host[10:20] == 7).all()
    assert (host[512:] == 1000 + np.arange(512)).all()
    assert mem.refct >= 1


def test_gpuptr_as_cuda_array_with_cupy_round_trip(fill):
    cupy = pytest.importorskip("cupy")
    from gpuptr.numba import as_cuda_array

    c = cupy.zeros(300, dtype=cupy.int64)
    arr = as_cuda_array(c)
    assert arr.gpu_data.context is gpuptr.context(0)
    assert arr.shape == (300,) and arr.dtype == np.int64
    fill[2, 256](arr, 5)
    cuda.synchronize()
    assert int(c[299]) == 304
    # and back: CuPy reads numba's export of the gpuptr-backed array
    back = cupy.asarray(arr)
    assert back.data.ptr == c.data.ptr and int(back[1]) == 6
    # slicing and setitem through numba
    arr[0:3] = np.array([9, 9, 9])
    assert c[:4].get().tolist() == [9, 9, 9, 8]


def test_gpuptr_as_cuda_array_matches_numba_on_a_strided_2d_array():
    cupy = pytest.importorskip("cupy")
    from gpuptr.numba import as_cuda_array

    c = cupy.arange(60, dtype=cupy.float32).reshape(6, 10)[::2, 1::3]
    ours, theirs = as_cuda_array(c), cuda.as_cuda_array(c)
    assert ours.shape == theirs.shape and ours.strides == theirs.strides
    assert ours.alloc_size == theirs.alloc_size
    assert ours.device_ctypes_pointer.value == theirs.device_ctypes_pointer.value
    assert (ours.copy_to_host() == theirs.copy_to_host()).all()


def test_gpuptr_as_cuda_array_with_torch(fill):
    torch = pytest.importorskip("torch")
    from gpuptr.numba import as_cuda_array

    t = torch.zeros(64, dtype=torch.int32, device="cuda")
    arr = as_cuda_array(t)
    fill[1, 64](arr, 1)
    cuda.synchronize()
    assert t.cpu().tolist() == list(range(1, 65))
    assert arr.gpu_data.owner is t


def test_numba_as_cuda_array_over_a_gpuptr_export():
    mem = gpuptr.alloc(64)
    mem.copy_from_host(np.arange(16, dtype=np.float32).tobytes())
    view = gpuptr.from_cuda_array_interface(
        {"version": 3, "shape": (16,), "typestr": "<f4", "data": (mem.device_pointer_value, False)}
    )
    arr = cuda.as_cuda_array(view)
    assert (arr.copy_to_host() == np.arange(16, dtype=np.float32)).all()


def test_from_dlpack_of_cupy_and_torch():
    cupy = pytest.importorskip("cupy")
    c = cupy.arange(12, dtype=cupy.float64).reshape(3, 4)
    v = gpuptr.from_dlpack(c)
    assert v.ptr == c.data.ptr and v.shape == (3, 4) and v.strides == (32, 8) and v.typestr == "<f8"
    assert np.frombuffer(v.pointer.copy_to_host(), dtype=np.float64).tolist() == list(range(12))
    torch = pytest.importorskip("torch")
    t = torch.arange(10, dtype=torch.int16, device="cuda")[2:]
    v = gpuptr.from_dlpack(t)
    assert v.ptr == t.data_ptr() and v.typestr == "<i2" and v.shape == (8,)


def test_arrow_access_pattern_on_every_kind_of_pointer():
    cupy = pytest.importorskip("cupy")
    c = cupy.ones(100, dtype=cupy.uint8)
    numba_ctx = cuda.current_context()
    from cuda.bindings import driver as cu

    cupy_ctx = int(cu.cuCtxGetCurrent()[1])
    pointers = [
        gpuptr.alloc(256),
        gpuptr.alloc(256).view(16, 48),
        gpuptr.wrap(c.data.ptr, c.nbytes, owner=c),
        gpuptr.from_cuda_array_interface(c).pointer,
        gpuptr.MemoryPointer(numba_ctx, ctypes.c_void_p(c.data.ptr), c.nbytes),
    ]
    for mem in pointers:
        ctx = mem.context
        assert ctx.device.id == 0
        assert ctx.handle.value == int(ctx.handle) == int(numba_ctx.handle) == cupy_ctx
        assert ctx.handle == numba_ctx.handle
        assert ctx == numba_ctx
        assert isinstance(mem.device_pointer_value, int) and mem.size > 0
    p = gpuptr.MemoryPointer(gpuptr.context(0), pointer=ctypes.c_void_p(c.data.ptr), size=100)
    assert p.copy_to_host() == b"\x01" * 100


def test_device_pointer_is_a_cuda_bindings_cudeviceptr():
    from cuda.bindings import driver as cu

    mem = gpuptr.alloc(64)
    assert isinstance(mem.device_pointer, cu.CUdeviceptr)
    assert int(mem.device_pointer) == mem.device_pointer_value == int(mem.handle)
    # numba's driver can use it directly
    cu.cuMemsetD8(mem.device_pointer, 3, 64)
    assert mem.copy_to_host() == b"\x03" * 64


def test_numba_memory_surface_expectations():
    mem = cuda.current_context().memalloc(64)  # numba's own, for reference
    ours = gpuptr.alloc(64)
    for attr in ("device_pointer_value", "device_ctypes_pointer", "size", "_cuda_memsize_", "refct",
                 "is_managed", "owner", "handle", "context", "__cuda_memory__"):
        assert hasattr(ours, attr) and hasattr(mem, attr), attr
    v = ours.view(8)
    assert ours.refct == 2
    del v
    gc.collect()
    assert ours.refct == 1
