"""The chain policies as schedules: streams of operations that reverse a
chain of ``t`` steps, Griewank's revolve split, each policy's cost, and the
count of a schedule's forward steps and slots.

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

from math import comb
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from ...errors import BudgetError
from .tables import (HIDDEN, QUAD, ChainTable, bptt_hsm_table, chain_table, check_chain,
                     max_useful_slots)

#: An operation: ``('advance', a, b)`` or ``(name, position)``.
Op = Tuple


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
