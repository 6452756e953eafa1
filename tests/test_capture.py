"""Stream captures and the pool, from Python, on the simulator: the capture
gate (``begin_capture``/``end_capture``, ``capturing()``) and the wrappers
``gpuptr.install()`` puts around CuPy's and PyTorch's capture calls."""

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
