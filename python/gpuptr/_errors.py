"""gpuptr's exception hierarchy. The Rust binding raises these classes."""

from __future__ import annotations

__all__ = [
    "GpuptrError",
    "NoDriverError",
    "CudaError",
    "OutOfMemoryError",
    "InvalidPointerError",
    "InvalidArgumentError",
    "InstallError",
]


class GpuptrError(Exception):
    """Base class of every error gpuptr raises."""


class NoDriverError(GpuptrError, RuntimeError):
    """No usable CUDA driver: libcuda is missing or too old, there is no
    device, or ``GPUPTR_DRIVER`` names no driver. The message has a hint."""


class CudaError(GpuptrError, RuntimeError):
    """A CUDA driver call failed.

    Attributes:
        code: the ``CUresult`` value (for example 2).
        name: its name (for example ``"CUDA_ERROR_OUT_OF_MEMORY"``).
    """

    def __init__(self, message: str, code: int = -1, name: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.name = name


class OutOfMemoryError(CudaError, MemoryError):
    """The device (or gpuptr's pool in front of it) cannot satisfy an
    allocation. Also a :class:`MemoryError`."""

    def __init__(self, message: str, code: int = 2, name: str = "CUDA_ERROR_OUT_OF_MEMORY") -> None:
        super().__init__(message, code, name)


class InvalidPointerError(GpuptrError, ValueError):
    """Memory gpuptr cannot reach: an address with no memory there, memory
    that is freed or stale, or bounds past the end of their memory. Also a
    :class:`ValueError`."""


class InvalidArgumentError(GpuptrError, ValueError):
    """An argument with a bad value: an int outside its argument's range (a
    negative size or offset, one past 2**63-1), an unknown device, a
    malformed array descriptor. Also a :class:`ValueError`."""


class InstallError(GpuptrError, RuntimeError):
    """A library's allocator could not be put on gpuptr's pool: for example
    PyTorch after its first CUDA allocation, or numba after it created a
    context with its own memory manager. The message says why."""


# Tracebacks and reprs name the public module, where users import them.
for _cls in (
    GpuptrError,
    NoDriverError,
    CudaError,
    OutOfMemoryError,
    InvalidPointerError,
    InvalidArgumentError,
    InstallError,
):
    _cls.__module__ = "gpuptr"
del _cls
