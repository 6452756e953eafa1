"""The numba EMM plugin's hooks, driven directly with a stand-in for numba's
context so they run on the simulator in CI (numba-cuda and numba-cuda-mlir
import without a GPU). Each test runs once per numba: the plugin builds one
manager per numba on that numba's own classes. The same hooks under real
numba are in gpu/test_numba_plugin_gpu.py."""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys

import pytest

import gpuptr
from helpers import hide_modules

np = pytest.importorskip("numpy")
try:
    from gpuptr import numba as plugin
except Exception as e:  # no numba, or no CUDA runtime to import with
    pytest.skip(f"no numba importable: {e}", allow_module_level=True)

BACKENDS = ["numba-cuda", "numba-cuda-mlir"]


def _importable(name):
    try:
        plugin._backend(name)
        return True
    except ImportError:
        return False


@pytest.fixture(params=BACKENDS)
def backend(request):
    if not _importable(request.param):
        pytest.skip(f"{request.param} is not importable here")
    return plugin._backend(request.param)


class _Device:
    def __init__(self, id):
        self.id = id

    def get_device_identity(self):
        return {"pci_domain_id": 0, "pci_bus_id": 0, "pci_device_id": self.id}


class FakeNumbaContext:
    """What the plugin reads of numba's Context: ``device.id``."""

    def __init__(self, device=0):
        self.device = _Device(device)


@pytest.fixture
def mm(backend):
    m = backend.MemoryManager(context=FakeNumbaContext(0))
    m.initialize()
    return m


def test_plugin_module_shape(backend):
    assert plugin._numba_memory_manager is plugin.MemoryManager
    m = backend.MemoryManager(context=None)
    assert m.interface_version == 1
    assert isinstance(m, backend.driver.BaseCUDAMemoryManager)
    assert isinstance(m, backend.driver.GetIpcHandleMixin), "IPC handles are that numba's own"
    assert isinstance(m, plugin.MemoryManager), "one isinstance check under every numba"
    assert issubclass(backend.MemoryManager, plugin.MemoryManager)
    with pytest.raises(RuntimeError):
        backend.MemoryManager()  # numba requires the context keyword
    with pytest.raises(RuntimeError):
        plugin.MemoryManager()


def test_set_memory_manager_accepts_the_plugin_and_its_check_gets_that_numbas_manager(backend, monkeypatch):
    driver = backend.driver
    made = []
    real = backend.MemoryManager

    class Spy(real):
        def __init__(self, *a, **k):
            made.append(type(self))
            super().__init__(*a, **k)

    monkeypatch.setattr(backend, "MemoryManager", Spy)
    saved = driver._memory_manager
    try:
        driver.set_memory_manager(plugin.MemoryManager)  # makes one with context=None
        assert driver._memory_manager is plugin.MemoryManager
    finally:
        driver._memory_manager = saved
    assert made == [Spy], "the version check was answered by the calling numba's manager"


def test_each_numba_context_gets_a_manager_of_its_own_numba(backend):
    # numba makes the manager as MemoryManager(context=ctx): which numba's
    # classes it is built on follows the context's module, not import order.
    module = {"numba-cuda": "numba.cuda.cudadrv.driver", "numba-cuda-mlir": "numba_cuda_mlir.numba_cuda.cudadrv.driver"}
    ctx_type = type("Context", (FakeNumbaContext,), {"__module__": module[backend.name]})
    m = plugin.MemoryManager(context=ctx_type(0))
    assert type(m) is backend.MemoryManager
    assert plugin.backend_of(ctx_type(0)) == backend.name
    m.initialize()
    assert m.memalloc(64).size == 64


def test_initialize_accepts_a_bare_cudevice_for_attached_contexts(backend):
    class Attached:
        device = 0  # numba's third-party contexts carry a CUdevice (int())

    m = backend.MemoryManager(context=Attached())
    m.initialize()
    assert m._device == 0


def test_initialize_is_idempotent_and_cheap(mm):
    for _ in range(3):
        mm.initialize()
    assert mm._device == 0


def test_memalloc_gives_pooled_gpuptr_memory(mm, no_leaks):
    mem = mm.memalloc(1 << 20)
    assert isinstance(mem, gpuptr.MemoryPointer) and mem.size == 1 << 20
    assert mem.context is gpuptr.context(0) and mem.__cuda_memory__
    mem.memset(1)
    del mem
    gc.collect()
    assert gpuptr.stats()[0]["cached_bytes"] >= 1 << 20


def test_memalloc_on_device_1_comes_from_device_1(backend):
    if gpuptr.driver_info()["device_count"] < 2:
        pytest.skip("needs two devices")
    m1 = backend.MemoryManager(context=FakeNumbaContext(1))
    m1.initialize()
    mem = m1.memalloc(4096)
    assert mem.context.device.id == 1
    assert gpuptr.stats()[1]["live_bytes"] >= 4096


def test_memhostalloc_pinned_and_mapped(mm):
    pinned = mm.memhostalloc(256)
    assert isinstance(pinned, gpuptr.PinnedMemory)
    arr = np.ndarray(64, dtype=np.float32, buffer=pinned)  # as numba's pinned_array
    arr[:] = 3
    mapped = mm.memhostalloc(256, mapped=True)
    assert isinstance(mapped, gpuptr.MappedMemory)
    marr = np.ndarray(256, dtype=np.uint8, buffer=mapped)  # as numba's mapped_array
    mapped.memset(7)
    assert (marr == 7).all()


@pytest.mark.sim
def test_memhostalloc_comes_from_the_host_cache_kept_apart_by_flags(mm):
    # numba's pinned_array and mapped_array call memhostalloc.
    import gc

    pinned = mm.memhostalloc(4096)
    p = pinned.host_pointer
    del pinned
    gc.collect()
    assert gpuptr.flush_pool()
    mapped = mm.memhostalloc(4096, mapped=True)
    assert mapped.host_pointer != p, "a mapped request never gets an unmapped block"
    before = gpuptr.stats()[0]["host"]["hits"]
    again = mm.memhostalloc(4096)
    assert again.host_pointer == p
    assert gpuptr.stats()[0]["host"]["hits"] == before + 1


def test_mempin_pins_in_place_and_keeps_the_owner(mm):
    host = np.zeros(128, dtype=np.uint8)
    pinned = mm.mempin(host, host.ctypes.data, host.nbytes)
    assert isinstance(pinned, gpuptr.PinnedMemory) and pinned.owned is host
    pinned.free()
    buf = np.zeros(64, dtype=np.uint8)
    m = mm.mempin(buf, ctypes.c_void_p(buf.ctypes.data), 64, mapped=True)
    assert isinstance(m, gpuptr.MappedMemory)
    m.memset(5)
    assert (buf == 5).all()


def test_memallocmanaged(mm):
    mem = mm.memallocmanaged(512, True)
    assert isinstance(mem, gpuptr.ManagedMemory)
    arr = np.ndarray(512, dtype=np.uint8, buffer=mem)
    mem.memset(9)
    assert (arr == 9).all()


def test_get_memory_info_counts_cached_bytes_as_free(mm, backend):
    MemoryInfo = backend.driver.MemoryInfo

    gpuptr.trim()
    before = mm.get_memory_info()
    assert isinstance(before, MemoryInfo) and 0 < before.free <= before.total
    mem = mm.memalloc(8 << 20)
    during = mm.get_memory_info()
    assert during.free <= before.free - (8 << 20)
    del mem
    gc.collect()
    after = mm.get_memory_info()
    assert after.free == before.free, "cached bytes count as free"


def test_reset_turns_live_pointers_stale_and_their_free_is_a_no_op(mm):
    mem = mm.memalloc(4096)
    view = mem.view(16)
    mm.reset()
    with pytest.raises(gpuptr.InvalidPointerError):
        mem.memset(0)
    with pytest.raises(gpuptr.InvalidPointerError):
        view.copy_to_host()
    mem.free()  # no-op: the memory belongs to the reset context
    assert gpuptr.stats()[0]["live_count"] == 0
    assert gpuptr.stats()[0]["cached_bytes"] == 0
    assert gpuptr.context(0) is not mem.context, "the reset context is detached"
    fresh = mm.memalloc(4096)  # allocation works again afterwards
    fresh.memset(1)
    assert fresh.copy_to_host()[:2] == b"\x01\x01"


def test_defer_cleanup_is_a_context_manager(mm, no_leaks):
    with mm.defer_cleanup():
        mem = mm.memalloc(64)
        del mem



def test_out_of_memory_is_numbas_own_error_and_gpuptrs(mm, backend):
    import pickle

    CudaAPIError = backend.driver.CudaAPIError

    with pytest.raises(CudaAPIError) as ei:
        mm.memalloc(1 << 62)
    e = ei.value
    assert isinstance(e, plugin.OutOfMemoryError) and isinstance(e, gpuptr.OutOfMemoryError)
    assert isinstance(e, MemoryError) and e.code == 2 and e.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert str(e).startswith("[2] out of memory on device 0") and "gpuptr's pool holds" in str(e)
    # Crossing a process boundary (a Dask worker's error) keeps it whole.
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is backend.OutOfMemoryError and back.code == 2 and str(back) == str(e)
    # The other numba's CudaAPIError does not catch it.
    for other in BACKENDS:
        if other != backend.name and _importable(other):
            assert not isinstance(e, plugin._backend(other).driver.CudaAPIError)



_ONLY_MLIR = hide_modules("numba") + """
try:
    import numba
except ImportError:
    pass
else:
    raise SystemExit("numba-cuda is still importable")
from numba_cuda_mlir.numba_cuda.cudadrv import driver
import gpuptr, gpuptr.numba as plugin
class Ctx:
    class device:
        id = 0
driver.set_memory_manager(plugin.MemoryManager)
m = plugin.MemoryManager(context=Ctx())
m.initialize()
assert isinstance(m, driver.BaseCUDAMemoryManager), type(m).__mro__
mem = m.memalloc(4096)
mem.memset(3)
assert mem.copy_to_host()[:2] == b"\\x03\\x03"
try:
    m.memalloc(1 << 62)
except driver.CudaAPIError as e:
    assert isinstance(e, plugin.OutOfMemoryError) and e.code == 2
try:
    plugin.as_cuda_array
except ImportError as e:
    assert "for numba-cuda" in str(e) and "numba-cuda-mlir" in str(e), e
else:
    raise SystemExit("as_cuda_array imported without numba-cuda")
print(gpuptr.install(cupy=False, torch=False)["numba"], driver._memory_manager is plugin.MemoryManager)
"""


def test_where_numba_cuda_mlir_is_the_only_numba_the_plugin_works():
    if not _importable("numba-cuda-mlir"):
        pytest.skip("numba-cuda-mlir is not importable here")
    r = subprocess.run([sys.executable, "-c", _ONLY_MLIR], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["installed", "True"], r.stdout


def test_star_import_works_where_numba_cuda_mlir_is_the_only_numba():
    # The launcher's names (for numba-cuda) are in __all__ only where
    # numba-cuda is: a star import must not raise the launcher's ImportError.
    if not _importable("numba-cuda-mlir"):
        pytest.skip("numba-cuda-mlir is not importable here")
    code = _ONLY_MLIR.split("from numba_cuda_mlir")[0] + (
        "ns = {}\n"
        "exec('from gpuptr.numba import *', ns)\n"
        "assert 'MemoryManager' in ns and 'as_cuda_array' not in ns, sorted(ns)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["ok"], r.stdout


class _Array:
    """What numba's ``device_memory_size`` reads of a ``DeviceNDArray``:
    its ``gpu_data`` (and the size it caches on it)."""

    def __init__(self, gpu_data):
        self.gpu_data = gpu_data


def test_device_memory_size_of_pool_memory_is_its_own_not_its_segments(mm, backend, no_leaks):
    # numba sizes memory by the driver allocation that holds it: for a
    # pool block, the whole segment. A memset sized so would run over the
    # blocks after it.
    mem = mm.memalloc(40)
    other = mm.memalloc(4096)
    arr = _Array(mem)
    assert backend.driver.device_memory_size(arr) == 40
    assert arr._cuda_memsize_ == 40, "cached, as numba caches its own"
    view = _Array(mem.view(8, 24))
    assert backend.driver.device_memory_size(view) == 16
    assert backend.driver.device_memory_size(mem) == 40, "the pointer itself"
    # The function is wrapped once, whatever builds the backend again.
    wrapped = backend.driver.device_memory_size
    plugin._size_gpuptr_memory_by_its_own(backend.driver)
    assert backend.driver.device_memory_size is wrapped
    assert wrapped.__name__ == "device_memory_size"
    del arr, view, mem, other


def test_device_memory_size_of_other_memory_is_numbas_answer(backend):
    # Not gpuptr's: numba's own function answers (here from the size a
    # numba object caches).
    class Foreign:
        _cuda_memsize_ = 123

    assert backend.driver.device_memory_size(Foreign()) == 123
    arr = _Array(object())
    arr._cuda_memsize_ = 77
    assert backend.driver.device_memory_size(arr) == 77
