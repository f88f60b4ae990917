"""The executor on CuPy: the same checks as on NumPy. Needs a GPU."""
import copy

import numpy as np
import pytest

import chainer_recompute as cr

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402

from chainer_recompute.runtime.capture import capture  # noqa: E402
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
    x = cupy.random.randn(16, 3, 64, 64).astype(np.float32)
    t = cupy.arange(16, dtype=np.int32) % 10
    plain = Net()
    plain.to_device(device)
    plain(x, t)
    ours = copy.deepcopy(plain)
    least = cr.least_feasible_budget(capture(ours, x, t), solver="approx")
    cr.apply(ours, budget=least)
    peaks = []
    for model in (plain, ours):
        for _ in range(2):  # the first call of ours plans
            cupy.random.seed(0)
            model.cleargrads()
            with MemoryMeter(cupy) as meter:
                loss = model(x, t)
                loss.backward()
        peaks.append(meter.result.peak_bytes)
        model.loss = loss
    assert cupy.array_equal(plain.loss.array, ours.loss.array)
    for (n, p), (_, q) in zip(sorted(plain.namedparams()), sorted(ours.namedparams())):
        assert cupy.array_equal(p.grad, q.grad), n
    assert peaks[1] < peaks[0]
