"""Foreign arrays at launch: the conversion cache behind
``gpuptr.numba.foreign_args``. These run on the simulator with stand-ins
for CuPy arrays (a data pointer, shape, strides, dtype and the CUDA Array
Interface, over gpuptr memory); launching real kernels is in the GPU tests."""

from __future__ import annotations

import gc
import threading
import types

import pytest

pytest.importorskip("numba.cuda")

import numpy as np  # noqa: E402

import gpuptr  # noqa: E402
import gpuptr._launch  # noqa: E402
import gpuptr.numba  # noqa: E402
from gpuptr.numba import ArgCache, Launcher  # noqa: E402


class CupyLike:
    """What the cache reads of a CuPy array, and how often its interface is read."""

    def __init__(self, mem, shape, dtype="<f4"):
        self.mem = mem
        self.data = types.SimpleNamespace(ptr=mem.device_pointer_value, device_id=0)
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self.strides = tuple(int(x) for x in np.empty(shape, self.dtype).strides)
        self.reads = 0

    @property
    def __cuda_array_interface__(self):
        self.reads += 1
        return {
            "version": 3,
            "shape": self.shape,
            "strides": self.strides,
            "typestr": self.dtype.str,
            "data": (self.data.ptr, False),
            "stream": None,
        }


@pytest.fixture
def mem():
    return gpuptr.alloc(1 << 16)


def test_the_same_array_is_converted_once_and_the_numba_array_reused(mem):
    cache = ArgCache()
    a = CupyLike(mem, (64, 64))
    first = cache.convert(a)
    again = cache.convert(a)
    assert again is first and a.reads == 1 and (cache.hits, cache.misses) == (1, 1)
    assert first.shape == (64, 64) and first.device_ctypes_pointer.value == mem.device_pointer_value
    assert first.gpu_data.owner is not a, "the cache does not own the exporter"


def test_a_changed_pointer_shape_or_type_is_converted_again(mem):
    cache = ArgCache()
    a = CupyLike(mem, (64, 64))
    first = cache.convert(a)
    a.shape, a.strides = (32, 128), (512, 4)
    reshaped = cache.convert(a)
    assert reshaped is not first and reshaped.shape == (32, 128)
    a.data.ptr += 256
    moved = cache.convert(a)
    assert moved.device_ctypes_pointer.value == mem.device_pointer_value + 256
    a.dtype = np.dtype("<i4")
    assert cache.convert(a).dtype == np.int32
    assert cache.misses == 4


def test_the_cache_never_keeps_an_array_alive_and_ids_are_not_trusted(mem):
    cache = ArgCache()
    a = CupyLike(mem, (16,))
    cache.convert(a)
    assert len(cache) == 1
    del a
    gc.collect()
    assert len(cache) == 0, "the entry went with the array"
    # A new object, perhaps at the same id: converted on its own.
    b = CupyLike(mem, (8,))
    assert cache.convert(b).shape == (8,)


def test_arguments_pass_through_or_convert_as_a_launch_would(mem):
    seen = {}

    class Kernel:
        def __getitem__(self, config):
            seen["config"] = config
            return lambda *args: seen.setdefault("args", args)

    native = gpuptr.numba.as_cuda_array(CupyLike(mem, (4,)))  # a numba DeviceNDArray
    host = np.zeros(3)
    a = CupyLike(mem, (64,))
    Launcher(Kernel())[(2, 32)](a, native, 2.5, host)
    converted, passed_native, scalar, passed_host = seen["args"]
    assert seen["config"] == (2, 32)
    assert converted.shape == (64,) and passed_native is native and scalar == 2.5 and passed_host is host


def test_threads_converting_at_once_get_right_arrays(mem):
    cache = ArgCache()
    arrays = [CupyLike(mem, (n + 1,)) for n in range(16)]
    errors = []

    def work(i):
        try:
            for _ in range(500):
                a = arrays[(i * 7) % 16]
                assert cache.convert(a).shape == a.shape
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and cache.hits + cache.misses == 8 * 500


def test_a_launch_asks_each_librarys_stream_once_and_waits_once_per_stream(mem, monkeypatch):
    # The CUDA Array Interface's stream rule at launch: the exporter's
    # current stream is waited for (as numba does), once per library and
    # device however many arguments come from it, not once per argument.
    asked, waited = [], []
    monkeypatch.setattr(gpuptr._launch._CUPY, "stream", lambda device: asked.append(device) or 0x7000)

    class Ctx:
        def stream_synchronize(self, s):
            waited.append(s)

    monkeypatch.setattr(gpuptr._launch._core, "context", lambda device: Ctx())

    class Kernel:
        def __getitem__(self, config):
            return lambda *args: args

    arrays = [CupyLike(mem, (n + 1,)) for n in range(8)]
    cache = ArgCache()
    launch = Launcher(Kernel(), cache=cache)[1, 32]
    launch(*arrays)  # converting: numba's own sync=True conversion path
    asked.clear(), waited.clear()
    got = launch(*arrays)  # every argument a cache hit
    assert [a.shape for a in got] == [a.shape for a in arrays]
    assert (asked, waited) == ([0], [0x7000])
    asked.clear(), waited.clear()
    Launcher(Kernel(), sync=False, cache=cache)[1, 32](*arrays)  # hits again
    assert (asked, waited) == ([], []), "sync=False: no wait"
    assert cache.misses == 8 and cache.hits == 16
