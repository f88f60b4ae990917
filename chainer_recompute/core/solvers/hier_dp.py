"""The hierarchical DP: plan each distinct segment once, then chain them
(docs/algorithm.md, "Planning at scale").

Pure core: numpy only (the chain DP's loop is compiled with numba when the
``fast`` extra is installed).

The graph is cut at *positions* ``0 = c_0 < c_1 < ... < c_P = n``: the
lower set of position ``j`` is the topological prefix ``{0, ..., c_j - 1}``.
Positions are the boundaries of the repeated segments that
:func:`~chainer_recompute.core.segments.detect_segments` finds (layers,
time steps), the cuts inside a segment whose boundary is as small as the
segments' interface (at most :data:`MENU_LIMIT` a segment), and the cheap
cuts of the parts before and after the segments. The nodes between two
consecutive positions are a *piece*.

A plan of the hierarchical family is a chain of lower sets made of two
kinds of steps from position ``j``:

- a *long block* to any later position ``q``: one block, the nodes
  ``c_j .. c_q - 1`` (memory and costs computed exactly, from prefix sums
  over the graph);
- an *option* of piece ``j``: a chain of lower sets ``prefix(c_j) ∪ x``
  (``x`` an ancestor closure inside the piece) from ``c_j`` to ``c_{j+1}``,
  found by the approximate DP on the piece (with the piece's successors as
  context) at several budgets. An option is summed up by its peak above
  the memory retained before it, the bytes it retains and the time it
  retains; options of identical pieces are computed once.

DP table (:func:`_chain_dp`): ``best[q, t]`` is the least retained memory
over chains from ∅ to position ``q`` whose retained time, in integer
units, is ``t``; a step from ``(j, t)`` is allowed when ``best[j, t]`` plus
its peak fits the budget. The plan is the one with the most (tc) or least
(mc) retained time at ``q = P``, and it is evaluated again on the whole
graph (:func:`~chainer_recompute.core.schedule.strategy_cost`): its
predicted peak and overhead are exact, and ``feasible`` is checked on them.

References:
    Kusumoto et al., "A Graph Theoretic Framework of Recomputation
    Algorithms for Memory-Efficient Backpropagation", NeurIPS 2019 (the
    DP inside a piece); Gruslys et al., "Memory-Efficient Backpropagation
    Through Time", NIPS 2016 (a DP over a chain of steps).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..graph import Graph
from ..lower_sets import LowerSetFamily, _rows_of_masks, _n_words
from ..memory_model import MemoryModel
from ..plan import Plan, infeasible_plan, make_plan
from ..schedule import entry_cost
from ..segments import Segments, detect_segments, menu_offsets, node_signatures, \
    prefix_boundary_bytes
from ._dp import chain_cost, run_dp
from ._hier_kernel import kernel, least_kernel

logger = logging.getLogger(__name__)

__all__ = ["HierProblem", "hier_problem", "solve_hier", "solve_auto", "AUTO_MIN_NODES"]

#: ``solver='auto'`` plans graphs of at least this many nodes with the
#: hierarchical DP (when they have repeated segments), smaller ones with
#: the flat approximate DP.
AUTO_MIN_NODES = 1000
#: At most this many positions (the chain DP is quadratic in them): with
#: more, only segment boundaries are positions, then every g-th one.
MAX_POSITIONS = 800
#: Cuts inside a segment kept as positions, the segment's start included.
MENU_LIMIT = 8
#: A cut is a position when its boundary is at most this many times the
#: segments' interface.
MENU_FACTOR = 2.0
#: Budgets per piece at which its options are planned.
OPTION_BUDGETS = 12
#: Integer units of retained time in the chain DP's table (fewer for many
#: positions, see :func:`_units`).
TIME_UNITS = 4096
#: The segments must cover at least this share of the nodes.
MIN_COVERAGE = 0.5


# ----------------------------------------------------------------- problem
@dataclasses.dataclass
class _Options:
    """The options of one piece: peak above the retained memory, retained
    bytes and time (of the piece they were planned on), each option's
    chain as lists of local node indices (0 = the piece's first node) and
    the local indices of the nodes it keeps (whose costs give the retained
    time of each piece with these options)."""

    peak: np.ndarray
    keep: np.ndarray
    time: np.ndarray
    chains: List[List[np.ndarray]]
    kept: List[np.ndarray]


class HierProblem:
    """What the hierarchical DP needs of one graph under one memory model,
    computed once and reused for every budget (see module doc).

    Attributes:
        ok: whether the graph has repeated segments to plan this way.
        segments: the segments found (or ``None``).
        cuts: the positions ``c_0 = 0 < ... < c_P = n``.
        setup_time_s: time spent building it.
    """

    def __init__(self, graph: Graph, model: Optional[MemoryModel] = None,
                 max_positions: int = MAX_POSITIONS) -> None:
        t0 = time.perf_counter()
        self.graph = graph
        self.model = MemoryModel.paper(graph) if model is None else model
        self.segments: Optional[Segments] = detect_segments(graph, self.model)
        self.ok = _usable(self.segments, graph.n)
        self.cuts: np.ndarray = np.array([0, graph.n], dtype=np.int64)
        self.setup_time_s = 0.0
        #: ``(budget, time units)`` of every chain found: the time a chain
        #: can reach within a budget (a bound for the tc table of larger ones)
        self.reached: List[Tuple[int, int]] = []
        self._flat: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None
        self._times: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None
        self._edges: Optional[np.ndarray] = None
        self.n_distinct_pieces = 0
        if self.ok:
            self._build(max_positions)
        self.setup_time_s = time.perf_counter() - t0

    # ------------------------------------------------------------ build
    def _build(self, max_positions: int) -> None:
        g, m, seg = self.graph, self.model, self.segments
        assert seg is not None
        n = g.n
        keep = np.asarray(m.keep_bytes, dtype=np.int64)
        bnd = prefix_boundary_bytes(g, keep)
        menu = menu_offsets(g, seg, keep, MENU_FACTOR, MENU_LIMIT)
        # inner cuts, cheapest boundary first
        self._menu_rank = sorted(menu[1:], key=lambda r: (bnd[seg.start + r + seg.period], r))
        small = MENU_FACTOR * max(seg.interface_bytes, 1)
        # outside the segments: the cheap cuts, and the local minima of the
        # boundary (a block's output: a residual stage, a pooling)
        outside = [c for c in range(1, n) if (c < seg.start or c > seg.end)
                   and (bnd[c] <= small or bnd[c] <= bnd[c - 1] and bnd[c] <= bnd[c + 1])]
        cuts = self._cuts(seg, menu, outside, max_positions)
        self.cuts = np.array(sorted(set(cuts)), dtype=np.int64)
        self._pairs()
        self._options()

    def _cuts(self, seg: Segments, menu: List[int], outside: List[int],
              max_positions: int) -> List[int]:
        n = self.graph.n
        base = [0, n, seg.start, seg.end]
        # outside cuts: no more than the segments have positions
        if len(outside) > max_positions // 4:
            step = math.ceil(len(outside) / (max_positions // 4))
            outside = outside[::step]
        # fewer cuts inside a segment (the cheapest first), then only the
        # segments' boundaries, then every g-th boundary
        for keep in range(len(menu), 0, -1):
            sub = [0] + [r for r in menu[1:] if r in self._menu_rank[:keep - 1]]
            inside = [seg.start + i * seg.period + r for i in range(seg.count) for r in sub]
            if len(inside) + len(outside) <= max_positions:
                break
        if len(inside) + len(outside) > max_positions:
            gsz = math.ceil(seg.count / max(1, max_positions - len(outside)))
            inside = [seg.start + i * seg.period for i in range(0, seg.count, gsz)]
        return base + inside + outside

    def _pairs(self) -> None:
        """Exact peak, retained bytes and retained time of every long block
        ``j -> q``, as ``(P + 1, P + 1)`` matrices (upper triangle)."""
        g, m = self.graph, self.model
        n = g.n
        c = self.cuts
        P = len(c) - 1
        blk = np.concatenate(([0], np.cumsum(m.block_bytes.astype(np.int64))))
        preds, succs = g.preds, g.succs
        ids = np.arange(n)
        minpred = np.array([min(p) if p else v for v, p in enumerate(preds)], dtype=np.int64)
        # v in A(prefix c) for c in [minpred(v) + 1, v]
        above = np.zeros(n + 2, dtype=np.int64)
        has = minpred < ids
        np.add.at(above, minpred[has] + 1, m.above_bytes[has])
        np.add.at(above, ids[has] + 1, -m.above_bytes[has])
        above = np.cumsum(above)[: n + 1]
        mm = np.array([min((minpred[w] for w in s), default=u) for u, s in enumerate(succs)],
                      dtype=np.int64)
        beside = np.zeros(n + 2, dtype=np.int64)
        has = mm < ids
        np.add.at(beside, mm[has] + 1, m.beside_bytes[has])
        np.add.at(beside, ids[has] + 1, -m.beside_bytes[has])
        beside = np.cumsum(beside)[: n + 1]
        self.above_at, self.beside_at = above, beside
        tr = np.asarray(m.transient_bytes, dtype=np.int64)
        pmax = np.array([tr[c[j]:c[j + 1]].max() if c[j + 1] > c[j] else 0 for j in range(P)],
                        dtype=np.int64)
        keep = np.asarray(m.keep_bytes, dtype=np.int64)
        cost = np.asarray(g.node_cost, dtype=np.float64)
        last = np.array([max(s) if s else -1 for s in succs], dtype=np.int64)
        D = prefix_boundary_bytes(g, keep)[c]
        DT = prefix_boundary_bytes(g, cost)[c]
        step = np.full((P + 1, P + 1), np.iinfo(np.int64).max // 4, dtype=np.int64)
        dm = np.zeros((P + 1, P + 1), dtype=np.int64)
        dt = np.zeros((P + 1, P + 1), dtype=np.float64)
        back = above[c] + beside[c]
        for j in range(P):
            q = np.arange(j + 1, P + 1)
            trm = np.maximum.accumulate(pmax[j:])
            step[j, j + 1:] = blk[c[q]] - blk[c[j]] + back[q] + trm
            # E(j, q): nodes before c_j still read at or after c_q
            u = np.flatnonzero((ids < c[j]) & (last >= c[j]))
            if len(u):
                order = np.argsort(last[u])
                lu = last[u][order]
                ck = np.concatenate((np.cumsum(keep[u][order][::-1])[::-1], [0]))
                ct = np.concatenate((np.cumsum(cost[u][order][::-1])[::-1], [0.0]))
                pos = np.searchsorted(lu, c[q], "left")
                e_m, e_t = ck[pos], ct[pos]
            else:
                e_m, e_t = 0, 0.0
            dm[j, j + 1:] = D[q] - e_m
            dt[j, j + 1:] = DT[q] - e_t
        self.step, self.dm, self.dt = step, dm, dt

    def _window(self, j: int) -> Tuple[List[Tuple[int, int]], np.ndarray, MemoryModel, bytes]:
        """Piece ``j`` with its context: a small graph ``S, piece...,
        context..., G, F`` (S: what came before; F: every later use past the
        context, with the above bytes of A(prefix); G: the beside bytes of
        B(prefix)), its memory model and a key equal for identical pieces."""
        g, m = self.graph, self.model
        c0, c1 = int(self.cuts[j]), int(self.cuts[j + 1])
        L = c1 - c0
        per = self.segments.period if self.segments is not None else L
        hi = min(g.n, c1 + max(L, per))
        C = hi - c1
        nodes = list(range(c0, hi))
        loc = {v: i + 1 for i, v in enumerate(nodes)}
        G, F = L + C + 1, L + C + 2
        edges = []
        far_flags = []
        for v in nodes:
            for p in g.preds[v]:
                edges.append((loc[p] if p >= c0 else 0, loc[v]))
            far = any(w >= hi for w in g.succs[v])
            far_flags.append(far)
            if far:
                edges.append((loc[v], F))
        # prefix nodes read past the window
        s_to_f = bool(self._prefix_far(c0, hi))
        if s_to_f:
            edges.append((0, F))
        edges.append((G, F))
        edges = sorted(set(edges))
        k = L + C + 3
        sl = slice(c0, hi)

        def w(arr: np.ndarray, first: int, g_val: int, f_val: int) -> np.ndarray:
            return np.concatenate(([first], np.asarray(arr[sl], dtype=np.int64),
                                   [g_val], [f_val]))

        above_f = int(self.above_at[hi]) if hi < g.n else 0
        beside_g = int(self.beside_at[hi]) if hi < g.n else 0
        wm = MemoryModel(block_bytes=w(m.block_bytes, 0, 0, 0), keep_bytes=w(m.keep_bytes, 0, 0, 0),
                         above_bytes=w(m.above_bytes, 0, 0, above_f),
                         beside_bytes=w(m.beside_bytes, 0, beside_g, 0),
                         transient_bytes=w(m.transient_bytes, 0, 0, 0), constant_bytes=0,
                         scope=m.scope)
        costs = np.concatenate(([0.0], g.node_cost[sl], [0.0, 0.0]))
        key = hashlib.sha1(b"".join([
            np.array([L, C, int(s_to_f)], dtype=np.int64).tobytes(),
            self._sig[sl].tobytes(), np.array(far_flags, dtype=bool).tobytes(),
            np.array([above_f, beside_g], dtype=np.int64).tobytes(),
            np.array(edges, dtype=np.int64).tobytes()])).digest()
        return edges, costs, wm, key

    def _prefix_far(self, c0: int, hi: int) -> bool:
        """Whether some node before ``c0`` is read at or after ``hi``."""
        return bool(self._last_before[c0] >= hi) if c0 > 0 else False

    def _options(self) -> None:
        g = self.graph
        self._sig = node_signatures(g, self.model)
        last = np.array([max(s) if s else -1 for s in g.succs], dtype=np.int64)
        # the latest reader of any node before c
        self._last_before = np.concatenate(([-1], np.maximum.accumulate(last)))
        P = len(self.cuts) - 1
        groups: Dict[bytes, List[Any]] = {}
        keys = []
        for j in range(P):
            edges, costs, wm, key = self._window(j)
            keys.append(key)
            got = groups.get(key)
            if got is None:
                groups[key] = [edges, costs.copy(), wm, 1,
                               int(self.cuts[j + 1] - self.cuts[j])]
            else:
                got[1] += costs
                got[3] += 1
        # Identical pieces are planned once, with their mean costs (measured
        # times differ from one repeat to the next).
        cache: Dict[bytes, _Options] = {}
        for key, (edges, csum, wm, cnt, L) in groups.items():
            wg = Graph.from_edges([0] * len(csum), edges, costs=(csum / cnt).tolist())
            cache[key] = _plan_piece(wg, wm, L)
        self.piece_options = [cache[k] for k in keys]
        self.n_distinct_pieces = len(cache)
        cost = np.asarray(g.node_cost, dtype=np.float64)
        self.piece_times = [np.array([float(cost[int(self.cuts[j]) + k].sum()) for k in o.kept],
                                     dtype=np.float64)
                            for j, o in enumerate(self.piece_options)]

    # ------------------------------------------------------------ solve
    def vanilla_bytes(self) -> int:
        m = self.model
        return int(m.constant_bytes + m.block_bytes.sum() + m.transient_bytes.max())

    def least_budget(self) -> int:
        """The least budget (under the model) for which the chain DP finds
        a plan: bisection on the budget over a one-state-per-position DP."""
        m = self.model
        if not self.ok:
            raise ValueError("no repeated segments: the least budget is the approximate DP's")
        lo = int((m.block_bytes + m.transient_bytes).max()) - 1
        hi = self.vanilla_bytes() - m.constant_bytes
        if self._least_m(hi)[0][-1] < 0:  # pragma: no cover - the single block fits
            return hi + m.constant_bytes
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._least_m(mid)[0][-1] >= 0:
                hi = mid
            else:
                lo = mid
        return int(hi + m.constant_bytes)

    def _least_m(self, bc: int) -> Tuple[np.ndarray, List[Tuple[int, int]]]:
        """Least retained memory reaching each position within ``bc``
        (``-1``: unreachable) and the back-pointers ``(j, option)``."""
        P = len(self.cuts) - 1
        ptr, o_peak, o_keep = self._flat_options()
        least = np.empty(P + 1, dtype=np.int64)
        back = np.empty((P + 1, 2), dtype=np.int64)
        least_kernel()(P, self.step, self.dm, ptr, o_peak, o_keep, bc, least, back)
        return least, [(int(j), int(o)) for j, o in back]

    def edges(self) -> np.ndarray:
        """The graph's :meth:`~Graph.edge_array`, made once (it dies with
        this problem, held weakly by :func:`hier_problem`)."""
        if self._edges is None:
            self._edges = self.graph.edge_array()
        return self._edges

    def time_units(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The chain DP's retained times in integer units (``TIME_UNITS``
        for every node with a successor), made once: long blocks ``dt``,
        options ``o_dt`` (as :meth:`_flat_options`) and the most a chain
        from each position on can retain (:func:`_most_time`)."""
        if self._times is None:
            g = self.graph
            nonsink = float(sum(g.node_cost[v] for v in range(g.n) if g.succs[v]))
            scale = _units(len(self.cuts) - 1) / nonsink if nonsink > 0 else 0.0
            dt = np.round(self.dt * scale).astype(np.int64)
            o_dt = np.round(np.concatenate(self.piece_times) * scale).astype(np.int64)
            self._times = (dt, o_dt, _most_time(dt, o_dt, self._flat_options()[0]))
        return self._times

    def _flat_options(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every piece's options in one array each: piece ``j``'s are
        ``ptr[j]:ptr[j + 1]`` of ``peak`` and ``keep``."""
        if self._flat is None:
            ptr = np.zeros(len(self.piece_options) + 1, dtype=np.int64)
            for j, o in enumerate(self.piece_options):
                ptr[j + 1] = ptr[j] + len(o.peak)
            self._flat = (ptr, np.concatenate([o.peak for o in self.piece_options]).astype(np.int64),
                          np.concatenate([o.keep for o in self.piece_options]).astype(np.int64))
        return self._flat

    def chain_masks(self, steps: List[Tuple[int, int, int]]) -> List[int]:
        """The lower sets (bitsets) of a chain of steps ``(j, q, option)``
        (``option`` -1: a long block)."""
        masks: List[int] = []
        for j, q, o in steps:
            if o < 0:
                masks.append((1 << int(self.cuts[q])) - 1)
                continue
            c0 = int(self.cuts[j])
            base = (1 << c0) - 1
            for local in self.piece_options[j].chains[o]:
                mk = base
                for i in local.tolist():
                    mk |= 1 << (c0 + i)
                masks.append(mk)
        return masks

    def chain_blocks(self, steps: List[Tuple[int, int, int]]) -> List[np.ndarray]:
        """The blocks (node ids) of a chain of steps ``(j, q, option)``."""
        out: List[np.ndarray] = []
        for j, q, o in steps:
            c0 = int(self.cuts[j])
            if o < 0:
                out.append(np.arange(c0, int(self.cuts[q]), dtype=np.int64))
                continue
            seen = np.zeros(int(self.cuts[j + 1]) - c0, dtype=bool)
            for local in self.piece_options[j].chains[o]:
                new = local[~seen[local]]
                if len(new):
                    seen[new] = True
                    out.append(np.sort(new) + c0)
        return out

    def solve(self, budget_bytes: Optional[int], strategy: str,
              engine: Optional[str] = None) -> Optional[List[Tuple[int, int, int]]]:
        """The chain DP's steps for a budget (``None``: unbounded), or
        ``None`` when nothing fits."""
        m = self.model
        bc = (self.vanilla_bytes() if budget_bytes is None else int(budget_bytes)) \
            - m.constant_bytes
        if strategy == "feasible":
            least, back = self._least_m(bc)
            if least[-1] < 0:
                return None
            steps = []
            q = len(self.cuts) - 1
            while q > 0:
                j, o = back[q]
                steps.append((j, q, o))
                q = j
            return steps[::-1]
        return _chain_dp(self, bc, strategy, engine)


def _usable(seg: Optional[Segments], n: int) -> bool:
    """Whether segments are worth planning hierarchically: at least 4, over
    :data:`MIN_COVERAGE` of the nodes."""
    return seg is not None and seg.covered >= MIN_COVERAGE * n and seg.count >= 4


def _units(P: int) -> int:
    """Time units of the chain DP's table for ``P`` positions (its rows
    keep only non-dominated states, so the units cost memory, not time)."""
    return TIME_UNITS


def _chain_dp(prob: HierProblem, bc: int, strategy: str,
              engine: Optional[str]) -> Optional[List[Tuple[int, int, int]]]:
    P = len(prob.cuts) - 1
    U = _units(P)
    dt, o_dt, most = prob.time_units()
    ptr, o_peak, o_keep = prob._flat_options()
    # a chain has at most P steps, each rounded by at most half a unit
    U = U + P // 2 + 1
    inf = np.iinfo(np.int64).max // 4
    # the tables, allocated once per problem and refilled for each solve
    # (a fresh allocation of these three cost a quarter of a solve)
    tables = getattr(prob, "_tables", None)
    if tables is None or tables[0].shape != (P + 1, U + 1):
        tables = prob._tables = (np.empty((P + 1, U + 1), dtype=np.int64),
                                 np.empty((P + 1, U + 1), dtype=np.int32),
                                 np.empty((P + 1, U + 1), dtype=np.int32))
    best, src, how = tables
    best.fill(inf)  # (src and how are read only where best is finite, written with it)
    best[0, 0] = 0
    # Branch and bound (tc): a chain found at a budget no larger than this
    # one retains ``lb`` units, so the optimum retains at least as much; a
    # state of row q retaining t units leads at best to t + most[q] (every
    # later step's time, memory ignored), so one with t < lb - most[q] is
    # not used as a source. Every state on an optimal chain stays, and with
    # it the chain the full table gives (the same sources, in the same order).
    need = np.full(P + 1, -1, dtype=np.int64)
    if strategy == "tc":
        lb = max((t for b, t in prob.reached if b <= bc), default=-1)
        if lb > 0:
            need = lb - most
    kernel(engine)(P, U, prob.step, prob.dm, dt, ptr, o_peak, o_keep, o_dt, bc, best, src,
                   how, strategy == "tc", need)
    fin = np.flatnonzero(best[P] < inf)
    if len(fin) == 0:
        return None
    t = int(fin[-1] if strategy == "tc" else fin[0])
    prob.reached.append((bc, t))
    steps = []
    q = P
    while q > 0:
        j, h = int(src[q, t]), int(how[q, t])
        steps.append((j, q, h - int(ptr[j]) if h >= 0 else -1))
        t -= int(o_dt[h]) if h >= 0 else int(dt[j, q])
        q = j
    return steps[::-1]


def _most_time(dt: np.ndarray, o_dt: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """The most time units a chain from each position to the last can
    retain, memory ignored: ``most[j]``, the longest path from ``j`` over
    long blocks ``dt[j, q]`` and options ``o_dt``."""
    P = len(ptr) - 1
    most = np.zeros(P + 1, dtype=np.int64)
    for j in range(P - 1, -1, -1):
        best = int((dt[j, j + 1:] + most[j + 1:]).max())
        if ptr[j + 1] > ptr[j]:
            best = max(best, int(o_dt[ptr[j]:ptr[j + 1]].max()) + int(most[j + 1]))
        most[j] = best
    return most


def _plan_piece(wg: Graph, wm: MemoryModel, L: int) -> _Options:
    """The options of a piece: the approximate DP on its window graph (rows
    ``{S} ∪ ancestors-in-piece(v)``) at :data:`OPTION_BUDGETS` budgets, most
    retained time and least retained memory at each."""
    from ..lower_sets import ancestor_masks
    anc = ancestor_masks(wg)
    piece = ((1 << (L + 1)) - 1)
    masks = [1, piece] + [(anc[v] & piece) | 1 for v in range(1, L + 1)]
    fam = LowerSetFamily.from_words(wg, _rows_of_masks(masks, _n_words(wg.n)), wm)
    last = len(fam) - 1
    whole = chain_cost(fam, [last])
    lo = int((wm.block_bytes[1:L + 1] + wm.transient_bytes[1:L + 1]).max())
    hi = int(whole.peak_bytes)
    budgets = sorted({int(lo * (hi / max(lo, 1)) ** (i / (OPTION_BUDGETS - 1)))
                      for i in range(OPTION_BUDGETS)} | {hi})
    found: Dict[Tuple[int, ...], Tuple[int, int, float]] = {}
    kept_of: Dict[Tuple[int, ...], np.ndarray] = {}
    cost = wg.node_cost
    keepw = wm.keep_bytes
    for b in budgets:
        for obj in ("tc", "feasible"):
            res = run_dp(fam, b, obj, engine="numpy")
            if res.chain is None:
                continue
            rows = tuple(res.chain[1:])
            if rows in found:
                continue
            cc = chain_cost(fam, list(rows))
            kept = 0
            for u in cc.checkpoints:
                kept |= u
            bits = [i for i in range(wg.n) if kept >> i & 1]
            kept_of[rows] = np.array([i - 1 for i in bits if 1 <= i <= L], dtype=np.int64)
            found[rows] = (int(cc.peak_bytes), int(sum(int(keepw[i]) for i in bits)),
                           float(sum(float(cost[i]) for i in bits)))
    # every distinct chain is kept: their times differ from one repeat of
    # the piece to the next (measured costs), so none is dominated for all
    keep_items = sorted(found.items(), key=lambda kv: (kv[1][0], kv[1][1], -kv[1][2]))
    chains, kept_idx = [], []
    for rows, _ in keep_items:
        kept_idx.append(kept_of[rows])
        ch = []
        for mk in fam.masks(list(rows)):
            mk &= ~1
            ch.append(np.array([i - 1 for i in range(1, L + 1) if mk >> i & 1], dtype=np.int64))
        chains.append(ch)
    return _Options(peak=np.array([v[0] for _, v in keep_items], dtype=np.int64),
                    keep=np.array([v[1] for _, v in keep_items], dtype=np.int64),
                    time=np.array([v[2] for _, v in keep_items], dtype=np.float64),
                    chains=chains, kept=kept_idx)


# ------------------------------------------------------------------ cache
_LAST: List[Tuple[Any, Any, Any]] = []


def hier_problem(graph: Graph, model: Optional[MemoryModel] = None) -> HierProblem:
    """The :class:`HierProblem` of ``graph`` under ``model``: the one made
    last for them while something still holds it (a
    :class:`~chainer_recompute.core.budget.BudgetSearch` does, for all its
    budgets), else a new one. Held weakly here, so that its tables never
    outlive their users (they would count in a runtime meter's arrays)."""
    for gref, mref, pref in _LAST:
        prob = pref()
        if prob is not None and gref() is graph and (
                mref is None and model is None or mref is not None and mref() is model):
            return prob
    prob = HierProblem(graph, model)
    _LAST[:] = [e for e in _LAST if e[2]() is not None][:3]
    _LAST.insert(0, (weakref.ref(graph), None if model is None else weakref.ref(model),
                     weakref.ref(prob)))
    return prob


# ----------------------------------------------------------------- solvers
def solve_hier(graph: Graph, budget_bytes: Optional[int], *, strategy: str = "tc",
               model: Optional[MemoryModel] = None, problem: Optional[HierProblem] = None,
               engine: Optional[str] = None, **kw: Any) -> Plan:
    """Hierarchical DP: each distinct repeated piece planned once, the
    pieces chained by a DP over positions (see module doc); graphs without
    repeated segments are planned by :func:`solve_approx`.

    DP table: ``best[q, t]``, the least retained memory over chains of the
    hierarchical family from ∅ to position ``q`` retaining ``t`` units of
    time.

    Args:
        graph: the graph.
        budget_bytes: the memory budget under the memory model, or ``None``.
        strategy: ``'tc'`` or ``'mc'``.
        model: the memory model (the paper's when ``None``).
        problem: a prepared :func:`hier_problem` of ``graph`` and ``model``.
        engine: ``numba``, ``numpy`` or ``auto``/``None``, as for the flat DPs.

    Returns:
        A :class:`Plan` evaluated on the whole graph; ``feasible`` is False
        when nothing of the family fits. ``info['hierarchical']`` says
        whether the hierarchical DP ran (False: the flat approximate DP).

    References:
        Kusumoto et al., NeurIPS 2019 (the DP inside a piece); Gruslys et
        al., NIPS 2016 (chains of steps).

    >>> edges = [(i, i + 1) for i in range(59)]
    >>> plan = solve_hier(Graph.from_edges([4] * 60, edges), 100)
    >>> plan.feasible, plan.predicted_peak_bytes <= 100
    (True, True)
    """
    t0 = time.perf_counter()
    prob = problem if problem is not None else hier_problem(graph, model)
    if not prob.ok:
        from .approx_dp import solve_approx
        plan = solve_approx(graph, budget_bytes, strategy=strategy, model=model, engine=engine)
        info = dict(plan.info, hierarchical=False)
        return dataclasses.replace(plan, solver="hier", info=info)
    mdl = prob.model
    bc_budget = budget_bytes
    steps = None
    cost = None
    for _ in range(4):
        steps = prob.solve(bc_budget, strategy, engine)
        if steps is None:
            break
        blocks = prob.chain_blocks(steps)
        entry = np.empty(graph.n, dtype=np.int64)
        for b, nodes in enumerate(blocks):
            entry[nodes] = b
        cost = entry_cost(graph, entry, mdl, edges=prob.edges())
        if budget_bytes is None or cost.peak_bytes <= budget_bytes:
            break
        # the options' figures are conservative; this is a safety net
        bc_budget = int(bc_budget) - int(cost.peak_bytes - budget_bytes)  # pragma: no cover
        steps = None  # pragma: no cover
    dt = time.perf_counter() - t0
    info = {"hierarchical": True, "n_positions": len(prob.cuts) - 1,
            "n_distinct_pieces": prob.n_distinct_pieces,
            "segments": dataclasses.asdict(prob.segments) if prob.segments else None,
            "setup_time_s": prob.setup_time_s}
    if steps is None:
        return infeasible_plan(graph, solver="hier", strategy=strategy, budget_bytes=budget_bytes,
                               solve_time_s=dt, info=info, model=model)
    return make_plan(graph, None, solver="hier", strategy=strategy, budget_bytes=budget_bytes,
                     solve_time_s=time.perf_counter() - t0, info=info, model=model, cost=cost,
                     blocks=[frozenset(b.tolist()) for b in blocks])


def use_hier(graph: Graph, model: Optional[MemoryModel] = None) -> bool:
    """Whether ``solver='auto'`` plans ``graph`` with the hierarchical DP:
    at least :data:`AUTO_MIN_NODES` nodes and repeated segments."""
    if graph.n < AUTO_MIN_NODES:
        return False
    for gref, mref, pref in _LAST:  # a problem made already
        prob = pref()
        if prob is not None and gref() is graph and (
                mref is None and model is None or mref is not None and mref() is model):
            return prob.ok
    m = MemoryModel.paper(graph) if model is None else model
    return _usable(detect_segments(graph, m), graph.n)


def solve_auto(graph: Graph, budget_bytes: Optional[int], *, strategy: str = "tc",
               model: Optional[MemoryModel] = None, **kw: Any) -> Plan:
    """The hierarchical DP on large graphs with repeated segments
    (:func:`use_hier`), the flat approximate DP on the others.

    >>> solve_auto(Graph.from_edges([4, 4, 4], [(0, 1), (1, 2)]), 20).solver
    'approx'
    """
    if use_hier(graph, model):
        return solve_hier(graph, budget_bytes, strategy=strategy, model=model,
                          problem=kw.pop("problem", None), engine=kw.pop("engine", None))
    from .approx_dp import solve_approx
    kw.pop("problem", None)
    return solve_approx(graph, budget_bytes, strategy=strategy, model=model, **kw)
