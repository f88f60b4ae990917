"""Figures of a plan, from the report the command line writes
(``chainer-recompute --out DIR``, or ``chainer-recompute plot report.json``).

- ``memory.png``: the memory of one training iteration, event by event, for
  plain backprop and for the plan (the timelines of
  :func:`~chainer_recompute.core.replay.replay`), with the budget as a line;
- ``schedule.png``: every function of the graph, in the order the forward
  runs them, its output's size as the bar's height, coloured by the plan's
  block, solid where its output is kept and pale where it is dropped and
  recomputed during the backward.

matplotlib is imported only when drawing (``pip install
'chainer-recompute[plot]'``); figures are drawn without pyplot, so nothing
here touches a global backend.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence, Tuple

from .core.errors import RecomputeError
from .core.units import format_bytes

__all__ = ["MissingMatplotlib", "ReportError", "load_report", "draw_report", "plot_memory",
           "plot_schedule", "REQUIRED_KEYS"]

#: The keys a report needs for drawing.
REQUIRED_KEYS = ("schema", "version", "graph", "budget", "plain", "plan", "timelines",
                 "schedule")


class MissingMatplotlib(RecomputeError, ImportError):
    """matplotlib is not installed."""


class ReportError(RecomputeError, ValueError):
    """A file is not a report this version can draw."""


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingMatplotlib("drawing needs matplotlib, which is not installed: pip install "
                                "'chainer-recompute[plot]' (or matplotlib)") from None
    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def load_report(path: str) -> Dict[str, Any]:
    """Read and check a report.json.

    Raises:
        ReportError: missing, unreadable, not JSON, or without the keys
            drawing needs (the message names them).
    """
    if not os.path.isfile(path):
        raise ReportError(f"{path}: no such file; accepted: a report.json written by "
                          f"chainer-recompute --out DIR (or --json PATH)")
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"{path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not JSON (line {e.lineno}: {e.msg}); accepted: a "
                          f"report.json written by chainer-recompute --out DIR") from None
    if not isinstance(report, dict):
        raise ReportError(f"{path}: not a chainer-recompute report (a JSON object is expected)")
    missing = [k for k in REQUIRED_KEYS if k not in report]
    if missing or report.get("schema") != "chainer-recompute report":
        raise ReportError(f"{path}: not a chainer-recompute report (missing "
                          f"{', '.join(missing) or 'the schema name'}); accepted: a report.json "
                          f"written by chainer-recompute --out DIR")
    if report["version"] != 1:
        raise ReportError(f"{path}: report version {report['version']} is not one this "
                          f"version draws (1)")
    return report


def draw_report(report: Dict[str, Any], out_dir: str) -> List[str]:
    """Write ``memory.png`` and ``schedule.png`` into ``out_dir``; return
    their paths."""
    paths = [os.path.join(out_dir, "memory.png"), os.path.join(out_dir, "schedule.png")]
    plot_memory(report, paths[0])
    plot_schedule(report, paths[1])
    return paths


def _unit(max_bytes: float) -> Tuple[str, float]:
    for name, scale in (("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10)):
        if max_bytes >= scale:
            return name, scale
    return "B", 1.0


def _title(report: Dict[str, Any]) -> str:
    g, src = report["graph"], report.get("source", {})
    name = src.get("model") or g.get("model") or os.path.basename(str(src.get("graph", "graph")))
    return f"{name}, batch {g.get('batch_size')}"


def plot_memory(report: Dict[str, Any], path: str) -> None:
    """memory.png: bytes over the events of one iteration, plain backprop
    and the plan, with the budget."""
    tl = report["timelines"]
    budget = report["budget"]
    plain, plan = tl["plain"], tl["plan"]
    top = max(max(plain["memory_bytes"], default=0), max(plan["memory_bytes"], default=0),
              budget.get("bytes") or 0)
    unit, scale = _unit(top)
    fig = _figure(10, 4.6)
    ax = fig.add_subplot()
    p = report["plan"]
    series = [("plain backprop", plain, "tab:gray"),
              (f"plan {p.get('solver')}/{p.get('strategy')}", plan, "tab:blue")]
    for label, t, colour in series:
        ys = [v / scale for v in t["memory_bytes"]]
        xs = list(range(len(ys)))
        ax.step(xs, ys, where="post", color=colour, lw=1.2,
                label=f"{label}: peak {format_bytes(t['peak_bytes'])}")
        if ys:
            k = max(range(len(ys)), key=ys.__getitem__)
            ax.plot([k], [ys[k]], "o", color=colour, ms=4)
        events = t.get("events") or []
        if "end of forward" in events:
            ax.axvline(events.index("end of forward"), color=colour, ls=":", lw=0.8)
    if budget.get("bytes"):
        text = budget["text"] if budget["text"] != "least" else "least feasible"
        note = "" if budget["scope"] == "total" else " (activations scope: not this curve)"
        ax.axhline(budget["bytes"] / scale, color="tab:red", ls="--", lw=1,
                   label=f"budget {text} = {format_bytes(budget['bytes'])}{note}")
    ax.set_xlabel("event of the iteration (forward, then backward; dotted: end of forward)")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{_title(report)}: memory over one training iteration "
                 f"({budget['scope']} scope)")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(path)


def plot_schedule(report: Dict[str, Any], path: str) -> None:
    """schedule.png: the graph's functions coloured by block, kept or
    recomputed."""
    sch = report["schedule"]
    sizes: Sequence[int] = sch["node_bytes"]
    blocks: Sequence[int] = sch["block"]
    recomputed = set(sch["recomputed"])
    n = len(sizes)
    unit, scale = _unit(max(sizes, default=0))
    fig = _figure(10, 4.2)
    ax = fig.add_subplot()
    try:
        from matplotlib import colormaps
        cmap = colormaps["tab10"]
    except ImportError:  # pragma: no cover - matplotlib < 3.5
        from matplotlib import cm
        cmap = cm.get_cmap("tab10")
    xs = list(range(n))
    heights = [s / scale for s in sizes]
    colours = [cmap(b % 10) for b in blocks]
    kept = [v for v in xs if v not in recomputed]
    dropped = [v for v in xs if v in recomputed]
    if kept:
        ax.bar(kept, [heights[v] for v in kept], width=1.0, color=[colours[v] for v in kept],
               edgecolor="none", label="kept (not recomputed)")
    if dropped:
        ax.bar(dropped, [heights[v] for v in dropped], width=1.0,
               color=[colours[v] for v in dropped], alpha=0.3, hatch="///", edgecolor="none",
               label="dropped in the forward, recomputed in the backward")
    starts = [v for v in range(1, n) if blocks[v] != blocks[v - 1]]
    for v in starts:
        ax.axvline(v - 0.5, color="black", lw=0.4, alpha=0.5)
    p = report["plan"]
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_xlabel("function, in forward order (vertical lines: block boundaries)")
    ax.set_ylabel(f"output size ({unit})")
    ax.set_title(f"{_title(report)}: {p.get('n_blocks')} blocks, {len(recomputed)} of {n} "
                 f"functions recomputed ({p.get('solver')}/{p.get('strategy')})")
    ax.legend(loc="upper right", fontsize=8)
    fig.savefig(path)
