"""Everything that differs between NumPy and CuPy, behind one small interface.

The runner, the executor, the recorder, BPTT and the benchmarks ask a
:class:`Device` (found from the arrays with :func:`device_of`) for:

- the iteration's peak and each function's transient memory: :meth:`Device.meter`
  (tracemalloc on NumPy; the memory pool's used and total bytes on CuPy);
- the bytes an array really takes: :meth:`Device.allocation_bytes` (CuPy's
  pool rounds every allocation up to 512 bytes);
- array identity and checksums: :meth:`Device.same` and :meth:`Device.checksum`
  (on CuPy a checksum's sums come back in one transfer, one sync);
- synchronisation before and after a timed call: :meth:`Device.synchronize`;
- the random states Chainer's functions draw from: :class:`RandomStates`.

CuPy's generators cannot be read or set: a cuRAND generator's position is
not exposed. :func:`recording_random` therefore puts a :class:`RandomTape`
in place of the current device's global ``cupy.random.RandomState``: every
draw still comes from the real generator the first time, so the stream is
the one plain Chainer sees, and is kept on the tape; :meth:`RandomStates.save`
notes the tape's position and :meth:`RandomStates.restore` rewinds it, so a
step run again draws the same numbers, bit for bit. The tape holds every
draw until the recording ends (the cost is the bytes drawn, on the device).

Tests drive every CuPy branch on a CPU with a test double of the ``cupy``
module (``tests/fake_cupy.py``) through :func:`simulate`.
"""
from __future__ import annotations

import contextlib
import random
import sys
import zlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy

from ..core.errors import RecomputeError, UnsafeRecomputeError
from .memory import MemoryMeter

__all__ = ["Device", "CupyDevice", "CPU", "device_of", "dtype_name", "simulate", "RandomStates",
           "RandomTape", "recording_random", "seed_all"]

_DTYPE_NAMES: Dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """``str(dtype)``, remembered: NumPy computes a dtype's name in Python
    each time (about 3 us), and the recorder and the executor ask it for
    every array of every function of every step.

    >>> dtype_name(numpy.zeros(1, numpy.float32).dtype)
    'float32'
    """
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


class Device:
    """NumPy on the host (the default device)."""

    name = "cpu"
    is_gpu = False
    #: arrays of at most this many bytes are their own checksum (:meth:`checksum`)
    SMALL_BYTES = 256

    def __init__(self) -> None:
        self.xp: Any = numpy

    def meter(self) -> MemoryMeter:
        """A new, stopped meter of this device's array memory."""
        return MemoryMeter(numpy)

    def adopt(self, meter: MemoryMeter, arrays: Any) -> int:
        """Make a running ``meter`` see the frees of ``arrays``, made before
        it started (NumPy: traced from now on when the meter owns the
        tracing; CuPy's pool sees every free already). Returns the bytes
        adopted."""
        return 0 if self.is_gpu else meter.adopt(arrays)

    def available_bytes(self) -> Optional[int]:
        """What this device can give an iteration now, before the margin of
        a ``'device'`` budget: the host's available memory
        (``MemAvailable``; psutil where there is no ``/proc/meminfo``)."""
        from ..core.budget_spec import host_available_bytes
        return host_available_bytes()

    def allocation_bytes(self, nbytes: int) -> int:
        """What an array of ``nbytes`` takes from the allocator.

        >>> CPU.allocation_bytes(3)
        3
        """
        return int(nbytes)

    def synchronize(self) -> None:
        """Wait for the device's queued work (nothing to wait for on the host)."""

    def to_host(self, a: Any) -> numpy.ndarray:
        return numpy.asarray(a)

    def checksum(self, a: Any) -> Tuple[Any, ...]:
        """A content checksum of ``a``: shape, dtype, the sum of its 64-bit
        words (one changed element, a NaN included, always changes it) and
        the CRC-32 of its bytes (moved elements change it: a permutation,
        a row swap; missed with probability 2**-32). One pass over the
        bytes each, no copy of a contiguous array.

        >>> x = numpy.arange(6, dtype=numpy.float32)
        >>> y = x.copy(); y[2] = 7
        >>> z = x.copy(); z[[0, 4]] = z[[4, 0]]
        >>> CPU.checksum(x) == CPU.checksum(x.copy()), CPU.checksum(x) == CPU.checksum(y)
        (True, False)
        >>> CPU.checksum(x) == CPU.checksum(z)
        False

        An array of at most ``SMALL_BYTES`` (a batch of token ids) is its
        bytes themselves: exact, and no larger than the checksum.
        """
        if a.nbytes <= self.SMALL_BYTES:
            return (tuple(a.shape), dtype_name(a.dtype), a.tobytes())
        flat = numpy.ascontiguousarray(a).reshape(-1).view(numpy.uint8)
        return self._word_sum(a, flat) + (zlib.crc32(flat),)

    def word_sum(self, a: Any) -> Tuple[Any, ...]:
        """A cheaper :meth:`checksum`: shape, dtype, the sum of the 64-bit
        words and the bytes after the last whole word. One changed element
        always changes it, moved elements need not; one vectorised pass, no
        copy of a contiguous array.

        >>> x = numpy.arange(6, dtype=numpy.float32)
        >>> y = x.copy(); y[2] = 7
        >>> CPU.word_sum(x) == CPU.word_sum(x.copy()), CPU.word_sum(x) == CPU.word_sum(y)
        (True, False)
        """
        return self._word_sum(a, self.xp.ascontiguousarray(a).reshape(-1).view(numpy.uint8))

    def _word_sum(self, a: Any, flat: Any) -> Tuple[Any, ...]:
        n8 = (flat.size // 8) * 8
        return (tuple(a.shape), dtype_name(a.dtype),
                int(flat[:n8].view(numpy.uint64).sum(dtype=numpy.uint64)),
                bytes(self.to_host(flat[n8:]).tobytes()))

    def same(self, a: Any, b: Any) -> bool:
        """Bitwise equality of two arrays (NaN equal to NaN)."""
        if a is None or b is None:
            return a is b
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        xp = self.xp
        a8 = xp.ascontiguousarray(a).reshape(-1).view(numpy.uint8)
        b8 = xp.ascontiguousarray(b).reshape(-1).view(numpy.uint8)
        return bool(xp.array_equal(a8, b8))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class CupyDevice(Device):
    """A CUDA device through CuPy (or a test double of the ``cupy`` module)."""

    name = "gpu"
    is_gpu = True
    #: CuPy's memory pool rounds every allocation up to a multiple of this.
    ALLOCATION_UNIT = 512

    def __init__(self, cupy_module: Any) -> None:
        self.xp = cupy_module

    def meter(self) -> MemoryMeter:
        return MemoryMeter("gpu", cupy_module=self.xp)

    def available_bytes(self) -> Optional[int]:
        """The free device memory plus all that CuPy's pool holds (the
        model's arrays and the blocks it caches: a total budget counts the
        model's own arrays), or the pool's limit if one is set and lower."""
        pool = self.xp.get_default_memory_pool()
        free, _total = self.xp.cuda.runtime.memGetInfo()
        figure = int(free) + int(pool.total_bytes())
        limit = int(pool.get_limit() or 0)
        return min(figure, limit) if limit else figure

    def allocation_bytes(self, nbytes: int) -> int:
        """
        >>> CupyDevice(None).allocation_bytes(1), CupyDevice(None).allocation_bytes(1024)
        (512, 1024)
        """
        unit = self.ALLOCATION_UNIT
        return -(-int(nbytes) // unit) * unit

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

    def to_host(self, a: Any) -> numpy.ndarray:
        return self.xp.asnumpy(a)

    #: words per chunk of the position-weighted sum (its two temporaries
    #: take 8 bytes a word each, 4 MiB in all)
    CHUNK_WORDS = 1 << 18

    def _weights(self) -> Any:
        """One odd pseudo-random 64-bit weight per position of a chunk
        (splitmix64 of the position), made once per device."""
        w = getattr(self, "_weights_cache", None)
        if w is None:
            xp = self.xp
            z = xp.arange(self.CHUNK_WORDS, dtype=numpy.uint64) * numpy.uint64(
                0x9E3779B97F4A7C15) + numpy.uint64(0x632BE59BD9B4E019)
            z = (z ^ (z >> numpy.uint64(30))) * numpy.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> numpy.uint64(27))) * numpy.uint64(0x94D049BB133111EB)
            w = self._weights_cache = (z ^ (z >> numpy.uint64(31))) | numpy.uint64(1)
        return w

    def checksum(self, a: Any) -> Tuple[Any, ...]:
        """On the device: shape, dtype, the sum of the 32-bit words (one
        changed element always changes it) and a position-weighted sum
        (each word times a pseudo-random odd weight of its position, the
        chunks mixed on the host: moved elements change it), all brought
        to the host in one transfer."""
        xp = self.xp
        flat = xp.ascontiguousarray(a).reshape(-1).view(numpy.uint8)
        n4 = (flat.size // 4) * 4
        w = flat[:n4].view(numpy.uint32)
        parts = [w.sum(dtype=numpy.uint64)]
        weights = self._weights()
        for start in range(0, w.size, self.CHUNK_WORDS):
            chunk = w[start:start + self.CHUNK_WORDS].astype(numpy.uint64)
            chunk *= weights[:chunk.size]
            parts.append(chunk.sum(dtype=numpy.uint64))
            del chunk
        host = self.to_host(xp.stack(parts))  # one transfer
        mixed = 0
        for k, v in enumerate(host[1:].tolist()):
            mixed = (mixed * 0x100000001B3 + (k + 1) * int(v)) & 0xFFFFFFFFFFFFFFFF
        tail = self.to_host(flat[n4:])
        return (tuple(a.shape), dtype_name(a.dtype), int(host[0]), mixed, bytes(tail.tobytes()))


CPU = Device()
_CUPY_DEVICES: Dict[int, CupyDevice] = {}
_SIMULATED: List[Device] = []


def _cupy_device(module: Any) -> CupyDevice:
    dev = _CUPY_DEVICES.get(id(module))
    if dev is None:
        dev = _CUPY_DEVICES[id(module)] = CupyDevice(module)
    return dev


def device_of(arrays: Sequence[Any]) -> Device:
    """The device of the first array among ``arrays`` (Variables are looked
    through); :data:`CPU` when there is none.

    >>> device_of([numpy.zeros(2)]).name
    'cpu'
    """
    for a in arrays:
        a = getattr(a, "raw_array", a)
        if isinstance(a, numpy.ndarray):
            return _SIMULATED[-1] if _SIMULATED else CPU
        cupy = sys.modules.get("cupy")
        if cupy is not None and isinstance(a, cupy.ndarray):
            return _cupy_device(cupy)
    return _SIMULATED[-1] if _SIMULATED else CPU


@contextlib.contextmanager
def simulate(device: Device) -> Iterator[Device]:
    """Treat NumPy arrays as living on ``device`` (tests: a :class:`CupyDevice`
    over a test double of CuPy runs every GPU branch on the host)."""
    _SIMULATED.append(device)
    try:
        yield device
    finally:
        _SIMULATED.remove(device)


# --------------------------------------------------------------- random state
def _cupy_generators(cupy: Any) -> Optional[Dict[Any, Any]]:
    """CuPy's global generators by device id (``cupy.random._generator._random_states``)."""
    gen = getattr(getattr(cupy, "random", None), "_generator", None)
    return None if gen is None else getattr(gen, "_random_states", None)


def _cupy_modules() -> List[Any]:
    mods = [d.xp for d in _SIMULATED if d.is_gpu]
    real = sys.modules.get("cupy")
    if real is not None and sys.modules.get("cupy.random._generator") is not None:
        mods.append(real)
    return mods


class RandomTape:
    """Stands in for one device's global ``cupy.random.RandomState``: the
    first time, each draw comes from the real generator and is kept; after
    :meth:`rewind`, draws are served from the tape, in order, until it runs
    out, then come from the real generator again.

    Args:
        state: the real ``RandomState``.
        copy: how to copy a drawn array (``cupy.copy``).
    """

    _PASS = frozenset({"seed"})

    def __init__(self, state: Any, copy: Any) -> None:
        self._state = state
        self._copy = copy
        self._draws: List[Tuple[Tuple[str, str, str], Any]] = []
        self.position = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the tape."""
        return sum(int(getattr(r, "nbytes", 0)) for _, r in self._draws)

    def rewind(self, position: int) -> None:
        if not 0 <= position <= len(self._draws):
            raise RecomputeError(f"internal error: random tape position {position} outside "
                                 f"0..{len(self._draws)}")  # pragma: no cover
        self.position = position

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._state, name)
        if name.startswith("_") or name in self._PASS or not callable(attr):
            return attr

        def draw(*args: Any, **kwargs: Any) -> Any:
            key = (name, repr(args), repr(sorted(kwargs.items())))
            if self.position < len(self._draws):
                was, value = self._draws[self.position]
                if was != key:
                    raise UnsafeRecomputeError(
                        f"a step run again drew other random numbers than the first time "
                        f"({key[0]}{key[1]} against {was[0]}{was[1]}): its random draws must "
                        f"not depend on anything but its inputs; make the step deterministic "
                        f"given its inputs, or do not recompute it")
                self.position += 1
                return self._copy(value) if hasattr(value, "shape") else value
            value = attr(*args, **kwargs)
            self._draws.append((key, self._copy(value) if hasattr(value, "shape") else value))
            self.position += 1
            return value

        return draw


class _Recording:
    """The tapes of one :func:`recording_random` block, by CuPy module."""

    def __init__(self) -> None:
        self.tapes: List[Tuple[Any, Any, Any, RandomTape]] = []  # (module, states, key, tape)

    def close(self) -> None:
        for _, states, key, tape in reversed(self.tapes):
            if states.get(key) is tape:
                states[key] = tape._state
        self.tapes.clear()
        if self in _RECORDINGS:
            _RECORDINGS.remove(self)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for *_, t in self.tapes)


_RECORDINGS: List[_Recording] = []


def recording_random(device: Device) -> _Recording:
    """Start taping the draws of ``device``'s global CuPy generator (nothing
    on the host: NumPy's state can be saved); :meth:`_Recording.close` puts
    the generator back. While open, :meth:`RandomStates.save` and
    :meth:`RandomStates.restore` cover CuPy's draws too."""
    rec = _Recording()
    if device.is_gpu:
        cupy = device.xp
        state = cupy.random.get_random_state()  # creates it if needed
        states = _cupy_generators(cupy)
        key = next((k for k, v in states.items() if v is state), None)
        if key is not None:
            tape = RandomTape(state, cupy.copy)
            states[key] = tape
            rec.tapes.append((cupy, states, key, tape))
    _RECORDINGS.append(rec)
    return rec


class RandomStates:
    """Save and restore the global random states Chainer's functions and a
    model's own code draw from: NumPy's, Python's ``random`` (a stochastic
    depth, a teacher-forcing coin), and CuPy's where a
    :func:`recording_random` block tapes them."""

    @staticmethod
    def save() -> Tuple[Any, Tuple[Tuple[RandomTape, int], ...], Any]:
        tapes = tuple((t, t.position) for rec in _RECORDINGS for *_, t in rec.tapes)
        return numpy.random.get_state(), tapes, random.getstate()

    @staticmethod
    def restore(saved: Tuple[Any, Tuple[Tuple[RandomTape, int], ...], Any]) -> None:
        numpy.random.set_state(saved[0])
        for tape, position in saved[1]:
            tape.rewind(position)
        random.setstate(saved[2])

    @staticmethod
    def save_generators() -> Tuple[Any, List[Tuple[Dict[Any, Any], Dict[Any, Any]]], Any]:
        """NumPy's and Python's states and CuPy's generator objects (for
        :meth:`isolated`)."""
        gens = []
        for mod in _cupy_modules():
            states = _cupy_generators(mod)
            if states is not None:
                gens.append((states, dict(states)))
        return numpy.random.get_state(), gens, random.getstate()

    @staticmethod
    def restore_generators(saved: Tuple[Any, List[Tuple[Dict[Any, Any], Dict[Any, Any]]], Any]
                           ) -> None:
        numpy.random.set_state(saved[0])
        for states, kept in saved[1]:
            states.clear()
            states.update(kept)
        random.setstate(saved[2])

    @staticmethod
    def numpy_changed(before: Any) -> bool:
        after = numpy.random.get_state()
        return not (before[2:] == after[2:] and numpy.array_equal(before[1], after[1]))

    @classmethod
    @contextlib.contextmanager
    def isolated(cls, seed: int = 0x5EED) -> Iterator[None]:
        """Run a block on other random states (NumPy's and Python's seeded
        with ``seed``, fresh CuPy generators); the original states and
        generators, untouched, are put back after."""
        saved = cls.save_generators()
        try:
            numpy.random.seed(seed)
            random.seed(seed)
            for states, _ in saved[1]:
                states.clear()  # CuPy makes new generators on demand
            yield
        finally:
            cls.restore_generators(saved)


def seed_all(seed: int) -> None:
    """Seed NumPy's global generator and, where CuPy is in use, CuPy's."""
    numpy.random.seed(seed)
    for mod in _cupy_modules():
        mod.random.seed(seed)
