"""IpcHandle across processes on the GPU (marked ``gpu``): each device, a
pool block inside a larger driver allocation, a child that never imports
numba, and handles of freed memory."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest

import gpuptr

pytestmark = pytest.mark.gpu


def _child_read(payload, q):
    import sys

    import gpuptr as g

    h = pickle.loads(payload)
    try:
        mem = h.open()
        q.put(("ok", mem.copy_to_host(), mem.context.device.id, "numba" in sys.modules))
    except g.GpuptrError as e:
        q.put((type(e).__name__, str(e), None, "numba" in sys.modules))


def _open_in_child(h):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child_read, args=(pickle.dumps(h), q))
    p.start()
    try:
        return q.get(timeout=120)
    finally:
        p.join(60)


@pytest.mark.parametrize("device", range(2))
def test_a_spawned_child_reads_the_parents_bytes_on_each_device(device):
    if device >= len(gpuptr.devices()):
        pytest.skip("needs a second GPU")
    gpuptr.reserve(16 << 20, block_size=1 << 20, device=device)
    blocks = [gpuptr.alloc(1 << 20, device=device) for _ in range(4)]
    inner = next(b for b in blocks if b.ipc_handle().offset > 0)  # carved from one allocation
    payload = bytes(range(256)) * 4096
    inner.copy_from_host(payload)
    h = inner.ipc_handle()
    status, data, dev, numba_loaded = _open_in_child(h)
    assert status == "ok", data
    assert data == payload and dev == device
    assert not numba_loaded, "IPC without numba"


def test_a_handle_of_freed_memory_fails_to_open_in_any_process():
    block = gpuptr.alloc(1 << 20)  # a pool block: its driver allocation stays
    h = block.ipc_handle()
    block.free()
    with pytest.raises(gpuptr.InvalidPointerError):
        h.open()  # in the exporting process
    status, message, _, _ = _open_in_child(h)
    assert status == "InvalidPointerError" and "freed" in message, (status, message)
    # A handle without its liveness slot (cleared by hand) does not open in
    # another process: the record is what bounds it to its allocation.
    big = gpuptr.alloc(300 << 20)
    raw = bytearray(big.ipc_handle().to_bytes())
    raw[48:52] = (2**32 - 1).to_bytes(4, "little")  # no liveness slot
    h2 = gpuptr.IpcHandle.from_bytes(bytes(raw))
    status, message, _, _ = _open_in_child(h2)
    assert status == "InvalidPointerError" and "no liveness record" in message, (status, message)
    big.free()
