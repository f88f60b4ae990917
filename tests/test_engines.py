"""Each algorithm's two engines (see :mod:`chainer_recompute.core.kernels`):
the compiled one against the reference one when numba is installed, and,
with numba made missing (the availability check patched), ``'auto'`` runs
the reference engine and ``'numba'`` raises instead of running it."""
import random

import numpy as np
import pytest

from chainer_recompute.core import kernels
from chainer_recompute.core.errors import EngineUnavailableError
from chainer_recompute.core.graph import Graph
from chainer_recompute.core.kernels import hier as hier_kernel
from chainer_recompute.core.replay import replay
from chainer_recompute.core.solvers import solve_exact
from chainer_recompute.core.solvers.hier_dp import HierProblem, solve_hier

needs_numba = pytest.mark.skipif(not kernels.numba_available(),
                                 reason="needs numba (the 'fast' extra)")


@pytest.fixture
def no_numba(monkeypatch):
    """numba made missing for every engine switch (and the column copy's
    choice made again)."""
    from chainer_recompute.runtime import workspace as ws
    monkeypatch.setattr(kernels, "numba_available", lambda: False)
    monkeypatch.setattr(ws, "_compiled_fill", None)


def _diamond() -> Graph:
    return Graph.from_edges([1, 2, 3, 4], [(0, 1), (0, 2), (1, 3), (2, 3)], costs=[1, 1, 1, 1])


def _repeated(layers: int = 6) -> Graph:
    """A chain of identical two-node layers (the hierarchical DP's case)."""
    n = 2 * layers
    return Graph.from_edges([4, 8] * layers, [(v, v + 1) for v in range(n - 1)],
                            costs=[1, 3] * layers)


def test_pick_engine_names_and_rules():
    assert kernels.pick_engine("numpy", what="x") == "numpy"
    assert kernels.pick_engine("python", what="x", reference="python") == "python"
    assert kernels.pick_engine("auto", what="x", pays=False) == "numpy"
    with pytest.raises(ValueError, match="unknown x engine 'fortran'"):
        kernels.pick_engine("fortran", what="x")
    want = "numba" if kernels.numba_available() else "numpy"
    assert kernels.pick_engine(None, what="x") == want


def test_numba_asked_for_without_numba_raises_everywhere(no_numba):
    g = _diamond()
    assert kernels.pick_engine("auto", what="x") == "numpy"
    with pytest.raises(EngineUnavailableError, match="pip install 'chainer-recompute\\[fast\\]'"):
        kernels.pick_engine("numba", what="x")
    with pytest.raises(EngineUnavailableError, match="flat DP"):
        solve_exact(g, 15, engine="numba")
    with pytest.raises(EngineUnavailableError, match="replay"):
        replay(g, engine="numba")
    with pytest.raises(EngineUnavailableError, match="hierarchical DP"):
        hier_kernel.kernel("numba")
    with pytest.raises(EngineUnavailableError, match="hierarchical DP"):
        hier_kernel.least_kernel("numba")
    assert issubclass(EngineUnavailableError, ImportError)


def test_auto_runs_the_reference_engines_without_numba(no_numba):
    from chainer_recompute.runtime import workspace as ws
    g = _diamond()
    assert solve_exact(g, 15, engine="auto").overhead == 1
    assert replay(g, engine="auto").peak_bytes == replay(g, engine="python").peak_bytes
    assert hier_kernel.kernel("auto") is hier_kernel._dp_numpy
    assert hier_kernel.least_kernel("auto") is hier_kernel._least_numpy
    assert ws._compiled_columns() is None


def test_a_numba_that_does_not_import_counts_as_missing(monkeypatch):
    """numba installed for another NumPy raises ``ImportError`` on import:
    ``auto`` then runs the reference engines, with a warning, not the error."""
    import importlib.util
    import sys
    spec = importlib.util.spec_from_loader("numba", loader=None)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: spec if name == "numba" else real_find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    monkeypatch.setattr(kernels, "_NUMBA", None)
    with pytest.warns(RuntimeWarning, match="numba is installed but does not import"):
        assert kernels.numba_available() is False
    assert kernels.pick_engine("auto", what="x") == "numpy"
    assert replay(_diamond(), engine="auto").peak_bytes == replay(_diamond(), engine="python").peak_bytes


def test_hierarchical_dp_numpy_engine_without_numba(no_numba):
    g = _repeated()
    prob = HierProblem(g)
    least = prob.least_budget()
    for strategy in ("tc", "mc", "feasible"):
        assert prob.solve(least, strategy, "numpy") is not None
        assert prob.solve(least - 1, strategy, "numpy") is None
    assert solve_hier(g, least, engine="numpy").feasible


@needs_numba
def test_flat_dp_engines_agree():
    rng = np.random.RandomState(0)
    for _ in range(5):
        n = 9
        edges = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.rand() < 0.3]
        edges += [(v, v + 1) for v in range(n - 1)]
        g = Graph.from_edges(list(rng.randint(1, 9, n)), sorted(set(edges)),
                             costs=list(rng.randint(1, 5, n)))
        for b in (30, 40, 60):
            for strategy in ("tc", "mc"):
                a = solve_exact(g, b, strategy=strategy, engine="numpy")
                c = solve_exact(g, b, strategy=strategy, engine="numba")
                assert (a.feasible, a.overhead) == (c.feasible, c.overhead)


@needs_numba
def test_replay_engines_agree():
    g = _repeated(8)
    from chainer_recompute.core.search import least_feasible_budget
    plan = solve_exact(g, least_feasible_budget(g, "exact"), strategy="tc")
    assert plan.feasible
    from chainer_recompute.core.execution import ExecutionPlan
    ep = ExecutionPlan(g, plan.lower_sets, frozenset(plan.kept))
    assert ep.dropped
    for p in (None, ep):
        a = replay(g, p, engine="python")
        b = replay(g, p, engine="numba")
        assert a.peak_bytes == b.peak_bytes
        assert list(a.memory_bytes) == list(b.memory_bytes)


@needs_numba
def test_hierarchical_dp_engines_agree():
    g = _repeated(8)
    prob = HierProblem(g)
    least = prob.least_budget()
    for b in (least, least + 8, least + 40):
        for strategy in ("tc", "mc", "feasible"):
            assert prob.solve(b, strategy, "numpy") == HierProblem(g).solve(b, strategy, "numba")


def _tree_chains():
    """Chains for the tree DP: random and equal figures (ties), short and
    long, grids of other sizes, with and without a base."""
    rng = random.Random(3)
    for _ in range(40):
        k = rng.choice([1, 2, 3, 7, 24, 40])
        equal = rng.random() < 0.4
        c = [1.0 if equal else rng.random() * 100 for _ in range(k - 1)]
        w = [55.0 if equal else rng.random() * 500 + 50 for _ in range(k)]
        tau = [1.0 if equal else rng.random() for _ in range(k)]
        yield (c, w, tau, max(w) + sum(c) * rng.random(), rng.choice([8, 33, 128]),
               min(w) if rng.random() < 0.5 else 0.0)


@needs_numba
def test_tree_dp_engines_agree():
    from chainer_recompute.core.solvers.nested_tree import TreeTable
    for c, w, tau, budget, grid, base in _tree_chains():
        a = TreeTable(c, w, tau, budget=budget, grid=grid, base=base, engine="numpy")
        b = TreeTable(c, w, tau, budget=budget, grid=grid, base=base, engine="numba")
        assert np.array_equal(a.time, b.time)
        assert np.array_equal(a._split, b._split) and np.array_equal(a._root, b._root)
        m = a.least()
        assert m == b.least() and (m is None or a.levels(m) == b.levels(m))


def test_tree_dp_numpy_engine_without_numba(no_numba):
    from chainer_recompute.core.solvers.nested_tree import TreeTable
    c, w, tau = [1.0] * 39, [2.0] * 40, [1.0] * 40
    assert TreeTable(c, w, tau, budget=12, grid=12).least() == TreeTable(
        c, w, tau, budget=12, grid=12, engine="numpy").least()
    with pytest.raises(EngineUnavailableError):
        TreeTable(c, w, tau, budget=12, grid=12, engine="numba")


@needs_numba
def test_column_copy_engines_agree():
    from chainer_recompute.runtime import workspace as ws
    x = np.random.RandomState(1).randn(2, 3, 7, 6)
    oh, ow = ws._out_size(7, 3, 2, 1, False, 1), ws._out_size(6, 3, 2, 1, False, 1)
    want = ws._columns(np, x, 3, 3, 2, 2, 1, 1, 1, 1, oh, ow)
    fill, ws._compiled_fill = ws._compiled_fill, False
    try:
        numpys = ws._columns(np, x, 3, 3, 2, 2, 1, 1, 1, 1, oh, ow)
    finally:
        ws._compiled_fill = fill
    assert ws._compiled_columns() is not None
    assert np.array_equal(want, numpys)


def test_a_tiny_graphs_table_stays_small_with_integral_costs():
    """Integral costs (flop counts) of a six-function graph, 61,617 in all,
    are scaled to the small-graph units like measured ones: the NumPy
    engine's dense table was one column per flop (about 7 MB for this
    graph, planned inside a tiny model's first call: more than the model)
    and is now about 100 columns. The plan is the same here."""
    from chainer_recompute.core.solvers._dp.pairs import UNITS_PER_NODE, dp_costs
    from chainer_recompute.runtime.memory import MemoryMeter
    flops = [16384, 1024, 32768, 1024, 10240, 177]
    units = int(dp_costs(np.array(flops, dtype=np.float64)).sum())
    assert units <= (UNITS_PER_NODE + 1) * len(flops), units  # (each rounded)
    assert dp_costs(np.array([10.0, 1.0, 10.0])).tolist() == [10, 1, 10]  # the paper's model
    g = Graph.from_edges([4096, 4096, 4096, 4096, 4096, 4], [(v, v + 1) for v in range(5)],
                         costs=flops)
    # (the overheads the exact costs give: the same plans)
    for budget, overhead in ((24384, 16561.0), (28480, 177.0)):
        with MemoryMeter() as m:
            plan = solve_exact(g, budget, strategy="tc", engine="numpy")
        assert plan.feasible and plan.overhead == overhead, (budget, plan.overhead)
        assert m.result.peak_bytes < 200_000, m.result.peak_bytes  # (was 7,334,347)


@needs_numba
def test_auto_takes_the_compiled_dp_where_numpys_table_would_be_large(monkeypatch):
    """On a 120-node graph with measured (real) costs NumPy's dense DP table
    (K·(T+1) entries of 16 bytes) would take about 4 MB: ``auto``
    runs the compiled DP there even in a process that has not loaded it
    (``NUMPY_TABLE_BYTES``: on a NumPy model the planner's memory is in the
    heap the budget bounds), for the same plan and far less memory."""
    import tracemalloc

    from chainer_recompute.core import lower_sets
    from chainer_recompute.core.solvers import _dp, solve_approx
    rng = random.Random(3)
    n = 120
    edges = [(v, v + 1) for v in range(n - 1)] + [(v, v + 3) for v in range(0, n - 3, 4)]
    g = Graph.from_edges([rng.randint(1, 9) * 1000 for _ in range(n)], edges,
                         costs=[rng.uniform(1, 5) for _ in range(n)])
    budget = int(0.7 * solve_approx(g, None).predicted_peak_bytes)
    _dp._load_kernels()  # (numba imported and the kernels loaded outside the measure)
    monkeypatch.setattr(lower_sets, "_KERNELS", None)  # a process that has not loaded them

    def solve(engine):
        tracemalloc.start()
        try:
            plan = solve_approx(g, budget, engine=engine)
            return plan, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    reference, numpy_peak = solve("numpy")
    plan, peak = solve("auto")
    assert lower_sets._KERNELS is not None  # loaded by auto
    assert (plan.overhead, plan.predicted_peak_bytes) == \
        (reference.overhead, reference.predicted_peak_bytes)
    assert plan.feasible and peak < _dp.NUMPY_TABLE_BYTES < numpy_peak, (peak, numpy_peak)
