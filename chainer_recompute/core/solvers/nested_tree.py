"""Nesting a chain of blocks to any depth: a dynamic program over the trees
of segments of a fine chain (docs/algorithm.md §9, "Deeper trees").

Pure core: numpy only.

A fine chain's blocks ``0 ... k-1`` are reduced to three figures each: the
bytes ``c[b]`` crossing boundary ``b`` (between blocks ``b`` and ``b+1``:
what a checkpoint there holds), the bytes ``w[b]`` block ``b``'s backward
needs beside the checkpoints held then, and its cost ``tau[b]``. A nested
plan gives each boundary a level (:class:`~chainer_recompute.core.execution.ExecutionPlan`);
under this model its memory at the backward of block ``t`` is

    Σ_{b ∈ S(t)} c[b] + w[t],   S(t) = the boundaries of the open segments,

and its recomputation, over the backward, every block once (``tau[t]``,
its regeneration) plus, each time the backward enters a segment of depth
one or more, a forward from its left end to the left end of its last child.

The DP: ``H(i, j, m)``, the least recomputation of the segment of blocks
``[i, j)`` entered with its left end alive and ``m`` bytes to use, is
``tau[i]`` for one block (when ``w[i] <= m``), else the best split at ``s``:

    H(i, j, m) = min_s  H(i, s, m) + Σ_{i <= b < s} tau[b] + H(s, j, m - c[s-1])

(the part ``[s, j)`` runs first, with the checkpoint at ``s - 1`` held; the
part ``[i, s)`` is a child one level deeper, made again when the backward
reaches it, by then with that checkpoint let go). The outermost level is
the same without the forward (the forward pass made its checkpoints).
Memory is counted in :data:`GRID` units of the budget, rounded up: a plan
it gives fits its figures. Its states are the ``k^2 / 2`` segments, each
a vector over the memory grid: ``O(k^3 · GRID)`` work, compiled (numba, the
``fast`` extra: 7 ms for 80 blocks, 37 ms for 160 on this project's CPU
machine) or in ``O(k^2)`` numpy calls, a segment's splits in one vector
operation (0.2 s and 1.1 s), the same tables from both
(:mod:`~chainer_recompute.core.kernels.tree`). The tables are
float32 and int16, ``6 k^2 (GRID + 1)`` bytes: 20 MB for a chain of
:data:`MAX_BLOCKS` blocks, the longest it runs on, host memory the planner
holds while it runs (in no plan, as the rest of the planner's).
:func:`tree_cost` evaluates any level assignment under the same model; the
tests check the DP against it over every assignment of small chains. The model is an estimate of the real
schedule (it counts a value crossing several held boundaries once per
boundary, and the blocks' needs as a single-level plan has them):
:class:`~chainer_recompute.core.nested.NestedSearch` replays every plan it
gives.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from ..execution import open_boundaries
from ..kernels.tree import kernel

__all__ = ["GRID", "MAX_BLOCKS", "TreeTable", "tree_cost", "tree_peak"]

#: memory units of the DP's grid
GRID = 128
#: longest fine chain the DP runs on
MAX_BLOCKS = 160


def tree_cost(c: Sequence[float], w: Sequence[float], tau: Sequence[float],
              levels: Sequence[int]) -> Tuple[float, float]:
    """The peak and the recomputation of the nested plan of boundary
    ``levels`` under the model (see the module): the backward from the last
    block to the first, each block's left end made again, when it is not
    alive, by a forward from the nearest alive boundary to its left, which
    puts back the boundaries of the open segments.

    >>> tree_cost([1, 1, 1], [2, 2, 2, 2], [1, 1, 1, 1], (1, 0, 1))
    (4, 6.0)
    """
    k = len(w)
    alive = {b for b in range(k - 1) if levels[b] == 0}
    peak, time = 0.0, 0.0
    for t in range(k - 1, -1, -1):
        if t > 0 and t - 1 not in alive:
            start = max((b for b in alive if b < t - 1), default=-1)
            time += sum(tau[start + 1:t])
            alive |= {b for b in open_boundaries(levels, t) if b > start}
        held = set(open_boundaries(levels, t))
        assert held <= alive, (t, held, alive)
        peak = max(peak, sum(c[b] for b in held) + w[t])
        time += tau[t]
        alive.discard(t - 1)
    return peak, time


def tree_peak(c: Sequence[float], w: Sequence[float], levels: Sequence[int]) -> float:
    """:func:`tree_cost`'s peak alone, in ``O(k)``: the open boundaries
    below block ``t`` are a stack of non-decreasing levels, each boundary
    popping those of a higher level before it is pushed.

    >>> tree_peak([1, 1, 1], [2, 2, 2, 2], (1, 0, 1))
    4
    """
    stack: list = []
    held, peak = 0, w[0]
    for t in range(1, len(w)):
        b = t - 1
        while stack and levels[stack[-1]] > levels[b]:
            held -= c[stack.pop()]
        stack.append(b)
        held += c[b]
        peak = max(peak, held + w[t])
    return peak


class TreeTable:
    """The DP's tables for one chain and a memory range of ``budget``
    bytes, in :data:`GRID` units (``grid``: another count of units) above
    ``base`` bytes: ``m`` units stand for ``base + m * unit`` bytes. Every
    memory figure of the model is one block's need plus checkpoints, so a
    ``base`` at most each ``w[t]`` (the least of them) changes no tree and
    spends the units on the range where trees differ: a chain whose blocks
    need 250 KB each and whose checkpoints are 4 KB, planned within 280 KB,
    gets units of 0.2 KB instead of 2.2 KB.

    >>> tt = TreeTable([1, 1, 1], [2, 2, 2, 2], [1, 1, 1, 1], budget=8, grid=8)
    >>> tt.least(), tt.levels(3), float(tt.time[3])
    (3, (2, 1, 0), 7.0)
    >>> tree_cost([1, 1, 1], [2, 2, 2, 2], [1, 1, 1, 1], (2, 1, 0))
    (3, 7.0)
    """

    def __init__(self, c: Sequence[float], w: Sequence[float], tau: Sequence[float],
                 budget: float, grid: int = GRID, base: float = 0.0,
                 engine: Optional[str] = None) -> None:
        k = len(w)
        if w and base > min(w):
            raise ValueError(f"base {base} is above a block's need ({min(w)})")
        self.k, self.grid, self.base = k, grid, base
        self.unit = (budget - base) / grid if budget > base else 1.0
        self.c = [min(grid + 1, math.ceil(x / self.unit)) for x in c]
        wu = [math.ceil((x - base) / self.unit) for x in w]
        prefix = np.concatenate([[0.0], np.cumsum(np.asarray(tau, dtype=np.float64))])
        # H[i, j]: the segment [i, j)'s least recomputation per memory unit,
        # split[i, j] its split; R[i] and root[i] the suffix [i, k)'s at the
        # outermost level, with no forward to pay (core/kernels/tree.py)
        H = np.full((k, k + 1, grid + 1), np.inf, dtype=np.float32)
        split = np.full((k, k + 1, grid + 1), -1, dtype=np.int16)
        R = np.full((k + 1, grid + 1), np.inf, dtype=np.float32)
        root = np.full((k + 1, grid + 1), -1, dtype=np.int16)
        kernel(engine, k)(k, grid, np.asarray(self.c, dtype=np.int64),
                          np.asarray(wu, dtype=np.int64),
                          np.asarray(tau, dtype=np.float64).astype(np.float32), prefix,
                          H, split, R, root)
        self._split, self._root = split, root
        #: least recomputation of the whole chain per memory unit
        self.time: np.ndarray = R[0].copy()

    def least(self) -> Optional[int]:
        """The fewest memory units any tree fits in (``None``: none does)."""
        ok = np.flatnonzero(np.isfinite(self.time))
        return int(ok[0]) if ok.size else None

    def levels(self, m: int) -> Tuple[int, ...]:
        """The boundary levels of the tree of least recomputation in ``m``
        units (``m`` at least :meth:`least`)."""
        levels = [0] * (self.k - 1)
        todo = []  # segments [i, j) to split, with their memory and depth
        i = 0
        while True:  # the outermost level
            s = int(self._root[i][m])
            if s < 0:
                todo.append((i, self.k, m, 1))
                break
            levels[s - 1] = 0
            todo.append((i, s, m, 1))
            i, m = s, m - self.c[s - 1]
        while todo:  # (a stack, not a recursive closure: no reference cycle holds the tables)
            i, j, m, depth = todo.pop()
            while j > i + 1:
                s = int(self._split[i, j][m])
                levels[s - 1] = depth
                todo.append((i, s, m, depth + 1))
                i, m = s, m - self.c[s - 1]
        return tuple(levels)
