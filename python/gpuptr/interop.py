"""Importing device arrays from other libraries: the CUDA Array Interface
(v3) and DLPack. Both give an :class:`ArrayView`, whose ``pointer`` is a
gpuptr MemoryPointer with the context resolved from the address itself."""

from __future__ import annotations

import importlib
import operator
from typing import Any, Dict, NoReturn, Optional, Tuple, Union

from gpuptr import _core
from gpuptr._errors import InvalidArgumentError, InvalidPointerError
from gpuptr._needs import is_bool

__all__ = ["ArrayView", "as_array", "from_cuda_array_interface", "from_dlpack"]

_DLPACK_CUDA = 2
_DLPACK_CUDA_MANAGED = 13
_DLPACK_NAMES = {1: "CPU", 3: "CUDA pinned host", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 10: "ROCm"}


class ArrayView:
    """A strided device array described by shape, byte strides and typestr,
    over a gpuptr :class:`~gpuptr.MemoryPointer` that starts at element 0.

    ``pointer`` keeps the exporter (``owner``) alive. ``offset`` is the byte
    distance from the start of the memory the array spans to element 0
    (non-zero only with negative strides). ``dtype_name`` names the element
    type (``"float32"``, ``"bfloat16"``), or is None for a typestr that
    names none. It exports ``__cuda_array_interface__`` and DLPack itself,
    so it can be handed back to numba, CuPy or torch without a copy.
    """

    __slots__ = ("pointer", "shape", "strides", "typestr", "itemsize", "readonly", "offset", "stream", "dtype_name")

    def __init__(
        self,
        pointer: _core.MemoryPointer,
        shape: Tuple[int, ...],
        strides: Tuple[int, ...],
        typestr: str,
        itemsize: int,
        readonly: bool,
        offset: int,
        stream: Optional[int],
        dtype_name: Optional[str] = None,
    ) -> None:
        self.pointer = pointer
        self.shape: Tuple[int, ...] = shape
        self.strides: Tuple[int, ...] = strides
        self.typestr: str = typestr
        self.itemsize: int = itemsize
        self.readonly: bool = readonly
        self.offset: int = offset
        self.stream: Optional[int] = stream
        self.dtype_name: Optional[str] = dtype_name

    @classmethod
    def _of(cls, imported: _core.ImportedArray) -> "ArrayView":
        return cls(
            imported.pointer,
            imported.shape,
            imported.strides,
            imported.typestr,
            imported.itemsize,
            imported.readonly,
            imported.offset,
            imported.stream,
            imported.dtype,
        )

    @property
    def owner(self) -> Any:
        """The exporter the memory belongs to (kept alive by ``pointer``)."""
        return self.pointer.owner

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
    def dtype(self) -> Any:
        """The numpy dtype (needs numpy; bfloat16 and the float8 types need
        ml_dtypes, else they show as void of their size)."""
        import numpy

        if self.dtype_name is not None and self.typestr[1] == "V":
            try:
                return numpy.dtype(self.dtype_name)
            except TypeError:
                try:
                    importlib.import_module("ml_dtypes")  # registers the types
                    return numpy.dtype(self.dtype_name)
                except (ImportError, TypeError):
                    pass
        return numpy.dtype(self.typestr)

    @property
    def context(self) -> _core.Context:
        """The gpuptr context the memory lives in."""
        return self.pointer.context

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        # No consumer gets an address reused since its memory was freed or
        # its context reset: the pointer's own interface raises then.
        if not self.pointer.live:
            self.pointer.__cuda_array_interface__
        return {
            "version": 3,
            "shape": self.shape,
            "strides": self.strides,
            "typestr": self.typestr,
            "data": (self.ptr, self.readonly),
            "stream": self.stream,
        }

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """Export through DLPack without a copy (``torch.from_dlpack``,
        ``cupy.from_dlpack``). ``stream`` is the consumer's: if the array's
        exporter named a stream, it is synchronized first unless it is the
        consumer's. A ``max_version`` of (1, 0) or later gets a versioned
        capsule, which read-only arrays need."""
        if self.dtype_name is None:
            raise BufferError(f"element type {self.typestr} has no DLPack code")
        return _core._dlpack_export(
            self.pointer,
            self.shape,
            self.strides,
            self.dtype_name,
            self.readonly,
            self.stream,
            stream=stream,
            max_version=max_version,
            dl_device=dl_device,
            copy=copy,
        )

    def __dlpack_device__(self) -> Tuple[int, int]:
        """``(2, device_id)``: CUDA memory of the context's device."""
        return self.pointer.__dlpack_device__()

    def __array__(self, *args: object, **kwargs: object) -> NoReturn:
        """numpy cannot read device memory: ``TypeError``, saying how to
        (the pointer's own refusal)."""
        self.pointer.__array__()
        raise AssertionError("unreachable: a MemoryPointer refuses numpy")

    def __repr__(self) -> str:
        return f"<gpuptr.ArrayView {self.typestr} shape={self.shape} strides={self.strides} at {self.ptr:#x}>"


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
            if hasattr(type(obj_or_desc), "__cuda_array_interface__"):
                raise  # the exporter's own property failed: its error, as it raised it
            raise InvalidArgumentError(
                f"{type(obj_or_desc).__name__} does not export __cuda_array_interface__"
            ) from None
        if owner is None:
            owner = obj_or_desc
    return ArrayView._of(_core._import_cai(desc, owner, sync))


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
    # Ask for a versioned (1.x) capsule first; older producers take fewer
    # arguments.
    try:
        capsule = obj.__dlpack__(stream=1, max_version=(1, 1))
    except TypeError:
        try:
            capsule = obj.__dlpack__(stream=1)
        except TypeError:
            capsule = obj.__dlpack__()
    # Consumed, as the protocol asks: renamed, and its deleter called when
    # the last pointer over the tensor goes.
    return ArrayView._of(_core._import_dlpack(capsule))


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        try:
            _core._dtype_info(dtype)
            return dtype
        except InvalidArgumentError:
            pass
    import numpy

    try:
        dt = numpy.dtype(dtype)
    except (TypeError, UnicodeEncodeError) as e:  # a str with a lone surrogate
        raise InvalidArgumentError(f"{dtype!r} is not an element type: {e}") from None
    if dt.byteorder == ">":
        raise InvalidArgumentError(f"big-endian element type {dt.str} is not supported")
    return str(dt.name)


def _ints(given: Any, what: str) -> Tuple[int, ...]:
    """``given`` (an int, or a sequence of them) as a tuple of ints; any
    element that is no int (a float, a bool, a string) is a ``TypeError``."""
    if isinstance(given, (str, bytes, bytearray)):
        raise TypeError(f"{what} must be an int or a sequence of ints, not {type(given).__name__}")
    try:
        items = tuple(given)
    except TypeError:
        items = (given,)
    out = []
    for n in items:
        if is_bool(n):
            raise TypeError(f"{what} must be ints, not {type(n).__name__} ({given!r})")
        try:
            out.append(operator.index(n))
        except TypeError:
            raise TypeError(f"{what} must be ints, not {type(n).__name__} ({given!r})") from None
    return tuple(out)


def as_array(
    ptr: _core.MemoryPointer,
    shape: Union[int, Tuple[int, ...]],
    dtype: Any,
    strides: Optional[Tuple[int, ...]] = None,
) -> ArrayView:
    """A typed strided view of device memory, exporting the CUDA Array
    Interface and DLPack, so numba, CuPy and torch can use it without a copy.

    ``dtype`` is anything numpy takes, or a name such as ``"bfloat16"`` or
    ``"float8_e4m3fn"`` (no ml_dtypes needed). ``strides`` are in bytes, as
    numpy's (C order when None). The array's lowest byte is at ``ptr`` (so
    with negative strides element 0 is above it, at ``offset``); an array
    that does not fit in ``ptr.size`` bytes raises
    :class:`InvalidPointerError`, as any bound past the end of memory does
    (a shape or stride that is no int raises ``TypeError``, a negative
    dimension :class:`InvalidArgumentError`). The view keeps ``ptr``'s
    memory alive, and carries its stream (memory allocated with ``stream=``).
    """
    if not isinstance(ptr, _core.MemoryPointer):
        raise TypeError(f"as_array needs a gpuptr MemoryPointer, not {type(ptr).__name__}")
    name = _dtype_name(dtype)
    typestr, itemsize, _code, _bits = _core._dtype_info(name)
    dims = _ints(shape, "shape")
    if any(n < 0 for n in dims):
        raise InvalidArgumentError(f"shape must be non-negative ints, got {shape!r}")
    if strides is not None:
        strides = _ints(strides, "strides")
        if len(strides) != len(dims):
            raise InvalidArgumentError(f"strides {strides!r} do not match shape {dims!r}")
    try:
        steps, lo, span = _core._layout(dims, strides, itemsize)
    except OverflowError:
        raise InvalidArgumentError("the array's extent overflows") from None
    strides = tuple(steps)
    if span > ptr.size:
        raise InvalidPointerError(f"an array of {span} bytes does not fit in {ptr.size} bytes")
    readonly = bool(ptr.__cuda_array_interface__["data"][1])
    # As imported arrays: the pointer starts at element 0 and ends where the
    # array's memory does.
    return ArrayView(ptr.view(-lo, span), dims, strides, typestr, itemsize, readonly, -lo, ptr.stream, name)
