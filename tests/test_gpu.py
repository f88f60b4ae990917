"""The executor on CuPy: the same checks as on NumPy. Needs a GPU."""
import copy

import numpy as np
import pytest

import chainer_recompute as cr

from fake_cupy import real_cupy_or_skip

pytestmark = pytest.mark.gpu
cupy = real_cupy_or_skip()  # skips the module where no GPU answers

import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402

from chainer_recompute.runtime.memory import MemoryMeter  # noqa: E402


class Net(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 16, 3, pad=1)
            self.b1 = L.BatchNormalization(16)
            self.c2 = L.Convolution2D(16, 16, 3, pad=1)
            self.b2 = L.BatchNormalization(16)
            self.fc = L.Linear(16, 10)

    def forward(self, x, t):
        h = F.relu(self.b1(self.c1(x)))
        h = F.dropout(F.relu(self.b2(self.c2(h)) + h), 0.2)
        return F.softmax_cross_entropy(self.fc(F.average(h, axis=(2, 3))), t)


def test_identical_gradients_and_less_pool_memory_on_gpu():
    device = chainer.get_device("@cupy:0")
    device.use()
    x = cupy.random.randn(16, 3, 64, 64).astype(np.float32)
    t = cupy.arange(16, dtype=np.int32) % 10
    plain = Net()
    plain.to_device(device)
    plain(x, t)
    ours = copy.deepcopy(plain)
    cr.apply(ours, budget="least", verbose=False)
    peaks = []
    for model in (plain, ours):
        opt = chainer.optimizers.MomentumSGD(lr=0.01)
        opt.setup(model)
        for step in range(4):  # the first call of ours records, the second plans
            cr.runtime.device.seed_all(step)
            model.cleargrads()
            with MemoryMeter(cupy) as meter:
                loss = model(x, t)
                loss.backward()
            opt.update()
        peaks.append(meter.result.peak_bytes)
        model.loss = loss
    stats = cr.runner_of(ours).last_stats
    assert stats.path == "planned"
    assert stats.measured_pool_total_bytes <= stats.budget_bytes
    assert cupy.array_equal(plain.loss.array, ours.loss.array)
    for (n, p), (_, q) in zip(sorted(plain.namedparams()), sorted(ours.namedparams())):
        assert cupy.array_equal(p.array, q.array), n
        assert cupy.array_equal(p.grad, q.grad), n
    assert peaks[1] < peaks[0]


def test_pool_limit_at_the_budget_raises_no_out_of_memory():
    device = chainer.get_device("@cupy:0")
    device.use()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    other = pool.total_bytes()  # not this model's (the limit bounds the pool's total)
    x = cupy.random.randn(16, 3, 64, 64).astype(np.float32)
    t = cupy.arange(16, dtype=np.int32) % 10
    model = Net()
    model.to_device(device)
    model(x, t)
    cr.apply(model, budget="least", verbose=False)
    for step in range(2):  # record, then plan
        model.cleargrads()
        model(x, t).backward()
    budget = cr.runner_of(model).last_stats.budget_bytes
    pool.set_limit(size=other + budget)  # the model, its inputs and its iteration
    try:
        for step in range(3):
            model.cleargrads()
            model(x, t).backward()
    finally:
        pool.set_limit(size=0)
