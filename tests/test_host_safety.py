"""Host memory, fork, exit, logging and argument safety on the simulator:
each mend (the numbered sections below) with a test that failed before it.
Cases that crashed or could hang the process run in a subprocess with a
timeout, so a regression fails the test instead of killing pytest."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gpuptr
from gpuptr import _core

pytestmark = pytest.mark.sim


def run_isolated(code: str, timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, GPUPTR_DRIVER="sim", GPUPTR_SIM_DEVICES="1", GPUPTR_SIM_MEMORY=str(256 << 20), **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


# 8. Read-only host memory is not writable through gpuptr's own pointers ---------

N = 900


def _read_only_sources():
    """Read-only objects of N bytes, each with the bytes it must keep."""
    b = bytes(range(256)) * 3 + bytes(N - 768)       # not interned: a new object
    arr = np.arange(N, dtype=np.uint8)
    arr.flags.writeable = False
    mv = memoryview(bytearray(b"m" * N)).toreadonly()
    return [("bytes", b), ("numpy", arr), ("memoryview", mv)]


def _snapshot(src) -> bytes:
    return bytes(memoryview(src))


# Every route to a gpuptr pointer over a mapped read-only registration `h`.
ROUTES = {
    "wrap": lambda h: gpuptr.wrap(h.device_pointer_value, N, owner=h),
    "wrap inside": lambda h: gpuptr.wrap(h.device_pointer_value + 100, 64, owner=h),
    "MemoryPointer(ctx)": lambda h: gpuptr.MemoryPointer(h.context, h.device_pointer_value, N),
    "MemoryPointer(None)": lambda h: gpuptr.MemoryPointer(None, h.device_pointer_value + 1, N - 1),
    "from_cuda_array_interface": lambda h: gpuptr.from_cuda_array_interface(h).pointer,
    "from_dlpack": lambda h: gpuptr.from_dlpack(h).pointer,
    "MappedMemory": lambda h: gpuptr.MappedMemory(None, h.host_pointer, N, owner=h),
    "MappedMemory inside": lambda h: gpuptr.MappedMemory(None, h.host_pointer + 10, 20, owner=h),
    "view": lambda h: h.view(5, 50),
}

WRITES = {
    "memset": lambda p: p.memset(0x45),
    "copy_from_host": lambda p: p.copy_from_host(b"EVIL" * (p.size // 4)),
    "copy_from_device": lambda p: p.copy_from_device(gpuptr.alloc(p.size)),
}


@pytest.mark.parametrize("source", ["bytes", "numpy", "memoryview"])
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_read_only_host_memory_is_not_writable_through_any_gpuptr_pointer(source, route):
    src = dict(_read_only_sources())[source]
    before = _snapshot(src)
    h = gpuptr.register_host(src, mapped=True)
    assert h.readonly
    p = ROUTES[route](h)
    assert p.__cuda_array_interface__["data"][1] is True, "exported as read-only"
    for name, write in WRITES.items():
        with pytest.raises(gpuptr.InvalidArgumentError, match="read-only"):
            write(p)
    assert _snapshot(src) == before
    assert p.copy_to_host()[:4] == before[p.device_pointer_value - h.device_pointer_value:][:4]  # reads work


def test_a_read_only_cai_or_dlpack_import_of_device_memory_refuses_writes():
    mem = gpuptr.alloc(256)
    mem.memset(7)
    desc = {"shape": (256,), "typestr": "|u1", "version": 3, "data": (mem.device_pointer_value, True)}
    cai = gpuptr.from_cuda_array_interface(desc).pointer
    cap = _core._dlpack_export(mem, [256], None, "uint8", True, None, max_version=(1, 0))
    dl = _core._import_dlpack(cap).pointer
    for p in (cai, dl, cai.view(10), dl.own()):
        for write in WRITES.values():
            with pytest.raises(gpuptr.InvalidArgumentError, match="read-only"):
                write(p)
    assert mem.copy_to_host() == b"\x07" * 256
    # The memory itself, and a writable import of it, stay writable.
    desc["data"] = (mem.device_pointer_value, False)
    gpuptr.from_cuda_array_interface(desc).pointer.memset(1)
    assert mem.copy_to_host() == b"\x01" * 256


def test_a_released_read_only_registration_leaves_no_read_only_range_behind():
    src = bytes(bytearray(b"r" * N))
    h = gpuptr.register_host(src, mapped=True)
    h.free()
    del h
    gc.collect()
    arr = np.zeros(N, dtype=np.uint8)
    w = gpuptr.register_host(arr, mapped=True)
    # Whatever address the new registration got, it is writable.
    gpuptr.wrap(w.device_pointer_value, N, owner=w).memset(9)
    assert (arr == 9).all()


# 9. Host objects over read-only memory export read-only buffers ----------------

def _address_of(src) -> int:
    return np.frombuffer(src, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("mapped", [False, True])
def test_pinned_and_mapped_wraps_of_a_read_only_registration_export_read_only(mapped):
    src = bytes(bytearray(b"immutable" * 100))
    h = gpuptr.register_host(src, mapped=mapped)
    wraps = [gpuptr.PinnedMemory(None, h.host_pointer, len(src)),
             gpuptr.PinnedMemory(None, h.host_pointer + 9, 9, owner=h)]
    if mapped:
        wraps += [gpuptr.MappedMemory(None, h.host_pointer, len(src)),
                  gpuptr.MappedMemory(None, h.host_pointer + 9, 9)]
    for w in wraps:
        assert w.readonly
        mv = memoryview(w)
        assert mv.readonly
        with pytest.raises(TypeError):
            mv[:4] = b"EVIL"
        assert not np.asarray(w).flags.writeable
        mv.release()
    assert src == b"immutable" * 100


@pytest.mark.parametrize("mapped", [False, True])
def test_mempin_of_a_read_only_owner_exports_read_only(mapped):
    for src in (bytes(bytearray(b"pinned!" * 64)), np.frombuffer(bytes(bytearray(448)), dtype=np.uint8)):
        before = _snapshot(src)
        p = _core.register_host_ptr(_address_of(src), len(before), owner=src, mapped=mapped)
        assert p.readonly
        with pytest.raises(TypeError):
            memoryview(p)[:4] = b"EVIL"
        if mapped:
            with pytest.raises(gpuptr.InvalidArgumentError, match="read-only"):
                p.memset(0)
        assert _snapshot(src) == before
        p.free()


def test_mempin_of_a_writable_owner_stays_writable():
    buf = bytearray(256)
    p = _core.register_host_ptr(_address_of(buf), 256, owner=buf, mapped=True)
    assert not p.readonly
    memoryview(p)[:4] = b"GOOD"
    p.view(4, 8).memset(0x21)
    assert bytes(buf[:8]) == b"GOOD!!!!"
    p.free()


# 10. A forked child never runs a release the parent deferred -------------------

def test_a_forked_child_never_runs_a_release_the_parent_deferred(tmp_path):
    log = tmp_path / "finalized"
    r = run_isolated(f"""
        import gc, os, pickle, subprocess, sys
        import gpuptr
        LOG = {str(log)!r}
        note = lambda: open(LOG, "a").write(f"{{os.getpid()}}\\n")  # noqa: E731
        mem = gpuptr.alloc(4096)
        wrapped = gpuptr.MemoryPointer(None, mem.device_pointer_value, 4096, finalizer=note)
        capsule = wrapped.__dlpack__()
        wrapped.free()                  # deferred: the capsule holds the memory
        block = gpuptr.alloc(1 << 20)
        handle = block.ipc_handle()
        block_capsule = block.__dlpack__()
        block.free()                    # deferred too; its liveness slot stays
        pid = os.fork()
        if pid == 0:
            del capsule, block_capsule  # the child's copies: nothing to release
            gc.collect()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not os.path.exists(LOG), "the finalizer ran in the child"
        # Another process still finds the block live (its own simulator then
        # fails to map it): the child did not clear the parent's slot.
        opener = "import pickle, sys, gpuptr\\n" \\
                 "try:\\n    pickle.loads(sys.stdin.buffer.read()).open()\\n" \\
                 "except gpuptr.GpuptrError as e:\\n    print(type(e).__name__)\\n"
        out = subprocess.run([sys.executable, "-c", opener], input=pickle.dumps(handle),
                             capture_output=True, timeout=60)
        print("open:", out.stdout.decode().strip())
        del capsule, block_capsule      # the parent's: released here
        gc.collect()
        print("finalized by", open(LOG).read().split() == [str(os.getpid())])
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split("\n")[:2] == ["open: InvalidArgumentError", "finalized by True"], r.stdout + r.stderr


def test_a_forked_child_never_calls_a_python_finalizer_at_its_exit(tmp_path):
    log = tmp_path / "finalized"
    r = run_isolated(f"""
        import os, sys, gpuptr
        LOG = {str(log)!r}
        note = lambda: open(LOG, "a").write(f"{{os.getpid()}}\\n")  # noqa: E731
        mem = gpuptr.alloc(4096)
        keep = gpuptr.MemoryPointer(None, mem.device_pointer_value, 4096, finalizer=note)
        view = keep.view(0, 16)
        pid = os.fork()
        if pid == 0:
            del keep, view              # the last holders, in the child
            sys.exit(0)                 # and a normal exit: finalization runs
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status), os.path.exists(LOG))
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "child 0 False", r.stdout + r.stderr


def test_a_forked_child_never_calls_a_python_finalizer_through_the_collector(tmp_path):
    # A garbage cycle pending at the fork (owner -> wrap -> owner) is
    # collected in both processes: the child's collection finalizes the
    # finalizer's guard, which must not call it there.
    log = tmp_path / "finalized"
    r = run_isolated(f"""
        import gc, os, sys, gpuptr
        LOG = {str(log)!r}
        note = lambda: open(LOG, "a").write(f"{{os.getpid()}}\\n")  # noqa: E731
        gc.disable()
        base = gpuptr.alloc(4096)
        class Holder: pass
        h = Holder()
        h.p = gpuptr.MemoryPointer(None, base.device_pointer_value, 4096, owner=h, finalizer=note)
        del h
        pid = os.fork()
        if pid == 0:
            gc.collect()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        child = os.path.exists(LOG)
        gc.collect()
        print("child", os.waitstatus_to_exitcode(status), child, open(LOG).read().split() == [str(os.getpid())])
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "child 0 False True", r.stdout + r.stderr


# 11. Exit is clean while a daemon thread is inside a gpuptr call running Python --

DAEMONS = {
    "stream object": """
        class Stream:
            def __cuda_stream__(self):
                x = 0
                for i in range(3000):
                    x += i
                return (0, 0)
        def work():
            s = Stream()
            while True:
                gpuptr.alloc(64, stream=s).free(stream=s)
    """,
    "log records": """
        import io, logging
        class Slow(logging.Handler):
            def emit(self, record):
                sum(range(3000))
                io.StringIO().write(self.format(record))
        logging.getLogger("gpuptr").addHandler(Slow())
        logging.getLogger("gpuptr").setLevel(logging.DEBUG)
        def work():
            n = 0
            while True:
                n += 1
                gpuptr.alloc(4096 * (1 + n % 97)).free()
                gpuptr.trim()
    """,
    "finalizer": """
        def work():
            mem = gpuptr.alloc(4096)
            while True:
                p = gpuptr.MemoryPointer(None, mem.device_pointer_value, 64,
                                         finalizer=lambda: sum(range(3000)))
                p.free()
    """,
}


@pytest.mark.parametrize("kind", sorted(DAEMONS))
def test_exit_is_clean_while_daemon_threads_are_inside_gpuptr_calls_that_run_python(kind):
    code = "import threading, time, gpuptr\n" + textwrap.dedent(DAEMONS[kind]) + textwrap.dedent("""
        for _ in range(4):
            threading.Thread(target=work, daemon=True).start()
        time.sleep(0.3)
        print("exiting")
    """)
    for attempt in range(4):
        r = run_isolated(code, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "exiting", (attempt, r.returncode, r.stderr[-3000:])
        assert "FATAL" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]


# 12. A raising logging handler does not drop the rest of the batch --------------

def test_a_raising_log_handler_does_not_drop_the_rest_of_the_batch():
    # Records made where no entry point delivers them (PyTorch's allocation
    # hook) queue up, and the next entry point delivers them as one batch.
    r = run_isolated("""
        import ctypes, logging, gpuptr
        from gpuptr import _core
        seen = {"first": [], "second": []}
        armed = []
        class Raises(logging.Handler):
            def emit(self, record):
                seen["first"].append(record.getMessage())
                if armed and armed.pop():
                    raise RuntimeError("a handler's own failure")
        class Counts(logging.Handler):
            def emit(self, record):
                seen["second"].append(record.getMessage())
        log = logging.getLogger("gpuptr")
        log.setLevel(logging.DEBUG)
        log.addHandler(Raises()); log.addHandler(Counts())
        lib = ctypes.CDLL(_core.__file__)
        lib.gpuptr_torch_alloc.restype = ctypes.c_void_p
        lib.gpuptr_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.gpuptr_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        gpuptr.context(0)
        # Each a segment of its own (10 MiB and more): records of growth.
        ptrs = [lib.gpuptr_torch_alloc((k + 10) << 20, 0, None) for k in range(10)]
        assert all(ptrs)
        seen["first"].clear(); seen["second"].clear()
        armed.append(True)              # the batch's first record raises
        _core._flush_log()
        print(len(seen["first"]), len(seen["second"]))
        for p in ptrs:
            lib.gpuptr_torch_free(p, 0, 0, None)
    """)
    assert r.returncode == 0, r.stderr
    first, second = map(int, r.stdout.split())
    assert first >= 10 and second == first - 1, (first, second, r.stderr)
    assert "a handler's own failure" in r.stderr  # reported, as unraisable


def test_any_int_is_a_logging_level_for_gpuptr():
    # Python's logging takes any int as a level; passing it on must not
    # raise from setLevel (it once raised OverflowError there).
    log = logging.getLogger("gpuptr")
    before = log.level
    try:
        for level in (2**70, -(2**70), 0, 10**30):
            log.setLevel(level)
            gpuptr.alloc(64).free()
    finally:
        log.setLevel(before)


# 13. Ints past 64 bits get a typed error naming the argument and the range ------

HUGE = [2**63, 2**64, 2**100, -(2**64)]

CALLS = {
    "alloc": (lambda n: gpuptr.alloc(n), "nbytes"),
    "alloc device": (lambda n: gpuptr.alloc(64, device=n), "device"),
    "alloc_host": (lambda n: gpuptr.alloc_host(n), "nbytes"),
    "alloc_managed": (lambda n: gpuptr.alloc_managed(n), "nbytes"),
    "set_pool_limit": (lambda n: gpuptr.set_pool_limit(n), "nbytes"),
    "set_pool_limit device": (lambda n: gpuptr.set_pool_limit(1 << 20, device=n), "device"),
    "reserve": (lambda n: gpuptr.reserve(n), "nbytes"),
    "reserve block_size": (lambda n: gpuptr.reserve(1 << 20, block_size=n), "block_size"),
    "memory_summary": (lambda n: gpuptr.memory_summary(device=n), "device"),
    "context": (lambda n: gpuptr.context(n), "device"),
    "Device": (lambda n: gpuptr.Device(n), "device"),
    "flush_pool": (lambda n: gpuptr.flush_pool(n), "device"),
    "cupy malloc": (lambda n: _core._cupy_malloc(n, 0), "nbytes"),
    "cupy malloc device": (lambda n: _core._cupy_malloc(64, n), "device"),
    "MemoryPointer size": (lambda n: gpuptr.MemoryPointer(None, gpuptr.alloc(64).device_pointer_value, n), "size"),
    "memset count": (lambda n: gpuptr.alloc(64).memset(0, count=n), "count"),
    "copy_from_device count": (lambda n: gpuptr.alloc(64).copy_from_device(gpuptr.alloc(64), count=n), "count"),
    "view start": (lambda n: gpuptr.alloc(64).view(n), "start"),
    "view stop": (lambda n: gpuptr.alloc(64).view(0, n), "stop"),
    "memalloc": (lambda n: gpuptr.context(0).memalloc(n), "size"),
    "register_host_ptr": (lambda n: _core.register_host_ptr(4096, n), "size"),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_ints_past_64_bits_get_a_typed_error_naming_the_argument_and_range(call):
    f, name = CALLS[call]
    for n in HUGE:
        with pytest.raises(gpuptr.InvalidArgumentError) as e:
            f(n)
        msg = str(e.value)
        assert name in msg and ("2**63" in msg or "9223372036854775807" in msg), (n, msg)


def test_the_cupy_hook_refuses_huge_sizes_with_a_typed_error():
    # CuPy's PythonFunctionAllocator passes the size through unchanged.
    with pytest.raises(gpuptr.InvalidArgumentError, match="nbytes"):
        _core._cupy_malloc(2**64, 0, None)
    assert _core._cupy_malloc(0, 0, None) == 0


# Our own adversarial pass ---------------------------------------------------------

@pytest.mark.parametrize("cls", ["PinnedMemory", "MappedMemory"])
def test_numbas_constructor_shape_with_a_read_only_owner_is_read_only(cls):
    # Memory someone pinned without telling gpuptr it is read-only (a raw
    # mempin with no owner), wrapped with its read-only owner.
    src = bytes(bytearray(b"owner" * 100))
    pin = _core.register_host_ptr(_address_of(src), len(src), mapped=True)
    w = getattr(gpuptr, cls)(None, pin.host_pointer, len(src), owner=src)
    assert w.readonly
    with pytest.raises(TypeError):
        memoryview(w)[:4] = b"EVIL"
    if cls == "MappedMemory":
        with pytest.raises(gpuptr.InvalidArgumentError, match="read-only"):
            w.memset(0)
    assert src == b"owner" * 100
    del w
    pin.free()


def test_a_dlpack_export_of_read_only_memory_is_read_only_whatever_the_caller_says():
    src = bytes(bytearray(b"dl" * 128))
    h = gpuptr.register_host(src, mapped=True)
    with pytest.raises(BufferError, match="read-only"):
        _core._dlpack_export(h, [256], None, "uint8", False, None)      # unversioned
    cap = _core._dlpack_export(h, [256], None, "uint8", False, None, max_version=(1, 0))
    imported = _core._import_dlpack(cap)
    assert imported.readonly
    with pytest.raises(gpuptr.InvalidArgumentError, match="read-only"):
        imported.pointer.memset(0)
    # A CAI dict that claims the memory is writable is imported read-only.
    desc = {"shape": (256,), "typestr": "|u1", "version": 3, "data": (h.device_pointer_value, False)}
    assert gpuptr.from_cuda_array_interface(desc).readonly
    assert src == b"dl" * 128


# The pinned cache across a reset on another thread -----------------------------


def test_a_reset_racing_pinned_allocations_never_leaves_a_dead_block_in_the_cache():
    # Threads pin and free while another resets the context over and over.
    # A block pinned in the old context must never reach the new context's
    # cache (the old context's memory is gone once its holders let go: a
    # later alloc_host would hand out freed memory), and the statistics must
    # stay consistent.
    out = run_isolated("""
        import gc, threading
        import gpuptr
        from gpuptr import _core

        STALE = "was reset"
        def host():
            return gpuptr.stats()[0]["host"]

        for round in range(6):
            stop, errors = False, []
            def worker():
                while not stop:
                    try:
                        m = gpuptr.alloc_host(4096)
                    except gpuptr.InvalidPointerError as e:  # a reset storm may outrun the retries
                        assert STALE in str(e), e
                        continue
                    except Exception as e:
                        errors.append(repr(e))
                        return
                    m.free()
                    del m
            threads = [threading.Thread(target=worker) for _ in range(3)]
            for t in threads:
                t.start()
            for _ in range(1500):
                _core.reset_context(0)
            stop = True
            for t in threads:
                t.join()
            assert not errors, errors
            gc.collect()
            assert gpuptr.flush_pool()
            h = host()
            assert (h["live_bytes"], h["live_count"]) == (0, 0), h
            assert h["held_bytes"] == h["cached_bytes"], h
            mems = [gpuptr.alloc_host(4096) for _ in range(64)]
            for m in mems:
                # The driver must know every block handed out: numba's
                # constructor shape asks it whether the range is pinned.
                _core.PinnedMemory(None, m.host_pointer, 4096)
            del mems, m
            gc.collect()
            gpuptr.trim()
            h = host()
            # (Blocks that turned stale stay pinned in the sim: a reset
            # expects the driver's own reset, which takes them, to follow.)
            assert h["held_bytes"] == h["cached_bytes"] == h["pending_bytes"] == 0, h
        print("ok")
    """, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
