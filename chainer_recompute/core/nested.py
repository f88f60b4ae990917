"""Nested plans: recomputation at two levels or more, for budgets below the least
a single-level plan reaches (docs/algorithm.md, "Nested plans").

Pure core: numpy only.

A single-level plan (Kusumoto et al.) keeps the checkpoints U_i of its
chain L_1 ⊊ ... ⊊ L_k through the forward, and regenerates a block V_i,
all of it at once, for its backward. A nested plan groups that chain's
blocks into outer blocks: only the checkpoints of the outer chain (the
nodes of an outer block read beyond it) are kept through the forward; the
regeneration of an outer block, for the backward of its last fine block,
puts back the fine chain's checkpoints inside it (the plan's ``inner``
nodes) and lets every other value go after its last reader; each earlier
fine block is then regenerated from them for its own backward, as in a
single-level plan. Every node but the outer checkpoints is recomputed at
most twice. Deeper plans nest the fine blocks of each outer block the same
way, level by level (a level per boundary of the fine chain; see
:meth:`~chainer_recompute.core.execution.ExecutionPlan.keeps`).

:class:`NestedSearch` finds such plans from the single-level plans a
:class:`~chainer_recompute.core.budget.BudgetSearch` made (its fine
chains): grouping each chain's blocks into outer blocks of about equal
checkpoint bytes over a range of sizes (two levels), and the trees of any
depth of the tree DP (:mod:`~chainer_recompute.core.solvers.nested_tree`),
each candidate replayed exactly (:func:`~chainer_recompute.core.replay.replay`,
which gives its peak and its recomputation).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from .execution import ExecutionPlan
from .graph import Graph, _topological_order
from .memory_model import MemoryModel
from .plan import Plan, make_plan, replace_plan
from .replay import ReplayResult, backward_steps, replay, replay_engine
from .solvers import nested_tree

__all__ = ["NestedSearch", "backward_positions", "cut_block", "nest", "nested_plan",
           "split_block", "two_levels"]

#: outer-block sizes tried per fine chain (geometric), then refined
#: between the neighbours of the best
GRID_STEPS = 8
REFINE_STEPS = 4
#: fine chains tried: the single-level plans of the most blocks, and those
#: of the least replayed peak, half each
MAX_FINE_CHAINS = 12
#: trees of the tree DP replayed per fine chain: those of least memory,
#: then more spread above them; on a graph of more than
#: :data:`TREE_REPLAY_NODES` / 12 nodes, as many as replay that many nodes
#: (at least two: the least tree and one above it)
TREE_LOW = 8
TREE_HIGH = 4
TREE_REPLAY_NODES = 24_000
#: rounds of refinement at the least plan's peak (:meth:`NestedSearch._refined`)
REFINE_ROUNDS = 4
#: rounds of cutting the blocks that bound the tree DP's least (:meth:`NestedSearch._cut`),
#: and how near the bound a block's need must come to be cut
CUT_ROUNDS = 8
CUT_TOL = 0.01
#: on a large graph (:data:`SCREEN_MIN_NODES`), the cutting stops after
#: this many rounds in a row without a lower plan
CUT_PATIENCE = 3
#: on graphs of this many nodes or more, the fine chains' groupings are
#: ranked by the tree DP's model (:func:`~.solvers.nested_tree.tree_peak`)
#: and only those of least modelled peak, of all chains, are replayed (a
#: nested replay in Python takes about a second on 15,000 nodes): as many
#: as replay :data:`SCREEN_REPLAY_NODES` nodes in all, at least
#: :data:`SCREEN_REPLAYS`
SCREEN_MIN_NODES = 1000
SCREEN_REPLAY_NODES = 24_000
SCREEN_REPLAYS = 6
#: a search replays dozens of plans or more: compiled (numba, where it is
#: installed) from this many nodes (:func:`~.replay.replay_engine`)
SEARCH_KERNEL_MIN_NODES = 100


def two_levels(n_blocks: int, ends: Sequence[int]) -> Tuple[int, ...]:
    """The boundary levels (see :func:`nest`) of a chain of ``n_blocks``
    fine blocks grouped into outer blocks that end at the fine blocks
    ``ends`` (increasing, the last block's index last): 0 after each outer
    block, 1 inside them.

    >>> two_levels(4, [1, 3])
    (1, 0, 1)
    """
    if not ends or ends[-1] != n_blocks - 1 or any(b <= a for a, b in zip(ends, ends[1:])):
        raise ValueError(f"outer blocks must end at increasing fine blocks, the last at "
                         f"{n_blocks - 1}: got {list(ends)}")
    out = set(ends)
    return tuple(0 if b in out else 1 for b in range(n_blocks - 1))


def nest(graph: Graph, plan: Plan, levels: Sequence[int]
         ) -> Tuple[FrozenSet[int], FrozenSet[int]]:
    """The outer and inner checkpoints of ``plan``'s chain nested at the
    boundary ``levels`` (one per boundary between consecutive fine blocks:
    0 between outer blocks, ``d >= 1`` inside a segment of depth ``d - 1``;
    :func:`two_levels`): a checkpoint of a fine block is an outer one when
    it crosses a boundary of level 0 to a node that reads it (or nothing
    reads it: the forward's results), an inner one otherwise.

    >>> from chainer_recompute.core.plan import make_plan
    >>> g = Graph.from_edges([4] * 4, [(0, 1), (1, 2), (2, 3)])
    >>> p = make_plan(g, [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}], solver='x', strategy='tc',
    ...               budget_bytes=None)
    >>> [sorted(s) for s in nest(g, p, two_levels(4, [1, 3]))]
    [[1], [0, 2]]
    """
    if len(levels) != plan.n_blocks - 1 or any(x < 0 for x in levels):
        raise ValueError(f"a chain of {plan.n_blocks} blocks has {plan.n_blocks - 1} "
                         f"boundaries, each of level 0 or more: got {list(levels)}")
    block_of = np.empty(graph.n, dtype=np.int64)
    for i, b in enumerate(plan.blocks):
        block_of[list(b)] = i
    # outer boundaries up to each one (crossing [i, r - 1] meets one iff
    # the counts before i and before r differ)
    zeros = np.concatenate([[0], np.cumsum(np.asarray(levels, dtype=np.int64) == 0)])
    outer, inner = set(), set()
    for i, u in enumerate(plan.checkpoints):
        for v in u:
            succ = graph.succs[v]
            r = int(block_of[list(succ)].max()) if succ else plan.n_blocks
            if not succ or (r > i and zeros[r] > zeros[i]):
                outer.add(v)
            else:
                inner.add(v)
    return frozenset(outer), frozenset(inner)


def nested_plan(graph: Graph, plan: Plan, levels: Sequence[int], engine: Optional[str] = None
                ) -> Tuple[Plan, ReplayResult]:
    """``plan`` (single-level) nested at the boundary ``levels`` (see
    :func:`nest`), and its replay on ``graph``. The nested plan's predicted
    peak is the replayed total peak, its overhead the cost of every node
    the replay recomputes (some more than once). ``engine``: the replay's."""
    levels = tuple(int(x) for x in levels)
    outer, inner = nest(graph, plan, levels)
    result = replay(graph, ExecutionPlan(graph, plan.lower_sets, outer, inner, levels),
                    engine=engine)
    blocks = plan.blocks
    total = float(graph.node_cost.sum())
    overhead = float(result.recomputed_cost or 0.0)
    info = dict(plan.info, nested={"fine_blocks": plan.n_blocks,
                                   "outer_blocks": levels.count(0) + 1,
                                   "depth": 1 + max(levels, default=1),
                                   "inner_checkpoints": len(inner),
                                   "outer_checkpoints": len(outer),
                                   "recomputed_nodes": result.recomputed},
                memory_scope="total")
    out = replace_plan(
        plan, solver=f"nested-{plan.solver}", predicted_peak_bytes=int(result.peak_bytes),
        simulated_peak_bytes=int(result.peak_bytes), overhead=overhead,
        overhead_fraction=overhead / total if total > 0 else 0.0,
        checkpoint_sets=tuple(frozenset(b & outer) for b in blocks), inner=inner,
        levels=levels, info=info)
    return out, result


def _checkpoint_bytes(graph: Graph, plan: Plan) -> List[int]:
    """The bytes of each fine block's checkpoints (their outputs)."""
    return [sum(graph.arrays[a].owned_bytes for v in u for a in graph.nodes[v].outputs)
            for u in plan.checkpoints]


def _grouping(sizes: Sequence[int], threshold: float) -> Tuple[int, ...]:
    """The boundary levels of fine blocks (their checkpoints' ``sizes``)
    grouped from the first on, an outer block ending (a boundary of level
    0) once its checkpoints hold ``threshold`` bytes.

    >>> _grouping([1, 1, 1, 1, 1], 2)
    (1, 0, 1, 0)
    """
    out, acc = [], 0.0
    for s in sizes[:-1]:
        acc += s
        out.append(0 if acc >= threshold else 1)
        if acc >= threshold:
            acc = 0.0
    return tuple(out)


#: the node whose backward an event of core.replay's belongs to
_EVENT_NODE = re.compile(r"^(?:backward (\d+) |regenerate \d+ \S+ for backward (\d+)$)")


#: a chain's figures for the tree DP: crossing bytes, block needs, block costs, peak
_Profile = Tuple[List[int], List[int], List[float], int]


def _profile(graph: Graph, plan: Plan, cost: np.ndarray, engine: Optional[str] = None
             ) -> _Profile:
    """The tree DP's figures of ``plan``'s chain
    (:mod:`~chainer_recompute.core.solvers.nested_tree`): the bytes crossing
    each boundary (the outputs of nodes before it read after it); what each
    block's backward (its regeneration included) needs in the plan's
    single-level replay beside the checkpoints kept before it; each block's
    ``cost`` (per node); and that replay's peak (``engine``: the replay's)."""
    k = plan.n_blocks
    ep = ExecutionPlan.of(graph, plan)
    block_of = ep.block_of
    crossing = np.zeros(k + 1)
    for node in graph.nodes:
        if graph.succs[node.id]:
            b, r = block_of[node.id], max(block_of[w] for w in graph.succs[node.id])
            if r > b:
                nbytes = sum(graph.arrays[a].owned_bytes for a in node.outputs)
                crossing[b] += nbytes
                crossing[r] -= nbytes
    c = np.cumsum(crossing)[:k - 1].astype(np.int64).tolist()
    kept_before = np.concatenate([[0], np.cumsum(_checkpoint_bytes(graph, plan))])
    result = replay(graph, ep, engine=engine)
    w = [0] * k
    for label, total in zip(result.events, result.memory_bytes):
        m = _EVENT_NODE.match(label)
        if m is not None:
            b = block_of[int(m.group(1) or m.group(2))]
            w[b] = max(w[b], int(total) - int(kept_before[b]))
    tau = [float(sum(cost[v] for v in block)) for block in plan.blocks]
    return c, w, tau, int(result.peak_bytes)


def _by_structure(candidate: Tuple[Plan, int]) -> Tuple[Any, ...]:
    """A nested candidate's rank where a refinement starts from the least:
    its peak, then what depends only on the graph's sizes and structure
    (the finer chain first, then the fewer nodes recomputed), never the
    measured times, so that the refinements, and the least they find, do
    not move between recordings of one model (the PTB LSTM's did, by 2%,
    when equal peaks were ranked by measured overhead)."""
    plan, peak = candidate
    return (peak, -plan.n_blocks, _recomputed(plan), plan.levels or (),
            tuple(len(b) for b in plan.blocks))


def _by_recomputation(candidate: Tuple[Plan, int]) -> Tuple[Any, ...]:
    """As :func:`_by_structure`, the fewer nodes recomputed first."""
    plan, peak = candidate
    return (peak, _recomputed(plan), -plan.n_blocks, plan.levels or (),
            tuple(len(b) for b in plan.blocks))


def _recomputed(plan: Plan) -> int:
    return int(plan.info.get("nested", {}).get("recomputed_nodes", 0))


def backward_positions(graph: Graph) -> List[int]:
    """Each node's position in a topological order of ``graph`` that is
    the backward's order reversed (:func:`~chainer_recompute.core.replay.backward_steps`;
    a node with no backward goes just before the first of its readers):
    a block of a chain split along it has its parts' backwards run one
    after the other, the last part's first.

    >>> g = Graph.from_edges([4] * 4, [(0, 1), (0, 2), (1, 3), (2, 3)])
    >>> g.backward_order = (3, 1, 2, 0)
    >>> backward_positions(g)
    [0, 2, 1, 3]
    """
    steps = backward_steps(graph)
    prio = [float("inf")] * graph.n
    for i, v in enumerate(steps):
        prio[v] = len(steps) - i
    for v in range(graph.n - 1, -1, -1):
        if prio[v] == float("inf"):
            prio[v] = min((prio[w] for w in graph.succs[v]), default=float("inf"))
    pos = [0] * graph.n
    for i, v in enumerate(_topological_order(
            graph.n, [(u, w) for u in range(graph.n) for w in graph.succs[u]], prio)):
        pos[v] = i
    return pos


def split_block(lower_sets: Sequence[FrozenSet[int]], b: int, position: Sequence[int]
                ) -> List[FrozenSet[int]]:
    """The chain ``lower_sets`` with its block ``b`` split into one block
    per node, in the order ``position`` gives (a topological order:
    :func:`backward_positions`).

    >>> [sorted(x) for x in split_block([frozenset({0}), frozenset({0, 1, 2})], 1, [0, 2, 1])]
    [[0], [0, 2], [0, 1, 2]]
    """
    prev = lower_sets[b - 1] if b else frozenset()
    out, acc = list(lower_sets[:b]), set(prev)
    for v in sorted(lower_sets[b] - prev, key=lambda v: position[v])[:-1]:
        acc.add(v)
        out.append(frozenset(acc))
    return out + list(lower_sets[b:])


def cut_block(graph: Graph, lower_sets: Sequence[FrozenSet[int]], b: int,
              position: Sequence[int]) -> Optional[List[FrozenSet[int]]]:
    """The chain ``lower_sets`` with its block ``b`` cut in two where the
    fewest bytes cross: after the prefix, in the order ``position`` gives
    (:func:`backward_positions`), whose outputs read beyond it weigh least
    (of equal ones, the nearest the middle). ``None`` for a block of one
    node.

    >>> g = Graph.from_edges([4, 8, 1, 8, 4], [(0, 1), (1, 2), (2, 3), (3, 4)])
    >>> [sorted(x) for x in cut_block(g, [frozenset(range(5))], 0, range(5))]
    [[0, 1, 2], [0, 1, 2, 3, 4]]
    """
    prev = lower_sets[b - 1] if b else frozenset()
    nodes = sorted(lower_sets[b] - prev, key=lambda v: position[v])
    if len(nodes) < 2:
        return None
    inside = set(prev)

    def owned(v: int) -> int:
        return sum(graph.arrays[a].owned_bytes for a in graph.nodes[v].outputs)
    # each node inside: its readers outside; the crossing bytes, kept as
    # each node comes in
    outside = {v: sum(w not in inside for w in graph.succs[v]) for v in prev}
    crossing = sum(owned(v) for v, k in outside.items() if k)
    best: Optional[Tuple[Tuple[int, float], int]] = None
    for k, v in enumerate(nodes[:-1], start=1):
        inside.add(v)
        outside[v] = sum(w not in inside for w in graph.succs[v])
        crossing += owned(v) if outside[v] else 0
        for u in graph.preds[v]:
            if u in outside:
                outside[u] -= 1
                crossing -= owned(u) if outside[u] == 0 else 0
        key = (crossing, abs(k - len(nodes) / 2))
        if best is None or key < best[0]:
            best = (key, k)
    assert best is not None
    return list(lower_sets[:b]) + [frozenset(prev | set(nodes[:best[1]]))] + list(lower_sets[b:])


class NestedSearch:
    """Nested plans of one graph, from its single-level plans.

    Args:
        graph: the recorded graph the plans are replayed on (its own
            costs give their overheads).
        fine: single-level plans with their replayed peaks (a
            :class:`~chainer_recompute.core.budget.BudgetSearch`'s
            candidates); :data:`MAX_FINE_CHAINS` distinct chains are
            nested, the finest and those of least peak.
        model: the measured memory model of ``graph``; on a graph of few
            lower sets the exact nested DP's plans under it are candidates
            too.

    The candidates depend on the graph's sizes and structure, and on the
    fine plans: planned without times, the least nested peak does not move
    between recordings of one model.
    """

    def __init__(self, graph: Graph, fine: Sequence[Tuple[Plan, int]],
                 model: Optional[MemoryModel] = None) -> None:
        self.graph, self.model = graph, model
        # the finest chains (nesting groups their blocks: a coarse chain's
        # blocks, regenerated whole, leave it little to gain) and those of
        # least peak, half each
        usable = [c for c in fine if c[0].recompute and c[0].n_blocks > 2]
        finest = sorted(usable, key=lambda c: (-c[0].n_blocks, c[1], c[0].overhead))
        lowest = sorted(usable, key=lambda c: (c[1], c[0].overhead))
        self.fine: List[Plan] = []
        seen = set()
        for order in (finest, lowest):
            took = 0
            for plan, _ in order:
                key = plan.blocks
                if key not in seen:
                    seen.add(key)
                    self.fine.append(plan)
                    took += 1
                if took == MAX_FINE_CHAINS // 2:
                    break
        self._candidates: Optional[List[Tuple[Plan, int]]] = None
        self._trees_of: Dict[Tuple[Any, ...], List[Tuple[Plan, int]]] = {}
        self._cut_from: set = set()
        self._cost: Optional[np.ndarray] = None
        self.engine = replay_engine(graph, SEARCH_KERNEL_MIN_NODES)

    def _time_free_cost(self) -> np.ndarray:
        """The graph's node costs without its measured times (made once)."""
        if self._cost is None:
            self._cost = self.graph.without_times().node_cost
        return self._cost

    def candidates(self) -> List[Tuple[Plan, int]]:
        """Every nested plan tried, with its replayed peak: each fine chain
        grouped into outer blocks at :data:`GRID_STEPS` sizes from a fine
        block's checkpoints to half of them all (geometric), then at
        :data:`REFINE_STEPS` more between the neighbours of its best (two
        levels; on a graph of :data:`SCREEN_MIN_NODES` nodes or more, only
        the groupings of least modelled peak are replayed, see
        :data:`SCREEN_REPLAY_NODES`); the trees of the tree DP
        (:meth:`_trees`, any depth); on small graphs the exact two-level
        DP's plans (:meth:`_exact`); the refinements' (:meth:`_refined`,
        :meth:`_cut`), from the least plan ranked by structure two ways."""
        if self._candidates is not None:
            return self._candidates
        out: List[Tuple[Plan, int]] = []
        screened = self.graph.n >= SCREEN_MIN_NODES
        cost = self._time_free_cost() if screened else None
        modelled: List[Tuple[int, int, Plan, Tuple[int, ...]]] = []
        for plan in self.fine:
            sizes = _checkpoint_bytes(self.graph, plan)
            total = float(sum(sizes))
            if total <= 0:
                continue
            lo = max(min(s for s in sizes if s > 0), total / 1e4)
            grid = np.geomspace(lo, total / 2, GRID_STEPS).tolist()
            seen: set = set()
            model = _profile(self.graph, plan, cost, self.engine)[:2] if screened else None
            tried = self._try(plan, sizes, grid, seen, model)
            if not tried:
                continue
            best = min(range(len(tried)), key=lambda j: (
                tried[j][1], tried[j][0].overhead if tried[j][0] else 0.0))
            j = grid.index(tried[best][2])
            a, b = grid[max(j - 1, 0)], grid[min(j + 1, len(grid) - 1)]
            tried += self._try(plan, sizes, np.linspace(a, b, REFINE_STEPS + 2)[1:-1].tolist(),
                               seen, model)
            if screened:
                modelled += [(peak, len(modelled), plan, levels) for _, peak, _, levels in tried]
            else:
                out += [(p, peak) for p, peak, _, _ in tried]
        n_replays = max(SCREEN_REPLAYS, SCREEN_REPLAY_NODES // self.graph.n)
        for _, _, plan, levels in sorted(modelled)[:n_replays]:  # the least modelled
            p = nested_plan(self.graph, plan, levels, self.engine)[0]
            out.append((p, p.predicted_peak_bytes))
        out += self._trees() + self._exact()
        # the refinements, from the least plan by either structural rank,
        # each going on by its rank (plans of equal peaks are common:
        # ResNet152 refines lower from its finest chain, the PTB LSTM's cut
        # from its least recomputing one)
        found = list(out)
        for rank in (_by_structure, _by_recomputation) if found else ():
            refined = self._refined(found, rank)
            out += refined
            out += self._cut(found + refined, rank)
        # (a chain both ranks reach gives its trees once)
        out = list({id(p): (p, peak) for p, peak in out}.values())
        self._candidates = out
        return out

    def _trees(self) -> List[Tuple[Plan, int]]:
        """For each of the finest fine chains (the first half of
        :attr:`fine`) of at most
        :data:`~chainer_recompute.core.solvers.nested_tree.MAX_BLOCKS`
        blocks, the tree DP's plans (:meth:`_tree_plans`)."""
        return [c for plan in self.fine[:MAX_FINE_CHAINS // 2] for c in self._tree_plans(plan)]

    def _tree_plans(self, plan: Plan, profile: Optional[_Profile] = None
                    ) -> List[Tuple[Plan, int]]:
        """The tree DP's plans of ``plan``'s chain (under :func:`_profile`'s
        figures, from its single-level replay) at its least memory and
        above: the :data:`TREE_LOW` distinct trees of least memory, then
        :data:`TREE_HIGH` more spread up to the chain's single-level peak
        (fewer on a large graph, see :data:`TREE_REPLAY_NODES`: a replay
        there takes about a second, and the refinements' rounds make a
        chain each); each replayed once per search (``profile``: the
        chain's :func:`_profile`, when known). None for a chain of more than
        :data:`~chainer_recompute.core.solvers.nested_tree.MAX_BLOCKS` blocks."""
        if plan.n_blocks > nested_tree.MAX_BLOCKS:
            return []
        done = self._trees_of.get(plan.blocks)
        if done is not None:
            return done
        cost = self._time_free_cost()  # (the trees do not move with timings)
        c, w, tau, peak = profile or _profile(self.graph, plan, cost, self.engine)
        table = nested_tree.TreeTable(c, w, tau, budget=peak, base=min(w))
        least = table.least()
        out: List[Tuple[Plan, int]] = []
        if least is not None:
            trees = [t for t in dict.fromkeys(table.levels(m) for m in range(
                least, table.grid + 1)) if any(t)]
            n = max(2, min(TREE_LOW + TREE_HIGH, TREE_REPLAY_NODES // self.graph.n))
            low = max(1, n * TREE_LOW // (TREE_LOW + TREE_HIGH))
            picked = trees[:low] + trees[low::max(1, (len(trees) - low) // (n - low) + 1)]
            for levels in picked:
                p, r = nested_plan(self.graph, plan, levels, self.engine)
                if p.nested:  # (a tree whose inner boundaries no checkpoint crosses is not)
                    out.append((p, int(r.peak_bytes)))
        self._trees_of[plan.blocks] = out
        return out

    def _refined(self, found: Sequence[Tuple[Plan, int]],
                 rank: Callable[..., Any] = _by_structure) -> List[Tuple[Plan, int]]:
        """Up to :data:`REFINE_ROUNDS` rounds from the least of ``found``
        (by ``rank``):
        its fine chain with the block of its peak's backward (or the larger
        of its neighbours, when that block is one node) split into one
        block per node in the backward's order reversed (:func:`split_block`,
        :func:`backward_positions`), and
        the tree DP's plans of that chain (:meth:`_tree_plans`); a round
        goes on from its least plan while that is lower than the last.
        A block of a single-level chain holds values its backward does not
        need at the peak of another (ResNet152: the first bottleneck's
        shortcut, retained by its BatchNormalization, through the main
        path's backward); split, the tree lets them go."""
        if not found:
            return []
        best, peak = min(found, key=rank)
        position: Optional[List[int]] = None
        out: List[Tuple[Plan, int]] = []
        for _ in range(REFINE_ROUNDS):
            if best.n_blocks >= nested_tree.MAX_BLOCKS:
                break
            ep = ExecutionPlan.of(self.graph, best)
            m = _EVENT_NODE.match(replay(self.graph, ep, engine=self.engine).peak_event)
            if m is None:  # (a peak in the forward or the update)
                break
            b = ep.block_of[int(m.group(1) or m.group(2))]
            sizes = [len(x) for x in best.blocks]
            if sizes[b] == 1:
                b = max((x for x in (b - 1, b + 1) if 0 <= x < len(sizes)),
                        key=lambda x: sizes[x])
                if sizes[b] == 1:
                    break
            position = position or backward_positions(self.graph)
            fine = make_plan(self.graph, split_block(best.lower_sets, b, position),
                             solver=best.solver.replace("nested-", ""), strategy=best.strategy,
                             budget_bytes=None)
            got = self._tree_plans(fine)
            out += got
            if not got or min(c[1] for c in got) >= peak:
                break
            best, peak = min(got, key=rank)
        return out

    def _cut(self, found: Sequence[Tuple[Plan, int]],
             rank: Callable[..., Any] = _by_structure) -> List[Tuple[Plan, int]]:
        """Up to :data:`CUT_ROUNDS` rounds from the fine chain of the least
        of ``found`` (by ``rank``): the blocks whose need (:func:`_profile`'s ``w[t]``,
        with the checkpoint before them) comes within :data:`CUT_TOL` of
        the largest, which bounds every tree of the chain from below, each
        cut in two where the fewest bytes cross (:func:`cut_block`), and
        the tree DP's plans of the new chain (:meth:`_tree_plans`). A round
        goes on from the chain the last one made, whatever its plans gave
        (the model and the replay differ: a round that is no lower may lead
        to one that is); on a graph of :data:`SCREEN_MIN_NODES` nodes or
        more, until :data:`CUT_PATIENCE` rounds in a row gave no lower plan
        (each round there takes seconds). A single-level DP's chain groups a recurrent
        net's steps two by two where its memory allows (the PTB LSTM at
        t = 30: the first 12 steps), and a tree over that chain holds two
        steps' values at those blocks' backward."""
        if not found:
            return []
        best = min(found, key=rank)[0]
        if best.blocks in self._cut_from:  # (both ranks' least: its rounds made once)
            return []
        self._cut_from.add(best.blocks)
        cost = self._time_free_cost()
        position = backward_positions(self.graph)
        fine = make_plan(self.graph, list(best.lower_sets),
                         solver=best.solver.replace("nested-", ""), strategy=best.strategy,
                         budget_bytes=None)
        profile = _profile(self.graph, fine, cost, self.engine)
        out: List[Tuple[Plan, int]] = []
        least: Optional[int] = None
        stale = 0  # rounds since the last lower plan
        for _ in range(CUT_ROUNDS):
            c, w = profile[:2]
            need = [w[t] + (c[t - 1] if t else 0) for t in range(len(w))]
            lower_sets = list(fine.lower_sets)
            for t in sorted((t for t in range(len(w)) if need[t] >= max(need) * (1 - CUT_TOL)),
                            reverse=True):  # (from the last: the indices before stay)
                lower_sets = cut_block(self.graph, lower_sets, t, position) or lower_sets
            if len(lower_sets) == fine.n_blocks or len(lower_sets) > nested_tree.MAX_BLOCKS:
                break
            fine = make_plan(self.graph, lower_sets, solver=fine.solver, strategy=fine.strategy,
                             budget_bytes=None)
            profile = _profile(self.graph, fine, cost, self.engine)
            got = self._tree_plans(fine, profile)
            out += got
            lowest = min([peak for _, peak in got], default=None)
            if lowest is not None and (least is None or lowest < least):
                least, stale = lowest, 0
            else:
                stale += 1
                if stale >= CUT_PATIENCE and self.graph.n >= SCREEN_MIN_NODES:
                    break
        return out

    def _exact(self) -> List[Tuple[Plan, int]]:
        """On a graph of few lower sets, the exact nested DPs' plans
        (:mod:`~chainer_recompute.core.solvers.nested_dp`, under ``model``):
        the two-level DP's at :data:`GRID_STEPS` budgets from its least to
        the single-level DPs' least, and the :data:`GRID_STEPS` trees of
        any depth of least memory (:func:`~.solvers.nested_dp.exact_trees`),
        replayed."""
        from .solvers.nested_dp import (exact_trees, least_nested_budget, small_enough,
                                        solve_nested_exact)
        from .search import least_feasible_budget
        if self.model is None or not small_enough(self.graph):
            return []
        g = self.graph.without_times()

        def replayed(masks: Sequence[int], levels: Sequence[int]) -> Tuple[Plan, int]:
            fine = make_plan(self.graph, list(masks), solver="exact", strategy="tc",
                             budget_bytes=None, model=self.model)
            p, r = nested_plan(self.graph, fine, levels, self.engine)
            return p, int(r.peak_bytes)

        trees = [t for t in exact_trees(g, self.model) if any(t.levels)][:GRID_STEPS]
        out = [c for c in (replayed(t.masks, t.levels) for t in trees) if c[0].nested]
        lo = least_nested_budget(g, self.model)
        hi = max(lo, least_feasible_budget(g, solver="exact", model=self.model))
        seen = set()
        for b in sorted({int(x) for x in np.linspace(lo, hi, GRID_STEPS)}):
            chain = solve_nested_exact(g, b, self.model)
            if chain is None or len(chain.ends) < 2 or (chain.masks, chain.ends) in seen:
                continue
            seen.add((chain.masks, chain.ends))
            out.append(replayed(chain.masks, two_levels(len(chain.masks), chain.ends)))
        return out

    def _try(self, plan: Plan, sizes: Sequence[int], thresholds: Sequence[float],
             seen: set, model: Optional[Tuple[List[int], List[int]]] = None
             ) -> List[Tuple[Optional[Plan], int, float, Tuple[int, ...]]]:
        """``plan`` nested at each threshold's grouping into two or more
        outer blocks (:func:`_grouping`) not in ``seen``, with its peak, the
        threshold that first gave it and its levels: replayed once each,
        or with ``model`` (:func:`_profile`'s crossing and block bytes) the
        tree DP's modelled peak and no plan (:meth:`candidates` replays the
        least)."""
        out = []
        for t in thresholds:
            levels = _grouping(sizes, t)
            if 0 in levels and 1 in levels and levels not in seen:
                seen.add(levels)
                if model is not None:
                    out.append((None, int(nested_tree.tree_peak(*model, levels)), t, levels))
                else:
                    p, r = nested_plan(self.graph, plan, levels, self.engine)
                    out.append((p, int(r.peak_bytes), t, levels))
        return out

    def least(self) -> Optional[Tuple[Plan, int]]:
        """The nested plan of least replayed peak (the least overhead among
        equal peaks), and that peak; ``None`` when no fine chain can nest."""
        cands = self.candidates()
        return min(cands, key=lambda c: (c[1], c[0].overhead)) if cands else None

    def fit(self, limit: int) -> Optional[Tuple[Plan, int]]:
        """The nested plan of least overhead whose replayed peak is at most
        ``limit``, and that peak; ``None`` when none is."""
        fitting = [c for c in self.candidates() if c[1] <= limit]
        return min(fitting, key=lambda c: (c[0].overhead, c[1])) if fitting else None
