"""IPC safety on the simulator (a review of handles and their liveness,
and what an adversarial pass over the same surface found): no handle, however it was made or
altered, no file in /dev/shm, and no exit makes gpuptr open memory that is
not the handle's, block, or leave state behind.

The importer here is often this process with a handle whose process token
was changed: it takes the other-process path (the liveness file, then the
driver), and the simulator maps its own memory, so what a handle opens to
can be checked byte for byte. A real second process has its own simulator
(it cannot map the parent's memory: a live handle gets ``InvalidArgumentError`` there, saying so,
past the liveness check). Cases that blocked or crashed run in subprocesses
with timeouts.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap

import pytest

import gpuptr

pytestmark = pytest.mark.sim

NO_SLOT = 2**32 - 1
SLOTS = 1 << 16
RECORD = 32
FILE_LEN = SLOTS * RECORD


def run_isolated(code: str, timeout: int = 120, memory: int = 256 << 20) -> subprocess.CompletedProcess:
    env = dict(os.environ, GPUPTR_DRIVER="sim", GPUPTR_SIM_DEVICES="1", GPUPTR_SIM_MEMORY=str(memory))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def fields(h: gpuptr.IpcHandle) -> dict:
    raw = h.to_bytes()
    u32 = lambda i: int.from_bytes(raw[i:i + 4], "little")  # noqa: E731
    u64 = lambda i: int.from_bytes(raw[i:i + 8], "little")  # noqa: E731
    return dict(device=u32(8), pid=u32(12), process=u64(16), export=u64(24), offset=u64(32),
                size=u64(40), slot=u32(48), handle=raw[52:116])


def craft(h: gpuptr.IpcHandle, **changes) -> gpuptr.IpcHandle:
    raw = bytearray(h.to_bytes())
    at = {"pid": (12, 4), "process": (16, 8), "export": (24, 8), "offset": (32, 8), "size": (40, 8), "slot": (48, 4)}
    for k, v in changes.items():
        i, n = at[k]
        raw[i:i + n] = v.to_bytes(n, "little")
    return gpuptr.IpcHandle.from_bytes(bytes(raw))


def liveness_path(h: gpuptr.IpcHandle) -> str:
    f = fields(h)
    return f"/dev/shm/gpuptr-ipc-{f['pid']}-{f['process']:016x}"


def new_token() -> int:
    return random.getrandbits(64) | 1


def open_in_child(*handles: gpuptr.IpcHandle, timeout: int = 60) -> list[str]:
    """What each handle opens to in a fresh process: 'opened' or the error's class name."""
    code = """
        import pickle, sys
        import gpuptr
        for h in pickle.loads(sys.stdin.buffer.read()):
            try:
                h.open()
                print("opened")
            except gpuptr.GpuptrError as e:
                print(type(e).__name__, str(e).replace(chr(10), " "))
    """
    env = dict(os.environ, GPUPTR_DRIVER="sim", GPUPTR_SIM_DEVICES="1")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], input=pickle.dumps(list(handles)),
                       capture_output=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr.decode()
    return p.stdout.decode().splitlines()


class Planted:
    """A liveness file made by hand at a crafted token's path: records as
    gpuptr writes them, locked by this process (as a live exporter's is)."""

    def __init__(self, path: str, records: dict[int, tuple[int, int, int]], mode: int = 0o644,
                 lock: bool = True, size: int = FILE_LEN):
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        for slot, (number, start, length) in records.items():
            rec = number.to_bytes(8, "little") + start.to_bytes(8, "little") + length.to_bytes(8, "little")
            os.pwrite(fd, rec, slot * RECORD)
        os.fchmod(fd, mode)
        if lock:
            fcntl.flock(fd, fcntl.LOCK_EX)
        self.fd = fd

    def close(self):
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@pytest.fixture
def planted():
    made: list = []

    def plant(path, *args, **kw):
        p = Planted(path, *args, **kw)
        made.append(p)
        return p

    yield plant
    for p in made:
        p.close()


@pytest.fixture
def paths():
    """Paths a test makes in /dev/shm, removed after it."""
    made: list[str] = []
    yield made
    for p in made:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


# 1. A handle is trusted for its size ------------------------------------------

def test_a_handle_larger_than_its_driver_allocation_does_not_open(planted):
    mem = gpuptr.alloc(4096)
    h = mem.ipc_handle()
    f = fields(h)
    # Another process's handle whose liveness record (planted, as an
    # altered file could say) spans far past the driver's allocation: the
    # driver's range still bounds it.
    token = new_token()
    planted(liveness_path(craft(h, process=token)), {0: (f["export"], 0, 1 << 62)})
    for offset, size in [(f["offset"], 1 << 40), (1 << 61, 16), (f["offset"] + (1 << 40), 0)]:
        bad = craft(h, process=token, slot=0, offset=offset, size=size)
        with pytest.raises(gpuptr.InvalidPointerError, match="outside"):
            bad.open()
    ok = craft(h, process=token, slot=0)
    assert ok.open().device_pointer_value == mem.device_pointer_value


def test_a_handle_without_its_liveness_record_does_not_open():
    # Every handle gpuptr makes has a record, which bounds it to its
    # allocation; without one (a slot cleared by hand), a pool block's
    # handle moved to the next block would have opened there, as the
    # driver's range is the whole segment.
    mine, theirs = gpuptr.alloc(4096), gpuptr.alloc(4096)
    theirs.memset(0xBB)
    h, other = fields(mine.ipc_handle()), fields(theirs.ipc_handle())
    assert h["handle"] == other["handle"], "one segment"
    for offset, size in [(other["offset"], 4096), (h["offset"], 4096), (0, 8192)]:
        bad = craft(mine.ipc_handle(), process=new_token(), slot=NO_SLOT, offset=offset, size=size)
        with pytest.raises(gpuptr.InvalidPointerError, match="no liveness record"):
            bad.open()
    assert open_in_child(craft(mine.ipc_handle(), slot=NO_SLOT))[0].startswith("InvalidPointerError")


def test_a_handle_reaching_past_its_exported_block_fails_in_another_process():
    block = gpuptr.alloc(4096)  # a pool block inside a larger driver allocation
    h = block.ipc_handle()
    f = fields(h)
    wider = craft(h, size=8192)
    before = craft(h, offset=f["offset"] - 4096) if f["offset"] >= 4096 else craft(h, size=4097)
    out = open_in_child(h, wider, before)
    assert out[0].startswith("InvalidArgumentError"), out  # live: past the record, to the driver
    assert out[1].startswith("InvalidPointerError") and "outside" in out[1], out
    assert out[2].startswith("InvalidPointerError") and "outside" in out[2], out


def test_a_handle_opened_in_its_exporter_stays_inside_the_exported_memory():
    mem = gpuptr.alloc(4096)
    h = mem.view(100, 200).ipc_handle()
    f = fields(h)
    start = f["offset"] - 100  # the allocation's offset in its driver allocation
    assert craft(h, size=1000).open().size == 1000
    assert craft(h, offset=start + 4096, size=0).open().size == 0
    cases = [(f["offset"], 5000), (start + 4096, 1), (1 << 62, 1)] + ([(start - 1, 16)] if start else [])
    for offset, size in cases:
        with pytest.raises(gpuptr.InvalidPointerError, match="outside"):
            craft(h, offset=offset, size=size).open()


# 2, 3. Re-exports of one live buffer: one slot, constant cost -----------------

def test_reexports_of_a_live_buffer_never_run_out_of_slots():
    mem = gpuptr.alloc(4096)
    first = mem.ipc_handle()
    for _ in range(SLOTS + 100):
        last = mem.ipc_handle()
    assert fields(last)["slot"] == fields(first)["slot"] != NO_SLOT
    mem.free()
    out = open_in_child(first, last)
    assert all(o.startswith("InvalidPointerError") and "freed" in o for o in out), out


def test_the_cost_of_an_export_is_constant():
    # In a fresh process: the first batch is the first exports it makes.
    out = run_isolated("""
        import time
        import gpuptr
        mem = gpuptr.alloc(4096)

        def batch():
            t = time.perf_counter()
            for _ in range(2000):
                mem.ipc_handle()
            return time.perf_counter() - t

        first = min(batch() for _ in range(3))
        for _ in range(30):
            batch()
        later = min(batch() for _ in range(3))
        print(first, later)
    """)
    assert out.returncode == 0, out.stderr
    first, later = map(float, out.stdout.split())
    assert later < 3 * first + 0.01, f"2000 exports: {first:.4f} s at first, {later:.4f} s after 66,000"


def test_pool_memory_past_the_last_slot_is_refused_never_shared_unchecked():
    out = run_isolated(f"""
        import gpuptr
        live = [gpuptr.alloc(512) for _ in range({SLOTS})]
        for m in live:
            m.ipc_handle()
        extra = gpuptr.alloc(512)
        try:
            extra.ipc_handle()
            print("exported")
        except gpuptr.InvalidArgumentError as e:
            print("refused", "liveness" in str(e))
        live.pop().free()
        h = extra.ipc_handle()
        print("then", h.size)
    """, memory=1 << 30, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["refused True", "then 512"], out.stdout


# 4. An empty view at an allocation's end ---------------------------------------

def test_an_empty_view_exports_its_own_allocation_and_opens_to_nothing(planted):
    mem = gpuptr.alloc(4096)
    nxt = gpuptr.alloc(4096)
    whole = fields(mem.ipc_handle())
    for start in (4096, 9000):
        h = mem.view(start, start).ipc_handle()
        f = fields(h)
        assert f["handle"] == whole["handle"] and f["size"] == 0
        assert f["offset"] == whole["offset"] + 4096
        assert h.open().size == 0
        token = new_token()
        planted(liveness_path(craft(h, process=token)), {0: (whole["export"], whole["offset"], 4096)})
        assert craft(h, process=token, slot=0).open().size == 0
    del nxt


# 5. The liveness file: never followed, never blocking ----------------------------

def test_a_fifo_at_the_liveness_path_fails_at_once(paths):
    token = new_token()
    code = f"""
        import os
        import gpuptr
        mem = gpuptr.alloc(4096)
        raw = bytearray(mem.ipc_handle().to_bytes())
        raw[16:24] = ({token}).to_bytes(8, "little")
        raw[48:52] = (0).to_bytes(4, "little")
        h = gpuptr.IpcHandle.from_bytes(bytes(raw))
        path = f"/dev/shm/gpuptr-ipc-{{os.getpid()}}-{token:016x}"
        os.mkfifo(path, 0o644)
        print(path, flush=True)
        try:
            h.open()
            print("opened")
        except gpuptr.GpuptrError as e:
            print(type(e).__name__)
    """
    env = dict(os.environ, GPUPTR_DRIVER="sim", GPUPTR_SIM_DEVICES="1")
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        paths.append(p.stdout.readline().strip())
        p.wait(timeout=60)  # blocked forever before
        out = p.stdout.read()
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 0
    assert out.split() == ["InvalidPointerError"]


def test_only_a_regular_liveness_file_its_owner_alone_writes_is_read(planted, paths):
    mem = gpuptr.alloc(4096)
    h = mem.ipc_handle()
    f = fields(h)
    record = {0: (f["export"], f["offset"], 4096)}

    def handle_at(token):
        return craft(h, process=token, slot=0)

    # The control: a file as gpuptr writes it opens (the simulator maps).
    good = handle_at(new_token())
    planted(liveness_path(good), record)
    assert good.open().device_pointer_value == mem.device_pointer_value
    # A symlink to it, a group-writable file, a file of the wrong size, a
    # directory, and a file no process locks (its exporter is gone).
    link = handle_at(new_token())
    os.symlink(liveness_path(good), liveness_path(link))
    paths.append(liveness_path(link))
    writable = handle_at(new_token())
    planted(liveness_path(writable), record, mode=0o666)
    short = handle_at(new_token())
    planted(liveness_path(short), record, size=8 * SLOTS)
    directory = handle_at(new_token())
    os.mkdir(liveness_path(directory))
    unlocked = handle_at(new_token())
    planted(liveness_path(unlocked), record, lock=False)
    try:
        for bad, why in [(link, "unusable"), (writable, "writable"), (short, "bytes"),
                         (directory, "unusable"), (unlocked, "exited")]:
            with pytest.raises(gpuptr.InvalidPointerError, match=why):
                bad.open()
    finally:
        os.rmdir(liveness_path(directory))


def test_a_slot_past_the_file_or_a_cleared_record_does_not_open(planted):
    mem = gpuptr.alloc(4096)
    h = mem.ipc_handle()
    f = fields(h)
    token = new_token()
    planted(liveness_path(craft(h, process=token)), {3: (f["export"], f["offset"], 4096), 4: (0, 0, 0)})
    assert craft(h, process=token, slot=3).open().size == 4096
    for slot, why in [(4, "freed"), (SLOTS, "unusable"), (NO_SLOT - 1, "unusable")]:
        with pytest.raises(gpuptr.InvalidPointerError, match=why):
            craft(h, process=token, slot=slot).open()


# 6. Liveness files outliving their process ---------------------------------------

EXPORTER = """
    import os, resource, signal, sys, time
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    import gpuptr
    mem = gpuptr.alloc(4096)
    sys.stdout.buffer.write(mem.ipc_handle().to_bytes())
    sys.stdout.flush()
    how = sys.argv[1]
    if how == "os._exit":
        os._exit(0)
    if how == "SIGKILL":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "SIGTERM":
        os.kill(os.getpid(), signal.SIGTERM)
    if how == "abort":
        os.abort()
    if how == "fork":
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 1)
            os.dup2(null, 2)
            time.sleep(60)
            os._exit(0)
        os._exit(0)
"""


def export_and_end(how: str) -> gpuptr.IpcHandle:
    env = dict(os.environ, GPUPTR_DRIVER="sim", GPUPTR_SIM_DEVICES="1")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(EXPORTER), how], capture_output=True,
                       timeout=60, env=env, start_new_session=True)
    return gpuptr.IpcHandle.from_bytes(p.stdout)


@pytest.mark.parametrize("how", ["exit", "os._exit", "SIGKILL", "SIGTERM", "abort", "fork"])
def test_liveness_files_of_gone_exporters_are_swept(how):
    mine = gpuptr.alloc(4096)
    my_handle = mine.ipc_handle()
    h = export_and_end(how)
    path = liveness_path(h)
    try:
        if how == "exit":
            assert not os.path.exists(path), "removed at a normal exit"
        # Its exporter is gone (a child it forked holds nothing).
        with pytest.raises(gpuptr.InvalidPointerError, match="exited"):
            h.open()
        # The next process's first export sweeps it, and leaves a live one.
        out = run_isolated("import gpuptr; gpuptr.alloc(4096).ipc_handle()")
        assert out.returncode == 0, out.stderr
        assert not os.path.exists(path), f"{path} outlived its exporter ({how})"
        assert os.path.exists(liveness_path(my_handle))
        assert open_in_child(my_handle)[0].startswith("InvalidArgumentError"), "still live"
    finally:
        if how == "fork":
            # The forked child sleeps in the exporter's session.
            pid = fields(h)["pid"]
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if os.path.exists(path):
            os.unlink(path)


def test_a_sweep_leaves_files_it_cannot_vouch_for(planted, paths):
    """Another version's file (another size), an empty file (one being made),
    and a FIFO are not swept; nor is anything not named gpuptr-ipc-*."""
    token = new_token()
    old = f"/dev/shm/gpuptr-ipc-{os.getpid()}-{token:016x}"
    planted(old, {}, lock=False, size=8 * SLOTS)
    empty = f"/dev/shm/gpuptr-ipc-{os.getpid()}-{new_token():016x}"
    planted(empty, {}, lock=False, size=0)
    fifo = f"/dev/shm/gpuptr-ipc-{os.getpid()}-{new_token():016x}"
    os.mkfifo(fifo, 0o644)
    paths.append(fifo)
    out = run_isolated("import gpuptr; gpuptr.alloc(4096).ipc_handle()", timeout=60)
    assert out.returncode == 0, out.stderr
    assert os.path.exists(old) and os.path.exists(empty) and os.path.exists(fifo)


# 7. The file's mode ---------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_the_liveness_file_mode_ignores_the_umask(umask):
    out = run_isolated(f"""
        import os, stat
        os.umask({umask:#o})
        import gpuptr
        raw = gpuptr.alloc(4096).ipc_handle().to_bytes()
        pid = int.from_bytes(raw[12:16], "little")
        token = int.from_bytes(raw[16:24], "little")
        st = os.lstat(f"/dev/shm/gpuptr-ipc-{{pid}}-{{token:016x}}")
        print(oct(stat.S_IMODE(st.st_mode)), stat.S_ISREG(st.st_mode), st.st_uid == os.geteuid())
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0o644", "True", "True"]


# Adversarial pass ------------------------------------------------------------------

def test_a_forked_child_never_clears_its_parents_liveness_record():
    """A release that runs in a forked child (a DLPack capsule dropped there)
    writes nothing to the parent's liveness file."""
    code = """
        import gc, os, sys
        import gpuptr
        mem = gpuptr.alloc(4096)
        h = mem.ipc_handle()
        capsule = mem.__dlpack__()
        mem.free()  # the release waits for the capsule
        pid = os.fork()
        if pid == 0:
            try:
                del capsule
                gc.collect()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), h.to_bytes().hex(), flush=True)
        sys.stdin.readline()
        del capsule
        gc.collect()
        print("released", flush=True)
        sys.stdin.readline()
    """
    env = dict(os.environ, GPUPTR_DRIVER="sim", GPUPTR_SIM_DEVICES="1")
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        rc, raw = p.stdout.readline().split()
        assert rc == "0"
        h = gpuptr.IpcHandle.from_bytes(bytes.fromhex(raw))
        assert open_in_child(h)[0].startswith("InvalidArgumentError"), "the parent's memory is still live"
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "released"
        assert open_in_child(h)[0].startswith("InvalidPointerError"), "released in the parent"
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(60) == 0
    finally:
        p.kill()
        p.wait()


def test_a_stale_handle_of_a_reused_block_does_not_open_elsewhere():
    # Neighbours kept live make the freed block a hole of its own size, which
    # best fit hands out before it splits a larger free block.
    left, mem, right = (gpuptr.alloc(4096) for _ in range(3))
    old = mem.ipc_handle()
    address = mem.device_pointer_value
    mem.free()
    gpuptr.flush_pool()
    # Holes of that size other tests left may come first.
    again = [gpuptr.alloc(4096)]
    while again[-1].device_pointer_value != address and len(again) < 1024:
        again.append(gpuptr.alloc(4096))
    reused = again[-1]
    assert reused.device_pointer_value == address, "the freed block is handed out again"
    new = reused.ipc_handle()
    assert fields(new)["export"] != fields(old)["export"]
    out = open_in_child(old, new)
    assert out[0].startswith("InvalidPointerError") and "freed" in out[0], out
    assert out[1].startswith("InvalidArgumentError"), out
    with pytest.raises(gpuptr.InvalidPointerError, match="freed"):
        old.open()
    assert new.open().device_pointer_value == address


def test_a_handle_of_another_process_with_this_processes_pid_is_not_this_processes(planted):
    """Only the random token says 'this process': a handle with this pid and
    another token goes through the liveness file."""
    mem = gpuptr.alloc(4096)
    h = craft(mem.ipc_handle(), process=new_token())
    with pytest.raises(gpuptr.InvalidPointerError, match="exited"):
        h.open()


def test_a_handle_of_another_version_is_refused_by_its_bytes():
    raw = bytearray(gpuptr.alloc(4096).ipc_handle().to_bytes())
    assert raw[:8] == b"gpuptrI3"
    for magic in (b"gpuptrI2", b"gpuptrI1"):
        raw[:8] = magic
        with pytest.raises(gpuptr.InvalidArgumentError):
            gpuptr.IpcHandle.from_bytes(bytes(raw))
