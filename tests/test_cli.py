"""The command line and the experiment scripts, run as a user would."""
import importlib.util
import json
from pathlib import Path

import pytest

from chainer_recompute.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = ROOT.parent / "shared" / "graphs"


def test_help_states_the_budget_units(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "GiB" in out and "10^9" in out and "--budget" in out


def test_plan_run_and_check_gradients(capsys, tmp_path):
    rc = main(["--model", "mlp", "--iterations", "2", "--vanilla", "--check-gradients",
               "--json", str(tmp_path / "out.json"), "--save-graph", str(tmp_path / "g.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "identical to plain backprop: True" in out
    assert "vanilla" in out and "approx-tc" in out
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["plan"]["feasible"] and data["gradients_identical"]
    assert [r["label"] for r in data["runs"]] == ["vanilla", "approx-tc"]
    assert (tmp_path / "g.json").exists()


def test_bad_budget_is_a_clear_error(capsys):
    assert main(["--model", "mlp", "--budget", "lots"]) == 2
    assert "accepted forms" in capsys.readouterr().err


def test_budget_below_least_feasible(capsys):
    assert main(["--model", "mlp", "--budget", "100"]) == 2
    err = capsys.readouterr().err
    assert "least feasible" in err


@pytest.mark.skipif(not GRAPHS.exists(), reason="../shared/graphs not present")
def test_authors_graph(capsys):
    rc = main(["--graph", str(GRAPHS / "cg_resnet50.txt"), "--solver", "exact", "--budget", "2GB"])
    out = capsys.readouterr().out
    assert rc == 0 and "176 nodes" in out and "Plan[exact/tc]" in out


def test_every_model_name_is_accepted():
    from chainer_recompute.models import MODELS
    parser = build_parser()
    for name in MODELS:
        assert parser.parse_args(["--model", name]).model == name


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_script_runs_on_cpu(capsys):
    gpu_check = _load(ROOT / "experiments" / "gpu_check.py")
    rc = gpu_check.main(["--device", "@numpy", "--model", "mlp", "--batch-size", "8",
                         "--iterations", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "identical to plain backprop: True" in out and "approx-mc" in out
