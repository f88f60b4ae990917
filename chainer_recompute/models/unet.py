"""The original U-Net (Ronneberger et al., MICCAI 2015) in plain Chainer.

Valid (unpadded) 3x3 convolutions, 2x2 max pooling, 2x2 stride-2
up-convolutions each followed by ReLU, crop-and-concatenate skip connections
(``concat([crop(skip), up])``), dropout 0.5 at the end of the contracting
path (after the last two encoder stages, as in the authors' Caffe model) and
a 1x1 score convolution. An input of 572x572 gives a 388x388 output; in
general the valid input sizes are ``16 * n + 12`` (n >= 11) and the output is
``input - 184`` (188 -> 4, 204 -> 20, 572 -> 388).

The link names follow the Caffe model and the authors' dump
(``cg_unet.txt``): ``conv_d0a_b`` ... ``conv_d4b_c``, ``upconv_d4c_u3a``,
``conv_u3b_c``, ``conv_u3c_d``, ... ``conv_u0d_score``, all at the root of the
link. One forward pass with the loss applies 60 functions, as in the
authors' graph: Convolution2DFunction 19, ReLU 22, MaxPooling2D 4,
Dropout 2, Deconvolution2DFunction 4, GetItem 4, Concat 4,
SoftmaxCrossEntropy 1.
"""
from __future__ import annotations

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import initializers

__all__ = ["UNet", "output_size", "is_valid_input_size"]


def output_size(input_size: int, depth: int = 4) -> int:
    """Spatial output size of a valid U-Net for a square input.

    Args:
        input_size: Input height (or width).
        depth: Number of poolings (4 in the original).

    Returns:
        The output size.

    Raises:
        ValueError: If a pooling would see an odd size or a size drops to 0.

    Example:
        >>> output_size(572)
        388
    """
    s = input_size
    for _ in range(depth):
        s -= 4
        if s <= 0 or s % 2:
            raise ValueError(f"U-Net input {input_size} is not valid: a pooling sees {s}; "
                             "use 16 * n + 12, e.g. 188, 204 or 572")
        s //= 2
    s -= 4
    for _ in range(depth):
        if s <= 0:
            break
        s = 2 * s - 4
    if s <= 0:
        raise ValueError(f"U-Net input {input_size} is too small; use at least 188")
    return s


def is_valid_input_size(input_size: int, depth: int = 4) -> bool:
    """Whether ``input_size`` passes through the valid U-Net without a remainder."""
    try:
        output_size(input_size, depth)
    except ValueError:
        return False
    return True


def _center_crop(x: chainer.Variable, size: int) -> chainer.Variable:
    d = (x.shape[2] - size) // 2
    if d == 0:
        return x
    return x[:, :, d:-d, d:-d]


class UNet(chainer.Chain):
    """U-Net whose ``forward(x, t)`` returns the pixel-wise softmax cross entropy.

    Args:
        n_class: Output classes (2 in the original).
        in_channels: Input channels (1 in the original).
        base_width: Channels of the first stage (64); stage ``i`` has
            ``base_width * 2 ** i``.
        dropout_ratio: Dropout at the end of the contracting path.

    Example:
        >>> import numpy as np
        >>> net = UNet(base_width=2)
        >>> net.predict(np.zeros((1, 1, 188, 188), np.float32)).shape
        (1, 2, 4, 4)
    """

    depth = 4

    def __init__(self, n_class: int = 2, in_channels: int = 1, base_width: int = 64,
                 dropout_ratio: float = 0.5) -> None:
        super().__init__()
        self.dropout_ratio = dropout_ratio
        w = initializers.HeNormal()
        ch = [base_width * 2 ** i for i in range(self.depth + 1)]
        with self.init_scope():
            c_in = in_channels
            for i in range(self.depth + 1):
                setattr(self, f"conv_d{i}a_b", L.Convolution2D(c_in, ch[i], 3, initialW=w))
                setattr(self, f"conv_d{i}b_c", L.Convolution2D(ch[i], ch[i], 3, initialW=w))
                c_in = ch[i]
            for i in reversed(range(self.depth)):
                src = f"d{i + 1}c" if i == self.depth - 1 else f"u{i + 1}d"
                setattr(self, f"upconv_{src}_u{i}a",
                        L.Deconvolution2D(ch[i + 1], ch[i], 2, 2, initialW=w))
                setattr(self, f"conv_u{i}b_c", L.Convolution2D(2 * ch[i], ch[i], 3, initialW=w))
                setattr(self, f"conv_u{i}c_d", L.Convolution2D(ch[i], ch[i], 3, initialW=w))
            self.conv_u0d_score = L.Convolution2D(ch[0], n_class, 1, initialW=w)

    def predict(self, x: chainer.Variable) -> chainer.Variable:
        """Return class scores of shape ``(B, n_class, H - 184, W - 184)``."""
        skips = []
        h = x
        for i in range(self.depth + 1):
            if i > 0:
                h = F.max_pooling_2d(h, 2, 2)
            h = F.relu(getattr(self, f"conv_d{i}a_b")(h))
            h = F.relu(getattr(self, f"conv_d{i}b_c")(h))
            if i >= self.depth - 1:
                h = F.dropout(h, self.dropout_ratio)
            skips.append(h)
        for i in reversed(range(self.depth)):
            src = f"d{i + 1}c" if i == self.depth - 1 else f"u{i + 1}d"
            up = F.relu(getattr(self, f"upconv_{src}_u{i}a")(h))
            h = F.concat((_center_crop(skips[i], up.shape[2]), up), axis=1)
            h = F.relu(getattr(self, f"conv_u{i}b_c")(h))
            h = F.relu(getattr(self, f"conv_u{i}c_d")(h))
        return self.conv_u0d_score(h)

    def forward(self, x: chainer.Variable, t: chainer.Variable) -> chainer.Variable:
        """Pixel-wise softmax cross entropy; ``t`` is int32 ``(B, H-184, W-184)``."""
        return F.softmax_cross_entropy(self.predict(x), t)
