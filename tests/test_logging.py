"""The Rust core's records in Python's logging (logger ``"gpuptr"``)."""

from __future__ import annotations

import logging
import sys
import threading

import pytest

import gpuptr
from gpuptr import _core


def rust_records(caplog, level=logging.DEBUG):
    _core._flush_log()
    return [r for r in caplog.records if r.name == "gpuptr" and r.pathname.endswith(".rs") and r.levelno >= level]


def test_debug_records_reach_the_gpuptr_logger(caplog):
    caplog.set_level(logging.DEBUG, logger="gpuptr")
    m = gpuptr.alloc(3 << 20)  # a class nothing else in the suite uses
    del m
    gpuptr.flush_pool()
    gpuptr.trim()
    messages = [r.getMessage() for r in rust_records(caplog)]
    assert any("the pool grew by" in s and "3145728-byte allocation" in s for s in messages), messages
    assert any("trim returned" in s for s in messages), messages
    grew = next(r for r in rust_records(caplog) if "the pool grew" in r.getMessage())
    assert grew.funcName == "gpuptr::pool" and grew.pathname.replace("\\", "/").endswith("device/oom.rs") and grew.lineno > 0


def test_fence_records_come_from_the_helper_thread(caplog):
    caplog.set_level(logging.DEBUG, logger="gpuptr")
    gpuptr.alloc(1 << 20).free()
    gpuptr.flush_pool()
    fences = [r for r in rust_records(caplog) if r.funcName == "gpuptr::fence"]
    assert fences and all(r.threadName == "gpuptr-fence" for r in fences)
    assert all("done in" in r.getMessage() for r in fences)


def test_one_free_and_a_flush_log_a_fence_or_two_not_a_flood(caplog):
    # After a fence someone asked for, the fence thread runs fences back to
    # back for a while; a flush waiting meanwhile logged each of them (1 to 18
    # records for one free), where only the asked one and the first the waiter
    # saw tell anything.
    caplog.set_level(logging.DEBUG, logger="gpuptr")
    counts = []
    for _ in range(8):
        caplog.clear()
        gpuptr.alloc(1 << 20).free()
        gpuptr.flush_pool()
        counts.append(sum(r.funcName == "gpuptr::fence" for r in rust_records(caplog)))
    assert all(n <= 2 for n in counts) and sum(counts) > 0, counts


def test_records_below_the_level_are_not_kept(caplog):
    caplog.set_level(logging.WARNING, logger="gpuptr")
    gpuptr.alloc(5 << 20).free()
    gpuptr.trim()
    caplog.set_level(logging.DEBUG, logger="gpuptr")  # delivers what was queued
    assert not [r for r in rust_records(caplog) if "5242880-byte" in r.getMessage() or "trim" in r.getMessage()]


def test_logging_disable_turns_records_off(caplog):
    # No fence of an earlier test still to finish (and log) once DEBUG is on.
    gpuptr.flush_pool()
    caplog.set_level(logging.DEBUG, logger="gpuptr")
    rust_records(caplog)
    caplog.clear()
    logging.disable(logging.CRITICAL)
    try:
        gpuptr.alloc(7 << 20).free()
        gpuptr.trim()
        # The first hand-out after a rest asks for a fence: let it end (and
        # its record be dropped) while logging is still off.
        gpuptr.flush_pool()
    finally:
        logging.disable(logging.NOTSET)
    assert not rust_records(caplog)


@pytest.mark.sim
def test_out_of_memory_recovery_is_logged_at_info(caplog):
    caplog.set_level(logging.INFO, logger="gpuptr")
    total = gpuptr.devices()[1].total_memory
    # A cached block too small for the next request, and too big to leave
    # room for it: the next request runs out, and the cache goes back.
    big = gpuptr.alloc(total // 2, device=1)
    del big
    other = gpuptr.alloc(total * 3 // 4, device=1)
    del other
    gpuptr.trim()
    infos = [r.getMessage() for r in rust_records(caplog, logging.INFO) if r.levelno == logging.INFO]
    assert any("device 1: out of memory" in s and "then succeeded" in s for s in infos), infos


def test_reset_is_logged_at_info(caplog):
    caplog.set_level(logging.INFO, logger="gpuptr")
    gpuptr.alloc(64)
    gpuptr.reset_context(0)
    assert any("context reset" in r.getMessage() for r in rust_records(caplog, logging.INFO))


def test_a_failing_handler_never_breaks_a_gpuptr_call(caplog):
    caplog.set_level(logging.DEBUG, logger="gpuptr")

    class Boom(logging.Handler):
        def emit(self, record):
            raise RuntimeError("handler failed")

    seen = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(u.exc_value)
    h = Boom()
    h.handleError = lambda record: (_ for _ in ()).throw(RuntimeError("handler failed"))  # type: ignore[method-assign]
    logger = logging.getLogger("gpuptr")
    logger.addHandler(h)
    try:
        m = gpuptr.alloc(9 << 20)  # logs, and the call still returns its memory
        assert m.size == 9 << 20
    finally:
        logger.removeHandler(h)
        sys.unraisablehook = old_hook
    assert seen and isinstance(seen[0], RuntimeError)


def test_a_handler_that_calls_gpuptr_does_not_deadlock(caplog):
    caplog.set_level(logging.DEBUG, logger="gpuptr")
    calls = []

    class Reenter(logging.Handler):
        def emit(self, record):
            if len(calls) < 3:
                calls.append(gpuptr.stats()[0]["live_bytes"])
                gpuptr.alloc(11 << 20).free()  # logs again, from inside a handler

    h = Reenter()
    logging.getLogger("gpuptr").addHandler(h)
    try:
        done = threading.Event()
        t = threading.Thread(target=lambda: (gpuptr.alloc(13 << 20).free(), gpuptr.trim(), done.set()))
        t.start()
        t.join(30)
        assert done.is_set(), "a gpuptr call from a handler deadlocked"
    finally:
        logging.getLogger("gpuptr").removeHandler(h)
    assert calls


def test_bench_records_keep_the_pools_records_at_their_level():
    # gpuptr.bench.records.keep, which benches/busy_*.py and footprint_why.py
    # read: a process of its own (it takes the logger over).
    import subprocess

    code = r"""
import logging, gpuptr
from gpuptr.bench.records import keep
debug = keep(logging.DEBUG)
gpuptr.alloc(3 << 20).free()
gpuptr.flush_pool(); gpuptr.trim()
from gpuptr import _core
_core._flush_log()
assert any(lv == "DEBUG" and "the pool grew by" in m for _, lv, m in debug), debug
assert all(isinstance(t, float) and t > 1e9 for t, _, _ in debug)
n = len(debug)
logging.getLogger("gpuptr").setLevel(logging.WARNING)
gpuptr.alloc(5 << 20).free(); gpuptr.trim(); _core._flush_log()
assert len(debug) == n, debug[n:]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert "the pool grew" not in out.stderr, "records stay off the root logger's handlers"
