"""The networks of the paper's experiments, as training-loss links.

Kusumoto et al. (NeurIPS 2019) measure ResNet50/101/152, VGG19, GoogLeNet,
DenseNet161 (batch 32, 3x224x224), U-Net (batch 8, 1x572x572) and PSPNet
(batch 1, 3x713x713). :func:`get_model` returns a :class:`ModelSpec` whose
``link(x, t)`` returns the scalar training loss and whose ``make_inputs``
draws matching inputs and labels.

Chainer is imported only when a model is built, so importing this module
(or asking for an unknown name) stays cheap.

Loss conventions:

* classifiers (``mlp``, ``resnet*``, ``vgg19``, ``densenet161``): softmax
  cross entropy on the logits (ResNet ``fc6``, VGG ``fc8``), no softmax node.
* ``googlenet``: ``main + 0.3 * (aux1 + aux2)`` as in Szegedy et al.; the
  ``prob`` softmax of Chainer's GoogLeNet is skipped.
* ``unet``: pixel-wise softmax cross entropy on the 388x388 output.
* ``pspnet``: pixel-wise softmax cross entropy (``ignore_label=-1``) plus 0.4
  times the auxiliary res4 loss.

The classifier wrappers hold the network as ``predictor`` (parameter paths
``/predictor/...`` as in the authors' dumps); U-Net and PSPNet are their own
loss links (``/conv_d0a_b/W`` as in the authors' U-Net dump).

References:
    Kusumoto, M., Inoue, T., Watanabe, G., Akiba, T., Koyama, M. "A Graph
    Theoretic Framework of Recomputation Algorithms for Memory-Efficient
    Backpropagation". NeurIPS 2019.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import numpy

if TYPE_CHECKING:  # pragma: no cover
    import chainer

__all__ = ["ModelSpec", "MODELS", "get_model"]


@dataclass(frozen=True)
class ModelSpec:
    """A network ready for a training step.

    Attributes:
        name: Registry name.
        link: ``chainer.Link``; ``link(x, t)`` returns the scalar loss.
        input_shape: Shape of one input sample, e.g. ``(3, 224, 224)``.
        label_shape: Shape of one sample's labels: ``()`` for classifiers,
            ``(H, W)`` for segmentation.
        n_class: Number of classes.
        default_batch_size: The paper's batch size for this network.
        small: Whether this is the reduced variant for quick tests.
    """

    name: str
    link: "chainer.Link"
    input_shape: Tuple[int, ...]
    label_shape: Tuple[int, ...]
    n_class: int
    default_batch_size: int
    small: bool = False

    def make_inputs(self, batch_size: Optional[int] = None, xp: Any = numpy,
                    seed: int = 0) -> Tuple[Any, Any]:
        """Draw inputs and labels of the right shapes.

        Args:
            batch_size: Batch size; ``None`` means ``default_batch_size``.
            xp: Array module (``numpy`` or ``cupy``).
            seed: Seed of the NumPy generator; same seed, same arrays.

        Returns:
            ``(x, t)``: float32 ``(B,) + input_shape`` drawn from N(0, 1) and
            int32 ``(B,) + label_shape`` in ``[0, n_class)``.

        Example:
            >>> spec = get_model("mlp")
            >>> x, t = spec.make_inputs(4)
            >>> x.shape, x.dtype, t.shape, t.dtype
            ((4, 784), dtype('float32'), (4,), dtype('int32'))
        """
        b = self.default_batch_size if batch_size is None else int(batch_size)
        rng = numpy.random.RandomState(seed)
        x = rng.standard_normal((b,) + tuple(self.input_shape)).astype(numpy.float32)
        t = rng.randint(0, self.n_class, size=(b,) + tuple(self.label_shape)).astype(numpy.int32)
        if xp is not numpy:
            x, t = xp.asarray(x), xp.asarray(t)
        return x, t


@functools.lru_cache(maxsize=None)
def _wrappers() -> SimpleNamespace:
    """Loss wrappers around Chainer's classifiers, defined on first use."""
    import chainer
    import chainer.functions as F
    import chainer.links as L

    class SoftmaxLoss(chainer.Chain):
        """``softmax_cross_entropy(predictor(x), t)``."""

        def __init__(self, predictor: chainer.Link) -> None:
            super().__init__()
            with self.init_scope():
                self.predictor = predictor

        def forward(self, x: Any, t: Any) -> chainer.Variable:
            return F.softmax_cross_entropy(self.predictor(x), t)

    class LayersLoss(chainer.Chain):
        """Softmax cross entropy on one named output of a ``*Layers`` model."""

        def __init__(self, predictor: chainer.Link, layer: str) -> None:
            super().__init__()
            self.layer = layer
            with self.init_scope():
                self.predictor = predictor

        def forward(self, x: Any, t: Any) -> chainer.Variable:
            y = self.predictor(x, layers=[self.layer])[self.layer]
            return F.softmax_cross_entropy(y, t)

    class GoogLeNetLoss(chainer.Chain):
        """``main + aux_weight * (aux1 + aux2)`` for Chainer's GoogLeNet."""

        def __init__(self, predictor: chainer.Link, aux_weight: float = 0.3) -> None:
            super().__init__()
            self.aux_weight = aux_weight
            with self.init_scope():
                self.predictor = predictor

        def forward(self, x: Any, t: Any) -> chainer.Variable:
            h = x
            cache: Dict[str, Any] = {}
            out: Dict[str, Any] = {}
            for key, funcs in self.predictor.functions.items():
                if key == "prob":
                    continue
                if key in ("loss1_fc2", "loss2_fc2"):
                    if not self.aux_weight:
                        continue
                    h = cache["inception_4a" if key == "loss1_fc2" else "inception_4d"]
                for func in funcs:
                    h = func(h)
                if key in ("inception_4a", "inception_4d"):
                    cache[key] = h
                out[key] = h
            loss = F.softmax_cross_entropy(out["loss3_fc"], t)
            if self.aux_weight:
                aux = (F.softmax_cross_entropy(out["loss1_fc2"], t)
                       + F.softmax_cross_entropy(out["loss2_fc2"], t))
                loss = loss + self.aux_weight * aux
            return loss

    class MLP(chainer.ChainList):
        """ReLU multilayer perceptron."""

        def __init__(self, sizes: Tuple[int, ...]) -> None:
            super().__init__(*[L.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:])])

        def forward(self, x: Any) -> chainer.Variable:
            h = x
            for i, layer in enumerate(self):
                h = layer(h)
                if i != len(self) - 1:
                    h = F.relu(h)
            return h

    return SimpleNamespace(SoftmaxLoss=SoftmaxLoss, LayersLoss=LayersLoss,
                           GoogLeNetLoss=GoogLeNetLoss, MLP=MLP)


def _replace_linear(owner: Any, name: str, n_class: int) -> None:
    """Swap ``owner.<name>`` (a Linear to 1000 classes) for one to ``n_class``."""
    import chainer.links as L
    old = getattr(owner, name)
    if old.out_size == n_class:
        return
    delattr(owner, name)
    with owner.init_scope():
        setattr(owner, name, L.Linear(old.in_size, n_class))


def _build_mlp(n_class: Optional[int], small: bool) -> Tuple[Any, tuple, tuple, int]:
    n_class = 10 if n_class is None else n_class
    sizes = (784, 100, 100, n_class) if not small else (784, 32, n_class)
    return _wrappers().SoftmaxLoss(_wrappers().MLP(sizes)), (784,), (), n_class


def _build_resnet(n_layers: int) -> Callable[..., Tuple[Any, tuple, tuple, int]]:
    def build(n_class: Optional[int], small: bool) -> Tuple[Any, tuple, tuple, int]:
        import chainer.links as L
        n_class = 1000 if n_class is None else n_class
        net = getattr(L, f"ResNet{n_layers}Layers")(pretrained_model=None)
        _replace_linear(net, "fc6", n_class)
        size = 64 if small else 224  # global average pooling: any size >= 32 works
        return _wrappers().LayersLoss(net, "fc6"), (3, size, size), (), n_class
    return build


def _build_vgg19(n_class: Optional[int], small: bool) -> Tuple[Any, tuple, tuple, int]:
    import chainer.links as L
    n_class = 1000 if n_class is None else n_class
    net = L.VGG19Layers(pretrained_model=None)
    _replace_linear(net, "fc8", n_class)
    # fc6 expects 512x7x7, so the input stays 224 even when small.
    return _wrappers().LayersLoss(net, "fc8"), (3, 224, 224), (), n_class


def _build_googlenet(n_class: Optional[int], small: bool) -> Tuple[Any, tuple, tuple, int]:
    import chainer.links as L
    n_class = 1000 if n_class is None else n_class
    net = L.GoogLeNet(pretrained_model=None)
    for name in ("loss3_fc", "loss1_fc2", "loss2_fc2"):
        _replace_linear(net, name, n_class)
    # The auxiliary heads' fc1 expects 128x4x4, so the input stays 224.
    return _wrappers().GoogLeNetLoss(net, 0.3), (3, 224, 224), (), n_class


def _build_densenet161(n_class: Optional[int], small: bool) -> Tuple[Any, tuple, tuple, int]:
    from .densenet import densenet161
    n_class = (10 if small else 1000) if n_class is None else n_class
    size = 32 if small else 224
    return (_wrappers().SoftmaxLoss(densenet161(n_class, small)), (3, size, size), (),
            n_class)


def _build_pspnet(n_class: Optional[int], small: bool) -> Tuple[Any, tuple, tuple, int]:
    from .pspnet import PSPNet
    n_class = 17 if n_class is None else n_class
    if small:
        # Same depth (ResNet-101 trunk) and graph shape, 1/16 of the widths.
        return PSPNet(n_class, width=4), (3, 65, 65), (65, 65), n_class
    return PSPNet(n_class), (3, 713, 713), (713, 713), n_class


def _build_unet(n_class: Optional[int], small: bool) -> Tuple[Any, tuple, tuple, int]:
    from .unet import UNet
    n_class = 2 if n_class is None else n_class
    if small:
        # Same graph shape; widths 4..64 and the valid input 204 -> 20.
        return UNet(n_class, base_width=4), (1, 204, 204), (20, 20), n_class
    return UNet(n_class), (1, 572, 572), (388, 388), n_class


#: Registry: name -> (builder(n_class, small) -> (link, input_shape,
#: label_shape, n_class), the paper's batch size).
MODELS: Dict[str, Tuple[Callable[..., Tuple[Any, tuple, tuple, int]], int]] = {
    "mlp": (_build_mlp, 32),
    "resnet50": (_build_resnet(50), 32),
    "resnet101": (_build_resnet(101), 32),
    "resnet152": (_build_resnet(152), 32),
    "vgg19": (_build_vgg19, 32),
    "googlenet": (_build_googlenet, 32),
    "densenet161": (_build_densenet161, 32),
    "pspnet": (_build_pspnet, 1),
    "unet": (_build_unet, 8),
}


def get_model(name: str, *, batch_size: Optional[int] = None, n_class: Optional[int] = None,
              small: bool = False) -> ModelSpec:
    """Build a registered network wrapped with its training loss.

    Args:
        name: One of ``sorted(MODELS)``.
        batch_size: Overrides the paper's batch size as ``default_batch_size``.
        n_class: Number of classes; ``None`` means the paper's (1000 for the
            ImageNet classifiers, 17 for PSPNet, 2 for U-Net, 10 for ``mlp``
            and the small DenseNet).
        small: Reduced variant for quick CPU tests: tiny widths and inputs for
            ``densenet161`` (32x32, same 568-function graph), ``pspnet``
            (65x65, width/16), ``unet`` (204 -> 20, width/16) and ``mlp``;
            64x64 inputs for ``resnet*``; ``vgg19`` and ``googlenet`` keep
            224x224 (their fully connected layers fix the size).

    Returns:
        The :class:`ModelSpec`; ``spec.link(*spec.make_inputs())`` is the loss.

    Raises:
        ValueError: For an unknown name (the message lists the known ones) or
            a non-positive ``batch_size``.

    Example:
        >>> spec = get_model("mlp")
        >>> float(spec.link(*spec.make_inputs(2)).array) > 0
        True
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    if batch_size is not None and int(batch_size) <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    builder, paper_batch = MODELS[name]
    link, input_shape, label_shape, n = builder(n_class, small)
    return ModelSpec(name=name, link=link, input_shape=tuple(input_shape),
                     label_shape=tuple(label_shape), n_class=int(n),
                     default_batch_size=paper_batch if batch_size is None else int(batch_size),
                     small=small)
