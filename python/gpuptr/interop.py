"""Importing device arrays from other libraries: the CUDA Array Interface
(v3) and DLPack. Both give an :class:`ArrayView`, whose ``pointer`` is a
gpuptr MemoryPointer with the context resolved from the address itself."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Optional, Tuple

from gpuptr import _core
from gpuptr._errors import InvalidArgumentError, InvalidPointerError

__all__ = ["ArrayView", "from_cuda_array_interface", "from_dlpack"]

_TYPESTR = re.compile(r"^[<>|=]([biufcV])(\d+)$")
_DLPACK_CUDA = 2
_DLPACK_CUDA_MANAGED = 13
_DLPACK_NAMES = {1: "CPU", 3: "CUDA pinned host", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 10: "ROCm"}


class ArrayView:
    """A strided device array described by shape, byte strides and typestr,
    over a gpuptr :class:`~gpuptr.MemoryPointer` that starts at element 0.

    ``pointer`` keeps the exporter (``owner``) alive. ``offset`` is the byte
    distance from the start of the memory the array spans to element 0
    (non-zero only with negative strides). It exports
    ``__cuda_array_interface__`` itself, so it can be handed back to numba,
    CuPy or torch.
    """

    __slots__ = ("pointer", "shape", "strides", "typestr", "itemsize", "readonly", "offset", "stream", "owner")

    def __init__(self, pointer, shape, strides, typestr, itemsize, readonly, offset, stream, owner):
        self.pointer = pointer
        self.shape: Tuple[int, ...] = shape
        self.strides: Tuple[int, ...] = strides
        self.typestr: str = typestr
        self.itemsize: int = itemsize
        self.readonly: bool = readonly
        self.offset: int = offset
        self.stream: Optional[int] = stream
        self.owner = owner

    @property
    def ptr(self) -> int:
        """Address of element 0 (0 for an empty array)."""
        return self.pointer.device_pointer_value or 0

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the elements (``size * itemsize``)."""
        return self.size * self.itemsize

    @property
    def dtype(self):
        """The numpy dtype (needs numpy)."""
        import numpy

        return numpy.dtype(self.typestr)

    @property
    def context(self):
        """The gpuptr context the memory lives in."""
        return self.pointer.context

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "version": 3,
            "shape": self.shape,
            "strides": self.strides,
            "typestr": self.typestr,
            "data": (self.ptr, self.readonly),
            "stream": None,
        }

    def __repr__(self) -> str:
        return f"<gpuptr.ArrayView {self.typestr} shape={self.shape} strides={self.strides} at {self.ptr:#x}>"


def _parse_typestr(typestr: Any) -> int:
    if not isinstance(typestr, str):
        raise InvalidArgumentError(f"typestr must be a str, got {typestr!r}")
    m = _TYPESTR.match(typestr)
    if not m or int(m.group(2)) == 0:
        raise InvalidArgumentError(f"typestr {typestr!r} is not a device array element type")
    return int(m.group(2))


def _int_tuple(value: Any, what: str, nonneg: bool) -> Tuple[int, ...]:
    try:
        items = tuple(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a tuple of ints, got {value!r}") from None
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) and not hasattr(v, "__index__"):
            raise InvalidArgumentError(f"{what} must be a tuple of ints, got {value!r}")
    items = tuple(int(v) for v in items)
    if nonneg and any(v < 0 for v in items):
        raise InvalidArgumentError(f"{what} must not be negative, got {items!r}")
    return items


def _c_strides(shape: Tuple[int, ...], itemsize: int) -> Tuple[int, ...]:
    strides = []
    step = itemsize
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


def _layout_uncached(shape: Any, strides: Any, typestr: Any):
    """Validate a strided layout: ``(shape, byte strides, itemsize, lo, span)``
    where ``lo <= 0`` is the lowest byte offset from element 0 and ``span``
    the bytes the array covers (0 when empty)."""
    itemsize = _parse_typestr(typestr)
    shape = _int_tuple(shape, "shape", nonneg=True)
    if strides is None:
        strides = _c_strides(shape, itemsize)
    else:
        strides = _int_tuple(strides, "strides", nonneg=False)
        if len(strides) != len(shape):
            raise InvalidArgumentError(f"strides {strides!r} do not match shape {shape!r}")
    if any(s == 0 for s in shape):
        return shape, strides, itemsize, 0, 0
    lo = hi = 0
    for n, st in zip(shape, strides):
        if st >= 0:
            hi += (n - 1) * st
        else:
            lo += (n - 1) * st
    return shape, strides, itemsize, lo, hi - lo + itemsize


# Exporters hand the same few layouts over and over; validating each once
# keeps the import cheap. Errors are raised, never cached.
_layout_cached = lru_cache(maxsize=4096)(_layout_uncached)


def _layout(shape: Any, strides: Any, typestr: Any):
    try:
        return _layout_cached(shape, strides, typestr)
    except TypeError as e:  # an unhashable part (a list): validate uncached
        if "unhashable" not in str(e):
            raise
        return _layout_uncached(shape, strides, typestr)


def _make_view(address, layout, typestr, readonly, owner, stream) -> ArrayView:
    """Wrap the memory a strided array spans; the pointer starts at element 0."""
    shape, strides, itemsize, lo, span = layout
    if not span:
        # Empty: no memory is touched; a null pointer in the current context.
        return ArrayView(_core.alloc(0), shape, strides, typestr, itemsize, readonly, 0, stream, owner)
    if not address:
        raise InvalidPointerError("a non-empty array has a null data pointer")
    if address + lo < 0:
        raise InvalidPointerError("negative strides reach below address 0")
    pointer = _core.wrap(address + lo, span, owner)
    if lo:
        pointer = pointer.view(-lo)
    return ArrayView(pointer, shape, strides, typestr, itemsize, readonly, -lo, stream, owner)


def from_cuda_array_interface(obj_or_desc: Any, *, owner: Any = None, sync: bool = True) -> ArrayView:
    """Import an object exporting ``__cuda_array_interface__`` (v0–v3), or
    the interface dict itself.

    The pointer's context is resolved from the data address. Following the
    v3 stream rule, when the exporter names a stream and ``sync`` is true,
    that stream is synchronized before returning. Masked arrays, malformed
    descriptors and host addresses raise typed errors
    (:class:`InvalidArgumentError`, :class:`InvalidPointerError`).
    """
    if isinstance(obj_or_desc, dict):
        desc = obj_or_desc
    else:
        try:
            desc = obj_or_desc.__cuda_array_interface__
        except AttributeError:
            raise InvalidArgumentError(
                f"{type(obj_or_desc).__name__} does not export __cuda_array_interface__"
            ) from None
        if owner is None:
            owner = obj_or_desc
        if not isinstance(desc, dict):
            raise InvalidArgumentError("__cuda_array_interface__ must be a dict")
    version = desc.get("version", 0)
    if not isinstance(version, int) or not 0 <= version <= 3:
        raise InvalidArgumentError(f"unsupported CUDA Array Interface version {version!r}")
    if desc.get("mask") is not None:
        raise InvalidArgumentError("masked arrays are not supported")
    if "shape" not in desc or "typestr" not in desc or "data" not in desc:
        missing = [k for k in ("shape", "typestr", "data") if k not in desc]
        raise InvalidArgumentError(f"the interface lacks {', '.join(missing)}")
    data = desc["data"]
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise InvalidArgumentError(f"data must be (address, readonly), got {data!r}")
    address, readonly = data
    if isinstance(address, bool) or not isinstance(address, int) or address < 0:
        raise InvalidPointerError(f"data address {address!r} is not an address")
    layout = _layout(desc["shape"], desc.get("strides"), desc["typestr"])
    stream = desc.get("stream") if version >= 3 else None
    if stream is not None:
        if isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
            raise InvalidArgumentError(f"stream must be an int handle, got {stream!r}")
        if stream == 0:
            raise InvalidArgumentError("stream 0 is disallowed by the interface (ambiguous); use 1 or 2")
    view = _make_view(address, layout, desc["typestr"], bool(readonly), owner, stream)
    if stream is not None and sync:
        view.pointer.context.stream_synchronize(stream)
    return view


def from_dlpack(obj: Any) -> ArrayView:
    """Import a device array through DLPack (``__dlpack__`` and
    ``__dlpack_device__``). Host arrays raise :class:`InvalidArgumentError`.
    The exporter is asked to make the data ready on the legacy default
    stream, which gpuptr's copies use."""
    try:
        device_type, _device_id = obj.__dlpack_device__()
    except AttributeError:
        raise InvalidArgumentError(f"{type(obj).__name__} does not support DLPack") from None
    if device_type not in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
        kind = _DLPACK_NAMES.get(device_type, f"device type {device_type}")
        raise InvalidArgumentError(f"{kind} arrays are not CUDA device memory; gpuptr imports device arrays only")
    try:
        capsule = obj.__dlpack__(stream=1)
    except TypeError:
        capsule = obj.__dlpack__()
    address, dtype_, _dev, shape, strides, typestr, byte_offset = _core._dlpack_describe(capsule)
    itemsize = _parse_typestr(typestr)
    if strides is not None:
        strides = tuple(s * itemsize for s in strides)
    layout = _layout(tuple(shape), strides, typestr)
    # The capsule is the owner: its destructor frees the tensor when the last
    # pointer over it goes.
    return _make_view(address + byte_offset, layout, typestr, False, capsule, None)
