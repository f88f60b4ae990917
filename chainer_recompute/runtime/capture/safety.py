"""Safety analysis: whether a function can be recomputed, found by running
its forward once more right after the first (no list of known functions).

Right after a function's forward, the recorder runs it once more on the
same inputs, which tells:

- whether it draws fresh randomness: the global NumPy (and CuPy) random
  state is compared around the first forward, and the second one runs on a
  *different* random state and must neither draw nor give other outputs (a
  dropout mask held in the function object is reused, so dropout passes);
- which attribute arrays are *derived* (made again by forward: max-pooling
  indexes, BatchNorm ``mean`` / ``inv_std``) and which are *state* that
  must be kept (dropout's ``mask``);
- which pre-existing arrays the first forward *wrote* (BatchNorm running
  statistics): a recomputation detaches them;
- whether the forward modified its inputs in place (then it is unsafe).

The global random state is put back around every rerun and every written
array is restored, so the iteration is left exactly as plain Chainer leaves
it. Results are cached per function class and configuration.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy

from .. import _chainer  # noqa: F401  (NumPy 2 compatibility before chainer)
import chainer
from chainer import backend

from ..device import RandomStates
from .arrays import _SKIP_ATTRS, _attr_owners, is_array, same_array

class Analysis:
    """Whether a function can be recomputed, and what its attributes are."""

    __slots__ = ("recomputable", "reason", "roles")

    def __init__(self, recomputable: bool, reason: str, roles: Dict[str, str]) -> None:
        self.recomputable, self.reason, self.roles = recomputable, reason, roles


_ANALYSIS_CACHE: Dict[Tuple[Any, ...], Analysis] = {}
_ANALYSIS_CACHE_LIMIT = 4096


def _scalar_kind(v: Any) -> Optional[str]:
    if isinstance(v, (bool, int, float, str, type(None))):
        return type(v).__name__
    if isinstance(v, tuple) and all(isinstance(x, (bool, int, float, str)) for x in v):
        return "tuple"
    return None


def _config_key(f: Any) -> Tuple[Any, ...]:
    """A function's class and the names and kinds of its scalar settings."""
    config = []
    for owner in _attr_owners(f):
        for k, v in vars(owner).items():
            if k in _SKIP_ATTRS:
                continue
            kind = _scalar_kind(v)
            if kind is not None:
                config.append((k, kind))
    return (type(f), type(getattr(f, "_function", None)), tuple(sorted(config)))


#: config key -> whether such a function wrote its inputs when checked.
_WRITES_INPUTS: Dict[Tuple[Any, ...], bool] = {}


def _analysis_key(f: Any, in_data: Tuple[Any, ...], held_names: Tuple[str, ...],
                  rng_drawn: bool, written: Tuple[str, ...]) -> Tuple[Any, ...]:
    return _config_key(f) + (
        held_names, tuple((str(x.dtype), x.ndim) if is_array(x) else None for x in in_data),
        rng_drawn, written)


def _rerun(f: chainer.FunctionNode, in_data: Tuple[Any, ...],
           clear: Sequence[Tuple[Any, str]] = (),
           detach: Sequence[Tuple[Any, str]] = (),
           remade: Optional[List[Any]] = None) -> Tuple[Any, ...]:
    """Run ``f.forward`` again; attributes in ``clear`` set to None and
    those in ``detach`` replaced by copies for the run; ``remade`` gets the
    values the run left in the ``clear`` attributes. ``f``'s attributes are
    put back as they were afterwards."""
    saved = [dict(vars(o)) for o in _attr_owners(f)]
    try:
        for owner, name in clear:
            setattr(owner, name, None)
        for owner, name in detach:
            setattr(owner, name, getattr(owner, name).copy())
        with chainer.using_config("in_recomputing", True), \
                chainer.using_device(backend.get_device_from_array(*in_data)):
            out = tuple(type(f).forward(f, in_data))
        if remade is not None:
            remade.extend(getattr(owner, name, None) for owner, name in clear)
        return out
    finally:
        for o, d in zip(_attr_owners(f), saved):
            vars(o).clear()
            vars(o).update(d)


def static_graph_reason(f: Any) -> Optional[str]:
    """Why ``f``, a function of a ``@static_graph`` chain, cannot be
    recomputed (None: it is not one). While the chain's schedule is built,
    Chainer's schedule reads every function's retained arrays as the next
    one is added (a released one crashes it), and a built schedule runs as
    one function that writes into the schedule's own arrays."""
    if getattr(chainer.config, "schedule_func", None) is not None:
        return "it runs in a @static_graph chain while its schedule is built"
    t = type(f)
    if t.__name__ == "StaticScheduleFunction" and t.__module__.startswith("chainer."):
        return "it is a @static_graph chain's schedule, which reuses its own arrays"
    return None


def static_graph_chains(link: Any) -> List[str]:
    """The paths of ``link``'s links (itself included) whose ``__call__``
    or ``forward`` is wrapped by Chainer's ``@static_graph``."""
    found = []
    for path, sub in link.namedlinks():
        for name in ("__call__", "forward"):
            f = getattr(type(sub), name, None)
            if getattr(f, "__module__", "") == "chainer.graph_optimizations.static_graph":
                found.append(path or "/")
                break
    return found


def analyse_function(f: chainer.FunctionNode, in_data: Tuple[Any, ...],
                     out_data: Tuple[Any, ...], held: Sequence[Tuple[Any, str, Any]],
                     rng_drawn: bool, written: Sequence[Tuple[Any, str]],
                     rng_before: Any = None) -> Analysis:
    """Decide whether ``f`` (whose forward has just run) can be recomputed,
    and the role of each attribute array in ``held``.

    Args:
        f: the function node.
        in_data, out_data: its inputs and the outputs of its first forward.
        held: ``(owner, name, array)`` of the attribute arrays to classify
            (neither inputs, outputs, parameters nor persistent values).
        rng_drawn: the first forward changed the global random state.
        written: ``(owner, name)`` of the pre-existing attribute arrays the
            first forward changed in place.
        rng_before: NumPy's global random state before the first forward.

    Returns:
        An :class:`Analysis`: roles are ``written``, ``derived``, ``drawn``
        (made again bit for bit by a rerun from ``rng_before``, which then
        leaves NumPy's state where the first forward left it: a dropout
        mask) or ``state``; ``recomputable`` is False when a rerun draws
        randomness again, gives other outputs, or fails.
    """
    roles = {name: "written" for _, name in written}
    key = _analysis_key(f, in_data, tuple(sorted(n for _, n, _ in held)), rng_drawn,
                        tuple(sorted(roles)))
    cached = _ANALYSIS_CACHE.get(key)
    if cached is not None:
        return Analysis(cached.recomputable, cached.reason, dict(cached.roles))

    def run(clear: Sequence[Tuple[Any, str]] = (),
            remade: Optional[List[Any]] = None) -> Tuple[Optional[Tuple[Any, ...]], bool]:
        """(outputs or None on failure, whether the run drew randomness)."""
        with RandomStates.isolated():
            before = numpy.random.get_state()
            try:
                out = _rerun(f, in_data, clear=clear, detach=written, remade=remade)
            except Exception:  # noqa: BLE001 - any failure means "not reproducible"
                return None, False
            return out, RandomStates.numpy_changed(before)

    def same(out: Optional[Tuple[Any, ...]]) -> bool:
        return out is not None and len(out) == len(out_data) and all(
            same_array(x, y) for x, y in zip(out, out_data))

    rng_after = numpy.random.get_state()

    def drawn_again(owner: Any, name: str, value: Any) -> bool:
        """A rerun without the attribute, from the random state before the
        first forward, makes it and the outputs bit for bit and leaves the
        state where the first forward did."""
        if not rng_drawn or rng_before is None:
            return False
        remade: List[Any] = []
        with RandomStates.isolated():
            numpy.random.set_state(rng_before)
            try:
                out = _rerun(f, in_data, clear=[(owner, name)], detach=written, remade=remade)
            except Exception:  # noqa: BLE001 - any failure means "not reproducible"
                return False
            where_first_left = not RandomStates.numpy_changed(rng_after)
        return (where_first_left and same(out) and bool(remade) and is_array(remade[0])
                and same_array(remade[0], value))

    result: Analysis
    out, drew = run()
    if out is None:
        result = Analysis(False, "its forward could not be run again", roles)
    elif drew:
        result = Analysis(False, "it draws fresh randomness from the global random state "
                                 "on every forward (it does not keep its draw)", roles)
    elif not same(out):
        result = Analysis(False, "a second forward on the same inputs gives other outputs "
                                 "(its forward changes state it reads, as "
                                 "BatchRenormalization's running averages, or draws "
                                 "randomness it does not keep)", roles)
    else:
        for owner, name, value in held:
            if name in roles:
                continue
            # Derived: the forward makes the attribute again, bit for bit,
            # from the inputs alone. Outputs that merely match without it
            # (F.where's condition when it is all False) do not make it so.
            remade: List[Any] = []
            out2, drew2 = run(clear=[(owner, name)], remade=remade)
            again = remade[0] if remade else None
            roles[name] = ("derived" if same(out2) and not drew2 and is_array(again)
                           and same_array(again, value) else
                           "drawn" if drew2 and drawn_again(owner, name, value) else "state")
        result = Analysis(True, "", roles)
    if len(_ANALYSIS_CACHE) < _ANALYSIS_CACHE_LIMIT:
        _ANALYSIS_CACHE[key] = Analysis(result.recomputable, result.reason, dict(result.roles))
    return result
