"""report.json's schema, the PNGs of --out, and the plot subcommand."""
import json
import sys

import pytest

from chainer_recompute.cli import main

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("out")
    assert main(["--model", "resnet50", "--small", "--batch-size", "4", "--budget", "320M",
                 "--out", str(d), "-q"]) == 0
    return d


def test_report_schema(out_dir):
    r = json.loads((out_dir / "report.json").read_text())
    assert r["schema"] == "chainer-recompute report" and r["version"] == 1
    assert r["command"].startswith("chainer-recompute --model resnet50 --batch-size 4 --small")
    assert r["budget"] == {"text": "320M", "bytes": 320 * 2 ** 20, "scope": "total",
                           "solver": "auto", "strategy": "tc", "resolved": None}
    assert r["source"]["model"] == "resnet50" and r["source"]["batch_size"] == 4
    assert r["graph"]["nodes"] == 176
    plain, plan, least = r["plain"], r["plan"], r["least"]
    assert plan["predicted_peak_bytes"] <= r["budget"]["bytes"] < plain["predicted_peak_bytes"]
    assert plan["saving_fraction"] == pytest.approx(
        1 - plan["predicted_peak_bytes"] / plain["predicted_peak_bytes"])
    for key in ("overhead_fraction", "n_blocks", "solve_time_s", "n_dropped",
                "recomputed_nodes", "peak_event", "feasible", "memory_scope"):
        assert key in plan
    assert least["budget_bytes"] <= r["budget"]["bytes"]
    for name in ("plain", "plan"):
        tl = r["timelines"][name]
        assert len(tl["events"]) == len(tl["memory_bytes"]) > 0
        assert max(tl["memory_bytes"]) == tl["peak_bytes"]
        assert "end of forward" in tl["events"]
    assert r["timelines"]["plan"]["peak_bytes"] == plan["predicted_peak_bytes"]
    sch = r["schedule"]
    n = r["graph"]["nodes"]
    assert len(sch["ops"]) == len(sch["node_bytes"]) == len(sch["block"]) == n
    assert sorted(sch["kept"] + sch["recomputed"]) == list(range(n))
    assert len(set(sch["block"])) == plan["n_blocks"]
    assert sch["recomputed"] and all(len(e) == 2 for e in sch["edges"])
    assert r["next_command"].startswith("chainer-recompute ")


def test_pngs_are_written(out_dir):
    for name in ("memory.png", "schedule.png", "tradeoff.png"):
        data = (out_dir / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000


def test_plot_subcommand_redraws(out_dir, tmp_path, capsys):
    assert main(["plot", str(out_dir / "report.json"), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "memory.png" in out and "schedule.png" in out and "tradeoff.png" in out
    for name in ("memory.png", "schedule.png", "tradeoff.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG)


@pytest.mark.parametrize("content,says", [(None, "no such file"), ("{", "not JSON"),
                                          ('{"a": 1}', "not a chainer-recompute report")])
def test_plot_bad_report(tmp_path, capsys, content, says):
    path = tmp_path / "report.json"
    if content is not None:
        path.write_text(content)
    assert main(["plot", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err


def test_without_matplotlib(tmp_path, capsys, monkeypatch):
    """--out still writes report.json and says how to get the figures; the
    plot subcommand exits 2 saying the same."""
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["--model", "mlp", "--out", str(tmp_path), "-q"]) == 0
    captured = capsys.readouterr()
    assert (tmp_path / "report.json").exists() and not (tmp_path / "memory.png").exists()
    assert "chainer-recompute[plot]" in captured.err
    assert main(["plot", str(tmp_path / "report.json")]) == 2
    assert "chainer-recompute[plot]" in capsys.readouterr().err


# ------------------------------------------------- what the figures say
# (read back from the matplotlib objects: the Agg canvas, no pyplot)
MIB = 2 ** 20


@pytest.fixture(scope="module")
def report(out_dir):
    return json.loads((out_dir / "report.json").read_text())


@pytest.fixture(scope="module")
def plain_fits(tmp_path_factory):
    """A report at a budget plain backprop fits (the plan is plain)."""
    d = tmp_path_factory.mktemp("plain")
    assert main(["--model", "mlp", "--budget", "1G", "--out", str(d), "-q"]) == 0
    return json.loads((d / "report.json").read_text())


def _texts(labels):
    return [t.get_text() for t in labels]


def test_report_names_each_functions_link(report):
    links = report["schedule"]["links"]
    assert len(links) == report["graph"]["nodes"]
    assert links[0] == "/predictor/conv1" and links[-1] == "/"
    assert any(link.startswith("/predictor/res3/") for link in links)


def test_schedule_names_the_link_groups_and_layers(report):
    from chainer_recompute.plotting import plot_schedule
    fig = plot_schedule(report)
    top, by_group, by_layer = fig.axes
    names = _texts(top.get_xticklabels())
    assert [n for n in names if n.startswith("res")] == ["res2", "res3", "res4", "res5"]
    assert "conv1" in names[0] and names[-1] == "fc6"
    assert _texts(by_group.get_yticklabels()) == names
    layers = _texts(by_layer.get_yticklabels())
    assert {"conv1", "bn1", "conv2", "bn2", "conv3", "bn3", "ReLU", "Add"} <= set(layers)
    # the per-layer notes add up to the plan's recomputed functions
    sch = report["schedule"]
    notes = [t.get_text() for t in by_layer.texts]
    rec = sum(int(t.split(", ")[1].split()[0]) for t in notes)
    kept = sum(int(t.split()[0]) for t in notes)
    assert rec == len(sch["recomputed"]) > 0 and kept == len(sch["kept"])
    legend = _texts(top.get_legend().get_texts())
    assert any(t.startswith("kept") for t in legend) and any("recomputed" in t for t in legend)


def test_schedule_of_a_graph_without_link_names(report):
    """Graphs saved before links were recorded, or the authors' format."""
    from chainer_recompute.plotting import plot_schedule
    old = json.loads(json.dumps(report))
    del old["schedule"]["links"]
    top = plot_schedule(old).axes[0]
    assert _texts(top.get_xticklabels()) == ["all functions (this graph names no links)"]


@pytest.mark.parametrize("which", ["plan recomputes", "plain fits"])
def test_memory_always_shows_plain_beside_the_plan(which, report, plain_fits):
    from chainer_recompute.plotting import plot_memory
    r = report if which == "plan recomputes" else plain_fits
    assert r["plan"]["recompute"] == (which == "plan recomputes")
    ax = plot_memory(r).axes[0]
    curves = {line.get_label().split(":")[0]: line for line in ax.get_lines()
              if not line.get_label().startswith("_") and len(line.get_xdata()) > 2}
    assert sorted(curves) == ["plain backprop (plain Chainer)", f"plan {r['plan']['solver']}/tc"]
    plain, plan = (curves[k] for k in sorted(curves))
    assert list(plain.get_ydata()) and list(plan.get_ydata())
    assert (list(plain.get_ydata()) == list(plan.get_ydata())) == (which == "plain fits")
    legend = _texts(ax.get_legend().get_texts())
    assert sum(t.startswith(("plain backprop", "plan ")) for t in legend) == 2
    if which == "plain fits":
        assert any("nothing recomputed" in t for t in legend)


def test_report_tradeoff_runs_from_least_to_plain(report):
    tr = report["tradeoff"]
    pts = tr["points"]
    assert tr["scope"] == "total" and tr["tried"] >= len(pts) >= 3
    assert pts[0]["budget_bytes"] == report["least"]["budget_bytes"]
    assert not pts[-1]["recompute"] and pts[-1]["overhead_fraction"] == 0.0
    assert pts[-1]["peak_bytes"] == report["plain"]["predicted_peak_bytes"]
    budgets = [p["budget_bytes"] for p in pts]
    overheads = [p["overhead_fraction"] for p in pts]
    assert budgets == sorted(budgets) and overheads == sorted(overheads, reverse=True)
    assert len(set(overheads)) == len(overheads)
    # the chosen plan is one of the plans it was drawn from: nothing on the
    # curve at its budget costs more
    b, plan = report["budget"]["bytes"], report["plan"]
    best = min(p["overhead_fraction"] for p in pts if p["budget_bytes"] <= b)
    assert best <= plan["overhead_fraction"]


def test_tradeoff_marks_the_chosen_budget(report):
    from chainer_recompute.plotting import plot_tradeoff
    ax = plot_tradeoff(report).axes[0]
    legend = _texts(ax.get_legend().get_texts())
    chosen = [t for t in legend if t.startswith("chosen budget 320M = 320.00 MiB")]
    pct = 100 * report["plan"]["overhead_fraction"]
    assert chosen == [f"chosen budget 320M = 320.00 MiB: {pct:.0f}% recompute "
                      f"({report['plan']['n_blocks']} blocks)"]
    assert any(t.startswith("least feasible") for t in legend)
    assert any(t.startswith("plain backprop: needs") for t in legend)
    star = [line for line in ax.get_lines() if line.get_marker() == "*"]
    assert len(star) == 1
    assert list(star[0].get_xdata()) == [320.0]
    assert list(star[0].get_ydata()) == pytest.approx([pct])
    vertical = [line for line in ax.get_lines() if list(line.get_xdata()) == [320.0, 320.0]]
    assert len(vertical) == 1
    assert "total budget" in ax.get_xlabel() and "recompute" in ax.get_ylabel()


def test_tradeoff_of_an_older_report(report, tmp_path):
    from chainer_recompute.plotting import ReportError, draw_report, plot_tradeoff
    old = dict(report)
    del old["tradeoff"]
    with pytest.raises(ReportError, match="plan again with --out"):
        plot_tradeoff(old)
    assert [p.rsplit("/", 1)[1] for p in draw_report(old, str(tmp_path))] == \
        ["memory.png", "schedule.png"]


def test_link_groups():
    from chainer_recompute.plotting import link_groups
    assert link_groups([]) == []
    assert link_groups(["", ""]) == [("", 0, 2)]
    assert link_groups(["/", "/"]) == [("/", 0, 2)]
    # the common path left out; a container's own functions join the
    # group before; as deep as max_groups allows
    links = ["/m/net/c1", "/m/net", "/m/net/s1/a/c", "/m/net/s1/a", "/m/net/s1/b/c",
             "/m/net/s2/a/c", "/m/net/s2/b/c", "/m/net/fc", "/"]
    assert link_groups(links, max_groups=4, min_share=0) == [
        ("c1", 0, 2), ("s1", 2, 5), ("s2", 5, 7), ("fc", 7, 9)]
    assert link_groups(links, max_groups=6, min_share=0) == [
        ("c1", 0, 2), ("s1/a", 2, 4), ("s1/b", 4, 5), ("s2/a", 5, 6), ("s2/b", 6, 7),
        ("fc", 7, 9)]
    # small neighbours shown as one
    assert link_groups(links, max_groups=4, min_share=0.25) == [
        ("c1", 0, 2), ("s1", 2, 5), ("s2 + fc", 5, 9)]
