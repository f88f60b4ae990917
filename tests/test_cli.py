"""The command line and the experiment scripts, run as a user would."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chainer_recompute.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = ROOT.parent / "shared" / "graphs"

# What every byte figure of the output looks like: binary units only.
DECIMAL_UNIT = re.compile(r"\d (kB|MB|GB|TB)\b")


def test_help_states_the_budget_units(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "GiB" in out and "10^9" in out and "--budget" in out and "--dry-run" in out


def test_plan_run_and_check_gradients(capsys, tmp_path):
    rc = main(["--model", "mlp", "--iterations", "2", "--vanilla", "--check-gradients", "-q",
               "--json", str(tmp_path / "out.json"), "--save-graph", str(tmp_path / "g.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "identical to plain backprop: True" in out
    assert "plain backprop" in out and "as run (auto-tc)" in out and "peak (measured)" in out
    assert "time/iter" in out
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["plan"]["feasible"] and data["gradients_identical"]
    assert [r["label"] for r in data["runs"]] == ["vanilla", "auto-tc"]
    assert all(r["measured_peak_bytes"] > 0 and r["time_s"] > 0 for r in data["runs"])
    assert (tmp_path / "g.json").exists()


def test_saved_graph_round_trip(capsys, tmp_path):
    assert main(["--model", "mlp", "--save-graph", str(tmp_path / "g.json"), "-q"]) == 0
    capsys.readouterr()
    assert main(["--graph", str(tmp_path / "g.json"), "--budget", "least", "-q"]) == 0
    out = capsys.readouterr().out
    assert "g.json: 6 functions" in out and "plain backprop" in out


def test_dry_run_table(capsys):
    assert main(["--model", "resnet50", "--small", "--batch-size", "4", "--dry-run",
                 "--budget", "8G", "-q"]) == 0
    out = capsys.readouterr().out
    assert "budget 8G (= 8.00 GiB)" in out  # echoed as typed, in binary units
    assert "recorded at batch 2, scaled" in out
    for column in ("peak (predicted)", "saving", "recompute", "blocks", "solve"):
        assert column in out
    assert "plain backprop fits in 8G" in out  # nothing to recompute at that budget
    assert "least feasible (" in out
    next_line = [line for line in out.splitlines() if line.startswith("next: ")]
    assert len(next_line) == 1 and "--budget" in next_line[0]
    assert not DECIMAL_UNIT.search(out), out


@pytest.mark.parametrize("name", ["mlp", "resnet50",
                                  pytest.param("resnet101", marks=pytest.mark.slow),  # 3 s
                                  pytest.param("resnet152", marks=pytest.mark.slow),  # 5 s
                                  pytest.param("vgg19", marks=pytest.mark.slow),  # 27 s
                                  "googlenet", "densenet161",
                                  pytest.param("pspnet", marks=pytest.mark.slow),  # 5 s
                                  "unet"])
def test_dry_run_every_network(name, capsys, tmp_path):
    """The CLI's dry run on each registry network at its reduced size."""
    rc = main(["--model", name, "--small", "--batch-size", "2", "--dry-run", "-q",
               "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "plain backprop" in out and "plan at the least feasible budget" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["source"]["capture"]["capture_batch"] == 2
    plain = report["plain"]["predicted_peak_bytes"]
    plan = report["plan"]["predicted_peak_bytes"]
    assert 0 < plan <= plain
    assert plan <= report["budget"]["bytes"]


def test_budget_scope_activations(capsys):
    assert main(["--model", "mlp", "--budget-scope", "activations", "-q"]) == 0
    out = capsys.readouterr().out
    assert "the paper's model" in out and "the whole iteration, replayed" in out


# ------------------------------------------------------------- bad input
BAD_INPUTS = [
    (["--graph", "/no/such/graph.json"], "no such file"),
    (["--batch-size", "-3"], "positive integer"),
    (["--batch-size", "0"], "positive integer"),
    (["--batch-size", "x"], "positive integer"),
    (["--budget", "-1G"], "accepted"),
    (["--budget", "lots"], "accepted"),
    (["--budget", "0"], "accepted"),
    (["--device", "@cupy:0"], "@numpy"),
    (["--device", "nonsense"], "@numpy"),
    (["--model", "resnet9000"], "choose from"),
    (["--solver", "magic"], "choose from"),
    (["--budget", "100"], "least feasible"),
    (["--budget", "100", "--budget-scope", "activations"], "least feasible"),
    (["--iterations", "-1"], "accepted"),
    (["--dry-run", "--iterations", "2"], "--dry-run"),
    (["--vanilla"], "--iterations"),
    (["--out", "/proc/no/such/dir"], "folder"),
]


@pytest.mark.parametrize("argv,says", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    rc = main(argv + ["-q"])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("chainer-recompute: error: ") and says in err, err
    assert "Traceback" not in captured.err + captured.out


def test_budget_below_least_feasible_says_the_least(capsys):
    assert main(["--model", "mlp", "--budget", "100", "-q"]) == 2
    err = capsys.readouterr().err
    assert "least feasible" in err and "--budget least" in err
    assert re.search(r"at least \d+\.\d\dKiB|at least \d+\.\d\dMiB", err), err


def test_malformed_graph_file(capsys, tmp_path):
    bad = tmp_path / "cg_bad.txt"
    bad.write_text("not a graph\n")
    assert main(["--graph", str(bad), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cg_bad.txt" in err


def test_verbose_shows_the_traceback(capsys):
    assert main(["--graph", "/no/such/graph.json", "-v"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("chainer-recompute")


def test_library_errors_reach_the_cli(capsys, monkeypatch):
    from chainer_recompute.core.errors import LowerSetExplosionError
    import chainer_recompute.cli as cli

    def explode(*a, **k):
        raise LowerSetExplosionError("too many lower sets\nfor the exact solver; use approx")
    monkeypatch.setattr(cli, "plan_report", explode)
    assert main(["--model", "mlp", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "chainer-recompute: error: too many lower sets for the exact solver; use approx"


def test_installed_entry_point_and_script():
    """``scripts/run_schedule.py`` runs the same main (as a subprocess: no
    import of the package from the test's path)."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_schedule.py"),
                          "--batch-size", "0"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not (GRAPHS / "cg_resnet50.txt").exists(),
                    reason=f"the authors' graph {GRAPHS / 'cg_resnet50.txt'} is absent: put "
                           f"their cg_*.txt files in {GRAPHS} to run this test")
def test_authors_graph(capsys):
    rc = main(["--graph", str(GRAPHS / "cg_resnet50.txt"), "--solver", "exact",
               "--budget", "2GB", "-q"])
    out = capsys.readouterr().out
    assert rc == 0 and "176 functions" in out and "the authors' format" in out
    assert "the paper's model" in out  # their format records activations only


def test_planning_a_saved_graph_does_not_import_chainer(tmp_path):
    """The CLI plans a saved graph with the pure core only (importing
    Chainer alone takes about half a second)."""
    from chainer_recompute.core.graph import Graph
    from chainer_recompute.core.io import save_graph
    path = tmp_path / "g.json"
    save_graph(Graph.from_edges([4, 8, 4, 2], [(0, 1), (1, 2), (2, 3)]), path)
    code = ("import sys; from chainer_recompute.cli import main; "
            f"rc = main(['--graph', {str(path)!r}, '--budget', 'least', '-q']); "
            "assert rc == 0, rc; "
            "assert 'chainer' not in sys.modules, 'chainer was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_every_model_name_is_accepted():
    from chainer_recompute.models import MODELS
    parser = build_parser()
    for name in MODELS:
        assert parser.parse_args(["--model", name]).model == name


# ------------------------------------------------------- dry-run capture
@pytest.mark.parametrize("name,sides,target", [("unet", (236, 220, 204), 268),
                                               ("pspnet", (137, 89, 41), 185)])
def test_input_size_extrapolation_is_exact(name, sides, target):
    """Shapes extrapolated from three smaller inputs equal those recorded at
    the target size (the reduced networks, same graph shapes)."""
    import chainer
    import numpy
    from chainer_recompute import bench
    from chainer_recompute.models import get_model
    label = bench.INPUT_SIZES[name].label

    def record(side):
        numpy.random.seed(0)
        spec = get_model(name, small=True)
        opt = chainer.optimizers.MomentumSGD()
        opt.setup(spec.link)
        rng = numpy.random.RandomState(0)
        x = rng.standard_normal((1,) + spec.input_shape[:-2] + (side, side)).astype("f")
        t = rng.randint(0, spec.n_class, size=(1, label(side), label(side))).astype("i")
        return bench._record(spec.link, x, t, cost_model="measured", name=name, optimizer=opt,
                             progress=bench.Progress(enabled=False), label=str(side))

    g = bench.extrapolate_input_size([(s, record(s)) for s in sides], target)
    full = record(target)
    assert [(a.shape, a.nbytes) for a in g.arrays] == [(a.shape, a.nbytes) for a in full.arrays]
    assert [[(h.shape, h.nbytes) for h in n.held] for n in g.nodes] == \
        [[(h.shape, h.nbytes) for h in n.held] for n in full.nodes]
    assert g.backward_order == full.backward_order
    from chainer_recompute.core.replay import replay
    assert replay(g).peak_bytes == pytest.approx(replay(full).peak_bytes, rel=0.02)


def test_extrapolation_refuses_a_changing_graph():
    from chainer_recompute import bench
    from chainer_recompute.core.errors import CaptureError
    from chainer_recompute.core.graph import Graph
    a = Graph.from_edges([4, 4], [(0, 1)])
    b = Graph.from_edges([4, 4, 4], [(0, 1), (1, 2)])
    with pytest.raises(CaptureError, match="changes with the input size"):
        bench.extrapolate_input_size([(20, a), (12, b)], 100)


def test_default_capture_batch_predicts_the_full_batch():
    """The CLI's default capture batch, scaled, predicts the small U-Net's
    plain peak at batch 8 as a batch-8 recording does (a batch-1 recording
    under-counts it: Chainer's convolution makes one column buffer fewer
    at batch 1)."""
    from chainer_recompute import bench
    from chainer_recompute.core.replay import replay
    cb = build_parser().parse_args(["--model", "unet", "--small"]).capture_batch
    scaled, _ = bench.dry_run_graph("unet", 8, small=True, capture_batch=cb)
    direct, _ = bench.dry_run_graph("unet", 8, small=True, capture_batch=8)
    assert replay(scaled).peak_bytes == pytest.approx(replay(direct).peak_bytes, rel=1e-3)


def test_run_prints_the_measured_saving(capsys):
    """With --vanilla the command says the measured peaks of plain Chainer
    and the plan, the saving, and the budget apply() planned for."""
    assert main(["--model", "mlp", "--iterations", "2", "--vanilla", "-q"]) == 0
    out = capsys.readouterr().out
    line = [s for s in out.splitlines() if s.startswith("measured against plain Chainer")]
    assert len(line) == 1 and "% less" in line[0] and "apply() planned for" in line[0]
    assert "OVER" not in line[0]


def test_batch_scaling_keeps_parameter_gradients():
    """A batch-2 recording scaled to 8 predicts the plain peak of a batch-8
    recording (the parameter gradients a backward makes do not scale)."""
    from chainer_recompute import bench
    from chainer_recompute.core.replay import replay
    scaled, _ = bench.dry_run_graph("resnet50", 8, small=True, capture_batch=2)
    direct, _ = bench.dry_run_graph("resnet50", 8, small=True, capture_batch=8)
    assert scaled.backward_order == direct.backward_order
    assert replay(scaled).peak_bytes == pytest.approx(replay(direct).peak_bytes, rel=1e-3)


def test_a_batch_1_recording_below_the_batch_is_refused(capsys):
    """--capture-batch 1 under-counts every larger batch (at batch 1
    NumPy's convolutions make one column buffer fewer): refused with the
    reason and what to use, before anything is recorded; at batch 1 it is
    the full batch."""
    assert main(["--model", "vgg19", "--small", "--batch-size", "8", "--capture-batch", "1",
                 "--dry-run", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--capture-batch 1 under-counts batch 8" in err
    assert "use --capture-batch 2 (the default) or more, or 0" in err
    assert main(["--model", "mlp", "--batch-size", "1", "--capture-batch", "1", "-q"]) == 0


def test_help_and_readme_name_the_same_flags():
    """Every option of the command is in the README's "## Command line"
    table (by one of its names), and the table names no other."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Command line", 1)[1].split("\n## ", 1)[0]
    first_cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    readme = {m for cell in first_cells for m in re.findall(r"`(--?[a-z][a-z-]*)", cell)}
    actions = [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    missing = [a.option_strings for a in actions if not readme & set(a.option_strings)]
    known = {s for a in actions for s in a.option_strings}
    assert missing == [], f"options the README's table lacks: {missing}"
    assert readme <= known, f"flags in the README the command lacks: {sorted(readme - known)}"
