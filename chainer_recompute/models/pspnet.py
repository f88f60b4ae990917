"""PSPNet (Zhao et al., CVPR 2017) with a dilated ResNet-101, in plain Chainer.

The layout follows ChainerCV's PSPNet and its training chain: a deep stem
(three 3x3 Conv-BN-ReLU, the first with stride 2) and 3x3/2 max pooling;
ResNet-101 bottleneck stages res2..res5 with (3, 4, 23, 3) blocks, res3
strided, res4 and res5 dilated by 2 and 4 (output stride 8); a pyramid
pooling module (average pooling to bins 1, 2, 3, 6, Conv1x1-BN-ReLU to
``C / 4`` channels each, ``F.resize_images`` back and ``F.concat`` with the
input); a head Conv3x3-BN-ReLU, dropout 0.1, Conv1x1 to the classes and
``F.resize_images`` to the input size. Training adds an auxiliary head on
res4 (Conv3x3-BN-ReLU to 256, dropout 0.1, Conv1x1, resize) whose loss has
weight 0.4. The loss is the pixel-wise softmax cross entropy with
``ignore_label=-1``.

The pooling kernels follow ChainerCV: ``ksize = stride = feature_size // bin``,
exact for the paper's 713x713 input (90x90 features: 90, 45, 30, 15).

``F.resize_images`` of Chainer 7.8.1 reads ``numpy.float``, which NumPy 1.24
removed; ``chainer_recompute._compat.patch_resize_images`` (applied whenever
this package imports Chainer) mends that.
"""
from __future__ import annotations

import logging
from typing import Sequence

from ..runtime import _chainer  # noqa: F401  (NumPy compatibility, resize_images)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import initializers

logger = logging.getLogger(__name__)


__all__ = ["ConvBNReLU", "Bottleneck", "ResStage", "DilatedResNet", "PyramidPooling",
           "PSPNet"]


class ConvBNReLU(chainer.Chain):
    """Convolution (no bias), BatchNorm and optionally ReLU.

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        ksize: Kernel size.
        stride: Stride.
        pad: Padding.
        dilate: Dilation.
        activ: Apply ReLU after BatchNorm.
    """

    def __init__(self, in_channels: int, out_channels: int, ksize: int, stride: int = 1,
                 pad: int = 0, dilate: int = 1, activ: bool = True) -> None:
        super().__init__()
        self.activ = activ
        with self.init_scope():
            self.conv = L.Convolution2D(in_channels, out_channels, ksize, stride, pad,
                                        nobias=True, dilate=dilate,
                                        initialW=initializers.HeNormal())
            self.bn = L.BatchNormalization(out_channels)

    def forward(self, x: chainer.Variable) -> chainer.Variable:
        """Conv, BN, (ReLU)."""
        h = self.bn(self.conv(x))
        return F.relu(h) if self.activ else h


class Bottleneck(chainer.Chain):
    """ResNet bottleneck 1x1-3x3(dilated, strided)-1x1 with a residual add.

    Args:
        in_channels: Input channels.
        mid_channels: Bottleneck channels.
        out_channels: Output channels.
        stride: Stride of the 3x3 convolution (and of the projection).
        dilate: Dilation of the 3x3 convolution.
        projection: Use a 1x1 Conv-BN projection on the shortcut.
    """

    def __init__(self, in_channels: int, mid_channels: int, out_channels: int,
                 stride: int = 1, dilate: int = 1, projection: bool = False) -> None:
        super().__init__()
        with self.init_scope():
            self.conv1 = ConvBNReLU(in_channels, mid_channels, 1)
            self.conv2 = ConvBNReLU(mid_channels, mid_channels, 3, stride, dilate, dilate)
            self.conv3 = ConvBNReLU(mid_channels, out_channels, 1, activ=False)
            self.residual_conv = (ConvBNReLU(in_channels, out_channels, 1, stride, activ=False)
                                  if projection else None)

    def forward(self, x: chainer.Variable) -> chainer.Variable:
        """``relu(f(x) + shortcut(x))``."""
        h = self.conv3(self.conv2(self.conv1(x)))
        s = self.residual_conv(x) if self.residual_conv is not None else x
        return F.relu(h + s)


class ResStage(chainer.ChainList):
    """``n_blocks`` bottlenecks, the first one projecting.

    Args:
        n_blocks: Number of blocks.
        in_channels: Input channels.
        mid_channels: Bottleneck channels.
        out_channels: Output channels.
        stride: Stride of the first block.
        dilate: Dilation of every block.
    """

    def __init__(self, n_blocks: int, in_channels: int, mid_channels: int,
                 out_channels: int, stride: int = 1, dilate: int = 1) -> None:
        super().__init__()
        self.add_link(Bottleneck(in_channels, mid_channels, out_channels, stride, dilate,
                                 projection=True))
        for _ in range(n_blocks - 1):
            self.add_link(Bottleneck(out_channels, mid_channels, out_channels, 1, dilate))

    def forward(self, x: chainer.Variable) -> chainer.Variable:
        """Apply the blocks in order."""
        for block in self:
            x = block(x)
        return x


class DilatedResNet(chainer.Chain):
    """Dilated ResNet trunk with output stride 8; returns ``(res4, res5)``.

    Args:
        n_blocks: Blocks of res2..res5 ((3, 4, 23, 3) for ResNet-101).
        width: Stem width (64 in ResNet); stages use 1x, 2x, 4x, 8x of it
            as bottleneck widths and 4x that as outputs.
    """

    def __init__(self, n_blocks: Sequence[int] = (3, 4, 23, 3), width: int = 64) -> None:
        super().__init__()
        w = width
        with self.init_scope():
            self.conv1_1 = ConvBNReLU(3, w, 3, 2, 1)
            self.conv1_2 = ConvBNReLU(w, w, 3, 1, 1)
            self.conv1_3 = ConvBNReLU(w, 2 * w, 3, 1, 1)
            self.res2 = ResStage(n_blocks[0], 2 * w, w, 4 * w, 1, 1)
            self.res3 = ResStage(n_blocks[1], 4 * w, 2 * w, 8 * w, 2, 1)
            self.res4 = ResStage(n_blocks[2], 8 * w, 4 * w, 16 * w, 1, 2)
            self.res5 = ResStage(n_blocks[3], 16 * w, 8 * w, 32 * w, 1, 4)
        self.res4_channels = 16 * w
        self.res5_channels = 32 * w

    def forward(self, x: chainer.Variable) -> tuple[chainer.Variable, chainer.Variable]:
        """Return the res4 and res5 feature maps (stride 8)."""
        h = self.conv1_3(self.conv1_2(self.conv1_1(x)))
        h = F.max_pooling_2d(h, 3, 2, 1)
        h = self.res3(self.res2(h))
        res4 = self.res4(h)
        res5 = self.res5(res4)
        return res4, res5


class PyramidPooling(chainer.ChainList):
    """Pyramid pooling module: pool to each bin count, reduce, resize, concat.

    Args:
        in_channels: Input channels ``C``; each branch outputs ``C // len(bins)``.
        bins: Output grid sizes of the poolings.
    """

    def __init__(self, in_channels: int, bins: Sequence[int] = (1, 2, 3, 6)) -> None:
        super().__init__()
        self.bins = tuple(bins)
        for _ in self.bins:
            self.add_link(ConvBNReLU(in_channels, in_channels // len(self.bins), 1))
        self.out_channels = in_channels + len(self.bins) * (in_channels // len(self.bins))

    def forward(self, x: chainer.Variable) -> chainer.Variable:
        """Return ``concat([x] + branches)``."""
        H, W = x.shape[2:]
        ys = [x]
        for f, b in zip(self, self.bins):
            ksize = (max(H // b, 1), max(W // b, 1))
            y = f(F.average_pooling_2d(x, ksize, ksize))
            ys.append(F.resize_images(y, (H, W)))
        return F.concat(ys, axis=1)


class PSPNet(chainer.Chain):
    """PSPNet; ``forward(x, t)`` returns main loss + ``aux_weight`` * auxiliary loss.

    Args:
        n_class: Number of classes (17 in the paper's experiment).
        n_blocks: Trunk blocks ((3, 4, 23, 3): ResNet-101).
        width: Trunk stem width (64); the head and auxiliary widths scale with it
            (512 and 256 at 64).
        bins: Pyramid pooling bins.
        aux_weight: Weight of the auxiliary res4 loss (0.4); 0 drops the branch.
        dropout_ratio: Dropout before the classifiers (0.1).
        ignore_label: Label ignored by the loss.

    Example:
        >>> import numpy as np
        >>> net = PSPNet(n_class=3, n_blocks=(1, 1, 1, 1), width=4)
        >>> net.predict(np.zeros((1, 3, 33, 33), np.float32)).shape
        (1, 3, 33, 33)
    """

    def __init__(self, n_class: int = 17, n_blocks: Sequence[int] = (3, 4, 23, 3),
                 width: int = 64, bins: Sequence[int] = (1, 2, 3, 6),
                 aux_weight: float = 0.4, dropout_ratio: float = 0.1,
                 ignore_label: int = -1) -> None:
        super().__init__()
        self.aux_weight = aux_weight
        self.dropout_ratio = dropout_ratio
        self.ignore_label = ignore_label
        w = initializers.HeNormal()
        with self.init_scope():
            self.trunk = DilatedResNet(n_blocks, width)
            self.ppm = PyramidPooling(self.trunk.res5_channels, bins)
            self.head_conv1 = ConvBNReLU(self.ppm.out_channels, 8 * width, 3, 1, 1)
            self.head_conv2 = L.Convolution2D(8 * width, n_class, 1, initialW=w)
            if aux_weight:
                self.aux_conv1 = ConvBNReLU(self.trunk.res4_channels, 4 * width, 3, 1, 1)
                self.aux_conv2 = L.Convolution2D(4 * width, n_class, 1, initialW=w)

    def _main(self, res5: chainer.Variable, size: tuple[int, int]) -> chainer.Variable:
        h = self.head_conv1(self.ppm(res5))
        h = F.dropout(h, self.dropout_ratio)
        return F.resize_images(self.head_conv2(h), size)

    def predict(self, x: chainer.Variable) -> chainer.Variable:
        """Main-branch scores ``(B, n_class, H, W)`` at the input's size."""
        _, res5 = self.trunk(x)
        return self._main(res5, x.shape[2:])

    def forward(self, x: chainer.Variable, t: chainer.Variable) -> chainer.Variable:
        """Training loss; ``t`` is int32 ``(B, H, W)`` with ``ignore_label`` allowed."""
        size = x.shape[2:]
        res4, res5 = self.trunk(x)
        loss = F.softmax_cross_entropy(self._main(res5, size), t,
                                       ignore_label=self.ignore_label)
        if self.aux_weight:
            a = F.dropout(self.aux_conv1(res4), self.dropout_ratio)
            a = F.resize_images(self.aux_conv2(a), size)
            loss = loss + self.aux_weight * F.softmax_cross_entropy(
                a, t, ignore_label=self.ignore_label)
        return loss
