"""The static part of a planned execution and the checks of a running
iteration against it: :class:`Program` (an ``ExecutionPlan`` with its
parameters and what the runtime learned of it), the per-iteration counters
:class:`IterationStats`, and whether a recorded call matches its planned
node before and after it runs."""
from __future__ import annotations

from typing import Any, Dict, FrozenSet, Optional, Sequence, Tuple

from ..core.execution import ExecutionPlan
from ..core.graph import Graph
from .capture import Call

#: Updates of parameters after which a plan's graph died without another
#: backward pass, before parameters are no longer saved for one.
PROBATION = 1


class Probation:
    """The clean updates seen of a structure's graphs (see
    :attr:`Program.saves_parameters`): one record for the plans of the
    structure, so that a plan made again (a correction's, at the next call,
    while the last call's graph is still alive) does not start its
    probation over and save the parameters at one more update. Also
    whether a backward pass reached one of its graphs after an update of
    parameters its released blocks were computed from, whose values were
    saved for it, or would have been but for the probation's release mode
    (``backward_after_update``: Chainer's DCGAN updater
    backpropagates the discriminator's graph again after updating it)."""

    __slots__ = ("clean_updates", "backward_after_update")

    def __init__(self) -> None:
        self.clean_updates = 0
        self.backward_after_update = False


class Program(ExecutionPlan):
    """An :class:`~chainer_recompute.core.execution.ExecutionPlan` with the
    very parameters it was planned for (wiring checks) and what the runtime
    learned about it.

    Args:
        graph, lower_sets, kept, inner, levels, backward_order: see
            ``ExecutionPlan``.
        param_refs: weak references to the parameters, by array id.
    """

    def __init__(self, graph: Graph, lower_sets: Sequence[FrozenSet[int]],
                 kept: FrozenSet[int], param_refs: Optional[Dict[int, Any]] = None,
                 inner: FrozenSet[int] = frozenset(),
                 levels: Optional[Sequence[int]] = None,
                 backward_order: Optional[Sequence[int]] = None) -> None:
        super().__init__(graph, lower_sets, kept, inner, levels, backward_order)
        self.param_refs: Dict[int, Any] = dict(param_refs or {})
        # learned: the graph is backpropagated more than once per iteration
        self.multi_backward = False
        # what stays after a node's last backward reader (replay.RELEASE_MODES):
        # chosen by the runner from the replayed peaks and the budget
        self.release_mode = "none"
        self.release_mode_decided = False
        # that mode is predicted over the budget: it keeps what a pass after
        # an optimizer update reads (Planner.decide_release); a step within
        # the prediction is no overshoot to correct
        self.over_budget_by_mode = False
        # The modes an iteration whose update is on probation (see
        # on_probation) may take in place of ``release_mode``: (mode, bytes
        # one call keeps at the update beyond ``release_mode``, bytes of
        # parameter values the update saves), and the bytes it saves in
        # ``release_mode`` (Planner.decide_probation_modes)
        self.probation_modes: Tuple[Tuple[str, int, int], ...] = ()
        self.probation_saved = 0
        # Updates of parameters while a graph of this plan was alive, after
        # which it died without another backward pass: after PROBATION of
        # them, parameters are no longer saved before updates. Shared with
        # the plans made again for the same structure (a correction's).
        self.probation = Probation()
        # The plan was made from an iteration whose backward pass(es) had all
        # run (multi_backward is then what that iteration did): its graphs
        # are not expected to be backpropagated after an optimizer update,
        # and no parameter is saved before one unless they are found to be.
        self.backward_known = False
        # The model returns its loss (scalars computed inside it): see
        # IterationHook.before_param_update.
        returned = graph.step.returned
        self.returns_loss = bool(returned) and all(
            graph.arrays[a].shape == () for a in returned)
        self._before: Dict[int, Tuple[Any, ...]] = {}
        self._after: Dict[int, Tuple[Any, ...]] = {}
        self._outputs: Dict[int, Any] = {}
        #: the recorder's records of the outputs of iterations that follow
        #: this plan, by array id: the same in each (Recorder._map_pending)
        self.records: Dict[int, Any] = {}
        #: a nested plan's regenerations, by their nodes: after which node
        #: each value is let go (``regeneration_frees``; the executor's)
        self.frees: Dict[Tuple[int, ...], Dict[int, Any]] = {}

    def before_key(self, i: int) -> Tuple[Any, ...]:
        """What :func:`_matches_before` compares node ``i`` with, made once:
        its function class, its inputs' shapes (``None`` where one is not
        recorded), the inputs the caller passed (position, argument name)
        and the parameters (position, array id, weak reference)."""
        key = self._before.get(i)
        if key is None:
            node, arrays = self.graph.nodes[i], self.graph.arrays
            infos = [arrays[a] for a in node.inputs]
            shapes = tuple(None if x.shape is None else tuple(x.shape) for x in infos)
            key = self._before[i] = (
                node.op, shapes if None not in shapes else None, shapes,
                tuple((j, x.name or None) for j, x in enumerate(infos) if x.kind == "input"),
                tuple((j, x.id, self.param_refs.get(x.id)) for j, x in enumerate(infos)
                      if x.kind == "param"))
        return key

    def after_key(self, i: int) -> Tuple[Any, ...]:
        """What :func:`_matches_after` compares node ``i`` with, made once:
        its inputs, outputs' count, inner parameters, the parameters it
        reads that :func:`_matches_before` checked and those it did not
        (array ids: those of its inner functions), its outputs' shapes and
        dtypes (position, shape, dtype) where recorded, and the inputs and
        outputs it retains (sorted)."""
        key = self._after.get(i)
        if key is None:
            node, arrays = self.graph.nodes[i], self.graph.arrays
            checked = {a for _, a, _ in self.before_key(i)[4]}
            key = self._after[i] = (
                node.inputs, len(node.outputs), node.inner_params, tuple(checked),
                tuple(a for a in node.inputs + node.inner_params
                      if a in self.param_refs and a not in checked),
                tuple((k, tuple(arrays[a].shape), arrays[a].dtype)
                      for k, a in enumerate(node.outputs) if arrays[a].shape is not None),
                sorted(node.retained_inputs), sorted(node.retained_outputs),
                (self.planned_outputs(i) or (None,))[0], node.outputs,
                set(),  # the retentions (input, output indexes) found to match
                bool(node.attrs.get("unchained")))
        return key

    def planned_outputs(self, i: int) -> Optional[Tuple[Tuple[Any, ...], Tuple[Any, ...]]]:
        """Node ``i``'s outputs as the recorder describes a call's
        (``Call.out_meta``: shape, dtype, bytes, buffer bytes;
        ``Call.out_view``: the input each output views), made once; None
        where an output's shape is not recorded or there is no node ``i``."""
        found = self._outputs.get(i, False)
        if found is False:
            if i >= self.n:  # (a call past the plan's end)
                return None
            node, arrays = self.graph.nodes[i], self.graph.arrays
            roots = [arrays[a].view_of if arrays[a].view_of is not None else a
                     for a in node.inputs]
            meta, views = [], []
            for a in node.outputs:
                info = arrays[a]
                if info.shape is None:
                    found = None
                    break
                meta.append((tuple(info.shape), info.dtype, info.nbytes, info.buffer_bytes))
                views.append(roots.index(info.view_of) if info.view_of in roots else None)
            else:
                found = (tuple(meta), tuple(views))
            self._outputs[i] = found
        return found

    @property
    def clean_updates(self) -> int:
        return self.probation.clean_updates

    @property
    def on_probation(self) -> bool:
        """Whether parameters are saved before updates only because the
        loop's behaviour is not known yet (:attr:`saves_parameters`, not
        for a graph known to be backpropagated twice): a cost of the first
        ``PROBATION`` updates, in no plan."""
        return not self.multi_backward and not self.backward_known and \
            self.clean_updates < PROBATION

    @property
    def saves_parameters(self) -> bool:
        """Whether an optimizer update of a parameter that a released block
        was computed from first saves the parameter's values: a graph known
        to be backpropagated twice that regenerates in between, or, while
        that is not known (a plan made before its recorded graph's backward
        ran, or from a separate capture), during the first ``PROBATION``
        updates."""
        if self.multi_backward and self.release_mode != "all":
            return True
        return not self.backward_known and self.clean_updates < PROBATION


class IterationStats:
    """Counters of one iteration, kept by the runner after the iteration's
    arrays are gone (it references no array or graph object).

    Attributes:
        path: ``planned`` (the iteration followed a plan), ``recorded``
            (it ran plainly while its graph was recorded: the first call of
            a signature, or a structure not seen before), ``mismatch`` (it
            started on a plan and stopped matching it), ``plain`` (the
            signature fell back to plain Chainer).
        n_dropped: nodes the plan drops.
        n_released: arrays released at the moment (all dropped ones after
            the forward).
        recomputed_nodes: function forwards re-run during backward.
        n_nodes: functions in the planned graph.
        release_mode: what is kept after a node's last backward reader
            (``none``, ``checkpoints``, ``all``; see ``core.replay``).
        mismatch: why the iteration stopped matching its plan.
        measured_peak_bytes / predicted_peak_bytes / budget_bytes: set by
            the runner when it measures the iteration (see ``apply``).
        plain_peak_bytes: plain Chainer's peak for this iteration, measured
            (on the recorded step, or by the captures, scaled) or else
            predicted; set with ``measured_peak_bytes``.
        measured_pool_total_bytes: on CuPy, the same with the blocks the
            memory pool added for the iteration (its cached and split
            blocks included); None on NumPy.
        reordered: the backward ran in the plan's own order
            (``Plan.backward_order``), not Chainer's.
    """

    __slots__ = ("path", "n_dropped", "n_released", "recomputed_nodes", "mismatch",
                 "measured_peak_bytes", "predicted_peak_bytes", "budget_bytes", "n_nodes",
                 "release_mode", "measured_pool_total_bytes", "plain_peak_bytes", "reordered")

    def __init__(self, n_dropped: int = 0, path: str = "planned") -> None:
        self.path = path
        self.n_dropped = n_dropped
        self.n_released = 0
        self.recomputed_nodes = 0
        self.mismatch: Optional[str] = None
        self.measured_peak_bytes: Optional[int] = None
        self.measured_pool_total_bytes: Optional[int] = None
        self.predicted_peak_bytes: Optional[int] = None
        self.budget_bytes: Optional[int] = None
        self.plain_peak_bytes: Optional[int] = None
        self.n_nodes = 0
        self.release_mode = "none"
        self.reordered = False

    def __repr__(self) -> str:
        return (f"IterationStats(path={self.path!r}, dropped={self.n_dropped}, "
                f"released={self.n_released}, recomputed_nodes={self.recomputed_nodes}, "
                f"mismatch={self.mismatch!r}, measured_peak_bytes={self.measured_peak_bytes}, "
                f"predicted_peak_bytes={self.predicted_peak_bytes})")



def _after_update(program_ref: Any, state: Dict[str, bool]) -> None:
    """A graph that saw a parameter update died: count the update as
    clean when no backward pass came after it."""
    program = program_ref()
    if program is not None and not state["again"]:
        program.probation.clean_updates += 1


def _matches_before(p: Program, call: Call, in_data: Tuple[Any, ...]) -> bool:
    """The call's function class, input shapes, arguments and parameters
    (a parameter's input is its very array) are the planned node's."""
    i = call.index
    key = p._before.get(i)
    if key is None:
        if i >= p.n:
            return False
        key = p.before_key(i)
    op, known, shapes, args, params = key
    if op != call.op:
        return False
    if known is not None:
        if known != call.in_shapes:
            return False
    elif len(shapes) != len(call.in_shapes) or any(
            s is not None and s != c for s, c in zip(shapes, call.in_shapes)):
        return False
    for j, name in args:
        if name != call.in_args[j]:
            return False
    for j, _, ref in params:
        param = ref() if ref is not None else None
        if param is None or param.raw_array is not in_data[j]:
            return False
    return True


def _after_mismatch(p: Program, call: Call, param_refs: Dict[int, Any]) -> str:
    """What differs between a call and its planned node (the first
    difference :func:`_matches_after` finds), in words."""
    i = call.index
    node = p.graph.nodes[i]
    head = f"function #{i} ({call.op})"
    in_ids, out_ids = call.in_ids or (), call.out_ids or ()
    if call.unchained != bool(node.attrs.get("unchained")):
        return (f"{head} was unchained (unchain_backward() inside the model) "
                + ("in this call, not in the plan's" if call.unchained
                   else "in the plan's call, not in this one"))
    if in_ids != node.inputs:
        return (f"{head} reads arrays {in_ids}, but the plan has it read {node.inputs} (the "
                f"model's wiring depends on the data?)")
    if len(out_ids) != len(node.outputs):
        return f"{head} makes {len(out_ids)} outputs, the plan {len(node.outputs)}"
    if call.inner_ids != node.inner_params:
        return (f"{head} applies functions to parameters {call.inner_ids} inside its forward, "
                f"the plan to {node.inner_params}")
    for a in in_ids + call.inner_ids:
        planned = p.param_refs.get(a)
        if planned is not None:
            ref = param_refs.get(a)
            if ref is None or ref() is not planned():
                return f"{head} reads another parameter than the plan's as array {a}"
    for a, (shape, dtype, _, _) in zip(node.outputs, call.out_meta):
        planned = p.graph.arrays[a]
        if planned.shape is not None and tuple(planned.shape) != shape:
            return (f"{head} makes array {a} of shape {shape}, the plan one of shape "
                    f"{tuple(planned.shape)}")
        if planned.shape is not None and planned.dtype and planned.dtype != dtype:
            return f"{head} makes array {a} of dtype {dtype}, the plan one of dtype {planned.dtype}"
    return f"{head} retains other arrays for its backward than the plan's"


def _matches_after(p: Program, call: Call, param_refs: Dict[int, Any]) -> bool:
    """The call's wiring (which recorded array each input is, the very
    parameters, those its inner functions read too), outputs and retention
    are the planned node's. (A parameter among its inputs is the planned
    one: :func:`_matches_before` saw its array at the planned position,
    and the same array ids follow. Outputs described as this plan's node's
    have its shapes: ``Recorder._describe_as_planned`` compared them.)"""
    key = p._after.get(call.index)
    if key is None:
        key = p.after_key(call.index)
    (inputs, n_out, inner, seen, params, shapes, keep_in, keep_out, planned, outputs, known,
     unchained) = key
    in_ids, out_ids = call.in_ids or (), call.out_ids or ()
    if (in_ids != inputs or len(out_ids) != n_out or call.inner_ids != inner
            or call.unchained is not unchained):
        return False
    for a in seen:  # (read as a Parameter, not a Variable of its array)
        if a not in param_refs:
            return False
    for a in params:
        ref = param_refs.get(a)
        if ref is None or ref() is not p.param_refs[a]():
            return False
    meta = call.out_meta
    if planned is None or meta is not planned:
        for k, shape, dtype in shapes:
            if k >= len(meta) or meta[k][0] != shape or (dtype and meta[k][1] != dtype):
                return False
    ki, ko = call.keep_in, call.keep_out
    if out_ids != outputs:
        return _retains(in_ids, out_ids, ki, ko, keep_in, keep_out)
    if (ki, ko) in known:
        return True
    if not _retains(in_ids, out_ids, ki, ko, keep_in, keep_out):
        return False
    known.add((ki, ko))
    return True


def _retains(in_ids: Tuple[int, ...], out_ids: Tuple[int, ...], ki: Tuple[int, ...],
             ko: Tuple[int, ...], keep_in: Any, keep_out: Any) -> bool:
    """Whether a call that retains inputs ``ki`` and outputs ``ko``
    (indexes) retains the arrays ``keep_in`` and ``keep_out`` (sorted)."""
    return ((sorted([in_ids[j] for j in ki]) == keep_in if ki else not keep_in) and
            (sorted([out_ids[k] for k in ko]) == keep_out if ko else not keep_out))
