"""The first training step under the default options, measured.

Chainer's MNIST example's model (``L.Classifier(MLP(1000, 10))``, lazily
initialised ``L.Linear(None, ...)``) with its optimizer, ``Adam``, and one
added line, ``chainer_recompute.apply(model, budget=...)``, trained as
``StandardUpdater`` does (``optimizer.update(model, x, t)``) on random
batches of MNIST's shape. Three runs from the same seeds, in one process:
plain Chainer, ``apply(budget='least')`` and ``apply(budget=B)`` with B
halfway between the least figure and plain's measured peak. Each step's
whole peak is measured by the library's NumPy meter (tracemalloc), started
before the model is built; each step's wall time too, the first apart.
Prints a table per run, the runner's one line, and the ratios of the first
step's and of the later steps' time against plain Chainer's.

    PYTHONPATH=$PWD .venv/bin/python experiments/first_step.py [--batch 100] [--steps 6]
"""
from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

import chainer
import chainer.functions as F
import chainer.links as L

import chainer_recompute as cr
from chainer_recompute.runtime.memory import MemoryMeter


class MLP(chainer.Chain):
    """The MNIST example's network (examples/mnist/train_mnist.py)."""

    def __init__(self, n_units: int, n_out: int) -> None:
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(None, n_units)
            self.l2 = L.Linear(None, n_units)
            self.l3 = L.Linear(None, n_out)

    def forward(self, x: Any) -> Any:
        h1 = F.relu(self.l1(x))
        h2 = F.relu(self.l2(h1))
        return self.l3(h2)


def run(budget: Optional[Any], batch: int, steps: int) -> Dict[str, Any]:
    gc.collect()
    outer = MemoryMeter()
    outer.start()
    rows: List[Dict[str, Any]] = []
    try:
        np.random.seed(0)
        model = L.Classifier(MLP(1000, 10))
        if budget is not None:
            cr.apply(model, budget=budget)  # the one added line
        opt = chainer.optimizers.Adam()
        opt.setup(model)
        rs = np.random.RandomState(1)
        for _ in range(steps):
            x = rs.rand(batch, 784).astype(np.float32)
            t = rs.randint(0, 10, batch).astype(np.int32)
            t0 = time.perf_counter()
            with MemoryMeter() as m:
                opt.update(model, x, t)
            row = {"peak": m.result.absolute_peak_bytes, "s": time.perf_counter() - t0}
            runner = cr.runner_of(model)
            if runner is not None:
                st = runner.last_stats
                row.update(path=st.path, budget=st.budget_bytes,
                           predicted=st.predicted_peak_bytes)
            rows.append(row)
            del x, t
        del model, opt
    finally:
        outer.stop()
    return {"rows": rows}


def saving(rows: List[Dict[str, Any]], plain: List[Dict[str, Any]]) -> str:
    ratio = 1 - max(r["peak"] for r in rows) / max(r["peak"] for r in plain)
    return f"{100 * abs(ratio):.1f}% {'less' if ratio >= 0 else 'more'}"


def table(name: str, rows: List[Dict[str, Any]]) -> str:
    out = [f"{name}:", "  step  peak (B)     budget (B)   predicted    path      time (s)"]
    for k, r in enumerate(rows):
        out.append(f"  {k:>4}  {r['peak']:>11,}  {r.get('budget') or 0:>11,}  "
                   f"{r.get('predicted') or 0:>11,}  {r.get('path', 'plain'):<8}  {r['s']:.3f}")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    logging.getLogger("chainer_recompute").setLevel(logging.INFO)
    plain = run(None, args.batch, args.steps)["rows"]
    print(table("plain Chainer", plain))
    least = run("least", args.batch, args.steps)["rows"]
    print(table("apply(budget='least')", least))
    # (where the least figure is plain's own, parameters and Adam's state
    # setting the peak, the least figure)
    mid = max(least[0]["budget"], (least[0]["budget"] + max(r["peak"] for r in plain)) // 2)
    middle = run(mid, args.batch, args.steps)["rows"]
    print(table(f"apply(budget={mid})", middle))
    for name, rows in (("least", least), (f"budget {mid}", middle)):
        over = [k for k, r in enumerate(rows) if r.get("budget") and r["peak"] > r["budget"]]
        later = statistics.median(r["s"] for r in rows[1:]) / statistics.median(
            r["s"] for r in plain[1:])
        print(f"{name}: steps over their budget: {over or 'none'}; first step's time "
              f"{rows[0]['s'] / plain[0]['s']:.2f}x plain's first, later steps (median) "
              f"{later:.2f}x plain's; peak {max(r['peak'] for r in rows):,} B against plain's "
              f"{max(r['peak'] for r in plain):,} B ({saving(rows, plain)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
