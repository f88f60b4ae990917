"""Measuring training iterations: vanilla Chainer against recomputation,
in the same process, as ratios. Used by the CLI, the experiments and the
GPU check.

The authors' protocol (PAPER.md §8): several iterations, the first dropped
(it plans, and warms caches), the rest averaged; the peak memory of one
training iteration measured by the allocator (NumPy: tracemalloc's NumPy
domain; CuPy: the memory pool's used bytes).
"""
from __future__ import annotations

import copy
import gc
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from . import _chainer  # noqa: F401
import chainer
from chainer import backend

from .memory import MemoryMeter, model_state_bytes
from .runner import apply, runner_of
from .units import format_bytes

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What one configuration measured."""

    label: str
    peak_bytes: int  # peak of arrays allocated during an iteration (max over iterations)
    time_s: float  # mean seconds per iteration, first dropped
    times_s: List[float]
    loss: float
    first_iteration_s: float
    first_iteration_peak_bytes: int
    plan: Any = None
    extra: Dict[str, Any] = field(default_factory=dict)


def _sync(xp: Any) -> None:
    if xp is not None and xp.__name__ == "cupy":
        xp.cuda.Device().synchronize()


def run_iterations(link: chainer.Link, x: Any, t: Any, iterations: int, label: str,
                   optimizer: Optional[chainer.Optimizer] = None) -> RunResult:
    """Run ``iterations`` training iterations (forward, backward, update)
    of ``link(x, t)``; measure each one's peak memory and time."""
    xp = backend.get_array_module(x)
    if optimizer is None:
        optimizer = chainer.optimizers.MomentumSGD(lr=1e-4)
        optimizer.setup(link)
    times, peaks, loss_value = [], [], float("nan")
    for _ in range(iterations):
        link.cleargrads()
        gc.collect()
        _sync(xp)
        with MemoryMeter(xp) as meter:
            t0 = time.perf_counter()
            loss = link(x, t)
            loss.backward()
            optimizer.update()
            _sync(xp)
            elapsed = time.perf_counter() - t0
            loss_value = float(loss.array)
            del loss
        times.append(elapsed)
        peaks.append(meter.result.peak_bytes)
    steady = times[1:] if len(times) > 1 else times
    steady_peaks = peaks[1:] if len(peaks) > 1 else peaks
    return RunResult(label=label, peak_bytes=max(steady_peaks),
                     time_s=statistics.mean(steady), times_s=times, loss=loss_value,
                     first_iteration_s=times[0], first_iteration_peak_bytes=peaks[0])


def gradients_match(make_link: Any, x: Any, t: Any, budget: Any, **options: Any) -> bool:
    """One step of plain backprop and one with recomputation, from the same
    parameters and random state: are the loss and all gradients bit-for-bit
    equal?"""
    import numpy
    plain = make_link()
    plain(x, t)
    ours = copy.deepcopy(plain)
    apply(ours, budget=budget, **options)
    results = []
    for model in (plain, ours):
        numpy.random.seed(0)
        model.cleargrads()
        loss = model(x, t)
        loss.backward()
        results.append((loss.array, {n: p.grad for n, p in model.namedparams()}))
    xp = backend.get_array_module(x)
    (l1, g1), (l2, g2) = results
    return bool(xp.array_equal(l1, l2)) and all(
        bool(xp.array_equal(g1[k], g2[k])) for k in g1)


def compare(make_link: Any, x: Any, t: Any, configs: List[Dict[str, Any]],
            iterations: int = 5, vanilla: bool = True) -> List[RunResult]:
    """Vanilla and each recompute configuration (``dict(budget=...,
    solver=..., strategy=..., label=...)``) on fresh copies of the same
    model, in this process."""
    results = []
    base = make_link()
    base(x, t)  # initialise lazily shaped parameters
    if vanilla:
        link = copy.deepcopy(base)
        results.append(run_iterations(link, x, t, iterations, "vanilla"))
        del link
    for cfg in configs:
        cfg = dict(cfg)
        label = cfg.pop("label", f"{cfg.get('solver', 'approx')}-{cfg.get('strategy', 'tc')}")
        link = copy.deepcopy(base)
        apply(link, **cfg)
        r = run_iterations(link, x, t, iterations, label)
        r.plan = runner_of(link).plan_for(link, x, t)
        r.extra["stats"] = runner_of(link).last_stats
        results.append(r)
        del link
    state = model_state_bytes(base)
    for r in results:
        r.extra["state"] = state
    return results


def format_results(results: List[RunResult]) -> str:
    """A table with ratios against the first row (vanilla)."""
    base = results[0]
    lines = [f"{'run':<22} {'peak (iteration)':>18} {'ratio':>7} {'time/iter':>10} "
             f"{'ratio':>7} {'predicted peak':>15} {'1st iter':>9}"]
    for r in results:
        pred = "" if r.plan is None else format_bytes(r.plan.simulated_peak_bytes or 0)
        lines.append(
            f"{r.label:<22} {format_bytes(r.peak_bytes):>18} "
            f"{r.peak_bytes / base.peak_bytes:>7.2f} {r.time_s:>9.3f}s "
            f"{r.time_s / base.time_s:>7.2f} {pred:>15} {r.first_iteration_s:>8.2f}s")
    return "\n".join(lines)
