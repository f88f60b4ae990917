"""Memory a training step allocates outside the recorded functions (issue #32,
deliverable 4): work the forward does with backprop disabled (a frozen
teacher's forward inside a distillation loss) and ``F.forget`` (its function
runs under no-backprop in the forward and again, with backprop, in its
backward).

Each model trains for :data:`STEPS` optimizer steps with plain Chainer and
with ``apply()`` at ``budget='least'`` and at a byte budget halfway between
that least figure and plain Chainer's measured peak, with the harness of
``test_step_budget`` (bit for bit against plain Chainer, every planned step's
whole peak at or under its budget); the runner's prediction
(``last_stats.predicted_peak_bytes``) must be within :data:`ACCURACY` of the
measured peak. The models keep only their loss's value (as a reporter
does), not its graph, so that plain Chainer's peak is one step's.

The graph's new parts (``ArrayInfo.made_at``, ``Node.unrecorded_peak_bytes``
and its tail in ``step``, ``Node.inner_params``) are checked on the recorded
graphs and on a small graph written by hand, in both replay engines.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import chainer_recompute as cr
from chainer_recompute.core.execution import ExecutionPlan
from chainer_recompute.core.graph import ArrayInfo, Graph, Node, StepFacts
from chainer_recompute.core.io import graph_from_dict, graph_to_dict
from chainer_recompute.core.replay import RELEASE_MODES, replay
from chainer_recompute.core.solvers._dp import numba_available
from harness import Run  # noqa: E402
from test_step_budget import OPTIONS, check, train  # noqa: E402

STEPS = 5
#: how far the runner's predicted peak may be from the measured one
ACCURACY = 0.03


# ------------------------------------------------------------- models
class Teacher(chainer.Chain):
    """A frozen network with wide hidden activations and few parameters:
    its forward's peak (several (batch, 1024) arrays at once) is larger
    than anything the student keeps."""

    def __init__(self, n_in: int = 32, hidden: int = 1024, n_out: int = 64) -> None:
        super().__init__()
        with self.init_scope():
            self.inp = L.Linear(n_in, hidden)
            self.out = L.Linear(hidden, n_out)

    def forward(self, x: Any) -> chainer.Variable:
        h = F.relu(self.inp(x))
        h = F.tanh(h) * h + h
        return self.out(h)


class Distillation(chainer.Chain):
    """A residual MLP student trained to match a frozen teacher's outputs
    (a hint loss): the teacher runs under ``no_backprop_mode`` inside the
    forward, after the student, and its output is read by the loss (a
    subtraction, which retains nothing: the output lives only to the loss's
    end)."""

    def __init__(self, n_in: int = 32, width: int = 128, depth: int = 3,
                 n_out: int = 64) -> None:
        super().__init__()
        with self.init_scope():
            self.inp = L.Linear(n_in, width)
            self.layers = chainer.ChainList(*[L.Linear(width, width) for _ in range(depth)])
            self.head = L.Linear(width, n_out)
            self.teacher = Teacher(n_in, n_out=n_out)
        self.teacher.disable_update()
        self.loss: Any = None

    def forward(self, x: Any, t: Any) -> chainer.Variable:
        h = F.relu(self.inp(x))
        for layer in self.layers:
            h = F.relu(layer(h)) + h
        with chainer.using_config("train", False), chainer.no_backprop_mode():
            target = self.teacher(x)
        d = self.head(h) - target
        loss = F.sum(d * d) / len(x)
        self.loss = loss.array  # the value, for reporting; not the graph
        return loss


class ForgetNet(chainer.Chain):
    """Residual blocks whose branch is a wide Linear under ``F.forget``:
    its intermediates are not kept in the forward and are made again in
    its backward, which also makes the branch's parameter gradients (its
    parameters are no input of the Forget function)."""

    def __init__(self, n_in: int = 32, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        with self.init_scope():
            self.inp = L.Linear(n_in, width)
            self.layers = chainer.ChainList(*[L.Linear(width, width) for _ in range(depth)])
            self.branches = chainer.ChainList(*[L.Linear(width, width) for _ in range(depth)])
            self.out = L.Linear(width, 10)
        self.loss: Any = None

    def forward(self, x: Any, t: Any) -> chainer.Variable:
        h = F.relu(self.inp(x))
        for layer, branch in zip(self.layers, self.branches):
            h = F.relu(layer(h))
            h = h + F.forget(lambda a, f=branch: F.tanh(f(a)) * a, h)
        loss = F.softmax_cross_entropy(self.out(h), t)
        self.loss = loss.array  # the value, for reporting; not the graph
        return loss


def batches(batch: int, n: int = STEPS, width: int = 32, seed: int = 7
            ) -> List[Tuple[np.ndarray, np.ndarray]]:
    rs = np.random.RandomState(seed)
    return [(rs.randn(batch, width).astype(np.float32),
             rs.randint(0, 10, batch).astype(np.int32)) for _ in range(n)]


CASES: Dict[str, Tuple[Callable[[], chainer.Link], int]] = {
    "distillation": (Distillation, 512),
    "forget": (ForgetNet, 256),
}


# ------------------------------------------------------------- runs
@functools.lru_cache(maxsize=None)
def _plain(name: str) -> Run:
    make, batch = CASES[name]
    return train(make, batches(batch), False)


@functools.lru_cache(maxsize=None)
def _applied(name: str, budget: Any) -> Run:
    make, batch = CASES[name]
    return train(make, batches(batch), True, options=dict(OPTIONS, budget=budget))


def _least_bytes(name: str) -> int:
    """The least figure ``apply(budget='least')`` planned for."""
    budget = _applied(name, "least").stats[1]["budget"]
    assert budget is not None and budget > 0
    return int(budget)


def _mid_bytes(name: str) -> int:
    """Halfway between the least figure and plain Chainer's measured peak."""
    plain_peak = max(_plain(name).peaks)
    least = _least_bytes(name)
    assert least < plain_peak, (least, plain_peak)
    return (least + plain_peak) // 2


def _check_at(name: str, budget: Any) -> Run:
    """``check`` (bit for bit, every planned step under its budget) at
    ``budget``, and the prediction within :data:`ACCURACY` of each planned
    step's measured peak."""
    make, batch = CASES[name]
    _, ours = check(make, batches(batch), plain=_plain(name), ours=_applied(name, budget))
    for k in range(1, STEPS):
        st = ours.stats[k]
        measured, predicted = ours.peaks[k], st["predicted"]
        assert predicted is not None
        assert abs(predicted - measured) <= ACCURACY * measured, (
            f"step {k}: predicted {predicted / 2**20:.3f} MiB, measured "
            f"{measured / 2**20:.3f} MiB, budget {st['budget'] / 2**20:.3f} MiB")
        if budget != "least":
            assert st["budget"] == budget
    return ours


@pytest.mark.parametrize("name", sorted(CASES))
def test_least_budget(name: str) -> None:
    _check_at(name, "least")


@pytest.mark.parametrize("name", sorted(CASES))
def test_mid_budget(name: str) -> None:
    _check_at(name, _mid_bytes(name))


# ------------------------------------------------------- recorded graphs
@functools.lru_cache(maxsize=None)
def _recorded(name: str) -> Graph:
    from chainer_recompute.runtime.capture import capture
    make, batch = CASES[name]
    np.random.seed(0)
    model = make()
    x, t = batches(batch, n=1)[0]
    return capture(model, x, t, backward=True)


def test_the_teachers_work_is_in_the_graph() -> None:
    """The teacher's functions are no nodes; its output, which the loss
    reads, is an array made before the loss's first function and living to
    the forward's end; its peak (three of its (512, 1024) arrays at once,
    its output included) is where it ran."""
    g = _recorded("distillation")
    assert not any(a.name.startswith("/teacher") for a in g.arrays)
    made = [a for a in g.arrays if a.made_at is not None]
    assert len(made) == 1
    (target,) = made
    assert target.shape == (512, 64) and target.kind == "input" and target.producer is None
    reader = next(n for n in g.nodes if target.id in n.inputs)
    assert reader.op == "Sub" and target.made_at == reader.id - 1
    assert target.dies_at == g.n  # the forward's local variable
    before = g.nodes[target.made_at]
    hidden = 512 * 1024 * 4
    assert 2 * hidden <= before.unrecorded_peak_bytes < 4 * hidden
    assert sum(n.unrecorded_peak_bytes for n in g.nodes) == before.unrecorded_peak_bytes
    r = replay(g, engine="python")
    assert r.peak_event == f"unrecorded work before {before.id} {before.op}"
    # the graph saved and read again is the same graph
    assert graph_from_dict(graph_to_dict(g)).arrays == g.arrays
    assert graph_from_dict(graph_to_dict(g)).nodes == g.nodes


def test_forget_makes_its_functions_parameter_gradients() -> None:
    """Each Forget node names its branch's parameters (not its inputs); the
    replay makes their gradients in its backward and keeps them to the
    update, as Chainer does (where no backward made them, the optimizer
    would make them as zeros at the update: ``replay.update_bytes``)."""
    g = _recorded("forget")
    forgets = [n for n in g.nodes if n.op == "Forget"]
    assert len(forgets) == 4
    names = [sorted(g.arrays[a].name for a in n.inner_params) for n in forgets]
    assert names == [[f"/branches/{k}/W", f"/branches/{k}/b"] for k in range(4)]
    assert all(not set(n.inputs) & set(n.inner_params) for n in forgets)
    assert not any(n.inner_params for n in g.nodes if n.op != "Forget")
    inner = sum(g.arrays[a].nbytes for n in forgets for a in n.inner_params)
    without = g.replace(nodes=[dataclasses.replace(n, inner_params=()) for n in g.nodes])
    with_, without_ = replay(g, engine="python"), replay(without, engine="python")
    # by the end of the backward the branches' gradients are there; at the
    # update every parameter's is, the others' made as zeros
    last = max(k for k, e in enumerate(with_.events) if e.startswith("backward"))
    assert with_.memory_bytes[last] - without_.memory_bytes[last] == inner
    assert with_.memory_bytes[-1] == without_.memory_bytes[-1]


def test_the_recorder_places_unrecorded_work() -> None:
    """Work under no-backprop before the first recorded function, between
    two, and after the last: its peaks where it ran, the arrays it made
    that recorded functions read with where they were made, and a
    reference dropped during it counted one node later."""
    from chainer_recompute.runtime.capture import capture
    lin = L.Linear(256, 256)
    x = np.random.RandomState(0).randn(512, 256).astype(np.float32)
    lin(x)  # lazy initialisation

    def f(x: Any) -> chainer.Variable:
        with chainer.no_backprop_mode():
            big = F.tanh(F.relu(x * 2.0))
        h = lin(x) + big
        h2 = F.relu(h)
        with chainer.no_backprop_mode():
            t = F.exp(big) + 1.0
            del h  # (ReLU retains its output, not its input)
        y = F.sum(h2 * t)
        with chainer.no_backprop_mode():
            F.exp(t * 2.0)
        return y

    g = capture(f, x, link=lin)
    assert [n.op for n in g.nodes] == ["LinearFunction", "Add", "ReLU", "Mul", "Sum"]
    made = {a.made_at: a for a in g.arrays if a.made_at is not None}
    assert sorted(made) == [0, 3]
    assert made[0].id in g.nodes[1].inputs and made[3].id in g.nodes[3].inputs
    # locals to the return, after the work after the last node
    assert made[0].dies_at == made[3].dies_at == g.n + 1
    one = 512 * 256 * 4
    peaks = [n.unrecorded_peak_bytes for n in g.nodes]
    assert peaks[0] >= 2 * one and peaks[3] >= 2 * one, peaks
    assert peaks[1] == peaks[2] == peaks[4] == 0, peaks
    assert g.step.unrecorded_tail_peak_bytes >= 2 * one
    (h,) = g.nodes[1].outputs
    assert g.arrays[h].dies_at == 4  # dropped during the work before node 3
    events = replay(g, engine="python").events
    assert events.index("unrecorded work before 3 Mul") + 1 == events.index("forward 3 Mul")
    assert events.index("unrecorded work after the last function") + 1 == \
        events.index("end of forward")


def test_the_plan_regenerates_forget() -> None:
    """At the least budget the plan drops Forget nodes and runs their
    forward again in the backward (its function under no-backprop, its
    parameters watched): ``test_least_budget[forget]`` compares that run with
    plain Chainer bit for bit."""
    make, batch = CASES["forget"]
    np.random.seed(0)
    model = cr.apply(make(), **dict(OPTIONS, budget="least"))
    opt = chainer.optimizers.MomentumSGD(0.01)
    opt.setup(model)
    data = batches(batch, n=2)
    for x, t in data:
        opt.update(model, x, t)
    runner = cr.runner_of(model)
    (graph,) = runner.planned_graphs()
    (plan,) = runner.plans.values()
    forgets = {n.id for n in graph.nodes if n.op == "Forget"}
    assert forgets & set(plan.dropped)
    assert runner.last_stats.recomputed_nodes > 0


# -------------------------------------------------------- both engines
def _hand_graph() -> Graph:
    """Four functions; unrecorded work before node 1 (made array 5, read by
    node 2) and after the last node; array 6 dropped by the caller during
    the work before node 1 (``dies_at`` 2)."""
    mib = 1 << 20
    arrays = [
        ArrayInfo(0, (1,), "float32", mib, "input", name="0"),
        ArrayInfo(1, (1,), "float32", 2 * mib, "intermediate", 0, dies_at=4),
        ArrayInfo(2, (1,), "float32", 2 * mib, "intermediate", 1, dies_at=3),
        ArrayInfo(3, (1,), "float32", 2 * mib, "intermediate", 2, dies_at=4),
        ArrayInfo(4, (1,), "float32", 4, "output", 3),
        ArrayInfo(5, (1,), "float32", 3 * mib, "input", made_at=1, dies_at=3),
        ArrayInfo(6, (1,), "float32", 5 * mib, "intermediate", 0, dies_at=2),
    ]
    nodes = [
        Node(0, "A", (0,), (1, 6), retained_inputs=(0,)),
        Node(1, "B", (1,), (2,), retained_inputs=(1,), unrecorded_peak_bytes=7 * mib),
        Node(2, "C", (2, 5), (3,), retained_inputs=(2,)),
        Node(3, "D", (3,), (4,), retained_inputs=(3,)),
    ]
    return Graph(arrays, nodes, batch_size=1,
                 step=StepFacts(unrecorded_tail_peak_bytes=11 * mib, returned=(4,)))


def test_hand_graph_replay() -> None:
    mib = 1 << 20
    g = _hand_graph()
    r = replay(g, engine="python")
    at = dict(zip(r.events, r.memory_bytes.tolist()))
    base = mib  # the caller's input
    # the work before node 1: arrays 1 and 6 alive (6 dropped only after it)
    assert at["unrecorded work before 1 B"] == base + 2 * mib + 5 * mib + 7 * mib
    # node 2 runs with the made array 5 (3 MiB), and without array 6
    assert at["forward 2 C"] == base + 2 * mib + 2 * mib + 3 * mib + 2 * mib
    # after the last node: array 5 is gone (dies_at 3)
    assert at["unrecorded work after the last function"] == \
        base + 2 * mib + 2 * mib + 2 * mib + 4 + 11 * mib
    assert r.peak_event == "unrecorded work after the last function"
    assert graph_from_dict(graph_to_dict(g)).step.unrecorded_tail_peak_bytes == 11 * mib
    # a batch twice as large: the work's peaks as the transients
    big = g.scale_batch(2)
    assert big.nodes[1].unrecorded_peak_bytes == 14 * mib
    assert big.step.unrecorded_tail_peak_bytes == 22 * mib and big.arrays[5].made_at == 1


@pytest.mark.skipif(not numba_available(), reason="needs numba (the 'fast' extra)")
@pytest.mark.parametrize("name", ["hand", "distillation", "forget"])
def test_both_engines_agree(name: str) -> None:
    g = _hand_graph() if name == "hand" else _recorded(name)
    plans: List[Any] = [None]
    if name != "hand":
        from test_replay_kernel import _some_plans
        plans += [ExecutionPlan(g, p.lower_sets, frozenset(p.kept)) for p in _some_plans(g)]
        assert len(plans) >= 3
    for ep in plans:
        for mode in RELEASE_MODES:
            a = replay(g, ep, release_mode=mode, engine="python")
            b = replay(g, ep, release_mode=mode, engine="numba")
            assert a.events == b.events, (name, mode)
            assert np.array_equal(a.memory_bytes, b.memory_bytes), (name, mode)
            assert (a.peak_bytes, a.peak_event, a.recomputed) == \
                (b.peak_bytes, b.peak_event, b.recomputed), (name, mode)
