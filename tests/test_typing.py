"""The type information gpuptr ships is true: ``_core.pyi`` matches the
compiled module (mypy's stubtest), and the package type-checks against it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("mypy", reason="mypy is in the test extra")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ)
    )


def test_the_stubs_match_the_compiled_module():
    # _testing is made by _core; its stub sits beside _core's.
    out = _run(
        "mypy.stubtest",
        "--ignore-disjoint-bases",
        "--ignore-unused-allowlist",
        "--allowlist",
        "tests/stubtest-allowlist.txt",
        "gpuptr._core",
        "gpuptr._testing",
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_package_type_checks_strictly():
    out = _run("mypy", "--strict", "--no-incremental", "python/gpuptr")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_stub_docstrings_are_the_compiled_modules():
    # scripts/stub-docs writes them from the Rust doc comments; --check
    # fails when a doc comment changed and the stub was not regenerated.
    out = subprocess.run(
        [sys.executable, "scripts/stub-docs", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
