"""BudgetSearch.tradeoff: the budget against the recompute overhead, from
the plans the search made (tradeoff.png's curve)."""
from __future__ import annotations

import numpy as np
import pytest

from chainer_recompute.core.budget import (BudgetSearch, TradeoffPoint, least_for, limit_of,
                                           pareto_front)
from chainer_recompute.core.graph import Graph


def random_graph(seed: int) -> Graph:
    r = np.random.RandomState(seed)
    n = int(r.randint(6, 14))
    edges = [(u, v) for v in range(1, n) for u in range(v) if u == v - 1 or r.rand() < 0.25]
    return Graph.from_edges(r.randint(1, 50, n).tolist(), edges,
                            costs=(r.rand(n) + 0.1).tolist())


def _overhead(plan) -> float:
    return float(plan.overhead_fraction or 0.0) if plan.recompute else 0.0


@pytest.mark.parametrize("solver", ["exact", "approx"])
@pytest.mark.parametrize("seed", range(6))
def test_front_from_least_to_plain_dominates_every_plan_made(solver, seed):
    g = random_graph(seed)
    search = BudgetSearch(g, solver, "tc")
    least = search.least_plan()
    van_peak = search.vanilla()[1]
    mid = (search.least_budget() + least_for(van_peak)) // 2
    plan = search.fit(mid)
    made = len(search._timed._cache)
    front, tried = search.tradeoff()
    assert len(search._timed._cache) == made  # nothing solved again
    budgets = [q.budget_bytes for q in front]
    overheads = [q.overhead_fraction for q in front]
    assert budgets == sorted(set(budgets)) and overheads == sorted(set(overheads), reverse=True)
    assert front[0].budget_bytes == search.least_budget()
    assert front[-1] == TradeoffPoint(least_for(van_peak), van_peak, 0.0, 1, False)
    assert len(front) <= tried
    made_plans = [search.vanilla()] + search.candidates() + [
        (p, peak) for p, peak in search._timed._cache.values() if p.feasible]
    for p, peak in made_plans:
        assert any(q.budget_bytes <= least_for(peak) and q.overhead_fraction <= _overhead(p)
                   for q in front)
    # the plans for the least budget and for ``mid`` are among them
    for p, b in ((least, search.least_budget()), (plan, mid)):
        assert p.predicted_peak_bytes <= limit_of(b)
        assert min(q.overhead_fraction for q in front if q.budget_bytes <= b) \
            <= _overhead(p) + 1e-12


def test_extra_budgets_are_bounded():
    g = random_graph(3)
    search = BudgetSearch(g, "exact", "tc")
    search.least_plan()
    before = len(search._timed._cache)
    search.tradeoff(extra_budgets=4)
    assert before < len(search._timed._cache) <= before + 5
    grown = len(search._timed._cache)
    search.tradeoff(extra_budgets=4, time_limit_s=0.0)  # cached: nothing new
    assert len(search._timed._cache) == grown


def test_pareto_front():
    p = lambda b, o: TradeoffPoint(b, b, o, 1, o > 0)  # noqa: E731
    assert pareto_front([]) == []
    assert pareto_front([p(5, 0.0), p(3, 0.4), p(3, 0.2), p(4, 0.2), p(2, 0.9)]) == [
        p(2, 0.9), p(3, 0.2), p(5, 0.0)]
