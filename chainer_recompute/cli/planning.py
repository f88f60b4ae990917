"""The command's planning: plain backprop, the plan for the budget and the
least feasible one, in the total or the activations scope, and their
memory timelines, gathered into the report (:func:`plan_report`)."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, Optional, Tuple

from ..core.units import format_bytes, format_bytes_up

REPORT_VERSION = 1


def plan_report(graph: Any, budget: Any, *, solver: str = "auto", strategy: str = "tc",
                scope: str = "total", progress: Any = None,
                subject: str = "this graph", workspace: Any = None) -> Dict[str, Any]:
    """Plan ``graph`` for ``budget`` (as typed: a size, ``'least'``,
    ``'60%'`` of plain backprop's need; or a
    :class:`~chainer_recompute.core.budget_spec.Budget`, ``'device'``
    resolved) and gather what the report shows: plain backprop, the plan,
    the least feasible budget, and the memory timelines of both.

    Raises:
        InfeasibleBudgetError: the budget is below the least feasible one
            (the message states it, in binary units).
    """
    from ..progress import Progress
    from ..core.errors import InfeasibleBudgetError
    from ..core.execution import ExecutionPlan
    from ..core.replay import least_floor, replay
    progress = progress if progress is not None else Progress(enabled=False)
    from ..core.budget import resolve_budget
    spec = resolve_budget(graph, budget, scope)
    budget = spec.text
    least_wanted = spec.is_least
    budget_bytes = spec.bytes
    with progress.step("replaying plain backprop"):
        plain = replay(graph, None)
    if scope == "total":
        if workspace is not None:  # the convolutions' bound (--workspace)
            from ..core.workspace import bounded_graph, plan_with_workspace
            graph = (plan_with_workspace(graph, spec, "auto", solver=solver,
                                         strategy=strategy).graph if workspace == "auto"
                     else bounded_graph(graph, workspace))
        plan, least_plan, least_bytes, plain_peak, times, search = _plan_total(
            graph, budget_bytes, solver, strategy, progress)
    else:
        search = None
        plan, least_plan, least_bytes, plain_peak, times = _plan_activations(
            graph, budget_bytes, solver, strategy, progress)
    if plan is None:
        nested = (f" with nested recomputation (single-level: "
                  f"{format_bytes_up(least_plan.budget_bytes)})"
                  if least_plan is not None and least_plan.budget_bytes is not None
                  and least_bytes < least_plan.budget_bytes else "")
        raise InfeasibleBudgetError(
            f"budget {_resolved(spec)} is below the least feasible "
            f"{format_bytes_up(least_bytes)}{nested} for {subject} (solver {solver}, strategy "
            f"{strategy}, scope {scope}; plain backprop needs {format_bytes_up(plain_peak)}); "
            f"raise --budget to at least {_typed(least_bytes)}, or use --budget least",
            budget_bytes=budget_bytes, least_feasible_bytes=least_bytes,
            vanilla_bytes=plain_peak)

    def timeline(p: Any) -> Any:
        if p is None or not p.recompute or not p.lower_sets:
            return plain
        return replay(graph, ExecutionPlan.of(graph, p))

    with progress.step("replaying the plan"):
        planned = timeline(plan)

    def row(p: Any, solve_s: float, predicted: int, replayed: Any) -> Dict[str, Any]:
        d = _plan_dict(p)
        d.update(predicted_peak_bytes=int(predicted),
                 saving_fraction=1.0 - predicted / plain_peak if plain_peak else 0.0,
                 overhead_fraction=float(p.overhead_fraction or 0.0) if p.recompute else 0.0,
                 n_blocks=p.n_blocks, solve_time_s=solve_s, n_dropped=len(p.dropped)
                 if p.recompute else 0, recomputed_nodes=replayed.recomputed,
                 replayed_peak_bytes=int(replayed.peak_bytes), peak_event=replayed.peak_event)
        return d

    plan_pred = planned.peak_bytes if scope == "total" else plan.predicted_peak_bytes
    report: Dict[str, Any] = {
        "schema": "chainer-recompute report", "version": REPORT_VERSION,
        "graph": {"nodes": graph.n, "edges": len(graph.edges), "batch_size": graph.batch_size,
                  "model": graph.meta.get("model"), "param_bytes": int(graph.param_bytes),
                  "cost_model": graph.cost_model, "iteration_s": _iteration_s(graph)},
        "budget": {"text": budget, "bytes": budget_bytes, "scope": scope, "solver": solver,
                   "strategy": strategy,
                   "resolved": _resolved(spec) if spec.kind in ("share", "device") else None},
        "plain": {"predicted_peak_bytes": int(plain_peak),
                  "replayed_peak_bytes": int(plain.peak_bytes), "peak_event": plain.peak_event},
        "plan": row(plan, times["plan"], plan_pred, planned),
        "least": None,
        "floor": dataclasses.asdict(least_floor(graph)) if scope == "total" else None,
        "timelines": {"plain": _timeline_dict(plain), "plan": _timeline_dict(planned)},
        "schedule": _schedule_dict(graph, plan),
    }
    if least_plan is not None:
        lp = timeline(least_plan) if least_plan is not plan else planned
        lpred = lp.peak_bytes if scope == "total" else least_plan.predicted_peak_bytes
        report["least"] = row(least_plan, times["least"], lpred, lp)
        report["least"]["budget_bytes"] = int(least_bytes)
    if least_wanted:
        report["budget"]["bytes"] = int(least_bytes)
    with progress.step("the trade-off between budget and recomputation"):
        report["tradeoff"] = (
            _tradeoff_total(search, plain_peak) if scope == "total" else
            _tradeoff_activations(graph, solver, strategy, plain_peak, least_bytes,
                                  [p for p in (least_plan, plan) if p is not None]))
    return report


def _iteration_s(graph: Any) -> Optional[float]:
    """Plain backprop's seconds per iteration as recorded (scaled with the
    graph), or None where a function's times are not known (or not
    measured: other cost models)."""
    if graph.cost_model != "measured":
        return None
    total = 0.0
    for n in graph.nodes:
        if n.forward_time_s is None or (n.has_backward and n.backward_time_s is None):
            return None
        total += n.forward_time_s + (n.backward_time_s or 0.0)
    return total


def _resolved(spec: Any) -> str:
    """What a budget came to (a share or ``'device'``: from what)."""
    return (spec.describe() if spec.kind in ("share", "device")
            else f"{spec.text} (= {format_bytes(spec.bytes)})")


def _plan_total(graph: Any, budget_bytes: Optional[int], solver: str, strategy: str,
                progress: Any) -> Tuple[Any, Any, int, int, Dict[str, float], Any]:
    """The least plan and the plan for ``budget_bytes`` from one
    :class:`~chainer_recompute.core.budget.BudgetSearch` (its plans are
    shared, and are the trade-off curve's: :func:`_tradeoff_total`)."""
    from ..core.budget import BudgetSearch, plan_for_budget
    from ..core.errors import InfeasibleBudgetError
    times: Dict[str, float] = {}
    search = None
    t0 = time.perf_counter()
    with progress.step(f"planning ({solver}/{strategy}): the least feasible budget"):
        if solver == "none":
            least = plan_for_budget(graph, "least", solver=solver, strategy=strategy)
        else:
            search = BudgetSearch(graph, solver, strategy)
            least = search.least_plan()
    times["least"] = time.perf_counter() - t0
    least_bytes = int(least.budget_bytes)
    plain_peak = int(least.info["vanilla_peak_bytes"])
    if budget_bytes is None or solver == "none":  # plain backprop: one plan for all budgets
        times["plan"] = times["least"]
        if budget_bytes is not None and budget_bytes < least_bytes:
            return None, least, least_bytes, plain_peak, times, search
        return least, least, least_bytes, plain_peak, times, search
    t0 = time.perf_counter()
    with progress.step(f"planning ({solver}/{strategy}) for {format_bytes(budget_bytes)}"):
        try:
            plan = search.fit(budget_bytes)
        except InfeasibleBudgetError as e:  # plain backprop's need, with the headroom;
            # the least feasible, nested when the search nests
            return None, least, int(e.least_feasible_bytes), int(e.vanilla_bytes), times, search
    times["plan"] = time.perf_counter() - t0
    return plan, least, least_bytes, plain_peak, times, search


def _plan_activations(graph: Any, budget_bytes: Optional[int], solver: str, strategy: str,
                      progress: Any) -> Tuple[Any, Any, int, int, Dict[str, float]]:
    from ..core.planner import solve
    from ..core.search import least_feasible_budget, vanilla_bytes
    times: Dict[str, float] = {}
    plain_peak = int(vanilla_bytes(graph, None))
    t0 = time.perf_counter()
    with progress.step(f"planning ({solver}/{strategy}): the least feasible budget"):
        least_bytes = int(least_feasible_budget(graph, solver=solver, strategy=strategy))
        least = solve(graph, least_bytes, solver=solver, strategy=strategy,
                      raise_infeasible=False)
    times["least"] = time.perf_counter() - t0
    if budget_bytes is None:
        times["plan"] = times["least"]
        return least, least, least_bytes, plain_peak, times
    if budget_bytes < least_bytes:
        return None, least, least_bytes, plain_peak, times
    t0 = time.perf_counter()
    with progress.step(f"planning ({solver}/{strategy}) for {format_bytes(budget_bytes)}"):
        plan = solve(graph, budget_bytes, solver=solver, strategy=strategy,
                     raise_infeasible=False)
    times["plan"] = time.perf_counter() - t0
    if not plan.feasible:
        return None, least, least_bytes, plain_peak, times
    return plan, least, least_bytes, plain_peak, times


#: The trade-off curve's extra plans: at most this many more DP budgets,
#: for at most this long (the plans the budget search made come free).
TRADEOFF_EXTRA_BUDGETS = 12
TRADEOFF_EXTRA_S = 5.0


def _tradeoff_total(search: Any, plain_peak: int) -> Dict[str, Any]:
    """The report's trade-off: the plans of ``search`` (plain backprop,
    the least budget's candidates, the plans tried for the budget) and a
    few more (:data:`TRADEOFF_EXTRA_BUDGETS`, :data:`TRADEOFF_EXTRA_S`),
    reduced to the least overhead each budget can have among them."""
    from ..core.budget import TradeoffPoint, least_for
    if search is None:  # --solver none: plain backprop only
        front = [TradeoffPoint(least_for(plain_peak), int(plain_peak), 0.0, 1, False)]
        tried = 1
    else:
        front, tried = search.tradeoff(TRADEOFF_EXTRA_BUDGETS, TRADEOFF_EXTRA_S)
    return _tradeoff_dict(front, tried, "total")


def _tradeoff_activations(graph: Any, solver: str, strategy: str, plain_peak: int,
                          least_bytes: int, plans: Any) -> Dict[str, Any]:
    """The same in the activations scope (the paper's model): the least
    plan, the plan, plain backprop, and this strategy's plans at a few
    budgets between the least and plain's (bounded in count and time)."""
    from ..core.budget import TradeoffPoint, pareto_front
    from ..core.planner import solve
    plans = list(plans)
    t0 = time.perf_counter()
    if solver != "none" and plain_peak > least_bytes > 0:
        k = TRADEOFF_EXTRA_BUDGETS
        for j in range(1, k):
            if time.perf_counter() - t0 > TRADEOFF_EXTRA_S:
                break
            b = int(least_bytes * (plain_peak / least_bytes) ** (j / k))
            p = solve(graph, b, solver=solver, strategy=strategy, raise_infeasible=False)
            if p.feasible:
                plans.append(p)
    points: Dict[Any, Any] = {}
    for p in plans:
        over = float(p.overhead_fraction or 0.0) if p.recompute else 0.0
        peak = int(p.predicted_peak_bytes) if p.recompute else int(plain_peak)
        q = TradeoffPoint(peak, peak, over, int(p.n_blocks) if p.recompute else 1,
                          bool(p.recompute))
        points[(q.peak_bytes, q.overhead_fraction, q.n_blocks)] = q
    plain = TradeoffPoint(int(plain_peak), int(plain_peak), 0.0, 1, False)
    points[(plain.peak_bytes, 0.0, 1)] = plain
    return _tradeoff_dict(pareto_front(list(points.values())), len(points), "activations")


def _tradeoff_dict(front: Any, tried: int, scope: str) -> Dict[str, Any]:
    return {"scope": scope, "tried": int(tried),
            "points": [{"budget_bytes": int(q.budget_bytes), "peak_bytes": int(q.peak_bytes),
                        "overhead_fraction": float(q.overhead_fraction),
                        "n_blocks": int(q.n_blocks), "recompute": bool(q.recompute)}
                       for q in front]}


def _plan_dict(plan: Any) -> Dict[str, Any]:
    d = {k: getattr(plan, k) for k in (
        "solver", "strategy", "budget_bytes", "feasible", "predicted_peak_bytes",
        "simulated_peak_bytes", "overhead", "overhead_fraction", "n_blocks", "solve_time_s",
        "cost_model", "recompute")}
    d["memory_scope"] = plan.info.get("memory_scope")
    d["nested"] = plan.info.get("nested") if plan.nested else None
    d["reordered"] = bool(plan.backward_order)
    return d


def _timeline_dict(result: Any) -> Dict[str, Any]:
    return {"events": list(result.events), "memory_bytes": [int(v) for v in result.memory_bytes],
            "peak_bytes": int(result.peak_bytes), "peak_event": result.peak_event,
            "constant_bytes": int(result.constant_bytes)}


def _schedule_dict(graph: Any, plan: Any) -> Dict[str, Any]:
    block = [0] * graph.n
    for b, nodes in enumerate(plan.blocks):
        for v in nodes:
            block[v] = b
    kept = plan.kept if plan.recompute else frozenset(range(graph.n))
    recomputed = sorted(v for v in range(graph.n) if v not in kept and graph.nodes[v].recomputable)
    gone = set(recomputed)
    return {"ops": [n.op for n in graph.nodes], "links": [n.link for n in graph.nodes],
            "node_bytes": [int(b) for b in graph.node_bytes],
            "block": block, "kept": [v for v in range(graph.n) if v not in gone],
            "recomputed": recomputed,
            "edges": [[int(u), int(v)] for u, v in graph.edges]}


def _typed(nbytes: float) -> str:
    """A size as one would type it back as a budget (rounded up)."""
    return format_bytes_up(nbytes).replace(" ", "")
