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
                           "solver": "auto", "strategy": "tc"}
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
    for name in ("memory.png", "schedule.png"):
        data = (out_dir / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000


def test_plot_subcommand_redraws(out_dir, tmp_path, capsys):
    assert main(["plot", str(out_dir / "report.json"), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "memory.png" in out and "schedule.png" in out
    for name in ("memory.png", "schedule.png"):
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
