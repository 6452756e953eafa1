"""The README's examples run as they are printed.

Every ```python block runs on the simulator (``GPUPTR_DRIVER=sim``, its
default size) in a fresh process, from a file in an empty directory (named
by the block's first line when that is a ``# name.py`` comment). A block
that needs CuPy, PyTorch, numba-cuda, Dask or a GPU says so on the line
right before it, ``<!-- readme-test: skip (why) -->``, and is skipped with
that reason. The Rust block is ``examples/readme.rs``, which ``cargo test``
builds and runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = re.compile(r"<!-- readme-test: skip \((?P<why>[^)]+)\) -->")
#: At least this many Python blocks run (those that need only gpuptr).
CORE_BLOCKS = 5

pytestmark = pytest.mark.skipif(not README.is_file(), reason="needs gpuptr's source tree (README.md)")


class Block(NamedTuple):
    line: int  # of the opening fence, from 1
    lang: str
    code: str
    skip: Optional[str]  # the marker's reason


def blocks(lang: str) -> List[Block]:
    """The README's fenced blocks in ``lang`` (fences at the start of a line)."""
    if not README.is_file():
        return []
    lines = README.read_text().splitlines()
    found = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("```") and lines[i][3:].strip():
            start, tag = i, lines[i][3:].strip()
            i += 1
            while not lines[i].startswith("```"):
                i += 1
            if tag == lang:
                m = MARKER.fullmatch(lines[start - 1].strip()) if start else None
                found.append(Block(start + 1, tag, "\n".join(lines[start + 1 : i]) + "\n", m and m["why"]))
        i += 1
    return found


PYTHON = blocks("python")


def _env() -> dict:
    """A user's environment on the simulator: none of the test session's
    other gpuptr or numba settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUPTR_", "NUMBA_CUDA_MEMORY_MANAGER"))}
    env["GPUPTR_DRIVER"] = "sim"
    return env


@pytest.mark.parametrize("block", PYTHON, ids=[f"line-{b.line}" for b in PYTHON])
def test_each_python_block_runs_on_the_simulator(block, tmp_path):
    if block.skip:
        pytest.skip(block.skip)
    first = block.code.splitlines()[0]
    name = first[2:].strip() if re.fullmatch(r"# [\w-]+\.py", first) else "example.py"
    (tmp_path / name).write_text(block.code)
    out = subprocess.run(
        [sys.executable, name], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"README.md line {block.line}:\n{block.code}\n{out.stdout}{out.stderr}"


def test_the_core_blocks_run_and_each_skip_says_why():
    text = README.read_text()
    markers = [line for line in text.splitlines() if "readme-test" in line]
    assert all(MARKER.fullmatch(m.strip()) for m in markers), markers
    # Each marker is right before a python block (else it marks nothing).
    assert len(markers) == sum(1 for b in PYTHON if b.skip), "a marker not right before a ```python block"
    run = [b for b in PYTHON if not b.skip]
    assert len(run) >= CORE_BLOCKS, f"only {len(run)} of {len(PYTHON)} python blocks run"


def test_the_rust_block_is_the_example_that_cargo_test_runs():
    (block,) = blocks("rust")
    example = (ROOT / "examples" / "readme.rs").read_text()
    body = example.split("// README: begin\n", 1)[1].split("// README: end\n", 1)[0]
    assert block.code == body, "README.md's Rust block and examples/readme.rs differ"
    inline = re.search(r"`(Runtime::new\(.*?\))\?`", README.read_text())
    assert inline and inline[1] in example, "the README's simulator runtime is the example's"


def test_the_try_it_without_a_gpu_command_runs():
    (line,) = [x for x in README.read_text().splitlines() if x.startswith("GPUPTR_DRIVER=sim python -c ")]
    argv = shlex.split(line.removeprefix("GPUPTR_DRIVER=sim "))
    out = subprocess.run([sys.executable, *argv[1:]], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == repr(b"\x07" * 4), out.stdout + out.stderr


def test_the_readme_is_a_pypi_page():
    """It speaks to users: no relative links (they break on PyPI), no paths
    outside the repository, and no notes of the team's working sessions."""
    text = README.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    links = re.findall(r"\]\(([^)]+)\)", prose)
    assert all(link.startswith(("http://", "https://", "#")) for link in links), links
    assert "../shared" not in text
    assert not re.search(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) sessions?\b", text)
