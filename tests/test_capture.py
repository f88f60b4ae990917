"""Graph capture against values derived independently from shapes."""
import time

import numpy as np
import pytest

import chainer_recompute as cr  # noqa: F401  (applies the NumPy compat first)
import chainer
import chainer.functions as F
import chainer.links as L

from chainer_recompute.runtime.capture import capture
from chainer_recompute.core.errors import CaptureError

F32 = 4


class MLP(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(4, 5)
            self.l2 = L.Linear(5, 3)

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.l2(F.relu(self.l1(x))), t)


def _ids(g, kind):
    return [a.id for a in g.arrays if a.kind == kind]


def test_mlp_nodes_edges_bytes_and_retention():
    x = np.ones((2, 4), np.float32)
    t = np.array([0, 2], np.int32)
    model = MLP()
    t0 = time.perf_counter()
    g = capture(model, x, t)
    elapsed_s = time.perf_counter() - t0
    assert [n.op for n in g.nodes] == ["LinearFunction", "ReLU", "LinearFunction",
                                      "SoftmaxCrossEntropy"]
    assert g.edges == [(0, 1), (1, 2), (2, 3)]
    # M_v from shapes: (2,5), (2,5), (2,3) float32 and a float32 scalar.
    assert list(g.node_bytes) == [2 * 5 * F32, 2 * 5 * F32, 2 * 3 * F32, F32]
    params = {a.name: a for a in g.arrays if a.kind == "param"}
    assert set(params) == {"/l1/W", "/l1/b", "/l2/W", "/l2/b"}
    assert params["/l1/W"].shape == (5, 4) and params["/l1/W"].nbytes == 5 * 4 * F32
    inputs = [a for a in g.arrays if a.kind == "input"]
    assert sorted(a.shape for a in inputs) == [(2,), (2, 4)]
    assert g.arrays[g.nodes[3].outputs[0]].kind == "output"
    # Linear retains x and W; ReLU retains its output; SCE retains both inputs.
    n0, n1, n2, n3 = g.nodes
    assert n0.retained_inputs == n0.inputs[:2] and n0.retained_outputs == ()
    assert n1.retained_inputs == () and n1.retained_outputs == n1.outputs
    assert n2.retained_inputs == n2.inputs[:2]
    assert n3.retained_inputs == n3.inputs
    assert all(n.recomputable for n in g.nodes)
    assert g.batch_size == 2
    # each function's forward timed: not zero, and within the capture's time
    assert all(n.forward_time_s is not None and n.forward_time_s > 0 for n in g.nodes)
    assert sum(n.forward_time_s for n in g.nodes) < elapsed_s


def test_diamond_edges():
    lin = L.Linear(3, 6)

    def f(x):
        h = F.relu(lin(x))
        return F.sum(F.tanh(h) + F.sigmoid(h))

    g = capture(f, np.ones((2, 3), np.float32), link=lin)
    assert [n.op for n in g.nodes] == ["LinearFunction", "ReLU", "Tanh", "Sigmoid", "Add", "Sum"]
    assert sorted(g.edges) == [(0, 1), (1, 2), (1, 3), (2, 4), (3, 4), (4, 5)]
    assert g.succs[1] == (2, 3) and g.preds[4] == (2, 3)
    # The ReLU output is read by both branches: one array, two readers.
    relu_out = g.nodes[1].outputs[0]
    assert g.nodes[2].inputs == (relu_out,) and g.nodes[3].inputs == (relu_out,)


class ResBlock(chainer.Chain):
    def __init__(self, c=4):
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(c, c, 3, pad=1, nobias=True)
            self.b1 = L.BatchNormalization(c)
            self.c2 = L.Convolution2D(c, c, 3, pad=1, nobias=True)
            self.b2 = L.BatchNormalization(c)

    def forward(self, x):
        h = F.relu(self.b1(self.c1(x)))
        return F.sum(F.relu(self.b2(self.c2(h)) + x))


def test_residual_block_with_batchnorm_state_untouched():
    model = ResBlock()
    x = np.random.RandomState(0).randn(2, 4, 5, 5).astype(np.float32)
    model(x)  # some history in the running statistics
    before = {(n, p): getattr(l, p).copy() for n, l in model.namedlinks()
              for p in l._persistent if isinstance(getattr(l, p), np.ndarray)}
    counts = {n: l.N for n, l in model.namedlinks() if hasattr(l, "N")}
    g = capture(model, x)
    for (n, p), v in before.items():
        np.testing.assert_array_equal(getattr(dict(model.namedlinks())[n], p), v)
    assert {n: l.N for n, l in model.namedlinks() if hasattr(l, "N")} == counts
    ops = [n.op for n in g.nodes]
    assert ops == ["Convolution2DFunction", "BatchNormalization", "ReLU",
                   "Convolution2DFunction", "BatchNormalization", "Add", "ReLU", "Sum"]
    act = 2 * 4 * 5 * 5 * F32
    assert list(g.node_bytes[:7]) == [act] * 7
    assert (0, 5) not in g.edges and g.preds[5] == (4,)  # x is an input, not a node
    bn = g.nodes[1]
    held = {h.name: h for h in bn.held}
    # BatchNorm keeps per-channel statistics, which its forward recomputes;
    # the running averages are updated in place.
    assert held["mean"].role == "derived" and held["mean"].nbytes == 4 * F32
    assert held["inv_std"].role == "derived"
    assert {h.name for h in bn.held if h.role == "written"} == {"running_mean", "running_var"}
    assert bn.retained_inputs == bn.inputs[:2]  # x and gamma
    assert g.nodes[5].retained_inputs == () and g.nodes[5].held == ()  # Add keeps nothing


def test_dropout_mask_is_drawn_and_rng_restored():
    """The mask is remade bit for bit from the random state before the
    forward (role ``drawn``); one this small (96 bytes) is kept rather than
    the random state that would replace it."""
    def f(x):
        return F.sum(F.dropout(x * 2, 0.5))

    x = chainer.Variable(np.ones((3, 8), np.float32))
    np.random.seed(1)
    g = capture(f, x)
    after = np.random.rand()
    np.random.seed(1)
    assert np.random.rand() == after
    drop = g.nodes[1]
    assert drop.op == "Dropout"
    (mask,) = drop.held
    assert mask.role == "drawn" and mask.nbytes == 3 * 8 * F32 and mask.shape == (3, 8)
    assert not mask.remade
    assert drop.recomputable
    assert g.retained_bytes == mask.nbytes


def test_multi_output_function_is_one_node():
    def f(x):
        a, b, c = F.split_axis(x * 1, 3, axis=1)
        return F.sum(a) + F.sum(c)

    g = capture(f, chainer.Variable(np.ones((2, 6), np.float32)))
    split = g.nodes[1]
    assert split.op == "SplitAxis" and len(split.outputs) == 3
    # split_axis returns views of its input: they cost no bytes of their own
    assert g.node_bytes[1] == 0
    assert all(g.arrays[a].view_of == g.nodes[0].outputs[0] for a in split.outputs)
    sums = [n for n in g.nodes if n.op == "Sum"]
    assert [s.inputs for s in sums] == [(split.outputs[0],), (split.outputs[2],)]
    assert g.arrays[split.outputs[1]].kind == "output"  # nobody reads b
    assert all(g.preds[s.id] == (1,) for s in sums)


def test_link_called_twice_shares_parameters():
    lin = L.Linear(3, 3)

    def f(x):
        return F.sum(lin(F.tanh(lin(x))))

    g = capture(f, np.ones((2, 3), np.float32), link=lin)
    linears = [n for n in g.nodes if n.op == "LinearFunction"]
    assert len(linears) == 2
    assert linears[0].inputs[1:] == linears[1].inputs[1:]
    assert len([a for a in g.arrays if a.kind == "param"]) == 2


def test_each_node_names_the_link_that_applied_it():
    """Node.link: the innermost running Link's namedlinks() path, '/' for
    the model's own forward; a Link outside the model by its caller's path
    and its class; '' outside every Link."""
    g = capture(MLP(), np.ones((2, 4), np.float32), np.array([0, 1], np.int32))
    assert [n.link for n in g.nodes] == ["/l1", "/", "/l2", "/"]
    lin = L.Linear(3, 3)
    g = capture(lambda x: F.sum(lin(F.tanh(x))), np.ones((2, 3), np.float32))
    assert [n.link for n in g.nodes] == ["", "/Linear", ""]
    assert not chainer._get_link_hooks()


def test_nested_and_no_backprop_work_are_not_nodes():
    def f(x):
        with chainer.no_backprop_mode():
            mean = F.mean(x)  # a constant of the graph
        return F.sum(F.relu(x - mean))

    g = capture(f, chainer.Variable(np.arange(6, dtype=np.float32)))
    assert [n.op for n in g.nodes] == ["Sub", "ReLU", "Sum"]
    assert sorted(a.kind for a in g.arrays if a.producer is None) == ["input", "input"]


def test_graph_json_round_trip(tmp_path):
    g = capture(MLP(), np.ones((2, 4), np.float32), np.array([0, 1], np.int32), backward=True)
    assert all(n.backward_time_s is not None for n in g.nodes)
    cr.save_graph(g, tmp_path / "g.json")
    h = cr.load_graph(tmp_path / "g.json")
    assert h.arrays == g.arrays and h.nodes == g.nodes and h.batch_size == 2
    assert list(h.node_cost) == list(g.node_cost)


def test_batch_scaling_matches_capture_at_large_batch():
    model = ResBlock()
    small = capture(model, np.ones((2, 4, 5, 5), np.float32))
    large = capture(model, np.ones((6, 4, 5, 5), np.float32))
    scaled = small.scale_batch(6)
    assert [a.shape for a in scaled.arrays] == [a.shape for a in large.arrays]
    assert [a.nbytes for a in scaled.arrays] == [a.nbytes for a in large.arrays]
    assert list(scaled.node_bytes) == list(large.node_bytes)
    assert scaled.param_bytes == small.param_bytes
    assert [[(h.name, h.nbytes) for h in n.held] for n in scaled.nodes] == \
        [[(h.name, h.nbytes) for h in n.held] for n in large.nodes]


def test_backward_timing_restores_gradients():
    model = MLP()
    x, t = np.ones((2, 4), np.float32), np.array([0, 1], np.int32)
    model.cleargrads()
    model(x, t).backward()
    grads = {n: p.grad.copy() for n, p in model.namedparams()}
    capture(model, x * 3, t, backward=True)
    for n, p in model.namedparams():
        np.testing.assert_array_equal(p.grad, grads[n])


def test_unsafe_function_is_detected():
    class Noisy(chainer.FunctionNode):  # draws new noise at every forward
        def forward(self, inputs):
            return inputs[0] + np.random.rand(*inputs[0].shape).astype(np.float32),

        def backward(self, indexes, gy):
            return gy

    def f(x):
        return F.sum(Noisy().apply((F.relu(x),))[0])

    g = capture(f, chainer.Variable(np.ones((2, 2), np.float32)))
    assert [n.recomputable for n in g.nodes] == [True, False, True]
    assert "draws fresh randomness" in g.nodes[1].attrs["unsafe_reason"]


# ----------------------------------------------------------- bad input
def test_not_callable():
    with pytest.raises(CaptureError, match="callable"):
        capture(42, np.ones(3))


def test_returns_no_variable():
    # Any result is fine for the forward; a backward needs a Variable.
    g = capture(lambda x: F.relu(x).array, np.ones((2, 2), np.float32))
    assert [n.op for n in g.nodes] == ["ReLU"]
    with pytest.raises(CaptureError, match="holding no chainer.Variable"):
        capture(lambda x: F.relu(x).array, np.ones((2, 2), np.float32), backward=True)


class _Distribution:
    """What chainerrl's policies return: an object holding its Variable."""

    def __init__(self, logits):
        self.logits = logits


class _TwoHeads(chainer.Chain):
    """A policy and a value head, returned as (distribution, value), as
    chainerrl's ``Branched`` models are; a loss uses both."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.pi = L.Linear(4, 3)
            self.v = L.Linear(4, 1)

    def forward(self, x):
        return _Distribution(self.pi(x)), self.v(x)


@pytest.mark.parametrize("wrap", [lambda d, v: (d, v), lambda d, v: {"v": v, "pi": d.logits},
                                  lambda d, v: [v, d]], ids=["object-first", "dict", "list"])
def test_backward_from_every_output(wrap):
    """A backward runs from every Variable of the result, in tuples, lists,
    dicts and objects' attributes: each head's function is backpropagated
    (only the first Variable was, so the policy head's backward was in no
    capture)."""
    model = _TwoHeads()
    g = capture(lambda x: wrap(*model(x)), np.ones((2, 4), np.float32), link=model,
                backward=True)
    assert sorted(n.op for n in g.nodes) == ["LinearFunction", "LinearFunction"]
    assert all(n.backward_time_s is not None for n in g.nodes), \
        [(n.op, n.backward_time_s) for n in g.nodes]


def test_no_function_applied():
    with pytest.raises(CaptureError, match="no Chainer function"):
        capture(lambda x: x, chainer.Variable(np.ones((2, 2), np.float32)))


def test_forward_that_raises_leaves_no_hook():
    class Broken(chainer.FunctionNode):
        def forward(self, inputs):
            raise FloatingPointError("boom")

    def bad(x):
        return Broken().apply((F.relu(x),))[0]

    with pytest.raises(FloatingPointError, match="boom") as info:
        capture(bad, chainer.Variable(np.ones((2, 3), np.float32)))
    assert any("Broken" in note for note in getattr(info.value, "__notes__", []))
    assert not chainer.get_function_hooks() and not chainer._get_link_hooks()
    # and the functions that ran keep no instance-level wrapper
    h = F.relu(np.ones(2, np.float32))
    assert "forward" not in vars(h.creator)


def test_type_error_before_forward_propagates_unchanged():
    def bad(x):
        return F.matmul(F.relu(x), np.ones((5, 5), np.float32))  # shape mismatch

    with pytest.raises(chainer.utils.type_check.InvalidType) as info:
        capture(bad, np.ones((2, 3), np.float32))
    assert any("after 1 functions (last: ReLU)" in n for n in info.value.__notes__)
    assert not chainer.get_function_hooks()


def test_resnet50_at_a_small_input():
    model = L.ResNet50Layers(pretrained_model=None)
    x = np.zeros((1, 3, 64, 64), np.float32)
    g = capture(lambda x: F.sum(model(x, layers=["fc6"])["fc6"]), x, link=model)
    ops = {}
    for n in g.nodes:
        ops[n.op] = ops.get(n.op, 0) + 1
    assert ops["Convolution2DFunction"] == 53 and ops["BatchNormalization"] == 53
    assert ops["Add"] == 16 and ops["ReLU"] == 49
    assert g.param_bytes == sum(p.array.nbytes for p in model.params())
    assert g.retained_bytes < g.activation_bytes
    assert "nodes" in g.summary()


def test_where_condition_is_state_even_when_all_false():
    """F.where keeps its condition as an attribute set in __init__, not made
    by forward: a rerun without it gives the same outputs when the condition
    is all False (a shifted softplus), yet it is state, not derived."""
    def f(x):
        a = x * 2
        return F.sum(F.where(a.array > 20, a, F.softplus(a)))

    g = capture(f, chainer.Variable(np.ones((3, 8), np.float32)))
    where = next(n for n in g.nodes if n.op == "Where")
    held = {h.name: h.role for h in where.held}
    assert held.get("condition", "state") == "state"
