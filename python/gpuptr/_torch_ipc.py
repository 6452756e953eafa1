"""CUDA tensors across ``torch.multiprocessing`` under ``gpuptr.install()``.

PyTorch shares a CUDA tensor through its allocator's ``shareIpcHandle``,
which a pluggable allocator lacks. ``gpuptr.torch.install()`` registers
reducers (``ForkingPickler``) for ``torch.Tensor`` and ``Parameter``, and
puts the same reducer in ``torch.multiprocessing.reductions.reduce_tensor``
(for code that calls it directly; a name imported before ``install()``
still holds PyTorch's): a
strided CUDA tensor on gpuptr memory travels as a gpuptr ``IpcHandle`` of
its storage plus its size, strides, offset and dtype, and the receiver
rebuilds it over the mapped memory (``torch.as_tensor`` over its
``__cuda_array_interface__``, which PyTorch drops with a plain decref, so
the receiver lets go as soon as its tensor is freed). Other tensors go to PyTorch's
own reducer.

Lifetime: the sender's memory lives until both sides let go. Sending lends
the storage's allocation (PyTorch's free then leaves the release to the
loan) and gives it a slot in a small share file of the sending process,
``/dev/shm/gpuptr-torch-<pid>-<random>``. The receiver takes a shared
``fcntl`` lock on its slot before it maps the memory and marks the slot
received; once its last tensor over the memory is gone, a helper thread waits
for the device (``torch.cuda.synchronize``: a kernel queued before may
still read it), unmaps it and lets go of the lock (a process that ends,
however it ends, lets go at once: the kernel drops its locks).
The sender gives the memory back once the slot is marked received and no
lock is held (checked by a helper thread every ``SWEEP_S`` seconds while
anything is lent, and at each send). A tensor sent and never received is
kept until the sender exits, as PyTorch's own sharing does.

A receiver that rebuilds after the sender let go gets ``InvalidPointerError``
("released"), and one whose sender's process has exited gets
``InvalidPointerError`` from gpuptr's IPC (the exporter's liveness file
reads as exited). Memory already mapped when the sender exits: see the
README (measured on the H200).
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import struct
import threading
from typing import Any, Dict, List, Optional, Tuple

from gpuptr import _core
from gpuptr._errors import InvalidPointerError

__all__ = ["install_reducers", "pending", "collect"]

SLOT = 16  # bytes: u64 generation, u32 state, u32 unused
RECEIVED = 1
SWEEP_S = 0.05
_PACK = struct.Struct("<QI4x")


def _read(fd: int, slot: int) -> Tuple[int, int]:
    raw = os.pread(fd, SLOT, slot * SLOT)
    if len(raw) < SLOT:
        return (0, 0)
    return _PACK.unpack(raw)


def _write(fd: int, slot: int, generation: int, state: int) -> None:
    os.pwrite(fd, _PACK.pack(generation, state), slot * SLOT)


class Exporter:
    """This process's share file and the loans it holds (see the module)."""

    def __init__(self, directory: str = "/dev/shm"):
        remove_stale(directory)
        self.path = os.path.join(directory, f"gpuptr-torch-{os.getpid()}-{secrets.token_hex(8)}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        self.fd = os.open(self.path, flags, 0o600)
        self.lock = threading.Lock()
        self.generations: List[int] = []
        self.free: List[int] = []
        self.lent: Dict[int, Tuple[int, Any]] = {}
        self.wake = threading.Event()
        self.thread: Optional[threading.Thread] = None

    def share(self, loan: Any) -> Tuple[str, int, int]:
        """Hold ``loan`` in a fresh slot: ``(path, slot, generation)``."""
        with self.lock:
            if self.free:
                slot = self.free.pop()
            else:
                slot = len(self.generations)
                self.generations.append(0)
            self.generations[slot] += 1
            generation = self.generations[slot]
            _write(self.fd, slot, generation, 0)
            self.lent[slot] = (generation, loan)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="gpuptr-torch-ipc", daemon=True
                )
                self.thread.start()
        self.wake.set()
        return self.path, slot, generation

    def sweep(self) -> int:
        """Give back the loans whose receiver has let go; how many."""
        done = []
        with self.lock:
            for slot, (generation, _) in list(self.lent.items()):
                try:
                    fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, SLOT, slot * SLOT)
                except OSError as e:
                    if e.errno in (errno.EACCES, errno.EAGAIN):
                        continue  # a receiver holds it
                    raise
                try:
                    g, state = _read(self.fd, slot)
                    if g == generation and state == RECEIVED:
                        # A later rebuild of the same message reads a newer
                        # generation: "released", never the memory.
                        self.generations[slot] += 1
                        _write(self.fd, slot, self.generations[slot], 0)
                        done.append(self.lent.pop(slot)[1])
                        self.free.append(slot)
                finally:
                    fcntl.lockf(self.fd, fcntl.LOCK_UN, SLOT, slot * SLOT)
        n = len(done)
        del done  # the loans go here, outside the lock
        return n

    def pending(self) -> int:
        with self.lock:
            return len(self.lent)

    def _run(self) -> None:
        while True:
            self.wake.wait(SWEEP_S)
            self.wake.clear()
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - a helper thread must not die noisily
                pass
            with self.lock:
                if not self.lent:
                    self.thread = None
                    return

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


def remove_stale(directory: str) -> int:
    """Remove the share files of this user's exited processes (an exporter
    that did not exit normally leaves its file); how many."""
    n = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        parts = name.split("-")
        if len(parts) != 4 or parts[:2] != ["gpuptr", "torch"] or not parts[2].isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
                n += 1
            except OSError:
                pass
        except OSError:
            continue
    return n


class Receipt:
    """A receiver's hold on one sent slot: the shared lock, taken before the
    memory is mapped, dropped when the last tensor over it goes."""

    _files: Dict[str, List[Any]] = {}  # path -> [fd, holds]
    _held: Dict[Tuple[str, int], int] = {}
    _lock = threading.Lock()

    def __init__(self, path: str, slot: int, generation: int):
        self.key = (path, slot)
        self.mapped: Any = None
        with Receipt._lock:
            entry = Receipt._files.get(path)
            if entry is None:
                try:
                    fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
                except OSError as e:
                    raise InvalidPointerError(
                        f"the sender's share file {path} is gone ({e.strerror}): "
                        "its process exited or let go of the tensor"
                    ) from None
                entry = Receipt._files[path] = [fd, 0]
            fd = entry[0]
            if Receipt._held.get(self.key, 0) == 0:
                fcntl.lockf(fd, fcntl.LOCK_SH, SLOT, slot * SLOT)
            g, state = _read(fd, slot)
            if g != generation:
                if Receipt._held.get(self.key, 0) == 0:
                    fcntl.lockf(fd, fcntl.LOCK_UN, SLOT, slot * SLOT)
                self._drop_file(path, entry)
                raise InvalidPointerError(
                    "the sender released this tensor's memory already (every receiver "
                    "had let go of it)"
                )
            if state != RECEIVED:
                _write(fd, slot, generation, RECEIVED)
            entry[1] += 1
            Receipt._held[self.key] = Receipt._held.get(self.key, 0) + 1
            self.fd = fd

    @staticmethod
    def _drop_file(path: str, entry: List[Any]) -> None:
        if entry[1] == 0:
            Receipt._files.pop(path, None)
            os.close(entry[0])

    def release(self) -> None:
        """Let go: unmap, then drop the lock if no other tensor here holds it
        (the caller has made sure the device is done with the memory)."""
        self.mapped = None
        with Receipt._lock:
            n = Receipt._held.get(self.key, 0) - 1
            if n > 0:
                Receipt._held[self.key] = n
            else:
                Receipt._held.pop(self.key, None)
                fcntl.lockf(self.fd, fcntl.LOCK_UN, SLOT, self.key[1] * SLOT)
            entry = Receipt._files.get(self.key[0])
            if entry is not None:
                entry[1] -= 1
                self._drop_file(self.key[0], entry)


_exporter: Optional[Exporter] = None
_exporter_lock = threading.Lock()


def exporter() -> Exporter:
    global _exporter
    with _exporter_lock:
        if _exporter is None:
            _exporter = Exporter()
            import atexit

            atexit.register(_exporter.close)
        return _exporter


def _forget_in_child() -> None:
    global _exporter
    _exporter = None  # the parent's loans and file are not the child's


os.register_at_fork(after_in_child=_forget_in_child)


def pending() -> int:
    """Tensors this process sent whose memory it still keeps for a receiver."""
    e = _exporter
    return 0 if e is None else e.pending()


def collect() -> int:
    """Give back now the memory of sent tensors whose receivers let go; how
    many (the helper thread does it within ``SWEEP_S`` seconds anyway)."""
    e = _exporter
    return 0 if e is None else e.sweep()


class _Mapped:
    """The sender's memory as the receiver maps it, for ``torch.as_tensor``
    (``__cuda_array_interface__``: PyTorch keeps this object, and drops it
    with a plain Python decref once its storage is freed). Its end hands
    the receipt to :func:`_let_go`."""

    def __init__(
        self, mapped: Any, receipt: Receipt, nbytes: int, device: int, synchronize: Any
    ):
        self.receipt = receipt
        self.device = device
        self.synchronize = synchronize
        receipt.mapped = mapped
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (mapped.device_pointer_value or 0, False),
            "strides": None,
            "version": 3,
        }

    def __del__(self) -> None:
        try:
            _let_go(self.receipt, self.device, self.synchronize)
        except Exception:  # noqa: BLE001 - never raise from a destructor
            pass


# Receipts whose tensors are gone, let go of by one helper thread once the
# device has finished what was queued before (a kernel still reading the
# memory must not see it reused by the sender).
_gone: List[Tuple[Receipt, int, Any]] = []
_gone_cv = threading.Condition()
_gone_thread: Optional[threading.Thread] = None


def _let_go(receipt: Receipt, device: int, synchronize: Any) -> None:
    """Let go of ``receipt`` on the helper thread once ``synchronize(device)``
    (PyTorch's) has returned."""
    global _gone_thread
    with _gone_cv:
        _gone.append((receipt, device, synchronize))
        if _gone_thread is None or not _gone_thread.is_alive():
            _gone_thread = threading.Thread(
                target=_letting_go, name="gpuptr-torch-ipc-receiver", daemon=True
            )
            _gone_thread.start()
        _gone_cv.notify()


def _letting_go() -> None:
    import time

    while True:
        with _gone_cv:
            while not _gone:
                if not _gone_cv.wait(1.0):
                    return
            batch = list(_gone)
            _gone.clear()
        for device, synchronize in {(d, f) for _, d, f in batch}:
            # A synchronize would break a capture under way on the device.
            while _capturing(device):
                time.sleep(0.001)
            try:
                synchronize(device)
            except Exception:  # noqa: BLE001 - a lost context: nothing runs there any more
                pass
        for receipt, _, _ in batch:
            receipt.release()


def _capturing(device: int) -> bool:
    try:
        return bool(_core.is_capturing(device))
    except Exception:  # noqa: BLE001 - no driver or device: nothing captures
        return False


def rebuild_tensor(
    cls: Any,
    handle: bytes,
    path: str,
    slot: int,
    generation: int,
    nbytes: int,
    dtype: Any,
    size: Tuple[int, ...],
    stride: Tuple[int, ...],
    offset: int,
    requires_grad: bool,
) -> Any:
    """The receiver's side: the tensor over the sender's memory."""
    import torch

    receipt = Receipt(path, slot, generation)
    h = _core.IpcHandle.from_bytes(handle)
    try:
        mapped = h.open()
    except BaseException:
        receipt.release()
        raise
    over = _Mapped(mapped, receipt, nbytes, h.device, torch.cuda.synchronize)
    data = torch.as_tensor(over, device=f"cuda:{h.device}")
    del over
    del mapped
    t = torch.empty((0,), dtype=dtype, device=data.device)
    t.set_(data.untyped_storage(), offset, size, stride)
    if cls is torch.nn.parameter.Parameter:
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    t.requires_grad_(requires_grad)
    return t if cls is torch.Tensor else t.as_subclass(cls)


def rebuild_empty(cls: Any, dtype: Any, size: Tuple[int, ...], device: int, requires_grad: bool) -> Any:
    """An empty CUDA tensor (no memory to share)."""
    import torch

    t = torch.empty(size, dtype=dtype, device=f"cuda:{device}")
    if cls is torch.nn.parameter.Parameter:
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad)


def install_reducers(torch: Any) -> None:
    """Register gpuptr's reducer for ``torch.Tensor`` and ``Parameter``
    (falling back to PyTorch's for anything not on gpuptr memory)."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    # PyTorch's own, also when installed again (the module attribute is ours then).
    original = getattr(reductions.reduce_tensor, "__gpuptr_original__", reductions.reduce_tensor)

    def reduce_tensor(tensor: Any) -> Any:
        """``torch.multiprocessing.reductions.reduce_tensor`` for gpuptr
        memory: ``(rebuild, args)``, where ``rebuild(*args)`` in another
        process (after pickling) gives the tensor over the same memory;
        PyTorch's own for every other tensor."""
        if (
            not getattr(tensor, "is_cuda", False)
            or tensor.layout != torch.strided
            or tensor.is_nested
            or type(tensor).__module__.startswith("torch._subclasses")
        ):
            return original(tensor)
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return (
                rebuild_empty,
                (type(tensor), tensor.dtype, tuple(tensor.size()), tensor.device.index or 0, tensor.requires_grad),
            )
        if not _core._torch_is_live(storage.data_ptr()):
            return original(tensor)
        if tensor.requires_grad and not tensor.is_leaf:
            raise RuntimeError(
                "Cowardly refusing to serialize non-leaf tensor which requires_grad, "
                "since autograd does not support crossing process boundaries. "
                "If you just want to transfer the data, call detach() on the tensor "
                "before serializing (e.g., putting it on the queue)."
            )
        # What was queued on the tensor is done before the receiver reads.
        torch.cuda.synchronize(tensor.device)
        handle, loan = _core._torch_lend(storage.data_ptr())
        path, slot, generation = exporter().share(loan)
        return (
            rebuild_tensor,
            (
                type(tensor),
                handle,
                path,
                slot,
                generation,
                storage.nbytes(),
                tensor.dtype,
                tuple(tensor.size()),
                tuple(tensor.stride()),
                tensor.storage_offset(),
                tensor.requires_grad,
            ),
        )

    reduce_tensor.__gpuptr_ipc__ = True  # type: ignore[attr-defined]
    reduce_tensor.__gpuptr_original__ = original  # type: ignore[attr-defined]
    # Code that shares weights itself (an RL trainer sending them to an
    # inference engine) calls reduce_tensor directly, by the module's name
    # or imported after this: it gets gpuptr's too.
    reductions.reduce_tensor = reduce_tensor
    for cls in (torch.Tensor, torch.nn.parameter.Parameter):
        current = getattr(ForkingPickler, "_extra_reducers", {}).get(cls)
        if not getattr(current, "__gpuptr_ipc__", False):
            ForkingPickler.register(cls, reduce_tensor)
