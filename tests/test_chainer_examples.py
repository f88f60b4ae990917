"""Chainer v7.8.1's own example scripts, plain against the one line
``chainer_recompute.apply(model, budget='least')``, bit for bit.

The scripts are vendored unmodified under tests/chainer_examples/;
tests/chainer_examples/harness.py runs each one's ``main()`` on seeded random
data of the real shapes, twice, and compares after every backward and every
iteration: reported values, every gradient, parameter, persistent, link
state (LSTM h/c), optimizer state, and NumPy's and Python's global RNG state.

Each applied link must also have been planned (``cr.runner_of(link).plans``
not empty) with a plan that drops something, so that "identical" cannot
come from an apply() that did nothing or kept everything. These tests are not xfailed when the runtime gets an example wrong:
a failure's message is the harness's report (first differing iteration and
keys, or the crash). ``CR_EXAMPLES_BUDGET=least-shim`` runs them at the least
feasible budget even where ``apply`` does not accept ``'least'`` (a
diagnostic; see ``harness.least_shim``).
"""
from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_PATH = os.path.join(HERE, "chainer_examples", "harness.py")
_spec = importlib.util.spec_from_file_location("chainer_examples_harness", _PATH)
harness = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = harness
_spec.loader.exec_module(harness)

import chainer  # noqa: E402  (after the harness, which imports chainer_recompute first)

BUDGET = os.environ.get("CR_EXAMPLES_BUDGET", "least")

# mnist, cifar-vgg, ptb, dcgan-gen, dcgan-dis, dcgan-both, vae, imagenet-<arch>
VARIANTS = list(harness.VARIANTS)
#: 8-22 s each at the light size: in the slow run only (NIN stays in the
#: default run; GoogLeNet, with its three losses, and VGG are in the slow
#: run's full list)
HEAVY = {"imagenet-alex", "imagenet-googlenetbn", "imagenet-resnet50", "imagenet-resnext50",
         "imagenet-googlenet", "cifar-vgg"}
LIGHT = [pytest.param(v, marks=pytest.mark.slow) if v in HEAVY else v for v in VARIANTS]


def _check(result):
    if not (result.applied.applied_to and result.identical):
        pytest.fail(result.report(), pytrace=False)
    # identical because it recomputed, not because apply() did nothing
    if not all(result.applied.n_plans):
        pytest.fail("no plan was made for some applied link (cr.runner_of(link).plans):\n"
                    + result.report(), pytrace=False)
    if not all(result.applied.n_dropped):
        pytest.fail(f"a plan keeps everything (nodes dropped per applied link: "
                    f"{result.applied.n_dropped}):\n" + result.report(), pytrace=False)


#: At the least total budget the DCGAN nets' plans keep everything (plain
#: backprop's peak is already the least: their parameters and Adam state
#: dominate at the light size); the paper's activations-only model makes
#: them drop, so that the comparison exercises recomputation.
OPTIONS = {v: {"budget_scope": "activations"} for v in ("dcgan-gen", "dcgan-dis", "dcgan-both")}


@pytest.mark.parametrize("variant", LIGHT)
def test_example_bit_identical(variant, tmp_path):
    """3 optimizer steps (PTB: 3 updates of bproplen 3), small batches
    (ImageNet: batch 2 at 224 x 224, the Evaluator every iteration)."""
    _check(harness.compare_variant(variant, str(tmp_path), size="light", budget=BUDGET,
                                   apply_options=OPTIONS.get(variant)))


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_example_bit_identical_full(variant, tmp_path):
    """4 steps at larger batches and the scripts' default widths
    (MNIST --unit 1000, VAE --dim-h 500, PTB --unit 200 --bproplen 10)."""
    _check(harness.compare_variant(variant, str(tmp_path), size="full", budget=BUDGET,
                                   apply_options=OPTIONS.get(variant)))


# ------------------------------------------------------ the harness itself
@pytest.mark.slow  # 6 s
def test_harness_plain_runs_are_identical_and_leave_no_patch(tmp_path):
    """Two plain runs of the DCGAN example (randomness in the forward,
    BatchNorm, two optimizers) are identical, so any difference in the
    tests above comes from apply(); and the harness undoes its patches."""
    def patched():
        return (chainer.optimizer.GradientMethod.setup, chainer.optimizer.Optimizer.call_hooks,
                chainer.training.Trainer.__init__,
                chainer.datasets.mnist._retrieve_mnist_training, chainer.datasets.cifar._get_cifar,
                chainer.datasets.image_dataset._read_image_as_array,
                chainer.iterators.MultiprocessIterator, chainer.training.extensions.PlotReport,
                np.savez_compressed)

    before = patched()
    result = harness.compare_variant("dcgan-both", str(tmp_path), control=True)
    if not result.identical:
        pytest.fail(result.report(), pytrace=False)
    steps = [label for label, _ in result.plain.records if label.isdigit()]
    assert steps == ["1", "2", "3"]
    # a record after each of the two backward passes of each iteration
    assert sum("optimizer, after backward" in label for label, _ in result.plain.records) == 6
    assert before == patched()
    for name in ("net", "updater", "visualize", "models", "matplotlib", "PIL"):
        mod = sys.modules.get(name)
        assert mod is None or not os.path.abspath(getattr(mod, "__file__", "") or "").startswith(
            os.path.join(HERE, "chainer_examples")), name
        assert not getattr(mod, "__chainer_examples_stub__", False), name


def test_harness_reports_the_first_difference(tmp_path):
    """A fake apply() that draws one number from NumPy's global RNG is caught
    at the first record, with the RNG named."""
    def drawing_apply(link, budget):
        np.random.rand()
        return link

    result = harness.compare_variant("mnist", str(tmp_path), apply_fn=drawing_apply)
    assert not result.identical
    label, diffs = result.first_difference
    assert label.startswith("0")
    assert diffs[0][0] == "rng/numpy" and "+2 32-bit draws" in diffs[0][1], diffs
    assert "first difference at iteration 0" in result.report()


def test_harness_catches_a_wrong_gradient_at_its_backward(tmp_path):
    """A fake apply() that scales the loss by (1 + 2**-20) is caught at the
    first backward, before the optimizer step, with the loss and gradients."""
    import chainer.functions as F

    def scaling_apply(link, budget):
        link.lossfun = lambda y, t: F.softmax_cross_entropy(y, t) * (1 + 2 ** -20)
        return link

    result = harness.compare_variant("mnist", str(tmp_path), apply_fn=scaling_apply)
    label, diffs = result.first_difference
    assert label.startswith("1 (main optimizer, after backward"), label
    keys = [k for k, _ in diffs]
    assert "obs/main/loss" in keys and "grad/main/predictor/l1/W" in keys, keys
    assert not any(k.startswith(("rng/", "param/")) for k in keys), keys


def test_harness_reports_a_crash(tmp_path):
    def crashing_apply(link, budget):
        raise RuntimeError("boom")

    result = harness.compare_variant("mnist", str(tmp_path), apply_fn=crashing_apply)
    assert result.crashed and not result.identical
    assert "RuntimeError: boom" in result.report()
