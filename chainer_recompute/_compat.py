"""Make Chainer 7.8.1 import and run under NumPy 2.x and Python 3.12.

Apply :func:`ensure_numpy_compat` *before* ``import chainer``; the package's
``__init__`` does so. What Chainer 7.8.1 needs, found by scanning every
``numpy.X`` / ``np.X`` / ``xp.X`` attribute and ``from numpy import X`` in the
sources of ``chainer``, ``chainermn``, ``onnx_chainer`` and ``chainerx`` for
names present in NumPy 1.26 and absent from NumPy 2.3, then running a
conv/BN/ReLU/pooling/dropout/linear net, ``gradient_check`` and ResNet50
forward/backward on NumPy 2.3 (Python 3.11 and 3.12):

* ``numpy.sctypes`` (removed in NumPy 2.0): read at import by
  ``chainer.functions.array.as_strided``. Restored with the NumPy 1.26 value.
* ``numpy.distutils.system_info`` (not shipped for Python >= 3.12, NumPy 1.26
  included): imported by ``chainer._environment_check``, which calls
  ``get_info('blas_opt')`` on macOS only. Replaced by a stub whose
  ``get_info`` returns ``{}``. This one is keyed on the module being missing,
  not on the NumPy version.

No other NumPy 2.0 removal (``float_``, ``complex_``, ``bool8``, ``product``,
``alltrue``, ``NaN``, ``asfarray``, ``find_common_type``, ...) is used by
Chainer, so none is added: restoring names nobody reads would only hide
mistakes in new code. ``chainer.functions.resize_images`` uses
``numpy.float``, removed in NumPy 1.24 (so it fails on NumPy 1.26 as well):
:func:`patch_resize_images`, applied once Chainer is imported
(``chainer_recompute.runtime._chainer``), gives that one function a
``numpy`` with ``float`` and leaves NumPy itself alone.

Chainer also imports ``pkg_resources`` at run time (``_environment_check``);
setuptools 81 removed it. Importing this module raises a clear
:class:`ImportError` when Chainer is installed and ``pkg_resources`` is not.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
import types
from typing import Any, Dict, List, MutableMapping, Optional, Tuple

logger = logging.getLogger(__name__)

#: Every name this module has patched in this process, in order.
PATCHED: List[str] = []

_SCTYPE_NAMES: Dict[str, Tuple[str, ...]] = {
    "int": ("int8", "int16", "int32", "int64"),
    "uint": ("uint8", "uint16", "uint32", "uint64"),
    "float": ("float16", "float32", "float64", "longdouble"),
    "complex": ("complex64", "complex128", "clongdouble"),
}

PKG_RESOURCES_MESSAGE = (
    "Chainer 7.8.1 imports pkg_resources, which setuptools 81 removed; "
    "found Chainer installed but no pkg_resources. Install an older "
    "setuptools: pip install 'setuptools<81'")


def numpy_major(numpy_module: Any) -> int:
    """The major version of a NumPy module, read from ``__version__``.

    >>> numpy_major(types.SimpleNamespace(__version__='2.1.3'))
    2
    """
    return int(str(numpy_module.__version__).split(".")[0])


def build_sctypes(numpy_module: Any) -> Dict[str, list]:
    """The value ``numpy.sctypes`` had in NumPy 1.x, built from a module's types.

    Args:
        numpy_module: a NumPy module (or an object with its scalar types).

    Returns:
        ``{'int': [...], 'uint': [...], 'float': [...], 'complex': [...],
        'others': [bool, object, bytes, str, void]}``, as in NumPy 1.26.

    >>> import numpy
    >>> [t().itemsize for t in build_sctypes(numpy)['int']]
    [1, 2, 4, 8]
    """
    table: Dict[str, list] = {kind: [getattr(numpy_module, n) for n in names]
                              for kind, names in _SCTYPE_NAMES.items()}
    table["others"] = [bool, object, bytes, str, numpy_module.void]
    return table


def check_pkg_resources() -> None:
    """Raise :class:`ImportError` if Chainer is installed but ``pkg_resources`` is not.

    Without Chainer nothing is needed (the pure core runs without it), so
    nothing is checked.

    >>> check_pkg_resources()  # silent where setuptools<81 is installed
    """
    if importlib.util.find_spec("chainer") is None:
        return
    if importlib.util.find_spec("pkg_resources") is None:
        raise ImportError(PKG_RESOURCES_MESSAGE)


def _make_distutils_stub(numpy_name: str) -> Tuple[types.ModuleType, types.ModuleType]:
    """Modules ``<numpy>.distutils`` and ``<numpy>.distutils.system_info``."""
    package = types.ModuleType(f"{numpy_name}.distutils",
                               "Stub by chainer_recompute._compat: numpy.distutils "
                               "is not available on this Python/NumPy.")
    package.__path__ = []  # a package, so the submodule import resolves
    system_info = types.ModuleType(f"{numpy_name}.distutils.system_info",
                                   "Stub by chainer_recompute._compat.")

    def get_info(name: str, notfound_action: int = 0) -> Dict[str, Any]:
        """Nothing is known about the build: an empty dict, as for no library."""
        return {}

    system_info.get_info = get_info  # type: ignore[attr-defined]

    def _missing(attr: str) -> Any:
        raise AttributeError(
            f"{numpy_name}.distutils is a stub installed by chainer_recompute._compat "
            f"(numpy.distutils does not exist on this Python/NumPy); {attr!r} is not "
            f"provided")

    package.__getattr__ = _missing  # type: ignore[attr-defined]
    package.system_info = system_info  # type: ignore[attr-defined]
    return package, system_info


def ensure_distutils_stub(numpy_module: Any,
                          modules: Optional[MutableMapping[str, Any]] = None,
                          available: Optional[bool] = None) -> bool:
    """Install a ``numpy.distutils.system_info`` stub if NumPy has none.

    Args:
        numpy_module: the NumPy module whose ``distutils`` Chainer imports.
        modules: the module table to patch; ``sys.modules`` by default.
        available: whether the real ``numpy.distutils`` exists; found with
            :func:`importlib.util.find_spec` when None.

    Returns:
        True if a stub was installed by this call.

    >>> fake = types.SimpleNamespace(__name__='fakenp')
    >>> table = {}
    >>> ensure_distutils_stub(fake, table, available=False)
    True
    >>> table['fakenp.distutils.system_info'].get_info('blas_opt')
    {}
    """
    modules = sys.modules if modules is None else modules
    name = numpy_module.__name__
    if f"{name}.distutils.system_info" in modules:
        return False
    if available is None:
        try:
            available = importlib.util.find_spec(f"{name}.distutils") is not None
        except (ImportError, ValueError):
            available = False
    if available:
        return False
    package, system_info = _make_distutils_stub(name)
    modules[package.__name__] = package
    modules[system_info.__name__] = system_info
    try:
        setattr(numpy_module, "distutils", package)
    except (AttributeError, TypeError):  # read-only object: the table suffices
        pass
    return True


def ensure_numpy_compat(numpy_module: Any = None,
                        modules: Optional[MutableMapping[str, Any]] = None) -> Tuple[str, ...]:
    """Restore what Chainer 7.8.1 needs from NumPy 1.x; idempotent.

    On NumPy 1.x nothing is added to ``numpy``. On NumPy >= 2 ``sctypes`` is
    restored (see the module docstring for why only it). On any version a
    ``numpy.distutils.system_info`` stub is installed when that module does
    not exist (Python >= 3.12). Call before ``import chainer``.

    Args:
        numpy_module: the module to patch; the real ``numpy`` by default
            (another object is accepted for testing).
        modules: the module table for the ``distutils`` stub;
            ``sys.modules`` by default. With a ``numpy_module`` other than
            the real numpy and no ``modules``, the stub is not installed.

    Returns:
        The names patched by this call (empty when nothing was missing), e.g.
        ``('numpy.sctypes',)``. Every patch is also logged at INFO level and
        appended to :data:`PATCHED`.

    >>> patched = ensure_numpy_compat()  # ('numpy.sctypes',) on NumPy 2, () on 1.26
    >>> ensure_numpy_compat()  # idempotent
    ()
    """
    if numpy_module is None:
        import numpy as numpy_module  # noqa: F811
        real = True
    else:
        real = numpy_module is sys.modules.get("numpy")
    name = getattr(numpy_module, "__name__", "numpy")
    patched: List[str] = []

    if numpy_major(numpy_module) >= 2:
        # getattr, not hasattr: NumPy 2's module __getattr__ raises
        # AttributeError with a removal message for expired names.
        try:
            getattr(numpy_module, "sctypes")
        except AttributeError:
            setattr(numpy_module, "sctypes", build_sctypes(numpy_module))
            patched.append(f"{name}.sctypes")

    if real or modules is not None:
        if ensure_distutils_stub(numpy_module, modules):
            patched.append(f"{name}.distutils.system_info")

    if patched:
        PATCHED.extend(patched)
        logger.info("NumPy %s: restored for Chainer 7.8.1: %s",
                    numpy_module.__version__, ", ".join(patched))
    return tuple(patched)


check_pkg_resources()


class _NumpyWithFloat(types.ModuleType):
    """NumPy proxy that also answers ``float`` (removed in NumPy 1.24)."""

    float = float

    def __init__(self, wrapped: Any) -> None:
        super().__init__(wrapped.__name__)
        self._wrapped = wrapped

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


def patch_resize_images() -> bool:
    """Let ``F.resize_images`` run on NumPy >= 1.24; idempotent.

    Chainer 7.8.1's ``chainer.functions.array.resize_images`` computes its
    sampling grid in ``compute_indices_and_weights`` with
    ``dtype=numpy.float`` (forward and backward). This replaces that one
    function of that module by a copy whose ``numpy`` global is a proxy that
    adds ``float`` (the builtin, i.e. float64, as NumPy < 1.24 had it);
    NumPy and every other Chainer function are untouched. Call it after
    Chainer is imported (``chainer_recompute.runtime._chainer`` does).

    Returns:
        True if the patch was applied by this call.

    >>> import chainer_recompute.runtime._chainer
    >>> patch_resize_images()  # already applied on import
    False
    """
    from chainer.functions.array import resize_images as mod
    orig = mod.compute_indices_and_weights
    if hasattr(orig.__globals__["numpy"], "float"):
        return False
    env = dict(orig.__globals__)
    env["numpy"] = _NumpyWithFloat(orig.__globals__["numpy"])
    patched = types.FunctionType(orig.__code__, env, orig.__name__, orig.__defaults__,
                                 orig.__closure__)
    patched.__doc__ = orig.__doc__
    patched.__wrapped__ = orig  # type: ignore[attr-defined]
    mod.compute_indices_and_weights = patched
    PATCHED.append("chainer.functions.array.resize_images (numpy.float)")
    logger.info("patched chainer.functions.array.resize_images.compute_indices_and_weights "
                "(numpy.float)")
    return True
