"""Chain (RNN) policies of Gruslys et al. and Griewank's revolve
(PAPER.md §7): tables, policies as schedules of operations, and their
costs in slots and in bytes.

Pure core: numpy only. A chain is ``t`` steps of one recurrent cell; a
*slot* holds one hidden state (what a step needs to be run again: the
recurrent state, and the RNG state of its dropout masks); a step's
*internal state* (everything its backward reads) takes ``alpha`` slots.
Costs are counted in forward steps, the first forward pass included:
plain BPTT costs ``t`` and keeps every internal state.

Tables (indices ``C[t, m]``: cost of reversing ``t`` steps with ``m``
slots, the slot of the subsequence's start state included; ``Y[t, m]``:
the split; ``K[t, m]``: for MSM, which kind of state the split stores):

- BPTT-HSM: ``C(t, m) = min_{1<=y<t} [y + C(t-y, m-1) + C(y, m)]``,
  ``C(0, m) = 0``, ``C(1, m) = 1``, ``C(t, 1) = t(t+1)/2``: run ``y``
  steps, store the hidden state, reverse the right part with one slot
  less, then the left part.
- BPTT-ISM: ``C(t, m) = min_{1<=y<=t} [y + C(t-y, m-alpha) + C(y-1, m)]``
  for ``m >= alpha`` (``t(t+1)/2`` below): run ``y`` steps, the last one
  with its internal state kept (it holds its output hidden state, which
  starts the right part), reverse the right part, backpropagate the kept
  step, then the left part.
- BPTT-MSM: the cheaper of the two at every split.
- revolve: the HSM recursion with Griewank's closed-form split, no table.

HSM's and ISM's columns ``C(., m)`` are convex in ``t``, and each is the
min-plus convolution of two convex sequences (``a(y) = y + C(y, m)`` or
``y + C(y-1, m)``, and the column ``m-1`` or ``m-alpha``): merging their
slopes builds a whole row of the table in a few vectorised operations,
``O(t m)`` in all instead of ``O(t^2 m)``. MSM's columns are not convex
(a min of two convex functions), so its table is the plain DP, vectorised
over ``m`` and cut by the bound ``t + y - 1 <= C <= min(HSM, ISM)``.
Tables are cached per (policy, alpha) and grown on demand: every ``(t, m)``
up to the largest asked is answered from one computation.

Schedules are streams of operations on positions ``0..t`` of the chain
(position ``p`` is the state before step ``p``): ``('advance', a, b)``
runs steps ``a..b-1`` without a graph, ``('store', p)`` / ``('restore', p)``
/ ``('free', p)`` keep, go back to and drop a checkpoint,
``('keep', k)`` runs step ``k`` building its graph and keeps it,
``('backward', k)`` backpropagates a kept step, ``('leaf', k)`` does both
at once. :func:`simulate_slots` counts their forward steps and slots,
:func:`simulate_bytes` their bytes from measured sizes.

References:
    Gruslys, Munos, Danihelka, Lanctot, Graves, "Memory-Efficient
    Backpropagation Through Time", NIPS 2016, §3.
    Griewank, Walther, "Algorithm 799: revolve", ACM TOMS 26(1), 2000.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from math import comb
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import BudgetError, GraphError, RecomputeError, UnknownSolverError

logger = logging.getLogger(__name__)

__all__ = ["POLICIES", "ChainTable", "ByteSizes", "bptt_hsm_table", "bptt_ism_table",
           "bptt_msm_table", "chain_table", "clear_table_cache", "table_cache_bytes", "hsm_policy", "max_useful_slots",
           "plain_schedule", "policy_cost", "revolve_beta", "revolve_min_forward_steps", "revolve_split",
           "schedule", "simulate_bytes", "simulate_slots", "check_chain", "CallBytes",
           "StepFunction", "StepGraph", "replay_plain", "plain_peak_bytes"]

#: Policy names, as accepted by :func:`schedule` and the runtime.
POLICIES = ("hsm", "ism", "msm", "revolve")

# Kinds of split in K[t, m].
QUAD, HIDDEN, INTERNAL = 0, 1, 2

Op = Tuple  # ('advance', a, b) | (name, position)


# --------------------------------------------------------------------------
# Input checks.

def check_chain(policy: str, t: int, m: int, alpha: int = 1, *, top_level: bool = True) -> None:
    """Raise the library's errors for a chain problem that makes no sense.

    Args:
        policy: one of :data:`POLICIES`.
        t: number of steps (>= 1).
        m: slots (>= 1, and at most :func:`max_useful_slots` when
            ``top_level``).
        alpha: slots of one internal state (>= 1).
        top_level: check ``m`` against what ``t`` steps can use and ISM's
            ``alpha <= m`` (the tables themselves accept any size).

    Raises:
        UnknownSolverError: unknown policy.
        GraphError: ``t < 1``.
        BudgetError: ``m < 1``, ``alpha < 1``, ``m`` above what the chain
            can use, or ISM with ``alpha > m``.

    >>> check_chain('hsm', 10, 3)
    >>> check_chain('hsm', 0, 3)
    Traceback (most recent call last):
    ...
    chainer_recompute.core.errors.GraphError: a chain of t=0 steps has nothing to backpropagate; t must be at least 1
    """
    if policy not in POLICIES:
        raise UnknownSolverError(f"unknown chain policy {policy!r}; known: {sorted(POLICIES)}")
    if not isinstance(t, (int, np.integer)) or t < 1:
        raise GraphError(f"a chain of t={t} steps has nothing to backpropagate; t must be "
                         f"at least 1")
    if not isinstance(alpha, (int, np.integer)) or alpha < 1:
        raise BudgetError(f"alpha={alpha}: an internal state takes at least one slot; "
                          f"alpha must be an integer >= 1")
    if not isinstance(m, (int, np.integer)) or m < 1:
        raise BudgetError(f"m={m} slots: at least one slot is needed to hold the start "
                          f"state of the chain; pass m >= 1")
    if top_level:
        most = max_useful_slots(policy, t, alpha)
        if m > most:
            raise BudgetError(f"m={m} slots is more than {policy.upper()} can use on t={t} "
                              f"steps (at most {most}: beyond that nothing is recomputed "
                              f"that more memory could save); pass m <= {most}, or a byte "
                              f"budget, which is capped there")
        if policy == "ism" and alpha > m:
            raise BudgetError(f"ISM stores whole internal states of alpha={alpha} slots, "
                              f"more than m={m}; give at least {alpha} slots, or use "
                              f"policy 'hsm' or 'msm', which store hidden states")


def max_useful_slots(policy: str, t: int, alpha: int = 1) -> int:
    """Slots beyond which a policy's cost no longer falls: ``t`` for
    HSM and revolve (every hidden state stored), ``alpha (t-1) + 1`` for
    ISM and MSM (every internal state stored: plain BPTT's cost ``t``).

    >>> max_useful_slots('hsm', 100), max_useful_slots('msm', 100, alpha=4)
    (100, 397)
    """
    if policy in ("hsm", "revolve"):
        return max(int(t), 1)
    return max(int(alpha) * (int(t) - 1) + 1, 1)


# --------------------------------------------------------------------------
# Tables.

def _empty(t_max: int, m_max: int) -> np.ndarray:
    c = np.full((t_max + 1, m_max + 1), np.inf)
    c[0, :] = 0.0
    if t_max >= 1:
        c[1, 1:] = 1.0
    return c


def _quadratic(t_max: int) -> np.ndarray:
    ts = np.arange(t_max + 1, dtype=np.float64)
    return ts * (ts + 1) / 2


def _hsm_merge(t_max: int, m_max: int) -> Tuple[np.ndarray, np.ndarray]:
    """HSM by merging slopes, one vectorised row at a time.

    Column ``m >= 2``: ``C(t, m) = (a * b)(t)``, the min-plus convolution of
    ``a(y) = y + C(y, m)`` (``y >= 1``) and ``b(s) = C(s, m-1)``
    (``s >= 1``). Both are convex (``C(., 1)`` is quadratic; a convolution
    of convex sequences is convex, and ``a`` on ``y < t`` only needs rows
    already built), so ``C(t, m) = C(t-1, m) + min(next slope of a, next
    slope of b)`` and the split ``y`` is one plus the slopes taken from
    ``a``.
    """
    c = _empty(t_max, m_max)
    y = np.zeros((t_max + 1, m_max + 1), dtype=np.int32)
    if m_max >= 1:
        c[:, 1] = _quadratic(t_max)
    if m_max < 2 or t_max < 2:
        return c, y
    cols = np.arange(2, m_max + 1)
    c[2, 2:] = 3.0
    y[2, 2:] = 1
    i = np.zeros(len(cols), dtype=np.int64)  # slopes of a taken
    for t in range(3, t_max + 1):
        j = (t - 3) - i  # slopes of b taken
        da = 1.0 + c[2 + i, cols] - c[1 + i, cols]
        db = c[2 + j, cols - 1] - c[1 + j, cols - 1]
        take_a = da <= db
        c[t, 2:] = c[t - 1, 2:] + np.where(take_a, da, db)
        i += take_a
        y[t, 2:] = 1 + i
    return c, y


def _ism_merge(t_max: int, m_max: int, alpha: int) -> Tuple[np.ndarray, np.ndarray]:
    """ISM by merging slopes (see :func:`_hsm_merge`): for ``m >= alpha``,
    ``C(., m)`` is the min-plus convolution of ``a(y) = y + C(y-1, m)``
    (``y >= 1``) and ``b(s) = C(s, m-alpha)`` (``s >= 0``); columns below
    ``alpha`` are quadratic."""
    c = _empty(t_max, m_max)
    y = np.zeros((t_max + 1, m_max + 1), dtype=np.int32)
    quad = _quadratic(t_max)
    for m in range(1, min(alpha, m_max + 1)):
        c[:, m] = quad
    if m_max < alpha or t_max < 1:
        return c, y
    cols = np.arange(alpha, m_max + 1)
    y[1, alpha:] = 1
    i = np.zeros(len(cols), dtype=np.int64)
    with np.errstate(invalid="ignore"):
        for t in range(2, t_max + 1):
            j = (t - 2) - i
            da = 1.0 + c[1 + i, cols] - c[i, cols]
            db = c[j + 1, cols - alpha] - c[j, cols - alpha]  # inf where m - alpha = 0
            take_a = ~(db < da)
            c[t, alpha:] = c[t - 1, alpha:] + np.where(take_a, da, db)
            i += take_a
            y[t, alpha:] = 1 + i
    return c, y


def _msm_dp(t_max: int, m_max: int, alpha: int, hsm: np.ndarray,
            ism: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MSM by the plain DP over splits, vectorised over ``m``.

    A split at ``y`` costs at least ``t + y - 1`` (every step runs at
    least once), and the optimum is at most ``min(HSM, ISM)``; splits
    beyond ``min(HSM, ISM) - t + 1`` are never tried. Ties keep the hidden
    state (less memory).
    """
    c = _empty(t_max, m_max)
    ysplit = np.zeros((t_max + 1, m_max + 1), dtype=np.int32)
    kind = np.zeros((t_max + 1, m_max + 1), dtype=np.int8)
    if m_max >= 1:
        c[:, 1] = _quadratic(t_max)
    if m_max >= 1 and t_max >= 1:
        kind[1, 1:] = QUAD
    if m_max < 2:
        return c, ysplit, kind
    ms = np.arange(2, m_max + 1)
    chunk_elems = 1 << 20
    for t in range(2, t_max + 1):
        ub = np.minimum(hsm[t, 2:], ism[t, 2:])
        bound = np.clip(ub - t + 1, 1, t).astype(np.int64)
        bound = np.maximum.accumulate(bound[::-1])[::-1]  # non-increasing in m
        best = np.full(len(ms), np.inf)
        best_y = np.zeros(len(ms), dtype=np.int32)
        best_k = np.zeros(len(ms), dtype=np.int8)
        ymax = int(bound[0])
        y0 = 1
        while y0 <= ymax:
            ncols = int(np.searchsorted(-bound, -y0, side="right"))  # columns with bound >= y0
            if ncols == 0:
                break
            y1 = min(ymax + 1, y0 + max(1, chunk_elems // ncols))
            yy = np.arange(y0, y1)
            sl = slice(0, ncols)
            mm = ms[sl]
            # hidden: y + C(y, m) + C(t-y, m-1), y <= t-1
            yh = yy[yy <= t - 1]
            if len(yh):
                v = yh[:, None] + c[yh][:, mm] + c[t - yh][:, mm - 1]
                k = np.argmin(v, axis=0)
                val = v[k, np.arange(ncols)]
                better = val < best[sl]
                best[sl] = np.where(better, val, best[sl])
                best_y[sl] = np.where(better, yh[k], best_y[sl])
                best_k[sl] = np.where(better, HIDDEN, best_k[sl])
            # internal: y + C(y-1, m) + C(t-y, m-alpha), m >= alpha
            first = max(0, alpha - 2)
            if first < ncols:
                mi = mm[first:]
                v = yy[:, None] + c[yy - 1][:, mi] + c[t - yy][:, mi - alpha]
                k = np.argmin(v, axis=0)
                val = v[k, np.arange(len(mi))]
                sub = slice(first, ncols)
                better = val < best[sub]
                best[sub] = np.where(better, val, best[sub])
                best_y[sub] = np.where(better, yy[k], best_y[sub])
                best_k[sub] = np.where(better, INTERNAL, best_k[sub])
            y0 = y1
        c[t, 2:] = best
        ysplit[t, 2:] = best_y
        kind[t, 2:] = best_k
    return c, ysplit, kind


@dataclasses.dataclass(frozen=True)
class ChainTable:
    """A cached DP table.

    Attributes:
        policy: ``'hsm'``, ``'ism'`` or ``'msm'``.
        alpha: slots of an internal state.
        cost: ``cost[t, m]``, forward steps (float64, ``inf`` where no
            policy exists: ``m = 0``).
        split: ``split[t, m]``, the ``y`` of the first split (0: none).
        kind: ``kind[t, m]``: 0 quadratic/leaf, 1 hidden, 2 internal.
        build_time_s: seconds the table took.
    """

    policy: str
    alpha: int
    cost: np.ndarray
    split: np.ndarray
    kind: np.ndarray
    build_time_s: float

    @property
    def t_max(self) -> int:
        return self.cost.shape[0] - 1

    @property
    def m_max(self) -> int:
        return self.cost.shape[1] - 1

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays of this table."""
        return int(self.cost.nbytes + self.split.nbytes + self.kind.nbytes)


_CACHE: Dict[Tuple[str, int], ChainTable] = {}


def _columns(cost: np.ndarray, t_max: int, m_max: int) -> np.ndarray:
    """``cost[:t_max+1, :m_max+1]``, the columns past a saturated table's
    last repeated (they are equal)."""
    cost = cost[:t_max + 1, :m_max + 1]
    if cost.shape[1] < m_max + 1:
        pad = np.repeat(cost[:, -1:], m_max + 1 - cost.shape[1], axis=1)
        cost = np.concatenate([cost, pad], axis=1)
    return cost


def clear_table_cache() -> None:
    """Forget every cached table."""
    _CACHE.clear()


def table_cache_bytes() -> int:
    """Bytes of the cached tables' arrays (host memory for planning,
    outside any budget)."""
    return sum(tab.nbytes for tab in _CACHE.values())


def chain_table(policy: str, t: int, m: int, alpha: int = 1) -> ChainTable:
    """The DP table of ``policy`` covering ``(t, m)``, from the cache when
    a table at least that large was built before.

    ``m`` is capped at :func:`max_useful_slots` (columns beyond are equal).
    A larger request grows the cached table to cover both.

    >>> tab = chain_table('hsm', 8, 3)
    >>> int(tab.cost[8, 3]), int(tab.split[8, 3]) > 0
    (19, True)
    >>> chain_table('hsm', 5, 2) is tab
    True
    """
    if policy == "revolve":
        policy = "hsm"
    if policy not in ("hsm", "ism", "msm"):
        raise UnknownSolverError(f"no table for policy {policy!r}; known: ['hsm', 'ism', 'msm']")
    if t < 0 or m < 0 or alpha < 1:
        raise BudgetError(f"table size t={t}, m={m}, alpha={alpha} must be non-negative "
                          f"(alpha >= 1)")
    key_alpha = 1 if policy == "hsm" else int(alpha)
    m = min(int(m), max_useful_slots(policy, max(int(t), 1), key_alpha))
    key = (policy, key_alpha)
    cached = _CACHE.get(key)
    if cached is not None and cached.t_max >= t and cached.m_max >= m:
        return cached
    t_new = max(int(t), cached.t_max if cached else 0)
    m_new = max(int(m), cached.m_max if cached else 0)
    start = time.perf_counter()
    if policy == "hsm":
        cost, split = _hsm_merge(t_new, m_new)
        kind = np.where(split > 0, HIDDEN, QUAD).astype(np.int8)
    elif policy == "ism":
        cost, split = _ism_merge(t_new, m_new, key_alpha)
        kind = np.where(split > 0, INTERNAL, QUAD).astype(np.int8)
    else:
        hsm = _columns(chain_table("hsm", t_new, m_new).cost, t_new, m_new)
        ism = _columns(chain_table("ism", t_new, m_new, key_alpha).cost, t_new, m_new)
        cost, split, kind = _msm_dp(t_new, m_new, key_alpha, hsm, ism)
    table = ChainTable(policy, key_alpha, cost, split, kind, time.perf_counter() - start)
    logger.info("built the %s table t<=%d, m<=%d, alpha=%d in %.3f s (%d bytes)", policy,
                t_new, m_new, key_alpha, table.build_time_s, table.nbytes)
    _CACHE[key] = table
    return table


def bptt_hsm_table(t_max: int, m_max: int) -> Tuple[np.ndarray, np.ndarray]:
    """BPTT-HSM: C(t, m) = min_{1≤y<t} [y + C(t-y, m-1) + C(y, m)], with
    C(0, m) = 0, C(1, m) = 1, C(t, 1) = t(t+1)/2.

    Returns ``(C, Y)``: the cost table of shape ``(t_max+1, m_max+1)``
    (``inf`` where m = 0) and the argmin split ``Y[t, m]`` (0 = none).

    References:
        Gruslys, Munos, Danihelka, Lanctot, Graves, "Memory-Efficient
        Backpropagation Through Time", NIPS 2016, §3 (BPTT-HSM).

    >>> C, _ = bptt_hsm_table(8, 3)
    >>> int(C[8, 3]), int(C[8, 1])
    (19, 36)
    """
    return _hsm_merge(int(t_max), int(m_max))


def bptt_ism_table(t_max: int, m_max: int, alpha: int = 2) -> np.ndarray:
    """BPTT-ISM: a stored internal state takes ``alpha`` slots:
    C(t, m) = min_{1≤y≤t} [y + C(t-y, m-α) + C(y-1, m)]; below α slots the
    quadratic fallback t(t+1)/2.

    References:
        Gruslys et al., NIPS 2016, §3 (BPTT-ISM).

    >>> int(bptt_ism_table(4, 4, alpha=2)[4, 4]) <= 10
    True
    """
    return _ism_merge(int(t_max), int(m_max), int(alpha))[0]


def bptt_msm_table(t_max: int, m_max: int, alpha: int = 2) -> np.ndarray:
    """BPTT-MSM: at each split the cheaper of storing a hidden state
    (1 slot, HSM) or an internal state (α slots, ISM).

    References:
        Gruslys et al., NIPS 2016, §3 (BPTT-MSM).

    >>> H, _ = bptt_hsm_table(30, 5)
    >>> bool((bptt_msm_table(30, 5)[1:, 1:] <= H[1:, 1:]).all())
    True
    """
    t_max, m_max, alpha = int(t_max), int(m_max), int(alpha)
    hsm = _hsm_merge(t_max, m_max)[0]
    ism = _ism_merge(t_max, m_max, alpha)[0]
    return _msm_dp(t_max, m_max, alpha, hsm, ism)[0]


def hsm_policy(t: int, m: int, ysplit: Optional[np.ndarray] = None) -> List[Tuple[int, int, int]]:
    """The BPTT-HSM recursion for a sequence of ``t`` steps and ``m``
    slots, as ``(offset, length, slots)`` of every subproblem that stores
    a hidden state, in execution order: run ``y`` forward steps from the
    start of the subproblem, store the state, solve the right part with
    one slot less, then the left part.

    >>> hsm_policy(4, 2)[0]
    (0, 4, 2)
    """
    if ysplit is None:
        _, ysplit = bptt_hsm_table(t, m)
    out: List[Tuple[int, int, int]] = []
    stack = [(0, t, m)]
    while stack:
        off, length, slots = stack.pop()
        if length <= 1 or slots <= 1:
            continue
        y = int(ysplit[length, slots])
        out.append((off, length, slots))
        stack.append((off, y, slots))
        stack.append((off + y, length - y, slots - 1))
    return out


# --------------------------------------------------------------------------
# revolve.

def revolve_beta(c: int, r: int) -> int:
    """β(c, r) = (c+r)! / (c! r!): the most steps reversible with ``c``
    snapshots and ``r`` repetitions.

    References:
        Griewank, Walther, "Algorithm 799: revolve", ACM TOMS 26(1), 2000.

    >>> revolve_beta(2, 3)
    10
    """
    if c < 0 or r < 0:
        return 0
    return comb(c + r, c)


def revolve_min_forward_steps(length: int, snapshots: int) -> int:
    """Least extra forward steps to reverse ``length`` steps with
    ``snapshots`` snapshots: r·l - β(c+1, r-1) for β(c, r-1) < l ≤ β(c, r).
    For a uniform chain this equals BPTT-HSM's C(t, m) - t with m = c.

    >>> revolve_min_forward_steps(8, 3)
    11
    """
    r = 0
    while revolve_beta(snapshots, r) < length:
        r += 1
    return r * length - revolve_beta(snapshots + 1, r - 1)


def revolve_split(length: int, snapshots: int) -> int:
    """Griewank's optimal first step: how far to advance before storing
    the next snapshot, reversing ``length >= 2`` steps with ``snapshots
    >= 2`` snapshots (the start's included), as in ``revolve``'s
    ``advance`` action.

    With ``r`` the least repetition number such that β(c, r) >= l:
    advance β(c, r-2) when l <= β(c, r-1) + β(c-2, r-1); β(c, r-1) when
    l >= β(c, r) - β(c-3, r); else l - β(c-1, r-1) - β(c-2, r-1).

    References:
        Griewank, Walther, "Algorithm 799: revolve", ACM TOMS 26(1), 2000.

    >>> revolve_split(8, 3), revolve_split(100, 2)
    (3, 86)
    """
    c, l = int(snapshots), int(length)
    if l < 2 or c < 2:
        raise BudgetError(f"revolve splits need at least 2 steps and 2 snapshots, got "
                          f"length={l}, snapshots={c}")
    r = 0
    while revolve_beta(c, r) < l:
        r += 1
    b = revolve_beta
    if l <= b(c, r - 1) + b(c - 2, r - 1):
        y = b(c, r - 2)
    elif l >= b(c, r) - b(c - 3, r):
        y = b(c, r - 1)
    else:
        y = l - b(c - 1, r - 1) - b(c - 2, r - 1)
    return int(min(max(y, 1), l - 1))


def policy_cost(policy: str, t: int, m: int, alpha: int = 1) -> int:
    """Forward steps of ``policy`` on ``t`` steps with ``m`` slots
    (plain BPTT: ``t``).

    >>> policy_cost('hsm', 1000, 10), policy_cost('revolve', 1000, 10)
    (4636, 4636)
    """
    check_chain(policy, t, m, alpha, top_level=False)
    if policy == "revolve":  # Griewank's schedule is optimal: the closed form
        return int(t) + revolve_min_forward_steps(int(t), int(m))
    return int(chain_table(policy, t, m, alpha).cost[t, min(m, max_useful_slots(policy, t, alpha))])


# --------------------------------------------------------------------------
# Schedules.

def schedule(policy: str, t: int, m: int, alpha: int = 1, *,
             table: Optional[ChainTable] = None) -> Iterator[Op]:
    """The operations of ``policy`` reversing ``t`` steps with ``m`` slots,
    lazily (``O(t)`` operations; memory of the generator ``O(t)``).

    The stream starts with ``('store', 0)`` and ends with ``('free', 0)``;
    its first part, up to the first ``leaf``/``backward``, is the forward
    pass: it runs every step once, in order.

    Args:
        policy: ``'hsm'``, ``'ism'``, ``'msm'`` or ``'revolve'``.
        t: steps.
        m: slots (capped at :func:`max_useful_slots`).
        alpha: slots of an internal state (ISM, MSM).
        table: a table to read splits from (default: the cached one).

    >>> list(schedule('hsm', 3, 2))  # doctest: +NORMALIZE_WHITESPACE
    [('store', 0), ('advance', 0, 1), ('store', 1), ('advance', 1, 2), ('leaf', 2),
     ('restore', 1), ('leaf', 1), ('free', 1), ('restore', 0), ('leaf', 0), ('free', 0)]
    """
    check_chain(policy, t, m, alpha, top_level=False)
    t, m, alpha = int(t), int(m), int(alpha)
    m = min(m, max_useful_slots(policy, t, alpha))
    if policy != "revolve" and table is None:
        table = chain_table(policy, t, m, alpha)

    def choose(length: int, slots: int) -> Tuple[int, int]:
        if policy == "revolve":
            return (QUAD, 0) if slots <= 1 else (HIDDEN, revolve_split(length, slots))
        assert table is not None
        slots = min(slots, table.m_max)
        k, y = int(table.kind[length, slots]), int(table.split[length, slots])
        if y <= 0:
            return QUAD, 0
        return k, y

    running: Optional[int] = 0
    yield ("store", 0)
    # Tasks: ('solve', off, length, slots) | ('goto', off) | op tuples.
    stack: List[Tuple] = [("free", 0), ("solve", 0, t, m)]
    while stack:
        task = stack.pop()
        name = task[0]
        if name == "goto":
            if running != task[1]:
                running = task[1]
                yield ("restore", task[1])
            continue
        if name != "solve":
            if name == "advance":
                running = task[2]
            elif name == "keep":
                running = task[1] + 1
            elif name in ("leaf", "backward"):
                running = None
            yield task
            continue
        _, off, length, slots = task
        if length == 0:
            continue
        if length == 1:
            stack += [("leaf", off), ("goto", off)]
            continue
        k, y = choose(length, slots)
        if k == QUAD:
            for step in range(off, off + length):  # the last pushed runs first
                stack.append(("leaf", step))
                if step > off:
                    stack.append(("advance", off, step))
                stack.append(("goto", off))
        elif k == HIDDEN:
            stack += [("solve", off, y, slots), ("free", off + y),
                      ("solve", off + y, length - y, slots - 1), ("store", off + y),
                      ("advance", off, off + y), ("goto", off)]
        elif y == length:  # nothing to the right: the kept step is a leaf
            stack += [("solve", off, y - 1, slots), ("leaf", off + y - 1)]
            if y > 1:
                stack.append(("advance", off, off + y - 1))
            stack.append(("goto", off))
        else:
            later = [("solve", off, y - 1, slots), ("backward", off + y - 1),
                     ("free", off + y), ("solve", off + y, length - y, slots - alpha),
                     ("store", off + y), ("keep", off + y - 1)]
            if y > 1:
                later.append(("advance", off, off + y - 1))
            later.append(("goto", off))
            stack += later


def plain_schedule(t: int) -> Iterator[Op]:
    """Plain BPTT as a schedule: every step kept, then backpropagated.

    >>> list(plain_schedule(2))
    [('keep', 0), ('keep', 1), ('backward', 1), ('backward', 0)]
    """
    for k in range(t):
        yield ("keep", k)
    for k in range(t - 1, -1, -1):
        yield ("backward", k)


def simulate_slots(ops: Iterator[Op], alpha: int = 1) -> Tuple[int, int]:
    """``(forward steps, peak slots)`` of a schedule: a checkpoint takes
    one slot (none when it is the output of the step kept just before,
    which the internal state holds), a kept internal state ``alpha``;
    a ``leaf`` is working memory.

    >>> simulate_slots(schedule('hsm', 10, 3))
    (25, 3)
    """
    cost = 0
    live = peak = 0
    ckpt_cost: Dict[int, int] = {}
    last_kept: Optional[int] = None
    for op in ops:
        name = op[0]
        if name == "advance":
            cost += op[2] - op[1]
        elif name in ("leaf", "keep"):
            cost += 1
            if name == "keep":
                live += alpha
                last_kept = op[1]
                peak = max(peak, live)
                continue
        elif name == "backward":
            live -= alpha
        elif name == "store":
            c = 0 if last_kept is not None and last_kept + 1 == op[1] else 1
            ckpt_cost[op[1]] = c
            live += c
        elif name == "free":
            live -= ckpt_cost.pop(op[1])
        last_kept = None
        peak = max(peak, live)
    return cost, peak


@dataclasses.dataclass(frozen=True)
class ByteSizes:
    """Measured bytes of one step of a cell, for :func:`simulate_bytes`.

    Attributes:
        state: the recurrent state between two steps (all its arrays).
        rng: one saved RNG state (kept with every checkpoint).
        internal: what a step's graph keeps besides its input and output
            states (the internal state less the states; the model's
            outputs the graph holds too, such as ``L.Classifier``'s ``y``,
            included).
        retained_input: the part of its input state that a step's graph
            keeps alive by itself.
        grad: the gradient of a state.
        param_grads: parameter gradients, allocated by the first backward.
        advance_peak: highest bytes above those live before a step run
            without a graph, while it runs (its output included).
        keep_peak: the same for a step that builds its graph.
        backward_peak: the same for the backward of one step (parameter
            gradients already allocated: they accumulate).
        first_backward_peak: the same for the first backward, which
            allocates the parameter gradients (default: ``backward_peak +
            param_grads``).
        outputs: what the model keeps of the last step it ran besides its
            state (``L.Classifier``'s ``y`` and ``loss``); the forward
            pass's last are held through the backward pass too (they are
            put back at the end).
        outputs_shared: the part of ``outputs`` that a step's graph holds
            too (counted in ``internal`` while the graph is kept).
        state0: bytes of the start state that the call allocates (0 when
            it was live before the call).
    """

    state: int
    rng: int
    internal: int
    retained_input: int
    grad: int
    param_grads: int
    advance_peak: int
    keep_peak: int
    backward_peak: int
    state0: int = 0
    first_backward_peak: Optional[int] = None
    outputs: int = 0
    outputs_shared: int = 0

    @property
    def hidden_slot(self) -> int:
        """Bytes of one hidden-state slot: a state and its RNG state."""
        return self.state + self.rng

    @property
    def internal_slot(self) -> int:
        """Bytes of one stored internal state: its own arrays and its
        output state (and that state's RNG state, as the right part's
        start)."""
        return self.internal + self.state + self.rng

    @property
    def alpha(self) -> int:
        """Slots of an internal state: ``ceil(internal_slot / hidden_slot)``."""
        return max(1, -(-self.internal_slot // max(self.hidden_slot, 1)))


@dataclasses.dataclass(frozen=True)
class CallBytes:
    """What :func:`simulate_bytes` needs to know of the call besides the
    step's sizes (all default to a call that starts from nothing).

    Attributes:
        grads_before: parameter gradients live when the call starts (the
            previous iteration's, kept through the forward pass as
            Chainer's PTB loop and ``StandardUpdater`` do).
        grads_cleared: whether they are cleared before ``backward()``
            (``model.cleargrads()``); if not, the backward accumulates
            into them.
        outputs_before: bytes of the model's outputs live at the call (the
            previous iteration's ``L.Classifier.y``), let go when the
            first step replaces them.
        update_transient: the largest temporary of the optimizer update
            that follows the backward (0: no update counted).
        first_step_ran: the runtime ran step 0 without a graph before the
            schedule (:class:`~chainer_recompute.runtime.bptt.ChainRecompute`
            does, to find the state): its output state is the running
            state when the schedule starts.
    """

    grads_before: int = 0
    grads_cleared: bool = True
    outputs_before: int = 0
    update_transient: int = 0
    first_step_ran: bool = False


def simulate_bytes(ops: Iterator[Op], sizes: ByteSizes, t: int,
                   trace: Optional[List[Tuple[Op, int, int]]] = None,
                   call: Optional[CallBytes] = None) -> int:
    """Predicted peak bytes of a schedule above the bytes live when it
    starts, from one step's measured sizes, event by event.

    Every array is counted once however many holders it has:

    - a state (position ``p``) is held by the running state, a checkpoint,
      the kept graph of the step that made it (``OUT``), the model after
      the forward pass (the final state), or only in part
      (``retained_input``) by the kept graph of the step that reads it;
    - the model's outputs of step ``j`` (``L.Classifier``'s ``y``) are held
      by the model until the next step replaces them, and the forward
      pass's last through the backward; while step ``j``'s graph is kept,
      their ``outputs_shared`` part is in its internal state;
    - one state gradient lives from the first backward on, the parameter
      gradients from the first backward (the previous iteration's until
      then, see :class:`CallBytes`), one RNG state per checkpoint and one
      for the backward pass;
    - each step run adds its measured transient (``advance_peak``,
      ``keep_peak``, ``(first_)backward_peak``) on top of what is live; the
      optimizer update its largest temporary at the end.

    Args:
        ops: a schedule (:func:`schedule`, :func:`plain_schedule`).
        sizes: the step's measured sizes.
        t: steps.
        trace: if given, ``(op, live bytes after it, peak so far)`` is
            appended for every operation.
        call: what is live at the call (:class:`CallBytes`).

    >>> s = ByteSizes(100, 10, 1000, 50, 100, 5000, 150, 1200, 2000)
    >>> simulate_bytes(schedule('hsm', 20, 20), s, 20) < simulate_bytes(schedule('msm', 20, 100, 10), s, 20)
    True
    """
    call = call or CallBytes()
    RUN, CKPT, OUT, IN, FINAL = 1, 2, 4, 8, 16
    MODEL, FINAL_OUT = 1, 2
    state_holders: Dict[int, int] = {}
    out_holders: Dict[int, int] = {-1: MODEL}
    kept: set = set()
    counted: Dict[Tuple[str, int], int] = {("o", -1): call.outputs_before}
    shared = min(sizes.outputs_shared, sizes.outputs)
    live = 0

    def refresh(kind: str, p: int) -> None:
        nonlocal live
        if kind == "s":
            h = state_holders.get(p, 0)
            if p == 0:
                b = sizes.state0 if h else 0
            elif h & (RUN | CKPT | OUT | FINAL):
                b = sizes.state
            elif h & IN:
                b = min(sizes.retained_input, sizes.state)
            else:
                b = 0
        else:
            h = out_holders.get(p, 0)
            if not h:
                b = 0
            elif p < 0:
                b = call.outputs_before
            else:
                b = sizes.outputs - (shared if p in kept else 0)
        live += b - counted.get((kind, p), 0)
        counted[(kind, p)] = b

    def hold(kind: str, p: int, bit: int) -> None:
        table = state_holders if kind == "s" else out_holders
        table[p] = table.get(p, 0) | bit
        refresh(kind, p)

    def drop(kind: str, p: int, bit: int) -> None:
        table = state_holders if kind == "s" else out_holders
        h = table.get(p, 0) & ~bit
        if h:
            table[p] = h
        else:
            table.pop(p, None)
        refresh(kind, p)

    running: Optional[int] = 0
    model_at = -1  # the step whose outputs the model holds
    hold("s", 0, RUN)
    peak = 0
    grad_live = False
    params_live = False
    backward_started = False
    last_run = False  # step t-1 has run (its outputs are kept to the end)

    def move_running(to: Optional[int]) -> None:
        nonlocal running
        if running is not None:
            drop("s", running, RUN)
        running = to
        if to is not None:
            hold("s", to, RUN)

    def ran(k: int) -> None:
        """Step ``k`` ran: the model now holds its outputs."""
        nonlocal model_at, last_run
        hold("o", k, MODEL)
        if model_at != k:
            drop("o", model_at, MODEL)
        model_at = k
        if k == t - 1 and not last_run:
            last_run = True
            hold("o", k, FINAL_OUT)

    def advance_step(k: int) -> None:
        nonlocal peak
        peak = max(peak, live + sizes.advance_peak)
        ran(k)
        move_running(k + 1)

    def keep(k: int) -> None:
        nonlocal peak, live
        peak = max(peak, live + sizes.keep_peak)
        kept.add(k)
        live += sizes.internal
        hold("s", k + 1, OUT)
        hold("s", k, IN)
        if k + 1 == t:
            hold("s", t, FINAL)
        ran(k)
        move_running(k + 1)

    def backward(k: int) -> None:
        nonlocal peak, live, grad_live, params_live, backward_started
        if not backward_started:  # the backward pass saves the RNG state
            backward_started = True
            live += sizes.rng
        if params_live:
            extra = sizes.backward_peak
        elif call.grads_before and not call.grads_cleared:
            extra = sizes.backward_peak  # accumulates into the live gradients
            params_live = True
        else:
            live -= call.grads_before
            extra = (sizes.first_backward_peak if sizes.first_backward_peak is not None
                     else sizes.backward_peak + sizes.param_grads)
        peak = max(peak, live + extra)
        if not params_live:
            live += sizes.param_grads
            params_live = True
        live -= sizes.internal
        kept.discard(k)
        refresh("o", k)
        drop("s", k + 1, OUT)
        drop("s", k, IN)
        if not grad_live:
            live += sizes.grad
            grad_live = True

    pre_ran = call.first_step_ran and t >= 1
    if pre_ran:  # step 0 without a graph, before the schedule
        advance_step(0)
    for op in ops:
        name = op[0]
        if pre_ran and name in ("advance", "keep", "leaf") and op[1] == 0:
            pre_ran = False
            if name == "advance":
                if op[2] > 1:
                    advance_step(1)
                if op[2] > 2:  # uniform steps: the last one's holders suffice
                    advance_step(op[2] - 1)
                if trace is not None:
                    trace.append((op, live, peak))
                continue
            move_running(0)  # step 0 again, from the start state, to build its graph
        if name == "advance":
            a, b = op[1], op[2]
            advance_step(a)
            if b - a >= 2:  # uniform steps: the last one's holders suffice
                advance_step(b - 1)
        elif name == "store":
            hold("s", op[1], CKPT)
            live += sizes.rng
        elif name == "free":
            drop("s", op[1], CKPT)
            live -= sizes.rng
        elif name == "restore":
            move_running(op[1])
        elif name == "keep":
            keep(op[1])
        elif name == "backward":
            backward(op[1])
            move_running(None)
        elif name == "leaf":
            keep(op[1])
            backward(op[1])
            move_running(None)
        else:  # pragma: no cover
            raise RecomputeError(f"unknown chain operation {op!r}")
        peak = max(peak, live)
        if trace is not None:
            trace.append((op, live, peak))
    # the end of the backward pass: the state's gradient goes, then the update
    if grad_live:
        live -= sizes.grad
    peak = max(peak, live + call.update_transient)
    if trace is not None:
        trace.append((("update",), live, peak))
    return int(peak)


# --------------------------------------------------------------------------
# Plain BPTT as Chainer runs it.

@dataclasses.dataclass(frozen=True)
class StepFunction:
    """One function of a recorded step, for :func:`replay_plain`.

    Attributes:
        name: the function's label.
        inputs: variable indexes of its inputs, in order.
        outputs: variable indexes of its outputs.
        grads: per input, bytes of the new gradient buffer its backward
            makes (0: no gradient, or one that shares an output gradient).
        shares: per input, the position in ``outputs`` of the output whose
            gradient buffer its gradient is (or a view of), else -1.
        peak: the highest bytes above those live before its backward,
            while it runs.
    """

    name: str
    inputs: Tuple[int, ...]
    outputs: Tuple[int, ...]
    grads: Tuple[int, ...]
    shares: Tuple[int, ...]
    peak: int


@dataclasses.dataclass(frozen=True)
class StepGraph:
    """The graph of one step, recorded from a backward (see
    :func:`replay_plain`).

    Attributes:
        functions: in a topological order of the step.
        kinds: per variable: ``'state'`` (an input state, ``state_index``
            says which), ``'param'`` (a parameter, shared by all steps),
            ``'leaf'`` (another leaf: data, constants) or ``'inner'`` (made
            by a function of the step).
        state_index: per variable, which input state it is (-1 if none).
        creator: per variable, the index of the function that made it (-1
            for leaves).
        out_states: per entry of the state, the variable of the step's
            output state (-1: None).
        loss: the variable of the step's loss.
    """

    functions: Tuple[StepFunction, ...]
    kinds: Tuple[str, ...]
    state_index: Tuple[int, ...]
    creator: Tuple[int, ...]
    out_states: Tuple[int, ...]
    loss: int


def replay_plain(graph: StepGraph, forward_end_bytes: int, t: int, *,
                 grads_cleared: bool = True, state0_grads: bool = False) -> int:
    """Peak bytes of plain BPTT's ``backward()`` over ``t`` steps, as
    Chainer runs it, above the bytes live when the call started.

    Chainer keeps every step's graph until ``unchain_backward()``, and its
    backward pops functions by rank, highest first (ties: the first
    discovered), over the whole unroll: a function that does not depend on
    the recurrent state (an embedding, the input projection of the first
    layer) keeps its rank at every step and runs only at the very end, so
    the gradients of its outputs wait, one per step. This replays that
    order on ``t`` copies of the recorded step, with the summed loss
    (``loss = 0; loss += step_loss``) on top: gradient buffers are counted
    once however many variables share them, freed when the last one is
    consumed; a gradient arriving where one is waiting is summed into a
    new buffer; parameter gradients (and, with ``state0_grads``, the
    gradients of a start state that requires them) stay to the end.

    Args:
        graph: the recorded step.
        forward_end_bytes: bytes live when ``backward()`` starts, above the
            call's start (the forward pass's graphs and outputs).
        t: steps.
        grads_cleared: parameter gradients were cleared before the
            backward (else each parameter's first gradient is summed into
            the live one).
        state0_grads: the start state requires gradients (a state carried
            over from the previous iteration is a leaf that does).

    Returns:
        The peak of the backward pass (transients included).
    """
    import heapq

    nvar = len(graph.kinds)
    # global ids: a variable of step k is k * nvar + v; the start state,
    # parameters and the summed loss get ids past them
    base = t * nvar
    state0_ids = {}
    param_ids: Dict[int, int] = {}
    next_id = [base]

    def new_id() -> int:
        next_id[0] += 1
        return next_id[0] - 1

    def gid(k: int, v: int) -> int:
        if v < 0:
            return -1
        kind = graph.kinds[v]
        if kind == "param":
            if v not in param_ids:
                param_ids[v] = new_id()
            return param_ids[v]
        if kind == "state":
            j = graph.state_index[v]
            if k == 0:
                if not state0_grads:
                    return -1
                if j not in state0_ids:
                    state0_ids[j] = new_id()
                return state0_ids[j]
            prev = graph.out_states[j]
            if prev < 0:
                return -1
            return gid(k - 1, prev)
        return k * nvar + v

    # ranks: Chainer's FunctionNode.rank = max(input ranks), a variable's
    # rank is its creator's + 1 (leaves: 0)
    var_rank: Dict[int, int] = {}
    creator_of: Dict[int, Tuple[int, int]] = {}  # global var -> (step, function)
    fn_ranks: List[List[int]] = []
    for k in range(t):
        ranks = []
        for f_idx, f in enumerate(graph.functions):
            r = max((var_rank.get(gid(k, v), 0) for v in f.inputs), default=0)
            ranks.append(r)
            for v in f.outputs:
                g = gid(k, v)
                if g < 0:
                    continue
                var_rank[g] = r + 1
                creator_of[g] = (k, f_idx)
        fn_ranks.append(ranks)
    # the summed loss: S_0 = 0 + l_0 (AddConstant), S_k = S_{k-1} + l_k (Add)
    sum_out: List[int] = []
    sum_rank: List[int] = []
    prev_rank = None
    for k in range(t):
        lr = var_rank.get(gid(k, graph.loss), 0)
        r = lr if prev_rank is None else max(prev_rank, lr)
        sum_rank.append(r)
        sum_out.append(new_id())
        prev_rank = r + 1

    # gradient table: variable -> buffer; buffers: id -> [bytes, references]
    table: Dict[int, int] = {}
    buffers: Dict[int, List[int]] = {}
    level = forward_end_bytes
    peak = level

    def new_buffer(nbytes: int) -> int:
        nonlocal level
        b = new_id()
        buffers[b] = [nbytes, 0]
        level += nbytes
        return b

    def ref(b: int) -> None:
        buffers[b][1] += 1

    def unref(b: int) -> None:
        nonlocal level
        buf = buffers[b]
        buf[1] -= 1
        if buf[1] <= 0:
            level -= buf[0]
            del buffers[b]

    def give(var: int, b: Optional[int], nbytes: int) -> None:
        """Gradient buffer ``b`` (None: a new one of ``nbytes``) arrives at ``var``."""
        if b is None:
            b = new_buffer(nbytes)
        ref(b)
        old = table.get(var)
        if old is None and not grads_cleared and var in params:
            # the parameter's gradient from before: live already, held by the
            # parameter until the backward ends
            old = new_id()
            buffers[old] = [buffers[b][0], 2]
        if old is not None:  # summed into a new buffer
            size = max(buffers[old][0], buffers[b][0])
            s = new_buffer(size)
            ref(s)
            unref(old)
            unref(b)
            b = s
        table[var] = b

    params = set(param_ids.values())

    heap: List[Tuple[int, int, Tuple[str, int, int]]] = []
    seen: set = set()

    def add_cand(key: Tuple[str, int, int], rank: int) -> None:
        if key not in seen:
            heapq.heappush(heap, (-rank, len(seen), key))
            seen.add(key)

    # the loss gradient (a scalar) at the summed loss
    table[sum_out[-1]] = new_buffer(0)
    ref(table[sum_out[-1]])
    add_cand(("sum", t - 1, 0), sum_rank[-1])
    while heap:
        _, _, key = heapq.heappop(heap)
        kind, k, f_idx = key
        if kind == "sum":
            gy = table.pop(sum_out[k], None)
            if gy is None:
                continue
            if k > 0:
                give(sum_out[k - 1], gy, 0)
                add_cand(("sum", k - 1, 0), sum_rank[k - 1])
            lv = gid(k, graph.loss)
            give(lv, gy, 0)
            c = creator_of.get(lv)
            if c is not None:
                add_cand(("fn",) + c, fn_ranks[c[0]][c[1]])
            unref(gy)
            continue
        f = graph.functions[f_idx]
        outs = [gid(k, v) for v in f.outputs]
        gys = [table.pop(o, None) for o in outs]
        inputs = [gid(k, v) for v in f.inputs]
        targets = [i for i, g in enumerate(inputs) if g >= 0 and (f.grads[i] or f.shares[i] >= 0)]
        if targets:
            peak = max(peak, level + f.peak)
            done = set()
            for i in targets:
                x = inputs[i]
                if x in done:
                    continue
                done.add(x)
                s = f.shares[i]
                if s >= 0:
                    if gys[s] is None:
                        continue
                    give(x, gys[s], 0)
                else:
                    give(x, None, f.grads[i])
                c = creator_of.get(x)
                if c is not None:
                    add_cand(("fn",) + c, fn_ranks[c[0]][c[1]])
        for b in gys:
            if b is not None:
                unref(b)
        peak = max(peak, level)
    return int(peak)


def plain_peak_bytes(sizes: ByteSizes, t: int, graph: Optional[StepGraph] = None,
                     call: Optional[CallBytes] = None, *, state0_grads: bool = False) -> int:
    """Predicted peak of plain BPTT (every step's graph kept, one
    ``backward()``, ``unchain_backward()``, the update) above the bytes
    live at the call.

    The forward pass is :func:`simulate_bytes` of every step kept; the
    backward is :func:`replay_plain` on the recorded step (without one,
    :func:`simulate_bytes` of :func:`plain_schedule`, which frees each
    step's graph after its backward as the chain runner does and so
    predicts too little).

    >>> s = ByteSizes(100, 10, 1000, 50, 100, 5000, 150, 1200, 2000)
    >>> plain_peak_bytes(s, 10) >= 10 * 1000
    True
    """
    call = call or CallBytes()
    if graph is None:
        return simulate_bytes(plain_schedule(t), sizes, t, call=call)
    trace: List[Tuple[Op, int, int]] = []
    fwd = dataclasses.replace(call, update_transient=0, first_step_ran=False)
    forward_peak = simulate_bytes((("keep", k) for k in range(t)), sizes, t, trace=trace,
                                  call=fwd)
    live = trace[-2][1] if len(trace) >= 2 else 0  # before the closing ('update',) entry
    cleared = call.grads_cleared or not call.grads_before
    if cleared:
        live -= call.grads_before
    backward_peak = replay_plain(graph, live, t, grads_cleared=cleared,
                                 state0_grads=state0_grads)
    # after unchain_backward(): the last outputs, the final state, the gradients
    end = (sizes.outputs - call.outputs_before + sizes.state + sizes.param_grads
           - (call.grads_before if cleared else 0))
    return int(max(forward_peak, backward_peak, end + call.update_transient))
