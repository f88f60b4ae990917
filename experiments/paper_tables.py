#!/usr/bin/env python
"""The paper's headline table (TARGETS.md), measured on this machine.

For each network of ``configs/paper.json``: capture the graph at the CPU
batch size (measured cost model), find the least feasible budget of the
approximate DP, the exact DP (when its lower sets can be enumerated) and
Chen et al., then run training iterations of vanilla Chainer and of each
plan at its least budget, interleaved, on copies of the same model, and
report the measured peak memory of an iteration *including parameters*
(as the authors did) and the reduction from vanilla, next to the authors'
GPU figures.

    python experiments/paper_tables.py --networks resnet50,unet
    python experiments/paper_tables.py --networks all --json experiments/out/paper.json

Each network runs in a subprocess of its own (bounded memory).
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
CONFIG = os.path.join(ROOT, "configs", "paper.json")


def run_one(name, cfg, iterations, solvers, small):
    from chainer_recompute.bench import compare, network
    from chainer_recompute.core.errors import LowerSetExplosionError, RecomputeError
    from chainer_recompute.core.search import least_feasible_budget

    batch = cfg["cpu_batch"]
    t0 = time.time()
    make, x, t, graph = network(name, batch, small=small)
    capture_s = time.time() - t0
    out = {"network": name, "batch": batch, "nodes": graph.n,
           "activation_bytes": graph.activation_bytes, "param_bytes": graph.param_bytes,
           "retained_bytes": graph.retained_bytes, "capture_s": capture_s, "least": {},
           "skipped": {}}
    configs = []
    for solver in solvers:
        try:
            t0 = time.time()
            least = least_feasible_budget(graph, solver=solver, strategy="tc")
            out["least"][solver] = {"budget_bytes": least, "search_s": time.time() - t0}
        except (LowerSetExplosionError, RecomputeError) as e:
            out["skipped"][solver] = str(e)
            continue
        configs.append(dict(budget=least, solver=solver, strategy="tc", label=solver))
    results = compare(make, x, t, configs, iterations=iterations)
    out["runs"] = {}
    for r in results:
        out["runs"][r.label] = {
            "peak_bytes": r.peak_bytes, "peak_with_params_bytes": r.peak_bytes + graph.param_bytes,
            "time_s": r.time_s, "times_s": r.times_s,
            "simulated_peak_bytes": None if r.plan is None else r.plan.simulated_peak_bytes,
            "overhead_fraction": None if r.plan is None else r.plan.overhead_fraction}
    return out


def table(rows, config):
    def gb(b):
        return f"{b / 1e9:.3f} GB"

    lines = ["| network (CPU batch) | approx DP | exact DP | Chen et al. | vanilla | "
             "paper: approx / exact / Chen |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        runs = row["runs"]
        van = runs["vanilla"]["peak_with_params_bytes"]
        cells = []
        for solver in ("approx", "exact", "chen"):
            if solver in runs:
                b = runs[solver]["peak_with_params_bytes"]
                cells.append(f"{gb(b)} ({100 * (b / van - 1):+.0f}%)")
            else:
                cells.append("n/a")
        tg = config["networks"][row["network"]]["targets"]
        paper = " / ".join(f"{100 * (tg[s] / tg['vanilla'] - 1):+.0f}%"
                           for s in ("approx", "exact", "chen"))
        lines.append(f"| {row['network']} ({row['batch']}) | " + " | ".join(cells)
                     + f" | {gb(van)} | {paper} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--networks", default="resnet50",
                   help="comma-separated names from configs/paper.json, or 'all'")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--solvers", default="approx,exact,chen")
    p.add_argument("--small", action="store_true", help="reduced networks (smoke run)")
    p.add_argument("--json", help="write all rows here")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one network, print JSON
    args = p.parse_args(argv)
    with open(CONFIG) as f:
        config = json.load(f)
    solvers = args.solvers.split(",")
    if args.one:
        row = run_one(args.one, config["networks"][args.one], args.iterations, solvers,
                      args.small)
        print("ROW " + json.dumps(row))
        return 0
    names = list(config["networks"]) if args.networks == "all" else args.networks.split(",")
    rows = []
    for name in names:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--iterations",
               str(args.iterations), "--solvers", args.solvers] + (["--small"] if args.small else [])
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        row_lines = [line for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        if proc.returncode != 0 or not row_lines:
            print(f"{name}: failed ({proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        row = json.loads(row_lines[-1][4:])
        rows.append(row)
        least = ", ".join(f"{s} {v['budget_bytes'] / 1e9:.3f} GB"
                          for s, v in row["least"].items())
        skipped = "; ".join(f"{s} skipped: {why[:120]}" for s, why in row["skipped"].items())
        print(f"{name}: {row['nodes']} nodes, batch {row['batch']}, least budgets: {least}"
              f"{'; ' + skipped if skipped else ''}; {time.time() - t0:.0f} s", flush=True)
        for label, r in row["runs"].items():
            print(f"    {label:<8} peak {r['peak_with_params_bytes'] / 1e9:.3f} GB (params incl.), "
                  f"{r['time_s']:.2f} s/iter, iterations " +
                  ", ".join(f"{s:.2f}" for s in r["times_s"]), flush=True)
    print()
    print(table(rows, config))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
