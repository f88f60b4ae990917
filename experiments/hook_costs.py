#!/usr/bin/env python
"""Where a planned step's time goes beyond plain Chainer's, by parts of the
executor's per-function work switched off: an attribution, not a benchmark
of correct runs.

The 32-unit unroll of experiments/bptt.py (Chainer's PTB LSTM, vocabulary
100, batch 8, t = 30, no dropout) under ``cr.apply()`` at ``--budget``
(default 434,256 B, the 25-slot row of experiments/nested.md; with
``--large`` the 256-unit one, vocabulary 1000, batch 32, default
18,395,126 B, a nested plan), or with
``--nothing-dropped`` at a budget above plain's with the executor's hooks
kept on (``plain_when_nothing_dropped = False``). One model; around every
other step the variant's patches are set, and every step runs right after
a plain step of the same model, whose time it is compared with. The
variants' order is rotated from round to round. Printed: the median and
the interquartile mean of each variant's extra milliseconds over plain,
and beside them the chain policies' (``ChainRecompute``, MSM and ISM at
the same budget) in the same process, with what ``apply()`` would need
to be within 5% of the fastest. Steps are timed as experiments/bptt.py
times them, inside its memory meter (tracemalloc, which on NumPy tracks
every array the step allocates and frees), or with ``--untraced`` without
it, as a training loop runs.

Variants (all but ``as_is`` switch work off that a correct run needs where
something is dropped: their gradients and memory are not checked; the two
marked run only with ``--nothing-dropped``, where nothing is regenerated):

- ``as_is``: the executor as it is;
- ``no_checks``: a call is not checked against its planned node (before
  it runs, nor after its inputs are mapped);
- ``lean_forward``: the forward's hooks only make each call's record
  with the plan's array ids and hook the function for its backward (no
  mapping of nodes to ids, no records of arrays, no checks, no wrapper,
  no pins or releases): the least a forward hook per function costs
  (``--nothing-dropped``);
- ``no_backward_driver``: the executor's work before and after each
  function's backward (regeneration, releases, the reach) is not done
  (``--nothing-dropped``);
- ``no_releases_after_backward``: only the releases after each
  function's backward are not done.

With ``--parts`` it times the executor as it is instead, untraced: each
step's wall time inside the executor's methods (inclusive: a method's
figure contains the methods it calls), among them ``_run_forward``, the
function forwards that regeneration runs, which is all the plan's
recomputation costs; the rest of the extra time over plain is the
executor's own work. The timers add about a microsecond per call.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python experiments/hook_costs.py --rounds 40
    OPENBLAS_NUM_THREADS=1 .venv/bin/python experiments/hook_costs.py --nothing-dropped --rounds 40
    OPENBLAS_NUM_THREADS=1 .venv/bin/python experiments/hook_costs.py --untraced --rounds 40
    OPENBLAS_NUM_THREADS=1 .venv/bin/python experiments/hook_costs.py --parts --rounds 20
    OPENBLAS_NUM_THREADS=1 .venv/bin/python experiments/hook_costs.py --large --untraced --variants as_is --rounds 30
"""
import argparse
import collections
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import chainer_recompute as cr  # noqa: E402
import bptt as B  # noqa: E402
from chainer_recompute.runtime import bptt as chain_runtime  # noqa: E402
from chainer_recompute.runtime import executor as E  # noqa: E402
from chainer_recompute.runtime.capture import recorder as R  # noqa: E402
from chainer_recompute.runtime.runner.recompute import Recompute  # noqa: E402


def _nothing(*args, **kwargs):
    return None


def _yes(*args, **kwargs):
    return True


# (the executor's hook is what Chainer calls: ``self`` is an IterationHook)
def _lean_pre(self, function, in_data):
    rec = self.recorder
    rec._depth += 1
    if rec._depth > 1 or rec.forward_done:
        rec._top.append(None)
        return
    call = R.Call(len(rec.calls), function, in_data, (), "")
    rec.calls.append(call)
    rec.index_of[id(function)] = call.index
    rec._top.append(call)


def _lean_post(self, function, in_data):
    rec = self.recorder
    rec._depth -= 1
    call = rec._top.pop()
    if call is None:
        return
    function.local_function_hooks[self.name] = self
    node = self.program.graph.nodes[call.index]
    call.in_ids, call.out_ids = node.inputs, node.outputs


def _lean_finish(self, result=None):
    self.forward_done = True
    self.returned = []
    self.arrays = list(self._events().program.graph.arrays)


VARIANTS = {
    "as_is": [],
    "no_checks": [(E, "_matches_before", _yes), (E, "_matches_after", _yes)],
    "lean_forward": [(E.IterationHook, "forward_preprocess", _lean_pre),
                     (E.IterationHook, "forward_postprocess", _lean_post),
                     (R.Recorder, "_map_pending", _nothing), (R.Recorder, "finish", _lean_finish)],
    "no_backward_driver": [(E.IterationHook, "backward_preprocess", _nothing),
                           (E.IterationHook, "backward_postprocess", _nothing)],
    "no_releases_after_backward": [(E.IterationHook, "after_backward", _nothing)],
}


#: variants that leave out work a plan that drops something cannot run without
NOTHING_DROPPED_ONLY = ("lean_forward", "no_backward_driver")


#: the methods ``--parts`` times (the hook's, then the recorder's)
PARTS = (
    (E.IterationHook, ("forward_preprocess", "forward_postprocess", "backward_preprocess",
                       "backward_postprocess", "finish", "_follow", "_pin", "after_mapping",
                       "_regenerate", "_run_forward", "_check_sources", "after_backward",
                       "_regenerable", "_release", "_extend_reach")),
    (R.Recorder, ("_map_pending", "_describe_as_planned", "_wrap")),
)


@contextlib.contextmanager
def patched(patches):
    """``(owner, attribute, value)`` set for the block, the originals put
    back after."""
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    for owner, attr, value in patches:
        setattr(owner, attr, value)
    try:
        yield
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)


def timed_parts(step, plain_step, rounds):
    """``step()``'s extra seconds over ``plain_step()`` and the seconds
    inside each of :data:`PARTS`, per round (untraced)."""
    spent, calls = collections.Counter(), collections.Counter()

    def timed(method, name):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
                calls[name] += 1
        return run

    timers = [(owner, name, timed(getattr(owner, name), name))
              for owner, names in PARTS for name in names]
    extra, per = [], collections.defaultdict(list)
    with patched(timers), B.untraced():
        for _ in range(rounds):
            p = plain_step()
            spent.clear()
            calls.clear()
            extra.append(step() - p)
            for name, s in spent.items():
                per[name].append(s)
    return extra, per, dict(calls)


def summary(extra):
    d = sorted(extra)
    q = len(d) // 4
    return statistics.median(d), statistics.mean(d[q:len(d) - q] or d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int,
                    help="bytes (default 434,256; with --large 18,395,126)")
    ap.add_argument("--large", action="store_true",
                    help="the 256-unit unroll (vocabulary 1000, batch 32)")
    ap.add_argument("--nothing-dropped", action="store_true",
                    help="plan above plain's step (3,000,000 B; with --large 64,000,000 B): "
                         "nothing dropped, the hooks kept on")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--untraced", action="store_true",
                    help="time the steps without experiments/bptt.py's memory meter")
    ap.add_argument("--parts", action="store_true",
                    help="time the executor's methods inside each step instead (untraced)")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                    help="default: every variant that runs at the budget")
    args = ap.parse_args()
    if args.variants is None:
        args.variants = [v for v in VARIANTS
                         if args.nothing_dropped or v not in NOTHING_DROPPED_ONLY]
    wrong = [v for v in args.variants if v in NOTHING_DROPPED_ONLY and not args.nothing_dropped]
    if wrong:
        ap.error(f"{', '.join(wrong)} run only with --nothing-dropped (they leave out work "
                 f"that regeneration needs)")
    model_args = (argparse.Namespace(vocab=1000, units=256, dropout=0.0, batch=32) if args.large
                  else argparse.Namespace(vocab=100, units=32, dropout=0.0, batch=8))
    if args.budget is None:
        args.budget = 18395126 if args.large else 434256
    data = np.random.RandomState(1).randint(0, model_args.vocab,
                                            (31, model_args.batch)).astype(np.int32)
    model, opt = B.make(model_args)
    plain = B.plain_fn(model)
    B.iterate(plain, model, opt, data)
    # (above plain's whole step: 0.9 MB at the small size, 38 MB at the large)
    budget = (64000000 if args.large else 3000000) if args.nothing_dropped else args.budget
    if args.nothing_dropped:
        Recompute.plain_when_nothing_dropped = False
    unrolled = B.Unrolled(model)
    cr.apply(unrolled, budget=budget, verbose=False)
    for _ in range(4):  # recorded, planned, then followed
        B.iterate(lambda xs, ts: unrolled(xs, ts), model, opt, data)
    stats = cr.runner_of(unrolled).last_stats
    if args.parts:
        extra, per, calls = timed_parts(
            lambda: B.iterate(lambda xs, ts: unrolled(xs, ts), model, opt, data)["time_s"],
            lambda: B.iterate(plain, model, opt, data)["time_s"], args.rounds)
        print(f"budget {budget} B; the plan drops {stats.n_dropped} of {stats.n_nodes} functions; "
              f"extra over plain {1e3 * statistics.median(extra):.2f} ms a step (median, untraced, "
              f"timers on); load {B.load()}")
        print(f"{'inside (inclusive)':28s} {'ms a step':>10s} {'calls':>6s}")
        for name in sorted(per, key=lambda n: -statistics.median(per[n])):
            print(f"{name:28s} {1e3 * statistics.median(per[name]):10.2f} {calls[name]:6d}")
        return
    methods = {v: VARIANTS[v] for v in args.variants}
    chains = {}
    if not args.nothing_dropped:
        for policy in ("msm", "ism"):
            runner = chain_runtime.ChainRecompute(model, policy=policy, budget=budget)
            model.predictor.reset_state()
            runner.predict(data[:-1], data[1:])
            B.iterate(runner, model, opt, data)
            chains[policy] = runner
    names = list(methods) + list(chains)
    timing = B.untraced() if args.untraced else contextlib.nullcontext()
    extra = {n: [] for n in names}
    plain_times = []
    with timing:
        for r in range(args.rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                if name in chains:
                    t = B.iterate(chains[name], model, opt, data)["time_s"]
                else:
                    with patched(methods[name]):
                        t = B.iterate(lambda xs, ts: unrolled(xs, ts), model, opt,
                                      data)["time_s"]
                p = B.iterate(plain, model, opt, data)["time_s"]
                plain_times.append(p)
                extra[name].append((t - p) * 1e3)
    base = statistics.median(plain_times) * 1e3
    print(f"budget {budget} B; the plan drops {stats.n_dropped} of {stats.n_nodes} functions; "
          f"plain {base:.1f} ms a step (median, {'untraced' if args.untraced else 'traced'}); "
          f"load {B.load()}")
    print(f"{'':28s} {'extra ms: median':>17s} {'iq mean':>8s}")
    for name in names:
        med, iqm = summary(extra[name])
        print(f"{name:28s} {med:17.2f} {iqm:8.2f}")
    if chains:
        fastest = min(summary(extra[c])[0] for c in chains)
        need = (base + fastest) * 1.05 - base
        steps = {n: base + summary(extra[n])[0] for n in names}
        print(f"within 5% of the fastest chain policy: at most {need:.2f} ms over plain; "
              + ", ".join(f"{n} {steps[n] / (base + fastest):.3f}x its time" for n in methods))


if __name__ == "__main__":
    main()
