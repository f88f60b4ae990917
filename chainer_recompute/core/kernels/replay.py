"""The replay of :mod:`~chainer_recompute.core.replay` as one compiled loop
over flat arrays (numba), for large graphs.

Pure core: numpy only (numba compiles the loop; :mod:`chainer_recompute.core.replay`
picks the engine through :func:`~chainer_recompute.core.kernels.pick_engine`).

It follows the reference replay (``replay(..., engine='python')``) event
by event and gives the same total at every event (the tests compare the
two timelines): the holders of a buffer are kept as one bit per (array,
reason) and a count per buffer, attribute arrays as one flag per
(node, name), and the gradients, which do not depend on the plan, as three
levels per backward step computed once per graph (:class:`ReplayContext`).
Graphs recorded on CuPy (whose pool model depends on the order of every
allocation) are replayed by the reference replay only.
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..execution import backward_readers, releasable_nodes
from ..graph import RNG_STATE_BYTES, Graph
from . import compiled

__all__ = ["ReplayContext", "context_of", "run_kernel"]

#: event kinds of the kernel's timeline
FORWARD, END, REGENERATE, BACKWARD, UPDATE, UNRECORDED = 0, 1, 2, 3, 4, 5
#: release modes, as :data:`~chainer_recompute.core.replay.RELEASE_MODES`
MODES = {"none": 0, "checkpoints": 1, "all": 2}


def _csr(lists: Sequence[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(lists) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists])
    flat = np.fromiter((v for x in lists for v in x), dtype=np.int64, count=int(ptr[-1]))
    return ptr, flat


class _Level:
    """A running total, for the gradients' pass (the reference replay's
    ``_Memory`` without buffers)."""

    def __init__(self) -> None:
        self.level = 0

    def alloc(self, key: Any, nbytes: int) -> None:
        self.level += nbytes

    def free(self, key: Any, nbytes: int, whole: bool = True) -> None:
        self.level -= nbytes


class ReplayContext:
    """What the replay of one graph needs that no plan changes, as flat
    arrays (made once per graph, see :func:`context_of`)."""

    def __init__(self, graph: Graph, helpers: Any) -> None:
        # the reference replay's own pieces (passed in: core.replay imports
        # this module)
        _Gradients, _caller_input = helpers._Gradients, helpers._caller_input
        param_grad_bytes = helpers.param_grad_bytes
        state_constant_bytes = helpers.state_constant_bytes
        # (weakly: the cache below keeps a context only while its graph lives)
        self._graph = weakref.ref(graph)
        arrays, nodes, n = graph.arrays, graph.nodes, graph.n
        self.n = n
        i64 = np.int64
        self.owner = np.array([a.id if a.view_of is None else a.view_of for a in arrays],
                              dtype=i64)
        self.owned = np.array([a.owned_bytes for a in arrays], dtype=i64)
        self.nbytes = np.array([a.nbytes for a in arrays], dtype=i64)
        pc = np.array([a.kind == "param" or _caller_input(a) for a in arrays], dtype=np.bool_)
        self.pc = pc
        self.constown = pc[self.owner] if len(arrays) else pc
        self.producer = np.array([-1 if a.producer is None else a.producer for a in arrays],
                                 dtype=i64)
        self.dies_at = np.array([-1 if a.dies_at is None else a.dies_at for a in arrays],
                                dtype=i64)
        retby = np.zeros(len(arrays), dtype=np.bool_)
        for node in nodes:
            for a in node.retained_inputs:
                retby[a] = True
            for a in node.retained_outputs:
                retby[a] = True
        self.retby = retby
        self.in_p, self.in_i = _csr([node.inputs for node in nodes])
        self.out_p, self.out_i = _csr([node.outputs for node in nodes])
        self.rout_p, self.rout_i = _csr([node.retained_outputs for node in nodes])
        self.rin_p, self.rin_i = _csr([node.retained_inputs for node in nodes])
        dies_at, made_at, temporaries = helpers.lifetimes(graph)
        # positions 0..n+1 (n + 1: after the unrecorded work after the last node)
        self.dies_p, self.dies_i = _csr([dies_at.get(i, ()) for i in range(n + 2)])
        self.made_p, self.made_i = _csr([made_at.get(i, ()) for i in range(n + 1)])
        self.tmp_p, self.tmp_i = _csr([temporaries.get(v, ()) for v in range(n)])
        self.unrec = np.array(helpers.unrecorded_peaks(graph), dtype=i64)
        self._unrecorded_label = helpers.unrecorded_label
        self._fixed: Optional[Tuple[List[str], List[str], List[str]]] = None
        keys: Dict[Tuple[int, str], int] = {}
        held: List[List[int]] = []
        nb: List[int] = []
        der: List[bool] = []
        red: List[bool] = []
        owner_node: List[int] = []
        for node in nodes:
            row = []
            for h in node.held:
                if h.role == "written":
                    continue
                row.append(keys.setdefault((node.id, h.name), len(keys)))
                nb.append(int(h.nbytes))
                der.append(h.remade)
                red.append(h.redrawn)
                owner_node.append(node.id)
            held.append(row)
        self.held_p, self.held_key = _csr(held)
        self.held_nb = np.array(nb, dtype=i64)
        self.held_der = np.array(der, dtype=np.bool_)
        #: per held entry: drawn from the random state (its node's) and the node
        self.held_red = np.array(red, dtype=np.bool_)
        self.held_node = np.array(owner_node, dtype=i64)
        self.n_keys = len(keys)
        self.ftr = np.array([n_.forward_transient_bytes or 0 for n_ in nodes], dtype=i64)
        # what ExecutionPlan finds for every plan of this graph
        derived = {node.id: tuple(h.name for h in node.held if h.remade) for node in nodes}
        #: the nodes whose released attributes a random state replaces
        #: (``HeldArray.redrawn``)
        self.redrawn = np.array([any(h.redrawn for h in node.held) for node in nodes],
                                dtype=np.bool_)
        rel = releasable_nodes(graph)
        self.releasable = np.zeros(n, dtype=np.bool_)
        self.releasable[list(rel)] = True
        needs, done = backward_readers(graph, rel, derived)
        self.needs_p, self.needs_i = _csr([needs[v] for v in range(n)])
        self.done_p, self.done_i = _csr([done[v] for v in range(n)])
        self.last = np.array([max(s, default=v) for v, s in enumerate(graph.succs)], dtype=i64)
        self.constant = state_constant_bytes(graph)
        self.old_grads = param_grad_bytes(graph) if graph.step.grads_in_forward \
            else 0
        # let go before the backward, or (step.grads_in_backward) at each
        # parameter's first backward reader, in the gradients' levels below
        alive = graph.step.grads_in_backward
        self.old_grads_at_backward = 0 if alive else self.old_grads
        self.free_all = helpers.graph_gone_at_update(graph)
        self.update_transient = helpers.update_bytes(graph)
        self.held_into_next = bool(graph.step.held_into_next_forward)
        self.held_inputs = helpers.held_caller_input_bytes(graph) if self.held_into_next else 0
        self.held_through_forward = helpers.held_through_forward
        self.outside_peak, self.outside_held = helpers.outside_bytes(graph)
        # the gradients: the same for every plan
        order = helpers.backward_steps(graph)
        self.order = np.array(order, dtype=i64)
        lv = _Level()
        grads = _Gradients(lv)  # type: ignore[arg-type]
        made: set = set()
        g_rec, g_extra, g_after = [], [], []
        old = self.old_grads if alive else 0
        # a step of several calls (core.replay.per_step): the parameters'
        # gradients (the new ones and the old ones left) before and at each
        # backward step, and what the calls' meeting at its parameters adds
        p_before, p_rec, acc = [], [], []
        param = 0
        for w in order:
            node = nodes[w]
            param_new, extra = helpers.backward_gradients(node, arrays, nodes, grads, made,
                                                          alive)
            p_before.append(param + old)
            param += param_new
            lv.alloc(None, param_new)
            g_rec.append(lv.level)
            g_extra.append(int(extra))
            p_rec.append(param + old)
            acc.append(helpers.accumulation_bytes(node, arrays))
            old = helpers.old_grads_left(lv, param_new, old)
            grads.drop(node.outputs)
            g_after.append(lv.level)
        self.g_rec = np.array(g_rec, dtype=i64)
        self.g_extra = np.array(g_extra, dtype=i64)
        self.g_after = np.array(g_after, dtype=i64)
        self.k = helpers.step_calls(graph)
        self.p_before = np.array(p_before, dtype=i64)
        self.p_rec = np.array(p_rec, dtype=i64)
        self.p_end = param + old
        self.acc = np.array(acc, dtype=i64)
        self.step_of = np.zeros(n, dtype=i64)
        self.step_of[self.order] = np.arange(len(order))

    def once_and_acc(self, kinds: np.ndarray, us: np.ndarray, ws: np.ndarray
                     ) -> Tuple[np.ndarray, np.ndarray]:
        """By event, what a step of several calls holds once and what
        their backward passes' meeting adds
        (:func:`~chainer_recompute.core.replay.per_step`), as the reference
        replay's ``_Memory`` has them."""
        once = np.full(kinds.shape[0], self.old_grads, dtype=np.int64)  # (the forward)
        acc = np.zeros(kinds.shape[0], dtype=np.int64)
        bw = kinds == BACKWARD
        once[bw] = self.p_rec[self.step_of[us[bw]]]
        acc[bw] = self.acc[self.step_of[us[bw]]]
        rg = kinds == REGENERATE
        once[rg] = self.p_before[self.step_of[ws[rg]]]
        once[kinds == UPDATE] = self.p_end + self.update_transient
        return once, acc

    @property
    def graph(self) -> Graph:
        """The graph (alive while its context is used: see :func:`context_of`)."""
        return self._graph()

    def labels(self, kind: np.ndarray, u: np.ndarray, w: np.ndarray) -> Tuple[str, ...]:
        """The reference replay's event labels for the kernel's events (the
        forward's and the backward's, the same in every plan, made once)."""
        if self._fixed is None:
            ops = [node.op for node in self.graph.nodes]
            self._fixed = ([f"forward {a} {op}" for a, op in enumerate(ops)],
                           [f"backward {a} {op}" for a, op in enumerate(ops)], ops)
        forward, backward, ops = self._fixed
        out = []
        for k, a, b in zip(kind.tolist(), u.tolist(), w.tolist()):
            if k == FORWARD:
                out.append(forward[a])
            elif k == BACKWARD:
                out.append(backward[a])
            elif k == REGENERATE:
                out.append(f"regenerate {a} {ops[a]} for backward {b}")
            elif k == UNRECORDED:
                out.append(self._unrecorded_label(self.graph, a))
            else:
                out.append("end of forward" if k == END else "update")
        return tuple(out)


_CONTEXTS: List[Tuple[Any, ReplayContext]] = []


def context_of(graph: Graph, helpers: Any) -> ReplayContext:
    """The :class:`ReplayContext` of ``graph`` (the last few made are kept
    while their graphs live); ``helpers``: the module
    :mod:`~chainer_recompute.core.replay`."""
    for ref, ctx in _CONTEXTS:
        if ref() is graph:
            return ctx
    ctx = ReplayContext(graph, helpers)
    del _CONTEXTS[3:]
    _CONTEXTS.insert(0, (weakref.ref(graph, _forget), ctx))
    return ctx


def _forget(ref: Any) -> None:
    """A graph died: its context goes with it."""
    _CONTEXTS[:] = [(r, c) for r, c in _CONTEXTS if r is not ref]


def _kernel() -> Any:
    return compiled(sys.modules[__name__], "_replay_loop",
                    helpers=("_event", "_attr_hold", "_hold", "_drop", "_remake", "_release",
                             "_regenerable", "_keeps"))


def nesting_of(ctx: ReplayContext, plan: Any) -> Tuple[np.ndarray, ...]:
    """What the kernel reads of a nested
    :class:`~chainer_recompute.core.execution.ExecutionPlan` beyond its
    dropped nodes and blocks: its ``done`` (in CSR), its inner checkpoints
    (bool per node), its source arrays (bool per array), its boundary
    levels, and each inner node's span (``-1`` where it has none)."""
    n = ctx.n
    done_p, done_i = _csr([plan.done.get(v, ()) for v in range(n)])
    inner = np.zeros(n, dtype=np.bool_)
    inner[list(plan.inner)] = True
    sources = np.zeros(ctx.owner.shape[0], dtype=np.bool_)
    sources[list(plan.source_arrays)] = True
    span_lo = np.full(n, -1, dtype=np.int64)
    span_hi = np.full(n, -1, dtype=np.int64)
    for u, (lo, hi) in plan.spans.items():
        span_lo[u], span_hi[u] = lo, hi
    return (done_p, done_i, inner, sources, np.asarray(plan.levels, dtype=np.int64),
            span_lo, span_hi)


def run_kernel(ctx: ReplayContext, dropped: Optional[np.ndarray], block_of: Optional[np.ndarray],
               release_mode: str = "none", nesting: Optional[Tuple[np.ndarray, ...]] = None
               ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """The timeline of one iteration: totals, event kinds, event nodes
    (``u``, and ``w`` for a regeneration) and the number of regenerated
    nodes. ``dropped`` (bool per node) and ``block_of`` (each node's
    block): the plan, ``None`` for plain Chainer; ``nesting``: a nested
    plan's :func:`nesting_of`."""
    has_plan = dropped is not None
    n = ctx.n
    if not has_plan:
        dropped = np.zeros(n, dtype=np.bool_)
        block_of = np.zeros(n, dtype=np.int64)
    c = ctx
    nested = nesting is not None
    if nested:
        done_p, done_i, inner, sources, levels, span_lo, span_hi = nesting
    else:
        done_p, done_i = c.done_p, c.done_i
        inner = sources = np.zeros(0, dtype=np.bool_)
        levels = span_lo = span_hi = np.zeros(0, dtype=np.int64)
    # the attributes a release lets go: the remade ones, but a drawn one
    # of a node the plan keeps (the executor keeps no random state for it:
    # released with its node after its last backward reader, it keeps the
    # draw; runtime/executor.py's _remade)
    held_rel = (c.held_der & ~(c.held_red & ~np.asarray(dropped, dtype=np.bool_)[c.held_node])
                if has_plan else c.held_der)
    trace, kinds, us, ws, recomputed, held_end = _kernel()(
        n, c.owner, c.owned, c.nbytes, c.pc, c.constown, c.producer, c.dies_at, c.retby,
        c.in_p, c.in_i, c.out_p, c.out_i, c.rout_p, c.rout_i, c.rin_p, c.rin_i,
        c.dies_p, c.dies_i, c.made_p, c.made_i, c.unrec, c.tmp_p, c.tmp_i, c.held_p,
        c.held_key, c.held_nb, held_rel,
        c.n_keys, c.ftr, c.order, c.g_rec, c.g_extra, c.g_after, c.releasable,
        c.needs_p, c.needs_i, done_p, done_i, c.last, c.constant, c.old_grads,
        c.old_grads_at_backward,
        c.free_all, c.update_transient, c.outside_peak, c.outside_held, has_plan,
        np.asarray(dropped, dtype=np.bool_),
        np.asarray(block_of, dtype=np.int64), MODES[release_mode],
        nested, inner, sources, levels, span_lo, span_hi)
    # the random states the executor keeps for the drawn attributes the plan
    # releases (HeldArray.redrawn), one per node, over the whole iteration
    # (a bound, a few KB each), as replay() counts them; a graph held into
    # the next call holds its own too
    states = (RNG_STATE_BYTES * int(np.count_nonzero(c.redrawn & np.asarray(dropped)))
              if has_plan else 0)
    trace = trace + states
    # an earlier call's graph, through this forward
    held = c.held_through_forward(c.graph, held_end + c.held_inputs + states
                                  if c.held_into_next else 0)
    if held:
        trace[:int(np.argmax(kinds == END)) + 1] += held
    return trace, kinds, us, ws, recomputed


def _replay_loop(n, owner, owned, nbytes, pc, constown, producer, dies_at, retby,
                 in_p, in_i, out_p, out_i, rout_p, rout_i, rin_p, rin_i,
                 dies_p, dies_i, made_p, made_i, unrec, tmp_p, tmp_i, held_p, held_key,
                 held_nb, held_der,
                 n_keys, ftr, order, g_rec, g_extra, g_after, releasable,
                 needs_p, needs_i, done_p, done_i, last, constant, old_grads,
                 old_grads_at_backward,
                 free_all, update_transient, outside_peak, outside_held, has_plan, dropped,
                 block_of, mode, nested, inner, sources, levels, span_lo, span_hi):
    VAR, RET, PIN, VAL = 1, 2, 4, 8
    n_arrays = owner.shape[0]
    reasons = np.zeros(n_arrays, dtype=np.uint8)
    # two buffers per owner: its own and, made again by a regeneration
    # while views of the old one are held, a second (the reference
    # replay's ``_Memory.remake``)
    count = np.zeros(2 * n_arrays, dtype=np.int64)
    cur = owner.copy()
    owned2 = np.concatenate((owned, owned))
    nbytes2 = np.concatenate((nbytes, nbytes))
    attr_on = np.zeros(n_keys, dtype=np.bool_)
    attr_nb = np.zeros(n_keys, dtype=np.int64)
    released = np.zeros(n, dtype=np.bool_)
    cap = 4 * n + 16
    trace = np.empty(cap, dtype=np.int64)
    kinds = np.empty(cap, dtype=np.int8)
    ev_u = np.empty(cap, dtype=np.int64)
    ev_w = np.empty(cap, dtype=np.int64)
    ne = 0
    level = constant + old_grads

    # the plan's releases (dropped nodes after their last forward reader)
    # and each block's dropped nodes, by counting
    rel_p = np.zeros(n + 2, dtype=np.int64)
    nblk = 0
    for u in range(n):
        if block_of[u] + 1 > nblk:
            nblk = block_of[u] + 1
    bn_p = np.zeros(nblk + 1, dtype=np.int64)
    if has_plan:
        for u in range(n):
            if dropped[u]:
                rel_p[last[u] + 2] += 1
                bn_p[block_of[u] + 1] += 1
    for i in range(n + 1):
        rel_p[i + 1] += rel_p[i]
    for b in range(nblk):
        bn_p[b + 1] += bn_p[b]
    rel_i = np.empty(rel_p[n + 1], dtype=np.int64)
    bn_i = np.empty(bn_p[nblk], dtype=np.int64)
    fill_r = rel_p[:n + 1].copy()
    fill_b = bn_p[:nblk].copy()
    if has_plan:
        for u in range(n):
            if dropped[u]:
                pos = last[u] + 1
                rel_i[fill_r[pos]] = u
                fill_r[pos] += 1
                rel_i_b = block_of[u]
                bn_i[fill_b[rel_i_b]] = u
                fill_b[rel_i_b] += 1

    # ------------------------------------------------------------ forward
    for i in range(n):
        for k in range(dies_p[i], dies_p[i + 1]):
            level += _drop(dies_i[k], VAR, reasons, count, cur, owned2)
        if unrec[i] > 0:
            trace, kinds, ev_u, ev_w, cap, ne = _event(
                trace, kinds, ev_u, ev_w, cap, ne, level + unrec[i], 5, i, -1)
        for k in range(made_p[i], made_p[i + 1]):
            level += _hold(made_i[k], VAR, reasons, count, cur, owned2, constown)
        if has_plan:
            for k in range(rel_p[i], rel_p[i + 1]):
                level += _release(rel_i[k], out_p, out_i, held_p, held_key, held_der, reasons,
                                  count, cur, owned2, attr_on, attr_nb, released)
        for k in range(tmp_p[i], tmp_p[i + 1]):
            level += _hold(tmp_i[k], VAR, reasons, count, cur, owned2, constown)
        if has_plan and dropped[i]:
            for k in range(in_p[i], in_p[i + 1]):
                a = in_i[k]
                p = producer[a]
                if (p < 0 or not dropped[p]) and not pc[a]:
                    level += _hold(a, PIN, reasons, count, cur, owned2, constown)
        for k in range(out_p[i], out_p[i + 1]):
            level += _hold(out_i[k], VAR, reasons, count, cur, owned2, constown)
        for k in range(rout_p[i], rout_p[i + 1]):
            level += _hold(rout_i[k], RET, reasons, count, cur, owned2, constown)
        for k in range(rin_p[i], rin_p[i + 1]):
            a = rin_i[k]
            if not pc[a]:
                level += _hold(a, RET, reasons, count, cur, owned2, constown)
        for k in range(held_p[i], held_p[i + 1]):
            level += _attr_hold(held_key[k], held_nb[k], attr_on, attr_nb)
        trace, kinds, ev_u, ev_w, cap, ne = _event(
            trace, kinds, ev_u, ev_w, cap, ne, level + ftr[i], 0, i, -1)
        for k in range(tmp_p[i], tmp_p[i + 1]):
            level += _drop(tmp_i[k], VAR, reasons, count, cur, owned2)
        for k in range(out_p[i], out_p[i + 1]):
            a = out_i[k]
            if dies_at[a] >= 0 and dies_at[a] <= i + 1:
                level += _drop(a, VAR, reasons, count, cur, owned2)
    for k in range(dies_p[n], dies_p[n + 1]):
        level += _drop(dies_i[k], VAR, reasons, count, cur, owned2)
    if unrec[n] > 0:
        trace, kinds, ev_u, ev_w, cap, ne = _event(
            trace, kinds, ev_u, ev_w, cap, ne, level + unrec[n], 5, n, -1)
    for k in range(made_p[n], made_p[n + 1]):
        level += _hold(made_i[k], VAR, reasons, count, cur, owned2, constown)
    for k in range(dies_p[n + 1], dies_p[n + 2]):
        level += _drop(dies_i[k], VAR, reasons, count, cur, owned2)
    if has_plan:
        for k in range(rel_p[n], rel_p[n + 1]):
            level += _release(rel_i[k], out_p, out_i, held_p, held_key, held_der, reasons,
                              count, cur, owned2, attr_on, attr_nb, released)
    trace, kinds, ev_u, ev_w, cap, ne = _event(
        trace, kinds, ev_u, ev_w, cap, ne, level + outside_peak, 1, -1, -1)
    level -= old_grads_at_backward
    level += outside_held

    # ----------------------------------------------------------- backward
    remaining = np.zeros(n, dtype=np.int64)
    if has_plan:
        for s in range(order.shape[0]):
            w = order[s]
            for k in range(done_p[w], done_p[w + 1]):
                remaining[done_i[k]] += 1
    regen = np.full(n, -1, dtype=np.int8)  # regenerable: -1 unknown, 0 no, 1 yes
    stack_v = np.empty(n + 1, dtype=np.int64)
    stack_k = np.empty(n + 1, dtype=np.int64)
    dfs = np.empty(in_i.shape[0] + n + 1, dtype=np.int64)
    wmark = np.zeros(n, dtype=np.int64)
    omark = np.zeros(n, dtype=np.int64)
    bmark = np.zeros(max(nblk, 1), dtype=np.int64)
    vmark = np.zeros(n_arrays, dtype=np.int64)
    nodes_buf = np.empty(n + 1, dtype=np.int64)
    values = np.empty(n_arrays + 1, dtype=np.int64)
    targets = np.empty(n + 1, dtype=np.int64)
    # (nested) the arrays a regeneration makes, and the step of its last
    # reader among the regeneration's steps
    mmark = np.zeros(n_arrays if nested else 0, dtype=np.int64)
    lastr = np.zeros(n_arrays if nested else 0, dtype=np.int64)
    stamp = 0
    recomputed = 0
    grad = 0
    for s in range(order.shape[0]):
        w = order[s]
        if has_plan:
            nt = 0
            for k in range(needs_p[w], needs_p[w + 1]):
                u = needs_i[k]
                if released[u]:
                    targets[nt] = u
                    nt += 1
            if nt > 0:
                stamp += 1
                # the wanted nodes: the targets, and the released nodes of
                # their blocks that a remaining backward reads
                nw = 0
                for t in range(nt):
                    u = targets[t]
                    if wmark[u] != stamp:
                        wmark[u] = stamp
                        dfs[nw] = u
                        nw += 1
                for t in range(nt):
                    b = block_of[targets[t]]
                    if bmark[b] != stamp:
                        bmark[b] = stamp
                        for k in range(bn_p[b], bn_p[b + 1]):
                            v = bn_i[k]
                            if released[v] and remaining[v] > 0 and wmark[v] != stamp:
                                wmark[v] = stamp
                                dfs[nw] = v
                                nw += 1
                # what they need: producers of inputs that are not alive
                no = 0
                sp = nw
                while sp > 0:
                    sp -= 1
                    u = dfs[sp]
                    if omark[u] == stamp:
                        continue
                    omark[u] = stamp
                    nodes_buf[no] = u
                    no += 1
                    for k in range(in_p[u], in_p[u + 1]):
                        a = in_i[k]
                        p = producer[a]
                        if p >= 0 and not (pc[a] or constown[a] or reasons[a] != 0):
                            dfs[sp] = p
                            sp += 1
                todo = np.sort(nodes_buf[:no])
                if nested:  # core.execution.regeneration_frees
                    for t in range(no):
                        u = todo[t]
                        for k in range(out_p[u], out_p[u + 1]):
                            mmark[out_i[k]] = stamp
                    for t in range(no):
                        u = todo[t]
                        for k in range(in_p[u], in_p[u + 1]):
                            if mmark[in_i[k]] == stamp:
                                lastr[in_i[k]] = t
                nv = 0
                for t in range(no):
                    u = todo[t]
                    for k in range(out_p[u], out_p[u + 1]):
                        a = out_i[k]
                        _remake(a, reasons, count, owner, cur, constown, n_arrays)
                        level += _hold(a, VAL, reasons, count, cur, owned2, constown)
                        if vmark[a] != stamp:
                            vmark[a] = stamp
                            values[nv] = a
                            nv += 1
                    for k in range(held_p[u], held_p[u + 1]):
                        if held_der[k]:
                            level += _attr_hold(held_key[k], held_nb[k], attr_on, attr_nb)
                    trace, kinds, ev_u, ev_w, cap, ne = _event(
                        trace, kinds, ev_u, ev_w, cap, ne, level + grad + ftr[u], 2, u, w)
                    recomputed += 1
                    if released[u] and (wmark[u] == stamp or (
                            nested and inner[u] and remaining[u] > 0
                            and _keeps(u, block_of[w], span_lo, span_hi, levels))):
                        released[u] = False
                        for k in range(out_p[u], out_p[u + 1]):
                            a = out_i[k]
                            if retby[a]:
                                level += _hold(a, RET, reasons, count, cur, owned2, constown)
                            if nested and sources[a]:
                                level += _hold(a, PIN, reasons, count, cur, owned2, constown)
                    else:
                        for k in range(held_p[u], held_p[u + 1]):
                            if held_der[k]:
                                key = held_key[k]
                                if attr_on[key]:
                                    attr_on[key] = False
                                    level -= attr_nb[key]
                    if nested:  # the values read no more in this regeneration
                        for k in range(in_p[u], in_p[u + 1]):
                            a = in_i[k]
                            if mmark[a] == stamp and lastr[a] == t:
                                level += _drop(a, VAL, reasons, count, cur, owned2)
                for t in range(nv):
                    level += _drop(values[t], VAL, reasons, count, cur, owned2)
        trace, kinds, ev_u, ev_w, cap, ne = _event(
            trace, kinds, ev_u, ev_w, cap, ne, level + g_rec[s] + g_extra[s], 3, w, -1)
        grad = g_after[s]
        if has_plan:
            for k in range(done_p[w], done_p[w + 1]):
                remaining[done_i[k]] -= 1
            if mode != 2:
                for k in range(done_p[w], done_p[w + 1]):
                    u = done_i[k]
                    if (remaining[u] <= 0 and releasable[u] and not released[u]
                            and (mode == 0 or dropped[u])
                            and _regenerable(u, regen, stack_v, stack_k, in_p, in_i, producer,
                                             pc, constown, reasons)):
                        level += _release(u, out_p, out_i, held_p, held_key, held_der, reasons,
                                          count, cur, owned2, attr_on, attr_nb, released)
    # what the graph still holds after its backward (a graph held into the
    # next call holds it through that call's forward)
    held_end = 0
    for b in range(2 * n_arrays):
        if count[b] > 0:
            held_end += nbytes2[b]
    for key in range(n_keys):
        if attr_on[key]:
            held_end += attr_nb[key]
    # the optimizer update
    if free_all:
        for b in range(2 * n_arrays):
            if count[b] > 0:
                level -= nbytes2[b]
                count[b] = 0
        for a in range(n_arrays):
            reasons[a] = 0
        for key in range(n_keys):
            if attr_on[key]:
                attr_on[key] = False
                level -= attr_nb[key]
    trace, kinds, ev_u, ev_w, cap, ne = _event(
        trace, kinds, ev_u, ev_w, cap, ne, level + grad + update_transient, 4, -1, -1)
    return trace[:ne], kinds[:ne], ev_u[:ne], ev_w[:ne], recomputed, held_end


def _event(trace, kinds, ev_u, ev_w, cap, ne, total, kind, u, w):
    """Append the event (``total`` bytes, ``kind``, nodes ``u``, ``w``) to the
    timeline, doubling its arrays when full; returns them, their capacity
    and the new count."""
    if ne == cap:
        cap *= 2
        t2 = np.empty(cap, dtype=np.int64)
        k2 = np.empty(cap, dtype=np.int8)
        u2 = np.empty(cap, dtype=np.int64)
        w2 = np.empty(cap, dtype=np.int64)
        t2[:ne] = trace
        k2[:ne] = kinds
        u2[:ne] = ev_u
        w2[:ne] = ev_w
        trace, kinds, ev_u, ev_w = t2, k2, u2, w2
    trace[ne] = total
    kinds[ne] = kind
    ev_u[ne] = u
    ev_w[ne] = w
    return trace, kinds, ev_u, ev_w, cap, ne + 1


def _attr_hold(key, nb, attr_on, attr_nb):
    """An attribute array comes alive (if it was not): the bytes added."""
    if attr_on[key]:
        return 0
    attr_on[key] = True
    attr_nb[key] = nb
    return nb


def _hold(a, bit, reasons, count, buf_of, buf_bytes, constown):
    if constown[a] or reasons[a] & bit:
        return 0
    reasons[a] |= bit
    buf = buf_of[a]
    count[buf] += 1
    if count[buf] == 1:
        return buf_bytes[buf]
    return 0


def _remake(a, reasons, count, owner, cur, constown, n_arrays):
    """As the reference replay's ``_Memory.remake``."""
    r = owner[a]
    if constown[a] or reasons[a] != 0:
        return
    if r != a:
        cur[a] = cur[r]
    elif count[cur[a]] > 0:
        other = a + n_arrays if cur[a] == a else a
        if count[other] == 0:
            cur[a] = other


def _drop(a, bit, reasons, count, buf_of, buf_bytes):
    if not reasons[a] & bit:
        return 0
    reasons[a] &= ~bit
    buf = buf_of[a]
    count[buf] -= 1
    if count[buf] == 0:
        return -buf_bytes[buf]
    return 0


def _release(u, out_p, out_i, held_p, held_key, held_der, reasons, count, buf_of, buf_bytes,
             attr_on, attr_nb, released):
    d = 0
    for k in range(out_p[u], out_p[u + 1]):
        a = out_i[k]
        d += _drop(a, 2, reasons, count, buf_of, buf_bytes)
        d += _drop(a, 4, reasons, count, buf_of, buf_bytes)
    for k in range(held_p[u], held_p[u + 1]):
        if held_der[k]:
            key = held_key[k]
            if attr_on[key]:
                attr_on[key] = False
                d -= attr_nb[key]
    released[u] = True
    return d


def _regenerable(u, regen, stack_v, stack_k, in_p, in_i, producer, pc, constown, reasons):
    """As the reference replay's ``regenerable``: decided once per node,
    depth first over the producers of inputs that are not alive."""
    if regen[u] >= 0:
        return regen[u] == 1
    regen[u] = 1  # provisional, against cycles
    sp = 0
    stack_v[0] = u
    stack_k[0] = 0
    sp = 1
    while sp > 0:
        v = stack_v[sp - 1]
        idx = stack_k[sp - 1]
        ok = True
        pushed = False
        while idx < in_p[v + 1] - in_p[v]:
            a = in_i[in_p[v] + idx]
            if pc[a] or constown[a] or reasons[a] != 0:
                idx += 1
                continue
            p = producer[a]
            if p >= 0 and regen[p] < 0:
                regen[p] = 1  # provisional
                stack_k[sp - 1] = idx
                stack_v[sp] = p
                stack_k[sp] = 0
                sp += 1
                pushed = True
                break
            if p < 0 or regen[p] == 0:
                ok = False
                break
            idx += 1
        if pushed:
            continue
        regen[v] = 1 if ok else 0
        sp -= 1
    return regen[u] == 1


def _keeps(u, t, span_lo, span_hi, levels):
    """As :meth:`~chainer_recompute.core.execution.ExecutionPlan.keeps`:
    whether a boundary of the open segments below block ``t`` lies in inner
    node ``u``'s span (the open boundaries, from ``t - 1`` down, are those
    of a level at most every level seen since)."""
    lo = span_lo[u]
    if lo < 0:
        return False
    hi = min(span_hi[u], t - 1)
    low = 0
    b = t - 1
    first = True
    while b >= lo:
        if first or levels[b] <= low:
            if b <= hi:
                return True
            low = levels[b]
            first = False
        b -= 1
    return False
