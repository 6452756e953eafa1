"""The project's records speak to outsiders: the CHANGELOG dates each
version and each note, and no record or comment cites an issue by a number
that only the team's tracker knows (``(#36)``, ``issue 26``); it says in
words what it refers to."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHANGELOG = ROOT / "CHANGELOG.md"

pytestmark = pytest.mark.skipif(not CHANGELOG.is_file(), reason="needs gpuptr's source tree (CHANGELOG.md)")

#: A citation of an issue by its number: ``(#36)``, ``(#35, items 4-6)``,
#: ``issue #24``, ``issue 26``, ``Issue 28:``. Not a Markdown anchor
#: (``](#usage)``), a colour (``"#4a7"``), nor another project's issue named
#: with its repository (``numba-cuda #536``).
CITATION = re.compile(r"""(?i)(?<![\w/\]"-])(?:issues?\s+#?\d+\b|\(#\d+\b|(?<!numba-cuda )#\d+\b(?![\w-]))""")

RECORDS = ["CHANGELOG.md", "README.md", "CONTRIBUTING.md", "tests/GPU-RUNS.md", "benches/RESULTS.md"]
CODE = ["src/**/*.rs", "tests/*.rs", "tests/**/*.py", "python/**/*.py", "python/**/*.pyi", "benches/**/*", "examples/**/*", "scripts/*"]


def _files():
    seen = set()
    for pattern in RECORDS + CODE:
        for path in sorted(ROOT.glob(pattern)):
            if path.is_file() and path not in seen and path != Path(__file__):
                seen.add(path)
                yield path


def test_no_record_or_comment_cites_an_issue_by_its_number():
    found = []
    for path in _files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in CITATION.finditer(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {m[0]!r} in {line.strip()[:120]}")
    assert not found, "\n".join(found)


def test_the_citation_pattern_finds_citations_and_nothing_else():
    for cited in ["the core layout (#25), old", "(#35, items 4-6)", "the busy tail of issue #24", "of issue 26:", "# --- issue 28: a", "// Issue 26: handles"]:
        assert CITATION.search(cited), cited
    for plain in ["[Rust](#use-from-rust)", '("gpuptr", "#4a7", -h / 2)', "the numba-cuda #536 complaint", '"#888"', "TorchLoan(#[allow(dead_code)] Loan)", "# 13. Ints past 64 bits"]:
        assert not CITATION.search(plain), plain


def test_the_changelog_dates_each_version_and_each_note():
    headings = re.findall(r"^(#{2,3}) (.+)$", CHANGELOG.read_text(), flags=re.M)
    assert headings
    undated = [h for _, h in headings if not re.search(r"\b20\d\d-\d\d-\d\d\b", h)]
    assert not undated, undated
