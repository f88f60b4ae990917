"""The runner's lines about a plan: plain Chainer's peak beside the
plan's, and the saving measured."""
from __future__ import annotations

from typing import Any, Optional, Tuple

from ...core.graph import Graph
from ...core.replay import step_calls
from ...core.units import format_bytes


def _budget(plan: Any) -> str:
    """The plan's budget, with what a ``'60%'`` or ``'device'`` budget
    resolved to."""
    return plan.info.get("budget") or format_bytes(plan.budget_bytes)


def plain_peak(graph: Graph, plan: Any) -> Tuple[Optional[int], str]:
    """Plain Chainer's peak for ``graph``'s iteration (the replay's
    prediction: it counts what a first step does not have yet, the
    optimizer's state, the previous gradients and graph) and what was
    measured of it: plain Chainer's forward and backward on the captures
    at two small batches, scaled (a plan made from a recorded step, or a
    capture of the whole batch: the prediction only)."""
    vanilla = plan.info.get("vanilla_peak_bytes")
    measured = graph.step.plain_measured_bytes
    k = step_calls(graph)
    if k > 1:
        how = (f"{k} calls at once: each call's bytes above what they share (parameters, "
               f"their gradients, optimizer state) counted {k} times")
        return (int(vanilla) if vanilla else None), how
    if measured is None:
        return (int(vanilla) if vanilla else None), "predicted"
    at = graph.step.plain_measured_at
    if not at:
        return (int(vanilla) if vanilla else int(measured)), "predicted"
    how = (f"predicted; its forward and backward measured at batch {at[0]} and {at[1]}, "
           f"scaled: {format_bytes(measured)}")
    return (int(vanilla) if vanilla else int(measured)), how


def describe_step(graph: Graph, plan: Any, planning_time_s: float, measured: int,
                  corrected: bool = False) -> str:
    """One line on a plan once a step has run on it (``measured``: that
    step's peak): plain Chainer's peak, the plan's predicted and measured
    peaks, and the saving measured."""
    name = graph.meta.get("model", "model")
    k = step_calls(graph)
    head = (f"{'re' if corrected else ''}planned {name} ({graph.n} functions, batch "
            f"{graph.batch_size}{f', {k} calls per step' if k > 1 else ''})")
    plain, how = plain_peak(graph, plan)
    if k > 1:  # (a bound, not a prediction: no saving said against it)
        saving = (f"; plain Chainer's step at most {format_bytes(plain)} ({how})"
                  if plain else "")
    else:
        saving = (f"; {abs(100 * (1 - measured / plain)):.0f}% "
                  f"{'less' if measured <= plain else 'more'} than plain Chainer's "
                  f"{format_bytes(plain)} ({how})" if plain else "")
    what = (f"recomputes {100 * (plan.overhead_fraction or 0):.0f}% of a forward in "
            f"{plan.n_blocks} blocks" if plan.recompute else "nothing recomputed (plain "
            "backprop fits)")
    return (f"{head}: peak {format_bytes(measured)} measured, "
            f"{format_bytes(plan.predicted_peak_bytes)} predicted, budget "
            f"{_budget(plan)}{saving}; {what} [planned in "
            f"{planning_time_s:.2f} s]")


def describe_plan(graph: Graph, plan: Any, planning_time_s: float) -> str:
    """One line on a plan: what it saves and what it costs."""
    name = graph.meta.get("model", "model")
    head = f"planned {name} ({graph.n} functions, batch {graph.batch_size})"
    if not plan.recompute:
        return (f"{head}: plain backprop fits the budget {_budget(plan)} "
                f"(predicted peak {format_bytes(plan.predicted_peak_bytes)}); nothing recomputed "
                f"[{planning_time_s:.2f} s]")
    vanilla = plan.info.get("vanilla_peak_bytes")
    saving = (f", plain Chainer {format_bytes(vanilla)} "
              f"(-{100 * (1 - plan.predicted_peak_bytes / vanilla):.0f}%)" if vanilla else "")
    scope = plan.info.get("memory_scope", "activations")
    return (f"{head}: predicted peak {format_bytes(plan.predicted_peak_bytes)} ({scope}) for "
            f"budget {_budget(plan)}{saving}; recomputes "
            f"{100 * (plan.overhead_fraction or 0):.0f}% of a forward in {plan.n_blocks} blocks "
            f"[{planning_time_s:.2f} s]")
