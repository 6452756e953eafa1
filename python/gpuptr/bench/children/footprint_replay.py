"""One footprint row's replay: ``footprint_replay.py ALLOCATOR TRACE.json``
allocates and frees the trace's blocks under ``gpuptr``, ``torch`` (its
caching allocator), ``gpuptr-ordered`` (``gpuptr.alloc`` on stream 0,
stream-ordered as PyTorch and CuPy are under ``gpuptr.install()``), ``cupy`` (its default pool) or ``rmm`` (a
``PoolMemoryResource`` with an initial size of 0: its default, half the
GPU, would say nothing of the trace), reading the bytes the allocator
holds from the device after every allocation; prints ``{"peak_held": ...,
"peak_live": ...}``."""

import json
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

Alloc = Callable[[int], Any]
Held = Callable[[], int]


def allocator(which: str) -> Tuple[Alloc, Held, Optional[Held]]:
    """The allocation call, the bytes held now, and the peak held where the
    allocator keeps one (else the replay's own reads are the peak)."""
    if which in ("gpuptr", "gpuptr-ordered"):
        import gpuptr

        stream = 0 if which == "gpuptr-ordered" else None
        return lambda n: gpuptr.alloc(n, stream=stream), lambda: int(gpuptr.stats()[0]["pool_bytes"]), lambda: int(
            gpuptr.stats()[0]["peak_pool_bytes"]
        )
    if which == "torch":
        import torch

        return (
            lambda n: torch.empty(n, dtype=torch.uint8, device="cuda"),
            lambda: int(torch.cuda.memory_reserved()),
            lambda: int(torch.cuda.max_memory_reserved()),
        )
    if which == "cupy":
        import cupy

        pool = cupy.get_default_memory_pool()
        return cupy.cuda.alloc, lambda: int(pool.total_bytes()), None
    import rmm

    mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=0)
    rmm.mr.set_current_device_resource(mr)
    return lambda n: rmm.DeviceBuffer(size=n), lambda: int(mr.pool_size()), None


def main() -> None:
    alloc, held, peak = allocator(sys.argv[1])
    with open(sys.argv[2]) as f:
        ops: List[List[int]] = json.load(f)
    live: Dict[int, Any] = {}
    sizes: Dict[int, int] = {}
    total = top_live = top_held = 0
    for k, n in ops:
        if n:
            live[k] = alloc(n)
            sizes[k] = n
            total += n
            top_live = max(top_live, total)
            top_held = max(top_held, held())
        elif k in live:
            del live[k]
            total -= sizes.pop(k)
    if peak is not None:
        top_held = max(top_held, peak())
    print(json.dumps({"peak_held": top_held, "peak_live": top_live}))


main()
