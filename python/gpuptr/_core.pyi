"""Type stubs for gpuptr's native module."""

import ctypes
import os
from typing import Any, Callable, NoReturn, Optional, Self, TypeVar, Union, final, overload

from gpuptr._types import ClassStats, DeviceStats, DriverInfo, Outstanding

from gpuptr._types import MemoryInfo


#: A CUDA stream argument: None, an int handle (0 and 1: the legacy default
#: stream, 2: the per-thread one), or a numba, CuPy, torch or cuda.core
#: stream object (anything with ``__cuda_stream__``, ``handle``, ``ptr`` or
#: ``cuda_stream``).
_Stream = object
_Buffer = TypeVar("_Buffer")

__all__ = [
    "Context",
    "ContextHandle",
    "Device",
    "MemoryPointer",
    "PinnedMemory",
    "MappedMemory",
    "ManagedMemory",
    "alloc_host",
    "register_host",
    "register_host_ptr",
    "alloc_managed",
    "context",
    "alloc",
    "wrap",
    "context_of",
    "driver_info",
    "devices",
    "probe_cuda",
    "stats",
    "release_contexts",
    "trim",
    "begin_capture",
    "end_capture",
    "is_capturing",
    "capture_started",
    "graph_kept_bytes",
    "_current_device",
    "flush_pool",
    "reserve",
    "set_pool_limit",
    "pool_classes",
    "reset_peak_stats",
    "reset_context",
    "_dlpack_consume",
    "_dlpack_export",
    "_layout",
    "IpcHandle",
    "open_ipc",
    "_alloc_for",
    "track",
    "tracking",
    "outstanding",
    "record_history",
    "recording_history",
    "snapshot",
    "dump_snapshot",
    "_set_log_level",
    "_flush_log",
    "_hooks_configure",
    "_hooks_record_stream",
    "_hooks_state",
    "_cupy_c_hooks",
    "_cupy_malloc",
    "_cupy_malloc_current",
    "_cupy_set_stream_source",
    "_cuda_core_buffer",
    "_cupy_free",
    "_cupy_set_oom_error",
    "_rmm_alloc",
    "_rmm_free",
    "_hooks_torch_errors",
    "_hooks_torch_oom_missing",
    "_torch_counts",
    "_torch_reset_peak",
    "_torch_reset_accumulated",
    "_torch_pool_begin",
    "_torch_pool_end",
    "_torch_pool_live",
    "_torch_pool_counts",
    "_torch_lend",
    "_torch_is_live",
    "TorchLoan",
    "_dtype_info",
    "DLPackOwner",
    "_import_cai",
    "_import_dlpack",
    "ImportedArray",
    "__version__",
]

__version__: str

@final
class Device:
    """A device; ``id`` is its ordinal."""

    id: int
    def __new__(cls, id: int) -> Device: ...
    @property
    def name(self) -> str:
        """The device's name (`cuDeviceGetName`)."""
    @property
    def total_memory(self) -> int:
        """Total device memory in bytes (`cuDeviceTotalMem`)."""
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...

@final
class ContextHandle:
    """A ``CUcontext``: ``.value`` and ``int()`` give its address."""

    value: int
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...

@final
class Context:
    """A device's retained primary context."""

    device: Device
    handle: ContextHandle
    def memalloc(self, size: int) -> MemoryPointer:
        """Allocate `size` bytes in this context (numba's `Context.memalloc`)."""
    def get_memory_info(self) -> MemoryInfo:
        """`MemoryInfo(free, total)` from `cuMemGetInfo`."""
    def synchronize(self) -> None:
        """Wait for all work in this context to finish."""
    def stream_synchronize(self, stream: _Stream) -> None:
        """Wait for the work queued on ``stream`` (an int handle, or a numba or
        CuPy stream object) to finish.
        """
    def push(self) -> None:
        """Make this context current on the calling thread."""

class MemoryPointer:
    """Device memory with numba-cuda's MemoryPointer protocol."""

    __cuda_memory__: bool
    def __new__(
        cls,
        context: object,
        pointer: object,
        size: int,
        owner: object = None,
        finalizer: Optional[Callable[[], object]] = None,
    ) -> MemoryPointer: ...
    @property
    def context(self) -> Context:
        """The context the memory lives in: a real, retained gpuptr `Context`."""
    @property
    def device_pointer(self) -> Any:
        """The address as a `cuda.bindings.driver.CUdeviceptr` (an int when
        cuda-bindings is not installed), made on first use.
        """
    @property
    def device_pointer_value(self) -> Optional[int]:
        """The address as an int, or None for a null pointer."""
    @property
    def device_ctypes_pointer(self) -> ctypes.c_size_t:
        """The address as a `ctypes.c_size_t`."""
    @property
    def handle(self) -> Any:
        """numba's `handle`: the same as `device_pointer`."""
    @property
    def size(self) -> int:
        """Size in bytes."""
    @property
    def nbytes(self) -> int:
        """Size in bytes (CuPy's and numpy's name; the same as ``size``)."""
    def __enter__(self) -> Self:
        """``with gpuptr.alloc(n) as m:``: the memory itself, freed when the
        block ends (as ``free()``; a view frees nothing), like cuda.core's
        ``Buffer`` and files.
        """
    def __exit__(self, *_exc: object) -> bool:
        """Free the memory (as ``free()``); exceptions from the block pass on."""
    @property
    def _cuda_memsize_(self) -> int:
        """Size in bytes (numba's `device_memory_size` reads this)."""
    @property
    def owner(self) -> object:
        """The object that owns the memory: the given owner, else this pointer."""
    @property
    def stream(self) -> Optional[int]:
        """The stream the memory is ordered on (allocated with ``stream=`` and
        used on no other): work queued there may still use it. None for
        memory any stream may use now. The legacy default stream is 1.
        """
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """..."""
    def __dlpack__(
        self,
        *,
        stream: Optional[int] = None,
        max_version: Optional[tuple[int, int]] = None,
        dl_device: Optional[tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> object:
        """..."""
    def __dlpack_device__(self) -> tuple[int, int]:
        """..."""
    def __array__(self, *args: object, **kwargs: object) -> NoReturn:
        """..."""
    @property
    def refct(self) -> int:
        """How many pointer objects (this one, its views, `own()` handles) share
        the allocation.
        """
    @property
    def is_managed(self) -> bool:
        """Whether `free()` releases the memory (gpuptr allocations, and wraps
        made with a finalizer).
        """
    @property
    def offset(self) -> int:
        """Offset of this pointer from the start of its allocation."""
    @property
    def freed(self) -> bool:
        """Whether the memory was freed."""
    @property
    def live(self) -> bool:
        """Whether the memory may be used now: not freed, its context not
        reset (and, for mapped memory, its host memory not released).
        """
    def own(self) -> MemoryPointer:
        """Another handle on the same memory; the allocation lives while any does."""
    def free(self, stream: _Stream = None) -> None:
        """Release the memory now. A second call, or a call on a view or a
        non-owning wrap, does nothing. Views of freed memory raise
        `InvalidPointerError` when used.

        With ``stream``, the free is stream-ordered (as ``cudaFreeAsync``):
        every use was queued on ``stream`` (or declared with
        ``record_stream``), so the block is reused at once on that stream and
        by others after a fence. Without it, the block is reused only once all
        work queued before now, on every stream, is done. While numpy arrays
        or memoryviews of host-reachable memory are alive this raises
        ``BufferError``. On mapped memory gpuptr pinned, or another handle of
        it (``own()``), its host memory goes too, as ``MappedMemory.free()``.
        """
    def ipc_handle(self) -> IpcHandle:
        """A picklable ``IpcHandle`` another process opens to use this memory
        (device memory gpuptr allocated, or a wrap of it with its pointer as
        owner; not managed, host or other wrapped memory, which raise
        ``InvalidArgumentError``, as any memory does when no liveness record
        is left: 65,536 allocations exported and live at once, or no
        ``/dev/shm``). Every handle of one allocation shares its record,
        which bounds it to the allocation in another process (a handle
        without one does not open there); an empty view's handle opens to
        an empty view.
        """
    def record_stream(self, stream: _Stream) -> None:
        """Declare that the memory is also used on ``stream`` (as torch's
        ``record_stream``): its block is then reused only after all work on
        every stream queued before its free is done.
        """
    def memset(self, byte: int, count: Optional[int] = None, stream: _Stream = None) -> None:
        """Set ``count`` bytes (default: all) to ``byte``, on ``stream``
        (0: synchronously).
        """
    def view(self, start: int, stop: Optional[int] = None) -> MemoryPointer:
        """A pointer to bytes ``[start, stop)`` of this one (``stop`` defaults to
        the end). It keeps the allocation alive. Bounds past the end, or
        reversed, raise `InvalidPointerError`; a negative one
        `InvalidArgumentError`.
        """
    def copy_from_host(self, src: object, stream: _Stream = None) -> None:
        """Copy a C-contiguous host buffer (bytes, numpy array, ...) to the
        start of this memory, on ``stream`` if given (it returns once the
        buffer may be reused). Other Python threads run during the copy, as
        they do during numba's.
        """
    def copy_to_host(self, dst: Optional[_Buffer] = None, stream: _Stream = None) -> Union[bytes, _Buffer]:
        """Copy this memory to the host: into the writable buffer ``dst`` if
        given (exactly this memory's size), else into new ``bytes``; on
        ``stream`` if given (it returns once the bytes are there). Other
        Python threads run during the copy.
        """
    def copy_from_device(self, src: MemoryPointer, count: Optional[int] = None, stream: _Stream = None) -> None:
        """Copy ``count`` bytes (default: all of ``src``) from device memory
        ``src`` to the start of this memory, on ``stream`` if given.
        """

def context(device: Optional[int] = None) -> Context:
    """The context of `device` (default, or None: 0): one object per device."""
def alloc(nbytes: int, device: Optional[int] = None, stream: _Stream = None) -> MemoryPointer:
    """Allocate ``nbytes`` of device memory on ``device`` (default: the current
    context's device, else 0), from the device's pool.

    Without ``stream`` the memory may be used on any stream: when it is
    freed, its block is reused only after all work queued before the free,
    on every stream, is done. With ``stream`` (an int handle, or a numba,
    CuPy or torch stream) the allocation is stream-ordered, as
    ``cudaMallocAsync``: a block freed on that stream is reused at once, and
    the memory is freed on it when dropped (``record_stream`` declares other
    streams it is used on).
    """
def wrap(address: object, nbytes: int, owner: object = None, context: Optional[Context] = None) -> MemoryPointer:
    """Wrap ``nbytes`` at ``address`` as a MemoryPointer that keeps ``owner``
    alive. Without ``context``, the context is resolved from the address
    itself, never from the current one. Where ``owner`` is a gpuptr pointer
    over memory gpuptr allocated that holds the range, the wrap is a view
    of it, in its context: freeing ``owner`` turns the wrap stale
    (``InvalidPointerError``), as it does every view. Any other wrap is
    numba's non-owning MemoryPointer: its memory is the caller's to keep
    alive.
    """
def context_of(address: object) -> Context:
    """The context of the memory at ``address``: a registry lookup for memory
    gpuptr knows, one driver query otherwise.
    """
def driver_info() -> DriverInfo:
    """Which driver is in use, its version and the device count."""
def devices() -> list[Device]:
    """The devices, as `Device` objects."""
def probe_cuda() -> tuple[bool, Union[int, str]]:
    """Whether the CUDA driver can be used here, without opening it for use:
    ``(True, version)`` or ``(False, reason)``.
    """
def stats() -> list[DeviceStats]:
    """Allocation statistics per device: live bytes and count, peak, the number
    of allocations made, the pool's cached bytes, hits, misses and fences,
    ``clients``: live bytes and count, and allocations made, per client
    (``"direct"``, ``"numba"``, ``"cupy"``, ``"torch"``, ``"cuda_core"``,
    ``"rmm"``), and
    ``host``: the cache of pinned host memory (held, live, cached and pending
    bytes, hits, misses, and its limit), and ``segments``: the pool's driver
    allocations as PyTorch counts segments (``count`` and ``bytes``, each
    ``all``/``small_pool``/``large_pool`` of
    ``current``/``peak``/``allocated``/``freed``; small: blocks of at most
    1 MiB).
    """
def release_contexts() -> None:
    """Drop gpuptr's own hold on contexts; each is released once no pointer
    holds it.
    """

@final
class PinnedMemory:
    """Page-locked host memory; exports its bytes (buffer protocol)."""

    def __new__(
        cls, context: object, pointer: object, size: int, owner: object = None, finalizer: Optional[Callable[[], object]] = None
    ) -> PinnedMemory: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...
    def __array__(self, *args: object, **kwargs: object) -> NoReturn:
        """..."""
    @property
    def context(self) -> Context:
        """The context the memory is pinned in."""
    @property
    def ptr(self) -> int:
        """The host address (an int): CuPy's name for it (``host_pointer``), so
        a ``cupy.cuda.PinnedMemoryPointer`` can hold this memory directly.
        """
    @property
    def host_pointer(self) -> int:
        """The host address (an int)."""
    @property
    def handle(self) -> int:
        """numba's ``handle``: the host address."""
    @property
    def size(self) -> int:
        """Size in bytes."""
    @property
    def owned(self) -> object:
        """The object whose memory this is (registered memory), if any."""
    @property
    def readonly(self) -> bool:
        """Whether the bytes are read-only (registered from a read-only object)."""
    @property
    def is_managed(self) -> bool:
        """Whether ``free()`` releases the memory."""
    def own(self) -> PinnedMemory:
        """numba's ``own()``: pinned memory is its own owner."""
    def free(self) -> None:
        """Release (free or unregister) now; a second call does nothing. While
        numpy arrays or memoryviews of it are alive this raises
        ``BufferError`` (as ``mmap.close()`` does) and releases nothing.
        """

@final
class MappedMemory(MemoryPointer):
    """Host memory mapped into the device; exports its host bytes."""

    def __new__(
        cls, context: object, pointer: object, size: int, owner: object = None, finalizer: Optional[Callable[[], object]] = None
    ) -> MappedMemory: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...
    @property
    def host_pointer(self) -> int:
        """The host address (an int)."""
    @property
    def owned(self) -> object:
        """The object whose memory this is (registered memory), if any."""
    @property
    def readonly(self) -> bool:
        """Whether the bytes are read-only (registered from a read-only object)."""
    def own(self) -> MappedMemory:
        """numba's ``own()``: mapped memory is its own owner, as pinned memory
        is, so a handle keeps it alive and its ``free()`` is this one's.
        """
    def free(self) -> None:  # type: ignore[override]
        """Release the host memory now (when this pointer manages it). While
        numpy arrays or memoryviews of it are alive this raises
        ``BufferError`` and releases nothing.
        """

@final
class ManagedMemory(MemoryPointer):
    """Managed (unified) memory; exports its bytes."""

    def __new__(
        cls, context: object, pointer: object, size: int, owner: object = None, finalizer: Optional[Callable[[], object]] = None
    ) -> ManagedMemory: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

def alloc_host(nbytes: int, mapped: bool = False, portable: bool = False, wc: bool = False, device: Optional[int] = None) -> Union[PinnedMemory, MappedMemory]:
    """Allocate ``nbytes`` of pinned host memory on ``device`` (default: the
    current one). With ``mapped``, it is mapped into the device and returned
    as a `MappedMemory`, else as a `PinnedMemory`.

    It comes from the device pool's cache of pinned memory: a block freed
    earlier with the same ``mapped``, ``portable`` and ``wc`` flags, reused
    only once all work queued before its free, on every stream, is done.
    """
def register_host(obj: Any, mapped: bool = False, portable: bool = False, device: Optional[int] = None) -> Union[PinnedMemory, MappedMemory]:
    """Pin the memory of ``obj`` (any writable or read-only C-contiguous
    buffer: numpy array, bytearray, ...) in place, keeping ``obj`` alive until
    it is unregistered. With ``mapped``, returns a `MappedMemory`.
    """
def alloc_managed(nbytes: int, attach_global: bool = True, device: Optional[int] = None) -> ManagedMemory:
    """Allocate ``nbytes`` of managed (unified) memory on ``device`` (default:
    the current one), attached globally (or to the host).
    """
@final
class ImportedArray:
    """An imported strided device array: a MemoryPointer starting where the
    array's memory starts, and the layout over it."""
    @property
    def pointer(self) -> MemoryPointer:
        """The memory the array spans, keeping the exporter alive."""
    @property
    def shape(self) -> tuple[int, ...]:
        """Elements per dimension."""
    @property
    def strides(self) -> tuple[int, ...]:
        """Bytes between neighbours in each dimension."""
    @property
    def typestr(self) -> str:
        """The element type, as the array interface writes it (``"<f4"``)."""
    @property
    def itemsize(self) -> int:
        """Bytes per element."""
    @property
    def readonly(self) -> bool:
        """Whether the exporter marked it read-only."""
    @property
    def offset(self) -> int:
        """Bytes from the start of ``pointer`` to element 0 (non-zero only
        with negative strides).
        """
    @property
    def stream(self) -> Optional[int]:
        """The stream the exporter named (the interface's v3), or None."""
    @property
    def dtype(self) -> Optional[str]:
        """The element type's name (``"float32"``, ``"bfloat16"``), or None
        for a typestr that names none (``"|V16"``).
        """

def _import_cai(desc: dict[str, Any], owner: object = None, sync: bool = True) -> ImportedArray:
    """Import a CUDA Array Interface dict (v0-v3) as an ``ImportedArray``.
    With ``sync`` and a named stream, waits for that stream (v3's rule)
    unless it is idle.
    """
def _import_dlpack(capsule: object) -> ImportedArray:
    """Import a DLPack ``"dltensor"`` or ``"dltensor_versioned"`` capsule as an
    ``ImportedArray``, consuming it as the protocol asks: the capsule is
    renamed ``"used_…"``, and the pointer keeps an owner that calls the
    tensor's deleter when the last holder goes (also when the import fails).
    """
def trim(*, host: bool = True) -> int:
    """Return every block the pool caches to the driver; the bytes freed
    (CuPy's ``free_all_blocks``). With ``host=False`` the cache of pinned
    host memory stays (PyTorch's ``empty_cache()`` leaves pinned memory
    alone).
    """
def begin_capture(device: Optional[int] = None) -> None:
    """Tell gpuptr that a stream capture (a CUDA graph) begins on ``device``
    (default: the current device). Until the matching ``end_capture``, the
    pool runs no fence: CUDA refuses ``cuCtxSynchronize`` of a context while
    any stream of it captures, in every capture mode, and that invalidates
    the capture. A
    fence already running is waited for first. Blocks freed meanwhile wait
    for the fence after the capture; an allocation that runs out of memory
    meanwhile raises ``OutOfMemoryError`` without waiting for a fence. Calls
    nest. ``gpuptr.install()`` makes these calls around CuPy's and PyTorch's
    own captures; gpuptr's allocations and frees need none (they run in
    relaxed capture mode).
    A thread that ends with captures it began still under way ends them, with
    a warning, before ``Thread.join()`` returns.
    """
def end_capture(device: Optional[int] = None) -> None:
    """End a capture begun with ``begin_capture`` on ``device`` (default: the
    current device) by the calling thread. ``InvalidArgumentError`` (and
    nothing ends) when this thread has no such capture under way there.
    """
def capture_started(stream: Any, device: Optional[int] = None) -> None:
    """Tell gpuptr that the capture ``stream`` takes part in has begun (call
    it after ``begin_capture`` and the library's own begin): its memory is
    then kept for its graph. Pool blocks allocated during the capture (on a
    stream that takes part in it, or by this thread), and blocks this thread
    frees during it, are reused only after the graph, and every executable
    graph made from it, is destroyed. ``gpuptr.install()`` calls it for
    CuPy's and PyTorch's captures. ``stream`` is a live stream handle (an
    int or a stream object) of ``device``; ``InvalidArgumentError`` if it is
    not capturing.
    """
def _current_device() -> int:
    """The current device (``device=None`` in the functions that take one)."""
def graph_kept_bytes(device: Optional[int] = None) -> int:
    """Bytes of ``device``'s pool (default: the current device) that CUDA
    graphs keep: freed, and reused once their graph is destroyed.
    """
def is_capturing(device: Optional[int] = None) -> bool:
    """Whether a capture begun with ``begin_capture`` is under way on
    ``device`` (default: the current device).
    """
def flush_pool(device: Optional[int] = None) -> bool:
    """Wait until every block freed so far on ``device`` (default: all devices
    with a context) has passed its fence and is ready for reuse; the
    allocator itself never waits. ``False`` if a fence failed.
    """
def reserve(nbytes: Union[int, float, str], block_size: Union[int, str, None] = None, device: Optional[int] = None) -> int:
    """Fill the pool ahead of demand with about ``nbytes`` of ready blocks of
    ``block_size`` bytes (default 1 MiB; as RMM's initial pool size), on ``device`` (default:
    the current one). Allocations of that size then make no driver call
    until the blocks are used, also while a busy GPU holds freed blocks back.
    ``nbytes`` is an int, a size (``"2GiB"``) or a share of what the device
    has free (``0.5``, ``"50%"``). More than the device has free raises
    ``OutOfMemoryError`` and reserves nothing. Returns the bytes reserved
    (fewer if the pool limit stops it part way; none at all raises
    ``OutOfMemoryError``, naming the limit); ``trim()`` gives them back.
    """
def pool_classes(device: int) -> list[ClassStats]:
    """The pool of ``device`` by size class: a list of dicts with ``class``
    (the block size), ``live_blocks``, ``peak_blocks`` and ``cached_blocks``,
    smallest class first.
    """
def reset_peak_stats() -> None:
    """Make every device's peak bytes equal to its live bytes now."""
def reset_context(device: int) -> None:
    """gpuptr's side of a reset of ``device``'s context (numba's
    ``cuda.close()``, before numba resets it): cached blocks go back to the
    driver, and every live pointer turns stale (using it raises
    `InvalidPointerError`; freeing it does nothing). Call it only when the
    context is reset next (``cuDevicePrimaryCtxReset``): the memory of live
    pointers and pinned registrations is left to that reset, which frees it
    (gpuptr must not free it, as it may already be another owner's after a
    reset). Without a reset it stays allocated until the context is reset or
    released by every holder, or the process ends.
    """

@final
class DLPackOwner:
    """Owns a consumed DLPack tensor; calls its deleter when dropped."""

def _dlpack_export(
    pointer: MemoryPointer,
    shape: tuple[int, ...],
    strides: Optional[tuple[int, ...]],
    dtype: str,
    readonly: bool,
    producer_stream: Optional[int],
    stream: Optional[int] = None,
    max_version: Optional[tuple[int, int]] = None,
    dl_device: Optional[tuple[int, int]] = None,
    copy: Optional[bool] = None,
) -> object:
    """Export an array over ``pointer`` (element 0 at its address, byte
    ``strides`` or None for C order, element type ``dtype`` by name) as a
    DLPack capsule for a consumer's ``__dlpack__`` call. ``producer_stream``
    is a stream whose queued work may still use the memory.
    """
def _alloc_for(client: str, nbytes: int, device: Optional[int] = None, stream: _Stream = None) -> MemoryPointer:
    """``alloc`` on behalf of ``client`` (``"numba"``, ``"cupy"``, ``"torch"``, ``"cuda_core"``,
    ``"rmm"`` or ``"direct"``), counted under that client in ``stats()``. The hook
    for gpuptr's own allocator plugins.
    """
@final
class IpcHandle:
    """..."""
    @property
    def device(self) -> int:
        """The device the memory is on."""
    @property
    def offset(self) -> int:
        """Bytes from the start of the exporter's driver allocation (a pool
        block lies inside a larger one).
        """
    @property
    def size(self) -> int:
        """Bytes of memory."""
    @property
    def pid(self) -> int:
        """The exporting process's id."""
    def to_bytes(self) -> bytes:
        """The handle as bytes (what pickling stores)."""
    @staticmethod
    def from_bytes(data: bytes) -> IpcHandle:
        """A handle from ``to_bytes()``; other bytes raise
        ``InvalidArgumentError``.
        """
    def __reduce__(self) -> tuple[object, tuple[bytes]]: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def open(self) -> MemoryPointer:
        """The memory this handle names (see the class)."""

def _cuda_core_buffer(make: Callable[[int, int, None, None, Optional[MemoryPointer]], _Buffer], nbytes: int, device: int) -> _Buffer:
    """gpuptr.cuda_core's allocation: ``nbytes`` from ``device``'s pool under
    the ``"cuda_core"`` client, handed to ``make(address, nbytes, None, None,
    owner)`` (the shape of cuda.core's ``Buffer._init``: no memory resource,
    an owner), whose result is returned. ``owner`` is the MemoryPointer that
    owns the block: the Buffer frees it into the pool (through the fence)
    when cuda.core drops the owner, with no Python call. Zero bytes give
    ``make(0, 0, None, None, None)``. If ``make`` raises, the block is freed.
    """
def open_ipc(handle: IpcHandle) -> MemoryPointer:
    """``handle.open()``: the memory an ``IpcHandle`` names."""
def set_pool_limit(nbytes: Union[int, float, str, None], device: Optional[int] = None) -> None:
    """Cap the bytes the pool of ``device`` (default: every device) holds from
    the driver at ``nbytes`` (None: no cap, the default), as RMM's maximum
    pool size. ``nbytes`` is an int of bytes, a size (``"40GB"``,
    ``"40GiB"``, ``"512M"``), or a share of each device's memory (``0.8``,
    ``"80%"``). Past it an allocation reuses and returns the cache first,
    then raises ``OutOfMemoryError``, whose message names the limit.
    ``stats()`` shows ``pool_bytes`` and ``pool_limit``. Without a pool
    (``GPUPTR_POOL=0``) a limit raises ``InvalidArgumentError``.
    """
def track(enabled: bool = True) -> None:
    """Turn the leak report on (or off): while on, every allocation gpuptr
    makes records where it was made (the Python stack, or the Rust location
    for Rust callers) until it is released. ``GPUPTR_TRACK=1`` turns it on at
    start. Allocations made while it is off are not listed.
    """
def tracking() -> bool:
    """Whether the leak report is on."""
def outstanding() -> list[Outstanding]:
    """The live allocations made while tracking was on, grouped by where they
    were made, the most bytes first: dicts of ``site`` (the stack, innermost
    first), ``count``, ``bytes``, ``devices`` and ``clients``.
    """
def record_history(
    enabled: bool = True,
    max_entries: Optional[int] = None,
    oom_snapshot: Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]", None] = None,
) -> None:
    """Start (or stop) recording the allocation history, as PyTorch's
    ``torch.cuda.memory._record_memory_history``, for every library on
    gpuptr's pool: each allocation and free (with the Python stack of the
    allocation and the client that asked: ``direct``, ``numba``, ``cupy``,
    ``torch``, ``cuda_core`` or ``rmm``), each driver allocation of the
    pool, and each out of memory. Started, the trace begins afresh and
    keeps the newest ``max_entries`` events; stopped, nothing more is
    recorded and what was stays for ``snapshot()``. ``GPUPTR_HISTORY=1``
    starts it at start-up.

    ``oom_snapshot``: a path (``str``, ``bytes`` or ``os.PathLike``) where a snapshot is
    written when an allocation runs out of memory (its error then names the
    file), as ``GPUPTR_OOM_SNAPSHOT`` does; ``""`` writes none; ``None``
    (the default) leaves the setting as it is. A snapshot that cannot be
    written is logged and named in the error, never raised.

    Off, an allocation pays one relaxed load (shared with ``track()``); on,
    about the cost of the leak report (the stack walk, 32 frames at most).
    """
def recording_history() -> bool:
    """Whether the allocation history records."""
def snapshot() -> dict[str, Any]:
    """The memory snapshot now, as ``torch.cuda.memory._snapshot()`` gives it:
    a dict of ``segments`` (each driver allocation of every device's pool,
    its blocks with their ``state``, sizes and ``frames``),
    ``device_traces`` (the history, one list per device),
    ``allocator_settings`` and ``external_annotations``. Each allocation's
    block and trace entries also have ``client``, and their first frame is
    ``{"filename": "gpuptr", "line": 0, "name": "client=NAME"}``.
    """
def dump_snapshot(path: Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]) -> None:
    """Write the memory snapshot (see ``snapshot()``) to ``path`` as a pickle,
    the file ``python -m torch.cuda._memory_viz trace_plot`` (and the viewer
    at pytorch.org/memory_viz) reads. It is written beside ``path`` and
    renamed over it, so no reader sees half of it. A directory that does not
    exist, or one that cannot be written, raises the ``OSError`` that says
    so (``FileNotFoundError``, ``PermissionError``, ...), naming ``path``.
    ``path`` is a ``str``, ``bytes`` or path-like object, as ``open`` takes.
    """
def _set_log_level(level: int) -> None:
    """Set the level records are kept at, from a Python logging level (the
    `gpuptr` logger's effective level), and deliver what is queued. Any int
    is a level (``setLevel(2**70)`` is allowed, and turns records off).
    """
def _flush_log() -> None:
    """Deliver the records the core queued (gpuptr's entry points do this
    themselves; this is for the end of a program, or a test).
    """
def _torch_pool_begin(device: int, pool: tuple[int, int], all_threads: bool = False) -> None:
    """Allocations on ``device`` go to ``pool`` from now: this thread's
    (``all_threads=False``, ``_cuda_beginAllocateCurrentThreadToPool``) or
    every thread's (``_cuda_beginAllocateToPool``), until
    ``_torch_pool_end``.
    """
def _torch_pool_end(device: int, pool: tuple[int, int]) -> bool:
    """Allocations on ``device`` no longer go to ``pool`` (the latest begin of
    it on this thread, else for all threads). Whether one was under way.
    """
def _torch_pool_live(device: int, pool: tuple[int, int]) -> list[tuple[int, int]]:
    """The live allocations of ``pool`` on ``device``: ``(address, bytes)``
    pairs, by address.
    """
def _torch_pool_counts(device: int, pool: tuple[int, int]) -> dict[str, int]:
    """The counts of ``pool`` on ``device`` (zeros for a pool that never
    allocated): ``live``, ``live_bytes``, ``peak_bytes``, ``allocations``,
    ``allocated_bytes``, ``frees``, ``freed_bytes``.
    """
@final
class TorchLoan:
    """A PyTorch allocation lent to another process: until it is dropped, a
    free by PyTorch leaves the release to it.
    """
def _torch_lend(address: int) -> tuple[bytes, TorchLoan]:
    """An IPC handle (as bytes) of the PyTorch allocation that starts at
    ``address``, and a loan that keeps it alive. ``InvalidPointerError`` for
    an address the hooks did not hand out (or freed).
    """
def _torch_is_live(address: int) -> bool:
    """Whether ``address`` starts a live allocation of gpuptr's PyTorch hooks."""
def _hooks_configure(stream_ordered: bool) -> None:
    """Set how the C entry points free memory: ordered on the allocating
    stream (``True``, PyTorch's own rule), or through the pool's fence
    (``False``).
    """
def _hooks_record_stream(address: int, stream: int) -> bool:
    """Note that the allocation the C entry points handed out at ``address``
    is also used on ``stream`` (``Tensor.record_stream``): its free then
    waits for the pool's fence. Whether ``address`` is such an allocation.
    """
def _cupy_c_hooks() -> tuple[int, int, int, int, int, str]:
    """``(malloc, free, fenced, ordered, probe, probe message)``: the C hooks
    for ``cupy.cuda.memory.CFunctionAllocator`` (addresses), the `param`
    values that pick each stream rule or the probe, and what the probe raises.
    """
def _cupy_malloc(nbytes: int, device: int, stream: _Stream = None) -> int:
    """CuPy's allocation hook, for ``cupy.cuda.PythonFunctionAllocator``:
    ``nbytes`` on ``device`` from the pool, as an address (0 for zero
    bytes), counted under ``"cupy"``. With ``stream``, allocated and freed on
    that stream; without, freed through the fence. Errors are gpuptr's typed
    exceptions (``OutOfMemoryError`` and so on), which CuPy passes on.
    """
def _cupy_malloc_current(nbytes: int, device: int) -> int:
    """CuPy's allocation hook on its current stream: ``_cupy_malloc`` with the
    stream the callable set by ``_cupy_set_stream_source`` returns (CuPy's
    ``get_current_stream_ptr``), called from here: no Python frame of
    gpuptr's per allocation. Without a source set, no stream (fenced).
    """
def _cupy_set_stream_source(source: Any) -> None:
    """Set the callable ``_cupy_malloc_current`` asks for CuPy's current
    stream handle.
    """
def _cupy_free(address: int, device: int) -> None:
    """CuPy's free hook: release what ``_cupy_malloc`` returned at ``address``
    (``device`` is CuPy's and unused: the address names the allocation).
    Anything else is ignored (and counted as a failure), never freed; it
    never raises (CuPy calls it from a destructor).
    """
def _cupy_set_oom_error(cls: Any) -> None:
    """Set the class ``_cupy_malloc`` raises for out of memory."""
def _rmm_alloc(device: int, ordered: bool, nbytes: int, stream: _Stream = None) -> int:
    """RMM's allocation callback, for ``rmm.mr.CallbackMemoryResource``
    (``gpuptr.rmm`` binds ``device`` and ``ordered`` with
    ``functools.partial``: one resource per device): ``nbytes`` on
    ``device`` from the pool, as an address (0 for zero bytes, as RMM's own
    resources), counted under ``"rmm"``. ``stream`` is RMM's stream (its
    ``Stream``, or anything ``stream`` arguments take): the allocation is
    made on it and, with ``ordered``, freed on the stream ``_rmm_free`` is
    given (reused at once there, by others after a fence: RMM's rule);
    without ``ordered``, every free waits for the fence. Errors are gpuptr's
    typed exceptions: out of memory is ``OutOfMemoryError``, a
    ``MemoryError``, which RMM rethrows as its ``rmm::out_of_memory``
    (``MemoryError`` in Python again, with this message).
    """
def _rmm_free(address: int, nbytes: Optional[int] = None, stream: _Stream = None) -> None:
    """RMM's deallocation callback: release what ``_rmm_alloc`` returned at
    ``address``, on ``stream`` where it was allocated stream-ordered (through
    the fence otherwise, or when the stream cannot be read). ``nbytes`` is
    RMM's and unused: the address names the allocation. Null is nothing to
    free, as RMM's own resources; any other address ``_rmm_alloc`` did not
    hand out (another library's, or one freed already) is ignored and
    counted as a failure, never freed. It never raises: RMM calls it from
    C++ destructors, which cannot take an exception.
    """
def _hooks_torch_errors(path: Any) -> bool:
    """Find PyTorch's exception thrower in its loaded ``libc10`` at ``path``
    (never loads the library: it must be loaded already), so a failed
    allocation raises in PyTorch instead of returning a null pointer.
    Whether it was found.
    """
def _hooks_torch_oom_missing(paths: list[Any]) -> str | None:
    """Find what throwing PyTorch's ``c10::OutOfMemoryError`` takes in the
    loaded libraries at ``paths`` (``libc10.so`` and the others PyTorch
    loaded; none is loaded by this call) and the C++ runtime, so that an
    allocation that runs out of memory raises ``torch.cuda.OutOfMemoryError``.
    None where everything was found; else what was not, in words (for the
    warning ``install()`` logs), and out of memory raises through
    ``_hooks_torch_errors``'s thrower, as a ``RuntimeError``.
    """
def _torch_counts(device: int) -> dict[str, Any]:
    """PyTorch's own counts on ``device``: ``allocation``,
    ``allocated_bytes`` and ``requested_bytes`` (each by pool:
    ``all``/``small_pool``/``large_pool`` of
    ``current``/``peak``/``allocated``/``freed``), ``num_ooms``, and the
    pool's ``segments_base`` and ``retries_base`` at the last
    ``_torch_reset_accumulated``; and the pool's own ``segments`` and
    ``num_alloc_retries`` on ``device`` now (as ``stats()`` has them). A
    device PyTorch never used has zeros.
    """
def _torch_reset_peak(device: int) -> None:
    """PyTorch's ``reset_peak_memory_stats(device)``: its peaks on ``device``
    become the values now, and so do the pool's there (one pool: its
    reserved peak is PyTorch's).
    """
def _torch_reset_accumulated(device: int) -> None:
    """PyTorch's ``reset_accumulated_memory_stats(device)``: its totals
    (``allocated``, ``freed``, ``num_ooms``, ``num_alloc_retries``) start
    again from zero on ``device``; the pool's own totals are kept, and
    PyTorch's are counted from what they are now.
    """
def _hooks_state() -> tuple[int, int]:
    """``(live allocations, failures)`` of the C entry points: allocations
    handed out and not freed, and calls that returned null or freed an
    address they did not hand out.
    """
def _layout(shape: tuple[int, ...], strides: Optional[tuple[int, ...]], itemsize: int) -> tuple[list[int], int, int]:
    """``(strides, lo, span)`` of an array of ``shape`` with byte ``strides``
    (None: C order) and elements of ``itemsize`` bytes, as the importers
    compute them: the strides, the lowest byte offset from element 0 (at
    most 0), and the bytes from there to the end of the highest element.
    """
def _dtype_info(name: str) -> tuple[str, int, int, int]:
    """``(typestr, itemsize, DLPack code, bits)`` of an element type named as
    numpy names it (``"float32"``, ``"bfloat16"``, ``"float8_e4m3fn"``).
    """
def _dlpack_consume(capsule: object) -> DLPackOwner:
    """Consume a `"dltensor"` or `"dltensor_versioned"` capsule (after
    [`describe`] read it): rename it `"used_…"` and return the owner that
    frees the tensor.
    """
def register_host_ptr(address: object, size: int, owner: object = None, mapped: bool = False, portable: bool = False, device: Optional[int] = None) -> Union[PinnedMemory, MappedMemory]:
    """Pin ``size`` bytes of host memory at ``address`` in place (numba's
    ``mempin``), keeping ``owner`` alive until it is unregistered. When
    ``owner`` exports a read-only buffer (``bytes``, a read-only array), the
    memory is read-only, as ``register_host`` makes it.
    """
