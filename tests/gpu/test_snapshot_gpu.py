"""One memory timeline for numba, CuPy and PyTorch (marked ``gpu``): a
program on one gpuptr pool records its history, dumps a snapshot, and
PyTorch's own ``torch.cuda._memory_viz`` turns it into HTML.

Each program runs in a fresh process: PyTorch takes a new allocator only
before its first CUDA allocation."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

PROGRAM = """
import gpuptr
report = gpuptr.install()
assert set(report.values()) == {"installed"}, report
gpuptr.record_history(True)
import cupy as cp
import torch
from numba import cuda

keep = []
for i in range(3):
    keep.append(cp.arange(1 << 18, dtype=cp.float32))           # CUPY-LINE
    keep.append(torch.ones(1 << 18, device="cuda"))              # TORCH-LINE
    keep.append(cuda.device_array(1 << 18, dtype="float32"))     # NUMBA-LINE
    del keep[0]
torch.cuda.synchronize()
gpuptr.dump_snapshot(SNAPSHOT)
print("dumped")
"""


def test_numba_cupy_and_torch_share_one_timeline_that_memory_viz_plots(tmp_path):
    pytest.importorskip("numba.cuda")
    pytest.importorskip("cupy")
    pytest.importorskip("torch")
    snapshot = tmp_path / "snap.pickle"
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM).replace("SNAPSHOT", repr(str(snapshot))))
    env = {k: v for k, v in os.environ.items() if k not in ("GPUPTR_DRIVER", "NUMBA_CUDA_MEMORY_MANAGER")}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    with open(snapshot, "rb") as f:
        snap = pickle.load(f)
    lines = script.read_text().splitlines()

    def line(marker):
        return next(i for i, text in enumerate(lines, 1) if marker in text)

    allocs = [e for trace in snap["device_traces"] for e in trace if e["action"] == "alloc"]
    by_client = {}
    for e in allocs:
        by_client.setdefault(e.get("client"), []).append(e)
    assert {"numba", "cupy", "torch"} <= set(by_client), {k: len(v) for k, v in by_client.items()}
    for client, marker in (("cupy", "CUPY-LINE"), ("numba", "NUMBA-LINE")):
        sites = {(f["filename"], f["line"]) for e in by_client[client] for f in e["frames"]}
        assert (str(script), line(marker)) in sites, (client, sorted(sites)[:10])
    # PyTorch's ops release the GIL before they allocate, and its hook never
    # waits for the GIL: a torch allocation names its line only where it was
    # called holding the GIL, and says it was made outside Python otherwise.
    for e in by_client["torch"]:
        names = {f["filename"] for f in e["frames"]}
        assert str(script) in names or "<a PyTorch allocation outside Python>" in names, e["frames"]
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert {"numba", "cupy", "torch"} <= {b.get("client") for b in blocks}

    html = tmp_path / "snap.html"
    viz = subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(snapshot), "-o", str(html)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert viz.returncode == 0, viz.stderr[-4000:]
    text = html.read_text()
    assert len(text) > 10_000 and "snapshot.pickle" in text and "MemoryViz.js" in text
    # The text commands read every key too (memory and segments need
    # flamegraph.pl, which the GPU host cannot download; the functions run
    # with the flamegraph step left out).
    for cmd in ("stats", "trace"):
        r = subprocess.run(
            [sys.executable, "-m", "torch.cuda._memory_viz", cmd, str(snapshot)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0 and r.stdout, (cmd, r.stderr[-4000:])
    from torch.cuda import _memory_viz

    assert _memory_viz.memory(snap, format_flamegraph=lambda text: text)
    assert _memory_viz.segments(snap, format_flamegraph=lambda text: text)
    assert _memory_viz.segment_plot(snap)
