"""The tree DP of nested plans (core/solvers/nested_tree.py) against a
brute force over every level assignment of small chains, under its model
(``tree_cost``, which simulates the schedule block by block)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from chainer_recompute.core.solvers.nested_tree import TreeTable, tree_cost, tree_peak


def brute_force(c, w, tau, m):
    """The least recomputation of any level assignment whose peak is at
    most ``m``, and that peak; ``None`` when none fits."""
    k = len(w)
    best = None
    for levels in itertools.product(range(k - 1), repeat=k - 1):
        peak, time = tree_cost(c, w, tau, levels)
        if peak <= m and (best is None or time < best[0]):
            best = (time, peak)
    return best


@pytest.mark.parametrize("seed", range(5))
def test_tree_peak_is_tree_costs_peak(seed):
    """The O(k) peak of the nested search's screen against the block by
    block simulation, on random chains and level assignments of any depth."""
    rs = np.random.RandomState(seed)
    for _ in range(200):
        k = int(rs.randint(1, 30))
        c, w = rs.randint(1, 100, k - 1).tolist(), rs.randint(0, 100, k).tolist()
        levels = rs.randint(0, int(rs.randint(1, 6)), k - 1).tolist()
        assert tree_peak(c, w, levels) == tree_cost(c, w, [1] * k, levels)[0], (c, w, levels)


@pytest.mark.parametrize("seed", range(15))
def test_the_dp_is_the_brute_force_over_every_tree(seed):
    rs = np.random.RandomState(seed)
    k = int(rs.randint(2, 7))
    c = rs.randint(1, 6, k - 1).tolist()
    w = rs.randint(1, 9, k).tolist()
    tau = rs.randint(1, 5, k).tolist()
    grid = int(sum(c) + max(w))
    table = TreeTable(c, w, tau, budget=grid, grid=grid)  # one byte per unit: exact
    for m in range(grid + 1):
        want = brute_force(c, w, tau, m)
        got = table.time[m]
        if want is None:
            assert not np.isfinite(got), (m, got)
            continue
        assert got == want[0], (m, got, want, c, w, tau)
        peak, time = tree_cost(c, w, tau, table.levels(m))
        assert peak <= m and time == got
    least = table.least()
    assert least is not None and brute_force(c, w, tau, least) is not None
    assert least == 0 or brute_force(c, w, tau, least - 1) is None


def test_a_coarser_grid_rounds_up():
    """In units of 3 bytes a plan's figures are rounded up: what the table
    says fits does fit."""
    c, w, tau = [4, 5, 3, 4], [7, 3, 8, 2, 6], [1, 2, 1, 3, 1]
    table = TreeTable(c, w, tau, budget=30, grid=10)
    for m in range(table.least(), 11):
        peak, time = tree_cost(c, w, tau, table.levels(m))
        assert peak <= 3 * m and time == table.time[m]


def test_a_long_uniform_chain_nests_deeper_for_less_memory():
    """64 equal blocks: the least memory is reached with more than two
    levels, far below the single-level least (about 2 sqrt(64) checkpoints)."""
    k = 64
    table = TreeTable([1] * (k - 1), [1] * k, [1] * k, budget=40, grid=40)
    least = table.least()
    levels = table.levels(least)
    assert max(levels) >= 2 and least < 2 * 8 - 1, (least, levels)
    assert tree_cost([1] * (k - 1), [1] * k, [1] * k, levels)[0] <= least


@pytest.mark.parametrize("t", [5, 10, 30, 64])
def test_on_a_uniform_chain_the_dp_is_revolve(t):
    """A recurrent network's chain of ``t`` equal steps (a hidden state per
    boundary, nothing else held: the chain solvers' slot model): for every
    memory of ``m`` hidden states the tree DP recomputes what BPTT-HSM and
    Griewank's revolve do with ``m`` slots, counted as they count (their
    forward steps also count the forward pass, ``t``, but not the last
    step's backward, whose internals the forward left alive: ``- 1``)."""
    from chainer_recompute.core.solvers.chain import policy_cost
    table = TreeTable([1] * (t - 1), [0] * t, [1] * t, budget=t, grid=t)
    for m in range(1, t):
        want = policy_cost("revolve", t, m)
        assert policy_cost("hsm", t, m) == want
        assert table.time[m] + t - 1 == want, (t, m, table.time[m], want)
        peak, time = tree_cost([1] * (t - 1), [0] * t, [1] * t, table.levels(m))
        assert peak <= m and time == table.time[m]


@pytest.mark.parametrize("seed", range(5))
def test_a_base_below_every_need_changes_no_tree_and_spends_the_units_above_it(seed):
    """Blocks that need 1,000 bytes or more beside checkpoints of a few:
    with ``base`` their least need, the table in units of one byte above
    it is the exact DP shifted by ``base`` (the brute force's); without,
    in as many units over the whole range, a checkpoint rounds up to a
    unit of dozens of bytes, and the least found is higher or none."""
    rs = np.random.RandomState(seed)
    k = int(rs.randint(3, 7))
    c = rs.randint(1, 6, k - 1).tolist()
    w = (1000 + rs.randint(0, 9, k)).tolist()
    tau = rs.randint(1, 5, k).tolist()
    base = min(w)
    grid = int(sum(c) + max(w) - base)
    table = TreeTable(c, w, tau, budget=base + grid, grid=grid, base=base)
    for m in range(grid + 1):
        want = brute_force(c, w, tau, base + m)
        if want is None:
            assert not np.isfinite(table.time[m]), (m, table.time[m])
            continue
        assert table.time[m] == want[0], (m, table.time[m], want)
        assert tree_cost(c, w, tau, table.levels(m))[0] <= base + m
    coarse = TreeTable(c, w, tau, budget=base + grid, grid=grid)
    assert coarse.least() is None or coarse.least() * coarse.unit > base + table.least()
    with pytest.raises(ValueError, match="above a block's need"):
        TreeTable(c, w, tau, budget=base + grid, base=base + 1)
