"""Read-only views of what a runner keeps per input signature, for tests,
tools and users who want to see a runner's plans (:meth:`Recompute.signatures`)
without reaching into its private state."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Tuple

from ...core.graph import Graph


@dataclass(frozen=True)
class StructureView:
    """One planned structure of a signature.

    Attributes:
        graph: the graph it was planned from (recorded, captured and scaled,
            or derived from its family's shapes: ``graph.step.derived_from``).
        plan: its :class:`~chainer_recompute.core.plan.Plan`.
        program: the :class:`~chainer_recompute.runtime.program.Program`
            the executor runs (``program.dropped``: the nodes it drops).
        planning_time_s: the wall time of its planning.
        checked: how many planned iterations on it had their peak measured.

    ``graph``, ``plan`` and ``program`` are the runner's own objects: read
    them, do not change them.
    """

    graph: Graph
    plan: Any
    program: Any
    planning_time_s: float
    checked: int


@dataclass(frozen=True)
class SignatureView:
    """What a runner keeps for one input signature, at the moment it was
    asked.

    Attributes:
        signature: the signature (see :meth:`Recompute.signature`).
        structures: its planned structures, most recently used first
            (empty until its first plan).
        calls: its training calls so far.
        recorded: its planned calls that stopped matching their plan and
            were recorded (a new structure).
        plain: it runs plain Chainer from now on (its structure changed on
            most calls).
        pending: a recorded iteration waits to be planned at its next call.
    """

    signature: Hashable
    structures: Tuple[StructureView, ...]
    calls: int
    recorded: int
    plain: bool
    pending: bool


def views_of(entries: Iterable[Tuple[Hashable, Any]]) -> Tuple[SignatureView, ...]:
    """Views of a runner's ``(signature, entry)`` pairs, in its order."""
    return tuple(
        SignatureView(sig, tuple(StructureView(s.graph, s.plan, s.program, s.planning_time_s,
                                               s.checked) for s in e.structures),
                      e.calls, e.recorded, e.plain, e.pending is not None)
        for sig, e in entries)
