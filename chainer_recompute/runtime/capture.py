"""Recording one real forward pass of a Chainer model into a :class:`Graph`.

:class:`CaptureHook` is a ``chainer.FunctionHook``: while it is active every
top-level function application is recorded in execution order, with its
input and output arrays, the arrays Chainer retains for its backward
(``retain_inputs`` / ``retain_outputs``), the arrays the function object
keeps in its own attributes (found by inspecting the object after its
forward, not from a per-function list) and its measured forward time.

With ``check_recompute=True`` (the default) every function is also run a
second time on the same inputs, which tells, without a list of known
functions:

- whether its forward is reproducible (randomness held in the function
  object, like dropout's ``mask``, is; randomness drawn anew is not);
- which attribute arrays are *derived* (recomputed by forward: max-pooling
  indexes, BatchNorm ``mean`` / ``inv_std``) and which are *state* that
  must be kept (a dropout mask: clearing it changes the output);
- which arrays it *writes* in place (BatchNorm running statistics), which
  a recomputation must detach;
- whether it modifies its inputs in place (then it is not recomputable).

Capture leaves the model as it found it: parameters, persistent values
(BatchNorm statistics), gradients and NumPy's global random state are
restored on every exit path, and the hook is always removed.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy

from . import _chainer  # noqa: F401  (NumPy 2 compatibility before chainer)
import chainer
from chainer import backend

from ..core.errors import CaptureError
from ..core.graph import ArrayInfo, Graph, HeldArray, Node

logger = logging.getLogger(__name__)

# FunctionNode bookkeeping attributes that are not arrays the function keeps.
_SKIP_ATTRS = frozenset({
    "_retained_output_data", "inputs", "outputs", "stack", "_input_layouts",
    "_output_layouts", "rank", "lazy_grad_sum", "_input_indexes_to_retain",
    "_output_indexes_to_retain", "_output_count", "_function", "forward",
    "local_function_hooks", "_local_function_hooks", "_n_local_function_hooks",
    "_is_chainerx_fallback_mode", "chainerx_device", "_chainerx_retained_inputs",
    "_chainerx_retained_outputs", "_supports_static_optimizations", "_static_forward",
})


def function_op(f: chainer.FunctionNode) -> str:
    """The class name of a function (of the wrapped one for old-style)."""
    inner = getattr(f, "_function", None)
    return type(inner).__name__ if inner is not None else type(f).__name__


def _attr_owners(f: chainer.FunctionNode) -> List[Any]:
    owners = [f]
    inner = getattr(f, "_function", None)
    if inner is not None:
        owners.append(inner)
    return owners


def attribute_arrays(f: chainer.FunctionNode) -> List[Tuple[Any, str, Any]]:
    """``(owner, name, array)`` for every ndarray kept in the attributes of
    ``f`` (and of the old-style Function it wraps)."""
    array_types = chainer.get_array_types()
    found = []
    for owner in _attr_owners(f):
        for name, value in list(vars(owner).items()):
            if name in _SKIP_ATTRS:
                continue
            if isinstance(value, array_types):
                found.append((owner, name, value))
    return found


def _is_array(x: Any) -> bool:
    return isinstance(x, chainer.get_array_types())


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of two arrays (NaN equal to NaN)."""
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    xp = backend.get_array_module(a)
    a8 = xp.ascontiguousarray(a).view(numpy.uint8)
    b8 = xp.ascontiguousarray(b).view(numpy.uint8)
    return bool(xp.array_equal(a8, b8))


def _synchronize(arrays: Sequence[Any]) -> None:
    for a in arrays:
        if _is_array(a) and not isinstance(a, numpy.ndarray):
            backend.get_device_from_array(a).device.synchronize()
            return


class _Record:
    __slots__ = ("func", "in_data", "out_data", "times")

    def __init__(self, func: chainer.FunctionNode, in_data: Tuple[Any, ...]) -> None:
        self.func = func
        self.in_data = in_data
        self.out_data: Optional[Tuple[Any, ...]] = None
        self.times: List[float] = []


class CaptureHook(chainer.FunctionHook):
    """Records the top-level function applications of a forward pass.

    Functions applied *inside* another function's forward (nested
    applications) and work done during backward are not recorded. The hook
    keeps references to the input and output arrays of every recorded
    function while it lives, so capture at a small batch and scale
    (:meth:`Graph.scale_batch`).

    >>> import chainer, numpy as np, chainer.functions as F
    >>> with CaptureHook() as hook:
    ...     y = F.sum(F.relu(chainer.Variable(np.ones((2, 3), np.float32))))
    >>> [function_op(r.func) for r in hook.records]
    ['ReLU', 'Sum']
    """

    name = "CaptureHook"

    def __init__(self) -> None:
        self.records: List[_Record] = []
        self._depth = 0
        self._stack: List[Optional[_Record]] = []
        self.interrupted: List[_Record] = []  # functions whose forward raised

    def forward_preprocess(self, function, in_data):
        self._depth += 1
        if self._depth > 1 or not chainer.config.enable_backprop:
            # A nested application inside another forward, or work outside
            # the backprop graph: not a node.
            self._stack.append(None)
            return
        rec = _Record(function, tuple(in_data))
        self._stack.append(rec)
        original = type(function).forward

        def timed_forward(inputs, _f=function, _rec=rec, _orig=original):
            _synchronize(inputs)
            t0 = time.perf_counter()
            out = _orig(_f, inputs)
            _synchronize(out)
            _rec.times.append(time.perf_counter() - t0)
            _rec.out_data = tuple(out)
            return out

        function.forward = timed_forward  # instance attribute, removed below

    def forward_postprocess(self, function, in_data):
        self._depth -= 1
        rec = self._stack.pop()
        if rec is None:
            return
        vars(function).pop("forward", None)
        self.records.append(rec)

    def deleted(self, function=None):
        # Make sure no instance-level forward wrapper outlives the hook.
        self.interrupted = [rec for rec in self._stack if rec is not None]
        for rec in self.interrupted:
            vars(rec.func).pop("forward", None)
        self._stack.clear()
        self._depth = 0


# --------------------------------------------------------------- state
class _ModelState:
    """Persistent values, gradients and NumPy's random state, saved and
    restored in place."""

    def __init__(self, link: Optional[chainer.Link]) -> None:
        self.link = link
        self.persistents: List[Tuple[chainer.Link, str, Any]] = []
        self.grads: List[Tuple[Any, Any]] = []
        self.rng = numpy.random.get_state()
        if link is None:
            return
        for sub in link.links():
            for name in getattr(sub, "_persistent", ()):
                value = getattr(sub, name, None)
                self.persistents.append((sub, name, value.copy() if _is_array(value) else value))
        for p in link.params():
            if p.array is None:
                # Lazily initialised: the capture forward initialises it, as
                # the first real forward would have.
                continue
            self.grads.append((p, None if p.grad is None else p.grad.copy()))

    def restore(self) -> None:
        numpy.random.set_state(self.rng)
        for sub, name, saved in self.persistents:
            current = getattr(sub, name, None)
            if _is_array(saved) and _is_array(current) and current.shape == saved.shape:
                current[...] = saved
            else:
                setattr(sub, name, saved)
        for p, g in self.grads:
            if g is None:
                p.grad = None
            elif p.grad is not None and p.grad.shape == g.shape:
                p.grad[...] = g
            else:
                p.grad = g


def batch_size_of(args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[int]:
    """The leading dimension of the first array (or Variable) argument."""
    for a in list(args) + list(kwargs.values()):
        arr = a.raw_array if isinstance(a, chainer.Variable) else a
        if _is_array(arr) and arr.ndim > 0:
            return int(arr.shape[0])
    return None


def _find_link(model: Any) -> Optional[chainer.Link]:
    if isinstance(model, chainer.Link):
        return model
    owner = getattr(model, "__self__", None)
    return owner if isinstance(owner, chainer.Link) else None


def _first_variable(result: Any) -> Optional[chainer.Variable]:
    if isinstance(result, chainer.Variable):
        return result
    if isinstance(result, dict):
        result = list(result.values())
    if isinstance(result, (tuple, list)):
        for r in result:
            v = _first_variable(r)
            if v is not None:
                return v
    return None


# ------------------------------------------------------------ analysis
def _rerun(f: chainer.FunctionNode, in_data: Tuple[Any, ...],
           clear: Sequence[Tuple[Any, str]] = (),
           detach: Sequence[Tuple[Any, str]] = ()) -> Tuple[Any, ...]:
    """Run ``f.forward`` again; attributes in ``clear`` set to None and
    in ``detach`` replaced by copies for the run. ``f``'s attributes are put
    back as they were afterwards."""
    saved = [dict(vars(o)) for o in _attr_owners(f)]
    try:
        for owner, name in clear:
            setattr(owner, name, None)
        for owner, name in detach:
            setattr(owner, name, getattr(owner, name).copy())
        with chainer.using_config("in_recomputing", True), \
                chainer.using_device(backend.get_device_from_array(*in_data)):
            return tuple(type(f).forward(f, in_data))
    finally:
        for o, d in zip(_attr_owners(f), saved):
            vars(o).clear()
            vars(o).update(d)


def analyse_recompute(f: chainer.FunctionNode, in_data: Tuple[Any, ...],
                      out_data: Tuple[Any, ...], external_ids: set
                      ) -> Tuple[bool, str, Dict[str, str]]:
    """Decide whether ``f`` can be recomputed and what its attribute arrays
    are.

    Returns:
        ``(recomputable, reason, roles)`` where ``roles`` maps attribute
        names to ``derived`` (recomputed by forward), ``state`` (must be
        kept for an identical recomputation), ``written`` (updated in place
        by forward: detach during recomputation) or ``external``
        (pre-existing arrays such as running statistics that forward only
        reads).
    """
    io_ids = {id(a) for a in in_data + out_data if a is not None}
    attrs = [(o, n, a) for o, n, a in attribute_arrays(f) if id(a) not in io_ids]
    before_attrs = {(id(o), n): a.copy() for o, n, a in attrs}
    before_inputs = [a.copy() if _is_array(a) else a for a in in_data]
    roles: Dict[str, str] = {}
    try:
        out1 = _rerun(f, in_data)
    except Exception as e:  # noqa: BLE001 - any failure means "unsafe"
        return False, f"forward could not be run again ({type(e).__name__}: {e})", roles
    # In-place writes: restore the contents, remember them.
    written = []
    for o, n, a in attrs:
        if not _same(a, before_attrs[(id(o), n)]):
            a[...] = before_attrs[(id(o), n)]
            roles[n] = "written"
            written.append((o, n))
    for a, b in zip(in_data, before_inputs):
        if _is_array(a) and not _same(a, b):
            a[...] = b
            return False, "forward modifies its inputs in place", roles
    if len(out1) != len(out_data) or not all(_same(x, y) for x, y in zip(out1, out_data)):
        return False, ("a second forward gives other outputs (randomness not held in "
                       "the function object?)"), roles
    for o, n, a in attrs:
        if n in roles:
            continue
        if id(a) in external_ids:
            roles[n] = "external"
            continue
        try:
            out2 = _rerun(f, in_data, clear=[(o, n)], detach=written)
            same = len(out2) == len(out_data) and all(_same(x, y) for x, y in zip(out2, out_data))
        except Exception:  # noqa: BLE001
            same = False
        roles[n] = "derived" if same else "state"
    return True, "", roles


# ------------------------------------------------------------- capture
def capture(model: Callable[..., Any], *args: Any, repeat: int = 1, backward: bool = False,
            check_recompute: bool = True, cost_model: str = "measured",
            batch_size: Optional[int] = None, name: Optional[str] = None,
            link: Optional[chainer.Link] = None, **kwargs: Any) -> Graph:
    """Run ``model(*args, **kwargs)`` once (``repeat`` times for timings)
    and record its computational graph.

    Args:
        model: a ``chainer.Link`` or any callable that applies Chainer
            functions and returns a ``chainer.Variable`` (or a tuple, list
            or dict holding one).
        *args, **kwargs: its inputs.
        repeat: forward passes to time; each function's time is the median.
        backward: also run one ``backward()`` from the first output to time
            each function's backward (gradients are restored afterwards).
        check_recompute: run each function once more to find what is safe to
            recompute (see the module docstring).
        cost_model: the returned graph's cost model (``measured``, ``flops``
            or ``paper``).
        batch_size: the batch size, for scaling; default: the leading
            dimension of the first array argument.
        name: a name for the graph (``meta['model']``).
        link: the Link whose state the forward may change (default:
            ``model`` itself, or the Link of a bound method); its persistent
            values and gradients are restored after the capture.

    Returns:
        The :class:`Graph`. The model's parameters, persistent values,
        gradients and NumPy's random state are as they were before.

    Raises:
        CaptureError: ``model`` is not callable, returns no Variable, or
            applies no function; a forward that raises is re-raised as is,
            with a note naming the function that was running.

    >>> import chainer.links as L, numpy as np
    >>> g = capture(L.Linear(3, 2), np.ones((4, 3), np.float32))
    >>> g.n, g.nodes[0].op, g.batch_size
    (1, 'LinearFunction', 4)
    """
    if not callable(model):
        raise CaptureError(f"capture needs a callable model (a chainer.Link or a function), "
                           f"got {type(model).__name__}")
    if not chainer.config.enable_backprop:
        raise CaptureError("capture runs with backprop disabled (chainer.no_backprop_mode?); "
                           "there is no graph to record: capture outside no_backprop_mode")
    if repeat < 1:
        raise CaptureError(f"repeat must be at least 1, got {repeat}")
    link = link if link is not None else _find_link(model)
    if link is None:
        logger.info("capture: %r is not a Link; persistent values of links it uses "
                    "cannot be restored after the capture forward", model)
    if batch_size is None:
        batch_size = batch_size_of(args, kwargs)
    external_ids = set()
    if link is not None:
        external_ids = {id(p.array) for p in link.params() if p.array is not None}
        for sub in link.links():
            for pname in getattr(sub, "_persistent", ()):
                v = getattr(sub, pname, None)
                if _is_array(v):
                    external_ids.add(id(v))

    state = _ModelState(link)
    runs: List[List[_Record]] = []
    try:
        first_hook: Optional[CaptureHook] = None
        result = None
        for i in range(repeat):
            hook = CaptureHook()
            try:
                with hook:
                    out = model(*args, **kwargs)
            except Exception as e:
                running = hook.interrupted
                last = (f" (last: {function_op(hook.records[-1].func)})"
                        if hook.records else "")
                where = (f"while running {function_op(running[-1].func)} (function "
                         f"#{len(hook.records)})" if running else
                         f"after {len(hook.records)} functions{last}")
                if hasattr(e, "add_note"):
                    e.add_note(f"chainer_recompute.capture: the model's forward raised {where}")
                raise
            runs.append(hook.records)
            if i == 0:
                first_hook, result = hook, out
            else:
                state.restore()
        assert first_hook is not None
        out_var = _first_variable(result)
        if out_var is None:
            raise CaptureError(f"the model returned {type(result).__name__}, not a "
                               f"chainer.Variable; capture needs the forward to return the "
                               f"loss (or an output) as a Variable")
        records = first_hook.records
        if not records:
            raise CaptureError("the model applied no Chainer function with backprop enabled; "
                               "nothing to capture")
        ops = [function_op(r.func) for r in first_hook.records]
        for k, other in enumerate(runs[1:], start=2):
            if [function_op(r.func) for r in other] != ops:
                from ..core.errors import GraphChangedError
                raise GraphChangedError(
                    f"forward pass {k} applied other functions than pass 1; the model's "
                    f"graph changes between calls with the same inputs, so it cannot be "
                    f"planned once: make the forward deterministic in structure")
        times = [statistics.median([run[j].times[0] for run in runs if j < len(run)])
                 for j in range(len(first_hook.records))]
        time_of = {id(r.func): t for r, t in zip(first_hook.records, times)}
        backward_times: Dict[int, float] = {}
        if backward:
            backward_times = _time_backward(out_var)
        graph = _build_graph(records, link, time_of, backward_times, check_recompute,
                             external_ids, batch_size, cost_model,
                             name or type(model).__name__)
    finally:
        state.restore()
    return graph


class _BackwardTimer(chainer.FunctionHook):
    name = "BackwardTimer"

    def __init__(self) -> None:
        self.start: Dict[int, float] = {}
        self.times: Dict[int, float] = {}

    def backward_preprocess(self, function, in_data, out_grad):
        _synchronize(in_data)
        self.start[id(function)] = time.perf_counter()

    def backward_postprocess(self, function, in_data, out_grad):
        _synchronize(in_data)
        t0 = self.start.pop(id(function), None)
        if t0 is not None:
            self.times[id(function)] = time.perf_counter() - t0


def _time_backward(out_var: chainer.Variable) -> Dict[int, float]:
    timer = _BackwardTimer()
    loss = out_var
    if loss.size != 1:
        loss = chainer.functions.sum(loss)
    with timer:
        loss.backward()
    return timer.times


def _build_graph(records: List[_Record], link: Optional[chainer.Link],
                 time_of: Dict[int, float], backward_times: Dict[int, float],
                 check_recompute: bool, external_ids: set, batch_size: Optional[int],
                 cost_model: str, name: str) -> Graph:
    param_name: Dict[int, str] = {}
    if link is not None:
        param_name = {id(p): path for path, p in link.namedparams()}
    arrays: List[ArrayInfo] = []
    array_of_node: Dict[int, int] = {}  # id(VariableNode) -> array id
    keep_alive: List[Any] = []  # VariableNodes whose ids we rely on

    def new_array(shape, dtype, nbytes, kind, producer, aname="") -> int:
        arrays.append(ArrayInfo(id=len(arrays), shape=tuple(shape), dtype=str(dtype),
                                nbytes=int(nbytes), kind=kind, producer=producer, name=aname))
        return len(arrays) - 1

    nodes: List[Node] = []
    consumed = set()
    for v, rec in enumerate(records):
        f = rec.func
        in_ids = []
        for xnode, x in zip(f.inputs, rec.in_data):
            key = id(xnode)
            if key not in array_of_node:
                var = xnode.get_variable_or_none()
                if var is not None and isinstance(var, chainer.Parameter):
                    kind, aname = "param", param_name.get(id(var), var.name or "")
                else:
                    kind, aname = "input", xnode.name or ""
                array_of_node[key] = new_array(x.shape, x.dtype, x.nbytes, kind, None, aname)
                keep_alive.append(xnode)
            in_ids.append(array_of_node[key])
            consumed.add(array_of_node[key])
        out_ids = []
        out_nodes = [ref() for ref in f.outputs]
        for k, y in enumerate(rec.out_data or ()):
            aid = new_array(y.shape, y.dtype, y.nbytes, "intermediate", v)
            ynode = out_nodes[k] if k < len(out_nodes) else None
            if ynode is not None:
                array_of_node[id(ynode)] = aid
                keep_alive.append(ynode)
            out_ids.append(aid)
        keep_in = f._input_indexes_to_retain or ()
        keep_out = f._output_indexes_to_retain or ()
        recomputable, reason, roles = True, "", {}
        if check_recompute:
            recomputable, reason, roles = analyse_recompute(
                f, rec.in_data, rec.out_data or (), external_ids)
        io_ids = {id(a) for a in rec.in_data + (rec.out_data or ())}
        held = []
        for owner, aname, a in attribute_arrays(f):
            role = roles.get(aname, "state")
            if id(a) in io_ids or (id(a) in external_ids and role != "written"):
                continue
            if role == "external":
                continue
            held.append(HeldArray(aname, tuple(a.shape), str(a.dtype), int(a.nbytes), role))
        attrs: Dict[str, Any] = {}
        if reason:
            attrs["unsafe_reason"] = reason
        nodes.append(Node(
            id=v, op=function_op(f), inputs=tuple(in_ids), outputs=tuple(out_ids),
            retained_inputs=tuple(in_ids[i] for i in keep_in),
            retained_outputs=tuple(out_ids[i] for i in keep_out),
            held=tuple(held), forward_time_s=time_of.get(id(f)),
            backward_time_s=backward_times.get(id(f)), recomputable=recomputable,
            label=f.label, attrs=attrs))
    final = []
    for a in arrays:
        if a.kind == "intermediate" and a.id not in consumed:
            a = ArrayInfo(a.id, a.shape, a.dtype, a.nbytes, "output", a.producer, a.name)
        final.append(a)
    return Graph(final, nodes, batch_size=batch_size, cost_model=cost_model,
                 meta={"model": name})
