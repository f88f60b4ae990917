"""Leave no trace: run an extra forward (and backward) and put back
everything plain Chainer would not have changed.

The global random states, the persistent values and attributes of every
Link reached (not only the model), lazily created parameters and gradients
are restored; the extra forward reads the caller's arguments through
Variables of its own (:func:`detached_arguments`), so its backward
reaches no Variable of the caller's.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple

from .. import _chainer  # noqa: F401  (NumPy 2 compatibility before chainer)
from .._chainer import param_grad
import chainer

from ..device import RandomStates
from .arrays import held_arrays, is_array

def detached_arguments(args: Tuple[Any, ...], kwargs: Dict[str, Any],
                       rows: Optional[int] = None, batch: Optional[int] = None
                       ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The arguments of an extra forward, which changes none of the
    caller's: each ``chainer.Variable`` among them (in tuples, lists and
    dicts too, not their subclasses; not a Parameter) a new one, the same
    one the same new one. One of the caller's that a function made gets a
    new one a function makes too (an identity applied to a new leaf), so
    that the extra graph's backward goes on outside the model as the real
    one does, and ends there: the caller's Variable (its ``grad``: an
    adversarial example's input gradient) and the graph that made it (a
    generator's parameters) get nothing from it. With ``batch``, each
    top-level argument whose first axis has ``batch`` rows is a copy of
    them (a model that scales its input in place scales the caller's once,
    in the real call), of its first ``rows`` where ``rows`` is fewer, and
    so is each top-level list or tuple of ``batch`` arrays, one per sample
    (NStepLSTM's sequences): its first ``rows``, each a copy; other
    arrays are the caller's (a large table passed along is not copied).

    >>> import numpy as np
    >>> x = chainer.Variable(np.ones((4, 2), np.float32))
    >>> (y,), _ = detached_arguments((x,), {}, rows=1, batch=4)
    >>> y is not x, y.shape, y.creator is None, y.requires_grad
    (True, (1, 2), True, True)
    """
    made: Dict[Tuple[int, bool], Any] = {}
    cut = rows is not None and batch is not None and rows < batch

    def sample_list(x: Any) -> bool:
        # a top-level list of one array per sample (NStepLSTM's sequences)
        return (type(x) in (tuple, list) and len(x) == batch and len(x) > 0
                and all(is_array(v.raw_array if isinstance(v, chainer.Variable) else v)
                        for v in x))

    def new(x: Any, top: bool, sample: bool = False) -> Any:
        if top and sample_list(x):  # its first ``rows`` samples, copied
            return type(x)(new(v, False, True) for v in (x[:rows] if cut else x))
        if type(x) in (tuple, list):  # (not a subclass: a namedtuple, a dict with
            return type(x)(new(v, False) for v in x)  # attribute access, left as it is)
        if type(x) is dict:
            return {k: new(v, False) for k, v in x.items()}
        if isinstance(x, chainer.Parameter):
            return x
        arr = x.raw_array if isinstance(x, chainer.Variable) else x
        if not is_array(arr):
            return x
        key = (id(x), top or sample)
        if key not in made:
            if sample:
                arr = arr.copy()
            elif top and arr.ndim and arr.shape[0] == batch:
                arr = (arr[:rows] if cut else arr).copy()
            if not isinstance(x, chainer.Variable):
                made[key] = arr
            else:
                leaf = chainer.Variable(arr, requires_grad=x.requires_grad)
                made[key] = (chainer.functions.identity(leaf) if x.creator_node is not None
                             else leaf)
        return made[key]

    return (tuple(new(a, True) for a in args), {k: new(v, True) for k, v in kwargs.items()})


def _uninitialize(param: chainer.Parameter) -> None:
    """Put a lazily initialised parameter back to its uninitialised state."""
    param._data[0] = None
    param._node._update_data_info(None)
    param.grad = None


def _writeable(a: Any) -> bool:
    """Whether array ``a`` can be written in place (NumPy's flag; CuPy's
    arrays always)."""
    return bool(getattr(getattr(a, "flags", None), "writeable", True))


def _grad_copy(p: chainer.Parameter) -> Any:
    g = param_grad(p)
    return None if g is None else g.copy()


class _LinkSnapshot:
    __slots__ = ("link", "attrs", "arrays", "held", "params")

    def __init__(self, link: chainer.Link) -> None:
        self.link = link
        self.attrs = dict(vars(link))
        self.arrays = {}
        for name in getattr(link, "_persistent", ()):
            v = getattr(link, name, None)
            if is_array(v):
                self.arrays[name] = (v, v.copy())
        # the arrays it keeps unregistered (a memory bank the forward
        # writes in place): their contents (not a read-only one's, a
        # broadcast view: it cannot have been written), which array a
        # Variable held, and its gradient (a backward reaches one that
        # requires it)
        self.held = [(var, arr, arr.copy() if _writeable(arr) else None,
                      None if var is None else _grad_copy(var))
                     for var, arr in held_arrays(link)]
        own = [getattr(link, name) for name in sorted(getattr(link, "_params", ()))]
        self.params = [(p, p.array is None, _grad_copy(p))
                       for p in own]  # its own: each Link is snapshotted on its own

    def restore(self) -> None:
        for name, (arr, saved) in self.arrays.items():
            arr[...] = saved
        for var, arr, saved, grad in self.held:
            if var is not None:
                if var.raw_array is not arr:
                    var.array = arr
                _restore_grad(var, grad)
            if saved is not None:
                arr[...] = saved
        vars(self.link).clear()
        vars(self.link).update(self.attrs)
        for p, was_uninit, grad in self.params:
            if was_uninit:
                _uninitialize(p)
            else:
                _restore_grad(p, grad)


class _LinkWatcher(chainer.LinkHook):
    """Snapshots every Link the moment its forward is first called."""

    def __init__(self, snapshots: Dict[int, _LinkSnapshot]) -> None:
        self.name = f"chainer_recompute.LinkWatcher-{id(self):x}"
        self.snapshots = snapshots

    def forward_preprocess(self, args: Any) -> None:
        link = args.link
        if id(link) not in self.snapshots:
            self.snapshots[id(link)] = _LinkSnapshot(link)


class _Trace:
    """What :func:`leave_no_trace` puts back (``snapshots``: by Link), and
    the gradients of parameters read outside any Link's call
    (:meth:`keep_grads`)."""

    def __init__(self) -> None:
        self.snapshots: Dict[int, _LinkSnapshot] = {}
        self.grads: Dict[int, Tuple[chainer.Parameter, Any]] = {}

    def keep_grads(self, params: Iterable[Any]) -> None:
        """Put back the gradients of ``params`` too, as they are now: the
        parameters the block's forward read, before its backward. Those of
        a Link it called or that is under the model are put back anyway; a
        parameter read without its Link's call (another model's weight,
        tied in) is not, and a backward through the block adds to its
        gradient."""
        owned = {id(p) for snap in self.snapshots.values() for p, _, _ in snap.params}
        for p in params:
            if p is not None and id(p) not in owned and id(p) not in self.grads:
                self.grads[id(p)] = (p, _grad_copy(p))

    def restore(self) -> None:
        for snap in self.snapshots.values():
            snap.restore()
        for p, grad in self.grads.values():
            _restore_grad(p, grad)


def _restore_grad(p: chainer.Parameter, grad: Any) -> None:
    now = param_grad(p)
    if grad is None:
        if now is not None:  # (one never cleared stays so, as Chainer left it)
            p.grad = None
    elif now is not None and now.shape == grad.shape:
        now[...] = grad
    else:
        p.grad = grad


@contextlib.contextmanager
def leave_no_trace(model: Any) -> Iterator[_Trace]:
    """Run a block (an extra forward, and backward) and put back everything
    plain Chainer would not have changed: the global random states (NumPy,
    CuPy), the persistent values and attributes (an ``L.LSTM``'s state, a
    BatchNorm's statistics and counters) of every Link called in the block
    and of every Link under ``model``, lazily created parameters, and the
    gradients of the parameters (of other ones the block's forward read,
    named to :meth:`_Trace.keep_grads` before its backward, too). The block
    draws from other random states (:meth:`RandomStates.isolated`): CuPy's
    generators are objects that its draws advance, so only fresh ones leave
    the caller's untouched."""
    trace = _Trace()
    link = model if isinstance(model, chainer.Link) else getattr(model, "__self__", None)
    if isinstance(link, chainer.Link):
        for sub in link.links():
            trace.snapshots[id(sub)] = _LinkSnapshot(sub)
    watcher = _LinkWatcher(trace.snapshots)
    try:
        with RandomStates.isolated(), watcher:
            yield trace
    finally:
        trace.restore()
