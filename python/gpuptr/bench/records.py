"""The pool's log records, kept in memory: what the scripts under
``benches/`` (``busy_tail.py``, ``busy_why.py``, ``footprint_why.py``) read
to say where a slow pair or a large footprint came from."""

from __future__ import annotations

import logging

__all__ = ["keep"]


class _Keep(logging.Handler):
    def __init__(self, into: list[tuple[float, str, str]]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append((record.created, record.levelname, record.getMessage()))


def keep(level: int = logging.DEBUG) -> list[tuple[float, str, str]]:
    """From now on, collect every record of the ``gpuptr`` logger at or
    above ``level`` as ``(created, levelname, message)`` in the list this
    returns (``created``: seconds since the epoch, as ``time.time()``).

    The logger stops passing records to the root logger's handlers, so a
    debug run prints nothing of its own. Rust's records reach Python when
    gpuptr is next called and at exit (see ``gpuptr._log``)."""
    records: list[tuple[float, str, str]] = []
    log = logging.getLogger("gpuptr")
    log.addHandler(_Keep(records))
    log.propagate = False
    log.setLevel(level)
    return records
