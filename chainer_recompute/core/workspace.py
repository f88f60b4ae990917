"""Bounded convolution workspaces: chunk sizes and the transients they leave.

Pure core: numpy only, never chainer.

On NumPy, and on CuPy without cuDNN, Chainer 7.8.1 runs a convolution as
im2col + GEMM: one call allocates a column buffer of ``batch x C x kh x kw x
out_h x out_w`` values, which can be most of an iteration's peak (VGG19's
first block, U-Net's 572x572 layers). A *workspace bound* of ``L`` bytes runs
every call whose column buffer is over ``L`` in chunks
(:mod:`chainer_recompute.runtime.workspace`), with the same arithmetic:

- the forward and the input gradient over the batch;
- the weight gradient over the input channels (the GEMM's output columns),
  so that every sum runs over the whole batch in one GEMM, as in one call.

The kernels allocate nothing but what is counted here, so the transient of
a chunked call follows from the shapes the graph records; this module gives
both sides (the runtime kernels and the planner) the same chunk sizes.
Three kernels, per element ``s`` bytes:

``conv``  (the convolution's forward; a deconvolution's input gradient):
    ``x (N, C, H, W)`` and ``W (O, C, kh, kw)`` to ``y (N, O, oh, ow)``;
    per sample a column block of ``C*kh*kw*oh*ow*s`` bytes.
``deconv`` (a convolution's input gradient; a deconvolution's forward):
    ``x (N, Ci, h, w)`` and ``W (Ci, Co, kh, kw)``; per sample the GEMM's
    result, ``Co*kh*kw*h*w*s`` bytes, and (more than one sample) the
    transposed copy of the input, ``Ci*h*w*s`` (counted for one sample too:
    a non-contiguous input is copied then).
``gradw`` (the weight gradient): ``x (N, C, H, W)``, ``gy (N, O, oh, ow)``;
    once the transposed copy of ``gy`` (``O*N*oh*ow*s``, none for N = 1), per
    input channel a column block of ``N*oh*ow*kh*kw*s`` and its share of the
    result, ``O*kh*kw*s``.

A call runs chunked when its whole column buffer (``N*C*kh*kw*oh*ow*s`` for
``conv`` and ``gradw``, the GEMM's result for ``deconv``) is over the bound;
the chunk is the largest whose transient fits it (at least one sample or
channel: a bound below that is exceeded by what one sample needs).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from .graph import Graph, Node

#: The ops whose calls can be chunked (Chainer's class names).
CONV_OPS = ("Convolution2DFunction", "Deconvolution2DFunction")


@dataclass(frozen=True)
class Kernel:
    """One im2col + GEMM kernel of a convolution call, by its sizes.

    Attributes:
        kind: ``conv``, ``deconv`` or ``gradw`` (module docstring).
        units: what the call is chunked over: the batch (``conv``,
            ``deconv``) or the input channels (``gradw``).
        unit_bytes: transient bytes per unit of a chunk of more than one.
        single_bytes: transient bytes of a chunk of one unit.
        fixed_bytes: transient bytes whatever the chunk (``gradw``: the
            transposed output gradient).
        column_bytes: the whole call's column buffer, which decides
            whether it runs chunked.
        min_units: the least chunk: one that keeps both sides of the
            chunk's GEMM at least 2 wide where the whole call's are (NumPy
            runs a product with one row or column as a matrix-vector
            product, whose sums may round otherwise).
    """

    kind: str
    units: int
    unit_bytes: int
    single_bytes: int
    fixed_bytes: int
    column_bytes: int
    min_units: int = 1

    def chunk(self, limit_bytes: Optional[int], exact: bool = False) -> int:
        """The units per chunk under ``limit_bytes`` (``units``: one call;
        ``exact``: always one call, the one-copy kernel only).

        >>> Kernel('conv', 32, 100, 100, 0, 3200).chunk(1000)
        10
        """
        if limit_bytes is None or self.column_bytes <= limit_bytes or exact:
            return self.units
        room = limit_bytes - self.fixed_bytes
        n = room // self.unit_bytes if self.unit_bytes > 0 else self.units
        return int(max(self.min_units, 1, min(self.units, n)))

    def transient_bytes(self, chunk: int) -> int:
        """The transient of this kernel run ``chunk`` units at a time."""
        per = self.single_bytes if chunk == 1 else chunk * self.unit_bytes
        return int(self.fixed_bytes + per)


def _least(width_per_unit: int, units: int) -> int:
    """The least units whose GEMM side (``width_per_unit`` each) is 2 wide,
    where all ``units`` together are."""
    if width_per_unit >= 2 or width_per_unit * units < 2:
        return 1
    return min(units, -(-2 // max(1, width_per_unit)))


def conv_kernel(x_shape: Sequence[int], w_shape: Sequence[int], y_shape: Sequence[int],
                itemsize: int) -> Kernel:
    """The ``conv`` kernel: ``x (N, C, H, W)``, ``W (O, C, kh, kw)``,
    ``y (N, O, oh, ow)``."""
    n, c = int(x_shape[0]), int(x_shape[1])
    kh, kw = int(w_shape[2]), int(w_shape[3])
    oh, ow = int(y_shape[2]), int(y_shape[3])
    col1 = c * kh * kw * oh * ow * itemsize
    return Kernel("conv", n, col1, col1, 0, n * col1, _least(oh * ow, n))


def deconv_kernel(x_shape: Sequence[int], w_shape: Sequence[int], itemsize: int) -> Kernel:
    """The ``deconv`` kernel: ``x (N, Ci, h, w)``, ``W (Ci, Co, kh, kw)``."""
    n, ci, h, w = (int(v) for v in x_shape)
    co, kh, kw = int(w_shape[1]), int(w_shape[2]), int(w_shape[3])
    gcol1 = co * kh * kw * h * w * itemsize
    xt1 = ci * h * w * itemsize
    # one sample's input is copied too when it is not contiguous (a gradient
    # that is a view into its padded buffer): counted, at most xt1 too much
    return Kernel("deconv", n, gcol1 + xt1, gcol1 + xt1, 0, n * gcol1, _least(h * w, n))


def gradw_kernel(x_shape: Sequence[int], gy_shape: Sequence[int], w_shape: Sequence[int],
                 itemsize: int) -> Kernel:
    """The ``gradw`` kernel: ``x (N, C, H, W)``, ``gy (N, O, oh, ow)``,
    the weight ``(O, C, kh, kw)``."""
    n, c = int(x_shape[0]), int(x_shape[1])
    o, oh, ow = int(gy_shape[1]), int(gy_shape[2]), int(gy_shape[3])
    kh, kw = int(w_shape[2]), int(w_shape[3])
    m = n * oh * ow
    gyt = o * m * itemsize if n > 1 else 0
    per = (m * kh * kw + o * kh * kw) * itemsize
    return Kernel("gradw", c, per, per, gyt, m * c * kh * kw * itemsize, _least(kh * kw, c))


@dataclass(frozen=True)
class ConvCall:
    """The kernels of one recorded convolution node.

    Attributes:
        node: the node's id.
        forward: the kernel of its forward (and of its regeneration).
        input_grad: the kernel of its input gradient, or ``None`` where its
            input gets none.
        weight_grad: the kernel of its weight gradient, or ``None``.
        weight_bytes: bytes of the weight gradient (allocated before the
            weight-gradient kernel runs, in the same backward call).
    """

    node: int
    forward: Kernel
    input_grad: Optional[Kernel]
    weight_grad: Optional[Kernel]
    weight_bytes: int

    def chunks(self, limit_bytes: Optional[int], exact: bool = True
               ) -> Tuple[int, Optional[int], Optional[int]]:
        """Units per chunk of the forward, input and weight gradients."""
        return (self.forward.chunk(limit_bytes, exact),
                None if self.input_grad is None else self.input_grad.chunk(limit_bytes, exact),
                None if self.weight_grad is None else self.weight_grad.chunk(limit_bytes, exact))

    def chunked(self, limit_bytes: Optional[int], exact: bool = True) -> bool:
        """Whether the call runs this module's kernels (all three share one
        column size, so it is all or nothing; ``exact`` at batch 1: never,
        Chainer's kernel holds one column buffer there already)."""
        if exact and self.forward.units == 1:
            return False
        return limit_bytes is not None and self.forward.column_bytes > limit_bytes

    def transients(self, limit_bytes: Optional[int], exact: bool = True) -> Tuple[int, int]:
        """The forward and backward transients under ``limit_bytes`` (as
        the recorder measures them: the peak above what the call leaves)."""
        fc, gc, wc = self.chunks(limit_bytes, exact)
        fwd = self.forward.transient_bytes(fc)
        bwd = 0
        if self.input_grad is not None:
            # the weight gradient, made after it, is part of what stays
            sub = self.weight_bytes if self.weight_grad is not None else 0
            bwd = max(bwd, self.input_grad.transient_bytes(gc) - sub)
        if self.weight_grad is not None:
            wt = self.weight_grad.transient_bytes(wc)
            if wc is not None and wc >= self.weight_grad.units:
                wt -= self.weight_bytes  # one chunk: its result is the gradient
            bwd = max(bwd, wt)
        return int(fwd), int(bwd)


def _needs_grad(graph: Graph, a: int) -> bool:
    info = graph.arrays[a]
    if info.kind == "param":
        return True
    return info.producer is not None and graph.nodes[info.producer].has_backward


def conv_call(graph: Graph, node: Node) -> Optional[ConvCall]:
    """The kernels of ``node``, or ``None`` where it is not a chunkable
    convolution (another op, grouped, unknown shapes, mixed dtypes)."""
    if node.op not in CONV_OPS or len(node.inputs) < 2 or not node.outputs:
        return None
    x, w, y = (graph.arrays[node.inputs[0]], graph.arrays[node.inputs[1]],
               graph.arrays[node.outputs[0]])
    if any(a.shape is None or len(a.shape) != 4 for a in (x, w, y)):
        return None
    if not x.dtype or x.dtype != w.dtype or x.dtype != y.dtype:
        return None
    s = np.dtype(x.dtype).itemsize
    gx = _needs_grad(graph, node.inputs[0]) and node.has_backward
    gw = _needs_grad(graph, node.inputs[1]) and node.has_backward
    if node.op == "Convolution2DFunction":
        if w.shape[1] != x.shape[1]:
            return None  # grouped
        fwd = conv_kernel(x.shape, w.shape, y.shape, s)
        ig = deconv_kernel(y.shape, w.shape, s) if gx else None
        wg = gradw_kernel(x.shape, y.shape, w.shape, s) if gw else None
    else:
        if w.shape[0] != x.shape[1]:
            return None  # grouped
        fwd = deconv_kernel(x.shape, w.shape, s)
        # its input gradient is a convolution of gy (shaped like y) into x's shape
        ig = conv_kernel(y.shape, w.shape, x.shape, s) if gx else None
        # its weight gradient: Convolution2DGradW of (gy, x)
        wg = gradw_kernel(y.shape, x.shape, w.shape, s) if gw else None
    return ConvCall(node.id, fwd, ig, wg, int(w.nbytes))


def conv_calls(graph: Graph) -> List[ConvCall]:
    """Every chunkable convolution node of ``graph``."""
    out = []
    for node in graph.nodes:
        c = conv_call(graph, node)
        if c is not None:
            out.append(c)
    return out


def bounded_graph(graph: Graph, limit_bytes: Optional[int], exact: bool = True) -> Graph:
    """``graph`` with the transients its convolutions have under a
    workspace bound of ``limit_bytes`` (``None``: the recorded ones).

    The recorded transients of a chunked node are kept in its ``attrs``
    (``plain_transient_bytes``), so that bounding a bounded graph again
    under another limit starts from them; ``step.workspace_bytes`` is
    the bound.

    >>> g = bounded_graph(Graph.from_edges([4, 4], [(0, 1)]), 1024)
    >>> g.step.workspace_bytes
    1024
    """
    nodes = list(graph.nodes)
    for call in conv_calls(graph):
        node = nodes[call.node]
        attrs = dict(node.attrs)
        plain = attrs.pop("plain_transient_bytes", None)
        if plain is None:
            plain = [node.forward_transient_bytes, node.backward_transient_bytes]
        attrs.pop("workspace_chunks", None)
        if call.chunked(limit_bytes, exact):
            fwd, bwd = call.transients(limit_bytes, exact)
            attrs["plain_transient_bytes"] = list(plain)
            attrs["workspace_chunks"] = list(call.chunks(limit_bytes, exact))
            node = dataclasses.replace(node, forward_transient_bytes=fwd,
                                       backward_transient_bytes=bwd
                                       if node.backward_transient_bytes is not None or
                                       call.input_grad or call.weight_grad else None,
                                       attrs=attrs)
        else:
            node = dataclasses.replace(node, forward_transient_bytes=plain[0],
                                       backward_transient_bytes=plain[1], attrs=attrs)
        nodes[call.node] = node
    return graph.replace(nodes=nodes).with_step(
        workspace_bytes=None if limit_bytes is None else int(limit_bytes),
        workspace_exact=bool(exact))


def candidate_limits(graph: Graph, max_candidates: int = 48,
                     exact: bool = True) -> List[Optional[int]]:
    """Workspace bounds worth planning with, largest first: ``None`` (no
    bound), then every bound at which some call's chunk changes (its
    kernels' transients at each chunk size, and just under each column
    buffer), down to 1 byte (every call at its least chunk). With more
    than ``max_candidates`` of them, a geometric subset that keeps the
    largest and the least. ``exact``: only one-copy calls, no chunks; the
    least bound puts every convolution on them.

    >>> candidate_limits(Graph.from_edges([4, 4], [(0, 1)]))
    [None]
    """
    calls = conv_calls(graph)
    if not calls:
        return [None]
    if exact:  # every call over the bound runs one-copy: the least bound does it for all
        calls = [c for c in calls if c.forward.units > 1]
        if not calls:
            return [None]
        least = min(c.forward.column_bytes for c in calls) - 1
        return [None, max(1, least)]
    points = {1}
    for c in calls:
        for k in (c.forward, c.input_grad, c.weight_grad):
            if k is None:
                continue
            points.add(max(1, k.column_bytes - 1))
            n = k.units
            while n >= 1:  # every chunk size for small calls, halving for big ones
                points.add(max(1, k.transient_bytes(n)))
                n = n - 1 if k.units <= 64 else n // 2
    top = max(c.forward.column_bytes for c in calls)
    ordered = sorted((p for p in points if p < top), reverse=True)
    if len(ordered) > max_candidates - 1:
        idx = np.unique(np.round(np.geomspace(1, len(ordered), max_candidates - 1)).astype(int) - 1)
        ordered = [ordered[i] for i in idx]
        if 1 not in ordered:
            ordered.append(1)
    return [None] + ordered


WorkspaceSpec = Union[None, str, int]


def parse_workspace(workspace: Any) -> WorkspaceSpec:
    """``None``, ``'auto'`` or a number of bytes (``'64M'``, 2**26, ...).

    Raises:
        ValueError: anything else, naming the accepted forms.

    >>> parse_workspace('64M'), parse_workspace('auto'), parse_workspace(None)
    (67108864, 'auto', None)
    """
    from .units import parse_bytes
    if workspace is None:
        return None
    if isinstance(workspace, str) and workspace.strip().lower() in ("auto", "none", "off"):
        w = workspace.strip().lower()
        return "auto" if w == "auto" else None
    try:
        value = parse_bytes(workspace)
    except Exception as e:  # the budget parser's error, reworded for a workspace
        raise ValueError(f"workspace {workspace!r} is neither 'auto', None nor a size "
                         f"('64M', '1G', bytes as an int): {e}") from None
    if value < 1:
        raise ValueError(f"workspace must be at least one byte, got {workspace!r}; use None "
                         f"for no bound")
    return int(value)


@dataclasses.dataclass(frozen=True)
class WorkspacePlan:
    """A plan made under a convolution workspace bound
    (:func:`plan_with_workspace`).

    Attributes:
        plan: the :class:`~chainer_recompute.core.plan.Plan`.
        graph: the graph it was made on: the convolutions' transients
            under the bound (:func:`bounded_graph`).
        workspace_bytes: the bound the calls must run under (None: none).
    """

    plan: Any
    graph: Graph
    workspace_bytes: Optional[int]


def plan_with_workspace(graph: Graph, budget: Any, workspace: WorkspaceSpec, *,
                        solver: str = "approx", strategy: str = "tc", scope: str = "total",
                        exact: bool = True, **solver_options: Any) -> WorkspacePlan:
    """The plan for ``budget`` with convolution workspaces bounded by
    ``workspace`` (bytes, ``'auto'`` or ``None``), with the bounded graph
    it was made on and the bound (:class:`WorkspacePlan`).

    ``'auto'`` plans under each of :func:`candidate_limits` and takes, for
    a budget in bytes, the plan with the least recomputation that fits
    (the largest bound among equals: fewer chunks); for ``'least'``, the
    least of the bounds' least feasible budgets (a function of the graph's
    sizes, not of its times), and among the bounds that reach it the
    largest.

    Raises:
        InfeasibleBudgetError: no bound gives a plan that fits (the message
            is that of the smallest bound's search).

    >>> g = Graph.from_edges([4, 4, 4], [(0, 1), (1, 2)])
    >>> chosen = plan_with_workspace(g, 'least', 'auto', scope='activations')
    >>> chosen.workspace_bytes is None, chosen.plan.feasible
    (True, True)
    """
    from .budget import plan_for_budget, resolve_budget
    from .errors import InfeasibleBudgetError
    budget = resolve_budget(graph, budget, scope)  # a share: of the unbounded graph's plain
    if workspace != "auto":
        bg = bounded_graph(graph, workspace, exact)
        return WorkspacePlan(plan_for_budget(bg, budget, solver=solver, strategy=strategy,
                                             scope=scope, **solver_options), bg, workspace)
    least = budget.is_least
    tried: List[Tuple[Optional[int], Any, Graph]] = []
    error: Optional[Exception] = None
    for limit in candidate_limits(graph, exact=exact):
        bg = bounded_graph(graph, limit, exact)
        try:
            plan = plan_for_budget(bg, budget, solver=solver, strategy=strategy, scope=scope,
                                   **solver_options)
        except InfeasibleBudgetError as e:
            error = e
            continue
        tried.append((limit, plan, bg))
    if not tried:
        assert error is not None
        raise error

    def size(limit: Optional[int]) -> float:
        return math.inf if limit is None else limit

    if least:  # (by the least figure: its plan's peak, under tc, follows the times)
        best = min(p.budget_bytes for _, p, _ in tried)
        limit, plan, bg = max((t for t in tried if t[1].budget_bytes <= best),
                              key=lambda t: size(t[0]))
        return WorkspacePlan(plan, bg, limit)
    limit, plan, bg = min(tried, key=lambda t: (t[1].overhead, -size(t[0])))
    return WorkspacePlan(plan, bg, limit)


__all__ = ["CONV_OPS", "ConvCall", "Kernel", "WorkspacePlan", "bounded_graph", "candidate_limits", "conv_call",
           "conv_calls", "conv_kernel", "deconv_kernel", "gradw_kernel", "parse_workspace",
           "plan_with_workspace"]
