"""The models and update functions of more of Chainer v7.8.1's examples,
plain against ``chainer_recompute.apply(model, budget='least')``, bit for
bit over several optimizer steps.

The example files are vendored unmodified under tests/chainer_examples/
(see its README.md). Their scripts need datasets or packages that are not
here (Penn Treebank trees, bAbI, WMT, gym), so these tests import the
models (and the examples' own update functions, where they have them) and
train them on seeded random data of the examples' shapes, in a loop of
their own. After every step they compare, between the two runs: the loss,
every parameter and gradient, the optimizer state, persistents, Variables
the links keep, what the test names (a memory network's memories), and
NumPy's and Python's global random states (``harness.diff_records``).

The examples cover: negative sampling (it draws from the global RNG in its
forward), hierarchical softmax, NStepLSTM encoders and a seq2seq model,
a CRF, a memory network that keeps Variables on plain Python objects,
functions that write their inputs in place (the thin-stack recursive net),
lazily initialised 1-D (de)convolutions (WaveNet), reinforcement
learning updates with target networks (DQN, DDPG), pix2pix's updater
under a Trainer (it backpropagates through the decoder again after
unchaining the encoder's outputs; slow), and a feature extractor run
under ``train=False`` and ``no_backprop_mode`` inside the forward (image
captioning, slow).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import importlib.util
import os
import random
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_PATH = os.path.join(HERE, "chainer_examples", "harness.py")
if "chainer_examples_harness" in sys.modules:
    harness = sys.modules["chainer_examples_harness"]
else:
    _spec = importlib.util.spec_from_file_location("chainer_examples_harness", _PATH)
    harness = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = harness
    _spec.loader.exec_module(harness)

import chainer  # noqa: E402
import chainer.links as L  # noqa: E402

import chainer_recompute as cr  # noqa: E402

EXAMPLES = os.path.join(HERE, "chainer_examples")


@contextlib.contextmanager
def _stubs(*names: str):
    """Stub modules for packages an example imports at top level but the
    tested code never uses (nltk, progressbar, gym), where they are absent."""
    added = []
    for n in names:  # parents first: a stub parent makes its children stubs too
        parent, _, child = n.rpartition(".")
        if parent in added or not harness._available(n):
            sys.modules[n] = harness._stub_module(n)
            added.append(n)
            if parent:
                setattr(sys.modules[parent], child, sys.modules[n])
    try:
        yield
    finally:
        for n in added:
            sys.modules.pop(n, None)


def load(folder: str, module: str, siblings: Sequence[str] = (), stubs: Sequence[str] = ()):
    """Import ``folder/module.py`` (its sibling modules under their plain
    names, isolated from other examples')."""
    with harness._isolated_import(os.path.join(EXAMPLES, folder), [module, *siblings]), \
            _stubs(*stubs):
        return importlib.import_module(module)


def records(links: Dict[str, chainer.Link], extra: Optional[Dict[str, Any]] = None
            ) -> Dict[str, Any]:
    rec: Dict[str, Any] = {}
    for name, link in links.items():
        harness._link_records(name, link, rec)
    harness._rng_records(rec)
    for k, v in (extra or {}).items():
        rec[k] = harness._to_numpy(v)
    return rec


def train(make: Callable[[], chainer.Link], batch: Callable[[int], tuple], steps: int,
          applied: bool, loss_of: Optional[Callable[..., Any]] = None,
          after_update: Optional[Callable[[Any], Dict[str, Any]]] = None, **apply_kw: Any):
    """``steps`` Adam steps of ``make()`` on ``batch(i)``: the records after
    each step, and the runner (or None)."""
    np.random.seed(0)
    random.seed(0)
    model = make()
    if applied:
        cr.apply(model, **{"budget": "least", "verbose": False, **apply_kw})
    opt = chainer.optimizers.Adam()
    opt.setup(model)
    out = []
    paths = []
    for i in range(steps):
        args = batch(i)
        model.cleargrads()
        loss = loss_of(model, *args) if loss_of is not None else model(*args)
        loss.backward()
        opt.update()
        extra = {"loss": loss}
        if after_update is not None:
            extra.update(after_update(model))
        out.append(records({"main": model}, extra))
        if applied:
            paths.append(cr.runner_of(model).last_stats.path)
    runner = cr.runner_of(model) if applied else None
    if runner is not None:
        runner.test_paths = paths  # each step's path, for compare()
    return out, runner


def assert_identical(plain: List[Dict[str, Any]], ours: List[Dict[str, Any]]) -> None:
    assert len(plain) == len(ours)
    for step, (a, b) in enumerate(zip(plain, ours), 1):
        diffs = harness.diff_records(a, b)
        assert not diffs, f"step {step}: {diffs[:5]}"


def assert_recomputed(runner: Any) -> None:
    stats = runner.last_stats
    assert stats.path == "planned" and stats.n_dropped > 0, stats
    assert stats.recomputed_nodes > 0, stats


def compare(make, batch, steps=5, expect="recomputed", **kw) -> None:
    """Plain against applied; ``expect``: the applied run's last step
    ``recomputed`` something, was ``planned`` (a graph with nothing worth
    dropping at the least budget), or ``recorded``: every call was recorded
    plainly under a signature of its own (inputs whose shapes change on
    every call, in no pattern a plan can be scaled along)."""
    plain, _ = train(make, batch, steps, False, **kw)
    ours, runner = train(make, batch, steps, True, **kw)
    assert_identical(plain, ours)
    if expect == "recomputed":
        assert_recomputed(runner)
    elif expect == "planned":
        assert runner.last_stats.path == "planned", runner.last_stats
    else:
        assert expect == "recorded", expect
        assert runner.test_paths == ["recorded"] * steps, runner.test_paths
        assert len(runner.signatures()) == min(steps, runner.spec.max_plans)


def reported(model, *args, **kwargs):
    """``model(...)`` with a reporter that knows it (the examples' models
    call ``chainer.report(..., self)``, as under a Trainer)."""
    reporter = chainer.Reporter()
    reporter.add_observer("main", model)
    with reporter.scope({}):
        return model(*args, **kwargs)


def cached(fn: Callable[[np.random.RandomState], tuple], seed: int) -> Callable[[int], tuple]:
    """Batches from their own RandomState, the same in both runs."""
    rs = np.random.RandomState(seed)
    memo: Dict[int, tuple] = {}

    def batch(i: int) -> tuple:
        if i not in memo:
            memo[i] = fn(rs)
        return memo[i]
    return batch


# ------------------------------------------------------------- word2vec
@pytest.mark.parametrize("arch", ["skipgram", "cbow"])
@pytest.mark.parametrize("out", ["ns", "hsm", "original"])
def test_word2vec(arch, out):
    """examples/word2vec: SkipGram / ContinuousBoW with negative sampling
    (it samples from the global RNG in its forward), hierarchical softmax
    or a softmax, built as the script builds them."""
    tw = load("word2vec", "train_word2vec")
    n_vocab, unit, window = 300, 16, 3
    words = np.random.RandomState(1).randint(0, n_vocab, 2000).astype(np.int32)
    words[:n_vocab] = np.arange(n_vocab)
    counts = collections.Counter(words.tolist())

    def make():
        if out == "hsm":
            hsm = L.BinaryHierarchicalSoftmax
            loss_func = hsm(unit, hsm.create_huffman_tree(counts))
            loss_func.W.array[...] = 0
        elif out == "ns":
            loss_func = L.NegativeSampling(unit, [counts[w] for w in range(len(counts))], 5)
            loss_func.W.array[...] = 0
        else:
            loss_func = tw.SoftmaxCrossEntropyLoss(unit, n_vocab)
        model = tw.SkipGram if arch == "skipgram" else tw.ContinuousBoW
        return model(n_vocab, unit, loss_func)

    def batch(rs):
        pos = rs.randint(window, len(words) - window, size=20)
        offsets = list(range(-window, 0)) + list(range(1, window + 1))
        return words[pos], np.stack([words[pos + o] for o in offsets], 1)

    # CBOW's graph is a few functions: at its least budget little or nothing is dropped
    compare(make, cached(batch, 2), loss_of=reported, budget_scope="activations",
            expect="recomputed" if arch == "skipgram" else "planned")


# --------------------------------------------------- text classification
@pytest.mark.parametrize("encoder", ["rnn", "cnn", "bowmlp"])
@pytest.mark.parametrize("lengths", ["fixed", "variable"])
def test_text_classification(encoder, lengths):
    """examples/text_classification: TextClassifier over its NStepLSTM,
    CNN and BOW-MLP encoders (dropout 0.2). Sentences of one length plan;
    sentences of varying lengths change the graph on every call and run as
    plain Chainer would."""
    nets = load("text_classification", "nets")
    n_vocab = 200
    make_encoder = {"rnn": nets.RNNEncoder, "cnn": nets.CNNEncoder,
                    "bowmlp": nets.BOWMLPEncoder}[encoder]

    def batch(rs):
        lens = [7] * 6 if lengths == "fixed" else rs.randint(2, 12, size=6)
        xs = [rs.randint(2, n_vocab, size=n).astype(np.int32) for n in lens]
        ys = [np.array([c], np.int32) for c in rs.randint(0, 4, size=6)]
        return xs, ys

    compare(lambda: nets.TextClassifier(make_encoder(2, n_vocab, 16, 0.2), 4), cached(batch, 3),
            steps=6, expect="recomputed" if lengths == "fixed" else "recorded",
            budget_scope="activations")


# ------------------------------------------------------------- seq2seq
def seq2seq_case() -> tuple:
    """The example's Seq2seq (2 layers, vocabularies of 200, 16 units) and
    its seeded batches (five sentence pairs, the same in every run):
    ``(make, batch)`` for :func:`train`."""
    s2s = load("seq2seq", "seq2seq", stubs=("nltk", "nltk.translate", "nltk.translate.bleu_score", "progressbar"))
    n_vocab = 200

    def batch(rs):
        return ([rs.randint(2, n_vocab, size=6).astype(np.int32) for _ in range(5)],
                [rs.randint(2, n_vocab, size=5).astype(np.int32) for _ in range(5)])

    return lambda: s2s.Seq2seq(2, n_vocab, n_vocab, 16), cached(batch, 4)


def test_seq2seq():
    """examples/seq2seq: two NStepLSTMs with the decoder started from the
    encoder's final states, softmax cross entropy summed over the words."""
    make, batch = seq2seq_case()
    compare(make, batch, steps=6, loss_of=reported, budget_scope="activations")


# --------------------------------------------------------------- memnn
@pytest.mark.parametrize("encoding", ["bow", "pe"])
def test_memory_network(encoding):
    """examples/memnn: the memories keep the embedded sentences as
    Variables on plain Python objects (``Memory.m``, ``Memory.c``); the
    script's extension zeroes the ignore label's embeddings after every
    update. The memories are compared too."""
    memnn = load("memnn", "memnn", siblings=("babi",))
    n_vocab, n_mem, n_words = 50, 10, 6

    def make():
        return L.Classifier(memnn.MemNN(16, n_vocab, memnn.make_encoder(encoding), n_mem, 3),
                            label_key="answer")

    def batch(rs):
        return ({"sentences": rs.randint(0, n_vocab, (8, n_mem, n_words)).astype(np.int32),
                 "question": rs.randint(0, n_vocab, (8, n_words)).astype(np.int32),
                 "answer": rs.randint(0, n_vocab, (8,)).astype(np.int32)},)

    def after_update(model):
        model.predictor.fix_ignore_label()
        return {f"memory{k}/{name}": getattr(m, name)
                for k, m in enumerate(model.predictor.memories) for name in ("m", "c")}

    compare(make, cached(batch, 5), loss_of=lambda model, kw: reported(model, **kw),
            after_update=after_update, budget_scope="activations")


# ----------------------------------------------------------------- pos
def test_pos_tagging_crf():
    """examples/pos: an embedding and a linear-chain CRF (CRF1d) over
    sentences sorted by length, with its Viterbi decoding in the forward."""
    pos = load("pos", "postagging", stubs=("nltk",))
    n_vocab, n_pos = 50, 7

    def batch(rs):
        lens = [6, 6, 5, 4, 4]
        return ([rs.randint(0, n_vocab, size=n).astype(np.int32) for n in lens],
                [rs.randint(0, n_pos, size=n).astype(np.int32) for n in lens])

    compare(lambda: pos.CRF(n_vocab, n_pos), cached(batch, 6), loss_of=reported,
            budget_scope="activations")


# ----------------------------------------------------------- sentiment
def _tree(rs, n_leaves):
    if n_leaves == 1:
        return (str(rs.randint(5)), f"w{rs.randint(40)}")
    k = rs.randint(1, n_leaves)
    return (str(rs.randint(5)), _tree(rs, k), _tree(rs, n_leaves - k))


def test_thin_stack_recursive_net():
    """examples/sentiment, the mini-batch recursive net: its thin-stack
    functions write the stack in place, so they are kept, never recomputed
    (and a warning says so); the same four trees in every batch."""
    trm = load("sentiment", "train_recursive_minibatch", siblings=("data", "thin_stack"))
    vocab = {f"w{i}": i for i in range(40)}
    trs = np.random.RandomState(12)
    trees = [trm.linearize_tree(vocab, _tree(trs, n)) for n in (5, 7, 4, 6)]
    inputs = trm.convert(trees, chainer.get_device("@numpy"))
    compare(lambda: trm.ThinStackRecursiveNet(40, 16, 5), lambda i: inputs, loss_of=reported,
            budget_scope="activations")


# ------------------------------------------------------------- wavenet
def test_wavenet():
    """examples/wavenet: Classifier(EncoderDecoderModel) with the upsampling
    net's lazily initialised Deconvolution1D/Convolution1D layers and the
    dilated residual blocks (small widths: 2 loops of 3 layers)."""
    net = load("wavenet", "net", siblings=("modules",))
    a_channels, length = 32, 256

    def make():
        return L.Classifier(net.EncoderDecoderModel(
            net.UpsampleNet(2 * 3, 8), net.WaveNet(2, 3, a_channels, 8, 16, True)))

    def batch(rs):
        audio = rs.randint(0, a_channels, size=(2, length))
        onehot = np.eye(a_channels, dtype=np.float32)[audio].transpose(0, 2, 1)
        cond = rs.randn(2, 20, length // 256).astype(np.float32)
        return onehot, cond, rs.randint(0, a_channels, size=(2, length)).astype(np.int32)

    compare(make, cached(batch, 9), steps=4, budget_scope="activations")


# --------------------------------------------------------- reinforcement
def _transitions(rs, n, obs, act, discrete):
    out = []
    for _ in range(n):
        a = rs.randint(act) if discrete else rs.uniform(-2, 2, size=act).astype(np.float32)
        out.append((rs.randn(obs).astype(np.float32), a, rs.randn(), float(rs.rand() < 0.1),
                    rs.randn(obs).astype(np.float32)))
    return out


def _rl_run(applied: bool, algo: str, steps: int = 6):
    """The examples' own update(): DQN's (double DQN, a target network
    copied every 3 steps) or DDPG's (critic then actor, soft target
    updates), on random transitions."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = load("reinforcement_learning",
                   "dqn_cartpole" if algo == "dqn" else "ddpg_pendulum", stubs=("gym",))
    np.random.seed(0)
    random.seed(0)
    rs = np.random.RandomState(3)
    options = dict(budget="least", budget_scope="activations", verbose=False)
    out = []
    if algo == "dqn":
        q = mod.QFunction(4, 2)
        if applied:
            cr.apply(q, **options)
        target = copy.deepcopy(q)
        opt = chainer.optimizers.Adam(eps=1e-2)
        opt.setup(q)
        for i in range(steps):
            mod.update(q, target, opt, _transitions(rs, 64, 4, 2, True))
            if i % 3 == 2:
                target = copy.deepcopy(q)
            out.append(records({"q": q, "target": target}))
        return out, [cr.runner_of(q)] if applied else []
    q = mod.QFunction(3, 1)
    policy = mod.Policy(3, 1, np.array([-2.0], "f"), np.array([2.0], "f"))
    if applied:
        cr.apply(q, **options)
        cr.apply(policy, **options)
    opt_q, opt_p = chainer.optimizers.Adam(), chainer.optimizers.Adam(alpha=1e-4)
    opt_q.setup(q)
    opt_p.setup(policy)
    target_q, target_p = copy.deepcopy(q), copy.deepcopy(policy)
    for i in range(steps):
        mod.update(q, target_q, policy, target_p, opt_q, opt_p, _transitions(rs, 64, 3, 1, False))
        mod.soft_copy_params(q, target_q, 1e-2)
        mod.soft_copy_params(policy, target_p, 1e-2)
        out.append(records({"q": q, "policy": policy, "target_q": target_q,
                            "target_policy": target_p}))
    return out, [cr.runner_of(q), cr.runner_of(policy)] if applied else []


@pytest.mark.parametrize("algo", ["dqn", "ddpg"])
def test_reinforcement_learning_updates(algo):
    plain, _ = _rl_run(False, algo)
    ours, runners = _rl_run(True, algo)
    assert_identical(plain, ours)
    for runner in runners:
        assert runner.last_stats.path == "planned" and runner.last_stats.n_dropped > 0, \
            runner.last_stats


# ------------------------------------------------------------- pix2pix
def _pix2pix_records(select, workdir, steps=3, scope="total"):
    """pix2pix's networks and ``FacadeUpdater`` at the script's sizes
    (batch 1, 256 x 256, 12 input channels) for ``steps`` iterations on
    seeded random data, with ``apply(budget='least', budget_scope=scope)``
    on the links named in ``select``: the records of :func:`harness.snapshot_state` after each
    iteration (under a Trainer, as the script runs it), and the runners."""
    net = load("pix2pix", "net")
    updater = load("pix2pix", "updater")
    np.random.seed(0)
    random.seed(0)
    links = {"enc": net.Encoder(in_ch=12), "dec": net.Decoder(out_ch=3),
             "dis": net.Discriminator(in_ch=12, out_ch=3)}
    runners = []
    for name in select:
        cr.apply(links[name], budget="least", budget_scope=scope, verbose=False)
        runners.append(cr.runner_of(links[name]))
    optimizers = {}
    for name, link in links.items():  # the script's make_optimizer
        opt = chainer.optimizers.Adam(alpha=0.0002, beta1=0.5)
        opt.setup(link)
        opt.add_hook(chainer.optimizer.WeightDecay(0.00001), "hook_dec")
        optimizers[name] = opt
    rs = np.random.RandomState(7)
    data = [(rs.rand(12, 256, 256).astype("f"), rs.rand(3, 256, 256).astype("f"))
            for _ in range(steps)]
    up = updater.FacadeUpdater(models=(links["enc"], links["dec"], links["dis"]),
                               iterator=chainer.iterators.SerialIterator(data, 1),
                               optimizer=optimizers, device=-1)
    trainer = chainer.training.Trainer(up, (steps, "iteration"), out=workdir)
    out = []

    @chainer.training.make_extension(trigger=(1, "iteration"), priority=-10 ** 9)
    def record(trainer):
        out.append(harness.snapshot_state(trainer, trainer.observation))

    trainer.extend(record)
    trainer.run()
    return out, runners


@pytest.mark.slow
@pytest.mark.parametrize("select, scope", [(("enc",), "activations"),
                                           (("enc", "dec", "dis"), "total")])
def test_pix2pix_updater_bit_identical(select, scope, tmp_path):
    """examples/pix2pix: its updater backpropagates through the decoder a
    second time after unchaining the encoder's outputs, which the decoder
    reads again (it crashed with the encoder applied): every iteration
    identical to plain Chainer, and each applied link recomputed but the
    encoder in the total scope: its least plan drops nothing there (what it
    could drop it returns to the decoder, and its step's peak, at its
    first convolutions' backward with the optimizer's state counted, holds
    nothing a plan could drop), so that it follows its plan, recomputing
    nothing, and holds its budget."""
    plain, _ = _pix2pix_records((), str(tmp_path / "plain"))
    ours, runners = _pix2pix_records(select, str(tmp_path / "applied"), scope=scope)
    assert len(plain) == 3
    assert_identical(plain, ours)
    for name, runner in zip(select, runners):
        if name == "enc" and scope == "total":
            stats = runner.last_stats
            assert stats.path == "planned" and stats.n_dropped == 0, stats
            assert stats.measured_peak_bytes <= stats.budget_bytes, stats
        else:
            assert_recomputed(runner)


# ---------------------------------------------------- image captioning
@pytest.mark.slow
@pytest.mark.parametrize("rnn", ["lstm", "nsteplstm"])
def test_image_captioning(rnn, monkeypatch):
    """examples/image_captioning: VGG16 features taken inside the forward
    under ``train=False`` and ``no_backprop_mode`` (its weights random here:
    the pretrained ones are a download), then an LSTM (a step per word) or
    NStepLSTM language model with dropout; 224 x 224 images, batch 2."""
    init = L.VGG16Layers.__init__
    monkeypatch.setattr(L.VGG16Layers, "__init__",
                        lambda self, pretrained_model=None, **kw: init(self, None, **kw))
    model = load("image_captioning", "model")
    n_vocab = 60

    def batch(rs):
        images = rs.rand(2, 3, 224, 224).astype(np.float32)
        captions = [rs.randint(0, n_vocab, size=7).astype(np.int32) for _ in range(2)]
        return images, (np.stack(captions) if rnn == "lstm" else captions)

    compare(lambda: model.ImageCaptionModel(n_vocab, 32, rnn=rnn, dropout_ratio=0.3),
            cached(batch, 3), steps=4, loss_of=reported, budget_scope="activations")
