"""Replaying one training iteration under a plan, event by event, to
predict the memory the allocator will see.

Pure core: numpy only.

The replay follows what Chainer and the runtime's executor do with each
array, from the recorded graph:

- a function's outputs are allocated when it runs (a view shares its base's
  memory), with the attribute arrays it keeps (dropout masks, pooling
  indexes, BatchNorm statistics) and, during the call, its measured
  transient working set (im2col buffers);
- an array lives while something references it: the caller's ``Variable``
  (until the recorded moment it went away), Chainer's retention for
  backward (until the iteration ends, or until the executor releases it),
  the executor's hold on the arrays regeneration starts from;
- backward runs in the recorded order: before a function's backward the
  executor regenerates the released arrays it reads (the released nodes of
  their block that a remaining backward reads, with every intermediate value
  alive until the block is done), the call allocates what it was measured
  to allocate (the gradients of its inputs, less the gradients it replaced
  by their sum; an input gradient that is the output gradient itself or a
  view of it costs nothing), attributed to the inputs by size, on top of
  its transient; then the gradients of its outputs are freed and nodes with
  no backward reader left are released again;
- bytes that do not depend on the plan come on top: parameters, optimizer
  state and the caller's input arrays; the previous iteration's parameter
  gradients during the forward (a training loop such as Chainer's
  ``StandardUpdater`` clears them only after the forward, right before the
  backward; ``step.grads_in_forward`` records what the recorded
  iteration did), each parameter's new gradient from the first backward
  that reads it, and the optimizer update's largest temporary at the end;
  a loop whose gradients are alive into the backward
  (``step.grads_in_backward``: ``zerograds``, or several calls' gradients
  accumulated before one update) keeps each parameter's old gradient until
  its first backward reader, where Chainer adds the new one to it (the sum
  a temporary of that call) and lets both parts go;
- the caller's own work between the forward and the backward (its loss, a
  target network's forward: ``step.outside_peak_bytes``, a transient at
  the end of the forward, and ``step.outside_held_bytes``, held from the
  backward on), as the recording measured it;
- a step that holds several calls of the model at once
  (``step.calls_per_step`` = k: a WGAN-GP critic's penalty call, then the
  fake and the real batch, then one backward through all three): each call
  runs under the same plan, and whatever order their backward passes
  interleave in, the step holds at most k times one call's bytes above
  what they share, a call that holds its whole graph (double backprop
  inside the step) at most plain Chainer's peak (:func:`per_step`);
- work inside the forward that was not recorded (functions applied with
  backprop disabled: a frozen teacher's forward), as the recording measured
  it: its peak (``Node.unrecorded_peak_bytes``, and
  ``step.unrecorded_tail_peak_bytes`` after the last function) is a transient where it ran, before the executor's releases at
  the next function, and the arrays it made that recorded functions read
  (``ArrayInfo.made_at``) live from there to the caller's last reference;
  a function that applies others to parameters that are not its inputs
  (``F.forget``) makes their gradients in its backward
  (``Node.inner_params``).

:func:`replay` gives the peak and the whole timeline; with ``plan=None`` it
replays plain Chainer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import numpy as np

from .execution import ExecutionPlan, regeneration_frees
from .graph import RNG_STATE_BYTES, Graph
from .kernels import pick_engine
from .pool import PoolModel

__all__ = ["Floor", "RELEASE_MODES", "REPLAY_ENGINES", "ReplayResult", "least_floor",
           "physical_floor", "replay",
           "replay_engine", "replay_peak", "state_constant_bytes"]

#: What is released after a node's last backward reader has run: ``none``
#: held back (everything recomputable is released; a second backward pass
#: through the graph regenerates checkpoints too), ``checkpoints`` kept
#: until the iteration ends (only regenerated arrays are released: a second
#: pass costs what the first did), or ``all`` kept (a second pass
#: regenerates nothing).
RELEASE_MODES = ("none", "checkpoints", "all")
#: ``python``: the replay below, event by event in Python (the reference);
#: ``numba``: the same replay compiled
#: (:mod:`~chainer_recompute.core.kernels.replay`; the same total at every
#: event, not for graphs recorded on CuPy; an error without numba);
#: ``auto``: compiled on graphs of at least :data:`KERNEL_MIN_NODES` nodes
#: when numba is installed.
REPLAY_ENGINES = ("auto", "python", "numba")
#: Graphs smaller than this are replayed in Python by ``engine='auto'``
#: (a few milliseconds; loading the compiled loop costs more).
KERNEL_MIN_NODES = 1000


@dataclass(frozen=True)
class ReplayResult:
    """What :func:`replay` found.

    Attributes:
        peak_bytes: the largest total, constants included.
        peak_event: the event at the peak (``'forward 12 Convolution2D'``,
            ``'regenerate 7 ... for backward 9'``, ``'backward 3 ...'``,
            ``'update'``).
        constant_bytes: the plan-independent part (see
            :func:`state_constant_bytes`).
        events: event labels, in order.
        memory_bytes: the total at each event (int64), peaks of calls
            included.
        recomputed: nodes re-run in the backward (with repeats).
        recomputed_cost: their cost under the graph's cost model.
        used_peak_bytes: the largest total of live arrays (what CuPy's
            ``used_bytes()`` reads); equal to ``peak_bytes`` but on CuPy.
        pool_total_peak_bytes: on a graph recorded on CuPy, the largest
            ``total_bytes()`` of its memory pool (cached and split blocks
            included), which ``peak_bytes`` then is; None elsewhere.
    """

    peak_bytes: int
    peak_event: str
    constant_bytes: int
    events: Tuple[str, ...] = field(repr=False)
    memory_bytes: np.ndarray = field(repr=False)
    recomputed: int = 0
    used_peak_bytes: Optional[int] = None
    recomputed_cost: Optional[float] = None
    pool_total_peak_bytes: Optional[int] = None


def state_constant_bytes(graph: Graph) -> int:
    """Parameters, optimizer state, persistent arrays (BatchNorm
    statistics) and the caller's input arrays: present during the whole
    iteration whatever the plan (plus the gradients a
    ``backward(retain_grad=True)`` left on Variables the model keeps,
    ``step.retained_grad_bytes``, and a correction the runtime may have
    measured, ``step.correction_bytes``)."""
    sb = graph.state_bytes
    params = sb.get("params", graph.param_bytes)
    inputs = sum(a.nbytes for a in graph.arrays
                 if _caller_input(a) and a.view_of is None and not model_state_input(a))
    return int(params + sb.get("optimizer_state", 0) + sb.get("persistents", 0) + inputs
               + int(graph.step.retained_grad_bytes) + int(graph.step.correction_bytes))


def shared_bytes(graph: Graph) -> int:
    """What the calls of one step share whatever the moment: parameters,
    optimizer state, persistent arrays and a measured correction
    (:func:`state_constant_bytes` less the caller's inputs, which each call
    has of its own). The parameters' gradients, one set for the step too,
    vary from event to event: :func:`per_step` takes them per event."""
    sb = graph.state_bytes
    return int(sb.get("params", graph.param_bytes) + sb.get("optimizer_state", 0)
               + sb.get("persistents", 0) + int(graph.step.correction_bytes))


def step_calls(graph: Graph) -> int:
    """How many calls of the model one step holds at once
    (``step.calls_per_step``, 1 unless the runtime saw more). Each runs
    under the same plan; the replay counts each event's bytes above what
    the calls share ``k`` times (:func:`per_step`).

    >>> g = Graph.from_edges([4, 4], [(0, 1)])
    >>> step_calls(g), step_calls(g.with_step(calls_per_step=3))
    (1, 3)
    """
    return max(1, int(graph.step.calls_per_step))


def whole_calls(graph: Graph) -> int:
    """How many of a step's :func:`step_calls` calls hold their whole graph
    (``step.whole_calls_per_step``: a penalty's call backpropagated
    with double backprop inside the step releases nothing from then on);
    0 without one call's plain peak (``step.whole_call_peak_bytes``)."""
    if graph.step.whole_call_peak_bytes is None:
        return 0
    return max(0, min(step_calls(graph) - 1, int(graph.step.whole_calls_per_step)))


def accumulation_bytes(node: Any, arrays: Any) -> int:
    """What a step of several calls adds at the backward of ``node``
    beyond one call's replay: the calls' backward passes meet at its
    parameters, whose gradient one call made first; each later call's
    backward makes new gradients for them (their bytes) and adds each to
    the step's, one parameter at a time (the largest one's sum), before
    both parts go. Used by both replay engines."""
    params = [arrays[a].nbytes for a in dict.fromkeys(node.inputs + node.inner_params)
              if arrays[a].kind == "param"]
    return sum(params) + max(params, default=0)


def per_step(graph: Graph, memory: Any, once: Any = 0, acc: Any = 0) -> Any:
    """One call's replayed ``memory`` (bytes, or an array of them by
    event) as the step of ``k`` = :func:`step_calls` calls holds it, ``d``
    = :func:`whole_calls` of them holding their whole graph, bounded by one
    call's plain peak ``P``: ``memory + (k - 1 - d)·(memory - shared -
    once) + d·(P - shared) + acc`` (``acc`` only where ``k > 1``).

    ``shared`` is :func:`shared_bytes`; ``once`` (by event, like
    ``memory``) what of the event the step holds once, not once per call:
    the parameters' gradients alive then and the optimizer update's
    temporary; ``acc``: :func:`accumulation_bytes` at backward events. The
    calls' backward passes run together, Chainer's backward taking every
    call's functions of a rank before those of the next one, so each event
    of the step holds every call at that event. (Without ``once`` each
    call's gradients are counted once per call: a bound.) Monotone in
    ``memory``.

    >>> g = Graph.from_edges([4, 4], [(0, 1)]).with_step(calls_per_step=2)
    >>> per_step(g, shared_bytes(g) + 100) - shared_bytes(g)
    200
    >>> per_step(g, shared_bytes(g) + 100, once=60) - shared_bytes(g)
    140
    >>> g = g.with_step(calls_per_step=3, whole_calls_per_step=1,
    ...                 whole_call_peak_bytes=shared_bytes(g) + 500)
    >>> per_step(g, shared_bytes(g) + 100) - shared_bytes(g)
    700
    """
    k = step_calls(graph)
    if k == 1:
        return memory
    shared = shared_bytes(graph)
    d = whole_calls(graph)
    whole = d * (int(graph.step.whole_call_peak_bytes or 0) - shared) if d else 0
    return memory + (k - 1 - d) * (memory - shared - once) + whole + acc


def outside_bytes(graph: Graph) -> Tuple[int, int]:
    """What the caller's own work between the model's forward and its
    backward allocates (a loss computed outside the model, a target
    network's forward), as the recording measured it: the peak above the
    level at the forward's end, and what is still held when the backward
    begins (kept until the iteration's end: the caller's graph lives
    through the update). Both 0 where nothing was measured there."""
    return (int(graph.step.outside_peak_bytes),
            int(graph.step.outside_held_bytes))


def unrecorded_peaks(graph: Graph) -> List[int]:
    """The peak of the unrecorded work before each node (``n + 1``
    entries: the last one after the last node), above the level where it
    began (see :attr:`~chainer_recompute.core.graph.Node.unrecorded_peak_bytes`).

    >>> unrecorded_peaks(Graph.from_edges([4, 4], [(0, 1)]))
    [0, 0, 0]
    """
    return ([int(node.unrecorded_peak_bytes) for node in graph.nodes]
            + [int(graph.step.unrecorded_tail_peak_bytes)])


def unrecorded_label(graph: Graph, i: int) -> str:
    """The replay's event label of the unrecorded work before node ``i``."""
    if i < graph.n:
        return f"unrecorded work before {i} {graph.nodes[i].op}"
    return "unrecorded work after the last function"


def lifetimes(graph: Graph) -> Tuple[Dict[int, List[int]], Dict[int, List[int]],
                                     Dict[int, List[int]]]:
    """When the forward's arrays come and go by the caller's references:
    ``dies`` (position -> arrays whose reference is dropped before node
    ``position``, ``n`` and ``n + 1`` around the unrecorded work after the
    last node), ``made`` (position -> arrays that unrecorded work made
    there) and ``temporaries`` (node -> arrays without a producer that live
    only while it runs: noise, a raw array made in the forward)."""
    dies: Dict[int, List[int]] = {}
    made: Dict[int, List[int]] = {}
    temporaries: Dict[int, List[int]] = {}
    for a in graph.arrays:
        if a.made_at is not None:
            made.setdefault(a.made_at, []).append(a.id)
        if (a.producer is not None or a.made_at is not None) and a.dies_at is not None:
            dies.setdefault(a.dies_at, []).append(a.id)
    for node in graph.nodes:
        for a in node.inputs:
            info = graph.arrays[a]
            if (info.kind == "input" and info.dies_at is not None and not info.name
                    and info.made_at is None):
                temporaries.setdefault(node.id, []).append(a)
    return dies, made, temporaries


def backward_steps(graph: Graph) -> List[int]:
    """The nodes whose backward runs, in the order it runs
    (:meth:`~chainer_recompute.core.graph.Graph.backward_steps`)."""
    return graph.backward_steps()


def param_grad_bytes(graph: Graph) -> int:
    """Bytes of the parameters' gradients."""
    sb = graph.state_bytes
    return int(sb.get("param_grads", sb.get("params", graph.param_bytes)))


def update_bytes(graph: Graph) -> int:
    """What the optimizer's update adds to the step: its largest temporary
    (``update_transient``), and the gradients of the parameters that no
    backward made, which Chainer's ``GradientMethod.update`` allocates as
    zeros before it updates (``reallocate_cleared_grads``: a part of the
    model run under ``no_backprop_mode``, a Link the forward did not
    call); none where the loop's gradients are alive into the backward
    (``step.grads_in_backward``: those are there already).

    >>> g = Graph.from_edges([4], []).with_step(state_bytes={"update_transient": 8})
    >>> update_bytes(g), update_bytes(g.with_step(state_bytes={"update_transient": 8,
    ...                                                        "param_grads": 40}))
    (8, 48)
    """
    transient = int(graph.state_bytes.get("update_transient", 0))
    if graph.step.grads_in_backward:
        return transient
    return transient + max(0, param_grad_bytes(graph) - graph.param_grad_bytes_read)


class _Memory:
    """Buffers with the reasons they are alive, attribute arrays and
    gradients; the running total, and on a graph recorded on CuPy
    (``step.allocator == 'cupy'``) the pool's total bytes too
    (:class:`~chainer_recompute.core.pool.PoolModel`)."""

    def __init__(self, graph: Graph, base: int) -> None:
        self.graph = graph
        self.owner = [a.id if a.view_of is None else a.view_of for a in graph.arrays]
        # the buffer each array is in now: its owner's, or after a
        # regeneration that made the owner again while views of the old
        # one were still held, the owner's second buffer (``n + owner``;
        # see :meth:`remake`)
        self.n_arrays = len(graph.arrays)
        self.cur = list(self.owner)
        # Buffers of parameters and of the caller's inputs (and views of
        # them) are in the constant: holding them adds nothing.
        self.constant = {a.id for a in graph.arrays
                         if a.kind == "param" or _caller_input(a)}
        self.holders: Dict[int, Set[Tuple[int, str]]] = {}  # buffer -> {(array, reason)}
        self.attrs: Dict[Tuple[int, str], int] = {}
        self.level = 0
        self.pool: Optional[PoolModel] = PoolModel() if graph.step.allocator == "cupy" \
            else None
        self._handles: Dict[Any, int] = {}
        self.events: List[str] = []
        self.trace: List[int] = []
        self.used_trace: List[int] = []
        # the parameters' gradients alive (old and new), and by event what a
        # step of several calls holds once and adds (see per_step)
        self.param_grads = 0
        self.once: List[int] = []
        self.acc: List[int] = []
        self.alloc("base", base)

    def alloc(self, key: Any, nbytes: int) -> None:
        self.level += nbytes
        # (a key is a string, or a tuple whose first item is its kind)
        if key == "old grads" or key[0] == "param grads":
            self.param_grads += nbytes
        if self.pool is not None:
            self._handles[key] = self.pool.alloc(nbytes)

    def free(self, key: Any, nbytes: int, whole: bool = True) -> None:
        """``nbytes`` of ``key``'s let go; its pool block only when
        ``whole`` (a part of it: the block stays, as the pool caches it)."""
        self.level -= nbytes
        if key == "old grads" or key[0] == "param grads":
            self.param_grads -= nbytes
        if self.pool is not None and whole:
            self.pool.free(self._handles.pop(key, -1))

    def record(self, label: str, extra: int = 0, once: int = 0, acc: int = 0) -> None:
        """One event; ``extra``: the call's transient, allocated and freed
        in it (``once`` of it the step's, not each call's; ``acc``: see
        :func:`per_step`)."""
        self.events.append(label)
        self.once.append(self.param_grads + once)
        self.acc.append(acc)
        used = self.level + extra
        self.used_trace.append(used)
        if self.pool is not None:
            h = self.pool.alloc(extra)
            used = max(used, self.pool.total_bytes)
            self.pool.free(h)
        self.trace.append(used)

    def buffer_array(self, buf: int) -> Any:
        """The array whose bytes buffer ``buf`` takes."""
        return self.graph.arrays[buf % self.n_arrays] if self.n_arrays else None

    def hold(self, a: int, why: str) -> None:
        if self.owner[a] in self.constant:
            return
        buf = self.cur[a]
        held = self.holders.get(buf)
        if held is None:
            held = self.holders[buf] = set()
            self.alloc(("buf", buf), self.buffer_array(buf).owned_bytes)
        held.add((a, why))

    def drop(self, a: int, why: str) -> None:
        buf = self.cur[a]
        held = self.holders.get(buf)
        if held is None:
            return
        held.discard((a, why))
        if not held:
            del self.holders[buf]
            self.free(("buf", buf), self.buffer_array(buf).owned_bytes)

    def alive(self, a: int) -> bool:
        if self.owner[a] in self.constant:
            return True
        return any(x == a for x, _ in self.holders.get(self.cur[a], ()))

    def remake(self, a: int) -> None:
        """Array ``a`` is made again by a regeneration. Held by nothing
        itself, it is a new buffer where its owner's old one is still held
        by views of it (a checkpoint that is a ``Reshape`` of a dropped
        output keeps that output's memory): it goes to the owner's other
        buffer, and the views made after it, to the owner's buffer then.
        (Two buffers per owner at most; a third is counted in the second.)"""
        r = self.owner[a]
        if r in self.constant or any(x == a for x, _ in self.holders.get(self.cur[a], ())):
            return
        if r != a:
            self.cur[a] = self.cur[r]
        elif self.cur[a] in self.holders:
            other = a + self.n_arrays if self.cur[a] == a else a
            if other not in self.holders:
                self.cur[a] = other

    def set_attr(self, key: Tuple[int, str], nbytes: int) -> None:
        if key not in self.attrs:
            self.attrs[key] = nbytes
            self.alloc(("attr", key), nbytes)

    def clear_attr(self, key: Tuple[int, str]) -> None:
        if key in self.attrs:
            self.free(("attr", key), self.attrs.pop(key))


class _Gradients:
    """Gradient buffers, shared by the arrays whose gradient they are."""

    def __init__(self, mem: "_Memory") -> None:
        self.mem = mem
        self.of: Dict[int, Set[int]] = {}  # array -> buffer ids
        self.size: Dict[int, int] = {}
        self.refs: Dict[int, int] = {}
        self._next = 0

    def has(self, a: int) -> bool:
        return a in self.of

    def buffers_of(self, outs: Sequence[int]) -> Set[int]:
        return set().union(*(self.of.get(a, set()) for a in outs)) if outs else set()

    def new(self, a: int, nbytes: int) -> None:
        b = self._next
        self._next += 1
        self.size[b], self.refs[b] = nbytes, 0
        self.mem.alloc(("grad", b), nbytes)
        self._ref(a, {b})

    def share(self, a: int, bufs: Set[int]) -> None:
        self._ref(a, bufs)

    def replace(self, a: int, nbytes: int) -> int:
        """``a``'s gradient becomes a new array of ``nbytes``; returns the
        bytes this adds, net of what its old buffers freed."""
        before = self.mem.level
        self.drop([a])
        self.new(a, nbytes)
        return self.mem.level - before

    def _ref(self, a: int, bufs: Set[int]) -> None:
        have = self.of.setdefault(a, set())
        for b in bufs - have:
            self.refs[b] += 1
        have |= bufs

    def drop(self, arrays: Sequence[int]) -> None:
        for a in arrays:
            for b in self.of.pop(a, ()):
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    self.mem.free(("grad", b), self.size.pop(b))
                    del self.refs[b]


def old_grads_left(mem: Any, param_new: int, old: int) -> int:
    """``step.grads_in_backward``: the old gradients' bytes left after a
    backward call that made ``param_new`` bytes of first parameter
    gradients, each replacing its parameter's old one (let go from ``mem``;
    the pool's block with the last of them)."""
    part = min(param_new, old)
    if part:
        mem.free("old grads", part, whole=part == old)
    return old - part


def backward_gradients(node: Any, arrays: Any, nodes: Any, grads: "_Gradients",
                       made: set, grads_alive: bool = False) -> Tuple[int, int]:
    """The gradients one backward call makes, entered into ``grads``: the
    new parameter gradients' bytes (``made``: the parameters that already
    have one, updated) and the call's transient bytes beyond them. With
    ``grads_alive`` (``step.grads_in_backward``) each new parameter
    gradient is added to the old one, whose bytes the caller lets go after
    the call: the sum is a transient. Used by the replay and, once per
    graph, by the compiled replay's context."""
    # Inputs that get a gradient: arrays made by a function with a
    # backward (an array computed only from inputs that need no
    # gradient, such as a reshape of the data, gets none).
    targets = [a for a in dict.fromkeys(node.inputs)
               if arrays[a].producer is not None and nodes[arrays[a].producer].has_backward]
    params = [a for a in dict.fromkeys(node.inputs + node.inner_params)
              if arrays[a].kind == "param"]
    first = [a for a in params if a not in made]
    made.update(first)
    param_new = sum(arrays[a].nbytes for a in first)
    if grads_alive and first:
        # the old gradient, the new one and their sum, before both parts go
        # (Chainer's ``_reduce`` after the backward call, one parameter at
        # a time): the largest parameter's sum on top of the call's gradients
        extra_sum = max(arrays[a].nbytes for a in first)
    else:
        extra_sum = 0
    fresh = [a for a in targets if not grads.has(a)]
    accumulated = [a for a in targets if grads.has(a)]
    extra = node.backward_transient_bytes
    if extra is None:  # a sum is made before its parts go
        extra = sum(arrays[a].nbytes for a in accumulated)
    extra = max(extra, extra_sum)  # (the sums come after the call's own transient)
    # An accumulated gradient becomes a new array, the sum; its parts
    # are let go (freeing what nothing else shares).
    acc_net = sum(grads.replace(a, arrays[a].nbytes) for a in accumulated)
    if node.backward_alloc_bytes is not None:
        # measured: the input gradients it made, net of sums it replaced
        act = max(0, node.backward_alloc_bytes - param_new - acc_net)
    else:
        act = sum(arrays[a].nbytes for a in fresh)
    # Inputs that get new arrays, the largest first, as far as the
    # measured allocation goes; the others get the output gradient
    # itself or a view of it (Add returns gy for both inputs, Reshape
    # a view), sharing its buffer.
    out_bufs = grads.buffers_of(node.outputs)
    left = act
    for a in sorted(fresh, key=lambda x: -arrays[x].nbytes):
        nb = arrays[a].nbytes
        if left >= nb // 2 or not out_bufs:
            grads.new(a, min(nb, left) if left < nb else nb)
            left -= min(nb, left)
        else:
            grads.share(a, out_bufs)
    if left > 0 and fresh:  # more than the gradients' sizes: keep it on the first
        grads.new(fresh[0], left)
    return param_new, extra


def graph_gone_at_update(graph: Graph) -> bool:
    """Whether nothing of the graph is left at the optimizer's update: the
    caller held nothing of it but what the forward returned (the loss;
    ``optimizer.update`` drops it after the backward), and the model keeps
    no output of it either (``step.kept_after_backward``: a loss link's
    ``self.loss``, which keeps the whole graph and what its functions still
    hold, dropout masks included, into the next call). A model that keeps
    another output (``Classifier.y``) keeps it alive too."""
    returned = set(graph.step.returned)
    if not returned or graph.step.kept_after_backward:
        return False
    return not any((a.producer is not None or a.made_at is not None) and a.dies_at is None
                   and a.id not in returned for a in graph.arrays)


def _caller_input(info: Any) -> bool:
    """An array the caller passed in, or a persistent array of the model
    read as an input (counted in the constant)."""
    return info.kind == "input" and bool(info.name)


def model_state_input(info: Any) -> bool:
    """A persistent array of the model that a function read as an input
    (named by its path, ``/predictor/conv1/mask``, as a parameter is):
    the same array at every call and counted in ``state_bytes``'
    ``persistents``, not among the caller's inputs."""
    return info.kind == "input" and info.name.startswith("/")


def held_caller_input_bytes(graph: Graph) -> int:
    """The caller's inputs that a graph held into the model's next call
    (``step.held_into_next_forward``) keeps alive through that call's
    forward: those a function retains for its backward (a ``Linear``'s
    ``x``). The next call's inputs are new arrays, counted in its constant;
    the previous ones live on in the kept graph, whether or not the loop
    still holds them. (The model's persistent arrays are the same arrays
    in the next call.)"""
    arrays = graph.arrays
    bufs = set()
    for node in graph.nodes:
        for a in node.retained_inputs:
            b = a if arrays[a].view_of is None else arrays[a].view_of
            if _caller_input(arrays[b]) and not model_state_input(arrays[b]):
                bufs.add(b)
    return sum(arrays[b].nbytes for b in bufs)


def held_through_forward(graph: Graph, own: int) -> int:
    """What an earlier call's graph holds through this graph's forward:
    ``own``, what this graph holds after its backward (where
    ``step.held_into_next_forward``: the model's previous call of this
    signature), or a graph of another signature
    (``step.held_other_bytes``), the larger. Used by both replay engines."""
    return max(int(own), int(graph.step.held_other_bytes))


def replay_engine(graph: Graph, min_nodes: Optional[int] = None) -> str:
    """The engine ``engine='auto'`` replays ``graph`` on: ``'numba'`` from
    ``min_nodes`` nodes where numba is installed and the graph was not
    recorded on CuPy, else ``'python'``. A caller that replays many plans
    of one graph passes fewer nodes (loading the compiled loop costs about
    as much as 30 replays of a 500-node graph in Python)."""
    return _engine(graph, None, min_nodes)


def _engine(graph: Graph, engine: Optional[str], min_nodes: Optional[int] = None) -> str:
    """``'numba'`` or ``'python'`` (see :data:`REPLAY_ENGINES`); ``auto``
    from ``min_nodes`` nodes (default :data:`KERNEL_MIN_NODES`)."""
    if min_nodes is None:
        min_nodes = KERNEL_MIN_NODES
    if engine not in (None,) + REPLAY_ENGINES:
        raise ValueError(f"unknown replay engine {engine!r}; accepted: {list(REPLAY_ENGINES)}")
    if graph.step.allocator == "cupy":
        if engine == "numba":
            raise ValueError("replay engine 'numba' does not model CuPy's memory pool: this "
                             "graph was recorded on CuPy; pass engine='auto' or 'python'")
        return "python"
    return pick_engine(engine, what="replay", reference="python",
                       pays=lambda: engine == "numba" or graph.n >= min_nodes)


def replay_peak(graph: Graph, dropped: Optional[np.ndarray] = None,
                block_of: Optional[np.ndarray] = None, *, release_mode: str = "none",
                engine: Optional[str] = None) -> int:
    """The peak of :func:`replay` for a plan given as arrays: ``dropped``
    (bool per node: :attr:`ExecutionPlan.dropped`) and ``block_of`` (each
    node's block); both ``None``: plain Chainer. What the budget search
    replays each candidate with (no :class:`ExecutionPlan` to build)."""
    if _engine(graph, engine) == "python":
        if dropped is None:
            return replay(graph, None, release_mode=release_mode, engine="python").peak_bytes
        return replay(graph, _ArrayPlan(graph, dropped, block_of), release_mode=release_mode,
                      engine="python").peak_bytes
    import sys
    from .kernels.replay import context_of, run_kernel
    ctx = context_of(graph, sys.modules[__name__])
    trace, kinds, us, ws, _ = run_kernel(ctx, dropped, block_of, release_mode)
    if ctx.k > 1:
        trace = per_step(graph, trace, *ctx.once_and_acc(kinds, us, ws))
    return int(trace.max())


class _ArrayPlan(ExecutionPlan):
    """The :class:`ExecutionPlan` of a plan given as ``dropped`` and
    ``block_of`` arrays (see :func:`replay_peak`)."""

    def __init__(self, graph: Graph, dropped: np.ndarray, block_of: np.ndarray) -> None:
        blocks: Dict[int, List[int]] = {}
        for v, b in enumerate(np.asarray(block_of).tolist()):
            blocks.setdefault(b, []).append(v)
        lower, acc = [], set()
        for b in sorted(blocks):
            acc |= set(blocks[b])
            lower.append(frozenset(acc))
        kept = frozenset(int(v) for v in np.flatnonzero(~np.asarray(dropped, dtype=bool)))
        super().__init__(graph, lower, kept)


def replay(graph: Graph, plan: Optional[ExecutionPlan] = None, *,
           release_mode: str = "none", engine: Optional[str] = None) -> ReplayResult:
    """Replay one iteration of ``graph`` under ``plan`` (``None``: plain
    Chainer) and return its memory.

    Args:
        graph: a recorded graph (views, lifetimes, transients and the
            backward order are used where recorded; without a recorded
            order, backward runs in reverse node order).
        plan: the execution plan (its ``backward_order``, where it has one,
            instead of the graph's).
        release_mode: what the executor releases after the last backward
            reader of a node (see :data:`RELEASE_MODES`).
        engine: see :data:`REPLAY_ENGINES` (the same result from each).

    >>> from chainer_recompute.core.execution import ExecutionPlan
    >>> g = Graph.from_edges([4, 4, 4], [(0, 1), (1, 2)])
    >>> replay(g).peak_bytes > 0
    True
    """
    if release_mode not in RELEASE_MODES:
        raise ValueError(f"unknown release mode {release_mode!r}; accepted: {list(RELEASE_MODES)}")
    if plan is not None and plan.backward_order is not None:
        from .backward_order import in_order
        graph = in_order(graph, plan.backward_order)
    if _engine(graph, engine) == "numba":
        return _replay_compiled(graph, plan, release_mode)
    n = graph.n
    arrays = graph.arrays
    nodes = graph.nodes
    constant = state_constant_bytes(graph)
    old_grads = param_grad_bytes(graph) if graph.step.grads_in_forward else 0
    mem = _Memory(graph, constant)
    mem.alloc("old grads", old_grads)
    # the random states kept for the drawn attributes the plan releases
    # (ExecutionPlan.drawn), over the whole iteration (and a graph held into
    # the next call holds its own, below)
    states = 0 if plan is None else RNG_STATE_BYTES * len(plan.drawn.keys() & plan.dropped)
    mem.alloc("random states", states)
    dropped: FrozenSet[int] = plan.dropped if plan is not None else frozenset()
    # Which outputs have their data held in their node (a consumer retains
    # them): those come back on regeneration.
    retained_by: Dict[int, int] = {}
    for node in nodes:
        for a in node.retained_inputs:
            retained_by[a] = retained_by.get(a, 0) + 1
        for a in node.retained_outputs:
            retained_by[a] = retained_by.get(a, 0) + 1
    dies, made, temporaries = lifetimes(graph)
    before = unrecorded_peaks(graph)
    released: Set[int] = set()

    def held_attrs(u: int) -> List[Tuple[str, int, bool]]:
        # (remade: released with the node and made again; a drawn one only
        # where the plan drops the node, which keeps its random state: the
        # executor keeps the draw of a kept node released after its last
        # backward reader, runtime/executor.py's _remade)
        return [(h.name, h.nbytes, h.remade and (u in dropped or not h.redrawn))
                for h in nodes[u].held if h.role != "written"]

    def release(u: int) -> None:
        for a in nodes[u].outputs:
            mem.drop(a, "ret")
            mem.drop(a, "pin")
        for name, _, remade in held_attrs(u):
            if remade:
                mem.clear_attr((u, name))
        released.add(u)

    # ------------------------------------------------------------ forward
    def unrecorded(i: int) -> None:
        # work the forward did with backprop disabled before node i (after
        # the last node: i == n), then the arrays it made that the
        # recorded functions read
        if before[i]:
            mem.record(unrecorded_label(graph, i), before[i])
        for a in made.get(i, ()):
            mem.hold(a, "var")

    for i in range(n):
        node = nodes[i]
        for a in dies.get(i, ()):
            mem.drop(a, "var")
        unrecorded(i)
        if plan is not None:
            for u in plan.release_at.get(i, ()):
                release(u)
        for a in temporaries.get(i, ()):
            mem.hold(a, "var")
        if i in dropped:
            for j in plan.sources[i]:  # type: ignore[union-attr]
                a = node.inputs[j]
                if arrays[a].kind != "param" and not _caller_input(arrays[a]):
                    mem.hold(a, "pin")
        for a in node.outputs:
            mem.hold(a, "var")
        for a in node.retained_outputs:
            mem.hold(a, "ret")
        for a in node.retained_inputs:
            if arrays[a].kind != "param" and not _caller_input(arrays[a]):
                mem.hold(a, "ret")
        for name, nbytes, _ in held_attrs(i):
            mem.set_attr((i, name), nbytes)
        mem.record(f"forward {i} {node.op}", node.forward_transient_bytes or 0)
        for a in temporaries.get(i, ()):
            mem.drop(a, "var")
        for a in node.outputs:
            if arrays[a].dies_at is not None and arrays[a].dies_at <= i + 1:
                mem.drop(a, "var")
    for a in dies.get(n, ()):
        mem.drop(a, "var")
    unrecorded(n)
    for a in dies.get(n + 1, ()):
        mem.drop(a, "var")
    if plan is not None:
        for u in plan.release_at.get(n, ()):
            release(u)
    outside_peak, outside_held = outside_bytes(graph)
    # the caller's work between the forward and the backward, with the
    # previous gradients still there as when it was measured
    mem.record("end of forward", outside_peak)
    alive = graph.step.grads_in_backward  # (each let go at its parameter's first reader)
    if not alive:
        mem.free("old grads", old_grads)  # cleared before the backward
    mem.alloc("outside", outside_held)  # held by the caller's graph to the end
    grads_made: Set[int] = set()
    grads = _Gradients(mem)
    several = step_calls(graph) > 1

    # ----------------------------------------------------------- backward
    order = backward_steps(graph)
    remaining: Dict[int, int] = {}
    if plan is not None:
        for w in order:
            for u in plan.done.get(w, ()):
                remaining[u] = remaining.get(u, 0) + 1
    recomputed = 0
    recomputed_cost = 0.0
    inner: FrozenSet[int] = plan.inner if plan is not None else frozenset()
    nested = bool(inner)

    def available(a: int, values: Set[int]) -> bool:
        info = arrays[a]
        return info.kind == "param" or _caller_input(info) or a in values or mem.alive(a)

    def regenerate(w: int, targets: List[int]) -> None:
        nonlocal recomputed, recomputed_cost
        assert plan is not None
        wanted = set(targets)
        block = plan.block_of[w]  # (a nested plan keeps the inner nodes of its open segments)
        for b in {plan.block_of[u] for u in targets}:
            for u in plan.block_nodes.get(b, ()):
                if u in released and remaining.get(u, 0) > 0:
                    wanted.add(u)
        values: Set[int] = set()
        order_: Set[int] = set()
        stack = sorted(wanted)
        while stack:
            u = stack.pop()
            if u in order_:
                continue
            order_.add(u)
            for a in nodes[u].inputs:
                p = arrays[a].producer
                if not available(a, values) and p is not None:
                    stack.append(p)
        steps = sorted(order_)
        last = (regeneration_frees(steps, lambda u: nodes[u].inputs, lambda u: nodes[u].outputs)
                if nested else {})
        for u in steps:
            for a in nodes[u].outputs:
                mem.remake(a)
                mem.hold(a, "val")
                values.add(a)
            for name, nbytes, remade in held_attrs(u):
                if remade:
                    mem.set_attr((u, name), nbytes)
            mem.record(f"regenerate {u} {nodes[u].op} for backward {w}",
                       nodes[u].forward_transient_bytes or 0)
            recomputed += 1
            recomputed_cost += float(graph.node_cost[u])
            if u in released and (u in wanted or (
                    u in inner and remaining.get(u, 0) > 0 and plan.keeps(u, block))):
                released.discard(u)
                for a in nodes[u].outputs:
                    if a in retained_by:
                        mem.hold(a, "ret")
                    if nested and a in plan.source_arrays:
                        mem.hold(a, "pin")
            else:
                for name, _, remade in held_attrs(u):
                    if remade:
                        mem.clear_attr((u, name))
            for a in last.get(u, ()):  # (nested) values read no more here
                mem.drop(a, "val")
                values.discard(a)
        for a in values:
            mem.drop(a, "val")

    regen_ok: Dict[int, bool] = {}  # as the executor, decided once per node

    def regenerable(u: int) -> bool:
        # Depth first over the producers of released inputs, with an explicit
        # stack: a chain of thousands of released nodes (a long unrolled RNN
        # in one block) is deeper than Python's recursion limit.
        known = regen_ok.get(u)
        if known is not None:
            return known
        regen_ok[u] = True  # provisional, against cycles
        stack = [[u, 0]]
        while stack:
            top = stack[-1]
            v, ins = top[0], nodes[top[0]].inputs
            ok, pushed = True, False
            while top[1] < len(ins):
                a = ins[top[1]]
                info = arrays[a]
                if info.kind == "param" or _caller_input(info) or mem.alive(a):
                    top[1] += 1
                    continue
                p = info.producer
                k = None if p is None else regen_ok.get(p)
                if p is not None and k is None:
                    regen_ok[p] = True  # provisional
                    stack.append([p, 0])
                    pushed = True
                    break
                if not k:
                    ok = False
                    break
                top[1] += 1
            if pushed:
                continue
            regen_ok[v] = ok
            stack.pop()
        return regen_ok[u]

    for w in order:
        node = nodes[w]
        if plan is not None:
            missing = [u for u in plan.needs.get(w, ()) if u in released]
            if missing:
                regenerate(w, missing)
        param_new, extra = backward_gradients(node, arrays, nodes, grads, grads_made, alive)
        mem.alloc(("param grads", w), param_new)
        mem.record(f"backward {w} {node.op}", extra,
                   acc=accumulation_bytes(node, arrays) if several else 0)
        if alive:
            old_grads = old_grads_left(mem, param_new, old_grads)
        grads.drop(node.outputs)
        if plan is not None:
            for u in plan.done.get(w, ()):
                remaining[u] = remaining.get(u, 0) - 1
            if release_mode != "all":
                for u in plan.done.get(w, ()):
                    if (remaining.get(u, 0) <= 0 and u in plan.releasable and u not in released
                            and (release_mode == "none" or u in dropped) and regenerable(u)):
                        release(u)
    # What the graph still holds after its backward: a graph held into the
    # model's next call (``step.held_into_next_forward``) holds it
    # through that call's forward, so the forward's events carry it too.
    held_end = held_through_forward(graph, (
        sum(mem.buffer_array(buf).nbytes for buf in mem.holders) + sum(mem.attrs.values())
        + held_caller_input_bytes(graph) + states) if graph.step.held_into_next_forward else 0)
    # The optimizer update: the graph is gone by then, or it still holds
    # what nothing released (see graph_gone_at_update).
    if graph_gone_at_update(graph):
        for buf in list(mem.holders):
            mem.free(("buf", buf), mem.buffer_array(buf).nbytes)
        mem.holders.clear()
        for key in list(mem.attrs):
            mem.clear_attr(key)
    update = update_bytes(graph)
    mem.record("update", update, once=update)
    trace = np.asarray(mem.trace, dtype=np.int64)
    used = np.asarray(mem.used_trace, dtype=np.int64)
    if held_end:
        end = mem.events.index("end of forward") + 1
        trace[:end] += held_end
        used[:end] += held_end
    once, acc = np.asarray(mem.once, dtype=np.int64), np.asarray(mem.acc, dtype=np.int64)
    trace = per_step(graph, trace, once, acc)
    k = int(np.argmax(trace)) if len(trace) else 0
    return ReplayResult(peak_bytes=int(trace[k]) if len(trace) else constant,
                        peak_event=mem.events[k] if mem.events else "",
                        constant_bytes=constant, events=tuple(mem.events),
                        memory_bytes=trace, recomputed=recomputed,
                        recomputed_cost=recomputed_cost,
                        used_peak_bytes=int(per_step(graph, used, once, acc).max())
                        if len(used) else constant,
                        pool_total_peak_bytes=(None if mem.pool is None else
                                               int(per_step(graph, mem.pool.peak_total_bytes))))


def _replay_compiled(graph: Graph, plan: Optional[ExecutionPlan],
                     release_mode: str) -> ReplayResult:
    import sys
    from .kernels.replay import REGENERATE, context_of, nesting_of, run_kernel
    ctx = context_of(graph, sys.modules[__name__])
    if plan is None:
        dropped = block_of = None
    else:
        dropped = np.zeros(graph.n, dtype=bool)
        dropped[list(plan.dropped)] = True
        block_of = np.asarray(plan.block_of, dtype=np.int64)
    nesting = nesting_of(ctx, plan) if plan is not None and plan.inner else None
    trace, kinds, us, ws, recomputed = run_kernel(ctx, dropped, block_of, release_mode, nesting)
    # (summed in the order of the events, as the Python engine sums)
    costs = np.cumsum(np.asarray(graph.node_cost, dtype=np.float64)[us[kinds == REGENERATE]])
    if ctx.k > 1:
        trace = per_step(graph, trace, *ctx.once_and_acc(kinds, us, ws))
    events = ctx.labels(kinds, us, ws)
    k = int(np.argmax(trace))
    return ReplayResult(peak_bytes=int(trace[k]), peak_event=events[k],
                        constant_bytes=ctx.constant, events=events, memory_bytes=trace,
                        recomputed=int(recomputed), used_peak_bytes=int(trace.max()),
                        recomputed_cost=float(costs[-1]) if len(costs) else 0.0,
                        pool_total_peak_bytes=None)


@dataclass(frozen=True)
class Floor:
    """What every schedule of one iteration holds at its fullest moment,
    however it recomputes (single-level, nested, at any depth): a lower
    bound of any plan's replayed peak (:func:`physical_floor`).

    Attributes:
        peak_bytes: the floor, ``state_bytes`` included.
        state_bytes: parameters, optimizer state, persistent arrays and the
            caller's inputs (:func:`state_constant_bytes`).
        grad_bytes: the parameters' gradients.
        event: where the floor is reached (``'backward 12 Convolution2D'``,
            ``'forward 3 ...'``, ``'update'``).
        working_bytes: at that event, what the function itself needs beyond
            the state and the gradients: the arrays its backward reads (or
            its forward's inputs and outputs) and its measured temporary.
        held_grad_bytes: at that event, the gradients alive: the
            parameters' made by then, and those of arrays whose reader's
            backward has run and whose own function's has not (the
            backward order holds them, whatever the plan; its outputs'
            and the inputs' it makes included).
    """

    peak_bytes: int
    state_bytes: int
    grad_bytes: int
    event: str
    working_bytes: int
    held_grad_bytes: int = 0


def physical_floor(graph: Graph) -> Floor:
    """The least any schedule of ``graph``'s iteration can hold at once,
    under the replay's memory model: the state (parameters, optimizer
    state, persistents, inputs) plus the most of

    - a function's forward: its inputs and outputs (views counted once, at
      their base) and its measured temporary;
    - a function's backward: what it reads (its retained inputs and outputs,
      the attribute arrays it keeps), its measured temporary, and the
      gradients alive then, as the replay counts them (the parameters'
      made by then, its output gradients and the input gradients it makes,
      and every other array's whose reader's backward has run and whose
      own function's has not: the graph's backward order, which every
      plan in that order runs, holds them; see
      :func:`least_floor` for the other order a plan may run in);
    - the optimizer's update: every gradient and the update's temporary.

    A recomputation, at any depth, can drop everything else but none of
    these: no plan replays below it (nor, up to the model's accuracy, runs
    below it). A step of several calls and the caller's own work are left
    out, so it is a bound, not a schedule.

    Args:
        graph: a recorded graph.

    Returns:
        A :class:`Floor`.

    >>> g = Graph.from_edges([4, 4, 4], [(0, 1), (1, 2)])
    >>> f = physical_floor(g)
    >>> f.peak_bytes <= replay(g).peak_bytes
    True
    """
    arrays, nodes = graph.arrays, graph.nodes

    def root(a: int) -> int:
        while arrays[a].view_of is not None:
            a = arrays[a].view_of
        return a

    def in_state(a: int) -> bool:
        return arrays[a].kind == "param" or _caller_input(arrays[a])

    def distinct(ids: Sequence[int]) -> int:
        roots = {root(a) for a in ids}
        return sum(arrays[r].nbytes for r in roots if not in_state(r))

    state = state_constant_bytes(graph)
    best = (0, "", 0)  # (bytes above the state, event, working bytes)
    for node in nodes:
        work = distinct(node.inputs + node.outputs) + int(node.forward_transient_bytes or 0)
        if work > best[0]:
            best = (work, f"forward {node.id} {node.op}", work)
    # the gradients, as the replay makes and lets them go (no plan moves
    # them: they follow the backward order alone)
    mem = _Memory(graph, 0)
    grads = _Gradients(mem)
    made: Set[int] = set()
    held = 0
    alive = graph.step.grads_in_backward  # (the old ones, each to its first reader)
    old = param_grad_bytes(graph) if alive else 0
    if old:
        mem.alloc("old grads", old)
    for v in backward_steps(graph):
        node = nodes[v]
        param_new, extra = backward_gradients(node, arrays, nodes, grads, made, alive)
        mem.alloc(("param grads", v), param_new)
        reads = distinct(node.retained_inputs + node.retained_outputs) + sum(
            h.nbytes for h in node.held if h.role != "written")
        work = reads + int(extra)
        if mem.level + work > best[0]:
            best, held = (mem.level + work, f"backward {v} {node.op}", work), mem.level
        old = old_grads_left(mem, param_new, old)
        grads.drop(node.outputs)
    all_grads = param_grad_bytes(graph)
    update = all_grads + int(graph.state_bytes.get("update_transient", 0))
    if update > best[0]:
        best = (update, "update", int(graph.state_bytes.get("update_transient", 0)))
        held = all_grads
    return Floor(peak_bytes=state + best[0], state_bytes=state, grad_bytes=all_grads,
                 event=best[1], working_bytes=best[2], held_grad_bytes=held)


def least_floor(graph: Graph) -> Floor:
    """:func:`physical_floor` over the orders a plan of ``graph`` may run
    in: its recorded one and, where
    :func:`~chainer_recompute.core.backward_order.reordered` allows it, the
    other one."""
    from .backward_order import reordered
    other = reordered(graph)
    floors = [physical_floor(g) for g in (graph, other) if g is not None]
    return min(floors, key=lambda f: f.peak_bytes)

