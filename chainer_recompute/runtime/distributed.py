"""Recomputation in ChainerMN data-parallel training: one plan on every rank.

A ChainerMN script changes by one line::

    import chainermn
    import chainer_recompute.runtime.distributed as crmn

    comm = chainermn.create_communicator('naive')      # 'pure_nccl' on GPUs
    model = L.Classifier(MyNet())
    model = crmn.apply(model, comm, budget='least')    # <- the one line
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.Adam(), comm)
    optimizer.setup(model)
    train = chainermn.scatter_dataset(train, comm, shuffle=True)
    ...                                                # Trainer, evaluator as before

``crmn.apply(model, comm, budget, **options)`` is
``cr.apply(model, budget, coordinator=crmn.Coordinator(comm), **options)``
with the informational report line printed by the root rank only; a bare
callable takes ``cr.Recompute(fn, budget, coordinator=crmn.Coordinator(comm))``.

Why a coordinator: each rank measures its own function times, and a plan
solved from them could differ from rank to rank; a rank with another plan
would also take another time per step, and the ranks would drift apart.
So plans are never made independently: the root rank (rank 0) solves, the
others take its plan.

The protocol (every step a collective call that every rank makes):

- **At every training call** (:meth:`Coordinator.on_call`) the ranks
  allgather a small message: the model, its planning options, this call's
  state (``record``, ``plan``, ``run``, ``plain``), whether this call will
  plan, and any over-budget correction a rank measured. Every rank decides
  from the same list, so they all take the same branch:

  - options (budget, solver, ...) or the model differ between ranks:
    :class:`DistributedError` on every rank;
  - a rank measured a peak over its budget: a *correction round* re-plans
    that structure for every rank;
  - some ranks plan in this call (a signature recorded in its previous
    call, a rank whose graph stopped matching its plan, the first call
    with ``capture_batch``): a *planning round*. Ranks that plan take part
    from inside :meth:`Coordinator.plan` (called by the runner instead of
    solving); the others take part from ``on_call`` at once. A rank whose
    batch has another signature than the others' (the last batch of an
    epoch) plans it in such a round too.

- **A round**: each rank that has a graph sends the digest of its structure
  (functions, wiring, shapes, dtypes, what each function retains) to the
  root; the root asks for the graph of each structure it does not hold
  (from the lowest rank that has it) and solves each distinct structure
  once, with its own solver options, catching errors; it broadcasts the
  plans (``comm.bcast_obj``), each with the structure it was made for.
  Every rank checks its own graph against the structure of the plan it
  takes, and the verdicts are allgathered. A solver error (an infeasible
  budget) or a mismatch raises the same error on every rank; nothing is
  left waiting in a collective call.

Ranks whose graphs differ (a data-dependent branch taken on one rank only)
each get the root's plan for their own structure; ranks with the same
structure get the same plan. Measured peaks over the budget are corrected
collectively: the runner's own re-plan is deferred to the next call, where
the root re-plans with the largest correction any rank measured and every
rank installs the new plan.

Requirements: every rank makes the same sequence of training calls of the
applied model (as ChainerMN's own collective update requires); models that
communicate inside their forward (``MultiNodeBatchNormalization``) should
not use ``capture_batch`` (its separate capture would run their collective
calls on some ranks only when signatures differ).
"""
from __future__ import annotations

import collections
import hashlib
import logging
import pickle
import time
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from ..core.errors import RecomputeError
from ..core.graph import Graph
from ..core.io import graph_from_dict, graph_to_dict

logger = logging.getLogger(__name__)
report = logging.getLogger("chainer_recompute.report")

__all__ = ["Coordinator", "DistributedError", "apply", "structure_of", "structure_key",
           "first_difference"]


from ..core.errors import DistributedError  # noqa: E402  (re-exported here)


# --------------------------------------------------------------- structure
def structure_of(graph: Graph) -> Tuple[Any, ...]:
    """What a plan depends on in a graph, and nothing measured: per array
    its shape, dtype, kind, producer, view and name; per node its function,
    wiring (input and output array ids), what Chainer retains, the arrays it
    holds, whether it can be recomputed and whether it has a backward.
    Two graphs with the same structure take the same plan.

    >>> from chainer_recompute.core.graph import Graph
    >>> a = Graph.from_edges([4, 8], [(0, 1)], costs=[1.0, 2.0])
    >>> b = Graph.from_edges([4, 8], [(0, 1)], costs=[3.0, 5.0])  # other measurements
    >>> structure_of(a) == structure_of(b)
    True
    """
    arrays = tuple((a.shape, a.dtype, a.kind, a.producer, a.view_of, a.name)
                   for a in graph.arrays)
    nodes = tuple((n.op, n.inputs, n.outputs, n.retained_inputs, n.retained_outputs,
                   tuple((h.name, h.shape, h.dtype, h.role) for h in n.held),
                   n.recomputable, n.has_backward,
                   repr(sorted(dict(n.attrs).items(), key=lambda kv: str(kv[0]))))
                  for n in graph.nodes)
    return (arrays, nodes)


def structure_key(structure: Tuple[Any, ...]) -> str:
    """A short digest of :func:`structure_of`.

    >>> from chainer_recompute.core.graph import Graph
    >>> len(structure_key(structure_of(Graph.from_edges([4, 8], [(0, 1)]))))
    32
    """
    return hashlib.sha256(repr(structure).encode()).hexdigest()[:32]


def first_difference(a: Tuple[Any, ...], b: Tuple[Any, ...]) -> str:
    """Where two structures (from :func:`structure_of`) first differ, in words.

    >>> from chainer_recompute.core.graph import Graph
    >>> a = Graph.from_edges([4, 8], [(0, 1)], ops=['Linear', 'ReLU'])
    >>> b = Graph.from_edges([4, 8], [(0, 1)], ops=['Linear', 'Tanh'])
    >>> first_difference(structure_of(a), structure_of(b))
    'function 1: ReLU (0,)->(1,) against Tanh (0,)->(1,) (functions differ)'
    """
    (arrays_a, nodes_a), (arrays_b, nodes_b) = a, b
    for i, (x, y) in enumerate(zip(nodes_a, nodes_b)):
        if x != y:
            fields = ("functions", "inputs", "outputs", "retained inputs", "retained outputs",
                      "held arrays", "recomputable flags", "backward flags", "attributes")
            what = next(f for f, u, v in zip(fields, x, y) if u != v)
            return (f"function {i}: {x[0]} {x[1]}->{x[2]} against {y[0]} {y[1]}->{y[2]} "
                    f"({what} differ)")
    if len(nodes_a) != len(nodes_b):
        return f"{len(nodes_a)} functions against {len(nodes_b)}"
    for i, (x, y) in enumerate(zip(arrays_a, arrays_b)):
        if x != y:
            return f"array {i}: shape {x[0]} {x[1]} ({x[2]}) against {y[0]} {y[1]} ({y[2]})"
    if len(arrays_a) != len(arrays_b):
        return f"{len(arrays_a)} arrays against {len(arrays_b)}"
    return "no difference"


def _check_communicator(comm: Any) -> None:
    try:
        import chainermn
    except Exception as e:  # pragma: no cover - chainermn ships with chainer
        raise DistributedError(f"chainermn could not be imported ({e}); it ships with "
                               f"Chainer 7 and needs mpi4py: pip install -e '.[mn]'") from e
    if isinstance(comm, chainermn.CommunicatorBase):
        return
    kind = f"{type(comm).__module__}.{type(comm).__qualname__}"
    hint = ""
    if type(comm).__module__.startswith("mpi4py"):
        hint = (" (an mpi4py communicator: wrap it with "
                "chainermn.create_communicator('naive', mpi_comm))")
    raise DistributedError(
        f"expected a ChainerMN communicator (chainermn.create_communicator('naive') on CPU, "
        f"'pure_nccl' on GPUs), got {kind}{hint}")


def _portable(exc: BaseException) -> BaseException:
    """The exception itself if it survives pickling, else a DistributedError
    with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return DistributedError(f"{type(exc).__name__}: {exc}")


def _add_note(exc: BaseException, note: str) -> BaseException:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    return exc


class _CallMessage(NamedTuple):
    """What each rank tells the others at a training call (allgathered)."""

    model: str  # the applied model's name
    options: str  # its planning options (see _options_digest)
    state: str  # the runner's call state (Recompute.call_state)
    will_plan: bool  # whether this call plans before its forward
    signature: str  # a digest of the call's input signature
    corrections: Dict[str, int]  # structure key -> correction bytes measured here
    call: int  # this rank's count of training calls
    available: Optional[int] = None  # a 'device' budget not yet fixed: what this rank's can give


class _Solved(NamedTuple):
    """The root's plan for one structure (broadcast in a round)."""

    plan: Any
    structure: Tuple[Any, ...]  # what it was made for (structure_of)
    correction: int  # the correction bytes it was solved with


class _Failed(NamedTuple):
    """The root could not plan one structure (broadcast in a round): raised
    on every rank."""

    error: BaseException
    ranks: List[int]  # the ranks whose graph it was


class _Graph:
    """A graph with its structure and key, computed once."""

    __slots__ = ("graph", "structure", "key")

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.structure = structure_of(graph)
        self.key = structure_key(self.structure)


# ------------------------------------------------------------- coordinator
class Coordinator:
    """Plans collectively over the ranks of a ChainerMN communicator.

    Pass it to :func:`~chainer_recompute.runtime.runner.apply` or
    :class:`~chainer_recompute.runtime.runner.Recompute` as
    ``coordinator=`` on every rank (or use :func:`apply`). The root rank
    solves; every rank runs the root's plan for its graph's structure and
    checks that its graph has that structure (see the module docstring for
    the protocol). One coordinator may serve several applied models.

    Args:
        comm: a ChainerMN communicator (``chainermn.create_communicator``).
        root: the rank that solves.

    Raises:
        DistributedError: ``comm`` is not a ChainerMN communicator.

    Attributes:
        rounds: planning and correction rounds this rank took part in.
        solves: structures this rank solved (the root only).
        calls: training calls seen.
        sync_s: seconds spent agreeing at the training calls (one
            allgather each), rounds excluded.
        round_s: seconds spent in rounds (the root's solving included).
        last_round: what the last round did: ``planners`` (the ranks that
            planned in that call; ``None`` when this rank planned), ``keys``
            (the structure keys each rank brought), ``senders`` (key -> the
            rank that sent its graph to the root) and ``plans`` (key -> plan).

    >>> model = cr.apply(model, budget='least',                  # doctest: +SKIP
    ...                  coordinator=Coordinator(comm))
    >>> Coordinator(object())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    chainer_recompute.core.errors.DistributedError: expected a ChainerMN communicator ...
    """

    #: plans remembered per structure (for deferred corrections)
    MAX_PLANS = 64

    def __init__(self, comm: Any, *, root: int = 0) -> None:
        _check_communicator(comm)
        if not 0 <= root < comm.size:
            raise DistributedError(f"root rank {root} is not in the communicator "
                                   f"(size {comm.size})")
        self.comm = comm
        self.rank, self.size, self.root = int(comm.rank), int(comm.size), int(root)
        self.rounds = 0
        self.solves = 0
        self.calls = 0
        self.sync_s = 0.0
        self.round_s = 0.0
        self.last_round: Dict[str, Any] = {}
        # structure key -> (plan, correction bytes it was solved with)
        self._plans: "collections.OrderedDict[str, Tuple[Any, int]]" = collections.OrderedDict()
        self._corrections: Dict[str, _Graph] = {}  # over-budget graphs waiting for a round
        self._expect: Optional[int] = None  # id of the runner whose next plan() is collective
        self._keys: "weakref.WeakKeyDictionary[Graph, str]" = weakref.WeakKeyDictionary()

    def __reduce__(self) -> Any:
        raise DistributedError("a Coordinator holds a communicator and is not pickled; "
                               "apply() the model again after unpickling it")

    def __repr__(self) -> str:
        return f"Coordinator(rank {self.rank} of {self.size}, root {self.root})"

    # ------------------------------------------------------ collectives
    def _allgather(self, obj: Any) -> List[Any]:
        got = self.comm.gather_obj(obj, root=self.root)
        return self.comm.bcast_obj(got if self.rank == self.root else None, root=self.root)

    def _bcast(self, obj: Any) -> Any:
        return self.comm.bcast_obj(obj if self.rank == self.root else None, root=self.root)

    # ---------------------------------------------------- runner hooks
    def on_call(self, runner: Any, signature: Any, state: str) -> None:
        """Called by the runner at the start of every training call, on
        every rank: agree on what every rank is about to do."""
        self.calls += 1
        self._expect = None  # an expectation left by a call that raised before planning
        will_plan = state == "capture" or runner.plans_before_forward(signature)
        corrections = {k: int(g.graph.step.correction_bytes)
                       for k, g in self._corrections.items()}
        mine = _CallMessage(_model_name(runner), _options_digest(runner), state, will_plan,
                            hashlib.sha1(repr(signature).encode()).hexdigest()[:12],
                            corrections, self.calls, runner.available_bytes())
        t0 = time.perf_counter()
        everyone = self._allgather(mine)
        self.sync_s += time.perf_counter() - t0
        self._check_agreement(everyone)
        offers = [m.available for m in everyone if m.available is not None]
        if offers:  # budget='device': the least any rank can give, on every rank
            runner.resolve_device_budget(min(offers))
        if any(m.corrections for m in everyone):
            self._correction_round(runner, everyone)
        planners = [r for r, m in enumerate(everyone) if m.will_plan]
        if planners:
            logger.debug("rank %d: ranks %s plan in this call (states %s)", self.rank,
                         planners, [m.state for m in everyone])
            if will_plan:
                self._expect = id(runner)  # plan() takes part in the round
            else:
                self._round({}, runner.solve, planners)

    def plan(self, graph: Graph, solve: Callable[[Graph], Any]) -> Any:
        """Called by the runner instead of ``solve(graph)``: the root's plan
        for this graph's structure."""
        runner = getattr(solve, "__self__", None)
        g = _Graph(graph)
        self._keys[graph] = g.key
        if self._expect is not None and (runner is None or self._expect == id(runner)):
            self._expect = None
            plans = self._round({g.key: g}, solve, None)
            return plans[g.key]
        # Not in a collective call: the runner measured a peak over the
        # budget in a backward and wants to re-plan. Other ranks are not
        # here, so nothing is solved now: keep the plan in force and
        # correct it collectively at the next call.
        known = self._plans.get(g.key)
        if known is None:
            raise DistributedError(
                "a plan was asked for outside a training call (plan_for()?); under a "
                "Coordinator plans are made collectively when every rank calls the model "
                "(use capture_batch= to plan before the first step)")
        plan, correction = known
        if int(graph.step.correction_bytes) > correction:
            self._corrections[g.key] = g
            logger.info("rank %d: measured peak over the budget; the plan is corrected "
                        "collectively at the next call", self.rank)
        return plan

    # ------------------------------------------------------- decisions
    def _check_agreement(self, everyone: List[_CallMessage]) -> None:
        names = {m.model for m in everyone}
        if len(names) > 1:
            raise DistributedError(
                "the ranks are calling different applied models in the same step ("
                + ", ".join(f"rank {r}: {m.model}" for r, m in enumerate(everyone))
                + "); every rank must make the same training calls")
        options = {m.options for m in everyone}
        if len(options) > 1:
            raise DistributedError(
                "apply() options differ between ranks ("
                + "; ".join(f"rank {r}: {m.options}" for r, m in enumerate(everyone))
                + "); give every rank the same budget, solver, strategy, cost and "
                  "capture_batch")

    # ----------------------------------------------------------- rounds
    def _round(self, mine: Dict[str, _Graph], solve: Callable[[Graph], Any],
               planners: Optional[List[int]]) -> Dict[str, Any]:
        """One planning round (collective): the root solves every distinct
        structure that some rank brings and broadcasts the plans; every
        rank checks its graph against the plan's structure."""
        t0 = time.perf_counter()
        try:
            return self._round_body(mine, solve, planners)
        finally:
            self.round_s += time.perf_counter() - t0

    def _round_body(self, mine: Dict[str, _Graph], solve: Callable[[Graph], Any],
                    planners: Optional[List[int]]) -> Dict[str, Any]:
        self.rounds += 1
        keys = self._allgather({k: int(g.graph.step.correction_bytes)
                                for k, g in mine.items()})
        # the root asks for the graphs it does not hold
        senders: Dict[str, int] = {}
        if self.rank == self.root:
            held = set(keys[self.root])
            for r, ks in enumerate(keys):
                for k in ks:
                    if k not in held and k not in senders:
                        senders[k] = r
        senders = self._bcast(senders)
        outgoing = {}
        for k, r in senders.items():
            if r == self.rank:
                try:
                    outgoing[k] = graph_to_dict(mine[k].graph)
                except Exception as e:  # sent as an error: the round goes on
                    outgoing[k] = _portable(e)
        received = self.comm.gather_obj(outgoing, root=self.root)
        results: Dict[str, Any] = {}
        if self.rank == self.root:
            everyone = list(range(self.size))
            try:
                results = self._solve_all(mine, keys, received, solve)
                pickle.dumps(results)  # what cannot travel must not stop the broadcast
            except Exception as e:
                results = {"": _Failed(_portable(e), everyone)}
        results = self._bcast(results)
        failed = [r for r in results.values() if isinstance(r, _Failed)]
        if failed:
            raise _add_note(failed[0].error, f"(planned collectively on rank {self.root} for "
                                             f"the graph of rank(s) {failed[0].ranks}; raised "
                                             f"on every rank)")
        # every rank checks its graph against the structure of its plan
        verdict = None
        for k, g in mine.items():
            if k not in results:
                verdict = f"rank {self.rank} got no plan for its graph from rank {self.root}"
                continue
            structure = results[k].structure
            if structure != g.structure:
                verdict = (f"rank {self.rank}'s graph does not match the plan broadcast by "
                           f"rank {self.root} for its structure: "
                           f"{first_difference(g.structure, structure)}")
        verdicts = self._allgather(verdict)
        bad = [v for v in verdicts if v is not None]
        if bad:
            raise DistributedError("; ".join(bad))
        plans = {}
        for k, solved in results.items():
            self._remember(k, solved.plan, solved.correction)
            plans[k] = solved.plan
        self.last_round = {"planners": planners, "keys": [sorted(ks) for ks in keys],
                           "senders": dict(senders), "plans": plans}
        return plans

    def _solve_all(self, mine: Dict[str, _Graph], keys: List[Dict[str, int]],
                   received: List[Dict[str, Any]], solve: Callable[[Graph], Any]
                   ) -> Dict[str, Any]:
        """On the root: solve each distinct structure once (a _Solved or a
        _Failed for each)."""
        graphs: Dict[str, _Graph] = dict(mine)
        results: Dict[str, Any] = {}
        holders: Dict[str, List[int]] = collections.defaultdict(list)
        for r, ks in enumerate(keys):
            for k in ks:
                holders[k].append(r)
        for d in received:
            for k, gd in (d or {}).items():
                if isinstance(gd, BaseException):
                    results[k] = _Failed(gd, holders[k])
                    continue
                try:
                    graphs[k] = _Graph(graph_from_dict(gd, source=f"rank {holders[k][0]}"))
                except Exception as e:
                    results[k] = _Failed(_portable(e), holders[k])
        own = next(iter(mine.values()), None)
        for k in holders:
            if k in results:
                continue
            g = graphs[k]
            if g.key != k:
                results[k] = _Failed(DistributedError(
                    f"the graph sent by rank {holders[k][0]} has another structure than the "
                    f"digest it announced"), holders[k])
                continue
            correction = max(keys[r][k] for r in holders[k])
            graph = g.graph
            if correction > int(graph.step.correction_bytes):
                graph = graph.with_step(correction_bytes=correction)
            if own is not None and k != own.key:
                same_batch = g.graph.batch_size == own.graph.batch_size
                log = report.info if same_batch and getattr(
                    getattr(solve, "__self__", None), "verbose", False) else logger.info
                log("rank %s's graph differs from rank %d's (%s%s); each is planned on rank "
                    "%d for its own structure", ",".join(map(str, holders[k])), self.root,
                    "" if same_batch else f"batch {g.graph.batch_size} against "
                                          f"{own.graph.batch_size}: ",
                    first_difference(g.structure, own.structure), self.root)
            try:
                plan = solve(graph)
                self.solves += 1
                results[k] = _Solved(plan, g.structure, correction)
            except Exception as e:
                results[k] = _Failed(_portable(e), holders[k])
        return results

    def _remember(self, key: str, plan: Any, correction: int) -> None:
        self._plans[key] = (plan, correction)
        self._plans.move_to_end(key)
        while len(self._plans) > self.MAX_PLANS:
            self._plans.popitem(last=False)

    def _correction_round(self, runner: Any, everyone: List[_CallMessage]) -> None:
        """Some rank measured a peak over the budget: re-plan those
        structures with the largest correction and install the plans on
        every rank that has them."""
        wanted = set().union(*(m.corrections for m in everyone))
        mine = {k: g for k, g in self._corrections.items() if k in wanted}
        self._corrections.clear()
        self._round(mine, runner.solve, None)
        for key in wanted:
            plan, correction = self._plans[key]
            self._install(runner, key, plan, correction)

    def _install(self, runner: Any, key: str, plan: Any, correction: int) -> None:
        """Replace this runner's structures of ``key`` by ``plan``."""
        for old in runner.planned_graphs():
            if self._key_of(old) != key:
                continue
            graph = old.with_step(correction_bytes=correction)
            self._keys[graph] = key
            runner.adopt(graph, plan, replacing=old)

    def _key_of(self, graph: Graph) -> str:
        key = self._keys.get(graph)
        if key is None:
            key = self._keys[graph] = structure_key(structure_of(graph))
        return key


def _model_name(runner: Any) -> str:
    fn = runner.fn
    return getattr(fn, "__qualname__", type(fn).__name__)


def _options_digest(runner: Any) -> str:
    return runner.spec.digest(runner.budget)


# ------------------------------------------------------------------ apply
def apply(model: Any, comm: Any, budget: Any, *, root: int = 0, **options: Any) -> Any:
    """:func:`chainer_recompute.apply` for ChainerMN: the plan is solved on
    the root rank and shared by every rank (see the module docstring).

    Args:
        model: the Link whose call returns the loss (on every rank).
        comm: the ChainerMN communicator (``chainermn.create_communicator``).
        budget: per-rank memory budget, in any form ``apply()`` takes
            (``'8G'``, bytes, ``'least'``, ``'60%'``); the same on every
            rank. ``'device'`` is the least that any rank's device can
            give, less 10%, fixed at the first training call.
        root: the rank that solves.
        **options: as for :func:`chainer_recompute.apply` (``solver``,
            ``strategy``, ``capture_batch``, ...; ``verbose`` defaults to
            True on the root only).

    Returns:
        ``model`` itself.

    Raises:
        DistributedError: ``comm`` is not a ChainerMN communicator.

    >>> comm = chainermn.create_communicator('naive')          # doctest: +SKIP
    >>> model = apply(L.Classifier(MLP()), comm, budget='least')  # doctest: +SKIP
    >>> optimizer = chainermn.create_multi_node_optimizer(     # doctest: +SKIP
    ...     chainer.optimizers.Adam(), comm)
    >>> optimizer.setup(model)                                 # doctest: +SKIP
    """
    from .runner import apply as _apply
    coordinator = Coordinator(comm, root=root)
    options.setdefault("verbose", coordinator.rank == coordinator.root)
    return _apply(model, budget, coordinator=coordinator, **options)
