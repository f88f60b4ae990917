"""Chain (RNN) solvers of Gruslys et al. and Griewank's revolve
(PAPER.md §7).

Pure core: numpy only. Costs are counted in forward steps; memory in
hidden-state slots.
"""
from __future__ import annotations

import logging
from math import comb
from typing import List, Optional, Tuple

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["bptt_hsm_table", "bptt_ism_table", "bptt_msm_table", "hsm_policy", "revolve_beta",
           "revolve_min_forward_steps"]


def _base(t_max: int, m_max: int) -> np.ndarray:
    c = np.full((t_max + 1, m_max + 1), np.inf)
    c[0, :] = 0
    if t_max >= 1:
        c[1, 1:] = 1
    ts = np.arange(t_max + 1)
    c[:, 1] = ts * (ts + 1) // 2
    return c


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
    c = _base(t_max, m_max)
    ysplit = np.zeros((t_max + 1, m_max + 1), dtype=np.int64)
    for m in range(2, m_max + 1):
        for t in range(2, t_max + 1):
            y = np.arange(1, t)
            v = y + c[t - y, m - 1] + c[y, m]
            k = int(np.argmin(v))
            c[t, m] = v[k]
            ysplit[t, m] = y[k]
    return c, ysplit


def bptt_ism_table(t_max: int, m_max: int, alpha: int = 2) -> np.ndarray:
    """BPTT-ISM: a stored internal state takes ``alpha`` slots:
    C(t, m) = min_{1≤y≤t} [y + C(t-y, m-α) + C(y-1, m)]; below α slots the
    quadratic fallback t(t+1)/2.

    References:
        Gruslys et al., NIPS 2016, §3 (BPTT-ISM).

    >>> int(bptt_ism_table(4, 4, alpha=2)[4, 4]) <= 10
    True
    """
    c = _base(t_max, m_max)
    for m in range(2, m_max + 1):
        for t in range(2, t_max + 1):
            if m < alpha:
                continue  # no room for an internal state: quadratic fallback below
            y = np.arange(1, t + 1)
            v = y + c[t - y, m - alpha] + c[y - 1, m]
            c[t, m] = min(float(v.min()), c[t, m])
        if m < alpha:
            ts = np.arange(t_max + 1)
            c[:, m] = np.minimum(c[:, m], ts * (ts + 1) // 2)
            c[0, m] = 0
    return c


def bptt_msm_table(t_max: int, m_max: int, alpha: int = 2) -> np.ndarray:
    """BPTT-MSM: at each split the cheaper of storing a hidden state
    (1 slot, HSM) or an internal state (α slots, ISM).

    References:
        Gruslys et al., NIPS 2016, §3 (BPTT-MSM).

    >>> H, _ = bptt_hsm_table(30, 5)
    >>> bool((bptt_msm_table(30, 5)[1:, 1:] <= H[1:, 1:]).all())
    True
    """
    c = _base(t_max, m_max)
    for m in range(2, m_max + 1):
        for t in range(2, t_max + 1):
            y = np.arange(1, t)
            best = float((y + c[t - y, m - 1] + c[y, m]).min())
            if m >= alpha:
                y2 = np.arange(1, t + 1)
                best = min(best, float((y2 + c[t - y2, m - alpha] + c[y2 - 1, m]).min()))
            c[t, m] = best
    return c


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

    def rec(off: int, length: int, slots: int) -> None:
        if length <= 1 or slots <= 1:
            return
        y = int(ysplit[length, slots])
        out.append((off, length, slots))
        rec(off + y, length - y, slots - 1)
        rec(off, y, slots)

    rec(0, t, m)
    return out


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
