"""``apply()`` and :class:`Recompute`: record the real iteration, plan, then
run every training forward under the backward driver.

>>> import chainer_recompute as cr                        # doctest: +SKIP
>>> model = cr.apply(model, budget='8G')                # doctest: +SKIP
>>> loss = model(x, t); loss.backward()                 # doctest: +SKIP

The first training call with a new input signature (shapes, dtypes, device,
train mode, other arguments) runs exactly as plain Chainer would (one
forward, the same random draws, side effects, lazy initialisation and
BatchNorm updates) while its graph is recorded, with the backward that
follows it. The next call with that signature plans (solves for the budget)
and runs under the plan. Every planned iteration is checked against the
plan as it runs (function classes, shapes and the real wiring); an
iteration that stops matching keeps what it has not released, records its
new structure and the next call plans that one too: a signature keeps a few
plans, one per structure. A model whose structure changes on almost every
call falls back to plain Chainer with one warning.

``capture_batch=N`` plans before the first call instead, from a separate
small-batch capture scaled to the real batch, so that the budget holds from
the first step; that capture leaves no trace (random states, persistent
values, lazily created parameters are restored). Evaluation calls
(``chainer.using_config('train', False)``, ``no_backprop_mode``) run the
plain forward.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import weakref
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import numpy

from . import _chainer  # noqa: F401
import chainer
from chainer import backend

from ..core.errors import InfeasibleBudgetError, RecomputeError
from ..core.graph import Graph
from ..core.units import format_bytes, parse_bytes
from .capture import batch_size_of, capture, leave_no_trace, state_bytes
from .executor import IterationHook, IterationStats, Program
from .workspace import bounded

logger = logging.getLogger(__name__)

#: What a user of apply() is told (the first plan, an infeasible budget, a
#: fallback): visible by default on stderr, like the CLI's own output;
#: ``verbose=False`` silences the informational lines. Its records propagate
#: as any library's do: once the application configures logging (a handler
#: on the root logger or on a ``chainer_recompute`` logger), they go there
#: only, and the fallback line on stderr stays silent.
report = logging.getLogger("chainer_recompute.report")


class _FallbackHandler(logging.StreamHandler):
    """Writes the report's lines to the current ``sys.stderr`` only while no
    other handler would receive them (logging left unconfigured)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("chainer_recompute: %(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> Any:  # the stderr of the moment (pytest's capture, a redirect)
        import sys
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        logger_: Optional[logging.Logger] = logging.getLogger(record.name)
        while logger_ is not None:
            if any(h is not self for h in logger_.handlers):
                return  # configured: those handlers have it
            if not logger_.propagate:
                break
            logger_ = logger_.parent  # type: ignore[assignment]
        super().emit(record)


if not any(isinstance(h, _FallbackHandler) or type(h).__name__ == "_FallbackHandler"
           for h in report.handlers):
    report.addHandler(_FallbackHandler())
if report.level == logging.NOTSET:
    report.setLevel(logging.INFO)

_ATTR = "_chainer_recompute"
_local = threading.local()


def _depth() -> int:
    return getattr(_local, "depth", 0)


class _Active:
    """Marks a runner's forward as running (inner runners then pass through)."""

    def __enter__(self) -> None:
        _local.depth = _depth() + 1

    def __exit__(self, *exc: Any) -> None:
        _local.depth = _depth() - 1


def _signature(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Hashable:
    def one(x: Any) -> Hashable:
        if isinstance(x, chainer.Variable):
            x = x.raw_array
        if isinstance(x, chainer.get_array_types()):
            return ("array", tuple(x.shape), str(x.dtype), str(backend.get_device_from_array(x)))
        if isinstance(x, (tuple, list)):
            return (type(x).__name__,) + tuple(one(y) for y in x)
        if isinstance(x, dict):
            return ("dict",) + tuple((k, one(v)) for k, v in sorted(x.items(), key=repr))
        if isinstance(x, (int, float, str, bool, type(None))):
            return ("value", x)
        if isinstance(x, numpy.generic):  # np.float32(lr): by value, not by id
            return ("value", str(x.dtype), x.item())
        if type(x).__hash__ not in (None, object.__hash__):
            try:  # hashable by value (a frozen config, an enum, a tuple-like)
                hash(x)
                return ("value", type(x).__qualname__, x)
            except TypeError:
                pass
        return ("object", type(x).__name__, id(x))

    return (tuple(one(a) for a in args),
            tuple((k, one(v)) for k, v in sorted(kwargs.items())),
            bool(chainer.config.train))


def _solver_keywords(solver: str) -> List[str]:
    """The keyword options ``solver`` takes besides those the runner sets."""
    import inspect
    from ..core.solvers import REGISTRY
    names = {"max_lower_sets"}  # read by the budget search itself
    for name in (("approx", "hier") if solver == "auto" else (solver,)):
        for p in inspect.signature(REGISTRY[name]).parameters.values():
            if p.kind is p.KEYWORD_ONLY:
                names.add(p.name)
    return sorted(names - {"strategy", "model"})


def _check_solver_options(solver: str, options: Dict[str, Any]) -> None:
    """Refuse, at once, a keyword that neither the runner nor the solver
    takes (else a TypeError from inside the solver at the first plan)."""
    import inspect
    known = _solver_keywords(solver)
    runner = [p.name for p in inspect.signature(Recompute.__init__).parameters.values()
              if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise RecomputeError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"apply() and Recompute take {', '.join(runner)}, and solver {solver!r} "
            f"takes {', '.join(known)}")


def _family(sig: Hashable) -> Tuple[Hashable, Tuple[int, ...]]:
    """A signature without its arrays' shapes (their ranks kept) and its
    numbers' values (their types kept), and those shapes' dimensions in
    order: signatures of one family differ in shapes and numbers only (a
    batch padded to its longest molecule, a last partial batch, a schedule
    value)."""
    dims: List[int] = []

    def walk(x: Any) -> Any:
        if isinstance(x, tuple):
            if len(x) == 4 and x[0] == "array" and isinstance(x[1], tuple):
                dims.extend(x[1])
                return ("array", len(x[1]), x[2], x[3])
            if x and x[0] == "value" and isinstance(x[-1], (int, float)) \
                    and not isinstance(x[-1], bool):
                return x[:-1] + (type(x[-1]).__name__,)
            return tuple(walk(y) for y in x)
        return x

    return walk(sig), tuple(dims)


_Recording = collections.namedtuple(
    "_Recording", "graph param_refs multi_backward backward_known hook")


class _Structure:
    """One planned graph of a signature."""

    __slots__ = ("graph", "plan", "program", "planning_time_s", "checked")

    def __init__(self, graph: Graph, plan: Any, program: Program, planning_time_s: float):
        self.graph, self.plan, self.program = graph, plan, program
        self.planning_time_s = planning_time_s
        self.checked = 0  # planned iterations whose peak was measured


class _Entry:
    """What a signature has: its plans (most recently used first), a
    recorded iteration waiting to be planned, and counters."""

    __slots__ = ("structures", "pending", "calls", "recorded", "plain", "error", "family",
                 "dims", "batch")

    def __init__(self, family: Hashable = None, dims: Tuple[int, ...] = ()) -> None:
        self.family, self.dims = family, dims  # see _family
        self.batch: Optional[int] = None  # the batch size of its calls
        self.error: Optional[Exception] = None  # raised at the next call
        self.structures: List[_Structure] = []
        self.pending: Optional[IterationHook] = None
        self.calls = 0
        self.recorded = 0
        self.plain = False


@dataclasses.dataclass(eq=False)
class _OpenMeter:
    """The measurement of one planned iteration, from the call to the end
    of its backward, then (``tail``) on to the end of the optimizer's
    update of the model's parameters (or the next call)."""

    meter: Any  # a running MemoryMeter
    entry: "_Entry"
    stats: Any  # the iteration's IterationStats
    hook: Any  # a weak reference to the iteration's IterationHook (it holds arrays)
    own: int  # the model's bytes at the call (state, inputs, the previous graph)
    level: int  # the meter's level then, those arrays counted
    new_meter: Any  # makes a meter for the same device
    tail: bool = False
    structure: Any = None  # the structure it ran on (set at the end of the backward)
    waiting: Any = None  # parameter ids whose update is still to come (tail)
    level_total: Optional[int] = None  # CuPy: the pool's total bytes at the call
    link_ref: Any = None  # a weak reference to the Link called
    finalizer: Any = None  # stops the meter if the runner is freed first
    # The call found the recorded (plain) iteration's graph still held (a
    # loss link keeps it until its forward): measured, but not checked
    # against the plan, which that graph is no part of.
    after_recording: bool = False
    watcher: Any = None  # the update watcher of a tail

    def measured(self, absolute_peak_bytes: int) -> int:
        """The model's bytes when the meter read ``absolute_peak_bytes``."""
        return self.own + absolute_peak_bytes - self.level


def _own_arrays(link: Optional[chainer.Link], arrays: List[Any]) -> List[Any]:
    """The arrays a training call finds that belong to the model: its
    parameters and their gradients, update-rule state, persistents, and the
    call's array arguments."""
    found: List[Any] = []

    def add(a: Any) -> None:
        if isinstance(a, chainer.Variable):
            a = a.raw_array
        if a is not None:
            found.append(a)
    if link is not None:
        for p in link.params():
            add(p.array)
            add(p.grad)
            rule = getattr(p, "update_rule", None)
            for v in (getattr(rule, "state", None) or {}).values():
                add(v)
        for sub in link.links():
            for name in getattr(sub, "_persistent", ()):
                add(getattr(sub, name, None))
    for x in arrays:
        add(x)
    return found


def _graph_arrays(hook: Any) -> List[Any]:
    """The arrays a previous iteration's graph still holds: what its
    function nodes retain (inputs, outputs, attributes) and the arrays of
    its outputs' live Variables."""
    from .capture import attribute_arrays
    found: List[Any] = []
    for call in hook.calls:
        f = call.func()
        if f is None:
            continue
        for node in list(f.inputs or ()) + [r() for r in (f.outputs or ())]:
            if node is None:
                continue
            if node._data is not None:
                found.append(node._data)
            var = node.get_variable_or_none()
            if var is not None and var.raw_array is not None:
                found.append(var.raw_array)
        found.extend(f._retained_output_data or ())
        found.extend(a for _, _, a in attribute_arrays(f))
    return found


def _distinct_bytes(dev: Any, arrays: List[Any]) -> int:
    """Bytes of ``arrays`` as the allocator holds them: each buffer once
    (views count their base)."""
    from .capture import is_array, root_of
    seen: set = set()
    total = 0
    for a in arrays:
        if not is_array(a):
            continue
        r = root_of(a)
        if id(r) in seen:
            continue
        seen.add(id(r))
        total += dev.allocation_bytes(getattr(r, "nbytes", a.nbytes))
    return total


def _keeps_graph(link: chainer.Link, hook: Any) -> bool:
    """Whether ``link`` (or a Link in it) keeps a Variable of the graph
    ``hook`` recorded in an attribute (``L.Classifier``'s ``loss``, ``y``)."""
    for sub in link.links():
        for v in vars(sub).values():
            if isinstance(v, chainer.Variable) and not isinstance(v, chainer.Parameter) \
                    and v.node in hook.array_of:
                return True
    return False


def _abandon(meter: Any) -> None:
    """The runner was freed with a meter running: stop it (tracing off)."""
    if getattr(meter, "_running", False):
        meter.stop()


def _update_targets(link_ref: Any) -> Optional[set]:
    """The ids of the parameters an optimizer will update (those of the
    iteration's Link with an update rule); None when the Link is not known
    (a callable): then the tail lasts until the next call or until the
    graph is freed."""
    link = link_ref() if link_ref is not None else None
    if link is None:
        return None
    return {id(p) for p in link.params() if getattr(p, "update_rule", None) is not None}


def _watch_updates(runner: "Recompute", open_: _OpenMeter) -> None:
    from .executor import add_update_watcher
    ref = weakref.ref(runner)

    def updated(param: Any) -> bool:
        """After each parameter update; True when done watching."""
        r = ref()
        if r is None or r._meter is not open_:
            return True
        open_.waiting.discard(id(param))
        if not open_.waiting:
            r._stop_meter()
            return True
        return False
    open_.watcher = updated
    add_update_watcher(updated)


def _graph_died(runner_ref: Any, open_: _OpenMeter) -> None:
    runner = runner_ref()
    if runner is not None and runner._meter is open_:
        runner._stop_meter()


class Recompute:
    """A callable that runs ``fn`` with recomputation.

    Args:
        fn: a callable applying Chainer functions (a Link's ``__call__``, a
            loss function); it may return anything (a Variable, a tuple, a
            dict, a ``chainer.Distribution``).
        budget: memory budget (``'8G'``, bytes, ...; see :func:`parse_bytes`),
            or ``'least'``: the solver's least feasible budget, found when
            planning.
        solver: ``auto`` (default: ``hier`` on graphs of 1,000+ functions
            with repeated layers or steps, else ``approx``), ``hier``,
            ``approx``, ``exact``, ``chen``, ``chen-greedy`` or ``none``
            (plain Chainer).
        strategy: ``tc`` (least recomputation) or ``mc`` (least memory).
        cost: cost model for the solver: ``measured`` (profiled times),
            ``flops`` or ``paper``.
        max_plans: how many input signatures keep their plans.
        max_structures: how many graph structures one signature keeps
            plans for.
        capture_batch: plan before the first call, from a separate capture
            at this batch size scaled linearly to the real batch (the budget
            then holds from the first step); default: plan from the first
            call, which runs plainly.
        verify: checksum the parameters and inputs that regeneration reads,
            so that an in-place change between forward and backward is
            reported instead of giving a different gradient.
        budget_scope: ``'total'`` (default): the budget bounds everything
            the device holds in an iteration (parameters, gradients,
            optimizer state, activations, temporaries); ``'activations'``:
            the paper's model only.
        coordinator: plans collectively across processes (data-parallel
            training); an object with ``plan(graph, solve) -> Plan``, called
            instead of solving locally (``solve(graph)`` solves here), and
            ``on_call(runner, signature, state)`` at each training call
            (``state``: ``'record'``, ``'capture'``, ``'plan'``, ``'run'`` or
            ``'plain'``; ``'plan'`` and ``'capture'`` calls call
            ``coordinator.plan`` exactly once before the forward).
            See :mod:`chainer_recompute.runtime.distributed`.
        verbose: print one line when the first plan is made (through the
            ``chainer_recompute.report`` logger, visible by default);
            warnings and errors are printed either way.
        workspace: a bound on one convolution call's temporary memory
            (``'64M'``, bytes), ``'auto'`` (the planner chooses it with the
            plan), or ``None`` (default: Chainer's own kernels). Calls over
            it run :mod:`~chainer_recompute.runtime.workspace`'s kernels and
            the planner sees their transients. ``workspace_exact`` (default
            True): bit-identical one-call kernels only (a column buffer
            built in one copy instead of Chainer's two); False: chunked to
            fit the bound, not bit-identical on OpenBLAS (README).
        check_iterations: how many planned iterations per plan have their
            peak measured by the allocator (NumPy: tracemalloc, slower
            while on) and checked against the budget; on CuPy every
            iteration is measured (the pool hook is cheap). A peak over the
            budget warns once, corrects the model by what was measured, and
            plans again.
        on_infeasible: what a training call does when its budget cannot be
            met (a new input shape or structure too large for it, a plan
            corrected after a measured overshoot): ``'raise'``:
            :class:`InfeasibleBudgetError` from that call, before anything
            runs; ``'warn'``: one warning (with the least feasible budget),
            and that signature runs plainly, its peak not bounded;
            ``'auto'`` (default): ``'raise'`` until the first planned
            iteration has run (a budget that cannot be met from the start is
            a setting to fix before training goes on), ``'warn'`` from then
            on (one unusual batch does not stop a run in progress).
        **solver_options: passed to the solver.

    Input shapes that change from call to call (a batch padded to its
    longest sequence or molecule, a last partial batch): once two shapes of
    the same structure have been recorded, a call at a new shape is planned
    before it runs, from a graph scaled from those two (each size linear in
    the input's dimensions); the plan of the largest recorded shape is
    reused when its replayed peak at the new shape fits the budget (with
    ``'least'``: that shape's least budget; no solver run), else the scaled
    graph is solved. A new value of a number argument (an ``np.float32``
    schedule value) with the same shapes reuses the graph, plan and
    program as they are. The executor checks the
    scaled graph against the call as for any plan; a call that does not
    match it is recorded and planned from its recording. The second shape
    is recorded plainly, with one warning when a byte budget is set.

    >>> runner = Recompute(loss_fn, budget='2G')            # doctest: +SKIP
    >>> loss = runner(x, t); loss.backward()                # doctest: +SKIP
    """

    #: A plan that drops nothing, once checked, runs as plain Chainer (no
    #: hook); False keeps the executor's hook on (to measure its cost).
    plain_when_nothing_dropped = True

    #: A signature whose structure changed this many times, and on more
    #: than half of its calls, runs plain Chainer from then on.
    PLAIN_AFTER = 6

    def __init__(self, fn: Callable[..., Any], budget: Any, *, solver: str = "auto",
                 strategy: str = "tc", cost: str = "measured", max_plans: int = 8,
                 max_structures: int = 4, capture_batch: Optional[int] = None,
                 verify: bool = True, budget_scope: str = "total", check_iterations: int = 3,
                 verbose: bool = True, coordinator: Any = None, workspace: Any = None,
                 workspace_exact: bool = True, on_infeasible: str = "auto",
                 **solver_options: Any) -> None:
        from ..core.budget import check_scope
        from ..core.costs import COST_MODELS
        from ..core.solvers import check_solver
        check_scope(budget_scope)
        from ..core.workspace import parse_workspace
        try:
            self.workspace = parse_workspace(workspace)
        except ValueError as e:
            raise RecomputeError(str(e)) from None
        self.workspace_exact = bool(workspace_exact)
        self.budget_least = isinstance(budget, str) and budget.strip().lower() == "least"
        self.budget_bytes: Optional[int] = None if self.budget_least else parse_bytes(budget)
        check_solver(solver, strategy)
        _check_solver_options(solver, solver_options)
        if on_infeasible not in ("auto", "warn", "raise"):
            raise RecomputeError(f"on_infeasible must be 'auto', 'warn' or 'raise', got "
                                 f"{on_infeasible!r}")
        self.on_infeasible = on_infeasible
        if cost not in COST_MODELS:
            raise RecomputeError(f"unknown cost model {cost!r}; known: {sorted(COST_MODELS)}")
        if capture_batch is not None and (not isinstance(capture_batch, int) or capture_batch < 1):
            raise RecomputeError(f"capture_batch must be a positive int or None, got "
                                 f"{capture_batch!r}")
        self.fn = fn
        self.solver, self.strategy, self.cost = solver, strategy, cost
        self.solver_options = solver_options
        self.max_plans, self.max_structures = max_plans, max_structures
        self.capture_batch = capture_batch
        self.verify = verify
        self.budget_scope = budget_scope
        self.check_iterations = check_iterations
        self.options: Dict[str, Any] = dict(
            budget=budget, solver=solver, strategy=strategy, cost=cost, max_plans=max_plans,
            max_structures=max_structures, capture_batch=capture_batch, verify=verify,
            budget_scope=budget_scope, check_iterations=check_iterations, verbose=verbose,
            coordinator=coordinator, workspace=workspace, workspace_exact=workspace_exact,
            on_infeasible=on_infeasible, **solver_options)
        self.verbose = verbose
        self.coordinator = coordinator
        self._warned_over = False
        self._reported_plan = False
        self._reported_infeasible = False
        self._said_unsafe: set = set()  # unsafe-function warnings given (one each)
        self._said_capture = False  # capture_batch refused a model (warned once)
        self._said_new_shape = False  # a new input shape recorded plainly (warned once)
        self._ran_planned = False  # a planned iteration has run
        self.shapes_derived = 0  # signatures planned from their family's graphs
        self._refusal = ""
        self._entries: "collections.OrderedDict[Hashable, _Entry]" = collections.OrderedDict()
        self.last_stats: Optional[IterationStats] = None

    def _name(self, args: Tuple[Any, ...]) -> str:
        link = self._link(args)
        return type(link).__name__ if link is not None else \
            getattr(self.fn, "__qualname__", "the model")

    @staticmethod
    def _link(args: Tuple[Any, ...]) -> Optional[chainer.Link]:
        return args[0] if args and isinstance(args[0], chainer.Link) else None

    # ------------------------------------------------------------ plans
    @property
    def plans(self) -> Dict[Hashable, Any]:
        """The plan of each signature's most recently used structure."""
        return {k: e.structures[0].plan for k, e in self._entries.items() if e.structures}

    def clear(self) -> None:
        """Forget every plan."""
        self._entries.clear()

    def _entry(self, sig: Hashable) -> _Entry:
        entry = self._entries.get(sig)
        if entry is None:
            entry = self._entries[sig] = _Entry(*_family(sig))
            while len(self._entries) > self.max_plans:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(sig)
        return entry

    def plan_for(self, *args: Any, **kwargs: Any) -> Any:
        """The plan for these inputs: the current one, or one made now from
        a separate capture that leaves no trace."""
        entry = self._entry(_signature(args, kwargs))
        if entry.pending is not None:
            self._plan_pending(entry, args, kwargs)
        if not entry.structures and not self._plan_separately(entry, args, kwargs):
            raise RecomputeError(self._refusal)
        return entry.structures[0].plan

    def _solve(self, graph: Graph) -> Any:
        from ..core.budget import plan_for_budget
        budget: Any = "least" if self.budget_least else self.budget_bytes
        try:
            return plan_for_budget(graph, budget, solver=self.solver, strategy=self.strategy,
                                   scope=self.budget_scope, **self.solver_options)
        except InfeasibleBudgetError as e:
            if not self._reported_infeasible and self._raising():
                self._reported_infeasible = True
                report.error("%s", e)
            raise

    def _raising(self) -> bool:
        """Whether an infeasible budget raises from a training call now."""
        return self.on_infeasible == "raise" or (self.on_infeasible == "auto"
                                                 and not self._ran_planned)

    def _infeasible(self, entry: _Entry, e: InfeasibleBudgetError) -> None:
        """A training call's budget cannot be met: raise, or say so once and
        run this signature plainly (see ``on_infeasible``)."""
        if self._raising():
            raise e
        entry.plain, entry.pending, entry.error = True, None, None
        entry.structures.clear()
        level = logging.INFO if self._reported_infeasible else logging.WARNING
        self._reported_infeasible = True
        report.log(level, "%s; this input signature runs without recomputation, its peak "
                   "not bounded by the budget (on_infeasible='raise' raises instead)", e)

    def _bound(self, graph: Graph) -> Graph:
        """``graph`` with its convolutions' transients under the workspace
        bound (for ``'auto'``, the bound whose plan fits best)."""
        from ..core.workspace import bounded_graph, plan_with_workspace
        if self.workspace != "auto" or self.budget_scope != "total":
            limit = None if self.workspace == "auto" else self.workspace
            return bounded_graph(graph, limit, self.workspace_exact)
        budget: Any = "least" if self.budget_least else self.budget_bytes
        try:
            return plan_with_workspace(graph, budget, "auto", solver=self.solver,
                                       strategy=self.strategy, scope=self.budget_scope,
                                       exact=self.workspace_exact, **self.solver_options)[1]
        except InfeasibleBudgetError:
            return bounded_graph(graph, None)  # _solve reports it

    def _add(self, entry: _Entry, graph: Graph, param_refs: Dict[int, Any],
             multi_backward: bool, t0: float, plan: Any = None,
             backward_known: bool = False) -> _Structure:
        if plan is None:
            if self.workspace is not None:  # the convolutions' bound, chosen with the plan
                graph = self._bound(graph)
            plan = (self._solve(graph) if self.coordinator is None
                    else self.coordinator.plan(graph, self._solve))
        program = Program(graph, plan.lower_sets, frozenset(plan.kept), param_refs=param_refs)
        program.multi_backward = multi_backward
        program.backward_known = backward_known
        s = _Structure(graph, plan, program, time.perf_counter() - t0)
        if plan.recompute:
            self._decide_release(s)
        entry.structures.insert(0, s)
        del entry.structures[self.max_structures:]
        level = logging.INFO if (self.verbose and not self._reported_plan) else logging.DEBUG
        self._reported_plan = True
        report.log(level, "%s", describe_plan(graph, plan, s.planning_time_s))
        if program.unsafe:
            kinds = collections.Counter(
                f"{graph.nodes[v].op} ({graph.nodes[v].attrs.get('unsafe_reason')})"
                for v in program.unsafe)
            n = len(program.unsafe)
            said = "%d function%s cannot be recomputed safely and %s kept: %s%s" % (
                n, "" if n == 1 else "s", "is" if n == 1 else "are", ", ".join(
                    kind + (f" x{count}" if count > 1 else "")
                    for kind, count in list(kinds.items())[:5]),
                ", ..." if len(kinds) > 5 else "")
            if said not in self._said_unsafe:  # not again for each plan of the same graph
                self._said_unsafe.add(said)
                report.warning("%s", said)
        return s

    def _plan_pending(self, entry: _Entry, args: Tuple[Any, ...],
                      kwargs: Dict[str, Any]) -> None:
        self._plan_recorded(entry, self._link(args))

    def _plan_when_backward_ends(self, entry: _Entry, hook: IterationHook,
                                 link: Optional[chainer.Link]) -> None:
        """Plan as soon as the recorded backward has run every function,
        still inside it: the recorded iteration runs as plain Chainer and is
        not under the budget, so the planner's own memory lands there and
        not in the first planned iteration, which the budget bounds. When
        the model keeps the recorded graph in its attributes (a loss link's
        ``self.loss``), that graph, which lives into the next call, then
        releases what the plan drops. Without a Link to plan for, the next
        call plans. An error is raised at the next call."""
        link_ref = weakref.ref(link) if link is not None else None
        before = hook.on_backward_done

        def plan(h: IterationHook) -> None:
            if before is not None:
                before(h)
            rec = entry.pending
            if isinstance(rec, _Recording):  # made into a graph for a sibling shape
                rec = rec.hook()
            if rec is not h or entry.error is not None:
                return
            lk = link_ref() if link_ref is not None else None
            if lk is None:
                return
            try:
                s = self._plan_recorded(entry, lk)
            except Exception as e:  # noqa: BLE001 - not from inside the user's backward
                entry.error = e
                return
            if _keeps_graph(lk, h):
                # the graph lives into the next step: it holds no more than
                # a planned one from now on
                h.release_as_planned(s.program)
        hook.on_backward_done = plan

    def _recorded(self, entry: _Entry, link: Optional[chainer.Link]) -> "_Recording":
        """The graph of ``entry``'s recorded iteration (made from its hook
        once, the hook then held weakly)."""
        rec = entry.pending
        if isinstance(rec, _Recording):
            return rec
        hook = rec
        graph = hook.graph(cost_model=self.cost, batch_size=entry.batch,
                           name=type(link).__name__ if link is not None else "model",
                           meta={"state_bytes": state_bytes(link)} if link is not None else None,
                           fill=hook.program.graph if hook.program is not None else None)
        if hook.backward_during_forward:
            # chainer.grad inside the forward (a gradient penalty): planned as
            # usual; from the moment such a backward starts, the executor
            # releases nothing more and regenerates what it needs.
            logger.info("the model's forward runs a backward (chainer.grad?); arrays are "
                        "not released after it starts")
        # backward_known: its backward ran to the end before planning, so a
        # graph backpropagated again after an update is seen by it (and
        # passed on to the plan); otherwise parameters are saved before
        # updates on probation.
        entry.pending = rec = _Recording(graph, hook.param_refs, hook.multi_backward,
                                         hook.backward_done, weakref.ref(hook))
        return rec

    def _plan_recorded(self, entry: _Entry, link: Optional[chainer.Link]) -> _Structure:
        t0 = time.perf_counter()
        rec = self._recorded(entry, link)
        entry.pending = None
        s = self._add(entry, rec.graph, rec.param_refs, rec.multi_backward, t0,
                      plan=self._family_plan(entry, rec.graph),
                      backward_known=rec.backward_known)
        hook = rec.hook()
        if hook is not None:
            # a second backward pass through the recorded graph, after this,
            # is learned by the plan
            hook.planned = s.program
        return s

    def _plan_separately(self, entry: _Entry, args: Tuple[Any, ...],
                         kwargs: Dict[str, Any]) -> bool:
        """Plan from a separate capture that leaves no trace. With
        ``capture_batch`` below the real batch: two small captures (at
        ``capture_batch`` and twice it), every size that differs between
        them scaled linearly to the real batch (a reshape that folds the
        batch into another axis included). A model those two captures do
        not describe (its structure depends on the batch size, a size not
        linear in it) is planned from its first call instead, with a
        warning; False then."""
        from ..core.errors import GraphError
        t0 = time.perf_counter()
        batch = batch_size_of(args, kwargs)
        small = self.capture_batch
        if small is None or batch is None or small >= batch:
            graph, hook = self._capture_at(args, kwargs, batch, batch)
            self._add(entry, graph, hook.param_refs, hook.multi_backward, t0)
            return True
        other = min(2 * small, batch - 1)
        if other <= small:  # batch = capture_batch + 1: capture it whole
            graph, hook = self._capture_at(args, kwargs, batch, batch)
            self._add(entry, graph, hook.param_refs, hook.multi_backward, t0)
            return True
        g1, hook = self._capture_at(args, kwargs, batch, small)
        g2, _ = self._capture_at(args, kwargs, batch, other)
        try:
            graph = g1.scale_between(g2, batch)
        except GraphError as e:
            self._refusal = f"capture_batch={small} cannot plan {self._name(args)}: {e}"
            level = logging.INFO if self._said_capture else logging.WARNING
            self._said_capture = True
            report.log(level, "%s; its first call at batch %d runs plainly (not bounded by the "
                       "budget) and the next ones run under a plan made from it",
                       self._refusal, batch)
            return False
        self._add(entry, graph, hook.param_refs, hook.multi_backward, t0)
        return True

    def _capture_at(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], batch: Optional[int],
                    small: Optional[int]) -> Tuple[Graph, IterationHook]:
        """One recorded iteration on the first ``small`` rows of the batch
        arguments (all of them when ``small`` is the batch), leaving no
        trace, and its graph."""
        link = self._link(args)
        cut_args, cut_kwargs = args, kwargs
        if small is not None and batch is not None and small < batch:
            def cut(x: Any) -> Any:
                arr = x.raw_array if isinstance(x, chainer.Variable) else x
                if isinstance(arr, chainer.get_array_types()) and arr.ndim and \
                        arr.shape[0] == batch:
                    return x[:small]
                return x
            cut_args = tuple(cut(a) for a in args)
            cut_kwargs = {k: cut(v) for k, v in kwargs.items()}
        with leave_no_trace(link if link is not None else self.fn):
            hook = IterationHook(link=link, args=list(cut_args) + list(cut_kwargs.values()))
            with _Active(), hook:
                out = self.fn(*cut_args, **cut_kwargs)
            hook.finish(out)
            from .capture import first_variable
            loss = first_variable(out)
            if loss is not None and loss.requires_grad:
                if loss.size != 1:
                    loss = chainer.functions.sum(loss)
                loss.grad_var = None
                if link is not None:
                    link.cleargrads()  # as a training loop does (restored after)
                loss.backward()
            del out, loss
        graph = hook.graph(cost_model=self.cost, batch_size=small,
                           name=type(link).__name__ if link is not None else "model",
                           meta={"state_bytes": state_bytes(link)} if link is not None else None)
        return graph, hook

    def _family_graphs(self, entry: _Entry, link: Optional[chainer.Link]
                       ) -> List[Tuple[_Entry, Graph]]:
        """The other signatures of ``entry``'s family with a graph: planned
        (their current structure's) or recorded and waiting to be planned."""
        out = []
        for e in list(self._entries.values()):
            if e is entry or e.family != entry.family or e.plain:
                continue
            if e.structures:
                out.append((e, e.structures[0].graph))
            elif e.pending is not None:
                out.append((e, self._recorded(e, link).graph))
        return out

    def _family_plan(self, entry: _Entry, graph: Graph) -> Any:
        """A plan of ``entry``'s family that fits ``graph`` under the
        budget (for ``'least'``: the least budget of the shape it was made
        for), its replayed peak on ``graph`` as its prediction (no solver
        run); None when none does (or in the activations scope, with
        workspace bounds or a coordinator: those plan each graph)."""
        if (self.budget_scope != "total" or self.workspace is not None
                or self.coordinator is not None):
            return None
        from ..core.budget import MARGIN
        from ..core.execution import ExecutionPlan
        from ..core.replay import replay
        planned = [e for e in self._entries.values()
                   if e is not entry and e.family == entry.family and e.structures
                   and not e.plain and e.structures[0].graph.n == graph.n
                   and [n.op for n in e.structures[0].graph.nodes] == [n.op for n in graph.nodes]]
        # the plan of the largest shape first (its blocks hold the most)
        planned.sort(key=lambda e: -e.structures[0].graph.activation_bytes)
        for e in planned[:2]:
            s = e.structures[0]
            ep = (ExecutionPlan(graph, s.plan.lower_sets, frozenset(s.plan.kept))
                  if s.plan.recompute else None)
            # 'least': the least budget of the larger shape the plan was made for
            budget = self.budget_bytes if self.budget_bytes is not None else s.plan.budget_bytes
            if budget is None:
                continue
            peak = replay(graph, ep).peak_bytes
            if peak <= budget * (1 - MARGIN):
                info = dict(s.plan.info, reused_from=list(e.dims))
                return dataclasses.replace(s.plan, predicted_peak_bytes=int(peak),
                                           budget_bytes=budget, info=info)
        return None

    def _plan_from_family(self, entry: _Entry, args: Tuple[Any, ...],
                          kwargs: Dict[str, Any]) -> bool:
        """Plan a new input shape before its first call, from two recorded
        shapes of its family (see the class docstring). False when there
        are not two such shapes or they do not describe this one: the call
        is then recorded (with one warning when a plan exists and a byte
        budget is set)."""
        from ..core.errors import GraphError
        link = self._link(args)
        sibs = self._family_graphs(entry, link)
        if not sibs:
            return False
        t0 = time.perf_counter()
        v = entry.dims
        graph = None
        why = "only one other shape of it has been recorded"
        for e1, g1 in sorted(sibs, key=lambda p: not p[0].structures):  # planned first
            if e1.dims == v:  # another value of a number argument: the same shapes
                graph, src = g1, e1
                break
        pairs = [] if graph is not None else \
            [(a, b) for i, a in enumerate(sibs) for b in sibs[i + 1:]]
        # the nearest recorded shapes first
        pairs.sort(key=lambda p: sum(abs(x - y) for x, y in zip(v, p[0][0].dims))
                   + sum(abs(x - y) for x, y in zip(v, p[1][0].dims)))
        for (e1, g1), (e2, g2) in pairs:
            v1, v2 = e1.dims, e2.dims
            k = next((j for j, (x, y) in enumerate(zip(v1, v2)) if x != y), None)
            if k is None:
                continue
            num, den = v[k] - v1[k], v2[k] - v1[k]
            if any((c - a) * den != (b - a) * num for a, b, c in zip(v1, v2, v)):
                why = "the recorded shapes do not vary along the same line as this one"
                continue
            try:
                graph = g1.interpolate(g2, num, den, where=f"at input dimensions {v1} and {v2}",
                                       target=f"input dimensions {v}")
            except GraphError as e:
                why = str(e)
                continue
            src = e1
            break
        batch = entry.batch
        if graph is None and batch is not None:
            # a last partial batch: only the batch dimension of the inputs
            # changed, and the graph scales with it (checked as it runs)
            for e1, g1 in sibs:
                if g1.batch_size and g1.batch_size != batch and all(
                        x == y or (x == g1.batch_size and y == batch)
                        for x, y in zip(e1.dims, v)):
                    graph, src = g1.scale_batch(batch), e1
                    break
        if graph is None:
            if self.budget_bytes is not None and not self._said_new_shape:
                self._said_new_shape = True
                report.warning("a new input shape of %s (dimensions %s) is recorded plainly: "
                               "its first call is not bounded by the budget (%s); later new "
                               "shapes are planned before they run once two of the same "
                               "structure are recorded", self._name(args), v, why)
            return False
        self.shapes_derived += 1
        if src.dims == v and src.structures:
            # the same shapes (a number argument's new value): the same
            # graph, plan and program, nothing solved or replayed
            # (one structure object: its measurements count for both)
            entry.structures.insert(0, src.structures[0])
            return True
        meta = dict(graph.meta)
        meta["derived_from"] = list(src.dims)
        graph = graph.replace(batch_size=batch, meta=meta)
        if src.structures:
            program = src.structures[0].program
            refs, multi, known = program.param_refs, program.multi_backward, \
                program.backward_known
        else:
            rec = self._recorded(src, link)
            refs, multi, known = rec.param_refs, rec.multi_backward, rec.backward_known
        plan = self._family_plan(entry, graph)
        if plan is None:
            # plan the largest recorded shape, if larger: its plan serves
            # this shape and the smaller ones to come
            big, g = max(sibs, key=lambda p: p[1].activation_bytes)
            if not big.structures and big.pending is not None and \
                    g.activation_bytes > graph.activation_bytes:
                rec = self._recorded(big, link)
                big.pending = None
                try:
                    self._add(big, rec.graph, rec.param_refs, rec.multi_backward,
                              time.perf_counter(), backward_known=rec.backward_known)
                except InfeasibleBudgetError:
                    big.pending = rec
                else:
                    plan = self._family_plan(entry, graph)
        self._add(entry, graph, refs, multi, t0, plan=plan, backward_known=known)
        return True

    # ------------------------------------------------------------- call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (chainer.config.train and chainer.config.enable_backprop) or _depth() > 0:
            if _depth() == 0:
                self._close_step()  # an evaluation between two steps is not in either
            return self.fn(*args, **kwargs)
        # The previous iteration (its update included) is over: checked
        # before anything else runs (planning's memory is in no iteration).
        self._close_step()
        sig = _signature(args, kwargs)
        entry = self._entry(sig)
        if entry.error is not None:
            self._infeasible(entry, entry.error)  # raises, or runs this signature plainly
        entry.calls += 1
        entry.batch = batch_size_of(args, kwargs)
        if self.coordinator is not None:
            state = ("plain" if entry.plain else "plan" if entry.pending is not None
                     else "run" if entry.structures
                     else "capture" if self.capture_batch is not None and entry.calls == 1
                     else "record")
            self.coordinator.on_call(self, sig, state)
        if entry.plain:
            self.last_stats = IterationStats(path="plain")
            return self.fn(*args, **kwargs)
        try:
            if entry.pending is not None:
                self._plan_pending(entry, args, kwargs)
            elif not entry.structures and entry.calls == 1:
                if self.capture_batch is not None:
                    self._plan_separately(entry, args, kwargs)
                elif self.coordinator is None:
                    self._plan_from_family(entry, args, kwargs)
        except InfeasibleBudgetError as e:
            self._infeasible(entry, e)
            self.last_stats = IterationStats(path="plain")
            return self.fn(*args, **kwargs)
        for s in entry.structures:
            if s.program.multi_backward and not s.program.release_mode_decided:
                self._decide_release(s)
        link = self._link(args)
        if len(entry.structures) == 1 and not entry.structures[0].program.dropped and \
                entry.structures[0].checked >= self.check_iterations and \
                self.plain_when_nothing_dropped:
            # A plan that drops nothing, checked against the allocator: plain
            # Chainer, no hook (its structure is no longer followed).
            self._last_hook = None
            s = entry.structures[0]
            stats = self.last_stats = IterationStats(0, path="planned")
            stats.n_nodes, stats.release_mode = s.program.n, s.program.release_mode
            stats.predicted_peak_bytes = s.plan.predicted_peak_bytes
            stats.budget_bytes = s.plan.budget_bytes
            return self.fn(*args, **kwargs)
        # Fewest functions first (most recently used first among equals): a
        # forward that goes on past a plan's last function switches to a
        # longer plan that matches it, while one that stops before a plan's
        # end could not switch back (a loss with and without its box term).
        programs = sorted((s.program for s in entry.structures), key=lambda p: p.n)
        hook = IterationHook(programs, link=link,
                             args=list(args) + list(kwargs.values()), verify=self.verify)
        if entry.structures:
            self._start_meter(entry, hook, link, args, kwargs)
        self._last_hook = weakref.ref(hook)
        limit = entry.structures[0].graph.meta.get("workspace_bytes") \
            if entry.structures else None
        with _Active(), hook, bounded(limit, self.workspace_exact):
            out = self.fn(*args, **kwargs)
        hook.finish(out)
        self.last_stats = hook.stats
        if hook.stats.path == "planned":
            self._ran_planned = True
        for s in entry.structures:
            if s.program is hook.program:
                hook.stats.predicted_peak_bytes = s.plan.predicted_peak_bytes
                hook.stats.budget_bytes = s.plan.budget_bytes
        if hook.recording:
            entry.pending = hook
            if self.coordinator is None:
                self._plan_when_backward_ends(entry, hook, link)
            if entry.structures:
                entry.recorded += 1
                logger.info("the model's graph changed for the same input signature (%s); this "
                            "iteration keeps what it had not released and the next call plans "
                            "the new structure", hook.stats.mismatch)
                if entry.recorded >= self.PLAIN_AFTER and 2 * entry.recorded > entry.calls:
                    entry.plain, entry.pending = True, None
                    entry.structures.clear()
                    report.warning(
                        "the graph of %s changed on %d of its %d calls "
                        "with the same input signature; running it without recomputation "
                        "from now on", self._name(args),
                        entry.recorded, entry.calls)
        else:
            used = hook.program
            entry.structures.sort(key=lambda s: s.program is not used)
        return out

    def _decide_release(self, s: _Structure) -> None:
        """What the executor keeps after a node's last backward reader
        (replay.RELEASE_MODES): the mode that makes a second backward pass
        cheapest among those whose replayed peak fits the budget (total
        scope; ``all`` only for a graph known to be backpropagated twice per
        iteration, a GAN's generator graph, else ``checkpoints``). In the
        activations scope: ``all`` for such a graph, ``checkpoints`` where it
        costs no peak."""
        from ..core.budget import MARGIN
        from ..core.replay import replay
        budget = s.plan.budget_bytes
        modes = ["all", "checkpoints"] if s.program.multi_backward else ["checkpoints"]
        s.program.release_mode = "none"
        if self.budget_scope != "total" or budget is None:
            # The paper's model does not bound the real peak: keep what a
            # second pass needs, or checkpoints where that costs nothing.
            base = replay(s.graph, s.program, release_mode="none").peak_bytes
            if s.program.multi_backward:
                s.program.release_mode = "all"
            elif replay(s.graph, s.program, release_mode="checkpoints").peak_bytes <= base:
                s.program.release_mode = "checkpoints"
        else:
            for mode in modes:
                if replay(s.graph, s.program, release_mode=mode).peak_bytes <= \
                        budget * (1 - MARGIN):
                    s.program.release_mode = mode
                    break
        s.program.release_mode_decided = s.program.multi_backward
        if s.program.release_mode != "none" and self.budget_scope == "total":
            # what the plan will really hold: its prediction in that mode
            peak = replay(s.graph, s.program, release_mode=s.program.release_mode).peak_bytes
            s.plan = dataclasses.replace(s.plan, predicted_peak_bytes=peak)
        if s.program.multi_backward:
            logger.info("the graph is backpropagated more than once per iteration; after each "
                        "backward pass %s", {
                            "all": "regenerated arrays are kept for the next",
                            "checkpoints": "checkpoints are kept, regenerated arrays released",
                            "none": "everything is released (keeping more would exceed the "
                                    "budget)"}[s.program.release_mode])

    # ------------------------------------------------- measured memory
    _meter: Optional["_OpenMeter"] = None
    _last_hook: Any = None  # a weak reference to the previous call's IterationHook

    def _start_meter(self, entry: _Entry, hook: IterationHook, link: Optional[chainer.Link],
                     args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Measure this iteration's peak, from the call to the end of its
        backward, then on through the optimizer's update of the model's
        parameters, while the plans of its signature still need checking
        (on CuPy always: the pool's hook is cheap).

        What is counted is this model's own iteration: the arrays it holds
        at the call (parameters, gradients, optimizer state, persistents,
        inputs, and the previous iteration's graph, which a loss link keeps
        until its forward), counted by hand (on NumPy they were made before
        tracing began, and are adopted by the tracing so that their frees
        are seen; on CuPy the pool also holds other models' arrays), plus
        what the allocator holds above its level at the call."""
        from .device import device_of
        arrays = list(args) + list(kwargs.values())
        dev = device_of(arrays)
        if not dev.is_gpu and all(s.checked >= self.check_iterations
                                  for s in entry.structures):
            return
        own = _own_arrays(link, arrays)
        previous = self._last_hook() if self._last_hook is not None else None
        held: List[Any] = []
        if previous is not None and previous is not hook and (
                previous.backward_done or previous.program is None):
            # (a call whose backward is still to come, a discriminator's
            # other batch, is another iteration's: not counted here)
            held = _graph_arrays(previous)
            own += held
        meter = dev.meter()
        meter.start()
        dev.adopt(meter, own)
        self._meter = _OpenMeter(meter, entry, hook.stats, weakref.ref(hook),
                                 _distinct_bytes(dev, own), meter.current_bytes(), dev.meter,
                                 link_ref=weakref.ref(link) if link is not None else None)
        self._meter.after_recording = bool(held) and previous.recording
        self._meter.finalizer = weakref.finalize(self, _abandon, meter)
        hook.on_backward_done = lambda _hook: self._stop_meter(done=True)

    def _close_step(self) -> None:
        """The next call: the previous iteration is over; measure and check
        what is left of it."""
        if self._meter is not None:
            self._stop_meter()

    def _stop_meter(self, done: bool = False) -> None:
        if self._meter is None:
            return
        open_, self._meter = self._meter, None
        if open_.finalizer is not None:
            open_.finalizer.detach()
        if open_.watcher is not None:
            from .executor import remove_update_watcher
            remove_update_watcher(open_.watcher)
        stats = open_.stats
        if open_.tail:
            m = open_.meter.stop()
            s = open_.structure
            if s is None or s not in open_.entry.structures:
                return
            measured = open_.measured(m.absolute_peak_bytes)
            total = None if m.total_peak_bytes is None or open_.level_total is None else \
                open_.own + m.total_peak_bytes - open_.level_total
            if measured > (stats.measured_peak_bytes or 0):
                stats.measured_peak_bytes = int(measured)
            if total is not None:
                stats.measured_pool_total_bytes = int(max(
                    total, measured, stats.measured_pool_total_bytes or 0))
            if not open_.after_recording:
                self._check(open_.entry, s, stats, max(measured, total or 0))
            return
        hook = open_.hook()
        s = next((s for s in open_.entry.structures
                  if hook is not None and s.program is hook.program), None)
        tail = None
        if done and stats.path == "planned" and s is not None:
            # the rest of the iteration: the optimizer's update (the meter
            # starts before this one stops, so that the tracing goes on)
            waiting = _update_targets(open_.link_ref)
            if waiting is None or waiting:
                tail = open_.new_meter()
                tail.start()
        m = open_.meter.stop()
        if not done or stats.path != "planned" or s is None:
            return  # no backward, or the iteration left its plan: nothing to check
        measured = open_.measured(m.absolute_peak_bytes)
        if not open_.after_recording:
            s.checked += 1
        stats.measured_peak_bytes = int(measured)
        stats.predicted_peak_bytes = s.plan.predicted_peak_bytes
        stats.budget_bytes = s.plan.budget_bytes
        if m.total_peak_bytes is not None:
            # what the budget bounds on CuPy: the pool's blocks added for this
            # iteration too (cached and split ones)
            total = open_.own + m.total_peak_bytes - m.start_total_bytes - \
                (open_.level - m.start_bytes)
            measured = max(measured, total)
            stats.measured_pool_total_bytes = int(measured)
        if tail is not None:
            self._meter = _OpenMeter(tail, open_.entry, stats, open_.hook, open_.own,
                                     open_.level, open_.new_meter, tail=True, structure=s,
                                     waiting=waiting, level_total=m.start_total_bytes,
                                     link_ref=open_.link_ref,
                                     after_recording=open_.after_recording)
            self._meter.finalizer = weakref.finalize(self, _abandon, tail)
            if waiting is not None:
                _watch_updates(self, self._meter)
            else:  # a callable's parameters are not known: to the next call
                weakref.finalize(hook, _graph_died, weakref.ref(self), self._meter)
        if not open_.after_recording:
            self._check(open_.entry, s, stats, measured)

    def _check(self, entry: _Entry, s: _Structure, stats: IterationStats,
               measured: int) -> None:
        budget = s.plan.budget_bytes
        if self.budget_scope != "total" or budget is None or measured <= budget:
            return
        excess = int(measured - (s.plan.predicted_peak_bytes or 0))
        if not self._warned_over:
            self._warned_over = True
            report.warning(
                "the measured peak %s is over the budget %s (predicted %s); "
                "correcting the memory model by %s and planning again",
                format_bytes(measured), format_bytes(budget),
                format_bytes(s.plan.predicted_peak_bytes or 0), format_bytes(max(excess, 0)))
        graph = s.graph
        meta = dict(graph.meta)
        meta["correction_bytes"] = int(meta.get("correction_bytes", 0)) + max(excess, 1)
        graph = graph.replace(meta=meta)
        t0 = time.perf_counter()
        entry.structures.remove(s)
        if self._meter is not None and self._meter.structure is s:
            self._meter.structure = None  # its tail is not checked against the old plan
        try:
            self._add(entry, graph, s.program.param_refs, s.program.multi_backward, t0,
                      backward_known=s.program.backward_known)
        except InfeasibleBudgetError as e:
            # Not from inside the user's backward: at the next call, before
            # anything runs.
            entry.error = e

    def __repr__(self) -> str:
        budget = "least" if self.budget_least else format_bytes(self.budget_bytes)
        return (f"Recompute(budget={budget}, solver={self.solver!r}, strategy={self.strategy!r}, "
                f"signatures={len(self._entries)})")


def describe_plan(graph: Graph, plan: Any, planning_time_s: float) -> str:
    """One line on a plan: what it saves and what it costs."""
    name = graph.meta.get("model", "model")
    head = f"planned {name} ({graph.n} functions, batch {graph.batch_size})"
    if not plan.recompute:
        return (f"{head}: plain backprop fits the budget {format_bytes(plan.budget_bytes)} "
                f"(predicted peak {format_bytes(plan.predicted_peak_bytes)}); nothing recomputed "
                f"[{planning_time_s:.2f} s]")
    vanilla = plan.info.get("vanilla_peak_bytes")
    saving = (f", plain Chainer {format_bytes(vanilla)} "
              f"(-{100 * (1 - plan.predicted_peak_bytes / vanilla):.0f}%)" if vanilla else "")
    scope = plan.info.get("memory_scope", "activations")
    return (f"{head}: predicted peak {format_bytes(plan.predicted_peak_bytes)} ({scope}) for "
            f"budget {format_bytes(plan.budget_bytes)}{saving}; recomputes "
            f"{100 * (plan.overhead_fraction or 0):.0f}% of a forward in {plan.n_blocks} blocks "
            f"[{planning_time_s:.2f} s]")


# ------------------------------------------------------------- apply()
_SUBCLASSES: Dict[type, type] = {}


def _recompute_call(self: chainer.Link, *args: Any, **kwargs: Any) -> Any:
    runner = vars(self).get(_ATTR)
    if runner is None:  # e.g. a half-built copy
        return type(self)._chainer_recompute_base.__call__(self, *args, **kwargs)
    return runner(self, *args, **kwargs)


def _reduce_ex(self: chainer.Link, protocol: int) -> Any:
    runner = vars(self)[_ATTR]
    state = {k: v for k, v in vars(self).items() if k != _ATTR}
    # A communicator does not travel with a snapshot: apply() again to set it.
    options = {k: v for k, v in runner.options.items() if k != "coordinator"}
    return (_rebuild, (type(self)._chainer_recompute_base, options), state)


def _rebuild(base: type, options: Dict[str, Any]) -> chainer.Link:
    """Unpickling (and copying) an applied Link: a new runner, no plans."""
    obj = base.__new__(base)
    _install(obj, base, Recompute(base.__call__, **options))
    return obj


def _subclass_for(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {
            "__call__": _recompute_call, "__reduce_ex__": _reduce_ex,
            "_chainer_recompute_base": cls, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
        _SUBCLASSES[cls] = sub
    return sub


def _install(model: chainer.Link, base: type, runner: Recompute) -> None:
    vars(model)[_ATTR] = runner
    model.__class__ = _subclass_for(base)


def apply(model: chainer.Link, budget: Any, *, solver: str = "auto", strategy: str = "tc",
          cost: str = "measured", **options: Any) -> chainer.Link:
    """Make ``model`` recompute, in place, and return it.

    The Link keeps its parameters, their paths (``save_npz`` / ``load_npz``
    work as before), its optimizer and its device moves; only calling it
    changes: the instance gets a subclass of its class whose ``__call__``
    runs the original one under the backward driver (:func:`remove` puts
    the class back). It pickles (Trainer snapshots, multiprocess
    iterators), and copies (``model.copy()``, ``deepcopy``) recompute with
    plans of their own. Applying again replaces the options; a Link called
    inside an applied one runs as part of the outer plan.

    Args:
        model: the Link whose call returns the loss (e.g. a
            ``chainer.links.Classifier``); it may define ``forward`` or
            only ``__call__``.
        budget: ``'8G'``, bytes, ... or ``'least'`` (see :class:`Recompute`).
        solver, strategy, cost, options: see :class:`Recompute`.

    Returns:
        ``model`` itself.

    Raises:
        BudgetError: the budget cannot be read (nothing is changed).
        UnknownSolverError: unknown solver or strategy (nothing is changed).

    >>> model = apply(L.Classifier(net), budget='8G')        # doctest: +SKIP
    """
    if not isinstance(model, chainer.Link):
        raise RecomputeError(f"apply() takes a chainer.Link, got {type(model).__name__}; for "
                             f"a plain callable use chainer_recompute.Recompute(fn, budget=...)")
    base = getattr(type(model), "_chainer_recompute_base", type(model))
    runner = Recompute(base.__call__, budget, solver=solver, strategy=strategy, cost=cost,
                       **options)
    _install(model, base, runner)
    return model


def remove(model: chainer.Link) -> chainer.Link:
    """Undo :func:`apply`: ``model`` runs its plain ``__call__`` again."""
    base = getattr(type(model), "_chainer_recompute_base", None)
    if base is not None:
        model.__class__ = base
        vars(model).pop(_ATTR, None)
    return model


def runner_of(model: chainer.Link) -> Optional[Recompute]:
    """The :class:`Recompute` that :func:`apply` installed, or None."""
    return vars(model).get(_ATTR)


__all__ = ["IterationStats", "Recompute", "apply", "remove", "runner_of"]
