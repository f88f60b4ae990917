"""Chain solvers (core/solvers/chain.py): Gruslys et al.'s BPTT tables and
revolve, against brute force over all policies; schedules; bad input."""
import dataclasses
import functools

import numpy as np
import pytest

from chainer_recompute.core.errors import BudgetError, GraphError, RecomputeError, UnknownSolverError
from chainer_recompute.core.solvers import chain as ch


# ------------------------------------------------------------ brute force
def _outcomes(length: int, options: str, alpha: int):
    """Every (forward steps, slots used besides the start state) that some
    policy reaches on ``length`` steps, enumerating all policy trees:
    a leaf (one step), the quadratic policy, a hidden-state split at any
    ``y`` (options 'h') and an internal-state split at any ``y``
    (options 'i')."""

    @functools.lru_cache(maxsize=None)
    def rec(n: int) -> frozenset:
        if n == 0:
            return frozenset({(0, 0)})
        if n == 1:
            return frozenset({(1, 0)})
        out = {(n * (n + 1) // 2, 0)}
        if "h" in options:
            for y in range(1, n):
                for cr, ur in rec(n - y):
                    for cl, ul in rec(y):
                        out.add((y + cr + cl, max(1 + ur, ul)))
        if "i" in options:
            for y in range(1, n + 1):
                for cl, ul in rec(y - 1):
                    if y == n:  # the kept step is backpropagated at once: a leaf
                        out.add((n + cl, ul))
                        continue
                    for cr, ur in rec(n - y):  # the right part starts at the kept output
                        out.add((y + cr + cl, max(alpha + ur, ul)))
        return frozenset(out)

    return rec(length)


def _brute_cost(length: int, m: int, options: str, alpha: int) -> float:
    costs = [c for c, u in _outcomes(length, options, alpha) if 1 + u <= m]
    return min(costs) if costs else np.inf


@pytest.mark.parametrize("alpha", [1, 2, 3])
def test_tables_equal_brute_force_over_all_policies(alpha):
    T, M = 9, 3 * alpha + 2
    H, _ = ch.bptt_hsm_table(T, M)
    I = ch.bptt_ism_table(T, M, alpha)
    S = ch.bptt_msm_table(T, M, alpha)
    for t in range(1, T + 1):
        for m in range(1, M + 1):
            assert H[t, m] == _brute_cost(t, m, "h", alpha), ("hsm", t, m)
            assert I[t, m] == _brute_cost(t, m, "i", alpha), ("ism", t, m)
            assert S[t, m] == _brute_cost(t, m, "hi", alpha), ("msm", t, m)


def test_msm_dp_equals_plain_dp_on_larger_tables():
    """The vectorised tables against the plain O(t^2 m) recursions."""
    T, alpha = 40, 3
    M = alpha * T
    C = {k: np.full((T + 1, M + 1), np.inf) for k in ("h", "i", "s")}
    for c in C.values():
        c[0, :] = 0
    for m in range(1, M + 1):
        for t in range(1, T + 1):
            quad = t * (t + 1) / 2
            for k, c in C.items():
                if t == 1:
                    c[1, m] = 1
                    continue
                best = quad if (m == 1 or (k == "i" and m < alpha)) else np.inf
                if k in "hs" and m >= 2:
                    y = np.arange(1, t)
                    best = min(best, (y + c[t - y, m - 1] + c[y, m]).min())
                if k in "is" and m >= alpha:
                    y = np.arange(1, t + 1)
                    best = min(best, (y + c[t - y, m - alpha] + c[y - 1, m]).min())
                c[t, m] = best
    assert np.array_equal(ch.bptt_hsm_table(T, M)[0], C["h"])
    assert np.array_equal(ch.bptt_ism_table(T, M, alpha), C["i"])
    assert np.array_equal(ch.bptt_msm_table(T, M, alpha), C["s"])


def test_hsm_equals_revolve_closed_form():
    C, _ = ch.bptt_hsm_table(200, 10)
    for t in range(1, 201):
        for m in range(1, 11):
            assert C[t, m] - t == ch.revolve_min_forward_steps(t, m), (t, m)
            assert ch.policy_cost("revolve", t, m) == C[t, m], (t, m)


def test_ism_alpha_one_with_enough_slots_costs_t():
    for t in range(1, 80):
        for m in (t, t + 1, 2 * t):
            assert ch.policy_cost("ism", t, min(m, ch.max_useful_slots("ism", t, 1)), 1) == t
    I = ch.bptt_ism_table(60, 120, alpha=1)
    assert all(I[t, m] == t for t in range(1, 61) for m in range(t, 121))


@pytest.mark.parametrize("policy", ch.POLICIES)
def test_schedules_cost_what_the_table_says_within_m_slots(policy):
    alpha = 3
    for t in range(1, 30):
        for m in range(1, 25):
            try:
                ch.check_chain(policy, t, m, alpha)
            except RecomputeError:
                continue
            ops = list(ch.schedule(policy, t, m, alpha))
            cost, peak = ch.simulate_slots(iter(ops), alpha)
            assert cost == ch.policy_cost(policy, t, m, alpha), (t, m)
            assert peak <= m, (t, m, peak)
            # the forward pass (up to the first backward) runs each step once, in order
            steps = []
            for op in ops:
                if op[0] == "advance":
                    steps += range(op[1], op[2])
                elif op[0] in ("keep", "leaf"):
                    steps.append(op[1])
                if op[0] in ("leaf", "backward"):
                    break
            assert steps == list(range(t)), (t, m)
            # every step is backpropagated once, last first
            back = [op[1] for op in ops if op[0] in ("leaf", "backward")]
            assert back == list(range(t - 1, -1, -1))


def test_tables_are_cached_and_grown():
    ch.clear_table_cache()
    big = ch.chain_table("msm", 60, 40, alpha=4)
    assert ch.chain_table("msm", 30, 20, alpha=4) is big
    assert ch.chain_table("msm", 60, 40, alpha=5) is not big  # another alpha
    bigger = ch.chain_table("msm", 80, 40, alpha=4)
    assert bigger.t_max == 80 and bigger.m_max >= 40
    assert np.array_equal(bigger.cost[:61, :41], big.cost[:61, :41])


def test_byte_simulation_orders_policies_by_memory():
    sizes = ch.ByteSizes(state=1000, rng=100, internal=8000, retained_input=1000, grad=1000,
                         param_grads=50_000, advance_peak=3000, keep_peak=12_000,
                         backward_peak=20_000)
    t = 100
    plain = ch.simulate_bytes(ch.schedule("msm", t, ch.max_useful_slots("msm", t, sizes.alpha),
                                          sizes.alpha), sizes, t)
    tight = ch.simulate_bytes(ch.schedule("hsm", t, 4), sizes, t)
    assert tight < plain / 5
    peaks = [ch.simulate_bytes(ch.schedule("hsm", t, m), sizes, t) for m in (2, 5, 10, 20)]
    assert peaks == sorted(peaks)


def test_byte_simulation_event_by_event():
    """Plain BPTT's schedule on two steps, by hand: each array counted once
    however many holders it has (the model's outputs inside a kept graph,
    the state a graph makes and the next one reads)."""
    sizes = ch.ByteSizes(state=100, rng=10, internal=1000, retained_input=100, grad=100,
                         param_grads=5000, advance_peak=150, keep_peak=1200, backward_peak=2000,
                         first_backward_peak=7000, outputs=50, outputs_shared=50)
    trace = []
    peak = ch.simulate_bytes(ch.plain_schedule(2), sizes, 2, trace=trace)
    # keep 0: internal + state 1; keep 1: + internal + state 2; backward 1: the
    # backward pass's RNG state, parameter gradients, the state's gradient, its
    # internal state goes while the last outputs stay (they are put back at the
    # end); backward 0; the state's gradient goes
    assert [live for _, live, _ in trace] == [1100, 2200, 6360, 5260, 5160]
    assert peak == 2210 + 7000
    # outputs the graph does not share are held besides it
    apart = ch.simulate_bytes(ch.plain_schedule(2), dataclasses.replace(sizes, outputs_shared=0),
                              2)
    assert apart == peak + 50
    # gradients live at the call and cleared before the backward: gone at its start
    call = ch.CallBytes(grads_before=5000, update_transient=3000)
    trace = []
    assert ch.simulate_bytes(ch.plain_schedule(2), sizes, 2, trace=trace, call=call) == peak - 5000
    assert trace[-1][1] == 5160 - 5000
    # not cleared: the backward accumulates into them
    kept = dataclasses.replace(call, grads_cleared=False)
    assert ch.simulate_bytes(ch.plain_schedule(2), sizes, 2, call=kept) == 2210 + 2000


def _toy_step():
    """embed(W, x) -> e; cell(s, e) -> h (the next state); loss(h) -> l."""
    F = ch.StepFunction
    return ch.StepGraph(
        functions=(F("embed", (0, 1), (2,), (40, 0), (-1, -1), 40),
                   F("cell", (3, 2), (4,), (10, 20), (-1, -1), 30),
                   F("loss", (4,), (5,), (10,), (-1,), 10)),
        kinds=("param", "leaf", "inner", "state", "inner", "inner"),
        state_index=(-1, -1, -1, 0, -1, -1), creator=(-1, -1, 0, -1, 1, 2),
        out_states=(4,), loss=5)


def test_plain_replay_follows_chainers_backward_order():
    """The embedding does not depend on the state: its rank is the same at
    every step, so Chainer runs it last and the gradient of its output
    waits, one per step (20 bytes each here)."""
    g = _toy_step()
    # by hand, t=2: loss 1, loss 0, cell 1 (h0's gradient summed), cell 0,
    # embed 1 (W's gradient made), embed 0 (summed): 40 live + 20 waiting + 40
    assert ch.replay_plain(g, 0, 2) == 100
    assert ch.replay_plain(g, 0, 20) - ch.replay_plain(g, 0, 10) == 10 * 20
    assert ch.replay_plain(g, 1000, 2) == 1100
    sizes = ch.ByteSizes(state=10, rng=1, internal=30, retained_input=10, grad=10,
                         param_grads=40, advance_peak=20, keep_peak=40, backward_peak=60)
    # the runner's order (each graph freed after its backward) predicts less
    assert ch.plain_peak_bytes(sizes, 50, g) > ch.plain_peak_bytes(sizes, 50, None)


def test_table_cache_bytes():
    ch.clear_table_cache()
    assert ch.table_cache_bytes() == 0
    tab = ch.chain_table("hsm", 50, 10)
    assert ch.table_cache_bytes() == tab.nbytes > 0
    ch.clear_table_cache()


# ------------------------------------------------------------ bad input
@pytest.mark.parametrize("args, error, words", [
    (("hsm", 0, 3), GraphError, "t=0"),
    (("hsm", 10, 0), BudgetError, "m=0"),
    (("hsm", 10, 11), BudgetError, "at most 10"),
    (("revolve", 5, 6), BudgetError, "at most 5"),
    (("ism", 10, 3, 4), BudgetError, "alpha=4"),
    (("msm", 10, 3, 0), BudgetError, "alpha=0"),
    (("fast", 10, 3), UnknownSolverError, "hsm"),
])
def test_bad_input_gives_clear_errors(args, error, words):
    with pytest.raises(error, match=words):
        ch.check_chain(*args)
    if args[1] < 1 or args[2] < 1 or error is UnknownSolverError:
        with pytest.raises(error):  # the schedule refuses it too, before any work
            next(ch.schedule(*args))


def test_table_at_ten_thousand_steps():
    """The tables at t = 10,000 are small and agree with revolve's count
    (its build time is not asserted: a timed assertion fails on a loaded machine)."""
    ch.clear_table_cache()
    tab = ch.chain_table("hsm", 10_000, 100)
    ism = ch.chain_table("ism", 10_000, 100, alpha=8)
    assert tab.nbytes < 20e6 and ism.nbytes < 20e6
    assert tab.cost[10_000, 100] - 10_000 == ch.revolve_min_forward_steps(10_000, 100)
    ch.clear_table_cache()


def test_revolve_cost_needs_no_deep_recursion():
    """revolve's cost with slots to spare (m ~ t, the recursion as deep as
    t) under a small recursion limit: every step stored once, ``2t - 1``
    forward steps as HSM's table says for t <= 200."""
    import sys
    from chainer_recompute.core.solvers.chain import policy_cost
    assert policy_cost("revolve", 150, 150) == policy_cost("hsm", 150, 150) == 299
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(150)
    try:
        assert policy_cost("revolve", 5000, 5000) == 9999
        assert 2 * 3000 - 1 < policy_cost("revolve", 3000, 1000) < 3 * 3000
    finally:
        sys.setrecursionlimit(limit)
