"""Memory safety on the simulator: every defect of the memory-safety issue
has a test here. Cases that crashed the process run in a subprocess, so a
regression fails the test instead of killing pytest."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import numpy as np
import pytest

import gpuptr
from gpuptr import _core, _testing

pytestmark = pytest.mark.sim


def run_isolated(code: str, timeout: int = 120, memory: int = 256 << 20) -> subprocess.CompletedProcess:
    env = dict(os.environ, GPUPTR_DRIVER="sim", GPUPTR_SIM_DEVICES="1", GPUPTR_SIM_MEMORY=str(memory))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


# 1. A buffer export outlives free() ------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: gpuptr.alloc_host(4096),
    lambda: gpuptr.alloc_host(4096, mapped=True),
    lambda: gpuptr.alloc_managed(4096),
    lambda: gpuptr.alloc_host(4096).own(),
])
def test_free_refuses_while_a_buffer_export_is_alive(make):
    p = make()
    arr = np.asarray(p)
    with pytest.raises(BufferError):
        p.free()
    arr[:] = 7                      # still the caller's own memory
    assert (np.asarray(p) == 7).all()
    del arr
    gc.collect()
    p.free()                        # no export left: released
    with pytest.raises(gpuptr.InvalidPointerError):
        memoryview(p)


def test_a_stale_export_never_reads_or_writes_freed_memory_in_a_subprocess():
    r = run_isolated("""
        import numpy as np, gpuptr
        p = gpuptr.alloc_host(16 << 20)
        a = np.asarray(p)
        try:
            p.free()
        except BufferError:
            pass
        else:
            raise SystemExit("free() succeeded with an export alive")
        q = gpuptr.alloc_host(16 << 20)
        a[:] = 1                    # lands in p's (still live) memory, never in q's
        assert not np.asarray(q).any()
        print("ok", int(a.sum()))
    """)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr


def test_a_registered_bytearray_cannot_move_while_registered_or_exported():
    b = bytearray(4096)
    p = gpuptr.register_host(b)
    with pytest.raises(BufferError):
        b.extend(b"x" * 10)         # the registration pins it in place
    v = memoryview(p)
    with pytest.raises(BufferError):
        p.free()
    v.release()
    p.free()
    b.extend(b"x" * 10)             # released: the owner may resize again


# 2. Read-only objects ----------------------------------------------------------

def test_read_only_sources_are_exported_read_only_and_refuse_device_writes():
    src = b"immutable" * 100
    p = gpuptr.register_host(src)
    assert p.readonly
    with pytest.raises(TypeError):
        memoryview(p)[:3] = b"abc"
    assert not np.asarray(p).flags.writeable
    src2 = b"unchanged" * 100
    m = gpuptr.register_host(src2, mapped=True)
    with pytest.raises(gpuptr.InvalidArgumentError):
        m.copy_from_host(b"x" * len(src2))
    with pytest.raises(gpuptr.InvalidArgumentError):
        m.memset(0)
    assert src == b"immutable" * 100 and src2 == b"unchanged" * 100
    assert m.copy_to_host()[:9] == b"unchanged"   # reads are fine


# 3. free() racing a copy in another thread ------------------------------------

def test_a_concurrent_free_never_lets_a_copy_write_into_reused_memory():
    gpuptr.flush_pool()
    failures = []
    for _ in range(200):
        p = gpuptr.alloc(1 << 16)
        payload = b"\xaa" * (1 << 16)
        start = threading.Barrier(2)

        def copy():
            start.wait()
            try:
                p.copy_from_host(payload)
            except gpuptr.InvalidPointerError:
                pass

        t = threading.Thread(target=copy)
        t.start()
        start.wait()
        p.free()
        t.join()
        q = gpuptr.alloc(1 << 16)
        q.memset(0)
        gpuptr.flush_pool()
        r = gpuptr.alloc(1 << 16)   # may get p's block now that it is fenced
        r.memset(0)
        if q.copy_to_host().count(0xAA) or r.copy_to_host().count(0xAA):
            failures.append(1)
        q.free(); r.free()
    assert not failures


# 4. copy_to_host() with no destination ------------------------------------------

def test_copy_to_host_checks_liveness_first_and_allocates_fallibly():
    r = run_isolated("""
        import gpuptr
        mem = gpuptr.alloc(64 << 20)
        v = mem.view(0)
        mem.free()
        try:
            v.copy_to_host()
        except gpuptr.InvalidPointerError:
            print("freed: typed")
    """)
    assert r.returncode == 0, r.stderr
    assert "freed: typed" in r.stdout


def test_copy_to_host_larger_than_host_memory_is_out_of_memory_not_an_abort():
    # The simulated device holds 1 GiB; the address-space limit then leaves
    # room for far less, so the host copy cannot be allocated.
    r = run_isolated("""
        import resource, gpuptr
        big = gpuptr.alloc(1 << 30)
        big.memset(1)
        vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
        try:
            big.copy_to_host()
            print("copied")
        except gpuptr.OutOfMemoryError as e:
            print("oom: typed", isinstance(e, MemoryError))
    """, memory=2 << 30)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "oom: typed True", r.stdout


def test_copy_to_host_into_a_buffer_of_the_wrong_size_is_refused():
    p = gpuptr.alloc(64)
    with pytest.raises(gpuptr.InvalidArgumentError):
        p.copy_to_host(bytearray(32))
    with pytest.raises(gpuptr.InvalidPointerError):
        p.copy_to_host(bytearray(65))
    assert len(p.copy_to_host(bytearray(64))) == 64


# 5. Host-memory constructors validate ----------------------------------------

@pytest.mark.parametrize("code", [
    "gpuptr.PinnedMemory(None, 0x10, 100)",
    "gpuptr.PinnedMemory(None, 0, 100)",
    "gpuptr.MappedMemory(None, h.host_pointer, 1 << 40)",
    "gpuptr.ManagedMemory(None, d.device_pointer_value, 64)",
    "gpuptr.PinnedMemory(None, d.device_pointer_value, 64)",
])
def test_host_memory_constructors_refuse_what_is_not_theirs(code):
    r = run_isolated(f"""
        import gpuptr, numpy as np
        h = gpuptr.alloc_host(4096, mapped=True)
        d = gpuptr.alloc(4096)
        try:
            x = {code}
            np.asarray(x).sum()
            print("accepted")
        except (gpuptr.InvalidPointerError, gpuptr.InvalidArgumentError) as e:
            print("refused", type(e).__name__)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("refused"), r.stdout


def test_register_host_ptr_refuses_unmapped_addresses():
    with pytest.raises((gpuptr.CudaError, gpuptr.InvalidPointerError)):
        _core.register_host_ptr(0x10, 4096)
    with pytest.raises((gpuptr.CudaError, gpuptr.InvalidPointerError)):
        _core.register_host_ptr(1 << 46, 4096)


# 6. Cycles are collected ---------------------------------------------------------

def test_an_exporter_caching_its_own_view_is_collected():
    gc.collect()
    live = gpuptr.stats()[0]["live_bytes"]

    class Exporter:
        def __init__(self):
            self.mem = gpuptr.alloc(1 << 20)
            self.__cuda_array_interface__ = {
                "shape": (1 << 20,), "typestr": "|u1", "version": 3,
                "data": (self.mem.device_pointer_value, False), "strides": None,
            }
            self.view = gpuptr.from_cuda_array_interface(self)

    e = Exporter()
    ref = weakref.ref(e)
    del e
    gc.collect()
    assert ref() is None
    assert gpuptr.stats()[0]["live_bytes"] == live


def test_a_bytearray_subclass_holding_its_own_registration_is_collected():
    class Buf(bytearray):
        pass

    regs = _testing.sim_live_registrations()
    b = Buf(8192)
    b.reg = gpuptr.register_host(b)
    ref = weakref.ref(b)
    del b
    gc.collect()
    assert ref() is None
    assert _testing.sim_live_registrations() == regs


def test_a_cycle_through_a_finalizer_is_collected_and_calls_it_once():
    calls = []
    box = []
    mem = gpuptr.alloc(4096)
    p = gpuptr.MemoryPointer(None, mem.device_pointer_value, 4096,
                             finalizer=lambda keep=box: calls.append(len(keep)))
    box.append(p)           # p -> finalizer -> its default (box) -> p
    ref = weakref.ref(p)
    del p, box
    gc.collect()
    assert ref() is None
    assert len(calls) == 1, "called exactly once (the collector may clear the list first)"
    mem.free()


def test_a_finalizer_shared_with_a_view_is_not_collected_early():
    calls = []
    mem = gpuptr.alloc(4096)
    p = gpuptr.MemoryPointer(None, mem.device_pointer_value, 4096, finalizer=lambda: calls.append(1))
    v = p.view(0, 16)
    del p
    gc.collect()
    assert calls == [] and not v.freed
    del v
    gc.collect()
    assert calls == [1]
    mem.free()


# 7. fork ---------------------------------------------------------------------------

def test_fork_while_another_thread_is_inside_gpuptr_never_hangs_the_child():
    r = run_isolated("""
        import os, threading, time, gpuptr
        stop = False
        def hammer():
            while not stop:
                p = gpuptr.alloc(4096); p.memset(1); p.copy_to_host(); p.free()
        ts = [threading.Thread(target=hammer) for _ in range(3)]
        for t in ts: t.start()
        results = []
        for i in range(10):
            pid = os.fork()
            if pid == 0:
                try:
                    gpuptr.alloc(16)
                    os._exit(3)
                except gpuptr.NoDriverError as e:
                    os._exit(0 if "fork" in str(e) else 4)
                except BaseException:
                    os._exit(5)
            deadline = time.time() + 20
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    results.append(os.waitstatus_to_exitcode(status)); break
                if time.time() > deadline:
                    os.kill(pid, 9); os.waitpid(pid, 0); results.append("hang"); break
                time.sleep(0.01)
        stop = True
        for t in ts: t.join()
        print(results)
    """, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str([0] * 10), r.stdout


# 8. CAI item sizes ---------------------------------------------------------------

def test_huge_cai_item_sizes_are_refused():
    mem = gpuptr.alloc(64)
    def desc(typestr):
        return {"shape": (1,), "typestr": typestr, "version": 3, "data": (mem.device_pointer_value, False)}

    # Item sizes that wrap a signed 64-bit stride are bad descriptors, also
    # for an empty array at address 0 (once accepted as a 0-byte array).
    for typestr in ["|V18446744073709551615", "|V9223372036854775808"]:
        with pytest.raises(gpuptr.InvalidArgumentError):
            gpuptr.from_cuda_array_interface(desc(typestr))
        empty = {"shape": (0,), "typestr": typestr, "version": 3, "data": (0, False)}
        with pytest.raises(gpuptr.InvalidArgumentError):
            gpuptr.from_cuda_array_interface(empty)
    # The largest that does not wrap is an array far larger than its memory.
    with pytest.raises((gpuptr.InvalidArgumentError, gpuptr.InvalidPointerError)):
        gpuptr.from_cuda_array_interface(desc("|V9223372036854775807"))


# 9. Mapped host memory is device memory ------------------------------------------

def test_mapped_host_memory_is_accepted_as_device_memory():
    h = gpuptr.alloc_host(4096, mapped=True)
    addr = h.device_pointer_value
    assert gpuptr.context_of(addr).device.id == h.context.device.id
    w = gpuptr.wrap(addr, 4096, owner=h)
    w.memset(3)
    assert np.asarray(h)[0] == 3
    desc = {"shape": (4096,), "typestr": "|u1", "version": 3, "data": (addr, False)}
    assert gpuptr.from_cuda_array_interface(desc).pointer.size == 4096
    # Unmapped pinned memory is not.
    with pytest.raises(gpuptr.InvalidPointerError):
        gpuptr.wrap(gpuptr.alloc_host(64).host_pointer, 64)


def test_zero_size_mapped_allocations_work_like_unmapped_ones():
    a = gpuptr.alloc_host(0, mapped=True)
    b = gpuptr.alloc_host(0)
    assert a.size == b.size == 0
    assert bytes(memoryview(a)) == bytes(memoryview(b)) == b""


# Smaller items ----------------------------------------------------------------------

def test_finalizer_must_be_callable():
    mem = gpuptr.alloc(64)
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.MemoryPointer(None, mem.device_pointer_value, 64, finalizer=42)


def test_floats_and_bools_are_not_addresses_sizes_or_devices():
    mem = gpuptr.alloc(64)
    with pytest.raises(TypeError):
        gpuptr.wrap(float(mem.device_pointer_value), 64)
    with pytest.raises(TypeError):
        gpuptr.alloc(True)
    with pytest.raises(TypeError):
        gpuptr.alloc(64, device=True)
    with pytest.raises(TypeError):
        gpuptr.alloc(64.0)


def test_a_bad_stream_gets_a_typed_error_that_names_streams():
    mem = gpuptr.alloc(64)
    for bad in ["s", 1.5, object(), True]:
        with pytest.raises(gpuptr.InvalidArgumentError, match="stream"):
            mem.memset(0, stream=bad)


def test_absurd_simulator_device_counts_are_refused():
    r = run_isolated("""
        import os, gpuptr
        try:
            gpuptr.alloc(1)
        except gpuptr.GpuptrError as e:
            print("refused", type(e).__name__)
    """.replace("import os, gpuptr", "import os; os.environ['GPUPTR_SIM_DEVICES'] = str(10**12); import gpuptr"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("refused"), r.stdout


def test_overlapping_copies_through_mapped_memory_are_defined():
    m = gpuptr.alloc_host(64, mapped=True)
    np.asarray(m)[:] = np.arange(64, dtype=np.uint8)
    m.view(1).copy_from_host(memoryview(m)[:-1])
    assert list(np.asarray(m)[:4]) == [0, 0, 1, 2]


def test_dlpack_capsules_are_consumed_on_import():
    arr = np.arange(4, dtype=np.float32)
    cap = arr.__dlpack__()
    owner = _core._dlpack_consume(cap)
    assert "used_dltensor" in repr(cap)
    with pytest.raises(gpuptr.InvalidArgumentError):
        _core._dlpack_consume(cap)          # consumed once only
    del owner                               # the deleter runs once, here
    gc.collect()
    assert arr.sum() == 6


# A wrap of gpuptr's own memory, with its pointer as owner -----------------------------

@pytest.mark.parametrize("make", [
    lambda m: gpuptr.wrap(m.device_pointer_value, m.size, owner=m),
    lambda m: gpuptr.wrap(m.device_pointer_value + 512, 512, owner=m),
    lambda m: gpuptr.MemoryPointer(m.context, m.device_pointer_value, m.size, owner=m),
    lambda m: gpuptr.from_cuda_array_interface(m).pointer,
    lambda m: gpuptr.wrap(m.device_pointer_value, m.size, owner=m, context=gpuptr.context(1)),
], ids=["wrap", "wrap-part", "MemoryPointer", "cai", "another-context"])
def test_a_wrap_whose_owner_is_the_gpuptr_pointer_turns_stale_when_it_is_freed(make):
    m = gpuptr.alloc(4096)
    m.memset(0)
    w = make(m)
    w.memset(7)                     # while the owner lives, the wrap is its memory
    assert m.copy_to_host().count(7) == w.size
    m.free()
    assert w.freed
    gpuptr.flush_pool()
    victim = gpuptr.alloc(4096)     # may take the freed block back
    victim.memset(0x11)
    for use in (lambda: w.memset(0xEE), lambda: w.copy_to_host(), lambda: w.view(0, 8).memset(1)):
        with pytest.raises(gpuptr.InvalidPointerError, match="freed"):
            use()
    assert set(victim.copy_to_host()) == {0x11}
    with pytest.raises(gpuptr.InvalidPointerError, match="freed"):
        make(m)                     # a wrap made after the free is refused
    victim.free()


def test_a_wrap_past_its_gpuptr_owners_memory_is_refused():
    m = gpuptr.alloc(4096)
    with pytest.raises(gpuptr.InvalidPointerError):
        gpuptr.wrap(m.device_pointer_value + 4096 - 8, 16, owner=m)
    m.free()


def test_a_cycle_through_a_wrap_of_a_pointer_with_a_finalizer_is_collected():
    g = gpuptr.alloc(4096)
    before = gpuptr.stats()[0]["live_bytes"]
    fired, kept = [], []
    p = gpuptr.MemoryPointer(g.context, g.device_pointer_value, 4096, owner=g,
                             finalizer=lambda kept=kept: fired.append(1))
    kept.append(gpuptr.wrap(g.device_pointer_value, 4096, owner=p))   # kept -> wrap -> p -> finalizer -> kept
    del g, p, kept
    gc.collect()
    assert fired == [1]
    assert gpuptr.stats()[0]["live_bytes"] == before - 4096


def test_a_finalizer_freed_with_a_cycle_runs_whole_before_the_collector_clears_it():
    # The collector frees a cycle through a wrap (owner -> wrap -> owner)
    # whose finalizer looks up a global: called from the pointer's clear, it
    # ran after the collector had cleared the function (no globals) and
    # crashed the interpreter. Each finalizer runs once, with its globals.
    r = run_isolated("""
        import gc, gpuptr
        gc.disable()
        base = gpuptr.alloc(1 << 20)
        calls = []
        class Holder: pass
        def make(i):
            h = Holder()
            h.p = gpuptr.MemoryPointer(None, base.device_pointer_value, 100, owner=h,
                                       finalizer=lambda: calls.append(len([i])))
        for i in range(100):
            make(i)
        gc.collect()
        print(len(calls), sum(calls))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["100", "100"]


def test_a_finalizer_is_called_at_free_whoever_holds_its_guard():
    # The collector hands the finalizer's holder out (gc.get_referents):
    # holding it does not put the call off past free(), and it leaves no
    # module behind.
    base = gpuptr.alloc(4096)
    fired = []
    p = gpuptr.MemoryPointer(None, base.device_pointer_value, 4096, owner=base,
                             finalizer=lambda: fired.append(1))
    held = [r for r in gc.get_referents(p) if r is not base]
    p.free()
    assert fired == [1]
    del held, p
    gc.collect()
    assert fired == [1]
    assert not [m for m in sys.modules if "finalizer" in m]


@pytest.mark.parametrize("make", [
    lambda h, f: gpuptr.MemoryPointer(None, h.device_pointer_value, 10, finalizer=f),
    lambda h, f: gpuptr.MappedMemory(None, h.host_pointer, 10, finalizer=f),
], ids=["MemoryPointer", "MappedMemory"])
def test_a_finalizer_keeps_the_error_of_the_call_that_freed_its_pointer(make):
    # A temporary pointer with a finalizer, freed while its method's error is
    # set: the finalizer ran with the error pending, and the caller got a
    # SystemError instead of its own.
    h = gpuptr.alloc_host(4096, mapped=True)
    fired = []
    with pytest.raises(gpuptr.InvalidArgumentError, match="256"):
        make(h, lambda: fired.append(1)).memset(256)
    assert fired == [1]
    h.free()


# Wraps and loans of gpuptr's pinned and mapped host memory ---------------------------

def _host_live() -> int:
    return gpuptr.stats()[0]["host"]["live_count"]


@pytest.mark.parametrize("make", [
    lambda m: gpuptr.wrap(m.device_pointer_value, 4096, owner=m),
    lambda m: gpuptr.MemoryPointer(m.context, m.device_pointer_value, 4096, owner=m),
    lambda m: gpuptr.MappedMemory(m.context, m.host_pointer, 4096, owner=m),
    lambda m: gpuptr.MappedMemory(m.context, m.host_pointer + 1024, 1024, owner=m),
    lambda m: gpuptr.from_cuda_array_interface(m).pointer,
], ids=["wrap", "MemoryPointer", "MappedMemory", "MappedMemory-part", "cai"])
def test_a_wrap_of_mapped_memory_with_it_as_owner_turns_stale_when_it_is_freed(make):
    m = gpuptr.alloc_host(4096, mapped=True)
    memoryview(m)[:] = bytes(4096)
    w = make(m)
    w.memset(7)                         # while the owner lives, the wrap is its memory
    assert bytes(memoryview(m)).count(7) == w.size
    m.free()
    gpuptr.flush_pool()
    victim = gpuptr.alloc_host(4096, mapped=True)   # the pinned cache may hand the block back
    memoryview(victim)[:4] = b"SAFE"
    with pytest.raises(gpuptr.InvalidPointerError):
        w.memset(0x45, 4)
    assert bytes(memoryview(victim)[:4]) == b"SAFE"
    with pytest.raises(gpuptr.InvalidPointerError):
        make(m)                         # made after the free: refused
    victim.free()


@pytest.mark.parametrize("make", [
    lambda r: gpuptr.PinnedMemory(r.context, r.host_pointer, 4096,
                                  owner=gpuptr.MappedMemory(r.context, r.host_pointer, 4096, owner=r)),
    lambda r: gpuptr.MappedMemory(r.context, r.host_pointer, 4096,
                                  owner=gpuptr.MappedMemory(r.context, r.host_pointer, 4096, owner=r)),
    lambda r: gpuptr.wrap(r.device_pointer_value, 4096,
                          owner=gpuptr.wrap(r.device_pointer_value, 4096, owner=r)),
    lambda r: gpuptr.PinnedMemory(r.context, r.host_pointer, 4096, owner=gpuptr.MemoryPointer.own(r)),
    lambda r: gpuptr.PinnedMemory(r.context, r.host_pointer + 64, 64, owner=r.view(0)),
], ids=["pinned-of-mapped-wrap", "mapped-of-mapped-wrap", "wrap-of-wrap", "owner-own-handle", "owner-view"])
def test_a_chain_of_wraps_over_gpuptr_mapped_memory_turns_stale_with_its_root(make):
    r = gpuptr.alloc_host(4096, mapped=True)
    w = make(r)
    r.free()
    gpuptr.flush_pool()
    victim = gpuptr.alloc_host(4096, mapped=True)
    memoryview(victim)[:4] = b"SAFE"
    with pytest.raises(gpuptr.InvalidPointerError):
        if isinstance(w, gpuptr.PinnedMemory):
            memoryview(w)[:4] = b"EEEE"
        else:
            w.memset(0x45, 4)
    assert bytes(memoryview(victim)[:4]) == b"SAFE"
    victim.free()


def test_mapped_memory_is_its_own_owner():
    m = gpuptr.alloc_host(4096, mapped=True)
    assert m.own() is m
    o = m.own()
    del m
    gc.collect()
    o.memset(1)                         # the handle keeps the memory alive
    fired = []
    h = gpuptr.alloc_host(4096, mapped=True)
    w = gpuptr.MappedMemory(h.context, h.host_pointer, 4096, None, lambda: fired.append(1))
    w.own().free()                      # numba's constructor shape: the finalizer runs
    assert fired == [1] and w.freed
    ba = bytearray(4096)
    r = gpuptr.register_host(ba, mapped=True)
    r.own().free()
    ba.extend(b"x")                     # unregistered, and the export of ba released
    h.free()
    o.free()


def test_a_with_block_that_raises_keeps_its_exception_over_a_refused_free():
    m = gpuptr.alloc_host(4096, mapped=True)
    with pytest.raises(KeyError):
        with m:
            view = memoryview(m)        # alive at the exit: the free is refused
            raise KeyError("the block's own")
    assert not m.freed
    view.release()
    m.free()
    with pytest.raises(BufferError):    # without an exception, the refusal is the error
        with gpuptr.alloc_host(64, mapped=True) as m2:
            view = memoryview(m2)
    view.release()
    m2.free()


def test_live_says_whether_memory_may_be_used_and_probes_of_freed_memory_raise():
    p = gpuptr.alloc(64)
    a = gpuptr.as_array(p, 64, "uint8")
    assert p.live and a.__cuda_array_interface__["data"][0] == p.device_pointer_value
    p.free()
    assert not p.live
    # A freed pointer answers no probe with an address: hasattr (numba's
    # is_cuda_array) raises InvalidPointerError, not False.
    for obj in (p, a):
        with pytest.raises(gpuptr.InvalidPointerError):
            hasattr(obj, "__cuda_array_interface__")


@pytest.mark.parametrize("finalizer", [False, True], ids=["plain", "with-finalizer"])
def test_a_pinned_wrap_with_gpuptr_pinned_memory_as_owner_shares_its_life(finalizer):
    # With a finalizer too: such a wrap was left out of the shared life, and
    # its export did not stop the owner's free (the memoryview then read and
    # wrote the block's next owner).
    h = gpuptr.alloc_host(4096)
    fired = []
    fin = {"finalizer": lambda: fired.append(1)} if finalizer else {}
    w = gpuptr.PinnedMemory(h.context, h.ptr + 1024, 1024, owner=h, **fin)
    memoryview(w)[:3] = b"abc"
    assert bytes(memoryview(h)[1024:1027]) == b"abc"     # the same bytes
    view = memoryview(w)
    with pytest.raises(BufferError):
        h.free()                        # the wrap's export counts on its owner
    view.release()
    h.free()
    gpuptr.flush_pool()
    victim = gpuptr.alloc_host(4096)
    memoryview(victim)[:4] = b"SAFE"
    with pytest.raises(gpuptr.InvalidPointerError, match="freed"):
        memoryview(w)[:4] = b"EEEE"
    assert bytes(memoryview(victim)[:4]) == b"SAFE"
    with pytest.raises(gpuptr.InvalidPointerError, match="inside its owner"):
        gpuptr.PinnedMemory(victim.context, victim.ptr + 4000, 200, owner=victim)
    # Not mapped: the driver is asked for its device address (the simulator
    # has none; with unified addressing a GPU's driver has one).
    with pytest.raises(gpuptr.GpuptrError):
        gpuptr.MappedMemory(victim.context, victim.ptr, 64, owner=victim)
    victim.free()
    w.free()                            # a wrap with a finalizer calls it, once
    del w
    assert fired == ([1] if finalizer else [])


def test_a_dlpack_loan_of_mapped_memory_keeps_its_host_memory_past_free():
    m = gpuptr.alloc_host(4096, mapped=True)
    before = _host_live()
    t = gpuptr.from_dlpack(m)
    m.free()                            # returns; the release waits for the consumer
    gpuptr.flush_pool()
    other = gpuptr.alloc_host(4096, mapped=True)
    assert other.host_pointer != m.host_pointer
    t.pointer.memset(1)                 # the consumer's memory is still its own
    del t
    gc.collect()
    assert _host_live() == before       # `other` only: the loan's end released m
    other.free()


@pytest.mark.parametrize("release", [
    lambda m: m.__exit__(None, None, None),
    lambda m: m.own().free(),
    lambda m: gpuptr.MemoryPointer.free(m),
    lambda m: gpuptr.MemoryPointer.own(m).free(),   # a plain handle over it: the base class's path
], ids=["with", "own", "base-free", "base-own"])
def test_every_free_of_mapped_memory_lets_its_host_memory_go(release):
    before = _host_live()
    m = gpuptr.alloc_host(4096, mapped=True)
    view = memoryview(m)
    with pytest.raises(BufferError):
        release(m)                      # refused while exported, nothing released
    assert not m.freed and _host_live() == before + 1
    view.release()
    release(m)
    assert m.freed and _host_live() == before


def test_with_on_mapped_registered_memory_unregisters_it():
    ba = bytearray(4096)
    with gpuptr.register_host(ba, mapped=True):
        pass
    ba.extend(b"x")                     # no export of `ba` is left


def test_registering_a_range_twice_is_a_typed_error():
    ba = bytearray(8192)
    r = gpuptr.register_host(ba)
    with pytest.raises(gpuptr.InvalidArgumentError, match="already registered"):
        gpuptr.register_host(memoryview(ba)[4096:])
    r.free()


# The simulator's poison ---------------------------------------------------------------

def test_no_stale_host_write_reached_freed_memory_during_these_tests():
    lost, stale = _testing.sim_stale_writes()
    assert (lost, stale) == (0, 0)
