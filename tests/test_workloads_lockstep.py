"""``run_together`` and the children's ``Turns`` ring (``--lockstep``) when
children fail, linger, or the parent is interrupted: no child outlives the
parent's run, and no failure holds the others up."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest

from gpuptr.bench import workloads as wl

CHILD = Path(str(resources.files("gpuptr.bench.children").joinpath("workload.py")))

# A stand-in for children/workload.py: the real Turns, steps that take
# FAKE_STEP_S, and per allocator (FAKE_BEHAVE, JSON) a way to fail.
_FAKE_CHILD = r"""
import importlib.util, json, os, sys, time
spec = importlib.util.spec_from_file_location("workload_child", os.environ["FAKE_REAL_CHILD"])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
workload, allocator = sys.argv[1], sys.argv[2]
how = json.loads(os.environ.get("FAKE_BEHAVE", "{}")).get(allocator, {})
step_s = float(os.environ.get("FAKE_STEP_S", "0.01"))
if how.get("exit_now") is not None:
    os._exit(how["exit_now"])
if how.get("sleep_first"):
    time.sleep(how["sleep_first"])
if how.get("raise_in_step") is not None:
    # The real main(), its run() replaced: a step raises inside `with TURNS`,
    # main() reports the error; then the process takes a while to end (a
    # library's teardown).
    def run(args, result):
        for i in range(how.get("steps", 5)):
            with m.TURNS:
                if i == how["raise_in_step"]:
                    raise RuntimeError("the step failed (an out-of-memory, say)")
                time.sleep(step_s)
        m.TURNS.finish()
    m.run = run
    m.main(["numba", allocator, "--steps", "1"])
    time.sleep(how.get("linger", 0))
    sys.exit(0)
turns = m.Turns(os.environ.get(m.TURNS_ENV))
if how.get("spawn"):
    os.system(how["spawn"])  # a helper process the child starts (fork + exec)
t0 = time.perf_counter()
for i in range(how.get("steps", 5)):
    with turns:
        time.sleep(step_s)
        if how.get("die_in_step") == i:
            os._exit(1)
turns.finish()
print(json.dumps({"workload": workload, "allocator": allocator, "steps_ms": [1.0],
                  "median_ms": 1.0, "turns": turns.taken, "pid": os.getpid(),
                  "ring_s": time.perf_counter() - t0}))
"""


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """run_together starts the stand-in child; returns a setter for the
    children's behaviour."""
    (tmp_path / "workload.py").write_text(_FAKE_CHILD)
    monkeypatch.setattr(wl, "resources", SimpleNamespace(files=lambda pkg: tmp_path, as_file=contextlib.nullcontext))
    monkeypatch.setenv("FAKE_REAL_CHILD", str(CHILD))

    def behave(**how: Dict[str, Any]) -> None:
        monkeypatch.setenv("FAKE_BEHAVE", json.dumps(how))

    return behave


def _record_popens(monkeypatch) -> List[subprocess.Popen]:
    procs: List[subprocess.Popen] = []
    real = subprocess.Popen

    class Popen(real):  # type: ignore[misc,valid-type]
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            procs.append(self)

    monkeypatch.setattr(wl.subprocess, "Popen", Popen)
    return procs


def _alive(p: subprocess.Popen) -> bool:
    return p.poll() is None


def _kill_all(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        with contextlib.suppress(OSError):
            p.kill()
        with contextlib.suppress(Exception):
            p.wait(timeout=10)


# --- guards: what the ring already survives ---------------------------------


def test_a_child_that_never_starts_leaves_the_others_to_finish(fake, monkeypatch):
    fake()
    real = subprocess.Popen

    def popen(args: List[str], *a: Any, **k: Any) -> subprocess.Popen:
        if "gpuptr" in args:
            raise OSError(24, "Too many open files")
        return real(args, *a, **k)

    monkeypatch.setattr(wl.subprocess, "Popen", popen)
    recs = wl.run_together("numba", ["own", "gpuptr", "gpuptr_stream"], timeout=30)
    assert "could not start" in recs[1]["error"]
    for r in (recs[0], recs[2]):
        assert r["error"] is None and r["median_ms"] == 1.0, r


def test_a_child_that_dies_holding_the_token_leaves_the_others_to_finish(fake):
    fake(gpuptr={"die_in_step": 1})
    recs = wl.run_together("numba", ["own", "gpuptr", "gpuptr_stream"], timeout=30)
    assert "exit status 1" in recs[1]["error"]
    for r in (recs[0], recs[2]):
        assert r["error"] is None and r["median_ms"] == 1.0, r


def test_a_ring_of_one_child_passes_the_token_to_itself(fake):
    fake()
    (rec,) = wl.run_together("numba", ["gpuptr"], timeout=30)
    assert rec["error"] is None and rec["turns"] == 5, rec


# --- findings ---------------------------------------------------------------


def test_an_interrupt_while_the_parent_waits_kills_the_children(fake, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) in ``proc.wait``: run_child's
    ``subprocess.run`` kills its child on any exception; run_together
    leaves every child running (GPU workloads in the background)."""
    fake(own={"sleep_first": 60}, gpuptr={"sleep_first": 60})
    procs = _record_popens(monkeypatch)
    real_wait = subprocess.Popen.wait

    def wait(self: subprocess.Popen, timeout: Any = None) -> int:
        if timeout is not None:
            raise KeyboardInterrupt
        return real_wait(self, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", wait)
    try:
        with pytest.raises(KeyboardInterrupt):
            wl.run_together("numba", ["own", "gpuptr"], timeout=30)
        monkeypatch.setattr(subprocess.Popen, "wait", real_wait)
        time.sleep(0.5)
        orphans = [p.pid for p in procs if _alive(p)]
    finally:
        monkeypatch.setattr(subprocess.Popen, "wait", real_wait)
        _kill_all(procs)
    assert orphans == [], f"children {orphans} still run after the parent was interrupted"


def test_a_failure_to_make_a_childs_output_file_neither_raises_nor_orphans_the_others(fake, monkeypatch):
    """``tempfile.TemporaryFile()`` sits outside the ``try`` around Popen:
    its OSError (EMFILE, say) for the second child escapes run_together
    (whose records promise run_child's "never raises") and the first child,
    already started, is never waited for or killed."""
    fake(own={"sleep_first": 60})
    procs = _record_popens(monkeypatch)
    real_tf = tempfile.TemporaryFile
    calls = [0]

    def temporary_file(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:  # the second child's stdout
            raise OSError(24, "Too many open files")
        return real_tf(*a, **k)

    monkeypatch.setattr(wl.tempfile, "TemporaryFile", temporary_file)
    raised = None
    try:
        try:
            wl.run_together("numba", ["own", "gpuptr"], timeout=5)
        except OSError as e:
            raised = e
        orphans = [p.pid for p in procs if _alive(p)]
    finally:
        _kill_all(procs)
    assert raised is None and orphans == [], f"raised {raised!r}; children {orphans} left running"


def test_a_child_that_raises_in_a_step_does_not_hold_the_others_up_while_it_ends(fake, monkeypatch):
    """An exception inside ``with TURNS:`` passes the token on, but main()
    never leaves the ring (``TURNS.finish()`` is skipped): the child keeps
    its ends open until its process ends, so the next time the token comes
    round to it, the others wait out its teardown (here 6 s; a teardown
    that hangs holds them until the group's timeout, and their results are
    lost with it)."""
    monkeypatch.setenv("FAKE_STEP_S", "0.02")
    fake(gpuptr={"raise_in_step": 1, "linger": 6})
    recs = wl.run_together("numba", ["own", "gpuptr"], timeout=60)
    own = recs[0]
    assert own["error"] is None, own
    assert own["ring_s"] < 3, f"own's 5 steps of 20 ms took {own['ring_s']:.1f} s in the ring"


def test_a_helper_process_of_a_dead_child_does_not_keep_the_ring_alive(fake):
    """The ring's descriptors are inheritable in the child (``pass_fds``):
    a process it starts (``os.system``, a fork-started worker pool) holds
    them too, so when the child dies its neighbours' pipes neither read
    empty nor refuse a write while that process lives."""
    fake(gpuptr={"spawn": "sleep 12 &", "die_in_step": 1})
    t0 = time.perf_counter()
    recs = wl.run_together("numba", ["own", "gpuptr"], timeout=8)
    took = time.perf_counter() - t0
    assert recs[0]["error"] is None, f"own failed after {took:.1f} s: {recs[0]['error']}"


def test_a_child_that_crashed_is_not_reported_as_timed_out(fake):
    """Once one child times out, every child without JSON is reported as
    timed out, one that crashed long before (exit status 3) included."""
    fake(own={"exit_now": 3}, gpuptr={"sleep_first": 30})
    recs = wl.run_together("numba", ["own", "gpuptr"], timeout=3)
    assert "timed out" in recs[1]["error"]
    assert "exit status 3" in recs[0]["error"], recs[0]["error"]
