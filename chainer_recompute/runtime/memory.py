"""Measured peak memory of arrays, on NumPy (tracemalloc) and CuPy (pool hook).

NumPy registers every data allocation with :mod:`tracemalloc` under its own
domain (``numpy.lib.tracemalloc_domain`` = 389047). ``tracemalloc``'s
``get_traced_memory()`` counts all domains together, Python objects included,
and keeps no peak per domain. To measure arrays alone, the outermost meter
starts ``tracemalloc`` and then puts back the interpreter's own allocators
(``PyMem_SetAllocator`` through :mod:`ctypes`, with the allocators read just
before the start): Python objects are no longer traced, while NumPy's
``PyTraceMalloc_Track`` calls still are, so the traced current and peak are
array bytes only. This also keeps the tracing cheap. Where that is not
possible (tracing already started by someone else, another interpreter than
CPython, ``numpy_only=False``) the numbers include Python objects and the
result's ``scope`` says so.

On CuPy, a ``cupy.cuda.MemoryHook`` records the largest ``used_bytes()`` of
the memory pool after every allocation, as Kusumoto et al. measured one
training iteration, and the largest ``total_bytes()`` (what the pool holds
from the device: used blocks, cached free blocks and the free parts of split
ones). CuPy is imported only when a GPU meter is made.

Arrays allocated before tracing began are invisible to ``tracemalloc``; to
count them in ``start_bytes``, start an outer :class:`MemoryMeter` before
creating them. Meters nest; they are not thread-safe.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import sys
import sysconfig
import tracemalloc
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

from ..core.errors import RecomputeError
from ..core.units import format_bytes

logger = logging.getLogger(__name__)

__all__ = ["MemoryMeasurement", "MemoryMeter", "measure_memory", "model_state_bytes",
           "parameter_bytes", "format_memory_report", "NUMPY_TRACEMALLOC_DOMAIN"]

#: The tracemalloc domain of NumPy's data allocations (``np.lib.tracemalloc_domain``).
NUMPY_TRACEMALLOC_DOMAIN = 389047

SCOPE_NUMPY = "numpy arrays"
SCOPE_TRACED = "numpy arrays + python objects"
SCOPE_CUPY = "cupy memory pool"


@dataclasses.dataclass(frozen=True)
class MemoryMeasurement:
    """Array memory measured over one block of code.

    Attributes:
        peak_bytes: the highest bytes live during the block minus
            ``start_bytes``: what the block itself added at its worst.
        absolute_peak_bytes: the highest bytes live during the block,
            counting ``start_bytes``.
        start_bytes: bytes live at entry (on CPU: only arrays allocated
            since tracing began, see the module docstring).
        end_bytes: bytes live at exit.
        device: ``'cpu'`` or ``'gpu'``.
        scope: what was counted: ``'numpy arrays'``, ``'numpy arrays +
            python objects'`` or ``'cupy memory pool'``.
        total_peak_bytes: on CuPy, the highest ``total_bytes()`` of the pool
            (None on CPU).
        start_total_bytes: on CuPy, the pool's ``total_bytes()`` at entry.
    """

    peak_bytes: int
    absolute_peak_bytes: int
    start_bytes: int
    end_bytes: int
    device: str
    scope: str
    total_peak_bytes: Optional[int] = None
    start_total_bytes: Optional[int] = None

    @property
    def retained_bytes(self) -> int:
        """``end_bytes - start_bytes``: what the block left allocated."""
        return self.end_bytes - self.start_bytes


# --------------------------------------------------------------------------
# CPU: tracemalloc with Python's own allocators put back.

class _PyMemAllocatorEx(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("ctx", "malloc", "calloc", "realloc", "free")]


_PYMEM_DOMAINS = (0, 1, 2)  # PYMEM_DOMAIN_RAW, _MEM, _OBJ


def _pymem_functions() -> Optional[tuple]:
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    try:
        get = ctypes.pythonapi.PyMem_GetAllocator
        put = ctypes.pythonapi.PyMem_SetAllocator
    except (AttributeError, OSError):
        return None
    for f in (get, put):
        f.argtypes = [ctypes.c_int, ctypes.POINTER(_PyMemAllocatorEx)]
        f.restype = None
    return get, put


class _Tracing:
    """Module state shared by nested CPU meters."""

    active: List["MemoryMeter"] = []
    owner: Optional["MemoryMeter"] = None  # the meter that started tracemalloc
    baseline: int = 0  # traced bytes that are not arrays (left from the start window)
    scope: str = SCOPE_TRACED


def _start_tracemalloc(numpy_only: bool) -> str:
    """Start tracemalloc; with ``numpy_only``, stop tracing Python objects."""
    functions = _pymem_functions() if numpy_only else None
    if functions is None:
        tracemalloc.start()
        if numpy_only:
            logger.info("cannot restrict tracemalloc to NumPy's domain here; "
                        "measured bytes include Python objects")
        return SCOPE_TRACED
    get, put = functions
    saved = [_PyMemAllocatorEx() for _ in _PYMEM_DOMAINS]
    for domain, alloc in zip(_PYMEM_DOMAINS, saved):
        get(domain, ctypes.byref(alloc))
    tracemalloc.start()
    for domain, alloc in zip(_PYMEM_DOMAINS, saved):
        put(domain, ctypes.byref(alloc))
    return SCOPE_NUMPY


def _track_function() -> Any:
    if sys.implementation.name != "cpython":
        return None
    try:
        f = ctypes.pythonapi.PyTraceMalloc_Track
    except AttributeError:
        return None
    f.argtypes = [ctypes.c_uint, ctypes.c_size_t, ctypes.c_size_t]
    f.restype = ctypes.c_int
    return f


_TRACK = _track_function()


def _untrack_function() -> Any:
    if _TRACK is None:
        return None
    f = ctypes.pythonapi.PyTraceMalloc_Untrack
    f.argtypes = [ctypes.c_uint, ctypes.c_size_t]
    f.restype = ctypes.c_int
    return f


_UNTRACK = _untrack_function()


def _np() -> Any:
    import numpy
    return numpy


def _propagate_peak() -> int:
    """Give every active meter the tracemalloc peak so far; return the current bytes."""
    current, peak = tracemalloc.get_traced_memory()
    for meter in _Tracing.active:
        meter._max_seen = max(meter._max_seen, peak)
    return current


class MemoryMeter:
    """Peak array bytes over a block of code, on CPU or GPU.

    Use as a ``with`` block or with :meth:`start`/:meth:`stop`; the
    measurement is in :attr:`result` afterwards (also after an exception).

    Args:
        xp: ``numpy`` (default) or ``cupy``, or ``'cpu'``/``'gpu'``.
        numpy_only: on CPU, count NumPy arrays only (see the module
            docstring); False counts Python objects too.
        cupy_module: the CuPy module to use on GPU (for tests); imported
            when needed by default.

    >>> import numpy as np
    >>> with MemoryMeter() as meter:
    ...     a = np.empty(10**6, np.uint8); a.fill(1); del a
    ...     b = np.empty(10**5, np.uint8)
    >>> meter.result.peak_bytes, meter.result.end_bytes, meter.result.device
    (1000000, 100000, 'cpu')
    """

    name = "MemoryMeter"

    def __init__(self, xp: Any = None, *, numpy_only: bool = True,
                 cupy_module: Any = None) -> None:
        self.device = _device_of(xp)
        self.numpy_only = numpy_only
        self._cupy = cupy_module
        self._running = False
        self._max_seen = 0
        self._start = 0
        self._hook: Any = None
        self.scope = SCOPE_CUPY if self.device == "gpu" else None
        self.result: Optional[MemoryMeasurement] = None

    # -- public ---------------------------------------------------------
    @property
    def start_bytes(self) -> int:
        """Bytes live when :meth:`start` was called (as ``result.start_bytes``)."""
        return self._start

    @property
    def owns_tracing(self) -> bool:
        """On CPU, whether this meter started tracemalloc (no outer meter
        or other tracer sees the arrays it adopts with :meth:`adopt`)."""
        return self.device == "cpu" and self._running and bool(getattr(self, "_owns", False))

    def current_bytes(self) -> int:
        """Bytes live now, as ``start_bytes`` counts them (the meter runs)."""
        if self.device == "gpu":
            return int(self._hook.level)
        return tracemalloc.get_traced_memory()[0] - _Tracing.baseline

    def untraced(self, arrays: Any) -> List[Any]:
        """On CPU, while this meter runs in NumPy's scope (only arrays
        traced) and does not own the tracing: the arrays of ``arrays`` that
        own their data and were made before the tracing began (an outer
        meter started after them), whose frees no meter sees; each told
        by taking its trace away and putting it back, which changes no
        meter's figures. Empty otherwise (where Python objects are traced
        too, the objects that telling makes would blur it)."""
        if (self.device != "cpu" or not self._running or self.owns_tracing
                or self.scope != SCOPE_NUMPY or _UNTRACK is None):
            return []
        found, seen = [], set()
        for a in arrays:
            if not isinstance(a, _np().ndarray) or a.base is not None or id(a) in seen:
                continue
            seen.add(id(a))
            before = tracemalloc.get_traced_memory()[0]
            _UNTRACK(NUMPY_TRACEMALLOC_DOMAIN, a.ctypes.data)
            gone = before - tracemalloc.get_traced_memory()[0]
            if gone > 0:
                _TRACK(NUMPY_TRACEMALLOC_DOMAIN, a.ctypes.data, gone)
            else:
                found.append(a)
        return found

    def checkpoint(self) -> int:
        """On CPU while running: the absolute peak so far (as
        ``result.absolute_peak_bytes`` would give it); from now on this
        meter's peak starts again from the bytes live now (the meters
        around it and inside it keep theirs)."""
        current = _propagate_peak()
        peak = self._max_seen - _Tracing.baseline
        tracemalloc.reset_peak()
        self._max_seen = current
        return peak

    def adopt(self, arrays: Any) -> int:
        """On CPU, trace NumPy arrays made before tracing began, as if they
        had been allocated now: their frees are then seen (NumPy untraces
        every block it frees). Only while this meter owns the tracing (it
        changes no one else's measurement). Returns the bytes adopted.
        """
        if not self.owns_tracing or _TRACK is None:
            return 0
        done = 0
        seen: set = set()
        for a in arrays:
            while getattr(a, "base", None) is not None:
                a = a.base
            if not isinstance(a, _np().ndarray) or not a.flags.owndata or id(a) in seen:
                continue
            seen.add(id(a))
            if _TRACK(NUMPY_TRACEMALLOC_DOMAIN, a.ctypes.data, max(int(a.nbytes), 1)) == 0:
                done += int(a.nbytes)
        return done

    def start(self) -> "MemoryMeter":
        """Begin measuring; returns self."""
        if self._running:
            raise RecomputeError("this MemoryMeter is already running; make a new one "
                                 "for a nested measurement")
        self.result = None
        if self.device == "gpu":
            self._hook = make_pool_peak_hook(self._cupy)
            self._hook.__enter__()
            self._start = self._hook.start_bytes
        else:
            self._start_cpu()
        self._running = True
        return self

    def stop(self) -> MemoryMeasurement:
        """End measuring and return (and keep in :attr:`result`) the measurement."""
        if not self._running:
            raise RecomputeError("MemoryMeter.stop() called on a meter that is not "
                                 "running; call start() first")
        self._running = False
        if self.device == "gpu":
            hook = self._hook
            hook.__exit__(None, None, None)
            self.result = MemoryMeasurement(
                peak_bytes=hook.max_used_bytes - hook.start_bytes,
                absolute_peak_bytes=hook.max_used_bytes, start_bytes=hook.start_bytes,
                end_bytes=hook.end_bytes, device="gpu", scope=SCOPE_CUPY,
                total_peak_bytes=hook.max_total_bytes, start_total_bytes=hook.start_total_bytes)
        else:
            self.result = self._stop_cpu()
        logger.debug("measured %s", self.result)
        return self.result

    def __enter__(self) -> "MemoryMeter":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        if self._running:
            self.stop()

    # -- CPU ------------------------------------------------------------
    def _start_cpu(self) -> None:
        self._owns = False
        if not tracemalloc.is_tracing():
            scope = _start_tracemalloc(self.numpy_only)
            self._owns = True
            _Tracing.owner = self
            _Tracing.scope = scope
            _Tracing.baseline = tracemalloc.get_traced_memory()[0] if scope == SCOPE_NUMPY else 0
        elif _Tracing.owner is None:
            # Someone else traces everything: take it as it is.
            _Tracing.scope = SCOPE_TRACED
            _Tracing.baseline = 0
            logger.info("tracemalloc was already running; measured bytes include "
                        "Python objects and its peak is reset")
        self.scope = _Tracing.scope
        _propagate_peak()  # outer meters keep the peak that reset_peak() will drop
        tracemalloc.reset_peak()
        current = tracemalloc.get_traced_memory()[0]
        self._start = current - _Tracing.baseline
        self._max_seen = current
        _Tracing.active.append(self)

    def _stop_cpu(self) -> MemoryMeasurement:
        current = _propagate_peak()
        if self in _Tracing.active:
            _Tracing.active.remove(self)
        baseline = _Tracing.baseline
        absolute_peak = self._max_seen - baseline
        result = MemoryMeasurement(
            peak_bytes=absolute_peak - self._start, absolute_peak_bytes=absolute_peak,
            start_bytes=self._start, end_bytes=current - baseline, device="cpu",
            scope=self.scope)
        if self._owns and _Tracing.active:
            # Meters started inside this one still run (a meter kept across
            # several blocks): tracing goes on, owned by the oldest of them.
            self._owns = False
            heir = _Tracing.active[0]
            heir._owns = True
            _Tracing.owner = heir
        elif self._owns:
            tracemalloc.stop()
            _Tracing.owner = None
            _Tracing.baseline = 0
        elif not _Tracing.active and _Tracing.owner is None:
            _Tracing.baseline = 0
        return result


@contextlib.contextmanager
def measure_memory(xp: Any = None, *, numpy_only: bool = True,
                   cupy_module: Any = None) -> Iterator[MemoryMeter]:
    """Measure the peak array bytes of a block; the result is in ``.result``.

    Args:
        xp: ``numpy`` (default), ``cupy``, ``'cpu'`` or ``'gpu'``.
        numpy_only: see :class:`MemoryMeter`.
        cupy_module: see :class:`MemoryMeter`.

    Yields:
        The running :class:`MemoryMeter`; its ``result`` is set on exit.

    >>> import numpy as np
    >>> with measure_memory() as m:
    ...     x = np.empty(10**7, np.uint8); x.fill(0); del x
    >>> m.result.peak_bytes
    10000000
    """
    meter = MemoryMeter(xp, numpy_only=numpy_only, cupy_module=cupy_module)
    meter.start()
    try:
        yield meter
    finally:
        meter.stop()


def _device_of(xp: Any) -> str:
    if xp is None:
        return "cpu"
    if isinstance(xp, str):
        key = xp.lower()
        if key in ("cpu", "numpy", "np"):
            return "cpu"
        if key in ("gpu", "cuda", "cupy"):
            return "gpu"
        raise RecomputeError(f"unknown device {xp!r} for memory measurement; expected "
                             f"numpy, cupy, 'cpu' or 'gpu'")
    name = getattr(xp, "__name__", "")
    if name == "numpy":
        return "cpu"
    if name.startswith("cupy"):
        return "gpu"
    raise RecomputeError(f"cannot measure memory for array module {name or xp!r}; "
                         f"expected numpy or cupy")


# --------------------------------------------------------------------------
# GPU: a memory hook on CuPy's pool.

class _PoolPeak:
    """The pool's largest used and total bytes while the hook is active (no
    CuPy needed).

    CuPy 14's ``used_bytes()`` sums every chunk in use and ``total_bytes()``
    every chunk, so reading them after each allocation made a metered step
    quadratic in its arrays (on an H200, ResNet152 b32's metered planned
    steps ran at 3-4 times plain Chainer's time; the meter's share of that
    was not measured). The hook reads them once at
    its start and keeps the used bytes from the sizes CuPy passes to its
    hooks: a ``malloc`` adds the chunk's ``mem_size``, a ``free`` takes it
    back (the pool's used bytes are the sum of the sizes of its chunks in
    use, each the rounded size of its request). The total grows only when
    the pool takes a new allocation from the device (``alloc``, reported
    before that chunk enters the pool's books), so it is read again after
    the next ``malloc`` that follows one: its highest value is always just
    after such a growth. With ``device_id``, events of other devices' pools
    (which the hooks see too) are left out.
    """

    name = "PoolPeakHook"

    def __init__(self, pool: Any, device_id: Optional[int] = None) -> None:
        self.pool = pool
        self.device_id = device_id
        self.start_bytes = int(pool.used_bytes())
        self.start_total_bytes = int(pool.total_bytes())
        self.level = self.start_bytes
        self.max_used_bytes = self.start_bytes
        self.max_total_bytes = self.start_total_bytes
        self.end_bytes = self.start_bytes
        self._grew = False

    def _other_device(self, device_id: Optional[int]) -> bool:
        return self.device_id is not None and device_id is not None and \
            device_id != self.device_id

    def alloc_postprocess(self, mem_size: int = 0, mem_ptr: int = 0,
                          device_id: Optional[int] = None, **kwargs: Any) -> None:
        if mem_ptr and not self._other_device(device_id):
            self._grew = True

    def malloc_postprocess(self, mem_size: int = 0, mem_ptr: int = 0,
                           device_id: Optional[int] = None, **kwargs: Any) -> None:
        if not mem_ptr or self._other_device(device_id):
            return  # (a failed allocation; one of 0 bytes, outside the pool; another device)
        self.level += int(mem_size)
        if self.level > self.max_used_bytes:
            self.max_used_bytes = self.level
        if self._grew:
            self._grew = False
            total = int(self.pool.total_bytes())
            if total > self.max_total_bytes:
                self.max_total_bytes = total

    def free_postprocess(self, mem_size: int = 0, device_id: Optional[int] = None,
                         **kwargs: Any) -> None:
        if not self._other_device(device_id):
            self.level -= int(mem_size)

    def finish(self) -> None:
        self.end_bytes = int(self.pool.used_bytes())
        self.max_used_bytes = max(self.max_used_bytes, self.end_bytes)
        self.max_total_bytes = max(self.max_total_bytes, int(self.pool.total_bytes()))


_HOOK_CLASSES: Dict[int, type] = {}


def make_pool_peak_hook(cupy_module: Any = None, pool: Any = None) -> Any:
    """A ``cupy.cuda.MemoryHook`` recording the peak of the pool's ``used_bytes()``.

    Use it as a ``with`` block around the code to measure; afterwards
    ``start_bytes``, ``max_used_bytes`` and ``end_bytes`` hold the pool's
    used bytes at entry, at its highest, and at exit.

    Args:
        cupy_module: CuPy, or an object with ``cuda.MemoryHook`` and
            ``get_default_memory_pool`` (tests); imported by default.
        pool: the memory pool; the default pool by default.

    Raises:
        RecomputeError: if CuPy is not installed.

    >>> import cupy  # doctest: +SKIP
    >>> with make_pool_peak_hook(cupy) as hook:  # doctest: +SKIP
    ...     x = cupy.ones(10**6, cupy.float32); del x
    >>> hook.max_used_bytes - hook.start_bytes  # doctest: +SKIP
    4000256
    """
    if cupy_module is None:
        try:
            import cupy as cupy_module  # noqa: F811
        except ImportError as e:
            raise RecomputeError("measuring GPU memory needs CuPy, which cannot be "
                                 f"imported ({e}); install cupy or measure on CPU") from e
    base = cupy_module.cuda.MemoryHook
    cls = _HOOK_CLASSES.get(id(base))
    if cls is None:
        class PoolPeakHook(_PoolPeak, base):  # type: ignore[misc, valid-type]
            name = "PoolPeakHook"

            def __init__(self, pool: Any, device_id: Optional[int]) -> None:
                base.__init__(self)
                _PoolPeak.__init__(self, pool, device_id)
                # CuPy refuses two active hooks of one name: nested meters need their own.
                self.name = f"PoolPeakHook-{id(self):x}"

            def __exit__(self, *exc: Any) -> Any:
                self.finish()
                return base.__exit__(self, *exc)

        cls = _HOOK_CLASSES[id(base)] = PoolPeakHook
    device = getattr(cupy_module.cuda, "Device", None)  # (the current device's pool)
    return cls(pool if pool is not None else cupy_module.get_default_memory_pool(),
               None if device is None else int(device().id))


# --------------------------------------------------------------------------
# Model state and the report.

def _nbytes(array: Any) -> int:
    return int(getattr(array, "nbytes", 0) or 0)


def rule_arrays(rule: Any) -> List[Any]:
    """The arrays an update rule holds now: its state, and a
    ``use_fp32_update`` rule's float32 master copy (none of them before its
    first update)."""
    if rule is None or getattr(rule, "state", None) is None:
        return []
    held = list(rule.state.values())
    fp32 = getattr(rule, "_fp32_param", None)
    if fp32 is not None:
        held.append(fp32.array)
    return held


def parameter_bytes(params: Iterable[Any], *,
                    nbytes: Callable[[int], int] = int) -> Dict[str, int]:
    """Bytes of parameters and what goes with them now, each array counted
    once: a Parameter reached under two names or through two links (tied
    weights) counts once, and so does an array that several Parameters
    share.

    Args:
        params: ``chainer.Parameter`` objects (``link.params()``);
            uninitialised ones count nothing.
        nbytes: what an array of ``n`` bytes takes (its ``nbytes`` by
            default; :meth:`~chainer_recompute.runtime.device.Device.allocation_bytes`
            for what its device allocates).

    Returns:
        ``params``; ``grads`` (the gradient arrays held now);
        ``optimizer_state`` (the update rules' state arrays that exist now,
        a ``use_fp32_update`` rule's float32 master copy included; nothing
        before the first update: the state a rule will make is measured by
        :func:`~chainer_recompute.runtime.optimizer_update.update_bytes`).

    >>> import chainer.links as L
    >>> lin = L.Linear(3, 2)
    >>> parameter_bytes(list(lin.params()) * 2)["params"]  # tied: counted once
    32
    """
    seen_params: set = set()
    distinct = []
    for p in params:
        if p.array is not None and id(p) not in seen_params:
            seen_params.add(id(p))
            distinct.append(p)
    nb = nbytes
    seen: set = set()

    def count(a: Any) -> int:
        if a is None or not hasattr(a, "nbytes") or id(a) in seen:
            return 0
        seen.add(id(a))
        return nb(a.nbytes)

    out = {"params": 0, "grads": 0, "optimizer_state": 0}
    for p in distinct:
        out["params"] += count(p.array)
    for p in distinct:
        out["grads"] += count(p.grad)
    for p in distinct:
        held = rule_arrays(getattr(p, "update_rule", None))
        out["optimizer_state"] += sum(count(v) for v in held)
    return out


def model_state_bytes(link: Any, optimizer: Any = None) -> Dict[str, int]:
    """Bytes of a model's parameters, gradients and optimizer state, apart.

    Arrays shared by several parameters are counted once
    (:func:`parameter_bytes`). Optimizer state
    is read from each parameter's ``update_rule.state`` (Chainer >= 2) and
    from an ``optimizer._states`` dict where one exists; it is empty until
    the first ``update()``.

    Args:
        link: a ``chainer.Link``.
        optimizer: a ``chainer.Optimizer`` set up on ``link`` (or on a link
            containing it); None for no optimizer state.

    Returns:
        ``{'params': ..., 'grads': ..., 'optimizer_state': ...}`` in bytes.

    >>> import chainer.links as L
    >>> model_state_bytes(L.Linear(3, 2))
    {'params': 32, 'grads': 32, 'optimizer_state': 0}
    """
    own = parameter_bytes(link.params())
    params, grads, state = own["params"], own["grads"], 0
    if optimizer is not None:
        target = getattr(optimizer, "target", None) or link
        state = parameter_bytes(target.params())["optimizer_state"]
        seen: set = set()
        for states in (getattr(optimizer, "_states", None) or {}).values():
            for v in (states.values() if isinstance(states, dict) else [states]):
                if hasattr(v, "nbytes") and id(v) not in seen:
                    seen.add(id(v))
                    state += _nbytes(v)
    return {"params": params, "grads": grads, "optimizer_state": state}


def format_memory_report(measured: MemoryMeasurement, predicted_peak_bytes: Optional[float] = None,
                         state: Optional[Dict[str, int]] = None) -> str:
    """The measured peak next to the plan's predicted peak, with their ratio.

    The block's own peak (``peak_bytes``, above what was live at entry) is
    compared with the prediction.

    Args:
        measured: a :class:`MemoryMeasurement`.
        predicted_peak_bytes: the plan's predicted peak, or None.
        state: :func:`model_state_bytes`'s dict, or None.

    Returns:
        A few lines of text.

    >>> m = MemoryMeasurement(3 * 2**20, 4 * 2**20, 2**20, 2**20, 'cpu', 'numpy arrays')
    >>> print(format_memory_report(m, predicted_peak_bytes=2 * 2**20))
    measured peak (cpu, numpy arrays): 3.00 MiB above 1.00 MiB live at entry (absolute 4.00 MiB); 1.00 MiB at exit
    predicted peak: 2.00 MiB; measured / predicted = 1.50
    """
    lines = [f"measured peak ({measured.device}, {measured.scope}): "
             f"{format_bytes(measured.peak_bytes)} above {format_bytes(measured.start_bytes)} "
             f"live at entry (absolute {format_bytes(measured.absolute_peak_bytes)}); "
             f"{format_bytes(measured.end_bytes)} at exit"]
    if predicted_peak_bytes is not None:
        ratio = (f"{measured.peak_bytes / predicted_peak_bytes:.2f}"
                 if predicted_peak_bytes > 0 else "n/a")
        lines.append(f"predicted peak: {format_bytes(predicted_peak_bytes)}; "
                     f"measured / predicted = {ratio}")
    if state is not None:
        total = sum(state.values())
        lines.append(f"model state: params {format_bytes(state.get('params', 0))}, "
                     f"grads {format_bytes(state.get('grads', 0))}, optimizer state "
                     f"{format_bytes(state.get('optimizer_state', 0))} "
                     f"(total {format_bytes(total)})")
    return "\n".join(lines)
