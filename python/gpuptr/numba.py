"""gpuptr for numba users: numba-cuda and numba-cuda-mlir.

This module is numba's External Memory Management plugin,
:class:`MemoryManager`, for both numbas: numba-cuda (``numba.cuda``) and
numba-cuda-mlir (``numba_cuda_mlir.cuda``), which keeps the same EMM
interface. ``NUMBA_CUDA_MEMORY_MANAGER=gpuptr.numba`` selects it in either,
or in both when both are installed: each numba context gets a manager built
on that numba's own classes (its ``BaseCUDAMemoryManager``, IPC mixin,
``MemoryInfo`` and ``CudaAPIError``), whichever numba imported first.

``as_cuda_array(obj)`` is a drop-in for ``numba.cuda.as_cuda_array``: it
returns a numba ``DeviceNDArray`` whose ``gpu_data`` is a gpuptr
MemoryPointer, holding the real context of the memory (resolved from the
address, not from numba's current context), at a fraction of numba's cost.
``foreign_args(kernel)`` launches a kernel on torch and CuPy arrays through
the same importer and a conversion cache. Both are for numba-cuda (they live
in ``gpuptr._launch``, imported on first use): numba-cuda-mlir's launcher
reads CUDA Array Interface and DLPack arguments itself, so pass CuPy and
torch arrays to its kernels directly.

numba copies host (numpy) arrays passed to a kernel to the device and back.
numba-cuda 0.30 allocates those copies through its device's cuda.core
``Device.allocate``, outside EMM; the plugin makes gpuptr's pool that
device's memory resource (:mod:`gpuptr.cuda_core`), so they come from the
pool too. numba-cuda-mlir allocates them through EMM.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
from typing import Any, Dict, Optional, Tuple

import gpuptr as _gpuptr
from gpuptr import _core

__all__ = [
    "ArgCache",
    "Launcher",
    "MemoryManager",
    "OutOfMemoryError",
    "as_cuda_array",
    "backend_of",
    "foreign_args",
    "from_cuda_array_interface_numba",
    "install",
]

# The numbas gpuptr serves, as the distribution names them, with the module
# that holds their EMM classes. The first that imports is the default for a
# manager made without a numba context (numba's own version check makes one).
_DRIVERS: Dict[str, str] = {
    "numba-cuda": "numba.cuda.cudadrv.driver",
    "numba-cuda-mlir": "numba_cuda_mlir.numba_cuda.cudadrv.driver",
}
_MLIR_PREFIX = "numba_cuda_mlir"


class OutOfMemoryError(_gpuptr.OutOfMemoryError):
    """Out of device memory in a numba allocation. What is raised is also
    that numba's own error, as its default manager reports it: a
    ``CudaAPIError`` (of numba-cuda or of numba-cuda-mlir, whichever
    allocated) with ``code`` 2 (``CUDA_ERROR_OUT_OF_MEMORY``), and gpuptr's
    :class:`~gpuptr.OutOfMemoryError` (a ``MemoryError``). Catch this class
    to handle both numbas. Raised after gpuptr has waited for its fence and
    returned its cache; the message says what the pool held."""


class _Backend:
    """One numba's EMM classes, and gpuptr's manager and OOM error built on
    them."""

    def __init__(self, name: str, driver: Any) -> None:
        self.name = name
        self.driver = driver
        self.MemoryManager = _make_manager(name, driver)
        self.OutOfMemoryError = _make_oom(name, driver.CudaAPIError)
        _size_gpuptr_memory_by_its_own(driver)


def _size_gpuptr_memory_by_its_own(driver: Any) -> None:
    """Make numba's ``driver.device_memory_size(devmem)`` give gpuptr's
    memory its own size. numba asks the driver for the extent of the
    allocation that holds the pointer (``cuMemGetAddressRange``): for one
    block of gpuptr's pool that is the whole pool segment, and a memset or
    a copy sized by it would write over the blocks after it, other
    owners' memory. For an array whose ``gpu_data`` is gpuptr's (what the
    plugin allocates, views of it, and ``as_cuda_array``'s imports) the
    size is that pointer's, cached as numba caches its own; anything else
    goes to numba's function as before. Idempotent. (``device_extents``,
    which numba's IPC export needs as the driver allocation's, is left
    alone.)"""
    original = getattr(driver, "device_memory_size", None)
    if original is None or getattr(original, "_gpuptr_sized", False):
        return

    def device_memory_size(devmem: Any) -> Any:
        if getattr(devmem, "_cuda_memsize_", None) is None:
            data = getattr(devmem, "gpu_data", None)
            if isinstance(data, _core.MemoryPointer):
                devmem._cuda_memsize_ = data._cuda_memsize_
        return original(devmem)

    functools.update_wrapper(device_memory_size, original)
    device_memory_size._gpuptr_sized = True  # type: ignore[attr-defined]
    driver.device_memory_size = device_memory_size


_backends: Dict[str, _Backend] = {}
_backends_lock = threading.Lock()


def _backend(name: str) -> _Backend:
    """The backend for the numba distribution ``name``, built on first use;
    ImportError (with the extra to install) if that numba cannot be
    imported."""
    b = _backends.get(name)
    if b is not None:
        return b
    if name not in _DRIVERS:
        raise ValueError(f"unknown numba {name!r}: one of {', '.join(_DRIVERS)}")
    try:
        driver = importlib.import_module(_DRIVERS[name])
    except Exception as e:  # not installed, or (numba-cuda-mlir) no CUDA runtime to load
        extra = "numba" if name == "numba-cuda" else "numba-mlir"
        raise ImportError(
            f'gpuptr.numba needs {name}: pip install "{name}[cu13]" (gpuptr\'s [{extra}] extra) ({e})',
            name=getattr(e, "name", None),
        ) from e
    with _backends_lock:
        b = _backends.get(name)
        if b is None:
            try:
                b = _Backend(name, driver)
            except AttributeError as e:  # no EMM classes: numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)
                raise ImportError(
                    f"gpuptr.numba needs {name}'s CUDA driver, which has External Memory Management; this one "
                    f"has none ({e}): numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) takes no memory manager"
                ) from e
            _backends[name] = b
        return b


def _name_for_module(module: str) -> Optional[str]:
    if module.startswith(_MLIR_PREFIX):
        return "numba-cuda-mlir"
    if module == "numba" or module.startswith("numba."):
        return "numba-cuda"
    return None


def _default_backend(hint: str = "") -> _Backend:
    """The backend of the numba in module ``hint`` if it names one, else the
    first numba that is already imported, else the first that imports."""
    name = _name_for_module(hint)
    if name is not None:
        return _backend(name)
    for name, module in _DRIVERS.items():
        if module in sys.modules:
            return _backend(name)
    errors = []
    for name in _DRIVERS:
        try:
            return _backend(name)
        except ImportError as e:
            errors.append(e)
    # Each error's cause, not its message: the message repeats the hint.
    why = "; ".join(f"{name}: {e.__cause__ or e}" for name, e in zip(_DRIVERS, errors))
    raise ImportError(
        f'gpuptr.numba needs numba-cuda or numba-cuda-mlir: pip install "numba-cuda[cu13]" or "numba-cuda-mlir[cu13]" '
        f"(gpuptr's [numba] or [numba-mlir] extra) ({why})",
        name=errors[0].name,
    ) from errors[0]


def backend_of(context: Any) -> str:
    """Which numba a numba context belongs to: ``"numba-cuda"`` or
    ``"numba-cuda-mlir"``. Contexts of neither (stand-ins in tests) belong to
    the default: the first numba imported."""
    name = _name_for_module(type(context).__module__)
    return name if name is not None else _default_backend().name


class _ManagerMeta(type):
    # Every numba's gpuptr manager is an instance (and subclass) of
    # MemoryManager, so one isinstance check holds under either numba.
    def __instancecheck__(cls, obj: Any) -> bool:
        return type.__instancecheck__(cls, obj) or any(
            isinstance(obj, b.MemoryManager) for b in list(_backends.values())
        )

    def __subclasscheck__(cls, sub: Any) -> bool:
        return type.__subclasscheck__(cls, sub) or any(
            issubclass(sub, b.MemoryManager) for b in list(_backends.values()) if isinstance(sub, type)
        )


class MemoryManager(metaclass=_ManagerMeta):
    """numba External Memory Management plugin (interface version 1) over
    gpuptr, for numba-cuda and numba-cuda-mlir: device memory comes from
    gpuptr's per-device caching pool, host memory is pinned by gpuptr, and
    every pointer holds its real, retained context.

    Enable it with ``NUMBA_CUDA_MEMORY_MANAGER=gpuptr.numba``, or with
    ``set_memory_manager(gpuptr.numba.MemoryManager)`` of either numba
    (``numba.cuda`` or ``numba_cuda_mlir.cuda``). numba makes one per
    context, as ``MemoryManager(context=ctx)``; that returns a manager of the
    context's own numba (a subclass of its ``BaseCUDAMemoryManager``).

    Reuse of freed device memory follows gpuptr's pool rule: a freed block is
    handed out again only after all work queued before its free, on every
    stream (non-blocking CuPy and torch streams included), has finished; a
    helper thread waits for that, never the allocating thread.

    ``get_memory_info()`` counts the bytes the pool caches as free: they are
    available to the next allocation.
    """

    interface_version = 1

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        context = kwargs.get("context")
        if context is not None:
            backend = _backend(backend_of(context))
        else:
            # numba's set_memory_manager makes one with context=None to read
            # its interface version: answer with the caller's numba.
            caller = sys._getframe(1).f_globals.get("__name__", "")
            backend = _default_backend(caller)
        return backend.MemoryManager(*args, **kwargs)


def _make_manager(name: str, driver: Any) -> type:
    base, mixin, memory_info = driver.BaseCUDAMemoryManager, driver.GetIpcHandleMixin, driver.MemoryInfo
    # numba-cuda (0.30) allocates copies of host-array kernel arguments
    # through its device's cuda.core Device.allocate, outside EMM; so may
    # numba-cuda-mlir (its devicearray has the same path).
    via_cuda_core = True

    class _Manager(mixin, base):  # type: ignore[misc,valid-type]  # numba ships no types
        __doc__ = MemoryManager.__doc__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._device: Optional[int] = None

        def initialize(self) -> None:
            # numba calls this on every context push: after the first call it
            # is one attribute test.
            if self._device is None and self.context is not None:
                dev = self.context.device
                # numba's own contexts have a Device (.id); contexts it
                # attaches to from a third party carry a bare CUdevice (int()).
                self._device = dev.id if hasattr(dev, "id") else int(dev)
                _gpuptr.context(self._device)
                if via_cuda_core:
                    _pool_cuda_core_allocations(getattr(dev, "_dev", None))

        def _dev(self) -> int:
            if self._device is None:
                self.initialize()
            assert self._device is not None, "numba initialises a manager with its context"
            return self._device

        def memalloc(self, size: int) -> _core.MemoryPointer:
            """Device memory from gpuptr's pool; :class:`OutOfMemoryError`
            (also this numba's ``CudaAPIError``) when none is left."""
            try:
                return _core._alloc_for("numba", size, device=self._dev())
            except _gpuptr.OutOfMemoryError as e:
                raise _backends[name].OutOfMemoryError(str(e)) from None

        def memhostalloc(self, size: int, mapped: bool = False, portable: bool = False, wc: bool = False) -> Any:
            """Pinned host memory (mapped into the device when ``mapped``)."""
            return _gpuptr.alloc_host(size, mapped=mapped, portable=portable, wc=wc, device=self._dev())

        def mempin(self, owner: Any, pointer: Any, size: int, mapped: bool = False) -> Any:
            """Pin ``size`` bytes of ``owner``'s memory at ``pointer`` in place."""
            return _core.register_host_ptr(pointer, size, owner, mapped=mapped, device=self._dev())

        def memallocmanaged(self, size: int, attach_global: bool) -> _core.ManagedMemory:
            """Managed (unified) memory."""
            return _gpuptr.alloc_managed(size, attach_global=attach_global, device=self._dev())

        def get_memory_info(self) -> Any:
            """``MemoryInfo(free, total)``, counting pool-cached bytes as free."""
            free, total = _gpuptr.context(self._dev()).get_memory_info()
            cached = _gpuptr.stats()[self._dev()]["cached_bytes"]
            return memory_info(free=min(free + cached, total), total=total)

        def reset(self) -> None:
            """Give cached blocks back and turn live pointers stale: numba
            resets the context next (``cuda.close()``), and a stale pointer's
            free never touches memory a later allocation reuses."""
            if self._device is not None:
                _core.reset_context(self._device)

        def defer_cleanup(self) -> Any:
            """gpuptr frees into its fenced pool at once, and safely on every
            stream, so there is nothing to defer."""
            return contextlib.nullcontext()

        @property
        def interface_version(self) -> int:
            return 1

    suffix = name.replace("-", "_")
    _Manager.__name__ = "MemoryManager"
    _Manager.__qualname__ = f"_MemoryManager_{suffix}"
    _Manager.__module__ = __name__
    return _Manager


def _pool_cuda_core_allocations(cuda_device: Any) -> None:
    """Make gpuptr's pool the memory resource of a numba device's cuda.core
    ``Device``, unless someone set one other than cuda.core's default. Never
    fails numba's context set-up: a failure is logged."""
    if cuda_device is None:
        return
    try:
        import cuda.core as cc

        from gpuptr import cuda_core

        if isinstance(cuda_device.memory_resource, cc.DeviceMemoryResource):
            cuda_core.install(cuda_device=cuda_device)
    except Exception as e:  # noqa: BLE001  (logged: numba's context must still come up)
        import logging

        logging.getLogger("gpuptr").warning(
            "numba's host-array copies stay on cuda.core's own memory resource: %s", e
        )


def _make_oom(name: str, cuda_api_error: Any) -> type:
    class _OOM(cuda_api_error, OutOfMemoryError):  # type: ignore[misc]  # numba ships no types
        __doc__ = OutOfMemoryError.__doc__

        def __init__(self, message: str) -> None:
            cuda_api_error.__init__(self, 2, message)
            # CudaAPIError's super().__init__(code, msg) reaches gpuptr's
            # __init__(message, code) along the MRO: set both sides' fields.
            self.code, self.msg, self.name = 2, message, "CUDA_ERROR_OUT_OF_MEMORY"
            self.args = (2, message)

        def __str__(self) -> str:
            return f"[2] {self.msg}"

        def __reduce__(self) -> Any:
            # Pickled across processes (Dask workers) as what __init__ takes;
            # found again through this module's __getattr__.
            return (type(self), (self.msg,))

    _OOM.__name__ = "OutOfMemoryError"
    _OOM.__qualname__ = f"_OutOfMemoryError_{name.replace('-', '_')}"
    _OOM.__module__ = __name__
    return _OOM


_numba_memory_manager = MemoryManager

# Fail at import, with the extra to install, when no numba is there.
_default_backend()

def install() -> None:
    """Make gpuptr the memory manager of every numba that imports
    (numba-cuda and numba-cuda-mlir), as ``NUMBA_CUDA_MEMORY_MANAGER=gpuptr.numba``
    does, from Python. Call it before numba's first CUDA call: numba picks
    its manager when it creates its first context, and raises
    :class:`~gpuptr.InstallError` if another manager was picked already.
    Calling it again is a no-op. ImportError (saying why) when no numba
    can take it: none installed, or only numba's CUDA simulator."""
    errors = []
    for name in _DRIVERS:
        try:
            driver = _backend(name).driver
        except Exception as e:  # not installed, or no CUDA runtime to import with
            errors.append(e)
            continue
        current = getattr(driver, "_memory_manager", None)
        if current is MemoryManager or (isinstance(current, type) and issubclass(current, MemoryManager)):
            continue
        if current is not None:
            raise _gpuptr.InstallError(
                f"{name} already uses the memory manager {current.__module__}.{current.__name__} "
                "(it picks one when it creates its first CUDA context): call gpuptr.install() "
                "before numba's first CUDA call, or set NUMBA_CUDA_MEMORY_MANAGER=gpuptr.numba"
            )
        driver.set_memory_manager(MemoryManager)
    if len(errors) == len(_DRIVERS):
        raise ImportError("; ".join(str(e) for e in errors)) from errors[-1]


_LAUNCH_NAMES = ("ArgCache", "Launcher", "as_cuda_array", "foreign_args", "from_cuda_array_interface_numba")


def _numba_cuda_found() -> bool:
    # Its EMM backend (built already where numba-cuda is the default): the
    # launcher itself stays unimported until first use.
    try:
        _backend("numba-cuda")
    except ImportError:
        return False
    return True


if not _numba_cuda_found():
    # ``from gpuptr.numba import *`` must work where numba-cuda-mlir is the
    # only numba: the launcher's names are not exported there.
    __all__ = [n for n in __all__ if n not in _LAUNCH_NAMES]

_PER_BACKEND: Dict[str, Tuple[str, str]] = {
    f"_{kind}_{n.replace('-', '_')}": (n, kind) for n in _DRIVERS for kind in ("MemoryManager", "OutOfMemoryError")
}


def __getattr__(attr: str) -> Any:
    if attr in _LAUNCH_NAMES:
        try:
            from gpuptr import _launch
        except ImportError as e:
            raise ImportError(
                f"gpuptr.numba.{attr} is for numba-cuda ({e}); numba-cuda-mlir's launcher reads "
                "CuPy and torch arrays (CUDA Array Interface, DLPack) itself: pass them to its "
                'kernels directly, or pip install "numba-cuda[cu13]"',
                name=e.name,
            ) from e
        return getattr(_launch, attr)
    if attr in _PER_BACKEND:  # what pickle looks up for a backend's class
        name, kind = _PER_BACKEND[attr]
        return getattr(_backend(name), kind)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
