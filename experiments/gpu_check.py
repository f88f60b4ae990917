#!/usr/bin/env python
"""The GPU check: Chainer's ResNet50 at batch 32 (3x224x224) on one GPU.

Prints, for vanilla Chainer and for recomputation (approximate DP,
time-centric, at the least feasible budget under the measured cost model):
the peak of the CuPy memory pool's used bytes during a training iteration
(the authors' method), the time per iteration (first dropped), and whether
one step's loss and gradients are bit-for-bit those of plain backprop.
Designed to finish in well under 8 minutes on one GPU.

    python experiments/gpu_check.py                 # GPU 0
    python experiments/gpu_check.py --device @numpy --small --batch-size 2   # smoke run on CPU

On a machine with NumPy 2 (the GPU machines), importing chainer_recompute
first makes Chainer 7.8.1 importable (see chainer_recompute/_compat.py).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import chainer_recompute as cr  # noqa: E402  (before chainer: NumPy 2 compatibility)
import chainer  # noqa: E402
import numpy  # noqa: E402

from chainer_recompute.bench import compare, gradients_match, network  # noqa: E402
from chainer_recompute.core.units import format_bytes  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="@cupy:0")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--small", action="store_true")
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--strategies", default="tc,mc")
    args = p.parse_args(argv)
    t_start = time.time()
    device = chainer.get_device(args.device)
    xp = device.xp
    print(f"device {device}, chainer {chainer.__version__}, numpy {numpy.__version__}"
          + (f", cupy {xp.__version__}" if xp is not numpy else ""))
    make, x, t, graph = network(args.model, args.batch_size, small=args.small,
                                device=device)
    print(graph.summary())
    configs = []
    for strategy in args.strategies.split(","):
        least = cr.least_feasible_budget(graph, solver="approx", strategy=strategy)
        print(f"least feasible budget approx/{strategy}: {format_bytes(least)}")
        configs.append(dict(budget=least, solver="approx", strategy=strategy,
                            budget_scope="activations", label=f"approx-{strategy} @least"))
    same = gradients_match(make, x, t, budget=configs[0]["budget"], budget_scope="activations")
    print(f"loss and gradients identical to plain backprop: {same}")
    results = compare(make, x, t, configs, iterations=args.iterations)
    base = results[0]
    print(f"{'run':<20} {'peak (pool used)':>18} {'vs vanilla':>10} {'time/iter':>10} "
          f"{'vs vanilla':>10}")
    for r in results:
        print(f"{r.label:<20} {format_bytes(r.peak_bytes):>18} "
              f"{100.0 * (r.peak_bytes / base.peak_bytes - 1):>+9.0f}% {r.time_s:>9.3f}s "
              f"{100.0 * (r.time_s / base.time_s - 1):>+9.0f}%")
    print(f"total {time.time() - t_start:.0f} s")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
