"""The footprint rows: the peak bytes an allocator holds from the device
over the peak bytes its users hold, for three traces, under gpuptr's pool,
PyTorch's caching allocator, CuPy's pool and RMM's pool, each in its own
process:

  a  three 1 MiB blocks allocated and freed, 2000 times (an idle GPU)
  b  a seeded mixed trace: sizes log-uniform from 512 B to 256 MiB, a
     working set of up to 2 GiB, 4000 allocations and frees
  c  a recorded torch training step's allocations (an MLP with AdamW:
     the model, three steps), replayed as allocations and frees

Held bytes are the allocator's own count where it keeps one (gpuptr's
``peak_pool_bytes``, torch's ``max_memory_reserved``, CuPy's pool
``total_bytes``, RMM's ``PoolMemoryResource.pool_size``), read after every
allocation. RMM's pool is made with an initial size of 0 (its default,
half the GPU, would say nothing of the trace).

Usage: python benches/footprint.py [--json PATH]   (on the GPU machine)
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from typing import Any, Dict, List, Tuple

Op = Tuple[int, int]  # (id, size): size > 0 allocates id, 0 frees it


def trace_a() -> List[Op]:
    ops: List[Op] = []
    for i in range(2000):
        ops += [(3 * i, 1 << 20), (3 * i + 1, 1 << 20), (3 * i + 2, 1 << 20)]
        ops += [(3 * i, 0), (3 * i + 1, 0), (3 * i + 2, 0)]
    return ops


def trace_b(seed: int = 36, n: int = 4000, working: int = 2 << 30) -> List[Op]:
    rng = random.Random(seed)
    ops: List[Op] = []
    live: Dict[int, int] = {}
    total = 0
    for i in range(n):
        size = int(2 ** rng.uniform(9, 28))
        while live and total + size > working:
            k = rng.choice(list(live))
            total -= live.pop(k)
            ops.append((k, 0))
        live[i] = size
        total += size
        ops.append((i, size))
        if rng.random() < 0.4 and live:
            k = rng.choice(list(live))
            total -= live.pop(k)
            ops.append((k, 0))
    ops += [(k, 0) for k in live]
    return ops


RECORD = r"""
import json, torch
torch.cuda.memory._record_memory_history(max_entries=1000000)
model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(4096, 4096), torch.nn.GELU())],
                            torch.nn.Linear(4096, 1024)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for _ in range(3):
    x = torch.randn(512, 4096, device="cuda")
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
ops, ids, n = [], {}, 0
for e in snap["device_traces"][0]:
    if e["action"] == "alloc":
        ids[e["addr"]] = n; ops.append((n, e["size"])); n += 1
    elif e["action"] == "free_requested" and e["addr"] in ids:
        ops.append((ids.pop(e["addr"]), 0))
print(json.dumps(ops))
"""

REPLAY = r"""
import json, sys
which, path = sys.argv[1], sys.argv[2]
ops = json.load(open(path))
if which == "gpuptr":
    import gpuptr
    alloc = gpuptr.alloc
    held = lambda: gpuptr.stats()[0]["pool_bytes"]
    peak = lambda: gpuptr.stats()[0]["peak_pool_bytes"]
elif which == "torch":
    import torch
    alloc = lambda n: torch.empty(n, dtype=torch.uint8, device="cuda")
    held = torch.cuda.memory_reserved
    peak = torch.cuda.max_memory_reserved
elif which == "cupy":
    import cupy
    pool = cupy.get_default_memory_pool()
    alloc = cupy.cuda.alloc
    held = pool.total_bytes
    peak = None
else:
    import rmm
    mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=0)
    rmm.mr.set_current_device_resource(mr)
    alloc = lambda n: rmm.DeviceBuffer(size=n)
    held = mr.pool_size
    peak = None
live, sizes, total, top_live, top_held = {}, {}, 0, 0, 0
for k, n in ops:
    if n:
        live[k] = alloc(n)
        sizes[k] = n
        total += n
        top_live = max(top_live, total)
        top_held = max(top_held, held())
    elif k in live:
        del live[k]
        total -= sizes.pop(k)
if peak is not None:
    top_held = max(top_held, peak())
print(json.dumps({"peak_held": top_held, "peak_live": top_live}))
"""


ALLOCATORS = ("gpuptr", "torch", "cupy", "rmm")


def _child(script: str, *args: str) -> str:
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        raise RuntimeError(lines[-1] if lines else "child failed")
    return r.stdout.strip().splitlines()[-1]


def traces() -> Dict[str, List[Op]]:
    """The three traces; (c) needs torch on a GPU (left out without)."""
    out = {"a: 3 x 1 MiB loop": trace_a(), "b: mixed 512 B-256 MiB, 2 GiB set": trace_b()}
    try:
        out["c: torch MLP + AdamW step"] = [tuple(o) for o in json.loads(_child(RECORD))]
    except Exception as e:  # no torch, or no GPU
        print(f"trace c left out: {e}", file=sys.stderr)
    return out


def rows(path: str = "/tmp/gpuptr-footprint-trace.json") -> List[Dict[str, Any]]:
    """One row per trace: each allocator's peak held bytes and its ratio
    to the trace's peak live bytes."""
    result = []
    for name, ops in traces().items():
        with open(path, "w") as f:
            json.dump(ops, f)
        row: Dict[str, Any] = {"trace": name}
        for a in ALLOCATORS:
            try:
                r = json.loads(_child(REPLAY, a, path))
                row[a] = {"held": r["peak_held"], "live": r["peak_live"], "ratio": round(r["peak_held"] / r["peak_live"], 3)}
            except Exception as e:
                row[a] = {"skipped": str(e)}
        result.append(row)
    return result


def main() -> int:
    out = rows()
    print(f"{'trace':36s}" + "".join(f"{a:>24s}" for a in ALLOCATORS))
    for r in out:
        cells = []
        for a in ALLOCATORS:
            c = r[a]
            cells.append(f"{c['held'] / 2**20:9.1f} MiB {c['ratio']:6.3f}x" if "held" in c else f"{'skipped':>24s}")
        print(f"{r['trace']:36s}" + "".join(f"{c:>24s}" for c in cells))
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
