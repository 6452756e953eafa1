"""Reliability: threads, interpreter shutdown, bad input, injected faults
and panics. Runs on the simulator in CI; the GPU parts are in
``tests/gpu/test_reliability_gpu.py``."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from helpers import soak

import gpuptr
from gpuptr import _testing

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DRIVER = gpuptr.driver_info()["driver"]
NDEV = gpuptr.driver_info()["device_count"]


def live():
    gc.collect()
    return [s["live_bytes"] for s in gpuptr.stats()], [s["live_count"] for s in gpuptr.stats()]


# --- threads ------------------------------------------------------------------


def test_sixteen_threads_hammer_alloc_view_wrap_free_and_lookup():
    before = live()
    errors = []
    start = threading.Barrier(16)

    def worker(k):
        try:
            start.wait()
            for i in range(300):
                dev = (k + i) % NDEV
                mem = gpuptr.alloc(256 + 64 * ((k * 7 + i) % 50), device=dev)
                v = mem.view(16, 128)
                w = gpuptr.wrap(mem.device_pointer_value + 8, 64, owner=mem)
                assert w.context is gpuptr.context(dev)
                assert gpuptr.context_of(v.device_pointer_value) is gpuptr.context(dev)
                v.memset(k & 0xFF, count=8)
                if i % 3 == 0:
                    mem.free()
                del mem, v, w
        except BaseException as e:  # a PanicException would be a BaseException
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert errors == []
    assert live() == before, "stats back to where they started"


# --- interpreter shutdown -------------------------------------------------------


def _exit_cleanly(code: str):
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=dict(os.environ), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr


def test_pointers_alive_at_exit_in_globals_and_cycles_exit_cleanly():
    _exit_cleanly(
        """
        import gpuptr
        g = gpuptr.alloc(1 << 20)
        views = [g.view(i * 1024, (i + 1) * 1024) for i in range(8)]
        cycle = [gpuptr.alloc(4096)]
        cycle.append(cycle)                      # a reference cycle holding a pointer
        class Holder:
            pass
        h = Holder(); h.me = h; h.mem = gpuptr.alloc_host(4096, mapped=True)
        w = gpuptr.wrap(g.device_pointer_value, 64, owner=h)
        fin = gpuptr.MemoryPointer(gpuptr.context(0), g.device_pointer_value, 16, finalizer=lambda: print("late"))
        import atexit
        atexit.register(lambda: None)
        """
    )


# --- bad input ------------------------------------------------------------------


def _host_addr():
    buf = ctypes.create_string_buffer(64)
    _host_addr.keep = buf
    return ctypes.addressof(buf)


BAD_INPUT = [
    ("alloc negative size", lambda m: gpuptr.alloc(-1), gpuptr.InvalidArgumentError),
    ("alloc huge size", lambda m: gpuptr.alloc(1 << 62), gpuptr.OutOfMemoryError),
    ("alloc float size", lambda m: gpuptr.alloc(1.5), TypeError),
    ("alloc str size", lambda m: gpuptr.alloc("8"), TypeError),
    ("alloc wrong device", lambda m: gpuptr.alloc(8, device=64), gpuptr.InvalidArgumentError),
    ("context wrong device", lambda m: gpuptr.context(64), gpuptr.InvalidArgumentError),
    ("wrap null address", lambda m: gpuptr.wrap(0, 8), gpuptr.InvalidPointerError),
    ("wrap negative address", lambda m: gpuptr.wrap(-1, 8), gpuptr.InvalidPointerError),
    ("wrap host address", lambda m: gpuptr.wrap(_host_addr(), 64), gpuptr.InvalidPointerError),
    ("wrap misaligned unregistered", lambda m: gpuptr.wrap(0x1003, 8), gpuptr.InvalidPointerError),
    ("wrap negative size", lambda m: gpuptr.wrap(m.device_pointer_value, -8), gpuptr.InvalidArgumentError),
    ("wrap past the block", lambda m: gpuptr.wrap(m.device_pointer_value, 1 << 40), gpuptr.InvalidPointerError),
    ("view past the end", lambda m: m.view(0, m.size + 1), gpuptr.InvalidPointerError),
    ("view reversed", lambda m: m.view(8, 4), gpuptr.InvalidPointerError),
    ("view negative start", lambda m: m.view(-1), gpuptr.InvalidArgumentError),
    ("view start past the end", lambda m: m.view(m.size + 1), gpuptr.InvalidPointerError),
    ("memset beyond the size", lambda m: m.memset(0, count=m.size + 1), gpuptr.InvalidPointerError),
    ("memset negative count", lambda m: m.memset(0, count=-1), gpuptr.InvalidArgumentError),
    ("memset byte out of range", lambda m: m.memset(256), gpuptr.InvalidArgumentError),
    ("copy from host too large", lambda m: m.copy_from_host(b"x" * (m.size + 1)), gpuptr.InvalidPointerError),
    ("copy to read-only buffer", lambda m: m.copy_to_host(b"xxxx"), gpuptr.InvalidArgumentError),
    ("free then use", lambda m: (m.free(), m.memset(0)), gpuptr.InvalidPointerError),
    ("CAI without data", lambda m: gpuptr.from_cuda_array_interface({"shape": (1,), "typestr": "<f4"}), gpuptr.InvalidArgumentError),
    ("CAI masked", lambda m: gpuptr.from_cuda_array_interface(
        {"shape": (1,), "typestr": "<f4", "data": (m.device_pointer_value, False), "mask": object(), "version": 3}),
        gpuptr.InvalidArgumentError),
    ("CAI bad typestr", lambda m: gpuptr.from_cuda_array_interface(
        {"shape": (1,), "typestr": "<q9", "data": (m.device_pointer_value, False), "version": 3}), gpuptr.InvalidArgumentError),
    ("DLPack of a host array", lambda m: gpuptr.from_dlpack(__import__("numpy").zeros(3)), gpuptr.InvalidArgumentError),
    ("DLPack of a non-exporter", lambda m: gpuptr.from_dlpack(object()), gpuptr.InvalidArgumentError),
    ("MemoryPointer bad context", lambda m: gpuptr.MemoryPointer("ctx", m.device_pointer_value, 8), TypeError),
    ("MemoryPointer bad pointer", lambda m: gpuptr.MemoryPointer(None, "addr", 8), TypeError),
    ("register a non-buffer", lambda m: gpuptr.register_host(object()), TypeError),
]


@pytest.mark.parametrize("name, call, error", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_gets_its_typed_error_and_leaks_nothing(name, call, error):
    mem = gpuptr.alloc(4096)
    before = live()
    host_before = _testing.sim_live_host_bytes() if DRIVER == "sim" else None
    with pytest.raises(error):
        call(mem)
    del mem
    gc.collect()
    after = live()
    # the case's own pointer may have been freed by the case; nothing else changed
    assert after[0][0] <= before[0][0] and after[1][0] <= before[1][0]
    assert after[0][1:] == before[0][1:]
    if host_before is not None:
        assert _testing.sim_live_host_bytes() == host_before


def test_there_are_at_least_twenty_bad_input_cases():
    assert len(BAD_INPUT) >= 20


def test_unknown_driver_name_is_a_typed_error():
    out = subprocess.run(
        [sys.executable, "-c", "import gpuptr\ntry:\n    gpuptr.context(0)\nexcept gpuptr.NoDriverError:\n    print('ok')"],
        env=dict(os.environ, GPUPTR_DRIVER="opencl"), capture_output=True, text=True, timeout=60,
    )
    assert out.stdout.strip() == "ok"


# --- injected faults --------------------------------------------------------------


FAULTS = [
    ("mem_alloc", lambda: (gpuptr.trim(), gpuptr.alloc(12345))),
    ("memset", lambda: gpuptr.alloc(64).memset(1)),
    ("memcpy", lambda: gpuptr.alloc(64).copy_to_host()),
    ("mem_get_info", lambda: gpuptr.context(0).get_memory_info()),
    ("synchronize", lambda: gpuptr.context(0).synchronize()),
    ("pointer_attributes", lambda: gpuptr.wrap(0x7F00_0000_1000, 8)),
    ("host_alloc", lambda: gpuptr.alloc_host(64)),
    ("host_register", lambda: gpuptr.register_host(bytearray(64))),
    ("host_device_pointer", lambda: gpuptr.alloc_host(64, mapped=True)),
    ("mem_alloc_managed", lambda: gpuptr.alloc_managed(64)),
    ("mem_free", lambda: (gpuptr.alloc(64).free(), gpuptr.trim())),
    # A free goes to the pinned cache; the trim makes the driver call.
    ("host_free", lambda: (gpuptr.alloc_host(64).free(), gpuptr.trim())),
    ("host_unregister", lambda: gpuptr.register_host(bytearray(64)).free()),
    ("context_current", lambda: gpuptr.context(0).push()),
    ("device_query", lambda: gpuptr.devices()[0].name),
]


@pytest.mark.sim
@pytest.mark.parametrize("kind, op", FAULTS, ids=[f[0] for f in FAULTS])
def test_each_fault_surfaces_typed_and_the_books_stay_balanced(kind, op):
    gc.collect()
    gpuptr.trim()
    base_dev, base_host = _testing.sim_live_bytes(), _testing.sim_live_host_bytes()
    _testing.sim_fail_nth(kind, 1, 999)  # CUDA_ERROR_UNKNOWN
    if kind == "mem_alloc":
        _testing.sim_fail_nth(kind, 2, 999)  # beat the pool's one retry
    with pytest.raises(gpuptr.CudaError) as ei:
        op()
    assert ei.value.code == 999 and ei.value.name == "CUDA_ERROR_UNKNOWN"
    _testing.sim_clear_faults()
    gc.collect()
    gpuptr.trim()
    # Every block is accounted for: the driver holds exactly what gpuptr
    # says is live, and nothing more.
    assert _testing.sim_live_bytes() - base_dev == 0
    assert _testing.sim_live_host_bytes() == base_host
    assert all(s["live_count"] >= 0 for s in gpuptr.stats())


# --- no panics --------------------------------------------------------------------

def _is_panic(e: BaseException) -> bool:
    return type(e).__name__ == "PanicException"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, 1 << 16), start=st.integers(-(1 << 64), 1 << 64), stop=st.one_of(st.none(), st.integers(-(1 << 64), 1 << 64)))
def test_view_arithmetic_never_panics(size, start, stop):
    mem = gpuptr.alloc(size)
    try:
        v = mem.view(start, stop)
        assert 0 <= v.size <= size
    except BaseException as e:
        assert not _is_panic(e), e
        # A bound that is no offset at all is out of its range; one past the
        # memory (or reversed bounds) reaches memory that is not there.
        bounds = [start] + ([] if stop is None else [stop])
        if any(b < 0 or b >= 2**63 for b in bounds):
            assert isinstance(e, gpuptr.InvalidArgumentError), repr(e)
        else:
            assert isinstance(e, gpuptr.InvalidPointerError), repr(e)


_ints = st.integers(-(1 << 70), 1 << 70)


@settings(max_examples=300, deadline=None)
@given(
    shape=st.one_of(st.lists(_ints, max_size=4).map(tuple), _ints, st.text(max_size=3)),
    strides=st.one_of(st.none(), st.lists(_ints, max_size=4).map(tuple)),
    typestr=st.one_of(st.sampled_from(["<f4", "|u1", "<i8", "<c16", "|V3"]), st.text(max_size=5)),
    offset=st.integers(-(1 << 20), 1 << 20),
    stream=st.one_of(st.none(), st.integers(-3, 3), st.booleans()),
)
def test_cai_parsing_never_panics(shape, strides, typestr, offset, stream):
    mem = gpuptr.alloc(1 << 16)
    desc = {"version": 3, "shape": shape, "strides": strides, "typestr": typestr,
            "data": (mem.device_pointer_value + offset, False), "stream": stream}
    try:
        v = gpuptr.from_cuda_array_interface(desc)
        assert v.pointer.size <= (1 << 16) + abs(offset)
    except BaseException as e:
        assert not _is_panic(e), e
        assert isinstance(e, (gpuptr.GpuptrError, TypeError, OverflowError)), repr(e)


# --- soak -----------------------------------------------------------------------


@pytest.mark.sim
def test_soak_through_the_plugin_hooks_on_the_simulator():
    soak(100_000, "hooks", dict(os.environ))


@pytest.mark.sim
def test_an_allocation_waiting_for_a_fence_lets_the_gil_go():
    # Out of memory, an allocation waits for the fence that frees a cached
    # block, and the fence waits for queued work that a Python thread ends
    # (as a stream callback or a feeding thread would). Holding the GIL
    # through the wait, the allocation would wait for ever.
    code = textwrap.dedent(
        """
        import threading, time, gpuptr
        from gpuptr import _testing
        MiB = 1 << 20
        a = gpuptr.alloc(12 * MiB)                  # a segment of its own
        _testing.sim_queue_write(0x7000, a.device_pointer_value, b"\\x01" * 64)
        a.free()                                    # waits for a fence
        def finish():
            time.sleep(0.3)
            _testing.sim_complete()                 # needs the GIL
        t = threading.Thread(target=finish)
        t.start()
        b = gpuptr.alloc(12 * MiB)                  # the device has no room for more
        t.join()
        print("done", b.device_pointer_value == a.device_pointer_value)
        """
    )
    env = dict(os.environ, GPUPTR_DRIVER="sim", GPUPTR_SIM_DEVICES="1", GPUPTR_SIM_MEMORY=str(20 << 20))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["done", "True"], r.stdout


@pytest.mark.sim
def test_alloc_after_a_reset_comes_from_the_new_context_not_the_cached_one():
    # gpuptr.alloc takes the device's cached context object when it is
    # still current: after a reset it must not.
    gc.collect()
    old = gpuptr.alloc(4096, device=0)
    before = old.context
    gpuptr.reset_context(0)
    with pytest.raises(gpuptr.InvalidPointerError):
        old.memset(0)
    fresh = gpuptr.alloc(4096, device=0)
    fresh.memset(7)  # live memory of the new context
    assert fresh.context.handle is not None and fresh.context is not before
    assert gpuptr.alloc(4096).context is fresh.context  # no device argument: the same
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.alloc(64, device=gpuptr.driver_info()["device_count"])
