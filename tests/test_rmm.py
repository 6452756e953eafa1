"""RMM on gpuptr's pool (``gpuptr.rmm``), without RMM: a stand-in
(``fake_rmm.py``) behaves as RMM's ``CallbackMemoryResource``,
``DeviceBuffer`` and per-device resources do, and is put in
``sys.modules`` as ``rmm``. The real RMM is exercised by the GPU tests in
gpu/test_rmm_gpu.py."""

from __future__ import annotations

import functools
import gc
import sys
import threading

import pytest

import fake_rmm
import gpuptr
from helpers import torch_hooks
from gpuptr import _core, _testing

MiB = 1 << 20


def client(name="rmm", device=0):
    gc.collect()
    return gpuptr.stats()[device]["clients"][name]


@pytest.fixture
def rmm(monkeypatch):
    """A fresh fake RMM as ``rmm`` (a real one, if any, is hidden), and
    gpuptr.rmm's state as it was."""
    import gpuptr.rmm as mod

    fake, mr = fake_rmm.make()
    monkeypatch.setitem(sys.modules, "rmm", fake)
    monkeypatch.setitem(sys.modules, "rmm.mr", mr)
    monkeypatch.setattr(mod, "_installed", {})
    monkeypatch.setattr(mod, "_stream_ordered", True)
    yield fake
    gc.collect()
    gpuptr.flush_pool()


def test_install_makes_gpuptrs_pool_rmms_resource_on_every_device(rmm):
    import gpuptr.rmm

    assert not gpuptr.rmm.installed()
    gpuptr.rmm.install()
    assert gpuptr.rmm.installed()
    n = gpuptr.driver_info()["device_count"]
    resources = [rmm.mr.get_per_device_resource(d) for d in range(n)]
    assert all(isinstance(r, rmm.mr.CallbackMemoryResource) for r in resources)
    assert len({id(r) for r in resources}) == n, "one resource per device"
    # The callables RMM calls with the GIL are the extension's own: the
    # allocation a partial over a builtin with the device bound, the free
    # the builtin itself.
    for d, r in enumerate(resources):
        assert isinstance(r._allocate_func, functools.partial)
        assert r._allocate_func.func is _core._rmm_alloc and r._allocate_func.args == (d, True)
        assert r._deallocate_func is _core._rmm_free
    gpuptr.rmm.install()  # again: nothing changes
    assert [rmm.mr.get_per_device_resource(d) for d in range(n)] == resources


def test_device_buffers_come_from_the_pool_and_count_as_rmm(rmm):
    import gpuptr.rmm

    gpuptr.rmm.install()
    live0, failures0 = _core._hooks_state()
    before = client()
    buf = rmm.DeviceBuffer(size=MiB)
    assert gpuptr.context_of(buf.ptr) is gpuptr.context(0), "pool memory, registered"
    view = gpuptr.wrap(buf.ptr, MiB)
    view.memset(5)
    assert view.copy_to_host()[-2:] == b"\x05\x05"
    del view
    now = client()
    assert now["live_bytes"] == before["live_bytes"] + MiB and now["live_count"] == before["live_count"] + 1
    assert now["alloc_count"] == before["alloc_count"] + 1
    assert _core._hooks_state() == (live0 + 1, failures0)
    del buf
    assert client()["live_bytes"] == before["live_bytes"]
    assert _core._hooks_state() == (live0, failures0)
    assert rmm.calls == [("allocate", MiB), ("deallocate", MiB)]
    # A zero-byte buffer never reaches the resource (as rmm::device_buffer);
    # a zero-byte allocation through the resource is null, as RMM's own
    # resources give, and freeing null is nothing.
    assert rmm.DeviceBuffer(size=0).ptr == 0
    mr = rmm.mr.get_current_device_resource()
    assert mr.allocate(0) == 0
    mr.deallocate(0, 0)
    assert client()["alloc_count"] == before["alloc_count"] + 1
    assert _core._hooks_state() == (live0, failures0)


def test_each_devices_resource_allocates_on_its_device(rmm):
    import gpuptr.rmm

    if gpuptr.driver_info()["device_count"] < 2:
        pytest.skip("needs two devices")
    gpuptr.rmm.install()
    before = client(device=1)["live_bytes"]
    rmm.current_device = 1  # RMM picks the current device's resource
    buf = rmm.DeviceBuffer(size=MiB)
    assert gpuptr.context_of(buf.ptr) is gpuptr.context(1)
    assert client(device=1)["live_bytes"] == before + MiB
    # Freed through the resource the buffer kept, whatever is current now.
    rmm.current_device = 0
    del buf
    assert client(device=1)["live_bytes"] == before
    own = gpuptr.rmm.memory_resource(1)
    b2 = rmm.DeviceBuffer(size=4096, mr=own)
    assert gpuptr.context_of(b2.ptr) is gpuptr.context(1)
    with pytest.raises(gpuptr.InvalidArgumentError, match="no device 99"):
        gpuptr.rmm.memory_resource(99)


@pytest.mark.sim
def test_frees_are_ordered_on_rmms_stream(rmm):
    # RMM's rule: a block freed on a stream is reused at once by
    # allocations on that stream; another stream gets it after the fence.
    import gpuptr.rmm

    gpuptr.rmm.install()
    gpuptr.flush_pool()
    s1, s2 = rmm.Stream(0x9100), rmm.Stream(0x9200)
    a = rmm.DeviceBuffer(size=MiB, stream=s1)
    p = a.ptr
    del a
    c = rmm.DeviceBuffer(size=MiB, stream=s1)
    assert c.ptr == p, "the freeing stream reuses it at once"
    del c
    b = rmm.DeviceBuffer(size=MiB, stream=s2)
    assert b.ptr != p, "another stream waits for the fence"
    del b
    # Freed on a stream other than its own: that one is the block's now.
    mr = rmm.mr.get_current_device_resource()
    gpuptr.flush_pool()
    q = mr.allocate(MiB, s1)
    mr.deallocate(q, MiB, s2)
    assert mr.allocate(MiB, s2) == q
    mr.deallocate(q, MiB, s2)
    # A free on a stream that cannot be read goes through the fence: not
    # reused while another stream's work may still use the block.
    r = mr.allocate(MiB, s1)
    try:
        _testing.sim_queue_write(0x7000, r, b"\xab" * 64)
        _core._rmm_free(r, MiB, "not a stream")
        again = mr.allocate(MiB, s1)
        assert again != r, "no stream known: it waits for the fence"
        mr.deallocate(again, MiB, s1)
    finally:
        _testing.sim_complete()


@pytest.mark.sim
def test_stream_ordered_false_makes_every_free_wait_for_the_fence(rmm):
    import gpuptr.rmm

    gpuptr.rmm.install(stream_ordered=False)
    mr = rmm.mr.get_current_device_resource()
    assert mr._allocate_func.args == (0, False)
    s = rmm.Stream(0x9300)
    try:
        a = rmm.DeviceBuffer(size=MiB, stream=s)
        p = a.ptr
        _testing.sim_queue_write(0x7000, p, b"\xab" * 64)  # a side stream still writes it
        del a
        b = rmm.DeviceBuffer(size=MiB, stream=s)
        assert b.ptr != p, "not reused while a stream may still write it"
        del b
    finally:
        _testing.sim_complete()
    # Installing with the other rule replaces the resources.
    gpuptr.rmm.install()
    assert rmm.mr.get_current_device_resource() is not mr
    assert rmm.mr.get_current_device_resource()._allocate_func.args == (0, True)


def test_out_of_memory_reaches_rmm_as_its_memory_error_with_gpuptrs_message(rmm):
    import gpuptr.rmm

    gpuptr.rmm.install()
    live0, failures0 = _core._hooks_state()
    before = client()
    # The callback raises gpuptr's OutOfMemoryError, a MemoryError ...
    with pytest.raises(gpuptr.OutOfMemoryError) as direct:
        _core._rmm_alloc(0, True, 1 << 62, rmm.DEFAULT_STREAM)
    assert isinstance(direct.value, MemoryError) and "could not allocate 4096.00 PiB" in str(direct.value)
    # ... which RMM sends through C++ as rmm::out_of_memory: what the user
    # catches is RMM's MemoryError, carrying gpuptr's message.
    total = gpuptr.context(0).get_memory_info()[1]
    with pytest.raises(MemoryError) as ei:
        rmm.DeviceBuffer(size=2 * total)
    text = str(ei.value)
    assert type(ei.value) is MemoryError
    assert text.startswith("std::bad_alloc: out of memory on device 0: could not allocate"), text
    assert f"({2 * total} bytes)" in text and "gpuptr's pool holds" in text, text
    # Other failures cross C++ as RuntimeError, with gpuptr's message.
    bad = rmm.mr.CallbackMemoryResource(functools.partial(_core._rmm_alloc, 99, True), _core._rmm_free)
    with pytest.raises(RuntimeError, match="device 99"):
        rmm.DeviceBuffer(size=4096, mr=bad)
    assert client()["live_bytes"] == before["live_bytes"]
    assert _core._hooks_state() == (live0, failures0)


def test_rmms_free_frees_only_what_rmms_allocation_handed_out(rmm):
    import gpuptr.rmm

    gpuptr.rmm.install()
    t_alloc, t_free = torch_hooks()
    mr = rmm.mr.get_current_device_resource()
    live0, failures0 = _core._hooks_state()
    # Another library's memory, freed through RMM's path: untouched.
    m = gpuptr.alloc(4096)
    mr.deallocate(m.device_pointer_value, 4096)
    c = _core._cupy_malloc(4096, 0)
    mr.deallocate(c, 4096)
    t = t_alloc(4096, 0, None)
    mr.deallocate(t, 4096)
    mr.deallocate(m.device_pointer_value + 512, 512)  # inside an allocation
    assert not m.freed
    assert _core._hooks_state() == (live0 + 2, failures0 + 4)
    view = gpuptr.wrap(c, 4096)
    view.memset(3)  # still live, still CuPy's
    del view
    # And RMM's memory freed through another library's path: untouched.
    p = mr.allocate(4096)
    _core._cupy_free(p, 0)
    t_free(p, 4096, 0, None)
    assert _core._hooks_state() == (live0 + 3, failures0 + 6)
    mr.deallocate(p, 4096)
    # A double free is ignored, never a second release; junk never raises.
    mr.deallocate(p, 4096)
    _core._rmm_free("junk", 4096, rmm.DEFAULT_STREAM)
    _core._rmm_free(-1, 4096, rmm.DEFAULT_STREAM)
    assert _core._hooks_state() == (live0 + 2, failures0 + 9)
    _core._cupy_free(c, 0)
    t_free(t, 4096, 0, None)
    assert _core._hooks_state() == (live0, failures0 + 9)


def test_bad_allocation_arguments_raise_typed_errors(rmm):
    live0, failures0 = _core._hooks_state()
    with pytest.raises(gpuptr.InvalidArgumentError):
        _core._rmm_alloc(0, True, -1, None)
    with pytest.raises(gpuptr.InvalidArgumentError):
        _core._rmm_alloc(-1, True, 4096, None)
    with pytest.raises(gpuptr.InvalidArgumentError, match="stream"):
        _core._rmm_alloc(0, True, 4096, "not a stream")
    assert _core._hooks_state() == (live0, failures0)


def test_rmm_callbacks_from_many_threads_balance_the_books(rmm):
    import gpuptr.rmm

    gpuptr.rmm.install()
    live0, failures0 = _core._hooks_state()
    before = client()
    mr = rmm.mr.get_current_device_resource()

    def churn(seed):
        stream = rmm.Stream(0xA000 + seed)
        held = []
        for i in range(500):
            n = 512 + (seed * 7919 + i * 131) % 300_000
            held.append((mr.allocate(n, stream), n))
            if len(held) > 8 or i % 3:
                p, n = held.pop(0)
                mr.deallocate(p, n, stream)
        for p, n in held:
            mr.deallocate(p, n, stream)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = client()
    assert (after["live_bytes"], after["live_count"]) == (before["live_bytes"], before["live_count"])
    assert after["alloc_count"] == before["alloc_count"] + 4 * 500
    assert _core._hooks_state() == (live0, failures0)


def test_the_summary_and_snapshot_name_the_rmm_client(rmm):
    import gpuptr.rmm

    gpuptr.rmm.install()
    gpuptr.record_history(True)
    try:
        buf = rmm.DeviceBuffer(size=3 * 4096 + 17)
        assert "rmm 12.0 KiB in 1" in gpuptr.memory_summary(0)
        entries = [
            b
            for seg in gpuptr.snapshot()["segments"]
            for b in seg["blocks"]
            if b.get("client") == "rmm" and b["state"] == "active_allocated"
        ]
        assert [b["requested_size"] for b in entries] == [3 * 4096 + 17]
        del buf
    finally:
        gpuptr.record_history(False)


def test_gpuptr_install_puts_rmm_on_the_pool_where_it_imports(rmm, monkeypatch):
    import gpuptr.rmm

    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "torch", None)
    report = gpuptr.install(numba=False)
    assert report["rmm"] == "installed" and gpuptr.rmm.installed()
    # Something else made RMM's resource: installed() says so, and
    # install() puts gpuptr back.
    rmm.mr.set_per_device_resource(0, rmm.mr.CudaMemoryResource())
    assert not gpuptr.rmm.installed()
    assert gpuptr.install(numba=False, rmm=True)["rmm"] == "installed" and gpuptr.rmm.installed()
    assert gpuptr.install(numba=False, rmm=False)["rmm"] == "not requested"
    with pytest.raises(TypeError, match="rmm must be True or False"):
        gpuptr.install(numba=False, rmm="yes")


def test_without_rmm_install_skips_it_and_says_what_to_install(monkeypatch):
    import gpuptr.rmm

    monkeypatch.setitem(sys.modules, "rmm", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "torch", None)
    report = gpuptr.install(numba=False)
    assert report["rmm"].startswith("skipped: rmm cannot be imported") and "pip install rmm-cu13" in report["rmm"]
    with pytest.raises(gpuptr.InstallError, match="pip install rmm-cu13"):
        gpuptr.rmm.install()
    with pytest.raises(gpuptr.InstallError):
        gpuptr.rmm.memory_resource(0)
