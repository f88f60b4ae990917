"""The exact nested DP against brute force on small random DAGs.

Brute force works from the definitions (docs/algorithm.md §9) on
frozensets, independently of the library: every lower set by testing every
subset, every strictly increasing chain ∅ ⊊ L_1 ⊊ ... ⊊ V, every grouping
of its blocks into outer blocks, each with its memory and recomputation
under the paper's model or a random one.
"""
from __future__ import annotations

import itertools
import random
from typing import FrozenSet, List, Optional, Tuple

import pytest

from chainer_recompute.core.graph import Graph
from chainer_recompute.core.errors import LowerSetExplosionError
from chainer_recompute.core.lower_sets import count_lower_sets
from chainer_recompute.core.memory_model import MemoryModel
from chainer_recompute.core.schedule import strategy_cost
from chainer_recompute.core.search import least_feasible_budget
from chainer_recompute.core.solvers.nested_dp import (least_nested_budget, nested_cost,
                                                       solve_nested_exact)
from test_bruteforce import KINDS, random_dag, random_model, weights


def brute_force(g: Graph, model: Optional[MemoryModel] = None
                ) -> List[Tuple[int, float, Tuple[FrozenSet[int], ...], Tuple[int, ...]]]:
    """(peak, recomputation, chain, outer ends) of every nested plan."""
    n = g.n
    preds = {v: set(g.preds[v]) for v in range(n)}
    succs = {v: set(g.succs[v]) for v in range(n)}
    blockw, keepw, abovew, besidew, trans, const = weights(g, model)
    T = [float(x) for x in g.node_cost]
    V = frozenset(range(n))
    lower = [frozenset(s) for r in range(1, n + 1) for s in itertools.combinations(range(n), r)
             if all(preds[v] <= set(s) for v in s)]

    def bnd(L):
        return frozenset(v for v in L if succs[v] - L)

    def around(L):
        A = {w for v in L for w in succs[v]} - L
        B = {u for w in A for u in preds[w]} - L
        return sum(abovew[v] for v in A) + sum(besidew[v] for v in B)

    chains: List[Tuple[FrozenSet[int], ...]] = []

    def rec(chain: Tuple[FrozenSet[int], ...]) -> None:
        last = chain[-1] if chain else frozenset()
        if last == V:
            chains.append(chain)
            return
        for L in lower:
            if last < L:
                rec(chain + (L,))

    rec(())
    out = []
    for chain in chains:
        k = len(chain)
        for cut in itertools.product([False, True], repeat=k - 1):
            ends = tuple(i for i in range(k - 1) if cut[i]) + (k - 1,)
            peak, t = 0, 0.0
            outer_kept, inner, start, prev = 0, 0, frozenset(), frozenset()
            for i, L in enumerate(chain):
                blk = L - prev
                peak = max(peak, const + outer_kept + inner + sum(blockw[v] for v in blk)
                           + around(L) + max(trans[v] for v in blk))
                if i in ends:
                    W = L - start
                    ubar = bnd(L) & W
                    outer_kept += sum(keepw[v] for v in ubar)
                    t += sum(T[v] for v in W - ubar)
                    start, inner = L, 0
                else:
                    U = bnd(L) & blk
                    inner += sum(keepw[v] for v in U)
                    t += sum(T[v] for v in blk - U)
                prev = L
            out.append((peak, t, chain, ends))
    return out


def _mask(s) -> int:
    return sum(1 << v for v in s)


def check(g: Graph, model: Optional[MemoryModel], rng: random.Random) -> None:
    plans = brute_force(g, model)
    least = min(p for p, *_ in plans)
    assert least_nested_budget(g, model) == least
    assert solve_nested_exact(g, least - 1, model) is None
    # nested plans include the single-level ones: never above their least
    assert least <= least_feasible_budget(g, "exact", model=model)
    top = max(p for p, *_ in plans)
    for b in sorted({least, top, rng.choice(plans)[0], (least + top) // 2}):
        best = min(t for p, t, *_ in plans if p <= b)
        got = solve_nested_exact(g, b, model)
        assert got is not None and got.peak_bytes <= b
        assert got.overhead == pytest.approx(best)
        # the DP's own figures are the formula's
        assert (got.peak_bytes, got.overhead) == nested_cost(g, got.masks, got.ends, model)
    # the formula agrees with brute force on some plans, and with the
    # single-level formula when every block is an outer block
    for peak, t, chain, ends in rng.sample(plans, min(5, len(plans))):
        masks = [_mask(L) for L in chain]
        assert nested_cost(g, masks, ends, model) == (peak, pytest.approx(t))
        flat = strategy_cost(g, masks, model)
        assert nested_cost(g, masks, range(len(masks)), model) == (
            flat.peak_bytes, pytest.approx(flat.overhead))


def small_dag(rng: random.Random, kind: str) -> Graph:
    """A random DAG of ``kind`` with at most 7 functions and 24 lower sets
    (the brute force's plans grow as the chains times their groupings)."""
    while True:
        sizes, edges, costs = random_dag(rng, kind)
        g = Graph.from_edges(sizes, edges, costs=costs)
        try:
            if g.n <= 7 and count_lower_sets(g, 24):
                return g
        except LowerSetExplosionError:
            continue


@pytest.mark.parametrize("seed", range(60))
def test_nested_dp_matches_brute_force(seed: int) -> None:
    rng = random.Random(20_000 + seed)
    g = small_dag(rng, KINDS[seed % len(KINDS)])
    check(g, None, rng)


@pytest.mark.parametrize("seed", range(40))
def test_nested_dp_matches_brute_force_under_random_models(seed: int) -> None:
    rng = random.Random(30_000 + seed)
    g = small_dag(rng, KINDS[seed % len(KINDS)])
    check(g, random_model(rng, g), rng)


@pytest.mark.parametrize("n", [9, pytest.param(12, marks=pytest.mark.slow)])
def test_a_chain_of_up_to_a_dozen_functions(n: int):
    """``n`` functions in a row (at 12: 2,048 chains, 177,147 nested plans):
    the DP's optima are brute force's, and nesting goes below the
    single-level least."""
    rng = random.Random(5)
    g = Graph.from_edges([rng.randint(1, 20) for _ in range(n)],
                         [(i, i + 1) for i in range(n - 1)], costs=[rng.randint(1, 9)
                                                                     for _ in range(n)])
    check(g, None, rng)
    assert least_nested_budget(g) < least_feasible_budget(g, "exact")
