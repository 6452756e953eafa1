"""``gpuptr.install()``: numba, CuPy and PyTorch on one pool."""

from __future__ import annotations

from typing import Callable, Dict

from gpuptr._errors import InstallError

__all__ = ["install"]


def _numba(stream_ordered: bool) -> None:
    from gpuptr import numba as plugin

    # Every numba that imports: numba-cuda and numba-cuda-mlir each pick
    # their memory manager when they create their first context.
    for name in plugin._DRIVERS:
        try:
            driver = plugin._backend(name).driver
        except Exception:  # not installed, or no CUDA runtime to import with
            continue
        current = getattr(driver, "_memory_manager", None)
        if current is plugin.MemoryManager or (isinstance(current, type) and issubclass(current, plugin.MemoryManager)):
            continue
        if current is not None:
            raise InstallError(
                f"{name} already uses the memory manager {current.__module__}.{current.__name__} "
                "(it picks one when it creates its first CUDA context): call gpuptr.install() "
                "before numba's first CUDA call, or set NUMBA_CUDA_MEMORY_MANAGER=gpuptr.numba"
            )
        driver.set_memory_manager(plugin.MemoryManager)


def _cupy(stream_ordered: bool) -> None:
    from gpuptr import _capture, cupy

    cupy.install(stream_ordered=stream_ordered)
    _capture.hook_cupy()


def _torch(stream_ordered: bool) -> None:
    from gpuptr import _capture, torch

    torch.install(stream_ordered=stream_ordered)
    _capture.hook_torch()


_PARTS: Dict[str, Callable[[bool], None]] = {"numba": _numba, "cupy": _cupy, "torch": _torch}
# The module each part needs, as pip names it in the message.
_NEEDS = {
    "numba": ("gpuptr.numba", '"gpuptr[numba]" (numba-cuda) or "gpuptr[numba-mlir]" (numba-cuda-mlir)'),
    "cupy": ("cupy", "cupy-cuda13x (or cupy-cuda12x)"),
    "torch": ("torch", "torch"),
}


def install(
    numba: bool = True, cupy: bool = True, torch: bool = True, *, stream_ordered: bool = False
) -> Dict[str, str]:
    """Put numba (numba-cuda and numba-cuda-mlir, each that imports), CuPy
    and PyTorch on gpuptr's pool, so that memory one of
    them frees is there for the others. Each part is installed only if its
    library imports; call it before they allocate (PyTorch cannot swap
    allocators after its first CUDA allocation, numba after its first
    context: both raise :class:`~gpuptr.InstallError` saying so).

    Freed memory is reused only after all work queued before the free, on
    every stream, is done, so no stream can still be using it; with
    ``stream_ordered``, CuPy and PyTorch memory is reused at once on the
    stream that freed it (their own allocators' rule; numba frees without a
    stream either way).

    Returns what happened to each library: ``"installed"``, ``"not
    requested"``, or ``"skipped: …"`` with the reason it could not be
    imported.
    """
    import importlib

    wanted = {"numba": numba, "cupy": cupy, "torch": torch}
    report: Dict[str, str] = {}
    for name, part in _PARTS.items():
        if not wanted[name]:
            report[name] = "not requested"
            continue
        module, dist = _NEEDS[name]
        try:
            importlib.import_module(module)
        except ImportError as e:
            report[name] = f"skipped: {module} cannot be imported ({e}); pip install {dist}"
            continue
        part(bool(stream_ordered))
        report[name] = "installed"
    return report
