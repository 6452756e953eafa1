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
import shutil
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


def printed(code: str) -> List[str]:
    """What a block's comments say it prints: the ``# `` lines right after
    each line that calls ``print(``, in order. A print with no such line is
    an error: every example shows what it prints."""
    lines = code.splitlines()
    said: List[str] = []
    for i, line in enumerate(lines):
        if "print(" not in line.split("#", 1)[0]:
            continue
        group = []
        for follow in lines[i + 1 :]:
            if not follow.startswith("# "):
                break
            group.append(follow[2:])
        assert group, f"{line!r}: no '# ' line after it says what it prints"
        said += group
    return said


def shows(said: List[str], stdout: str) -> bool:
    """Whether ``stdout`` is what the comments say, spaces aside, where
    ``...`` in a comment stands for any text (as in ``(...)``)."""
    flat = " ".join(" ".join(said).split())
    pattern = ".*?".join(re.escape(part) for part in flat.split("..."))
    return re.fullmatch(pattern, " ".join(stdout.split())) is not None


def test_shows_matches_whitespace_and_elisions_and_nothing_else():
    assert shows(["[{'a': 1},", " {'b': 2}]"], "[{'a': 1}, {'b': 2}]\n")
    assert shows(["{'cupy': ...}"], "{'cupy': 'skipped: (x)'}\n")
    assert not shows(["['alloc', 'alloc']"], "['segment_alloc', 'alloc']\n")
    assert not shows(["0"], "0\n1\n")
    with pytest.raises(AssertionError, match="says what it prints"):
        printed("print(1)\nx = 2\n")


@pytest.mark.parametrize("block", PYTHON, ids=[f"line-{b.line}" for b in PYTHON])
def test_each_python_block_runs_on_the_simulator_and_prints_what_it_says(block, tmp_path):
    if block.skip:
        pytest.skip(block.skip)
    first = block.code.splitlines()[0]
    name = first[2:].strip() if re.fullmatch(r"# [\w-]+\.py", first) else "example.py"
    (tmp_path / name).write_text(block.code)
    out = subprocess.run(
        [sys.executable, name], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"README.md line {block.line}:\n{block.code}\n{out.stdout}{out.stderr}"
    # The examples' paths are a user's: the file ran in tmp_path.
    stdout = out.stdout
    for where in {str(tmp_path.resolve()), str(tmp_path)}:
        stdout = stdout.replace(where, "/home/you")
    said = printed(block.code)
    assert shows(said, stdout), f"README.md line {block.line} says it prints\n{chr(10).join(said)}\nbut printed\n{stdout}"


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


@pytest.mark.skipif(shutil.which("cargo") is None, reason="needs cargo")
def test_the_rust_block_runs_with_the_readmes_command_and_prints_what_it_says():
    (block,) = blocks("rust")
    lines = block.code.splitlines()
    said = [lines[i + 1].strip().removeprefix("// ") for i, x in enumerate(lines) if "println!(" in x]
    assert said and all(said), "each println! has a '// ' line after it saying what it prints"
    env = {**_env(), "CARGO_TERM_COLOR": "never"}
    out = subprocess.run(
        ["cargo", "run", "--quiet", "--example", "readme"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0 and out.stdout.splitlines() == said, out.stdout + out.stderr[-2000:]


def test_the_try_it_without_a_gpu_command_runs():
    (line,) = [x for x in README.read_text().splitlines() if x.startswith("GPUPTR_DRIVER=sim python -c ")]
    argv = shlex.split(line.removeprefix("GPUPTR_DRIVER=sim "))
    out = subprocess.run([sys.executable, *argv[1:]], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == repr(b"\x07" * 4), out.stdout + out.stderr
    (block,) = [b for b in blocks("sh") if line in b.code]
    assert printed(block.code) == [repr(b"\x07" * 4)], "the comment under the command says what it prints"


def test_the_readme_is_a_pypi_page():
    """It speaks to users: no relative links (they break on PyPI), no paths
    outside the repository, and no notes of the team's working sessions."""
    text = README.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    links = re.findall(r"\]\(([^)]+)\)", prose)
    assert all(link.startswith(("http://", "https://", "#")) for link in links), links
    assert "../shared" not in text
    assert not re.search(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) sessions?\b", text)


def _slug(heading: str) -> str:
    """The anchor GitHub and PyPI give a heading: lower case, punctuation
    but hyphens dropped, spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_contents_and_every_anchor_lead_to_a_heading():
    text = README.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    anchors = {_slug(m[1]) for m in re.finditer(r"^#{2,4} (.+)$", prose, flags=re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", prose)
    assert len(links) >= 20, "the contents list names the sections"
    assert [link for link in links if link not in anchors] == []
    # The contents and the requirements come first, before any section.
    heads = re.findall(r"^## (.+)$", prose, flags=re.M)
    assert heads[:2] == ["Contents", "Requirements"], heads[:3]
    every = {_slug(h) for h in heads}
    assert every - {"contents"} <= set(links), "a section missing from the contents"


def test_the_requirements_are_the_builds_own():
    text = README.read_text()
    reqs = text.split("## Requirements\n", 1)[1].split("\n## ", 1)[0]
    cargo = (ROOT / "Cargo.toml").read_text()
    rust = re.search(r'^rust-version = "([\d.]+)"', cargo, flags=re.M)[1]
    python = re.search(r'^requires-python = ">=([\d.]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M)[1]
    assert "Linux" in reqs and f"Rust {rust} or later" in reqs and f"CPython {python} or later" in reqs, reqs
    assert "CUDA 12.0 or later" in reqs


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def test_the_pip_that_refuses_git_file_urls_is_named_truly(tmp_path):
    """The README names the newest pip that refuses ``git+file:///`` (pip
    took such URLs once it vendored packaging 22 or later); the pip here
    refuses it exactly when it is that one or older."""
    import importlib.metadata

    try:
        pip = importlib.metadata.version("pip")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("no pip here")
    text = " ".join(README.read_text().split())
    named = re.search(r"\(pip ([\d.]+) and older(?:,[^)]*?)? refuse `git\+file:///…`", text)
    assert named, "the README's note on git+file:/// URLs"
    # Nothing is fetched: the URL names no repository, and no index is asked.
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index",
         f"gpuptr @ git+file://{tmp_path}/no-repository"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    refused = "Invalid requirement" in out.stdout + out.stderr
    assert refused == (_release(pip) <= _release(named[1])), (pip, named[1], out.stderr[-600:])


def test_every_extra_installs_from_the_repository_and_no_url_leads_nowhere():
    """gpuptr is on no package index: the README installs it from a clone or
    a git URL, names every extra pyproject.toml has (and no other), and the
    metadata carries no URL (the project has no public home yet)."""
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "urls" not in meta
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]
    assert not {"homepage", "repository", "documentation"} & set(cargo)
    text = README.read_text()
    install = text.split("## Install\n", 1)[1].split("\n## ", 1)[0]
    bullets = "\n".join(line for line in install.splitlines() if line.startswith("- `["))
    named = set(re.findall(r"`\[([\w-]+)\]`", bullets))
    assert named == set(meta["optional-dependencies"]), named
    assert 'pip install ".[' in install and '@ git+' in install
    # No install line anywhere asks an index for gpuptr itself.
    assert not re.search(r'pip install "?gpuptr(\[[\w,-]+\])?"?(?! *@)(\s|$|`)', text)
    rust = text.split("### Use from Rust\n", 1)[1].split("\n## ", 1)[0]
    assert 'gpuptr = { path = "' in rust and "gpuptr = { git = " in rust
    assert "GPUPTR_DRIVER=sim cargo run\n--example readme" in rust or "GPUPTR_DRIVER=sim cargo run --example readme" in rust
