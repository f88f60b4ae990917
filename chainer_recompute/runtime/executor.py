"""The backward driver: discard arrays in the forward pass, regenerate them
just before backward needs them.

A :class:`Program` is the static part, made once per input signature from
a captured :class:`Graph` and a solver's ``Plan``: which nodes are dropped,
when (after which function) their arrays can be released, which block each
belongs to, which backward reads which arrays. An :class:`IterationHook` is
the dynamic part of one training iteration:

- while the model's forward runs it is a global ``FunctionHook``: it checks
  that the functions applied are the ones planned, holds references to the
  checkpoint arrays that regeneration will start from, and releases the
  dropped arrays as soon as their last forward reader has run: the
  references Chainer keeps for backward (a retained input's
  ``VariableNode._data``, a function's ``_retained_output_data``, arrays in
  its attributes such as max-pooling indexes) are set to ``None``, keeping
  each node's shape and dtype;
- it is then registered as a *local* hook on every recorded function, so it
  sees ``backward_preprocess`` of those functions during a plain
  ``loss.backward()``: before a function's backward reads a released
  array, the dropped nodes of its block are recomputed from the kept ones
  by running the recorded function nodes' ``forward`` again under
  ``chainer.using_config('in_recomputing', True)`` and the results are put
  back where Chainer's backward reads them; after the last backward reader
  of an array has run, it is released again.

The hook holds no strong reference to function or variable nodes, so the
graph is freed by reference counting as in plain Chainer, whether or not
backward ever runs. Everything goes through the array module of the
arrays, so NumPy and CuPy take the same path.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from . import _chainer  # noqa: F401
import chainer
from chainer import backend

from .capture import function_op
from ..core.errors import RecomputeError
from ..core.graph import Graph

logger = logging.getLogger(__name__)


class Program:
    """What to drop, when to release it, and how to regenerate it.

    Args:
        graph: the captured graph; node ids are the order in which the
            model's forward applies its functions.
        lower_sets: the plan's strategy L_1 ⊊ ... ⊊ L_k = V.
        kept: nodes whose outputs are checkpoints (U_1 ∪ ... ∪ U_k).

    Nodes that are not recomputable (see ``capture``) and nodes that produce
    no array are never dropped.
    """

    def __init__(self, graph: Graph, lower_sets: Sequence[FrozenSet[int]],
                 kept: FrozenSet[int]) -> None:
        self.graph = graph
        n = graph.n
        self.block_of = [0] * n
        prev: FrozenSet[int] = frozenset()
        for b, L in enumerate(lower_sets):
            for v in L - prev:
                self.block_of[v] = b
            prev = L
        if len(prev) != n:
            raise RecomputeError(f"the plan covers {len(prev)} of the graph's {n} nodes; "
                                 f"the last lower set must be V")
        self.dropped: FrozenSet[int] = frozenset(
            v for v in range(n) if v not in kept and graph.nodes[v].recomputable)
        self.unsafe = [v for v in range(n) if v not in kept and not graph.nodes[v].recomputable]
        arrays = graph.arrays
        # Attribute names by role.
        self.derived: Dict[int, Tuple[str, ...]] = {}
        self.written: Dict[int, Tuple[str, ...]] = {}
        for node in graph.nodes:
            self.derived[node.id] = tuple(h.name for h in node.held if h.role == "derived")
            self.written[node.id] = tuple(h.name for h in node.held if h.role == "written")
        # When to release: at the forward_preprocess of the function after
        # the last forward reader (n means: when the forward has finished).
        self.release_at: Dict[int, List[int]] = {}
        for u in sorted(self.dropped):
            last = max(graph.succs[u], default=u)
            self.release_at.setdefault(last + 1, []).append(u)
        # Arrays the forward must keep a reference to: inputs of dropped
        # nodes that are not themselves outputs of dropped nodes (the
        # checkpoints and model inputs regeneration starts from).
        self.sources: Set[int] = set()
        for u in self.dropped:
            for a in graph.nodes[u].inputs:
                p = arrays[a].producer
                if arrays[a].kind != "param" and (p is None or p not in self.dropped):
                    self.sources.add(a)
        # needs[w]: released nodes whose arrays w's backward reads (its own
        # retained outputs or attribute arrays, its retained inputs).
        # done[w]: nodes that have one backward reader less once w's
        # backward has run: needs[w] and w itself. A node's own backward
        # runs after those of all its consumers (Chainer's backward goes by
        # decreasing rank), so when all its readers have run its arrays are
        # dead and are released, checkpoints included: later blocks'
        # checkpoints do not outlive their backward, unlike plain Chainer's
        # retained arrays, which live as long as the graph.
        self.releasable: FrozenSet[int] = frozenset(
            v for v in range(n) if graph.nodes[v].recomputable)
        self.needs: Dict[int, Tuple[int, ...]] = {}
        self.done: Dict[int, Tuple[int, ...]] = {}
        readers: Dict[int, int] = {u: 0 for u in self.releasable}
        for node in graph.nodes:
            need = set()
            if node.retained_outputs or self.derived[node.id]:
                need.add(node.id)
            for a in node.retained_inputs:
                p = arrays[a].producer
                if p is not None:
                    need.add(p)
            need &= self.releasable
            self.needs[node.id] = tuple(sorted(need))
            done = need | ({node.id} & self.releasable)
            self.done[node.id] = tuple(sorted(done))
            for u in done:
                readers[u] += 1
        self.readers = readers
        self.block_nodes: Dict[int, List[int]] = {}
        for u in sorted(self.dropped):
            self.block_nodes.setdefault(self.block_of[u], []).append(u)

    @property
    def n(self) -> int:
        return self.graph.n


def _owner_of(f: Any, name: str) -> Any:
    inner = getattr(f, "_function", None)
    if inner is not None and name in vars(inner):
        return inner
    return f


class IterationStats:
    """Counters of one iteration, kept by the runner after the iteration's
    arrays are gone (it references no array or graph object)."""

    __slots__ = ("n_dropped", "n_released", "recomputed_nodes", "mismatch")

    def __init__(self, n_dropped: int) -> None:
        self.n_dropped = n_dropped
        self.n_released = 0  # arrays released now (after backward: all dropped)
        self.recomputed_nodes = 0
        self.mismatch: Optional[str] = None

    def __repr__(self) -> str:
        return (f"IterationStats(dropped={self.n_dropped}, released={self.n_released}, "
                f"recomputed_nodes={self.recomputed_nodes}, mismatch={self.mismatch!r})")


class IterationHook(chainer.FunctionHook):
    """Drives one forward/backward of a planned model (see module doc)."""

    name = "chainer_recompute"

    def __init__(self, program: Program) -> None:
        self.program = program
        self.funcs: List["weakref.ref[Any]"] = []
        self.index: Dict[int, int] = {}
        self.kept: Dict[int, Any] = {}
        self.released: Dict[int, Tuple[Tuple[int, ...], bool]] = {}
        # Backward readers of each node that have not run yet.
        self.remaining: Dict[int, int] = dict(program.readers)
        self.stats = IterationStats(len(program.dropped))
        self._depth = 0
        self._top: List[bool] = []

    @property
    def mismatch(self) -> Optional[str]:
        return self.stats.mismatch

    @mismatch.setter
    def mismatch(self, message: Optional[str]) -> None:
        self.stats.mismatch = message

    # ---------------------------------------------------------- forward
    def forward_preprocess(self, function, in_data):
        self._depth += 1
        top = self._depth == 1 and chainer.config.enable_backprop and self.mismatch is None
        self._top.append(top)
        if not top:
            return
        i = len(self.funcs)
        p = self.program
        if i >= p.n:
            self.mismatch = (f"the forward applied more than the {p.n} functions of the "
                             f"planned graph (function #{i + 1} is {function_op(function)})")
            self._top[-1] = False
            return
        node = p.graph.nodes[i]
        shapes = tuple(tuple(x.shape) for x in in_data)
        planned = tuple(p.graph.arrays[a].shape for a in node.inputs)
        if function_op(function) != node.op or shapes != planned:
            self.mismatch = (f"function #{i} is {function_op(function)} on inputs of shapes "
                             f"{shapes}, but the plan has {node.op} on {planned}")
            self._top[-1] = False
            return
        for u in p.release_at.get(i, ()):
            self._release(u)
        for a, x in zip(node.inputs, in_data):
            if a in p.sources:
                self.kept[a] = x
        self.index[id(function)] = i
        self.funcs.append(weakref.ref(function))

    def forward_postprocess(self, function, in_data):
        self._depth -= 1
        if self._top.pop():
            function.add_hook(self)

    def finish_forward(self) -> None:
        """Release what the last functions read; call after the model's
        forward has returned."""
        p = self.program
        if self.mismatch is None and len(self.funcs) != p.n:
            self.mismatch = (f"the forward applied {len(self.funcs)} functions, but the "
                             f"planned graph has {p.n}")
        if self.mismatch is not None:
            return
        for u in p.release_at.get(p.n, ()):
            self._release(u)

    # ---------------------------------------------------------- release
    def _release(self, u: int) -> None:
        f = self.funcs[u]() if u < len(self.funcs) else None
        if f is None or u in self.released:
            return
        for a in self.program.graph.nodes[u].outputs:
            self.kept.pop(a, None)
        outs = []
        for k, ref in enumerate(f.outputs or ()):
            vnode = ref()
            if vnode is not None and vnode._data is not None:
                vnode._data = None  # keep shape and dtype (CHAINER_NOTES 2)
                outs.append(k)
        had_retained = f._retained_output_data is not None and bool(f._output_indexes_to_retain)
        if had_retained:
            f._retained_output_data = None
        for name in self.program.derived[u]:
            setattr(_owner_of(f, name), name, None)
        self.released[u] = (tuple(outs), had_retained)
        self.stats.n_released = len(self.released)

    # ---------------------------------------------------------- backward
    def backward_preprocess(self, function, in_data, out_grad):
        w = self.index.get(id(function))
        if w is None:
            return
        missing = [u for u in self.program.needs[w] if u in self.released]
        if missing:
            self._regenerate(missing)

    def backward_postprocess(self, function, in_data, out_grad):
        w = self.index.get(id(function))
        if w is None:
            return
        for u in self.program.done[w]:
            self.remaining[u] -= 1
            if self.remaining[u] <= 0:
                self._release(u)

    def _input_array(self, f: Any, j: int, a: int, values: Dict[int, Any]) -> Any:
        if a in values:
            return values[a]
        if a in self.kept:
            return self.kept[a]
        xnode = f.inputs[j]
        if xnode._data is not None:
            return xnode._data
        var = xnode.get_variable_or_none()
        if var is not None and var.raw_array is not None:
            return var.raw_array
        return None

    def _regenerate(self, targets: List[int]) -> None:
        """Recompute the dropped nodes of the targets' block(s) that the
        targets need, and put the targets' arrays back."""
        p = self.program
        g = p.graph
        # Targets: every released node of the blocks involved whose backward
        # readers have not all run, so that a block is regenerated once.
        blocks = {p.block_of[u] for u in targets}
        wanted = sorted({u for b in blocks for u in p.block_nodes.get(b, ())
                         if u in self.released and self.remaining[u] > 0} | set(targets))
        # (block_nodes lists dropped nodes; checkpoints released after their
        # backward come back only as targets, on a second backward.)
        # Closure: dropped ancestors whose outputs are not available.
        values: Dict[int, Any] = {}
        order: Set[int] = set()
        stack = list(wanted)
        while stack:
            u = stack.pop()
            if u in order:
                continue
            order.add(u)
            f = self.funcs[u]()
            for j, a in enumerate(g.nodes[u].inputs):
                if self._input_array(f, j, a, values) is None:
                    prod = g.arrays[a].producer
                    if prod is None or prod not in p.releasable:
                        raise RecomputeError(
                            f"cannot regenerate node {u} ({g.nodes[u].op}): its input array "
                            f"{a} is not available and is not recomputable")
                    stack.append(prod)
        targets_set = set(wanted)
        for u in sorted(order):
            f = self.funcs[u]()
            node = g.nodes[u]
            in_data = tuple(self._input_array(f, j, a, values)
                            for j, a in enumerate(node.inputs))
            outs = self._run_forward(f, u, in_data)
            self.stats.recomputed_nodes += 1
            for a, y in zip(node.outputs, outs):
                values[a] = y
            if u in targets_set and u in self.released:
                out_idx, had_retained = self.released.pop(u)
                self.stats.n_released = len(self.released)
                for k in out_idx:
                    vnode = f.outputs[k]()
                    if vnode is not None:
                        vnode._data = outs[k]
                if had_retained:
                    f._retained_output_data = tuple(outs[k] for k in f._output_indexes_to_retain)
            else:
                for name in p.derived[u]:  # transient: drop what forward made
                    setattr(_owner_of(f, name), name, None)

    def _run_forward(self, f: Any, u: int, in_data: Tuple[Any, ...]) -> Tuple[Any, ...]:
        detached = []
        for name in self.program.written[u]:
            owner = _owner_of(f, name)
            original = getattr(owner, name)
            if original is not None:
                setattr(owner, name, original.copy())  # e.g. BatchNorm running stats
                detached.append((owner, name, original))
        keep_in, keep_out = f._input_indexes_to_retain, f._output_indexes_to_retain
        try:
            with chainer.using_config("in_recomputing", True), \
                    chainer.using_device(backend.get_device_from_array(*in_data)):
                outs = tuple(type(f).forward(f, in_data))
        finally:
            for owner, name, original in detached:
                setattr(owner, name, original)
            f._input_indexes_to_retain, f._output_indexes_to_retain = keep_in, keep_out
        return outs
