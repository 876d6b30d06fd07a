"""This process's own host memory (I/O edge): read in each child after each task."""

from __future__ import annotations

import os
import resource
import sys
import time

__all__ = ["RSS_READ_INTERVAL_S", "read_rss_high_water", "rss_high_water_after_task"]

_STATUS = "/proc/self/status"


#: ``(pid, bytes)``: what ``getrusage`` reports of this process that is not its own: the
#: high-water of the memory it replaced at ``exec``. A worker is started by ``vfork`` and
#: ``exec``, so that memory was the pool's process's: its ``ru_maxrss`` is at least the
#: parent's high-water for its whole life (a worker of a parent that held 600 MiB read 600
#: MiB, against 17 MiB of its own ``VmHWM``). Read once per process.
_inherited: tuple[int, int] | None = None


def read_rss_high_water(path: str | os.PathLike[str] = _STATUS) -> int | None:
    """This process's resident-set high-water (``VmHWM``) in bytes, or ``None`` if unknown.

    The high-water covers the worker's whole life, which is what a warm
    worker keeps on the host; the host-RAM ceiling prices exactly that. On
    Linux it comes from ``getrusage`` (``ru_maxrss``, KiB), one system call per
    task, where that is this process's own: ``ru_maxrss`` is the larger of
    ``VmHWM`` and the high-water of the memory the process replaced at ``exec``
    (for a worker, the pool's process's): while ``ru_maxrss`` is not above the
    latter, ``VmHWM`` is read from ``path`` instead.
    """
    if sys.platform == "linux" and (path is _STATUS or path == _STATUS):
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if maxrss > _inherited_bytes(maxrss):
            return maxrss  # above what the exec left: this process's own, from now on
        return _parse_vmhwm(_STATUS_FILE.read())
    return _read_vmhwm(path)


def _read_vmhwm(path: str | os.PathLike[str]) -> int | None:
    """``VmHWM`` of a ``/proc/<pid>/status`` file, in bytes; ``None`` if unknown."""
    try:
        with open(path, "rb") as file:
            return _parse_vmhwm(file.read(_STATUS_MAX_BYTES))
    except OSError:
        return None


def _parse_vmhwm(text: bytes | None) -> int | None:
    """``VmHWM`` in a status file's ``text``, in bytes; ``None`` where it says none."""
    if text is None:
        return None
    start = text.find(b"VmHWM:")
    if start < 0 or (start > 0 and text[start - 1 : start] != b"\n"):
        return None
    end = text.find(b"\n", start)
    parts = (text[start:] if end < 0 else text[start:end]).split()
    if len(parts) >= 2 and parts[1].isdigit():
        return int(parts[1]) * 1024
    return None


#: More than a status file holds (about 1.5 KiB): one read takes it whole.
_STATUS_MAX_BYTES = 65536


class _ProcFile:
    """A file of this process's ``/proc/self``, kept open and read again at each call (a third
    of the cost of opening it each time). A descriptor a task closed, or replaced by a file
    of its own (its identity changed), or one inherited from the process a fork copied, is
    opened again."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self._path = path
        self._max_bytes = max_bytes
        self._fd = -1
        self._id: tuple[int, int, int] | None = None  # pid, st_dev, st_ino

    def read(self) -> bytes | None:
        pid = os.getpid()
        for _ in range(2):
            if self._fd >= 0 and self._id is not None and self._id[0] == pid:
                try:
                    status = os.fstat(self._fd)
                    if (pid, status.st_dev, status.st_ino) == self._id:
                        return os.pread(self._fd, self._max_bytes, 0)
                except OSError:
                    pass
            self._open(pid)
        return None

    def _open(self, pid: int) -> None:
        """Open the file anew; a descriptor of ours that is still the file (a fork's copy of it
        included) is closed first."""
        if self._fd >= 0 and self._id is not None:
            try:
                status = os.fstat(self._fd)
                if (status.st_dev, status.st_ino) == self._id[1:]:
                    os.close(self._fd)
            except OSError:
                pass
        self._fd, self._id = -1, None
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        status = os.fstat(fd)
        self._fd, self._id = fd, (pid, status.st_dev, status.st_ino)


_STATUS_FILE = _ProcFile(_STATUS, _STATUS_MAX_BYTES)


def _inherited_bytes(maxrss: int) -> int:
    """What ``ru_maxrss`` holds that is not this process's own (0: nothing), given its value
    now (``maxrss``, bytes): found once per process, from ``VmHWM``."""
    global _inherited
    pid = os.getpid()
    if _inherited is None or _inherited[0] != pid:
        own = _read_vmhwm(_STATUS)
        # Above VmHWM, ru_maxrss is the replaced memory's high-water, fixed at exec; at or
        # below it, ru_maxrss follows VmHWM from now on (both only grow).
        _inherited = (pid, maxrss if own is not None and maxrss > own else 0)
    return _inherited[1]


#: How often, at most, a worker reads its RSS high-water as a task ends; a task that ends
#: sooner after the last reading reports that reading again. The reading, however made
#: (``getrusage`` or the status file), took 100-300 us of wall time in a worker right after
#: its task on a loaded 2-core host (5-10 us of CPU): 20-25 % of a no-op task's cost with
#: 2 workers. A task that ran this long or longer is always read at its end (the last
#: reading is older than the task), and so is a worker's first task.
RSS_READ_INTERVAL_S = 0.1

#: ``(pid, bytes or None, when read: monotonic seconds)`` of the last reading after a task.
_last_after_task: tuple[int, int | None, float] | None = None


def rss_high_water_after_task() -> int | None:
    """This process's RSS high-water for the report of a task that just ended: read now
    (:func:`read_rss_high_water`), or the last reading where it is less than
    :data:`RSS_READ_INTERVAL_S` old. Growth that a burst of short tasks made is reported at
    the first task end past that interval."""
    global _last_after_task
    pid, now_s = os.getpid(), time.monotonic()
    last = _last_after_task
    if last is not None and last[0] == pid and now_s - last[2] < RSS_READ_INTERVAL_S:
        return last[1]
    figure = read_rss_high_water()
    _last_after_task = (pid, figure, now_s)
    return figure
