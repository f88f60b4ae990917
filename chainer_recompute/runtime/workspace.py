"""Chunked convolutions: a bound on one convolution call's temporary memory.

Chainer 7.8.1 runs ``Convolution2DFunction``, ``Deconvolution2DFunction``
and ``Convolution2DGradW`` (the weight gradient of both) as im2col + GEMM
on NumPy, and on CuPy without cuDNN (CuPy 14 ships none). Inside
:func:`bounded`, a call whose column buffer is over the bound runs in chunks
(sizes from :mod:`chainer_recompute.core.workspace`), with the arithmetic of
one call:

- forward and input gradient over the batch: each output sample is the same
  GEMM row (column) of the same products, and col2im adds a sample's
  kernel positions in the same order;
- weight gradient over the input channels, the GEMM's output columns: each
  element is still one sum over the whole batch and every output pixel,
  taken by one GEMM.

The column block of a chunk is built in the GEMM's layout in one copy (no
padded copy of the input, no second, transposed copy), the forward writes
its GEMM straight into the output, and outputs have the memory layout of
Chainer's (the forward's ``(N, oh, ow, O)`` buffer seen as ``(N, O, oh,
ow)``, the input gradient a view into its padded buffer), so that what
reads them later sums in the same order. On NumPy the results are
bit-identical to Chainer's (``tests/test_workspace.py``). On CuPy the same
code runs; cuBLAS may choose another GEMM algorithm for another shape, so
there bit-identity is not promised.

A call remembers the bound it ran under (a regeneration in the backward
runs it again the same way), and a convolution's backward runs under the
bound of its forward, wherever the caller's ``backward()`` is.

>>> import numpy as np, chainer.functions as F
>>> x = np.ones((4, 3, 8, 8), np.float32); w = np.ones((2, 3, 3, 3), np.float32)
>>> with bounded(4096):
...     y = F.convolution_2d(x, w, pad=1)
>>> bool((y.array == F.convolution_2d(x, w, pad=1).array).all())
True
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator, Optional, Tuple

import numpy

from chainer import backend
from chainer.functions.connection import convolution_2d as _conv
from chainer.functions.connection import deconvolution_2d as _deconv
from chainer.utils import conv as _conv_utils

from ..core.workspace import conv_kernel, deconv_kernel, gradw_kernel

_state = threading.local()
#: the bound each convolution node ran under (None: none)
_node_limits: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_installed = False
#: the chunked calls run so far (tests read it): kernel kind -> count
chunked_calls = {"conv": 0, "deconv": 0, "gradw": 0}


Bound = Tuple[int, bool]  # (limit in bytes, exact: one call, no chunks)


def _current() -> Optional[Bound]:
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def _push(bound: Optional[Bound]) -> Iterator[None]:
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(bound)
    try:
        yield
    finally:
        stack.pop()


@contextlib.contextmanager
def bounded(limit_bytes: Optional[int], exact: bool = True) -> Iterator[None]:
    """Run the convolutions called inside with at most ``limit_bytes`` of
    column buffer each (``None``: no bound, as plain Chainer); their
    backward and regeneration keep the bound wherever they run.

    ``exact`` (the default): a call over the bound runs Chainer's very GEMM
    in one call, on a column buffer built in one copy (half of Chainer's
    two), bit-identical to Chainer; it is not chunked. ``exact=False``
    chunks it to fit the bound; OpenBLAS and cuBLAS then round some sums
    differently (another GEMM shape takes other kernel paths), by about one
    unit in the last place (docs/workspaces.md).

    >>> with bounded(64 * 2**20):            # doctest: +SKIP
    ...     loss = model(x, t)
    >>> loss.backward()                      # doctest: +SKIP
    """
    if limit_bytes is None and _current() is None:
        yield
        return
    install()
    with _push(None if limit_bytes is None else (int(limit_bytes), bool(exact))):
        yield


def _bound_of(f: Any) -> Optional[Bound]:
    try:
        return _node_limits[f]
    except KeyError:
        pass
    except TypeError:
        return _current()
    stack = getattr(_state, "stack", None)
    if not stack:
        return None
    bound = stack[-1]
    _node_limits[f] = bound
    return bound


# ----------------------------------------------------------------- kernels
def _out_size(size: int, k: int, s: int, p: int, cover_all: bool, d: int) -> int:
    return _conv_utils.get_conv_outsize(size, k, s, p, cover_all=cover_all, d=d)


#: The column copy's engine: ``None`` until first used, then the compiled
#: loop (:func:`~chainer_recompute.core.kernels.columns.fill_columns`) when
#: :func:`~chainer_recompute.core.kernels.pick_engine` picks numba, else
#: ``False`` (NumPy's strided copies below).
_compiled_fill: Any = None


def _compiled_columns() -> Any:
    """The compiled column copy, or None when NumPy's runs (no numba)."""
    global _compiled_fill
    if _compiled_fill is None:
        from ..core import kernels
        _compiled_fill = False
        if kernels.pick_engine("auto", what="column copy") == "numba":
            from ..core.kernels.columns import fill_kernel
            _compiled_fill = fill_kernel()
    return _compiled_fill or None


def _columns(xp: Any, x: Any, kh: int, kw: int, sy: int, sx: int, ph: int, pw: int,
             dy: int, dx: int, oh: int, ow: int) -> Any:
    """im2col in the GEMM's layout ``(n, oh, ow, C, kh, kw)``, one copy:
    ``col[b, p, q, c, j, i] = x[b, c, p*sy - ph + j*dy, q*sx - pw + i*dx]``
    (0 outside ``x``), the values of Chainer's ``im2col``."""
    n, c, h, w = x.shape
    fill = _compiled_columns() if xp is numpy and kh * kw > 1 else None
    if fill is not None:  # (a 1x1 kernel's copy is one transpose: NumPy's is as fast)
        col = numpy.empty((n, oh, ow, c, kh, kw), dtype=x.dtype)
        fill(x, col, sy, sx, ph, pw, dy, dx)
        return col
    col = xp.zeros((n, oh, ow, c, kh, kw), dtype=x.dtype)
    xt = x.transpose(0, 2, 3, 1)

    def span(k: int, d: int, s: int, p: int, size: int, out: int) -> Tuple[int, int, int]:
        off = k * d - p  # input index of output 0
        lo = 0 if off >= 0 else (-off + s - 1) // s
        hi = min(out, (size - 1 - off) // s + 1) if size - 1 - off >= 0 else 0
        return lo, max(lo, hi), off

    for j in range(kh):
        p0, p1, roff = span(j, dy, sy, ph, h, oh)
        if p1 <= p0:
            continue
        for i in range(kw):
            q0, q1, coff = span(i, dx, sx, pw, w, ow)
            if q1 <= q0:
                continue
            col[:, p0:p1, q0:q1, :, j, i] = xt[
                :, p0 * sy + roff:(p1 - 1) * sy + roff + 1:sy,
                q0 * sx + coff:(q1 - 1) * sx + coff + 1:sx, :]
    return col


def _chunk(kind: str, kernel: Any, limit: int, exact: bool, n_all: int) -> Optional[int]:
    """The chunk a call over the bound runs in (counted in :data:`chunked_calls`),
    or None for Chainer's own kernel: within the bound, or one sample in exact
    mode (Chainer's transposed columns are a view then: one buffer already)."""
    if kernel.column_bytes <= limit or (exact and n_all == 1):
        return None
    chunked_calls[kind] += 1
    return kernel.chunk(limit, exact)


def _conv_forward(f: Any, x: Any, W: Any, b: Any, limit: int, exact: bool) -> Optional[Tuple[Any]]:
    """Convolution2DFunction's forward over batch chunks (None: one call)."""
    if x.dtype != W.dtype or (b is not None and b.dtype != x.dtype) or f.groups != 1:
        return None
    n_all, _, h, w = x.shape
    o, _, kh, kw = W.shape
    oh = _out_size(h, kh, f.sy, f.ph, f.cover_all, f.dy)
    ow = _out_size(w, kw, f.sx, f.pw, f.cover_all, f.dx)
    n = _chunk("conv", conv_kernel(x.shape, W.shape, (n_all, o, oh, ow), x.dtype.itemsize),
               limit, exact, n_all)
    if n is None:
        return None
    xp = backend.get_array_module(x)
    y = xp.empty((n_all, oh, ow, o), dtype=x.dtype)
    wt = W.transpose(1, 2, 3, 0).reshape(-1, o)  # numpy.tensordot's right operand
    for n0 in range(0, n_all, n):
        n1 = min(n_all, n0 + n)
        col = _columns(xp, x[n0:n1], kh, kw, f.sy, f.sx, f.ph, f.pw, f.dy, f.dx, oh, ow)
        xp.dot(col.reshape((n1 - n0) * oh * ow, -1), wt,
               out=y[n0:n1].reshape((n1 - n0) * oh * ow, o))
        del col
    if b is not None:
        y += b
    return xp.rollaxis(y, 3, 1),


def _deconv_forward(f: Any, x: Any, W: Any, b: Any, limit: int, exact: bool) -> Optional[Tuple[Any]]:
    """Deconvolution2DFunction's forward (a convolution's input gradient)
    over batch chunks (None: one call)."""
    if x.dtype != W.dtype or (b is not None and b.dtype != x.dtype) or f.groups != 1:
        return None
    n_all = x.shape[0]
    _, co, kh, kw = W.shape
    n = _chunk("deconv", deconv_kernel(x.shape, W.shape, x.dtype.itemsize), limit, exact, n_all)
    if n is None:
        return None
    xp = backend.get_array_module(x)
    sy, sx, ph, pw, dy, dx = f.sy, f.sx, f.ph, f.pw, f.dy, f.dx
    oh, ow = f.outh, f.outw
    h, w = x.shape[2:]
    img = xp.zeros((n_all, co, oh + 2 * ph + sy - 1, ow + 2 * pw + sx - 1), dtype=x.dtype)
    for n0 in range(0, n_all, n):
        n1 = min(n_all, n0 + n)
        gcol = xp.tensordot(W, x[n0:n1], (0, 1)).astype(x.dtype, copy=False)
        gcol = xp.rollaxis(gcol, 3)  # (n, co, kh, kw, h, w)
        part = img[n0:n1]
        for j in range(kh):  # col2im's order
            jdy = j * dy
            for i in range(kw):
                idx = i * dx
                part[:, :, jdy:jdy + sy * h:sy, idx:idx + sx * w:sx] += gcol[:, :, j, i]
        del gcol, part
    y = img[:, :, ph:oh + ph, pw:ow + pw]
    if b is not None:
        y += b.reshape((1, b.size, 1, 1))
    return y,


def _grad_w(f: Any, x: Any, gy: Any, limit: int, exact: bool) -> Optional[Tuple[Any]]:
    """Convolution2DGradW's forward over chunks of input channels (None:
    one call)."""
    if x.dtype != gy.dtype or x.dtype != f.W_dtype or f.groups != 1:
        return None
    n_all, c_all = x.shape[:2]
    _, o, oh, ow = gy.shape
    kh, kw = f.kh, f.kw
    cc = _chunk("gradw", gradw_kernel(x.shape, gy.shape, (o, c_all, kh, kw), x.dtype.itemsize),
                limit, exact, n_all)
    if cc is None:
        return None
    xp = backend.get_array_module(x)
    gyt = gy.transpose(1, 0, 2, 3).reshape(o, -1)  # numpy.tensordot's left operand
    gW = xp.empty((o, c_all, kh, kw), dtype=f.W_dtype) if cc < c_all else None
    m = n_all * oh * ow
    for c0 in range(0, c_all, cc):
        c1 = min(c_all, c0 + cc)
        col = _columns(xp, x[:, c0:c1], kh, kw, f.sy, f.sx, f.ph, f.pw, f.dy, f.dx, oh, ow)
        res = xp.dot(gyt, col.reshape(m, -1))
        del col
        if cc >= c_all:
            return res.reshape(o, c_all, kh, kw),
        gW[:, c0:c1] = res.reshape(o, c1 - c0, kh, kw)
        del res
    return gW,


# ------------------------------------------------------------ installing
def _wrap_core(original: Any, impl: Any) -> Any:
    def core(self: Any, *args: Any) -> Any:
        bound = _bound_of(self)
        if bound is not None and not getattr(self, "_use_ideep", False):
            out = impl(self, *args, *bound)
            if out is not None:
                return out
        return original(self, *args)
    core.__wrapped__ = original  # type: ignore[attr-defined]
    core.__doc__ = original.__doc__
    return core


def _wrap_backward(original: Any) -> Any:
    def backward(self: Any, indexes: Any, grad_outputs: Any) -> Any:
        bound = _node_limits.get(self)
        if bound is None:
            return original(self, indexes, grad_outputs)
        with _push(bound):
            return original(self, indexes, grad_outputs)
    backward.__wrapped__ = original  # type: ignore[attr-defined]
    backward.__doc__ = original.__doc__
    return backward


def install() -> None:
    """Route Chainer's convolution kernels through the bound (once; calls
    outside :func:`bounded` run Chainer's own code)."""
    global _installed
    if _installed:
        return
    for cls, impl in ((_conv.Convolution2DFunction, _conv_forward),
                      (_deconv.Deconvolution2DFunction, _deconv_forward),
                      (_conv.Convolution2DGradW, _grad_w)):
        for name in ("_forward_cpu_core", "_forward_gpu_core"):
            setattr(cls, name, _wrap_core(getattr(cls, name), impl))
    for cls in (_conv.Convolution2DFunction, _deconv.Deconvolution2DFunction):
        cls.backward = _wrap_backward(cls.backward)
    _installed = True


__all__ = ["bounded", "chunked_calls", "install"]
