"""The footprint rows: the peak bytes an allocator holds from the device
over the peak bytes its users hold, for three traces, gpuptr's pool against
PyTorch's caching allocator, CuPy's pool and RMM's pool, each replayed in
its own process:

  a  three 1 MiB blocks allocated and freed, 2000 times (an idle GPU)
  b  a seeded mixed trace: sizes log-uniform from 512 B to 256 MiB, a
     working set of up to 2 GiB, 4000 allocations and frees
  c  a recorded torch training step's allocations (an MLP with AdamW:
     the model, three steps), replayed as allocations and frees

Each trace also has a row of gpuptr's stream-ordered replay (``gpuptr.alloc``
on stream 0, a free reused at once on its stream: the rule PyTorch and CuPy
follow under ``gpuptr.install()``) against PyTorch's caching allocator; the
first rows replay without a stream (numba's rule: a free waits for a fence).

Held bytes are the allocator's own count (gpuptr's ``peak_pool_bytes``,
torch's ``max_memory_reserved``, CuPy's ``total_bytes``, RMM's
``pool_size``), read after every allocation. A row's two columns are the
two allocators' held/live ratios (in percent in the JSON), its "speed-up" the peer's ratio over
gpuptr's (above 1: gpuptr holds less for the same trace); ``extra`` has
the bytes."""

from __future__ import annotations

import json
import os
import random
import tempfile
from functools import partial
from typing import Any, Dict, List, Tuple

from gpuptr.bench._bench import Bench, Measured, Result
from gpuptr.bench._child import child_json, child_out

Op = Tuple[int, int]  # (id, size): size > 0 allocates id, 0 frees it

PEERS = (("torch", "torch's caching allocator"), ("cupy", "CuPy's pool"), ("rmm", "RMM's pool (initial size 0)"))


def trace_a() -> List[Op]:
    """Three 1 MiB blocks allocated and freed, 2000 times."""
    ops: List[Op] = []
    for i in range(2000):
        ops += [(3 * i, 1 << 20), (3 * i + 1, 1 << 20), (3 * i + 2, 1 << 20)]
        ops += [(3 * i, 0), (3 * i + 1, 0), (3 * i + 2, 0)]
    return ops


def trace_b(seed: int = 36, n: int = 4000, working: int = 2 << 30) -> List[Op]:
    """Sizes log-uniform from 512 B to 256 MiB, at most ``working`` bytes
    live, random frees."""
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


def trace_c() -> List[Op]:
    """A torch MLP + AdamW training step's allocations, recorded (needs
    torch on a GPU)."""
    return [(int(k), int(n)) for k, n in json.loads(child_out("footprint_record"))]


TRACES = (("a: 3 x 1 MiB loop", trace_a), ("b: mixed 512 B-256 MiB, 2 GiB set", trace_b), ("c: torch MLP + AdamW step", trace_c))


def replay(allocator: str, ops: List[Op]) -> Dict[str, Any]:
    """The peak held and live bytes of ``ops`` under ``allocator``, in a
    child process."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="gpuptr-footprint-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(ops, f)
        return child_json("footprint_replay", allocator, path)
    finally:
        os.unlink(path)


def _row(ours: Dict[str, Any], peer: str, ops: List[Op]) -> Measured:
    theirs = replay(peer, ops)
    # Percent, so that the report's rounding to 0.1 keeps three digits.
    mine = 100 * ours["peak_held"] / ours["peak_live"]
    other = 100 * theirs["peak_held"] / theirs["peak_live"]
    return Measured(mine, other, extra={"footprint": {"gpuptr": ours, "baseline": theirs}})


def _ordered_row(ops: List[Op]) -> Measured:
    """gpuptr's stream-ordered replay of ``ops`` against PyTorch's."""
    return _row(replay("gpuptr-ordered", ops), "torch", ops)


def rows(b: Bench) -> None:
    for name, make in TRACES:
        row = f"footprint {name}: peak held / peak live"
        wanted = [(peer, label) for peer, label in PEERS if b.wants(row, label, "footprint")]
        if not wanted:
            continue
        b.say(f"{row}, gpuptr against {', '.join(p for p, _ in wanted)}")
        try:
            b.need_gpu()
            ops = make()
            ours = replay("gpuptr", ops)
        except Exception as e:  # no GPU, or no torch for (c)
            for _, label in wanted:
                b.add(Result.skip(row, label, e))
            continue
        for peer, label in wanted:
            b.record(row, label, partial(_row, ours, peer, ops))
        ordered = f"footprint {name}, gpuptr stream-ordered: peak held / peak live"
        if b.wants(ordered, PEERS[0][1], "footprint"):
            b.record(ordered, PEERS[0][1], partial(_ordered_row, ops))
