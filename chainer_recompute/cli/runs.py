"""The command's runs: training iterations with the plan (and plain Chainer
beside it), and the comparison of gradients with plain backprop."""
from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any, Dict, Iterator, List

from .args import _workspace
from .planning import _plan_dict


def _check_gradients(args: argparse.Namespace, report: Dict[str, Any]) -> bool:
    from ..bench import gradients_match, network
    batch = report["source"]["batch_size"]
    make, x, t, _ = _network_for_runs(args, batch, network)
    with _errors_once():
        return gradients_match(make, x, t, **_apply_options(args, report))


def _network_for_runs(args: argparse.Namespace, batch: int, network: Any) -> Any:
    cb = args.capture_batch if args.capture_batch and args.capture_batch < batch else None
    return network(args.model, batch, small=args.small, device=args.device,
                   cost_model=args.cost, seed=args.seed, capture_batch=cb)


def _apply_options(args: argparse.Namespace, report: Dict[str, Any]) -> Dict[str, Any]:
    """apply()'s options for the runs: it plans from the first training
    call, which it records at the real batch (the first iteration is left
    out of the averages)."""
    budget = report["budget"]["text"]
    from ..runtime.runner import Tuning
    return dict(budget=budget, solver=args.solver, strategy=args.strategy,
                budget_scope=report["budget"]["scope"], verbose=args.verbose,
                workspace=_workspace(args), keep=list(getattr(args, "keep", None) or ()) or None,
                tuning=Tuning(cost=args.cost, check_iterations=max(3, args.iterations)))


class _NoErrors(logging.Filter):
    """Drops the runner's error lines: the command prints the error itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


@contextlib.contextmanager
def _errors_once() -> Iterator[None]:
    report = logging.getLogger("chainer_recompute.report")
    f = _NoErrors()
    report.addFilter(f)
    try:
        yield
    finally:
        report.removeFilter(f)


def _run_iterations(args: argparse.Namespace, report: Dict[str, Any],
                    progress: Any) -> List[Dict[str, Any]]:
    from ..bench import compare
    batch = report["source"]["batch_size"]
    make = x = t = None
    from ..bench import network
    with progress.step(f"building {args.model} at batch {batch}"):
        make, x, t, _ = _network_for_runs(args, batch, network)
    label = f"{args.solver}-{args.strategy}"
    with progress.step(f"running {args.iterations} iterations"
                       + (" of plain Chainer and the plan" if args.vanilla else ""),
                       total=args.iterations * (2 if args.vanilla else 1),
                       unit="iterations") as step, _errors_once():
        results = compare(make, x, t, [dict(_apply_options(args, report), label=label)],
                          iterations=args.iterations, vanilla=args.vanilla,
                          on_step=lambda: step.update(), as_updater=True)
    runs = []
    for r in results:
        stats = r.extra.get("stats")
        run: Dict[str, Any] = {
            "label": r.label, "peak_bytes": r.peak_bytes,
            "measured_peak_bytes": r.total_peak_bytes, "time_s": r.time_s,
            "times_s": r.times_s, "first_iteration_s": r.first_iteration_s,
            "recomputed_nodes": getattr(stats, "recomputed_nodes", None), "plan": None}
        if r.plan is not None:  # the plan the runner made from its own recording
            run["plan"] = _plan_dict(r.plan)
        runs.append(run)
    return runs
