"""Tests of chainer_recompute.runtime.memory: measured peaks, model state bytes, report."""
from __future__ import annotations

import tracemalloc
import types
from typing import Any, List

import numpy as np
import pytest

from chainer_recompute.core.errors import RecomputeError
from chainer_recompute.runtime.memory import (SCOPE_CUPY, SCOPE_NUMPY, SCOPE_TRACED, MemoryMeasurement,
                                      MemoryMeter, format_memory_report, make_pool_peak_hook,
                                      measure_memory, model_state_bytes)

from fake_cupy import FakeCupy, real_cupy_or_skip

KB = 1024
MB = 10 ** 6


def _alloc(nbytes: int) -> np.ndarray:
    a = np.empty(nbytes, np.uint8)
    a.fill(1)  # touch it: a real allocation, not a lazy one
    return a


@pytest.fixture(autouse=True)
def no_tracing_left() -> Any:
    was = tracemalloc.is_tracing()
    yield
    assert tracemalloc.is_tracing() == was, "a test left tracemalloc in another state"


def test_numpy_domain_constant() -> None:
    assert np.lib.tracemalloc_domain == 389047


def test_known_allocations_freed_in_between() -> None:
    with measure_memory() as m:
        a = _alloc(30 * MB)
        del a
        b = _alloc(20 * MB)
        c = _alloc(15 * MB)   # b + c = 35 MB coexist: the peak
        del b, c
        d = _alloc(5 * MB)
    r = m.result
    assert r.device == "cpu" and r.scope == SCOPE_NUMPY
    assert r.start_bytes == pytest.approx(0, abs=4 * KB)
    assert r.peak_bytes == pytest.approx(35 * MB, abs=4 * KB)
    assert r.absolute_peak_bytes == r.peak_bytes + r.start_bytes
    assert r.end_bytes == pytest.approx(5 * MB, abs=4 * KB)
    assert r.retained_bytes == r.end_bytes - r.start_bytes
    del d
    assert not tracemalloc.is_tracing()


def test_large_empty_exact() -> None:
    with measure_memory(np) as m:
        x = np.empty(10 ** 8, np.uint8)
        x.fill(0)
        del x
    assert m.result.peak_bytes == pytest.approx(10 ** 8, abs=4 * KB)
    assert m.result.end_bytes == pytest.approx(0, abs=4 * KB)


def test_python_objects_not_counted_by_default() -> None:
    with measure_memory() as m:
        junk = [str(i) * 10 for i in range(200_000)]  # ~ 15 MB of Python objects
        a = _alloc(1 * MB)
        del a
    assert m.result.peak_bytes == pytest.approx(1 * MB, abs=4 * KB)
    with measure_memory(numpy_only=False) as m2:
        junk2 = [str(i) * 10 for i in range(200_000)]
    assert m2.result.scope == SCOPE_TRACED
    assert m2.result.peak_bytes > 5 * MB
    del junk, junk2


def test_nested_meters_keep_the_outer_peak() -> None:
    with measure_memory() as outer:
        a = _alloc(10 * MB)
        with measure_memory() as inner:
            b = _alloc(30 * MB)
            del b
            c = _alloc(1 * MB)
        d = _alloc(5 * MB)
        del d
    i, o = inner.result, outer.result
    assert i.start_bytes == pytest.approx(10 * MB, abs=4 * KB)
    assert i.peak_bytes == pytest.approx(30 * MB, abs=4 * KB)
    assert i.absolute_peak_bytes == pytest.approx(40 * MB, abs=4 * KB)
    assert i.end_bytes == pytest.approx(11 * MB, abs=4 * KB)
    # The inner reset_peak() did not make the outer meter forget the 40 MB.
    assert o.peak_bytes == pytest.approx(40 * MB, abs=4 * KB)
    assert o.end_bytes == pytest.approx(11 * MB, abs=4 * KB)
    del a, c


def test_a_nested_meter_tells_the_arrays_made_before_the_tracing() -> None:
    """Inside a meter started after an array was made, ``untraced`` lists
    it (its frees are seen by no meter) and not one made since, nor a
    view; telling them apart changes neither meter's figures.
    ``checkpoint`` gives the peak so far and starts it again, the outer
    meter keeping its own."""
    before = np.ones(MB, np.uint8)
    with MemoryMeter() as outer:
        after = np.ones(MB // 10, np.uint8)
        with MemoryMeter() as inner:
            assert inner.untraced([before, after, before[:10], before]) == [before]
            assert inner.current_bytes() == outer.current_bytes() == pytest.approx(MB // 10, abs=KB)
            big = np.ones(3 * MB // 10, np.uint8)
            del big
            assert inner.checkpoint() == pytest.approx(4 * MB // 10, abs=KB)
            small = np.ones(MB // 100, np.uint8)
        assert inner.result.absolute_peak_bytes == pytest.approx(11 * MB // 100, abs=KB)
        assert inner.untraced([before]) == []  # (stopped)
        del small
    assert outer.result.peak_bytes == pytest.approx(4 * MB // 10, abs=KB)
    assert outer.result.end_bytes == pytest.approx(MB // 10, abs=KB)


def test_raising_block_stops_tracing_and_keeps_result() -> None:
    with pytest.raises(ZeroDivisionError):
        with measure_memory() as m:
            a = _alloc(2 * MB)
            with MemoryMeter() as inner:
                b = _alloc(3 * MB)
                1 / 0
    assert not tracemalloc.is_tracing()
    assert inner.result is not None and m.result is not None
    assert inner.result.peak_bytes == pytest.approx(3 * MB, abs=4 * KB)
    assert m.result.peak_bytes == pytest.approx(5 * MB, abs=4 * KB)
    # The next meter starts clean.
    with measure_memory() as again:
        c = _alloc(1 * MB)
    assert again.result.start_bytes == pytest.approx(0, abs=4 * KB)
    assert again.result.peak_bytes == pytest.approx(1 * MB, abs=4 * KB)
    del a, c


def test_tracing_started_by_someone_else_is_left_running() -> None:
    tracemalloc.start()
    try:
        keep = _alloc(4 * MB)
        with measure_memory() as m:
            a = _alloc(8 * MB)
            del a
        assert tracemalloc.is_tracing()
        r = m.result
        assert r.scope == SCOPE_TRACED
        assert r.start_bytes >= 4 * MB
        assert 8 * MB <= r.peak_bytes < 8 * MB + 512 * KB
        del keep
    finally:
        tracemalloc.stop()


def test_meter_misuse_errors() -> None:
    meter = MemoryMeter()
    with pytest.raises(RecomputeError, match="not running"):
        meter.stop()
    meter.start()
    with pytest.raises(RecomputeError, match="already running"):
        meter.start()
    meter.stop()
    with pytest.raises(RecomputeError, match="expected numpy, cupy"):
        MemoryMeter("tpu")
    with pytest.raises(RecomputeError, match="expected numpy or cupy"):
        MemoryMeter(types.SimpleNamespace(__name__="jax.numpy"))
    assert MemoryMeter("cuda").device == "gpu"


# --------------------------------------------------------------------------
# Chainer

def _mlp(sizes: List[int]) -> Any:
    import chainer
    import chainer.links as L

    class MLP(chainer.ChainList):
        def __init__(self) -> None:
            super().__init__(*[L.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:])])

        def forward(self, x: Any) -> Any:
            import chainer.functions as F
            h = x
            for i, link in enumerate(self):
                h = link(h)
                if i < len(self) - 1:
                    h = F.relu(h)
            return h
    return MLP()


def test_chainer_mlp_forward_backward_peak() -> None:
    import chainer.functions as F
    batch, sizes = 64, [784, 1000, 1000, 10]
    model = _mlp(sizes)
    x = np.random.RandomState(0).standard_normal((batch, sizes[0])).astype(np.float32)
    t = np.arange(batch, dtype=np.int32) % sizes[-1]
    model.cleargrads()
    with measure_memory() as m:
        loss = F.softmax_cross_entropy(model(x), t)
        loss.backward()
        del loss
    r = m.result
    # The two hidden ReLU outputs are retained (by ReLU and by the next Linear)
    # until backward reaches them, so they coexist; so do the new gradients.
    hidden = 2 * batch * 1000 * 4
    grads = sum(p.grad.nbytes for p in model.params())
    params = sum(p.array.nbytes for p in model.params())
    assert r.peak_bytes >= hidden
    assert r.end_bytes == pytest.approx(grads, rel=0.01, abs=64 * KB)
    assert r.peak_bytes >= grads
    # Reasonable: below everything added up twice over.
    activations = batch * (sizes[0] + 2 * 1000 * 2 + 10 * 3) * 4
    assert r.peak_bytes < 2 * (activations + grads + params)
    text = format_memory_report(r, predicted_peak_bytes=hidden + grads,
                                state=model_state_bytes(model))
    assert "measured / predicted" in text


def test_model_state_bytes_adam_and_momentum() -> None:
    import chainer
    import chainer.functions as F
    import chainer.optimizers as O
    for make, per_param in ((O.Adam, 2), (O.MomentumSGD, 1), (O.SGD, 0)):
        model = _mlp([20, 30, 5])
        opt = make()
        opt.setup(model)
        before = model_state_bytes(model, opt)
        assert before["optimizer_state"] == 0  # state is made on the first update
        x = np.ones((4, 20), np.float32)
        loss = F.sum(model(x))
        model.cleargrads()
        loss.backward()
        opt.update()
        got = model_state_bytes(model, opt)
        params = sum(p.array.nbytes for p in model.params())
        assert got["params"] == params == (20 * 30 + 30 + 30 * 5 + 5) * 4
        assert got["grads"] == sum(p.grad.nbytes for p in model.params())
        assert got["optimizer_state"] == per_param * params, make.__name__
        expected = sum(v.nbytes for p in model.params() for v in p.update_rule.state.values())
        assert got["optimizer_state"] == expected
    assert model_state_bytes(model) == {"params": params, "grads": params, "optimizer_state": 0}
    model.cleargrads()
    assert model_state_bytes(model)["grads"] == 0
    assert isinstance(model, chainer.Link)


def test_model_state_bytes_shared_array_counted_once() -> None:
    import chainer.links as L
    a, b = L.Linear(4, 4), L.Linear(4, 4)
    b.W.array = a.W.array
    chain = __import__("chainer").ChainList(a, b)
    assert model_state_bytes(chain)["params"] == 16 * 4 + 2 * 4 * 4


def test_tied_parameters_counted_once_by_every_model_state_count() -> None:
    """One Parameter reached under two names (tied weights) is one array:
    state_bytes, model_state_bytes and parameter_bytes (which the BPTT
    driver's constant bytes use) count its value, gradient and optimizer
    state once, before and after an update."""
    import chainer
    import chainer.functions as F
    import chainer.links as L
    import chainer.optimizers as O
    from chainer_recompute.runtime.capture import state_bytes
    from chainer_recompute.runtime.memory import parameter_bytes

    class Tied(chainer.Chain):
        def __init__(self) -> None:
            super().__init__()
            with self.init_scope():
                self.enc = L.Linear(4, 6)
                self.dec = L.Linear(6, 4)
                self.again = self.enc  # the same Linear under a second name

        def __call__(self, x: Any) -> Any:
            return self.dec(self.again(x))

    model = Tied()
    opt = O.MomentumSGD()
    opt.setup(model)
    assert len(list(model.params())) == 6  # Chainer yields the tied ones twice
    params = (4 * 6 + 6 + 6 * 4 + 4) * 4
    sb = state_bytes(model)
    assert (sb["params"], sb["param_grads"], sb["optimizer_state"]) == (params, params, params)
    assert model_state_bytes(model, opt) == {"params": params, "grads": params, "optimizer_state": 0}
    model.cleargrads()
    F.sum(model(np.ones((2, 4), np.float32))).backward()
    opt.update()
    assert state_bytes(model)["optimizer_state"] == params
    assert model_state_bytes(model, opt) == {"params": params, "grads": params,
                                             "optimizer_state": params}
    pb = parameter_bytes(model.params(), nbytes=int)
    assert (pb["params"], pb["grads"], pb["optimizer_state"]) == (params, params, params)


# --------------------------------------------------------------------------
# GPU path, with a fake CuPy and with the real one.

def test_gpu_meter_with_fake_cupy() -> None:
    cp = FakeCupy()
    pool = cp.get_default_memory_pool()
    a = pool.malloc(1000)  # live at entry: 1024 bytes (512-byte units)
    with measure_memory(cp, cupy_module=cp) as m:
        b = pool.malloc(5000)  # 5120
        pool.free(b)  # cached: the pool's total stays
        c = pool.malloc(3000)  # 3072, split from the cached block
        with measure_memory("gpu", cupy_module=cp) as inner:  # nested: its own hook name
            assert len(cp.hooks) == 2
            d = pool.malloc(2000)  # 2048: the rest of the split block
            pool.free(d)
    assert cp.hooks == []
    r = m.result
    assert r == MemoryMeasurement(peak_bytes=5120, absolute_peak_bytes=6144, start_bytes=1024,
                                  end_bytes=4096, device="gpu", scope=SCOPE_CUPY,
                                  total_peak_bytes=6144, start_total_bytes=1024)
    assert inner.result.start_bytes == 4096 and inner.result.peak_bytes == 2048
    assert inner.result.total_peak_bytes == 6144
    del a, c


def test_fake_pool_limit_frees_cached_blocks_then_raises() -> None:
    pool = FakeCupy().get_default_memory_pool()
    pool.set_limit(size=4096)
    b = pool.malloc(3000)
    pool.free(b)
    c = pool.malloc(4000)  # the cached 3072 block is not enough: freed, then a new one
    assert pool.total_bytes() == 4096 and pool.used_bytes() == 4096
    with pytest.raises(FakeCupy.OutOfMemoryError):
        pool.malloc(1)
    del c


def test_make_pool_peak_hook_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(RecomputeError, match="needs CuPy"):
        make_pool_peak_hook()


@pytest.mark.gpu
def test_gpu_meter_with_cupy() -> None:
    cp = real_cupy_or_skip()
    pool = cp.get_default_memory_pool()
    unit = 512  # the pool rounds every allocation up to it
    keep = cp.ones(10 ** 6, cp.uint8)
    with measure_memory(cp) as m:
        a = cp.ones(10 ** 8, cp.uint8)
        del a
        b = cp.ones(3 * 10 ** 7, cp.uint8)
    r = m.result
    rounded = -(-b.nbytes // unit) * unit
    assert r.device == "gpu" and r.start_bytes == pool.used_bytes() - rounded
    assert r.start_bytes >= keep.nbytes
    assert r.peak_bytes == -(-10 ** 8 // unit) * unit
    assert r.end_bytes - r.start_bytes == rounded
    assert r.total_peak_bytes >= r.absolute_peak_bytes


# --------------------------------------------------------------------------
# Report

def test_format_memory_report() -> None:
    m = MemoryMeasurement(peak_bytes=3 * 2 ** 20, absolute_peak_bytes=4 * 2 ** 20,
                          start_bytes=2 ** 20, end_bytes=2 ** 20, device="cpu", scope=SCOPE_NUMPY)
    text = format_memory_report(m, predicted_peak_bytes=2 * 2 ** 20,
                                state={"params": 2 ** 20, "grads": 2 ** 20, "optimizer_state": 2 ** 21})
    assert "3.00 MiB above 1.00 MiB" in text
    assert "measured / predicted = 1.50" in text
    assert "total 4.00 MiB" in text
    assert len(format_memory_report(m).splitlines()) == 1
    assert "n/a" in format_memory_report(m, predicted_peak_bytes=0)
    with pytest.raises(dataclasses_frozen_error()):
        m.peak_bytes = 0  # type: ignore[misc]


def dataclasses_frozen_error() -> type:
    import dataclasses
    return dataclasses.FrozenInstanceError
