"""The recurrent runner (runtime/bptt.py) against plain BPTT, bit for bit:
Chainer's PTB pattern (L.LSTM with dropout, state in the links) and
L.NStepLSTM over variable-length sequences (explicit state)."""
import doctest

import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest

from chainer_recompute.core.errors import BudgetError, GraphError, InfeasibleBudgetError
from chainer_recompute.runtime import bptt
from chainer_recompute.runtime.memory import MemoryMeter

V, U, B = 200, 64, 8


class RNNForLM(chainer.Chain):
    """Chainer's PTB example model (examples/ptb/train_ptb.py), smaller."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.embed = L.EmbedID(V, U)
            self.l1 = L.LSTM(U, U)
            self.l2 = L.LSTM(U, U)
            self.l3 = L.Linear(U, V)

    def forward(self, x):
        h0 = self.embed(x)
        h1 = self.l1(F.dropout(h0))
        h2 = self.l2(F.dropout(h1))
        return self.l3(F.dropout(h2))


def _lm():
    np.random.seed(0)
    model = L.Classifier(RNNForLM())
    opt = chainer.optimizers.SGD(lr=1.0)
    opt.setup(model)
    return model, opt


def _snapshot(model, loss, peak):
    p = model.predictor
    return dict(loss=loss.array.copy(),
                grads={n: q.grad.copy() for n, q in model.namedparams()},
                params={n: q.array.copy() for n, q in model.namedparams()},
                state=[a.array.copy() for a in (p.l1.h, p.l1.c, p.l2.h, p.l2.c)],
                rng=np.random.get_state()[1].copy(), peak=peak)


def _train(t, runner_args=None, iterations=3):
    """Three truncated-BPTT updates, plain (runner_args None) or with the runner."""
    model, opt = _lm()
    np.random.seed(7)
    data = np.random.RandomState(1).randint(0, V, (iterations * t + 1, B)).astype(np.int32)
    runner = bptt.ChainRecompute(model, **runner_args) if runner_args else None
    out = []
    for it in range(iterations):
        xs, ts = data[it * t:(it + 1) * t], data[it * t + 1:(it + 1) * t + 1]
        model.cleargrads()
        with MemoryMeter() as meter:
            if runner is None:
                loss = 0
                for x, y in zip(xs, ts):
                    loss += model(x, y)
            else:
                loss = runner(xs, ts)
            model.cleargrads()
            loss.backward()
            loss.unchain_backward()
            opt.update()
        out.append(_snapshot(model, loss, meter.result.peak_bytes))
    return out, runner


def _assert_same(plain, ours):
    for a, b in zip(plain, ours):
        assert a["loss"] == b["loss"] and a["loss"].dtype == b["loss"].dtype
        for n in a["grads"]:
            assert np.array_equal(a["grads"][n], b["grads"][n]), n
            assert np.array_equal(a["params"][n], b["params"][n]), n
        for x, y in zip(a["state"], b["state"]):
            assert np.array_equal(x, y)
        assert np.array_equal(a["rng"], b["rng"])


@pytest.fixture(scope="module")
def plain50():
    return _train(50)[0]


@pytest.mark.parametrize("policy", ["hsm", "msm"])
def test_lstm_lm_tight_budget_identical_and_predicted(plain50, policy):
    # the budget: a quarter of the way from the least feasible to plain's prediction
    probe = _train(50, dict(policy=policy, slots=1), iterations=1)[1].last_stats
    least = probe.predicted_peak_bytes
    budget = int(least + 0.25 * (probe.plain_peak_bytes - least))
    ours, runner = _train(50, dict(policy=policy, budget=budget))
    _assert_same(plain50, ours)
    stats = runner.last_stats
    assert stats.predicted_peak_bytes <= budget
    assert stats.forward_steps > 50
    for it in (1, 2):  # after the first call, which measures the cell
        measured, plain = ours[it]["peak"], plain50[it]["peak"]
        assert measured < plain
        assert abs(measured / stats.predicted_peak_bytes - 1) < 0.10, (measured, stats)


@pytest.mark.parametrize("policy, slots", [("ism", 20), ("revolve", 3), ("hsm", 50)])
def test_lstm_lm_other_policies_identical(plain50, policy, slots):
    ours, runner = _train(50, dict(policy=policy, slots=slots))
    _assert_same(plain50, ours)
    assert runner.last_stats.slots == slots


# ------------------------------------------------------------ NStepLSTM
class Seq(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.embed = L.EmbedID(V, U)
            self.rnn = L.NStepLSTM(2, U, U, dropout=0.3)
            self.out = L.Linear(U, V)


def _nstep_step(model, chunk):
    """One chunk of ``chunk`` time steps over sequences sorted by length,
    longest first; finished sequences keep their state."""

    def step(state, xs, ts):
        hx, cx = state
        n = len(xs)
        hy, cy, ys = model.rnn(hx[:, :n], cx[:, :n], [model.embed(x) for x in xs])
        if n < hx.shape[1]:
            hy = F.concat([hy, hx[:, n:]], axis=1)
            cy = F.concat([cy, cx[:, n:]], axis=1)
        loss = F.softmax_cross_entropy(model.out(F.concat(ys, axis=0)), np.concatenate(ts))
        return loss, (hy, cy)
    return step


def _chunks(seqs, chunk):
    """Per-step inputs: step k gets the k-th chunk of every sequence still running."""
    longest = len(seqs[0])
    xs, ts = [], []
    for start in range(0, longest - 1, chunk):
        alive = [s for s in seqs if len(s) - 1 > start]
        xs.append([s[start:start + chunk][:len(s) - 1 - start] for s in alive])
        ts.append([s[start + 1:start + 1 + chunk] for s in alive])
    return xs, ts


def test_nstep_lstm_variable_length_identical():
    rs = np.random.RandomState(3)
    lengths = sorted(rs.randint(5, 60, size=6), reverse=True)
    seqs = [rs.randint(0, V, n).astype(np.int32) for n in lengths]
    xs, ts = _chunks(seqs, 4)
    results = []
    for use_runner in (False, True):
        np.random.seed(0)
        model = Seq()
        opt = chainer.optimizers.SGD(lr=0.5)
        opt.setup(model)
        step = _nstep_step(model, 4)
        runner = bptt.ChainRecompute(step, policy="hsm", slots=3, model=model)
        state = (np.zeros((2, len(seqs), U), np.float32),) * 2
        state = tuple(chainer.Variable(s) for s in state)
        np.random.seed(11)
        out = []
        for _ in range(2):
            if use_runner:
                loss, state = runner(xs, ts, state=state)
            else:
                loss, st = 0, state
                for x, y in zip(xs, ts):
                    lk, st = step(st, x, y)
                    loss += lk
                state = st
            model.cleargrads()
            loss.backward()
            loss.unchain_backward()
            opt.update()
            out.append((loss.array.copy(), [p.grad.copy() for p in model.params()],
                        [s.array.copy() for s in state], np.random.get_state()[1].copy()))
        results.append(out)
    assert len(xs) > 10
    for a, b in zip(*results):
        assert a[0] == b[0]
        assert all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))
        assert all(np.array_equal(x, y) for x, y in zip(a[2], b[2]))
        assert np.array_equal(a[3], b[3])


# ------------------------------------------------------------ API and bad input
def test_bad_input_gives_clear_errors():
    model, _ = _lm()
    xs = np.zeros((10, B), np.int32)
    with pytest.raises(BudgetError, match="either slots"):
        bptt.ChainRecompute(model)
    with pytest.raises(BudgetError, match="either slots"):
        bptt.ChainRecompute(model, slots=2, budget="1M")
    with pytest.raises(BudgetError):
        bptt.ChainRecompute(model, slots=0)
    with pytest.raises(BudgetError, match="cannot read"):
        bptt.ChainRecompute(model, budget="lots")
    with pytest.raises(GraphError, match="t=0"):
        bptt.ChainRecompute(model, slots=2)(xs[:0], xs[:0])
    with pytest.raises(BudgetError, match="at most 10"):
        bptt.ChainRecompute(model, policy="hsm", slots=11)(xs, xs)
    with pytest.raises(BudgetError, match="alpha"):
        bptt.ChainRecompute(model, policy="ism", slots=1)(xs, xs)
    with pytest.raises(InfeasibleBudgetError, match="at least") as info:
        bptt.ChainRecompute(model, policy="hsm", budget=1000)(xs, xs)
    assert info.value.least_feasible_bytes > 1000


def test_evaluation_runs_the_steps_plainly():
    model, _ = _lm()
    xs = np.random.RandomState(0).randint(0, V, (6, B)).astype(np.int32)
    runner = bptt.ChainRecompute(model, slots=2)
    with chainer.using_config("train", False):
        loss = runner(xs, xs)
    model.predictor.l1.reset_state()
    model.predictor.l2.reset_state()
    with chainer.using_config("train", False):
        expected = sum(model(x, x) for x in xs)
    assert np.array_equal(loss.array, expected.array)


def test_docstring_example_runs():
    failures, _ = doctest.testmod(bptt, raise_on_error=False, verbose=False)
    assert failures == 0
