"""The per-block memory formula that the dynamic programs optimise.

Pure core: numpy only.

For a strategy ∅ = L_0 ⊊ L_1 ⊊ ... ⊊ L_k = V with blocks V_i = L_i \\ L_{i-1},
checkpoints U_i = ∂(L_i) ∩ V_i, A_i = δ+(L_i) \\ L_i and B_i = δ-(A_i) \\ L_i,
the peak is max_i M^(i) with

    M^(i) = constant + Σ_{j<i} keep(U_j) + block(V_i) + above(A_i)
            + beside(B_i) + max_{v ∈ V_i} transient_v

where keep, block, above and beside are sums of per-node byte weights.
The paper's model (Kusumoto et al. 2019, §3) is the special case
block = 2·M_v, keep = above = beside = M_v, no transient, no constant.
The measured model (``scope='total'``) adds each function's transient
working set (im2col buffers, workspaces) and the bytes that do not depend
on the strategy (parameters, their gradients, optimizer state, inputs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .graph import Graph

__all__ = ["MemoryModel", "SCOPES", "measured_model"]

#: ``activations``: the paper's model (what the authors' solver optimises);
#: ``total``: everything the allocator sees in one training iteration.
SCOPES = ("activations", "total")


def _weights(values: "np.ndarray", n: int, name: str) -> np.ndarray:
    w = np.asarray(values, dtype=np.int64).reshape(-1)
    if len(w) != n:
        raise ValueError(f"{name} has {len(w)} entries for a graph of {n} nodes")
    if (w < 0).any():
        raise ValueError(f"{name} has negative entries")
    w = w.copy()
    w.setflags(write=False)
    return w


@dataclass(frozen=True, eq=False)
class MemoryModel:
    """Per-node byte weights of the per-block formula (see module doc).

    Attributes:
        block_bytes: weight of a node in the block being recomputed and
            backpropagated (the paper: 2·M_v, its value and its gradient).
        keep_bytes: weight of a node kept as a checkpoint for later
            blocks (the paper: M_v).
        above_bytes: weight of a node of A_i (the paper: M_v).
        beside_bytes: weight of a node of B_i (the paper: M_v).
        transient_bytes: the largest temporary working set of the node's
            forward or backward; a block pays the largest of its nodes'.
        constant_bytes: bytes present whatever the strategy.
        scope: ``'activations'`` or ``'total'`` (see :data:`SCOPES`).

    >>> from chainer_recompute.core.graph import Graph
    >>> g = Graph.from_edges([1, 2, 1], [(0, 1), (1, 2)])
    >>> MemoryModel.paper(g).block_bytes.tolist()
    [2, 4, 2]
    """

    block_bytes: np.ndarray
    keep_bytes: np.ndarray
    above_bytes: np.ndarray
    beside_bytes: np.ndarray
    transient_bytes: np.ndarray
    constant_bytes: int = 0
    scope: str = "activations"

    def __post_init__(self) -> None:
        n = len(np.asarray(self.block_bytes).reshape(-1))
        for name in ("block_bytes", "keep_bytes", "above_bytes", "beside_bytes",
                     "transient_bytes"):
            object.__setattr__(self, name, _weights(getattr(self, name), n, name))
        if self.constant_bytes < 0:
            raise ValueError(f"constant_bytes must not be negative, got {self.constant_bytes}")
        object.__setattr__(self, "constant_bytes", int(self.constant_bytes))
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")

    @property
    def n(self) -> int:
        return len(self.block_bytes)

    @property
    def has_transients(self) -> bool:
        return bool(self.transient_bytes.any())

    @classmethod
    def paper(cls, graph: "Graph") -> "MemoryModel":
        """The paper's model on ``graph``'s node sizes M_v."""
        m = graph.node_bytes.astype(np.int64)
        zero = np.zeros(graph.n, dtype=np.int64)
        return cls(block_bytes=2 * m, keep_bytes=m, above_bytes=m, beside_bytes=m,
                   transient_bytes=zero, constant_bytes=0, scope="activations")


def measured_model(graph: "Graph") -> MemoryModel:
    """The per-block formula with what a recorded graph measured
    (``scope='total'``): a block holds its nodes' own output memory (views
    cost nothing), the arrays they keep in attributes and their outputs'
    gradients; a checkpoint holds its outputs and attributes; gradients
    arrive from A, values are read from B; each node's largest transient
    (forward or backward) and the plan-independent bytes (parameters,
    their gradients, optimizer state, inputs) come on top.

    The formula is the DP's objective; the runtime's exact memory under a
    plan is predicted by :func:`~chainer_recompute.core.replay.replay`.
    """
    from .replay import param_grad_bytes, state_constant_bytes
    own = graph.node_bytes.astype(np.int64)
    held = np.array([n.held_bytes for n in graph.nodes], dtype=np.int64)
    grad = np.array([sum(graph.arrays[a].nbytes for a in n.outputs) for n in graph.nodes],
                    dtype=np.int64)
    trans = np.array([max(n.forward_transient_bytes or 0, n.backward_transient_bytes or 0)
                      for n in graph.nodes], dtype=np.int64)
    const = state_constant_bytes(graph) + param_grad_bytes(graph)
    return MemoryModel(block_bytes=own + held + grad, keep_bytes=own + held,
                       above_bytes=grad, beside_bytes=own, transient_bytes=trans,
                       constant_bytes=const, scope="total")
