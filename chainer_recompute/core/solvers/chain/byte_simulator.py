"""A chain schedule's peak in bytes, predicted event by event from one
step's measured sizes (:func:`simulate_bytes`).

Pure core: numpy only.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Tuple

from ...errors import RecomputeError
from .schedules import Op

@dataclasses.dataclass(frozen=True)
class ByteSizes:
    """Measured bytes of one step of a cell, for :func:`simulate_bytes`.

    Attributes:
        state: the recurrent state between two steps (all its arrays).
        rng: one saved RNG state (kept with every checkpoint).
        internal: what a step's graph keeps besides its input and output
            states (the internal state less the states; the model's
            outputs the graph holds too, such as ``L.Classifier``'s ``y``,
            included).
        retained_input: the part of its input state that a step's graph
            keeps alive by itself.
        grad: the gradient of a state.
        param_grads: parameter gradients, allocated by the first backward.
        advance_peak: highest bytes above those live before a step run
            without a graph, while it runs (its output included).
        keep_peak: the same for a step that builds its graph.
        backward_peak: the same for the backward of one step (parameter
            gradients already allocated: they accumulate).
        first_backward_peak: the same for the first backward, which
            allocates the parameter gradients (default: ``backward_peak +
            param_grads``).
        outputs: what the model keeps of the last step it ran besides its
            state (``L.Classifier``'s ``y`` and ``loss``); the forward
            pass's last are held through the backward pass too (they are
            put back at the end).
        outputs_shared: the part of ``outputs`` that a step's graph holds
            too (counted in ``internal`` while the graph is kept).
        state0: bytes of the start state that the call allocates (0 when
            it was live before the call).
    """

    state: int
    rng: int
    internal: int
    retained_input: int
    grad: int
    param_grads: int
    advance_peak: int
    keep_peak: int
    backward_peak: int
    state0: int = 0
    first_backward_peak: Optional[int] = None
    outputs: int = 0
    outputs_shared: int = 0

    @property
    def hidden_slot(self) -> int:
        """Bytes of one hidden-state slot: a state and its RNG state."""
        return self.state + self.rng

    @property
    def internal_slot(self) -> int:
        """Bytes of one stored internal state: its own arrays and its
        output state (and that state's RNG state, as the right part's
        start)."""
        return self.internal + self.state + self.rng

    @property
    def alpha(self) -> int:
        """Slots of an internal state: ``ceil(internal_slot / hidden_slot)``."""
        return max(1, -(-self.internal_slot // max(self.hidden_slot, 1)))


@dataclasses.dataclass(frozen=True)
class CallBytes:
    """What :func:`simulate_bytes` needs to know of the call besides the
    step's sizes (all default to a call that starts from nothing).

    Attributes:
        grads_before: parameter gradients live when the call starts (the
            previous iteration's, kept through the forward pass as
            Chainer's PTB loop and ``StandardUpdater`` do).
        grads_cleared: whether they are cleared before ``backward()``
            (``model.cleargrads()``); if not, the backward accumulates
            into them.
        outputs_before: bytes of the model's outputs live at the call (the
            previous iteration's ``L.Classifier.y``), let go when the
            first step replaces them.
        update_transient: the largest temporary of the optimizer update
            that follows the backward (0: no update counted).
        first_step_ran: the runtime ran step 0 without a graph before the
            schedule (:class:`~chainer_recompute.runtime.bptt.ChainRecompute`
            does, to find the state): its output state is the running
            state when the schedule starts.
    """

    grads_before: int = 0
    grads_cleared: bool = True
    outputs_before: int = 0
    update_transient: int = 0
    first_step_ran: bool = False


def simulate_bytes(ops: Iterator[Op], sizes: ByteSizes, t: int,
                   trace: Optional[List[Tuple[Op, int, int]]] = None,
                   call: Optional[CallBytes] = None) -> int:
    """Predicted peak bytes of a schedule above the bytes live when it
    starts, from one step's measured sizes, event by event.

    Every array is counted once however many holders it has:

    - a state (position ``p``) is held by the running state, a checkpoint,
      the kept graph of the step that made it (``OUT``), the model after
      the forward pass (the final state), or only in part
      (``retained_input``) by the kept graph of the step that reads it;
    - the model's outputs of step ``j`` (``L.Classifier``'s ``y``) are held
      by the model until the next step replaces them, and the forward
      pass's last through the backward; while step ``j``'s graph is kept,
      their ``outputs_shared`` part is in its internal state;
    - one state gradient lives from the first backward on, the parameter
      gradients from the first backward (the previous iteration's until
      then, see :class:`CallBytes`), one RNG state per checkpoint and one
      for the backward pass;
    - each step run adds its measured transient (``advance_peak``,
      ``keep_peak``, ``(first_)backward_peak``) on top of what is live; the
      optimizer update its largest temporary at the end.

    Args:
        ops: a schedule (:func:`schedule`, :func:`plain_schedule`).
        sizes: the step's measured sizes.
        t: steps.
        trace: if given, ``(op, live bytes after it, peak so far)`` is
            appended for every operation.
        call: what is live at the call (:class:`CallBytes`).

    >>> from chainer_recompute.core.solvers.chain import schedule
    >>> s = ByteSizes(100, 10, 1000, 50, 100, 5000, 150, 1200, 2000)
    >>> simulate_bytes(schedule('hsm', 20, 20), s, 20) < simulate_bytes(schedule('msm', 20, 100, 10), s, 20)
    True
    """
    call = call or CallBytes()
    RUN, CKPT, OUT, IN, FINAL = 1, 2, 4, 8, 16
    MODEL, FINAL_OUT = 1, 2
    state_holders: Dict[int, int] = {}
    out_holders: Dict[int, int] = {-1: MODEL}
    kept: set = set()
    counted: Dict[Tuple[str, int], int] = {("o", -1): call.outputs_before}
    shared = min(sizes.outputs_shared, sizes.outputs)
    live = 0

    def refresh(kind: str, p: int) -> None:
        nonlocal live
        if kind == "s":
            h = state_holders.get(p, 0)
            if p == 0:
                b = sizes.state0 if h else 0
            elif h & (RUN | CKPT | OUT | FINAL):
                b = sizes.state
            elif h & IN:
                b = min(sizes.retained_input, sizes.state)
            else:
                b = 0
        else:
            h = out_holders.get(p, 0)
            if not h:
                b = 0
            elif p < 0:
                b = call.outputs_before
            else:
                b = sizes.outputs - (shared if p in kept else 0)
        live += b - counted.get((kind, p), 0)
        counted[(kind, p)] = b

    def hold(kind: str, p: int, bit: int) -> None:
        table = state_holders if kind == "s" else out_holders
        table[p] = table.get(p, 0) | bit
        refresh(kind, p)

    def drop(kind: str, p: int, bit: int) -> None:
        table = state_holders if kind == "s" else out_holders
        h = table.get(p, 0) & ~bit
        if h:
            table[p] = h
        else:
            table.pop(p, None)
        refresh(kind, p)

    running: Optional[int] = 0
    model_at = -1  # the step whose outputs the model holds
    hold("s", 0, RUN)
    peak = 0
    grad_live = False
    params_live = False
    backward_started = False
    last_run = False  # step t-1 has run (its outputs are kept to the end)

    def move_running(to: Optional[int]) -> None:
        nonlocal running
        if running is not None:
            drop("s", running, RUN)
        running = to
        if to is not None:
            hold("s", to, RUN)

    def ran(k: int) -> None:
        """Step ``k`` ran: the model now holds its outputs."""
        nonlocal model_at, last_run
        hold("o", k, MODEL)
        if model_at != k:
            drop("o", model_at, MODEL)
        model_at = k
        if k == t - 1 and not last_run:
            last_run = True
            hold("o", k, FINAL_OUT)

    def advance_step(k: int) -> None:
        nonlocal peak
        peak = max(peak, live + sizes.advance_peak)
        ran(k)
        move_running(k + 1)

    def keep(k: int) -> None:
        nonlocal peak, live
        peak = max(peak, live + sizes.keep_peak)
        kept.add(k)
        live += sizes.internal
        hold("s", k + 1, OUT)
        hold("s", k, IN)
        if k + 1 == t:
            hold("s", t, FINAL)
        ran(k)
        move_running(k + 1)

    def backward(k: int) -> None:
        nonlocal peak, live, grad_live, params_live, backward_started
        if not backward_started:  # the backward pass saves the RNG state
            backward_started = True
            live += sizes.rng
        if params_live:
            extra = sizes.backward_peak
        elif call.grads_before and not call.grads_cleared:
            extra = sizes.backward_peak  # accumulates into the live gradients
            params_live = True
        else:
            live -= call.grads_before
            extra = (sizes.first_backward_peak if sizes.first_backward_peak is not None
                     else sizes.backward_peak + sizes.param_grads)
        peak = max(peak, live + extra)
        if not params_live:
            live += sizes.param_grads
            params_live = True
        live -= sizes.internal
        kept.discard(k)
        refresh("o", k)
        drop("s", k + 1, OUT)
        drop("s", k, IN)
        if not grad_live:
            live += sizes.grad
            grad_live = True

    pre_ran = call.first_step_ran and t >= 1
    if pre_ran:  # step 0 without a graph, before the schedule
        advance_step(0)
    for op in ops:
        name = op[0]
        if pre_ran and name in ("advance", "keep", "leaf") and op[1] == 0:
            pre_ran = False
            if name == "advance":
                if op[2] > 1:
                    advance_step(1)
                if op[2] > 2:  # uniform steps: the last one's holders suffice
                    advance_step(op[2] - 1)
                if trace is not None:
                    trace.append((op, live, peak))
                continue
            move_running(0)  # step 0 again, from the start state, to build its graph
        if name == "advance":
            a, b = op[1], op[2]
            advance_step(a)
            if b - a >= 2:  # uniform steps: the last one's holders suffice
                advance_step(b - 1)
        elif name == "store":
            hold("s", op[1], CKPT)
            live += sizes.rng
        elif name == "free":
            drop("s", op[1], CKPT)
            live -= sizes.rng
        elif name == "restore":
            move_running(op[1])
        elif name == "keep":
            keep(op[1])
        elif name == "backward":
            backward(op[1])
            move_running(None)
        elif name == "leaf":
            keep(op[1])
            backward(op[1])
            move_running(None)
        else:  # pragma: no cover
            raise RecomputeError(f"unknown chain operation {op!r}")
        peak = max(peak, live)
        if trace is not None:
            trace.append((op, live, peak))
    # the end of the backward pass: the state's gradient goes, then the update
    if grad_live:
        live -= sizes.grad
    peak = max(peak, live + call.update_transient)
    if trace is not None:
        trace.append((("update",), live, peak))
    return int(peak)
