#!/usr/bin/env python
"""New batch sizes under ``apply()``, loop by loop: every whole step's
peak against its budget and its prediction, bit for bit against plain
Chainer.

Four small models of tests/test_first_step.py (an MLP returning its
logits, the loss made by the loop; an MLP that keeps ``self.loss``;
ConvBN; an LSTM with dropout), two optimizers (MomentumSGD, Adam), three
loops (``optimizer.update(model, x, t)``, or ``update(lossfun)`` for the
logits model; the loss held through the update, then dropped; the loss
held into the next forward), two batch patterns with new sizes (full,
full, 3/4, full, 3/4, 3/4; full, 1/2, full, 3/4, 1/2, 3/4), and two
budgets (``'least'``, and halfway from it to plain Chainer's largest
step). Each run trains plain Chainer and ``apply()`` from the same seeds
with the tests' harness: an outer tracemalloc meter started before the
model exists, each step's absolute peak (forward, backward, update, the
planner's memory at a call, a graph the loop holds), the batch copied in
the step as a loop's converter makes it.

Printed per run: whether every record (loss, gradients, parameters,
persistents, optimizer state, RNG states) is identical, then each step
whose peak is over its budget (steps after the first) or whose runner
measurement is above the prediction by more than 4 KiB, with the
runner's said messages counted. ``--json`` writes the rows.

    .venv/bin/python experiments/new_shapes.py                    # everything (6 min)
    .venv/bin/python experiments/new_shapes.py --models lstm --loops held
"""
import argparse
import itertools
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402

from harness import assert_same_records  # noqa: E402
from test_real_code_patterns import Said  # noqa: E402
from test_first_step import (LSTMNet, MLP, ConvBN, LogitsMLP, images, optimizer,  # noqa: E402
                             sequences, train, vectors)

MODELS = {
    "logits_mlp": (lambda: LogitsMLP((196, 512, 512, 10)), lambda n: vectors(n=n, batch=256),
                   True),
    "mlp": (lambda: MLP((196, 512, 512, 10)), lambda n: vectors(n=n, batch=256), False),
    "convbn": (ConvBN, lambda n: images(n=n, batch=32), False),
    "lstm": (lambda: LSTMNet(64, 128), lambda n: sequences(n=n, batch=32), False),
}
OPTIMIZERS = {"momentum": lambda: chainer.optimizers.MomentumSGD(0.01),
              "adam": lambda: chainer.optimizers.Adam()}
PATTERNS = {"A": (1, 1, .75, 1, .75, .75), "B": (1, .5, 1, .75, .5, .75)}
LOOPS = ("lossfun", "held", "next")


def _loss(model, logits, x, t):
    return F.softmax_cross_entropy(model(x), t) if logits else model(x, t)


def step_of(loop, logits):
    """One training step of ``loop`` (None: the harness's
    ``opt.update(model, x, t)``), returning the loss the loop holds."""
    if loop == "lossfun":
        if not logits:
            return None

        def step(model, opt, x, t):
            opt.update(lambda: _loss(model, True, x, t))
        return step
    held = []  # the previous step's loss, for "next"

    def step(model, opt, x, t):
        loss = _loss(model, logits, x, t)
        if loop == "next":
            held[:] = [loss]  # (replaced after this forward, as ``loss = ...`` is)
        model.cleargrads()
        loss.backward()
        opt.update()
        return loss
    return step


def run(model, opt, loop, pattern, budget):
    make, data, logits = MODELS[model]
    batches = [(x[:max(1, int(len(x) * f))], t[:max(1, int(len(x) * f))])
               for (x, t), f in zip(data(len(PATTERNS[pattern])), PATTERNS[pattern])]
    setup = optimizer(OPTIMIZERS[opt])
    plain = train(make, setup, batches, step=step_of(loop, logits))
    with Said() as said:
        ours = train(make, setup, batches, "least", step=step_of(loop, logits))
    if budget == "mid":
        mid = (ours.stats[0][1] + max(plain.peaks)) // 2
        with Said() as said:
            ours = train(make, setup, batches, mid, step=step_of(loop, logits))
    try:
        assert_same_records(plain, ours)
        identical = True
    except AssertionError:
        identical = False
    steps = []
    for k, (peak, (path, budget_bytes, predicted, measured)) in enumerate(
            zip(ours.peaks, ours.stats)):
        n = len(batches[k][0])
        steps.append({"step": k, "batch": n, "first_at_batch": all(
            len(batches[j][0]) != n for j in range(k)), "path": path, "peak": peak,
            "budget": budget_bytes, "predicted": predicted, "measured": measured})
    return {"model": model, "optimizer": opt, "loop": loop, "pattern": pattern,
            "budget": budget, "identical": identical, "steps": steps,
            "said": len(said.messages)}


def flags(s):
    out = []
    if s["step"] > 0 and s["budget"] is not None and s["peak"] > s["budget"]:
        out.append(f"over the budget by {s['peak'] - s['budget']:,} B")
    if s["measured"] is not None and s["predicted"] is not None and \
            s["measured"] > s["predicted"] + 4096:
        out.append(f"measured {s['measured'] - s['predicted']:,} B above the prediction")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS),
                    default=list(OPTIMIZERS))
    ap.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS))
    ap.add_argument("--patterns", nargs="+", choices=list(PATTERNS), default=list(PATTERNS))
    ap.add_argument("--budgets", nargs="+", choices=("least", "mid"), default=["least", "mid"])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = []
    for combo in itertools.product(args.models, args.optimizers, args.loops, args.patterns,
                                   args.budgets):
        try:
            row = run(*combo)
        except Exception as e:  # noqa: BLE001 - said and recorded (an infeasible budget)
            row = {"model": combo[0], "optimizer": combo[1], "loop": combo[2],
                   "pattern": combo[3], "budget": combo[4],
                   "error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(" ".join(combo), row["error"], flush=True)
            rows.append(row)
            continue
        rows.append(row)
        print(" ".join(combo), "identical" if row["identical"] else "NOT IDENTICAL",
              f"({row['said']} said)", flush=True)
        for s in row["steps"]:
            f = flags(s)
            if f:
                print(f"    step {s['step']} batch {s['batch']}"
                      f"{' (first at it)' if s['first_at_batch'] else ''}: peak {s['peak']:,} B,"
                      f" budget {s['budget']:,} B, predicted {s['predicted']:,} B: "
                      + "; ".join(f), flush=True)
    done = [r for r in rows if "error" not in r]
    print(f"{len(done)} runs, {sum(r['identical'] for r in done)} identical; "
          f"{len(rows) - len(done)} refused")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
