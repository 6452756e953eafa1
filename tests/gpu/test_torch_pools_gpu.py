"""PyTorch's pools, tensor sharing and CUDA graph trees under
``gpuptr.install()``, against PyTorch's own allocator in the same run.

Each case runs in fresh processes (an allocator is chosen before the first
allocation): ``native`` is PyTorch's caching allocator, ``gpuptr`` is
``gpuptr.install()``; both must reach the same outcome. The child prints
one JSON line.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

_PRELUDE = r"""
import gc, json, os, sys, time
import torch
MODE = sys.argv[1]
if MODE == "gpuptr":
    import gpuptr
    gpuptr.install(numba=False, cupy=False)
"""


def _run(tmp_path, body, mode, timeout=300):
    script = tmp_path / f"case_{mode}.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    r = subprocess.run(
        [sys.executable, str(script), mode],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(tmp_path),
    )
    assert r.returncode == 0, f"{mode}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _both(tmp_path, body, timeout=300):
    return _run(tmp_path, body, "native", timeout), _run(tmp_path, body, "gpuptr", timeout)


_MEMPOOL = r"""
N = 1 << 20
pool = torch.cuda.MemPool()
out = {"id": [type(v).__name__ for v in pool.id], "before": pool.use_count()}
with torch.cuda.use_mem_pool(pool):
    out["inside"] = pool.use_count()
    a = torch.full((N,), 3.0, device="cuda")
    b = a * 2.0
c = torch.full((N,), 5.0, device="cuda")  # outside the block
out["after"] = pool.use_count()

def active(p):
    got = set()
    for s in p.snapshot():
        addr = s["address"]
        for blk in s["blocks"]:
            if blk["state"] == "active_allocated":
                got.add(addr)
            addr += blk["size"]
    return got

live = active(pool)
out["a_in_pool"] = a.data_ptr() in live
out["b_in_pool"] = b.data_ptr() in live
out["c_in_pool"] = c.data_ptr() in live
out["b_sum"] = float(b.sum())
ptr_a = a.data_ptr()
del a
torch.cuda.synchronize()
out["a_gone_after_free"] = ptr_a not in active(pool)

# A graph captured into the pool: replays stay right while fresh tensors
# are made and filled.
x = torch.full((N,), 1.0, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2):
        y = x * 2.0 + 1.0
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, pool=pool.id):
    t = x * 2.0
    y = t + 1.0
    del t
g.replay()
torch.cuda.synchronize()
fresh = [torch.full((N,), -7.0, device="cuda") for _ in range(20)]
x.fill_(2.0)
g.replay()
torch.cuda.synchronize()
out["graph_ok"] = bool((y == 5.0).all())
out["fresh_ok"] = all(bool((f == -7.0).all()) for f in fresh)
del g, fresh
print(json.dumps(out))
"""


def test_mempool_and_use_mem_pool_as_under_torchs_allocator(tmp_path):
    native, mine = _both(tmp_path, _MEMPOOL)
    assert native["b_sum"] == 6.0 * (1 << 20)
    assert mine == native, f"native {native}\ngpuptr  {mine}"


_SPAWN = r"""
import torch.multiprocessing as mp

def child(q_in, q_out):
    if MODE == "gpuptr":
        import gpuptr
        gpuptr.install(numba=False, cupy=False)
    t, v = q_in.get()
    q_out.put(("got", float(t.sum()), v.tolist(), t.device.index))
    assert q_in.get() == "check"
    q_out.put(("check", float(t.sum())))
    assert q_in.get() == "let go"
    del t, v
    gc.collect()
    torch.cuda.synchronize()
    q_out.put(("gone",))
    assert q_in.get() == "exit"

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q_in, q_out))
    p.start()
    N = 1 << 20
    t = torch.arange(N, dtype=torch.float32, device="cuda") * 1.5
    expected = float(t.sum())
    v = t[10:20:2]
    q_in.put((t, v))
    got = q_out.get(timeout=120)
    out = {"sum_ok": got[1] == expected, "view": got[2], "device": got[3]}
    # The sender lets go; fresh tensors would take its memory if it were reused.
    del t, v
    gc.collect()
    fresh = [torch.full((N,), -1.0, device="cuda") for _ in range(40)]
    torch.cuda.synchronize()
    q_in.put("check")
    out["intact_after_sender_let_go"] = q_out.get(timeout=120)[1] == expected
    q_in.put("let go")
    q_out.get(timeout=120)
    if MODE == "gpuptr":
        from gpuptr import _torch_ipc
        deadline = time.time() + 10
        while _torch_ipc.pending() and time.time() < deadline:
            time.sleep(0.02)
        out["released"] = _torch_ipc.pending() == 0
    else:
        torch.cuda.ipc_collect()
        out["released"] = True
    q_in.put("exit")
    p.join(60)
    out["child_exit"] = p.exitcode
    print(json.dumps(out))
"""


def test_cuda_tensors_cross_torch_multiprocessing_spawn(tmp_path):
    native, mine = _both(tmp_path, _SPAWN)
    assert native["sum_ok"] and native["child_exit"] == 0
    assert native["view"] == [15.0, 18.0, 21.0, 24.0, 27.0]
    assert mine == native, f"native {native}\ngpuptr  {mine}"


_REDUCE = r"""
import pickle
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor  # imported after install()

def child(conn):
    if MODE == "gpuptr":
        import gpuptr
        gpuptr.install(numba=False, cupy=False)
    func, args = pickle.loads(conn.recv_bytes())
    w = func(*args)  # what an inference engine does with weights sent to it
    conn.send((float(w.sum()), tuple(w.shape), w.stride(), str(w.dtype), w.device.index))
    w.mul_(2.0)  # the same memory: the sender sees it
    torch.cuda.synchronize()
    conn.send("doubled")
    assert conn.recv() == "exit"
    del w

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    p = ctx.Process(target=child, args=(theirs,))
    p.start()
    base = torch.arange(4 * 256, dtype=torch.float32, device="cuda").reshape(4, 256)
    w = base[1:, 128:]  # a view with an offset and strides
    out = {"by_module": torch.multiprocessing.reductions.reduce_tensor is reduce_tensor}
    expect = float(w.sum())  # before the child doubles it
    func, args = reduce_tensor(w)
    mine.send_bytes(pickle.dumps((func, args)))
    got = mine.recv()
    out["got"] = [abs(got[0] - expect) <= 1e-6 * abs(expect), list(got[1]), list(got[2]), got[3], got[4]]
    assert mine.recv() == "doubled"
    out["shared"] = bool((base[1:, 128:] == 2.0 * torch.arange(4 * 256, device="cuda").reshape(4, 256)[1:, 128:]).all())
    out["untouched"] = bool((base[:1] == torch.arange(256, device="cuda")).all())
    mine.send("exit")
    p.join(60)
    out["child_exit"] = p.exitcode
    print(json.dumps(out))
"""


def test_reduce_tensor_called_directly_rebuilds_in_a_spawned_process(tmp_path):
    """Weight sharing as RL trainers do it: ``reduce_tensor(t)`` sent as
    pickled bytes, ``func(*args)`` in a spawned process, over the same
    memory (PyTorch's pluggable allocator alone refuses: no shareIpcHandle)."""
    native, mine = _both(tmp_path, _REDUCE)
    assert native["got"][0] and native["shared"] and native["untouched"] and native["child_exit"] == 0, native
    assert mine == native, f"native {native}\ngpuptr  {mine}"


_OUTLIVE = r"""
import torch.multiprocessing as mp

def sender(q, done):
    if MODE == "gpuptr":
        import gpuptr
        gpuptr.install(numba=False, cupy=False)
    t = torch.full((1 << 20,), 2.0, device="cuda")
    q.put(t)
    q.put(t)   # a second message, rebuilt only after this process exits
    done.wait(120)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=sender, args=(q, done))
    p.start()
    t = q.get(timeout=120)
    out = {"before": float(t.sum())}
    raw = q._reader.recv_bytes()  # the second message, still pickled
    done.set()
    p.join(60)
    out["sender_exit"] = p.exitcode
    try:
        out["mapped_after_exit"] = float(t.sum())
    except Exception as e:
        out["mapped_after_exit"] = type(e).__name__
    try:
        import pickle
        t2 = pickle.loads(raw)
        out["rebuilt_after_exit"] = float(t2.sum())
    except Exception as e:
        out["rebuilt_after_exit"] = type(e).__name__ + ": " + str(e)[:200]
    print(json.dumps(out))
"""


def test_a_receiver_outliving_the_sender(tmp_path):
    """What a receiver sees once the sending process has exited, recorded
    for both allocators. On the H200 (torch 2.11) both keep memory mapped
    before the exit readable; PyTorch's own also rebuilds a message after
    it (with a warning), where gpuptr raises ``InvalidPointerError`` (the
    exporter exited)."""
    script = tmp_path / "outlive.py"
    script.write_text(_PRELUDE + textwrap.dedent(_OUTLIVE))
    for mode in ("native", "gpuptr"):
        r = subprocess.run(
            [sys.executable, str(script), mode], capture_output=True, text=True, timeout=300
        )
        print(mode, r.returncode, r.stdout.strip()[-500:], r.stderr.strip()[-300:])
    assert r.returncode == 0, r.stderr[-4000:]
    mine = json.loads(r.stdout.strip().splitlines()[-1])
    assert mine["before"] == 2.0 * (1 << 20) and mine["sender_exit"] == 0
    assert mine["mapped_after_exit"] == 2.0 * (1 << 20), mine
    assert str(mine["rebuilt_after_exit"]).startswith("InvalidPointerError"), mine


_TREES = r"""
import torch._inductor.config as cfg
TREES = sys.argv[2] == "trees"
if MODE == "gpuptr":
    gpuptr.torch.install(graph_trees=TREES)
else:
    cfg.triton.cudagraph_trees = TREES
torch.manual_seed(0)
D = 2048
w1 = torch.randn(D, D, device="cuda") / D ** 0.5
w2 = torch.randn(D, D, device="cuda") / D ** 0.5

def f1(x):
    return torch.relu(x @ w1) * 2.0 + 1.0

def f2(h):
    return torch.tanh(h @ w2) + h.sum(dim=1, keepdim=True) * 1e-4

c1 = torch.compile(f1, mode="reduce-overhead")
c2 = torch.compile(f2, mode="reduce-overhead")
x = torch.randn(256, D, device="cuda")
torch.cuda.synchronize()
free0 = torch.cuda.mem_get_info()[0]
ok = True
for i in range(5):
    torch.compiler.cudagraph_mark_step_begin()
    y = c2(c1(x))
    ok = ok and bool(torch.allclose(y, f2(f1(x)), atol=1e-3, rtol=1e-3))
kept = [y.clone()]
torch.cuda.synchronize()
times = []
for i in range(200):
    t0 = time.perf_counter()
    torch.compiler.cudagraph_mark_step_begin()
    y = c2(c1(x))
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
ok = ok and bool(torch.allclose(y, f2(f1(x)), atol=1e-3, rtol=1e-3))
ok = ok and bool(torch.allclose(kept[0], f2(f1(x)), atol=1e-3, rtol=1e-3))
held = free0 - torch.cuda.mem_get_info()[0]
times.sort()
print(json.dumps({"equal": ok, "step_us": round(times[len(times) // 2] * 1e6, 1),
                  "held_mib": round(held / 2 ** 20, 1),
                  "trees": bool(cfg.triton.cudagraph_trees)}))
"""


def _trees(tmp_path, mode, kind):
    script = tmp_path / f"trees_{mode}_{kind}.py"
    script.write_text(_PRELUDE + textwrap.dedent(_TREES))
    r = subprocess.run(
        [sys.executable, str(script), mode, kind], capture_output=True, text=True, timeout=400
    )
    assert r.returncode == 0, f"{mode} {kind}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_torch_compile_reduce_overhead_with_graph_trees_matches_eager(tmp_path):
    """Two compiled functions: CUDA graph trees (inductor's default)
    natively and under gpuptr, and one graph per function under gpuptr
    (``install(graph_trees=False)``): each equals eager, and
    the setting the user chose is the one that runs. Prints the table."""
    rows = {}
    for mode, kind in (("native", "trees"), ("gpuptr", "trees"), ("gpuptr", "per-function")):
        rows[(mode, kind)] = _trees(tmp_path, mode, kind)
    for (mode, kind), r in rows.items():
        print(f"| {mode} | {kind} | {r['step_us']} us | {r['held_mib']} MiB | equal={r['equal']} |")
    for (mode, kind), r in rows.items():
        assert r["equal"], (mode, kind, r)
        assert r["trees"] == (kind == "trees"), (mode, kind, r)


def test_install_leaves_cudagraph_trees_as_the_user_set_it(tmp_path):
    body = r"""
import torch._inductor.config as cfg
print(json.dumps({"trees": bool(cfg.triton.cudagraph_trees)}))
"""
    native, mine = _both(tmp_path, body)
    assert native == mine == {"trees": True}
