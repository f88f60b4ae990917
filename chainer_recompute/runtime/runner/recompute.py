"""The :class:`Recompute` runner: the training call that records, plans or
runs a step under its plan, coordinating a :class:`~.planning.Planner`
(plans, the budget), a :class:`~.metering.StepMeter` (measurement and
correction) and a :class:`~.signatures.SignatureCache` (each input
signature's plans), with the options parsed once into a
:class:`~.spec.RunnerSpec`."""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

from .. import _chainer  # noqa: F401
import chainer

from ...core.errors import InfeasibleBudgetError, RecomputeError
from ...core.budget_spec import Budget, parse_budget
from ...core.units import format_bytes
from ..capture import batch_size_of
from ..executor import IterationHook, IterationStats
from ..workspace import bounded
from .log import logger, report
from .metering import StepMeter
from .planning import Planner, link_of, name_of
from .signatures import SignatureCache, _signature
from .spec import RunnerSpec
from .state import _Active, _depth
from .views import SignatureView, views_of


def _step_mark(link: Optional[chainer.Link]) -> Any:
    """Which training step a call is in: the optimizer's update count of
    the model's parameters (calls between two updates share it); None for
    a bare callable (its calls are told apart by their backward alone)."""
    if link is None:
        return None
    from ..param_updates import _update_count
    return max((_update_count(p) for p in link.params()), default=-1)


class Recompute:
    """A callable that runs ``fn`` with recomputation.

    Args:
        fn: a callable applying Chainer functions (a Link's ``__call__``, a
            loss function); it may return anything (a Variable, a tuple, a
            dict, a ``chainer.Distribution``).
        budget: memory budget: a size (``'8G'`` = 8·2^30 bytes, ``'8GB'``
            = 8·10^9, any case, spaces allowed; an int of bytes),
            ``'least'`` (the least feasible budget, found when planning),
            ``'60%'`` (that share of what plain Chainer needs for each input
            signature) or ``'device'`` (what the model's device can give,
            less 10%); see docs/defaults.md and
            :func:`~chainer_recompute.core.budget_spec.parse_budget`.
        solver: ``auto`` (default: ``hier`` on graphs of 1,000+ functions
            with repeated layers or steps, else ``approx``), ``hier``,
            ``approx``, ``exact``, ``chen``, ``chen-greedy`` or ``none``
            (plain Chainer).
        strategy: ``tc`` (least recomputation) or ``mc`` (coarsest blocks:
            the most recomputation, each array dropped early; see
            docs/algorithm.md).
        cost: cost model for the solver: ``measured`` (profiled times),
            ``flops`` or ``paper``.
        max_plans: how many input signatures keep their plans.
        max_structures: how many graph structures one signature keeps
            plans for.
        capture_batch: how the first call of an input signature is planned.
            ``'auto'`` (default): before it runs, from two separate captures
            at a small batch (1 and 2 below a batch of 16, 2 and 4 from 16
            on, and above batch 4 for a model those at 1 and 2 do not
            describe) that leave no trace, every size that differs between
            them scaled linearly to the real batch; the budget then holds
            from the first step. A batch under 3, arguments without a batch
            dimension, or a model the captures do not describe (its
            structure or a size not linear in the batch) is said once, and
            that first call runs as plain Chainer while its graph is
            recorded. An int: captures at
            that batch and twice it (a batch no larger than it is captured
            whole). ``None``: the first call runs as plain Chainer and is
            recorded (not bounded by the budget). Input shapes after the
            first are planned from the recorded shapes of their family where
            they can be (below), else captured the same way (a model whose
            signature is new at nearly every call, none planned: see
            :data:`RECORD_NEW_AFTER`).
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
            A coordinator uses the runner through :meth:`solve`, :meth:`plan`,
            :meth:`call_state`, :meth:`plans_before_forward`,
            :meth:`planned_graphs`, :meth:`adopt`, :meth:`available_bytes`
            and :meth:`resolve_device_budget` only. See
            :mod:`chainer_recompute.runtime.distributed`.
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
            fit the bound, not bit-identical on OpenBLAS (docs/workspaces.md).
        check_iterations: how many planned iterations per plan have their
            peak measured by the allocator (NumPy: tracemalloc, slower
            while on) and checked against the budget; on CuPy every
            iteration is measured (the pool hook is cheap). A peak over the
            budget warns once, corrects the model by what was measured, and
            plans again at the model's next call, before that call's meter
            starts (not inside the step that overshot).
        on_infeasible: what a training call does when its budget cannot be
            met (a new input shape or structure too large for it, a plan
            corrected after a measured overshoot): ``'raise'``:
            :class:`InfeasibleBudgetError` from that call, before anything
            runs; ``'warn'``: one warning (with the least feasible budget),
            and that signature runs plainly, its peak not bounded;
            ``'auto'`` (default): ``'raise'`` until the first planned
            iteration has run (a budget that cannot be met from the start is
            a setting to fix before training goes on), ``'warn'`` from then
            on (one unusual batch does not stop a run in progress). Where
            only the previous call's graph of another signature, alive
            through this call's forward, makes it infeasible, ``'warn'``
            runs that call under its plan, over the budget, and the
            signature stays planned.
        plan_at: when a recorded iteration is planned. ``'backward'``
            (default): at the end of its own backward, so that the planner's
            memory lands in that plain, recorded step and never in a step the
            budget bounds (that step then peaks above plain Chainer's by the
            planner's memory, host memory on a GPU). ``'call'``: at the next
            call, before its meter starts (the recorded step is plain
            Chainer's to the byte; the planner's memory comes at the start
            of the first planned call, below that call's peak when
            activations dominate, above it on tiny models). A model that
            keeps the recorded graph in an attribute (``L.Classifier``'s
            ``loss``) is always planned at the end of its backward, and that
            graph then releases what the plan drops; a bare callable (no
            Link) always at its next call.
        keep: functions whose outputs no plan drops: link paths as
            ``namedlinks()`` names them (``['/predictor/res5', '/attn']``:
            every function applied by that link or a link under it), a
            function taking a recorded function (its ``.op``, ``.link``,
            ``.label``) and returning True for those to keep, or a list of
            both; ``None`` (default): none. The solvers plan with them kept
            (their memory in every figure, the least budget included). A
            path that names no link is refused, with the closest names: for
            a Link's call at the first call, else at the first plan (see
            :mod:`~chainer_recompute.core.keep`).
        free_previous_graph: False (default): the graph of an earlier call
            lives as long as something holds it, as in plain Chainer (a
            backward through it works whatever came between: a later call,
            ``chainer.grad``, a hand-written differentiable backward,
            ``@static_graph``); what a graph held into the next call still
            holds is measured at that call and planned for (the step stays
            under the budget). True (opt-in): when the model is called
            again for training, release what the graphs of earlier calls
            whose backward has run still hold (outputs, retained and
            attribute arrays, the previous batch), so that a loop that keeps
            its ``loss`` into the next forward holds none of it there: less
            memory, but a backward through such a graph afterwards raises
            :class:`UnsafeRecomputeError`.
        calls_per_step: how many times a training step calls ``fn`` before
            one backward through them all (a discriminator on the real and
            the fake batch: 2), when known: every plan is made for that many
            from the first call. None (default): found at the call that
            shows a later call of a step, and planned for from there (that
            step's earlier calls ran under a plan for fewer; said once).
        **solver_options: passed to the solver.

    Input shapes that change from call to call (a batch padded to its
    longest sequence or molecule, a last partial batch): once two shapes of
    the same structure have been recorded, a call at a new shape is planned
    before it runs, from a graph fitted through the recorded shapes on one
    line of input shapes with it (each size the polynomial of least degree
    through them: linear through two; a size quadratic in the input's
    dimensions, pairs of atoms, is fitted once three are recorded); the
    plan of the largest recorded shape is
    reused when its replayed peak at the new shape fits the budget (with
    ``'least'``: that shape's least budget; no solver run), else the scaled
    graph is solved. A new value of a number argument (an ``np.float32``
    schedule value) with the same shapes reuses the graph, plan and
    program as they are. The executor checks the
    scaled graph against the call as for any plan; a call that does not
    match it is recorded and planned from its recording (that step is not
    held to the budget: one warning under a byte budget). The second shape
    is recorded plainly, with one warning when a byte budget is set.

    A step that calls ``fn`` several times before one backward through
    them all (a discriminator on the real and the fake batch) is planned
    for that many calls per step from the call that reveals them, and
    measured as one step; ``calls_per_step`` plans the first step so too
    (docs/defaults.md).

    >>> runner = Recompute(loss_fn, budget='2G')            # doctest: +SKIP
    >>> loss = runner(x, t); loss.backward()                # doctest: +SKIP
    """

    #: A plan that drops nothing, once checked, runs as plain Chainer (no
    #: hook); False keeps the executor's hook on (to measure its cost).
    plain_when_nothing_dropped = True

    #: A signature whose structure changed this many times, and on more
    #: than half of its calls, runs plain Chainer from then on.
    PLAIN_AFTER = 6

    #: After this many training calls in a row of signatures never seen
    #: before, each recorded and planned, none of those plans used (an
    #: object detector's images of their own sizes and boxes), a new
    #: signature's first call is no longer recorded: one that nothing plans
    #: before it runs runs as plain Chainer without the hook, one whose plan
    #: from its family does not fit it is not planned from; its second call
    #: is recorded.
    RECORD_NEW_AFTER = 8

    def __init__(self, fn: Callable[..., Any], budget: Any, *, solver: str = "auto",
                 strategy: str = "tc", cost: str = "measured", max_plans: int = 8,
                 max_structures: int = 4, capture_batch: Any = "auto",
                 verify: bool = True, budget_scope: str = "total", check_iterations: int = 3,
                 verbose: bool = True, coordinator: Any = None, workspace: Any = None,
                 workspace_exact: bool = True, on_infeasible: str = "auto",
                 plan_at: str = "backward", free_previous_graph: bool = False,
                 keep: Any = None, calls_per_step: Optional[int] = None,
                 **solver_options: Any) -> None:
        spec = RunnerSpec.parse(
            solver=solver, strategy=strategy, cost=cost, max_plans=max_plans,
            max_structures=max_structures, capture_batch=capture_batch, verify=verify,
            budget_scope=budget_scope, check_iterations=check_iterations, verbose=verbose,
            workspace=workspace, workspace_exact=workspace_exact, on_infeasible=on_infeasible,
            plan_at=plan_at, free_previous_graph=free_previous_graph, keep=keep,
            calls_per_step=calls_per_step, **solver_options)
        if coordinator is not None and not all(
                callable(getattr(coordinator, name, None)) for name in ("plan", "on_call")):
            raise RecomputeError(
                f"coordinator= takes an object with plan(graph, solve) and on_call(runner, "
                f"signature, state), such as chainer_recompute.distributed.Coordinator(comm); "
                f"got {type(coordinator).__name__}")
        self.fn = fn
        self.coordinator = coordinator
        #: each input signature's plans (:class:`~.signatures.SignatureCache`)
        self.entries = SignatureCache(spec.max_plans)
        #: makes the plans (:class:`~.planning.Planner`); holds the budget
        self.planner = Planner(fn, spec, parse_budget(budget), self.entries, coordinator)
        # (weakly: a runner freed with its model is not kept in a cycle)
        self.planner.runner_solve = weakref.WeakMethod(self.solve)
        #: measures the steps and corrects their plans (:class:`~.metering.StepMeter`)
        self.steps = StepMeter(spec, self.planner)
        self._spec = spec
        #: the options as given (a model copied or sent to another process
        #: gets a runner made from them)
        self.options: Dict[str, Any] = dict(
            budget=budget, solver=solver, strategy=strategy, cost=cost, max_plans=max_plans,
            max_structures=max_structures, capture_batch=capture_batch, verify=verify,
            budget_scope=budget_scope, check_iterations=check_iterations, verbose=verbose,
            coordinator=coordinator, workspace=workspace, workspace_exact=workspace_exact,
            on_infeasible=on_infeasible, plan_at=plan_at,
            free_previous_graph=free_previous_graph, keep=keep, calls_per_step=calls_per_step,
            **solver_options)
        self.last_stats: Optional[IterationStats] = None
        self._said_mismatch = False  # a call off its plan under a byte budget (warned once)
        self._said_eval_backward = False  # a backward through a call in evaluation mode
        #: the model's @static_graph chains (None: not looked for yet)
        self._static_chains: Optional[Tuple[str, ...]] = None
        self._said_static = False
        self._new_recorded = 0  # training calls in a row that recorded a new signature

    # ---------------------------------------------------------- options
    @property
    def spec(self) -> RunnerSpec:
        """The options, parsed (:class:`~.spec.RunnerSpec`); set a new one
        with :func:`dataclasses.replace` (its planner and meter follow)."""
        return self._spec

    @spec.setter
    def spec(self, spec: RunnerSpec) -> None:
        self._spec = self.planner.spec = self.steps.spec = spec

    def check_keep(self, model: chainer.Link) -> None:
        """Refuse a ``keep=`` path that names no link of ``model`` (by its
        ``namedlinks()``), with the closest names.

        Raises:
            KeepError: a path names no link of ``model``.
        """
        self.planner.check_keep(model)

    # ----------------------------------------------------------- budget
    @property
    def budget(self) -> Budget:
        """The budget as parsed (:class:`~chainer_recompute.core.budget_spec.Budget`);
        ``'device'`` is resolved at the first plan (:meth:`resolve_device_budget`)."""
        return self.planner.budget

    @property
    def budget_least(self) -> bool:
        """Whether the budget is ``'least'``."""
        return self.planner.budget.is_least

    @property
    def budget_bytes(self) -> Optional[int]:
        """The budget in bytes: a size, or ``'device'`` once resolved; None
        for ``'least'`` and a share (resolved per signature, in its plan's
        ``budget_bytes``)."""
        return self.planner.budget_bytes

    def available_bytes(self) -> Optional[int]:
        """For a ``'device'`` budget not yet resolved: what the device of
        the latest training call's arrays can give now (before
        :data:`~chainer_recompute.core.budget_spec.DEVICE_MARGIN`); None
        otherwise."""
        return self.planner.available_bytes()

    def resolve_device_budget(self, available_bytes: Optional[int] = None) -> None:
        """Fix a ``'device'`` budget at ``available_bytes`` less the margin
        (default: :meth:`available_bytes`); a coordinator passes the least
        of every rank's. Once resolved, it stays for the runner's life."""
        self.planner.resolve_device_budget(available_bytes)

    @property
    def shapes_derived(self) -> int:
        """How many signatures were planned from their family's graphs."""
        return self.planner.shapes_derived

    # ------------------------------------------- public: for a coordinator
    def solve(self, graph: Any) -> Any:
        """``graph`` solved here, for this runner's budget and options (what
        a coordinator's root calls; :meth:`plan` asks the coordinator).

        Raises:
            InfeasibleBudgetError: the budget cannot be met."""
        return self.planner.solve(graph)

    def plan(self, graph: Any) -> Any:
        """A plan for ``graph``: solved here, or, with a coordinator, the
        one it gives (``coordinator.plan(graph, self.solve)``)."""
        return self.planner.plan(graph)

    def planned_graphs(self) -> list:
        """The graph of every planned structure of every signature (each
        once), most recently used signature last."""
        return self.planner.planned_graphs()

    def adopt(self, graph: Any, plan: Any, *, replacing: Any) -> None:
        """Run ``plan`` (made elsewhere, for ``graph``: a coordinator's
        collective re-plan) in place of every structure planned for
        ``replacing`` (one of :meth:`planned_graphs`); ``graph`` is
        ``replacing`` with other measurements (a correction)."""
        self.planner.adopt(graph, plan, replacing=replacing)

    # ------------------------------------------------------------ plans
    @property
    def plans(self) -> Dict[Hashable, Any]:
        """The plan of each signature's most recently used structure."""
        return {k: e.structures[0].plan for k, e in self.entries.items() if e.structures}

    def signatures(self) -> Tuple[SignatureView, ...]:
        """What the runner keeps for each input signature it has seen
        (least recently used first, at most ``max_plans``): read-only
        :class:`~.views.SignatureView` snapshots, each with its planned
        structures (graph, plan, program, planning time), most recently
        used first.

        >>> (sig,) = cr.runner_of(model).signatures()       # doctest: +SKIP
        >>> sig.structures[0].plan.predicted_peak_bytes     # doctest: +SKIP
        """
        return views_of(self.entries.items())

    def clear(self) -> None:
        """Forget every plan."""
        self.entries.clear()

    @staticmethod
    def signature(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Hashable:
        """The input signature of a call with ``args`` and ``kwargs``: each
        signature has plans of its own (see :mod:`.signatures`)."""
        return _signature(args, kwargs)

    def call_state(self, signature: Hashable) -> Optional[str]:
        """What the training call in progress with ``signature`` does:
        ``'plain'`` (runs plain Chainer), ``'plan'`` (plans its recorded
        iteration, then runs under the plan), ``'run'`` (runs under a
        plan), ``'capture'`` (the first call with ``capture_batch``: plans
        from a separate capture first) or ``'record'`` (runs plainly while
        its graph is recorded); None for a signature it has not seen."""
        entry = self.entries.get(signature)
        if entry is None:
            return None
        return ("plain" if entry.plain else "plan" if entry.pending is not None
                else "run" if entry.structures
                else "capture" if entry.calls == 1 and self.planner.captures(entry.batch)
                else "record")

    def plans_before_forward(self, signature: Hashable) -> bool:
        """Whether the training call in progress with ``signature`` calls
        :meth:`plan` (so ``coordinator.plan``) before its forward."""
        return self.call_state(signature) in ("plan", "capture")

    def plan_for(self, *args: Any, **kwargs: Any) -> Any:
        """The plan for these inputs: the current one, or one made now from
        a separate capture that leaves no trace."""
        if self.steps.pending:
            self.steps.apply_pending()
        entry = self.entries.entry(self.signature(args, kwargs))
        if entry.pending is not None:
            self.planner.plan_pending(entry, args, kwargs)
        if not entry.structures and not self.planner.plan_separately(entry, args, kwargs):
            raise RecomputeError(self.planner.refusal)
        return entry.structures[0].plan

    # ------------------------------------------------------------- call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (chainer.config.train and chainer.config.enable_backprop) or _depth() > 0:
            if _depth() == 0 and not self.steps.awaiting_backward():
                self.steps.close_step()  # an evaluation between two steps is not in either
            out = self.fn(*args, **kwargs)
            if chainer.config.enable_backprop and not self._said_eval_backward and _depth() == 0:
                _watch_eval_backward(self, out, args)
            return out
        link = link_of(args)
        if self._static_graph(link):
            self.last_stats = IterationStats(path="plain")
            return self.fn(*args, **kwargs)
        mark = _step_mark(link)
        entry = self._begin(link, mark, args, kwargs)
        if entry.plain or not self._plan_before_forward(entry, args, kwargs):
            self.last_stats = IterationStats(path="plain")
            return self.fn(*args, **kwargs)
        if self._checked_plain(entry):
            self._new_recorded = 0  # (a plan used: see _count_new)
            return self.fn(*args, **kwargs)
        hook, out = self._run(entry, link, mark, args, kwargs)
        self._after_forward(entry, hook, link, args, kwargs)
        return out

    def _static_graph(self, link: Optional[chainer.Link]) -> bool:
        """Whether the model has a ``@static_graph`` chain (looked for at
        the first training call, said then): Chainer's static schedule
        keeps and reuses its own arrays, which no plan can drop, and a
        capture at another batch size would build and keep a schedule of
        its own; so the model runs as plain Chainer, its budget not
        applied."""
        if self._static_chains is None:
            from ..capture.safety import static_graph_chains
            self._static_chains = tuple(static_graph_chains(link)) if link is not None else ()
        if not (self._static_chains and getattr(chainer.config, "use_static_graph", True)):
            return False  # (use_static_graph=False: the chains run define-by-run)
        if not self._said_static:
            self._said_static = True
            report.warning(
                "%s has @static_graph chains (%s): Chainer's static schedule keeps its own "
                "arrays, which recomputation cannot drop; it runs as plain Chainer and the "
                "budget is not applied (remove @static_graph, or run with "
                "chainer.config.use_static_graph = False, to plan it)",
                name_of(self.fn, (link,)), ", ".join(self._static_chains))
        return True

    def _begin(self, link: Optional[chainer.Link], mark: Any, args: Tuple[Any, ...],
               kwargs: Dict[str, Any]) -> Any:
        """The start of a training call, before anything of it runs: the
        previous step closed (measured, checked) unless this call is a
        later one of the same step, corrections and graphs held from earlier
        calls planned for, and this call's signature entry (raises a budget
        that cannot be met, or sets the entry to run plainly)."""
        steps, planner = self.steps, self.planner
        # (planning's memory is in no iteration: before any meter starts)
        steps.find_step(mark)
        steps.close_step(continued=steps.in_step())
        if self.spec.free_previous_graph:
            steps.let_go_of_finished_graphs()
        if not planner.keep_checked and link is not None:
            planner.check_keep(link)  # before anything runs
        sig = self.signature(args, kwargs)
        entry = self.entries.entry(sig)
        if self.budget.kind == "device" and not self.budget.resolved:
            from ..device import device_of
            planner.device = device_of(list(args) + list(kwargs.values()))
        # plans made again here, where no step's meter runs: after a
        # correction, for a graph held into this call, for more calls per step
        planner.held_other = 0  # (this call's: see StepMeter.count_held_graph)
        # (before the planner's memory is measured from here: what a
        # recorded graph frees first hid as much of it)
        steps.release_recorded()
        with planner.watch_planning(entry, args, kwargs, "again at a training call",
                                    held=lambda: steps.held_previous_bytes(entry)):
            if steps.pending:
                steps.apply_pending()
            steps.count_held_graph(entry)
            steps.count_step_calls(entry, args)
            steps.count_grads_alive(entry, link)
        if entry.error is not None:
            planner.infeasible(entry, entry.error)  # raises, or runs this signature plainly
        entry.calls += 1
        entry.batch = batch_size_of(args, kwargs)
        if self.coordinator is not None:
            self.coordinator.on_call(self, sig, self.call_state(sig))
        return entry

    def _plan_before_forward(self, entry: Any, args: Tuple[Any, ...],
                             kwargs: Dict[str, Any]) -> bool:
        """Plan what is to be planned before the forward (a recorded
        iteration, a first call from its family's shapes or from captures)
        and decide the release mode of plans backpropagated twice. False:
        this call runs plainly: the budget cannot be met (said), or it is
        the first call of a signature, which nothing planned, once first
        calls are not recorded (:data:`RECORD_NEW_AFTER`)."""
        planner = self.planner
        try:
            if entry.pending is not None:
                planner.plan_pending(entry, args, kwargs)
            elif not entry.structures and entry.calls == 1:
                # a new shape of a recorded family first (no capture), then
                # a separate capture
                if not planner.plan_in_call(entry, args, kwargs) and \
                        not planner.record_first_calls:
                    return False
        except InfeasibleBudgetError as e:
            if not self._plan_without_held_other(entry, args, kwargs, e):
                planner.infeasible(entry, e)
                return False
        undecided = [s for s in entry.structures
                     if s.program.multi_backward and not s.program.release_mode_decided]
        if undecided:  # (no meter at the calls that decide nothing)
            with planner.watch_planning(entry, args, kwargs, "again at a training call",
                                        held=lambda: self.steps.held_previous_bytes(entry)):
                for s in undecided:
                    planner.decide_release(s)  # (may plan again: a pass after the update)
        return True

    def _plan_without_held_other(self, entry: Any, args: Tuple[Any, ...],
                                 kwargs: Dict[str, Any], e: InfeasibleBudgetError) -> bool:
        """A signature's first call whose budget only the previous call's
        graph of another signature makes infeasible (``planner.held_other``,
        alive through this forward): planned without that graph, and run
        under that plan over the budget (:meth:`StepMeter.run_beyond`), the
        signature planned for its next calls. False where that is not the
        case (the error is then said, or raised)."""
        planner = self.planner
        held = planner.held_other
        if not held or entry.pending is not None or planner._raising():
            return False
        planner.held_other = None
        try:
            planned = planner.plan_in_call(entry, args, kwargs) and bool(entry.structures)
        except InfeasibleBudgetError:
            planned = False
        finally:
            planner.held_other = held
        if planned:
            self.steps.run_beyond(entry.structures[0], held, e)
        return planned

    def _count_new(self, entry: Any, hook: IterationHook, args: Tuple[Any, ...]) -> None:
        """Count a new signature's first call that recorded its graph
        (nothing planned it, or its plan did not fit it); a call that ran
        its plan through ends the count. At :data:`RECORD_NEW_AFTER` in a
        row, first calls are no longer recorded or planned from (said once;
        not with a coordinator: its processes record together)."""
        if hook.stats.path == "planned":
            self._new_recorded = 0
            return
        if entry.calls != 1 or not hook.recorder.recording:
            return
        self._new_recorded += 1
        planner = self.planner
        if (self._new_recorded < self.RECORD_NEW_AFTER or not planner.record_first_calls
                or self.coordinator is not None):
            return
        planner.record_first_calls = False
        # (captures that failed on each of them: two more forwards and
        # backwards at every new signature, for nothing)
        planner.capture_first_calls = not planner.captures_failed
        why = (f"a plan made from its earlier shapes did not fit it: {hook.stats.mismatch}"
               if hook.stats.mismatch else planner.refusal or "nothing could plan it")
        report.warning(
            "%s had a new input signature at each of its last %d training calls, each "
            "recorded and planned, its plan never used (%s). From now on the first call of a "
            "new signature that nothing plans before it runs is not recorded (it runs as plain "
            "Chainer, as a recorded call does)%s, one run under a plan made from its family "
            "that does not fit it is not planned from, and its graph is recorded at its second "
            "call", name_of(self.fn, args), self._new_recorded, why,
            "" if planner.capture_first_calls else " nor captured at smaller batches")

    def _checked_plain(self, entry: Any) -> bool:
        """A plan that drops nothing, checked against the allocator, runs as
        plain Chainer, no hook (its structure is no longer followed), where
        plain Chainer keeps its budget: True then, its stats set."""
        if not (len(entry.structures) == 1 and not entry.structures[0].program.dropped
                and entry.structures[0].checked >= self.spec.check_iterations
                and self.plain_when_nothing_dropped and self._plain_fits(entry.structures[0])):
            return False
        self.steps.last_hook = None
        s = entry.structures[0]
        stats = self.last_stats = IterationStats(0, path="planned")
        stats.n_nodes, stats.release_mode = s.program.n, s.program.release_mode
        stats.predicted_peak_bytes = s.plan.predicted_peak_bytes
        stats.budget_bytes = s.plan.budget_bytes
        return True

    def _plain_fits(self, s: Any) -> bool:
        """Whether plain Chainer keeps the budget of structure ``s``, whose
        plan drops nothing: with its graph held through the optimizer's
        update (a loop that keeps its ``loss`` until then holds it), where
        the executor releases each array after its last backward reader
        (the plan's release mode ``none``: the least budget of a model that
        drops nothing can count on those releases). Checked once."""
        if s.plain_fits is None:
            from ...core.budget import limit_of
            from ...core.replay import replay
            budget, scope = s.plan.budget_bytes, self.spec.budget_scope
            if s.program.release_mode != "none" or budget is None:
                s.plain_fits = True
            else:
                held = replay(s.graph.with_step(kept_after_backward=True), None,
                              release_mode="all").peak_bytes
                s.plain_fits = (held <= s.plan.predicted_peak_bytes
                                or (scope == "total" and held <= limit_of(budget)))
        return s.plain_fits

    def _run(self, entry: Any, link: Optional[chainer.Link], mark: Any,
             args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[IterationHook, Any]:
        """The forward under the backward driver (recording when there is
        no plan), its meter started; the driver and the output."""
        steps = self.steps
        # Fewest functions first (most recently used first among equals): a
        # forward that goes on past a plan's last function switches to a
        # longer plan that matches it, while one that stops before a plan's
        # end could not switch back (a loss with and without its box term).
        programs = sorted((s.program for s in entry.structures), key=lambda p: p.n)
        hook = IterationHook(programs, link=link,
                             args=list(args) + list(kwargs.values()), verify=self.spec.verify)
        if entry.structures:
            steps.watch_held_graph(hook)
            steps.start(entry, hook, link, args, kwargs)
        hook.step_mark = mark
        steps.track(hook, entry, list(args) + list(kwargs.values()))
        steps.watch_gradients(hook, entry, link)
        limit = entry.structures[0].workspace_bytes if entry.structures else None
        with _Active(), hook, bounded(limit, self.spec.workspace_exact):
            out = self.fn(*args, **kwargs)
        hook.finish(out)
        return hook, out

    def _after_forward(self, entry: Any, hook: IterationHook, link: Optional[chainer.Link],
                       args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """After the forward: its stats; a recorded iteration set to be
        planned (a planned call that left its plan counted, and a signature
        whose structure keeps changing run plainly from now on); the plan
        used made the most recent."""
        planner = self.planner
        self.steps.check_held_graph(entry, hook)
        self.last_stats = hook.stats
        self._count_new(entry, hook, args)
        if hook.stats.path == "planned":
            planner.ran_planned = True
        for s in entry.structures:
            if s.program is hook.program:
                hook.stats.predicted_peak_bytes = s.plan.predicted_peak_bytes
                hook.stats.budget_bytes = s.plan.budget_bytes
        if not hook.recorder.recording:
            used = hook.program
            entry.structures.sort(key=lambda s: s.program is not used)
            return
        if entry.calls == 1 and not planner.record_first_calls:
            # a new signature's first call, recorded (the call that counted
            # to RECORD_NEW_AFTER) or off the plan made from its family: not
            # planned from
            if entry.structures:
                self._mismatched(hook, args)
            return
        entry.pending = hook
        if self.coordinator is None:
            planner.plan_when_backward_ends(entry, hook, link)
        if entry.structures:
            entry.recorded += 1
            self._mismatched(hook, args)
            if entry.recorded >= self.PLAIN_AFTER and 2 * entry.recorded > entry.calls:
                entry.plain, entry.pending = True, None
                entry.structures.clear()
                report.warning(
                    "the graph of %s changed on %d of its %d calls "
                    "with the same input signature; running it without recomputation "
                    "from now on", name_of(self.fn, args),
                    entry.recorded, entry.calls)
        # what the caller's own work allocates before this graph's backward
        # (its loss, a target network's forward) is measured into the
        # recorded graph (the last thing before the return)
        from ..device import device_of
        hook.recorder.watch_outside(device_of(list(args) + list(kwargs.values())))

    def _mismatched(self, hook: IterationHook, args: Tuple[Any, ...]) -> None:
        """A planned call stopped matching its plan: from there it keeps
        what it has not released, as plain Chainer does, and its structure
        is recorded for the next calls. Under a byte budget that step is not
        held to it: a warning, once per runner (else at info level)."""
        graph = hook.program.graph if hook.program is not None else None
        derived = graph.step.derived_from if graph is not None else None
        if self.budget_bytes is None or self._said_mismatch:
            logger.info("the model's graph changed for the same input signature (%s); this "
                        "iteration keeps what it had not released and the next call plans "
                        "the new structure", hook.stats.mismatch)
            return
        self._said_mismatch = True
        cause = (f"the plan's graph was derived from the shapes recorded nearest to "
                 f"{tuple(derived)}, and a size of this call does not follow them (a third "
                 f"recorded shape fits sizes quadratic in the input's)" if derived is not None
                 else "the model's graph depends on more than its input signature")
        report.warning("the model's graph changed from its plan's in a call of %s (%s): %s. "
                       "From there this step keeps what it has not released, as plain Chainer "
                       "does, and is not held to the budget %s; its structure is recorded and "
                       "planned for the next calls", name_of(self.fn, args), hook.stats.mismatch,
                       cause, format_bytes(self.budget_bytes))

    def __repr__(self) -> str:
        return (f"Recompute(budget={self.budget.describe()}, solver={self.spec.solver!r}, "
                f"strategy={self.spec.strategy!r}, signatures={len(self.entries)})")


class _EvalBackward(chainer.FunctionHook):
    """On the functions that made the outputs of a call in evaluation mode
    with backprop enabled (which runs as plain Chainer): a backward through
    them is said once, with the budget it is not under."""

    name = "chainer_recompute-evaluation-backward"

    def __init__(self, runner: "Recompute", what: str) -> None:
        self.runner = weakref.ref(runner)  # (the functions hold this hook)
        self.what = what

    def backward_preprocess(self, function: Any, in_data: Any, out_grad: Any) -> None:
        runner = self.runner()
        if runner is None or runner._said_eval_backward:
            return
        runner._said_eval_backward = True
        report.warning(
            "%s was called in evaluation mode (chainer.config.train False) with backprop "
            "enabled, and a backward runs through it (an input gradient: an attack run in "
            "evaluation mode): such a call runs as plain Chainer, as evaluation does, its "
            "activations and backward not under the budget (%s); run it in training mode "
            "(chainer.config.train True) to plan it", self.what, runner.budget.describe())


def _watch_eval_backward(runner: Recompute, out: Any, args: Tuple[Any, ...]) -> None:
    """See :class:`_EvalBackward`: hooked on the creators of the call's
    output Variables (any backward through the call passes them)."""
    from ..capture import result_variables
    hook = None
    for v in result_variables(out):
        creator = v.creator_node
        if creator is not None:
            hook = hook or _EvalBackward(runner, name_of(runner.fn, args))
            creator.local_function_hooks[hook.name] = hook
