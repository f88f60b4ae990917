"""Measuring a recurrent cell at the first call of a shape, for
:class:`~chainer_recompute.runtime.bptt.ChainRecompute`'s byte budgets: the
state and RNG slots, what a step's graph keeps, the transients of a step's
forward and backward, and the step's graph with the gradient buffers each
function's backward makes (:func:`measure_step`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Tuple

from . import _chainer  # noqa: F401
from ._chainer import param_grad
import chainer
from chainer import backend

from ..core.solvers import chain as chain_solver
from ..core.solvers.chain import ByteSizes
from .bptt_cell import _Cell, _graph_params, _leaves, _nbytes
from .device import RandomStates
from .memory import MemoryMeter

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------
# Measuring a cell.

def _meter(cell: "_Cell") -> MemoryMeter:
    return cell.device.meter()


def recurrent_mask(cell: _Cell, k: int, state_arrays: Tuple[Any, ...]) -> Tuple[bool, ...]:
    """Which entries of the state step ``k`` reads (an attribute it only
    writes, such as ``L.Classifier``'s ``y``, is an output, not state)."""
    rng = RandomStates.save()
    implicit_state = None if cell.explicit else cell.get_state()
    try:
        inputs = _leaves(state_arrays)
        with chainer.using_config("enable_backprop", True), cell.extra_runs():
            loss, outputs = cell.run(k, inputs)
        seen, stack = set(), [v.node for v in (loss,) + tuple(outputs)
                              if isinstance(v, chainer.Variable)]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.creator_node is not None:
                stack.extend(node.creator_node.inputs)
        return tuple(v is not None and id(v.node) in seen for v in inputs)
    finally:
        RandomStates.restore(rng)
        if implicit_state is not None:
            cell.set_state(implicit_state)


def measure_step(cell: _Cell, k: int, state_arrays: Tuple[Any, ...]) -> ByteSizes:
    """Measure step ``k`` of ``cell`` from ``state_arrays`` (leaving no
    trace: the RNG, the links' state and the parameter gradients are put
    back).

    Returns:
        The :class:`ByteSizes` of one step.
    """
    return _measure(cell, k, state_arrays).sizes


@dataclasses.dataclass
class _Measured:
    sizes: ByteSizes
    graph: Optional[chain_solver.StepGraph]
    params: List[chainer.Parameter]


def _measure(cell: _Cell, k: int, state_arrays: Tuple[Any, ...]) -> _Measured:
    # (one tracing session for the measurements below; the runs of step k
    # there are extra: its persistent values are put back after them)
    with cell.extra_runs(), _meter(cell):
        return _measure_step(cell, k, state_arrays)


def _base(a: Any) -> Any:
    while getattr(a, "base", None) is not None:
        a = a.base
    return a


class _BackpropRecorder:
    """Records, for each function a backward runs, the gradients it makes
    (their bytes, or which output gradient they are) and its peak, by
    wrapping Chainer's ``_backprop_utils.backprop_step`` for the length of
    a ``with`` block."""

    def __init__(self, cell: "_Cell") -> None:
        self.cell = cell
        self.records: Dict[int, Tuple[Tuple[int, ...], Tuple[int, ...], int]] = {}

    def __enter__(self) -> "_BackpropRecorder":
        from chainer import _backprop_utils
        self._module = _backprop_utils
        self._orig = orig = _backprop_utils.backprop_step
        records = self.records
        cell = self.cell

        def step(func: Any, target_input_indexes: Any, grad_outputs: Any, grad_inputs: Any,
                 is_debug: Any) -> Any:
            with _meter(cell) as m:
                out = orig(func, target_input_indexes, grad_outputs, grad_inputs, is_debug)
            gys = [None if g is None else _base(g.raw_array) for g in grad_outputs]
            n = len(func.inputs)
            grads, shares = [0] * n, [-1] * n
            done = set()
            for i in target_input_indexes:
                x = func.inputs[i]
                if id(x) in done:
                    continue
                done.add(id(x))
                lst = grad_inputs.get(x)
                gx = lst[0] if lst else None
                if gx is None:
                    continue
                arr = gx.raw_array
                b = _base(arr)
                same = [j for j, gy in enumerate(gys) if gy is not None and gy is b]
                if same:
                    shares[i] = same[0]
                else:
                    grads[i] = int(getattr(arr, "nbytes", 0) or 0)
            records[id(func)] = (tuple(grads), tuple(shares), int(m.result.peak_bytes))
            return out

        _backprop_utils.backprop_step = step
        return self

    def __exit__(self, *exc: Any) -> None:
        self._module.backprop_step = self._orig


def _step_graph(loss: chainer.Variable, inputs: Tuple[Any, ...], outputs: Tuple[Any, ...],
                records: Dict[int, Tuple[Tuple[int, ...], Tuple[int, ...], int]]
                ) -> chain_solver.StepGraph:
    """The recorded step as a :class:`~chainer_recompute.core.solvers.chain.StepGraph`."""
    heads = [loss] + [v for v in outputs if isinstance(v, chainer.Variable)]
    funcs: Dict[int, Any] = {}
    stack = [v.node.creator_node for v in heads if v.node.creator_node is not None]
    while stack:
        f = stack.pop()
        if id(f) in funcs:
            continue
        funcs[id(f)] = f
        stack.extend(x.creator_node for x in f.inputs if x.creator_node is not None)
    order = sorted(funcs.values(), key=lambda f: f.rank)
    state_nodes = {id(v.node): j for j, v in enumerate(inputs) if isinstance(v, chainer.Variable)}
    index: Dict[int, int] = {}
    kinds: List[str] = []
    state_index: List[int] = []
    creator: List[int] = []
    f_index = {id(f): i for i, f in enumerate(order)}

    def var(node: Any) -> int:
        key = id(node)
        if key not in index:
            index[key] = len(kinds)
            c = node.creator_node
            if key in state_nodes:
                kinds.append("state")
            elif c is not None and id(c) in f_index:
                kinds.append("inner")
            elif isinstance(node.get_variable_or_none(), chainer.Parameter):
                kinds.append("param")
            else:
                kinds.append("leaf")
            state_index.append(state_nodes.get(key, -1))
            creator.append(f_index[id(c)] if kinds[-1] == "inner" else -1)
        return index[key]

    functions = []
    for f in order:
        ins = tuple(var(x) for x in f.inputs)
        outs = tuple(-1 if y() is None else var(y()) for y in f.outputs)
        grads, shares, peak = records.get(id(f), ((0,) * len(ins), (-1,) * len(ins), 0))
        functions.append(chain_solver.StepFunction(getattr(f, "label", type(f).__name__), ins,
                                                   outs, grads, shares, peak))
    out_states = tuple(var(v.node) if isinstance(v, chainer.Variable) else -1 for v in outputs)
    return chain_solver.StepGraph(tuple(functions), tuple(kinds), tuple(state_index),
                                  tuple(creator), out_states, var(loss.node))


@dataclasses.dataclass(frozen=True)
class _NaNGrad:
    """A parameter gradient that is Chainer's initial NaN fill."""

    shape: Tuple[int, ...]
    dtype: Any
    xp: Any

    def make(self) -> chainer.Variable:
        return chainer.Variable(self.xp.full(self.shape, self.xp.nan, dtype=self.dtype))


def _never_written(a: Any) -> bool:
    """Whether a gradient is Chainer's initial NaN fill (a float array
    whose every entry is NaN)."""
    xp = backend.get_array_module(a)
    if a.size == 0 or a.dtype.kind != "f" or not bool(xp.isnan(a.ravel()[0])):
        return False
    return bool(xp.isnan(a).all())


def _measure_step(cell: _Cell, k: int, state_arrays: Tuple[Any, ...]) -> _Measured:
    rng = RandomStates.save()
    implicit_state = None if cell.explicit else cell.get_state()
    implicit_outputs = [(link, name, getattr(link, name)) for link, name in cell.out_keys]
    saved_grads: List[Tuple[chainer.Parameter, Any]] = []
    try:
        with _meter(cell) as m_rng:
            snap = RandomStates.save()
        rng_bytes = max(m_rng.result.end_bytes - m_rng.result.start_bytes, 0)
        del snap
        state_bytes = _nbytes(state_arrays)
        # a step without a graph
        with chainer.no_backprop_mode():
            with _meter(cell) as m_adv:
                loss, out = cell.run(k, _leaves(state_arrays))
            advance_peak = m_adv.result.peak_bytes
            del loss, out
        RandomStates.restore(rng)
        # a step with its graph, from copies of the state (to see what it keeps of
        # them); the model's outputs and state of the step before are let go first,
        # so that their release does not hide what the step keeps
        for link, name in cell.out_keys:
            setattr(link, name, None)
        if not cell.explicit:
            cell.set_state(_leaves(state_arrays))
        with _meter(cell) as m_copy:
            copies = tuple(None if a is None else a.copy() for a in state_arrays)
            inputs = _leaves(copies)
        with chainer.using_config("enable_backprop", True):
            with _meter(cell) as m_keep:
                loss, outputs = cell.run(k, inputs)
        out_bytes = _nbytes([v for v in outputs if v is not None])
        keep_peak = m_keep.result.peak_bytes
        # the model's outputs (L.Classifier's y): what of them the graph holds too
        outputs_bytes = shared = 0
        if not cell.explicit and cell.out_keys:
            held = [(link, name, getattr(link, name)) for link, name in cell.out_keys]
            outputs_bytes = _nbytes([v for _, _, v in held if isinstance(v, chainer.Variable)])
            with _meter(cell) as m_out:
                for link, name, _ in held:
                    setattr(link, name, None)
                del held
            shared = min(max(outputs_bytes + m_out.result.retained_bytes, 0), outputs_bytes)
        # what the graph keeps besides the states (the outputs it shares included)
        internal = max(m_keep.result.retained_bytes - out_bytes - (outputs_bytes - shared), 0)
        params = _graph_params([loss] + [v for v in outputs if isinstance(v, chainer.Variable)])
        # their gradients are put aside for the measurement; Chainer's initial
        # NaN fill (a parameter never backpropagated) is let go and made again
        # after, so that a first call does not hold two sets of gradients
        for p in params:
            g = p.grad_var
            if g is not None and _never_written(g.array):
                saved_grads.append((p, _NaNGrad(g.shape, g.dtype, backend.get_array_module(g.array))))
            else:
                saved_grads.append((p, g))
            del g
            p.grad_var = None
        outs = [loss] + [v for v in outputs if isinstance(v, chainer.Variable)]
        grads = [chainer.Variable(v.xp.ones_like(v.array)) for v in outs]
        with _meter(cell) as m_b1:
            chainer.backward(outs, grads)
        param_bytes = _nbytes([g for g in map(param_grad, params) if g is not None])
        grad_bytes = _nbytes([v.grad for v in inputs if v is not None and v.grad is not None])
        for v in inputs:
            if v is not None:
                v.grad_var = None
        # again, with the parameter gradients accumulating (as in every
        # backward but the first), recording each function's gradients
        graph = None
        with _BackpropRecorder(cell) as rec:
            with _meter(cell) as m_b2:
                chainer.backward(outs, grads)
        try:
            graph = _step_graph(loss, inputs, tuple(outputs), rec.records)
        except Exception as e:  # pragma: no cover - a graph we cannot read
            logger.info("could not record the step's graph (%s); plain BPTT's peak is "
                        "predicted without Chainer's backward order", e)
        del grads, outs
        for p, g in saved_grads:
            p.grad_var = g.make() if isinstance(g, _NaNGrad) else g
        saved_grads = []
        for v in inputs:
            if v is not None:
                v.grad_var = None
        del inputs, copies
        with _meter(cell) as m_now:
            pass
        retained_input = max(m_now.result.start_bytes - m_copy.result.start_bytes - internal
                             - out_bytes, 0)
        del loss, outputs
        sizes = ByteSizes(state=state_bytes, rng=rng_bytes, internal=internal,
                          outputs=outputs_bytes, outputs_shared=min(shared, outputs_bytes),
                          retained_input=min(retained_input, state_bytes), grad=grad_bytes,
                          param_grads=param_bytes, advance_peak=advance_peak,
                          keep_peak=keep_peak, backward_peak=m_b2.result.peak_bytes,
                          first_backward_peak=m_b1.result.peak_bytes)
        return _Measured(sizes, graph, params)
    finally:
        for p, g in saved_grads:
            p.grad_var = g.make() if isinstance(g, _NaNGrad) else g
        RandomStates.restore(rng)
        if implicit_state is not None:
            cell.set_state(implicit_state)
        for link, name, value in implicit_outputs:
            setattr(link, name, value)
