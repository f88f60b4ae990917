"""Bounded convolution workspaces: the kernels of
runtime/workspace.py against Chainer's own, bit for bit; their transients
against core/workspace.py's formulas; apply(workspace=...) on a small VGG-like
block; the planner's 'auto' choice against brute force."""
import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import chainer_recompute as cr
from chainer_recompute.core.budget import plan_for_budget
from chainer_recompute.core.errors import InfeasibleBudgetError, RecomputeError
from chainer_recompute.core.workspace import (bounded_graph, candidate_limits, conv_calls,
                                              parse_workspace, plan_with_workspace)
from chainer_recompute.runtime import workspace as ws
from chainer_recompute.runtime.capture import capture

# (N, C, H, W, O, k, stride, pad, dilate, cover_all): padding, stride 2, a
# batch that no chunk divides, 1x1 and 7x7 kernels, dilation, cover_all
CONV_CASES = [
    (1, 3, 9, 11, 4, 3, 1, 1, 1, False),  # one sample: Chainer's own kernels
    (5, 3, 9, 11, 4, 3, 1, 1, 1, False),
    (5, 3, 9, 11, 4, 3, 2, 1, 1, False),
    (7, 6, 13, 10, 5, 7, 2, 3, 1, False),
    (3, 8, 6, 6, 16, 1, 1, 0, 1, False),
    (5, 4, 9, 9, 3, 3, 1, 1, 2, False),
    (5, 4, 10, 9, 3, 3, 2, 0, 1, True),
]
# (N, Ci, h, w, Co, k, stride, pad)
DECONV_CASES = [(5, 3, 9, 11, 4, 3, 2, 1), (4, 6, 7, 7, 3, 4, 2, 1), (3, 2, 5, 5, 2, 1, 1, 0)]


def _run(fn, arrays, gy_seed, limit, exact=True):
    vs = [chainer.Variable(a.copy()) for a in arrays]
    with ws.bounded(limit, exact):
        y = fn(*vs)
    y.grad = (np.arange(y.size, dtype=y.dtype).reshape(y.shape) * gy_seed % 7) - 3
    y.backward()
    return [y.array] + [v.grad for v in vs], y.array.strides, vs[0].grad.strides


def _compare(fn, arrays, limit=1, exact=True):
    plain, ys, gs = _run(fn, arrays, 5, None)
    before = dict(ws.chunked_calls)
    ours, ys2, gs2 = _run(fn, arrays, 5, limit, exact)
    ran = {k: ws.chunked_calls[k] - before[k] for k in before}
    return plain, ours, (ys, gs), (ys2, gs2), ran


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "x".join(map(str, c)))
def test_convolution_kernels_bit_identical(case):
    n, c, h, w, o, k, s, p, d, cover_all = case
    rng = np.random.RandomState(0)
    arrays = [rng.randn(n, c, h, w).astype(np.float32), rng.randn(o, c, k, k).astype(np.float32),
              rng.randn(o).astype(np.float32)]
    fn = lambda x, W, b: F.convolution_2d(x, W, b, stride=s, pad=p, dilate=d,  # noqa: E731
                                          cover_all=cover_all)
    plain, ours, layout, layout2, ran = _compare(fn, arrays)
    # forward, input, weight and bias gradients, and the memory layouts
    for a, b in zip(plain, ours):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert layout == layout2
    want = 0 if n == 1 else 1  # ours ran, not Chainer's (but at batch 1)
    assert ran == {"conv": want, "deconv": want, "gradw": want}


@pytest.mark.parametrize("case", CONV_CASES + [(2, 3, 4, 5, 1, 3, 3, 4, 2, False)],
                         ids=lambda c: "x".join(map(str, c)))
def test_compiled_columns_are_numpys(case):
    """The compiled column copy (numba) writes what NumPy's strided copies
    write, with padding larger than the kernel, a stride larger than it,
    dilation, a channel slice (not contiguous) and float64."""
    pytest.importorskip("numba")
    n, c, h, w, _, k, s, p, d, cover_all = case
    x = np.random.RandomState(1).randn(n, c + 2, h, w)
    for x in (x[:, 1:c + 1], x[:, :c].astype(np.float32)):
        oh = ws._out_size(h, k, s, p, cover_all, d)
        ow = ws._out_size(w, k, s, p, cover_all, d)
        compiled = ws._columns(np, x, k, k, s, s, p, p, d, d, oh, ow)
        fill, ws._compiled_fill = ws._compiled_fill, False
        try:
            numpys = ws._columns(np, x, k, k, s, s, p, p, d, d, oh, ow)
        finally:
            ws._compiled_fill = fill
        assert k == 1 or fill, "the compiled copy did not run"
        assert compiled.dtype == numpys.dtype and np.array_equal(compiled, numpys)


@pytest.mark.parametrize("case", DECONV_CASES, ids=lambda c: "x".join(map(str, c)))
def test_deconvolution_kernels_bit_identical(case):
    n, ci, h, w, co, k, s, p = case
    rng = np.random.RandomState(1)
    arrays = [rng.randn(n, ci, h, w).astype(np.float32), rng.randn(ci, co, k, k).astype(np.float32),
              rng.randn(co).astype(np.float32)]
    fn = lambda x, W, b: F.deconvolution_2d(x, W, b, stride=s, pad=p)  # noqa: E731
    plain, ours, layout, layout2, ran = _compare(fn, arrays)
    for a, b in zip(plain, ours):
        assert np.array_equal(a, b)
    assert layout == layout2
    assert ran == {"conv": 1, "deconv": 1, "gradw": 1}


def test_float64_and_under_the_bound():
    rng = np.random.RandomState(2)
    arrays = [rng.randn(3, 4, 8, 8), rng.randn(5, 4, 3, 3), rng.randn(5)]
    fn = lambda x, W, b: F.convolution_2d(x, W, b, pad=1)  # noqa: E731
    plain, ours, _, _, ran = _compare(fn, arrays)
    assert all(np.array_equal(a, b) for a, b in zip(plain, ours))
    # a call whose column buffer fits runs Chainer's own kernel
    plain, ours, _, _, ran = _compare(fn, arrays, limit=10 ** 9)
    assert ran == {"conv": 0, "deconv": 0, "gradw": 0}


@pytest.mark.parametrize("case", CONV_CASES[:4] + [(9, 16, 20, 20, 32, 3, 1, 1, 1, False)],
                         ids=lambda c: "x".join(map(str, c)))
def test_chunked_kernels_match_to_rounding(case):
    """exact=False chunks over the batch and the input channels: the same
    products and sums, but OpenBLAS rounds a GEMM of another shape
    differently, so only equal to rounding (README)."""
    n, c, h, w, o, k, s, p, d, cover_all = case
    rng = np.random.RandomState(3)
    arrays = [rng.randn(n, c, h, w).astype(np.float32), rng.randn(o, c, k, k).astype(np.float32),
              rng.randn(o).astype(np.float32)]
    fn = lambda x, W, b: F.convolution_2d(x, W, b, stride=s, pad=p, dilate=d,  # noqa: E731
                                          cover_all=cover_all)
    plain, ours, layout, layout2, ran = _compare(fn, arrays, exact=False)
    for a, b in zip(plain, ours):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(a).max()))
    assert layout == layout2


def _transients(graph):
    return {n.id: (n.forward_transient_bytes, n.backward_transient_bytes)
            for n in graph.nodes if n.op in ("Convolution2DFunction", "Deconvolution2DFunction")}


class TwoConv(chainer.Chain):
    def __init__(self, deconv=False):
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 16, 3, pad=1)
            self.c2 = (L.Deconvolution2D(16, 8, 4, stride=2, pad=1) if deconv
                       else L.Convolution2D(16, 8, 3, pad=1, stride=2))

    def forward(self, x):
        return F.sum(self.c2(F.relu(self.c1(x))))


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("deconv", [False, True])
def test_measured_transients_are_the_formulas(exact, deconv):
    """The recorded transient of a bounded call is its kernel's, as
    core/workspace.py predicts it: within 1 KiB, or over by at most the
    transposed copy of an input or output gradient that the formula counts
    and NumPy made as a view (its layout, which the graph does not record,
    allowed it)."""
    model = TwoConv(deconv)
    x = np.random.RandomState(0).rand(6, 3, 24, 24).astype(np.float32)
    model(x)
    g = capture(model, x, backward=True)
    limit = 20000  # chunks every call
    bg = bounded_graph(g, limit, exact)
    predicted = _transients(bg)
    with ws.bounded(limit, exact):
        measured = _transients(capture(model, x, backward=True))
    assert predicted.keys() == measured.keys() and len(predicted) == 2
    for v in predicted:
        node = g.nodes[v]
        slack = max(g.arrays[node.outputs[0]].nbytes, g.arrays[node.inputs[0]].nbytes)
        for p, m in zip(predicted[v], measured[v]):
            assert m - 1024 <= p <= m + slack + 1024, (v, predicted, measured)
    if exact:  # one copy of the column buffer instead of Chainer's two
        plain = _transients(g)
        first = min(plain)
        assert measured[first][0] < 0.6 * plain[first][0]


class VGGBlock(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 16, 3, pad=1)
            self.c2 = L.Convolution2D(16, 16, 3, pad=1)
            self.c3 = L.Convolution2D(16, 32, 3, pad=1)
            self.c4 = L.Convolution2D(32, 32, 3, pad=1)
            self.fc = L.Linear(None, 10)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.c2(F.relu(self.c1(x)))), 2)
        h = F.max_pooling_2d(F.relu(self.c4(F.relu(self.c3(h)))), 2)
        return self.fc(h)


def _train(workspace, steps=3, exact=True, plain=False):
    np.random.seed(0)
    model = L.Classifier(VGGBlock())
    rng = np.random.RandomState(0)
    x = rng.rand(8, 3, 32, 32).astype(np.float32)
    t = rng.randint(0, 10, 8).astype(np.int32)
    model(x, t)  # lazy initialisation, as a training loop's first call
    if not plain:
        cr.apply(model, budget="least", workspace=workspace, verbose=False,
                 tuning=cr.Tuning(workspace_exact=exact, check_iterations=10))
    opt = chainer.optimizers.SGD(0.1)
    opt.setup(model)
    stats = []
    for _ in range(steps + 1):  # the first call is recorded
        opt.update(model, x, t)
        if not plain:
            stats.append(cr.runner_of(model).last_stats)
    return model, stats


def _params(model):
    return {k: p.array for k, p in model.namedparams()}


def test_vgg_block_bit_identical_with_less_memory():
    plain, _ = _train(None, plain=True)
    without, st0 = _train(None)
    with_ws, st1 = _train("auto")
    for k, a in _params(plain).items():
        assert np.array_equal(a, _params(with_ws)[k]), k
        assert np.array_equal(a, _params(without)[k]), k
    least0 = max(s.measured_peak_bytes for s in st0[1:])
    for s in st1[1:]:
        assert s.path == "planned"
        assert s.measured_peak_bytes <= s.budget_bytes
        assert abs(s.measured_peak_bytes - s.predicted_peak_bytes) <= 0.01 * s.predicted_peak_bytes
    least1 = max(s.measured_peak_bytes for s in st1[1:])
    # one copy of each column buffer instead of two: a little over half
    assert least1 < 0.7 * least0, (least1, least0)
    graph = cr.runner_of(with_ws).signatures()[0].structures[0].graph
    assert graph.step.workspace_bytes is not None


@pytest.mark.slow  # 6 s
def test_vgg_block_chunked_under_half():
    """exact=False: the chunks reach under half of the least peak without
    a workspace (equal to rounding, not bit for bit)."""
    plain, _ = _train(None, plain=True)
    _, st0 = _train(None)
    chunked, st1 = _train("auto", exact=False)
    for k, a in _params(plain).items():
        np.testing.assert_allclose(a, _params(chunked)[k], rtol=1e-3, atol=1e-5)
    least0 = max(s.measured_peak_bytes for s in st0[1:])
    least1 = max(s.measured_peak_bytes for s in st1[1:])
    for s in st1[1:]:
        assert s.measured_peak_bytes <= s.budget_bytes
    assert least1 < 0.5 * least0, (least1, least0)


def _brute_force(g, budget, exact):
    """Every bound at which some call's chunk changes, planned."""
    limits = {None}
    for c in conv_calls(g):
        for k in (c.forward, c.input_grad, c.weight_grad):
            if k is None:
                continue
            limits.add(k.column_bytes - 1)
            for n in range(1, k.units + 1):
                limits.add(k.transient_bytes(n))
    out = []
    for limit in limits:
        bg = bounded_graph(g, limit, exact)
        try:
            plan = plan_for_budget(bg, budget)
        except InfeasibleBudgetError:
            continue
        out.append((limit, plan))
    return out


@pytest.mark.parametrize("exact", [True, False])
def test_auto_against_brute_force(exact):
    model = TwoConv()
    x = np.random.RandomState(0).rand(6, 3, 24, 24).astype(np.float32)
    model(x)
    g = capture(model, x, backward=True, cost_model="flops")
    tried = _brute_force(g, "least", exact)
    best = min(p.predicted_peak_bytes for _, p in tried)
    chosen_plan = plan_with_workspace(g, "least", "auto", exact=exact)
    plan, bg = chosen_plan.plan, chosen_plan.graph
    assert plan.predicted_peak_bytes == best
    # the largest bound (fewest chunks) that reaches it, up to the chunks
    # it gives: no bound larger than the chosen one reaches the least peak
    # with fewer chunks
    chosen = chosen_plan.workspace_bytes
    assert chosen == bg.step.workspace_bytes
    chunks = [n.attrs.get("workspace_chunks") for n in bg.nodes]
    for limit, p in tried:
        if p.predicted_peak_bytes == best and (chosen is not None and
                                               (limit is None or limit > chosen)):
            other = bounded_graph(g, limit, exact)
            assert [n.attrs.get("workspace_chunks") for n in other.nodes] == chunks or \
                p.overhead > plan.overhead
    # at a budget between the least and plain: the least recomputation
    budget = int(best * 1.3)
    tried = _brute_force(g, budget, exact)
    plan = plan_with_workspace(g, budget, "auto", exact=exact).plan
    assert plan.overhead == min(p.overhead for _, p in tried)
    assert plan.predicted_peak_bytes <= budget


def test_parse_workspace_and_errors():
    assert parse_workspace("1M") == 2 ** 20
    assert parse_workspace(None) is None and parse_workspace("auto") == "auto"
    with pytest.raises(ValueError, match="auto"):
        parse_workspace("lots")
    with pytest.raises(ValueError, match="'64.5M' for 64.5 MiB"):  # (its unit left out)
        parse_workspace("64.5")
    with pytest.raises(RecomputeError, match="auto"):
        cr.Recompute(lambda x: x, "1G", workspace="lots")
    g = capture(TwoConv(), np.zeros((2, 3, 8, 8), np.float32), backward=True)
    assert candidate_limits(g)[0] is None


def test_auto_workspace_plan_is_the_one_the_runner_runs(monkeypatch):
    """With ``workspace='auto'`` the runner runs the plan chosen with the
    bound: one search per candidate bound, not one more for the runner."""
    from chainer_recompute.core import budget as core_budget
    from chainer_recompute.core import workspace as core_ws
    calls = []
    real = core_budget.plan_for_budget

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(core_budget, "plan_for_budget", counted)
    bounds = []
    real_bounded = core_ws.bounded_graph

    def counted_bound(*args, **kwargs):
        bounds.append(args[1] if len(args) > 1 else kwargs.get("limit_bytes"))
        return real_bounded(*args, **kwargs)
    monkeypatch.setattr(core_ws, "bounded_graph", counted_bound)
    _train("auto", steps=2)
    assert calls and len(calls) == len(bounds), (len(calls), len(bounds))
