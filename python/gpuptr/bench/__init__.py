"""``python -m gpuptr bench``: gpuptr against what users would otherwise
use, measured side by side in one run on the same GPU.

Each row times a gpuptr operation and a named baseline (best of N runs
after a warm-up, the two sides' runs interleaved) and reports the speed-up
``baseline / gpuptr`` (above 1: gpuptr is faster; the JSON row's
``ratio``). A baseline whose library is missing is reported as skipped.
Rows about numba's memory manager run in child processes, because numba
picks its manager once per process. Results print as a table and go to
JSON.

The package:

- ``_timing``: the timing primitives (:func:`best_ns` and its kin);
- ``_bench``: :class:`Bench`, which measures rows and keeps each as a
  :class:`Result`;
- ``_child``: running a script of ``children/`` in a child process;
- ``children/``: those scripts, one plain Python file each;
- one module a row group (``context``, ``alloc``, ``numba``, ``pinned``,
  ...), each with a function ``rows(b)``, run in the order of ``GROUPS``;
- ``spin``: the busy GPU (a sleeping kernel on a non-blocking stream) of
  the busy rows and of ``benches/busy_*.py``;
- ``report``: the report's ``meta``, the table and the plot;
- ``runner``: :func:`run`, which runs the row groups of ``GROUPS``;
- ``command``: the options and the command line.

Adding a row group: write ``gpuptr/bench/<area>.py`` with a docstring
saying what it compares and a ``rows(b: Bench) -> None`` that adds its
rows, then name the module in ``GROUPS`` where its rows should print. In
``rows``: ``b.row(name, baseline, setup)`` times a pair of callables here
(``setup`` returns ``(ours, theirs)``, or raises to skip the row; call
``b.need_gpu()`` first if it needs a GPU), and ``b.measure(name,
baseline, fn)`` takes a row that times itself: ``fn`` returns a
:class:`Measured` or raises to skip, e.g. with
``_child.child_ns("<script>", ...)`` for a script added to ``children/``.
``b.quick``, ``b.n`` and ``b.repeat`` size the runs.
"""

from __future__ import annotations

from gpuptr.bench._bench import Bench, Measured, Pair, Result, Skipped
from gpuptr.bench._timing import best_ns, interleaved_runs_ns, runs_ns
from gpuptr.bench.busy import busy_devarray
from gpuptr.bench.command import DESCRIPTION, add_arguments, check_arguments, main, run_command
from gpuptr.bench.library import library_alloc_ns
from gpuptr.bench.report import format_table, plot
from gpuptr.bench.runner import GROUPS, run

__all__ = [
    "DESCRIPTION",
    "GROUPS",
    "Bench",
    "Measured",
    "Pair",
    "Result",
    "Skipped",
    "add_arguments",
    "best_ns",
    "busy_devarray",
    "check_arguments",
    "format_table",
    "interleaved_runs_ns",
    "library_alloc_ns",
    "main",
    "plot",
    "run",
    "run_command",
    "runs_ns",
]
