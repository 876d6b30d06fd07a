"""A process's descendants and their host memory, from ``/proc`` (I/O edge).

The child's probe measures a task's whole process tree: the worker and what
the task starts (compilers, ``torchrun``, ``multiprocessing`` inside a task).
Descendants are found through each thread's ``/proc/<pid>/task/<tid>/children``
(only the tree is read, a few small files per sample); on a kernel without
those files, by one scan of every ``/proc/<pid>/stat``.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

from gpupool._sensors.ancestry import read_parent_pid

__all__ = [
    "MAX_DESCENDANTS",
    "read_children_rss_high_water",
    "read_descendants",
    "read_rss_high_water_of",
]

#: The most descendants one walk lists: a fork bomb must not stall the probe.
MAX_DESCENDANTS = 4096


def _children_of(pid: int, proc: Path) -> list[int] | None:
    """``pid``'s children, from its threads' ``children`` files; ``None``: the kernel has none."""
    try:
        tids = os.listdir(proc / str(pid) / "task")
    except OSError:
        return []  # it has exited
    found: list[int] = []
    for tid in tids:
        try:
            text = (proc / str(pid) / "task" / tid / "children").read_bytes()
        except FileNotFoundError:
            if tid == str(pid) and (proc / str(pid) / "task" / tid).is_dir():
                return None  # a kernel without CONFIG_PROC_CHILDREN
            continue  # the thread ended while we read
        except OSError:
            continue
        found.extend(int(part) for part in text.split() if part.isdigit())
    return found


def _scan_parents(proc: Path) -> dict[int, list[int]]:
    """Every process's children, from one pass over ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return children
    for name in names:
        if name.isdigit():
            parent = read_parent_pid(int(name), proc)
            if parent is not None:
                children.setdefault(parent, []).append(int(name))
    return children


def read_descendants(pid: int, proc: Path = Path("/proc")) -> tuple[int, ...]:
    """Every live process started under ``pid`` (children, grandchildren...), ``pid`` excluded.

    A descendant whose parent exited before it was seen is re-parented (to
    init or a subreaper) and is no longer under ``pid``. At most
    :data:`MAX_DESCENDANTS` are listed.
    """
    scanned: dict[int, list[int]] | None = None
    found: list[int] = []
    seen = {pid}
    stack = [pid]
    while stack and len(found) < MAX_DESCENDANTS:
        current = stack.pop()
        children = None if scanned is not None else _children_of(current, proc)
        if children is None:
            if scanned is None:
                scanned = _scan_parents(proc)
            children = scanned.get(current, [])
        for child in children:
            if child not in seen:
                seen.add(child)
                found.append(child)
                stack.append(child)
    return tuple(found[:MAX_DESCENDANTS])


def read_rss_high_water_of(pid: int, proc: Path = Path("/proc")) -> int | None:
    """Process ``pid``'s resident-set high-water (``VmHWM``) in bytes; ``None`` if unknown."""
    try:
        text = (proc / str(pid) / "status").read_bytes()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(b"VmHWM:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None  # a kernel thread, or a zombie: no memory of its own


def read_children_rss_high_water() -> int | None:
    """The largest RSS high-water of this process's reaped descendants (``RUSAGE_CHILDREN``).

    It covers only children that have been waited for (and what they waited
    for), over this process's life; ``None`` off Linux, where the unit differs.
    """
    if sys.platform != "linux":
        return None
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
