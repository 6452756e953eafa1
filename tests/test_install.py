"""One pool for numba, CuPy and PyTorch: the allocator hooks, per-client
statistics and ``gpuptr.install()``. These run without a GPU: PyTorch's C
entry points are called through ctypes (as PyTorch's pluggable allocator
calls them), and CuPy and PyTorch are stood in for by small fakes that
record what gpuptr hands them. The real libraries are exercised by the GPU
tests in gpu/test_pipeline_gpu.py."""

from __future__ import annotations

import ctypes
import gc
import shutil
import subprocess
import sys
import textwrap
import threading
import types

import pytest

import gpuptr
from helpers import torch_hooks
from gpuptr import _core, _testing

t_alloc, t_free = torch_hooks()


def client(name, device=0):
    gc.collect()
    return gpuptr.stats()[device]["clients"][name]


@pytest.fixture
def fenced_hooks():
    _core._hooks_configure(False)
    yield
    _core._hooks_configure(True)  # the default


def test_torch_entry_points_allocate_from_the_pool_and_count_as_torch(fenced_hooks):
    live0, failures0 = _core._hooks_state()
    before = client("torch")["live_bytes"]
    p = t_alloc(1 << 20, 0, None)
    assert p, "an address"
    assert gpuptr.context_of(p) is gpuptr.context(0), "registered: its context resolves"
    assert client("torch")["live_bytes"] == before + (1 << 20)
    assert _core._hooks_state() == (live0 + 1, failures0)
    view = gpuptr.wrap(p, 1 << 20)
    view.memset(7)
    assert view.copy_to_host()[:4] == b"\x07" * 4
    del view
    t_free(p, 1 << 20, 0, None)
    assert client("torch")["live_bytes"] == before
    assert _core._hooks_state() == (live0, failures0)


def test_torch_entry_points_keep_the_pool_when_nothing_else_holds_the_context():
    # A fresh process where only PyTorch allocates: no gpuptr Python object
    # holds the context. Freeing the last tensor must not end the context
    # and its pool (on the H200 that made every torch.empty a cuMemAlloc,
    # 100 us instead of 2).
    code = textwrap.dedent(
        """
        import ctypes, gpuptr
        from gpuptr import _core
        lib = ctypes.CDLL(_core.__file__)
        lib.gpuptr_torch_alloc.restype = ctypes.c_void_p
        lib.gpuptr_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.gpuptr_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        _core._hooks_configure(True)                   # stream-ordered: reuse at once
        for _ in range(50):
            p = lib.gpuptr_torch_alloc(1 << 20, 0, 0x9000)
            lib.gpuptr_torch_free(p, 1 << 20, 0, 0x9000)
        s = gpuptr.stats()[0]
        print(s["pool_hits"], s["pool_misses"])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    hits, misses = map(int, out.stdout.split())
    assert (hits, misses) == (49, 1), "one miss, then the cached block every time"


def test_torch_entry_points_refuse_bad_input_without_crashing(fenced_hooks):
    live0, failures0 = _core._hooks_state()
    assert t_alloc(0, 0, None) is None, "zero bytes: null, as PyTorch's own allocator"
    assert t_alloc(-5, 0, None) is None
    assert t_alloc(1024, -1, None) is None
    assert t_alloc(1024, 99, None) is None
    assert t_alloc(1 << 62, 0, None) is None, "out of memory: null"
    assert _core._hooks_state() == (live0, failures0 + 4)
    m = gpuptr.alloc(4096)
    t_free(m.device_pointer_value, 4096, 0, None)  # not the hooks': untouched
    t_free(None, 0, 0, None)
    assert not m.freed and _core._hooks_state() == (live0, failures0 + 5)
    p = t_alloc(4096, 0, None)
    t_free(p, 4096, 0, None)
    t_free(p, 4096, 0, None)  # a second free is ignored, never a double free
    assert _core._hooks_state() == (live0, failures0 + 6)


def test_torch_entry_points_from_many_threads_balance_the_books(fenced_hooks):
    live0, failures0 = _core._hooks_state()
    before = client("torch")

    def churn(seed):
        held = []
        for i in range(2000):
            held.append(t_alloc(512 + (seed * 7919 + i * 131) % 300_000, 0, None))
            if len(held) > 8 or i % 3:
                t_free(held.pop(0), 0, 0, None)
        for p in held:
            t_free(p, 0, 0, None)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(8)]  # ctypes drops the GIL
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = client("torch")
    assert after["live_bytes"] == before["live_bytes"] and after["live_count"] == before["live_count"]
    assert after["alloc_count"] == before["alloc_count"] + 8 * 2000
    assert _core._hooks_state() == (live0, failures0)


@pytest.mark.sim
def test_torch_frees_wait_for_every_stream_unless_stream_ordered(fenced_hooks):
    # A tensor allocated on the default stream and written by a kernel on a
    # side stream (no record_stream reaches a pluggable allocator) is freed.
    p = t_alloc(1 << 20, 0, None)
    _testing.sim_queue_write(0x7000, p, b"\xab" * 64)
    t_free(p, 1 << 20, 0, None)
    q = t_alloc(1 << 20, 0, None)
    assert q != p, "not reused while the side stream may still write it"
    t_free(q, 1 << 20, 0, None)
    _testing.sim_complete()
    gpuptr.flush_pool()
    # Stream-ordered (PyTorch's own rule): reused at once on its stream.
    _core._hooks_configure(True)
    a = t_alloc(1 << 20, 0, 0x9000)
    t_free(a, 1 << 20, 0, 0x9000)
    b = t_alloc(1 << 20, 0, 0x9000)
    assert b == a, "the same stream reuses it at once"
    t_free(b, 1 << 20, 0, 0x9000)


@pytest.mark.sim
def test_a_recorded_stream_makes_a_torch_free_wait_for_every_stream():
    # PyTorch's default rule, and record_stream (gpuptr.torch.install makes
    # Tensor.record_stream tell the hooks): a tensor used on a side stream
    # and recorded there is not reused under that stream's work; one that
    # is not recorded is reused at once, as under PyTorch's own allocator.
    a = t_alloc(1 << 20, 0, 0x9000)
    _testing.sim_queue_write(0x7000, a, b"\xab" * 64)
    assert _core._hooks_record_stream(a, 0x7000)
    assert not _core._hooks_record_stream(a + 512, 0x7000), "not an allocation's start"
    t_free(a, 1 << 20, 0, 0x9000)
    b = t_alloc(1 << 20, 0, 0x9000)
    assert b != a, "recorded: it waits for the side stream"
    t_free(b, 1 << 20, 0, 0x9000)
    c = t_alloc(1 << 20, 0, 0x9000)
    assert c == b, "not recorded: reused at once on its stream"
    t_free(c, 1 << 20, 0, 0x9000)
    _testing.sim_complete()
    gpuptr.flush_pool()


def test_clients_count_their_own_allocations():
    before = {k: client(k) for k in ("direct", "numba", "cupy")}
    held = [_core._alloc_for("cupy", 1000), _core._alloc_for("numba", 3000), gpuptr.alloc(5000)]
    now = {k: client(k) for k in ("direct", "numba", "cupy")}
    for k, n in (("cupy", 1000), ("numba", 3000), ("direct", 5000)):
        assert now[k]["live_bytes"] == before[k]["live_bytes"] + n
        assert now[k]["live_count"] == before[k]["live_count"] + 1
        assert now[k]["alloc_count"] == before[k]["alloc_count"] + 1
    total = gpuptr.stats()[0]
    assert total["live_bytes"] == sum(c["live_bytes"] for c in total["clients"].values())
    del held
    assert client("cupy")["live_bytes"] == before["cupy"]["live_bytes"]
    with pytest.raises(gpuptr.InvalidArgumentError, match="client"):
        _core._alloc_for("jax", 64)


# ------------------------------------------------------------------ CuPy


class FakeCupy(types.ModuleType):
    """What gpuptr.cupy uses of CuPy, recording what it is handed."""

    def __init__(self, stream=0x4242, device=0, c_errors=True):
        super().__init__("cupy")
        self.__version__ = "0-fake"
        self.allocator = self.pinned_allocator = None
        rt = types.SimpleNamespace(getDevice=lambda: device)
        st = types.SimpleNamespace(get_current_stream_ptr=lambda: stream)

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id=-1):
                self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id

        class MemoryPointer:
            def __init__(self, mem, offset):
                self.mem, self.ptr = mem, mem.ptr + offset

        class PinnedMemoryPointer:
            def __init__(self, mem, offset):
                self.mem, self.ptr = mem, mem.ptr + offset

        class PythonFunctionAllocatorMemory:
            # As CuPy's: malloc only for a positive size, free when dropped.
            def __init__(self, size, malloc_func, free_func, device_id):
                self._free_func, self.device_id, self.size = free_func, device_id, size
                self.ptr = 0  # a malloc that raises leaves nothing to free
                self.ptr = malloc_func(size, device_id) if size > 0 else 0

            def __del__(self):
                if self.ptr:
                    self._free_func(self.ptr, self.device_id)

        class PythonFunctionAllocator:
            def __init__(self, malloc_func, free_func):
                self._malloc_func, self._free_func = malloc_func, free_func

            def malloc(self, size):
                mem = PythonFunctionAllocatorMemory(size, self._malloc_func, self._free_func, device)
                return MemoryPointer(mem, 0)

        # CuPy's CFunctionAllocator: its Cython calls the C hooks holding
        # the GIL (ctypes.PYFUNCTYPE does too, and raises what the hook set,
        # as Cython 3's `except? -1` does). With c_errors False, a CuPy whose
        # Cython would take the -1 for an address.
        c_malloc = ctypes.PYFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        c_free = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
        self.c_calls = 0

        def call_malloc(param, func, size, device_id):
            self.c_calls += 1
            try:
                return c_malloc(func)(param, size, device_id)
            except Exception:
                if c_errors:
                    raise
                return -1

        class CFunctionAllocatorMemory:
            def __init__(self, size, param, malloc_func, free_func, device_id):
                self._param, self._free_func, self.device_id, self.size = param, free_func, device_id, size
                self.ptr = 0
                self.ptr = call_malloc(param, malloc_func, size, device_id) if size > 0 else 0

            def __del__(self):
                if self.ptr:
                    c_free(self._free_func)(self._param, self.ptr, self.device_id)

        class CFunctionAllocator:
            def __init__(self, param, malloc_func, free_func, owner):
                self._args, self._owner = (param, malloc_func, free_func), owner

            def malloc(self, size):
                p, m, f = self._args
                return MemoryPointer(CFunctionAllocatorMemory(size, p, m, f, device), 0)

        class OutOfMemoryError(MemoryError):
            # As CuPy's: made from (size, total, limit).
            def __init__(self, size, total, limit=0):
                super().__init__(f"Out of memory allocating {size} bytes")

        self.cuda = types.SimpleNamespace(
            memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
            runtime=rt,
            stream=st,
            UnownedMemory=UnownedMemory,
            MemoryPointer=MemoryPointer,
            PinnedMemoryPointer=PinnedMemoryPointer,
            PythonFunctionAllocator=PythonFunctionAllocator,
            CFunctionAllocator=CFunctionAllocator,
            set_allocator=lambda f: setattr(self, "allocator", f),
            set_pinned_memory_allocator=lambda f: setattr(self, "pinned_allocator", f),
            get_current_stream=lambda: types.SimpleNamespace(ptr=stream),
        )


@pytest.fixture
def fake_cupy(monkeypatch):
    import gpuptr.cupy as gc_mod

    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    names = ("_installed", "_stream_ordered", "_allocator", "_get_device", "_current_stream_ptr", "_oom")
    for name in names:
        monkeypatch.setattr(gc_mod, name, getattr(gc_mod, name))
    return fake


def test_cupy_allocator_hands_out_pool_memory_owned_by_gpuptr(fake_cupy):
    import gpuptr.cupy

    gpuptr.cupy.install()
    assert gpuptr.cupy.installed()
    live0, failures0 = _core._hooks_state()
    before = client("cupy")["live_bytes"]
    mp = fake_cupy.allocator(1 << 20)
    assert (mp.mem.size, mp.mem.device_id) == (1 << 20, 0)
    assert gpuptr.context_of(mp.ptr) is gpuptr.context(0), "pool memory, registered"
    view = gpuptr.wrap(mp.ptr, 1 << 20)
    view.memset(9)
    assert view.copy_to_host()[-2:] == b"\x09\x09"
    del view
    assert client("cupy")["live_bytes"] == before + (1 << 20)
    assert _core._hooks_state() == (live0 + 1, failures0)
    del mp
    assert client("cupy")["live_bytes"] == before and _core._hooks_state() == (live0, failures0)
    pinned = fake_cupy.pinned_allocator(4096)
    # CuPy's PinnedMemoryPointer holds gpuptr's PinnedMemory itself (its
    # ptr and size are CuPy's names); a zero-byte one has a null address.
    assert isinstance(pinned.mem, gpuptr.PinnedMemory)
    assert pinned.ptr == pinned.mem.host_pointer == pinned.mem.ptr and pinned.mem.size == 4096
    assert fake_cupy.pinned_allocator(0).ptr == 0
    zero = fake_cupy.allocator(0)
    assert zero.ptr == 0 and zero.mem.device_id == 0
    # gpuptr.cupy.malloc is the same allocator, for code that calls it itself.
    assert gpuptr.cupy.malloc(4096).mem.size == 4096


@pytest.mark.sim
def test_cupy_frees_wait_for_every_stream_when_not_stream_ordered(fake_cupy):
    # The strict rule: memory CuPy freed while a (side-stream) kernel may
    # still write it is not handed out again until the fence.
    import gpuptr.cupy

    gpuptr.cupy.install(stream_ordered=False, pinned=False)
    try:
        mp = fake_cupy.allocator(1 << 20)
        p = mp.ptr
        _testing.sim_queue_write(0x7000, p, b"\xab" * 64)
        del mp
        again = fake_cupy.allocator(1 << 20)
        assert again.ptr != p, "not reused while a stream may still write it"
        del again
    finally:
        _testing.sim_complete()
        gpuptr.cupy.install(pinned=False)
    gpuptr.flush_pool()


@pytest.mark.sim
def test_cupy_pinned_memory_comes_from_the_host_cache_and_waits_for_the_fence(fake_cupy):
    # CuPy's pinned allocator (no CuPy needed: the fake stands in for it)
    # gets portable pinned blocks from gpuptr's host cache: a freed block is
    # reused only after the fence that follows its free.
    import gc

    import gpuptr.cupy

    gpuptr.cupy.install()
    before = gpuptr.stats()[0]["host"]
    pinned = fake_cupy.pinned_allocator(1 << 20)
    p = pinned.ptr
    assert gpuptr.stats()[0]["host"]["live_bytes"] == before["live_bytes"] + (1 << 20)
    del pinned
    gc.collect()
    again = fake_cupy.pinned_allocator(1 << 20)
    assert again.ptr != p, "not reused before the fence"
    q = again.ptr
    del again
    gc.collect()
    assert gpuptr.flush_pool()
    third = fake_cupy.pinned_allocator(1 << 20)
    after = gpuptr.stats()[0]["host"]
    assert third.ptr in (p, q), "a fenced block is reused"
    assert (after["hits"], after["misses"]) == (before["hits"] + 1, before["misses"] + 2)


def test_cupy_stream_ordered_allocates_on_cupys_current_stream(fake_cupy):
    import gpuptr.cupy

    gpuptr.cupy.install(stream_ordered=True, pinned=False)
    assert fake_cupy.pinned_allocator is None
    mp = fake_cupy.allocator(4096)
    p = mp.ptr
    del mp
    again = fake_cupy.allocator(4096)
    assert again.ptr == p, "freed on CuPy's stream: reused at once there"


def test_cupy_hooks_refuse_bad_input_with_typed_errors(fake_cupy):
    import gpuptr.cupy

    gpuptr.cupy.install()
    live0, failures0 = _core._hooks_state()
    with pytest.raises(fake_cupy.cuda.memory.OutOfMemoryError) as ei:
        _core._cupy_malloc(1 << 62, 0)
    # CuPy's error, and gpuptr's too, saying what was asked for and held.
    assert isinstance(ei.value, gpuptr.OutOfMemoryError) and isinstance(ei.value, MemoryError)
    assert ei.value.requested == 1 << 62 and ei.value.code == 2
    assert "could not allocate 4096.00 PiB" in str(ei.value) and "gpuptr's pool holds" in str(ei.value)
    with pytest.raises(gpuptr.InvalidArgumentError):
        _core._cupy_malloc(1024, 99)
    with pytest.raises(gpuptr.InvalidArgumentError):
        _core._cupy_malloc(-1, 0)
    m = gpuptr.alloc(4096)
    _core._cupy_free(m.device_pointer_value, 0)  # not the hooks': untouched
    _core._cupy_free("junk", 0)
    assert not m.freed
    p = _core._cupy_malloc(4096, 0)
    _core._cupy_free(p, 0)
    _core._cupy_free(p, 0)  # a second free is ignored, never a double free
    assert _core._hooks_state() == (live0, failures0 + 3)


def test_cupy_allocator_calls_the_c_hooks_where_cupy_passes_their_errors_on(fake_cupy):
    # CuPy's CFunctionAllocator calls gpuptr's C hooks: no Python call per
    # allocation. A failure there is CuPy's (and gpuptr's) typed exception.
    import gpuptr.cupy

    gpuptr.cupy.install(pinned=False)
    assert type(gpuptr.cupy._allocator).__name__ == "CFunctionAllocator"
    live0, failures0 = _core._hooks_state()
    calls = fake_cupy.c_calls
    mp = fake_cupy.allocator(1 << 20)
    assert fake_cupy.c_calls == calls + 1 and gpuptr.context_of(mp.ptr) is gpuptr.context(0)
    assert client("cupy")["live_bytes"] >= 1 << 20 and _core._hooks_state() == (live0 + 1, failures0)
    with pytest.raises(fake_cupy.cuda.memory.OutOfMemoryError) as ei:
        fake_cupy.allocator(1 << 62)
    assert isinstance(ei.value, gpuptr.OutOfMemoryError) and ei.value.requested == 1 << 62
    del mp
    assert _core._hooks_state() == (live0, failures0)
    s0 = gpuptr.stats()[0]
    again = fake_cupy.allocator(1 << 20)
    s1 = gpuptr.stats()[0]
    assert (s1["pool_hits"], s1["pool_misses"]) == (s0["pool_hits"] + 1, s0["pool_misses"]), "reused at once"
    del again
    malloc, free, fenced, _, probe, message = _core._cupy_c_hooks()
    c_malloc = ctypes.PYFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(malloc)
    c_free = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)(free)
    for device in (99, -1):
        with pytest.raises(gpuptr.InvalidArgumentError, match="device"):
            c_malloc(fenced, 1024, device)
    with pytest.raises(gpuptr.InvalidArgumentError, match="probe"):
        c_malloc(probe, 1024, 0)
    m = gpuptr.alloc(4096)
    c_free(fenced, m.device_pointer_value, 0)  # not the hooks': untouched
    assert not m.freed
    q = c_malloc(fenced, 4096, 0)
    c_free(probe, q, 0)  # the probe's free frees nothing
    assert _core._hooks_state() == (live0 + 1, failures0 + 1)
    c_free(fenced, q, 0)
    c_free(fenced, q, 0)  # a second free is ignored, never a double free
    assert _core._hooks_state() == (live0, failures0 + 2)


def test_cupy_allocator_keeps_the_python_hooks_where_cupy_would_take_an_error_for_an_address(monkeypatch):
    # A CuPy whose Cython does not check for an exception after its C
    # malloc would hand out address -1: the install-time probe finds that,
    # costs nothing, and gpuptr keeps PythonFunctionAllocator there.
    import gpuptr.cupy as gc_mod

    fake = FakeCupy(c_errors=False)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for name in ("_installed", "_stream_ordered", "_allocator", "_get_device", "_current_stream_ptr", "_oom"):
        monkeypatch.setattr(gc_mod, name, getattr(gc_mod, name))
    state = _core._hooks_state()
    gc_mod.install(pinned=False)
    assert type(gc_mod._allocator).__name__ == "PythonFunctionAllocator"
    assert fake.c_calls == 1, "probed once"
    assert _core._hooks_state() == state, "the probe allocated and freed nothing"
    mp = fake.allocator(4096)
    assert gpuptr.context_of(mp.ptr) is gpuptr.context(0) and fake.c_calls == 1
    del mp
    assert _core._hooks_state() == state


# ----------------------------------------------------------------- torch


class FakeTorchMemory(types.ModuleType):
    def __init__(self, fail=None):
        super().__init__("torch.cuda.memory")
        self.loaded = []
        self.fail = fail

        outer = self

        class CUDAPluggableAllocator:
            def __init__(self, path, alloc, free):
                outer.loaded.append((path, alloc, free))

        def change_current_allocator(a):
            if outer.fail:
                raise RuntimeError(outer.fail)
            outer.current = a

        self.CUDAPluggableAllocator = CUDAPluggableAllocator
        self.change_current_allocator = change_current_allocator


@pytest.fixture
def fake_torch(monkeypatch):
    import gpuptr.torch as gt

    def make(fail=None):
        mem = FakeTorchMemory(fail)
        torch = types.ModuleType("torch")
        torch.cuda = types.ModuleType("torch.cuda")
        torch.cuda.memory = mem
        for name, mod in (("torch", torch), ("torch.cuda", torch.cuda), ("torch.cuda.memory", mem)):
            monkeypatch.setitem(sys.modules, name, mod)
        monkeypatch.setattr(gt, "_allocator", None)
        return mem

    yield make
    _core._hooks_configure(False)


def test_torch_install_loads_gpuptrs_own_entry_points(fake_torch):
    import gpuptr.torch

    mem = fake_torch()
    gpuptr.torch.install()
    ((path, alloc, free),) = mem.loaded
    assert path == _core.__file__
    lib = ctypes.CDLL(_core.__file__)
    assert hasattr(lib, alloc) and hasattr(lib, free), "the symbols exist in the module"
    assert gpuptr.torch.installed()
    gpuptr.torch.install()  # idempotent
    assert len(mem.loaded) == 1


def test_torch_install_after_torch_allocated_says_why(fake_torch):
    import gpuptr.torch

    fake_torch(fail="Can't swap an already initialized allocator")
    with pytest.raises(gpuptr.InstallError, match="before PyTorch's first CUDA allocation") as e:
        gpuptr.torch.install()
    assert isinstance(e.value, RuntimeError) and "already initialized" in str(e.value)
    assert not gpuptr.torch.installed()


# --------------------------------------------------------------- install


def test_install_skips_what_cannot_be_imported_and_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "torch", None)
    report = gpuptr.install(numba=False)
    assert report["numba"] == "not requested"
    assert report["cupy"].startswith("skipped: cupy cannot be imported") and "pip install cupy-cuda" in report["cupy"]
    assert report["torch"].startswith("skipped: torch cannot be imported") and "pip install torch" in report["torch"]


def run(code):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_install_puts_numba_on_gpuptr_before_its_first_context():
    pytest.importorskip("numba.cuda")
    out = run(
        """
        import sys
        sys.modules["cupy"] = sys.modules["torch"] = None
        import gpuptr
        from numba.cuda.cudadrv import driver
        print(gpuptr.install()["numba"], driver._memory_manager.__module__)
        print(gpuptr.install()["numba"])
        """
    )
    assert out.split() == ["installed", "gpuptr.numba", "installed"]


def test_numba_install_alone_puts_numba_on_gpuptr_and_says_why_when_too_late():
    pytest.importorskip("numba.cuda")
    out = run(
        """
        import gpuptr.numba
        from numba.cuda.cudadrv import driver
        gpuptr.numba.install()
        gpuptr.numba.install()  # again: a no-op
        print(driver._memory_manager is gpuptr.numba.MemoryManager)
        driver._memory_manager = driver.NumbaCUDAMemoryManager
        try:
            gpuptr.numba.install()
        except gpuptr.InstallError as e:
            print("InstallError", "NUMBA_CUDA_MEMORY_MANAGER=gpuptr.numba" in str(e))
        """
    )
    assert out.split() == ["True", "InstallError", "True"]


def test_install_after_numba_chose_another_manager_says_why():
    pytest.importorskip("numba.cuda")
    out = run(
        """
        import sys
        sys.modules["cupy"] = sys.modules["torch"] = None
        import gpuptr
        from numba.cuda.cudadrv import driver
        driver._memory_manager = driver.NumbaCUDAMemoryManager  # as after numba's first context
        try:
            gpuptr.install()
        except gpuptr.InstallError as e:
            print("InstallError", "before numba's first CUDA call" in str(e))
        """
    )
    assert out.split() == ["InstallError", "True"]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_torch_entry_points_in_a_forked_child_refuse_without_touching_the_parents_memory(fenced_hooks):
    import os

    p = t_alloc(1 << 20, 0, None)
    assert p
    pid = os.fork()
    if pid == 0:  # the child: the parent's contexts are not its own
        ok = t_alloc(4096, 0, None) is None
        t_free(p, 1 << 20, 0, None)  # must not free the parent's block
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, "the child got no memory"
    before = client("torch")["live_bytes"]
    t_free(p, 1 << 20, 0, None)
    assert client("torch")["live_bytes"] == before - (1 << 20), "the parent's block was still its own"


_FORK_WHILE_THREADS_FREE = """
import ctypes, os, sys, threading, time, warnings
warnings.simplefilter("ignore")                  # fork with threads running
from gpuptr import _core
sys.path.insert(0, sys.argv[1])
from helpers import torch_hooks
t_alloc, t_free = torch_hooks()
_core._hooks_configure(False)
mine = [t_alloc(4096 * (i + 1), 0, None) for i in range(64)]
stop = False
def churn(s):
    while not stop:
        t_free(t_alloc(512 + s * 100, 0, None), 0, 0, None)
threads = [threading.Thread(target=churn, args=(s,), daemon=True) for s in range(8)]
for t in threads:
    t.start()
statuses = []
for _ in range(int(sys.argv[2])):
    failures0 = _core._hooks_state()[1]
    pid = os.fork()
    if pid == 0:
        for p in mine:
            t_free(p, 0, 0, None)
        ok = t_alloc(4096, 0, None) is None and _core._hooks_state()[1] >= failures0 + 65
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 10
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            done = (pid, "hung")
            break
        time.sleep(0.002)
    statuses.append(done[1])
stop = True
print(sorted(set(statuses), key=str))
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_torch_frees_in_a_child_forked_while_threads_allocate_never_hang():
    # The child's free took the record's lock, which a parent thread
    # allocating at the fork could hold for good: 4 of 800 children hung.
    # Now a child never touches the record: each free is refused (counted
    # as a failure), and the parent's pointers stay the parent's.
    import os

    env = dict(os.environ, GPUPTR_DRIVER="sim")
    here = os.path.dirname(__file__)
    r = subprocess.run(
        [sys.executable, "-c", _FORK_WHILE_THREADS_FREE, here, "60"], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0 and r.stdout.strip() == "[0]", (r.stdout, r.stderr)


_NATIVE_CHURN = r"""
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
typedef void *(*alloc_t)(ptrdiff_t, int, void *);
typedef void (*free_t)(void *, ptrdiff_t, int, void *);
static alloc_t A;
static free_t F;
static void *run(void *arg) {
    for (long i = 0;; i++) F(A(512 + ((long)arg * 7 + i) % 200000, 0, NULL), 0, 0, NULL);
    return NULL;
}
int start(const char *path, int n) {
    void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!h) return -1;
    A = (alloc_t)dlsym(h, "gpuptr_torch_alloc");
    F = (free_t)dlsym(h, "gpuptr_torch_free");
    for (long k = 0; k < n; k++) {
        pthread_t t;
        pthread_create(&t, NULL, run, (void *)k);
        pthread_detach(t);
    }
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_torch_allocations_from_threads_python_never_ran_on_survive_the_interpreters_exit(tmp_path):
    # PyTorch's own threads go on allocating while the interpreter exits,
    # with the history recording. Once finalized, CPython reports that every
    # thread holds the GIL; attaching to walk the stack panicked ("The
    # Python interpreter is not initialized", on stderr at 7 exits of 10)
    # and failed an allocation that had succeeded.
    (tmp_path / "churn.c").write_text(_NATIVE_CHURN)
    lib = tmp_path / "libchurn.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "churn.c"), "-lpthread", "-ldl"], check=True)
    code = textwrap.dedent(
        f"""
        import ctypes, time, gpuptr
        from gpuptr import _core
        gpuptr.record_history(True)
        assert ctypes.CDLL({str(lib)!r}).start(_core.__file__.encode(), 8) == 0
        time.sleep(0.2)
        """
    )
    env = dict(__import__("os").environ, GPUPTR_DRIVER="sim")
    for _ in range(5):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "panicked" not in r.stderr, r.stderr


def test_cupy_c_hooks_on_daemon_threads_survive_the_interpreters_exit():
    # The stream source is Python code (CuPy's fallback is a lambda): a
    # daemon thread that took the GIL back inside it during finalization
    # was ended with a forced unwind through the hook's frames, which
    # aborted the process (rc -6 at 5 exits of 10).
    code = textwrap.dedent(
        """
        import ctypes, threading, time
        from gpuptr import _core
        malloc, free, _, ordered, _, _ = _core._cupy_c_hooks()
        _core._cupy_set_stream_source(lambda: 0x9000)
        c_malloc = ctypes.PYFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(malloc)
        c_free = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)(free)
        def churn(s):
            while True:
                c_free(ordered, c_malloc(ordered, 4096 + s, 0), 0)
        for s in range(4):
            threading.Thread(target=churn, args=(s,), daemon=True).start()
        time.sleep(0.2)
        """
    )
    env = dict(__import__("os").environ, GPUPTR_DRIVER="sim")
    for _ in range(8):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (r.returncode, r.stderr)


def test_cupys_out_of_memory_class_can_be_caught_before_install(fake_cupy):
    import gpuptr.cupy

    cls = gpuptr.cupy.OutOfMemoryError            # before install(): made now, not None
    assert issubclass(cls, fake_cupy.cuda.memory.OutOfMemoryError) and issubclass(cls, gpuptr.OutOfMemoryError)
    gpuptr.cupy.install()
    assert gpuptr.cupy.OutOfMemoryError is cls    # the one the hook raises
    with pytest.raises(cls):
        _core._cupy_malloc(1 << 62, 0)


def test_without_cupy_its_out_of_memory_class_is_gpuptrs(monkeypatch):
    import gpuptr.cupy

    monkeypatch.setattr(gpuptr.cupy, "_oom", None)
    monkeypatch.setitem(sys.modules, "cupy", None)    # import cupy raises ImportError
    assert gpuptr.cupy.OutOfMemoryError is gpuptr.OutOfMemoryError
    with pytest.raises(AttributeError):
        gpuptr.cupy.no_such_name


def test_install_flags_take_numpys_bools_and_refuse_strings():
    np = pytest.importorskip("numpy")
    from gpuptr._needs import flag

    assert flag(np.True_, "x") is True and flag(np.False_, "x") is False
    for bad in ("no", 0, None, np.int64(1)):
        with pytest.raises(TypeError, match="x must be True or False"):
            flag(bad, "x")


def test_torch_install_checks_graph_trees_before_touching_torch(monkeypatch):
    import gpuptr.torch

    monkeypatch.setitem(sys.modules, "torch", None)      # never reached: the flag is refused first
    with pytest.raises(TypeError, match="graph_trees must be True or False"):
        gpuptr.torch.install(graph_trees="no")
