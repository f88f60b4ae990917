"""Solvers, registry, plans, schedule simulator and searches."""
from __future__ import annotations

import numpy as np
import pytest

from chainer_recompute.core.errors import (GraphError, InfeasibleBudgetError, LowerSetExplosionError,
                                      UnknownSolverError, BudgetError)
from chainer_recompute.core.graph import Graph
from chainer_recompute.core.plan import Plan
from chainer_recompute.core.schedule import build_schedule, paper_cost, simulate
from chainer_recompute.core.search import (largest_batch_size, least_feasible_budget, scale_bytes)
from chainer_recompute.core.planner import solve
from chainer_recompute.core.solvers import REGISTRY, solve_chen, solve_exact, solve_none


def chain4() -> Graph:
    # 0 -> 1 -> 2 -> 3, every M_v = 1 and T_v = 1.
    return Graph.from_edges([1, 1, 1, 1], [(0, 1), (1, 2), (2, 3)], costs=[1, 1, 1, 1])


def diamond() -> Graph:
    # 0 -> {1, 2} -> 3; M = 1, 2, 3, 4; T_v = 1.
    return Graph.from_edges([1, 2, 3, 4], [(0, 1), (0, 2), (1, 3), (2, 3)], costs=[1, 1, 1, 1])


# Chain of 4 worked by hand. Block [a..b] costs acc + 2(b-a+1) + [b<3] (A is
# the next node; B is empty on a chain) and keeps U = {b} when b < 3.
#   singletons          : peaks 3, 4, 5, 5         -> peak 5, overhead 1
#   {0,1},{2,3}         : 5, then acc 1 + 4 = 5     -> peak 5, overhead 3
#   {0,1},{2},{3}       : 5, 4, 4                   -> peak 5, overhead 2
#   {0},{1},{2,3}       : 3, 4, 6                   -> peak 6, overhead 2
#   {0},{1,2},{3}       : 3, 6, 4                   -> peak 6, overhead 2
#   single block        : 8                         -> overhead 4
# So the least feasible budget is 5; TC at 5 has overhead 1 and MC 3; at 8
# MC takes the single block (overhead 4).
@pytest.mark.parametrize("budget, tc, mc", [(5, 1, 3), (6, 1, 3), (8, 1, 4)])
def test_chain4_by_hand(budget: int, tc: float, mc: float) -> None:
    g = chain4()
    assert solve_exact(g, budget, strategy="tc").overhead == tc
    assert solve_exact(g, budget, strategy="mc").overhead == mc
    assert solve(g, budget, "approx", "tc").overhead == tc  # every lower set is a closure


def test_chain4_least_budget_and_infeasible() -> None:
    g = chain4()
    assert least_feasible_budget(g, "exact") == 5
    assert not solve_exact(g, 4).feasible
    p = solve_exact(g, 5)
    assert [sorted(s) for s in p.lower_sets] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert p.predicted_peak_bytes == 5 and p.overhead_fraction == pytest.approx(0.25)


# Diamond worked by hand (A = successors outside L, B = their other preds):
#   {0}: back 5, {0,1}: back 10 (A={2,3}, B={2}), {0,2}: back 8 (A={1,3}, B={1}),
#   {0,1,2}: back 4, V: 0.
#   ∅→{0}→{0,1,2}→V: peaks 7, 1+10+4 = 15, acc 6: 14 -> 15, overhead 1
#   ∅→{0,1,2}→V: 16, acc 5: 13 -> 16, overhead 2 (nodes 0 and 3)
#   ∅→{0,2}→V: 16, acc 4: 16 -> 16, overhead 2
#   single block: 20, overhead 4
# Least feasible 15 (TC = MC = 1 there); at 16 MC reaches overhead 2.
def test_diamond_by_hand() -> None:
    g = diamond()
    assert least_feasible_budget(g, "exact") == 15
    assert not solve_exact(g, 14).feasible
    assert solve_exact(g, 15, strategy="tc").overhead == 1
    assert solve_exact(g, 15, strategy="mc").overhead == 1
    assert solve_exact(g, 16, strategy="mc").overhead == 2
    assert solve_exact(g, 20, strategy="mc").overhead == 4
    p = solve_exact(g, 15)
    assert p.lower_sets[-1] == frozenset(range(4))
    assert p.kept | p.dropped == frozenset(range(4)) and not (p.kept & p.dropped)


def test_plan_is_immutable_and_prints() -> None:
    p = solve(chain4(), 6, "exact")
    assert isinstance(p, Plan)
    with pytest.raises(Exception):
        p.feasible = False  # type: ignore[misc]
    assert "exact/tc" in str(p) and "overhead" in p.summary()
    assert len(p.blocks) == p.n_blocks == len(p.checkpoints)
    assert frozenset().union(*p.blocks) == frozenset(range(4))


def test_registry_errors() -> None:
    with pytest.raises(UnknownSolverError) as e:
        solve(chain4(), 10, solver="nope")
    assert str(sorted(REGISTRY)) in str(e.value)
    with pytest.raises(UnknownSolverError, match="strategy"):
        solve(chain4(), 10, strategy="fast")
    with pytest.raises(BudgetError):
        solve(chain4(), "lots")


def test_infeasible_raises_with_least_budget() -> None:
    g = Graph.from_edges([10 ** 9] * 4, [(0, 1), (1, 2), (2, 3)])
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(g, "1GB", solver="approx")
    err = e.value
    assert err.least_feasible_bytes == 5 * 10 ** 9
    assert err.vanilla_bytes == 8 * 10 ** 9
    assert "least feasible 4.66 GiB" in str(err) and "'approx'" in str(err)
    p = solve(g, "1GB", solver="approx", raise_infeasible=False)
    assert not p.feasible and p.lower_sets == ()


def test_budget_below_one_block() -> None:
    # A single huge node needs 2·M even alone.
    g = Graph.from_edges([1, 100, 1], [(0, 1), (1, 2)])
    assert least_feasible_budget(g, "exact") >= 200
    assert not solve(g, 150, "exact", raise_infeasible=False).feasible


def test_bad_graphs() -> None:
    with pytest.raises(GraphError, match="cycle"):
        Graph.from_edges([1, 1], [(0, 1), (1, 0)])
    with pytest.raises(GraphError, match="empty"):
        Graph.from_edges([], [])


def test_explosion_names_approx() -> None:
    g = Graph.from_edges([1] * 25, [])
    with pytest.raises(LowerSetExplosionError, match="approx"):
        solve_exact(g, 100, max_lower_sets=1000)
    assert solve(g, None, "approx").feasible


def test_none_and_chen() -> None:
    g = Graph.from_edges([1] * 16, [(i, i + 1) for i in range(15)])
    v = solve_none(g, None)
    assert v.overhead == 0 and v.predicted_peak_bytes == 32 and v.n_blocks == 1
    assert v.kept == frozenset(range(16)) and v.dropped == frozenset()
    c = solve_chen(g, None)
    assert c.info["n_candidates"] == 17
    assert c.n_blocks == 4  # k = floor(sqrt(17)) = 4 cuts at equal spacing
    assert c.predicted_peak_bytes < v.predicted_peak_bytes
    greedy = solve(g, 14, "chen-greedy")
    assert greedy.feasible and greedy.predicted_peak_bytes <= 14
    assert least_feasible_budget(g, "chen-greedy") <= least_feasible_budget(g, "chen")


def test_simulator_vanilla_and_checks() -> None:
    g = chain4()
    sched = build_schedule(g, [{0, 1, 2, 3}], recompute=False)
    sim = simulate(g, sched)
    assert sched.count("recompute") == 0
    assert sim.memory_bytes[-1] == 0  # everything freed at the end
    assert sim.peak_bytes <= 2 * 4
    assert sim.memory_bytes[sim.peak_step] == sim.peak_bytes


def test_simulator_recomputes_dropped() -> None:
    g = diamond()
    p = solve_exact(g, 15)
    sched = build_schedule(g, [set(s) for s in p.lower_sets])
    sim = simulate(g, sched)
    assert sched.count("recompute") == len(p.dropped)
    assert sim.recompute_cost == pytest.approx(p.overhead)
    assert sim.memory_bytes[-1] == 0
    assert isinstance(sim.memory_bytes, np.ndarray)
    assert p.simulated_peak_bytes == sim.peak_bytes


def test_simulator_rejects_bad_schedule() -> None:
    from chainer_recompute.core.schedule import Schedule
    g = chain4()
    with pytest.raises(ValueError):
        simulate(g, Schedule(ops=(("forward", 1),), n_blocks=1))


def test_paper_cost_rejects_non_chain() -> None:
    with pytest.raises(ValueError):
        paper_cost(chain4(), [{0, 1}, {0, 1}])


def test_scale_and_largest_batch() -> None:
    g = Graph.from_edges([4, 4, 4, 4], [(0, 1), (1, 2), (2, 3)])
    assert scale_bytes(g, 3).node_bytes.tolist() == [12] * 4
    # least feasible at batch 1 is 20 bytes (chain of 4: 5 units of 4 bytes)
    assert least_feasible_budget(g, "exact") == 20
    assert largest_batch_size(g, 100, "exact", batch_size=1) == 5
    assert largest_batch_size(g, 19, "exact", batch_size=1) == 0
    with pytest.raises(GraphError):
        largest_batch_size(g, 100, "exact")


def test_string_budget() -> None:
    g = Graph.from_edges([2 ** 30] * 4, [(0, 1), (1, 2), (2, 3)])
    assert solve(g, "5G", "exact").feasible
    assert not solve(g, "4G", "exact", raise_infeasible=False).feasible


# ------------------------------------------------------------ chain solvers
def test_hsm_equals_revolve_on_uniform_chains() -> None:
    from chainer_recompute.core.solvers.chain import bptt_hsm_table, revolve_min_forward_steps
    C, _ = bptt_hsm_table(120, 12)
    for t in range(1, 121):
        for m in range(1, 13):
            assert C[t, m] - t == revolve_min_forward_steps(t, m)
    assert C[8, 1] == 36 and C[0, 3] == 0 and C[1, 3] == 1


def test_msm_no_worse_than_hsm_and_ism() -> None:
    from chainer_recompute.core.solvers.chain import bptt_hsm_table, bptt_ism_table, bptt_msm_table
    H, _ = bptt_hsm_table(60, 8)
    I = bptt_ism_table(60, 8, alpha=2)
    M = bptt_msm_table(60, 8, alpha=2)
    assert (M[1:, 1:] <= H[1:, 1:]).all() and (M[1:, 2:] <= I[1:, 2:]).all()


def test_hsm_policy_splits_are_valid() -> None:
    from chainer_recompute.core.solvers.chain import hsm_policy
    pol = hsm_policy(10, 3)
    assert pol[0] == (0, 10, 3)
    for off, length, slots in pol:
        assert 0 <= off and off + length <= 10 and 2 <= slots <= 3


def test_dp_engines() -> None:
    from chainer_recompute.core.solvers._dp import numba_available
    g = Graph.from_edges([1, 2, 3, 4], [(0, 1), (0, 2), (1, 3), (2, 3)], costs=[1, 1, 1, 1])
    ref = solve_exact(g, 15, engine="numpy")
    assert ref.overhead == 1
    with pytest.raises(ValueError, match="engine"):
        solve_exact(g, 15, engine="fortran")
    if numba_available():
        assert solve_exact(g, 15, engine="numba").overhead == ref.overhead
        assert solve_exact(g, 16, strategy="mc", engine="numba").overhead == 2
        assert least_feasible_budget(g, "exact", engine="numba") == 15
    else:
        with pytest.raises(ImportError, match="fast"):
            solve_exact(g, 15, engine="numba")


def test_plan_records_memory_scope() -> None:
    from chainer_recompute.core.memory_model import MemoryModel
    g = chain4()
    assert solve_exact(g, 5).info["memory_scope"] == "activations"
    m = MemoryModel.paper(g)
    total = MemoryModel(block_bytes=m.block_bytes, keep_bytes=m.keep_bytes,
                        above_bytes=m.above_bytes, beside_bytes=m.beside_bytes,
                        transient_bytes=[0, 3, 0, 0], constant_bytes=10, scope="total")
    p = solve(g, 18, "exact", model=total)
    assert p.info["memory_scope"] == "total" and p.predicted_peak_bytes <= 18
    assert least_feasible_budget(g, "exact", model=total) == p.predicted_peak_bytes or \
        least_feasible_budget(g, "exact", model=total) <= 18
    with pytest.raises(InfeasibleBudgetError):
        solve(g, 9, "exact", model=total)  # below the constant


@pytest.mark.parametrize("seed", range(30))
def test_chain_cost_equals_strategy_cost(seed: int) -> None:
    """The DPs' plans take their cost from the family's per-row sums
    (chain_cost): the same figures as strategy_cost from the graph, for
    random chains, memory models and costs (integral or not)."""
    import random

    from chainer_recompute.core.lower_sets import LowerSetFamily
    from chainer_recompute.core.memory_model import MemoryModel
    from chainer_recompute.core.schedule import strategy_cost
    from chainer_recompute.core.solvers._dp import chain_cost
    rng = random.Random(seed)
    n = rng.randint(2, 12)
    edges = sorted({(rng.randrange(v), v) for v in range(1, n) for _ in range(rng.randint(0, 2))})
    costs = [rng.random() * 3 for _ in range(n)] if seed % 3 == 0 else \
        [rng.randint(1, 10) for _ in range(n)]
    g = Graph.from_edges([rng.randint(1, 30) for _ in range(n)], edges, costs=costs)
    model = None if seed % 2 else MemoryModel(
        block_bytes=[rng.randint(0, 40) for _ in range(n)],
        keep_bytes=[rng.randint(0, 20) for _ in range(n)],
        above_bytes=[rng.randint(0, 20) for _ in range(n)],
        beside_bytes=[rng.randint(0, 20) for _ in range(n)],
        transient_bytes=[rng.choice([0, rng.randint(1, 60)]) for _ in range(n)],
        constant_bytes=rng.randint(0, 50), scope="total")
    fam = LowerSetFamily.all(g, model=model)
    masks = fam.masks()
    for _ in range(10):
        rows, cur = [], 0
        while cur != len(fam) - 1:  # a random chain ∅ ⊊ ... ⊊ V
            sup = [j for j in range(cur + 1, len(fam))
                   if masks[j] & masks[cur] == masks[cur] and masks[j] != masks[cur]]
            cur = rng.choice(sup)
            rows.append(cur)
        got = chain_cost(fam, rows)
        ref = strategy_cost(g, [masks[r] for r in rows], model)
        assert got == ref


@pytest.mark.parametrize("seed", range(10))
def test_prefix_chain_finds_the_topological_prefixes(seed: int) -> None:
    """The rows of ∅, {0}, {0, 1}, ..., V in a family of every lower set
    (the tc DP's answer when the budget never binds), in chunks of any
    size; None where a prefix is not a row (ancestor closures of a graph
    with two sources)."""
    import random

    from chainer_recompute.core.lower_sets import LowerSetFamily, set_to_mask
    from chainer_recompute.core.solvers._dp import _prefix_chain
    rng = random.Random(seed)
    n = 70  # two words
    head = rng.randint(2, 12)  # a random DAG, then a chain
    edges = {(rng.randrange(v), v) for v in range(1, head) for _ in range(rng.randint(0, 2))}
    edges |= {(v - 1, v) for v in range(head, n)}
    fam = LowerSetFamily.all(Graph.from_edges([1] * n, sorted(edges)))
    want = [fam.masks().index(set_to_mask(range(k))) for k in range(n + 1)]
    assert _prefix_chain(fam) == want
    assert _prefix_chain(fam, chunk=3) == want
    two_sources = Graph.from_edges([1, 1, 1], [(0, 2), (1, 2)])
    assert _prefix_chain(LowerSetFamily.ancestor_closures(two_sources)) is None


@pytest.mark.parametrize("seed", range(10))
def test_closure_rows_finds_the_ancestor_closures(seed: int) -> None:
    """The rows of ∅, V and every node's ancestor closure in a family of
    every lower set (the tc incumbent's rows), over one to three words;
    None where the closures are the whole family or one is not a row."""
    import random

    from chainer_recompute.core.lower_sets import LowerSetFamily, ancestor_masks
    from chainer_recompute.core.solvers._dp import _closure_rows
    rng = random.Random(seed)
    n = rng.choice([9, 70, 150])
    head = rng.randint(1, 9)  # a random DAG, then a chain
    edges = {(rng.randrange(v), v) for v in range(1, head) for _ in range(rng.randint(0, 2))}
    edges |= {(v - 1, v) for v in range(head, n)}
    g = Graph.from_edges([1] * n, sorted(edges))
    fam = LowerSetFamily.all(g)
    masks = fam.masks()
    want = sorted({0, len(fam) - 1} | {masks.index(m) for m in ancestor_masks(g)})
    got = _closure_rows(fam)
    assert (got is None) if len(want) == len(fam) else got.tolist() == want
    closures = LowerSetFamily.ancestor_closures(g)
    assert _closure_rows(closures) is None
    some = LowerSetFamily.of_masks(g, masks[:-1:2] + [masks[-1]])
    if not set(ancestor_masks(g)) <= set(some.masks()):
        assert _closure_rows(some) is None


def test_infeasible_message_in_binary_units():
    """solve()'s error gives sizes in binary units, as everything else."""
    import re
    g = Graph.from_edges([3 << 30] * 3, [(0, 1), (1, 2)])
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(g, "1G", solver="exact")
    msg = str(e.value)
    assert "1.00 GiB" in msg and "12.00 GiB" in msg and "18.00 GiB" in msg, msg
    assert not re.search(r"\d (kB|MB|GB|TB)\b", msg), msg
