"""Planning for a runner: solving a graph for the budget (under the
workspace bound), plans from a recorded iteration, from a separate
capture or from the shape family, and what the executor releases after
a backward pass."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .. import _chainer  # noqa: F401
import chainer

from ...core.budget import release_caches
from ...core.budget_spec import Budget
from ...core.errors import InfeasibleBudgetError
from ...core.graph import Graph
from ...core.replay import replay_peak
from ...core.units import format_bytes
from ..capture import batch_size_of, detached_arguments, leave_no_trace, state_bytes
from ..executor import IterationHook, Program
from ..program import Probation
from .describe import describe_plan
from .log import logger, report
from .spec import RunnerSpec
from .state import _Active, _Entry, _Recording, _Structure

#: ``capture_batch='auto'`` captures a first call below this batch at 1
#: and 2 (then 2 and 4 above batch 4 where those cannot plan it), from it
#: on at 2 and 4: the captures' own peak, plain Chainer's at their batch,
#: is then a quarter of plain's activations or less
AUTO_SMALL_BELOW = 16


def link_of(args: Tuple[Any, ...]) -> Optional[chainer.Link]:
    """The Link a call applies (its first argument, for a Link's call)."""
    return args[0] if args and isinstance(args[0], chainer.Link) else None


def name_of(fn: Any, args: Tuple[Any, ...]) -> str:
    """The name a runner's messages give the model of a call."""
    link = link_of(args)
    return type(link).__name__ if link is not None else \
        getattr(fn, "__qualname__", "the model")


def _kept_attributes(link: chainer.Link, hook: Any) -> List[Tuple[chainer.Link, str]]:
    """The attributes of ``link`` (and of the Links in it) that keep a
    Variable of the graph ``hook`` recorded (``L.Classifier``'s ``loss``,
    ``y``), as ``(link, name)``."""
    return [(sub, name) for sub in link.links() for name, v in vars(sub).items()
            if isinstance(v, chainer.Variable) and not isinstance(v, chainer.Parameter)
            and v.node in hook.recorder.array_of]


def _retained_grad_bytes(attrs: List[Tuple[chainer.Link, str]], hook: Any) -> int:
    """Bytes of the gradients that a ``backward(retain_grad=True)`` left on
    the graph's Variables kept in ``attrs`` (:func:`_kept_attributes`), the
    forward's returned ones (the loss, its gradient counted by the replay)
    left out: each buffer once, as its device allocates it."""
    from ..device import device_of
    from .metering import _distinct_bytes
    returned = set(hook.recorder.returned)
    grads = [v.grad for v in (getattr(sub, name) for sub, name in attrs)
             if v.grad is not None and hook.recorder.array_of[v.node] not in returned]
    return _distinct_bytes(device_of(grads), grads) if grads else 0


def _keeps_graph(link: chainer.Link, hook: Any) -> bool:
    """Whether ``link`` (or a Link in it) keeps a Variable of the graph
    ``hook`` recorded in an attribute."""
    return bool(_kept_attributes(link, hook))


@contextlib.contextmanager
def _writes_before_first_function(hook: IterationHook,
                                  attrs: List[Tuple[chainer.Link, str]]) -> Iterator[None]:
    """While the block runs, the classes of the Links of ``attrs``
    (``(link, name)``) note those attributes being set; at ``hook``'s first
    function, ``hook.lets_go`` says whether every one was (the values are
    left alone: a stateful Link that reads its state before its first
    function reads its own)."""
    if not attrs:
        yield
        return
    watched = {(id(sub), name) for sub, name in attrs}
    written: set = set()
    before_first = [True]
    patched = []

    def tracking(original: Any) -> Any:
        def __setattr__(self: Any, name: str, value: Any) -> None:
            if before_first[0] and (id(self), name) in watched:
                written.add((id(self), name))
            original(self, name, value)
        return __setattr__

    for cls in dict.fromkeys(type(sub) for sub, _ in attrs):
        patched.append((cls, cls.__dict__.get("__setattr__")))
        cls.__setattr__ = tracking(cls.__setattr__)
    this = weakref.ref(hook)  # (no cycle: the hook holds the check)

    def first() -> None:
        before_first[0] = False
        h = this()
        if h is not None:
            h.lets_go = written == watched
    hook.on_first_function = first
    try:
        yield
    finally:
        for cls, own in reversed(patched):
            if own is None:
                del cls.__setattr__
            else:
                cls.__setattr__ = own


def _let_go(graph: Graph, hook: IterationHook) -> Graph:
    """``graph`` (scaled from captures, the last of them ``hook``'s) not
    held into the next call's forward where that capture saw the model let
    go of the graph the previous one kept before its first function."""
    if graph.step.held_into_next_forward and getattr(hook, "lets_go", False):
        return graph.with_step(held_into_next_forward=False)
    return graph


def _saved_at_update(program: Program, mode: str) -> int:
    """The bytes of the parameter values that an update saves (on
    probation, or at each update where a later pass regenerates after it:
    :attr:`Program.saves_parameters`) where the backward before it released
    in ``mode``: those of the parameters that the released nodes read
    (every releasable node in ``none``, the dropped ones in
    ``checkpoints``, none in ``all``)."""
    g = program.graph
    nodes = (program.releasable if mode == "none" else
             program.dropped if mode == "checkpoints" else ())
    params = {a for u in nodes for a in g.nodes[u].inputs if g.arrays[a].kind == "param"}
    return sum(g.arrays[a].nbytes for a in params)


def _program(graph: Graph, plan: Any, param_refs: Dict[int, Any], multi_backward: bool,
             backward_known: bool, probation: Optional[Probation]) -> Program:
    """The executor's program of ``plan`` for ``graph``, with what the
    runner knows of its iterations (``probation``: the record of the
    program it replaces, continued)."""
    program = Program(graph, plan.lower_sets, frozenset(plan.kept), param_refs=param_refs,
                      inner=plan.inner, levels=plan.levels, backward_order=plan.backward_order)
    program.multi_backward = multi_backward
    program.backward_known = backward_known
    if probation is not None:
        program.probation = probation
    return program


def _peak_with_a_later_pass(held: Graph, program: Program, mode: str) -> int:
    """The replayed peak of ``program`` in release ``mode`` (its graph
    held through the update, ``held``) where a backward pass after the
    update regenerates from the parameter values saved at it (held from
    the update through that pass; that pass itself no replay counts)."""
    from ...core.replay import replay
    return replay(held, program, release_mode=mode).peak_bytes + _saved_at_update(program, mode)


class Planner:
    """Makes a runner's plans: from captures, a recorded iteration, the
    shapes of a signature's family, or again (a correction, more calls per
    step); what the executor releases; the budget, resolved.

    Args:
        fn: the runner's callable.
        spec: the runner's options (:class:`~.spec.RunnerSpec`).
        budget: the budget as parsed (``'device'`` resolved at the first plan).
        entries: the runner's signatures (:class:`~.signatures.SignatureCache`).
        coordinator: plans collectively across processes, or None.
    """

    def __init__(self, fn: Any, spec: RunnerSpec, budget: Budget, entries: Any,
                 coordinator: Any = None) -> None:
        self.fn, self.spec, self.entries, self.coordinator = fn, spec, entries, coordinator
        #: what a coordinator is given to solve with: the runner's bound
        #: ``solve`` (a weak method)
        self.runner_solve: Optional[Any] = None
        #: the budget as parsed (:class:`~chainer_recompute.core.budget_spec.Budget`);
        #: ``'device'`` is resolved at the first plan (:meth:`resolve_device_budget`)
        self.budget: Budget = budget
        self.device: Any = None  # the device of the latest training call's arrays
        self.keep_checked = not spec.keep.paths  # its paths checked against link names
        self.ran_planned = False  # a planned iteration has run
        self.shapes_derived = 0  # signatures planned from their family's graphs
        # the most calls of the model one step has held at once, and of those
        # the calls holding their whole graph (see StepMeter.count_step_calls)
        self.step_calls, self.whole_calls = spec.calls_per_step or 1, 0
        # what a graph of another signature holds through this call's forward
        # (see StepMeter.count_held_other); None: plans count no such graph,
        # not even one their family's graph brings (Recompute's
        # _plan_without_held_other)
        self.held_other: Optional[int] = 0
        # the loop's gradients alive when a backward begins (see
        # StepMeter.watch_gradients): every plan made for them from then on
        self.grads_alive = False
        # the loop holds a graph through the optimizer's update (its loss:
        # see StepMeter.stop): plans that keep arrays after the backward are
        # predicted with it from then on (decide_release)
        self.held_at_update = False
        self._said_kept_over = False  # (decide_release)
        self.refusal = ""  # why captures could not plan a first call
        self.captures_failed = False  # the last first call's captures ran and failed
        #: the first call of a new signature is planned from captures (False:
        #: not, once they failed on new signatures call after call, see
        #: ``Recompute._count_new``)
        self.capture_first_calls = True
        #: the first call of a signature that nothing plans before it runs is
        #: recorded (False: not, see ``Recompute.RECORD_NEW_AFTER``)
        self.record_first_calls = True
        self._reported_infeasible = False
        self._said_unsafe: set = set()  # unsafe-function warnings given (one each)
        self._said_capture = False  # capture_batch refused a model (warned once)
        self._said_new_shape = False  # a new input shape recorded plainly (warned once)
        self._said_planning: set = set()  # steps over the budget by planning in them (once each)
        #: while :meth:`watch_planning` measures a call: its captures, (batch,
        #: peak with the model's own bytes)
        self._captures_run: Optional[List[Tuple[int, int]]] = None
        # structures added (planned or adopted), replaced or replayed, to see
        # planning in a call
        self.plans_made = 0

    # ------------------------------------------------------------- keep
    def check_keep(self, model: chainer.Link) -> None:
        """Refuse a ``keep=`` path that names no link of ``model`` (by its
        ``namedlinks()``), with the closest names.

        Raises:
            KeepError: a path names no link of ``model``.
        """
        self.spec.keep.check_names((name for name, _ in model.namedlinks()),
                                   f"{type(model).__name__}")
        self.keep_checked = True

    def _with_keep(self, graph: Any) -> Any:
        """``graph`` with the functions ``keep=`` names marked
        (:attr:`~chainer_recompute.core.graph.Node.must_keep`); its paths
        are checked against the graph's links when no model's were."""
        keep = self.spec.keep
        if not keep:
            return graph
        if not self.keep_checked:
            keep.check_graph(graph)
            self.keep_checked = True
        return keep.mark(graph)

    # ----------------------------------------------------------- budget
    @property
    def budget_bytes(self) -> Optional[int]:
        """The budget in bytes: a size, or ``'device'`` once resolved; None
        for ``'least'`` and a share (resolved per signature, in its plan's
        ``budget_bytes``)."""
        return self.budget.bytes if self.budget.kind in ("bytes", "device") else None

    def available_bytes(self) -> Optional[int]:
        """For a ``'device'`` budget not yet resolved: what the device of
        the latest training call's arrays can give now (before
        :data:`~chainer_recompute.core.budget_spec.DEVICE_MARGIN`); None
        otherwise."""
        if self.budget.kind != "device" or self.budget.resolved:
            return None
        from ..device import CPU
        return (self.device or CPU).available_bytes()

    def resolve_device_budget(self, available_bytes: Optional[int] = None) -> None:
        """Fix a ``'device'`` budget at ``available_bytes`` less the margin
        (default: :meth:`available_bytes`); a coordinator passes the least
        of every rank's. Once resolved, it stays for the runner's life."""
        if self.budget.kind != "device" or self.budget.resolved:
            return
        b = self.budget.of_device(available_bytes if available_bytes is not None
                                  else self.available_bytes())
        self.budget = b
        logger.info("budget %s", b.describe())

    def planning_budget(self) -> Budget:
        """The budget planning uses: ``'device'`` resolved (at the first
        plan), a share resolved by the planner for each graph."""
        if self.budget.kind == "device":
            self.resolve_device_budget()
        return self.budget

    def budget_bytes_for(self, graph: Any) -> Optional[int]:
        """The budget in bytes for ``graph``'s signature: a share resolved
        against plain Chainer's need for it; None for ``'least'``."""
        b = self.planning_budget()
        if b.kind == "share":
            from ...core.budget import plain_need_bytes
            return b.of_plain(plain_need_bytes(graph, self.spec.budget_scope)).bytes
        return b.bytes

    def _name(self, args: Tuple[Any, ...]) -> str:
        return name_of(self.fn, args)

    @staticmethod
    def _link(args: Tuple[Any, ...]) -> Optional[chainer.Link]:
        return link_of(args)

    # ------------------------------------------- public: for a coordinator
    def solve(self, graph: Graph) -> Any:
        """``graph`` solved here, for this runner's budget and options (what
        a coordinator's root calls; :meth:`plan` asks the coordinator).

        Raises:
            InfeasibleBudgetError: the budget cannot be met. Not logged
                here: a training call raises it (its message is the one the
                user reads, once, in a Trainer's report too), or, with
                ``on_infeasible='warn'``, says it once as a warning."""
        from ...core.budget import plan_for_budget
        graph = self._with_keep(graph)
        return plan_for_budget(graph, self.planning_budget(), solver=self.spec.solver,
                               strategy=self.spec.strategy, scope=self.spec.budget_scope,
                               **self.spec.solver_options)

    def _raising(self) -> bool:
        """Whether an infeasible budget raises from a training call now."""
        return self.spec.on_infeasible == "raise" or (self.spec.on_infeasible == "auto"
                                                 and not self.ran_planned)

    def infeasible(self, entry: _Entry, e: InfeasibleBudgetError) -> None:
        """A training call's budget cannot be met: raise, or say so once and
        run this signature plainly (see ``on_infeasible``)."""
        if self._raising():
            raise e
        from ...core.errors import KeepError
        if isinstance(e, KeepError):  # a setting to fix, whatever on_infeasible says
            raise e
        entry.plain, entry.pending, entry.error = True, None, None
        entry.structures.clear()
        level = logging.INFO if self._reported_infeasible else logging.WARNING
        self._reported_infeasible = True
        report.log(level, "%s; this input signature runs without recomputation, its peak "
                   "not bounded by the budget (on_infeasible='raise' raises instead)",
                   str(e))  # (not the error: a handler keeping records would keep its frames)

    def _bound(self, graph: Graph) -> Tuple[Graph, Any, Optional[int]]:
        """``graph`` with its convolutions' transients under the workspace
        bound, for ``'auto'`` (the bound whose plan fits best) the plan
        made under that bound (None otherwise: planned by :meth:`plan`),
        and the bound (None: none)."""
        from ...core.workspace import bounded_graph, plan_with_workspace
        spec = self.spec
        if spec.workspace != "auto" or spec.budget_scope != "total":
            limit = None if spec.workspace == "auto" else spec.workspace
            return bounded_graph(graph, limit, spec.workspace_exact), None, limit
        try:
            chosen = plan_with_workspace(
                graph, self.planning_budget(), "auto", solver=spec.solver,
                strategy=spec.strategy, scope=spec.budget_scope, exact=spec.workspace_exact,
                **spec.solver_options)
        except InfeasibleBudgetError:
            return bounded_graph(graph, None), None, None  # solve reports it
        # a coordinator plans collectively: its plan, for the bounded graph
        return (chosen.graph, chosen.plan if self.coordinator is None else None,
                chosen.workspace_bytes)

    def plan(self, graph: Graph) -> Any:
        """A plan for ``graph``: solved here, or, with a coordinator, the
        one it gives (``coordinator.plan(graph, solve)``, ``solve`` the
        runner's :meth:`~.Recompute.solve`, :attr:`runner_solve`: a
        coordinator knows the runner by it)."""
        if self.coordinator is None:
            return self.solve(graph)
        solve = self.runner_solve() if self.runner_solve is not None else None
        return self.coordinator.plan(graph, solve or self.solve)

    def planned_graphs(self) -> List[Graph]:
        """The graph of every planned structure of every signature (each
        once), most recently used signature last."""
        seen: Dict[int, Graph] = {}
        for entry in self.entries.values():
            for s in entry.structures:
                seen.setdefault(id(s.graph), s.graph)
        return list(seen.values())

    def adopt(self, graph: Graph, plan: Any, *, replacing: Graph) -> None:
        """Run ``plan`` (made elsewhere, for ``graph``: a coordinator's
        collective re-plan) in place of every structure planned for
        ``replacing`` (one of :meth:`planned_graphs`); ``graph`` is
        ``replacing`` with other measurements (a correction)."""
        for entry in list(self.entries.values()):
            for s in list(entry.structures):
                if s.graph is not replacing:
                    continue
                entry.structures.remove(s)
                self.add(entry, graph, s.program.param_refs, s.program.multi_backward,
                          time.perf_counter(), plan=plan, adopted=True,
                          probation=s.program.probation)

    # ------------------------------------------------------------ plans
    def add(self, entry: _Entry, graph: Graph, param_refs: Dict[int, Any],
             multi_backward: bool, t0: float, plan: Any = None,
             backward_known: bool = False, adopted: bool = False,
             probation: Optional[Probation] = None) -> _Structure:
        """A new structure of ``entry`` (first), for ``graph`` and ``plan``
        (None: planned now; ``adopted``: a plan made elsewhere for ``graph``
        before its workspace bound). ``probation``: the record of the
        structure this one replaces (a plan made again continues it)."""
        self.plans_made += 1
        graph = self._with_facts(graph)
        limit = None  # the convolutions' workspace bound its calls run under
        try:
            if plan is None or adopted:
                if self.spec.workspace is not None:  # the convolutions' bound, chosen with the plan
                    graph, bound_plan, limit = self._bound(graph)
                    if plan is None:
                        plan = bound_plan
                if plan is None:
                    plan = self.plan(graph)
            program = _program(graph, plan, param_refs, multi_backward, backward_known,
                               probation)
            s = _Structure(graph, plan, program, time.perf_counter() - t0, limit)
            if plan.recompute:
                self.decide_release(s)
            self.decide_probation_modes(s)
        finally:
            release_caches()  # nothing of the planner's stays into the steps (raised or not)
        entry.structures.insert(0, s)
        del entry.structures[self.spec.max_structures:]
        # said at the end of the first step that runs on it, with what it
        # measured (:meth:`_say_measured`)
        logger.debug("%s", describe_plan(graph, plan, s.planning_time_s))
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

    def _with_facts(self, graph: Graph) -> Graph:
        """``graph`` with what the runner has learned of the model's steps,
        as every plan is made for it: the functions ``keep=`` keeps, the
        loop's gradients alive into the backward, its graph held through
        the update, a graph of another signature held through the forward,
        the calls per step."""
        graph = self._with_keep(graph)
        if self.grads_alive and not graph.step.grads_in_backward:
            graph = graph.with_step(grads_in_backward=True)
        if self.held_at_update and not graph.step.kept_after_backward:
            graph = graph.with_step(kept_after_backward=True)  # (see StepMeter.stop)
        if self.held_other is None:
            if graph.step.held_other_bytes:
                graph = graph.with_step(held_other_bytes=0)
        elif self.held_other > graph.step.held_other_bytes:  # (see StepMeter.count_held_other)
            graph = graph.with_step(held_other_bytes=self.held_other)
        if self.step_calls > 1 and self.coordinator is None and \
                self.spec.budget_scope == "total":  # (see StepMeter.count_step_calls)
            graph = self._for_step_calls(graph)
        return graph

    def replan(self, entry: _Entry, s: _Structure, keep_if_refused: bool = False,
               **facts: Any) -> Optional[InfeasibleBudgetError]:
        """Plan ``s``'s graph again with ``facts`` set (step facts a
        measurement added to the memory model), in place of ``s``; a budget
        that cannot be met then is kept on the entry (raised or warned about
        by the call of that signature), or, with ``keep_if_refused``,
        returned, ``s`` left in its place."""
        graph = s.graph.with_step(**facts)
        t0 = time.perf_counter()
        at = entry.structures.index(s)
        del entry.structures[at]
        try:
            self.add(entry, graph, s.program.param_refs, s.program.multi_backward, t0,
                     backward_known=s.program.backward_known, probation=s.program.probation)
        except InfeasibleBudgetError as e:
            # (without its traceback: through the planner's frames it would
            # keep this frame, the entry and the graph in a reference cycle,
            # alive until the collector runs)
            refused = e.with_traceback(None)
            if keep_if_refused:
                entry.structures.insert(at, s)
                return refused
            entry.error = refused
        return None

    def _for_step_calls(self, graph: Graph) -> Graph:
        """``graph`` for the calls per step seen (``step.calls_per_step``,
        and those holding their whole graph with one call's plain peak,
        see :func:`~chainer_recompute.core.replay.per_step`)."""
        one = replay_peak(graph.with_step(calls_per_step=1)) if self.whole_calls else None
        return graph.with_step(calls_per_step=self.step_calls,
                               whole_calls_per_step=self.whole_calls, whole_call_peak_bytes=one)

    def plan_pending(self, entry: _Entry, args: Tuple[Any, ...],
                      kwargs: Dict[str, Any]) -> None:
        self._plan_recorded(entry, self._link(args))

    def plan_when_backward_ends(self, entry: _Entry, hook: IterationHook,
                                 link: Optional[chainer.Link]) -> None:
        """Plan as soon as the recorded backward has run every function,
        still inside it: the recorded iteration runs as plain Chainer and is
        not under the budget, so the planner's own memory lands there and
        not in the first planned iteration, which the budget bounds. When
        the model keeps the recorded graph in its attributes (a loss link's
        ``self.loss``), that graph, which lives into the next call, then
        releases what the plan drops. Without a Link to plan for, or with
        ``plan_at='call'`` for a model that keeps no graph, the next call
        plans. An error is raised at the next call."""
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
            keeps = _keeps_graph(lk, h)
            if self.spec.plan_at != "backward" and not keeps:
                return
            try:
                s = self._plan_recorded(entry, lk)
            except Exception as e:  # noqa: BLE001 - not from inside the user's backward
                entry.error = e
                return
            if keeps:
                # the graph lives into the next step: it holds no more than
                # a planned one from now on
                h.release_as_planned(s.program)
        hook.on_backward_done = plan

    def _kept_facts(self, keeps: bool) -> Dict[str, bool]:
        """A recorded graph's step facts on whether the model keeps an output of
        it (``keeps``): then the graph lives through the update and, unless
        ``free_previous_graph`` lets it go, into the next call's forward."""
        return {"kept_after_backward": keeps,
                "held_into_next_forward": keeps and not self.spec.free_previous_graph}

    def _recorded(self, entry: _Entry, link: Optional[chainer.Link]) -> "_Recording":
        """The graph of ``entry``'s recorded iteration (made from its hook
        once, the hook then held weakly)."""
        rec = entry.pending
        if isinstance(rec, _Recording):
            return rec
        hook = rec
        facts = None
        if link is not None:
            # a model that keeps an output of its graph (a loss link's
            # ``self.loss``) keeps the graph through the optimizer's update:
            # the replay counts what it still holds then
            kept = _kept_attributes(link, hook)
            facts = {"state_bytes": state_bytes(link), **self._kept_facts(bool(kept)),
                     "retained_grad_bytes": _retained_grad_bytes(kept, hook)}
        graph = hook.recorder.graph(
            cost_model=self.spec.cost, batch_size=entry.batch,
            name=type(link).__name__ if link is not None else "model", facts=facts,
            fill=hook.program.graph if hook.program is not None else None)
        if hook.recorder.backward_during_forward:
            # chainer.grad inside the forward (a gradient penalty): planned as
            # usual; from the moment such a backward starts until the forward
            # returns, the executor releases nothing and regenerates what it
            # needs (see IterationHook.before_backward).
            logger.info("the model's forward runs a backward (chainer.grad?); arrays are "
                        "not released from its start until the forward returns")
        # backward_known: its backward ran to the end before planning, so a
        # graph backpropagated again after an update is seen by it (and
        # passed on to the plan); otherwise parameters are saved before
        # updates on probation.
        entry.pending = rec = _Recording(graph, hook.recorder.param_refs, hook.multi_backward,
                                         hook.backward_done, weakref.ref(hook))
        return rec

    def _plan_recorded(self, entry: _Entry, link: Optional[chainer.Link]) -> _Structure:
        t0 = time.perf_counter()
        rec = self._recorded(entry, link)
        entry.pending = None
        s = self.add(entry, rec.graph, rec.param_refs, rec.multi_backward, t0,
                      plan=self._family_plan(entry, rec.graph),
                      backward_known=rec.backward_known)
        hook = rec.hook()
        if hook is not None:
            # a second backward pass through the recorded graph, after this,
            # is learned by the plan
            hook.planned = s.program
        return s

    def captures(self, batch: Optional[int]) -> bool:
        """Whether the first call of a signature at ``batch`` is planned
        from a separate capture (see ``capture_batch``)."""
        if self.spec.capture_batch == "auto":
            return batch is not None and batch >= 3
        return self.spec.capture_batch is not None

    def _say_recorded(self, args: Tuple[Any, ...], batch: Optional[int], why: str) -> None:
        """The first call of a signature runs plainly, recorded: said once
        (a warning), before it runs."""
        level = logging.INFO if self._said_capture else logging.WARNING
        self._said_capture = True
        report.log(level, "the first call of %s%s runs as plain Chainer%s, not bounded by the "
                   "budget: %s; %s", self._name(args),
                   "" if batch is None else f" at batch {batch}",
                   " while its graph is recorded" if self.record_first_calls else ", not recorded",
                   why, "the next calls run under a plan made from it" if self.record_first_calls
                   else "its second call is recorded, and the next ones run under its plan")

    def plan_separately(self, entry: _Entry, args: Tuple[Any, ...],
                         kwargs: Dict[str, Any]) -> bool:
        """Plan from a separate capture that leaves no trace. With
        ``capture_batch`` below the real batch: two small captures (at
        ``capture_batch`` and twice it; under ``'auto'`` each pair of
        :meth:`_auto_smalls` in turn), every size that differs between
        them scaled linearly to the real batch (a reshape that folds the
        batch into another axis included). A model those two captures do
        not describe (its structure depends on the batch size, a size not
        linear in it) is planned from its first call instead, with a
        warning; False then."""
        from ...core.errors import GraphError
        t0 = time.perf_counter()
        batch = batch_size_of(args, kwargs)
        small = self.spec.capture_batch
        self.captures_failed = False
        if small == "auto":
            if not self.captures(batch):
                self.refusal = ("its arguments have no batch dimension" if batch is None else
                                 "a batch under 3 cannot be planned from smaller captures")
                self._say_recorded(args, batch, self.refusal)
                return False
            captured: Dict[int, Tuple[Graph, IterationHook]] = {}
            failed = []
            for small in self._auto_smalls(batch):
                try:
                    with warnings.catch_warnings():  # (BatchNorm's on one sample: the capture's)
                        warnings.simplefilter("ignore")
                        for b in (small, 2 * small):
                            if b not in captured:
                                captured[b] = self._capture_at(
                                    args, kwargs, batch, b,
                                    after=captured[small][1] if b > small else None)
                    (g1, hook), (g2, hook2) = captured[small], captured[2 * small]
                    graph = _let_go(g1.scale_between(g2, batch), hook2)
                except Exception as e:  # noqa: BLE001 - said, and the next pair is tried
                    failed.append(f"captures at batch {small} and {2 * small} cannot plan it "
                                  f"({type(e).__name__}: {e})")
                    captured.pop(small, None)  # (the larger is the next pair's smaller)
                    continue
                p1, p2 = g1.step.plain_measured_bytes, g2.step.plain_measured_bytes
                if p1 is not None and p2 is not None and p2 > p1 and small > 1:
                    # plain Chainer's peak as the captures measured it, on
                    # the line through them (the capture's graph is freed
                    # by then: what it holds is in the measure); not said
                    # where the smaller batch measured more (a one-time
                    # allocation in the first capture: the line means
                    # nothing), nor through batch 1, where NumPy's views of
                    # size-1 dimensions spare copies that larger batches
                    # make (the line overstates it: Graph.fit's ``origin``)
                    graph = graph.with_step(
                        plain_measured_bytes=int(p1 + (p2 - p1) * (batch - small) / small),
                        plain_measured_at=(small, 2 * small))
                break
            else:
                self.refusal = "; ".join(failed)
                self.captures_failed = True
                self._say_recorded(args, batch, self.refusal)
                return False
            self.add(entry, graph, hook.recorder.param_refs, hook.multi_backward, t0)
            entry.line = g2
            return True
        if small is None or batch is None or small >= batch:
            graph, hook = self._capture_at(args, kwargs, batch, batch)
            self.add(entry, graph, hook.recorder.param_refs, hook.multi_backward, t0)
            return True
        other = min(2 * small, batch - 1)
        if other <= small:  # batch = capture_batch + 1: capture it whole
            graph, hook = self._capture_at(args, kwargs, batch, batch)
            self.add(entry, graph, hook.recorder.param_refs, hook.multi_backward, t0)
            return True
        g1, hook = self._capture_at(args, kwargs, batch, small)
        g2, hook2 = self._capture_at(args, kwargs, batch, other, after=hook)
        try:
            graph = _let_go(g1.scale_between(g2, batch), hook2)
        except GraphError as e:
            self.refusal = f"capture_batch={small} cannot plan {self._name(args)}: {e}"
            self.captures_failed = True
            level = logging.INFO if self._said_capture else logging.WARNING
            self._said_capture = True
            report.log(level, "%s; its first call at batch %d runs plainly (not bounded by the "
                       "budget) and the next ones run under a plan made from it",
                       self.refusal, batch)
            return False
        self.add(entry, graph, hook.recorder.param_refs, hook.multi_backward, t0)
        entry.line = g2
        return True

    @staticmethod
    def _auto_smalls(batch: int) -> Tuple[int, ...]:
        """The smaller batch of each pair of captures ``capture_batch='auto'``
        tries for a first call at ``batch``, in turn: 1 and 2 below
        ``AUTO_SMALL_BELOW`` (their own peak, plain Chainer's, the least
        there is), then 2 and 4 above batch 4 for a model those do not
        describe (its graph at batch 1 is another: a squeezed batch axis);
        2 and 4 from ``AUTO_SMALL_BELOW`` on."""
        if batch < AUTO_SMALL_BELOW:
            return (1,) if batch <= 4 else (1, 2)
        return (2,)

    def _capture_at(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], batch: Optional[int],
                    small: Optional[int], after: Optional[IterationHook] = None
                    ) -> Tuple[Graph, IterationHook]:
        """One recorded iteration on the first ``small`` rows of the batch
        arguments (all of them when ``small`` is the batch), leaving no
        trace, and its graph. ``after``: the hook of a capture run before
        it, whose graph the model kept in attributes (``kept_attrs``, weak
        references to the Links and the names): the hook's ``lets_go``
        says whether this capture's forward set every one of them before
        its first function (``L.Classifier`` does: plain Chainer then does
        not hold the previous step's graph through the forward)."""
        link = self._link(args)
        cut_args, cut_kwargs = detached_arguments(args, kwargs, small, batch)
        from ..device import device_of
        from .metering import _abandon, _distinct_bytes, _own_arrays
        arrays = list(cut_args) + list(cut_kwargs.values())
        dev = device_of(arrays)
        # (the model's state, the caller's arguments and the copies it reads)
        own = _distinct_bytes(dev, _own_arrays(link, list(args) + list(kwargs.values()) + arrays))
        meter = dev.meter()
        meter.start()
        try:
            with leave_no_trace(link if link is not None else self.fn) as trace:
                hook = IterationHook(link=link,
                                     args=list(cut_args) + list(cut_kwargs.values()))
                probe = [(sub, name) for sub, name in
                         ((ref(), name) for ref, name in getattr(after, "kept_attrs", ()))
                         if sub is not None]
                with _writes_before_first_function(hook, probe), _Active(), hook:
                    out = self.fn(*cut_args, **cut_kwargs)
                hook.finish(out)
                trace.keep_grads(ref() for ref in hook.recorder.param_refs.values())
                from ..capture import backward_from
                backward_from(out, link)
                del out
                hook.kept_attrs = [(weakref.ref(sub), name) for sub, name in
                                   (_kept_attributes(link, hook) if link is not None else [])]
                keeps = bool(hook.kept_attrs)
                peak = meter.stop().peak_bytes
                if self._captures_run is not None:
                    self._captures_run.append((small, own + peak))
                # (here, while lazily initialised parameters exist: they are put
                # back; after the meter: the optimizer's update is measured apart,
                # on throw-away copies, with the capture's gradients let go: a
                # set of gradients beside the caller's, which leave_no_trace
                # holds to put back, would add to this step's peak)
                if link is not None:
                    link.cleargrads()
                sb = state_bytes(link) if link is not None else None
        finally:
            _abandon(meter)  # (a capture that raised: tracing stopped all the same)
        facts = None
        if link is not None:
            facts = {"state_bytes": sb, **self._kept_facts(keeps),
                     # plain Chainer's forward and backward at this batch, measured
                     "plain_measured_bytes": own + peak}
        graph = hook.recorder.graph(cost_model=self.spec.cost, batch_size=small,
                                    name=type(link).__name__ if link is not None else "model",
                                    facts=facts)
        return graph, hook

    def _family_graphs(self, entry: _Entry, link: Optional[chainer.Link]
                       ) -> List[Tuple[_Entry, Graph]]:
        """The other signatures of ``entry``'s family with a graph: planned
        (their current structure's) or recorded and waiting to be planned."""
        out = []
        for e in list(self.entries.values()):
            if e is entry or e.family != entry.family or e.plain:
                continue
            if e.structures:
                out.append((e, e.structures[0].graph))
            elif e.pending is not None:
                out.append((e, self._recorded(e, link).graph))
        return out

    def _recorded_graph(self, e: _Entry, link: Optional[chainer.Link]) -> Optional[Graph]:
        """The graph recorded at ``e``'s shapes (a planned structure's, or
        its recording waiting to be planned), not one derived from other
        shapes; None when it has none."""
        for s in e.structures:
            if s.graph.step.derived_from is None:
                return s.graph
        if e.pending is not None:
            return self._recorded(e, link).graph
        return None

    def _fit_family(self, entry: _Entry, link: Optional[chainer.Link]
                    ) -> Tuple[Optional[Graph], Optional[_Entry], str]:
        """A graph at ``entry``'s shapes from the graphs recorded at other
        shapes of its family on one line with it (each input dimension
        affine along the line): every size the polynomial of least degree
        through them (:meth:`Graph.fit`): linear from two, a size quadratic
        in the input's dimensions (pairs of atoms) once three are recorded.
        All the recorded shapes on a line are tried first, then pairs of
        them, the nearest first. ``(graph, the entry of the nearest shape it
        was fitted from, '')``, or ``(None, None, why not)``."""
        from ...core.errors import GraphError
        v = entry.dims
        points: Dict[Tuple[int, ...], Tuple[_Entry, Graph]] = {}
        for e in list(self.entries.values()):
            if e is entry or e.family != entry.family or e.plain or e.dims in points \
                    or e.dims == v:
                continue
            g = self._recorded_graph(e, link)
            if g is not None:
                points[e.dims] = (e, g)
        if len(points) < 2:
            return None, None, "only one other shape of it has been recorded"

        def far(d: Tuple[int, ...]) -> int:
            return sum(abs(x - y) for x, y in zip(v, d))

        def on_line(v1: Tuple[int, ...], v2: Tuple[int, ...], k: int,
                    d: Tuple[int, ...]) -> bool:
            num, den = d[k] - v1[k], v2[k] - v1[k]
            return all((c - a) * den == (b - a) * num for a, b, c in zip(v1, v2, d))

        pts = sorted(points.values(), key=lambda p: far(p[0].dims))
        pairs = [(a, b) for i, a in enumerate(pts) for b in pts[i + 1:]]
        pairs.sort(key=lambda p: far(p[0][0].dims) + far(p[1][0].dims))
        why = "the recorded shapes do not vary along the same line as this one"
        tried = set()
        for a, b in pairs:
            v1, v2 = a[0].dims, b[0].dims
            k = next(j for j, (x, y) in enumerate(zip(v1, v2)) if x != y)
            if not on_line(v1, v2, k, v):
                continue
            line = [p for p in pts if on_line(v1, v2, k, p[0].dims)]  # nearest first
            for group in ([line] if len(line) > 2 else []) + [[a, b]]:
                key = frozenset(p[0].dims for p in group)
                if key in tried:
                    continue
                tried.add(key)
                dims = [p[0].dims for p in group]
                try:
                    graph = Graph.fit([p[1] for p in group], [d[k] for d in dims], v[k],
                                      where="at input dimensions " + ", ".join(map(str, dims)),
                                      target=f"input dimensions {v}")
                except GraphError as e:
                    why = str(e)
                    continue
                return graph, group[0][0], ""
        return None, None, why

    def _family_plan(self, entry: _Entry, graph: Graph) -> Any:
        """A plan of ``entry``'s family that fits ``graph`` under the
        budget (for ``'least'``: the least budget of the shape it was made
        for), its replayed peak on ``graph`` as its prediction (no solver
        run); None when none does (or in the activations scope, with
        workspace bounds or a coordinator: those plan each graph). The
        replay is of ``graph`` with the step facts :meth:`add` gives it
        (:meth:`_with_facts`: the calls per step, the gradients alive)."""
        if (self.spec.budget_scope != "total" or self.spec.workspace is not None
                or self.coordinator is not None):
            return None
        graph = self._with_facts(graph)
        from ...core.budget import limit_of
        from ...core.execution import ExecutionPlan
        from ...core.replay import replay
        planned = [e for e in self.entries.values()
                   if e is not entry and e.family == entry.family and e.structures
                   and not e.plain and e.structures[0].graph.n == graph.n
                   and [n.op for n in e.structures[0].graph.nodes] == [n.op for n in graph.nodes]]
        # the plan of the largest shape first (its blocks hold the most)
        planned.sort(key=lambda e: -e.structures[0].graph.activation_bytes)
        for e in planned[:2]:
            s = e.structures[0]
            ep = ExecutionPlan.of(graph, s.plan) if s.plan.recompute else None
            # 'least': the least budget of the larger shape the plan was made for
            budget = self.budget_bytes_for(graph) or s.plan.budget_bytes
            if budget is None:
                continue
            peak = replay(graph, ep).peak_bytes
            if peak <= limit_of(budget):
                info = dict(s.plan.info, reused_from=list(e.dims))
                return dataclasses.replace(s.plan, predicted_peak_bytes=int(peak),
                                           budget_bytes=budget, info=info)
        return None

    def plan_in_call(self, entry: _Entry, args: Tuple[Any, ...],
                      kwargs: Dict[str, Any]) -> bool:
        """Plan the first call of a signature inside it, before its meter
        starts: from the recorded shapes of its family
        (:meth:`_plan_from_family`), else from a separate capture
        (:meth:`plan_separately`); False when neither can (the call is
        then recorded, said there). The planner's memory (and the
        captures') is in that step and in no plan (:meth:`watch_planning`)."""
        with self.watch_planning(entry, args, kwargs, "inside its first call"):
            return bool((self.coordinator is None and self._plan_from_family(entry, args, kwargs))
                        or (self.spec.capture_batch is not None and self.capture_first_calls
                            and self.plan_separately(entry, args, kwargs)))

    @contextlib.contextmanager
    def watch_planning(self, entry: _Entry, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                       where: str, held: Optional[Any] = None) -> Iterator[None]:
        """Planning inside a training call (a first call, or a plan made
        again at a call after a correction): the planner's memory is in
        that step and in no plan. On NumPy (on a GPU it is host memory,
        outside the budget) it is measured, and when with the model's own
        arrays (parameters, gradients, optimizer state, inputs) and the
        previous call's graph alive at this call (of another signature,
        ``held_other``; of this one, ``held()``'s bytes) it is over
        the budget (as resolved for the plan: ``'least'``'s figure too),
        that step is, and it is said (once for each ``where``)."""
        from ..device import device_of
        from .metering import own_bytes
        arrays = list(args) + list(kwargs.values())
        dev = device_of(arrays)
        if dev.is_gpu or where in self._said_planning or self.spec.budget_scope != "total":
            yield
            return
        made = self.plans_made
        captures = self._captures_run = []
        meter = dev.meter()
        meter.start()
        try:
            yield
        finally:
            planner = meter.stop().peak_bytes
            self._captures_run = None
        if self.plans_made == made or not entry.structures:
            return  # nothing planned (a call recorded instead is said there)
        budget = self.budget_bytes or entry.structures[0].plan.budget_bytes
        own = own_bytes(dev, self._link(args), arrays) + (self.held_other or 0)
        previous = held() if held is not None else 0
        own += previous
        if budget is None or own + planner <= budget:
            return
        self._said_planning.add(where)
        over = [(b, peak) for b, peak in captures if peak > budget]
        if over:
            # (the captures run plain Chainer at their batch: a budget under
            # that peak cannot hold them, whatever the planner takes)
            b, peak = max(over)
            report.warning(
                "planning %s (input dimensions %s) %s ran it as plain Chainer at batch %s "
                "(captures, in no plan; the larger peaked at %s with the model's own arrays), "
                "then the planner: this step peaks at %s or more, over the budget %s, which is "
                "under plain Chainer's step at batch %d (the next steps run under the plan; at a "
                "larger batch the captures are a smaller part of it)",
                self._name(args), entry.dims, where,
                " and ".join(str(c) for c, _ in captures), format_bytes(peak),
                format_bytes(own + planner), format_bytes(budget), b)
        else:
            report.warning(
                "planning %s (input dimensions %s) %s took %s (the planner's memory, in no "
                "plan) on top of the model's own %s (parameters, gradients, optimizer state, "
                "inputs%s): this step peaks at %s or more, over the budget %s",
                self._name(args), entry.dims, where, format_bytes(planner), format_bytes(own),
                ", the previous call's graph" if self.held_other or previous else "",
                format_bytes(own + planner), format_bytes(budget))

    def _plan_from_family(self, entry: _Entry, args: Tuple[Any, ...],
                          kwargs: Dict[str, Any]) -> bool:
        """Plan a new input shape before its first call, from the recorded
        shapes of its family (:meth:`_fit_family`; see the class
        docstring). False when there are not two such shapes or they do not
        describe this one: the call is then recorded (with one warning when
        a plan exists and a byte budget is set)."""
        link = self._link(args)
        sibs = self._family_graphs(entry, link)
        if not sibs:
            return False
        t0 = time.perf_counter()
        v = entry.dims
        graph = None
        for e1, g1 in sorted(sibs, key=lambda p: not p[0].structures):  # planned first
            if e1.dims == v:  # another value of a number argument: the same shapes
                graph, src = g1, e1
                break
        if graph is None:
            graph, src, why = self._fit_family(entry, link)
        batch = entry.batch
        if graph is None and batch is not None:
            # a last partial batch: only the batch dimension of the inputs
            # changed, and the graph scales with it (checked as it runs), on
            # the line of the captures it was planned from where it was
            for e1, g1 in sibs:
                if g1.batch_size and g1.batch_size != batch and all(
                        x == y or (x == g1.batch_size and y == batch)
                        for x, y in zip(e1.dims, v)):
                    graph, src = g1.scale_batch(batch, e1.line), e1
                    entry.line = e1.line
                    break
        if graph is None:
            if self.captures(batch):
                return False  # planned from a separate capture instead
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
        graph = graph.replace(batch_size=batch).with_step(derived_from=tuple(src.dims))
        # what the loop does with the graph (a backward after an update: see
        # Program.saves_parameters) is the source's, learned or not yet
        probation = None
        if src.structures:
            program = src.structures[0].program
            refs, multi, known = program.param_refs, program.multi_backward, \
                program.backward_known
            probation = program.probation
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
                    self.add(big, rec.graph, rec.param_refs, rec.multi_backward,
                              time.perf_counter(), backward_known=rec.backward_known)
                except InfeasibleBudgetError:
                    big.pending = rec
                else:
                    plan = self._family_plan(entry, graph)
        self.add(entry, graph, refs, multi, t0, plan=plan, backward_known=known,
                 probation=probation)
        return True

    def decide_probation_modes(self, s: _Structure) -> None:
        """The release modes an iteration whose update is on probation may
        take in place of the plan's (:attr:`Program.probation_modes`; total
        scope, a byte budget). That update saves the values of the
        parameters that the nodes released after the backward read
        (IterationHook.before_param_update), in no plan; a mode that releases
        less keeps those nodes' arrays through the update instead, which
        costs less where they are smaller than the parameters (a model
        returning its logits at a small batch). Each mode that saves less
        and peaks no higher, replayed with the graph held through the update
        (which no recording tells), is listed with what one call keeps at
        the update beyond the plan's mode and what it saves; the iteration
        chooses among them once it knows its step's calls."""
        p = s.program
        p.probation_modes, p.probation_saved = (), 0
        if not p.on_probation or p.returns_loss or self.spec.budget_scope != "total" \
                or s.plan.budget_bytes is None:
            return  # (a model that returns its loss saves nothing on probation)
        from ...core.replay import replay
        held = s.graph.with_step(kept_after_backward=True)
        figures = {}
        for mode in dict.fromkeys((p.release_mode, "none", "checkpoints", "all")):
            r = replay(held, p, release_mode=mode)
            if "update" not in r.events:
                return  # (no optimizer seen: nothing to count the values at)
            figures[mode] = (r.peak_bytes, int(r.memory_bytes[r.events.index("update")]),
                             _saved_at_update(p, mode))
        peak0, at0, saved0 = figures.pop(p.release_mode)
        p.probation_saved = saved0
        p.probation_modes = tuple(
            (mode, max(0, at - at0), saved) for mode, (peak, at, saved) in figures.items()
            if saved < saved0 and peak <= max(peak0, at0 + saved0))

    def _replan_for_a_later_pass(self, s: _Structure, held: Graph, budget: int, mode: str,
                                 peak: int) -> Tuple[str, int]:
        """Structure ``s``'s graph is backpropagated again after the
        update, and its plan holds ``peak`` through that pass in its best
        ``mode``, over ``budget``. The plans a budget search makes (those
        that drop less, down to plain backprop's, which drops nothing and
        holds what Chainer holds) replayed so: the fastest that fits the
        budget, else the lowest-peaking, replaces the plan where it is not
        the plan itself. Its mode and peak."""
        from ...core.budget import BudgetSearch, limit_of
        spec, current = self.spec, s.program
        search = BudgetSearch(self._with_keep(s.graph), spec.solver, spec.strategy,
                              **spec.solver_options)
        search.tradeoff(extra_budgets=6)
        best = None
        for plan, _ in search.tried():
            program = _program(s.graph, plan, current.param_refs, current.multi_backward,
                               current.backward_known, current.probation)
            modes = ("all", "checkpoints") if program.dropped else ("all",)
            m, p = min(((m, _peak_with_a_later_pass(held, program, m)) for m in modes),
                       key=lambda c: c[1])
            over = float(plan.overhead or 0.0) if plan.recompute else 0.0
            key = (0, over, p) if p <= limit_of(budget) else (1, p, over)
            if best is None or key < best[0]:
                best = (key, plan, program, m, p)
        if best is None or best[4] >= peak:
            return mode, peak
        _, plan, program, mode, peak = best
        s.plan, s.program = search.annotated(plan, peak, budget), program
        self.plans_made += 1
        return mode, peak

    def decide_release(self, s: _Structure) -> None:
        """What the executor keeps after a node's last backward reader
        (replay.RELEASE_MODES): the mode that makes a second backward pass
        cheapest among those whose replayed peak fits the budget (total
        scope; ``all`` only for a graph known to be backpropagated twice per
        iteration, a GAN's generator graph, else ``checkpoints``). In the
        activations scope: ``all`` for such a graph, ``checkpoints`` where it
        costs no peak."""
        from ...core.budget import limit_of
        from ...core.replay import replay
        budget = s.plan.budget_bytes
        modes = ["all", "checkpoints"] if s.program.multi_backward else ["checkpoints"]
        s.program.release_mode, s.program.over_budget_by_mode = "none", False
        if self.spec.budget_scope != "total" or budget is None:
            # The paper's model does not bound the real peak: keep what a
            # second pass needs, or checkpoints where that costs nothing.
            base = replay(s.graph, s.program, release_mode="none").peak_bytes
            if s.program.multi_backward:
                s.program.release_mode = "all"
            elif replay(s.graph, s.program, release_mode="checkpoints").peak_bytes <= base:
                s.program.release_mode = "checkpoints"
        else:
            # What these modes keep lives as long as anything of the graph:
            # a loop that holds its loss through the optimizer's update
            # (``loss = F.softmax_cross_entropy(model(x), t)``, then
            # ``loss.backward()``, ``optimizer.update()``) holds it there,
            # which no recording tells from a loss dropped by
            # ``optimizer.update(lossfun, ...)``: a mode is chosen where it
            # fits the budget either way, and predicted with the graph held
            # once the runner has seen the loop hold it (StepMeter.stop).
            held = s.graph.with_step(kept_after_backward=True)
            after_update = s.program.multi_backward and s.program.probation.backward_after_update

            peaks: Dict[str, int] = {}

            def peak_of(mode: str) -> int:
                if mode not in peaks:
                    peaks[mode] = (_peak_with_a_later_pass(held, s.program, mode) if after_update
                                   else replay(held, s.program, release_mode=mode).peak_bytes)
                return peaks[mode]
            for mode in modes:
                if peak_of(mode) <= limit_of(budget):
                    s.program.release_mode = mode
                    if self.held_at_update:  # (a structure planned before it was seen)
                        s.graph = s.program.graph = held
                    break
            else:
                if after_update:
                    # That later pass, which no replay counts, would
                    # regenerate after ``none`` released everything
                    # (checkpoints too: each block made again from the
                    # input, every array kept for the pass): Chainer's DCGAN
                    # discriminator measured 12% over plain Chainer so, in
                    # every step, an MLP whose output is backpropagated again
                    # after the update 36%. Keep what that pass reads, as
                    # Chainer does, or the checkpoints, from which it
                    # regenerates block by block, where they peak lower.
                    mode = min(("all", "checkpoints"), key=peak_of)
                    peak = peaks[mode]
                    if peak > limit_of(budget):
                        mode, peak = self._replan_for_a_later_pass(s, held, budget, mode, peak)
                    s.program.release_mode = mode
                    s.program.over_budget_by_mode = peak > budget
                    if s.program.over_budget_by_mode and not self._said_kept_over:
                        self._said_kept_over = True
                        how = ("no plan holds less through that pass than plain Chainer, "
                               "so it runs without recomputation" if not s.program.dropped else
                               "after each backward pass the plan keeps %s, which that pass "
                               "reads" % ("what it regenerated" if mode == "all"
                                          else "its checkpoints"))
                        report.warning(
                            "%s's graph is backpropagated again after the optimizer's "
                            "update: %s, predicted to peak at %s, over the budget %s (the "
                            "budget counts one pass; it is not corrected for this). Raise the "
                            "budget to at least that, or run the later pass before the update",
                            s.graph.meta.get("model", "the model"), how,
                            format_bytes(peak), format_bytes(budget))
        s.program.release_mode_decided = s.program.multi_backward
        if s.program.release_mode != "none" and self.spec.budget_scope == "total":
            # what the plan will really hold: its prediction in that mode
            peak = replay(s.graph, s.program, release_mode=s.program.release_mode).peak_bytes
            if s.program.multi_backward and s.program.probation.backward_after_update:
                peak += _saved_at_update(s.program, s.program.release_mode)
            s.plan = dataclasses.replace(s.plan, predicted_peak_bytes=peak)
        if s.program.multi_backward:
            logger.info("the graph is backpropagated more than once per iteration; after each "
                        "backward pass %s", {
                            "all": "regenerated arrays are kept for the next",
                            "checkpoints": "checkpoints are kept, regenerated arrays released",
                            "none": "everything is released (keeping more would exceed the "
                                    "budget)"}[s.program.release_mode])
