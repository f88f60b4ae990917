"""Plain BPTT's peak in bytes as Chainer runs it: its backward order over
the whole unroll replayed on copies of one recorded step
(:func:`replay_plain`), and the whole step's peak (:func:`plain_peak_bytes`).

Pure core: numpy only. The order emulated is Chainer's (see
docs/chainer_internals.md).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple
from .byte_simulator import ByteSizes, CallBytes, simulate_bytes
from .schedules import Op, plain_schedule

@dataclasses.dataclass(frozen=True)
class StepFunction:
    """One function of a recorded step, for :func:`replay_plain`.

    Attributes:
        name: the function's label.
        inputs: variable indexes of its inputs, in order.
        outputs: variable indexes of its outputs.
        grads: per input, bytes of the new gradient buffer its backward
            makes (0: no gradient, or one that shares an output gradient).
        shares: per input, the position in ``outputs`` of the output whose
            gradient buffer its gradient is (or a view of), else -1.
        peak: the highest bytes above those live before its backward,
            while it runs.
    """

    name: str
    inputs: Tuple[int, ...]
    outputs: Tuple[int, ...]
    grads: Tuple[int, ...]
    shares: Tuple[int, ...]
    peak: int


@dataclasses.dataclass(frozen=True)
class StepGraph:
    """The graph of one step, recorded from a backward (see
    :func:`replay_plain`).

    Attributes:
        functions: in a topological order of the step.
        kinds: per variable: ``'state'`` (an input state, ``state_index``
            says which), ``'param'`` (a parameter, shared by all steps),
            ``'leaf'`` (another leaf: data, constants) or ``'inner'`` (made
            by a function of the step).
        state_index: per variable, which input state it is (-1 if none).
        creator: per variable, the index of the function that made it (-1
            for leaves).
        out_states: per entry of the state, the variable of the step's
            output state (-1: None).
        loss: the variable of the step's loss.
    """

    functions: Tuple[StepFunction, ...]
    kinds: Tuple[str, ...]
    state_index: Tuple[int, ...]
    creator: Tuple[int, ...]
    out_states: Tuple[int, ...]
    loss: int


def replay_plain(graph: StepGraph, forward_end_bytes: int, t: int, *,
                 grads_cleared: bool = True, state0_grads: bool = False) -> int:
    """Peak bytes of plain BPTT's ``backward()`` over ``t`` steps, as
    Chainer runs it, above the bytes live when the call started.

    Chainer keeps every step's graph until ``unchain_backward()``, and its
    backward pops functions by rank, highest first (ties: the first
    discovered), over the whole unroll: a function that does not depend on
    the recurrent state (an embedding, the input projection of the first
    layer) keeps its rank at every step and runs only at the very end, so
    the gradients of its outputs wait, one per step. This replays that
    order on ``t`` copies of the recorded step, with the summed loss
    (``loss = 0; loss += step_loss``) on top: gradient buffers are counted
    once however many variables share them, freed when the last one is
    consumed; a gradient arriving where one is waiting is summed into a
    new buffer; parameter gradients (and, with ``state0_grads``, the
    gradients of a start state that requires them) stay to the end.

    Args:
        graph: the recorded step.
        forward_end_bytes: bytes live when ``backward()`` starts, above the
            call's start (the forward pass's graphs and outputs).
        t: steps.
        grads_cleared: parameter gradients were cleared before the
            backward (else each parameter's first gradient is summed into
            the live one).
        state0_grads: the start state requires gradients (a state carried
            over from the previous iteration is a leaf that does).

    Returns:
        The peak of the backward pass (transients included).
    """
    import heapq

    nvar = len(graph.kinds)
    # global ids: a variable of step k is k * nvar + v; the start state,
    # parameters and the summed loss get ids past them
    base = t * nvar
    state0_ids = {}
    param_ids: Dict[int, int] = {}
    next_id = [base]

    def new_id() -> int:
        next_id[0] += 1
        return next_id[0] - 1

    def gid(k: int, v: int) -> int:
        if v < 0:
            return -1
        kind = graph.kinds[v]
        if kind == "param":
            if v not in param_ids:
                param_ids[v] = new_id()
            return param_ids[v]
        if kind == "state":
            j = graph.state_index[v]
            if k == 0:
                if not state0_grads:
                    return -1
                if j not in state0_ids:
                    state0_ids[j] = new_id()
                return state0_ids[j]
            prev = graph.out_states[j]
            if prev < 0:
                return -1
            return gid(k - 1, prev)
        return k * nvar + v

    # ranks: Chainer's FunctionNode.rank = max(input ranks), a variable's
    # rank is its creator's + 1 (leaves: 0)
    var_rank: Dict[int, int] = {}
    creator_of: Dict[int, Tuple[int, int]] = {}  # global var -> (step, function)
    fn_ranks: List[List[int]] = []
    for k in range(t):
        ranks = []
        for f_idx, f in enumerate(graph.functions):
            r = max((var_rank.get(gid(k, v), 0) for v in f.inputs), default=0)
            ranks.append(r)
            for v in f.outputs:
                g = gid(k, v)
                if g < 0:
                    continue
                var_rank[g] = r + 1
                creator_of[g] = (k, f_idx)
        fn_ranks.append(ranks)
    # the summed loss: S_0 = 0 + l_0 (AddConstant), S_k = S_{k-1} + l_k (Add)
    sum_out: List[int] = []
    sum_rank: List[int] = []
    prev_rank = None
    for k in range(t):
        lr = var_rank.get(gid(k, graph.loss), 0)
        r = lr if prev_rank is None else max(prev_rank, lr)
        sum_rank.append(r)
        sum_out.append(new_id())
        prev_rank = r + 1

    # gradient table: variable -> buffer; buffers: id -> [bytes, references]
    table: Dict[int, int] = {}
    buffers: Dict[int, List[int]] = {}
    level = forward_end_bytes
    peak = level

    def new_buffer(nbytes: int) -> int:
        nonlocal level
        b = new_id()
        buffers[b] = [nbytes, 0]
        level += nbytes
        return b

    def ref(b: int) -> None:
        buffers[b][1] += 1

    def unref(b: int) -> None:
        nonlocal level
        buf = buffers[b]
        buf[1] -= 1
        if buf[1] <= 0:
            level -= buf[0]
            del buffers[b]

    def give(var: int, b: Optional[int], nbytes: int) -> None:
        """Gradient buffer ``b`` (None: a new one of ``nbytes``) arrives at ``var``."""
        if b is None:
            b = new_buffer(nbytes)
        ref(b)
        old = table.get(var)
        if old is None and not grads_cleared and var in params:
            # the parameter's gradient from before: live already, held by the
            # parameter until the backward ends
            old = new_id()
            buffers[old] = [buffers[b][0], 2]
        if old is not None:  # summed into a new buffer
            size = max(buffers[old][0], buffers[b][0])
            s = new_buffer(size)
            ref(s)
            unref(old)
            unref(b)
            b = s
        table[var] = b

    params = set(param_ids.values())

    heap: List[Tuple[int, int, Tuple[str, int, int]]] = []
    seen: set = set()

    def add_cand(key: Tuple[str, int, int], rank: int) -> None:
        if key not in seen:
            heapq.heappush(heap, (-rank, len(seen), key))
            seen.add(key)

    # the loss gradient (a scalar) at the summed loss
    table[sum_out[-1]] = new_buffer(0)
    ref(table[sum_out[-1]])
    add_cand(("sum", t - 1, 0), sum_rank[-1])
    while heap:
        _, _, key = heapq.heappop(heap)
        kind, k, f_idx = key
        if kind == "sum":
            gy = table.pop(sum_out[k], None)
            if gy is None:
                continue
            if k > 0:
                give(sum_out[k - 1], gy, 0)
                add_cand(("sum", k - 1, 0), sum_rank[k - 1])
            lv = gid(k, graph.loss)
            give(lv, gy, 0)
            c = creator_of.get(lv)
            if c is not None:
                add_cand(("fn",) + c, fn_ranks[c[0]][c[1]])
            unref(gy)
            continue
        f = graph.functions[f_idx]
        outs = [gid(k, v) for v in f.outputs]
        gys = [table.pop(o, None) for o in outs]
        inputs = [gid(k, v) for v in f.inputs]
        targets = [i for i, g in enumerate(inputs) if g >= 0 and (f.grads[i] or f.shares[i] >= 0)]
        if targets:
            peak = max(peak, level + f.peak)
            done = set()
            for i in targets:
                x = inputs[i]
                if x in done:
                    continue
                done.add(x)
                s = f.shares[i]
                if s >= 0:
                    if gys[s] is None:
                        continue
                    give(x, gys[s], 0)
                else:
                    give(x, None, f.grads[i])
                c = creator_of.get(x)
                if c is not None:
                    add_cand(("fn",) + c, fn_ranks[c[0]][c[1]])
        for b in gys:
            if b is not None:
                unref(b)
        peak = max(peak, level)
    return int(peak)


def plain_peak_bytes(sizes: ByteSizes, t: int, graph: Optional[StepGraph] = None,
                     call: Optional[CallBytes] = None, *, state0_grads: bool = False) -> int:
    """Predicted peak of plain BPTT (every step's graph kept, one
    ``backward()``, ``unchain_backward()``, the update) above the bytes
    live at the call.

    The forward pass is :func:`simulate_bytes` of every step kept; the
    backward is :func:`replay_plain` on the recorded step (without one,
    :func:`simulate_bytes` of :func:`plain_schedule`, which frees each
    step's graph after its backward as the chain runner does and so
    predicts too little).

    >>> s = ByteSizes(100, 10, 1000, 50, 100, 5000, 150, 1200, 2000)
    >>> plain_peak_bytes(s, 10) >= 10 * 1000
    True
    """
    call = call or CallBytes()
    if graph is None:
        return simulate_bytes(plain_schedule(t), sizes, t, call=call)
    trace: List[Tuple[Op, int, int]] = []
    fwd = dataclasses.replace(call, update_transient=0, first_step_ran=False)
    forward_peak = simulate_bytes((("keep", k) for k in range(t)), sizes, t, trace=trace,
                                  call=fwd)
    live = trace[-2][1] if len(trace) >= 2 else 0  # before the closing ('update',) entry
    cleared = call.grads_cleared or not call.grads_before
    if cleared:
        live -= call.grads_before
    backward_peak = replay_plain(graph, live, t, grads_cleared=cleared,
                                 state0_grads=state0_grads)
    # after unchain_backward(): the last outputs, the final state, the gradients
    end = (sizes.outputs - call.outputs_before + sizes.state + sizes.param_grads
           - (call.grads_before if cleared else 0))
    return int(max(forward_peak, backward_peak, end + call.update_transient))
