"""Import Chainer after making NumPy 2 look like NumPy 1 where Chainer 7.8.1
needs it, then mend the one Chainer function that newer NumPy 1.x breaks.
Every module of this package that uses Chainer imports it through
``from . import _chainer`` first."""
from .._compat import ensure_numpy_compat, patch_resize_images

ensure_numpy_compat()

import chainer  # noqa: E402,F401

patch_resize_images()


def param_grad(p: "chainer.Variable"):
    """``p.grad``, or None where reading it raises: a parameter never
    initialised (a lazy link its forward has not called) has no valid
    gradient until ``cleargrads()``, which ``Optimizer.update(lossfun)``
    calls only after the forward. (Chainer's own optimizer reads the same
    flag.)"""
    return p.grad if p._grad_valid else None
