"""``python -m gpuptr check``: exercise the whole stack on whatever is here
and print a pass/fail table. Without a GPU it runs on the simulator and says
so; checks whose library (numba-cuda, CuPy, torch) is missing are skipped
by name. The exit status is non-zero if any check fails."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import traceback
from typing import Callable, List, Optional, Tuple, TextIO

PASS, FAIL, SKIP = "pass", "FAIL", "skip"


class Skip(Exception):
    """A check that cannot run here (says why)."""


def _on_gpu() -> bool:
    import gpuptr

    return gpuptr.driver_info()["driver"] == "cuda"


def _need_numba() -> None:
    try:
        import numba.cuda  # noqa: F401
    except Exception as e:
        raise Skip(f"numba-cuda not importable ({type(e).__name__})")
    try:
        from gpuptr.numba import MemoryManager  # noqa: F401
    except ImportError as e:  # numba's CUDA simulator: no memory managers
        raise Skip(str(e))


def run_plugin(code: str, timeout: int = 300) -> str:
    """Run ``code`` (dedented) as a script under
    ``NUMBA_CUDA_MEMORY_MANAGER=gpuptr.numba`` on the CUDA driver, from a
    file so that spawned children can re-import it; its stdout. A failure
    raises ``RuntimeError`` with the child's output. gpuptr's checks and its
    test suite share it."""
    return _run_script(code, timeout, manager="gpuptr.numba")


def _run_script(code: str, timeout: int = 300, manager: Optional[str] = None) -> str:
    """``code`` (dedented) as a script from a file, on the CUDA driver, with
    numba's memory manager ``manager`` (None: numba's own); its stdout."""
    import tempfile

    env = {k: v for k, v in os.environ.items() if k not in ("GPUPTR_DRIVER", "NUMBA_CUDA_MEMORY_MANAGER")}
    if manager:
        env["NUMBA_CUDA_MEMORY_MANAGER"] = manager
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "case.py")
        with open(path, "w") as f:
            f.write(textwrap.dedent(code))
        out = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=timeout, cwd=d)
    if out.returncode != 0:
        raise RuntimeError(f"the script failed (exit {out.returncode}):\n{out.stdout}{out.stderr}")
    return out.stdout


def check_driver() -> str:
    import gpuptr

    info = gpuptr.driver_info()
    where = "the CUDA driver" if info["driver"] == "cuda" else "gpuptr's simulator (GPUPTR_DRIVER=sim)"
    # Every other check needs device 0: with none visible (CUDA_VISIBLE_DEVICES
    # empty) they are not run, as without a driver.
    assert info["device_count"] > 0, f"{where} shows no device (is CUDA_VISIBLE_DEVICES empty?)"
    return f"{where}, CUDA {info['version_string']}, {info['device_count']} device(s)"


def check_contexts() -> str:
    import gpuptr

    for dev in gpuptr.devices():
        ctx = gpuptr.context(dev.id)
        assert ctx is gpuptr.context(dev.id), "one Context object per device"
        assert ctx.device.id == dev.id
        assert ctx.handle.value == int(ctx.handle) != 0
    return f"{len(gpuptr.devices())} primary context(s) retained, handles consistent"


def check_alloc() -> str:
    import gpuptr

    gc.collect()
    before = gpuptr.stats()[0]["live_bytes"]
    mem = gpuptr.alloc(1 << 20)
    data = bytes(range(256)) * 4096
    mem.copy_from_host(data)
    assert mem.copy_to_host() == data, "copy round trip"
    mem.memset(0x5A, count=16)
    assert mem.copy_to_host()[:17] == b"\x5a" * 16 + bytes([16]), "memset of a prefix"
    mem.free()
    mem.free()
    del mem
    gc.collect()
    assert gpuptr.stats()[0]["live_bytes"] == before, "live bytes back to start"
    return "1 MiB alloc, copy round trip, memset, double free"


def check_views() -> str:
    import gpuptr

    mem = gpuptr.alloc(4096)
    v = mem.view(1024, 2048)
    base = mem.device_pointer_value
    assert base is not None
    assert v.device_pointer_value == base + 1024 and v.size == 1024
    del mem
    gc.collect()
    v.memset(1)
    assert v.copy_to_host() == b"\x01" * 1024, "a view keeps its allocation alive"
    try:
        v.view(0, 4096)
    except gpuptr.InvalidPointerError:
        pass
    else:
        raise AssertionError("out-of-range view accepted")
    return "offsets, lifetime, bounds"


def check_pool() -> str:
    import gpuptr

    s0 = gpuptr.stats()[0]
    for _ in range(64):
        gpuptr.alloc(1 << 16).free()
    # Freed blocks wait for a fence (all earlier work, on every stream);
    # wait for it here, as the allocator itself never does.
    assert gpuptr.flush_pool(0), "the fence failed"
    for _ in range(64):
        gpuptr.alloc(1 << 16).free()
    s1 = gpuptr.stats()[0]
    if s1["pool_misses"] == s0["pool_misses"] and s1["pool_bytes"] == 0:
        raise Skip("the caching pool is off (GPUPTR_POOL): every allocation goes to the driver")
    hits = s1["pool_hits"] - s0["pool_hits"]
    assert hits > 0, "freed blocks are reused"
    return f"{hits} of 128 allocations from the cache, {s1['fences'] - s0['fences']} fence(s)"


def check_host() -> str:
    import gpuptr

    mapped = gpuptr.alloc_host(4096, mapped=True)
    assert isinstance(mapped, gpuptr.MappedMemory), type(mapped)
    mapped.memset(7)
    assert bytes(memoryview(mapped))[:4] == b"\x07" * 4
    managed = gpuptr.alloc_managed(4096)
    managed.memset(3)
    gpuptr.context(0).synchronize()
    assert bytes(memoryview(managed))[:4] == b"\x03" * 4
    return "pinned+mapped and managed memory, buffer protocol"


def check_numba_plugin() -> str:
    _need_numba()
    if not _on_gpu():
        from gpuptr.numba import MemoryManager

        class _Ctx:
            class device:
                id = 0

        mm = MemoryManager(context=_Ctx())
        mm.initialize()
        mem = mm.memalloc(1 << 20)
        assert mm.interface_version == 1 and mem.size == 1 << 20
        return "hooks on the simulator (numba's own contexts need a GPU)"
    out = run_plugin(
        """
        import numpy as np
        from numba import cuda
        from gpuptr.numba import MemoryManager
        assert isinstance(cuda.current_context().memory_manager, MemoryManager)
        @cuda.jit
        def inc(a):
            i = cuda.grid(1)
            if i < a.size:
                a[i] += 1
        d = cuda.to_device(np.arange(1000, dtype=np.int32))
        inc[4, 256](d)
        assert (d.copy_to_host() == np.arange(1, 1001)).all()
        print("ok")
        """
    )
    assert out.strip() == "ok", out[-300:]
    return "NUMBA_CUDA_MEMORY_MANAGER=gpuptr.numba: to_device + kernel"


def check_cai_import() -> str:
    import gpuptr

    if not _on_gpu():
        mem = gpuptr.alloc(64)
        desc = {"version": 3, "shape": (16,), "typestr": "<f4", "data": (mem.device_pointer_value, False)}
        v = gpuptr.from_cuda_array_interface(desc)
        assert v.context is gpuptr.context(0) and v.pointer.size == 64
        return "CAI v3 descriptor on the simulator (CuPy/torch need a GPU)"
    for name in ("cupy", "torch"):
        try:
            mod = __import__(name)
        except Exception:
            continue
        if name == "cupy":
            arr = mod.arange(256, dtype=mod.uint8)
        else:
            arr = mod.arange(256, dtype=mod.uint8, device="cuda")
        v = gpuptr.from_cuda_array_interface(arr)
        assert v.pointer.copy_to_host() == bytes(range(256))
        assert v.context.device.id == 0
        return f"{name} array: bytes and context"
    raise Skip("neither CuPy nor torch is installed")


def check_ipc() -> str:
    if not _on_gpu():
        raise Skip("IPC needs the GPU")
    _need_numba()
    out = run_plugin(
        """
        import multiprocessing as mp, numpy as np

        def child(h, q):
            with h as arr:
                q.put(arr.copy_to_host().tolist())

        if __name__ == "__main__":
            from numba import cuda
            arr = cuda.to_device(np.arange(8, dtype=np.int64))
            h = arr.get_ipc_handle()
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(h, q))
            p.start()
            print(q.get(timeout=120) == list(range(8)))
            p.join(60)
        """
    )
    assert out.strip() == "True", out[-300:]
    return "pooled pointer opened in a spawned process"


def check_export() -> str:
    import pickle

    import gpuptr

    mem = gpuptr.alloc(4096)
    mem.memset(5)
    cai = mem.__cuda_array_interface__
    assert cai["data"][0] == mem.device_pointer_value and cai["typestr"] == "|u1"
    back = gpuptr.from_dlpack(mem)  # our exporter, our importer
    assert back.ptr == mem.device_pointer_value and back.nbytes == 4096
    typed = gpuptr.as_array(mem, (32, 32), "float32")
    again = gpuptr.from_dlpack(typed)
    assert again.shape == (32, 32) and again.strides == (128, 4)
    h = pickle.loads(pickle.dumps(mem.view(1024, 2048).ipc_handle()))
    assert h.open().copy_to_host() == b"\x05" * 1024
    return "CAI and DLPack out (both capsule kinds), typed views, IPC handle by pickle"


def check_ipc_without_numba() -> str:
    if not _on_gpu():
        raise Skip("IPC between processes needs the GPU")
    out = _run_script(
        """
        import multiprocessing as mp, pickle, sys

        def child(payload, q):
            import gpuptr
            q.put((gpuptr.open_ipc(pickle.loads(payload)).copy_to_host(), "numba" in sys.modules))

        if __name__ == "__main__":
            import gpuptr
            mem = gpuptr.alloc(1 << 20)
            mem.memset(9)
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(pickle.dumps(mem.ipc_handle()), q))
            p.start()
            data, numba_loaded = q.get(timeout=120)
            p.join(60)
            print(data == b"\x09" * (1 << 20), numba_loaded)
        """
    )
    assert out.split() == ["True", "False"], out[-300:]
    return "a spawned child without numba read the parent's pool block"


def check_one_pool() -> str:
    if not _on_gpu():
        raise Skip("CuPy and torch on gpuptr need the GPU")
    try:
        import cupy  # noqa: F401
        import torch  # noqa: F401
    except Exception as e:
        raise Skip(f"needs CuPy and torch ({type(e).__name__})")
    out = _run_script(
        """
        import gc, gpuptr
        report = gpuptr.install()
        import cupy as cp, torch
        a = cp.ones(1 << 20, dtype=cp.float32)
        t = torch.ones(1 << 20, device="cuda")
        ok = float(a.sum()) == float(t.sum()) == float(1 << 20)
        live = {k: v["live_bytes"] > 0 for k, v in gpuptr.stats()[0]["clients"].items()}
        del a, t
        torch.cuda.synchronize(); gc.collect()
        after = {k: v["live_bytes"] for k, v in gpuptr.stats()[0]["clients"].items()}
        print(ok, live["cupy"], live["torch"], after["cupy"], after["torch"])
        """
    )
    assert out.split() == ["True", "True", "True", "0", "0"], out[-300:]
    return "CuPy and torch allocate from gpuptr's pool and give it back"


def check_leak_report() -> str:
    import gpuptr

    # The report leaves out gpuptr's own frames, and this check is one: the
    # allocation is made by code that names itself as a user's file.
    ns = {"gpuptr": gpuptr}
    gpuptr.track()
    try:
        exec(compile("leaked = gpuptr.alloc(12288)", "user_code.py", "exec"), ns)
        mine = [o for o in gpuptr.outstanding() if o["site"].startswith("user_code.py:1 in <module>")]
        assert mine and mine[0]["bytes"] == 12288, gpuptr.outstanding()
        del ns["leaked"]
        gc.collect()
        assert not [o for o in gpuptr.outstanding() if o["site"].startswith("user_code.py")]
    finally:
        gpuptr.track(False)
    return "an allocation names its caller until freed"


CHECKS: List[Tuple[str, Callable[[], str]]] = [
    ("driver", check_driver),
    ("contexts", check_contexts),
    ("alloc", check_alloc),
    ("views", check_views),
    ("pool", check_pool),
    ("host memory", check_host),
    ("numba plugin", check_numba_plugin),
    ("CAI import", check_cai_import),
    ("IPC", check_ipc),
    ("export", check_export),
    ("IPC without numba", check_ipc_without_numba),
    ("one pool (CuPy, torch)", check_one_pool),
    ("leak report", check_leak_report),
]


def _failure(e: Exception) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} at: {where.line}"


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def run(out: TextIO = sys.stdout, as_json: bool = False) -> int:
    """Run every check and print the table (or, with ``as_json``, a JSON
    report); returns the number of failures. Each row is printed as its
    check ends. On a terminal the row's name shows while its check runs,
    and its time follows the row; with the table going elsewhere, stderr
    shows the progress when it is a terminal. When the driver check fails,
    the others (which all need a driver) are not run."""
    import json
    import time

    failures = 0
    rows: List[Tuple[str, str, str]] = []
    not_run: List[str] = []
    width = max(len(name) for name, _ in CHECKS)
    live = not as_json and _isatty(out)
    progress = not live and _isatty(sys.stderr)
    for i, (name, fn) in enumerate(CHECKS):
        t0 = time.perf_counter()
        if live:
            print(f"{name:<{width}}  ", end="", file=out, flush=True)
        elif progress:
            print(f"  running: {name} ...", end="", file=sys.stderr, flush=True)
        try:
            row = (name, PASS, fn())
        except Skip as s:
            row = (name, SKIP, str(s))
        except Exception as e:
            failures += 1
            row = (name, FAIL, _failure(e))
        rows.append(row)
        took = time.perf_counter() - t0
        if live:
            print(f"{row[1]:<4}  {row[2]}  ({took:.1f} s)", file=out, flush=True)
        else:
            if progress:
                print(f" {row[1]} ({took:.1f} s)", file=sys.stderr, flush=True)
            if not as_json:
                print(f"{name:<{width}}  {row[1]:<4}  {row[2]}", file=out, flush=True)
        if name == "driver" and row[1] == FAIL:
            not_run = [n for n, _ in CHECKS[i + 1 :]]
            break
    counts = {k: sum(r[1] == v for r in rows) for k, v in (("passed", PASS), ("failed", FAIL), ("skipped", SKIP))}
    if as_json:
        report = {
            "checks": [{"name": n, "status": st, "detail": d} for n, st, d in rows],
            **counts,
            "not_run": not_run,
        }
        print(json.dumps(report, indent=2), file=out)
        return failures
    summary = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    if not_run:
        print(f"the other {len(not_run)} checks were not run: each needs a working driver and a device", file=out)
        summary += f", {len(not_run)} not run"
    print(summary, file=out)
    return failures
