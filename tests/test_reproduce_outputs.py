"""experiments/reproduce.py leaves the repository alone: results go to the
folder named by --out or a scratch one, the committed cells and
experiments/README.md only with --update-committed; a cell's command has
every flag, and a run ends with a short table."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import reproduce  # noqa: E402


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def module_state(monkeypatch):
    """main() sets the module's folders: put them back after each test."""
    for name in ("RESULTS", "SWEEP", "WRITE_TO", "RUN_FLAGS"):
        monkeypatch.setattr(reproduce, name, getattr(reproduce, name))


def test_results_folder_default_is_scratch_and_said(capsys):
    results, write_to, flags = reproduce.results_folder(None, False, False)
    assert reproduce.COMMITTED not in (results, *results.parents) and results.is_dir()
    assert write_to is None and flags == ["--out", str(results)]
    assert str(results) in capsys.readouterr().err


def test_report_and_plots_read_committed_and_write_to_scratch(capsys):
    results, write_to, flags = reproduce.results_folder(None, False, True)
    assert results == reproduce.COMMITTED and write_to is not None
    assert reproduce.COMMITTED not in (write_to, *write_to.parents)


@pytest.mark.parametrize("out", ["experiments/results", "experiments/results/cells"])
def test_committed_folder_is_refused_without_the_flag(out, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit, match="--update-committed"):
        reproduce.results_folder(out, False, False)


def test_update_committed(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert reproduce.results_folder(None, True, False) == (
        reproduce.COMMITTED, None, ["--update-committed"])
    with pytest.raises(SystemExit, match="drop --out"):
        reproduce.results_folder(str(tmp_path), True, False)


def test_report_leaves_the_repository_alone():
    """--report as written in experiments/README.md: the tables printed and
    written to a scratch folder, git status unchanged."""
    before = _git_status()
    r = subprocess.run([sys.executable, "experiments/reproduce.py", "--report"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "| network" in r.stdout and "left alone" in r.stderr
    scratch = Path(r.stderr.split("wrote ", 1)[1].split(" ", 1)[0])
    assert scratch.name == "tables.md" and scratch.exists()
    assert reproduce.COMMITTED not in scratch.parents
    assert _git_status() == before


_FAKE_WORKER = textwrap.dedent("""
    import json, sys, time
    print("STEP building resnet50 at batch 32", file=sys.stderr, flush=True)
    time.sleep(0.6)
    print("STEP call 2 of 2 (measured)", file=sys.stderr, flush=True)
    time.sleep(0.6)
    print("CELL " + json.dumps({"network": "resnet50", "method": "approx-tc", "batch": 32,
          "status": "ok", "measured_peak_bytes": 1380000000,
          "predicted_peak_bytes": 1379000000, "time_s": 29.8,
          "vanilla_replay": {"peak_bytes": 3497000000}, "calls": []}))
""")


def test_a_cell_writes_to_out_with_its_full_command(tmp_path, monkeypatch, capsys,
                                                    module_state):
    """``--cell resnet50:approx-tc --out DIR`` with the worker process
    replaced by a stand-in that prints as the worker does: the JSON lands
    in DIR, its command names every flag, progress lines say what runs and
    the time elapsed, the run ends with the table, and git status is
    unchanged."""
    real_popen = subprocess.Popen
    seen = {}

    def popen(cmd, **kw):
        seen["cmd"] = cmd
        return real_popen([sys.executable, "-c", _FAKE_WORKER], **kw)
    monkeypatch.setattr(reproduce.subprocess, "Popen", popen)
    monkeypatch.setattr(reproduce, "PROGRESS_EVERY_S", 0.2)
    before = _git_status()
    out = tmp_path / "res"
    assert reproduce.main(["--cell", "resnet50:approx-tc", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    cell = json.loads((out / "cells" / "resnet50_b32__approx-tc.json").read_text())
    assert cell["command"] == (".venv/bin/python experiments/reproduce.py --cell "
                               f"resnet50:approx-tc --batch 32 --budget least --config "
                               f"configs/paper.json --out {out}")
    assert "--worker" in seen["cmd"] and str(out / "graphs") in " ".join(seen["cmd"])
    assert "[resnet50:approx-tc] building resnet50 at batch 32" in captured.err
    assert "[resnet50:approx-tc] call 2 of 2 (measured)" in captured.err
    assert "elapsed" in captured.err
    table = captured.out
    assert "measured peak" in table and "paper (GPU)" in table
    row = [ln for ln in table.splitlines() if ln.startswith("resnet50:approx-tc")][0]
    assert "1.380 GB" in row and "1.379 GB" in row and "-61%" in row
    assert "3.4 GB (-62%)" in row and cell["command"] in row
    assert _git_status() == before


def _real_cell(method, tmp_path):
    before = _git_status()
    r = subprocess.run([sys.executable, "experiments/reproduce.py", "--cell",
                        f"resnet50:{method}", "--batch", "1", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    cell = json.loads((tmp_path / "cells" / f"resnet50_b1__{method}.json").read_text())
    assert cell["status"] == "ok" and f"--out {tmp_path}" in cell["command"]
    assert f"[resnet50:{method}]" in r.stderr and "measured peak" in r.stdout
    assert _git_status() == before
    return cell


@pytest.mark.slow  # 6 s
def test_the_cheapest_cell_leaves_git_status_unchanged(tmp_path):
    """The cheapest real cell (plain ResNet50 at batch 1: about 8 s on a
    shared 2-core machine) into --out."""
    _real_cell("vanilla", tmp_path)


@pytest.mark.slow
def test_a_planned_cell_leaves_git_status_unchanged(tmp_path):
    """A cell that plans and saves its graph (ResNet50 at batch 1,
    approximate DP: 10-20 s)."""
    cell = _real_cell("approx-tc", tmp_path)
    assert (tmp_path / "graphs" / "resnet50_b1.json").exists()
    assert cell["predicted_peak_bytes"] > 0
