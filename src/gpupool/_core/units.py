"""Byte sizes: parse what users write, format what the log prints (pure core)."""

from __future__ import annotations

import functools
import math
import re
from typing import TYPE_CHECKING

from gpupool._errors import InvalidSizeError

if TYPE_CHECKING:
    import numbers
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


@functools.cache
def _size_pattern() -> re.Pattern[str]:
    """A size as text: a number and its unit (compiled on first use: a worker parses none)."""
    return re.compile(
        r"^\s*(?P<number>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?P<unit>[a-zA-Z]*)\s*$"
    )


_HOW = "write a non-negative number of bytes, optionally with a unit: 6GiB, 6.5 GB, 512MiB, 7e9"


def parse_size(value: object, *, name: str = "size", allow_zero: bool = True) -> int:
    """Parse a byte size as users write it.

    Binary units (``KiB``, ``MiB``, ``GiB``, ``TiB``) are powers of 1024, decimal
    units (``KB``, ``MB``, ``GB``, ``TB``) powers of 1000, units are
    case-insensitive, and a bare number is bytes. A size in a unit larger than
    a byte rounds down to whole bytes (``"1.3GiB"``); a number of bytes must be
    whole: ``1.5`` (or ``"1.5"``, ``"1.5B"``) is refused, since a byte does not
    split and such a number is a unit left out far more often than a size.

    Args:
        value: a ``str`` such as ``"6GiB"``, ``"6.5 GB"``, ``"7e9"``, or a
            number of bytes (an ``int`` or ``float``, numpy's included).
        name: what the value is, for the error message (``"task_peak"``).
        allow_zero: whether ``0`` is acceptable.

    Returns:
        The size in bytes.

    Raises:
        InvalidSizeError: ``value`` is not a finite, non-negative size, or is a
            fraction of a byte (a ``ValueError``); the message quotes the input.
    """
    if isinstance(value, bool) or value is None:
        raise InvalidSizeError(f"{name}={value!r} is not a byte size; {_HOW}.", value=value)
    number, scale = _read_number(value, name)
    if number < 0:
        raise InvalidSizeError(f"{name}={value!r} is negative; {_HOW}.", value=value)
    nbytes = math.floor(number)
    if scale == 1 and nbytes != number:
        raise _fraction_error(value, name, number, nbytes)
    if nbytes == 0 and not allow_zero:
        raise InvalidSizeError(f"{name}={value!r} is zero; {name} must be positive.", value=value)
    return nbytes


def _read_number(value: object, name: str) -> tuple[Decimal | int, int]:
    """The size ``value`` says, exactly, and its unit's bytes (1 for a number of bytes)."""
    # Exact arithmetic: a float product can land one byte short ("8.54 GB"
    # was 8539999999), and float() overflows on a large int. The float is
    # only the finiteness check, so "1e400GiB" is refused before any exact
    # arithmetic is asked to build a 400-digit number. (numbers loads here: a worker
    # imports this module but parses a size only when a task ran out of memory.)
    import numbers

    if isinstance(value, numbers.Integral):  # numpy's integers too
        return int(value), 1
    if isinstance(value, numbers.Real):  # a float, numpy's, a Fraction
        return _read_real(value, name), 1
    if isinstance(value, str):
        return _read_text(value, name)
    raise InvalidSizeError(
        f"{name}={value!r} ({type(value).__name__}) is not a byte size; {_HOW}.",
        value=value,
    )


def _read_real(value: numbers.Real, name: str) -> Decimal:
    """A real number of bytes as the exact value of its float, refused where it is not finite."""
    from decimal import Decimal

    try:
        real = float(value)
    except (OverflowError, ValueError):
        real = math.inf
    if not math.isfinite(real):
        raise InvalidSizeError(f"{name}={value!r} is not finite; {_HOW}.", value=value)
    return Decimal(real)


def _read_text(value: str, name: str) -> tuple[Decimal, int]:
    """A size written as text: its number times its unit, exactly, and the unit's bytes."""
    from decimal import Decimal, localcontext

    match = _size_pattern().match(value)
    unit = match.group("unit").lower() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidSizeError(f"{name}={value!r} is not a byte size; {_HOW}.", value=value)
    text, scale = match.group("number"), _UNITS[unit]
    if not math.isfinite(float(text) * scale):
        raise InvalidSizeError(f"{name}={value!r} is not finite; {_HOW}.", value=value)
    with localcontext() as context:
        context.prec = len(text) + 20  # enough digits for an exact product
        return Decimal(text) * scale, scale


def _fraction_error(
    value: object, name: str, number: Decimal | int, nbytes: int
) -> InvalidSizeError:
    """The refusal of a number of bytes that is not whole, with the likelier fix."""
    # A small one is a unit left out (task_peak=1.5 for 1.5 GiB); a large one, a
    # computed size whose fraction is float noise.
    fix = (
        f"write its unit, such as {name}='{_shown(value)}GiB'"
        if number < KiB
        else f"pass a whole number of bytes, such as {nbytes} (int() of a computed size)"
    )
    return InvalidSizeError(
        f"{name}={value!r} is a fraction of a byte: a number of bytes (what a number "
        f"without a unit is) must be whole; {fix}.",
        value=value,
    )


def _shown(value: object) -> str:
    """The number of a bare size as the user wrote it (``"1.5"`` of ``1.5`` or ``"1.5 B"``)."""
    import numbers

    if isinstance(value, str):
        return value.strip().rstrip("bB").strip()
    return f"{float(value):g}" if isinstance(value, numbers.Real) else str(value)


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
