"""From a strategy (a chain of lower sets) to an ordered schedule, and a
liveness simulator that measures its memory.

Pure core: numpy only.

The *canonical schedule* of a strategy ∅ ⊊ L_1 ⊊ ... ⊊ L_k = V
(docs/paper.md §2), with V_i = L_i \\ L_{i-1} and U_i = ∂(L_i) ∩ V_i:

- forward, i = 1..k: compute the nodes of V_i in topological order; the
  values of V_i \\ U_i are dropped (freed right after their last reader in
  the block);
- backward, i = k..1: recompute V_i \\ U_i, then backpropagate through V_i
  in reverse topological order.

Backward model (conservative, simple): the backward step of node ``w``
reads the gradient of ``w`` (accumulated from the backward steps of its
successors, or seeded when ``w`` is a sink), the forward value of ``w``
and the forward values of its predecessors; it creates (or accumulates
into) the gradients of its predecessors. Liveness: every forward value is
freed right after its last reader (forward recomputation or backward
step), every gradient right after the backward step that consumes it.
Sizes: a forward value and its gradient both take M_v bytes.

:func:`simulate` is the ground truth the DP's paper model
(:func:`paper_peak_bytes`) is compared with; a :class:`~.plan.Plan`
reports both.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import numpy as np

from .graph import Graph
from .lower_sets import boundary, mask_to_set, set_to_mask

if TYPE_CHECKING:  # pragma: no cover
    from .memory_model import MemoryModel

logger = logging.getLogger(__name__)

__all__ = ["Op", "Schedule", "SimResult", "StrategyCost", "build_schedule", "paper_cost",
           "paper_peak_bytes", "simulate", "strategy_cost"]

# Op kinds.
FORWARD = "forward"          # compute v for the first time (allocates M_v)
RECOMPUTE = "recompute"      # compute v again during backward (allocates M_v)
FREE = "free"                # free the forward value of v
BACKWARD = "backward"        # backward step of v: gradients of preds (allocates)
FREE_GRAD = "free_grad"      # free the gradient of v

Op = Tuple[str, int]


@dataclass(frozen=True)
class Schedule:
    """An ordered list of ``(kind, node)`` operations.

    ``kind`` is one of ``forward``, ``recompute``, ``free``, ``backward``,
    ``free_grad``.
    """

    ops: Tuple[Op, ...]
    n_blocks: int

    def __len__(self) -> int:
        return len(self.ops)

    def count(self, kind: str) -> int:
        """Number of ops of ``kind``."""
        return sum(1 for k, _ in self.ops if k == kind)


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` measured.

    Attributes:
        peak_bytes: the largest memory of intermediates (values and
            gradients) at any point.
        peak_step: index of the op after which the peak was reached.
        memory_bytes: memory after each op, int64 array of ``len(ops)``.
        recompute_cost: Σ T_v over the ``recompute`` ops.
    """

    peak_bytes: int
    peak_step: int
    memory_bytes: np.ndarray
    recompute_cost: float


@dataclass(frozen=True)
class StrategyCost:
    """A strategy's costs under the paper's model (docs/paper.md §3)."""

    peak_bytes: int
    overhead: float
    block_peaks_bytes: Tuple[int, ...]
    checkpoints: Tuple[int, ...]  # U_i as bitsets


def _masks(lower_sets: Sequence) -> List[int]:
    return [m if isinstance(m, int) else set_to_mask(m) for m in lower_sets]


def strategy_cost(graph: Graph, lower_sets: Sequence,
                  model: Optional["MemoryModel"] = None) -> StrategyCost:
    """Peak memory and overhead of a strategy under a memory model
    (docs/paper.md §3; :class:`~.memory_model.MemoryModel`, the paper's by
    default):

        M^(i) = constant + Σ_{j<i} keep(U_j) + block(V_i) + above(A_i)
                + beside(B_i) + max_{v ∈ V_i} transient_v

    (the paper: Σ_{j<i} M(U_j) + 2·M(V_i) + M(A_i) + M(B_i)) and
    T = Σ_i T(V_i \\ U_i). Vectorised over the blocks and the edges.

    Args:
        graph: the graph.
        lower_sets: L_1 ⊊ ... ⊊ L_k = V as bitsets or sets of node ids.
        model: the memory model; ``None`` for the paper's.

    >>> g = Graph.from_edges([1, 2, 1], [(0, 1), (1, 2)])
    >>> c = paper_cost(g, [{0, 1}, {0, 1, 2}])
    >>> c.peak_bytes, c.overhead
    (7, 2.0)
    """
    from .lower_sets import _derived_words, _n_words, _rows_of_masks, _bits, _masks_of_rows
    from .memory_model import MemoryModel
    if model is None:
        model = MemoryModel.paper(graph)
    masks = _masks(lower_sets)
    prev = 0
    for cur in masks:
        if cur & prev != prev or cur == prev:
            raise ValueError("lower sets must form a strictly increasing chain")
        prev = cur
    if not masks:
        return StrategyCost(peak_bytes=0, overhead=0.0, block_peaks_bytes=(), checkpoints=())
    n = graph.n
    nw = _n_words(n)
    words = _rows_of_masks(masks, nw)
    bnd, a, b = _derived_words(graph, words)
    x = _bits(words, n).astype(bool)
    xp = np.zeros_like(x)
    xp[1:] = x[:-1]
    block = x & ~xp
    u = _bits(bnd, n).astype(bool) & block
    i64 = np.int64
    keep = (u.astype(i64) @ model.keep_bytes)
    acc = np.concatenate([[0], np.cumsum(keep)[:-1]])
    trans = np.where(block, model.transient_bytes[None, :], 0).max(axis=1)
    peaks = (model.constant_bytes + acc + block.astype(i64) @ model.block_bytes
             + _bits(a, n).astype(i64) @ model.above_bytes
             + _bits(b, n).astype(i64) @ model.beside_bytes + trans)
    nc = graph.node_cost.astype(np.float64)
    overhead = 0.0
    for row in block & ~u:  # block by block, nodes in order (the sum's rounding as before)
        overhead += float(sum(float(nc[v]) for v in np.flatnonzero(row)))
    ups = tuple(_masks_of_rows(_pack_rows(u, nw)))
    return StrategyCost(peak_bytes=int(peaks.max()), overhead=overhead,
                        block_peaks_bytes=tuple(int(p) for p in peaks), checkpoints=ups)


def entry_cost(graph: Graph, entry: np.ndarray, model: Optional["MemoryModel"] = None,
               edges: Optional[np.ndarray] = None) -> StrategyCost:
    """:func:`strategy_cost` of the chain given by each node's block: node
    ``v`` enters at ``L_{entry[v]}`` (blocks numbered from 0, each block
    non-empty, ``entry`` non-decreasing along every edge). Linear in the
    nodes, edges and blocks (:func:`strategy_cost` is nodes times blocks):
    ``v ∈ ∂(L_i)`` for ``entry[v] <= i < max entry of its successors``,
    ``v ∈ A_i`` for ``min entry of its predecessors <= i < entry[v]`` and
    ``u ∈ B_i`` for ``min over successors w of min entry of w's
    predecessors <= i < entry[u]``, each an interval of blocks. ``edges``:
    :meth:`Graph.edge_array`, made by the caller for several calls.

    >>> g = Graph.from_edges([1, 2, 1], [(0, 1), (1, 2)])
    >>> c = entry_cost(g, np.array([0, 0, 1]))
    >>> (c.peak_bytes, c.overhead) == (strategy_cost(g, [3, 7]).peak_bytes, 2.0)
    True
    """
    from .memory_model import MemoryModel
    if model is None:
        model = MemoryModel.paper(graph)
    ent = np.asarray(entry, dtype=np.int64)
    n = graph.n
    J = int(ent.max()) + 1
    ed = graph.edge_array() if edges is None else edges
    eu, ev = ed[:, 0], ed[:, 1]
    if len(ed) and (ent[ev] < ent[eu]).any():
        raise ValueError("entry must not decrease along an edge (the sets are not lower sets)")
    if np.any(np.bincount(ent, minlength=J) == 0):
        raise ValueError("lower sets must form a strictly increasing chain")
    i64 = np.int64
    ms = ent.copy()
    np.maximum.at(ms, eu, ent[ev])
    in_u = ms > ent
    if graph.must_keep:  # ∂ holds what every plan keeps (lower_sets.boundary)
        in_u[list(graph.must_keep)] = True
    keep = np.bincount(ent[in_u], weights=model.keep_bytes[in_u], minlength=J).astype(i64)
    acc = np.concatenate([[0], np.cumsum(keep)[:-1]])
    blk = np.bincount(ent, weights=model.block_bytes, minlength=J).astype(i64)

    def intervals(lo: np.ndarray, hi: np.ndarray, w: np.ndarray) -> np.ndarray:
        ok = lo < hi
        d = np.zeros(J + 1, dtype=i64)
        np.add.at(d, lo[ok], w[ok])
        np.add.at(d, hi[ok], -w[ok])
        return np.cumsum(d)[:J]

    mp = ent.copy()
    np.minimum.at(mp, ev, ent[eu])
    above = intervals(mp, ent, np.asarray(model.above_bytes, dtype=i64))
    mmw = ent.copy()
    np.minimum.at(mmw, eu, mp[ev])
    beside = intervals(mmw, ent, np.asarray(model.beside_bytes, dtype=i64))
    trans = np.zeros(J, dtype=i64)
    np.maximum.at(trans, ent, np.asarray(model.transient_bytes, dtype=i64))
    peaks = model.constant_bytes + acc + blk + above + beside + trans
    nc = graph.node_cost.astype(np.float64)
    dropped = np.flatnonzero(~in_u)
    per_block = np.zeros(J, dtype=np.float64)
    for b, v in zip(ent[dropped].tolist(), dropped.tolist()):
        per_block[b] += float(nc[v])
    overhead = 0.0
    for x in per_block.tolist():
        overhead += x
    ups = [0] * J
    for v in np.flatnonzero(in_u).tolist():
        ups[int(ent[v])] |= 1 << v
    return StrategyCost(peak_bytes=int(peaks.max()), overhead=overhead,
                        block_peaks_bytes=tuple(int(p) for p in peaks), checkpoints=tuple(ups))


def _pack_rows(bits: np.ndarray, nw: int) -> np.ndarray:
    from .lower_sets import _pack
    return _pack(bits, nw)


#: The paper's name for :func:`strategy_cost` (its default model is the paper's).
paper_cost = strategy_cost


def paper_peak_bytes(graph: Graph, lower_sets: Sequence,
                     model: Optional["MemoryModel"] = None) -> int:
    """The peak memory of a strategy under ``model`` (the paper's by
    default; see :func:`strategy_cost`).

    >>> g = Graph.from_edges([1, 2, 1], [(0, 1), (1, 2)])
    >>> paper_peak_bytes(g, [{0, 1, 2}])
    8
    """
    return strategy_cost(graph, lower_sets, model).peak_bytes


def build_schedule(graph: Graph, lower_sets: Sequence, *,
                   recompute: bool = True) -> Schedule:
    """The canonical schedule of a strategy, with liveness frees.

    Args:
        graph: the graph.
        lower_sets: L_1 ⊊ ... ⊊ L_k = V (bitsets or sets).
        recompute: when False nothing is dropped or recomputed (vanilla
            backpropagation; only meaningful with ``k = 1``).

    >>> g = Graph.from_edges([1, 1], [(0, 1)])
    >>> build_schedule(g, [{0, 1}], recompute=False).ops[:2]
    (('forward', 0), ('forward', 1))
    """
    masks = _masks(lower_sets)
    n = graph.n
    preds, succs = graph.preds, graph.succs
    block_of = [-1] * n
    prev = 0
    blocks: List[List[int]] = []
    keep = [False] * n
    nested = True
    for i, cur in enumerate(masks):
        nested = nested and prev & ~cur == 0
        nodes = sorted(mask_to_set(cur & ~prev))
        blocks.append(nodes)
        for v in nodes:
            block_of[v] = i
        prev = cur
    if nested:
        # U_i = ∂(L_i) ∩ V_i: a node of V_i with a successor outside L_i,
        # that is in a later block or in none (linear, where the bitsets'
        # boundary is nodes times blocks)
        for i, nodes in enumerate(blocks):
            for v in nodes:
                if any(block_of[s] > i or block_of[s] < 0 for s in succs[v]):
                    keep[v] = True
        for v in graph.must_keep:  # kept by every plan (lower_sets.boundary)
            if block_of[v] >= 0:
                keep[v] = True
    else:  # not a chain: from the bitsets
        prev = 0
        for cur in masks:
            for v in mask_to_set(boundary(graph, cur) & (cur & ~prev)):
                keep[v] = True
            prev = cur
    if not recompute:
        keep = [True] * n
    ops: List[Op] = []
    # Forward: drop V_i \ U_i after its last forward reader in the block.
    for nodes in blocks:
        pending = {}
        for v in nodes:
            ops.append((FORWARD, v))
            for p in preds[v]:
                if not keep[p] and p in pending:
                    pending[p] -= 1
                    if pending[p] == 0:
                        ops.append((FREE, p))
                        del pending[p]
            if not keep[v]:
                if succs[v]:
                    pending[v] = len(succs[v])
                else:
                    ops.append((FREE, v))
        assert not pending
    # Backward readers of each forward value: its own backward step and the
    # backward steps of its successors; plus recompute readers.
    readers = [1 + len(succs[v]) for v in range(n)]
    grad_alloc = [False] * n
    for i in range(len(blocks) - 1, -1, -1):
        nodes = blocks[i]
        for v in nodes:
            if not keep[v]:
                ops.append((RECOMPUTE, v))
        for w in reversed(nodes):
            if not grad_alloc[w]:
                grad_alloc[w] = True  # seed (a sink) or all successors' grads were zero
            ops.append((BACKWARD, w))
            for p in preds[w]:
                grad_alloc[p] = True
            ops.append((FREE_GRAD, w))
            for x in preds[w] + (w,):
                readers[x] -= 1
                if readers[x] == 0:
                    ops.append((FREE, x))
    return Schedule(ops=tuple(ops), n_blocks=len(blocks))


def simulate(graph: Graph, schedule: Schedule) -> SimResult:
    """Replay ``schedule`` and measure memory of intermediates over time.

    A ``backward`` op of ``w`` allocates the gradients of ``w``'s
    predecessors that are not allocated yet (and ``w``'s own, as a seed,
    when it is a sink); the memory is recorded after each op.

    >>> g = Graph.from_edges([1, 1], [(0, 1)])
    >>> simulate(g, build_schedule(g, [{0, 1}], recompute=False)).peak_bytes
    4
    """
    nb = [int(x) for x in graph.node_bytes]
    nc = graph.node_cost
    preds = graph.preds
    fwd = [False] * graph.n
    grad = [False] * graph.n
    mem = 0
    trace = np.zeros(len(schedule.ops), dtype=np.int64)
    rec_cost = 0.0
    for k, (kind, v) in enumerate(schedule.ops):
        if kind == FORWARD or kind == RECOMPUTE:
            if kind == RECOMPUTE:
                rec_cost += float(nc[v])
            if fwd[v]:
                raise ValueError(f"op {k}: node {v} computed while already held")
            for p in preds[v]:
                if not fwd[p]:
                    raise ValueError(f"op {k}: node {v} computed but its input {p} is not held")
            fwd[v] = True
            mem += nb[v]
        elif kind == FREE:
            if not fwd[v]:
                raise ValueError(f"op {k}: freeing node {v}, which is not held")
            fwd[v] = False
            mem -= nb[v]
        elif kind == BACKWARD:
            for x in preds[v] + (v,):
                if not fwd[x]:
                    raise ValueError(f"op {k}: backward of {v} needs the value of {x}")
            if not grad[v]:
                grad[v] = True
                mem += nb[v]
            for p in preds[v]:
                if not grad[p]:
                    grad[p] = True
                    mem += nb[p]
        elif kind == FREE_GRAD:
            grad[v] = False
            mem -= nb[v]
        else:
            raise ValueError(f"unknown op kind {kind!r}")
        trace[k] = mem
    peak_step = int(np.argmax(trace)) if len(trace) else 0
    return SimResult(peak_bytes=int(trace.max()) if len(trace) else 0, peak_step=peak_step,
                     memory_bytes=trace, recompute_cost=rec_cost)
