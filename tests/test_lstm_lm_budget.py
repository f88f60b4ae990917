"""An LSTM language model unrolled inside ``forward`` (embedding, two
``L.LSTM`` layers, dropout, a linear decoder, softmax cross entropy summed
over 40 steps, batch 20), as Chainer's PTB example's model: the replayed
peak against the allocator over whole optimizer steps, and a budget of
0.75x plain Chainer's measured peak accepted, met and bit-identical."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent

WORKER = textwrap.dedent("""
    import gc, json, sys
    from chainer_recompute.runtime.memory import MemoryMeter
    outer = MemoryMeter(); outer.start()   # absolute bytes: state, graph, update
    import hashlib
    import numpy as np
    import chainer, chainer.functions as F, chainer.links as L
    import chainer_recompute as cr

    V, U, T, B = 500, 128, 40, 20

    class RNNLM(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.embed = L.EmbedID(V, U)
                self.l1, self.l2 = L.LSTM(U, U), L.LSTM(U, U)
                self.out = L.Linear(U, V)

        def forward(self, xs, ts):
            self.l1.reset_state(); self.l2.reset_state()
            loss = 0
            for k in range(xs.shape[1]):
                h = self.l1(F.dropout(self.embed(xs[:, k]), 0.5))
                h = self.l2(F.dropout(h, 0.5))
                loss += F.softmax_cross_entropy(self.out(F.dropout(h, 0.5)), ts[:, k])
            return loss

    budget = sys.argv[1]
    np.random.seed(0)
    model = RNNLM()
    rs = np.random.RandomState(1)
    xs = rs.randint(0, V, (B, T)).astype(np.int32)
    ts = rs.randint(0, V, (B, T)).astype(np.int32)
    if budget != "plain":
        cr.apply(model, budget=int(budget), verbose=False)
    opt = chainer.optimizers.SGD(0.1); opt.setup(model)
    steps = []
    for step in range(7):
        gc.collect()
        np.random.seed(100 + step)   # the dropout masks
        with MemoryMeter() as m:
            opt.update(model, xs, ts)
        h = hashlib.sha1()
        for _, p in sorted(model.namedparams()):
            h.update(p.array.tobytes()); h.update(p.grad.tobytes())
        r = cr.runner_of(model)
        plan = next(iter(r.plans.values()), None) if r is not None else None
        steps.append({"peak": m.result.absolute_peak_bytes, "digest": h.hexdigest(),
                      "path": r.last_stats.path if r is not None else "plain",
                      "predicted": plan.predicted_peak_bytes if plan is not None else None,
                      "budget": plan.budget_bytes if plan is not None else None,
                      "vanilla": plan.info.get("vanilla_peak_bytes") if plan else None})
    print(json.dumps(steps))
""")


def _run(budget: str) -> list:
    p = subprocess.run([sys.executable, "-c", WORKER, budget], capture_output=True, text=True,
                       cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 50 s
def test_lstm_lm_prediction_and_three_quarters_of_plain():
    plain = _run("plain")
    plain_peak = max(s["peak"] for s in plain)
    budget = int(0.75 * plain_peak)
    ours = _run(str(budget))  # refused as infeasible before: the test fails on the error
    # bit for bit: parameters and gradients after every step
    assert [s["digest"] for s in ours] == [s["digest"] for s in plain]
    planned = [s for s in ours if s["path"] == "planned"]
    assert len(planned) >= 5 and planned[0]["budget"] == budget
    # the replay predicts the allocator's peak of a whole step, the update
    # included (steady state: from the third planned step)
    for s in planned[2:]:
        assert abs(s["peak"] / s["predicted"] - 1) <= 0.03, (s, plain_peak)
        assert s["peak"] <= budget, (s, budget)
    # and plain Chainer's
    assert abs(plain_peak / planned[-1]["vanilla"] - 1) <= 0.03, (plain_peak, planned[-1])
