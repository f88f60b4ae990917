"""experiments/gpu_run.py, the prepared GPU run (issue 36), on the CPU at
tiny sizes: it writes its table and JSON, plain and recomputed steps are
identical, the CuPy and torch sections say why they are skipped, and a
section stopped at its time box leaves the others to run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "gpu_run.py"


def run(out: Path, *options: str, timeout: float = 120) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "--device", "@numpy",
                           "--tiny", *options], cwd=str(ROOT), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "gpu_run.md").exists()
    return json.loads((out / "gpu_run.json").read_text())


def sections(report: dict) -> dict:
    return {s["name"]: s for s in report["sections"]}


def test_tiny_run_writes_table_and_json_with_identical_rows(tmp_path):
    report = run(tmp_path, "--sections", "pytest,mlp,torch", "--bundle", str(tmp_path / "b"))
    s = sections(report)
    # what the device tool brings back: three files
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        "gpu_run.json", "gpu_run.md", "logs.tar.gz"]
    # with the graph the least plan was made from, to replay elsewhere
    import tarfile
    from chainer_recompute.core.io import load_graph
    with tarfile.open(tmp_path / "b" / "logs.tar.gz") as tar:
        assert any(n.startswith("graphs/mlp-") for n in tar.getnames())
    assert load_graph(next((tmp_path / "graphs").glob("mlp-*.json"))).n > 0
    assert list(s) == ["pytest", "torch", "mlp"]  # the run's order, extra networks last
    assert s["pytest"]["status"] == "skipped" and "no CuPy" in s["pytest"]["reason"]
    reason = s["torch"]["reason"]
    assert s["torch"]["status"] == "skipped" and ("no torch" in reason or "no CUDA" in reason)
    assert s["mlp"]["status"] == "ok", s["mlp"]
    rows = {r["case"]: r for r in s["mlp"]["rows"]}
    assert set(rows) == {"vanilla", "least", "half"}
    assert rows["vanilla"]["used_peak_bytes"] and len(rows["vanilla"]["times_s"]) == 2
    # the half budget runs where plain's peak is over the least one
    for case in ("least", "half") if "budget_bytes" in rows["half"] else ("least",):
        r = rows[case]
        assert r["identical"] is True, r.get("differences")
        assert r["budget_bytes"] and r["predicted_bytes"] and r["used_peak_bytes"]
        assert len(r["times_s"]) == 2 and len(r["times_noverify_s"]) == 2
        assert "vs_base" in r and "noverify_vs_base" in r
    if "budget_bytes" in rows["half"]:
        assert rows["half"]["budget_bytes"] > rows["least"]["budget_bytes"]
    else:
        assert rows["half"]["note"].startswith("not run: plain's peak")
    md = (tmp_path / "gpu_run.md").read_text()
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert table[0].startswith("| section | case | budget")
    assert sum("| mlp | least |" in ln and "| True |" in ln for ln in table) == 1
    assert "skipped: no CuPy" in md


def test_a_section_past_its_box_is_recorded_and_the_next_still_runs(tmp_path):
    report = run(tmp_path, "--sections", "mlp,lstm", "--box-scale", "0.001")
    s = sections(report)
    assert [s[n]["status"] for n in ("mlp", "lstm")] == ["timed out", "timed out"]
    assert "timed out" in (tmp_path / "gpu_run.md").read_text()


def test_unknown_section_is_refused_with_the_choices(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--sections", "resnet5"],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "unknown section 'resnet5'" in proc.stderr
    assert "tc_overhead" in proc.stderr


@pytest.mark.slow
def test_tiny_lstm_and_resnet50(tmp_path):
    """The LSTM at t=300 (MSM and ISM at 5% and 10% of plain's memory) and
    ResNet50 (small, batch 4): every run row identical to plain, and the
    LSTM's peaks at or under their budgets (about 5 minutes on 2 cores)."""
    report = run(tmp_path, "--sections", "resnet50,lstm", timeout=900)
    s = sections(report)
    assert s["resnet50"]["status"] == "ok" and s["lstm"]["status"] == "ok", s
    assert {r["case"] for r in s["resnet50"]["rows"]} >= {"vanilla", "least", "nested"}
    for name in ("resnet50", "lstm"):
        for r in s[name]["rows"]:
            if "identical" in r:
                assert r["identical"] is True, (name, r)
    lstm = [r for r in s["lstm"]["rows"] if r["case"].startswith(("msm", "ism"))]
    assert len(lstm) == 4
    for r in lstm:
        if "used_peak_bytes" in r:
            assert r["used_peak_bytes"] <= r["budget_bytes"], r


@pytest.mark.slow  # 7 s
def test_tiny_lstm_graph_rows_are_identical_and_within_their_budgets(tmp_path):
    """Issue 35's LSTM rows (apply() against MSM and ISM at two budgets):
    every method's gradients are plain's, its measured peak is at or under
    its budget, and each has a time paired with plain's."""
    report = run(tmp_path, "--sections", "lstm_graph", timeout=300)
    s = sections(report)["lstm_graph"]
    assert s["status"] == "ok", s
    measured = [r for r in s["rows"] if "identical" in r]
    assert sorted(r["case"] for r in measured) == sorted(
        f"{m} at {f}" for m in ("msm", "ism", "apply") for f in ("10%", "25%"))
    for r in measured:
        assert r["identical"] is True, r
        assert r["used_peak_bytes"] <= r["budget_bytes"], r
    timed = {r["case"] for r in s["rows"] if "vs_base" in r}
    assert timed == {r["case"] for r in measured}
