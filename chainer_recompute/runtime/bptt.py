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
  the recurrent state with the NumPy RNG state (so dropout draws the same
  masks when a step runs again), or a step's whole graph (ISM/MSM);
- the returned loss is the sum of the step losses, added in the order the
  loop adds them; its ``backward()`` walks the policy's schedule
  (:func:`chainer_recompute.core.solvers.chain.schedule`): it reruns
  segments from their checkpoints, rebuilds one step's graph at a time
  and backpropagates it with the state's gradient from the step after;
  parameter gradients accumulate step by step, last step first, as in
  plain backprop;
- afterwards the model's state is the final state of the forward pass and
  NumPy's RNG is where it was before ``backward()``.

The recurrent state is either held by the model's links (``L.LSTM``'s
``h``/``c``, any non-parameter Variable attribute a step replaces: the
call has no ``state=``), or passed explicitly (``state=``: the step is
``step(state, *args) -> (loss, new_state)``, e.g. around
``L.NStepLSTM``; the call returns ``(loss, final_state)``).

Sizes are measured on the cell at the first call of a shape: a hidden
slot (the state and its RNG state), the internal state of a step (what its
graph keeps), transients of a step's forward and backward, parameter
gradients. A byte budget picks the largest number of slots whose
simulated peak fits (:func:`chainer_recompute.core.solvers.chain.simulate_bytes`).

Limits: the state's gradient is combined with the gradients from inside a
step in Chainer's order, which is the plain graph's whenever a state feeds
at most two functions (true of ``L.LSTM``, ``L.NStepLSTM``); a parameter
used at two different depths of one step (tied input and output
embeddings) accumulates its gradient in another order than plain
backprop's (equal to rounding). CuPy's RNG is not saved: on GPU use
deterministic cells or no dropout.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from . import _chainer  # noqa: F401
import chainer
from chainer import backend

from ..core.errors import BudgetError, GraphError, InfeasibleBudgetError, RecomputeError
from ..core.solvers import chain as chain_solver
from ..core.solvers.chain import ByteSizes
from ..core.units import format_bytes, parse_bytes
from .memory import MemoryMeter

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
        predicted_peak_bytes: the schedule's simulated peak above the
            bytes live at the call (parameter gradients counted from none).
        plain_peak_bytes: the same for plain BPTT.
        budget_bytes: the budget asked, or None.
        sizes: the measured :class:`ByteSizes`.
        table_time_s: seconds spent building tables this call.
        plan_time_s: seconds spent choosing the slots this call.
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

    @property
    def recompute_overhead(self) -> float:
        """Extra forward steps as a fraction of one forward pass."""
        return self.forward_steps / self.t - 1.0


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
        self.rng0 = np.random.get_state()
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
            self.ckpts[op[1]] = (self.running, np.random.get_state())
            return restored
        if name == "restore":
            arrays, rng = self.ckpts[op[1]]
            self.running, self.running_pos = arrays, op[1]
            np.random.set_state(rng)
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
                np.random.set_state(self.rng0)
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

    def backward_all(self, gy: Any) -> None:
        if self.done:
            raise RecomputeError("this loss was already backpropagated: its checkpoints are "
                                 "consumed; run the forward again (plain Chainer would also "
                                 "need retain_graph semantics here)")
        self.gy = gy
        rng_before = np.random.get_state()
        try:
            with _Configured(self.config, in_recomputing=True):
                op = self.pending
                assert op is not None
                self.backward(op[1])
                restored = False
                for op in self.ops:
                    restored = self.execute(op, restored)
        finally:
            self.done = True
            np.random.set_state(rng_before)
            if not self.cell.explicit:
                self.cell.set_state(self.final_state)
                for link, name, value in self.final_outputs:
                    setattr(link, name, value)
            self.kept.clear()
            self.ckpts.clear()
            self.running = ()
            self.grad = ()


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

def _meter() -> MemoryMeter:
    return MemoryMeter()


def recurrent_mask(cell: _Cell, k: int, state_arrays: Tuple[Any, ...]) -> Tuple[bool, ...]:
    """Which entries of the state step ``k`` reads (an attribute it only
    writes, such as ``L.Classifier``'s ``y``, is an output, not state)."""
    rng = np.random.get_state()
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
        np.random.set_state(rng)
        if implicit_state is not None:
            cell.set_state(implicit_state)


def measure_step(cell: _Cell, k: int, state_arrays: Tuple[Any, ...]) -> ByteSizes:
    """Measure step ``k`` of ``cell`` from ``state_arrays`` (leaving no
    trace: the RNG, the links' state and the parameter gradients are put
    back).

    Returns:
        The :class:`ByteSizes` of one step.
    """
    with _meter():  # one tracing session for the measurements below
        return _measure_step(cell, k, state_arrays)


def _measure_step(cell: _Cell, k: int, state_arrays: Tuple[Any, ...]) -> ByteSizes:
    rng = np.random.get_state()
    implicit_state = None if cell.explicit else cell.get_state()
    implicit_outputs = [(link, name, getattr(link, name)) for link, name in cell.out_keys]
    saved_grads: List[Tuple[chainer.Parameter, Any]] = []
    try:
        with _meter() as m_rng:
            snap = np.random.get_state()
        rng_bytes = max(m_rng.result.end_bytes - m_rng.result.start_bytes, 0)
        del snap
        state_bytes = _nbytes(state_arrays)
        # a step without a graph
        with chainer.no_backprop_mode():
            with _meter() as m_adv:
                loss, out = cell.run(k, _leaves(state_arrays))
            advance_peak = m_adv.result.peak_bytes
            del loss, out
        np.random.set_state(rng)
        # a step with its graph, from copies of the state (to see what it keeps of
        # them); the model's outputs of the step before are let go first, so that
        # their release does not hide what the step keeps
        for link, name in cell.out_keys:
            setattr(link, name, None)
        with _meter() as m_copy:
            copies = tuple(None if a is None else a.copy() for a in state_arrays)
            inputs = _leaves(copies)
        with chainer.using_config("enable_backprop", True):
            with _meter() as m_keep:
                loss, outputs = cell.run(k, inputs)
        out_bytes = _nbytes([v for v in outputs if v is not None])
        internal = max(m_keep.result.retained_bytes - out_bytes, 0)
        keep_peak = m_keep.result.peak_bytes
        params = _graph_params([loss] + [v for v in outputs if isinstance(v, chainer.Variable)])
        saved_grads = [(p, p.grad_var) for p in params]
        for p in params:
            p.grad_var = None
        outs = [loss] + [v for v in outputs if isinstance(v, chainer.Variable)]
        grads = [chainer.Variable(v.xp.ones_like(v.array)) for v in outs]
        with _meter() as m_b1:
            chainer.backward(outs, grads)
        param_bytes = _nbytes([p.grad for p in params if p.grad is not None])
        grad_bytes = _nbytes([v.grad for v in inputs if v is not None and v.grad is not None])
        for v in inputs:
            if v is not None:
                v.grad_var = None
        with _meter() as m_b2:
            chainer.backward(outs, grads)
        del grads, outs
        for p, g in saved_grads:
            p.grad_var = g
        saved_grads = []
        del inputs, copies
        with _meter() as m_now:
            pass
        retained_input = max(m_now.result.start_bytes - m_copy.result.start_bytes - internal
                             - out_bytes, 0)
        del loss, outputs
        outputs_bytes = 0 if cell.explicit else _nbytes(
            [getattr(link, name) for link, name in cell.out_keys
             if isinstance(getattr(link, name), chainer.Variable)])
        return ByteSizes(state=state_bytes, rng=rng_bytes, internal=internal, outputs=outputs_bytes,
                         retained_input=min(retained_input, state_bytes), grad=grad_bytes,
                         param_grads=param_bytes, advance_peak=advance_peak,
                         keep_peak=keep_peak, backward_peak=m_b2.result.peak_bytes,
                         first_backward_peak=m_b1.result.peak_bytes)
    finally:
        for p, g in saved_grads:
            p.grad_var = g
        np.random.set_state(rng)
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
            :func:`chainer_recompute.parse_bytes`): the largest number of
            slots whose predicted peak fits. Give ``slots`` or ``budget``.
        model: the Link that holds the recurrent state and the parameters
            (default: ``step`` when it is a Link).

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
                 model: Optional[chainer.Link] = None) -> None:
        if policy not in chain_solver.POLICIES:
            from ..core.errors import UnknownSolverError
            raise UnknownSolverError(f"unknown chain policy {policy!r}; known: "
                                     f"{sorted(chain_solver.POLICIES)}")
        if (slots is None) == (budget is None):
            raise BudgetError("give either slots= (hidden-state slots) or budget= (bytes, "
                              "e.g. '16M'), not " + ("both" if slots is not None else "neither"))
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, (int, np.integer))
                                  or slots < 1):
            raise BudgetError(f"slots={slots!r}: give a positive number of hidden-state slots")
        self.step = step
        self.policy = policy
        self.slots = None if slots is None else int(slots)
        self.budget_bytes = None if budget is None else parse_bytes(budget)
        self.model = model if model is not None else (step if isinstance(step, chainer.Link) else None)
        self._sizes: Dict[Hashable, ByteSizes] = {}
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
        cell = _Cell(self.step, self.model, seqs, explicit)
        if not chainer.config.enable_backprop or not chainer.config.train:
            return self._plain(cell, t, state)
        if explicit:
            state0 = cell.unpack(state)
        else:
            before = cell.candidates()
            state0 = None
        # step 0, as plain Chainer runs it (lazy parameters, RNG draws)
        run_rng0 = np.random.get_state()
        with chainer.no_backprop_mode():
            loss0, state1 = cell.run(0, None if not explicit else state0)
        if not explicit:
            cell.keys = [(link, name) for key, (link, name, old) in before.items()
                         if isinstance(getattr(link, name), chainer.Variable)
                         and getattr(link, name) is not old]
            state0 = tuple(before[(id(link), name)][2] for link, name in cell.keys)
            state1 = cell.get_state()
        if t == 1:
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
        if cached is None:
            cached = (measure_step(cell, 1, _arrays(state1)), mask)
            self._sizes[key] = cached
        sizes = cached[0]
        run = _Run(self, cell, t, state0)
        run.rng0 = run_rng0
        run._add_loss(0, loss0)
        run.computed_steps = 1
        del loss0
        run.running, run.running_pos = _arrays(state1), 1
        run.skip_first = True
        del state1
        stats = self._plan(t, sizes, time.perf_counter() - start)
        ops = chain_solver.schedule(self.policy, t, stats.slots, stats.alpha)
        if not explicit:
            cell.set_state(tuple(None if a is None else chainer.Variable(a)
                                 for a in run.running))
        run.forward(ops)
        stats.forward_steps = chain_solver.policy_cost(self.policy, t, stats.slots, stats.alpha)
        self.last_stats = stats
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

    run = __call__

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

    def _plan(self, t: int, sizes: ByteSizes, measure_s: float) -> BPTTStats:
        start = time.perf_counter()
        alpha = sizes.alpha if self.policy in ("ism", "msm") else 1
        most = chain_solver.max_useful_slots(self.policy, t, alpha)
        least = alpha if self.policy == "ism" else 1
        table_s = 0.0

        def peak(m: int) -> int:
            nonlocal table_s
            t0 = time.perf_counter()
            if self.policy != "revolve":
                chain_solver.chain_table(self.policy, t, m, alpha)
            table_s += time.perf_counter() - t0
            return chain_solver.simulate_bytes(
                chain_solver.schedule(self.policy, t, m, alpha), sizes, t)

        if self.slots is not None:
            chain_solver.check_chain(self.policy, t, self.slots, alpha)
            m = self.slots
        else:
            budget = self.budget_bytes
            assert budget is not None
            hi = int(min(most, max(least, budget // max(sizes.hidden_slot, 1))))
            if self.policy != "revolve":  # one table for the whole search
                t0 = time.perf_counter()
                chain_solver.chain_table(self.policy, t, hi, alpha)
                table_s += time.perf_counter() - t0
            low_peak = peak(least)
            if low_peak > budget:
                plain = chain_solver.simulate_bytes(chain_solver.plain_schedule(t), sizes, t)
                raise InfeasibleBudgetError(
                    f"budget {format_bytes(budget)} cannot hold the {self.policy.upper()} "
                    f"schedule of t={t} steps even with {least} slot(s): it needs at least "
                    f"{format_bytes(low_peak)} ({low_peak} bytes: one step's graph and "
                    f"backward, parameter gradients, the state's gradient); plain BPTT "
                    f"needs {format_bytes(plain)}. Raise the budget to at least "
                    f"{low_peak} bytes", budget_bytes=budget, least_feasible_bytes=low_peak,
                    vanilla_bytes=plain)
            lo = least  # feasible
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if peak(mid) <= budget:
                    lo = mid
                else:
                    hi = mid - 1
            m = lo
        predicted = peak(m)
        plain = chain_solver.simulate_bytes(chain_solver.plain_schedule(t), sizes, t)
        return BPTTStats(policy=self.policy, t=t, slots=m, alpha=alpha, forward_steps=0,
                         predicted_peak_bytes=predicted, plain_peak_bytes=plain,
                         budget_bytes=self.budget_bytes, sizes=sizes, table_time_s=table_s,
                         plan_time_s=time.perf_counter() - start + measure_s)

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
        np.random.set_state(rng0)
        loss, new = cell.run(0, state0 if explicit else None)
        total = loss + 0
        if explicit:
            return total, cell.pack(new)
        return total
