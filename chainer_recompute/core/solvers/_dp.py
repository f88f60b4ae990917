"""The DP over a family of lower sets, shared by the exact and the
approximate solvers (PAPER.md §4-§6), under a memory model
(:class:`~chainer_recompute.core.memory_model.MemoryModel`, the paper's by
default).

Pure core: numpy only (the optional compiled kernels in :mod:`._dp_numba`
need numba).

Table: for each lower set ``L`` (row of a :class:`LowerSetFamily`, rows
sorted by size so every subset precedes its supersets) a Pareto frontier
of states ``(t, m)``: ``t`` the retained time Σ_j T(U_j) and ``m`` the
retained memory Σ_j keep(U_j) of some chain ∅ ⊊ L_1 ⊊ ... ⊊ L. A
transition ``L -> L'`` for *every* ``L' ⊋ L`` in the family is allowed when
``m + block(L') - block(L) + above(A(L')) + beside(B(L')) + max_{v ∈ L' \\ L}
transient_v <= budget - constant`` (the paper: ``m + 2·(M(L') - M(L)) +
M(A(L')) + M(B(L')) <= budget``); it adds ``U' = ∂(L') ∩ (L' \\ L)``.
Because ``∂(L') ∩ L ⊆ ∂(L)``, ``T(U') = T(∂(L')) - Σ_{v ∈ ∂(L)}
T_v·[v ∈ ∂(L')]``, a few vectorised bit tests per source.

Dominance depends on the objective: time-centric keeps states with more
``t`` and less ``m``; memory-centric keeps less ``t`` and less ``m``;
feasibility keeps the least ``m`` only. Candidate supersets of ``L`` are
restricted by the budget to a window of block(L') (``block(L') - block(L)
<= budget - m``) found by binary search in the rows sorted by block(L'),
then filtered with a vectorised subset test. NumPy engine: pushed states
are buffered per target size and reduced (grouped Pareto filter) when that
size's turn comes, or kept in a dense table. Compiled engine: see
:func:`_run_compiled`.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np

from .. import lower_sets as _lower_sets
from ..lower_sets import LowerSetFamily, _weighted_sum

if TYPE_CHECKING:  # pragma: no cover
    from ..graph import Graph
    from ..plan import Plan

logger = logging.getLogger(__name__)

_FLUSH_AT = 2_000_000
_GUARD_BUCKETS = 32


@dataclass
class DPResult:
    """The chain found by :func:`run_dp` (row indices into the family) and
    its retained time and memory; ``chain`` is ``None`` when infeasible."""

    chain: Optional[List[int]]
    retained_time: float
    retained_bytes: int
    n_transitions: int
    n_states: int


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


#: Retained time is counted in integer units. Integral costs with a total
#: up to this are used as they are (the paper's model: 10 and 1); others
#: (measured seconds, flop counts) are scaled to at most COST_UNITS units
#: per forward and rounded, which bounds every frontier at that many + 1
#: states; for large families the units shrink so that the table keeps
#: about STATE_LIMIT entries (never below MIN_COST_UNITS). The Plan's
#: overhead is recomputed from the real costs.
EXACT_COST_LIMIT = 65536
COST_UNITS = 4096
MIN_COST_UNITS = 256
#: ... and at most this many units per node (not below UNITS_FLOOR).
UNITS_PER_NODE = 16
UNITS_FLOOR = 64
STATE_LIMIT = 8_000_000
#: The dense table (one row of T+1 entries per lower set) is used while it
#: has at most this many entries; larger problems use the sparse frontiers.
DENSE_LIMIT = 24_000_000


def dp_costs(node_cost: np.ndarray, n_lower_sets: int = 0) -> np.ndarray:
    """Integer DP costs (see :data:`COST_UNITS`).

    >>> dp_costs(np.array([10.0, 1.0])).tolist(), dp_costs(np.array([0.5, 0.25])).tolist()
    ([10, 1], [43, 21])
    """
    c = np.asarray(node_cost, dtype=np.float64)
    total = float(c.sum())
    if np.all(c == np.round(c)) and total <= EXACT_COST_LIMIT:
        return c.astype(np.int64)
    if total <= 0:
        return np.zeros(len(c), dtype=np.int64)
    units = COST_UNITS
    if n_lower_sets > 0:
        units = int(min(COST_UNITS, max(MIN_COST_UNITS, STATE_LIMIT // n_lower_sets)))
    # Small graphs need no finer grain than this, and their table stays
    # small (planning a tiny model should not cost more than the model).
    units = min(units, max(UNITS_FLOOR, UNITS_PER_NODE * len(c)))
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
        from ..lower_sets import _bits, _n_words, _pack
        model = family.model
        g = family.graph
        # The family's arrays, not the family: the family caches this object
        # (``family.cache['pairs']``), and a reference back would make a
        # cycle that only the cyclic garbage collector frees, keeping every
        # array of a large lattice alive long after the solve (issue 11).
        self.words = family.words
        self.bwords = family.boundary_words
        self.K = len(family)
        self.size = family.size
        self.blk = np.asarray(family.block_bytes, dtype=np.int64)
        self.by_blk = np.argsort(self.blk, kind="stable")
        self.blk_s = self.blk[self.by_blk]
        self.back = np.asarray(family.back_bytes, dtype=np.int64)
        self.node_t = dp_costs(g.node_cost, self.K)
        self.total_t = int(self.node_t.sum())
        self.btime = _weighted_sum(family.boundary_words, self.node_t, g.n).astype(np.int64)
        self.bbytes = np.asarray(family.boundary_bytes, dtype=np.int64)
        self.node_m = np.asarray(model.keep_bytes, dtype=np.int64)
        self.constant = int(model.constant_bytes)
        # The most retained time any continuation from L can add: T of the
        # nodes outside L that have a successor (each kept at most once).
        _, sw = family.adjacency()
        nonsink = np.where(sw.any(axis=1), self.node_t, 0).astype(np.int64)
        self.r0 = int(nonsink.sum()) - _weighted_sum(family.words, nonsink, g.n).astype(np.int64)
        tr = model.transient_bytes.astype(np.int64)
        pos = np.flatnonzero(tr > 0)
        rank = pos[np.argsort(-tr[pos], kind="stable")]
        self.trans_vals = tr[rank]
        self.trans_rank = rank
        self.has_trans = len(rank) > 0
        if self.has_trans:
            nwt = _n_words(len(rank))
            self.twords = _pack(_bits(family.words, g.n)[:, rank], nwt)

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
    from L within the budget (-1 when it is not)."""
    K = pairs.K
    inf = np.iinfo(np.int64).max
    cap = np.full(K, -1, dtype=np.int64)
    cap[K - 1] = budget
    for i in range(K - 2, -1, -1):
        if least[i] == inf:
            continue
        tgt, step, _, d_m = pairs.out_of(i, budget - int(least[i]))
        if len(tgt):
            c = cap[tgt]
            val = np.minimum(budget - step, np.where(c >= 0, c - d_m, -1))
            cap[i] = max(int(val.max()), -1)
    return cap


#: ``auto`` (compiled kernels when numba is installed and the problem is
#: large enough to repay loading them, see :data:`COMPILED_MIN_WORK`),
#: ``numba`` or ``numpy``; the environment variable
#: ``CHAINER_RECOMPUTE_DP_ENGINE`` sets the default.
ENGINE = os.environ.get("CHAINER_RECOMPUTE_DP_ENGINE", "auto")
ENGINES = ("auto", "numba", "numpy")
#: ``auto`` uses the compiled kernels when K²·(T+1)/2 (inclusion pairs
#: times retained-time levels) exceeds this (a NumPy run long enough to
#: repay importing numba and loading the kernels), or when this process
#: has loaded them already.
COMPILED_MIN_WORK = 20_000_000
#: The compiled DP keeps a dense table of at most K·(T+1) entries (12 bytes
#: each) up to this many; larger problems use the NumPy frontiers.
COMPILED_DENSE_LIMIT = 40_000_000


_NUMBA: Optional[bool] = None


def numba_available() -> bool:
    """Whether the compiled kernels can be used (numba is importable)."""
    global _NUMBA
    if _NUMBA is None:
        import importlib.util
        _NUMBA = importlib.util.find_spec("numba") is not None
    return _NUMBA


def loaded_kernels():
    """The compiled kernels' module when this process has loaded it (and
    every kernel in it), else ``None`` (see :func:`_pick_engine`)."""
    return _lower_sets._KERNELS


def _load_kernels():
    """Import the compiled kernels and load every one of them (compiled, or
    read from numba's on-disk cache) by solving a tiny graph: later solves
    of any size then pay no loading."""
    if _lower_sets._KERNELS is None:
        from . import _dp_numba as kn
        _lower_sets._KERNELS = kn
        try:
            _warm_up()
        except BaseException:
            _lower_sets._KERNELS = None
            raise
    return _lower_sets._KERNELS


def _warm_up() -> None:
    from ..graph import Graph
    g = Graph.from_edges([4, 4, 4, 4], [(0, 1), (1, 2), (0, 2), (2, 3)])
    fam = LowerSetFamily.all(g)
    for objective in ("tc", "mc", "feasible"):
        run_dp(fam, 20, objective, engine="numba")
        run_dp(fam, None, objective, engine="numba")
    run_dp(fam, 10_000, "tc", engine="numba")


def _pick_engine(engine: Optional[str], family: LowerSetFamily, total_t: int) -> str:
    engine = ENGINE if engine is None else engine
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "numpy":
        return "numpy"
    if engine == "numba":
        if not numba_available():
            raise ImportError("engine='numba' needs numba: pip install 'chainer-recompute[fast]'")
        _load_kernels()
        return "numba"
    if not numba_available():
        return "numpy"
    K = len(family)
    if loaded_kernels() is not None or K * K * (total_t + 1) // 2 > COMPILED_MIN_WORK:
        _load_kernels()
        return "numba"
    return "numpy"


def run_dp(family: LowerSetFamily, budget_bytes: Optional[int], objective: str,
           method: str = "auto", engine: Optional[str] = None) -> DPResult:
    """Run the DP; ``objective`` is ``'tc'``, ``'mc'`` or ``'feasible'``.

    Returns the best chain ending at V (the last row) under the objective:
    most retained time (tc), least retained time (mc), or any feasible one
    (feasible; least retained memory).

    With a budget, two cheap passes come first: the least retained memory
    reaching each row (forward) and the most with which V is still
    reachable (backward); states outside that interval are never stored,
    which keeps the frontiers small near the least feasible budget without
    changing the optimum. A budget that no transition from any state can
    exceed is dropped; without a budget tc keeps every non-sink (the
    topological prefixes, when the family holds them) and mc takes the
    single block V, on either engine.

    ``engine``: ``numba`` (compiled kernels, :mod:`._dp_numba`: a feasible
    chain found first by a one-state-per-row heuristic bounds the optimum,
    and every state that cannot reach it is pruned), ``numpy`` (vectorised
    NumPy), ``auto`` or ``None`` (:data:`ENGINE`). ``method`` (NumPy
    engine): ``dense`` (a table row of T+1 entries per lower set, fast on
    small families), ``sparse`` (Pareto frontiers, for large families), or
    ``auto`` (dense while the table has at most :data:`DENSE_LIMIT`
    entries); giving ``dense`` or ``sparse`` selects the NumPy engine unless
    ``engine`` says otherwise. All find the same optimum.

    >>> from chainer_recompute.core.graph import Graph
    >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)])
    >>> run_dp(LowerSetFamily.all(g), None, 'tc').chain
    [0, 1, 2, 3]
    """
    if family.model is None:
        family = family.with_model(None)
    pairs = family.cache.get("pairs")
    if pairs is None:
        pairs = family.cache["pairs"] = _Pairs(family)
    K = pairs.K
    # The model's constant is paid by every block: it shifts the budget.
    budget = None if budget_bytes is None else int(budget_bytes) - pairs.constant
    if budget is not None and budget < 0:
        return DPResult(None, 0.0, 0, 0, 0)
    if objective not in ("tc", "mc", "feasible"):
        raise ValueError(f"objective must be 'tc', 'mc' or 'feasible', got {objective!r}")
    if method not in ("auto", "dense", "sparse"):
        raise ValueError(f"method must be 'auto', 'dense' or 'sparse', got {method!r}")
    if engine is None and method != "auto":
        engine = "numpy"  # a NumPy table was asked for
    if budget is not None and budget >= _never_binds(family, pairs):
        budget = None  # every transition from every state fits: the same answers
    if budget is None and objective != "feasible":
        if objective == "mc":  # one block: nothing retained
            return DPResult([0, K - 1], 0.0, 0, 1, 2)
        chain = _prefix_chain(family)
        if chain is not None:  # every non-sink kept
            return DPResult(chain, float(pairs.r0[0]), 0, len(chain) - 1, len(chain))
    if (_pick_engine(engine, family, pairs.total_t) == "numba"
            and (objective == "feasible" or K * (pairs.total_t + 1) <= COMPILED_DENSE_LIMIT)):
        return _run_compiled(family, pairs, budget, objective)
    inf = np.iinfo(np.int64).max
    least, fsrc, n_feas = _feasibility(pairs, budget)
    if least[K - 1] == inf:
        return DPResult(None, 0.0, 0, n_feas, 0)
    if objective == "feasible":
        chain = [K - 1]
        while chain[-1] != 0:
            chain.append(int(fsrc[chain[-1]]))
        chain.reverse()
        return DPResult(chain, float("nan"), int(least[K - 1]), n_feas, K)
    cap = _capacity(pairs, budget, least) if budget is not None else np.full(K, inf, np.int64)
    if method == "auto":
        method = "dense" if K * (pairs.total_t + 1) <= DENSE_LIMIT else "sparse"
    if method == "dense":
        return _dense(pairs, budget, objective, least, cap)
    return _sparse(pairs, budget, objective, least, cap)


def _kernel_args(family: LowerSetFamily, pairs: _Pairs) -> tuple:
    """The family as the flat arrays of :mod:`._dp_numba` (cached)."""
    args = family.cache.get("kernel_args")
    if args is not None:
        return args
    from ..lower_sets import _n_words
    kn = _load_kernels()
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


def _chain_from(src: np.ndarray, K: int) -> List[int]:
    chain = [K - 1]
    while chain[-1] != 0:
        chain.append(int(src[chain[-1]]))
    chain.reverse()
    return chain


def _prefix_chain(family: LowerSetFamily, chunk: int = 1 << 16) -> Optional[List[int]]:
    """Rows of the topological prefixes ∅, {0}, {0, 1}, ..., V, when the
    family holds them all (every lower set does), else None."""
    from ..lower_sets import _n_words, _pack
    n = family.graph.n
    prefixes = _pack(np.tri(n + 1, n, -1, dtype=np.uint8), _n_words(n))  # row k: 0..k-1
    rows: List[int] = []
    for s in range(0, len(family), chunk):  # (chunks: a lattice may have millions of rows)
        w = family.words[s:s + chunk]
        hit = np.all(w == prefixes[family.size[s:s + chunk]], axis=1)
        rows += (s + np.flatnonzero(hit)).tolist()
    return rows if len(rows) == n + 1 else None


def _run_compiled(family: LowerSetFamily, pairs: _Pairs, budget: Optional[int],
                  objective: str) -> DPResult:
    """The DP on the compiled kernels (:mod:`._dp_numba`).

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

    from . import _dp_numba as kn
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
        # a small part of the family: on U-Net at 1.25 x its least budget
        # (62 of 331 rows) 176 in ~0.1 ms (optimum 197; the greedy run
        # below finds 104), and the DP below then pushes ~4x less. On
        # ResNet50 (176 nodes, 241 rows) it would cost about as much as the
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
    """The compiled dense DP's table (see :func:`._dp_numba.dense`).

    Each row L holds only the retained times that can occur there and
    survive the pruning: at most T of the non-sinks in L (only they are
    ever kept), at least ``incumbent - bound(L)`` (tc; any guess is above
    the incumbent), at most the incumbent (mc); none for rows that cannot
    reach V (``cap < 0``). It is left uninitialised: the kernel fills a row
    when it first writes it and reads only rows written (touched), so rows
    never reached cost no memory. Fresh memory costs ~0.5 ms per MB here
    (page faults): on ResNet50 at its least budget the full K x (T + 1)
    table took more time than the DP.
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
        from . import _dp_numba as kn
        return self.t_low[K - 1] + np.flatnonzero(
            self.opt[self.off[K - 1]:self.off[K]] != kn.INF)


def _closure_rows(family: LowerSetFamily) -> Optional[np.ndarray]:
    """The family's rows that are ∅, V or the ancestor closure of a node
    (every one, in a family of all lower sets), or None when some is not
    a row or when they are every row (cached)."""
    rows = family.cache.get("closure_rows", False)
    if rows is not False:
        return rows
    from ..lower_sets import _n_words, _rows_of_masks, ancestor_masks
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


#: The compiled tc DP on a small table takes its incumbent from the DP on
#: the ancestor-closure rows (one per node) when they are at most
#: 1/CLOSURE_SHARE of the family (see :func:`_run_compiled`).
CLOSURE_SHARE = 4

#: The compiled tc DP guesses the optimum (see :func:`_run_compiled`) when
#: its table has more than this many entries (below it, one run with the
#: incumbent takes a few milliseconds: U-Net's and ResNet50's 77 k and
#: 158 k entries, 30% faster without guesses; ResNet152's and DenseNet's
#: 1.1 M, up to 2.6x faster with them), in steps of 1/GUESS_STEPS of the
#: interval left ...
GUESS_MIN_TABLE = 500_000
GUESS_STEPS = 32
#: ... raced with a run with the incumbent, stopped at first after this
#: many pushes, and tried again each time the guesses have spent
#: GUESS_RACE times its last limit.
GUESS_FIRST_PUSHES = 200_000
GUESS_RACE = 16


def _dense(pairs: _Pairs, budget: Optional[int], objective: str, least: np.ndarray,
           cap: np.ndarray) -> DPResult:
    """The DP with one dense row per lower set: ``opt[L, t]`` is the least
    retained memory of a chain ending at ``L`` with retained time ``t``
    (PAPER.md §4 verbatim); dominated entries of a row are skipped when it
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


def chain_cost(family: LowerSetFamily, rows: List[int]):
    """The strategy of family rows ``rows`` (L_1 ⊊ ... ⊊ L_k = V, ∅
    excluded) under the family's memory model: the same
    :class:`~chainer_recompute.core.schedule.StrategyCost` as
    :func:`~chainer_recompute.core.schedule.strategy_cost`, from the
    family's per-row sums (block, back, boundary) instead of the graph.

    >>> from chainer_recompute.core.graph import Graph
    >>> from chainer_recompute.core.schedule import strategy_cost
    >>> g = Graph.from_edges([1, 2, 1], [(0, 1), (1, 2)])
    >>> fam = LowerSetFamily.all(g).with_model(None)
    >>> c = chain_cost(fam, [2, 3])
    >>> (c.peak_bytes, c.overhead) == (strategy_cost(g, [3, 7]).peak_bytes, 2.0)
    True
    """
    from ..lower_sets import _bits, _masks_of_rows
    from ..schedule import StrategyCost
    model = family.model
    g = family.graph
    n = g.n
    r = np.asarray(rows, dtype=np.int64)
    words = family.words[r]
    prev = np.zeros_like(words)
    prev[1:] = words[:-1]
    block = words & ~prev
    u = family.boundary_words[r] & block
    ub = _bits(u, n).astype(bool)
    keep = ub.astype(np.int64) @ model.keep_bytes
    acc = np.zeros(len(r), dtype=np.int64)
    acc[1:] = np.cumsum(keep)[:-1]
    blk = family.block_bytes[r].astype(np.int64)
    blk[1:] -= blk[:-1].copy()
    peaks = model.constant_bytes + acc + blk + family.back_bytes[r].astype(np.int64)
    dropped = _bits(block & ~u, n).astype(bool)
    if model.has_transients:
        bb = _bits(block, n).astype(bool)
        peaks = peaks + np.where(bb, model.transient_bytes[None, :], 0).max(axis=1)
    nc = g.node_cost
    if g.integral_costs:
        # Sums of integers below 2**53 are exact in any order.
        overhead = float(int(dropped.sum(axis=0) @ nc.astype(np.int64)))
    else:  # block by block, nodes in order (strategy_cost's rounding)
        overhead = 0.0
        ncl = nc.tolist()
        rr, vv = np.nonzero(dropped)
        cuts = np.searchsorted(rr, np.arange(1, len(r))).tolist()
        vl = vv.tolist()
        for a, b in zip([0] + cuts, cuts + [len(vl)]):
            overhead += float(sum(ncl[v] for v in vl[a:b]))
    return StrategyCost(peak_bytes=int(peaks.max()), overhead=overhead,
                        block_peaks_bytes=tuple(peaks.tolist()),
                        checkpoints=tuple(_masks_of_rows(u)))


def plan_from_dp(graph: "Graph", family: LowerSetFamily, budget_bytes: Optional[int],
                 strategy: str, method: str, solver: str, t0: float,
                 engine: Optional[str] = None) -> "Plan":
    """Run the DP over ``family`` and wrap its chain in a Plan (the common
    tail of the exact and approximate solvers; ``t0`` is when the solve
    started, family construction included)."""
    import time

    from ..plan import infeasible_plan, make_plan
    res = run_dp(family, budget_bytes, strategy, method, engine)
    dt = time.perf_counter() - t0
    info = {"n_lower_sets": len(family), "n_transitions": res.n_transitions,
            "n_states": res.n_states}
    logger.debug("%s DP: %d lower sets, %d transitions, %.3f s", solver, len(family),
                 res.n_transitions, dt)
    if res.chain is None:
        return infeasible_plan(graph, solver=solver, strategy=strategy,
                               budget_bytes=budget_bytes, solve_time_s=dt, info=info,
                               model=family.model)
    masks = family.masks(res.chain[1:])
    cost = chain_cost(family, res.chain[1:])
    return make_plan(graph, masks, solver=solver, strategy=strategy,
                     budget_bytes=budget_bytes, solve_time_s=dt, info=info, model=family.model,
                     cost=cost)
