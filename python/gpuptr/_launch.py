"""numba arrays from foreign device arrays, for ``gpuptr.numba``.

- :func:`as_cuda_array` (and :func:`from_cuda_array_interface_numba`)
  convert one CUDA Array Interface exporter (a CuPy array, a torch tensor)
  to a numba ``DeviceNDArray`` over a gpuptr pointer.
- :func:`foreign_args` (a :class:`Launcher`) converts a kernel's arguments
  at each launch, through the conversion cache :class:`ArgCache`.

Users reach them all through ``gpuptr.numba``, which re-exports them
beside its memory manager.
"""

from __future__ import annotations

import sys
import threading
import weakref
from functools import lru_cache
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
from numba import cuda
from numba.cuda import config
from numba.cuda.cudadrv import dummyarray
from numba.cuda.cudadrv.devicearray import DeviceNDArray

from gpuptr import _core

__all__ = ["ArgCache", "Launcher", "as_cuda_array", "foreign_args", "from_cuda_array_interface_numba"]


# --- one array ----------------------------------------------------------------


@lru_cache(maxsize=1024)
def _array_attrs(shape: Tuple[int, ...], strides: Tuple[int, ...], typestr: str) -> Dict[str, Any]:
    """What ``DeviceNDArray.__init__`` derives from a layout. numba builds the
    index descriptor (``_dummy``) for every array; it is never mutated, so one
    per layout serves them all."""
    dtype = np.dtype(typestr)
    dummy = dummyarray.Array.from_desc(0, shape, strides, dtype.itemsize)
    return {
        "ndim": len(shape),
        "_dummy": dummy,
        "shape": dummy.shape,
        "strides": dummy.strides,
        "dtype": dtype,
        "size": dummy.size,
    }


@lru_cache(maxsize=64)
def _external_stream(handle: int, device: int) -> Any:
    # External streams own nothing, so one numba Stream per handle serves.
    with cuda.gpus[device]:
        return cuda.external_stream(handle)


def from_cuda_array_interface_numba(desc: Dict[str, Any], owner: Any = None, sync: bool = True) -> DeviceNDArray:
    """``numba.cuda.from_cuda_array_interface`` over a gpuptr pointer: the
    DeviceNDArray that ``DeviceNDArray(shape, strides, dtype, stream,
    gpu_data)`` would build, without re-deriving what is already known."""
    # _import_cai checks every field, and that desc is a dict.
    imp = _core._import_cai(desc, owner, bool(sync and config.CUDA_ARRAY_INTERFACE_SYNC))
    ptr, stream = imp.pointer, imp.stream
    attrs = dict(_array_attrs(imp.shape, imp.strides, imp.typestr))
    attrs["alloc_size"] = imp.offset + ptr.size if attrs["size"] else 0
    attrs["gpu_data"] = ptr
    attrs["stream"] = 0 if stream is None else _external_stream(stream, ptr.context.device.id)
    arr = _new(DeviceNDArray)
    arr.__dict__ = attrs
    return arr


# DeviceNDArray's own __new__: where numba's C DeviceArray is its base,
# object.__new__ refuses the class ("not safe"); where it is not, this is
# object.__new__ itself.
_new = DeviceNDArray.__new__


def as_cuda_array(obj: Any, sync: bool = True) -> DeviceNDArray:
    """Create a numba ``DeviceNDArray`` from any object implementing the CUDA
    Array Interface, as ``numba.cuda.as_cuda_array`` does. Its ``gpu_data``
    is a gpuptr MemoryPointer that keeps ``obj`` alive and carries the
    memory's own context. With ``sync``, the exporter's stream (if any) is
    synchronized first."""
    try:
        desc = obj.__cuda_array_interface__
    except AttributeError:
        raise TypeError("*obj* doesn't implement the cuda array interface.") from None
    return from_cuda_array_interface_numba(desc, owner=obj, sync=sync)


# --- foreign arrays at kernel launch ------------------------------------------


class _Converted:
    __slots__ = ("ref", "fingerprint", "array", "device")

    def __init__(self, ref: Any, fingerprint: Tuple[Any, ...], array: DeviceNDArray, device: int) -> None:
        self.ref, self.fingerprint, self.array, self.device = ref, fingerprint, array, device


# How the cache reads an exporter without its (slow) interface: per type,
# a fingerprint of what a conversion depends on (data pointer, shape,
# strides, element type, device) and the stream its interface would name
# now. Learnt from the first object of each type.


def _torch_fingerprint(obj: Any) -> Tuple[Any, ...]:
    return (obj.data_ptr(), obj.shape, obj.stride(), obj.dtype, obj.get_device())


def _cupy_fingerprint(obj: Any) -> Tuple[Any, ...]:
    data = obj.data
    return (data.ptr, obj.shape, obj.strides, obj.dtype, data.device_id)


def _torch_stream(device: int) -> Optional[int]:
    """torch's current stream on ``device`` (its interface's ``stream``)."""
    # A tensor exists, so torch is imported: no import machinery per launch.
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    s = int(raw(device)) if raw is not None else int(torch.cuda.current_stream(device).cuda_stream)
    return s or 1  # the legacy default stream is 1 in the interface


def _cupy_stream(device: int) -> Optional[int]:
    """CuPy's current stream (its interface's ``stream``)."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    get = getattr(cupy.cuda.stream, "get_current_stream_ptr", None)
    s = int(get()) if get is not None else int(cupy.cuda.get_current_stream().ptr)
    return s or 1


class _Kind:
    __slots__ = ("fingerprint", "stream")

    def __init__(self, fingerprint: Any, stream: Any) -> None:
        self.fingerprint, self.stream = fingerprint, stream


_TORCH = _Kind(_torch_fingerprint, _torch_stream)
_CUPY = _Kind(_cupy_fingerprint, _cupy_stream)
_OTHER = _Kind(None, None)  # a CAI exporter the cache cannot fingerprint
_KINDS: Dict[type, Optional[_Kind]] = {DeviceNDArray: None}  # None: passed through


def _kind(obj: Any) -> Optional[_Kind]:
    """How ``obj`` is converted at launch: None to pass it through (numba
    arrays, scalars, host arrays), else its kind (learnt once per type)."""
    t = type(obj)
    try:
        return _KINDS[t]
    except KeyError:
        pass
    kind: Optional[_Kind]
    # A class attribute test: reading the interface itself is slow.
    if not hasattr(t, "__cuda_array_interface__") or hasattr(t, "__cuda_ndarray__"):
        kind = None
    elif callable(getattr(obj, "data_ptr", None)):  # torch.Tensor
        kind = _TORCH
    elif isinstance(getattr(getattr(obj, "data", None), "ptr", None), int):  # cupy.ndarray
        kind = _CUPY
    else:
        kind = _OTHER
    _KINDS[t] = kind
    return kind


class ArgCache:
    """Conversions of foreign device arrays (torch tensors, CuPy arrays) to
    numba arrays, kept per array object and reused while the array's data
    pointer, shape, strides and element type are what they were. A reused
    numba array also keeps what numba derives from it per object (its type),
    which a fresh conversion at each launch pays for again.

    - It never keeps an array alive: an entry holds the array weakly and goes
      when the array does (objects that take no weak reference are converted
      afresh each time), and the numba array it keeps does not own the
      memory. So only :class:`Launcher` hands these arrays out, for the
      duration of a launch, while the caller holds the originals.
    - A changed pointer, shape, strides or type is converted again.
    - The CUDA Array Interface's stream rule holds on every launch: the
      stream the exporter would name now is synchronized (unless idle), as
      numba does, when ``sync`` and numba's ``CUDA_ARRAY_INTERFACE_SYNC`` say
      so.
    - Thread-safe.
    """

    def __init__(self, maxsize: int = 1024) -> None:
        self._entries: Dict[int, _Converted] = {}
        self._lock = threading.RLock()  # weakref callbacks may run inside
        self._maxsize = maxsize
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _forget(self, key: int, ref: Any) -> None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.ref is ref:
                del self._entries[key]

    def convert(self, obj: Any, sync: bool = True) -> DeviceNDArray:
        """The numba array for ``obj`` (which must export the CUDA Array
        Interface), after waiting for the exporter's stream when ``sync``."""
        streams: Dict[Any, Any] = {}
        arr = self._convert(obj, _kind(obj) or _OTHER, sync, streams)
        _synchronize(streams)
        return arr

    def _convert(self, obj: Any, kind: _Kind, sync: bool, streams: Dict[Any, Any]) -> DeviceNDArray:
        """``convert`` for an ``obj`` of ``kind``, noting the streams to wait
        for in ``streams`` (a launch waits once per stream)."""
        fp = None
        if kind.fingerprint is not None:
            try:
                fp = kind.fingerprint(obj)
            except Exception:  # not what its type's first object was
                fp = None
        if fp is not None:
            # A dict read is atomic: the read side takes no lock.
            e = self._entries.get(id(obj))
            if e is not None and e.ref() is obj and e.fingerprint == fp:
                self.hits += 1
                if sync and config.CUDA_ARRAY_INTERFACE_SYNC:
                    wait = (kind, e.device)
                    if wait not in streams:  # one lookup per library and device
                        try:
                            streams[wait] = kind.stream(e.device)
                        except Exception:
                            streams[wait] = None
                return e.array
        self.misses += 1
        desc = obj.__cuda_array_interface__
        if fp is None:
            return from_cuda_array_interface_numba(desc, owner=obj, sync=sync)
        # Not owning: the cache must not keep `obj` alive.
        arr = from_cuda_array_interface_numba(desc, owner=None, sync=sync)
        key = id(obj)

        def gone(r: Any, key: int = key) -> None:
            self._forget(key, r)

        try:
            ref = weakref.ref(obj, gone)
        except TypeError:
            return from_cuda_array_interface_numba(desc, owner=obj, sync=False)
        with self._lock:
            if len(self._entries) >= self._maxsize:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = _Converted(ref, fp, arr, arr.gpu_data.context.device.id)
        return arr

    def clear(self) -> None:
        """Forget every conversion."""
        with self._lock:
            self._entries.clear()


_ARG_CACHE = ArgCache()


def _synchronize(streams: Dict[Any, Any]) -> None:
    """Wait for the streams an :meth:`ArgCache._convert` noted (unless idle)."""
    for (_, device), s in streams.items():
        if s is not None:
            _core.context(device).stream_synchronize(s)


class Launcher:
    """A numba CUDA kernel that takes torch tensors and CuPy arrays (and any
    other CUDA Array Interface exporter) through gpuptr's importer and
    :class:`ArgCache`: ``foreign_args(kernel)[grid, block](x, y, 2.0)``.
    numba arrays, scalars and everything else pass through unchanged; the
    kernel sees what it would see launched directly."""

    def __init__(self, kernel: Any, sync: bool = True, cache: Optional[ArgCache] = None) -> None:
        self.kernel = kernel
        self.sync = sync
        self.cache = _ARG_CACHE if cache is None else cache

    def convert_args(self, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
        """The arguments as the kernel takes them (after the stream waits)."""
        streams: Dict[Any, Any] = {}
        convert, sync, out = self.cache._convert, self.sync, []
        for a in args:
            kind = _kind(a)
            out.append(a if kind is None else convert(a, kind, sync, streams))
        _synchronize(streams)
        return tuple(out)

    def __getitem__(self, config: Any) -> Callable[..., Any]:
        configured = self.kernel[config]

        def launch(*args: Any) -> Any:
            return configured(*self.convert_args(args))

        return launch


def foreign_args(kernel: Any, sync: bool = True) -> Launcher:
    """Wrap a ``@cuda.jit`` kernel so that torch, CuPy and other CUDA Array
    Interface arguments go through gpuptr's fast importer and a conversion
    cache (see :class:`ArgCache`)."""
    return Launcher(kernel, sync)
