"""cloudpickle that keeps each code object's file name, so tracebacks show the source line.

A function defined in ``__main__`` (or a lambda, a closure) travels by value:
cloudpickle rebuilds its code object in the worker, and since cloudpickle 3.0
names its file ``<dynamic-code>``, so a failing task's traceback reads
``File "<dynamic-code>", line 6, in bad`` with no source. The standard pool
imports ``__main__`` in its workers and shows the script's file and line.
This pickler sends the file name with the code object; the worker's
traceback then names the script, and :mod:`linecache` reads the line from it.
"""

from __future__ import annotations

import io
import pickle
import types
from collections import ChainMap
from typing import Any, ClassVar

import cloudpickle

__all__ = ["dumps_by_value", "named_code"]

#: cloudpickle's own reducer for code objects (the name it gives the file aside).
_CLOUDPICKLE_CODE_REDUCE = cloudpickle.Pickler.dispatch_table[types.CodeType]


def named_code(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` with its file name back (run in the process that unpickles it)."""
    return code.replace(co_filename=filename)


class _Unnamed:
    """A code object that pickles as cloudpickle pickles it, file name dropped."""

    __slots__ = ("code",)

    def __init__(self, code: types.CodeType) -> None:
        self.code = code

    def __reduce__(self) -> Any:
        return _CLOUDPICKLE_CODE_REDUCE(self.code)


def _reduce_code(code: types.CodeType) -> tuple[Any, tuple[Any, ...]]:
    return named_code, (_Unnamed(code), code.co_filename)


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    dispatch_table: ClassVar[ChainMap[Any, Any]] = ChainMap(
        {types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table
    )


def dumps_by_value(obj: object) -> bytes:
    """``cloudpickle.dumps(obj)`` at the highest protocol, every code object keeping its file."""
    with io.BytesIO() as file:
        _Pickler(file, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return file.getvalue()
