"""The tables of the tree DP of nested plans
(:class:`~chainer_recompute.core.solvers.nested_tree.TreeTable`), on both
engines: loops compiled by numba (the ``fast`` extra), or numpy with one
vector operation per segment. Both fill the same float32 tables, bit for
bit: ``H[i, j, m]`` and ``split[i, j, m]`` for each segment ``[i, j)`` of
the chain and ``m`` memory units, then ``R[i, m]`` and ``root[i, m]`` for
each suffix ``[i, k)`` at the outermost level (see the module doc of
:mod:`~chainer_recompute.core.solvers.nested_tree`). A split is the least
over ``s`` of ``left(s) + right(s)``, the first of equal ones; ``-1`` where
none is finite."""
from __future__ import annotations

import sys
from typing import Any, Optional

import numpy as np

from . import compiled, pick_engine

#: the fewest blocks for which ``engine='auto'`` compiles the tables (a
#: shorter chain's numpy tables take a few milliseconds)
KERNEL_MIN_BLOCKS = 24


def kernel(engine: Optional[str], k: int) -> Any:
    """The tables' filler for ``engine`` on a chain of ``k`` blocks:
    :func:`_tree_loops` compiled, or :func:`_tree_numpy` (see
    :func:`~.pick_engine`)."""
    if pick_engine(engine, what="tree DP", pays=k >= KERNEL_MIN_BLOCKS) == "numpy":
        return _tree_numpy
    return compiled(sys.modules[__name__], "_tree_loops")


def _tree_numpy(k, grid, cs, wu, tau, prefix, H, split, R, root):
    """The tables, each segment's splits in one vector operation
    (``O(k^2)`` numpy calls)."""
    ms = np.arange(grid + 1)
    for i in range(k):
        H[i, i + 1] = np.where(ms >= wu[i], tau[i], np.float32(np.inf))

    def best_split(left, rights, s):
        # left[x] + rights[x] shifted by cs[s[x] - 1], least over x (the
        # first of equal ones)
        idx = ms[None, :] - cs[s - 1][:, None]
        v = left + np.where(idx >= 0, np.take_along_axis(rights, np.maximum(idx, 0), 1),
                            np.float32(np.inf))
        arg = v.argmin(axis=0)
        best = v[arg, ms]
        return best, np.where(np.isfinite(best), s[arg], -1)

    for span in range(2, k + 1):
        for i in range(0, k - span + 1):
            j = i + span
            s = np.arange(i + 1, j)
            left = H[i, i + 1:j] + (prefix[i + 1:j] - prefix[i]).astype(np.float32)[:, None]
            H[i, j], split[i, j] = best_split(left, H[i + 1:j, j], s)
    for i in range(k - 1, -1, -1):
        R[i] = H[i, k]
        root[i] = -1
        if i + 1 < k:
            best, arg = best_split(H[i, i + 1:k], R[i + 1:k], np.arange(i + 1, k))
            better = best < R[i]
            R[i] = np.where(better, best, R[i])
            root[i] = np.where(better, arg, -1)


def _tree_loops(k, grid, cs, wu, tau, prefix, H, split, R, root):
    """The same tables as :func:`_tree_numpy`, in loops (float32 sums in
    the same order; each segment's splits in increasing order, a later one
    taken where it is strictly less, over the memory units innermost)."""
    inf = np.float32(np.inf)
    best = np.empty(grid + 1, dtype=np.float32)
    arg = np.empty(grid + 1, dtype=np.int64)
    for i in range(k):
        for m in range(grid + 1):
            H[i, i + 1, m] = tau[i] if m >= wu[i] else inf
    for span in range(2, k + 1):
        for i in range(0, k - span + 1):
            j = i + span
            for s in range(i + 1, j):
                fwd = np.float32(prefix[s] - prefix[i])
                c = cs[s - 1]
                for m in range(grid + 1):
                    right = H[s, j, m - c] if m >= c else inf
                    v = (H[i, s, m] + fwd) + right
                    if s == i + 1 or v < best[m]:
                        best[m] = v
                        arg[m] = s
            for m in range(grid + 1):
                H[i, j, m] = best[m]
                split[i, j, m] = arg[m] if best[m] < inf else -1
    for i in range(k - 1, -1, -1):
        for m in range(grid + 1):
            R[i, m] = H[i, k, m]
            root[i, m] = -1
        for s in range(i + 1, k):
            c = cs[s - 1]
            for m in range(grid + 1):
                right = R[s, m - c] if m >= c else inf
                v = H[i, s, m] + right
                if s == i + 1 or v < best[m]:
                    best[m] = v
                    arg[m] = s
        if i + 1 < k:
            for m in range(grid + 1):
                if best[m] < R[i, m]:
                    R[i, m] = best[m]
                    root[i, m] = arg[m]
