"""ChainerMN data-parallel training with collective planning.

Two harnesses run the same scenarios on 2 ranks:

- **without MPI** (the default run, everywhere): the ranks are forked
  processes talking through :class:`QueueComm`, a ChainerMN communicator
  (a ``chainermn.CommunicatorBase``) over multiprocessing queues. Every
  collective call is numbered and named; a rank that reaches another
  collective call than its peers fails at once ("out of step"), and a
  collective call that waits too long fails as a deadlock, so protocol
  errors that would hang under MPI fail here instead;
- **with MPI** (marked ``mpi``; skipped with the reason when ``mpiexec`` or
  mpi4py is missing): ``mpiexec -n 2`` runs this file as a script over
  Chainer's ``naive`` communicator, ``scatter_dataset`` and
  ``create_multi_node_optimizer``, and prints every rank's results.

The exactness scenario trains plain ChainerMN and then ChainerMN with
``chainer_recompute.runtime.distributed.apply(model, comm, budget='least')``
from the same seeds and data split, and compares the parameters, gradients
and BatchNorm statistics after every update bit for bit; the parameters
must also be identical across ranks, and every rank must run the root's
plan (only the root solves).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import queue
import shutil
import subprocess
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import pytest

import chainer_recompute as cr  # noqa: F401  (NumPy compatibility before chainer)
import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
from chainer.dataset import concat_examples

from chainer_recompute.core.errors import InfeasibleBudgetError, RecomputeError
from chainer_recompute.runtime import distributed as crmn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# =====================================================================
# A ChainerMN communicator over multiprocessing queues
# =====================================================================
class OutOfStep(RuntimeError):
    """Two ranks are in different collective calls."""


class QueueComm(chainermn.CommunicatorBase):
    """The collective calls ChainerMN's training path uses (object
    broadcast/gather, point-to-point objects, ``bcast_data``,
    ``multi_node_mean_grad``), between forked processes."""

    def __init__(self, rank: int, size: int, inboxes: List[Any], timeout: float) -> None:
        super().__init__()
        self._rank, self._size = rank, size
        self._inboxes = inboxes
        self._timeout = timeout
        self._count = 0
        self._stash: List[Any] = []
        self.collectives: List[str] = []

    rank = property(lambda self: self._rank)
    size = property(lambda self: self._size)
    intra_rank = property(lambda self: self._rank)
    intra_size = property(lambda self: self._size)
    inter_rank = property(lambda self: 0)
    inter_size = property(lambda self: 1)

    # -- plumbing
    def _put(self, dest: int, kind: str, obj: Any, seq: Optional[int]) -> None:
        self._inboxes[dest].put((self._rank, kind, seq, obj))

    def _get(self, src: int, kind: str, seq: Optional[int]) -> Any:
        def match(m: Any) -> bool:  # point-to-point, or any collective call
            return m[0] == src and ((m[1] == "p2p") == (seq is None))

        for i, m in enumerate(self._stash):
            if match(m):
                del self._stash[i]
                return self._check(m, kind, seq)
        while True:
            try:
                m = self._inboxes[self._rank].get(timeout=self._timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"rank {self._rank}: collective call #{seq} {kind} waited "
                    f"{self._timeout:.0f} s for rank {src}: deadlock") from None
            if match(m):
                return self._check(m, kind, seq)
            self._stash.append(m)

    def _check(self, m: Any, kind: str, seq: Optional[int]) -> Any:
        src, got_kind, got_seq, obj = m
        if seq is not None and (got_kind, got_seq) != (kind, seq):
            raise OutOfStep(f"ranks out of step: rank {self._rank} is in collective call "
                            f"#{seq} {kind} but rank {src} sent #{got_seq} {got_kind}")
        return obj

    def _next(self, kind: str) -> int:
        self._count += 1
        self.collectives.append(kind)
        return self._count

    # -- objects
    def gather_obj(self, obj: Any, root: int = 0) -> Any:
        seq = self._next("gather_obj")
        if self._rank != root:
            self._put(root, "gather_obj", obj, seq)
            return None
        out = [None] * self._size
        out[root] = obj
        for r in range(self._size):
            if r != root:
                out[r] = self._get(r, "gather_obj", seq)
        return out

    def bcast_obj(self, obj: Any, max_buf_len: Any = None, root: int = 0) -> Any:
        seq = self._next("bcast_obj")
        if self._rank == root:
            import pickle
            data = pickle.dumps(obj)  # as chunked_bcast_obj does, on the root
            for r in range(self._size):
                if r != root:
                    self._put(r, "bcast_obj", data, seq)
            return pickle.loads(data)
        import pickle
        return pickle.loads(self._get(root, "bcast_obj", seq))

    def send_obj(self, obj: Any, dest: int, tag: int = 0) -> None:
        self._put(dest, "p2p", obj, None)

    def recv_obj(self, source: int, status: Any = None, tag: Any = None) -> Any:
        return self._get(source, "p2p", None)

    def allreduce_obj(self, obj: Any) -> Any:
        got = self.gather_obj(obj)
        return self.bcast_obj(sum(got) if self._rank == 0 else None)

    # -- arrays (the multi-node optimizer)
    def bcast_data(self, model: chainer.Link) -> None:
        params = [(n, p) for n, p in sorted(model.namedparams()) if p.array is not None]
        got = self.bcast_obj({n: p.array for n, p in params} if self._rank == 0 else None)
        for n, p in params:
            p.array[...] = got[n]

    def multi_node_mean_grad(self, model: chainer.Link, zero_fill: bool = False) -> None:
        params = [(n, p) for n, p in sorted(model.namedparams()) if p.grad is not None]
        got = self.gather_obj({n: p.grad for n, p in params})
        mean = None
        if self._rank == 0:
            mean = {}
            for n, _ in params:
                total = got[0][n].copy()
                for g in got[1:]:
                    total += g[n]
                mean[n] = total / self._size
        mean = self.bcast_obj(mean)
        for n, p in params:
            p.grad[...] = mean[n]

    # -- not used by these tests
    def _unused(self, *a: Any, **k: Any) -> Any:
        raise NotImplementedError("QueueComm implements what the tests use only")

    split = alltoall = send = recv = bcast = gather = allgather = allreduce = scatter = \
        allreduce_grad = _unused


def run_ranks(fn: Callable[..., Any], size: int = 2, timeout: float = 240,
              op_timeout: float = 60, **kwargs: Any) -> List[Any]:
    """Run ``fn(comm, **kwargs)`` on ``size`` forked ranks; each rank's
    result, or ``('error', type name, message)`` for a rank that raised.
    A rank still running after ``timeout`` fails the test as a deadlock."""
    ctx = multiprocessing.get_context("fork")
    inboxes = [ctx.Queue() for _ in range(size)]
    results = ctx.Queue()

    def main(rank: int) -> None:
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            comm = QueueComm(rank, size, inboxes, op_timeout)
            out = ("ok", fn(comm, **kwargs))
        except BaseException as e:  # reported to the parent
            out = ("error", type(e).__name__, str(e), traceback.format_exc())
        results.put((rank, out))

    procs = [ctx.Process(target=main, args=(r,), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    got: Dict[int, Any] = {}
    try:
        while len(got) < size:
            rank, out = results.get(timeout=timeout)
            got[rank] = out
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(size)) - set(got))} did not finish in "
                    f"{timeout} s (deadlock?); finished: {got}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [got[r] for r in range(size)]


def results_of(outs: List[Any]) -> List[Dict[str, Any]]:
    """The ranks' results; fails with every rank's traceback if one raised."""
    bad = [(r, o) for r, o in enumerate(outs) if o[0] != "ok"]
    if bad:
        pytest.fail("\n".join(f"rank {r}: {o[1]}: {o[2]}\n{o[3]}" for r, o in bad))
    return [o[1] for o in outs]


# =====================================================================
# Scenarios (shared by both harnesses)
# =====================================================================
class MLP(chainer.Chain):
    """Lazy first layer, BatchNorm, optional dropout, and optionally a
    branch that depends on the data (``x[0, 0] > 0``)."""

    def __init__(self, n_in: Optional[int] = None, n_hidden: int = 48, n_out: int = 10,
                 dropout: float = 0.0,
                 branch: bool = False, spike: int = 0, grad_in_forward: bool = False) -> None:
        super().__init__()
        self.dropout, self.branch, self.spike = dropout, branch, spike
        self.grad_in_forward = grad_in_forward
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_hidden)
            self.bn = L.BatchNormalization(n_hidden)
            self.l2 = L.Linear(n_hidden, n_hidden)
            self.l3 = L.Linear(n_hidden, n_hidden)
            self.l4 = L.Linear(n_hidden, n_out)

    def forward(self, x: Any) -> Any:
        h = F.relu(self.bn(self.l1(x)))
        if self.dropout:
            h = F.dropout(h, self.dropout)
        h = F.tanh(self.l2(h))
        if self.spike:  # memory the graph does not see (an over-budget rank)
            junk = np.ones(self.spike, np.uint8)
            junk += 1
            del junk
        if self.branch and float(chainer.backend.CpuDevice().send(
                x.array if isinstance(x, chainer.Variable) else x)[0, 0]) > 0:
            h = F.sigmoid(h) * h + h
        if self.grad_in_forward:
            g, = chainer.grad([F.sum(h * h)], [h], enable_double_backprop=True)
            h = h + 0.01 * g
        h = F.relu(self.l3(h))
        return self.l4(h)


def dataset(n: int = 48, dim: int = 20, seed: int = 0, split_sign: bool = False) -> Any:
    """Seeded examples; with ``split_sign`` the first half has x[:, 0] > 0
    and the second half x[:, 0] < 0 (so that, scattered in order, the
    ranks take different branches)."""
    rs = np.random.RandomState(seed)
    x = rs.randn(n, dim).astype(np.float32)
    if split_sign:
        x[:, 0] = np.abs(x[:, 0]) + 0.1
        x[n // 2:, 0] *= -1
    t = rs.randint(0, 10, n).astype(np.int32)
    return chainer.datasets.TupleDataset(x, t)


def _np(x: Any) -> Any:
    if x is None:
        return None
    return np.array(chainer.backend.CpuDevice().send(x), copy=True)


def snapshot(model: chainer.Link) -> Dict[str, Any]:
    rec = {}
    for path, p in model.namedparams(include_uninit=True):
        rec[f"param{path}"] = _np(p.array)
        rec[f"grad{path}"] = _np(p.grad)
    for path, link in model.namedlinks():
        for name in sorted(link._persistent):
            v = getattr(link, name, None)
            if isinstance(v, chainer.get_array_types()):
                rec[f"persist{path}/{name}"] = _np(v)
    return rec


def first_difference(a: List[Dict[str, Any]], b: List[Dict[str, Any]]) -> Optional[str]:
    if len(a) != len(b):
        return f"{len(a)} steps against {len(b)}"
    for step, (ra, rb) in enumerate(zip(a, b)):
        if sorted(ra) != sorted(rb):
            return f"step {step}: keys {sorted(set(ra) ^ set(rb))}"
        for k in sorted(ra):
            x, y = ra[k], rb[k]
            if (x is None) != (y is None) or (x is not None and (
                    x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes())):
                return f"step {step}: {k}"
    return None


def _digest(model: chainer.Link) -> str:
    h = hashlib.sha256()
    for path, p in sorted(model.namedparams()):
        h.update(path.encode())
        h.update(_np(p.array).tobytes())
    return h.hexdigest()


def _plans_of(runner: Any) -> Dict[str, Any]:
    out = {}
    for entry in runner.signatures():
        sig = entry.signature
        for s in entry.structures:
            key = crmn.structure_key(crmn.structure_of(s.graph))
            out[key] = {"signature": repr(sig[0][1:]),
                        "lower_sets": [sorted(ls) for ls in s.plan.lower_sets],
                        "kept": sorted(s.plan.kept),
                        "budget": s.plan.budget_bytes,
                        "correction": s.graph.step.correction_bytes}
    return out


def train(comm: Any, *, applied: bool, options: Dict[str, Any], n: int, batch: int,
          epochs: int, seed: int = 1, equal: bool = True, mpi_scatter: bool = False,
          split_sign: bool = False, net: Optional[Dict[str, Any]] = None,
          per_rank_net: Optional[Dict[int, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """Train ``epochs`` epochs of ChainerMN (multi-node optimizer, data
    scattered in order, last batch of an epoch smaller) and record the
    state after every update."""
    data = dataset(n, split_sign=split_sign)
    shard = chainermn.scatter_dataset(data if comm.rank == 0 else None, comm,
                                      force_equal_length=equal)
    np.random.seed(seed)  # the same initial weights on every rank
    kw = dict(net or {})
    kw.update((per_rank_net or {}).get(comm.rank, {}))
    model = L.Classifier(MLP(**kw))
    coordinator = None
    if applied:
        crmn.apply(model, comm, **options)
        coordinator = cr.runner_of(model).coordinator
    opt = chainermn.create_multi_node_optimizer(chainer.optimizers.MomentumSGD(lr=0.05), comm)
    opt.setup(model)
    np.random.seed(seed + 100 * (comm.rank + 1))  # dropout differs between ranks
    records, paths = [], []
    for _ in range(epochs):
        it = chainer.iterators.SerialIterator(shard, batch, repeat=False, shuffle=False)
        for b in it:
            x, t = concat_examples(b)
            opt.update(model, x, t)
            records.append(snapshot(model))
            runner = cr.runner_of(model)
            if runner is not None:
                st = runner.last_stats
                paths.append((len(x), st.path, st.n_dropped))
    out = {"records": records, "paths": paths, "digest": _digest(model), "shard": len(shard)}
    if applied:
        out.update(plans=_plans_of(cr.runner_of(model)), solves=coordinator.solves,
                   rounds=coordinator.rounds)
    return out


def scenario_exact(comm: Any, *, options: Optional[Dict[str, Any]] = None,
                   **kw: Any) -> Dict[str, Any]:
    """Plain ChainerMN, then ChainerMN with recomputation, from the same
    seeds: per-rank results (the comparisons are made by :func:`check_exact`)."""
    options = dict(options or {"budget": "least"})
    plain = train(comm, applied=False, options=options, **kw)
    rec = train(comm, applied=True, options=options, **kw)
    return {"difference": first_difference(plain["records"], rec["records"]),
            "steps": len(rec["records"]), "digest": rec["digest"],
            "plain_digest": plain["digest"], "paths": rec["paths"], "plans": rec["plans"],
            "solves": rec["solves"], "rounds": rec["rounds"], "shard": rec["shard"]}


def check_exact(res: List[Dict[str, Any]], *, same_structures: bool = True) -> None:
    """Bit-identical to plain ChainerMN on every rank, the same parameters
    on every rank, planned and recomputing, only the root solving, and the
    same plan for the same structure on every rank."""
    for r, x in enumerate(res):
        assert x["difference"] is None, f"rank {r} differs from plain ChainerMN: " \
                                        f"{x['difference']}"
        assert any(p == "planned" and d for _, p, d in x["paths"]), \
            f"rank {r} never ran a plan that drops something: {x['paths']}"
    assert len({x["digest"] for x in res}) == 1, "the parameters differ between ranks"
    assert res[0]["digest"] == res[0]["plain_digest"]
    assert res[0]["solves"] >= 1
    assert all(x["solves"] == 0 for x in res[1:]), [x["solves"] for x in res]
    assert len({x["rounds"] for x in res}) == 1, [x["rounds"] for x in res]
    for x in res[1:]:
        common = set(x["plans"]) & set(res[0]["plans"])
        if same_structures:
            assert set(x["plans"]) == set(res[0]["plans"])
        for k in common:
            assert x["plans"][k] == res[0]["plans"][k], f"plans differ for structure {k}"


def scenario_error(comm: Any, *, options: Dict[str, Any], n: int = 32, batch: int = 8,
                   per_rank_batch: Optional[Dict[int, int]] = None,
                   per_rank_options: Optional[Dict[int, Dict[str, Any]]] = None,
                   least_factor: Optional[float] = None, steps: int = 3) -> Dict[str, Any]:
    """Train until something raises; the error, or None, and how far it got."""
    b = (per_rank_batch or {}).get(comm.rank, batch)
    data = dataset(max(n, b))
    x, t = concat_examples(data[:b])
    np.random.seed(1)
    opts = dict(options)
    if least_factor is not None:  # a budget between the batches' needs
        probe = L.Classifier(MLP())
        probe(x[:batch], t[:batch])
        from chainer_recompute.core.budget import BudgetSearch
        g = cr.capture(probe, x[:batch], t[:batch], backward=True)
        opts["budget"] = int(BudgetSearch(g).least_budget() * least_factor)
        opts["budget"] = comm.bcast_obj(opts["budget"] if comm.rank == 0 else None)
    opts.update((per_rank_options or {}).get(comm.rank, {}))
    model = crmn.apply(L.Classifier(MLP()), comm, **opts)
    opt = chainermn.create_multi_node_optimizer(chainer.optimizers.SGD(), comm)
    opt.setup(model)
    done = 0
    try:
        for _ in range(steps):
            opt.update(model, x, t)
            done += 1
    except RecomputeError as e:
        return {"error": type(e).__name__, "message": str(e), "steps": done}
    return {"error": None, "steps": done}


def scenario_device_budget(comm: Any) -> Dict[str, Any]:
    """budget='device' with each rank's device giving a different figure:
    every rank plans for the least of them."""
    from chainer_recompute.core import budget_spec
    budget_spec.host_available_bytes = lambda: (1 << 40) * (comm.rank + 1)  # forked rank
    x, t = concat_examples(dataset(8))
    np.random.seed(1)
    model = crmn.apply(L.Classifier(MLP()), comm, budget="device")
    opt = chainermn.create_multi_node_optimizer(chainer.optimizers.SGD(), comm)
    opt.setup(model)
    opt.update(model, x, t)
    runner = cr.runner_of(model)
    return {"bytes": runner.budget_bytes, "basis": runner.budget.basis_bytes,
            "plans": [p.budget_bytes for p in runner.plans.values()]}


SCENARIOS: Dict[str, Callable[[Any], Any]] = {
    # the same batch on both ranks, smaller last batch, dropout, BatchNorm, lazy init
    "exact": lambda comm: scenario_exact(comm, n=40, batch=8, epochs=3,
                                         net={"dropout": 0.2}),
    # unequal shards: the ranks' last batches differ (different signatures in one step)
    "last_batch": lambda comm: scenario_exact(comm, n=37, batch=8, epochs=3, equal=False),
    # the ranks take different branches: different structures for one signature
    "structures": lambda comm: scenario_exact(comm, n=32, batch=8, epochs=2,
                                              split_sign=True, net={"branch": True}),
    # plans before the first step from a small capture
    # (not lazy: capture_batch over an uninitialised Parameter that never had
    # cleargrads() fails in capture.leave_no_trace, without ChainerMN too)
    "capture_batch": lambda comm: scenario_exact(comm, n=32, batch=8, epochs=2,
                                                 net={"n_in": 20},
                                                 options={"budget": "least",
                                                          "capture_batch": 2}),
    # a budget that fits rank 0's batch but not rank 1's
    "infeasible_one_rank": lambda comm: scenario_error(
        comm, options={}, per_rank_batch={1: 64}, least_factor=1.2, n=64),
    # rank 1 was given another budget
    "options_differ": lambda comm: scenario_error(
        comm, options={"budget": "least"}, per_rank_options={1: {"budget": "1G"}}),
}


# =====================================================================
# Without MPI: forked ranks over QueueComm
# =====================================================================
def test_exact_two_ranks():
    check_exact(results_of(run_ranks(SCENARIOS["exact"])))


def test_last_batch_with_other_signature_on_one_rank():
    res = results_of(run_ranks(SCENARIOS["last_batch"]))
    assert [x["shard"] for x in res] == [19, 18]
    # the last batches (3 and 2 examples) were planned (on rank 0) and run
    for x, last in zip(res, (3, 2)):
        assert any(b == last and p == "planned" for b, p, _ in x["paths"]), x["paths"]
    check_exact(res, same_structures=False)
    assert len(res[0]["plans"]) == len(res[1]["plans"]) == 2


def test_ranks_with_different_structures_get_the_roots_plan_for_theirs():
    res = results_of(run_ranks(SCENARIOS["structures"]))
    check_exact(res, same_structures=False)
    assert set(res[0]["plans"]) != set(res[1]["plans"])  # a branch on one rank only


def test_capture_batch_plans_collectively_before_the_first_step():
    res = results_of(run_ranks(SCENARIOS["capture_batch"]))
    check_exact(res)
    for x in res:
        assert x["paths"][0][1] == "planned"


def test_infeasible_on_one_rank_fails_on_every_rank():
    res = results_of(run_ranks(SCENARIOS["infeasible_one_rank"]))
    assert [x["error"] for x in res] == ["InfeasibleBudgetError"] * 2, res
    assert res[0]["message"] == res[1]["message"]
    # planned from captures before the first step, which raises on every rank
    assert [x["steps"] for x in res] == [0, 0]


def test_budget_below_every_ranks_need():
    res = results_of(run_ranks(scenario_error, options={"budget": 1}))
    assert [x["error"] for x in res] == ["InfeasibleBudgetError"] * 2, res
    assert [x["steps"] for x in res] == [0, 0]  # before the first step


def test_device_budget_is_the_least_any_rank_can_give():
    res = results_of(run_ranks(scenario_device_budget))
    want = int((1 << 40) * (1 - 0.10))
    assert [r["basis"] for r in res] == [1 << 40] * 2, res
    assert [r["bytes"] for r in res] == [want] * 2
    assert all(r["plans"] == [want] for r in res), res


def test_options_differ_between_ranks():
    res = results_of(run_ranks(SCENARIOS["options_differ"]))
    assert [x["error"] for x in res] == ["DistributedError"] * 2, res
    assert "options differ between ranks" in res[0]["message"]
    assert res[0]["message"] == res[1]["message"]
    assert [x["steps"] for x in res] == [0, 0]


def test_graph_that_does_not_match_the_broadcast_plan_fails_everywhere():
    """Structure digests that collide (forced here) while the graphs
    differ: the rank whose graph does not match the root's plan is found
    by the check, and every rank raises the same error."""
    def collide(comm: Any) -> Any:
        crmn.structure_key = lambda structure: "same-for-everyone"
        return scenario_exact(comm, n=32, batch=8, epochs=2, split_sign=True,
                              net={"branch": True})

    outs = run_ranks(collide)
    assert [o[0] for o in outs] == ["error", "error"], outs
    assert [o[1] for o in outs] == ["DistributedError"] * 2
    assert outs[0][2] == outs[1][2]
    assert "rank 1's graph does not match the plan broadcast by rank 0" in outs[0][2]
    assert "function" in outs[0][2]


def _correction(comm: Any) -> Dict[str, Any]:
    # rank 1 allocates 1 MB in its forward that the graph does not see:
    # its measured peak is over the budget, its plan is corrected for
    # every rank at the next call
    res = scenario_exact(comm, n=48, batch=8, epochs=2, per_rank_net={1: {"spike": 1 << 20}})
    return res


def test_over_budget_on_one_rank_is_corrected_for_every_rank():
    res = results_of(run_ranks(_correction))
    check_exact(res)
    for x in res:
        corr = [p["correction"] for p in x["plans"].values()]
        assert max(corr) > 1 << 19, x["plans"]  # most of the 1 MB the graph missed
    assert res[0]["rounds"] >= 2  # the first plan, and the correction


def test_backward_inside_the_forward():
    """``chainer.grad`` in the forward: runners that plan it and runners
    that run it without a plan (``_plan_pending`` before the change) are
    both followed, never leaving a rank alone in a collective call."""
    def run(comm: Any) -> Dict[str, Any]:
        return scenario_exact(comm, n=16, batch=8, epochs=2, net={"grad_in_forward": True})

    res = results_of(run_ranks(run))
    for x in res:
        assert x["difference"] is None
    assert res[0]["digest"] == res[1]["digest"]
    assert res[0]["rounds"] == res[1]["rounds"]
    assert res[1]["solves"] == 0 and res[0]["solves"] == res[0]["rounds"]


def test_plan_for_outside_a_training_call_is_refused():
    def run(comm: Any) -> Any:
        model = crmn.apply(L.Classifier(MLP(n_in=20)), comm, budget="least")
        x, t = concat_examples(dataset(8)[:8])
        try:
            cr.runner_of(model).plan_for(model, x, t)
        except crmn.DistributedError as e:
            return str(e)
        return None

    res = results_of(run_ranks(run))
    assert all(m and "outside a training call" in m for m in res), res


def test_one_rank_reaching_a_collective_call_alone_is_caught_by_the_harness():
    """The harness itself: a protocol error fails instead of hanging."""
    def run(comm: Any) -> Any:
        if comm.rank == 0:
            comm.bcast_obj("x")
        return comm.gather_obj(1)

    outs = run_ranks(run, op_timeout=5)
    assert outs[0][0] == "error" or outs[1][0] == "error"
    assert any("out of step" in o[2] or "deadlock" in o[2] for o in outs if o[0] == "error")


# ---- without any other rank ------------------------------------------
def test_not_a_chainermn_communicator():
    model = L.Classifier(MLP())
    for bad in (object(), None, 3):
        with pytest.raises(crmn.DistributedError, match="expected a ChainerMN communicator"):
            crmn.apply(model, bad, budget="least")
        with pytest.raises(RecomputeError, match="create_communicator"):
            crmn.Coordinator(bad)
    assert cr.runner_of(model) is None


def test_single_rank_and_pickling():
    def run(comm: Any) -> Any:
        import pickle
        res = scenario_exact(comm, n=24, batch=8, epochs=2)
        model = crmn.apply(L.Classifier(MLP()), comm, budget="least")
        x, t = concat_examples(dataset(8)[:8])
        model(x, t).backward()
        clone = pickle.loads(pickle.dumps(model))  # the coordinator stays behind
        return res, cr.runner_of(clone).coordinator

    (res, coordinator), = results_of(run_ranks(run, size=1))
    check_exact([res])
    assert coordinator is None


def test_structure_digest_ignores_measurements():
    x, t = concat_examples(dataset(8)[:8])
    model = L.Classifier(MLP(n_in=20))
    g1 = cr.capture(model, x, t, backward=True)
    g2 = cr.capture(model, x, t, backward=True)
    assert crmn.structure_of(g1) == crmn.structure_of(g2)
    nodes = [dataclasses.replace(n, forward_time_s=1.0, backward_transient_bytes=7)
             for n in g1.nodes]
    assert crmn.structure_of(g1.replace(nodes=nodes)) == crmn.structure_of(g1)
    g3 = cr.capture(model, x[:4], t[:4], backward=True)
    assert "shape" in crmn.first_difference(crmn.structure_of(g1), crmn.structure_of(g3)) \
        or "function" in crmn.first_difference(crmn.structure_of(g1), crmn.structure_of(g3))


# =====================================================================
# With MPI: mpiexec -n 2 over Chainer's naive communicator
# =====================================================================
def _mpi_missing() -> Optional[str]:
    if shutil.which("mpiexec") is None:
        return ("mpiexec not found: install MPI (Debian: apt-get install openmpi-bin "
                "libopenmpi-dev) to run the 2-rank check")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed: pip install -e '.[mn]' (needs MPI) to run the 2-rank check"
    return None


def mpiexec_command(n: int) -> List[str]:
    """``mpiexec -n N``, with Open MPI's flags for more ranks than cores
    and for root (containers)."""
    cmd = ["mpiexec", "-n", str(n)]
    try:
        version = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except Exception:
        version = ""
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd += ["--allow-run-as-root"]
    return cmd


def _mpi_env() -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    return env


@pytest.mark.mpi
@pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
def test_mpiexec_two_ranks():
    names = list(SCENARIOS)
    proc = subprocess.run(mpiexec_command(2) + [sys.executable, os.path.abspath(__file__)]
                          + names, capture_output=True, text=True, timeout=600,
                          env=_mpi_env(), cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MN-RESULTS ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-4000:]}\n" \
                                           f"{proc.stderr[-4000:]}"
    results = json.loads(lines[-1][len("MN-RESULTS "):])
    for name in ("exact", "capture_batch"):
        check_exact(results[name])
    check_exact(results["last_batch"], same_structures=False)
    check_exact(results["structures"], same_structures=False)
    inf = results["infeasible_one_rank"]
    assert [x["error"] for x in inf] == ["InfeasibleBudgetError"] * 2, inf
    diff = results["options_differ"]
    assert [x["error"] for x in diff] == ["DistributedError"] * 2, diff


@pytest.mark.mpi
@pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
def test_train_mn_script_runs_under_mpiexec(tmp_path):
    out = tmp_path / "mn.json"
    proc = subprocess.run(
        mpiexec_command(2) + [sys.executable, os.path.join(ROOT, "scripts", "train_mn.py"),
                              "--model", "resnet50", "--small", "--batch-size", "8",
                              "--epochs", "1", "--n-train", "32", "--n-test", "16",
                              "--budget", "least", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=_mpi_env(), cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rep = json.loads(out.read_text())
    assert len(rep["ranks"]) == 2
    assert rep["identical_across_ranks"]
    for r in rep["ranks"]:
        assert r["paths"] == ["recorded", "planned"], r["paths"]
        assert r["peak_bytes"] > 0 and r["plans"][0]["n_blocks"] > 1
    assert rep["ranks"][0]["solves"] == 1 and rep["ranks"][1]["solves"] == 0


def _mpi_main(names: List[str]) -> None:
    comm = chainermn.create_communicator("naive")
    results = {}
    for name in names:
        try:
            mine = SCENARIOS[name](comm)
            for k in ("records",):
                mine.pop(k, None)
        except Exception as e:  # reported, and the others go on
            mine = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        results[name] = comm.gather_obj(mine)
    if comm.rank == 0:
        print("MN-RESULTS " + json.dumps(results, default=str), flush=True)


if __name__ == "__main__":
    _mpi_main(sys.argv[1:] or list(SCENARIOS))
