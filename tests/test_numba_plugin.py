"""The numba EMM plugin's hooks, driven directly with a stand-in for numba's
context so they run on the simulator in CI (numba-cuda imports without a
GPU). The same hooks under real numba are in gpu/test_numba_plugin_gpu.py."""

from __future__ import annotations

import ctypes
import gc

import pytest

import gpuptr

np = pytest.importorskip("numpy")
try:
    import numba.cuda  # noqa: F401
    from gpuptr import numba as plugin
except Exception as e:  # numba-cuda absent, or no CUDA runtime to import with
    pytest.skip(f"numba-cuda not importable: {e}", allow_module_level=True)


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
def mm():
    m = plugin.MemoryManager(context=FakeNumbaContext(0))
    m.initialize()
    return m


def test_plugin_module_shape():
    assert plugin._numba_memory_manager is plugin.MemoryManager
    m = plugin.MemoryManager(context=None)  # numba's version check does this
    assert m.interface_version == 1
    from numba.cuda.cudadrv.driver import BaseCUDAMemoryManager

    assert isinstance(m, BaseCUDAMemoryManager)
    with pytest.raises(RuntimeError):
        plugin.MemoryManager()  # numba requires the context keyword


def test_set_memory_manager_accepts_the_plugin():
    from numba.cuda.cudadrv import driver

    saved = driver._memory_manager
    try:
        driver.set_memory_manager(plugin.MemoryManager)
        assert driver._memory_manager is plugin.MemoryManager
    finally:
        driver._memory_manager = saved


def test_initialize_accepts_a_bare_cudevice_for_attached_contexts():
    class Attached:
        device = 0  # numba's third-party contexts carry a CUdevice (int())

    m = plugin.MemoryManager(context=Attached())
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


def test_memalloc_on_device_1_comes_from_device_1():
    if gpuptr.driver_info()["device_count"] < 2:
        pytest.skip("needs two devices")
    m1 = plugin.MemoryManager(context=FakeNumbaContext(1))
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


def test_get_memory_info_counts_cached_bytes_as_free(mm):
    from numba.cuda.cudadrv.driver import MemoryInfo

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



def test_out_of_memory_is_numbas_own_error_and_gpuptrs(mm):
    import pickle

    from numba.cuda.cudadrv.driver import CudaAPIError

    with pytest.raises(CudaAPIError) as ei:
        mm.memalloc(1 << 62)
    e = ei.value
    assert isinstance(e, plugin.OutOfMemoryError) and isinstance(e, gpuptr.OutOfMemoryError)
    assert isinstance(e, MemoryError) and e.code == 2 and e.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert str(e).startswith("[2] out of memory on device 0") and "gpuptr's pool holds" in str(e)
    # Crossing a process boundary (a Dask worker's error) keeps it whole.
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is plugin.OutOfMemoryError and back.code == 2 and str(back) == str(e)
