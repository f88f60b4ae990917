"""Time cost models T_v for graph nodes.

- ``paper``: 10 for a function whose name starts with ``Conv``, 1 otherwise,
  as the authors' solver did (docs/paper.md §1).
- ``flops``: floating-point operations estimated from shapes for the
  functions that dominate (convolutions, deconvolutions, linear, matmul);
  every other function costs the elements it reads and writes (it is
  memory-bound), and where shapes are unknown, its bytes.
- ``measured``: the profiled forward time in seconds.

``paper`` and ``flops`` are functions of a graph's shapes, sizes and wiring
(:data:`TIME_FREE`); ``measured`` is not: two recordings of one model give
other times. What must not change from one recording to the next (the
least feasible budget) is searched under :func:`time_free_model`'s costs.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from .errors import GraphError
# Functions here take the graph and node as duck-typed objects (``arrays``,
# ``nodes``; ``op``, ``inputs``, ...): graph.py imports this module, not
# the other way round.
Graph = Any
Node = Any


def _paper(graph: Graph, node: Node) -> float:
    return 10.0 if node.op.startswith("Conv") else 1.0


def _size(shape: Optional[Tuple[int, ...]]) -> Optional[int]:
    if shape is None:
        return None
    return math.prod(shape)  # (np.prod costs 20x more on these short tuples)


def _flops(graph: Graph, node: Node) -> float:
    ins = [graph.arrays[a] for a in node.inputs]
    outs = [graph.arrays[a] for a in node.outputs]
    op = node.op
    try:
        if op in ("Convolution2DFunction", "ConvolutionND") and len(ins) >= 2:
            w = ins[1].shape  # (out_c, in_c / groups, kh, kw...)
            return 2.0 * _size(outs[0].shape) * _size(w[1:])
        if op in ("Deconvolution2DFunction", "DeconvolutionND") and len(ins) >= 2:
            w = ins[1].shape  # (in_c, out_c / groups, kh, kw...)
            return 2.0 * _size(ins[0].shape) * _size(w[1:])
        if op == "LinearFunction" and len(ins) >= 2:
            return 2.0 * _size(outs[0].shape) * ins[1].shape[1]
        if op in ("MatMul", "BatchMatMul") and len(ins) >= 2:
            return 2.0 * _size(outs[0].shape) * ins[0].shape[-1]
    except (TypeError, IndexError):
        pass  # unknown shapes: fall through to the memory-bound estimate
    elems = [_size(a.shape) for a in ins + outs if a.kind != "param"]
    if all(e is not None for e in elems) and elems:
        return float(sum(elems))
    return float(sum(a.nbytes for a in ins + outs if a.kind != "param"))


def _measured(graph: Graph, node: Node) -> float:
    if node.forward_time_s is None:
        raise GraphError(f"cost model 'measured' needs forward times, but node {node.id} "
                         f"({node.op}) has none; capture with profile=True or use "
                         f"cost='flops' or cost='paper'")
    return float(node.forward_time_s)


COST_MODELS: Dict[str, Callable[[Graph, Node], float]] = {
    "paper": _paper,
    "flops": _flops,
    "measured": _measured,
}


#: Cost models whose costs depend on shapes, sizes and wiring only.
TIME_FREE = ("paper", "flops")
#: The time-free model that stands in for ``measured``: the nearest to
#: measured times (convolutions and products by their flops, the rest by
#: the elements they touch).
TIME_FREE_STAND_IN = "flops"


def time_free_model(cost_model: str) -> str:
    """``cost_model`` when it is time-free (:data:`TIME_FREE`), else
    :data:`TIME_FREE_STAND_IN`.

    >>> time_free_model('paper'), time_free_model('measured')
    ('paper', 'flops')
    """
    return cost_model if cost_model in TIME_FREE else TIME_FREE_STAND_IN


def node_costs(graph: Graph, cost_model: str) -> np.ndarray:
    """T_v for every node of ``graph`` under ``cost_model``, as float64."""
    try:
        fn = COST_MODELS[cost_model]
    except KeyError:
        raise GraphError(f"unknown cost model {cost_model!r}; known: {sorted(COST_MODELS)}") from None
    return np.array([fn(graph, node) for node in graph.nodes], dtype=np.float64)
