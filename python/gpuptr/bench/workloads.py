"""Real programs under gpuptr and under the library's own allocator: each
workload runs in a child process of its own (``children/workload.py``)
per allocator, the allocators alternating round by round, or, with
``--lockstep`` (:func:`run_together`), all at once taking their steps in
turn.

The workloads (``children/workload.py`` says how each is timed and what
each memory number is):

  gpt2    GPT-2 training (transformers, from a config: 8 layers, 768 wide,
          12 heads, vocabulary 50257; nothing downloaded), batch 8,
          sequence lengths drawn per step from 64..1024 by a seeded
          generator (the same for every allocator), bf16 autocast, AdamW;
          8 warm-up and 30 timed steps
  resnet  ResNet-18 training (timm, else torchvision), batch 64 of
          3x224x224, channels_last, bf16 autocast, SGD with momentum;
          15 warm-up and 40 timed steps
  cupy    3,000 ``b = a * 2 + 1`` on a fresh ``cupy.empty`` of log-uniform
          1 KiB-64 MiB (seeded), the last 20 results kept; a step is the
          whole pass (1 warm-up pass, 4 timed)
  numba   2,000 rounds of three ``cuda.device_array`` of log-uniform
          256 B-64 MiB (seeded), each filled by a kernel, then dropped; a
          step is the whole pass (1 warm-up pass, 2 timed)

The allocators: ``own`` (PyTorch's caching allocator, CuPy's pool,
numba's default manager), ``rmm`` (``rmm.reinitialize(pool_allocator=
True)``: a pool of half the GPU up front, then RMM's allocator for the
library), ``gpuptr`` (``gpuptr.install()`` with its defaults), ``strict``
(``stream_ordered=False``: a freed block waits for all work queued before
the free, on every stream) and ``ordered`` (``stream_ordered=True``:
reused at once on the stream that freed it). One of the last two is
gpuptr's default, read from ``gpuptr.install``'s signature when the run
starts: :func:`default_allocators` runs the other one beside ``gpuptr``
(each child reports the rule it ran, ``stream_ordered``, and the table
shows it). numba frees without a stream, so it runs ``gpuptr`` alone.

The bench's rows (``python -m gpuptr bench --only workloads``) are gpuptr
(defaults) against the library's own allocator, in 3 rounds in lockstep
(:func:`run_together`; 1 round with ``--quick``; a ``--quick`` run
without ``--only`` leaves them out, as :data:`QUICK_SKIP` says), per
workload:

- ``workload <name>: median step``: the median over rounds of each child's
  median step time (in ns, as every row; each round's median is in
  ``gpuptr_runs``/``baseline_runs``), speed-up ``own / gpuptr`` (above 1:
  gpuptr is faster);
- ``workload <name>: peak memory (library count)``: the allocator's own
  count of its peak (PyTorch's ``max_memory_reserved()``, which gpuptr
  answers under gpuptr; CuPy's pool ``total_bytes()``; gpuptr's
  ``peak_pool_bytes``), the most over rounds, shown as the footprint rows
  are: each side in percent of the own allocator's peak (so its column
  reads 1.00x), speed-up ``own / gpuptr`` (above 1: gpuptr holds less),
  and a line with both peaks in MiB and the peak bytes live. numba's own
  manager keeps no such count: its row is skipped (``benches/workloads.py``
  without ``--lockstep`` reads the device's free memory for every
  allocator).

``benches/workloads.py`` runs all four allocators and prints one table
(its ``main`` is :func:`main` here).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from gpuptr.bench._bench import Bench, Measured, Result, Skipped
from gpuptr.bench._child import manager_env

__all__ = [
    "ALLOCATORS",
    "DEFAULT_ROUNDS",
    "DEFAULT_TIMEOUT_S",
    "WORKLOADS",
    "default_allocators",
    "format_table",
    "last_json",
    "main",
    "missing_library",
    "not_run",
    "parse_args",
    "peak_measured",
    "rows",
    "run_child",
    "run_rounds",
    "run_together",
    "step_measured",
    "summarize",
]

WORKLOADS = ("gpt2", "resnet", "cupy", "numba")
ALLOCATORS = ("own", "rmm", "gpuptr", "strict", "ordered")
#: The allocators that are gpuptr (the table flags them against ``own``).
GPUPTR_SIDES = ("gpuptr", "strict", "ordered")
#: The modules a workload needs: one of each inner tuple.
NEEDS: Dict[str, Tuple[Tuple[str, ...], ...]] = {
    "gpt2": (("torch",), ("transformers",)),
    "resnet": (("torch",), ("timm", "torchvision")),
    "cupy": (("cupy",),),
    "numba": (("numba",),),
}
#: The library's own allocator, as the bench's baseline column names it.
OWN = {
    "gpt2": "torch's caching allocator",
    "resnet": "torch's caching allocator",
    "cupy": "CuPy's pool",
    "numba": "numba's default memory manager",
}
DEFAULT_ROUNDS = 3
DEFAULT_TIMEOUT_S = 300.0
#: The table flags a gpuptr allocator whose median step is over this
#: times own's, or whose peak (either count) is over PEAK_FLAG times own's.
STEP_FLAG = 1.05
PEAK_FLAG = 1.10
#: Why a ``--quick`` run of every group leaves these rows out: a minute or
#: two of child processes (model builds, library imports), where the other
#: groups take seconds, and scripts/gpu-quick gives the whole quick bench
#: 240 s. ``--quick --only workloads`` runs them (one round).
QUICK_SKIP = "left out of a --quick run of every group (minutes of child processes): --only workloads runs them"
#: The characters of a failed child's stderr kept in its JSON.
STDERR_TAIL = 2000
#: The child's variable for a lockstep run's pipes (``Turns`` there).
TURNS_ENV = "GPUPTR_BENCH_TURNS"
#: A child's readings of the device's free memory: another process's
#: memory moves them, so a lockstep run drops them.
DEVICE_KEYS = ("device_lost_bytes", "peak_device_lost_bytes", "released_device_lost_bytes")

Record = Dict[str, Any]
Say = Callable[[str], None]
RunChild = Callable[..., Record]
RunGroup = Callable[..., List[Record]]


# --- what runs --------------------------------------------------------------


def missing_library(workload: str) -> Optional[str]:
    """Why ``workload`` cannot run here because a library is not installed
    (None: all are; whether they import, the child finds out)."""
    for choices in NEEDS[workload]:
        if not any(_installed(m) for m in choices):
            return f"{' or '.join(choices)} {'is' if len(choices) == 1 else 'are'} not installed"
    return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def default_stream_ordered() -> bool:
    """``gpuptr.install``'s default ``stream_ordered`` (False if it cannot
    be read)."""
    import gpuptr

    try:
        default = inspect.signature(gpuptr.install).parameters["stream_ordered"].default
    except (KeyError, TypeError, ValueError):
        return False
    return default is True


def default_allocators() -> List[str]:
    """``own``, ``rmm``, ``gpuptr`` (defaults) and gpuptr's other stream
    rule: ``ordered`` while the default is to wait for all streams, else
    ``strict``."""
    return ["own", "rmm", "gpuptr", "strict" if default_stream_ordered() else "ordered"]


def not_run(workload: str, allocator: str) -> Optional[str]:
    """Why the pair is not run although it could be (None: it is run)."""
    if workload == "numba" and allocator in ("strict", "ordered"):
        return "the same as gpuptr for numba (numba frees without a stream)"
    return None


def gpu_problem() -> Optional[str]:
    """Why nothing can run on a GPU here (None: gpuptr sees a CUDA device)."""
    try:
        import gpuptr

        info = gpuptr.driver_info()
    except Exception as e:
        return f"needs the GPU ({type(e).__name__}: {str(e).split(';')[0]})"
    if info["driver"] != "cuda":
        return f"needs the GPU (gpuptr's driver here is {info['driver']!r})"
    if info["device_count"] < 1:
        return "needs the GPU (the driver sees no device)"
    return None


# --- one child --------------------------------------------------------------


def child_env(workload: str, allocator: str) -> Dict[str, str]:
    """This process's environment for the child: numba's memory manager set
    (numba reads it when imported) or unset."""
    manager = None
    if workload == "numba" and allocator == "rmm":
        manager = "rmm.allocators.numba"
    elif workload == "numba" and allocator in GPUPTR_SIDES:
        manager = "gpuptr.numba"
    return manager_env(manager)


def last_json(stdout: str) -> Optional[Record]:
    """The last line of ``stdout`` that is a JSON object (libraries may
    print after it)."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _text(data: Any) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", "replace")
    return str(data)


def _failed(workload: str, allocator: str, error: str, stderr: Any = None) -> Record:
    return {"workload": workload, "allocator": allocator, "skipped": None, "error": error,
            "stderr_tail": _text(stderr)[-STDERR_TAIL:]}


def run_child(
    workload: str,
    allocator: str,
    *,
    warmup: Optional[int] = None,
    steps: Optional[int] = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Record:
    """``children/workload.py`` for the pair: its JSON object, with
    ``child_wall_s``; never raises: a child that timed out, died or printed
    no JSON gives an object with ``error``, and a failed child's JSON keeps
    the end of its stderr as ``stderr_tail``."""
    args = _child_args(workload, allocator, warmup, steps)
    source = resources.files("gpuptr.bench.children").joinpath("workload.py")
    t0 = time.perf_counter()
    try:
        with resources.as_file(source) as path:
            # -P: the script's folder does not go first on the child's sys.path.
            out = subprocess.run(
                [sys.executable, "-P", str(path), *args],
                env=child_env(workload, allocator),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
    except subprocess.TimeoutExpired as e:
        rec = _failed(workload, allocator, f"timed out after {timeout:g} s (--timeout)", e.stderr)
        rec["child_wall_s"] = round(time.perf_counter() - t0, 2)
        return rec
    except OSError as e:
        return _failed(workload, allocator, f"could not start the child: {type(e).__name__}: {e}")
    return _record(workload, allocator, out.returncode, out.stdout, out.stderr, time.perf_counter() - t0)


def _record(workload: str, allocator: str, returncode: int, stdout: str, stderr: str, wall: float) -> Record:
    """A finished child's record, from its exit status and output."""
    found = last_json(stdout)
    if found is None:
        how = f"exit status {returncode}" if returncode >= 0 else f"killed by signal {-returncode}"
        rec = _failed(workload, allocator, f"the child printed no result ({how})", stderr)
    else:
        rec = found
        rec.setdefault("workload", workload)
        rec.setdefault("allocator", allocator)
        rec.setdefault("skipped", None)
        rec.setdefault("error", None)
        if returncode != 0:
            rec["returncode"] = returncode
        if rec["error"] or returncode != 0:
            rec["stderr_tail"] = stderr[-STDERR_TAIL:]
    rec["child_wall_s"] = round(wall, 2)
    return rec


def _child_args(workload: str, allocator: str, warmup: Optional[int], steps: Optional[int]) -> List[str]:
    args = [workload, allocator]
    if warmup is not None:
        args += ["--warmup", str(warmup)]
    if steps is not None:
        args += ["--steps", str(steps)]
    return args


def run_together(
    workload: str,
    allocators: Sequence[str],
    *,
    first: int = 0,
    warmup: Optional[int] = None,
    steps: Optional[int] = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> List[Record]:
    """``workload``'s children under every allocator at once, taking their
    steps in turn (``--lockstep``; ``children/workload.py``'s ``Turns``):
    a ring of pipes in the order of ``allocators``, the token first to
    ``allocators[first]``. A step of each runs between two of the others',
    so a host whose speed drifts (a VM's CPU taken by its neighbours) moves
    every allocator's steps alike. The device's free memory is then read
    while the others hold theirs, so the device readings are dropped
    (None); the allocators' own counts stand. The children share the
    device's memory, so an allocator that takes much up front (RMM's pool
    takes half the GPU) may leave the others short: ``own,gpuptr`` is the
    pair to run so. ``timeout`` is each child's: the group may run ``n``
    times it. One record per allocator, in order, as :func:`run_child`
    makes them (``child_wall_s`` is then the group's), each with
    ``lockstep`` (the ring's order) and, for a child that finished, its
    ``turns``."""
    n = len(allocators)
    if n == 0:
        return []
    source = resources.files("gpuptr.bench.children").joinpath("workload.py")
    ring: List[Tuple[int, int]] = []  # child i reads ring[i], writes ring[i + 1]
    try:
        for _ in range(n):
            ring.append(os.pipe())
    except OSError as e:
        for fds in ring:
            for fd in fds:
                os.close(fd)
        return [_failed(workload, a, f"could not make the ring's pipes: {e}") for a in allocators]
    started: List[Tuple[str, Any, Any, Any]] = []
    failed: Dict[str, Record] = {}
    t0 = time.perf_counter()
    killed: Set[Any] = set()
    try:
        try:
            with resources.as_file(source) as path:
                for i, a in enumerate(allocators):
                    inp, out = ring[i][0], ring[(i + 1) % n][1]
                    env = child_env(workload, a)
                    env[TURNS_ENV] = f"{inp},{out}"
                    files: List[Any] = []
                    try:
                        for _ in range(2):
                            files.append(tempfile.TemporaryFile())
                        proc = subprocess.Popen([sys.executable, "-P", str(path),
                                                 *_child_args(workload, a, warmup, steps)],
                                                env=env, stdout=files[0], stderr=files[1], pass_fds=(inp, out))
                    except OSError as e:
                        for f in files:
                            f.close()
                        failed[a] = _failed(workload, a, f"could not start the child: {type(e).__name__}: {e}")
                        continue
                    started.append((a, proc, files[0], files[1]))
                # The token, then the parent's ends go: a child that is gone
                # leaves its neighbours a pipe that reads empty or refuses.
                with contextlib.suppress(OSError):
                    os.write(ring[first % n][1], b"t")
        finally:
            for fds in ring:
                for fd in fds:
                    os.close(fd)
        deadline = t0 + timeout * n  # the steps run in turn: n children's time
        for a, proc, so, se in started:
            try:
                proc.wait(timeout=None if killed else max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                for _, other, _, _ in started:
                    if other.poll() is None:
                        killed.add(other)
                        with contextlib.suppress(OSError):
                            other.kill()
                proc.wait()
    except BaseException:
        # As subprocess.run does: no child outlives an error or an interrupt.
        for _, proc, so, se in started:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()
            so.close()
            se.close()
        raise
    recs: Dict[str, Record] = dict(failed)
    for a, proc, so, se in started:
        with so, se:
            so.seek(0)
            se.seek(0)
            stdout, stderr = _text(so.read()), _text(se.read())
        wall = time.perf_counter() - t0
        if proc in killed and last_json(stdout) is None:
            rec = _failed(workload, a, f"timed out after {timeout:g} s (--timeout)", stderr)
            rec["child_wall_s"] = round(wall, 2)
        else:
            rec = _record(workload, a, proc.returncode, stdout, stderr, wall)
        recs[a] = rec
    out_recs = []
    for a in allocators:
        rec = recs[a]
        rec["lockstep"] = list(allocators[first % n:]) + list(allocators[:first % n])
        for key in DEVICE_KEYS:
            if key in rec:
                rec[key] = None
        out_recs.append(rec)
    return out_recs


def reason(rec: Record) -> Optional[str]:
    """A record's skip or error, on one line (None: it was measured)."""
    if rec.get("skipped"):
        return str(rec["skipped"])
    if rec.get("error"):
        lines = [x for x in str(rec["error"]).strip().splitlines() if x.strip()]
        return lines[-1].strip() if lines else "error"
    if rec.get("median_ms") is None:
        return "the child reported no step time"
    return None


# --- the rounds -------------------------------------------------------------


def run_rounds(
    workloads: Sequence[str],
    allocators: Sequence[str],
    rounds: int,
    *,
    warmup: Optional[int] = None,
    steps: Optional[int] = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    gpu: Optional[str] = None,
    say: Optional[Say] = None,
    run: RunChild = run_child,
    together: bool = False,
    run_group: Optional[RunGroup] = None,
) -> List[Record]:
    """Every pair's children, round by round, the allocators alternating in
    each round (round 1: each workload under each allocator in order;
    round 2: the same ...); with ``together``, a workload's children under
    every allocator at once, in lockstep (:func:`run_together`), another
    allocator first each round. A pair that cannot run (``gpu``: why nothing
    can; a library or RMM not installed; :func:`not_run`) gets one record
    with ``skipped`` and ``"round": None`` and no child; a pair whose child
    skipped or failed is not run again. Each child's record gets its
    ``round``."""
    say = say or (lambda s: None)
    group = run_group or run_together
    records: List[Record] = []
    stopped: Dict[Tuple[str, str], str] = {}
    for w in workloads:
        lib = missing_library(w)
        for a in allocators:
            why = lib or gpu or (("rmm is not installed" if not _installed("rmm") else None) if a == "rmm" else None)
            why = why or not_run(w, a)
            if why:
                stopped[(w, a)] = why
                records.append({"workload": w, "allocator": a, "round": None, "skipped": why, "error": None})
    for w in workloads:
        gone = {stopped[(w, a)] for a in allocators if (w, a) in stopped}
        if all((w, a) in stopped for a in allocators):
            say(f"{w}: skipped ({'; '.join(sorted(gone))})")
        else:
            for a in allocators:
                if (w, a) in stopped:
                    say(f"{w} under {a}: skipped ({stopped[(w, a)]})")

    def note(r: int, w: str, a: str, rec: Record, t0: float) -> None:
        rec["round"] = r
        records.append(rec)
        why = reason(rec)
        took = f"{time.perf_counter() - t0:.1f} s"
        if why is None:
            say(f"[round {r}/{rounds}] {w} under {a}: median step {rec['median_ms']:.2f} ms ({took})")
        else:
            stopped[(w, a)] = why
            kind = "skipped" if rec.get("skipped") else "FAILED"
            say(f"[round {r}/{rounds}] {w} under {a}: {kind}: {why} ({took}; not run again)")

    for r in range(1, rounds + 1):
        for w in workloads:
            live = [a for a in allocators if (w, a) not in stopped]
            if together and live:
                t0 = time.perf_counter()
                # Each round another allocator takes the first step.
                recs = group(w, live, first=(r - 1) % len(live), warmup=warmup, steps=steps, timeout=timeout)
                for a, rec in zip(live, recs):
                    note(r, w, a, rec, t0)
                continue
            for a in live:
                t0 = time.perf_counter()
                note(r, w, a, run(w, a, warmup=warmup, steps=steps, timeout=timeout), t0)
    return records


def _most(values: List[Any]) -> Optional[int]:
    known = [int(v) for v in values if v is not None]
    return max(known) if known else None


def summarize(records: Sequence[Record]) -> Dict[Tuple[str, str], Record]:
    """Per (workload, allocator): over its measured rounds, the median of
    the children's median steps and their min and max (ms); the most of
    each memory number over the rounds; gpuptr's counts and the stream
    rule of the last measured round; else why it was skipped or failed
    (``skipped``/``error``, one line each)."""
    pairs: Dict[Tuple[str, str], List[Record]] = {}
    for rec in records:
        pairs.setdefault((rec["workload"], rec["allocator"]), []).append(rec)
    out: Dict[Tuple[str, str], Record] = {}
    for key, recs in pairs.items():
        ok = [r for r in recs if reason(r) is None]
        s: Record = {"workload": key[0], "allocator": key[1], "rounds": len(ok), "skipped": None, "error": None}
        bad = [r for r in recs if reason(r) is not None]
        if bad:
            s["skipped" if bad[0].get("skipped") else "error"] = reason(bad[0])
        if ok:
            medians = [float(r["median_ms"]) for r in ok]
            last = ok[-1]
            s.update(
                median_ms=statistics.median(medians),
                min_ms=min(medians),
                max_ms=max(medians),
                round_medians_ms=medians,
                by_round={int(r["round"]): float(r["median_ms"]) for r in ok if r.get("round") is not None},
                peak_lib_bytes=_most([r.get("peak_lib_bytes") for r in ok]),
                peak_live_bytes=_most([r.get("peak_live_bytes") for r in ok]),
                device_lost_bytes=_most([r.get("device_lost_bytes") for r in ok]),
                peak_device_lost_bytes=_most([r.get("peak_device_lost_bytes") for r in ok]),
                released_device_lost_bytes=_most([r.get("released_device_lost_bytes") for r in ok]),
                gpuptr=last.get("gpuptr"),
                stream_ordered=last.get("stream_ordered"),
                lockstep=any(r.get("lockstep") for r in ok),
                step=last.get("step"),
            )
        out[key] = s
    return out


def paired_ratio(mine: Record, own: Record) -> Optional[float]:
    """The median over rounds of ``mine``'s median step over ``own``'s in
    the same round (the two ran one after the other, or in lockstep side by
    side, so a host that drifts between rounds moves both); None without a
    round measured by both."""
    a, b = mine.get("by_round") or {}, own.get("by_round") or {}
    xs = [a[r] / b[r] for r in a if b.get(r)]
    return statistics.median(xs) if xs else None


def ratio(value: Any, own: Any) -> Optional[float]:
    """``value / own``, None unless both are known and ``own`` is not 0."""
    if value is None or own is None or not own:
        return None
    return float(value) / float(own)


# --- the bench's rows -------------------------------------------------------


def _pair(summary: Dict[Tuple[str, str], Record], workload: str) -> Tuple[Record, Record]:
    """gpuptr's and own's summaries, or Skipped with why one is missing."""
    mine = summary.get((workload, "gpuptr"), {})
    own = summary.get((workload, "own"), {})
    for side in (mine, own):
        if not side.get("rounds"):
            raise Skipped(side.get("skipped") or side.get("error") or "not measured")
    return mine, own


def step_measured(summary: Dict[Tuple[str, str], Record], workload: str) -> Measured:
    """The median-step row: each side's median over rounds, in ns."""
    mine, own = _pair(summary, workload)
    return Measured(
        mine["median_ms"] * 1e6,
        own["median_ms"] * 1e6,
        extra={"workload": {"gpuptr": mine, "own": own}},
        gpuptr_runs=[ms * 1e6 for ms in mine["round_medians_ms"]],
        baseline_runs=[ms * 1e6 for ms in own["round_medians_ms"]],
    )


def peak_measured(summary: Dict[Tuple[str, str], Record], workload: str) -> Measured:
    """The peak-memory row: each side's peak in percent of own's (the
    report shows a ``footprint`` row's values over 100 as ``x``)."""
    mine, own = _pair(summary, workload)
    if not own.get("peak_lib_bytes"):
        raise Skipped(f"{OWN[workload]} keeps no count of what it holds (benches/workloads.py reads the device's)")
    if mine.get("peak_lib_bytes") is None or mine.get("peak_live_bytes") is None:
        raise Skipped("gpuptr reported no peak pool or live bytes")
    held = {
        side: {"peak_held": s["peak_lib_bytes"], "peak_live": s.get("peak_live_bytes")}
        for side, s in (("gpuptr", mine), ("baseline", own))
    }
    return Measured(
        100.0 * mine["peak_lib_bytes"] / own["peak_lib_bytes"],
        100.0,
        extra={"footprint": held, "workload": {"gpuptr": mine, "own": own, "unit": "percent of own's peak"}},
    )


def rows(b: Bench) -> None:
    rounds = 1 if b.quick else DEFAULT_ROUNDS
    for w in WORKLOADS:
        label = OWN[w]
        named = [
            (f"workload {w}: median step", step_measured),
            (f"workload {w}: peak memory (library count)", peak_measured),
        ]
        wanted = [(row, fn) for row, fn in named if b.wants(row, label, "workloads")]
        if not wanted:
            continue
        b.say(f"workload {w} under gpuptr and {label}, {rounds} round{'s' if rounds > 1 else ''} of child processes")
        try:
            if b.quick and b.only is None:
                raise Skipped(QUICK_SKIP)
            lib = missing_library(w)
            if lib:
                raise Skipped(lib)
            b.need_gpu()
            records = run_rounds([w], ["own", "gpuptr"], rounds, together=True,
                                 say=lambda s: print(f"    {s}", file=b.out, flush=True))
            summary = summarize(records)
        except Exception as e:  # a library missing, no GPU
            for row, _ in wanted:
                b.add(Result.skip(row, label, e))
            continue
        for row, fn in wanted:
            b.record(row, label, partial(fn, summary, w))


# --- the table --------------------------------------------------------------


def _bytes(n: Any) -> str:
    if n is None:
        return "-"
    n = float(n)
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def _x(value: Optional[float], flag_over: Optional[float] = None) -> str:
    if value is None:
        return "- "
    # One more character, "!" or " ", so that the ratios line up.
    return f"{value:.2f}x" + ("!" if flag_over is not None and value > flag_over else " ")


def _counts(g: Any) -> str:
    if not isinstance(g, dict):
        return "-"
    return " / ".join("-" if g.get(k) is None else str(g[k]) for k in ("alloc_count", "pool_misses", "fences"))


def format_table(
    summary: Dict[Tuple[str, str], Record], workloads: Sequence[str], allocators: Sequence[str]
) -> str:
    """One line per workload and allocator: the median step with its min
    and max over rounds and the two peaks, each with its ratio to ``own``
    (a gpuptr allocator over 1.05x own's step, or 1.10x either of own's
    peaks, is flagged ``!``); the bytes still taken at the end and once the
    cache was given back; and gpuptr's allocations, misses and fences. A
    workload skipped under every allocator for one reason is one line;
    reasons follow the table."""
    header = ("workload", "allocator", "rounds", "median step", "min-max ms", "x own", "by round",
              "peak (library)", "x own", "peak (device)", "x own", "at end (device)",
              "released (device)", "gpuptr allocs / misses / fences")
    cells: List[Tuple[str, ...]] = []
    notes: List[str] = []
    flagged = False
    for w in workloads:
        present = [summary[(w, a)] for a in allocators if (w, a) in summary]
        if not present:
            continue
        if all(not s["rounds"] for s in present) and len({s["skipped"] or s["error"] for s in present}) == 1:
            s = present[0]
            cells.append((w, "(all)", "0", ("skipped: " if s["skipped"] else "FAILED: ") + str(s["skipped"] or s["error"])))
            continue
        own = summary.get((w, "own"), {})
        own_ok = bool(own.get("rounds"))
        for s in present:
            a = s["allocator"]
            if not s["rounds"]:
                cells.append((w, a, "0", ("skipped: " if s["skipped"] else "FAILED: ") + str(s["skipped"] or s["error"])))
                continue
            mine = a in GPUPTR_SIDES
            step_x = ratio(s["median_ms"], own.get("median_ms")) if own_ok else None
            round_x = paired_ratio(s, own) if own_ok else None
            lib_x = ratio(s["peak_lib_bytes"], own.get("peak_lib_bytes")) if own_ok else None
            dev_x = ratio(s["peak_device_lost_bytes"], own.get("peak_device_lost_bytes")) if own_ok else None
            for value, limit in ((step_x, STEP_FLAG), (round_x, STEP_FLAG), (lib_x, PEAK_FLAG), (dev_x, PEAK_FLAG)):
                flagged = flagged or bool(mine and value is not None and value > limit)
            name = a
            if mine and s.get("stream_ordered") is not None:
                name += " (stream-ordered)" if s["stream_ordered"] else " (all streams)"
            cells.append((
                w,
                name,
                str(s["rounds"]),
                f"{s['median_ms']:.2f} ms",
                f"{s['min_ms']:.2f}-{s['max_ms']:.2f}",
                _x(step_x, STEP_FLAG if mine else None),
                _x(round_x, STEP_FLAG if mine else None),
                _bytes(s["peak_lib_bytes"]),
                _x(lib_x, PEAK_FLAG if mine else None),
                _bytes(s["peak_device_lost_bytes"]),
                _x(dev_x, PEAK_FLAG if mine else None),
                _bytes(s["device_lost_bytes"]),
                _bytes(s.get("released_device_lost_bytes")),
                _counts(s.get("gpuptr")) if mine else "",
            ))
            if s["error"] or s["skipped"]:
                notes.append(f"{w} under {a}: {s['rounds']} round(s) measured, then {s['error'] or s['skipped']}")
        step = next((s.get("step") for s in present if s.get("step")), None)
        if step:
            notes.append(f"{w}: a step is {step}")
    n = len(header)
    full = [c for c in cells if len(c) == n]
    w_ = [max(len(c[i]) for c in [header, *full]) for i in range(n)]
    right = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}

    def line(c: Tuple[str, ...]) -> str:
        if len(c) != n:  # a skipped or failed pair: its reason after the rounds
            return f"{c[0]:<{w_[0]}}  {c[1]:<{w_[1]}}  {c[2]:>{w_[2]}}  {c[3]}"
        return "  ".join(f"{v:>{w_[i]}}" if i in right else f"{v:<{w_[i]}}" for i, v in enumerate(c)).rstrip()

    lines = [line(header)] + [line(c) for c in cells]
    if not full:  # nothing measured: the skips say it all
        return "\n".join(lines + notes)
    lines.append("")
    lines.append(
        "median step: the median over rounds of each child's median step (min-max: of those medians); "
        "x own: over the library's own allocator; by round: the median over rounds of the ratio "
        "to own's step in the same round"
    )
    lines.append(
        "peak (library): the allocator's own count (torch max_memory_reserved, CuPy pool total_bytes, "
        "gpuptr peak_pool_bytes; '-': it keeps none); peak (device): the most free device memory went down "
        "after the context existed; at end: still down after the timed steps (the most over rounds); "
        "released: still down once the objects went and the cache was given back as the library's users do "
        "(torch.cuda.empty_cache(), CuPy's free_all_blocks(), numba's pending frees and gpuptr.trim())"
    )
    if any(s.get("lockstep") for s in summary.values()):
        lines.append(
            "lockstep: a workload's children ran at once, taking their steps in turn (another allocator first "
            "each round), so by round compares steps taken side by side; the device columns read '-' (the "
            "children shared the device's free memory)"
        )
    if flagged:
        lines.append(f"! a gpuptr allocator over {STEP_FLAG:.2f}x own's median step or {PEAK_FLAG:.2f}x own's peak")
    lines += notes
    return "\n".join(lines)


# --- benches/workloads.py ---------------------------------------------------


def _names(allowed: Sequence[str], what: str) -> Callable[[str], List[str]]:
    def parse(text: str) -> List[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(unknown) or repr(text)} (choose from {','.join(allowed)})"
            )
        return list(dict.fromkeys(names))

    return parse


def _cpus(text: str) -> List[int]:
    """``--cpus``: CPU numbers and ranges (``3``, ``2,3``, ``2-5``), each
    one this process may run on."""
    cpus: List[int] = []
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cpus += range(first, last + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not CPU numbers or ranges (such as 3 or 2-5): {text!r}") from None
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    outside = sorted(set(cpus) - allowed)
    if not cpus or outside:
        raise argparse.ArgumentTypeError(
            f"CPUs {outside or text!r} are not among those this process may run on ({sorted(allowed)})"
        )
    return sorted(set(cpus))


def _positive(kind: Callable[[str], Any], least: float) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least:g}: {text}")
        return value

    return parse


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """``benches/workloads.py``'s arguments (argparse's exit status 2 on
    bad ones, a ``--json`` file in a missing directory included)."""
    ap = argparse.ArgumentParser(
        prog="benches/workloads.py",
        description="Real training and compute loops (GPT-2, ResNet-18, CuPy, numba) under the library's own "
        "allocator, RMM, gpuptr and gpuptr's other stream rule, each in its own process, the allocators "
        "alternating round by round; one table on stdout, progress on stderr.",
    )
    ap.add_argument("--rounds", type=_positive(int, 1), default=DEFAULT_ROUNDS, help="rounds (default %(default)s)")
    ap.add_argument("--only", type=_names(WORKLOADS, "workload"), default=list(WORKLOADS),
                    help=f"workloads, comma-separated (default: {','.join(WORKLOADS)})")
    ap.add_argument("--allocators", type=_names(ALLOCATORS, "allocator"), default=None,
                    help=f"allocators, comma-separated, of {','.join(ALLOCATORS)} (default: "
                    f"{','.join(default_allocators())}: gpuptr's defaults and its other stream rule)")
    ap.add_argument("--steps", type=_positive(int, 1), default=None,
                    help="timed steps (cupy, numba: passes) for every workload (default: each workload's)")
    ap.add_argument("--warmup", type=_positive(int, 0), default=None,
                    help="warm-up steps (cupy, numba: passes) for every workload (default: each workload's)")
    ap.add_argument("--timeout", type=_positive(float, 1), default=DEFAULT_TIMEOUT_S,
                    help="seconds a child may run; in lockstep, a workload's children together may run this "
                    "times their number (default %(default)g)")
    ap.add_argument("--cpus", type=_cpus, default=None, metavar="LIST",
                    help="run every child on these CPUs only (such as 3 or 2-5): a host-bound loop such as "
                    "cupy's then varies less from process to process (default: any CPU)")
    ap.add_argument("--lockstep", action="store_true",
                    help="run a workload's children under every allocator at once, taking their steps in turn, "
                    "so a host whose speed drifts moves them alike (the device memory columns are then left "
                    "out: the children share the device and its memory, so run own,gpuptr so, not rmm's "
                    "half-the-GPU pool beside the others)")
    ap.add_argument("--json", metavar="FILE", help="also write every child's JSON and the summary to FILE")
    args = ap.parse_args(argv)
    if args.allocators is None:
        args.allocators = default_allocators()
    if args.json:
        parent = Path(args.json).parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            ap.error(f"--json {args.json}: the directory {parent} does not exist or cannot be written")
    return args


def main(argv: Optional[Sequence[str]] = None, run: RunChild = run_child, run_group: Optional[RunGroup] = None) -> int:
    """``benches/workloads.py``: the table on stdout; 1 if nothing could be
    measured (as ``python -m gpuptr bench``), else 0."""
    args = parse_args(argv)

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    if args.cpus:
        os.sched_setaffinity(0, args.cpus)  # the children inherit it
    gpu = gpu_problem()
    say(f"workloads {','.join(args.only)} under {','.join(args.allocators)}, {args.rounds} round(s)"
        f"{', in lockstep' if args.lockstep else ''}"
        f"{'' if gpu is None else ' - ' + gpu}")
    t0 = time.perf_counter()
    records = run_rounds(
        args.only, args.allocators, args.rounds,
        warmup=args.warmup, steps=args.steps, timeout=args.timeout, gpu=gpu, say=say, run=run,
        together=args.lockstep, run_group=run_group,
    )
    summary = summarize(records)
    print(format_table(summary, args.only, args.allocators))
    measured = any(s["rounds"] for s in summary.values())
    if args.json:
        report = {
            "meta": _meta(args, gpu, time.perf_counter() - t0),
            "summary": [summary[k] for k in sorted(summary, key=lambda k: (WORKLOADS.index(k[0]), ALLOCATORS.index(k[1])))],
            "children": records,
        }
        try:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
            say(f"note: wrote {args.json}")
        except OSError as e:
            say(f"error: could not write {args.json}: {e}")
            return 1
    if not measured:
        say("error: nothing could be measured here")
        return 1
    return 0


def _meta(args: argparse.Namespace, gpu: Optional[str], wall_s: float) -> Record:
    import gpuptr

    meta: Record = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "argv": sys.argv[1:],
        "rounds": args.rounds,
        "workloads": args.only,
        "allocators": args.allocators,
        "steps": args.steps,
        "warmup": args.warmup,
        "timeout_s": args.timeout,
        "cpus": args.cpus,
        "lockstep": args.lockstep,
        "gpuptr": gpuptr.__version__,
        "gpuptr_default_stream_ordered": default_stream_ordered(),
        "python": platform.python_version(),
        "host": platform.node(),
        "gpu_problem": gpu,
        "wall_s": round(wall_s, 1),
    }
    try:
        meta["device"] = gpuptr.devices()[0].name if gpu is None else None
    except Exception:
        meta["device"] = None
    return meta
