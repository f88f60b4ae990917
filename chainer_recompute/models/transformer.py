"""A Transformer encoder in plain Chainer (multi-head self-attention, layer
normalization, dropout), for the planning-at-scale benchmark and tests
(``experiments/planning_scale.py``).

>>> import numpy
>>> enc = TransformerEncoder(n_layers=2, d=16, heads=2, n_vocab=20)
>>> xs = numpy.zeros((2, 5), numpy.int32)
>>> float(enc(xs, xs).array) > 0
True
"""
from __future__ import annotations

from typing import Any, Tuple

import numpy

import chainer
import chainer.functions as F
import chainer.links as L

__all__ = ["EncoderLayer", "TransformerEncoder", "make_encoder"]


class EncoderLayer(chainer.Chain):
    """One post-norm encoder layer: multi-head self-attention and a
    position-wise feed-forward network, each with dropout, a residual
    connection and layer normalization."""

    def __init__(self, d: int, heads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.d, self.heads, self.dropout = d, heads, dropout
        with self.init_scope():
            self.q = L.Linear(d, d)
            self.k = L.Linear(d, d)
            self.v = L.Linear(d, d)
            self.o = L.Linear(d, d)
            self.ln1 = L.LayerNormalization(d)
            self.ff1 = L.Linear(d, ff)
            self.ff2 = L.Linear(ff, d)
            self.ln2 = L.LayerNormalization(d)

    def forward(self, h: Any, b: int, n: int) -> Any:
        d, H = self.d, self.heads
        hd = d // H

        def split(z: Any) -> Any:
            return F.reshape(F.transpose(F.reshape(z, (b, n, H, hd)), (0, 2, 1, 3)),
                             (b * H, n, hd))

        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        att = F.softmax(F.matmul(q, k, transb=True) * (1.0 / numpy.sqrt(hd)), axis=2)
        att = F.dropout(att, self.dropout)
        ctx = F.reshape(F.transpose(F.reshape(F.matmul(att, v), (b, H, n, hd)), (0, 2, 1, 3)),
                        (b * n, d))
        h = self.ln1(h + F.dropout(self.o(ctx), self.dropout))
        f = self.ff2(F.dropout(F.relu(self.ff1(h)), self.dropout))
        return self.ln2(h + F.dropout(f, self.dropout))


class TransformerEncoder(chainer.Chain):
    """Token embedding plus learned positions, ``n_layers``
    :class:`EncoderLayer` and a token classifier with its loss."""

    def __init__(self, n_layers: int = 6, d: int = 64, heads: int = 4, ff: int = 256,
                 n_vocab: int = 100, max_len: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, d)
            self.pos = chainer.Parameter(
                numpy.random.RandomState(0).normal(0, 0.02, (max_len, d)).astype(numpy.float32))
            self.layers = chainer.ChainList(*[EncoderLayer(d, heads, ff, dropout)
                                              for _ in range(n_layers)])
            self.out = L.Linear(d, n_vocab)

    def forward(self, xs: Any, ts: Any) -> chainer.Variable:
        b, n = xs.shape
        d = self.pos.shape[1]
        h = self.embed(xs) + F.broadcast_to(self.pos[:n], (b, n, d))
        h = F.reshape(h, (b * n, d))
        for layer in self.layers:
            h = layer(h, b, n)
        return F.softmax_cross_entropy(self.out(h), F.reshape(ts, (b * n,)))


def make_encoder(n_layers: int, seed: int = 0, batch: int = 8, length: int = 32,
                 **kw: Any) -> Tuple[TransformerEncoder, Tuple[numpy.ndarray, numpy.ndarray]]:
    """An encoder of ``n_layers`` layers and a seeded batch ``(xs, ts)``."""
    numpy.random.seed(seed)
    model = TransformerEncoder(n_layers=n_layers, max_len=max(length, 64), **kw)
    r = numpy.random.RandomState(seed + 1)
    n_vocab = model.out.W.shape[0]
    xs = r.randint(0, n_vocab, (batch, length)).astype(numpy.int32)
    return model, (xs, numpy.roll(xs, -1, axis=1))
