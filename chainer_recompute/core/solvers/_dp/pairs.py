"""The DP's transition structure: the family's per-row quantities (block,
back, boundary time and memory, transients) as the arrays both engines
read (:class:`_Pairs`), integer costs (:func:`dp_costs`), the budget that
never binds, and the NumPy passes that bound every state's memory from
both ends (:func:`_feasibility`, :func:`_capacity`).

Pure core: numpy only.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ...lower_sets import LowerSetFamily, _weighted_sum

logger = logging.getLogger(__name__)

#: Retained time is counted in integer units. Integral costs with a total
#: up to this are used as they are (the paper's model: 10 and 1); others
#: (measured seconds, flop counts) are scaled to at most COST_UNITS units
#: per forward and rounded, which bounds every frontier at that many + 1
#: states; for large families the units shrink so that the table keeps
#: about STATE_LIMIT entries (never below MIN_COST_UNITS). The Plan's
#: overhead is recomputed from the real costs. A graph of fewer than
#: COST_UNITS / UNITS_PER_NODE nodes has at most its small-graph units
#: (below), integral costs too.
EXACT_COST_LIMIT = 65536
COST_UNITS = 4096
MIN_COST_UNITS = 256
#: ... and at most this many units per node (not below UNITS_FLOOR).
UNITS_PER_NODE = 16
UNITS_FLOOR = 64
STATE_LIMIT = 8_000_000


def dp_costs(node_cost: np.ndarray, n_lower_sets: int = 0) -> np.ndarray:
    """Integer DP costs (see :data:`COST_UNITS`).

    >>> dp_costs(np.array([10.0, 1.0])).tolist(), dp_costs(np.array([0.5, 0.25])).tolist()
    ([10, 1], [43, 21])
    """
    c = np.asarray(node_cost, dtype=np.float64)
    total = float(c.sum())
    # Small graphs need no finer grain than this, and their table stays
    # small (planning a tiny model should not cost more than the model):
    # a six-function MLP's flop counts, 61,617 in all, made a table of
    # 7 MB where 96 units make one of 11 KB.
    small = max(UNITS_FLOOR, UNITS_PER_NODE * len(c))
    exact_limit = EXACT_COST_LIMIT if small >= COST_UNITS else small
    if np.all(c == np.round(c)) and total <= exact_limit:
        return c.astype(np.int64)
    if total <= 0:
        return np.zeros(len(c), dtype=np.int64)
    units = COST_UNITS
    if n_lower_sets > 0:
        units = int(min(COST_UNITS, max(MIN_COST_UNITS, STATE_LIMIT // n_lower_sets)))
    units = min(units, small)
    return np.round(c * (units / total)).astype(np.int64)


class _BlockSorted:
    """A per-row array of :class:`_Pairs` (the attribute ``source``)
    permuted into block(L) order, made on first read and then kept on the
    instance."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: "_Pairs", owner: Optional[type] = None) -> np.ndarray:
        arr = np.ascontiguousarray(getattr(obj, self.source)[obj.by_blk])
        obj.__dict__[self.name] = arr
        return arr


class _Pairs:
    """Vectorised generation of the allowed transitions out of one row.

    A transition ``L -> L'`` (``L ⊊ L'``) needs ``m + step <= budget`` with
    ``step = block(L') - block(L) + back(L') + max_{v ∈ L' \\ L} transient_v``
    (the model's per-block peak less the retained memory ``m`` and the
    constant), and adds ``ΔM = keep(∂(L') \\ L)`` and ``ΔT = T(∂(L') \\ L)``.
    Rows are also held sorted by block(L), so that the supersets a slack
    allows are a contiguous window (block and back weights are never
    negative).

    The transient term is exact: nodes with a positive transient are ranked
    by it (largest first) and every row re-encoded as a bitset over those
    ranks; the largest transient of ``L' \\ L`` is then the rank of the
    lowest set bit of ``rank(L') & ~rank(L)``.
    """

    def __init__(self, family: LowerSetFamily) -> None:
        from ...lower_sets import _bits, _n_words, _pack
        model = family.model
        g = family.graph
        # The family's arrays, not the family: the family caches this object
        # (``family.cache['pairs']``), and a reference back would make a
        # cycle that only the cyclic garbage collector frees, keeping every
        # array of a large lattice alive long after the solve.
        self.words = family.words
        self.bwords = family.boundary_words
        self.K = len(family)
        self.size = family.size
        self.blk = np.asarray(family.block_bytes, dtype=np.int64)
        self.by_blk = np.argsort(self.blk, kind="stable")
        self.blk_s = self.blk[self.by_blk]
        self.back = np.asarray(family.back_bytes, dtype=np.int64)
        self._times(family)
        self.bbytes = np.asarray(family.boundary_bytes, dtype=np.int64)
        self.node_m = np.asarray(model.keep_bytes, dtype=np.int64)
        self.constant = int(model.constant_bytes)
        #: passes shared with pairs of the same lower sets under other
        #: costs (see :meth:`with_costs`); ``None``: not shared
        self.memo: Optional[Dict[Tuple[str, Optional[int]], Any]] = None
        tr = model.transient_bytes.astype(np.int64)
        pos = np.flatnonzero(tr > 0)
        rank = pos[np.argsort(-tr[pos], kind="stable")]
        self.trans_vals = tr[rank]
        self.trans_rank = rank
        self.has_trans = len(rank) > 0
        if self.has_trans:
            nwt = _n_words(len(rank))
            self.twords = _pack(_bits(family.words, g.n)[:, rank], nwt)

    def _times(self, family: LowerSetFamily) -> None:
        """The per-row time arrays, from ``family``'s graph's costs."""
        g = family.graph
        self.node_t = dp_costs(g.node_cost, self.K)
        self.total_t = int(self.node_t.sum())
        self.btime = _weighted_sum(family.boundary_words, self.node_t, g.n).astype(np.int64)
        # The most retained time any continuation from L can add: T of the
        # nodes outside L that have a successor or must be kept (each kept
        # at most once).
        _, sw = family.adjacency()
        keepable = sw.any(axis=1)
        if g.must_keep:
            keepable[list(g.must_keep)] = True
        nonsink = np.where(keepable, self.node_t, 0).astype(np.int64)
        self.r0 = int(nonsink.sum()) - _weighted_sum(family.words, nonsink, g.n).astype(np.int64)

    def with_costs(self, family: LowerSetFamily) -> "_Pairs":
        """These pairs for ``family``, the same lower sets and memory model
        under other costs (:meth:`LowerSetFamily.with_costs`): the time
        arrays made again, the rest shared, and the memory-only passes of
        the DP (feasibility and capacity, the last budget's) shared between
        the two from now on.

        >>> from chainer_recompute.core.graph import Graph
        >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)], costs=[0.5, 2.0, 1.0])
        >>> fam = LowerSetFamily.ancestor_closures(g).with_model(None)
        >>> p = _Pairs(fam)
        >>> q = p.with_costs(fam.with_costs(g.without_times()))
        >>> q.memo is p.memo is not None, (q.blk is p.blk), p.btime.tolist() != q.btime.tolist()
        (True, True, True)
        """
        if self.memo is None:
            self.memo = {}
        other = copy.copy(self)
        other.__dict__.pop("btime_s", None)  # (block-sorted copies are made on first read)
        other._times(family)
        return other

    # Every per-row array again, permuted into block(L) order, so that a
    # budget window is a contiguous slice (no fancy indexing): the NumPy
    # engine's (made on first use).
    size_s = _BlockSorted("size")
    back_s = _BlockSorted("back")
    words_s = _BlockSorted("words")
    bwords_s = _BlockSorted("bwords")
    btime_s = _BlockSorted("btime")
    bbytes_s = _BlockSorted("bbytes")
    twords_s = _BlockSorted("twords")

    def transient(self, i: int, p: np.ndarray) -> np.ndarray:
        """max_{v ∈ L'_p \\ L_i} transient_v for the rows ``p`` of the
        block(L)-sorted arrays (supersets of row ``i``)."""
        x = self.twords_s[p] & ~self.twords[i]
        nz = x != 0
        w = np.argmax(nz, axis=1)
        xv = x[np.arange(len(p)), w]
        low = xv & (~xv + np.uint64(1))
        found = nz.any(axis=1)
        bit = np.zeros(len(p), dtype=np.int64)
        bit[found] = np.log2(low[found].astype(np.float64)).astype(np.int64)
        r = 64 * w + bit
        return np.where(found, self.trans_vals[np.minimum(r, len(self.trans_vals) - 1)], 0)

    def out_of(self, i: int, slack: Optional[int]):
        """Targets (rows), step bytes, ΔT and ΔM of every proper superset
        ``L'`` of row ``i`` with ``step <= slack``."""
        bi = self.blk[i]
        lo = int(np.searchsorted(self.blk_s, bi, "left"))
        hi = self.K if slack is None else int(np.searchsorted(self.blk_s, bi + slack, "right"))
        step = self.blk_s[lo:hi] - bi + self.back_s[lo:hi]
        ok = self.size_s[lo:hi] > self.size[i]
        if slack is not None:
            ok &= step <= slack
        wi = self.words[i]
        for w in np.flatnonzero(wi):
            ok &= (self.words_s[lo:hi, w] & wi[w]) == wi[w]
        p = np.flatnonzero(ok)
        step = step[p]
        p += lo
        if self.has_trans and len(p):
            step = step + self.transient(i, p)
            if slack is not None:
                fits = step <= slack
                p, step = p[fits], step[fits]
        d_t = self.btime_s[p]
        d_m = self.bbytes_s[p]
        bi_words = self.bwords[i]
        for w in np.flatnonzero(bi_words):
            x = int(bi_words[w])
            col = self.bwords_s[p, w]
            while x:
                low = x & -x
                v = 64 * int(w) + low.bit_length() - 1
                x ^= low
                hit = (col & np.uint64(low)) != 0
                d_t = d_t - hit * self.node_t[v]
                d_m = d_m - hit * self.node_m[v]
        return self.by_blk[p], step, d_t, d_m


def _feasibility(pairs: _Pairs, budget: Optional[int]):
    """Least retained memory reaching each row, and its predecessor row."""
    K = pairs.K
    inf = np.iinfo(np.int64).max
    least = np.full(K, inf, dtype=np.int64)
    src = np.full(K, -1, dtype=np.int64)
    least[0] = 0
    n = 0
    for i in range(K - 1):
        if least[i] == inf:
            continue
        slack = None if budget is None else budget - int(least[i])
        tgt, _, _, d_m = pairs.out_of(i, slack)
        new = least[i] + d_m
        better = new < least[tgt]
        least[tgt[better]] = new[better]
        src[tgt[better]] = i
        n += len(tgt)
    return least, src, n


def _capacity(pairs: _Pairs, budget: int, least: np.ndarray) -> np.ndarray:
    """cap[L]: the most retained memory with which V is still reachable
    from L within the budget (-1 when it is not); V's is unbounded: what
    the last block keeps (the nodes every plan keeps, Graph.must_keep) is
    held during no later block."""
    K = pairs.K
    inf = np.iinfo(np.int64).max
    cap = np.full(K, -1, dtype=np.int64)
    cap[K - 1] = inf // 4
    for i in range(K - 2, -1, -1):
        if least[i] == inf:
            continue
        tgt, step, _, d_m = pairs.out_of(i, budget - int(least[i]))
        if len(tgt):
            c = cap[tgt]
            val = np.minimum(budget - step, np.where(c >= 0, c - d_m, -1))
            cap[i] = max(int(val.max()), -1)
    return cap


def _never_binds(family: LowerSetFamily, pairs: _Pairs) -> int:
    """A budget (less the model's constant) that no transition from any
    state exceeds: a block's peak is at most max(block, keep) summed over
    its lower set, plus back(L) and the largest transient (cached)."""
    ub = family.cache.get("never_binds")
    if ub is None:
        w = np.maximum(family.model.block_bytes, family.model.keep_bytes)
        ub = family.cache["never_binds"] = int(
            (_weighted_sum(family.words, w, family.graph.n) + pairs.back).max()
            + (pairs.trans_vals.max() if pairs.has_trans else 0))
    return ub
