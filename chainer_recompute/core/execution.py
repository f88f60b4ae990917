"""What the runtime does with a plan, as data: which nodes are dropped,
when their arrays are released, what regeneration starts from, which
backward reads which node.

Pure core: numpy only. The runtime's executor drives Chainer with it, and
:mod:`~chainer_recompute.core.replay` replays the same decisions to
predict the memory of an iteration.
"""
from __future__ import annotations

import weakref
from bisect import bisect_left
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

from .errors import RecomputeError
from .graph import Graph

__all__ = ["ExecutionPlan", "backward_readers", "open_boundaries", "regeneration_frees",
           "releasable_nodes"]


def backward_readers(graph: Graph, releasable: FrozenSet[int],
                     derived: Dict[int, Tuple[str, ...]]
                     ) -> Tuple[Dict[int, Tuple[int, ...]], Dict[int, Tuple[int, ...]]]:
    """``needs[w]``: nodes whose arrays the backward of ``w`` reads (its own
    retained outputs and derived attributes, the producers of its retained
    inputs); ``done[w]``: the nodes with one backward reader less once
    ``w``'s backward has run (``needs[w]`` and ``w``). Both restricted to
    ``releasable``.

    >>> g = Graph.from_edges([4, 4], [(0, 1)])
    >>> backward_readers(g, frozenset({0, 1}), {})
    ({0: (), 1: ()}, {0: (0,), 1: (1,)})
    """
    needs: Dict[int, Tuple[int, ...]] = {}
    done: Dict[int, Tuple[int, ...]] = {}
    for node in graph.nodes:
        need = set()
        if node.retained_outputs or derived.get(node.id):
            need.add(node.id)
        for a in node.retained_inputs:
            p = graph.arrays[a].producer
            if p is not None:
                need.add(p)
        need &= releasable
        needs[node.id] = tuple(sorted(need))
        done[node.id] = tuple(sorted(need | ({node.id} & releasable)))
    return needs, done


def regeneration_frees(steps: Sequence[int], inputs: Callable[[int], Sequence[int]],
                       outputs: Callable[[int], Sequence[int]]) -> Dict[int, List[int]]:
    """``out[u]``: the arrays made by ``steps`` (a nested plan's
    regeneration, in order; ``inputs(u)`` and ``outputs(u)``: each step's
    arrays) whose last reader among them is ``u``: what the executor and
    the replay let go once ``u`` has run.

    >>> ins, outs = {0: [9], 1: [0], 2: [0, 1]}, {0: [0], 1: [1], 2: [2]}
    >>> regeneration_frees([0, 1, 2], ins.get, outs.get)
    {2: [0, 1]}
    """
    made = {a for u in steps for a in outputs(u)}
    last: Dict[int, int] = {}
    for u in steps:
        for a in inputs(u):
            if a in made:
                last[a] = u
    out: Dict[int, List[int]] = {}
    for a, u in last.items():
        out.setdefault(u, []).append(a)
    return out


def open_boundaries(levels: Sequence[int], t: int) -> List[int]:
    """S(t) of a nested plan of boundary ``levels`` (docs/algorithm.md,
    "Deeper trees"): the boundaries below block ``t`` of a level at most
    every level between them and ``t``, increasing: the left ends of the
    open segments of the nesting tree (for two levels: the outer
    boundaries, and every boundary since the last of them).

    >>> open_boundaries((2, 1, 2, 2), 4), open_boundaries((1, 0, 1), 3)
    ([1, 2, 3], [1, 2])
    """
    out: List[int] = []
    low: Optional[int] = None
    for b in range(t - 1, -1, -1):
        if low is None or levels[b] <= low:
            out.append(b)
            low = levels[b]
    out.reverse()
    return out


def releasable_nodes(graph: Graph) -> FrozenSet[int]:
    """The nodes a plan may release: recomputable, except those whose
    outputs are all returned by the forward (``graph.step.returned``)
    and that hold no derived attribute (releasing them frees nothing: the
    caller's Variables hold the arrays, and that is all they retain; and
    regenerating them would recompute for nothing).

    >>> sorted(releasable_nodes(Graph.from_edges([4, 4], [(0, 1)])))
    [0, 1]
    """
    returned = set(graph.step.returned)
    held = {node.id for node in graph.nodes
            if node.outputs and not any(h.remade for h in node.held)
            and returned.issuperset(node.outputs)}
    return frozenset(v for v in range(graph.n) if graph.nodes[v].recomputable and v not in held)


class _Facts(NamedTuple):
    """What every plan of one graph finds the same (see :class:`ExecutionPlan`)."""
    derived: Dict[int, Tuple[str, ...]]
    written: Dict[int, Tuple[str, ...]]
    drawn: Dict[int, Tuple[str, ...]]
    releasable: FrozenSet[int]
    needs: Dict[int, Tuple[int, ...]]
    done: Dict[int, Tuple[int, ...]]
    last: List[int]  # each node's last forward reader (itself where none)


_FACTS: "weakref.WeakKeyDictionary[Graph, _Facts]" = weakref.WeakKeyDictionary()


def facts_of(graph: Graph) -> _Facts:
    """The plan-independent part of an :class:`ExecutionPlan` of ``graph``,
    made once per graph (a search builds hundreds of plans of one graph;
    :func:`~chainer_recompute.core.budget.release_caches` lets go of them)."""
    got = _FACTS.get(graph)
    if got is None:
        derived, written, drawn = {}, {}, {}
        for node in graph.nodes:
            derived[node.id] = tuple(h.name for h in node.held if h.remade)
            d = tuple(h.name for h in node.held if h.redrawn)
            if d:
                drawn[node.id] = d
            written[node.id] = tuple(h.name for h in node.held if h.role == "written")
        releasable = releasable_nodes(graph)
        needs, done = backward_readers(graph, releasable, derived)
        last = [max(graph.succs[u], default=u) for u in range(graph.n)]
        got = _FACTS[graph] = _Facts(derived, written, drawn, releasable, needs, done, last)
    return got


def release_facts() -> None:
    """Let go of every graph's :func:`facts_of`."""
    _FACTS.clear()


class ExecutionPlan:
    """The runtime's view of a plan.

    Args:
        graph: the planned graph; node ids are the order in which the
            model's forward applies its functions.
        lower_sets: the plan's strategy L_1 ⊊ ... ⊊ L_k = V.
        kept: nodes whose outputs are checkpoints (U_1 ∪ ... ∪ U_k).
        inner: a nested plan's inner checkpoints (docs/algorithm.md,
            "Nested plans"): nodes dropped in the forward like any other
            that a regeneration through them puts back (see :meth:`keeps`)
            and keeps until their last reader (a backward, or the
            regeneration of a later block that starts from them) has run; a
            regeneration of a nested plan frees each of its transient values
            after its last reader in it. Empty: a single-level plan.
        levels: a nested plan's level of each boundary between two
            consecutive blocks (``k - 1`` of them): 0 where the outer
            checkpoints cross it, ``d >= 1`` for a boundary inside a
            segment of depth ``d - 1``. Omitted: every boundary that only
            ``inner`` nodes cross is of level 1 (two levels).
        backward_order: the order the backward runs in, where it is not
            the graph's recorded one (``Plan.backward_order``); the replay
            follows it.

    Attributes:
        dropped: nodes whose arrays are released in the forward pass and
            regenerated in the backward (not kept, releasable).
        unsafe: nodes the plan would drop but that cannot be recomputed
            (kept instead).
        release_at: ``release_at[i]``: dropped nodes released just before
            node ``i`` runs (after their last forward reader; ``n``: when
            the forward has returned).
        sources: ``sources[u]``: input positions of dropped node ``u`` whose
            arrays are not made by a dropped node: what regeneration starts
            from (held until then); ``source_arrays``: those made by nodes.
        releasable: recomputable nodes, except those whose outputs are all
            returned by the forward (``graph.step.returned``) and that
            hold no derived attribute: the only ones ever released.
        needs, done: see :func:`backward_readers`; in a nested plan a
            node of ``inner`` also has one reader less once the backward
            of each dropped node reading its outputs has run (that node's
            block was regenerated from it by then).
        block_of, block_nodes: each node's block; the dropped nodes of
            each block (regenerated together).
        derived, written: attribute names by role, per node (``derived``:
            those released with the node and made again by its forward,
            ``drawn`` ones included, see
            :attr:`~chainer_recompute.core.graph.HeldArray.remade`).
        drawn: per node, the ``derived`` names its forward draws from the
            random state.

    >>> g = Graph.from_edges([4, 4, 4], [(0, 1), (1, 2)])
    >>> ep = ExecutionPlan(g, [frozenset({0, 1}), frozenset({0, 1, 2})], frozenset({1}))
    >>> sorted(ep.dropped), ep.release_at
    ([0, 2], {2: [0], 3: [2]})
    """

    def __init__(self, graph: Graph, lower_sets: Sequence[FrozenSet[int]],
                 kept: FrozenSet[int], inner: FrozenSet[int] = frozenset(),
                 levels: Optional[Sequence[int]] = None,
                 backward_order: Optional[Sequence[int]] = None) -> None:
        self.graph = graph
        self.backward_order: Optional[Tuple[int, ...]] = (
            tuple(backward_order) if backward_order else None)
        n = graph.n
        self.block_of = [0] * n
        prev: FrozenSet[int] = frozenset()
        for b, L in enumerate(lower_sets):
            for v in L - prev:
                self.block_of[v] = b
            prev = L
        if len(prev) != n:
            raise RecomputeError(f"the plan covers {len(prev)} of the graph's {n} nodes; "
                                 f"the last lower set must be V")
        # (shared by the plans of one graph, never changed)
        facts = facts_of(graph)
        self.derived: Dict[int, Tuple[str, ...]] = facts.derived
        self.written: Dict[int, Tuple[str, ...]] = facts.written
        #: per node, the released attributes a regeneration draws again
        #: from the random state kept at its forward (``drawn``, remade)
        self.drawn: Dict[int, Tuple[str, ...]] = facts.drawn
        self.releasable: FrozenSet[int] = facts.releasable
        self.dropped: FrozenSet[int] = frozenset(
            v for v in self.releasable if v not in kept)
        self.unsafe = [v for v in range(n) if v not in kept and not graph.nodes[v].recomputable]
        arrays = graph.arrays
        self.release_at: Dict[int, List[int]] = {}
        for u in sorted(self.dropped):
            self.release_at.setdefault(facts.last[u] + 1, []).append(u)
        self.sources: Dict[int, Tuple[int, ...]] = {}
        for u in self.dropped:
            pos = []
            for j, a in enumerate(graph.nodes[u].inputs):
                p = arrays[a].producer
                if p is None or p not in self.dropped:
                    pos.append(j)
            self.sources[u] = tuple(pos)
        #: the nested plan's inner checkpoints (dropped, kept once regenerated)
        self.inner: FrozenSet[int] = frozenset(inner) & self.dropped
        #: arrays made by a node that regeneration starts from (in a nested
        #: plan also the outputs of ``inner`` that dropped nodes read)
        self.source_arrays: FrozenSet[int] = frozenset(
            graph.nodes[u].inputs[j] for u, pos in self.sources.items() for j in pos
            if arrays[graph.nodes[u].inputs[j]].producer is not None) | frozenset(
            a for u in self.dropped for a in graph.nodes[u].inputs
            if arrays[a].producer in self.inner)
        self.needs, self.done = facts.needs, facts.done
        if self.inner:
            self.done = dict(self.done)
            for w in self.dropped:
                starts = {arrays[a].producer for a in graph.nodes[w].inputs} & self.inner
                if starts - {w}:
                    self.done[w] = tuple(sorted(set(self.done[w]) | starts))
        self.block_nodes: Dict[int, List[int]] = {}
        for u in sorted(self.dropped):
            self.block_nodes.setdefault(self.block_of[u], []).append(u)
        k = len(lower_sets)
        self.levels: Tuple[int, ...] = tuple(levels) if levels else (1,) * (k - 1)
        if len(self.levels) != k - 1:
            raise RecomputeError(f"a nested plan of {k} blocks has {k - 1} boundaries: got "
                                 f"{len(self.levels)} levels")
        #: the boundaries an inner node crosses: after its block up to the
        #: block of its last reader (an inner node read by nothing has none)
        self.spans: Dict[int, Tuple[int, int]] = {
            u: (self.block_of[u], max(self.block_of[w] for w in graph.succs[u]) - 1)
            for u in self.inner if graph.succs[u]}
        self._stacks: Dict[int, List[int]] = {}

    def stack(self, t: int) -> List[int]:
        """:func:`open_boundaries` of this plan's levels below block ``t``:
        the boundaries whose checkpoints the backward of block ``t`` keeps.

        >>> g = Graph.from_edges([4] * 5, [(0, 1), (1, 2), (2, 3), (3, 4)])
        >>> L = [frozenset(range(i + 1)) for i in range(5)]
        >>> ExecutionPlan(g, L, frozenset({4}), frozenset({0, 1, 2, 3}), (2, 1, 2, 2)).stack(4)
        [1, 2, 3]
        """
        got = self._stacks.get(t)
        if got is None:
            got = self._stacks[t] = open_boundaries(self.levels, t)
        return got

    def keeps(self, u: int, t: int) -> bool:
        """Whether a regeneration for the backward of block ``t`` puts
        back inner node ``u`` (kept until its last reader): when ``u`` crosses
        a boundary of :meth:`stack` (``t``) before reaching ``t``. Deeper
        inner nodes of a segment the backward has not reached yet are let
        go, to be made again from that segment's start."""
        span = self.spans.get(u)
        if span is None:
            return False
        lo, hi = span[0], min(span[1], t - 1)
        s = self.stack(t)
        i = bisect_left(s, lo)
        return i < len(s) and s[i] <= hi

    @classmethod
    def of(cls, graph: Graph, plan: Any) -> "ExecutionPlan":
        """The execution plan of a :class:`~chainer_recompute.core.plan.Plan`
        (its chain, its kept nodes, a nested plan's inner checkpoints).

        >>> from chainer_recompute.core.plan import make_plan
        >>> g = Graph.from_edges([4, 4, 4], [(0, 1), (1, 2)])
        >>> p = make_plan(g, [{0, 1}, {0, 1, 2}], solver='exact', strategy='tc', budget_bytes=None)
        >>> sorted(ExecutionPlan.of(g, p).dropped)
        [0, 2]
        """
        return cls(graph, plan.lower_sets, frozenset(plan.kept), plan.inner, plan.levels,
                   plan.backward_order)

    @property
    def n(self) -> int:
        return self.graph.n
