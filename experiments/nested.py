"""Nested plans below the single-level least (docs/algorithm.md §9), from
the committed graphs (pure core: nothing runs a model, except ``--scale``,
which records its two models).

- The least total budget with nesting against without, on the headline
  table's graphs (recorded at the paper's batch sizes), with the physical
  floor below which no schedule goes, what each least plan recomputes, and
  the time the nested search takes.
- The nested search's time on graphs of thousands of functions (a
  48-layer Transformer encoder, an LSTM unrolled 1000 steps), recorded by
  apply() (``--scale``).
- The largest batch at the runtime sweep's fixed budget B
  (experiments/README.md, "Time per iteration at a fixed budget"): the
  single-level plans' (approx TC, as the sweep) against the nested ones
  (solver auto), on the sweep's recorded graphs scaled to each batch.

    .venv/bin/python experiments/nested.py                 # all three; writes experiments/nested.json
    .venv/bin/python experiments/nested.py --least resnet152_b32
    .venv/bin/python experiments/nested.py --scale         # the search on thousands of functions

Every figure is a replayed peak (the memory model that apply() plans with),
not a measurement; experiments/nested.md has the measured runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from chainer_recompute.core.budget import BudgetSearch, least_for  # noqa: E402
from chainer_recompute.core.io import load_graph  # noqa: E402
from chainer_recompute.core.replay import physical_floor  # noqa: E402

GRAPHS = ["resnet50_b32", "resnet152_b32", "densenet161_b32", "googlenet_b32", "pspnet_b1",
          "unet_b8", "vgg19_b32"]
SWEEP = ["resnet152", "densenet161"]


def least_row(name: str) -> dict:
    g = load_graph(HERE / "results" / "graphs" / f"{name}.json")
    t0 = time.perf_counter()
    search = BudgetSearch(g, "auto")
    single_plan, single = search.least()
    t1 = time.perf_counter()
    got = search.nested_search().least()
    t2 = time.perf_counter()
    floor = physical_floor(g)
    row = {"graph": name, "functions": g.n, "single_least_bytes": least_for(single),
           "single_peak_bytes": int(single), "single_recompute": single_plan.overhead_fraction,
           "floor_bytes": int(floor.peak_bytes), "floor_event": floor.event,
           "floor_held_grad_bytes": int(floor.held_grad_bytes),
           "single_search_s": t1 - t0, "nested_search_s": t2 - t1}
    if got is not None and got[1] < single:
        plan, peak = got
        row.update(nested_least_bytes=least_for(peak), nested_peak_bytes=int(peak),
                   nested_recompute=plan.overhead_fraction, nested=plan.info["nested"])
    return row


def largest_rows(net: str) -> dict:
    import reproduce
    state = json.loads((HERE / "results" / "sweep" / f"{net}_budget.json").read_text())
    gpath = str(ROOT / state["graph_file"])
    budget = int(state["budget_bytes"])
    out = {"network": net, "budget_bytes": budget}
    for m in ("approx-tc", "nested-tc"):
        r = reproduce.largest_batch(gpath, m, budget)
        out[m] = {"largest_batch": r["largest_batch"], "search_s": r["search_s"]}
    return out


def in_order(rows: dict, names: list) -> list:
    """``rows`` (by name) in the order of ``names``, then the others."""
    return [rows[n] for n in names if n in rows] + [r for n, r in rows.items() if n not in names]


#: graphs of thousands of functions (experiments/planning_scale.py's
#: models), recorded here by apply()'s runner
SCALE = {"encoder48": ("_encoder", 48), "lstm1000": ("_lstm", 1000)}


def scale_row(name: str) -> dict:
    """The nested search's time on a graph of thousands of functions,
    against the single-level search (each graph recorded by ``apply()``
    over two optimizer steps, as a training loop would)."""
    import chainer
    import chainer_recompute as cr
    import planning_scale
    make, arg = SCALE[name]
    model, batch = getattr(planning_scale, make)(arg)
    cr.apply(model, budget="least", verbose=False)
    opt = chainer.optimizers.MomentumSGD(0.01)
    opt.setup(model)
    for _ in range(2):
        opt.update(model, *batch)
    g = cr.runner_of(model).planned_graphs()[-1]
    t0 = time.perf_counter()
    search = BudgetSearch(g, "auto")
    single = search.least()[1]
    t1 = time.perf_counter()
    got = search.nested_least()
    t2 = time.perf_counter()
    row = {"graph": name, "functions": g.n, "single_least_bytes": least_for(single),
           "single_search_s": t1 - t0, "nested_search_s": t2 - t1,
           "nested_replays": len(search.nested_search().candidates()),
           "floor_bytes": int(physical_floor(g).peak_bytes)}
    if got is not None:
        row.update(nested_least_bytes=least_for(got[1]), nested=got[0].info["nested"])
    return row


def gb(x: int) -> str:
    return f"{x / 1e9:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--least", nargs="*", metavar="GRAPH", help="only the least budgets "
                    "(of these committed graphs; default all)")
    ap.add_argument("--largest", nargs="*", metavar="NET", help="only the largest batches "
                    "(of these sweep networks; default both)")
    ap.add_argument("--json", default=str(HERE / "nested.json"), help="where to write the figures")
    ap.add_argument("--scale", action="store_true", help="only the nested search's time on "
                    "graphs of thousands of functions (" + ", ".join(SCALE) + ")")
    args = ap.parse_args()
    both = args.least is None and args.largest is None and not args.scale
    # a partial run updates its part of an existing file
    out = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
    if both or args.least is not None:
        rows = {r["graph"]: r for r in out.get("least", [])}
        print("| graph | functions | single-level least GB (recomputes) | nested least GB "
              "(recomputes) | change | levels | physical floor GB | nested search s |")
        print("|---|---|---|---|---|---|---|---|")
        for name in args.least or GRAPHS:
            r = rows[name] = least_row(name)
            nl = r.get("nested_least_bytes")
            print(f"| {name} | {r['functions']} | {gb(r['single_least_bytes'])} "
                  f"({100 * r['single_recompute']:.0f}%) | "
                  + (f"{gb(nl)} ({100 * r['nested_recompute']:.0f}%) | "
                     f"{100 * (nl / r['single_least_bytes'] - 1):+.1f}% | "
                     f"{r['nested']['depth']}" if nl else "none lower | - | -")
                  + f" | {gb(r['floor_bytes'])} | {r['nested_search_s']:.1f} |", flush=True)
        out["least"] = in_order(rows, GRAPHS)
    if both or args.largest is not None:
        rows = {r["network"]: r for r in out.get("largest", [])}
        print("\n| network | budget B GB | largest batch, single-level (approx TC) | "
              "largest batch, nested | ratio |")
        print("|---|---|---|---|---|")
        for net in args.largest or SWEEP:
            r = rows[net] = largest_rows(net)
            a, n = r["approx-tc"]["largest_batch"], r["nested-tc"]["largest_batch"]
            print(f"| {net} | {gb(r['budget_bytes'])} | {a} | {n} | {n / a:.2f}x |", flush=True)
        out["largest"] = in_order(rows, SWEEP)
    if both or args.scale:
        out["scale"] = []
        print("\n| graph | functions | single-level least MB (search s) | nested least MB "
              "(search s) | change | replays | physical floor MB |")
        print("|---|---|---|---|---|---|---|")
        for name in SCALE:
            r = scale_row(name)
            out["scale"].append(r)
            nl = r.get("nested_least_bytes")
            print(f"| {name} | {r['functions']} | {r['single_least_bytes'] / 1e6:.2f} "
                  f"({r['single_search_s']:.1f}) | "
                  + (f"{nl / 1e6:.2f} ({r['nested_search_s']:.1f}) | "
                     f"{100 * (nl / r['single_least_bytes'] - 1):+.1f}%" if nl else
                     f"none lower ({r['nested_search_s']:.1f}) | -")
                  + f" | {r['nested_replays']} | {r['floor_bytes'] / 1e6:.2f} |", flush=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
