"""The repository's scripts: what they say while they run, and what they need."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"

pytestmark = pytest.mark.skipif(not (SCRIPTS / "test").is_file(), reason="needs gpuptr's source tree (scripts/)")

# A stand-in for cargo and python that says it ran and what it was asked.
FAKE = """#!/usr/bin/env bash
echo "RAN $(basename "$0") $*"
if [ "$(basename "$0")" = python3 ] && [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  printf 'PATH="%s:$PATH"\\n' "$FAKES" > "$3/bin/activate"
fi
"""


def test_scripts_test_names_each_step_before_it_runs_it(tmp_path):
    """./scripts/test builds for minutes with --quiet tools: it says which
    step it is on (and the time so far) before each one."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    (tree / "scripts" / "test").write_text((SCRIPTS / "test").read_text())
    (tree / "scripts" / "test").chmod(0o755)
    fakes = tmp_path / "bin"
    fakes.mkdir()
    for name in ("cargo", "python3", "python"):
        (fakes / name).write_text(FAKE)
        (fakes / name).chmod(stat.S_IRWXU)
    env = {**os.environ, "PATH": f"{fakes}:/usr/bin:/bin", "FAKES": str(fakes)}
    out = subprocess.run(
        ["bash", str(tree / "scripts" / "test"), "-k", "x"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("== scripts/test ")]
    assert [re.match(r"== scripts/test (\d)/5 \(\dm\d\ds\): ", lines[i])[1] for i in steps] == list("12345")
    ran = [line for line in lines if line.startswith("RAN ")]
    # Each step's line comes before the commands of that step.
    assert lines[steps[0] + 1] == "RAN cargo test --quiet"
    assert lines[steps[1] + 1] == "RAN cargo bench --no-run --quiet"
    assert lines[steps[2] + 1] == "RAN python3 -m venv .venv"
    assert lines[steps[3] + 1] == 'RAN python -m pip install --quiet .[test]'
    assert lines[steps[4] + 1] == "RAN python -m pytest -q -k x tests"
    assert len(ran) == 7 and re.fullmatch(r"== scripts/test: done in \dm\d\ds", lines[-1]), lines


def test_no_script_points_outside_the_repository():
    for script in SCRIPTS.iterdir():
        assert "../shared" not in script.read_text(), script.name
        assert "shared/device" not in script.read_text(), script.name


def _tracked() -> list:
    """The repository's files (git's list where there is one, else a walk)."""
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [ROOT / n for n in names.splitlines() if (ROOT / n).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "target", ".whl", ".whl-mlir", "__pycache__"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def test_nothing_in_the_tree_points_outside_it():
    """No file leads to a folder beside the checkout; these tests name the
    string only to look for it."""
    here = {Path(__file__).resolve(), (ROOT / "tests" / "test_readme.py").resolve()}
    found = []
    for path in _tracked():
        if path.resolve() in here:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if "../shared" in text or "shared/device" in text:
            found.append(str(path.relative_to(ROOT)))
    assert found == []


def test_the_gpu_how_to_is_in_contributing_and_its_scripts_exist():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    gpu = text.split("## Working on the GPU\n", 1)[1]
    for need in ("numpy 2.4.6", "numba-cuda 0.30.4", "filecheck", "RMM", "numba-cuda-mlir", "dask-cuda"):
        assert need in gpu, need
    for script in set(re.findall(r"`(scripts/[\w-]+)", text)):
        assert (ROOT / script).is_file() and os.access(ROOT / script, os.X_OK), script
    assert "scripts/gpu-wheels" in gpu


def test_gpu_wheels_refuses_an_unknown_part_before_building_anything(tmp_path):
    out = subprocess.run(
        [str(SCRIPTS / "gpu-wheels"), "base", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "no part 'nope' (base, dask, mlir)" in out.stderr, out.stderr
    assert out.stdout == ""
