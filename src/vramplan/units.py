"""Byte and count formatting and parsing. Bytes are exact integers everywhere else.

>>> format_bytes(288_000_000)
'274.7 MiB'
>>> format_bytes(288_000_000, units="decimal")
'288.0 MB'
>>> parse_count("1.3B")
1300000000
>>> parse_bytes("24GiB")
25769803776
"""

from __future__ import annotations

import re
from typing import Literal

from vramplan.errors import UserError

Units = Literal["binary", "decimal"]

_BINARY = [("PiB", 1024**5), ("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)]
_DECIMAL = [("PB", 1000**5), ("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("kB", 1000)]

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_SUFFIX = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KB": 1000,
    "KIB": 1024,
    "M": 1024**2,
    "MB": 1000**2,
    "MIB": 1024**2,
    "G": 1024**3,
    "GB": 1000**3,
    "GIB": 1024**3,
    "T": 1024**4,
    "TB": 1000**4,
    "TIB": 1024**4,
}
_NUMBER = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def format_bytes(n: int, units: Units = "binary", digits: int = 1) -> str:
    """Render a byte count with the largest unit that keeps it >= 1."""
    table = _BINARY if units == "binary" else _DECIMAL
    sign = "-" if n < 0 else ""
    size = abs(n)
    for name, factor in table:
        if size >= factor:
            return f"{sign}{size / factor:.{digits}f} {name}"
    return f"{sign}{size} B"


def unit_name(units: Units) -> str:
    """Say which units the output uses, for a footer line."""
    return (
        "binary units (1 MiB = 2^20 bytes)"
        if units == "binary"
        else "decimal units (1 MB = 10^6 bytes)"
    )


def parse_count(text: str | int | float, what: str = "count", minimum: int = 0) -> int:
    """Parse '20M', '1.3B', '2e7' or 7000 into an integer count; a fraction of one
    (``0.5``) is no count, and a count under ``minimum`` is refused.

    >>> parse_count("0.5", "parameter count")
    Traceback (most recent call last):
    vramplan.errors.UserError: parameter count must be a whole number, got '0.5'
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _NUMBER.match(str(text))
        suffix = match.group(2).upper() if match else None
        if not match or suffix not in _COUNT_SUFFIX:
            raise UserError(f"cannot read {what} {text!r}: use a number such as 20M, 1.3B or 2e7")
        value = float(match.group(1)) * _COUNT_SUFFIX[suffix]
    if value < 0:
        raise UserError(f"{what} must not be negative, got {text!r}")
    if value != value or value == float("inf"):
        raise UserError(f"cannot read {what} {text!r}: use a number such as 20M, 1.3B or 2e7")
    if abs(value - round(value)) > 1e-6 * max(1.0, value):
        raise UserError(f"{what} must be a whole number, got {text!r}")
    if round(value) < minimum:
        raise UserError(f"{what} must be at least {minimum:,}, got {text!r}")
    return int(round(value))


def parse_bytes(text: str, what: str = "size", require_unit: bool = False) -> int:
    """Parse '24GiB', '80GB', '512MiB' or a plain byte count; bare K/M/G are binary.
    With ``require_unit`` a bare number is refused (``24`` is more likely 24 GiB than
    24 bytes)::

        >>> parse_bytes("24", "GPU memory", require_unit=True)
        Traceback (most recent call last):
        vramplan.errors.UserError: GPU memory '24' has no unit: did you mean 24GiB?
    """
    match = _NUMBER.match(str(text))
    suffix = match.group(2).upper() if match else None
    if not match or suffix not in _BYTE_SUFFIX:
        raise UserError(f"cannot read {what} {text!r}: use a size such as 24GiB, 80GB or 512MiB")
    if require_unit and not suffix:
        raise UserError(f"{what} {text!r} has no unit: did you mean {match.group(1)}GiB?")
    value = float(match.group(1)) * _BYTE_SUFFIX[suffix]
    if value <= 0:
        raise UserError(f"{what} must be positive, got {text!r}")
    if value == float("inf"):
        raise UserError(f"{what} {text!r} is not a size")
    return int(round(value))
