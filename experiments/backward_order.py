"""Another backward order, bit-identical to Chainer's: how much lower the
PTB LSTM's floor and least figures go (issue 35's LSTM target).

Chainer's backward runs its functions by rank, so on the PTB LSTM the
functions that do not depend on the recurrent state (the embedding, the
first layer's input projection) run after every step's backward, and
their output gradients wait (experiments/nested.md, "A recurrent chain").
A gradient's value depends only on the order in which the backward passes
of its array's readers add into it, so any order that runs each function
after the readers of its outputs, and the readers of each array in
Chainer's relative order, gives the same bits. This script

1. makes plain Chainer (no executor) run the latest-forward-first such
   order (:func:`chainer_recompute.core.backward_order.reorder`; ranks
   rewritten after the forward: Chainer pops the highest rank first) and
   compares the gradients with plain Chainer's, bit for bit, on the PTB
   LSTM;
2. replays the recorded graph of ``apply()`` in both orders: physical
   floor, plain peak, single-level least, the nested least in Chainer's
   order, and the least below the single-level least that ``apply()``
   plans (both orders), on the LSTM and on the committed graphs (recorded
   before ``step.closed_backward`` existed: planned in the other order
   here for the figures only).

    .venv/bin/python experiments/backward_order.py [--units 256 --batch 32 --vocab 1000]
    .venv/bin/python experiments/backward_order.py --graphs resnet50_b32 pspnet_b1

``apply()`` uses the other order below the single-level least only
(docs/algorithm.md §10).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import chainer  # noqa: E402

import chainer_recompute as cr  # noqa: E402
import bptt  # noqa: E402
from chainer_recompute.core.backward_order import reorder, reordered  # noqa: E402
from chainer_recompute.core.budget import BudgetSearch  # noqa: E402
from chainer_recompute.core.graph import Graph  # noqa: E402
from chainer_recompute.core.io import load_graph  # noqa: E402
from chainer_recompute.core.replay import physical_floor  # noqa: E402


def graph_reordered(g: Graph) -> Graph:
    """``g`` in :func:`reorder`'s order (whatever ``step.closed_backward``
    says: for the figures)."""
    return reordered(g.with_step(closed_backward=True)) or g


class _Functions(chainer.FunctionHook):
    name = "backward_order-functions"

    def __init__(self) -> None:
        self.forward: List[Any] = []
        self.backward: List[Any] = []
        self.n_forward = 0  # (the functions a backward applies come after)

    def forward_postprocess(self, function: Any, in_data: Any) -> None:
        self.forward.append(function)

    def backward_preprocess(self, function: Any, in_data: Any, out_grad: Any) -> None:
        self.backward.append(function)


def chainer_check(args: argparse.Namespace) -> Dict[str, Any]:
    """Plain Chainer on the unroll, then again with :func:`reorder`'s order
    imposed through the ranks: the order it ran and whether every
    parameter's gradient is the same."""
    data = np.random.RandomState(1).randint(0, args.vocab, (args.t + 1, args.batch)) \
        .astype(np.int32)
    model, _ = bptt.make(args)

    def run(new: Any = None) -> Tuple[_Functions, Dict[str, np.ndarray]]:
        model.predictor.reset_state()
        model.cleargrads()
        np.random.seed(7)  # (the same dropout masks in both runs)
        hook = _Functions()
        with hook:
            loss = bptt.plain_fn(model)(data[:-1], data[1:])
            if new is not None:
                top = max(f.rank for f in hook.forward) + 1
                for k, v in enumerate(new):
                    hook.forward[v].rank = top + len(new) - k
            hook.n_forward = len(hook.forward)
            loss.backward()
        return hook, {n: p.grad.copy() for n, p in model.namedparams()}

    first, grads = run()  # (its graph kept: the hook holds its functions)
    where = {id(f): k for k, f in enumerate(first.forward)}
    made = {id(ref()): k for k, f in enumerate(first.forward) for ref in f.outputs or ()
            if ref() is not None}
    old = [where[id(f)] for f in first.backward]
    new = reorder(old, lambda v: [id(x) for x in first.forward[v].inputs], made.get)
    second, grads2 = run(new)
    where2 = {id(f): k for k, f in enumerate(second.forward)}
    return dict(functions=first.n_forward, backward=len(old),
                moved=sum(a != b for a, b in zip(old, new)),
                ran_as_imposed=[where2[id(f)] for f in second.backward] == new,
                identical=all(np.array_equal(grads[k], grads2[k]) for k in grads))


def figures(g: Graph, below: bool = True) -> Dict[str, Any]:
    """Floor, plain and single-level least of ``g``; with ``below``, its
    nested least in its own order and the least below the single-level
    least that ``apply()`` plans (in either order: ``closed_backward`` set
    here)."""
    search = BudgetSearch(g.with_step(closed_backward=True))
    out = dict(floor=physical_floor(g).peak_bytes, plain=search.vanilla()[1],
               single=search.least()[1])
    if below:
        chainers = search.nested_search().least()
        got = search.nested_least()
        out.update(nested=None if chainers is None else chainers[1],
                   below=None if got is None else got[1],
                   order="other" if got is not None and got[0].backward_order else "own")
    return out


def lstm_graph(args: argparse.Namespace) -> Graph:
    """The unroll's graph as ``apply()`` records and plans it."""
    data = np.random.RandomState(1).randint(0, args.vocab, (args.t + 1, args.batch)) \
        .astype(np.int32)
    model, opt = bptt.make(args)
    unrolled = bptt.Unrolled(model)
    cr.apply(unrolled, budget="least", verbose=False)
    for _ in range(3):  # records, plans, then (at the third call) replays the plan
        # without the previous call's graph, which L.Classifier lets go
        bptt.iterate(lambda a, b: unrolled(a, b), model, opt, data)
    return cr.runner_of(unrolled).signatures()[0].structures[0].graph


def row(name: str, g: Graph) -> None:
    t0 = time.perf_counter()
    a, b = figures(g), figures(graph_reordered(g), below=False)
    pair = " | ".join(f"{a[k]:,} / {b[k]:,}" for k in ("floor", "plain", "single"))
    nested = "none" if a["nested"] is None else f"{a['nested']:,}"
    below = "none" if a["below"] is None else f"{a['below']:,} ({a['order']})"
    print(f"| {name} | {pair} | {nested} | {below} | {time.perf_counter() - t0:.0f} |",
          flush=True)


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, default=30)
    ap.add_argument("--units", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=100)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--graphs", nargs="*", default=None,
                    help="committed graphs (experiments/results/graphs) instead of the LSTM")
    args = ap.parse_args(argv)
    print("| graph | floor, Chainer's order / other | plain, the same | single-level least, "
          "the same | nested least, Chainer's order | least below the single-level least "
          "(its order) | s |")
    print("|---|---|---|---|---|---|---|")
    if args.graphs:
        for name in args.graphs:
            row(name, load_graph(HERE / "results" / "graphs" / f"{name}.json"))
        return 0
    print("Chainer runs the new order:", chainer_check(args), file=sys.stderr)
    row(f"LSTM t={args.t}, {args.units} units, batch {args.batch}", lstm_graph(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
