"""The hierarchical planner (core/segments.py, core/solvers/hier_dp.py):
segment detection, plans against the flat exact DP on small graphs built
from repeated random segments, the linear-time chain cost and the block
chain, and an applied 12-layer encoder against plain Chainer."""
import numpy as np
import pytest

from chainer_recompute.core.graph import Graph
from chainer_recompute.core.memory_model import MemoryModel
from chainer_recompute.core.plan import BlockChain
from chainer_recompute.core.planner import solve
from chainer_recompute.core.schedule import entry_cost, strategy_cost
from chainer_recompute.core.search import least_feasible_budget, vanilla_bytes
from chainer_recompute.core.segments import detect_segments
from chainer_recompute.core.solvers import REGISTRY, resolve_solver
from chainer_recompute.core.solvers._dp import numba_available
from chainer_recompute.core.solvers.hier_dp import HierProblem, solve_hier

NEEDS_NUMBA = pytest.mark.skipif(not numba_available(), reason="needs numba (the 'fast' extra)")


def repeated_graph(seed, n_seg=8, seg_len=None, costs=False):
    """A prefix node, ``n_seg`` copies of one random segment (random DAG
    inside, reading the previous segment's last node, sometimes a residual
    edge over it), a loss node."""
    r = np.random.RandomState(seed)
    s = seg_len or int(r.randint(3, 6))
    inner = [(u, v) for v in range(1, s) for u in range(v) if u == v - 1 or r.rand() < 0.3]
    sizes_seg = r.randint(1, 9, s).tolist()
    residual = r.rand() < 0.5
    sizes, edges = [int(r.randint(1, 9))], []
    prev = 0
    for _ in range(n_seg):
        base = len(sizes)
        sizes += sizes_seg
        edges.append((prev, base))
        edges += [(base + u, base + v) for u, v in inner]
        if residual:
            edges.append((prev, base + s - 1))
        prev = base + s - 1
    sizes.append(1)
    edges.append((prev, len(sizes) - 1))
    c = (r.rand(len(sizes)) + 0.5).tolist() if costs else None
    return Graph.from_edges(sizes, edges, costs=c)


@pytest.mark.parametrize("seed", range(12))
def test_hier_against_flat_exact_on_repeated_random_segments(seed):
    g = repeated_graph(seed, costs=seed % 2 == 1)
    prob = HierProblem(g)
    assert prob.ok and prob.segments.count >= 4
    exact_least = least_feasible_budget(g, "exact")
    hier_least = least_feasible_budget(g, "hier")
    # never below the exact DP's (its family is every chain), and close
    assert exact_least <= hier_least <= 1.25 * exact_least
    van = vanilla_bytes(g)
    for budget in (hier_least, (hier_least + van) // 2, van):
        for strategy in ("tc", "mc"):
            plan = solve_hier(g, budget, strategy=strategy)
            assert plan.feasible and plan.solver == "hier"
            # the plan's figures are the whole graph's, exactly
            cost = strategy_cost(g, plan.lower_sets)
            assert plan.predicted_peak_bytes == cost.peak_bytes <= budget
            assert plan.overhead == pytest.approx(cost.overhead)
            if strategy == "tc":
                ex = solve(g, budget, solver="exact")
                assert ex.overhead <= plan.overhead + 1e-9
                total = float(g.node_cost.sum())
                assert plan.overhead - ex.overhead <= 0.15 * total
    assert not solve_hier(g, hier_least - 1).feasible


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("engine", [pytest.param("numba", marks=NEEDS_NUMBA), "numpy"])
def test_tc_tables_bounded_by_earlier_chains_give_the_same_plans(seed, engine):
    # a problem that has solved smaller budgets skips the tc states that
    # cannot reach those chains' time; each plan is a fresh problem's
    from chainer_recompute.core.kernels.hier import _dp_numpy, kernel
    # the engine asked for is the one that fills the tables (not NumPy twice)
    assert (kernel(engine) is _dp_numpy) == (engine == "numpy")
    g = repeated_graph(seed, n_seg=12, costs=True)
    shared = HierProblem(g)
    lo, van = least_feasible_budget(g, "hier"), vanilla_bytes(g)
    for b in np.linspace(lo, van, 8).astype(int).tolist():
        if b % 2:
            shared.solve(b, "mc", engine)  # an mc chain bounds the tc table too
        assert shared.solve(b, "tc", engine) == HierProblem(g).solve(b, "tc", engine)
    assert len(shared.reached) >= 8


@pytest.mark.slow  # 45 s
def test_least_m_compiled_and_vectorised_agree():
    from chainer_recompute.core.kernels import hier as kern
    numba = pytest.importorskip("numba")
    for seed in range(8):
        p = HierProblem(repeated_graph(seed, n_seg=12, costs=True))
        P = len(p.cuts) - 1
        for bc in np.linspace(0, p.vanilla_bytes(), 12).astype(int).tolist():
            out = []
            for fn in (kern._least_numpy, numba.njit(kern._least_loops)):
                least, back = np.empty(P + 1, np.int64), np.empty((P + 1, 2), np.int64)
                fn(P, p.step, p.dm, *p._flat_options(), bc, least, back)
                out.append((least.tolist(), back[least >= 0].tolist()))
            assert out[0] == out[1]


def test_hier_matches_flat_on_a_chain_and_layers():
    # a chain and transformer-like layers under the paper's costs: the
    # same least budget and overhead as the flat approximate DP
    chain = Graph.from_edges([4] * 200, [(i, i + 1) for i in range(199)])
    sizes, edges = [4], []
    x = 0
    for _ in range(24):
        b = len(sizes)
        sizes += [4, 4, 4, 4, 8, 8, 4, 4, 4, 16, 4, 4]
        ln, q, k, v, s, sm, c, p, r, f1, f2, out = range(b, b + 12)
        edges += [(x, ln), (ln, q), (ln, k), (ln, v), (q, s), (k, s), (s, sm), (sm, c), (v, c),
                  (c, p), (x, r), (p, r), (r, f1), (f1, f2), (r, out), (f2, out)]
        x = out
    sizes.append(1)
    edges.append((x, len(sizes) - 1))
    layers = Graph.from_edges(sizes, edges)
    for g in (chain, layers):
        lo_h, lo_a = least_feasible_budget(g, "hier"), least_feasible_budget(g, "approx")
        assert lo_h <= 1.02 * lo_a
        mid = (lo_a + vanilla_bytes(g)) // 2
        assert solve_hier(g, mid).overhead <= 1.05 * solve(g, mid, solver="approx").overhead


def test_no_repeats_falls_back_to_approx():
    r = np.random.RandomState(0)
    n = 30
    edges = [(i, i + 1) for i in range(n - 1)] + [(i, j) for i in range(n) for j in range(i + 2, n)
                                                   if r.rand() < 0.1]
    g = Graph.from_edges(r.randint(1, 50, n).tolist(), edges)
    b = (least_feasible_budget(g, "approx") + vanilla_bytes(g)) // 2
    plan = solve_hier(g, b)
    ref = solve(g, b, solver="approx")
    assert plan.info["hierarchical"] is False
    assert plan.lower_sets == ref.lower_sets
    assert least_feasible_budget(g, "hier") == least_feasible_budget(g, "approx")


def test_auto_picks_by_size():
    small = repeated_graph(0, n_seg=8)
    big = repeated_graph(0, n_seg=400)
    assert big.n >= 1000
    assert resolve_solver("auto", small) == "approx"
    assert resolve_solver("auto", big) == "hier"
    assert solve(big, None).solver == "hier" and solve(small, None).solver == "approx"
    assert "auto" in REGISTRY and "hier" in REGISTRY


def test_segments_of_a_chain_and_of_layers():
    g = Graph.from_edges([4] * 50, [(i, i + 1) for i in range(49)])
    seg = detect_segments(g)
    assert seg.period == 1 and seg.count >= 45
    g = repeated_graph(3, n_seg=10, seg_len=5)
    seg = detect_segments(g)
    assert seg.period == 5 and seg.count >= 9


@pytest.mark.parametrize("seed", range(6))
def test_entry_cost_is_strategy_cost(seed):
    r = np.random.RandomState(seed)
    n = 25
    edges = [(u, v) for v in range(1, n) for u in range(v) if u == v - 1 or r.rand() < 0.15]
    g = Graph.from_edges(r.randint(1, 20, n).tolist(), edges,
                         costs=(r.rand(n) + 0.1).tolist())
    m = MemoryModel(block_bytes=r.randint(0, 9, n), keep_bytes=r.randint(0, 9, n),
                    above_bytes=r.randint(0, 9, n), beside_bytes=r.randint(0, 9, n),
                    transient_bytes=r.randint(0, 9, n) * (r.rand(n) < 0.3), constant_bytes=7)
    cuts = sorted(set(r.randint(1, n, 6).tolist())) + [n]
    entry = np.searchsorted(np.array(cuts), np.arange(n), side="right")
    masks = [(1 << c) - 1 for c in cuts]
    a, b = entry_cost(g, entry, m), strategy_cost(g, masks, m)
    assert a.peak_bytes == b.peak_bytes and a.block_peaks_bytes == b.block_peaks_bytes
    assert a.checkpoints == b.checkpoints and a.overhead == b.overhead


def test_block_chain_behaves_as_a_tuple_of_frozensets():
    blocks = [frozenset({0, 2}), frozenset({1}), frozenset({3, 4})]
    c = BlockChain(blocks)
    ref = (frozenset({0, 2}), frozenset({0, 1, 2}), frozenset({0, 1, 2, 3, 4}))
    assert c == ref and tuple(c) == ref and len(c) == 3
    assert c[2] - c[0] == frozenset({1, 3, 4}) and c[1] - c[1] == frozenset()
    assert set(c[-1]) == set(range(5)) and 3 not in c[1] and 1 in c[1]
    assert hash(c[1]) == hash(ref[1]) and c[0] <= c[1]
    assert frozenset().union(*c) == ref[-1]
    import pickle
    assert pickle.loads(pickle.dumps(c)) == ref


# ------------------------------------------------------------- captured
def _capture_encoder(n_layers):
    import chainer_recompute as cr  # noqa: F401
    from chainer_recompute.models.transformer import make_encoder
    from chainer_recompute.runtime.capture import capture
    model, (xs, ts) = make_encoder(n_layers, d=16, heads=2, ff=32, n_vocab=20, batch=2,
                                   length=8)
    return capture(model, xs, ts)


def test_segments_of_a_captured_transformer():
    from chainer_recompute.core.memory_model import measured_model
    g = _capture_encoder(6)
    seg = detect_segments(g, measured_model(g))
    assert seg is not None and seg.count == 6
    lo, hi = seg.bounds(0)
    ops = [g.nodes[v].op for v in range(lo, hi)]
    assert ops.count("LinearFunction") == 6 and ops.count("LayerNormalization") == 2
    assert ops.count("Dropout") == 4 and ops.count("Softmax") == 1
    assert [g.nodes[v].op for v in range(*seg.bounds(5))] == ops


def test_segments_of_an_unrolled_lstm():
    import chainer_recompute as cr  # noqa: F401
    from chainer_recompute.core.memory_model import measured_model
    from chainer_recompute.models.small import LSTMLanguageModel
    from chainer_recompute.runtime.capture import capture
    np.random.seed(0)
    model = LSTMLanguageModel(n_vocab=30, n_units=8)
    xs = np.random.RandomState(1).randint(0, 30, (2, 20)).astype(np.int32)
    g = capture(model, xs, np.roll(xs, -1, axis=1))
    seg = detect_segments(g, measured_model(g))
    assert seg is not None and seg.count >= 18  # the steps after the first
    ops = [g.nodes[v].op for v in range(*seg.bounds(0))]
    assert ops.count("LSTM") == 2 and ops.count("SoftmaxCrossEntropy") == 1
    assert seg.period == len(ops)


def test_applied_12_layer_encoder_is_plain_chainer_bit_for_bit():
    import chainer
    import chainer_recompute as cr
    from chainer_recompute.models.transformer import make_encoder

    def run(applied):
        model, (xs, ts) = make_encoder(12, d=16, heads=2, ff=32, n_vocab=20, batch=2, length=8)
        opt = chainer.optimizers.Adam()
        opt.setup(model)
        runner = None
        if applied:
            cr.apply(model, "least", solver="hier", verbose=False)
            runner = cr.runner_of(model)
        out = []
        for step in range(3):
            np.random.seed(100 + step)  # dropout masks
            model.cleargrads()
            loss = model(xs, ts)
            loss.backward()
            opt.update()  # (the runner's check measures the step to here)
            grads = [p.grad.copy() for _, p in sorted(model.namedparams())]
            out.append((loss.array.copy(), grads,
                        [p.array.copy() for _, p in sorted(model.namedparams())]))
        return out, runner

    plain, _ = run(False)
    applied, runner = run(True)
    for (la, ga, pa), (lb, gb, pb) in zip(plain, applied):
        assert la.tobytes() == lb.tobytes()
        assert all(a.tobytes() == b.tobytes() for a, b in zip(ga, gb))
        assert all(a.tobytes() == b.tobytes() for a, b in zip(pa, pb))
    plans = list(runner.plans.values())
    assert plans and all(p.solver == "hier" and p.info["hierarchical"] for p in plans)
    stats = runner.last_stats
    assert stats.path == "planned" and stats.n_dropped > 0 and stats.recomputed_nodes > 0
    if stats.measured_peak_bytes is not None:
        assert stats.measured_peak_bytes <= stats.budget_bytes
