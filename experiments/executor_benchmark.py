#!/usr/bin/env python
"""Executor benchmark: the time of a training step with recomputation
applied against plain Chainer, in the same process.

One network (default Chainer's ResNet50 at 3x64x64, ``--small``), batch
16, MomentumSGD, steps as Chainer's ``StandardUpdater`` runs them
(``optimizer.update(model, x, t)``). Copies of the same model run
interleaved (plain, then each configuration, round after round), so that a
change in the machine's load affects all alike; the first two steps of each
(recording and planning) are left out and the medians of the next
``--iterations`` are compared, each as a ratio to plain's median, and as
the median of the per-round ratios (paired), for the wall clock and for
the process's CPU time (``time.process_time``: every thread's; run with
``OPENBLAS_NUM_THREADS=1`` on a shared machine, so that BLAS threads
waiting for a core do not count).

Configurations:

- ``keep``: a budget above plain Chainer's peak (the plan drops
  nothing), default options: runs as plain Chainer once checked;
- ``keep/no-verify``: the same with ``verify=False``;
- ``keep/hooked``: the same plan (``verify=False``) with the executor's
  hook left on (``plain_when_nothing_dropped = False``: the forward
  checked function by function against the plan, the backward seen): the
  cost of the per-function checks alone, without recomputation;
- ``least``: ``budget='least'`` (drops and recomputes), default options;
  ``least/no-verify``: the same with ``verify=False``.

    python experiments/executor_benchmark.py --iterations 7
"""
import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy  # noqa: E402

from chainer_recompute.runtime import _chainer  # noqa: E402,F401
import chainer  # noqa: E402

import chainer_recompute as cr  # noqa: E402
from chainer_recompute.models import get_model  # noqa: E402


CONFIGS = {
    "keep": dict(budget="64G", verify=True),
    "keep/no-verify": dict(budget="64G", verify=False),
    "keep/hooked": dict(budget="64G", verify=False),
    "least": dict(budget="least", verify=True),
    "least/no-verify": dict(budget="least", verify=False),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--iterations", type=int, default=7, help="measured steps per config")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated, among: " + ",".join(CONFIGS))
    p.add_argument("--cost", default="flops")
    args = p.parse_args(argv)

    spec = get_model(args.model, batch_size=args.batch_size, small=True)
    x, t = spec.make_inputs(args.batch_size, seed=0)
    numpy.random.seed(0)
    base = get_model(args.model, batch_size=args.batch_size, small=True).link
    with chainer.no_backprop_mode():
        base(x[:1], t[:1])  # lazily shaped parameters
    import copy
    runs = {"plain": copy.deepcopy(base)}
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    for name in names:
        budget, verify = CONFIGS[name]["budget"], CONFIGS[name]["verify"]
        model = cr.apply(copy.deepcopy(base), budget=budget, verbose=False,
                         tuning=cr.Tuning(cost=args.cost, verify=verify))
        if name == "keep/hooked":
            cr.runner_of(model).plain_when_nothing_dropped = False
        runs[name] = model
    opts = {}
    for name, model in runs.items():
        opts[name] = chainer.optimizers.MomentumSGD(lr=1e-4)
        opts[name].setup(model)
    times = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    warmup = 2 + 3  # recording, planning and the three checked (measured) steps
    for step in range(warmup + args.iterations):
        for name, model in runs.items():
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            opts[name].update(model, x, t)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
        print(f"round {step}: " + ", ".join(f"{n} {times[n][-1]:.3f} s ({cpu[n][-1]:.3f} s CPU)"
                                            for n in runs), flush=True)
    print(f"\n{args.model} (small, 3x64x64), batch {args.batch_size}, MomentumSGD; medians of "
          f"steps {warmup}..{warmup + args.iterations - 1} (the first {warmup} left out: "
          f"recording, planning, the runner's checked steps)\n")
    print("| run | dropped | clock | median step | vs plain (medians) | median of paired ratios |")
    print("|---|---|---|---|---|---|")
    for name, model in runs.items():
        runner = cr.runner_of(model)
        st = runner.last_stats if runner is not None else None
        dropped = "" if st is None else str(st.n_dropped)
        for clock, rec in (("wall", times), ("CPU", cpu)):
            ts, plain = rec[name][warmup:], rec["plain"][warmup:]
            paired = statistics.median(a / b for a, b in zip(ts, plain))
            print(f"| {name} | {dropped} | {clock} | {statistics.median(ts):.3f} s | "
                  f"{100 * (statistics.median(ts) / statistics.median(plain) - 1):+.1f}% | "
                  f"{100 * (paired - 1):+.1f}% |")


if __name__ == "__main__":
    main()
