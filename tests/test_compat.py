"""Tests of chainer_recompute._compat: NumPy 2 / Python 3.12 shims for Chainer 7.8.1.

The fast tests run on the project's NumPy 1.x. The slow test builds a venv
with NumPy 2 and Chainer 7.8.1 under a temporary directory and runs real
Chainer work there in a subprocess (skipped when pip cannot install).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import venv
from pathlib import Path

import numpy
import pytest

from chainer_recompute import _compat

REPO = Path(__file__).resolve().parents[1]


def _fake_numpy(version: str = "2.1.0", with_sctypes: bool = False) -> types.ModuleType:
    """A module object shaped like NumPy 2: scalar types, no ``sctypes``."""
    fake = types.ModuleType("fakenumpy")
    fake.__version__ = version  # type: ignore[attr-defined]
    for names in _compat._SCTYPE_NAMES.values():
        for n in names:
            setattr(fake, n, getattr(numpy, n))
    fake.void = numpy.void  # type: ignore[attr-defined]
    if with_sctypes:
        fake.sctypes = {"int": []}  # type: ignore[attr-defined]
    return fake


def test_noop_and_idempotent_on_installed_numpy() -> None:
    if _compat.numpy_major(numpy) >= 2:
        pytest.skip("this test is about NumPy 1.x")
    before = set(vars(numpy))
    sctypes = numpy.sctypes
    assert _compat.ensure_numpy_compat() == ()
    assert _compat.ensure_numpy_compat() == ()
    assert set(vars(numpy)) == before
    assert numpy.sctypes is sctypes


def test_build_sctypes_equals_numpy_1() -> None:
    if _compat.numpy_major(numpy) >= 2:
        pytest.skip("needs NumPy 1.x's own sctypes to compare with")
    assert _compat.build_sctypes(numpy) == numpy.sctypes


def test_restores_sctypes_on_fake_numpy_2() -> None:
    fake = _fake_numpy("2.1.0")
    table: dict = {}
    patched = _compat.ensure_numpy_compat(fake, modules=table)
    assert "fakenumpy.sctypes" in patched
    assert [t().itemsize for t in fake.sctypes["int"]] == [1, 2, 4, 8]
    assert fake.sctypes["float"][1] is numpy.float32
    assert set(fake.sctypes) == {"int", "uint", "float", "complex", "others"}
    # fakenumpy.distutils does not exist, so the stub went into the given table.
    assert "fakenumpy.distutils.system_info" in patched
    assert table["fakenumpy.distutils.system_info"].get_info("blas_opt") == {}
    assert fake.distutils is table["fakenumpy.distutils"]
    assert "fakenumpy.sctypes" in _compat.PATCHED
    # Idempotent: nothing left to patch, the same objects stay.
    sctypes = fake.sctypes
    assert _compat.ensure_numpy_compat(fake, modules=table) == ()
    assert fake.sctypes is sctypes


def test_fake_numpy_1_and_existing_names_left_alone() -> None:
    old = _fake_numpy("1.26.4")
    assert _compat.ensure_numpy_compat(old, modules={}) == ("fakenumpy.distutils.system_info",)
    assert not hasattr(old, "sctypes")
    present = _fake_numpy("2.0.0", with_sctypes=True)
    _compat.ensure_numpy_compat(present, modules={})
    assert present.sctypes == {"int": []}


def test_fake_module_without_table_does_not_touch_sys_modules() -> None:
    fake = _fake_numpy("2.0.0")
    assert _compat.ensure_numpy_compat(fake) == ("fakenumpy.sctypes",)
    assert "fakenumpy.distutils" not in sys.modules


def test_distutils_stub_message_and_available() -> None:
    fake = types.SimpleNamespace(__name__="fakenp2")
    table: dict = {}
    assert not _compat.ensure_distutils_stub(fake, table, available=True)
    assert table == {}
    assert _compat.ensure_distutils_stub(fake, table, available=False)
    with pytest.raises(AttributeError, match="stub installed by chainer_recompute"):
        table["fakenp2.distutils"].misc_util


def test_pkg_resources_check(monkeypatch: pytest.MonkeyPatch) -> None:
    _compat.check_pkg_resources()  # installed here: silent
    real = _compat.importlib.util.find_spec

    def no_pkg_resources(name: str, *args: object):
        return None if name == "pkg_resources" else real(name, *args)

    monkeypatch.setattr(_compat.importlib.util, "find_spec", no_pkg_resources)
    with pytest.raises(ImportError, match=r"pip install 'setuptools<81'"):
        _compat.check_pkg_resources()


# --------------------------------------------------------------------------
# The real check: NumPy 2 in its own venv.

#: Run in a subprocess by the slow test, on NumPy 2 and on the project's own
#: NumPy for comparison. Prints one JSON line prefixed with RESULT=.
CHECK_SCRIPT = r'''
import json, logging, sys, time, warnings
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import numpy as np
import chainer_recompute._compat as compat
patched = compat.ensure_numpy_compat()
again = compat.ensure_numpy_compat()
caught = []
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as w:
    import chainer
    import chainer.functions as F
    import chainer.links as L
    from chainer import gradient_check
    from chainer.links.model.vision.resnet import ResNet50Layers
    out = {"python": sys.version.split()[0], "numpy": np.__version__,
           "chainer": chainer.__version__, "patched": list(compat.PATCHED), "first_call": list(patched),
           "second_call": list(again)}

    # conv + BN + ReLU + max pooling + dropout + linear + softmax cross entropy
    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.conv = L.Convolution2D(3, 8, 3, pad=1, initialW=chainer.initializers.Normal(0.1))
                self.bn = L.BatchNormalization(8)
                self.fc = L.Linear(8 * 4 * 4, 5, initialW=chainer.initializers.Normal(0.1))
        def forward(self, x):
            h = F.max_pooling_2d(F.relu(self.bn(self.conv(x))), 2)
            h = F.dropout(h, 0.0)
            return self.fc(h)
    rng = np.random.RandomState(0)
    net = Net()
    for p in net.params():
        p.array[...] = rng.standard_normal(p.shape).astype(p.dtype) * 0.1
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    t = np.array([0, 1, 2, 3], np.int32)
    loss = F.softmax_cross_entropy(net(x), t)
    net.cleargrads()
    loss.backward()
    out["small_loss"] = float(loss.array)
    out["small_grad_norms"] = {name: float(np.linalg.norm(p.grad)) for name, p in sorted(net.namedparams())}
    out["small_running_mean_sum"] = float(net.bn.avg_mean.sum())
    with chainer.using_config("train", True):
        y = F.dropout(np.ones((100, 100), np.float32), 0.5)
        out["dropout_kept_fraction"] = float((y.array != 0).mean())

    # gradient_check on a few functions, in float64
    checked = []
    def gc(name, f, inputs, **kw):
        gy = rng.standard_normal(f(*inputs).shape)
        gradient_check.check_backward(f, inputs, gy, dtype=np.float64, **kw)
        checked.append(name)
    xs = rng.standard_normal((2, 3, 6, 6))
    W = rng.standard_normal((4, 3, 3, 3))
    b = rng.standard_normal(4)
    gc("relu", F.relu, (xs + np.sign(xs) * 0.1,))
    gc("convolution_2d", lambda a, w, c: F.convolution_2d(a, w, c, pad=1), (xs, W, b))
    gamma, beta = rng.standard_normal(3) + 2.0, rng.standard_normal(3)
    gc("batch_normalization", F.batch_normalization, (xs, gamma, beta), atol=1e-4, rtol=1e-3)
    gc("max_pooling_2d", lambda a: F.max_pooling_2d(a, 2), (np.arange(2 * 3 * 6 * 6).reshape(2, 3, 6, 6) * 0.01 + xs * 1e-4,))
    gc("linear", F.linear, (rng.standard_normal((5, 7)), rng.standard_normal((3, 7)), rng.standard_normal(3)))
    labels = np.array([0, 2, 1, 1])
    gc("softmax_cross_entropy", lambda a: F.softmax_cross_entropy(a, labels), (rng.standard_normal((4, 3)),))
    gc("as_strided", lambda a: F.as_strided(a, (3, 3), (1, 1)), (rng.standard_normal(6),))
    gc("average_pooling_2d", lambda a: F.average_pooling_2d(a, 2), (xs,))
    gc("add", lambda a, c: a + c, (xs, rng.standard_normal(xs.shape)))
    out["gradient_check"] = checked

    # ResNet50 forward/backward at 1x3x64x64
    t0 = time.perf_counter()
    model = ResNet50Layers(pretrained_model=None)
    x = rng.standard_normal((1, 3, 64, 64)).astype(np.float32)
    with chainer.using_config("train", True):
        h = model(x, layers=["fc6"])["fc6"]
    loss = F.softmax_cross_entropy(h, np.array([7], np.int32))
    model.cleargrads()
    loss.backward()
    grads = [p.grad for p in model.params()]
    out["resnet50"] = {
        "output_shape": list(h.shape), "loss_finite": bool(np.isfinite(loss.array)),
        "n_params": len(grads), "all_grads_set": all(g is not None for g in grads),
        "all_grads_finite": all(bool(np.isfinite(g).all()) for g in grads if g is not None),
        "conv1_grad_norm": float(np.linalg.norm(model.conv1.W.grad)),
        "seconds": round(time.perf_counter() - t0, 2)}
out["warnings"] = sorted({f"{x.category.__name__}: {str(x.message)[:120]} ({x.filename.split('site-packages/')[-1]}:{x.lineno})" for x in w
                          if "pkg_resources" not in str(x.message)})
print("RESULT=" + json.dumps(out))
'''


def _run_check(python: str, env_extra: dict) -> dict:
    env = dict(os.environ)
    env.update(env_extra)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([python, "-c", CHECK_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=900, cwd=str(REPO))
    assert proc.returncode == 0, f"check failed under {python}:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")][-1]
    result = json.loads(line[len("RESULT="):])
    result["log"] = [ln for ln in proc.stderr.splitlines() if "chainer_recompute" in ln]
    return result


def _pip(python: Path, *args: str) -> None:
    env = dict(os.environ, PIP_CONSTRAINT=str(REPO / "constraints.txt"),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", *args],
                          capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode != 0:
        pytest.skip(f"pip could not install {args} (no network?): {proc.stderr[-800:]}")


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_chainer_under_numpy2(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Chainer 7.8.1 + NumPy 2: small net, gradient_check, ResNet50, same numbers as NumPy 1."""
    given = os.environ.get("CHAINER_RECOMPUTE_NP2_VENV")  # reuse a venv built before
    root = Path(given) if given else None
    if root is None or not (root / "bin" / "python").exists():
        root = tmp_path_factory.mktemp("np2venv")
        venv.EnvBuilder(with_pip=True).create(root)
        python = root / "bin" / "python"
        _pip(python, "numpy>=2,<2.4", "setuptools<81", "filelock", "protobuf",
             "typing_extensions", "six", "networkx")
        _pip(python, "--no-deps", "chainer==7.8.1")
    python = root / "bin" / "python"
    np2 = _run_check(str(python), {})
    print("NumPy 2 check:", json.dumps(np2, indent=1))
    assert np2["numpy"].startswith("2.")
    assert "numpy.sctypes" in np2["patched"]
    assert np2["second_call"] == []
    assert any("numpy.sctypes" in ln for ln in np2["log"])
    assert len(np2["gradient_check"]) == 9
    res = np2["resnet50"]
    assert res["output_shape"] == [1, 1000]
    assert res["loss_finite"] and res["all_grads_set"] and res["all_grads_finite"]
    assert 0.3 < np2["dropout_kept_fraction"] < 0.7

    # The same small net on the project's NumPy 1.x gives the same numbers.
    np1 = _run_check(sys.executable, {})
    assert np1["patched"] == [] or _compat.numpy_major(numpy) >= 2
    assert np2["small_loss"] == pytest.approx(np1["small_loss"], rel=1e-5)
    for name, norm in np1["small_grad_norms"].items():
        assert np2["small_grad_norms"][name] == pytest.approx(norm, rel=1e-4, abs=1e-7), name
    assert np2["small_running_mean_sum"] == pytest.approx(np1["small_running_mean_sum"], rel=1e-5, abs=1e-7)


def test_resize_images_works_once_the_chainer_side_is_imported() -> None:
    import numpy as np

    import chainer_recompute.runtime._chainer  # noqa: F401  (applies the patch)
    import chainer.functions as F
    from chainer_recompute._compat import patch_resize_images

    assert patch_resize_images() is False  # already applied, idempotent
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    y = F.resize_images(x, (7, 7))
    assert y.shape == (1, 1, 7, 7)
    assert float(y.array[0, 0, 0, 0]) == 0.0 and float(y.array[0, 0, -1, -1]) == 15.0
