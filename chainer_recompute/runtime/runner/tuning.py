"""The runner's tuning knobs, in one object: what ``apply()`` takes as
``tuning=`` beside the options a user sets."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping

__all__ = ["Tuning"]


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Knobs of the planner and the runner that the defaults serve
    (``apply(model, budget, tuning=Tuning(...))``); each is documented on
    :class:`~chainer_recompute.runtime.runner.Recompute`.

    Attributes:
        cost: the solver's time model: ``'measured'`` (profiled times),
            ``'flops'`` or ``'paper'``.
        max_plans: how many input signatures keep their plans.
        max_structures: how many graph structures one signature keeps plans for.
        check_iterations: planned iterations per plan whose peak the
            allocator measures and the runner checks (on CuPy: every one).
        verify: checksum what regeneration reads (an in-place change
            between forward and backward is reported, not miscomputed).
        workspace_exact: with ``workspace=``, bit-identical one-call
            kernels only (False: chunked, equal to rounding).
        plan_at: ``'backward'`` (default) or ``'call'``: when a recorded
            iteration is planned.
        solver_options: passed to the solver (``engine='numpy'``,
            ``method=...``, ``max_lower_sets=...``).

    >>> Tuning(cost='flops').options()['cost']
    'flops'
    >>> Tuning(solver_options={'engine': 'numpy'}).options()['engine']
    'numpy'
    """

    cost: str = "measured"
    max_plans: int = 8
    max_structures: int = 4
    check_iterations: int = 3
    verify: bool = True
    workspace_exact: bool = True
    plan_at: str = "backward"
    solver_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def options(self) -> Dict[str, Any]:
        """As keyword arguments of :class:`Recompute`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "solver_options"}
        out.update(self.solver_options)
        return out

    @classmethod
    def fields(cls) -> frozenset:
        """The names of the knobs (``solver_options`` aside)."""
        return frozenset(f.name for f in dataclasses.fields(cls)) - {"solver_options"}
