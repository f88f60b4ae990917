"""The entry point of the solvers: :func:`solve` a graph for a budget.

Pure core: numpy only.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from .budget_spec import parse_budget
from .errors import BudgetError, InfeasibleBudgetError
from .graph import Graph
from .plan import Plan
from .memory_model import MemoryModel
from .search import least_feasible_budget, vanilla_bytes
from .solvers import REGISTRY, check_solver
from .units import format_bytes, format_bytes_up

__all__ = ["solve"]


def _size(nbytes: Optional[float], up: bool = False) -> str:
    """A size in binary units (as every size the package prints)."""
    if nbytes is None:
        return "n/a"
    return format_bytes_up(nbytes) if up else format_bytes(nbytes)


def _budget_bytes(graph: Graph, budget: Any, solver: str, strategy: str,
                  model: Optional[MemoryModel]) -> int:
    """``budget`` in bytes under the per-block model: ``'least'`` is the
    least feasible budget, ``'60%'`` that share of plain backprop's."""
    b = parse_budget(budget)
    if b.is_least:
        return int(least_feasible_budget(graph, solver=solver, strategy=strategy, model=model))
    if b.kind == "share" and b.bytes is None:
        b = b.of_plain(vanilla_bytes(graph, model))
    if b.bytes is None:
        raise BudgetError("budget 'device' means the memory of the model's device, which a "
                          "graph alone does not know: use it with apply(), Recompute or the "
                          "command line, or give a size such as '8G'")
    return int(b.bytes)


def solve(graph: Graph, budget: Union[str, int, float, None] = None, solver: str = "auto",
          strategy: str = "tc", *, raise_infeasible: bool = True,
          model: Optional[MemoryModel] = None, **kw: Any) -> Plan:
    """Find a recomputation plan for ``graph`` within ``budget``.

    Args:
        graph: the computational graph.
        budget: ``'2G'``, ``'1.5GB'``, a number of bytes, ``'least'`` (the
            least feasible), ``'60%'`` (of plain backprop's figure; see
            :func:`~chainer_recompute.core.budget_spec.parse_budget`), or
            ``None`` (no limit; tc then minimises overhead outright).
        solver: one of ``sorted(REGISTRY)``; ``'auto'`` (the default): the
            hierarchical DP on graphs of at least 1,000 nodes with repeated
            segments, the approximate DP on the others.
        strategy: ``'tc'`` (time-centric: least overhead) or ``'mc'``
            (memory-centric: most overhead, coarsest blocks).
        raise_infeasible: when False an infeasible budget gives a Plan with
            ``feasible=False`` instead of an exception.
        model: the memory model the budget is for
            (:class:`~chainer_recompute.core.memory_model.MemoryModel`);
            ``None``: the paper's.
        **kw: passed to the solver (``max_lower_sets``, ...).

    Raises:
        UnknownSolverError: unknown solver or strategy.
        BudgetError: a budget that cannot be parsed.
        InfeasibleBudgetError: nothing fits (the message gives the least
            feasible budget for this solver and the vanilla figure).

    >>> g = Graph.from_edges([4, 4, 4], [(0, 1), (1, 2)])
    >>> solve(g, 20, solver='exact').feasible
    True
    """
    check_solver(solver, strategy)
    budget_bytes = None if budget is None else _budget_bytes(graph, budget, solver, strategy,
                                                             model)
    plan = REGISTRY[solver](graph, budget_bytes, strategy=strategy, model=model, **kw)
    if plan.feasible or not raise_infeasible:
        return plan
    least = least_feasible_budget(graph, solver=solver, strategy=strategy, model=model)
    vanilla = vanilla_bytes(graph, model)
    raise InfeasibleBudgetError(
        f"budget {_size(budget_bytes)} is below the least feasible {_size(least, up=True)} for "
        f"this graph with solver {solver!r} (vanilla backpropagation needs "
        f"{_size(vanilla, up=True)} "
        f"under the same "
        f"model); raise the budget, use solver='exact' if the graph allows it, or reduce the "
        f"batch size", budget_bytes=budget_bytes, least_feasible_bytes=least,
        vanilla_bytes=vanilla)
