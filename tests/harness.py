"""The train-and-compare harness shared by the tests that train a model
twice from the same seeds, plain Chainer and under ``apply()``, and compare
the two runs step by step (test_step_budget, test_first_step,
test_third_party, test_real_code_patterns, test_unplanned_memory).

- :func:`records`: one step's state as Python bytes (the loss, parameters,
  gradients, optimizer state, persistents, NumPy's random state), so that
  the records are not in the measured NumPy domain.
- :class:`Run`: a run's per-step peaks, records and runner stats.
- :func:`outer_meter`: the meter started before the model is built (so a
  step's absolute peak counts everything the model holds).
- :func:`assert_same_records`: every step's records identical.

test_real_training has a richer scenario harness of its own (``Env``,
``Pair``: labelled snapshots inside a step, several links and optimizers).
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

import chainer

from chainer_recompute.runtime.memory import MemoryMeter


def as_bytes(x: Any) -> Any:
    """An array (or a Variable's) as ``(dtype, shape, bytes)``; anything
    else as it is."""
    if isinstance(x, chainer.Variable):
        x = x.array
    if not isinstance(x, chainer.get_array_types()):
        return x
    return (str(x.dtype), x.shape, x.tobytes())


def records(model: chainer.Link, loss: Any) -> Dict[str, Any]:
    """The state after one step: the loss, each parameter, its gradient,
    its update rule's state and step count, each link's persistents, and
    NumPy's global random state."""
    rec: Dict[str, Any] = {"loss": as_bytes(loss)}
    for path, p in model.namedparams():
        rec["param" + path] = as_bytes(p.array)
        rec["grad" + path] = as_bytes(p.grad)
        if p.update_rule is None:  # (no optimizer: TRPO updates its policy itself)
            continue
        for k, v in sorted((p.update_rule.state or {}).items()):
            rec[f"opt{path}/{k}"] = as_bytes(v)
        rec[f"opt{path}/t"] = p.update_rule.t
    for path, link in model.namedlinks():
        for name in sorted(link._persistent):
            rec[f"persist{path}/{name}"] = as_bytes(getattr(link, name))
    state = np.random.get_state()
    rec["rng"] = (state[1].tobytes(), state[2])
    return rec


class Run:
    """One training run: per step its whole peak, records and runner stats
    (and, where a test measures bytes that are no part of the model's
    iteration, those)."""

    def __init__(self) -> None:
        self.peaks: List[int] = []
        self.records: List[Dict[str, Any]] = []
        self.stats: List[Any] = []
        self.excluded: List[int] = []


@contextlib.contextmanager
def outer_meter() -> Iterator[MemoryMeter]:
    """A meter running around a whole run (started before the model is
    built), stopped at the end whatever happens."""
    outer = MemoryMeter()
    outer.start()
    try:
        yield outer
    finally:
        outer.stop()


def assert_same_records(plain: Run, ours: Run, name: Optional[str] = None,
                        same_keys: bool = False, shown: int = 8) -> None:
    """Every step's records of ``ours`` equal to ``plain``'s (``same_keys``:
    and the same keys, as many steps)."""
    head = f"{name}, " if name else ""
    if same_keys:
        assert len(plain.records) == len(ours.records), (len(plain.records), len(ours.records))
    for k, (a, b) in enumerate(zip(plain.records, ours.records)):
        if same_keys:
            assert a.keys() == b.keys(), f"{head}step {k}: keys differ"
        diff = [key for key in a if a[key] != b.get(key)]
        assert not diff, f"{head}step {k}: differs from plain Chainer in {diff[:shown]}"
