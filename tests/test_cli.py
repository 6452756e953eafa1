"""The command line: ``check`` and ``bench`` (run as a user would, in a
subprocess with the session's driver)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gpuptr


def _run(*args, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "gpuptr", *args], env=dict(os.environ), capture_output=True, text=True, timeout=timeout
    )


def test_check_passes_and_prints_a_table():
    out = _run("check")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for name in ("driver", "contexts", "alloc", "views", "pool", "host memory", "numba plugin", "CAI import", "IPC"):
        assert any(line.startswith(name) for line in lines), name
    assert "0 failed" in lines[-1]
    if gpuptr.driver_info()["driver"] == "sim":
        assert "simulator" in out.stdout


def test_bench_quick_writes_json_with_positive_ratios(tmp_path):
    path = tmp_path / "bench.json"
    out = _run("bench", "--quick", "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "measuring:" in out.stderr, "progress is shown"
    report = json.loads(path.read_text())
    assert {"date", "driver", "device", "gpuptr"} <= set(report["meta"])
    rows = report["rows"]
    assert len(rows) >= 10
    measured = [r for r in rows if not r["skipped"]]
    assert measured, "at least one row runs here"
    for r in rows:
        assert r["row"] and r["baseline"]
        if r["skipped"]:
            assert r["ratio"] is None and r["skipped"]
        else:
            assert r["gpuptr_ns"] > 0 and r["baseline_ns"] > 0 and r["ratio"] > 0
            # The spread: each run's time, the best of which is the row's.
            for side in ("gpuptr", "baseline"):
                if r[f"{side}_runs"]:
                    assert min(r[f"{side}_runs"]) == r[f"{side}_ns"] <= max(r[f"{side}_runs"])
    observed = {r["row"]: r for r in rows if "tracking on" in r["row"] or "logging on" in r["row"]}
    assert len(observed) == 2 and not any(r["skipped"] for r in observed.values()), observed
    # the table names each baseline
    for r in rows:
        assert r["baseline"] in out.stdout


def test_bench_only_runs_the_rows_it_names():
    out = _run("bench", "--quick", "--only", "TRACKING", "--json", "-")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [r["row"] for r in rows] == ["gpuptr.alloc+free 1 MiB, tracking on"], rows
    assert out.stderr.count("measuring:") == 1


def test_bench_plot_draws_a_png(tmp_path):
    import pytest

    pytest.importorskip("matplotlib")
    png = tmp_path / "ratios.png"
    out = _run("bench", "--quick", "--json", str(tmp_path / "b.json"), "--plot", str(png))
    assert out.returncode == 0, out.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_version_and_help_are_plain_text():
    out = _run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"gpuptr {gpuptr.__version__}"
    out = _run("--help")
    assert out.returncode == 0
    assert "``" not in out.stdout and ":func:" not in out.stdout, "no reStructuredText markup"
    for command in ("check", "info", "bench"):
        assert command in out.stdout
        sub = _run(command, "--help")
        assert sub.returncode == 0 and "usage: gpuptr" in sub.stdout, command


def test_info_json_describes_the_driver_devices_and_pool():
    out = _run("info", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    info = gpuptr.driver_info()
    assert report["driver"]["driver"] == info["driver"]
    assert len(report["devices"]) == info["device_count"] == len(report["stats"])
    assert all(d["total_bytes"] > 0 for d in report["devices"])


def test_check_json_reports_each_check():
    out = _run("check", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["failed"] == 0 and report["passed"] >= 8
    assert {c["name"] for c in report["checks"]} >= {"driver", "pool", "numba plugin"}
    assert all(c["status"] in ("pass", "FAIL", "skip") for c in report["checks"])


def test_bench_writes_no_file_unless_asked(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "gpuptr", "bench", "--quick"],
        env=dict(os.environ), capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert list(tmp_path.iterdir()) == [], "nothing written without --json"
    out = subprocess.run(
        [sys.executable, "-m", "gpuptr", "bench", "--quick", "--json", "-"],
        env=dict(os.environ), capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert out.returncode == 0 and json.loads(out.stdout)["rows"]


def test_bench_exits_non_zero_when_it_measured_nothing(monkeypatch, capsys):
    from gpuptr import bench

    skipped = {"row": "r", "baseline": "b", "gpuptr_ns": None, "baseline_ns": None, "ratio": None,
               "skipped": "needs the GPU", "extra": {}}
    monkeypatch.setattr(bench.runner, "run", lambda quick=False, out=None, only=None: {"meta": {}, "rows": [skipped]})
    assert bench.main(["--quick"]) == 1
    assert "no row could be measured" in capsys.readouterr().err



# --- what a newcomer meets in the first hour: the bench's errors and table ---------

import io  # noqa: E402
import itertools  # noqa: E402
import re  # noqa: E402
import select  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from gpuptr import bench, check, cli  # noqa: E402

NO_LIBCUDA = not gpuptr.probe_cuda()[0]


def _run_env(*args, timeout=900, cwd=None, **env):
    """``_run`` with these variables set (None: unset)."""
    e = dict(os.environ)
    for k, v in env.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    return subprocess.run(
        [sys.executable, "-m", "gpuptr", *args], env=e, capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def _cli_in_child(code, *args):
    """``cli.main(args)`` in a child process, after ``code``."""
    script = f"import sys\n{code}\nfrom gpuptr.cli import main\nraise SystemExit(main({list(args)!r}))\n"
    return subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True,
                          timeout=900)


# 7. bench's files and errors


def test_bench_plot_without_matplotlib_says_how_to_install_it_before_measuring(tmp_path):
    out = _cli_in_child("sys.modules['matplotlib'] = None  # as if not installed",
                        "bench", "--quick", "--plot", str(tmp_path / "r.png"))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "pip install matplotlib" in out.stderr
    assert "measuring:" not in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "r.png").exists()


def test_bench_json_into_a_missing_directory_fails_before_measuring(tmp_path):
    path = tmp_path / "no such dir" / "b.json"
    out = _run("bench", "--quick", "--json", str(path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"the directory {path.parent} does not exist" in out.stderr
    assert "measuring:" not in out.stderr and "Traceback" not in out.stderr


def test_bench_json_naming_a_directory_fails_before_measuring(tmp_path):
    out = _run("bench", "--quick", "--json", str(tmp_path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"--json {tmp_path}: is a directory" in out.stderr
    assert "measuring:" not in out.stderr and "Traceback" not in out.stderr


def test_bench_json_naming_an_empty_name_fails_before_measuring():
    # It wrote nothing and exited 0.
    out = _run("bench", "--quick", "--json", "", timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--json: the file name is empty" in out.stderr
    assert "measuring:" not in out.stderr and "Traceback" not in out.stderr


def test_check_skips_the_pool_row_when_the_pool_is_off():
    # GPUPTR_POOL=0 is a documented setting: its check failed ("freed
    # blocks are reused") and the command exited 1.
    out = _run_env("check", GPUPTR_DRIVER="sim", GPUPTR_POOL="0", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("pool ")]
    assert row.split()[1] == "skip" and "GPUPTR_POOL" in row, row


def test_check_with_no_device_says_so_and_runs_nothing_else():
    # With no device visible the checks failed with an IndexError each. The
    # simulator with no device is a driver that finds none (NoDriverError,
    # as cuInit's CUDA_ERROR_NO_DEVICE).
    out = _run_env("check", GPUPTR_DRIVER="sim", GPUPTR_SIM_DEVICES="0", timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "NoDriverError" in out.stdout and "no CUDA device" in out.stdout, out.stdout
    assert "IndexError" not in out.stdout
    assert "checks were not run: each needs a working driver and a device" in out.stdout


def test_numbas_cuda_simulator_is_skipped_by_install_and_check():
    # Under NUMBA_ENABLE_CUDASIM=1 numba's driver has no memory managers:
    # install() raised AttributeError (and installed nothing else), and
    # check's numba row failed.
    code = "import numba.cuda, gpuptr; print(gpuptr.install()['numba'])"
    env = dict(os.environ, GPUPTR_DRIVER="sim", NUMBA_ENABLE_CUDASIM="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("skipped:") and "NUMBA_ENABLE_CUDASIM" in r.stdout, r.stdout
    out = _run_env("check", GPUPTR_DRIVER="sim", NUMBA_ENABLE_CUDASIM="1", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("numba plugin")]
    assert row.split()[2] == "skip", row


def test_bench_errors_go_through_the_clis_error_handling(monkeypatch, capsys):
    def fails(quick=False, out=None, only=None):
        raise gpuptr.InvalidArgumentError("the bench could not start")

    monkeypatch.setattr(bench.runner, "run", fails)
    assert cli.main(["bench", "--quick"]) == 1
    assert "error: InvalidArgumentError: the bench could not start" in capsys.readouterr().err


def test_bench_plot_to_a_format_matplotlib_cannot_write_fails_before_measuring(tmp_path):
    pytest.importorskip("matplotlib")
    for how in (_run, lambda *a: _cli_in_child("", *a)):
        for name, said in (("p.txt", "matplotlib cannot write .txt files"), ("plot", "name the file with the extension")):
            path = tmp_path / name
            out = how("bench", "--quick", "--plot", str(path))
            assert out.returncode == 2, out.stdout + out.stderr
            assert said in out.stderr and ".png" in out.stderr and ".svg" in out.stderr, out.stderr
            assert "measuring:" not in out.stderr and "Traceback" not in out.stderr
            assert not path.exists()
    # The bench on its own (python -m gpuptr.bench) checks the same.
    out = subprocess.run([sys.executable, "-m", "gpuptr.bench", "--quick", "--plot", str(tmp_path / "p.txt")],
                         env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert out.returncode == 2 and "gpuptr bench: error: --plot" in out.stderr, out.stderr
    assert "measuring:" not in out.stderr


# 8. --only that matches nothing


def test_bench_only_that_matches_no_row_says_so():
    out = _run("bench", "--quick", "--only", "zzz")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no row matches 'zzz'" in out.stderr
    assert "no row could be measured" not in out.stderr and "measuring:" not in out.stderr


# 9. the table


def test_bench_table_says_when_it_ran_on_the_simulator():
    out = _run("bench", "--quick", "--only", "tracking")
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    if gpuptr.driver_info()["driver"] == "sim":
        assert "simulator" in first and "not GPU measurements" in first
    else:
        assert "simulator" not in out.stdout


def _row(name, baseline, ns=None, skipped=None):
    measured = skipped is None
    return {"row": name, "baseline": baseline, "gpuptr_ns": ns if measured else None,
            "baseline_ns": 2 * ns if measured else None, "ratio": 2.0 if measured else None,
            "skipped": skipped, "extra": {}, "gpuptr_runs": [], "baseline_runs": []}


def test_bench_table_columns_align_with_long_names():
    long_name = "a row whose name is much longer than forty characters, as graph rows are"
    report = {"meta": {"driver": "cuda"}, "rows": [
        _row("alloc+free 1 MiB", "cupy.cuda.alloc (CuPy pool)", 512.0),
        _row(long_name, "a baseline whose name is also longer than the old column of forty-four", 123456.0),
        _row("short", "b", skipped="RuntimeError: needs the GPU"),
    ]}
    lines = bench.format_table(report).split("\n\n")[0].splitlines()
    assert len(lines) == 4
    assert len({len(line) for line in lines}) == 1, "the last column (right-aligned) ends at one place"
    # The baseline names start under their heading; the times end at one place.
    col = lines[0].index("baseline")
    for line, name in zip(lines[1:], ("cupy.cuda.alloc", "a baseline", "b ")):
        assert line[col:].startswith(name), (line, name)
    assert lines[1].index("512 ns") + len("512 ns") == lines[2].index("123456 ns") + len("123456 ns")


def test_bench_table_heads_the_speed_up_column_with_the_plots_word():
    lines = bench.format_table({"meta": {"driver": "cuda"}, "rows": [_row("r", "b", 100.0)]}).splitlines()
    assert lines[0].split()[-1] == "speed-up" and lines[1].split()[-1] == "2.00x", lines
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.figure

    drawn = []
    report = {"meta": {"driver": "cuda", "device": "d", "date": "now"}, "rows": [_row("r", "b", 100.0)]}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
        bench.plot(report, "unused.png")
    assert drawn[0].axes[0].get_xlabel().split()[0] == "speed-up"


def test_bench_table_prints_the_pinned_probe_row_whose_extra_has_no_baseline():
    # The probe row's extra holds "probe" and "gpuptr" (no "baseline"): the
    # busy rows' line must not be tried on it (it raised KeyError on the GPU).
    probe = {k: 1000.0 for k in (
        "retain_release_cold_ns", "retain_release_held_ns", "alloc_4k_ns", "alloc_1m_ns", "alloc_4k_portable_ns",
        "alloc_1m_portable_ns", "free_4k_ns", "free_1m_ns", "free_4k_portable_ns", "free_1m_portable_ns",
        "free_while_busy_ns", "busy_left_after_free_ns")}
    row = _row("pinned probe", "old path", 2000.0)
    row["extra"] = {"probe": probe, "gpuptr": {"pair_ns": 2000.0, "first_pairs_ns": [5000.0, 1000.0]}}
    lines = bench.format_table({"meta": {"driver": "cuda"}, "rows": [row]}).splitlines()
    assert len(lines) == 3 and "context retain+release with no other holder 1.0 us" in lines[2], lines
    assert "gpuptr's first pairs 5, 1 us" in lines[2]


def test_bench_table_marks_skipped_rows_and_lists_the_reasons_below():
    report = {"meta": {}, "rows": [
        _row("r1", "b1", skipped="RuntimeError: needs the GPU"),
        _row("r2", "b2", 100.0),
        _row("r3", "b3", skipped="ModuleNotFoundError: No module named 'cupy'"),
        _row("r4", "b4", skipped="RuntimeError: needs the GPU"),
    ]}
    table, _, footer = bench.format_table(report).partition("\n\n")
    assert "(RuntimeError" not in table and "needs the GPU" not in table
    assert [line.split()[-1] for line in table.splitlines()[1:]] == ["[1]", "2.00x", "[2]", "[1]"]
    assert footer.splitlines() == [
        "skipped:",
        "  [1] RuntimeError: needs the GPU (2 rows)",
        "  [2] ModuleNotFoundError: No module named 'cupy' (1 row)",
    ]


def test_bench_row_interleaves_the_runs_of_gpuptr_and_the_baseline():
    b = bench.Bench(quick=True, out=io.StringIO())
    b.n, b.repeat = 10, 4
    calls = []
    b.row("r", "b", lambda: (lambda: calls.append("gpuptr"), lambda: calls.append("baseline")))
    assert calls[:20] == ["gpuptr"] * 10 + ["baseline"] * 10, "a warm-up of each"
    runs = [side for side, _ in itertools.groupby(calls[20:])]
    assert len(runs) >= b.repeat, f"the sides' runs alternate, not all of one then the other: {runs}"
    assert calls.count("gpuptr") == calls.count("baseline")
    (r,) = b.results
    assert len(r.gpuptr_runs) == len(r.baseline_runs) == b.repeat


# 10. help and usage


def test_bench_help_neither_probes_the_driver_nor_prints_notes():
    probe = "import gpuptr\ndef probe():\n    raise AssertionError('probed the driver')\ngpuptr.probe_cuda = probe"
    out = subprocess.run(
        [sys.executable, "-c", f"{probe}\nfrom gpuptr.cli import main\nraise SystemExit(main(['bench', '--help']))"],
        env={k: v for k, v in os.environ.items() if k != "GPUPTR_DRIVER"}, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "usage: gpuptr bench" in out.stdout and "--only" in out.stdout
    assert out.stderr == ""


def test_a_commands_bad_option_prints_that_commands_usage():
    out = _run("info", "--bogus")
    assert out.returncode == 2
    assert "usage: gpuptr info" in out.stderr and "unrecognized arguments: --bogus" in out.stderr


def test_short_version_flag():
    for flag in ("-V", "--version"):
        out = _run(flag)
        assert out.returncode == 0 and out.stdout.strip() == f"gpuptr {gpuptr.__version__}", flag


def test_no_command_is_an_error_that_shows_the_commands():
    out = _run()
    assert out.returncode == 2
    assert "error: no command given" in out.stderr and "usage: gpuptr" in out.stderr
    for command in ("check", "info", "bench"):
        assert re.search(rf"^\s+{command}\s+\S", out.stderr, re.M), command


# 11. no driver, or a bad choice of one


def test_the_fallback_note_does_not_contradict_itself(monkeypatch):
    detail = ("no CUDA driver: libcuda was not found; install the NVIDIA driver (libcuda.so.1 must be on the "
              "loader path), or set GPUPTR_DRIVER=sim to run on gpuptr's simulator")
    monkeypatch.setattr(gpuptr, "probe_cuda", lambda: (False, detail))
    monkeypatch.setenv("GPUPTR_DRIVER", "auto")
    monkeypatch.delenv("GPUPTR_DRIVER")  # restored afterwards
    note = io.StringIO()
    cli._choose_driver(note)
    text = note.getvalue()
    assert "libcuda was not found" in text and "running on gpuptr's simulator" in text
    assert "or set GPUPTR_DRIVER=sim" not in text
    assert os.environ["GPUPTR_DRIVER"] == "sim"


@pytest.mark.skipif(not NO_LIBCUDA, reason="libcuda is present on this machine")
def test_the_fallback_note_as_a_user_sees_it():
    out = _run_env("info", GPUPTR_DRIVER=None)
    assert out.returncode == 0, out.stderr
    assert "running on gpuptr's simulator" in out.stderr and "or set GPUPTR_DRIVER=sim" not in out.stderr


def test_check_stops_after_a_failing_driver_row(monkeypatch):
    ran = []

    def no_driver():
        raise gpuptr.NoDriverError("no CUDA driver: libcuda was not found")

    monkeypatch.setattr(check, "CHECKS", [("driver", no_driver), ("contexts", lambda: ran.append(1) or "ok"),
                                          ("alloc", lambda: ran.append(2) or "ok")])
    out = io.StringIO()
    assert check.run(out=out) == 1
    assert ran == []
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("driver") and "FAIL" in lines[0]
    assert out.getvalue().count("libcuda was not found") == 1
    assert lines[-1] == "0 passed, 1 failed, 0 skipped, 2 not run"
    out = io.StringIO()
    check.run(out=out, as_json=True)
    report = json.loads(out.getvalue())
    assert report["not_run"] == ["contexts", "alloc"] and report["failed"] == 1


@pytest.mark.skipif(not NO_LIBCUDA, reason="libcuda is present on this machine")
def test_check_on_cuda_without_a_driver_reports_it_once():
    out = _run_env("check", GPUPTR_DRIVER="cuda")
    assert out.returncode == 1
    assert out.stdout.count("NoDriverError") == 1, out.stdout
    assert out.stdout.splitlines()[-1].endswith("12 not run")


def test_a_bad_driver_name_is_a_configuration_error():
    for command in ("info", "check", "bench"):
        out = _run_env(command, GPUPTR_DRIVER="bogus")
        assert out.returncode == 2, (command, out.stdout, out.stderr)
        assert "GPUPTR_DRIVER='bogus' is not a driver" in out.stderr and "auto, cuda or sim" in out.stderr
        assert "no CUDA driver" not in out.stderr and "NoDriverError" not in out.stderr
        assert out.stdout == ""


# 12. check on a terminal


def _on_a_terminal(*args, timeout=900):
    """What a terminal shows for ``python -m gpuptr ARGS`` (stdout and
    stderr both on it), and the exit status."""
    import pty

    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "gpuptr", *args], stdin=slave, stdout=slave, stderr=slave,
                         env=dict(os.environ))
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if p.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    rc = p.wait(timeout=60)
    return b"".join(chunks).decode(errors="replace").replace("\r\n", "\n"), rc


def test_check_on_a_terminal_prints_each_check_once():
    text, rc = _on_a_terminal("check")
    assert rc == 0, text
    assert "running:" not in text
    lines = text.splitlines()
    for name, _ in check.CHECKS:
        # (A library's warning printed while its check runs may split the row.)
        rows = [line for line in lines if re.match(rf"{re.escape(name)}\s{{2,}}\S", line)]
        assert len(rows) == 1, (name, text)
    assert re.search(r"^driver\s+pass\s.*\(\d+\.\d s\)$", text, re.M), "a row's time follows it"
    assert "0 failed" in lines[-1]


# 13. info


def test_info_shows_readable_sizes_the_pool_per_process_and_library_versions():
    from importlib import metadata

    out = _run("info")
    assert out.returncode == 0, out.stderr
    assert not re.search(r"\b\d{4,} B\b", out.stdout), "sizes in KiB, MiB, GiB"
    assert "GiB total" in out.stdout or "MiB total" in out.stdout
    assert "per process" in out.stdout and "0 B live" not in out.stdout
    versions = cli.library_versions()
    assert list(versions) == ["numba-cuda", "numba-cuda-mlir", "CuPy", "torch", "cuda-bindings", "cuda-core", "RMM"]
    for name, version in versions.items():
        line = re.search(rf"^\s+{re.escape(name)}\s+(.+)$", out.stdout, re.M)
        assert line, (name, out.stdout)
        assert line.group(1) == (version or "not installed")
    for name, dist in (
        ("numba-cuda", "numba-cuda"),
        ("numba-cuda-mlir", "numba-cuda-mlir"),
        ("torch", "torch"),
        ("cuda-bindings", "cuda-bindings"),
        ("RMM", "rmm-cu13"),
    ):
        try:
            installed = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        assert versions[name] == installed, name
    report = json.loads(_run("info", "--json").stdout)
    assert report["libraries"] == versions
