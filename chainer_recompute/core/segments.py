"""Repeated segments of a graph: layers of a deep network, steps of an
unrolled recurrent one (the hierarchical solver's cuts, see
:mod:`~chainer_recompute.core.solvers.hier_dp`).

Pure core: numpy only.

Node ids are a topological order, and a network that applies the same
layer again and again records the same run of functions again and again:
the same functions, with the same byte weights and costs, wired the same
way relative to each other. :func:`detect_segments` finds the period ``s``
of the longest such run and cuts it into ``count`` segments of ``s``
consecutive nodes, at the offset where the fewest bytes cross the cut.
Every cut between two node ids is a lower set (a *prefix* ``{0, ..., e}``),
so segments need no check of their own.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .graph import Graph
    from .memory_model import MemoryModel

logger = logging.getLogger(__name__)

__all__ = ["Segments", "detect_segments", "last_readers", "prefix_boundary_bytes",
           "node_signatures"]

#: Relative wiring is recorded for predecessors at most this far back; an
#: edge longer than this is recorded as "far".
NEAR = 256
#: Candidate periods tried (the most frequent gaps between equal nodes).
N_CANDIDATES = 8
#: At least this many repeats make a repeated structure.
MIN_REPEATS = 3


@dataclass(frozen=True)
class Segments:
    """A run of ``count`` identical segments of ``period`` nodes.

    Attributes:
        start: id of the first node of the first segment.
        period: nodes per segment.
        count: number of segments; they cover ``start .. start + period *
            count - 1``.
        interface_bytes: the memory model's keep bytes of the boundary of a
            cut between two segments (the median over the cuts).

    >>> s = Segments(start=1, period=12, count=4, interface_bytes=4)
    >>> s.bounds(0), s.covered
    ((1, 13), 48)
    """

    start: int
    period: int
    count: int
    interface_bytes: int

    def bounds(self, i: int) -> Tuple[int, int]:
        """Node ids ``[lo, hi)`` of segment ``i``."""
        lo = self.start + i * self.period
        return lo, lo + self.period

    @property
    def covered(self) -> int:
        """Nodes inside the segments."""
        return self.period * self.count

    @property
    def end(self) -> int:
        """One past the last node of the last segment."""
        return self.start + self.covered


def node_signatures(graph: "Graph", model: Optional["MemoryModel"] = None) -> np.ndarray:
    """One integer per node, equal for two nodes that run the same function
    with the same byte weights and read their inputs from nodes at
    the same distances back (edges longer than :data:`NEAR` count as
    "far").

    >>> from chainer_recompute.core.graph import Graph
    >>> g = Graph.from_edges([4] * 5, [(0, 1), (1, 2), (2, 3), (3, 4)])
    >>> s = node_signatures(g)
    >>> bool(s[1] == s[2] == s[3]), bool(s[0] == s[1])
    (True, False)
    """
    if model is None:
        from .memory_model import MemoryModel
        model = MemoryModel.paper(graph)
    table: Dict[tuple, int] = {}
    out = np.empty(graph.n, dtype=np.int64)
    for v, node in enumerate(graph.nodes):
        near = tuple(v - p for p in graph.preds[v] if v - p <= NEAR)
        far = sum(1 for p in graph.preds[v] if v - p > NEAR)
        key = (node.op, int(model.block_bytes[v]), int(model.keep_bytes[v]),
               int(model.above_bytes[v]), int(model.beside_bytes[v]),
               int(model.transient_bytes[v]), near, far,
               len(graph.succs[v]) > 0)
        out[v] = table.setdefault(key, len(table))
    return out


def last_readers(graph: "Graph", must_keep: bool = True) -> np.ndarray:
    """Each node's last successor (``-1``: none), ``n`` for a node every
    plan keeps (:attr:`~chainer_recompute.core.graph.Graph.must_keep`: in ∂
    of every prefix that holds it, V included) unless ``must_keep`` is False.

    >>> from chainer_recompute.core.graph import Graph
    >>> g = Graph.from_edges([1, 2, 3], [(0, 1), (0, 2)])
    >>> from chainer_recompute.core.keep import with_must_keep
    >>> last_readers(g).tolist(), last_readers(with_must_keep(g, [1])).tolist()
    ([2, -1, -1], [2, 3, -1])
    """
    last = np.array([max(s) if s else -1 for s in graph.succs], dtype=np.int64)
    if must_keep and graph.must_keep:
        last[list(graph.must_keep)] = graph.n
    return last


def prefix_boundary_bytes(graph: "Graph", weights: np.ndarray,
                          must_keep: bool = True) -> np.ndarray:
    """``out[e + 1]`` = Σ weights over ∂({0, ..., e}), the nodes of the
    prefix up to ``e`` read by a node after it (and, with ``must_keep``,
    those every plan keeps: see :func:`last_readers`), for ``e = -1 .. n - 1``.

    >>> from chainer_recompute.core.graph import Graph
    >>> g = Graph.from_edges([1, 2, 3], [(0, 1), (0, 2), (1, 2)])
    >>> prefix_boundary_bytes(g, g.node_bytes).tolist()
    [0, 1, 3, 0]
    >>> from chainer_recompute.core.keep import with_must_keep
    >>> prefix_boundary_bytes(with_must_keep(g, [2]), g.node_bytes).tolist()
    [0, 1, 3, 3]
    """
    n = graph.n
    last = last_readers(graph, must_keep)
    diff = np.zeros(n + 2, dtype=np.float64 if weights.dtype.kind == "f" else np.int64)
    ids = np.arange(n)
    live = last > ids
    # node u is in the boundary of the prefixes e = u .. last(u) - 1
    np.add.at(diff, ids[live] + 1, weights[live])
    np.add.at(diff, last[live] + 1, -weights[live])
    return np.cumsum(diff)[: n + 1]


def detect_segments(graph: "Graph", model: Optional["MemoryModel"] = None,
                    min_repeats: int = MIN_REPEATS) -> Optional[Segments]:
    """The longest run of identical segments of ``graph``, or ``None``.

    Candidate periods are the most frequent distances between two nodes
    with the same :func:`node_signatures`; for each, the longest run of
    nodes ``v`` whose signature equals that of ``v + period`` is found, and
    the period covering the most nodes (the shortest on a tie) wins. The
    run is then cut at the offset whose boundary (keep bytes under
    ``model``, the paper's by default) is the smallest.

    >>> from chainer_recompute.core.graph import Graph
    >>> edges = [(i, i + 1) for i in range(40)]
    >>> detect_segments(Graph.from_edges([4] * 41, edges)).period
    1
    """
    if model is None:
        from .memory_model import MemoryModel
        model = MemoryModel.paper(graph)
    n = graph.n
    if n < 2 * min_repeats:
        return None
    sig = node_signatures(graph, model)
    order = np.argsort(sig, kind="stable")
    ss = sig[order]
    same = ss[1:] == ss[:-1]
    gaps = (order[1:] - order[:-1])[same]
    if len(gaps) == 0:
        return None
    vals, counts = np.unique(gaps, return_counts=True)
    cands = vals[np.argsort(-counts, kind="stable")[:N_CANDIDATES]]
    best: Optional[Tuple[int, int, int]] = None  # (covered, -period, start)
    for s in sorted(int(c) for c in cands):
        if s <= 0 or s * min_repeats > n:
            continue
        match = sig[:-s] == sig[s:]
        # longest run of True
        m = np.concatenate(([False], match, [False]))
        d = np.diff(m.astype(np.int8))
        starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
        if len(starts) == 0:
            continue
        lens = ends - starts
        i = int(np.argmax(lens))
        k = (int(lens[i]) + s) // s
        if k < min_repeats:
            continue
        key = (k * s, -s, int(starts[i]))
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        return None
    covered, s, a = best[0], -best[1], best[2]
    k = covered // s
    # (the wiring's boundary: what a cut costs wherever the kept nodes are)
    bnd = prefix_boundary_bytes(graph, np.asarray(model.keep_bytes, dtype=np.int64), False)
    # cut before node a + i*s + r: prefix e = a + i*s + r - 1, bnd index e + 1
    med = []
    for r in range(s):
        idx = a + r + s * np.arange(1, k)
        med.append(float(np.median(bnd[idx])) if len(idx) else float(bnd[a + r]))
    r = int(np.argmin(med))
    if r > 0:
        a, k = a + r, k - 1
    if k < min_repeats:
        return None
    seg = Segments(start=int(a), period=int(s), count=int(k), interface_bytes=int(med[r]))
    logger.debug("segments: %s", seg)
    return seg


def menu_offsets(graph: "Graph", seg: Segments, keep_bytes: np.ndarray, factor: float = 2.0,
                 limit: int = 4) -> List[int]:
    """Offsets ``r`` (0 = the segment's start) of the cuts inside a segment
    whose boundary is at most ``factor`` times the segments' interface: the
    places where a block may start or end (0 always among them).

    >>> from chainer_recompute.core.graph import Graph
    >>> g = Graph.from_edges([4] * 12, [(i, i + 1) for i in range(11)])
    >>> menu_offsets(g, detect_segments(g), g.node_bytes)
    [0]
    """
    bnd = prefix_boundary_bytes(graph, np.asarray(keep_bytes, dtype=np.int64), False)
    s, k = seg.period, seg.count
    scores = []
    for r in range(s):
        idx = seg.start + r + s * np.arange(1, k)
        scores.append(float(np.median(bnd[idx])))
    ref = max(scores[0], 1.0)
    picks = sorted((sc, r) for r, sc in enumerate(scores) if r > 0 and sc <= factor * ref)
    return sorted([0] + [r for _, r in picks[: limit - 1]])
