"""chainer_recompute.extensions.RecomputeReport in a Trainer: its keys reach
LogReport and PrintReport."""
import io

import numpy as np
import pytest

import chainer_recompute as cr
from chainer_recompute.runtime import _chainer  # noqa: F401
import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions


class MLP(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(20, 64)
            self.l2 = L.Linear(64, 64)
            self.l3 = L.Linear(64, 3)

    def forward(self, x):
        return self.l3(chainer.functions.relu(self.l2(chainer.functions.relu(self.l1(x)))))


def _trainer(tmp_path, model, n_iter=5):
    rng = np.random.RandomState(0)
    data = chainer.datasets.TupleDataset(rng.randn(64, 20).astype("f"),
                                         rng.randint(0, 3, 64).astype("i"))
    it = chainer.iterators.SerialIterator(data, 16, shuffle=False)
    opt = chainer.optimizers.MomentumSGD(lr=0.01)
    opt.setup(model)
    updater = training.updaters.StandardUpdater(it, opt)
    return training.Trainer(updater, (n_iter, "iteration"), out=str(tmp_path))


def test_keys_in_log_report_and_print_report(tmp_path):
    from chainer_recompute.extensions import RecomputeReport
    model = cr.apply(L.Classifier(MLP()), budget="least", verbose=False)
    trainer = _trainer(tmp_path, model)
    report = RecomputeReport()
    log = extensions.LogReport(trigger=(1, "iteration"))
    out = io.StringIO()
    trainer.extend(report)
    trainer.extend(log)
    trainer.extend(extensions.PrintReport(["iteration", "main/loss"] + report.keys, out=out))
    trainer.run()
    entries = log.log
    assert len(entries) == 5
    assert entries[0]["recompute/planned"] == 1.0  # the first call planned from captures
    planned = [e for e in entries if e.get("recompute/planned") == 1.0]
    assert planned, entries
    for e in planned:
        assert e["recompute/predicted_peak_MiB"] > 0
        assert e["recompute/budget_MiB"] >= e["recompute/predicted_peak_MiB"]
        # at 'least' every planned step drops arrays and re-runs their forwards
        assert e["recompute/recomputed"] > 0, e
    assert any("recompute/measured_peak_MiB" in e for e in planned)
    assert any(e.get("recompute/plain_peak_MiB", 0) > 0 and "recompute/saving_percent" in e
               for e in planned), planned
    text = out.getvalue()
    assert "recompute/predicted_peak_MiB" in text and "recompute/recomputed" in text


def test_units_and_prefix(tmp_path):
    from chainer_recompute.extensions import RecomputeReport
    model = cr.apply(L.Classifier(MLP()), budget="least", verbose=False)
    trainer = _trainer(tmp_path, model, n_iter=3)
    report = RecomputeReport(model, unit="KiB", prefix="cr/")
    log = extensions.LogReport(trigger=(1, "iteration"))
    trainer.extend(report)
    trainer.extend(log)
    trainer.run()
    assert report.keys[0] == "cr/predicted_peak_KiB"
    assert log.log[-1]["cr/predicted_peak_KiB"] > 1.0
    with pytest.raises(ValueError, match="unit"):
        RecomputeReport(unit="MB")


def test_no_recomputing_link_is_a_clear_error(tmp_path):
    from chainer_recompute.extensions import RecomputeReport
    trainer = _trainer(tmp_path, L.Classifier(MLP()), n_iter=1)
    trainer.extend(RecomputeReport())
    with pytest.raises(cr.RecomputeError, match="apply"):
        trainer.run()


def test_exported_from_runtime_too():
    from chainer_recompute.extensions import RecomputeReport
    from chainer_recompute.runtime.extensions import RecomputeReport as Same
    assert RecomputeReport is Same
