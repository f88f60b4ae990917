#!/usr/bin/env python
"""ChainerCV's own train chains, plain Chainer against ``apply(model,
budget='least')``, bit for bit, with each whole step's peak and time.

Each model trains twice from the same seeds on seeded random data of the
real shapes, plain and applied, with the optimizer and hooks its example's
``train.py`` sets up (``opt.update(model, *batch)``, as its
``StandardUpdater`` calls it). After every step the two runs' records must
be identical (tests/harness.py: loss, parameters, gradients, optimizer
state, persistents, NumPy's and Python's random states). Each step's peak is
the absolute peak of one tracemalloc meter started before the model is
built (parameters, gradients, optimizer state and everything the step
makes), beside the runner's figures.

- ``segnet``: ``PixelwiseSoftmaxClassifier(SegNetBasic(n_class=11))`` with
  class weights, MomentumSGD(0.1, 0.9) and WeightDecay(5e-4) (its
  example's), batch 2 at 64 x 96;
- ``ssd``: ``SSD300(n_fg_class=20)`` in the example's ``MultiboxTrainChain``
  (hard negative mining), MomentumSGD, ``GradientScaling(2)`` on the
  biases and ``WeightDecay(5e-4)`` on the rest, batch 2 at 300 x 300,
  targets made by the model's own ``coder.encode``;
- ``frcnn``: ``FasterRCNNTrainChain(FasterRCNNVGG16(n_fg_class=20,
  min_size=128, max_size=160, anchor_scales=(2, 4, 8)))``, MomentumSGD(1e-3,
  0.9) and WeightDecay(5e-4), batch 1 at three image sizes and one to three
  boxes (anchor, proposal and target sampling draw from NumPy's global
  random state in the forward). About 50 s a step on 2 CPUs;
- ``pspnet``: ``PSPNetResNet50(5 classes, input 96 x 96)`` in its example's
  ``TrainChain`` (an auxiliary loss, dropout, lazily initialised
  convolutions), MomentumSGD(1e-2, 0.9), ``WeightDecay(1e-4)`` on all but
  the BatchNorms' and ``GradientScaling(10)`` on the heads', batch 2;
- ``fpn``: ``FasterRCNNFPNResNet50(5 classes, min_size=128,
  max_size=160)`` in its example's ``TrainChain`` (a list of two images of
  their own sizes, with their own boxes: no batch dimension, and the RoIs
  each FPN level gets depend on the data), MomentumSGD(1e-3, 0.9) and
  WeightDecay(1e-4), the stem, res2 and the BatchNorms frozen as the
  example does.

The two examples' train chains are read from the source checkout below
(``CHAINERCV_SRC``, default /tmp/chainercv: ``example_class``), not copied
here. ChainerCV 0.13.1 still uses NumPy aliases removed in 1.24
(``np.float``, ``np.bool``) and stacks generators: ``numpy_aliases`` puts
them back for both runs alike.

ChainerCV 0.13.1 has no wheel, and its source archive ships a C file made
by an old Cython that Python 3.11 cannot build. Build it from the release's
source with a current Cython, in the project's environment::

    PIP_CONSTRAINT=$PWD/constraints.txt .venv/bin/pip install cython 'setuptools<81' wheel
    git clone --depth 1 -b v0.13.1 https://github.com/chainer/chainercv /tmp/chainercv
    PIP_CONSTRAINT=$PWD/constraints.txt .venv/bin/pip install --no-build-isolation /tmp/chainercv

    OPENBLAS_NUM_THREADS=2 .venv/bin/python experiments/chainercv_train.py segnet ssd frcnn pspnet
    STEPS=3 ... frcnn   # fewer steps
    STEPS=12 ... fpn
"""
import gc
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import numpy as np  # noqa: E402
import chainer  # noqa: E402
from chainer.optimizer_hooks import WeightDecay  # noqa: E402

import chainer_recompute as cr  # noqa: E402
from chainer_recompute.runtime.memory import MemoryMeter  # noqa: E402
from harness import Run, assert_same_records, outer_meter, records  # noqa: E402
from test_real_code_patterns import Said  # noqa: E402

STEPS = int(os.environ.get("STEPS", 6))


class MultiboxTrainChain(chainer.Chain):
    """chainercv/examples/ssd/train.py's train chain (the example's file is
    not in the package)."""

    def __init__(self, model, alpha=1, k=3):
        super().__init__()
        with self.init_scope():
            self.model = model
        self.alpha, self.k = alpha, k

    def forward(self, imgs, gt_mb_locs, gt_mb_labels):
        from chainercv.links.model.ssd import multibox_loss
        mb_locs, mb_confs = self.model(imgs)
        loc_loss, conf_loss = multibox_loss(mb_locs, mb_confs, gt_mb_locs, gt_mb_labels, self.k)
        loss = loc_loss * self.alpha + conf_loss
        chainer.reporter.report({"loss": loss, "loss/loc": loc_loss, "loss/conf": conf_loss},
                                self)
        return loss


def boxes(rs, n, h, w, small, large):
    y0, x0 = rs.uniform(0, h - large, n), rs.uniform(0, w - large, n)
    return np.stack([y0, x0, y0 + rs.uniform(small, large, n),
                     x0 + rs.uniform(small, large, n)], 1).astype(np.float32)


def segnet():
    from chainercv.links import PixelwiseSoftmaxClassifier, SegNetBasic
    rs = np.random.RandomState(3)
    data = [(rs.uniform(-1, 1, (2, 3, 64, 96)).astype(np.float32),
             rs.randint(-1, 11, (2, 64, 96)).astype(np.int32)) for _ in range(STEPS)]

    def make():
        model = PixelwiseSoftmaxClassifier(SegNetBasic(n_class=11),
                                           class_weight=np.linspace(0.5, 2, 11, dtype=np.float32))
        return model, chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9), [WeightDecay(5e-4)]
    return make, data


def ssd():
    from chainercv.links import SSD300
    from chainercv.links.model.ssd import GradientScaling
    np.random.seed(5)
    coder = SSD300(n_fg_class=20, pretrained_model=None).coder
    rs = np.random.RandomState(3)
    data = []
    for _ in range(STEPS):
        imgs, locs, labels = [], [], []
        for _ in range(2):
            imgs.append(rs.uniform(-100, 100, (3, 300, 300)).astype(np.float32))
            n = rs.randint(1, 4)
            loc, label = coder.encode(boxes(rs, n, 300, 300, 30, 100),
                                      rs.randint(0, 20, n).astype(np.int32))
            locs.append(loc)
            labels.append(label)
        data.append((np.stack(imgs), np.stack(locs), np.stack(labels)))

    def make():
        model = MultiboxTrainChain(SSD300(n_fg_class=20, pretrained_model=None))
        return model, chainer.optimizers.MomentumSGD(), []

    def rule_hooks(model):
        for param in model.params():
            param.update_rule.add_hook(GradientScaling(2) if param.name == "b"
                                       else WeightDecay(0.0005))
    make.rule_hooks = rule_hooks
    return make, data


def frcnn():
    from chainercv.links import FasterRCNNVGG16
    from chainercv.links.model.faster_rcnn import FasterRCNNTrainChain
    rs = np.random.RandomState(3)
    data = []
    for k in range(STEPS):
        h, w = [(128, 160), (160, 128), (144, 144)][k % 3]
        n = rs.randint(1, 4)
        data.append((rs.uniform(-100, 100, (1, 3, h, w)).astype(np.float32),
                     boxes(rs, n, h, w, 20, 40)[None],
                     rs.randint(0, 20, (1, n)).astype(np.int32), np.array([1.0], np.float32)))

    def make():
        model = FasterRCNNTrainChain(FasterRCNNVGG16(
            n_fg_class=20, pretrained_model=None, min_size=128, max_size=160,
            anchor_scales=(2, 4, 8)))
        return model, chainer.optimizers.MomentumSGD(lr=1e-3, momentum=0.9), [WeightDecay(5e-4)]
    return make, data


def example_class(example, name):
    """Class ``name`` of ChainerCV's ``examples/<example>`` script (not in
    the package; the scripts import chainermn and cv2 at the top), from the
    source checkout the build uses (``CHAINERCV_SRC``, default
    /tmp/chainercv), with the script's own imports."""
    import ast
    path = os.path.join(os.environ.get("CHAINERCV_SRC", "/tmp/chainercv"), "examples", example)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
            and not any(a.name.split(".")[0] in ("chainermn", "cv2") for a in n.names)
            and getattr(n, "module", None) not in ("chainermn",)]
    keep += [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    scope = {"__name__": "chainercv_example"}
    exec(compile(ast.Module(body=keep, type_ignores=[]), path, "exec"), scope)
    return scope[name]


def pspnet():
    from chainercv.experimental.links import PSPNetResNet50
    from chainercv.links.model.ssd import GradientScaling
    TrainChain = example_class("pspnet/train_multi.py", "TrainChain")
    rs = np.random.RandomState(3)
    data = [(rs.uniform(-100, 100, (2, 3, 96, 96)).astype(np.float32),
             rs.randint(-1, 5, (2, 96, 96)).astype(np.int32)) for _ in range(STEPS)]

    def make():
        return (TrainChain(PSPNetResNet50(5, pretrained_model=None, input_size=(96, 96))),
                chainer.optimizers.MomentumSGD(1e-2, 0.9), [])

    def rule_hooks(chain):  # (the example's, after its optimizer's setup)
        model = chain.model
        for param in chain.params():
            if param.name not in ("beta", "gamma"):
                param.update_rule.add_hook(WeightDecay(1e-4))
        for link in [model.ppm, model.head_conv1, model.head_conv2, chain.aux_conv1,
                     chain.aux_conv2]:
            for param in link.params():
                param.update_rule.add_hook(GradientScaling(10))
    make.rule_hooks = rule_hooks
    return make, data


def fpn():
    from chainercv.links import FasterRCNNFPNResNet50
    TrainChain = example_class("fpn/train_multi.py", "TrainChain")
    rs = np.random.RandomState(3)
    data = []
    for k in range(STEPS):
        imgs, bbs, labels = [], [], []
        for b in range(2):
            h, w = [(128, 160), (160, 128), (128, 128)][(k + b) % 3]
            n = rs.randint(1, 4)
            imgs.append(rs.uniform(-100, 100, (3, h, w)).astype(np.float32))
            bbs.append(boxes(rs, n, h, w, 16, 40))
            labels.append(rs.randint(0, 5, n).astype(np.int32))
        data.append((imgs, bbs, labels))

    def make():
        model = TrainChain(FasterRCNNFPNResNet50(n_fg_class=5, pretrained_model=None,
                                                 min_size=128, max_size=160))
        return model, chainer.optimizers.MomentumSGD(1e-3, 0.9), [WeightDecay(1e-4)]

    def rule_hooks(chain):  # (the example's: the stem, res2 and BatchNorms frozen)
        chain.model.extractor.base.conv1.disable_update()
        chain.model.extractor.base.res2.disable_update()
        for link in chain.links():
            if isinstance(link, chainer.links.BatchNormalization):
                link.disable_update()
    make.rule_hooks = rule_hooks
    return make, data


def numpy_aliases():
    """ChainerCV 0.13.1 still uses NumPy's removed aliases (``np.float``,
    ``np.bool``) and stacks generators (refused since NumPy 1.24): put back
    for both runs alike."""
    import types
    np.float, np.bool = float, bool
    for name in ("hstack", "vstack"):
        def stacked(tup, *args, _stack=getattr(np, name), **kwargs):
            return _stack(list(tup) if isinstance(tup, types.GeneratorType) else tup,
                          *args, **kwargs)
        setattr(np, name, stacked)


def train(make, data, applied):
    run = Run()
    run.times = []
    with outer_meter():
        np.random.seed(0)
        random.seed(0)
        model, opt, hooks = make()
        if applied:
            cr.apply(model, budget="least", verbose=False)
        opt.setup(model)
        for h in hooks:
            opt.add_hook(h)
        if hasattr(make, "rule_hooks"):
            make.rule_hooks(model)
        for k, batch in enumerate(data):
            gc.collect()
            t0 = time.perf_counter()
            with MemoryMeter() as m:
                opt.update(model, *batch)
            run.times.append(time.perf_counter() - t0)
            run.peaks.append(m.result.absolute_peak_bytes)
            rec = records(model, None)
            rec["python random"] = random.getstate()
            run.records.append(rec)
            st = cr.runner_of(model).last_stats if applied else None
            run.stats.append(st and (st.path, st.n_dropped, st.budget_bytes,
                                     st.predicted_peak_bytes))
            print(f"  {'applied' if applied else 'plain'} step {k}: {run.times[-1]:.1f} s,"
                  f" peak {run.peaks[-1]:,} B" + (f", {run.stats[-1]}" if applied else ""),
                  flush=True)
        del model, opt
    return run


def main(names):
    numpy_aliases()
    with np.errstate(all="ignore"):  # (random images: SSD's losses overflow, in both runs)
        for name in names:
            make, data = {"segnet": segnet, "ssd": ssd, "frcnn": frcnn, "pspnet": pspnet,
                          "fpn": fpn}[name]()
            print(name)
            plain = train(make, data, False)
            with Said() as said:
                ours = train(make, data, True)
            assert_same_records(plain, ours, name, same_keys=True)
            print(f"{name}: identical over {len(data)} steps; plain {sum(plain.times):.1f} s, "
                  f"applied {sum(ours.times):.1f} s; said: {said.messages or 'nothing'}")
            for k, (p, a, s) in enumerate(zip(plain.peaks, ours.peaks, ours.stats)):
                over = s[2] is not None and a > s[2]
                print(f"  step {k}: plain {p:,} B, applied {a:,} B ({a / p:.3f}), {s[0]}, "
                      f"dropped {s[1]}, budget {s[2] or 0:,} B, predicted {s[3] or 0:,} B"
                      + (" OVER" if over else ""))


if __name__ == "__main__":
    main(sys.argv[1:] or ["segnet", "ssd"])
