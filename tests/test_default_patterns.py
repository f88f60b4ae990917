"""Code that plain Chainer runs runs the same with ``apply()``'s default
options: a backward through the graph of an earlier call of the model
works whatever came between (a later call, ``chainer.grad(...,
enable_double_backprop=True)``, a hand-written differentiable backward,
``@static_graph``), bit for bit, over several optimizer steps.

The runs use :func:`test_real_training.compare` (plain and applied from the
same seeds, every record compared after each backward and update) with no
option but the budget.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer.graph_optimizations.static_graph import static_graph

import test_first_step as first_step
from test_first_step import LazyMLP
from test_real_training import Critic, compare

DEFAULTS = {"budget": "least"}


# ------------------------------------------------------------ WGAN-GP
class TanhCritic(Critic):
    """test_real_training's critic with tanh (whose backward reads its
    retained output)."""

    def __init__(self) -> None:
        super().__init__(n_in=24, w=48, depth=5)

    def forward(self, x):
        h = x
        for lin in self.layers:
            h = F.tanh(lin(h))
        return self.last(h)


def gan_data(steps: int = 5, batch: int = 128, n_in: int = 24):
    rs = np.random.RandomState(7)
    return [(np.tanh(rs.randn(batch, n_in)).astype(np.float32),
             np.tanh(rs.randn(batch, n_in)).astype(np.float32),
             rs.uniform(0, 1, (batch, 1)).astype(np.float32)) for _ in range(steps)]


def test_wgan_gp_penalty_first():
    """The penalty's ``chainer.grad(..., enable_double_backprop=True)``
    first, then the critic on the fake and the real batch, then one
    backward: the penalty's graph reads outputs of the first call after
    two later calls (it crashed in tanh's backward on the first step)."""
    data = gan_data()

    def scenario(env):
        critic = env.apply("critic", TanhCritic(), **DEFAULTS)
        opt = env.optimizer("main", chainer.optimizers.Adam(1e-4, beta1=0.5), critic)
        for i, (x_real, x_fake, eps) in enumerate(data):
            x_hat = chainer.Variable(eps * x_real + (1 - eps) * x_fake)
            gx, = chainer.grad([F.sum(critic(x_hat))], [x_hat], enable_double_backprop=True)
            gp = F.mean((F.sqrt(F.batch_l2_norm_squared(gx) + 1e-12) - 1) ** 2)
            loss = F.mean(critic(x_fake)) - F.mean(critic(x_real)) + 10 * gp
            critic.cleargrads()
            loss.backward()
            env.snap(f"{i} backward", loss=loss)
            opt.update()
            env.snap(f"{i} update")

    compare(scenario, **DEFAULTS).assert_recomputed(at_least=3)


# ------------------------------------ a critic that keeps its activations
class KeepingCritic(chainer.Chain):
    """A critic that keeps its activations in attributes and builds its
    input gradient by a hand-written differentiable backward over them
    (the shape of chainer-gan-lib's WGAN-GP discriminators)."""

    def __init__(self, n_in: int = 24, w: int = 48) -> None:
        super().__init__()
        with self.init_scope():
            self.l0 = L.Linear(n_in, w)
            self.l1 = L.Linear(w, w)
            self.l2 = L.Linear(w, w)
            self.l3 = L.Linear(w, 1)

    def forward(self, x):
        self.x = x
        self.h0 = F.leaky_relu(self.l0(x), 0.2)
        self.h1 = F.leaky_relu(self.l1(self.h0), 0.2)
        self.h2 = F.leaky_relu(self.l2(self.h1), 0.2)
        return self.l3(self.h2)

    @staticmethod
    def _bw_linear(g, lin):
        return F.matmul(g, lin.W)

    @staticmethod
    def _bw_leaky_relu(h, g, a):
        xp = chainer.backend.get_array_module(h.array)
        mask = (h.array > 0).astype(g.dtype) + a * (h.array < 0).astype(g.dtype)
        return g * xp.asarray(mask)

    def differentiable_backward(self, g):
        g = self._bw_linear(g, self.l3)
        g = self._bw_leaky_relu(self.h2, g, 0.2)
        g = self._bw_linear(g, self.l2)
        g = self._bw_leaky_relu(self.h1, g, 0.2)
        g = self._bw_linear(g, self.l1)
        g = self._bw_leaky_relu(self.h0, g, 0.2)
        return self._bw_linear(g, self.l0)


class Gen(chainer.Chain):
    def __init__(self, n_z: int = 8, n_out: int = 24) -> None:
        super().__init__()
        with self.init_scope():
            self.l0 = L.Linear(n_z, 32)
            self.l1 = L.Linear(32, n_out)

    def forward(self, z):
        return F.tanh(self.l1(F.relu(self.l0(z))))


def test_critic_keeping_activations_called_three_times_before_two_backwards():
    """chainer-gan-lib's WGAN-GP updater: the critic on the real batch, on
    the generator's batch (the generator's loss backpropagated and updated
    through it at once), on the mixed batch, then its differentiable
    backward; then the critic's loss backward (through the first two
    calls' graphs again) and the penalty's backward."""
    data = gan_data()
    rs = np.random.RandomState(3)
    zs = [rs.randn(len(d[0]), 8).astype(np.float32) for d in data]

    def scenario(env):
        dis = env.apply("dis", KeepingCritic(), **DEFAULTS)
        gen = env.apply("gen", Gen(), **DEFAULTS)
        opt_d = env.optimizer("dis", chainer.optimizers.Adam(1e-4, beta1=0.5), dis)
        opt_g = env.optimizer("gen", chainer.optimizers.Adam(1e-4, beta1=0.5), gen)
        for i, ((x_real, _, eps), z) in enumerate(zip(data, zs)):
            batch = len(x_real)
            y_real = dis(chainer.Variable(x_real))
            x_fake = gen(chainer.Variable(z))
            y_fake = dis(x_fake)
            loss_gen = F.sum(-y_fake) / batch
            gen.cleargrads()
            loss_gen.backward()
            opt_g.update()
            env.snap(f"{i} gen update", loss=loss_gen)
            x_fake.unchain_backward()
            x_mid = chainer.Variable(eps * x_real + (1.0 - eps) * x_fake.array)
            y_mid = dis(x_mid)
            dydx = dis.differentiable_backward(np.ones_like(y_mid.array))
            dydx = F.sqrt(F.sum(dydx ** 2, axis=1))
            loss_gp = 10 * F.mean_squared_error(dydx, np.ones_like(dydx.array))
            loss_dis = F.sum(-y_real) / batch + F.sum(y_fake) / batch
            dis.cleargrads()
            loss_dis.backward()
            loss_gp.backward()
            env.snap(f"{i} dis backward", loss=loss_dis, gp=loss_gp)
            opt_d.update()
            env.snap(f"{i} dis update")

    # (the critic's activations are its attributes: nothing of it is worth
    # dropping even at the least budget; what is checked is that the calls
    # and backward passes through earlier graphs give plain Chainer's results)
    compare(scenario, **DEFAULTS)


# ------------------------------------------------------- @static_graph
class StaticMLP(LazyMLP):
    """Chainer's static_graph_optimizations MNIST example's network: the
    MNIST example's, its call a static graph."""

    def __init__(self) -> None:
        super().__init__(n_units=64)

    @static_graph
    def __call__(self, x):
        return self.forward(x)


def test_static_graph_classifier_with_adam():
    """``@static_graph`` under ``L.Classifier`` with Adam, a plain update
    loop (the example's own): the same results as plain Chainer."""
    rs = np.random.RandomState(5)
    data = [(rs.randn(32, 40).astype(np.float32), rs.randint(0, 10, 32).astype(np.int32))
            for _ in range(6)]

    def scenario(env):
        model = env.apply("model", L.Classifier(StaticMLP()), **DEFAULTS)
        opt = env.optimizer("main", chainer.optimizers.Adam(), model)
        for i, (x, t) in enumerate(data):
            opt.update(model, x, t)
            env.snap(f"{i} update", loss=model.loss)

    compare(scenario, **DEFAULTS)


def _static_data(batch: int = 64):
    rs = np.random.RandomState(5)
    return [(rs.randn(batch, 40).astype(np.float32), rs.randint(0, 10, batch).astype(np.int32))
            for _ in range(6)]


def _adam(model: chainer.Link) -> chainer.Optimizer:
    opt = chainer.optimizers.Adam()
    opt.setup(model)
    return opt


def test_static_graph_runs_plainly_said_before_its_first_step(caplog):
    """A planned ``@static_graph`` chain crashed inside Chainer's schedule
    builder (a released retained array read as the next function was
    added) and its captures kept schedules of their own: the model runs as
    plain Chainer instead, said once before its first step, with plain
    Chainer's peaks and results, whatever the budget."""
    data = _static_data()
    plain = first_step.train(lambda: L.Classifier(StaticMLP()), _adam, data)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chainer_recompute"):
        run = first_step.train(lambda: L.Classifier(StaticMLP()), _adam, data, "least")
    first_step.assert_same_records(plain, run, "least")
    assert run.peaks == plain.peaks
    assert all(s[0] == "plain" for s in run.stats)
    said = [r.getMessage() for r in caplog.records if "@static_graph" in r.getMessage()]
    assert len(said) == 1 and "/predictor" in said[0] and "use_static_graph" in said[0], said


def test_static_graph_define_by_run_is_planned():
    """With ``chainer.config.use_static_graph = False`` the same chain runs
    define-by-run: planned, every step under ``'least'`` and a byte budget,
    the first included, bit for bit plain Chainer's."""
    with chainer.using_config("use_static_graph", False):
        first_step.check(lambda: L.Classifier(StaticMLP()), _adam, _static_data())


def test_a_captured_static_graph_is_not_recomputed():
    """Recorded as it runs (``capture``, as the CLI does), a ``@static_graph``
    chain's functions are marked as not recomputable, with the reason:
    those run while its schedule is built and the schedule's own node."""
    import chainer_recompute as cr
    x, t = _static_data(batch=8)[0]
    graph = cr.capture(L.Classifier(StaticMLP()), x, t)
    reasons = {n.op: n.attrs.get("unsafe_reason", "") for n in graph.nodes
               if not n.recomputable}
    assert "StaticScheduleFunction" in reasons, [n.op for n in graph.nodes]
    assert all("@static_graph" in r for r in reasons.values()), reasons


# --------------------------------------- truncated backprop inside a call
class TruncatedLM(chainer.Chain):
    """An LSTM language model that truncates its backpropagation inside
    its own forward: ``unchain_backward()`` on the state every ``k``
    steps, so Chainer lets go of the functions before each cut while later
    functions still read their outputs (the dropout after each step)."""

    def __init__(self, k: int = 5) -> None:
        super().__init__()
        self.k = k
        with self.init_scope():
            self.embed = L.EmbedID(50, 32)
            self.lstm = L.LSTM(32, 32)
            self.out = L.Linear(32, 50)

    def forward(self, xs, ts):
        self.lstm.reset_state()
        loss = 0
        for i in range(xs.shape[1]):
            y = self.out(F.dropout(self.lstm(self.embed(xs[:, i])), 0.1))
            loss += F.softmax_cross_entropy(y, ts[:, i])
            if (i + 1) % self.k == 0:
                self.lstm.h.unchain_backward()
                self.lstm.c.unchain_backward()
        return loss


def test_backprop_truncated_inside_the_forward_is_not_recomputed_from_unchained_functions():
    """The plan dropped the outputs of functions the forward had unchained
    (gone before the backward), and regenerating them raised
    ``RecomputeError: cannot regenerate node ... its function node no longer
    exists`` at the first planned step. A recording marks a function whose
    outputs are still read after it was unchained as not recomputable; the
    runs are bit for bit plain Chainer's, every step planned, something
    dropped (the steps after the last cut)."""
    rs = np.random.RandomState(3)
    _adam_steps_planned(TruncatedLM, [(rs.randint(0, 50, (8, 20)).astype(np.int32),
                                       rs.randint(0, 50, (8, 20)).astype(np.int32))
                                      for _ in range(5)])


def _adam_steps_planned(make, data):
    """``make()`` trained with Adam on ``data`` (``(xs, ts)`` batches, the
    model returning its loss), plain and under the defaults: every record
    identical (after each forward, backward and update), every step
    planned with something dropped."""

    def scenario(env):
        model = env.apply("model", make(), **DEFAULTS)
        opt = env.optimizer("main", chainer.optimizers.Adam(), model)
        for i, (xs, ts) in enumerate(data):
            model.cleargrads()
            loss = model(xs, ts)
            env.snap(f"{i} forward", loss=loss)
            loss.backward()
            env.snap(f"{i} backward")
            opt.update()
            env.snap(f"{i} update")

    pair = compare(scenario, **DEFAULTS)
    steps = [s["model"] for label, s in pair.ours.stats if label.endswith("backward")]
    assert len(steps) == len(data) and all(s.dropped for s in steps), pair.stats_report()


# ------------------------------------ an output written in place by the model
class MaskedAttention(chainer.Chain):
    """Causal self-attention whose mask is written into the scores'
    ``.array`` in place (older Chainer code's way), after the function that
    made them."""

    def __init__(self, d: int = 32, depth: int = 3) -> None:
        super().__init__()
        with self.init_scope():
            self.embed = L.EmbedID(50, d)
            self.qkv = chainer.ChainList(*[L.Linear(d, 3 * d) for _ in range(depth)])
            self.ff = chainer.ChainList(*[L.Linear(d, d) for _ in range(depth)])
            self.out = L.Linear(d, 50)

    def forward(self, xs, ts):
        b, t = xs.shape
        h = self.embed(xs)
        future = np.triu(np.ones((t, t), bool), 1)[None]
        for qkv, ff in zip(self.qkv, self.ff):
            q, k, v = F.split_axis(F.reshape(qkv(F.reshape(h, (b * t, -1))), (b, t, -1)), 3,
                                   axis=2)
            scores = F.matmul(q, k, transb=True) / np.sqrt(q.shape[-1])
            scores.array[np.broadcast_to(future, scores.shape)] = -1e9
            h = h + F.matmul(F.softmax(scores, axis=2), v)
            h = h + F.reshape(F.relu(ff(F.reshape(h, (b * t, -1)))), (b, t, -1))
        return F.softmax_cross_entropy(self.out(F.reshape(h, (b * t, -1))), ts.reshape(-1))


class ScalesAfterUse(chainer.Chain):
    """Residual tanh layers whose tanh output, which the next Linear keeps
    for its backward, the model scales in place after that Linear ran."""

    def __init__(self) -> None:
        super().__init__()
        with self.init_scope():
            self.layers = chainer.ChainList(*[L.Linear(32, 32) for _ in range(6)])
            self.out = L.Linear(32, 10)

    def forward(self, x, t):
        h = x
        for layer in self.layers:
            g = F.tanh(h)
            h = layer(g) + h
            g.array *= 0.5
        return F.softmax_cross_entropy(self.out(h), t)


def _tokens(rs):
    return [(rs.randint(0, 50, (8, 12)).astype(np.int32),
             rs.randint(0, 50, (8, 12)).astype(np.int32)) for _ in range(5)]


def _vectors(rs):
    return [(rs.randn(64, 32).astype(np.float32), rs.randint(0, 10, 64).astype(np.int32))
            for _ in range(5)]


@pytest.mark.parametrize("make, batches", [(MaskedAttention, _tokens),
                                           (ScalesAfterUse, _vectors)])
def test_an_output_the_model_writes_in_place_is_not_recomputed(make, batches):
    """The plan dropped the attention scores, which the model masks in
    place after the function that made them: regenerated, they came back
    unmasked, and the gradients differed from plain Chainer's from the
    first step, silently. So did a tanh output the model scaled after the
    Linear that keeps it for its backward had run. A recording compares
    each input right before its function runs, and at the forward's end
    each array kept for a backward, with its producer's output right after
    that ran; the producer of one written since is not recomputable. Bit
    for bit plain Chainer's, every step planned with something dropped."""
    _adam_steps_planned(make, batches(np.random.RandomState(0)))


# ------------------------------------------- a lazy link the forward never calls
class WithUnusedLazyLink(LazyMLP):
    """An MLP of lazy links with one more that its forward never calls
    (chainer-chemistry's GIN has one): that parameter stays uninitialised,
    and reading its ``grad`` raises until ``cleargrads()``, which
    ``Optimizer.update(lossfun)`` calls only after the forward."""

    def __init__(self) -> None:
        super().__init__()
        with self.init_scope():
            self.unused = L.Linear(None, 5)


@pytest.mark.parametrize("capture_batch", ["default", None])
def test_a_lazy_link_never_called_is_no_error(capture_batch):
    """Trained by ``opt.update(model, x, t)`` (the forward before the
    gradients are cleared), its first call captured or recorded: every
    step identical to plain Chainer's. (Recorded, the first call read the
    unused parameter's gradient and raised.)"""
    rs = np.random.RandomState(3)
    data = [(rs.rand(16, 12).astype(np.float32), rs.randint(0, 4, 16).astype(np.int32))
            for _ in range(4)]
    options = {} if capture_batch == "default" else {"capture_batch": capture_batch}

    def scenario(env):
        model = env.apply("model", L.Classifier(WithUnusedLazyLink()), **DEFAULTS, **options)
        opt = env.optimizer("main", chainer.optimizers.Adam(), model)
        for i, (x, t) in enumerate(data):
            opt.update(model, x, t)
            env.snap(f"{i} update")

    pair = compare(scenario, **DEFAULTS)
    assert pair.ours.stats[-1][1]["model"].path == "planned", pair.stats_report()


# ------------------------------------- an input no function made, written in place
class MoCoQueue(chainer.Chain):
    """MoCo's contrastive loss against a queue of keys, a persistent array
    of the model that ``F.matmul`` reads (and retains): the step's keys
    are enqueued in place, in the forward after the loss (``where ==
    'forward'``) or by the loop between the forward and its backward
    (``'loop'``)."""

    def __init__(self, where: str, k: int = 512, d: int = 32) -> None:
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(48, 512)
            self.l2 = L.Linear(512, 512)
            self.l3 = L.Linear(512, d)
        self.where = where
        self.add_persistent("queue", np.random.RandomState(0).randn(k, d).astype(np.float32))
        self.ptr = 0

    def enqueue(self, keys):
        n = len(keys)
        self.queue[self.ptr:self.ptr + n] = keys
        self.ptr = (self.ptr + n) % len(self.queue)

    def forward(self, x, keys):
        q = F.normalize(self.l3(F.relu(self.l2(F.relu(self.l1(x))))))
        logits = F.concat((F.sum(q * keys, axis=1, keepdims=True),
                           F.matmul(q, self.queue, transb=True)), axis=1) / 0.07
        loss = F.softmax_cross_entropy(logits, np.zeros(len(x), np.int32))
        if self.where == "forward":
            self.enqueue(keys)
        return loss


def _moco_batches(steps: int = 4):
    rs = np.random.RandomState(5)
    data = []
    for _ in range(steps):
        keys = rs.randn(512, 32).astype(np.float32)
        data.append((rs.rand(512, 48).astype(np.float32),
                     keys / np.linalg.norm(keys, axis=1, keepdims=True)))
    return data


def test_an_input_written_in_place_after_its_reader_is_not_recomputed():
    """The queue written in the forward after ``F.matmul`` read it: run
    again, the product would read the new keys. The recording (the
    captures) sees the write at the forward's end and keeps the reader.
    Every step identical to plain Chainer's, with something dropped. (The
    first planned step's backward raised UnsafeRecomputeError: the queue
    changed since the forward.)"""
    _adam_steps_planned(lambda: MoCoQueue("forward"), _moco_batches())


def test_an_input_the_loop_writes_before_the_backward_is_seen_by_a_recorded_first_call():
    """The loop enqueues the keys between the forward and its backward: a
    recorded first call (``capture_batch=None``) sees the write at its
    backward's start and keeps the reader. Losses and parameters identical
    to plain Chainer's over four Adam steps. (The second step's backward
    raised UnsafeRecomputeError.)"""
    import chainer_recompute as cr

    def run(applied):
        np.random.seed(0)
        model = MoCoQueue("loop")
        if applied:
            cr.apply(model, budget="least", verbose=False, capture_batch=None)
        opt = chainer.optimizers.Adam()
        opt.setup(model)
        losses = []
        for x, keys in _moco_batches():
            loss = model(x, keys)
            model.enqueue(keys)
            model.cleargrads()
            loss.backward()
            opt.update()
            losses.append(loss.array.tobytes())
        return model, losses

    (ours, ours_losses), (plain, plain_losses) = run(True), run(False)
    assert ours_losses == plain_losses
    for (name, p), q in zip(plain.namedparams(), ours.params()):
        assert p.array.tobytes() == q.array.tobytes(), name
    assert ours.queue.tobytes() == plain.queue.tobytes()
    st = cr.runner_of(ours).last_stats
    assert st.path == "planned" and st.n_dropped > 0, st
