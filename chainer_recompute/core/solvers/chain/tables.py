"""The chain policies' DP tables (BPTT-HSM, -ISM, -MSM of Gruslys et al.)
and the checks of a chain problem.

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

References:
    Gruslys, Munos, Danihelka, Lanctot, Graves, "Memory-Efficient
    Backpropagation Through Time", NIPS 2016, §3.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Dict, List, Tuple

import numpy as np

from ...errors import BudgetError, GraphError, UnknownSolverError

logger = logging.getLogger(__name__)

#: Policy names, as accepted by :func:`schedule` and the runtime.
POLICIES = ("hsm", "ism", "msm", "revolve")

# Kinds of split in K[t, m].
QUAD, HIDDEN, INTERNAL = 0, 1, 2



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


def cached_tables() -> List[ChainTable]:
    """The cached tables (a table grown on demand is a new object in its
    stead)."""
    return list(_CACHE.values())


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
