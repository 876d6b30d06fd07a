"""This process's own host memory (I/O edge): read in each child after each task."""

from __future__ import annotations

import os
import resource
import sys
import time

__all__ = ["read_rss_high_water"]

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
    latter, ``VmHWM`` is read from ``path`` instead (no more often than every
    :data:`VMHWM_MAX_AGE_S` while the resident set stays below it).
    """
    if sys.platform == "linux" and (path is _STATUS or path == _STATUS):
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if maxrss > _inherited_bytes(maxrss):
            return maxrss  # above what the exec left: this process's own, from now on
        return _own_high_water()
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
_STATM_FILE = _ProcFile("/proc/self/statm", 256)

#: How old a ``VmHWM`` reading may be when it is given again (where ``ru_maxrss`` is not
#: this process's own): the status file costs some 10-40 us to read, a no-op task less. A
#: reading is given again only while the resident set now (``statm``, about 2 us) is not
#: above it, so what a task kept is seen at its end; a peak a task freed before it ended is
#: seen at the first end of a task this long after the last reading.
VMHWM_MAX_AGE_S = 0.05

#: ``(pid, VmHWM bytes, when read: monotonic seconds)`` of the last status reading.
_last_vmhwm: tuple[int, int, float] | None = None


def _own_high_water() -> int | None:
    """This process's ``VmHWM``, read from its status file at most every
    :data:`VMHWM_MAX_AGE_S` while its resident set stays below the last reading."""
    global _last_vmhwm
    pid, now_s = os.getpid(), time.monotonic()
    last = _last_vmhwm
    if last is not None and last[0] == pid and now_s - last[2] < VMHWM_MAX_AGE_S:
        resident = _resident_bytes()
        if resident is not None and resident <= last[1]:
            return last[1]
    figure = _parse_vmhwm(_STATUS_FILE.read())
    _last_vmhwm = None if figure is None else (pid, figure, now_s)
    return figure


def _resident_bytes() -> int | None:
    """This process's resident set now (``statm``'s second figure, in pages), in bytes."""
    text = _STATM_FILE.read()
    if text is None:
        return None
    parts = text.split()
    if len(parts) < 2 or not parts[1].isdigit():
        return None
    return int(parts[1]) * _PAGE_BYTES


_PAGE_BYTES = resource.getpagesize()


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
