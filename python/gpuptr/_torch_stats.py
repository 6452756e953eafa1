"""PyTorch's memory API on gpuptr's pool.

``torch.cuda.memory`` reads its allocator through a few entry points of
``torch._C``, looked up when each function runs: ``memory_stats`` (and so
``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
``max_memory_reserved``, ``memory_summary``) calls ``_cuda_memoryStats``;
``reset_peak_memory_stats`` and ``reset_accumulated_memory_stats`` call
``_cuda_resetPeakMemoryStats`` and ``_cuda_resetAccumulatedMemoryStats``;
``memory_snapshot``, ``_snapshot`` and ``_dump_snapshot`` call
``_cuda_memorySnapshot``; ``_record_memory_history`` calls
``_cuda_record_memory_history`` (or ``…_legacy``); ``empty_cache`` calls
``_cuda_emptyCache``. Under a pluggable allocator each of them raises
"does not yet support" (``empty_cache`` does nothing). :func:`patch` puts
gpuptr's answers there (``gpuptr.torch.install()`` calls it once PyTorch's
allocator is gpuptr's, which is then for the life of the process).

The numbers are gpuptr's:

- ``allocated_bytes``, ``active_bytes``, ``allocation``, ``active`` and
  ``requested_bytes`` are PyTorch's own allocations through gpuptr's hooks
  (block bytes, and the bytes asked for), counted exactly in the hooks,
  peaks included; ``small_pool`` is blocks of at most 1 MiB, as PyTorch's.
  A freed tensor's block is the pool's at once (its fence is the pool's
  business), so ``active`` equals ``allocated``.
- ``reserved_bytes`` and ``segment`` are what gpuptr's pool holds from the
  driver on that device: its driver allocations, which serve every library
  on the pool (numba, CuPy, ``gpuptr.alloc`` as well as PyTorch). That is
  what ``torch.cuda.empty_cache()`` gives back and what ``nvidia-smi``
  sees, and it is the one number the libraries cannot split: a cached
  block is anyone's.
- ``num_ooms`` counts the out-of-memory errors thrown to PyTorch;
  ``num_alloc_retries`` the pool's retries after giving its cache back (for
  every library); ``num_device_alloc``/``num_device_free`` its driver
  allocations and frees. gpuptr never splits a block, so ``inactive_split``
  and the ``oversize`` counts are zero, and ``max_split_size`` is -1 (no
  limit), as under PyTorch's defaults.
- Snapshots are gpuptr's (``gpuptr.snapshot()``, PyTorch's memory-viz
  format): every library's blocks, each with its ``client``.

The mapping functions here are pure (dicts in, dicts out), so they are
tested without PyTorch.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["memory_stats", "patch", "record_history_args", "torch_snapshot"]

#: ``max_split_size`` as PyTorch reports "no limit" (its default).
NO_SPLIT_LIMIT = -1


_ZERO = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}


def _zero_by_pool() -> Dict[str, Dict[str, int]]:
    return {"all": dict(_ZERO), "small_pool": dict(_ZERO), "large_pool": dict(_ZERO)}


def _mirror(b: Mapping[str, Mapping[str, int]]) -> Dict[str, Dict[str, int]]:
    return {p: dict(v) for p, v in b.items()}


def _since(b: Dict[str, Dict[str, int]], base: Mapping[str, Mapping[str, int]]) -> Dict[str, Dict[str, int]]:
    """``b`` (changed in place) with its totals counted from ``base``'s
    (PyTorch's ``reset_accumulated_memory_stats`` restarts them; the pool's
    own go on)."""
    for p, stat in b.items():
        since = base[p]
        stat["allocated"] = max(0, stat["allocated"] - since["allocated"])
        stat["freed"] = max(0, stat["freed"] - since["freed"])
    return b


def memory_stats(counts: Dict[str, Any], device: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """``torch._C._cuda_memoryStats(device)``'s nested dict, from PyTorch's
    counts in gpuptr's hooks and the pool's (``_core._torch_counts(device)``:
    with ``segments``, the pool's driver allocations, and
    ``num_alloc_retries``; or those two from ``device``, a
    ``gpuptr.stats()`` entry). The dicts of ``counts`` become the result's
    (it is built fresh for each call), so it is not used again."""
    pool = counts if device is None else device
    segments = pool["segments"]
    base = counts["segments_base"]
    segment = _since(_mirror(segments["count"]), base["count"])
    allocation = counts["allocation"]
    allocated = counts["allocated_bytes"]
    return {
        "num_alloc_retries": max(0, pool["num_alloc_retries"] - counts["retries_base"]),
        "num_ooms": counts["num_ooms"],
        "max_split_size": NO_SPLIT_LIMIT,
        "num_sync_all_streams": 0,
        "num_device_alloc": segment["all"]["allocated"],
        "num_device_free": segment["all"]["freed"],
        "allocation": allocation,
        "segment": segment,
        "active": _mirror(allocation),
        "inactive_split": _zero_by_pool(),
        "allocated_bytes": allocated,
        "reserved_bytes": _since(_mirror(segments["bytes"]), base["bytes"]),
        "active_bytes": _mirror(allocated),
        "inactive_split_bytes": _zero_by_pool(),
        "requested_bytes": counts["requested_bytes"],
        "oversize_allocations": dict(_ZERO),
        "oversize_segments": dict(_ZERO),
    }


def torch_snapshot(snapshot: Dict[str, Any], arg: Any = None) -> Dict[str, Any]:
    """``torch._C._cuda_memorySnapshot(arg)`` from a ``gpuptr.snapshot()``.
    ``arg`` is what ``torch.cuda.memory`` passes: ``None`` (everything), a
    pool id ``(a, b)``, or ``(a, b, include_traces)``; pool ``(0, 0)`` is
    every pool, another one only its own segments (gpuptr's are all
    ``(0, 0)``); ``include_traces=False`` leaves the traces out."""
    include_traces = True
    pool: Optional[Tuple[int, int]] = None
    if arg is not None:
        items = tuple(arg)
        if len(items) >= 3:
            include_traces = bool(items[2])
        if len(items) >= 2 and (int(items[0]), int(items[1])) != (0, 0):
            pool = (int(items[0]), int(items[1]))
    out = dict(snapshot)
    if pool is not None:
        out["segments"] = [s for s in snapshot["segments"] if tuple(s.get("segment_pool_id", (0, 0))) == pool]
    if not include_traces:
        out["device_traces"] = [[] for _ in snapshot.get("device_traces", [])]
    return out


def record_history_args(legacy: bool, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Tuple[bool, int]:
    """``(enabled, max_entries)`` for ``gpuptr.record_history`` from the
    arguments ``torch.cuda.memory._record_memory_history`` passes on:

    - ``_cuda_record_memory_history(enabled, context, stacks, max_entries,
      …, record_cuda)``: ``enabled`` ``None`` stops; ``"state"`` keeps the
      live allocations' stacks and no trace (``max_entries`` 0); ``"all"``
      keeps the newest ``max_entries`` events (PyTorch's default,
      ``sys.maxsize``, keeps all). ``record_cuda=False`` (host memory only)
      records nothing here.
    - ``_cuda_record_memory_history_legacy(enabled, record_context,
      trace_alloc_max_entries, …)``: a bool, and the entries to keep.
    """
    def arg(i: int, name: str, default: Any) -> Any:
        if len(args) > i:
            return args[i]
        return kwargs.get(name, default)

    if legacy:
        enabled = bool(arg(0, "enabled", False))
        entries = int(arg(2, "trace_alloc_max_entries", 1))
        return enabled, max(0, entries)
    enabled_mode = arg(0, "enabled", "all")
    record_cuda = arg(9, "record_cuda", True)
    if enabled_mode is None or not record_cuda:
        return False, 0
    if enabled_mode not in ("state", "all"):
        raise ValueError(f"enabled must be None, 'state' or 'all', not {enabled_mode!r}")
    if enabled_mode == "state":
        return True, 0
    return True, max(0, min(int(arg(3, "max_entries", sys.maxsize)), sys.maxsize))


def entry_points(core: Any) -> Dict[str, Callable[..., Any]]:
    """The ``torch._C`` entry points gpuptr answers, by name, over the
    binding ``core`` (``gpuptr._core``)."""

    def _cuda_memoryStats(device: int) -> Dict[str, Any]:
        return memory_stats(core._torch_counts(device))

    def _cuda_resetPeakMemoryStats(device: int) -> None:
        core._torch_reset_peak(int(device))

    def _cuda_resetAccumulatedMemoryStats(device: int) -> None:
        core._torch_reset_accumulated(int(device))

    def _cuda_memorySnapshot(arg: Any = None) -> Dict[str, Any]:
        return torch_snapshot(core.snapshot(), arg)

    def _record(legacy: bool, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        enabled, entries = record_history_args(legacy, args, kwargs)
        if enabled:
            core.record_history(True, entries)
        else:
            core.record_history(False)

    def _cuda_record_memory_history(*args: Any, **kwargs: Any) -> None:
        _record(False, args, kwargs)

    def _cuda_record_memory_history_legacy(*args: Any, **kwargs: Any) -> None:
        _record(True, args, kwargs)

    def _cuda_emptyCache(*args: Any, **kwargs: Any) -> None:
        # torch.cuda.empty_cache(): PyTorch's pluggable allocator calls a
        # reset hook there that its Python API cannot set, so it reached
        # nothing; the pool's device memory goes back to the driver, as
        # PyTorch's does, and its pinned host cache stays, as PyTorch's.
        core.trim(host=False)

    return {
        f.__name__: f
        for f in (
            _cuda_memoryStats,
            _cuda_resetPeakMemoryStats,
            _cuda_resetAccumulatedMemoryStats,
            _cuda_memorySnapshot,
            _cuda_record_memory_history,
            _cuda_record_memory_history_legacy,
            _cuda_emptyCache,
        )
    }


#: What :func:`patch` replaced: name to PyTorch's own function.
_replaced: Dict[str, Any] = {}


def patch(namespace: Any, core: Any = None) -> List[str]:
    """Answer PyTorch's memory entry points in ``namespace`` (``torch._C``)
    from gpuptr (``core``: ``gpuptr._core``). Only names the namespace has
    are set (a PyTorch without one keeps its own behaviour); calling it
    again changes nothing. The names set."""
    if core is None:
        from gpuptr import _core as core
    done = []
    for name, f in entry_points(core).items():
        current = getattr(namespace, name, None)
        if current is None:
            continue
        if getattr(current, "__module__", None) != __name__:
            _replaced.setdefault(name, current)
            f.__qualname__ = name
            setattr(namespace, name, f)
        done.append(name)
    return done
