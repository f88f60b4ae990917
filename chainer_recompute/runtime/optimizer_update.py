"""The optimizer's update as a plan counts it: the state each update rule
will create, and the largest temporary of an update, both measured on
throw-away copies before the first ``optimizer.update()`` has run.

A plan is made at the end of the recorded (plain) first backward, or from a
separate capture before the first call: the update rules have made no
state yet, and how much an update allocates depends on the rule (Adam's
CPU update makes several parameter-sized temporaries: ``grad - m``,
``grad * grad``, ``sqrt(v)``, the step, ``step * m``), on its
hyperparameters (AMSGrad's ``vhat``, AdamW's weight decay), on the hooks
of the rule and of its optimizer, and on NumPy (which reuses some
temporaries of an expression in place). So nothing is guessed:

- **State.** For a rule whose state does not exist yet, a copy of the rule
  (``copy.copy``, its own ``_state`` and fp32 master copy) runs Chainer's
  own ``_init_states`` on a throw-away copy of the parameter, and the arrays
  it makes are counted (with ``use_fp32_update`` on a float16 parameter,
  the float32 master copy too). Chainer's ``UpdateRule.serialize`` does the
  same to learn the state's keys.
- **Temporaries.** That copy of the rule, its state made, then runs one
  whole update of the throw-away parameter (a copy of the parameter and of
  its gradient, or of the parameter where there is no gradient yet) under
  the device's meter (tracemalloc on NumPy, the memory pool on CuPy): the
  optimizer's per-parameter hooks (``call_for_each_param``, as
  ``hook(rule, param)``, on shallow copies of the hook objects), the
  rule's own hooks and ``update_core``, and the finiteness check of
  dynamic loss scaling. The peak above the level at its start (the copies
  and the state, which persist) is the parameter's update transient.
- **Large parameters.** A parameter of at least eight slices of
  :data:`SLICE_BYTES` (1 MiB) of whole rows is measured on copies of its
  first rows, at three sizes, and the figures (each state array, the
  transient) extrapolated to all its rows where they are linear in them
  (measured whole otherwise): a whole copy would hold up to several times
  the parameter at the first call, more than plain Chainer's first step
  where one parameter dominates. On NumPy the extrapolated figures are the
  whole measurement's, byte for byte, for every optimizer and hook of
  Chainer.
- **Whole-optimizer hooks** (called once per update as ``hook(optimizer)``):
  ``GradientClipping`` runs on a stand-in optimizer whose ``target`` holds
  a copy of the model's largest parameter: its work on each parameter is a
  ``ravel()`` (a view of a contiguous gradient, a copy otherwise) and a dot
  product, then an in-place scaling, so its peak is one parameter's, the
  largest. Any other such hook cannot be run safely outside the model (it
  sees the whole optimizer); it is named once in a warning, left out of
  the plan, and the runner's meter corrects the plan after the first
  planned step if it allocates more.

Each measurement leaves no trace: the global random states (NumPy's, CuPy's
generators) are put back (:meth:`RandomStates.isolated`), the real rule,
parameter, gradient, state and ``t`` are never touched, and the runtime's
patch of ``UpdateRule.update`` (which saves parameters and tells the
runner's meter) is bypassed. One measurement is made per distinct (rule
type, hyperparameters, hooks, shape, dtype, device), and kept in a cache
that lives as long as the model (a weak-keyed dictionary): the first plan
of a model pays for one update of one parameter of each distinct shape.

The optimizers themselves are found from the update rules: a rule made by
an optimizer's ``create_update_rule`` has the optimizer's ``hyperparam``
as its parent, and the objects referring to that parent (one scan of the
garbage collector's objects, :func:`gc.get_referrers`) include the
optimizer. This finds it whatever its ``target`` (the model or a link
holding it, as ``L.Classifier``) and whenever it was set up.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import warnings
import weakref
from typing import (Any, Callable, Dict, Hashable, Iterable, Iterator, List, Optional, Sequence,
                    Tuple, TypeVar)

import numpy

from . import _chainer  # noqa: F401  (NumPy 2 compatibility before chainer)
from ._chainer import param_grad
import chainer

from ..core.units import format_bytes
from .device import RandomStates, device_of
from .memory import rule_arrays
from .param_updates import _update as _patched_update

logger = logging.getLogger(__name__)
#: The runner's report logger (``runtime.runner.log.report``; named here
#: rather than imported, which would import the runner from the recorder).
report = logging.getLogger("chainer_recompute.report")

__all__ = ["UpdateBytes", "update_bytes", "optimizers_of"]

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class UpdateBytes:
    """What an optimizer's update of some parameters holds.

    Attributes:
        optimizer_state_bytes: the update rules' state, each array once:
            the arrays held now, and for a rule that has made none yet, the
            arrays it will make at its first update.
        update_transient_bytes: the largest temporary of an update, above
            the parameters, gradients and state: the largest over the
            parameters of (its per-parameter hooks and rule update), or of
            a whole-optimizer hook. Without any update rule (no optimizer
            set up), the largest parameter's bytes (a hand-written
            ``param.array -= lr * param.grad``).
        unmeasured: what the figures leave out (a hook or rule that could
            not be measured), one line each.
    """

    optimizer_state_bytes: int
    update_transient_bytes: int
    unmeasured: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Sandboxed:
    """One measured update of a throw-away parameter."""

    state_nbytes: Tuple[int, ...]  # the arrays a fresh state holds (fp32 master copy included)
    transient_bytes: int  # the peak above the level at the update's start
    error: Optional[str] = None  # why it could not be measured (the figures are then a guess)


class _Cache:
    """Measurements of one model's updates (they die with it)."""

    def __init__(self) -> None:
        self.runs: Dict[Hashable, _Sandboxed] = {}
        self.said: set = set()  # warnings given
        self.parents: Optional[frozenset] = None  # ids of the rules' parent hyperparameters
        self.optimizers: List[Any] = []  # weak references to the optimizers found for them


_CACHES: "weakref.WeakKeyDictionary[Any, _Cache]" = weakref.WeakKeyDictionary()


def _cache_of(owner: Any) -> _Cache:
    try:
        cache = _CACHES.get(owner)
        if cache is None:
            cache = _CACHES[owner] = _Cache()
        return cache
    except TypeError:  # not weakly referable: measured again each time
        return _Cache()


# ----------------------------------------------------------------- optimizers
def optimizers_of(params: Iterable[chainer.Parameter]) -> List[chainer.Optimizer]:
    """The optimizers that update ``params``: those whose ``hyperparam``
    is the parent of one of their update rules' hyperparameters (what
    ``GradientMethod.setup`` makes), and whose ``target`` holds that
    parameter.

    One scan of the objects the garbage collector tracks
    (:func:`gc.get_referrers`), two where an optimizer's ``__dict__`` is a
    separate object.

    >>> import chainer, chainer.links as L
    >>> model = L.Linear(3, 2)
    >>> opt = chainer.optimizers.Adam().setup(model)
    >>> optimizers_of(model.params()) == [opt]
    True
    """
    params = list(params)
    parents: Dict[int, Any] = {}
    for p in params:
        rule = getattr(p, "update_rule", None)
        parent = getattr(getattr(rule, "hyperparam", None), "parent", None)
        if parent is not None:
            parents[id(parent)] = parent
    if not parents:
        return []
    referrers = gc.get_referrers(*parents.values())
    dicts = [r for r in referrers if isinstance(r, dict)]
    candidates = [r for r in referrers if isinstance(r, chainer.Optimizer)]
    if dicts:
        candidates += [o for o in gc.get_referrers(*dicts) if isinstance(o, chainer.Optimizer)]
    del referrers, dicts
    ids = {id(p) for p in params}
    found: List[Any] = []
    for opt in candidates:
        if any(o is opt for o in found) or id(getattr(opt, "hyperparam", None)) not in parents:
            continue
        target = getattr(opt, "target", None)
        if isinstance(target, chainer.Link) and any(id(p) in ids for p in target.params()):
            found.append(opt)
    return found


def _optimizers(cache: _Cache, params: Sequence[chainer.Parameter]) -> List[Any]:
    """:func:`optimizers_of`, scanned again only when the rules' parents change."""
    parents = frozenset(
        id(getattr(getattr(getattr(p, "update_rule", None), "hyperparam", None), "parent", None))
        for p in params)
    alive = [r() for r in cache.optimizers]
    if cache.parents != parents or any(o is None for o in alive):
        alive = optimizers_of(params)
        cache.parents = parents
        cache.optimizers = [weakref.ref(o) for o in alive]
    return [o for o in alive if o is not None]


def _hooks(hookable: Any) -> Tuple[List[Tuple[str, Any]], List[Tuple[str, Any]]]:
    """``(pre, post)``: the ``(name, hook)`` pairs of a Chainer hookable, in order."""
    if hookable is None:
        return [], []
    return (list(getattr(hookable, "_pre_update_hooks", {}).items()),
            list(getattr(hookable, "_post_update_hooks", {}).items()))


def _hooks_key(hooks: Sequence[Tuple[str, Any]]) -> Tuple[Tuple[str, str], ...]:
    return tuple((name, f"{type(h).__module__}.{type(h).__qualname__}") for name, h in hooks)


def _copy_hook(hook: Any) -> Any:
    """A shallow copy of a hook object (so that an attribute it sets on
    itself stays on the copy); functions and methods as they are."""
    if isinstance(hook, (type(_copy_hook), type(len))) or hasattr(hook, "__self__"):
        return hook
    try:
        return copy.copy(hook)
    except Exception:  # noqa: BLE001 - an object that refuses copying is called as it is
        return hook


# ------------------------------------------------------------------ the sandbox
def _unpatched_update(rule: Any) -> Callable[[Any, Any], Any]:
    """The rule's ``update``, bypassing the runtime's patch of
    ``UpdateRule.update`` (which saves parameter values for live iterations
    and tells the runner's meter that a parameter was updated)."""
    fn = type(rule).update
    if fn is _patched_update:
        fn = getattr(_patched_update, "__wrapped__", fn)
    return fn


def _rule_copy(rule: Any) -> Any:
    """A copy of ``rule`` sharing nothing the update writes: no state, no
    fp32 master copy, its own arrays, its own hooks (shallow copies)."""
    r = copy.copy(rule)
    array_types = chainer.get_array_types()
    for name, value in list(vars(r).items()):
        if isinstance(value, array_types):
            setattr(r, name, value.copy())
    r._state = None
    r._fp32_param = None
    hookable = getattr(rule, "_hookable", None)
    if hookable is not None:
        h = copy.copy(hookable)
        pre, post = _hooks(hookable)
        h._pre_update_hooks = type(hookable._pre_update_hooks)(
            (name, _copy_hook(f)) for name, f in pre)
        h._post_update_hooks = type(hookable._post_update_hooks)(
            (name, _copy_hook(f)) for name, f in post)
        r._hookable = h
    return r


def _throwaway(param: chainer.Parameter, share_grad: bool,
               rows: Optional[int] = None) -> chainer.Parameter:
    """A new Parameter with a copy of ``param``'s array, its gradient (its
    array where it has no gradient yet) and its loss scale, or of their
    first ``rows`` rows. With ``share_grad``, a NumPy gradient is not
    copied but given as a read-only view (the rules read it; writing it
    raises, and the caller then measures again with a copy): one
    parameter's bytes less at the measurement's peak."""
    array = param.array if rows is None else param.array[:rows]
    sp = chainer.Parameter(array.copy(), name=param.name)
    grad = param_grad(param)
    if grad is None:
        grad = param.array
    if rows is not None:
        grad = grad[:rows]
    if share_grad and isinstance(grad, numpy.ndarray):
        grad = grad.view()
        grad.flags.writeable = False
    else:
        grad = grad.copy()
    sp.grad = grad
    sp._loss_scale = getattr(param, "_loss_scale", None)
    return sp


def _wrote_shared(e: Exception) -> bool:
    """Whether ``e`` is NumPy refusing to write a read-only array."""
    return isinstance(e, ValueError) and "read-only" in str(e)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The other random states, and no warning a throw-away update would
    give (``invalid value`` in MSVAG's first step): plain Chainer gives
    them at the real update."""
    with RandomStates.isolated(), warnings.catch_warnings(), numpy.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        yield


def _share_then_copy(run: Callable[[bool], _T]) -> _T:
    """``run(True)`` (the gradient shared, read-only); if that wrote the
    gradient, ``run(False)`` (a copy), once the first attempt's arrays
    are freed (with its exception, which holds its frame)."""
    try:
        return run(True)
    except ValueError as e:
        if not _wrote_shared(e):
            raise
    return run(False)


#: The least bytes of a large parameter's slice (whole rows): above NumPy's
#: 256 KiB threshold for eliding temporaries, so that an update makes the
#: temporaries it makes at full size (see the module docstring).
SLICE_BYTES = 1 << 20
#: what a figure of the largest slice may differ from the line through the
#: other two (a CuPy pool rounds each allocation up to 512 bytes)
_LINEAR_SLACK = 8192


def _slices(param: chainer.Parameter) -> Optional[Tuple[int, int, int]]:
    """The rows of the three copies :func:`_measured` runs, or None where
    ``param`` is measured whole."""
    a = param.array
    if a.ndim == 0 or a.shape[0] == 0:
        return None
    rows = -(-SLICE_BYTES // max(1, a.nbytes // a.shape[0]))
    return (rows, 2 * rows, 4 * rows) if 8 * rows <= a.shape[0] else None


def _measured(param: chainer.Parameter,
              measure: Callable[[Optional[int]], Tuple[int, ...]]) -> Tuple[int, ...]:
    """``measure(rows)``, the figures of an update of a copy of ``param``'s
    first ``rows`` rows (of all of it for None), for all of ``param``:
    extrapolated from three slices (:data:`SLICE_BYTES`) where each figure
    is linear in the rows, measured whole otherwise."""
    sizes = _slices(param)
    if sizes is not None:
        try:
            got = [measure(r) for r in sizes]
        except Exception:  # noqa: BLE001 - a rule that needs all the rows: measured whole
            got = []
        if got and len({len(g) for g in got}) == 1:
            (r1, r2, r4), n, full = sizes, param.shape[0], []
            for v1, v2, v4 in zip(*got):
                slope = (v4 - v1) / (r4 - r1)
                if abs(v2 - (v1 + slope * (r2 - r1))) > _LINEAR_SLACK:
                    break
                full.append(max(0, int(round(v4 + slope * (n - r4)))))
            else:
                return tuple(full)
    return measure(None)


def _sandbox(rule: Any, param: chainer.Parameter, pre: Sequence[Any], post: Sequence[Any],
             check_finite: bool) -> _Sandboxed:
    """Make a fresh state for a copy of ``rule`` and run one update with it
    of a throw-away copy of ``param`` (of slices of it: :func:`_measured`),
    between the optimizer's per-parameter hooks ``pre`` and ``post``; the
    state's array sizes and the update's peak above its start. Leaves no
    trace (see the module docstring)."""
    def measure(rows: Optional[int]) -> Tuple[int, ...]:
        run = _share_then_copy(lambda share: _sandbox_once(rule, param, pre, post, check_finite,
                                                           share, rows))
        return run.state_nbytes + (run.transient_bytes,)
    got = _measured(param, measure)
    return _Sandboxed(got[:-1], got[-1])


def _sandbox_once(rule: Any, param: chainer.Parameter, pre: Sequence[Any],
                  post: Sequence[Any], check_finite: bool, share_grad: bool,
                  rows: Optional[int] = None) -> _Sandboxed:
    dev = device_of([param.array])
    with _quiet():
        sp = _throwaway(param, share_grad, rows)
        r = _rule_copy(rule)
        target = sp
        fp32: Tuple[int, ...] = ()
        if getattr(r, "_use_fp32_update", False) and sp.dtype == numpy.float16:
            # what UpdateRule.update makes at the first update: a float32 master copy
            r._fp32_param = chainer.Parameter(sp.array.astype(numpy.float32), name=param.name)
            target = r._fp32_param
            fp32 = (int(target.array.nbytes),)
        r._init_states(target)
        state = tuple(int(v.nbytes) for v in (r._state or {}).values()
                      if isinstance(v, chainer.get_array_types())) + fp32
        update = _unpatched_update(r)
        xp = sp.device.xp
        meter = dev.meter()
        meter.start()
        try:
            if check_finite:  # Optimizer.check_nan_in_grads (dynamic loss scaling)
                xp.all(xp.isfinite(sp.grad))
            for hook in pre:
                hook(r, sp)
            update(r, sp)
            for hook in post:
                hook(r, sp)
        finally:
            measured = meter.stop()
    return _Sandboxed(state, max(0, int(measured.peak_bytes)))


class _StandInOptimizer:
    """What a whole-optimizer hook sees of its optimizer in the sandbox:
    ``target`` (a Link holding throw-away parameters) and ``t``."""

    def __init__(self, optimizer: Any, params: Sequence[chainer.Parameter]) -> None:
        self.target = chainer.ChainList()
        for p in params:
            link = chainer.Link()
            with link.init_scope():
                link.p = p
            self.target.append(link)
        self.t = getattr(optimizer, "t", 0)
        self.epoch = getattr(optimizer, "epoch", 0)


def _whole_hook_bytes(optimizer: Any, hook: Any, param: chainer.Parameter) -> int:
    """The peak of a whole-optimizer hook run on a stand-in optimizer
    holding a throw-away copy of ``param`` (the model's largest; of slices
    of it: :func:`_measured`)."""
    def once(share_grad: bool, rows: Optional[int]) -> int:
        dev = device_of([param.array])
        with _quiet():
            stand_in = _StandInOptimizer(optimizer, [_throwaway(param, share_grad, rows)])
            meter = dev.meter()
            meter.start()
            try:
                _copy_hook(hook)(stand_in)
            finally:
                measured = meter.stop()
        return max(0, int(measured.peak_bytes))
    return _measured(param, lambda rows: (_share_then_copy(lambda share: once(share, rows)),))[0]


#: Whole-optimizer hooks whose work on each parameter is done one parameter
#: at a time (measured on a stand-in holding the largest parameter, see the
#: module docstring).
_ONE_PARAMETER_AT_A_TIME = (chainer.optimizer_hooks.GradientClipping,)


# ----------------------------------------------------------------- the figures
def _rule_key(rule: Any, param: chainer.Parameter, opt_hooks: Hashable,
              check_finite: bool) -> Hashable:
    try:
        hp = tuple(sorted((k, repr(v)) for k, v in rule.hyperparam.get_dict().items()))
    except Exception:  # noqa: BLE001 - a custom hyperparameter object
        hp = (repr(rule.hyperparam),)
    pre, post = _hooks(getattr(rule, "_hookable", None))
    return (type(rule), hp, bool(getattr(rule, "_use_fp32_update", False)), _hooks_key(pre),
            _hooks_key(post), opt_hooks, check_finite, tuple(param.shape), str(param.dtype),
            str(param.device))


def _say(cache: _Cache, key: Hashable, message: str, *args: Any) -> None:
    if key in cache.said:
        return
    cache.said.add(key)
    report.warning(message, *args)


def update_bytes(params: Iterable[chainer.Parameter], *, owner: Any,
                 nbytes: Optional[Callable[[int], int]] = None) -> UpdateBytes:
    """The optimizer state and the largest update temporary of ``params``
    (see the module docstring for how each is measured).

    Args:
        params: the model's Parameters (tied ones counted once,
            uninitialised ones skipped).
        owner: the object whose lifetime the measurements are kept for
            (the model Link); measured again for another owner.
        nbytes: what an array of ``n`` bytes takes from its allocator (the
            device's :meth:`~chainer_recompute.runtime.device.Device.allocation_bytes`
            by default).

    Returns:
        :class:`UpdateBytes`. A rule or hook that cannot be measured is
        warned about once per owner on the ``chainer_recompute.report``
        logger and named in ``unmeasured``.

    >>> import chainer, chainer.links as L
    >>> model = L.Linear(1000, 1000)
    >>> opt = chainer.optimizers.Adam().setup(model)
    >>> got = update_bytes(model.params(), owner=model)
    >>> got.optimizer_state_bytes == 2 * (1000 * 1000 + 1000) * 4  # Adam's m and v
    True
    >>> got.update_transient_bytes >= 1000 * 1000 * 4  # a step the size of W, at least
    True

    See also:
        :func:`chainer_recompute.runtime.capture.state_bytes`, which puts
        these figures in every plan's graph.
    """
    seen: set = set()
    distinct: List[chainer.Parameter] = []
    for p in params:
        if p.array is not None and id(p) not in seen:
            seen.add(id(p))
            distinct.append(p)
    if not distinct:
        return UpdateBytes(0, 0)
    nb = nbytes if nbytes is not None else device_of([distinct[0].array]).allocation_bytes
    cache = _cache_of(owner)
    unmeasured: List[str] = []

    # the optimizers' hooks: per parameter (by the parameters of their targets) and whole
    # (pre hooks, post hooks, finiteness check) by parameter id
    per_param: Dict[int, Tuple[List[Tuple[str, Any]], List[Tuple[str, Any]], List[bool]]] = {}
    whole: List[Tuple[Any, str, Any]] = []
    with_rules = any(getattr(p, "update_rule", None) is not None for p in distinct)
    for opt in _optimizers(cache, distinct) if with_rules else []:
        pre, post = _hooks(getattr(opt, "_hookable", None))
        whole += [(opt, n, h) for n, h in pre + post
                  if not getattr(h, "call_for_each_param", False)]
        finite = bool(getattr(opt, "_loss_scaling_is_dynamic", False))
        for p in opt.target.params():
            got = per_param.setdefault(id(p), ([], [], []))
            got[0].extend((n, h) for n, h in pre if getattr(h, "call_for_each_param", False))
            got[1].extend((n, h) for n, h in post if getattr(h, "call_for_each_param", False))
            got[2].append(finite)

    state = 0
    transient = 0
    legacy = 0
    any_rule = False
    counted: set = set()
    for p in distinct:
        rule = getattr(p, "update_rule", None)
        if rule is None:
            legacy = max(legacy, nb(p.array.nbytes))
            continue
        any_rule = True
        current = getattr(rule, "state", None)  # (made by an update already: what it holds)
        for v in rule_arrays(rule):
            if hasattr(v, "nbytes") and id(v) not in counted:
                counted.add(id(v))
                state += nb(v.nbytes)
        if not rule.enabled:
            continue
        pre, post, checks = per_param.get(id(p), ([], [], []))
        finite = any(checks)
        key = _rule_key(rule, p, (_hooks_key(pre), _hooks_key(post)), finite)
        run = cache.runs.get(key)
        if run is None:
            try:
                run = _sandbox(rule, p, [h for _, h in pre], [h for _, h in post], finite)
            except Exception as e:  # noqa: BLE001 - a rule or hook that fails on a copy
                run = _Sandboxed((), int(p.array.nbytes), error=f"{type(e).__name__}: {e}")
            cache.runs[key] = run
            logger.debug("update of %s %s %s: state %s, transient %s", type(rule).__name__,
                         p.shape, p.dtype, run.state_nbytes, format_bytes(run.transient_bytes))
        if run.error is not None:
            what = (f"the optimizer update of {type(rule).__name__} on a {p.dtype} parameter "
                    f"of shape {tuple(p.shape)}")
            unmeasured.append(what)
            _say(cache, ("rule", type(rule)), "cannot measure %s on a throw-away copy (%s): "
                 "its state is not in the plan and its temporaries are counted as one "
                 "parameter's size; the runner's meter corrects the plan after the first "
                 "planned step if the update holds more", what, run.error)
        if current is None:
            state += sum(nb(n) for n in run.state_nbytes)
        transient = max(transient, run.transient_bytes)
    if not any_rule:
        transient = legacy

    largest = max(distinct, key=lambda q: q.array.nbytes)
    for opt, name, hook in whole:
        if type(hook) in _ONE_PARAMETER_AT_A_TIME:
            key = ("whole", type(hook), name, tuple(largest.shape), str(largest.dtype),
                   str(largest.device))
            run = cache.runs.get(key)
            if run is None:
                try:
                    run = _Sandboxed((), _whole_hook_bytes(opt, hook, largest))
                except Exception as e:  # noqa: BLE001
                    run = _Sandboxed((), 0, error=f"{type(e).__name__}: {e}")
                cache.runs[key] = run
            if run.error is None:
                transient = max(transient, run.transient_bytes)
                continue
        what = f"the optimizer hook {name!r} ({type(hook).__name__})"
        unmeasured.append(what)
        _say(cache, ("hook", name, type(hook)), "%s is called once per update with the whole "
             "optimizer and cannot be run on a copy: its temporaries are not in the plan; the "
             "runner's meter corrects the plan after the first planned step if it allocates "
             "more", what)
    return UpdateBytes(int(state), int(transient), tuple(unmeasured))
