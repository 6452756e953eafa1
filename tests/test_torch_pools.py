"""PyTorch's pools, tensor sharing and graph trees on gpuptr, without a GPU:
PyTorch's C entry points are called through ctypes (as its pluggable
allocator calls them), and ``torch`` is a small stand-in namespace that
records what gpuptr calls. The real library runs in
gpu/test_torch_pools_gpu.py."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

import gpuptr
from helpers import torch_hooks
from gpuptr import _core, _torch_ipc, _torch_pool, _torch_trees

t_alloc, t_free = torch_hooks()

MIB = 1 << 20


def torch_live_bytes():
    gc.collect()
    return gpuptr.stats()[0]["clients"]["torch"]["live_bytes"]


def test_allocations_in_a_pool_block_are_tagged_and_forgotten_when_freed():
    pool = (0, 9001)
    assert _core._torch_pool_live(0, pool) == []
    outside = t_alloc(MIB, 0, None)
    _core._torch_pool_begin(0, pool, False)
    try:
        inside = t_alloc(2 * MIB, 0, None)
        other_device = _core._torch_pool_live(1, pool)
        box = []
        th = threading.Thread(target=lambda: box.append(t_alloc(MIB, 0, None)))
        th.start()
        th.join()
    finally:
        assert _core._torch_pool_end(0, pool)
    after = t_alloc(MIB, 0, None)
    assert _core._torch_pool_live(0, pool) == [(inside, 2 * MIB)], "only this thread's, in the block"
    assert other_device == []
    c = _core._torch_pool_counts(0, pool)
    assert (c["live"], c["live_bytes"], c["allocations"]) == (1, 2 * MIB, 1)
    t_free(inside, 0, 0, None)
    assert _core._torch_pool_live(0, pool) == []
    c = _core._torch_pool_counts(0, pool)
    assert (c["live"], c["frees"], c["freed_bytes"], c["peak_bytes"]) == (0, 1, 2 * MIB, 2 * MIB)
    for p in (outside, after, box[0]):
        t_free(p, 0, 0, None)
    assert not _core._torch_pool_end(0, pool), "nothing left to end"


def test_a_pool_begun_for_all_threads_tags_every_threads_allocations():
    pool = (0, 9002)
    _core._torch_pool_begin(0, pool, True)
    box = []
    th = threading.Thread(target=lambda: box.append(t_alloc(MIB, 0, None)))
    th.start()
    th.join()
    assert _core._torch_pool_end(0, pool)
    assert _core._torch_pool_live(0, pool) == [(box[0], MIB)]
    t_free(box[0], 0, 0, None)
    assert _core._torch_pool_live(0, pool) == []


def fake_torch():
    """The parts of torch that gpuptr's pool code touches, recording calls."""
    calls = []

    def rec(name):
        return lambda *a, **k: calls.append((name, a))

    C = types.SimpleNamespace(
        _cuda_beginAllocateCurrentThreadToPool=rec("begin"),
        _cuda_beginAllocateToPool=rec("begin_all"),
        _cuda_endAllocateToPool=rec("end"),
        _cuda_releasePool=rec("release"),
    )
    memory = types.SimpleNamespace(**vars(C))

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        # torch.cuda.memory.use_mem_pool, which calls its module's names.
        memory._cuda_beginAllocateCurrentThreadToPool(0, pool.id)
        try:
            yield
        finally:
            memory._cuda_endAllocateToPool(0, pool.id)
            memory._cuda_releasePool(0, pool.id)

    class CUDAGraph:
        def capture_begin(self, pool=None, capture_error_mode="global"):
            calls.append(("capture_begin", (pool,)))

        def capture_end(self):
            calls.append(("capture_end", ()))

    cuda = types.SimpleNamespace(
        memory=memory, MemPool=object, current_device=lambda: 0, CUDAGraph=CUDAGraph
    )
    memory.use_mem_pool = use_mem_pool
    return types.SimpleNamespace(_C=C, cuda=cuda), calls


def test_mem_pool_under_install_is_a_tag_with_torchs_id_use_count_and_snapshot():
    torch, calls = fake_torch()
    own = object()
    _torch_pool.install_pools(torch, own)
    _torch_pool.install_pools(torch, own)  # idempotent: wrapped once
    assert torch.cuda.MemPool is _torch_pool.MemPool is torch.cuda.memory.MemPool
    pool = torch.cuda.MemPool()
    assert isinstance(pool.id, tuple) and pool.id[0] == 0 and pool.id[1] > 0
    assert torch.cuda.MemPool().id != pool.id
    assert torch.cuda.MemPool(allocator=own).allocator is own
    with pytest.raises(ValueError, match="another allocator"):
        torch.cuda.MemPool(allocator=object())
    assert pool.use_count() == 1
    with torch.cuda.memory.use_mem_pool(pool):
        assert pool.use_count() == 2
        a = t_alloc(MIB, 0, None)
    b = t_alloc(MIB, 0, None)
    assert pool.use_count() == 1
    assert [c[0] for c in calls] == ["begin", "end", "release"], "torch's own calls still made"
    segs = pool.snapshot()
    assert [s["address"] for s in segs] == [a]
    s = segs[0]
    assert s["segment_pool_id"] == pool.id and s["total_size"] == MIB and s["device"] == 0
    assert s["blocks"] == [
        {"address": a, "size": MIB, "requested_size": MIB, "state": "active_allocated", "frames": []}
    ]
    t_free(a, 0, 0, None)
    assert pool.snapshot() == []
    t_free(b, 0, 0, None)


def test_a_capture_into_a_pool_tags_what_it_allocates():
    torch, calls = fake_torch()
    _torch_pool.install_pools(torch)
    pool = _torch_pool.MemPool()
    g = torch.cuda.CUDAGraph()
    g.capture_begin(pool.id)
    assert pool.use_count() == 2
    a = t_alloc(MIB, 0, None)
    g.capture_end()
    b = t_alloc(MIB, 0, None)
    assert _torch_pool.live_in_pool(0, pool.id) == [a]
    assert pool.use_count() == 1
    g2 = torch.cuda.CUDAGraph()
    g2.capture_begin()  # no pool named: nothing tagged
    c = t_alloc(MIB, 0, None)
    g2.capture_end()
    assert _torch_pool.live_in_pool(0, pool.id) == [a]
    for p in (a, b, c):
        t_free(p, 0, 0, None)


def test_lending_a_torch_allocation_keeps_it_until_the_loan_goes():
    before = torch_live_bytes()
    p = t_alloc(MIB, 0, None)
    assert _core._torch_is_live(p)
    handle, loan = _core._torch_lend(p)
    h = gpuptr.IpcHandle.from_bytes(handle)
    assert h.size == MIB and h.pid == os.getpid()
    t_free(p, 0, 0, None)  # PyTorch lets go: the loan keeps it
    assert not _core._torch_is_live(p)
    assert torch_live_bytes() == before + MIB
    assert h.open().device_pointer_value == p, "still the memory, in the exporting process"
    del loan
    assert torch_live_bytes() == before
    with pytest.raises(gpuptr.InvalidPointerError):
        h.open()
    with pytest.raises(gpuptr.InvalidPointerError, match="not the start"):
        _core._torch_lend(p)
    q = t_alloc(2 * MIB, 0, None)
    with pytest.raises(gpuptr.InvalidPointerError):
        _core._torch_lend(q + 4096)  # inside, not the start
    t_free(q, 0, 0, None)


class Loan:
    """Stands for a TorchLoan: says when it is dropped."""

    def __init__(self, dropped):
        self.dropped = dropped

    def __del__(self):
        self.dropped.set()


_RECEIVER = textwrap.dedent(
    r"""
    import sys, time
    from gpuptr import _torch_ipc
    path, slot, gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    r = _torch_ipc.Receipt(path, slot, gen)
    r2 = _torch_ipc.Receipt(path, slot, gen)   # two tensors over one message here
    print("held", flush=True)
    sys.stdin.readline()
    r.release()
    print("one left", flush=True)
    sys.stdin.readline()
    if sys.argv[4] == "release":
        r2.release()
        print("released", flush=True)
        sys.stdin.readline()
    """
)


def _receiver(share, how):
    path, slot, gen = share
    return subprocess.Popen(
        [sys.executable, "-c", _RECEIVER, path, str(slot), str(gen), how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _say(p, expect):
    assert p.stdout.readline().strip() == expect


@pytest.mark.parametrize("how", ["release", "exit"])
def test_a_sent_loan_is_kept_until_the_receiver_lets_go(tmp_path, how):
    ex = _torch_ipc.Exporter(str(tmp_path))
    dropped = threading.Event()
    share = ex.share(Loan(dropped))
    assert ex.sweep() == 0 and ex.pending() == 1, "not received yet: kept"
    p = _receiver(share, how)
    try:
        _say(p, "held")
        assert ex.sweep() == 0 and not dropped.is_set(), "held by the receiver"
        p.stdin.write("\n")
        p.stdin.flush()
        _say(p, "one left")
        assert ex.sweep() == 0 and not dropped.is_set(), "its second tensor still holds it"
        p.stdin.write("\n")
        p.stdin.flush()
        if how == "release":
            _say(p, "released")
        else:
            p.wait(30)  # the process ends: the kernel drops its lock
        assert dropped.wait(5) or ex.sweep() == 1
        assert dropped.wait(5) and ex.pending() == 0
    finally:
        p.kill()
        p.wait()
    # A late rebuild of the same message: released, never the memory.
    with pytest.raises(gpuptr.InvalidPointerError, match="released"):
        _torch_ipc.Receipt(*share)
    # The slot serves the next share, under a new generation.
    share2 = ex.share(Loan(threading.Event()))
    assert share2[1] == share[1] and share2[2] > share[2]
    ex.close()
    with pytest.raises(gpuptr.InvalidPointerError, match="gone"):
        _torch_ipc.Receipt(*share2)


def test_the_helper_thread_gives_a_loan_back_without_a_call(tmp_path):
    ex = _torch_ipc.Exporter(str(tmp_path))
    dropped = threading.Event()
    share = ex.share(Loan(dropped))
    r = _torch_ipc.Receipt(*share)  # in this process: the lock is its own
    r.release()
    assert dropped.wait(5), "swept within SWEEP_S"
    ex.close()


def fake_trees_torch(standard=()):
    freed = []
    C = types.SimpleNamespace(
        _cuda_getCheckpointState=lambda d, p: (_ for _ in ()).throw(RuntimeError("unsupported")),
        _free_And_Remove_DeleterFn=freed.append,
        _has_Standard_Deleter=lambda s: s in standard,
        _cuda_checkPoolLiveAllocations=lambda *a: (_ for _ in ()).throw(RuntimeError("unsupported")),
    )
    return types.SimpleNamespace(_C=C), freed


def test_graph_trees_calls_are_answered_from_gpuptrs_graph_memory(monkeypatch):
    torch, freed = fake_trees_torch(standard=(11,))

    class Manager:
        def apply_checkpoint_execution_state_in_allocator(self):
            raise AssertionError("PyTorch's restores an allocator state gpuptr does not have")

    trees = types.ModuleType("torch._inductor.cudagraph_trees")
    trees.CUDAGraphTreeManager = Manager
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", trees)
    assert _torch_trees.patch_trees(torch)
    assert _torch_trees.patch_trees(torch), "idempotent"
    state = torch._C._cuda_getCheckpointState(0, (3, 0))
    assert isinstance(state, _torch_trees.Checkpoint) and state.pool == (3, 0)
    torch._C._free_And_Remove_DeleterFn(11)
    torch._C._free_And_Remove_DeleterFn(12)  # rebuilt over its graph's memory: left alone
    assert freed == [11]

    m = Manager()
    removed = []
    m.current_node = types.SimpleNamespace(
        checkpointed_caching_state=state, remove_path_cached_tensors=lambda: removed.append(1)
    )
    m.debug_checkpointing_counter = 0
    m.apply_checkpoint_execution_state_in_allocator()
    assert (m.debug_checkpointing_counter, removed) == (1, [1])

    pool = (0, 9003)
    _core._torch_pool_begin(0, pool, False)
    a = t_alloc(MIB, 0, None)
    _core._torch_pool_end(0, pool)
    check = torch._C._cuda_checkPoolLiveAllocations
    assert check(0, pool, {a}) and check(0, pool, {a, 123})
    assert not check(0, pool, set()), "a live allocation of the pool the tree does not know"
    t_free(a, 0, 0, None)
    assert check(0, pool, set())


def test_graph_trees_are_not_patched_where_torch_lacks_an_entry_point():
    torch, _ = fake_trees_torch()
    del torch._C._has_Standard_Deleter
    original = torch._C._cuda_getCheckpointState
    assert not _torch_trees.patch_trees(torch)
    assert torch._C._cuda_getCheckpointState is original


def test_a_received_tensors_end_lets_go_after_the_device_is_done(tmp_path):
    """The receiver's holder (what ``torch.as_tensor`` keeps over its
    ``__cuda_array_interface__``) lets go once dropped, with a plain Python
    decref, on the helper thread after the device synchronize; on the
    device, the DLPack route left the lock held until gpuptr's next call."""
    ex = _torch_ipc.Exporter(str(tmp_path))
    dropped = threading.Event()
    share = ex.share(Loan(dropped))
    receipt = _torch_ipc.Receipt(*share)
    mem = gpuptr.alloc(MIB)
    synced = []
    holder = _torch_ipc._Mapped(mem, receipt, MIB, 0, synced.append)
    cai = holder.__cuda_array_interface__
    assert cai["shape"] == (MIB,) and cai["typestr"] == "|u1" and cai["version"] == 3
    assert cai["data"] == (mem.device_pointer_value, False)
    del mem
    assert receipt.mapped is not None, "the holder keeps the mapping"
    del holder
    deadline = time.monotonic() + 5
    while receipt.mapped is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receipt.mapped is None, "let go on the helper thread"
    assert synced == [0], "after the device synchronize"
    # (In one process the lock is the sender's own, so the sender may sweep
    # before; across processes the lock holds it: see the tests above.)
    assert dropped.wait(5) and ex.pending() == 0
    ex.close()


def test_share_files_of_exited_senders_are_removed(tmp_path):
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f"gpuptr-torch-{int(p.stdout)}-00"
    gone.write_bytes(b"")
    mine = tmp_path / f"gpuptr-torch-{os.getpid()}-00"
    mine.write_bytes(b"")
    other = tmp_path / "gpuptr-torch-x-00"
    other.write_bytes(b"")
    ex = _torch_ipc.Exporter(str(tmp_path))
    assert not gone.exists() and mine.exists() and other.exists()
    ex.close()
    assert not os.path.exists(ex.path)


def test_a_pools_listing_never_shows_an_allocation_freed_or_one_too_many():
    # One thread churns allocations under two pools (every thread's); two
    # more list them meanwhile. A listing never holds more than the
    # churning thread holds at once, and none is left once all are freed
    # (a free's untagging raced the listing, and a free raced the tag of
    # an allocation another thread had just made).
    import threading

    pools = [(71, 1), (71, 2)]
    for p in pools:
        _core._torch_pool_begin(0, p, True)
    stop = threading.Event()
    worst = [0]
    try:
        def churn():
            held = []
            for i in range(800):
                held.append(t_alloc(4096 * (1 + i % 5), 0, None))
                if len(held) > 2:
                    t_free(held.pop(0), 0, 0, None)
            for p in held:
                t_free(p, 0, 0, None)
            stop.set()

        def look():
            while not stop.is_set():
                worst[0] = max(worst[0], sum(len(_core._torch_pool_live(0, p)) for p in pools))

        threads = [threading.Thread(target=churn), threading.Thread(target=look), threading.Thread(target=look)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for p in pools:
            _core._torch_pool_end(0, p)
    assert worst[0] <= 3, worst[0]
    assert [_core._torch_pool_live(0, p) for p in pools] == [[], []]


def test_reduce_tensor_called_directly_is_gpuptrs_and_torchs_own_for_other_tensors(monkeypatch):
    """``torch.multiprocessing.reductions.reduce_tensor`` (what weight-sharing
    code calls itself) is gpuptr's after the install, torch's own stays
    underneath for tensors not on gpuptr memory, and a second install keeps
    torch's, not gpuptr's, as that."""
    from multiprocessing.reduction import ForkingPickler

    monkeypatch.setattr(ForkingPickler, "_extra_reducers", dict(ForkingPickler._extra_reducers))
    torchs_own = []

    def reduce_tensor(t):
        torchs_own.append(t)
        return ("torch's", t)

    reductions = types.ModuleType("torch.multiprocessing.reductions")
    reductions.reduce_tensor = reduce_tensor
    mp = types.ModuleType("torch.multiprocessing")
    mp.reductions = reductions
    fake = types.ModuleType("torch")
    fake.multiprocessing = mp
    fake.strided = object()
    fake.Tensor = type("Tensor", (), {})
    fake.nn = types.SimpleNamespace(parameter=types.SimpleNamespace(Parameter=type("Parameter", (fake.Tensor,), {})))
    for name, m in (("torch", fake), ("torch.multiprocessing", mp), ("torch.multiprocessing.reductions", reductions)):
        monkeypatch.setitem(sys.modules, name, m)

    _torch_ipc.install_reducers(fake)
    ours = reductions.reduce_tensor
    assert ours is not reduce_tensor and getattr(ours, "__gpuptr_ipc__", False)
    assert ForkingPickler._extra_reducers[fake.Tensor] is ours
    cpu = types.SimpleNamespace(is_cuda=False)
    assert ours(cpu) == ("torch's", cpu) and torchs_own == [cpu]

    _torch_ipc.install_reducers(fake)  # again: torch's own stays underneath
    assert reductions.reduce_tensor(cpu) == ("torch's", cpu) and torchs_own == [cpu, cpu]
    assert reductions.reduce_tensor.__gpuptr_original__ is reduce_tensor
