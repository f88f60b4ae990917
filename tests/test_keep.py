"""``keep=``: nodes every plan keeps (:attr:`Graph.must_keep`).

The solvers count a kept node in ∂(L) of every lower set that holds it, so
that it is a checkpoint of its block: checked against brute force over
every chain on small random DAGs (the DPs are optimal among plans that keep
those nodes), on every solver, with the least figure's monotonicity.
"""
from __future__ import annotations

import random
from typing import FrozenSet, List, Optional, Tuple

import numpy as np
import pytest

from chainer_recompute.core.graph import Graph
from chainer_recompute.core.keep import with_must_keep
from chainer_recompute.core.memory_model import MemoryModel
from chainer_recompute.core.search import least_feasible_budget
from chainer_recompute.core.solvers import (REGISTRY, solve_approx, solve_exact, solve_hier,
                                            solve_none)
from chainer_recompute.core.schedule import build_schedule, entry_cost, strategy_cost

from test_bruteforce import ENGINES, KINDS, brute_force_chains, random_dag, random_model


def brute_force_keep(g: Graph, keep: FrozenSet[int], model: Optional[MemoryModel] = None
                     ) -> List[Tuple[int, int, FrozenSet[int]]]:
    """test_bruteforce's enumeration with ``keep`` kept in every block."""
    return brute_force_chains(g, model, keep)


def _random_case(seed: int, with_model: bool):
    rng = random.Random(20_000 + seed)
    sizes, edges, costs = random_dag(rng, KINDS[seed % len(KINDS)])
    g = Graph.from_edges(sizes, edges, costs=costs)
    model = random_model(rng, g) if with_model else None
    keep = frozenset(v for v in range(g.n) if rng.random() < 0.35) or frozenset({0})
    return rng, g, model, keep


@pytest.mark.parametrize("seed", range(24))
def test_dps_keep_what_they_must_and_are_optimal_among_such_plans(seed: int) -> None:
    _check_against_brute_force(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(24, 300))
def test_dps_keep_what_they_must_many_graphs(seed: int) -> None:
    _check_against_brute_force(seed)


def _check_against_brute_force(seed: int) -> None:
    rng, g0, model, keep = _random_case(seed, with_model=seed % 2 == 1)
    g = with_must_keep(g0, keep)
    total_t = int(sum(g.node_cost))
    chains = brute_force_keep(g, keep, model)
    least = min(p for p, _, _ in chains)
    # every chain keeps K by construction; the plans without K are no worse
    plain = brute_force_keep(g0, frozenset(), model)
    least0 = min(p for p, _, _ in plain)
    assert least >= least0
    # among the canonical plans of the wiring alone, those that happen to
    # keep K cost what they cost with K: the optimum with K is no worse
    keeping = [(p, t) for p, t, kept in plain if keep <= kept]
    for engine in ENGINES:
        assert least_feasible_budget(g, "exact", model=model, engine=engine) == least
        assert least_feasible_budget(g, "approx", model=model, engine=engine) >= least
        assert not solve_exact(g, least - 1, model=model, engine=engine).feasible
        assert not solve_approx(g, least - 1, model=model, engine=engine).feasible
    worst = max(p for p, _, _ in chains)
    for b in sorted({least, worst, rng.choice(chains)[0], (least + worst) // 2, 10 ** 15}):
        ok = [t for p, t, _ in chains if p <= b]
        for strategy, best in (("tc", max(ok)), ("mc", min(ok))):
            runs = [dict(engine="numpy", method="dense"), dict(engine="numpy", method="sparse")] \
                + [dict(engine=e) for e in ENGINES[1:]]
            for kw in runs:
                p = solve_exact(g, b, strategy=strategy, model=model, **kw)
                assert p.feasible and p.predicted_peak_bytes <= b, kw
                assert keep <= p.kept, (strategy, kw)
                assert p.overhead == pytest.approx(total_t - best), (strategy, kw)
                a = solve_approx(g, b, strategy=strategy, model=model, **kw)
                if a.feasible:
                    assert keep <= a.kept
                    assert a.predicted_peak_bytes <= b
                    if strategy == "tc":
                        assert a.overhead >= p.overhead - 1e-9
                if strategy == "tc":
                    fits = [t for pk, t in keeping if pk <= b]
                    if fits:
                        assert p.overhead <= total_t - max(fits) + 1e-9
            # the plan's figures are its strategy's under K (independent paths)
            c = strategy_cost(g, p.lower_sets, model)
            assert c.peak_bytes == p.predicted_peak_bytes
            assert c.overhead == pytest.approx(p.overhead)


def test_keep_changes_nothing_when_the_plan_keeps_those_nodes_already() -> None:
    g = Graph.from_edges([4] * 8, [(i, i + 1) for i in range(7)], costs=[1] * 8)
    least = least_feasible_budget(g, "exact")
    plan = solve_exact(g, least, strategy="mc")
    kept = frozenset(v for v in plan.kept if g.succs[v])
    gk = with_must_keep(g, kept)
    assert least_feasible_budget(gk, "exact") == least
    assert least_feasible_budget(gk, "approx") == least_feasible_budget(g, "approx")
    # more kept nodes never lower it; all of them raise it
    figures = [least_feasible_budget(with_must_keep(g, range(k)), "exact") for k in range(9)]
    assert figures == sorted(figures) and figures[0] == least and figures[-1] > least


def _stack(n_layers: int = 40, width: int = 3) -> Graph:
    """A deep stack of identical residual layers (the hierarchical DP's case)."""
    edges, sizes = [], []
    prev = None
    for i in range(n_layers):
        base = len(sizes)
        sizes += [8] * width
        for k in range(1, width):
            edges.append((base + k - 1, base + k))
        if prev is not None:
            edges.append((prev, base))
            edges.append((prev, base + width - 1))
        prev = base + width - 1
    return Graph.from_edges(sizes, edges)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_solver_keeps_what_it_must(name: str) -> None:
    g0 = _stack()
    keep = frozenset(range(30, 45)) | {len(g0.nodes) - 1}  # a run of layers, and the sink
    g = with_must_keep(g0, keep)
    least0 = least_feasible_budget(g0, "approx")
    least = least_feasible_budget(g, "approx")
    assert least > least0  # the least plan of the wiring drops some of them
    budget = (least + 2 * least) // 2
    p = REGISTRY[name](g, budget)
    p0 = REGISTRY[name](g0, budget)
    assert keep <= p.kept, name
    if name != "none":
        assert not keep <= p0.kept  # (the test would show nothing)
    # its figures count them: the strategy's cost under K
    c = strategy_cost(g, p.lower_sets)
    assert p.predicted_peak_bytes == c.peak_bytes
    assert p.overhead == pytest.approx(c.overhead if p.recompute else 0.0)
    if name not in ("chen", "none"):  # (they ignore the budget)
        assert p.feasible and p.predicted_peak_bytes <= budget
    # the liveness schedule keeps them too
    sched = build_schedule(g, p.lower_sets, recompute=p.recompute)
    assert not any(op == "recompute" and v in keep for op, v in sched.ops)


def test_hier_counts_kept_nodes_in_its_own_tables() -> None:
    from chainer_recompute.core.solvers.hier_dp import hier_problem
    g0 = _stack(60)
    keep = frozenset(range(60, 90))
    g = with_must_keep(g0, keep)
    prob0, prob = hier_problem(g0), hier_problem(g)
    assert prob.ok and prob0.ok
    # the least budget of its family rises with what it must keep, and the
    # plan there keeps it, its predicted peak under the budget (exact: the
    # plan is evaluated on the whole graph with K)
    assert prob.least_budget() >= prob0.least_budget()
    b = prob.least_budget()
    p = solve_hier(g, b)
    assert p.feasible and keep <= p.kept and p.info["hierarchical"]
    assert p.predicted_peak_bytes <= b
    # the hierarchical tables' retained bytes are the plan's under K
    entry = np.empty(g.n, dtype=np.int64)
    for i, blk in enumerate(p.blocks):
        entry[list(blk)] = i
    assert entry_cost(g, entry).peak_bytes == p.predicted_peak_bytes


def test_vanilla_and_the_graph_file_keep_the_marks(tmp_path) -> None:
    from chainer_recompute.core.io import load_graph, save_graph
    g = with_must_keep(Graph.from_edges([4, 4, 4], [(0, 1), (1, 2)]), {1})
    assert solve_none(g, None).kept == frozenset({0, 1, 2})
    save_graph(g, str(tmp_path / "g.json"))
    assert load_graph(str(tmp_path / "g.json")).must_keep == frozenset({1})
    assert with_must_keep(g, {1}) is g
    with pytest.raises(Exception, match="nodes"):
        with_must_keep(g, {7})


# ------------------------------------------------------------ apply(keep=)
import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402

import chainer_recompute as cr  # noqa: E402
from chainer_recompute.core.errors import KeepError  # noqa: E402
from chainer_recompute.runtime.executor import IterationHook  # noqa: E402


class Block(chainer.Chain):
    def __init__(self, n: int) -> None:
        super().__init__()
        with self.init_scope():
            self.fc1 = L.Linear(n, n)
            self.fc2 = L.Linear(n, n)

    def forward(self, x):
        return F.relu(x + self.fc2(F.tanh(self.fc1(x))))


class Deep(chainer.Chain):
    def __init__(self, n: int = 16, depth: int = 6) -> None:
        super().__init__()
        with self.init_scope():
            for i in range(depth):
                setattr(self, f"b{i}", Block(n))
            self.out = L.Linear(n, 4)
        self.depth = depth

    def forward(self, x):
        for i in range(self.depth):
            x = getattr(self, f"b{i}")(x)
        return self.out(x)


def _train(keep, applied: bool, steps: int = 4):
    """Train ``steps`` optimizer steps; the parameters after each, and the
    links of the functions the executor released and regenerated."""
    np.random.seed(0)
    model = L.Classifier(Deep())
    if applied:
        cr.apply(model, budget="least", tuning=cr.Tuning(cost="flops"), verbose=False, keep=keep)
    opt = chainer.optimizers.MomentumSGD(0.01)
    opt.setup(model)
    rng = np.random.RandomState(1)
    # released in the forward (to be regenerated; after its backward readers
    # an array is freed as in plain Chainer), regenerated in the backward
    seen = {"released": set(), "regenerated": set()}
    release, forward, backward = (IterationHook._release, IterationHook._run_forward,
                                  IterationHook.before_backward)

    def spy_release(self, u):
        if self.program is not None and u < self.program.n and \
                not getattr(self, "_spy_backward", False):
            seen["released"].add(self.program.graph.nodes[u].link)
        return release(self, u)

    def spy_forward(self, f, u, in_data):
        seen["regenerated"].add(self.program.graph.nodes[u].link)
        return forward(self, f, u, in_data)

    def spy_backward(self, *args):
        self._spy_backward = True
        return backward(self, *args)

    params = []
    IterationHook._release, IterationHook._run_forward = spy_release, spy_forward
    IterationHook.before_backward = spy_backward
    try:
        for _ in range(steps):
            x = rng.randn(8, 16).astype(np.float32)
            t = rng.randint(0, 4, 8).astype(np.int32)
            opt.update(model, x, t)
            params.append({p: v.array.copy() for p, v in model.namedparams()})
    finally:
        IterationHook._release, IterationHook._run_forward = release, forward
        IterationHook.before_backward = backward
    return model, params, seen


def test_training_under_keep_is_identical_and_never_drops_the_kept_link() -> None:
    _, plain, _ = _train(None, applied=False)
    _, free, seen_free = _train(None, applied=True)
    model, kept, seen = _train(["/predictor/b2"], applied=True)
    for a, b, c in zip(plain, free, kept):
        for name in a:
            assert np.array_equal(a[name], c[name]), name  # bit-identical
            assert np.array_equal(a[name], b[name]), name
    under = {l for l in seen_free["released"] if l.startswith("/predictor/b2")}
    assert under  # without keep=, the least plan drops some of b2's functions
    assert seen["released"] and seen["regenerated"]  # it still recomputes elsewhere
    assert not any(l.startswith("/predictor/b2") for l in seen["released"] | seen["regenerated"])
    runner = cr.runner_of(model)
    plan = next(iter(runner.plans.values()))
    s = runner.signatures()[0].structures[0]
    marked = {v for v, n in enumerate(s.graph.nodes) if n.link.startswith("/predictor/b2")}
    assert marked and marked == s.graph.must_keep and marked <= plan.kept
    assert not marked & s.program.dropped
    # the least figure accounts for it: at least the one without keep=
    free_plan = next(iter(cr.runner_of(_train(None, applied=True, steps=2)[0]).plans.values()))
    assert plan.budget_bytes >= free_plan.budget_bytes


def test_keep_by_function() -> None:
    model, _, seen = _train(lambda node: node.op == "Tanh", applied=True, steps=3)
    s = cr.runner_of(model).signatures()[0].structures[0]
    tanh = {v for v, n in enumerate(s.graph.nodes) if n.op == "Tanh"}
    assert tanh and tanh == s.graph.must_keep and not tanh & s.program.dropped


def test_a_path_that_names_no_link_is_refused_with_the_closest_names() -> None:
    model = L.Classifier(Deep())
    cls = type(model)
    with pytest.raises(KeepError, match=r"'/predictor/b9'.*closest: '/predictor/b[0-9]'"):
        cr.apply(model, budget="least", keep=["/predictor/b2", "/predictor/b9"])
    assert type(model) is cls and cr.runner_of(model) is None  # nothing half-applied
    with pytest.raises(KeepError, match="accepted"):
        cr.apply(model, budget="least", keep=3)
    assert cr.runner_of(model) is None
    # a plain callable: refused at its first plan, against the recorded links
    net = Deep()

    def loss_fn(x, t):
        return F.softmax_cross_entropy(net(x), t)

    runner = cr.Recompute(loss_fn, "least", keep="/b2/fc3", verbose=False, capture_batch=None)
    x = np.zeros((4, 16), np.float32)
    t = np.zeros(4, np.int32)
    with chainer.using_config("train", True):
        loss = runner(x, t)
        loss.backward()
        # (a Link called by a plain callable is named by its class: /Deep/...)
        with pytest.raises(KeepError, match=r"'/b2/fc3'.*closest: '/Deep/b2/fc[12]'"):
            runner(x, t)


def test_cli_keep(tmp_path, capsys) -> None:
    import json
    from chainer_recompute.cli import main
    base = ["--model", "mlp", "--small", "--batch-size", "64", "-q"]
    assert main(base + ["--json", str(tmp_path / "a.json")]) == 0
    assert main(base + ["--keep", "/predictor/0", "--keep", "/predictor/1",
                        "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "kept by every plan (--keep): /predictor/0, /predictor/1" in out
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["budget"]["keep"]["paths"] == ["/predictor/0", "/predictor/1"]
    assert "--keep /predictor/0 --keep /predictor/1" in b["command"]
    assert b["least"]["budget_bytes"] >= a["least"]["budget_bytes"]
    assert main(base + ["--keep", "/predictor/2"]) == 2
    err = capsys.readouterr().err
    assert "--keep names '/predictor/2', which is no link" in err and "'/predictor/1'" in err
