"""The least feasible figure printed by InfeasibleBudgetError, pasted back
as the budget on held-out models: accepted and met over 5 steps, and the
same figure from two recordings of the same model."""
from __future__ import annotations

import re

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
import chainer_recompute as cr
from chainer_recompute.core.errors import InfeasibleBudgetError
from chainer_recompute.models.small import VAE

_LEAST_RE = re.compile(r"least feasible (?:budget )?(?:is )?([0-9.]+ ?[kKMGT]?i?B)")


class SharedWeights(chainer.Chain):
    """One Linear applied eight times (residual), its gradient accumulated."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.inp, self.mid, self.out = L.Linear(64, 128), L.Linear(128, 128), L.Linear(128, 10)

    def forward(self, x, t):
        h = F.relu(self.inp(x))
        for _ in range(8):
            h = F.relu(self.mid(h)) + h
        return F.softmax_cross_entropy(self.out(h), t)


def _make(kind):
    np.random.seed(0)
    rs = np.random.RandomState(1)
    if kind == "vae":
        return VAE(), ((rs.rand(32, 784) > 0.5).astype(np.float32),)
    return SharedWeights(), (rs.randn(32, 64).astype(np.float32),
                             rs.randint(0, 10, 32).astype(np.int32))


def _least_figure(kind):
    model, args = _make(kind)
    opt = chainer.optimizers.SGD(0.01)
    opt.setup(model)
    cr.apply(model, budget=1, verbose=False)
    with pytest.raises(InfeasibleBudgetError) as info:  # before the first step
        opt.update(model, *args)
    m = _LEAST_RE.search(str(info.value))
    assert m, str(info.value)
    return m.group(1)


@pytest.mark.parametrize("kind", ["vae", "shared"])
def test_least_figure_pastes_back_and_is_the_same_twice(kind):
    figure = _least_figure(kind)
    assert _least_figure(kind) == figure  # a second recording, the same figure
    model, args = _make(kind)
    opt = chainer.optimizers.SGD(0.01)
    opt.setup(model)
    cr.apply(model, budget=figure, verbose=False)
    budget = cr.parse_bytes(figure)
    measured = []
    for step in range(6):  # 6 planned steps, the first planned from captures
        opt.update(model, *args)
        stats = cr.runner_of(model).last_stats
        assert stats.path == "planned", (step, stats.path)
        assert stats.budget_bytes <= budget
        if stats.measured_peak_bytes is not None:  # the runner's checked steps
            measured.append(stats.measured_peak_bytes)
    assert measured and max(measured) <= budget, (measured, budget)
