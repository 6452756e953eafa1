"""``gpuptr.memory_summary()``: a readable table of the pool."""

from __future__ import annotations

from typing import List, Optional

from gpuptr import _core
from gpuptr._numbers import device_index

__all__ = ["memory_summary"]


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def memory_summary(device: Optional[int] = None) -> str:
    """A table of each device's memory as gpuptr sees it: live, cached
    (waiting for a fence included) and peak bytes, pool hits, misses and
    fences, what the pool holds (and its limit), its cache of pinned host
    memory (held, in use, cached, hits and misses), live bytes per client,
    then blocks live, at their peak and cached per size class (counts: a
    class holds blocks of up to its size). ``device``: one device (default: all)."""
    stats = _core.stats()
    if device is not None:
        one = device_index(device)
        stats = [s for s in stats if s["device"] == one]
    lines: List[str] = []
    for s in stats:
        d = s["device"]
        lines.append(f"device {d}")
        lines.append(
            f"  live {_size(s['live_bytes'])} in {s['live_count']} allocations, peak {_size(s['peak_bytes'])},"
            f" {s['alloc_count']} allocations made"
        )
        lines.append(
            f"  cached {_size(s['cached_bytes'])} ({_size(s['pending_bytes'])} waiting for a fence);"
            f" pool hits {s['pool_hits']}, misses {s['pool_misses']}, fences {s['fences']}"
        )
        limit = s["pool_limit"]
        lines.append(
            f"  the pool holds {_size(s['pool_bytes'])} from the driver"
            + (f" (limit {_size(limit)})" if limit is not None else "")
        )
        h = s["host"]
        if h["held_bytes"] or h["hits"] or h["misses"]:
            lines.append(
                f"  pinned host: holds {_size(h['held_bytes'])}, in use {_size(h['live_bytes'])} in"
                f" {h['live_count']} blocks, cached {_size(h['cached_bytes'])}"
                f" ({_size(h['pending_bytes'])} waiting for a fence); hits {h['hits']}, misses {h['misses']}"
            )
        users = [(k, c) for k, c in s["clients"].items() if c["live_count"] or c["alloc_count"]]
        if users:
            lines.append(
                "  by client: "
                + ", ".join(f"{k} {_size(c['live_bytes'])} in {c['live_count']} ({c['alloc_count']} made)" for k, c in users)
            )
        # Blocks by size class: counts only. A class holds blocks of up to its
        # size, so its size times a count would overstate the bytes (a 17 MiB
        # free block counted as 20 MiB); the lines above give them exactly.
        classes = _core.pool_classes(d)
        if classes:
            lines.append(f"  {'block size':>12} {'live':>8} {'peak':>8} {'cached':>8}")
            for c in classes:
                lines.append(
                    f"  {_size(c['class']):>12} {c['live_blocks']:>8} {c['peak_blocks']:>8} {c['cached_blocks']:>8}"
                )
    return "\n".join(lines)

