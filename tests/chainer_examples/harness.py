"""Run Chainer's own example scripts plain and with ``chainer_recompute.apply``
injected, and compare the two runs bit for bit.

The scripts under this folder are Chainer v7.8.1's, unmodified (see
README.md). Nothing in them is edited; everything below is monkeypatching,
undone when a run ends.

What one run does (:func:`run_example`)
---------------------------------------
1. **Data.** The datasets are replaced by seeded random data of the real
   shapes and dtypes, by patching the private retrievers behind Chainer's
   public loaders, so that the real ``get_mnist`` / ``get_cifar10`` /
   ``get_ptb_words`` (with all their arguments: ``withlabel``, ``ndim``,
   ``scale``, ``dtype``) do their own preprocessing of fake raw data:

   - ``chainer.datasets.mnist._retrieve_mnist_training`` / ``_test``: raw
     ``{'x': uint8 (N, 784), 'y': uint8 (N,)}``;
   - ``chainer.datasets.cifar._get_cifar``: uint8 images (N, 3072) and
     labels through the real ``_preprocess_cifar`` (this is also the
     DCGAN example's default image dataset, ``get_cifar10(withlabel=False,
     scale=255.)``);
   - ``chainer.datasets.ptb._retrieve_ptb_words``: int32 word ids below
     10000 (the real vocabulary size; the train split contains 9999 so the
     script's ``n_vocab = max(train) + 1`` is the real 10000).

   - ``chainer.datasets.image_dataset._read_image_as_array``: a uint8
     256 x 256 RGB image per file name, for ImageNet's
     ``LabeledImageDataset`` (which then does not need Pillow); the
     harness writes the two image-label lists the script reads (labels
     below 1000) and a mean image (``compute_mean.py``'s 3 x 256 x 256
     float32) into the run's directory. ImageNet's ``MultiprocessIterator`` is replaced by a
     ``SerialIterator`` with the same batch, repeat and shuffle: its worker
     processes would crop with their own copies of Python's RNG, in an
     order set by the scheduler.

   The data come from their own ``numpy.random.RandomState(data_seed)``,
   so making them draws nothing from the global RNG, and both runs get the
   same arrays. ``chainer.dataset.download.cached_download`` raises, so a
   run never touches the network.
2. **Arguments.** ``sys.argv`` is set to a small configuration (batch size,
   ``--epoch 1``, ``--device @numpy``, ``--out`` in the run's directory,
   small widths where the script has a flag for them; ImageNet: the
   architecture, ``--test`` so that the Evaluator and the snapshots run
   every iteration); with ``--epoch 1``
   the dataset size fixes the number of optimizer steps
   (``n_train = steps * batch``; PTB: ``steps * batch * bproplen`` words).
   The working directory is the run's directory during the run.
3. **Packages the scripts need but the project does not install.** If
   ``matplotlib`` is missing, stub ``matplotlib`` / ``matplotlib.pyplot``
   modules are put in ``sys.modules`` while the script is imported (MNIST
   and VAE import it at top level) and ``extensions.PlotReport`` is
   replaced by a no-op extension. If ``PIL`` is missing, a stub ``PIL``
   lets DCGAN's ``visualize.py`` import (its extension only fires every
   ``--snapshot_interval`` = 1000 iterations, i.e. never here; it would
   reseed the global RNG from OS entropy). The VAE script's final
   ``save_images`` (matplotlib figures) is replaced by a no-op on the
   loaded module. Snapshots are written with ``numpy.savez`` instead of
   ``numpy.savez_compressed`` (zlib on VGG's 120 MB took seconds); ImageNet's
   (``--test`` takes a trainer and a model snapshot every iteration, up to
   0.7 GB each) are serialized in memory and not written.
   Everything else the scripts set up runs for real:
   Evaluator, LogReport, PrintReport, ProgressBar, DumpGraph, snapshots
   (when their triggers fire), PTB's final test evaluation and
   ``save_npz`` of the model.
4. **The one line.** The "applied" run wraps
   ``chainer.optimizer.GradientMethod.setup`` and ``Optimizer.setup``: when
   the link handed to ``setup`` is selected (all links, or by class name:
   ``Generator`` / ``Discriminator`` for the DCGAN variants), it calls
   ``link = chainer_recompute.apply(link, budget=budget)`` first and hands
   the result to the real ``setup``. That is exactly where the README puts
   the line (after the model is built and moved to its device, before the
   optimizer sees it); ``apply`` works in place, so the script's other
   references (Evaluator, the DCGAN updater's ``gen``/``dis``, PTB's
   ``model.copy()``) see the applied model too.
5. **Seeds.** ``numpy.random.seed(seed)`` and ``random.seed(seed)``
   immediately before ``main()`` (the scripts seed nothing themselves except
   DCGAN's image extension, which does not fire). The script module (and its
   sibling modules ``net``, ``updater``, ``models.VGG``, ...) is imported
   afresh for every run.
6. **Recording.** ``chainer.training.Trainer.__init__`` is wrapped to add a
   recorder extension (trigger every iteration, lowest priority, so it runs
   after the update and after every other extension of that iteration) that
   snapshots, for every optimizer of the updater (prefix = the optimizer's
   name: ``main``, or ``gen``/``dis``):

   - ``obs/<key>``: every value reported in that iteration (``main/loss``,
     ``main/accuracy``, ``dis/loss``, ``validation/main/loss``, ...);
   - ``param/<opt><path>`` and ``grad/<opt><path>``: every parameter and its
     gradient, by path (``None`` while uninitialised);
   - ``persist/<opt><path>``: every persistent (BatchNorm ``avg_mean``,
     ``avg_var``, ``N``, the VAE prior's ``loc``/``scale``);
   - ``state/<opt><path>``: every other ``Variable`` attribute of a link
     (``L.LSTM``'s ``h`` and ``c``);
   - ``opt/<opt><path>/<k>``: each update rule's state (Adam ``m``/``v``,
     momentum ``v``), and ``opt/<opt>/t``;
   - ``rng/numpy``: ``numpy.random.get_state()``; ``rng/python``:
     ``random.getstate()``.

   Iteration 0 is recorded when the trainer starts (before
   ``call_before_training`` extensions), iteration ``i`` after the i-th
   update; a final record ``end`` is taken after ``main()`` returns. In
   between, ``Optimizer.call_hooks`` is wrapped so that every optimizer
   step also records, right after its backward and before its hooks
   (WeightDecay, GradientClipping) and its update, the reported values,
   gradients, persistents, states and RNG states (label ``"<i> (<name>
   optimizer, after backward, ...)"``): a wrong gradient is caught at the
   backward that made it, and DCGAN's two backward passes per iteration
   are told apart. Warnings logged by ``chainer_recompute`` during the applied run and the
   runners' plan counts / last iteration stats are kept for the report.

Comparison (:func:`compare`)
----------------------------
The plain run keeps its records; the applied run (made with
``reference=plain``) compares each record with the plain run's record of the
same rank as soon as it is made and keeps only the first difference, so
memory holds one run's records. Every key of every record: arrays are
equal when dtype, shape and raw bytes (``tobytes()``) are equal; the RNG
states when every field is equal (for NumPy: the 624 key words and the
position). The first differing
record is reported with every differing key (RNG first, then reported
values, gradients, parameters, persistents, states, optimizer state), each
with its max abs difference, or the RNG positions (and how many 32-bit words
ahead one run is when the key words agree). A crash of the applied run is
reported with its traceback summary, after the comparison of the records
made before it.

Use from Python::

    from harness import compare_variant
    result = compare_variant('dcgan-dis', workdir)   # plain vs applied
    assert result.identical, result.report()

or from the command line::

    .venv/bin/python tests/chainer_examples/harness.py mnist cifar-vgg --size light

(``--budget least-shim`` plans at the least feasible budget even when
``apply`` does not accept ``'least'``; a diagnostic only, see
:func:`least_shim`.)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import itertools
import logging
import os
import random
import sys
import tempfile
import traceback
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # when run as a script
    sys.path.insert(0, ROOT)

import chainer_recompute  # noqa: E402  (before chainer: NumPy 2 compat)
import chainer  # noqa: E402
import chainer.datasets.cifar  # noqa: E402
import chainer.datasets.image_dataset  # noqa: E402
import chainer.datasets.mnist  # noqa: E402
import chainer.datasets.ptb  # noqa: E402
from chainer import training  # noqa: E402
from chainer.training import extensions  # noqa: E402

PTB_VOCAB = 10000


# --------------------------------------------------------------- configuration
@dataclasses.dataclass(frozen=True)
class Size:
    """How big one run is: optimizer steps, batch, and widths."""
    steps: int = 3
    batch: int = 8
    n_test: int = 8
    # per-example knobs (ignored where the script has no such flag)
    unit: int = 100          # MNIST --unit, PTB --unit
    bproplen: int = 3        # PTB
    dim_h: int = 500         # VAE
    dim_z: int = 20          # VAE


@dataclasses.dataclass(frozen=True)
class Example:
    name: str
    script: str                       # relative to HERE
    argv: Callable[[Size, str], List[str]]
    n_train: Callable[[Size], int]
    local_modules: Tuple[str, ...] = ()
    post_load: Optional[Callable[[types.ModuleType], None]] = None
    #: writes the files the arguments name (the ImageNet lists), given the
    #: size, the run's directory and the data seed
    prepare: Optional[Callable[[Size, str, int], None]] = None
    #: False: snapshots are serialized in memory and not written (ImageNet's
    #: ``--test`` takes two per iteration, 0.3-0.7 GB each)
    write_snapshots: bool = True


def _noop_save_images(*args: Any, **kwargs: Any) -> None:
    return None


def _savez_in_memory(file: Any, *args: Any, **kwargs: Any) -> None:
    np.savez(io.BytesIO(), *args, **kwargs)


EXAMPLES: Dict[str, Example] = {
    "mnist": Example(
        "mnist", "mnist/train_mnist.py",
        lambda s, out: ["--batchsize", str(s.batch), "--epoch", "1", "--device", "@numpy",
                        "--unit", str(s.unit), "--out", out],
        lambda s: s.steps * s.batch),
    "cifar": Example(
        "cifar", "cifar/train_cifar.py",
        lambda s, out: ["--dataset", "cifar10", "--batchsize", str(s.batch), "--epoch", "1",
                        "--device", "@numpy", "--out", out],
        lambda s: s.steps * s.batch, local_modules=("models",)),
    "ptb": Example(
        "ptb", "ptb/train_ptb.py",
        lambda s, out: ["--batchsize", str(s.batch), "--bproplen", str(s.bproplen),
                        "--epoch", "1", "--unit", str(s.unit), "--device", "@numpy",
                        "--out", out, "--model", os.path.join(out, "model.npz")],
        lambda s: s.steps * s.batch * s.bproplen),
    "dcgan": Example(
        "dcgan", "dcgan/train_dcgan.py",
        lambda s, out: ["--batchsize", str(s.batch), "--epoch", "1", "--device", "@numpy",
                        "--out", out, "--snapshot_interval", "1000",
                        "--display_interval", "1"],
        lambda s: s.steps * s.batch, local_modules=("net", "updater", "visualize")),
    "vae": Example(
        "vae", "vae/train_vae.py",
        lambda s, out: ["--batch-size", str(s.batch), "--epoch", "1", "--device", "@numpy",
                        "--dim-h", str(s.dim_h), "--dim-z", str(s.dim_z), "--out", out],
        lambda s: s.steps * s.batch, local_modules=("net",),
        post_load=lambda m: setattr(m, "save_images", _noop_save_images)),
}


#: examples/imagenet's architectures (``--arch``; not the NHWC ResNet50,
#: which needs cuDNN)
IMAGENET_ARCHS = ("alex", "googlenet", "googlenetbn", "nin", "resnet50", "resnext50")
IMAGENET_MODULES = ("dali_util", "dataset_util") + IMAGENET_ARCHS


def _imagenet_files(size: Size, out: str, data_seed: int) -> None:
    """The two image-label lists (image names only: the images themselves
    are made by the patched reader) and a mean image, as the script's
    ``compute_mean.py`` would write it (3 x 256 x 256 float32)."""
    r = np.random.RandomState([data_seed, 7])
    for tag, n in (("train", size.steps * size.batch), ("val", size.n_test)):
        with open(os.path.join(out, f"{tag}.txt"), "w") as f:
            for i in range(n):
                f.write(f"{tag}{i}.png {r.randint(0, 1000)}\n")
    np.save(os.path.join(out, "mean.npy"), r.uniform(0, 255, (3, 256, 256)).astype(np.float32))


def _imagenet_argv(arch: str) -> Callable[[Size, str], List[str]]:
    def argv(s: Size, out: str) -> List[str]:
        return [os.path.join(out, "train.txt"), os.path.join(out, "val.txt"), "--arch", arch,
                "--batchsize", str(s.batch), "--val_batchsize", str(s.n_test), "--epoch", "1",
                "--device", "@numpy", "--mean", os.path.join(out, "mean.npy"), "--root", out,
                "--out", out, "--test"]
    return argv


for _arch in IMAGENET_ARCHS:
    EXAMPLES[f"imagenet-{_arch}"] = Example(
        f"imagenet-{_arch}", "imagenet/train_imagenet.py", _imagenet_argv(_arch),
        lambda s: s.steps * s.batch, local_modules=IMAGENET_MODULES, prepare=_imagenet_files,
        write_snapshots=False)


def _all(link: Any) -> bool:
    return True


def _by_class(*names: str) -> Callable[[Any], bool]:
    def select(link: Any) -> bool:
        return type(link).__name__ in names or \
            getattr(type(link), "_chainer_recompute_base", type(link)).__name__ in names
    select.__name__ = "class in " + "/".join(names)
    return select


# variant -> (example, which links handed to optimizer.setup get apply())
VARIANTS: Dict[str, Tuple[str, Callable[[Any], bool]]] = {
    "mnist": ("mnist", _all),
    "cifar-vgg": ("cifar", _all),
    "ptb": ("ptb", _all),
    "dcgan-gen": ("dcgan", _by_class("Generator")),
    "dcgan-dis": ("dcgan", _by_class("Discriminator")),
    "dcgan-both": ("dcgan", _by_class("Generator", "Discriminator")),
    "vae": ("vae", _all),
    **{f"imagenet-{arch}": (f"imagenet-{arch}", _all) for arch in IMAGENET_ARCHS},
}

# Sizes: 'light' for the default test run, 'full' for the slow ones.
SIZES: Dict[str, Dict[str, Size]] = {
    "light": {
        "mnist": Size(steps=3, batch=20, n_test=20, unit=100),
        "cifar": Size(steps=3, batch=4, n_test=4),
        "ptb": Size(steps=3, batch=4, n_test=6, unit=16, bproplen=3),
        "dcgan": Size(steps=3, batch=2, n_test=2),
        "vae": Size(steps=3, batch=20, n_test=20, dim_h=100, dim_z=8),
        **{f"imagenet-{arch}": Size(steps=3, batch=2, n_test=2) for arch in IMAGENET_ARCHS},
    },
    "full": {
        "mnist": Size(steps=3, batch=100, n_test=100, unit=1000),
        "cifar": Size(steps=4, batch=16, n_test=16),
        "ptb": Size(steps=4, batch=20, n_test=20, unit=200, bproplen=10),
        "dcgan": Size(steps=4, batch=16, n_test=16),
        "vae": Size(steps=4, batch=100, n_test=100, dim_h=500, dim_z=20),
        **{f"imagenet-{arch}": Size(steps=4, batch=4, n_test=4) for arch in IMAGENET_ARCHS},
    },
}


# ---------------------------------------------------------------- patching
class _Patches:
    """setattr with undo."""

    def __init__(self) -> None:
        self._undo: List[Tuple[Any, str, Any, bool]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        own = vars(obj)  # classes and modules: their own attribute, not an inherited one
        self._undo.append((obj, name, own.get(name), name in own))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, old, had in reversed(self._undo):
            if had:
                setattr(obj, name, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
        self._undo.clear()


def _fake_data_patches(patches: _Patches, n_train: int, n_test: int, data_seed: int) -> None:
    def rs(tag: str) -> np.random.RandomState:
        return np.random.RandomState([data_seed, sum(map(ord, tag))])

    def mnist_raw(tag: str, n: int) -> Dict[str, np.ndarray]:
        r = rs("mnist" + tag)
        return {"x": r.randint(0, 256, size=(n, 784)).astype(np.uint8),
                "y": r.randint(0, 10, size=n).astype(np.uint8)}

    patches.set(chainer.datasets.mnist, "_retrieve_mnist_training",
                lambda: mnist_raw("train", n_train))
    patches.set(chainer.datasets.mnist, "_retrieve_mnist_test",
                lambda: mnist_raw("test", n_test))

    def fake_get_cifar(name: str, withlabel: bool, ndim: int, scale: float, dtype: Any) -> Any:
        n_class = 10 if name == "cifar-10" else 100
        out = []
        for tag, n in (("train", n_train), ("test", n_test)):
            r = rs(name + tag)
            x = r.randint(0, 256, size=(n, 3072)).astype(np.uint8)
            y = r.randint(0, n_class, size=n).astype(np.uint8)
            out.append(chainer.datasets.cifar._preprocess_cifar(x, y, withlabel, ndim, scale,
                                                                 dtype))
        return tuple(out)

    patches.set(chainer.datasets.cifar, "_get_cifar", fake_get_cifar)

    def fake_ptb_words(name: str, url: str) -> np.ndarray:
        n = n_train if name.startswith("train") else n_test
        x = rs("ptb" + name).randint(0, PTB_VOCAB, size=n).astype(np.int32)
        if name.startswith("train"):
            x[n // 2] = PTB_VOCAB - 1  # the real vocabulary size, from max(train) + 1
        return x

    patches.set(chainer.datasets.ptb, "_retrieve_ptb_words", fake_ptb_words)

    def fake_image(path: str, dtype: Any) -> np.ndarray:
        # ImageNet: a 256 x 256 RGB image per file name, as PIL would read it
        r = rs("image" + os.path.basename(path))
        return r.randint(0, 256, size=(256, 256, 3)).astype(dtype)

    patches.set(chainer.datasets.image_dataset, "_read_image_as_array", fake_image)
    patches.set(chainer.datasets.image_dataset, "available", True)  # Pillow: not needed

    # ImageNet's MultiprocessIterator: its workers would crop with their
    # own copies of Python's RNG, in an order set by scheduling
    patches.set(chainer.iterators, "MultiprocessIterator", _SerialForMultiprocess)

    def no_network(url: str, *a: Any, **k: Any) -> Any:
        raise RuntimeError(f"chainer_examples harness: no download in tests ({url})")

    patches.set(chainer.dataset.download, "cached_download", no_network)


class _SerialForMultiprocess(chainer.iterators.SerialIterator):
    """``MultiprocessIterator``'s arguments, ``SerialIterator``'s iteration."""

    def __init__(self, dataset: Any, batch_size: int, repeat: bool = True,
                 shuffle: Optional[bool] = None, n_processes: Optional[int] = None,
                 **kwargs: Any) -> None:
        super().__init__(dataset, batch_size, repeat=repeat, shuffle=shuffle)


class _NoopExtension(training.Extension):
    trigger = (10 ** 9, "iteration")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, trainer: Any) -> None:
        pass


def _stub_module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__chainer_examples_stub__ = True

    def __getattr__(attr: str) -> Any:
        raise AttributeError(f"{name}.{attr}: stub module of the chainer_examples harness "
                             f"({name} is not installed)")
    mod.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return mod


def _available(name: str) -> bool:
    mod = sys.modules.get(name)
    if mod is not None:
        return not getattr(mod, "__chainer_examples_stub__", False)
    return importlib.util.find_spec(name) is not None


@contextlib.contextmanager
def _missing_packages(patches: _Patches):
    """Stub matplotlib / PIL while the script is imported, if they are absent."""
    added: List[str] = []
    if not _available("matplotlib"):
        pyplot = _stub_module("matplotlib.pyplot")
        sys.modules["matplotlib"] = _stub_module("matplotlib", use=lambda *a, **k: None,
                                                 pyplot=pyplot)
        sys.modules["matplotlib.pyplot"] = pyplot
        added += ["matplotlib", "matplotlib.pyplot"]
        patches.set(extensions, "PlotReport", _NoopExtension)
    if not _available("PIL"):
        image = _stub_module("PIL.Image")
        sys.modules["PIL"] = _stub_module("PIL", Image=image)
        sys.modules["PIL.Image"] = image
        added += ["PIL", "PIL.Image"]
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


@contextlib.contextmanager
def _isolated_import(example_dir: str, local_modules: Sequence[str]):
    """Let the script import its siblings (``net``, ``models.VGG``) under their
    plain names, without clashing with another example's ``net``."""
    def ours(name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in local_modules)

    saved = {k: v for k, v in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, example_dir)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(example_dir)
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


_counter = itertools.count()


def _load_script(example: Example) -> types.ModuleType:
    path = os.path.join(HERE, example.script)
    name = f"_chainer_example_{example.name}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    if example.post_load is not None:
        example.post_load(module)
    return module


# ---------------------------------------------------------------- recording
RNG_NUMPY = "rng/numpy"
RNG_PYTHON = "rng/python"


def _to_numpy(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, chainer.Variable):
        value = value.array
    if value is None:
        return None
    return np.array(chainer.backend.CpuDevice().send(value), copy=True)


def _grad_of(param: chainer.Parameter) -> Any:
    if param.array is None:  # lazily initialised, not yet: .grad would raise
        return None
    try:
        return param.grad
    except RuntimeError:
        return None


def _link_records(prefix: str, link: chainer.Link, rec: Dict[str, Any]) -> None:
    for path, param in link.namedparams():
        rec[f"param/{prefix}{path}"] = _to_numpy(param.array)
        rec[f"grad/{prefix}{path}"] = _to_numpy(_grad_of(param))
        rule = getattr(param, "update_rule", None)
        state = getattr(rule, "state", None) or {}
        for k in sorted(state):
            rec[f"opt/{prefix}{path}/{k}"] = _to_numpy(state[k])
        if rule is not None:
            rec[f"opt/{prefix}{path}/t"] = np.asarray(getattr(rule, "t", 0))
    for path, sub in link.namedlinks():
        base = path.rstrip("/")
        for name in sorted(getattr(sub, "_persistent", ())):
            value = getattr(sub, name)
            if not isinstance(value, (chainer.Variable,) + chainer.get_array_types()):
                value = np.asarray(value)  # N (int), scalars
            rec[f"persist/{prefix}{base}/{name}"] = _to_numpy(value)
        params = set(getattr(sub, "_params", ()))
        for name, value in sorted(vars(sub).items()):
            if name in params or name.startswith("_chainer_recompute"):
                continue
            if isinstance(value, chainer.Variable) and not isinstance(value, chainer.Parameter):
                rec[f"state/{prefix}{base}/{name}"] = _to_numpy(value)


def _rng_records(rec: Dict[str, Any]) -> None:
    rec[RNG_NUMPY] = np.random.get_state()
    rec[RNG_PYTHON] = random.getstate()


_PRE_UPDATE = ("obs/", "grad/", "persist/", "state/", "rng/")


def snapshot_state(trainer: Any, observation: Optional[Dict[str, Any]] = None,
                   only: Optional[Tuple[str, ...]] = None) -> Dict[str, Any]:
    """One record (see the module docstring); ``only``: keep these key prefixes."""
    rec: Dict[str, Any] = {}
    rec.update({f"obs/{k}": _to_numpy(v) for k, v in sorted((observation or {}).items())})
    for name, opt in sorted(trainer.updater.get_all_optimizers().items()):
        rec[f"opt/{name}/t"] = np.asarray(opt.t)
        _link_records(name, opt.target, rec)
    _rng_records(rec)
    if only is not None:
        rec = {k: v for k, v in rec.items() if k.startswith(only)}
    return rec


class _Recorder(training.Extension):
    trigger = (1, "iteration")
    priority = -10 ** 9  # after every other extension of the iteration
    name = "chainer_examples_recorder"

    def __init__(self, run: "RunRecord") -> None:
        self.run = run

    def initialize(self, trainer: Any) -> None:
        self.run.trainer = trainer
        self.run.add("0 (before training)", snapshot_state(trainer))

    def __call__(self, trainer: Any) -> None:
        self.run.add(str(trainer.updater.iteration),
                     snapshot_state(trainer, trainer.observation))


def _pre_update_recorder(run: "RunRecord", real_call_hooks: Callable[..., Any]
                         ) -> Callable[..., Any]:
    """``Optimizer.call_hooks`` that first records the gradients of the
    backward just done (before WeightDecay, GradientClipping, the step)."""
    def call_hooks(self: Any, timing: str = "pre") -> Any:
        trainer = run.trainer
        if timing == "pre" and trainer is not None:
            names = [n for n, o in trainer.updater.get_all_optimizers().items() if o is self]
            step = trainer.updater.iteration + 1
            run.add(f"{step} ({names[0] if names else '?'} optimizer, after backward, "
                    f"before its hooks and step)",
                    snapshot_state(trainer, trainer.observation, only=_PRE_UPDATE))
        return real_call_hooks(self, timing)
    return call_hooks


# ------------------------------------------------------------------- runs
@dataclasses.dataclass
class RunRecord:
    """One run. With ``reference`` (the plain run), each record is compared
    with the reference's record of the same rank as soon as it is made, and
    only the first difference is kept (not the arrays): memory stays at one
    run's records."""
    label: str
    reference: Optional["RunRecord"] = None
    records: List[Tuple[str, Optional[Dict[str, Any]]]] = dataclasses.field(default_factory=list)
    first_difference: Optional[Tuple[str, List[Tuple[str, str]]]] = None
    label_mismatch: Optional[Tuple[str, str]] = None
    n_identical: Optional[int] = None  # records identical before the first difference
    error: Optional[str] = None          # formatted traceback of a crash
    error_summary: Optional[str] = None  # last frames + the exception line
    applied_to: List[str] = dataclasses.field(default_factory=list)
    runner_info: List[str] = dataclasses.field(default_factory=list)
    n_plans: List[Optional[int]] = dataclasses.field(default_factory=list)  # per applied link
    #: per applied link: the most nodes one of its plans drops (0: plans
    #: that keep everything)
    n_dropped: List[int] = dataclasses.field(default_factory=list)
    log: List[str] = dataclasses.field(default_factory=list)
    stdout: str = ""
    trainer: Any = None

    def add(self, label: str, rec: Dict[str, Any]) -> None:
        i = len(self.records)
        if self.reference is None:
            self.records.append((label, rec))
            return
        self.records.append((label, None))
        if self.first_difference is not None or self.label_mismatch is not None:
            return
        if i >= len(self.reference.records):
            self.label_mismatch = (f"(none: the plain run made {i} records)", label)
            self.n_identical = i
            return
        ref_label, ref = self.reference.records[i]
        if ref_label != label:
            self.label_mismatch = (ref_label, label)
            self.n_identical = i
            return
        diffs = diff_records(ref, rec)  # type: ignore[arg-type]
        if diffs:
            self.first_difference = (label, diffs)
            self.n_identical = i


class _ListHandler(logging.Handler):
    def __init__(self, out: List[str]) -> None:
        super().__init__(logging.INFO)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append(f"{record.levelname}: {record.getMessage()}")


def least_shim(patches: _Patches) -> Any:
    """Diagnostic only: ``apply(..., budget=1)`` with the planner's ``solve``
    patched to use the graph's least feasible budget, for a runtime whose
    ``apply`` does not accept ``'least'`` yet. Returns the budget to pass."""
    from chainer_recompute.core import planner
    from chainer_recompute.core.search import least_feasible_budget
    real = planner.solve

    def solve(graph: Any, budget: Any = None, solver: str = "approx", strategy: str = "tc",
              **kw: Any) -> Any:
        least = least_feasible_budget(graph, solver=solver, strategy=strategy)
        return real(graph, least, solver=solver, strategy=strategy, **kw)

    patches.set(planner, "solve", solve)
    return 1


def _summarise(exc: BaseException) -> str:
    """The innermost frames, the last line of the example script that was
    running, and the exception."""
    frames = traceback.extract_tb(exc.__traceback__)

    def where(f: traceback.FrameSummary) -> str:
        name = os.path.relpath(f.filename, ROOT) if f.filename.startswith(ROOT) else f.filename
        return f"{name}:{f.lineno} in {f.name}"

    text = " <- ".join(where(f) for f in reversed(frames[-4:]))
    in_script = [f for f in frames if f.filename.startswith(HERE)
                 and os.path.basename(f.filename) != "harness.py"]
    if in_script:
        f = in_script[-1]
        text += f"\nin the example at {where(f)}: {(f.line or '').strip()}"
    return text + f"\n{type(exc).__name__}: {exc}"


def run_example(name: str, workdir: str, *, select: Optional[Callable[[Any], bool]] = None,
                budget: Any = "least", size: Optional[Size] = None, seed: int = 0,
                data_seed: int = 1234, label: Optional[str] = None,
                apply_options: Optional[Dict[str, Any]] = None,
                reference: Optional[RunRecord] = None,
                apply_fn: Optional[Callable[..., Any]] = None) -> RunRecord:
    """Run one example's ``main()``; ``select`` (None: plain) chooses the links
    that get ``chainer_recompute.apply(link, budget=budget)`` at
    ``optimizer.setup``; ``reference``: compare with that run while running
    (see :class:`RunRecord`); ``apply_fn``: called instead of
    ``chainer_recompute.apply`` (the harness's own tests). Never raises for
    a crash inside the script: the traceback is in the returned record's
    ``error``."""
    example = EXAMPLES[name]
    size = size or SIZES["light"][name]
    run = RunRecord(label or ("plain" if select is None else "applied"), reference=reference)
    out = os.path.join(workdir, run.label)
    os.makedirs(out, exist_ok=True)
    patches = _Patches()
    handler = _ListHandler(run.log)
    cr_logger = logging.getLogger("chainer_recompute")
    applied: List[Any] = []
    old_argv, old_cwd = sys.argv, os.getcwd()
    buf = io.StringIO()
    try:
        _fake_data_patches(patches, example.n_train(size), size.n_test, data_seed)
        # Snapshots (MNIST, CIFAR, PTB write one at the end of the epoch) are
        # written uncompressed: zlib on VGG's 120 MB took seconds.
        patches.set(np, "savez_compressed", np.savez if example.write_snapshots
                    else _savez_in_memory)
        if budget == "least-shim" and select is not None:
            budget = least_shim(patches)

        # the recorder
        real_init = training.Trainer.__init__

        def trainer_init(self: Any, *a: Any, **k: Any) -> None:
            real_init(self, *a, **k)
            self.extend(_Recorder(run))
        patches.set(training.Trainer, "__init__", trainer_init)
        patches.set(chainer.optimizer.Optimizer, "call_hooks",
                    _pre_update_recorder(run, chainer.optimizer.Optimizer.call_hooks))

        # the one line
        if select is not None:
            def wrap(cls: type) -> None:
                real_setup = cls.__dict__["setup"]

                def setup(self: Any, link: Any) -> Any:
                    if select(link) and not any(link is a for a in applied):
                        run.applied_to.append(type(link).__name__)
                        link = (apply_fn or chainer_recompute.apply)(
                            link, budget=budget, **(apply_options or {}))
                        applied.append(link)
                    return real_setup(self, link)
                patches.set(cls, "setup", setup)
            wrap(chainer.optimizer.Optimizer)
            wrap(chainer.optimizer.GradientMethod)
            cr_logger.addHandler(handler)

        example_dir = os.path.dirname(os.path.join(HERE, example.script))
        with _missing_packages(patches), _isolated_import(example_dir, example.local_modules):
            module = _load_script(example)
            if example.prepare is not None:
                example.prepare(size, out, data_seed)
            sys.argv = [os.path.join(HERE, example.script)] + example.argv(size, out)
            os.chdir(out)
            np.random.seed(seed)
            random.seed(seed)
            try:
                with contextlib.redirect_stdout(buf):
                    module.main()
            except BaseException as exc:  # noqa: BLE001 - reported, not raised
                if isinstance(exc, KeyboardInterrupt):
                    raise
                run.error = traceback.format_exc()
                run.error_summary = _summarise(exc)
            else:
                if run.trainer is not None:
                    run.add("end (after main)", snapshot_state(run.trainer))
    finally:
        os.chdir(old_cwd)
        sys.argv = old_argv
        patches.undo()
        cr_logger.removeHandler(handler)
        run.stdout = buf.getvalue()
    for link in applied:
        runner = getattr(chainer_recompute, "runner_of", lambda m: None)(link)
        plans = getattr(runner, "plans", None)
        run.n_plans.append(None if plans is None else len(plans))
        entries = runner.signatures() if hasattr(runner, "signatures") else ()
        run.n_dropped.append(max((len(s.program.dropped) for e in entries
                                  for s in e.structures), default=0))
        if runner is not None:
            run.runner_info.append(f"{type(link).__name__}: "
                                   f"{'?' if plans is None else len(plans)} plan(s); "
                                   f"last_stats={getattr(runner, 'last_stats', None)}")
    return run


# --------------------------------------------------------------- comparison
_ORDER = ("rng/", "obs/", "grad/", "param/", "persist/", "state/", "opt/")


def _order(key: str) -> Tuple[int, str]:
    for i, p in enumerate(_ORDER):
        if key.startswith(p):
            return (i, key)
    return (len(_ORDER), key)


def _diff_numpy_rng(a: Any, b: Any) -> Optional[str]:
    name_a, keys_a, pos_a, g_a, c_a = a
    name_b, keys_b, pos_b, g_b, c_b = b
    if name_a == name_b and keys_a.tobytes() == keys_b.tobytes() and pos_a == pos_b \
            and g_a == g_b and (c_a == c_b or (np.isnan(c_a) and np.isnan(c_b))):
        return None
    if keys_a.tobytes() == keys_b.tobytes():
        return (f"same key words, position plain {pos_a} vs applied {pos_b} "
                f"(applied is {pos_b - pos_a:+d} 32-bit draws off)"
                + ("" if g_a == g_b else f"; has_gauss {g_a} vs {g_b}"))
    return (f"different key words (runs are >= 1 MT19937 block apart), positions "
            f"plain {pos_a} vs applied {pos_b}")


def _diff_value(a: Any, b: Any) -> Optional[str]:
    if a is None or b is None:
        return None if a is None and b is None else \
            f"plain {'None' if a is None else 'set'} vs applied {'None' if b is None else 'set'}"
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"plain {a.dtype}{a.shape} vs applied {b.dtype}{b.shape}"
    if a.tobytes() == b.tobytes():
        return None
    if a.dtype.kind in "fiub":
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        n = int(np.count_nonzero(a != b)) if a.dtype.kind != "f" else \
            int(np.count_nonzero(~((a == b) | (np.isnan(a) & np.isnan(b)))))
        return f"max abs diff {np.nanmax(d):.6g} ({n} of {a.size} elements differ)"
    return "bytes differ"


def diff_records(a: Dict[str, Any], b: Dict[str, Any]) -> List[Tuple[str, str]]:
    """``(key, description)`` of every differing key of two records."""
    out = []
    for key in sorted(set(a) | set(b), key=_order):
        if key not in a or key not in b:
            out.append((key, "only in " + ("plain" if key in a else "applied")))
            continue
        if key == RNG_NUMPY:
            d = _diff_numpy_rng(a[key], b[key])
        elif key == RNG_PYTHON:
            d = None if a[key] == b[key] else "Python random state differs"
        else:
            d = _diff_value(a[key], b[key])
        if d is not None:
            out.append((key, d))
    return out


@dataclasses.dataclass
class Comparison:
    """Plain run against applied run (see :func:`compare_variant`)."""
    variant: str
    plain: RunRecord
    applied: RunRecord

    @property
    def crashed(self) -> bool:
        return self.applied.error is not None

    @property
    def first_difference(self) -> Optional[Tuple[str, List[Tuple[str, str]]]]:
        return self.applied.first_difference

    @property
    def n_compared(self) -> int:
        """Records found identical (before the first difference, if any)."""
        if self.applied.n_identical is not None:
            return self.applied.n_identical
        return min(len(self.applied.records), len(self.plain.records))

    @property
    def identical(self) -> bool:
        return (not self.crashed and self.first_difference is None
                and self.applied.label_mismatch is None
                and len(self.plain.records) == len(self.applied.records))

    def report(self, max_keys: int = 12) -> str:
        steps = sum(1 for label, _ in self.plain.records if label.isdigit())
        head = f"[{self.variant}] apply() on {self.applied.applied_to or 'nothing'}: "
        lines = [head]
        if self.identical:
            lines[0] += (f"identical: {len(self.plain.records)} records bit for bit "
                         f"({steps} iterations)")
        else:
            first = self.first_difference
            if first is not None:
                label, diffs = first
                n = self.n_compared
                lines[0] += (f"first difference at iteration {label}: {len(diffs)} keys differ "
                             f"(after {n} identical record{'' if n == 1 else 's'})")
                for key, d in diffs[:max_keys]:
                    lines.append(f"    {key}: {d}")
                if len(diffs) > max_keys:
                    lines.append(f"    ... and {len(diffs) - max_keys} more")
            elif self.applied.label_mismatch is not None:
                p, a = self.applied.label_mismatch
                lines[0] += (f"the runs took different paths after {self.n_compared} identical "
                             f"records: plain recorded {p!r} where applied recorded {a!r}")
            elif self.crashed and self.n_compared == 0:
                lines[0] += "crashed before the first record"
            elif self.crashed:
                lines[0] += f"identical in the {self.n_compared} records before the crash"
            else:
                lines[0] += (f"records differ in number: plain {len(self.plain.records)} vs "
                             f"applied {len(self.applied.records)}")
            if self.crashed:
                where = (self.applied.records[-1][0] if self.applied.records
                         else "none (before training)")
                lines.append(f"  applied run crashed; last record made: {where}")
                lines.append("  " + self.applied.error_summary.replace("\n", "\n  "))
        lines += [f"  runner: {r}" for r in self.applied.runner_info]
        seen = set()
        for msg in self.applied.log:
            if msg not in seen:
                seen.add(msg)
                lines.append(f"  log: {msg[:400]}")
        return "\n".join(lines)


def compare(variant: str, plain: RunRecord, applied: RunRecord) -> Comparison:
    """The comparison of two runs (the second made with ``reference=plain``)."""
    if plain.error is not None:
        raise AssertionError(f"[{variant}] the plain run itself failed (harness problem):\n"
                             f"{plain.error}")
    if applied.reference is not plain:
        raise ValueError("the applied run must be made with reference=plain")
    return Comparison(variant, plain, applied)


def compare_variant(variant: str, workdir: str, *, size: str = "light", budget: Any = "least",
                    seed: int = 0, control: bool = False,
                    apply_fn: Optional[Callable[..., Any]] = None,
                    apply_options: Optional[Dict[str, Any]] = None) -> Comparison:
    """Plain run vs applied run of one variant (``control``: plain vs plain,
    to check that the harness itself is deterministic; ``apply_fn``,
    ``apply_options``: see :func:`run_example`)."""
    name, select = VARIANTS[variant]
    sz = SIZES[size][name]
    plain = run_example(name, workdir, size=sz, seed=seed, label="plain")
    if plain.error is not None:
        raise AssertionError(f"[{variant}] the plain run itself failed (harness problem):\n"
                             f"{plain.error}")
    if control:
        other = run_example(name, workdir, size=sz, seed=seed, label="plain-again",
                            reference=plain)
    else:
        other = run_example(name, workdir, select=select, budget=budget, size=sz, seed=seed,
                            label="applied", reference=plain, apply_fn=apply_fn,
                            apply_options=apply_options)
    return compare(variant, plain, other)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("variants", nargs="*", default=list(VARIANTS),
                   help=f"any of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--size", choices=sorted(SIZES), default="light")
    p.add_argument("--budget", default="least",
                   help="'least' (default), a size such as 8G, or 'least-shim' (diagnostic)")
    p.add_argument("--control", action="store_true", help="plain vs plain")
    p.add_argument("--traceback", action="store_true", help="print full tracebacks of crashes")
    args = p.parse_args(argv)
    bad = 0
    for v in args.variants:
        with tempfile.TemporaryDirectory() as tmp:
            r = compare_variant(v, tmp, size=args.size, budget=args.budget, control=args.control)
        print(r.report(), flush=True)
        if args.traceback and r.applied.error:
            print(r.applied.error)
        bad += not r.identical
    return 1 if bad else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
