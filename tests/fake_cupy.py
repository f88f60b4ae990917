"""A test double of the ``cupy`` module: every GPU branch of the project,
run on the host.

Its arrays are NumPy arrays, put on the "device" by
:func:`chainer_recompute.runtime.device.simulate`. What it models of CuPy:

- the memory pool (``get_default_memory_pool()``): every allocation is
  rounded up to 512 bytes; a freed block stays cached in the pool (its
  ``total_bytes()``), merged with its free neighbours, and is reused, best
  fit, split when larger; a limit
  (``set_limit(size=...)``) frees the cached whole blocks first and then
  raises ``OutOfMemoryError``, as CuPy's does;
- ``cuda.MemoryHook``: hooks see what CuPy 14 tells them, with its
  arguments: ``alloc_postprocess`` when the pool takes a new block from
  the device, ``malloc_postprocess`` after each allocation from the pool
  and ``free_postprocess`` after each free back to it, each with the
  block's rounded ``mem_size`` (CuPy refuses two active hooks of one
  name);
- the global random generators (``random._generator._random_states``, one
  ``RandomState`` per device, created on demand, ``random.seed``,
  ``random.rand`` ...), separate from NumPy's global state, like CuPy's;
- ``cuda.runtime.memGetInfo()``: the (free, total) bytes set in
  ``device_memory``;
- ``cuda.get_current_stream().synchronize()``, ``asnumpy``, ``copy`` and the
  array functions the project calls (``stack``, ``ascontiguousarray``, ...,
  NumPy's).

Chainer's own functions allocate with NumPy, not through this pool: while a
:class:`FakeCupy` is :meth:`~FakeCupy.active`, the NumPy bytes alive
(tracemalloc) count as used by the pool (and as taken from the device), and
their change is reported to the memory hooks as one allocation (or free)
after every forward and backward call and whenever the pool's bytes are
read, so a meter sees the peaks at function boundaries.
"""
from __future__ import annotations

import contextlib
import tracemalloc
import types
from typing import Any, Dict, Iterator, List, Optional

import numpy

import chainer

UNIT = 512


class OutOfMemoryError(MemoryError):
    pass


class _Block:
    __slots__ = ("size", "segment", "offset", "free")

    def __init__(self, size: int, segment: int, offset: int = 0) -> None:
        self.size, self.segment, self.offset, self.free = size, segment, offset, False


class FakePool:
    """CuPy's pool as far as the project sees it."""

    def __init__(self, owner: "FakeCupy") -> None:
        self.owner = owner
        self.blocks: List[_Block] = []
        self.segments: Dict[int, int] = {}  # segment id -> bytes taken from the device
        self.limit = 0
        self._next = 0
        self.host_base = 0  # NumPy bytes alive when the double became active
        self._host_told = 0  # the NumPy bytes the hooks were last told of

    def _host(self) -> int:
        if not self.owner.is_active or not tracemalloc.is_tracing():
            return 0
        return max(0, tracemalloc.get_traced_memory()[0] - self.host_base)

    def sync_host(self) -> None:
        """Tell the hooks how the NumPy bytes changed since they were last told."""
        h = self._host()
        d, self._host_told = h - self._host_told, h
        if d > 0:
            self.owner.tell("alloc_postprocess", mem_size=d, mem_ptr=1)
            self.owner.tell("malloc_postprocess", size=d, mem_size=d, mem_ptr=1, pmem_id=0)
        elif d < 0:
            self.owner.tell("free_postprocess", mem_size=-d, mem_ptr=1, pmem_id=0)

    def used_bytes(self) -> int:
        self.sync_host()
        return sum(b.size for b in self.blocks if not b.free) + self._host_told

    def total_bytes(self) -> int:
        self.sync_host()
        return sum(self.segments.values()) + self._host_told

    def free_bytes(self) -> int:
        return self.total_bytes() - self.used_bytes()

    def set_limit(self, size: int) -> None:
        self.limit = int(size)

    def get_limit(self) -> int:
        return self.limit

    def free_all_blocks(self) -> None:
        """Give back the cached blocks that are whole segments."""
        for b in [b for b in self.blocks if b.free and self.segments.get(b.segment) == b.size]:
            self.blocks.remove(b)
            del self.segments[b.segment]

    def malloc(self, nbytes: int) -> _Block:
        size = -(-int(nbytes) // UNIT) * UNIT
        fits = [b for b in self.blocks if b.free and b.size >= size]
        if fits:
            best = min(fits, key=lambda b: (b.size, b.segment, b.offset))
            if best.size > size:  # split: the rest stays cached
                rest = _Block(best.size - size, best.segment, best.offset + size)
                rest.free = True
                self.blocks.append(rest)
                best.size = size
            best.free = False
            block = best
        else:
            if self.limit and self.total_bytes() + size > self.limit:
                self.free_all_blocks()
                if self.total_bytes() + size > self.limit:
                    raise OutOfMemoryError(
                        f"out of memory allocating {size} bytes (limit {self.limit}, "
                        f"total {self.total_bytes()})")
            self._next += 1
            self.owner.tell("alloc_postprocess", mem_size=size, mem_ptr=self._next)
            self.segments[self._next] = size
            block = _Block(size, self._next)
            self.blocks.append(block)
        self.owner.tell("malloc_postprocess", size=int(nbytes), mem_size=size,
                        mem_ptr=block.segment, pmem_id=id(block))
        return block

    def free(self, block: _Block) -> None:
        """Cache the block, merged with its free neighbours in its segment."""
        size = block.size
        block.free = True
        self.owner.tell("free_postprocess", mem_size=size, mem_ptr=block.segment,
                        pmem_id=id(block))
        for other in [b for b in self.blocks if b.free and b is not block
                      and b.segment == block.segment]:
            if other.offset + other.size == block.offset:
                block.offset, block.size = other.offset, block.size + other.size
                self.blocks.remove(other)
            elif block.offset + block.size == other.offset:
                block.size += other.size
                self.blocks.remove(other)


class _Hook:
    """``cupy.cuda.MemoryHook``."""

    name = "MemoryHook"
    _active: List["_Hook"] = []

    def __enter__(self) -> "_Hook":
        if any(h.name == self.name for h in self._active):
            raise KeyError(f"hook {self.name} already exists")
        self._active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active.remove(self)

    def alloc_postprocess(self, **kwargs: Any) -> None:
        pass

    def malloc_postprocess(self, **kwargs: Any) -> None:
        pass

    def free_postprocess(self, **kwargs: Any) -> None:
        pass


class FakeRandomState:
    """``cupy.random.RandomState``: its own stream, apart from NumPy's."""

    def __init__(self, seed: Optional[int] = None) -> None:
        self._rs = numpy.random.RandomState(seed)

    def seed(self, seed: Optional[int] = None) -> None:
        self._rs.seed(seed)

    def rand(self, *size: int, dtype: Any = float) -> numpy.ndarray:
        return self._rs.random_sample(size).astype(dtype)

    def random_sample(self, size: Any = None, dtype: Any = float) -> numpy.ndarray:
        return numpy.asarray(self._rs.random_sample(size)).astype(dtype)

    def standard_normal(self, size: Any = None, dtype: Any = float) -> numpy.ndarray:
        return numpy.asarray(self._rs.standard_normal(size)).astype(dtype)


class _Stream:
    def __init__(self, owner: "FakeCupy") -> None:
        self.owner = owner

    def synchronize(self) -> None:
        self.owner.syncs += 1


class _SampleHook(chainer.FunctionHook):
    """Tells the memory hooks of the NumPy bytes after each function call."""

    name = "FakeCupySample"

    def __init__(self, owner: "FakeCupy") -> None:
        self.owner = owner

    def forward_postprocess(self, function: Any, in_data: Any) -> None:
        self.owner._pool.sync_host()

    def backward_postprocess(self, function: Any, in_data: Any, out_grad: Any) -> None:
        self.owner._pool.sync_host()


class FakeCupy(types.SimpleNamespace):
    """The double; pass it where the project takes a ``cupy`` module."""

    __name__ = "cupy"
    OutOfMemoryError = OutOfMemoryError

    def __init__(self) -> None:
        super().__init__()
        self.is_active = False
        self.syncs = 0
        self._pool = FakePool(self)
        self._stream = _Stream(self)
        hook_base = type("MemoryHook", (_Hook,), {"_active": []})
        #: what ``cuda.runtime.memGetInfo()`` answers: (free, total) bytes
        self.device_memory = (8 << 30, 16 << 30)
        self.cuda = types.SimpleNamespace(
            MemoryHook=hook_base, get_current_stream=lambda: self._stream,
            memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
            runtime=types.SimpleNamespace(memGetInfo=lambda: self.device_memory))
        states: Dict[int, FakeRandomState] = {}

        def get_random_state() -> Any:
            rs = states.get(0)
            if rs is None:
                rs = states.setdefault(0, FakeRandomState())
            return rs

        self.random = types.SimpleNamespace(
            _generator=types.SimpleNamespace(_random_states=states),
            get_random_state=get_random_state,
            seed=lambda seed=None: get_random_state().seed(seed),
            rand=lambda *size, dtype=float: get_random_state().rand(*size, dtype=dtype),
            random_sample=lambda size=None, dtype=float: get_random_state().random_sample(
                size, dtype),
            standard_normal=lambda size=None, dtype=float: get_random_state().standard_normal(
                size, dtype))
        self.ndarray = type("ndarray", (), {})  # no real array is one

    def __getattr__(self, name: str) -> Any:  # array functions: NumPy's
        return getattr(numpy, name)

    @property
    def hooks(self) -> List[Any]:
        return self.cuda.MemoryHook._active

    def get_default_memory_pool(self) -> FakePool:
        return self._pool

    @staticmethod
    def asnumpy(a: Any) -> numpy.ndarray:
        return numpy.asarray(a)

    @staticmethod
    def copy(a: Any) -> Any:
        return numpy.array(a, copy=True)

    def tell(self, event: str, **kwargs: Any) -> None:
        """Call ``event`` on every active memory hook, as CuPy does."""
        for h in list(self.hooks):
            getattr(h, event)(device_id=0, **kwargs)

    @contextlib.contextmanager
    def active(self) -> Iterator["FakeCupy"]:
        """NumPy arrays are this double's device arrays inside the block."""
        from chainer_recompute.runtime.device import CupyDevice, simulate
        from chainer_recompute.runtime.memory import MemoryMeter
        outer = MemoryMeter()  # keeps tracemalloc on, NumPy's domain only
        outer.start()
        self._pool.host_base = tracemalloc.get_traced_memory()[0]
        self._pool._host_told = 0
        self.is_active = True
        sample = _SampleHook(self)
        try:
            with simulate(CupyDevice(self)), sample:
                yield self
        finally:
            self.is_active = False
            outer.stop()


def real_cupy_or_skip() -> Any:
    """The real CuPy with a GPU that answers, or skip the test saying why
    (CuPy installed without a GPU or driver raises at the first call)."""
    import pytest
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("CuPy finds no GPU")
    except Exception as e:  # cudaErrorInsufficientDriver, cudaErrorNoDevice, ...
        pytest.skip(f"CuPy finds no usable GPU: {e}")
    return cupy
