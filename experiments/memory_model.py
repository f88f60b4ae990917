"""The memory model against the allocator.

For each model: plain Chainer, the plan at the least feasible total budget,
and the plan at the budget halfway between that and plain Chainer's
measured peak. Each configuration runs in a process of its own with
tracemalloc started before anything is allocated, so the measured peak is
every NumPy array of the training iteration (parameters, gradients,
optimizer state, inputs, activations, temporaries). The second budget is
halfway between the least feasible one and what plain Chainer needs (its
predicted peak with the planner's 1% headroom). A training loop like
Chainer's StandardUpdater (``optimizer.update(model, *args)``), four
iterations (the first records the graph, the second plans), the peak of
the last two.

    .venv/bin/python experiments/memory_model.py [--models a,b] [--out experiments/memory_model.json]

Prints the table written to experiments/memory_model.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from chainer_recompute.core.budget import MARGIN  # noqa: E402

#: name -> (builder, batch size); registry networks at their reduced size.
REGISTRY = {
    "mlp": 64, "resnet50": 4, "resnet101": 2, "resnet152": 2, "vgg19": 2, "googlenet": 2,
    "densenet161": 8, "pspnet": 1, "unet": 2,
}
SMALL = ["lstm_lm", "gru_lm", "nstep_lstm", "transformer", "vae", "deconv_generator",
         "views", "convnet"]


def worker(name: str, budget: str, solver: str) -> dict:
    from chainer_recompute.runtime.memory import MemoryMeter
    outer = MemoryMeter()
    outer.start()  # before anything of the model exists
    import gc

    import numpy
    import chainer
    import chainer_recompute as cr
    if name in REGISTRY:
        from chainer_recompute.models import get_model
        numpy.random.seed(0)
        spec = get_model(name, small=True)
        link = spec.link
        args = spec.make_inputs(REGISTRY[name], seed=0)
    else:
        from chainer_recompute.models.small import SMALL_MODELS
        link, args = SMALL_MODELS[name](0)
    if budget != "plain":
        cr.apply(link, budget=budget if budget == "least" else int(budget), solver=solver,
                 verbose=False)
    opt = chainer.optimizers.MomentumSGD(0.01)
    opt.setup(link)
    peaks, times = [], []
    for _ in range(4):
        gc.collect()
        with MemoryMeter() as m:
            t0 = time.perf_counter()
            opt.update(link, *args)
            times.append(time.perf_counter() - t0)
        peaks.append(m.result.absolute_peak_bytes)
    out = {"model": name, "config": budget, "measured": max(peaks[2:]), "peaks": peaks,
           "time_s": sum(times[2:]) / 2}
    runner = cr.runner_of(link)
    if runner is not None:
        (entry,) = runner.entries.values()
        s = entry.structures[0]
        stats = runner.last_stats
        out.update(predicted=s.plan.predicted_peak_bytes, budget=s.plan.budget_bytes,
                   vanilla_predicted=s.plan.info.get("vanilla_peak_bytes"),
                   recompute=s.plan.recompute, dropped=len(s.program.dropped), n=s.graph.n,
                   path=stats.path, runtime_measured=stats.measured_peak_bytes,
                   overhead_fraction=s.plan.overhead_fraction,
                   structures=len(entry.structures))
    return out


def run(name: str, budget: str, solver: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--config", budget,
           "--solver", solver]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return {"model": name, "config": budget, "error": p.stderr.strip().splitlines()[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(list(REGISTRY) + SMALL))
    ap.add_argument("--solver", default="approx")
    ap.add_argument("--out", default=os.path.join(HERE, "memory_model.json"))
    ap.add_argument("--worker")
    ap.add_argument("--config")
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.config, args.solver)))
        return 0
    rows = []
    print("| model | budget | budget MiB | predicted MiB | measured MiB | measured/predicted "
          "| measured <= budget | plain predicted MiB | plain measured MiB | plain meas./pred. "
          "| dropped |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        plain = run(name, "plain", args.solver)
        least = run(name, "least", args.solver)
        results = [least]
        if "error" not in least and "error" not in plain:
            # halfway between the least feasible budget and what plain
            # Chainer needs (its predicted peak with the planner's headroom)
            need = int(least["vanilla_predicted"] / (1 - MARGIN)) + 1
            half = (least["budget"] + need) // 2
            results.append(run(name, str(half), args.solver))
        for label, r in zip(("least", "halfway"), results):
            r["plain"] = plain
            rows.append(r)
            if "error" in r or "error" in plain:
                print(f"| {name} | {label} | error: {r.get('error') or plain.get('error')} |")
                continue
            ok = r["measured"] <= r["budget"]
            print(f"| {name} | {label} | {mib(r['budget'])} | {mib(r['predicted'])} | "
                  f"{mib(r['measured'])} | {r['measured'] / r['predicted']:.3f} | "
                  f"{'yes' if ok else 'NO'} | {mib(r['vanilla_predicted'])} | "
                  f"{mib(plain['measured'])} | "
                  f"{plain['measured'] / r['vanilla_predicted']:.3f} | "
                  f"{r['dropped']}/{r['n']} |", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
