"""Shared test helpers."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap


def run_plugin(code: str, timeout: int = 300) -> str:
    """Run ``code`` as a script file under NUMBA_CUDA_MEMORY_MANAGER=gpuptr.numba
    (a file, since spawned children re-import it); returns its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "GPUPTR_DRIVER"}
    env["NUMBA_CUDA_MEMORY_MANAGER"] = "gpuptr.numba"
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "plugin_case.py")
        with open(script, "w") as f:
            f.write(textwrap.dedent(code))
        out = subprocess.run(
            [sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout, cwd=d
        )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout
