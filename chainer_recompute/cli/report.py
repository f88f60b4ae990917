"""What the command prints and writes: the report's lines, the next
command to try, report.json and the figures."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any, Dict, List, Optional, Sequence

from ..core.units import format_bytes, format_bytes_up
from .args import PROG, UsageError, _argv_of
from .planning import _typed


def _pct(fraction: Optional[float]) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def format_report(report: Dict[str, Any]) -> str:
    """The lines the command prints: what was planned, the table, notes
    and the next command."""
    src = report.get("source", {})
    g = report["graph"]
    b = report["budget"]
    lines = []
    if "model" in src:
        cap = src.get("capture") or {}
        how = []
        if cap.get("capture_batch") and cap["capture_batch"] != src["batch_size"]:
            how.append(f"recorded at batch {cap['capture_batch']}, scaled")
        if cap.get("input_sizes"):
            how.append("input sizes " + ", ".join(str(s) for s in cap["input_sizes"])
                       + " extrapolated")
        took = f", {cap['capture_s']:.1f} s" if "capture_s" in cap else ""
        lines.append(f"{src['model']}{' (small)' if src.get('small') else ''}, batch "
                     f"{src['batch_size']}: {g['nodes']} functions, parameters "
                     f"{format_bytes(g['param_bytes'])}"
                     + (f" ({'; '.join(how)}{took})" if how else f" (recorded{took})"))
    else:
        lines.append(f"{src.get('graph', 'graph')}: {g['nodes']} functions, batch "
                     f"{g['batch_size']}"
                     + (" (the authors' format)" if src.get("format") == "authors" else ""))
    what = ("the whole iteration: parameters, gradients, optimizer state, activations, "
            "temporaries" if b["scope"] == "total" else
            "activations and their gradients (the paper's model); parameters, their "
            "gradients, optimizer state and temporaries come on top")
    budget = (f"least (= {format_bytes(b['bytes'])}, the least feasible)" if b["text"] == "least"
              else b["resolved"] if b.get("resolved")
              else f"{b['text']} (= {format_bytes(b['bytes'])})")
    lines.append(f"budget {budget} for {what}; solver {b['solver']}, strategy {b['strategy']}")
    if b.get("keep"):
        k = b["keep"]
        lines.append(f"kept by every plan (--keep): {', '.join(k['paths'])} "
                     f"({k['functions']} function{'' if k['functions'] == 1 else 's'})")
    lines.append("")
    runs = {r["label"]: r for r in report.get("runs", [])}
    measured = bool(runs)
    head = ["", "peak (predicted)"] + (["peak (measured)"] if measured else []) + \
        ["saving (predicted)", "recompute", "blocks", "solve"] + (["time/iter"] if measured
                                                                  else [])
    rows = []
    plain = report["plain"]
    vanilla = runs.get("vanilla")

    def meas(run: Optional[Dict[str, Any]]) -> List[str]:
        if not measured:
            return []
        return [format_bytes(run["measured_peak_bytes"]) if run and run.get(
            "measured_peak_bytes") is not None else "-"]

    def tcol(run: Optional[Dict[str, Any]]) -> List[str]:
        if not measured:
            return []
        if not run:
            return ["-"]
        text = f"{run['time_s']:.3f} s"
        if vanilla and run is not vanilla and vanilla["time_s"]:
            text += f" ({100 * (run['time_s'] / vanilla['time_s'] - 1):+.0f}%)"
        return [text]

    rows.append(["plain backprop", format_bytes(plain["predicted_peak_bytes"])] + meas(vanilla)
                + ["-", "0%", "1", "-"] + tcol(vanilla))
    plan = report["plan"]
    label = "plan at the least feasible budget" if b["text"] == "least" else f"plan for {b['text']}"
    rows.append([label, format_bytes(plan["predicted_peak_bytes"])] + meas(None)
                + [_pct(plan["saving_fraction"]), _pct(plan["overhead_fraction"])
                   if plan["recompute"] else "0%",
                   str(plan["n_blocks"]), f"{plan['solve_time_s']:.2f} s"] + tcol(None))
    for name, run in runs.items():
        rp = run.get("plan")
        if name == "vanilla" or not rp:
            continue
        pred = rp.get("predicted_peak_bytes")
        saving = (1.0 - pred / plain["predicted_peak_bytes"]
                  if pred and plain["predicted_peak_bytes"] else None)
        rows.append([f"  as run ({name})", format_bytes(pred) if pred else "-"] + meas(run)
                    + [_pct(saving), _pct(rp.get("overhead_fraction")) if rp.get("recompute")
                       else "0%", str(rp.get("n_blocks")), f"{rp.get('solve_time_s') or 0:.2f} s"]
                    + tcol(run))
    least = report.get("least")
    if least is not None and b["text"] != "least":
        rows.append([f"least feasible ({format_bytes_up(least['budget_bytes'])})",
                     format_bytes(least["predicted_peak_bytes"])] + (["-"] if measured else [])
                    + [_pct(least["saving_fraction"]), _pct(least["overhead_fraction"])
                       if least["recompute"] else "0%", str(least["n_blocks"]),
                       f"{least['solve_time_s']:.2f} s"] + (["-"] if measured else []))
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    for r in [head] + rows:
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(r)).rstrip())
    lines.append("")
    lines.append("saving: against plain backprop's predicted peak; recompute: extra forward "
                 f"work in % of one forward ({g['cost_model']} costs)")
    floor = report.get("floor")
    if floor is not None:
        lines.append(f"physical floor: {format_bytes(floor['peak_bytes'])}, below which no "
                     f"schedule goes, recomputing at any depth: parameters, optimizer state and "
                     f"inputs {format_bytes(floor['state_bytes'])}, the gradients alive then "
                     f"{format_bytes(floor['held_grad_bytes'])} and "
                     f"{format_bytes(floor['working_bytes'])} that {floor['event']} needs itself "
                     f"(the least feasible budget recomputes each array once)")
    nest = plan.get("nested")
    if nest:
        lines.append(
            f"nested plan (below the single-level least"
            f"{'' if least is None else ' ' + format_bytes_up(least['budget_bytes'])}): "
            f"{nest.get('depth', 2)} levels, {nest['outer_blocks']} outer blocks over "
            f"{nest['fine_blocks']} fine blocks, "
            f"{nest['outer_checkpoints']} checkpoints kept through the forward, "
            f"{nest['inner_checkpoints']} kept once regenerated; it recomputes "
            f"{_pct(plan['overhead_fraction'])} of a forward"
            + ("" if least is None else
               f" (the single-level least: {_pct(least['overhead_fraction'])})"))
    if plan.get("reordered"):
        lines.append("its backward runs in another order than Chainer's, with the same "
                     "gradients (docs/algorithm.md §10)")
    if not plan["recompute"]:
        lines.append(f"plain backprop fits in {b['text']}: the plan recomputes nothing.")
    if b["text"] == "least" and b["scope"] == "total" \
            and b["bytes"] > plain["predicted_peak_bytes"]:
        from ..core.budget import MARGIN, least_for
        need = least_for(plain["predicted_peak_bytes"])
        lines.append(f"the least feasible budget is above plain backprop's predicted peak: a "
                     f"total budget keeps {100 * MARGIN:.0f}% of headroom for what the replay "
                     f"does not see, and no plan saves that much here (plain backprop needs "
                     f"{format_bytes_up(need)} of budget).")
    if b["scope"] == "activations":
        lines.append(f"the whole iteration, replayed: plain backprop "
                     f"{format_bytes(plain['replayed_peak_bytes'])}, the plan "
                     f"{format_bytes(plan['replayed_peak_bytes'])} (--budget-scope total "
                     f"bounds that figure)")
    if measured:
        lines.append("as run: the plan apply() made from its own recording of the model "
                     "(first iteration recorded, second planned), measured over the later ones; "
                     "plain backprop over all but the first")
    for name, run in runs.items():
        rp = run.get("plan") or {}
        if name == "vanilla" or not vanilla or not vanilla.get("measured_peak_bytes") \
                or not run.get("measured_peak_bytes"):
            continue
        before, after = vanilla["measured_peak_bytes"], run["measured_peak_bytes"]
        text = (f"measured against plain Chainer ({name}): peak {format_bytes(before)} -> "
                f"{format_bytes(after)}, {100 * (1 - after / before):.0f}% less")
        if vanilla.get("time_s") and run.get("time_s"):
            text += f", time per iteration {100 * (run['time_s'] / vanilla['time_s'] - 1):+.0f}%"
        pred = rp.get("predicted_peak_bytes")
        if pred and plain["predicted_peak_bytes"]:
            # the prediction of the very plan that ran, said as such
            text += (f"; predicted for that plan: "
                     f"{100 * (1 - pred / plain['predicted_peak_bytes']):.0f}% less")
            if rp.get("recompute") is False and plan["recompute"]:
                text += (f" (it recomputes nothing: plain Chainer fits in its budget; the "
                         f"'{label}' row's {_pct(plan['saving_fraction'])} is this command's "
                         f"own plan)")
        if rp.get("budget_bytes"):
            ran = format_bytes(rp["budget_bytes"])
            text += (f"; apply() planned for {ran}"
                     + (" (its own least feasible budget)" if b["text"] == "least" else ""))
            if after > rp["budget_bytes"]:
                text += " - the measured peak is OVER that budget"
        lines.append(text)
    if "gradients_identical" in report:
        lines.append(f"loss and gradients identical to plain backprop: "
                     f"{report['gradients_identical']}")
    if report.get("next_command"):
        lines.append(f"next: {report['next_command']}")
    return "\n".join(lines)


#: a run of the full network is suggested after a dry run when its
#: iterations (plain Chainer and the plan, as recorded) should take less.
QUICK_RUN_S = 60.0


def _next_command(args: argparse.Namespace, report: Dict[str, Any]) -> str:
    """The next command to try, consistent with what this one planned or
    measured: a budget where the plan recomputes something, a measurement
    at a batch where that budget still matters, the API call after a run
    whose plan saved memory."""
    base = [PROG] + [a for a in _argv_of(args)]
    plan, least, b = report["plan"], report.get("least"), report["budget"]
    batch = report.get("source", {}).get("batch_size") or report["graph"].get("batch_size")
    budget_text = b["text"] if b["text"] != "least" else _typed(b["bytes"])
    least_typed = _typed(least["budget_bytes"]) if least is not None else None

    def cmd(replace_budget: Optional[str] = None, extra: Sequence[str] = (),
            drop: Sequence[str] = ()) -> str:
        argv = list(base)
        if replace_budget is not None:
            i = argv.index("--budget")
            argv[i + 1] = replace_budget
        for flag in drop:  # a flag and its value
            if flag in argv:
                i = argv.index(flag)
                del argv[i:i + 2]
        return " ".join(shlex.quote(a) for a in argv + list(extra))

    if args.iterations:
        runs = [r for r in report.get("runs", []) if r["label"] != "vanilla"]
        ran = runs[0].get("plan") if runs else None
        if ran is not None and not ran.get("recompute"):
            # the plan as run recomputed nothing: plain Chainer fits in the
            # budget at this batch, so the run measured no saving
            if least is not None and least["recompute"] and b["text"] != "least":
                again = ["--iterations", str(args.iterations)] + (["--vanilla"] if args.vanilla
                                                                  else [])
                return (f"{cmd(least_typed, again)}   # plain Chainer fits in {budget_text} at "
                        f"batch {batch}, so nothing was recomputed; at the least feasible "
                        f"budget the plan recomputes ({_pct(least['saving_fraction'])} less "
                        f"predicted)")
            return (f"{cmd(extra=['--dry-run'], drop=['--batch-size'])} --batch-size "
                    f"{2 * int(batch or 1)}   # plain Chainer fits in {budget_text} at batch "
                    f"{batch}: nothing to recompute; plan a larger batch first")
        return (f"in a training script: model = chainer_recompute.apply(model, "
                f"budget={budget_text!r}) (PrintReport can show chainer_recompute.extensions."
                f"RecomputeReport's keys)")
    if not plan["recompute"] and least is not None and least["recompute"]:
        dry = ["--dry-run"] if args.dry_run else []
        return (f"{cmd(least_typed, dry)}   # {b['text']} holds plain backprop here; the least "
                f"feasible budget: {_pct(least['saving_fraction'])} less than plain backprop "
                f"(predicted)")
    if args.graph:
        return cmd(extra=["--out", "plan"]) + "   # memory.png, schedule.png, tradeoff.png"
    run = ["--iterations", "3", "--vanilla"]
    if args.small or args.model in ("mlp",):
        return cmd(extra=run) + "   # measure this plan against plain Chainer"
    # the full network: measure this very plan where that is quick and fits
    from .preflight import available_memory
    iteration_s = report["graph"].get("iteration_s")
    avail = available_memory(args.device)[0]
    need = report["plain"]["replayed_peak_bytes"] + plan["replayed_peak_bytes"]
    if iteration_s is not None and 3 * 2 * iteration_s < QUICK_RUN_S and (
            avail is None or need < avail):
        return (cmd(extra=run) + f"   # measure this plan against plain Chainer (about "
                f"{iteration_s:.1f} s per iteration, as recorded)")
    # else the reduced network at a small batch: a size chosen for this
    # network would hold plain backprop there, so at its own least budget
    return (cmd("least", ["--small", "--batch-size", "4"] + run, drop=["--batch-size"])
            + f"   # measure a plan against plain Chainer on the reduced network at batch 4, "
              f"at its own least feasible budget ({budget_text} is sized for {args.model} at "
              f"batch {batch}; the full network is slow on a CPU)")


def _write_json(report: Dict[str, Any], path: str) -> None:
    try:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=_json_default)
    except OSError as e:
        raise UsageError(f"cannot write {path} ({e.strerror})") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _draw(report: Dict[str, Any], out_dir: str) -> List[str]:
    from ..plotting import MissingMatplotlib, draw_report
    try:
        return draw_report(report, out_dir)
    except MissingMatplotlib as e:
        print(f"note: {e}", file=sys.stderr)
        return []
