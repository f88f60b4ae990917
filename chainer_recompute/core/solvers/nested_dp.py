"""The exact dynamic programs over nested plans, under the per-block
memory model (docs/algorithm.md §9), for small graphs: over two-level plans
(:func:`solve_nested_exact`, below), and over plans of any depth
(:func:`exact_trees`, the tree DP over every chain of lower sets at once,
at the end of the module).

Pure core: numpy only.

A nested plan is a fine chain ∅ = L_0 ⊊ L_1 ⊊ ... ⊊ L_k = V with
checkpoints U_i = ∂(L_i) ∩ V_i, and an outer chain, a sub-chain of it that
ends at V, with outer blocks W_j and outer checkpoints Ū_j = ∂(L_{e_j}) ∩ W_j.
Under a :class:`~chainer_recompute.core.memory_model.MemoryModel` its
memory at fine block i of outer block j is

    M^(i) = constant + Σ_{j' < j} keep(Ū_{j'}) + Σ_{i' < i, V_i' ⊆ W_j} keep(U_i')
            + block(V_i) + above(A(L_i)) + beside(B(L_i)) + max_{v ∈ V_i} transient_v

(the single-level formula, :func:`~chainer_recompute.core.schedule.strategy_cost`,
with the checkpoints of the earlier outer blocks reduced to their outer
ones), and its recomputation

    T = Σ_j T(W_j \\ Ū_j) + Σ_{i not last in its outer block} T(V_i \\ U_i).

With one fine block per outer block both are the single-level ones.

The DP walks pairs (S, L) of lower sets, S ⊆ L: the current outer block
starts at S and its fine chain has reached L. Each state keeps the Pareto
front of (recomputation so far, Σ keep(Ū) of the closed outer blocks,
Σ keep(U) of the open one's fine blocks). A step L -> L' adds the fine
block L' \\ L when its memory fits the budget, and either leaves the outer
block open or closes it at L'. The exact family (every lower set) makes it
exact: :func:`nested_cost` and a brute force over every chain and grouping
agree with it (tests/test_nested_dp.py). The states are pairs of lower
sets, so it is for small graphs (:data:`MAX_LOWER_SETS`);
:class:`~chainer_recompute.core.nested.NestedSearch` adds its plans to its
candidates there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import LowerSetExplosionError
from ..graph import Graph
from ..lower_sets import (above, beside, boundary, count_lower_sets, enumerate_lower_sets,
                          mask_to_set)
from ..memory_model import MemoryModel

__all__ = ["MAX_LOWER_SETS", "NestedChain", "NestedTree", "exact_trees", "least_nested_budget",
           "nested_cost", "small_enough", "solve_nested_exact", "tree_nested_cost"]

#: Above this many lower sets the exact nested DP is not run (its states are
#: pairs of lower sets).
MAX_LOWER_SETS = 16


@dataclass(frozen=True)
class NestedChain:
    """A nested plan as the DP gives it: the fine chain (bitsets, the last
    V), the indexes of the fine blocks that end an outer block (the last
    block's last), its memory and its recomputation under the model."""

    masks: Tuple[int, ...]
    ends: Tuple[int, ...]
    peak_bytes: int
    overhead: float


class _Weights:
    """Sums of the model's weights and the graph's costs over bitsets."""

    def __init__(self, graph: Graph, model: MemoryModel) -> None:
        self.graph, self.model = graph, model
        self.cost = [float(c) for c in graph.node_cost]
        self.keep = [int(x) for x in model.keep_bytes]
        self.block = [int(x) for x in model.block_bytes]
        self.above = [int(x) for x in model.above_bytes]
        self.beside = [int(x) for x in model.beside_bytes]
        self.trans = [int(x) for x in model.transient_bytes]
        self._derived: Dict[int, Tuple[int, int, int]] = {}

    def sum(self, w: Sequence, mask: int) -> float:
        return sum(w[v] for v in mask_to_set(mask))

    def derived(self, L: int) -> Tuple[int, int, int]:
        """∂(L), A(L), B(L)."""
        got = self._derived.get(L)
        if got is None:
            got = self._derived[L] = (boundary(self.graph, L), above(self.graph, L),
                                      beside(self.graph, L))
        return got

    def block_memory(self, L: int, L2: int) -> int:
        """What the fine block ``L2 \\ L`` adds on top of the checkpoints."""
        V = L2 & ~L
        _, a, b = self.derived(L2)
        return int(self.sum(self.block, V) + self.sum(self.above, a)
                   + self.sum(self.beside, b) + max((self.trans[v] for v in mask_to_set(V)),
                                                   default=0))


def nested_cost(graph: Graph, masks: Sequence[int], ends: Sequence[int],
                model: Optional[MemoryModel] = None) -> Tuple[int, float]:
    """The memory and recomputation of a nested plan under ``model`` (the
    paper's by default): the formulas of the module docstring, written
    out block by block.

    >>> g = Graph.from_edges([1, 1, 1, 1], [(0, 1), (1, 2), (2, 3)])
    >>> nested_cost(g, [1, 3, 7, 15], [1, 3])   # two outer blocks of two fine ones
    (4, 3.0)
    >>> nested_cost(g, [1, 3, 7, 15], [0, 1, 2, 3])   # the single-level plan
    (5, 1.0)
    """
    model = MemoryModel.paper(graph) if model is None else model
    w = _Weights(graph, model)
    ends = list(ends)
    peak, overhead = 0, 0.0
    outer_kept = 0
    start, prev, inner = 0, 0, 0
    for i, L in enumerate(masks):
        V = L & ~prev
        peak = max(peak, model.constant_bytes + outer_kept + inner + w.block_memory(prev, L))
        U = w.derived(L)[0] & V
        if i in ends:
            W = L & ~start
            ubar = w.derived(L)[0] & W
            outer_kept += int(w.sum(w.keep, ubar))
            overhead += w.sum(w.cost, W & ~ubar)
            start, inner = L, 0
        else:
            inner += int(w.sum(w.keep, U))
            overhead += w.sum(w.cost, V & ~U)
        prev = L
    return int(peak), overhead


def _fronts_insert(front: List[Tuple[float, int, int, object]],
                   item: Tuple[float, int, int, object]) -> None:
    """Keep ``front`` the non-dominated (overhead, outer, inner) triples."""
    t, mo, mi, _ = item
    for f in front:
        if f[0] <= t and f[1] <= mo and f[2] <= mi:
            return
    front[:] = [f for f in front if not (t <= f[0] and mo <= f[1] and mi <= f[2])]
    front.append(item)


def solve_nested_exact(graph: Graph, budget_bytes: int, model: Optional[MemoryModel] = None,
                       lower_sets: Optional[List[int]] = None) -> Optional[NestedChain]:
    """The nested plan of least recomputation whose memory under ``model``
    (the paper's by default) is at most ``budget_bytes``; ``None`` when
    none is. ``lower_sets``: the family (bitsets; default every lower set
    of ``graph``).

    >>> g = Graph.from_edges([1, 1, 1, 1], [(0, 1), (1, 2), (2, 3)])
    >>> solve_nested_exact(g, 4).overhead, solve_nested_exact(g, 3)
    (2.0, None)
    """
    model = MemoryModel.paper(graph) if model is None else model
    w = _Weights(graph, model)
    full = (1 << graph.n) - 1
    family = sorted(set(enumerate_lower_sets(graph) if lower_sets is None else lower_sets)
                    | {0, full}, key=lambda m: (bin(m).count("1"), m))
    # states (S, L) with their fronts; items carry a back-pointer
    fronts: Dict[Tuple[int, int], List[Tuple[float, int, int, object]]] = {
        (0, 0): [(0.0, 0, 0, None)]}
    for L in family:  # every subset before its supersets
        for S in [s for (s, l) in list(fronts) if l == L]:
            for item in list(fronts[(S, L)]):
                t, mo, mi, _ = item
                for L2 in family:
                    if L2 & L != L or L2 == L:
                        continue
                    if model.constant_bytes + mo + mi + w.block_memory(L, L2) > budget_bytes:
                        continue
                    V = L2 & ~L
                    bnd = w.derived(L2)[0]
                    if L2 != full:  # the outer block stays open
                        U = bnd & V
                        _fronts_insert(fronts.setdefault((S, L2), []), (
                            t + w.sum(w.cost, V & ~U), mo, mi + int(w.sum(w.keep, U)),
                            (S, L, item, False)))
                    W = L2 & ~S  # the outer block closes at L2
                    ubar = bnd & W
                    _fronts_insert(fronts.setdefault((L2, L2), []), (
                        t + w.sum(w.cost, W & ~ubar), mo + int(w.sum(w.keep, ubar)), 0,
                        (S, L, item, True)))
    end = fronts.get((full, full))
    if not end:
        return None
    best = min(end, key=lambda f: (f[0], f[1]))
    masks, closes = [], []
    item, L = best, full
    while item[3] is not None:
        S, prev, parent, closed = item[3]
        masks.append(L)
        closes.append(closed)
        item, L = parent, prev
    masks.reverse()
    closes.reverse()
    ends = tuple(i for i, c in enumerate(closes) if c)
    peak, overhead = nested_cost(graph, masks, ends, model)
    return NestedChain(masks=tuple(masks), ends=ends, peak_bytes=peak, overhead=overhead)


def least_nested_budget(graph: Graph, model: Optional[MemoryModel] = None) -> int:
    """The least budget a nested plan fits under ``model`` (bisection over
    the budget with :func:`solve_nested_exact` as the test).

    >>> least_nested_budget(Graph.from_edges([1, 1, 1, 1], [(0, 1), (1, 2), (2, 3)]))
    4
    """
    model = MemoryModel.paper(graph) if model is None else model
    family = enumerate_lower_sets(graph)
    hi = int(model.constant_bytes + sum(int(x) for x in model.block_bytes)
             + max(int(x) for x in model.transient_bytes))
    while solve_nested_exact(graph, hi, model, family) is None:
        hi *= 2
    lo = int(model.constant_bytes) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if solve_nested_exact(graph, mid, model, family) is None:
            lo = mid
        else:
            hi = mid
    return hi


def small_enough(graph: Graph) -> bool:
    """Whether the exact nested DP runs on ``graph`` (at most
    :data:`MAX_LOWER_SETS` lower sets)."""
    try:
        count_lower_sets(graph, MAX_LOWER_SETS)
    except LowerSetExplosionError:
        return False
    return True


# ---------------------------------------------------------------- any depth

@dataclass(frozen=True)
class NestedTree:
    """A nested plan of any depth as :func:`exact_trees` gives it: the fine
    chain (bitsets, the last V), each boundary's level (as
    :class:`~chainer_recompute.core.execution.ExecutionPlan` takes them),
    and its memory and recomputation under :func:`tree_nested_cost`."""

    masks: Tuple[int, ...]
    levels: Tuple[int, ...]
    peak_bytes: int
    overhead: float


class _TreeWeights(_Weights):
    """The tree model's figures over lower sets: what a checkpoint at ``S``
    holds entered from ``A``, a block's need and its cost."""

    def held(self, A: int, S: int) -> int:
        """keep(∂(S) ∩ (S \\ A)): the nodes of the segment from A to S that
        a later block reads."""
        return int(self.sum(self.keep, self.derived(S)[0] & S & ~A))

    def time(self, A: int, B: int) -> float:
        return float(self.sum(self.cost, B & ~A))


def tree_nested_cost(graph: Graph, masks: Sequence[int], levels: Sequence[int],
                     model: Optional[MemoryModel] = None) -> Tuple[int, float]:
    """The memory and recomputation of the nested plan of fine chain
    ``masks`` and boundary ``levels`` under the tree model over lower sets
    (docs/algorithm.md §9, "Deeper trees"): at the backward of block
    ``t``, the constant, the checkpoint of each open boundary ``b``
    (:func:`~chainer_recompute.core.execution.open_boundaries`), which
    holds keep(∂(L_b) ∩ (L_b \\ L_p)) with ``p`` the open boundary before
    it (∅ for the first), and the block's own need (the single-level
    formula's); the recomputation of
    :func:`~chainer_recompute.core.solvers.nested_tree.tree_cost` with each
    block's cost in full. On two levels the memory is :func:`nested_cost`'s.

    >>> g = Graph.from_edges([1, 1, 1, 1], [(0, 1), (1, 2), (2, 3)])
    >>> tree_nested_cost(g, [1, 3, 7, 15], (1, 0, 1))
    (4, 6.0)
    """
    from ..execution import open_boundaries
    from .nested_tree import tree_cost
    model = MemoryModel.paper(graph) if model is None else model
    w = _TreeWeights(graph, model)
    masks, k = list(masks), len(masks)
    peak = 0
    for t in range(k):
        held, prev = 0, 0
        for b in open_boundaries(levels, t):
            held += w.held(prev, masks[b])
            prev = masks[b]
        peak = max(peak, model.constant_bytes + held
                   + w.block_memory(masks[t - 1] if t else 0, masks[t]))
    tau = [w.time(masks[t - 1] if t else 0, masks[t]) for t in range(k)]
    return int(peak), tree_cost([0] * (k - 1), [0] * k, tau, levels)[1]


def _pareto(items: List[Tuple[int, float, object]]) -> List[Tuple[int, float, object]]:
    """The (need, time) pairs no other is at most on both, by need."""
    out: List[Tuple[int, float, object]] = []
    for it in sorted(items, key=lambda x: (x[0], x[1])):
        if not out or it[1] < out[-1][1]:
            out.append(it)
    return out


def exact_trees(graph: Graph, model: Optional[MemoryModel] = None,
                lower_sets: Optional[List[int]] = None) -> List[NestedTree]:
    """Every nested plan of any depth that no other beats on both memory
    and recomputation under :func:`tree_nested_cost`, least memory first:
    the tree DP (:mod:`~chainer_recompute.core.solvers.nested_tree`) over
    every chain of lower sets at once. A segment from ``A`` to ``B``
    (lower sets, entered with ``A``'s checkpoint held) is one block, or is
    split at a lower set ``S`` between them: the part from ``S`` runs first
    with ``S``'s checkpoint held, the part before it is made again a level
    deeper; each segment keeps the Pareto front of (the memory it needs
    beyond what encloses it, its recomputation). The outermost level pays
    no forward. ``lower_sets``: the family (bitsets; default every lower
    set of ``graph``): ``O(N^3)`` pairs of fronts for ``N`` of them, for
    small graphs (:func:`small_enough`).

    >>> g = Graph.from_edges([1, 1, 1, 1], [(0, 1), (1, 2), (2, 3)])
    >>> [(t.peak_bytes, t.overhead, t.levels) for t in exact_trees(g)]
    [(4, 5.0, (1, 0, 0)), (5, 4.0, (0, 0, 0))]
    """
    model = MemoryModel.paper(graph) if model is None else model
    w = _TreeWeights(graph, model)
    full = (1 << graph.n) - 1
    family = sorted(set(enumerate_lower_sets(graph) if lower_sets is None else lower_sets)
                    | {0, full}, key=lambda m: (bin(m).count("1"), m))
    inside = {A: [S for S in family if S & A == A and S != A] for A in family}
    # front[(A, B)]: (need, time, how): how = None (one block) or (S, left, right)
    front: Dict[Tuple[int, int], List[Tuple[int, float, object]]] = {}
    for B in family:  # (A, S) before (A, B), and (S, B) before (A, B) for A ⊊ S
        for A in reversed(family):
            if A & B != A or A == B:
                continue
            items = [(w.block_memory(A, B), w.time(A, B), None)]
            for S in inside[A]:
                if S & B != S or S == B:
                    continue
                c, ts = w.held(A, S), w.time(A, S)
                items += [(max(x[0], y[0] + c), x[1] + ts + y[1], (S, x, y))
                          for x in front[(A, S)] for y in front[(S, B)]]
            front[(A, B)] = _pareto(items)
    # the outermost level, from the right: root[A] the suffix from A to V
    root: Dict[int, List[Tuple[int, float, object]]] = {}
    for A in reversed(family[:-1]):
        items = [(x[0], x[1], (None, x, None)) for x in front[(A, full)]]
        for S in inside[A]:
            if S == full:
                continue
            c = w.held(A, S)
            items += [(max(x[0], y[0] + c), x[1] + y[1], (S, x, y))
                      for x in front[(A, S)] for y in root[S]]
        root[A] = _pareto(items)

    def segment(item: Tuple[int, float, object], depth: int) -> List[Tuple[int, int]]:
        # the boundaries of a segment's tree with their levels, in order
        how = item[2]
        if how is None:
            return []
        S, x, y = how
        return segment(x, depth + 1) + [(S, depth)] + segment(y, depth)

    out = []
    for item in root[0]:
        bounds: List[Tuple[int, int]] = []
        while True:
            S, x, y = item[2]
            if S is None:  # the rest is one outermost segment
                bounds += segment(x, 1)
                break
            bounds += segment(x, 1) + [(S, 0)]
            item = y
        masks = tuple(S for S, _ in bounds) + (full,)
        levels = tuple(d for _, d in bounds)
        peak, overhead = tree_nested_cost(graph, masks, levels, model)
        out.append(NestedTree(masks=masks, levels=levels, peak_bytes=peak, overhead=overhead))
    return out
