"""The device layer's CuPy side, run on the host through a test double of
CuPy (tests/fake_cupy.py): the runner's planned calls, the executor's
checksums, the recorder's meters and syncs, BPTT's random states, and the
benchmark's seeding."""
from __future__ import annotations

import copy

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import chainer_recompute as cr
from chainer_recompute import bench
from chainer_recompute.runtime import device as devmod
from chainer_recompute.runtime.bptt import ChainRecompute
from chainer_recompute.runtime.capture import state_bytes
from chainer_recompute.runtime.device import (CPU, CupyDevice, RandomStates, device_of,
                                              recording_random, seed_all)
from chainer_recompute.runtime.memory import SCOPE_CUPY
from chainer_recompute.runtime.runner import runner_of

from fake_cupy import FakeCupy


class Net(chainer.Chain):
    def __init__(self, width=64):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(32, width)
            self.b1 = L.BatchNormalization(width)
            self.l2 = L.Linear(width, width)
            self.l3 = L.Linear(width, width)
            self.out = L.Linear(width, 10)

    def forward(self, x, t):
        h = F.relu(self.b1(self.l1(x)))
        h = F.dropout(F.relu(self.l2(h)), 0.3)
        h = F.tanh(self.l3(h)) + h
        return F.softmax_cross_entropy(self.out(h), t)


def _inputs(n=64, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, 32).astype(np.float32), rng.randint(0, 10, n).astype(np.int32)


def test_gpu_meter_has_a_scope():
    # the step meter read meter.scope, which a GPU meter never set
    meter = CupyDevice(FakeCupy()).meter()
    assert meter.scope == SCOPE_CUPY
    meter.start()
    assert meter.stop().scope == SCOPE_CUPY


def test_device_of_and_allocation_bytes():
    fake = FakeCupy()
    assert device_of([np.zeros(3)]) is CPU
    with fake.active():
        dev = device_of([chainer.Variable(np.zeros(3))])
        assert dev.is_gpu and dev.xp is fake
        assert dev.allocation_bytes(1) == 512 and dev.allocation_bytes(0) == 0
        # the pool's rounding in the state the budget counts
        assert state_bytes(L.Linear(3, 2))["params"] == 2 * 512
    assert state_bytes(L.Linear(3, 2))["params"] == 32


@pytest.mark.parametrize("size", [11, 101])  # (on CPU: its bytes themselves; the checksum)
def test_checksum_one_transfer_and_exact_equality(size):
    fake = FakeCupy()
    dev = CupyDevice(fake)
    x = np.arange(size, dtype=np.float32)
    assert (x.nbytes <= CPU.SMALL_BYTES) == (size == 11)
    y = x.copy()
    y[3] += 1
    assert dev.checksum(x) == dev.checksum(x.copy())
    assert CPU.checksum(x) == CPU.checksum(x.copy())
    # one changed element, a NaN, moved elements (a swap of two words that
    # the old per-stride sums could not see: positions 0 and 6)
    z = x.copy()
    z[[0, 6]] = z[[6, 0]]
    n = x.copy()
    n[5] = np.nan
    w = np.random.RandomState(0).rand(8, 12).astype(np.float32)
    w2 = w.copy()
    w2[[0, 6]] = w2[[6, 0]]
    for d in (dev, CPU):
        assert d.checksum(x) != d.checksum(y)
        assert d.checksum(x) != d.checksum(z)
        assert d.checksum(x) != d.checksum(n)
        assert d.checksum(w) != d.checksum(w2)
        assert d.checksum(n) == d.checksum(n.copy())
    assert dev.same(x, x.copy()) and not dev.same(x, y)
    dev.synchronize()
    assert fake.syncs == 1


def _train(model, x, t, steps, fake=None):
    opt = chainer.optimizers.MomentumSGD(lr=0.05)
    opt.setup(model)
    losses = []
    for k in range(steps):
        np.random.seed(k)
        model.cleargrads()
        loss = model(x, t)
        loss.backward()
        opt.update()
        losses.append(loss.array.copy())
    return losses


def test_planned_calls_on_the_cupy_side_identical_and_measured():
    """The path that raised AttributeError: apply(), then planned calls
    measured by the pool, with checksums and syncs on the device."""
    fake = FakeCupy()
    x, t = _inputs()
    with fake.active():
        np.random.seed(1)
        plain = Net()
        plain(x, t)
        ours = copy.deepcopy(plain)
        cr.apply(ours, budget="least", tuning=cr.Tuning(verify=True), verbose=False)
        l_plain = _train(plain, x, t, 5)
        syncs = fake.syncs
        l_ours = _train(ours, x, t, 5)
        assert fake.syncs > syncs  # the recorder timed its calls with device syncs
        stats = runner_of(ours).last_stats
    assert stats.path == "planned" and stats.n_dropped > 0
    assert stats.measured_peak_bytes is not None
    assert stats.measured_pool_total_bytes >= stats.measured_peak_bytes
    assert all(np.array_equal(a, b) for a, b in zip(l_plain, l_ours))
    for (n, p), (_, q) in zip(sorted(plain.namedparams()), sorted(ours.namedparams())):
        assert np.array_equal(p.array, q.array), n
        assert np.array_equal(p.grad, q.grad), n
    assert np.array_equal(plain.b1.avg_mean, ours.b1.avg_mean)


def test_other_arrays_on_the_card_are_not_counted():
    """The budget counts this model's iteration: another model's arrays, or
    the pool's blocks held for something else, are outside it."""
    x, t = _inputs()
    measured = []
    for other in (0, 32 * 2 ** 20):
        fake = FakeCupy()
        with fake.active():
            pool = fake.get_default_memory_pool()
            np.random.seed(1)
            model = Net()
            model(x, t)
            cr.apply(model, budget="least", verbose=False)
            held = pool.malloc(other) if other else None  # e.g. a GAN's other network
            kept = np.ones(other // 4, np.float32) if other else None  # data kept on the card
            _train(model, x, t, 3)
            stats = runner_of(model).last_stats
            measured.append(stats.measured_peak_bytes)
            assert stats.measured_peak_bytes <= stats.budget_bytes
            del held, kept
    # the same to a few pool units: the double's pool counts Chainer's NumPy
    # arrays unrounded while the runner counts what it finds held at the call
    # (the previous graph's small arrays) rounded to 512 bytes, and whether a
    # graph in a reference cycle is still there depends on the cyclic GC
    assert abs(measured[0] - measured[1]) <= 8 * 512, measured


def test_the_loops_work_before_the_backward_is_measured_by_the_pool():
    """A DQN-style loop on the CuPy side: a wider target network's forward
    (no_backprop_mode) and the TD loss between the model's forward and its
    backward are measured by the pool in the recorded step, so that the
    first planned step is under its budget. Before, it measured 772,096 B
    against 447,871 B and was corrected."""
    from test_real_code_patterns import QNet, td_step
    rng = np.random.RandomState(5)
    batches = [(rng.rand(64, 32).astype(np.float32), rng.rand(64, 32).astype(np.float32),
                rng.randint(0, 6, 64).astype(np.int32), rng.rand(64).astype(np.float32))
               for _ in range(4)]
    fake = FakeCupy()
    with fake.active():
        np.random.seed(1)
        target = QNet(width=512, depth=2)
        np.random.seed(0)
        model = QNet()
        cr.apply(model, budget="least", tuning=cr.Tuning(cost="flops"), verbose=False,
                 capture_batch=None)  # the recorded step measures the loop's work
        opt = chainer.optimizers.MomentumSGD(0.01)
        opt.setup(model)
        stats = []
        for batch in batches:
            td_step(model, target, opt, *batch)
            stats.append(runner_of(model).last_stats)
        (entry,) = runner_of(model).signatures()
        step = entry.structures[0].graph.step
    assert step.allocator == "cupy" and step.correction_bytes == 0
    assert step.outside_peak_bytes >= 3 * 64 * 512 * 4  # the target's activations
    assert [s.path for s in stats] == ["recorded"] + ["planned"] * 3
    for s in stats[1:]:
        assert s.n_dropped and s.measured_pool_total_bytes <= s.budget_bytes, s


def test_random_tape_save_restore_and_the_stream_after():
    fake = FakeCupy()
    fake.random.seed(7)
    reference = FakeCupy()
    reference.random.seed(7)
    expected = [reference.random.rand(5) for _ in range(3)]
    with fake.active():
        dev = device_of([np.zeros(1)])
        rec = recording_random(dev)
        a = fake.random.rand(5)
        saved = RandomStates.save()
        b = fake.random.rand(5)
        RandomStates.restore(saved)
        assert np.array_equal(fake.random.rand(5), b)  # the same draw, again
        with pytest.raises(cr.RecomputeError, match="other random numbers") as refused:
            RandomStates.restore(saved)
            fake.random.rand(6)
        assert isinstance(refused.value, cr.UnsafeRecomputeError)
        rec.close()
        c = fake.random.rand(5)
    # plain Chainer's stream is unchanged: a, b, then c
    assert all(np.array_equal(u, v) for u, v in zip((a, b, c), expected))
    assert not isinstance(fake.random.get_random_state(), devmod.RandomTape)


class NoisyCell(chainer.Chain):
    """An RNN step whose noise comes from CuPy's generator (as F.dropout's
    mask does on a GPU)."""

    def __init__(self, fake, n=8):
        super().__init__()
        self.fake = fake
        with self.init_scope():
            self.x2h = L.Linear(n, n)
            self.h2h = L.Linear(n, n, nobias=True)
            self.out = L.Linear(n, 4)

    def forward(self, h, x, t):
        noise = self.fake.random.rand(*x.shape, dtype=np.float32)
        h = F.tanh(self.x2h(x * noise) + self.h2h(h))
        return F.softmax_cross_entropy(self.out(h), t), h


def _bptt_grads(fake, recompute, T=24):
    rng = np.random.RandomState(0)
    xs = [rng.randn(3, 8).astype(np.float32) for _ in range(T)]
    ts = [rng.randint(0, 4, 3).astype(np.int32) for _ in range(T)]
    np.random.seed(0)
    cell = NoisyCell(fake)
    cell.cleargrads()  # a new Parameter's grad is NaN-filled
    h0 = chainer.Variable(np.zeros((3, 8), np.float32))
    fake.random.seed(3)
    with fake.active():
        if recompute:
            runner = ChainRecompute(cell, policy="msm", slots=2)
            loss, _ = runner(xs, ts, state=h0)
        else:
            loss, h = 0, h0
            for x, t in zip(xs, ts):
                step_loss, h = cell(h, x, t)
                loss = loss + step_loss
        loss.backward()
        after = fake.random.rand(4)  # where the stream is left
    return float(loss.array), {n: p.grad.copy() for n, p in cell.namedparams()}, after


def test_bptt_restores_cupys_random_state():
    fake = FakeCupy()
    l1, g1, a1 = _bptt_grads(fake, recompute=False)
    l2, g2, a2 = _bptt_grads(FakeCupy(), recompute=True)
    assert l1 == l2
    assert all(np.array_equal(g1[k], g2[k]) for k in g1)
    assert np.array_equal(a1, a2)


def test_bptt_without_the_tape_would_differ(monkeypatch):
    """The test above can fail: without taping CuPy's draws, a step run
    again from a checkpoint draws other noise."""
    _, g1, _ = _bptt_grads(FakeCupy(), recompute=False)
    monkeypatch.setattr("chainer_recompute.runtime.bptt.recording_random",
                        lambda dev: devmod.recording_random(CPU))
    _, g2, _ = _bptt_grads(FakeCupy(), recompute=True)
    assert not all(np.array_equal(g1[k], g2[k]) for k in g1)


class NoiseNet(Net):
    def __init__(self, fake):
        super().__init__()
        self.fake = fake

    def forward(self, x, t):
        noise = self.fake.random.standard_normal(x.shape, dtype=np.float32)
        return super().forward(x + 0.1 * noise, t)


def test_gradients_match_seeds_cupy_too():
    fake = FakeCupy()
    x, t = _inputs(32)
    with fake.active():
        assert bench.gradients_match(lambda: NoiseNet(fake), x, t, "least", verbose=False)


def test_seed_all_seeds_both():
    fake = FakeCupy()
    with fake.active():
        seed_all(5)
        a = (np.random.rand(), fake.random.rand(2))
        seed_all(5)
        b = (np.random.rand(), fake.random.rand(2))
    assert a[0] == b[0] and np.array_equal(a[1], b[1])


def test_pool_model_follows_the_pool():
    """core.pool.PoolModel (the replay's model of CuPy's pool) and the test
    double's pool, written apart, agree at every step of random traffic."""
    from chainer_recompute.core.pool import PoolModel
    rng = np.random.RandomState(0)
    model, pool = PoolModel(), FakeCupy().get_default_memory_pool()
    live = []
    for _ in range(2000):
        if live and rng.rand() < 0.45:
            h, b = live.pop(rng.randint(len(live)))
            model.free(h)
            pool.free(b)
        else:
            n = int(rng.choice([100, 512, 1000, 4096, 5000, 20000]))
            live.append((model.alloc(n), pool.malloc(n)))
        assert (model.used_bytes, model.total_bytes) == (pool.used_bytes(), pool.total_bytes())
    assert model.peak_total_bytes > model.peak_used_bytes  # fragments and cached blocks


def test_the_gpu_meter_is_exact_and_reads_the_pool_a_few_times_only():
    """CuPy 14's ``used_bytes()`` and ``total_bytes()`` walk every chunk:
    the meter read both after each allocation, which made a metered
    ResNet152 step on an H200 3-4 times slower than plain Chainer. It now
    counts the sizes CuPy gives its hooks and reads the pool at its start,
    its end and after the pool grew: on random traffic (splits, merges,
    cached blocks, blocks freed that were allocated before it started) its
    peaks are the exact ones, and its reads do not grow with the traffic."""
    fake = FakeCupy()
    pool = fake.get_default_memory_pool()
    reads = {"n": 0}
    for name in ("used_bytes", "total_bytes"):
        method = getattr(pool, name)

        def counted(m=method):
            reads["n"] += 1
            return m()
        setattr(pool, name, counted)
    rng = np.random.RandomState(0)
    live = [pool.malloc(int(n)) for n in rng.choice([512, 5000, 20000], 20)]  # before
    meter = CupyDevice(fake).meter()
    meter.start()
    reads["n"] = 0
    peak_used = peak_total = 0
    mallocs = grew = 0
    for _ in range(3000):
        if live and rng.rand() < 0.47:
            pool.free(live.pop(rng.randint(len(live))))
        else:
            before = sum(pool.segments.values())
            live.append(pool.malloc(int(rng.choice([100, 512, 1000, 4096, 5000, 20000]))))
            mallocs += 1
            grew += sum(pool.segments.values()) > before
        n = reads["n"]
        peak_used = max(peak_used, pool.used_bytes())
        peak_total = max(peak_total, pool.total_bytes())
        reads["n"] = n  # (the test's own reads are not the meter's)
    r = meter.stop()
    assert r.absolute_peak_bytes == peak_used
    assert r.total_peak_bytes == peak_total
    assert r.end_bytes == pool.used_bytes()
    # start, end (2 each) and one total after each growth, not two per allocation
    assert reads["n"] <= 4 + grew < mallocs // 2, (reads["n"], grew, mallocs)


def test_replay_models_the_pool_on_graphs_recorded_on_cupy(monkeypatch):
    from chainer_recompute.core import graph as graph_module
    from chainer_recompute.core.budget import plan_for_budget
    from chainer_recompute.core.replay import replay
    from chainer_recompute.runtime.capture import capture
    # the dropout mask kept, as on CuPy, whose generator draws it (the fake
    # draws from NumPy's, so its mask would be drawn again and released)
    monkeypatch.setattr(graph_module, "RNG_STATE_BYTES", 1 << 40)
    fake = FakeCupy()
    x, t = _inputs()
    model = Net()
    model(x, t)
    with fake.active():
        g = capture(model, x, t, backward=True)
    assert g.step.allocator == "cupy"
    r = replay(g)
    assert r.pool_total_peak_bytes is not None and r.peak_bytes == max(
        r.pool_total_peak_bytes, r.used_peak_bytes)
    assert replay(capture(model, x, t, backward=True)).pool_total_peak_bytes is None
    # the pool's total, not the live arrays', is what the budget bounds: a
    # plan's prediction is its replayed pool total, and a byte budget under
    # it is refused even where the live arrays alone would fit
    from chainer_recompute.core.errors import InfeasibleBudgetError
    from chainer_recompute.core.execution import ExecutionPlan
    plan = plan_for_budget(g, "least")
    ran = replay(g, ExecutionPlan(g, plan.lower_sets, frozenset(plan.kept)))
    assert plan.predicted_peak_bytes == ran.pool_total_peak_bytes > ran.used_peak_bytes
    plain = plan_for_budget(g, r.pool_total_peak_bytes * 2)  # plain backprop fits
    assert plain.predicted_peak_bytes == r.pool_total_peak_bytes
    with pytest.raises(InfeasibleBudgetError):
        plan_for_budget(g, (ran.used_peak_bytes + plan.predicted_peak_bytes) // 2)
