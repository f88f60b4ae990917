"""Lower sets of a computational graph (docs/paper.md §2).

Pure core: numpy only.

A *lower set* ``L`` is closed under predecessors: no edge enters ``L`` from
outside. Sets of nodes are Python ints used as bitsets (bit ``v`` set when
node ``v`` is in the set); :func:`mask_to_set` and :func:`set_to_mask`
convert to and from ``frozenset[int]``. For the dynamic programs the
family is also held as a matrix of ``uint64`` words, one row per set
(:class:`LowerSetFamily`), so that subset tests and set sizes are
vectorised.

Enumeration grows the family node by node in topological order: after
node ``v`` the family holds exactly the lower sets of the subgraph on
``0..v``, and each of those is a lower set of the whole graph, so the
count never goes down and an explosion is detected as soon as it happens.
"""
from __future__ import annotations

import logging
import weakref
import dataclasses
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .errors import LowerSetExplosionError
from .graph import Graph

if TYPE_CHECKING:  # pragma: no cover
    from .memory_model import MemoryModel

logger = logging.getLogger(__name__)

DEFAULT_MAX_LOWER_SETS = 2_000_000
"""Default cap on the family size; 2M sets of 1,000 nodes take ~250 MB."""

__all__ = [
    "DEFAULT_MAX_LOWER_SETS", "LowerSetFamily", "above", "ancestor_closures",
    "beside", "boundary", "count_lower_sets", "enumerate_lower_sets",
    "is_lower_set", "mask_bits", "mask_to_set", "set_to_mask", "full_mask", "with_forward_only",
]


# ------------------------------------------------------------ bitset helpers
#: sets of this many nodes or more are made bitsets through numpy (one
#: pass; OR-ing each bit into a Python int copies it every time)
_BULK_MASK = 256


def set_to_mask(nodes: Iterable[int]) -> int:
    """The bitset of ``nodes``.

    >>> set_to_mask([0, 2])
    5
    >>> set_to_mask(range(0, 600, 3)) == sum(1 << v for v in range(0, 600, 3))
    True
    """
    if isinstance(nodes, Sized) and len(nodes) >= _BULK_MASK:
        ids = np.fromiter(nodes, dtype=np.int64, count=len(nodes))
        if ids.min() >= 0:
            bits = np.zeros(int(ids.max()) + 1, dtype=np.bool_)
            bits[ids] = True
            return int.from_bytes(np.packbits(bits, bitorder="little").tobytes(), "little")
    m = 0
    for v in nodes:
        m |= 1 << int(v)
    return m


def mask_bits(mask: int) -> List[int]:
    """The nodes of bitset ``mask``, increasing (in one numpy pass).

    >>> mask_bits(5)
    [0, 2]
    """
    if mask < 0:
        raise ValueError("a bitset is a non-negative int")
    raw = np.frombuffer(mask.to_bytes(max(1, (mask.bit_length() + 7) // 8), "little"),
                        dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()


def mask_to_set(mask: int) -> FrozenSet[int]:
    """The nodes of bitset ``mask`` as a frozenset.

    >>> sorted(mask_to_set(5))
    [0, 2]
    """
    return frozenset(mask_bits(mask))


def full_mask(graph: Graph) -> int:
    """The bitset of V.

    >>> full_mask(Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)]))
    7
    """
    return (1 << graph.n) - 1


def ancestor_masks(graph: Graph) -> List[int]:
    """The ancestor closure of each node (the node and every node it
    depends on) as a bitset.

    >>> ancestor_masks(Graph.from_edges([1, 1, 1], [(0, 2), (1, 2)]))
    [1, 2, 7]
    """
    anc: List[int] = []
    for v in range(graph.n):
        m = 1 << v
        for p in graph.preds[v]:
            m |= anc[p]
        anc.append(m)
    return anc


_MASKS: "weakref.WeakKeyDictionary[Graph, Tuple[List[int], List[int]]]" = \
    weakref.WeakKeyDictionary()


def _masks_of(graph: Graph) -> Tuple[List[int], List[int]]:
    got = _MASKS.get(graph)
    if got is None:
        got = _MASKS[graph] = ([set_to_mask(ps) for ps in graph.preds],
                               [set_to_mask(ss) for ss in graph.succs])
    return got


def _pred_masks(graph: Graph) -> List[int]:
    return _masks_of(graph)[0]


def _adjacency_words(graph: Graph) -> Tuple[np.ndarray, np.ndarray]:
    """The predecessors and the successors of each node as ``(n, W)``
    uint64 words, from the graph's cached bitsets. Not cached with the graph
    (arrays kept alive with it would count in the array bytes a runtime
    meter sees): a family keeps its own (:meth:`LowerSetFamily.adjacency`)."""
    nw = _n_words(graph.n)
    pm, sm = _masks_of(graph)
    return _rows_of_masks(pm, nw), _rows_of_masks(sm, nw)


#: The compiled kernels' module (:mod:`.kernels.dp`) once the DP's
#: compiled engine has loaded it in this process (it sets this), else
#: ``None``; the family's arrays are then built by the kernels (the same
#: arrays as the NumPy code's).
_KERNELS = None


def _kernels():
    return _KERNELS


def _succ_masks(graph: Graph) -> List[int]:
    return _masks_of(graph)[1]


def _as_mask(s) -> int:
    return s if isinstance(s, int) else set_to_mask(s)


def is_lower_set(graph: Graph, nodes) -> bool:
    """Whether ``nodes`` (bitset or iterable) is closed under predecessors.

    >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)])
    >>> is_lower_set(g, {0, 1}), is_lower_set(g, {1})
    (True, False)
    """
    m = _as_mask(nodes)
    for v, pm in enumerate(_pred_masks(graph)):
        if (m >> v) & 1 and pm & ~m:
            return False
    return True


def boundary(graph: Graph, nodes) -> int:
    """∂(L): the nodes of ``L`` with a successor outside ``L`` (bitset),
    and those of ``L`` every plan must keep (:attr:`Graph.must_keep`: the
    solvers' ∂ is ``∂(L) ∪ (K ∩ L)``, so that such a node is a checkpoint
    of whichever block holds it).

    >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (1, 2), (0, 2)])
    >>> sorted(mask_to_set(boundary(g, {0, 1})))
    [0, 1]
    >>> from chainer_recompute.core.keep import with_must_keep
    >>> sorted(mask_to_set(boundary(with_must_keep(g, [2]), {0, 1, 2})))
    [2]
    """
    m = _as_mask(nodes)
    out = m & set_to_mask(graph.must_keep)
    for v, sm in enumerate(_succ_masks(graph)):
        if (m >> v) & 1 and sm & ~m:
            out |= 1 << v
    return out


def above(graph: Graph, nodes) -> int:
    """A(L) = δ+(L) \\ L: successors of ``L`` outside it (bitset); their
    gradients arrive from above when the block below is backpropagated.

    >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)])
    >>> sorted(mask_to_set(above(g, {0})))
    [1]
    """
    m = _as_mask(nodes)
    out = 0
    for v, pm in enumerate(_pred_masks(graph)):
        if not (m >> v) & 1 and pm & m:
            out |= 1 << v
    return out


def beside(graph: Graph, nodes) -> int:
    """B(L) = δ-(A(L)) \\ L: the other forward inputs of the nodes of A(L)
    (bitset).

    >>> g = Graph.from_edges([1, 1, 1, 1], [(0, 2), (1, 2), (2, 3)])
    >>> sorted(mask_to_set(beside(g, {0})))
    [1]
    """
    m = _as_mask(nodes)
    a = above(graph, m)
    out = 0
    for v, sm in enumerate(_succ_masks(graph)):
        if not (m >> v) & 1 and sm & a:
            out |= 1 << v
    return out


# --------------------------------------------------------------- enumeration
def _n_words(n: int) -> int:
    return max(1, (n + 63) // 64)


def _rows_of_masks(masks: Sequence[int], n_words: int) -> np.ndarray:
    """Bitsets as the rows of a ``(len(masks), n_words)`` uint64 matrix
    (inverse of :func:`_masks_of_rows`).

    >>> _rows_of_masks([5, 1 << 64], 2).tolist()
    [[5, 0], [0, 1]]
    """
    raw = b"".join([m.to_bytes(8 * n_words, "little") for m in masks])
    return np.frombuffer(raw, dtype="<u8").astype(np.uint64).reshape(len(masks), n_words)


def _masks_of_rows(words: np.ndarray) -> List[int]:
    """Each row of ``(k, W)`` words as a bitset (one conversion to bytes
    for all rows).

    >>> _masks_of_rows(np.array([[5, 0], [0, 1]], dtype=np.uint64)) == [5, 1 << 64]
    True
    """
    step = 8 * words.shape[1]
    raw = np.ascontiguousarray(words, dtype="<u8").tobytes()
    return [int.from_bytes(raw[i:i + step], "little") for i in range(0, len(raw), step)]


def _enumerate_words(graph: Graph, max_lower_sets: Optional[int],
                     adjacency: Optional[Tuple[np.ndarray, np.ndarray]] = None) -> np.ndarray:
    n = graph.n
    nw = _n_words(n)
    pw, _ = _adjacency_words(graph) if adjacency is None else adjacency
    kn = _kernels()
    if kn is not None:
        states, v = kn.enum_lower_sets(pw, -1 if max_lower_sets is None else max_lower_sets)
        if v >= 0:
            _explosion(max_lower_sets, len(states), v, n)
        return states
    buf = np.zeros((64, nw), dtype=np.uint64)
    K = 1
    for v in range(n):
        states = buf[:K]
        ok = None
        for w in np.flatnonzero(pw[v]).tolist():
            hit = (states[:, w] & pw[v, w]) == pw[v, w]
            ok = hit if ok is None else ok & hit
        grown = states if ok is None else states[ok]
        m = len(grown)
        if K + m > len(buf):
            bigger = np.zeros((2 * (K + m), nw), dtype=np.uint64)
            bigger[:K] = buf[:K]
            grown = bigger[:K] if ok is None else grown
            buf = bigger
        buf[K:K + m] = grown
        buf[K:K + m, v >> 6] |= np.uint64(1 << (v & 63))
        K += m
        if max_lower_sets is not None and K > max_lower_sets:
            _explosion(max_lower_sets, K, v, n)
    return buf[:K].copy()


def _explosion(limit: int, count: int, v: int, n: int) -> None:
    raise LowerSetExplosionError(
        f"the graph has more than {limit:,} lower sets (already "
        f"{count:,} among its first {v + 1} of {n} nodes): too many for the "
        f"exact solver; use solver='approx' (|V|+2 lower sets) or raise "
        f"max_lower_sets")


def count_lower_sets(graph: Graph, limit: Optional[int] = None) -> int:
    """Number of lower sets of ``graph``, counting ∅ and V.

    Raises:
        LowerSetExplosionError: when the count exceeds ``limit``.

    >>> count_lower_sets(Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)]))
    4
    """
    return int(len(_enumerate_words(graph, limit)))


def enumerate_lower_sets(graph: Graph,
                         max_lower_sets: Optional[int] = DEFAULT_MAX_LOWER_SETS) -> List[int]:
    """Every lower set of ``graph`` as a bitset, ∅ and V included, sorted
    by size then memory M(L) (so every subset precedes its supersets).

    Raises:
        LowerSetExplosionError: more than ``max_lower_sets`` sets.

    >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (0, 2)])
    >>> [sorted(mask_to_set(m)) for m in enumerate_lower_sets(g)]
    [[], [0], [0, 1], [0, 2], [0, 1, 2]]
    """
    return LowerSetFamily.all(graph, max_lower_sets=max_lower_sets).masks()


def with_forward_only(graph: Graph, masks: Sequence[int]) -> List[int]:
    """Each lower set of ``masks`` with the nodes no backward needs
    (:attr:`~chainer_recompute.core.graph.Graph.forward_only`) whose inputs
    it holds taken in; a set that takes in none is left out.

    >>> g = Graph.from_edges([4, 4, 4], [(0, 1), (0, 2)])
    >>> g.backward_order = (1, 0)
    >>> with_forward_only(g, [0b001, 0b011])
    [5, 7]
    """
    out = []
    dead = graph.forward_only
    if not dead:
        return out
    pm = _pred_masks(graph)
    for m in masks:
        c = m
        for d in dead:  # (topological: one that reads another comes after it)
            if not (c >> d) & 1 and (pm[d] & c) == pm[d]:
                c |= 1 << d
        if c != m:
            out.append(c)
    return out


def ancestor_closures(graph: Graph) -> List[int]:
    """The approximate DP's family (docs/paper.md §5): ∅, V and, for each node
    v, L_v = {v} ∪ ancestors(v), without duplicates, as bitsets sorted by
    size then memory; on a graph with nodes no backward needs (a metric
    beside the loss), also each L_v with those of them whose inputs it
    holds (:func:`with_forward_only`).

    >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (0, 2)])
    >>> [sorted(mask_to_set(m)) for m in ancestor_closures(g)]
    [[], [0], [0, 1], [0, 2], [0, 1, 2]]
    """
    return LowerSetFamily.ancestor_closures(graph).masks()


# ----------------------------------------------------------------- family
def _popcount_rows(words: np.ndarray) -> np.ndarray:
    b = np.unpackbits(words.view(np.uint8), axis=1)
    return b.sum(axis=1, dtype=np.int64)


def _bits(words: np.ndarray, n: int) -> np.ndarray:
    """Rows of words as a ``(K, n)`` uint8 0/1 matrix."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=1,
                         bitorder="little")[:, :n]


def _pack(bits: np.ndarray, n_words: int) -> np.ndarray:
    """Inverse of :func:`_bits`."""
    packed = np.packbits(bits.astype(np.uint8, copy=False), axis=1, bitorder="little")
    out = np.zeros((len(bits), 8 * n_words), dtype=np.uint8)
    out[:, :packed.shape[1]] = packed
    return out.view("<u8").astype(np.uint64)


def _weighted_sum(words: np.ndarray, weights: np.ndarray, n: int,
                  chunk: int = 1 << 15) -> np.ndarray:
    """Σ weights[v] over the bits of each row of ``words``."""
    if weights.dtype == np.int64 and len(words):
        kn = _kernels()
        if kn is not None:
            return kn.wsum(np.ascontiguousarray(words), weights)
    out = np.zeros(len(words), dtype=weights.dtype)
    for s in range(0, len(words), chunk):
        bits = _bits(words[s:s + chunk], n)
        out[s:s + chunk] = bits @ weights if len(bits) else 0
    return out


def _group_any(x: np.ndarray, keys: np.ndarray, n: int) -> np.ndarray:
    """``out[:, v]`` = any of the columns ``e`` of ``x`` with ``keys[e] == v``."""
    out = np.zeros((x.shape[0], n), dtype=bool)
    if x.shape[1] == 0 or x.shape[0] == 0:
        return out
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    out[:, k[starts]] = np.logical_or.reduceat(x[:, order], starts, axis=1)
    return out


def _derived_words(graph: Graph, words: np.ndarray, chunk: int = 1 << 14,
                   adjacency: Optional[Tuple[np.ndarray, np.ndarray]] = None):
    """∂(L), A(L) and B(L) of every row, as words (vectorised over edges);
    ∂(L) holds the nodes of ``L`` every plan keeps (see :func:`boundary`)."""
    bnd, a, b = _structural_words(graph, words, chunk, adjacency)
    if graph.must_keep:
        bnd |= words & _rows_of_masks([set_to_mask(graph.must_keep)], words.shape[1])
    return bnd, a, b


def _structural_words(graph: Graph, words: np.ndarray, chunk: int,
                      adjacency: Optional[Tuple[np.ndarray, np.ndarray]]):
    kn = _kernels()
    if kn is not None:
        pw, sw = _adjacency_words(graph) if adjacency is None else adjacency
        return kn.derive(np.ascontiguousarray(words), sw, pw)
    n = graph.n
    nw = words.shape[1]
    edges = graph.edge_array()
    eu, ev = edges[:, 0], edges[:, 1]
    bnd = np.zeros_like(words)
    a = np.zeros_like(words)
    b = np.zeros_like(words)
    for s in range(0, len(words), chunk):
        x = _bits(words[s:s + chunk], n).astype(bool)
        cross = x[:, eu] & ~x[:, ev]          # u in L, v outside
        bnd[s:s + chunk] = _pack(_group_any(cross, eu, n), nw)
        am = _group_any(cross, ev, n)
        a[s:s + chunk] = _pack(am, nw)
        into_a = ~x[:, eu] & am[:, ev]        # u outside L feeding a node of A
        b[s:s + chunk] = _pack(_group_any(into_a, eu, n), nw)
    return bnd, a, b


@dataclass
class LowerSetFamily:
    """A family of lower sets with the quantities the DPs need.

    Rows are sorted by (size, M(L)), so that a subset always comes before
    its supersets. All arrays are indexed by row. Byte quantities follow
    the family's memory model (:class:`~.memory_model.MemoryModel`, the
    paper's by default): for the paper's model ``block_bytes`` is 2·M(L),
    ``boundary_bytes`` is M(∂(L)) and ``back_bytes`` is M(A(L)) + M(B(L)).

    Attributes:
        graph: the graph.
        words: ``(K, W)`` uint64, the sets as bitset words.
        size: ``|L|``.
        mem_bytes: M(L) (node sizes, whatever the model).
        boundary_words: ∂(L) as words.
        boundary_time: T(∂(L)).
        boundary_bytes: keep(∂(L)) under the model.
        back_bytes: above(A(L)) + beside(B(L)) under the model (overlap
            counted twice, as the authors do).
        above_words: A(L) as words.
        beside_words: B(L) as words.
        block_bytes: block(L) under the model (Σ of block weights over L).
        model: the memory model.
    """

    graph: Graph
    words: np.ndarray
    size: np.ndarray
    mem_bytes: np.ndarray
    boundary_words: np.ndarray
    boundary_time: np.ndarray
    boundary_bytes: np.ndarray
    back_bytes: np.ndarray
    above_words: Optional[np.ndarray] = None
    beside_words: Optional[np.ndarray] = None
    block_bytes: Optional[np.ndarray] = None
    model: Optional["MemoryModel"] = None
    #: derived arrays that solvers keep between calls (per model)
    cache: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.words)

    @classmethod
    def from_words(cls, graph: Graph, words: np.ndarray,
                   model: Optional["MemoryModel"] = None,
                   adjacency: Optional[Tuple[np.ndarray, np.ndarray]] = None
                   ) -> "LowerSetFamily":
        """Builds the family from raw rows (deduplicated and sorted here);
        ``adjacency``: the graph's :meth:`adjacency` where the caller has
        it."""
        n = graph.n
        if adjacency is None:
            adjacency = _adjacency_words(graph)
        nw = _n_words(n)
        words = np.ascontiguousarray(words, dtype=np.uint64).reshape(-1, nw)
        mem = _weighted_sum(words, graph.node_bytes.astype(np.int64), n)
        kn = _kernels()
        size = _popcount_rows(words) if kn is None else kn.wsum(words, np.ones(n, np.int64))
        # By size, then M(L), then the words (as np.unique orders rows);
        # duplicates end up next to each other.
        order = np.lexsort(tuple(words[:, q] for q in range(nw - 1, -1, -1)) + (mem, size))
        words = words[order]
        dup = np.zeros(len(words), dtype=bool)
        if len(words) > 1:
            dup[1:] = np.all(words[1:] == words[:-1], axis=1)
        if dup.any():
            order, words = order[~dup], words[~dup]
        words = np.ascontiguousarray(words)
        mem, size = mem[order], size[order]
        bnd, a, b = _derived_words(graph, words, adjacency=adjacency)
        nc = graph.node_cost
        if kn is not None and graph.integral_costs:
            btime = kn.wsum(bnd, nc.astype(np.int64)).astype(np.float64)  # exact
        else:
            btime = _weighted_sum(bnd, nc.astype(np.float64), n)
        fam = cls(graph=graph, words=words, size=size, mem_bytes=mem, boundary_words=bnd,
                  boundary_time=btime, boundary_bytes=mem, back_bytes=mem, above_words=a,
                  beside_words=b)
        fam.cache["adjacency"] = adjacency
        return fam.with_model(model)

    def with_model(self, model: Optional["MemoryModel"]) -> "LowerSetFamily":
        """The same lower sets with byte quantities under ``model`` (``None``:
        the paper's model)."""
        from .memory_model import MemoryModel
        g = self.graph
        if model is None:
            model = MemoryModel.paper(g)
        if model.n != g.n:
            raise ValueError(f"the memory model has {model.n} nodes, the graph {g.n}")
        if self.model is model:
            return self
        n = g.n
        fam = LowerSetFamily(
            graph=g, words=self.words, size=self.size, mem_bytes=self.mem_bytes,
            boundary_words=self.boundary_words, boundary_time=self.boundary_time,
            boundary_bytes=_weighted_sum(self.boundary_words, model.keep_bytes, n),
            back_bytes=(_weighted_sum(self.above_words, model.above_bytes, n)
                        + _weighted_sum(self.beside_words, model.beside_bytes, n)),
            above_words=self.above_words, beside_words=self.beside_words,
            block_bytes=_weighted_sum(self.words, model.block_bytes, n), model=model)
        if "adjacency" in self.cache:  # the graph's, whatever the model
            fam.cache["adjacency"] = self.cache["adjacency"]
        return fam

    def with_costs(self, graph: Graph) -> "LowerSetFamily":
        """The same lower sets (and memory model) on ``graph``: this
        family's graph with other node costs (e.g. its
        :meth:`~Graph.without_times`); only T(∂(L)) is computed again.

        Raises:
            ValueError: ``graph`` has other nodes, wiring or sizes.

        >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)], costs=[0.5, 2.0, 1.0])
        >>> fam = LowerSetFamily.ancestor_closures(g)
        >>> fam.boundary_time.tolist(), fam.with_costs(g.without_times()).boundary_time.tolist()
        ([0.0, 0.5, 2.0, 0.0], [0.0, 1.0, 2.0, 0.0])
        """
        g = self.graph
        if graph is g:
            return self
        if (graph.n != g.n or graph.preds != g.preds
                or not np.array_equal(graph.node_bytes, g.node_bytes)):
            raise ValueError("with_costs takes the same graph with other costs; this one has "
                             "other nodes, wiring or sizes")
        nc = graph.node_cost
        kn = _kernels()
        if kn is not None and graph.integral_costs:
            btime = kn.wsum(self.boundary_words, nc.astype(np.int64)).astype(np.float64)
        else:
            btime = _weighted_sum(self.boundary_words, nc.astype(np.float64), graph.n)
        fam = dataclasses.replace(self, graph=graph, boundary_time=btime, cache={})
        if "adjacency" in self.cache:  # the wiring's, whatever the costs
            fam.cache["adjacency"] = self.cache["adjacency"]
        return fam

    def adjacency(self) -> Tuple[np.ndarray, np.ndarray]:
        """The graph's predecessor and successor words (``(n, W)`` uint64),
        made once per family."""
        adj = self.cache.get("adjacency")
        if adj is None:
            adj = self.cache["adjacency"] = _adjacency_words(self.graph)
        return adj

    @classmethod
    def all(cls, graph: Graph, max_lower_sets: Optional[int] = DEFAULT_MAX_LOWER_SETS,
            model: Optional["MemoryModel"] = None) -> "LowerSetFamily":
        """Every lower set (see :func:`enumerate_lower_sets`)."""
        adj = _adjacency_words(graph)
        return cls.from_words(graph, _enumerate_words(graph, max_lower_sets, adj), model, adj)

    @classmethod
    def ancestor_closures(cls, graph: Graph,
                          model: Optional["MemoryModel"] = None) -> "LowerSetFamily":
        """∅, V and the ancestor closure of each node, and each of those
        with the nodes no backward needs whose inputs it holds
        (:func:`with_forward_only`): without them, a per-step metric
        (``F.accuracy`` of an unrolled RNN's outputs) read after every later
        closure makes the outputs it reads boundaries of every chain, kept
        through the forward (Chainer's PTB LSTM at t = 30: single-level
        least 432,264 -> 396,800 B, nested 345,196 -> 279,296 B)."""
        nw = _n_words(graph.n)
        anc = ancestor_masks(graph)
        masks = [0, full_mask(graph)] + anc + with_forward_only(graph, anc)
        words = _rows_of_masks(masks, nw)
        return cls.from_words(graph, words, model)

    @classmethod
    def of_masks(cls, graph: Graph, masks: Sequence[int],
                 model: Optional["MemoryModel"] = None) -> "LowerSetFamily":
        """A family of given lower sets (∅ and V are added)."""
        nw = _n_words(graph.n)
        masks = [0, full_mask(graph)] + [int(m) for m in masks]
        return cls.from_words(graph, _rows_of_masks(masks, nw), model)

    def mask(self, i: int) -> int:
        """Row ``i`` as a bitset."""
        return self.masks([i])[0]

    def masks(self, rows: Optional[Sequence[int]] = None) -> List[int]:
        """The rows ``rows`` (default: every row) as bitsets."""
        words = self.words if rows is None else self.words[np.asarray(rows, dtype=np.intp)]
        return _masks_of_rows(words)

    def sets(self) -> List[FrozenSet[int]]:
        """Every row as a frozenset of node ids."""
        return [mask_to_set(m) for m in self.masks()]
