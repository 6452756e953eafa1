"""Stream captures and the pool, from Python, on the simulator: the capture
gate (``begin_capture``/``end_capture``, ``capturing()``) and the wrappers
``gpuptr.install()`` puts around CuPy's and PyTorch's capture calls."""

import os

import pytest

import gpuptr
from gpuptr import _capture

DRIVER = gpuptr.driver_info()["driver"]
pytestmark = pytest.mark.skipif(DRIVER != "sim", reason="the simulator's fence is observable")


def test_capturing_holds_every_fence_until_it_ends():
    m = gpuptr.alloc(4096)
    assert not gpuptr.is_capturing()
    with gpuptr.capturing():
        assert gpuptr.is_capturing(0)
        m.free()
        assert gpuptr.flush_pool(0) is False, "no fence may run during a capture"
        with gpuptr.capturing(0):  # nested
            assert gpuptr.is_capturing()
        assert gpuptr.is_capturing(), "one end per begin"
    assert not gpuptr.is_capturing()
    assert gpuptr.flush_pool(0) is True


def test_capturing_ends_on_the_device_it_began_on_when_the_body_switches_device():
    # The body makes device 1 current; the end must still close device 0's gate.
    gpuptr.context(0).push()
    try:
        with gpuptr.capturing():
            assert gpuptr.is_capturing(0)
            gpuptr.context(1).push()
        assert not gpuptr.is_capturing(0), "device 0's gate must come down"
        assert not gpuptr.is_capturing(1)
        m = gpuptr.alloc(4096, device=0)
        m.free()
        assert gpuptr.flush_pool(0) is True
    finally:
        gpuptr.context(0).push()


def test_an_unbalanced_end_capture_is_refused_and_closes_no_other_threads_gate():
    import threading

    with pytest.raises(gpuptr.InvalidArgumentError, match="no capture begun on this thread"):
        gpuptr.end_capture(0)
    gpuptr.begin_capture(0)
    try:
        got = []
        t = threading.Thread(target=lambda: got.append(_try(gpuptr.end_capture, 0)))
        t.start()
        t.join(30)
        assert isinstance(got[0], gpuptr.InvalidArgumentError), got
        assert gpuptr.is_capturing(0), "another thread closed this thread's gate"
    finally:
        gpuptr.end_capture(0)
    assert not gpuptr.is_capturing(0)


def test_a_thread_that_exits_during_its_capture_ends_it(caplog):
    # Left under way, its capture held every fence back: memory freed was
    # never reused and the device ran out with nothing live.
    import logging
    import threading

    caplog.set_level(logging.WARNING, logger="gpuptr")
    # Ended before join() returns, every time: the core's own record ends
    # it only at the OS thread's exit, up to 8 ms later (11 of 15 runs
    # read it still under way right after the join).
    for _ in range(30):
        t = threading.Thread(target=gpuptr.begin_capture, args=(0,))
        t.start()
        t.join(30)
        assert not gpuptr.is_capturing(0)
    for _ in range(300):
        gpuptr.alloc(8 << 20, device=0).free()
    assert gpuptr.flush_pool(0) is True
    assert any("during a capture it began" in r.getMessage() for r in caplog.records if r.name == "gpuptr")


_FORK_IN_CAPTURE = """
import os, sys, threading, time
import gpuptr

def churn():  # another thread takes the device's capture lock meanwhile
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        gpuptr.begin_capture(0)
        gpuptr.end_capture(0)

other = threading.Thread(target=churn)
other.start()
gpuptr.begin_capture(0)  # open in the forking thread: its record goes to the child
statuses = []
for _ in range(20):
    with gpuptr.capturing(0):
        pid = os.fork()
        if pid == 0:
            pass  # the child leaves the with block, then exits normally
    if pid == 0:
        sys.exit(0)
    end = time.monotonic() + 20
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            statuses.append(os.waitstatus_to_exitcode(status))
            break
        if time.monotonic() > end:
            os.kill(pid, 9)
            statuses.append("hung")
            break
        time.sleep(0.01)
gpuptr.end_capture(0)
other.join()
print(statuses, gpuptr.is_capturing(0))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_child_forked_during_a_capture_exits_cleanly():
    # The child ended the parent's capture as it left the with block (a
    # NoDriverError made its exit status 1), and its exit's thread-local
    # destructor waited for a lock a parent's thread held at the fork, for
    # good (2 of 40 children hung).
    import subprocess
    import sys

    env = dict(os.environ, GPUPTR_DRIVER="sim")
    r = subprocess.run([sys.executable, "-c", _FORK_IN_CAPTURE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{[0] * 20} False", (r.stdout, r.stderr)


def test_is_capturing_without_a_pool():
    # GPUPTR_POOL=0: the device keeps the record of its captures all the
    # same (it read False during a capture).
    import subprocess
    import sys

    code = (
        "import gpuptr\n"
        "gpuptr.begin_capture(0)\n"
        "during = gpuptr.is_capturing(0)\n"
        "gpuptr.end_capture(0)\n"
        "print(during, gpuptr.is_capturing(0))\n"
    )
    env = dict(os.environ, GPUPTR_DRIVER="sim", GPUPTR_POOL="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "True False", (r.stdout, r.stderr)


def _try(f, *args):
    try:
        return f(*args)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e


def test_capturing_rejects_a_device_that_does_not_exist():
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.begin_capture(10_000)
    assert not gpuptr.is_capturing()


class _Stream:
    """Stands in for cupy.cuda.Stream: begin_capture/end_capture methods."""

    fail_begin = False
    fail_end = False

    def begin_capture(self, mode=None):
        if self.fail_begin:
            raise RuntimeError("begin failed")
        self.seen = gpuptr.is_capturing()
        return "began"

    def end_capture(self):
        if self.fail_end:
            raise RuntimeError("end failed")
        return "graph"


def test_wrapped_capture_calls_tell_the_pool_and_always_end():
    class S(_Stream):
        pass

    _capture._wrap(S, "begin_capture", "end_capture", lambda s: 0)
    _capture._wrap(S, "begin_capture", "end_capture", lambda s: 0)  # once per class
    s = S()
    assert s.begin_capture() == "began" and s.seen is True
    assert gpuptr.is_capturing()
    assert s.end_capture() == "graph"
    assert not gpuptr.is_capturing()
    # A failed begin leaves no capture counted; a failed end still ends it.
    s.fail_begin = True
    with pytest.raises(RuntimeError):
        s.begin_capture()
    assert not gpuptr.is_capturing()
    s.fail_begin, s.fail_end = False, True
    s.begin_capture()
    with pytest.raises(RuntimeError):
        s.end_capture()
    assert not gpuptr.is_capturing()
    # An end with no begin (a capture begun before install()) counts nothing.
    s.fail_end = False
    assert s.end_capture() == "graph"
    assert not gpuptr.is_capturing()


def test_a_class_that_cannot_be_wrapped_gets_a_warning_not_an_error(caplog):
    _capture._try_wrap(int, "begin_capture", "end_capture", lambda s: 0)
    assert any("gpuptr.capturing()" in r.getMessage() for r in caplog.records)


def _fresh(n=64):
    """Addresses of ``n`` 4 KiB blocks allocated after a fence (held
    together, so each is a different block)."""
    assert gpuptr.flush_pool(0) is True
    held = [gpuptr.alloc(4096) for _ in range(n)]
    return {m.device_pointer_value for m in held}


class _SimStream:
    """A stream whose captures are the simulator's: as CuPy's Stream, it has
    begin_capture/end_capture (which returns the graph) and a handle."""

    ptr = 0x7E57_0C05

    def begin_capture(self, mode=None):
        from gpuptr import _testing

        _testing.sim_begin_capture(self.ptr)

    def end_capture(self):
        from gpuptr import _testing

        return _testing.sim_end_capture(self.ptr)


def test_a_wrapped_capture_keeps_its_memory_until_the_graph_is_destroyed():
    class S(_SimStream):
        pass

    _capture._wrap(S, "begin_capture", "end_capture", lambda s: 0, lambda s: s.ptr)
    s = S()
    s.begin_capture()
    scratch = gpuptr.alloc(4096)  # an intermediate the graph writes at each replay
    at = scratch.device_pointer_value
    scratch.free()
    out = gpuptr.alloc(4096)  # the graph's output, freed later by its user
    out_at = out.device_pointer_value
    graph = s.end_capture()
    assert not gpuptr.is_capturing()
    out.free()
    assert gpuptr.graph_kept_bytes(0) == 8192
    now = _fresh()
    assert at not in now and out_at not in now, "graph memory reused while the graph can replay"
    graph.destroy()
    now = _fresh()
    assert at in now and out_at in now, "given back once the graph is destroyed"
    assert gpuptr.graph_kept_bytes(0) == 0


def test_a_graph_collected_by_python_gives_its_memory_back():
    class S(_SimStream):
        pass

    _capture._wrap(S, "begin_capture", "end_capture", lambda s: 0, lambda s: s.ptr)
    s = S()
    s.begin_capture()
    gpuptr.alloc(4096).free()
    graph = s.end_capture()
    assert gpuptr.graph_kept_bytes(0) == 4096
    del graph
    assert gpuptr.graph_kept_bytes(0) == 0


def test_capture_started_refuses_a_stream_that_is_not_capturing():
    with pytest.raises(gpuptr.InvalidArgumentError, match="not capturing"):
        gpuptr.capture_started(0x7E57_0C06, 0)
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.capture_started(None, 0)


def test_a_capture_whose_memory_cannot_be_kept_warns_and_goes_on(caplog):
    class S(_SimStream):
        ptr = 0x7E57_0C07

        def begin_capture(self, mode=None):
            pass  # the library "began" nothing the driver knows of

        def end_capture(self):
            return "graph"

    _capture._wrap(S, "begin_capture", "end_capture", lambda s: 0, lambda s: s.ptr)
    s = S()
    s.begin_capture()
    assert gpuptr.is_capturing()
    assert s.end_capture() == "graph"
    assert any("reused while the graph replays" in r.getMessage() for r in caplog.records)
