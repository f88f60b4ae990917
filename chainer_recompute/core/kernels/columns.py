"""The im2col copy of the bounded convolutions
(:func:`chainer_recompute.runtime.workspace._columns`, whose NumPy engine is
a few strided copies) as one loop, compiled by numba.

Pure core: plain loops (numba compiles them, see :func:`fill_kernel`).
"""
from __future__ import annotations

import sys
from typing import Any


def fill_columns(x: Any, col: Any, sy: int, sx: int, ph: int, pw: int,
                 dy: int, dx: int) -> None:
    """``col[b, p, q, c, j, i] = x[b, c, p*sy - ph + j*dy, q*sx - pw + i*dx]``
    (0 outside ``x``) as one loop over ``col`` in its memory order: the
    writes are sequential and the reads stay within ``kh`` rows of each
    channel, where NumPy's strided copies read one element per cache line
    (a transposing copy).

    >>> import numpy as np
    >>> x = np.arange(4.0).reshape(1, 1, 2, 2)
    >>> col = np.empty((1, 2, 2, 1, 1, 1))
    >>> fill_columns(x, col, 1, 1, 0, 0, 1, 1)
    >>> col.ravel().tolist()
    [0.0, 1.0, 2.0, 3.0]
    """
    n, c, h, w = x.shape
    oh, ow, kh, kw = col.shape[1], col.shape[2], col.shape[4], col.shape[5]
    for b in range(n):
        for p in range(oh):
            for q in range(ow):
                for ch in range(c):
                    for j in range(kh):
                        r = p * sy - ph + j * dy
                        for i in range(kw):
                            s = q * sx - pw + i * dx
                            if 0 <= r < h and 0 <= s < w:
                                col[b, p, q, ch, j, i] = x[b, ch, r, s]
                            else:
                                col[b, p, q, ch, j, i] = 0


def fill_kernel() -> Any:
    """:func:`fill_columns` compiled (numba must be installed)."""
    from . import compiled
    return compiled(sys.modules[__name__], "fill_columns")
