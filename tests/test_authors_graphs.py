"""The authors' four graphs with the paper cost model, against TARGETS.md."""
from __future__ import annotations

from pathlib import Path

import pytest

from chainer_recompute.core.lower_sets import count_lower_sets
from chainer_recompute.core.search import least_feasible_budget
from chainer_recompute.core.planner import solve

GRAPHS = Path(__file__).resolve().parents[1].parent / "shared" / "graphs"

# name: (#V, #lower sets, authors' approx GB, authors' exact GB)
AUTHORS = {
    "vgg19": (46, 47, 2.114, 2.114),
    "resnet50": (176, 241, 1.311, 1.290),
    "densenet": (568, 569, 1.685, 1.685),
    "unet": (60, 331, 5.819, 5.726),
}


def load(name: str):
    path = GRAPHS / f"cg_{name}.txt"
    if not path.exists():
        pytest.skip(f"the authors' graph {path} is absent: put their cg_*.txt files in {GRAPHS}")
    from chainer_recompute.core.io import load_authors_graph
    return load_authors_graph(path)


# (densenet, 50 s: with -m slow)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "densenet" else n
                                  for n in sorted(AUTHORS)])
def test_least_budgets_match_authors(name: str) -> None:
    g = load(name)
    n, n_lower, approx_gb, exact_gb = AUTHORS[name]
    assert g.n == n and g.cost_model == "paper"
    assert count_lower_sets(g) == n_lower
    approx = least_feasible_budget(g, "approx", rel_tol=1e-4) / 1e9
    exact = least_feasible_budget(g, "exact", rel_tol=1e-4) / 1e9
    assert exact <= exact_gb + 1e-9          # exhaustive: never worse than theirs
    assert exact <= approx + 1e-9
    assert abs(approx - approx_gb) <= 0.01 * approx_gb  # within 1% of theirs


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "densenet" else n
                                  for n in sorted(AUTHORS)])
def test_approx_fits_the_authors_least_budget(name: str) -> None:
    """Both strategies find a plan at the authors' least approx budget.
    (Solver times: experiments/solver_benchmark.py, not asserted here.)"""
    g = load(name)
    budget = int(AUTHORS[name][2] * 1e9)
    for strategy in ("tc", "mc"):
        p = solve(g, budget, "approx", strategy)
        assert p.feasible and p.predicted_peak_bytes <= budget


@pytest.mark.parametrize("name", sorted(AUTHORS))
def test_mc_not_below_tc_overhead(name: str) -> None:
    g = load(name)
    budget = int(AUTHORS[name][3] * 1e9)
    tc = solve(g, budget, "exact", "tc")
    mc = solve(g, budget, "exact", "mc")
    assert tc.feasible and mc.feasible
    assert mc.overhead >= tc.overhead
    assert mc.n_blocks <= tc.n_blocks


# The least feasible budgets of the exhaustive DPs, exact to the byte (paper
# model); they must not change with the solver's speed.
LEAST_BYTES = {  # name: (approx, exact)
    "vgg19": (2106589184, 2106589184),
    "resnet50": (1310195712, 1258815488),
    "unet": (5784403968, 5545689088),
    "densenet": (1676279808, 1676279808),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "densenet" else n
                                  for n in sorted(LEAST_BYTES)])
def test_least_budgets_unchanged(name: str) -> None:
    from chainer_recompute.core.solvers._dp import numba_available
    g = load(name)
    for engine in ["numpy"] + (["numba"] if numba_available() else []):
        approx, exact = LEAST_BYTES[name]
        assert least_feasible_budget(g, "approx", engine=engine) == approx
        assert least_feasible_budget(g, "exact", engine=engine) == exact
        # Same optimum from both engines at the least budget and with slack.
        for budget in (exact, exact * 5 // 4):
            for strategy in ("tc", "mc"):
                ref = solve(g, budget, "exact", strategy, engine="numpy")
                assert solve(g, budget, "exact", strategy, engine=engine).overhead == ref.overhead
