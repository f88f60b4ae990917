"""One call of :class:`~chainer_recompute.runtime.bptt.ChainRecompute`:
the cell (the step function and where its recurrent state lives), a run of
a chain policy's schedule over it (the forward pass keeping only
checkpoints, the backward pass rebuilding one step's graph at a time), and
the summed loss whose ``backward()`` runs that backward pass.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Set, Tuple

from . import _chainer  # noqa: F401
import chainer

from ..core.errors import RecomputeError
from .device import RandomStates, device_of


class RunnerSide(Protocol):
    """What a run calls on its :class:`~chainer_recompute.runtime.bptt.ChainRecompute`."""

    def claim_tape(self) -> None: ...

    def learn_grads_cleared(self) -> None: ...

    def finish_check(self, run: Any, backward: Any) -> None: ...

    def close_tape(self) -> None: ...


logger = logging.getLogger(__name__)

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

def persistent_names(model: Optional[chainer.Link]) -> List[Tuple[chainer.Link, str]]:
    """The persistent values of ``model``'s links, by link and name."""
    return [(link, name) for link in (model.links() if model is not None else ())
            for name in sorted(getattr(link, "_persistent", ()))]


@contextlib.contextmanager
def persistents_kept(names: Sequence[Tuple[chainer.Link, str]]) -> Iterator[None]:
    """Run steps again (a recomputation, a measurement) and put back the
    persistent values ``names`` (:func:`persistent_names`) they wrote
    (BatchNormalization's running statistics): plain BPTT runs each step
    once."""
    saved = []
    for link, name in names:
        value = getattr(link, name, None)
        copy = value.copy() if isinstance(value, chainer.get_array_types()) else None
        saved.append((link, name, value, copy))
    try:
        yield
    finally:
        for link, name, value, copy in saved:
            if copy is not None and getattr(link, name, None) is value:
                value[...] = copy
            else:
                setattr(link, name, value)


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
        self.ran: Set[int] = set()  # steps run once already (their persistent writes made)
        self._extra = False  # inside extra_runs()
        self.persistents = persistent_names(model)

    @contextlib.contextmanager
    def extra_runs(self) -> Iterator[None]:
        """Runs of steps beside the call's own (measuring the cell): they
        write no persistent value and count as no step's run."""
        self._extra = True
        try:
            with persistents_kept(self.persistents):
                yield
        finally:
            self._extra = False

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
        """Step ``k`` from ``state`` (Variables, or None: the links as they
        are); run again (a recomputation), it writes no persistent value."""
        if self._extra:
            return self._run(k, state)
        if k in self.ran and self.persistents:
            with persistents_kept(self.persistents):
                return self._run(k, state)
        self.ran.add(k)
        return self._run(k, state)

    def _run(self, k: int, state: Optional[Tuple[Any, ...]]) -> Tuple[chainer.Variable, Tuple[Any, ...]]:
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

    def __init__(self, runner: RunnerSide, cell: _Cell, t: int,
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
        runner.claim_tape()  # closed when this run's backward ends
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
    stats: Any = None  # the call's BPTTStats

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
                runner.learn_grads_cleared()
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
                runner.finish_check(self, meter.result if ok else None)
            self.done = True
            RandomStates.restore(rng_before)
            runner.close_tape()
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
