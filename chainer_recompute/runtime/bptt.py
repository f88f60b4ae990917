"""Truncated BPTT under Gruslys et al.'s chain policies: a recurrent step
function run ``t`` times, with only checkpoints kept in the forward pass
and each step's graph rebuilt during backward.

Chainer's PTB example accumulates the loss of ``bprop_len`` calls of a
stateful model (``L.LSTM`` keeps ``h`` and ``c``), calls ``backward()``
once, then ``unchain_backward()``. With :class:`ChainRecompute` the loop
becomes one call::

    runner = ChainRecompute(model, policy='msm', budget='16M')
    loss = runner(xs, ts)            # step k calls model(xs[k], ts[k])
    model.cleargrads()
    loss.backward()                  # recomputes, as the policy dictates
    loss.unchain_backward()
    optimizer.update()

How it runs:

- the forward pass runs every step once without building a graph
  (``no_backprop_mode``), keeping only the checkpoints the policy stores:
  the recurrent state with the random states (so dropout draws the same
  masks when a step runs again), or a step's whole graph (ISM/MSM);
- the returned loss is the sum of the step losses, added in the order the
  loop adds them; its ``backward()`` walks the policy's schedule
  (:func:`chainer_recompute.core.solvers.chain.schedule`): it reruns
  segments from their checkpoints, rebuilds one step's graph at a time
  and backpropagates it with the state's gradient from the step after;
  parameter gradients accumulate step by step, last step first, as in
  plain backprop;
- afterwards the model's state is the final state of the forward pass and
  the random states are where they were before ``backward()``.

The recurrent state is either held by the model's links (``L.LSTM``'s
``h``/``c``, any non-parameter Variable attribute a step replaces: the
call has no ``state=``), or passed explicitly (``state=``: the step is
``step(state, *args) -> (loss, new_state)``, e.g. around
``L.NStepLSTM``; the call returns ``(loss, final_state)``).

Sizes are measured on the cell at the first call of a shape: a hidden
slot (the state and its RNG state), the internal state of a step (what its
graph keeps, the model's outputs it shares included), transients of a
step's forward and backward, parameter gradients, and the step's graph with
the gradients each function's backward makes (for plain BPTT's peak). A
byte budget picks the largest number of slots whose peak, simulated event
by event (:func:`chainer_recompute.core.solvers.chain.simulate_bytes`),
fits with 1% of headroom. By default (``budget_scope='total'``, as
``apply()``) the budget covers the whole iteration: parameters, their
gradients, optimizer state, the inputs, the recurrent state and everything
the call adds up to the optimizer update; ``'call'`` covers only what the
call adds. The first calls of a plan are measured (NumPy: tracemalloc; CuPy:
the memory pool); a
peak over the budget corrects the prediction for the next call. Plain
BPTT's peak is predicted by replaying Chainer's backward order over the
whole unroll (:func:`chainer_recompute.core.solvers.chain.plain_peak_bytes`):
Chainer keeps every graph to the end and runs the functions that do not
depend on the state (the embedding, the first layer's input projection)
last, while their output gradients wait.

Limits: the state's gradient is combined with the gradients from inside a
step in Chainer's order, which is the plain graph's whenever a state feeds
at most two functions (true of ``L.LSTM``, ``L.NStepLSTM``); a parameter
used at two different depths of one step (tied input and output
embeddings) accumulates its gradient in another order than plain
backprop's (equal to rounding). On CuPy, whose generators cannot be read
or set, a call tapes CuPy's draws (:func:`~chainer_recompute.runtime.device.recording_random`)
and serves them again to a step run from a checkpoint: the tape holds the
call's draws on the device until its backward ends.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from . import _chainer  # noqa: F401
import chainer
from chainer import backend

from ..core.budget import MARGIN
from ..core.errors import BudgetError, GraphError, InfeasibleBudgetError, RecomputeError
from ..core.solvers import chain as chain_solver
from ..core.solvers.chain import ByteSizes
from ..core.units import format_bytes, parse_bytes
from .capture import state_bytes
from .device import RandomStates, device_of, recording_random
from .memory import MemoryMeasurement, MemoryMeter

#: Accepted ``budget_scope`` values of :class:`ChainRecompute`.
SCOPES = ("total", "call")

logger = logging.getLogger(__name__)

__all__ = ["ChainRecompute", "BPTTStats", "measure_step"]

_NO_STATE = object()


@dataclasses.dataclass
class BPTTStats:
    """What one call planned and predicted.

    Attributes:
        policy: ``'hsm'``, ``'ism'``, ``'msm'`` or ``'revolve'``.
        t: steps.
        slots: slots used (hidden-state units).
        alpha: slots of an internal state.
        forward_steps: steps run in all (plain BPTT: ``t``).
        predicted_peak_bytes: the schedule's peak, simulated event by
            event (:func:`~chainer_recompute.core.solvers.chain.simulate_bytes`),
            in the budget's scope: with ``'total'``, ``constant_bytes`` and
            the call's own peak (to the optimizer update); with ``'call'``,
            the call's own peak above the bytes live at its start.
        plain_peak_bytes: the same for plain BPTT, as Chainer runs it
            (:func:`~chainer_recompute.core.solvers.chain.plain_peak_bytes`).
        budget_bytes: the budget asked, or None.
        sizes: the measured :class:`ByteSizes`.
        table_time_s: seconds spent building tables for this plan.
        plan_time_s: seconds spent measuring the cell and choosing the
            slots for this plan (a call that reuses a plan spends none).
        budget_scope: ``'total'`` or ``'call'``.
        constant_bytes: in the total scope, the bytes live at the call that
            the budget covers (parameters, optimizer state, inputs, the start
            state, the previous gradients and outputs).
        correction_bytes: added to predictions after a measured overshoot.
        measured_peak_bytes: the call's peak measured from the call to the
            end of its backward (in the budget's scope; the first calls of
            a plan only), else None.
    """

    policy: str
    t: int
    slots: int
    alpha: int
    forward_steps: int
    predicted_peak_bytes: int
    plain_peak_bytes: int
    budget_bytes: Optional[int]
    sizes: ByteSizes
    table_time_s: float = 0.0
    plan_time_s: float = 0.0
    budget_scope: str = "total"
    constant_bytes: int = 0
    correction_bytes: int = 0
    measured_peak_bytes: Optional[int] = None


# --------------------------------------------------------------------------
# State helpers.

def _arrays(state: Tuple[Any, ...]) -> Tuple[Any, ...]:
    return tuple(None if v is None else (v.array if isinstance(v, chainer.Variable) else v)
                 for v in state)


def _leaves(arrays: Tuple[Any, ...]) -> Tuple[Optional[chainer.Variable], ...]:
    return tuple(None if a is None else chainer.Variable(a, requires_grad=True) for a in arrays)


def _nbytes(arrays: Any) -> int:
    total = 0
    for a in arrays:
        if isinstance(a, chainer.Variable):
            a = a.array
        total += int(getattr(a, "nbytes", 0) or 0)
    return total


def _detached(v: Any) -> Any:
    return chainer.Variable(v.array) if isinstance(v, chainer.Variable) else v


def _iter_arrays(x: Any) -> Any:
    """The arrays in nested sequences of per-step inputs."""
    if isinstance(x, chainer.Variable):
        x = x.array
    if hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "nbytes"):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _iter_arrays(y)


def _input_bytes(seqs: Sequence[Any]) -> int:
    """Bytes of the per-step inputs, each buffer once (views of one array
    count their base)."""
    seen, total = set(), 0
    for a in _iter_arrays(list(seqs)):
        b = a
        while getattr(b, "base", None) is not None and hasattr(b.base, "nbytes"):
            b = b.base
        if id(b) not in seen:
            seen.add(id(b))
            total += int(b.nbytes)
    return total


def _config_snapshot() -> Dict[str, Any]:
    local = getattr(chainer.config, "_local", None)
    values = dict(vars(local)) if local is not None else {}
    values["train"] = chainer.config.train
    values.pop("enable_backprop", None)
    return values


class _Configured:
    def __init__(self, values: Dict[str, Any], **extra: Any) -> None:
        self.values = dict(values, **extra)
        self.contexts: List[Any] = []

    def __enter__(self) -> None:
        for k, v in self.values.items():
            ctx = chainer.using_config(k, v)
            ctx.__enter__()
            self.contexts.append(ctx)

    def __exit__(self, *exc: Any) -> None:
        while self.contexts:
            self.contexts.pop().__exit__(*exc)


def _graph_params(outputs: Sequence[chainer.Variable]) -> List[chainer.Parameter]:
    """Parameters that are leaves of the graph of ``outputs``."""
    seen, found, stack = set(), [], [v.node for v in outputs if v is not None]
    while stack:
        node = stack.pop()
        func = node.creator_node
        if func is None:
            var = node.get_variable_or_none()
            if isinstance(var, chainer.Parameter) and id(var) not in seen:
                seen.add(id(var))
                found.append(var)
            continue
        if id(func) in seen:
            continue
        seen.add(id(func))
        stack.extend(func.inputs)
    return found


# --------------------------------------------------------------------------
# One call.

class _Cell:
    """Runs one step of the user's cell from a given state."""

    def __init__(self, step: Callable[..., Any], model: Optional[chainer.Link],
                 seqs: Sequence[Sequence[Any]], explicit: bool) -> None:
        self.step = step
        self.model = model
        self.seqs = seqs
        self.explicit = explicit
        self.device = device_of(list(_iter_arrays(seqs)))
        self.keys: List[Tuple[chainer.Link, str]] = []
        self.out_keys: List[Tuple[chainer.Link, str]] = []
        self.structure: Any = tuple

    # implicit state: attributes of the links
    def candidates(self) -> Dict[Tuple[int, str], Tuple[chainer.Link, str, Any]]:
        out = {}
        assert self.model is not None
        for link in self.model.links():
            for name, value in vars(link).items():
                if value is None or (isinstance(value, chainer.Variable)
                                     and not isinstance(value, chainer.Parameter)):
                    out[(id(link), name)] = (link, name, value)
        return out

    def set_state(self, state: Tuple[Any, ...]) -> None:
        for (link, name), v in zip(self.keys, state):
            setattr(link, name, v)

    def get_state(self) -> Tuple[Any, ...]:
        return tuple(getattr(link, name) for link, name in self.keys)

    def run(self, k: int, state: Optional[Tuple[Any, ...]]) -> Tuple[chainer.Variable, Tuple[Any, ...]]:
        """Step ``k`` from ``state`` (Variables, or None: the links as they are)."""
        args = tuple(seq[k] for seq in self.seqs)
        if self.explicit:
            out = self.step(self.pack(state), *args)
            if not isinstance(out, tuple) or len(out) != 2:
                raise RecomputeError("with state=, the step must return (loss, new_state); "
                                     f"it returned {type(out).__name__}")
            loss, new_state = out
            return self.check_loss(loss), self.unpack(new_state)
        if state is not None:
            self.set_state(state)
        return self.check_loss(self.step(*args)), self.get_state()

    @staticmethod
    def check_loss(loss: Any) -> chainer.Variable:
        if not isinstance(loss, chainer.Variable) or loss.size != 1:
            raise RecomputeError("the step must return its loss as a scalar Variable (as "
                                 "L.Classifier does); got "
                                 f"{type(loss).__name__}{getattr(loss, 'shape', '')}")
        return loss

    def unpack(self, state: Any) -> Tuple[Any, ...]:
        if isinstance(state, (tuple, list)):
            self.structure = type(state)
            return tuple(state)
        self.structure = None
        return (state,)

    def pack(self, state: Optional[Tuple[Any, ...]]) -> Any:
        if state is None:
            return None
        if self.structure is None:
            return state[0]
        return self.structure(state)


class _Run:
    """The forward pass and, later, the backward of one call."""

    def __init__(self, runner: "ChainRecompute", cell: _Cell, t: int,
                 state0: Tuple[Any, ...]) -> None:
        self.runner = runner
        self.cell = cell
        self.t = t
        self.config = _config_snapshot()
        self.ckpts: Dict[int, Tuple[Tuple[Any, ...], Any]] = {}
        self.kept: Dict[int, Tuple[chainer.Variable, Tuple[Any, ...], Tuple[Any, ...]]] = {}
        self.running_pos: Optional[int] = 0
        self.running: Tuple[Any, ...] = _arrays(state0)
        self.state0_arrays = self.running
        self.rng0 = RandomStates.save()
        runner._recording_claimed = True  # closed when this run's backward ends
        self.next_first = 0  # next step whose loss is added to the total
        self.total: Any = None
        self.ops: Any = None
        self.pending: Optional[Tuple] = None  # the op the forward pass stopped in
        self.grad: Tuple[Any, ...] = ()
        self.gy: Any = None
        self.final_state: Tuple[Any, ...] = ()
        self.done = False
        self.computed_steps = 0
        self.final_outputs: List[Tuple[chainer.Link, str, Any]] = []

    # -- steps ---------------------------------------------------------
    def _add_loss(self, k: int, loss: chainer.Variable) -> None:
        if k == self.next_first:
            arr = loss.array
            self.total = chainer.utils.force_array(arr + arr.dtype.type(0)) if self.total is None \
                else chainer.utils.force_array(self.total + arr)
            self.next_first += 1

    def advance(self, a: int, b: int, restored: bool) -> None:
        assert self.running_pos == a, (self.running_pos, a)
        state: Optional[Tuple[Any, ...]] = (_leaves(self.running)
                                             if restored or self.cell.explicit else None)
        with chainer.no_backprop_mode():
            for k in range(a, b):
                loss, new = self.cell.run(k, state)
                self._add_loss(k, loss)
                del loss
                state = new if self.cell.explicit else None
                self.computed_steps += 1
                self.running = _arrays(new)
        self.running_pos = b

    def keep(self, k: int) -> None:
        assert self.running_pos == k, (self.running_pos, k)
        inputs = _leaves(self.running)
        with chainer.using_config("enable_backprop", True):
            loss, outputs = self.cell.run(k, inputs)
        self._add_loss(k, loss)
        self.computed_steps += 1
        self.kept[k] = (loss, inputs, outputs)
        self.running = _arrays(outputs)
        self.running_pos = k + 1
        if k + 1 == self.t and not self.final_state:
            self.final_state = outputs

    def backward(self, k: int) -> None:
        loss, inputs, outputs = self.kept.pop(k)
        outs, grads = [loss], [self.gy]
        for v, g in zip(outputs, self.grad or (None,) * len(outputs)):
            if v is not None and g is not None and isinstance(v, chainer.Variable):
                outs.append(v)
                grads.append(g)
        chainer.backward(outs, grads)
        self.grad = tuple(None if v is None else v.grad_var for v in inputs)
        del loss, inputs, outputs, outs, grads
        self.running_pos = None
        self.running = ()

    def execute(self, op: Tuple, restored: bool) -> bool:
        """Run one operation; returns whether the running state was restored."""
        name = op[0]
        if name == "advance":
            self.advance(op[1], op[2], restored)
            return False
        if name == "store":
            assert self.running_pos == op[1]
            self.ckpts[op[1]] = (self.running, RandomStates.save())
            return restored
        if name == "restore":
            arrays, rng = self.ckpts[op[1]]
            self.running, self.running_pos = arrays, op[1]
            RandomStates.restore(rng)
            return True
        if name == "free":
            del self.ckpts[op[1]]
            return restored
        if name == "keep":
            self.keep(op[1])
            return False
        if name == "backward":
            self.backward(op[1])
            return False
        if name == "leaf":
            self.keep(op[1])
            self.backward(op[1])
            return False
        raise RecomputeError(f"unknown chain operation {op!r}")  # pragma: no cover

    # -- phases --------------------------------------------------------
    def forward(self, ops: Any) -> None:
        """Run the schedule up to its first backward (the forward pass)."""
        self.ops = ops
        restored = True
        for op in ops:
            if op[0] == "store" and op[1] == 0:
                self.ckpts[0] = (self.state0_arrays, self.rng0)
                continue
            if op[0] == "advance" and self.skip_first and op[1] == 0:
                # step 0 already ran (to measure the cell): go on from step 1
                self.skip_first = False
                if op[2] > 1:
                    self.advance(1, op[2], restored=False)
                restored = False
                continue
            if self.skip_first and op[0] in ("keep", "leaf") and op[1] == 0:
                # it must build its graph: run step 0 again from the start
                self.skip_first = False
                self.running, self.running_pos = self.state0_arrays, 0
                RandomStates.restore(self.rng0)
                restored = True
            if op[0] in ("leaf", "backward"):
                if op[0] == "leaf":
                    self.keep(op[1])
                self.pending = op
                break
            restored = self.execute(op, restored)
        if not self.final_state:  # pragma: no cover
            raise RecomputeError("internal error: the forward pass did not reach the last step")
        if self.next_first != self.t:  # pragma: no cover
            raise RecomputeError("internal error: the forward pass skipped a step")

    skip_first = False
    meter: Any = None
    grads_before = 0
    forward_peak: Optional[int] = None
    stats: Optional["BPTTStats"] = None

    def backward_all(self, gy: Any) -> None:
        if self.done:
            raise RecomputeError("this loss was already backpropagated: its checkpoints are "
                                 "consumed; run the forward again (plain Chainer would also "
                                 "need retain_graph semantics here)")
        self.gy = gy
        runner = self.runner
        if self.stats is not None and self.stats.sizes.param_grads:
            # whether the loop clears the gradients before backward() (the
            # PTB example does); learnt for the next plans
            if self.grads_before:
                runner._grads_cleared = not any(p.grad is not None for p in runner._params())
        meter = self.cell.device.meter() if self.meter is not None else None
        rng_before = RandomStates.save()
        ok = False
        try:
            if meter is not None:
                meter.start()
            with _Configured(self.config, in_recomputing=True):
                op = self.pending
                assert op is not None
                self.backward(op[1])
                restored = False
                for op in self.ops:
                    restored = self.execute(op, restored)
            ok = True
        finally:
            if meter is not None:
                self.grad = ()
                self.gy = None
                meter.stop()
                runner._finish_check(self, meter.result if ok else None)
            self.done = True
            RandomStates.restore(rng_before)
            runner._close_tape()
            if not self.cell.explicit:
                self.cell.set_state(self.final_state)
                for link, name, value in self.final_outputs:
                    setattr(link, name, value)
            self.kept.clear()
            self.ckpts.clear()
            self.running = ()
            self.grad = ()


@dataclasses.dataclass
class _Check:
    """The measurement of one call (see ``ChainRecompute.check_calls``)."""

    meter: MemoryMeter
    owns: bool = False
    start_bytes: int = 0
    tables: int = 0
    grads: List[Tuple[Any, int]] = dataclasses.field(default_factory=list)
    outputs: List[Tuple[Any, int]] = dataclasses.field(default_factory=list)
    plan_key: Hashable = None
    stats: Optional["BPTTStats"] = None
    host_tables: bool = True


class _LossNode(chainer.FunctionNode):
    """The summed loss; its backward runs the policy's backward pass."""

    def __init__(self, run: _Run) -> None:
        super().__init__()
        self.run = run

    def forward(self, inputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        return (self.run.total,)

    def backward(self, indexes: Tuple[int, ...], grad_outputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        run, self.run = self.run, None
        if run is None:
            raise RecomputeError("this loss was already backpropagated: its checkpoints are "
                                 "consumed; run the forward again")
        run.backward_all(grad_outputs[0])
        return (None,)


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
        with chainer.using_config("enable_backprop", True):
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
    with _meter(cell):  # one tracing session for the measurements below
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
        param_bytes = _nbytes([p.grad for p in params if p.grad is not None])
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


# --------------------------------------------------------------------------
# The public runner.

class ChainRecompute:
    """Run a truncated-BPTT loop under a chain policy.

    Args:
        step: the cell, called once per step: ``step(*args_k)`` returning
            the step's loss (state in the model's links), or, when calls
            pass ``state=``, ``step(state, *args_k) -> (loss, new_state)``.
        policy: ``'msm'`` (default), ``'hsm'``, ``'ism'`` or ``'revolve'``.
        slots: memory in hidden-state slots (the start state's included).
        budget: memory in bytes (``'16M'``, an int, ...; see
            :func:`chainer_recompute.parse_bytes`), or ``'least'``: the
            largest number of slots whose predicted peak fits (with 1% of
            headroom, as ``apply()`` keeps), or the fewest slots the policy
            can run with. Give ``slots`` or ``budget``.
        budget_scope: what the budget bounds. ``'total'`` (default, as
            ``apply()``): the whole training iteration, from the call to the
            optimizer update: parameters, their gradients (the previous
            iteration's too while they are alive), optimizer state, the
            per-step inputs, the recurrent state, checkpoints and their RNG
            states, the steps' graphs, gradients and temporaries. ``'call'``:
            only what the call, its backward and the update add above the
            bytes live when the call starts. Host-side planning tables
            (:func:`~chainer_recompute.core.solvers.chain.chain_table`) are
            in neither.
        model: the Link that holds the recurrent state and the parameters
            (default: ``step`` when it is a Link).
        check_calls: the first calls of each shape are measured (NumPy:
            tracemalloc, from the call to the end of its backward); a
            measured peak over the budget warns, corrects the prediction by
            the difference and plans again for the next call. 0: never.

    Attributes:
        last_stats: :class:`BPTTStats` of the last call.

    Raises:
        BudgetError: neither or both of ``slots`` and ``budget``; a budget
            that cannot be read; slots out of range (on the call).
        InfeasibleBudgetError: a budget below the least this policy needs
            for one step (on the call; the message gives that figure).

    >>> import numpy as np, chainer, chainer.links as L, chainer.functions as F
    >>> class LM(chainer.Chain):
    ...     def __init__(self):
    ...         super().__init__()
    ...         with self.init_scope():
    ...             self.embed = L.EmbedID(20, 8); self.rnn = L.LSTM(8, 8); self.out = L.Linear(8, 20)
    ...     def forward(self, x, t):
    ...         return F.softmax_cross_entropy(self.out(F.dropout(self.rnn(self.embed(x)))), t)
    >>> model = LM()
    >>> runner = ChainRecompute(model, policy='hsm', slots=3)
    >>> xs = np.random.randint(0, 20, (12, 4)).astype(np.int32)
    >>> loss = runner(xs[:-1], xs[1:])            # 11 steps
    >>> model.cleargrads(); loss.backward(); loss.unchain_backward()
    >>> runner.last_stats.forward_steps           # plain BPTT: 11
    29
    """

    def __init__(self, step: Callable[..., Any], *, policy: str = "msm",
                 slots: Optional[int] = None, budget: Any = None,
                 budget_scope: str = "total", model: Optional[chainer.Link] = None,
                 check_calls: int = 2) -> None:
        if policy not in chain_solver.POLICIES:
            from ..core.errors import UnknownSolverError
            raise UnknownSolverError(f"unknown chain policy {policy!r}; known: "
                                     f"{sorted(chain_solver.POLICIES)}")
        if (slots is None) == (budget is None):
            raise BudgetError("give either slots= (hidden-state slots) or budget= (bytes, "
                              "e.g. '16M', or 'least'), not "
                              + ("both" if slots is not None else "neither"))
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, (int, np.integer))
                                  or slots < 1):
            raise BudgetError(f"slots={slots!r}: give a positive number of hidden-state slots")
        if budget_scope not in SCOPES:
            raise BudgetError(f"unknown budget_scope {budget_scope!r}; accepted: {list(SCOPES)} "
                              f"('total': the whole iteration, parameters and optimizer state "
                              f"included; 'call': what the call adds above the bytes live at "
                              f"its start)")
        self.step = step
        self.policy = policy
        self.slots = None if slots is None else int(slots)
        self.budget_least = isinstance(budget, str) and budget.strip().lower() == "least"
        self.budget_bytes = None if budget is None or self.budget_least else parse_bytes(budget)
        self.budget_scope = budget_scope
        self.check_calls = int(check_calls)
        self.model = model if model is not None else (step if isinstance(step, chainer.Link) else None)
        self._sizes: Dict[Hashable, Tuple[_Measured, Tuple[bool, ...]]] = {}
        self._plans: Dict[Hashable, BPTTStats] = {}
        self._checked: Dict[Hashable, int] = {}
        self._need_check = True
        self._open_meter: Optional[MemoryMeter] = None
        self._correction: Dict[Hashable, int] = {}
        self._grads_cleared = True
        self._warned_over = False
        self._error: Optional[Exception] = None
        self.last_stats: Optional[BPTTStats] = None

    # ------------------------------------------------------------------
    def __call__(self, *seqs: Sequence[Any], state: Any = _NO_STATE) -> Any:
        """Run the ``t`` steps (step ``k`` gets ``seqs[0][k], seqs[1][k], ...``).

        Returns:
            The summed loss (a Variable whose ``backward()`` recomputes);
            with ``state=``, ``(loss, final_state)``.
        """
        explicit = state is not _NO_STATE
        if not seqs:
            raise GraphError("give the per-step inputs: runner(xs, ts), step k gets xs[k], ts[k]")
        t = len(seqs[0])
        if any(len(s) != t for s in seqs):
            raise GraphError(f"the per-step sequences differ in length: {[len(s) for s in seqs]}")
        if t < 1:
            raise GraphError("t=0 steps: nothing to run; give at least one step")
        if not explicit and self.model is None:
            raise RecomputeError("the recurrent state lives in the model's links: pass model= "
                                 "(the Link), or pass state= and make the step "
                                 "step(state, *args) -> (loss, new_state)")
        if self._error is not None:  # found after the last call's backward
            error, self._error = self._error, None
            raise error
        cell = _Cell(self.step, self.model, seqs, explicit)
        if not chainer.config.enable_backprop or not chainer.config.train:
            return self._plain(cell, t, state)
        self._tape(cell)
        meter = self._start_check(seqs)
        try:
            out = self._run(cell, seqs, t, state, explicit, meter)
        except BaseException:
            if meter is not None:
                meter.meter.stop()
                self._open_meter = None
            self._close_tape()
            raise
        if self._recording is not None and not self._recording_claimed:
            self._close_tape()  # no backward of ours follows (one step: plain backprop)
        return out

    run = __call__

    def predict(self, *seqs: Sequence[Any], state: Any = _NO_STATE) -> "BPTTStats":
        """The plan a call with these inputs would run, without running it:
        slots, forward steps, predicted peaks (the policy's and plain
        BPTT's). The first time a shape is seen, the cell is measured (one
        step run with and without its graph); the model's state, outputs,
        gradients and the random states are left as they were.

        Raises:
            as a call does (bad input, an infeasible budget).
        """
        explicit = state is not _NO_STATE
        if not seqs or len(seqs[0]) < 2 or any(len(s) != len(seqs[0]) for s in seqs):
            raise GraphError("predict() needs per-step sequences of one length, at least 2 steps")
        if not explicit and self.model is None:
            raise RecomputeError("the recurrent state lives in the model's links: pass model=")
        cell = _Cell(self.step, self.model, seqs, explicit)
        self._tape(cell)
        rng = RandomStates.save()
        restore = None if explicit else list(cell.candidates().values())
        try:
            return self._run(cell, seqs, len(seqs[0]), state, explicit, None, predict_only=True)
        finally:
            RandomStates.restore(rng)
            self._close_tape()
            for link, name, value in restore or ():
                setattr(link, name, value)

    def _run(self, cell: _Cell, seqs: Sequence[Sequence[Any]], t: int, state: Any,
             explicit: bool, meter: Any, predict_only: bool = False) -> Any:
        if explicit:
            state0 = cell.unpack(state)
        else:
            before = cell.candidates()
            state0 = None
        grads_before = self._grad_bytes()
        # step 0, as plain Chainer runs it (lazy parameters, RNG draws)
        run_rng0 = RandomStates.save()
        with chainer.no_backprop_mode():
            loss0, state1 = cell.run(0, None if not explicit else state0)
        outputs_before = 0
        if not explicit:
            cell.keys = [(link, name) for key, (link, name, old) in before.items()
                         if isinstance(getattr(link, name), chainer.Variable)
                         and getattr(link, name) is not old]
            state0 = tuple(before[(id(link), name)][2] for link, name in cell.keys)
            state1 = cell.get_state()
        if t == 1:
            if meter is not None:
                meter.meter.stop()
                self._open_meter = None
            return self._single(cell, state0, run_rng0, explicit)
        start = time.perf_counter()
        key = self._key(seqs, _arrays(state1), explicit,
                        [(id(link), name) for link, name in cell.keys])
        cached = self._sizes.get(key)
        if cached is None:
            mask = recurrent_mask(cell, 1, _arrays(state1))
        else:
            mask = cached[1]
        if not explicit:  # attributes only written (L.Classifier's y): outputs, not state
            cell.out_keys = [kv for kv, used in zip(cell.keys, mask) if not used]
            cell.keys = [kv for kv, used in zip(cell.keys, mask) if used]
            state0 = tuple(v for v, used in zip(state0, mask) if used)
            state1 = tuple(v for v, used in zip(state1, mask) if used)
            outputs_before = _nbytes([before[(id(link), name)][2] for link, name in cell.out_keys
                                      if isinstance(before[(id(link), name)][2], chainer.Variable)])
            if meter is not None and meter.owns:
                meter.outputs = [(weakref.ref(before[(id(link), name)][2].array),
                                  _nbytes([before[(id(link), name)][2]]))
                                 for link, name in cell.out_keys
                                 if isinstance(before[(id(link), name)][2], chainer.Variable)]
            del before  # the model's outputs of the last call go when step 1 replaces them
        if cached is None:
            cached = (_measure(cell, 1, _arrays(state1)), mask)
            self._sizes[key] = cached
        measured = cached[0]
        run = _Run(self, cell, t, state0)
        run.rng0 = run_rng0
        run.grads_before = grads_before
        run._add_loss(0, loss0)
        run.computed_steps = 1
        del loss0
        run.running, run.running_pos = _arrays(state1), 1
        run.skip_first = True
        del state1
        call = chain_solver.CallBytes(grads_before=grads_before, grads_cleared=self._grads_cleared,
                                      outputs_before=outputs_before,
                                      update_transient=self._update_transient(measured),
                                      first_step_ran=True)
        constant = 0
        if self.budget_scope == "total":
            constant = self._constant(measured, seqs, state0, grads_before, outputs_before)
        state0_live = any(v is not None for v in state0)
        plan_key = (key, t, call, constant, state0_live)
        stats = self._plans.get(plan_key)
        if stats is None:
            stats = self._plan(t, measured, call, constant, plan_key, state0_live,
                               time.perf_counter() - start)
            self._plans[plan_key] = stats
            self._need_check = True
        stats = dataclasses.replace(stats, measured_peak_bytes=None)
        if predict_only:
            return stats
        ops = chain_solver.schedule(self.policy, t, stats.slots, stats.alpha)
        if not explicit:
            cell.set_state(tuple(None if a is None else chainer.Variable(a)
                                 for a in run.running))
        if meter is not None:
            meter.plan_key, meter.stats = plan_key, stats
            run.meter = meter
            with cell.device.meter() as fwd:
                run.forward(ops)
            run.forward_peak = fwd.result.absolute_peak_bytes - meter.start_bytes
        else:
            run.forward(ops)
        self.last_stats = stats
        run.stats = stats
        loss = self._loss(run)
        final = run.final_state
        if explicit:
            return loss, cell.pack(tuple(None if v is None else chainer.Variable(v.array)
                                         for v in final))
        final_vars = tuple(None if v is None else chainer.Variable(v.array) for v in final)
        run.final_state = final_vars
        cell.set_state(final_vars)
        # outputs the model keeps (L.Classifier's y, loss): without their graph,
        # as plain Chainer's are after unchain_backward()
        run.final_outputs = [(link, name, _detached(getattr(link, name)))
                             for link, name in cell.out_keys]
        for link, name, value in run.final_outputs:
            setattr(link, name, value)
        return loss

    # ------------------------------------------------------------------
    @staticmethod
    def _key(seqs: Sequence[Sequence[Any]], state: Tuple[Any, ...], explicit: bool,
             names: List[Tuple[int, str]]) -> Hashable:
        def sig(x: Any) -> Hashable:
            if isinstance(x, chainer.Variable):
                x = x.array
            if hasattr(x, "shape") and hasattr(x, "dtype"):
                return (tuple(x.shape), str(x.dtype))
            if isinstance(x, (list, tuple)):
                return tuple(sig(y) for y in x)
            return type(x).__name__
        step1 = tuple(sig(s[1]) for s in seqs)
        return (step1, tuple(sig(a) for a in state), explicit, tuple(names))

    def _params(self, measured: Optional[_Measured] = None) -> List[chainer.Parameter]:
        if self.model is not None:
            return list(self.model.params())
        return list(measured.params) if measured is not None else []

    def _grad_bytes(self) -> int:
        """Parameter gradients live now (the previous iteration's)."""
        seen, total = set(), 0
        for p in self._params():
            g = p.grad
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                total += int(g.nbytes)
        return total

    def _update_transient(self, measured: _Measured) -> int:
        """The largest temporary of an optimizer update (one parameter's
        size) when an optimizer is set up on the parameters."""
        params = [p for p in self._params(measured) if p.array is not None]
        if not any(getattr(p, "update_rule", None) is not None for p in params):
            return 0
        return max((int(p.array.nbytes) for p in params), default=0)

    def _constant(self, measured: _Measured, seqs: Sequence[Sequence[Any]],
                  state0: Tuple[Any, ...], grads_before: int, outputs_before: int) -> int:
        """Bytes live when the call starts that the total budget covers:
        parameters, optimizer state (estimated from the update rules before
        the first update), persistent arrays, the per-step inputs, the start
        state, the previous iteration's gradients and the model's outputs."""
        if self.model is not None:
            sb = state_bytes(self.model)
            fixed = sb["params"] + sb["optimizer_state"] + sb["persistents"]
        else:
            fixed = _nbytes([p.array for p in measured.params if p.array is not None])
            for p in measured.params:
                rule = getattr(p, "update_rule", None)
                for v in (getattr(rule, "state", None) or {}).values():
                    fixed += int(getattr(v, "nbytes", 0) or 0)
        return int(fixed + _input_bytes(seqs) + _nbytes([v for v in state0 if v is not None])
                   + grads_before + outputs_before)

    def _plan(self, t: int, measured: _Measured, call: chain_solver.CallBytes, constant: int,
              plan_key: Hashable, state0_live: bool, measure_s: float) -> "BPTTStats":
        start = time.perf_counter()
        sizes = measured.sizes
        alpha = sizes.alpha if self.policy in ("ism", "msm") else 1
        most = chain_solver.max_useful_slots(self.policy, t, alpha)
        least = alpha if self.policy == "ism" else 1
        least = min(least, most) if self.policy != "ism" else least
        correction = self._correction.get(plan_key[:2], 0)
        table_s = 0.0

        def peak(m: int) -> int:
            nonlocal table_s
            t0 = time.perf_counter()
            if self.policy != "revolve":
                chain_solver.chain_table(self.policy, t, m, alpha)
            table_s += time.perf_counter() - t0
            return constant + correction + chain_solver.simulate_bytes(
                chain_solver.schedule(self.policy, t, m, alpha), sizes, t, call=call)

        def plain_peak() -> int:
            return constant + correction + chain_solver.plain_peak_bytes(
                sizes, t, measured.graph, call=dataclasses.replace(call, first_step_ran=False),
                state0_grads=state0_live)

        budget = self.budget_bytes
        limit = None if budget is None else int(budget * (1 - MARGIN))
        if self.slots is not None:
            chain_solver.check_chain(self.policy, t, self.slots, alpha)
            m = self.slots
        elif self.budget_least:
            if self.policy == "ism":
                chain_solver.check_chain(self.policy, t, least, alpha)
            m = least
        else:
            assert budget is not None and limit is not None
            hi = int(min(most, max(least, budget // max(sizes.hidden_slot, 1))))
            if self.policy != "revolve":  # one table for the whole search
                t0 = time.perf_counter()
                chain_solver.chain_table(self.policy, t, hi, alpha)
                table_s += time.perf_counter() - t0
            low_peak = peak(least)
            if low_peak > limit:
                plain = plain_peak()
                need = -(-low_peak // 1) if MARGIN == 0 else int(-(-low_peak // (1 - MARGIN)))
                raise InfeasibleBudgetError(
                    f"budget {format_bytes(budget)} cannot hold the {self.policy.upper()} "
                    f"schedule of t={t} steps even with {least} slot(s): it needs at least "
                    f"{format_bytes(need)} ({need} bytes, {self.budget_scope} scope, with "
                    f"{100 * MARGIN:.0f}% of headroom: one step's graph and backward, parameter "
                    f"gradients, the state's gradient"
                    + (", parameters, optimizer state and inputs" if self.budget_scope == "total"
                       else "") + f"); plain BPTT needs {format_bytes(plain)}. Raise the budget "
                    f"to at least {need} bytes", budget_bytes=budget, least_feasible_bytes=need,
                    vanilla_bytes=plain)
            lo = least  # feasible
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if peak(mid) <= limit:
                    lo = mid
                else:
                    hi = mid - 1
            m = lo
        predicted = peak(m)
        plain = plain_peak()
        return BPTTStats(policy=self.policy, t=t, slots=m, alpha=alpha,
                         forward_steps=chain_solver.policy_cost(self.policy, t, m, alpha),
                         predicted_peak_bytes=predicted, plain_peak_bytes=plain,
                         budget_bytes=self.budget_bytes, sizes=sizes, table_time_s=table_s,
                         plan_time_s=time.perf_counter() - start + measure_s,
                         budget_scope=self.budget_scope, constant_bytes=constant,
                         correction_bytes=correction)

    # ------------------------------------------------------------------ checks
    _recording: Any = None
    _recording_claimed = False

    def _tape(self, cell: _Cell) -> None:
        """Tape CuPy's draws from now until this call's backward is done
        (:func:`~chainer_recompute.runtime.device.recording_random`): a step
        run again from a checkpoint draws what it drew the first time."""
        self._close_tape()  # the last call's loss was never backpropagated
        self._recording = recording_random(cell.device)
        self._recording_claimed = False

    def _close_tape(self) -> None:
        if self._recording is not None:
            self._recording.close()
            self._recording = None

    def _start_check(self, seqs: Sequence[Sequence[Any]]) -> Optional["_Check"]:
        """A meter from the call to the end of its backward, while the
        plan of the call still needs checking."""
        if self.check_calls <= 0 or not self._need_check:
            return None
        dev = device_of(list(_iter_arrays(seqs)))
        if self._open_meter is not None:  # the last call's loss was never backpropagated
            self._open_meter.stop()
        check = _Check(dev.meter())
        check.meter.start()
        self._open_meter = check.meter
        check.owns = bool(getattr(check.meter, "_owns", False))
        with dev.meter() as here:
            pass
        check.start_bytes = here.result.start_bytes
        # planning tables: host memory, in tracemalloc's count on NumPy only
        check.host_tables = not dev.is_gpu
        check.tables = chain_solver.table_cache_bytes() if check.host_tables else 0
        if check.owns:  # arrays made before tracing began: their release is not seen
            check.grads = [(weakref.ref(p.grad), int(p.grad.nbytes)) for p in self._params()
                           if p.grad is not None]
        return check

    def _finish_check(self, run: "_Run", backward: Optional[MemoryMeasurement]) -> None:
        check, run.meter = run.meter, None
        self._open_meter = None
        check.meter.stop()
        count = self._checked.get(check.plan_key, 0) + 1
        self._checked[check.plan_key] = count
        if count >= self.check_calls:
            self._need_check = False
        if backward is None:
            return
        # and the planning tables built in this call (host memory, outside budgets)
        early = sum(nb for ref, nb in check.outputs if ref() is None) + (max(
            chain_solver.table_cache_bytes() - check.tables, 0) if check.host_tables else 0)
        cleared = sum(nb for ref, nb in check.grads if ref() is None)
        forward_peak = (run.forward_peak or 0) - early
        backward_peak = backward.absolute_peak_bytes - check.start_bytes - early - cleared
        above = max(forward_peak, backward_peak)
        stats = check.stats
        measured = above + (stats.constant_bytes if stats.budget_scope == "total" else 0)
        stats.measured_peak_bytes = int(measured)
        budget = self.budget_bytes
        if budget is None or measured <= budget:
            return
        excess = int(measured - stats.predicted_peak_bytes)
        if not self._warned_over:
            self._warned_over = True
            logger.warning("ChainRecompute: the measured peak %s is over the budget %s "
                           "(predicted %s); correcting the prediction by %s and planning "
                           "again", format_bytes(measured), format_bytes(budget),
                           format_bytes(stats.predicted_peak_bytes), format_bytes(max(excess, 1)))
        k = check.plan_key[:2]
        self._correction[k] = self._correction.get(k, 0) + max(excess, 1)
        for key in [key for key in self._plans if key[:2] == k]:
            del self._plans[key]
        self._need_check = True

    def _loss(self, run: _Run) -> chainer.Variable:
        xp = backend.get_array_module(run.total)
        dummy = chainer.Variable(xp.zeros((), dtype=run.total.dtype), requires_grad=True)
        return _LossNode(run).apply((dummy,))[0]

    def _plain(self, cell: _Cell, t: int, state: Any) -> Any:
        """Evaluation (no backprop or train=False): the steps as they are."""
        total = None
        st = cell.unpack(state) if cell.explicit else None
        for k in range(t):
            loss, new = cell.run(k, st)
            total = loss + 0 if total is None else total + loss
            st = new if cell.explicit else None
        if cell.explicit:
            return total, cell.pack(st)
        return total

    def _single(self, cell: _Cell, state0: Tuple[Any, ...], rng0: Any, explicit: bool) -> Any:
        """One step: plain backprop (nothing to recompute)."""
        if not explicit:
            cell.set_state(state0)
        RandomStates.restore(rng0)
        loss, new = cell.run(0, state0 if explicit else None)
        total = loss + 0
        if explicit:
            return total, cell.pack(new)
        return total
