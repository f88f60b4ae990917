"""Planning at scale: planning time against graph size for the
hierarchical DP (``solver='hier'``, what ``solver='auto'`` picks on graphs
of 1,000+ functions with repeated segments) beside the flat approximate
and exact DPs, and ``apply()`` on a 48-layer Transformer encoder and a
t = 1000 LSTM against plain Chainer.

Usage (from the repository root):

    .venv/bin/python experiments/planning_scale.py [--cap-s 600] [--quick]
        [--json experiments/planning_scale.json] > experiments/planning_scale.md

Graphs:

- transformer-like DAGs (``Graph.from_edges``, 12 nodes a layer with
  residual edges, the paper's cost and memory model) of 6-384 layers, and
  one of 4,166 layers (50,000 nodes);
- a Chainer Transformer encoder (``chainer_recompute.models.transformer``:
  multi-head attention, layer norm, dropout) of 6, 24 and 48 layers and
  ``LSTMLanguageModel`` (two LSTM layers unrolled inside ``forward``) at
  t = 100, 1000 and 3000, captured here (measured times);
- the paper's seven networks (the authors' files in ../shared/graphs and
  the captured ones in experiments/graphs).

For each graph and solver, in its own process (warm: NumPy, numba and the
compiled kernels loaded before the clock starts): the least feasible
budget (activations scope, the paper's memory model), found by the
solver's own search, and one solve at the mid budget, halfway between the
hierarchical DP's least budget and plain backprop; the time is the sum of
both, the figure the issue's targets are about. A flat solver is stopped
after ``--cap-s`` seconds (600 in the issue; the exact DP also stops at
its lower-set limit).

``apply()`` runs: plain Chainer and ``cr.apply(model, budget)`` (default
solver ``auto``, total scope) for 3 steps each from the same seed, at the
least budget and at a mid budget (the loop lets go of its loss after the
update, as Chainer's StandardUpdater does); the first applied call records and plans
at the end of its backward (planning time: the runner's own clock, from the
recorded graph to the plan and its release mode; the call's wall time less
a plain first step's is given beside it), losses, gradients and
parameters are compared bit for bit, and the runner's measured peak is
compared with its budget.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Flat solvers are not run above these sizes: the approximate DP's family
#: alone is n² bits four times over (1.2 GB at 50,000 nodes) and its DP is
#: quadratic in n (the issue measured 35 minutes at t = 1000); the exact
#: DP's enumeration holds up to 2,000,000 sets of n bits before it stops.
APPROX_MAX_N = 20_000
EXACT_MAX_N = 2_500
PAPER = ["vgg19", "resnet50", "unet", "densenet", "resnet152", "pspnet", "googlenet"]


# ------------------------------------------------------------------ graphs
def transformer_like(layers: int):
    """12 nodes a layer: layer norm, q/k/v, scores, softmax, context,
    projection, residual add, two feed-forward nodes, residual add; a loss."""
    from chainer_recompute.core.graph import Graph
    sizes: List[int] = [4]
    edges = []
    x = 0
    for _ in range(layers):
        b = len(sizes)
        sizes += [4, 4, 4, 4, 8, 8, 4, 4, 4, 16, 4, 4]
        ln, q, k, v, s, sm, c, p, r, f1, f2, out = range(b, b + 12)
        edges += [(x, ln), (ln, q), (ln, k), (ln, v), (q, s), (k, s), (s, sm), (sm, c),
                  (v, c), (c, p), (x, r), (p, r), (r, f1), (f1, f2), (r, out), (f2, out)]
        x = out
    sizes.append(1)
    edges.append((x, len(sizes) - 1))
    return Graph.from_edges(sizes, edges)


def _lstm(t: int, seed: int = 0):
    import numpy as np
    from chainer_recompute.models.small import LSTMLanguageModel
    np.random.seed(seed)
    model = LSTMLanguageModel(n_vocab=1000, n_units=64)
    xs = np.random.RandomState(seed + 1).randint(0, 1000, (8, t)).astype(np.int32)
    return model, (xs, np.roll(xs, -1, axis=1))


def _encoder(layers: int, seed: int = 0):
    from chainer_recompute.models.transformer import make_encoder
    return make_encoder(layers, seed=seed, batch=8, length=32)


def load_case(spec: str):
    """A graph from its spec: ``tl:<layers>``, ``file:<path>``,
    ``authors:<path>``."""
    kind, _, arg = spec.partition(":")
    if kind == "tl":
        return transformer_like(int(arg))
    if kind == "file":
        from chainer_recompute.core.io import load_graph
        return load_graph(arg)
    if kind == "authors":
        from chainer_recompute.core.io import load_authors_graph
        return load_authors_graph(arg)
    raise ValueError(spec)


# ------------------------------------------------------------------ worker
def worker(spec: str, solver: str, mid: Optional[int]) -> Dict[str, Any]:
    """One graph, one solver: least budget search and one mid solve."""
    import chainer_recompute as cr
    from chainer_recompute.core.graph import Graph
    from chainer_recompute.core.search import least_feasible_budget, vanilla_bytes
    from chainer_recompute.core.solvers._dp import _load_kernels, numba_available
    from chainer_recompute.core.solvers.hier_dp import hier_problem
    if numba_available():  # warm: kernels loaded, the chain DP compiled
        _load_kernels()
        w = Graph.from_edges([4] * 40, [(i, i + 1) for i in range(39)])
        cr.solve(w, least_feasible_budget(w, "hier") + 8, solver="hier")
    t0 = time.perf_counter()
    g = load_case(spec)
    t_load = time.perf_counter() - t0
    out: Dict[str, Any] = {"n": g.n, "load_s": t_load}
    t0 = time.perf_counter()
    # held for both calls, as plan_for_budget's BudgetSearch holds it
    prob = hier_problem(g) if solver == "hier" else None
    try:
        least = least_feasible_budget(g, solver)
    except cr.LowerSetExplosionError as e:
        return dict(out, error=f"lower-set limit ({str(e).split(';')[0][:60]})")
    t1 = time.perf_counter()
    van = vanilla_bytes(g)
    b = mid if mid is not None else (least + van) // 2
    plan = cr.solve(g, b, solver=solver, raise_infeasible=False)
    t2 = time.perf_counter()
    out.update(least=int(least), vanilla=int(van), mid=int(b), least_s=t1 - t0,
               mid_s=t2 - t1, total_s=t2 - t0, feasible=bool(plan.feasible),
               overhead=plan.overhead_fraction, blocks=plan.n_blocks,
               peak=plan.predicted_peak_bytes)
    if prob is not None:
        out.update(hier=bool(prob.ok), positions=len(prob.cuts) - 1,
                   pieces=getattr(prob, "n_distinct_pieces", None),
                   segments=None if prob.segments is None else
                   [prob.segments.period, prob.segments.count])
    return out


def run_worker(spec: str, solver: str, mid: Optional[int], cap_s: float) -> Dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", spec, solver]
    if mid is not None:
        cmd += ["--mid", str(mid)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=cap_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"> {cap_s:.0f} s (stopped)"}
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["failed"])[-1][:120],
                "wall_s": time.perf_counter() - t0}
    return json.loads(p.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ apply
def apply_check(name: str, make, steps: int = 3) -> Dict[str, Any]:
    """Plain against applied (auto solver, total scope) at the least budget
    and at a mid budget: planning time, bit-identity, measured peak."""
    import numpy as np
    import chainer
    import chainer_recompute as cr
    from chainer_recompute.core.budget import BudgetSearch
    from chainer_recompute.runtime.capture import capture

    def train(budget):
        model, (xs, ts) = make()
        opt = chainer.optimizers.SGD(lr=0.1)
        opt.setup(model)
        if budget is not None:
            cr.apply(model, budget, verbose=False)
        rec, walls = [], []
        for step in range(steps):
            np.random.seed(100 + step)
            model.cleargrads()
            t0 = time.perf_counter()
            loss = model(xs, ts)
            loss.backward()
            walls.append(time.perf_counter() - t0)
            rec.append((loss.array.tobytes(),
                        [p.grad.tobytes() for _, p in sorted(model.namedparams())]))
            opt.update()
            rec[-1] += ([p.array.tobytes() for _, p in sorted(model.namedparams())],)
            loss = None  # as StandardUpdater: the graph is gone before the next forward
        runner = cr.runner_of(model) if budget is not None else None
        return rec, walls, runner

    plain, pwalls, _ = train(None)
    model, (xs, ts) = make()
    g = capture(model, xs, ts, backward=True)
    t0 = time.perf_counter()
    search = BudgetSearch(g, "auto")
    least = search.least_budget()
    t_least = time.perf_counter() - t0
    van = search.vanilla()[1]
    out: Dict[str, Any] = {"name": name, "n": g.n, "solver": search.solver,
                           "least_search_s": t_least, "least_bytes": least,
                           "plain_peak_bytes": van, "runs": []}
    for label, budget in (("least", "least"), ("mid", int((least + van / 0.99) / 2))):
        rec, walls, runner = train(budget)
        same = all(a[0] == b[0] and a[1] == b[1] and a[2] == b[2] for a, b in zip(plain, rec))
        plan = next(iter(runner.plans.values()))
        st = runner.last_stats
        # the runner's own clock: from the recorded graph to the plan and
        # its release mode (at the end of the recorded backward, plan_at's
        # default), the structures of every signature summed
        planning = sum(s.planning_time_s for e in runner.entries.values() for s in e.structures)
        out["runs"].append({
            "budget": label, "budget_bytes": plan.budget_bytes, "solver": plan.solver,
            "planning_s": planning, "first_step_extra_s": walls[0] - pwalls[0],
            "identical": bool(same),
            "path": st.path, "dropped": st.n_dropped, "recomputed": st.recomputed_nodes,
            "measured_peak_bytes": st.measured_peak_bytes, "predicted_peak_bytes":
            plan.predicted_peak_bytes, "overhead": plan.overhead_fraction,
            "plain_step_s": pwalls[1], "applied_step_s": walls[2]})
    return out


# ------------------------------------------------------------------ report
def fit_exponent(ns: List[int], ts: List[float]) -> Optional[float]:
    import numpy as np
    pts = [(n, t) for n, t in zip(ns, ts) if t and t > 0]
    if len(pts) < 2:
        return None
    x = np.log([p[0] for p in pts])
    y = np.log([p[1] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


def _fmt_b(b: Optional[int]) -> str:
    from chainer_recompute.core.units import format_bytes
    return "-" if b is None else format_bytes(int(b))


def _cell(r: Dict[str, Any], ref: Optional[Dict[str, Any]] = None) -> List[str]:
    if "error" in r:
        return [r["error"], "", ""]
    least = _fmt_b(r["least"])
    if ref is not None and "least" in ref and ref is not r:
        least += f" ({100 * (ref['least'] / r['least'] - 1):+.1f}%)" if False else ""
    return [f"{r['total_s']:.2f} s", _fmt_b(r["least"]),
            f"{100 * r['overhead']:.2f}%" if r.get("feasible") else "infeasible"]


def report(results: Dict[str, Any], cmd: str) -> str:
    lines = ["# Planning at scale", "",
             "Produced by", "", f"    {cmd}", "",
             "on this machine (2 CPU cores, shared with other work while it ran), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Each cell: one process, warm "
             "(kernels loaded before the clock); time = least-budget search + one solve at the "
             "mid budget (halfway between the hierarchical DP's least budget and plain "
             "backprop), activations scope (the paper's memory model). Overhead: recomputed "
             "forward time at the mid budget, as a share of one forward. Δ: hier against "
             f"the flat approximate DP. Flat solvers stopped after {results['cap_s']:.0f} s "
             f"(the issue allows 600 s; a smaller cap was used for time); the flat approximate "
             f"DP is not run above {APPROX_MAX_N:,} functions and the exact DP above "
             f"{EXACT_MAX_N:,} (see APPROX_MAX_N in the script: memory on a shared machine).", ""]
    hdr = ("| graph | functions | hier: time | least | overhead @mid | approx: time | least | "
           "overhead @mid | exact: time | least | overhead @mid | Δ least | Δ overhead |")
    for group in ("transformer-like", "captured", "paper"):
        rows = [r for r in results["rows"] if r["group"] == group]
        if not rows:
            continue
        lines += [f"## {group}", "", hdr, "|" + "---|" * 13]
        for r in rows:
            h, a, e = r["hier"], r["approx"], r["exact"]
            dl = do = ""
            if "least" in h and "least" in a:
                dl = f"{100 * (h['least'] / a['least'] - 1):+.2f}%"
                if h.get("feasible") and a.get("feasible"):
                    do = f"{100 * (h['overhead'] - a['overhead']):+.2f} pp"
                    if a["overhead"] > 0:
                        do += f" ({100 * (h['overhead'] / a['overhead'] - 1):+.1f}%)"
            lines.append("| " + " | ".join([r["name"], str(h.get("n", a.get("n", "")))]
                                           + _cell(h) + _cell(a) + _cell(e) + [dl, do]) + " |")
        lines.append("")
        if group == "transformer-like":
            hs = [r for r in rows if "total_s" in r["hier"]]
            ex = fit_exponent([r["hier"]["n"] for r in hs], [r["hier"]["total_s"] for r in hs])
            fa = [r for r in rows if "total_s" in r["approx"]]
            ea = fit_exponent([r["approx"]["n"] for r in fa], [r["approx"]["total_s"] for r in fa])
            lines += [f"Fitted growth exponent of the time (log-log least squares over the rows "
                      f"above): hier {ex:.2f}" + (f", flat approx {ea:.2f}" if ea else "") + ".",
                      ""]
        if group == "captured":
            for fam in ("encoder", "lstm"):
                hs = [r for r in rows if r["name"].startswith(fam) and "total_s" in r["hier"]]
                ex = fit_exponent([r["hier"]["n"] for r in hs],
                                  [r["hier"]["total_s"] for r in hs])
                if ex is not None:
                    lines.append(f"Fitted growth exponent, hier, {fam}: {ex:.2f}.")
            lines.append("")
    lines += ["Hierarchical DP details (segments found: period x count; positions of the chain "
              "DP; distinct pieces planned):", "",
              "| graph | segments | positions | distinct pieces | hier used |",
              "|---|---|---|---|---|"]
    for r in results["rows"]:
        h = r["hier"]
        if "positions" in h:
            seg = "-" if not h.get("segments") else f"{h['segments'][0]} x {h['segments'][1]}"
            lines.append(f"| {r['name']} | {seg} | {h['positions']} | {h['pieces']} | "
                         f"{'yes' if h['hier'] else 'no (flat approx)'} |")
    lines.append("")
    if results.get("apply"):
        lines += ["## apply() against plain Chainer", "",
                  "Default solver (`auto`), total scope, SGD, 3 steps from the same seed "
                  "(dropout masks seeded per step). Planning: the runner's own clock, from the "
                  "recorded graph to the plan and its release mode (at the end of the first "
                  "call's backward); first call: the applied first call's wall time less the "
                  "plain one's (recording and planning). Least search: "
                  "`BudgetSearch(graph, 'auto').least_budget()` on a captured graph (what "
                  "planning at budget='least' does).", "",
                  "| model | functions | solver | least search | budget | planning | first call "
                  "| bit-identical | measured peak | budget bytes | plain peak (replayed) | "
                  "dropped | overhead |", "|" + "---|" * 13]
        for a in results["apply"]:
            for run in a["runs"]:
                lines.append(
                    f"| {a['name']} | {a['n']} | {run['solver']} | {a['least_search_s']:.2f} s | "
                    f"{run['budget']} | {run['planning_s']:.2f} s | "
                    f"+{run.get('first_step_extra_s', math.nan):.2f} s | {run['identical']} | "
                    f"{_fmt_b(run['measured_peak_bytes'])} | {_fmt_b(run['budget_bytes'])} | "
                    f"{_fmt_b(a['plain_peak_bytes'])} | {run['dropped']} | "
                    f"{100 * (run['overhead'] or 0):.1f}% |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "SOLVER"))
    ap.add_argument("--mid", type=int)
    ap.add_argument("--cap-s", type=float, default=600.0)
    ap.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    ap.add_argument("--skip-apply", action="store_true")
    ap.add_argument("--rows-from", default=None, metavar="FILE",
                    help="take the solver rows from FILE (the JSON lines an earlier run wrote "
                    "to stderr) instead of running them; run only the apply() checks")
    ap.add_argument("--json", default=None)
    ap.add_argument("--graphs", default=str(ROOT.parent / "shared" / "graphs"))
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.mid)))
        return 0
    import chainer_recompute as cr  # noqa: F401
    from chainer_recompute.core.io import save_graph
    from chainer_recompute.runtime.capture import capture
    enc = [6] if args.quick else [6, 24, 48]
    rows = []
    if args.rows_from:
        for line in Path(args.rows_from).read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and "group" in r:
                rows.append(r)
    cases = []
    layers = [6, 12, 24] if args.quick else [6, 12, 24, 48, 96, 192, 384, 4166]
    for n in layers:
        cases.append(("transformer-like", f"{n} layers", f"tl:{n}"))
    tmp = tempfile.mkdtemp(prefix="planning_scale_")
    ts = [100] if args.quick else [100, 1000, 3000]
    if args.rows_from:
        enc, ts, layers, cases = [], [], [], []
    for n in enc:
        model, (xs, tt) = _encoder(n)
        path = os.path.join(tmp, f"enc{n}.json")
        save_graph(capture(model, xs, tt, backward=True), path)
        cases.append(("captured", f"encoder, {n} layers", f"file:{path}"))
    for t in ts:
        model, (xs, tt) = _lstm(t)
        path = os.path.join(tmp, f"lstm{t}.json")
        save_graph(capture(model, xs, tt, backward=True), path)
        cases.append(("captured", f"lstm, t = {t}", f"file:{path}"))
    for name in ([] if args.quick or args.rows_from else PAPER):
        a = Path(args.graphs) / f"cg_{name}.txt"
        j = ROOT / "experiments" / "graphs" / f"{name}.json"
        if a.exists():
            cases.append(("paper", name, f"authors:{a}"))
        elif j.exists():
            cases.append(("paper", name, f"file:{j}"))
    for group, name, spec in cases:
        h = run_worker(spec, "hier", None, args.cap_s)
        mid = h.get("mid")
        n = h.get("n", 0)
        row = {"group": group, "name": name, "hier": h,
               "approx": run_worker(spec, "approx", mid, args.cap_s) if n <= APPROX_MAX_N
               else {"error": f"not run (n > {APPROX_MAX_N:,})"},
               "exact": run_worker(spec, "exact", mid, args.cap_s) if n <= EXACT_MAX_N
               else {"error": f"not run (n > {EXACT_MAX_N:,})"}}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    results: Dict[str, Any] = {"cap_s": args.cap_s, "rows": rows, "apply": []}
    if not args.skip_apply:
        ne = 6 if args.quick else 48
        nt = 100 if args.quick else 1000
        for name, make in ((f"encoder, {ne} layers", lambda: _encoder(ne)),
                           (f"lstm, t = {nt}", lambda: _lstm(nt))):
            a = apply_check(name, make)
            results["apply"].append(a)
            print(json.dumps(a), file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    cmd = "PYTHONPATH=. .venv/bin/python experiments/planning_scale.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]))
    print(report(results, cmd.strip()))
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
