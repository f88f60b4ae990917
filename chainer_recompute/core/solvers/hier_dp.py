"""The hierarchical DP: plan each distinct segment once, then chain them
(docs/algorithm.md, "Planning at scale").

Pure core: numpy only (the chain DP's table: :mod:`..kernels.hier`).

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

import copy
import dataclasses
import hashlib
import logging
import math
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..costs import node_costs, time_free_model
from ..graph import Graph
from ..keep import with_must_keep
from ..lower_sets import LowerSetFamily, _rows_of_masks, _n_words
from ..memory_model import MemoryModel
from ..plan import Plan, infeasible_plan, make_plan
from ..schedule import entry_cost
from ..segments import Segments, detect_segments, last_readers, menu_offsets, \
    node_signatures, prefix_boundary_bytes
from ..kernels.hier import kernel, least_kernel
from . import _dp

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
    bytes and time (under the costs they were planned with), each option's
    chain as lists of local node indices (0 = the piece's first node) and
    the local indices of the nodes it keeps (whose costs give the retained
    time of each piece with these options). ``free``: the options found
    whatever the costs (the least retained memory at each budget; every
    option of a graph with time-free costs), in an order that does not
    depend on costs: the same for two recordings of one model."""

    peak: np.ndarray
    keep: np.ndarray
    time: np.ndarray
    chains: List[List[np.ndarray]]
    kept: List[np.ndarray]
    free: np.ndarray

    def time_free(self) -> "_Options":
        """The options of :attr:`free`, in its order."""
        f = self.free.tolist()
        return _Options(peak=self.peak[f], keep=self.keep[f], time=self.time[f],
                        chains=[self.chains[i] for i in f], kept=[self.kept[i] for i in f],
                        free=np.arange(len(f), dtype=np.int64))


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
        self._flat: Dict[bool, Tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._times: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None
        self._edges: Optional[np.ndarray] = None
        self.n_distinct_pieces = 0
        self._least_budget: Optional[int] = None
        if self.ok:
            self._build(max_positions)
        self.setup_time_s = time.perf_counter() - t0

    # ------------------------------------------------------------ build
    def _build(self, max_positions: int) -> None:
        g, m, seg = self.graph, self.model, self.segments
        assert seg is not None
        n = g.n
        keep = np.asarray(m.keep_bytes, dtype=np.int64)
        bnd = prefix_boundary_bytes(g, keep, must_keep=False)  # (where to cut: the wiring)
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
        self._last = last_readers(g)  # (a kept node is read "at n": in ∂ of every prefix)
        step = np.full((P + 1, P + 1), np.iinfo(np.int64).max // 4, dtype=np.int64)
        back = above[c] + beside[c]
        for j in range(P):
            q = np.arange(j + 1, P + 1)
            trm = np.maximum.accumulate(pmax[j:])
            step[j, j + 1:] = blk[c[q]] - blk[c[j]] + back[q] + trm
        self.step = step
        self.dm = self._retained(np.asarray(m.keep_bytes, dtype=np.int64))
        self.dt = self._retained(np.asarray(g.node_cost, dtype=np.float64))

    def _retained(self, w: np.ndarray) -> np.ndarray:
        """What the long block ``j -> q`` retains, as a ``(P + 1, P + 1)``
        matrix (upper triangle): ``w`` summed over ∂(prefix ``c_q``) less
        E(j, q), the nodes before ``c_j`` still read at or after ``c_q``
        (retained by earlier blocks)."""
        g, c = self.graph, self.cuts
        P = len(c) - 1
        ids, last = np.arange(g.n), self._last
        D = prefix_boundary_bytes(g, w)[c]
        out = np.zeros((P + 1, P + 1), dtype=w.dtype)
        for j in range(P):
            q = np.arange(j + 1, P + 1)
            u = np.flatnonzero((ids < c[j]) & (last >= c[j]))
            e: Any = 0
            if len(u):
                order = np.argsort(last[u])
                cw = np.concatenate((np.cumsum(w[u][order][::-1])[::-1], [0]))
                e = cw[np.searchsorted(last[u][order], c[q], "left")]
            out[j, j + 1:] = D[q] - e
        return out

    def _window(self, j: int, node_cost: np.ndarray
                ) -> Tuple[List[Tuple[int, int]], np.ndarray, MemoryModel, bytes, Tuple]:
        """Piece ``j`` with its context: a small graph ``S, piece...,
        context..., G, F`` (S: what came before; F: every later use past the
        context, with the above bytes of A(prefix); G: the beside bytes of
        B(prefix)), its costs (of ``node_cost``), its memory model, a key
        equal for identical pieces, and the window ids of the piece's nodes
        every plan keeps (:attr:`Graph.must_keep`)."""
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
        costs = np.concatenate(([0.0], node_cost[sl], [0.0, 0.0]))
        kept = np.array([g.nodes[v].must_keep for v in range(c0, c1)], dtype=bool)
        key = hashlib.sha1(b"".join([
            np.array([L, C, int(s_to_f)], dtype=np.int64).tobytes(),
            self._sig[sl].tobytes(), np.array(far_flags, dtype=bool).tobytes(), kept.tobytes(),
            np.array([above_f, beside_g], dtype=np.int64).tobytes(),
            np.array(edges, dtype=np.int64).tobytes()])).digest()
        return edges, costs, wm, key, tuple((np.flatnonzero(kept) + 1).tolist())

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
        # Each piece's options: most retained time under the graph's own
        # costs, least retained memory (whatever the costs). The latter are
        # the same for two recordings of one model, and so is the least
        # budget found over them (_least_m); on a measured graph, a window
        # under time-free costs (flops) orders them without times.
        free = time_free_model(g.cost_model)
        free_cost = g.node_cost if free == g.cost_model else node_costs(g, free)
        timed = free != g.cost_model
        groups: Dict[bytes, List[Any]] = {}
        keys = []
        for j in range(P):
            edges, costs, wm, key, kept = self._window(j, free_cost)
            keys.append(key)
            own = self._window_costs(j) if timed else None
            got = groups.get(key)
            if got is None:
                groups[key] = [edges, costs.copy(), own, wm, 1,
                               int(self.cuts[j + 1] - self.cuts[j]), kept]
            else:
                got[1] += costs
                if timed:
                    got[2] += own
                got[4] += 1
        # Identical pieces are planned once, with their mean costs.
        cache: Dict[bytes, _Options] = {}
        for key, (edges, fsum, tsum, wm, cnt, L, kept) in groups.items():
            wg = with_must_keep(Graph.from_edges([0] * len(fsum), edges,
                                                 costs=(fsum / cnt).tolist()), kept)
            wt = None if tsum is None else with_must_keep(
                Graph.from_edges([0] * len(tsum), edges, costs=(tsum / cnt).tolist()), kept)
            cache[key] = _plan_piece(wg, wm, L, wt)
        self.piece_options = [cache[k] for k in keys]
        self.n_distinct_pieces = len(cache)
        self.piece_times = self._piece_times()

    def _window_costs(self, j: int) -> np.ndarray:
        """The graph's own costs of piece ``j``'s window, as
        :meth:`_window` lays it out."""
        g = self.graph
        c0, c1 = int(self.cuts[j]), int(self.cuts[j + 1])
        per = self.segments.period if self.segments is not None else c1 - c0
        hi = min(g.n, c1 + max(c1 - c0, per))
        return np.concatenate(([0.0], g.node_cost[c0:hi], [0.0, 0.0]))

    def _piece_times(self) -> List[np.ndarray]:
        """The time each option of each piece retains, from that repeat's
        own costs (the graph's)."""
        cost = np.asarray(self.graph.node_cost, dtype=np.float64)
        return [np.array([float(cost[int(self.cuts[j]) + k].sum()) for k in o.kept],
                         dtype=np.float64)
                for j, o in enumerate(self.piece_options)]

    def with_costs(self, graph: Graph, time_free: bool = False) -> "HierProblem":
        """This problem for ``graph``, this one's graph with other node
        costs (its :meth:`~Graph.without_times`, say): positions, options,
        memory and the least budget shared; the retained times (of long
        blocks and options) from ``graph``'s costs, and no chain found yet.
        With ``time_free``, only each piece's time-free options
        (:attr:`_Options.free`): with ``graph``'s costs time-free too, a
        problem that is the same for two recordings of one model.

        Raises:
            ValueError: ``graph`` has other nodes, wiring or sizes.
        """
        g = self.graph
        if graph is g and not time_free:
            return self
        if (graph.n != g.n or graph.preds != g.preds
                or not np.array_equal(graph.node_bytes, g.node_bytes)):
            raise ValueError("with_costs takes the same graph with other costs; this one has "
                             "other nodes, wiring or sizes")
        other = copy.copy(self)
        other.graph = graph
        other.reached, other._times, other._flat = [], None, {}
        other.__dict__.pop("_tables", None)  # the chain DP's own tables
        if self.ok:
            if time_free:
                other.piece_options = [o.time_free() for o in self.piece_options]
            other.dt = other._retained(np.asarray(graph.node_cost, dtype=np.float64))
            other.piece_times = other._piece_times()
        return other

    # ------------------------------------------------------------ solve
    def vanilla_bytes(self) -> int:
        m = self.model
        return int(m.constant_bytes + m.block_bytes.sum() + m.transient_bytes.max())

    def least_budget(self) -> int:
        """The least budget (under the model) for which the chain DP finds
        a plan: bisection on the budget over a one-state-per-position DP
        (made once). It depends on the positions and the options' memory
        only, not on the graph's costs."""
        if not self.ok:
            raise ValueError("no repeated segments: the least budget is the approximate DP's")
        if self._least_budget is None:
            self._least_budget = self._bisect_least()
        return self._least_budget

    def _bisect_least(self) -> int:
        m = self.model
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

    def _least_m(self, bc: int, engine: Optional[str] = None) -> Tuple[np.ndarray, List[Tuple[int, int]]]:
        """Least retained memory reaching each position within ``bc``
        (``-1``: unreachable) and the back-pointers ``(j, option)``, over
        the long blocks and each piece's time-free options (``option``
        indexes :attr:`_Options.free`): the same for two recordings of one
        model."""
        P = len(self.cuts) - 1
        ptr, o_peak, o_keep = self._flat_options(time_free=True)
        least = np.empty(P + 1, dtype=np.int64)
        back = np.empty((P + 1, 2), dtype=np.int64)
        fill = least_kernel(engine, _dp.ENGINE)
        fill(P, self.step, self.dm, ptr, o_peak, o_keep, bc, least, back)
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

    def _flat_options(self, time_free: bool = False
                      ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every piece's options in one array each: piece ``j``'s are
        ``ptr[j]:ptr[j + 1]`` of ``peak`` and ``keep`` (with ``time_free``,
        each piece's :attr:`_Options.free`, in its order)."""
        got = self._flat.get(time_free)
        if got is None:
            opts = [o.time_free() if time_free else o for o in self.piece_options]
            ptr = np.zeros(len(opts) + 1, dtype=np.int64)
            for j, o in enumerate(opts):
                ptr[j + 1] = ptr[j] + len(o.peak)
            got = self._flat[time_free] = (
                ptr, np.concatenate([o.peak for o in opts]).astype(np.int64),
                np.concatenate([o.keep for o in opts]).astype(np.int64))
        return got

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
            least, back = self._least_m(bc, engine)
            if least[-1] < 0:
                return None
            steps = []
            q = len(self.cuts) - 1
            while q > 0:
                j, o = back[q]  # (o: an option of the time-free ones)
                steps.append((j, q, o if o < 0 else int(self.piece_options[j].free[o])))
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
    kernel(engine, _dp.ENGINE)(P, U, prob.step, prob.dm, dt, ptr, o_peak, o_keep, o_dt, bc,
                               best, src, how, strategy == "tc", need)
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


def _plan_piece(wg: Graph, wm: MemoryModel, L: int, timed: Optional[Graph] = None) -> _Options:
    """The options of a piece: the approximate DP on its window graph (rows
    ``{S} ∪ ancestors-in-piece(v)``) at :data:`OPTION_BUDGETS` budgets, most
    retained time and least retained memory at each. ``wg`` has time-free
    costs; ``timed``, where given, is the same window under the repeats'
    mean measured costs, for the most retained time. The least retained
    memory does not depend on costs: those options (all of them without
    ``timed``) are the time-free ones (see :class:`_Options`)."""
    from ..lower_sets import ancestor_masks
    from ._dp.pairs import _Pairs
    anc = ancestor_masks(wg)
    piece = ((1 << (L + 1)) - 1)
    masks = [1, piece] + [(anc[v] & piece) | 1 for v in range(1, L + 1)]
    fam = LowerSetFamily.from_words(wg, _rows_of_masks(masks, _n_words(wg.n)), wm)
    # the runs at each budget share one feasibility pass (memory only)
    pairs = fam.cache["pairs"] = _Pairs(fam)
    pairs.memo = {}
    ft = fam
    if timed is not None:
        ft = fam.with_costs(timed)
        ft.cache["pairs"] = pairs.with_costs(ft)
    last = len(fam) - 1
    whole = _dp.chain_cost(fam, [last])
    lo = int((wm.block_bytes[1:L + 1] + wm.transient_bytes[1:L + 1]).max())
    hi = int(whole.peak_bytes)
    budgets = sorted({int(lo * (hi / max(lo, 1)) ** (i / (OPTION_BUDGETS - 1)))
                      for i in range(OPTION_BUDGETS)} | {hi})
    found: Dict[Tuple[int, ...], Tuple[int, int, float, float]] = {}
    free: Dict[Tuple[int, ...], bool] = {}
    kept_of: Dict[Tuple[int, ...], np.ndarray] = {}
    keepw, tcost, fcost = wm.keep_bytes, ft.graph.node_cost, wg.node_cost
    for b in budgets:
        for f, obj in ((ft, "tc"), (fam, "feasible")):
            res = _dp.run_dp(f, b, obj, engine="numpy")
            if res.chain is None:
                continue
            rows = tuple(res.chain[1:])
            is_free = f is fam
            if rows in found:
                free[rows] = free[rows] or is_free
                continue
            cc = _dp.chain_cost(f, list(rows))
            kept = 0
            for u in cc.checkpoints:
                kept |= u
            bits = [i for i in range(wg.n) if kept >> i & 1]
            kept_of[rows] = np.array([i - 1 for i in bits if 1 <= i <= L], dtype=np.int64)
            found[rows] = (int(cc.peak_bytes), int(sum(int(keepw[i]) for i in bits)),
                           float(sum(float(tcost[i]) for i in bits)),
                           float(sum(float(fcost[i]) for i in bits)))
            free[rows] = is_free
    # every distinct chain is kept: their times differ from one repeat of
    # the piece to the next (measured costs), so none is dominated for all
    items = sorted(found.items(), key=lambda kv: (kv[1][0], kv[1][1], -kv[1][2]))
    # the time-free ones, in an order that does not depend on times either
    free_idx = sorted((i for i, (rows, _) in enumerate(items) if free[rows]),
                      key=lambda i: (items[i][1][0], items[i][1][1], -items[i][1][3],
                                     items[i][0]))
    chains, kept_idx = [], []
    for rows, _ in items:
        kept_idx.append(kept_of[rows])
        ch = []
        for mk in fam.masks(list(rows)):
            mk &= ~1
            ch.append(np.array([i - 1 for i in range(1, L + 1) if mk >> i & 1], dtype=np.int64))
        chains.append(ch)
    return _Options(peak=np.array([v[0] for _, v in items], dtype=np.int64),
                    keep=np.array([v[1] for _, v in items], dtype=np.int64),
                    time=np.array([v[2] for _, v in items], dtype=np.float64),
                    chains=chains, kept=kept_idx, free=np.array(free_idx, dtype=np.int64))


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
