"""Input signatures of a training call (shapes, dtypes, device, train
mode, other arguments), their shape families (the same signature but
for shapes and numbers), and what a runner keeps per signature
(:class:`SignatureCache`)."""
from __future__ import annotations

import collections
from typing import Any, Dict, Hashable, Iterator, List, Optional, Tuple

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


class SignatureCache:
    """What a runner keeps per input signature (an ``_Entry`` each: its
    planned structures, a recording waiting to be planned, counters), the
    ``max_plans`` most recently used.

    >>> cache = SignatureCache(max_plans=1)
    >>> a = cache.entry(_signature((), {}))
    >>> cache.entry(_signature((1,), {})) is not a, len(cache)
    (True, 1)
    """

    def __init__(self, max_plans: int) -> None:
        self.max_plans = max_plans
        self._entries: "collections.OrderedDict[Hashable, Any]" = collections.OrderedDict()

    def entry(self, sig: Hashable) -> Any:
        """``sig``'s entry, made if new (the least recently used one then
        forgotten beyond ``max_plans``), now the most recently used."""
        from .state import _Entry
        entry = self._entries.get(sig)
        if entry is None:
            entry = self._entries[sig] = _Entry(*_family(sig))
            while len(self._entries) > self.max_plans:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(sig)
        return entry

    def get(self, sig: Hashable) -> Optional[Any]:
        return self._entries.get(sig)

    def items(self) -> List[Tuple[Hashable, Any]]:
        return list(self._entries.items())

    def values(self) -> List[Any]:
        return list(self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._entries))
