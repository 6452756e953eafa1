"""PyTorch on gpuptr's pool.

``gpuptr.torch.install()`` makes gpuptr PyTorch's CUDA allocator, through
``torch.cuda.memory.CUDAPluggableAllocator``: PyTorch loads two C functions
(``gpuptr_torch_alloc`` and ``gpuptr_torch_free``) from gpuptr's own
extension module, which allocate from the same per-device pool as numba,
CuPy and ``gpuptr.alloc``. Call it before PyTorch's first CUDA allocation.

Streams: as under PyTorch's own caching allocator, a tensor's memory is
reused at once on the stream it was allocated on, and ``record_stream``
(``Tensor.record_stream``, which ``install()`` extends to tell gpuptr) makes
it wait until all work queued before its free, on every stream, is done. A
tensor used on a side stream without ``record_stream`` may be reused under
that stream's work, exactly as under PyTorch's allocator.
``install(stream_ordered=False)`` makes every tensor wait so, for code that
does not call ``record_stream``.

CUDA graphs: memory allocated during a ``torch.cuda.graph`` capture, and
memory freed during it, is reused only after the graph is destroyed (gpuptr
ties it to the graph). ``torch.compile(mode="reduce-overhead")`` keeps
inductor's setting: with CUDA graph trees (its default) gpuptr answers the
trees' allocator calls (``gpuptr._torch_trees``); ``install(graph_trees=False)``
asks for one graph per compiled function instead.

``torch.cuda.MemPool`` and ``use_mem_pool`` work as a tag over gpuptr's one
pool (``gpuptr._torch_pool``), and CUDA tensors cross ``torch.multiprocessing``
as gpuptr IPC handles, the memory kept until both sides let go
(``gpuptr._torch_ipc``).

Out of memory: a failed allocation raises ``torch.cuda.OutOfMemoryError``
(PyTorch's own ``c10::OutOfMemoryError``, built from what ``libc10``
exports), whose message starts "CUDA out of memory." and says what gpuptr's
pool holds, after gpuptr has waited for its fence and returned its cache;
``num_ooms`` counts it and the process goes on. A PyTorch whose libraries
do not export what that takes gets a ``RuntimeError`` with the same message.

PyTorch's memory API answers from gpuptr (see ``gpuptr._torch_stats``):
``torch.cuda.memory_stats()`` with PyTorch's keys, and so
``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
``max_memory_reserved``, ``reset_peak_memory_stats``,
``reset_accumulated_memory_stats``, ``memory_summary`` and
``memory_snapshot``; ``torch.cuda.memory._record_memory_history``,
``_snapshot`` and ``_dump_snapshot`` use gpuptr's allocation history.
Allocated bytes are PyTorch's own; reserved bytes are what gpuptr's pool
holds from the driver, for every library on it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from gpuptr import _core
from gpuptr._errors import InstallError

__all__ = ["install", "installed"]

ALLOC_SYMBOL = "gpuptr_torch_alloc"
FREE_SYMBOL = "gpuptr_torch_free"

_allocator: Optional[Any] = None


def installed() -> bool:
    """Whether ``install()`` put PyTorch on gpuptr in this process."""
    return _allocator is not None


def install(*, stream_ordered: bool = True, graph_trees: Optional[bool] = None) -> None:
    """Make gpuptr PyTorch's CUDA allocator. Idempotent; a second call only
    changes ``stream_ordered`` (for frees from then on) and ``graph_trees``.

    ``graph_trees``: None (the default) leaves inductor's
    ``cudagraph_trees`` as it is (trees work on gpuptr; only a torch
    without the entry points gpuptr answers for them gets one graph per
    function, and the log says so); True or False sets it.

    Raises :class:`~gpuptr.InstallError` if PyTorch has already allocated
    CUDA memory with its own allocator (it cannot swap allocators then), or
    cannot be imported (naming what to install).
    """
    global _allocator
    from gpuptr._needs import flag

    ordered = flag(stream_ordered, "stream_ordered")
    if graph_trees is not None:
        graph_trees = flag(graph_trees, "graph_trees")
    try:
        import torch.cuda.memory as tmem
    except ImportError as e:
        raise InstallError(
            f"gpuptr.torch.install() needs PyTorch, which cannot be imported ({e}): pip install torch"
        ) from e

    _core._hooks_configure(ordered)
    if _allocator is not None:
        _graph_trees(graph_trees)
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
    _raise_in_torch()
    from gpuptr import _torch_stats

    _torch_stats.patch(_torch_C())
    _pools_and_sharing(allocator)
    _graph_trees(graph_trees)
    _tell_record_stream()


def _tell_record_stream() -> None:
    """Make ``Tensor.record_stream`` tell gpuptr too: PyTorch's pluggable
    allocator drops the call, and the memory would then be reused on its
    allocating stream while the recorded stream still uses it. Calls from
    PyTorch's C++ (some collectives) do not pass through here."""
    import torch

    cls = getattr(torch, "Tensor", None)
    own = getattr(cls, "record_stream", None)
    if own is None or getattr(own, "_gpuptr", False):
        return

    def record_stream(self: Any, stream: Any) -> None:
        own(self, stream)
        if self.is_cuda:
            _core._hooks_record_stream(self.untyped_storage().data_ptr(), int(stream.cuda_stream))

    record_stream.__doc__ = own.__doc__
    record_stream._gpuptr = True  # type: ignore[attr-defined]
    setattr(cls, "record_stream", record_stream)


def _pools_and_sharing(allocator: Any) -> None:
    """``torch.cuda.MemPool`` as gpuptr's tag, and gpuptr's reducers for
    ``torch.multiprocessing``; a warning, the rest of ``install()`` holding,
    for a torch without the pieces they replace."""
    import torch

    from gpuptr import _torch_ipc, _torch_pool

    own: Any = getattr(allocator, "allocator", None)
    mine: Any = own() if callable(own) else None
    parts: "list[tuple[str, Callable[[], None]]]" = [
        ("torch.cuda.MemPool", lambda: _torch_pool.install_pools(torch, mine)),
        ("torch.multiprocessing", lambda: _torch_ipc.install_reducers(torch)),
    ]
    for what, part in parts:
        try:
            part()
        except (ImportError, AttributeError) as e:
            logging.getLogger("gpuptr").warning(
                "%s is not served by gpuptr in this torch (%s)", what, e
            )


def _raise_in_torch() -> None:
    """Make a failed allocation raise in PyTorch (a ``RuntimeError`` whose
    message starts "CUDA out of memory.") instead of returning the null
    pointer PyTorch's pluggable allocator would write through."""
    import os

    import torch

    here = getattr(torch, "__file__", None) or ""
    lib = os.path.join(os.path.dirname(here), "lib", "libc10.so")
    libs = [os.path.join(os.path.dirname(lib), n) for n in _OOM_LIBS]
    missing = _core._hooks_torch_oom_missing(libs) if here else None
    if here and missing is not None:
        logging.getLogger("gpuptr").warning(
            "c10::OutOfMemoryError cannot be built from %s (%s not found): out of memory raises a "
            "RuntimeError in PyTorch",
            libs,
            missing,
        )
    if not (here and _core._hooks_torch_errors(lib)):
        logging.getLogger("gpuptr").warning(
            "PyTorch's exception thrower was not found in %s: an allocation that fails "
            "returns a null pointer to PyTorch",
            lib,
        )


# Where PyTorch's c10::OutOfMemoryError (its typeinfo, vtable and
# constructor) may be exported.
_OOM_LIBS = ("libc10.so", "libc10_cuda.so", "libtorch_cuda.so", "libtorch_cpu.so", "libtorch_python.so")


def _torch_C() -> Any:
    import torch

    return getattr(torch, "_C", None)


def _graph_trees(wanted: Optional[bool]) -> None:
    """``torch.compile(mode="reduce-overhead")`` on gpuptr: CUDA graph trees
    (gpuptr answers their allocator calls, ``gpuptr._torch_trees``) or one
    graph per compiled function (``cudagraph_trees = False``), as
    ``wanted`` says; None keeps inductor's setting, unless this torch lacks
    what trees need."""
    try:
        import torch._inductor.config as inductor_config
    except Exception:  # noqa: BLE001 - a torch without inductor: nothing to set
        return
    import torch

    from gpuptr import _torch_trees

    triton = getattr(inductor_config, "triton", None)
    if triton is None:
        return
    log = logging.getLogger("gpuptr")
    # Applied whatever the setting, so that trees turned on later work too:
    # the calls answered raise under any pluggable allocator.
    answered = _torch_trees.patch_trees(torch)
    if wanted is not None:
        triton.cudagraph_trees = bool(wanted)
    if getattr(triton, "cudagraph_trees", False) and not answered:
        triton.cudagraph_trees = False
        log.warning(
            "this torch lacks what CUDA graph trees need on gpuptr (%s): "
            "torch.compile(mode='reduce-overhead') captures one CUDA graph per compiled "
            "function (torch._inductor.config.triton.cudagraph_trees = False)",
            ", ".join(n for n in _torch_trees.NEEDED if not hasattr(torch._C, n)),
        )
    elif wanted is False:
        log.info(
            "torch.compile(mode='reduce-overhead') captures one CUDA graph per compiled "
            "function on gpuptr (torch._inductor.config.triton.cudagraph_trees = False, as asked)"
        )
