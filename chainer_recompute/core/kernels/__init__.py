"""The compiled kernels, one module per algorithm, and the one switch that
picks an algorithm's engine (:func:`pick_engine`).

Each algorithm below runs on two engines that give the same results: a
reference one (NumPy; plain Python for the replay) beside the algorithm's
own code, and loops compiled by numba (the ``fast`` extra) here:

- :mod:`.replay`: the replay of :mod:`~chainer_recompute.core.replay` as
  one loop over flat arrays;
- :mod:`.dp`: the flat DP of :mod:`~chainer_recompute.core.solvers._dp`
  (its NumPy engine: ``_dp/numpy_engine.py``) and the lower-set family's
  builders (:mod:`~chainer_recompute.core.lower_sets`);
- :mod:`.hier`: the hierarchical DP's chain table, both engines;
- :mod:`.tree`: the tables of the tree DP of nested plans
  (:mod:`~chainer_recompute.core.solvers.nested_tree`), both engines;
- :mod:`.columns`: the im2col copy of the bounded convolutions
  (:mod:`chainer_recompute.runtime.workspace`; its NumPy engine there).

Only this package imports numba, and only when a compiled engine is
picked. Pure core: numpy only.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from ..errors import EngineUnavailableError

__all__ = ["ENGINES", "compiled", "numba_available", "pick_engine"]

#: The engines every algorithm accepts: ``auto`` (compiled when numba is
#: installed and the algorithm's own rule says it pays), ``numba`` (compiled;
#: an error without numba) or the reference engine (``numpy``; the replay
#: calls it ``python``).
ENGINES = ("auto", "numba", "numpy")

_NUMBA: Optional[bool] = None


def numba_available() -> bool:
    """Whether numba is installed and imports (the compiled engines can
    run). A numba that is installed but does not import (one built for
    another NumPy raises ``ImportError``) counts as missing, with a warning,
    so that ``engine='auto'`` runs the reference engines instead of failing.

    >>> isinstance(numba_available(), bool)
    True
    """
    global _NUMBA
    if _NUMBA is None:
        import importlib.util
        _NUMBA = importlib.util.find_spec("numba") is not None
        if _NUMBA:
            try:
                import numba  # noqa: F401
            except Exception as e:  # noqa: BLE001  (any failure of its import)
                import warnings
                warnings.warn(f"numba is installed but does not import ({type(e).__name__}: "
                              f"{e}); the planner runs its NumPy engines", RuntimeWarning,
                              stacklevel=2)
                _NUMBA = False
    return _NUMBA


def pick_engine(engine: Optional[str], *, what: str, default: str = "auto",
                pays: Union[bool, Callable[[], bool]] = True,
                reference: str = "numpy") -> str:
    """The engine an algorithm runs on: ``'numba'`` or ``reference``.

    Args:
        engine: ``'auto'``, ``'numba'``, ``reference``, or ``None`` (``default``).
        what: the algorithm, for the messages ("flat DP", "replay", ...).
        default: the engine ``None`` stands for.
        pays: for ``'auto'`` with numba installed, whether the compiled
            engine is worth loading (a callable is asked only then).
        reference: the name of the algorithm's reference engine.

    Raises:
        ValueError: ``engine`` is not one of the names above.
        EngineUnavailableError: ``'numba'`` was asked for and numba is not
            installed (no silent fall-back to the reference engine).

    >>> pick_engine('numpy', what='flat DP')
    'numpy'
    >>> pick_engine('fortran', what='replay', reference='python')
    Traceback (most recent call last):
    ...
    ValueError: unknown replay engine 'fortran'; accepted: ['auto', 'numba', 'python']
    """
    engine = default if engine is None else engine
    accepted = ("auto", "numba", reference)
    if engine not in accepted:
        raise ValueError(f"unknown {what} engine {engine!r}; accepted: {list(accepted)}")
    if engine == reference:
        return reference
    if engine == "numba":
        if not numba_available():
            raise EngineUnavailableError(
                f"the {what} was asked to run on engine='numba', but numba is not installed: "
                f"pip install 'chainer-recompute[fast]', or pass engine='auto' (the "
                f"{reference} engine when numba is missing) or engine={reference!r}")
        return "numba"
    if not (pays() if callable(pays) else pays):  # asked first: numba is imported only if it pays
        return reference
    return "numba" if numba_available() else reference


_COMPILED: Dict[Tuple[str, str], Any] = {}


def compiled(module: ModuleType, name: str, helpers: Sequence[str] = ()) -> Any:
    """``module.name`` compiled by numba (``cache=True, nogil=True``), once
    per process; the ``helpers`` it calls are compiled first, in place in
    the module's globals (numba calls only compiled functions)."""
    key = (module.__name__, name)
    k = _COMPILED.get(key)
    if k is None:
        import numba
        g = vars(module)
        for h in helpers:
            if not hasattr(g[h], "py_func"):
                g[h] = numba.njit(cache=True, nogil=True)(g[h])
        k = _COMPILED[key] = numba.njit(cache=True, nogil=True)(g[name])
    return k
