"""Tests of chainer_recompute.models: registry, shapes, losses, graph shapes.

The graph-shape tests compare the function counts of one forward pass with
those of the authors' dumps (``shared/graphs/cg_*.txt``, batch 32 / 8); the
counts are hard-coded here, and checked against the dumps when present.
Chainer 7.8.1 names max pooling ``MaxPoolingND`` where the authors' Chainer
said ``MaxPooling2D``, and ``+`` is ``Add``: :func:`count_functions`
normalizes both.
"""
from __future__ import annotations

import collections
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Counter, Dict, Optional

import numpy
import pytest

from chainer_recompute.models import MODELS, ModelSpec, get_model

chainer = pytest.importorskip("chainer")

ROOT = Path(__file__).resolve().parents[1]
_GRAPH_DIRS = [ROOT / "shared" / "graphs", ROOT.parent / "shared" / "graphs"]

# Forward function counts in the authors' dumps (graph at batch 32 / 8).
AUTHORS_DENSENET161 = {
    "Convolution2DFunction": 160, "BatchNormalization": 161, "ReLU": 161, "Concat": 78,
    "AveragePooling2D": 4, "MaxPooling2D": 1, "Reshape": 1, "LinearFunction": 1,
    "SoftmaxCrossEntropy": 1}
AUTHORS_UNET = {
    "Convolution2DFunction": 19, "ReLU": 22, "MaxPooling2D": 4, "Dropout": 2,
    "Deconvolution2DFunction": 4, "GetItem": 4, "Concat": 4, "SoftmaxCrossEntropy": 1}
AUTHORS_RESNET50 = {
    "Convolution2DFunction": 53, "BatchNormalization": 53, "ReLU": 49, "Add": 16,
    "MaxPooling2D": 1, "AveragePooling2D": 1, "Reshape": 1, "LinearFunction": 1,
    "SoftmaxCrossEntropy": 1}
AUTHORS_VGG19 = {
    "Convolution2DFunction": 16, "ReLU": 18, "MaxPooling2D": 5, "LinearFunction": 3,
    "Dropout": 2, "Reshape": 1, "SoftmaxCrossEntropy": 1}

_RENAME = {"MaxPoolingND": "MaxPooling2D", "AveragePoolingND": "AveragePooling2D"}


class _Counter(chainer.FunctionHook):
    name = "TestFunctionCounter"

    def __init__(self) -> None:
        self.counts: Counter[str] = collections.Counter()

    def forward_preprocess(self, function, in_data) -> None:
        self.counts[_RENAME.get(type(function).__name__, type(function).__name__)] += 1


def count_functions(spec: ModelSpec, batch_size: int = 1) -> Dict[str, int]:
    """Function applications by class name in one forward pass with the loss."""
    x, t = spec.make_inputs(batch_size)
    hook = _Counter()
    with hook, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec.link(x, t)
    return dict(hook.counts)


def _authors_graph(name: str) -> Optional[Path]:
    for d in _GRAPH_DIRS:
        if (d / f"cg_{name}.txt").exists():
            return d / f"cg_{name}.txt"
    return None


def _read_authors(path: Path):
    """(parameter names, forward counts) of an authors' dump."""
    lines = path.read_text().split("\n")
    n_var, _ = map(int, lines[0].split())
    params = {ln.split(" ", 2)[2] for ln in lines[1:1 + n_var]}
    params = {p for p in params if p.startswith("/")}
    counts: Counter[str] = collections.Counter()
    i = 1 + n_var
    while i < len(lines) and lines[i].strip():
        n_in, n_out = map(int, lines[i + 1].split())
        if lines[i] == "forward":
            counts[lines[i + 2 + n_in + n_out]] += 1
        json.loads(lines[i + 3 + n_in + n_out])
        i += 4 + n_in + n_out
    return params, dict(counts)


def _train_step(spec: ModelSpec, batch_size: int) -> float:
    x, t = spec.make_inputs(batch_size)
    spec.link.cleargrads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # batch-1 BatchNorm warning
        loss = spec.link(x, t)
        assert loss.shape == ()
        loss.backward()
    value = float(loss.array)
    assert numpy.isfinite(value)
    for path, param in spec.link.namedparams():
        assert param.grad is not None, path
        assert numpy.all(numpy.isfinite(param.grad)), path
    return value


@pytest.fixture(scope="module")
def small_specs() -> Dict[str, ModelSpec]:
    return {}


def _small(cache: Dict[str, ModelSpec], name: str) -> ModelSpec:
    if name not in cache:
        cache[name] = get_model(name, small=True)
    return cache[name]


# --- registry ---------------------------------------------------------------

def test_registry_names():
    assert sorted(MODELS) == ["densenet161", "googlenet", "mlp", "pspnet", "resnet101",
                              "resnet152", "resnet50", "unet", "vgg19"]


def test_unknown_name_lists_models():
    with pytest.raises(ValueError) as info:
        get_model("resnet18")
    assert str(sorted(MODELS)) in str(info.value)


def test_unknown_name_imports_nothing_heavy():
    code = ("import sys\n"
            "from chainer_recompute.models import get_model\n"
            "try:\n    get_model('nope')\nexcept ValueError:\n    pass\n"
            "heavy = [m for m in ('chainer', 'cupy') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_bad_batch_size():
    with pytest.raises(ValueError):
        get_model("mlp", batch_size=0)


def test_paper_batch_sizes():
    expected = {"resnet50": 32, "resnet101": 32, "resnet152": 32, "vgg19": 32,
                "googlenet": 32, "densenet161": 32, "unet": 8, "pspnet": 1}
    assert {n: MODELS[n][1] for n in expected} == expected
    assert get_model("mlp", batch_size=5).default_batch_size == 5


@pytest.mark.parametrize("name", ["mlp", "resnet50", "resnet101", "resnet152", "googlenet",
                                  "densenet161", "pspnet", "unet"])
def test_constructs_small(small_specs, name):
    spec = _small(small_specs, name)
    assert spec.name == name and spec.small
    assert isinstance(spec.link, chainer.Link)
    x, t = spec.make_inputs(2)
    assert x.dtype == numpy.float32 and x.shape == (2,) + spec.input_shape
    assert t.dtype == numpy.int32 and t.shape == (2,) + spec.label_shape
    assert t.min() >= 0 and t.max() < spec.n_class
    x2, t2 = spec.make_inputs(2, seed=0)
    assert numpy.array_equal(x, x2) and numpy.array_equal(t, t2)


@pytest.mark.parametrize("name, input_shape, label_shape, n_class", [
    ("densenet161", (3, 224, 224), (), 1000),
    ("unet", (1, 572, 572), (388, 388), 2),
    ("pspnet", (3, 713, 713), (713, 713), 17),
    ("googlenet", (3, 224, 224), (), 1000),
    ("resnet50", (3, 224, 224), (), 1000),
])
def test_constructs_full(name, input_shape, label_shape, n_class):
    spec = get_model(name)
    assert (spec.input_shape, spec.label_shape, spec.n_class) == (input_shape, label_shape,
                                                                  n_class)
    assert spec.default_batch_size == MODELS[name][1]
    assert spec.make_inputs(1)[0].shape == (1,) + input_shape


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_constructs_every_full_model(name):
    spec = get_model(name)
    assert isinstance(spec.link, chainer.Link)


def test_n_class_replaces_classifier(small_specs):
    spec = get_model("resnet50", small=True, n_class=7)
    assert spec.link.predictor.fc6.out_size == 7 and spec.n_class == 7
    _train_step(spec, 2)


# --- forward + backward -------------------------------------------------------

@pytest.mark.parametrize("name, batch", [("mlp", 4), ("densenet161", 2), ("pspnet", 2),
                                         ("unet", 1), ("resnet50", 2), ("googlenet", 1)])
def test_small_forward_backward(small_specs, name, batch):
    _train_step(_small(small_specs, name), batch)


@pytest.mark.slow
@pytest.mark.parametrize("name, batch", [("resnet101", 2), ("resnet152", 2), ("vgg19", 1)])
def test_small_forward_backward_slow(small_specs, name, batch):
    _train_step(_small(small_specs, name), batch)


def test_make_inputs_cupy_like_xp():
    class FakeXp:
        @staticmethod
        def asarray(a):
            return ("converted", a.shape)
    x, t = get_model("mlp").make_inputs(3, xp=FakeXp)
    assert x == ("converted", (3, 784)) and t == ("converted", (3,))


# --- U-Net ------------------------------------------------------------------

def test_unet_size_arithmetic():
    from chainer_recompute.models.unet import is_valid_input_size, output_size
    assert output_size(572) == 388
    assert output_size(188) == 4
    assert output_size(204) == 20
    assert [s for s in range(150, 600) if is_valid_input_size(s)] == list(range(188, 600, 16))
    with pytest.raises(ValueError):
        output_size(570)
    with pytest.raises(ValueError):
        output_size(172)


@pytest.mark.parametrize("size", [188, 204])
def test_unet_small_output_shape(small_specs, size):
    from chainer_recompute.models.unet import output_size
    link = _small(small_specs, "unet").link
    with chainer.using_config("train", False):
        y = link.predict(numpy.zeros((1, 1, size, size), numpy.float32))
    assert y.shape == (1, 2, output_size(size), output_size(size))


def test_unet_graph_matches_authors(small_specs):
    assert count_functions(_small(small_specs, "unet")) == AUTHORS_UNET
    assert sum(AUTHORS_UNET.values()) == 60


@pytest.mark.slow
def test_unet_full_shape_and_graph():
    spec = get_model("unet")
    with chainer.using_config("train", False), chainer.no_backprop_mode():
        y = spec.link.predict(spec.make_inputs(1)[0])
    assert y.shape == (1, 2, 388, 388)
    assert count_functions(spec) == AUTHORS_UNET


# --- PSPNet -----------------------------------------------------------------

@pytest.mark.parametrize("size", [(65, 65), (49, 81)])
def test_pspnet_small_output_shape(small_specs, size):
    link = _small(small_specs, "pspnet").link
    with chainer.using_config("train", False), chainer.no_backprop_mode():
        y = link.predict(numpy.zeros((2, 3) + size, numpy.float32))
    assert y.shape == (2, 17) + size


def test_pspnet_loss_has_aux_and_ignore_label():
    from chainer_recompute.models.pspnet import PSPNet
    net = PSPNet(n_class=3, n_blocks=(1, 1, 1, 1), width=2, dropout_ratio=0.0)
    x = numpy.random.RandomState(0).standard_normal((2, 3, 33, 33)).astype(numpy.float32)
    t = numpy.random.RandomState(1).randint(0, 3, (2, 33, 33)).astype(numpy.int32)
    t[:, :5] = -1
    loss = net(x, t)
    main = chainer.functions.softmax_cross_entropy(net.predict(x), t)
    assert float(loss.array) > float(main.array)  # aux term is positive
    net.aux_weight = 0.0
    assert numpy.allclose(float(net(x, t).array), float(main.array), rtol=1e-5)


def test_pspnet_graph_shape(small_specs):
    counts = count_functions(_small(small_specs, "pspnet"), 2)
    # ResNet-101 trunk: 3 stem + 33 blocks x 3 + 4 projections = 106 conv/BN;
    # PPM 4, head 2, aux 2 -> 114 conv, 112 BN.
    assert counts["Convolution2DFunction"] == 114
    assert counts["BatchNormalization"] == 112
    assert counts["Add"] == 33 + 1  # residual adds + main + 0.4 * aux
    assert counts["ResizeImages"] == 6
    assert counts["AveragePooling2D"] == 4
    assert counts["SoftmaxCrossEntropy"] == 2


# --- DenseNet ---------------------------------------------------------------

def test_densenet161_graph_matches_authors(small_specs):
    assert count_functions(_small(small_specs, "densenet161")) == AUTHORS_DENSENET161
    assert sum(AUTHORS_DENSENET161.values()) == 568


def test_densenet161_full_widths():
    from chainer_recompute.models.densenet import densenet161
    net = densenet161()
    assert net.out_features == 2208
    assert net.c0.W.shape == (96, 3, 7, 7)
    assert net.d3[23].c1.W.shape == (48, 192, 3, 3)
    assert net.t2.c0.W.shape == (1056, 2112, 1, 1)
    assert net.fc.W.shape == (1000, 2208)


@pytest.mark.slow
def test_densenet161_full_graph():
    assert count_functions(get_model("densenet161")) == AUTHORS_DENSENET161


def test_resnet50_graph_matches_authors(small_specs):
    assert count_functions(_small(small_specs, "resnet50")) == AUTHORS_RESNET50


@pytest.mark.slow
def test_vgg19_graph_matches_authors(small_specs):
    assert count_functions(_small(small_specs, "vgg19")) == AUTHORS_VGG19


# --- the authors' dumps, when present ----------------------------------------

@pytest.mark.parametrize("name, expected", [("densenet", AUTHORS_DENSENET161),
                                            ("unet", AUTHORS_UNET),
                                            ("resnet50", AUTHORS_RESNET50),
                                            ("vgg19", AUTHORS_VGG19)])
def test_hardcoded_counts_match_dumps(name, expected):
    path = _authors_graph(name)
    if path is None:
        pytest.skip("shared/graphs not available")
    _, counts = _read_authors(path)
    assert counts == expected


@pytest.mark.parametrize("graph, name", [("densenet", "densenet161"), ("unet", "unet")])
def test_parameter_paths_match_dumps(small_specs, graph, name):
    path = _authors_graph(graph)
    if path is None:
        pytest.skip("shared/graphs not available")
    params, _ = _read_authors(path)
    ours = {p for p, _ in _small(small_specs, name).link.namedparams()}
    # The dump lists the parameters that a function reads: all of ours.
    assert params == ours


def test_pspnet_paper_input_size_at_tiny_width():
    """713x713 -> 90x90 features (output stride 8), exact PPM bins, 713 output."""
    from chainer_recompute.models.pspnet import PSPNet
    net = PSPNet(n_class=17, n_blocks=(1, 1, 1, 1), width=2)
    x = numpy.zeros((1, 3, 713, 713), numpy.float32)
    with chainer.using_config("train", False), chainer.no_backprop_mode():
        res4, res5 = net.trunk(x)
        y = net.predict(x)
    assert res4.shape[2:] == res5.shape[2:] == (90, 90)
    assert [90 // b * b for b in net.ppm.bins] == [90] * 4
    assert y.shape == (1, 17, 713, 713)
