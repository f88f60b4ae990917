"""apply(), remove() and runner_of(): a Link made to recompute in place
(a subclass of its class whose call runs the runner), and its pickling."""
from __future__ import annotations

from typing import Any, Dict, Optional

from .. import _chainer  # noqa: F401
import chainer

from ...core.errors import RecomputeError
from .recompute import Recompute

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
          cost: str = "measured", **options: Any) -> chainer.Link:
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
        budget: ``'8G'``, bytes, ... or ``'least'`` (see :class:`Recompute`).
        solver, strategy, cost, options: see :class:`Recompute`.

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
    runner = Recompute(base.__call__, budget, solver=solver, strategy=strategy, cost=cost,
                       **options)
    runner.check_keep(model)  # a path that names no link: refused before anything changes
    _install(model, base, runner)
    return model


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
