"""Solvers: a registry of ``solve_<name>`` functions (the entry point,
:func:`chainer_recompute.core.planner.solve`, raises on an infeasible budget).

Every solver has the signature ``solve_<name>(graph, budget_bytes, *,
strategy='tc', ...) -> Plan``.

Pure core: numpy only.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict

from ..errors import UnknownSolverError
from ..plan import Plan
from .approx_dp import solve_approx
from .chen import solve_chen, solve_chen_greedy, solve_none
from .exact_dp import solve_exact
from .hier_dp import solve_auto, solve_hier

logger = logging.getLogger(__name__)

__all__ = ["REGISTRY", "STRATEGIES", "check_solver", "resolve_solver", "solve_approx",
           "solve_auto", "solve_chen", "solve_chen_greedy", "solve_exact", "solve_hier",
           "solve_none"]

SolverFn = Callable[..., Plan]

REGISTRY: Dict[str, SolverFn] = {
    "auto": solve_auto,
    "approx": solve_approx,
    "hier": solve_hier,
    "exact": solve_exact,
    "chen": solve_chen,
    "chen-greedy": solve_chen_greedy,
    "none": solve_none,
}

STRATEGIES = ("tc", "mc")


def check_solver(solver: str, strategy: str = "tc") -> None:
    """Raise :class:`UnknownSolverError` for an unknown solver or strategy,
    listing the known ones."""
    if solver not in REGISTRY:
        raise UnknownSolverError(f"unknown solver {solver!r}; known solvers: {sorted(REGISTRY)}")
    if strategy not in STRATEGIES:
        raise UnknownSolverError(f"unknown strategy {strategy!r}; known strategies: "
                                 f"{list(STRATEGIES)} (solvers: {sorted(REGISTRY)})")


def resolve_solver(solver: str, graph, model=None) -> str:
    """The solver ``solver='auto'`` stands for on ``graph`` (``'hier'`` or
    ``'approx'``, see :func:`~.hier_dp.use_hier`); any other name as it is."""
    if solver != "auto":
        return solver
    from .hier_dp import use_hier
    return "hier" if use_hier(graph, model) else "approx"
