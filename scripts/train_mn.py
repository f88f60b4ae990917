#!/usr/bin/env python
"""ChainerMN data-parallel training with recomputation, on CPU with synthetic data.

    mpiexec -n 2 python scripts/train_mn.py --model resnet50 --small --batch-size 8
    mpiexec -n 2 python scripts/train_mn.py ... --compare --iterations 6
    mpiexec -n 2 python scripts/train_mn.py ... --largest-batch 400M

A usual ChainerMN script (``create_communicator``, ``scatter_dataset``,
``create_multi_node_optimizer``, ``create_multi_node_evaluator``, a
``Trainer``) with one added line::

    model = crmn.apply(model, comm, budget=args.budget)

Every rank measures each iteration's peak memory (NumPy arrays live in the
process: parameters, gradients, optimizer state, the batch, activations,
temporaries and the communicator's buffers; tracemalloc) and its time.

- default: train ``--epochs`` with recomputation and print each rank's
  figures (``--plain``: plain ChainerMN);
- ``--compare``: ``--iterations`` of plain ChainerMN, then the same with
  recomputation from the same seeds and data: per-rank peak and time side
  by side, and whether the parameters are bit-identical;
- ``--largest-batch BUDGET``: the largest per-rank batch whose iteration
  fits ``BUDGET`` without and with recomputation (predicted from a graph
  recorded at ``--capture-batch`` and scaled, by the total-budget search of
  ``chainer_recompute.core.budget``), then both batches run to measure
  their peaks against the budget.

``--json PATH`` writes the figures (rank 0).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import chainer_recompute as cr  # noqa: E402  (before chainer: NumPy 2 machines)
import chainer  # noqa: E402
import numpy  # noqa: E402
from chainer import training  # noqa: E402
from chainer.training import extensions  # noqa: E402

from chainer_recompute.core.units import format_bytes, parse_bytes  # noqa: E402
from chainer_recompute.runtime.memory import MemoryMeter  # noqa: E402

CLASSIFIERS = ("mlp", "resnet50", "resnet101", "resnet152", "vgg19", "densenet161")


class Reported(chainer.Chain):
    """The registry's loss link, reporting ``loss`` (for LogReport and the
    evaluator)."""

    def __init__(self, loss: chainer.Link) -> None:
        super().__init__()
        with self.init_scope():
            self.loss = loss

    def forward(self, x: Any, t: Any) -> chainer.Variable:
        loss = self.loss(x, t)
        chainer.report({"loss": loss}, self)
        return loss


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50", choices=CLASSIFIERS)
    p.add_argument("--small", action=argparse.BooleanOptionalAction, default=True,
                   help="the reduced network (ResNet at 64x64; default) or the full one")
    p.add_argument("--communicator", default="naive",
                   help="ChainerMN communicator: naive (CPU, default), pure_nccl (GPU), ...")
    p.add_argument("--gpu", action="store_true", help="one GPU per rank (intra_rank)")
    p.add_argument("--batch-size", type=int, default=8, help="per-rank batch size")
    p.add_argument("--budget", default="least",
                   help="per-rank memory budget: 'least' (default) or a size (300M, 2G)")
    p.add_argument("--solver", default="approx")
    p.add_argument("--strategy", default="tc")
    p.add_argument("--capture-batch", type=int, default=None,
                   help="plan before the first step from a capture at this batch")
    p.add_argument("--plain", action="store_true", help="no recomputation")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--n-train", type=int, default=64, help="synthetic training examples")
    p.add_argument("--n-test", type=int, default=32, help="synthetic test examples")
    p.add_argument("--compare", action="store_true",
                   help="plain ChainerMN, then with recomputation, --iterations each")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1,
                   help="--compare: alternate plain and recompute runs this many times")
    p.add_argument("--largest-batch", metavar="BUDGET", default=None,
                   help="the largest per-rank batch that fits BUDGET, without and with "
                        "recomputation")
    p.add_argument("--max-batch", type=int, default=256, help="search cap for --largest-batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here (rank 0)")
    return p.parse_args(argv)


# ----------------------------------------------------------------- parts
def make_model(args: argparse.Namespace) -> Any:
    from chainer_recompute.models import get_model
    numpy.random.seed(args.seed)  # the same initial weights everywhere
    return Reported(get_model(args.model, small=args.small).link)


def make_data(args: argparse.Namespace, comm: Any, n: int, seed: int) -> Any:
    import chainermn
    from chainer_recompute.models import get_model
    data = None
    if comm.rank == 0:
        spec = get_model(args.model, small=args.small)
        x, t = spec.make_inputs(n, seed=seed)
        data = chainer.datasets.TupleDataset(x, t)
    return chainermn.scatter_dataset(data, comm, shuffle=True, seed=seed)


def device_of(args: argparse.Namespace, comm: Any) -> Any:
    device = chainer.get_device(f"@cupy:{comm.intra_rank}" if args.gpu else "@numpy")
    device.use()
    return device


class Measured:
    """Wraps an updater's ``update_core``: each iteration's peak bytes
    (arrays live since the outer meter started, less ``base``: what was
    live before the run) and time, and the runner's path."""

    def __init__(self, updater: Any, model: Any, xp: Any, base: int) -> None:
        self.model, self.xp = model, xp
        self.peaks: List[int] = []
        self.times: List[float] = []
        self.paths: List[str] = []
        self.predicted: List[Optional[int]] = []
        inner = updater.update_core

        def update_core() -> None:
            gc.collect()
            meter = MemoryMeter(xp)
            meter.start()
            t0 = time.perf_counter()
            try:
                inner()
            finally:
                if xp is not numpy:
                    xp.cuda.Device().synchronize()
                self.times.append(time.perf_counter() - t0)
                self.peaks.append(meter.stop().absolute_peak_bytes - base)
            runner = cr.runner_of(model)
            st = runner.last_stats if runner is not None else None
            self.paths.append(st.path if st is not None else "plain")
            self.predicted.append(st.predicted_peak_bytes if st is not None else None)

        updater.update_core = update_core

    def summary(self, skip: int) -> Dict[str, Any]:
        peaks, times = self.peaks[skip:] or self.peaks, self.times[skip:] or self.times
        pred = [p for p in self.predicted[skip:] if p]
        return {"peak_bytes": max(peaks), "peak_all_bytes": max(self.peaks),
                "time_s": statistics.median(times), "time_min_s": min(times),
                "steady_times_s": list(times), "iterations": len(self.peaks),
                "first_peaks_bytes": self.peaks[:skip], "paths": self.paths,
                "predicted_peak_bytes": max(pred) if pred else None}


def digest(model: chainer.Link) -> str:
    h = hashlib.sha256()
    for path, p in sorted(model.namedparams()):
        h.update(path.encode())
        h.update(numpy.ascontiguousarray(chainer.backend.CpuDevice().send(p.array)).tobytes())
    return h.hexdigest()


def train(args: argparse.Namespace, comm: Any, *, applied: bool, batch: int,
          budget: Any, stop: Any, evaluate: bool, capture_batch: Optional[int] = None
          ) -> Dict[str, Any]:
    """One ChainerMN training run; this rank's figures."""
    import chainermn
    import chainer_recompute.runtime.distributed as crmn
    device = device_of(args, comm)
    train_set = make_data(args, comm, args.n_train, args.seed + 1)
    test_set = make_data(args, comm, args.n_test, args.seed + 2) if evaluate else None
    gc.collect()
    probe = MemoryMeter(device.xp)  # what is live before the run (the datasets): not counted
    probe.start()
    base = probe.stop().start_bytes
    model = make_model(args)
    if applied:
        crmn.apply(model, comm, budget=budget, solver=args.solver,  # <- the one added line
                   strategy=args.strategy, capture_batch=capture_batch)
    model.to_device(device)
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=args.lr), comm)
    optimizer.setup(model)
    train_iter = chainer.iterators.SerialIterator(train_set, batch)
    updater = training.updaters.StandardUpdater(train_iter, optimizer, device=device)
    measured = Measured(updater, model, device.xp, base)
    out = tempfile.mkdtemp(prefix="train_mn_")
    trainer = training.Trainer(updater, stop, out=out)
    if evaluate:
        test_iter = chainer.iterators.SerialIterator(test_set, batch, repeat=False,
                                                     shuffle=False)
        evaluator = extensions.Evaluator(test_iter, model, device=device)
        trainer.extend(chainermn.create_multi_node_evaluator(evaluator, comm))
        if comm.rank == 0:
            trainer.extend(extensions.LogReport(trigger=(1, "epoch")))
            trainer.extend(extensions.PrintReport(
                ["epoch", "iteration", "main/loss", "validation/main/loss", "elapsed_time"]))
    numpy.random.seed(args.seed + 1000 * (comm.rank + 1))
    trainer.run()
    runner = cr.runner_of(model)
    skip = (2 if capture_batch is None else 1) if applied else 1
    res = measured.summary(skip)
    res.update(rank=comm.rank, batch=batch, applied=applied, digest=digest(model))
    if runner is not None:
        res["plans"] = [{"predicted_peak_bytes": p.predicted_peak_bytes,
                         "budget_bytes": p.budget_bytes, "n_blocks": p.n_blocks,
                         "overhead_fraction": p.overhead_fraction}
                        for p in runner.plans.values()]
        c = runner.coordinator
        res.update(solves=c.solves, rounds=c.rounds, calls=c.calls,
                   sync_ms_per_call=1e3 * c.sync_s / max(c.calls, 1), round_s=c.round_s)
    del trainer, updater, optimizer, model, runner
    gc.collect()
    return res


def merge(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The figures of repeated runs of one configuration: the largest peak,
    the median and the least time of all their steady iterations."""
    out = dict(runs[-1])
    times = [t for r in runs for t in r["steady_times_s"]]
    out.update(peak_bytes=max(r["peak_bytes"] for r in runs),
               peak_all_bytes=max(r["peak_all_bytes"] for r in runs),
               time_s=statistics.median(times), time_min_s=min(times),
               steady_times_s=times, rounds=len(runs))
    return out


def largest_batches(args: argparse.Namespace, budget_bytes: int) -> Dict[str, Any]:
    """On one rank: the predicted largest per-rank batch that fits without
    and with recomputation (total budget: the replayed peak with the
    budget search's headroom)."""
    from chainer_recompute.core.budget import MARGIN, BudgetSearch
    from chainer_recompute.core.errors import InfeasibleBudgetError
    from chainer_recompute.models import get_model
    model = make_model(args)
    opt = chainer.optimizers.MomentumSGD(lr=args.lr)
    opt.setup(model)
    b0 = args.capture_batch or 4
    x, t = get_model(args.model, small=args.small).make_inputs(b0, seed=args.seed)
    with chainer.no_backprop_mode():
        model(x, t)  # lazily shaped parameters
    graph = cr.capture(model, x, t, backward=True, name=args.model)

    def need(b: int, plain: bool) -> int:
        # scaled as the runner scales a capture_batch graph
        search = BudgetSearch(graph.scale_batch(b), args.solver, args.strategy)
        if plain:
            return int(math.ceil(search.vanilla()[1] / (1 - MARGIN)))
        try:
            return search.least_budget()
        except InfeasibleBudgetError:
            return 1 << 62

    def largest(plain: bool) -> int:
        if need(1, plain) > budget_bytes:
            return 0
        lo, hi = 1, 2
        while hi <= args.max_batch and need(hi, plain) <= budget_bytes:
            lo, hi = hi, hi * 2
        if hi > args.max_batch:
            return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if need(mid, plain) <= budget_bytes:
                lo = mid
            else:
                hi = mid
        return lo

    t0 = time.perf_counter()
    bp, br = largest(True), largest(False)
    return {"plain": bp, "recompute": br, "capture_batch": b0,
            "plain_need_bytes": need(bp, True) if bp else None,
            "plain_need_next_bytes": need(bp + 1, True),
            "recompute_need_bytes": need(br, False) if br else None,
            "recompute_need_next_bytes": need(br + 1, False),
            "search_s": time.perf_counter() - t0}


# ------------------------------------------------------------------ main
def table(rows: List[List[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    import chainermn
    from chainer_recompute.core.errors import InfeasibleBudgetError
    from chainer_recompute.runtime.distributed import DistributedError
    args = parse_args(argv)
    comm = chainermn.create_communicator(args.communicator)
    report: Dict[str, Any] = {"args": vars(args), "size": comm.size}
    outer = MemoryMeter(numpy)  # counts what each run allocates (inner meters nest)
    outer.start()
    try:
        if args.largest_batch:
            budget_bytes = parse_bytes(args.largest_batch)
            found = largest_batches(args, budget_bytes) if comm.rank == 0 else None
            found = comm.bcast_obj(found)
            cb = args.capture_batch or 4
            runs = {}
            it = (args.iterations, "iteration")
            if found["plain"]:
                runs["plain"] = train(args, comm, applied=False, batch=found["plain"],
                                      budget=None, stop=it, evaluate=False)
            b = found["recompute"]
            while b > found["plain"]:
                try:  # planned before the first step (capture_batch): every step in budget
                    runs["recompute"] = train(args, comm, applied=True, batch=b,
                                              budget=budget_bytes, stop=it, evaluate=False,
                                              capture_batch=cb if cb < b else None)
                    break
                except InfeasibleBudgetError:  # raised on every rank: all try a smaller one
                    found.setdefault("refused_by_runner", []).append(b)
                    b -= 1
            if "recompute" in runs:
                runs["plain_at_recompute_batch"] = train(args, comm, applied=False, batch=b,
                                                         budget=None, stop=it, evaluate=False)
            report["largest"] = dict(found, budget_bytes=budget_bytes,
                                     runs={k: comm.gather_obj(v) for k, v in runs.items()})
        elif args.compare:
            it = (args.iterations, "iteration")
            plains, ourss = [], []
            for _ in range(args.rounds):  # alternated: load on a shared machine hits both
                plains.append(train(args, comm, applied=False, batch=args.batch_size,
                                    budget=None, stop=it, evaluate=False))
                ourss.append(train(args, comm, applied=True, batch=args.batch_size,
                                   budget=args.budget, stop=it, evaluate=False,
                                   capture_batch=args.capture_batch))
            plain, ours = merge(plains), merge(ourss)
            ours["identical_to_plain"] = len({r["digest"] for r in plains + ourss}) == 1
            report["compare"] = {"plain": comm.gather_obj(plain),
                                 "recompute": comm.gather_obj(ours)}
            report["ranks"] = report["compare"]["recompute"]
        else:
            res = train(args, comm, applied=not args.plain, batch=args.batch_size,
                        budget=args.budget, stop=(args.epochs, "epoch"), evaluate=True,
                        capture_batch=args.capture_batch)
            report["ranks"] = comm.gather_obj(res)
    except DistributedError as e:  # the same on every rank
        if comm.rank == 0:
            print(f"train_mn.py: {e}", file=sys.stderr)
        return 2
    finally:
        outer.stop()
    if comm.rank != 0:
        return 0
    if report.get("ranks"):
        report["identical_across_ranks"] = len({r["digest"] for r in report["ranks"]}) == 1
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


def render(report: Dict[str, Any]) -> str:
    a = report["args"]
    head = (f"{a['model']}{' (small)' if a['small'] else ''}, {report['size']} ranks, "
            f"communicator {a['communicator']}")
    out = [head]
    fb = format_bytes
    if "compare" in report:
        rows = [["rank", "per-rank batch", "plain peak", "recompute peak", "peak change",
                 "predicted", "plain s/it", "recompute s/it", "time", "bit-identical"]]
        for p, r in zip(report["compare"]["plain"], report["compare"]["recompute"]):
            rows.append([str(p["rank"]), str(p["batch"]), fb(p["peak_bytes"]),
                         fb(r["peak_bytes"]),
                         f"{100 * (r['peak_bytes'] / p['peak_bytes'] - 1):+.0f}%",
                         fb(r["predicted_peak_bytes"]),
                         f"{p['time_s']:.3f} (min {p['time_min_s']:.3f})",
                         f"{r['time_s']:.3f} (min {r['time_min_s']:.3f})",
                         f"x{r['time_s'] / p['time_s']:.2f} (min x"
                         f"{r['time_min_s'] / p['time_min_s']:.2f})",
                         str(r["identical_to_plain"])])
        out.append(table(rows))
    elif "largest" in report:
        lg = report["largest"]
        out.append(f"budget {fb(lg['budget_bytes'])} per rank: largest per-rank batch "
                   f"predicted {lg['plain']} plain, {lg['recompute']} with recomputation "
                   f"(from a capture at batch {lg['capture_batch']}, scaled)"
                   + (f"; refused by the runner's own planning: {lg['refused_by_runner']}"
                      if lg.get("refused_by_runner") else ""))
        rows = [["run", "per-rank batch", "rank", "peak (steady)", "fits", "peak (every "
                 "iteration)", "fits", "s/it"]]
        for name, ranks in lg["runs"].items():
            for r in ranks:
                rows.append([name, str(r["batch"]), str(r["rank"]), fb(r["peak_bytes"]),
                             str(r["peak_bytes"] <= lg["budget_bytes"]),
                             fb(r["peak_all_bytes"]),
                             str(r["peak_all_bytes"] <= lg["budget_bytes"]),
                             f"{r['time_s']:.3f}"])
        out.append(table(rows))
    else:
        rows = [["rank", "per-rank batch", "peak", "predicted", "s/it", "paths"]]
        for r in report["ranks"]:
            rows.append([str(r["rank"]), str(r["batch"]), fb(r["peak_bytes"]),
                         fb(r["predicted_peak_bytes"]), f"{r['time_s']:.3f}",
                         ",".join(sorted(set(r["paths"])))])
        out.append(table(rows))
    if "identical_across_ranks" in report:
        out.append(f"parameters identical across ranks: {report['identical_across_ranks']}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
