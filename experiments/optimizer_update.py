#!/usr/bin/env python
"""Whole-step peaks of a 784-1000-1000-10 MLP in ``L.Classifier`` with a
Chainer optimizer, plain against ``apply(budget='least', cost='flops')``:
one tracemalloc meter from before the model is built, each step's absolute
peak (the update included), and the runner's figures (path, its measured
peak, predicted peak, budget). The parameters dominate the memory, so
the optimizer's state and update temporaries decide whether the first
planned step holds its budget (issue #32).

    PYTHONPATH=$PWD python experiments/optimizer_update.py Adam 100   # optimizer, batch
    PYTHONPATH=$PWD python experiments/optimizer_update.py AdamW 100 weight_decay_rate=0.01
    PYTHONPATH=$PWD python experiments/optimizer_update.py MomentumSGD 100 --hidden 4096 --weight-decay 5e-4

``--hidden`` sets the two hidden layers' width (a 4096x4096 weight, 64 MiB,
is then most of the model), ``--weight-decay`` adds ``WeightDecay`` (a hook
that writes the gradients) to the optimizer.
"""
import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numpy as np  # noqa: E402
import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402

import chainer_recompute as cr  # noqa: E402
from chainer_recompute.runtime.memory import MemoryMeter  # noqa: E402

MiB = 2 ** 20


class MLP(chainer.Chain):
    def __init__(self, hidden):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(784, hidden)
            self.l2 = L.Linear(hidden, hidden)
            self.l3 = L.Linear(hidden, 10)

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))


def run(make_opt, x, t, applied, hidden, steps=6):
    outer = MemoryMeter()
    outer.start()
    np.random.seed(0)
    model = L.Classifier(MLP(hidden))
    if applied:
        cr.apply(model, budget="least", tuning=cr.Tuning(cost="flops"))
    opt = make_opt(model)
    rows = []
    for step in range(steps):
        with MemoryMeter() as m:
            opt.update(model, x, t)
        st = cr.runner_of(model).last_stats if applied else None
        rows.append((m.result.absolute_peak_bytes, st))
    outer.stop()
    return rows


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("optimizer", nargs="?", default="Adam")
    ap.add_argument("batch", nargs="?", type=int, default=100)
    ap.add_argument("hyper", nargs="*", help="the optimizer's hyperparameters, name=value")
    ap.add_argument("--hidden", type=int, default=1000)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    args = ap.parse_args(argv)
    name, batch = args.optimizer, args.batch
    hyper = {k: float(v) for k, v in (a.split("=", 1) for a in args.hyper)}

    def make_opt(model):
        opt = getattr(chainer.optimizers, name)(**hyper)
        opt.setup(model)
        if args.weight_decay:
            opt.add_hook(chainer.optimizer_hooks.WeightDecay(args.weight_decay))
        return opt
    warnings = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())
    logging.getLogger("chainer_recompute.report").addHandler(Keep())
    rs = np.random.RandomState(1)
    x = rs.rand(batch, 784).astype(np.float32)
    t = rs.randint(0, 10, batch).astype(np.int32)
    plain = run(make_opt, x, t, False, args.hidden)
    ours = run(make_opt, x, t, True, args.hidden)
    decay = f" + WeightDecay({args.weight_decay:g})" if args.weight_decay else ""
    print(f"MLP 784-{args.hidden}-{args.hidden}-10, batch {batch}, {name} {hyper or ''}{decay}")
    for k, ((p, _), (a, st)) in enumerate(zip(plain, ours)):
        line = f"step {k}: plain {p / MiB:.2f} MiB, applied {a / MiB:.2f} MiB ({st.path}"
        if st.budget_bytes is not None:
            line += (f", budget {st.budget_bytes / MiB:.2f} MiB, predicted "
                     f"{st.predicted_peak_bytes / MiB:.2f} MiB")
        if st.measured_peak_bytes is not None:
            line += f", runner measured {st.measured_peak_bytes / MiB:.2f} MiB"
        print(line + ")")
    planned = [a for a, st in ours if st.path == "planned"]
    print(f"plain peak {max(p for p, _ in plain) / MiB:.2f} MiB; largest planned step "
          f"{max(planned) / MiB:.2f} MiB; first planned step {planned[0] / MiB:.2f} MiB "
          f"against its budget {ours[1][1].budget_bytes / MiB:.2f} MiB")
    print("warnings:", warnings or "none")


if __name__ == "__main__":
    main(sys.argv[1:])
