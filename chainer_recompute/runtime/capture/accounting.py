"""Byte accounting outside the graph: the bytes a model's state takes
whatever the plan (parameters, gradients, optimizer state, persistents),
and the batch size of a call."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from .. import _chainer  # noqa: F401  (NumPy 2 compatibility before chainer)
import chainer

from ..device import device_of
from .arrays import is_array

def state_bytes(link: chainer.Link) -> Dict[str, int]:
    """Bytes that do not depend on the plan: ``params``, ``param_grads``
    (as many as the parameters: every training iteration makes them),
    ``optimizer_state`` (measured when the optimizer has run, otherwise
    estimated from its update rules), ``update_transient`` (the largest
    temporary of an update: one parameter's size) and ``persistents``
    (BatchNorm statistics and other persistent arrays). Each array counts
    what its device allocates for it (CuPy rounds up to 512 bytes)."""
    params = [p for p in link.params() if p.array is not None]
    nb = device_of([p.array for p in params]).allocation_bytes
    pbytes = sum(nb(p.array.nbytes) for p in params)
    state = 0
    largest = 0
    for p in params:
        largest = max(largest, nb(p.array.nbytes))
        rule = getattr(p, "update_rule", None)
        if rule is None:
            continue
        st = getattr(rule, "state", None)
        if st:
            state += sum(nb(v.nbytes) for v in st.values() if is_array(v))
        else:
            state += _STATE_COPIES.get(type(rule).__name__, 2) * nb(p.array.nbytes)
    persistents = 0
    seen: set = set()
    for sub in link.links():
        for name in getattr(sub, "_persistent", ()):
            v = getattr(sub, name, None)
            if is_array(v) and id(v) not in seen:
                seen.add(id(v))
                persistents += nb(v.nbytes)
    return {"params": pbytes, "param_grads": pbytes, "optimizer_state": state,
            "update_transient": largest, "persistents": persistents}


#: Arrays of a parameter's size that each of Chainer's update rules keeps
#: (used before the first update, when the state does not exist yet).
_STATE_COPIES = {
    "SGDRule": 0, "MomentumSGDRule": 1, "CorrectedMomentumSGDRule": 1, "NesterovAGRule": 1,
    "AdaGradRule": 1, "RMSpropRule": 1, "RMSpropGravesRule": 3, "AdaDeltaRule": 2,
    "AdamRule": 2, "MSVAGRule": 2, "SMORMS3Rule": 3,
}


def batch_size_of(args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[int]:
    """The leading dimension of the first array (or Variable) argument."""
    for a in list(args) + list(kwargs.values()):
        arr = a.raw_array if isinstance(a, chainer.Variable) else a
        if is_array(arr) and arr.ndim > 0:
            return int(arr.shape[0])
    return None
