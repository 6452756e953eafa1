"""One real workload under one allocator, in a process of its own:
``workload.py WORKLOAD ALLOCATOR [--warmup N] [--steps N]``; prints one
JSON object as its last line of output (``gpuptr.bench.workloads`` runs it
and reads it; its docstring says what each workload does).

WORKLOAD: ``gpt2`` (a GPT-2 training step, transformers, built from a
config), ``resnet`` (a ResNet-18 training step, timm or torchvision),
``cupy`` (one pass over 3,000 ``b = a * 2 + 1`` of log-uniform sizes),
``numba`` (one pass over 2,000 rounds of three ``device_array`` filled by a
kernel). For ``gpt2`` and ``resnet`` a step is one training step (defaults:
8 and 15 warm-up, 30 and 40 timed); for ``cupy`` and ``numba`` a step is
one whole pass of the loop (defaults: 1 warm-up pass, then 4 timed for
cupy and 2 for numba; the median of an even count is the middle two's
mean), and ``per_item_us`` is the median pass's time per array
(cupy) or round (numba), in microseconds. Step times are wall time up to
and including a device synchronize; the warm-up steps' are in
``warmup_ms``.

ALLOCATOR: ``own`` (the library's own: PyTorch's caching allocator, CuPy's
default pool, numba's default manager); ``rmm`` (``rmm.reinitialize
(pool_allocator=True)``, then RMM's allocator for the library; numba's
through ``NUMBA_CUDA_MEMORY_MANAGER=rmm.allocators.numba``, set here
before numba is imported if the parent did not); ``gpuptr``
(``gpuptr.install()`` with its defaults, for the workload's library only;
numba through ``NUMBA_CUDA_MEMORY_MANAGER=gpuptr.numba``); ``strict``
(``stream_ordered=False``: freed memory is reused once all work queued
before the free, on every stream, is done); ``ordered``
(``stream_ordered=True``: reused at once on the stream that freed it).
numba frees without a stream, so for it ``strict`` and ``ordered`` are
``gpuptr``.

Memory, all in bytes:

- ``device_lost_bytes``: free device memory (``cuMemGetInfo`` through
  cuda.bindings, with the device's primary context pushed for the call)
  read once that context exists (this script retains it first) and before
  the allocator is set up or the library allocates, minus free memory
  after the timed steps, with the workload's objects still alive. It
  counts all the process took from the device: the pool, and what the
  library loads outside its allocator (kernels, cuBLAS/cuDNN state).
  ``peak_device_lost_bytes``: the largest such drop, read after every step
  (and, for ``cupy`` and ``numba``, after every array or round of the
  warm-up pass, whose sizes are those of the timed passes).
  ``released_device_lost_bytes``: the same drop once the workload's objects
  are gone and the cache was given back as the library's users give it
  back (``released_by`` names the calls: ``torch.cuda.empty_cache()``,
  CuPy's ``free_all_blocks()``, numba's pending deallocations and, under
  gpuptr, ``gpuptr.trim()``). Read through
  the driver because numba's ``get_memory_info()`` and the libraries' own
  calls differ under each allocator (gpuptr's counts its cache as free).
  None when cuda.bindings does not import or its calls fail for another
  reason than no GPU (``device_memory`` says which).
- ``peak_lib_bytes``: the allocator's own count of what it holds: PyTorch's
  ``max_memory_reserved()`` (gpuptr answers it under gpuptr; None where
  it raises, as under RMM); CuPy's pool ``total_bytes()`` read after every
  array of the warm-up pass and after every pass (its pool only grows);
  gpuptr's ``peak_pool_bytes`` under gpuptr; None for numba's own manager
  and RMM's (they keep no such count here).
- ``peak_live_bytes``: the most bytes live at once, where counted: gpuptr's
  ``peak_bytes``, PyTorch's ``max_memory_allocated()``, CuPy's pool
  ``used_bytes()`` read as ``total_bytes()`` is.

``gpuptr``: the device's ``gpuptr.stats()`` cut to its counts (None
unless under gpuptr). A library that does not import, or no GPU, prints
the object with ``skipped`` (the reason); any other failure prints it with
``error`` (the traceback). Either way the exit status is 0. What Python
code prints while the workload runs goes to stderr; a library's C code
may still write to stdout, so the parent takes the last line that is a
JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import inspect
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

WORKLOADS = ("gpt2", "resnet", "cupy", "numba")
ALLOCATORS = ("own", "rmm", "gpuptr", "strict", "ordered")
#: Warm-up and timed steps of each workload (for cupy and numba: passes).
#: ResNet-18 under torch's own allocator takes about ten steps to settle
#: (steps 1-7 ran 11-14 ms, the rest 7.3-8.4 ms, on an H100).
DEFAULT_STEPS: Dict[str, Tuple[int, int]] = {"gpt2": (8, 30), "resnet": (15, 40), "cupy": (1, 4), "numba": (1, 2)}
#: gpt2's sequence lengths: one drawn per step by random.Random(0).
GPT2_LENGTHS = (64, 128, 256, 384, 512, 768, 1024)
#: The gpuptr.stats() keys a child reports (read with .get: a renamed key
#: reads None instead of failing the run).
GPUPTR_KEYS = (
    "alloc_count",
    "pool_hits",
    "pool_misses",
    "fences",
    "peak_pool_bytes",
    "pool_bytes",
    "peak_bytes",
    "live_bytes",
    "reserved_bytes",
    "num_alloc_retries",
    "num_ooms",
)
NUMBA_MANAGER = "NUMBA_CUDA_MEMORY_MANAGER"
#: ``IN,OUT``: the pipes of a lockstep run (see :class:`Turns`).
TURNS_ENV = "GPUPTR_BENCH_TURNS"
CUDA_ERROR_NO_DEVICE = 100
#: cupy: arrays a pass, their sizes (log2 of bytes, log-uniform), results kept.
CUPY_ARRAYS, CUPY_LOG2, CUPY_KEEP = 3000, (10.0, 26.0), 20
#: numba: rounds a pass (three arrays each), their sizes (log2 of bytes).
NUMBA_ROUNDS, NUMBA_LOG2 = 2000, (8.0, 26.0)

Result = Dict[str, Any]


class Skip(Exception):
    """The run cannot happen here (a library missing, no GPU): reported as
    ``skipped`` with this reason."""


def blank(workload: str, allocator: str) -> Result:
    """The result object before anything ran."""
    return {
        "workload": workload,
        "allocator": allocator,
        "step": None,
        "warmup_ms": [],
        "steps_ms": [],
        "median_ms": None,
        "per_item_us": None,
        "peak_lib_bytes": None,
        "peak_live_bytes": None,
        "device_lost_bytes": None,
        "peak_device_lost_bytes": None,
        "released_device_lost_bytes": None,
        "released_by": None,
        "device_total_bytes": None,
        "device_memory": None,
        "gpuptr": None,
        "stream_ordered": None,
        "allocator_check": None,
        "versions": {},
        "skipped": None,
        "error": None,
        "wall_s": None,
    }


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="workload.py", description="One workload under one allocator; one JSON line.")
    ap.add_argument("workload", choices=WORKLOADS)
    ap.add_argument("allocator", choices=ALLOCATORS)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: the workload's)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: the workload's)")
    args = ap.parse_args(argv)
    warmup, steps = DEFAULT_STEPS[args.workload]
    args.warmup = warmup if args.warmup is None else args.warmup
    args.steps = steps if args.steps is None else args.steps
    if args.warmup < 0 or args.steps < 1:
        ap.error("--warmup must be at least 0 and --steps at least 1")
    return args


def need(module: str, what: Optional[str] = None) -> Any:
    """``module`` imported, or Skip saying it does not import."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise Skip(f"{what or module} does not import ({type(e).__name__}: {e})") from None


def version(result: Result, name: str, module: Any) -> None:
    result["versions"][name] = str(getattr(module, "__version__", "?"))


class DeviceMemory:
    """Free memory of device 0 from the driver (``cuMemGetInfo``, with the
    device's primary context pushed for each read): the first read is the
    baseline, every read lowers the low mark."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        try:
            out = driver.cuInit(0)
        except Exception as e:  # the bindings found no libcuda
            raise Skip(f"needs the GPU (cuInit: {type(e).__name__}: {e})") from None
        if int(out[0]) == CUDA_ERROR_NO_DEVICE:
            raise Skip(f"needs the GPU (cuInit: {out[0]!r})")
        self.call("cuInit", 0)
        (count,) = self.call("cuDeviceGetCount")
        if int(count) < 1:
            raise Skip("needs the GPU (the driver sees no CUDA device)")
        (self.device,) = self.call("cuDeviceGet", 0)
        # The primary context: the one PyTorch, CuPy, numba and gpuptr use.
        (self.context,) = self.call("cuDevicePrimaryCtxRetain", self.device)
        self.baseline = 0
        self.lowest = 0
        self.total = 0

    def call(self, name: str, *args: Any) -> Tuple[Any, ...]:
        out = getattr(self.driver, name)(*args)
        err, rest = out[0], tuple(out[1:])
        if int(err) != 0:
            raise RuntimeError(f"{name}{args}: {err!r}")
        return rest

    def free(self) -> int:
        self.call("cuCtxPushCurrent", self.context)
        try:
            free, total = self.call("cuMemGetInfo")
        finally:
            self.call("cuCtxPopCurrent")
        self.total = int(total)
        return int(free)

    def start(self) -> None:
        self.baseline = self.lowest = self.free()

    def sample(self) -> int:
        free = self.free()
        self.lowest = min(self.lowest, free)
        return free


def device_memory(result: Result) -> Optional[DeviceMemory]:
    """The driver's free-memory reader; Skip if the driver finds no GPU;
    None (and why, in ``device_memory``) if cuda.bindings does not import
    or fails otherwise (e.g. bindings newer than the driver): the workload
    then runs without device readings."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python before cuda.bindings
        except ImportError as e:
            result["device_memory"] = f"no readings: cuda.bindings does not import ({e})"
            return None
    try:
        mem = DeviceMemory(driver)
    except Skip:
        raise
    except Exception as e:
        result["device_memory"] = f"no readings: {type(e).__name__}: {e}"
        return None
    result["device_memory"] = "cuMemGetInfo through cuda.bindings, primary context of device 0"
    return mem


Sampler = Callable[[], None]


class Peaks:
    """What is read after every step (outside its timing): free device
    memory, and the library's own counts where it keeps them."""

    def __init__(self, mem: Optional[DeviceMemory]) -> None:
        self.mem = mem
        self.extra: List[Callable[[], Tuple[int, int]]] = []  # () -> (held, live)
        self.held: Optional[int] = None
        self.live: Optional[int] = None

    def __call__(self) -> None:
        if self.mem is not None:
            self.mem.sample()
        for read in self.extra:
            held, live = read()
            self.held = held if self.held is None else max(self.held, held)
            self.live = live if self.live is None else max(self.live, live)


class Turns:
    """Steps taken in turn with other children (``benches/workloads.py
    --lockstep``): the parent joins the children in a ring of pipes
    (``GPUPTR_BENCH_TURNS=IN,OUT``, file descriptors) and hands one token
    round it. A child runs a step (and its readings) only while it holds the
    token, then passes it on, so the steps of the allocators compared run
    one after the other, each beside the others' in time: a host whose speed
    drifts moves them alike. Without the variable every ``with`` block runs
    at once. A ring that breaks (a child failed or ended early: its pipe
    reads empty or refuses a write) is left, and the steps go on alone;
    ``result["turns"]`` says how many steps were taken in turn."""

    def __init__(self, spec: Optional[str]) -> None:
        self.fds: Optional[Tuple[int, int]] = None
        self.taken = 0
        if spec:
            inp, _, out = spec.partition(",")
            self.fds = (int(inp), int(out))
            # Only this process holds the ring's ends: a process it starts
            # (exec'd, or forked) would keep a dead child's pipes open.
            for fd in self.fds:
                os.set_inheritable(fd, False)
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        """In a forked process: close its copies of the ends, passing nothing."""
        self._leave()

    def __enter__(self) -> None:
        if self.fds is not None and not os.read(self.fds[0], 1):
            self._leave()  # every other child is gone: nobody passes it on

    def __exit__(self, *exc: Any) -> None:
        if self.fds is None:
            return
        self.taken += 1
        try:
            os.write(self.fds[1], b"t")
        except OSError:  # the next child is gone (BrokenPipeError)
            self._leave()

    def finish(self) -> None:
        """After the last step: wait for the token once more (the others'
        last steps run alone), pass it on and leave the ring."""
        if self.fds is not None and os.read(self.fds[0], 1):
            with contextlib.suppress(OSError):
                os.write(self.fds[1], b"t")
        self._leave()

    def _leave(self) -> None:
        if self.fds is not None:
            for fd in self.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.fds = None


#: This process's turns: set from ``GPUPTR_BENCH_TURNS`` by :func:`main`.
TURNS = Turns(None)


def timed(fn: Callable[[], Any], sync: Callable[[], Any]) -> Tuple[float, Any]:
    """``fn()``'s wall time in ms, up to and including ``sync()``."""
    t0 = time.perf_counter()
    out = fn()
    sync()
    return (time.perf_counter() - t0) * 1e3, out


# --- the allocators -------------------------------------------------------


def numba_env(allocator: str) -> None:
    """numba's manager, set before numba is imported (the parent sets it
    too; this makes the script right when run by hand)."""
    if allocator == "own":
        os.environ.pop(NUMBA_MANAGER, None)
    elif allocator == "rmm":
        os.environ[NUMBA_MANAGER] = "rmm.allocators.numba"
    else:
        os.environ[NUMBA_MANAGER] = "gpuptr.numba"
    os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")


def stream_rule(allocator: str) -> Dict[str, bool]:
    """``gpuptr.install``'s keyword for ``allocator`` (none: its default)."""
    return {"strict": {"stream_ordered": False}, "ordered": {"stream_ordered": True}}.get(allocator, {})


def default_stream_ordered(gpuptr: Any) -> Optional[bool]:
    try:
        default = inspect.signature(gpuptr.install).parameters["stream_ordered"].default
    except (KeyError, TypeError, ValueError):
        return None
    return bool(default) if isinstance(default, bool) else None


def install_gpuptr(result: Result, workload: str, allocator: str) -> Any:
    """gpuptr for the workload's library (numba: through the environment,
    set before numba was imported); returns the gpuptr module."""
    gpuptr = importlib.import_module("gpuptr")
    version(result, "gpuptr", gpuptr)
    info = gpuptr.driver_info()
    if info.get("driver") != "cuda":
        raise RuntimeError(f"gpuptr runs on its {info.get('driver')!r} driver here, not CUDA (GPUPTR_DRIVER?)")
    kw = stream_rule(allocator)
    result["stream_ordered"] = kw.get("stream_ordered", default_stream_ordered(gpuptr))
    if workload == "numba":
        if os.environ.get(NUMBA_MANAGER) != "gpuptr.numba":
            raise RuntimeError(f"{NUMBA_MANAGER} is {os.environ.get(NUMBA_MANAGER)!r}, not gpuptr.numba")
        return gpuptr
    part = "cupy" if workload == "cupy" else "torch"
    report = gpuptr.install(numba=False, cupy=part == "cupy", torch=part == "torch", rmm=False, **kw)
    if report.get(part) != "installed":
        raise RuntimeError(f"gpuptr.install() did not install {part}: {report!r}")
    return gpuptr


def install_rmm(result: Result, workload: str, rmm: Any, lib: Any) -> None:
    """RMM's pool, and its allocator for the library (before the library
    allocates)."""
    rmm.reinitialize(pool_allocator=True)
    if workload == "cupy":
        from rmm.allocators.cupy import rmm_cupy_allocator

        lib.cuda.set_allocator(rmm_cupy_allocator)
    elif workload in ("gpt2", "resnet"):
        from rmm.allocators.torch import rmm_torch_allocator

        if rmm_torch_allocator is None:
            raise Skip("rmm.allocators.torch has no allocator for this PyTorch (no CUDAPluggableAllocator)")
        lib.cuda.memory.change_current_allocator(rmm_torch_allocator)
    elif os.environ.get(NUMBA_MANAGER) != "rmm.allocators.numba":
        raise RuntimeError(f"{NUMBA_MANAGER} is {os.environ.get(NUMBA_MANAGER)!r}, not rmm.allocators.numba")


def gpuptr_counts(gpuptr: Any) -> Dict[str, Any]:
    """Device 0's ``gpuptr.stats()``, cut to the counts that matter."""
    all_stats = gpuptr.stats()
    dev = next((s for s in all_stats if s.get("device") == 0), all_stats[0] if all_stats else {})
    counts: Dict[str, Any] = {k: dev.get(k) for k in GPUPTR_KEYS}
    clients = dev.get("clients") or {}
    counts["clients"] = {name: c.get("alloc_count") for name, c in clients.items() if c.get("alloc_count")}
    return counts


# --- the workloads --------------------------------------------------------


def torch_steps(
    torch: Any, step: Callable[[int], Any], warmup: int, steps: int, peaks: Peaks, result: Result
) -> List[Any]:
    """``step(i)`` for the warm-up and timed steps, each timed to a
    ``torch.cuda.synchronize()``; keeps the last step's output alive."""
    last: List[Any] = [None]
    for i in range(warmup + steps):
        with TURNS:
            ms, last[0] = timed(lambda: step(i), torch.cuda.synchronize)
            peaks()
        result["warmup_ms" if i < warmup else "steps_ms"].append(round(ms, 3))
    return last


def torch_counts(torch: Any, result: Result) -> None:
    for key, fn in (("peak_lib_bytes", "max_memory_reserved"), ("peak_live_bytes", "max_memory_allocated")):
        try:
            result[key] = int(getattr(torch.cuda, fn)())
        except Exception as e:  # a pluggable allocator (RMM's) raises "does not yet support"
            print(f"workload.py: torch.cuda.{fn}() raised {type(e).__name__}: {e}", file=sys.stderr)
    try:
        result["allocator_check"] = f"torch backend {torch.cuda.memory.get_allocator_backend()}"
    except Exception:
        pass


def run_gpt2(torch: Any, args: argparse.Namespace, peaks: Peaks, result: Result) -> List[Any]:
    # After the allocator: importing transformers must not reach CUDA first.
    # The model is built from a config: nothing to fetch, and the GPU
    # machine may have no network to wait for.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    transformers = need("transformers")
    version(result, "transformers", transformers)
    result["step"] = "one training step: batch 8, bf16 autocast, AdamW"
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=8, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
    model = transformers.GPT2LMHeadModel(config).cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(0)
    lengths = [rng.choice(GPT2_LENGTHS) for _ in range(args.warmup + args.steps)]
    result["seq_lens"] = lengths
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)

    def step(i: int) -> Any:
        ids = torch.randint(0, config.vocab_size, (8, lengths[i]), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    last = torch_steps(torch, step, args.warmup, args.steps, peaks, result)
    torch_counts(torch, result)
    return [model, opt, *last]


def run_resnet(torch: Any, args: argparse.Namespace, peaks: Peaks, result: Result) -> List[Any]:
    torch.manual_seed(0)
    try:
        timm = importlib.import_module("timm")
        version(result, "timm", timm)
        model = timm.create_model("resnet18", num_classes=1000)
        result["model"] = "timm resnet18"
    except ImportError:
        torchvision = need("torchvision", "timm or torchvision")
        version(result, "torchvision", torchvision)
        model = torchvision.models.resnet18(num_classes=1000)
        result["model"] = "torchvision resnet18"
    result["step"] = "one training step: batch 64, 3x224x224, channels_last, bf16 autocast, SGD"
    model = model.cuda().to(memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)

    def step(i: int) -> Any:
        x = torch.randn(64, 3, 224, 224, device="cuda", generator=gen).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (64,), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    last = torch_steps(torch, step, args.warmup, args.steps, peaks, result)
    torch_counts(torch, result)
    return [model, opt, *last]


def _size(log2: float) -> str:
    n = int(2**log2)
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} B"


def log_uniform(seed: int, n: int, lo_log2: float, hi_log2: float) -> List[int]:
    """``n`` byte sizes from 2**lo_log2 to 2**hi_log2, log-uniform, seeded."""
    rng = random.Random(seed)
    return [int(2 ** rng.uniform(lo_log2, hi_log2)) for _ in range(n)]


def passes(
    one_pass: Callable[[Optional[Sampler]], Any],
    sync: Callable[[], Any],
    args: argparse.Namespace,
    peaks: Peaks,
    result: Result,
    items: int,
) -> Any:
    """The warm-up passes (reading memory after every item) and the timed
    passes (reading it after each pass only); returns the last pass's live
    objects."""
    alive: Any = None
    for i in range(args.warmup + args.steps):
        warm = i < args.warmup
        alive = None  # the last pass's objects go before this one starts
        with TURNS:
            ms, alive = timed(lambda: one_pass(peaks if warm else None), sync)
            peaks()
        result["warmup_ms" if warm else "steps_ms"].append(round(ms, 3))
    result["per_item_us"] = round(statistics.median(result["steps_ms"]) * 1e3 / items, 3)
    return alive


def run_cupy(cupy: Any, args: argparse.Namespace, peaks: Peaks, result: Result) -> List[Any]:
    n = CUPY_ARRAYS
    result["step"] = (
        f"one pass: {n} x (b = a * 2 + 1 on a fresh cupy.empty, float32, {_size(CUPY_LOG2[0])}-{_size(CUPY_LOG2[1])}),"
        f" the last {CUPY_KEEP} kept"
    )
    counts = [max(1, size // 4) for size in log_uniform(0, n, *CUPY_LOG2)]
    if result["allocator"] == "own":
        pool = cupy.get_default_memory_pool()
        peaks.extra.append(lambda: (int(pool.total_bytes()), int(pool.used_bytes())))

    def one_pass(sample: Optional[Sampler]) -> Deque[Any]:
        keep: Deque[Any] = deque(maxlen=CUPY_KEEP)
        for count in counts:
            a = cupy.empty(count, dtype=cupy.float32)
            keep.append(a * 2 + 1)
            if sample is not None:
                sample()
        return keep

    alive = passes(one_pass, cupy.cuda.Device().synchronize, args, peaks, result, n)
    if result["allocator"] == "own":
        result["peak_lib_bytes"], result["peak_live_bytes"] = peaks.held, peaks.live
    try:
        result["allocator_check"] = f"cupy allocator {cupy.cuda.get_allocator()!r}"
    except Exception:
        pass
    return [alive]


#: numba.cuda once run_numba has it: the kernel reads it as a module global,
#: which numba resolves (and its simulator swaps); a closure over it is not.
nb_cuda: Any = None


def _fill(a: Any) -> None:
    """The numba kernel: each element gets its index."""
    i = nb_cuda.grid(1)
    if i < a.size:
        a[i] = i


def run_numba(cuda: Any, args: argparse.Namespace, peaks: Peaks, result: Result) -> List[Any]:
    import numpy as np

    rounds = NUMBA_ROUNDS
    result["step"] = (
        f"one pass: {rounds} x (three device_array of {_size(NUMBA_LOG2[0])}-{_size(NUMBA_LOG2[1])},"
        " each filled by a kernel, then dropped)"
    )
    sizes = log_uniform(0, 3 * rounds, *NUMBA_LOG2)
    elements = [max(1, size // 4) for size in sizes]

    global nb_cuda
    nb_cuda = cuda
    fill = cuda.jit(_fill)

    # The warm-up that compiles the kernel (one launch, untimed).
    first = cuda.device_array(256, dtype=np.float32)
    fill[1, 256](first)
    cuda.synchronize()
    del first

    def one_pass(sample: Optional[Sampler]) -> None:
        for r in range(rounds):
            arrays = [cuda.device_array(elements[3 * r + k], dtype=np.float32) for k in range(3)]
            for a in arrays:
                fill[(a.size + 255) // 256, 256](a)
            del arrays
            if sample is not None:
                sample()

    passes(one_pass, cuda.synchronize, args, peaks, result, rounds)
    try:
        manager = cuda.current_context().memory_manager
        result["allocator_check"] = f"numba manager {type(manager).__module__}.{type(manager).__name__}"
    except Exception:
        pass
    return []


# --- the run --------------------------------------------------------------


def run(args: argparse.Namespace, result: Result) -> None:
    workload, allocator = args.workload, args.allocator
    if workload == "numba":
        numba_env(allocator)
    # The library, then RMM or gpuptr, imported before anything reaches CUDA.
    if workload in ("gpt2", "resnet"):
        lib = need("torch")
        if workload == "gpt2" and importlib.util.find_spec("transformers") is None:
            raise Skip("transformers does not import (not installed)")
        if workload == "resnet" and not any(importlib.util.find_spec(m) for m in ("timm", "torchvision")):
            raise Skip("neither timm nor torchvision is installed")
        version(result, "torch", lib)
    elif workload == "cupy":
        lib = need("cupy")
        version(result, "cupy", lib)
    else:
        lib = need("numba.cuda", "numba.cuda (numba-cuda)")
        try:
            version(result, "numba_cuda", importlib.import_module("numba_cuda"))
        except ImportError:
            version(result, "numba", importlib.import_module("numba"))
    rmm = None
    if allocator == "rmm":
        rmm = need("rmm")
        version(result, "rmm", rmm)

    mem = device_memory(result)
    if mem is not None:
        mem.start()
    else:
        print(f"workload.py: device memory: {result['device_memory']}", file=sys.stderr)
    peaks = Peaks(mem)

    gpuptr = None
    if rmm is not None:
        install_rmm(result, workload, rmm, lib)
    elif allocator != "own":
        gpuptr = install_gpuptr(result, workload, allocator)

    runner = {"gpt2": run_gpt2, "resnet": run_resnet, "cupy": run_cupy, "numba": run_numba}[workload]
    alive = runner(lib, args, peaks, result)
    TURNS.finish()
    if os.environ.get(TURNS_ENV):
        result["turns"] = TURNS.taken
    result["median_ms"] = round(statistics.median(result["steps_ms"]), 3)

    # With the workload's objects still alive.
    if mem is not None:
        end = mem.sample()
        result["device_lost_bytes"] = mem.baseline - end
        result["peak_device_lost_bytes"] = mem.baseline - mem.lowest
        result["device_total_bytes"] = mem.total
    if gpuptr is not None:
        counts = gpuptr_counts(gpuptr)
        result["gpuptr"] = counts
        if workload in ("cupy", "numba") and counts.get("peak_pool_bytes") is not None:
            result["peak_lib_bytes"] = int(counts["peak_pool_bytes"])
        if counts.get("peak_bytes") is not None:
            result["peak_live_bytes"] = int(counts["peak_bytes"])
    # Done with it: the objects go, and the cache goes back the way a user
    # of the library gives it back.
    del alive
    gc.collect()
    try:
        result["released_by"] = release(workload, lib, gpuptr)
    except Exception as e:  # e.g. an allocator without the call: still read
        result["released_by"] = f"failed: {type(e).__name__}: {e}"
    if mem is not None:
        result["released_device_lost_bytes"] = mem.baseline - mem.sample()


def release(workload: str, lib: Any, gpuptr: Any) -> str:
    """Give the allocator's cache back as the library's users do once done
    with their objects: ``torch.cuda.empty_cache()``, CuPy's default pool's
    ``free_all_blocks()`` (both reach gpuptr's pool under ``install()``),
    numba's pending deallocations flushed (numba has no call that reaches a
    plugin's cache, so under gpuptr ``gpuptr.trim()`` too). What it called."""
    if workload in ("gpt2", "resnet"):
        lib.cuda.synchronize()
        lib.cuda.empty_cache()
        return "torch.cuda.empty_cache()"
    if workload == "cupy":
        lib.cuda.Device().synchronize()
        lib.get_default_memory_pool().free_all_blocks()
        return "cupy.get_default_memory_pool().free_all_blocks()"
    lib.synchronize()
    lib.current_context().deallocations.clear()
    if gpuptr is None:
        return "numba: current_context().deallocations.clear()"
    gpuptr.trim()
    return "numba: current_context().deallocations.clear(), gpuptr.trim()"


def main(argv: Optional[Sequence[str]] = None) -> int:
    global TURNS
    args = parse(argv)
    TURNS = Turns(os.environ.get(TURNS_ENV))
    result = blank(args.workload, args.allocator)
    out = sys.stdout
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            run(args, result)
    except Skip as e:
        result["skipped"] = str(e)
    except Exception:
        result["error"] = traceback.format_exc()
    # A run that failed leaves the ring at once (its token, if it held it,
    # was passed on): the others need not wait for this process to end.
    TURNS._leave()
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    sys.stderr.flush()
    print(json.dumps(result, default=str), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
