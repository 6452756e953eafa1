"""Small value types shared by the binding and the Python layer."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["MemoryInfo"]


class MemoryInfo(NamedTuple):
    """Free and total device memory in bytes, as numba's ``MemoryInfo``."""

    free: int
    total: int
