"""``gpuptr.install()``: numba, CuPy, PyTorch and RMM on one pool."""

from __future__ import annotations

from typing import Callable, Dict

from gpuptr._needs import NEEDS, flag

__all__ = ["install"]


def _numba(stream_ordered: bool) -> None:
    # numba frees without a stream: its memory waits for every stream either way.
    from gpuptr import numba

    numba.install()


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
        module, dist = NEEDS[name]
        try:
            importlib.import_module(module)
        except ImportError as e:
            report[name] = f"skipped: {module} cannot be imported ({e}); pip install {dist}"
            continue
        try:
            part(stream_ordered)
        except ImportError as e:  # importable, yet unusable (numba's CUDA simulator)
            report[name] = f"skipped: {e}"
            continue
        report[name] = "installed"
    return report
