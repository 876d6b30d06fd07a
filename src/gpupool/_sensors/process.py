"""This process's own host memory (I/O edge): read in each child after each task."""

from __future__ import annotations

from pathlib import Path

__all__ = ["read_rss_high_water"]

_STATUS = Path("/proc/self/status")


def read_rss_high_water(path: Path = _STATUS) -> int | None:
    """This process's resident-set high-water (``VmHWM``) in bytes, or ``None`` off Linux.

    The high-water covers the worker's whole life, which is what a warm
    worker keeps on the host; the host-RAM ceiling prices exactly that.
    """
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None
