"""chainer-recompute: memory-efficient backpropagation for Chainer by
recomputation, after Kusumoto et al. (NeurIPS 2019) and Gruslys et al.
(NIPS 2016).

The pure core (graph, costs, io, units, lower sets, solvers, schedule)
imports numpy and networkx only; the Chainer glue (capture, executor,
apply, memory) is imported lazily so that the core works without Chainer.
"""
from __future__ import annotations

from typing import Any

from ._compat import ensure_numpy_compat

ensure_numpy_compat()  # before anything imports chainer (NumPy 2 machines)

from .core.errors import (BudgetError, CaptureError, DistributedError,  # noqa: F401
                          GraphError, GraphFormatError,
                          InfeasibleBudgetError, KeepError, LowerSetExplosionError,
                          RecomputeError,
                          SchemaVersionError, UnknownSolverError, UnsafeRecomputeError)
from .core.graph import ArrayInfo, Graph, HeldArray, Node  # noqa: F401
from .core.keep import KeepPolicy, parse_keep  # noqa: F401
from .core.io import load_authors_graph, load_graph, save_graph  # noqa: F401
from .core.plan import Plan  # noqa: F401
from .core.search import largest_batch_size, least_feasible_budget  # noqa: F401
from .core.budget import least_total_budget  # noqa: F401
from .core.planner import solve  # noqa: F401
from .core.solvers import REGISTRY  # noqa: F401
from .core.units import format_bytes, parse_bytes  # noqa: F401

__version__ = "0.1.0"

# Names served by modules that import chainer, loaded on first use.
_LAZY = {
    "capture": ("runtime.capture", "capture"),
    "apply": ("runtime.runner", "apply"),
    "remove": ("runtime.runner", "remove"),
    "runner_of": ("runtime.runner", "runner_of"),
    "Recompute": ("runtime.runner", "Recompute"),
    "Tuning": ("runtime.runner", "Tuning"),
    "bptt": ("runtime.bptt", None),
    "distributed": ("runtime.distributed", None),
    "extensions": ("extensions", None),
}

#: The public API: ``help(chainer_recompute)`` lists these.
__all__ = [
    # the one line, and the runner it installs
    "apply", "Tuning", "remove", "runner_of", "Recompute",
    # planning without a model: graphs, plans, budgets
    "capture", "solve", "least_total_budget", "least_feasible_budget",
    "largest_batch_size", "parse_bytes", "format_bytes", "Graph", "Node", "ArrayInfo",
    "HeldArray", "Plan", "REGISTRY", "load_graph", "save_graph", "load_authors_graph",
    # errors
    "RecomputeError", "BudgetError", "InfeasibleBudgetError", "UnsafeRecomputeError",
    "CaptureError", "GraphError", "GraphFormatError", "SchemaVersionError",
    "UnknownSolverError", "LowerSetExplosionError", "DistributedError",
    # sub-modules: recurrent networks, ChainerMN, Trainer extensions
    "bptt", "distributed", "extensions",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        mod = importlib.import_module(f".{module}", __name__)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'chainer_recompute' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))
