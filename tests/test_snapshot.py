"""Memory snapshots in PyTorch's memory-viz format: ``gpuptr.record_history``,
``gpuptr.snapshot`` and ``gpuptr.dump_snapshot``, on the simulator (the
structure is the same on a GPU).

torch is not installed in CI, so ``check_memory_viz_format`` restates what
``torch/cuda/_memory_viz.py`` and ``torch/utils/viz/MemoryViz.js`` read of a
snapshot, function by function; where torch imports, the real
``_memory_viz`` functions run on the snapshot as well.
"""

from __future__ import annotations

import ctypes
import gc
import os
import pickle
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

import gpuptr
from gpuptr import _core

ACTIONS = {
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
}
STATES = {"active_allocated", "active_pending_free", "inactive"}


def check_frames(frames):
    # _frame_fmt, _frame_filter (f['line'], f['filename'], f['name']) and
    # MemoryViz.js frameFilter/format_frames (name.includes, filename.includes).
    assert isinstance(frames, list)
    for f in frames:
        assert isinstance(f["filename"], str) and isinstance(f["name"], str), f
        assert isinstance(f["line"], int), f


def check_memory_viz_format(snap):
    """What torch's memory viz reads of a snapshot, function by function."""
    assert set(snap) >= {"segments", "device_traces", "allocator_settings", "external_annotations"}
    assert isinstance(snap["allocator_settings"], dict)
    devices = len(snap["device_traces"])
    for seg in snap["segments"]:
        # segments()/memory(): seg['stream'], seg['address'], seg['blocks'];
        # segsum(): seg['total_size'], b['state'], b['size']; trace():
        # seg['address'], seg['allocated_size']; MemoryViz.js MemoryView and
        # annotate_snapshot: seg.device, seg.address, seg.total_size,
        # seg.stream, seg.frames; torch.cuda.memory._snapshot's own keys.
        for key, kind in (
            ("device", int),
            ("address", int),
            ("total_size", int),
            ("allocated_size", int),
            ("active_size", int),
            ("requested_size", int),
            ("stream", int),
            ("segment_type", str),
            ("is_expandable", bool),
            ("blocks", list),
        ):
            assert isinstance(seg[key], kind), (key, seg)
        assert seg["segment_type"] in ("small", "large")
        assert len(seg["segment_pool_id"]) == 2
        check_frames(seg["frames"])
        # snapshot_change() finds the device's trace by index.
        assert 0 <= seg["device"] < devices
        # annotate_snapshot() gives each block the address of the previous
        # one plus its size; segsum() asserts the sizes add up to the segment.
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == addr
            assert isinstance(b["size"], int) and b["size"] > 0
            assert b["state"] in STATES
            # _block_extra(): b['frames'], b['requested_size'].
            check_frames(b["frames"])
            assert 0 <= b["requested_size"] <= b["size"]
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"]
        active = [b for b in seg["blocks"] if b["state"] == "active_allocated"]
        assert seg["allocated_size"] == sum(b["size"] for b in active)
        assert seg["requested_size"] == sum(b["requested_size"] for b in active)
    for trace in snap["device_traces"]:
        assert isinstance(trace, list)
        for e in trace:
            # trace(): e['action'], e['addr'], e['size'], e['device_free'] for
            # oom; MemoryViz.js: t.stream, t.frames, event.device_free.
            assert e["action"] in ACTIONS, e
            assert isinstance(e["addr"], int) and isinstance(e["size"], int)
            assert isinstance(e["stream"], int)
            assert isinstance(e["time_us"], int)
            check_frames(e["frames"])
            if e["action"] == "oom":
                assert isinstance(e["device_free"], int)


def run_memory_viz(snap, tmp_path):
    """Where torch imports: its own _memory_viz functions on the snapshot."""
    viz = pytest.importorskip("torch.cuda._memory_viz")
    assert viz.segsum(snap)
    assert viz.trace(snap)
    assert viz.memory(snap, format_flamegraph=lambda lines: lines) is not None
    assert viz.segments(snap, format_flamegraph=lambda lines: lines) is not None
    html = viz.trace_plot(snap)
    assert "snapshot.pickle" in html and len(html) > 1000
    assert viz.segment_plot(snap)


@pytest.fixture
def history():
    gpuptr.record_history(True, max_entries=10_000)
    yield
    gpuptr.record_history(False)


def line_of(marker):
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if marker in text and "line_of" not in text)


def my_entries(snap, action="alloc"):
    return [
        e
        for trace in snap["device_traces"]
        for e in trace
        if e["action"] == action and any(f["filename"] == __file__ for f in e["frames"])
    ]


def test_the_snapshot_has_every_key_memory_viz_reads(history, tmp_path):
    kept = [gpuptr.alloc(1 << 20), gpuptr.alloc(3000), gpuptr.alloc(5 << 20, stream=0)]
    gone = gpuptr.alloc(4096)
    del gone
    gpuptr.reserve(64 << 10, block_size=4096)
    snap = gpuptr.snapshot()
    check_memory_viz_format(snap)
    assert snap["segments"], "the pool's allocations are its segments"
    states = {b["state"] for s in snap["segments"] for b in s["blocks"]}
    assert "active_allocated" in states and "inactive" in states, states
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert {"alloc", "free_requested", "free_completed", "segment_alloc"} <= actions
    # The file is the same dict.
    path = tmp_path / "snap.pickle"
    gpuptr.dump_snapshot(path)
    with open(path, "rb") as f:
        assert pickle.load(f).keys() == snap.keys()
    del kept


def test_memory_viz_reads_it_where_torch_imports(history, tmp_path):
    pytest.importorskip("torch")
    kept = [gpuptr.alloc(1 << 20), gpuptr.alloc(3000)]
    del kept[1]
    snap = gpuptr.snapshot()
    check_memory_viz_format(snap)
    run_memory_viz(snap, tmp_path)
    path = tmp_path / "snap.pickle"
    gpuptr.dump_snapshot(str(path))
    out = tmp_path / "snap.html"
    subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(path), "-o", str(out)],
        check=True,
        timeout=300,
    )
    assert out.stat().st_size > 1000


def test_frames_name_this_file_and_line_and_the_client(history):
    mem = gpuptr.alloc(12345)  # ALLOC-HERE
    snap = gpuptr.snapshot()
    (e,) = [e for e in my_entries(snap) if e["size"] == 12345]
    assert e["client"] == "direct"
    assert e["frames"][0] == {"filename": "gpuptr", "line": 0, "name": "client=direct"}
    assert e["frames"][1] == {
        "filename": __file__,
        "line": line_of("ALLOC-HERE"),
        "name": "test_frames_name_this_file_and_line_and_the_client",
    }
    # The live block says the same, in its segment.
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["address"] == mem.device_pointer_value]
    assert len(blocks) == 1 and blocks[0]["state"] == "active_allocated"
    assert blocks[0]["requested_size"] == 12345 and blocks[0]["client"] == "direct"
    assert blocks[0]["frames"][1]["line"] == line_of("ALLOC-HERE")
    address = mem.device_pointer_value
    mem.free()
    frees = [e for e in my_entries(gpuptr.snapshot(), "free_requested") if e["addr"] == address]
    assert frees and frees[-1]["frames"][1]["line"] == line_of("ALLOC-HERE"), "a free names its allocation"


def test_each_library_hook_labels_its_client(history):
    numba = _core._alloc_for("numba", 3001)  # the numba memory manager's path
    cupy_address = _core._cupy_malloc(3002, 0)  # CuPy's allocator hook
    _core._hooks_configure(False)
    lib = ctypes.PyDLL(_core.__file__)  # PyTorch's hook, called holding the GIL
    lib.gpuptr_torch_alloc.restype = ctypes.c_void_p
    lib.gpuptr_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.gpuptr_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    torch_address = lib.gpuptr_torch_alloc(3003, 0, None)  # TORCH-HOOK
    snap = gpuptr.snapshot()
    clients = {e["size"]: e["client"] for e in my_entries(snap)}
    assert (clients.get(3001), clients.get(3002), clients.get(3003)) == ("numba", "cupy", "torch"), clients
    (t,) = [e for e in my_entries(snap) if e["size"] == 3003]
    assert t["frames"][1]["line"] == line_of("TORCH-HOOK")
    lib.gpuptr_torch_free(torch_address, 0, 0, None)
    _core._cupy_free(cupy_address, 0)
    del numba


def test_numba_and_cupy_label_their_allocations_where_they_run():
    cupy = pytest.importorskip("cupy")
    pytest.importorskip("numba.cuda")
    if gpuptr.driver_info()["driver"] != "cuda":
        pytest.skip("numba and CuPy allocate through a CUDA driver")
    gpuptr.install(torch=False)
    gpuptr.record_history(True)
    try:
        from numba import cuda

        a = cupy.empty(1 << 20, dtype=cupy.uint8)
        b = cuda.device_array(1 << 20)
        clients = {e["client"] for e in my_entries(gpuptr.snapshot())}
        assert {"cupy", "numba"} <= clients, clients
        del a, b
    finally:
        gpuptr.record_history(False)


def test_max_entries_bounds_the_trace():
    gpuptr.record_history(True, max_entries=7)
    try:
        for _ in range(20):
            gpuptr.alloc(4096).free()
        trace = gpuptr.snapshot()["device_traces"][0]
        assert len(trace) == 7
        assert gpuptr.snapshot()["allocator_settings"]["max_entries"] == 7
        # The newest: the last free is there (the pool's growth ahead of
        # demand may add segments after it, on its own thread).
        ours = [e["action"] for e in trace if not e["action"].startswith("segment")]
        assert ours[-2:] == ["free_requested", "free_completed"], trace
    finally:
        gpuptr.record_history(False)


def test_stopping_records_no_more():
    gpuptr.record_history(True)
    assert gpuptr.recording_history()
    a = gpuptr.alloc(5555)
    gpuptr.record_history(False)
    assert not gpuptr.recording_history()
    b = gpuptr.alloc(6666)
    del a, b
    gc.collect()
    sizes = [e["size"] for e in my_entries(gpuptr.snapshot(), "alloc")]
    frees = my_entries(gpuptr.snapshot(), "free_requested")
    assert 5555 in sizes and 6666 not in sizes
    assert not [e for e in frees if e["size"] == 5555], "freed after it stopped: not recorded"


def test_dump_snapshot_takes_a_path_as_open_takes_it(history, tmp_path):
    # str, bytes (a name that is not UTF-8 too) and path-like objects of
    # either, as open() and torch's _dump_snapshot take them; bytes raised
    # TypeError.
    class BytesPath:
        def __fspath__(self):
            return os.fsencode(tmp_path / "fspath.pickle")

    kept = gpuptr.alloc(4096)
    for path in (tmp_path / "a.pickle", str(tmp_path / "b.pickle"),
                 os.fsencode(tmp_path) + b"/caf\xe9.pickle", BytesPath()):
        gpuptr.dump_snapshot(path)
        with open(path, "rb") as f:
            assert "segments" in pickle.load(f), path
    assert b"caf\xe9.pickle" in os.listdir(os.fsencode(tmp_path))
    with pytest.raises(TypeError):
        gpuptr.dump_snapshot(5)
    del kept


def test_out_of_memory_writes_the_snapshot_and_the_error_names_it(tmp_path):
    path = tmp_path / "oom.pickle"
    gpuptr.record_history(True, oom_snapshot=path)
    # Nothing cached that a 64 MiB request could take under the limit
    # (earlier tests in this process may have left such a block).
    gpuptr.flush_pool(0)
    gpuptr.trim()
    limit = gpuptr.stats()[0]["pool_bytes"] + (4 << 20)
    gpuptr.set_pool_limit(limit, device=0)
    try:
        kept = gpuptr.alloc(1 << 20)
        with pytest.raises(gpuptr.OutOfMemoryError) as err:
            gpuptr.alloc(64 << 20)  # OOM-HERE
        assert f"a memory snapshot was written to {path}" in str(err.value)
        with open(path, "rb") as f:
            snap = pickle.load(f)
        check_memory_viz_format(snap)
        (oom,) = [e for e in snap["device_traces"][0] if e["action"] == "oom"]
        assert oom["size"] == 64 << 20 and oom["device_free"] > 0
        assert any(b["address"] == kept.device_pointer_value for s in snap["segments"] for b in s["blocks"])
        # A path that cannot be written: named in the error, never raised.
        gpuptr.record_history(True, oom_snapshot=tmp_path / "missing" / "oom.pickle")
        with pytest.raises(gpuptr.OutOfMemoryError, match="could not be written"):
            gpuptr.alloc(64 << 20)
        # A bytes path, in a name that is not UTF-8, as open() takes it.
        raw = os.fsencode(tmp_path) + b"/oom-\xe9.pickle"
        gpuptr.record_history(True, oom_snapshot=raw)
        with pytest.raises(gpuptr.OutOfMemoryError, match="a memory snapshot was written"):
            gpuptr.alloc(64 << 20)
        assert os.path.getsize(raw) > 0
        gpuptr.record_history(True, oom_snapshot="")
        with pytest.raises(gpuptr.OutOfMemoryError) as err:
            gpuptr.alloc(64 << 20)
        assert "snapshot" not in str(err.value)
        # A name no file can have is refused at once (it was taken, and
        # failed only at the first out of memory), and the setting stays.
        with pytest.raises(gpuptr.InvalidArgumentError, match="NUL"):
            gpuptr.record_history(True, oom_snapshot="a\0b")
        with pytest.raises(gpuptr.OutOfMemoryError) as err:
            gpuptr.alloc(64 << 20)
        assert "snapshot" not in str(err.value)
        del kept
    finally:
        gpuptr.set_pool_limit(None)
        gpuptr.record_history(False, oom_snapshot="")


def test_the_environment_arms_the_oom_snapshot(tmp_path):
    path = tmp_path / "env-oom.pickle"
    code = (
        "import gpuptr\n"
        "gpuptr.set_pool_limit(8 << 20)\n"
        "try:\n"
        "    gpuptr.alloc(64 << 20)\n"
        "except gpuptr.OutOfMemoryError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, GPUPTR_DRIVER="sim", GPUPTR_HISTORY="1", GPUPTR_OOM_SNAPSHOT=str(path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"a memory snapshot was written to {path}" in out.stdout
    with open(path, "rb") as f:
        snap = pickle.load(f)
    check_memory_viz_format(snap)
    assert [e["action"] for e in snap["device_traces"][0]][-1] == "oom"


def test_dump_snapshot_keeps_a_replaced_files_permission_bits(tmp_path):
    # The new file renamed over the old one took the umask's mode (a 0o640
    # file became 0o644, readable by anyone); a set-user-ID bit is not kept
    # (the new file is the caller's).
    path = tmp_path / "snap.pickle"
    for mode, kept in [(0o640, 0o640), (0o4750, 0o750)]:
        path.write_bytes(b"old")
        path.chmod(mode)
        gpuptr.dump_snapshot(path)
        assert stat.S_IMODE(path.stat().st_mode) == kept
        assert pickle.loads(path.read_bytes())["segments"] is not None


READ_ONLY = """
import os, sys, gpuptr
path = sys.argv[1]
try:
    gpuptr.dump_snapshot(path)
    print("written")
except PermissionError:
    print("PermissionError")
print(open(path, "rb").read().decode(), oct(os.stat(path).st_mode & 0o777))
"""


def test_dump_snapshot_refuses_a_file_its_caller_may_not_write():
    # As open(path, "wb"): a read-only file is refused, and left as it was
    # (it was replaced). Root may write any file, so as root the child runs
    # without that capability (util-linux's setpriv).
    d = tempfile.mkdtemp(prefix="gpuptr-snap-")
    try:
        path = os.path.join(d, "ro.pickle")
        with open(path, "w") as f:
            f.write("precious")
        os.chmod(path, 0o444)
        env = dict(os.environ, GPUPTR_DRIVER="sim")
        drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
        out = subprocess.run([*drop, sys.executable, "-c", READ_ONLY, path], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["PermissionError", "precious", "0o444"]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_dump_snapshot_raises_a_typed_error_for_a_path_it_cannot_write(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        gpuptr.dump_snapshot(tmp_path / "missing" / "snap.pickle")
    assert err.value.filename == str(tmp_path / "missing" / "snap.pickle")
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(PermissionError):
            gpuptr.dump_snapshot(locked / "snap.pickle")
    with pytest.raises(IsADirectoryError):
        gpuptr.dump_snapshot(tmp_path)
    # Paths that name no file, as open() finds them (they were an
    # InvalidArgumentError).
    for nothing in ("", str(tmp_path / "missing" / "..")):
        with pytest.raises(FileNotFoundError):
            gpuptr.dump_snapshot(nothing)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")], "no half-written file left"


def test_dump_snapshot_never_writes_through_a_file_planted_at_its_temporary_name(tmp_path):
    # The temporary name beside the target is predictable (the pid and a
    # counter): in a shared directory someone else may put a symlink there
    # first. The dump must not follow it and clobber what it points at.
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    code = f"""
import os, pathlib, pickle, gpuptr
d = pathlib.Path({str(tmp_path)!r})
for n in range(4):
    os.symlink(d / "victim", d / f".snap.pickle.{{os.getpid()}}.{{n}}.tmp")
gpuptr.dump_snapshot(d / "snap.pickle")
with open(d / "snap.pickle", "rb") as f:
    assert "segments" in pickle.load(f)
print("dumped")
"""
    env = dict(os.environ, GPUPTR_DRIVER="sim")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert victim.read_bytes() == b"precious", "the dump wrote through a planted symlink"
    assert not (tmp_path / "snap.pickle").is_symlink()


def test_dump_snapshot_writes_into_a_fifo_and_through_a_symlink_replacing_neither(tmp_path):
    # As torch's open(path, "wb") does: a FIFO (or /dev/null) gets the bytes
    # and stays what it is, and a symlink's file is the one replaced.
    import stat
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = {}

    def reader():
        with open(fifo, "rb") as f:
            got["data"] = f.read()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    gpuptr.dump_snapshot(fifo)
    t.join(30)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced by a regular file"
    assert "segments" in pickle.loads(got.get("data", b"")), "the reader got no snapshot"
    real = tmp_path / "runs" / "real.pickle"
    real.parent.mkdir()
    real.write_bytes(b"old")
    link = tmp_path / "latest.pickle"
    link.symlink_to(real)
    gpuptr.dump_snapshot(link)
    assert link.is_symlink(), "the symlink was replaced"
    assert "segments" in pickle.loads(real.read_bytes())
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_dump_snapshot_onto_a_dangling_symlink_creates_its_target_and_keeps_the_link(tmp_path):
    # open(link, "wb") creates the file the link names; so does the dump.
    (tmp_path / "runs").mkdir()
    link = tmp_path / "latest.pickle"
    link.symlink_to("runs/new.pickle")  # relative, target not there yet
    gpuptr.dump_snapshot(link)
    assert link.is_symlink(), "the symlink was replaced by a regular file"
    assert "segments" in pickle.loads((tmp_path / "runs" / "new.pickle").read_bytes())
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_dump_snapshot_onto_a_directory_or_a_symlink_to_one_raises_is_a_directory(tmp_path):
    d = tmp_path / "adir"
    d.mkdir()
    link = tmp_path / "dirlink"
    link.symlink_to(d)
    for p in (d, link):
        with pytest.raises(IsADirectoryError):
            gpuptr.dump_snapshot(p)
    assert link.is_symlink() and d.is_dir() and not list(d.iterdir())
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_dump_snapshot_takes_the_longest_file_name_open_takes(tmp_path):
    name = "s" * 243 + ".pickle"  # 250 bytes
    with open(tmp_path / name, "wb"):
        pass
    gpuptr.dump_snapshot(tmp_path / name)
    assert "segments" in pickle.loads((tmp_path / name).read_bytes())
    assert not [p for p in tmp_path.iterdir() if p.name != name]
