"""The ``gpuptr`` command line.

- ``python -m gpuptr check``: exercise the whole stack (driver, contexts,
  alloc, views, pool, host memory, numba plugin, CAI import, IPC) and print
  a pass/fail table; non-zero exit on any failure.
- ``python -m gpuptr info``: the driver in use (cuda or sim), its version,
  and each device with its memory.
- ``python -m gpuptr bench``: gpuptr against numba, CuPy and cuda.bindings.

With no ``GPUPTR_DRIVER`` set and no usable CUDA driver, they run on the
simulator and say so. Notes go to stderr; ``--json`` puts the result on
stdout as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence, TextIO

_DESCRIPTION = "gpuptr: refcounted CUDA contexts and device pointers, and a caching pool for numba."
_EPILOG = (
    "With no GPUPTR_DRIVER set and no usable CUDA driver, the commands run on "
    "gpuptr's simulator and say so on stderr. Run 'gpuptr COMMAND --help' for a command's options."
)


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

    _choose_driver(sys.stderr)
    info = gpuptr.driver_info()
    stats = {s["device"]: s for s in gpuptr.stats()}
    devices: list[dict[str, Any]] = []
    for dev in gpuptr.devices():
        free, total = gpuptr.context(dev.id).get_memory_info()
        devices.append({"id": dev.id, "name": dev.name, "total_bytes": total, "free_bytes": free})
    if args.json:
        report = {"gpuptr": gpuptr.__version__, "driver": dict(info), "devices": devices, "stats": list(stats.values())}
        print(json.dumps(report, indent=2))
        return 0
    print(f"gpuptr {gpuptr.__version__}")
    print(f"driver: {info['driver']} (CUDA {info['version_string']}, version {info['version']})")
    print(f"devices: {info['device_count']}")
    for d in devices:
        print(f"  [{d['id']}] {d['name']}: {_gib(d['total_bytes'])} total, {_gib(d['free_bytes'])} free")
        s = stats[d["id"]]
        print(
            f"      this process's pool: {s['live_bytes']} B live in {s['live_count']} allocations,"
            f" {s['cached_bytes']} B cached ({s['pending_bytes']} B waiting for a fence),"
            f" peak {s['peak_bytes']} B"
        )
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Exercise the whole stack and print a pass/fail table."""
    _choose_driver(sys.stderr)
    from gpuptr.check import run

    return 1 if run(as_json=args.json) else 0


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
    import gpuptr

    parser = argparse.ArgumentParser(prog="gpuptr", description=_DESCRIPTION, epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=f"gpuptr {gpuptr.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "check",
        help="exercise the whole stack and print a pass/fail table",
        description="Exercise the whole stack (driver, contexts, alloc, views, pool, host memory, numba plugin, "
        "CAI import, IPC) and print a pass/fail table. Exits non-zero on any failure.",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser(
        "info",
        help="show the driver, the devices and the pool",
        description="Show the driver in use, its version, and each device with its memory.",
    )
    p.add_argument("--json", action="store_true", help="print it as JSON on stdout")
    p.set_defaults(func=cmd_info)
    sub.add_parser(
        "bench",
        help="time gpuptr against numba, CuPy, torch, RMM and cuda.bindings (see 'gpuptr bench --help')",
    )
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
