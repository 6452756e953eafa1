"""gpuptr's records in Python's logging, under the logger ``"gpuptr"``.

The Rust core keeps only records at or above the ``gpuptr`` logger's
effective level, so with DEBUG off its ``debug!`` calls cost one load. This
module tells it the level, at import and again whenever Python's logging
levels change: ``Logger.setLevel`` (and so ``logging.basicConfig(level=…)``
and pytest's ``caplog.set_level``) clears every logger's level cache, and
the ``gpuptr`` logger's cache is a dict that passes the new level on when
cleared. Where a level changes some other way, call :func:`sync_level`.

Records are delivered when gpuptr is next called (they keep the time they
were made), and at exit.
"""

from __future__ import annotations

import atexit
import logging
from gpuptr import _core

__all__ = ["logger", "sync_level"]

logger = logging.getLogger("gpuptr")


def sync_level() -> None:
    """Pass the ``gpuptr`` logger's effective level to the Rust core (and
    deliver what it queued)."""
    level = max(logger.getEffectiveLevel(), logging.root.manager.disable + 1)
    if logger.disabled:
        level = logging.CRITICAL + 1
    _core._set_log_level(level)


class _LevelWatch(dict):  # type: ignore[type-arg]
    """The ``gpuptr`` logger's level cache: cleared when any level changes."""

    def clear(self) -> None:
        super().clear()
        sync_level()


def _watch() -> None:
    # `Logger._cache` and `Manager._clear_cache` are CPython's logging
    # internals (3.7 and later); without them, only sync_level() updates it.
    if isinstance(getattr(logger, "_cache", None), dict) and hasattr(logging.Logger.manager, "_clear_cache"):
        setattr(logger, "_cache", _LevelWatch())
    sync_level()


_watch()
atexit.register(_core._flush_log)
