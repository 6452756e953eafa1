"""PyTorch on gpuptr's pool.

``gpuptr.torch.install()`` makes gpuptr PyTorch's CUDA allocator, through
``torch.cuda.memory.CUDAPluggableAllocator``: PyTorch loads two C functions
(``gpuptr_torch_alloc`` and ``gpuptr_torch_free``) from gpuptr's own
extension module, which allocate from the same per-device pool as numba,
CuPy and ``gpuptr.alloc``. Call it before PyTorch's first CUDA allocation.

Safety on every stream needs no call from you: by default a tensor's memory
is reused only after all work queued before its free, on every stream, is
done (the pluggable-allocator interface cannot forward ``record_stream``, so
PyTorch's own stream-ordered rule would reuse memory a side stream still
uses). ``install(stream_ordered=True)`` orders frees on the allocating
stream instead, as PyTorch's caching allocator does, for code that keeps
each tensor on its stream.

What PyTorch's pluggable allocators do not support: ``torch.cuda.memory_stats``
and its friends raise (use ``gpuptr.stats()``, whose ``"torch"`` client
counts PyTorch's allocations), a failed allocation returns a null pointer to
PyTorch (which does not check it), and CUDA-graph private pools are not
supported.
"""

from __future__ import annotations

from typing import Any, Optional

from gpuptr import _core
from gpuptr._errors import InstallError

__all__ = ["install", "installed"]

ALLOC_SYMBOL = "gpuptr_torch_alloc"
FREE_SYMBOL = "gpuptr_torch_free"

_allocator: Optional[Any] = None


def installed() -> bool:
    """Whether ``install()`` put PyTorch on gpuptr in this process."""
    return _allocator is not None


def install(*, stream_ordered: bool = False) -> None:
    """Make gpuptr PyTorch's CUDA allocator. Idempotent; a second call only
    changes ``stream_ordered`` (for frees from then on).

    Raises :class:`~gpuptr.InstallError` if PyTorch has already allocated
    CUDA memory with its own allocator (it cannot swap allocators then), and
    ``ImportError`` without PyTorch.
    """
    global _allocator
    import torch.cuda.memory as tmem

    _core._hooks_configure(bool(stream_ordered))
    if _allocator is not None:
        return
    allocator = tmem.CUDAPluggableAllocator(_core.__file__, ALLOC_SYMBOL, FREE_SYMBOL)
    try:
        tmem.change_current_allocator(allocator)
    except RuntimeError as e:
        raise InstallError(
            "gpuptr.torch.install() must run before PyTorch's first CUDA allocation: "
            "PyTorch cannot swap its allocator once it has allocated "
            f"(PyTorch said: {e}). Call it (or gpuptr.install()) right after import."
        ) from e
    _allocator = allocator
