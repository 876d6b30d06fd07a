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
from typing import TYPE_CHECKING

from gpupool._sensors.ancestry import read_parent_pid

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from pathlib import Path

__all__ = [
    "MAX_DESCENDANTS",
    "read_children_of",
    "reap_adopted",
    "reap_unclaimed_zombies",
    "read_children_rss_high_water",
    "read_descendants",
    "read_rss_high_water_of",
]

#: The most descendants one walk lists: a fork bomb must not stall the probe.
MAX_DESCENDANTS = 4096
#: Whether ``waitid`` can tell that this process has no child (not on macOS).
_CAN_ASK_CHILDREN = hasattr(os, "waitid") and hasattr(os, "WNOWAIT")
#: One ``read`` of a ``/proc`` file: more than a ``status`` or a short ``children`` file.
_READ_BYTES = 8192


def _read_small(path: str) -> bytes:
    """The whole of a small ``/proc`` file (``os.open``/``os.read``: no file object).

    A read shorter than asked is not the end of the file: the kernel hands a
    ``/proc`` file out at most a page per read (a ``children`` file of some
    700 children is longer). Only an empty read is.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, _READ_BYTES)
        if not data:
            return data
        parts = [data]
        while data:
            data = os.read(fd, _READ_BYTES)
            parts.append(data)
        return b"".join(parts)
    finally:
        os.close(fd)


def _children_of(pid: int, proc: str) -> list[int] | None:
    """``pid``'s children, from its threads' ``children`` files; ``None``: the kernel has none."""
    task = f"{proc}/{pid}/task"
    try:
        tids = os.listdir(task)
    except OSError:
        return []  # it has exited
    found: list[int] = []
    for tid in tids:
        try:
            text = _read_small(f"{task}/{tid}/children")
        except FileNotFoundError:
            if tid == str(pid) and os.path.isdir(f"{task}/{tid}"):
                return None  # a kernel without CONFIG_PROC_CHILDREN
            continue  # the thread ended while we read
        except OSError:
            continue
        if text:
            found.extend(int(part) for part in text.split() if part.isdigit())
    return found


def _scan_parents(proc: str) -> dict[int, list[int]]:
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


def read_children_of(pid: int, proc: Path | str = "/proc") -> frozenset[int] | None:
    """``pid``'s direct children now; ``None`` where the kernel cannot list them."""
    children = _children_of(pid, str(proc))
    return None if children is None else frozenset(children)


def reap_adopted(pids: Iterable[int]) -> int:
    """Reap those of ``pids`` that are exited children of this process; how many were.

    For a child subreaper (a pool's worker): an orphan re-parented to it that
    exits stays a zombie until it is reaped, and no one else waits for it.
    Only PIDs this process adopted may be passed: reaping a child a task
    started itself would take the status its ``Popen.wait`` reads.
    """
    reaped = 0
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            continue  # not our child (never adopted, or reaped already)
        reaped += done == pid
    return reaped


def reap_unclaimed_zombies(claimed: Callable[[], Iterable[int]], proc: str = "/proc") -> int:
    """Reap this process's exited children that nothing here will wait for; how many were.

    For a child subreaper: an orphan adopted after its parent exited (``sh -c "cmd &"``)
    is often first seen as a direct child, so :func:`reap_adopted` never learns of it,
    and each one would stay a zombie. ``claimed`` is called only when an exited child is
    found: the PIDs a waiter in this process still owns (live ``Popen`` objects,
    ``multiprocessing`` children), whose status is theirs to read.
    """
    if not _exited_child():
        return 0  # the usual case, told by one system call: no child has exited
    children = _children_of(os.getpid(), proc)
    exited = [pid for pid in children or () if _is_zombie(pid, proc)]
    if not exited:
        return 0
    owned = set(claimed())
    return reap_adopted(pid for pid in exited if pid not in owned)


def _is_zombie(pid: int, proc: str) -> bool:
    """Whether ``pid`` has exited and waits to be reaped (state ``Z`` in its ``stat``)."""
    try:
        text = _read_small(f"{proc}/{pid}/stat")
    except OSError:
        return False
    end = text.rfind(b")")
    return end >= 0 and text[end + 2 : end + 3] == b"Z"


def _exited_child() -> bool | None:
    """This process's children (any thread's), by one ``waitid`` that reaps nothing:
    ``None`` where it has none at all, ``False`` where none has exited, ``True`` where one
    has exited and waits to be reaped, or where that cannot be asked (then look)."""
    if not _CAN_ASK_CHILDREN:
        return True
    try:
        return os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return None
    except OSError:
        return True


def read_descendants(
    pid: int, proc: Path | str = "/proc", *, own: bool | None = None
) -> tuple[int, ...]:
    """Every live process started under ``pid`` (children, grandchildren...), ``pid`` excluded.

    A descendant whose parent exited before it was seen is re-parented (to
    init or a subreaper) and is no longer under ``pid``. At most
    :data:`MAX_DESCENDANTS` are listed. For this process itself, one
    ``waitid`` first tells whether it has any child, so that a process
    without one costs no read of ``/proc``. ``own``: whether ``pid`` is this
    process, where the caller knows (``None``: asked of ``os.getpid``).
    """
    if own is None:
        own = pid == os.getpid()
    if own and _exited_child() is None:
        return ()
    root = str(proc)
    scanned: dict[int, list[int]] | None = None
    found: list[int] = []
    seen = {pid}
    stack = [pid]
    while stack and len(found) < MAX_DESCENDANTS:
        current = stack.pop()
        children = None if scanned is not None else _children_of(current, root)
        if children is None:
            if scanned is None:
                scanned = _scan_parents(root)
            children = scanned.get(current, [])
        for child in children:
            if child not in seen:
                seen.add(child)
                found.append(child)
                stack.append(child)
    return tuple(found[:MAX_DESCENDANTS])


def read_rss_high_water_of(pid: int, proc: Path | str = "/proc") -> int | None:
    """Process ``pid``'s resident-set high-water (``VmHWM``) in bytes; ``None`` if unknown."""
    try:
        text = _read_small(f"{proc}/{pid}/status")
    except OSError:
        return None
    at = text.find(b"\nVmHWM:")
    if at >= 0:
        parts = text[at + 7 : text.find(b"\n", at + 7)].split()
        if parts and parts[0].isdigit():
            return int(parts[0]) * 1024
    return None  # a kernel thread, or a zombie: no memory of its own


def read_children_rss_high_water() -> int | None:
    """The largest RSS high-water of this process's reaped descendants (``RUSAGE_CHILDREN``).

    It covers only children that have been waited for (and what they waited
    for), over this process's life; ``None`` off Linux, where the unit differs.
    """
    if sys.platform != "linux":
        return None
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
