"""Answers before long work: what a run of the command needs in memory,
estimated from the graph recorded at a small batch and scaled (nothing
runs at the full batch for it), against what the device can give now; and
the message for an allocation that failed anyway.

The estimate is made twice, both times before the model is built at the
full batch: right after the recording, from plain backprop's replayed
peak and, for the plan, a figure no plan can go under (parameters, their
gradients and optimizer state, the inputs, and the largest single
temporary of one call); then after planning, from the plan's replayed
peak. Runs keep several models alive at once (plain Chainer beside the
plan with ``--vanilla``, a copy for ``--check-gradients``); their
parameters, gradients and optimizer state are added.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from ..core.units import format_bytes
from .args import UsageError


class MemoryRefusal(UsageError):
    """The run cannot fit in the memory the device has now (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """What a run needs, and what is available.

    Attributes:
        need_bytes: the estimate of the run's peak (host memory on NumPy,
            device memory on CuPy).
        available_bytes: what the device can give now (None: unknown).
        where: ``'host memory'`` or ``'GPU N memory'``.
        parts: ``(what, bytes)`` pairs that make up ``need_bytes``.
        fits_batch: about the largest batch whose estimate fits (None:
            unknown or not computed).
        stage: ``'recorded'`` (the plan's figure in it is a floor: made
            before planning) or ``'planned'`` (replayed peaks only).
        floor_parts: with ``'recorded'``, what the floor is made of.
    """

    need_bytes: int
    available_bytes: Optional[int]
    where: str
    parts: Tuple[Tuple[str, int], ...]
    fits_batch: Optional[int] = None
    stage: str = "planned"
    floor_parts: Tuple[Tuple[str, int], ...] = ()

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.need_bytes <= self.available_bytes


# ------------------------------------------------------------ availability
def available_memory(device: str) -> Tuple[Optional[int], str]:
    """What ``device`` (a Chainer device spec) can give now, and its name.

    On CuPy: the device's free memory plus what the memory pool caches,
    bounded by the pool's limit where one is set. Elsewhere: available host
    memory. ``(None, where)`` when it cannot be read."""
    if device.startswith("@cupy"):
        try:
            import cupy
            dev_id = int(device.split(":", 1)[1]) if ":" in device else 0
            with cupy.cuda.Device(dev_id):
                free, _total = cupy.cuda.runtime.memGetInfo()
                pool = cupy.get_default_memory_pool()
                avail = int(free) + int(pool.free_bytes())
                limit = int(pool.get_limit())
                if limit:
                    avail = min(avail, max(0, limit - int(pool.used_bytes())))
            return avail, f"GPU {dev_id} memory"
        except Exception:  # noqa: BLE001 - an unknown figure only skips the check
            return None, "GPU memory"
    from ..core.budget_spec import host_available_bytes
    return host_available_bytes(), "host memory"


# --------------------------------------------------------------- estimate
def plan_floor(graph: Any, workspace: Any = None) -> Tuple[int, List[Tuple[str, int]]]:
    """A figure no plan's iteration goes under: what stays the whole
    iteration (parameters, their gradients, optimizer state, persistent
    arrays, the inputs) plus the largest temporary of one call (the
    convolutions' column buffers; left out with ``workspace``, which bounds
    them). With its parts."""
    from ..core.replay import param_grad_bytes, state_constant_bytes
    constant = int(state_constant_bytes(graph))
    grads = int(param_grad_bytes(graph))
    parts = [("parameters, optimizer state and inputs", constant),
             ("parameter gradients", grads)]
    if workspace is None:
        temp, who = 0, ""
        for node in graph.nodes:
            for t in (node.forward_transient_bytes, node.backward_transient_bytes,
                      node.unrecorded_peak_bytes):
                if t and int(t) > temp:
                    temp, who = int(t), node.op
        if temp:
            parts.append((f"the largest temporary of one call ({who})", temp))
    return sum(b for _, b in parts), parts


def _runs_need(args: argparse.Namespace, graph: Any, plain_peak: int, plan_peak: int,
               plan_what: str) -> Tuple[int, List[Tuple[str, int]]]:
    """The peak of what the command runs: ``--iterations`` (the plan, with
    ``--vanilla`` plain Chainer beside it, interleaved: one model's
    iteration at a time, the other's parameters, gradients and optimizer
    state alive, and the model they were copied from) and
    ``--check-gradients`` (plain Chainer and a copy under the plan)."""
    sb = graph.state_bytes
    params = int(sb.get("params", graph.param_bytes))
    state = params + int(sb.get("param_grads", params)) + int(sb.get("optimizer_state", 0))
    options: List[Tuple[int, List[Tuple[str, int]]]] = []
    if args.iterations:
        if args.vanilla:
            a = [("plain Chainer's iteration", plain_peak), ("the plan's model beside it", state),
                 ("the model they are copied from", params)]
            b = [(plan_what, plan_peak), ("plain Chainer's model beside it", state),
                 ("the model they are copied from", params)]
            options += [(sum(v for _, v in a), a), (sum(v for _, v in b), b)]
        else:
            a = [(plan_what, plan_peak), ("the model it is copied from", params)]
            options.append((sum(v for _, v in a), a))
    if args.check_gradients:
        a = [("plain Chainer's iteration", plain_peak),
             ("the copy under the plan (parameters, gradients)", 2 * params)]
        options.append((sum(v for _, v in a), a))
    return max(options, key=lambda o: o[0]) if options else (0, [])


def needs_check(args: argparse.Namespace) -> bool:
    return bool(not args.graph and (args.iterations or args.check_gradients)
                and not getattr(args, "no_memory_check", False))


def estimate_recorded(args: argparse.Namespace, graph: Any, workspace: Any = None
                      ) -> MemoryEstimate:
    """Before planning: plain backprop's replayed peak, and the plan's floor."""
    from ..core.replay import replay
    plain_peak = int(replay(graph, None).peak_bytes)
    floor, floor_parts = plan_floor(graph, workspace)

    def need(g: Any) -> Tuple[int, List[Tuple[str, int]]]:
        p = int(replay(g, None).peak_bytes) if (args.vanilla or args.check_gradients) else 0
        return _runs_need(args, g, p, plan_floor(g, workspace)[0],
                          "the plan's iteration, at least")

    what = "the plan's iteration, at least"
    total, parts = _runs_need(args, graph, plain_peak, floor, what)
    on_floor = any(w == what for w, _ in parts)
    return _estimate(args, graph, total, parts, need, "recorded" if on_floor else "planned",
                     tuple(floor_parts) if on_floor else ())


def estimate_planned(args: argparse.Namespace, graph: Any, report: Dict[str, Any]
                     ) -> MemoryEstimate:
    """After planning: the plan's and plain backprop's replayed peaks."""
    plain_peak = int(report["plain"]["replayed_peak_bytes"])
    plan_peak = int(report["plan"]["replayed_peak_bytes"])
    total, parts = _runs_need(args, graph, plain_peak, plan_peak, "the plan's iteration")
    from ..core.replay import replay

    def need(g: Any) -> Tuple[int, List[Tuple[str, int]]]:
        # at another batch the plan's peak is taken in the same ratio to
        # plain backprop's as here (rough: for the suggested batch only)
        p = int(replay(g, None).peak_bytes)
        return _runs_need(args, g, p, p * plan_peak // max(1, plain_peak),
                          "the plan's iteration")

    return _estimate(args, graph, total, parts, need, "planned")


def _estimate(args: argparse.Namespace, graph: Any, total: int, parts: List[Tuple[str, int]],
              need: Any, stage: str, floor_parts: Tuple[Tuple[str, int], ...] = ()
              ) -> MemoryEstimate:
    avail, where = available_memory(args.device)
    fits_batch = None
    if avail is not None and total > avail and graph.batch_size and graph.batch_size > 1:
        fits_batch = _largest_fitting_batch(graph, need, avail)
    return MemoryEstimate(need_bytes=int(total), available_bytes=avail, where=where,
                          parts=tuple(parts), fits_batch=fits_batch, stage=stage,
                          floor_parts=floor_parts)


def _largest_fitting_batch(graph: Any, need: Any, avail: int) -> Optional[int]:
    """About the largest batch whose estimate fits: bisection on the graph
    scaled to each batch (0 when not even batch 1 fits)."""
    lo, hi = 0, int(graph.batch_size)
    for _ in range(40):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        try:
            fits = need(graph.scale_batch(mid))[0] <= avail
        except Exception:  # noqa: BLE001 - no suggestion rather than a wrong one
            return None
        lo, hi = (mid, hi) if fits else (lo, mid)
    if lo == 0:
        try:
            return 1 if need(graph.scale_batch(1))[0] <= avail else 0
        except Exception:  # noqa: BLE001
            return None
    return lo


def refuse_if_too_big(args: argparse.Namespace, estimate: MemoryEstimate, batch: int,
                      capture_batch: int) -> None:
    """Raise :class:`MemoryRefusal` when the estimate is over what is available."""
    if estimate.fits:
        return
    what = "runs" if args.iterations else "checks gradients"
    parts = ", ".join(f"{w} {format_bytes(b)}" for w, b in estimate.parts)
    if estimate.floor_parts:
        parts += " (that floor: " + ", ".join(f"{w} {format_bytes(b)}"
                                              for w, b in estimate.floor_parts) + ")"
    recorded = (f"recorded at batch {capture_batch} and scaled to {batch}"
                if capture_batch and capture_batch < batch else f"recorded at batch {batch}")
    tries = []
    if estimate.fits_batch and estimate.stage == "recorded":
        tries.append(f"--batch-size {estimate.fits_batch} at most (where that floor fits; the "
                     f"plan's own figure is checked after planning)")
    elif estimate.fits_batch:
        tries.append(f"--batch-size {estimate.fits_batch} or less (about what fits)")
    elif estimate.fits_batch == 0:
        tries.append("a smaller model (not even batch 1 fits)")
    else:
        tries.append("a smaller --batch-size")
    if args.vanilla:
        tries.append("dropping --vanilla (plain Chainer's iteration is the larger)")
    if args.budget != "least":
        tries.append("--budget least")
    tries.append("--dry-run (plans without running)")
    floor = " at least" if estimate.stage == "recorded" else ""
    raise MemoryRefusal(
        f"not enough memory: this command {what} at batch {batch}, which needs{floor} about "
        f"{format_bytes(estimate.need_bytes)} of {estimate.where} ({parts}; estimated from the "
        f"graph {recorded}), and {format_bytes(estimate.available_bytes or 0)} is available "
        f"now; try {', '.join(tries)}; --no-memory-check runs it anyway")


# ------------------------------------------------------------ out of memory
def out_of_memory_message(error: BaseException, args: Optional[argparse.Namespace],
                          estimate: Optional[MemoryEstimate]) -> str:
    """The one line for a ``MemoryError`` (CuPy's ``OutOfMemoryError`` is
    one): what was asked, what is available, what to try."""
    gpu = type(error).__module__.startswith("cupy") or (
        args is not None and str(getattr(args, "device", "")).startswith("@cupy"))
    asked = " ".join(str(error).split()) or "an allocation failed"
    device = getattr(args, "device", "@numpy") if args is not None else "@numpy"
    avail, where = available_memory(device)
    lines = [f"out of {'GPU' if gpu else 'host'} memory: {asked}"]
    if avail is not None:
        lines.append(f"{format_bytes(avail)} of {where} is available now")
    if estimate is not None:
        lines.append(f"the estimate before the run was about {format_bytes(estimate.need_bytes)}"
                     + (" (a floor)" if estimate.stage == "recorded" else ""))
    tries = ["a smaller --batch-size", "--budget least (the least feasible budget)"]
    if args is not None and getattr(args, "vanilla", False):
        tries.append("dropping --vanilla")
    tries.append("--dry-run (plans without running at the full batch)")
    return "; ".join(lines) + "; try " + ", ".join(tries)
