"""A stand-in ``cupy`` for the probe's tests: a default memory pool that keeps freed blocks.

It models what the probe reads of CuPy's ``MemoryPool``: ``used_bytes()``
(bytes in live arrays), ``total_bytes()`` (what the pool holds from the
driver: live arrays plus cached free blocks) and ``free_all_blocks()`` (the
cached blocks go back). CuPy keeps no peak: the probe samples. Every call is
recorded, so a test can check that the probe only reads.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable


class StandinMemoryPool:
    """``cupy.get_default_memory_pool()`` (or the pinned pool), as far as the probe uses it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.used = 0
        self.total = 0
        self.freed = 0
        self.on_change: Callable[[StandinMemoryPool], None] | None = None

    def malloc(self, nbytes: int) -> None:
        """An array of ``nbytes``: served from cached blocks first, then from the driver."""
        self.used += nbytes
        self.total = max(self.total, self.used)
        self._changed()

    def free(self, nbytes: int) -> None:
        """An array dropped: its block stays cached in the pool."""
        self.used -= nbytes

    def used_bytes(self) -> int:
        self.calls.append("used_bytes")
        return self.used

    def total_bytes(self) -> int:
        self.calls.append("total_bytes")
        return self.total

    def free_all_blocks(self) -> None:
        self.calls.append("free_all_blocks")
        self.freed += 1
        self.total = self.used
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)


class StandinOutOfMemoryError(MemoryError):
    """CuPy's ``cupy.cuda.memory.OutOfMemoryError``."""


StandinOutOfMemoryError.__module__ = "cupy.cuda.memory"
StandinOutOfMemoryError.__name__ = StandinOutOfMemoryError.__qualname__ = "OutOfMemoryError"


def make_cupy() -> types.ModuleType:
    """A stand-in ``cupy`` module with a device pool and a pinned pool."""
    cupy = types.ModuleType("cupy")
    device_pool, pinned_pool = StandinMemoryPool(), StandinMemoryPool()
    cupy.get_default_memory_pool = lambda: device_pool  # type: ignore[attr-defined]
    cupy.get_default_pinned_memory_pool = lambda: pinned_pool  # type: ignore[attr-defined]
    cupy.OutOfMemoryError = StandinOutOfMemoryError  # type: ignore[attr-defined]
    return cupy


def install_in_worker() -> None:
    """Initializer: this worker's ``import cupy`` finds the stand-in."""
    sys.modules["cupy"] = make_cupy()
