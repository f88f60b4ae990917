"""Metering of one planned step: the model's own bytes at the call, the
allocator's peak from the call to the end of its backward and on through
the optimizer's update, and the check of that peak against the plan
(a peak over the budget corrects the memory model and plans again)."""
from __future__ import annotations

import dataclasses
import logging
import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple

from .. import _chainer  # noqa: F401
from .._chainer import param_grad
import chainer

from ..executor import IterationHook, IterationStats
from .describe import describe_step, plain_peak
from ..correction import CallMeter, Correction
from ..memory import rule_arrays
from ...core.errors import InfeasibleBudgetError
from ...core.units import format_bytes
from .log import logger, report
from .state import _Entry, _Structure



@dataclasses.dataclass(eq=False)
class _OpenMeter(CallMeter):
    """The measurement of one planned iteration, from the call to the end
    of its backward, then (``tail``) on to the end of the optimizer's
    update of the model's parameters (or the next call). ``own``: the
    model's bytes at the call (state, inputs, the previous graph)."""

    entry: "_Entry" = None
    stats: Any = None  # the iteration's IterationStats
    hook: Any = None  # a weak reference to the iteration's IterationHook (it holds arrays)
    new_meter: Any = None  # makes a meter for the same device
    tail: bool = False
    structure: Any = None  # the structure it ran on (set at the end of the backward)
    waiting: Any = None  # parameter ids whose update is still to come (tail)
    level_total: Optional[int] = None  # CuPy: the pool's total bytes at the call
    link_ref: Any = None  # a weak reference to the Link called
    finalizer: Any = None  # stops the meter if the runner is freed first
    # The call found the recorded (plain) iteration's graph still held (a
    # loss link keeps it until its forward): measured, but not checked
    # against the plan, which that graph is no part of. So too a step
    # planned again inside it, or whose earlier call left its plan (a
    # branch taken the other way: its graph is under no plan).
    after_recording: bool = False
    watcher: Any = None  # the update watcher of a tail
    # the previous call's inputs its graph held at the call (weak
    # reference, bytes): counted in ``own``, but the caller's if still
    # alive at the end (a list of batches; a dataset they are views of)
    user_held: List[Tuple[Any, int]] = dataclasses.field(default_factory=list)
    # ids of the buffers of the inputs counted in ``own`` (a step's later
    # calls add theirs: see StepMeter._continue)
    input_ids: set = dataclasses.field(default_factory=set)
    # bytes of parameter values the previous graph saved on probation
    # (Program.on_probation), counted in ``own``
    probation: int = 0
    # bytes the previous graph holds beyond what this plan counts for it,
    # left by a plan since replaced (StepMeter._replaced_plan_bytes)
    replaced: int = 0

    def measured(self, absolute_peak_bytes: int) -> int:
        """The model's bytes when the meter read ``absolute_peak_bytes``."""
        users = sum(nbytes for ref, nbytes in self.user_held if ref() is not None)
        return self.total(absolute_peak_bytes) - users


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
            if p.array is None:  # not initialised yet (no gradient either)
                continue
            add(p.array)
            add(p.grad)
            for v in rule_arrays(getattr(p, "update_rule", None)):
                add(v)
        for sub in link.links():
            for name in getattr(sub, "_persistent", ()):
                add(getattr(sub, name, None))
    for x in arrays:
        add(x)
    return found


def _attribute_arrays(link: Optional[chainer.Link]) -> List[Any]:
    """The arrays the model's Links keep unregistered
    (:func:`~chainer_recompute.runtime.capture.held_arrays`: the last
    call's, until it sets them again, or a memory bank), and the gradients
    of such Variables."""
    from ..capture import held_arrays
    if link is None:
        return []
    found = []
    for sub in link.links():
        for var, a in held_arrays(sub):
            found.append(a)
            if var is not None and var.grad is not None:
                found.append(var.grad)
    return found


def own_bytes(dev: Any, link: Optional[chainer.Link], arrays: List[Any]) -> int:
    """Bytes of what a training call finds of the model's own
    (:func:`_own_arrays`), the call's inputs at their own size (a batch
    sliced from a data set held in memory is what it shows, the data set the
    caller's)."""
    return (_distinct_bytes(dev, _own_arrays(link, []))
            + _distinct_bytes(dev, _own_arrays(None, arrays), as_shown=True))


def _graph_arrays(hook: Any) -> List[Any]:
    """The arrays a previous iteration's graph still holds: what its
    function nodes retain (inputs, outputs, attributes), the arrays of its
    outputs' live Variables, and what its hook holds for another backward
    pass through it (the arrays pinned or regenerated for a dropped block,
    the parameter values saved before an update). All of these are freed
    with the graph, often early in the next forward: left out, they would
    be taken off the step's peak as someone else's bytes."""
    from ..capture import attribute_arrays
    found: List[Any] = list(getattr(hook, "kept", {}).values())
    found.extend(getattr(hook, "snapshots", {}).values())
    for call in hook.recorder.calls:
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
            if var is not None and var.grad is not None:
                found.append(var.grad)
        found.extend(f._retained_output_data or ())
        found.extend(a for _, _, a in attribute_arrays(f))
    return found


def _probation_bytes(hook: Any, at_update: bool = True) -> int:
    """Bytes of the parameter values ``hook``'s iteration saved on probation
    (:attr:`Program.on_probation`); ``at_update``: or, where its backward
    released in a probation mode, what its step was predicted to hold so
    at the update, the larger. 0 for ``hook`` None."""
    program = getattr(hook, "program", None)
    if program is None or not program.on_probation:
        return 0
    extra = (hook.probation_extra or 0) if at_update else 0
    if not hook.snapshots:
        return extra
    from ..device import device_of
    saved = list(hook.snapshots.values())
    return max(extra, _distinct_bytes(device_of(saved), saved))


def _distinct_bytes(dev: Any, arrays: List[Any], as_shown: bool = False) -> int:
    """Bytes of ``arrays`` as the allocator holds them: each buffer once
    (views count their base). ``as_shown``: each array once at its own
    size (a call's inputs: a batch sliced from a data set held in memory is
    what it shows, its base being the caller's)."""
    from ..capture import is_array, root_of
    seen: set = set()
    total = 0
    for a in arrays:
        if not is_array(a):
            continue
        r = a if as_shown else root_of(a)
        if id(r) in seen:
            continue
        seen.add(id(r))
        total += dev.allocation_bytes(getattr(r, "nbytes", a.nbytes))
    return total


def _weak_roots(arrays: List[Any]) -> List[Any]:
    """Weak references to the buffers of a call's array arguments."""
    from ..capture import is_array, root_of
    refs = []
    for a in arrays:
        if is_array(a):
            try:
                refs.append(weakref.ref(root_of(a)))
            except TypeError:  # an array type without weak references
                pass
    return refs


def _previous_inputs(dev: Any, previous: Any, held: List[Any]) -> List[Tuple[Any, int]]:
    """The previous call's inputs that its graph holds (``held``), with
    the bytes they were counted at: the model's only if nothing else keeps
    them, which is known at the end of the step (see :meth:`_OpenMeter.measured`)."""
    from ..capture import is_array, root_of
    roots = {id(r()): r for r in getattr(previous, "input_roots", ()) if r() is not None}
    out: Dict[int, Tuple[Any, int]] = {}
    for a in held:
        if is_array(a):
            r = root_of(a)
            if id(r) in roots and id(r) not in out:
                out[id(r)] = (roots[id(r)], dev.allocation_bytes(r.nbytes))
    return list(out.values())


def _held_after(s: _Structure) -> int:
    """What structure ``s``'s graph holds after its backward through the
    next forward, as the replay counts its own
    (``step.held_into_next_forward``): the same measure for a graph of
    another signature (see :meth:`StepMeter.count_held_other`). Replayed
    once per structure."""
    if s.held_after is None:
        from ...core.budget import release_caches
        from ...core.replay import replay
        plan = s.program if s.plan.recompute else None
        one = s.graph.with_step(calls_per_step=1, whole_calls_per_step=0, held_other_bytes=0)
        try:
            first = [replay(one.with_step(held_into_next_forward=held), plan,
                            release_mode=s.program.release_mode).memory_bytes[0]
                     for held in (True, False)]
        finally:
            release_caches()
        s.held_after = int(first[0] - first[1])
    return s.held_after


def _held_counted(s: _Structure) -> int:
    """What structure ``s``'s replay counts through the forward for the
    graph of the model's previous call: its own after its backward
    (:func:`_held_after`, ``step.held_into_next_forward``), or one of another
    signature (``step.held_other_bytes``), the larger."""
    return max(s.graph.step.held_other_bytes,
               _held_after(s) if s.graph.step.held_into_next_forward else 0)


def _held_now(previous: Any, caller_keeps_inputs: Optional[bool]) -> int:
    """What the graph of the previous call (``previous``, its hook), not
    planned (a recorded first call), holds now (:func:`_graph_arrays`):
    not the parameters, nor their values saved before an update (which no
    plan counts), nor the caller's batches where it keeps them."""
    from ..capture import root_of
    from ..device import device_of
    from ...core.graph import RNG_STATE_BYTES
    refs = list(previous.recorder.param_refs.values())
    if previous.program is not None:  # (a followed plan maps them as the plan did)
        refs += previous.program.param_refs.values()
    mine = [p for p in (r() for r in refs) if p is not None]
    left = [p.array for p in mine] + [param_grad(p) for p in mine] + \
        list(previous.snapshots.values())
    if caller_keeps_inputs:
        left += [r() for r in previous.input_roots]
    left_ids = {id(root_of(a)) for a in left if a is not None}
    arrays = [a for a in _graph_arrays(previous) if id(root_of(a)) not in left_ids]
    return (_distinct_bytes(device_of(arrays), arrays)
            + RNG_STATE_BYTES * len(previous._rng_states))


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


#: the step facts of a plan replayed without the previous call's graph,
#: which the model let go of before its first function (check_held_graph)
_LET_GO: Dict[str, Any] = {"held_into_next_forward": False, "held_other_bytes": 0}


def _watch_updates(steps: "StepMeter", open_: _OpenMeter) -> None:
    from ..executor import add_update_watcher
    ref = weakref.ref(steps)

    def updated(param: Any) -> bool:
        """After each parameter update; True when done watching."""
        r = ref()
        if r is None or r._meter is not open_:
            return True
        open_.waiting.discard(id(param))
        if not open_.waiting:
            r.stop(at_update=True)
            return True
        return False
    open_.watcher = updated
    add_update_watcher(updated)


def _into_parameters() -> bool:
    """Whether the backward pass running now accumulates into the
    parameters' gradients: ``Variable.backward`` and ``chainer.backward``
    (Chainer's ``_backprop_to_all``, which loads each leaf's gradient at
    its first reader), not ``chainer.grad``, which leaves them as they are."""
    from chainer import _backprop
    code = _backprop._backprop_to_all.__code__
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def _graph_died(steps_ref: Any, open_: _OpenMeter) -> None:
    steps = steps_ref()
    if steps is not None and steps._meter is open_:
        steps.stop()


class StepMeter:
    """Measures a runner's planned steps and checks them against their
    plans: a step's peak from its first call of the model through the
    optimizer's update (:meth:`start`), what an earlier call's graph still
    holds at the next (:meth:`count_held_graph`), the calls of one step
    held at once (:meth:`find_step`, :meth:`count_step_calls`), and the
    correction of a plan that a step overshot (:meth:`apply_pending`,
    at the next call: planned by ``planner``).

    Args:
        spec: the runner's options (:class:`~.spec.RunnerSpec`).
        planner: the runner's :class:`~.planning.Planner` (replans).
    """

    def __init__(self, spec: Any, planner: Any) -> None:
        self.spec, self.planner = spec, planner
        self._meter: Optional[_OpenMeter] = None
        # structures measured over their budget, to plan again at the next
        # call: id(structure) -> (entry, structure, correction bytes)
        self.corrections: Optional[Dict[int, Tuple[_Entry, _Structure, int]]] = None
        self._correction = Correction(report)  # a measured overshoot: warned once
        self._said_probation = False  # a step over its budget with probation's saved values
        self._said_replaced = False  # ... with the graph of a replaced plan held
        # id(structure) -> bytes that the previous call's graph of another
        # signature holds beyond what it counts, at a call whose budget that
        # graph makes infeasible (count_held_other): known, said, no correction
        self._beyond: Dict[int, int] = {}
        self._said_beyond = False
        self._said_measured: set = set()  # corrections whose plan's first measured step was said
        self.last_hook: Any = None  # a weak reference to the previous call's IterationHook
        self.last_entry: Optional[_Entry] = None  # ... and its signature
        # whether the caller keeps its batches after a step (a list of them, a
        # data set they are views of): learned where a step was measured
        # with the previous call's inputs held by its graph (see
        # _OpenMeter.user_held); None until then
        self.caller_keeps_inputs: Optional[bool] = None
        # weak references to the hooks of calls whose graphs may be alive
        self._graphs: List[Any] = []
        # the function nodes of the previous call's graph (weak references)
        # when this call found it alive
        self._held_previous: Optional[List[Any]] = None
        #: plans to replay at the next call with other step facts, the same
        #: plan (apply_pending): without the previous call's graph
        #: (check_held_graph, :data:`_LET_GO`), with their own graph held
        #: through the update (stop)
        self._replays: List[Tuple[_Entry, _Structure, Dict[str, Any]]] = []
        # whether that graph was still alive at the forward's first function
        # when last seen (None: never seen)
        self.held_at_start: Optional[bool] = None
        # this call's earlier ones in its step (weak references: a hook holds arrays)
        self._step_others: List[Any] = []
        self._said_step_calls = False
        # the most calls a step held that the plans are not made for yet
        # (see count_step_calls)
        self._calls_seen = 0
        self._said_grads_alive = False

    def in_step(self) -> bool:
        """Whether this training call is a later one of a step whose
        earlier calls' backward is still to come (after :meth:`find_step`)."""
        return bool(self._step_others)

    def track(self, hook: IterationHook, entry: _Entry, arrays: List[Any]) -> None:
        """``hook`` is this training call's, of signature ``entry``, on the
        array arguments ``arrays``: the previous call's at the next."""
        self.last_hook = weakref.ref(hook)
        self.last_entry = entry
        self._graphs.append(self.last_hook)
        if not hasattr(hook, "input_roots"):  # (set where the call is measured)
            hook.input_roots = _weak_roots(_own_arrays(None, arrays))

    def start(self, entry: _Entry, hook: IterationHook, link: Optional[chainer.Link],
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
        arrays = list(args) + list(kwargs.values())
        if self._step_others and self._continue(entry, hook, link, arrays):
            return
        from ..device import device_of
        dev = device_of(arrays)
        if not dev.is_gpu and all(s.checked >= self.spec.check_iterations
                                  for s in entry.structures):
            return
        own = _own_arrays(link, [])
        inputs = _own_arrays(None, arrays)
        hook.input_roots = _weak_roots(inputs)
        previous = self.last_hook() if self.last_hook is not None else None
        held: List[Any] = []
        user_held: List[Tuple[Any, int]] = []
        probation = replaced = 0
        if previous is not None and previous is not hook and (
                previous.backward_done or previous.program is None):
            # (a call whose backward is still to come, a discriminator's
            # other batch, is in this step's meter if one runs from it:
            # see find_step)
            held = _graph_arrays(previous)
            user_held = _previous_inputs(dev, previous, held)
            own += held
            probation = _probation_bytes(previous, at_update=False)
            replaced = self._replaced_plan_bytes(entry, hook, previous)
            if not replaced and previous.probation_extra is not None:
                # released in a probation mode: it holds more into this
                # forward than this plan counts for it, and no later graph does
                probation += self._held_beyond_plan(entry, hook, previous)
        off_plan = False
        for other in filter(None, (r() for r in self._step_others)):
            if other is not previous:  # (the step's earlier calls, none measured)
                own += _graph_arrays(other)
            off_plan = off_plan or other.stats.path != "planned"
        from ..capture import is_array, root_of
        # (at their own size, as inputs are: a view of a data set shows
        # the model's share)
        counted = {id(root_of(a)) for a in own + inputs if is_array(a)}
        kept = [a for a in _attribute_arrays(link) if id(root_of(a)) not in counted]
        self._meter = _OpenMeter.start(
            dev, own + kept + inputs,
            own=(_distinct_bytes(dev, own) + _distinct_bytes(dev, kept, as_shown=True)
                 + _distinct_bytes(dev, inputs, as_shown=True)),
            entry=entry, stats=hook.stats, hook=weakref.ref(hook), new_meter=dev.meter,
            link_ref=weakref.ref(link) if link is not None else None, user_held=user_held,
            probation=probation, replaced=replaced)
        self._meter.watch_untraced([root_of(a) for a in own if is_array(a)]
                                   + [a for a in kept if getattr(a, "base", None) is None],
                                   dev.allocation_bytes)
        self._meter.input_ids = {id(root_of(a)) for a in inputs}
        self._meter.after_recording = off_plan or (bool(held) and previous.recorder.recording)
        self._meter.finalizer = weakref.finalize(self, _abandon, self._meter.meter)
        self._stop_when_done(hook)

    def awaiting_backward(self) -> bool:
        """Whether the measured call's backward is still to come: a call of
        the model under no-backprop now (double DQN's online network on the
        next states, between the loss's forward and its backward) is part
        of that step."""
        open_ = self._meter
        hook = None if open_ is None or open_.tail else open_.hook()
        return hook is not None and not hook.backward_done

    def close_step(self, continued: bool = False) -> None:
        """The next call: the previous iteration is over; measure and check
        what is left of it. ``continued``: the next call is in the same
        step, its earlier calls' backward still to come: the meter goes on
        (:meth:`start` hands it to the new call)."""
        if self._meter is not None and not continued:
            self.stop()

    def _continue(self, entry: _Entry, hook: IterationHook,
                        link: Optional[chainer.Link], arrays: List[Any]) -> bool:
        """A later call of a step whose meter runs from its first call: the
        same meter, its level and counted bytes kept, measures on for this
        call (its plan is the one checked at the step's end). Its inputs not
        counted yet are counted at their size (the caller's batch, made
        before the step; one made inside the step, a generator's output, is
        then counted twice: an overestimate). False when no meter runs."""
        open_ = self._meter
        if open_ is None:
            return False
        from ..capture import root_of
        from ..device import device_of
        dev = device_of(arrays)
        new = [a for a in _own_arrays(None, arrays) if id(root_of(a)) not in open_.input_ids]
        open_.input_ids.update(id(root_of(a)) for a in new)
        open_.own += _distinct_bytes(dev, new, as_shown=True)
        dev.adopt(open_.meter, new)
        hook.input_roots = _weak_roots(new)
        if open_.stats is not None and open_.stats.path != "planned":
            open_.after_recording = True  # (the step's earlier call left its plan)
        if open_.watcher is not None:  # (a tail: the update is still to come)
            from ..executor import remove_update_watcher
            remove_update_watcher(open_.watcher)
            open_.watcher = None
        open_.tail, open_.waiting, open_.structure = False, None, None
        open_.entry, open_.stats, open_.hook = entry, hook.stats, weakref.ref(hook)
        open_.link_ref = weakref.ref(link) if link is not None else None
        self._stop_when_done(hook)
        return True

    def _stop_when_done(self, hook: IterationHook) -> None:
        """At the end of ``hook``'s backward, the meter (if it is still
        this call's) goes on through the update."""
        steps = weakref.ref(self)

        def done(h: IterationHook) -> None:
            r = steps()
            if r is not None and r._meter is not None and r._meter.hook() is h:
                r.stop(done=True)
        hook.on_backward_done = done

    def stop(self, done: bool = False, at_update: bool = False) -> None:
        """The meter stops: at the end of the call's backward (``done``,
        then a tail meter goes on through the update), at the end of the
        update (``at_update``), or at the next call."""
        if self._meter is None:
            return
        if at_update and self._meter.tail and self._on_to_a_later_pass(self._meter):
            return
        open_, self._meter = self._meter, None
        if open_.user_held:
            self.caller_keeps_inputs = any(ref() is not None for ref, _ in open_.user_held)
        if open_.finalizer is not None:
            open_.finalizer.detach()
        if open_.watcher is not None:
            from ..executor import remove_update_watcher
            remove_update_watcher(open_.watcher)
        stats = open_.stats
        if open_.tail:
            m = open_.meter.stop()
            s = open_.structure
            if s is None or s not in open_.entry.structures:
                return
            if at_update and open_.hook() is not None:
                self._held_at_update(s)
            measured = open_.measured(m.absolute_peak_bytes)
            total = None if m.total_peak_bytes is None or open_.level_total is None else \
                open_.own + m.total_peak_bytes - open_.level_total
            if measured > (stats.measured_peak_bytes or 0):
                stats.measured_peak_bytes = int(measured)
            if total is not None:
                stats.measured_pool_total_bytes = int(max(
                    total, measured, stats.measured_pool_total_bytes or 0))
            if not open_.after_recording:
                self._check(open_.entry, s, stats, max(measured, total or 0),
                            open_.probation + _probation_bytes(open_.hook()), open_.replaced)
                self._say_measured(s, stats)
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
            self._meter = _OpenMeter(tail, open_.own, open_.level, entry=open_.entry,
                                     stats=stats, hook=open_.hook, new_meter=open_.new_meter,
                                     tail=True, structure=s,
                                     waiting=waiting, level_total=m.start_total_bytes,
                                     link_ref=open_.link_ref,
                                     after_recording=open_.after_recording,
                                     user_held=open_.user_held, probation=open_.probation,
                                     replaced=open_.replaced)
            self._meter.finalizer = weakref.finalize(self, _abandon, tail)
            if waiting is not None:
                _watch_updates(self, self._meter)
            else:  # a callable's parameters are not known: to the next call
                weakref.finalize(hook, _graph_died, weakref.ref(self), self._meter)
        if not open_.after_recording:
            self._check(open_.entry, s, stats, measured,
                        open_.probation + _probation_bytes(hook), open_.replaced)
            if tail is None:
                self._say_measured(s, stats)

    def _held_at_update(self, s: _Structure) -> None:
        """The graph of structure ``s`` is alive when the update ends: the
        loop holds it (its loss, from ``loss.backward()`` through
        ``optimizer.update()``), and with it what a plan keeps after the
        backward (``checkpoints``, ``all``). Such plans are replayed so at
        the next call, and every plan is predicted so from then on
        (Planner._with_facts)."""
        if self.planner.held_at_update or s.graph.step.kept_after_backward:
            return
        self.planner.held_at_update = True
        self._replays += [(e, t, {"kept_after_backward": True})
                          for e in list(self.planner.entries.values())
                          for t in e.structures if t.program.release_mode != "none"]

    def _on_to_a_later_pass(self, open_: _OpenMeter) -> bool:
        """At the end of the update, a tail whose plan learned a backward
        pass through its graph after the update: the graph's being held is
        noted and the meter goes on until the graph is freed (or the next
        call), that pass included. False for any other tail."""
        s, hook = open_.structure, open_.hook()
        if s is None or hook is None or s not in open_.entry.structures or not (
                s.program.multi_backward and s.program.probation.backward_after_update):
            return False
        self._held_at_update(s)
        if open_.watcher is not None:
            from ..executor import remove_update_watcher
            remove_update_watcher(open_.watcher)
            open_.watcher = None
        weakref.finalize(hook, _graph_died, weakref.ref(self), open_)
        return True

    def _say_measured(self, s: _Structure, stats: IterationStats) -> None:
        """The first measured step of the runner's first plan, and of each
        plan corrected after an overshoot: one line with plain Chainer's
        peak, the plan's predicted and measured peaks and the saving."""
        if stats.measured_peak_bytes is None:
            return
        from ...core.replay import step_calls
        # (plain Chainer's step of several calls: a bound, no saving said;
        # a plan whose replay counts the previous graph, which the model
        # turned out to let go (check_held_graph): said once replayed
        # without it, at the next call)
        let_go = any(t is s and facts is _LET_GO for _, t, facts in self._replays)
        stats.plain_peak_bytes = plain_peak(s.graph, s.plan)[0] \
            if step_calls(s.graph) == 1 and not let_go else None
        correction = int(s.graph.step.correction_bytes)
        if (correction in self._said_measured or let_go
                or s.checked < min(2, self.spec.check_iterations)):
            return  # (said from the second step: the first has no state, no gradients yet)
        self._said_measured.add(correction)
        level = logging.INFO if self.spec.verbose else logging.DEBUG
        report.log(level, "%s", describe_step(s.graph, s.plan, s.planning_time_s,
                                              stats.measured_peak_bytes,
                                              corrected=bool(correction)))

    def _check(self, entry: _Entry, s: _Structure, stats: IterationStats,
               measured: int, probation: int = 0, replaced: int = 0) -> None:
        """A peak over the budget (total scope): the memory model is to be
        corrected by what the plan missed, and the structure planned again
        at the model's next call (:meth:`apply_pending`): the check
        runs inside the step (at the end of its backward, or of the
        optimizer's update), and planning there would add the planner's
        memory to the step the budget bounds. ``probation``: bytes of
        parameter values saved on probation that the step counted
        (:attr:`Program.on_probation`); ``replaced``: what the previous
        call's graph held beyond what this plan counts for it, left by a
        plan since replaced (:meth:`_replaced_plan_bytes`). Each is said,
        and no part of the correction (no later step holds them)."""
        if self.spec.budget_scope != "total":
            return
        budget = s.plan.budget_bytes
        for held, said, what in (
                (replaced, "_said_replaced",
                 "held by the previous call's graph beyond what this plan counts for it: that "
                 "graph ran under the plan this one replaced (made before the loop was seen to "
                 "keep its graph into the next call, or before a correction), which holds more "
                 "after its backward; later steps hold this plan's graph"),
                (probation, "_said_probation",
                 "held on probation, in no plan: parameter values saved before the optimizer's "
                 "update, or the arrays they were read into kept through it where those are "
                 "smaller. A plan made before the training loop was seen keeps them until a "
                 "graph that was alive at an update dies without another backward pass, so "
                 "that one after the update could still regenerate; later steps do not hold "
                 "them, but for the next one where the loop keeps its loss into the next "
                 "forward (capture_batch=None records the first call instead, plainly, and "
                 "keeps none)")):
            if held and budget is not None and measured > budget and not getattr(self, said):
                setattr(self, said, True)
                report.warning("the measured peak %s is over the budget %s with %s " + what,
                               format_bytes(measured), format_bytes(budget), format_bytes(held))
        transient = probation + replaced + self._beyond.get(id(s), 0)
        if s.program.over_budget_by_mode and measured - transient <= s.plan.predicted_peak_bytes:
            return  # (over by the plan's own choice, said there: planned again, the same)
        correction = self._correction.overshoot(measured, budget, s.plan.predicted_peak_bytes,
                                                transient=transient)
        if not correction:
            return
        if self.corrections is None:
            self.corrections = {}
        # the backward's and the update's checks of one step: the larger miss
        _, _, before = self.corrections.get(id(s), (entry, s, 0))
        self.corrections[id(s)] = (entry, s, max(before, correction))

    @property
    def pending(self) -> bool:
        """Whether plans are to change at the model's next call
        (:meth:`apply_pending`)."""
        return bool(self.corrections or self._replays)

    def apply_pending(self) -> None:
        """At a training call, before its meter starts: the plans that
        :meth:`check_held_graph` found let go of the previous call's graph,
        replayed without it, and, once the loop was found holding a graph
        through the update (:meth:`stop`), the plans that keep arrays after
        the backward replayed with it (chosen where that fits their budget:
        the same plan, its prediction and plain Chainer's as they are);
        then the structures that overshot their budget planned again with
        the memory model corrected by what they missed. A budget the
        corrected model cannot meet is raised (or warned about) by the
        call of that signature."""
        replays, self._replays = self._replays, []
        replays = [(entry, s, facts) for entry, s, facts in replays if s in entry.structures
                   and any(getattr(s.graph.step, k) != v for k, v in facts.items())]
        if replays:
            from ...core.budget import release_caches
            from ...core.replay import replay
            try:
                for entry, s, facts in replays:
                    graph = s.graph.with_step(**facts)
                    peak = replay(graph, s.program if s.plan.recompute else None,
                                  release_mode=s.program.release_mode).peak_bytes
                    info = dict(s.plan.info)
                    if "vanilla_peak_bytes" in info:
                        info["vanilla_peak_bytes"] = replay(graph, None).peak_bytes
                    s.graph = s.program.graph = graph
                    s.plan = dataclasses.replace(s.plan, predicted_peak_bytes=int(peak),
                                                 info=info)
                    self.planner.plans_made += 1  # (its memory is in this call: watch_planning)
            finally:
                # the replays' caches (a plan's graph in its backward
                # order, 6 KB on a 386-function LSTM) stay in no step
                release_caches()
        pending, self.corrections = self.corrections, None
        for entry, s, correction in (pending or {}).values():
            if s in entry.structures:
                self.planner.replan(entry, s, correction_bytes=int(
                    s.graph.step.correction_bytes) + correction)

    def check_held_graph(self, entry: _Entry, hook: IterationHook) -> None:
        """At the end of a planned forward whose call found the previous
        call's graph alive: a plan that counted that graph through the
        forward (``held_into_next_forward``, assumed for a model that keeps
        an output in an attribute) when the model let go of it before its
        first function (``L.Classifier`` and ``L.LSTM``'s ``reset_state``
        do) is to be replayed without it (:meth:`apply_pending`), at the
        model's next call: the replay and the graph it makes would be in
        this step's peak (3 KB a graph array per 386 functions, 14 KB over
        the prediction on Chainer's PTB LSTM, which a tight budget's
        correction then refused); this step is checked against the plan's
        prediction with the graph held, which is above it."""
        funcs, self._held_previous = self._held_previous, None
        if funcs is None or hook.program is None or getattr(hook, "_held_at_start", True):
            return  # still held when this forward began: as planned
        self._replays += [(entry, s, _LET_GO) for s in entry.structures
                          if s.program is hook.program and (s.graph.step.held_into_next_forward
                                                            or s.graph.step.held_other_bytes)]

    def held_previous_bytes(self, entry: _Entry) -> int:
        """What the graph of the model's previous call of ``entry``'s
        signature holds now, where :meth:`count_held_graph` found it alive
        at this call (planning at the call has it alive too); 0 otherwise
        (another signature's graph is the planner's ``held_other``)."""
        previous = self.last_hook() if self.last_hook is not None else None
        if self._held_previous is None or previous is None or self.last_entry is not entry:
            return 0
        return _held_now(previous, self.caller_keeps_inputs)

    def watch_held_graph(self, hook: IterationHook) -> None:
        """Whether the previous call's graph, alive at this call, is still
        alive when ``hook``'s forward applies its first function."""
        funcs = self._held_previous
        if funcs is None:
            return
        ref = weakref.ref(hook)  # (no cycle: the hook dies with its graph)
        steps = weakref.ref(self)

        def first() -> None:
            h, r = ref(), steps()
            if h is not None and r is not None:
                h._held_at_start = r.held_at_start = any(f() is not None for f in funcs)
        hook.on_first_function = first

    def find_step(self, mark: Any) -> None:
        """The earlier calls of this training step (``mark``: see
        ``_step_mark``) whose graphs are alive with a backward still to come
        (a WGAN-GP critic: the penalty's call, backpropagated again later,
        then the fake batch, at the real one's call): one backward runs
        through all of them, so the step holds them all at once
        (``_step_others``). This call's meter is then the step's, from its
        first call on (:meth:`close_step`, :meth:`start`)."""
        alive, others = [], []
        for ref in self._graphs:
            h = ref()
            if h is None or h.let_go_done or \
                    not any(c.func() is not None for c in h.recorder.calls):
                continue  # (its graph is gone)
            alive.append(ref)
            if getattr(h, "step_mark", None) == mark and h.recorder.forward_done and (
                    not h.backward_done or h.no_release):
                others.append(ref)
        self._graphs = alive
        self._step_others = others

    def count_step_calls(self, entry: _Entry, args: Tuple[Any, ...]) -> None:
        """A step that holds more calls of the model at once than its plan
        was made for (:meth:`find_step`): the plan is made again, before
        this call runs, for as many (``step.calls_per_step``: every call
        under the same plan, the step's peak the calls' bytes above what
        they share, see :func:`~chainer_recompute.core.replay.step_calls`);
        later plans are made so from the start (``_add``). The earlier calls
        of the step that reveals them ran under the plan made for fewer:
        that step may exceed the budget (said once).

        Past four calls, a step that goes on calling (an episode's calls
        at batch 1 before REINFORCE's one backward) is planned again only
        where its count doubles the one planned for, and for the exact
        count at the next step's first call: a planning per call made
        chainerrl's REINFORCE 300 times slower in its first steps."""
        others = [h for h in (r() for r in self._step_others) if h is not None]
        k, d = 1 + len(others), sum(1 for h in others if h.no_release)
        planned_for = self.planner.step_calls
        if k == 1 and self._calls_seen > planned_for:
            k = self._calls_seen  # (the last step's count, at this step's first call)
        elif 4 < k < 2 * planned_for:
            self._calls_seen = max(self._calls_seen, k)
            k = planned_for  # (planned again when it doubles, or at the next step)
        more, whole = k > planned_for, d > self.planner.whole_calls
        if not (more or whole):
            return
        self.planner.step_calls, self.planner.whole_calls = max(k, self.planner.step_calls), max(d, self.planner.whole_calls)
        if (self.spec.budget_scope != "total" or self.planner.coordinator is not None
                or not entry.structures):
            return  # (planned for them when planned: see _add)
        from ...core.units import format_bytes
        k, b = self.planner.step_calls, self.planner.budget_bytes
        level = logging.INFO if self._said_step_calls else logging.WARNING
        self._said_step_calls = True
        what = (f"{self.planner._name(args)} is called {k} times in one training step before a "
                f"backward through them all" if more else
                f"a call of {self.planner._name(args)} is backpropagated with double backprop inside "
                f"the step and holds its whole graph")
        hint = f" (apply(..., calls_per_step={k}) plans the first step for them)" if more else ""
        report.log(level, "%s; planned again for %d calls per step (each under the same "
                   "plan%s)%s", what, k,
                   f", {self.planner.whole_calls} holding plain Chainer's peak" if self.planner.whole_calls
                   else "",
                   f"; this step ran its earlier calls under a plan for fewer and may exceed "
                   f"the budget {format_bytes(b)}{hint}" if b is not None else "")
        if whole and b is not None:  # (said once: the correction that follows is said too)
            report.log(level, "what the double backprop of %s's call builds (its second-order "
                       "graph) is in no recording: the next step measures it and may exceed the "
                       "budget %s once, then the memory model is corrected",
                       self.planner._name(args), format_bytes(b))
        for s in list(entry.structures):
            self.planner.replan(entry, s)  # (for the calls per step seen: _add)
        if self._meter is not None:  # measured, not checked: its earlier calls ran another plan
            self._meter.after_recording = True

    def watch_gradients(self, hook: IterationHook, entry: _Entry,
                        link: Optional[chainer.Link]) -> None:
        """Whether the loop leaves the parameters' gradients alive when this
        call's backward begins (``model.zerograds()``, or several calls'
        gradients accumulated before one update; Chainer's updaters and a
        loop that calls ``cleargrads()`` leave none): Chainer keeps each
        until its parameter's first backward reader, then adds the new
        one to it. Seen once, every plan is made for it
        (``step.grads_in_backward``): ``entry``'s at the end of that
        backward (this step, under a plan without them, is measured, not
        checked, and takes the planner's memory too), other signatures' at
        their next call (:meth:`count_grads_alive`)."""
        if link is None or self.planner.grads_alive:
            return
        # (weak references: the hook that keeps these callbacks may be the
        # entry's pending recording)
        steps, link_ref, entry_ref = weakref.ref(self), weakref.ref(link), weakref.ref(entry)

        def start(h: IterationHook) -> bool:
            """At a backward pass's first function; True when done."""
            if not _into_parameters():
                return False  # (chainer.grad: the gradients are not touched)
            r, lk = steps(), link_ref()
            if r is None or lk is None or r.planner.grads_alive:
                return True
            if any(p.grad_var is not None for p in lk.params()):
                r.planner.grads_alive = True
                if r._meter is not None:
                    r._meter.after_recording = True
                before = h.on_backward_done

                def done(hh: IterationHook) -> None:
                    if before is not None:
                        before(hh)  # (the meter, first: its plan is still the entry's)
                    r2, e, lk2 = steps(), entry_ref(), link_ref()
                    if r2 is not None and e is not None:
                        r2.count_grads_alive(e, lk2)
                h.on_backward_done = done
            return True
        hook.on_backward_start = start

    def count_grads_alive(self, entry: _Entry, link: Optional[chainer.Link]) -> None:
        """The plans of ``entry`` made without the gradients the loop
        leaves alive into the backward (:meth:`watch_gradients`), made
        again for them (said once, naming ``link``). A budget they cannot
        meet is kept on the entry, raised at its next call."""
        if not self.planner.grads_alive:
            return
        if not self._said_grads_alive:
            self._said_grads_alive = True
            b = self.planner.budget_bytes
            report.warning(
                "the gradients of %s's parameters are alive when its backward begins (the loop "
                "zeroes them with zerograds(), or accumulates several calls' gradients before "
                "an update): Chainer adds each new gradient to the old one, so both are alive "
                "for a while; planned again for them%s", self.planner._name((link,)),
                f" (the step that showed it ran under a plan without them and may exceed the "
                f"budget {format_bytes(b)})" if b is not None else "")
        try:
            for s in [s for s in entry.structures if not s.graph.step.grads_in_backward]:
                self.planner.replan(entry, s)
        except Exception as e:  # noqa: BLE001 - maybe inside the user's backward: at the next call
            entry.error = e

    def _held_previous_hook(self) -> Optional[IterationHook]:
        """The driver of the model's previous call, where its graph, its
        backward run, is still alive at this call and counted
        (:meth:`count_held_graph`); None otherwise."""
        if (self.spec.free_previous_graph or self.spec.budget_scope != "total"
                or self.planner.coordinator is not None):  # (a coordinator replans collectively)
            return None
        previous = self.last_hook() if self.last_hook is not None else None
        if previous is None or not previous.backward_done or previous.let_go_done:
            return None
        if not any(c.func() is not None for c in previous.recorder.calls):
            return None  # freed, as by StandardUpdater (``del loss`` after the backward)
        return previous

    def release_recorded(self) -> None:
        """A recorded (plain) graph of the previous call still alive at
        this one releases what its plan drops (:meth:`count_held_graph`)
        before anything is planned or replayed at this call, which then
        has the graph alive as a planned one."""
        previous = self.last_hook() if self.last_hook is not None else None
        if previous is None or not previous.recorder.recording or previous.planned is None:
            return  # (the usual call: no walk of the previous graph's calls)
        if self._held_previous_hook() is previous:
            previous.release_as_planned(previous.planned)

    def count_held_graph(self, entry: _Entry) -> None:
        """The graph of the model's previous call, its backward run, is
        still alive at this call (the loop keeps its ``loss`` into the next
        forward, the model keeps an output in an attribute): as in plain
        Chainer it stays alive through this call's forward. A plan that did
        not count it is made again, before this step's meter starts, with
        what such a graph holds after its backward added to the forward
        (``step.held_into_next_forward``, replayed), so that the step
        stays under the budget. A recorded (plain) graph has released
        what its plan drops (:meth:`release_recorded`, first at the
        call): a backward pass through it later regenerates them. (A model
        known to keep its graph is planned so from the start:
        :meth:`_recorded`, :meth:`_capture_at`.)"""
        self._held_previous = None
        self._beyond = {}  # (the previous step is checked: close_step, before this)
        previous = self._held_previous_hook()
        if previous is None:
            return
        self._held_previous = [c.func for c in previous.recorder.calls]  # (weak references)
        if self.last_entry is not entry:  # (another signature's graph)
            if self.held_at_start is not False and \
                    all(r() is not previous for r in self._step_others):  # (this step's: per_step)
                self.count_held_other(entry, previous)
            return
        if not entry.structures:
            return
        s = entry.structures[0]
        if not s.graph.step.held_into_next_forward and \
                self.held_at_start is not False:  # (not seen let go before its forward)
            logger.info("the graph of the model's previous call is still held at its next "
                        "call; planned again with it alive through the forward")
            self.planner.replan(entry, s, held_into_next_forward=True)

    def count_held_other(self, entry: _Entry, previous: IterationHook) -> None:
        """The graph of the model's previous call, of another signature
        (the batches' shapes change from call to call: a sequence length),
        is alive at this call (:meth:`count_held_graph`): what it holds is
        alive through this call's forward (a step after a larger batch holds
        that batch's graph), counted as the replay counts a graph of its own
        signature held so (:func:`_held_after`; a graph not planned yet, a
        recorded first call, by its arrays: :func:`_held_now`), less the
        previous batch where the caller keeps its batches. The plans this
        call makes (its signature's first) are made for it (the planner's
        ``held_other``); one made for less (``step.held_other_bytes``, the
        most its calls met), whose prediction with the difference is over
        its budget, is made again before this step's meter starts."""
        program = previous.program or previous.planned
        done = next((s for s in getattr(self.last_entry, "structures", ())
                     if s.program is program), None)
        if done is None:
            held = _held_now(previous, self.caller_keeps_inputs)
        else:
            from ...core.replay import held_caller_input_bytes
            held = _held_after(done) - (held_caller_input_bytes(done.graph)
                                        if self.caller_keeps_inputs else 0)
        self.planner.held_other = held  # (this call's plans are made for it)
        from ...core.budget import limit_of
        for s in list(entry.structures):
            more = held - _held_counted(s)
            budget = s.plan.budget_bytes
            # (not where the plan's prediction has room for it under its budget)
            if more > 0 and (budget is None or
                             s.plan.predicted_peak_bytes + more > limit_of(budget)):
                logger.info("the graph of the model's previous call, of another input "
                            "signature, still holds %s at its next call; planned again with "
                            "it alive through the forward", format_bytes(held))
                # (that graph dies in this call's forward: a signature whose
                # budget it alone makes infeasible keeps its plan, over the
                # budget at this call only, unless the error is to be raised)
                refused = self.planner.replan(entry, s,
                                              keep_if_refused=not self.planner._raising(),
                                              held_other_bytes=held)
                if refused is not None:
                    self.run_beyond(s, held, refused)

    def run_beyond(self, s: _Structure, held: int, e: InfeasibleBudgetError) -> None:
        """This call runs under ``s``'s plan, though the previous call's
        graph of another signature, alive through its forward (``held``
        bytes), makes its budget infeasible (``e``): that graph dies in the
        forward, so the signature keeps its plan, and this call is over the
        budget by what that graph holds beyond what the plan counts. Said
        once; that much of the step's overshoot is no correction of the
        memory model (:attr:`_beyond`)."""
        self._beyond[id(s)] = max(0, held - _held_counted(s))
        if self._said_beyond:
            return
        self._said_beyond = True
        least = e.least_feasible_bytes
        report.warning(
            "the graph of the model's previous call, of another input signature, still holds "
            "%s at this call, until this call's forward replaces it (the loop or the model "
            "keeps it): with it alive no plan of this call fits the budget %s%s; this call "
            "runs under its signature's plan, over the budget, and the next calls as planned "
            "(a budget of the least or more keeps such calls under it)", format_bytes(held),
            format_bytes(s.plan.budget_bytes),
            f" (the least is {format_bytes(least)})" if least is not None else "")

    def _replaced_plan_bytes(self, entry: _Entry, hook: IterationHook,
                             previous: IterationHook) -> int:
        """What the previous call's graph, of this signature, holds beyond
        what the plan ``hook`` follows counts for it (its own graph after
        its backward, ``step.held_into_next_forward``; a graph of another
        signature, ``step.held_other_bytes``), where that graph ran under a
        plan since replaced (planned again for that graph, for a correction,
        for more calls per step): the replaced plan may release less after
        its backward (a source it did not pin, checkpoints it kept for a
        second pass), and no later step holds its graph. 0 where the previous
        graph's plan is one of the signature's (two structures taking
        turns: a pattern the correction is to learn)."""
        if self.last_entry is not entry or previous.program is None or \
                any(s.program is previous.program for s in entry.structures):
            return 0
        return self._held_beyond_plan(entry, hook, previous)

    def _held_beyond_plan(self, entry: _Entry, hook: IterationHook,
                          previous: IterationHook) -> int:
        """What the previous call's graph holds now beyond what the plan
        ``hook`` follows counts for it."""
        s = next((s for s in entry.structures if s.program is hook.program), None)
        if s is None:
            return 0
        return max(0, _held_now(previous, self.caller_keeps_inputs) - _held_counted(s))

    def let_go_of_finished_graphs(self) -> None:
        """The graphs of earlier calls whose backward has run release what
        they hold (see ``free_previous_graph``)."""
        waiting = []
        for ref in self._graphs:
            hook = ref()
            if hook is None:
                continue
            if hook.backward_done:
                hook.let_go()
            else:  # its backward is still to come (a discriminator's other batch)
                waiting.append(ref)
        self._graphs = waiting
