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

from .runtime import _chainer  # noqa: F401
import chainer
from chainer import backend

from .runtime.memory import MemoryMeter, model_state_bytes
from .runtime.runner import apply, runner_of
from .core.units import format_bytes

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


def network(name: str, batch_size: int, *, small: bool = False, device: Any = "@numpy",
            cost_model: str = "measured", seed: int = 0, capture_batch: Optional[int] = None):
    """A registry network ready for a comparison: ``(make, x, t, graph)``.

    ``make()`` builds the same initial model every time (seeded), on
    ``device``; ``x, t`` are one batch of inputs; ``graph`` is captured from
    one such model (lazily shaped parameters initialised first), at
    ``capture_batch`` and scaled linearly to ``batch_size`` when given.
    """
    import numpy

    from .runtime.capture import capture
    from .models import get_model
    device = chainer.get_device(device)
    device.use()

    def make() -> chainer.Link:
        numpy.random.seed(seed)
        link = get_model(name, batch_size=batch_size, small=small).link
        link.to_device(device)
        return link

    spec = get_model(name, batch_size=batch_size, small=small)
    x, t = spec.make_inputs(batch_size, xp=device.xp, seed=seed)
    link = make()
    link(x, t)
    if capture_batch is None or capture_batch >= batch_size:
        return make, x, t, capture(link, x, t, cost_model=cost_model, name=name)
    xs, ts = spec.make_inputs(capture_batch, xp=device.xp, seed=seed)
    graph = capture(link, xs, ts, cost_model=cost_model, name=name).scale_batch(batch_size)
    return make, x, t, graph


def _sync(xp: Any) -> None:
    if xp is not None and xp.__name__ == "cupy":
        xp.cuda.Device().synchronize()


class _Runner:
    """One configuration under measurement: a model and its optimizer."""

    def __init__(self, link: chainer.Link, label: str) -> None:
        self.link, self.label = link, label
        self.optimizer = chainer.optimizers.MomentumSGD(lr=1e-4)
        self.optimizer.setup(link)
        self.times: List[float] = []
        self.peaks: List[int] = []
        self.loss = float("nan")

    def step(self, x: Any, t: Any) -> None:
        xp = backend.get_array_module(x)
        self.link.cleargrads()
        gc.collect()
        _sync(xp)
        with MemoryMeter(xp) as meter:
            t0 = time.perf_counter()
            loss = self.link(x, t)
            loss.backward()
            self.optimizer.update()
            _sync(xp)
            elapsed = time.perf_counter() - t0
            self.loss = float(loss.array)
            del loss
        self.times.append(elapsed)
        self.peaks.append(meter.result.peak_bytes)

    def result(self) -> RunResult:
        steady = self.times[1:] if len(self.times) > 1 else self.times
        steady_peaks = self.peaks[1:] if len(self.peaks) > 1 else self.peaks
        return RunResult(label=self.label, peak_bytes=max(steady_peaks),
                         time_s=statistics.mean(steady), times_s=list(self.times),
                         loss=self.loss, first_iteration_s=self.times[0],
                         first_iteration_peak_bytes=self.peaks[0])


def gradients_match(make_link: Any, x: Any, t: Any, budget: Any, **options: Any) -> bool:
    """Two steps of plain backprop and two with recomputation (the first
    call records the graph, the second runs the plan), from the same
    parameters and random state: are the losses and all gradients of both
    steps bit-for-bit equal, and did the second step follow its plan?"""
    import numpy
    plain = make_link()
    plain(x, t)
    ours = copy.deepcopy(plain)
    apply(ours, budget=budget, **options)
    xp = backend.get_array_module(x)
    for step in range(2):
        results = []
        for model in (plain, ours):
            numpy.random.seed(step)
            model.cleargrads()
            loss = model(x, t)
            loss.backward()
            results.append((loss.array, {n: p.grad for n, p in model.namedparams()}))
        (l1, g1), (l2, g2) = results
        if not (bool(xp.array_equal(l1, l2)) and all(
                bool(xp.array_equal(g1[k], g2[k])) for k in g1)):
            return False
    stats = runner_of(ours).last_stats
    return stats is not None and stats.path == "planned"


def compare(make_link: Any, x: Any, t: Any, configs: List[Dict[str, Any]],
            iterations: int = 5, vanilla: bool = True) -> List[RunResult]:
    """Vanilla and each recompute configuration (``dict(budget=...,
    solver=..., strategy=..., label=...)``) on copies of the same model, in
    this process. Iterations are interleaved (vanilla, then each
    configuration, round after round) so that a change in the machine's
    load affects all alike."""
    base = make_link()
    base(x, t)  # initialise lazily shaped parameters
    runners = []
    if vanilla:
        runners.append(_Runner(copy.deepcopy(base), "vanilla"))
    for cfg in configs:
        cfg = dict(cfg)
        label = cfg.pop("label", f"{cfg.get('solver', 'approx')}-{cfg.get('strategy', 'tc')}")
        runners.append(_Runner(apply(copy.deepcopy(base), **cfg), label))
    for _ in range(iterations):
        for r in runners:
            r.step(x, t)
    state = model_state_bytes(base)
    results = []
    for r in runners:
        res = r.result()
        runner = runner_of(r.link)
        if runner is not None:
            res.plan = runner.plan_for(r.link, x, t)
            res.extra["stats"] = runner.last_stats
        res.extra["state"] = state
        results.append(res)
    return results


def format_results(results: List[RunResult]) -> str:
    """A table with ratios against the first row (vanilla). The prediction
    is the plan's simulated activation peak plus the parameter gradients,
    which every iteration allocates."""
    base = results[0]
    lines = [f"{'run':<22} {'peak (iteration)':>18} {'ratio':>7} {'time/iter':>10} "
             f"{'ratio':>7} {'predicted peak':>15} {'1st iter':>9}"]
    for r in results:
        grads = r.extra.get("state", {}).get("params", 0)
        pred = ("" if r.plan is None
                else format_bytes((r.plan.simulated_peak_bytes or 0) + grads))
        lines.append(
            f"{r.label:<22} {format_bytes(r.peak_bytes):>18} "
            f"{r.peak_bytes / base.peak_bytes:>7.2f} {r.time_s:>9.3f}s "
            f"{r.time_s / base.time_s:>7.2f} {pred:>15} {r.first_iteration_s:>8.2f}s")
    return "\n".join(lines)
