"""gpuptr in a two-worker dask-cuda cluster, on the GPU (marked ``gpu``)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import gpuptr

pytestmark = pytest.mark.gpu


def test_local_cuda_cluster_runs_numba_chunks_on_gpuptr_and_gives_memory_back():
    pytest.importorskip("dask_cuda")
    if len(gpuptr.devices()) < 2:
        pytest.skip("needs two GPUs")
    script = pathlib.Path(__file__).resolve().parents[2] / "benches" / "dask_workload.py"
    env = {k: v for k, v in os.environ.items() if k not in ("GPUPTR_DRIVER", "NUMBA_CUDA_MEMORY_MANAGER")}
    out = subprocess.run(
        [sys.executable, str(script), "--manager", "gpuptr", "--chunks", "16"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["workers"] == 2
    for per_device in report["stats"].values():
        assert per_device[0]["alloc_count"] > 0, "the worker's pool was used"
        assert per_device[0]["live_bytes"] == 0, "and everything went back"
