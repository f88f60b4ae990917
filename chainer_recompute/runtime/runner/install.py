"""apply(), remove() and runner_of(): a Link made to recompute in place
(a subclass of its class whose call runs the runner), and its pickling."""
from __future__ import annotations

from typing import Any, Dict, Optional

from .. import _chainer  # noqa: F401
import chainer

from ...core.errors import RecomputeError
from .recompute import Recompute
from .tuning import Tuning

_ATTR = "_chainer_recompute"

_SUBCLASSES: Dict[type, type] = {}


def _recompute_call(self: chainer.Link, *args: Any, **kwargs: Any) -> Any:
    runner = vars(self).get(_ATTR)
    if runner is None:  # e.g. a half-built copy
        return type(self)._chainer_recompute_base.__call__(self, *args, **kwargs)
    return runner(self, *args, **kwargs)


def _reduce_ex(self: chainer.Link, protocol: int) -> Any:
    runner = vars(self)[_ATTR]
    state = {k: v for k, v in vars(self).items() if k != _ATTR}
    # A communicator does not travel with a snapshot: apply() again to set it.
    options = {k: v for k, v in runner.options.items() if k != "coordinator"}
    return (_rebuild, (type(self)._chainer_recompute_base, options), state)


def _rebuild(base: type, options: Dict[str, Any]) -> chainer.Link:
    """Unpickling (and copying) an applied Link: a new runner, no plans."""
    obj = base.__new__(base)
    _install(obj, base, Recompute(base.__call__, **options))
    return obj


def _subclass_for(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {
            "__call__": _recompute_call, "__reduce_ex__": _reduce_ex,
            "_chainer_recompute_base": cls, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
        _SUBCLASSES[cls] = sub
    return sub


def _install(model: chainer.Link, base: type, runner: Recompute) -> None:
    vars(model)[_ATTR] = runner
    model.__class__ = _subclass_for(base)


def apply(model: chainer.Link, budget: Any, *, solver: str = "auto", strategy: str = "tc",
          budget_scope: str = "total", capture_batch: Any = "auto",
          on_infeasible: str = "auto", workspace: Any = None, keep: Any = None,
          free_previous_graph: bool = False, calls_per_step: Optional[int] = None,
          verbose: bool = True, tuning: Optional[Tuning] = None,
          **legacy: Any) -> chainer.Link:
    """Make ``model`` recompute, in place, and return it.

    The Link keeps its parameters, their paths (``save_npz`` / ``load_npz``
    work as before), its optimizer and its device moves; only calling it
    changes: the instance gets a subclass of its class whose ``__call__``
    runs the original one under the backward driver (:func:`remove` puts
    the class back). It pickles (Trainer snapshots, multiprocess
    iterators), and copies (``model.copy()``, ``deepcopy``) recompute with
    plans of their own. Applying again replaces the options; a Link called
    inside an applied one runs as part of the outer plan.

    Args:
        model: the Link whose call returns the loss (e.g. a
            ``chainer.links.Classifier``); it may define ``forward`` or
            only ``__call__``.
        budget: ``'8G'`` (8·2^30 bytes), ``'8GB'`` (8·10^9), bytes,
            ``'least'``, ``'60%'`` (of plain Chainer's need) or
            ``'device'`` (docs/defaults.md).
        solver: ``'auto'``, ``'hier'``, ``'approx'``, ``'exact'``,
            ``'chen'``, ``'chen-greedy'`` or ``'none'``.
        strategy: ``'tc'`` (least recomputation) or ``'mc'``.
        budget_scope: ``'total'`` (the whole iteration) or
            ``'activations'`` (the paper's model).
        capture_batch: how a signature's first call is planned
            (``'auto'``: from small captures, under the budget).
        on_infeasible: ``'auto'``, ``'raise'`` or ``'warn'``.
        workspace: a bound on one convolution's temporary memory, ``'auto'``
            or None.
        keep: link paths (or a predicate on recorded functions) whose
            outputs no plan drops.
        free_previous_graph: opt-in: release earlier calls' graphs at the
            next training call.
        calls_per_step: how many times a training step calls the model
            before one backward through them all (2 for a discriminator on
            the real and the fake batch), to plan the first step for them;
            None: found when a step shows them.
        verbose: the one line on stderr when a plan is made.
        tuning: the planner's and runner's knobs (:class:`Tuning`).
        legacy: ``Tuning``'s knobs and solver options passed directly, as
            before ``tuning=`` (deprecated: a DeprecationWarning names the
            ``Tuning`` field); ``coordinator=`` (ChainerMN,
            :mod:`~chainer_recompute.runtime.distributed`).

    Each option is documented at length on :class:`Recompute`.

    Returns:
        ``model`` itself.

    Raises:
        BudgetError: the budget cannot be read (nothing is changed).
        UnknownSolverError: unknown solver or strategy (nothing is changed).
        KeepError: a ``keep=`` path names no link of ``model`` (the
            message gives the closest names; nothing is changed).

    >>> model = apply(L.Classifier(net), budget='8G')        # doctest: +SKIP
    >>> model = apply(model, budget='8G', keep=['/predictor/attn'])  # doctest: +SKIP
    """
    if not isinstance(model, chainer.Link):
        raise RecomputeError(f"apply() takes a chainer.Link, got {type(model).__name__}; for "
                             f"a plain callable use chainer_recompute.Recompute(fn, budget=...)")
    base = getattr(type(model), "_chainer_recompute_base", type(model))
    options = _tuning_options(tuning, legacy)
    runner = Recompute(base.__call__, budget, solver=solver, strategy=strategy,
                       budget_scope=budget_scope, capture_batch=capture_batch,
                       on_infeasible=on_infeasible, workspace=workspace, keep=keep,
                       free_previous_graph=free_previous_graph, calls_per_step=calls_per_step,
                       verbose=verbose, **options)
    runner.check_keep(model)  # a path that names no link: refused before anything changes
    _install(model, base, runner)
    return model


def _tuning_options(tuning: Optional[Tuning], legacy: Dict[str, Any]) -> Dict[str, Any]:
    """Recompute's keyword arguments from ``tuning`` and the knobs passed
    to ``apply()`` directly (deprecated, still honoured)."""
    if tuning is not None and not isinstance(tuning, Tuning):
        raise RecomputeError(f"tuning= takes a chainer_recompute.Tuning, got "
                             f"{type(tuning).__name__}")
    options = (tuning or Tuning()).options()
    legacy = dict(legacy)
    coordinator = legacy.pop("coordinator", None)
    if legacy:
        defaults = Tuning().options()
        both = [k for k in legacy if tuning is not None and options.get(k) != defaults.get(k)]
        if both:
            raise RecomputeError(f"{', '.join(both)} given both in tuning= and as apply()'s "
                                 f"own arguments: give each once, in tuning=")
        import warnings
        known = Tuning.fields()
        said = ", ".join(f"{k}={v!r}" if k in known else f"solver_options={{{k!r}: {v!r}}}"
                         for k, v in legacy.items())
        warnings.warn(f"apply({', '.join(k + '=...' for k in legacy)}) is deprecated: pass "
                      f"tuning=chainer_recompute.Tuning({said})", DeprecationWarning,
                      stacklevel=3)
        options.update(legacy)
    if coordinator is not None:
        options["coordinator"] = coordinator
    return options


def remove(model: chainer.Link) -> chainer.Link:
    """Undo :func:`apply`: ``model`` runs its plain ``__call__`` again."""
    base = getattr(type(model), "_chainer_recompute_base", None)
    if base is not None:
        model.__class__ = base
        vars(model).pop(_ATTR, None)
    return model


def runner_of(model: chainer.Link) -> Optional[Recompute]:
    """The :class:`Recompute` that :func:`apply` installed, or None."""
    return vars(model).get(_ATTR)
