"""The ``gpuptr`` command line.

- ``python -m gpuptr check``: exercise the whole stack (driver, contexts,
  alloc, views, pool, host memory, numba plugin, CAI import, IPC) and print
  a pass/fail table; non-zero exit on any failure.
- ``python -m gpuptr info``: the driver in use (cuda or sim), its version,
  each device with its memory, and the versions of the libraries gpuptr
  plugs into.
- ``python -m gpuptr bench``: gpuptr against numba, CuPy and cuda.bindings.

With ``GPUPTR_DRIVER`` unset (or ``auto``) and no usable CUDA driver, they
run on the simulator and say so. Notes go to stderr; ``--json`` puts the
result on stdout as JSON. Usage errors, a bad ``GPUPTR_DRIVER`` among them,
exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, TextIO, Tuple

_DESCRIPTION = "gpuptr: refcounted CUDA contexts and device pointers, and a caching pool for numba."
_EPILOG = (
    "With GPUPTR_DRIVER unset (or auto) and no usable CUDA driver, the commands run on "
    "gpuptr's simulator and say so on stderr. Run 'gpuptr COMMAND --help' for a command's options."
)
_DRIVERS = ("auto", "cuda", "sim")
#: The libraries ``info`` reports: (name shown, module, distributions that
#: may provide it; CuPy's also found through the module's own).
_LIBRARIES: Tuple[Tuple[str, str, Tuple[str, ...]], ...] = (
    ("numba-cuda", "numba.cuda", ("numba-cuda",)),
    ("numba-cuda-mlir", "numba_cuda_mlir", ("numba-cuda-mlir",)),
    ("CuPy", "cupy", ("cupy", "cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x")),
    ("torch", "torch", ("torch",)),
    ("cuda-bindings", "cuda.bindings", ("cuda-bindings",)),
    ("cuda-core", "cuda.core", ("cuda-core",)),
    ("RMM", "rmm", ("rmm-cu13", "rmm-cu12", "rmm")),
)


class UsageError(Exception):
    """A command line or setting that cannot work (exit status 2)."""


def _driver_setting() -> str:
    """``GPUPTR_DRIVER`` as the library reads it ('' when unset); a name
    that is no driver is a configuration error, not a missing driver."""
    raw = os.environ.get("GPUPTR_DRIVER", "")
    choice = raw.strip().lower()
    if choice and choice not in _DRIVERS:
        raise UsageError(f"GPUPTR_DRIVER={raw!r} is not a driver: set it to auto, cuda or sim, or unset it")
    return choice


def _no_driver_reason(detail: str) -> str:
    """The reason in a no-driver message, without its advice (which ends
    in 'or set GPUPTR_DRIVER=sim', what the fallback is about to do)."""
    reason = detail.split("; install the NVIDIA driver")[0].strip()
    return reason.removeprefix("no CUDA driver:").strip() or detail


def _choose_driver(out: TextIO) -> None:
    """Fall back to the simulator when the user did not pick a driver and
    libcuda cannot be used here. Must run before the first GPU call."""
    if _driver_setting() not in ("", "auto"):
        return
    from gpuptr import probe_cuda

    ok, detail = probe_cuda()
    if not ok:
        print(f"note: no usable CUDA driver here ({_no_driver_reason(str(detail))})", file=out)
        print(
            "note: running on gpuptr's simulator instead; install the NVIDIA driver to use a GPU "
            "(GPUPTR_DRIVER=sim picks the simulator without these notes)",
            file=out,
        )
        os.environ["GPUPTR_DRIVER"] = "sim"


def _size(n: int) -> str:
    from gpuptr._summary import _size as size

    return size(n)


def library_versions() -> Dict[str, Optional[str]]:
    """The version of each library ``info`` reports, or None where it cannot
    be imported (read from the installed metadata: nothing is imported but
    the parent package of a dotted name)."""
    from importlib import metadata, util

    found: Dict[str, Optional[str]] = {}
    for name, module, dists in _LIBRARIES:
        try:
            importable = util.find_spec(module) is not None
        except (ImportError, ValueError):
            importable = False
        version = None
        if importable:
            top = module.split(".")[0]
            candidates = list(dists) + [d for d in metadata.packages_distributions().get(top, []) if d not in dists]
            for dist in candidates:
                try:
                    version = metadata.version(dist)
                    break
                except metadata.PackageNotFoundError:
                    continue
            else:
                version = "?"
        found[name] = version
    return found


def cmd_info(args: argparse.Namespace) -> int:
    """Print the driver, the devices and the libraries gpuptr plugs into."""
    import platform

    import gpuptr

    _choose_driver(sys.stderr)
    info = gpuptr.driver_info()
    stats = {s["device"]: s for s in gpuptr.stats()}
    devices: List[Dict[str, Any]] = []
    for dev in gpuptr.devices():
        free, total = gpuptr.context(dev.id).get_memory_info()
        devices.append({"id": dev.id, "name": dev.name, "total_bytes": total, "free_bytes": free})
    libraries = library_versions()
    if args.json:
        report = {
            "gpuptr": gpuptr.__version__,
            "python": platform.python_version(),
            "driver": dict(info),
            "devices": devices,
            "stats": list(stats.values()),
            "libraries": libraries,
        }
        print(json.dumps(report, indent=2))
        return 0
    print(f"gpuptr {gpuptr.__version__} (Python {platform.python_version()})")
    print(f"driver: {info['driver']} (CUDA {info['version_string']}, version {info['version']})")
    print(f"devices: {info['device_count']}")
    for d in devices:
        print(f"  [{d['id']}] {d['name']}: {_size(d['total_bytes'])} total, {_size(d['free_bytes'])} free")
    used = [s for s in stats.values() if s["live_count"] or s["cached_bytes"] or s["peak_bytes"]]
    if not used:
        print("pool: per process, so this command's own is empty; gpuptr.memory_summary() in your program shows its pool")
    for s in used:
        print(
            f"pool of device {s['device']} (this process): {_size(s['live_bytes'])} live in {s['live_count']}"
            f" allocations, {_size(s['cached_bytes'])} cached ({_size(s['pending_bytes'])} waiting for a fence),"
            f" peak {_size(s['peak_bytes'])}"
        )
    print("libraries:")
    width = max(len(name) for name in libraries)
    for name, version in libraries.items():
        print(f"  {name:<{width}}  {version or 'not installed'}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Exercise the whole stack and print a pass/fail table."""
    _choose_driver(sys.stderr)
    from gpuptr.check import run

    return 1 if run(as_json=args.json) else 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the side-by-side benchmark (see gpuptr.bench); its arguments are
    checked before the driver is chosen and anything is measured."""
    from gpuptr import bench

    problem = bench.check_arguments(args)
    if problem:
        raise UsageError(problem)
    _choose_driver(sys.stderr)
    return bench.run_command(args)


def _parser() -> Tuple[argparse.ArgumentParser, Dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each command's own."""
    import gpuptr
    from gpuptr import bench

    parser = argparse.ArgumentParser(prog="gpuptr", description=_DESCRIPTION, epilog=_EPILOG)
    parser.add_argument("-V", "--version", action="version", version=f"gpuptr {gpuptr.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands: Dict[str, argparse.ArgumentParser] = {}
    p = commands["check"] = sub.add_parser(
        "check",
        help="exercise the whole stack and print a pass/fail table",
        description="Exercise the whole stack (driver, contexts, alloc, views, pool, host memory, numba plugin, "
        "CAI import, IPC) and print a pass/fail table. Exits non-zero on any failure.",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.set_defaults(func=cmd_check)
    p = commands["info"] = sub.add_parser(
        "info",
        help="show the driver, the devices and the libraries gpuptr plugs into",
        description="Show the driver in use, its version, each device with its memory, and the versions of "
        "numba-cuda, numba-cuda-mlir, CuPy, torch, cuda-bindings, cuda-core and RMM where they are installed.",
    )
    p.add_argument("--json", action="store_true", help="print it as JSON on stdout")
    p.set_defaults(func=cmd_info)
    p = commands["bench"] = sub.add_parser(
        "bench",
        help="time gpuptr against numba, CuPy, torch, RMM and cuda.bindings",
        description=bench.DESCRIPTION,
    )
    bench.add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return parser, commands


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help(sys.stderr)
        print(f"\ngpuptr: error: no command given; choose one of {', '.join(commands)}", file=sys.stderr)
        return 2
    if extra:
        # The command's own usage, not the top level's.
        commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    from gpuptr import GpuptrError

    try:
        _driver_setting()
        rc: int = args.func(args)
        return rc
    except UsageError as e:
        print(f"gpuptr {args.command}: error: {e}", file=sys.stderr)
        return 2
    except GpuptrError as e:  # the CLI reports, it does not trace back
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
