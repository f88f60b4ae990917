"""Budgets as a user writes them (core/budget_spec.py): every form, the
refusals, and each form through apply(), ChainRecompute, the CuPy test
double and the command line."""
from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import chainer_recompute as cr
from chainer_recompute.core import budget_spec
from chainer_recompute.core.budget import least_for, plain_need_bytes, plan_for_budget
from chainer_recompute.core.budget_spec import DEVICE_MARGIN, Budget, parse_budget
from chainer_recompute.core.errors import BudgetError
from chainer_recompute.core.graph import Graph

G, GB = 2 ** 30, 10 ** 9


@pytest.mark.parametrize("text, expected", [
    ("8G", 8 * G), ("8g", 8 * G), ("8 G", 8 * G), ("8GiB", 8 * G), ("8gib", 8 * G),
    ("8 GiB", 8 * G), ("8Gi", 8 * G), ("8GB", 8 * GB), ("8gb", 8 * GB), ("8Gb", 8 * GB),
    ("8 GB", 8 * GB), (" 8 gB ", 8 * GB), ("512m", 512 * 2 ** 20), ("1.5kB", 1500),
    ("123456", 123456), (123456, 123456), (np.int64(4096), 4096), (2e3, 2000),
    (123456.8, 123457),  # (a computed size: rounded)
])
def test_sizes_in_any_case_and_spacing(text, expected):
    b = parse_budget(text)
    assert (b.kind, b.bytes) == ("bytes", expected)


@pytest.mark.parametrize("text, kind", [("least", "least"), (" LEAST ", "least"),
                                         ("device", "device"), ("Device", "device"),
                                         ("60%", "share"), ("60 %", "share"),
                                         ("12.5%", "share")])
def test_words_and_shares(text, kind):
    b = parse_budget(text)
    assert b.kind == kind and b.bytes is None and not (kind != "least" and b.resolved)
    if kind == "share":
        assert b.share == pytest.approx(float(text.strip().rstrip("%")) / 100)
    assert parse_budget(b) is b


@pytest.mark.parametrize("bad, said", [
    (0.5, "'50%'"), ("0.5", "'50%'"), (0.25, "'25%'"), ("abc", "cannot read budget"),
    ("0", "is zero"), ("0G", "is zero"), ("-1G", "is negative"), (-5, "not a positive"),
    ("0%", "not a positive share"), ("x%", "share such as"), (None, "not a budget"),
    (True, "not a budget"), (float("nan"), "not a positive"), (math.inf, "not a positive"),
    ([1], "is a list"), ("8 XB", "cannot read"), ("G", "cannot read"),
    (1.5, "'1.5G' for 1.5 GiB"), ("1.5", "not a whole number of bytes"),
    (np.float32(100.5), "'100.5M' for 100.5 MiB"),
])
def test_refusals_list_every_form(bad, said):
    with pytest.raises(BudgetError) as info:
        parse_budget(bad)
    msg = str(info.value)
    assert said in msg
    for form in ("8GB", "'least'", "'60%'", "'device'"):
        assert form in msg


def test_resolving_a_share_and_a_device_budget():
    share = parse_budget("60%").of_plain(1000)
    assert (share.bytes, share.basis_bytes) == (600, 1000)
    assert share.describe() == "60% of plain Chainer's 1000 B = 600 B"
    dev = parse_budget("device").of_device(10 * G)
    assert dev.bytes == int(10 * G * (1 - DEVICE_MARGIN))
    assert "less 10%" in dev.describe()
    with pytest.raises(BudgetError, match="could not be read"):
        parse_budget("device").of_device(None)
    # resolving leaves other kinds alone
    assert parse_budget("8G").of_plain(1) == parse_budget("8G")


def _chain_graph():
    return Graph.from_edges([4, 4, 4, 4], [(0, 1), (1, 2), (2, 3)])


def test_plan_for_budget_share_in_both_scopes():
    g = _chain_graph()
    for scope in ("activations", "total"):
        need = plain_need_bytes(g, scope)
        plan = plan_for_budget(g, "100%", solver="exact", scope=scope)
        assert plan.budget_bytes == need
        assert plan.predicted_peak_bytes <= need
        if scope == "total":  # plain backprop is the plan at what it needs
            assert not plan.recompute
        assert plan.info["budget"].startswith("100% of plain Chainer's")
    plan = plan_for_budget(g, "80%", solver="exact", scope="activations")
    assert plan.budget_bytes == int(0.8 * plain_need_bytes(g, "activations"))
    assert plan.recompute
    with pytest.raises(BudgetError, match="model's device"):
        plan_for_budget(g, "device", solver="exact")
    assert cr.solve(g, "least", solver="exact").budget_bytes == \
        cr.least_feasible_budget(g, solver="exact")


class _Deep(chainer.Chain):
    """Activations dominate (a wide batch through narrow layers), so that a
    share well under plain Chainer's need is feasible."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.ls = chainer.ChainList(*[L.Linear(32, 32) for _ in range(6)])
            self.out = L.Linear(32, 4)

    def forward(self, x):
        h = x
        for lk in self.ls:
            h = F.tanh(lk(h))
        return self.out(h)


def _step(model, x, t):
    opt = chainer.optimizers.SGD()
    opt.setup(model)
    for _ in range(2):
        model.cleargrads()
        loss = model(x, t)
        loss.backward()
        opt.update()


def _data():
    rs = np.random.RandomState(0)
    return rs.rand(256, 32).astype(np.float32), rs.randint(0, 4, 256).astype(np.int32)


def test_share_through_apply_on_numpy():
    x, t = _data()
    model = cr.apply(L.Classifier(_Deep()), budget="70%", verbose=False)
    _step(model, x, t)
    runner = cr.runner_of(model)
    assert runner.budget_bytes is None and runner.budget.kind == "share"
    (graph,) = runner.planned_graphs()
    (plan,) = runner.plans.values()
    need = plain_need_bytes(graph)
    assert plan.budget_bytes == int(0.7 * need)
    assert plan.info["budget"].startswith("70% of plain Chainer's")
    assert plan.recompute and plan.predicted_peak_bytes <= plan.budget_bytes
    assert runner.last_stats.measured_peak_bytes <= plan.budget_bytes


def test_device_through_apply_on_numpy(monkeypatch):
    x, t = _data()
    # the host's memory as it is: the budget is what it has, less the margin
    model = cr.apply(L.Classifier(_Deep()), budget="device", verbose=False)
    _step(model, x, t)
    runner = cr.runner_of(model)
    b = runner.budget
    assert b.kind == "device" and b.basis_bytes > 0
    assert runner.budget_bytes == int(b.basis_bytes * (1 - DEVICE_MARGIN))
    with open("/proc/meminfo") as f:
        total = int(next(l for l in f if l.startswith("MemTotal:")).split()[1]) * 1024
    assert b.basis_bytes <= total
    (plan,) = runner.plans.values()
    assert plan.budget_bytes == runner.budget_bytes and "available less 10%" in plan.info["budget"]
    # a host with little memory free: the budget follows it and the plan recomputes
    need = plain_need_bytes(runner.planned_graphs()[0])
    small = int(0.7 * need / (1 - DEVICE_MARGIN))
    monkeypatch.setattr(budget_spec, "host_available_bytes", lambda: small)
    model = cr.apply(L.Classifier(_Deep()), budget="device", verbose=False)
    _step(model, x, t)
    runner = cr.runner_of(model)
    assert runner.budget_bytes == int(small * (1 - DEVICE_MARGIN))
    (plan,) = runner.plans.values()
    assert plan.recompute and plan.budget_bytes == runner.budget_bytes


def test_device_on_the_cupy_double():
    from fake_cupy import FakeCupy
    from chainer_recompute.runtime.device import CupyDevice
    fake = FakeCupy()
    fake.device_memory = (3 * G, 16 * G)
    dev = CupyDevice(fake)
    pool = fake.get_default_memory_pool()
    block = pool.malloc(10_000)
    pool.free(block)  # cached by the pool: the device can give it
    assert pool.total_bytes() >= 10_000
    assert dev.available_bytes() == 3 * G + pool.total_bytes()
    pool.set_limit(G)
    assert dev.available_bytes() == G
    pool.set_limit(0)
    # through apply(): resolved at the first plan from the pool and the device
    fake = FakeCupy()
    fake.device_memory = (2 * G, 16 * G)
    x, t = _data()
    with fake.active():
        model = cr.apply(L.Classifier(_Deep()), budget="device", verbose=False)
        _step(model, x, t)
        runner = cr.runner_of(model)
        b = runner.budget
        assert b.kind == "device" and b.basis_bytes >= 2 * G
        assert runner.budget_bytes == int(b.basis_bytes * (1 - DEVICE_MARGIN))
        fake2 = FakeCupy()
        fake2.get_default_memory_pool().set_limit(64 << 20)
    with fake2.active():
        model = cr.apply(L.Classifier(_Deep()), budget="device", verbose=False)
        _step(model, x, t)
        assert cr.runner_of(model).budget.basis_bytes == 64 << 20


def test_share_in_chain_recompute():
    from chainer_recompute import bptt

    class LM(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.embed = L.EmbedID(20, 16)
                self.rnn = L.LSTM(16, 16)
                self.out = L.Linear(16, 20)

        def forward(self, x, t):
            return F.softmax_cross_entropy(self.out(self.rnn(self.embed(x))), t)

    model = LM()
    runner = bptt.ChainRecompute(model, policy="msm", budget="70%", check_iterations=0)
    xs = np.random.RandomState(0).randint(0, 20, (41, 8)).astype(np.int32)
    loss = runner(xs[:-1], xs[1:])
    model.cleargrads()
    loss.backward()
    st = runner.last_stats
    assert st.budget_bytes == int(0.7 * least_for(st.plain_peak_bytes))
    assert st.predicted_peak_bytes <= st.budget_bytes and st.forward_steps > st.t  # recomputes
    with pytest.raises(BudgetError, match="'50%'"):
        bptt.ChainRecompute(model, budget=0.5)


def test_cli_budget_in_two_words_and_a_share(tmp_path, capsys):
    from chainer_recompute.cli import main
    out = tmp_path / "r.json"
    assert main(["--model", "mlp", "--budget", "8", "GB", "--dry-run", "-q",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["budget"]["bytes"] == 8 * GB and report["budget"]["text"] == "8 GB"
    assert "--budget '8 GB'" in report["command"]
    assert main(["--model", "mlp", "--budget", "99%", "--dry-run", "-q",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["budget"]["resolved"].startswith("99% of plain Chainer's")
    assert main(["--model", "mlp", "--budget", "0.5", "--dry-run", "-q"]) == 2
    assert "'50%'" in capsys.readouterr().err


def test_infeasible_budget_said_once_in_a_trainer(tmp_path, capsys):
    """The error is the exception's message; the library's loggers do not
    say it too (a Trainer prints the exception)."""
    from chainer import training
    x, t = _data()
    model = cr.apply(L.Classifier(_Deep()), budget="10K")
    opt = chainer.optimizers.SGD()
    opt.setup(model)
    it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), 64)
    trainer = training.Trainer(training.updaters.StandardUpdater(it, opt), (2, "iteration"),
                               out=str(tmp_path))
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    handler = Keep()
    logging.getLogger("chainer_recompute").addHandler(handler)
    try:
        with pytest.raises(cr.InfeasibleBudgetError) as info:
            trainer.run()
    finally:
        logging.getLogger("chainer_recompute").removeHandler(handler)
    msg = str(info.value)
    assert "raise the budget to at least" in msg and "least_total_budget" not in msg
    assert not [r for r in records if "below the least feasible" in r], records
    err = capsys.readouterr().err
    assert err.count("below the least feasible") == 1  # Trainer's own report of it
