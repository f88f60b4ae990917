"""``apply()`` and :class:`Recompute`: planning on first use, then running
every training forward under the backward driver.

>>> import chainer_recompute as cr                        # doctest: +SKIP
>>> model = cr.apply(model, budget='8G')                # doctest: +SKIP
>>> loss = model(x, t); loss.backward()                 # as before

The first call with a new input signature (shapes, dtypes, device, train
mode, other arguments) captures the graph (one extra forward pass, whose
effects on the model are undone), solves for the budget, and caches the
plan; later calls with the same signature reuse it. Evaluation
(``chainer.using_config('train', False)``) and ``no_backprop_mode`` calls
go straight to the model: no planning, no overhead.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

from . import _chainer  # noqa: F401
import chainer
from chainer import backend

from .capture import batch_size_of, capture
from ..core.errors import RecomputeError
from .executor import IterationHook, IterationStats, Program
from ..core.graph import Graph
from ..core.units import format_bytes, parse_bytes

logger = logging.getLogger(__name__)

_ATTR = "_chainer_recompute"


def _signature(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Hashable:
    def one(x: Any) -> Hashable:
        if isinstance(x, chainer.Variable):
            x = x.raw_array
        if isinstance(x, chainer.get_array_types()):
            return ("array", tuple(x.shape), str(x.dtype), str(backend.get_device_from_array(x)))
        if isinstance(x, (tuple, list)):
            return (type(x).__name__,) + tuple(one(y) for y in x)
        if isinstance(x, (int, float, str, bool, type(None))):
            return ("value", x)
        return ("object", type(x).__name__, id(x))

    return (tuple(one(a) for a in args),
            tuple((k, one(v)) for k, v in sorted(kwargs.items())),
            bool(chainer.config.train))


class _Entry:
    __slots__ = ("graph", "plan", "program", "planning_time_s")

    def __init__(self, graph: Graph, plan: Any, program: Program, planning_time_s: float):
        self.graph, self.plan, self.program = graph, plan, program
        self.planning_time_s = planning_time_s


class Recompute:
    """A callable that runs ``fn`` with recomputation.

    Args:
        fn: a callable applying Chainer functions and returning the loss
            Variable (a Link's ``forward``, a loss function).
        budget: memory budget for the activations (``'8G'``, bytes, ...;
            see :func:`parse_bytes`).
        solver: ``approx`` (default), ``exact``, ``chen``, ``chen-greedy``
            or ``none`` (plain Chainer).
        strategy: ``tc`` (least recomputation) or ``mc`` (least memory).
        cost: cost model for the solver: ``measured`` (profiled times),
            ``flops`` or ``paper``.
        max_plans: how many input signatures keep a cached plan.
        capture_repeat: forward passes timed at capture (median).
        capture_batch: capture the graph at this batch size (the leading
            dimension of the array arguments) and scale it linearly to the
            real batch: planning then costs the memory and time of a small
            forward. If the model turns out not to scale linearly, the
            mismatch is detected and that signature is planned again at
            full size.

    >>> runner = Recompute(loss_fn, budget='2G')            # doctest: +SKIP
    >>> loss = runner(x, t); loss.backward()                # doctest: +SKIP
    """

    def __init__(self, fn: Callable[..., Any], budget: Any, *, solver: str = "approx",
                 strategy: str = "tc", cost: str = "measured", max_plans: int = 8,
                 capture_repeat: int = 1, capture_batch: Optional[int] = None,
                 **solver_options: Any) -> None:
        from ..core.solvers import check_solver
        self.fn = fn
        self.budget_bytes = parse_bytes(budget)
        check_solver(solver, strategy)
        from ..core.costs import COST_MODELS
        if cost not in COST_MODELS:
            raise RecomputeError(f"unknown cost model {cost!r}; known: {sorted(COST_MODELS)}")
        self.solver, self.strategy, self.cost = solver, strategy, cost
        self.solver_options = solver_options
        self.max_plans = max_plans
        self.capture_repeat = capture_repeat
        self.capture_batch = capture_batch
        self._full_capture: set = set()  # signatures that did not scale linearly
        self._entries: "collections.OrderedDict[Hashable, _Entry]" = collections.OrderedDict()
        # Counters of the last iteration (the hook itself lives as long as
        # that iteration's graph, as Chainer's retained arrays do).
        self.last_stats: Optional[IterationStats] = None

    @staticmethod
    def _link(args: Tuple[Any, ...]) -> Optional[chainer.Link]:
        return args[0] if args and isinstance(args[0], chainer.Link) else None

    # ------------------------------------------------------------ plans
    @property
    def plans(self) -> Dict[Hashable, Any]:
        """The cached plans by input signature."""
        return {k: e.plan for k, e in self._entries.items()}

    def clear(self) -> None:
        """Forget every cached plan."""
        self._entries.clear()

    def plan_for(self, *args: Any, **kwargs: Any) -> Any:
        """The plan for these inputs (planned now if not cached)."""
        return self._entry(_signature(args, kwargs), args, kwargs).plan

    def _entry(self, sig: Hashable, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> _Entry:
        entry = self._entries.get(sig)
        if entry is not None:
            self._entries.move_to_end(sig)
            return entry
        from ..core.planner import solve
        t0 = time.perf_counter()
        graph = self._capture(sig, args, kwargs)
        plan = solve(graph, self.budget_bytes, solver=self.solver, strategy=self.strategy,
                     **self.solver_options)
        program = Program(graph, plan.lower_sets, frozenset(plan.kept))
        entry = _Entry(graph, plan, program, time.perf_counter() - t0)
        logger.info("chainer_recompute: planned %d functions in %.2f s for budget %s: %s",
                    graph.n, entry.planning_time_s, format_bytes(self.budget_bytes), plan)
        if program.unsafe:
            logger.warning("chainer_recompute: %d functions cannot be recomputed safely and "
                           "are kept: %s", len(program.unsafe),
                           ", ".join(f"{graph.nodes[v].op} ({graph.nodes[v].attrs.get('unsafe_reason')})"
                                     for v in program.unsafe[:5]))
        self._entries[sig] = entry
        while len(self._entries) > self.max_plans:
            self._entries.popitem(last=False)
        return entry

    def _capture(self, sig: Hashable, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Graph:
        link = self._link(args)
        batch = batch_size_of(args, kwargs)
        small = self.capture_batch
        if small is None or batch is None or small >= batch or sig in self._full_capture:
            return capture(self.fn, *args, repeat=self.capture_repeat, cost_model=self.cost,
                           link=link, **kwargs)

        def cut(x: Any) -> Any:
            arr = x.raw_array if isinstance(x, chainer.Variable) else x
            if isinstance(arr, chainer.get_array_types()) and arr.ndim and arr.shape[0] == batch:
                return x[:small]
            return x

        graph = capture(self.fn, *[cut(a) for a in args], repeat=self.capture_repeat,
                        cost_model=self.cost, link=link, batch_size=small,
                        **{k: cut(v) for k, v in kwargs.items()})
        return graph.scale_batch(batch)

    # ------------------------------------------------------------- call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (chainer.config.train and chainer.config.enable_backprop):
            return self.fn(*args, **kwargs)
        sig = _signature(args, kwargs)
        entry = self._entry(sig, args, kwargs)
        hook = IterationHook(entry.program)
        with hook:
            out = self.fn(*args, **kwargs)
        hook.finish_forward()
        if hook.mismatch is not None:
            logger.warning("chainer_recompute: the model's graph changed for the same input "
                           "signature (%s); this iteration keeps what it did not release "
                           "yet, and the next call is planned again", hook.mismatch)
            entry = self._entries.pop(sig, None)
            if entry is not None and entry.graph.meta.get("scaled_from") is not None:
                self._full_capture.add(sig)
        self.last_stats = hook.stats
        return out


_SUBCLASSES: Dict[type, type] = {}


def _recompute_forward(self: chainer.Link, *args: Any, **kwargs: Any) -> Any:
    return vars(self)[_ATTR](self, *args, **kwargs)


def _subclass_for(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {
            "forward": _recompute_forward, "_chainer_recompute_base": cls,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__})
        _SUBCLASSES[cls] = sub
    return sub


def apply(model: chainer.Link, budget: Any, *, solver: str = "approx", strategy: str = "tc",
          cost: str = "measured", **options: Any) -> chainer.Link:
    """Make ``model`` recompute, in place, and return it.

    The Link keeps its parameters, their paths (``save_npz`` / ``load_npz``
    work as before), its optimizer and its device moves; only ``forward``
    changes: the instance gets a subclass of its class whose ``forward``
    runs the original one under the backward driver (:func:`remove` puts
    the class back). Copies of the model (``model.copy()``, ``deepcopy``)
    keep recomputing, each with its own plans. Training calls are planned
    on first use per input signature; evaluation calls run the plain
    forward.

    Args:
        model: the Link whose call returns the loss (e.g. a
            ``chainer.links.Classifier``).
        budget, solver, strategy, cost, options: see :class:`Recompute`.

    Returns:
        ``model`` itself.

    Raises:
        BudgetError: the budget cannot be read (nothing is changed).
        UnknownSolverError: unknown solver or strategy (nothing is changed).

    >>> model = apply(L.Classifier(net), budget='8G')        # doctest: +SKIP
    """
    if not isinstance(model, chainer.Link):
        raise RecomputeError(f"apply() takes a chainer.Link, got {type(model).__name__}; for "
                             f"a plain callable use chainer_recompute.Recompute(fn, budget=...)")
    base = getattr(type(model), "_chainer_recompute_base", type(model))
    runner = Recompute(base.forward, budget, solver=solver, strategy=strategy, cost=cost,
                       **options)
    vars(model)[_ATTR] = runner
    model.__class__ = _subclass_for(base)
    return model


def remove(model: chainer.Link) -> chainer.Link:
    """Undo :func:`apply`: ``model`` runs its plain forward again."""
    base = getattr(type(model), "_chainer_recompute_base", None)
    if base is not None:
        model.__class__ = base
        vars(model).pop(_ATTR, None)
    return model


def runner_of(model: chainer.Link) -> Optional[Recompute]:
    """The :class:`Recompute` that :func:`apply` installed, or None."""
    return vars(model).get(_ATTR)
