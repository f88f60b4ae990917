"""The command line answers before long work: a run that cannot fit is
refused before anything is built at the full batch, an allocation that
fails is reported as out of memory, and the ``next:`` line follows what
was planned or measured."""
import time

import pytest

import chainer_recompute.cli as cli
from chainer_recompute.cli import build_parser, main
from chainer_recompute.cli import preflight
from chainer_recompute.cli.report import _next_command

GiB = 2 ** 30


def _no_full_batch(monkeypatch):
    """Make building the network at the full batch (and, before the
    refusal, planning) fail the test."""
    from chainer_recompute import bench

    def built(*a, **k):
        raise AssertionError("the network was built at the full batch")
    monkeypatch.setattr(bench, "network", built)


def test_huge_batch_is_refused_before_planning_or_building(capsys, monkeypatch):
    """A small convnet at batch 10^9 (petabytes, whatever the machine):
    refused after the small recording, before planning and before the
    network is built at that batch; the line gives the estimate, what is
    available and what to try."""
    _no_full_batch(monkeypatch)

    def planned(*a, **k):
        raise AssertionError("planned before the refusal")
    monkeypatch.setattr(cli, "plan_report", planned)
    t0 = time.perf_counter()
    rc = main(["--model", "resnet50", "--small", "--batch-size", str(10 ** 9),
               "--iterations", "1", "-q"])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "not enough memory" in err and "of host memory" in err and "available now" in err
    assert "at least" in err and "Convolution2DFunction" in err  # the floor and its parts
    assert "recorded at batch 2 and scaled to 1000000000" in err
    assert "--batch-size" in err and "--dry-run" in err and "--no-memory-check" in err
    assert "a bug?" not in err and len(err.strip().splitlines()) == 1
    assert took < 30, took


def _least_peaks(model, batch):
    """The small recording's floor and the least plan's replayed peak."""
    from chainer_recompute import bench
    from chainer_recompute.cli.planning import plan_report
    graph, _ = bench.dry_run_graph(model, batch, capture_batch=2)
    report = plan_report(graph, "least")
    return graph, preflight.plan_floor(graph)[0], report["plan"]["replayed_peak_bytes"]


def test_the_plans_own_figure_is_checked_after_planning(capsys, monkeypatch):
    """Available memory between the floor and the plan's replayed peak:
    past the first check, refused by the second, still before the
    network is built at the full batch."""
    graph, floor, peak = _least_peaks("mlp", 64)
    params = graph.state_bytes.get("params", graph.param_bytes)
    assert floor < peak
    avail = (floor + peak) // 2 + params
    monkeypatch.setattr(preflight, "available_memory", lambda device: (avail, "host memory"))
    _no_full_batch(monkeypatch)
    rc = main(["--model", "mlp", "--batch-size", "64", "--iterations", "1", "-q"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "not enough memory" in err and "the plan's iteration" in err
    assert "at least" not in err  # the plan's replayed peak, not the floor


def test_a_run_that_fits_is_not_refused(capsys, monkeypatch):
    """Plenty available: the run goes on, and report.json keeps the estimate."""
    monkeypatch.setattr(preflight, "available_memory", lambda device: (64 * GiB, "host memory"))
    rc = main(["--model", "mlp", "--iterations", "2", "-q"])
    assert rc == 0, capsys.readouterr().err


@pytest.mark.parametrize("module, where", [("builtins", "host"), ("cupy.cuda.memory", "GPU")])
def test_an_allocation_that_fails_is_reported_as_memory(module, where, capsys, monkeypatch):
    """numpy's MemoryError and CuPy's OutOfMemoryError (a MemoryError too):
    one line about memory, exit status 1, no "a bug?"."""
    oom = type("OutOfMemoryError", (MemoryError,), {"__module__": module})

    def run(args):
        raise oom("Unable to allocate 68.7 GiB for an array with shape (10000, 3, 7, 7, "
                  "112, 112) and data type float32")
    monkeypatch.setattr(cli, "_run", run)
    monkeypatch.setattr(preflight, "available_memory", lambda device: (20 * GiB, "host memory"))
    rc = main(["--model", "mlp", "--iterations", "1", "-q"])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"out of {where} memory: Unable to allocate 68.7 GiB" in err
    assert "20.00 GiB of host memory is available now" in err
    assert "--batch-size" in err and "--budget least" in err and "--dry-run" in err
    assert "a bug?" not in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ next:
def _report(budget_text, budget_bytes, *, plan_recompute=True, least_recompute=True,
            runs=None, batch=32, iteration_s=None):
    row = dict(recompute=plan_recompute, saving_fraction=0.54 if plan_recompute else 0.0,
               replayed_peak_bytes=3 * GiB, predicted_peak_bytes=3 * GiB)
    least = dict(recompute=least_recompute, saving_fraction=0.72, budget_bytes=2 * GiB,
                 replayed_peak_bytes=2 * GiB)
    r = {"plan": row, "least": least,
         "budget": {"text": budget_text, "bytes": budget_bytes, "scope": "total"},
         "plain": {"predicted_peak_bytes": 6 * GiB, "replayed_peak_bytes": 6 * GiB},
         "graph": {"batch_size": batch, "iteration_s": iteration_s},
         "source": {"batch_size": batch}}
    if runs is not None:
        r["runs"] = runs
    return r


def _args(*argv):
    return build_parser().parse_args(list(argv))


def test_next_after_a_size_budget_dry_run_keeps_the_budget_meaningful():
    """After a 3G dry run of the full network (slow to run here), the
    suggested measurement is not the reduced network at 3G (where plain
    backprop fits): it is at the reduced network's own least budget."""
    args = _args("--model", "resnet152", "--budget", "3G", "--dry-run")
    text = _next_command(args, _report("3G", 3 * GiB, iteration_s=30.0))
    assert "--small" in text and "--budget least" in text and "--budget 3G" not in text
    assert "3G is sized for resnet152 at batch 32" in text


def test_next_after_a_quick_dry_run_measures_the_same_plan(monkeypatch):
    """Where the full network's iterations are quick and fit, the same plan
    (same network, batch and budget) is what the next command measures."""
    monkeypatch.setattr(preflight, "available_memory", lambda device: (64 * GiB, "host memory"))
    args = _args("--model", "resnet152", "--budget", "3G", "--dry-run")
    text = _next_command(args, _report("3G", 3 * GiB, iteration_s=1.0))
    assert "--budget 3G" in text and "--iterations" in text and "--small" not in text
    monkeypatch.setattr(preflight, "available_memory", lambda device: (GiB, "host memory"))
    text = _next_command(args, _report("3G", 3 * GiB, iteration_s=1.0))
    assert "--small" in text  # it would not fit here


def test_next_after_a_run_that_recomputed_nothing():
    """The run's plan recomputed nothing (plain Chainer fits in the budget):
    the API call with that budget is not suggested; the least budget is."""
    runs = [{"label": "vanilla", "plan": None},
            {"label": "auto-tc", "plan": {"recompute": False, "predicted_peak_bytes": 6 * GiB}}]
    args = _args("--model", "resnet152", "--small", "--batch-size", "4", "--budget", "3G",
                 "--iterations", "3", "--vanilla")
    text = _next_command(args, _report("3G", 3 * GiB, plan_recompute=False, runs=runs, batch=4))
    assert "apply(" not in text
    assert "--budget 2.00GiB" in text and "--iterations 3 --vanilla" in text
    assert "nothing was recomputed" in text
    runs[1]["plan"]["recompute"] = True
    text = _next_command(args, _report("3G", 3 * GiB, runs=runs, batch=4))
    assert "apply(model, budget='3G')" in text


def test_measured_saving_is_printed_beside_the_prediction_of_the_plan_that_ran(capsys):
    rc = main(["--model", "mlp", "--iterations", "2", "--vanilla", "-q"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "saving (predicted)" in out
    line = [s for s in out.splitlines() if s.startswith("measured against plain Chainer")]
    assert len(line) == 1 and "% less" in line[0] and "predicted for that plan:" in line[0]


@pytest.mark.slow
def test_resnet152_at_batch_10000_is_refused_in_seconds(capsys, monkeypatch):
    """The issue's command: refused well before the 66 s a build at that
    batch took, and before any build."""
    _no_full_batch(monkeypatch)
    t0 = time.perf_counter()
    rc = main(["--model", "resnet152", "--batch-size", "10000", "--iterations", "1", "-q"])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert rc == 2 and "not enough memory" in err, err
    assert took < 40, took


def test_gpu_availability_counts_the_pool_cache_and_its_limit(monkeypatch):
    """On CuPy: the device's free memory plus what the pool caches, bounded
    by the pool's limit where one is set (a stand-in CuPy module)."""
    import contextlib
    import types

    class Pool:
        limit = 0

        def free_bytes(self):
            return 2 * GiB

        def used_bytes(self):
            return 3 * GiB

        def get_limit(self):
            return self.limit

    pool = Pool()
    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=lambda i: contextlib.nullcontext(),
                                   runtime=types.SimpleNamespace(
                                       memGetInfo=lambda: (5 * GiB, 16 * GiB))),
        get_default_memory_pool=lambda: pool)
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake)
    assert preflight.available_memory("@cupy:1") == (7 * GiB, "GPU 1 memory")
    pool.limit = 4 * GiB
    assert preflight.available_memory("@cupy:0") == (GiB, "GPU 0 memory")
    assert preflight.available_memory("@numpy")[1] == "host memory"
