"""The bench's command line: its options, the checks made before anything
is measured, and the run that prints the table (or the JSON) and writes
the files asked for. ``python -m gpuptr bench`` (``gpuptr.cli``) and
``python -m gpuptr.bench`` both come here."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from gpuptr.bench import runner
from gpuptr.bench.report import format_table, plot, plot_formats

__all__ = ["DESCRIPTION", "add_arguments", "check_arguments", "main", "run_command"]


DESCRIPTION = (
    "Time gpuptr against numba, CuPy, torch, RMM and cuda.bindings, side by side, and print "
    "a table of speed-ups (a peer that is not installed, or needs a GPU, is skipped). Progress goes to stderr."
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The bench's options, on its own parser or the CLI's ``bench`` command."""
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--json", metavar="FILE", help="also write the JSON report to FILE ('-': stdout, instead of the table)")
    ap.add_argument("--plot", metavar="FILE.png", help="draw the speed-ups (needs matplotlib: pip install matplotlib)")
    ap.add_argument("--only", metavar="TEXT", help="only the rows whose name or baseline contains TEXT (any case)")


def check_arguments(args: argparse.Namespace) -> Optional[str]:
    """What stops the arguments from working, found before anything is
    measured (None: nothing): ``--plot`` without matplotlib or to a file
    whose extension names no format matplotlib writes, or a report file in
    a directory that does not exist or cannot be written, or an empty
    name. A path that is not a regular file (``/dev/stdout``, a pipe) is
    written into, as ``open()`` writes it."""
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib: pip install matplotlib (gpuptr's [plot] extra)"
        problem = _plot_format_problem(args.plot)
        if problem:
            return problem
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None or (flag == "--json" and path == "-"):
            continue
        if not path:
            return f"{flag}: the file name is empty"
        parent = Path(path).parent
        if Path(path).is_dir():
            return f"{flag} {path}: is a directory (name a file in it)"
        if Path(path).exists() and not os.access(path, os.W_OK):
            return f"{flag} {path}: the file cannot be written"
        if not parent.is_dir():
            return f"{flag} {path}: the directory {parent} does not exist"
        if not os.access(parent, os.W_OK):
            return f"{flag} {path}: the directory {parent} cannot be written"
    return None


def _plot_format_problem(path: str) -> Optional[str]:
    """Why matplotlib cannot write the plot to ``path`` (None: it can):
    ``savefig`` picks the format by the extension."""
    formats = plot_formats()
    ext = Path(path).suffix.lower().lstrip(".")
    if ext in formats:
        return None
    names = ", ".join(f".{f}" for f in formats)
    if not ext:
        return f"--plot {path}: name the file with the extension of its format (one of {names})"
    return f"--plot {path}: matplotlib cannot write .{ext} files (it writes {names})"


def run_command(args: argparse.Namespace) -> int:
    """Run the bench for parsed (and checked) arguments: the table (or the
    JSON) on stdout, the files asked for; the exit status."""
    # Looked up at the call: a test may replace it.
    report = runner.run(quick=args.quick, only=args.only)
    if args.only and not report["rows"]:
        print(f"error: no row matches {args.only!r} (--only picks the rows whose name or baseline contains it,"
              " in any case; e.g. alloc, launch, context, graph, pinned, ipc)", file=sys.stderr)
        return 1
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    try:
        if args.json and args.json != "-":
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
            print(f"note: wrote {args.json}", file=sys.stderr)
        if args.plot:
            plot(report, args.plot)
            print(f"note: wrote {args.plot}", file=sys.stderr)
    except OSError as e:
        print(f"error: could not write the report: {e}", file=sys.stderr)
        return 1
    if not any(not r["skipped"] for r in report["rows"]):
        print("error: no row could be measured here", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m gpuptr.bench``: the bench on its own (the CLI's ``bench``
    command also picks the driver first)."""
    ap = argparse.ArgumentParser(prog="gpuptr bench", description=DESCRIPTION)
    add_arguments(ap)
    args = ap.parse_args(argv)
    problem = check_arguments(args)
    if problem:
        print(f"gpuptr bench: error: {problem}", file=sys.stderr)
        return 2
    return run_command(args)
