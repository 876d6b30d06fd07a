"""What a call's arguments say about its peak, read in the parent at submit time.

:func:`call_features` names a few cheap figures of a call's arguments, from which the planner may
learn to predict a task's peak (:mod:`gpupool._core.predict`):

* a sequence, mapping or set of a built-in type: its length (``arg0.len``);
* an array or a tensor (any object whose type has ``nbytes`` and ``shape``, as NumPy's arrays,
  PyTorch's, CuPy's and JAX's do): its ``nbytes`` and its first dimension (``arg1.nbytes``,
  ``arg1.shape0``);
* a real number (``bool`` aside): its value (``arg2``);

each for the first :data:`ARGS_READ` positional arguments and keyword arguments, named by
position (``arg0``) or by keyword (``items.len``). Nothing else is read: no argument is pickled,
walked or iterated, so a call costs a few type checks whatever its payload. A figure that is not
positive and finite is left out, as is an attribute read that raises.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from gpupool._core.predict import Features

__all__ = ["ARGS_READ", "call_features"]

#: The most positional and keyword arguments read per call.
ARGS_READ = 8

_SIZED_TYPES = (list, tuple, str, bytes, bytearray, dict, set, frozenset, range)
_NO_FEATURES: Features = ()


#: Each position's names, worked out once: (value, length, nbytes, first dimension).
_POSITIONS = tuple(
    (f"arg{i}", f"arg{i}.len", f"arg{i}.nbytes", f"arg{i}.shape0") for i in range(ARGS_READ)
)


def call_features(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Features:
    """The figures of a call's arguments that may predict its peak (module docstring)."""
    if not args and not kwargs:
        return _NO_FEATURES
    found: list[tuple[str, float]] = []
    for names, value in zip(_POSITIONS, args, strict=False):
        _read(names, value, found)
    for count, (name, value) in enumerate(kwargs.items()):
        if count >= ARGS_READ:
            break
        _read((name, f"{name}.len", f"{name}.nbytes", f"{name}.shape0"), value, found)
    return tuple(found)


def _read(names: tuple[str, str, str, str], value: object, found: list[tuple[str, float]]) -> None:
    kind = type(value)
    if kind in _SIZED_TYPES:
        _add(names[1], len(value), found)  # type: ignore[arg-type]
    elif kind is int or kind is float:
        _add(names[0], value, found)
    elif kind is bool:
        return
    elif isinstance(value, numbers.Real):  # NumPy's scalars among them
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            return
        _add(names[0], number, found)
    elif hasattr(kind, "nbytes") and hasattr(kind, "shape"):
        try:
            nbytes, shape = value.nbytes, value.shape  # type: ignore[attr-defined]
            first = shape[0] if len(shape) else None
        except Exception:  # a stranger's attribute: no figure
            return
        _add(names[2], nbytes, found)
        if first is not None:
            _add(names[3], first, found)


def _add(name: str, value: object, found: list[tuple[str, float]]) -> None:
    if type(value) is not float:
        try:
            value = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            return
    assert isinstance(value, float)
    if value > 0 and math.isfinite(value):
        found.append((name, value))
