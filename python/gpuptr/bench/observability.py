"""What observability costs: gpuptr.alloc+free with the leak report on,
with the allocation history on (``--only history``), and with DEBUG
logging on (records to a NullHandler), each against the same pair with it
off, measured one after the other."""

from __future__ import annotations

import logging
from typing import Callable, List

from gpuptr.bench._bench import Bench, Measured
from gpuptr.bench._timing import run_ns
from gpuptr.bench.alloc import alloc_pair

_NULL_HANDLER = logging.NullHandler()


def rows(b: Bench) -> None:
    pair = alloc_pair()
    _observed(b, "gpuptr.alloc+free 1 MiB, tracking on", _tracking, pair)
    _observed(b, "gpuptr.alloc+free 1 MiB, history on", _history, pair)
    _observed(b, "gpuptr.alloc+free 1 MiB, DEBUG logging on", _debug_logging, pair)


def _observed(b: Bench, name: str, switch: Callable[[bool], None], pair: Callable[[], None]) -> None:
    """The row ``name``: ``pair`` with ``switch(True)``, against it after
    ``switch(False)``."""

    def measure() -> Measured:
        n = max(10, b.n // 4)
        on: List[float] = []
        off: List[float] = []

        def switched_on() -> None:
            # One run with the switch on; the pair runs it n times.
            switch(True)
            try:
                on.append(run_ns(pair, n))
            finally:
                switch(False)

        switch(True)
        try:
            for _ in range(min(n, 200)):
                pair()
        finally:
            switch(False)
        for _ in range(min(n, 200)):
            pair()
        # Runs with it on and off alternate, as in Bench.row.
        for i in range(b.repeat):
            if i % 2 == 0:
                switched_on()
                off.append(run_ns(pair, n))
            else:
                off.append(run_ns(pair, n))
                switched_on()
        return Measured(min(on), min(off), gpuptr_runs=on, baseline_runs=off)

    b.measure(name, "the same, off", measure, say=name)


def _tracking(on: bool) -> None:
    """Turn the leak report on or off (a switch for :func:`_observed`)."""
    import gpuptr

    if on and gpuptr.tracking():
        raise RuntimeError("tracking is already on in this process (GPUPTR_TRACK)")
    gpuptr.track(on)


def _history(on: bool) -> None:
    """Turn the allocation history on (a fresh trace) or off (a switch for
    :func:`_observed`)."""
    import gpuptr

    if on and gpuptr.recording_history():
        raise RuntimeError("the allocation history is already on in this process (GPUPTR_HISTORY)")
    gpuptr.record_history(on)


def _debug_logging(on: bool) -> None:
    """Turn gpuptr's DEBUG logging to a NullHandler on, or back to what it
    was (a switch for :func:`_observed`)."""
    logger = logging.getLogger("gpuptr")
    if on:
        _debug_logging.saved = (logger.level, logger.propagate)  # type: ignore[attr-defined]
        logger.addHandler(_NULL_HANDLER)
        logger.propagate = False
        logger.setLevel(logging.DEBUG)
    else:
        level, propagate = _debug_logging.saved  # type: ignore[attr-defined]
        logger.setLevel(level)
        logger.propagate = propagate
        logger.removeHandler(_NULL_HANDLER)
