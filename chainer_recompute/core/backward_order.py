"""Another backward order with Chainer's gradients, bit for bit.

Chainer's backward runs its functions by rank (depth from the inputs), so
functions that do not depend on a long chain (an LSTM's embedding and
input projections) run after the whole chain's backward while their
output gradients wait. A gradient's bits depend only on the order in which
the backward passes of its array's readers add into it (Chainer sums them
as they come, ``(g1 + g2) + g3``), so any order that runs each function
after the readers of its outputs, and the readers of each array in
Chainer's relative order, gives the same gradients. :func:`reorder` makes
the one that runs, among the functions ready, the latest in the forward
first; :func:`in_order` is a graph replayed in it.

Where it is used: below the single-level least a budget search also plans
a graph in that order (:class:`~chainer_recompute.core.budget.BudgetSearch`),
when the recorded backward allows it (``graph.step.closed_backward``: it
ran from the graph's own loss and read nothing with a gradient from
outside); a plan made there carries the order (``Plan.backward_order``),
the replay follows it, and the executor makes Chainer follow it by giving
the graph's functions new ranks at the end of the forward
(:meth:`~chainer_recompute.runtime.executor.IterationHook.impose_order`).
docs/algorithm.md §10 has the argument.
"""
from __future__ import annotations

import heapq
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .graph import Graph


def reorder(order: Sequence[int], reads: Callable[[int], Sequence[Any]],
            producer: Callable[[Any], Optional[int]]) -> List[int]:
    """The latest-forward-first backward order with the same gradients as
    ``order``.

    Args:
        order: the functions (forward positions) in the order their backward
            ran.
        reads: the arrays a function reads (any hashable keys).
        producer: the forward position of the function that made an array
            (``None``: a parameter or an input).

    Each function comes after every function that reads its outputs, and
    the readers of each array keep their relative order in ``order``;
    among the functions ready, the latest in the forward goes first.

    >>> reads = {0: ['x'], 1: ['a'], 2: ['a'], 3: ['y']}
    >>> reorder([3, 1, 2, 0], reads.__getitem__, {'a': 0}.get)   # 1 reads a before 2
    [3, 1, 2, 0]
    >>> reorder([1, 2, 3, 0], reads.__getitem__, {'a': 0}.get)
    [3, 1, 2, 0]
    """
    pos = {v: k for k, v in enumerate(order)}
    after: Dict[int, set] = {v: set() for v in order}  # v -> those that must follow it
    readers: Dict[Any, List[int]] = {}
    for v in order:
        for a in reads(v):
            readers.setdefault(a, []).append(v)
            p = producer(a)
            if p is not None and p in pos and p != v:
                after[v].add(p)
    for rs in readers.values():
        rs.sort(key=pos.__getitem__)
        for x, y in zip(rs, rs[1:]):
            if x != y:
                after[x].add(y)
    waiting = {v: 0 for v in order}
    for v in order:
        for w in after[v]:
            waiting[w] += 1
    ready = [-v for v in order if waiting[v] == 0]
    heapq.heapify(ready)
    out: List[int] = []
    while ready:
        v = -heapq.heappop(ready)
        out.append(v)
        for w in after[v]:
            waiting[w] -= 1
            if waiting[w] == 0:
                heapq.heappush(ready, -w)
    if len(out) != len(order):  # (``order`` itself satisfies every constraint)
        raise AssertionError("the readers' order and the wiring disagree")
    return out


_ORDERED: Dict[Tuple[int, Tuple[int, ...]], Tuple[Any, Graph]] = {}


def in_order(graph: Graph, order: Sequence[int]) -> Graph:
    """``graph`` replayed with its backward in ``order`` (the same graph
    object for the same order; the last few are kept, so that the compiled
    replay's context of each is made once)."""
    order = tuple(order)
    if graph.backward_order == order:
        return graph
    key = (id(graph), order)
    got = _ORDERED.get(key)
    if got is not None and got[0]() is graph:
        return got[1]
    out = graph.replace(backward_order=order)
    for k in [k for k, (ref, _) in _ORDERED.items() if ref() is None]:
        del _ORDERED[k]
    while len(_ORDERED) >= 4:
        del _ORDERED[next(iter(_ORDERED))]
    _ORDERED[key] = (weakref.ref(graph), out)
    return out


def reordered(graph: Graph) -> Optional[Graph]:
    """``graph`` in :func:`reorder`'s order, where its recorded backward
    allows another order (``step.closed_backward``, one call per step) and
    that order differs from the recorded one; else ``None``."""
    step = graph.step
    if (not step.closed_backward or not graph.backward_order or step.calls_per_step != 1
            or step.whole_calls_per_step):
        return None
    new = reorder(graph.backward_order, lambda v: graph.nodes[v].inputs,
                  lambda a: graph.arrays[a].producer)
    return None if tuple(new) == graph.backward_order else in_order(graph, new)
