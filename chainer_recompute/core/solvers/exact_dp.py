"""The exact DP over every lower set (docs/paper.md §4), exhaustive.

Pure core: numpy only.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from ..graph import Graph
from ..lower_sets import DEFAULT_MAX_LOWER_SETS, LowerSetFamily
from ..memory_model import MemoryModel
from ..plan import Plan
from ._dp import plan_from_dp

logger = logging.getLogger(__name__)

__all__ = ["solve_exact"]


def solve_exact(graph: Graph, budget_bytes: Optional[int], *, strategy: str = "tc",
                max_lower_sets: Optional[int] = DEFAULT_MAX_LOWER_SETS,
                family: Optional[LowerSetFamily] = None, method: str = "auto",
                model: Optional[MemoryModel] = None, engine: Optional[str] = None) -> Plan:
    """Exact DP: the best canonical strategy over all lower sets.

    DP table: ``opt[L]`` is the Pareto frontier of (retained time
    Σ T(U_j), retained memory Σ M(U_j)) over chains ∅ ⊊ ... ⊊ L; every
    inclusion pair ``L ⊊ L'`` is tried (rows sorted by size, unlike the
    authors' solver, which skips the pairs whose superset it discovered
    first). ``strategy='tc'`` returns the least overhead, ``'mc'`` the
    most overhead among feasible strategies.

    Args:
        graph: the graph.
        budget_bytes: the memory budget under the memory model, or ``None``.
        strategy: ``'tc'`` or ``'mc'``.
        max_lower_sets: raise :class:`LowerSetExplosionError` above this.
        family: a precomputed :meth:`LowerSetFamily.all` (reuse it across
            budgets).
        method: the DP table's form, ``auto``, ``dense`` or ``sparse``
            (see :func:`run_dp`); all give the same optimum.
        model: the memory model (:class:`MemoryModel`); ``None``: the
            family's model when a family is given, else the paper's.
        engine: ``numba`` (compiled kernels, the ``fast`` extra), ``numpy``
            or ``auto``/``None`` (see :func:`run_dp`); all give the same
            optimum.

    Returns:
        A :class:`Plan`; ``feasible`` is False when nothing fits.

    Raises:
        LowerSetExplosionError: too many lower sets; use ``solve_approx``.

    References:
        Kusumoto et al., "A Graph Theoretic Framework of Recomputation
        Algorithms for Memory-Efficient Backpropagation", NeurIPS 2019,
        §4 (exact DP).

    >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)])
    >>> solve_exact(g, 6).feasible
    True
    """
    t0 = time.perf_counter()
    fam = (LowerSetFamily.all(graph, max_lower_sets, model) if family is None
           else family if model is None else family.with_model(model))
    return plan_from_dp(graph, fam, budget_bytes, strategy, method, "exact", t0, engine)
