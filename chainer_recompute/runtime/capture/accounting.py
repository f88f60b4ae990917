"""Byte accounting outside the graph: the bytes a model's state takes
whatever the plan (parameters, gradients, optimizer state, persistents),
and the batch size of a call."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from .. import _chainer  # noqa: F401  (NumPy 2 compatibility before chainer)
import chainer

from ..device import device_of
from ..memory import parameter_bytes
from ..optimizer_update import update_bytes
from .arrays import is_array


def state_bytes(link: chainer.Link) -> Dict[str, int]:
    """Bytes that do not depend on the plan: ``params``, ``param_grads``
    (as many as the parameters: every training iteration makes them),
    ``optimizer_state`` (the update rules' state: what they hold, and for
    those that have made none yet, what they will make at the first
    update), ``update_transient`` (the largest temporary of the
    optimizer's update, its hooks included) and ``persistents`` (BatchNorm
    statistics and other persistent arrays). Each array counts what its
    device allocates for it (CuPy rounds up to 512 bytes), and once
    (:func:`parameter_bytes`: tied parameters once). The optimizer's
    figures are measured on throw-away copies, once per model
    (:func:`~chainer_recompute.runtime.optimizer_update.update_bytes`)."""
    nb = device_of([p.array for p in link.params() if p.array is not None]).allocation_bytes
    pb = parameter_bytes(link.params(), nbytes=nb)
    ub = update_bytes(link.params(), owner=link, nbytes=nb)
    persistents = 0
    seen: set = set()
    for sub in link.links():
        for name in getattr(sub, "_persistent", ()):
            v = getattr(sub, name, None)
            if is_array(v) and id(v) not in seen:
                seen.add(id(v))
                persistents += nb(v.nbytes)
    return {"params": pb["params"], "param_grads": pb["params"],
            "optimizer_state": ub.optimizer_state_bytes,
            "update_transient": ub.update_transient_bytes, "persistents": persistents}


def batch_size_of(args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[int]:
    """The leading dimension of the first array (or Variable) argument."""
    for a in list(args) + list(kwargs.values()):
        arr = a.raw_array if isinstance(a, chainer.Variable) else a
        if is_array(arr) and arr.ndim > 0:
            return int(arr.shape[0])
    return None
