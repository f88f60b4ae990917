"""The DP on the compiled kernels (:mod:`~chainer_recompute.core.kernels.dp`): the family as flat
arrays, an incumbent (the DP on the ancestor closures, or a greedy chain),
guesses of the optimum from the top, and the pruned dense table
(:func:`_run_compiled`).

Pure core: numpy, and numba through the kernels.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List, Optional

import numpy as np

from ...lower_sets import LowerSetFamily
from .result import DPResult

if TYPE_CHECKING:  # pragma: no cover
    from .pairs import _Pairs

logger = logging.getLogger(__name__)

#: The compiled tc DP on a small table takes its incumbent from the DP on
#: the ancestor-closure rows (one per node) when they are at most
#: 1/CLOSURE_SHARE of the family (see :func:`_run_compiled`).
CLOSURE_SHARE = 4

#: The compiled tc DP guesses the optimum (see :func:`_run_compiled`) when
#: its table has more than this many entries (below it, one run with the
#: incumbent is cheaper than the guesses), in steps of 1/GUESS_STEPS of the
#: interval left ...
GUESS_MIN_TABLE = 500_000
GUESS_STEPS = 32
#: ... raced with a run with the incumbent, stopped at first after this
#: many pushes, and tried again each time the guesses have spent
#: GUESS_RACE times its last limit.
GUESS_FIRST_PUSHES = 200_000
GUESS_RACE = 16


def _kernel_args(family: LowerSetFamily, pairs: _Pairs) -> tuple:
    """The family as the flat arrays of :mod:`~chainer_recompute.core.kernels.dp` (cached)."""
    args = family.cache.get("kernel_args")
    if args is not None:
        return args
    from ...lower_sets import _n_words
    from ...kernels import dp as kn
    g = family.graph
    n, K = g.n, pairs.K
    all_rows = pairs.by_blk.astype(np.int64)
    all_blk = pairs.blk_s
    # Rows containing each node, sorted by block(L); maximal elements of
    # each row.
    _, sw = family.adjacency()
    vptr, ps, mptr, ms = kn.node_lists(family.words, all_rows, sw, n)
    nw = _n_words(n)
    tw = pairs.twords if pairs.has_trans else np.zeros((K, 0), dtype=np.uint64)
    nums = np.stack([pairs.size, pairs.back, pairs.btime, pairs.bbytes, pairs.blk],
                    axis=1).astype(np.int64).view(np.uint64)
    R = np.ascontiguousarray(np.concatenate(
        [family.words, family.boundary_words, tw, nums], axis=1), dtype=np.uint64)
    args = (R, (nw, tw.shape[1]), all_rows, all_blk, vptr, all_rows[ps], all_blk[ps],
            mptr, ms, pairs.node_t.astype(np.int64),
            pairs.node_m.astype(np.int64), pairs.trans_vals.astype(np.int64))
    family.cache["kernel_args"] = args
    return args


def _chain_from(src: np.ndarray, K: int) -> List[int]:
    chain = [K - 1]
    while chain[-1] != 0:
        chain.append(int(src[chain[-1]]))
    chain.reverse()
    return chain


def _run_compiled(family: LowerSetFamily, pairs: _Pairs, budget: Optional[int],
                  objective: str) -> DPResult:
    """The DP on the compiled kernels (:mod:`~chainer_recompute.core.kernels.dp`).

    1. With a budget (:func:`run_dp` drops one that can never bind), the
       most retained memory with which V is still reachable from each row
       (one backward pass; ∅ with 0 says whether anything fits).
    2. A feasible chain, whose retained time is an incumbent: for tc on
       small tables where the ancestor closures are few, the DP on those
       rows alone; else a one-state-per-row heuristic (greedy on the
       objective).
    3. If the incumbent meets the bound at ∅ (tc: every non-sink kept; mc:
       nothing kept) it is optimal; else the dense DP, where a push that
       cannot reach the incumbent even with the bound of its row (tc: the
       retained time of the non-sinks outside it; mc: 0) is dropped. Ties
       with the incumbent are kept, so the DP finds the optimum itself.
       For tc the DP first runs with guesses above the incumbent, from the
       top down (see the code): a guess above the optimum finds nothing,
       cheaply; the first that finds a chain has found the optimum.
    """
    import time

    from ...kernels import dp as kn
    t0 = time.perf_counter()
    P = _kernel_args(family, pairs)
    K, T = pairs.K, pairs.total_t
    inf = kn.INF
    has_budget = budget is not None
    B = int(budget) if has_budget else 0
    if objective == "feasible":
        least, src, n = kn.feasibility(P, B, has_budget)
        if least[K - 1] == inf:
            return DPResult(None, 0.0, 0, int(n), 0)
        return DPResult(_chain_from(src, K), float("nan"), int(least[K - 1]), int(n), K)
    tc = objective == "tc"
    if not has_budget:
        cap = np.full(K, inf, dtype=np.int64)
    else:
        cap = kn.capacity(P, B)
        if cap[0] < 0:
            return DPResult(None, 0.0, 0, 0, 0)
    bound = pairs.r0 if tc else np.zeros(K, dtype=np.int64)
    inc = None
    if (tc and has_budget and K * (T + 1) <= GUESS_MIN_TABLE
            and family.graph.n * CLOSURE_SHARE <= K):
        # An incumbent from the same DP on the rows that are ancestor
        # closures (the approximate DP's lower sets) alone, where they are
        # a small part of the family: it is usually far closer to the
        # optimum than the greedy run's, so the DP below pushes less; where
        # the closures are a large part it would cost about as much as the
        # DP itself.
        rows = _closure_rows(family)
        if rows is not None:
            capr = np.full(K, -1, dtype=np.int64)
            capr[rows] = cap[rows]
            sub = _Table(pairs, capr, 0, tc)
            kn.dense(P, B, has_budget, tc, capr, T, bound, 0, sub.off, sub.t_low, sub.opt,
                     sub.src, sub.touched, 0)
            reached = sub.reached()
            if len(reached):
                inc = int(reached[-1])
                logger.debug("ancestor closures: incumbent %d (%.2f s)", inc,
                             time.perf_counter() - t0)
    if inc is None:
        bt, bm, gsrc = kn.greedy(P, B, has_budget, tc, cap, 0.0)
        inc = int(bt[K - 1])
        logger.debug("capacity and greedy: incumbent %d (%.2f s)", inc,
                     time.perf_counter() - t0)
        if (tc and inc >= bound[0]) or (not tc and inc <= 0):
            return DPResult(_chain_from(gsrc, K), float(inc), int(bm[K - 1]), 0, K)
    pushes = 0
    tab = _Table(pairs, cap, inc, tc)

    def dense(incumbent: int, limit: int) -> int:
        return kn.dense(P, B, has_budget, tc, cap, T, bound, incumbent, tab.off, tab.t_low,
                        tab.opt, tab.src, tab.touched, limit)

    found_opt = False

    def incumbent_run(limit: int) -> int:
        """The run with the incumbent, stopped after ``limit`` pushes: its
        pushes, or -1 when stopped (the table then reset)."""
        n_f = dense(inc, limit)
        logger.debug("incumbent run (at most %d pushes): %d (%.2f s)", limit, n_f,
                     time.perf_counter() - t0)
        if n_f < 0:
            tab.reset()
        return n_f

    if tc and K * (T + 1) > GUESS_MIN_TABLE:
        # Two searches, raced. (a) The run with the incumbent: short when
        # the incumbent is close to the optimum. (b) The optimum lies in
        # [inc, bound(∅)]; a run with a guess g above inc keeps only what
        # can still reach g: when the optimum is below g it finds nothing
        # and costs little; when it finds a chain, that chain is optimal.
        # Guesses step down from the top by 1/GUESS_STEPS of the interval
        # left, so the run that succeeds is close to the optimum (the cost
        # of a run grows fast as its guess goes below the optimum); the
        # first steps are 1, 2, 4, ... (an optimum close to the bound is
        # found in a few cheap runs). (a) runs first with GUESS_FIRST_PUSHES
        # pushes at most, then again each time the guesses have spent
        # GUESS_RACE times its last limit, with what they have spent as its
        # limit: when the incumbent is optimal (or nearly), the guesses
        # near it each cost about as much as (a), which then wins.
        limit = GUESS_FIRST_PUSHES
        n_f = incumbent_run(limit)
        pushes += limit if n_f < 0 else n_f
        found_opt = n_f >= 0
        lo, hi = inc, int(bound[0]) + 1
        first, spent = 1, 0
        while not found_opt and hi - lo > 1:
            guess = hi - min(first, max(1, (hi - lo) // GUESS_STEPS))
            first *= 2
            n_g = dense(guess, 0)
            pushes += n_g
            spent += n_g
            reached = tab.reached()
            logger.debug("guess %d: %d pushes, %s (%.2f s)", guess, n_g,
                         "found" if len(reached) else "none", time.perf_counter() - t0)
            if len(reached) and reached[-1] >= guess:
                found_opt = True
                break
            hi = guess
            tab.reset()
            if spent >= GUESS_RACE * limit:
                limit = spent
                n_f = incumbent_run(limit)
                pushes += limit if n_f < 0 else n_f
                found_opt = n_f >= 0
    if not found_opt:  # (tc: nothing above the incumbent, which is optimal)
        n_f = dense(inc, 0)
        pushes += n_f
        logger.debug("dense: %d pushes (%.2f s)", n_f, time.perf_counter() - t0)
    reached = tab.reached()
    # Never empty: the incumbent's chain survives every pruning.
    t_end = int(reached[-1] if tc else reached[0])
    e = tab.entry(K - 1, t_end)
    retained_m = int(tab.opt[e])
    entries = [e]
    first = int(tab.off[1])  # entries below it are row 0's (∅)
    while e >= first:
        e = int(tab.src[e])
        entries.append(e)
    chain = (np.searchsorted(tab.off, entries[::-1], "right") - 1).tolist()
    return DPResult(chain, float(t_end), retained_m, int(pushes),
                    int(kn.count_states(tab.opt, tab.off, tab.touched)))


class _Table:
    """The compiled dense DP's table (see :func:`~chainer_recompute.core.kernels.dp.dense`).

    Each row L holds only the retained times that can occur there and
    survive the pruning: at most T of the non-sinks in L (only they are
    ever kept), at least ``incumbent - bound(L)`` (tc; any guess is above
    the incumbent), at most the incumbent (mc); none for rows that cannot
    reach V (``cap < 0``). It is left uninitialised: the kernel fills a row
    when it first writes it and reads only rows written (touched), so rows
    never reached cost no memory (and no page faults: a full K x (T + 1)
    table can take longer to fault in than the DP takes to run).
    """

    def __init__(self, pairs: _Pairs, cap: np.ndarray, incumbent: int, tc: bool) -> None:
        K = pairs.K
        t_top = pairs.r0[0] - pairs.r0  # T of the non-sinks in L
        if tc:
            self.t_low = np.maximum(incumbent - pairs.r0, 0)
        else:
            self.t_low = np.zeros(K, dtype=np.int64)
            t_top = np.minimum(t_top, incumbent)
        width = np.where(cap >= 0, np.maximum(t_top - self.t_low + 1, 0), 0)
        self.off = np.zeros(K + 1, dtype=np.int64)
        np.cumsum(width, out=self.off[1:])
        self.opt = np.empty(int(self.off[K]), dtype=np.int64)
        self.src = np.empty(int(self.off[K]), dtype=np.int32)  # < COMPILED_DENSE_LIMIT
        self.touched = np.zeros(K, dtype=np.bool_)
        self.K = K

    def reset(self) -> None:
        self.touched[:] = False  # rows are filled again when first written

    def entry(self, row: int, t: int) -> int:
        return int(self.off[row] - self.t_low[row]) + t

    def reached(self) -> np.ndarray:
        """The retained times reached at V, increasing."""
        K = self.K
        if not self.touched[K - 1]:
            return np.zeros(0, dtype=np.int64)
        from ...kernels import dp as kn
        return self.t_low[K - 1] + np.flatnonzero(
            self.opt[self.off[K - 1]:self.off[K]] != kn.INF)


def _closure_rows(family: LowerSetFamily) -> Optional[np.ndarray]:
    """The family's rows that are ∅, V or the ancestor closure of a node
    (every one, in a family of all lower sets), or None when some is not
    a row or when they are every row (cached)."""
    rows = family.cache.get("closure_rows", False)
    if rows is not False:
        return rows
    from ...lower_sets import _n_words, _rows_of_masks, ancestor_masks
    nw = _n_words(family.graph.n)
    want = _rows_of_masks(ancestor_masks(family.graph), nw)
    hit = np.ones((len(want), len(family)), dtype=bool)
    for w in range(nw):
        hit &= want[:, w, None] == family.words[None, :, w]
    rows = None
    if hit.any(axis=1).all():
        rows = np.unique(np.concatenate([[0, len(family) - 1], hit.argmax(axis=1)]))
        if len(rows) == len(family):  # the family is the closures: nothing to gain
            rows = None
    family.cache["closure_rows"] = rows
    return rows
