#!/usr/bin/env python
"""Whole-step peaks of Chainer's ResNet50 (3x64x64) in ``L.Classifier``
with MomentumSGD, plain against ``apply(budget='least')``: one tracemalloc
meter from before the model is built, each step's absolute peak (update
included), and the runner's own figures (path, dropped, measured,
predicted, budget).

    PYTHONPATH=$PWD python experiments/step_budget.py 4     # batch 4
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numpy as np  # noqa: E402
import chainer, chainer.links as L, chainer.functions as F
import chainer_recompute as cr
from chainer_recompute.runtime.memory import MemoryMeter
from chainer_recompute.models import get_model

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 4
budget = sys.argv[2] if len(sys.argv) > 2 else "least"
steps = 6
MiB = 2**20

def make():
    np.random.seed(0)
    net = L.ResNet50Layers(pretrained_model=None)
    class P(chainer.Chain):
        def __init__(s):
            super().__init__()
            with s.init_scope():
                s.net = net
        def forward(s, x):
            return s.net(x, layers=["fc6"])["fc6"]
    return L.Classifier(P())

rs = np.random.RandomState(1)
x = rs.rand(batch, 3, 64, 64).astype(np.float32)
t = rs.randint(0, 1000, batch).astype(np.int32)

def run(applied):
    outer = MemoryMeter(); outer.start()
    model = make()
    if applied:
        cr.apply(model, budget=budget, tuning=cr.Tuning(cost="flops"))
    opt = chainer.optimizers.MomentumSGD(lr=0.01); opt.setup(model)
    peaks = []
    for s in range(steps):
        np.random.seed(s)
        m = MemoryMeter(); m.start()
        opt.update(model, x, t)
        r = m.stop()
        peaks.append(r.absolute_peak_bytes)
        st = cr.runner_of(model).last_stats if applied else None
        print(("applied" if applied else "plain"), s, f"{r.absolute_peak_bytes/MiB:.1f} MiB", 
              st.path if st else "", st.n_dropped if st else "", 
              (st.measured_peak_bytes or 0)/MiB if st else "", (st.predicted_peak_bytes or 0)/MiB if st else "",
              (st.budget_bytes or 0)/MiB if st else "", flush=True)
    outer.stop()
    return peaks, float(model.loss.array)

p, l1 = run(False)
a, l2 = run(True)
print("loss", l1, l2)
