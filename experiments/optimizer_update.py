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
"""
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
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(784, 1000)
            self.l2 = L.Linear(1000, 1000)
            self.l3 = L.Linear(1000, 10)

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))


def run(make_opt, x, t, applied, steps=6):
    outer = MemoryMeter()
    outer.start()
    np.random.seed(0)
    model = L.Classifier(MLP())
    if applied:
        cr.apply(model, budget="least", tuning=cr.Tuning(cost="flops"))
    opt = make_opt()
    opt.setup(model)
    rows = []
    for step in range(steps):
        with MemoryMeter() as m:
            opt.update(model, x, t)
        st = cr.runner_of(model).last_stats if applied else None
        rows.append((m.result.absolute_peak_bytes, st))
    outer.stop()
    return rows


def main(argv):
    name = argv[0] if argv else "Adam"
    batch = int(argv[1]) if len(argv) > 1 else 100
    hyper = {k: float(v) for k, v in (a.split("=", 1) for a in argv[2:])}
    make_opt = lambda: getattr(chainer.optimizers, name)(**hyper)  # noqa: E731
    warnings = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())
    logging.getLogger("chainer_recompute.report").addHandler(Keep())
    rs = np.random.RandomState(1)
    x = rs.rand(batch, 784).astype(np.float32)
    t = rs.randint(0, 10, batch).astype(np.int32)
    plain = run(make_opt, x, t, False)
    ours = run(make_opt, x, t, True)
    print(f"MLP 784-1000-1000-10, batch {batch}, {name} {hyper or ''}")
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
