"""The pure-core parts of experiments/reproduce.py that make published
figures: the runtime sweep's largest batches and simulated curves
on a small captured graph."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import reproduce  # noqa: E402

from chainer_recompute.core.io import load_graph, save_graph  # noqa: E402
from chainer_recompute.core.replay import replay  # noqa: E402
from chainer_recompute.runtime.capture import capture  # noqa: E402


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A convnet recorded at its batch b0 (as ``--sweep`` records its
    network at ``vanilla_batch``), and the budget B at which plain
    backprop's largest batch is b0 (halfway to b0 + 1, as ``--sweep``)."""
    from chainer_recompute.models.small import SMALL_MODELS
    link, args = SMALL_MODELS["convnet"](0)
    g = capture(link, *args, backward=True, cost_model="flops")
    path = tmp_path_factory.mktemp("sweep") / "convnet.json"
    save_graph(g, path)
    b0 = g.batch_size
    p0 = replay(g.scale_batch(b0), None).peak_bytes
    p1 = replay(g.scale_batch(b0 + 1), None).peak_bytes
    return str(path), b0, (p0 + p1) // 2


@pytest.fixture(scope="module")
def searched(recorded):
    """``reproduce.largest_batch`` of each method on the recorded net
    (searched once for both tests: the nested search is the slow one)."""
    path, _, budget = recorded
    return {m: reproduce.largest_batch(path, m, budget)
            for m in ("vanilla", "chen", "approx-tc", "approx-mc", "exact-tc", "nested-tc")}


@pytest.mark.slow  # 14 s
def test_largest_batch_is_the_boundary_of_what_fits(recorded, searched):
    path, b0, budget = recorded
    g0 = load_graph(path)
    van = searched["vanilla"]["largest_batch"]
    assert van == b0  # B is defined by vanilla's largest batch
    largest = {}
    for method in ("chen", "approx-tc", "approx-mc", "exact-tc", "nested-tc"):
        r = searched[method]
        big = largest[method] = r["largest_batch"]
        assert big >= van, method
        if method == "chen":
            continue
        solver, strategy = reproduce._solver_of(method)
        # it fits at its largest batch and at none of the next two
        assert reproduce._fit_plan(g0.scale_batch(big), solver, strategy, budget) is not None
        for b in (big + 1, big + 2):
            assert reproduce._fit_plan(g0.scale_batch(b), solver, strategy, budget) is None
        assert r["largest_batch_size_dp_formula"] <= big  # the formula over-counts
        assert big > van, method  # recomputation makes room on this net
    # nesting only adds plans below the single-level least
    assert largest["nested-tc"] >= largest["approx-tc"]


def test_simulated_curve_agrees_with_the_largest_batch(recorded, searched):
    path, b0, budget = recorded
    for method in ("vanilla", "approx-tc", "nested-tc"):
        big = searched[method]["largest_batch"]
        rows = reproduce.simulate_method(path, method, budget, list(range(1, big + 3)))["rows"]
        fits = {r["batch"]: r["fits"] for r in rows}
        assert fits[big] and not fits[big + 1], (method, fits)
        if method == "vanilla":
            assert all(r["recompute_share"] == 0 for r in rows)
        else:  # past vanilla's largest batch the plan recomputes something
            assert all(r["recompute_share"] > 0 for r in rows if r["batch"] > b0 and r["fits"])


def test_the_patterns_table_probes_the_infeasible_budget_message_where_it_is_raised():
    """experiments/patterns.py's row for the infeasible-budget message: the
    model's first call raises it (planned from captures before it runs),
    and the figure it prints, passed back, plans."""
    import patterns
    out = patterns.infeasible_probe()
    assert "error" not in out, out
    assert out["figure_bytes"] >= out["least_feasible_bytes"], out
    assert out["pasted_back"] == "accepted, path planned", out


def test_every_patterns_row_calls_its_test_with_the_arguments_it_takes():
    """experiments/patterns.py calls tests/test_real_training.py's test
    functions itself: each row's arguments, with the test's own
    ``parametrize`` cases for the rest, bind to the function's signature
    (a test given a new parameter stays in the table)."""
    import inspect

    import patterns
    checked = 0
    for spec in patterns.pattern_specs():
        if spec["test"] == "ever_changing":
            continue
        fn, cases = patterns.row_cases(spec)
        for kw in cases:
            inspect.signature(fn).bind(**kw)
            checked += 1
    assert checked > 50, checked


def test_chainers_dcgan_discriminator_at_least_holds_no_more_than_plain_chainer():
    """Chainer's DCGAN example (its updater backpropagates the
    discriminator's graph of the fake batch again, for the generator's
    loss, after the discriminator's update) with ``apply()`` on the
    discriminator at ``'least'``, measured as experiments/patterns.py
    measures it: where no release mode fits the budget with the graph held,
    the plan keeps what that later pass reads, as plain Chainer does. It
    released it, and the later pass regenerated it from parameter values
    saved at each update, in no replay: every step 12% over plain Chainer
    (199.1 against 178.5 MiB), for a plan that drops nothing. The first
    step, planned from captures on probation, saved every parameter at its
    update (1.142x plain Chainer's step); it keeps the arrays instead, which
    the plan drops none of."""
    import patterns
    row = patterns.run_example_variant("dcgan-dis", patterns._size_name("light", 5))
    assert row["identical"], row["report"]
    (runner,) = row["runners"].values()
    assert runner["last"]["release_mode"] == "all", runner["last"]
    assert runner["last"]["recomputed_nodes"] == 0, runner["last"]
    steps = row["per_step"]
    assert steps and all(s["applied"] <= 1.01 * s["plain"] for s in steps), steps
