"""Task functions for the worker start-up tests: this module imports nothing of gpupool, so
what a worker has loaded is what its own start loaded."""

from __future__ import annotations

import importlib
import os
import sys


def loaded(names: tuple[str, ...], first: str | None = None) -> list[str]:
    """Which of ``names`` this process has imported (after importing ``first``, if given)."""
    if first is not None:
        importlib.import_module(first)
    return [name for name in names if name in sys.modules]


def open_paths(_: object = None) -> list[str]:
    """What each descriptor of this process refers to (``/proc/self/fd``)."""
    paths = []
    for name in os.listdir("/proc/self/fd"):
        try:
            paths.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return paths
