"""The Rust that gpuptr says it builds with (``rust-version`` in Cargo.toml,
and the README's requirements, which ``test_readme.py`` holds to it) is the
Rust its locked dependencies need: the highest ``rust-version`` among the
packages of Cargo.lock, with every feature (the ``python`` one brings
PyO3), as ``cargo metadata`` reads them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.skipif(not (ROOT / "Cargo.lock").is_file(), reason="needs gpuptr's source tree (Cargo.lock)"),
    pytest.mark.skipif(shutil.which("cargo") is None, reason="needs cargo"),
]


def _version(text: str) -> tuple[int, ...]:
    parts = [int(p) for p in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_rust_version_is_the_highest_that_a_locked_dependency_needs():
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--all-features", "--locked"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    meta = json.loads(out.stdout)
    root = meta["resolve"]["root"]
    needs = {
        (p["name"], p["version"]): p["rust_version"]
        for p in meta["packages"]
        if p["id"] != root and p.get("rust_version")
    }
    assert needs, "no locked dependency states its Rust"
    highest = max(needs.values(), key=_version)
    by = sorted(f"{n} {v}" for (n, v), r in needs.items() if _version(r) == _version(highest))
    cargo = (ROOT / "Cargo.toml").read_text()
    ours = re.search(r'^rust-version = "([\d.]+)"', cargo, flags=re.M)[1]
    assert _version(ours) == _version(highest), f"Cargo.toml says {ours}; {', '.join(by)} need {highest}"
