"""Progress lines (or bars) for the CLI's and the benchmarks' long steps.

Pure: no chainer import (the CLI plans saved graphs without Chainer).
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Iterator, Optional, TextIO

__all__ = ["Progress"]


class Progress:
    """Progress of a run's long steps, on ``stream`` (stderr).

    On a terminal with :mod:`tqdm` installed each step is a bar (with an
    ETA when its total is known); otherwise each step prints one line when
    it ends (if it took ``quiet_below_s`` or more), and a step that runs
    longer than ``every_s`` prints a line with its count (and ETA, when
    the total is known) every ``every_s``. ``enabled=False`` prints nothing.

    >>> import io
    >>> out = io.StringIO()
    >>> with Progress(out, tty=False, quiet_below_s=0).step("solving") as s:
    ...     s.update()
    >>> out.getvalue().startswith("solving: done")
    True
    """

    def __init__(self, stream: Optional[TextIO] = None, *, enabled: bool = True,
                 tty: Optional[bool] = None, every_s: float = 10.0,
                 quiet_below_s: float = 1.0) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.tqdm: Any = None
        if tty:
            try:
                from tqdm import tqdm
                self.tqdm = tqdm
            except ImportError:
                self.tqdm = None
        self.every_s = every_s
        #: steps shorter than this print no line of their own
        self.quiet_below_s = quiet_below_s

    def line(self, text: str) -> None:
        """One line of its own (between bars)."""
        if not self.enabled:
            return
        if self.tqdm is not None:
            self.tqdm.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    @contextlib.contextmanager
    def step(self, label: str, total: Optional[int] = None, unit: str = "it") -> Iterator["_Step"]:
        """A step; ``update(n)`` as its work advances."""
        s = _Step(self, label, total, unit)
        try:
            yield s
        finally:
            s.close()


class _Step:
    def __init__(self, progress: Progress, label: str, total: Optional[int], unit: str) -> None:
        self.p, self.label, self.total, self.unit = progress, label, total, unit
        self.n = 0
        self.t0 = self.last = time.perf_counter()
        self.bar = None
        if progress.enabled and progress.tqdm is not None:
            self.bar = progress.tqdm(total=total, desc=label, unit=unit, file=progress.stream,
                                     leave=False, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if self.p.enabled and now - self.last >= self.p.every_s:
            self.last = now
            self.p.line(f"{self.label}: {self.n}{'/' + str(self.total) if self.total else ''} "
                        f"{self.unit}, {now - self.t0:.0f} s{self._eta(now)}")

    def _eta(self, now: float) -> str:
        if not self.total or self.n <= 0 or self.n >= self.total:
            return ""
        return f", about {(now - self.t0) * (self.total - self.n) / self.n:.0f} s left"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        took = time.perf_counter() - self.t0
        if took >= self.p.quiet_below_s or self.last != self.t0:
            self.p.line(f"{self.label}: done in {took:.1f} s")
