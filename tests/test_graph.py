"""The pure graph model: construction, cost models, export, io."""
import dataclasses
from fractions import Fraction
import json
import subprocess
import sys
from pathlib import Path

import pytest

from chainer_recompute.core.errors import GraphError, GraphFormatError, SchemaVersionError
from chainer_recompute.core.graph import ArrayInfo, Graph, Node, StepFacts
from chainer_recompute.core.io import load_authors_graph, load_graph, save_graph

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = ROOT.parent / "shared" / "graphs"
needs_graphs = pytest.mark.skipif(not GRAPHS.exists(), reason="../shared/graphs not present")


def test_core_imports_without_chainer():
    code = ("import sys; import chainer_recompute as cr; "
            "g = cr.Graph.from_edges([1, 2], [(0, 1)]); cr.solve(g, 100); "
            "assert 'chainer' not in sys.modules, 'chainer was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_from_edges_renumbers_into_topological_order():
    # 0 <- 2 <- 1 given out of order: node "1" must come first.
    g = Graph.from_edges([10, 20, 30], [(1, 2), (2, 0)], costs=[1.0, 2.0, 3.0])
    assert [n.label for n in g.nodes] == ["1", "2", "0"]
    assert list(g.node_bytes) == [20, 30, 10]
    assert list(g.node_cost) == [2.0, 3.0, 1.0]
    assert g.edges == [(0, 1), (1, 2)]
    assert g.cost_model == "measured"


def test_cycle_and_empty_and_bad_edges():
    with pytest.raises(GraphError, match="cycle"):
        Graph.from_edges([1, 1, 1], [(0, 1), (1, 2), (2, 0)])
    with pytest.raises(GraphError, match="empty"):
        Graph.from_edges([], [])
    with pytest.raises(GraphError, match="does not join"):
        Graph.from_edges([1, 1], [(0, 5)])


def test_node_order_is_checked():
    arrays = [ArrayInfo(0, (2,), "float32", 8, "intermediate", 1),
              ArrayInfo(1, (2,), "float32", 8, "output", 0)]
    nodes = [Node(0, "A", inputs=(0,), outputs=(1,)), Node(1, "B", inputs=(), outputs=(0,))]
    with pytest.raises(GraphError, match="topological"):
        Graph(arrays, nodes)


def test_cost_models():
    arrays = [ArrayInfo(0, (2, 3, 8, 8), "float32", 2 * 3 * 64 * 4, "input"),
              ArrayInfo(1, (4, 3, 3, 3), "float32", 4 * 27 * 4, "param"),
              ArrayInfo(2, (2, 4, 8, 8), "float32", 2 * 4 * 64 * 4, "intermediate", 0),
              ArrayInfo(3, (2, 4, 8, 8), "float32", 2 * 4 * 64 * 4, "output", 1)]
    nodes = [Node(0, "Convolution2DFunction", (0, 1), (2,), forward_time_s=0.5),
             Node(1, "ReLU", (2,), (3,), forward_time_s=0.25)]
    g = Graph(arrays, nodes, cost_model="paper")
    assert list(g.node_cost) == [10.0, 1.0]
    # flops: 2 * output elements * (in_channels * kh * kw); ReLU: elements read + written
    assert list(g.with_cost_model("flops").node_cost) == [2 * 512 * 27, 512 + 512]
    assert list(g.with_cost_model("measured").node_cost) == [0.5, 0.25]
    no_times = Graph(arrays, [Node(0, "Convolution2DFunction", (0, 1), (2,)),
                              Node(1, "ReLU", (2,), (3,))])
    with pytest.raises(GraphError, match="profile"):
        no_times.with_cost_model("measured")
    with pytest.raises(GraphError, match="unknown cost model"):
        g.with_cost_model("magic")


def test_to_networkx():
    g = Graph.from_edges([4, 8, 4], [(0, 1), (1, 2), (0, 2)])
    nx_graph = g.to_networkx()
    assert sorted(nx_graph.edges) == [(0, 1), (0, 2), (1, 2)]
    assert nx_graph.nodes[1]["bytes"] == 8 and nx_graph.nodes[1]["cost"] == 1.0


def test_json_round_trip_and_schema_version(tmp_path):
    g = Graph.from_edges([4, 8, 4], [(0, 1), (1, 2)], costs=[1, 2, 3])
    save_graph(g, tmp_path / "g.json")
    h = load_graph(tmp_path / "g.json")
    assert h.nodes == g.nodes and h.arrays == g.arrays and h.cost_model == "measured"
    data = json.loads((tmp_path / "g.json").read_text())
    data["schema_version"] = 99
    (tmp_path / "old.json").write_text(json.dumps(data))
    with pytest.raises(SchemaVersionError, match="version 99"):
        load_graph(tmp_path / "old.json")
    (tmp_path / "bad.json").write_text('{\n  "schema_version": 1,\n  "arrays": [\n')
    with pytest.raises(GraphFormatError, match=r"bad.json:4"):
        load_graph(tmp_path / "bad.json")


def test_step_facts_are_typed_and_files_of_earlier_versions_read(tmp_path):
    """What a graph records of the step around it is typed (``graph.step``),
    saved under ``step`` (schema 3) and read back equal; a version 2 file
    that kept the facts among ``meta``'s notes is read with them as facts,
    its notes left in ``meta``; facts given both ways are refused."""
    g = Graph.from_edges([4, 8], [(0, 1)], costs=[1, 2]).with_step(
        state_bytes={"params": 64}, correction_bytes=12, calls_per_step=2, returned=[2])
    g = g.replace(meta={"model": "m"})
    assert g.step.returned == (2,) and g.step.calls_per_step == 2 and g.state_bytes == {"params": 64}
    save_graph(g, tmp_path / "g.json")
    data = json.loads((tmp_path / "g.json").read_text())
    assert data["schema_version"] == 3 and data["meta"] == {"model": "m"}
    assert data["step"] == {"state_bytes": {"params": 64}, "returned": [2], "calls_per_step": 2,
                            "correction_bytes": 12}
    assert load_graph(tmp_path / "g.json").step == g.step
    old = dict(data, schema_version=2, meta={"model": "m", **data.pop("step")})
    (tmp_path / "v2.json").write_text(json.dumps(old))
    h = load_graph(tmp_path / "v2.json")
    assert h.step == g.step and h.meta == {"model": "m"}
    with pytest.raises(GraphError, match="both"):
        Graph(g.arrays, g.nodes, meta={"correction_bytes": 1}, step=StepFacts())


@needs_graphs
@pytest.mark.parametrize("name,n_nodes", [("vgg19", 46), ("resnet50", 176), ("unet", 60),
                                          ("densenet", 568)])
def test_authors_graphs_load(name, n_nodes):
    g = load_authors_graph(GRAPHS / f"cg_{name}.txt")
    assert g.n == n_nodes
    assert g.cost_model == "paper"
    # every node is the output of one forward record; inputs and parameters are not nodes
    assert sum(a.kind in ("intermediate", "output") for a in g.arrays) == n_nodes
    assert all(u < v for u, v in g.edges)
    convs = sum(n.op.startswith("Conv") for n in g.nodes)
    assert g.node_cost.sum() == 10 * convs + (n_nodes - convs)


@needs_graphs
def test_authors_resnet50_details():
    g = load_authors_graph(GRAPHS / "cg_resnet50.txt")
    # 2ΣM over all variables, as the authors print it: 9.45 GB (TARGETS.md)
    total = 2 * sum(a.nbytes for a in g.arrays)
    assert round(total / 1e9, 2) == 9.45
    first = g.nodes[0]
    assert first.op == "Convolution2DFunction" and g.arrays[first.inputs[0]].kind == "input"
    assert first.retained_inputs == first.inputs[:2]
    relu = next(n for n in g.nodes if n.op == "ReLU")
    assert relu.retained_outputs == relu.outputs


def _write(tmp_path, text):
    p = tmp_path / "cg.txt"
    p.write_text(text)
    return p


GOOD = """3 1
0 16 0
1 16 _
2 8 /predictor/W
forward
2 1
0 _
2 _
1
LinearFunction
{"_input_indexes_to_retain": [0, 1], "_output_indexes_to_retain": null}
"""


def test_authors_format_small_file(tmp_path):
    g = load_authors_graph(_write(tmp_path, GOOD))
    assert g.n == 1 and g.nodes[0].op == "LinearFunction"
    assert [a.kind for a in g.arrays] == ["input", "output", "param"]
    assert g.nodes[0].retained_inputs == (0, 2)


@pytest.mark.parametrize("text,line,message", [
    (GOOD.replace("3 1\n", "3 x\n"), 1, "N_VARIABLES"),
    ("\n".join(GOOD.splitlines()[:7]) + "\n", 8, "ends early"),
    (GOOD.replace("forward\n", "sideways\n"), 5, "'forward' or 'backward'"),
    (GOOD.replace("2 _\n", "7 _\n"), 8, "variable 7"),
    (GOOD.replace('{"_input', '{_input'), 11, "JSON"),
    (GOOD.replace("1 16 _\n", "1 16\n"), 3, "variable line"),
])
def test_authors_format_errors_name_the_line(tmp_path, text, line, message):
    with pytest.raises(GraphFormatError, match=message) as info:
        load_authors_graph(_write(tmp_path, text))
    assert info.value.line == line
    assert f"cg.txt:{line}:" in str(info.value)


def _careful(path):
    """The careful (line-checking) reader alone, without the fast path."""
    from chainer_recompute.core import io
    text = Path(path).read_text()
    lines = io._Lines(str(path), text)
    return io._authors_graph(str(path), *io._parse_authors(lines), lines.error)


def _same_graph(a, b):
    return (a.arrays == b.arrays and a.nodes == b.nodes and a.meta == b.meta and a.step == b.step
            and a.cost_model == b.cost_model)


@pytest.mark.parametrize("name", ["vgg19", "resnet50", "unet", "densenet"])
def test_fast_authors_reader_equals_the_careful_one(name):
    path = GRAPHS / f"cg_{name}.txt"
    if not path.exists():
        pytest.skip("../shared/graphs not present")
    from chainer_recompute.core import io
    fast = io._authors_graph(str(path), *io._parse_authors_fast(path.read_text()), io._retry)
    assert _same_graph(fast, _careful(path))


def _mutations(text, rng, count):
    """Small edits of a good file: a line dropped, doubled, swapped, a
    token changed, spaces, tabs or blank lines added, a long integer in the
    attributes, retained indexes that are not a list of integers."""
    lines = text.splitlines()
    edits = [
        lambda ls, i: ls[:i] + ls[i + 1:],
        lambda ls, i: ls[:i] + [ls[i]] + ls[i:],
        lambda ls, i: ls[:i] + [ls[(i + 1) % len(ls)], ls[i]] + ls[i + 2:],
        lambda ls, i: ls[:i] + [ls[i].replace("1", "7", 1)] + ls[i + 1:],
        lambda ls, i: ls[:i] + [" " + ls[i] + "\t"] + ls[i + 1:],
        lambda ls, i: ls[:i] + [""] + ls[i:],
        lambda ls, i: ls[:i] + [ls[i].replace("_", "x 1", 1)] + ls[i + 1:],
        lambda ls, i: ls[:i] + [ls[i].replace("{", '{"n": 12345678901234567890123, ', 1)]
        + ls[i + 1:],
        lambda ls, i: ls[:i] + [ls[i].replace("null", "3", 1).replace("[0]", '["0"]', 1)]
        + ls[i + 1:],
        lambda ls, i: ls[:i] + [ls[i].replace("{", "[", 1)] + ls[i + 1:],
        lambda ls, i: ls[:i] + [ls[i].replace(" ", "  ", 1)] + ls[i + 1:],
        lambda ls, i: ls[:i] + [ls[i] + " "] + ls[i + 1:],
        lambda ls, i: ls[:i] + [ls[i].replace(" ", "\t", 1)] + ls[i + 1:],
        lambda ls, i: ls[:i] + [" " + ls[i]] + ls[i + 1:],
    ]
    for _ in range(count):
        k = int(rng.integers(len(edits)))
        i = int(rng.integers(len(lines)))
        yield "\n".join(edits[k](list(lines), i)) + "\n"


@pytest.mark.parametrize("orjson", [True, False], ids=["orjson", "json"])
def test_fast_authors_reader_agrees_on_edited_files(tmp_path, monkeypatch, orjson):
    """Every edited file reads to the same graph, or fails with the same
    error (naming the same line), as with the careful reader alone; with
    orjson (the ``fast`` extra) and without."""
    import numpy as np
    from chainer_recompute.core import io
    if not orjson:
        monkeypatch.setattr(io, "_orjson_loads", None)
    elif io._orjson_loads is None:
        pytest.skip("orjson is not installed")
    rng = np.random.default_rng(0)
    big = GOOD.replace("3 1\n", "4 3\n").replace(
        "2 8 /predictor/W\n", "2 8 /predictor/W\n3 4 _\n") + (
        "backward\n1 1\n1 _\n0\nLinearFunction\n{}\n"
        "forward\n1 1\n1 _\n3\nReLU\n"
        '{"_input_indexes_to_retain": null, "_output_indexes_to_retain": [0]}\n')
    # Whitespace other than spaces and newlines, which str.split() and
    # splitlines() (the careful reader's) treat as separators; a backward
    # record's attributes valid JSON but not an object.
    odd = [big.replace("\n", "\r\n"), big.replace("2 8 /predictor/W", "2 8 /pre\tdictor/W"),
           big.replace("3 4 _\n", "3 4 _\x0c\n"),
           big.replace("LinearFunction", "Linear\x1fFunction"),
           big.replace("/predictor/W", "/predictor/W\u2028"),
           big.replace("LinearFunction\n{}\n", "LinearFunction\n[]\n")]
    texts = [big] + odd + list(_mutations(big, rng, 300))
    sources = [GRAPHS / "cg_vgg19.txt"]
    if sources[0].exists():
        texts += list(_mutations(sources[0].read_text(), rng, 40))
    outcomes = set()
    fast_read = 0  # edited files the fast reader took itself
    for k, text in enumerate(texts):
        p = tmp_path / f"cg_{k}.txt"
        p.write_text(text)
        try:
            fast = io._authors_graph(str(p), *io._parse_authors_fast(text), io._retry)
        except Exception:
            fast = None
        try:
            want = _careful(p)
        except Exception as e:
            assert fast is None, text
            with pytest.raises(type(e)) as info:
                load_authors_graph(p)
            assert str(info.value) == str(e)
            outcomes.add("error")
        else:
            assert _same_graph(load_authors_graph(p), want), text
            assert fast is None or _same_graph(fast, want), text
            fast_read += fast is not None and k > len(odd)
            outcomes.add("graph")
    assert outcomes == {"graph", "error"}
    assert fast_read >= 50  # the fast reader is tested, not only its fallback


def test_summary_mentions_the_figures():
    g = Graph.from_edges([2 ** 20, 2 ** 20], [(0, 1)])
    s = g.summary()
    assert "2 nodes" in s and "2.00 MiB" in s


def test_the_callers_work_scales_with_the_graph():
    """What the caller allocates between the forward and the backward (a
    target network's forward over the batch) scales with the batch, as the
    transients do, and is interpolated between two recorded shapes."""
    def at(batch, peak, held):
        return Graph.from_edges([8 * batch, 8 * batch], [(0, 1)]).replace(
            batch_size=batch).with_step(outside_peak_bytes=peak, outside_held_bytes=held)
    g2 = at(2, 1000, 200)
    assert g2.scale_batch(6).step.outside_peak_bytes == 3000
    assert g2.scale_batch(6).step.outside_held_bytes == 600
    g4 = at(4, 1800, 200)
    g = g2.scale_between(g4, 8)
    assert (g.step.outside_peak_bytes, g.step.outside_held_bytes) == (3400, 200)
    assert Graph.from_edges([8], []).replace(
        batch_size=2).scale_batch(4).step.outside_peak_bytes == 0


def test_a_temporary_that_batch_one_understates_scales_from_batch_two():
    """NumPy spares a copy at batch 1 that it makes at every larger batch
    (a convolution's im2col buffer through ``tensordot``), so the line
    through captures at batch 1 and 2 overstates each larger batch: a
    measured temporary that is lower per sample at batch 1 than at batch 2
    (by more than 1%) is scaled from batch 2 in proportion. One on or
    above the line, within 1% of it, between the captures, or scaled from
    captures at batch 2 and 4, follows the line."""
    def at(batch, fwd, bwd):
        g = Graph.from_edges([8 * batch, 8 * batch], [(0, 1)]).replace(batch_size=batch)
        nodes = [dataclasses.replace(n, forward_transient_bytes=f, backward_transient_bytes=b)
                 for n, f, b in zip(g.nodes, fwd, bwd)]
        return g.replace(nodes=nodes)

    def transients(g):
        return [(n.forward_transient_bytes, n.backward_transient_bytes) for n in g.nodes]

    # node 0: 100 at batch 1 against 300 at 2 (150 a sample): 150 a sample
    # from batch 2 (the line: 700 at 4); 1000 / 2000 (1,000 a sample both
    # ways) on the line; node 1: 200 / 300 (a constant 100 and 100 a sample)
    # and 995 / 2000 (0.5% under 1,000 a sample) on the line
    g1, g2 = at(1, [100, 200], [1000, 995]), at(2, [300, 300], [2000, 2000])
    assert transients(g1.scale_between(g2, 4)) == [(600, 4000), (500, 4010)]
    assert transients(g1.scale_between(g2, 3)) == [(450, 3000), (400, 3005)]
    assert transients(g2.scale_between(g1, 4)) == [(600, 4000), (500, 4010)]  # (either order)
    # between captures at 1 and 2 or from captures at 2 and 4: the line
    assert transients(Graph.fit([g1, g2], [1, 2], Fraction(3, 2), origin=0)) == [
        (200, 1500), (250, 1498)]
    g4 = at(4, [600, 600], [4000, 4000])
    assert transients(at(2, [200, 300], [2000, 2000]).scale_between(g4, 8)) == [
        (1400, 8000), (1200, 8000)]


def test_a_batch_scaled_on_the_line_of_its_captures_keeps_what_does_not_grow():
    """A graph scaled from captures at batch 2 and 4 to 32, then to 24 (a
    last partial batch): in proportion its backward's temporary of a
    parameter's size (a constant 1,000 B beside 100 B a sample) shrinks
    with the batch; on the line through the capture at 4 it stays, as it
    would have been scaled from the captures to 24 directly. The step's
    facts and the metadata are the graph's, scaled as they are in
    proportion; without a line, or with one of another structure, the
    proportion."""
    def at(batch):
        g = Graph.from_edges([8 * batch, 8 * batch], [(0, 1)]).replace(batch_size=batch)
        nodes = [dataclasses.replace(n, backward_transient_bytes=1000 + 100 * batch)
                 for n in g.nodes]
        return g.replace(nodes=nodes).with_step(outside_peak_bytes=10 * batch,
                                                correction_bytes=7)

    g2, g4 = at(2), at(4)
    g32 = g2.scale_between(g4, 32)
    assert [n.backward_transient_bytes for n in g32.nodes] == [4200, 4200]

    def figures(g):
        return ([n.backward_transient_bytes for n in g.nodes], g.node_bytes.tolist(),
                g.batch_size, g.step.outside_peak_bytes, g.step.correction_bytes)

    on_line = g32.scale_batch(24, g4)
    assert figures(on_line) == ([3400, 3400], [192, 192], 24, 240, 7)
    assert figures(g2.scale_between(g4, 24))[:2] == ([3400, 3400], [192, 192])
    assert on_line.meta == g32.scale_batch(24).meta
    # (in proportion, arrays of no known shape keep their bytes)
    assert figures(g32.scale_batch(24)) == ([3150, 3150], [256, 256], 24, 240, 7)
    other = Graph.from_edges([32, 32, 32], [(0, 1), (1, 2)]).replace(batch_size=4)
    assert figures(g32.scale_batch(24, other)) == figures(g32.scale_batch(24))


# ------------------------------------------------ a model at several shapes
def pair_graph(n: int, b: int = 2, h: int = 3, rows: int = None) -> Graph:
    """A pairwise model recorded at ``n`` points: its input (b, n, h), the
    pairs flattened to (b*n*n, h) rows (``rows`` instead of b*n*n: a
    made-up size), their sum per point (b, n, h); the flattening's
    transient is quadratic in n too, the sum's backward leaves b*n*h*4
    bytes."""
    rows = b * n * n if rows is None else rows
    arrays = [ArrayInfo(0, (b, n, h), "float32", 4 * b * n * h, "input"),
              ArrayInfo(1, (rows, h), "float32", 4 * rows * h, "intermediate", producer=0),
              ArrayInfo(2, (b, n, h), "float32", 4 * b * n * h, "output", producer=1)]
    nodes = [Node(0, "Pairs", (0,), (1,), forward_transient_bytes=4 * rows * h,
                  forward_time_s=1e-6 * rows),
             Node(1, "Sum", (1,), (2,), retained_inputs=(1,), backward_alloc_bytes=4 * b * n * h)]
    return Graph(arrays, nodes, batch_size=b, meta={"model": "pairs"})


def test_fit_through_three_shapes_gets_a_quadratic_size_the_linear_rule_misses():
    exact = pair_graph(7)
    # through two recorded shapes every size is linear: the pair rows are wrong
    two = Graph.fit([pair_graph(3), pair_graph(4)], [3, 4], 7)
    assert two.arrays[1].shape == (2 * (9 + 4 * 7), 3) != exact.arrays[1].shape  # 74 rows, not 98
    assert pair_graph(3).interpolate(pair_graph(4), 4, 1).arrays[1].shape == two.arrays[1].shape
    # through three, the polynomial of least degree: quadratic in n where it
    # is (extrapolated and between the points), linear where it is
    for at, points in ((7, (3, 4, 5)), (7, (5, 3, 4)), (4, (2, 3, 6)), (7, (2, 3, 4, 5))):
        g = Graph.fit([pair_graph(n) for n in points], points, at)
        truth = pair_graph(at)
        assert [a.shape for a in g.arrays] == [a.shape for a in truth.arrays], (at, points)
        assert [a.nbytes for a in g.arrays] == [a.nbytes for a in truth.arrays]
        assert [n.forward_transient_bytes for n in g.nodes] == \
            [n.forward_transient_bytes for n in truth.nodes]
        assert g.nodes[1].backward_alloc_bytes == truth.nodes[1].backward_alloc_bytes
        assert g.nodes[0].forward_time_s == pytest.approx(truth.nodes[0].forward_time_s)
        assert list(g.node_bytes) == list(truth.node_bytes)
    # the rest is the first graph's (put the nearest first)
    assert Graph.fit([pair_graph(5), pair_graph(3), pair_graph(4)], [5, 3, 4], 6).meta == \
        pair_graph(5).meta


def test_fit_refuses_a_size_that_is_not_whole_at_the_new_shape():
    # rows 18, 32, 56 at n = 3, 4, 6 (not b*n*n): a quadratic through them
    # is not whole at n = 5
    graphs = [pair_graph(3, rows=18), pair_graph(4, rows=32), pair_graph(6, rows=56)]
    with pytest.raises(GraphError, match=r"dimension 0 of array 1 \(intermediate\) is 18, 32 "
                                         r"and 56 at the three shapes: not a whole number at "
                                         r"n = 5 \(44\.6667\) as quadratic in the input's size"):
        Graph.fit(graphs, [3, 4, 6], 5, where="at the three shapes", target="n = 5")
    with pytest.raises(GraphError, match=r"is 18 and 56 .* \(43\.3333\) as linear"):
        Graph.fit(graphs[::2], [3, 6], 5)


def test_fit_refuses_other_structures_and_bad_positions():
    other = pair_graph(4)
    other = other.replace(nodes=[other.nodes[0], dataclasses.replace(other.nodes[1], op="Mean")])
    with pytest.raises(GraphError, match=r"differ \(function #1 \(Sum\) is Sum reading .* Mean"):
        Graph.fit([pair_graph(2), pair_graph(3), other], [2, 3, 4], 5)
    with pytest.raises(GraphError, match="two graphs or more"):
        Graph.fit([pair_graph(2)], [2], 5)
    with pytest.raises(GraphError, match="distinct positions"):
        Graph.fit([pair_graph(2), pair_graph(3)], [2, 2], 5)
