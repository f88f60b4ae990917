"""Real training code against plain Chainer.

Every pattern runs twice from the same seeds: once with plain
Chainer and once with ``chainer_recompute`` applied (``apply`` /
``Recompute``) at a tight budget, over at least 3 optimizer steps. After
every backward and every update the two runs are compared bit for bit
(:func:`snapshot`): the loss, every parameter and gradient, every
persistent (BatchNorm statistics and counters), link state (Variables a
Link keeps: ``L.LSTM``'s ``h``/``c``, ``Classifier.y``, kept logging
outputs; Python counters), the optimizer state (update rules' state and
``t``) and NumPy's and Python's global random states.

Each test also asserts that the applied run really recomputed: some
iteration took the ``planned`` path with ``n_dropped > 0`` (the first call
of a signature runs plainly while its graph is recorded), so that a test
cannot pass because nothing happened.

Budgets: ``budget='least'`` (total scope, the default of ``apply``); where
that leaves nothing to drop, ``budget='least'`` with
``budget_scope='activations'`` (the paper's memory model); ``cost='flops'``
so that plans do not depend on measured times.

Tests that fail here because the runtime is wrong are left failing (not
xfailed): their message names the first differing record, or the crash.
"""
from __future__ import annotations

import copy
import functools
import gc
import logging
import os
import pickle
import random
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest

import chainer_recompute as cr
import chainer
import chainer.distributions as D
import chainer.functions as F
import chainer.links as L
from chainer import serializers, training
from chainer.training import extensions

from chainer_recompute.core.errors import InfeasibleBudgetError, RecomputeError
from chainer_recompute.runtime import capture as _capture_module
from chainer_recompute.runtime.memory import MemoryMeter

# cost='flops': the plan (and so what a test asserts about drops and
# recomputation) does not depend on timings measured on a shared machine.
LEAST = {"budget": "least", "cost": "flops"}  # total scope (apply's default)
LEAST_ACT = {"budget": "least", "budget_scope": "activations", "cost": "flops"}


# =====================================================================
# Recording and comparing the state of a run
# =====================================================================
def _np(x: Any) -> Any:
    if isinstance(x, chainer.Variable):
        x = x.array
    if x is None:
        return None
    if isinstance(x, chainer.get_array_types()):
        return np.array(chainer.backend.CpuDevice().send(x), copy=True)
    if isinstance(x, (np.generic, int, float, bool)):
        return np.array(x)
    return x


def link_records(prefix: str, link: chainer.Link, rec: Dict[str, Any]) -> None:
    """Parameters, gradients, update-rule state, persistents, Variables
    and Python scalars the links keep."""
    for path, p in link.namedparams(include_uninit=True):
        rec[f"param/{prefix}{path}"] = _np(p.array)
        rec[f"grad/{prefix}{path}"] = _np(p.grad)
        rule = getattr(p, "update_rule", None)
        if rule is not None:
            for k in sorted(rule.state or {}):
                rec[f"opt/{prefix}{path}/{k}"] = _np(rule.state[k])
            rec[f"opt/{prefix}{path}/t"] = rule.t
    for path, sub in link.namedlinks():
        base = prefix + path
        for name in sorted(sub._persistent):
            rec[f"persist/{base}/{name}"] = _np(getattr(sub, name, None))
        for name, value in sorted(vars(sub).items()):
            if name in sub._params or name in sub._persistent:
                continue
            if isinstance(value, chainer.Variable) and not isinstance(value, chainer.Parameter):
                rec[f"state/{base}/{name}"] = _np(value)
            elif (not name.startswith("_") and isinstance(value, (bool, int, float))
                  and not isinstance(value, type)):
                rec[f"pystate/{base}/{name}"] = value


class StatsCopy:
    """The counters of a runner's ``last_stats`` at one moment."""

    __slots__ = ("path", "n_dropped", "n_released", "recomputed_nodes", "mismatch", "n_nodes",
                 "release_mode")

    def __init__(self, stats: Any) -> None:
        for k in self.__slots__:
            setattr(self, k, None if stats is None else getattr(stats, k))

    @property
    def dropped(self) -> bool:
        return self.path == "planned" and (self.n_dropped or 0) > 0

    def __repr__(self) -> str:
        return (f"{self.path}(dropped={self.n_dropped}, recomputed={self.recomputed_nodes}, "
                f"release={self.release_mode}"
                + (f", mismatch={self.mismatch!r}" if self.mismatch else "") + ")")


class _LogCatcher(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        # attached to a logger and its child: a record that propagates is
        # seen twice
        if not any(r is record for r in self.records):
            self.records.append(record)


#: The library's loggers: its modules', and the user-facing report (which
#: does not propagate).
LOGGERS = ("chainer_recompute", "chainer_recompute.report")


class _catching:
    """Attach a handler to the library's loggers for a block."""

    def __init__(self, handler: logging.Handler) -> None:
        self.handler = handler
        self.saved: List[Tuple[logging.Logger, int]] = []

    def __enter__(self) -> logging.Handler:
        # The runner sets the report logger up when first imported, unless
        # it has a handler already: import it before adding ours, or a
        # later test in this process would find that logger propagating.
        import chainer_recompute.runtime.runner  # noqa: F401
        for name in LOGGERS:
            log = logging.getLogger(name)
            self.saved.append((log, log.level))
            log.addHandler(self.handler)
            log.setLevel(logging.INFO)
        return self.handler

    def __exit__(self, *exc: Any) -> None:
        for log, level in self.saved:
            log.removeHandler(self.handler)
            log.setLevel(level)


class Env:
    """One run of a scenario: plain (``applied=False``) or applied.

    A scenario builds its models through :meth:`apply` / :meth:`wrap`
    (identity in the plain run), its optimizers through
    :meth:`optimizer`, and calls :meth:`snap` after each backward and
    update."""

    def __init__(self, applied: bool, options: Dict[str, Any]) -> None:
        self.applied = applied
        self.options = dict(options)
        self.links: Dict[str, chainer.Link] = {}
        self.optimizers: Dict[str, Any] = {}
        self.runners: Dict[str, Any] = {}
        self.records: List[Tuple[str, Dict[str, Any]]] = []
        self.stats: List[Tuple[str, Dict[str, StatsCopy]]] = []
        self.logs: List[logging.LogRecord] = []
        self.error: Optional[BaseException] = None
        self.data: Dict[str, Any] = {}  # whatever a scenario wants to keep

    # -- building
    def apply(self, name: str, link: chainer.Link, **override: Any) -> chainer.Link:
        self.links[name] = link
        if self.applied:
            cr.apply(link, **{**self.options, **override})
            self.runners[name] = cr.runner_of(link)
        return link

    def wrap(self, name: str, fn: Callable[..., Any], **override: Any) -> Callable[..., Any]:
        if not self.applied:
            return fn
        runner = cr.Recompute(fn, **{**self.options, **override})
        self.runners[name] = runner
        return runner

    def track(self, name: str, link: chainer.Link) -> chainer.Link:
        """Record ``link`` under ``name`` (and its runner, if applied)."""
        self.links[name] = link
        runner = cr.runner_of(link) if self.applied else None
        if runner is not None:
            self.runners[name] = runner
        else:
            self.runners.pop(name, None)
        return link

    def optimizer(self, name: str, opt: Any, link: chainer.Link) -> Any:
        opt.setup(link)
        self.optimizers[name] = opt
        return opt

    # -- recording
    def snap(self, label: str, **extra: Any) -> None:
        rec: Dict[str, Any] = {}
        for name, link in self.links.items():
            link_records(name, link, rec)
        for name, opt in self.optimizers.items():
            rec[f"opt/{name}/t"] = opt.t
            rec[f"opt/{name}/epoch"] = opt.epoch
        for k, v in extra.items():
            rec[f"extra/{k}"] = _np(v)
        rec["rng/numpy"] = np.random.get_state()
        rec["rng/python"] = random.getstate()
        self.records.append((label, rec))
        if self.applied:
            self.stats.append((label, {n: StatsCopy(r.last_stats)
                                       for n, r in self.runners.items()}))

    def stats_at(self, label: str) -> Dict[str, StatsCopy]:
        for lab, s in self.stats:
            if lab == label:
                return s
        raise KeyError(label)

    def warnings(self, contains: str = "") -> List[str]:
        return [r.getMessage() for r in self.logs
                if r.levelno >= logging.WARNING and contains in r.getMessage()]


def _same(key: str, a: Any, b: Any) -> bool:
    if key == "rng/numpy":
        return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    return a == b


def _describe(key: str, a: Any, b: Any) -> str:
    if key == "rng/numpy":
        return f"NumPy RNG differs (plain pos {a[2]}, applied pos {b[2]}, keys equal: " \
               f"{np.array_equal(a[1], b[1])})"
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        with np.errstate(all="ignore"):
            d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        return f"max abs diff {np.nanmax(d) if d.size else 0:.3g}"
    return f"{_short(a)} vs {_short(b)}"


def _short(x: Any) -> str:
    s = repr(x)
    return s if len(s) < 60 else s[:57] + "..."


def _order(key: str) -> Tuple[int, str]:
    prefixes = ("rng/", "extra/", "grad/", "param/", "persist/", "state/", "pystate/", "opt/")
    return (next((i for i, p in enumerate(prefixes) if key.startswith(p)), len(prefixes)), key)


class Pair:
    """A plain run and an applied run of one scenario."""

    def __init__(self, plain: Env, ours: Env) -> None:
        self.plain, self.ours = plain, ours

    def first_difference(self) -> Optional[str]:
        pr, ar = self.plain.records, self.ours.records
        for k, ((lp, rp), (la, ra)) in enumerate(zip(pr, ar)):
            if lp != la:
                return f"record #{k}: labels differ ({lp!r} vs {la!r})"
            keys = sorted(set(rp) | set(ra), key=_order)
            diffs = []
            for key in keys:
                if key not in rp or key not in ra:
                    diffs.append(f"  {key}: only in {'plain' if key in rp else 'applied'}")
                elif not _same(key, rp[key], ra[key]):
                    diffs.append(f"  {key}: {_describe(key, rp[key], ra[key])}")
            if diffs:
                more = f"\n  ... {len(diffs) - 12} more" if len(diffs) > 12 else ""
                return (f"first difference at record #{k} ({lp!r}), {len(diffs)} keys:\n"
                        + "\n".join(diffs[:12]) + more)
        if len(pr) != len(ar) and self.ours.error is None:
            return f"{len(pr)} records in the plain run, {len(ar)} in the applied run"
        return None

    def stats_report(self) -> str:
        lines = [f"  {label}: {s}" for label, s in self.ours.stats]
        return "applied run's stats:\n" + "\n".join(lines)

    def check(self) -> "Pair":
        """Identical records; a crash of the applied run is re-raised after
        the records made before it are compared."""
        diff = self.first_difference()
        if diff is not None:
            crash = "" if self.ours.error is None else \
                f"\n(the applied run crashed later: {self.ours.error!r})"
            pytest.fail(f"applied run differs from plain Chainer: {diff}{crash}\n"
                        + self.stats_report(), pytrace=False)
        if self.ours.error is not None:
            raise self.ours.error
        return self

    def assert_recomputed(self, names: Optional[List[str]] = None, at_least: int = 1,
                          regenerated: bool = True) -> "Pair":
        """At least ``at_least`` records where each runner in ``names``
        (default: every runner) was on a plan that drops something, and
        (``regenerated``) some backward that recomputed dropped nodes."""
        names = names if names is not None else list(self.ours.runners)
        assert names, "nothing was applied"
        for name in names:
            on_plan = [s[name] for _, s in self.ours.stats if name in s and s[name].dropped]
            assert len(on_plan) >= at_least, (
                f"{name}: {len(on_plan)} records on a plan with drops (wanted at least "
                f"{at_least})\n" + self.stats_report())
            if regenerated:
                assert any(s.recomputed_nodes for s in on_plan), (
                    f"{name}: dropped arrays but never recomputed any\n" + self.stats_report())
        return self


def run(scenario: Callable[[Env], None], applied: bool, options: Dict[str, Any],
        seed: int = 0) -> Env:
    env = Env(applied, options)
    np.random.seed(seed)
    random.seed(seed)
    catcher = _LogCatcher()
    try:
        with _catching(catcher):
            with chainer.using_config("train", True):
                scenario(env)
    except Exception as e:  # noqa: BLE001 - reported by Pair.check
        if not applied:
            raise
        env.error = e
    finally:
        env.logs = catcher.records
    return env


def compare(scenario: Callable[[Env], None], seed: int = 0, **options: Any) -> Pair:
    """Run ``scenario`` plain and applied (``options``: apply's, default
    ``budget='least'``) and check that every record is identical."""
    options = {**LEAST, **options}
    plain = run(scenario, False, options, seed)
    ours = run(scenario, True, options, seed)
    return Pair(plain, ours).check()


# ---------------------------------------------- the comparison itself
class _Counted(chainer.Chain):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        with self.init_scope():
            self.l1 = L.Linear(8, 8)
            self.bn = L.BatchNormalization(8)
            self.l2 = L.Linear(8, 3)

    def forward(self, x):
        self.calls += 1
        return self.l2(F.relu(self.bn(self.l1(x))))


_TAMPER = {
    "rng/numpy": lambda m: np.random.rand(),
    "rng/python": lambda m: random.random(),
    "param/": lambda m: m.predictor.l1.W.array.__setitem__(
        (0, 0), np.nextafter(m.predictor.l1.W.array[0, 0], np.float32(1))),
    "grad/": lambda m: m.predictor.l2.b.grad.__setitem__(0, m.predictor.l2.b.grad[0] * 2),
    "persist/": lambda m: m.predictor.bn.avg_var.__setitem__(1, 0.5),
    "state/": lambda m: setattr(m, "y", m.y * 1),  # a new Variable, same values: no difference
    "pystate/": lambda m: setattr(m.predictor, "calls", m.predictor.calls + 1),
    "opt/": lambda m: m.predictor.l1.b.update_rule.state["m"].__setitem__(0, 1.0),
}


def _tamper_scenario(kind):
    data = [(x[:, :8], t % 3) for x, t in batches(3, batch=4)]

    def scenario(env):
        model = env.track("model", L.Classifier(_Counted()))
        opt = env.optimizer("main", chainer.optimizers.Adam(), model)
        for i, (x, t) in enumerate(data):
            model.cleargrads()
            loss = model(x, t)
            loss.backward()
            opt.update()
            if i == 1 and kind is not None:
                _TAMPER[kind](model)
            env.snap(f"{i}", loss=loss)

    return scenario


@pytest.mark.parametrize("kind", sorted(_TAMPER))
def test_comparison_catches_each_kind_of_state(kind):
    """The records differ when one value of one kind changes by one ulp
    or one random draw (so "identical" above means what it says); a new
    Variable with the same values is no difference."""
    plain = run(_tamper_scenario(None), False, {})
    other = run(_tamper_scenario(kind), False, {})
    diff = Pair(plain, other).first_difference()
    if kind == "state/":
        assert diff is None, diff
    else:
        assert diff is not None and "record #1" in diff and kind in diff, diff


# =====================================================================
# Small helpers for scenarios
# =====================================================================
def batches(n: int, batch: int = 16, width: int = 32, classes: int = 10, seed: int = 1,
            shape: Optional[Tuple[int, ...]] = None) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Data from its own RandomState (draws nothing from the global RNG)."""
    rs = np.random.RandomState(seed)
    shape = shape or (width,)
    return [(rs.randn(batch, *shape).astype(np.float32),
             rs.randint(0, classes, batch).astype(np.int32)) for _ in range(n)]


def train_steps(env: Env, model: Callable[..., Any], opt: Any, data: List[Tuple[Any, ...]],
                start: int = 0, target: Optional[chainer.Link] = None) -> None:
    """The plain loop: cleargrads, loss, backward, (record), update, (record)."""
    target = target if target is not None else model
    for i, args in enumerate(data, start):
        target.cleargrads()
        loss = model(*args)
        loss.backward()
        env.snap(f"{i} backward", loss=loss)
        opt.update()
        env.snap(f"{i} update")


def last_structures(runner: Any) -> List[Any]:
    return [s for e in runner.signatures() for s in e.structures]


class MLP(chainer.Chain):
    def __init__(self, width: int = 32, hidden: int = 64, depth: int = 4, out: int = 10,
                 lazy: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout
        with self.init_scope():
            self.layers = chainer.ChainList(*[
                L.Linear(None if lazy else (width if k == 0 else hidden), hidden)
                for k in range(depth)])
            self.out = L.Linear(None if lazy else hidden, out)

    def forward(self, x):
        h = x
        for lin in self.layers:
            h = F.relu(lin(h))
            if self.dropout:
                h = F.dropout(h, self.dropout)
        return self.out(h)


class MLPLoss(MLP):
    def forward(self, x, t):
        return F.softmax_cross_entropy(super().forward(x), t)


# =====================================================================
# Silent wrong results
# =====================================================================
class ConcatOrder(chainer.Chain):
    """Same functions, same shapes; the concat order depends on the data."""

    def __init__(self, w: int = 32) -> None:
        super().__init__()
        with self.init_scope():
            self.a1, self.a2 = L.Linear(w, w), L.Linear(w, w)
            self.b1, self.b2 = L.Linear(w, w), L.Linear(w, w)
            self.c = L.Linear(2 * w, w)
            self.out = L.Linear(w, 10)

    def forward(self, x, t):
        a = F.tanh(self.a2(F.relu(self.a1(x))))
        b = F.tanh(self.b2(F.relu(self.b1(x))))
        h = F.concat((a, b) if float(x[:, 0].mean()) >= 0 else (b, a), axis=1)
        h = F.relu(self.c(h))
        return F.softmax_cross_entropy(self.out(h), t)


class CrossWiring(chainer.Chain):
    """Same functions, same shapes; which branch feeds which layer depends
    on the data."""

    def __init__(self, w: int = 32) -> None:
        super().__init__()
        with self.init_scope():
            self.a, self.b = L.Linear(w, w), L.Linear(w, w)
            self.c, self.d = L.Linear(w, w), L.Linear(w, w)
            self.e = L.Linear(w, w)
            self.out = L.Linear(w, 10)

    def forward(self, x, t):
        a = F.relu(self.a(x))
        b = F.relu(self.b(x))
        u, v = (a, b) if float(x[:, 0].mean()) >= 0 else (b, a)
        h = F.tanh(self.c(u)) * F.sigmoid(self.d(v))
        h = F.relu(self.e(h))
        return F.softmax_cross_entropy(self.out(h), t)


SIGNS = [1, 1, -1, 1, -1, -1, 1, -1]


def _signed(data, signs=SIGNS):
    out = []
    for (x, t), s in zip(data, signs):
        x = x.copy()
        x[:, 0] = np.abs(x[:, 0]) * s
        out.append((x, t))
    return out


@pytest.mark.parametrize("net", [ConcatOrder, CrossWiring])
def test_wiring_depends_on_data(net):
    """Silent wrong results: the same function names and shapes on every
    call, but the data choose which array feeds which function."""
    data = _signed(batches(len(SIGNS)))

    def scenario(env):
        model = env.apply("model", net())
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        train_steps(env, model, opt, data)
        if env.applied:
            env.data["structures"] = len(last_structures(cr.runner_of(model)))

    pair = compare(scenario)
    pair.assert_recomputed(at_least=3)
    # a planned iteration on the other wiring must not follow the first plan
    assert pair.ours.data["structures"] == 2, pair.stats_report()


class OutputByData(chainer.Chain):
    """The same functions on arrays of the same shapes at every call, but
    the data choose what one of them makes: the dtype of a cast (a float64
    or float16 round trip), or the shape of a sum (over the batch or over
    the features): only that output tells the two structures apart."""

    def __init__(self, what: str, w: int = 32) -> None:
        super().__init__()
        self.what = what
        with self.init_scope():
            self.a, self.b, self.c = L.Linear(w, w), L.Linear(w, w), L.Linear(w, w)
            self.out = L.Linear(w, 10)

    def forward(self, x, t):
        h = F.relu(self.a(x))
        wide = float(x[:, 0].mean()) >= 0
        if self.what == "dtype":
            h = F.cast(F.cast(h, np.float64 if wide else np.float16), np.float32)
        h = F.relu(self.c(F.tanh(self.b(h))))
        loss = F.softmax_cross_entropy(self.out(h), t)
        if self.what == "shape":
            loss = loss + 1e-3 * F.sum(F.sum(h * h, axis=0 if wide else 1))
        return loss


@pytest.mark.parametrize("what,op", [("dtype", "Cast"), ("shape", "Sum")])
def test_output_depends_on_data(what, op):
    """A planned call whose output has another dtype (another size) or
    another shape than its planned node's, on the same inputs, does not
    follow the plan: the iteration stops matching it at that very call,
    and the training stays plain Chainer's."""
    data = _signed(batches(len(SIGNS)))

    def scenario(env):
        model = env.apply("model", OutputByData(what))
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        train_steps(env, model, opt, data)

    pair = compare(scenario)
    pair.assert_recomputed(at_least=2)
    mismatches = [s["model"].mismatch for _, s in pair.ours.stats if s["model"].mismatch]
    assert mismatches, pair.stats_report()
    assert all(re.search(rf"\({op}\) makes array \d+ of {what} ", m) for m in mismatches), \
        mismatches


@pytest.mark.parametrize("capture_batch", [None, 4])
@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_lazy_init_and_dropout(ratio, capture_batch):
    """``L.Linear(None, n)`` (parameters made at the first call, from the
    global RNG) with and without dropout; with ``capture_batch`` the
    separate capture must leave the parameters uninitialised and the RNG
    untouched."""
    data = batches(4)

    def scenario(env):
        model = env.apply("model", L.Classifier(MLP(lazy=True, dropout=ratio)),
                          capture_batch=capture_batch)
        opt = env.optimizer("main", chainer.optimizers.Adam(), model)
        train_steps(env, model, opt, data)

    compare(scenario).assert_recomputed(at_least=3)


def test_lazy_init_with_shuffling_iterator():
    """Chainer's MNIST pattern: lazy layers, dropout, a shuffling
    SerialIterator (draws from the global RNG at every epoch), and
    ``optimizer.update(model, x, t)``; 8 steps over two epochs."""
    rs = np.random.RandomState(3)
    dataset = chainer.datasets.TupleDataset(rs.randn(40, 32).astype(np.float32),
                                            rs.randint(0, 10, 40).astype(np.int32))

    def scenario(env):
        model = env.apply("model", L.Classifier(MLP(lazy=True, dropout=0.2)))
        opt = env.optimizer("main", chainer.optimizers.Adam(), model)
        it = chainer.iterators.SerialIterator(dataset, 8, shuffle=True)
        for i in range(8):
            x, t = chainer.dataset.concat_examples(it.next())
            opt.update(model, x, t)
            env.snap(f"{i} update", epoch=it.epoch)

    compare(scenario).assert_recomputed(at_least=6)


class RNNLM(chainer.Chain):
    """Chainer's PTB example in small: ``L.LSTM`` keeps ``h``/``c`` between
    calls; truncated BPTT over 3 calls per backward."""

    def __init__(self, n_vocab: int = 50, n_units: int = 32) -> None:
        super().__init__()
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, n_units)
            self.l1 = L.LSTM(n_units, n_units)
            self.l2 = L.LSTM(n_units, n_units)
            self.out = L.Linear(n_units, n_vocab)

    def reset_state(self):
        self.l1.reset_state()
        self.l2.reset_state()

    def forward(self, x, t):
        h = self.l1(F.dropout(self.embed(x), 0.2))
        h = self.l2(F.dropout(h, 0.2))
        return F.softmax_cross_entropy(self.out(F.dropout(h, 0.2)), t)


@pytest.mark.parametrize("capture_batch", [None, 4])
def test_stateful_lstm_truncated_bptt(capture_batch):
    """The LSTM state advances exactly as in plain Chainer (a separate
    capture must not advance it); 4 updates of 3 calls each."""
    rs = np.random.RandomState(15)
    words = rs.randint(0, 50, (13, 8)).astype(np.int32)

    def scenario(env):
        model = env.apply("model", RNNLM(), capture_batch=capture_batch)
        opt = env.optimizer("main", chainer.optimizers.SGD(0.5), model)
        opt.add_hook(chainer.optimizer_hooks.GradientClipping(5))
        model.reset_state()
        for i in range(4):
            loss = 0
            for k in range(3):
                loss += model(words[3 * i + k], words[3 * i + k + 1])
            model.cleargrads()
            loss.backward()
            env.snap(f"{i} backward", loss=loss)
            loss.unchain_backward()
            opt.update()
            env.snap(f"{i} update")

    compare(scenario).assert_recomputed(at_least=3)


class AnnealedVAE(chainer.Chain):
    """KL annealing: a Python-side counter advanced by every forward."""

    def __init__(self, n_in: int = 32, n_h: int = 64, n_z: int = 8, warmup: int = 4) -> None:
        super().__init__()
        self.warmup, self.calls, self.beta = warmup, 0, 0.0
        with self.init_scope():
            self.enc1, self.enc2 = L.Linear(n_in, n_h), L.Linear(n_h, n_h)
            self.mu, self.ln_var = L.Linear(n_h, n_z), L.Linear(n_h, n_z)
            self.dec1, self.dec2 = L.Linear(n_z, n_h), L.Linear(n_h, n_in)

    def forward(self, x):
        self.calls += 1
        self.beta = min(1.0, self.calls / self.warmup)
        h = F.tanh(self.enc2(F.tanh(self.enc1(x))))
        mu, ln_var = self.mu(h), self.ln_var(h)
        z = F.gaussian(mu, ln_var)
        y = self.dec2(F.tanh(self.dec1(z)))
        rec = F.bernoulli_nll(x, y) / len(x)
        kl = F.gaussian_kl_divergence(mu, ln_var) / len(x)
        return rec + self.beta * kl


@pytest.mark.parametrize("capture_batch", [None, 4])
def test_python_counter_in_forward(capture_batch):
    """The counter (and the annealed weight) advance exactly as in plain
    Chainer, also when planning from a separate capture."""
    rs = np.random.RandomState(4)
    data = [(rs.uniform(0, 1, (16, 32)).astype(np.float32),) for _ in range(5)]

    def scenario(env):
        model = env.apply("model", AnnealedVAE(), capture_batch=capture_batch)
        opt = env.optimizer("main", chainer.optimizers.Adam(), model)
        for i, (x,) in enumerate(data):
            model.cleargrads()
            loss = model(x)
            loss.backward()
            env.snap(f"{i} backward", loss=loss, calls=model.calls, beta=model.beta)
            opt.update()
            env.snap(f"{i} update")

    # budget_scope='total' finds plain backprop the least for this model
    pair = compare(scenario, capture_batch=capture_batch, **LEAST_ACT)
    pair.assert_recomputed(at_least=3 if capture_batch is None else 4)
    assert pair.ours.links["model"].calls == len(data)


class BNNet(chainer.Chain):
    def __init__(self, c: int = 8, finetune: bool = False) -> None:
        super().__init__()
        self.finetune = finetune
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, c, 3, pad=1)
            self.bn1 = L.BatchNormalization(c)
            self.conv2 = L.Convolution2D(c, c, 3, pad=1)
            self.bn2 = L.BatchNormalization(c)
            self.conv3 = L.Convolution2D(c, c, 3, pad=1)
            self.bn3 = L.BatchNormalization(c)
            self.fc = L.Linear(c, 10)

    def logits(self, x):
        kw = {"finetune": True} if self.finetune else {}
        h = F.relu(self.bn1(self.conv1(x), **kw))
        h = F.relu(self.bn2(self.conv2(h), **kw)) + h
        h = F.relu(self.bn3(self.conv3(h), **kw))
        return self.fc(F.average(h, axis=(2, 3)))

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.logits(x), t)


def image_batches(n: int, batch: int = 8, size: int = 8, seed: int = 5):
    return batches(n, batch=batch, shape=(3, size, size), seed=seed)


def test_batchnorm_finetune():
    """``BatchNormalization(finetune=True)``: ``N`` and the running
    averages (decay 1/N) must be updated once per call, as in plain
    Chainer."""
    data = image_batches(4)

    def scenario(env):
        model = env.apply("model", BNNet(finetune=True))
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        train_steps(env, model, opt, data)

    compare(scenario).assert_recomputed(at_least=3)


class RenormNet(BNNet):
    """BNNet with its middle BatchNorm a ``BatchRenormalization``, whose
    forward reads the running averages it updates (r and d)."""

    def __init__(self) -> None:
        super().__init__()
        del self.bn2
        with self.init_scope():
            self.bn2 = L.BatchRenormalization(8, rmax=1.5, dmax=0.5)


def test_batch_renormalization_is_kept_and_identical():
    """The one BatchRenormalization is found unsafe (a second forward gives
    other outputs), said so in the singular with that reason, and kept;
    the rest of the net is recomputed, bit for bit as plain Chainer."""
    data = image_batches(4)

    def scenario(env):
        model = env.apply("model", RenormNet())
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        train_steps(env, model, opt, data)

    pair = compare(scenario).assert_recomputed(at_least=3)
    said = [r.getMessage() for r in pair.ours.logs if "recomputed safely" in r.getMessage()]
    assert said == ["1 function cannot be recomputed safely and is kept: "
                    "BatchRenormalizationFunction (a second forward on the same inputs gives "
                    "other outputs (its forward changes state it reads, as "
                    "BatchRenormalization's running averages, or draws randomness it does "
                    "not keep))"], said


@pytest.mark.parametrize("capture_batch", [None, 2])
def test_recompute_callable_over_batchnorm(capture_batch):
    """``cr.Recompute(fn)`` over a function that calls a net with
    BatchNorm (no Link is handed to the runner); with ``capture_batch``
    the separate capture must leave the statistics untouched."""
    data = image_batches(4)

    def scenario(env):
        net = env.track("net", BNNet())
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), net)

        def loss_fn(x, t):
            return F.softmax_cross_entropy(net.logits(x), t)

        fn = env.wrap("fn", loss_fn, capture_batch=capture_batch)
        train_steps(env, fn, opt, data, target=net)

    compare(scenario).assert_recomputed(at_least=3 if capture_batch is None else 4)


# ------------------------------------------------------------- DCGAN
class Generator(chainer.Chain):
    def __init__(self, n_z: int = 8, w: int = 64, out: int = 32) -> None:
        super().__init__()
        self.n_z = n_z
        with self.init_scope():
            self.l0, self.bn0 = L.Linear(n_z, w), L.BatchNormalization(w)
            self.l1, self.bn1 = L.Linear(w, w), L.BatchNormalization(w)
            self.l2 = L.Linear(w, out)

    def make_hidden(self, batch: int) -> np.ndarray:
        return np.random.uniform(-1, 1, (batch, self.n_z)).astype(np.float32)

    def forward(self, z):
        h = F.relu(self.bn0(self.l0(z)))
        h = F.relu(self.bn1(self.l1(h)))
        return F.tanh(self.l2(h))


class Discriminator(chainer.Chain):
    """As Chainer's DCGAN example, Gaussian noise added to the input in the
    forward (an array drawn outside any function node; the example adds it
    at every layer, which leaves little a plan could save)."""

    def __init__(self, n_in: int = 32, w: int = 64, depth: int = 5) -> None:
        super().__init__()
        with self.init_scope():
            self.layers = chainer.ChainList(*[L.Linear(n_in if k == 0 else w, w)
                                              for k in range(depth)])
            self.last = L.Linear(w, 1)

    @staticmethod
    def add_noise(h, sigma=0.2):
        if chainer.config.train:
            return h + sigma * np.random.randn(*h.shape).astype(h.dtype)
        return h

    def forward(self, x):
        h = self.add_noise(x)
        for lin in self.layers:
            h = F.leaky_relu(lin(h))
        return self.last(h)


def dcgan_scenario(apply_to: Tuple[str, ...], steps: int = 4, batch: int = 64):
    """Batch 64: the activations outweigh Adam's update of a 64x64 weight
    (three temporaries of its size), so the least budget's plans drop."""
    rs = np.random.RandomState(6)
    reals = [np.tanh(rs.randn(batch, 32)).astype(np.float32) for _ in range(steps)]

    def scenario(env):
        gen, dis = Generator(), Discriminator()
        gen = env.apply("gen", gen) if "gen" in apply_to else env.track("gen", gen)
        dis = env.apply("dis", dis) if "dis" in apply_to else env.track("dis", dis)
        opt_gen = env.optimizer("gen", chainer.optimizers.Adam(2e-4, beta1=0.5), gen)
        opt_dis = env.optimizer("dis", chainer.optimizers.Adam(2e-4, beta1=0.5), dis)
        opt_dis.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
        for i, x_real in enumerate(reals):
            # chainer/examples/dcgan/updater.py, DCGANUpdater.update_core
            y_real = dis(chainer.Variable(x_real))
            z = chainer.Variable(gen.make_hidden(batch))
            x_fake = gen(z)
            y_fake = dis(x_fake)
            loss_dis = F.sum(F.softplus(-y_real)) / batch + F.sum(F.softplus(y_fake)) / batch
            dis.cleargrads()
            loss_dis.backward()
            env.snap(f"{i} dis backward", loss=loss_dis)
            opt_dis.update()  # the discriminator changes between the two backward passes
            loss_gen = F.sum(F.softplus(-y_fake)) / batch
            gen.cleargrads()
            loss_gen.backward()
            env.snap(f"{i} gen backward", loss=loss_gen)
            opt_gen.update()
            env.snap(f"{i} update")
            del y_real, x_fake, y_fake, loss_dis, loss_gen

    return scenario


@pytest.mark.parametrize("capture_batch", [None, 4])
@pytest.mark.parametrize("apply_to", [("dis",), ("gen",), ("gen", "dis")],
                         ids=["dis", "gen", "both"])
def test_dcgan_updater(apply_to, capture_batch):
    """Chainer's DCGAN updater: the discriminator is updated between the
    two backward passes through it (regeneration must not use the updated
    weights); ``apply()`` on the generator, the discriminator and both;
    planned from the first iteration on (``capture_batch``) or from the
    second."""
    pair = compare(dcgan_scenario(apply_to), capture_batch=capture_batch)
    pair.assert_recomputed(list(apply_to), at_least=3)


# ------------------------------------------- randomness in a FunctionNode
class RandomSignFlip(chainer.FunctionNode):
    """Flips the sign of its input with probability 1/2: one coin from the
    global RNG per forward, not kept for a rerun (so a rerun gives the same
    output only half the time)."""

    def forward(self, inputs):
        x, = inputs
        self.sign = x.dtype.type(1.0 if np.random.rand() < 0.5 else -1.0)
        return chainer.utils.force_array(x * self.sign),

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] * float(self.sign),


class NoisyScale(chainer.FunctionNode):
    """Multiplies by fresh noise from the global RNG on every forward."""

    def forward(self, inputs):
        x, = inputs
        self.scale = (1 + 0.1 * np.random.standard_normal(x.shape)).astype(x.dtype)
        return chainer.utils.force_array(x * self.scale),

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] * self.scale,


class RandomFunctionNet(chainer.Chain):
    def __init__(self, w: int = 32) -> None:
        super().__init__()
        with self.init_scope():
            self.l1, self.l2 = L.Linear(w, w), L.Linear(w, w)
            self.l3, self.l4 = L.Linear(w, w), L.Linear(w, w)
            self.out = L.Linear(w, 10)

    def forward(self, x, t):
        h = F.relu(self.l1(x))
        h, = RandomSignFlip().apply((h,))
        h = F.tanh(self.l2(h))
        h, = NoisyScale().apply((h,))
        h = F.relu(self.l3(h))
        h = F.relu(self.l4(h))
        return F.softmax_cross_entropy(self.out(h), t)


RANDOM_OPS = ("RandomSignFlip", "NoisyScale")


def _random_function_check(seeds):
    data = batches(4, seed=7)

    def scenario(env):
        model = env.apply("model", RandomFunctionNet())
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        train_steps(env, model, opt, data)
        if env.applied:
            env.data["structures"] = last_structures(cr.runner_of(model))

    for seed in seeds:
        _capture_module._ANALYSIS_CACHE.clear()  # decide afresh for each seed
        pair = compare(scenario, seed=seed, **LEAST_ACT)
        pair.assert_recomputed(at_least=3)
        structures = pair.ours.data["structures"]
        assert structures
        for s in structures:
            found = [v for v, node in enumerate(s.graph.nodes) if node.op in RANDOM_OPS]
            assert len(found) == 2, [n.op for n in s.graph.nodes]
            for v in found:
                node = s.graph.nodes[v]
                assert not node.recomputable, \
                    f"seed {seed}: {node.op} (node {v}) was judged safe to recompute"
                assert v not in s.program.dropped, f"seed {seed}: {node.op} is dropped"


def test_random_function_node_always_unsafe():
    """A custom FunctionNode that draws from the global RNG (and keeps no
    draw a rerun could reuse) is found unsafe on every seed, never dropped,
    and the runs stay identical."""
    _random_function_check(range(12))


@pytest.mark.slow
def test_random_function_node_always_unsafe_many_seeds():
    _random_function_check(range(12, 112))


# =====================================================================
# Crash patterns
# =====================================================================
class SeqNet(chainer.Chain):
    """Variable-length sequences through ``L.NStepLSTM`` (the Link sorts
    and transposes them) or ``F.n_step_lstm`` (sorted by length,
    descending, transposed by ``F.transpose_sequence``)."""

    def __init__(self, link: bool, n_in: int = 8, n_h: int = 16, n_out: int = 3) -> None:
        super().__init__()
        self.link = link
        with self.init_scope():
            self.lstm = L.NStepLSTM(1, n_in, n_h, dropout=0.2)
            self.out = L.Linear(n_h, n_out)

    def forward(self, xs, t):
        if self.link:
            hy, cy, ys = self.lstm(None, None, xs)
        else:
            n_h = self.lstm.out_size
            hx = np.zeros((1, len(xs), n_h), np.float32)
            cx = np.zeros((1, len(xs), n_h), np.float32)
            # time-major: batch t holds the sequences still running at time t
            hy, cy, ys = F.n_step_lstm(1, 0.2, hx, cx, self.lstm.ws, self.lstm.bs,
                                       F.transpose_sequence(xs))
        loss = F.softmax_cross_entropy(self.out(hy[-1]), t)
        return loss + 0.01 * F.mean(F.concat(ys, axis=0) ** 2)


@pytest.mark.parametrize("link", [True, False], ids=["NStepLSTM", "n_step_lstm"])
def test_nstep_lstm_variable_length(link):
    rs = np.random.RandomState(8)
    lengths = [[7, 5, 5, 3], [6, 6, 4, 2]]  # two signatures, alternating
    data = []
    for i in range(6):
        lens = lengths[i % 2]
        xs = [rs.randn(n, 8).astype(np.float32) for n in lens]
        data.append((xs, rs.randint(0, 3, len(lens)).astype(np.int32)))

    def scenario(env):
        model = env.apply("model", SeqNet(link))
        opt = env.optimizer("main", chainer.optimizers.Adam(), model)
        train_steps(env, model, opt, data)

    compare(scenario).assert_recomputed(at_least=3)


class LoggingNet(chainer.Chain):
    """Outputs computed for logging, not used by the loss: kept on the
    Link (``keep``) or computed and thrown away at once (``throwaway``)."""

    def __init__(self, kind: str, w: int = 32, h: int = 64) -> None:
        super().__init__()
        self.kind = kind
        with self.init_scope():
            self.l1, self.l2 = L.Linear(w, h), L.Linear(h, h)
            self.l3, self.out = L.Linear(h, h), L.Linear(h, 10)

    def forward(self, x):
        h = F.relu(self.l1(x))
        if self.kind == "keep":
            self.act_mean = F.mean(h)
        else:
            F.sigmoid(h)
        h = F.relu(self.l2(h))
        h = F.relu(self.l3(h))
        y = self.out(h)
        if self.kind == "keep":
            self.prob = F.softmax(y)
        else:
            F.max(F.softmax(y))
        return y


@pytest.mark.parametrize("kind", ["keep", "throwaway"])
def test_outputs_not_used_by_the_loss(kind):
    """Softmax, a mean and Classifier's accuracy computed for logging only,
    kept on the Link or thrown away as soon as computed."""
    data = batches(4)

    def scenario(env):
        model = env.apply("model", L.Classifier(LoggingNet(kind)))
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        train_steps(env, model, opt, data)

    compare(scenario).assert_recomputed(at_least=3)


class Branchy(chainer.Chain):
    """The data select the branch (the sign of a batch statistic)."""

    def __init__(self, w: int = 32, h: int = 64) -> None:
        super().__init__()
        with self.init_scope():
            self.l0 = L.Linear(w, h)
            self.a1, self.a2 = L.Linear(h, h), L.Linear(h, h)
            self.b1 = L.Linear(h, h)
            self.l1, self.out = L.Linear(h, h), L.Linear(h, 10)

    def forward(self, x, t):
        if float(x.mean()) >= 0:  # early: the first function differs
            h = F.relu(self.l0(x))
        else:
            h = F.tanh(self.l0(x))
        if float(h.array[:, 0].mean()) >= float(h.array[:, 1].mean()):  # late
            h = F.relu(self.a2(F.relu(self.a1(h))))
        else:
            h = F.tanh(self.b1(h))
        h = F.relu(self.l1(h))
        return F.softmax_cross_entropy(self.out(h), t)


def test_data_dependent_branch_selection():
    rs = np.random.RandomState(9)
    data = []
    for i in range(8):
        x = rs.randn(16, 32).astype(np.float32) + (0.5 if SIGNS[i] > 0 else -0.5)
        data.append((x, rs.randint(0, 10, 16).astype(np.int32)))

    def scenario(env):
        model = env.apply("model", Branchy())
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        train_steps(env, model, opt, data)

    compare(scenario).assert_recomputed(at_least=3)


class LayerChoice(chainer.Chain):
    """The data choose which of two Linear layers of the same shape runs:
    same function names, shapes and wiring of arrays, other parameters."""

    def __init__(self, w: int = 32) -> None:
        super().__init__()
        with self.init_scope():
            self.a, self.b = L.Linear(w, w), L.Linear(w, w)
            self.cs = chainer.ChainList(*[L.Linear(w, w) for _ in range(4)])
            self.out = L.Linear(w, 10)

    def forward(self, x, t):
        h = F.tanh((self.a if float(x.mean()) >= 0 else self.b)(x))
        for c in self.cs:
            h = F.tanh(c(h))
        return F.softmax_cross_entropy(self.out(h), t)


class BNThenBranch(chainer.Chain):
    """BatchNorm first; the data add a function at the end, so the
    structure seen on a mismatch iteration is planned too."""

    def __init__(self, w: int = 32) -> None:
        super().__init__()
        with self.init_scope():
            self.bn = L.BatchNormalization(w)
            self.cs = chainer.ChainList(*[L.Linear(w, w) for _ in range(4)])
            self.out = L.Linear(w, 10)

    def forward(self, x, t):
        h = F.tanh(self.bn(x))
        for c in self.cs:
            h = F.tanh(c(h))
        if float(x.mean()) < 0:
            h = F.relu(h)
        return F.softmax_cross_entropy(self.out(h), t)


def _shifted(signs, seed=14):
    rs = np.random.RandomState(seed)
    return [(rs.randn(16, 32).astype(np.float32) + s, rs.randint(0, 10, 16).astype(np.int32))
            for s in signs]


@pytest.mark.parametrize("net, signs", [
    (LayerChoice, [1, -1, 1, -1, 1, -1]),
    (BNThenBranch, [1, -1, -1, -1, 1, -1]),
], ids=["same_shaped_layers", "batchnorm_then_branch"])
def test_data_dependent_structure_more(net, signs):
    """Data-dependent structure, two more shapes of it: a choice between
    two Linear layers of the same shape (the candidate plans differ only
    in their parameters), and a BatchNorm followed by a data-dependent
    function (its statistics must be updated once per call on the plan
    made from a mismatch iteration as on any other)."""
    data = _shifted(signs)

    def scenario(env):
        model = env.apply("model", net(), **LEAST_ACT)
        opt = env.optimizer("main", chainer.optimizers.SGD(0.1), model)
        train_steps(env, model, opt, data)

    compare(scenario).assert_recomputed(at_least=3)


# ------------------------------------------------------- double backprop
class Critic(chainer.Chain):
    def __init__(self, n_in: int = 32, w: int = 64, depth: int = 6) -> None:
        super().__init__()
        with self.init_scope():
            self.layers = chainer.ChainList(*[L.Linear(n_in if k == 0 else w, w)
                                              for k in range(depth)])
            self.last = L.Linear(w, 1)

    def forward(self, x):
        h = x
        for lin in self.layers:
            h = F.leaky_relu(lin(h))
        return self.last(h)


def gradient_penalty(critic, x_real, x_fake, eps):
    x_hat = chainer.Variable(eps * x_real + (1 - eps) * x_fake)
    y_hat = critic(x_hat)
    g, = chainer.grad([F.sum(y_hat)], [x_hat], enable_double_backprop=True)
    return F.mean((F.sqrt(F.batch_l2_norm_squared(g) + 1e-12) - 1) ** 2)


class WGANGPLoss(chainer.Chain):
    """WGAN-GP's critic loss as one Link: ``chainer.grad`` with double
    backprop inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        with self.init_scope():
            self.critic = Critic()

    def forward(self, x_real, x_fake, eps):
        y_real = self.critic(x_real)
        y_fake = self.critic(x_fake)
        gp = gradient_penalty(self.critic, x_real, x_fake, eps)
        return F.mean(y_fake) - F.mean(y_real) + 10 * gp


def wgan_data(steps=4, batch=16):
    rs = np.random.RandomState(10)
    return [(np.tanh(rs.randn(batch, 32)).astype(np.float32),
             np.tanh(rs.randn(batch, 32)).astype(np.float32),
             rs.uniform(0, 1, (batch, 1)).astype(np.float32)) for _ in range(steps)]


def _double_backprop_inside_scenario(env):
    model = env.apply("model", WGANGPLoss())
    opt = env.optimizer("main", chainer.optimizers.Adam(1e-4, beta1=0.5), model)
    train_steps(env, model, opt, wgan_data())


def test_double_backprop_inside_forward():
    """A gradient penalty computed inside the applied forward: identical,
    no crash."""
    pair = compare(_double_backprop_inside_scenario)
    s = [st["model"].path for _, st in pair.ours.stats]
    assert "planned" in s, pair.stats_report()


def test_double_backprop_inside_forward_still_recomputes():
    """The parts of that graph that the second-order graph does not read
    (the critic on the real and the fake batch) can still be dropped."""
    compare(_double_backprop_inside_scenario).assert_recomputed(at_least=3)


def test_double_backprop_after_forward_gradient_penalty():
    """WGAN-GP with the critic applied and the penalty computed outside
    it: three calls of the critic, one of them differentiated twice."""
    data = wgan_data()

    def scenario(env):
        critic = env.apply("critic", Critic())
        opt = env.optimizer("main", chainer.optimizers.Adam(1e-4, beta1=0.5), critic)
        for i, (x_real, x_fake, eps) in enumerate(data):
            y_real, y_fake = critic(x_real), critic(x_fake)
            loss = F.mean(y_fake) - F.mean(y_real) + 10 * gradient_penalty(
                critic, x_real, x_fake, eps)
            critic.cleargrads()
            loss.backward()
            env.snap(f"{i} backward", loss=loss)
            opt.update()
            env.snap(f"{i} update")

    compare(scenario, **LEAST_ACT).assert_recomputed(at_least=3)


def test_double_backprop_after_forward_input_gradient():
    """``chainer.grad(..., enable_double_backprop=True)`` of an applied
    Classifier's loss with respect to its input, penalised."""
    data = batches(4)

    def scenario(env):
        lossfun = functools.partial(F.softmax_cross_entropy, enable_double_backprop=True)
        model = env.apply("model", L.Classifier(MLP(), lossfun=lossfun))
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        for i, (x, t) in enumerate(data):
            xv = chainer.Variable(x)
            loss = model(xv, t)
            gx, = chainer.grad([loss], [xv], enable_double_backprop=True)
            total = loss + F.sum(gx * gx)
            model.cleargrads()
            total.backward()
            env.snap(f"{i} backward", loss=total)
            opt.update()
            env.snap(f"{i} update")

    compare(scenario, **LEAST_ACT).assert_recomputed(at_least=3)


# =====================================================================
# API
# =====================================================================
class CallOnly(chainer.Chain):
    """Defines ``__call__`` only (no ``forward``), like the VAE example's
    loss Link."""

    def __init__(self) -> None:
        super().__init__()
        with self.init_scope():
            self.net = MLP()

    def __call__(self, x, t):
        return F.softmax_cross_entropy(self.net(x), t)


def test_link_with_only_call():
    data = batches(4)

    def scenario(env):
        model = env.apply("model", CallOnly())
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        train_steps(env, model, opt, data)

    compare(scenario).assert_recomputed(at_least=3)


class MyClassifier(L.Classifier):
    def __call__(self, x, t):
        self.y = self.predictor(x)
        self.loss = F.softmax_cross_entropy(self.y, t)
        self.accuracy = F.accuracy(self.y, t)
        return self.loss


def test_classifier_subclass_overriding_call():
    """Must really recompute (planned, with drops) on every step, the first
    planned from captures."""
    data = batches(4)

    def scenario(env):
        model = env.apply("model", MyClassifier(MLP()))
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        train_steps(env, model, opt, data)

    pair = compare(scenario).assert_recomputed(at_least=3)
    paths = [s["model"].path for label, s in pair.ours.stats if label.endswith("backward")]
    assert paths == ["planned"] * 4, pair.stats_report()  # the first from captures


def test_nested_apply():
    """An applied predictor inside an applied Classifier: it works (the
    inner runner passes through and runs as part of the outer plan), and
    the results are identical."""
    data = batches(4)

    def scenario(env):
        inner = env.apply("inner", MLP())
        model = env.apply("outer", L.Classifier(inner))
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        del env.links["inner"]  # recorded through the outer link
        train_steps(env, model, opt, data)

    pair = compare(scenario).assert_recomputed(["outer"], at_least=3)
    # the inner runner did not run a plan of its own inside the outer one
    assert all(s["inner"].path is None for _, s in pair.ours.stats), pair.stats_report()
    assert not pair.ours.runners["inner"].signatures()


def test_pickle_applied_model():
    """Train, pickle the applied model with its optimizer, unpickle, go on
    training: identical to doing the same with plain Chainer, and the
    unpickled model recomputes with a runner (and plans) of its own."""
    data = batches(6)

    def scenario(env):
        model = env.apply("model", L.Classifier(MLP(dropout=0.2)))
        opt = env.optimizer("main", chainer.optimizers.Adam(), model)
        train_steps(env, model, opt, data[:3])
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
        if env.applied:
            r1, r2 = cr.runner_of(model), cr.runner_of(model2)
            assert r2 is not None and r2 is not r1
            assert r2.options == r1.options
            assert not r2.signatures()  # plans of its own, made afresh
        env.track("model", model2)
        env.optimizers["main"] = opt2
        del model, opt
        train_steps(env, model2, opt2, data[3:], start=3)

    pair = compare(scenario)
    labels = [label for label, s in pair.ours.stats if s["model"].dropped]
    assert any(label.startswith(("4", "5")) for label in labels), pair.stats_report()


class _Recorder(training.Extension):
    trigger = (1, "iteration")
    priority = -1000  # after every other extension

    def __init__(self, env: Env, tag: str = "") -> None:
        self.env, self.tag = env, tag

    def __call__(self, trainer):
        obs = {k: v for k, v in trainer.observation.items()}
        self.env.snap(f"{self.tag}{trainer.updater.iteration}",
                      **{k.replace("/", "_"): v for k, v in sorted(obs.items())})


def test_trainer_snapshot_and_load_npz(tmp_path):
    """A Trainer snapshot (``extensions.snapshot``) of an applied model,
    loaded with ``serializers.load_npz`` into a new applied trainer, which
    goes on training."""
    rs = np.random.RandomState(11)
    dataset = chainer.datasets.TupleDataset(rs.randn(24, 32).astype(np.float32),
                                            rs.randint(0, 10, 24).astype(np.int32))

    def make(env, out, epochs):
        model = env.apply("model", L.Classifier(MLP(lazy=True, dropout=0.2)))
        opt = env.optimizer("main", chainer.optimizers.Adam(), model)
        it = chainer.iterators.SerialIterator(dataset, 8, shuffle=True)
        updater = training.updaters.StandardUpdater(it, opt)
        trainer = training.Trainer(updater, (epochs, "epoch"), out=out)
        trainer.extend(_Recorder(env, f"{epochs}:"))
        return trainer

    def scenario(env):
        out = str(tmp_path / ("applied" if env.applied else "plain"))
        trainer = make(env, out, 2)
        trainer.extend(extensions.snapshot(filename="snap"), trigger=(1, "epoch"))
        trainer.run()
        del trainer
        trainer = make(env, out, 4)
        serializers.load_npz(os.path.join(out, "snap"), trainer)
        env.snap("loaded")
        trainer.run()

    pair = compare(scenario)
    labels = [label for label, s in pair.ours.stats if s["model"].dropped]
    assert any(label.startswith("4:") for label in labels), pair.stats_report()


def test_copy_and_deepcopy_get_their_own_plans():
    """``model.copy()`` and ``copy.deepcopy(model)`` recompute with
    runners of their own; training the copies leaves the original's plans
    alone; everything identical to the same with plain Chainer."""
    data = batches(8)

    def scenario(env):
        model = env.apply("model", L.Classifier(MLP()))
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        train_steps(env, model, opt, data[:2])
        shallow = env.track("shallow", model.copy())
        deep = env.track("deep", copy.deepcopy(model))
        if env.applied:
            runners = [cr.runner_of(m) for m in (model, shallow, deep)]
            assert all(r is not None for r in runners)
            assert len({id(r) for r in runners}) == 3
            before = {v.signature: v.structures for v in runners[0].signatures()}
        opt_deep = chainer.optimizers.MomentumSGD(0.05)
        opt_deep.setup(deep)
        env.optimizers["deep"] = opt_deep
        train_steps(env, deep, opt_deep, data[2:5], start=2)
        # the shallow copy shares the parameters: the original's optimizer updates them
        train_steps(env, shallow, opt, data[5:8], start=5)
        if env.applied:
            after = {v.signature: v.structures for v in runners[0].signatures()}
            assert before.keys() == after.keys()
            for k in before:
                assert [id(s.program) for s in before[k]] == [id(s.program) for s in after[k]]

    pair = compare(scenario)
    pair.assert_recomputed(["model"], at_least=1)
    pair.assert_recomputed(["deep"], at_least=2)
    pair.assert_recomputed(["shallow"], at_least=2)


def test_budget_least_in_apply():
    data = batches(4)

    def scenario(env):
        model = env.apply("model", L.Classifier(MLP()))
        assert model is not None
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        train_steps(env, model, opt, data)
        if env.applied:
            env.data["plans"] = list(cr.runner_of(model).plans.values())

    pair = compare(scenario, budget="least").assert_recomputed(at_least=3)
    plans = pair.ours.data["plans"]
    assert len(plans) == 1 and plans[0].feasible


_LEAST_RE = re.compile(r"least feasible (?:budget )?(?:is )?([0-9.]+ ?[kKMGT]?i?B)")


@pytest.mark.parametrize("scope", ["total", "activations"])
@pytest.mark.parametrize("hidden", [40, 64, 100])
def test_infeasible_budget_figure_can_be_pasted_back(scope, hidden):
    """The least feasible figure printed by ``InfeasibleBudgetError`` is
    accepted when passed back as the budget (three widths, so that the
    figure falls differently against its last printed digit)."""
    x, t = batches(1)[0]
    np.random.seed(0)
    model = L.Classifier(MLP(hidden=hidden))
    cr.apply(model, budget=1, budget_scope=scope)
    with pytest.raises(InfeasibleBudgetError) as info:
        model(x, t)  # planned from captures before it runs
    message = str(info.value)
    m = _LEAST_RE.search(message)
    assert m, message
    figure = m.group(1)
    cr.apply(model, budget=figure, budget_scope=scope)  # the model as it was
    try:
        model(x, t).backward()
    except InfeasibleBudgetError as e:
        pytest.fail(f"pasting back {figure!r} ({cr.parse_bytes(figure)} B) from\n  {message}\n"
                    f"is refused (least feasible: {info.value.least_feasible_bytes} B):\n  {e}",
                    pytrace=False)
    stats = cr.runner_of(model).last_stats
    assert stats.path == "planned", (figure, stats)
    assert cr.parse_bytes(figure) >= info.value.least_feasible_bytes, (figure, message)


def _returns_scenario(kind):
    data = batches(4)

    class Net(MLP):
        def forward(self, x, t):
            y = super().forward(x)
            loss = F.softmax_cross_entropy(y, t)
            acc = F.accuracy(y, t)
            if kind == "tuple":
                return loss, acc
            return {"loss": loss, "accuracy": acc, "logits": y}

    def scenario(env):
        model = env.apply("model", Net())
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        for i, (x, t) in enumerate(data):
            model.cleargrads()
            out = model(x, t)
            loss, acc = (out if kind == "tuple" else (out["loss"], out["accuracy"]))
            loss.backward()
            env.snap(f"{i} backward", loss=loss, accuracy=acc)
            opt.update()
            env.snap(f"{i} update")

    return scenario


class Encoder(chainer.Chain):
    def __init__(self, n_in: int = 32, n_h: int = 64, n_z: int = 8, depth: int = 5) -> None:
        super().__init__()
        with self.init_scope():
            self.layers = chainer.ChainList(*[L.Linear(n_in if k == 0 else n_h, n_h)
                                              for k in range(depth)])
            self.mu, self.ln_sigma = L.Linear(n_h, n_z), L.Linear(n_h, n_z)

    def forward(self, x):
        h = x
        for lin in self.layers:
            h = F.tanh(lin(h))
        return D.Normal(loc=self.mu(h), log_scale=self.ln_sigma(h))


class Decoder(chainer.Chain):
    def __init__(self, n_z: int = 8, n_h: int = 64, n_out: int = 32) -> None:
        super().__init__()
        with self.init_scope():
            self.l1, self.l2 = L.Linear(n_z, n_h), L.Linear(n_h, n_out)

    def forward(self, z):
        return D.Bernoulli(logit=self.l2(F.tanh(self.l1(z))))


def _distribution_scenario(env):
    rs = np.random.RandomState(12)
    data = [(rs.uniform(0, 1, (16, 32)) > 0.5).astype(np.float32) for _ in range(4)]
    enc = env.apply("enc", Encoder())
    dec = env.track("dec", Decoder())
    model = chainer.ChainList(enc, dec)
    opt = env.optimizer("main", chainer.optimizers.Adam(), model)
    prior = D.Normal(np.zeros(8, np.float32), np.ones(8, np.float32))
    for i, x in enumerate(data):
        q = enc(x)
        z = q.sample()  # draws from the global RNG
        rec = -F.sum(dec(z).log_prob(x)) / len(x)
        kl = F.sum(chainer.kl_divergence(q, prior)) / len(x)
        loss = rec + kl
        model.cleargrads()
        loss.backward()
        env.snap(f"{i} backward", loss=loss)
        opt.update()
        env.snap(f"{i} update")


@pytest.mark.parametrize("kind", ["tuple", "dict", "distribution"])
def test_forward_returning_other_than_a_variable(kind):
    if kind == "distribution":
        compare(_distribution_scenario, **LEAST_ACT).assert_recomputed(at_least=3)
    else:
        compare(_returns_scenario(kind)).assert_recomputed(at_least=3)


@pytest.mark.parametrize("capture_batch", [None, 4])
def test_graph_backpropagated_twice_simple(capture_batch):
    """Two losses from one applied forward, each backpropagated in turn:
    the second backward recomputes at most what the first did. With
    ``capture_batch`` the plan is made from a capture with one backward,
    so the first planned iteration meets the second backward unannounced."""
    data = batches(4)

    def scenario(env):
        model = env.apply("model", MLP(depth=6), capture_batch=capture_batch)
        opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
        for i, (x, t) in enumerate(data):
            model.cleargrads()
            y = model(x)
            loss1 = F.softmax_cross_entropy(y, t)
            loss1.backward()
            env.snap(f"{i} first backward", loss=loss1)
            loss2 = 0.1 * F.mean(y * y)
            loss2.backward()
            env.snap(f"{i} second backward", loss=loss2)
            opt.update()
            env.snap(f"{i} update")

    pair = compare(scenario, **LEAST_ACT).assert_recomputed(at_least=3)
    _assert_second_backward_cheaper(pair, "model", "first backward", "second backward")


def _assert_second_backward_cheaper(pair, name, first, second):
    """On every step where ``name`` ran a plan with drops: when the memory
    allows keeping what the first backward regenerated (release mode
    ``all``), the second backward pass recomputes at most what the first
    did; when it does not (a tight budget), it regenerates what the first
    released, about each node once, never node by node over and over (at
    most the first pass's recomputations plus one per function, and a few
    more the first time the second pass comes unannounced)."""
    checked, bad = 0, []
    for i in range(8):
        try:
            a = pair.ours.stats_at(f"{i} {first}")[name]
            b = pair.ours.stats_at(f"{i} {second}")[name]
        except KeyError:
            break
        if not a.dropped:
            continue
        first_n = a.recomputed_nodes
        second_n = b.recomputed_nodes - a.recomputed_nodes
        limit = first_n if a.release_mode == "all" else first_n + int(1.25 * a.n_nodes)
        if second_n > limit:
            bad.append(f"step {i}: first backward {first_n}, second {second_n} "
                       f"(release mode {a.release_mode}, {a.n_nodes} functions)")
        checked += 1
    assert not bad, (f"{name}: the second backward recomputed too much: "
                     + "; ".join(bad) + "\n" + pair.stats_report())
    assert checked >= 2, pair.stats_report()


class SkipEncoder(chainer.Chain):
    """Returns every hidden state (a U-Net encoder, as pix2pix's). With
    ``norm``, each state is a BatchNormalization's output: its function
    holds derived arrays (mean, inverse std), so the plan may release and
    regenerate it; a function that returns its output and holds nothing
    else (relu) is never released."""

    def __init__(self, width: int = 32, hidden: int = 48, depth: int = 5,
                 norm: bool = False) -> None:
        super().__init__()
        with self.init_scope():
            self.layers = chainer.ChainList(*[L.Linear(width if i == 0 else hidden, hidden)
                                              for i in range(depth)])
            self.norms = chainer.ChainList(*[L.BatchNormalization(hidden)
                                             for _ in range(depth if norm else 0)])

    def forward(self, x):
        hs = []
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x))  # relu keeps its output: the hs are retained
            if len(self.norms):
                x = self.norms[i](x)
            hs.append(x)
        return hs


class SkipDecoder(chainer.Chain):
    def __init__(self, hidden: int = 48, depth: int = 5, out: int = 10) -> None:
        super().__init__()
        with self.init_scope():
            self.layers = chainer.ChainList(*[L.Linear(hidden * (1 if i == 0 else 2), hidden)
                                              for i in range(depth)])
            self.out = L.Linear(hidden, out)

    def forward(self, hs):
        h = F.tanh(self.layers[0](hs[-1]))  # linear keeps its input: hs[-1]
        for layer, skip in zip(self.layers[1:], hs[-2::-1]):
            h = F.tanh(layer(F.concat([h, skip])))
        return self.out(h)


def test_outputs_backpropagated_again_by_their_consumer():
    """pix2pix's updater: an applied encoder's outputs feed a plain
    decoder; the encoder is updated from the first backward, its outputs
    are unchained, and the decoder's loss is backpropagated again through
    the decoder alone, which reads the encoder's outputs once more (they
    used to be released by the encoder's plan after the first backward)."""
    data = batches(4)

    def scenario(env):
        enc = env.apply("enc", SkipEncoder(norm=True))
        dec = SkipDecoder()
        env.links["dec"] = dec
        opt_enc = env.optimizer("enc", chainer.optimizers.Adam(), enc)
        opt_dec = env.optimizer("dec", chainer.optimizers.Adam(), dec)
        for i, (x, t) in enumerate(data):
            hs = enc(x)
            y = dec(hs)
            opt_enc.update(lambda: F.softmax_cross_entropy(y, t))
            env.snap(f"{i} enc update")
            for h in hs:
                h.unchain_backward()
            opt_dec.update(lambda: F.softmax_cross_entropy(y, t) + 0.1 * F.mean(y * y))
            env.snap(f"{i} dec update")

    compare(scenario, **LEAST_ACT).assert_recomputed(["enc"], at_least=3)


def test_regenerated_outputs_are_the_callers_arrays():
    """A returned array that its block regenerates for backward is put
    back as the caller's own array, not a second copy of it (which would
    stay until the graph dies: returned arrays are not released again)."""
    x, t = batches(1)[0]
    np.random.seed(0)
    enc, dec = SkipEncoder(norm=True), SkipDecoder()
    cr.apply(enc, **LEAST_ACT, verbose=False)
    for _ in range(3):
        hs = enc(x)
        F.softmax_cross_entropy(dec(hs), t).backward()
    stats = cr.runner_of(enc).last_stats
    assert stats.path == "planned" and stats.recomputed_nodes > 0, stats
    back = [h.node._data is h.array for h in hs if h.node._data is not None]
    assert back and all(back), back


def test_returned_outputs_are_never_dropped():
    """Under the paper's model the plan drops the encoder's relu outputs,
    which the forward returns: releasing them would free nothing (the
    caller holds them, and relu retains only them) and regenerating them
    made a second copy. They are never released or recomputed, and the
    applied encoder's peak (NumPy arrays, :class:`MemoryMeter`, which the
    runner's own measurements nest in) is plain Chainer's, to within half
    a hidden state (it was two hidden states above it)."""
    x, t = batches(1, batch=64, width=256)[0]

    def peak(applied: bool) -> int:
        np.random.seed(0)
        enc, dec = SkipEncoder(width=256, hidden=512), SkipDecoder(hidden=512)
        if applied:
            cr.apply(enc, **LEAST_ACT, verbose=False)
        for _ in range(3):  # recorded, planned, planned
            with MemoryMeter() as meter:
                hs = enc(x)
                F.softmax_cross_entropy(dec(hs), t).backward()
                del hs
        if applied:
            (entry,) = cr.runner_of(enc).signatures()
            program = entry.structures[0].program
            relus = {n.id for n in program.graph.nodes if n.op == "ReLU"}
            assert len(relus) == 5 and not relus & program.releasable, program.dropped
            assert cr.runner_of(enc).last_stats.recomputed_nodes == 0
        return meter.result.peak_bytes

    plain, ours = peak(False), peak(True)
    state = 64 * 512 * 4  # one hidden state
    assert ours < plain + state // 2, (ours, plain)


@pytest.mark.parametrize("capture_batch", [None, 4])
def test_gan_graphs_backpropagated_twice(capture_batch):
    """The DCGAN update backpropagates the generator's graph and the
    discriminator's graph of the fake batch twice (the discriminator's
    loss, then the generator's), with the discriminator updated in
    between: the second backward recomputes at most what the first did."""
    pair = compare(dcgan_scenario(("gen", "dis")), capture_batch=capture_batch)
    pair.assert_recomputed(["gen", "dis"], at_least=3)
    errors = []
    for name in ("gen", "dis"):
        try:
            _assert_second_backward_cheaper(pair, name, "dis backward", "gen backward")
        except AssertionError as e:
            errors.append(str(e).split("\n")[0])
    assert not errors, "\n".join(errors) + "\n" + pair.stats_report()


# =====================================================================
# A Trainer, 3 epochs
# =====================================================================
def test_trainer_three_epochs_shuffle_lazy_dropout(tmp_path):
    """StandardUpdater over a shuffling SerialIterator, lazy layers,
    dropout, an Evaluator and a LogReport; every iteration compared."""
    rs = np.random.RandomState(13)
    train = chainer.datasets.TupleDataset(rs.randn(40, 32).astype(np.float32),
                                          rs.randint(0, 10, 40).astype(np.int32))
    test = chainer.datasets.TupleDataset(rs.randn(16, 32).astype(np.float32),
                                         rs.randint(0, 10, 16).astype(np.int32))

    def scenario(env):
        out = str(tmp_path / ("applied" if env.applied else "plain"))
        model = env.apply("model", L.Classifier(MLP(lazy=True, dropout=0.3)))
        opt = env.optimizer("main", chainer.optimizers.Adam(), model)
        it = chainer.iterators.SerialIterator(train, 8, shuffle=True)
        test_it = chainer.iterators.SerialIterator(test, 8, repeat=False, shuffle=False)
        trainer = training.Trainer(training.updaters.StandardUpdater(it, opt), (3, "epoch"),
                                   out=out)
        trainer.extend(extensions.Evaluator(test_it, model), trigger=(1, "epoch"))
        trainer.extend(extensions.LogReport(trigger=(1, "epoch")))
        trainer.extend(_Recorder(env))
        trainer.run()

    pair = compare(scenario)
    assert len(pair.plain.records) == 15
    pair.assert_recomputed(at_least=12)


# =====================================================================
# Fallback paths: never more memory than plain Chainer
# =====================================================================
class EverChanging(chainer.Chain):
    """Its structure changes on every call (depth from a call counter)."""

    def __init__(self, w: int = 64, depth: int = 16) -> None:
        super().__init__()
        self.calls = 0
        with self.init_scope():
            self.layers = chainer.ChainList(*[L.Linear(w, w) for _ in range(depth)])
            self.out = L.Linear(w, 10)

    def forward(self, x, t):
        self.calls += 1
        h = x
        for lin in self.layers[:1 + self.calls % len(self.layers)]:
            h = F.relu(lin(h))
        return F.softmax_cross_entropy(self.out(h), t)


#: Arrays the runner keeps for its own bookkeeping (the plans it caches
#: hold a few small index arrays, ~100 B per plan): not the model's memory.
BOOKKEEPING = 1024


def _peak(model, x, t):
    model.cleargrads()
    gc.collect()
    with MemoryMeter() as meter:
        loss = model(x, t)
        loss.backward()
        del loss
    return meter.result.peak_bytes


@pytest.mark.slow  # 20 s over its four cases
@pytest.mark.parametrize("plan_at", ["backward", "call"])
@pytest.mark.parametrize("size", ["wide", "tiny"])
def test_ever_changing_structure_falls_back_to_plain(size, plan_at):
    """A model whose graph changes on every call ends on the ``plain``
    path with one warning; gradients identical to plain Chainer; its
    measured peak (forward + backward, ``MemoryMeter`` around the call and
    ``backward()``) is never above plain Chainer's (give or take
    ``BOOKKEEPING`` bytes of cached plans), on the plain path and
    on the ``mismatch`` calls before it (which plan the new structure
    inside the call). With ``plan_at='backward'`` (the default) the
    recorded and mismatch calls also hold the planner, which runs at the
    end of their backward: on ``tiny`` that is more than the model's arrays,
    so there only the plain-path calls are held to plain's peak. ``wide``: activations dominate (batch 256, width
    256); ``tiny``: batch 32, width 64, where the arrays of the model are
    smaller than what planning allocates."""
    batch, width = (256, 256) if size == "wide" else (32, 64)
    x, t = batches(1, batch=batch, width=width)[0]
    np.random.seed(0)
    plain = EverChanging(w=width)
    ours = copy.deepcopy(plain)
    cr.apply(ours, budget="least", tuning=cr.Tuning(plan_at=plan_at))
    runner = cr.runner_of(ours)
    paths, peaks = [], []
    catcher = _LogCatcher()
    with _catching(catcher):
        for i in range(10):
            np.random.seed(100 + i)
            p_plain = _peak(plain, x, t)
            np.random.seed(100 + i)
            p_ours = _peak(ours, x, t)
            paths.append(runner.last_stats.path)
            peaks.append((p_plain, p_ours))
            a, b = {}, {}
            link_records("", plain, a)
            link_records("", ours, b)
            assert a.keys() == b.keys()
            for k in a:
                assert _same(k, a[k], b[k]), (i, k)
    fallback = [r for r in catcher.records if r.levelno >= logging.WARNING
                and "without recomputation" in r.getMessage()]
    assert paths[-1] == "plain", paths
    assert len(fallback) == 1, [r.getMessage() for r in catcher.records]
    held = (lambda path: True) if plan_at == "call" or size == "wide" else \
        (lambda path: path == "plain")
    over = [(i, path, p, q) for i, (path, (p, q)) in enumerate(zip(paths, peaks))
            if held(path) and q > p + BOOKKEEPING]
    assert not over, (f"measured peak above plain Chainer's (call, path, plain bytes, applied "
                      f"bytes): {over}")
