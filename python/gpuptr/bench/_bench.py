"""A bench run's rows: :class:`Bench` measures them (``row`` for a pair of
callables timed here, ``measure`` for a row that times itself) and keeps
each as a :class:`Result`, measured or skipped."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, TextIO, Tuple

from gpuptr.bench._timing import interleaved_runs_ns

__all__ = ["Bench", "Measured", "Pair", "Result", "Skipped"]

#: A row's two timed callables: gpuptr's and the baseline's.
Pair = Tuple[Callable[[], object], Callable[[], object]]


class Skipped(Exception):
    """Skips a row with this reason as it stands (e.g. one a child process
    already gave as ``"RuntimeError: needs the GPU"``); any other exception
    skips it with ``"<type>: <message>"``."""


@dataclass
class Measured:
    """What a row's ``measure`` function found: each side's best ns per
    call, with anything the table or the JSON should carry in ``extra``,
    and each run's time where it kept them."""

    gpuptr_ns: float
    baseline_ns: float
    extra: Dict[str, Any] = field(default_factory=dict)
    gpuptr_runs: List[float] = field(default_factory=list)
    baseline_runs: List[float] = field(default_factory=list)


@dataclass
class Result:
    """One row of the report (its fields are the JSON row's keys)."""

    row: str
    baseline: str
    gpuptr_ns: Optional[float] = None
    baseline_ns: Optional[float] = None
    #: ``baseline_ns / gpuptr_ns``: the speed-up (above 1: gpuptr is faster).
    ratio: Optional[float] = None
    skipped: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    #: Each run's mean ns per call (the best is ``gpuptr_ns``/``baseline_ns``).
    gpuptr_runs: List[float] = field(default_factory=list)
    baseline_runs: List[float] = field(default_factory=list)

    @classmethod
    def of(cls, row: str, baseline: str, m: Measured) -> Result:
        """The measured row, rounded as the report shows it."""
        return cls(
            row,
            baseline,
            round(m.gpuptr_ns, 1),
            round(m.baseline_ns, 1),
            round(m.baseline_ns / m.gpuptr_ns, 2),
            extra=m.extra,
            gpuptr_runs=[round(x, 1) for x in m.gpuptr_runs],
            baseline_runs=[round(x, 1) for x in m.baseline_runs],
        )

    @classmethod
    def skip(cls, row: str, baseline: str, why: BaseException) -> Result:
        """The row, skipped because of ``why``."""
        reason = str(why) if isinstance(why, Skipped) else f"{type(why).__name__}: {why}"
        return cls(row, baseline, skipped=reason)


class Bench:
    """The rows of one run. ``on_gpu``: the driver is CUDA (rows that need
    a GPU skip otherwise, through :meth:`need_gpu`); ``addr``: an address
    inside gpuptr memory held for the whole run (``run`` sets it)."""

    def __init__(
        self, quick: bool, out: TextIO = sys.stderr, only: Optional[str] = None, on_gpu: bool = False
    ) -> None:
        self.quick = quick
        self.n = 2000 if quick else 20000
        self.repeat = 3 if quick else 7
        self.results: list[Result] = []
        self.out = out
        self.only = only.lower() if only else None
        self.on_gpu = on_gpu
        self.addr = 0

    def wants(self, *labels: str) -> bool:
        """Whether a row with these labels runs (``--only`` matches one)."""
        return self.only is None or any(self.only in label.lower() for label in labels)

    def need_gpu(self) -> None:
        """Skip the row being set up unless this run is on a GPU."""
        if not self.on_gpu:
            raise RuntimeError("needs the GPU")

    def say(self, what: str) -> None:
        """The progress line for what is measured next (on ``out``)."""
        print(f"  measuring: {what} ...", file=self.out, flush=True)

    def row(self, name: str, baseline: str, setup: Callable[[], Pair], scale: float = 1.0) -> None:
        """``setup()`` returns ``(ours, theirs)`` callables, or raises
        (ImportError, RuntimeError, ...) to skip the row; the two are timed
        here, ``n * scale`` calls a run, their runs interleaved."""
        if not self.wants(name, baseline):
            return
        self.say(f"{name} vs {baseline}")
        try:
            ours, theirs = setup()
        except Exception as e:  # a missing peer or an unusable one
            self.add(Result.skip(name, baseline, e))
            return
        n = max(10, int(self.n * scale))
        a_runs, b_runs = interleaved_runs_ns(ours, theirs, n, self.repeat)
        measured = Measured(min(a_runs), min(b_runs), gpuptr_runs=a_runs, baseline_runs=b_runs)
        self.add(Result.of(name, baseline, measured))

    def measure(
        self,
        name: str,
        baseline: str,
        fn: Callable[[], Measured],
        *,
        labels: Tuple[str, ...] = (),
        say: Optional[str] = None,
    ) -> None:
        """A row that times itself (in child processes, or not as a pair of
        callables): ``fn()`` returns what it measured, or raises to skip the
        row. ``labels``: more words ``--only`` may pick it by; ``say``: the
        progress line (default: ``"<name> vs <baseline>"``)."""
        if not self.wants(name, baseline, *labels):
            return
        self.say(say or f"{name} vs {baseline}")
        self.record(name, baseline, fn)

    def record(self, name: str, baseline: str, fn: Callable[[], Measured]) -> None:
        """:meth:`measure` without the ``--only`` test and the progress line
        (for a group of rows announced once)."""
        try:
            m = fn()
        except Exception as e:  # a missing peer, a child that failed
            self.add(Result.skip(name, baseline, e))
            return
        self.add(Result.of(name, baseline, m))

    def add(self, result: Result) -> None:
        self.results.append(result)
