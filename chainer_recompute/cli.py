"""Command line: plan (and optionally run) recomputation for a network.

``python scripts/run_schedule.py --model resnet152 --budget 8G``
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, List, Optional

from .core.units import ACCEPTED_FORMS, format_bytes, parse_bytes

logger = logging.getLogger(__name__)

SOLVERS = ("approx", "exact", "chen", "chen-greedy", "none")


def build_parser() -> argparse.ArgumentParser:
    from .models import MODELS
    p = argparse.ArgumentParser(
        prog="run_schedule.py",
        description="Capture a network's computational graph, find a recomputation plan "
                    "for a memory budget (Kusumoto et al., NeurIPS 2019) and optionally run "
                    "training iterations with it, measured against plain Chainer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="mlp", choices=sorted(MODELS),
                     help="network to capture")
    src.add_argument("--graph", metavar="PATH",
                     help="solve a saved graph instead: this project's JSON, or the authors' "
                          "text format (cg_*.txt); plan only")
    p.add_argument("--budget", default="least",
                   help="memory budget for activations: 'least' (the least feasible budget "
                        f"for the solver) or a size: {ACCEPTED_FORMS}. G means GiB (2^30), "
                        "GB means 10^9")
    p.add_argument("--batch-size", type=int, default=None,
                   help="batch size (default: the paper's for the network)")
    p.add_argument("--small", action="store_true",
                   help="the reduced variant of the network (quick CPU runs)")
    p.add_argument("--solver", default="approx", choices=SOLVERS)
    p.add_argument("--strategy", default="tc", choices=("tc", "mc"),
                   help="tc: least recomputation; mc: least memory")
    p.add_argument("--cost", default="measured", choices=("measured", "flops", "paper"),
                   help="cost model T_v for the solver")
    p.add_argument("--capture-batch", type=int, default=4,
                   help="capture the graph at this batch size and scale it linearly to "
                        "--batch-size (saves memory and time when planning large batches; "
                        "a model that does not scale is captured again at full size); "
                        "0: capture at full size")
    p.add_argument("--iterations", type=int, default=0,
                   help="training iterations to run with the plan (0: plan only); the "
                        "first is dropped from the averages")
    p.add_argument("--vanilla", action="store_true",
                   help="with --iterations: also run plain Chainer and print ratios")
    p.add_argument("--check-gradients", action="store_true",
                   help="compare one step's loss and gradients with plain backprop")
    p.add_argument("--device", default="@numpy",
                   help="Chainer device specifier: @numpy, @cupy:0, ...")
    p.add_argument("--save-graph", metavar="PATH", help="write the captured graph as JSON")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true", help="log planning details")
    return p


def _solve_saved_graph(args: argparse.Namespace) -> int:
    from .core.io import load_authors_graph, load_graph
    from .core.search import least_feasible_budget
    from .core.planner import solve
    path = args.graph
    graph = load_graph(path) if path.endswith(".json") else load_authors_graph(path)
    has_times = all(n.forward_time_s is not None for n in graph.nodes)
    if args.cost == "measured" and not has_times:
        print(f"note: {path} has no measured times; using its cost model "
              f"{graph.cost_model!r}")
    elif args.cost != graph.cost_model:
        graph = graph.with_cost_model(args.cost)
    print(graph.summary())
    budget = (least_feasible_budget(graph, solver=args.solver, strategy=args.strategy)
              if args.budget == "least" else parse_bytes(args.budget))
    plan = solve(graph, budget, solver=args.solver, strategy=args.strategy)
    print(plan.summary())
    _write_json(args, {"graph": path, "budget_bytes": budget, "plan": _plan_dict(plan)})
    return 0


def _plan_dict(plan: Any) -> dict:
    return {k: getattr(plan, k) for k in (
        "solver", "strategy", "budget_bytes", "feasible", "predicted_peak_bytes",
        "simulated_peak_bytes", "overhead", "overhead_fraction", "n_blocks", "solve_time_s",
        "cost_model")}


def _write_json(args: argparse.Namespace, data: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2, default=str)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from .core.errors import RecomputeError
    try:
        if args.budget != "least":
            parse_bytes(args.budget)  # fail early on a bad budget
        if args.graph:
            return _solve_saved_graph(args)
        return _run_model(args)
    except RecomputeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run_model(args: argparse.Namespace) -> int:
    from .bench import compare, format_results, gradients_match, network
    from .models import MODELS
    from .core.search import least_feasible_budget
    from .core.planner import solve

    batch = args.batch_size or MODELS[args.model][1]
    cap_batch = args.capture_batch if args.capture_batch and args.capture_batch < batch else None
    make, x, t, graph = network(args.model, batch, small=args.small, device=args.device,
                                cost_model=args.cost, seed=args.seed, capture_batch=cap_batch)
    print(graph.summary())
    if args.save_graph:
        from .core.io import save_graph
        save_graph(graph, args.save_graph)
    least = least_feasible_budget(graph, solver=args.solver, strategy=args.strategy)
    budget = least if args.budget == "least" else parse_bytes(args.budget)
    print(f"least feasible budget ({args.solver}, {args.strategy}): "
          f"{format_bytes(least)} ({format_bytes(least, binary=False)}); "
          f"using {format_bytes(budget)}")
    plan = solve(graph, budget, solver=args.solver, strategy=args.strategy)
    print(plan.summary())
    out = {"model": args.model, "batch_size": batch, "device": args.device,
           "least_feasible_bytes": least, "budget_bytes": budget, "plan": _plan_dict(plan)}
    options = dict(budget=budget, solver=args.solver, strategy=args.strategy, cost=args.cost,
                   budget_scope="activations",
                   capture_batch=cap_batch)
    if args.check_gradients:
        same = gradients_match(make, x, t, **options)
        print(f"loss and gradients identical to plain backprop: {same}")
        out["gradients_identical"] = same
        if not same:
            return 1
    if args.iterations > 0:
        results = compare(make, x, t,
                          [dict(options, label=f"{args.solver}-{args.strategy}")],
                          iterations=args.iterations, vanilla=args.vanilla)
        print(format_results(results))
        out["runs"] = [{"label": r.label, "peak_bytes": r.peak_bytes, "time_s": r.time_s,
                        "times_s": r.times_s} for r in results]
    _write_json(args, out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
