"""Baselines: vanilla backpropagation and Chen et al.'s checkpointing
(docs/paper.md §7), as the authors implemented them.

Pure core: numpy only.
"""
from __future__ import annotations

import logging
import math
import time
from typing import List, Optional

from ..errors import LowerSetExplosionError
from ..graph import Graph
from ..keep import with_must_keep
from ..lower_sets import DEFAULT_MAX_LOWER_SETS, LowerSetFamily, full_mask
from ..plan import Plan, make_plan
from ..memory_model import MemoryModel
from ..schedule import strategy_cost

logger = logging.getLogger(__name__)

__all__ = ["chen_candidates", "solve_chen", "solve_chen_greedy", "solve_none"]


def solve_none(graph: Graph, budget_bytes: Optional[int], *, strategy: str = "tc",
               model: Optional[MemoryModel] = None) -> Plan:
    """Vanilla backpropagation: keep everything, recompute nothing.

    The predicted peak is the memory model's single block (the paper's:
    2·M(V)); ``feasible`` says whether that fits the budget.

    >>> solve_none(Graph.from_edges([1, 1], [(0, 1)]), None).overhead
    0.0
    """
    t0 = time.perf_counter()
    return make_plan(graph, [full_mask(graph)], solver="none", strategy=strategy,
                     budget_bytes=budget_bytes, solve_time_s=time.perf_counter() - t0,
                     recompute=False, model=model)


def chen_candidates(graph: Graph,
                    max_lower_sets: Optional[int] = DEFAULT_MAX_LOWER_SETS) -> List[int]:
    """Chen's candidate cuts: lower sets whose boundary ∂(L) is a single
    node (articulation cuts), plus ∅ and V, as bitsets sorted by M(L).
    Falls back to the ancestor-closure family when the graph has too many
    lower sets. The nodes every plan keeps (:attr:`Graph.must_keep`) do not
    count in ∂(L) here: they are checkpoints of the resulting plan, and
    its figures count them.

    >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)])
    >>> chen_candidates(g)
    [0, 1, 3, 7]
    """
    wiring = with_must_keep(graph, ())  # cuts of the wiring (kept nodes cost in the plan)
    try:
        fam = LowerSetFamily.all(wiring, max_lower_sets)
    except LowerSetExplosionError:
        fam = LowerSetFamily.ancestor_closures(wiring)
    import numpy as np
    bsize = np.unpackbits(fam.boundary_words.view(np.uint8), axis=1).sum(axis=1)
    rows = [i for i in range(len(fam)) if bsize[i] == 1 or i == 0 or i == len(fam) - 1]
    rows.sort(key=lambda r: (int(fam.mem_bytes[r]), int(fam.size[r])))
    return fam.masks(rows)


def solve_chen(graph: Graph, budget_bytes: Optional[int], *, strategy: str = "tc",
               max_lower_sets: Optional[int] = DEFAULT_MAX_LOWER_SETS,
               model: Optional[MemoryModel] = None) -> Plan:
    """Chen et al.'s sqrt(n) checkpointing as the authors implemented it.

    The candidates (:func:`chen_candidates`, sorted by M(L)) are walked
    with k = max(1, floor(sqrt(#candidates))) thresholds spaced M(V)/k
    apart: the first and the last candidate are cuts, and so is each
    candidate whose M(L) passes the next threshold. The budget is ignored
    when choosing; ``feasible`` says whether the result fits it under
    ``model`` (the paper's memory model by default).

    References:
        Chen, Xu, Zhang, Guestrin, "Training Deep Nets with Sublinear
        Memory Cost", arXiv 1604.06174 (2016). Kusumoto et al., NeurIPS
        2019, §7 (the baseline as compared there).

    >>> g = Graph.from_edges([1] * 9, [(i, i + 1) for i in range(8)])
    >>> solve_chen(g, None).n_blocks
    3
    """
    t0 = time.perf_counter()
    cands = chen_candidates(graph, max_lower_sets)
    nb = graph.node_bytes

    def mem(mask: int) -> int:
        return int(sum(int(nb[v]) for v in range(graph.n) if (mask >> v) & 1))

    k = max(1, int(math.isqrt(len(cands))))
    total = mem(full_mask(graph))
    step = total // k
    thresh = step
    cuts = []
    for i, c in enumerate(cands):
        mc = mem(c)
        if i == 0 or i + 1 == len(cands) or mc > thresh:
            cuts.append(c)
            while step > 0 and thresh < mc:
                thresh += step
    chain = sorted({c for c in cuts if c}, key=lambda m: bin(m).count("1"))
    return make_plan(graph, chain, solver="chen", strategy=strategy, budget_bytes=budget_bytes,
                     solve_time_s=time.perf_counter() - t0, info={"n_candidates": len(cands)},
                     model=model)


def _greedy_chain(graph: Graph, cut_ok: List[bool], b: int) -> List[int]:
    chain = []
    running = 0
    mask = 0
    for v in range(graph.n):
        mask |= 1 << v
        running += int(graph.node_bytes[v])
        if cut_ok[v] and running > b and v + 1 < graph.n:
            chain.append(mask)
            running = 0
    chain.append(mask)
    return chain


def solve_chen_greedy(graph: Graph, budget_bytes: Optional[int], *, strategy: str = "tc",
                      n_trials: int = 200, model: Optional[MemoryModel] = None) -> Plan:
    """Chen et al.'s budgeted greedy: walk the nodes in topological order
    with a running size; after a node whose topological prefix has a
    single-node boundary, cut when the running size passes ``b`` and
    restart it. ``b`` is searched over ``n_trials`` values in (0, M(V)];
    among the resulting plans that fit the budget (under ``model``, the
    paper's memory model by default) the least
    overhead (tc) or the most (mc) wins; without a budget, or when none
    fits, the least predicted peak.

    References:
        Chen, Xu, Zhang, Guestrin, "Training Deep Nets with Sublinear
        Memory Cost", arXiv 1604.06174 (2016), Algorithm 3.

    >>> g = Graph.from_edges([1] * 9, [(i, i + 1) for i in range(8)])
    >>> solve_chen_greedy(g, None).predicted_peak_bytes <= 18
    True
    """
    t0 = time.perf_counter()
    succs = graph.succs
    cut_ok = []
    max_succ = -1
    for v in range(graph.n):
        # The prefix 0..v has boundary {v} when no node before v has a
        # successor after v, and v has one (or v is the last node).
        prev_reach = max_succ
        max_succ = max([max_succ] + list(succs[v]))
        cut_ok.append(prev_reach <= v)
    if not any(cut_ok[:-1]):
        cut_ok = [True] * graph.n
    total = int(graph.node_bytes.sum())
    seen = {}
    for j in range(1, n_trials + 1):
        b = total * j // n_trials
        chain = tuple(_greedy_chain(graph, cut_ok, b))
        if chain not in seen:
            c = strategy_cost(graph, chain, model)
            seen[chain] = (c.peak_bytes, c.overhead, b)
    fits = [(ch, v) for ch, v in seen.items()
            if budget_bytes is not None and v[0] <= budget_bytes]
    if fits:
        sgn = 1 if strategy == "tc" else -1
        chain, _ = min(fits, key=lambda cv: (sgn * cv[1][1], cv[1][0]))
    else:
        chain, _ = min(seen.items(), key=lambda cv: (cv[1][0], cv[1][1]))
    return make_plan(graph, list(chain), solver="chen-greedy", strategy=strategy,
                     budget_bytes=budget_bytes, solve_time_s=time.perf_counter() - t0,
                     info={"b_bytes": seen[chain][2]}, model=model)
