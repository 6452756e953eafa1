"""``gpuptr.install()``: numba, CuPy, PyTorch and RMM on one pool."""

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


def _rmm(stream_ordered: bool) -> None:
    from gpuptr import rmm

    rmm.install(stream_ordered=stream_ordered)


_PARTS: Dict[str, Callable[[bool], None]] = {"numba": _numba, "cupy": _cupy, "torch": _torch, "rmm": _rmm}
# The module each part needs, as pip names it in the message.
_NEEDS = {
    "numba": ("gpuptr.numba", '"gpuptr[numba]" (numba-cuda) or "gpuptr[numba-mlir]" (numba-cuda-mlir)'),
    "cupy": ("cupy", "cupy-cuda13x (or cupy-cuda12x)"),
    "torch": ("torch", "torch"),
    "rmm": ("rmm", "rmm-cu13 (or rmm-cu12)"),
}


def flag(value: object, name: str) -> bool:
    """``value`` if it is a bool (numpy's included); ``TypeError`` naming
    ``name`` otherwise, so that ``stream_ordered="no"`` is not read as
    true."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"{name} must be True or False, not {type(value).__name__} {value!r}")


def install(
    numba: bool = True, cupy: bool = True, torch: bool = True, rmm: bool = True, *, stream_ordered: bool = True
) -> Dict[str, str]:
    """Put numba (numba-cuda and numba-cuda-mlir, each that imports), CuPy,
    PyTorch and RMM (RMM's device memory resource on every device, so cuDF,
    cuML and the other RAPIDS libraries too: see :mod:`gpuptr.rmm`) on
    gpuptr's pool, so that memory one of them frees is there for the
    others. Each part is installed only if its library imports; call it
    before they allocate (PyTorch cannot swap allocators after its first
    CUDA allocation, numba after its first context: both raise
    :class:`~gpuptr.InstallError` saying so).

    CuPy, PyTorch and RMM memory follows their own allocators' rule: a
    block freed on a stream is reused at once on that stream (PyTorch's
    ``record_stream`` is honoured: such a block waits until all work queued
    before its free, on every stream, is done). ``stream_ordered=False``
    gives CuPy, PyTorch and RMM memory that rule for every block (safe for
    tensors used on a side stream without ``record_stream``, at a cost
    on busy training steps: see the README). numba frees without a stream,
    and so waits for every stream, either way.

    Returns what happened to each library: ``"installed"``, ``"not
    requested"``, or ``"skipped: …"`` with the reason it could not be
    imported.
    """
    import importlib

    wanted = {
        "numba": flag(numba, "numba"),
        "cupy": flag(cupy, "cupy"),
        "torch": flag(torch, "torch"),
        "rmm": flag(rmm, "rmm"),
    }
    stream_ordered = flag(stream_ordered, "stream_ordered")
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
        part(stream_ordered)
        report[name] = "installed"
    return report
