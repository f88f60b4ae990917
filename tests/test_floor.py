"""The physical floor (core.replay.physical_floor): no plan of any solver,
at any budget, replays below it, on real recorded models; on a graph
small enough to count by hand it is the figure counted."""
from __future__ import annotations

import numpy as np
import pytest

from chainer_recompute.core.budget import least_for, plan_for_budget
from chainer_recompute.core.execution import ExecutionPlan
from chainer_recompute.core.graph import ArrayInfo, Graph, Node
from chainer_recompute.core.replay import physical_floor, replay, state_constant_bytes
from chainer_recompute.models.small import SMALL_MODELS
from chainer_recompute.runtime.capture import capture


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)  # 5-8 s each
                                  if n in ("gru_lm", "lstm_lm", "nstep_lstm") else n
                                  for n in sorted(SMALL_MODELS)])
def test_no_plan_replays_below_the_floor(name):
    link, args = SMALL_MODELS[name](0)
    g = capture(link, *args, backward=True)
    floor = physical_floor(g)
    plain = replay(g).peak_bytes
    assert floor.state_bytes == state_constant_bytes(g)
    assert floor.state_bytes < floor.peak_bytes <= plain
    least = plan_for_budget(g, "least", solver="approx").budget_bytes
    most = least_for(plain)
    for solver in ("approx", "exact") if g.n <= 40 else ("approx",):
        for strategy in ("tc", "mc"):
            for frac in np.linspace(0.0, 1.0, 6):
                budget = int(least + frac * max(most - least, 0))
                plan = plan_for_budget(g, budget, solver=solver, strategy=strategy)
                ran = replay(g, ExecutionPlan(g, plan.lower_sets, frozenset(plan.kept)))
                assert min(ran.peak_bytes, plan.predicted_peak_bytes) >= floor.peak_bytes, \
                    (solver, strategy, budget, floor)


def test_floor_counted_by_hand():
    """x (input) -> f -> a -> g -> b (the loss's input): g's backward reads
    a (retained) and needs b's gradient and its temporary; with the
    parameter W (read by f), at f's backward every gradient exists."""
    arrays = [ArrayInfo(0, (10,), "float32", 40, "input", name="x"),
              ArrayInfo(1, (25,), "float32", 100, "param", name="W"),
              ArrayInfo(2, (50,), "float32", 200, "intermediate", producer=0),
              ArrayInfo(3, (75,), "float32", 300, "output", producer=1)]
    nodes = [Node(0, "f", (0, 1), (2,), retained_inputs=(0, 1), backward_transient_bytes=7),
             Node(1, "g", (2,), (3,), retained_inputs=(2,), backward_transient_bytes=1000)]
    g = Graph(arrays, nodes, backward_order=(1, 0))
    floor = physical_floor(g)
    state = state_constant_bytes(g)
    # g's backward: it reads a (200) and makes a's gradient (200), b's
    # gradient? no reader's backward ran before it (b is the loss's), its
    # temporary 1000
    assert (floor.event, floor.working_bytes, floor.held_grad_bytes) == ("backward 1 g", 1200, 200)
    assert floor.peak_bytes == state + 1400
    assert floor.peak_bytes <= replay(g).peak_bytes


def test_floor_holds_the_gradients_the_backward_order_holds():
    """x -> f -> a -> g -> b, and x -> k -> c, b + c -> s (the loss), with
    the backward order s, g, k, f (Chainer's ranks put f last, as they put
    an unrolled LSTM's input projections after every step's backward): a's
    gradient, made by g's backward, is held through k's until f's, whatever
    the plan; at k's backward the floor counts it with k's own output
    gradient and its temporary."""
    arrays = [ArrayInfo(0, (10,), "float32", 40, "input", name="x"),
              ArrayInfo(1, (250,), "float32", 1000, "intermediate", producer=0),
              ArrayInfo(2, (25,), "float32", 100, "intermediate", producer=1),
              ArrayInfo(3, (25,), "float32", 100, "intermediate", producer=2),
              ArrayInfo(4, (1,), "float32", 4, "output", producer=3)]
    nodes = [Node(0, "f", (0,), (1,), retained_inputs=(0,)),
             Node(1, "g", (1,), (2,)),
             Node(2, "k", (0,), (3,), retained_inputs=(0,), backward_transient_bytes=500),
             Node(3, "s", (2, 3), (4,))]
    g = Graph(arrays, nodes, backward_order=(3, 1, 2, 0))
    floor = physical_floor(g)
    state = state_constant_bytes(g)
    # k's backward: a's gradient (1000) and c's (100), its temporary 500;
    # it reads x, which is the caller's (in the state)
    assert (floor.event, floor.held_grad_bytes, floor.working_bytes) == ("backward 2 k", 1100, 500)
    assert floor.peak_bytes == state + 1600
    assert floor.peak_bytes <= replay(g).peak_bytes
