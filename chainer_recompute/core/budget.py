"""Planning for a budget the allocator will hold: ``budget_scope='total'``.

Pure core: numpy only.

Two scopes:

- ``'activations'``: the paper's model (docs/paper.md §3): the budget bounds the
  per-block formula over activations and their gradients; parameters,
  gradients, optimizer state and temporaries come on top. This is what the
  authors' solver does, kept to reproduce their tables and for graphs that
  record nothing else (their text format).
- ``'total'`` (the default of ``apply()`` and the CLI): the budget bounds
  the whole iteration as the allocator sees it: parameters, their
  gradients, optimizer state, inputs, activations, gradients and the
  functions' temporary buffers. The DPs optimise the per-block formula
  with the measured terms (:func:`~chainer_recompute.core.memory_model.measured_model`);
  each candidate plan's real peak is predicted by replaying the iteration
  event by event (:func:`~chainer_recompute.core.replay.replay`), and the
  DPs' own budget is searched until the replayed peak fits the user's.
  Plain backpropagation is a candidate too (it needs no recomputation), so
  the least feasible budget is never above what plain Chainer needs
  (its replayed peak with the same :data:`MARGIN`), and the least plan's
  replayed peak never above plain Chainer's.

The least feasible budget is a function of the graph's sizes and structure
(and the solver's options), never of its measured times: the plans it is
the least peak of are those of the graph without times
(:meth:`~chainer_recompute.core.graph.Graph.without_times`), so that two
recordings of one model, whose times differ, give the same figure, and the
figure an error message offers is accepted in the next process. A plan for
a byte budget is the solver's under the graph's own (measured) costs.
"""
from __future__ import annotations

import logging
import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from .backward_order import in_order, reordered
from .errors import BudgetError, InfeasibleBudgetError
from .execution import ExecutionPlan, facts_of
from .graph import Graph
from .lower_sets import DEFAULT_MAX_LOWER_SETS, LowerSetFamily
from .memory_model import SCOPES, MemoryModel, measured_model
from .plan import Plan, recost_plan, replace_plan
from .planner import solve
from .replay import replay, replay_peak, step_calls
from .search import least_feasible_budget
from .solvers import check_solver, resolve_solver, solve_none
from .budget_spec import Budget, parse_budget
from .units import format_bytes, format_bytes_up

logger = logging.getLogger(__name__)

__all__ = ["BudgetSearch", "TradeoffPoint", "plan_for_budget", "check_scope",
           "least_total_budget", "pareto_front", "plain_need_bytes", "resolve_budget"]

#: Relative precision of the search over the DPs' own budget.
SEARCH_TOL = 0.005
#: Headroom kept below a total budget for what the replay does not see
#: (small arrays of the loss, allocator rounding): a plan's replayed peak
#: stays under ``budget * (1 - MARGIN)``, and the least feasible budget is
#: the least replayed peak divided by ``1 - MARGIN``.
MARGIN = 0.01


def limit_of(budget_bytes: int) -> int:
    """The largest replayed peak a budget accepts: ``budget * (1 -
    MARGIN)``, rounded down, in integers (a float product can fall one
    byte short, so that the least figure pasted back was refused).

    >>> limit_of(100), least_for(99), limit_of(least_for(99))
    (99, 100, 99)
    """
    num, den = _margin()
    return int(budget_bytes) * (den - num) // den


def least_for(peak_bytes: int) -> int:
    """The least budget whose :func:`limit_of` is at least ``peak_bytes``."""
    num, den = _margin()
    return -(-int(peak_bytes) * den // (den - num))


def _margin() -> Tuple[int, int]:
    from fractions import Fraction
    f = Fraction(MARGIN).limit_denominator(1 << 20)
    return f.numerator, f.denominator
#: Steps of the grid of DP budgets over which the ``mc`` DP's plans are
#: tried for the least replayed peak, and points tried between the best
#: one's neighbours (see :meth:`BudgetSearch.candidates`).
GRID_STEPS = 24
REFINE_STEPS = 4
#: The same for the hierarchical DP, whose graphs are large (each
#: candidate is replayed, linear in the graph).
HIER_GRID_STEPS = 8
HIER_REFINE_STEPS = 2


def check_scope(scope: str) -> None:
    """Raise :class:`BudgetError` for an unknown budget scope."""
    if scope not in SCOPES:
        raise BudgetError(f"unknown budget_scope {scope!r}; accepted: {list(SCOPES)} "
                          f"('total': everything the device holds in an iteration; "
                          f"'activations': the paper's model)")


class _Tries:
    """The solver's plans of one graph at the DPs' own budgets (cached),
    with their replayed peaks, and the candidates for the least peak
    (:meth:`BudgetSearch.candidates`). A :class:`BudgetSearch` has one
    for its graph's own costs (the plans for byte budgets) and one for its
    graph without times (the least feasible budget).

    Holds no reference to its search (a cycle would keep the DPs' arrays
    alive until the cyclic garbage collector runs).
    """

    def __init__(self, graph: Graph, replay_graph: Graph, solver: str, strategy: str,
                 model: MemoryModel, dp_least: int, family: Optional[LowerSetFamily],
                 problem: Any, options: Dict[str, Any]) -> None:
        self.graph, self.replay_graph = graph, replay_graph
        self.solver, self.strategy, self.model = solver, strategy, model
        self.dp_least, self.family, self.problem, self.options = dp_least, family, problem, options
        self._cache: Dict[Tuple[str, int], Tuple[Plan, Optional[int]]] = {}
        self._candidates: Optional[List[Tuple[Plan, int]]] = None

    def at(self, dp_budget: int, strategy: Optional[str] = None
           ) -> Tuple[Optional[Plan], Optional[int]]:
        """See :meth:`BudgetSearch.at`."""
        key = (strategy or self.strategy, int(dp_budget))
        hit = self._cache.get(key)
        if hit is None:
            extra: Dict[str, Any] = {}
            if self.family is not None:
                extra["family"] = self.family
            if self.problem is not None:
                extra["problem"] = self.problem
            plan = solve(self.graph, key[1], solver=self.solver, strategy=key[0],
                         raise_infeasible=False, model=self.model, **extra, **self.options)
            hit = (plan, peak_of(self.replay_graph, plan) if plan.feasible else None)
            self._cache[key] = hit
        plan, peak = hit
        return (plan, peak) if plan.feasible else (None, None)

    def grid(self, k: int = 6) -> List[int]:
        """``k + 1`` DP budgets from the DPs' least to plain backprop's,
        geometric."""
        lo = self.dp_least
        hi = max(lo + 1, self.dp_vanilla())
        return sorted({int(lo * (hi / lo) ** (j / k)) if lo > 0 else lo + (hi - lo) * j // k
                       for j in range(k + 1)})

    def dp_vanilla(self) -> int:
        m = self.model
        return int(m.constant_bytes + m.block_bytes.sum() + m.transient_bytes.max())

    def candidates(self, vanilla: Tuple[Plan, int]) -> List[Tuple[Plan, int]]:
        """``vanilla``, this strategy's DP plans over :meth:`grid`, and the
        ``mc`` DP's over a finer grid, refined between the neighbours of
        its best point (see :meth:`BudgetSearch.candidates`)."""
        if self._candidates is not None:
            return self._candidates
        coarse = []
        if self.family is not None or self.solver == "hier":
            # solved first: the hierarchical DP bounds its tc tables of
            # larger budgets by the chains it found (they come out the same)
            hier = self.solver == "hier"
            grid = self.grid(HIER_GRID_STEPS if hier else GRID_STEPS)
            peaks = []
            for b in grid:
                plan, peak = self.at(b, "mc")
                coarse.append((plan, peak))
                peaks.append(math.inf if peak is None else peak)
            i = min(range(len(grid)), key=peaks.__getitem__)
            lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
            refine = HIER_REFINE_STEPS if hier else REFINE_STEPS
            for j in range(1, refine + 1):
                coarse.append(self.at(lo + (hi - lo) * j // (refine + 1), "mc"))
        out = [vanilla] + [self.at(b) for b in self.grid()] + coarse
        self._candidates = [(plan, peak) for plan, peak in out
                            if plan is not None and peak is not None]
        return self._candidates


@dataclass(frozen=True)
class TradeoffPoint:
    """One plan on the trade-off between memory and recomputation
    (:meth:`BudgetSearch.tradeoff`).

    Attributes:
        budget_bytes: the least budget the plan fits (its peak, with
            :data:`MARGIN` of headroom in the total scope).
        peak_bytes: its predicted peak (replayed, in the total scope).
        overhead_fraction: its extra forward work, a fraction of one
            forward (0 for plain backprop).
        n_blocks: its blocks.
        recompute: False for plain backprop.
    """

    budget_bytes: int
    peak_bytes: int
    overhead_fraction: float
    n_blocks: int
    recompute: bool


def pareto_front(points: List[TradeoffPoint]) -> List[TradeoffPoint]:
    """The points no other beats on both budget and overhead, by budget
    (ascending; their overheads then descend): the least overhead each
    budget can have among ``points``.

    >>> p = lambda b, o: TradeoffPoint(b, b, o, 1, o > 0)
    >>> [(q.budget_bytes, q.overhead_fraction) for q in pareto_front(
    ...     [p(10, 0.0), p(4, 0.5), p(6, 0.6), p(7, 0.2), p(4, 0.9)])]
    [(4, 0.5), (7, 0.2), (10, 0.0)]
    """
    out: List[TradeoffPoint] = []
    for q in sorted(points, key=lambda q: (q.budget_bytes, q.overhead_fraction)):
        if not out or q.overhead_fraction < out[-1].overhead_fraction:
            out.append(q)
    return out


class BudgetSearch:
    """Plans of one graph for budgets on the total peak (see module doc).

    Args:
        graph: a recorded graph (with measured transients and lifetimes).
        solver, strategy: as in :func:`~chainer_recompute.core.planner.solve`.
        **solver_options: passed to the solver.

    Plans are cached by the DPs' budget, so that several budgets (and the
    least feasible one) share the work.

    The least feasible budget depends on the graph's sizes and structure
    only, never on its measured times (two recordings of one model give
    other times, and the figure an error message offers must be accepted
    in the next process): its candidates are planned on
    :meth:`~Graph.without_times` (the DPs minimise time under a memory
    bound, so their plans, and the replayed peaks of those plans, follow the
    costs). A plan for a byte budget is the solver's under the graph's own
    costs, as is every plan's overhead.
    """

    def __init__(self, graph: Graph, solver: str = "auto", strategy: str = "tc",
                 nested: Optional[bool] = None, **solver_options: Any) -> None:
        check_solver(solver, strategy)
        #: plan nested (two levels or more) for budgets below the single-level least
        #: (default: with ``solver='auto'``)
        self.nested = solver == "auto" if nested is None else bool(nested)
        self._nested_search: Optional[Any] = None
        self._reordered: Any = None  # the search in another backward order (False: none)
        self._given = (solver, strategy, solver_options)
        self.model: MemoryModel = measured_model(graph)
        solver = resolve_solver(solver, graph, self.model)
        self.graph, self.solver, self.strategy = graph, solver, strategy
        # The lower sets with the model's quantities, built once for every
        # budget tried (the DPs accept a prepared family).
        self.family: Optional[LowerSetFamily] = None
        if solver == "approx":
            self.family = LowerSetFamily.ancestor_closures(graph, self.model)
        elif solver == "exact":
            self.family = LowerSetFamily.all(
                graph, solver_options.get("max_lower_sets", DEFAULT_MAX_LOWER_SETS), self.model)
        # the hierarchical DP's positions and options, made once
        self.problem = None
        if solver == "hier":
            from .solvers.hier_dp import hier_problem
            self.problem = hier_problem(graph, self.model)
        if self.problem is not None and self.problem.ok:
            self.dp_least = self.problem.least_budget()
        else:  # (the DPs' feasibility does not depend on costs)
            self.dp_least = least_feasible_budget(
                graph, solver=solver if self.family is not None else "approx",
                strategy=strategy, model=self.model, family=self.family)
        self.options = {k: v for k, v in solver_options.items() if k != "max_lower_sets"} \
            if self.family is not None else solver_options
        self._vanilla: Optional[Tuple[Plan, int]] = None
        self._least: Optional[Tuple[Plan, int]] = None
        self._least_candidates: Optional[List[Tuple[Plan, int]]] = None
        self._timed = _Tries(graph, graph, solver, strategy, self.model, self.dp_least,
                             self.family, self.problem, self.options)
        self._free: Optional[_Tries] = None

    # ----------------------------------------------------------- pieces
    def peak_of(self, plan: Plan) -> int:
        """The replayed total peak of a plan (:func:`~.replay.replay_peak`:
        what :func:`~.replay.replay` of its :class:`ExecutionPlan` gives)."""
        return peak_of(self.graph, plan)

    def vanilla(self) -> Tuple[Plan, int]:
        """Plain backpropagation and its replayed peak."""
        if self._vanilla is None:
            plan = solve_none(self.graph, None, model=self.model)
            self._vanilla = (plan, replay_peak(self.graph))
        return self._vanilla

    def at(self, dp_budget: int, strategy: Optional[str] = None
           ) -> Tuple[Optional[Plan], Optional[int]]:
        """The solver's plan for the DPs' budget ``dp_budget`` (with
        ``strategy``, default this search's) under the graph's own costs,
        and its replayed peak (``None, None`` when the DP finds nothing)."""
        return self._timed.at(dp_budget, strategy)

    def _grid(self, k: int = 6) -> List[int]:
        """``k + 1`` DP budgets from the DPs' least to plain backprop's,
        geometric."""
        return self._timed.grid(k)

    def _dp_vanilla(self) -> int:
        return self._timed.dp_vanilla()

    def _time_free(self) -> _Tries:
        """The plans of the graph without times (made when first asked)."""
        if self._free is None:
            g = self.graph.without_times()
            if g is self.graph:
                self._free = self._timed
            else:
                self._free = _Tries(
                    g, self.graph, self.solver, self.strategy, self.model, self.dp_least,
                    None if self.family is None else self.family.with_costs(g),
                    None if self.problem is None else self.problem.with_costs(g, time_free=True),
                    self.options)
        return self._free

    def _own_costs(self, plan: Plan) -> Plan:
        """``plan`` (of the graph without times) as a plan of this search's
        graph: its overhead under the graph's own costs, no reference to the
        other graph (a plan the runner keeps would keep that graph's arrays
        alive through every budgeted step)."""
        if plan.cost_model == self.graph.cost_model:
            return plan
        return self.vanilla()[0] if not plan.recompute else recost_plan(plan, self.graph)

    def candidates(self) -> List[Tuple[Plan, int]]:
        """The plans the least feasible budget is the least peak of, with
        their replayed peaks: plain backprop, this strategy's DP plans over
        :meth:`_grid`, and the ``mc`` DP's over a finer grid, refined
        between the neighbours of its best point, all of the graph without
        times (:meth:`~Graph.without_times`; their overheads under the
        graph's own costs). The replayed peak is not monotone in the DPs'
        budget (the per-block formula over-counts some plans much more
        than others), and ``mc`` plans, cheap to find, reach lower peaks
        than ``tc`` ones whose formula is the same."""
        if self._least_candidates is None:
            self._least_candidates = [
                (self._own_costs(plan), peak)
                for plan, peak in self._time_free().candidates(self.vanilla())]
        return self._least_candidates

    # ---------------------------------------------------------- answers
    def least(self) -> Tuple[Plan, int]:
        """The plan with the least replayed peak among :meth:`candidates`
        (the least overhead among equal peaks), and that peak: the least
        feasible total budget, a function of the graph's sizes and
        structure (not of its times)."""
        if self._least is None:
            self._least = min(self.candidates(), key=lambda c: (c[1], c[0].overhead))
        return self._least

    def _tc_fits(self, limit: int) -> Dict[int, Tuple[Plan, int]]:
        """The DPs' budgets tried whose plan (this strategy's, the graph's
        own costs) replays at or under ``limit``, with those plans: the
        largest such budget is searched (the DPs' formula is not the
        replay's, but their peak is monotone in practice), then every
        budget of :meth:`_grid` is tried if none was found."""
        ok: Dict[int, Tuple[Plan, int]] = {}

        def fits(b: int) -> bool:
            plan, peak = self.at(b)
            if plan is not None and peak is not None and peak <= limit:
                ok[b] = (plan, peak)
                return True
            return False

        lo, hi = self.dp_least - 1, self._dp_vanilla()
        if fits(hi):
            lo = hi
        else:
            start = min(max(limit, self.dp_least), hi)
            if fits(start):
                lo = start
            else:
                hi = start
            while hi - lo > max(1, int(SEARCH_TOL * hi)):
                mid = (lo + hi) // 2
                if fits(mid):
                    lo = mid
                else:
                    hi = mid
        if not ok:
            for b in self._grid():
                fits(b)
        return ok

    def fit(self, budget_bytes: int, label: Optional[str] = None) -> Plan:
        """The plan for a total budget: the least overhead (tc) or the
        coarsest (mc) whose replayed peak fits (with :data:`MARGIN`);
        ``label``: the budget as an error message names it (default: its
        size).

        Raises:
            InfeasibleBudgetError: no candidate fits; the message gives the
                least feasible total budget, rounded up.
        """
        t0 = time.perf_counter()
        limit = limit_of(budget_bytes)
        van_plan, van_peak = self.vanilla()
        if self.strategy == "tc" and van_peak <= limit:
            return self._annotate(van_plan, van_peak, budget_bytes, None, t0)
        ok = self._tc_fits(limit)
        if ok:
            b = max(ok)
            plan, peak = ok[b]
            return self._annotate(plan, peak, budget_bytes, b, t0)
        # another strategy's plan, or a refined one (of the graph's own costs
        # or without times: the least budget's plan fits its figure)
        fitting = [c for c in self._timed.candidates(self.vanilla()) + self.candidates()
                   if c[1] <= limit and c[0].recompute]
        if fitting:
            plan, peak = min(fitting, key=lambda c: (c[0].overhead, c[1]) if
                             self.strategy == "tc" else (c[1], c[0].overhead))
            return self._annotate(plan, peak, budget_bytes, None, t0)
        if van_peak <= limit:  # mc with nothing coarser that fits
            return self._annotate(van_plan, van_peak, budget_bytes, None, t0)
        single = self.least_budget()
        nested = self.nested_least() if self.nested else None
        if nested is not None:
            got = self._below_fit(limit)
            if got is not None:
                return self._annotate(got[0], got[1], budget_bytes, None, t0)
        least = single if nested is None else least_for(nested[1])
        how = ("" if nested is None else
               f" with {_kind(nested[0])}, which recomputes "
               f"{100 * (nested[0].overhead_fraction or 0):.0f}% of a forward (single-level "
               f"recomputation needs {format_bytes_up(single)})")
        k = step_calls(self.graph)
        calls = f", {k} calls of the model a step" if k > 1 else ""
        raise InfeasibleBudgetError(
            f"budget {label or format_bytes(budget_bytes)} is below the least feasible "
            f"{format_bytes_up(least)}{how} for this model and batch{calls} (the whole iteration: "
            f"parameters, gradients, optimizer state, activations and temporaries; plain "
            f"Chainer needs {format_bytes_up(least_for(van_peak))}); raise the budget to at "
            f"least {format_bytes_up(least)}, use budget='least', or reduce the batch size",
            budget_bytes=budget_bytes, least_feasible_bytes=least,
            vanilla_bytes=least_for(van_peak))

    def nested_search(self) -> Any:
        """The :class:`~chainer_recompute.core.nested.NestedSearch` of this
        graph, from the least budget's :meth:`candidates` (made when first
        asked)."""
        if self._nested_search is None:
            from .nested import NestedSearch
            self._nested_search = NestedSearch(self.graph, self.candidates(), self.model)
        return self._nested_search

    def reordered_search(self) -> Optional["BudgetSearch"]:
        """The search of this graph in another backward order with the same
        gradients (:func:`~.backward_order.reordered`), where the recorded
        backward allows one; its plans carry the order. Made when first
        asked."""
        if self._reordered is None:
            g = reordered(self.graph)
            solver, strategy, options = self._given
            self._reordered = False if g is None else BudgetSearch(
                g, solver, strategy, nested=True, **options)
        return self._reordered or None

    def _below(self) -> List[Tuple[Plan, int]]:
        """The plans below the single-level least are searched among: the
        nested search's, and in the other backward order the single-level
        and nested ones (those that recompute)."""
        out = list(self.nested_search().candidates())
        other = self.reordered_search()
        if other is not None:
            out += other._in_its_order(other.candidates() + other.nested_search().candidates())
        return out

    def _in_its_order(self, plans: List[Tuple[Plan, int]]) -> List[Tuple[Plan, int]]:
        """Those of ``plans`` that recompute, carrying this search's graph's
        backward order (a :meth:`reordered_search`'s plans, for its parent)."""
        return [(replace_plan(p, backward_order=self.graph.backward_order), peak)
                for p, peak in plans if p.recompute]

    def _below_fit(self, limit: int) -> Optional[Tuple[Plan, int]]:
        """The plan of least overhead (then peak) that replays at or under
        ``limit`` among :meth:`_below` and, in the other backward order,
        the plans of least overhead that fit (:meth:`_tc_fits`)."""
        fitting = [c for c in self._below() if c[1] <= limit]
        other = self.reordered_search()
        if other is not None:  # (and its least overhead that fits, as fit() searches it)
            fitting += other._in_its_order(list(other._tc_fits(limit).values()))
        return min(fitting, key=lambda c: (c[0].overhead, c[1])) if fitting else None

    def nested_least(self) -> Optional[Tuple[Plan, int]]:
        """The plan of :meth:`_below` of least replayed peak (nested, or in
        another backward order) and that peak, when it is below the
        single-level least's (else ``None``)."""
        below = self._below()
        got = min(below, key=lambda c: (c[1], c[0].overhead)) if below else None
        if got is None or got[1] >= self.least()[1]:
            return None
        return got

    def _annotate(self, plan: Plan, peak: int, budget_bytes: Optional[int],
                  dp_budget: Optional[int], t0: float) -> Plan:
        info = dict(plan.info)
        info.update(memory_scope="total", dp_budget_bytes=dp_budget,
                    dp_peak_bytes=plan.predicted_peak_bytes,
                    vanilla_peak_bytes=self.vanilla()[1], search_time_s=time.perf_counter() - t0)
        return replace_plan(plan, predicted_peak_bytes=int(peak),
                                   budget_bytes=budget_bytes, feasible=True, info=info)

    def least_budget(self) -> int:
        """The least feasible total budget: the least replayed peak with
        :data:`MARGIN` of headroom (a function of the graph's sizes and
        structure, see :meth:`least`)."""
        return least_for(self.least()[1])

    def tradeoff(self, extra_budgets: int = 0, time_limit_s: float = 10.0
                 ) -> Tuple[List[TradeoffPoint], int]:
        """The budget against the recompute overhead, from plain backprop
        down to the least feasible budget, from the plans this search has
        made: plain backprop, the least budget's :meth:`candidates` and the
        plans tried for byte budgets (:meth:`fit`, :meth:`least_plan`).

        Args:
            extra_budgets: plan this strategy first at up to this many
                more DP budgets (:meth:`_grid`, geometric from the DPs'
                least to plain backprop's; cached, so none is solved twice),
                to fill the curve between budgets already tried.
            time_limit_s: stop those extra plans after this long.

        Returns:
            ``(front, tried)``: :func:`pareto_front` of the plans (the
            least overhead each budget can have among them), by budget, and
            how many distinct plans it was chosen from.

        >>> g = Graph.from_edges([4, 4, 4, 4], [(0, 1), (1, 2), (2, 3)])
        >>> s = BudgetSearch(g, 'exact')
        >>> front, tried = s.tradeoff()
        >>> front[0].budget_bytes == s.least_budget(), front[-1].recompute
        (True, False)
        """
        if extra_budgets > 0:
            t0 = time.perf_counter()
            for b in self._grid(extra_budgets):
                if time.perf_counter() - t0 > time_limit_s:
                    break
                self.at(b)
        points: Dict[Tuple[int, float, int], TradeoffPoint] = {}
        for plan, peak in self.tried():
            over = float(plan.overhead_fraction or 0.0) if plan.recompute else 0.0
            point = TradeoffPoint(least_for(peak), int(peak), over,
                                  int(plan.n_blocks if plan.recompute else 1),
                                  bool(plan.recompute))
            points[(point.peak_bytes, point.overhead_fraction, point.n_blocks)] = point
        return pareto_front(list(points.values())), len(points)

    def tried(self) -> List[Tuple[Plan, int]]:
        """Every plan this search has made, with its replayed peak: plain
        backprop, the least budget's :meth:`candidates` and the plans for
        the DPs' budgets tried (:meth:`at`; :meth:`tradeoff` tries more)."""
        return [self.vanilla()] + list(self.candidates()) + [
            (plan, peak) for plan, peak in self._timed._cache.values()
            if plan.feasible and peak is not None]

    def annotated(self, plan: Plan, peak: int, budget_bytes: Optional[int]) -> Plan:
        """``plan`` (one of :meth:`tried`) as :meth:`fit` gives a plan for
        ``budget_bytes``, predicted at ``peak``."""
        return self._annotate(plan, peak, budget_bytes, None, time.perf_counter())

    def least_plan(self) -> Plan:
        """The plan at the least feasible total budget: with ``tc``, the
        least overhead (under the graph's own costs) among the candidates
        that fit it and the tc plans of the graph's own costs that do (the
        most time retained: :meth:`fit`'s search)."""
        t0 = time.perf_counter()
        plan, peak = self.least()
        budget = self.least_budget()
        if self.strategy == "tc":
            limit = limit_of(budget)
            pool = [c for c in self.candidates() if c[1] <= limit]
            # the measured tc plans that fit, searched only when the one at
            # the DPs' least budget does (their peak grows with the DPs'
            # budget in practice)
            lowest = self.at(self.dp_least)[1]
            if lowest is not None and lowest <= limit:
                pool += list(self._tc_fits(limit).values())
            plan, peak = min(pool, key=lambda c: (c[0].overhead, c[1]))
        return self._annotate(plan, peak, budget, None, t0)


def _kind(plan: Plan) -> str:
    """What a plan below the single-level least does, in words."""
    kind = "nested recomputation" if plan.nested else "recomputation"
    return kind + (" and the backward in another order (the same gradients)"
                   if plan.backward_order else "")


def peak_of(graph: Graph, plan: Plan) -> int:
    """The replayed total peak of ``plan`` on ``graph``
    (:func:`~.replay.replay_peak`: what :func:`~.replay.replay` of its
    :class:`ExecutionPlan` gives); it depends on sizes and lifetimes, not
    on costs."""
    if plan.backward_order:
        graph = in_order(graph, plan.backward_order)
    if not plan.recompute:
        return replay_peak(graph)
    if plan.inner:
        return replay(graph, ExecutionPlan.of(graph, plan)).peak_bytes
    dropped, block_of = plan_arrays(graph, plan)
    return replay_peak(graph, dropped, block_of)


def plan_arrays(graph: Graph, plan: Plan) -> Tuple[np.ndarray, np.ndarray]:
    """A plan's dropped nodes (bool per node) and each node's block, as
    :class:`ExecutionPlan` finds them (in time linear in the graph)."""
    n = graph.n
    block_of = np.full(n, -1, dtype=np.int64)
    blocks = getattr(plan.lower_sets, "blocks", None)
    if blocks is None:
        blocks, prev = [], frozenset()
        for cur in plan.lower_sets:
            blocks.append(cur - prev)
            prev = cur
    for b, nodes in enumerate(blocks):
        block_of[list(nodes)] = b
    if (block_of < 0).any():  # as ExecutionPlan
        return _ep_arrays(graph, plan)
    keep = np.zeros(n, dtype=bool)
    keep[list(plan.kept)] = True
    dropped = _releasable(graph) & ~keep
    return dropped, block_of


def _ep_arrays(graph: Graph, plan: Plan) -> Tuple[np.ndarray, np.ndarray]:
    ep = ExecutionPlan.of(graph, plan)
    dropped = np.zeros(graph.n, dtype=bool)
    dropped[list(ep.dropped)] = True
    return dropped, np.asarray(ep.block_of, dtype=np.int64)


def _releasable(graph: Graph) -> np.ndarray:
    got = _RELEASABLE.get(id(graph))
    if got is not None and got[0]() is graph:
        return got[1]
    mask = np.zeros(graph.n, dtype=bool)
    mask[list(facts_of(graph).releasable)] = True
    _RELEASABLE.clear()  # the last graph's only
    _RELEASABLE[id(graph)] = (weakref.ref(graph), mask)
    return mask


_RELEASABLE: Dict[int, Tuple[Any, np.ndarray]] = {}


def release_caches() -> None:
    """Let go of what the replays and the budget search keep between calls
    for speed (the last graphs' flat arrays, every graph's node bytes and
    costs: NumPy arrays, in the meter of a training step on NumPy). The
    runner calls it once a plan is made, so that nothing of the planner
    stays in memory between training steps; the next search makes them
    again.

    >>> release_caches()
    """
    from . import backward_order
    from .execution import release_facts
    from .graph import let_go_of_arrays
    from .kernels import replay as replay_kernel
    _RELEASABLE.clear()
    release_facts()
    del replay_kernel._CONTEXTS[:]
    backward_order._ORDERED.clear()
    let_go_of_arrays()


def least_total_budget(graph: Graph, solver: str = "auto", strategy: str = "tc",
                       **solver_options: Any) -> int:
    """The least feasible budget of the ``total`` scope, ``apply()``'s
    default: the least replayed total peak (parameters, gradients,
    optimizer state, activations and temporaries) with :data:`MARGIN` of
    headroom, the figure ``plan_for_budget(graph, 'least')`` plans for.

    :func:`~chainer_recompute.core.search.least_feasible_budget` is the
    ``activations`` scope's (the paper's model), lower: a total budget set
    to it is refused.

    Args:
        graph: a recorded graph (with measured transients and lifetimes).
        solver, strategy, **solver_options: as in :func:`plan_for_budget`.

    >>> g = Graph.from_edges([4, 4, 4, 4], [(0, 1), (1, 2), (2, 3)])
    >>> least_total_budget(g, 'exact') >= least_feasible_budget(g, 'exact')
    True
    """
    check_solver(solver, strategy)
    if solver == "none":
        return least_for(BudgetSearch(graph, "approx", strategy).vanilla()[1])
    return BudgetSearch(graph, solver, strategy, **solver_options).least_budget()


def plain_need_bytes(graph: Graph, scope: str = "total") -> int:
    """What plain Chainer needs for ``graph``: in the ``total`` scope its
    replayed peak with :data:`MARGIN` of headroom (the least budget at which
    plain backprop is the plan), in the ``activations`` scope the paper's
    vanilla figure. A ``'60%'`` budget is that share of this figure.

    >>> g = Graph.from_edges([4, 4, 4, 4], [(0, 1), (1, 2), (2, 3)])
    >>> plain_need_bytes(g, 'activations')
    32
    """
    check_scope(scope)
    if scope == "activations":
        from .search import vanilla_bytes
        return int(vanilla_bytes(graph))
    return least_for(replay_peak(graph))


def resolve_budget(graph: Graph, budget: Any, scope: str = "total") -> Budget:
    """``budget`` parsed (:func:`~.budget_spec.parse_budget`), a share
    resolved against :func:`plain_need_bytes` of ``graph``.

    Raises:
        BudgetError: an unreadable budget, or ``'device'`` not yet resolved
            (the core does not know the model's device: ``apply()``,
            ``Recompute`` and the command line resolve it).
    """
    b = parse_budget(budget)
    if b.kind == "share" and b.bytes is None:
        b = b.of_plain(plain_need_bytes(graph, scope))
    if b.kind == "device" and b.bytes is None:
        raise BudgetError("budget 'device' means the memory of the model's device, which a "
                          "graph alone does not know: use it with apply(), Recompute or the "
                          "command line, or give a size such as '8G'")
    return b


def _with_budget(plan: Plan, b: Budget) -> Plan:
    """``plan`` noting what a share or ``'device'`` budget resolved to."""
    if b.kind not in ("share", "device"):
        return plan
    return replace_plan(plan, info=dict(plan.info, budget=b.describe()))


def plan_for_budget(graph: Graph, budget: Any, *, solver: str = "auto",
                    strategy: str = "tc", scope: str = "total",
                    **solver_options: Any) -> Plan:
    """The plan for ``budget`` in a scope.

    Args:
        graph: the graph.
        budget: any form :func:`~.budget_spec.parse_budget` reads (bytes,
            ``'8G'``, ``'least'``: the least feasible budget, ``'60%'``: a
            share of what plain Chainer needs for this graph) or a
            :class:`~.budget_spec.Budget` (``'device'`` resolved).
        solver, strategy: as in :func:`~chainer_recompute.core.planner.solve`.
        scope: ``'total'`` (what the allocator sees; needs a recorded graph)
            or ``'activations'`` (the paper's model).

    Returns:
        A :class:`Plan`; for ``total``, ``predicted_peak_bytes`` is the
        replayed total peak and ``info`` holds the DPs' budget and formula;
        for a share, ``info['budget']`` says what it resolved to.

    Raises:
        BudgetError, UnknownSolverError, InfeasibleBudgetError.

    >>> g = Graph.from_edges([4, 4, 4, 4], [(0, 1), (1, 2), (2, 3)])
    >>> plan_for_budget(g, 'least', solver='exact', scope='activations').predicted_peak_bytes
    20
    >>> plan_for_budget(g, '80%', solver='exact', scope='activations').info['budget']
    "80% of plain Chainer's 32 B = 25 B"
    """
    check_scope(scope)
    check_solver(solver, strategy)
    b = resolve_budget(graph, budget, scope)
    return _with_budget(_plan_for(graph, b, solver, strategy, scope, solver_options), b)


def _plan_for(graph: Graph, b: Budget, solver: str, strategy: str, scope: str,
              solver_options: Dict[str, Any]) -> Plan:
    least = b.is_least
    if scope == "activations":
        nbytes = (least_feasible_budget(graph, solver=solver, strategy=strategy) if least
                  else b.bytes)
        return solve(graph, nbytes, solver=solver, strategy=strategy, **solver_options)
    if solver == "none":
        search = BudgetSearch(graph, "approx", strategy)
        plan, peak = search.vanilla()
        need = least_for(peak)
        nbytes = need if least else int(b.bytes)
        if need > nbytes:
            raise InfeasibleBudgetError(
                f"budget {_label(b)} is below what plain Chainer needs, "
                f"{format_bytes_up(need)}; raise the budget to at least "
                f"{format_bytes_up(need)}", budget_bytes=nbytes, least_feasible_bytes=need,
                vanilla_bytes=need)
        return search._annotate(plan, peak, nbytes, None, time.perf_counter())
    search = BudgetSearch(graph, solver, strategy, **solver_options)
    if least:
        return search.least_plan()
    return search.fit(int(b.bytes), _label(b))


def _label(b: Budget) -> str:
    return b.describe() if b.kind in ("share", "device") else format_bytes(b.bytes)
