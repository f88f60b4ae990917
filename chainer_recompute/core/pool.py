"""A model of CuPy's device memory pool, to predict its total bytes.

Pure core: no Chainer, no CuPy.

On a GPU the allocator is CuPy's ``SingleDeviceMemoryPool``. What it holds
from the device (``total_bytes()``) can exceed what the live arrays use
(``used_bytes()``): a freed block stays cached, and a cached block larger
than a request is split, so free fragments sit between used ones. With
``set_limit(size=L)`` an allocation that would take the total over ``L``
first frees the cached blocks that are whole device allocations, then raises
``OutOfMemoryError``. :class:`PoolModel` follows the same rules:

- every request is rounded up to 512 bytes;
- it takes the smallest cached free chunk that fits (best fit; among equal
  sizes, which CuPy leaves to a set's order, the first device allocation and
  the lowest offset), splitting off the rest as a free chunk of the same
  device allocation;
- a freed chunk merges with its free neighbours in its device allocation;
- when no cached chunk fits, a new device allocation of the rounded size is
  made (``total_bytes`` grows).

Fed with an iteration's allocations and frees in order (the replay does
that, :func:`chainer_recompute.core.replay.replay`), its highest total is
the pool size the iteration needs with nothing else on the device: a limit
at or above it never makes the pool free blocks or fail.

>>> pool = PoolModel()
>>> a, b = pool.alloc(1000), pool.alloc(3000)
>>> pool.free(a); c = pool.alloc(512)       # split from the cached 1024
>>> pool.used_bytes, pool.total_bytes
(3584, 4096)
>>> pool.free(b); d = pool.alloc(4000)       # no chunk of 4096 is free: a new one
>>> pool.total_bytes, pool.peak_total_bytes
(8192, 8192)
"""
from __future__ import annotations

import bisect
from typing import Dict, List, Tuple

__all__ = ["ALLOCATION_UNIT", "PoolModel", "rounded"]

#: CuPy's pool rounds every allocation up to a multiple of this.
ALLOCATION_UNIT = 512


def rounded(nbytes: int) -> int:
    """``nbytes`` rounded up to the pool's allocation unit.

    >>> rounded(1), rounded(512), rounded(0)
    (512, 512, 0)
    """
    return -(-int(nbytes) // ALLOCATION_UNIT) * ALLOCATION_UNIT


class PoolModel:
    """Best-fit pool with splitting and merging; see the module docstring."""

    def __init__(self) -> None:
        # chunk id -> (segment, offset, size, free)
        self._chunks: Dict[int, List[int]] = {}
        self._by_pos: Dict[Tuple[int, int], int] = {}  # (segment, offset) -> chunk id
        self._ends: Dict[Tuple[int, int], int] = {}  # (segment, end offset) -> chunk id
        # free chunks, sorted: (size, segment, offset, chunk id)
        self._free: List[Tuple[int, int, int, int]] = []
        self._next = 0
        self._segments = 0
        self.used_bytes = 0
        self.total_bytes = 0
        self.peak_total_bytes = 0
        self.peak_used_bytes = 0

    def _new_chunk(self, segment: int, offset: int, size: int, free: bool) -> int:
        cid = self._next
        self._next += 1
        self._chunks[cid] = [segment, offset, size, int(free)]
        self._by_pos[(segment, offset)] = cid
        self._ends[(segment, offset + size)] = cid
        if free:
            bisect.insort(self._free, (size, segment, offset, cid))
        return cid

    def _forget(self, cid: int) -> None:
        segment, offset, size, free = self._chunks.pop(cid)
        del self._by_pos[(segment, offset)]
        del self._ends[(segment, offset + size)]
        if free:
            self._free.remove((size, segment, offset, cid))

    def alloc(self, nbytes: int) -> int:
        """Allocate; returns a handle for :meth:`free` (-1 for 0 bytes)."""
        size = rounded(nbytes)
        if size == 0:
            return -1
        k = bisect.bisect_left(self._free, (size, -1, -1, -1))
        if k < len(self._free):
            have, _, _, cid = self._free[k]
            segment, offset, _, _ = self._chunks[cid]
            self._forget(cid)
            cid = self._new_chunk(segment, offset, size, False)
            if have > size:
                self._new_chunk(segment, offset + size, have - size, True)
        else:
            self._segments += 1
            cid = self._new_chunk(self._segments, 0, size, False)
            self.total_bytes += size
            self.peak_total_bytes = max(self.peak_total_bytes, self.total_bytes)
        self.used_bytes += size
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        return cid

    def free(self, handle: int) -> None:
        """Free a chunk; it merges with its free neighbours."""
        if handle < 0:
            return
        segment, offset, size, free = self._chunks[handle]
        assert not free, "double free"
        self.used_bytes -= size
        self._forget(handle)
        start, end = offset, offset + size
        after = self._by_pos.get((segment, end))
        if after is not None and self._chunks[after][3]:
            end += self._chunks[after][2]
            self._forget(after)
        before = self._ends.get((segment, start))
        if before is not None and self._chunks[before][3]:
            start = self._chunks[before][1]
            self._forget(before)
        self._new_chunk(segment, start, end - start, True)
