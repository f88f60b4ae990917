"""How both runners check a step against its plan: the meter from the
model's call on (:class:`CallMeter`), and what a runner does when a measured
step overshoots its budget (:class:`Correction`): warn once (per runner),
give the bytes by which its memory model is corrected, and let the runner
plan again with them.

The runner (:class:`~chainer_recompute.runtime.runner.Recompute`) adds the
correction to its graph's ``correction_bytes`` and solves that graph again;
``ChainRecompute`` adds it to its predictions and drops its cached plans.
Both go through :meth:`Correction.overshoot`, so that the test, the amount
and the warning are the same.

>>> import logging
>>> c = Correction(logging.getLogger("doctest"))
>>> c.overshoot(measured=90, budget=100, predicted=80)   # within the budget
0
>>> c.overshoot(measured=130, budget=100, predicted=95)  # over it: by what was missed
35
>>> c.overshoot(measured=101, budget=100, predicted=120), c.warned  # at least one byte
(1, True)
>>> c.overshoot(measured=130, budget=100, predicted=95, transient=40)  # over by one step's own
0
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from typing import Any, Callable, List, Optional

from ..core.units import format_bytes


class Correction:
    """The overshoot check of one runner, which warns once.

    Args:
        log: where the warning goes (the runner's report logger).
        prefix: put before the warning (the runner's name, ``'ChainRecompute: '``).
        corrected: what the warning says is corrected (``'the memory
            model'``, ``'the prediction'``).
    """

    def __init__(self, log: logging.Logger, *, prefix: str = "",
                 corrected: str = "the memory model") -> None:
        self.log = log
        self.prefix = prefix
        self.corrected = corrected
        self.warned = False  # the warning has been given

    def overshoot(self, measured: int, budget: Optional[int],
                  predicted: Optional[int], transient: int = 0) -> int:
        """The bytes to add to the predictions after a step that measured
        ``measured`` bytes under a plan that predicted ``predicted`` for
        ``budget``: 0 when the step held the budget (or there is no byte
        budget), else what the prediction missed, at least 1 (a correction
        always plans again). ``transient``: bytes of the measurement that
        no later step holds (left out of both). The first overshoot warns;
        later ones do not."""
        if budget is None or measured - transient <= budget:
            return 0
        correction = max(int(measured - transient - (predicted or 0)), 1)
        if not self.warned:
            self.warned = True
            self.log.warning("%sthe measured peak %s is over the budget %s (predicted %s%s); "
                             "correcting %s by %s and planning again", self.prefix,
                             format_bytes(measured), format_bytes(budget),
                             format_bytes(predicted or 0),
                             f"; {format_bytes(transient)} of the peak held by this step "
                             f"only" if transient else "", self.corrected,
                             format_bytes(correction))
        return correction


@dataclasses.dataclass(eq=False)
class CallMeter:
    """The allocator's peak from a model's call on, in a budget's scope:
    :meth:`total` adds ``own``, the bytes live at the call that the budget
    covers (set by the runner: counted by hand, or the plan's constant part),
    to what the allocator holds above its ``level`` at the call. Both
    runners measure their steps with it (``Recompute``'s step meter through
    the optimizer's update, ``ChainRecompute`` to the end of its backward).

    Args:
        meter: the running :class:`~chainer_recompute.runtime.memory.MemoryMeter`.
        own: see above.
        level: the meter's bytes at the call (the adopted arrays counted).
    """

    meter: Any
    own: int
    level: int
    #: the step's bytes at its peak before the last free of an array of
    #: ``own`` that the meter cannot see (:meth:`watch_untraced`)
    folded: int = 0
    #: weak references that watch those arrays
    untraced_refs: List[Any] = dataclasses.field(default_factory=list)
    #: the bytes of the arrays found at the call that :meth:`start` adopted
    adopted: int = 0

    @classmethod
    def start(cls, dev: Any, arrays: List[Any], **fields: Any) -> "CallMeter":
        """A meter started now on ``dev`` (a
        :class:`~chainer_recompute.runtime.device.Device`) that sees the
        frees of ``arrays``, found at the call: on NumPy made before tracing
        began, they are adopted (gradients cleared, the last call's outputs
        replaced are then seen going). ``fields``: the others (``own``; a
        subclass's)."""
        meter = dev.meter()
        meter.start()
        adopted = dev.adopt(meter, arrays)
        fields.setdefault("own", 0)
        return cls(meter=meter, level=meter.current_bytes(), adopted=adopted, **fields)

    def above(self, absolute_peak_bytes: int) -> int:
        """What the allocator held above its level at the call, when its
        meter (or one nested in it) read ``absolute_peak_bytes``."""
        return int(absolute_peak_bytes) - self.level

    def total(self, absolute_peak_bytes: int) -> int:
        """``own`` and :meth:`above`: the step's bytes at that reading (or
        at the peak before an unseen free of ``own``, if more)."""
        return max(self.folded, self.own + self.above(absolute_peak_bytes))

    def watch_untraced(self, arrays: List[Any], nbytes: Callable[[int], int]) -> None:
        """On NumPy, where an outer meter started after ``arrays`` (counted
        in ``own``, ``nbytes`` as they are counted there) were made, so
        that neither it nor this meter sees them freed (the gradients
        ``opt.update`` clears after the forward, a previous graph let go
        at it): when one is freed during the step, the peak so far is kept
        in ``folded`` and ``own`` drops by it."""
        this = weakref.ref(self)

        def freed(_ref: Any, size: int) -> None:
            cm = this()
            if cm is None or not cm.meter._running:
                return  # (after the meter: a tail's own meter runs on with ``own``)
            cm.folded = max(cm.folded, cm.own + cm.above(cm.meter.checkpoint()))
            cm.own -= size

        self.untraced_refs = [weakref.ref(a, functools.partial(freed, size=nbytes(a.nbytes)))
                              for a in self.meter.untraced(arrays)]
