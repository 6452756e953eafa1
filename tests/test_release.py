"""``scripts/release`` fails when ``python -m gpuptr check`` fails.

The release build itself takes minutes, so these tests source the script
(which then only defines its functions) and drive ``check_installed``, the
step that runs the check in each fresh venv, with a stand-in Python whose
``-m gpuptr check`` passes or fails on demand."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

RELEASE = Path(__file__).resolve().parent.parent / "scripts" / "release"

pytestmark = pytest.mark.skipif(not RELEASE.is_file(), reason="needs gpuptr's source tree (scripts/release)")


def _fake_python(tmp_path: Path, summary: str, rc: int) -> Path:
    """An executable that prints a check table ending in ``summary`` and
    exits with ``rc``, whatever its arguments."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho 'driver  FAIL  no driver'\necho '{summary}'\nexit {rc}\n")
    fake.chmod(0o755)
    return fake


def _source_and_check(fake: Path) -> subprocess.CompletedProcess:
    # Sourced without its guard, the script would run the whole release.
    assert 'if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then' in RELEASE.read_text(), "sourcing would build"
    # As in the script's main: a plain call under the script's `set -e`,
    # then a line that runs only if the call did not stop the script.
    script = 'source "$1"; check_installed "$2" gpuptr-0.1.0.whl; echo "went on"'
    return subprocess.run(
        ["bash", "-c", script, "bash", str(RELEASE), str(fake)],
        capture_output=True, text=True, timeout=60, cwd=fake.parent,
    )


def test_release_stops_when_the_check_fails(tmp_path):
    out = _source_and_check(_fake_python(tmp_path, "0 passed, 12 failed, 1 skipped", 1))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "release: gpuptr-0.1.0.whl: 0 passed, 12 failed, 1 skipped" in out.stdout
    assert "went on" not in out.stdout, "set -e saw the failure"
    assert "driver  FAIL" in out.stderr and "check failed (exit 1)" in out.stderr


def test_release_goes_on_when_the_check_passes(tmp_path):
    out = _source_and_check(_fake_python(tmp_path, "9 passed, 0 failed, 4 skipped", 0))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "release: gpuptr-0.1.0.whl: 9 passed, 0 failed, 4 skipped" in out.stdout
    assert "went on" in out.stdout and out.stderr == ""


def test_release_runs_the_check_through_check_installed():
    # The one call that matters is a plain command, not a substitution
    # (inside `$( )` or a pipe, set -e never sees the check's status).
    text = RELEASE.read_text()
    main = text[text.index("main() {") :]
    assert 'check_installed "$tools/try/bin/python"' in main
    assert "$(GPUPTR_DRIVER=sim" not in main and "gpuptr check |" not in main
