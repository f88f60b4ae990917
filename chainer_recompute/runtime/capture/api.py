"""One recorded iteration: :func:`capture` runs the model once with a
:class:`~chainer_recompute.runtime.capture.recorder.Recorder` (and a
backward, if asked) inside :func:`leave_no_trace`, and returns its graph."""
from __future__ import annotations

from typing import Any, Callable, Optional

from .. import _chainer  # noqa: F401  (NumPy 2 compatibility before chainer)
import chainer

from ...core.errors import CaptureError
from ...core.graph import Graph
from .accounting import batch_size_of, state_bytes
from .arrays import backward_from
from .recorder import Recorder
from .trace import detached_arguments, leave_no_trace

def capture(model: Callable[..., Any], *args: Any, backward: bool = False,
            analyse: bool = True, cost_model: str = "measured",
            batch_size: Optional[int] = None, name: Optional[str] = None,
            link: Optional[chainer.Link] = None, check_recompute: Optional[bool] = None,
            **kwargs: Any) -> Graph:
    """Run ``model(*args, **kwargs)`` once, record its graph, and leave no
    trace (see :func:`leave_no_trace`).

    Args:
        model: a ``chainer.Link`` or any callable that applies Chainer
            functions.
        *args, **kwargs: its inputs.
        backward: also run a backward from the output (the sum of the first
            Variable returned, if not a scalar) to record the backward order,
            times and transient memory.
        analyse: find what is safe to recompute (``check_recompute`` is
            accepted as an older name).
        cost_model: the graph's cost model (``measured``, ``flops``,
            ``paper``).
        batch_size: the batch size, for scaling; default: the leading
            dimension of the first array argument.
        name: ``meta['model']``.
        link: the Link whose parameters name the graph's parameters
            (default: ``model`` or the Link of a bound method).

    Returns:
        The :class:`Graph`.

    Raises:
        CaptureError: ``model`` is not callable, backprop is disabled, or it
            applies no function; a forward that raises is re-raised as is,
            with a note naming the function that was running.

    >>> import chainer.links as L, numpy as np
    >>> g = capture(L.Linear(3, 2), np.ones((4, 3), np.float32))
    >>> g.n, g.nodes[0].op, g.batch_size
    (1, 'LinearFunction', 4)
    """
    if check_recompute is not None:
        analyse = check_recompute
    if not callable(model):
        raise CaptureError(f"capture needs a callable model (a chainer.Link or a function), "
                           f"got {type(model).__name__}")
    if not chainer.config.enable_backprop:
        raise CaptureError("capture runs with backprop disabled (chainer.no_backprop_mode?); "
                           "there is no graph to record: capture outside no_backprop_mode")
    link = link if link is not None else _find_link(model)
    if batch_size is None:
        batch_size = batch_size_of(args, kwargs)
    with leave_no_trace(model if link is None else link) as trace:
        args, kwargs = detached_arguments(args, kwargs)
        rec = Recorder(analyse=analyse, link=link, args=list(args) + list(kwargs.values()))
        try:
            with rec:
                result = model(*args, **kwargs)
        except Exception as e:
            if hasattr(e, "add_note"):
                last = rec.calls[-1].op if rec.calls else "nothing yet"
                e.add_note(f"chainer_recompute.capture: the model's forward raised after "
                           f"{len(rec.calls)} functions (last: {last})")
            raise
        rec.finish(result)
        trace.keep_grads(ref() for ref in rec.param_refs.values())
        if backward:
            if not backward_from(result, link):
                raise CaptureError(f"the model returned {type(result).__name__} holding no "
                                   f"chainer.Variable: nothing to backpropagate")
        graph = rec.graph(cost_model=cost_model, batch_size=batch_size,
                          name=name or type(model).__name__,
                          facts={"state_bytes": state_bytes(link)} if link is not None else None)
        del result
    return graph



def _find_link(model: Any) -> Optional[chainer.Link]:
    if isinstance(model, chainer.Link):
        return model
    owner = getattr(model, "__self__", None)
    return owner if isinstance(owner, chainer.Link) else None
