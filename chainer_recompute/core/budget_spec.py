"""A memory budget as a user writes it, parsed once into a :class:`Budget`.

Pure core: no Chainer, no CuPy. Every entry point (``apply()``,
``Recompute``, ``ChainRecompute``, ``distributed.apply``, the command line,
:func:`~chainer_recompute.core.budget.plan_for_budget`) reads a budget with
:func:`parse_budget`; the forms (docs/defaults.md has the same table):

- ``'8G'``, ``'8g'``, ``'8 G'``, ``'8GiB'``, ``'8gib'``: 8·2^30 bytes (binary:
  any case, spaces allowed);
- ``'8GB'``, ``'8gb'``, ``'8Gb'``, ``'8 GB'``: 8·10^9 bytes (with a ``B``
  and no ``i``: decimal);
- ``123456``: bytes (an int, or a number of at least 1);
- ``'least'``: the least feasible budget, found when planning;
- ``'60%'``: that share of what plain Chainer needs for the same input
  (its predicted peak with the planner's 1% headroom), resolved for each
  input signature where its plan is made;
- ``'device'``: what the model's device can give, less
  :data:`DEVICE_MARGIN` (10%): on CuPy the free memory plus all that the
  pool holds, or the pool's limit if one is set; on NumPy the host's
  available memory.

Anything else raises :class:`~chainer_recompute.core.errors.BudgetError`
with the list of forms (``0.5`` is read as a share meant: ``'50%'``).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import re
from typing import Any, Optional

from .errors import BudgetError
from .units import format_bytes, format_bytes_up, parse_bytes, unit_forgotten

__all__ = ["Budget", "parse_budget", "BUDGET_FORMS", "DEVICE_MARGIN", "host_available_bytes"]

#: What a ``'device'`` budget leaves unused of what the device can give:
#: the CUDA libraries' own workspaces, the allocator's rounding and
#: fragmentation, other processes' growth.
DEVICE_MARGIN = 0.10

BUDGET_FORMS = ("a size such as 8G, 8GiB or 8 g (8·2^30 bytes), 8GB or 8gb (8·10^9 bytes), "
                "512M, 1.5G; a whole number of bytes; 'least' (the least feasible budget); "
                "'60%' (a share of what plain Chainer needs for the same input); or 'device' "
                f"(what the model's device can give, less {100 * DEVICE_MARGIN:.0f}%)")

_SHARE = re.compile(r"^\s*(?P<num>[0-9]*\.?[0-9]+)\s*%\s*$")


@dataclasses.dataclass(frozen=True)
class Budget:
    """A parsed budget (see the module's table).

    Args:
        kind: ``'bytes'``, ``'least'``, ``'share'`` or ``'device'``.
        bytes: the budget in bytes: given for ``'bytes'``; for ``'share'``
            and ``'device'`` once resolved (:meth:`of_plain`,
            :meth:`of_device`), else None.
        share: for ``'share'``: the fraction (``'60%'`` -> 0.6).
        text: the budget as the user wrote it.
        basis_bytes: what a resolved share or device budget was taken from
            (plain Chainer's need, the device's available memory).

    >>> b = parse_budget('60%'); b.kind, b.share, b.resolved
    ('share', 0.6, False)
    >>> b.of_plain(1000).bytes, b.of_plain(1000).describe()
    (600, "60% of plain Chainer's 1000 B = 600 B")
    >>> parse_budget('8 gb').bytes, parse_budget('least').kind
    (8000000000, 'least')
    """

    kind: str
    bytes: Optional[int] = None
    share: Optional[float] = None
    text: str = ""
    basis_bytes: Optional[int] = None

    @property
    def is_least(self) -> bool:
        return self.kind == "least"

    @property
    def resolved(self) -> bool:
        """Whether planning can use it as it is (bytes, or ``'least'``)."""
        return self.kind == "least" or self.bytes is not None

    def of_plain(self, plain_bytes: int) -> "Budget":
        """A ``'share'`` budget resolved against what plain Chainer needs
        (``plain_bytes``); any other budget unchanged."""
        if self.kind != "share" or self.share is None:
            return self
        return dataclasses.replace(self, bytes=max(1, int(self.share * int(plain_bytes))),
                                   basis_bytes=int(plain_bytes))

    def of_device(self, available_bytes: int) -> "Budget":
        """A ``'device'`` budget resolved from what the device can give
        (``available_bytes``), less :data:`DEVICE_MARGIN`; any other
        budget unchanged."""
        if self.kind != "device":
            return self
        if available_bytes is None or available_bytes < 1:
            raise BudgetError("budget 'device': the device's free memory could not be read; "
                              "give the budget as a size such as '8G'")
        return dataclasses.replace(
            self, bytes=max(1, int(available_bytes * (1 - DEVICE_MARGIN))),
            basis_bytes=int(available_bytes))

    def describe(self) -> str:
        """The budget in words, with what a share or ``'device'`` resolved to."""
        if self.kind == "least":
            return "least"
        if self.bytes is None:
            return self.text
        if self.kind == "share":
            return (f"{self.text.strip()} of plain Chainer's {format_bytes_up(self.basis_bytes)} "
                    f"= {format_bytes(self.bytes)}")
        if self.kind == "device":
            return (f"device: {format_bytes(self.basis_bytes)} available less "
                    f"{100 * DEVICE_MARGIN:.0f}% = {format_bytes(self.bytes)}")
        return format_bytes(self.bytes)

    def __str__(self) -> str:
        return self.describe()


def _refuse(value: Any, why: str) -> BudgetError:
    said = f"cannot read budget {value!r}" if why == "cannot be read" else f"budget {value!r} {why}"
    return BudgetError(f"{said}; accepted forms: {BUDGET_FORMS}")


def parse_budget(value: Any) -> Budget:
    """Read a budget in any form of the module's table.

    Args:
        value: a :class:`Budget` (returned as is), a string (``'8G'``,
            ``'8 GB'``, ``'least'``, ``'60%'``, ``'device'``) or a number of
            bytes.

    Returns:
        A :class:`Budget`.

    Raises:
        BudgetError: anything else; the message lists the forms, and a
            number between 0 and 1 suggests the share it may mean.

    >>> parse_budget('8G').bytes == parse_budget('8gib').bytes == 8 * 2**30
    True
    >>> parse_budget(0.5)
    Traceback (most recent call last):
    ...
    chainer_recompute.core.errors.BudgetError: budget 0.5 is less than one byte; for a share of plain Chainer's peak write '50%'; accepted forms: ...
    """
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool) or value is None:
        raise _refuse(value, "is not a budget")
    if isinstance(value, numbers.Real):
        x = float(value)
        _refuse_unitless(value, x)
        if not math.isfinite(x) or x < 1:
            raise _refuse(value, "is not a positive number of bytes")
        return Budget("bytes", bytes=int(round(x)), text=str(value))
    if not isinstance(value, str):
        raise _refuse(value, f"is a {type(value).__name__}")
    word = value.strip().lower()
    if word == "least":
        return Budget("least", text="least")
    if word == "device":
        return Budget("device", text="device")
    m = _SHARE.match(value)
    if m is not None:
        pct = float(m.group("num"))
        if pct <= 0:
            raise _refuse(value, "is not a positive share")
        return Budget("share", share=pct / 100, text=f"{pct:g}%")
    if value.strip().endswith("%"):
        raise _refuse(value, "is not a share such as '60%'")
    try:
        x = float(value)
    except ValueError:
        pass
    else:
        _refuse_unitless(value, x)
    try:
        nbytes = parse_bytes(value)
    except BudgetError:
        head = value.strip()
        why = ("is negative" if head.startswith("-") else
               "is zero" if re.match(r"^[0.]+(\s*[a-z]*)?$", head, re.IGNORECASE) else
               "cannot be read")
        raise _refuse(value, why) from None
    return Budget("bytes", bytes=nbytes, text=value.strip())


def _refuse_unitless(value: Any, x: float) -> None:
    """A budget of ``x`` bytes, given without a unit (``value``), that is
    a share written as a fraction (``0.6``) or a size whose unit was left
    out (``1.5``, :func:`~.units.unit_forgotten`): refused, saying which."""
    if 0 < x < 1:
        raise _refuse(value, f"is less than one byte; for a share of plain Chainer's peak "
                             f"write '{100 * x:g}%'")
    why = unit_forgotten(x)
    if why is not None:
        raise _refuse(value, why)


def host_available_bytes() -> Optional[int]:
    """The host memory available to a new allocation: ``MemAvailable`` of
    ``/proc/meminfo`` (Linux), else psutil's ``available`` if psutil is
    installed, bounded by the room left under the cgroup's memory limit
    where one is set (a container); None when nothing answers."""
    avail: Optional[int] = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            import psutil  # optional
            avail = int(psutil.virtual_memory().available)
        except ImportError:
            pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2 ** 60:
            room = max(0, int(limit) - usage)
            avail = room if avail is None else min(avail, room)
        break
    return avail
