"""Gruslys et al.'s BPTT policies on a real Chainer LSTM language model:
measured peak memory and time per iteration against plain BPTT, for
sequence lengths and budgets from the least feasible to plain's, and the
same unrolled graph through the general DP (``cr.apply``).

    .venv/bin/python experiments/bptt.py --lengths 100 300 1000 3000 \
        --json experiments/bptt.json --png experiments/bptt.png

Writes a Markdown table to stdout. The model is Chainer's PTB example
(embedding, two L.LSTM with dropout, linear, softmax cross entropy) at a
small size, so that the whole run takes minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

import chainer_recompute as cr  # noqa: F401  (NumPy compatibility first)
import chainer
import chainer.functions as F
import chainer.links as L

from chainer_recompute.core.solvers import chain as chain_solver
from chainer_recompute.runtime import bptt
from chainer_recompute.runtime.memory import MemoryMeter

POLICIES = ("hsm", "ism", "msm", "revolve")


class RNNForLM(chainer.Chain):
    def __init__(self, n_vocab: int, n_units: int) -> None:
        super().__init__()
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, n_units)
            self.l1 = L.LSTM(n_units, n_units)
            self.l2 = L.LSTM(n_units, n_units)
            self.l3 = L.Linear(n_units, n_vocab)

    def reset_state(self) -> None:
        self.l1.reset_state()
        self.l2.reset_state()

    def forward(self, x: Any) -> Any:
        h0 = self.embed(x)
        h1 = self.l1(F.dropout(h0))
        h2 = self.l2(F.dropout(h1))
        return self.l3(F.dropout(h2))


class Unrolled(chainer.Chain):
    """The whole t-step unroll as one Link, for cr.apply()."""

    def __init__(self, model: chainer.Link) -> None:
        super().__init__()
        with self.init_scope():
            self.model = model

    def forward(self, xs: Any, ts: Any) -> Any:
        self.model.predictor.reset_state()
        loss = 0
        for k in range(xs.shape[0]):
            loss += self.model(xs[k], ts[k])
        return loss


def make(args: argparse.Namespace) -> Any:
    np.random.seed(0)
    model = L.Classifier(RNNForLM(args.vocab, args.units))
    opt = chainer.optimizers.SGD(lr=0.1)
    opt.setup(model)
    return model, opt


def iterate(fn: Any, model: Any, opt: Any, xs: Any, ts: Any) -> Dict[str, float]:
    model.predictor.reset_state()
    model.cleargrads()
    start = time.perf_counter()
    with MemoryMeter() as meter:
        loss = fn(xs, ts)
        model.cleargrads()
        loss.backward()
        loss.unchain_backward()
        opt.update()
    return {"time_s": time.perf_counter() - start, "peak_bytes": meter.result.peak_bytes}


def plain_fn(model: Any) -> Any:
    def run(xs: Any, ts: Any) -> Any:
        loss = 0
        for x, t in zip(xs, ts):
            loss += model(x, t)
        return loss
    return run


def measure(fn: Any, model: Any, opt: Any, xs: Any, ts: Any, repeat: int) -> Dict[str, float]:
    iterate(fn, model, opt, xs, ts)  # first call: measures the cell / plans
    runs = [iterate(fn, model, opt, xs, ts) for _ in range(repeat)]
    return {"time_s": float(np.median([r["time_s"] for r in runs])),
            "peak_bytes": int(max(r["peak_bytes"] for r in runs))}


def run_length(t: int, args: argparse.Namespace) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    data = np.random.RandomState(1).randint(0, args.vocab, (t + 1, args.batch)).astype(np.int32)
    xs, ts = data[:-1], data[1:]
    model, opt = make(args)
    plain = measure(plain_fn(model), model, opt, xs, ts, args.repeat)
    rows.append(dict(t=t, method="plain", budget_bytes=None, slots=None, forward_steps=t,
                     predicted_bytes=None, **plain))
    print(f"t={t} plain {plain}", file=sys.stderr)
    # the cell's sizes and the least feasible budget (HSM, one slot)
    probe = bptt.ChainRecompute(model, policy="hsm", slots=1)
    iterate(probe, model, opt, xs, ts)
    least = probe.last_stats.predicted_peak_bytes
    top = plain["peak_bytes"]
    fractions = args.fractions
    budgets = sorted({int(least + f * (top - least)) for f in fractions})
    sizes = probe.last_stats.sizes
    rows.append(dict(t=t, method="sizes", hidden_slot=sizes.hidden_slot,
                     internal_slot=sizes.internal_slot, alpha=sizes.alpha,
                     least_bytes=least))
    for budget in budgets:
        for policy in POLICIES:
            alpha = sizes.alpha if policy in ("ism", "msm") else 1
            m_hint = budget // sizes.hidden_slot
            if policy == "msm" and t * min(m_hint, alpha * t) > args.msm_cells:
                rows.append(dict(t=t, method=policy, budget_bytes=budget,
                                 skipped=f"MSM table of {t}x{min(m_hint, alpha * t)} cells "
                                         f"over --msm-cells"))
                continue
            runner = bptt.ChainRecompute(model, policy=policy, budget=budget)
            try:
                res = measure(runner, model, opt, xs, ts, args.repeat)
            except cr.RecomputeError as e:
                rows.append(dict(t=t, method=policy, budget_bytes=budget, skipped=str(e)[:120]))
                continue
            st = runner.last_stats
            rows.append(dict(t=t, method=policy, budget_bytes=budget, slots=st.slots,
                             forward_steps=st.forward_steps,
                             predicted_bytes=st.predicted_peak_bytes,
                             table_time_s=st.table_time_s, **res))
            print(f"t={t} {policy} budget={budget} -> {rows[-1]}", file=sys.stderr)
        if t <= args.graph_dp_max_t:
            for solver in ("approx", "exact"):
                rows.append(graph_dp(t, budget, solver, args, xs, ts))
    return rows


def graph_dp(t: int, budget: int, solver: str, args: argparse.Namespace, xs: Any,
             ts: Any) -> Dict[str, Any]:
    model, opt = make(args)
    unrolled = Unrolled(model)
    row: Dict[str, Any] = dict(t=t, method=f"graph-{solver}", budget_bytes=budget)
    try:
        start = time.perf_counter()
        cr.apply(unrolled, budget=budget, solver=solver)
        res = measure(lambda a, b: unrolled(a, b), model, opt, xs, ts, args.repeat)
        row.update(res)
        row["plan_and_run_s"] = time.perf_counter() - start
        stats = cr.runner_of(unrolled).last_stats
        row["last_stats"] = repr(stats)[:300]
    except Exception as e:  # report precisely, as the brief asks
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"t={t} graph-{solver} budget={budget} -> {row}", file=sys.stderr)
    return row


def table(rows: List[Dict[str, Any]]) -> str:
    plain = {r["t"]: r for r in rows if r["method"] == "plain"}
    out = ["| t | method | budget | slots | forward steps | predicted peak | measured peak | "
           "memory vs plain | time / iter | time vs plain |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["method"] == "sizes":
            continue
        p = plain[r["t"]]
        if "skipped" in r or "error" in r:
            why = r.get("skipped") or r.get("error")
            out.append(f"| {r['t']} | {r['method']} | {mb(r.get('budget_bytes'))} | | | | | | | "
                       f"{why} |")
            continue
        out.append(
            f"| {r['t']} | {r['method']} | {mb(r.get('budget_bytes'))} | {r.get('slots') or ''} | "
            f"{r.get('forward_steps') or ''} | {mb(r.get('predicted_bytes'))} | "
            f"{mb(r['peak_bytes'])} | {100 * (r['peak_bytes'] / p['peak_bytes'] - 1):+.0f}% | "
            f"{r['time_s']:.2f} s | {100 * (r['time_s'] / p['time_s'] - 1):+.0f}% |")
    return "\n".join(out)


def mb(x: Optional[float]) -> str:
    return "" if x is None else f"{x / 2**20:.2f} MiB"


def plot(rows: List[Dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lengths = sorted({r["t"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.6), squeeze=False)
    for ax, t in zip(axes[0], lengths):
        plain = next(r for r in rows if r["t"] == t and r["method"] == "plain")
        for method, marker in zip(POLICIES + ("graph-approx", "graph-exact"), "osd^xv"):
            pts = [(r["peak_bytes"] / plain["peak_bytes"], r["time_s"] / plain["time_s"])
                   for r in rows if r["t"] == t and r["method"] == method and "peak_bytes" in r]
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker=marker, label=method)
        ax.plot([1], [1], "k*", markersize=12, label="plain BPTT")
        if t == 1000:
            ax.plot([0.05], [1.33], "r*", markersize=12, label="Gruslys et al. (GPU)")
        ax.set_xscale("log")
        ax.set_title(f"t = {t}")
        ax.set_xlabel("peak memory / plain")
        ax.set_ylabel("time / plain")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[100, 300, 1000, 3000])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.1, 0.5],
                    help="budgets between the least feasible (0) and plain's peak (1)")
    ap.add_argument("--vocab", type=int, default=100)
    ap.add_argument("--units", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--msm-cells", type=int, default=4_000_000)
    ap.add_argument("--graph-dp-max-t", type=int, default=100)
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args(argv)
    rows: List[Dict[str, Any]] = []
    for t in args.lengths:
        rows += run_length(t, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print(table(rows))
    for r in rows:
        if r["method"] == "sizes":
            print(f"\nt={r['t']}: hidden slot {r['hidden_slot']} B, internal state "
                  f"{r['internal_slot']} B (alpha={r['alpha']}), least feasible "
                  f"{mb(r['least_bytes'])}")
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
