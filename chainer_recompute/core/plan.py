"""The immutable result of a solver: a :class:`Plan`.

Pure core: numpy only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, Optional, Sequence, Tuple

from .graph import Graph
from .lower_sets import mask_to_set, set_to_mask
from .schedule import build_schedule, simulate, strategy_cost
from .units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .memory_model import MemoryModel

logger = logging.getLogger(__name__)

__all__ = ["Plan", "make_plan", "infeasible_plan"]

NodeSet = FrozenSet[int]


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
            solved with (the paper's by default, PAPER.md §3;
            ``info['memory_scope']`` names its scope); ``None`` when
            infeasible.
        simulated_peak_bytes: peak of the canonical schedule with liveness
            (:func:`~chainer_recompute.core.schedule.simulate`).
        overhead: extra forward cost Σ T(V_i \\ U_i), in cost units.
        overhead_fraction: ``overhead / T(V)`` (a fraction of one forward).
        n_blocks: k.
        solve_time_s: wall time of the solver.
        cost_model: the graph's cost model.
        checkpoint_sets: U_i per block.
        recompute: False for vanilla (nothing dropped, nothing recomputed).
        info: solver-specific extras (lower-set count, DP states, ...).

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
    simulated_peak_bytes: Optional[int]
    overhead: Optional[float]
    overhead_fraction: Optional[float]
    n_blocks: int
    solve_time_s: float
    cost_model: str
    checkpoint_sets: Tuple[NodeSet, ...] = ()
    recompute: bool = True
    info: Dict[str, Any] = field(default_factory=dict, compare=False)

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
        return (f"Plan[{self.solver}/{self.strategy}] budget {budget}: {self.n_blocks} blocks, "
                f"keeps {len(self.kept)} of {len(self.lower_sets[-1])} nodes\n"
                f"  predicted peak {format_bytes(self.predicted_peak_bytes, binary=False)} "
                f"(paper model), simulated peak "
                f"{format_bytes(self.simulated_peak_bytes, binary=False)} (liveness)\n"
                f"  overhead {self.overhead:.6g} cost units = "
                f"{100 * (self.overhead_fraction or 0.0):.1f}% of one forward "
                f"(cost model {self.cost_model}); solved in {self.solve_time_s:.3f} s")

    def __str__(self) -> str:
        return self.summary()


def make_plan(graph: Graph, lower_sets: Sequence, *, solver: str, strategy: str,
              budget_bytes: Optional[int], solve_time_s: float = 0.0,
              recompute: bool = True, info: Optional[Dict[str, Any]] = None,
              model: Optional["MemoryModel"] = None) -> Plan:
    """Evaluate a strategy (memory model and simulator) and wrap it in a Plan.

    ``predicted_peak_bytes`` is the peak under ``model`` (the paper's when
    ``None``; ``info['memory_scope']`` records the model's scope) and
    ``feasible`` is ``predicted_peak_bytes <= budget_bytes`` (always True
    without a budget).

    >>> from chainer_recompute.core.graph import Graph
    >>> g = Graph.from_edges([1, 1, 1], [(0, 1), (1, 2)])
    >>> make_plan(g, [{0}, {0, 1, 2}], solver='chen', strategy='tc', budget_bytes=10).feasible
    True
    """
    masks = [m if isinstance(m, int) else set_to_mask(m) for m in lower_sets]
    cost = strategy_cost(graph, masks, model)
    sim = simulate(graph, build_schedule(graph, masks, recompute=recompute))
    total = float(graph.node_cost.sum())
    overhead = cost.overhead if recompute else 0.0
    feasible = budget_bytes is None or cost.peak_bytes <= budget_bytes
    return Plan(solver=solver, strategy=strategy, budget_bytes=budget_bytes, feasible=feasible,
                lower_sets=tuple(mask_to_set(m) for m in masks),
                predicted_peak_bytes=int(cost.peak_bytes),
                simulated_peak_bytes=int(sim.peak_bytes), overhead=overhead,
                overhead_fraction=overhead / total if total > 0 else 0.0,
                n_blocks=len(masks), solve_time_s=solve_time_s, cost_model=graph.cost_model,
                checkpoint_sets=tuple(mask_to_set(u) for u in cost.checkpoints)
                if recompute else tuple(mask_to_set(m) for m in masks[:1]),
                recompute=recompute, info=_info(info, model))


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
