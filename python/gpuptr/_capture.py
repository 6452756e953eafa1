"""Stream captures (CUDA graphs) and gpuptr's pool.

CUDA refuses ``cuCtxSynchronize`` of a context while any stream of that
context captures, in every capture mode, and the refused call invalidates
the capture (another device's context may still synchronize). The pool's
fence is such a call, so each device's pool must know when a capture is
under way on it: :func:`capturing` (or ``begin_capture``/``end_capture``) tells it, and
``gpuptr.install()`` makes those calls around CuPy's
``Stream.begin_capture``/``end_capture`` and PyTorch's
``CUDAGraph.capture_begin``/``capture_end`` (so ``torch.cuda.graph`` too).
gpuptr's own allocations and frees need nothing: they run in relaxed
capture mode, which CUDA allows during a capture.

A graph replays its kernels at the addresses they had during the capture,
so the wrappers also call ``capture_started`` once the capture has begun:
pool blocks allocated during it (by the capturing thread, or on a stream
that takes part in it) and blocks the capturing thread frees during it are
then reused only after the graph, and every executable graph made from it,
is destroyed. CUDA tells gpuptr when that is (a user object the graph owns),
whichever library made the graph.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any, Dict, Iterator, Optional, Tuple

from gpuptr import _core

__all__ = ["capturing"]


@contextlib.contextmanager
def capturing(device: Optional[int] = None) -> Iterator[None]:
    """Tell gpuptr's pool that a stream capture is under way on ``device``
    (default: the current device) for the body of the ``with``: the pool
    runs no fence meanwhile (see ``gpuptr.begin_capture``). Use it around a
    capture that ``gpuptr.install()`` does not see, such as one begun with
    ``cuda.bindings`` or ``cuda.core``."""
    # The device is settled once, at the begin: the body may make another
    # device current, and the end must close the gate the begin opened.
    if device is None:
        device = _core._current_device()
    _core.begin_capture(device)
    pid = os.getpid()
    try:
        yield
    finally:
        _end(device, pid)


def _end(device: int, pid: int) -> None:
    """End the capture process ``pid`` began on ``device``: in a child
    forked meanwhile it is the parent's, not this process's to end (and
    gpuptr refuses every call there)."""
    if os.getpid() == pid:
        _core.end_capture(device)


def _wrap(cls: Any, begin: str, end: str, device_of: Any, stream_of: Any = None) -> None:
    """Make ``cls.begin``/``cls.end`` tell the pool, once per class; with
    ``stream_of`` (the capturing stream's handle, asked after the begin),
    the capture's memory is kept for its graph (``capture_started``)."""
    original_begin, original_end = getattr(cls, begin), getattr(cls, end)
    if getattr(original_begin, "__gpuptr_capture__", False):
        return
    # The device and process each capture began in, by the capturing object.
    began: Dict[int, Tuple[int, int]] = {}

    @functools.wraps(original_begin)
    def begin_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = device_of(self)
        _core.begin_capture(device)
        try:
            r = original_begin(self, *args, **kwargs)
        except BaseException:
            _core.end_capture(device)
            raise
        began[id(self)] = (device, os.getpid())
        if stream_of is not None:
            _keep_graph_memory(device, stream_of, self)
        return r

    @functools.wraps(original_end)
    def end_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original_end(self, *args, **kwargs)
        finally:
            where = began.pop(id(self), None)
            if where is not None:
                _end(*where)

    begin_wrapper.__gpuptr_capture__ = True  # type: ignore[attr-defined]
    setattr(cls, begin, begin_wrapper)
    setattr(cls, end, end_wrapper)


def _keep_graph_memory(device: int, stream_of: Any, obj: Any) -> None:
    """Keep the memory of the capture ``obj`` began for its graph; a
    warning if that cannot be done (the capture itself goes on)."""
    try:
        _core.capture_started(stream_of(obj), device)
    except Exception as e:  # noqa: BLE001 - the user's capture must not fail for it
        logging.getLogger("gpuptr").warning(
            "cannot keep the memory of this capture for its graph (%s): memory freed "
            "during it may be reused while the graph replays",
            e,
        )


def hook_cupy() -> None:
    """Tell the pool about CuPy's captures (``Stream.begin_capture``)."""
    import cupy

    def device_of(stream: Any) -> int:
        return int(cupy.cuda.Device().id)

    def stream_of(stream: Any) -> int:
        return int(stream.ptr)

    for cls in (cupy.cuda.Stream, cupy.cuda.ExternalStream):
        _try_wrap(cls, "begin_capture", "end_capture", device_of, stream_of)


def hook_torch() -> None:
    """Tell the pool about PyTorch's captures (``CUDAGraph.capture_begin``,
    which ``torch.cuda.graph`` and ``torch.compile(mode="reduce-overhead")``
    call)."""
    import torch

    def device_of(graph: Any) -> int:
        return int(torch.cuda.current_device())

    def stream_of(graph: Any) -> int:
        # torch.cuda.graph makes the capture stream current around capture_begin.
        return int(torch.cuda.current_stream().cuda_stream)

    _try_wrap(torch.cuda.CUDAGraph, "capture_begin", "capture_end", device_of, stream_of)


def _try_wrap(cls: Any, begin: str, end: str, device_of: Any, stream_of: Any = None) -> None:
    """:func:`_wrap`, or a warning where the class cannot be wrapped (an
    extension type, or a library version without those methods): the rest
    of ``install()`` still holds, and :func:`capturing` is the way then."""
    try:
        _wrap(cls, begin, end, device_of, stream_of)
    except (AttributeError, TypeError) as e:
        logging.getLogger("gpuptr").warning(
            "cannot tell the pool about %s.%s captures (%s): wrap them in gpuptr.capturing()",
            cls.__module__,
            cls.__qualname__,
            e,
        )
