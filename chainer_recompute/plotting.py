"""Figures of a plan, from the report the command line writes
(``chainer-recompute --out DIR``, or ``chainer-recompute plot report.json``).

- ``memory.png``: the memory of one training iteration, event by event, for
  plain backprop and for the plan (the timelines of
  :func:`~chainer_recompute.core.replay.replay`), with the budget as a line;
  plain backprop is drawn even where the plan is plain backprop;
- ``schedule.png``: every function of the graph, in the order the forward
  runs them, its output's size as the bar's height, solid where its output
  is kept and hatched where it is dropped and recomputed during the
  backward, under the names of the links that applied them (grouped by
  their path: ``res2``, ``res3``, ...); below, per link group, the bytes
  kept and recomputed, the functions recomputed and the plan's blocks;
- ``tradeoff.png``: the budget against the recompute overhead, from plain
  backprop down to the least feasible budget, from the plans the budget
  search made (:meth:`~chainer_recompute.core.budget.BudgetSearch.tradeoff`),
  the chosen budget marked.

matplotlib is imported only when drawing (``pip install
'chainer-recompute[plot]'``); figures are drawn without pyplot, so nothing
here touches a global backend. Each ``plot_*`` returns its Figure.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .core.errors import RecomputeError
from .core.units import format_bytes

__all__ = ["MissingMatplotlib", "ReportError", "load_report", "draw_report", "plot_memory",
           "plot_schedule", "plot_tradeoff", "link_groups", "REQUIRED_KEYS"]

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
    """Write ``memory.png``, ``schedule.png`` and (for reports that carry
    the trade-off) ``tradeoff.png`` into ``out_dir``; return their paths."""
    paths = [os.path.join(out_dir, "memory.png"), os.path.join(out_dir, "schedule.png")]
    plot_memory(report, paths[0])
    plot_schedule(report, paths[1])
    if report.get("tradeoff"):
        paths.append(os.path.join(out_dir, "tradeoff.png"))
        plot_tradeoff(report, paths[2])
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


def _plan_name(report: Dict[str, Any]) -> str:
    p = report["plan"]
    return f"{p.get('solver')}/{p.get('strategy')}"


def _budget_text(budget: Dict[str, Any]) -> str:
    text = budget["text"] if budget["text"] != "least" else "least feasible"
    return f"{text} = {format_bytes(budget['bytes'])}"


def plot_memory(report: Dict[str, Any], path: Optional[str] = None) -> Any:
    """memory.png: bytes over the events of one iteration, plain backprop
    and the plan, with the budget. Plain backprop is drawn wide and pale
    under the plan, so that both show where they coincide (a budget plain
    backprop fits). Returns the Figure."""
    tl = report["timelines"]
    budget = report["budget"]
    plain, plan = tl["plain"], tl["plan"]
    top = max(max(plain["memory_bytes"], default=0), max(plan["memory_bytes"], default=0),
              budget.get("bytes") or 0)
    unit, scale = _unit(top)
    fig = _figure(10, 4.6)
    ax = fig.add_subplot()
    p = report["plan"]
    same = not p.get("recompute") or plan["memory_bytes"] == plain["memory_bytes"]
    plan_label = (f"plan {_plan_name(report)}" + (": plain backprop (nothing recomputed), "
                                                   "on the plain curve" if same else ""))
    series = [("plain backprop (plain Chainer)", plain, "tab:gray", 4.0 if same else 1.2,
               0.45 if same else 1.0),
              (plan_label, plan, "tab:blue", 1.2, 1.0)]
    for label, t, colour, lw, alpha in series:
        ys = [v / scale for v in t["memory_bytes"]]
        xs = list(range(len(ys)))
        ax.step(xs, ys, where="post", color=colour, lw=lw, alpha=alpha,
                label=f"{label}: peak {format_bytes(t['peak_bytes'])}")
        if ys:
            k = max(range(len(ys)), key=ys.__getitem__)
            ax.plot([k], [ys[k]], "o", color=colour, ms=4 if lw < 2 else 7, alpha=alpha)
        events = t.get("events") or []
        if "end of forward" in events:
            ax.axvline(events.index("end of forward"), color=colour, ls=":", lw=0.8)
    if budget.get("bytes"):
        note = "" if budget["scope"] == "total" else " (activations scope: not this curve)"
        ax.axhline(budget["bytes"] / scale, color="tab:red", ls="--", lw=1,
                   label=f"budget {_budget_text(budget)}{note}")
    ax.set_xlabel("event of the iteration (forward, then backward; dotted: end of forward)")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{_title(report)}: memory over one training iteration "
                 f"({budget['scope']} scope)")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    if path is not None:
        fig.savefig(path)
    return fig


def link_groups(links: Sequence[str], max_groups: int = 12,
                min_share: float = 1 / 60) -> List[Tuple[str, int, int]]:
    """The functions, in forward order, in contiguous groups named by the
    link path that applied them (``Node.link``), as deep as keeps at most
    ``max_groups`` groups (and no deeper than splits them further): below
    the path all functions share
    (``/predictor``), the first component (``res2``, ``res3``), then two
    (``res2/a``), and so on. A function applied above that depth (a ReLU in
    the model's own forward, the loss: by a link that contains others)
    joins the group before it;
    consecutive groups of fewer than ``min_share`` of the functions are
    shown as one (``conv1 + bn1``).

    Returns:
        ``(name, start, stop)`` for each group, covering ``range(len(links))``;
        one group named ``''`` when no function names its link.

    >>> link_groups(['/p/c1', '/p/b1', '/p', '/p/r2/a/c', '/p/r2/b/c', '/p/r3/a/c', '/'],
    ...             max_groups=4, min_share=0)
    [('c1', 0, 1), ('b1', 1, 3), ('r2', 3, 5), ('r3', 5, 7)]
    """
    n = len(links)
    if n == 0:
        return []
    parts = [[c for c in link.split("/") if c] if link else None for link in links]
    known = [p for p in parts if p]
    if not known:
        return [("/" if any(links) else "", 0, n)]
    prefix: List[str] = []
    for comps in zip(*known):
        if any(c != comps[0] for c in comps):
            break
        prefix.append(comps[0])
    k = len(prefix)
    deepest = max(len(p) for p in known) - k
    if deepest <= 0:
        return [("/".join(prefix), 0, n)]
    containers = {tuple(p[:j]) for p in known for j in range(len(p))}
    best: List[List[Any]] = []
    for depth in range(1, deepest + 1):
        runs = _link_runs(parts, prefix, depth, containers)
        if best and len(runs) > max_groups:
            break
        if len(runs) > len(best):  # (a deeper cut that splits nothing: shorter names)
            best = runs
    # consecutive small groups shown as one
    out: List[List[Any]] = []
    small = max(1.0, min_share * n)
    for name, a, b in best:
        if out and b - a < small and out[-1][2] - out[-1][1] < small and out[-1][3]:
            out[-1][0].append(name)
            out[-1][2] = b
        else:
            out.append([[name], a, b, b - a < small])
    return [(_joined(names), a, b) for names, a, b, _ in out]


def _link_runs(parts: Sequence[Optional[List[str]]], prefix: List[str], depth: int,
               containers: Any) -> List[List[Any]]:
    """Runs of equal keys: a link's path below ``prefix`` cut at ``depth``;
    none (joins the run before) for a link that contains others and is not
    that deep."""
    k = len(prefix)
    runs: List[List[Any]] = []
    for v, p in enumerate(parts):
        key = None
        if p is not None and p[:k] == prefix and len(p) > k and (
                len(p) >= k + depth or tuple(p) not in containers):
            key = "/".join(p[k:k + depth])
        if key is None or (runs and runs[-1][0] == key):
            if runs:
                runs[-1][2] = v + 1
            continue
        runs.append([key, v, v + 1])
    if runs:
        runs[0][1] = 0
    return runs


def _joined(names: List[str]) -> str:
    return " + ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]}"


def layer_names(links: Sequence[str], ops: Sequence[str]) -> List[str]:
    """Each function's layer, as the schedule's per-layer panel counts
    them: the last name of its link's path (``conv1`` for
    ``/predictor/res3/b2/conv1``) where that link contains no other, else
    the function's own name (a ReLU or an Add in a block's own forward, the
    loss in the model's).

    >>> layer_names(['/p/a/conv1', '/p/a', '/', ''], ['Conv', 'ReLU', 'Loss', 'Sum'])
    ['conv1', 'ReLU', 'Loss', 'Sum']
    """
    containers = {link.rsplit("/", 1)[0] for link in links if link}
    return [link.rsplit("/", 1)[-1] if link and link != "/" and link not in containers else op
            for link, op in zip(links, ops)]


def _hbars(ax: Any, names: Sequence[str], kept: Sequence[float], rec: Sequence[float],
           notes: Sequence[str], xlabel: str) -> None:
    rows = list(range(len(names)))
    ax.barh(rows, kept, color=_KEPT, height=0.7)
    ax.barh(rows, rec, left=kept, color=_RECOMPUTED, height=0.7)
    right = max((x + y for x, y in zip(kept, rec)), default=0) or 1
    for r, x, y, note in zip(rows, kept, rec, notes):
        ax.text(x + y + 0.015 * right, r, note, va="center", fontsize=7)
    ax.set_yticks(rows)
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, right * 1.6)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.grid(axis="x", alpha=0.3)


_KEPT, _RECOMPUTED = "tab:blue", "tab:orange"
#: The per-layer panel's rows: the layers with the most functions.
MAX_LAYER_ROWS = 16


def plot_schedule(report: Dict[str, Any], path: Optional[str] = None) -> Any:
    """schedule.png: the graph's functions in forward order under the names
    of the links that applied them (:func:`link_groups`), kept or
    recomputed; below, per link group the bytes kept and recomputed, and per
    layer (:func:`layer_names`) the functions kept and recomputed. Returns
    the Figure."""
    sch = report["schedule"]
    sizes: Sequence[int] = sch["node_bytes"]
    blocks: Sequence[int] = sch["block"]
    recomputed = set(sch["recomputed"])
    n = len(sizes)
    links = sch.get("links") or [""] * n
    named = any(links)
    groups = link_groups(links) if named else [
        ("all functions (this graph names no links)", 0, n)]
    layers = layer_names(links, sch.get("ops") or ["?"] * n)
    counts: Dict[str, List[int]] = {}
    for v, name in enumerate(layers):
        counts.setdefault(name, [0, 0])[v in recomputed] += 1
    order = sorted(counts, key=lambda k: -sum(counts[k]))
    if len(order) > MAX_LAYER_ROWS:
        rest = order[MAX_LAYER_ROWS - 1:]
        counts["others"] = [sum(counts[k][0] for k in rest), sum(counts[k][1] for k in rest)]
        order = order[:MAX_LAYER_ROWS - 1] + ["others"]
    unit, scale = _unit(max(sizes, default=0))
    lower_rows = max(len(groups), len(order))
    fig = _figure(12, 4.6 + 0.25 * lower_rows)
    grid = fig.add_gridspec(2, 2, height_ratios=[3.2, 0.8 + 0.25 * lower_rows])
    top = fig.add_subplot(grid[0, :])
    xs = list(range(n))
    heights = [s / scale for s in sizes]
    kept = [v for v in xs if v not in recomputed]
    dropped = [v for v in xs if v in recomputed]
    if kept:
        top.bar(kept, [heights[v] for v in kept], width=1.0, color=_KEPT, edgecolor="none",
                label="kept from the forward to the backward")
    if dropped:
        top.bar(dropped, [heights[v] for v in dropped], width=1.0, color=_RECOMPUTED,
                edgecolor="none", label="dropped in the forward, recomputed in the backward")
    for v in range(1, n):
        if blocks[v] != blocks[v - 1]:
            top.axvline(v - 0.5, color="0.55", lw=0.3, alpha=0.6)
    for j, (_, a, b) in enumerate(groups):
        if j % 2:
            top.axvspan(a - 0.5, b - 0.5, color="0.92", zorder=0, lw=0)
        if a:
            top.axvline(a - 0.5, color="black", lw=0.9)
    top.set_xlim(-0.5, n - 0.5)
    top.set_ylim(0, max(heights, default=1) * 1.25 or 1)
    top.set_xticks([(a + b - 1) / 2 for _, a, b in groups])
    names = [g[0] for g in groups]
    fits = all((b - a) / max(n, 1) * 10.5 > 0.075 * len(name) + 0.1 for name, a, b in groups)
    top.set_xticklabels(names, rotation=0 if fits else 30, ha="center" if fits else "right",
                        fontsize=8)
    top.tick_params(axis="x", length=0)
    top.set_xlabel("functions in forward order, under the links that applied them (grey "
                   "lines: the plan's block boundaries)", fontsize=8)
    top.set_ylabel(f"output size ({unit})")
    p = report["plan"]
    top.set_title(f"{_title(report)}: plan {_plan_name(report)}, {p.get('n_blocks')} blocks; "
                  f"{len(recomputed)} of {n} functions recomputed")
    top.legend(loc="upper right", fontsize=8)
    # per link group: bytes kept and recomputed
    kept_b, rec_b, notes = [], [], []
    for name, a, b in groups:
        kept_b.append(sum(sizes[v] for v in range(a, b) if v not in recomputed) / scale)
        rec_b.append(sum(sizes[v] for v in range(a, b) if v in recomputed) / scale)
        k = sum(1 for v in range(a, b) if v in recomputed)
        nb = len({blocks[v] for v in range(a, b)})
        notes.append(f"{k} of {b - a} recomputed, {nb} block{'s' if nb != 1 else ''}")
    by_group = fig.add_subplot(grid[1, 0])
    _hbars(by_group, names if named else ["all functions"], kept_b, rec_b, notes,
           f"per link group: output bytes kept (blue), recomputed (orange), {unit}")
    by_layer = fig.add_subplot(grid[1, 1])
    _hbars(by_layer, order, [counts[k][0] for k in order], [counts[k][1] for k in order],
           [f"{counts[k][0]} kept, {counts[k][1]} recomputed" for k in order],
           "per layer (its link's name, or the function's): functions kept (blue), "
           "recomputed (orange)")
    if path is not None:
        fig.savefig(path)
    return fig


def plot_tradeoff(report: Dict[str, Any], path: Optional[str] = None) -> Any:
    """tradeoff.png: the budget against the recompute overhead, from plain
    backprop down to the least feasible budget (the least overhead each
    budget can have among the plans the search made), the chosen budget
    marked. Returns the Figure.

    Raises:
        ReportError: the report has no trade-off (written by an older
            version: plan again to draw it).
    """
    tr = report.get("tradeoff")
    if not tr or not tr.get("points"):
        raise ReportError("this report has no trade-off (written by an older version); "
                          "plan again with --out to draw tradeoff.png")
    pts = sorted(tr["points"], key=lambda q: q["budget_bytes"])
    budget, p = report["budget"], report["plan"]
    chosen_b = budget.get("bytes") or p.get("budget_bytes") or pts[0]["budget_bytes"]
    chosen_o = 100 * (p.get("overhead_fraction") or 0.0) if p.get("recompute") else 0.0
    hi = max(pts[-1]["budget_bytes"], chosen_b)
    unit, scale = _unit(hi)
    xs = [q["budget_bytes"] / scale for q in pts]
    ys = [100 * q["overhead_fraction"] for q in pts]
    fig = _figure(9, 4.8)
    ax = fig.add_subplot()
    right = max(hi / scale, xs[-1]) + 0.06 * (max(hi / scale, xs[-1]) - xs[0] or xs[-1])
    ax.step(xs + [right], ys + [ys[-1]], where="post", color="tab:blue", lw=1.4,
            label=f"least recompute for each budget, among the {tr.get('tried')} plans the "
                  f"search made")
    ax.plot(xs, ys, "o", color="tab:blue", ms=3)
    least, plain = pts[0], pts[-1]
    left = xs[0] - 0.06 * (right - xs[0])
    ax.axvspan(left, xs[0], color="0.85", lw=0, label="below the least feasible budget")
    ax.plot([xs[0]], [ys[0]], "s", color="tab:purple", ms=7,
            label=f"least feasible: {format_bytes(least['budget_bytes'])}, "
                  f"{ys[0]:.0f}% recompute")
    if not plain["recompute"]:
        ax.plot([xs[-1]], [ys[-1]], "D", color="tab:gray", ms=7,
                label=f"plain backprop: needs {format_bytes(plain['budget_bytes'])}, 0%")
    ax.axvline(chosen_b / scale, color="tab:red", ls="--", lw=1)
    ax.plot([chosen_b / scale], [chosen_o], "*", color="tab:red", ms=14,
            label=f"chosen budget {_budget_text(budget)}: "
                  + (f"{chosen_o:.0f}% recompute ({p.get('n_blocks')} blocks)"
                     if p.get("recompute") else "plain backprop, 0%"))
    ax.set_xlim(left, right)
    ax.set_ylim(bottom=0, top=max(ys + [chosen_o, 1.0]) * 1.12)
    what = ("total budget: parameters, gradients, optimizer state, activations, temporaries"
            if tr.get("scope", budget["scope"]) == "total" else
            "activations budget (the paper's model)")
    ax.set_xlabel(f"{what} ({unit})")
    ax.set_ylabel("recompute overhead (extra forward work, % of one forward)")
    ax.set_title(f"{_title(report)}: memory against recomputation ({_plan_name(report)}, "
                 f"{report['graph'].get('cost_model')} costs)")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    if path is not None:
        fig.savefig(path)
    return fig
