"""Shared test helpers: the same plugin runner as ``python -m gpuptr check``,
DLPack's C structs in ctypes (to build and read capsules without a GPU
library), and the alloc/free soak (on the simulator and on the GPU)."""

from __future__ import annotations

import ctypes
import subprocess
import sys

from gpuptr.check import run_plugin

__all__ = ["DLDataType", "DLDevice", "DLManagedTensor", "DLManagedTensorVersioned", "DLTensor", "hide_modules", "run_plugin", "soak"]


def hide_modules(*names: str) -> str:
    """The first lines of a child script (unindented) in which ``names`` and
    their submodules cannot be imported, as if not installed: a finder first
    on ``sys.meta_path`` raises ``ImportError`` for them (numba-cuda hidden
    where numba-cuda-mlir is the only numba, an extra missing)."""
    return (
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if any(name == m or name.startswith(m + '.') for m in {list(names)!r}):\n"
        "            raise ImportError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Hide())\n"
    )


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


SOAK_CODE = """
import gc, sys, tracemalloc
import numpy as np
import gpuptr
from gpuptr import _core
N = int(sys.argv[1])
sizes = [256, 4096, 65536, 1 << 20, 3000, 12345]
mm = None
if sys.argv[2] == "plugin":
    from numba import cuda
    ctx = cuda.current_context()
    alloc = lambda n: cuda.device_array(n, dtype=np.uint8)
else:
    from gpuptr.numba import MemoryManager
    class _Ctx:
        class device:
            id = 0
    mm = MemoryManager(context=_Ctx()); mm.initialize()
    alloc = mm.memalloc
def own_mib():
    # This process's device memory, where the driver reports it by process
    # (nvidia-smi lists this pid): other processes on the same GPU then do
    # not count. None where it does not (no nvidia-smi, the simulator, a
    # pid namespace the driver does not see).
    import os, subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in out.splitlines() if line.count(",") == 1]
    mine = [int(m) for p, m in rows if p.strip() == str(os.getpid()) and m.strip().isdigit()]
    return sum(mine) if mine else None
free0, total = gpuptr.context(0).get_memory_info()
own0 = own_mib()
def cycle(k):
    for i in range(k):
        a = alloc(sizes[i % 6]); b = alloc(sizes[(i * 7) % 6])
        del a, b
cycle(1000)                      # warm the pool and the caches
gc.collect()
tracemalloc.start()
snap0 = tracemalloc.take_snapshot()
cycle(N // 2)
gc.collect()
snap1 = tracemalloc.take_snapshot()
grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename") if s.size_diff > 0)
s = gpuptr.stats()[0]
free1, _ = gpuptr.context(0).get_memory_info()
own1 = own_mib()
gpuptr.trim()  # the cache back to the driver: what is still used is not the pool's
free2, _ = gpuptr.context(0).get_memory_info()
own2 = own_mib()
used, after_trim = free0 - free1, free0 - free2
if None not in (own0, own1, own2):  # by process: what other processes did is not counted
    used, after_trim = (own1 - own0) << 20, (own2 - own0) << 20
print(N, s["live_bytes"], s["live_count"], s["cached_bytes"], used, grown, after_trim)
"""


def soak(n, mode, env):
    """Run ``n`` alloc/free cycles in a child process (``mode``: ``"plugin"``
    through numba under ``env``'s memory manager, ``"hooks"`` through
    :class:`gpuptr.numba.MemoryManager` directly) and assert that memory
    came back: no live pointer, free device memory back less what the pool
    caches, Python memory flat."""
    out = subprocess.run([sys.executable, "-c", SOAK_CODE, str(n), mode], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    n, live_bytes, live_count, cached, used, grown, after_trim = map(int, out.stdout.split())
    assert (live_bytes, live_count) == (0, 0)
    # Free device memory came back, except what the pool caches (and says
    # so); what is still used once the pool gave its cache back tells the
    # pool's count from the driver's own keeping. By process where the
    # driver reports it so (other processes may use the same GPU), else
    # the device's free memory.
    assert used <= cached + (2 << 20), dict(used=used, cached=cached, used_after_trim=after_trim)
    assert grown < 256 * 1024, f"Python memory grew by {grown} bytes"


def torch_hooks():
    """The two C functions PyTorch's pluggable allocator loads from gpuptr's
    extension (``gpuptr_torch_alloc``, ``gpuptr_torch_free``), typed as
    PyTorch calls them. Loaded from the module Python already imported, so
    they share its statics."""
    from gpuptr import _core

    lib = ctypes.CDLL(_core.__file__)
    alloc = lib.gpuptr_torch_alloc
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free = lib.gpuptr_torch_free
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    return alloc, free
