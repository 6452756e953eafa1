"""The one-number memory helpers PyTorch users know
(``torch.cuda.memory_allocated`` and friends), over every library on
gpuptr's pool: numba, CuPy, PyTorch and direct allocations together."""

from __future__ import annotations

import operator
from typing import Any, Dict, Optional

from gpuptr import _core

__all__ = ["max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"]


def device_index(device: Any) -> int:
    """``device`` as an int, checked as every device argument is: a
    ``TypeError`` for anything but an int (0.9, True and "0" are not
    devices), ``InvalidArgumentError`` for a device that does not exist."""
    _core.pool_classes(device)
    return operator.index(device)


def _device_stats(device: Optional[int]) -> Dict[str, Any]:
    d = _core._current_device() if device is None else device_index(device)
    for s in _core.stats():
        if s["device"] == d:
            return dict(s)
    raise AssertionError("unreachable: stats() lists every device")


def memory_allocated(device: Optional[int] = None) -> int:
    """Bytes in live allocations on ``device`` (default: the current one),
    from every library on gpuptr (``stats()``'s ``live_bytes``)."""
    return int(_device_stats(device)["live_bytes"])


def max_memory_allocated(device: Optional[int] = None) -> int:
    """The most :func:`memory_allocated` has been since
    ``reset_peak_stats()`` (``peak_bytes``)."""
    return int(_device_stats(device)["peak_bytes"])


def memory_reserved(device: Optional[int] = None) -> int:
    """Bytes gpuptr holds from the driver on ``device``: the pool's, handed
    out or cached, and live allocations that bypass it (``reserved_bytes``)."""
    return int(_device_stats(device)["reserved_bytes"])


def max_memory_reserved(device: Optional[int] = None) -> int:
    """The most the pool has held from the driver since
    ``reset_peak_stats()`` (``peak_pool_bytes``)."""
    return int(_device_stats(device)["peak_pool_bytes"])
