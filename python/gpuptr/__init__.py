"""gpuptr: refcounted CUDA contexts and device pointers, from Rust.

Every pointer holds a real, retained CUDA context, and views hold their
allocation, so nothing can outlive what it points into::

    import gpuptr
    mem = gpuptr.alloc(1 << 20)            # on the current device
    mem.memset(0)
    half = mem.view(0, 1 << 19)            # keeps `mem`'s memory alive
    half.context.device.id, int(half.context.handle)

    ptr = gpuptr.wrap(cupy_array.data.ptr, cupy_array.nbytes, owner=cupy_array)
    ptr.context                            # resolved from the address

The driver is chosen by ``GPUPTR_DRIVER``: ``auto`` (default) or ``cuda``
use libcuda; ``sim`` uses gpuptr's host-memory simulator.
"""

from gpuptr._core import (
    Context,
    ContextHandle,
    Device,
    IpcHandle,
    ManagedMemory,
    MappedMemory,
    MemoryPointer,
    PinnedMemory,
    __version__,
    alloc,
    alloc_host,
    alloc_managed,
    begin_capture,
    capture_started,
    context,
    context_of,
    devices,
    driver_info,
    dump_snapshot,
    end_capture,
    flush_pool,
    graph_kept_bytes,
    is_capturing,
    open_ipc,
    probe_cuda,
    record_history,
    recording_history,
    register_host,
    release_contexts,
    reserve,
    reset_context,
    reset_peak_stats,
    outstanding,
    set_pool_limit,
    snapshot,
    stats,
    track,
    tracking,
    trim,
    wrap,
)
from gpuptr._errors import (
    CudaError,
    GpuptrError,
    InstallError,
    InvalidArgumentError,
    InvalidPointerError,
    NoDriverError,
    OutOfMemoryError,
)
from gpuptr._install import install
from gpuptr._capture import capturing
from gpuptr import _log  # noqa: F401,E402  (the core's records into logging)
from gpuptr._summary import memory_summary
from gpuptr._numbers import max_memory_allocated, max_memory_reserved, memory_allocated, memory_reserved
from gpuptr._types import ClassStats, ClientStats, DeviceStats, DriverInfo, HostStats, MemoryInfo, Outstanding
from gpuptr.interop import ArrayView, as_array, from_cuda_array_interface, from_dlpack

__all__ = [
    "ArrayView",
    "from_cuda_array_interface",
    "from_dlpack",
    "Context",
    "ContextHandle",
    "CudaError",
    "ClassStats",
    "ClientStats",
    "Device",
    "DeviceStats",
    "DriverInfo",
    "GpuptrError",
    "HostStats",
    "InstallError",
    "IpcHandle",
    "InvalidArgumentError",
    "InvalidPointerError",
    "ManagedMemory",
    "MappedMemory",
    "MemoryInfo",
    "MemoryPointer",
    "PinnedMemory",
    "NoDriverError",
    "OutOfMemoryError",
    "Outstanding",
    "__version__",
    "alloc",
    "alloc_host",
    "alloc_managed",
    "as_array",
    "context",
    "context_of",
    "devices",
    "driver_info",
    "dump_snapshot",
    "begin_capture",
    "capture_started",
    "capturing",
    "end_capture",
    "flush_pool",
    "graph_kept_bytes",
    "is_capturing",
    "install",
    "open_ipc",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_summary",
    "probe_cuda",
    "record_history",
    "recording_history",
    "register_host",
    "release_contexts",
    "reserve",
    "reset_context",
    "reset_peak_stats",
    "set_pool_limit",
    "outstanding",
    "snapshot",
    "stats",
    "track",
    "tracking",
    "trim",
    "wrap",
]
