"""PyTorch's memory API on gpuptr, without PyTorch: the counts the
allocator hooks keep for PyTorch, their mapping onto ``torch.cuda.memory_stats()``'s
keys, the history-to-snapshot path, the ``torch._C`` entry points
``gpuptr.torch.install()`` sets (on a stand-in namespace), the throw of
PyTorch's ``c10::OutOfMemoryError`` (against a stand-in ``libc10`` built
here), and CuPy's default pool answered by gpuptr. The hooks are called
through ctypes, as PyTorch's pluggable allocator calls them. The real
libraries are exercised by gpu/test_torch_fidelity_gpu.py."""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import types

import pytest

import gpuptr
from helpers import torch_hooks
from gpuptr import _core, _torch_stats

t_alloc, t_free = torch_hooks()

MiB = 1 << 20

#: The keys of ``torch._C._cuda_memoryStats(device)`` in torch 2.11 (read on
#: the H200 from torch's own allocator), each ``by pool`` or a ``stat``.
BY_POOL = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
STATS = ("oversize_allocations", "oversize_segments")
COUNTERS = ("num_alloc_retries", "num_ooms", "max_split_size", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def flatten(nested):
    """``torch.cuda.memory.memory_stats``'s own flattening of the nested dict."""
    out = []

    def walk(prefix, obj):
        if isinstance(obj, dict):
            prefix = prefix + "." if prefix else prefix
            for k, v in obj.items():
                walk(prefix + k, v)
        else:
            out.append((prefix, obj))

    walk("", nested)
    out.sort()
    return collections.OrderedDict(out)


def counts(device=0):
    return _core._torch_counts(device)


def by_pool(**pools):
    """A by-pool dict: each pool's (current, peak, allocated, freed)."""
    full = {p: pools.get(p, (0, 0, 0, 0)) for p in ("all", "small_pool", "large_pool")}
    return {p: dict(zip(("current", "peak", "allocated", "freed"), v)) for p, v in full.items()}


def device_stats(device=0):
    gc.collect()
    return gpuptr.stats()[device]


# ----------------------------------------------------------- the mapping


def test_memory_stats_maps_torchs_counts_and_the_pools_segments_onto_torchs_keys():
    counts_in = {
        "allocation": by_pool(all=(2, 3, 5, 3), small_pool=(1, 2, 3, 2), large_pool=(1, 1, 2, 1)),
        "allocated_bytes": by_pool(all=(3072, 4096, 9000, 5928), small_pool=(1024, 2048, 4000, 2976)),
        "requested_bytes": by_pool(all=(3000, 4000, 8800, 5800)),
        "num_ooms": 4,
        "segments_base": {"count": by_pool(all=(0, 0, 1, 1)), "bytes": by_pool(all=(0, 0, MiB, MiB))},
        "retries_base": 2,
    }
    stats_in = {
        "num_alloc_retries": 7,
        "segments": {
            "count": by_pool(all=(3, 4, 6, 3), small_pool=(2, 2, 4, 2), large_pool=(1, 2, 2, 1)),
            "bytes": by_pool(all=(8 * MiB, 9 * MiB, 20 * MiB, 12 * MiB)),
        },
    }
    import copy

    kept = copy.deepcopy(stats_in)
    nested = _torch_stats.memory_stats(copy.deepcopy(counts_in), stats_in)
    # The same from _torch_counts' own layout (the pool's numbers in it).
    assert _torch_stats.memory_stats({**copy.deepcopy(counts_in), **copy.deepcopy(stats_in)}) == nested
    assert set(nested) == set(BY_POOL) | set(STATS) | set(COUNTERS)
    flat = flatten(nested)
    # What torch.cuda.memory_allocated & co. read.
    assert flat["allocated_bytes.all.current"] == 3072
    assert flat["allocated_bytes.all.peak"] == 4096
    assert flat["reserved_bytes.all.current"] == 8 * MiB and flat["reserved_bytes.all.peak"] == 9 * MiB
    # Totals count from the last reset of accumulated stats: the pool's go on.
    assert flat["reserved_bytes.all.allocated"] == 19 * MiB and flat["reserved_bytes.all.freed"] == 11 * MiB
    assert (flat["segment.all.allocated"], flat["segment.all.freed"]) == (5, 2)
    assert (flat["num_device_alloc"], flat["num_device_free"]) == (5, 2)
    assert flat["segment.small_pool.current"] == 2 and flat["segment.large_pool.peak"] == 2
    assert flat["num_alloc_retries"] == 5 and flat["num_ooms"] == 4
    # A freed block is the pool's at once: active is allocated.
    assert nested["active_bytes"] == nested["allocated_bytes"] and nested["active"] == nested["allocation"]
    assert nested["requested_bytes"]["all"]["current"] == 3000
    # gpuptr never splits a block.
    assert all(v == 0 for k, v in flat.items() if k.startswith(("inactive_split", "oversize")))
    assert flat["max_split_size"] == -1
    # Every key memory_summary formats is there.
    for metric in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes", "inactive_split_bytes",
                   "allocation", "active", "segment", "inactive_split"):
        for pool in ("all", "large_pool", "small_pool"):
            for k in ("current", "peak", "allocated", "freed"):
                assert isinstance(flat[f"{metric}.{pool}.{k}"], int)
    # The pool's numbers are read, not changed (gpuptr.stats() may be reused).
    assert stats_in == kept
    assert nested["active"] is not nested["allocation"], "each key its own dicts"
    assert nested["inactive_split"]["all"] is not nested["inactive_split_bytes"]["all"]


def test_torch_snapshot_takes_torchs_arguments():
    snap = {
        "segments": [{"segment_pool_id": (0, 0), "address": 1}, {"segment_pool_id": (1, 2), "address": 2}],
        "device_traces": [[{"action": "alloc"}], []],
        "allocator_settings": {"allocator": "gpuptr"},
    }
    assert _torch_stats.torch_snapshot(snap, None) == snap
    assert _torch_stats.torch_snapshot(snap, (0, 0, True)) == snap
    light = _torch_stats.torch_snapshot(snap, (0, 0, False))
    assert light["device_traces"] == [[], []] and light["segments"] == snap["segments"]
    assert [s["address"] for s in _torch_stats.torch_snapshot(snap, (1, 2))["segments"]] == [2]
    assert snap["device_traces"] == [[{"action": "alloc"}], []], "the input is left as it was"


def test_record_history_args_follow_torchs_signatures():
    f = _torch_stats.record_history_args
    # _cuda_record_memory_history(enabled, context, stacks, max_entries, clear_history, ...)
    assert f(False, ("all", "all", "all", 500, False, False, False, [], False, True), {}) == (True, 500)
    assert f(False, ("all", "all", "all", sys.maxsize), {}) == (True, sys.maxsize)
    assert f(False, ("state", None, "python", 10), {}) == (True, 0)
    assert f(False, (None,), {}) == (False, 0)
    assert f(False, ("all", "all", "all", 10, False, False, False, [], True, False), {}) == (False, 0)
    assert f(False, (), {"enabled": "all", "max_entries": 7}) == (True, 7)
    with pytest.raises(ValueError, match="'state' or 'all'"):
        f(False, ("everything",), {})
    # _cuda_record_memory_history_legacy(enabled, record_context, trace_alloc_max_entries, ...)
    assert f(True, (True, True, 1000, True), {}) == (True, 1000)
    assert f(True, (False,), {}) == (False, 1)


# --------------------------------------------------- the hooks' own counts


def test_the_hooks_count_torchs_blocks_requests_and_peaks_by_pool():
    _core._torch_reset_accumulated(0)
    _core._torch_reset_peak(0)
    c0 = counts()
    small = t_alloc(1000, 0, None)  # a 1 KiB block: the small pool
    large = t_alloc(3 * MiB, 0, None)  # large
    assert small and large
    c1 = counts()
    grew = lambda key, pool, field: c1[key][pool][field] - c0[key][pool][field]  # noqa: E731
    assert grew("allocation", "all", "current") == 2 and grew("allocation", "small_pool", "current") == 1
    assert grew("allocated_bytes", "small_pool", "current") == 1024, "the 1 KiB class"
    assert grew("allocated_bytes", "large_pool", "current") == 3 * MiB
    assert grew("requested_bytes", "all", "current") == 1000 + 3 * MiB
    assert c1["allocated_bytes"]["all"]["peak"] == c1["allocated_bytes"]["all"]["current"]
    # gpuptr.stats()'s torch client counts the bytes asked for: the same.
    assert device_stats()["clients"]["torch"]["live_bytes"] == c1["requested_bytes"]["all"]["current"]
    t_free(large, 3 * MiB, 0, None)
    t_free(small, 1000, 0, None)
    c2 = counts()
    assert c2["allocated_bytes"]["all"]["current"] == c0["allocated_bytes"]["all"]["current"]
    assert c2["allocated_bytes"]["all"]["peak"] == c1["allocated_bytes"]["all"]["peak"], "the peak stays"
    assert c2["allocation"]["all"]["freed"] - c0["allocation"]["all"]["freed"] == 2
    assert c2["allocated_bytes"]["large_pool"]["freed"] - c0["allocated_bytes"]["large_pool"]["freed"] == 3 * MiB
    _core._torch_reset_peak(0)
    c3 = counts()
    assert c3["allocated_bytes"]["all"]["peak"] == c3["allocated_bytes"]["all"]["current"]
    assert c3["allocated_bytes"]["all"]["allocated"] == c2["allocated_bytes"]["all"]["allocated"], "totals stay"
    _core._torch_reset_accumulated(0)
    c4 = counts()
    assert all(c4[k]["all"][f] == 0 for k in ("allocation", "allocated_bytes", "requested_bytes") for f in ("allocated", "freed"))
    assert c4["num_ooms"] == 0
    base = c4["segments_base"]["count"]["all"]["allocated"]
    assert c2["segments_base"]["count"]["all"]["allocated"] <= base <= device_stats()["segments"]["count"]["all"]["allocated"]


def test_peaks_are_exact_across_threads():
    # PyTorch's backward allocates on autograd's thread: the peak is the
    # peak of the sum, not a sum of per-thread peaks.
    import threading

    _core._torch_reset_peak(0)
    base = counts()["allocated_bytes"]["all"]["current"]
    a = t_alloc(4 * MiB, 0, None)
    t_free(a, 4 * MiB, 0, None)
    got = []
    th = threading.Thread(target=lambda: got.append(t_alloc(4 * MiB, 0, None)))
    th.start()
    th.join()
    t_free(got[0], 4 * MiB, 0, None)
    assert counts()["allocated_bytes"]["all"]["peak"] == base + 4 * MiB


def test_an_out_of_memory_counts_in_num_ooms_and_the_process_goes_on():
    before = counts()["num_ooms"]
    assert t_alloc(1 << 50, 0, None) is None  # no PyTorch here: a null pointer
    assert counts()["num_ooms"] == before + 1
    p = t_alloc(MiB, 0, None)
    assert p
    t_free(p, MiB, 0, None)


def test_the_counts_refuse_devices_that_do_not_exist():
    for f in (_core._torch_counts, _core._torch_reset_peak, _core._torch_reset_accumulated):
        with pytest.raises(gpuptr.InvalidArgumentError):
            f(99)
        with pytest.raises(gpuptr.InvalidArgumentError):
            f(-1)
        with pytest.raises(TypeError):
            f("zero")


def test_segments_count_the_pools_driver_allocations():
    gpuptr.trim()
    s0 = device_stats()["segments"]
    p = t_alloc(5 * MiB, 0, None)
    d1 = device_stats()
    s1 = d1["segments"]
    assert s1["count"]["large_pool"]["allocated"] >= s0["count"]["large_pool"]["allocated"] + 1
    assert s1["bytes"]["all"]["current"] == d1["pool_bytes"] >= 5 * MiB
    assert s1["bytes"]["large_pool"]["current"] + s1["bytes"]["small_pool"]["current"] == d1["pool_bytes"]
    t_free(p, 5 * MiB, 0, None)
    gpuptr.flush_pool()
    gpuptr.trim()
    d2 = device_stats()
    s2 = d2["segments"]
    assert s2["bytes"]["all"]["current"] == d2["pool_bytes"] == 0
    assert s2["count"]["all"]["freed"] > s1["count"]["all"]["freed"]
    assert s2["bytes"]["all"]["peak"] >= s1["bytes"]["all"]["current"]
    snap_segments = [s for s in gpuptr.snapshot()["segments"] if s["device"] == 0]
    assert len(snap_segments) == s2["count"]["all"]["current"] == 0


# ------------------------------------------- torch._C's entry points, faked


@pytest.fixture
def fake_C():
    def own(name):
        def f(*a, **k):
            raise RuntimeError(f"CUDAPluggableAllocator does not yet support {name}")

        f.__module__ = "torch._C"
        return f

    names = list(_torch_stats.entry_points(_core))
    ns = types.SimpleNamespace(**{n: own(n) for n in names}, _cuda_other=own("other"))
    yield ns
    _core.record_history(False)


def test_patch_answers_torchs_entry_points_from_gpuptr(fake_C):
    originals = {n: getattr(fake_C, n) for n in vars(fake_C)}
    done = _torch_stats.patch(fake_C)
    assert sorted(done) == sorted(_torch_stats.entry_points(_core))
    assert fake_C._cuda_other is originals["_cuda_other"], "nothing else is touched"
    assert _torch_stats.patch(fake_C) == done and fake_C._cuda_memoryStats is not originals["_cuda_memoryStats"]
    assert _torch_stats._replaced["_cuda_memoryStats"] is originals["_cuda_memoryStats"]
    # torch.cuda.memory_allocated(0) = memory_stats(0)["allocated_bytes.all.current"]
    before = flatten(fake_C._cuda_memoryStats(0))
    p = t_alloc(2 * MiB, 0, None)
    now = flatten(fake_C._cuda_memoryStats(0))
    assert now["allocated_bytes.all.current"] == before["allocated_bytes.all.current"] + 2 * MiB
    assert now["requested_bytes.large_pool.current"] == before["requested_bytes.large_pool.current"] + 2 * MiB
    assert now["reserved_bytes.all.current"] == device_stats()["pool_bytes"] >= now["allocated_bytes.all.current"]
    fake_C._cuda_resetPeakMemoryStats(0)
    assert flatten(fake_C._cuda_memoryStats(0))["allocated_bytes.all.peak"] == now["allocated_bytes.all.current"]
    assert device_stats()["peak_pool_bytes"] == device_stats()["pool_bytes"], "the pool's peak too"
    fake_C._cuda_resetAccumulatedMemoryStats(0)
    after = flatten(fake_C._cuda_memoryStats(0))
    assert after["allocation.all.allocated"] == 0 and after["num_device_alloc"] == 0
    t_free(p, 2 * MiB, 0, None)
    assert flatten(fake_C._cuda_memoryStats(0))["allocation.all.freed"] == 1
    with pytest.raises(gpuptr.InvalidArgumentError):
        fake_C._cuda_memoryStats(7)


def test_torchs_empty_cache_gives_the_pools_cache_back(fake_C):
    _torch_stats.patch(fake_C)
    p = t_alloc(4 * MiB, 0, None)
    t_free(p, 4 * MiB, 0, None)
    gpuptr.alloc_host(MiB).free()   # pinned memory, cached by the host cache
    gpuptr.flush_pool()
    assert device_stats()["cached_bytes"] > 0 and device_stats()["host"]["cached_bytes"] > 0
    fake_C._cuda_emptyCache()       # torch.cuda.empty_cache()
    assert device_stats()["cached_bytes"] == 0
    # Pinned host memory is not PyTorch's empty_cache()'s to give back.
    assert device_stats()["host"]["cached_bytes"] > 0
    gpuptr.trim()
    assert device_stats()["host"]["cached_bytes"] == 0
    # reserved_bytes (torch.cuda.memory_reserved()) is what the pool still holds: nothing.
    assert flatten(fake_C._cuda_memoryStats(0))["reserved_bytes.all.current"] == device_stats()["pool_bytes"] == 0


def test_a_namespace_without_the_names_is_left_alone():
    ns = types.SimpleNamespace(_cuda_memoryStats=None)
    assert _torch_stats.patch(ns) == [] and ns._cuda_memoryStats is None
    assert _torch_stats.patch(None) == []


def test_history_and_snapshots_through_torchs_entry_points(fake_C):
    _torch_stats.patch(fake_C)
    # torch.cuda.memory._record_memory_history(max_entries=1000)
    fake_C._cuda_record_memory_history("all", "all", "all", 1000, False, False, False, [], False, True)
    assert gpuptr.recording_history()
    p = t_alloc(MiB + 512, 0, None)
    snap = fake_C._cuda_memorySnapshot(None)  # torch.cuda.memory._snapshot()
    trace = snap["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc" and e["addr"] == p]
    assert allocs and allocs[0]["client"] == "torch" and allocs[0]["size"] == MiB + 512
    assert allocs[0]["frames"][0] == {"filename": "gpuptr", "line": 0, "name": "client=torch"}
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["address"] == p]
    assert blocks and blocks[0]["state"] == "active_allocated" and blocks[0]["requested_size"] == MiB + 512
    # torch.cuda.memory_snapshot(): the segments, traces left out.
    light = fake_C._cuda_memorySnapshot((0, 0, False))
    assert all(t == [] for t in light["device_traces"]) and light["segments"]
    assert fake_C._cuda_memorySnapshot((3, 4, True))["segments"] == []
    t_free(p, MiB + 512, 0, None)
    frees = [e for e in fake_C._cuda_memorySnapshot(None)["device_traces"][0]
             if e["addr"] == p and not e["action"].startswith("segment")]
    assert [e["action"] for e in frees] == ["alloc", "free_requested", "free_completed"]
    # _record_memory_history("state"): the live blocks' stacks, no trace.
    fake_C._cuda_record_memory_history("state", "all", "all", 1000)
    q = t_alloc(4096, 0, None)
    st = fake_C._cuda_memorySnapshot(None)
    assert st["device_traces"][0] == []
    assert [b["frames"][0]["name"] for s in st["segments"] for b in s["blocks"] if b["address"] == q] == ["client=torch"]
    t_free(q, 4096, 0, None)
    fake_C._cuda_record_memory_history(None)
    assert not gpuptr.recording_history()
    fake_C._cuda_record_memory_history_legacy(True, True, 50)
    assert gpuptr.recording_history() and _core.snapshot()["allocator_settings"]["max_entries"] == 50
    fake_C._cuda_record_memory_history_legacy(False)
    assert not gpuptr.recording_history()


def _a_users_allocation(size):
    # PyTorch's operators release the GIL around their work, as a ctypes
    # call does: the hook is entered on a Python thread without the GIL.
    return t_alloc(size, 0, None)


def test_the_history_names_the_python_caller_of_an_allocation_made_without_the_gil(fake_C):
    import threading

    _torch_stats.patch(fake_C)
    fake_C._cuda_record_memory_history("all", "all", "all", 1000, False, False, False, [], False, True)
    try:
        got = {}
        p = _a_users_allocation(MiB)
        t = threading.Thread(target=lambda: got.setdefault("p", _a_users_allocation(4096)))
        t.start()
        t.join()
        trace = fake_C._cuda_memorySnapshot(None)["device_traces"][0]
        for addr in (p, got["p"]):
            frames = [e["frames"] for e in trace if e["action"] == "alloc" and e["addr"] == addr][0]
            assert frames[0]["name"] == "client=torch"
            assert any(f["filename"] == __file__ and f["name"] == "_a_users_allocation" for f in frames), frames
        t_free(p, MiB, 0, None)
        t_free(got["p"], 4096, 0, None)
    finally:
        fake_C._cuda_record_memory_history(None)
    # With the history off, the leak report alone never waits for the GIL:
    # a hook entered without it names no Python frame.
    gpuptr.track(True)
    try:
        q = _a_users_allocation(4096)
        sites = [str(o["site"]) for o in gpuptr.outstanding()]
        assert any("outside Python" in site for site in sites), sites
        assert not any("_a_users_allocation" in site for site in sites), sites
        t_free(q, 4096, 0, None)
    finally:
        gpuptr.track(False)


def test_torch_install_patches_torchs_entry_points(monkeypatch):
    import gpuptr.torch as gt

    calls = []

    class Mem(types.ModuleType):
        def CUDAPluggableAllocator(self, *a):
            return a

        def change_current_allocator(self, a):
            calls.append(a)

    def own(*a):
        raise RuntimeError("does not yet support getDeviceStats")

    own.__module__ = "torch._C"
    torch = types.ModuleType("torch")
    torch._C = types.SimpleNamespace(_cuda_memoryStats=own)
    torch.cuda = types.ModuleType("torch.cuda")
    torch.cuda.memory = Mem("torch.cuda.memory")
    for name, mod in (("torch", torch), ("torch.cuda", torch.cuda), ("torch.cuda.memory", torch.cuda.memory)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(gt, "_allocator", None)
    gt.install()
    assert calls and torch._C._cuda_memoryStats is not own
    assert "allocated_bytes" in torch._C._cuda_memoryStats(0)
    _core._hooks_configure(False)


# ------------------------------------------ c10::OutOfMemoryError, thrown

# A stand-in for the parts of PyTorch's libc10 gpuptr uses, with PyTorch's
# names (so the Itanium ABI's mangled names are the same), and a caller that
# catches as PyTorch's exception translation does.
FAKE_C10 = r"""
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <sys/types.h>
extern "C" __attribute__((visibility("default"))) int fake_destroyed = 0;
namespace c10 {
struct SourceLocation { const char* function; const char* file; uint32_t line; };
class __attribute__((visibility("default"))) Error : public std::exception {
  std::string msg_;
 public:
  Error(SourceLocation loc, std::string msg);
#ifdef INLINE_DTOR
  ~Error() override { ++fake_destroyed; }  // as PyTorch 2.11's: not exported
#else
  ~Error() override;
#endif
  const char* what() const noexcept override { return msg_.c_str(); }
};
Error::Error(SourceLocation, std::string msg) : msg_(std::move(msg)) {}
#ifndef INLINE_DTOR
Error::~Error() { ++fake_destroyed; }
#endif
#ifndef NO_OOM
class __attribute__((visibility("default"))) OutOfMemoryError : public Error { using Error::Error; };
// As PyTorch's allocator, which throws it (so its vtable is emitted).
__attribute__((visibility("default"))) void throw_oom() { throw OutOfMemoryError({"", "", 0}, "oom"); }
#endif
namespace detail {
[[noreturn]] __attribute__((visibility("default"))) void torchCheckFail(
    const char* f, const char* file, uint32_t line, const char* msg) {
  throw Error({f, file, line}, msg);
}
}
}
typedef void* (*alloc_fn)(ssize_t, int, void*);
extern "C" int fake_torch_call(alloc_fn alloc, ssize_t size, char* out, size_t n) {
  try {
    return alloc(size, 0, nullptr) ? 0 : 3;
#ifndef NO_OOM
  } catch (const c10::OutOfMemoryError& e) {
    snprintf(out, n, "%s", e.what());
    return 2;
#endif
  } catch (const c10::Error& e) {
    snprintf(out, n, "%s", e.what());
    return 1;
  } catch (...) {
    return 4;
  }
}
"""

CALLER = r"""
import ctypes, json, sys
from gpuptr import _core
path = sys.argv[1]
# As Python loads PyTorch (its extension module, and so libc10 and
# libstdc++ under it, RTLD_LOCAL), or into the global scope.
fake = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL if sys.argv[2] == "local" else ctypes.RTLD_GLOBAL)
found = {"oom": _core._hooks_torch_oom_missing([path, "/nonexistent/libc10_cuda.so"]) is None, "errors": _core._hooks_torch_errors(path)}
alloc = ctypes.cast(ctypes.CDLL(_core.__file__).gpuptr_torch_alloc, ctypes.c_void_p)
fake.fake_torch_call.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_char_p, ctypes.c_size_t]
buf = ctypes.create_string_buffer(4096)
results = []
for size in (1 << 50, 1 << 50, 1 << 20):
    rc = fake.fake_torch_call(alloc, size, buf, 4096)
    results.append([rc, buf.value.decode()])
print(json.dumps({"found": found, "results": results, "ooms": _core._torch_counts(0)["num_ooms"],
                  "destroyed": ctypes.c_int.in_dll(fake, "fake_destroyed").value,
                  "dtor_exported": hasattr(fake, "_ZN3c105ErrorD1Ev")}))
"""


@pytest.mark.parametrize("scope", ["local", "global"])
@pytest.mark.parametrize("variant", ["oom", "inline_dtor", "no_oom"])
def test_out_of_memory_throws_c10s_out_of_memory_error_where_libc10_has_it(tmp_path, variant, scope):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler to build the stand-in libc10")
    src = tmp_path / "fake_c10.cpp"
    src.write_text(FAKE_C10)
    so = tmp_path / "libc10.so"
    flags = {"oom": [], "inline_dtor": ["-DINLINE_DTOR", "-fvisibility-inlines-hidden"], "no_oom": ["-DNO_OOM"]}[variant]
    subprocess.run([cxx, "-shared", "-fPIC", "-O1", *flags, "-o", str(so), str(src)], check=True)
    out = subprocess.run([sys.executable, "-c", CALLER, str(so), scope], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    (rc1, msg1), (rc2, _), (rc3, _) = got["results"]
    # PyTorch 2.11 exports no destructor: the vtable's is used.
    assert got["dtor_exported"] == (variant != "inline_dtor")
    if variant != "no_oom":
        # Caught as c10::OutOfMemoryError (torch.cuda.OutOfMemoryError in
        # Python), twice: each throw is a fresh exception.
        assert got["found"] == {"oom": True, "errors": True}
        assert (rc1, rc2) == (2, 2)
    else:
        # No c10::OutOfMemoryError exported: c10::Error (a RuntimeError).
        assert got["found"] == {"oom": False, "errors": True}
        assert (rc1, rc2) == (1, 1)
    assert msg1.startswith("CUDA out of memory. Tried to allocate 1.00 PiB") and "gpuptr's pool holds" in msg1
    assert rc3 == 0, "the process goes on: the next allocation succeeds"
    assert got["ooms"] == 2
    assert got["destroyed"] == 2, "each exception was destroyed once its catch was done"


def test_the_oom_thrower_is_not_found_in_libraries_without_it():
    assert _core._hooks_torch_oom_missing(["/nonexistent/libc10.so"]) is not None
    assert _core._hooks_torch_oom_missing([]) is not None
    assert _core._hooks_torch_oom_missing([ctypes.util.find_library("c") or "libc.so.6"]) is not None
    # and says what it missed: nothing loaded, or a library without c10's pieces
    assert _core._hooks_torch_oom_missing(["/nonexistent/libc10.so"]) == "none of the libraries is loaded"
    assert _core._hooks_torch_oom_missing([ctypes.util.find_library("c") or "libc.so.6"]) == "c10::Error's constructor"


# ------------------------------------------------------- CuPy's default pool


def test_cupys_default_pool_answers_from_gpuptr(monkeypatch):
    from test_install import FakeCupy

    import gpuptr.cupy as gc_mod

    fake = FakeCupy()
    fake._default_memory_pool = object()
    fake.get_default_memory_pool = lambda: fake._default_memory_pool
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for name in ("_installed", "_stream_ordered", "_allocator", "_get_device", "_current_stream_ptr", "OutOfMemoryError"):
        monkeypatch.setattr(gc_mod, name, getattr(gc_mod, name))
    gc_mod.install(pinned=False)
    pool = fake.get_default_memory_pool()
    assert isinstance(pool, gc_mod._PoolView)
    used0, free0 = pool.used_bytes(), pool.free_bytes()
    mp = fake.allocator(3 * MiB)
    assert pool.used_bytes() == used0 + 3 * MiB == device_stats()["clients"]["cupy"]["live_bytes"]
    assert pool.total_bytes() == pool.used_bytes() + pool.free_bytes()
    del mp
    gc.collect()
    gpuptr.flush_pool()
    assert pool.used_bytes() == used0 and pool.free_bytes() >= 3 * MiB and pool.n_free_blocks() >= 1
    pool.free_all_blocks()
    assert pool.free_bytes() == 0 and device_stats()["pool_bytes"] == device_stats()["live_bytes"]
    pool.set_limit(size=64 * MiB)
    assert pool.get_limit() == 64 * MiB == device_stats()["pool_limit"]
    with pytest.raises(gpuptr.OutOfMemoryError):
        pool.malloc(128 * MiB)
    m = pool.malloc(MiB)
    assert m.mem.size == MiB
    del m
    pool.set_limit(fraction=0.5)
    assert pool.get_limit() == gpuptr.context(0).device.total_memory // 2
    pool.set_limit(0)
    assert pool.get_limit() == 0 and device_stats()["pool_limit"] is None
    with pytest.raises(ValueError):
        pool.set_limit(size=1, fraction=0.5)
    with pytest.raises(ValueError):
        pool.set_limit(fraction=1.5)
    gc_mod.install(pinned=False)
    assert fake.get_default_memory_pool() is pool, "installed again: the same pool"
    gpuptr.set_pool_limit(None)
