"""Gruslys et al.'s BPTT policies on a real Chainer LSTM language model:
measured peak memory and time per iteration against plain BPTT, for
sequence lengths and budgets from the least feasible to plain's, and the
same unrolled graph through the general DP (``cr.apply``).

    .venv/bin/python experiments/bptt.py --lengths 100 300 1000 3000 \\
        --fractions-at 3000:0.05,0.1 --json experiments/bptt.json \\
        --png experiments/bptt.png --md experiments/results/bptt_table.md

Each length runs in a process of its own (``--worker chain``), the graph DP
in another (``--worker graph``), with tracemalloc restricted to NumPy's
arrays. Each iteration's meter adopts the arrays live at its start that
the iteration frees (the previous gradients at ``cleargrads()``, the
model's last outputs), so that their frees are seen. (Before 2026-12-04
it did not: where a peak came after ``cleargrads()`` the previous
gradients stayed counted beside the new ones, and ``apply()``'s meter,
nested in this one, could correct its plans for bytes that were not
there; the t = 30 rows of experiments/nested.md measured again since came
out the same.)

Memory is in the total scope (what ``cr.apply()``'s default budget and
``ChainRecompute``'s cover): the bytes live when an iteration starts that
it needs (parameters, the previous iteration's gradients, optimizer state,
the input arrays, the model's outputs), counted by hand, plus the
iteration's peak above them (forward, ``cleargrads()``, backward,
``unchain_backward()``, ``optimizer.update()``). Host-side planning
structures (the chain tables, the graph DP's lower sets) are outside it.

Time: one warm-up call per method (the chain runners measure the cell
and plan there, ``apply()`` records then plans in its first two), then
``--repeat`` rounds; each round runs plain BPTT and every method once, in
an order rotated from round to round, and the table gives the median and
the minimum. The load average is recorded before and after. Those
rounds run inside each iteration's memory meter, and on NumPy
tracemalloc's tracking of every array slows NumPy's work (plain's step
by about 20 ms at 32 units) and not the executor's Python, so their
times favour ``apply()`` at small sizes. Then, the memory measured, the
tracing stops and ``--untraced-repeat`` more rounds (as many as
``--repeat`` by default) time every method the same way without a meter,
as a training loop runs: the rows' ``untraced_*`` fields and the table's
last column (experiments/nested.md).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from chainer_recompute.runtime.memory import MemoryMeter

_TOP: Optional[MemoryMeter] = None
if __name__ == "__main__" and "--worker" in sys.argv:  # trace from the very start
    _TOP = MemoryMeter()
    _TOP.start()

import chainer_recompute as cr  # noqa: E402  (NumPy compatibility first)
import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402

from chainer_recompute.core.replay import least_floor  # noqa: E402
from chainer_recompute.core.solvers import chain as chain_solver  # noqa: E402
from chainer_recompute.runtime import bptt  # noqa: E402
from chainer_recompute.runtime.memory import model_state_bytes  # noqa: E402

POLICIES = ("hsm", "ism", "msm", "revolve")
HEADLINE = {"t": 1000, "memory": -0.95, "time": 0.33}  # Gruslys et al. 2016, on GPU


class RNNForLM(chainer.Chain):
    """Chainer's PTB example model (examples/ptb/train_ptb.py)."""

    def __init__(self, n_vocab: int, n_units: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.dropout = dropout
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, n_units)
            self.l1 = L.LSTM(n_units, n_units)
            self.l2 = L.LSTM(n_units, n_units)
            self.l3 = L.Linear(n_units, n_vocab)

    def reset_state(self) -> None:
        self.l1.reset_state()
        self.l2.reset_state()

    def forward(self, x: Any) -> Any:
        def drop(h: Any) -> Any:  # (0: no dropout layers, for --dropout 0)
            return F.dropout(h, self.dropout) if self.dropout else h

        h0 = self.embed(x)
        h1 = self.l1(drop(h0))
        h2 = self.l2(drop(h1))
        return self.l3(drop(h2))


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


def make(args: argparse.Namespace) -> Tuple[chainer.Link, chainer.Optimizer]:
    np.random.seed(0)
    model = L.Classifier(RNNForLM(args.vocab, args.units, args.dropout))
    opt = chainer.optimizers.SGD(lr=0.1)
    opt.setup(model)
    return model, opt


def _outputs_kept(model: chainer.Link) -> List[Any]:
    """The model's last outputs and state that its links keep."""
    out = []
    for link in model.links():
        for name in ("h", "c", "y", "loss", "accuracy"):
            v = getattr(link, name, None)
            if isinstance(v, chainer.Variable) and v.array is not None:
                out.append(v.array)
    return out


def live_at_call(model: chainer.Link, opt: chainer.Optimizer, data: np.ndarray) -> int:
    """Bytes live when an iteration starts that it needs, counted by hand."""
    sb = model_state_bytes(model, opt)
    extra = sum(int(a.nbytes) for a in _outputs_kept(model))
    return int(sb["params"] + sb["grads"] + sb["optimizer_state"] + data.nbytes + extra)


#: Whether :func:`iterate` measures memory (off in :func:`untraced`).
_TRACED = True


def iterate(fn: Callable[[Any, Any], Any], model: chainer.Link, opt: chainer.Optimizer,
            data: np.ndarray) -> Dict[str, float]:
    """One truncated-BPTT update as Chainer's PTB example runs it (the last
    gradients live through the forward, cleared before backward); the
    state starts from zero every time (as ``Unrolled`` does). Its time and
    peak; under :func:`untraced` its time only (``peak_bytes`` None)."""
    from chainer_recompute.runtime.device import device_of
    xs, ts = data[:-1], data[1:]
    dev = device_of([data])  # NumPy: tracemalloc; CuPy: the pool (gpu_run.py)
    model.predictor.reset_state()

    def update() -> None:
        loss = fn(xs, ts)
        model.cleargrads()
        loss.backward()
        loss.unchain_backward()
        opt.update()
        dev.synchronize()

    if not _TRACED:
        dev.synchronize()
        start = time.perf_counter()
        update()
        return {"time_s": time.perf_counter() - start, "peak_bytes": None}
    live = live_at_call(model, opt, data)
    dev.synchronize()
    start = time.perf_counter()
    with dev.meter() as meter:
        # the arrays the iteration frees, traced from here (their frees
        # seen; on CuPy the pool sees them)
        live -= dev.adopt(meter, [p.grad for p in model.params() if p.grad is not None]
                          + _outputs_kept(model))
        update()
    elapsed = time.perf_counter() - start
    return {"time_s": elapsed, "peak_bytes": int(live + meter.result.peak_bytes),
            "live_at_call": live}


def plain_fn(model: chainer.Link) -> Callable[[Any, Any], Any]:
    def run(xs: Any, ts: Any) -> Any:
        loss = 0
        for x, t in zip(xs, ts):
            loss += model(x, t)
        return loss
    return run


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """:func:`iterate` times without a memory meter inside: the worker's
    tracing stopped (the memory is measured by then), each iteration
    timed as a training loop runs it."""
    global _TOP, _TRACED
    import tracemalloc
    if _TOP is not None:
        _TOP.stop()
        _TOP = None
    if tracemalloc.is_tracing():
        tracemalloc.stop()
    _TRACED = False
    try:
        yield
    finally:
        _TRACED = True
    if tracemalloc.is_tracing():  # (a runner's own meter started it: not untraced)
        print("warning: tracemalloc was tracing during the untraced rounds", file=sys.stderr)


def untraced_rounds(methods: Dict[str, Callable[[], Dict[str, float]]], repeat: int
                    ) -> Dict[str, List[Dict[str, float]]]:
    """:func:`interleaved` under :func:`untraced` (none for ``repeat`` 0)."""
    if repeat <= 0:
        return {name: [] for name in methods}
    with untraced():
        return interleaved(methods, repeat)


def with_untraced(row: Dict[str, Any], runs: List[Dict[str, float]]) -> None:
    """Add a method's untraced rounds to its row."""
    if not runs:
        return
    times = [r["time_s"] for r in runs]
    row["untraced_time_median_s"] = float(statistics.median(times))
    row["untraced_times_s"] = times
    if all("plain_time_s" in r for r in runs):
        row["untraced_plain_times_s"] = [r["plain_time_s"] for r in runs]


def load() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


def interleaved(methods: Dict[str, Callable[[], Dict[str, float]]], repeat: int
                ) -> Dict[str, List[Dict[str, float]]]:
    """``repeat`` rounds; in each, every method runs once (the order rotated
    from round to round), each right next to a run of plain BPTT (plain
    first in even rounds, second in odd ones); a method's run records that
    plain run's time as ``plain_time_s``, for the paired ratio."""
    names = [n for n in methods if n != "plain"]
    runs: Dict[str, List[Dict[str, float]]] = {n: [] for n in methods}

    def one(name: str, r: int) -> Dict[str, float]:
        res = methods[name]()
        runs[name].append(res)
        mem = "" if res["peak_bytes"] is None else f", {res['peak_bytes'] / 2**20:.2f} MiB"
        print(f"  round {r} {name}: {res['time_s']:.2f} s{mem}",
              file=sys.stderr, flush=True)
        return res

    for r in range(repeat):
        k = r % max(len(names), 1)
        for name in names[k:] + names[:k]:
            if r % 2 == 0:
                base = one("plain", r)
                res = one(name, r)
            else:
                res = one(name, r)
                base = one("plain", r)
            res["plain_time_s"] = base["time_s"]
        if not names:
            one("plain", r)
    return runs


def summary(runs: List[Dict[str, float]]) -> Dict[str, Any]:
    times = [r["time_s"] for r in runs]
    out = {"time_median_s": float(statistics.median(times)), "time_min_s": float(min(times)),
           "times_s": times, "peak_bytes": int(max(r["peak_bytes"] for r in runs)),
           "peak_bytes_min": int(min(r["peak_bytes"] for r in runs))}
    if runs and all("plain_time_s" in r for r in runs):
        out["plain_times_s"] = [r["plain_time_s"] for r in runs]
    return out


# --------------------------------------------------------------------------
# Workers (one process each).

def worker_chain(args: argparse.Namespace) -> List[Dict[str, Any]]:
    t = args.t
    rows: List[Dict[str, Any]] = []
    data = np.random.RandomState(1).randint(0, args.vocab, (t + 1, args.batch)).astype(np.int32)
    xs, ts = data[:-1], data[1:]
    model, opt = make(args)
    load0 = load()
    plain = plain_fn(model)
    iterate(plain, model, opt, data)  # warm-up (lazy initialisation)
    first = iterate(plain, model, opt, data)
    plain_total = first["peak_bytes"]
    step_s = first["time_s"] / t
    fractions = args.fractions
    # the least feasible total: the fewest slots any policy can run with
    leasts = []
    for policy in POLICIES:
        model.predictor.reset_state()
        leasts.append(bptt.ChainRecompute(model, policy=policy, budget="least")
                      .predict(xs, ts).predicted_peak_bytes)
    least_total = min(leasts)
    # budgets: fractions of the way from the least feasible to plain's measured peak
    budgets = [int(least_total + f * (plain_total - least_total)) for f in fractions]
    methods: Dict[str, Callable[[], Dict[str, float]]] = {
        "plain": lambda: iterate(plain, model, opt, data)}
    runners: Dict[str, Tuple[bptt.ChainRecompute, Dict[str, Any]]] = {}
    seen: Dict[Tuple[str, int, int, int], str] = {}
    copies: List[Tuple[Dict[str, Any], str]] = []
    # the least each policy can run with: predicted (run if cheap enough)
    for policy in args.policies:
        for label, budget in [("least", "least")] + list(zip(fractions, budgets)):
            row: Dict[str, Any] = dict(t=t, method=policy, budget=label,
                                       budget_bytes=None if budget == "least" else budget)
            runner = bptt.ChainRecompute(model, policy=policy, budget=budget)
            model.predictor.reset_state()
            try:
                st = runner.predict(xs, ts)
            except cr.RecomputeError as e:
                row.update(skipped=f"{type(e).__name__}: {str(e)[:160]}",
                           least_feasible_bytes=getattr(e, "least_feasible_bytes", None))
                rows.append(row)
                continue
            row.update(slots=st.slots, alpha=st.alpha, forward_steps=st.forward_steps,
                       predicted_bytes=st.predicted_peak_bytes,
                       plain_predicted_bytes=st.plain_peak_bytes,
                       table_time_s=st.table_time_s, plan_time_s=st.plan_time_s)
            if label == "least":
                row["budget_bytes"] = st.predicted_peak_bytes
            calls = args.repeat + args.untraced_repeat + 1
            estimate = st.forward_steps * step_s * 1.3 * calls
            if estimate > args.max_config_s:
                row["skipped"] = (f"not run: {st.forward_steps} forward steps "
                                  f"(~{estimate:.0f} s for {calls} calls)")
                rows.append(row)
                continue
            same = seen.get((policy, st.slots, st.forward_steps, st.predicted_peak_bytes))
            if same is not None:  # the budget above the useful slots: the same plan
                row["same_plan_as"] = same
                copies.append((row, same))
                rows.append(row)
                continue
            name = f"{policy}@{label}"
            seen[(policy, st.slots, st.forward_steps, st.predicted_peak_bytes)] = name
            runners[name] = (runner, row)
            methods[name] = (lambda r=runner: iterate(r, model, opt, data))
            rows.append(row)
            print(f"t={t} {name}: slots {st.slots}, {st.forward_steps} steps, predicted "
                  f"{st.predicted_peak_bytes / 2**20:.2f} MiB", file=sys.stderr, flush=True)
    # warm-up: the first call of each runner (it measures the cell and plans)
    for name, (runner, row) in runners.items():
        res = iterate(runner, model, opt, data)
        row["first_call"] = dict(res, self_measured_bytes=runner.last_stats.measured_peak_bytes,
                                 predicted_bytes=runner.last_stats.predicted_peak_bytes)
    runs = interleaved(methods, args.repeat)
    quiet = untraced_rounds(methods, args.untraced_repeat)
    load1 = load()
    plain_row = dict(t=t, method="plain", budget=None, forward_steps=t, **summary(runs["plain"]),
                     load_before=load0, load_after=load1)
    with_untraced(plain_row, quiet.get("plain", []))
    any_runner = next(iter(runners.values()))[0] if runners else None
    if any_runner is not None:
        st = any_runner.last_stats
        plain_row["predicted_bytes"] = st.plain_peak_bytes
        sizes = st.sizes
        rows.insert(0, dict(t=t, method="sizes", hidden_slot=sizes.hidden_slot,
                            internal_slot=sizes.internal_slot, alpha=sizes.alpha,
                            constant_bytes=st.constant_bytes, param_grads=sizes.param_grads,
                            table_bytes=chain_solver.table_cache_bytes()))
    plain_row["least_feasible_bytes"] = least_total
    plain_row["fractions"] = list(fractions)
    rows.insert(0, plain_row)
    for name, (runner, row) in runners.items():
        row.update(summary(runs[name]))
        with_untraced(row, quiet.get(name, []))
        st = runner.last_stats
        row["predicted_bytes"] = st.predicted_peak_bytes
        row["self_measured_bytes"] = st.measured_peak_bytes
        row["correction_bytes"] = st.correction_bytes
        row["load_before"], row["load_after"] = load0, load1
    for row, same in copies:
        src = runners[same][1]
        row.update({k: v for k, v in src.items()
                    if k not in ("budget", "budget_bytes", "table_time_s", "plan_time_s")})
    return rows


def worker_graph(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """``cr.apply()`` on the whole unroll at the given total budgets."""
    t = args.t
    data = np.random.RandomState(1).randint(0, args.vocab, (t + 1, args.batch)).astype(np.int32)
    model, opt = make(args)
    unrolled = Unrolled(model)
    plain = plain_fn(model)
    load0 = load()
    rows: List[Dict[str, Any]] = []
    methods: Dict[str, Callable[[], Dict[str, float]]] = {
        "plain": lambda: iterate(plain, model, opt, data)}
    iterate(plain, model, opt, data)
    budgets: List[Any] = (["least"] if not args.no_least else []) + [int(b) for b in args.budgets]
    if args.solver == "exact":  # the lower sets explode whatever the budget: try it once
        budgets = budgets[-1:]
    applied: List[Tuple[str, Dict[str, Any]]] = []
    for budget in budgets:
        row: Dict[str, Any] = dict(t=t, method=f"graph-{args.solver}",
                                   budget="least" if budget == "least" else None,
                                   budget_bytes=None if budget == "least" else budget)
        u = Unrolled(model)
        start = time.perf_counter()
        try:
            solver_options = ({"max_lower_sets": args.max_lower_sets} if args.solver == "exact"
                              else {})
            cr.apply(u, budget=budget, solver=args.solver, verbose=False,
                     tuning=cr.Tuning(solver_options=solver_options))
            iterate(lambda a, b, u=u: u(a, b), model, opt, data)  # records
            res = iterate(lambda a, b, u=u: u(a, b), model, opt, data)  # plans, runs
        except Exception as e:  # reported as it is
            row.update(error=f"{type(e).__name__}: {str(e)[:300]}",
                       seconds=round(time.perf_counter() - start, 1))
            rows.append(row)
            print(f"t={t} graph-{args.solver} {budget}: {row['error']}", file=sys.stderr)
            continue
        runner = cr.runner_of(u)
        row["plan_and_first_call_s"] = round(time.perf_counter() - start, 1)
        # what any schedule holds at its fullest, in Chainer's backward
        # order (the input projections last: their output gradients wait
        # through every step's backward) or the other one apply() may use
        floor = least_floor(runner.signatures()[0].structures[0].graph)
        row["floor_bytes"], row["floor_held_grad_bytes"] = floor.peak_bytes, floor.held_grad_bytes
        row["first_call"] = res
        st = runner.last_stats
        row["predicted_bytes"] = getattr(st, "predicted_peak_bytes", None)
        row["recomputed_nodes"] = getattr(st, "recomputed_nodes", None)
        if budget == "least":
            plan_budget = getattr(st, "budget_bytes", None)
            row["budget_bytes"] = plan_budget
        name = f"graph@{budget}"
        methods[name] = (lambda u=u: iterate(lambda a, b: u(a, b), model, opt, data))
        applied.append((name, row))
        rows.append(row)
    runs = interleaved(methods, args.repeat)
    quiet = untraced_rounds(methods, args.untraced_repeat)
    load1 = load()
    rows.insert(0, dict(t=t, method=f"plain (graph-{args.solver} process)", budget=None,
                        forward_steps=t, **summary(runs["plain"]), load_before=load0,
                        load_after=load1))
    with_untraced(rows[0], quiet.get("plain", []))
    for name, row in applied:
        row.update(summary(runs[name]))
        with_untraced(row, quiet.get(name, []))
        row["load_before"], row["load_after"] = load0, load1
    del unrolled
    return rows


def worker_tables(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Time and bytes of building the tables at t = 10^4 (and MSM smaller)."""
    rows = []
    for policy, t, m, alpha in [("hsm", 10_000, 100, 1), ("ism", 10_000, 100, 8),
                                ("hsm", 10_000, 1_000, 1), ("ism", 10_000, 1_000, 8),
                                ("msm", 10_000, 30, 8), ("msm", 1_000, 2_000, 8)]:
        chain_solver.clear_table_cache()
        start = time.perf_counter()
        with MemoryMeter() as meter:
            tab = chain_solver.chain_table(policy, t, m, alpha)
        rows.append(dict(method="table", policy=policy, t=t, m=m, alpha=alpha,
                         seconds=time.perf_counter() - start, table_bytes=tab.nbytes,
                         build_peak_bytes=meter.result.peak_bytes,
                         cost=int(tab.cost[t, min(m, tab.m_max)]), load=load()))
        print(rows[-1], file=sys.stderr, flush=True)
    chain_solver.clear_table_cache()
    return rows


# --------------------------------------------------------------------------
# Report.

def mib(x: Optional[float]) -> str:
    return "" if x is None else f"{x / 2**20:.2f}"


def pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def paired(r: Dict[str, Any], p: Dict[str, Any]) -> float:
    """Median over the rounds of (this method's time / the plain run's next
    to it); rows measured before plain ran next to each method: plain's
    run of the same round."""
    return _paired(r["times_s"], r.get("plain_times_s") or p["times_s"])


def _paired(times: List[float], base: List[float]) -> float:
    return float(statistics.median(a / b for a, b in zip(times, base)))


def paired_untraced(r: Dict[str, Any]) -> Optional[float]:
    """:func:`paired` over the rounds timed without the memory meter
    (None where the row has none)."""
    times, base = r.get("untraced_times_s"), r.get("untraced_plain_times_s")
    return _paired(times, base) if times and base else None


def table(rows: List[Dict[str, Any]]) -> str:
    out = ["| t | method | budget MiB (fraction) | slots | forward steps | predicted MiB | "
           "measured MiB | within budget | memory vs plain | time median (min) | "
           "time vs plain: paired median (min / min) | untraced: paired median |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = {(r["t"], r.get("process")): r for r in rows if r["method"].startswith("plain")}
    for r in rows:
        if r.get("method") in ("sizes", "table") or "t" not in r:
            continue
        p = plain.get((r["t"], r.get("process")))
        method = r["method"] + (f" ({r['budget']})" if r.get("budget") == "least" else "")
        if r.get("same_plan_as"):
            method += f" (= {r['same_plan_as'].split('@')[1]}: same slots)"
        budget = mib(r.get("budget_bytes"))
        if isinstance(r.get("budget"), float):
            budget += f" ({r['budget']:g})"
        if "error" in r or "skipped" in r:
            why = r.get("error") or r.get("skipped")
            out.append(f"| {r['t']} | {method} | {budget} | {r.get('slots', '')} | "
                       f"{r.get('forward_steps', '')} | {mib(r.get('predicted_bytes'))} | | | | | "
                       f"{why} | |")
            continue
        # memory against plain as the chain process measured it (the graph processes'
        # plain runs see some of the graph runner's leftovers)
        pm = plain.get((r["t"], "chain"), p)
        mem = pct(r["peak_bytes"] / pm["peak_bytes"] - 1) if pm else ""
        tim = (f"{pct(paired(r, p) - 1)} ({pct(r['time_min_s'] / p['time_min_s'] - 1)})"
               if p and not r["method"].startswith("plain") else "")
        quiet = paired_untraced(r) if not r["method"].startswith("plain") else None
        held = "" if not r.get("budget_bytes") or r.get("budget") == "least" else (
            "yes" if r["peak_bytes"] <= r["budget_bytes"] else "**no**")
        out.append(
            f"| {r['t']} | {method} | {budget} | {r.get('slots') or ''} | "
            f"{r.get('forward_steps') or ''} | {mib(r.get('predicted_bytes'))} | "
            f"{mib(r['peak_bytes'])} | {held} | {mem} | "
            f"{r['time_median_s']:.2f} s ({r['time_min_s']:.2f}) | {tim} | "
            f"{'' if quiet is None else pct(quiet - 1)} |")
    return "\n".join(out)


def plot(rows: List[Dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lengths = sorted({r["t"] for r in rows if r.get("method") == "plain"})
    ncol = 2 if len(lengths) > 2 else len(lengths)
    nrow = (len(lengths) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 4.0 * nrow), squeeze=False)
    styles = dict(zip(POLICIES + ("graph-approx", "graph-exact"), "osd^xv"))
    handles: Dict[str, Any] = {}
    for ax, t in zip(axes.flat, lengths):
        plain = next(r for r in rows if r["t"] == t and r["method"] == "plain")
        ref = {r.get("process"): r for r in rows
               if r.get("t") == t and r["method"].startswith("plain")}
        for method, marker in styles.items():
            pts = sorted((r["peak_bytes"] / ref.get("chain", ref[r.get("process")])["peak_bytes"],
                          paired(r, ref[r.get("process")]))
                         for r in rows
                         if r.get("t") == t and r["method"] == method and "peak_bytes" in r)
            if pts:
                xs, ys = zip(*pts)
                handles[method], = ax.plot(xs, ys, marker=marker, label=method)
        handles["plain BPTT"], = ax.plot([1], [1], "k*", markersize=12, label="plain BPTT")
        if t == HEADLINE["t"]:
            handles["Gruslys et al. 2016 (t=1000, GPU)"], = ax.plot(
                [1 + HEADLINE["memory"]], [1 + HEADLINE["time"]], "r*", markersize=14,
                label="Gruslys et al. 2016 (t=1000, GPU)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"t = {t}: plain BPTT {plain['peak_bytes'] / 2**20:.1f} MiB, "
                     f"{plain['time_median_s']:.2f} s (median)", fontsize=9)
        ax.set_xlabel("measured peak / plain BPTT's (whole iteration)", fontsize=8)
        ax.set_ylabel("time per iteration / plain's\n(median of paired ratios)", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(lengths):]:
        ax.axis("off")
    fig.legend(list(handles.values()), list(handles), loc="lower center",
               ncol=min(len(handles), 7), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------

def run_worker(kind: str, t: int, args: argparse.Namespace, extra: List[str],
               timeout: Optional[float] = None) -> List[Dict[str, Any]]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--t", str(t),
           "--vocab", str(args.vocab), "--units", str(args.units), "--batch", str(args.batch),
           "--dropout", str(args.dropout),
           "--repeat", str(args.repeat_at.get(t, args.repeat)),
           "--untraced-repeat", str(args.repeat_at.get(t, args.repeat)
                                    if args.untraced_repeat is None else args.untraced_repeat),
           "--max-config-s", str(args.max_config_s), "--out", out] + extra
    print(" ".join(cmd[1:]), file=sys.stderr, flush=True)
    start = time.perf_counter()
    what = f"graph-{extra[extra.index('--solver') + 1]}" if kind == "graph" else kind
    failed = dict(t=t, method=what, process=what)
    try:
        subprocess.run(cmd, check=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [dict(failed, error=f"no result within {timeout:.0f} s (process killed)")]
    except subprocess.CalledProcessError as e:
        return [dict(failed, error=f"worker failed ({e.returncode})")]
    with open(out) as fh:
        rows = json.load(fh)
    os.unlink(out)
    print(f"  ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[100, 300, 1000, 3000])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.1, 0.25, 0.5],
                    help="budgets as fractions of the way from the least feasible total "
                         "(the fewest slots any policy runs with) to plain BPTT's measured "
                         "total peak (each policy's own least is added)")
    ap.add_argument("--fractions-at", action="append", default=[],
                    help="T:f1,f2 — other fractions at length T")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES,
                    help="the chain policies run (all policies' least is predicted)")
    ap.add_argument("--policies-at", action="append", default=[],
                    help="T:p1,p2 — other policies at length T")
    ap.add_argument("--vocab", type=int, default=100)
    ap.add_argument("--units", type=int, default=32)
    ap.add_argument("--dropout", type=float, default=0.5,
                    help="the dropout ratio of the model's three dropout layers (Chainer's "
                         "PTB example: 0.5; 0: none)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--repeat-at", action="append", default=[], help="T:n")
    ap.add_argument("--untraced-repeat", type=int,
                    help="rounds timed without the memory meter after the measured ones "
                         "(default: as many as --repeat; 0: none)")
    ap.add_argument("--max-config-s", type=float, default=240.0,
                    help="skip a configuration whose calls would take longer (estimated "
                         "from its forward steps)")
    ap.add_argument("--graph-dp-max-t", type=int, default=300)
    ap.add_argument("--graph-dp-solvers", nargs="+", default=["approx", "exact"])
    ap.add_argument("--exact-max-t", type=int, default=100)
    ap.add_argument("--graph-timeout-s", type=float, default=1800)
    ap.add_argument("--tables", action="store_true", help="also time the tables at t=10^4")
    ap.add_argument("--json")
    ap.add_argument("--png")
    ap.add_argument("--md")
    ap.add_argument("--report", nargs="+", help="only merge these JSON files (into --json) "
                    "and write the table/PNG")
    ap.add_argument("--skip-chain", action="store_true", help="run only the graph DP (and "
                    "--tables); the budgets come from --json or --budgets-from")
    ap.add_argument("--budgets-from", help="a JSON file with the chain rows")
    # worker options
    ap.add_argument("--worker", choices=["chain", "graph", "tables"])
    ap.add_argument("--t", type=int)
    ap.add_argument("--solver", default="approx")
    ap.add_argument("--budgets", type=float, nargs="*", default=[])
    ap.add_argument("--max-lower-sets", type=int, default=2_000_000)
    ap.add_argument("--no-least", action="store_true",
                    help="graph DP: only the given budgets, not budget='least' (its search "
                         "runs the DP many times)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    args.repeat_at = {int(k): int(v) for k, v in (s.split(":") for s in args.repeat_at)}
    if args.worker and args.untraced_repeat is None:
        args.untraced_repeat = args.repeat
    if args.worker:
        if args.worker == "chain":
            rows = worker_chain(args)
        elif args.worker == "graph":
            rows = worker_graph(args)
        else:
            rows = worker_tables(args)
        process = "chain" if args.worker == "chain" else f"graph-{args.solver}"
        for r in rows:
            r.setdefault("process", process)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        return 0
    policies_at = {int(k): v.split(",") for k, v in (s.split(":") for s in args.policies_at)}
    fractions_at = {int(k): [float(x) for x in v.split(",")]
                    for k, v in (s.split(":") for s in args.fractions_at)}
    def save(rows: List[Dict[str, Any]]) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)

    if args.report:  # merge finished runs' JSON files
        rows = []
        for path in args.report:
            with open(path) as f:
                rows += json.load(f)
        save(rows)
    else:
        rows = []
        if args.json and os.path.exists(args.json):  # resume: what is done is kept
            with open(args.json) as f:
                rows = json.load(f)
        budget_rows = list(rows)
        if args.budgets_from:  # the chain rows of another run (graph DP only)
            with open(args.budgets_from) as f:
                budget_rows += json.load(f)
        for t in args.lengths:
            if not args.skip_chain and not any(
                    r.get("t") == t and r.get("method") == "plain" for r in rows):
                fr = fractions_at.get(t, args.fractions)
                chain_rows = run_worker("chain", t, args, ["--fractions"] + [str(x) for x in fr]
                                        + ["--policies"] + policies_at.get(t, args.policies))
                rows += chain_rows
                budget_rows += chain_rows
                save(rows)
            if t > args.graph_dp_max_t:
                continue
            budgets = sorted({r["budget_bytes"] for r in budget_rows
                              if r.get("t") == t and r.get("method") in POLICIES
                              and r.get("budget") != "least" and r.get("budget_bytes")})
            for solver in args.graph_dp_solvers:
                if solver == "exact" and t > args.exact_max_t:
                    continue
                if any(r.get("t") == t and r.get("process") == f"graph-{solver}" for r in rows):
                    continue
                rows += run_worker("graph", t, args,
                                   (["--no-least"] if args.no_least else []) + ["--solver", solver, "--max-lower-sets", str(args.max_lower_sets),
                                    "--budgets"] + [str(b) for b in budgets],
                                   timeout=args.graph_timeout_s)
                save(rows)
        if args.tables and not any(r.get("method") == "table" for r in rows):
            rows += run_worker("tables", 0, args, [])
            save(rows)
    text = table(rows)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
