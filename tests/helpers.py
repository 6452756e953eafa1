"""Shared test helpers: the same plugin runner as ``python -m gpuptr check``."""

from __future__ import annotations

from gpuptr.check import run_plugin

__all__ = ["run_plugin"]
