"""What a recorded forward does besides its recorded functions, for the
:class:`~chainer_recompute.runtime.capture.recorder.Recorder`.

- **Work under no-backprop.** Functions the forward applies with backprop
  disabled (a frozen teacher's forward under ``chainer.no_backprop_mode()``
  inside a distillation loss) are not recorded as functions: no plan can
  drop or regenerate them, and Chainer keeps nothing of them for the
  backward. Their memory is in the step all the same. Chainer calls the
  function hooks for them too (before the forward returns, at the top
  level; backward work, CHAINER_NOTES §5, comes after the forward has
  returned), so :class:`UnrecordedWork` measures each stretch of them
  between two recorded functions with the allocator (its peak above the
  level where it began: ``Node.unrecorded_peak_bytes``, or the graph's
  ``step.unrecorded_tail_peak_bytes`` after the last function) and remembers, weakly, the arrays they
  make, with where they were made: a recorded function that reads one makes
  it an array of the graph with ``made_at``.
- **Parameters read inside a recorded function.** A function may apply
  others inside its forward (nested): ``F.forget(func, x)`` runs ``func``
  under no-backprop there and again, with backprop, in its backward, which
  then makes the gradients of ``func``'s parameters although they are no
  input of the ``Forget`` node. :class:`ParameterIndex` finds the model's
  parameters among the nested functions' inputs (``Node.inner_params``).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Tuple

from .arrays import is_array


class Made:
    """An array made by an unrecorded function: where (the index of the
    next recorded call), once a recorded call reads it its array id, and
    how many of the callers' Variables that hold it are watched and alive."""

    __slots__ = ("at", "aid", "live")

    def __init__(self, at: int) -> None:
        self.at = at
        self.aid: Optional[int] = None
        self.live = 0

    def read(self, rec: Any, index: int, var: Any, watch: bool,
             position: Callable[[], Optional[int]]) -> Any:
        """Recorded call ``index`` reads it, through the caller's Variable
        ``var`` (None: gone already): its record ``rec`` lives through this
        reader, or while ``var`` does (``watch``: a weak reference that
        sets ``rec.dies_at`` to ``position()`` when the last such Variable
        goes, returned to be kept)."""
        if var is None:
            if self.live == 0:  # (a Variable of an earlier reader holds it otherwise)
                rec.dies_at = max(rec.dies_at or 0, index + 1)
            return None
        if not watch:
            return None
        self.live += 1
        rec.dies_at = None

        def died(_ref: Any) -> None:
            self.live -= 1
            at = position()
            if at is not None and self.live == 0:
                rec.dies_at = max(rec.dies_at or 0, at)
        return weakref.ref(var, died)


class Aside:
    """An unrecorded function while it runs: its outputs, seen by its
    wrapped forward."""

    __slots__ = ("out",)

    def __init__(self) -> None:
        self.out: Tuple[Any, ...] = ()


class UnrecordedWork:
    """The stretches of unrecorded work of one forward (see the module
    docstring): the one running now, the peak of one after the last
    recorded call, and the live outputs of their functions.

    >>> work = UnrecordedWork()
    >>> work.begin(3, None); work.running, work.end()
    (True, None)
    """

    def __init__(self) -> None:
        self._at: Optional[int] = None  # the running stretch's position
        self._meter: Any = None
        #: the peak of the stretch after the last recorded call (None: none)
        self.tail_peak: Optional[int] = None
        self._made: Dict[int, Tuple[Any, Made]] = {}  # id(array) -> (weakref, Made)

    @property
    def running(self) -> bool:
        """A stretch began and no recorded call or end followed yet."""
        return self._at is not None

    @property
    def any_made(self) -> bool:
        return bool(self._made)

    def begin(self, at: int, meter: Any) -> None:
        """A stretch begins before recorded call ``at`` (if none is
        running), measured by ``meter`` (None: not measured)."""
        if self._at is not None:
            return
        self._at, self._meter = at, meter
        if meter is not None:
            meter.start()

    def end(self) -> Optional[int]:
        """The running stretch ends: its peak above the level where it
        began; None where none ran or it was not measured."""
        at, meter = self._at, self._meter
        self._at = self._meter = None
        if at is None or meter is None:
            return None
        return max(0, int(meter.stop().peak_bytes))

    def end_tail(self) -> None:
        """The forward is over: a stretch still running is the one after
        the last recorded call."""
        if self._at is not None:
            self.tail_peak = self.end()

    def wrap(self, function: Any) -> Aside:
        """Wrap ``function``'s forward (an instance attribute: take it off
        at its postprocess) to see its outputs."""
        aside = Aside()
        original = type(function).forward

        def wrapped(inputs: Tuple[Any, ...], _f: Any = function, _a: Aside = aside) -> Any:
            out = original(_f, inputs)
            _a.out = tuple(out)
            return out

        function.forward = wrapped
        return aside

    def note(self, out: Tuple[Any, ...], at: int) -> None:
        """Remember an unrecorded function's outputs (weakly: they come and
        go with the caller's work) as made at ``at`` (the running stretch's
        position when one runs)."""
        at = self._at if self._at is not None else at
        made = self._made
        for y in out:
            if not is_array(y):
                continue
            try:
                made[id(y)] = (weakref.ref(y, _forget(made, id(y))), Made(at))
            except TypeError:  # an array type without weak references: not followed
                continue

    def made_of(self, x: Any) -> Optional[Made]:
        """What is known of array ``x`` if an unrecorded function made it."""
        entry = self._made.get(id(x))
        if entry is None or entry[0]() is not x:
            return None
        return entry[1]


def _forget(made: Dict[int, Tuple[Any, Made]], key: int) -> Callable[[Any], None]:
    def gone(ref: Any) -> None:
        entry = made.get(key)
        if entry is not None and entry[0] is ref:
            del made[key]
    return gone


class ParameterIndex:
    """A link's parameters by the identity of their arrays, to find them
    among the inputs of functions nested in a recorded call (made again
    for each call: lazily initialised parameters get their arrays late)."""

    def __init__(self, link_ref: Optional[Callable[[], Any]]) -> None:
        self._link_ref = link_ref
        self._by_array: Dict[int, Any] = {}
        self._for: Optional[int] = None

    def note(self, index: int, found: Dict[int, Any], in_data: Tuple[Any, ...]) -> None:
        """A function nested in recorded call ``index`` reads ``in_data``:
        the link's parameters among them go into ``found`` (by ``id``)."""
        link = self._link_ref() if self._link_ref is not None else None
        if link is None:
            return
        if self._for != index:
            self._by_array = {id(p.array): p for p in link.params() if p.array is not None}
            self._for = index
        for x in in_data:
            p = self._by_array.get(id(x))
            if p is not None and p.array is x:
                found.setdefault(id(p), p)
