"""The executor against plain ``loss.backward()``: loss, every gradient and
BatchNorm statistics bit for bit, over several training steps; measured
peak memory below vanilla's at a tight budget."""
import copy
import gc
import logging
import re

import numpy as np
import pytest

import chainer_recompute as cr
import chainer
import chainer.functions as F
import chainer.links as L

from chainer_recompute.runtime.capture import capture
from chainer_recompute.core.errors import BudgetError, InfeasibleBudgetError, UnknownSolverError
from chainer_recompute.runtime.memory import MemoryMeter
from chainer_recompute.core.search import least_feasible_budget

log = logging.getLogger(__name__)


# ------------------------------------------------------------- models
class MLP(chainer.Chain):
    def __init__(self, width=256, depth=6):
        super().__init__()
        with self.init_scope():
            self.layers = chainer.ChainList(*[L.Linear(width, width) for _ in range(depth)])
            self.out = L.Linear(width, 10)

    def forward(self, x, t):
        h = x
        for lin in self.layers:
            h = F.relu(lin(h))
        return F.softmax_cross_entropy(self.out(h), t)


class ResNet(chainer.Chain):
    """Residual blocks with BatchNorm on big feature maps, few channels:
    activations dominate memory."""

    def __init__(self, c=8, blocks=4):
        super().__init__()
        with self.init_scope():
            self.stem = L.Convolution2D(3, c, 3, pad=1)
            self.convs = chainer.ChainList(*[L.Convolution2D(c, c, 3, pad=1, nobias=True)
                                             for _ in range(2 * blocks)])
            self.bns = chainer.ChainList(*[L.BatchNormalization(c) for _ in range(2 * blocks)])
            self.fc = L.Linear(c, 10)

    def logits(self, x):
        h = F.relu(self.stem(x))
        for i in range(0, len(self.convs), 2):
            r = F.relu(self.bns[i](self.convs[i](h)))
            r = self.bns[i + 1](self.convs[i + 1](r))
            h = F.relu(h + r)
        return self.fc(F.average(h, axis=(2, 3)))

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.logits(x), t)


class ResNetPredictor(ResNet):
    def forward(self, x):
        return self.logits(x)


class DropoutNet(MLP):
    def forward(self, x, t):
        h = x
        for lin in self.layers:
            h = F.dropout(F.relu(lin(h)), 0.3)
        return F.softmax_cross_entropy(self.out(h), t)


class Diamond(chainer.Chain):
    def __init__(self, w=128):
        super().__init__()
        with self.init_scope():
            self.a = L.Linear(w, w)
            self.b1 = L.Linear(w, w)
            self.b2 = L.Linear(w, w)
            self.c = L.Linear(w, 10)

    def forward(self, x, t):
        h = F.tanh(self.a(x))
        h = F.relu(self.b1(h)) * F.sigmoid(self.b2(h))  # both branches read h
        return F.softmax_cross_entropy(self.c(h), t)


class MultiOutput(chainer.Chain):
    def __init__(self, w=128):
        super().__init__()
        with self.init_scope():
            self.a = L.Linear(w, 2 * w)
            self.c = L.Linear(w, 10)

    def forward(self, x, t):
        u, v = F.split_axis(self.a(x), 2, axis=1)
        h = F.tanh(u) + F.relu(v) * F.sigmoid(u)
        return F.softmax_cross_entropy(self.c(h), t)


class SharedLink(chainer.Chain):
    def __init__(self, w=128):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(w, w)
            self.c = L.Linear(w, 10)

    def forward(self, x, t):
        h = F.relu(self.l(x))
        h = F.relu(self.l(h))  # the same link twice
        h = F.relu(self.l(h))
        return F.softmax_cross_entropy(self.c(h), t)


class KeepsIntermediate(SharedLink):
    """The model keeps a Variable it made (as a user might, for logging)."""

    def forward(self, x, t):
        h = F.relu(self.l(x))
        self.kept = F.tanh(h)
        h = F.relu(self.l(self.kept))
        h = F.relu(self.l(h))
        return F.softmax_cross_entropy(self.c(h), t)


def mlp_inputs(batch=64, width=256):
    rs = np.random.RandomState(0)
    return (rs.randn(batch, width).astype(np.float32),
            rs.randint(0, 10, batch).astype(np.int32))


def image_inputs(batch=4, size=32):
    rs = np.random.RandomState(0)
    return (rs.randn(batch, 3, size, size).astype(np.float32),
            rs.randint(0, 10, batch).astype(np.int32))


CASES = {
    "mlp": (MLP, lambda: mlp_inputs()),
    "resnet_bn": (ResNet, lambda: image_inputs()),
    "dropout": (DropoutNet, lambda: mlp_inputs()),
    "diamond": (lambda: Diamond(), lambda: mlp_inputs(width=128)),
    "multi_output": (lambda: MultiOutput(), lambda: mlp_inputs(width=128)),
    "shared_link": (lambda: SharedLink(), lambda: mlp_inputs(width=128)),
    "keeps_intermediate": (lambda: KeepsIntermediate(), lambda: mlp_inputs(width=128)),
}


def _state(model):
    grads = {n: None if p.grad is None else p.grad.copy() for n, p in model.namedparams()}
    stats = {(n, k): np.array(getattr(link, k)) for n, link in model.namedlinks()
             for k in link._persistent}
    return grads, stats


def _assert_same(m1, m2):
    g1, s1 = _state(m1)
    g2, s2 = _state(m2)
    assert g1.keys() == g2.keys()
    for k in g1:
        np.testing.assert_array_equal(g1[k], g2[k], err_msg=f"gradient of {k}")
    for k in s1:
        np.testing.assert_array_equal(s1[k], s2[k], err_msg=f"persistent {k}")


def _train_both(make, inputs, budget, steps=3, solver="approx", strategy="tc"):
    x, t = inputs
    plain = make()
    plain(x, t)  # initialise lazily shaped parameters
    ours = copy.deepcopy(plain)
    cr.apply(ours, budget=budget, solver=solver, strategy=strategy,
             budget_scope="activations" if isinstance(budget, int) else "total")
    opt1, opt2 = chainer.optimizers.MomentumSGD(0.01), chainer.optimizers.MomentumSGD(0.01)
    opt1.setup(plain)
    opt2.setup(ours)
    for step in range(steps):
        xs = x * (1 + 0.1 * step)
        for model, opt in ((plain, opt1), (ours, opt2)):
            np.random.seed(step)  # the same dropout masks in both
            model.cleargrads()
            loss = model(xs, t)
            loss.backward()
            if model is plain:
                loss1, rng1 = loss.array.copy(), np.random.rand()
            else:
                loss2, rng2 = loss.array.copy(), np.random.rand()
        assert loss1 == loss2
        assert rng1 == rng2  # recomputation drew no random numbers
        _assert_same(plain, ours)
        opt1.update()
        opt2.update()
    return plain, ours


def _least(make, inputs, strategy="tc"):
    model = make()
    x, t = inputs
    model(x, t)
    g = capture(model, x, t)
    return g, least_feasible_budget(g, solver="approx", strategy=strategy)


@pytest.mark.parametrize("name", sorted(CASES))
def test_identical_to_plain_backprop(name):
    make, inputs = CASES[name]
    g, least = _least(make, inputs())
    plain, ours = _train_both(make, inputs(), budget=least)
    stats = cr.runner_of(ours).last_stats
    assert stats.n_dropped > 0, "the tight budget should drop something"
    assert stats.recomputed_nodes > 0
    # every dropped array is released again after backward, and checkpoints too
    assert stats.n_released >= stats.n_dropped
    if name == "keeps_intermediate":
        np.testing.assert_array_equal(ours.kept.array, plain.kept.array)


@pytest.mark.parametrize("strategy", ["tc", "mc"])
def test_exact_solver_and_both_strategies(strategy):
    make, inputs = CASES["resnet_bn"]
    g, least = _least(make, inputs(), strategy)
    _train_both(make, inputs(), budget=least, solver="exact", strategy=strategy, steps=2)


def _peak(model, x, t):
    model.cleargrads()
    gc.collect()
    with MemoryMeter() as meter:
        loss = model(x, t)
        loss.backward()
        del loss
    return meter.result.peak_bytes


@pytest.mark.parametrize("name", ["mlp", "resnet_bn", "dropout", "diamond", "shared_link"])
def test_measured_peak_below_vanilla(name):
    make, inputs = CASES[name]
    x, t = inputs()
    g, least = _least(make, (x, t))
    plain = make()
    plain(x, t)
    ours = copy.deepcopy(plain)
    cr.apply(ours, budget=least, budget_scope="activations")
    for _ in range(2):  # the first call is recorded, the second plans
        ours(x, t).backward()
    vanilla, recompute = _peak(plain, x, t), _peak(ours, x, t)
    plan = cr.runner_of(ours).plan_for(ours, x, t)
    log.warning("%s: vanilla %d B, recompute %d B (%.0f%%), plan predicted %d B, simulated %d B",
                name, vanilla, recompute, 100.0 * recompute / vanilla,
                plan.predicted_peak_bytes, plan.simulated_peak_bytes)
    assert recompute < vanilla


def test_chainer_resnet50_tiny_input():
    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.r = L.ResNet50Layers(pretrained_model=None)

        def forward(self, x, t):
            return F.softmax_cross_entropy(self.r(x, layers=["fc6"])["fc6"], t)

    x = np.random.RandomState(0).randn(2, 3, 32, 32).astype(np.float32)
    t = np.array([1, 2], np.int32)
    _, least = _least(Net, (x, t))
    _train_both(Net, (x, t), budget=least, steps=2)


# ---------------------------------------------------------- behaviour
def test_eval_mode_runs_plain_forward_without_planning():
    make, inputs = CASES["resnet_bn"]
    x, t = inputs()
    model = make()
    model(x, t)
    plain_out = model(x, t).array
    cr.apply(model, budget="1G")
    with chainer.using_config("train", False):
        a = model(x, t)
    runner = cr.runner_of(model)
    cr.remove(model)
    with chainer.using_config("train", False):
        b = model(x, t)
    np.testing.assert_array_equal(a.array, b.array)
    cr.apply(model, budget="1G")
    with chainer.no_backprop_mode():
        model(x, t)
    assert runner.plans == {} and cr.runner_of(model).plans == {}
    assert plain_out.shape == a.array.shape


def test_plan_cache_per_signature_and_bound():
    make, inputs = CASES["mlp"]
    x, t = inputs()
    model = make()
    cr.apply(model, budget="1G", tuning=cr.Tuning(max_plans=2))
    runner = cr.runner_of(model)
    model(x, t).backward()  # recorded, planned at the end of its backward
    assert len(runner.plans) == 1
    model(x, t).backward()  # planned
    assert len(runner.plans) == 1
    for _ in range(2):
        model(x[:10], t[:10]).backward()  # a smaller last batch: planned again
    assert len(runner.plans) == 2
    for _ in range(2):
        model(x[:5], t[:5]).backward()
    assert len(runner.plans) == 2  # bounded


def test_backward_twice_matches_plain():
    make, inputs = CASES["resnet_bn"]
    x, t = inputs()
    _, least = _least(make, (x, t))
    plain = make()
    plain(x, t)
    ours = copy.deepcopy(plain)
    cr.apply(ours, budget=least, budget_scope="activations")
    for model in (plain, ours):
        model.cleargrads()
        loss = model(x, t)
        loss.backward()
        loss.backward()  # gradients accumulate, as in plain Chainer
    _assert_same(plain, ours)


def test_no_backward_leaks_nothing():
    make, inputs = CASES["resnet_bn"]
    x, t = inputs()
    _, least = _least(make, (x, t))
    model = make()
    model(x, t)
    cr.apply(model, budget=least, budget_scope="activations")
    model(x, t).backward()  # recorded
    model(x, t).backward()  # planned
    gc.collect()
    gc.disable()  # reference counting alone must free the graph
    try:
        with MemoryMeter() as meter:
            for _ in range(3):
                model(x, t)  # loss dropped without backward
        assert meter.result.end_bytes - meter.result.start_bytes <= 0
    finally:
        gc.enable()


class Switch(MLP):
    """An MLP whose depth the caller switches: its graph changes."""
    deep = True

    def forward(self, x, t):
        h = x
        for lin in self.layers if self.deep else self.layers[:2]:
            h = F.relu(lin(h))
        return F.softmax_cross_entropy(self.out(h), t)


def test_graph_change_is_detected_and_replanned(caplog):
    x, t = mlp_inputs()
    _, least = _least(Switch, (x, t))
    plain = Switch()
    plain(x, t)
    ours = copy.deepcopy(plain)
    cr.apply(ours, budget=least, budget_scope="activations")
    for _ in range(2):
        for model in (plain, ours):
            model.cleargrads()
            model(x, t).backward()  # recorded, then planned
    assert cr.runner_of(ours).last_stats.path == "planned"
    for model in (plain, ours):
        model.deep = False
        model.cleargrads()
        with caplog.at_level(logging.INFO):
            model(x, t).backward()
    assert "graph changed" in caplog.text
    assert cr.runner_of(ours).last_stats.path == "mismatch"
    _assert_same(plain, ours)
    for model in (plain, ours):
        model.cleargrads()
        model(x, t).backward()
    _assert_same(plain, ours)
    (entry,) = cr.runner_of(ours).signatures()
    assert len(entry.structures) == 2  # one plan per structure
    assert cr.runner_of(ours).last_stats.path == "planned"
    for model in (plain, ours):  # back to the first structure: its plan is still there
        model.deep = True
        model.cleargrads()
        model(x, t).backward()
    _assert_same(plain, ours)
    assert cr.runner_of(ours).last_stats.path == "planned"


def _array_facts(graph):
    return [(a.shape, a.dtype, a.nbytes, a.kind, a.producer, a.view_of, a.dies_at,
             a.buffer_bytes) for a in graph.arrays]


def test_followed_iterations_share_the_plans_records_and_a_change_records_its_own():
    """The iterations that follow a plan share its output records (one
    made per array, not per step); a later one that leaves the plan records
    its own graph as a fresh recording of the new structure would, and
    leaves the shared records as they were."""
    x, t = mlp_inputs()
    _, least = _least(Switch, (x, t))
    ours = Switch()
    fresh = copy.deepcopy(ours)
    fresh.deep = False
    cr.apply(ours, budget=least, budget_scope="activations")
    hooks, losses = [], []  # (a graph kept keeps its iteration's hook)
    for _ in range(3):
        ours.cleargrads()
        losses.append(ours(x, t))
        losses[-1].backward()  # recorded, then planned twice
        hooks.append(cr.runner_of(ours).steps.last_hook())
    program = hooks[-1].program
    assert hooks[-1].stats.path == hooks[-2].stats.path == "planned"
    assert hooks[-2].program is program
    outputs = [a for c in hooks[-1].recorder.calls for a in c.out_ids]
    assert outputs and all(hooks[-1].recorder.arrays[a] is program.records[a]
                           is hooks[-2].recorder.arrays[a] for a in outputs)
    before = {a: (r.shape, r.nbytes, r.producer, r.view_of, r.dies_at)
              for a, r in program.records.items()}
    del hooks, losses
    ours.deep = False
    ours.cleargrads()
    ours(x, t).backward()
    assert cr.runner_of(ours).last_stats.path == "mismatch"
    ours.cleargrads()
    ours(x, t).backward()  # planned from the mismatched iteration's recording
    assert {a: (r.shape, r.nbytes, r.producer, r.view_of, r.dies_at)
            for a, r in program.records.items()} == before
    cr.apply(fresh, budget=least, budget_scope="activations")
    fresh.cleargrads()
    fresh(x, t).backward()
    fresh.cleargrads()
    fresh(x, t).backward()
    (mine,) = [s.graph for s in cr.runner_of(ours).signatures()[0].structures
               if s.program is not program]
    (theirs,) = [s.graph for s in cr.runner_of(fresh).signatures()[0].structures]
    assert _array_facts(mine) == _array_facts(theirs)


def _hook_state(hook):
    """What an iteration's hook and its recorder hold, as plain values."""
    rec = hook.recorder
    calls = [(c.index, c.op, c.in_shapes, c.in_args, c.link, c.in_ids, c.out_ids, c.keep_in,
              c.keep_out, c.out_meta, c.out_view, c.as_planned, c.has_backward, c.inner_ids,
              c.measured, c.unrecorded_peak, c.func() is not None) for c in rec.calls]
    arrays = [(r.shape, r.dtype, r.nbytes, r.kind, r.producer, r.name, r.view_of, r.dies_at,
               r.buffer_bytes, r.made_at) for r in rec.arrays]
    stats = hook.stats
    return dict(
        calls=calls, arrays=arrays, mapped=sorted(rec.array_of.ids.values()),
        params=sorted(rec.param_refs), returned=rec.returned, recording=rec.recording,
        depth=rec._depth, pending=rec._pending is not None, index_of=sorted(rec.index_of.values()),
        stats=(stats.path, stats.n_dropped, stats.n_released, stats.recomputed_nodes,
               stats.mismatch, stats.reordered),
        mismatch_at=hook.mismatch_at, released=sorted(hook.released.items()),
        kept=sorted(hook.kept), pinned=sorted(hook._pinned_at.items()),
        pinned_ok=sorted(hook._pinned_ok), watched=sorted(hook.params),
        fingerprints=sorted(hook.fingerprints.items()), regenerated=sorted(hook.regenerated),
        no_release=hook.no_release, backward_done=hook.backward_done)


def _through_the_recorder(monkeypatch):
    """Chainer's calls to the executor's hook go to its recorder's methods,
    which call the hook back (the path that is not fused)."""
    from chainer_recompute.runtime.executor import IterationHook
    for name in ("forward_preprocess", "forward_postprocess", "backward_preprocess",
                 "backward_postprocess"):
        monkeypatch.setattr(IterationHook, name,
                            lambda self, *a, _n=name: getattr(self.recorder, _n)(*a))


@pytest.mark.parametrize("deep", [True, False], ids=["followed", "left-at-a-call"])
def test_a_followed_calls_fused_work_leaves_what_the_recorders_leaves(monkeypatch, deep):
    """A call of an iteration that follows its one plan runs the recorder's
    and the executor's work in one hook call: the recorder and the hook end
    in the state the recorder's own methods (calling the hook back) leave,
    the gradients are the same, and an iteration that leaves the plan at a
    call hands over with nothing different (its recording, the mismatch
    and what was released and pinned until then)."""
    from chainer_recompute.runtime.executor import IterationHook
    x, t = mlp_inputs()
    _, least = _least(Switch, (x, t))
    model = Switch()
    cr.apply(model, budget=least, budget_scope="activations")
    for _ in range(2):
        model.cleargrads()
        model(x, t).backward()  # recorded, then planned
    (entry,) = cr.runner_of(model).signatures()
    (program,) = [s.program for s in entry.structures]
    assert program.dropped
    model.deep = deep

    def run():
        hook = IterationHook([program], link=model, args=[model, x, t])  # (as the runner)
        model.cleargrads()
        with hook:
            loss = Switch.forward(model, x, t)
        hook.finish(loss)
        forward = _hook_state(hook)
        loss.backward()
        return forward, _hook_state(hook), {n: p.grad.copy() for n, p in model.namedparams()
                                            if p.grad is not None}

    from chainer_recompute.runtime.capture.recorder import Recorder
    counted = []  # calls that went to the recorder's forward_preprocess
    original = Recorder.forward_preprocess
    monkeypatch.setattr(Recorder, "forward_preprocess",
                        lambda self, *a: counted.append(1) or original(self, *a))
    fused = run()
    n_fused = len(counted)
    _through_the_recorder(monkeypatch)
    del counted[:]
    reference = run()
    assert fused[0] == reference[0]  # after the forward
    assert fused[1] == reference[1]  # after the backward
    assert fused[2].keys() == reference[2].keys()
    for name, g in reference[2].items():
        np.testing.assert_array_equal(fused[2][name], g, err_msg=name)
    state = fused[1]
    if deep:
        assert state["stats"][0] == "planned" and state["regenerated"], state["stats"]
        assert n_fused == 0  # every call fused
    else:
        assert state["stats"][0] == "mismatch" and state["recording"]
        assert 0 < n_fused < len(counted)  # fused until the mismatch
        assert fused[0]["calls"][-1][1] == "SoftmaxCrossEntropy"


def test_budget_below_least_feasible_changes_nothing():
    make, inputs = CASES["resnet_bn"]
    x, t = inputs()
    g, least = _least(make, (x, t))
    model = make()
    model(x, t)
    cr.apply(model, budget=int(least * 0.5), budget_scope="activations")
    before = _state(model)[1]
    with pytest.raises(InfeasibleBudgetError) as info:
        model(x, t)  # planned from captures before it runs
    assert "least feasible" in str(info.value)
    assert info.value.least_feasible_bytes == least
    assert not chainer.get_function_hooks()
    after = _state(model)[1]
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])


def test_bad_arguments_are_rejected_before_anything_changes():
    model = MLP()
    with pytest.raises(BudgetError, match="accepted forms"):
        cr.apply(model, budget="lots")
    with pytest.raises(UnknownSolverError, match="approx"):
        cr.apply(model, budget="1G", solver="magic")
    # counts: refused at once, not at the first call (a TypeError there)
    for name, bad in (("check_iterations", "3"), ("check_iterations", -1), ("max_plans", 0),
                      ("max_structures", 1.5)):
        with pytest.raises(cr.RecomputeError, match=f"{name} must be a whole number"):
            cr.apply(model, budget="1G", tuning=cr.Tuning(**{name: bad}))
    with pytest.raises(cr.RecomputeError, match="check_iterations must be a whole number"):
        from chainer_recompute.runtime import bptt
        bptt.ChainRecompute(L.LSTM(4, 4), slots=2, check_iterations="2")
    assert type(model) is MLP and cr.runner_of(model) is None
    assert cr.apply(MLP(), budget="1G", tuning=cr.Tuning(check_iterations=np.int64(2)))


def test_apply_remove_and_serialization(tmp_path):
    make, inputs = CASES["resnet_bn"]
    x, t = inputs()
    model = make()
    model(x, t)
    keys_plain = sorted(n for n, _ in model.namedparams())
    cr.apply(model, budget="1G")
    assert isinstance(model, ResNet)
    assert sorted(n for n, _ in model.namedparams()) == keys_plain
    chainer.serializers.save_npz(tmp_path / "m.npz", model)
    fresh = make()
    fresh(x, t)
    chainer.serializers.load_npz(tmp_path / "m.npz", fresh)
    assert sorted(np.load(tmp_path / "m.npz").files) == sorted(
        np.load(_save_plain(model, tmp_path)).files)
    copied = model.copy(mode="copy")
    assert cr.runner_of(copied) is not None
    copied(x, t).backward()
    model.to_device("@numpy")
    cr.remove(model)
    assert type(model) is ResNet and cr.runner_of(model) is None


def _save_plain(model, tmp_path):
    plain = copy.deepcopy(model)
    cr.remove(plain)
    chainer.serializers.save_npz(tmp_path / "plain.npz", plain)
    return tmp_path / "plain.npz"


def test_trainer_end_to_end(tmp_path):
    from chainer import training
    from chainer.training import extensions

    rs = np.random.RandomState(0)
    data = chainer.datasets.TupleDataset(rs.randn(64, 3, 16, 16).astype(np.float32),
                                         rs.randint(0, 10, 64).astype(np.int32))
    model = L.Classifier(ResNetPredictor(c=4, blocks=2))
    cr.apply(model, budget="64M")  # the one changed line
    opt = chainer.optimizers.Adam()
    opt.setup(model)
    train_iter = chainer.iterators.SerialIterator(data, 16)
    test_iter = chainer.iterators.SerialIterator(data, 16, repeat=False, shuffle=False)
    updater = training.updaters.StandardUpdater(train_iter, opt)
    trainer = training.Trainer(updater, (6, "iteration"), out=str(tmp_path))
    trainer.extend(extensions.Evaluator(test_iter, model), trigger=(3, "iteration"))
    trainer.extend(extensions.LogReport(trigger=(3, "iteration")))
    trainer.run()
    log_entries = trainer.get_extension("LogReport").log
    assert len(log_entries) == 2
    assert all(np.isfinite(e["main/loss"]) and "validation/main/loss" in e for e in log_entries)
    assert len(cr.runner_of(model).plans) == 1


def test_capture_at_a_small_batch_and_scale():
    make, inputs = CASES["resnet_bn"]
    x, t = image_inputs(batch=8)
    _, least = _least(make, (x, t))
    plain = make()
    plain(x, t)
    ours = copy.deepcopy(plain)
    cr.apply(ours, budget=least, capture_batch=2, budget_scope="activations")
    for model in (plain, ours):
        for _ in range(2):
            model.cleargrads()
            model(x, t).backward()
    _assert_same(plain, ours)
    (entry,) = cr.runner_of(ours).signatures()
    assert entry.structures[0].graph.meta["scaled_from"] == 2 and entry.structures[0].graph.batch_size == 8
    assert cr.runner_of(ours).last_stats.mismatch is None


def test_capture_batch_falls_back_when_the_model_does_not_scale(caplog):
    """A model whose depth depends on the batch: the two small captures
    differ, so capture_batch says so once and the model is planned from its
    first call (recorded plainly), then runs planned and identical."""
    class BatchDependent(MLP):
        def forward(self, x, t):
            h = x
            for lin in self.layers[: min(len(x), 4)]:  # depth depends on the batch
                h = F.relu(lin(h))
            return F.softmax_cross_entropy(self.out(h), t)

    x, t = mlp_inputs(batch=8)
    plain = BatchDependent()
    plain(x, t)
    ours = copy.deepcopy(plain)
    cr.apply(ours, budget="1G", capture_batch=2)
    with caplog.at_level(logging.WARNING):
        for model in (plain, ours):
            for _ in range(3):
                model.cleargrads()
                model(x, t).backward()
    _assert_same(plain, ours)
    runner = cr.runner_of(ours)
    said = [r.getMessage() for r in caplog.records if "capture_batch=2" in r.getMessage()]
    assert len(said) == 1 and "depends on the input shape" in said[0], said
    assert runner.last_stats.mismatch is None  # planned at full size
    assert runner.last_stats.path == "planned"
    (entry,) = runner.signatures()
    assert entry.recorded == 0 and entry.structures[0].graph.batch_size == 8
    assert "scaled_from" not in entry.structures[0].graph.meta


class NoisyNet(MLP):
    """A function that draws fresh noise in its forward (not held in the
    function object): it must never be dropped and recomputed."""

    class AddNoise(chainer.FunctionNode):
        def forward(self, inputs):
            x, = inputs
            return x + np.random.rand(*x.shape).astype(x.dtype),

        def backward(self, indexes, gy):
            return gy

    def forward(self, x, t):
        h = x
        for lin in self.layers:
            h = self.AddNoise().apply((F.relu(lin(h)),))[0]
        return F.softmax_cross_entropy(self.out(h), t)


def test_unsafe_functions_are_kept_and_gradients_stay_identical(caplog):
    x, t = mlp_inputs()
    g, least = _least(NoisyNet, (x, t))
    unsafe = [n.id for n in g.nodes if not n.recomputable]
    assert [g.nodes[v].op for v in unsafe] == ["AddNoise"] * 6
    plain, ours = _train_both(NoisyNet, (x, t), budget=least, steps=2)  # the report propagates
    said = [r.getMessage() for r in caplog.records if "cannot be recomputed" in r.getMessage()]
    (entry,) = cr.runner_of(ours).signatures()
    program = entry.structures[0].program
    # each kind of function once, with its count: the unsafe functions the
    # plan would have dropped (how many depends on the measured times'
    # plan; the others it keeps anyway)
    assert program.unsafe and set(program.unsafe) <= set(unsafe)
    n = len(program.unsafe)
    form = (r"1 function cannot be recomputed safely and is kept: AddNoise \(it draws fresh randomness .*\)"
            if n == 1 else
            rf"{n} functions cannot be recomputed safely and are kept: "
            rf"AddNoise \(it draws fresh randomness .*\) x{n}")
    assert said and all(re.fullmatch(form, m) for m in said), (n, said)
    assert not set(unsafe) & program.dropped
    assert cr.runner_of(ours).last_stats.recomputed_nodes > 0


def test_two_live_graphs_share_one_saved_copy_of_a_parameter():
    """Two live graphs of one applied Link (a GAN discriminator's real and
    fake batches), updated between two backward passes: the values saved
    before the update are one copy per parameter, not one per graph, and
    the second backward pass is still plain backprop's."""
    from chainer_recompute.runtime.executor import _LIVE
    x, t = mlp_inputs()
    plain = MLP()
    plain(x, t)
    ours = copy.deepcopy(plain)
    # check_iterations=0: the copies at the first update would be measured
    # and the plan corrected to one that keeps what the second pass reads
    # (no copies then); the plan drops nothing but releases arrays after
    # their last backward reader: kept on the executor's path
    cr.apply(ours, budget="least", verbose=False,
             tuning=cr.Tuning(cost="flops", check_iterations=0))
    cr.runner_of(ours).plain_when_nothing_dropped = False
    grads, saved = {}, []
    for model in (plain, ours):
        opt = chainer.optimizers.SGD(0.1)
        opt.setup(model)
        for _ in range(4):
            a, b = model(x[:32], t[:32]), model(x[32:], t[32:])
            model.cleargrads()
            (a + b).backward()
            opt.update()
            if model is ours:  # ids and counts: a reference would keep a hook alive
                saved.append((sum(1 for hook in _LIVE if hook.snapshots),
                              [id(arr) for hook in _LIVE for arr in hook.snapshots.values()]))
            model.cleargrads()
            b.backward()  # through the updated parameters' old values
            grads.setdefault(id(model), []).append([p.grad.copy() for p in model.params()])
            opt.update()
            del a, b
    n_params = len(list(ours.params()))
    # (once the second pass is known, the plan keeps what it reads: release
    # mode 'all', nothing saved; before that, the first planned update saves)
    assert any(n_hooks >= 1 for n_hooks, _ in saved), saved
    for n_hooks, ids in saved:
        assert len(ids) == n_hooks * len(set(ids)) and len(set(ids)) <= n_params
    for g_plain, g_ours in zip(grads[id(plain)], grads[id(ours)]):
        for u, v in zip(g_plain, g_ours):
            np.testing.assert_array_equal(u, v)


def test_numpy_scalar_argument_is_part_of_the_signature_by_value():
    """A forward that takes a schedule value as an np.float32 (a new object
    every call) is planned, not recorded on every call."""
    class Scaled(MLP):
        def forward(self, x, t, scale):
            return super().forward(x * scale, t)

    x, t = mlp_inputs()
    model = Scaled(width=256, depth=4)
    cr.apply(model, budget="least", verbose=False)
    paths = []
    for k in range(4):
        model.cleargrads()
        model(x, t, np.float32(0.5) + np.float32(0)).backward()
        paths.append(cr.runner_of(model).last_stats.path)
    assert paths == ["planned", "planned", "planned", "planned"]  # the first from captures
    # another value: another signature, planned before it runs from the
    # graph of the first (the same shapes), not recorded
    model(x, t, np.float32(0.25)).backward()
    runner = cr.runner_of(model)
    assert runner.last_stats.path == "planned" and len(runner.signatures()) == 2
    assert runner.shapes_derived == 1
