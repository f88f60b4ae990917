"""The immutable result of a solver: a :class:`Plan`.

Pure core: numpy only.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Set as _AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from .graph import Graph
from .lower_sets import mask_bits, set_to_mask
from .schedule import StrategyCost, build_schedule, simulate, strategy_cost
from .units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .memory_model import MemoryModel

logger = logging.getLogger(__name__)

__all__ = ["BlockChain", "Plan", "make_plan", "infeasible_plan", "recost_plan", "replace_plan"]

NodeSet = FrozenSet[int]


class _ChainSet(_AbstractSet):
    """Lower set ``i`` of a :class:`BlockChain`: a read-only set of node ids
    held as its chain's blocks and index (blocks ``0..i``), not as its elements.
    ``L_i - L_j`` of the same chain (``j < i``) is the union of blocks
    ``j+1..i``; other set operations give frozensets."""

    __slots__ = ("chain", "index")

    def __init__(self, chain: "_ChainData", index: int) -> None:
        self.chain, self.index = chain, index

    def __contains__(self, v: object) -> bool:
        b = self.chain.block_of.get(v) if isinstance(v, int) else None  # type: ignore
        return b is not None and b <= self.index

    def __len__(self) -> int:
        return self.chain.sizes[self.index]

    def __iter__(self):
        for b in range(self.index + 1):
            yield from self.chain.blocks[b]

    @classmethod
    def _from_iterable(cls, it):
        return frozenset(it)

    def __sub__(self, other):
        if isinstance(other, _ChainSet) and other.chain is self.chain:
            if other.index >= self.index:
                return frozenset()
            return frozenset().union(*self.chain.blocks[other.index + 1:self.index + 1])
        return frozenset(self) - (other if isinstance(other, (set, frozenset))
                                  else frozenset(other))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _ChainSet) and other.chain is self.chain:
            return other.index == self.index
        return _AbstractSet.__eq__(self, other)

    __hash__ = _AbstractSet._hash

    def __reduce__(self):
        return (frozenset, (tuple(self),))

    def __repr__(self) -> str:
        return f"<lower set {self.index} of {len(self.chain.blocks)}: {len(self)} nodes>"


class _ChainData:
    """The blocks of a :class:`BlockChain`, each node's block, and the size
    of each lower set."""

    __slots__ = ("blocks", "block_of", "sizes")

    def __init__(self, blocks: Tuple[NodeSet, ...]) -> None:
        self.blocks = blocks
        self.block_of = {v: i for i, b in enumerate(blocks) for v in b}
        sizes, tot = [], 0
        for b in blocks:
            tot += len(b)
            sizes.append(tot)
        self.sizes = sizes


class BlockChain(tuple):
    """A chain of lower sets L_1 ⊊ ... ⊊ L_k held as its blocks (memory
    linear in the nodes; a tuple of frozensets is nodes times blocks). Its
    items are read-only sets (:class:`_ChainSet`) that compare equal to the
    frozensets of the same nodes.

    >>> c = BlockChain([frozenset({0}), frozenset({1, 2})])
    >>> sorted(c[1]), c[1] == frozenset({0, 1, 2}), sorted(c[1] - c[0])
    ([0, 1, 2], True, [1, 2])
    """

    def __new__(cls, blocks):
        data = _ChainData(tuple(frozenset(b) for b in blocks))
        self = super().__new__(cls, [_ChainSet(data, i) for i in range(len(data.blocks))])
        self.data = data
        return self

    @property
    def blocks(self) -> Tuple[NodeSet, ...]:
        return self.data.blocks

    def __reduce__(self):
        return (BlockChain, (self.data.blocks,))

    def __repr__(self) -> str:
        return f"BlockChain({len(self)} lower sets, {len(self[-1]) if len(self) else 0} nodes)"


class _SimulatedPeak:
    """The liveness simulation of a plan's canonical schedule, run when its
    peak is first read (a reporting figure: solvers do not pay for it)."""

    __slots__ = ("graph", "masks", "recompute")

    def __init__(self, graph: Graph, masks: Sequence[int], recompute: bool) -> None:
        self.graph, self.masks, self.recompute = graph, masks, recompute

    def __call__(self) -> int:
        sched = build_schedule(self.graph, list(self.masks), recompute=self.recompute)
        return int(simulate(self.graph, sched).peak_bytes)


class _Lazy:
    """A dataclass field whose value may be given as a :class:`_SimulatedPeak`,
    evaluated (once) on first access. The field stays a required field of
    ``__init__``; ``dataclasses.replace``, ``==``, ``repr``, ``hash`` and
    pickling see the evaluated value."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = "_" + name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        if obj is None:
            raise AttributeError(self.key)  # no class-level default
        value = obj.__dict__[self.key]
        if isinstance(value, _SimulatedPeak):
            value = obj.__dict__[self.key] = value()
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.key] = value  # from __init__ only (the class is frozen)


@dataclass(frozen=True)
class Plan:
    """A recomputation plan: a chain of lower sets and what it costs.

    Attributes:
        solver: registry name of the solver that made it.
        strategy: ``'tc'`` (time-centric) or ``'mc'`` (memory-centric).
        budget_bytes: the budget it was solved for (``None``: no budget).
        feasible: whether the plan fits the budget under the memory model.
        lower_sets: L_1 ⊊ ... ⊊ L_k = V as frozensets of node ids; empty
            when infeasible.
        predicted_peak_bytes: peak under the memory model the plan was
            solved with (the paper's by default, docs/paper.md §3;
            ``info['memory_scope']`` names its scope); ``None`` when
            infeasible.
        simulated_peak_bytes: peak of the canonical schedule with liveness
            (:func:`~chainer_recompute.core.schedule.simulate`); simulated
            when first read.
        overhead: extra forward cost Σ T(V_i \\ U_i), in cost units.
        overhead_fraction: ``overhead / T(V)`` (a fraction of one forward).
        n_blocks: k.
        solve_time_s: wall time of the solver.
        cost_model: the graph's cost model.
        checkpoint_sets: U_i per block.
        recompute: False for vanilla (nothing dropped, nothing recomputed).
        info: solver-specific extras (lower-set count, DP states, ...).
        inner: a nested plan's inner checkpoints (docs/algorithm.md,
            "Nested plans"): dropped in the forward, kept once a
            regeneration has made them again, until their last reader; its
            ``lower_sets`` are then the fine chain and ``checkpoint_sets``
            the outer checkpoints. Empty for a single-level plan.
        levels: a nested plan's level of each boundary of its fine chain
            (:class:`~chainer_recompute.core.execution.ExecutionPlan`): 0
            between outer blocks, 1 inside them, 2 and more inside the
            segments of a deeper nesting. Empty: two levels.
        backward_order: the order the backward runs the graph's functions
            in, where it is not the recorded one (Chainer's): another order
            with the same gradients
            (:mod:`~chainer_recompute.core.backward_order`), which the replay
            follows and the executor makes Chainer follow. Empty: Chainer's.

    >>> from chainer_recompute.core.graph import Graph
    >>> g = Graph.from_edges([1, 1], [(0, 1)])
    >>> p = make_plan(g, [{0, 1}], solver='exact', strategy='tc', budget_bytes=None)
    >>> p.n_blocks, sorted(p.dropped)
    (1, [0, 1])
    """

    solver: str
    strategy: str
    budget_bytes: Optional[int]
    feasible: bool
    lower_sets: Tuple[NodeSet, ...]
    predicted_peak_bytes: Optional[int]
    simulated_peak_bytes: Optional[int] = _Lazy()  # type: ignore[assignment]
    overhead: Optional[float]
    overhead_fraction: Optional[float]
    n_blocks: int
    solve_time_s: float
    cost_model: str
    checkpoint_sets: Tuple[NodeSet, ...] = ()
    recompute: bool = True
    info: Dict[str, Any] = field(default_factory=dict, compare=False)
    inner: NodeSet = frozenset()
    levels: Tuple[int, ...] = ()
    backward_order: Tuple[int, ...] = ()

    @property
    def nested(self) -> bool:
        """Whether the plan recomputes at two levels or more (:attr:`inner`)."""
        return bool(self.inner)

    @property
    def depth(self) -> int:
        """How many levels the plan recomputes at: 1 for a single-level
        plan."""
        if not self.inner:
            return 1
        return 1 + max(self.levels, default=1)

    @property
    def blocks(self) -> Tuple[NodeSet, ...]:
        """V_i = L_i \\ L_{i-1}."""
        out = []
        prev: NodeSet = frozenset()
        for cur in self.lower_sets:
            out.append(cur - prev)
            prev = cur
        return tuple(out)

    @property
    def checkpoints(self) -> Tuple[NodeSet, ...]:
        """U_i = ∂(L_i) ∩ V_i, the values kept from block i."""
        return self.checkpoint_sets

    @property
    def kept(self) -> NodeSet:
        """Union of the U_i (everything when ``recompute`` is False)."""
        if not self.recompute and self.lower_sets:
            return self.lower_sets[-1]
        return frozenset().union(*self.checkpoint_sets) if self.checkpoint_sets else frozenset()

    @property
    def dropped(self) -> NodeSet:
        """V minus :attr:`kept`: the nodes recomputed during backward."""
        if not self.lower_sets:
            return frozenset()
        return self.lower_sets[-1] - self.kept

    def summary(self) -> str:
        """A few lines for humans."""
        budget = "none" if self.budget_bytes is None else format_bytes(self.budget_bytes, binary=False)
        if not self.feasible:
            return (f"Plan[{self.solver}/{self.strategy}] INFEASIBLE at budget {budget}"
                    f" (solved in {self.solve_time_s:.3f} s)")
        nest = (f", {len(self.inner)} kept once regenerated (nested)" if self.inner else "")
        return (f"Plan[{self.solver}/{self.strategy}] budget {budget}: {self.n_blocks} blocks, "
                f"keeps {len(self.kept)} of {len(self.lower_sets[-1])} nodes{nest}\n"
                f"  predicted peak {format_bytes(self.predicted_peak_bytes, binary=False)} "
                f"(paper model), simulated peak "
                f"{format_bytes(self.simulated_peak_bytes, binary=False)} (liveness)\n"
                f"  overhead {self.overhead:.6g} cost units = "
                f"{100 * (self.overhead_fraction or 0.0):.1f}% of one forward "
                f"(cost model {self.cost_model}); solved in {self.solve_time_s:.3f} s")

    def __str__(self) -> str:
        return self.summary()

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_simulated_peak_bytes"] = self.simulated_peak_bytes  # not the graph
        return state


def replace_plan(plan: Plan, **changes: Any) -> Plan:
    """``dataclasses.replace(plan, **changes)`` that leaves a simulated peak
    not read yet unread (``replace`` reads every field, and the liveness
    simulation of a plan of thousands of blocks takes seconds).

    >>> from chainer_recompute.core.graph import Graph
    >>> p = make_plan(Graph.from_edges([1, 1], [(0, 1)]), [{0, 1}], solver='exact',
    ...               strategy='tc', budget_bytes=None)
    >>> q = replace_plan(p, budget_bytes=8)
    >>> isinstance(q.__dict__['_simulated_peak_bytes'], _SimulatedPeak), q.budget_bytes
    (True, 8)
    """
    kw = {}
    for f in dataclasses.fields(plan):
        if f.name in changes:
            kw[f.name] = changes.pop(f.name)
        elif f.name == "simulated_peak_bytes":  # as stored: maybe not simulated yet
            kw[f.name] = plan.__dict__["_simulated_peak_bytes"]
        else:
            kw[f.name] = getattr(plan, f.name)
    if changes:
        raise TypeError(f"Plan has no field {sorted(changes)[0]!r}")
    return Plan(**kw)


def recost_plan(plan: Plan, graph: Graph) -> Plan:
    """``plan``, made for a graph with the same nodes, sizes and wiring as
    ``graph`` but other costs (its :meth:`~Graph.without_times`), as a plan
    of ``graph``: its overhead under ``graph``'s costs, its cost model, and
    its liveness simulation (if not run yet) on ``graph``, so that the plan
    keeps no reference to the other graph.

    >>> from chainer_recompute.core.graph import Graph
    >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)], costs=[0.5, 2.0, 1.0])
    >>> p = make_plan(g.without_times(), [{0}, {0, 1, 2}], solver='approx', strategy='tc',
    ...               budget_bytes=None)
    >>> q = recost_plan(p, g)
    >>> (p.cost_model, p.overhead), (q.cost_model, q.overhead, q.overhead_fraction)
    (('flops', 4.0), ('measured', 3.0, 0.8571428571428571))
    """
    dropped = np.zeros(graph.n, dtype=bool)
    if plan.recompute:
        dropped[:] = True
        dropped[list(plan.kept)] = False
    overhead = float(graph.node_cost[dropped].sum())
    total = float(graph.node_cost.sum())
    sim = plan.__dict__["_simulated_peak_bytes"]
    if isinstance(sim, _SimulatedPeak):
        sim = _SimulatedPeak(graph, sim.masks, sim.recompute)
    return replace_plan(plan, overhead=overhead if plan.overhead is not None else None,
                        overhead_fraction=(overhead / total if total > 0 else 0.0)
                        if plan.overhead is not None else None,
                        cost_model=graph.cost_model, simulated_peak_bytes=sim)


def make_plan(graph: Graph, lower_sets: Optional[Sequence], *, solver: str, strategy: str,
              budget_bytes: Optional[int], solve_time_s: float = 0.0,
              recompute: bool = True, info: Optional[Dict[str, Any]] = None,
              model: Optional["MemoryModel"] = None,
              cost: Optional[StrategyCost] = None,
              blocks: Optional[Sequence[Sequence[int]]] = None) -> Plan:
    """Evaluate a strategy (memory model and simulator) and wrap it in a Plan.

    ``predicted_peak_bytes`` is the peak under ``model`` (the paper's when
    ``None``; ``info['memory_scope']`` records the model's scope) and
    ``feasible`` is ``predicted_peak_bytes <= budget_bytes`` (always True
    without a budget). ``cost``: the strategy's
    :func:`~chainer_recompute.core.schedule.strategy_cost` under ``model``
    when the caller has it already (the DPs compute it from their family).
    The liveness simulation (``simulated_peak_bytes``) runs when that field
    is first read. ``blocks``: the chain's blocks, when the caller has them;
    the plan then holds its lower sets as a :class:`BlockChain` (memory
    linear in the nodes, for chains of thousands of blocks), and with
    ``cost`` given ``lower_sets`` may be ``None``.

    >>> from chainer_recompute.core.graph import Graph
    >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)])
    >>> make_plan(g, [{0}, {0, 1, 2}], solver='chen', strategy='tc', budget_bytes=10).feasible
    True
    """
    if blocks is not None and cost is not None:
        masks: Any = _MasksOf(blocks)  # made only if the simulation runs
    else:
        masks = _chain_masks(lower_sets)
    if cost is None:
        cost = strategy_cost(graph, masks, model)
    total = float(graph.node_cost.sum())
    overhead = cost.overhead if recompute else 0.0
    feasible = budget_bytes is None or cost.peak_bytes <= budget_bytes
    chain = chain_sets(masks) if blocks is None else BlockChain(blocks)
    return Plan(solver=solver, strategy=strategy, budget_bytes=budget_bytes, feasible=feasible,
                lower_sets=chain, predicted_peak_bytes=int(cost.peak_bytes),
                simulated_peak_bytes=_SimulatedPeak(graph, masks, recompute),  # type: ignore
                overhead=overhead,
                overhead_fraction=overhead / total if total > 0 else 0.0,
                n_blocks=len(masks), solve_time_s=solve_time_s, cost_model=graph.cost_model,
                checkpoint_sets=tuple(frozenset(_bits_of(u)) for u in cost.checkpoints)
                if recompute else chain[:1],
                recompute=recompute, info=_info(info, model))


class _MasksOf:
    """The bitsets of the chain of lower sets of ``blocks``, made when
    first iterated (for the liveness simulation, which most plans never
    run: thousands of n-bit integers otherwise)."""

    def __init__(self, blocks: Sequence[Sequence[int]]) -> None:
        self.blocks = [tuple(b) for b in blocks]

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self):
        acc = 0
        for b in self.blocks:
            acc |= set_to_mask(b)
            yield acc


def _chain_masks(lower_sets: Sequence[Any]) -> List[int]:
    """The bitsets of a chain of lower sets (sets or bitsets), each set
    that holds the previous one made from it and the nodes it adds (on a
    graph of 15,000 nodes, a chain of a hundred sets in milliseconds, not
    a second)."""
    out: List[int] = []
    prev: Any = None
    for L in lower_sets:
        if isinstance(L, int):
            m = L
        else:
            new = L - prev if isinstance(L, _AbstractSet) and prev is not None else None
            m = (out[-1] | set_to_mask(new) if new is not None
                 and len(new) == len(L) - len(prev) else set_to_mask(L))
        out.append(m)
        prev = L if isinstance(L, _AbstractSet) else None
    return out


def _bits_of(mask: int) -> list:
    """The set bits of a non-negative int, increasing."""
    if mask.bit_length() > 4096:  # (one pass, not a copy of the int per bit)
        return mask_bits(mask)
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def chain_sets(masks: Sequence[int]) -> Tuple[NodeSet, ...]:
    """A chain of bitsets L_1 ⊊ ... ⊊ L_k as frozensets (each built from
    the previous one and its block).

    >>> [sorted(s) for s in chain_sets([1, 7])]
    [[0], [0, 1, 2]]
    """
    out = []
    prev: NodeSet = frozenset()
    prev_m = 0
    for m in masks:
        if m < 0:
            raise ValueError("a bitset is a non-negative int")
        prev = prev.union(_bits_of(m & ~prev_m)) if prev_m & ~m == 0 else \
            frozenset(_bits_of(m))
        prev_m = m
        out.append(prev)
    return tuple(out)


def _info(info: Optional[Dict[str, Any]], model: Optional["MemoryModel"]) -> Dict[str, Any]:
    out = dict(info or {})
    out["memory_scope"] = "activations" if model is None else model.scope
    return out


def infeasible_plan(graph: Graph, *, solver: str, strategy: str, budget_bytes: Optional[int],
                    solve_time_s: float = 0.0, info: Optional[Dict[str, Any]] = None,
                    model: Optional["MemoryModel"] = None) -> Plan:
    """A Plan that says no strategy fits ``budget_bytes``.

    >>> from chainer_recompute.core.graph import Graph
    >>> infeasible_plan(Graph.from_edges([1], []), solver='exact', strategy='tc',
    ...                 budget_bytes=1).feasible
    False
    """
    return Plan(solver=solver, strategy=strategy, budget_bytes=budget_bytes, feasible=False,
                lower_sets=(), predicted_peak_bytes=None, simulated_peak_bytes=None,
                overhead=None, overhead_fraction=None, n_blocks=0, solve_time_s=solve_time_s,
                cost_model=graph.cost_model, info=_info(info, model))
