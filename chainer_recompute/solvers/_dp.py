"""The DP over a family of lower sets, shared by the exact and the
approximate solvers (PAPER.md §4-§6).

Pure core: numpy only.

Table: for each lower set ``L`` (row of a :class:`LowerSetFamily`, rows
sorted by size so every subset precedes its supersets) a Pareto frontier
of states ``(t, m)``: ``t`` the retained time Σ_j T(U_j) and ``m`` the
retained memory Σ_j M(U_j) of some chain ∅ ⊊ L_1 ⊊ ... ⊊ L. A transition
``L -> L'`` for *every* ``L' ⊋ L`` in the family is allowed when
``m + 2·(M(L') - M(L)) + M(A(L')) + M(B(L')) <= budget``; it adds
``U' = ∂(L') ∩ (L' \\ L)``. Because ``∂(L') ∩ L ⊆ ∂(L)``,
``T(U') = T(∂(L')) - Σ_{v ∈ ∂(L)} T_v·[v ∈ ∂(L')]``, a few vectorised bit
tests per source.

Dominance depends on the objective: time-centric keeps states with more
``t`` and less ``m``; memory-centric keeps less ``t`` and less ``m``;
feasibility keeps the least ``m`` only. Candidate supersets of ``L`` are
restricted by the budget to a window of M(L') (``2·(M(L') - M(L)) <=
budget - m``) found by binary search in the rows sorted by M(L'), then
filtered with a vectorised subset test. Pushed states are buffered per
target size and reduced (grouped Pareto filter, all in numpy) when that
size's turn comes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..lower_sets import LowerSetFamily

logger = logging.getLogger(__name__)

_FLUSH_AT = 2_000_000


@dataclass
class DPResult:
    """The chain found by :func:`run_dp` (row indices into the family) and
    its retained time and memory; ``chain`` is ``None`` when infeasible."""

    chain: Optional[List[int]]
    retained_time: float
    retained_bytes: int
    n_transitions: int
    n_states: int


def _reduce(cols: Tuple[np.ndarray, ...]) -> Tuple[np.ndarray, ...]:
    """Grouped Pareto filter: cols = (tgt, obj, m, t, src, ent). Keeps, per
    tgt, the states not dominated in (obj low, m low); sorted by tgt, obj."""
    tgt, obj, m = cols[0], cols[1], cols[2]
    if len(tgt) == 0:
        return cols
    order = np.lexsort((m, obj, tgt))
    cols = tuple(c[order] for c in cols)
    tgt, m = cols[0], cols[2]
    new_group = np.empty(len(tgt), dtype=bool)
    new_group[0] = True
    np.not_equal(tgt[1:], tgt[:-1], out=new_group[1:])
    rank = np.cumsum(new_group) - 1
    big = int(m.max()) + 1
    key = m + (rank[-1] - rank) * big
    run = np.minimum.accumulate(key)
    keep = new_group.copy()
    keep[1:] |= key[1:] < run[:-1]
    return tuple(c[keep] for c in cols)


def run_dp(family: LowerSetFamily, budget_bytes: Optional[int], objective: str) -> DPResult:
    """Run the DP; ``objective`` is ``'tc'``, ``'mc'`` or ``'feasible'``.

    Returns the best chain ending at V (the last row) under the objective:
    most retained time (tc), least retained time (mc), or any feasible one
    (feasible; least retained memory).

    >>> from chainer_recompute.graph import Graph
    >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)])
    >>> run_dp(LowerSetFamily.all(g), None, 'tc').chain
    [0, 1, 2, 3]
    """
    K = len(family)
    words = family.words
    nw = words.shape[1]
    mem = family.mem_bytes.astype(np.int64)
    size = family.size
    back = family.back_bytes.astype(np.int64)
    btime = family.boundary_time.astype(np.float64)
    bbytes = family.boundary_bytes.astype(np.int64)
    bwords = family.boundary_words
    node_t = family.graph.node_cost.astype(np.float64)
    node_m = family.graph.node_bytes.astype(np.int64)
    budget = None if budget_bytes is None else int(budget_bytes)
    by_mem = np.argsort(mem, kind="stable")
    mem_sorted = mem[by_mem]
    sign = {"tc": -1.0, "mc": 1.0, "feasible": 0.0}[objective]

    # Per-row frontier: (obj, m, t, src, ent) arrays, or None if unreached.
    front: List[Optional[Tuple[np.ndarray, ...]]] = [None] * K
    front[0] = (np.zeros(1), np.zeros(1, dtype=np.int64), np.zeros(1),
                np.full(1, -1, dtype=np.int64), np.full(1, -1, dtype=np.int64))
    if budget is not None and budget < 0:
        return DPResult(None, 0.0, 0, 0, 0)
    raw: List[Tuple[np.ndarray, ...]] = []
    raw_len = 0
    buckets: Dict[int, List[Tuple[np.ndarray, ...]]] = {}
    n_trans = 0
    n_states = 1

    def flush() -> None:
        nonlocal raw, raw_len
        if not raw:
            return
        cols = _reduce(tuple(np.concatenate(c) for c in zip(*raw)))
        raw, raw_len = [], 0
        sz = size[cols[0]]
        cuts = np.flatnonzero(np.diff(sz)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [len(sz)]])
        for s, e in zip(starts, ends):
            buckets.setdefault(int(sz[s]), []).append(tuple(c[s:e] for c in cols))

    def finalize(level: int) -> None:
        nonlocal n_states
        chunks = buckets.pop(level, None)
        if not chunks:
            return
        cols = _reduce(tuple(np.concatenate(c) for c in zip(*chunks)))
        tgt = cols[0]
        cuts = np.flatnonzero(np.diff(tgt)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [len(tgt)]])
        for s, e in zip(starts, ends):
            front[int(tgt[s])] = tuple(c[s:e] for c in cols[1:])
        n_states += len(tgt)

    level = 0
    for i in range(K):
        if size[i] != level:
            flush()
            level = int(size[i])
            finalize(level)
        fr = front[i]
        if fr is None or i == K - 1:
            continue
        obj, m, t, _, _ = fr
        m_min = int(m.min())
        if budget is None:
            cand = np.arange(i + 1, K)
        else:
            slack = budget - m_min
            if slack < 0:
                continue
            lo = np.searchsorted(mem_sorted, mem[i], "left")
            hi = np.searchsorted(mem_sorted, mem[i] + slack // 2, "right")
            cand = by_mem[lo:hi]
            cand = cand[size[cand] > size[i]]
        if len(cand) == 0:
            continue
        step = 2 * (mem[cand] - mem[i]) + back[cand]
        if budget is not None:
            ok = m_min + step <= budget
            cand, step = cand[ok], step[ok]
        wi = words[i]
        sub = np.ones(len(cand), dtype=bool)
        for w in range(nw):
            if wi[w]:
                sub &= (words[cand, w] & wi[w]) == wi[w]
        cand, step = cand[sub], step[sub]
        if len(cand) == 0:
            continue
        d_t = btime[cand].copy()
        d_m = bbytes[cand].copy()
        bi = bwords[i]
        for w in range(nw):
            x = int(bi[w])
            while x:
                low = x & -x
                v = 64 * w + low.bit_length() - 1
                x ^= low
                hit = (bwords[cand, w] & np.uint64(low)) != 0
                d_t[hit] -= node_t[v]
                d_m[hit] -= node_m[v]
        E = len(m)
        if E == 1:
            if budget is not None:
                ok = m[0] + step <= budget
                c_, dt_, dm_ = cand[ok], d_t[ok], d_m[ok]
            else:
                c_, dt_, dm_ = cand, d_t, d_m
            nt = t[0] + dt_
            cols = (c_, sign * nt, m[0] + dm_, nt, np.full(len(c_), i, dtype=np.int64),
                    np.zeros(len(c_), dtype=np.int64))
        else:
            ent = np.repeat(np.arange(E, dtype=np.int64), len(cand))
            c_ = np.tile(cand, E)
            mm = m[ent] + np.tile(d_m, E)
            nt = t[ent] + np.tile(d_t, E)
            if budget is not None:
                ok = m[ent] + np.tile(step, E) <= budget
                c_, mm, nt, ent = c_[ok], mm[ok], nt[ok], ent[ok]
            cols = (c_, sign * nt, mm, nt, np.full(len(c_), i, dtype=np.int64), ent)
        if len(cols[0]) == 0:
            continue
        n_trans += len(cols[0])
        raw.append(cols)
        raw_len += len(cols[0])
        if raw_len > _FLUSH_AT:
            flush()
    fr = front[K - 1]
    if fr is None:
        return DPResult(None, 0.0, 0, n_trans, n_states)
    obj, m, t, src, ent = fr
    # Frontier rows are sorted by (obj, m): the first is the best.
    j = 0
    retained_t, retained_m = float(t[0]), int(m[0])
    chain = [K - 1]
    row = K - 1
    while True:
        s, e = int(front[row][3][j]), int(front[row][4][j])
        if s < 0:
            break
        chain.append(s)
        row, j = s, e
    chain.reverse()
    return DPResult(chain, retained_t, retained_m, n_trans, n_states)
