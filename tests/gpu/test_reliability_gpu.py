"""Reliability on the GPU (marked ``gpu``): numba arrays alive at
interpreter shutdown, an IPC handle of a process that has exited, and a
million alloc/free cycles through numba. The simulator's side is in
``tests/test_reliability.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from helpers import soak

pytestmark = pytest.mark.gpu


# --- interpreter shutdown -----------------------------------------------------


def test_numba_arrays_on_gpuptr_memory_alive_at_exit_exit_cleanly():
    env_code = """
        import numpy as np
        from numba import cuda
        keep = [cuda.to_device(np.arange(1000)) for _ in range(10)]
        pinned = cuda.pinned_array(100)
        mapped = cuda.mapped_array(100)
        cyc = [keep[0]]; cyc.append(cyc)
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(env_code)],
        env=dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="gpuptr.numba"),
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr


# --- bad input ----------------------------------------------------------------


def test_ipc_handle_of_a_dead_process_is_a_typed_error():
    # A handle exported by a process that has exited cannot be opened.
    code = textwrap.dedent(
        """
        import pickle, sys
        from numba import cuda
        import numpy as np
        a = cuda.to_device(np.arange(4))
        sys.stdout.buffer.write(pickle.dumps(a.get_ipc_handle()))
        """
    )
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="gpuptr.numba")
    blob = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300).stdout
    opener = textwrap.dedent(
        """
        import pickle, sys
        h = pickle.loads(sys.stdin.buffer.read())
        try:
            with h as arr:
                arr.copy_to_host()
            print("opened")
        except Exception as e:
            print("error", type(e).__name__)
        """
    )
    out = subprocess.run([sys.executable, "-c", opener], env=env, input=blob, capture_output=True, timeout=300)
    assert out.stdout.decode().startswith("error"), out.stdout + out.stderr


# --- soak ---------------------------------------------------------------------


def test_soak_a_million_alloc_free_cycles_through_numba():
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="gpuptr.numba")
    env.pop("GPUPTR_DRIVER", None)
    soak(1_000_000, "plugin", env)
