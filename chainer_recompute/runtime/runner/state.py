"""What a runner keeps per input signature (its planned structures, a
recorded iteration waiting to be planned, counters) and whether a
runner's forward is running (inner runners then pass through)."""
from __future__ import annotations

import collections
import threading
from typing import Any, Hashable, List, Optional, Tuple

from ...core.graph import Graph
from ..executor import IterationHook, Program

_local = threading.local()


def _depth() -> int:
    return getattr(_local, "depth", 0)


class _Active:
    """Marks a runner's forward as running (inner runners then pass through)."""

    def __enter__(self) -> None:
        _local.depth = _depth() + 1

    def __exit__(self, *exc: Any) -> None:
        _local.depth = _depth() - 1


_Recording = collections.namedtuple(
    "_Recording", "graph param_refs multi_backward backward_known hook")


class _Structure:
    """One planned graph of a signature."""

    __slots__ = ("graph", "plan", "program", "planning_time_s", "checked", "workspace_bytes",
                 "plain_fits", "held_after")

    def __init__(self, graph: Graph, plan: Any, program: Program, planning_time_s: float,
                 workspace_bytes: Optional[int] = None):
        self.graph, self.plan, self.program = graph, plan, program
        self.planning_time_s = planning_time_s
        self.workspace_bytes = workspace_bytes  # the convolutions' bound its calls run under
        self.checked = 0  # planned iterations whose peak was measured
        #: whether plain Chainer keeps what its plan keeps (see
        #: ``Recompute._checked_plain``); None: not known yet
        self.plain_fits: Optional[bool] = None
        #: what its graph holds after its backward, as the replay counts it
        #: held into the next forward (see ``StepMeter.count_held_other``)
        self.held_after: Optional[int] = None


class _Entry:
    """What a signature has: its plans (most recently used first), a
    recorded iteration waiting to be planned, and counters."""

    __slots__ = ("structures", "pending", "calls", "recorded", "plain", "error", "family",
                 "dims", "batch", "line", "__weakref__")

    def __init__(self, family: Hashable = None, dims: Tuple[int, ...] = ()) -> None:
        self.family, self.dims = family, dims  # see _family
        self.batch: Optional[int] = None  # the batch size of its calls
        self.error: Optional[Exception] = None  # raised at the next call
        self.structures: List[_Structure] = []
        self.pending: Optional[IterationHook] = None
        self.calls = 0
        self.recorded = 0
        self.plain = False
        #: its graph at another batch size, on the line its plans' graph was
        #: scaled on (the larger of the captures it was planned from): a
        #: new batch size of its family is scaled on that line
        #: (``Graph.scale_batch``)
        self.line: Optional[Graph] = None
