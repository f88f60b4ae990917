"""The DP on NumPy: one dense row of retained times per lower set
(:func:`_dense`), or Pareto frontiers buffered per target size and reduced
when that size's turn comes (:func:`_sparse`).

Pure core: numpy only.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np

from .result import DPResult

if TYPE_CHECKING:  # pragma: no cover
    from .pairs import _Pairs

logger = logging.getLogger(__name__)

_FLUSH_AT = 2_000_000
_GUARD_BUCKETS = 32

#: The dense table (one row of T+1 entries per lower set) is used while it
#: has at most this many entries; larger problems use the sparse frontiers.
DENSE_LIMIT = 24_000_000


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


def _dense(pairs: _Pairs, budget: Optional[int], objective: str, least: np.ndarray,
           cap: np.ndarray) -> DPResult:
    """The DP with one dense row per lower set: ``opt[L, t]`` is the least
    retained memory of a chain ending at ``L`` with retained time ``t``
    (docs/paper.md §4 verbatim); dominated entries of a row are skipped when it
    is expanded."""
    K, T = pairs.K, pairs.total_t
    inf = np.iinfo(np.int64).max
    opt = np.full((K, T + 1), inf, dtype=np.int64)
    src_row = np.full((K, T + 1), -1, dtype=np.int32)
    src_t = np.full((K, T + 1), -1, dtype=np.int32)
    opt[0, 0] = 0
    flat_opt, flat_row, flat_t = opt.ravel(), src_row.ravel(), src_t.ravel()
    n_trans = 0
    for i in range(K - 1):
        if least[i] == inf:
            continue
        row = opt[i]
        ts = np.flatnonzero(row != inf)
        if len(ts) == 0:
            continue
        ms = row[ts]
        # Keep the row's Pareto-optimal entries for the objective.
        if objective == "tc":  # more t, less m: m below every larger t's
            later = np.minimum.accumulate(ms[::-1])[::-1]
            keep = np.ones(len(ts), dtype=bool)
            keep[:-1] = ms[:-1] < later[1:]
        else:  # mc: less t, less m
            earlier = np.minimum.accumulate(ms)
            keep = np.ones(len(ts), dtype=bool)
            keep[1:] = ms[1:] < earlier[:-1]
        ts, ms = ts[keep], ms[keep]
        m_min = int(ms.min())
        tgt, step, d_t, d_m = pairs.out_of(i, None if budget is None else budget - m_min)
        if len(tgt) == 0:
            continue
        new_m = ms[None, :] + d_m[:, None]
        ok = new_m <= cap[tgt][:, None]
        if budget is not None:
            ok &= ms[None, :] + step[:, None] <= budget
        rows, cols = np.nonzero(ok)
        if len(rows) == 0:
            continue
        n_trans += len(rows)
        new_t = ts[cols] + d_t[rows]
        flat = tgt[rows] * (T + 1) + new_t  # unique within one source row
        vals = new_m[rows, cols]
        better = vals < flat_opt[flat]
        flat = flat[better]
        flat_opt[flat] = vals[better]
        flat_row[flat] = i
        flat_t[flat] = ts[cols[better]]
    last = opt[K - 1]
    reached = np.flatnonzero(last != inf)
    if len(reached) == 0:
        return DPResult(None, 0.0, 0, n_trans, int((opt != inf).sum()))
    t_end = int(reached[-1] if objective == "tc" else reached[0])
    retained_m = int(last[t_end])
    chain = [K - 1]
    r, t = K - 1, t_end
    while r != 0:
        r, t = int(src_row[r, t]), int(src_t[r, t])
        chain.append(r)
    chain.reverse()
    return DPResult(chain, float(t_end), retained_m, n_trans, int((opt != inf).sum()))


def _sparse(pairs: _Pairs, budget: Optional[int], objective: str, least: np.ndarray,
            cap: np.ndarray) -> DPResult:
    """The DP with per-row Pareto frontiers, for large families."""
    K = pairs.K
    size = pairs.size
    sign = {"tc": -1.0, "mc": 1.0}[objective]

    # Per-row frontier: (obj, m, t, src, ent) arrays, or None if unreached.
    front: List[Optional[Tuple[np.ndarray, ...]]] = [None] * K
    front[0] = (np.zeros(1), np.zeros(1, dtype=np.int64), np.zeros(1),
                np.full(1, -1, dtype=np.int64), np.full(1, -1, dtype=np.int64))
    guard: Optional[np.ndarray] = None
    if budget is not None:
        guard = np.full((K, _GUARD_BUCKETS), np.inf)
        span = np.maximum(cap - np.minimum(least, cap), 0) + 1
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
        m_min = int(m[0]) if len(m) == 1 else int(m.min())
        tgt, step, d_t, d_m = pairs.out_of(i, None if budget is None else budget - m_min)
        if budget is not None and len(tgt):
            live = cap[tgt] >= m_min + d_m
            tgt, step, d_t, d_m = tgt[live], step[live], d_t[live], d_m[live]
        if len(tgt) == 0:
            continue
        E = len(m)
        if E == 1:
            mm = m[0] + d_m
            nt = t[0] + d_t
            c_ = tgt
            ent = np.zeros(len(c_), dtype=np.int64)
            if budget is not None:
                ok = (m[0] + step <= budget) & (mm <= cap[c_])
                c_, mm, nt, ent = c_[ok], mm[ok], nt[ok], ent[ok]
        else:
            C = len(tgt)
            ent = np.repeat(np.arange(E, dtype=np.int64), C)
            c_ = np.tile(tgt, E)
            mm = np.repeat(m, C) + np.tile(d_m, E)
            nt = np.repeat(t, C) + np.tile(d_t, E)
            if budget is not None:
                ok = (np.repeat(m, C) + np.tile(step, E) <= budget) & (mm <= cap[c_])
                c_, mm, nt, ent = c_[ok], mm[ok], nt[ok], ent[ok]
        if len(c_) == 0:
            continue
        n_trans += len(c_)
        o = sign * nt
        if guard is not None:
            # Drop pushes dominated by a state already pushed to the same
            # target from an earlier source (a lower bucket of m, no worse
            # objective); then record the survivors.
            lo_m = least[c_]
            b = ((mm - lo_m) * _GUARD_BUCKETS) // (span[c_])
            keep = guard[c_, b] > o
            c_, mm, nt, ent, o, b = c_[keep], mm[keep], nt[keep], ent[keep], o[keep], b[keep]
            if len(c_) == 0:
                continue
            upd = b + 1 < _GUARD_BUCKETS
            np.minimum.at(guard, (c_[upd], b[upd] + 1), o[upd])
            rows = np.unique(c_[upd])
            guard[rows] = np.minimum.accumulate(guard[rows], axis=1)
        raw.append((c_, o, mm, nt, np.full(len(c_), i, dtype=np.int64), ent))
        raw_len += len(c_)
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
