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
from chainer_recompute.core.solvers.nested_dp import (exact_trees, least_nested_budget,
                                                       nested_cost, solve_nested_exact,
                                                       tree_nested_cost)
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


def small_dag(rng: random.Random, kind: str, max_lower_sets: int = 24) -> Graph:
    """A random DAG of ``kind`` with at most 7 functions and
    ``max_lower_sets`` lower sets (the brute force's plans grow as the
    chains times their groupings, or their level assignments)."""
    while True:
        sizes, edges, costs = random_dag(rng, kind)
        g = Graph.from_edges(sizes, edges, costs=costs)
        try:
            if g.n <= 7 and count_lower_sets(g, max_lower_sets):
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


# ------------------------------------------------------------- any depth

def every_chain(g: Graph) -> List[Tuple[int, ...]]:
    """Every strictly increasing chain of lower sets ending at V (bitsets),
    the lower sets found by testing every subset."""
    n = g.n
    lower = [m for m in range(1, 1 << n)
             if all(m >> u & 1 for v in range(n) if m >> v & 1 for u in g.preds[v])]
    full = (1 << n) - 1
    out: List[Tuple[int, ...]] = []

    def rec(chain: Tuple[int, ...]) -> None:
        last = chain[-1] if chain else 0
        if last == full:
            out.append(chain)
            return
        for L in lower:
            if L & last == last and L != last:
                rec(chain + (L,))

    rec(())
    return out


def check_trees(g: Graph, model: Optional[MemoryModel]) -> None:
    """exact_trees' front against every chain with every level assignment
    (any depth) under tree_nested_cost."""
    plans = [tree_nested_cost(g, chain, levels, model) + (chain, levels)
             for chain in every_chain(g)
             for levels in itertools.product(range(max(1, len(chain) - 1)),
                                             repeat=len(chain) - 1)]
    front = []
    for peak, t, *_ in sorted(plans, key=lambda p: (p[0], p[1])):
        if not front or t < front[-1][1] - 1e-9:
            front.append((peak, t))
    got = exact_trees(g, model)
    assert [(x.peak_bytes, pytest.approx(x.overhead)) for x in got] == front
    for x in got:  # the DP's own figures are the cost function's
        assert (x.peak_bytes, pytest.approx(x.overhead)) == tree_nested_cost(
            g, x.masks, x.levels, model)
    # never above the two-level exact DP's least, nor below the single block's floor
    assert got[0].peak_bytes <= least_nested_budget(g, model)
    # on two levels the memory is the two-level formula's
    for peak, t, chain, levels in plans[::7]:
        if set(levels) <= {0, 1}:
            ends = [i for i, x in enumerate(levels) if x == 0] + [len(chain) - 1]
            assert peak == nested_cost(g, chain, ends, model)[0]


@pytest.mark.parametrize("seed", range(40))
def test_exact_trees_are_the_brute_force_over_every_chain_and_tree(seed: int) -> None:
    rng = random.Random(40_000 + seed)
    g = small_dag(rng, KINDS[seed % len(KINDS)], max_lower_sets=7)  # (every level assignment)
    check_trees(g, None if seed % 2 else random_model(rng, g))
