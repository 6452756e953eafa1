"""IpcHandle from Python: pickling, opening in the exporting process, and
validation (these run on either driver; a child process on the simulator
has its own simulator, so the parent's handle fails there with a typed
error, which is what CPU CI checks). The GPU tests open it for real."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import gpuptr


def test_handle_pickles_and_opens_in_the_exporting_process():
    mem = gpuptr.alloc(8192)
    mem.copy_from_host(bytes(range(256)) * 32)
    h = mem.view(256, 768).ipc_handle()
    assert (h.device, h.size, h.pid) == (0, 512, os.getpid())
    back = pickle.loads(pickle.dumps(h))
    assert back == h and back.to_bytes() == h.to_bytes() and back.offset == h.offset
    assert hash(back) == hash(h) and len({h, back}) == 1   # equal handles hash alike (a dict key)
    assert h != mem.view(0, 256).ipc_handle()
    opened = back.open()
    assert opened.device_pointer_value == mem.device_pointer_value + 256
    assert opened.copy_to_host() == (bytes(range(256)) * 32)[256:768]
    assert opened.context is mem.context
    assert gpuptr.open_ipc(h).size == 512
    del opened
    mem.free()
    with pytest.raises(gpuptr.InvalidPointerError, match="freed"):
        h.open()


def test_bad_handles_and_bad_memory_get_typed_errors():
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.IpcHandle.from_bytes(b"not a handle")
    with pytest.raises(TypeError):
        gpuptr.open_ipc(b"bytes are not a handle")
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.alloc_managed(4096).ipc_handle()
    m = gpuptr.alloc(4096)
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.wrap(m.device_pointer_value, 4096).ipc_handle()
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.alloc(0).ipc_handle()
    raw = bytearray(m.ipc_handle().to_bytes())
    raw[8:12] = (99).to_bytes(4, "little")  # device 99
    with pytest.raises(gpuptr.InvalidArgumentError, match="device 99"):
        gpuptr.IpcHandle.from_bytes(bytes(raw)).open()


@pytest.mark.sim
def test_another_process_learns_that_a_pool_block_was_freed_before_it_maps():
    live = gpuptr.alloc(1 << 20)
    gone = gpuptr.alloc(1 << 20)
    handles = [live.ipc_handle(), gone.ipc_handle()]
    gone.free()  # back to the pool: its driver allocation is still there
    code = textwrap.dedent(
        """
        import pickle, sys
        import gpuptr
        for h in pickle.loads(sys.stdin.buffer.read()):
            try:
                h.open()
                print("opened")
            except gpuptr.GpuptrError as e:
                print(type(e).__name__, "freed by the process that exported it" in str(e))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(handles), capture_output=True, timeout=120, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stderr.decode()
    # The live one passes the exporter's liveness check and reaches the
    # driver (another simulator cannot map it); the freed one stops there.
    assert out.stdout.decode().split("\n")[:2] == ["InvalidArgumentError False", "InvalidPointerError True"]
    del live


@pytest.mark.sim
def test_a_handle_in_another_process_is_validated_without_numba():
    mem = gpuptr.alloc(4096)
    h = mem.ipc_handle()
    code = textwrap.dedent(
        """
        import pickle, sys
        h = pickle.loads(sys.stdin.buffer.read())
        import gpuptr
        try:
            h.open()
            print("opened")
        except gpuptr.InvalidArgumentError as e:
            print("InvalidArgumentError", "numba" in sys.modules)
            print(e)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(h), capture_output=True, timeout=120, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stderr.decode()
    # Another simulator cannot map this one's memory: a typed error that
    # says so (not the driver's bare CUDA_ERROR_INVALID_VALUE), no crash.
    first, message = out.stdout.decode().splitlines()[:2]
    assert first == "InvalidArgumentError False", out.stdout
    assert "simulator cannot share memory between processes" in message and "CUDA_ERROR" not in message


def test_a_handle_of_a_reset_context_does_not_open():
    dev = 1 if len(gpuptr.devices()) > 1 else 0
    mem = gpuptr.alloc(4096, device=dev)
    h = mem.ipc_handle()
    gpuptr.reset_context(dev)
    with pytest.raises(gpuptr.InvalidPointerError):
        h.open()
    with pytest.raises(gpuptr.InvalidPointerError):
        mem.ipc_handle()
