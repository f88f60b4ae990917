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
the call adds up to the optimizer update; ``'activations'`` (as
``apply()``'s, the state the model holds anyway left out) covers only what
the call adds. The first calls of a plan are measured (NumPy: tracemalloc; CuPy:
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
import warnings
import weakref
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from . import _chainer  # noqa: F401
from ._chainer import param_grad
import chainer
from chainer import backend

from ..core.budget import MARGIN, least_for, limit_of
from ..core.errors import BudgetError, GraphError, InfeasibleBudgetError, RecomputeError
from ..core.solvers import chain as chain_solver
from ..core.solvers.chain import ByteSizes
from ..core.budget_spec import Budget, parse_budget
from ..core.units import format_bytes
from .bptt_cell import (_arrays, _Cell, _detached, _input_bytes, _iter_arrays, _LossNode, _nbytes,
                        _Run)
from .bptt_measure import _measure, _Measured, measure_step, recurrent_mask
from .capture import state_bytes
from .runner.spec import ChainSpec
from .correction import CallMeter, Correction
from .device import RandomStates, device_of, recording_random
from .memory import MemoryMeasurement, MemoryMeter, parameter_bytes
from .optimizer_update import UpdateBytes, update_bytes

#: The former name of ``budget_scope='activations'`` here (deprecated).
_CALL_SCOPE = "call"

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
            the call's own peak (to the optimizer update); with
            ``'activations'``, the call's own peak above the bytes live at
            its start.
        plain_peak_bytes: the same for plain BPTT, as Chainer runs it
            (:func:`~chainer_recompute.core.solvers.chain.plain_peak_bytes`).
        budget_bytes: the budget asked, or None.
        sizes: the measured :class:`ByteSizes`.
        table_time_s: seconds spent building tables for this plan.
        plan_time_s: seconds spent measuring the cell and choosing the
            slots for this plan (a call that reuses a plan spends none).
        budget_scope: ``'total'`` or ``'activations'``.
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


@dataclasses.dataclass(eq=False)
class _Check(CallMeter):
    """The measurement of one call (see ``ChainRecompute.check_iterations``),
    from the call to the end of its backward; ``own``: the plan's constant
    part in the total scope (parameters, optimizer state, inputs, state, the
    previous gradients and outputs), else 0."""

    #: the planning tables cached at the call (NumPy): (weak reference,
    #: bytes, whether this meter sees their arrays freed)
    tables: Tuple[Tuple[Any, int, bool], ...] = ()
    host_tables: bool = True
    plan_key: Hashable = None
    stats: Optional["BPTTStats"] = None


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
        budget: any form ``apply()`` takes (docs/defaults.md): a size
            (``'16M'``, an int of bytes), ``'60%'`` (of plain BPTT's
            predicted need) or ``'device'``: the largest number of slots
            whose predicted peak fits (with 1% of headroom, as ``apply()``
            keeps); ``'least'``: the fewest slots the policy can run with.
            Give ``slots`` or ``budget``.
        budget_scope: what the budget bounds. ``'total'`` (default, as
            ``apply()``): the whole training iteration, from the call to the
            optimizer update: parameters, their gradients (the previous
            iteration's too while they are alive), optimizer state, the
            per-step inputs, the recurrent state, checkpoints and their RNG
            states, the steps' graphs, gradients and temporaries.
            ``'activations'`` (as ``apply()``'s: what the model holds anyway
            left out): only what the call, its backward and the update add
            above the bytes live when the call starts (``'call'``, its
            former name here, is deprecated). Host-side planning tables
            (:func:`~chainer_recompute.core.solvers.chain.chain_table`) are
            in neither.
        model: the Link that holds the recurrent state and the parameters
            (default: ``step`` when it is a Link).
        check_iterations: the first calls of each shape are measured
            (NumPy: tracemalloc, from the call to the end of its backward);
            a measured peak over the budget warns, corrects the prediction
            by the difference and plans again for the next call. 0: never.
            The name ``apply()`` gives the same option.
        check_calls: the former name of ``check_iterations`` (deprecated).

    Attributes:
        spec: the options but the budget, checked once
            (:class:`~chainer_recompute.runtime.runner.spec.ChainSpec`);
            ``policy``, ``slots``, ``budget_scope`` and ``check_iterations``
            read from it.
        budget: the budget as parsed
            (:class:`~chainer_recompute.core.budget_spec.Budget`), or None.
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
                 check_iterations: int = 2, check_calls: Optional[int] = None) -> None:
        if budget_scope == _CALL_SCOPE:
            warnings.warn("ChainRecompute(budget_scope='call') is now budget_scope="
                          "'activations', as in apply(); 'call' will be removed",
                          DeprecationWarning, stacklevel=2)
            budget_scope = "activations"
        if check_calls is not None:
            warnings.warn("ChainRecompute(check_calls=...) is now check_iterations=..., as in "
                          "apply(); check_calls will be removed", DeprecationWarning, stacklevel=2)
            check_iterations = check_calls
        #: the options, checked (:class:`~.runner.spec.ChainSpec`)
        self.spec = ChainSpec.parse(policy=policy, slots=slots, budget_scope=budget_scope,
                                    check_iterations=check_iterations)
        if (slots is None) == (budget is None):
            raise BudgetError("give either slots= (hidden-state slots) or budget= (e.g. "
                              "'16M', 'least', '60%' or 'device'), not "
                              + ("both" if slots is not None else "neither"))
        self.step = step
        #: the budget as parsed (None with ``slots=``); ``'device'`` is
        #: resolved at the first plan, a share for each plan
        self.budget: Optional[Budget] = None if budget is None else parse_budget(budget)
        self.model = model if model is not None else (step if isinstance(step, chainer.Link) else None)
        self._sizes: Dict[Hashable, Tuple[_Measured, Tuple[bool, ...]]] = {}
        self._plans: Dict[Hashable, BPTTStats] = {}
        self._checked: Dict[Hashable, int] = {}
        self._need_check = True
        self._open_meter: Optional[MemoryMeter] = None
        self._correction: Dict[Hashable, int] = {}
        self._grads_cleared = True
        self._overshoot = Correction(logger, prefix="ChainRecompute: ",
                                     corrected="the prediction")
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
        meter = self._start_check(cell, seqs, state)
        try:
            out = self._run(cell, seqs, t, state, explicit, meter)
        except BaseException:
            if meter is not None:
                meter.meter.stop()
                self._open_meter = None
            self.close_tape()
            raise
        if self._recording is not None and not self._recording_claimed:
            self.close_tape()  # no backward of ours follows (one step: plain backprop)
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
            self.close_tape()
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
            run.forward_peak = meter.above(fwd.result.absolute_peak_bytes)
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
    @property
    def policy(self) -> str:
        """The chain policy (``spec.policy``)."""
        return self.spec.policy

    @property
    def slots(self) -> Optional[int]:
        """The slots asked (``spec.slots``), or None with a budget."""
        return self.spec.slots

    @property
    def budget_scope(self) -> str:
        """What the budget bounds (``spec.budget_scope``)."""
        return self.spec.budget_scope

    @property
    def check_iterations(self) -> int:
        """How many calls of each plan are measured (``spec.check_iterations``)."""
        return self.spec.check_iterations

    @property
    def budget_least(self) -> bool:
        """Whether the budget is ``'least'``."""
        return self.budget is not None and self.budget.is_least

    @property
    def budget_bytes(self) -> Optional[int]:
        """The budget in bytes: a size, or ``'device'`` once resolved; None
        for ``'least'``, a share (each plan's ``budget_bytes``) or slots."""
        b = self.budget
        return b.bytes if b is not None and b.kind in ("bytes", "device") else None

    def _budget_for(self, plain_peak: Callable[[], int], measured: _Measured) -> Optional[Budget]:
        """The budget of one plan: ``'device'`` resolved once from the
        parameters' device, a share of plain BPTT's need (its predicted
        peak with the 1% headroom)."""
        b = self.budget
        if b is None or b.is_least:
            return b
        if b.kind == "device" and b.bytes is None:
            self.budget = b = b.of_device(device_of(self._params(measured)).available_bytes())
        if b.kind == "share":
            b = b.of_plain(least_for(plain_peak()))
        return b

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
        return parameter_bytes(self._params())["grads"]

    def _optimizer_bytes(self, measured: _Measured) -> UpdateBytes:
        """The optimizer's state and update temporary for the parameters
        (measured once per model on throw-away copies)."""
        owner = self.model if self.model is not None else self
        return update_bytes(self._params(measured), owner=owner)

    def _update_transient(self, measured: _Measured) -> int:
        """The largest temporary of an optimizer update (its hooks
        included) when an optimizer is set up on the parameters."""
        params = [p for p in self._params(measured) if p.array is not None]
        if not any(getattr(p, "update_rule", None) is not None for p in params):
            return 0
        return self._optimizer_bytes(measured).update_transient_bytes

    def _constant(self, measured: _Measured, seqs: Sequence[Sequence[Any]],
                  state0: Tuple[Any, ...], grads_before: int, outputs_before: int) -> int:
        """Bytes live when the call starts that the total budget covers:
        parameters, optimizer state (before the first update, what the
        update rules will make), persistent arrays, the per-step inputs, the start
        state, the previous iteration's gradients and the model's outputs."""
        if self.model is not None:
            sb = state_bytes(self.model)
            fixed = sb["params"] + sb["optimizer_state"] + sb["persistents"]
        else:
            pb = parameter_bytes(measured.params)
            fixed = pb["params"] + self._optimizer_bytes(measured).optimizer_state_bytes
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

        spec = self._budget_for(plain_peak, measured)
        budget = None if spec is None else spec.bytes
        limit = None if budget is None else limit_of(budget)
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
                need = least_for(low_peak)
                raise InfeasibleBudgetError(
                    f"budget {_label(spec)} cannot hold the {self.policy.upper()} "
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
                         budget_bytes=budget, sizes=sizes, table_time_s=table_s,
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
        self.close_tape()  # the last call's loss was never backpropagated
        self._recording = recording_random(cell.device)
        self._recording_claimed = False

    def learn_grads_cleared(self) -> None:
        """At a run's backward: whether the loop cleared the parameters'
        gradients before it (the PTB example does), for the next plans."""
        self._grads_cleared = not any(param_grad(p) is not None for p in self._params())

    def claim_tape(self) -> None:
        """A run of this call will backpropagate: the tape of CuPy's draws
        (:meth:`_tape`) stays open until its backward ends (the run closes
        it), not closed at the end of the call."""
        self._recording_claimed = True

    def close_tape(self) -> None:
        """The run's backward is over (or no backward of ours follows): stop
        taping CuPy's draws."""
        if self._recording is not None:
            self._recording.close()
            self._recording = None

    def _start_check(self, cell: _Cell, seqs: Sequence[Sequence[Any]],
                     state: Any) -> Optional["_Check"]:
        """A meter from the call to the end of its backward, while the
        plan of the call still needs checking. It sees the frees of the
        previous gradients and of the model's state and outputs (the last
        call's, replaced by this one's)."""
        if self.check_iterations <= 0 or not self._need_check:
            return None
        dev = device_of(list(_iter_arrays(seqs)))
        if self._open_meter is not None:  # the last call's loss was never backpropagated
            self._open_meter.stop()
        found = [g for g in map(param_grad, self._params()) if g is not None]
        found += list(_iter_arrays([v for _, _, v in cell.candidates().values()])
                      if not cell.explicit else _iter_arrays(state))
        # planning tables: host memory, in tracemalloc's count on NumPy only
        host = not dev.is_gpu
        tables = chain_solver.cached_tables() if host else []
        arrays = [a for tab in tables for a in (tab.cost, tab.split, tab.kind)]
        check = _Check.start(dev, found + arrays, host_tables=host)
        # A table grown in this call replaces the cached one: the meter sees
        # the old one freed if it traces its arrays (adopted where the meter
        # owns the tracing, or made while an outer meter traced), not if they
        # were made before any tracing began.
        unseen = {id(a) for a in check.meter.untraced(arrays)}
        check.tables = tuple(
            (weakref.ref(tab), tab.nbytes,
             check.adopted > 0 if check.meter.owns_tracing
             else not {id(tab.cost), id(tab.split), id(tab.kind)} & unseen)
            for tab in tables)
        self._open_meter = check.meter
        return check

    @staticmethod
    def _tables_built(check: "_Check") -> int:
        """What the planning tables built since ``check`` began add to its
        meter's figures (host memory, outside budgets): the tables cached
        now and not then, less those cached then and freed since whose
        free the meter saw."""
        if not check.host_tables:
            return 0
        before = {id(ref()) for ref, _, _ in check.tables if ref() is not None}
        added = sum(tab.nbytes for tab in chain_solver.cached_tables() if id(tab) not in before)
        return added - sum(nbytes for ref, nbytes, seen in check.tables if seen and ref() is None)

    def finish_check(self, run: "_Run", backward: Optional[MemoryMeasurement]) -> None:
        check, run.meter = run.meter, None
        self._open_meter = None
        check.meter.stop()
        count = self._checked.get(check.plan_key, 0) + 1
        self._checked[check.plan_key] = count
        if count >= self.check_iterations:
            self._need_check = False
        if backward is None:
            return
        # less the planning tables built in this call (host memory, outside budgets)
        tables = self._tables_built(check)
        stats = check.stats
        check.own = stats.constant_bytes if stats.budget_scope == "total" else 0
        measured = max(run.forward_peak or 0, check.above(backward.absolute_peak_bytes)) \
            - tables + check.own
        stats.measured_peak_bytes = int(measured)
        c = self._overshoot.overshoot(int(measured), stats.budget_bytes,
                                      stats.predicted_peak_bytes)
        if not c:
            return
        k = check.plan_key[:2]
        self._correction[k] = self._correction.get(k, 0) + c
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


def _label(b: Budget) -> str:
    """A budget as a message names it (with what a share or ``'device'``
    resolved to)."""
    return b.describe() if b.kind in ("share", "device") else format_bytes(b.bytes)
