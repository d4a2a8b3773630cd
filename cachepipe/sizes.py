"""Sizes and shares of free space: parse them as people write them, format them for people.

Sizes accept an int of bytes or a string: ``"50GiB"``, ``"1.5GB"``, ``"512M"``, ``"1g"``.
Units: ``KiB/MiB/GiB/TiB`` are powers of 1024, ``KB/MB/GB/TB`` powers of 1000, and the
single letters ``k/m/g/t`` (any case, as the original tool accepted) powers of 1024.
A capacity may also be a share of the cache filesystem's free space (and of what the cache
folder holds already), ``"80%"``, resolved once when the cache opens.

Pure and light (no pydantic): the ``cachepipe status`` command formats sizes with it without
importing the configuration model. :mod:`cachepipe.config` re-exports every name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SIZE_FORMS",
    "SMALL_CAPACITY",
    "Share",
    "format_size",
    "parse_capacity",
    "parse_size",
    "small_capacity",
    "with_unit",
]

SIZE_FORMS = "a positive number of bytes or a size like '50GiB', '1.5GB', '512M', '1g'"
_CAPACITY_FORMS = SIZE_FORMS + ", or a share of free disk space like '80%'"

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True, slots=True)
class Share:
    """A fraction of the cache filesystem's free space, ``0 < fraction <= 1``."""

    fraction: float

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%"


def parse_size(value: Any, what: str = "size") -> int:
    """Parse a size into a positive int of bytes.

    Raises:
        ValueError: naming ``what``, the value and the accepted forms, for anything that is not
            a positive size (``"10X"``, ``-1``, ``0``, ``"abc"``, ``True``, NaN).
    """
    bad = ValueError(f"{what} {value!r}: expected {SIZE_FORMS}")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, (int, float)):
        number, unit = float(value), 1
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise bad
        number, unit = float(match.group(1)), _UNITS[match.group(2).lower()]
    else:
        raise bad
    if not math.isfinite(number) or number <= 0:
        raise bad
    size = int(number * unit)
    if size <= 0:
        raise bad
    return size


def format_size(n: float) -> str:
    """A byte count for people: ``512 B``, ``1.5 KiB``, ``20.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_capacity(value: Any, name: str = "capacity") -> int | Share:
    """Parse a capacity: a size (see :func:`parse_size`) or a share of free space (``"80%"``);
    errors name the option ``name``."""
    if isinstance(value, Share):
        return value
    if isinstance(value, str) and value.strip().endswith("%"):
        text = value.strip()[:-1].strip()
        try:
            percent = float(text)
        except ValueError:
            percent = math.nan
        if not (0 < percent <= 100):
            raise ValueError(f"{name} {value!r}: expected {_CAPACITY_FORMS} (a share between 0% and 100%)")
        return Share(percent / 100)
    try:
        return parse_size(value, name)
    except ValueError:
        raise ValueError(f"{name} {value!r}: expected {_CAPACITY_FORMS}") from None


SMALL_CAPACITY = 1024**2
"""A capacity under this (1 MiB) is legal but most likely a size without its unit (``"100"``)."""


def with_unit(capacity: int | Share) -> str | Share:
    """A capacity worked out in bytes (a share of another, a reloaded one), written with its
    unit (``"524288B"``) for the :class:`~cachepipe.Pipeline` it is given to: a size with a unit
    is meant, so :func:`small_capacity` does not take it for one whose unit was left out."""
    return capacity if isinstance(capacity, Share) else f"{capacity}B"


def small_capacity(given: Any, capacity: int | Share) -> str | None:
    """A warning for a capacity under :data:`SMALL_CAPACITY` given without a unit (``given`` as
    the caller wrote it: a number, or a string of digits), else None: ``"512KiB"`` is meant."""
    if isinstance(capacity, Share) or capacity >= SMALL_CAPACITY:
        return None
    if isinstance(given, str) and ((match := _SIZE_RE.match(given)) is None or match.group(2)):
        return None  # a unit: meant
    return (
        f"capacity {given!r} is {capacity} bytes, less than 1 MiB: a size without a unit is in bytes; "
        "if you meant more, give a unit like '100MiB' or '100GiB', or a share like '80%'"
    )
