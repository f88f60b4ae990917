"""Attributes a forward draws from NumPy's global random state (a dropout
mask, role ``drawn``): a plan releases them with their node and a
regeneration draws them again from the random state kept at the forward,
bit for bit, leaving the global state as plain Chainer leaves it."""
from __future__ import annotations

import chainer

import chainer_recompute.core.graph as graph_module
from chainer_recompute.core.budget import BudgetSearch
from chainer_recompute.runtime.capture import capture
from harness import assert_same_records
from test_step_budget import OPTIONS, DropoutNet, train, vector_batches


def dropout_masks(loss: chainer.Variable) -> list:
    """The masks of the Dropout functions of ``loss``'s graph, in any order
    (None where released)."""
    seen, out, todo = set(), [], [loss.creator_node]
    while todo:
        f = todo.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        if type(f).__name__ == "Dropout":
            out.append(f.mask)
        todo += [x.creator_node for x in f.inputs]
    return out


def test_the_masks_are_drawn_and_larger_ones_released():
    x, t = vector_batches(1, batch=32)[0]
    g = capture(DropoutNet(), x, t)
    masks = [h for n in g.nodes for h in n.held if n.op == "Dropout"]
    assert len(masks) == 6 and all(h.role == "drawn" and h.remade for h in masks)
    # kept instead when the random state would cost more than a mask
    small = capture(DropoutNet(), x[:2], t[:2])
    assert not any(h.remade for n in small.nodes for h in n.held if n.op == "Dropout")


def test_released_masks_lower_the_least_budget(monkeypatch):
    """The least budget with the masks drawn again is lower than with them
    kept (a random state larger than any mask)."""
    x, t = vector_batches(1, batch=32)[0]
    g = capture(DropoutNet(), x, t, backward=True)
    drawn = BudgetSearch(g, "approx").least_budget()
    monkeypatch.setattr(graph_module, "RNG_STATE_BYTES", 1 << 40)
    kept = BudgetSearch(g, "approx").least_budget()
    assert drawn < kept, (drawn, kept)


def test_bit_identical_with_the_masks_released_in_the_forward():
    """Five optimizer steps of plain Chainer and of ``apply()`` at the least
    budget: identical losses, gradients, parameters and global random
    state; in every planned call the forward released the six masks (they
    are None when it returns), and every step from the second is under its
    budget. (Nested plans release them too: tests/test_nested.py's residual
    CNN and Transformer, whose dropout masks are drawn.)"""
    batches = vector_batches(5, batch=32)
    plain = train(DropoutNet, batches, False)
    released = []

    def make():
        model = DropoutNet()
        forward = model.forward

        def spy(x, t):
            loss = forward(x, t)
            released.append(sum(m is None for m in dropout_masks(loss)))
            return loss
        model.forward = spy
        return model

    ours = train(make, batches, True, options=OPTIONS)
    assert_same_records(plain, ours)
    assert all(s["path"] == "planned" for s in ours.stats[1:])
    assert released[-len(batches):] == [6] * len(batches), released  # (captures come first)
    for k in range(1, len(batches)):
        assert ours.peaks[k] <= ours.stats[k]["budget"], (k, ours.peaks, ours.stats[k])
