"""CUDA graph trees (``torch.compile(mode="reduce-overhead")`` with
inductor's default ``cudagraph_trees = True``) under ``gpuptr.install()``.

Graph trees share one private pool of PyTorch's caching allocator across
the graphs of a tree, and call four allocator entry points a pluggable
allocator lacks. gpuptr answers them from what it does instead, keeping
each graph's memory for that graph until the graph is destroyed (so no
graph's replay can write over another's memory or a live tensor's):

- ``torch._C._cuda_getCheckpointState``: the tree checkpoints the pool after
  each recording, to restore it before it records a child. Under gpuptr
  there is no pool state to restore: it returns a token.
- ``CUDAGraphTreeManager.apply_checkpoint_execution_state_in_allocator``:
  PyTorch's restores the checkpoint and frees the outputs that died since
  (``_cuda_setCheckpointPoolState`` and ``raw_delete``). Under gpuptr those
  outputs' memory went back when PyTorch freed them (to their graph, which
  keeps it), so gpuptr's version only drops the path's cached tensors.
- ``torch._C._free_And_Remove_DeleterFn``: PyTorch's frees a live output's
  memory early and requires it to own its memory. Outputs rebuilt on a
  replay own none under gpuptr (their graph does), so for them it does
  nothing; others go to PyTorch's own.
- ``torch._C._cuda_checkPoolLiveAllocations``: whether every live
  allocation tagged with the tree's pool is among the tree's live
  storages (no allocation of the pool outlives the tree's knowledge of it).

``install()`` applies these when the names are there (torch 2.x); where a
torch lacks one, it sets ``cudagraph_trees = False`` instead, and logs it.
"""

from __future__ import annotations

import gc
import logging
import sys
from typing import Any, Iterable

__all__ = ["patch_trees", "NEEDED"]

NEEDED = (
    "_cuda_getCheckpointState",
    "_free_And_Remove_DeleterFn",
    "_has_Standard_Deleter",
    "_cuda_checkPoolLiveAllocations",
)
_TREES = "torch._inductor.cudagraph_trees"


class Checkpoint:
    """What ``_cuda_getCheckpointState`` returns under gpuptr: the device
    and pool, and nothing to restore (each graph keeps its own memory)."""

    __slots__ = ("device", "pool")

    def __init__(self, device: int, pool: Any):
        self.device = device
        self.pool = tuple(pool)

    def __repr__(self) -> str:
        return f"<gpuptr graph-tree checkpoint of pool {self.pool} on device {self.device}>"


def apply_checkpoint(manager: Any) -> None:
    """gpuptr's ``apply_checkpoint_execution_state_in_allocator``: nothing
    to restore in an allocator (each graph keeps its memory until it is
    destroyed, and outputs that died went back when PyTorch freed them);
    the path's cached tensors are dropped, as PyTorch's does."""
    node = manager.current_node
    assert node is not None and node.checkpointed_caching_state is not None
    manager.debug_checkpointing_counter += 1
    node.remove_path_cached_tensors()


def pool_live_within(device: int, pool: Any, storages: Iterable[int]) -> bool:
    """Whether every live allocation tagged with ``pool`` on ``device`` is
    among ``storages`` (data pointers); asked twice, around a
    ``gc.collect()``, as PyTorch does before its slow path."""
    live = set(storages)
    from gpuptr._torch_pool import live_in_pool

    if all(a in live for a in live_in_pool(device, pool)):
        return True
    gc.collect()
    return all(a in live for a in live_in_pool(device, pool))


def _patch_manager() -> None:
    trees = sys.modules.get(_TREES)
    cls = getattr(trees, "CUDAGraphTreeManager", None)
    if cls is None or getattr(cls, "__gpuptr_trees__", False):
        return
    cls.apply_checkpoint_execution_state_in_allocator = apply_checkpoint
    cls.__gpuptr_trees__ = True


def patch_trees(torch: Any) -> bool:
    """Answer graph trees' allocator calls (see the module); False, and
    nothing changed, where this torch lacks one of them."""
    C = torch._C
    if any(not hasattr(C, n) for n in NEEDED):
        return False
    if getattr(C._cuda_getCheckpointState, "__gpuptr_trees__", False):
        return True
    original_free = C._free_And_Remove_DeleterFn
    has_standard = C._has_Standard_Deleter

    def get_checkpoint_state(device: Any, pool: Any) -> Checkpoint:
        # Called by the tree after each recording, before any checkpoint is
        # applied: the manager's class is imported by then.
        _patch_manager()
        return Checkpoint(int(device), pool)

    def free_and_remove_deleter(storage: Any) -> None:
        if has_standard(storage):
            original_free(storage)
        # Else an output rebuilt on a replay, over its graph's memory,
        # which the graph keeps: there is nothing to free.

    def check_pool_live_allocations(device: Any, pool: Any, storages: Any) -> bool:
        return pool_live_within(int(device), pool, storages)

    for f in (get_checkpoint_state, free_and_remove_deleter, check_pool_live_allocations):
        setattr(f, "__gpuptr_trees__", True)
    C._cuda_getCheckpointState = get_checkpoint_state
    C._free_And_Remove_DeleterFn = free_and_remove_deleter
    C._cuda_checkPoolLiveAllocations = check_pool_live_allocations
    _patch_manager()
    logging.getLogger("gpuptr").debug(
        "CUDA graph trees on gpuptr: each graph keeps its own memory "
        "(no pool shared across a tree's graphs)"
    )
    return True

