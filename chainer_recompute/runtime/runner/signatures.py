"""Input signatures of a training call (shapes, dtypes, device, train
mode, other arguments) and their shape families (the same signature but
for shapes and numbers)."""
from __future__ import annotations

from typing import Any, Dict, Hashable, List, Tuple

import numpy

from .. import _chainer  # noqa: F401
import chainer
from chainer import backend


def _signature(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Hashable:
    def one(x: Any) -> Hashable:
        if isinstance(x, chainer.Variable):
            x = x.raw_array
        if isinstance(x, chainer.get_array_types()):
            return ("array", tuple(x.shape), str(x.dtype), str(backend.get_device_from_array(x)))
        if isinstance(x, (tuple, list)):
            return (type(x).__name__,) + tuple(one(y) for y in x)
        if isinstance(x, dict):
            return ("dict",) + tuple((k, one(v)) for k, v in sorted(x.items(), key=repr))
        if isinstance(x, (int, float, str, bool, type(None))):
            return ("value", x)
        if isinstance(x, numpy.generic):  # np.float32(lr): by value, not by id
            return ("value", str(x.dtype), x.item())
        if type(x).__hash__ not in (None, object.__hash__):
            try:  # hashable by value (a frozen config, an enum, a tuple-like)
                hash(x)
                return ("value", type(x).__qualname__, x)
            except TypeError:
                pass
        return ("object", type(x).__name__, id(x))

    return (tuple(one(a) for a in args),
            tuple((k, one(v)) for k, v in sorted(kwargs.items())),
            bool(chainer.config.train))

def _family(sig: Hashable) -> Tuple[Hashable, Tuple[int, ...]]:
    """A signature without its arrays' shapes (their ranks kept) and its
    numbers' values (their types kept), and those shapes' dimensions in
    order: signatures of one family differ in shapes and numbers only (a
    batch padded to its longest molecule, a last partial batch, a schedule
    value)."""
    dims: List[int] = []

    def walk(x: Any) -> Any:
        if isinstance(x, tuple):
            if len(x) == 4 and x[0] == "array" and isinstance(x[1], tuple):
                dims.extend(x[1])
                return ("array", len(x[1]), x[2], x[3])
            if x and x[0] == "value" and isinstance(x[-1], (int, float)) \
                    and not isinstance(x[-1], bool):
                return x[:-1] + (type(x[-1]).__name__,)
            return tuple(walk(y) for y in x)
        return x

    return walk(sig), tuple(dims)
