"""Issue 7's patterns, one row each: plain Chainer against ``apply()``.

Every scenario is the regression test's own, imported from
tests/test_real_training.py and tests/chainer_examples/harness.py; nothing
is written twice. The test functions are called as they are (with their own
assertions); two module globals of the test module are swapped while they
run, so that each ``compare()`` they make is also measured:

- ``Env`` becomes :class:`MeasuringEnv`, which measures the array memory
  between consecutive records (``env.snap``) with
  :class:`~chainer_recompute.runtime.memory.MemoryMeter` and keeps each
  applied runner's ``last_stats`` at every record;
- ``run`` starts an outer ``MemoryMeter`` before the scenario builds anything
  (so parameters, gradients, optimizer state and the activations are all
  traced) and stops it when the run ends;
- ``compare`` is the test module's own, also keeping the ``Pair``.

Chainer's example scripts run through the harness's ``compare_variant``
(``size='light'``, the sizes of the default test run, with 5 optimizer steps
instead of 3: ``--example-steps``) with
``snapshot_state`` / ``RunRecord.add`` / ``run_example`` wrapped the same
way, and ``apply_fn`` = ``chainer_recompute.apply`` that also keeps the
applied links.

Measured peak of a step: the largest array bytes live (NumPy arrays, traced
by tracemalloc from the start of the run) in the windows between the
records of the last optimizer step, minus what the harness itself holds
(its records: the bytes its record-taking left allocated, summed); the
windows that end at a record taken right after a backward (forward +
backward), or the whole step where the scenario records only after its
update. Data made before a scenario starts (most tests make their batches
in the test function) are not traced, in either run.

    .venv/bin/python experiments/patterns.py [--only SUBSTRING] [--no-examples]
        [--example-steps N] [--from-json experiments/patterns.json]

Writes experiments/patterns.json and experiments/patterns.md (about 7 minutes
on 2 CPUs); ``--from-json`` only writes the .md again.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import chainer_recompute as cr  # noqa: E402  (before chainer)
import chainer  # noqa: E402
import numpy as np  # noqa: E402

from chainer_recompute.runtime.memory import MemoryMeter  # noqa: E402


def _load(name: str, path: str) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


# the same module names as the test run uses
harness = _load("chainer_examples_harness", os.path.join(ROOT, "tests", "chainer_examples",
                                                         "harness.py"))
trt = _load("test_real_training", os.path.join(ROOT, "tests", "test_real_training.py"))


# =====================================================================
# Measuring the Env scenarios
# =====================================================================
STATS_FIELDS = ("path", "n_dropped", "n_nodes", "recomputed_nodes", "release_mode", "mismatch",
                "predicted_peak_bytes", "budget_bytes", "measured_peak_bytes")


def stats_dict(runner: Any) -> Optional[Dict[str, Any]]:
    s = getattr(runner, "last_stats", None)
    if s is None:
        return None
    d = {k: getattr(s, k, None) for k in STATS_FIELDS}
    d["scope"] = getattr(runner, "budget_scope", None)
    return d


class Windows:
    """Peak array bytes between consecutive records, less the bytes that
    taking the records left allocated (the harness's own holdings)."""

    def __init__(self) -> None:
        self.meter: Optional[MemoryMeter] = None
        self.held = 0
        self.prev_end: Optional[int] = None
        self.windows: List[Dict[str, Any]] = []
        self.pending: Optional[Dict[str, Any]] = None

    def open(self) -> None:
        self.meter = MemoryMeter().start()

    def close(self) -> Optional[Dict[str, Any]]:
        if self.meter is None:
            return None
        gc.collect()  # inside the window: frees only, the peak is kept
        r = self.meter.stop()
        self.meter = None
        if self.prev_end is not None:
            self.held += r.start_bytes - self.prev_end
        self.prev_end = r.end_bytes
        return {"peak": r.absolute_peak_bytes - self.held, "start": r.start_bytes - self.held,
                "held_by_records": self.held}


def _make_env_class() -> type:
    class MeasuringEnv(trt.Env):
        def __init__(self, applied: bool, options: Dict[str, Any]) -> None:
            super().__init__(applied, options)
            self.win = Windows()
            self.runner_log: List[Any] = []
            self.win.open()

        def snap(self, label: str, **extra: Any) -> None:
            w = self.win.close()
            if w is not None:
                w["label"] = label
                self.win.windows.append(w)
            super().snap(label, **extra)
            if self.applied:
                self.runner_log.append((label, {n: stats_dict(r)
                                                for n, r in self.runners.items()}))
            self.win.open()

        def finish(self) -> None:
            if self.win.meter is not None:
                self.win.meter.stop()
                self.win.meter = None
    return MeasuringEnv


CALLS: List[Dict[str, Any]] = []  # one per compare() of the test being run


def _measured_run(real_run: Callable[..., Any]) -> Callable[..., Any]:
    def run(scenario: Any, applied: bool, options: Dict[str, Any], seed: int = 0) -> Any:
        gc.collect()
        outer = MemoryMeter().start()
        envs: List[Any] = []
        real_env = trt.Env

        class Tracked(real_env):  # type: ignore[misc, valid-type]
            def __init__(self, *a: Any, **k: Any) -> None:
                super().__init__(*a, **k)
                envs.append(self)
        trt.Env = Tracked
        try:
            env = real_run(scenario, applied, options, seed)
        finally:
            trt.Env = real_env
            for e in envs:
                e.finish()
            outer.stop()
        return env
    return run


def _measured_compare(scenario: Any, seed: int = 0, **options: Any) -> Any:
    """tests/test_real_training.py's compare(), keeping the Pair."""
    options = {**trt.LEAST, **options}
    plain = trt.run(scenario, False, options, seed)
    ours = trt.run(scenario, True, options, seed)
    pair = trt.Pair(plain, ours)
    CALLS.append({"pair": pair, "options": options, "seed": seed})
    return pair.check()


@contextlib.contextmanager
def measuring_tests():
    saved = (trt.Env, trt.run, trt.compare)
    trt.Env = _make_env_class()
    trt.run = _measured_run(saved[1])
    trt.compare = _measured_compare
    try:
        yield
    finally:
        trt.Env, trt.run, trt.compare = saved


def _token(label: str) -> str:
    return label.split()[0] if label.split() else label


def _step_peak(windows: List[Dict[str, Any]], token: str) -> Optional[Dict[str, Any]]:
    mine = [w for w in windows if _token(w["label"]) == token]
    bw = [w for w in mine if "backward" in w["label"]]
    use = bw or mine
    if not use:
        return None
    best = max(use, key=lambda w: w["peak"])
    return {"peak": best["peak"], "window": best["label"],
            "windows": "after backward" if bw else "whole step"}


def _per_step(records: List[Any], pw: List[Dict[str, Any]], aw: List[Dict[str, Any]],
              runner_log: List[Any]) -> List[Dict[str, Any]]:
    """Plain and applied peak of every step, in the order of the records."""
    tokens: List[str] = []
    for lab, _ in records:
        t = _token(lab)
        if "before training" in lab:
            continue
        if t not in tokens and (t.isdigit() or ":" in t):
            tokens.append(t)
    out = []
    for t in tokens:
        p, a = _step_peak(pw, t), _step_peak(aw, t)
        if p and a:
            paths = {}
            for lab, d in runner_log:
                if _token(lab) == t:
                    paths.update({n: (st or {}).get("path") for n, st in d.items()})
            out.append({"step": t, "plain": p["peak"], "applied": a["peak"], "paths": paths})
    return out


def _kinds(records: List[Any]) -> List[str]:
    kinds = set()
    for _, rec in records:
        if rec:
            kinds.update(k.split("/")[0] for k in rec)
    return sorted(kinds)


def summarise_pair(call: Dict[str, Any]) -> Dict[str, Any]:
    pair = call["pair"]
    plain, ours = pair.plain, pair.ours
    diff = pair.first_difference()
    records = plain.records
    out: Dict[str, Any] = {
        "options": {k: v for k, v in call["options"].items()},
        "seed": call["seed"],
        "identical": diff is None and ours.error is None,
        "first_difference": diff,
        "crash": None if ours.error is None else "".join(
            traceback.format_exception_only(type(ours.error), ours.error)).strip(),
        "records": len(records),
        "keys_per_record": max((len(r) for _, r in records), default=0),
        "compared": _kinds(records),
        "steps": len({_token(lab) for lab, _ in records}),
        "warnings": sorted(set(ours.warnings())),
    }
    # paths: each runner's last_stats at every record, and at the last one
    log = getattr(ours, "runner_log", [])
    runners = sorted({n for _, d in log for n in d})
    out["runners"] = {}
    for name in runners:
        seq = [(lab, d.get(name)) for lab, d in log]
        last = next((s for _, s in reversed(seq) if s is not None), None)
        out["runners"][name] = {
            "last": last,
            "paths": [f"{lab}: {s['path'] if s else None}" for lab, s in seq],
        }
    if records:
        token = _token(records[-1][0])
        out["last_step"] = token
        p = _step_peak(getattr(plain, "win", Windows()).windows, token)
        a = _step_peak(getattr(ours, "win", Windows()).windows, token)
        out["plain_peak"] = p
        out["applied_peak"] = a
        out["per_step"] = _per_step(records, getattr(plain, "win", Windows()).windows,
                                    getattr(ours, "win", Windows()).windows, log)
    return out


# =====================================================================
# Measuring Chainer's example scripts
# =====================================================================
class _ExampleRun:
    current: Optional["_ExampleRun"] = None

    def __init__(self) -> None:
        self.win = Windows()
        self.links: List[Any] = []
        self.runner_log: List[Any] = []


def _example_patches():
    """Wrappers of the harness's record-taking: a window closes when a
    record is about to be taken (``snapshot_state``) and the next one opens
    once the record-taking code has returned (so that a record the applied
    run compares and drops at once is not counted as held)."""
    real = (harness.run_example, harness.snapshot_state, harness.RunRecord.add,
            harness._Recorder.initialize, harness._Recorder.__call__,
            harness._pre_update_recorder)
    real_run_example, real_snapshot, real_add, real_init, real_call, real_factory = real

    def reopen() -> None:
        m = _ExampleRun.current
        if m is not None and m.win.meter is None:
            m.win.open()

    def run_example(*a: Any, **k: Any) -> Any:
        m = _ExampleRun()
        _ExampleRun.current = m
        gc.collect()
        outer = MemoryMeter().start()
        m.win.open()
        try:
            rec = real_run_example(*a, **k)
        finally:
            if m.win.meter is not None:
                m.win.meter.stop()
                m.win.meter = None
            outer.stop()
            _ExampleRun.current = None
        rec._measure = m
        return rec

    def snapshot_state(*a: Any, **k: Any) -> Any:
        m = _ExampleRun.current
        if m is not None and m.win.meter is not None:
            m.win.pending = m.win.close()
        return real_snapshot(*a, **k)

    def add(self: Any, label: str, rec: Any) -> None:
        real_add(self, label, rec)
        m = _ExampleRun.current
        if m is not None:
            if m.win.pending is not None:
                m.win.pending["label"] = label
                m.win.windows.append(m.win.pending)
                m.win.pending = None
            if m.links:
                m.runner_log.append((label, {f"{type(l).__name__}#{i}": stats_dict(
                    cr.runner_of(l)) for i, l in enumerate(m.links)}))

    def initialize(self: Any, trainer: Any) -> None:
        real_init(self, trainer)
        reopen()

    def call(self: Any, trainer: Any) -> None:
        real_call(self, trainer)
        reopen()

    def factory(run: Any, real_call_hooks: Callable[..., Any]) -> Callable[..., Any]:
        def hooks(self: Any, timing: str = "pre") -> Any:
            reopen()  # the record of the backward is taken (and dropped) by now
            return real_call_hooks(self, timing)
        return real_factory(run, hooks)

    def apply_fn(link: Any, budget: Any, **kw: Any) -> Any:
        link = cr.apply(link, budget=budget, **kw)
        if _ExampleRun.current is not None:
            _ExampleRun.current.links.append(link)
        return link

    return real, (run_example, snapshot_state, add, initialize, call, factory), apply_fn


def _set_harness(fns: Any) -> None:
    (harness.run_example, harness.snapshot_state, harness.RunRecord.add,
     harness._Recorder.initialize, harness._Recorder.__call__,
     harness._pre_update_recorder) = fns


def _size_name(size: str, steps: Optional[int]) -> str:
    """``size`` of harness.SIZES, or that size with ``steps`` optimizer
    steps (added to harness.SIZES under a name of its own)."""
    if steps is None:
        return size
    import dataclasses
    name = f"{size}-{steps}steps"
    harness.SIZES[name] = {k: dataclasses.replace(v, steps=steps)
                           for k, v in harness.SIZES[size].items()}
    return name


def run_example_variant(variant: str, size: str) -> Dict[str, Any]:
    saved, new, apply_fn = _example_patches()
    _set_harness(new)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            res = harness.compare_variant(variant, tmp, size=size, budget="least",
                                          apply_fn=apply_fn)
            elapsed = time.perf_counter() - t0
    finally:
        _set_harness(saved)
    pm, am = res.plain._measure, res.applied._measure
    steps = [lab for lab, _ in res.plain.records if lab.isdigit()]
    last = steps[-1] if steps else None
    out: Dict[str, Any] = {
        "variant": variant, "size": size,
        "identical": res.identical,
        "report": res.report(),
        "crash": res.applied.error_summary,
        "records": len(res.plain.records),
        "keys_per_record": max((len(r) for _, r in res.plain.records if r), default=0),
        "compared": _kinds(res.plain.records),
        "steps": len(steps),
        "applied_to": res.applied.applied_to,
        "n_plans": res.applied.n_plans,
        "warnings": sorted({m for m in res.applied.log if m.startswith(("WARNING", "ERROR"))}),
        "seconds": round(elapsed, 1),
        "last_step": last,
    }
    out["runners"] = {}
    for name in sorted({n for _, d in am.runner_log for n in d}):
        seq = [(lab, d.get(name)) for lab, d in am.runner_log]
        lastst = next((s for _, s in reversed(seq) if s is not None), None)
        # the stats at the last backward of the last step
        at_bw = [s for lab, s in seq if lab.startswith(f"{last} (") and s is not None]
        out["runners"][name] = {
            "last": at_bw[-1] if at_bw else lastst,
            "paths": [f"{lab.split(' (')[0]}{' bw' if 'after backward' in lab else ''}: "
                      f"{s['path'] if s else None}" for lab, s in seq],
        }
    if last is not None:
        out["plain_peak"] = _step_peak(pm.win.windows, last)
        out["applied_peak"] = _step_peak(am.win.windows, last)
        out["per_step"] = _per_step(res.plain.records, pm.win.windows, am.win.windows,
                                    am.runner_log)
    return out


# =====================================================================
# The patterns
# =====================================================================
def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="patterns-"))


# (group, pattern, test function, kwargs, kind) ; kind: "memory" or "api"
def pattern_specs() -> List[Dict[str, Any]]:
    S: List[Dict[str, Any]] = []

    def add(group, pattern, test, kind="memory", **kw):
        S.append({"group": group, "pattern": pattern, "test": test, "kwargs": kw, "kind": kind})

    g = "silent wrong results"
    add(g, "dynamic wiring: concat order chosen by the data", "test_wiring_depends_on_data",
        net=trt.ConcatOrder)
    add(g, "dynamic wiring: which branch feeds which layer", "test_wiring_depends_on_data",
        net=trt.CrossWiring)
    add(g, "lazy L.Linear(None, n), no dropout", "test_lazy_init_and_dropout", ratio=0.0,
        capture_batch=None)
    add(g, "lazy L.Linear(None, n) + dropout 0.3", "test_lazy_init_and_dropout", ratio=0.3,
        capture_batch=None)
    add(g, "lazy + dropout 0.3, capture_batch=4", "test_lazy_init_and_dropout", ratio=0.3,
        capture_batch=4)
    add(g, "lazy + dropout + shuffling SerialIterator (MNIST pattern)",
        "test_lazy_init_with_shuffling_iterator")
    add(g, "Trainer, 3 epochs: shuffle, lazy, dropout, Evaluator",
        "test_trainer_three_epochs_shuffle_lazy_dropout", tmp_path="TMP")
    add(g, "Python-side counter in forward (KL annealing)", "test_python_counter_in_forward",
        capture_batch=None)
    add(g, "Python-side counter in forward, capture_batch=4", "test_python_counter_in_forward",
        capture_batch=4)
    add(g, "BatchNormalization(finetune=True)", "test_batchnorm_finetune")
    add(g, "cr.Recompute(fn) over a net with BatchNorm", "test_recompute_callable_over_batchnorm",
        capture_batch=None)
    add(g, "cr.Recompute(fn) over BatchNorm, capture_batch=2",
        "test_recompute_callable_over_batchnorm", capture_batch=2)
    for cb in (None, 4):
        for to in (("dis",), ("gen",), ("gen", "dis")):
            add("crashes" if to == ("gen", "dis") else g,
                f"DCGAN updater (dis updated between the two backward passes), apply() on "
                f"{'+'.join(to)}" + ("" if cb is None else f", capture_batch={cb}"),
                "test_dcgan_updater", apply_to=to, capture_batch=cb)
    add(g, "custom FunctionNode drawing from the global RNG (12 seeds)",
        "test_random_function_node_always_unsafe")
    add(g, "L.LSTM state, truncated BPTT (PTB pattern)", "test_stateful_lstm_truncated_bptt",
        capture_batch=None)
    add(g, "L.LSTM state, truncated BPTT, capture_batch=4", "test_stateful_lstm_truncated_bptt",
        capture_batch=4)

    g = "crashes"
    add(g, "L.NStepLSTM, variable lengths", "test_nstep_lstm_variable_length", link=True)
    add(g, "F.n_step_lstm, variable lengths", "test_nstep_lstm_variable_length", link=False)
    add(g, "unused outputs kept on the Link (softmax, mean, accuracy)",
        "test_outputs_not_used_by_the_loss", kind_="keep")
    add(g, "unused outputs thrown away at once", "test_outputs_not_used_by_the_loss",
        kind_="throwaway")
    add(g, "data-dependent branch selection", "test_data_dependent_branch_selection")
    add(g, "data choose between two same-shaped layers", "test_data_dependent_structure_more",
        net=trt.LayerChoice, signs=[1, -1, 1, -1, 1, -1])
    add(g, "BatchNorm then a data-dependent function", "test_data_dependent_structure_more",
        net=trt.BNThenBranch, signs=[1, -1, -1, -1, 1, -1])
    add(g, "double backprop inside the forward (WGAN-GP loss Link)",
        "test_double_backprop_inside_forward_still_recomputes")
    add(g, "gradient penalty outside the applied critic",
        "test_double_backprop_after_forward_gradient_penalty")
    add(g, "chainer.grad(enable_double_backprop) wrt an applied Classifier's input",
        "test_double_backprop_after_forward_input_gradient")
    add(g, "GAN graphs backpropagated twice, apply() on gen+dis",
        "test_gan_graphs_backpropagated_twice", capture_batch=None)
    add(g, "one graph backpropagated twice (two losses)", "test_graph_backpropagated_twice_simple",
        capture_batch=None)
    add(g, "an applied encoder's outputs backpropagated again by their consumer, after "
           "unchain_backward (pix2pix updater)", "test_outputs_backpropagated_again_by_their_consumer")

    g = "API"
    add(g, "Link with only __call__", "test_link_with_only_call")
    add(g, "Classifier subclass overriding __call__", "test_classifier_subclass_overriding_call")
    add(g, "budget='least' in apply()", "test_budget_least_in_apply")
    for k in ("tuple", "dict", "distribution"):
        add(g, f"forward returns a {k}", "test_forward_returning_other_than_a_variable", kind_=k)
    add(g, "nested apply()", "test_nested_apply", kind="api")
    add(g, "pickling (model + optimizer, mid-training)", "test_pickle_applied_model",
        kind="api")
    add(g, "Trainer snapshot, load_npz into a new applied trainer",
        "test_trainer_snapshot_and_load_npz", kind="api", tmp_path="TMP")
    add(g, "copy() and deepcopy()", "test_copy_and_deepcopy_get_their_own_plans", kind="api")
    add(g, "infeasible-budget message pasted back (2 scopes x 3 widths)",
        "test_infeasible_budget_figure_can_be_pasted_back", kind="api")

    g = "fallback"
    add(g, "structure changes on every call (EverChanging, batch 256, width 256, 10 steps)",
        "ever_changing", kind="memory")
    add(g, "structure changes on every call: the test's own per-call peaks (wide, tiny; plan_at "
        "backward, call)",
        "test_ever_changing_structure_falls_back_to_plain", kind="api")
    return S


def ever_changing_scenario(env: Any) -> None:
    """tests/test_real_training.py's EverChanging as a training loop (its
    own test measures single calls)."""
    data = trt.batches(10, batch=256, width=256)
    model = env.apply("model", trt.EverChanging(w=256))
    opt = env.optimizer("main", chainer.optimizers.MomentumSGD(0.05), model)
    trt.train_steps(env, model, opt, data)


def infeasible_probe(scope: str = "total", hidden: int = 64) -> Dict[str, Any]:
    """One message of the infeasible-budget test, for the table: the figure
    it prints and what passing it back does."""
    x, t = trt.batches(1)[0]
    np.random.seed(0)
    model = chainer.links.Classifier(trt.MLP(hidden=hidden))
    cr.apply(model, budget=1, budget_scope=scope)
    try:
        model(x, t)  # planned from captures before it runs
        return {"error": "no InfeasibleBudgetError at budget=1"}
    except cr.InfeasibleBudgetError as e:
        message, least = str(e), e.least_feasible_bytes
    m = trt._LEAST_RE.search(message)
    figure = m.group(1) if m else None
    out = {"scope": scope, "hidden": hidden, "message": message, "figure": figure,
           "least_feasible_bytes": least,
           "figure_bytes": cr.parse_bytes(figure) if figure else None}
    cr.apply(model, budget=figure, budget_scope=scope)
    for _ in range(2):
        model.cleargrads()
        try:
            model(x, t).backward()
        except cr.InfeasibleBudgetError as e:
            out["pasted_back"] = f"refused: {e}"
            return out
    out["pasted_back"] = f"accepted, path {cr.runner_of(model).last_stats.path}"
    return out


def row_cases(spec: Dict[str, Any]) -> Tuple[Callable[..., Any], List[Dict[str, Any]]]:
    """A row's test function of tests/test_real_training.py and the keyword
    arguments of each call the row makes: the row's own, with the test's
    ``parametrize`` cases for the rest (``"TMP"``: a fresh directory)."""
    fn = getattr(trt, spec["test"])
    given = {("kind" if k == "kind_" else k): v for k, v in spec["kwargs"].items()}
    return fn, [{**given, **extra} for extra in _param_sets(fn, given)]


def _param_sets(fn: Callable[..., Any], given: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every case of the test function ``fn``'s own ``pytest.mark.parametrize``
    marks, over the arguments not ``given`` by its row."""
    sets: List[Dict[str, Any]] = [{}]
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if any(n in given for n in names):
            continue
        rows = [v if len(names) > 1 else (v,) for v in values]
        sets = [{**s, **dict(zip(names, row))} for s in sets for row in rows]
    return sets


def run_pattern(spec: Dict[str, Any]) -> Dict[str, Any]:
    row: Dict[str, Any] = {k: spec[k] for k in ("group", "pattern", "test", "kind")}
    row["params"] = {("kind" if k == "kind_" else k): (v.__name__ if isinstance(v, type) else v)
                     for k, v in spec["kwargs"].items() if k != "tmp_path"}
    del CALLS[:]
    t0 = time.perf_counter()
    outcomes = []
    with measuring_tests():
        if spec["test"] == "ever_changing":
            calls = [lambda: trt.compare(ever_changing_scenario)]
        else:
            fn, cases = row_cases(spec)
            calls = [lambda kw=kw: fn(**{k: (_tmp() if v == "TMP" else v) for k, v in kw.items()})
                     for kw in cases]
        for call in calls:
            try:
                call()
                outcomes.append("passed")
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - pytest.fail raises a BaseException
                msg = str(e).strip().splitlines()
                outcomes.append(f"FAILED: {type(e).__name__}: {msg[0] if msg else ''}"[:400])
    row["seconds"] = round(time.perf_counter() - t0, 1)
    n_ok = outcomes.count("passed")
    if n_ok == len(outcomes):
        row["test_outcome"] = "passed" + (f" ({n_ok} runs)" if n_ok > 1 else "")
    else:
        row["test_outcome"] = (f"FAILED {len(outcomes) - n_ok}/{len(outcomes)}: "
                               + "; ".join(o for o in outcomes if o != "passed"))
    row["compares"] = [summarise_pair(c) for c in CALLS]
    if spec["test"] == "test_infeasible_budget_figure_can_be_pasted_back":
        row["probe"] = infeasible_probe()
    return row


# =====================================================================
# Report
# =====================================================================
def mib(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / 2**20:.3f}"


def _path_cell(runners: Dict[str, Any]) -> str:
    cells = []
    for name, r in runners.items():
        last = r["last"]
        path = last["path"] if last else "none"
        if last and last["path"] == "planned":
            path += f" ({last['n_dropped']}/{last['n_nodes']} dropped)"
        cells.append((f"{name}: " if len(runners) > 1 else "") + f"**{path}**")
    return "; ".join(cells) or "-"


def _pred_cell(runners: Dict[str, Any]) -> str:
    cells = []
    for name, r in runners.items():
        last = r["last"]
        if last and last["path"] == "planned" and last["predicted_peak_bytes"] is not None:
            cells.append((f"{name}: " if len(runners) > 1 else "")
                         + f"{mib(last['predicted_peak_bytes'])} ({last['scope']})")
    return "; ".join(cells) or "-"


def _steps_cell(per_step: List[Dict[str, Any]]) -> str:
    return " ".join(f"{x['applied'] / x['plain']:.2f}" for x in per_step if x["plain"]) or "-"


def _identical_cell(c: Dict[str, Any]) -> str:
    if c["identical"]:
        return f"yes ({c['records']} records x {c['keys_per_record']} keys, {c['steps']} steps)"
    if c.get("crash"):
        return f"NO: crash {c['crash'][:120]}"
    return f"NO: {str(c.get('first_difference') or c.get('report'))[:200]}"


def table_rows(rows: List[Dict[str, Any]]) -> List[str]:
    out = ["| # | group | pattern | test outcome | bit-identical | path at last step "
           "| plain peak MiB | applied peak MiB | applied/plain | predicted MiB (scope) "
           "| applied/plain, every step |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        comps = r.get("compares") or []
        if r.get("variant"):
            comps = [r]
        if not comps:
            c = None
        elif len(comps) == 1:
            c = comps[0]
        else:
            c = comps[-1]
        outcome = r.get("test_outcome", "")
        if r.get("variant"):
            outcome = "harness: " + ("identical" if r["identical"] else "differs")
        if c is None:
            probe = r.get("probe") or {}
            behaviour = (f"message: \"...{probe.get('figure')}...\" (least feasible "
                         f"{probe.get('least_feasible_bytes')} B, figure = "
                         f"{probe.get('figure_bytes')} B); pasted back: "
                         f"{probe.get('pasted_back')}") if probe else r.get("behaviour", "-")
            out.append(f"| {i} | {r['group']} | {r['pattern']} | {outcome} | "
                       f"n/a (no training run compared) | {behaviour} | - | - | - | - | - |")
            continue
        if len(comps) > 1:
            n_id = sum(x["identical"] for x in comps)
            ident = f"{'yes' if n_id == len(comps) else 'NO'}: {n_id}/{len(comps)} runs; " \
                    + _identical_cell(c)
        else:
            ident = _identical_cell(c)
        path = _path_cell(c.get("runners", {}))
        if r["kind"] == "api":
            beh = r.get("behaviour", "")
            out.append(f"| {i} | {r['group']} | {r['pattern']} | {outcome} | {ident} | {path}"
                       f"{'; ' + beh if beh else ''} | - | - | - | - | - |")
            continue
        p, a = c.get("plain_peak"), c.get("applied_peak")
        pp, ap = (p or {}).get("peak"), (a or {}).get("peak")
        ratio = f"{ap / pp:.3f}" if pp and ap else "-"
        out.append(f"| {i} | {r['group']} | {r['pattern']} | {outcome} | {ident} | {path} | "
                   f"{mib(pp)} | {mib(ap)} | {ratio} | {_pred_cell(c.get('runners', {}))} | "
                   f"{_steps_cell(c.get('per_step') or [])} |")
    return out


#: Written into patterns.md after the generated sections: where the applied
#: run's peak above plain Chainer comes from, measured separately (the
#: commands are given; the figures are from the run of 2026-11-30).
NOTES = """\
## Where the steps above plain Chainer come from (measured separately)

Every row is bit-identical. Where the applied run's peak is above plain
Chainer's (previous section), four causes were found, each measured: by
tracemalloc snapshots (NumPy's domain, grouped by allocating line) at every
record of the plain and the applied run, subtracted; or by a MemoryMeter
around the runner's planning calls (`Recompute._plan_pending`, `_add`):

1. **The step after the first planned update** (rows with a `1.1x-1.2x` at the
   third step: Classifier-style loops, MNIST, CIFAR-VGG). Before an optimizer
   update, the executor copies every parameter that a released block was
   computed from (`IterationHook.before_param_update`,
   chainer_recompute/runtime/executor.py, `self.snapshots[a] = param.array.copy()`),
   until a plan's first update was followed by no second backward
   (`PROBATION = 1`). The copies live as long as the previous iteration's
   graph, which `L.Classifier` (`self.y`, `self.loss`) and a loop's `loss`
   variable keep alive into the next forward; that forward's peak then
   carries them. tracemalloc snapshots by allocating line, right after the
   backward of step 3 of the MNIST example: the applied run's extra live
   bytes are that line (350 KiB, the model's parameters). A standalone reproducer
   (Classifier of 4 x Linear(256, 256), batch 64, `budget='least'`,
   `cost='flops'`, MemoryMeter around cleargrads + forward + backward):

   ```
   step 0: plain 2787676 B, applied 2787676 B (1.000), recorded
   step 1: plain 3850628 B, applied 3785088 B (0.983), planned, budget 3554910, predicted 3519360, runner measured 3055484
   step 2: plain 3850628 B, applied 4583688 B (1.190), planned, budget 3554910, predicted 3519360, runner measured 2451280
   step 3: plain 3850628 B, applied 3586276 B (0.931), planned, budget 3554910, predicted 3519360, runner measured 3320188
   ```

   At step 2 the process's array peak is 1.29x the budget while the runner's
   own check (`last_stats.measured_peak_bytes`, counted from the call) sees
   2.45 MB, under it: the budget check does not see the copies nor the
   previous graph.
   With `capture_batch=4` (lazy + dropout row) the copies are made at three
   consecutive updates (steps 0-2), not one: the plan is made again after the
   runner's "measured peak over the budget" correction, and a new plan starts
   its probation afresh. (Since 2026-12-05, night: a plan made again for a
   correction continues its structure's probation (`Program.probation`), and
   the copies a step counts are no part of the correction; see
   `tests/test_first_step.py::test_parameters_saved_on_probation_are_no_correction`.)
2. **Chainer's DCGAN example, `dis` applied** (steps 1 and 2 above 1.0x):
   the same copies of the discriminator's parameters (22.4 MiB) while a plan
   is on probation. Before 437eddc the hook of each of the two live `dis`
   graphs (real and fake batch) made its own copy (44.7 MiB after the second
   update, 1.24x); now the live iterations share one copy per parameter
   (1.12x at step 2 in this run). From step 3 the plan, re-planned after the
   runner's own "measured peak over the budget" correction, drops nothing,
   and the copies stop (1.00x).
3. **The first planned call of a signature plans inside the call**, and the
   planner's arrays count in that step. MemoryMeter around
   `Recompute._plan_pending`: NStepLSTM row, 3.61 MiB and 2.92 MiB above its
   start (the first planned call of each of the two alternating signatures,
   steps 2 and 3, measured 3.68 / 2.95 MiB against 0.12 MiB plain); WGAN-GP
   loss Link (72 functions), 1.40 MiB (step 1, 1.78 against 0.51 MiB);
   Chainer's DCGAN example (dis), 0.26 MiB. A fixed cost per planned
   structure that dominates on tiny models.
4. **The DCGAN-updater rows with `dis` applied, at every step** (1.06x of
   the small GAN on the last step; 1.21x before 437eddc): the
   discriminator's graph of the fake batch is backpropagated again after
   `opt_dis.update()`, so its parameters are copied before each update
   (`multi_backward` plans always are). Before 437eddc the hooks of the real
   and the fake batch's graphs each copied the 12 parameters (24 arrays,
   147 KiB); now they share one copy (12 arrays, 73.5 KiB). That copy is
   still more than the plan's drops save on this toy (40 KiB of leaky_relu
   outputs), and the real batch's graph, never backpropagated again, keeps
   it alive as long as the fake one does.
"""


API_BEHAVIOUR = {
    "test_ever_changing_structure_falls_back_to_plain":
        "10 single calls (MemoryMeter around call + backward), each against plain Chainer; the "
        "test asserts the applied peak <= plain + 1 KiB on every call",
    "test_nested_apply": "inner runner passes through inside the outer plan (inner "
                         "last_stats stays None, no plans of its own)",
    "test_pickle_applied_model": "pickle.loads(pickle.dumps((model, opt))) gives a model with "
                                 "a runner of its own (same options, no plans), which re-plans "
                                 "and trains on",
    "test_trainer_snapshot_and_load_npz": "extensions.snapshot + serializers.load_npz into a "
                                          "new applied Trainer, trains on",
    "test_copy_and_deepcopy_get_their_own_plans": "model.copy() and copy.deepcopy(model) each "
                                                  "get a runner of their own; the original's "
                                                  "plans untouched",
}


def write_md(rows: List[Dict[str, Any]], path: str, meta: Dict[str, Any]) -> None:
    lines = [
        "# Issue 7's patterns: plain Chainer against `apply()`, per pattern",
        "",
        f"Command: `{meta['command']}` ({meta['date']}, commit {meta['commit']}"
        + (f" with uncommitted changes in the working tree ({len([x for x in meta['dirty'] if x])} "
           f"tracked files, listed in patterns.json)" if any(meta['dirty']) else "")
        + f", {meta['machine']}; Python {meta['python']}, Chainer {meta['chainer']}, "
        f"NumPy {meta['numpy']}; {meta['seconds']:.0f} s). Raw data: "
        "[patterns.json](patterns.json).",
        "",
        "## Protocol",
        "",
        "- **Scenarios.** Each row runs the regression test's own scenario: the test "
        "function of tests/test_real_training.py, called with its parameters and its own "
        "assertions (column *test outcome*), or Chainer v7.8.1's example script through "
        "tests/chainer_examples/harness.py (`compare_variant(..., budget='least')` at the "
        "default test run's sizes, `size='light'`, with 5 optimizer steps instead of 3 "
        "(`--example-steps`), so that the last step is past the transients; seeded random "
        "data of the real shapes). The examples plan with apply's default cost model "
        "(measured times), so the number of dropped functions can differ from run to run. "
        "Nothing is reimplemented, except the EverChanging row (the test's model in the "
        "test module's `train_steps` loop, 10 steps) and one infeasible-budget message "
        "reproduced to quote it.",
        "- **Budgets** are the tests': `budget='least'`, `cost='flops'`, scope `total` "
        "(apply's default), or scope `activations` where the test uses it (the predicted "
        "column says which). Examples: `apply(link, budget='least')`, nothing else.",
        "- **Bit-identical**: every record of the plain run equals the applied run's "
        "(dtype, shape and raw bytes; NumPy's and Python's RNG state field by field). Records "
        "are taken after every backward and every update (tests) or after every backward, "
        "every iteration and at the end (examples). Keys per record: loss and reported "
        "values, every gradient, parameter, persistent (BatchNorm statistics, N), link state "
        "(LSTM h/c, kept Variables, Python counters), update-rule state and `t`, global RNG "
        "states. *n records x k keys* is the plain run's count; a row over several runs "
        "(seeds, parameters) says how many were identical.",
        "- **Path at last step**: `chainer_recompute.runner_of(model).last_stats` of each "
        "applied runner at the last record of the run (examples: at the last backward): "
        "`planned` (followed a plan; dropped/functions shown), `recorded` (ran plainly "
        "while recording a new structure), `mismatch` (left its plan mid-iteration, kept "
        "what it had not released), `plain` (fallen back to plain Chainer).",
        "- **Peak**: `MemoryMeter` (tracemalloc, NumPy arrays only) started before the "
        "scenario builds anything, in the same process, plain run then applied run. Between "
        "two consecutive records a nested `MemoryMeter` measures the window's peak; the bytes "
        "that taking the records left allocated are subtracted. The step's peak is the "
        "largest window of the last optimizer step that ends at a record taken right after a "
        "backward (forward + backward; it includes the previous iteration's graph where the "
        "loop still holds it, and the parameters, gradients, optimizer state), or the whole "
        "step where the scenario records only after its update (the shuffling-iterator and "
        "Trainer rows). Batches made before the scenario starts (most tests make them in the "
        "test function) are not counted, in either run.",
        "- **Predicted**: the plan's `predicted_peak_bytes` at that step (only where the path "
        "is `planned`). Scope `total` predicts the whole iteration (parameters, gradients, "
        "optimizer state, inputs, activations, temporaries), comparable with the measured "
        "peak; scope `activations` is the paper's model (activations and their gradients "
        "only), not comparable with it.",
        "- API rows (nested apply, pickling, snapshots, copies, the infeasible-budget "
        "message) report the observed behaviour instead of memory.",
        "",
        "## Table",
        "",
    ]
    lines += table_rows(rows)
    bad = []
    for i, r in enumerate(rows, 1):
        comps = [r] if r.get("variant") else (r.get("compares") or [])
        notok = [c for c in comps if not c["identical"]]
        failed = not r.get("variant") and not r.get("test_outcome", "passed").startswith("passed")
        if notok or failed:
            bad.append((i, r, notok))
    lines += ["", "## Not identical, crashed, or the test's assertions failed", ""]
    if not bad:
        lines.append("None: every row is bit-identical and every test's own assertions held.")
    for i, r, notok in bad:
        lines.append(f"- row {i} ({r['pattern']}): test outcome `{r.get('test_outcome')}`")
        for c in notok:
            lines.append("  ```")
            lines.append("  " + str(c.get("first_difference") or c.get("report")
                                    or c.get("crash")).replace("\n", "\n  "))
            lines.append("  ```")
    last_over = []
    for i, r in enumerate(rows, 1):
        comps = [r] if r.get("variant") else (r.get("compares") or [])
        if r["kind"] != "memory" or not comps:
            continue
        c = comps[-1]
        pp, ap = (c.get("plain_peak") or {}).get("peak"), (c.get("applied_peak") or {}).get("peak")
        if pp and ap and ap > 1.01 * pp:
            last_over.append(f"{i} ({ap / pp:.2f}x)")
    lines += ["", "On the last step, the applied peak is more than 1% above plain Chainer's in "
              "rows " + (", ".join(last_over) if last_over else "none") + "."]
    lines += ["", "## Steps where the applied run's measured peak is above plain Chainer's", "",
              "Every step of every row (not only the last) whose applied peak is more than 1% "
              "above the plain run's, with each runner's path at that step.", ""]
    n_over = 0
    for i, r in enumerate(rows, 1):
        comps = [r] if r.get("variant") else (r.get("compares") or [])
        if r["kind"] != "memory":
            continue
        for c in comps[-1:]:  # several runs (seeds): the last one
            for x in c.get("per_step") or []:
                if x["plain"] and x["applied"] > 1.01 * x["plain"]:
                    n_over += 1
                    paths = ", ".join(f"{n}: {p}" for n, p in sorted(x["paths"].items()))
                    lines.append(f"- row {i} ({r['pattern']}), step {x['step']}: "
                                 f"{mib(x['applied'])} vs {mib(x['plain'])} MiB "
                                 f"({x['applied'] / x['plain']:.3f}); {paths}")
    if not n_over:
        lines.append("None.")
    lines += ["", "## Paths over the run", "",
              "Each applied runner's `last_stats.path` at every record (r = recorded, "
              "P = planned, m = mismatch, p = plain, - = not called yet).", ""]
    abbrev = {"recorded": "r", "planned": "P", "mismatch": "m", "plain": "p", "None": "-"}
    for i, r in enumerate(rows, 1):
        comps = [r] if r.get("variant") else (r.get("compares") or [])
        if not comps:
            continue
        c = comps[-1]
        for name, rr in c.get("runners", {}).items():
            seq = " ".join(abbrev.get(p.split(": ")[-1], p.split(": ")[-1]) for p in rr["paths"])
            lines.append(f"- row {i}, {name}: {seq}")
    lines += ["", NOTES]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def example_rows(size: str, steps: Optional[int] = None,
                 only: Optional[str] = None) -> List[Dict[str, Any]]:
    size = _size_name(size, steps)
    rows = []
    for v in harness.VARIANTS:
        if only and only not in f"examples/{v} ({size})":
            continue
        print(f"[example] {v} ...", flush=True)
        try:
            r = run_example_variant(v, size)
        except Exception as e:  # noqa: BLE001
            r = {"variant": v, "identical": False, "crash": repr(e), "runners": {},
                 "report": traceback.format_exc()}
        r.update(group="Chainer example", pattern=f"examples/{v} ({size})", kind="memory",
                 test="tests/test_chainer_examples.py::test_example_bit_identical")
        print("   ", r.get("report", "").splitlines()[0] if r.get("report") else r, flush=True)
        rows.append(r)
    return rows


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, type):
        return x.__name__
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    return repr(x)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="run only the patterns whose name contains this")
    ap.add_argument("--no-examples", action="store_true")
    ap.add_argument("--size", default="light", choices=["light", "full"],
                    help="the examples' size (harness.SIZES)")
    ap.add_argument("--example-steps", type=int, default=5,
                    help="optimizer steps of each example run (the size's batch and widths; "
                         "0: the size's own, 3)")
    ap.add_argument("--out", default=os.path.join(HERE, "patterns"))
    ap.add_argument("--from-json", help="only write the .md again from this patterns.json")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        write_md(data["rows"], args.out + ".md", data["meta"])
        return 0
    logging.getLogger("chainer_recompute").setLevel(logging.WARNING)
    t0 = time.perf_counter()
    rows = []
    for spec in pattern_specs():
        if args.only and args.only not in spec["pattern"]:
            continue
        print(f"[pattern] {spec['pattern']} ...", flush=True)
        row = run_pattern(spec)
        if spec["test"] in API_BEHAVIOUR:
            row["behaviour"] = API_BEHAVIOUR[spec["test"]]
        print(f"    {row['test_outcome'][:200]}; identical: "
              f"{[c['identical'] for c in row['compares']]} ({row['seconds']} s)", flush=True)
        rows.append(row)
    if not args.no_examples:
        rows += example_rows(args.size, args.example_steps or None, args.only)
    meta = {
        "command": " ".join([".venv/bin/python", "experiments/patterns.py"]
                            + (argv if argv is not None else sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "dirty": subprocess.run(["git", "status", "--short", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.split("\n"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(), "chainer": chainer.__version__,
        "numpy": np.__version__, "seconds": time.perf_counter() - t0,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(_jsonable({"meta": meta, "rows": rows}), f, indent=1)
    write_md(rows, args.out + ".md", meta)
    print("\n".join(table_rows(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
