"""Importing device arrays from other libraries: the CUDA Array Interface
(v3) and DLPack. Both give an :class:`ArrayView`, whose ``pointer`` is a
gpuptr MemoryPointer with the context resolved from the address itself."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from gpuptr import _core
from gpuptr._errors import InvalidArgumentError

__all__ = ["ArrayView", "from_cuda_array_interface", "from_dlpack"]

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

    __slots__ = ("pointer", "shape", "strides", "typestr", "itemsize", "readonly", "offset", "stream")

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
    ) -> None:
        self.pointer = pointer
        self.shape: Tuple[int, ...] = shape
        self.strides: Tuple[int, ...] = strides
        self.typestr: str = typestr
        self.itemsize: int = itemsize
        self.readonly: bool = readonly
        self.offset: int = offset
        self.stream: Optional[int] = stream

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
        """The numpy dtype (needs numpy)."""
        import numpy

        return numpy.dtype(self.typestr)

    @property
    def context(self) -> _core.Context:
        """The gpuptr context the memory lives in."""
        return self.pointer.context

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
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
    try:
        capsule = obj.__dlpack__(stream=1)
    except TypeError:
        capsule = obj.__dlpack__()
    # Consumed, as the protocol asks: renamed, and its deleter called when
    # the last pointer over the tensor goes.
    return ArrayView._of(_core._import_dlpack(capsule))
