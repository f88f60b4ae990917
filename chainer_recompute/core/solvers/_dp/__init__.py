"""The DP over a family of lower sets, shared by the exact and the
approximate solvers (docs/paper.md §4-§6), under a memory model
(:class:`~chainer_recompute.core.memory_model.MemoryModel`, the paper's by
default).

Pure core: numpy only (the optional compiled kernels in
:mod:`~chainer_recompute.core.kernels.dp` need numba).

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
from typing import TYPE_CHECKING, Any, List, Optional

import numpy as np

from ... import lower_sets as _lower_sets
from ...kernels import ENGINES, numba_available, pick_engine  # noqa: F401 (re-exported)
from ...lower_sets import LowerSetFamily
from .compiled import _closure_rows, _run_compiled  # noqa: F401 (_closure_rows: tests)
from .numpy_engine import DENSE_LIMIT, _dense, _sparse
from .pairs import _capacity, _feasibility, _never_binds, _Pairs
from .result import DPResult

if TYPE_CHECKING:  # pragma: no cover
    from ...graph import Graph
    from ...plan import Plan

logger = logging.getLogger(__name__)


#: ``auto`` (compiled kernels when numba is installed and the problem is
#: large enough to repay loading them, see :data:`COMPILED_MIN_WORK`),
#: ``numba`` or ``numpy``; the environment variable
#: ``CHAINER_RECOMPUTE_DP_ENGINE`` sets the default.
ENGINE = os.environ.get("CHAINER_RECOMPUTE_DP_ENGINE", "auto")
#: ``auto`` uses the compiled kernels when K²·(T+1)/2 (inclusion pairs
#: times retained-time levels) exceeds this (a NumPy run long enough to
#: repay importing numba and loading the kernels), or when this process
#: has loaded them already.
COMPILED_MIN_WORK = 20_000_000
#: The compiled DP keeps a dense table of at most K·(T+1) entries (12 bytes
#: each) up to this many; larger problems use the NumPy frontiers.
COMPILED_DENSE_LIMIT = 40_000_000
#: ``auto`` also uses the compiled kernels where NumPy's dense table
#: (K·(T+1) entries, 16 bytes each) would be larger than this: the
#: compiled DP fills only the entries its bounds leave (0.6 MB on ResNet50
#: b32 against NumPy's 8.6 MB, 1.8 MB on ResNet152 b32 against 38 MB),
#: and on a NumPy model the planner's memory is in the heap that the
#: budget bounds (a plan made at a training call, with the model's arrays
#: alive: docs/limits.md).
NUMPY_TABLE_BYTES = 1 << 20


def loaded_kernels():
    """The compiled kernels' module when this process has loaded it (and
    every kernel in it), else ``None`` (see :func:`_pick_engine`)."""
    return _lower_sets._KERNELS


def _load_kernels():
    """Import the compiled kernels and load every one of them (compiled, or
    read from numba's on-disk cache) by solving a tiny graph: later solves
    of any size then pay no loading."""
    if _lower_sets._KERNELS is None:
        from ...kernels import dp as kn
        _lower_sets._KERNELS = kn
        try:
            _warm_up()
        except BaseException:
            _lower_sets._KERNELS = None
            raise
    return _lower_sets._KERNELS


def _warm_up() -> None:
    from ...graph import Graph
    g = Graph.from_edges([4, 4, 4, 4], [(0, 1), (1, 2), (0, 2), (2, 3)])
    fam = LowerSetFamily.all(g)
    for objective in ("tc", "mc", "feasible"):
        run_dp(fam, 20, objective, engine="numba")
        run_dp(fam, None, objective, engine="numba")
    run_dp(fam, 10_000, "tc", engine="numba")


def _pick_engine(engine: Optional[str], family: LowerSetFamily, total_t: int) -> str:
    """``'numba'`` (the kernels loaded) or ``'numpy'``, through
    :func:`~chainer_recompute.core.kernels.pick_engine`; ``auto`` picks the
    kernels when the problem repays loading them (:data:`COMPILED_MIN_WORK`),
    when NumPy's table would take more memory than theirs
    (:data:`NUMPY_TABLE_BYTES`), or when this process has loaded them
    already."""
    K = len(family)
    picked = pick_engine(engine, what="flat DP", default=ENGINE,
                         pays=lambda: (loaded_kernels() is not None
                                       or K * K * (total_t + 1) // 2 > COMPILED_MIN_WORK
                                       or K * (total_t + 1) * 16 > NUMPY_TABLE_BYTES))
    if picked == "numba":
        _load_kernels()
    return picked


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

    ``engine``: ``numba`` (compiled kernels,
    :mod:`~chainer_recompute.core.kernels.dp`: a feasible chain found first
    by a one-state-per-row heuristic bounds the optimum, and every state
    that cannot reach it is pruned; an error without numba), ``numpy``
    (vectorised NumPy), ``auto`` or ``None`` (:data:`ENGINE`; see
    :func:`~chainer_recompute.core.kernels.pick_engine`). ``method`` (NumPy
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
        if objective == "mc":  # one block: nothing retained but what must be kept
            return DPResult([0, K - 1], float(pairs.btime[K - 1]), int(pairs.bbytes[K - 1]),
                            1, 2)
        chain = _prefix_chain(family)
        if chain is not None:  # every non-sink kept
            return DPResult(chain, float(pairs.r0[0]), 0, len(chain) - 1, len(chain))
    if (_pick_engine(engine, family, pairs.total_t) == "numba"
            and (objective == "feasible" or K * (pairs.total_t + 1) <= COMPILED_DENSE_LIMIT)):
        return _run_compiled(family, pairs, budget, objective)
    inf = np.iinfo(np.int64).max
    least, fsrc, n_feas = _bounds(pairs, budget, "feasibility", lambda: _feasibility(pairs, budget))
    if least[K - 1] == inf:
        return DPResult(None, 0.0, 0, n_feas, 0)
    if objective == "feasible":
        chain = [K - 1]
        while chain[-1] != 0:
            chain.append(int(fsrc[chain[-1]]))
        chain.reverse()
        return DPResult(chain, float("nan"), int(least[K - 1]), n_feas, K)
    cap = (_bounds(pairs, budget, "capacity", lambda: _capacity(pairs, budget, least))
           if budget is not None else np.full(K, inf, np.int64))
    if method == "auto":
        method = "dense" if K * (pairs.total_t + 1) <= DENSE_LIMIT else "sparse"
    if method == "dense":
        return _dense(pairs, budget, objective, least, cap)
    return _sparse(pairs, budget, objective, least, cap)


def _bounds(pairs: _Pairs, budget: Optional[int], kind: str, compute: Any) -> Any:
    """``compute()``, a pass that depends on the lower sets' memory and the
    budget only, or its value for this budget from pairs that share their
    passes (:meth:`_Pairs.with_costs`: the last budget's are kept)."""
    memo = pairs.memo
    if memo is None:
        return compute()
    key = (kind, budget)
    if key not in memo:
        if memo and next(iter(memo))[1] != budget:
            memo.clear()
        memo[key] = compute()
    return memo[key]


def _prefix_chain(family: LowerSetFamily, chunk: int = 1 << 16) -> Optional[List[int]]:
    """Rows of the topological prefixes ∅, {0}, {0, 1}, ..., V, when the
    family holds them all (every lower set does), else None."""
    from ...lower_sets import _n_words, _pack
    n = family.graph.n
    prefixes = _pack(np.tri(n + 1, n, -1, dtype=np.uint8), _n_words(n))  # row k: 0..k-1
    rows: List[int] = []
    for s in range(0, len(family), chunk):  # (chunks: a lattice may have millions of rows)
        w = family.words[s:s + chunk]
        hit = np.all(w == prefixes[family.size[s:s + chunk]], axis=1)
        rows += (s + np.flatnonzero(hit)).tolist()
    return rows if len(rows) == n + 1 else None


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
    from ...lower_sets import _bits, _masks_of_rows
    from ...schedule import StrategyCost
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

    from ...plan import infeasible_plan, make_plan
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
