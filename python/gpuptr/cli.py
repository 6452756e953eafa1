"""The ``gpuptr`` command line.

- ``python -m gpuptr check``: exercise the whole stack (driver, contexts,
  alloc, views, pool, host memory, numba plugin, CAI import, IPC) and print
  a pass/fail table; non-zero exit on any failure.
- ``python -m gpuptr info``: the driver in use (cuda or sim), its version,
  and each device with its memory.
- ``python -m gpuptr bench``: gpuptr against numba, CuPy and cuda.bindings.

With no ``GPUPTR_DRIVER`` set and no usable CUDA driver, they run on the
simulator and say so.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence, TextIO


def _choose_driver(out: TextIO) -> None:
    """Fall back to the simulator when the user did not pick a driver and
    libcuda cannot be used here. Must run before the first GPU call."""
    if os.environ.get("GPUPTR_DRIVER", "").strip():
        return
    from gpuptr import probe_cuda

    ok, detail = probe_cuda()
    if not ok:
        print(f"note: {detail}", file=out)
        print("note: running on gpuptr's simulator (GPUPTR_DRIVER=sim)", file=out)
        os.environ["GPUPTR_DRIVER"] = "sim"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def cmd_info(args: argparse.Namespace) -> int:
    """Print the driver and devices."""
    import gpuptr

    _choose_driver(sys.stdout)
    info = gpuptr.driver_info()
    print(f"gpuptr {gpuptr.__version__}")
    print(f"driver: {info['driver']} (CUDA {info['version_string']}, version {info['version']})")
    print(f"devices: {info['device_count']}")
    for dev in gpuptr.devices():
        ctx = gpuptr.context(dev.id)
        free, total = ctx.get_memory_info()
        print(f"  [{dev.id}] {dev.name}: {_gib(total)} total, {_gib(free)} free")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Exercise the whole stack and print a pass/fail table."""
    _choose_driver(sys.stdout)
    from gpuptr.check import run

    return 1 if run() else 0


def cmd_bench(argv: Sequence[str]) -> int:
    """Run the side-by-side benchmark (see gpuptr.bench) with its own options."""
    _choose_driver(sys.stderr)
    from gpuptr.bench import main as bench_main

    return bench_main(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # bench parses its own options (--quick, --json, --plot).
        return cmd_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="gpuptr", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="exercise the whole stack and print a pass/fail table")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("info", help="show the driver and devices")
    p.set_defaults(func=cmd_info)
    sub.add_parser("bench", help="time gpuptr against numba, CuPy and cuda.bindings (--quick, --json, --plot)")
    args = parser.parse_args(argv)
    try:
        rc: int = args.func(args)
        return rc
    except Exception as e:  # the CLI reports, it does not trace back
        from gpuptr import GpuptrError

        if isinstance(e, GpuptrError):
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        raise
