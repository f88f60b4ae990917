"""The DPs against brute force on hundreds of small random DAGs.

Brute force works from the definitions (docs/paper.md §2-§3) on frozensets,
independently of the library: every lower set by testing every subset,
every strictly increasing chain ∅ ⊊ L_1 ⊊ ... ⊊ V, each with its paper-
model peak and retained time.
"""
from __future__ import annotations

import itertools
import random
from typing import Dict, FrozenSet, List, Optional, Tuple

import pytest

from chainer_recompute.core.graph import Graph
from chainer_recompute.core.memory_model import MemoryModel
from chainer_recompute.core.planner import solve
from chainer_recompute.core.search import least_feasible_budget
from chainer_recompute.core.solvers import solve_approx, solve_exact
from chainer_recompute.core.solvers._dp import numba_available

#: The DP's kernels under test: NumPy always, the compiled ones when numba
#: is installed (the ``fast`` extra).
ENGINES = ["numpy"] + (["numba"] if numba_available() else [])


def random_dag(rng: random.Random, kind: str) -> Tuple[List[int], List[Tuple[int, int]], List[int]]:
    n = rng.randint(1, 7) if kind in ("random", "wide", "sinks") else rng.randint(2, 9)
    edges = set()
    if kind == "chain":
        edges = {(i, i + 1) for i in range(n - 1)}
    elif kind == "diamond":
        # a chain of diamonds / skip connections
        for i in range(n - 1):
            edges.add((i, i + 1))
            if i + 2 < n and rng.random() < 0.5:
                edges.add((i, i + 2))
    elif kind == "wide":
        # a root fanning out to several branches, maybe joined
        for v in range(1, n):
            edges.add((0, v))
        if n > 2 and rng.random() < 0.5:
            for v in range(1, n - 1):
                edges.add((v, n - 1))
    elif kind == "sinks":
        for v in range(1, n):
            if rng.random() < 0.6:
                edges.add((rng.randrange(v), v))
    else:
        p = rng.choice([0.2, 0.4, 0.7])
        for u in range(n):
            for v in range(u + 1, n):
                if rng.random() < p:
                    edges.add((u, v))
    sizes = [rng.randint(1, 20) for _ in range(n)]
    costs = [rng.randint(1, 10) for _ in range(n)]
    return sizes, sorted(edges), costs


def brute_force(g: Graph, model: Optional[MemoryModel] = None) -> List[Tuple[int, int]]:
    """(peak, retained time) of every canonical strategy, under the paper's
    memory model or under ``model``'s weights (read from the model, the
    formula written out here)."""
    return [(peak, t) for peak, t, _ in brute_force_chains(g, model)]


def weights(g: Graph, model: Optional[MemoryModel] = None) -> Tuple[List[int], ...]:
    """The per-node weights (block, keep, above, beside, transient) and the
    constant that brute force adds up: the paper's model (a block counts
    twice, with its gradients; no transients) or ``model``'s."""
    M = [int(x) for x in g.node_bytes]
    if model is None:
        return [2 * m for m in M], M, M, M, [0] * g.n, 0
    return ([int(x) for x in model.block_bytes], [int(x) for x in model.keep_bytes],
            [int(x) for x in model.above_bytes], [int(x) for x in model.beside_bytes],
            [int(x) for x in model.transient_bytes], model.constant_bytes)


def brute_force_chains(g: Graph, model: Optional[MemoryModel] = None,
                       must_keep: FrozenSet[int] = frozenset()
                       ) -> List[Tuple[int, int, FrozenSet[int]]]:
    """(peak, retained time, kept nodes) of every chain ∅ ⊊ L_1 ⊊ ... ⊊ V
    whose checkpoints are U_i = (∂(L_i) ∪ must_keep) ∩ V_i, from the
    definitions (docs/paper.md §2-§3) on frozensets."""
    n = g.n
    preds = {v: set(g.preds[v]) for v in range(n)}
    succs = {v: set(g.succs[v]) for v in range(n)}
    blockw, keepw, abovew, besidew, trans, const = weights(g, model)
    T = [int(round(x)) for x in g.node_cost]
    V = frozenset(range(n))
    lower = [frozenset(s) for r in range(n + 1) for s in itertools.combinations(range(n), r)
             if all(preds[v] <= set(s) for v in s)]
    info: Dict[FrozenSet[int], Tuple[FrozenSet[int], int]] = {}
    for L in lower:
        bnd = frozenset(v for v in L if succs[v] - L)
        A = {w for v in L for w in succs[v]} - L
        B = {u for w in A for u in preds[w]} - L
        info[L] = (bnd, sum(abovew[v] for v in A) + sum(besidew[v] for v in B))
    out = []

    def rec(L: FrozenSet[int], acc: int, peak: int, t: int, kept: FrozenSet[int]) -> None:
        if L == V:
            out.append((peak, t, kept))
            return
        for L2 in lower:
            if L < L2:
                bnd, back = info[L2]
                blk = L2 - L
                U = (bnd | must_keep) & blk
                step = (const + acc + sum(blockw[v] for v in blk) + back
                        + max(trans[v] for v in blk))
                rec(L2, acc + sum(keepw[v] for v in U), max(peak, step),
                    t + sum(T[v] for v in U), kept | U)

    rec(frozenset(), 0, 0, 0, frozenset())
    return out


KINDS = ["chain", "diamond", "wide", "sinks", "random"]


@pytest.mark.parametrize("seed", range(300))
def test_exact_dp_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    sizes, edges, costs = random_dag(rng, kind)
    g = Graph.from_edges(sizes, edges, costs=costs)
    total_t = sum(costs)
    chains = brute_force(g)
    least = min(p for p, _ in chains)
    for engine in ENGINES:
        assert least_feasible_budget(g, "exact", engine=engine) == least
        assert least_feasible_budget(g, "approx", engine=engine) >= least
        # Infeasible just below the least feasible budget.
        assert not solve_exact(g, least - 1, engine=engine).feasible
        assert not solve_approx(g, least - 1, engine=engine).feasible
    # 10**15: a budget that can never bind (the DPs drop it: tc keeps every
    # non-sink, mc takes the single block, on every engine).
    budgets = sorted({least, max(p for p, _ in chains), rng.choice(chains)[0],
                      (least + max(p for p, _ in chains)) // 2, 10 ** 15})
    for b in budgets:
        ok = [t for p, t in chains if p <= b]
        best_tc, best_mc = max(ok), min(ok)
        tc = solve_exact(g, b, strategy="tc", engine="numpy")
        mc = solve_exact(g, b, strategy="mc", engine="numpy")
        # The sparse (Pareto frontier) table and the compiled kernels find
        # the same optima.
        assert solve_exact(g, b, strategy="tc", method="sparse").overhead == tc.overhead
        assert solve_exact(g, b, strategy="mc", method="sparse").overhead == mc.overhead
        for engine in ENGINES[1:]:
            for strategy, ref in (("tc", tc), ("mc", mc)):
                p = solve_exact(g, b, strategy=strategy, engine=engine)
                assert p.feasible and p.predicted_peak_bytes <= b
                assert p.overhead == ref.overhead
                a_np = solve_approx(g, b, strategy=strategy, engine="numpy")
                a_nb = solve_approx(g, b, strategy=strategy, engine=engine)
                assert a_nb.feasible == a_np.feasible and a_nb.overhead == a_np.overhead
        assert tc.feasible and mc.feasible
        assert tc.predicted_peak_bytes <= b and mc.predicted_peak_bytes <= b
        assert tc.overhead == pytest.approx(total_t - best_tc)
        assert mc.overhead == pytest.approx(total_t - best_mc)
        ap = solve_approx(g, b, strategy="tc")
        if ap.feasible:
            assert ap.predicted_peak_bytes <= b
            assert ap.overhead >= tc.overhead - 1e-9
        # Every plan is a strictly increasing chain of lower sets ending at V.
        prev: FrozenSet[int] = frozenset()
        for L in tc.lower_sets:
            assert prev < L
            assert all(set(g.preds[v]) <= L for v in L)
            prev = L
        assert prev == frozenset(range(g.n))


def random_model(rng: random.Random, g: Graph) -> MemoryModel:
    """Random per-node weights: independent block, keep, above and beside
    weights (zeros included), transients on some nodes, a constant."""
    n = g.n

    def w(lo: int, hi: int, p_zero: float) -> List[int]:
        return [0 if rng.random() < p_zero else rng.randint(lo, hi) for _ in range(n)]

    return MemoryModel(block_bytes=w(1, 40, 0.1), keep_bytes=w(1, 20, 0.1),
                       above_bytes=w(1, 20, 0.2), beside_bytes=w(1, 20, 0.2),
                       transient_bytes=w(1, 60, rng.choice([0.0, 0.5, 0.8])),
                       constant_bytes=rng.choice([0, 0, rng.randint(1, 100)]), scope="total")


@pytest.mark.parametrize("seed", range(200))
def test_dps_match_brute_force_under_random_models(seed: int) -> None:
    rng = random.Random(10_000 + seed)
    kind = KINDS[seed % len(KINDS)]
    sizes, edges, costs = random_dag(rng, kind)
    g = Graph.from_edges(sizes, edges, costs=costs)
    model = random_model(rng, g)
    total_t = sum(costs)
    chains = brute_force(g, model)
    least = min(p for p, _ in chains)
    for engine in ENGINES:
        assert least_feasible_budget(g, "exact", model=model, engine=engine) == least
        assert least_feasible_budget(g, "approx", model=model, engine=engine) >= least
        assert not solve_exact(g, least - 1, model=model, engine=engine).feasible
        assert not solve_approx(g, least - 1, model=model, engine=engine).feasible
        if model.constant_bytes:
            assert not solve_exact(g, model.constant_bytes - 1, model=model,
                                   engine=engine).feasible
    worst = max(p for p, _ in chains)
    for b in sorted({least, worst, rng.choice(chains)[0], (least + worst) // 2, 10 ** 15}):
        ok = [t for p, t in chains if p <= b]
        for strategy, best in (("tc", max(ok)), ("mc", min(ok))):
            runs = [dict(method="dense"), dict(method="sparse")] + [
                dict(engine=e) for e in ENGINES[1:]]
            for kw in runs:
                p = solve_exact(g, b, strategy=strategy, model=model, **kw)
                assert p.feasible and p.predicted_peak_bytes <= b
                assert p.overhead == pytest.approx(total_t - best)
                assert p.info["memory_scope"] == "total"
            ap = solve(g, b, "approx", strategy, model=model, raise_infeasible=False)
            if ap.feasible:
                assert ap.predicted_peak_bytes <= b
                if strategy == "tc":
                    assert ap.overhead >= total_t - best - 1e-9
                else:
                    assert ap.overhead <= total_t - best + 1e-9


def wide_dag(rng: random.Random, n: int) -> Graph:
    """A DAG of a few parallel branches with cross links: many lower sets."""
    width = rng.randint(3, 5)
    edges = set()
    for v in range(width, n):
        edges.add((v - width, v))
        if rng.random() < 0.25:
            edges.add((rng.randrange(v), v))
    sizes = [rng.randint(1, 50) for _ in range(n)]
    costs = [rng.choice([1, 1, 2, 10]) for _ in range(n)]
    return Graph.from_edges(sizes, sorted(edges), costs=costs)


@pytest.mark.skipif(len(ENGINES) < 2, reason="numba is not installed (the 'fast' extra)")
@pytest.mark.parametrize("seed", range(12))
def test_compiled_matches_numpy_on_many_lower_sets(seed: int) -> None:
    """Graphs too large for brute force (hundreds of lower sets): the
    compiled kernels against the NumPy DP, which brute force checks above,
    under the paper's model and a random one, across the budget range."""
    rng = random.Random(20_000 + seed)
    g = wide_dag(rng, rng.randint(13, 17))
    model = random_model(rng, g) if seed % 2 else None
    lo = least_feasible_budget(g, "exact", model=model, engine="numpy")
    assert least_feasible_budget(g, "exact", model=model, engine="numba") == lo
    hi = solve(g, None, "none", model=model).predicted_peak_bytes
    for b in sorted({lo, lo + (hi - lo) // 8, int(lo * 1.25), (lo + hi) // 2, 2 * hi}):
        for strategy in ("tc", "mc"):
            ref = solve_exact(g, b, strategy=strategy, model=model, engine="numpy")
            got = solve_exact(g, b, strategy=strategy, model=model, engine="numba")
            assert got.feasible and got.predicted_peak_bytes <= b
            assert got.overhead == pytest.approx(ref.overhead)


@pytest.mark.skipif(len(ENGINES) < 2, reason="numba is not installed (the 'fast' extra)")
@pytest.mark.parametrize("seed", range(8))
def test_compiled_guesses_match_numpy(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled tc DP's guessed runs (which large tables take: a run
    with the incumbent stopped early, then guesses from the top) find the
    NumPy DP's optimum, forced here on small graphs."""
    from chainer_recompute.core.solvers._dp import compiled
    rng = random.Random(30_000 + seed)
    g = wide_dag(rng, rng.randint(10, 15))
    model = random_model(rng, g) if seed % 2 else None
    lo = least_feasible_budget(g, "exact", model=model, engine="numpy")
    hi = solve(g, None, "none", model=model).predicted_peak_bytes
    budgets = sorted({lo, lo + (hi - lo) // 8, int(lo * 1.25), (lo + hi) // 2})
    refs = {b: solve_exact(g, b, strategy="tc", model=model, engine="numpy") for b in budgets}
    for first in (1, 10**9):  # the incumbent's run stopped at once, or never
        monkeypatch.setattr(compiled, "GUESS_MIN_TABLE", 0)
        monkeypatch.setattr(compiled, "GUESS_FIRST_PUSHES", first)
        for b in budgets:
            got = solve_exact(g, b, strategy="tc", model=model, engine="numba")
            assert got.feasible and got.predicted_peak_bytes <= b
            assert got.overhead == pytest.approx(refs[b].overhead)


def unet_like(levels: int, rng: Optional[random.Random]) -> Graph:
    """A U-Net's shape: per level conv, relu, conv, relu (the skip), pool;
    a bottom; per level up, concat with the skip through a crop, conv,
    relu, conv, relu. Its greedy incumbent is far below the optimum (as on
    the authors' U-Net), and the crops make more lower sets than
    ancestor closures."""
    sizes: List[int] = []
    costs: List[float] = []
    edges: List[Tuple[int, int]] = []

    def add(size: int, cost: float, preds: List[int]) -> int:
        sizes.append(size)
        costs.append(cost)
        edges.extend((p, len(sizes) - 1) for p in preds)
        return len(sizes) - 1

    prev: List[int] = []
    skips = []
    s = 64
    for _ in range(levels):
        a = add(s, 10, prev)
        c = add(s, 10, [add(s, 1, [a])])
        skips.append(add(s, 1, [c]))
        prev = [add(s // 4, 1, [skips[-1]])]
        s //= 2
    crops = [add(sizes[k], 1, [k]) for k in skips]
    prev = [add(s, 1, [add(s, 10, prev)])]
    for level in reversed(range(levels)):
        s *= 2
        cat = add(2 * s, 1, [add(s, 10, prev), crops[level]])
        c = add(s, 10, [add(s, 1, [add(s, 10, [cat])])])
        prev = [add(s, 1, [c])]
    if rng is not None:
        sizes = [max(1, int(x * rng.uniform(0.5, 2))) for x in sizes]
    return Graph.from_edges(sizes, edges, costs=costs)


@pytest.mark.skipif(len(ENGINES) < 2, reason="numba is not installed (the 'fast' extra)")
def test_compiled_closure_incumbent_matches_numpy(caplog: pytest.LogCaptureFixture) -> None:
    """On U-Net-like graphs the compiled tc DP raises its incumbent with
    the DP on the ancestor-closure rows; it still finds the NumPy DP's
    optimum, both where that incumbent is below the optimum and where it
    is the optimum (a tie, which must not be pruned)."""
    import logging
    import re
    caplog.set_level(logging.DEBUG, logger="chainer_recompute.core.solvers._dp")
    seen = {"below": 0, "optimal": 0}
    for levels in (3, 4):
        for seed in range(6):
            g = unet_like(levels, random.Random(seed) if seed else None)
            total = float(g.node_cost.sum())
            lo = least_feasible_budget(g, "exact", engine="numpy")
            hi = solve(g, None, "none").predicted_peak_bytes
            for b in sorted({lo, int(lo * 1.1), int(lo * 1.25), int(lo * 1.5), (lo + hi) // 2}):
                ref = solve_exact(g, b, strategy="tc", engine="numpy")
                caplog.clear()
                got = solve_exact(g, b, strategy="tc", engine="numba")
                assert got.feasible and got.predicted_peak_bytes <= b
                assert got.overhead == ref.overhead
                for m in caplog.messages:
                    if m.startswith("ancestor closures"):
                        inc = int(re.search(r"incumbent (\d+)", m).group(1))
                        seen["optimal" if inc == total - ref.overhead else "below"] += 1
    assert seen["below"] >= 5 and seen["optimal"] >= 2, seen
