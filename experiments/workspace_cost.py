#!/usr/bin/env python
"""What chunked convolutions cost in time, and whether the memory model
predicts their peak (experiments/workspace_cost.md).

    PYTHONPATH=. .venv/bin/python experiments/workspace_cost.py [--net vgg19 --batch 2 --rounds 2]

Two parts, each paired (the variants alternate in the same script, so that
they share the machine's load):

1. **cells**: reproduce.py's protocol (a process per cell, tracemalloc,
   recorded first call, plan, then ``--measured`` iterations) for
   ``approx-tc`` (no workspace), ``approx-tc-ws`` (one-copy kernels,
   bit-identical) and ``approx-tc-wsc`` (chunked too, ``workspace_exact=
   False``), each at its own least total budget; ``rounds`` rounds in
   turn. Each cell's measured peak against its predicted peak and budget,
   its time per iteration.
2. **kernels**: in one process, the same model's plain forward + backward
   (no recomputation) under no bound, under the one-copy kernels
   (``bounded(1)``) and under the chunked bound that part 1's chunked cell
   chose (and the one-copy kernels with NumPy's column copy instead of the
   compiled one, when numba is installed), alternating, ``iterations`` times each: the kernels' own cost,
   with nothing else changed. The results of all three are compared bit
   for bit with the plain ones.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import reproduce as R  # noqa: E402

OUT = R.RESULTS / "workspace" / "cost"
METHODS = ["approx-tc", "approx-tc-ws", "approx-tc-wsc"]


def _stem(net: str, batch: int, small: bool) -> str:
    """The results' file names (a reduced model's apart from the full one's)."""
    return f"{net}{'_small' if small else ''}_b{batch}"


def cells(net: str, batch: int, small: bool, rounds: int, measured: int) -> dict:
    cfg = R.load_config(None)
    res: dict = {m: [] for m in METHODS}
    for r in range(rounds):
        for m in (METHODS if r % 2 == 0 else METHODS[::-1]):
            out = OUT / f"{_stem(net, batch, small)}_r{r}__{m}.json"
            c = R.run_cell(net, m, batch, cfg, small=small, out=out, save_graph=False,
                           measured=measured)
            if c.get("status") != "ok":
                print(f"{m} round {r}: {c.get('status')} {c.get('error', '')[-300:]}", flush=True)
                continue
            steady = [x for x in c["calls"][1:] if x.get("path") == "planned"]
            ts = [x["time_s"] for x in steady]
            res[m].append(c)
            print(f"round {r} {m}: measured {c['measured_peak_bytes'] / 1e6:.1f} MB, predicted "
                  f"{c['predicted_peak_bytes'] / 1e6:.1f} MB, budget "
                  f"{c['plan']['budget_bytes'] / 1e6:.1f} MB, workspace {c.get('workspace_bytes')}"
                  f" ({c.get('workspace_calls')} calls), s/iter "
                  f"{', '.join(f'{t:.2f}' for t in ts)} (load {c['load_end']})", flush=True)
    return res


def kernels(net: str, batch: int, small: bool, limit: int, iterations: int,
            device: object = "@numpy") -> dict:
    """Part 2 on ``device`` (on CuPy, Chainer's own convolutions are im2col
    + cuBLAS: CuPy 14 has no cuDNN; gpu_run.py's ``workspace`` section)."""
    import numpy
    import chainer
    from chainer_recompute.models import get_model
    from chainer_recompute.runtime import workspace as ws
    from chainer_recompute.runtime.device import device_of, seed_all

    cdev = chainer.get_device(device)
    cdev.use()
    xp = cdev.xp
    numpy.random.seed(0)
    spec = get_model(net, batch_size=batch, small=small)
    link = spec.link
    link.to_device(cdev)
    x, t = spec.make_inputs(batch, xp=xp, seed=0)
    dev = device_of([x])
    variants = {"plain": (None, True), "one-copy": (1, True), "chunked": (limit, False)}
    if xp is numpy and ws._compiled_columns() is not None:  # the column copy without numba
        variants["one-copy-numpy"] = (1, True)
    times: dict = {k: [] for k in variants}
    cpu: dict = {k: [] for k in variants}  # process CPU time (less load-sensitive)
    grads: dict = {}
    calls: dict = {}
    for i in range(iterations + 1):  # the first round warms up
        for k in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
            bound, exact = variants[k]
            link.cleargrads()
            seed_all(1)  # VGG19's dropout: the same masks in every run
            gc.collect()
            dev.synchronize()
            before = dict(ws.chunked_calls)
            compiled, ws._compiled_fill = ws._compiled_fill, \
                (False if k == "one-copy-numpy" else ws._compiled_fill)
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                with ws.bounded(bound, exact):
                    loss = link(x, t)
                loss.backward()
                dev.synchronize()
            finally:
                ws._compiled_fill = compiled
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            ran = {n: ws.chunked_calls[n] - before[n] for n in before}
            del loss
            if i:
                times[k].append(dt)
                cpu[k].append(dc)
            else:
                grads[k] = {n: p.grad.copy() for n, p in link.namedparams()}
                calls[k] = ran
                print(f"{k}: our kernels ran {ran}", flush=True)
    same = {k: all(bool(xp.array_equal(grads["plain"][n], g)) for n, g in grads[k].items())
            for k in grads}
    diff = {k: max(float(xp.abs(grads["plain"][n] - g).max()
                         / (float(xp.abs(grads["plain"][n]).max()) or 1))
                   for n, g in grads[k].items()) for k in grads}

    def versus(ts: dict) -> tuple:
        med = {k: statistics.median(v) for k, v in ts.items()}
        # paired: each round's time against plain's in the same round, the median
        paired = {k: statistics.median(a / b - 1 for a, b in zip(v, ts["plain"]))
                  for k, v in ts.items()}
        return med, {k: med[k] / med["plain"] - 1 for k in med}, paired

    med, vs, paired = versus(times)
    cmed, cvs, cpaired = versus(cpu)
    return {"limit": limit, "times_s": times, "median_s": med, "vs_plain": vs,
            "vs_plain_paired": paired, "cpu_s": cpu, "cpu_median_s": cmed,
            "cpu_vs_plain": cvs, "cpu_vs_plain_paired": cpaired,
            "bit_identical_grads": same, "max_rel_diff": diff, "calls": calls}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--net", default="vgg19")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--measured", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--skip-cells", action="store_true", help="part 2 only (from the saved cells)")
    ap.add_argument("--limit", help="part 2's chunked bound ('8M'; default: the chunked cell's)")
    ap.add_argument("--tag", default="", help="added to the summary file's name")
    args = ap.parse_args()
    stem = _stem(args.net, args.batch, args.small)
    summary_path = OUT / f"{stem}__summary.json"
    if args.skip_cells:
        res = {m: [R.read_json(p) for p in sorted(OUT.glob(f"{stem}_r*__{m}.json"))]
               for m in METHODS}
    else:
        res = cells(args.net, args.batch, args.small, args.rounds, args.measured)
    summary: dict = {"net": args.net, "batch": args.batch, "small": args.small, "cells": {}}
    for m, cs in res.items():
        cs = [c for c in cs if c and c.get("status") == "ok"]
        if not cs:
            continue
        ts = [x["time_s"] for c in cs for x in c["calls"][1:] if x.get("path") == "planned"]
        summary["cells"][m] = {
            "median_s": statistics.median(ts), "n": len(ts), "times_s": ts,
            "measured_peak_bytes": [c["measured_peak_bytes"] for c in cs],
            "predicted_peak_bytes": [c["predicted_peak_bytes"] for c in cs],
            "budget_bytes": [c["plan"]["budget_bytes"] for c in cs],
            "workspace_bytes": [c.get("workspace_bytes") for c in cs],
            "workspace_calls": [c.get("workspace_calls") for c in cs],
            "loads": [c["load_end"] for c in cs]}
    cc = summary["cells"]
    if "approx-tc" in cc:
        for m in cc:
            cc[m]["vs_no_workspace"] = cc[m]["median_s"] / cc["approx-tc"]["median_s"] - 1
    chunked = cc.get("approx-tc-wsc", {}).get("workspace_bytes", [None])
    limit = next((w for w in chunked if w), None)
    if args.limit:
        from chainer_recompute.core.units import parse_bytes
        limit = parse_bytes(args.limit)
        summary_path = OUT / f"{stem}__summary_L{args.limit}.json"
    if limit and args.iterations:
        summary["kernels"] = kernels(args.net, args.batch, args.small, limit, args.iterations)
    if args.tag:
        summary_path = summary_path.with_name(f"{summary_path.stem}_{args.tag}.json")
    R.write_json(summary_path, summary)
    print(json.dumps({k: v for k, v in summary.items()}, indent=1, default=str)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
