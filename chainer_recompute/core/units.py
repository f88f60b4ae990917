"""Byte quantities: parsing budgets and printing sizes.

Binary units are the default, because that is what GPU memory is sold and
reported in: ``8G`` = ``8Gi`` = ``8GiB`` = 8·2^30 bytes, the capacity of an
"8 GB" card. The SI forms with a ``B`` (``8GB``, ``512MB``, ``1.5kB``)
are decimal: ``8GB`` = 8·10^9 bytes, as in the paper's tables. Units are
read in any case (``8g``, ``8gib``; ``8gb`` and ``8Gb`` = ``8GB``), with
optional spaces (``8 GB``). A bare number (``1e9``, ``123456``) is bytes.
"""
from __future__ import annotations

import math
import re
from typing import Optional, Union

from .errors import BudgetError

_BINARY = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
_DECIMAL = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12}
_PATTERN = re.compile(
    r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"
    r"(?P<unit>(?:[kmgt](?:i?b|i)?)|b)?\s*$", re.IGNORECASE)

ACCEPTED_FORMS = ("8G (= 8GiB = 8·2^30 bytes), 8GiB, 8Gi, 8GB (= 8·10^9 bytes), "
                  "any case (8g, 8gb), spaces allowed (8 GB), 512M, 1.5G, 1e9 (bytes), "
                  "123456 (bytes)")


def parse_bytes(value: Union[str, int, float]) -> int:
    """Parse a memory size such as a budget.

    Args:
        value: ``'8G'``, ``'8GiB'``, ``'8GB'``, ``'512M'``, ``'1.5G'``,
            ``'1e9'``, an int or a float (bytes).

    Returns:
        The number of bytes, a positive int.

    Raises:
        BudgetError: for garbage, zero, negative, infinite or NaN values,
            and a size without its unit (:func:`unit_forgotten`); the
            message lists the accepted forms.

    >>> parse_bytes('8G'), parse_bytes('8GB'), parse_bytes('1.5K'), parse_bytes(1e3)
    (8589934592, 8000000000, 1536, 1000)
    """
    if isinstance(value, bool):
        raise BudgetError(f"memory size {value!r} is a bool; accepted forms: {ACCEPTED_FORMS}")
    if isinstance(value, (int, float)):
        number = float(value)
        multiplier = 1
    elif isinstance(value, str):
        m = _PATTERN.match(value)
        if m is None:
            raise BudgetError(f"cannot read memory size {value!r}; accepted forms: "
                              f"{ACCEPTED_FORMS}")
        number = float(m.group("num"))
        unit = m.group("unit") or ""
        prefix = unit[:1].upper() if unit[:1].upper() in "KMGT" and unit else ""
        rest = (unit[1:] if prefix else unit).lower()
        if prefix and rest == "b":
            multiplier = _DECIMAL[prefix]
        else:
            multiplier = _BINARY[prefix]
    else:
        raise BudgetError(f"memory size must be a string or a number, got "
                          f"{type(value).__name__}; accepted forms: {ACCEPTED_FORMS}")
    if math.isnan(number) or math.isinf(number):
        raise BudgetError(f"memory size {value!r} is not finite; accepted forms: {ACCEPTED_FORMS}")
    why = unit_forgotten(number) if multiplier == 1 else None
    if why is not None:
        raise BudgetError(f"memory size {value!r} {why}; accepted forms: {ACCEPTED_FORMS}")
    nbytes = number * multiplier
    if nbytes < 1:
        raise BudgetError(f"memory size {value!r} must be positive (at least one byte); "
                          f"accepted forms: {ACCEPTED_FORMS}")
    return int(round(nbytes))


def unit_forgotten(number: float) -> Optional[str]:
    """Why ``number`` bytes, given without a unit, is refused, or None: a
    number of bytes with a fraction below a KiB (``1.5``) is a size whose
    unit was left out. (A larger one, a computed ``0.9 * peak``, is
    rounded.)

    >>> unit_forgotten(1.5)
    "is not a whole number of bytes; a size needs its unit: '1.5G' for 1.5 GiB, '1.5M' for 1.5 MiB"
    >>> unit_forgotten(2.0), unit_forgotten(123456.8)
    (None, None)
    """
    if number.is_integer() or not 1 < number < 1024:
        return None
    return (f"is not a whole number of bytes; a size needs its unit: '{number:g}G' for "
            f"{number:g} GiB, '{number:g}M' for {number:g} MiB")


def format_bytes(nbytes: float, binary: bool = True) -> str:
    """``format_bytes(3 * 2**30) == '3.00 GiB'``; ``binary=False`` gives SI
    units (``'3.22 GB'``), as the paper's tables use."""
    if nbytes is None or (isinstance(nbytes, float) and math.isnan(nbytes)):
        return "n/a"
    base = 1024.0 if binary else 1000.0
    units = ["B", "KiB", "MiB", "GiB", "TiB"] if binary else ["B", "kB", "MB", "GB", "TB"]
    x = float(nbytes)
    for unit in units:
        if abs(x) < base or unit == units[-1]:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= base
    raise AssertionError("unreachable")


def format_bytes_up(nbytes: float, binary: bool = True) -> str:
    """Like :func:`format_bytes`, rounded *up* at the last digit shown, so
    that the figure pasted back as a budget is never below ``nbytes``.

    >>> format_bytes_up(29_364_001, binary=False), parse_bytes('29.37 MB') >= 29_364_001
    ('29.37 MB', True)
    >>> format_bytes_up(3 * 2**30)
    '3.00 GiB'
    """
    if nbytes is None or (isinstance(nbytes, float) and math.isnan(nbytes)):
        return "n/a"
    base = 1024.0 if binary else 1000.0
    units = ["B", "KiB", "MiB", "GiB", "TiB"] if binary else ["B", "kB", "MB", "GB", "TB"]
    x = float(nbytes)
    for k, unit in enumerate(units):
        if abs(x) < base or unit == units[-1]:
            if unit == "B":
                return f"{math.ceil(x):.0f} B"
            up = math.ceil(round(x * 100, 6)) / 100
            if up >= base and k + 1 < len(units):
                return f"{math.ceil(up / base * 100) / 100:.2f} {units[k + 1]}"
            return f"{up:.2f} {unit}"
        x /= base
    raise AssertionError("unreachable")
