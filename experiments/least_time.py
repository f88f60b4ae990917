"""Time of the least feasible budget (``BudgetSearch.least_budget``, what the
error message and ``least_total_budget`` give) and of the plan at it
(``least_plan``, what ``apply(budget='least')`` runs), CPU and wall, with
the figure, on graphs of the small networks recorded as the dry run does
(batch 2, scaled to 32): ResNet50 and PSPNet; and the figure on the same
graph with its times scaled by random factors (it must not move).

    PYTHONPATH=. .venv/bin/python experiments/least_time.py --save DIR
    PYTHONPATH=. .venv/bin/python experiments/least_time.py --load DIR

``--save`` records the graphs and keeps them in DIR; ``--load`` reads them,
so that two versions of the library time the same graphs (run it from each
version's checkout). Each figure is the least of ``--repeat`` runs (the
machine is shared); the compiled kernels are loaded before the clock
starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [("resnet50", 32), ("pspnet", 8)]


def _other_times(graph, seed: int):
    import numpy as np
    r = np.random.RandomState(seed)
    return graph.replace(nodes=[dataclasses.replace(
        n, forward_time_s=None if n.forward_time_s is None else
        n.forward_time_s * float(np.exp(r.randn()))) for n in graph.nodes])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save")
    ap.add_argument("--load")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--solver", default="auto")
    args = ap.parse_args()
    from chainer_recompute.core.budget import BudgetSearch
    from chainer_recompute.core.io import load_graph, save_graph
    from chainer_recompute.core.solvers._dp import _load_kernels, numba_available
    if numba_available():
        _load_kernels()
    for name, batch in CASES:
        path = os.path.join(args.load or args.save or ".", f"{name}_small_b{batch}.json")
        if args.load:
            g = load_graph(path)
        else:
            from chainer_recompute.bench import dry_run_graph
            g, _ = dry_run_graph(name, batch, small=True, capture_batch=2)
            if args.save:
                os.makedirs(args.save, exist_ok=True)
                save_graph(g, path)
        BudgetSearch(g, args.solver).least_budget()  # warm (replay kernels)
        best = None
        for _ in range(args.repeat):
            w0, c0 = time.perf_counter(), time.process_time()
            search = BudgetSearch(g, args.solver)
            least = search.least_budget()
            w1, c1 = time.perf_counter(), time.process_time()
            plan = search.least_plan()
            w2, c2 = time.perf_counter(), time.process_time()
            run = (c1 - c0, w1 - w0, c2 - c1, w2 - w1)
            best = run if best is None else tuple(min(a, b) for a, b in zip(best, run))
        others = [BudgetSearch(_other_times(g, s), args.solver).least_budget() for s in (1, 2)]
        print(json.dumps({
            "graph": f"{name} small, batch {batch}", "n": g.n, "solver": search.solver,
            "least": least, "least_other_times": others,
            "vanilla_peak": search.vanilla()[1], "least_plan_peak": plan.predicted_peak_bytes,
            "least_plan_overhead": round(plan.overhead_fraction, 4),
            "least_cpu_s": round(best[0], 3), "least_wall_s": round(best[1], 3),
            "least_plan_extra_cpu_s": round(best[2], 3),
            "least_plan_extra_wall_s": round(best[3], 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
