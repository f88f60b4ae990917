"""parse_bytes and format_bytes."""
from __future__ import annotations

import math

import pytest

from chainer_recompute.core.errors import BudgetError
from chainer_recompute.core.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("8G", 8 * 2 ** 30), ("8GiB", 8 * 2 ** 30), ("8Gi", 8 * 2 ** 30), ("8GB", 8 * 10 ** 9),
    ("512M", 512 * 2 ** 20), ("512MB", 512 * 10 ** 6), ("1.5G", 3 * 2 ** 29),
    ("1.5K", 1536), ("1e9", 10 ** 9), ("123456", 123456), (" 2 G ", 2 * 2 ** 30),
    (1000, 1000), (1e3, 1000), ("1T", 2 ** 40), ("1TB", 10 ** 12),
])
def test_parse_accepted(text, expected) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "8 XB", "G", "--1G", "-1G", "0", "0G", -5, 0,
                                 float("nan"), "nan", math.inf, "inf", None, True, [1]])
def test_parse_rejects(bad) -> None:
    with pytest.raises(BudgetError):
        parse_bytes(bad)


def test_parse_error_lists_forms() -> None:
    with pytest.raises(BudgetError, match="accepted forms"):
        parse_bytes("lots")


def test_format_bytes() -> None:
    assert format_bytes(3 * 2 ** 30) == "3.00 GiB"
    assert format_bytes(3 * 2 ** 30, binary=False) == "3.22 GB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1.311e9, binary=False) == "1.31 GB"
    assert format_bytes(float("nan")) == "n/a"
