#!/usr/bin/env python
"""Capture the paper's networks into graph files (this project's JSON).

Each network is captured at a small batch (measured forward times) and
scaled linearly to the paper's batch size (configs/paper.json), except
where the paper's batch is already small. The files feed the solver
benchmark (experiments/solver_benchmark.py --captured).

    python experiments/capture_graphs.py --networks resnet152,pspnet,googlenet
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import chainer_recompute as cr  # noqa: E402
from chainer_recompute.runtime.capture import capture  # noqa: E402
from chainer_recompute.models import get_model  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--networks", default="resnet152,pspnet,googlenet")
    p.add_argument("--capture-batch", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "experiments", "graphs"))
    args = p.parse_args(argv)
    with open(os.path.join(ROOT, "configs", "paper.json")) as f:
        config = json.load(f)["networks"]
    os.makedirs(args.out, exist_ok=True)
    for name in args.networks.split(","):
        batch = config[name]["paper_batch"]
        small = min(batch, args.capture_batch)
        spec = get_model(name, batch_size=small)
        x, t = spec.make_inputs(small, seed=0)
        spec.link(x, t)
        t0 = time.time()
        g = capture(spec.link, x, t, name=name)
        if batch != small:
            g = g.scale_batch(batch)
        path = os.path.join(args.out, f"{name}.json")
        cr.save_graph(g, path)
        print(f"{name}: captured at batch {small} in {time.time() - t0:.1f} s, "
              f"scaled to {batch}: {g.n} nodes -> {path}")
        print(g.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
