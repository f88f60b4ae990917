"""The hierarchical DP's chain table
(:func:`~chainer_recompute.core.solvers.hier_dp._chain_dp`), on both
engines: loops compiled by numba (the ``fast`` extra) or vectorised over
the time units with numpy. Both fill ``best[q, t]``, ``src`` and ``how`` as the
module doc of :mod:`~chainer_recompute.core.solvers.hier_dp` says; a state of row ``q`` whose retained
time is below ``need[q]`` is not used as a source (branch and bound, see
:func:`~chainer_recompute.core.solvers.hier_dp._chain_dp`)."""
from __future__ import annotations

import sys
from typing import Any, Optional

import numpy as np

from . import compiled, pick_engine


def kernel(engine: Optional[str], default: str = "auto") -> Any:
    """The table's filler for ``engine`` (``None``: ``default``; the
    hierarchical DP passes the flat DPs',
    :data:`~chainer_recompute.core.solvers._dp.ENGINE`): :func:`_dp_loops`
    compiled, or :func:`_dp_numpy` (see :func:`~.pick_engine`)."""
    if pick_engine(engine, what="hierarchical DP", default=default) == "numpy":
        return _dp_numpy
    return compiled(sys.modules[__name__], "_dp_loops", helpers=("_relax",))


def least_kernel(engine: Optional[str] = None, default: str = "auto") -> Any:
    """The one-state-per-position table's filler for ``engine`` (as
    :func:`kernel`): :func:`_least_loops` compiled, or :func:`_least_numpy`."""
    if pick_engine(engine, what="hierarchical DP", default=default) == "numpy":
        return _least_numpy
    return compiled(sys.modules[__name__], "_least_loops")


def _least_numpy(P, step, dm, ptr, o_peak, o_keep, bc, least, back):
    """:func:`_least_loops`, vectorised over the sources of each position."""
    inf = np.iinfo(np.int64).max // 4
    least[:] = inf
    least[0] = 0
    back[:] = -1
    for q in range(1, P + 1):
        lj = least[:q]
        ok = (lj < inf) & (lj + step[:q, q] <= bc)
        best = inf
        if ok.any():
            cand = np.where(ok, lj + dm[:q, q], inf)
            j = int(np.argmin(cand))
            best, back[q] = int(cand[j]), (j, -1)
        lp = least[q - 1]
        if lp < inf:
            peak, keep = o_peak[ptr[q - 1]:ptr[q]], o_keep[ptr[q - 1]:ptr[q]]
            fit = lp + peak <= bc
            if fit.any():
                i = int(np.argmin(np.where(fit, keep, inf)))
                if lp + int(keep[i]) < best:
                    best, back[q] = lp + int(keep[i]), (q - 1, i)
        least[q] = best
    least[least >= inf] = -1


def _least_loops(P, step, dm, ptr, o_peak, o_keep, bc, least, back):
    """The chain DP with one state per position: ``least[q]``, the least
    memory retained by a chain from ∅ to position ``q`` within ``bc``
    (``-1``: none), and ``back[q]``, its last step ``(j, option)``
    (option -1: a long block; the first of equal ones)."""
    inf = 2305843009213693951  # np.iinfo(np.int64).max // 4
    least[0] = 0
    back[0, 0] = -1
    back[0, 1] = -1
    for q in range(1, P + 1):
        best, bj, bo = inf, -1, -1
        for j in range(q):
            lj = least[j]
            if lj < inf and lj + step[j, q] <= bc and lj + dm[j, q] < best:
                best, bj, bo = lj + dm[j, q], j, -1
        lp = least[q - 1]
        if lp < inf:
            keep, pick = inf, -1
            for h in range(ptr[q - 1], ptr[q]):
                if lp + o_peak[h] <= bc and o_keep[h] < keep:
                    keep, pick = o_keep[h], h - ptr[q - 1]
            if pick >= 0 and lp + keep < best:
                best, bj, bo = lp + keep, q - 1, pick
        least[q] = best
        back[q, 0] = bj
        back[q, 1] = bo
    for q in range(P + 1):
        if least[q] >= inf:
            least[q] = -1


def _dp_numpy(P, U, step, dm, dt, ptr, o_peak, o_keep, o_dt, bc, best, src, how, tc, need):
    """The chain DP's table (see module doc), vectorised over the time
    units."""
    inf = np.iinfo(np.int64).max // 4

    def relax(q, j, peak, d, add, tag):
        # row j's states extended to row q by one transition (see _relax)
        row, row_q = best[j], best[q]
        d = int(d)
        ok = (row < inf) & (row + peak <= bc)
        ok[:max(int(need[j]), 0)] = False
        if d > 0:
            ok[U - d + 1:] = False
        idx = np.flatnonzero(ok)
        if len(idx) == 0:
            return
        cand = row[idx] + add
        tgt = idx + d
        better = cand < row_q[tgt]
        row_q[tgt[better]] = cand[better]
        src[q, tgt[better]] = j
        how[q, tgt[better]] = tag

    for q in range(1, P + 1):
        for j in range(q):
            if step[j, q] <= bc:
                relax(q, j, step[j, q], dt[j, q], dm[j, q], -1)
        for h in range(ptr[q - 1], ptr[q]):
            relax(q, q - 1, o_peak[h], o_dt[h], o_keep[h], h)


def _relax(best, src, how, ft, fm, lo, hi, peak, d, add, q, j, tag, bc, U):
    """Extend the frontier states ``lo:hi`` of row ``j`` to row ``q`` by one
    transition (peak above the state's memory, time ``d``, memory kept
    ``add``; ``tag``: -1 for a block, else its option), where it fits the
    budget and improves ``best[q]``."""
    for k in range(lo, hi):
        v = fm[k]
        t = ft[k]
        if v + peak <= bc and t + d <= U:
            c = v + add
            if c < best[q, t + d]:
                best[q, t + d] = c
                src[q, t + d] = j
                how[q, t + d] = tag


def _dp_loops(P, U, step, dm, dt, ptr, o_peak, o_keep, o_dt, bc, best, src, how, tc, need):
    """The chain DP's table, as loops (compiled by numba). Each finished
    row keeps only its non-dominated states as sources: for tc a state
    with less time and more memory than another can only lead to worse
    plans, for mc one with more time and more memory."""
    inf = 2305843009213693951  # np.iinfo(np.int64).max // 4
    ft = np.empty((P + 1) * (U + 1), dtype=np.int64)
    fm = np.empty((P + 1) * (U + 1), dtype=np.int64)
    fp = np.zeros(P + 2, dtype=np.int64)
    ft[0] = 0
    fm[0] = 0
    fp[1] = 1
    least = np.full(P + 1, inf, dtype=np.int64)
    least[0] = 0
    for q in range(1, P + 1):
        for j in range(q):
            if least[j] >= inf:
                continue
            st = step[j, q]
            if least[j] + st > bc:
                continue
            _relax(best, src, how, ft, fm, fp[j], fp[j + 1], st, dt[j, q], dm[j, q], q, j, -1,
                   bc, U)
        j = q - 1
        if least[j] < inf:
            for h in range(ptr[j], ptr[j + 1]):
                if least[j] + o_peak[h] > bc:
                    continue
                _relax(best, src, how, ft, fm, fp[j], fp[j + 1], o_peak[h], o_dt[h], o_keep[h],
                       q, j, h, bc, U)
        # the row's frontier
        n = fp[q]
        run = inf
        # tc: from the most retained time down to need[q]; mc: up from 0
        first, stop, by = (U, max(need[q], 0) - 1, -1) if tc else (0, U + 1, 1)
        for t in range(first, stop, by):
            v = best[q, t]
            if v < run:
                run = v
                ft[n] = t
                fm[n] = v
                n += 1
        fp[q + 1] = n
        least[q] = run
