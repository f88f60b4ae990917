"""The backward driver: discard arrays in the forward pass, regenerate them
just before backward needs them, and check every iteration against its plan.

A :class:`Program` is the static part, made once per planned graph from the
Graph and a solver's Plan: which nodes are dropped, when (after which
function) their arrays can be released, which block each belongs to, which
backward reads which arrays.

An :class:`IterationHook` drives one training iteration. It holds a
:class:`~chainer_recompute.runtime.capture.Recorder`, which tells it which
recorded array every input of every function is; while the model's forward
runs (a global ``FunctionHook`` forwarding to its recorder) it:

- checks each function against the candidate plans of this input signature
  (its class and input shapes before it runs; its real wiring, which
  recorded array each input is, right after), and follows one that matches;
- holds references to the arrays that regeneration will start from (the
  inputs of dropped nodes that are not dropped themselves), checksums the
  parameters and inputs among them, and releases the dropped arrays as soon
  as their last forward reader has run: the references Chainer keeps for
  backward (a retained input's ``VariableNode._data``, a function's
  ``_retained_output_data``, derived attribute arrays) are set to ``None``,
  keeping each node's shape and dtype;
- when the iteration stops matching every plan, it releases nothing more,
  never regenerates from an unverified source, and records the rest of the
  iteration (measured) so that the new structure can be planned.

It is also a local hook of every recorded function, so it sees
``backward_preprocess`` of those functions during a plain
``loss.backward()``: before a function's backward reads a released array,
the released nodes of its block that some remaining backward will read are
recomputed from the kept ones by running the recorded function nodes'
``forward`` again under ``chainer.using_config('in_recomputing', True)``,
with written arrays (BatchNorm statistics) detached, and the results are
put back where Chainer's backward reads them; after the last backward
reader of an array has run, it is released again, except the arrays the
forward returned (their consumers outside the link may read them in
another backward pass). A function whose every output the forward returns
and that holds nothing else is never released at all (the caller holds
its arrays; :class:`~chainer_recompute.core.execution.ExecutionPlan`).
Functions no backward will reach (outputs kept for logging) are never
regenerated.

A graph backpropagated again after an optimizer update of a parameter
that a released block was computed from (Chainer's DCGAN updater updates
the discriminator between the two backward passes through it) needs the
parameter's old values to regenerate: the update first saves them
(``UpdateRule.update`` is patched only while such an iteration is alive).
That is done only for plans known to be backpropagated twice, and on
probation for plans made before their recorded graph's backward had run
(from a separate capture, or a model called twice before its first
backward): a plan made from a recorded iteration whose backward ran to the
end saves nothing, so that its update adds no memory (a loss link keeps
the graph, and anything saved, into the next step). If such a graph is
backpropagated after an update after all, the update count of the
parameter's rule says so and the regeneration raises
:class:`~chainer_recompute.core.errors.UnsafeRecomputeError` (the next iterations
save the values); any other in-place change of a parameter or input that a
regeneration would read is detected by its checksum (``verify``) and
raises too, rather than give a gradient different from plain Chainer's.
With double backprop (``enable_double_backprop``) nothing more is
released.

The hook holds no strong reference to function or variable nodes, so the
graph is freed by reference counting as in plain Chainer. Everything goes
through the array module of the arrays, so NumPy and CuPy take the same
path.

:class:`Program`, :class:`IterationStats` and the wiring checks live in
:mod:`~chainer_recompute.runtime.program`, the patched optimizer update in
:mod:`~chainer_recompute.runtime.param_updates`; both are importable from
here as before.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy

from . import _chainer  # noqa: F401
import chainer
from chainer import backend

from ..core.errors import RecomputeError, UnsafeRecomputeError
from ..core.execution import regeneration_frees
from .capture import Call, Recorder, fingerprint, owner_of
from .capture.recorder import _NO_NAMES, _unwrap
from .param_updates import (_LIVE, _add_live, _update_count, add_update_watcher,  # noqa: F401
                            remove_update_watcher)
from .program import (PROBATION, IterationStats, Program, _after_mismatch,  # noqa: F401
                      _after_update, _matches_after, _matches_before)

logger = logging.getLogger(__name__)

#: The distinct ``IterationHook.released`` entries (released outputs,
#: retained outputs released), shared: every iteration makes the same few.
_RELEASED: Dict[Tuple[Tuple[int, ...], bool], Tuple[Tuple[int, ...], bool]] = {}


class IterationHook(chainer.FunctionHook):
    """Drives one forward/backward of a planned model (see module doc).

    It holds a :class:`Recorder` (``recorder``), which maps each function
    to its node of the planned graph (and records it when no plan fits)
    and calls this hook back before and after each function's forward and
    backward. This hook is what Chainer calls: registered for the forward
    (a ``with`` block) and on each function it saw (its backward), so the
    graph's functions keep it, and it keeps the recorder (which refers to
    it weakly: no reference cycle).

    Args:
        programs: the candidate plans of this input signature, the one to
            try first first; empty to record only.
        link, args, measure, analyse: as for :class:`Recorder`.
        verify: checksum the parameters and inputs that regeneration reads.
    """

    def __init__(self, programs: Sequence[Program] = (), *, link: Any = None,
                 args: Sequence[Any] = (), verify: bool = True, measure: bool = True,
                 analyse: bool = True) -> None:
        self.name = f"chainer_recompute-run-{id(self):x}"  # (unique: see Recorder)
        self.recorder = Recorder(measure=measure, analyse=analyse, link=link, args=args,
                                 driver=self)
        self.candidates: List[Program] = list(programs)
        self.program: Optional[Program] = self.candidates[0] if self.candidates else None
        self.recorder.recording = self.program is None
        if self.program is not None:
            self.recorder.shared_records = self.program.records
        self.verify = verify
        self.mismatch_at: Optional[int] = None
        self.kept: Dict[int, Any] = {}  # array id -> pinned array
        self._pinned_at: Dict[int, Tuple[int, ...]] = {}  # node -> array ids it pinned
        self._pinned_ok: Set[int] = set()  # dropped nodes whose sources are held
        self.params: Dict[int, Any] = {}  # array id -> Parameter read by a dropped node
        # parameters that a dropped node's inner functions read (F.forget's
        # function): a regeneration reads them live, so no saved copy helps
        self._inner: Set[int] = set()
        self.fingerprints: Dict[int, Tuple[Any, ...]] = {}
        # arrays whose fingerprint a regeneration checked since the
        # backward last reached new functions (_extend_reach)
        self._checked: Set[int] = set()
        self.snapshots: Dict[int, Any] = {}  # array id -> parameter values saved before an update
        self._reads: Optional[Tuple[Tuple[int, int], Set[int]]] = None  # (_released_reads)
        # dropped node -> NumPy's random state before its forward (its drawn
        # attributes are made again from it)
        self._rng_states: Dict[int, Any] = {}
        self.released: Dict[int, Tuple[Tuple[int, ...], bool]] = {}
        self.regenerated: Set[int] = set()
        self._regen_ok: Dict[int, bool] = {}
        # node -> (its function, its output nodes' weak references), for the
        # nodes released during the forward, until the forward returns: a
        # function the forward unchains after that (unchain_backward()
        # inside the model) is let go of by Chainer, and what a later
        # function of the call reads of it is made again (see finish)
        self._held_funcs: Dict[int, Tuple[Any, Tuple[Any, ...]]] = {}
        self.no_release = False  # double backprop, or a backward during the forward
        # a probation mode of the program's (_choose_probation_mode) and
        # the bytes its step holds so at the update; None: the program's
        # release mode
        self.release_mode: Optional[str] = None
        self.probation_extra: Optional[int] = None
        self._own_updated = False  # (in a probation mode: see before_param_update)
        # the optimizer updates of the model's parameters at the forward's end
        # (_updates_of) of a recorded iteration or one on probation
        self._updates_at_forward: Optional[int] = None
        self.multi_backward = False
        self._bw_seen: Set[int] = set()
        self._reach: Optional[Set[int]] = None
        self.remaining: Dict[int, int] = {}
        self._needs: Dict[int, Tuple[int, ...]] = {}
        self._done: Dict[int, Tuple[int, ...]] = {}
        self._bw_left: Optional[Set[int]] = None
        #: called once when the backward pass has run every reachable function
        self.on_backward_done: Optional[Any] = None
        self.backward_done = False  # set then
        self.let_go_done = False  # released by let_go(): no backward through it any more
        #: called before the forward's first function runs
        self.on_first_function: Optional[Callable[[], None]] = None
        #: called with this hook, after the forward, where a backward pass
        #: reaches functions it had not (its first one, first), until it
        #: returns True
        self.on_backward_start: Optional[Callable[[Any], bool]] = None
        #: the plan made from this recorded iteration (it learns a second
        #: backward pass through this graph)
        self.planned: Optional[Program] = None
        self.stats = IterationStats(len(self.program.dropped) if self.program else 0,
                                    path="recorded" if self.program is None else "planned")
        self._update_state = {"updated": False, "again": False}
        if self.program is not None:
            self.stats.n_nodes = self.program.n
            self.stats.release_mode = self.program.release_mode
            # (a backward may run inside the forward: chainer.grad)
            self._needs, self._done = self.program.needs, self.program.done
        # array id -> the update count of a watched parameter's update rule
        # when the forward read it (an update since then is seen without a
        # checksum, and without patching the optimizer)
        self._param_t: Dict[int, int] = {}

    # ------------------------------------- Chainer's calls, to the recorder
    # Chainer's calls before and after each function's forward and backward
    # (this hook is what Chainer calls: registered for the forward, and on
    # each function for its backward). For a call of an iteration that
    # follows its one candidate plan without recording, each does the
    # recorder's work and this hook's callback (``before_forward``, ...)
    # in one call, exactly as the recorder's method followed by the
    # callback does (a mismatch hands over with nothing to redo); every
    # other call (a recording, a nested or unrecorded function, a mismatch,
    # several candidate plans) goes to the recorder's method, which calls
    # this hook back. (Methods of the class: bound ones kept on the
    # instance would make it a reference cycle, freed only by the
    # collector with the arrays it pins.)
    def forward_preprocess(self, function: Any, in_data: Tuple[Any, ...]) -> None:
        rec = self.recorder
        work = rec._unrecorded
        if (rec._depth or rec.forward_done or rec.recording or work._at is not None
                or work._made or len(self.candidates) != 1
                or self.candidates[0] is not self.program
                or not chainer.config.enable_backprop):
            return rec.forward_preprocess(function, in_data)
        if rec._pending is not None:
            rec._map_pending()
            if rec.recording:  # (it left the plan)
                return rec.forward_preprocess(function, in_data)
        p = self.program
        i = len(rec.calls)
        names = rec._arg_names
        names = tuple([names.get(id(x)) for x in in_data])
        call = Call(i, function, in_data, _NO_NAMES.get(names, names), rec._links.current)
        rec.calls.append(call)
        rec.index_of[id(function)] = i
        rec._depth = 1
        rec._top.append(call)
        if i == 0 or not _matches_before(p, call, in_data):
            # (the first call: ``on_first_function`` runs before the check)
            self.before_forward(call, function, in_data)
        else:
            self._follow(call, in_data)
        rec._wrap(call, function, in_data)

    def forward_postprocess(self, function: Any, in_data: Tuple[Any, ...]) -> None:
        rec = self.recorder
        top = rec._top
        call = top[-1] if top else None
        if rec._depth != 1 or type(call) is not Call or call._before is not None:
            return rec.forward_postprocess(function, in_data)
        rec._depth = 0
        top.pop()
        out = call._out or ()
        _unwrap(function)
        call.keep_in = tuple(function._input_indexes_to_retain or ())
        call.keep_out = tuple(function._output_indexes_to_retain or ())
        if not rec._describe_as_planned(call, out):
            rec._describe(call, function, in_data, out, {})
        function.local_function_hooks[self.name] = self
        call._func_strong = function
        rec._pending = call

    def backward_preprocess(self, function: Any, in_data: Any, out_grad: Any) -> None:
        rec = self.recorder
        i = rec.index_of.get(id(function))
        if i is None:
            return
        if rec.recording or rec._outside_watch is not None or not rec.forward_done:
            return rec.backward_preprocess(function, in_data, out_grad)
        if (self.let_go_done or self._update_state["updated"] or i in self._bw_seen
                or self._reach is None or i not in self._reach):
            return self.before_backward(i, function)
        # (before_backward, for a function of this backward pass seen first)
        if chainer.config.enable_backprop:
            self.no_release = True  # (double backprop: see before_backward)
        self._bw_seen.add(i)
        needs = self._needs.get(i)
        if needs:
            released = self.released
            missing = [u for u in needs if u in released]
            if missing:
                self._regenerate(i, missing)

    def backward_postprocess(self, function: Any, in_data: Any, out_grad: Any) -> None:
        rec = self.recorder
        i = rec.index_of.get(id(function))
        if i is None:
            return
        if rec._bwd:  # (a backward begun while recording)
            return rec.backward_postprocess(function, in_data, out_grad)
        self.after_backward(i, function)

    def added(self, function: Any = None) -> None:
        self.recorder.added(function)

    def deleted(self, function: Any = None) -> None:
        self.recorder.deleted(function)

    @property
    def mismatch(self) -> Optional[str]:
        return self.stats.mismatch

    @property
    def executing(self) -> bool:
        return self.program is not None and self.mismatch_at is None

    def _set_mismatch(self, index: int, message: str) -> None:
        self.mismatch_at = index
        self.stats.mismatch = message
        self.stats.path = "mismatch"
        self.recorder.recording = True

    # ---------------------------------------------------------- forward
    def before_forward(self, call: Call, function: Any, in_data: Tuple[Any, ...]) -> None:
        if call.index == 0 and self.on_first_function is not None:
            self.on_first_function()
        if not self.executing:
            return
        i = call.index
        alive = _alive(self.candidates, _matches_before, call, in_data)
        if not alive:
            p = self.program
            if i >= p.n:
                msg = (f"the forward applied more than the {p.n} functions of the planned "
                       f"graph (function #{i} is {call.op})")
            else:
                node = p.graph.nodes[i]
                planned = tuple(p.graph.arrays[a].shape for a in node.inputs)
                msg = (f"function #{i} is {call.op} on inputs of shapes {call.in_shapes}, "
                       f"but the plan has {node.op} on {planned}"
                       + (" (other parameters or arguments)" if node.op == call.op and
                          planned == call.in_shapes else ""))
            self._set_mismatch(i, msg)
            return
        self.candidates = alive
        if self.program not in alive:
            self._switch(alive[0], i)
        self._follow(call, in_data)

    def _follow(self, call: Call, in_data: Tuple[Any, ...]) -> None:
        """Call ``call`` matches the followed plan's node (before it runs):
        release what the plan releases before it, pin its sources if the
        plan drops it."""
        p, i = self.program, call.index
        shapes = p.before_key(i)[1]
        if shapes is not None:
            call.in_shapes = shapes  # (equal: the plan's, shared by every iteration)
        release_at = p.release_at.get(i)
        if release_at:
            pinned = self._pinned_ok
            for u in release_at:
                if u in pinned:  # its sources held under a verified wiring
                    self._release(u)
        if i in p.dropped:
            self._pin(i, p, in_data)
            if i in p.drawn:
                self._rng_states[i] = numpy.random.get_state()

    def planned_outputs(self, i: int) -> Optional[Tuple[Tuple[Any, ...], Tuple[Any, ...]]]:
        """Call ``i``'s outputs as its planned node has them
        (:meth:`Program.planned_outputs`), while the plan is followed."""
        if self.program is None or self.mismatch_at is not None:
            return None
        return self.program.planned_outputs(i)

    def planned_inputs(self, i: int) -> Optional[Tuple[int, ...]]:
        """Call ``i``'s inputs as a candidate plan's node has them, one
        unchained in the forward first (the recorder's, for a call the
        forward unchained before its inputs were mapped), while a plan is
        followed."""
        if self.program is None or self.mismatch_at is not None:
            return None
        for p in self.candidates:
            if i < p.n and p.graph.nodes[i].attrs.get("unchained"):
                return p.graph.nodes[i].inputs
        return self.program.graph.nodes[i].inputs if i < self.program.n else None

    def _switch(self, program: Program, upto: int) -> None:
        """Follow ``program`` from call ``upto`` on. The calls before it ran
        under another candidate plan (two structures' plans share the calls
        before the structures differ), whose pins and releases need not be
        this one's: this one's are made first (:meth:`_catch_up`), so that
        the step holds what its prediction has."""
        self.program = program
        self.recorder.shared_records = program.records
        stats = self.stats  # (the iteration's, of the plan it ends on)
        stats.n_dropped, stats.n_nodes = len(program.dropped), program.n
        stats.release_mode = program.release_mode
        self._needs, self._done = program.needs, program.done
        self._catch_up(program, upto)

    def _catch_up(self, p: Program, upto: int) -> None:
        """The state ``p`` holds before call ``upto`` (see :meth:`_switch`):
        the nodes it keeps that the other plan released made again, its
        sources of the nodes it drops pinned, the other plan's pins that
        none of them starts from let go of, and what it releases by then
        released."""
        released, kept, pinned = self.released, self.kept, self._pinned_ok
        calls, nodes, arrays = self.recorder.calls, p.graph.nodes, p.graph.arrays
        back = [u for u in sorted(released) if u < upto and u not in p.dropped]
        if back and not self._put_back(back):
            for u in back:
                self._put_back([u])
        need: Set[int] = set()
        for u in sorted(p.dropped):
            if u >= upto:
                break
            f = calls[u].func()
            node = nodes[u]
            in_data: List[Any] = [None] * len(node.inputs)
            ok = f is not None
            for j in p.sources[u]:
                a = node.inputs[j]
                if arrays[a].kind != "param":  # (a parameter: _pin watches it)
                    need.add(a)
                    if ok:  # (pinned already, or still held by the graph)
                        in_data[j] = self._input_array(f, j, a, {})
                        ok = in_data[j] is not None
            if ok:
                self._pin(u, p, tuple(in_data))
            else:
                pinned.discard(u)  # (its sources not all at hand: not released)
        for u in released:
            if u not in pinned or u not in p.dropped:
                # released by the other plan, not pinned by this one: what
                # it reads (the other's sources among it) stays pinned
                need.update(calls[u].in_ids or ())
        for a in [a for a in kept if a not in need]:
            del kept[a]
            self.fingerprints.pop(a, None)
        for j in range(min(upto, p.n + 1)):
            for u in p.release_at.get(j, ()):
                if u in pinned:
                    self._release(u)

    def _put_back(self, nodes: List[int]) -> bool:
        """Regenerate released ``nodes`` (from the pins that released
        them), False where that cannot be done: an input lost with a
        function the forward unchained, a function gone (read by none).
        (:meth:`_regenerate` raises before it runs anything.) Those stay
        released, found by the backward as any released node is."""
        try:
            self._regenerate(nodes[-1], nodes)
        except UnsafeRecomputeError:
            raise  # (a source written since it was pinned: as in the backward)
        except RecomputeError:
            return False
        return True

    def _pin(self, i: int, p: Program, in_data: Tuple[Any, ...]) -> None:
        node = p.graph.nodes[i]
        new = []
        for j in p.sources[i]:
            a = node.inputs[j]
            info = p.graph.arrays[a]
            if info.kind == "param":
                # this call's inputs are mapped after it runs: the plan's parameter
                if a not in self.params and self._watch_param(a, p.param_refs.get(a)):
                    new.append(a)
                continue
            if a in self.kept:
                continue
            self.kept[a] = in_data[j]
            new.append(a)
            if self.verify and info.kind == "input":
                self.fingerprints[a] = fingerprint(in_data[j])
        for a in node.inner_params:  # read by F.forget's function when it runs again
            self._inner.add(a)
            if self._watch_param(a, p.param_refs.get(a)):
                new.append(a)
        if new:
            self._pinned_at[i] = tuple(new)  # (ints only: the collector stops following it)
        self._pinned_ok.add(i)

    def _watch_param(self, a: int, ref: Any) -> bool:
        """Regeneration may read parameter array ``a``: checksum it and save
        its values before an optimizer updates it. True if newly watched."""
        if a in self.params:
            return False
        param = ref() if ref is not None else None
        if param is None or param.array is None:
            return False
        self.params[a] = param
        if self.verify:
            self.fingerprints[a] = fingerprint(param.array)
        self._param_t[a] = _update_count(param)
        if self.program is not None and self.program.saves_parameters:
            _add_live(self)
        return True

    def after_mapping(self, call: Call) -> None:
        p = self.program
        if p is None or self.mismatch_at is not None:
            return
        candidates = self.candidates
        if not (len(candidates) == 1 and candidates[0] is p  # (the usual case, first)
                and _matches_after(p, call, self.recorder.param_refs)):
            alive = _alive(candidates, _matches_after, call, self.recorder.param_refs)
            if not alive:
                i = call.index
                self._set_mismatch(i, _after_mismatch(p, call, self.recorder.param_refs))
                self._unpin(i)  # pinned under an unverified wiring
                return
            self.candidates = alive
            if p not in alive:
                # This call's pins were made under the other plan's wiring.
                self._unpin(call.index)
                self._switch(alive[0], call.index + 1)
        # (equal: the plan's tuples, shared by every iteration, in place of
        # this call's own)
        node = self.program.graph.nodes[call.index]
        call.in_ids = node.inputs
        if call.out_ids == node.outputs:
            call.out_ids = node.outputs

    def _unpin(self, i: int) -> None:
        for a in self._pinned_at.pop(i, ()):
            self.kept.pop(a, None)
            self.params.pop(a, None)
            self.fingerprints.pop(a, None)
        self._pinned_ok.discard(i)

    def finish(self, result: Any = None) -> None:
        """The forward has returned (``result``): the recorder maps its
        last function, arrays released from functions the forward unchained
        since that a later function still reads are made again, then what
        the plan releases at the forward's end is released."""
        self.recorder.finish(result)
        if self.recorder.backward_during_forward:
            # Backward passes inside the forward (chainer.grad: MAML's inner
            # steps, a gradient penalty) kept everything they read
            # (no_release) and are not the iteration's: the backward after
            # the forward counts its own reach and readers from its start,
            # releases after its own last readers, and its end is the
            # backward's (the meter's, a recorded step's planning).
            self._bw_seen, self._reach, self.remaining, self._bw_left = set(), None, {}, None
            self.no_release = False
        held, self._held_funcs = self._held_funcs, {}
        self._restore_unchained(held)
        n = len(self.recorder.calls)
        if self.executing and n != self.program.n:
            self._set_mismatch(n, f"the forward applied {n} functions, but the planned graph "
                                  f"has {self.program.n}")
        if self.recorder.recording or self.program.on_probation:
            # (to learn, for the graph this iteration records, the first or
            # one that left its plan, or while the loop is not known yet,
            # whether a later pass comes after an optimizer update)
            self._updates_at_forward = _updates_of(self.recorder.param_refs)
        if self.executing:
            self.candidates = [p for p in self.candidates if p.n == n]
            for u in self.program.release_at.get(self.program.n, ()):
                if u in self._pinned_ok:
                    self._release(u)
            self._needs, self._done = self.program.needs, self.program.done
            if self.program.backward_order:
                self.impose_order(self.program.backward_order)
            if self.program.probation_modes and self.program.on_probation:
                # told of the update whether or not it saves anything: the
                # probation ends on the first clean one (before_param_update)
                _add_live(self)
        elif self.program is not None:
            # (whether or not the forward released anything: the backward
            # releases after the last readers, and a later pass regenerates
            # for its readers, by these)
            self._actual_readers()

    def _restore_unchained(self, held: Dict[int, Tuple[Any, Tuple[Any, ...]]]) -> None:
        """Released nodes whose function the forward unchained after they
        were released (``unchain_backward()`` inside the model where the
        plan's recording did not: Chainer let go of the function, so no
        backward could regenerate them) and whose outputs a function still
        reads (a skip connection across the cut): made again now from the
        pinned sources, put back, and never released again, as plain
        Chainer holds them."""
        lost = [u for u, (f, outs) in held.items()
                if f.inputs is None and u in self.released
                and any(outs[k]() is not None for k in self.released[u][0])]
        if not lost:
            return
        self._held_funcs = held  # (for _regenerate: the lost nodes and their sources)
        try:
            self._regenerate(max(lost), lost)
        finally:
            self._held_funcs = {}
        for u in lost:
            self._regen_ok[u] = False

    def impose_order(self, order: Sequence[int]) -> None:
        """Make Chainer's backward run the graph's functions in ``order``
        (a plan's ``backward_order``, with the same gradients: see
        :mod:`~chainer_recompute.core.backward_order`): Chainer runs the
        highest rank first, so the functions of ``order`` get ranks above
        every other function's, decreasing along it, and the others
        Chainer's own rule over the new ranks (the highest of their inputs'),
        their outputs one more, as ``FunctionNode.apply`` gives them. The
        ranks stay a topological order of the whole graph, so a function
        applied later to its arrays (the caller's loss, a second graph)
        ranks above them as it would have."""
        funcs = [c.func() for c in self.recorder.calls]  # (None: gone, read by nothing)
        if any(funcs[v] is None for v in order):
            return
        top = max(f.rank for f in funcs if f is not None) + 1
        new = {v: top + len(order) - k for k, v in enumerate(order)}
        for v, f in enumerate(funcs):
            if f is None:
                continue
            rank = new.get(v)
            if rank is None:
                rank = max((x.rank for x in f.inputs or ()), default=f.rank)
            f.rank = rank
            for ref in f.outputs or ():
                y = ref()
                if y is not None:
                    y._rank = rank + 1
        self.stats.reordered = True

    def release_as_planned(self, program: Program) -> None:
        """This recorded iteration's backward has run every function and
        ``program`` was planned from it: release what a planned iteration
        no longer holds after its backward (as :meth:`after_backward` does
        in the program's ``release_mode``: what the plan drops, and in mode
        ``none`` its checkpoints too) and can be regenerated, so that a
        graph the model keeps into the next step (a loss link's
        ``self.loss``) holds no more than a planned one. A later backward
        pass through it regenerates as usual."""
        if (self.program is not None or self.no_release or self.multi_backward
                or program.n != len(self.recorder.calls)
                or program.release_mode == "all"):
            return
        self.program = program
        self.candidates = [program]
        self.recorder.recording = False
        self._needs, self._done = program.needs, program.done
        for u in sorted(program.releasable if program.release_mode == "none"
                        else program.dropped):
            if u in program.releasable and self._regenerable(u):
                self._release(u)

    def _actual_readers(self) -> None:
        """Backward readers from the recorded wiring (after a mismatch the
        plan's are wrong beyond the mismatch)."""
        p = self.program
        releasable = frozenset(u for u in p.releasable if u < (self.mismatch_at or 0))
        self._needs, self._done = {}, {}  # new dicts: the plan's own must stay as they are
        for c in self.recorder.calls:
            need = set()
            derived = p.derived.get(c.index, ()) if c.index < p.n else ()
            if c.keep_out or derived:
                need.add(c.index)
            for j in c.keep_in:
                if c.in_ids is not None and j < len(c.in_ids):
                    prod = self.recorder.arrays[c.in_ids[j]].producer
                    if prod is not None:
                        need.add(prod)
            need &= releasable
            self._needs[c.index] = tuple(sorted(need))
            self._done[c.index] = tuple(sorted(need | ({c.index} & releasable)))

    # ---------------------------------------------------------- release
    def _release(self, u: int) -> None:
        if u in self.released or u >= len(self.recorder.calls):
            return
        call = self.recorder.calls[u]
        f = call.func()
        if f is None or f.outputs is None:
            return
        p, kept = self.program, self.kept
        if kept:
            for a in p.graph.nodes[u].outputs:
                kept.pop(a, None)
        returned = self.recorder.returned
        outs = []
        # Arrays the forward returned keep their node's data: functions
        # outside the link (their consumers) may read it again in another
        # backward pass that never reaches this link's functions (pix2pix's
        # updater unchains the encoder's outputs and backpropagates through
        # the decoder again), and the caller's Variable holds them anyway.
        out_ids = call.out_ids or ()
        read = False  # an output node is alive (something reads it)
        for k, ref in enumerate(f.outputs):
            vnode = ref()
            if vnode is None:
                continue
            read = True
            if (vnode._data is not None
                    and not (returned and k < len(out_ids) and out_ids[k] in returned)):
                vnode._data = None  # keep shape and dtype (docs/chainer_internals.md §2)
                outs.append(k)
        had_retained = f._retained_output_data is not None and bool(f._output_indexes_to_retain)
        if had_retained:
            f._retained_output_data = None
        if p.derived.get(u):
            for name in self._remade(u):
                setattr(owner_of(f, name), name, None)
        if read and not self.recorder.forward_done:
            self._held_funcs[u] = (f, f.outputs)  # (see _restore_unchained)
        key = (tuple(outs), had_retained)
        self.released[u] = _RELEASED.setdefault(key, key)  # (a few distinct ones: shared)
        self.stats.n_released = len(self.released)

    def let_go(self) -> None:
        """This iteration's backward has run and the model is called again
        (``Recompute.free_previous_graph``): release every array its graph
        still holds (the functions' outputs but those the forward returned,
        their retained outputs, the arrays in their attributes, the arrays
        pinned and the random states kept for regeneration, and the
        retained inputs of the functions' own nodes of raw arrays: the
        caller's previous batch), so that a
        training loop that keeps its ``loss`` holds none of them through
        the next forward. A backward pass through this graph afterwards
        raises."""
        from .capture import attribute_arrays
        self.let_go_done = True
        self.kept.clear()
        self.snapshots.clear()
        self._rng_states.clear()
        for call in self.recorder.calls:
            call.rng_state = None
            f = call.func()
            if f is None:
                continue
            out_ids = call.out_ids or ()
            for k, ref in enumerate(f.outputs or ()):
                vnode = ref()
                if vnode is not None and not (k < len(out_ids)
                                              and out_ids[k] in self.recorder.returned):
                    vnode._data = None
            f._retained_output_data = None
            for xnode in f.inputs or ():
                # a node Chainer made for a raw array (the caller's input, a
                # constant): this function's own; not a Parameter's, nor a
                # Variable the caller passed (another graph may read it)
                if (xnode._data is not None and xnode.creator_node is None
                        and not xnode.requires_grad and xnode not in self.recorder.arg_nodes
                        and xnode.get_variable_or_none() is None):
                    xnode._data = None
            for owner, name, _ in attribute_arrays(f):
                if owner is f:  # (an old-style Function may be called again: left as it is)
                    setattr(f, name, None)

    # ---------------------------------------------------------- backward
    def before_backward(self, i: int, function: Any) -> None:
        if self.let_go_done:
            raise UnsafeRecomputeError(
                f"backward through {type(function).__name__} of an earlier call of the model, "
                f"whose graph released its arrays when the model was called again for "
                f"training: run each iteration's backward before the model's next call (as "
                f"training loops do), or apply(..., free_previous_graph=False) to keep earlier "
                f"graphs as plain Chainer does (a graph the loop keeps is then not under the "
                f"budget)")
        if self._update_state["updated"]:
            self._update_state["again"] = True
            if self.program is not None and (self.snapshots or self._own_updated):
                # (or would have been, but for the probation mode's keeping)
                self.program.probation.backward_after_update = True
        if (self.on_backward_start is not None and self.recorder.forward_done
                and (self._reach is None or i not in self._reach)
                and self.on_backward_start(self)):
            self.on_backward_start = None
        if i in self._bw_seen:
            # Another backward pass through this graph (a GAN's generator
            # graph, or loss.backward() twice): count its readers afresh,
            # so that its regenerations are block-wise again.
            self.multi_backward = True
            after_update = self._updates_at_forward is not None and \
                _updates_of(self.recorder.param_refs) != self._updates_at_forward
            for prog in (self.program, self.planned):
                if prog is not None:
                    prog.multi_backward = True
                    if after_update:
                        # (learned whether or not values were saved for it: a
                        # recorded iteration's pass after the update, as
                        # ``y`` backpropagated again after ``opt.update()``)
                        prog.probation.backward_after_update = True
            self._bw_seen = set()
            self._reach = None
            self.remaining = {}
            self._bw_left = None
        if self._reach is None or i not in self._reach:
            self._extend_reach(function)
        if chainer.config.enable_backprop or not self.recorder.forward_done:
            # Double backprop reads the arrays in a second-order graph; a
            # backward inside the forward (chainer.grad) will be followed
            # by another: keep everything from now on.
            self.no_release = True
        self._bw_seen.add(i)
        if self.program is None:
            return
        missing = [u for u in self._needs.get(i, ()) if u in self.released]
        if missing:
            self._regenerate(i, missing)

    def after_backward(self, i: int, function: Any) -> None:
        if self._bw_left is not None:
            self._bw_left.discard(i)
            if not self._bw_left:
                self._bw_left = None
                self.backward_done = True
                self.recorder.end_session()  # (before planning, which on_backward_done may run)
                if self.on_backward_done is not None:
                    self.on_backward_done(self)
        p = self.program
        done = self._done.get(i) if p is not None else None
        if not done:
            return
        remaining = self.remaining
        mode = self.release_mode or p.release_mode
        # what may be released once no backward reads it any more
        may = (None if self.no_release or mode == "all" else
               p.releasable if mode == "none" else p.dropped)
        limit = self.mismatch_at  # (None: every node of ``done`` is the plan's)
        for u in done:
            left = remaining.get(u)
            if left is not None:
                left -= 1
                remaining[u] = left
                if left > 0:
                    continue
            if may is not None and u in may and (limit is None or u < limit) and \
                    self._regenerable(u):
                self._release(u)

    def _choose_probation_mode(self, p: Program) -> None:
        """The backward of an iteration whose update is on probation
        starts: the release mode of ``p.probation_modes`` (or the plan's)
        whose step holds least at the update. Each of the model's calls
        whose backward is to come (a siamese model's two, a rollout's eight)
        keeps what the mode keeps, where the parameter values saved are one
        copy for all: counted where they all run ``p``, which makes them all
        choose alike; calls on other plans (one made again for more calls
        per step) choose nothing, and save as their plans do."""
        live = [h for h in _LIVE if not h.backward_done and (
            h.program is p or _same_link(h.recorder, self.recorder))]
        if any(h.program is not p for h in live):
            return
        k = max(1, len(live))
        held, mode = p.probation_saved, None
        for m, keep, saved in p.probation_modes:
            if k * keep + saved < held:
                held, mode = k * keep + saved, m
        if mode is not None:
            self.release_mode = self.stats.release_mode = mode
            self.probation_extra = held

    def _regenerable(self, u: int) -> bool:
        """Whether ``u`` could be regenerated by a later backward pass once
        released: each input is a parameter, pinned, an input array that is
        still there (pinned now), an array still held, or made by a
        regenerable function. (Noise made inside the forward and not
        retained by anyone makes its consumers not regenerable.)"""
        regen_ok = self._regen_ok
        known = regen_ok.get(u)
        if known is not None:
            return known
        rec, kept, params = self.recorder, self.kept, self.params
        call = rec.calls[u]
        f = call.func()
        ok = f is not None and f.inputs is not None  # (unchained: let go of)
        regen_ok[u] = ok  # provisional, against cycles
        for a in call.inner_ids if ok else ():
            self._inner.add(a)
            self._watch_param(a, rec.param_refs.get(a))
        for j, a in enumerate(call.in_ids or ()) if ok else ():
            if a in kept:
                continue
            info = rec.arrays[a]
            if info.kind == "param":
                if a not in params:
                    self._watch_param(a, rec.param_refs.get(a))
                continue
            if info.producer is None:
                x = self._input_array(f, j, a, {})
                if x is None:
                    ok = False
                    break
                kept[a] = x
                if self.verify:
                    self.fingerprints[a] = fingerprint(x)
                continue
            if info.producer not in self.released and f.inputs[j]._data is not None:
                continue  # held (retained by some function); released later only if regenerable
            if info.producer >= len(rec.calls) or not self._regenerable(info.producer):
                ok = False
                break
        regen_ok[u] = ok
        return ok

    def _extend_reach(self, function: Any) -> None:
        """Recorded functions whose backward this backward pass will run:
        those reachable from ``function`` through their inputs' creators,
        with an input that requires a gradient. Counts their reads."""
        reach = self._reach if self._reach is not None else set()
        # a backward pass reaches functions it had not: the sources its
        # regenerations read are checked again
        self._checked = set()
        bw_left, remaining, done = self._bw_left, self.remaining, self._done
        # (its end is the backward's; not a pass inside the forward)
        first = bw_left is None and not self._bw_seen and self.recorder.forward_done
        index_of, calls = self.recorder.index_of, self.recorder.calls
        stack = [function]
        while stack:
            f = stack.pop()
            i = index_of.get(id(f))
            if i is None or i in reach:
                continue
            call = calls[i]
            if call.func() is not f:
                continue
            xs = f.inputs or ()
            # (its inputs' requirement, as mapped; a call not mapped yet: a
            # backward inside the forward)
            if not (call.has_backward if call.in_ids is not None
                    else any(x.requires_grad for x in xs)):
                continue
            reach.add(i)
            if first:
                bw_left = self._bw_left = set()
                first = False
                p = self.program
                if p is not None and p.probation_modes and p.on_probation:
                    self._choose_probation_mode(p)
            if bw_left is not None:
                bw_left.add(i)
            for u in done.get(i, ()):
                remaining[u] = remaining.get(u, 0) + 1
            for x in xs:
                c = x.creator_node
                if c is not None:
                    stack.append(c)
        self._reach = reach

    def before_param_update(self, param: Any, copy: Callable[[], Any]) -> None:
        """An optimizer is about to update ``param`` in place: keep its
        values (``copy()``: the copy shared by the live iterations that keep
        them) if a released block was computed from it, for a backward pass
        that may still come (Chainer's DCGAN updater backpropagates the
        discriminator's graph again after updating it). Plans known to be
        backpropagated twice that regenerate in between always do; others
        until ``PROBATION`` updates were followed by no second pass (then a
        second pass after an update is caught by the checksums)."""
        p = self.program
        if p is None or not p.saves_parameters:
            return
        if not self.released:
            # A probation mode that released nothing: an update of one of
            # this model's parameters is counted all the same (it ends the
            # probation, and a pass after it is one that values would have
            # been saved for); another model's update (a critic's, between
            # two passes through a generator's graph) is not.
            if self.probation_extra is None or not (self._own_updated or any(
                    r() is param for r in self.recorder.param_refs.values())):
                return
            self._own_updated = True
        if not self._update_state["updated"]:
            self._update_state["updated"] = True
            weakref.finalize(self, _after_update, weakref.ref(p), self._update_state)
        if not self.released:
            return
        if p.returns_loss and not p.multi_backward and \
                not any(h.program is p or _same_link(h.recorder, self.recorder)
                        for h in _LIVE if h is not self):
            # On probation, a model that returns its loss (a Classifier, a
            # model keeping ``self.loss``) called once before this update:
            # its graph, which the model keeps into the next call, is
            # reached after the update only by that loss's backward run a
            # second time, which the update count catches. Saving its
            # parameters would add their size to the next step's peak, in
            # no plan (a discriminator called twice, on real and fake
            # batches, still saves them, whether its calls ran on one plan
            # or on two: one made again for two calls per step).
            return
        reads = None
        for a, p in self.params.items():
            if p is param and a not in self.snapshots and a not in self._inner:
                if reads is None:
                    reads = self._released_reads()
                if a in reads:
                    self.snapshots[a] = copy()

    def _released_reads(self) -> Set[int]:
        """The array ids that a later backward pass may regenerate from:
        those the nodes released now read (their inputs and inner
        parameters), an update saving only those parameters' values; none
        where the arrays regenerated stay (the ``all`` mode a probation
        iteration may take, double backprop) and no function whose backward
        has not run reads a released node, since a pass through the
        functions that ran finds what they read kept (a node released in the
        forward that no backward reads, a Linear's output that ReLU does not
        retain, stays released and reads its weights). Made again only where
        the released nodes or the functions run changed."""
        released = self.released
        key = (len(released), self.stats.recomputed_nodes, len(self._bw_seen))
        if self._reads is None or self._reads[0] != key:
            mode = self.release_mode or self.program.release_mode
            if (mode == "all" or self.no_release) and not any(
                    u in released for i, us in self._needs.items() if i not in self._bw_seen
                    for u in us):
                reads: Set[int] = set()
            else:
                calls = self.recorder.calls
                reads = {a for u in released for a in (calls[u].in_ids or ()) + calls[u].inner_ids}
            self._reads = (key, reads)
        return self._reads[1]

    def _input_array(self, f: Any, j: int, a: int, values: Dict[int, Any]) -> Any:
        if a in values:
            return values[a]
        if a in self.kept:
            return self.kept[a]
        if a in self.snapshots:
            return self.snapshots[a]
        if f.inputs is None:  # (unchained: see _restore_unchained)
            param = self.params.get(a)
            return param.array if param is not None else None
        xnode = f.inputs[j]
        if xnode._data is not None:
            return xnode._data
        var = xnode.get_variable_or_none()
        if var is not None and var.raw_array is not None:
            return var.raw_array
        return None

    def _regenerate(self, i: int, targets: List[int]) -> None:
        """Recompute the released nodes of the targets' block(s) that a
        remaining backward reads, for the backward of node ``i``, and put
        their arrays back."""
        calls, arrays = self.recorder.calls, self.recorder.arrays
        p, kept = self.program, self.kept
        released, remaining = self.released, self.remaining
        block = p.block_of[i] if i < p.n else None
        blocks = {p.block_of[u] for u in targets if u < p.n}
        wanted = set(targets)
        for b in blocks:
            for u in p.block_nodes.get(b, ()):
                if u in released and remaining.get(u, 0) > 0:
                    wanted.add(u)
        values: Dict[int, Any] = {}
        order: Set[int] = set()
        stack = sorted(wanted)
        while stack:
            u = stack.pop()
            if u in order:
                continue
            f = calls[u].func()
            if f is None or (f.inputs is None and u not in self._held_funcs):
                link = calls[u].link or "the model"
                raise RecomputeError(
                    f"cannot regenerate node {u} ({calls[u].op}, applied by {link}): Chainer "
                    f"let go of its function before this backward (the model unchained it, "
                    f"with unchain_backward() or unchain() in its forward, where the recorded "
                    f"calls did not), so the arrays the plan dropped from it are lost. "
                    f"apply(..., keep=[{link!r}]) keeps that link's outputs")
            order.add(u)
            for j, a in enumerate(calls[u].in_ids or ()):
                if a not in kept and self._input_array(f, j, a, values) is None:
                    prod = arrays[a].producer
                    if prod is None or prod not in p.releasable:
                        raise RecomputeError(
                            f"cannot regenerate node {u} ({calls[u].op}): its input array "
                            f"{a} is not available and is not recomputable")
                    stack.append(prod)
        steps = sorted(order)
        # a nested plan's regeneration lets each value go after its last reader
        # (the same for the same steps while the plan is followed: the calls'
        # arrays are its nodes')
        last: Dict[int, Any] = {}
        if p.inner:
            followed = self.mismatch_at is None
            last = p.frees.get(tuple(steps)) if followed else None
            if last is None:
                last = regeneration_frees(steps, lambda u: calls[u].in_ids or (),
                                          lambda u: calls[u].out_ids or ())
                if followed:
                    p.frees[tuple(steps)] = last
        params = self.params
        # (the checks below look only at the parameters updated since the
        # forward read them and at the arrays fingerprinted and not checked
        # yet in this backward pass: a node that reads none of them has
        # nothing to check)
        updated = self._updated_since_forward()
        printed, checked = (self.fingerprints, self._checked) if self.verify else ({}, set())
        stats = self.stats
        # (each forward runs as it does in Chainer's own recomputation: F.forget)
        with chainer.using_config("in_recomputing", True), \
                chainer.using_config("enable_backprop", False):
            for u in steps:
                call = calls[u]
                f = call.func()
                in_ids = call.in_ids or ()
                out_ids = call.out_ids or ()
                in_data = tuple([values[a] if a in values else kept[a] if a in kept
                                 else self._input_array(f, j, a, values)
                                 for j, a in enumerate(in_ids)])
                inner = call.inner_ids
                ids = in_ids + inner if inner else in_ids
                if updated and not updated.isdisjoint(ids):
                    self._updated_before(u, next(a for a in ids if a in updated))
                if printed and any([a in printed and a not in checked for a in ids]):
                    self._check_sources(u, ids, in_data + tuple(
                        [params[a].array if a in params else None for a in inner]))
                outs = self._run_forward(f, u, in_data)
                stats.recomputed_nodes += 1
                for a, y in zip(out_ids, outs):
                    values[a] = y
                if (u in released and u not in wanted and remaining.get(u, 0) > 0
                        and (not p.inner or u not in p.dropped
                             or (block is not None and p.keeps(u, block)))):
                    # a checkpoint released after an earlier backward pass, or a
                    # nested plan's inner checkpoint of an open segment (kept
                    # until its last reader)
                    wanted.add(u)
                if u in wanted and u in released:
                    for a, y in zip(out_ids, outs):
                        if a in p.source_arrays:
                            self.kept[a] = y  # later blocks start from it again
                    out_idx, had_retained = released.pop(u)
                    stats.n_released = len(released)
                    outputs = f.outputs if f.outputs is not None else self._held_funcs[u][1]
                    for k in out_idx:
                        vnode = outputs[k]()
                        if vnode is not None:
                            # a live Variable (one the forward returned) holds
                            # the same values already: no second copy
                            var = vnode.get_variable_or_none()
                            held = None if var is None else var.raw_array
                            same = (held is not None and held.shape == outs[k].shape
                                    and held.dtype == outs[k].dtype)
                            vnode._data = held if same else outs[k]
                    if had_retained:
                        f._retained_output_data = tuple(outs[k]
                                                        for k in f._output_indexes_to_retain)
                    self.regenerated.add(u)
                else:
                    for name in self._remade(u):  # transient: drop what forward made
                        setattr(owner_of(f, name), name, None)
                for a in last.get(u, ()):
                    del values[a]
                in_data = outs = None
        if self.no_release and self.recorder.forward_done:
            self._unpin_spent()

    def _unpin_spent(self) -> None:
        """Under ``no_release`` (double backprop) nothing is released
        again once the forward is done, so a source pinned for regeneration
        (an array plain Chainer frees: a ``Linear``'s output that ``tanh``
        reads) is of no further use once no released node starts from it:
        unpinned, the graph holds what plain Chainer's holds."""
        p = self.program
        needed = {p.graph.nodes[u].inputs[j] for u in self.released if u < p.n
                  for j in p.sources.get(u, ())}
        for a in [a for a in self.kept if a in p.source_arrays and a not in needed]:
            del self.kept[a]

    def _updated_since_forward(self) -> Set[int]:
        """The watched parameters that an optimizer updated since the
        forward read them, whose values a regeneration cannot take from a
        saved copy (none saved, or read live by inner functions): a node
        that reads one raises (:meth:`_updated_before`)."""
        stale = set()
        for a, t in self._param_t.items():
            if a in self.snapshots and a not in self._inner:
                continue
            param = self.params.get(a)
            if param is not None and _update_count(param) != t:
                stale.add(a)
        return stale

    def _updated_before(self, u: int, a: int) -> None:
        """Parameter ``a``, which node ``u`` reads, was updated by an
        optimizer since the forward read it, and its values were not saved
        (or are of no use: a parameter its inner functions read, as
        ``F.forget``'s function does, is read live): recomputing would give
        other arrays than the forward's (checked with or without
        ``verify``; see :meth:`_updated_since_forward`)."""
        calls, arrays = self.recorder.calls, self.recorder.arrays
        if self.program is not None:
            self.program.multi_backward = True  # the next iterations save it
        name = arrays[a].name or a
        raise UnsafeRecomputeError(
            f"parameter {name} was updated by an optimizer after the forward pass and "
            f"before the backward that recomputes node {u} ({calls[u].op}) (the graph "
            f"is backpropagated again after an update); its values were not saved, so "
            f"recomputing would give a result different from plain Chainer's. From the "
            f"next iteration on, the parameters are saved before such an update; to "
            f"avoid this error, run one iteration of this pattern before apply(), or do "
            f"not update between two backward passes through the same graph")

    def _check_sources(self, u: int, in_ids: Tuple[int, ...], in_data: Tuple[Any, ...]) -> None:
        calls, arrays = self.recorder.calls, self.recorder.arrays
        for a, x in zip(in_ids, in_data):
            expected = self.fingerprints.get(a)
            if expected is None or x is None or a in self._checked:
                continue
            if fingerprint(x) == expected:
                self._checked.add(a)
            else:
                info = arrays[a]
                what = (f"parameter {info.name or a}" if info.kind == "param"
                        else f"input array {info.name or a}")
                if self.program is not None:
                    self.program.multi_backward = True  # the next iterations keep a copy
                raise UnsafeRecomputeError(
                    f"{what} was modified in place between the forward pass and the backward "
                    f"that recomputes node {u} ({calls[u].op}); recomputing it would give "
                    f"a result different from plain Chainer's. If an optimizer updated it "
                    f"between two backward passes through the same graph, the next iterations "
                    f"keep a copy for that; otherwise a recorded first call sees such a write "
                    f"and keeps the functions that read the array (apply(..., "
                    f"capture_batch=None): the default's captures run the model alone), or "
                    f"do not write to the array between the forward and its backward")

    def _remade(self, u: int) -> Tuple[str, ...]:
        """The attributes of node ``u`` released with it and made again by
        its forward: the derived ones, and the drawn ones when its random
        state was kept at its forward (otherwise they stay: nothing could
        draw them again)."""
        p = self.program
        names = p.derived.get(u, ())
        drawn = p.drawn.get(u, ())
        if drawn and self._rng_state(u) is None:
            return tuple(n for n in names if n not in drawn)
        return names

    def _rng_state(self, u: int) -> Any:
        """NumPy's random state before node ``u``'s forward: kept when the
        plan dropped it, or when this iteration recorded it drawing."""
        state = self._rng_states.get(u)
        if state is None and u < len(self.recorder.calls):
            state = self.recorder.calls[u].rng_state
        return state

    def _run_forward(self, f: Any, u: int, in_data: Tuple[Any, ...]) -> Tuple[Any, ...]:
        # the drawn attributes from the forward's random state, the current
        # one put back after
        state = self._rng_state(u) if u in self.program.drawn else None
        current = numpy.random.get_state() if state is not None else None
        detached = []
        for name in self.program.written.get(u, ()):
            owner = owner_of(f, name)
            original = getattr(owner, name, None)
            if original is not None:
                setattr(owner, name, original.copy())  # e.g. BatchNorm running stats
                detached.append((owner, name, original))
        keep_in, keep_out = f._input_indexes_to_retain, f._output_indexes_to_retain
        try:
            if state is not None:
                numpy.random.set_state(state)
            # (under _regenerate's configuration; in the device context of
            # its arrays, as FunctionNode.apply runs it: NumPy's does nothing)
            if all([type(x) is numpy.ndarray for x in in_data]):
                outs = tuple(type(f).forward(f, in_data))
            else:
                with chainer.using_device(backend.get_device_from_array(*in_data)):
                    outs = tuple(type(f).forward(f, in_data))
        finally:
            if current is not None:
                numpy.random.set_state(current)
            for owner, name, original in detached:
                setattr(owner, name, original)
            f._input_indexes_to_retain, f._output_indexes_to_retain = keep_in, keep_out
        return outs


def _alive(candidates: List[Program], matches: Callable[..., bool], *args: Any) -> List[Program]:
    """The candidate plans that ``matches(plan, *args)`` (the list itself
    when it has one plan and that one matches: the usual case, and a
    check of every function of every step)."""
    if len(candidates) == 1:
        return candidates if matches(candidates[0], *args) else []
    return [p for p in candidates if matches(p, *args)]


def _updates_of(param_refs: Dict[int, Any]) -> int:
    """The optimizer updates of the parameters of ``param_refs`` (weak
    references), summed: it changes with any update of one of them."""
    return sum(_update_count(p) for p in (r() for r in param_refs.values()) if p is not None)


def _same_link(a: Recorder, b: Recorder) -> bool:
    """Whether two recordings ran the same Link."""
    return (a._link_ref is not None and b._link_ref is not None
            and a._link_ref() is b._link_ref())
