"""Solvers: a registry and one entry point, :func:`solve`.

Every solver has the signature ``solve_<name>(graph, budget_bytes, *,
strategy='tc', ...) -> Plan``.

Pure core: numpy only.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Union

from ..errors import InfeasibleBudgetError, UnknownSolverError
from ..graph import Graph
from ..plan import Plan
from ..units import format_bytes, parse_bytes
from .approx_dp import solve_approx
from .chen import solve_chen, solve_chen_greedy, solve_none
from .exact_dp import solve_exact

logger = logging.getLogger(__name__)

__all__ = ["REGISTRY", "STRATEGIES", "check_solver", "solve", "solve_approx", "solve_chen",
           "solve_chen_greedy", "solve_exact", "solve_none"]

SolverFn = Callable[..., Plan]

REGISTRY: Dict[str, SolverFn] = {
    "approx": solve_approx,
    "exact": solve_exact,
    "chen": solve_chen,
    "chen-greedy": solve_chen_greedy,
    "none": solve_none,
}

STRATEGIES = ("tc", "mc")


def _gb(nbytes: Optional[float]) -> str:
    return "n/a" if nbytes is None else format_bytes(nbytes, binary=False)


def check_solver(solver: str, strategy: str = "tc") -> None:
    """Raise :class:`UnknownSolverError` for an unknown solver or strategy,
    listing the known ones."""
    if solver not in REGISTRY:
        raise UnknownSolverError(f"unknown solver {solver!r}; known solvers: {sorted(REGISTRY)}")
    if strategy not in STRATEGIES:
        raise UnknownSolverError(f"unknown strategy {strategy!r}; known strategies: "
                                 f"{list(STRATEGIES)} (solvers: {sorted(REGISTRY)})")


def solve(graph: Graph, budget: Union[str, int, float, None] = None, solver: str = "approx",
          strategy: str = "tc", *, raise_infeasible: bool = True, **kw: Any) -> Plan:
    """Find a recomputation plan for ``graph`` within ``budget``.

    Args:
        graph: the computational graph.
        budget: ``'2G'``, ``'1.5GB'``, a number of bytes, or ``None`` (no
            limit; tc then minimises overhead outright).
        solver: one of ``sorted(REGISTRY)``.
        strategy: ``'tc'`` (time-centric: least overhead) or ``'mc'``
            (memory-centric: most overhead, coarsest blocks).
        raise_infeasible: when False an infeasible budget gives a Plan with
            ``feasible=False`` instead of an exception.
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
    budget_bytes = None if budget is None else parse_bytes(budget)
    plan = REGISTRY[solver](graph, budget_bytes, strategy=strategy, **kw)
    if plan.feasible or not raise_infeasible:
        return plan
    from ..search import least_feasible_budget
    least = least_feasible_budget(graph, solver=solver, strategy=strategy)
    vanilla = 2 * graph.activation_bytes
    raise InfeasibleBudgetError(
        f"budget {_gb(budget_bytes)} is below the least feasible {_gb(least)} for this graph "
        f"with solver {solver!r} (vanilla backpropagation needs {_gb(vanilla)} under the same "
        f"model); raise the budget, use solver='exact' if the graph allows it, or reduce the "
        f"batch size", budget_bytes=budget_bytes, least_feasible_bytes=least,
        vanilla_bytes=vanilla)
