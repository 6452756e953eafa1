"""``torch.cuda.MemPool``, ``use_mem_pool`` and graph pools under ``gpuptr.install()``.

What a pool means under gpuptr: **a tag over gpuptr's one pool**, not
memory of its own. PyTorch's pluggable allocator cannot create private
pools (its ``createOrIncrefPool`` raises), so ``gpuptr.torch.install()``
puts :class:`MemPool` in its place. While a thread is inside
``use_mem_pool(pool)`` (or a CUDA graph tree's pool manager, or a
``torch.cuda.graph(pool=...)`` capture), the allocations gpuptr makes for
PyTorch on that device are noted under ``pool.id``; they are served from,
and freed back to, the pool that numba, CuPy and PyTorch share. So:

- allocations in the block are served and freed as any other; freed memory
  is there for every library at once (not kept for the pool, as PyTorch's
  private pools keep it until the pool goes);
- ``pool.id``, ``use_count()`` and ``snapshot()`` work: the snapshot lists
  the pool's live allocations as PyTorch's segments;
- ``use_on_oom`` and ``no_split`` are accepted and change nothing: any
  cached memory already serves any request, and gpuptr never merges blocks;
- a graph's memory is the graph's until it is destroyed whatever pool it
  names (see gpuptr's CUDA graphs section), so ``torch.cuda.graph(pool=...)``
  shares no memory between graphs: it costs memory, never correctness.

A ``MemPool(allocator=...)`` over another allocator cannot be served under
gpuptr's pluggable allocator: it raises ``ValueError`` saying so.

The functions here take the ``torch`` module as an argument, so that the
simulator tests run them over a stand-in.
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import Any, Dict, List, Tuple

from gpuptr import _core

__all__ = ["MemPool", "install_pools"]

PoolId = Tuple[int, int]

# Ids of pools made here: (0, n), the form PyTorch gives user-made pools
# (its graph pools are (n, 0)); PyTorch's own counter for (0, n) never runs
# under the pluggable allocator.
_ids = itertools.count(1)
# Begins not yet released, by (device, pool): use_count's part beyond the
# pool object itself.
_uses: Dict[Tuple[int, PoolId], int] = {}
_uses_lock = threading.Lock()
# The pieces of torch that MemPool needs (set by install_pools).
_torch: Any = None
_own_allocators: List[Any] = []


def _pool_id(pool: Any) -> PoolId:
    a, b = pool
    return (int(a), int(b))


def _incref(device: int, pool: PoolId, by: int) -> None:
    with _uses_lock:
        n = _uses.get((device, pool), 0) + by
        if n > 0:
            _uses[(device, pool)] = n
        else:
            _uses.pop((device, pool), None)


class MemPool:
    """``torch.cuda.MemPool`` under gpuptr: a tag over gpuptr's one pool
    (see the module). ``id`` is a ``(0, n)`` tuple, as PyTorch's own
    user-made pools; ``use_count()`` is 1 (this object) plus the
    ``use_mem_pool`` blocks and captures under way with it;
    ``snapshot()`` lists its live allocations as PyTorch's segments."""

    def __init__(self, allocator: Any = None, use_on_oom: bool = False, no_split: bool = False):
        if allocator is not None and not any(allocator is a for a in _own_allocators):
            raise ValueError(
                "torch.cuda.MemPool(allocator=...) over another allocator cannot be served "
                "under gpuptr.install(): PyTorch's allocator is then gpuptr's pluggable "
                "allocator, which cannot hand requests to a second one. Make the pool "
                "without an allocator (a tag over gpuptr's pool), or do not install "
                "gpuptr for PyTorch"
            )
        self._id: PoolId = (0, next(_ids))
        self._device = int(_torch.cuda.current_device()) if _torch is not None else 0
        self._allocator = allocator
        self.use_on_oom = bool(use_on_oom)
        self.no_split = bool(no_split)

    @property
    def id(self) -> PoolId:
        """The pool's id: a tuple of two ints."""
        return self._id

    @property
    def allocator(self) -> Any:
        """The allocator the pool was made with (None: gpuptr's)."""
        return self._allocator

    def use_count(self) -> int:
        """1 (this object) plus the ``use_mem_pool`` blocks and captures
        under way with this pool."""
        with _uses_lock:
            return 1 + _uses.get((self._device, self._id), 0)

    def snapshot(self, include_traces: bool = True) -> List[Dict[str, Any]]:
        """The pool's live allocations, as the segments
        ``torch.cuda.memory_snapshot()`` lists (one block each, all
        ``active_allocated``); ``include_traces`` is accepted for PyTorch's
        signature (gpuptr's history is ``gpuptr.snapshot()``)."""
        del include_traces
        return pool_segments(self._device, self._id)

    def __repr__(self) -> str:
        return f"<gpuptr MemPool {self._id} on device {self._device}>"


def pool_segments(device: int, pool: PoolId) -> List[Dict[str, Any]]:
    """The live allocations of ``pool`` on ``device`` as PyTorch's snapshot
    segments (each one block, ``active_allocated``)."""
    out = []
    for address, size in _core._torch_pool_live(device, pool):
        out.append(
            {
                "device": device,
                "address": address,
                "total_size": size,
                "allocated_size": size,
                "active_size": size,
                "requested_size": size,
                "stream": 0,
                "segment_type": "large" if size >= (1 << 20) else "small",
                "segment_pool_id": pool,
                "is_expandable": False,
                "frames": [],
                "blocks": [
                    {
                        "address": address,
                        "size": size,
                        "requested_size": size,
                        "state": "active_allocated",
                        "frames": [],
                    }
                ],
            }
        )
    return out


def _wrap_begin(original: Any, all_threads: bool) -> Any:
    @functools.wraps(original)
    def begin(device: Any, pool: Any, *args: Any, **kwargs: Any) -> Any:
        r = original(device, pool, *args, **kwargs)
        d, p = int(device), _pool_id(pool)
        _core._torch_pool_begin(d, p, all_threads)
        _incref(d, p, 1)
        return r

    begin.__gpuptr_pool__ = True  # type: ignore[attr-defined]
    return begin


def _wrap_end(original: Any) -> Any:
    @functools.wraps(original)
    def end(device: Any, pool: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(device, pool, *args, **kwargs)
        finally:
            _core._torch_pool_end(int(device), _pool_id(pool))

    end.__gpuptr_pool__ = True  # type: ignore[attr-defined]
    return end


def _wrap_release(original: Any) -> Any:
    @functools.wraps(original)
    def release(device: Any, pool: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(device, pool, *args, **kwargs)
        finally:
            _incref(int(device), _pool_id(pool), -1)

    release.__gpuptr_pool__ = True  # type: ignore[attr-defined]
    return release


_WRAPPERS = {
    "_cuda_beginAllocateCurrentThreadToPool": lambda f: _wrap_begin(f, False),
    "_cuda_beginAllocateToPool": lambda f: _wrap_begin(f, True),
    "_cuda_endAllocateToPool": _wrap_end,
    "_cuda_releasePool": _wrap_release,
}


def _wrap_capture(graph_cls: Any, current_device: Any) -> None:
    """Tag what a ``torch.cuda.graph(pool=...)`` capture allocates (on the
    capturing thread) with the pool it names."""
    begin, end = graph_cls.capture_begin, graph_cls.capture_end
    if getattr(begin, "__gpuptr_pool__", False):
        return
    pools: Dict[int, Tuple[int, PoolId]] = {}

    @functools.wraps(begin)
    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        pool = kwargs.get("pool", args[0] if args else None)
        r = begin(self, *args, **kwargs)
        if pool is not None and tuple(pool) != (0, 0):
            d, p = int(current_device()), _pool_id(pool)
            _core._torch_pool_begin(d, p, False)
            _incref(d, p, 1)
            pools[id(self)] = (d, p)
        return r

    @functools.wraps(end)
    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return end(self, *args, **kwargs)
        finally:
            tagged = pools.pop(id(self), None)
            if tagged is not None:
                _core._torch_pool_end(*tagged)
                _incref(tagged[0], tagged[1], -1)

    capture_begin.__gpuptr_pool__ = True  # type: ignore[attr-defined]
    setattr(graph_cls, "capture_begin", capture_begin)
    setattr(graph_cls, "capture_end", capture_end)


def install_pools(torch: Any, own_allocator: Any = None) -> None:
    """Put :class:`MemPool` in the place of ``torch.cuda.MemPool`` and tag
    the allocations of pool blocks (``use_mem_pool``, graph trees' pool
    manager, ``torch.cuda.graph(pool=...)``). Idempotent."""
    global _torch
    _torch = torch
    if own_allocator is not None and not any(own_allocator is a for a in _own_allocators):
        _own_allocators.append(own_allocator)
    memory = torch.cuda.memory
    for name, wrap in _WRAPPERS.items():
        for ns in (torch._C, memory):
            f = getattr(ns, name, None)
            if f is not None and not getattr(f, "__gpuptr_pool__", False):
                setattr(ns, name, wrap(f))
    torch.cuda.MemPool = MemPool
    memory.MemPool = MemPool
    graph_cls = getattr(torch.cuda, "CUDAGraph", None)
    if graph_cls is not None:
        _wrap_capture(graph_cls, torch.cuda.current_device)


def live_in_pool(device: int, pool: Any) -> List[int]:
    """Addresses of the live allocations of ``pool`` on ``device``."""
    return [a for a, _ in _core._torch_pool_live(int(device), _pool_id(pool))]


def counts(device: int, pool: Any) -> Dict[str, int]:
    """The counts of ``pool`` on ``device`` (see ``_torch_pool_counts``)."""
    return dict(_core._torch_pool_counts(int(device), _pool_id(pool)))

