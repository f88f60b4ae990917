"""Lower sets: enumeration, counts, closures, boundary, A and B."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from chainer_recompute.core.errors import LowerSetExplosionError
from chainer_recompute.core.graph import Graph
from chainer_recompute.core.lower_sets import (LowerSetFamily, above, ancestor_closures, beside,
                                          boundary, count_lower_sets, enumerate_lower_sets,
                                          full_mask, is_lower_set, mask_to_set, set_to_mask)

GRAPHS = Path(__file__).resolve().parents[1].parent / "shared" / "graphs"


def chain(n: int) -> Graph:
    return Graph.from_edges([1] * n, [(i, i + 1) for i in range(n - 1)])


def diamond() -> Graph:
    # 0 -> 1 -> 3, 0 -> 2 -> 3
    return Graph.from_edges([1, 2, 3, 4], [(0, 1), (0, 2), (1, 3), (2, 3)])


def test_mask_roundtrip() -> None:
    assert set_to_mask([0, 3, 64]) == (1 | 8 | (1 << 64))
    assert mask_to_set(set_to_mask({0, 3, 64, 130})) == frozenset({0, 3, 64, 130})
    assert mask_to_set(0) == frozenset()


@pytest.mark.parametrize("n", [1, 2, 5, 70, 130])
def test_chain_has_n_plus_one(n: int) -> None:
    assert count_lower_sets(chain(n)) == n + 1
    sets = enumerate_lower_sets(chain(n))
    assert [sorted(mask_to_set(m)) for m in sets] == [list(range(k)) for k in range(n + 1)]


def test_diamond_complete() -> None:
    got = [sorted(mask_to_set(m)) for m in enumerate_lower_sets(diamond())]
    assert got == [[], [0], [0, 1], [0, 2], [0, 1, 2], [0, 1, 2, 3]]


def test_antichain_is_power_set() -> None:
    g = Graph.from_edges([1] * 6, [])
    assert count_lower_sets(g) == 64


def test_enumeration_matches_definition() -> None:
    g = Graph.from_edges([1, 2, 3, 4, 5, 6], [(0, 2), (1, 2), (2, 4), (3, 4), (1, 5)])
    brute = {set_to_mask(s) for r in range(7) for s in itertools.combinations(range(6), r)
             if all(set(g.preds[v]) <= set(s) for v in s)}
    assert set(enumerate_lower_sets(g)) == brute
    assert all(is_lower_set(g, m) for m in brute)
    assert not is_lower_set(g, {2})


def test_ancestor_closures() -> None:
    g = diamond()
    fam = [sorted(mask_to_set(m)) for m in ancestor_closures(g)]
    assert fam == [[], [0], [0, 1], [0, 2], [0, 1, 2, 3]]
    # subsets before supersets
    masks = ancestor_closures(g)
    for i, a in enumerate(masks):
        for b in masks[:i]:
            assert not (a & b == a and a != b)


def test_boundary_above_beside() -> None:
    g = diamond()
    assert mask_to_set(boundary(g, {0, 1})) == {0, 1}
    assert mask_to_set(above(g, {0, 1})) == {2, 3}
    assert mask_to_set(beside(g, {0, 1})) == {2}
    assert boundary(g, full_mask(g)) == 0 and above(g, full_mask(g)) == 0


def test_family_quantities() -> None:
    g = diamond()
    fam = LowerSetFamily.all(g)
    for i, m in enumerate(fam.masks()):
        s = mask_to_set(m)
        assert fam.mem_bytes[i] == sum(g.node_bytes[v] for v in s)
        assert fam.size[i] == len(s)
        a, b = mask_to_set(above(g, m)), mask_to_set(beside(g, m))
        assert fam.back_bytes[i] == sum(g.node_bytes[v] for v in a) + sum(g.node_bytes[v] for v in b)
    assert len(fam.sets()) == 6


def test_explosion() -> None:
    g = Graph.from_edges([1] * 30, [])
    with pytest.raises(LowerSetExplosionError, match="approx"):
        count_lower_sets(g, limit=10_000)
    with pytest.raises(LowerSetExplosionError):
        enumerate_lower_sets(g, max_lower_sets=1000)


@pytest.mark.parametrize("name, n, count", [("vgg19", 46, 47), ("resnet50", 176, 241),
                                            ("unet", 60, 331), ("densenet", 568, 569)])
def test_authors_graph_counts(name: str, n: int, count: int) -> None:
    path = GRAPHS / f"cg_{name}.txt"
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared graphs are not checked out)")
    from chainer_recompute.core.io import load_authors_graph
    g = load_authors_graph(path)
    assert g.n == n
    assert count_lower_sets(g) == count


FAMILY_ARRAYS = ["words", "size", "mem_bytes", "boundary_words", "boundary_time",
                 "boundary_bytes", "back_bytes", "above_words", "beside_words", "block_bytes"]


def _random_graph(rng, n: int, measured: bool) -> Graph:
    edges = set()
    for v in range(1, n):
        for _ in range(rng.randint(0, 3)):
            edges.add((rng.randrange(max(0, v - 6), v), v))
    sizes = [rng.randint(1, 50) for _ in range(n)]
    return Graph.from_edges(sizes, sorted(edges),
                            costs=[rng.random() for _ in range(n)] if measured else None)


@pytest.mark.parametrize("seed", range(40))
def test_compiled_family_equals_numpy(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The family built by the compiled kernels (once the DP's compiled
    engine is loaded) has the NumPy code's arrays, in the same order; the
    explosion error is the same."""
    import random

    from chainer_recompute.core import lower_sets
    from chainer_recompute.core.solvers._dp import _load_kernels, numba_available
    if not numba_available():
        pytest.skip("numba is not installed (the 'fast' extra)")
    rng = random.Random(seed)
    g = _random_graph(rng, rng.choice([3, 20, 63, 64, 65, 130]), measured=seed % 2 == 1)
    kn = _load_kernels()
    got = {}
    for label, kernels in (("numpy", None), ("compiled", kn)):
        monkeypatch.setattr(lower_sets, "_KERNELS", kernels)
        try:
            fams = (LowerSetFamily.all(g, 50_000), LowerSetFamily.ancestor_closures(g))
        except LowerSetExplosionError as e:
            fams = (str(e), LowerSetFamily.ancestor_closures(g))
        got[label] = fams
    for a, b in zip(got["numpy"], got["compiled"]):
        if isinstance(a, str):
            assert a == b
            continue
        for f in FAMILY_ARRAYS:
            x, y = getattr(a, f), getattr(b, f)
            assert x.dtype == y.dtype and x.shape == y.shape and (x == y).all(), f


def _unrolled(steps: int, metric: bool) -> Graph:
    """An unrolled recurrence: per step a cell (small state), an output
    (large), its loss added to the running one, and with ``metric`` a
    per-step metric of the output that no backward needs (``F.accuracy``
    beside ``F.softmax_cross_entropy``). Its backward runs every node but
    the metrics, latest first."""
    sizes, edges, metrics = [], [], []
    h = total = None
    for _ in range(steps):
        cell = len(sizes)
        sizes.append(64)
        if h is not None:
            edges.append((h, cell))
        out = len(sizes)
        sizes.append(1024)
        edges.append((cell, out))
        loss = len(sizes)
        sizes.append(4)
        edges.append((out, loss))
        if metric:
            metrics.append(len(sizes))
            sizes.append(4)
            edges.append((out, metrics[-1]))
        if total is not None:
            edges.append((total, len(sizes)))
            edges.append((loss, len(sizes)))
            sizes.append(4)
            total = len(sizes) - 1
        else:
            total = loss
        h = cell
    g = Graph.from_edges(sizes, edges)
    g.backward_order = tuple(v for v in range(g.n - 1, -1, -1) if v not in metrics)
    return g


def test_a_metric_no_backward_needs_keeps_nothing() -> None:
    """A per-step metric read after every later ancestor closure made the
    outputs it reads boundaries of every chain of the approximate family,
    kept through the forward; closed under the nodes no backward needs, the
    family plans the graph as if the metrics were not there, but for their
    own few bytes (12 x 4; before: 13,776 B against 2,944 B)."""
    from chainer_recompute.core.search import least_feasible_budget
    from chainer_recompute.core.lower_sets import with_forward_only
    with_metric, without = _unrolled(12, True), _unrolled(12, False)
    assert len(with_metric.forward_only) == 12 and not without.forward_only
    assert with_forward_only(without, ancestor_closures(without)) == []
    least = least_feasible_budget(without, solver="approx")
    assert least <= least_feasible_budget(with_metric, solver="approx") <= least + 12 * 4
    # the old family (without the closed sets) kept the outputs the metrics read
    family = LowerSetFamily.ancestor_closures(with_metric)
    closed = set(with_forward_only(with_metric, ancestor_closures(with_metric)))
    assert closed and closed <= set(family.masks())
