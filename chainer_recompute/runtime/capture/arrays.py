"""What the recorder inspects in Chainer's objects: the arrays a function
keeps in its attributes, which array owns a view's memory, content
checksums, the arrays of a call's arguments and of a forward's result, and
whether a gradient array is gone."""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy

from .. import _chainer  # noqa: F401  (NumPy 2 compatibility before chainer)
from .._chainer import param_grad
import chainer

from ..device import device_of

# FunctionNode bookkeeping attributes that are not arrays the function keeps.
_SKIP_ATTRS = frozenset({
    "_retained_output_data", "inputs", "outputs", "stack", "_input_layouts",
    "_output_layouts", "rank", "lazy_grad_sum", "_input_indexes_to_retain",
    "_output_indexes_to_retain", "_output_count", "_function", "forward",
    "local_function_hooks", "_local_function_hooks", "_n_local_function_hooks",
    "_is_chainerx_fallback_mode", "chainerx_device", "_chainerx_retained_inputs",
    "_chainerx_retained_outputs", "_supports_static_optimizations", "_static_forward",
})



def function_op(f: chainer.FunctionNode) -> str:
    """The class name of a function (of the wrapped one for old-style)."""
    inner = getattr(f, "_function", None)
    return type(inner).__name__ if inner is not None else type(f).__name__


def _attr_owners(f: chainer.FunctionNode) -> List[Any]:
    owners = [f]
    inner = getattr(f, "_function", None)
    if inner is not None:
        owners.append(inner)
    return owners


def attribute_arrays(f: chainer.FunctionNode) -> List[Tuple[Any, str, Any]]:
    """``(owner, name, array)`` for every ndarray kept in the attributes of
    ``f`` (and of the old-style Function it wraps)."""
    array_types = chainer.get_array_types()
    found = []
    for owner in _attr_owners(f):
        for name, value in list(vars(owner).items()):
            if name in _SKIP_ATTRS:
                continue
            if isinstance(value, array_types):
                found.append((owner, name, value))
    return found


def owner_of(f: Any, name: str) -> Any:
    """The object (``f`` or the old-style Function it wraps) holding attribute ``name``."""
    inner = getattr(f, "_function", None)
    if inner is not None and name in vars(inner):
        return inner
    return f


def is_array(x: Any) -> bool:
    return isinstance(x, chainer.get_array_types())


def root_of(a: Any) -> Any:
    """The object that owns the memory of array ``a`` (``a`` unless a view)."""
    while True:
        b = getattr(a, "base", None)
        if b is None:
            return a
        a = b


def same_array(a: Any, b: Any) -> bool:
    """Bitwise equality of two arrays (NaN equal to NaN)."""
    return device_of([a, b]).same(a, b)


def fingerprint(a: Any) -> Tuple[Any, ...]:
    """A content checksum of ``a`` (:meth:`~chainer_recompute.runtime.device.Device.checksum`)."""
    return device_of([a]).checksum(a)


def buffer_print(a: Any) -> Tuple[Any, ...]:
    """The :func:`fingerprint` of the memory ``a`` lives in: its base
    buffer when that is contiguous (no copy of a strided view)."""
    r = root_of(a)
    if is_array(r) and r.flags.c_contiguous:
        return fingerprint(r)
    return fingerprint(a)


def content_print(a: Any) -> Tuple[Any, ...]:
    """A cheaper :func:`buffer_print`, to tell whether the memory ``a``
    lives in was written since (:meth:`~chainer_recompute.runtime.device.Device.word_sum`
    of its base buffer when that is contiguous)."""
    r = root_of(a)
    r = r if is_array(r) and r.flags.c_contiguous else a
    return device_of([r]).word_sum(r)


def _arrays_in(x: Any, path: str) -> Iterator[Tuple[str, Any]]:
    """The arrays of a call argument (Variables, arrays, nested tuples,
    lists and dicts), with a path naming each."""
    if isinstance(x, chainer.Variable):
        arr = x.raw_array
        if arr is not None:
            yield path, arr
    elif is_array(x):
        yield path, x
    elif isinstance(x, (tuple, list)):
        for k, y in enumerate(x):
            yield from _arrays_in(y, f"{path}.{k}")
    elif isinstance(x, dict):
        for k, y in x.items():
            yield from _arrays_in(y, f"{path}.{k}")


def held_arrays(link: chainer.Link) -> List[Tuple[Optional[chainer.Variable], Any]]:
    """The arrays ``link`` itself keeps in attributes that Chainer does not
    register (neither parameters nor persistents): arrays, the arrays of
    Variables that are not parameters, and those in lists and tuples there
    (a memory bank, ``self.attention = a.array`` kept for logging, a
    segment's hidden states kept for the next call), as
    ``(variable or None, array)``."""
    persistent = getattr(link, "_persistent", ())
    found: List[Tuple[Optional[chainer.Variable], Any]] = []
    for name, v in vars(link).items():
        if name in persistent:
            continue
        for x in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(x, chainer.Variable) and not isinstance(x, chainer.Parameter):
                if x.raw_array is not None:
                    found.append((x, x.raw_array))
            elif is_array(x):
                found.append((None, x))
    return found


def persistent_arrays(link: chainer.Link) -> List[Tuple[str, Any]]:
    """``(path, array)`` of each persistent array of ``link`` and the Links
    in it (BatchNorm's statistics, a fixed mask registered with
    ``register_persistent``), each once; the path as a parameter's
    (``/predictor/conv1/mask``)."""
    found, seen = [], set()
    for prefix, sub in link.namedlinks():
        for name in getattr(sub, "_persistent", ()):
            v = getattr(sub, name, None)
            if is_array(v) and id(v) not in seen:
                seen.add(id(v))
                found.append((f"{prefix.rstrip('/')}/{name}", v))
    return found


def persistent_array_ids(link: chainer.Link,
                         persistents: Optional[List[Tuple[str, Any]]] = None) -> set:
    """ids of the parameter arrays and persistent arrays of ``link``
    (``persistents``: :func:`persistent_arrays` of it, where made already)."""
    ids = {id(p.array) for p in link.params() if p.array is not None}
    ids.update(id(v) for _, v in (persistent_arrays(link) if persistents is None
                                  else persistents))
    return ids


def _variables_in(result: Any) -> Iterator[chainer.Variable]:
    if isinstance(result, chainer.Variable):
        yield result
    elif isinstance(result, dict):
        for v in result.values():
            yield from _variables_in(v)
    elif isinstance(result, (tuple, list)):
        for v in result:
            yield from _variables_in(v)


def result_variables(result: Any) -> List[chainer.Variable]:
    """The Variables of a forward's result, each once, in order: the result
    itself, the items of tuples, lists and dicts, and the attributes of
    other objects (chainerrl's distributions and action values hold theirs:
    ``SoftmaxDistribution.logits``, ``DiscreteActionValue.q_values``), four
    levels deep. Links, optimizers, functions and classes are not looked
    into."""
    found: List[chainer.Variable] = []
    seen: set = set()
    # (a loop over a stack, not a recursive closure: that would be a
    # reference cycle holding ``found``, the model's outputs and their
    # graph, until the garbage collector runs)
    stack = [(result, 0)]
    while stack:
        x, depth = stack.pop()
        if id(x) in seen or depth > 4:
            continue
        seen.add(id(x))
        if isinstance(x, chainer.Variable):
            found.append(x)
            continue
        if isinstance(x, dict):
            items = list(x.values())
        elif isinstance(x, (tuple, list)):
            items = list(x)
        elif isinstance(x, (chainer.Link, chainer.Optimizer, type)) or callable(x):
            continue
        else:
            items = list(getattr(x, "__dict__", {}).values())
        stack.extend((item, depth + 1) for item in reversed(items))
    return found


def backward_from(result: Any, link: Optional[chainer.Link] = None) -> bool:
    """Run a backward pass from every Variable of a forward's result that
    requires a gradient (:func:`result_variables`; from all of them where
    none does, which runs no function's backward), as from the sum of all
    their elements: whatever loss a training loop makes of them, its
    backward reaches every output. ``link``'s gradients are cleared first,
    as a training loop clears them (the caller puts them back). False
    where the result holds no Variable."""
    found = result_variables(result)
    outs = [v for v in found if v.requires_grad] or found
    if not outs:
        return False
    if link is not None:
        link.cleargrads()
    loss = None
    for v in outs:
        term = v if v.size == 1 else chainer.functions.sum(v)
        loss = term if loss is None else loss + term
    loss.grad_var = None
    loss.backward()
    return True


def gone_watch(param: Any, grad: Any) -> Callable[[], bool]:
    """Whether ``grad`` (``param``'s gradient now) has been freed, later:
    by a weak reference to it, or where the array takes none, by
    ``param`` no longer holding it."""
    try:
        ref = weakref.ref(grad)
    except TypeError:
        pref, gid = weakref.ref(param), id(grad)

        def cleared() -> bool:
            p = pref()
            g = None if p is None else param_grad(p)
            return g is None or id(g) != gid
        return cleared
    return lambda: ref() is None


def node_nbytes(xnode: Any) -> int:
    """The bytes of a ``VariableNode``'s array, from its shape and dtype
    (0 where they are unknown)."""
    shape, dtype = xnode.shape, xnode.dtype
    if shape is None or dtype is None:
        return 0
    return int(math.prod(shape)) * numpy.dtype(dtype).itemsize
