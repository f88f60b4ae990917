"""Trainer extensions: ``chainer_recompute.extensions.RecomputeReport``
(defined in :mod:`chainer_recompute.runtime.extensions`)."""
from .runtime.extensions import RecomputeReport

__all__ = ["RecomputeReport"]
