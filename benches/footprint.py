"""The footprint rows of ``python -m gpuptr bench --only footprint``, as one
table: for each trace (see ``gpuptr.bench.footprint``), the peak bytes each
allocator holds from the device and their ratio to the peak bytes live,
under gpuptr's pool, PyTorch's caching allocator, CuPy's pool and RMM's
pool (initial size 0), each in its own process.

Usage: python benches/footprint.py [--json PATH]   (on a GPU machine with
torch, CuPy and RMM; an allocator that is missing is shown as skipped)
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List

from gpuptr.bench.footprint import TRACES, replay

ALLOCATORS = ("gpuptr", "torch", "cupy", "rmm")


def rows() -> List[Dict[str, Any]]:
    """One row per trace: each allocator's peak held bytes and its ratio
    to the trace's peak live bytes."""
    result = []
    for name, make in TRACES:
        try:
            ops = make()
        except Exception as e:  # trace c without torch on a GPU
            print(f"trace {name} left out: {e}", file=sys.stderr)
            continue
        row: Dict[str, Any] = {"trace": name}
        for a in ALLOCATORS:
            try:
                r = replay(a, ops)
                row[a] = {"held": r["peak_held"], "live": r["peak_live"], "ratio": round(r["peak_held"] / r["peak_live"], 3)}
            except Exception as e:
                row[a] = {"skipped": str(e)}
        result.append(row)
    return result


def main() -> int:
    out = rows()
    print(f"{'trace':36s}" + "".join(f"{a:>24s}" for a in ALLOCATORS))
    for r in out:
        cells = []
        for a in ALLOCATORS:
            c = r[a]
            cells.append(f"{c['held'] / 2**20:9.1f} MiB {c['ratio']:6.3f}x" if "held" in c else f"{'skipped':>24s}")
        print(f"{r['trace']:36s}" + "".join(f"{c:>24s}" for c in cells))
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
