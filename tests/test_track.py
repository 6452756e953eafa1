"""The leak report: ``gpuptr.track()`` and ``gpuptr.outstanding()``."""

from __future__ import annotations

import ctypes
import gc
import os
import re
import shutil
import subprocess
import sys

import pytest

import gpuptr
from gpuptr import _core


@pytest.fixture
def tracking():
    gpuptr.track()
    yield
    gpuptr.track(False)


def line_of(marker):
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if marker in text and "line_of" not in text)


def sites():
    gc.collect()
    return gpuptr.outstanding()


def test_a_leak_names_this_file_and_line_and_goes_once_freed(tracking):
    leaked = [gpuptr.alloc(12345) for _ in range(2)]  # LEAK-HERE
    report = sites()
    mine = [o for o in report if o["site"].startswith(f"{__file__}:{line_of('LEAK-HERE')} in ")]
    assert len(mine) == 1, report
    assert (mine[0]["count"], mine[0]["bytes"], mine[0]["clients"], mine[0]["devices"]) == (2, 24690, ["direct"], [0])
    assert " <- " in mine[0]["site"], "the callers too"
    del leaked
    assert not [o for o in sites() if o["site"].startswith(f"{__file__}:")]


def test_largest_first_and_off_means_not_listed(tracking):
    small = gpuptr.alloc(1000)
    big = gpuptr.alloc(1 << 20)
    gpuptr.track(False)
    unseen = gpuptr.alloc(5 << 20)
    assert not gpuptr.tracking()
    report = [o for o in sites() if o["site"].startswith(__file__)]
    assert [o["bytes"] for o in report] == [1 << 20, 1000]
    del small, big, unseen


def test_allocator_glue_frames_are_skipped(tracking):
    from gpuptr import numba as _unused  # noqa: F401  (the package's own frames)

    mem = _core._alloc_for("cupy", 4096)  # GLUE-CALLER
    (mine,) = [o for o in sites() if "cupy" in o["clients"]]
    assert mine["site"].startswith(f"{__file__}:{line_of('GLUE-CALLER')}")
    del mem


def test_pytorch_hook_records_the_python_caller_only_when_it_holds_the_gil(tracking):
    _core._hooks_configure(False)
    with_gil = ctypes.PyDLL(_core.__file__)  # keeps the GIL, as a call from Python code would
    without = ctypes.CDLL(_core.__file__)  # drops it, as PyTorch's own threads run
    for lib in (with_gil, without):
        lib.gpuptr_torch_alloc.restype = ctypes.c_void_p
        lib.gpuptr_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.gpuptr_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    a = with_gil.gpuptr_torch_alloc(7000, 0, None)  # HOOK-CALLER
    b = without.gpuptr_torch_alloc(9000, 0, None)
    torch_sites = {o["bytes"]: o["site"] for o in sites() if o["clients"] == ["torch"]}
    assert torch_sites[7000].startswith(f"{__file__}:{line_of('HOOK-CALLER')}")
    assert torch_sites[9000] == "<a PyTorch allocation outside Python>"
    with_gil.gpuptr_torch_free(a, 0, 0, None)
    without.gpuptr_torch_free(b, 0, 0, None)
    assert not [o for o in sites() if o["clients"] == ["torch"]]


def test_gpuptr_track_env_turns_it_on_at_start():
    env = dict(os.environ, GPUPTR_TRACK="1")
    code = "import gpuptr; m = gpuptr.alloc(100); print(gpuptr.tracking(), len(gpuptr.outstanding()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "1"]


# From an attacker's pass ------------------------------------------------------


def test_a_caller_whose_file_name_is_not_utf8_keeps_the_stack(tracking):
    # A path Python read with surrogate escapes (a Latin-1 directory): the
    # whole stack was lost, reported as "<no Python caller>".
    ns = {"gpuptr": gpuptr}
    exec(compile("def f():\n    return gpuptr.alloc(1234)\n", os.fsdecode(b"/nowhere/caf\xe9.py"), "exec"), ns)
    m = ns["f"]()
    (mine,) = [o for o in sites() if o["bytes"] == 1234]
    assert re.match(r"/nowhere/caf\ufffd+\.py:2 in f <- ", mine["site"]), mine["site"]
    assert __file__ in mine["site"]
    m.free()


def test_gpuptr_installed_under_a_path_that_is_not_utf8_names_callers(tmp_path):
    # Every allocation was "<no Python caller>" there.
    home = tmp_path / os.fsdecode(b"site-\xff")
    shutil.copytree(os.path.dirname(gpuptr.__file__), home / "gpuptr")
    code = (
        "import gpuptr\ngpuptr.track()\ndef mine():\n    return gpuptr.alloc(100)\n"
        "m = mine()\nassert gpuptr.__file__.startswith(%r)\nprint(gpuptr.outstanding()[0]['site'])\n" % str(home)
    )
    env = dict(os.environ, PYTHONPATH=str(home))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("<string>:4 in mine <- <string>:5 in <module>"), out.stdout
