"""Property-based fuzzing on the simulator: constructors, host-memory
exports, CAI descriptors and free/copy/view interleavings across two
threads. Three properties: no crash, no SystemError or PanicException, and
no byte written outside the caller's own allocation (canary allocations stay
intact, and the simulator's poisoned quarantine finds no stale write)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuptr
from gpuptr import _testing

pytestmark = pytest.mark.sim

EXPECTED = (gpuptr.GpuptrError, TypeError, ValueError, BufferError, OverflowError, MemoryError)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def _no_internal_error(fn):
    try:
        fn()
    except EXPECTED as e:
        assert not isinstance(e, SystemError), e
    except BaseException as e:  # PanicException derives from BaseException
        raise AssertionError(f"unexpected {type(e).__name__}: {e}") from e


class Canary:
    """Allocations no fuzzed call owns: their bytes must never change."""

    def __init__(self):
        self.dev = gpuptr.alloc(4096)
        self.dev.memset(0x5A)
        self.host = gpuptr.alloc_host(4096, mapped=True)
        np.asarray(self.host)[:] = 0xA5

    def intact(self):
        return (self.dev.copy_to_host() == b"\x5a" * 4096
                and bool((np.asarray(self.host) == 0xA5).all()))


@pytest.fixture(scope="module")
def canary():
    c = Canary()
    yield c
    assert c.intact()
    assert _testing.sim_stale_writes() == (0, 0)


addresses = st.one_of(st.integers(-2, 2**64 + 2), st.floats(allow_nan=True), st.none(),
                      st.booleans(), st.text(max_size=3))
sizes = st.one_of(st.integers(-2, 2**63), st.floats(), st.booleans())


@SETTINGS
@given(cls=st.sampled_from(["PinnedMemory", "MappedMemory", "ManagedMemory", "MemoryPointer"]),
       address=addresses, size=sizes, use_real=st.booleans(), offset=st.integers(0, 8192))
def test_constructors_never_crash_or_reach_foreign_memory(canary, cls, address, size, use_real, offset):
    if use_real:
        address = canary.host.host_pointer + offset if cls != "MemoryPointer" else canary.dev.device_pointer_value + offset

    def build():
        obj = getattr(gpuptr, cls)(None, address, size)
        if cls == "MemoryPointer":
            obj.memset(0)
        else:
            np.asarray(obj).sum()
    _no_internal_error(build)
    # A wrap of the canary's own range may legitimately write it; restore.
    canary.dev.memset(0x5A)
    np.asarray(canary.host)[:] = 0xA5


typestrs = st.one_of(st.sampled_from(["|u1", "<f4", "<f8", "|V16", "|b1"]), st.text(max_size=25),
                     st.from_regex(r"\|V[0-9]{1,25}", fullmatch=True))


@SETTINGS
@given(shape=st.lists(st.integers(-3, 2**40), max_size=4), typestr=typestrs,
       strides=st.one_of(st.none(), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4)),
       offset=st.integers(0, 4096), version=st.integers(0, 4))
def test_cai_descriptors_never_crash(canary, shape, typestr, strides, offset, version):
    desc = {"shape": tuple(shape), "typestr": typestr, "version": version,
            "data": (canary.dev.device_pointer_value + offset, False), "strides": strides}
    _no_internal_error(lambda: gpuptr.from_cuda_array_interface(desc))
    assert canary.intact()


ops = st.lists(st.sampled_from(["free", "copy_in", "copy_out", "memset", "view", "export"]),
               min_size=1, max_size=8)


@SETTINGS
@given(a=ops, b=ops, host=st.booleans())
def test_two_threads_interleaving_free_copy_view_never_write_elsewhere(canary, a, b, host):
    mem = gpuptr.alloc_host(8192, mapped=True) if host else gpuptr.alloc(8192)

    def run(seq):
        for op in seq:
            def one(op=op):
                if op == "free":
                    mem.free()
                elif op == "copy_in":
                    mem.copy_from_host(b"\x11" * 8192)
                elif op == "copy_out":
                    mem.copy_to_host()
                elif op == "memset":
                    mem.memset(0x22)
                elif op == "view":
                    mem.view(100, 200).memset(0x33)
                elif op == "export" and host:
                    m = memoryview(mem)
                    m[:4] = b"abcd"
                    m.release()
            _no_internal_error(one)

    t = threading.Thread(target=run, args=(a,))
    t.start()
    run(b)
    t.join()
    assert canary.intact()
