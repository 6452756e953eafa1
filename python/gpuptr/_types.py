"""Small value types shared by the binding and the Python layer."""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, TypedDict

__all__ = ["ClassStats", "ClientStats", "DeviceStats", "DriverInfo", "HostStats", "MemoryInfo", "Outstanding"]


class MemoryInfo(NamedTuple):
    """Free and total device memory in bytes, as numba's ``MemoryInfo``."""

    free: int
    total: int


class DriverInfo(TypedDict):
    """What ``gpuptr.driver_info()`` returns."""

    #: ``"cuda"`` or ``"sim"``.
    driver: str
    #: As ``cuDriverGetVersion``: 13000 for CUDA 13.0.
    version: int
    #: ``"13.0"``.
    version_string: str
    device_count: int


class ClientStats(TypedDict):
    """One library's share of a device's allocations, in ``DeviceStats``."""

    live_bytes: int
    live_count: int
    #: Allocations it made so far.
    alloc_count: int


class HostStats(TypedDict):
    """A device's cache of pinned host memory, in ``DeviceStats["host"]``:
    ``alloc_host``, CuPy's pinned allocator and numba's pinned and mapped
    arrays through gpuptr (registered memory is never cached). Pinned
    memory of a size the cache does not keep (over ``cache_limit``, or
    with the cache off) comes from the driver and goes back to it at its
    free, and is not counted here."""

    #: Bytes of pinned blocks held from the driver (handed out or cached).
    held_bytes: int
    #: Bytes handed out now (as requested), and how many blocks.
    live_bytes: int
    live_count: int
    #: Bytes cached for reuse: ready, or waiting for a fence.
    cached_bytes: int
    #: The part of ``cached_bytes`` waiting for a fence.
    pending_bytes: int
    #: Allocations served from the cache, and those that went to the driver.
    hits: int
    misses: int
    #: The most bytes the cache keeps (``GPUPTR_HOST_CACHE``; 0: no cache).
    cache_limit: int


class DeviceStats(TypedDict):
    """One device's entry in ``gpuptr.stats()``, in bytes and counts."""

    device: int
    #: Memory handed out now, and how many allocations.
    live_bytes: int
    live_count: int
    #: The most ``live_bytes`` has been (``reset_peak_stats()`` lowers it).
    peak_bytes: int
    #: Allocations made so far.
    alloc_count: int
    #: Held by the pool for reuse: ready, on a stream's list, or pending.
    cached_bytes: int
    #: The part of ``cached_bytes`` waiting for a fence.
    pending_bytes: int
    pool_hits: int
    pool_misses: int
    #: Fences (batches of freed blocks made safe for reuse) completed.
    fences: int
    #: The allocations per client: ``"direct"`` (``gpuptr.alloc``),
    #: ``"numba"``, ``"cupy"``, ``"torch"``, ``"cuda_core"`` and ``"rmm"``
    #: (gpuptr's allocator plugins).
    clients: Dict[str, ClientStats]
    #: Bytes the pool holds from the driver (handed out or cached), and the
    #: cap ``set_pool_limit()`` put on them (None: none).
    pool_bytes: int
    pool_limit: Optional[int]
    #: The most ``pool_bytes`` has been since ``reset_peak_stats()``.
    peak_pool_bytes: int
    #: Bytes held from the driver: the pool's, and live allocations that
    #: bypass it (``memory_reserved()``).
    reserved_bytes: int
    #: Allocations that failed as out of memory after the pool gave its
    #: cache back and retried, and allocations it retried so (PyTorch's
    #: ``num_ooms`` and ``num_alloc_retries``).
    num_ooms: int
    num_alloc_retries: int
    #: The cache of pinned host memory.
    host: HostStats
    #: The pool's driver allocations as PyTorch counts segments: ``count``
    #: and ``bytes``, each by pool (``all``, ``small_pool``: blocks of at
    #: most 1 MiB, ``large_pool``) of ``current``, ``peak`` (since
    #: ``reset_peak_stats()``), ``allocated`` and ``freed`` (totals).
    segments: Dict[str, Dict[str, Dict[str, int]]]


#: One size class of a device's pool (``_core.pool_classes``): the block
#: size in bytes (``class``), and blocks handed out now, the most at once,
#: and held for reuse.
ClassStats = TypedDict(
    "ClassStats", {"class": int, "live_blocks": int, "peak_blocks": int, "cached_blocks": int}
)


class Outstanding(TypedDict):
    """One site of ``gpuptr.outstanding()``: the live allocations made there
    while tracking was on."""

    #: The Python stack, innermost first (``file:line in function``, joined
    #: by ``" <- "``), or a Rust ``file:line``.
    site: str
    count: int
    bytes: int
    devices: List[int]
    #: ``"direct"``, ``"numba"``, ``"cupy"``, ``"torch"``, ``"cuda_core"``
    #: or ``"rmm"``.
    clients: List[str]
