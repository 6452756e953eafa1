"""What each integration needs, shared by ``gpuptr.install()`` and the
integrations themselves: the bool check of their flags, and the module and
pip name of each library (a leaf: it imports nothing of gpuptr)."""

from __future__ import annotations

from typing import Dict, Tuple

# The module each part of ``gpuptr.install()`` needs, and what to pip
# install when it cannot be imported.
NEEDS: Dict[str, Tuple[str, str]] = {
    "numba": ("gpuptr.numba", '"numba-cuda[cu13]" (gpuptr\'s [numba] extra) or "numba-cuda-mlir[cu13]" ([numba-mlir])'),
    "cupy": ("cupy", "cupy-cuda13x (or cupy-cuda12x)"),
    "torch": ("torch", "torch"),
    "rmm": ("rmm", "rmm-cu13 (or rmm-cu12)"),
}


def is_bool(value: object) -> bool:
    """Whether ``value`` is a bool, Python's or numpy's (whose scalar type
    is named ``bool_`` before numpy 2 and ``bool`` since)."""
    return isinstance(value, bool) or type(value).__name__ in ("bool", "bool_")


def flag(value: object, name: str) -> bool:
    """``value`` if it is a bool (numpy's included); ``TypeError`` naming
    ``name`` otherwise, so that ``stream_ordered="no"`` is not read as
    true."""
    if is_bool(value):
        return bool(value)
    raise TypeError(f"{name} must be True or False, not {type(value).__name__} {value!r}")
