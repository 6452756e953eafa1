"""RMM, and the RAPIDS libraries that allocate through it, on gpuptr's pool.

``gpuptr.rmm.install()`` makes RMM's device memory resource on every device
an ``rmm.mr.CallbackMemoryResource`` over gpuptr's pool, so
``rmm.DeviceBuffer``, ``rmm.allocators.cupy``/``torch``/``numba``, cuDF,
cuML and anything else that allocates through RMM share the one pool with
numba, CuPy, PyTorch and ``gpuptr.alloc``. ``gpuptr.stats()`` counts their
memory under the client ``"rmm"``.

The callables RMM calls (it takes the GIL for each) are the extension
module's own functions, not Python code: the allocation is
``functools.partial(_core._rmm_alloc, device, stream_ordered)``, which
costs 17 ns more per call than calling the function directly (measured on
the simulator: 270 against 253 ns for a zero-byte call), and the free is
``_core._rmm_free`` itself.

Devices: RMM keeps one resource per device and allocates through the
current device's, so ``install()`` sets one per device with its device
bound, as RMM asks (``set_per_device_resource``: a resource belongs to one
device). An allocation never asks the driver which device is current.

Streams: RMM's rule. An allocation is made on the stream RMM passes, and a
free on the stream RMM passes is reused at once there; other streams get
the block after gpuptr's fence (all work queued before the free, on every
stream, done). ``install(stream_ordered=False)`` makes every free wait for
the fence.

Out of memory: the callback raises gpuptr's ``OutOfMemoryError`` (a
``MemoryError``); RMM turns a ``MemoryError`` into its C++
``rmm::out_of_memory``, which reaches Python as a plain ``MemoryError``
whose message is ``"std::bad_alloc: "`` followed by gpuptr's (the device,
the size asked for, what the pool held). Other failures (a bad device, no
driver) reach Python as ``RuntimeError`` with gpuptr's message.

Freeing: only what this resource handed out is freed. A null pointer is
nothing to free (as RMM's own resources); any other address it did not hand
out, and a second free of one it did, is ignored and counted as a failure
(``_core._hooks_state()``), never freed: another library's memory stays
its own.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional

from gpuptr import _core
from gpuptr._errors import InstallError

__all__ = ["install", "installed", "memory_resource"]

# Per device: the resource install() made RMM's current one there.
_installed: Dict[int, Any] = {}
_stream_ordered = True


def _import_rmm() -> Any:
    try:
        import rmm
        import rmm.mr
    except ImportError as e:
        from gpuptr._needs import NEEDS  # the hint gpuptr.install() gives

        raise InstallError(
            f"gpuptr.rmm needs RMM, which cannot be imported ({e}): pip install {NEEDS['rmm'][1]}"
        ) from e
    return rmm


def memory_resource(device: Optional[int] = None, *, stream_ordered: bool = True) -> Any:
    """A new ``rmm.mr.CallbackMemoryResource`` over gpuptr's pool on
    ``device`` (default: the current device), for RMM code that takes a
    resource (``rmm.DeviceBuffer(size=n, mr=...)``, ``set_per_device_resource``).
    Its memory is counted under ``"rmm"``; ``stream_ordered`` as in
    :func:`install`."""
    from gpuptr._needs import flag

    stream_ordered = flag(stream_ordered, "stream_ordered")
    rmm = _import_rmm()
    d = _core._current_device() if device is None else int(device)
    if not 0 <= d < _core.driver_info()["device_count"]:
        from gpuptr._errors import InvalidArgumentError

        raise InvalidArgumentError(f"no device {d}")
    return _resource(rmm, d, stream_ordered)


def _resource(rmm: Any, device: int, stream_ordered: bool) -> Any:
    # Both callables are the extension module's own (a partial over a
    # builtin stays a C call): RMM calls them with the GIL, for every
    # allocation and free.
    allocate = functools.partial(_core._rmm_alloc, device, stream_ordered)
    return rmm.mr.CallbackMemoryResource(allocate, _core._rmm_free)


def installed() -> bool:
    """Whether ``install()`` put RMM on gpuptr in this process, and RMM's
    resource of each device is still gpuptr's."""
    if not _installed:
        return False
    try:
        import rmm.mr
    except ImportError:  # pragma: no cover - installed means RMM imported
        return False
    return all(rmm.mr.get_per_device_resource(d) is mr for d, mr in _installed.items())


def install(*, stream_ordered: bool = True) -> None:
    """Make gpuptr's pool RMM's device memory resource on every device
    (``rmm.mr.set_per_device_resource``). Buffers RMM allocated before keep
    their own resource (each ``rmm.DeviceBuffer`` holds it) and go back to
    it; RMM drops its own reference to the resource it replaces, as it does
    for any ``set_current_device_resource``, so call this before RAPIDS
    allocates. Calling it again changes nothing unless ``stream_ordered``
    differs or something else was made RMM's resource since.
    ``rmm.reinitialize()`` or ``set_current_device_resource()`` after it
    replace gpuptr's resource. Raises :class:`~gpuptr.InstallError`, with
    what to install, where RMM cannot be imported."""
    global _stream_ordered
    from gpuptr._needs import flag

    stream_ordered = flag(stream_ordered, "stream_ordered")
    rmm = _import_rmm()
    mr_mod = rmm.mr
    for name in ("CallbackMemoryResource", "set_per_device_resource", "get_per_device_resource"):
        if not hasattr(mr_mod, name):  # pragma: no cover - an RMM without them
            raise InstallError(f"this RMM ({getattr(rmm, '__version__', '?')}) lacks rmm.mr.{name}")
    same = stream_ordered == _stream_ordered
    for d in range(_core.driver_info()["device_count"]):
        mine = _installed.get(d)
        if same and mine is not None and mr_mod.get_per_device_resource(d) is mine:
            continue
        mr = _resource(rmm, d, stream_ordered)
        mr_mod.set_per_device_resource(d, mr)
        _installed[d] = mr
    _stream_ordered = stream_ordered
