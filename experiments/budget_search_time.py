"""Time of the total-scope planning that ``apply()`` does (``BudgetSearch``:
the least feasible budget, then the plan for a mid budget), wall and CPU,
on recorded graphs: the 48-layer Transformer encoder and the LSTM language
model at t = 100 and 1000 of ``experiments/planning_scale.py``.

    PYTHONPATH=. .venv/bin/python experiments/budget_search_time.py [--save DIR | --load DIR]

``--save DIR`` captures the graphs and keeps them in DIR; ``--load DIR``
reads graphs saved so (so that two versions of the library time the same
graphs). Warm: the compiled kernels are loaded (and the replay's compiled)
before the clock starts. CPU time is reported beside wall time because the
machine these figures come from is shared.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

CASES = [("encoder, 48 layers", "enc", 48), ("lstm, t = 100", "lstm", 100),
         ("lstm, t = 1000", "lstm", 1000)]


def _warm() -> None:
    import chainer_recompute as cr
    from chainer_recompute.core.graph import Graph
    from chainer_recompute.core.search import least_feasible_budget
    from chainer_recompute.core.solvers._dp import _load_kernels, numba_available
    if numba_available():
        _load_kernels()
        w = Graph.from_edges([4] * 40, [(i, i + 1) for i in range(39)])
        cr.solve(w, least_feasible_budget(w, "hier") + 8, solver="hier")
        try:  # the compiled replay, where this version has it
            from chainer_recompute.core.replay import replay
            replay(w, None, engine="numba")
        except TypeError:
            pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save")
    ap.add_argument("--load")
    ap.add_argument("--only", default=None)
    args = ap.parse_args()
    from chainer_recompute.core.budget import BudgetSearch
    from chainer_recompute.core.io import load_graph, save_graph
    _warm()
    rows = []
    for name, kind, size in CASES:
        if args.only and args.only not in name:
            continue
        if args.load:
            g = load_graph(os.path.join(args.load, f"{kind}{size}.json"))
        else:
            import planning_scale as ps
            from chainer_recompute.runtime.capture import capture
            model, (xs, ts) = ps._lstm(size) if kind == "lstm" else ps._encoder(size)
            g = capture(model, xs, ts, backward=True)
            if args.save:
                os.makedirs(args.save, exist_ok=True)
                save_graph(g, os.path.join(args.save, f"{kind}{size}.json"))
        w0, c0 = time.perf_counter(), time.process_time()
        search = BudgetSearch(g, "auto")
        least = search.least_budget()
        w1, c1 = time.perf_counter(), time.process_time()
        mid = (least + search.vanilla()[1]) // 2
        plan = search.fit(mid)
        w2, c2 = time.perf_counter(), time.process_time()
        rows.append({"name": name, "n": g.n, "solver": search.solver, "least": least,
                     "least_wall_s": w1 - w0, "least_cpu_s": c1 - c0, "mid": mid,
                     "mid_wall_s": w2 - w1, "mid_cpu_s": c2 - c1,
                     "mid_peak": plan.predicted_peak_bytes, "overhead": plan.overhead_fraction})
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
