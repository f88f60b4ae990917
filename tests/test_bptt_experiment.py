"""experiments/bptt.py's rounds timed without the memory meter: no tracing
while they run, their times kept beside the measured rounds'."""
from __future__ import annotations

import argparse
import sys
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import bptt as B  # noqa: E402


def test_untraced_rounds_time_every_method_with_no_tracing():
    args = argparse.Namespace(vocab=20, units=8, dropout=0.0, batch=2)
    data = np.random.RandomState(0).randint(0, 20, (5, 2)).astype(np.int32)
    model, opt = B.make(args)
    plain = B.plain_fn(model)
    seen = []

    def traced_now(xs, ts):
        seen.append(tracemalloc.is_tracing())
        return plain(xs, ts)

    methods = {"plain": lambda: B.iterate(plain, model, opt, data),
               "probe": lambda: B.iterate(traced_now, model, opt, data)}
    measured = B.interleaved(methods, 2)
    assert seen == [True, True]  # the measured rounds run in the meter
    assert all(r["peak_bytes"] > 0 for r in measured["probe"])
    tracemalloc.start()  # a worker traces from its start
    try:
        quiet = B.untraced_rounds(methods, 3)
        assert not tracemalloc.is_tracing()
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
    assert seen[2:] == [False] * 3
    assert [r["peak_bytes"] for r in quiet["probe"]] == [None] * 3
    row = B.summary(measured["probe"])
    B.with_untraced(row, quiet["probe"])
    assert len(row["untraced_times_s"]) == len(row["untraced_plain_times_s"]) == 3
    ratios = [a / b for a, b in zip(row["untraced_times_s"], row["untraced_plain_times_s"])]
    assert B.paired_untraced(row) == sorted(ratios)[1]
    assert B.paired_untraced(B.summary(measured["probe"])) is None
    assert B.untraced_rounds(methods, 0) == {"plain": [], "probe": []}
    assert B._TRACED  # the next rounds are measured again
