"""The approximate DP over the ancestor-closure family (docs/paper.md §5).

Pure core: numpy only.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from ..graph import Graph
from ..lower_sets import LowerSetFamily
from ..memory_model import MemoryModel
from ..plan import Plan
from ._dp import plan_from_dp

logger = logging.getLogger(__name__)

__all__ = ["solve_approx"]


def solve_approx(graph: Graph, budget_bytes: Optional[int], *, strategy: str = "tc",
                 family: Optional[LowerSetFamily] = None, method: str = "auto",
                 model: Optional[MemoryModel] = None, engine: Optional[str] = None) -> Plan:
    """Approximate DP: the exact DP's recurrence restricted to ∅, V and the
    ancestor closures L_v = {v} ∪ ancestors(v) (|V|+2 sets at most),
    ordered so that subsets come before supersets (by size, then memory).

    DP table: ``opt[L]`` is the Pareto frontier of (retained time, retained
    memory) over chains of family members ending at ``L``; every inclusion
    pair of the family is tried.

    Args:
        graph: the graph.
        budget_bytes: the memory budget under the memory model, or ``None``.
        strategy: ``'tc'`` or ``'mc'``.
        family: a precomputed :meth:`LowerSetFamily.ancestor_closures`.
        method: the DP table's form, ``auto``, ``dense`` or ``sparse``
            (see :func:`run_dp`).
        model: the memory model (:class:`MemoryModel`); ``None``: the
            family's model when a family is given, else the paper's.
        engine: ``numba`` (compiled kernels, the ``fast`` extra), ``numpy``
            or ``auto``/``None`` (see :func:`run_dp`); all give the same
            optimum.

    Returns:
        A :class:`Plan`; ``feasible`` is False when nothing fits.

    References:
        Kusumoto et al., "A Graph Theoretic Framework of Recomputation
        Algorithms for Memory-Efficient Backpropagation", NeurIPS 2019,
        §5 (approximate DP).

    >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)])
    >>> solve_approx(g, 6).n_blocks
    3
    """
    t0 = time.perf_counter()
    fam = (LowerSetFamily.ancestor_closures(graph, model) if family is None
           else family if model is None else family.with_model(model))
    return plan_from_dp(graph, fam, budget_bytes, strategy, method, "approx", t0, engine)
