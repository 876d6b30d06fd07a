"""Byte sizes: parse what users write, format what the log prints (pure core)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from gpupool._errors import InvalidSizeError

if TYPE_CHECKING:
    from decimal import Decimal

__all__ = ["MAX_SIZE_BYTES", "GiB", "KiB", "MiB", "format_size", "parse_pool_size", "parse_size"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(
    r"^\s*(?P<number>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?P<unit>[a-zA-Z]*)\s*$"
)

_HOW = "write a non-negative number of bytes, optionally with a unit: 6GiB, 6.5 GB, 512MiB, 7e9"


def parse_size(value: object, *, name: str = "size", allow_zero: bool = True) -> int:
    """Parse a byte size as users write it.

    Binary units (``KiB``, ``MiB``, ``GiB``, ``TiB``) are powers of 1024, decimal
    units (``KB``, ``MB``, ``GB``, ``TB``) powers of 1000, units are
    case-insensitive, and a bare number is bytes. Fractions round down to
    whole bytes.

    Args:
        value: a ``str`` such as ``"6GiB"``, ``"6.5 GB"``, ``"7e9"``, or an
            ``int``/``float`` number of bytes.
        name: what the value is, for the error message (``"task_peak"``).
        allow_zero: whether ``0`` is acceptable.

    Returns:
        The size in bytes.

    Raises:
        InvalidSizeError: ``value`` is not a finite, non-negative size (a
            ``ValueError``); the message quotes the input.
    """
    if isinstance(value, bool) or value is None:
        raise InvalidSizeError(f"{name}={value!r} is not a byte size; {_HOW}.", value=value)
    # Exact arithmetic: a float product can land one byte short ("8.54 GB"
    # was 8539999999), and float() overflows on a large int. The float is
    # only the finiteness check, so "1e400GiB" is refused before any exact
    # arithmetic is asked to build a 400-digit number. (decimal loads here: a worker
    # imports this module but parses a size only when a task ran out of memory.)
    from decimal import Decimal, localcontext

    number: Decimal | int
    if isinstance(value, int):
        number = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidSizeError(f"{name}={value!r} is not finite; {_HOW}.", value=value)
        number = Decimal(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group("unit").lower() if match else ""
        if match is None or unit not in _UNITS:
            raise InvalidSizeError(f"{name}={value!r} is not a byte size; {_HOW}.", value=value)
        text = match.group("number")
        if not math.isfinite(float(text) * _UNITS[unit]):
            raise InvalidSizeError(f"{name}={value!r} is not finite; {_HOW}.", value=value)
        with localcontext() as context:
            context.prec = len(text) + 20  # enough digits for an exact product
            number = Decimal(text) * _UNITS[unit]
    else:
        raise InvalidSizeError(
            f"{name}={value!r} ({type(value).__name__}) is not a byte size; {_HOW}.",
            value=value,
        )
    if number < 0:
        raise InvalidSizeError(f"{name}={value!r} is negative; {_HOW}.", value=value)
    nbytes = math.floor(number)
    if nbytes == 0 and not allow_zero:
        raise InvalidSizeError(f"{name}={value!r} is zero; {name} must be positive.", value=value)
    return nbytes


#: The largest size a pool (and ``gpupool plan``) accepts for a task's peak, a
#: reserve or a margin: 1 PiB, some thousands of times any card's memory. A
#: larger value is a typo (or a unit given twice), and its decision log would
#: not be readable by ``postmortem``.
MAX_SIZE_BYTES = 2**50


def parse_pool_size(value: object, *, name: str, allow_zero: bool = True) -> int:
    """:func:`parse_size` with gpupool's upper bound (:data:`MAX_SIZE_BYTES`).

    Raises:
        InvalidSizeError: as :func:`parse_size`, or the size is over 1 PiB.
    """
    size = parse_size(value, name=name, allow_zero=allow_zero)
    if size > MAX_SIZE_BYTES:
        raise InvalidSizeError(
            f"{name}={value!r} is {size} bytes, more than the 2**50 bytes (1 PiB) gpupool "
            "accepts; give the size of one task on one card, such as '6GiB'.",
            value=value,
        )
    return size


def format_size(nbytes: int | None) -> str:
    """Format bytes for people: ``"9.90 GiB"``, ``"512.00 MiB"``, ``"unknown"`` for ``None``.

    Negative values keep their sign (a negative room is a real, oversubscribed card).
    """
    if nbytes is None:
        return "unknown"
    sign = "-" if nbytes < 0 else ""
    magnitude = abs(nbytes)
    for unit, scale in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if magnitude >= scale:
            return f"{sign}{magnitude / scale:.2f} {unit}"
    return f"{sign}{magnitude} B"
