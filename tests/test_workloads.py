"""The workloads group (``gpuptr.bench.workloads``, its child
``children/workload.py`` and ``benches/workloads.py``) without a GPU: the
arguments, the rounds' order, the summary, ratios and table on canned
child JSON, the bench's rows, and children that report a missing library
or GPU as a skip. Nothing here measures a workload."""

from __future__ import annotations

import importlib.util
import inspect
import io
import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

import gpuptr
from gpuptr import bench
from gpuptr.bench import workloads as wl

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(str(resources.files("gpuptr.bench.children").joinpath("workload.py")))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _child_module() -> Any:
    spec = importlib.util.spec_from_file_location("workload_child", CHILD)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # main() runs only as a script
    return module


def child(workload: str, allocator: str, round_: Optional[int] = None, *, median: float = 10.0,
          lib: Optional[int] = 1 << 30, live: Optional[int] = 1 << 29, dev: Optional[int] = 2 << 30,
          end: Optional[int] = 3 << 29, released: Optional[int] = 1 << 28, **more: Any) -> Dict[str, Any]:
    """A child's JSON as children/workload.py prints it (trimmed)."""
    rec: Dict[str, Any] = {
        "workload": workload, "allocator": allocator, "steps_ms": [median - 1, median, median + 1],
        "median_ms": median, "peak_lib_bytes": lib, "peak_live_bytes": live, "device_lost_bytes": end,
        "peak_device_lost_bytes": dev, "released_device_lost_bytes": released, "gpuptr": None, "stream_ordered": None, "skipped": None, "error": None,
        "step": "one training step",
    }
    if allocator in wl.GPUPTR_SIDES:
        rec["gpuptr"] = {"alloc_count": 1000, "pool_hits": 990, "pool_misses": 10, "fences": 40}
        rec["stream_ordered"] = allocator == "ordered"
    if round_ is not None:
        rec["round"] = round_
    rec.update(more)
    return rec


# --- registration and the child's own names ---------------------------------


def test_the_group_is_registered_and_has_rows():
    assert "workloads" in bench.GROUPS
    assert callable(wl.rows)


def test_the_child_and_the_parent_agree_on_the_names():
    c = _child_module()
    assert tuple(c.WORKLOADS) == wl.WORKLOADS and tuple(c.ALLOCATORS) == wl.ALLOCATORS
    assert set(c.DEFAULT_STEPS) == set(wl.WORKLOADS)
    assert c.DEFAULT_STEPS["gpt2"] == (8, 30) and c.DEFAULT_STEPS["resnet"] == (15, 40)
    assert (c.CUPY_ARRAYS, c.CUPY_KEEP, c.NUMBA_ROUNDS) == (3000, 20, 2000)
    # The keys a child reads from gpuptr.stats() are DeviceStats's.
    keys = set(gpuptr.DeviceStats.__annotations__)
    assert set(c.GPUPTR_KEYS) <= keys, set(c.GPUPTR_KEYS) - keys


def test_the_child_parses_its_arguments_with_each_workloads_defaults():
    c = _child_module()
    a = c.parse(["gpt2", "own"])
    assert (a.warmup, a.steps) == (8, 30)
    a = c.parse(["cupy", "strict", "--steps", "4", "--warmup", "0"])
    assert (a.workload, a.allocator, a.warmup, a.steps) == ("cupy", "strict", 0, 4)
    for bad in (["gpt3", "own"], ["gpt2", "tlsf"], ["numba", "own", "--steps", "0"]):
        with pytest.raises(SystemExit):
            c.parse(bad)


class _Recorder:
    """A stand-in for a library's module: every attribute path called is
    recorded, in order."""

    def __init__(self, calls: List[str], path: str = "") -> None:
        self._calls, self._path = calls, path

    def __getattr__(self, name: str) -> "_Recorder":
        return _Recorder(self._calls, f"{self._path}.{name}" if self._path else name)

    def __call__(self, *args: Any) -> "_Recorder":
        self._calls.append(self._path)
        return self


@pytest.mark.parametrize("workload, gpuptr_on, expected", [
    ("gpt2", False, ["cuda.synchronize", "cuda.empty_cache"]),
    ("resnet", True, ["cuda.synchronize", "cuda.empty_cache"]),
    ("cupy", True, ["cuda.Device", "cuda.Device.synchronize", "get_default_memory_pool",
                    "get_default_memory_pool.free_all_blocks"]),
    ("numba", False, ["synchronize", "current_context", "current_context.deallocations.clear"]),
    ("numba", True, ["synchronize", "current_context", "current_context.deallocations.clear", "gpuptr:trim"]),
])
def test_the_child_gives_the_cache_back_as_each_librarys_users_do(workload, gpuptr_on, expected):
    c = _child_module()
    calls: List[str] = []
    lib = _Recorder(calls)
    g = _Recorder(calls, "gpuptr:") if gpuptr_on else None
    said = c.release(workload, lib, g)
    assert [x.replace(":.", ":") for x in calls] == expected
    assert ("gpuptr.trim()" in said) == (workload == "numba" and gpuptr_on)


def test_the_childs_stream_rules_are_gpuptr_installs_keywords():
    c = _child_module()
    assert c.stream_rule("gpuptr") == {}
    assert c.stream_rule("strict") == {"stream_ordered": False}
    assert c.stream_rule("ordered") == {"stream_ordered": True}
    assert "stream_ordered" in inspect.signature(gpuptr.install).parameters
    assert c.default_stream_ordered(gpuptr) == wl.default_stream_ordered()


def test_the_childs_log_uniform_sizes_are_seeded_and_in_range():
    c = _child_module()
    sizes = c.log_uniform(0, 3000, 10, 26)
    assert sizes == c.log_uniform(0, 3000, 10, 26)
    assert min(sizes) >= 1 << 10 and max(sizes) <= 1 << 26 and len(set(sizes)) > 2900


class _Driver:
    """cuda.bindings' driver as the child calls it: (CUresult, values...)."""

    def __init__(self, init: int = 0, count: int = 1) -> None:
        self.init, self.count, self.free = init, count, 100 << 30
        self.pushed = 0

    def cuInit(self, flags: int) -> tuple:
        return (self.init,)

    def cuDeviceGetCount(self) -> tuple:
        return (0, self.count)

    def cuDeviceGet(self, i: int) -> tuple:
        return (0, i)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple:
        return (0, "primary")

    def cuCtxPushCurrent(self, ctx: str) -> tuple:
        assert ctx == "primary"
        self.pushed += 1
        return (0,)

    def cuCtxPopCurrent(self) -> tuple:
        self.pushed -= 1
        return (0, "primary")

    def cuMemGetInfo(self) -> tuple:
        assert self.pushed == 1, "cuMemGetInfo needs the context current"
        return (0, self.free, 141 << 30)


def test_the_childs_device_reading_is_the_drop_in_free_memory_with_the_context_pushed():
    c = _child_module()
    d = _Driver()
    mem = c.DeviceMemory(d)
    mem.start()
    d.free -= 5 << 30
    mem.sample()
    d.free += 3 << 30
    assert mem.baseline - mem.sample() == 2 << 30 and mem.baseline - mem.lowest == 5 << 30
    assert mem.total == 141 << 30 and d.pushed == 0


def test_the_child_skips_without_a_device_and_runs_without_readings_on_other_driver_errors(monkeypatch):
    c = _child_module()
    with pytest.raises(c.Skip, match="needs the GPU"):
        c.DeviceMemory(_Driver(init=c.CUDA_ERROR_NO_DEVICE))
    with pytest.raises(c.Skip, match="sees no CUDA device"):
        c.DeviceMemory(_Driver(count=0))
    with pytest.raises(RuntimeError, match="cuInit"):
        c.DeviceMemory(_Driver(init=999))  # e.g. bindings newer than the driver
    result = c.blank("gpt2", "own")

    def fails(driver: Any) -> Any:  # any failure but no GPU: the workload runs without readings
        raise RuntimeError("cuInit(0,): <CUresult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: 803>")

    monkeypatch.setattr(c, "DeviceMemory", fails)
    if _installed("cuda.bindings"):
        assert c.device_memory(result) is None
        assert result["device_memory"].startswith("no readings: RuntimeError: cuInit")


# --- children that cannot run here ------------------------------------------


def _run_child(*args: str) -> Dict[str, Any]:
    out = subprocess.run([sys.executable, "-P", str(CHILD), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    rec: Dict[str, Any] = json.loads(lines[0])
    return rec


@pytest.mark.skipif(_installed("torch"), reason="torch is installed here")
def test_a_child_for_a_missing_library_prints_a_skip_not_a_traceback():
    rec = _run_child("gpt2", "gpuptr")
    assert rec["skipped"].startswith("torch does not import (ModuleNotFoundError"), rec
    assert rec["error"] is None and rec["steps_ms"] == [] and rec["median_ms"] is None
    assert (rec["workload"], rec["allocator"]) == ("gpt2", "gpuptr")


@pytest.mark.skipif(_installed("cupy"), reason="cupy is installed here")
def test_run_child_reads_the_skip_and_keeps_no_stderr_for_it():
    rec = wl.run_child("cupy", "own", steps=1, timeout=120)
    assert rec["skipped"].startswith("cupy does not import") and rec["error"] is None
    assert "stderr_tail" not in rec and rec["child_wall_s"] > 0
    assert wl.reason(rec) == rec["skipped"]


@pytest.mark.skipif(gpuptr.probe_cuda()[0], reason="a CUDA driver is present here")
@pytest.mark.skipif(not _installed("numba_cuda"), reason="needs numba-cuda (to get past the import)")
def test_a_child_without_a_gpu_prints_a_skip_saying_so():
    rec = _run_child("numba", "own", "--steps", "1")
    assert rec["skipped"].startswith("needs the GPU"), rec
    assert rec["error"] is None


def test_a_child_that_dies_or_hangs_is_an_error_with_its_stderr(monkeypatch):
    def died(*a: Any, **k: Any) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(a[0], -11, stdout="", stderr="x" * 5000 + "Segmentation fault")

    monkeypatch.setattr(wl.subprocess, "run", died)
    rec = wl.run_child("gpt2", "own")
    assert rec["error"] == "the child printed no result (killed by signal 11)"
    assert len(rec["stderr_tail"]) == wl.STDERR_TAIL and rec["stderr_tail"].endswith("Segmentation fault")

    def hung(*a: Any, **k: Any) -> subprocess.CompletedProcess:
        raise subprocess.TimeoutExpired(a[0], k["timeout"], stderr=b"step 3\n")

    monkeypatch.setattr(wl.subprocess, "run", hung)
    rec = wl.run_child("gpt2", "own", timeout=7)
    assert rec["error"] == "timed out after 7 s (--timeout)" and rec["stderr_tail"] == "step 3\n"
    assert wl.reason(rec) == "timed out after 7 s (--timeout)"


def test_run_child_takes_the_last_json_line_and_notes_a_bad_exit(monkeypatch):
    good = json.dumps(child("cupy", "own"))
    seen: Dict[str, Any] = {}

    def ran(cmd: List[str], **k: Any) -> subprocess.CompletedProcess:
        seen.update(cmd=cmd, env=k["env"])
        return subprocess.CompletedProcess(cmd, 1, stdout=f"hello\n{good}\nbye {{not json\n", stderr="at exit: boom")

    monkeypatch.setattr(wl.subprocess, "run", ran)
    rec = wl.run_child("cupy", "own", warmup=0, steps=2)
    assert rec["median_ms"] == 10.0 and rec["returncode"] == 1 and rec["stderr_tail"] == "at exit: boom"
    assert seen["cmd"][-6:] == ["cupy", "own", "--warmup", "0", "--steps", "2"]
    assert seen["cmd"][1] == "-P" and seen["cmd"][2].endswith("workload.py")


def test_last_json_skips_what_the_libraries_print_after_it():
    assert wl.last_json('{"a": 1}\n{"b": 2}\nwarning: {x}\n[1, 2]\n') == {"b": 2}
    assert wl.last_json("nothing\n") is None


def test_the_child_env_sets_numbas_manager_only_for_numba(monkeypatch):
    monkeypatch.setenv("NUMBA_CUDA_MEMORY_MANAGER", "somebody.else")
    assert "NUMBA_CUDA_MEMORY_MANAGER" not in wl.child_env("numba", "own")
    assert "NUMBA_CUDA_MEMORY_MANAGER" not in wl.child_env("gpt2", "gpuptr")
    assert wl.child_env("numba", "rmm")["NUMBA_CUDA_MEMORY_MANAGER"] == "rmm.allocators.numba"
    for a in ("gpuptr", "strict", "ordered"):
        assert wl.child_env("numba", a)["NUMBA_CUDA_MEMORY_MANAGER"] == "gpuptr.numba"


# --- the script's arguments --------------------------------------------------


def test_the_scripts_defaults_are_three_rounds_of_everything():
    a = wl.parse_args([])
    assert a.rounds == 3 and a.only == list(wl.WORKLOADS) and a.timeout == 300.0
    assert a.steps is None and a.warmup is None and a.json is None
    # gpuptr's defaults and its other stream rule.
    assert a.allocators == wl.default_allocators()
    assert a.allocators[:3] == ["own", "rmm", "gpuptr"]
    assert a.allocators[3] == ("strict" if wl.default_stream_ordered() else "ordered")


@pytest.mark.parametrize("default, other", [(True, "strict"), (False, "ordered")])
def test_the_other_rule_follows_gpuptrs_default(monkeypatch, default, other):
    def install(numba: bool = True, cupy: bool = True, torch: bool = True, *, stream_ordered: bool = default) -> None:
        pass

    monkeypatch.setattr(gpuptr, "install", install)
    assert wl.default_stream_ordered() is default
    assert wl.default_allocators() == ["own", "rmm", "gpuptr", other]
    assert _child_module().default_stream_ordered(gpuptr) is default


def test_the_scripts_lists_and_numbers(tmp_path):
    a = wl.parse_args(["--rounds", "1", "--only", "cupy, numba,cupy", "--allocators", "own,strict", "--steps", "4",
                       "--warmup", "0", "--timeout", "12.5", "--json", str(tmp_path / "out.json")])
    assert (a.rounds, a.only, a.allocators, a.steps, a.warmup, a.timeout) == (1, ["cupy", "numba"], ["own", "strict"],
                                                                             4, 0, 12.5)


def test_the_script_pins_its_children_to_the_cpus_asked_for(monkeypatch, capsys):
    mine = sorted(os.sched_getaffinity(0))
    assert wl.parse_args(["--cpus", f"{mine[0]}"]).cpus == [mine[0]]
    assert wl.parse_args(["--cpus", f"{mine[0]}-{mine[0]},{mine[0]}"]).cpus == [mine[0]]
    assert wl.parse_args([]).cpus is None
    pinned = []
    monkeypatch.setattr(wl.os, "sched_setaffinity", lambda pid, cpus: pinned.append((pid, list(cpus))))
    monkeypatch.setattr(wl, "gpu_problem", lambda: "no GPU here")
    wl.main(["--rounds", "1", "--only", "cupy", "--allocators", "own", "--cpus", str(mine[-1])])
    assert pinned == [(0, [mine[-1]])], "set once, in the parent, before any child"
    capsys.readouterr()


@pytest.mark.parametrize("argv", [
    ["--only", "gpt3"], ["--only", ""], ["--allocators", "own,tlsf"], ["--rounds", "0"], ["--steps", "x"],
    ["--warmup", "-1"], ["--timeout", "0"], ["--json", "/no/such/dir/out.json"],
    ["--cpus", "x"], ["--cpus", ""], ["--cpus", "3-1"], ["--cpus", "-2"], ["--cpus", "100000"],
])
def test_the_script_refuses_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        wl.parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


# --- the rounds --------------------------------------------------------------


def test_the_rounds_alternate_allocators_and_do_not_retry_a_failed_pair(monkeypatch):
    monkeypatch.setattr(wl, "missing_library", lambda w: "torch is not installed" if w == "resnet" else None)
    monkeypatch.setattr(wl, "_installed", lambda m: False)  # no rmm
    calls: List[tuple] = []

    def run(w: str, a: str, **k: Any) -> Dict[str, Any]:
        calls.append((w, a, k["steps"]))
        if a == "strict":
            return child(w, a, error="Traceback (most recent call last):\n  ...\nRuntimeError: out of memory\n")
        return child(w, a, median=10.0 + len(calls))

    said: List[str] = []
    records = wl.run_rounds(["gpt2", "resnet", "numba"], ["own", "rmm", "gpuptr", "strict"], 2, steps=3,
                            say=said.append, run=run)
    assert calls == [("gpt2", "own", 3), ("gpt2", "gpuptr", 3), ("gpt2", "strict", 3), ("numba", "own", 3),
                     ("numba", "gpuptr", 3), ("gpt2", "own", 3), ("gpt2", "gpuptr", 3), ("numba", "own", 3),
                     ("numba", "gpuptr", 3)]
    skipped = {(r["workload"], r["allocator"]): r["skipped"] for r in records if r["round"] is None}
    assert skipped[("resnet", "gpuptr")] == "torch is not installed"
    assert skipped[("gpt2", "rmm")] == "rmm is not installed"
    assert skipped[("numba", "strict")].startswith("the same as gpuptr for numba")
    assert [r["round"] for r in records if r["round"] is not None] == [1, 1, 1, 1, 1, 2, 2, 2, 2]
    assert "resnet: skipped (torch is not installed)" in said
    assert any("gpt2 under strict: FAILED: RuntimeError: out of memory" in s for s in said)


def test_no_gpu_skips_every_pair_without_a_child():
    def run(*a: Any, **k: Any) -> Dict[str, Any]:
        raise AssertionError("no child without a GPU")

    records = wl.run_rounds(["numba"], ["own", "gpuptr"], 3, gpu="needs the GPU (no driver)", run=run)
    expected = wl.missing_library("numba") or "needs the GPU (no driver)"
    assert [(r["allocator"], r["skipped"], r["round"]) for r in records] == [("own", expected, None),
                                                                             ("gpuptr", expected, None)]


# --- the summary, ratios and table ------------------------------------------


def _records() -> List[Dict[str, Any]]:
    recs = []
    for r, (own, rmm, mine, ordered) in enumerate([(40.0, 43.0, 44.0, 40.0), (42.0, 44.0, 45.0, 40.0),
                                                    (41.0, 45.0, 43.0, 42.0)], 1):
        recs.append(child("gpt2", "own", r, median=own, lib=8 << 30, dev=9 << 30))
        recs.append(child("gpt2", "rmm", r, median=rmm, lib=None, dev=70 << 30))
        recs.append(child("gpt2", "gpuptr", r, median=mine, lib=(9 << 30) - r, dev=9 << 30, released=(5 << 20) * r))
        recs.append(child("gpt2", "ordered", r, median=ordered, lib=8 << 30, dev=9 << 30))
    recs.append(child("cupy", "own", 1, median=300.0, lib=1 << 30, dev=1 << 30))
    recs.append(child("cupy", "gpuptr", 1, median=290.0, lib=1 << 29, dev=1 << 29, error=None))
    recs.append({"workload": "cupy", "allocator": "rmm", "round": None, "skipped": "rmm is not installed", "error": None})
    recs.append(child("cupy", "ordered", 1, error="Traceback...\nValueError: bad\n", median_ms=None))
    return recs


def test_the_summary_is_the_median_of_the_rounds_medians_and_the_most_memory():
    s = wl.summarize(_records())
    g = s[("gpt2", "gpuptr")]
    assert (g["rounds"], g["median_ms"], g["min_ms"], g["max_ms"]) == (3, 44.0, 43.0, 45.0)
    assert g["round_medians_ms"] == [44.0, 45.0, 43.0]
    assert g["by_round"] == {1: 44.0, 2: 45.0, 3: 43.0}
    # Round by round: 44/40, 45/42, 43/41, whose median is 45/42 (the
    # ratio of the medians is 44/41).
    assert wl.paired_ratio(g, s[("gpt2", "own")]) == pytest.approx(45 / 42)
    assert wl.paired_ratio(g, {"by_round": {4: 40.0}}) is None
    assert g["peak_lib_bytes"] == (9 << 30) - 1 and g["gpuptr"]["pool_misses"] == 10
    assert g["released_device_lost_bytes"] == 15 << 20  # the most over rounds
    assert g["stream_ordered"] is False and s[("gpt2", "ordered")]["stream_ordered"] is True
    assert s[("gpt2", "rmm")]["peak_lib_bytes"] is None
    assert s[("cupy", "rmm")]["rounds"] == 0 and s[("cupy", "rmm")]["skipped"] == "rmm is not installed"
    assert s[("cupy", "ordered")]["rounds"] == 0 and s[("cupy", "ordered")]["error"] == "ValueError: bad"
    assert wl.ratio(44.0, 41.0) == pytest.approx(44 / 41)
    assert wl.ratio(None, 1) is None and wl.ratio(1, 0) is None and wl.ratio(1, None) is None


def test_the_table_gives_ratios_to_own_and_flags_gpuptr_only():
    s = wl.summarize(_records())
    table = wl.format_table(s, ["gpt2", "resnet", "cupy"], ["own", "rmm", "gpuptr", "ordered"])
    lines = {tuple(line.split()[:2]): line for line in table.splitlines() if line.split()}
    own, rmm, mine = lines[("gpt2", "own")], lines[("gpt2", "rmm")], lines[("gpt2", "gpuptr")]
    assert "41.00 ms" in own and "40.00-42.00" in own and "1.00x " in own and "8.00 GiB" in own
    # rmm: 44/41 = 1.07 and a 70 GiB device peak (7.78x), not flagged: it is not gpuptr.
    assert "1.07x " in rmm and "7.78x" in rmm and "!" not in rmm and "70.00 GiB" in rmm
    # rmm by round: 43/40, 44/42, 45/41, median 43/40 = 1.075.
    assert rmm.split()[7] in ("1.07x", "1.08x"), rmm
    # gpuptr: 44/41 = 1.07 (over 1.05) and 9/8 = 1.12 of the library's count (over 1.10): flagged.
    assert "(all streams)" in mine and "1.07x!" in mine and "1.12x!" in mine and "1.00x " in mine
    assert mine.split()[8] == "1.07x!", mine  # by round: 45/42
    assert "1000 / 10 / 40" in mine
    # The columns: at end (device), then released (device), the most over rounds.
    assert "released (device)" in table.splitlines()[0]
    assert mine.split()[-7:-5] == ["15.0", "MiB"] and own.split()[-2:] == ["256.0", "MiB"], (mine, own)
    assert "released: still down once the objects went" in table
    assert "! a gpuptr allocator over 1.05x own's median step or 1.10x own's peak" in table
    assert "0.98x" in lines[("gpt2", "ordered")] and "(stream-ordered)" in lines[("gpt2", "ordered")]
    assert lines[("gpt2", "ordered")].split()[8] == "1.00x"  # 40/40, 40/42, 42/41
    assert "!" not in lines[("gpt2", "ordered")]
    # cupy: gpuptr 290/300 and half the memory; rmm skipped; ordered failed.
    assert "0.97x" in lines[("cupy", "gpuptr")] and "0.50x" in lines[("cupy", "gpuptr")]
    assert lines[("cupy", "rmm")].split(None, 3)[3] == "skipped: rmm is not installed"
    assert lines[("cupy", "ordered")].split(None, 3)[3] == "FAILED: ValueError: bad"
    assert ("resnet", "own") not in lines  # not in the records: not in the table
    assert "gpt2: a step is one training step" in table


def test_a_workload_skipped_everywhere_for_one_reason_is_one_line():
    recs = [{"workload": "gpt2", "allocator": a, "round": None, "skipped": "torch is not installed", "error": None}
            for a in ("own", "rmm", "gpuptr")]
    table = wl.format_table(wl.summarize(recs), ["gpt2"], ["own", "rmm", "gpuptr"])
    assert table.splitlines()[1].split() == ["gpt2", "(all)", "0", "skipped:", "torch", "is", "not", "installed"]
    assert len(table.splitlines()) == 2


# --- the bench's rows ---------------------------------------------------------


def test_the_rows_are_gpuptr_against_own_with_the_speed_up_the_bench_way():
    s = wl.summarize(_records())
    step = bench.Result.of("workload gpt2: median step", wl.OWN["gpt2"], wl.step_measured(s, "gpt2"))
    assert (step.gpuptr_ns, step.baseline_ns, step.ratio) == (44e6, 41e6, round(41 / 44, 2))
    assert step.gpuptr_runs == [44e6, 45e6, 43e6] and step.baseline_runs == [40e6, 42e6, 41e6]
    peak = bench.Result.of("workload gpt2: peak memory (library count)", wl.OWN["gpt2"], wl.peak_measured(s, "gpt2"))
    assert (peak.gpuptr_ns, peak.baseline_ns, peak.ratio) == (112.5, 100.0, 0.89)
    assert peak.extra["footprint"]["gpuptr"]["peak_held"] == (9 << 30) - 1
    table = bench.format_table({"meta": {}, "rows": [step.__dict__, peak.__dict__]})
    assert "44000000 ns" in table and "0.93x" in table
    assert "1.12x" in table and "1.00x" in table and "0.89x" in table
    assert "held 9216.0 vs 8192.0 MiB for 512.0 MiB live" in table


def test_a_row_skips_with_the_childs_reason_or_without_a_count():
    s = wl.summarize(_records() + [child("numba", "own", 1, lib=None), child("numba", "gpuptr", 1)])
    with pytest.raises(bench.Skipped, match="^rmm is not installed$"):
        wl._pair({("cupy", "gpuptr"): s[("cupy", "gpuptr")], ("cupy", "own"): s[("cupy", "rmm")]}, "cupy")
    with pytest.raises(bench.Skipped, match="numba's default memory manager keeps no count"):
        wl.peak_measured(s, "numba")
    assert wl.step_measured(s, "numba").gpuptr_ns == 10e6


def test_the_bench_rows_skip_cleanly_without_a_gpu():
    b = bench.Bench(quick=True, out=io.StringIO(), only="workloads", on_gpu=False)
    wl.rows(b)
    assert [r.row for r in b.results] == [f"workload {w}: {what}" for w in wl.WORKLOADS
                                          for what in ("median step", "peak memory (library count)")]
    for r in b.results:
        w = r.row.split()[1].rstrip(":")
        assert r.baseline == wl.OWN[w]
        assert r.skipped == (wl.missing_library(w) or "RuntimeError: needs the GPU"), r
    assert "1 round of child processes" in b.out.getvalue()


def test_a_quick_run_of_every_group_leaves_the_rows_out_without_a_child():
    b = bench.Bench(quick=True, out=io.StringIO(), only=None, on_gpu=True)
    wl.rows(b)
    assert len(b.results) == 8 and {r.skipped for r in b.results} == {wl.QUICK_SKIP}
    b = bench.Bench(quick=False, out=io.StringIO(), only=None, on_gpu=False)
    wl.rows(b)
    assert len(b.results) == 8 and wl.QUICK_SKIP not in {r.skipped for r in b.results}


def test_the_bench_picks_the_rows_by_workload_name():
    b = bench.Bench(quick=True, out=io.StringIO(), only="cupy", on_gpu=False)
    wl.rows(b)
    assert {r.row for r in b.results} == {"workload cupy: median step", "workload cupy: peak memory (library count)"}


# --- the script end to end, children faked ----------------------------------


def test_the_script_prints_the_table_and_writes_every_childs_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(wl, "gpu_problem", lambda: None)
    monkeypatch.setattr(wl, "missing_library", lambda w: None)
    monkeypatch.setattr(wl, "_installed", lambda m: True)

    def run(w: str, a: str, **k: Any) -> Dict[str, Any]:
        return child(w, a, median={"own": 20.0, "rmm": 22.0, "gpuptr": 21.0}.get(a, 20.5))

    out = tmp_path / "w.json"
    rc = wl.main(["--rounds", "2", "--only", "gpt2,numba", "--json", str(out)], run=run)
    assert rc == 0
    text = capsys.readouterr()
    assert "gpt2      own" in text.out and "1.05x" in text.out and "[round 2/2] numba under gpuptr" in text.err
    report = json.loads(out.read_text())
    assert len(report["children"]) == 2 * (4 + 3) + 1  # numba's ordered: one skip record, no child
    assert [(s["workload"], s["allocator"]) for s in report["summary"]][:2] == [("gpt2", "own"), ("gpt2", "rmm")]
    assert report["meta"]["rounds"] == 2 and report["meta"]["allocators"] == wl.default_allocators()


def test_the_script_without_a_gpu_prints_skips_and_exits_1_as_the_bench_does():
    out = subprocess.run([sys.executable, str(ROOT / "benches" / "workloads.py"), "--rounds", "1"],
                         capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                           "GPUPTR_DRIVER": "sim"})
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert "error: nothing could be measured here" in out.stderr
    for w in wl.WORKLOADS:
        assert f"{w}: skipped (" in out.stderr
    assert all("skipped:" in line for line in out.stdout.strip().splitlines()[1:])


# --- lockstep: the children take their steps in turn ------------------------

_RING_CHILD = r"""
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("workload_child", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
turns = m.Turns(os.environ.get(m.TURNS_ENV))
name, steps, log = sys.argv[2], int(sys.argv[3]), sys.argv[4]
for i in range(steps):
    with turns:
        with open(log, "a") as f:  # two lines a step, another child's between them if it ran at once
            f.write(f"{name} {i} start\n"); f.flush(); time.sleep(0.01); f.write(f"{name} {i} end\n")
turns.finish()
print(turns.taken)
"""


def _ring(tmp_path: Path, steps: List[int], first: int = 0) -> Tuple[List[str], List[int]]:
    """Children ``a``, ``b``, ... with ``steps[i]`` steps each, in a ring of
    pipes as run_together makes it; the log of their steps, in order."""
    log = tmp_path / "log"
    n = len(steps)
    ring = [os.pipe() for _ in range(n)]
    procs = []
    for i, k in enumerate(steps):
        inp, out = ring[i][0], ring[(i + 1) % n][1]
        env = dict(os.environ, **{wl.TURNS_ENV: f"{inp},{out}"})
        procs.append(subprocess.Popen([sys.executable, "-c", _RING_CHILD, str(CHILD), "abc"[i], str(k), str(log)],
                                      env=env, pass_fds=(inp, out), stdout=subprocess.PIPE, text=True))
    os.write(ring[first][1], b"t")
    for fds in ring:
        for fd in fds:
            os.close(fd)
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return log.read_text().splitlines(), [int(o) for o in outs]


def test_children_in_a_ring_take_their_steps_one_at_a_time_in_order(tmp_path):
    lines, taken = _ring(tmp_path, [4, 4, 4], first=1)
    steps = [line.rsplit(" ", 1)[0] for line in lines[::2]]
    assert [line.rsplit(" ", 1)[0] for line in lines[1::2]] == steps, "no step began inside another's"
    assert steps == [f"{c} {i}" for i in range(4) for c in "bca"], "b first, then round the ring"
    assert taken == [4, 4, 4]


def test_a_child_that_ends_early_leaves_the_others_to_go_on_alone(tmp_path):
    # b leaves after one step (as a child that failed does): a and c must
    # not wait for it, and finish every step.
    lines, taken = _ring(tmp_path, [5, 1, 5])
    done = [line for line in lines if line.endswith("end")]
    assert sum(line.startswith("a ") for line in done) == 5
    assert sum(line.startswith("c ") for line in done) == 5
    assert taken[1] == 1 and taken[0] >= 1 and taken[2] >= 1


def test_without_the_variable_turns_do_nothing():
    m = _child_module()
    t = m.Turns(None)
    with t:
        pass
    t.finish()
    assert t.taken == 0


def test_run_together_never_waits_on_children_that_skip_and_drops_the_device_readings(monkeypatch):
    # Without the GPU each child skips before its first step: the ring is
    # gone at once, and the parent's token finds no reader.
    monkeypatch.setenv("GPUPTR_DRIVER", "sim")
    recs = wl.run_together("numba", ["own", "gpuptr"], first=1, steps=1, timeout=120)
    assert [r["allocator"] for r in recs] == ["own", "gpuptr"]
    for r in recs:
        assert r["skipped"] and r["error"] is None, r
        assert r["lockstep"] == ["gpuptr", "own"]
        assert all(r.get(k) is None for k in wl.DEVICE_KEYS)


def test_lockstep_rounds_run_every_allocator_together_another_first_each_round(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(wl, "missing_library", lambda w: None)
    monkeypatch.setattr(wl, "gpu_problem", lambda: None)
    groups: List[tuple] = []

    def run_group(w: str, allocators: List[str], *, first: int, **k: Any) -> List[Dict[str, Any]]:
        groups.append((w, tuple(allocators), first))
        order = allocators[first:] + allocators[:first]
        return [child(w, a, median=10.0 if a == "own" else 10.3, dev=None, end=None, released=None,
                      lockstep=order) for a in allocators]

    def run(*a: Any, **k: Any) -> Dict[str, Any]:
        raise AssertionError("lockstep runs no child alone")

    out = tmp_path / "w.json"
    assert wl.main(["--lockstep", "--rounds", "3", "--only", "gpt2", "--allocators", "own,gpuptr",
                    "--json", str(out)], run=run, run_group=run_group) == 0
    assert groups == [("gpt2", ("own", "gpuptr"), 0), ("gpt2", ("own", "gpuptr"), 1), ("gpt2", ("own", "gpuptr"), 0)]
    table = capsys.readouterr().out
    assert "lockstep: a workload's children ran at once" in table
    gp = next(line for line in table.splitlines() if line.startswith("gpt2") and "gpuptr" in line)
    assert "1.03x" in gp and "-" in gp
    report = json.loads(out.read_text())
    assert report["meta"]["lockstep"] is True
    assert all(s["lockstep"] for s in report["summary"])


def test_the_bench_rows_run_gpuptr_and_own_in_lockstep(monkeypatch):
    monkeypatch.setattr(wl, "missing_library", lambda w: None)
    groups: List[tuple] = []

    def run_together(w: str, allocators: List[str], *, first: int, **k: Any) -> List[Dict[str, Any]]:
        groups.append((w, tuple(allocators), first))
        return [child(w, a, median=10.0 if a == "own" else 8.0, lib=(1 << 30) if a == "own" else (1 << 29),
                      dev=None, end=None, released=None) for a in allocators]

    monkeypatch.setattr(wl, "run_together", run_together)
    b = bench.Bench(quick=False, out=io.StringIO(), only="cupy", on_gpu=True)
    monkeypatch.setattr(b, "need_gpu", lambda: None)
    wl.rows(b)
    assert groups == [("cupy", ("own", "gpuptr"), r % 2) for r in range(wl.DEFAULT_ROUNDS)]
    by_row = {r.row: r for r in b.results}
    step = by_row["workload cupy: median step"]
    assert step.skipped is None and (step.gpuptr_ns, step.baseline_ns, step.ratio) == (8e6, 10e6, 1.25)
    assert by_row["workload cupy: peak memory (library count)"].ratio == 2.0
