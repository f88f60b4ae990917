"""The runner's loggers: ``logger`` for details, ``report`` for what a
user of apply() is told (visible by default on stderr while logging is
unconfigured)."""
from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger(__package__)

#: What a user of apply() is told (the first plan, an infeasible budget, a
#: fallback): visible by default on stderr, like the CLI's own output;
#: ``verbose=False`` silences the informational lines. Its records propagate
#: as any library's do: once the application configures logging (a handler
#: on the root logger or on a ``chainer_recompute`` logger), they go there
#: only, and the fallback line on stderr stays silent.
report = logging.getLogger("chainer_recompute.report")


class _FallbackHandler(logging.StreamHandler):
    """Writes the report's lines to the current ``sys.stderr`` only while no
    other handler would receive them (logging left unconfigured)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("chainer_recompute: %(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> Any:  # the stderr of the moment (pytest's capture, a redirect)
        import sys
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        logger_: Optional[logging.Logger] = logging.getLogger(record.name)
        while logger_ is not None:
            if any(h is not self for h in logger_.handlers):
                return  # configured: those handlers have it
            if not logger_.propagate:
                break
            logger_ = logger_.parent  # type: ignore[assignment]
        super().emit(record)


if not any(isinstance(h, _FallbackHandler) or type(h).__name__ == "_FallbackHandler"
           for h in report.handlers):
    report.addHandler(_FallbackHandler())
if report.level == logging.NOTSET:
    report.setLevel(logging.INFO)
