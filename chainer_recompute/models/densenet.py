"""DenseNet (Huang et al., CVPR 2017) in plain Chainer, DenseNet-161 shape.

The layout follows the reference implementation the paper's authors dumped
(``cg_densenet.txt``): a 7x7/2 convolution stem with BatchNorm, ReLU and a
3x3/2 max pooling; four dense blocks of BN-ReLU-Conv1x1(4k)-BN-ReLU-Conv3x3(k)
bottleneck layers where *every* layer concatenates its ``k`` new feature maps
to its input with one ``F.concat``; transitions BN-ReLU-Conv1x1-AvgPool2x2
with compression 0.5; a final BN-ReLU, global average pooling, reshape and a
linear classifier. Parameter paths match the authors' dump under a
``predictor`` child (``/predictor/c0/W``, ``/predictor/d0/0/bn0/gamma``,
``/predictor/t0/c0/W``, ``/predictor/t3_bn0/gamma``, ``/predictor/fc/W``).

At batch 32 and 3x224x224 the forward pass plus softmax cross entropy applies
568 functions: Convolution2DFunction 160, BatchNormalization 161, ReLU 161,
Concat 78, AveragePooling2D 4, MaxPooling2D 1, Reshape 1, LinearFunction 1,
SoftmaxCrossEntropy 1 -- the authors' counts exactly. The count does not
depend on the input size or the widths, so the ``small`` variant has the same
graph shape.
"""
from __future__ import annotations

from typing import Sequence

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import initializers

__all__ = ["DenseLayer", "DenseBlock", "Transition", "DenseNet", "densenet161"]


class DenseLayer(chainer.Chain):
    """One bottleneck layer: BN-ReLU-Conv1x1(bn_size*k)-BN-ReLU-Conv3x3(k).

    Args:
        in_channels: Channels of the input (all previous feature maps).
        growth_rate: ``k``, the channels this layer adds.
        bn_size: Bottleneck width multiplier (4 in DenseNet-BC).
    """

    def __init__(self, in_channels: int, growth_rate: int, bn_size: int = 4) -> None:
        super().__init__()
        w = initializers.HeNormal()
        mid = bn_size * growth_rate
        with self.init_scope():
            self.bn0 = L.BatchNormalization(in_channels)
            self.c0 = L.Convolution2D(in_channels, mid, 1, 1, 0, nobias=True, initialW=w)
            self.bn1 = L.BatchNormalization(mid)
            self.c1 = L.Convolution2D(mid, growth_rate, 3, 1, 1, nobias=True, initialW=w)

    def forward(self, x: chainer.Variable) -> chainer.Variable:
        """Return ``concat(x, new_features)`` along the channel axis."""
        h = self.c0(F.relu(self.bn0(x)))
        h = self.c1(F.relu(self.bn1(h)))
        return F.concat((x, h), axis=1)


class DenseBlock(chainer.ChainList):
    """``n_layers`` dense layers; children are named ``0``, ``1``, ...

    Args:
        n_layers: Number of dense layers.
        in_channels: Channels entering the block.
        growth_rate: Channels each layer adds.
        bn_size: Bottleneck width multiplier.
    """

    def __init__(self, n_layers: int, in_channels: int, growth_rate: int,
                 bn_size: int = 4) -> None:
        super().__init__()
        for i in range(n_layers):
            self.add_link(DenseLayer(in_channels + i * growth_rate, growth_rate, bn_size))
        self.out_channels = in_channels + n_layers * growth_rate

    def forward(self, x: chainer.Variable) -> chainer.Variable:
        """Apply the layers in order."""
        for layer in self:
            x = layer(x)
        return x


class Transition(chainer.Chain):
    """BN-ReLU-Conv1x1-AvgPool(2, 2) between dense blocks.

    Args:
        in_channels: Input channels.
        out_channels: Output channels (``compression * in_channels``).
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        with self.init_scope():
            self.bn0 = L.BatchNormalization(in_channels)
            self.c0 = L.Convolution2D(in_channels, out_channels, 1, 1, 0, nobias=True,
                                      initialW=initializers.HeNormal())

    def forward(self, x: chainer.Variable) -> chainer.Variable:
        """Halve the spatial size and compress the channels."""
        h = self.c0(F.relu(self.bn0(x)))
        return F.average_pooling_2d(h, 2, 2)


class DenseNet(chainer.Chain):
    """DenseNet-BC classifier returning class scores (logits).

    Args:
        growth_rate: ``k``.
        block_config: Layers per dense block.
        init_features: Channels of the stem convolution.
        bn_size: Bottleneck width multiplier.
        compression: Channel factor of the transitions.
        n_class: Number of classes.

    Example:
        >>> import numpy as np
        >>> net = DenseNet(4, (1, 1, 1, 1), 8, n_class=3)
        >>> net(np.zeros((1, 3, 32, 32), np.float32)).shape
        (1, 3)
    """

    def __init__(self, growth_rate: int = 48, block_config: Sequence[int] = (6, 12, 36, 24),
                 init_features: int = 96, bn_size: int = 4, compression: float = 0.5,
                 n_class: int = 1000) -> None:
        super().__init__()
        self.n_blocks = len(block_config)
        ch = init_features
        with self.init_scope():
            self.c0 = L.Convolution2D(3, ch, 7, 2, 3, nobias=True,
                                      initialW=initializers.HeNormal())
            self.bn0 = L.BatchNormalization(ch)
            for i, n in enumerate(block_config):
                block = DenseBlock(n, ch, growth_rate, bn_size)
                setattr(self, f"d{i}", block)
                ch = block.out_channels
                if i != len(block_config) - 1:
                    out = int(ch * compression)
                    setattr(self, f"t{i}", Transition(ch, out))
                    ch = out
            setattr(self, f"t{len(block_config) - 1}_bn0", L.BatchNormalization(ch))
            self.fc = L.Linear(ch, n_class)
        self.out_features = ch

    def forward(self, x: chainer.Variable) -> chainer.Variable:
        """Return logits of shape ``(B, n_class)``."""
        h = F.relu(self.bn0(self.c0(x)))
        h = F.max_pooling_2d(h, 3, 2, 1, cover_all=False)
        for i in range(self.n_blocks):
            h = getattr(self, f"d{i}")(h)
            if i != self.n_blocks - 1:
                h = getattr(self, f"t{i}")(h)
        h = F.relu(getattr(self, f"t{self.n_blocks - 1}_bn0")(h))
        # Global average pooling; the kernel is 7 at 224x224 as in the reference.
        h = F.average_pooling_2d(h, h.shape[2:], 1)
        h = F.reshape(h, (h.shape[0], self.out_features))
        return self.fc(h)


def densenet161(n_class: int = 1000, small: bool = False) -> DenseNet:
    """DenseNet-161 (k=48, blocks 6-12-36-24, 96 stem features).

    Args:
        n_class: Number of classes.
        small: Same depth and graph shape but tiny widths (k=2, 4 stem
            features) for quick CPU tests.

    Returns:
        The classifier (logits), without the loss.
    """
    if small:
        return DenseNet(2, (6, 12, 36, 24), 4, n_class=n_class)
    return DenseNet(48, (6, 12, 36, 24), 96, n_class=n_class)
