"""The computational graph that the solvers work on.

Pure core: numpy and networkx only, never chainer.

A :class:`Graph` holds the *arrays* of one forward pass (model inputs,
parameters, intermediates, outputs) and its *nodes*, one per function
application, with integer ids in topological (execution) order. In the
paper's terms (docs/paper.md §1) node ``v`` stands for the tensors its function
creates: ``M_v`` is the bytes of its outputs and ``T_v`` its cost under the
chosen cost model. An edge ``u -> v`` means that ``v``'s function reads an
output of ``u``. Model inputs and parameters are not nodes: they are always
in memory.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from fractions import Fraction
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .costs import node_costs, time_free_model
from .errors import GraphError
from .units import format_bytes

ARRAY_KINDS = ("input", "param", "intermediate", "output")


@dataclass(frozen=True)
class StepFacts:
    """What a graph records of the training step around its forward pass,
    beside its arrays and nodes: what the memory model replays
    (:mod:`~chainer_recompute.core.replay`) and what the runtime measured.
    Typed, immutable, one field per meaning: ``graph.with_step(...)`` gives
    a graph with some changed.

    Attributes:
        state_bytes: bytes that do not depend on the plan, as recorded:
            ``params``, ``param_grads``, ``optimizer_state``,
            ``update_transient``, ``persistents`` (see
            :attr:`Graph.state_bytes`); empty where not recorded (the
            authors' files).
        returned: the array ids the forward returned.
        kept_after_backward: the model keeps an output of its graph after
            the backward (an attribute): the graph is not gone at the update.
        grads_in_forward: the parameters' gradients of the previous step
            are alive through the forward (a loop that clears them after).
        grads_in_backward: ... and into the backward (a loop that zeroes
            them with ``zerograds``, or accumulates several calls'
            gradients before one update): each parameter's is let go at
            its first backward reader, replaced by the sum of it and the
            new gradient.
        held_into_next_forward: the graph is held into the model's next
            call: what it holds after its backward is alive through the
            next forward.
        held_other_bytes: what the graph of an earlier call of another
            input signature (a loop that keeps its ``loss`` while the
            shapes change from batch to batch) holds through this
            graph's forward, the most seen; the replay counts the larger
            of it and this graph's own (``held_into_next_forward``).
        outside_peak_bytes, outside_held_bytes: what the caller's work
            between the forward and the backward allocates: its peak above
            the forward's end, and what is still held when the backward
            begins. Scaled with the graph.
        retained_grad_bytes: the gradients of the graph's Variables that the
            model keeps in attributes (``self.h = h``) and that a
            ``backward(retain_grad=True)`` left on them: alive after the
            backward, through the update and into the next call until the
            model sets those attributes again, so counted through the whole
            step (an overestimate only between that moment and the
            backward that makes the new ones). Scaled with the graph.
        unrecorded_tail_peak_bytes: the peak of work the forward did after
            its last recorded function with functions it did not record
            (applied with backprop disabled). Scaled with the graph.
        calls_per_step: how many calls of the model one training step
            holds at once (a WGAN-GP critic: 3); see
            :func:`~chainer_recompute.core.replay.step_calls`.
        whole_calls_per_step, whole_call_peak_bytes: how many of those hold
            their whole graph (a penalty's call backpropagated with double
            backprop inside the step), and one call's plain peak, which
            bounds what such a call holds.
        correction_bytes: what a measured step missed, added to every
            replayed event (the runtime's correction).
        allocator: ``'numpy'``, or ``'cupy'`` for a graph recorded on
            CuPy (its replay models the memory pool).
        plain_measured_bytes, plain_measured_at: plain Chainer's peak as the
            recording (or the captures, at the batch sizes ``at``) measured it.
        workspace_bytes, workspace_exact: the convolutions' workspace bound
            the graph's transients are under (None: unbounded), and whether
            chunks are sized exactly (see :mod:`~chainer_recompute.core.workspace`).
        derived_from: the input dimensions of the recorded shapes this
            graph's sizes were derived from (None: recorded or captured).
        closed_backward: the recorded backward ran from the graph's own
            returned scalar (its loss), and no array a recorded function
            read with a gradient was made outside the graph: its backward
            may run in another order with the same gradients
            (:mod:`~chainer_recompute.core.backward_order`).

    >>> StepFacts().calls_per_step, StepFacts(correction_bytes=8).correction_bytes
    (1, 8)
    """

    state_bytes: Mapping[str, int] = field(default_factory=dict)
    returned: Tuple[int, ...] = ()
    kept_after_backward: bool = False
    grads_in_forward: bool = True
    grads_in_backward: bool = False
    held_into_next_forward: bool = False
    held_other_bytes: int = 0
    outside_peak_bytes: int = 0
    outside_held_bytes: int = 0
    unrecorded_tail_peak_bytes: int = 0
    retained_grad_bytes: int = 0
    calls_per_step: int = 1
    whole_calls_per_step: int = 0
    whole_call_peak_bytes: Optional[int] = None
    correction_bytes: int = 0
    allocator: str = "numpy"
    plain_measured_bytes: Optional[int] = None
    plain_measured_at: Optional[Tuple[int, ...]] = None
    workspace_bytes: Optional[int] = None
    workspace_exact: bool = False
    derived_from: Optional[Tuple[int, ...]] = None
    closed_backward: bool = False

    #: the fields scaled with the graph's batch size, as its transients are
    SCALED = ("outside_peak_bytes", "outside_held_bytes", "unrecorded_tail_peak_bytes",
              "retained_grad_bytes")

    def __post_init__(self) -> None:
        for name in ("returned", "plain_measured_at", "derived_from"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, tuple):
                object.__setattr__(self, name, tuple(int(x) for x in v))
        object.__setattr__(self, "state_bytes",
                           {k: int(v) for k, v in dict(self.state_bytes).items()})

    @classmethod
    def split(cls, meta: Mapping[str, Any]) -> Tuple["StepFacts", Dict[str, Any]]:
        """The facts among ``meta``'s keys (the files of earlier versions
        kept them there, by the same names), and the rest (notes)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return (cls(**{k: v for k, v in meta.items() if k in names}),
                {k: v for k, v in meta.items() if k not in names})

    def as_dict(self) -> Dict[str, Any]:
        """The fields that differ from their defaults, JSON-able."""
        default = StepFacts()
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v != getattr(default, f.name):
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


@dataclass(frozen=True)
class ArrayInfo:
    """One array of the forward pass.

    Attributes:
        id: index in ``Graph.arrays``.
        shape: the array's shape, or ``None`` where unknown (authors' files).
        dtype: numpy dtype name, or ``''`` where unknown.
        nbytes: size in bytes.
        kind: one of ``input``, ``param``, ``intermediate``, ``output``.
        producer: id of the node that created it (``None`` for inputs and
            parameters).
        name: parameter path (``/predictor/conv1/W``); for an input, the
            caller's argument (its index: ``0``, ``1.x`` in a tuple or
            dict), the path of a persistent array of the model that a
            function reads (``/predictor/conv1/mask``: counted in
            ``state_bytes``' ``persistents``), or ``''`` (an array the
            forward made).
        view_of: the array whose memory this one shares (a ``reshape``,
            ``transpose``, ``split_axis`` or basic-slice output); ``None``
            when it owns its memory. A view costs no bytes of its own.
        dies_at: for arrays made by the forward pass, the index of the node
            before which the caller's last reference (its ``Variable``) was
            gone; ``None`` when it was still referenced when the forward
            returned (the loss, outputs the model keeps for logging). What
            Chainer retains for backward lives on regardless. A caller's
            reference that went away while work the recording did not
            record was running before node ``v`` (see ``made_at``) counts
            from ``v + 1`` (it may have been there at that work's peak);
            so ``dies_at`` may be ``n + 1``.
        made_at: for an array the forward made with functions it did not
            record (applied with backprop disabled: a frozen teacher's
            output that a recorded function reads), the index of the node
            before which that work ran (``n``: after the last one); ``None``
            for every other array. Such an array is an ``input`` without a
            name: it lives from there to ``dies_at`` (or as long as a
            function retains it).
    """

    id: int
    shape: Optional[Tuple[int, ...]]
    dtype: str
    nbytes: int
    kind: str
    producer: Optional[int] = None
    name: str = ""
    view_of: Optional[int] = None
    dies_at: Optional[int] = None
    buffer_bytes: Optional[int] = None
    made_at: Optional[int] = None

    @property
    def owned_bytes(self) -> int:
        """Bytes this array allocates itself: 0 for a view, the whole
        buffer for an array that is a strided view of a larger private
        buffer (a ``Deconvolution2D`` output), else ``nbytes``."""
        if self.view_of is not None:
            return 0
        return self.nbytes if self.buffer_bytes is None else self.buffer_bytes


@dataclass(frozen=True)
class HeldArray:
    """An array a function object keeps in its own attributes for backward
    (a dropout mask, max-pooling indexes, BatchNorm statistics).

    ``role`` says what a recomputation must do with it: ``derived`` arrays
    are made again by the function's forward (released with the node),
    ``drawn`` ones too, from NumPy's global random state as it was before
    the forward (a dropout mask: the executor keeps that state, about
    :data:`RNG_STATE_BYTES`, instead), ``state`` arrays must be kept,
    ``written`` arrays are pre-existing arrays the forward updates in place
    (detached during a recomputation; not counted as held bytes).
    """

    name: str
    shape: Optional[Tuple[int, ...]]
    dtype: str
    nbytes: int
    role: str = "state"

    @property
    def remade(self) -> bool:
        """Whether a plan releases it with its node and a regeneration
        makes it again: ``derived``, and ``drawn`` when larger than the
        random state that replaces it (a smaller one is kept).

        >>> HeldArray("mask", (8, 64), "float32", 2048, "drawn").remade
        False
        """
        return self.role == "derived" or self.redrawn

    @property
    def redrawn(self) -> bool:
        """A ``drawn`` attribute a plan releases: larger than the random
        state the executor keeps instead."""
        return self.role == "drawn" and self.nbytes > RNG_STATE_BYTES


#: what the executor keeps per released ``drawn`` attribute: NumPy's global
#: random state, whose array is MT19937's 624 32-bit words (the rest, a few
#: Python objects, the meter does not see)
RNG_STATE_BYTES = 2496


@dataclass(frozen=True)
class Node:
    """One function application.

    Attributes:
        id: index in ``Graph.nodes``; topological order.
        op: the function's class name (``Convolution2DFunction``).
        inputs / outputs: array ids.
        retained_inputs / retained_outputs: array ids that Chainer keeps
            alive for this function's backward.
        held: arrays kept in the function object's attributes.
        forward_time_s / backward_time_s: measured times, if profiled.
        recomputable: False where re-running the function is not safe.
        label: free text (Chainer's function label; the authors' node
            number for their graphs).
        attrs: JSON-able function attributes (stride, pad, ...).
        forward_transient_bytes / backward_transient_bytes: the largest
            temporary memory of one forward / backward call above what it
            leaves allocated (im2col buffers, workspaces), measured by the
            allocator; ``None`` where not measured.
        backward_alloc_bytes: bytes the backward call leaves allocated (the
            input gradients it makes, less gradients it replaced by their
            sum; may be negative), measured; ``None`` where not measured.
        has_backward: False when no input requires a gradient, so Chainer
            never runs this function's backward.
        inner_params: parameter arrays that functions applied inside this
            function's forward read without being its inputs
            (``F.forget(func, x)``: ``func``'s links); its backward makes
            their gradients (Chainer runs ``func`` again there).
        unrecorded_peak_bytes: the peak, above the level where it began, of
            the work the forward did right before this function with
            functions it did not record (applied with backprop disabled: a
            frozen teacher's forward), its outputs included (those a
            recorded function reads are arrays with ``made_at`` equal to
            this node's id); 0 where there was none.
        link: the path (``/predictor/res2/a/conv1``, as ``namedlinks()``
            names it) of the innermost Link whose forward applied this
            function, ``'/'`` for the model's own forward; ``''`` where
            unknown (functions applied outside any Link, graphs not
            recorded by :func:`capture`).
        must_keep: every plan keeps its outputs (``keep=``, see
            :mod:`~chainer_recompute.core.keep`): the solvers count it in
            ∂(L) of every lower set ``L`` that holds it.
    """

    id: int
    op: str
    inputs: Tuple[int, ...]
    outputs: Tuple[int, ...]
    retained_inputs: Tuple[int, ...] = ()
    retained_outputs: Tuple[int, ...] = ()
    held: Tuple[HeldArray, ...] = ()
    forward_time_s: Optional[float] = None
    backward_time_s: Optional[float] = None
    recomputable: bool = True
    label: str = ""
    attrs: Mapping[str, Any] = field(default_factory=dict)
    forward_transient_bytes: Optional[int] = None
    backward_transient_bytes: Optional[int] = None
    backward_alloc_bytes: Optional[int] = None
    has_backward: bool = True
    inner_params: Tuple[int, ...] = ()
    unrecorded_peak_bytes: int = 0
    link: str = ""
    must_keep: bool = False

    @property
    def held_bytes(self) -> int:
        return sum(h.nbytes for h in self.held if h.role != "written")


#: the graphs holding :attr:`Graph.node_bytes` or :attr:`Graph.node_cost`
_WITH_ARRAYS: "weakref.WeakSet[Graph]" = weakref.WeakSet()


def let_go_of_arrays() -> None:
    """Every graph drops its :attr:`Graph.node_bytes` and
    :attr:`Graph.node_cost` (made again at their next read).

    >>> g = Graph.from_edges([4, 8], [(0, 1)])
    >>> g.node_bytes.tolist()
    [4, 8]
    >>> let_go_of_arrays(); "node_bytes" in vars(g)
    False
    """
    for graph in list(_WITH_ARRAYS):
        graph.__dict__.pop("node_bytes", None)
        graph.__dict__.pop("node_cost", None)
    _WITH_ARRAYS.clear()


class Graph:
    """Arrays and function nodes of one forward pass, plus a cost model.

    Args:
        arrays: every array, ``arrays[i].id == i``.
        nodes: every function application, ``nodes[v].id == v``, in a
            topological order (each input is produced by an earlier node).
        batch_size: the batch the graph was captured at (for scaling).
        cost_model: ``paper``, ``flops`` or ``measured`` (see ``costs``).
        meta: notes for people, JSON-able (model name, source file, how
            it was scaled); nothing reads them to compute. Keys named as
            :class:`StepFacts` fields (the files of earlier versions kept
            the facts there) become ``step``'s, when ``step`` is not given.
        step: what the graph records of the training step around it
            (:class:`StepFacts`).
        backward_order: node ids in the order their backward ran in the
            recorded iteration (``None`` where not recorded).

    >>> g = Graph.from_edges([4, 8, 4], [(0, 1), (1, 2)])
    >>> g.n, g.node_bytes.tolist(), g.preds[2]
    (3, [4, 8, 4], (1,))
    """

    def __init__(self, arrays: Sequence[ArrayInfo], nodes: Sequence[Node], *,
                 batch_size: Optional[int] = None, cost_model: str = "paper",
                 meta: Optional[Mapping[str, Any]] = None,
                 backward_order: Optional[Sequence[int]] = None,
                 step: Optional[StepFacts] = None) -> None:
        self.arrays: Tuple[ArrayInfo, ...] = tuple(arrays)
        self.nodes: Tuple[Node, ...] = tuple(nodes)
        self.batch_size = batch_size
        facts, notes = StepFacts.split(meta or {})
        if step is not None:
            if facts != StepFacts():
                raise GraphError(f"step facts given both as step and in meta "
                                 f"({sorted(facts.as_dict())}): set them on step")
            facts = step
        self.step: StepFacts = facts
        self.meta: Dict[str, Any] = notes
        self.backward_order: Optional[Tuple[int, ...]] = (
            None if backward_order is None else tuple(int(v) for v in backward_order))
        self._validate()
        preds: List[set] = [set() for _ in self.nodes]
        for node in self.nodes:
            for a in node.inputs:
                p = self.arrays[a].producer
                if p is not None:
                    preds[node.id].add(p)
        self.preds: Tuple[Tuple[int, ...], ...] = tuple(tuple(sorted(p)) for p in preds)
        succs: List[List[int]] = [[] for _ in self.nodes]
        for v, ps in enumerate(self.preds):
            for u in ps:
                succs[u].append(v)
        self.succs: Tuple[Tuple[int, ...], ...] = tuple(tuple(s) for s in succs)
        self.cost_model = cost_model
        self.node_cost  # (a cost model the graph cannot give raises here)

    # The two per-node arrays the solvers read, made at their first read and
    # let go by :func:`let_go_of_arrays` (which ``release_caches`` calls once
    # a plan is made): a graph kept with its plan holds no NumPy array into
    # the training steps, where a meter on NumPy would count it.
    @functools.cached_property
    def node_bytes(self) -> np.ndarray:
        """Each node's output bytes (the arrays it owns), int64."""
        nb = np.array([sum(self.arrays[a].owned_bytes for a in n.outputs) for n in self.nodes],
                      dtype=np.int64)
        nb.setflags(write=False)
        _WITH_ARRAYS.add(self)
        return nb

    @functools.cached_property
    def node_cost(self) -> np.ndarray:
        """T_v of every node under :attr:`cost_model`, float64."""
        nc = node_costs(self, self.cost_model)
        nc.setflags(write=False)
        _WITH_ARRAYS.add(self)
        return nc

    # ------------------------------------------------------------------ build
    @classmethod
    def from_edges(cls, sizes: Sequence[int], edges: Iterable[Tuple[int, int]],
                   costs: Optional[Sequence[float]] = None,
                   ops: Optional[Sequence[str]] = None) -> "Graph":
        """A graph given by node sizes, edges and (optionally) costs.

        Node ``i`` gets one output array of ``sizes[i]`` bytes. Edges may
        use any numbering of ``0..n-1``; when they are not already in
        topological order the nodes are renumbered into one, and the
        original number is kept in ``Node.label``. ``costs`` become the
        nodes' measured times (cost model ``measured``); without them the
        ``paper`` model is used (``ops`` name the functions, default
        ``Op``).

        Raises:
            GraphError: on a cycle, an empty graph, or an edge to a node
                that does not exist.
        """
        n = len(sizes)
        if n == 0:
            raise GraphError("the graph is empty: give at least one node")
        edges = [(int(u), int(v)) for u, v in edges]
        for u, v in edges:
            if not (0 <= u < n and 0 <= v < n) or u == v:
                raise GraphError(f"edge ({u}, {v}) does not join two distinct nodes of 0..{n - 1}")
        order = _topological_order(n, edges)
        new_id = {old: new for new, old in enumerate(order)}
        arrays = [ArrayInfo(id=new_id[old], shape=None, dtype="", nbytes=int(sizes[old]),
                            kind="intermediate", producer=new_id[old])
                  for old in order]
        has_succ = {u for u, _ in edges}
        arrays = [dataclasses.replace(a, kind="output") if order[a.id] not in has_succ else a
                  for a in arrays]
        preds: Dict[int, List[int]] = {v: [] for v in range(n)}
        for u, v in edges:
            preds[new_id[v]].append(new_id[u])
        nodes = [Node(id=v, op=(ops[order[v]] if ops is not None else "Op"),
                      inputs=tuple(sorted(set(preds[v]))), outputs=(v,),
                      forward_time_s=(float(costs[order[v]]) if costs is not None else None),
                      label=str(order[v]))
                 for v in range(n)]
        return cls(arrays, nodes, cost_model="measured" if costs is not None else "paper")

    def _validate(self) -> None:
        if not self.nodes:
            raise GraphError("the graph has no function nodes: the forward pass "
                             "applied no Chainer function")
        for i, a in enumerate(self.arrays):
            if a.id != i:
                raise GraphError(f"array at position {i} has id {a.id}")
            if a.kind not in ARRAY_KINDS:
                raise GraphError(f"array {i} has kind {a.kind!r}; expected one of {ARRAY_KINDS}")
            if a.nbytes < 0:
                raise GraphError(f"array {i} has negative size {a.nbytes}")
        for v, node in enumerate(self.nodes):
            if node.id != v:
                raise GraphError(f"node at position {v} has id {node.id}")
            for a in node.inputs + node.outputs:
                if not 0 <= a < len(self.arrays):
                    raise GraphError(f"node {v} ({node.op}) refers to array {a}, "
                                     f"which does not exist")
            for a in node.inputs:
                p = self.arrays[a].producer
                if p is not None and p >= v:
                    raise GraphError(
                        f"node {v} ({node.op}) reads array {a} made by node {p}: node ids "
                        f"must be in topological order (the graph may have a cycle)")
            for a in node.outputs:
                if self.arrays[a].producer != v:
                    raise GraphError(f"array {a} is an output of node {v} but records "
                                     f"producer {self.arrays[a].producer}")
            for a in node.inner_params:
                if not 0 <= a < len(self.arrays) or self.arrays[a].kind != "param":
                    raise GraphError(f"node {v} ({node.op}) names array {a} among the "
                                     f"parameters its inner functions read, but it is not a "
                                     f"parameter array")
        for a in self.arrays:
            if a.view_of is not None and not 0 <= a.view_of < len(self.arrays):
                raise GraphError(f"array {a.id} is a view of array {a.view_of}, which does "
                                 f"not exist")
            if a.made_at is not None and (a.producer is not None
                                          or not 0 <= a.made_at <= len(self.nodes)):
                raise GraphError(f"array {a.id} is made by unrecorded work before node "
                                 f"{a.made_at}: that needs an array without a producer and a "
                                 f"node index from 0 to {len(self.nodes)}")
        if self.backward_order is not None:
            bad = [v for v in self.backward_order if not 0 <= v < len(self.nodes)]
            if bad:
                raise GraphError(f"backward_order names nodes {bad[:5]} that do not exist")

    # ------------------------------------------------------------- derived
    @property
    def n(self) -> int:
        """Number of nodes |V|."""
        return len(self.nodes)

    @property
    def edges(self) -> List[Tuple[int, int]]:
        return [(u, v) for v, ps in enumerate(self.preds) for u in ps]

    def edge_array(self) -> np.ndarray:
        """:attr:`edges` as an ``(E, 2)`` int64 array (made on each call: a
        graph keeps no array of its own that would outlive its planning)."""
        return np.array(self.edges, dtype=np.int64).reshape(-1, 2)

    @functools.cached_property
    def must_keep(self) -> FrozenSet[int]:
        """The nodes every plan keeps (:attr:`Node.must_keep`; set them with
        :func:`~chainer_recompute.core.keep.with_must_keep`)."""
        return frozenset(v for v, node in enumerate(self.nodes) if node.must_keep)

    def backward_steps(self) -> List[int]:
        """The nodes whose backward runs, in the order it runs: the recorded
        order, else reverse node order (those with a backward)."""
        if self.backward_order:
            return list(self.backward_order)
        return [v for v in range(self.n - 1, -1, -1) if self.nodes[v].has_backward]

    @functools.cached_property
    def forward_only(self) -> Tuple[int, ...]:
        """The nodes no backward needs, in topological order: the recorded
        backward does not run them and reaches none of their descendants
        (a metric computed beside the loss, ``F.accuracy``). A plan never
        regenerates them, so their inputs need not be kept for them; a lower
        set may take them in as soon as it holds their inputs
        (:meth:`~chainer_recompute.core.lower_sets.LowerSetFamily.ancestor_closures`).
        Without a recorded backward order, the nodes without a backward
        stand for the ones it runs.

        >>> g = Graph.from_edges([4, 4, 4], [(0, 1), (0, 2)])
        >>> g.backward_order = (1, 0)
        >>> g.forward_only
        (2,)
        """
        run = set(self.backward_steps())
        needed = [False] * self.n
        for v in range(self.n - 1, -1, -1):
            needed[v] = v in run or any(needed[w] for w in self.succs[v])
        return tuple(v for v in range(self.n) if not needed[v])

    def with_cost_model(self, cost_model: str) -> "Graph":
        """The same graph under another cost model."""
        return self.replace(cost_model=cost_model)

    def without_times(self) -> "Graph":
        """This graph with costs that are a function of its shapes, sizes
        and wiring only (:func:`~chainer_recompute.core.costs.time_free_model`:
        ``flops`` for a ``measured`` graph), or itself when its costs are
        already so. Two recordings of one model differ in their measured
        times; what must not (the least feasible budget) is planned on this.

        >>> g = Graph.from_edges([4, 4], [(0, 1)], costs=[0.3, 0.1])
        >>> g.without_times().cost_model, g.without_times().node_cost.tolist()
        ('flops', [4.0, 8.0])
        """
        model = time_free_model(self.cost_model)
        return self if model == self.cost_model else self.with_cost_model(model)

    def replace(self, *, arrays: Optional[Sequence[ArrayInfo]] = None,
                nodes: Optional[Sequence[Node]] = None, **kw: Any) -> "Graph":
        kwargs = dict(batch_size=self.batch_size, cost_model=self.cost_model, meta=self.meta,
                      backward_order=self.backward_order, step=self.step)
        kwargs.update(kw)
        return Graph(self.arrays if arrays is None else arrays,
                     self.nodes if nodes is None else nodes, **kwargs)

    def with_step(self, **changes: Any) -> "Graph":
        """This graph with some of its :class:`StepFacts` changed.

        >>> Graph.from_edges([4], []).with_step(calls_per_step=2).step.calls_per_step
        2
        """
        return self.replace(step=dataclasses.replace(self.step, **changes))

    def arrays_of_kind(self, *kinds: str) -> List[ArrayInfo]:
        return [a for a in self.arrays if a.kind in kinds]

    @property
    def state_bytes(self) -> Dict[str, int]:
        """Bytes that do not depend on the plan, as recorded at capture:
        ``params``, ``param_grads``, ``optimizer_state`` (0 where no
        optimizer was known), ``update_transient`` (the largest temporary
        of an optimizer update) and ``persistents`` (BatchNorm statistics);
        empty for graphs that do not record them (the authors' files)."""
        return dict(self.step.state_bytes)

    @functools.cached_property
    def integral_costs(self) -> bool:
        """Whether every node cost is an integer, with an absolute sum
        below 2**52: float64 sums of them are then exact in any order.

        >>> Graph.from_edges([1, 1], [(0, 1)]).integral_costs
        True
        """
        nc = self.node_cost
        return bool(np.all(nc == np.round(nc))) and float(np.abs(nc).sum()) < 2.0 ** 52

    @property
    def activation_bytes(self) -> int:
        """Bytes of every array the functions create (Σ M_v)."""
        return int(self.node_bytes.sum())

    @property
    def param_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays_of_kind("param"))

    @property
    def input_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays_of_kind("input"))

    def retained_array_ids(self) -> List[int]:
        """Non-parameter arrays that some function retains for backward."""
        ids = set()
        for node in self.nodes:
            ids.update(node.retained_inputs)
            ids.update(node.retained_outputs)
        return sorted(a for a in ids if self.arrays[a].kind != "param")

    @property
    def retained_bytes(self) -> int:
        """Bytes vanilla Chainer keeps alive for backward after the forward
        pass: retained inputs and outputs (parameters excluded) plus arrays
        held in function attributes."""
        return (sum(self.arrays[a].nbytes for a in self.retained_array_ids())
                + sum(n.held_bytes for n in self.nodes))

    @functools.cached_property
    def param_grad_bytes_read(self) -> int:
        """Bytes of the parameters that some node reads (inputs or
        ``inner_params``), whose gradients its backward makes:
        :meth:`param_grad_bytes_made` summed, once per graph (every replay
        asks, :func:`~chainer_recompute.core.replay.update_bytes`)."""
        return sum(self.param_grad_bytes_made())

    # ------------------------------------------------------------- scaling
    def param_grad_bytes_made(self) -> List[int]:
        """Per node, the bytes of the parameter gradients its backward makes
        first (in the recorded backward order): part of its measured
        ``backward_alloc_bytes`` that does not grow with the batch.

        >>> Graph.from_edges([4], []).param_grad_bytes_made()
        [0]
        """
        made = [0] * self.n
        seen: set = set()
        for v in (self.backward_order or range(self.n - 1, -1, -1)):
            for a in dict.fromkeys(self.nodes[v].inputs + self.nodes[v].inner_params):
                if self.arrays[a].kind == "param" and a not in seen:
                    seen.add(a)
                    made[v] += self.arrays[a].nbytes
        return made

    def scale_batch(self, batch_size: int, line: Optional["Graph"] = None) -> "Graph":
        """The graph at another batch size, by linear scaling.

        Arrays other than parameters whose leading dimension is the capture
        batch get that dimension replaced (and their bytes scaled); the same
        for arrays held in function attributes. Parameters, scalars and
        per-channel statistics are unchanged. Measured times and transient
        bytes scale linearly with the batch, and so do backward allocations
        but for the parameter gradients in them.

        ``line``: the same model recorded at another batch size (the
        capture this graph was scaled from): every size is then on the line
        through the two (:meth:`scale_between`), so that what does not
        grow with the batch (a temporary the size of a parameter, in a
        function's backward) stays as it is; the step's facts and the
        metadata are this graph's, scaled as above. Where the two are not
        the same structure, as above.

        Raises:
            GraphError: when the graph does not know its batch size.
        """
        old = self.batch_size
        if old is None:
            raise GraphError("this graph does not record the batch size it was captured at; "
                             "capture it with chainer_recompute.capture or set batch_size")
        if batch_size <= 0:
            raise GraphError(f"batch size must be positive, got {batch_size}")
        meta = dict(self.meta)
        meta.setdefault("scaled_from", old)
        step = dataclasses.replace(self.step, **{  # the caller's and unrecorded work
            key: getattr(self.step, key) * batch_size // old for key in StepFacts.SCALED})
        if line is not None and line.batch_size not in (None, old):
            try:
                on_line = self.scale_between(line, batch_size)
            except GraphError:
                pass  # (not the same structure)
            else:
                return on_line.replace(meta=meta, step=step)

        def scaled(shape: Optional[Tuple[int, ...]], nbytes: int, kind: str):
            if kind == "param" or not shape or shape[0] != old:
                return shape, nbytes
            return (batch_size,) + tuple(shape[1:]), nbytes * batch_size // old

        arrays = []
        for a in self.arrays:
            shape, nbytes = scaled(a.shape, a.nbytes, a.kind)
            buf = a.buffer_bytes
            if buf is not None and nbytes != a.nbytes:
                buf = buf * batch_size // old
            arrays.append(dataclasses.replace(a, shape=shape, nbytes=nbytes, buffer_bytes=buf))
        ratio = batch_size / old
        param_first = self.param_grad_bytes_made()
        nodes = []
        for node in self.nodes:
            held = []
            for h in node.held:
                shape, nbytes = scaled(h.shape, h.nbytes, "held")
                held.append(dataclasses.replace(h, shape=shape, nbytes=nbytes))
            def scale_b(b: Optional[int]) -> Optional[int]:
                return None if b is None else int(b * batch_size // old)

            nodes.append(dataclasses.replace(
                node, held=tuple(held),
                forward_transient_bytes=scale_b(node.forward_transient_bytes),
                backward_transient_bytes=scale_b(node.backward_transient_bytes),
                unrecorded_peak_bytes=node.unrecorded_peak_bytes * batch_size // old,
                backward_alloc_bytes=(
                    None if node.backward_alloc_bytes is None else
                    param_first[node.id]
                    + scale_b(node.backward_alloc_bytes - param_first[node.id])),
                forward_time_s=None if node.forward_time_s is None else node.forward_time_s * ratio,
                backward_time_s=None if node.backward_time_s is None else node.backward_time_s * ratio))
        return self.replace(arrays=arrays, nodes=nodes, batch_size=batch_size, meta=meta,
                            step=step)

    def scale_between(self, other: "Graph", batch_size: int) -> "Graph":
        """The graph at ``batch_size``, from this graph and ``other``, the
        same model recorded at another batch size: every dimension that
        differs between the two (of any array, a reshape's ``batch *
        length`` included) is taken as linear in the batch, every one that
        does not as constant (see :meth:`interpolate`).

        Raises:
            GraphError: the two graphs are not the same structure (the
                model's functions or wiring depend on the batch size), or a
                dimension is not linear in it (not a whole number at
                ``batch_size``); the message says which.

        >>> a = Graph.from_edges([8, 8], [(0, 1)]).replace(batch_size=2)
        >>> b = Graph.from_edges([16, 16], [(0, 1)]).replace(batch_size=4)
        >>> a.scale_between(b, 8).node_bytes.tolist()
        [32, 32]
        """
        b1, b2 = self.batch_size, other.batch_size
        if b1 is None or b2 is None or b1 == b2:
            raise GraphError(f"scaling a graph to batch {batch_size} needs two recordings at two "
                             f"different batch sizes, got batch {b1} and batch {b2}; record the "
                             f"model at two batch sizes")
        if batch_size <= 0:
            raise GraphError(f"batch size must be positive, got {batch_size}")
        g = Graph.fit([self, other], [b1, b2], batch_size, origin=0,
                      where=f"at batch {b1} and at batch {b2}", target=f"batch {batch_size}")
        meta = dict(g.meta)
        meta.setdefault("scaled_from", b1)
        meta["scaled_with"] = b2
        return g.replace(batch_size=int(batch_size), meta=meta)

    def interpolate(self, other: "Graph", num: int, den: int, *, where: str = "",
                    target: str = "the new shape") -> "Graph":
        """The same structure as this graph and ``other`` (one model
        recorded at two input shapes), every size at the point
        ``num / den`` of the way from this graph to ``other`` (beyond it
        when above 1): each array dimension linearly (a whole number, or
        :class:`GraphError`); :meth:`fit` through the two graphs.

        Raises:
            GraphError: the two graphs differ in structure (functions,
                wiring, retention, held attributes), or a dimension is not
                whole at the point.
        """
        return Graph.fit([self, other], [0, den], num, where=where, target=target)

    @staticmethod
    def fit(graphs: Sequence["Graph"], at: Sequence[Any], point: Any, *, where: str = "",
            target: str = "the new shape", origin: Any = None) -> "Graph":
        """The same structure as ``graphs`` (one model recorded at several
        input shapes on one line, ``graphs[i]`` at position ``at[i]`` on
        it), every size at position ``point``: the polynomial of least
        degree through the recorded values (exact rational arithmetic; of
        degree below ``len(graphs)``: linear through two graphs, quadratic
        sizes such as pairs of atoms once three are recorded). An array
        dimension must be a whole number at ``point`` (else
        :class:`GraphError`), and an array's bytes follow from its shape;
        measured transients and gradient bytes are fitted the same way
        (rounded, transients at least 0), times scale with the node's
        output bytes from the graph where they are largest. The rest
        (lifetimes, metadata) is ``graphs[0]``'s: put the nearest first.

        ``origin``: the position where the input's size is 0, where the
        positions are sizes (:meth:`scale_between`: batch sizes, origin 0).
        Then a measured temporary (a function's forward or backward
        transient, the unrecorded work before it) extrapolated beyond two
        graphs, the smaller at size 1, that measured less per unit of size
        there than at the larger one is scaled in proportion from the
        larger one (by more than 1%, more than rounding): at size 1 NumPy
        makes views where it copies at larger sizes (a convolution's
        ``tensordot`` on its im2col buffer holds about half of its batch-2
        temporary per sample at batch 1), so the line through both would
        overstate every larger size.

        Raises:
            GraphError: fewer than two graphs or positions that repeat; the
                graphs differ in structure (functions, wiring, retention,
                held attributes); a dimension is not whole at ``point``.

        >>> a, b, c = (Graph.from_edges([8 * n * n, 4 * n], [(0, 1)]) for n in (2, 3, 4))
        >>> Graph.fit([a, b, c], [2, 3, 4], 6).node_bytes.tolist()
        [288, 24]
        """
        graphs = list(graphs)
        if len(graphs) < 2 or len(at) != len(graphs):
            raise GraphError(f"fit needs two graphs or more, each with its position, got "
                             f"{len(graphs)} graphs and {len(at)} positions")
        ts = [Fraction(t) for t in at]
        if len(set(ts)) != len(ts):
            raise GraphError(f"fit needs graphs at distinct positions, got {list(at)}")
        x = Fraction(point)
        first = graphs[0]
        # (measured temporaries in proportion from the larger of two graphs
        # where the smaller is at size 1: see above)
        zero = None if origin is None else Fraction(origin)
        lo, hi = (0, 1) if ts[0] < ts[-1] else (1, 0)
        proportional = (zero is not None and len(ts) == 2 and ts[lo] - zero == 1
                        and x > ts[hi])
        unit_hi = ts[hi] - zero if proportional else 1

        def differ(what: str) -> GraphError:
            return GraphError(f"the model's graphs {where} differ ({what}): its structure "
                              f"depends on the input shape, so it cannot be scaled to {target}")

        def value(vals: Sequence[Optional[int]], what: str, whole: bool = False) -> Any:
            known = [(t, v) for t, v in zip(ts, vals) if v is not None]
            if not known:
                return None
            r, degree = _through([t for t, _ in known], [v for _, v in known], x)
            if r.denominator == 1:
                return int(r)
            if whole:
                shape = ("linear" if degree == 1 else "quadratic" if degree == 2
                         else f"a polynomial of degree {degree}")
                raise GraphError(
                    f"{what} is {_and(vals)} {where}: not a whole number at {target} "
                    f"({float(r):.6g}) as {shape} in the input's size, so the graph cannot be "
                    f"scaled to it")
            return int(round(r))

        def shape_of(shapes: Sequence[Optional[Tuple[int, ...]]],
                     what: str) -> Optional[Tuple[int, ...]]:
            if any(s is None for s in shapes):
                return None
            if len({len(s) for s in shapes}) > 1:
                raise differ(f"{what} has shapes {_and(shapes)}")
            out = tuple(value(ds, f"dimension {k} of {what}", whole=True)
                        for k, ds in enumerate(zip(*shapes)))
            if any(d < 0 for d in out):
                raise GraphError(f"{what} would have shape {out} at {target}")
            return out

        def size(s: Optional[Tuple[int, ...]]) -> int:
            return int(np.prod(s)) if s is not None else 0

        def bytes_of(ns: Sequence[int], shapes: Sequence[Any], new: Any, what: str) -> int:
            ks = [size(s) for s in shapes]
            if new is not None and all(ks) and ns[0] % ks[0] == 0 and all(
                    n == k * (ns[0] // ks[0]) for n, k in zip(ns, ks)):
                return size(new) * (ns[0] // ks[0])  # itemsize x elements
            return max(0, value(ns, what))

        for g in graphs[1:]:
            if first.n != g.n or len(first.arrays) != len(g.arrays):
                raise differ(f"{first.n} and {g.n} functions, {len(first.arrays)} and "
                             f"{len(g.arrays)} arrays")
        arrays = []
        for same in zip(*(g.arrays for g in graphs)):
            a = same[0]
            what = f"array {a.id} ({a.name or a.kind})"
            if any((o.kind, o.producer, o.dtype, o.view_of, o.made_at) != (
                    a.kind, a.producer, a.dtype, a.view_of, a.made_at) for o in same):
                raise differ(f"{what} is made differently")
            if a.kind == "param":
                if any((o.shape, o.nbytes) != (a.shape, a.nbytes) for o in same):
                    raise differ(f"parameter {a.name or a.id} has another shape")
                arrays.append(a)
                continue
            shape = shape_of([o.shape for o in same], what)
            nbytes = bytes_of([o.nbytes for o in same], [o.shape for o in same], shape, what)
            buf = a.buffer_bytes
            if all(o.buffer_bytes is not None for o in same):
                buf = nbytes if all(o.buffer_bytes == o.nbytes for o in same) else \
                    max(0, value([o.buffer_bytes for o in same], what))
            arrays.append(dataclasses.replace(a, shape=shape, nbytes=nbytes, buffer_bytes=buf))
        nodes = []
        for same in zip(*(g.nodes for g in graphs)):
            node = same[0]
            what = f"function #{node.id} ({node.op})"
            for o in same[1:]:
                if (node.op, node.inputs, node.outputs, node.retained_inputs,
                        node.retained_outputs, node.inner_params) != (
                            o.op, o.inputs, o.outputs, o.retained_inputs,
                            o.retained_outputs, o.inner_params):
                    raise differ(f"{what} is {node.op} reading {node.inputs} in one, {o.op} "
                                 f"reading {o.inputs} in another")
                if [h.name for h in node.held] != [h.name for h in o.held]:
                    raise differ(f"{what} holds other attributes")
            held = []
            for hs in zip(*(o.held for o in same)):
                hw = f"{what}'s {hs[0].name}"
                shape = shape_of([h.shape for h in hs], hw)
                held.append(dataclasses.replace(hs[0], shape=shape, nbytes=bytes_of(
                    [h.nbytes for h in hs], [h.shape for h in hs], shape, hw)))

            def nonneg(vals: Sequence[Optional[int]]) -> Optional[int]:
                if (proportional and None not in vals
                        and 100 * vals[lo] * unit_hi < 99 * vals[hi]):  # (size 1 at ``lo``)
                    return int(round(Fraction(vals[hi]) * (x - zero) / unit_hi))
                v = value(vals, what)
                return None if v is None else max(0, v)

            big, bytes_big = max(((o, sum(g.arrays[a].nbytes for a in o.outputs))
                                  for o, g in zip(same, graphs)), key=lambda p: p[1])
            out_new = sum(arrays[a].nbytes for a in node.outputs)
            ratio = out_new / bytes_big if bytes_big else 1.0

            def timed(t: Optional[float]) -> Optional[float]:
                return None if t is None else t * ratio

            nodes.append(dataclasses.replace(
                node, held=tuple(held),
                forward_transient_bytes=nonneg([o.forward_transient_bytes for o in same]),
                backward_transient_bytes=nonneg([o.backward_transient_bytes for o in same]),
                unrecorded_peak_bytes=nonneg([o.unrecorded_peak_bytes for o in same]) or 0,
                backward_alloc_bytes=value([o.backward_alloc_bytes for o in same], what),
                forward_time_s=timed(big.forward_time_s),
                backward_time_s=timed(big.backward_time_s)))
        step = dataclasses.replace(first.step, **{  # the caller's and unrecorded work
            key: max(0, value([getattr(g.step, key) for g in graphs], key))
            for key in StepFacts.SCALED})
        return first.replace(arrays=arrays, nodes=nodes, step=step)

    # ------------------------------------------------------------ export
    def to_networkx(self):
        """A ``networkx.DiGraph`` with node attributes ``op``, ``bytes`` and
        ``cost``."""
        import networkx as nx
        g = nx.DiGraph()
        for node in self.nodes:
            g.add_node(node.id, op=node.op, bytes=int(self.node_bytes[node.id]),
                       cost=float(self.node_cost[node.id]), label=node.label)
        g.add_edges_from(self.edges)
        return g

    def summary(self) -> str:
        """A few lines: node count, activation, retained and parameter bytes."""
        n_ops: Dict[str, int] = {}
        for node in self.nodes:
            n_ops[node.op] = n_ops.get(node.op, 0) + 1
        top = ", ".join(f"{k} {v}" for k, v in sorted(n_ops.items(), key=lambda kv: -kv[1])[:6])
        name = self.meta.get("model", "graph")
        lines = [
            f"{name}: {self.n} nodes, {len(self.edges)} edges, batch {self.batch_size}",
            f"  activations (sum of M_v):       {format_bytes(self.activation_bytes)}",
            f"  retained by Chainer for backward: {format_bytes(self.retained_bytes)}",
            f"  parameters:                      {format_bytes(self.param_bytes)}",
            f"  inputs:                          {format_bytes(self.input_bytes)}",
            f"  cost model {self.cost_model}: total T(V) = {float(self.node_cost.sum()):.6g}",
            f"  functions: {top}",
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Graph(n={self.n}, edges={len(self.edges)}, arrays={len(self.arrays)}, "
                f"batch_size={self.batch_size}, cost_model={self.cost_model!r})")


def _topological_order(n: int, edges: Sequence[Tuple[int, int]],
                       priority: Optional[Sequence[float]] = None) -> List[int]:
    """Kahn's algorithm, the ready node of least ``priority`` first (then
    of least index; without ``priority``, smallest index first); GraphError
    on a cycle."""
    import heapq
    indeg = [0] * n
    out: List[List[int]] = [[] for _ in range(n)]
    for u, v in set(edges):
        out[u].append(v)
        indeg[v] += 1
    key = (lambda v: (priority[v], v)) if priority is not None else (lambda v: (v, v))
    heap = [key(v) for v in range(n) if indeg[v] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, u = heapq.heappop(heap)
        order.append(u)
        for v in out[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, key(v))
    if len(order) != n:
        stuck = sorted(v for v in range(n) if indeg[v] > 0)
        raise GraphError(f"the graph has a cycle through nodes {stuck[:10]}"
                         f"{' ...' if len(stuck) > 10 else ''}: a computational graph "
                         f"must be acyclic")
    return order


def _through(at: Sequence[Fraction], values: Sequence[int], x: Fraction) -> Tuple[Fraction, int]:
    """The value at ``x`` of the polynomial of least degree through the
    points ``(at[i], values[i])`` (distinct positions), and its degree:
    Newton's divided differences in exact rational arithmetic (the degree
    is that of the last coefficient that is not 0).

    >>> _through([Fraction(1), Fraction(2), Fraction(3)], [1, 4, 9], Fraction(5))
    (Fraction(25, 1), 2)
    """
    v0 = values[0]
    if all(v == v0 for v in values):
        return Fraction(v0), 0
    m = len(values)
    if m == 2:  # a line (the common case, in integers where it is whole)
        n, d = (values[1] - v0) * (x - at[0]), at[1] - at[0]
        return v0 + n / d, 1
    coef = [Fraction(v) for v in values]
    for j in range(1, m):
        for i in range(m - 1, j - 1, -1):
            coef[i] = (coef[i] - coef[i - 1]) / (at[i] - at[i - j])
    degree = max(i for i in range(m) if coef[i] != 0)
    r = coef[degree]
    for i in range(degree - 1, -1, -1):
        r = r * (x - at[i]) + coef[i]
    return r, degree


def _and(items: Sequence[Any]) -> str:
    """``a, b and c``."""
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
