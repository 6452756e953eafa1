"""The bench as a package (``gpuptr.bench``): its row groups are
registered, its child scripts run from their files, its rows skip with
their reason, and the scripts of ``benches/`` find what they import from
it. (The command line itself: ``test_cli.py``.)"""

from __future__ import annotations

import ast
import io
import pkgutil
import re
import subprocess
import sys
from importlib import import_module, resources
from pathlib import Path

import pytest

import gpuptr
from gpuptr import bench
from gpuptr.bench import _child

ROOT = Path(__file__).resolve().parent.parent


def test_every_module_with_rows_is_a_registered_group_and_every_group_has_rows():
    with_rows = set()
    for info in pkgutil.iter_modules(bench.__path__):
        module = import_module(f"gpuptr.bench.{info.name}")
        if callable(getattr(module, "rows", None)):
            with_rows.add(info.name)
    assert with_rows == set(bench.GROUPS), "a row module not in GROUPS never runs; a group needs rows(b)"
    assert len(bench.GROUPS) == len(set(bench.GROUPS))


def test_the_child_scripts_are_files_of_the_package_and_each_says_what_it_measures():
    scripts = [p for p in resources.files("gpuptr.bench.children").iterdir() if p.name.endswith(".py")]
    names = {p.name for p in scripts}
    assert {"devarray.py", "lib_alloc.py", "busy.py", "graph.py", "mlir_launch.py", "pinned_cupy.py",
            "pinned_probe.py", "pinned_gpuptr.py"} <= names, names
    for p in scripts:
        tree = ast.parse(p.read_text())
        assert ast.get_docstring(tree), p.name
    # No script shadows a module its imports would find first.
    assert not names & {"numba.py", "cupy.py", "torch.py", "rmm.py", "gpuptr.py"}


def test_a_child_script_runs_from_its_file_and_its_last_line_is_the_result():
    # The pinned pair needs no GPU library: it runs on the simulator too.
    row = _child.child_json("pinned_gpuptr")
    assert len(row["first_pairs_ns"]) == 5 and all(ns > 0 for ns in row["first_pairs_ns"])
    assert row["pair_ns"] > 0 and row["host"]["live_count"] == 0


def test_a_failing_child_gives_its_last_error_line():
    with pytest.raises(RuntimeError, match=r"^devarray.py: no numba package 'nonesuch'$"):
        _child.child_out("devarray", "nonesuch", 1, 1)


def test_manager_env_sets_or_unsets_numbas_manager_and_puts_the_path_first(monkeypatch):
    monkeypatch.setenv("NUMBA_CUDA_MEMORY_MANAGER", "somebody.else")
    monkeypatch.setenv("PYTHONPATH", "/old")
    assert "NUMBA_CUDA_MEMORY_MANAGER" not in _child.manager_env(None)
    env = _child.manager_env("gpuptr.numba", "/benches")
    assert env["NUMBA_CUDA_MEMORY_MANAGER"] == "gpuptr.numba"
    assert env["PYTHONPATH"].split(":") == ["/benches", "/old"]


def _bench(only=None):
    return bench.Bench(quick=True, out=io.StringIO(), only=only)


def test_measure_keeps_what_the_row_measured_rounded_with_its_speed_up():
    b = _bench()
    b.measure("r", "b", lambda: bench.Measured(100.04, 250.0, extra={"k": 1}))
    (r,) = b.results
    assert (r.gpuptr_ns, r.baseline_ns, r.ratio, r.skipped, r.extra) == (100.0, 250.0, 2.5, None, {"k": 1})
    assert "measuring: r vs b ..." in b.out.getvalue()


def test_measure_skips_a_row_whose_measurement_raises_with_the_reason():
    b = _bench()
    b.on_gpu = False

    def needs_gpu():
        b.need_gpu()
        raise AssertionError("not reached")

    b.measure("r1", "b", needs_gpu)
    b.measure("r2", "b", lambda: (_ for _ in ()).throw(ImportError("No module named 'cupy'")))
    b.measure("r3", "b", lambda: _child.pick({}, {"own": "RuntimeError: child failed"}, "gpuptr", "own"))
    assert [r.skipped for r in b.results] == [
        "RuntimeError: needs the GPU",
        "ImportError: No module named 'cupy'",
        "RuntimeError: child failed",  # a reason given as it stands (Skipped)
    ]
    assert all(r.ratio is None and r.gpuptr_ns is None for r in b.results)


def test_only_picks_a_measured_row_by_its_name_baseline_or_labels():
    b = _bench(only="IPC")
    ran = []

    def fn():
        ran.append(1)
        return bench.Measured(1.0, 1.0)

    b.measure("export", "first", fn)
    b.measure("export", "first", fn, labels=("ipc",))
    b.measure("r", "ipc baseline", fn)
    assert len(ran) == 2 and len(b.results) == 2


def test_the_rows_rounds_pick_the_best_of_each_allocator_and_stop_trying_a_failed_one():
    calls = []

    def measure(lib, allocator, n, repeat):
        calls.append(allocator)
        if allocator == "broken":
            raise RuntimeError("no pool")
        return {"gpuptr": [300.0, 200.0, 250.0], "own": [400.0, 500.0, 450.0]}[allocator][calls.count(allocator) - 1]

    best, failed = _child.best_of_rounds("json", ["gpuptr", "own", "broken"], 3, 10, 1, True, measure)
    assert best == {"gpuptr": 200.0, "own": 400.0} and failed == {"broken": "RuntimeError: no pool"}
    assert calls.count("broken") == 1 and calls.count("gpuptr") == 3
    m = _child.pick(best, failed, "gpuptr", "own")
    assert (m.gpuptr_ns, m.baseline_ns) == (200.0, 400.0)
    with pytest.raises(bench.Skipped, match="^RuntimeError: no pool$"):
        _child.pick(best, failed, "gpuptr", "broken")


def test_the_benches_scripts_find_what_they_import_from_the_bench():
    # Their own imports and those of the child scripts they hold as text.
    found = 0
    for script in sorted((ROOT / "benches").glob("*.py")):
        for module, names in re.findall(r"from (gpuptr\.bench[\w.]*) import ([\w, ]+)", script.read_text()):
            mod = import_module(module)
            for name in (n.strip() for n in names.split(",")):
                assert hasattr(mod, name), (script.name, module, name)
                found += 1
    assert found >= 5


def test_the_old_module_level_names_stay_importable():
    for name in ("best_ns", "runs_ns", "interleaved_runs_ns", "busy_devarray", "library_alloc_ns", "Bench", "Result",
                 "format_table", "plot", "run", "main", "DESCRIPTION", "add_arguments", "check_arguments",
                 "run_command"):
        assert hasattr(bench, name), name
    assert gpuptr.bench is bench


def test_cupy_why_folds_py_spys_raw_stacks_into_shares(tmp_path):
    # py-spy's raw format: frames joined by ";", then the sample count.
    (tmp_path / "gpuptr.txt").write_text(
        "main (python);hook (_core.abi3.so);Arena::take (_core.abi3.so) 30\n"
        "main (python);launch (libcuda.so) 10\n"
    )
    r = subprocess.run([sys.executable, str(ROOT / "benches" / "cupy_why.py"), "--fold", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = [ln.split() for ln in r.stdout.splitlines()]
    assert ["==", "gpuptr:", "40", "samples;"] == lines[0][:4]
    shares = {ln[-1]: float(ln[0]) for ln in lines[1:] if ln and ln[0][0].isdigit()}
    assert shares["_core.abi3.so"] == 75.0 and shares["libcuda.so"] == 25.0 and shares["python"] == 100.0
    assert "own" not in r.stdout  # no file for it: nothing said
