"""Solver benchmark: least feasible budgets, simulated peaks and solve
times on the authors' graphs and on a generated Inception-like graph.

Usage (from the repository root):
    .venv/bin/python experiments/solver_benchmark.py [--skip-inception]

Prints a Markdown table; experiments/solver_benchmark.md holds a run.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chainer_recompute.core.graph import Graph  # noqa: E402
from chainer_recompute.core.io import load_authors_graph, load_graph  # noqa: E402
from chainer_recompute.core.lower_sets import LowerSetFamily, count_lower_sets  # noqa: E402
from chainer_recompute.core.search import least_feasible_budget  # noqa: E402
from chainer_recompute.core.solvers import solve_exact  # noqa: E402
from chainer_recompute.core.planner import solve  # noqa: E402

GRAPHS = ROOT.parent / "shared" / "graphs"
AUTHORS = {  # approx GB, exact GB (TARGETS.md)
    "vgg19": (2.114, 2.114), "resnet50": (1.311, 1.290),
    "densenet": (1.685, 1.685), "unet": (5.819, 5.726),
}


def inception_like(n_modules: int = 9, branches: Sequence[int] = (5, 8, 8, 5),
                   stem: int = 10, base_bytes: int = 1_000_000) -> Graph:
    """A GoogLeNet-like graph: a stem, then ``n_modules`` inception modules
    of 4 parallel conv/ReLU branches joined by a concat, then a loss."""
    sizes: List[int] = []
    ops: List[str] = []
    edges = []

    def add(nbytes: int, op: str, preds: Sequence[int]) -> int:
        v = len(sizes)
        sizes.append(nbytes)
        ops.append(op)
        edges.extend((p, v) for p in preds)
        return v

    last: Optional[int] = None
    for i in range(stem):
        last = add(4 * base_bytes, "Convolution2DFunction" if i % 2 == 0 else "ReLU",
                   [] if last is None else [last])
    for _ in range(n_modules):
        ends = []
        for length in branches:
            prev = last
            for j in range(length):
                prev = add(base_bytes * (1 + j % 3),
                           "Convolution2DFunction" if j % 2 == 0 else "ReLU", [prev])
            ends.append(prev)
        last = add(4 * base_bytes, "Concat", ends)
    add(base_bytes // 10, "Loss", [last])
    return Graph.from_edges(sizes, edges, ops=ops)


def gb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e9:.3f}"


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def row(name: str, g: Graph, authors: Optional[tuple]) -> str:
    n_lower = count_lower_sets(g)
    t0 = time.perf_counter()
    la = least_feasible_budget(g, "approx")
    t_search_a = time.perf_counter() - t0
    t0 = time.perf_counter()
    le = least_feasible_budget(g, "exact", rel_tol=1e-3 if n_lower > 5000 else 0.0)
    t_search_e = time.perf_counter() - t0
    lc = least_feasible_budget(g, "chen")
    tc = solve(g, le, "exact", "tc")
    mc = solve(g, le, "exact", "mc")
    ta = solve(g, la, "approx", "tc")
    chen = solve(g, None, "chen")
    auth = "-" if authors is None else f"{authors[0]:.3f} / {authors[1]:.3f}"
    return (f"| {name} | {g.n} | {n_lower} | {gb(la)} / {gb(le)} / {gb(lc)} | {auth} | "
            f"{gb(tc.simulated_peak_bytes)} / {gb(mc.simulated_peak_bytes)} | "
            f"{gb(chen.simulated_peak_bytes)} | "
            f"{ta.solve_time_s:.3f} | {tc.solve_time_s:.2f} / {mc.solve_time_s:.2f} | "
            f"{t_search_a:.1f} / {t_search_e:.1f} | {rss_gb():.2f} |")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--skip-inception", action="store_true")
    args = ap.parse_args(argv)
    print("| graph | #V | #lower sets | least budget GB approx / exact / chen | authors approx / exact |"
          " sim. peak GB TC / MC at exact least | Chen sim. peak GB | approx TC solve s |"
          " exact TC / MC solve s | search s approx / exact | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("vgg19", "resnet50", "densenet", "unet"):
        path = GRAPHS / f"cg_{name}.txt"
        if not path.exists():
            print(f"| {name} | missing {path} |")
            continue
        print(row(name, load_authors_graph(path), AUTHORS[name]), flush=True)
    print()
    print("Graphs captured by this project (experiments/capture_graphs.py), approximate DP:")
    print()
    print("| graph | #V | #lower sets | cost model | least approx budget GB | approx TC solve s "
          "at 1.0 / 1.5 / 3.0 x least | approx MC solve s at 1.0 / 1.5 / 3.0 x least |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted((ROOT / "experiments" / "graphs").glob("*.json")):
        captured = load_graph(path)
        n_lower = count_lower_sets(captured, limit=10_000_000)
        for cost in ("measured", "paper"):
            g = captured.with_cost_model(cost)
            la = least_feasible_budget(g, "approx")
            times = {}
            for strategy in ("tc", "mc"):
                times[strategy] = []
                for factor in (1.0, 1.5, 3.0):
                    t0 = time.perf_counter()
                    solve(g, int(la * factor), "approx", strategy)
                    times[strategy].append(time.perf_counter() - t0)
            print(f"| {path.stem} (batch {g.batch_size}) | {g.n} | {n_lower} | {cost} | "
                  f"{gb(la)} | " + " / ".join(f"{x:.2f}" for x in times["tc"]) + " | "
                  + " / ".join(f"{x:.2f}" for x in times["mc"]) + " |", flush=True)
    if not args.skip_inception:
        g = inception_like()
        print(row("inception-like", g, None), flush=True)
        fam = LowerSetFamily.all(g)
        le = least_feasible_budget(g, "exact", rel_tol=1e-3)
        print()
        print("Inception-like graph, exact DP (family built once, reused):")
        for factor in (1.0, 1.1, 1.25):
            for strategy in ("tc", "mc"):
                b = int(le * factor)
                t0 = time.perf_counter()
                p = solve_exact(g, b, strategy=strategy, family=fam)
                dt = time.perf_counter() - t0
                print(f"- budget {b / 1e9:.4f} GB ({factor:.2f} x least), {strategy}: "
                      f"{dt:.1f} s, feasible {p.feasible}, {p.n_blocks} blocks, overhead "
                      f"{p.overhead}, transitions {p.info['n_transitions']:,}, "
                      f"states {p.info['n_states']:,}, peak RSS so far {rss_gb():.2f} GB",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
