"""Recording Chainer's define-by-run graph of a real iteration into a
:class:`~chainer_recompute.core.graph.Graph`, and what it needs, one job a
module:

- :mod:`.recorder`: the ``FunctionHook`` that records a forward and its
  backward (:class:`Recorder`, :class:`Call`);
- :mod:`.safety`: whether a function can be recomputed, and the role of
  each array it keeps (:func:`analyse_function`);
- :mod:`.trace`: :func:`leave_no_trace`, which puts back what an extra
  forward changed;
- :mod:`.accounting`: the model-state bytes outside the graph
  (:func:`state_bytes`) and :func:`batch_size_of`;
- :mod:`.arrays`: inspecting functions and arrays (views, checksums, the
  arrays a function keeps);
- :mod:`.api`: :func:`capture`, one recorded iteration that leaves no trace.
"""
from .accounting import batch_size_of, state_bytes
from .api import capture
from .arrays import (attribute_arrays, backward_from, buffer_print, fingerprint, function_op,
                     held_arrays, is_array, owner_of, persistent_array_ids, result_variables,
                     root_of, same_array)  # noqa: F401
from .recorder import Call, Recorder
from .safety import _ANALYSIS_CACHE, Analysis, analyse_function  # noqa: F401
from .trace import detached_arguments, leave_no_trace

__all__ = ["Analysis", "Call", "Recorder", "analyse_function", "attribute_arrays",
           "backward_from", "batch_size_of", "capture", "detached_arguments", "fingerprint",
           "function_op", "leave_no_trace", "owner_of", "persistent_array_ids", "result_variables", "root_of",
           "same_array", "state_bytes"]
