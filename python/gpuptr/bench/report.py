"""The report: its ``meta`` (when, on what, the peers' versions), the
table ``bench`` prints, and the plot of ``--plot``."""

from __future__ import annotations

import platform
import time
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

if TYPE_CHECKING:
    from gpuptr._types import DriverInfo

__all__ = ["format_table", "meta", "plot", "plot_formats"]

#: The column header of the speed-up, ``baseline / gpuptr`` (the JSON key
#: ``ratio``); the plot's axis uses the same word.
SPEED_UP = "speed-up"


def meta(info: DriverInfo, quick: bool) -> Dict[str, Any]:
    """The report's ``meta``: when, on what, and the peers' versions."""
    import gpuptr

    meta: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "driver": info["driver"],
        "driver_version": info["version_string"],
        "device": gpuptr.devices()[0].name,
        "gpuptr": gpuptr.__version__,
        "python": platform.python_version(),
        "quick": quick,
    }
    for mod in ("numba_cuda", "cupy", "torch", "rmm", "cuda.bindings", "cuda.core", "numpy"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            meta[mod] = getattr(m, "__version__", "?")
        except Exception:
            meta[mod] = None
    return meta


_SIM_BANNER = (
    "# on gpuptr's simulator (GPUPTR_DRIVER=sim): host-memory stand-ins for the GPU, not GPU measurements"
)


def _ns_cell(ns: float) -> str:
    return f"{ns:.0f} ns"


def _reason(skipped: str) -> str:
    """A skipped row's reason, on one line and of a readable length."""
    line = skipped.strip().splitlines()[0] if skipped.strip() else "skipped"
    return line if len(line) <= 160 else line[:157] + "..."


def format_table(report: Dict[str, Any]) -> str:
    """The report as a table whose columns fit the longest entry. A skipped
    row shows a numbered marker in the speed-up column, and the reasons follow
    the table, one per distinct reason. On the simulator the first line
    says so."""
    rows = report["rows"]
    reasons: List[str] = []
    cells: List[Tuple[str, str, str, str, str]] = []
    for r in rows:
        if r["skipped"]:
            reason = _reason(r["skipped"])
            if reason not in reasons:
                reasons.append(reason)
            cells.append((r["row"], "-", r["baseline"], "-", f"skipped [{reasons.index(reason) + 1}]"))
        elif "footprint" in (r.get("extra") or {}):  # held/live ratios, not times
            cells.append(
                (r["row"], f"{r['gpuptr_ns'] / 100:.2f}x", r["baseline"], f"{r['baseline_ns'] / 100:.2f}x", f"{r['ratio']:.2f}x")
            )
        else:
            cells.append(
                (r["row"], _ns_cell(r["gpuptr_ns"]), r["baseline"], _ns_cell(r["baseline_ns"]), f"{r['ratio']:.2f}x")
            )
    header = ("row", "gpuptr", "baseline", "baseline", SPEED_UP)
    w = [max(len(c[i]) for c in [header, *cells]) for i in range(5)]

    def line(c: Tuple[str, str, str, str, str]) -> str:
        return f"{c[0]:<{w[0]}}  {c[1]:>{w[1]}}  {c[2]:<{w[2]}}  {c[3]:>{w[3]}}  {c[4]:>{w[4]}}"

    lines = [_SIM_BANNER] if report.get("meta", {}).get("driver") == "sim" else []
    lines.append(line(header))
    for r, c in zip(rows, cells):
        lines.append(line(c))
        e = r.get("extra") or {}
        if not r["skipped"] and "gpuptr" in e and "baseline" in e:  # the busy rows
            mine, other = e["gpuptr"], e["baseline"]
            lines.append(
                f"{'':{w[0]}}  median {mine['median_ns'] / 1e3:.1f} vs {other['median_ns'] / 1e3:.1f} us;"
                f" p99 {mine['p99_ns'] / 1e3:.1f} vs {other['p99_ns'] / 1e3:.1f} us;"
                f" worst {mine['worst_ns'] / 1e3:.1f} vs {other['worst_ns'] / 1e3:.1f} us;"
                f" kernel still running after the loop: {mine['busy']} / {other['busy']}"
            )
        if not r["skipped"] and "footprint" in e:
            f = e["footprint"]
            lines.append(
                f"{'':{w[0]}}  held {f['gpuptr']['peak_held'] / 2**20:.1f} vs {f['baseline']['peak_held'] / 2**20:.1f} MiB"
                f" for {f['gpuptr']['peak_live'] / 2**20:.1f} MiB live"
            )
        if not r["skipped"] and "probe" in e:
            p, g = e["probe"], e["gpuptr"]

            def us(k: str) -> str:
                return f"{p[k] / 1e3:.1f}"

            lines.append(
                f"{'':{w[0]}}  context retain+release with no other holder {us('retain_release_cold_ns')} us"
                f" (held: {us('retain_release_held_ns')}); cuMemHostAlloc 4 KiB/1 MiB {us('alloc_4k_ns')}/{us('alloc_1m_ns')} us"
                f" (portable {us('alloc_4k_portable_ns')}/{us('alloc_1m_portable_ns')}); cuMemFreeHost"
                f" {us('free_4k_ns')}/{us('free_1m_ns')} us (portable {us('free_4k_portable_ns')}/{us('free_1m_portable_ns')});"
                f" free while busy {us('free_while_busy_ns')} us, {us('busy_left_after_free_ns')} us of work left after it;"
                f" gpuptr's first pairs {', '.join(f'{x / 1e3:.0f}' for x in g['first_pairs_ns'])} us"
            )
    if reasons:
        lines.append("")
        lines.append("skipped:")
        for i, reason in enumerate(reasons, 1):
            count = sum(1 for r in rows if r["skipped"] and _reason(r["skipped"]) == reason)
            lines.append(f"  [{i}] {reason} ({count} row{'s' if count != 1 else ''})")
    return "\n".join(lines)


def plot(report: Dict[str, Any], path: str) -> None:
    """Two panels: the speed-up of each row, and the absolute time of both
    sides with the spread of their runs (bar: best run; line: best to worst)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows = [r for r in report["rows"] if not r["skipped"]]
    labels = [f"{r['row']}\nvs {r['baseline']}" for r in rows]
    fig, (ax, at) = plt.subplots(
        1, 2, figsize=(15, 0.6 * len(rows) + 1.8), sharey=True, gridspec_kw={"width_ratios": [1, 1.2]}
    )
    ys = list(range(len(rows)))
    ratios = [r["ratio"] for r in rows]
    ax.barh(ys, ratios, color=["#4a7" if x >= 1 else "#c54" for x in ratios])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(ys, labels, fontsize=7)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    for i, x in enumerate(ratios):
        ax.text(x, i, f" {x:.1f}×", va="center", fontsize=7)
    ax.set_xlabel(f"{SPEED_UP} (baseline time / gpuptr time)")

    h = 0.38
    for side, color, dy in (("gpuptr", "#4a7", -h / 2), ("baseline", "#888", h / 2)):
        best = [r[f"{side}_ns"] for r in rows]
        at.barh([y + dy for y in ys], best, height=h, color=color, label=side)
        for y, r in zip(ys, rows):
            runs = r.get(f"{side}_runs") or [r[f"{side}_ns"]]
            at.plot([min(runs), max(runs)], [y + dy, y + dy], color="k", lw=1)
            at.text(max(runs), y + dy, f" {_fmt_ns(r[f'{side}_ns'])}", va="center", fontsize=6)
    at.set_xscale("log")
    at.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _fmt_ns(v)))
    at.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    at.set_xlabel("time per operation (bar: best run; line: spread over the runs)")
    at.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"gpuptr on {report['meta']['device']} ({report['meta']['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _fmt_ns(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} µs"
    return f"{ns:.0f} ns"


def plot_formats() -> List[str]:
    """The file extensions ``--plot`` can write (matplotlib's formats)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())
