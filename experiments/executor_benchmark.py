#!/usr/bin/env python
"""Executor benchmark: vanilla Chainer against recomputation, same process.

For one network (default Chainer's ResNet50 at 3x224x224) it captures the
graph, finds the least feasible budget of each solver/strategy, then runs
training iterations (forward, backward, MomentumSGD update) of vanilla
Chainer and of each plan on fresh copies of the same model and prints the
measured peak memory of an iteration (arrays allocated during it: NumPy
through tracemalloc's NumPy domain, CuPy through the pool) and the time per
iteration (first iteration dropped), as ratios to vanilla, next to the
plans' predictions.

    python experiments/executor_benchmark.py --model resnet50 --batch-size 8
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from chainer_recompute.bench import compare, network  # noqa: E402
from chainer_recompute.core.search import least_feasible_budget  # noqa: E402
from chainer_recompute.core.units import format_bytes  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--small", action="store_true")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--device", default="@numpy")
    p.add_argument("--configs", default="approx-tc,approx-mc,exact-tc,chen-tc",
                   help="comma-separated solver-strategy pairs, each at its least "
                        "feasible budget")
    p.add_argument("--cost", default="measured")
    args = p.parse_args(argv)

    make, x, t, graph = network(args.model, args.batch_size, small=args.small,
                                device=args.device, cost_model=args.cost)
    print(graph.summary())
    configs = []
    for item in args.configs.split(","):
        solver, strategy = item.rsplit("-", 1)
        least = least_feasible_budget(graph, solver=solver, strategy=strategy)
        print(f"least feasible budget {solver}/{strategy}: {format_bytes(least)}")
        configs.append(dict(budget=least, solver=solver, strategy=strategy, cost=args.cost,
                            label=f"{solver}-{strategy} @least"))
    results = compare(make, x, t, configs, iterations=args.iterations, vanilla=True)
    base = results[0]
    state = base.extra["state"]
    print(f"\nparameters {format_bytes(state['params'])} (their gradients are allocated in "
          f"every iteration and counted in the peaks)")
    print("| run | measured peak | vs vanilla | time/iter | vs vanilla | plan: simulated "
          "activations + grads | measured / predicted | plan: recompute, % of a forward |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if r.plan is not None:
            predicted = r.plan.simulated_peak_bytes + state["params"]
            pred = f"{format_bytes(predicted)}"
            ratio = f"{r.peak_bytes / predicted:.2f}"
            extra = f"{100 * r.plan.overhead_fraction:.0f}%"
        else:
            pred, ratio, extra = "", "", ""
        print(f"| {r.label} | {format_bytes(r.peak_bytes)} | "
              f"{100.0 * (r.peak_bytes / base.peak_bytes - 1):+.0f}% | {r.time_s:.2f} s | "
              f"{100.0 * (r.time_s / base.time_s - 1):+.0f}% | {pred} | {ratio} | {extra} |")
    print("\nper-iteration times (s):")
    for r in results:
        print(f"  {r.label}: " + ", ".join(f"{s:.2f}" for s in r.times_s))


if __name__ == "__main__":
    main()
