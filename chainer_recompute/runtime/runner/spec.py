"""A runner's options, checked once, as one frozen value
(:class:`RunnerSpec`): what its planner, its step meter and a coordinator
read, and what ranks compare (:meth:`RunnerSpec.digest`)."""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping, Optional

import numpy as np

from ...core.errors import RecomputeError
from ...core.keep import KeepPolicy


@dataclasses.dataclass(frozen=True)
class RunnerSpec:
    """The options of a :class:`~.Recompute` but its budget (resolved later:
    ``'device'``, a share) and its coordinator, each documented there.

    >>> spec = RunnerSpec.parse(solver='approx')
    >>> spec.solver, spec.budget_scope, spec.capture_batch
    ('approx', 'total', 'auto')
    """

    solver: str = "auto"
    strategy: str = "tc"
    cost: str = "measured"
    max_plans: int = 8
    max_structures: int = 4
    capture_batch: Any = "auto"
    verify: bool = True
    budget_scope: str = "total"
    check_iterations: int = 3
    verbose: bool = True
    workspace: Any = None  # parsed: bytes, 'auto' or None
    workspace_exact: bool = True
    on_infeasible: str = "auto"
    plan_at: str = "backward"
    free_previous_graph: bool = False
    keep: KeepPolicy = dataclasses.field(default_factory=KeepPolicy)
    calls_per_step: Optional[int] = None
    solver_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, *, workspace: Any = None, keep: Any = None, **options: Any) -> "RunnerSpec":
        """Check every option and parse ``workspace`` and ``keep``; keyword
        arguments that are not fields of the spec are the solver's
        (checked against it).

        Raises:
            RecomputeError: an option out of its range (the message names
                what it takes).
            UnknownSolverError: an unknown solver or strategy.
            KeepError: ``keep`` cannot be read.
        """
        from ...core.budget import check_scope
        from ...core.costs import COST_MODELS
        from ...core.keep import parse_keep
        from ...core.solvers import check_solver
        from ...core.workspace import parse_workspace
        names = {f.name for f in dataclasses.fields(cls)} - {"solver_options"}
        solver_options = {k: v for k, v in options.items() if k not in names}
        fields = {k: v for k, v in options.items() if k in names}
        spec = dataclasses.replace(cls(), **fields, solver_options=solver_options)
        check_scope(spec.budget_scope)
        try:
            parsed = parse_workspace(workspace)
        except ValueError as e:
            raise RecomputeError(str(e)) from None
        check_solver(spec.solver, spec.strategy)
        _check_solver_options(spec.solver, solver_options)
        if spec.on_infeasible not in ("auto", "warn", "raise"):
            raise RecomputeError(f"on_infeasible must be 'auto', 'warn' or 'raise', got "
                                 f"{spec.on_infeasible!r}")
        if spec.plan_at not in ("backward", "call"):
            raise RecomputeError(f"plan_at must be 'backward' or 'call', got {spec.plan_at!r}")
        if spec.cost not in COST_MODELS:
            raise RecomputeError(f"unknown cost model {spec.cost!r}; known: "
                                 f"{sorted(COST_MODELS)}")
        cb = spec.capture_batch
        if cb is not None and cb != "auto" and (not isinstance(cb, int) or isinstance(cb, bool)
                                                or cb < 1):
            raise RecomputeError(f"capture_batch must be 'auto', a positive int or None, got "
                                 f"{cb!r}")
        k = spec.calls_per_step
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise RecomputeError(f"calls_per_step must be None or a positive int (how many "
                                 f"times a training step calls the model before one backward "
                                 f"through them all), got {k!r}")
        check_count("check_iterations", spec.check_iterations, least=0)
        check_count("max_plans", spec.max_plans, least=1)
        check_count("max_structures", spec.max_structures, least=1)
        flags = {name: check_flag(name, getattr(spec, name))
                 for name in ("verify", "verbose", "free_previous_graph", "workspace_exact")}
        return dataclasses.replace(spec, workspace=parsed, keep=parse_keep(keep), **flags)

    def digest(self, budget: Any) -> str:
        """What must agree between the ranks of a data-parallel run: the
        budget as given (``budget``: a
        :class:`~chainer_recompute.core.budget_spec.Budget`) and every
        option that changes a plan."""
        opts = (("budget", budget.bytes if budget.kind == "bytes" else budget.text),
                ("solver", self.solver), ("strategy", self.strategy), ("cost", self.cost),
                ("budget_scope", self.budget_scope), ("capture_batch", self.capture_batch),
                ("keep", self.keep.describe()), ("workspace", self.workspace),
                ("workspace_exact", self.workspace_exact), ("plan_at", self.plan_at),
                ("calls_per_step", self.calls_per_step),
                ) + tuple(sorted((k, repr(v)) for k, v in self.solver_options.items()))
        return ", ".join(f"{k}={v}" for k, v in opts)


@dataclasses.dataclass(frozen=True)
class ChainSpec:
    """The options of a :class:`~chainer_recompute.runtime.bptt.ChainRecompute`
    but its budget, each documented there: parsed by the checks
    :class:`RunnerSpec` uses for the options both runners take
    (``budget_scope``, ``check_iterations``).

    >>> spec = ChainSpec.parse(policy='hsm', slots=3)
    >>> spec.policy, spec.slots, spec.budget_scope, spec.check_iterations
    ('hsm', 3, 'total', 2)
    """

    policy: str = "msm"
    slots: Optional[int] = None
    budget_scope: str = "total"
    check_iterations: int = 2

    @classmethod
    def parse(cls, *, policy: str = "msm", slots: Any = None, budget_scope: str = "total",
              check_iterations: Any = 2) -> "ChainSpec":
        """Check every option.

        Raises:
            UnknownSolverError: an unknown policy.
            BudgetError: ``slots`` not a positive whole number.
            RecomputeError: ``budget_scope`` or ``check_iterations`` out of
                range (the message names what it takes).
        """
        from ...core.budget import check_scope
        from ...core.errors import BudgetError, UnknownSolverError
        from ...core.solvers.chain import POLICIES
        if policy not in POLICIES:
            raise UnknownSolverError(f"unknown chain policy {policy!r}; known: "
                                     f"{sorted(POLICIES)}")
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, (int, np.integer))
                                  or slots < 1):
            raise BudgetError(f"slots={slots!r}: give a positive number of hidden-state slots")
        check_scope(budget_scope)
        return cls(policy=policy, slots=None if slots is None else int(slots),
                   budget_scope=budget_scope,
                   check_iterations=check_count("check_iterations", check_iterations, least=0))


def check_count(name: str, value: Any, *, least: int) -> int:
    """``value`` if it is a whole number of at least ``least`` (an option
    that counts: ``check_iterations``, ``max_plans``), else
    :class:`RecomputeError` naming the option.

    >>> check_count("check_iterations", 2, least=0)
    2
    """
    try:
        count = operator.index(value)  # (an int, a NumPy integer; not 2.0, not '2')
    except TypeError:
        count = None
    if isinstance(value, bool) or count is None or count < least:
        raise RecomputeError(f"{name} must be a whole number of at least {least}, got {value!r}")
    return count


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a bool if it is one (a NumPy bool too), else
    :class:`RecomputeError` naming the option: a string such as ``'no'``
    would be true.

    >>> check_flag("verbose", False)
    False
    >>> check_flag("free_previous_graph", "no")
    Traceback (most recent call last):
    ...
    chainer_recompute.core.errors.RecomputeError: free_previous_graph must be True or False, got 'no'
    """
    if not isinstance(value, (bool, np.bool_)):
        raise RecomputeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _solver_keywords(solver: str) -> list:
    """The keyword options ``solver`` takes besides those the runner sets."""
    import inspect
    from ...core.solvers import REGISTRY
    names = {"max_lower_sets"}  # read by the budget search itself
    for name in (("approx", "hier") if solver == "auto" else (solver,)):
        for p in inspect.signature(REGISTRY[name]).parameters.values():
            if p.kind is p.KEYWORD_ONLY:
                names.add(p.name)
    return sorted(names - {"strategy", "model"})


def _check_solver_options(solver: str, options: Mapping[str, Any]) -> None:
    """Refuse, at once, a keyword that neither the runner nor the solver
    takes (else a TypeError from inside the solver at the first plan)."""
    known = _solver_keywords(solver)
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        runner = sorted({f.name for f in dataclasses.fields(RunnerSpec)} - {"solver_options"}
                        | {"budget", "coordinator"})
        raise RecomputeError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"apply() and Recompute take {', '.join(runner)}, and solver {solver!r} "
            f"takes {', '.join(known)}")
