"""The optimizer's update is in the plan from the first planned step: the
state every update rule will make, and the largest temporary of the update
(its hooks included), measured on throw-away copies before the first
``optimizer.update()`` (``runtime/optimizer_update.py``), against the real
allocator (tracemalloc) around real updates."""
from __future__ import annotations

import gc
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
import chainer.optimizer_hooks as H
import chainer.optimizers as O

from chainer_recompute.runtime import optimizer_update
from chainer_recompute.runtime.capture import state_bytes
from chainer_recompute.runtime.memory import MemoryMeter, parameter_bytes
from chainer_recompute.runtime.optimizer_update import optimizers_of, update_bytes
from test_step_budget import train

OPTIMIZERS: Dict[str, Callable[[], chainer.Optimizer]] = {
    "SGD": lambda: O.SGD(),
    "MomentumSGD": lambda: O.MomentumSGD(),
    "NesterovAG": lambda: O.NesterovAG(),
    "CorrectedMomentumSGD": lambda: O.CorrectedMomentumSGD(),
    "AdaGrad": lambda: O.AdaGrad(),
    "AdaDelta": lambda: O.AdaDelta(),
    "RMSprop": lambda: O.RMSprop(),
    "RMSpropGraves": lambda: O.RMSpropGraves(),
    "Adam": lambda: O.Adam(),
    "AMSGrad": lambda: O.AMSGrad(),
    "AdaBound": lambda: O.AdaBound(),
    "AMSBound": lambda: O.AMSBound(),
    "AdamW": lambda: O.AdamW(weight_decay_rate=0.01),
    "SMORMS3": lambda: O.SMORMS3(),
    "MSVAG": lambda: O.MSVAG(),
}

#: Every hook of chainer.optimizer_hooks (GradientClipping is whole-optimizer).
HOOKS: Dict[str, Callable[[], Any]] = {
    "WeightDecay": lambda: H.WeightDecay(1e-4),
    "Lasso": lambda: H.Lasso(1e-4),
    "GradientClipping": lambda: H.GradientClipping(1e-3),  # small: it clips
    "GradientHardClipping": lambda: H.GradientHardClipping(-1e-3, 1e-3),
    "GradientNoise": lambda: H.GradientNoise(0.01),
    "GradientLARS": lambda: H.GradientLARS(threshold=1e-6, weight_decay=1e-4),
}
PER_PARAM_HOOKS = [n for n in HOOKS if n != "GradientClipping"]


def linears(dtype: Any = np.float32) -> chainer.Chain:
    """A small chain of Linear layers; the largest parameter (300x200) is
    in the last layer, so the first update's peak comes with most of the
    state made (the plan counts all of it)."""
    model = chainer.Sequential(L.Linear(30, 100), F.relu, L.Linear(100, 200), F.relu,
                               L.Linear(200, 300))
    if dtype != np.float32:
        for p in model.params():
            p.array = p.array.astype(dtype)
    return model


class Updates:
    """The plan's figures at the end of the first backward and the peaks of
    the first two real updates, all counted by one outer meter."""

    def __init__(self, make_opt: Callable[[], chainer.Optimizer], *, hook: Any = None,
                 rule_hook: Optional[Callable[[], Any]] = None, dtype: Any = np.float32,
                 fp32_update: bool = False) -> None:
        outer = MemoryMeter()
        outer.start()
        try:
            np.random.seed(0)
            model = linears(dtype)
            opt = make_opt()
            if fp32_update:
                opt.use_fp32_update()
            opt.setup(model)
            if hook is not None:
                opt.add_hook(hook)
            if rule_hook is not None:
                for p in model.params():
                    p.update_rule.add_hook(rule_hook())
            self.largest = max(p.array.nbytes for p in model.params())
            self.peaks: List[int] = []
            for step in range(2):
                self._backward(model, dtype)
                if step == 0:
                    self.sb = state_bytes(model)  # where the plan is made
                    self.predicted = (self.sb["params"] + self.sb["param_grads"]
                                      + self.sb["optimizer_state"] + self.sb["update_transient"])
                with MemoryMeter() as m:
                    opt.update()
                self.peaks.append(m.result.absolute_peak_bytes)
                if step == 0:
                    self.state = parameter_bytes(model.params())["optimizer_state"]
            del model, opt
        finally:
            outer.stop()

    @staticmethod
    def _backward(model: chainer.Link, dtype: Any) -> None:
        x = np.random.RandomState(1).rand(4, 30).astype(dtype)
        loss = F.sum(model(x))
        model.cleargrads()
        loss.backward()
        del loss, x

    def check(self) -> None:
        what = (f"predicted {self.predicted} ({self.sb}), first two updates peaked at "
                f"{self.peaks}, largest parameter {self.largest}")
        assert self.sb["optimizer_state"] == self.state, what
        assert self.predicted >= max(self.peaks), what
        assert self.predicted - max(self.peaks) <= self.largest, what


# (MSVAG's first update, in plain Chainer, divides 0 by 0)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_and_update_peak_of_every_optimizer(name):
    Updates(OPTIMIZERS[name]).check()


@pytest.mark.parametrize("name", ["Adam", "MomentumSGD"])
def test_fp16_parameters_and_fp32_update(name):
    """Float16 parameters: Adam computes in float32 (temporaries twice the
    parameter's bytes); with ``use_fp32_update`` the rule keeps a float32
    master copy (state) and converts the gradient (temporary)."""
    plain = Updates(OPTIMIZERS[name], dtype=np.float16)
    plain.check()
    fp32 = Updates(OPTIMIZERS[name], dtype=np.float16, fp32_update=True)
    fp32.check()
    assert fp32.sb["optimizer_state"] > plain.sb["optimizer_state"]  # the master copy


@pytest.mark.parametrize("optimizer", ["MomentumSGD", "Adam"])
@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_optimizer_hooks(optimizer, hook):
    Updates(OPTIMIZERS[optimizer], hook=HOOKS[hook]()).check()


@pytest.mark.parametrize("hook", PER_PARAM_HOOKS)
def test_update_rule_hooks(hook):
    """Hooks added to each rule (``rule.add_hook``) run inside its update."""
    Updates(OPTIMIZERS["MomentumSGD"], rule_hook=HOOKS[hook]).check()


class _Big:
    """A 2048x2048 weight (16 MiB: measured on three slices of its rows,
    of 1, 2 and 4 MiB) and its bias, with a gradient each, and the
    optimizer's figures for them."""

    def __init__(self, make_opt: Callable[[], chainer.Optimizer], hook: Any = None,
                 rule_hook: Optional[Callable[[], Any]] = None) -> None:
        np.random.seed(0)
        self.model = L.Linear(2048, 2048)
        opt = make_opt()
        opt.setup(self.model)
        if hook is not None:
            opt.add_hook(hook)
        for p in self.model.params():
            if rule_hook is not None:
                p.update_rule.add_hook(rule_hook())
            p.grad = np.random.rand(*p.shape).astype(p.dtype)
        self.opt = opt

    def figures(self) -> Tuple[Any, int]:
        """The figures and the peak of their measurement."""
        gc.collect()
        with MemoryMeter() as m:
            got = update_bytes(self.model.params(), owner=object())
        return got, m.result.peak_bytes


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("case", sorted(OPTIMIZERS) + [f"MomentumSGD+{h}" for h in HOOKS]
                         + ["MomentumSGD+rule WeightDecay"])
@pytest.mark.slow  # 12 s over its cases
def test_a_large_parameter_measured_on_slices_as_whole(case, monkeypatch):
    """A parameter of more than eight slices (optimizer_update.SLICE_BYTES)
    is measured on three copies of its first rows and the figures
    extrapolated: on NumPy they are the figures of the whole parameter's
    measurement, exactly, for every optimizer and hook (the whole-optimizer
    GradientClipping's too), at under half the memory."""
    name, _, hook = case.partition("+")
    rule_hook = HOOKS[hook[5:]] if hook.startswith("rule ") else None
    opt_hook = HOOKS[hook]() if hook and rule_hook is None else None
    big = _Big(OPTIMIZERS[name], opt_hook, rule_hook)
    assert optimizer_update._slices(big.model.W) == (128, 256, 512)
    sliced, sliced_peak = big.figures()
    monkeypatch.setattr(optimizer_update, "_slices", lambda param: None)
    whole, whole_peak = big.figures()
    assert sliced == whole
    assert sliced_peak < whole_peak / 2, (sliced_peak, whole_peak)


class _OuterProduct(chainer.UpdateRule):
    """SGD, plus a rows x rows temporary (``grad @ grad.T``): its peak
    grows with the square of the rows."""

    def __init__(self) -> None:
        super().__init__()
        self.hyperparam.lr = 1e-3

    def update_core_cpu(self, param: Any) -> None:
        g = param.grad
        param.array -= self.hyperparam.lr * (g @ g.T)[:, :1]


def test_a_temporary_not_linear_in_the_rows_is_measured_whole():
    """Figures that do not grow linearly with the rows (three slices off
    the line by more than the slack) are measured on the whole parameter."""
    model = L.Linear(2048, 2048)
    model.W.grad = np.ones_like(model.W.array)
    model.W.update_rule = _OuterProduct()
    model.b.update_rule = _OuterProduct()
    got = update_bytes([model.W], owner=object())
    rows = model.W.shape[0]
    assert got.update_transient_bytes >= rows * rows * 4, got


def test_hooks_add_their_temporaries():
    """Lasso's ``sign(p)`` and ``rate * sign`` come before MomentumSGD's
    one temporary: the figure is Lasso's, above the plain update's."""
    plain = Updates(OPTIMIZERS["MomentumSGD"])
    lasso = Updates(OPTIMIZERS["MomentumSGD"], hook=HOOKS["Lasso"]())
    assert lasso.sb["update_transient"] > plain.sb["update_transient"]


def test_dynamic_loss_scaling():
    """``loss_scaling()`` checks every gradient for NaN before the update."""
    def make() -> chainer.Optimizer:
        opt = O.Adam()
        opt.loss_scaling()
        return opt
    Updates(make).check()


# ------------------------------------------------------------ no trace
def _snapshot(model: chainer.Link, opt: chainer.Optimizer, ids: bool = True) -> Dict[str, Any]:
    """Everything an update reads or writes (with ``ids``, which arrays too)."""
    rec: Dict[str, Any] = {"opt.t": opt.t, "rng": np.random.get_state()[1].tobytes()}
    for path, p in model.namedparams():
        rule = p.update_rule
        state = None if rule.state is None else {
            k: ((id(v),) if ids else ()) + (v.tobytes(),) for k, v in rule.state.items()}
        rec[path] = (p.array.tobytes(), None if p.grad is None else p.grad.tobytes(), rule.t,
                     state, id(rule._fp32_param) if ids else None)
    return rec


def test_measurement_leaves_no_trace():
    """Measuring with hooks that draw random numbers (GradientNoise) and
    write the gradient (WeightDecay), before and after the first update:
    NumPy's random state, the parameters, gradients, rules' state and
    ``t`` are as they were, the runtime's update watchers see nothing, and
    the training run is the one plain Chainer runs."""
    from chainer_recompute.runtime.param_updates import (add_update_watcher,
                                                         remove_update_watcher)

    def run(measure: bool) -> Dict[str, Any]:
        np.random.seed(0)
        model = linears()
        opt = O.Adam().setup(model)
        opt.add_hook(H.GradientNoise(0.01))
        opt.add_hook(H.WeightDecay(1e-4))
        for p in model.params():
            p.update_rule.add_hook(H.GradientNoise(0.01), name="rule_noise")
        seen: List[Any] = []

        def watch(param: Any) -> bool:
            seen.append(param)
            return False
        add_update_watcher(watch)  # UpdateRule.update is patched meanwhile
        try:
            for step in range(2):
                Updates._backward(model, np.float32)
                if measure:
                    before = _snapshot(model, opt)
                    optimizer_update._CACHES.pop(model, None)  # measured again each time
                    got = update_bytes(model.params(), owner=model)
                    assert got.update_transient_bytes > 0 and not got.unmeasured
                    assert _snapshot(model, opt) == before, step
                    assert seen == [], "the runtime's update watchers saw a throw-away update"
                opt.update()
                assert len(seen) == len(list(model.params()))
                seen.clear()
        finally:
            remove_update_watcher(watch)
        return _snapshot(model, opt, ids=False)

    assert run(True) == run(False)


def test_measured_once_per_model_and_forgotten_with_it(monkeypatch):
    """One throw-away update per distinct (rule, hooks, shape, dtype); none
    the second time; the cache goes with the model."""
    import weakref
    calls: List[Tuple[int, ...]] = []
    once = optimizer_update._sandbox_once

    def counting(rule, param, *args, **kwargs):
        calls.append(param.shape)
        return once(rule, param, *args, **kwargs)
    monkeypatch.setattr(optimizer_update, "_sandbox_once", counting)
    model = linears()
    O.Adam().setup(model)
    state_bytes(model)
    shapes = {p.shape for p in model.params()}
    assert sorted(calls) == sorted(shapes)
    calls.clear()
    state_bytes(model)
    assert calls == []
    ref = weakref.ref(model)
    gc.collect()  # (models of earlier tests)
    before = len(optimizer_update._CACHES)
    del model
    gc.collect()
    assert ref() is None and len(optimizer_update._CACHES) == before - 1


def test_optimizer_found_whatever_its_target():
    """The optimizer of an inner model is found when its target is a link
    holding the model (``L.Classifier``), and its hooks are measured."""
    inner = linears()
    outer = L.Classifier(inner)
    opt = O.MomentumSGD().setup(outer)
    assert optimizers_of(inner.params()) == [opt]
    without = update_bytes(inner.params(), owner=inner).update_transient_bytes
    opt.add_hook(H.Lasso(1e-4))
    assert update_bytes(inner.params(), owner=inner).update_transient_bytes > without
    assert optimizers_of(linears().params()) == []  # no optimizer


def test_whole_optimizer_hook_that_cannot_be_measured_is_said_once(caplog):
    model = linears()
    opt = O.Adam().setup(model)
    calls: List[Any] = []
    opt.add_hook(lambda optimizer: calls.append(optimizer), name="my_hook")
    with caplog.at_level(logging.WARNING, logger="chainer_recompute.report"):
        first = update_bytes(model.params(), owner=model)
        again = update_bytes(model.params(), owner=model)
    assert calls == []  # not run
    assert first.unmeasured == again.unmeasured == ("the optimizer hook 'my_hook' (function)",)
    said = [r for r in caplog.records if "my_hook" in r.getMessage()]
    assert len(said) == 1 and "runner's meter corrects" in said[0].getMessage()


def test_without_optimizer_the_largest_parameter():
    """No update rule (no optimizer set up): no state, and one parameter's
    bytes for a hand-written update."""
    model = linears()
    got = update_bytes(model.params(), owner=model)
    assert got.optimizer_state_bytes == 0
    assert got.update_transient_bytes == max(p.array.nbytes for p in model.params())


# ------------------------------------------------------------ end to end
class MLP(chainer.Chain):
    """784-1000-1000-10 shrunk by 4: the parameters dominate a small batch."""

    def __init__(self, n_in: int = 196, n_hidden: int = 250) -> None:
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_hidden)
            self.l2 = L.Linear(n_hidden, n_hidden)
            self.l3 = L.Linear(n_hidden, 10)

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))


def _adam_with_hooks() -> chainer.Optimizer:
    class Hooked(O.Adam):
        def setup(self, link):
            super().setup(link)
            self.add_hook(H.GradientNoise(0.01))
            self.add_hook(H.WeightDecay(1e-4))
            return self
    return Hooked()


E2E = {"Adam": lambda: O.Adam(), "AdamW": lambda: O.AdamW(weight_decay_rate=0.01),
       "Adam+noise+decay": _adam_with_hooks}


@pytest.mark.parametrize("name", sorted(E2E))
def test_mlp_planned_steps_hold_the_budget(name, caplog):
    """``apply(budget='least')`` on the MLP: from the first planned step on,
    each whole step (the update included) is at or under its plan's budget,
    with no correction, and bit-identical to plain Chainer."""
    rs = np.random.RandomState(3)
    batches = [(rs.rand(8, 196).astype(np.float32), rs.randint(0, 10, 8).astype(np.int32))
               for _ in range(6)]

    def make() -> chainer.Link:
        return L.Classifier(MLP())
    # the recorded path: on this 0.2 MiB model the measuring of the update
    # (copies of the largest parameter, its state and temporaries) would set
    # a first step planned from captures (tests/test_first_step.py)
    options = {"budget": "least", "cost": "flops", "verbose": False, "capture_batch": None}
    plain = train(make, batches, False, optimizer=E2E[name])
    with caplog.at_level(logging.WARNING, logger="chainer_recompute.report"):
        ours = train(make, batches, True, optimizer=E2E[name], options=options)
    for k, (a, b) in enumerate(zip(plain.records, ours.records)):
        diff = [key for key in a if a[key] != b.get(key)]
        assert not diff, f"step {k}: differs from plain Chainer in {diff[:8]}"
    paths = [s["path"] for s in ours.stats]
    assert paths[0] == "recorded" and all(p == "planned" for p in paths[1:]), paths
    table = "\n".join(f"step {k}: plain {p}, applied {a}, budget {s['budget']}, predicted "
                      f"{s['predicted']}" for k, (p, a, s) in
                      enumerate(zip(plain.peaks, ours.peaks, ours.stats)))
    for k in range(1, len(batches)):
        assert ours.peaks[k] <= ours.stats[k]["budget"], f"step {k} over its budget:\n{table}"
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [], warned


def test_separate_capture_counts_the_update():
    """A graph captured before the first call (``capture()``, as
    ``capture_batch`` plans) carries the state Adam will make and the
    update's measured temporary; without gradients (``cleargrads()``) the
    figures are the same."""
    from chainer_recompute.runtime.capture import capture
    model = L.Classifier(MLP())
    opt = O.Adam().setup(model)
    x, t = np.ones((8, 196), np.float32), np.zeros(8, np.int32)
    g = capture(model, x, t, backward=True)
    model.cleargrads()
    optimizer_update._CACHES.pop(model, None)  # measured again
    without = update_bytes(model.params(), owner=model)
    assert (without.optimizer_state_bytes, without.update_transient_bytes) == (
        g.state_bytes["optimizer_state"], g.state_bytes["update_transient"])
    opt.update(model, x, t)
    params = parameter_bytes(model.params())
    assert g.state_bytes["optimizer_state"] == params["optimizer_state"] == 2 * params["params"]
    largest = max(p.array.nbytes for p in model.params())
    assert g.state_bytes["update_transient"] >= 3 * largest  # Adam's step, its sqrt, step * m
