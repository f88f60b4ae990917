"""Benchmark helpers: building a registry network and its graph, planning
without running the network at full size (:func:`dry_run_graph`), and
measuring training iterations of plain Chainer against recomputation in the
same process. Used by the CLI, the experiments and the GPU check.

Measuring follows the authors' protocol: several iterations, the first
dropped (it plans, and warms caches), the rest averaged; the peak memory of
one training iteration measured by the allocator (NumPy: tracemalloc's
NumPy domain; CuPy: the memory pool's used bytes).

A dry run records the graph at a small batch (1 by default) and scales it
to the real batch (:meth:`Graph.scale_batch`). The segmentation networks
(``unet``, ``pspnet``) are also recorded at three smaller input sizes and
extrapolated to the real one (:func:`extrapolate_input_size`): PSPNet's
paper batch is already 1, and one plain iteration of it at 713x713 needs
about 6 GiB.
"""
from __future__ import annotations

import copy
import gc
import logging
import statistics
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .runtime import _chainer  # noqa: F401
import chainer
from chainer import backend

from .core.errors import CaptureError
from .core.graph import ArrayInfo, Graph
from .core.units import format_bytes
from .progress import Progress
from .runtime.device import device_of, seed_all
from .runtime.memory import model_state_bytes
from .runtime.runner import apply, runner_of

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What one configuration measured."""

    label: str
    peak_bytes: int  # peak of arrays allocated during an iteration (max over iterations)
    time_s: float  # mean seconds per iteration, first dropped
    times_s: List[float]
    loss: float
    first_iteration_s: float
    first_iteration_peak_bytes: int
    plan: Any = None
    extra: Dict[str, Any] = field(default_factory=dict)
    #: the iteration's whole peak (parameters, optimizer state and inputs
    #: counted in), max over the iterations after the first
    total_peak_bytes: Optional[int] = None


def network(name: str, batch_size: int, *, small: bool = False, device: Any = "@numpy",
            cost_model: str = "measured", seed: int = 0, capture_batch: Optional[int] = None):
    """A registry network ready for a comparison: ``(make, x, t, graph)``.

    ``make()`` builds the same initial model every time (seeded), on
    ``device``; ``x, t`` are one batch of inputs; ``graph`` is captured from
    one such model (lazily shaped parameters initialised first, by a
    forward at the capture batch), at ``capture_batch`` and scaled linearly
    to ``batch_size`` when given. Nothing runs at ``batch_size`` here.
    """
    import numpy

    from .runtime.capture import capture
    from .models import get_model
    device = chainer.get_device(device)
    device.use()

    def make() -> chainer.Link:
        numpy.random.seed(seed)
        link = get_model(name, batch_size=batch_size, small=small).link
        link.to_device(device)
        return link

    spec = get_model(name, batch_size=batch_size, small=small)
    x, t = spec.make_inputs(batch_size, xp=device.xp, seed=seed)
    link = make()
    small_batch = capture_batch is not None and capture_batch < batch_size
    xs, ts = spec.make_inputs(capture_batch, xp=device.xp, seed=seed) if small_batch else (x, t)
    with chainer.no_backprop_mode():
        link(xs, ts)  # lazily shaped parameters
    graph = capture(link, xs, ts, cost_model=cost_model, name=name)
    return make, x, t, graph.scale_batch(batch_size) if small_batch else graph


# --------------------------------------------------------- dry-run graphs
@dataclass(frozen=True)
class InputSizes:
    """How a fully convolutional registry network is recorded at smaller
    input sizes: ``full`` is the network's input side; ``samples`` are
    three smaller sides in the same residue class of its downsampling (so
    that every array's side is the same affine function of the input side
    at all of them and at ``full``), the first two fitted, the third
    checked; ``label`` gives the label side for an input side."""

    full: int
    samples: Tuple[int, int, int]
    label: Callable[[int], int]


#: PSPNet: output stride 8 (713 = 8*89 + 1) and pyramid bins 1, 2, 3, 6, so
#: feature sides that are multiples of 6 (36, 30, 24 at 281, 233, 185).
#: U-Net: valid convolutions and four 2x2 poolings: sides 16k + 12; its
#: labels are 184 pixels narrower.
INPUT_SIZES: Dict[str, InputSizes] = {
    "pspnet": InputSizes(713, (281, 233, 185), lambda s: s),
    "unet": InputSizes(572, (300, 252, 204), lambda s: s - 184),
}


class _Counter(chainer.FunctionHook):
    """Counts function applications for a progress step."""

    def __init__(self) -> None:
        self.name = f"chainer_recompute.bench.Counter-{id(self):x}"
        self.on_forward: Optional[Callable[[], None]] = None
        self.on_backward: Optional[Callable[[], None]] = None
        self.depth = 0

    def forward_preprocess(self, function: Any, in_data: Any) -> None:
        self.depth += 1

    def forward_postprocess(self, function: Any, in_data: Any) -> None:
        self.depth -= 1
        if self.depth == 0 and self.on_forward is not None:
            self.on_forward()

    def backward_postprocess(self, function: Any, in_data: Any, out_grad: Any) -> None:
        if self.on_backward is not None:
            self.on_backward()


def _record(link: chainer.Link, x: Any, t: Any, *, cost_model: str, name: str,
            optimizer: Any, progress: Progress, label: str,
            expect: Optional[int] = None) -> Graph:
    """One recorded training iteration (forward, cleared gradients,
    backward) of a throwaway model, as :func:`capture` would record it but
    without putting the model back afterwards (nothing is copied)."""
    from .runtime.capture import Recorder, state_bytes
    counter = _Counter()
    rec = Recorder(link=link, args=[x, t])
    with progress.step(f"{label}: forward", total=expect, unit="functions") as step:
        counter.on_forward = step.update
        with rec, counter, warnings.catch_warnings():
            # BatchNorm over a single value per channel (PSPNet's 1x1 bin at batch 1).
            warnings.filterwarnings("ignore", message="A batch with no more than one sample")
            loss = link(x, t)
        rec.finish()
    n = len(rec.calls)
    sb = state_bytes(link)
    link.cleargrads()  # as an updater does between the forward and the backward
    with progress.step(f"{label}: backward", total=n, unit="functions") as step:
        counter.on_forward, counter.on_backward = None, step.update
        with counter, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="A batch with no more than one sample")
            loss.backward()
    del loss
    return rec.graph(cost_model=cost_model, batch_size=int(x.shape[0]), name=name,
                     facts={"state_bytes": sb})


def dry_run_graph(name: str, batch_size: int, *, small: bool = False, device: Any = "@numpy",
                  cost_model: str = "measured", seed: int = 0, capture_batch: int = 2,
                  input_size: str = "auto", progress: Optional[Progress] = None
                  ) -> Tuple[Graph, Dict[str, Any]]:
    """The graph of a registry network at ``batch_size`` without running it
    at that size: recorded at ``capture_batch`` and scaled (not 1 where the
    batch is larger: at batch 1 NumPy's convolutions make one column buffer
    fewer, so the scaled graph under-counts; the CLI refuses it); for the
    networks of :data:`INPUT_SIZES` (full size, ``input_size='auto'``)
    also recorded at three smaller input sizes and extrapolated.

    The model is built with a ``MomentumSGD`` optimizer (the one the CLI's
    iterations use) so that the optimizer state is counted.

    Returns:
        ``(graph, info)``; ``info`` says how it was recorded
        (``capture_batch``, ``input_sizes``, ``capture_s``).

    Raises:
        CaptureError: the network's graph changes with the input size in a
            way that cannot be extrapolated (use ``input_size='full'``).
    """
    import numpy
    from .models import get_model
    if input_size not in ("auto", "full"):
        raise ValueError(f"input_size must be 'auto' or 'full', got {input_size!r}")
    progress = progress if progress is not None else Progress(enabled=False)
    device = chainer.get_device(device)
    device.use()
    cb = max(1, min(int(capture_batch), int(batch_size)))
    numpy.random.seed(seed)
    spec = get_model(name, batch_size=batch_size, small=small)
    link = spec.link
    link.to_device(device)
    optimizer = chainer.optimizers.MomentumSGD(lr=1e-4)
    optimizer.setup(link)
    sizes = INPUT_SIZES.get(name) if (input_size == "auto" and not small) else None
    t0 = time.perf_counter()
    info: Dict[str, Any] = {"capture_batch": cb, "batch_size": batch_size,
                            "input_shape": list(spec.input_shape)}
    rng = numpy.random.RandomState(seed)

    def inputs(side: Optional[int]) -> Tuple[Any, Any]:
        shape, label = tuple(spec.input_shape), tuple(spec.label_shape)
        if side is not None:
            shape = shape[:-2] + (side, side)
            label = label[:-2] + (sizes.label(side),) * 2
        x = rng.standard_normal((cb,) + shape).astype(numpy.float32)
        t = rng.randint(0, spec.n_class, size=(cb,) + label).astype(numpy.int32)
        return device.send(x), device.send(t)

    if sizes is None:
        x, t = inputs(None)
        graph = _record(link, x, t, cost_model=cost_model, name=name, optimizer=optimizer,
                        progress=progress, label=f"recording {name} at batch {cb}")
        info["input_sizes"] = None
    else:
        recorded = []
        expect = None
        for k, side in enumerate(sizes.samples):
            x, t = inputs(side)
            g = _record(link, x, t, cost_model=cost_model, name=name, optimizer=optimizer,
                        progress=progress, expect=expect,
                        label=f"recording {name} at batch {cb}, {side}x{side} "
                              f"({k + 1}/{len(sizes.samples)})")
            expect = g.n
            recorded.append((side, g))
            del x, t
        graph = extrapolate_input_size(recorded, sizes.full)
        info["input_sizes"] = list(sizes.samples)
    info["capture_s"] = time.perf_counter() - t0
    if cb != batch_size:
        graph = graph.scale_batch(batch_size)
    meta = dict(graph.meta)
    meta["dry_run"] = {k: v for k, v in info.items() if k != "capture_s"}
    return graph.replace(meta=meta, backward_order=graph.backward_order), info


def _affine(v1: int, v2: int, s1: int, s2: int, s: int) -> Optional[int]:
    """The value at ``s`` of the affine function through (s1, v1), (s2, v2),
    or None when it is not a non-negative integer."""
    num = (v2 - v1) * (s - s1)
    if num % (s2 - s1):
        return None
    v = v1 + num // (s2 - s1)
    return v if v >= 0 else None


def extrapolate_input_size(recorded: Sequence[Tuple[int, Graph]], side: int) -> Graph:
    """The graph of a fully convolutional network at input side ``side``
    from graphs recorded at smaller sides.

    Every array's shape is taken to be an affine function of the input side
    (exact for convolutions, poolings and resizes when the sides are in the
    same residue class of the network's downsampling): fitted on the first
    two graphs, checked on every other one. Bytes follow from the shapes;
    each node's transient bytes are scaled by how much its inputs and
    outputs grew from the first (largest) graph, and its measured times
    follow a fixed cost per call plus a cost per byte, fitted on the first
    two graphs.

    Args:
        recorded: ``(input side, graph)`` pairs, at least two, the same
            batch, the largest first.
        side: the input side wanted.

    Raises:
        CaptureError: the graphs differ in structure, or a shape is not
            affine in the input side (the check graph disagrees).

    >>> def chain(s):  # two functions whose outputs have side s and s - 2
    ...     from chainer_recompute.core.graph import ArrayInfo, Node
    ...     arrays = [ArrayInfo(0, (1, s), 'float32', 4 * s, 'input'),
    ...               ArrayInfo(1, (1, s), 'float32', 4 * s, 'intermediate', 0),
    ...               ArrayInfo(2, (1, s - 2), 'float32', 4 * (s - 2), 'output', 1)]
    ...     nodes = [Node(0, 'ReLU', (0,), (1,)), Node(1, 'Crop', (1,), (2,))]
    ...     return Graph(arrays, nodes, batch_size=1)
    >>> g = extrapolate_input_size([(20, chain(20)), (12, chain(12)), (8, chain(8))], 100)
    >>> [a.shape for a in g.arrays], int(g.node_bytes.sum())
    ([(1, 100), (1, 100), (1, 98)], 792)
    """
    import numpy
    if len(recorded) < 2:
        raise ValueError("extrapolate_input_size needs graphs at two input sizes at least")
    (s1, g1), (s2, g2) = recorded[0], recorded[1]
    for s, g in recorded[1:]:
        _same_structure(g1, g, s1, s)

    def shape_at(sh1: Any, sh2: Any, what: str) -> Any:
        if sh1 is None or sh2 is None:
            return sh1
        out = []
        for d1, d2 in zip(sh1, sh2):
            v = _affine(int(d1), int(d2), s1, s2, side)
            if v is None:
                raise CaptureError(f"{what} of {g1.meta.get('model', 'the graph')} has shape "
                                   f"{tuple(sh1)} at input side {s1} and {tuple(sh2)} at "
                                   f"{s2}, which does not extrapolate to side {side}; "
                                   f"record it at full size")
            out.append(v)
        return tuple(out)

    def nbytes_of(shape: Any, dtype: str, old_shape: Any, old: int) -> int:
        if shape is None:
            return old
        count = int(numpy.prod(shape, dtype=numpy.int64)) if len(shape) else 1
        try:
            return count * numpy.dtype(dtype).itemsize
        except TypeError:
            old_count = int(numpy.prod(old_shape, dtype=numpy.int64)) if len(old_shape) else 1
            return old * count // max(old_count, 1)

    checks = recorded[2:]
    arrays = []
    for a1, a2 in zip(g1.arrays, g2.arrays):
        shape = shape_at(a1.shape, a2.shape, f"array {a1.id}")
        for s, g in checks:
            want = g.arrays[a1.id].shape
            if shape is not None and want is not None and tuple(
                    _affine(int(d1), int(d2), s1, s2, s) for d1, d2 in zip(a1.shape, a2.shape)
            ) != tuple(want):
                raise CaptureError(
                    f"array {a1.id} of {g1.meta.get('model', 'the graph')} (made by "
                    f"{g1.nodes[a1.producer].op if a1.producer is not None else 'the caller'}) "
                    f"has shape {tuple(want)} at input side {s}, not the affine fit of sides "
                    f"{s1} and {s2}; record it at full size")
        arrays.append(replace(a1, shape=shape,
                              nbytes=nbytes_of(shape, a1.dtype, a1.shape, a1.nbytes)))

    def io_bytes(graph_arrays: Sequence[ArrayInfo], node: Any) -> int:
        return sum(graph_arrays[a].nbytes for a in node.inputs + node.outputs
                   if graph_arrays[a].kind != "param")

    def scaled(v: Optional[int], r: float) -> Optional[int]:
        return None if v is None else int(round(v * r))

    def time_at(t1: Optional[float], t2: Optional[float], io: int, io1: int, io2: int,
                r: float) -> Optional[float]:
        # A fixed cost per call plus a cost per byte, fitted on the two
        # graphs; the plain ratio where that fit is not increasing.
        if t1 is None:
            return None
        if t2 is not None and io1 > io2 and t1 > t2:
            return t1 + (t1 - t2) * (io - io1) / (io1 - io2)
        return t1 * r

    made = g1.param_grad_bytes_made()
    nodes = []
    for n1, n2 in zip(g1.nodes, g2.nodes):
        held = tuple(replace(h1, shape=shape_at(h1.shape, h2.shape, f"{n1.op} {h1.name}"),
                             nbytes=nbytes_of(shape_at(h1.shape, h2.shape, h1.name), h1.dtype,
                                              h1.shape, h1.nbytes))
                     for h1, h2 in zip(n1.held, n2.held))
        io, io1, io2 = (io_bytes(arrays, n1), io_bytes(g1.arrays, n1), io_bytes(g2.arrays, n2))
        r = io / max(io1, 1)
        nodes.append(replace(
            n1, held=held,
            forward_time_s=time_at(n1.forward_time_s, n2.forward_time_s, io, io1, io2, r),
            backward_time_s=time_at(n1.backward_time_s, n2.backward_time_s, io, io1, io2, r),
            forward_transient_bytes=scaled(n1.forward_transient_bytes, r),
            backward_transient_bytes=scaled(n1.backward_transient_bytes, r),
            backward_alloc_bytes=(None if n1.backward_alloc_bytes is None else
                                  made[n1.id] + int(round((n1.backward_alloc_bytes
                                                           - made[n1.id]) * r)))))
    meta = dict(g1.meta)
    meta["extrapolated"] = {"from_input_sides": [s for s, _ in recorded], "to_input_side": side}
    return Graph(arrays, nodes, batch_size=g1.batch_size, cost_model=g1.cost_model,
                 meta=meta, step=g1.step, backward_order=g1.backward_order)


def _same_structure(g1: Graph, g: Graph, s1: int, s: int) -> None:
    """Raise CaptureError where ``g`` is not ``g1``'s graph at another size."""
    def fail(what: str) -> None:
        raise CaptureError(f"the graph of {g1.meta.get('model', 'the model')} changes with the "
                           f"input size ({what} differs between sides {s1} and {s}); it "
                           f"cannot be extrapolated: record it at full size")
    if g.n != g1.n or len(g.arrays) != len(g1.arrays):
        fail(f"{g1.n} vs {g.n} functions, {len(g1.arrays)} vs {len(g.arrays)} arrays")
    for a, b in zip(g1.arrays, g.arrays):
        same = ((a.kind, a.producer, a.view_of, a.dies_at, a.name, a.dtype)
                == (b.kind, b.producer, b.view_of, b.dies_at, b.name, b.dtype))
        if a.shape is None or b.shape is None:
            same = same and a.shape is b.shape
        else:
            same = same and len(a.shape) == len(b.shape)
            same = same and (a.kind != "param" or a.shape == b.shape)
        if not same:
            fail(f"array {a.id}")
    for u, v in zip(g1.nodes, g.nodes):
        key_u = (u.op, u.inputs, u.outputs, u.retained_inputs, u.retained_outputs,
                 u.recomputable, u.has_backward, [(h.name, h.role, h.dtype) for h in u.held])
        key_v = (v.op, v.inputs, v.outputs, v.retained_inputs, v.retained_outputs,
                 v.recomputable, v.has_backward, [(h.name, h.role, h.dtype) for h in v.held])
        if key_u != key_v:
            fail(f"function {u.id} ({u.op})")
    if g1.backward_order != g.backward_order:
        fail("the backward order")


class _Runner:
    """One configuration under measurement: a model and its optimizer."""

    def __init__(self, link: chainer.Link, label: str, as_updater: bool = False) -> None:
        self.link, self.label = link, label
        self.as_updater = as_updater
        self.optimizer = chainer.optimizers.MomentumSGD(lr=1e-4)
        self.optimizer.setup(link)
        self.times: List[float] = []
        self.peaks: List[int] = []
        self.totals: List[int] = []
        self.loss = float("nan")

    def step(self, x: Any, t: Any) -> None:
        dev = device_of([x])
        if not self.as_updater:
            self.link.cleargrads()
        gc.collect()
        dev.synchronize()
        state = model_state_bytes(self.link, self.optimizer)
        start = (state["params"] + state["grads"] + state["optimizer_state"]
                 + dev.allocation_bytes(x.nbytes) + dev.allocation_bytes(t.nbytes))
        with dev.meter() as meter:
            t0 = time.perf_counter()
            loss = self.link(x, t)
            if self.as_updater:
                self.link.cleargrads()
            loss.backward()
            self.optimizer.update()
            dev.synchronize()
            elapsed = time.perf_counter() - t0
            self.loss = float(loss.array)
            del loss
        self.times.append(elapsed)
        self.peaks.append(meter.result.peak_bytes)
        self.totals.append(start + meter.result.peak_bytes)

    def result(self) -> RunResult:
        # Not steady: plain Chainer's first iteration (allocations made
        # once); with recomputation also the second, which plans (the
        # solver's time and working memory) after the first recorded.
        warmup = 2 if runner_of(self.link) is not None else 1
        k = min(warmup, len(self.times) - 1)
        steady, steady_peaks, steady_totals = self.times[k:], self.peaks[k:], self.totals[k:]
        return RunResult(label=self.label, peak_bytes=max(steady_peaks),
                         time_s=statistics.mean(steady), times_s=list(self.times),
                         loss=self.loss, first_iteration_s=self.times[0],
                         first_iteration_peak_bytes=self.peaks[0],
                         total_peak_bytes=max(steady_totals))


def gradients_match(make_link: Any, x: Any, t: Any, budget: Any, **options: Any) -> bool:
    """Two steps of plain backprop and two with recomputation (the first
    call records the graph, the second runs the plan), from the same
    parameters and random states (NumPy's and CuPy's seeded alike): are the
    losses and all gradients of both steps bit-for-bit equal, and did the
    second step follow its plan?"""
    plain = make_link()
    plain(x, t)
    ours = copy.deepcopy(plain)
    apply(ours, budget=budget, **options)
    xp = backend.get_array_module(x)
    for step in range(2):
        results = []
        for model in (plain, ours):
            seed_all(step)
            model.cleargrads()
            loss = model(x, t)
            loss.backward()
            results.append((loss.array, {n: p.grad for n, p in model.namedparams()}))
        (l1, g1), (l2, g2) = results
        if not (bool(xp.array_equal(l1, l2)) and all(
                bool(xp.array_equal(g1[k], g2[k])) for k in g1)):
            return False
    stats = runner_of(ours).last_stats
    return stats is not None and stats.path == "planned"


def compare(make_link: Any, x: Any, t: Any, configs: List[Dict[str, Any]],
            iterations: int = 5, vanilla: bool = True,
            on_step: Optional[Callable[[], None]] = None,
            as_updater: bool = False) -> List[RunResult]:
    """Vanilla and each recompute configuration (``dict(budget=...,
    solver=..., strategy=..., label=...)``) on copies of the same model, in
    this process. Iterations are interleaved (vanilla, then each
    configuration, round after round) so that a change in the machine's
    load affects all alike; ``on_step()`` is called after each.

    ``as_updater=True`` runs each step as Chainer's ``StandardUpdater``
    does (forward, clear the gradients, backward, update: the previous
    gradients live through the forward) under one meter for all the
    iterations, so that ``total_peak_bytes`` measures what
    :func:`~chainer_recompute.core.replay.replay` predicts; otherwise the
    gradients are cleared before each step (``peak_bytes`` as before)."""
    base = make_link()
    # lazily shaped parameters, initialised by a forward on two rows
    # without a graph or state updates: a forward at the full batch would
    # hold plain Chainer's activations, more than the plan needs
    with chainer.no_backprop_mode(), chainer.using_config("train", False):
        base(x[:2], t[:2])
    runners = []
    if vanilla:
        runners.append(_Runner(copy.deepcopy(base), "vanilla", as_updater))
    for cfg in configs:
        cfg = dict(cfg)
        label = cfg.pop("label", f"{cfg.get('solver', 'approx')}-{cfg.get('strategy', 'tc')}")
        runners.append(_Runner(apply(copy.deepcopy(base), **cfg), label, as_updater))
    # One meter over all the iterations (as_updater): the frees of the
    # gradients an earlier iteration made are seen.
    outer = device_of([x]).meter() if as_updater else None
    if outer is not None:
        outer.start()
    try:
        for _ in range(iterations):
            for r in runners:
                r.step(x, t)
                if on_step is not None:
                    on_step()
    finally:
        if outer is not None:
            outer.stop()
    state = model_state_bytes(base)
    results = []
    for r in runners:
        res = r.result()
        runner = runner_of(r.link)
        if runner is not None:
            res.plan = runner.plan_for(r.link, x, t)
            res.extra["stats"] = runner.last_stats
        res.extra["state"] = state
        results.append(res)
    return results

