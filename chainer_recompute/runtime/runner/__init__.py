"""``apply()`` and :class:`Recompute`: record the real iteration, plan, then
run every training forward under the backward driver.

>>> import chainer_recompute as cr                        # doctest: +SKIP
>>> model = cr.apply(model, budget='8G')                # doctest: +SKIP
>>> loss = model(x, t); loss.backward()                 # doctest: +SKIP

The first training call with a new input signature (shapes, dtypes, device,
train mode, other arguments) runs exactly as plain Chainer would (one
forward, the same random draws, side effects, lazy initialisation and
BatchNorm updates) while its graph is recorded, with the backward that
follows it. The next call with that signature plans (solves for the budget)
and runs under the plan. Every planned iteration is checked against the
plan as it runs (function classes, shapes and the real wiring); an
iteration that stops matching keeps what it has not released, records its
new structure and the next call plans that one too: a signature keeps a few
plans, one per structure. A model whose structure changes on almost every
call falls back to plain Chainer with one warning.

``capture_batch=N`` plans before the first call instead, from a separate
small-batch capture scaled to the real batch, so that the budget holds from
the first step; that capture leaves no trace (random states, persistent
values, lazily created parameters are restored). Evaluation calls
(``chainer.using_config('train', False)``, ``no_backprop_mode``) run the
plain forward.
"""
from ..executor import IterationStats
from .install import _rebuild, apply, remove, runner_of  # noqa: F401 (_rebuild: old pickles)
from .log import logger, report  # noqa: F401
from .describe import describe_plan
from .recompute import Recompute
from .views import SignatureView, StructureView

__all__ = ["IterationStats", "Recompute", "SignatureView", "StructureView", "apply", "describe_plan", "remove", "runner_of"]
