"""One small hierarchy of errors for the whole library.

Every error says what was expected, what was found, and what to do.
"""
from __future__ import annotations

from typing import Optional


class RecomputeError(Exception):
    """Base class of every error raised by chainer_recompute."""


class GraphError(RecomputeError, ValueError):
    """A graph is malformed: a cycle, a dangling reference, no nodes."""


class GraphFormatError(GraphError):
    """A graph file cannot be parsed; ``line`` is the 1-based line number."""

    def __init__(self, path: str, line: Optional[int], message: str) -> None:
        self.path = path
        self.line = line
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")


class SchemaVersionError(GraphError):
    """A JSON graph file was written with another schema version."""


class BudgetError(RecomputeError, ValueError):
    """A memory budget could not be understood (garbage, zero, negative, NaN)."""


class InfeasibleBudgetError(RecomputeError):
    """No plan fits the budget; ``least_feasible_bytes`` says what would."""

    def __init__(self, message: str, budget_bytes: Optional[float] = None,
                 least_feasible_bytes: Optional[float] = None,
                 vanilla_bytes: Optional[float] = None) -> None:
        self.budget_bytes = budget_bytes
        self.least_feasible_bytes = least_feasible_bytes
        self.vanilla_bytes = vanilla_bytes
        super().__init__(message)


class LowerSetExplosionError(RecomputeError):
    """A graph has too many lower sets for the exact solver."""


class UnknownSolverError(RecomputeError, ValueError):
    """A solver or strategy name is not in the registry."""


class CaptureError(RecomputeError):
    """A model could not be captured into a graph."""


class UnsafeRecomputeError(RecomputeError):
    """A recomputation would not reproduce the first run, and is refused: a
    step run again drew other random numbers than the first time, or an
    array a regeneration reads (a parameter, an input) was changed in place
    between the forward and the backward that recomputes from it."""


class DistributedError(RecomputeError):
    """Collective planning across ChainerMN ranks failed: not a ChainerMN
    communicator, ranks that disagree (options, models, graphs against
    their plan), or a collective call that failed. Raised on every rank."""


class KeepError(RecomputeError, ValueError):
    """A ``keep=`` policy cannot be used: a link path that names no link of
    the model (the message gives the closest names), a value of another
    kind, or a predicate that raised."""


class EngineUnavailableError(RecomputeError, ImportError):
    """An engine was asked for by name (``engine='numba'``) and is not
    installed; nothing falls back to another engine silently."""
