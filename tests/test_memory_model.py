"""The measured memory model: views cost nothing, transients are
measured, the replayed peak matches the allocator, budgets hold, and a
misprediction is corrected at run time."""
from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from chainer_recompute.core.units import format_bytes_up

import chainer_recompute as cr
import chainer
import chainer.functions as F
import chainer.links as L

from chainer_recompute.core.budget import MARGIN, BudgetSearch, plan_for_budget
from chainer_recompute.core.execution import ExecutionPlan
from chainer_recompute.core.graph import Graph
from chainer_recompute.core.io import graph_from_dict, graph_to_dict
from chainer_recompute.core.memory_model import measured_model
from chainer_recompute.core.replay import replay
from chainer_recompute.runtime.capture import capture
from test_step_budget import DropoutNet  # noqa: E402 (a dropout + residual net that keeps its loss)

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------- views
def test_views_cost_nothing():
    def f(x):
        h = F.tanh(x)
        a, b = F.split_axis(h, 2, axis=0)  # rows: contiguous, so reshape is a view too
        r = F.reshape(a, (-1,))
        t = F.transpose(b)
        s = h[:, :3]
        return F.sum(r) + F.sum(t) + F.sum(s)

    g = capture(f, chainer.Variable(np.ones((4, 6), np.float32)))
    ops = [n.op for n in g.nodes]
    tanh_out = g.nodes[ops.index("Tanh")].outputs[0]
    for op in ("SplitAxis", "Reshape", "Transpose", "GetItem"):
        node = g.nodes[ops.index(op)]
        assert g.node_bytes[node.id] == 0, op
        for a in node.outputs:
            assert g.arrays[a].view_of == tanh_out, op  # the root buffer, not the direct input
    assert g.node_bytes[ops.index("Tanh")] == 4 * 6 * 4


def test_view_shares_its_base_in_the_replay():
    """A reshape of a retained array adds no bytes in the replay."""
    def make(view):
        def f(x):
            h = F.tanh(x)
            h2 = F.reshape(h, (-1,)) if view else F.tanh(h)
            return F.sum(F.relu(h2))
        return f

    x = np.ones((64, 256), np.float32)
    with_view = capture(make(True), x, backward=True)
    without = capture(make(False), x, backward=True)
    assert replay(without).peak_bytes - replay(with_view).peak_bytes >= 64 * 256 * 4


# ------------------------------------------------------------ transients
@pytest.mark.parametrize("link, shape", [
    (lambda: L.Convolution2D(16, 16, 3, pad=1), (8, 16, 32, 32)),
    (lambda: L.Deconvolution2D(16, 8, 4, 2, 1), (8, 16, 16, 16)),
])
def test_transient_peaks_are_recorded(link, shape):
    lnk = link()
    # (an input that needs a gradient: Chainer 7.8.1's Deconvolution2D
    # backward fails when only W does, plain Chainer included)
    x = chainer.Variable(np.random.RandomState(0).randn(*shape).astype(np.float32))
    g = capture(lambda v: F.sum(lnk(v)), x, backward=True)
    conv = g.nodes[0]
    out_bytes = g.node_bytes[0]
    n, c, h, w = shape
    kh = kw = lnk.W.shape[2]
    # NumPy's im2col (col2im for the deconvolution) works on a buffer of
    # N·C·kh·kw·H·W elements, several times the output.
    assert conv.forward_transient_bytes > out_bytes
    assert conv.backward_transient_bytes is not None and conv.backward_transient_bytes > 0
    assert max(conv.forward_transient_bytes, conv.backward_transient_bytes) >= \
        min(n * c * kh * kw * h * w, n * lnk.W.shape[1] * kh * kw * h * w) * 4 // 2
    assert conv.backward_alloc_bytes is not None


def test_json_schema_2_keeps_the_measurements_and_reads_version_1(tmp_path):
    lnk = L.Convolution2D(3, 4, 3)
    g = capture(lambda v: F.sum(F.reshape(lnk(v), (-1,))), np.ones((2, 3, 8, 8), np.float32),
                backward=True)
    d = graph_to_dict(g)
    assert d["schema_version"] == 3
    g2 = graph_from_dict(json.loads(json.dumps(d)))
    assert g2.nodes[0].forward_transient_bytes == g.nodes[0].forward_transient_bytes
    assert g2.backward_order == g.backward_order
    assert [a.view_of for a in g2.arrays] == [a.view_of for a in g.arrays]
    assert replay(g2).peak_bytes == replay(g).peak_bytes
    # a version 1 file: no measurements, still read
    d1 = {k: v for k, v in d.items() if k != "backward_order"}
    d1["schema_version"] = 1
    for n in d1["nodes"]:
        for k in ("forward_transient_bytes", "backward_transient_bytes",
                  "backward_alloc_bytes", "has_backward"):
            n.pop(k)
    for a in d1["arrays"]:
        a.pop("view_of")
        a.pop("dies_at")
    g1 = graph_from_dict(d1)
    assert g1.nodes[0].forward_transient_bytes is None and replay(g1).peak_bytes > 0


# ----------------------------------------------------- the model and plans
def test_measured_model_terms():
    lnk = L.Convolution2D(3, 8, 3, pad=1)
    g = capture(lambda v: F.sum(F.relu(lnk(v))), np.ones((4, 3, 16, 16), np.float32),
                backward=True, link=lnk)
    m = measured_model(g)
    assert m.scope == "total"
    assert m.constant_bytes >= 2 * g.param_bytes  # parameters and their gradients
    assert m.transient_bytes[0] == max(g.nodes[0].forward_transient_bytes,
                                       g.nodes[0].backward_transient_bytes)
    assert (m.block_bytes >= m.keep_bytes).all()


def test_total_budget_search_fits_and_reports_the_least():
    from chainer_recompute.models.small import SMALL_MODELS
    link, args = SMALL_MODELS["convnet"](0)
    link(*args)
    g = capture(link, *args, backward=True)
    search = BudgetSearch(g, "approx", "tc")
    least = search.least_budget()
    van_plan, van_peak = search.vanilla()
    assert least <= van_peak / (1 - MARGIN) + 1
    plan = search.fit(least)
    assert plan.predicted_peak_bytes <= least * (1 - MARGIN) + 1
    assert plan.info["memory_scope"] == "total"
    with pytest.raises(cr.InfeasibleBudgetError) as info:
        search.fit(least // 2)
    assert info.value.least_feasible_bytes == least
    # the figure in the message, pasted back, is accepted
    import re
    shown = re.search(r"least feasible ([0-9.]+ [KMG]iB)", str(info.value)).group(1)
    assert cr.parse_bytes(shown) >= least
    assert search.fit(cr.parse_bytes(shown)).feasible
    # a budget above plain's need: plain backprop, nothing recomputed (tc)
    assert not search.fit(int(van_peak / (1 - MARGIN)) + 1).recompute
    # and the activations scope is the paper's model
    paper = plan_for_budget(g, "least", scope="activations")
    assert paper.info.get("memory_scope", "activations") == "activations"


def test_least_total_budget_is_the_figure_the_total_scope_accepts():
    """cr.least_feasible_budget is the activations scope's figure, which a
    total budget refuses; the refusal gives the total scope's least figure,
    which is accepted (and one byte less refused), in the user's words (no
    internal function named)."""
    from chainer_recompute.models.small import SMALL_MODELS
    link, args = SMALL_MODELS["convnet"](0)
    link(*args)
    g = capture(link, *args, backward=True)
    paper = cr.least_feasible_budget(g, solver="approx")
    total = cr.least_total_budget(g, solver="approx")
    assert total == BudgetSearch(g, "approx", "tc").least_budget()
    assert plan_for_budget(g, total, solver="approx").feasible
    with pytest.raises(cr.InfeasibleBudgetError):
        plan_for_budget(g, total - 1, solver="approx")
    assert paper < total
    with pytest.raises(cr.InfeasibleBudgetError) as info:
        plan_for_budget(g, paper, solver="approx")
    assert "least_total_budget" not in str(info.value)
    assert "least_feasible_budget" not in str(info.value)
    assert f"raise the budget to at least {format_bytes_up(total)}" in str(info.value)
    assert info.value.least_feasible_bytes == total


def test_least_budget_looks_past_the_strategys_own_plans():
    """The DPs' formula over-counts some plans much more than others: on a
    transformer block no ``tc`` plan replays below about 7.4 MB while an
    ``mc`` plan does 6.1 MB. A ``tc`` search reports the lower least
    budget and fits budgets between the two (with the least overhead
    there), and the least is at or below every candidate tried."""
    from chainer_recompute.models.small import SMALL_MODELS
    link, args = SMALL_MODELS["transformer"](0)
    link(*args)
    g = capture(link, *args, backward=True)
    search = BudgetSearch(g, "approx", "tc")
    tc_only = min(p for _, p in (search.at(b) for b in search._grid()) if p is not None)
    least = search.least_budget()
    assert least * (1 - MARGIN) < 0.95 * tc_only
    assert all(peak >= search.least()[1] for _, peak in search.candidates())
    between = (least + int(tc_only / (1 - MARGIN))) // 2
    plan = plan_for_budget(g, between, solver="approx", strategy="tc")
    assert plan.recompute and plan.predicted_peak_bytes <= between * (1 - MARGIN)
    assert plan_for_budget(g, "least").predicted_peak_bytes == search.least()[1]


# ------------------------------------------------------ against the allocator
WORKER = textwrap.dedent("""
    import gc, json, sys
    from chainer_recompute.runtime.memory import MemoryMeter
    outer = MemoryMeter(); outer.start()   # before anything is allocated: absolute bytes
    import chainer, chainer_recompute as cr
    from chainer_recompute.models.small import SMALL_MODELS
    name, budget = sys.argv[1], sys.argv[2]
    link, args = SMALL_MODELS[name](0)
    if budget != "plain":
        cr.apply(link, budget=budget if budget == "least" else int(budget), verbose=False)
    opt = chainer.optimizers.MomentumSGD(0.01); opt.setup(link)
    peaks = []
    for _ in range(4):
        gc.collect()
        with MemoryMeter() as m:
            opt.update(link, *args)
        peaks.append(m.result.absolute_peak_bytes)
    # step 1 records; step 2 is the first planned one (planning included)
    out = {"measured": max(peaks[2:]), "first": peaks[1]}
    r = cr.runner_of(link)
    if r is not None:
        (e,) = r.signatures()
        s = e.structures[0]
        out.update(predicted=s.plan.predicted_peak_bytes, budget=s.plan.budget_bytes,
                   vanilla=s.plan.info.get("vanilla_peak_bytes"), path=r.last_stats.path,
                   dropped=len(s.program.dropped))
    print(json.dumps(out))
""")


def _measure(name: str, budget: str) -> dict:
    p = subprocess.run([sys.executable, "-c", WORKER, name, budget], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


MODELS = ["convnet", "views", "vae", "deconv_generator", "gru_lm", "transformer"]


@functools.lru_cache(maxsize=None)
def _measured(name: str, budget: str) -> tuple:
    return tuple(sorted(_measure(name, budget).items()))


@pytest.mark.parametrize("name", MODELS)
def test_budget_holds_and_prediction_within_1_percent(name):
    """Steady state (steps 3 and 4), the whole step against the allocator:
    under the least budget, measured / predicted in [0.999, 1.01] (measured
    1.000-1.008 on these six), plain Chainer's real peak within 1% of its
    replayed figure."""
    least = dict(_measured(name, "least"))
    assert least["path"] == "planned"
    assert least["measured"] <= least["budget"], least
    assert 0.999 <= least["measured"] / least["predicted"] <= 1.01, least
    plain = dict(_measured(name, "plain"))
    # the least feasible budget is never above plain Chainer's real peak
    assert least["budget"] <= plain["measured"] * 1.02, (least, plain)
    assert abs(plain["measured"] / least["vanilla"] - 1) <= 0.01, (least, plain)


@pytest.mark.parametrize("name", MODELS)
def test_first_planned_step_under_the_budget(name):
    """The first planned step is under the budget too (the planner ran at
    the end of the recorded backward, in the plain step before it),
    and predicted within 1%."""
    least = dict(_measured(name, "least"))
    assert least["first"] <= least["budget"], least
    assert 0.999 <= least["first"] / least["predicted"] <= 1.01, least


# ------------------------------------------------ gradients summed in backward
class _SharedLinear(chainer.Chain):
    """One Linear applied six times with a residual: its gradient is summed
    at each later use (the previous sum freed), and so is the activation's
    at each Add."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.inp, self.mid, self.out = L.Linear(32, 96), L.Linear(96, 96), L.Linear(96, 10)

    def forward(self, x, t):
        h = F.relu(self.inp(x))
        for _ in range(6):
            h = F.relu(self.mid(h)) + h
        return F.softmax_cross_entropy(self.out(h), t)


def _shared_linear():
    np.random.seed(0)
    rs = np.random.RandomState(1)
    return _SharedLinear(), (rs.randn(16, 32).astype(np.float32),
                             rs.randint(0, 10, 16).astype(np.int32))


#: The loss's gradient (a float32 scalar of ones) that ``loss.backward()``
#: keeps on the loss Variable through the backward: not in the replay.
_LOSS_GRAD_BYTES = 4


def test_summed_gradients_are_predicted_to_the_byte():
    """The recorded backward sees the frees of the gradients a call
    replaces by their sum (one tracing session for the whole backward, as
    in a training loop with no tracer of its own): the least budget's plan
    and plain Chainer are predicted to the byte (but the loss's gradient),
    the whole step against the allocator. With each backward call measured
    in its own session, both were predicted 37,252 B under the allocator
    (201,880 B measured under the plan, 264,600 B plain): the 96x96 weight
    matrix and its bias (and the loss's gradient)."""
    import tracemalloc

    from chainer_recompute.runtime.memory import MemoryMeter
    assert not tracemalloc.is_tracing()  # as in a training loop
    link, args = _shared_linear()
    cr.apply(link, budget="least", verbose=False)
    opt = chainer.optimizers.SGD(0.01)
    opt.setup(link)
    opt.update(link, *args)  # recorded
    opt.update(link, *args)  # the first planned step
    runner = cr.runner_of(link)
    stats = runner.last_stats
    assert stats.path == "planned" and stats.measured_peak_bytes is not None
    (entry,) = runner.signatures()
    s = entry.structures[0]
    assert s.graph.step.correction_bytes == 0  # nothing was corrected
    assert s.plan.recompute
    over = stats.measured_peak_bytes - s.plan.predicted_peak_bytes
    assert 0 <= over <= _LOSS_GRAD_BYTES, (stats.measured_peak_bytes, s.plan.predicted_peak_bytes)

    plain, args = _shared_linear()
    opt = chainer.optimizers.SGD(0.01)
    opt.setup(plain)
    opt.update(plain, *args)  # gradients there, as in a training loop
    with MemoryMeter() as m:  # the model's own arrays adopted: their frees are seen
        m.adopt([p.array for p in plain.params()] + [p.grad for p in plain.params()]
                + list(args))
        opt.update(plain, *args)
    over = m.result.absolute_peak_bytes - s.plan.info["vanilla_peak_bytes"]
    assert 0 <= over <= _LOSS_GRAD_BYTES, (m.result.absolute_peak_bytes,
                                           s.plan.info["vanilla_peak_bytes"])


#: The previous step's loss, which the model keeps until its forward ends:
#: counted by the runner (the previous graph at the call), not in the replay.
_PREVIOUS_LOSS_BYTES = 4


@pytest.mark.parametrize("keep_loss", [False, True])
@pytest.mark.parametrize("dataset", ["fresh", "in_memory"])
def test_dropout_residual_net_that_keeps_its_loss_is_predicted_to_the_byte(keep_loss, dataset):
    """Every planned step, the update included, is predicted to the byte
    but the previous loss. Before the replay kept the graph the model
    keeps through the update, the six dropout masks (98,304 B) under the
    update's temporary were missed: measured 1,484,672 B against 1,464,064
    predicted, over the budget, corrected. Before the previous graph let go
    of the caller's arrays its functions retained (the previous batch,
    8,320 B, and its loss), the runner counted that batch as the model's
    while the graph held it (an in-memory dataset: 8,324 B over)."""
    import tracemalloc
    assert not tracemalloc.is_tracing()  # as in a training loop
    rs = np.random.RandomState(4)
    batches = [(rs.randn(32, 64).astype(np.float32), rs.randint(0, 10, 32).astype(np.int32))
               for _ in range(4)]
    np.random.seed(0)
    link = DropoutNet()
    # the recorded path (the figures above are of a plan made from it), the
    # previous graph let go at the next call (with the default, kept alive as
    # in plain Chainer, it is planned for by its replayed hold, above what
    # this net's graph really holds by about 370 KB: conservative)
    cr.apply(link, budget="least", tuning=cr.Tuning(cost="flops"), verbose=False, capture_batch=None,
             free_previous_graph=True)
    opt = chainer.optimizers.MomentumSGD(0.01)
    opt.setup(link)
    runner = cr.runner_of(link)
    loss = None
    for step in range(4):
        args = batches[step]
        if dataset == "fresh":  # made for this step, as an iterator's converter does
            args = tuple(a.copy() for a in args)
        if keep_loss:  # the loop keeps its loss into the next forward
            loss = link(*args)
            link.cleargrads()
            loss.backward()
            opt.update()
        else:
            opt.update(link, *args)
        del args
        stats = runner.last_stats
        if step == 0:
            assert stats.path == "recorded"
            continue
        (entry,) = runner.signatures()
        s = entry.structures[0]
        assert stats.path == "planned" and s.plan.recompute
        assert s.graph.step.kept_after_backward
        assert s.graph.step.correction_bytes == 0  # nothing was corrected
        over = stats.measured_peak_bytes - s.plan.predicted_peak_bytes
        assert 0 <= over <= _PREVIOUS_LOSS_BYTES, (step, stats.measured_peak_bytes,
                                                   s.plan.predicted_peak_bytes)


# -------------------------------------------------------- runtime check
def _when_called(forward, step):
    def f(*a, **k):
        step["now"] = "forward"
        return forward(*a, **k)
    return f


def test_misprediction_warns_once_corrects_and_replans(monkeypatch, caplog):
    """A plan whose real peak is over the budget (the replay made to under-
    predict) is measured, reported once, corrected and planned again; the
    next plan predicts at least what was measured."""
    from chainer_recompute.core import budget as budget_mod
    from chainer_recompute.models.small import SMALL_MODELS
    link, args = SMALL_MODELS["convnet"](0)
    real_replay = budget_mod.replay_peak
    shrink = {"on": True}

    def optimistic(graph, *plan, **kw):
        peak = real_replay(graph, *plan, **kw)
        if shrink["on"] and graph.step.correction_bytes == 0:
            return int(peak * 0.8)
        return peak

    monkeypatch.setattr(budget_mod, "replay_peak", optimistic)
    cr.apply(link, budget="least", verbose=False, capture_batch=None)  # recorded first
    runner = cr.runner_of(link)
    opt = chainer.optimizers.MomentumSGD(0.01)
    opt.setup(link)
    opt.update(link, *args)  # recorded (the report logger propagates to caplog)
    planned_in = []
    real_plan = runner.planner.plan

    def plan(graph):  # where the correction's planning runs
        planned_in.append(step["now"])
        return real_plan(graph)
    runner.planner.plan = plan
    step = {"now": "planned"}
    opt.update(link, *args)  # planned with the optimistic model: over the budget
    stats = runner.last_stats
    (entry,) = runner.signatures()
    assert "correction_bytes" not in entry.structures[0].graph.meta
    step["now"] = "between"
    link.forward = _when_called(link.forward, step)
    opt.update(link, *args)  # planned again at the call, corrected
    # not inside the step that overshot (its memory would be in that step),
    # but at the next call, before its forward
    assert planned_in == ["between"]
    assert stats.measured_peak_bytes > stats.budget_bytes
    assert caplog.text.count("over the budget") == 1
    (entry,) = runner.signatures()
    s = entry.structures[0]
    assert s.graph.step.correction_bytes > 0
    assert s.plan.predicted_peak_bytes >= stats.measured_peak_bytes * 0.95
    shrink["on"] = False
    after = runner.last_stats
    assert after.path == "planned" and after.measured_peak_bytes <= after.budget_bytes


def test_overshoot_that_the_corrected_model_cannot_meet_raises_at_the_next_call(monkeypatch):
    """The backward that measured the overshoot completes (gradients as in
    plain Chainer); the next call raises InfeasibleBudgetError with the
    least feasible figure, before running anything."""
    import copy
    from chainer_recompute.core import budget as budget_mod
    from chainer_recompute.models.small import SMALL_MODELS
    link, args = SMALL_MODELS["convnet"](0)
    plain = copy.deepcopy(link)
    real_replay = budget_mod.replay_peak

    def optimistic(graph, *plan, **kw):
        peak = real_replay(graph, *plan, **kw)
        if graph.step.correction_bytes == 0:
            return int(peak * 0.7)
        return peak

    monkeypatch.setattr(budget_mod, "replay_peak", optimistic)
    link(*args).backward()  # initialise, as plain below
    plain(*args).backward()
    g = capture(link, *args, backward=True, link=link)
    tight = BudgetSearch(g).least_budget()  # under the optimistic model
    cr.apply(link, budget=tight, verbose=False, on_infeasible="raise",  # default: warn, plain
             capture_batch=None)  # recorded first
    for model in (plain, link):
        model.cleargrads()
        model(*args).backward()  # recorded
    for model in (plain, link):
        model.cleargrads()
        model(*args).backward()  # planned: over the real budget; measured, re-planned
    assert cr.runner_of(link).last_stats.measured_peak_bytes > tight
    for (n, p), (_, q) in zip(sorted(plain.namedparams()), sorted(link.namedparams())):
        np.testing.assert_array_equal(p.grad, q.grad, err_msg=n)
    with pytest.raises(cr.InfeasibleBudgetError) as info:
        link(*args)
    assert info.value.least_feasible_bytes > tight


@pytest.mark.parametrize("solver", ["exact", "approx"])
@pytest.mark.parametrize("engine", ["numpy", "numba"])
def test_planning_leaves_no_arrays_for_the_cyclic_gc(solver, engine, monkeypatch):
    """Everything a plan search allocates is freed by reference counting
    when it returns. A reference cycle (the lower-set family caching an
    object that points back to it) kept a large lattice's arrays alive until
    the cyclic collector ran, which can be many iterations later: 103 MB
    inside GoogLeNet's first planned iteration at batch 32."""
    import gc

    from chainer_recompute.core.solvers import _dp
    from chainer_recompute.runtime.memory import MemoryMeter
    if engine == "numba" and not _dp.numba_available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(_dp, "ENGINE", engine)
    from chainer_recompute.models.small import SMALL_MODELS
    link, args = SMALL_MODELS["convnet"](0)
    g = capture(link, *args, backward=True)
    plan_for_budget(g, "least", solver=solver, scope="total")  # compiled kernels loaded
    gc.collect()
    gc.disable()
    try:
        with MemoryMeter() as m:
            plan = plan_for_budget(g, "least", solver=solver, scope="total")
            assert plan.recompute
            del plan
    finally:
        gc.enable()
    assert m.result.peak_bytes > 0  # the search did allocate arrays
    assert m.result.end_bytes - m.result.start_bytes == 0
