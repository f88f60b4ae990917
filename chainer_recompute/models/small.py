"""Small models of kinds the paper's networks do not cover, for the memory
model's benchmark and tests: recurrent nets, attention, a VAE, a
deconvolution generator, a net made mostly of views, a conv net with
concatenation.

``SMALL_MODELS[name](seed)`` returns ``(link, args)``: ``link(*args)`` is the
training loss; the same seed gives the same parameters and inputs.

>>> link, args = SMALL_MODELS['views'](0)
>>> float(link(*args).array) > 0
True
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import numpy

from ..runtime import _chainer  # noqa: F401  (NumPy compatibility before chainer)
import chainer
import chainer.functions as F
import chainer.links as L

__all__ = ["SMALL_MODELS"]


def _rng(seed: int) -> numpy.random.RandomState:
    numpy.random.seed(seed)  # Chainer's initializers draw from the global generator
    return numpy.random.RandomState(seed + 1)


class LSTMLanguageModel(chainer.Chain):
    """Two ``L.LSTM`` layers unrolled over the sequence, dropout between."""

    def __init__(self, n_vocab: int = 1000, n_units: int = 128) -> None:
        super().__init__()
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, n_units)
            self.l1 = L.LSTM(n_units, n_units)
            self.l2 = L.LSTM(n_units, n_units)
            self.out = L.Linear(n_units, n_vocab)

    def forward(self, xs: Any, ts: Any) -> chainer.Variable:
        self.l1.reset_state()
        self.l2.reset_state()
        loss = 0
        for k in range(xs.shape[1]):
            h = self.embed(xs[:, k])
            h = self.l1(F.dropout(h, 0.2))
            h = self.l2(F.dropout(h, 0.2))
            loss += F.softmax_cross_entropy(self.out(F.dropout(h, 0.2)), ts[:, k])
        return loss / xs.shape[1]


class GRULanguageModel(chainer.Chain):
    """A stateless GRU unrolled over the sequence."""

    def __init__(self, n_vocab: int = 500, n_units: int = 128) -> None:
        super().__init__()
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, n_units)
            self.gru = L.StatelessGRU(n_units, n_units)
            self.out = L.Linear(n_units, n_vocab)

    def forward(self, xs: Any, ts: Any) -> chainer.Variable:
        h = None
        loss = 0
        for k in range(xs.shape[1]):
            x = self.embed(xs[:, k])
            h = self.gru(x, x * 0) if h is None else self.gru(h, x)
            loss += F.softmax_cross_entropy(self.out(h), ts[:, k])
        return loss / xs.shape[1]


class NStepTagger(chainer.Chain):
    """``L.NStepLSTM`` over a batch of sequences of different lengths."""

    def __init__(self, n_in: int = 64, n_units: int = 128, n_tags: int = 20) -> None:
        super().__init__()
        with self.init_scope():
            self.lstm = L.NStepLSTM(2, n_in, n_units, 0.1)
            self.out = L.Linear(n_units, n_tags)

    def forward(self, xs: Any, ts: Any) -> chainer.Variable:
        _, _, ys = self.lstm(None, None, list(xs))
        return F.softmax_cross_entropy(self.out(F.concat(ys, axis=0)), ts)


class TransformerBlock(chainer.Chain):
    """One pre-norm transformer encoder block with a token classifier."""

    def __init__(self, d: int = 128, heads: int = 4, n_class: int = 50) -> None:
        super().__init__()
        self.d, self.heads = d, heads
        with self.init_scope():
            self.ln1 = L.LayerNormalization(d)
            self.qkv = L.Linear(d, 3 * d)
            self.proj = L.Linear(d, d)
            self.ln2 = L.LayerNormalization(d)
            self.ff1 = L.Linear(d, 4 * d)
            self.ff2 = L.Linear(4 * d, d)
            self.cls = L.Linear(d, n_class)

    def forward(self, x: Any, t: Any) -> chainer.Variable:
        b, n, d = x.shape
        hd = d // self.heads
        h = self.ln1(F.reshape(x, (b * n, d)))
        q, k, v = F.split_axis(self.qkv(h), 3, axis=1)

        def heads(z: Any) -> Any:
            return F.reshape(F.transpose(F.reshape(z, (b, n, self.heads, hd)), (0, 2, 1, 3)),
                             (b * self.heads, n, hd))

        att = F.softmax(F.matmul(heads(q), heads(k), transb=True) / numpy.sqrt(hd), axis=2)
        o = F.reshape(F.transpose(F.reshape(F.matmul(att, heads(v)), (b, self.heads, n, hd)),
                                  (0, 2, 1, 3)), (b * n, d))
        h = F.reshape(x, (b * n, d)) + self.proj(o)
        h = h + self.ff2(F.relu(self.ff1(self.ln2(h))))
        return F.softmax_cross_entropy(self.cls(h), F.reshape(t, (b * n,)))


class VAE(chainer.Chain):
    """A fully connected VAE: Bernoulli likelihood, Gaussian posterior."""

    def __init__(self, n_in: int = 784, n_h: int = 256, n_z: int = 32) -> None:
        super().__init__()
        with self.init_scope():
            self.e1 = L.Linear(n_in, n_h)
            self.e_mu = L.Linear(n_h, n_z)
            self.e_ln = L.Linear(n_h, n_z)
            self.d1 = L.Linear(n_z, n_h)
            self.d2 = L.Linear(n_h, n_in)

    def forward(self, x: Any) -> chainer.Variable:
        h = F.tanh(self.e1(x))
        mu, ln_var = self.e_mu(h), self.e_ln(h)
        z = F.gaussian(mu, ln_var)
        rec = F.bernoulli_nll(x, self.d2(F.tanh(self.d1(z)))) / len(x)
        return rec + F.gaussian_kl_divergence(mu, ln_var) / len(x)


class DeconvGenerator(chainer.Chain):
    """A DCGAN-like generator (deconvolutions with BatchNorm) fitted to
    target images."""

    def __init__(self, n_z: int = 100, ch: int = 128) -> None:
        super().__init__()
        self.ch = ch
        with self.init_scope():
            self.l0 = L.Linear(n_z, 4 * 4 * ch)
            self.bn0 = L.BatchNormalization(4 * 4 * ch)
            self.dc1 = L.Deconvolution2D(ch, ch // 2, 4, 2, 1)
            self.bn1 = L.BatchNormalization(ch // 2)
            self.dc2 = L.Deconvolution2D(ch // 2, ch // 4, 4, 2, 1)
            self.bn2 = L.BatchNormalization(ch // 4)
            self.dc3 = L.Deconvolution2D(ch // 4, 3, 4, 2, 1)

    def forward(self, z: Any, target: Any) -> chainer.Variable:
        h = F.reshape(F.relu(self.bn0(self.l0(z))), (len(z), self.ch, 4, 4))
        h = F.relu(self.bn1(self.dc1(h)))
        h = F.relu(self.bn2(self.dc2(h)))
        return F.mean_squared_error(F.tanh(self.dc3(h)), target)


class ViewNet(chainer.Chain):
    """Mostly views: split_axis, transpose, reshape, where, concat."""

    def __init__(self, w: int = 256) -> None:
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(w, 4 * w)
            self.l2 = L.Linear(w, w)
            self.out = L.Linear(4 * w, 10)

    def forward(self, x: Any, t: Any) -> chainer.Variable:
        a, b, c, d = F.split_axis(self.l1(x), 4, axis=1)
        side = int(numpy.sqrt(d.shape[1]))
        d = F.reshape(F.transpose(F.reshape(d, (-1, side, side)), (0, 2, 1)), (-1, side * side))
        h = F.concat([F.tanh(self.l2(a)), F.where(b.array > 0, b, c), d, c], axis=1)
        return F.softmax_cross_entropy(self.out(h), t)


class ConvNet(chainer.Chain):
    """Convolutions with BatchNorm, a concatenation and pooling."""

    def __init__(self) -> None:
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 32, 3, pad=1)
            self.b1 = L.BatchNormalization(32)
            self.c2 = L.Convolution2D(32, 32, 3, pad=1)
            self.b2 = L.BatchNormalization(32)
            self.c3 = L.Convolution2D(64, 64, 3, pad=1)
            self.b3 = L.BatchNormalization(64)
            self.fc = L.Linear(64 * 16 * 16, 10)

    def forward(self, x: Any, t: Any) -> chainer.Variable:
        h1 = F.relu(self.b1(self.c1(x)))
        h2 = F.relu(self.b2(self.c2(h1)))
        h = F.max_pooling_2d(F.concat([h1, h2]), 2)
        h = F.relu(self.b3(self.c3(h)))
        return F.softmax_cross_entropy(self.fc(h), t)


def _lstm(seed: int) -> Tuple[chainer.Link, tuple]:
    r = _rng(seed)
    link = LSTMLanguageModel()
    xs = r.randint(0, 1000, (16, 40)).astype(numpy.int32)
    return link, (xs, numpy.roll(xs, -1, axis=1))


def _gru(seed: int) -> Tuple[chainer.Link, tuple]:
    r = _rng(seed)
    link = GRULanguageModel()
    xs = r.randint(0, 500, (16, 30)).astype(numpy.int32)
    return link, (xs, numpy.roll(xs, -1, axis=1))


def _nstep(seed: int) -> Tuple[chainer.Link, tuple]:
    r = _rng(seed)
    link = NStepTagger()
    lengths = [24, 20, 17, 15, 12, 9, 7, 4]
    xs = tuple(r.randn(n, 64).astype(numpy.float32) for n in lengths)
    ts = r.randint(0, 20, sum(lengths)).astype(numpy.int32)
    return link, (xs, ts)


def _transformer(seed: int) -> Tuple[chainer.Link, tuple]:
    r = _rng(seed)
    link = TransformerBlock()
    return link, (r.randn(8, 64, 128).astype(numpy.float32),
                  r.randint(0, 50, (8, 64)).astype(numpy.int32))


def _vae(seed: int) -> Tuple[chainer.Link, tuple]:
    r = _rng(seed)
    link = VAE()
    return link, ((r.rand(64, 784) > 0.5).astype(numpy.float32),)


def _generator(seed: int) -> Tuple[chainer.Link, tuple]:
    r = _rng(seed)
    link = DeconvGenerator()
    return link, (r.randn(16, 100).astype(numpy.float32),
                  numpy.tanh(r.randn(16, 3, 32, 32)).astype(numpy.float32))


def _views(seed: int) -> Tuple[chainer.Link, tuple]:
    r = _rng(seed)
    link = ViewNet()
    return link, (r.randn(256, 256).astype(numpy.float32),
                  r.randint(0, 10, 256).astype(numpy.int32))


def _convnet(seed: int) -> Tuple[chainer.Link, tuple]:
    r = _rng(seed)
    link = ConvNet()
    return link, (r.randn(16, 3, 32, 32).astype(numpy.float32),
                  r.randint(0, 10, 16).astype(numpy.int32))


#: name -> builder(seed) -> (link, args).
SMALL_MODELS: Dict[str, Callable[[int], Tuple[chainer.Link, tuple]]] = {
    "lstm_lm": _lstm,
    "gru_lm": _gru,
    "nstep_lstm": _nstep,
    "transformer": _transformer,
    "vae": _vae,
    "deconv_generator": _generator,
    "views": _views,
    "convnet": _convnet,
}
