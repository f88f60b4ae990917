"""A Trainer extension that shows recomputation in ``LogReport`` and
``PrintReport``.

>>> import chainer_recompute as cr                                  # doctest: +SKIP
>>> from chainer_recompute.extensions import RecomputeReport        # doctest: +SKIP
>>> model = cr.apply(L.Classifier(net), budget='8G')                # doctest: +SKIP
>>> report = RecomputeReport()                                      # doctest: +SKIP
>>> trainer.extend(report)                                          # doctest: +SKIP
>>> trainer.extend(extensions.LogReport())                          # doctest: +SKIP
>>> trainer.extend(extensions.PrintReport(
...     ['epoch', 'main/loss'] + report.keys))                      # doctest: +SKIP

After every training iteration it puts into the trainer's observation,
which ``LogReport`` averages over its interval:

- ``recompute/predicted_peak_MiB``: the plan's predicted peak (the budget's
  scope: the whole iteration by default);
- ``recompute/measured_peak_MiB``: the peak the runner measured, on the
  iterations it measures (the first few after planning on NumPy, every one
  on CuPy);
- ``recompute/budget_MiB``: the budget the plan was made for;
- ``recompute/plain_peak_MiB`` and ``recompute/saving_percent``: plain
  Chainer's peak for the same iteration (predicted by the replay, which
  counts what a first step does not hold yet; its forward and backward
  are measured, see the runner's first line) and the measured saving
  against it, on the iterations the runner measures;
- ``recompute/recomputed``: function forwards re-run during the backward;
- ``recompute/planned``: 1 when the iteration ran under a plan, 0 when it
  ran plainly (the first call of an input signature records the graph).

A key is left out of an iteration that has no value for it; ``LogReport``
then averages over the iterations that have.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from . import _chainer  # noqa: F401
from chainer.training import extension

from .runner import Recompute, runner_of

__all__ = ["RecomputeReport"]

_UNITS = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}


class RecomputeReport(extension.Extension):
    """Report the plan's predicted peak, the measured peak and the
    recompute count of each training iteration (see the module doc).

    Args:
        target: the Link :func:`~chainer_recompute.apply` was applied to
            (or a Link containing it); default: the target of the
            updater's ``main`` optimizer, searched for an applied Link.
        unit: unit of the byte figures, ``'B'``, ``'KiB'``, ``'MiB'`` or
            ``'GiB'`` (binary); it ends their key names.
        prefix: prefix of the keys.

    Raises:
        ValueError: an unknown unit.
        chainer_recompute.RecomputeError: at the first iteration, when no
            Link under ``target`` recomputes.
    """

    trigger = 1, "iteration"
    priority = extension.PRIORITY_WRITER  # before LogReport reads the observation
    name = "RecomputeReport"

    def __init__(self, target: Any = None, *, unit: str = "MiB",
                 prefix: str = "recompute/") -> None:
        if unit not in _UNITS:
            raise ValueError(f"unit must be one of {sorted(_UNITS)}, got {unit!r}")
        self.target = target
        self.unit = unit
        self.prefix = prefix
        self._runner: Optional[Recompute] = None

    @property
    def keys(self) -> List[str]:
        """The observation keys, for ``PrintReport``."""
        u, p = self.unit, self.prefix
        return [f"{p}predicted_peak_{u}", f"{p}measured_peak_{u}", f"{p}budget_{u}",
                f"{p}plain_peak_{u}", f"{p}saving_percent", f"{p}recomputed", f"{p}planned"]

    def _find_runner(self, trainer: Any) -> Recompute:
        from ..core.errors import RecomputeError
        targets = [self.target] if self.target is not None else [
            opt.target for opt in trainer.updater.get_all_optimizers().values()]
        for target in targets:
            if target is None:
                continue
            if isinstance(target, Recompute):
                return target
            for link in target.links():
                runner = runner_of(link)
                if runner is not None:
                    return runner
        raise RecomputeError("RecomputeReport found no Link that recomputes under the "
                             "updater's optimizers; apply chainer_recompute.apply(model, "
                             "budget=...) to the model first, or pass it as target=")

    def observe(self) -> Dict[str, float]:
        """The values of the runner's last training iteration."""
        runner = self._runner
        if runner is None:
            return {}
        stats = runner.last_stats
        if stats is None:
            return {}
        scale = float(_UNITS[self.unit])
        u, p = self.unit, self.prefix
        planned = stats.path == "planned"
        out: Dict[str, float] = {f"{p}planned": 1.0 if planned else 0.0}
        if not planned:
            return out
        predicted = stats.predicted_peak_bytes
        budget = stats.budget_bytes
        if predicted is None or budget is None:
            plans = runner.plans
            plan = list(plans.values())[-1] if plans else None  # most recently used
            if plan is not None:
                predicted = plan.predicted_peak_bytes if predicted is None else predicted
                budget = plan.budget_bytes if budget is None else budget
        if predicted is not None:
            out[f"{p}predicted_peak_{u}"] = predicted / scale
        if stats.measured_peak_bytes is not None:
            out[f"{p}measured_peak_{u}"] = stats.measured_peak_bytes / scale
            plain = stats.plain_peak_bytes
            if plain:
                out[f"{p}plain_peak_{u}"] = plain / scale
                out[f"{p}saving_percent"] = 100.0 * (1 - stats.measured_peak_bytes / plain)
        if budget is not None:
            out[f"{p}budget_{u}"] = budget / scale
        out[f"{p}recomputed"] = float(stats.recomputed_nodes)
        return out

    def __call__(self, trainer: Any) -> None:
        if self._runner is None:
            self._runner = self._find_runner(trainer)
        trainer.observation.update(self.observe())
