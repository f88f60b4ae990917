"""Searches over budgets and batch sizes (docs/paper.md §6).

Pure core: numpy only.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Union

import numpy as np

from .errors import GraphError
from .graph import Graph
from .lower_sets import DEFAULT_MAX_LOWER_SETS, LowerSetFamily
from .memory_model import MemoryModel
from .solvers import REGISTRY, check_solver, resolve_solver, solve_chen, solve_chen_greedy
from .solvers._dp import run_dp
from .units import parse_bytes

logger = logging.getLogger(__name__)

__all__ = ["bisect_least", "largest_batch_size", "least_feasible_budget", "scale_bytes",
           "scale_model", "vanilla_bytes"]


def bisect_least(feasible: Callable[[int], bool], lo: int, hi: int, rel_tol: float = 0.0) -> int:
    """The least integer ``x`` in ``(lo, hi]`` with ``feasible(x)``, given
    ``feasible`` monotone, ``feasible(lo)`` False and ``feasible(hi)`` True;
    stops when ``hi - lo <= max(1, rel_tol * hi)`` and returns ``hi``.

    >>> bisect_least(lambda x: x >= 37, 0, 100)
    37
    """
    while hi - lo > max(1, int(rel_tol * hi)):
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def least_feasible_budget(graph: Graph, solver: str = "auto", strategy: str = "tc", *,
                          rel_tol: float = 0.0,
                          max_lower_sets: Optional[int] = DEFAULT_MAX_LOWER_SETS,
                          model: Optional[MemoryModel] = None,
                          engine: Optional[str] = None,
                          family: Optional[LowerSetFamily] = None) -> int:
    """The least budget (bytes, under ``model``, the paper's memory model
    by default) for which ``solver`` finds a plan.

    This is the ``activations`` scope's figure (the paper's model: the
    activations the plan keeps, no parameters, gradients, optimizer state
    or temporaries). ``apply()``'s default ``total`` scope refuses a budget
    this low; its least feasible budget is
    :func:`~chainer_recompute.core.budget.least_total_budget` (what
    ``plan_for_budget(graph, 'least')`` and ``apply(budget='least')`` use).

    For the DPs this is a bisection on the budget over a feasibility-only
    DP (one state per lower set: the least retained memory), exact to the
    byte with ``rel_tol=0`` (the default; ~35 cheap DP runs). It starts
    from ``constant + max_v (block_v + transient_v) - 1``, which no
    strategy fits (some block holds v), and from the single block V,
    ``constant + block(V) + max_v transient_v``, which always fits.
    Feasibility does not depend on the strategy. Chen's sqrt(n) ignores the
    budget, so its figure is its plan's predicted peak; for Chen's greedy
    it is the least predicted peak over the ``b`` it tries; for ``none`` it
    is the single block's (the paper's: 2·M(V)); for ``hier`` a bisection
    over its chain DP; ``auto`` is the solver it stands for
    (:func:`~chainer_recompute.core.solvers.resolve_solver`). ``engine`` selects the
    DP's kernels (see :func:`~chainer_recompute.core.solvers._dp.run_dp`);
    ``family``: the solver's lower sets under ``model``, where the caller
    has them (``exact`` and ``approx``).

    The figure depends on the graph's sizes and structure only, not on its
    costs (two recordings of one model differ in their measured times):
    feasibility does not, and the hierarchical DP's least is over the
    options it finds whatever the costs.

    >>> g = Graph.from_edges([1, 1, 1, 1], [(0, 1), (1, 2), (2, 3)])
    >>> least_feasible_budget(g, 'exact')
    5
    """
    check_solver(solver, strategy)
    solver = resolve_solver(solver, graph, model)
    if solver == "hier":
        from .solvers.hier_dp import hier_problem
        prob = hier_problem(graph, model)
        if prob.ok:
            return prob.least_budget()
        solver = "approx"  # solve_hier falls back to the approximate DP
    if model is None:
        model = MemoryModel.paper(graph)
    if solver == "none":
        return vanilla_bytes(graph, model)
    if solver == "chen":
        return int(solve_chen(graph, None, strategy=strategy, model=model).predicted_peak_bytes)
    if solver == "chen-greedy":
        return int(solve_chen_greedy(graph, None, strategy=strategy,
                                     model=model).predicted_peak_bytes)
    if family is not None:
        fam = family if family.model is model else family.with_model(model)
    else:
        fam = (LowerSetFamily.all(graph, max_lower_sets, model) if solver == "exact"
               else LowerSetFamily.ancestor_closures(graph, model))

    def ok(b: int) -> bool:
        return run_dp(fam, b, "feasible", engine=engine).chain is not None

    hi = vanilla_bytes(graph, model)
    lo = model.constant_bytes + int((model.block_bytes + model.transient_bytes).max()) - 1
    if hi <= lo + 1:
        return hi
    return bisect_least(ok, lo, hi, rel_tol)


def vanilla_bytes(graph: Graph, model: Optional[MemoryModel] = None) -> int:
    """The single block V's peak under ``model`` (the paper's: 2·M(V)):
    what plain backpropagation needs, and a budget every DP meets.

    >>> vanilla_bytes(Graph.from_edges([1, 2], [(0, 1)]))
    6
    """
    if model is None:
        return 2 * graph.activation_bytes
    return int(model.constant_bytes + model.block_bytes.sum() + model.transient_bytes.max())


def scale_bytes(graph: Graph, factor: float) -> Graph:
    """The graph with every non-parameter array (and held array) scaled by
    ``factor`` (rounded to whole bytes): linear batch scaling for graphs
    that do not record shapes, such as the authors' files.

    >>> scale_bytes(Graph.from_edges([4, 8], [(0, 1)]), 2.5).node_bytes.tolist()
    [10, 20]
    """
    if not factor > 0:
        raise GraphError(f"scale factor must be positive, got {factor}")
    arrays = [a if a.kind == "param" else
              dataclasses.replace(a, nbytes=int(round(a.nbytes * factor))) for a in graph.arrays]
    nodes = [dataclasses.replace(n, held=tuple(dataclasses.replace(
        h, nbytes=int(round(h.nbytes * factor))) for h in n.held)) for n in graph.nodes]
    return graph.replace(arrays=arrays, nodes=nodes)


def scale_model(model: MemoryModel, factor: float) -> MemoryModel:
    """``model`` for a batch ``factor`` times larger: every per-node weight
    scaled (rounded to whole bytes), the constant (parameters, their
    gradients, optimizer state) unchanged.

    >>> from chainer_recompute.core.graph import Graph
    >>> scale_model(MemoryModel.paper(Graph.from_edges([4, 8], [(0, 1)])), 2).block_bytes.tolist()
    [16, 32]
    """
    def s(w: np.ndarray) -> np.ndarray:
        return np.round(w * float(factor)).astype(np.int64)

    return dataclasses.replace(model, block_bytes=s(model.block_bytes),
                               keep_bytes=s(model.keep_bytes), above_bytes=s(model.above_bytes),
                               beside_bytes=s(model.beside_bytes),
                               transient_bytes=s(model.transient_bytes))


def largest_batch_size(graph: Graph, budget: Union[str, int, float], solver: str = "auto",
                       strategy: str = "tc", *, batch_size: Optional[int] = None,
                       max_batch_size: int = 1 << 20,
                       model: Union[MemoryModel, Callable[[Graph], MemoryModel], None] = None
                       ) -> int:
    """The largest batch size whose graph (activations scaled linearly from
    the capture batch) still has a feasible plan within ``budget``; 0 when
    not even batch 1 fits.

    Args:
        graph: the graph, captured at ``batch_size`` (default
            ``graph.batch_size``).
        budget: bytes or a string such as ``'8G'``.
        solver, strategy: as in :func:`~chainer_recompute.core.planner.solve`.
        batch_size: the batch the graph was captured at, for graphs that
            do not record it (the authors' files: 32, or 8 for U-Net).
        max_batch_size: search cap.
        model: the memory model: ``None`` (the paper's, on each scaled
            graph), a :class:`MemoryModel` of ``graph`` (scaled with
            :func:`scale_model`), or a function from a scaled graph to its
            model.

    >>> g = Graph.from_edges([4, 4], [(0, 1)])
    >>> largest_batch_size(g, 32, 'exact', batch_size=1)
    2
    """
    base = batch_size if batch_size is not None else graph.batch_size
    if base is None:
        raise GraphError("the graph does not record its batch size; pass batch_size=")
    budget_bytes = parse_bytes(budget)

    def ok(b: int) -> bool:
        g = graph.scale_batch(b) if (batch_size is None and graph.batch_size) else \
            scale_bytes(graph, b / base)
        if model is None or callable(model) and not isinstance(model, MemoryModel):
            m = None if model is None else model(g)
        else:
            m = scale_model(model, b / base)
        return REGISTRY[solver](g, budget_bytes, strategy=strategy, model=m).feasible

    if not ok(1):
        return 0
    lo = 1
    hi = 2
    while hi <= max_batch_size and ok(hi):
        lo, hi = hi, hi * 2
    if hi > max_batch_size:
        return lo
    return bisect_least(lambda b: not ok(b), lo, hi) - 1
