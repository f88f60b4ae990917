"""``apply()`` and :class:`Recompute`: record the real iteration, plan, then
run every training forward under the backward driver.

>>> import chainer_recompute as cr                        # doctest: +SKIP
>>> model = cr.apply(model, budget='8G')                # doctest: +SKIP
>>> loss = model(x, t); loss.backward()                 # doctest: +SKIP

The first training call with a new input signature (shapes, dtypes, device,
train mode, other arguments) is planned before it runs, from two small
captures scaled to the real batch (``capture_batch='auto'``), so that the
budget holds from the first step; a call the captures cannot describe runs
as plain Chainer while its graph is recorded, and the next call runs under
a plan made from that recording. Every planned iteration is checked against
its plan as it runs (function classes, shapes and the real wiring); an
iteration that stops matching keeps what it has not released, records its
new structure, and the next call plans that one too. Evaluation calls
(``chainer.using_config('train', False)``, ``no_backprop_mode``) run the
plain forward. What the defaults do: docs/defaults.md.
"""
from ..executor import IterationStats
from .install import _rebuild, apply, remove, runner_of  # noqa: F401 (_rebuild: old pickles)
from .log import logger, report  # noqa: F401
from .describe import describe_plan
from .recompute import Recompute
from .tuning import Tuning
from .views import SignatureView, StructureView

__all__ = ["IterationStats", "Recompute", "SignatureView", "StructureView", "Tuning", "apply",
           "describe_plan", "remove", "runner_of"]
