"""This process's own host memory (I/O edge): read in each child after each task."""

from __future__ import annotations

import os
import resource
import sys

__all__ = ["read_rss_high_water"]

_STATUS = "/proc/self/status"


def read_rss_high_water(path: str | os.PathLike[str] = _STATUS) -> int | None:
    """This process's resident-set high-water (``VmHWM``) in bytes, or ``None`` if unknown.

    The high-water covers the worker's whole life, which is what a warm
    worker keeps on the host; the host-RAM ceiling prices exactly that. On
    Linux it comes from ``getrusage`` (``ru_maxrss``, KiB: the kernel's
    ``VmHWM``), one system call per task; ``path`` is read elsewhere.
    """
    if sys.platform == "linux" and (path is _STATUS or path == _STATUS):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with open(path, encoding="ascii", errors="replace") as file:
            text = file.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isascii() and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None
