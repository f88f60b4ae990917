"""The recorder: Chainer's define-by-run graph of a real iteration, recorded
into a :class:`~chainer_recompute.core.graph.Graph`.

:class:`Recorder` is a ``chainer.FunctionHook``. While the model's forward
runs, every top-level function application is recorded in execution order
with metadata only (it holds no array, so the recorded iteration uses the
memory of a plain one): its inputs and outputs (which recorded array each
input is, by its ``VariableNode``; which call argument or parameter it is
otherwise), their shapes and bytes, which outputs are *views* of an input
(``reshape``, ``transpose``, ``split_axis``: they cost no bytes), what
Chainer retains for its backward, the arrays it keeps in its own attributes
(found by inspection, not from a list of functions), when the caller's last
reference to each output went away, and, when measuring, its forward time
and the transient memory of the call (im2col buffers) from the allocator.
It then registers itself as a local hook of every recorded function and
records the backward order, times and transient memory of the backward that
follows. With ``analyse=True`` it also finds what is safe to recompute
(:mod:`~chainer_recompute.runtime.capture.safety`).

Functions applied with backprop disabled inside the forward (a frozen
teacher's) and functions nested in a recorded one (``F.forget``'s) are not
recorded; their memory and the parameters the nested ones read are
(:mod:`~chainer_recompute.runtime.capture.unrecorded`).
"""
from __future__ import annotations

import gc
import logging
import time
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy

from .. import _chainer  # noqa: F401  (NumPy 2 compatibility before chainer)
from .._chainer import param_grad
import chainer

from ...core.errors import CaptureError, RecomputeError
from ...core.graph import ArrayInfo, Graph, HeldArray, Node, StepFacts
from ..device import Device, RandomStates, device_of, dtype_name
from .arrays import (_arrays_in, _variables_in, attribute_arrays, buffer_print, content_print,
                     fingerprint, function_op, gone_watch, is_array, node_nbytes,
                     persistent_array_ids, persistent_arrays, result_variables, root_of)
from .links import LinkPaths
from .safety import _WRITES_INPUTS, _config_key, analyse_function, static_graph_reason
from .unrecorded import Aside, Made, ParameterIndex, UnrecordedWork

logger = logging.getLogger(__name__)

#: ``Call.in_args`` of calls that read no argument of the caller, shared
_NO_NAMES = {(None,) * k: (None,) * k for k in range(1, 9)}


class _Before(NamedTuple):
    """A recorded call's state before its forward ran."""
    attrs: Dict[Tuple[int, str], Any]  # fingerprints of the arrays it held
    inputs: List[Any]  # buffer prints of its inputs (None: not checked)
    rng: Any  # NumPy's global random state
    meter: Any  # its memory meter, or None


class Call:
    """What the recorder knows of one top-level function application.

    The class attributes are the defaults: a call sets only what it has of
    its own (one is made for every function of every step)."""

    label = ""
    out_meta: Tuple[Tuple[Any, ...], ...] = ()  # (shape, dtype, nbytes, buffer bytes)
    out_view: Tuple[Optional[int], ...] = ()  # input index each output views
    as_planned = False  # out_meta and out_view are its planned node's
    keep_in: Tuple[int, ...] = ()
    keep_out: Tuple[int, ...] = ()
    held: Tuple[HeldArray, ...] = ()
    in_ids: Optional[Tuple[int, ...]] = None
    out_ids: Optional[Tuple[int, ...]] = None
    has_backward = True
    measured = False
    time_s: Optional[float] = None
    fwd_transient: Optional[int] = None
    recomputable = True
    reason = ""
    bwd_time_s: Optional[float] = None
    bwd_transient: Optional[int] = None
    bwd_alloc: Optional[int] = None
    # parameters nested functions read, by id (None: none, or not looked for)
    inner: Optional[Dict[int, Any]] = None
    inner_ids: Tuple[int, ...] = ()  # ... as array ids
    in_made: Tuple[Optional[Made], ...] = ()  # inputs unrecorded functions made
    unrecorded_peak: Optional[int] = None  # the unrecorded work's right before
    _out: Optional[Tuple[Any, ...]] = None  # the outputs, until mapped
    _func_strong: Any = None  # the function node, until mapped
    _before: Optional[_Before] = None  # the state before its forward ran
    #: NumPy's random state before a recorded forward that drew attributes
    #: (role ``drawn``): a plan made later can release them and draw them
    #: again from it
    rng_state: Any = None
    #: a recording's prints of the inputs before the forward (until they are
    #: compared with their producers') and of the outputs after it
    in_prints: Optional[List[Any]] = None
    out_prints: Optional[Tuple[Any, ...]] = None
    _in_data: Optional[Tuple[Any, ...]] = None  # a recording's inputs, until mapped
    #: the forward unchained its function (``unchain_backward()`` inside the
    #: model) before its inputs and outputs were mapped: Chainer had let go
    #: of them (see Recorder._unchained_inputs)
    unchained = False

    def __init__(self, index: int, func: Any, in_data: Tuple[Any, ...],
                 in_args: Tuple[Optional[str], ...], link: str = "") -> None:
        self.index = index
        self.link = link  # the path of the Link that applied it (Node.link)
        self.func = weakref.ref(func)
        self.op = function_op(func)
        self.in_shapes = tuple([tuple(x.shape) for x in in_data])
        self.in_args = in_args


class _ArrayRecord:
    __slots__ = ("shape", "dtype", "nbytes", "kind", "producer", "name", "view_of", "dies_at",
                 "buffer_bytes", "made_at")

    def __init__(self, shape: Tuple[int, ...], dtype: str, nbytes: int, kind: str,
                 producer: Optional[int], name: str = "", view_of: Optional[int] = None) -> None:
        self.shape, self.dtype, self.nbytes, self.kind = shape, dtype, nbytes, kind
        self.producer, self.name, self.view_of = producer, name, view_of
        self.dies_at: Optional[int] = None
        self.buffer_bytes: Optional[int] = None
        self.made_at: Optional[int] = None


class NodeIds:
    """Array ids by ``VariableNode``, the nodes held weakly.

    A node's key is a plain weak reference to it: the one its creator's
    ``outputs`` already holds (``weakref.ref`` gives it back), so mapping a
    function's outputs makes no object. A node that dies leaves its key
    behind, which no other node matches (a dead reference equals only
    itself); the recorder that keeps this lives one iteration.
    """

    __slots__ = ("ids",)

    def __init__(self) -> None:
        self.ids: Dict[Any, int] = {}

    def get(self, node: Any, default: Optional[int] = None) -> Optional[int]:
        return self.ids.get(weakref.ref(node), default)

    def __getitem__(self, node: Any) -> int:
        return self.ids[weakref.ref(node)]

    def __setitem__(self, node: Any, aid: int) -> None:
        self.ids[weakref.ref(node)] = aid

    def __contains__(self, node: Any) -> bool:
        return weakref.ref(node) in self.ids


class Recorder(chainer.FunctionHook):
    """Records the top-level function applications of a forward pass, and
    the backward that follows (see the module docstring).

    Args:
        measure: time each forward and backward call and measure its
            transient memory with the allocator.
        analyse: find what is safe to recompute (see the module docstring).
        link: the Link being run (names parameters by their paths).
        args: the call's arguments, so that inputs can be told apart.
        driver: the object told of each call (``before_forward``,
            ``after_mapping``, ``before_backward``, ``after_backward``):
            the executor's :class:`~chainer_recompute.runtime.executor.IterationHook`,
            which is then what Chainer calls, forwarding to this recorder.
            Held weakly; None: this recorder's own (no-op) methods.

    Use it as a ``with`` block around the forward; call :meth:`finish`
    when the forward has returned; :meth:`graph` builds the Graph (after
    the backward, to include it).

    >>> import chainer, numpy as np, chainer.functions as F
    >>> rec = Recorder()
    >>> with rec:
    ...     y = F.sum(F.relu(chainer.Variable(np.ones((2, 3), np.float32))))
    >>> rec.finish(); [n.op for n in rec.graph().nodes]
    ['ReLU', 'Sum']
    """

    name = "chainer_recompute.Recorder"

    def __init__(self, *, measure: bool = True, analyse: bool = True,
                 link: Optional[chainer.Link] = None, args: Sequence[Any] = (),
                 driver: Any = None) -> None:
        # A unique name: several recorders (nested models, a GAN's two
        # models) may hook the same function.
        self.name = f"chainer_recompute-{id(self):x}"
        # What the calls are reported to (before_forward, after_mapping,
        # before_backward, after_backward): the executor's hook, which
        # Chainer calls and which forwards to this recorder; held weakly
        # (it holds this recorder), and hooked on each function in its stead
        self._driver = weakref.ref(driver) if driver is not None else None
        self.measure, self.analyse = measure, analyse
        self.recording = True
        #: the records of a followed plan's outputs, by array id (the
        #: driver's, while it follows one; see _map_pending)
        self.shared_records: Optional[Dict[int, _ArrayRecord]] = None
        self.on_cupy = False  # a recorded call ran on CuPy: the graph's allocator is its pool
        self.calls: List[Call] = []
        self.arrays: List[_ArrayRecord] = []
        self.array_of = NodeIds()
        self.param_refs: Dict[int, "weakref.ref[Any]"] = {}
        self.index_of: Dict[int, int] = {}  # id(function) -> call index
        self.backward_order: List[int] = []
        self.backward_during_forward = False
        # a recorded function read an array with a gradient that a function
        # outside the graph made (the backward goes on outside it)
        self.outside_grad_input = False
        self.forward_done = False
        self.returned: List[int] = []  # array ids the forward returned
        self._depth = 0
        self._top: List[Optional[Call]] = []
        self._pending: Optional[Call] = None
        self._watch: List[Any] = []  # weakrefs to output Variables (their lifetime)
        self._bwd: Dict[int, Tuple[float, Any, Device]] = {}
        self._param_names: Dict[int, str] = {}
        self._external_ids: set = set()
        persistents = persistent_arrays(link) if link is not None else []
        # the parameters' arrays: inputs no function made (not compared with
        # a producer's output, see _note_written_between); made at the first
        # recorded call (a followed iteration needs none)
        self._param_arrays: Optional[set] = None
        # (call index, the array or a weak reference to it, print) of the
        # inputs recorded calls read that no function made and no parameter
        # is (the caller's, the model's persistent arrays), until the
        # backward (_note_sources_written)
        self._sources: List[Tuple[int, Any, Any]] = []
        if link is not None:
            self._param_names = {id(p): path for path, p in link.namedparams()}
            self._external_ids = persistent_array_ids(link, persistents)
        self._link_ref = weakref.ref(link) if link is not None else None
        self._links = LinkPaths(link)  # which Link applies each call (while registered)
        # The recorded backward's tracing session (see _begin_session).
        self._session: Any = None
        self._session_end: Any = None
        # The caller's work between the forward's return and the backward
        # (see watch_outside): the meter while it runs, then (peak, held).
        self._outside_watch: Any = None
        self.outside: Optional[Tuple[int, int]] = None
        # Work inside the forward that is not recorded, and the parameters
        # that nested functions read (see .unrecorded).
        self._unrecorded = UnrecordedWork()
        self._params = ParameterIndex(self._link_ref)
        # A new call: the backward of an earlier recording is over.
        end_backward_sessions()
        self._arg_names: Dict[int, str] = {}
        self._arg_ids: Dict[str, int] = {}  # argument path -> its array id
        # id(array) -> (array id, weak reference to the array): a recording's
        # outputs, and the outputs of calls unchained before they were
        # mapped (their nodes are gone from their function: see
        # _unchained_inputs)
        self._made_arrays: Dict[int, Tuple[int, Any]] = {}
        self._unchained_outs: Dict[int, Tuple[int, Any]] = {}
        # the nodes of the Variables the caller passed (other graphs may
        # share them; a raw array argument gets a node of each function's own)
        self.arg_nodes: "weakref.WeakSet[Any]" = weakref.WeakSet(
            v.node for v in _variables_in(list(args)))
        for k, a in enumerate(args):
            for path, arr in _arrays_in(a, str(k)):
                self._arg_names.setdefault(id(arr), path)
        # The model's persistent arrays that a function reads as an input
        # (a fixed mask multiplied into a weight) are named as arguments
        # are, by their path: one array wherever it is read, there before
        # the step and after it (``state_bytes``' persistents), not a
        # temporary of the step (``core.replay.model_state_input``).
        for path, arr in persistents:
            self._arg_names.setdefault(id(arr), path)

    # ------------------------------------------------------------ forward
    def forward_preprocess(self, function: Any, in_data: Tuple[Any, ...]) -> None:
        self._depth += 1
        if self._depth > 1 or self.forward_done:
            if self._depth > 1 and self._top and isinstance(self._top[0], Call):
                top = self._top[0]
                if top.inner is None:
                    top.inner = {}
                self._params.note(top.index, top.inner, in_data)
            self._top.append(None)
            return
        if not chainer.config.enable_backprop:
            self._top.append(self._aside(function, in_data))
            return
        self._map_pending()
        peak = self._unrecorded.end()
        names = tuple([self._arg_names.get(id(x)) for x in in_data])
        call = Call(len(self.calls), function, in_data, _NO_NAMES.get(names, names),
                    self._links.current)
        call.unrecorded_peak = 0 if peak is None and self.recording and self.measure else peak
        if self._unrecorded.any_made:
            call.in_made = tuple(self._unrecorded.made_of(x) for x in in_data)
        self.calls.append(call)
        self.index_of[id(function)] = call.index
        self._top.append(call)
        self._events().before_forward(call, function, in_data)
        self._wrap(call, function, in_data)

    def forward_postprocess(self, function: Any, in_data: Tuple[Any, ...]) -> None:
        self._depth -= 1
        call = self._top.pop()
        if call is None:
            return
        if isinstance(call, Aside):
            _unwrap(function)
            self._unrecorded.note(call.out, len(self.calls))
            return
        out = call._out or ()
        _unwrap(function)
        # The safety analysis runs the forward once more: the functions that
        # applies (F.forget's) are nested in this call, not unrecorded work.
        self._depth += 1
        try:
            roles = (self._stop_measure(call, function, in_data, out)
                     if call._before is not None else {})
        finally:
            self._depth -= 1
        call.keep_in = tuple(function._input_indexes_to_retain or ())
        call.keep_out = tuple(function._output_indexes_to_retain or ())
        if call.measured or not self._describe_as_planned(call, out):
            self._describe(call, function, in_data, out, roles)
        if call.in_prints is not None:
            call.out_prints = tuple([content_print(y) for y in out])
        # A local hook, to see its backward (FunctionNode.add_hook's work,
        # without its checks and its ``added`` call, which does nothing here:
        # this runs for every function of every step)
        events = self._events()
        function.local_function_hooks[events.name] = events
        # Held until its inputs and outputs are mapped at the next function:
        # a result thrown away at once would take its node with it.
        call._func_strong = function
        self._pending = call

    def added(self, function: Any = None) -> None:
        if function is None:  # registered globally (the with block): the Links too
            self._links.__enter__()

    def deleted(self, function: Any = None) -> None:
        """Removed as a global hook (the ``with`` block ended, maybe by an
        exception inside a function's forward): undo what a function that
        never reached its postprocess left behind."""
        if function is not None:
            return
        self._links.__exit__()
        for call in self._top:
            if not isinstance(call, Call):
                continue  # (an unrecorded function's wrapper goes with its node)
            f = call.func()
            if f is not None:
                _unwrap(f)
            if call._before is not None and call._before.meter is not None:
                call._before.meter.stop()
            call._before = None
        self._top.clear()
        self._depth = 0
        self._unrecorded.end_tail()

    def _events(self) -> Any:
        """The driver (see ``driver``), or this recorder (its own no-op
        callbacks) without one."""
        driver = self._driver() if self._driver is not None else None
        return self if driver is None else driver

    def before_forward(self, call: Call, function: Any, in_data: Tuple[Any, ...]) -> None:
        """Called before each recorded function runs (the executor's hook)."""

    def after_mapping(self, call: Call) -> None:
        """Called once ``call``'s inputs and outputs are known as array ids."""

    def finish(self, result: Any = None) -> None:
        """The forward has returned (``result``): map the last function."""
        self._map_pending()
        self._unrecorded.end_tail()
        self.forward_done = True
        if self.recording:
            self._note_unchained()
            self._note_retained_written()
            self._note_sources_written()
        self._watch.clear()
        self.returned = sorted({self.array_of[v.node] for v in result_variables(result)
                                if v.node in self.array_of})

    def _note_written_between(self, call: Call) -> None:
        """A recorded call's inputs as they were right before its forward,
        against their producers' outputs (:meth:`_written_since`); those no
        function made are kept to compare later (:meth:`_note_sources_written`)."""
        for x, aid, seen in zip(call._in_data, call.in_ids, call.in_prints):
            if seen is None:
                continue
            if self.arrays[aid].producer is None:
                try:  # (held weakly: the caller may let go of its batch)
                    x = weakref.ref(x)
                except TypeError:  # an array type without weak references
                    pass
                self._sources.append((call.index, x, seen))
            else:
                self._written_since(aid, lambda: seen, call.op)
        call.in_prints = call._in_data = None

    def _note_sources_written(self) -> None:
        """At the forward's end and at the backward's start (then no more):
        an input no function made (the caller's array, a model's persistent
        array: MoCo's queue of keys) written in place after a recorded call
        read it makes that call not recomputable: run again, it would read
        the new values."""
        for index, x, seen in self._sources:
            if isinstance(x, weakref.ref):
                x = x()
            if x is not None and content_print(x) != seen:
                self._not_recomputable(
                    index, "an input no function made (the caller's or a model's array) was "
                           "written in place after it read it: run again, it would read the "
                           "new values")

    def _note_retained_written(self) -> None:
        """At the forward's end, the arrays recorded functions keep for
        their backward against their producers' outputs
        (:meth:`_written_since`): one written after its last reader's
        forward is what that backward reads."""
        for call in self.calls:
            f = call.func() if call.keep_in or call.keep_out else None
            if f is None or f.inputs is None or call.in_ids is None or call.out_ids is None:
                continue
            kept = [(call.in_ids[j], f.inputs[j].data) for j in call.keep_in
                    if j < len(call.in_ids)]
            kept += [(call.out_ids[k], y) for k, y in
                     zip(call.keep_out, f._retained_output_data or ()) if k < len(call.out_ids)]
            for aid, x in kept:
                if x is not None:
                    self._written_since(aid, lambda x=x: content_print(x),
                                        f"the backward of {call.op}")

    def _written_since(self, aid: int, seen: Callable[[], Any], reader: str) -> None:
        """Array ``aid`` as ``reader`` read it (``seen()``, its print)
        against its producer's output right after that ran: written in place
        in between by the model's own code (a causal mask assigned into
        attention scores' ``.array``), its producer run again would not
        give it, so it is not recomputable."""
        producer = self.arrays[aid].producer
        made = self.calls[producer] if producer is not None else None
        if (made is None or made.out_prints is None or made.out_ids is None
                or aid not in made.out_ids):
            return
        if made.out_prints[made.out_ids.index(aid)] != seen():
            self._not_recomputable(
                producer, f"its output was written in place before {reader} read it (an "
                          f"assignment to a Variable's .array in the model): run again, it "
                          f"would not give what was read")

    def _note_unchained(self) -> None:
        """Functions the forward unchained (``unchain_backward()`` or
        ``unchain()`` inside the model: truncated backpropagation within
        one call) whose outputs something still reads: Chainer let go of
        them before the backward, so they cannot be run again."""
        for ref, aid in self.array_of.ids.items():
            node = ref()
            producer = self.arrays[aid].producer if node is not None else None
            if producer is not None and node.creator_node is None:
                self._not_recomputable(
                    producer, "unchained in the forward (unchain_backward() or unchain() "
                              "inside the model): Chainer lets go of it before the backward")

    def _not_recomputable(self, index: int, reason: str) -> None:
        call = self.calls[index]
        if call.recomputable:
            call.recomputable, call.reason = False, reason

    # ------------------------------------------------ unrecorded work
    def _aside(self, function: Any, in_data: Tuple[Any, ...]) -> Aside:
        """A top-level function applied with backprop disabled inside the
        forward: not recorded, but in a measured stretch of unrecorded work
        (:mod:`.unrecorded`)."""
        if not self._unrecorded.running:
            # The last recorded call's outputs are mapped now, so that a
            # reference dropped from here on counts as dropped during this
            # work (see _death_callback).
            self._map_pending()
            meter = device_of(in_data).meter() if self.recording and self.measure else None
            self._unrecorded.begin(len(self.calls), meter)
        return self._unrecorded.wrap(function)

    # ---------------------------------------------------- measuring a call
    def _wrap(self, call: Call, function: Any, in_data: Tuple[Any, ...]) -> None:
        """Wrap the function's forward (an instance attribute, removed at
        postprocess) to see its outputs and, when recording, to time it and
        measure its memory."""
        original = type(function).forward
        measure = self.recording and self.measure
        meter = None
        if self.recording:
            attrs_before = {(id(o), n): fingerprint(a) for o, n, a in attribute_arrays(function)}
            # Whether a function writes its inputs depends on its class and
            # configuration: checked the first time, then trusted. The
            # inputs' prints are kept to compare with their producers' (see
            # _note_written_between).
            key = _config_key(function)
            inputs_before = ([buffer_print(x) if is_array(x) else None for x in in_data]
                             if _WRITES_INPUTS.get(key, True) else [None] * len(in_data))
            params = self._param_arrays
            if params is None:
                link = self._link_ref() if self._link_ref is not None else None
                params = self._param_arrays = (
                    {id(p.array) for p in link.params() if p.array is not None}
                    if link is not None else set())
            call.in_prints = [content_print(x) if is_array(x) and id(x) not in params else None
                              for x in in_data]
            call._in_data = in_data
            dev = device_of(in_data)
            self.on_cupy = self.on_cupy or dev.is_gpu
            meter = dev.meter() if measure else None
            call._before = _Before(attrs_before, inputs_before, numpy.random.get_state(), meter)

        def wrapped(inputs: Tuple[Any, ...], _f: Any = function, _call: Call = call) -> Any:
            if measure:
                dev.synchronize()
                t0 = time.perf_counter()
            out = original(_f, inputs)
            if measure:
                dev.synchronize()
                _call.time_s = time.perf_counter() - t0
            _call._out = tuple(out)
            return out

        function.forward = wrapped
        if meter is not None:
            meter.start()

    def _stop_measure(self, call: Call, function: Any, in_data: Tuple[Any, ...],
                      out: Optional[Tuple[Any, ...]]) -> Dict[str, str]:
        """What the forward did (its memory, whether it wrote its inputs or
        attributes, drew random numbers, can be recomputed): the role of
        each attribute it holds."""
        attrs_before, inputs_before, rng_before, meter = call._before
        call._before = None
        if meter is not None:
            m = meter.stop()
            call.fwd_transient = max(0, m.peak_bytes - max(0, m.retained_bytes))
        call.measured = True
        io = {id(x) for x in tuple(in_data) + out if is_array(x)}
        written, held = [], []
        for owner, name, a in attribute_arrays(function):
            if id(a) in io:
                continue
            before = attrs_before.get((id(owner), name))
            if before is not None and before != fingerprint(a):
                written.append((owner, name))
            elif id(a) not in self._external_ids:
                held.append((owner, name, a))
        modified = any(b is not None and b != buffer_print(x)
                       for x, b in zip(in_data, inputs_before))
        key = _config_key(function)
        if any(b is not None for b in inputs_before):
            _WRITES_INPUTS[key] = modified
        drew = RandomStates.numpy_changed(rng_before)
        static = static_graph_reason(function)
        if modified or static:
            call.recomputable = False
            call.reason = static or "its forward modifies its inputs in place"
            roles = {n: "written" for _, n in written}
        elif self.analyse:
            res = analyse_function(function, tuple(in_data), out, held, drew, written,
                                   rng_before)
            call.recomputable, call.reason, roles = res.recomputable, res.reason, res.roles
            if "drawn" in roles.values():
                call.rng_state = rng_before
        else:
            roles = {n: "written" for _, n in written}
            if drew:
                call.recomputable = False
                call.reason = "its forward draws from the global random state"
        return roles

    def _describe_as_planned(self, call: Call, out: Tuple[Any, ...]) -> bool:
        """Describe an unmeasured call's outputs (one a plan runs) as its
        planned node's, where they have the node's shapes and dtypes (the
        plan's bytes and views then; its retention is its own, read from
        the function: what the wiring check compares): False where there is
        no such node."""
        planned = self._events().planned_outputs(call.index)
        if planned is None:
            return False
        meta, views = planned
        if len(meta) != len(out):
            return False
        for m, y in zip(meta, out):
            if m[0] != y.shape or m[1] != dtype_name(y.dtype):
                return False
        call.out_meta, call.out_view = meta, views
        call.as_planned = True
        return True

    def planned_outputs(self, i: int) -> Optional[Tuple[Tuple[Any, ...], Tuple[Any, ...]]]:
        """The planned description of call ``i``'s outputs (the executor's;
        a recorder of its own has no plan)."""
        return None

    def _describe(self, call: Call, function: Any, in_data: Tuple[Any, ...],
                  out: Tuple[Any, ...], roles: Dict[str, str]) -> None:
        """Held attributes (their ``roles``), views and bytes of the outputs,
        from the function after its forward (arrays are looked at, not
        kept; its retention is read before, in ``forward_postprocess``)."""
        # what each array takes from its allocator (CuPy's pool rounds up)
        nb_of = device_of(out or in_data).allocation_bytes
        # (a call a plan ran without measuring it has its planned node's:
        # Recorder.graph's ``fill``)
        if call.measured:
            io = {id(x) for x in tuple(in_data) + out if is_array(x)}
            held = []
            for owner, name, a in attribute_arrays(function):
                role = roles.get(name, "state")
                if id(a) in io or (id(a) in self._external_ids and role != "written"):
                    continue
                held.append(HeldArray(name, tuple(a.shape), dtype_name(a.dtype), nb_of(a.nbytes),
                                      role))
            call.held = tuple(held)
        roots = [root_of(x) if is_array(x) else None for x in in_data] if out else []
        views: List[Optional[int]] = []
        meta = []
        for y in out:
            r = root_of(y)
            view = None
            for j, rx in enumerate(roots):
                if rx is r:
                    view = j
                    break
            views.append(view)
            # a strided view of a larger private buffer (Deconvolution2D's
            # output): the buffer is what it costs
            buffer = None
            if view is None and r is not y:
                nb = getattr(r, "nbytes", None)
                if nb and nb > y.nbytes:
                    buffer = nb_of(nb)
            meta.append((tuple(y.shape), dtype_name(y.dtype), nb_of(y.nbytes), buffer))
        call.out_view = tuple(views)
        call.out_meta = tuple(meta)
        call.label = getattr(function, "label", "") or ""

    # ---------------------------------------------------- mapping to ids
    def _node_bytes(self, xnode: Any) -> int:
        var = xnode.get_variable_or_none()
        return device_of([var] if var is not None else []).allocation_bytes(node_nbytes(xnode))

    def _new_array(self, rec: _ArrayRecord) -> int:
        self.arrays.append(rec)
        return len(self.arrays) - 1

    def _map_pending(self) -> None:
        """Map the last recorded call's input and output nodes to array ids
        (they exist only once ``FunctionNode.apply`` has returned)."""
        call, self._pending = self._pending, None
        if call is None:
            return
        f = call._func_strong
        in_ids = []
        xnodes = f.inputs if f is not None and f.inputs is not None else ()
        ids, weak = self.array_of.ids, weakref.ref  # (NodeIds' own dict: the hot path)
        has_backward = False
        for j, xnode in enumerate(xnodes):
            aid = ids.get(weak(xnode))
            if aid is None:
                aid = ids[weak(xnode)] = self._new_input(call, j, xnode)
            in_ids.append(aid)
            if not has_backward and xnode._requires_grad:  # (requires_grad)
                has_backward = True
        if f is not None and f.inputs is None and call.in_shapes:
            # unchained by the forward since it ran: no backward reaches it
            call.unchained = True
            in_ids = self._unchained_inputs(call)
        call.in_ids = tuple(in_ids)
        call.has_backward = has_backward
        if call.in_prints is not None:
            self._note_written_between(call)
        if call.inner:
            inner = []
            for p in call.inner.values():
                a = ids.get(weak(p.node))
                if a is None:
                    a = self._param_array(p)
                if a not in in_ids and a not in inner:
                    inner.append(a)
            call.inner_ids = tuple(inner)
            call.inner = None
        out_ids = []
        arrays, out_view = self.arrays, call.out_view
        outputs = (f.outputs or ()) if f is not None else ()
        n_out = len(outputs)
        # the records of a plan's outputs, shared by the iterations that
        # follow it (never changed once made: no death is watched then)
        shared = self.shared_records if call.as_planned and not self.recording else None
        for k, (shape, dtype, nbytes, buffer_bytes) in enumerate(call.out_meta):
            j = out_view[k]
            view_of = None
            if j is not None and j < len(in_ids):
                base = arrays[in_ids[j]]
                view_of = in_ids[j] if base.view_of is None else base.view_of
            yref = outputs[k] if k < n_out else None
            ynode = yref() if yref is not None else None
            var = ynode._variable() if ynode is not None else None  # (get_variable_or_none)
            # (an unchained call's output nodes are gone: the caller may hold it)
            dies_at = call.index + 1 if var is None and not call.unchained else None
            aid = len(arrays)
            rec = shared.get(aid) if shared is not None else None
            if (rec is None or rec.producer != call.index or rec.shape is not shape
                    or rec.view_of != view_of or rec.dies_at != dies_at):
                rec = _ArrayRecord(shape, dtype, nbytes, "intermediate", call.index,
                                   view_of=view_of)
                rec.buffer_bytes = buffer_bytes
                rec.dies_at = dies_at
                if shared is not None:
                    shared[aid] = rec
            arrays.append(rec)
            out_ids.append(aid)
            if ynode is None:
                continue
            ids[yref] = aid
            if var is not None and self.recording:
                self._watch.append(weakref.ref(var, self._death_callback(aid)))
        call.out_ids = tuple(out_ids)
        if call._out is not None and (call.unchained or self.recording):
            # found by their arrays: a later reader of an unchained call's
            # output (its node is not the function's any more), an
            # unchained call's input in a recording
            made = self._unchained_outs if call.unchained else self._made_arrays
            for aid, y in zip(out_ids, call._out):
                try:
                    made[id(y)] = (aid, weakref.ref(y))
                except TypeError:  # (an array type without weak references)
                    pass
        call._out = None
        self._events().after_mapping(call)
        call._func_strong = None

    def _new_input(self, call: Call, j: int, xnode: Any) -> int:
        """The array id of input ``j`` of ``call``, read for the first time
        (``xnode``): a parameter, an array an unrecorded function made, the
        caller's argument, or a temporary."""
        if xnode.requires_grad and xnode.creator_node is not None:
            self.outside_grad_input = True
        var = xnode.get_variable_or_none()
        if self._unchained_outs:
            aid = _found(self._unchained_outs, var.raw_array if var is not None else xnode._data)
            if aid is not None:
                if var is not None and self.recording:  # (its lifetime, as any output's)
                    self._watch.append(weakref.ref(var, self._death_callback(aid)))
                return aid
        made = call.in_made[j] if j < len(call.in_made) else None
        if isinstance(var, chainer.Parameter):
            return self._param_array(var)
        if made is not None:
            if made.aid is None:  # its first reader
                made.aid = self._new_array(_ArrayRecord(
                    tuple(xnode.shape), dtype_name(xnode.dtype), self._node_bytes(xnode),
                    "input", None))
                self.arrays[made.aid].made_at = made.at
            ref = made.read(self.arrays[made.aid], call.index, var, self.recording,
                            self._death_position)
            if ref is not None:
                self._watch.append(ref)
            return made.aid
        aid, new = self._input_record(call, j, xnode.shape, xnode.dtype,
                                      lambda: self._node_bytes(xnode))
        if new and var is None and not self.arrays[aid].name:
            self.arrays[aid].dies_at = call.index + 1  # a temporary made in the forward (noise)
        return aid

    def _input_record(self, call: Call, j: int, shape: Any, dtype: Any,
                      nbytes: Callable[[], int]) -> Tuple[int, bool]:
        """The array id of input ``j`` of ``call`` that no recorded
        function made: the caller's argument's (a raw array argument gets a
        new Variable, and node, at every function it is passed to: it is
        still one array), else a new input array; and whether it is new."""
        name = call.in_args[j] if j < len(call.in_args) else None
        aid = self._arg_ids.get(name) if name else None
        if aid is not None:
            return aid, False
        aid = self._new_array(_ArrayRecord(tuple(shape), dtype_name(dtype), nbytes(), "input",
                                           None, name or ""))
        if name:
            self._arg_ids[name] = aid
        return aid, True

    def _unchained_inputs(self, call: Call) -> List[int]:
        """The array ids of the inputs of ``call``, whose function the
        forward unchained (``unchain_backward()`` inside the model: truncated
        backpropagation within one call) before they were mapped, so that
        its input nodes are gone. Following a plan: the planned node's
        inputs (its class, input shapes and parameters were checked before
        it ran; which intermediate arrays it read cannot be seen any more,
        and no backward reaches it or anything before it). Recording: found
        by their arrays, as this recording's outputs, the link's parameters
        or the caller's arguments; others are new input arrays."""
        planned = self._events().planned_inputs(call.index)
        if planned is not None and len(planned) == len(call.in_shapes):
            return list(planned)
        data = call._in_data
        if data is None:
            return []
        params: Dict[int, Any] = {}
        self._params.note(call.index, params, data)  # (the link's parameters among them)
        found = []
        for j, x in enumerate(data):
            aid = _found(self._made_arrays, x)
            param = (next((p for p in params.values() if p.array is x), None)
                     if aid is None else None)
            if param is not None:
                aid = self.array_of.get(param.node)
                if aid is None:
                    aid = self._param_array(param)
            if aid is None:
                aid, _ = self._input_record(call, j, x.shape, x.dtype,
                                           lambda: device_of([x]).allocation_bytes(x.nbytes))
            found.append(aid)
        return found

    def planned_inputs(self, i: int) -> Optional[Tuple[int, ...]]:
        """The planned inputs of call ``i`` (the executor's, while it
        follows a plan; see :meth:`_unchained_inputs`)."""
        return None

    def _param_array(self, param: Any) -> int:
        """A new parameter array (``param`` read for the first time)."""
        name = self._param_names.get(id(param), param.name or "")
        node = param.node
        aid = self._new_array(_ArrayRecord(tuple(node.shape), dtype_name(node.dtype),
                                           self._node_bytes(node), "param", None, name))
        self.param_refs[aid] = weakref.ref(param)
        self.array_of[node] = aid
        return aid

    def _death_callback(self, aid: int) -> Callable[[Any], None]:
        def died(_ref: Any) -> None:
            at = self._death_position()
            if at is not None:
                self.arrays[aid].dies_at = at
        return died

    def _death_position(self) -> Optional[int]:
        """The ``dies_at`` of a caller's reference dropped now: before the
        next recorded call, or the one after it during unrecorded work (it
        may have been there at that work's peak); None after the forward."""
        if self.forward_done:
            return None
        return len(self.calls) + (1 if self._unrecorded.running else 0)

    # ------------------------------------------------------------ backward
    def backward_preprocess(self, function: Any, in_data: Any, out_grad: Any) -> None:
        i = self.index_of.get(id(function))
        if i is None:
            return
        if self._outside_watch is not None:
            self.end_outside()
        if not self.forward_done:
            self.backward_during_forward = True
        if self._sources and self.forward_done:  # (written between the forward and its backward)
            if self.recording:
                self._note_sources_written()
            self._sources = []
        self._events().before_backward(i, function)
        if self.recording:
            self.backward_order.append(i)
            dev = device_of(tuple(in_data) + tuple(out_grad))
            if self.measure:
                self._begin_session(dev)
            meter = dev.meter() if self.measure else None
            if meter is not None:
                dev.synchronize()
                meter.start()
            self._bwd[i] = (time.perf_counter(), meter, dev)

    def backward_postprocess(self, function: Any, in_data: Any, out_grad: Any) -> None:
        i = self.index_of.get(id(function))
        if i is None:
            return
        started = self._bwd.pop(i, None)
        if started is not None:
            t0, meter, dev = started
            if meter is not None:
                dev.synchronize()
                m = meter.stop()
                call = self.calls[i]
                # The net allocation may be negative (accumulated gradients
                # replace their parts); the transient is above the end state.
                call.bwd_alloc = int(m.retained_bytes)
                call.bwd_transient = max(0, m.peak_bytes - m.retained_bytes)
            self.calls[i].bwd_time_s = time.perf_counter() - t0
        self._events().after_backward(i, function)

    def _begin_session(self, dev: Device) -> None:
        """On NumPy, one tracing session from the first recorded backward
        call to the end of the recorded backward (:meth:`end_session`), in
        which each call's meter is nested. A meter that starts the tracing
        sees no free of an array allocated before it (tracemalloc knows
        only what it traced), and a backward call frees arrays that earlier
        calls made: a parameter used several times gets its gradient summed
        at each later use and the previous sum freed, an activation's
        gradient is summed with the one another reader gave. Measured each
        in its own session, such a call's net allocation comes out as large
        as the new sum (its peak above its end a sum too small), where the
        allocator's is nothing. The parameters' gradients already there (a
        loop that does not clear them) are adopted by the session, so that
        their frees at their first use are seen too. CuPy's pool sees every
        free: no session."""
        if dev.is_gpu or self._session is not None:
            return
        session = dev.meter()
        session.start()
        link = self._link_ref() if self._link_ref is not None else None
        if link is not None:
            dev.adopt(session, [g for g in map(param_grad, link.params()) if g is not None])
        self._session = session
        self._session_end = weakref.finalize(self, _end_meter, session)
        _SESSIONS.add(self)

    def end_session(self) -> None:
        """End the recorded backward's tracing session, if open (the
        backward is over; a new call, :meth:`graph`), and the watch of the
        caller's work before it (no backward came)."""
        if self._outside_watch is not None:
            self.end_outside(backward=False)
        session, self._session = self._session, None
        if session is None:
            return
        _SESSIONS.discard(self)
        self._session_end.detach()
        self._session_end = None
        _end_meter(session)

    def before_backward(self, i: int, function: Any) -> None:
        """Called before the backward of recorded function ``i`` (executor)."""

    # ----------------------------------- the caller's work after the forward
    def watch_outside(self, dev: Device) -> None:
        """The recorded forward has returned: measure what the caller
        allocates, outside the recorded functions, until the backward of
        the first of them begins, while the graph is alive: its loss, a
        target network's forward under ``no_backprop_mode`` (a DQN agent's
        update), their gradients. :attr:`outside` then holds the peak above
        the level at the return and what is still held when the backward
        begins, with the allocator's view that a planned step's meter has
        (NumPy's tracemalloc domain; CuPy's pool), or stays None where that
        view would count Python objects too (someone else traces
        everything).

        The model's parameter gradients that the caller clears in between
        (``cleargrads()``) are freed by the replay before its backward: their
        frees are taken back out of what is held (on NumPy the meter adopts
        them when it owns the tracing, so that their frees are seen; under
        an outer tracer they are taken to be traced by it). The recording's
        own work comes later: the backward's tracing session starts, and a
        plan is made, only once the backward has begun."""
        if not (self.recording and self.measure) or self._outside_watch is not None \
                or self.backward_order:
            return
        from ..memory import SCOPE_CUPY, SCOPE_NUMPY
        # garbage already waiting is collected now (once per recording), so
        # that its finalizers' arrays do not land in the caller's window
        gc.collect()
        meter = dev.meter()
        meter.start()
        if meter.scope not in (SCOPE_NUMPY, SCOPE_CUPY):
            meter.stop()
            return
        link = self._link_ref() if self._link_ref is not None else None
        grads: Dict[int, Any] = {}
        if link is not None:
            for p in link.params():
                g = param_grad(p)
                if g is not None:
                    grads.setdefault(id(g), (p, g))
        dev.adopt(meter, [g for _, g in grads.values()])
        level = meter.current_bytes()
        watched = [(gone_watch(p, g), dev.allocation_bytes(g.nbytes))
                   for p, g in grads.values()]
        end = weakref.finalize(self, _end_meter, meter)
        self._outside_watch = (meter, level, watched, end)
        _SESSIONS.add(self)

    def end_outside(self, backward: bool = True) -> None:
        """End :meth:`watch_outside`'s measurement: the backward begins
        (``backward``), or none came (the model is called again, its graph
        is made): then nothing was between a forward and its backward, and
        nothing is kept of it."""
        watch, self._outside_watch = self._outside_watch, None
        if watch is None:
            return
        meter, level, watched, end = watch
        end.detach()
        if self._session is None:
            _SESSIONS.discard(self)
        m = meter.stop()
        if not backward:
            return
        freed = sum(nb for gone, nb in watched if gone())
        held = max(0, m.end_bytes - level + freed)
        self.outside = (max(0, m.absolute_peak_bytes - level, held), held)

    def after_backward(self, i: int, function: Any) -> None:
        """Called after the backward of recorded function ``i`` (executor)."""

    # ------------------------------------------------------------- graph
    def graph(self, *, cost_model: str = "measured", batch_size: Optional[int] = None,
              name: str = "model", facts: Optional[Dict[str, Any]] = None,
              fill: Optional[Graph] = None) -> Graph:
        """The recorded graph.

        Args:
            cost_model: its cost model.
            batch_size: the batch it was recorded at.
            name: ``meta['model']``.
            facts: :class:`~chainer_recompute.core.graph.StepFacts` fields
            the recording cannot see (``state_bytes``, ``kept_after_backward``).
            fill: a graph whose nodes of the same index give the
                measurements of calls that were not measured (the executor
                records without measuring while a plan matches).

        Raises:
            CaptureError: nothing was recorded.
        """
        self._map_pending()
        self.end_session()
        if not self.calls:
            raise CaptureError("the model applied no Chainer function with backprop enabled; "
                               "there is no graph to record")
        arrays = []
        consumed = {a for c in self.calls for a in (c.in_ids or ())}
        for i, r in enumerate(self.arrays):
            kind = r.kind
            if kind == "intermediate" and i not in consumed:
                kind = "output"
            dies_at = r.dies_at
            if (fill is not None and r.producer is not None and i < len(fill.arrays)
                    and not self.calls[r.producer].measured
                    and not self.calls[r.producer].unchained):
                dies_at = fill.arrays[i].dies_at  # lifetimes were not watched
            if dies_at is not None:
                dies_at = min(dies_at, len(self.calls) + 1)
            arrays.append(ArrayInfo(id=i, shape=r.shape, dtype=r.dtype, nbytes=r.nbytes, kind=kind,
                                    producer=r.producer, name=r.name, view_of=r.view_of,
                                    dies_at=dies_at, buffer_bytes=r.buffer_bytes,
                                    made_at=r.made_at))
        nodes = []
        for c in self.calls:
            ref = fill.nodes[c.index] if (fill is not None and not c.measured
                                          and c.index < fill.n) else None
            held, recomputable, reason = c.held, c.recomputable, c.reason
            time_s, fwd_t = c.time_s, c.fwd_transient
            if ref is not None:
                # Same function and shapes as the planned node: its attributes
                # and their roles (written ones included: running statistics
                # are not seen without measuring) are the same.
                held = ref.held
                # (what this recording found of the call itself stands: an
                # input written in place, its function unchained)
                recomputable = ref.recomputable and c.recomputable
                reason = ref.attrs.get("unsafe_reason", "") if not ref.recomputable else reason
                time_s, fwd_t = ref.forward_time_s, ref.forward_transient_bytes
            elif not c.measured:
                recomputable, reason = False, "not analysed"
            bwd_time = c.bwd_time_s if c.bwd_time_s is not None else (
                ref.backward_time_s if ref is not None else None)
            bwd_t = c.bwd_transient if c.bwd_transient is not None else (
                ref.backward_transient_bytes if ref is not None else None)
            bwd_a = c.bwd_alloc if c.bwd_alloc is not None else (
                ref.backward_alloc_bytes if ref is not None else None)
            attrs = {"unsafe_reason": reason} if reason else {}
            if c.unchained:
                attrs["unchained"] = True
            unrecorded = c.unrecorded_peak
            if unrecorded is None:  # not measured (a planned call): the plan's figure
                unrecorded = (fill.nodes[c.index].unrecorded_peak_bytes
                              if fill is not None and c.index < fill.n else 0)
            in_ids = c.in_ids or ()
            out_ids = c.out_ids or ()
            nodes.append(Node(
                id=c.index, op=c.op, inputs=in_ids, outputs=out_ids,
                retained_inputs=tuple(in_ids[i] for i in c.keep_in if i < len(in_ids)),
                retained_outputs=tuple(out_ids[i] for i in c.keep_out if i < len(out_ids)),
                held=held, forward_time_s=time_s, backward_time_s=bwd_time,
                recomputable=recomputable, attrs=attrs,
                label=c.label or (ref.label if ref is not None else ""),
                forward_transient_bytes=fwd_t, backward_transient_bytes=bwd_t,
                backward_alloc_bytes=bwd_a, has_backward=c.has_backward,
                inner_params=c.inner_ids, unrecorded_peak_bytes=int(unrecorded), link=c.link))
        step: Dict[str, Any] = {"returned": tuple(self.returned)}
        peak, held = self.outside or (0, 0)
        if peak >= OUTSIDE_FLOOR_BYTES:
            # the caller's arrays between the forward and the backward (the
            # replay's transient at the end of the forward, and what stays
            # from there on)
            step["outside_peak_bytes"] = int(peak)
            if held >= OUTSIDE_FLOOR_BYTES:
                step["outside_held_bytes"] = int(held)
        # work after the last recorded function that was not recorded
        step["unrecorded_tail_peak_bytes"] = int(self._unrecorded.tail_peak or 0)
        if self.on_cupy:
            step["allocator"] = "cupy"  # the replay models its pool (core.pool)
        order = self.backward_order or None
        if order and not (self.outside_grad_input or self.backward_during_forward):
            loss = self.returned[0] if len(self.returned) == 1 else None
            step["closed_backward"] = (loss is not None and arrays[loss].shape == ()
                                       and arrays[loss].producer == order[0])
        step.update(facts or {})
        return Graph(arrays, nodes, batch_size=batch_size, cost_model=cost_model,
                     meta={"model": name}, step=StepFacts(**step),
                     backward_order=_first_pass(order) if order else None)


#: What the caller allocates between the recorded forward and its backward
#: is entered into the graph from this many bytes on: below it (the loss's
#: gradient, a scalar or two) it is left to the budget's 1% headroom, so that
#: a loop that does nothing there plans as before.
OUTSIDE_FLOOR_BYTES = 1024


#: Recorders whose backward's tracing session (or watch of the caller's
#: work before it) is open.
_SESSIONS: "weakref.WeakSet[Recorder]" = weakref.WeakSet()


def _found(made: Dict[int, Tuple[int, Any]], x: Any) -> Optional[int]:
    """The array id of array ``x`` in ``made`` (``id(array) -> (array id,
    weak reference)``), or None."""
    hit = made.get(id(x))
    return hit[0] if hit is not None and hit[1]() is x else None


def _unwrap(function: Any) -> None:
    """Take off the forward wrapper set on ``function`` (an instance
    attribute). ``vars()`` is not used: it would make the function's
    instance dictionary an object of its own, one more for the collector
    to follow through every step."""
    try:
        del function.forward
    except AttributeError:
        pass


def end_backward_sessions() -> None:
    """End every open tracing session of a recorded backward (a new call
    begins: a meter started now must own the tracing to see the frees of
    the arrays it adopts)."""
    for rec in list(_SESSIONS):
        rec.end_session()


def _end_meter(meter: Any) -> None:
    try:
        meter.stop()
    except RecomputeError:  # already stopped
        pass


def _first_pass(order: Sequence[int]) -> List[int]:
    """The first backward pass of a recorded order (a graph backpropagated
    twice records its functions twice)."""
    seen, out = set(), []
    for v in order:
        if v in seen:
            break
        seen.add(v)
        out.append(v)
    return out
