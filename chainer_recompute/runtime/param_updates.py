"""Optimizer updates as the runtime sees them: ``UpdateRule.update`` is
patched only while it is needed, to save a parameter's values for the live
iterations that may still regenerate from it, and to tell the watchers (the
runner's measurement of the update) after each update."""
from __future__ import annotations

import weakref
from typing import Any, Callable, List, Protocol

from . import _chainer  # noqa: F401
import chainer


class LiveIteration(Protocol):
    """What this module needs of a live iteration (the executor's
    ``IterationHook``): told before an optimizer updates a parameter in
    place."""

    def before_param_update(self, param: Any, copy: Callable[[], Any]) -> None: ...


# Hooks whose released blocks were computed from parameters that an
# optimizer update must save first (snapshot-on-update, see the
# docstring of ``runtime.executor``). ``UpdateRule.update`` is patched only
# while one is alive.
_LIVE: "weakref.WeakSet[LiveIteration]" = weakref.WeakSet()
_LIVE_COUNT = [0]
_ORIGINAL_UPDATE: List[Any] = []  # the unpatched UpdateRule.update while patched


_WATCHERS: List[Callable[[Any], bool]] = []  # called after each update (True: done)


def _update(self: Any, param: Any) -> Any:
    """``UpdateRule.update`` while patched: save ``param``'s values for the
    live iterations that may still regenerate from it, update, and tell the
    watchers (the runner's measurement of the update)."""
    if _LIVE:
        saved: List[Any] = []

        def copy() -> Any:  # one copy, shared by every live iteration
            if not saved:
                saved.append(param.array.copy())
            return saved[0]
        for hook in list(_LIVE):
            hook.before_param_update(param, copy)
    out = _ORIGINAL_UPDATE[0](self, param)
    if _WATCHERS:
        for w in list(_WATCHERS):
            if w(param) and w in _WATCHERS:
                _WATCHERS.remove(w)
        if not _WATCHERS and _LIVE_COUNT[0] <= 0:
            _unpatch_update_rule()
    return out


def add_update_watcher(watcher: Callable[[Any], bool]) -> None:
    """Call ``watcher(param)`` after each optimizer update of a parameter
    until it returns True or is removed (``UpdateRule.update`` is patched
    meanwhile)."""
    _patch_update_rule()
    _WATCHERS.append(watcher)


def remove_update_watcher(watcher: Callable[[Any], bool]) -> None:
    if watcher in _WATCHERS:
        _WATCHERS.remove(watcher)
    if not _WATCHERS and _LIVE_COUNT[0] <= 0:
        _unpatch_update_rule()


def _patch_update_rule() -> None:
    """Patch ``UpdateRule.update`` (once) while an iteration may need it."""
    if _ORIGINAL_UPDATE:
        return
    original = chainer.optimizer.UpdateRule.update
    _ORIGINAL_UPDATE.append(original)
    _update.__wrapped__ = original  # type: ignore[attr-defined]
    chainer.optimizer.UpdateRule.update = _update


def _unpatch_update_rule() -> None:
    """Put ``UpdateRule.update`` back (unless someone patched it over ours,
    then ours stays and passes through)."""
    if _ORIGINAL_UPDATE and chainer.optimizer.UpdateRule.update is _update:
        chainer.optimizer.UpdateRule.update = _ORIGINAL_UPDATE.pop()


def _add_live(hook: LiveIteration) -> None:
    if hook in _LIVE:
        return
    _patch_update_rule()
    _LIVE.add(hook)
    _LIVE_COUNT[0] += 1
    weakref.finalize(hook, _live_died)


def _live_died() -> None:
    _LIVE_COUNT[0] -= 1
    if _LIVE_COUNT[0] <= 0:
        _LIVE_COUNT[0] = 0
        if not _WATCHERS:
            _unpatch_update_rule()


def _update_count(param: Any) -> int:
    """How many times an optimizer has updated ``param`` (its update
    rule's ``t``; -1 without an update rule)."""
    rule = getattr(param, "update_rule", None)
    t = getattr(rule, "t", None)
    return int(t) if t is not None else -1
