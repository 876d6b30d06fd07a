"""Which processes the simulator's ledger names have exited (I/O edge, part of the ledger).

The ledger frees a process's bytes once it has exited (a zombie counts: a
driver frees a process's memory when it exits, not when it is reaped) or its
PID was reused; every ledger operation asks. Reading each named process's
``/proc/<pid>/stat`` at every operation costs a file read per process, so
each is opened once as a *pidfd* (Linux 5.3 and later), which becomes
readable when its process exits, and all are polled in one system call. A
pidfd names one process, never a later one with its PID. A death the poll
reports is confirmed by the process's start token before it counts; where no
pidfd can be had (another system, too many processes), the start token is
read at every operation, as before. A pidfd a task closed (``os.closerange``)
is never closed again by number: the number may now be another file's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import select
from typing import TYPE_CHECKING

from gpupool._sensors.booking_rows import read_start_token

if TYPE_CHECKING:
    from collections.abc import Set

__all__ = ["MAX_WATCHED", "Liveness"]

#: The most processes watched through a pidfd; past that, their start tokens are read.
MAX_WATCHED = 1024
#: At most this share of the process's descriptor limit goes to pidfds (``1 / 4``): a ledger
#: that names many processes must leave the program room for its own files.
_SHARE_OF_LIMIT = 4

_pidfd_open = getattr(os, "pidfd_open", None)


class Liveness:
    """Tells which of the ledger's ``(pid, start token)`` identities have exited.

    One per :class:`~gpupool._sensors.simulated.Ledger` and process (a forked
    child makes its own).
    """

    def __init__(self) -> None:
        self._fds: dict[tuple[int, str], int] = {}
        self._names: dict[int, tuple[int, str]] = {}
        # What each pidfd is (``fstat``'s device and inode), to tell it from a file that
        # took its number after a task closed it.
        self._files: dict[int, tuple[int, int] | None] = {}
        self._poll = select.poll() if _pidfd_open is not None and hasattr(select, "poll") else None
        self._can_open = self._poll is not None
        self._most = _most_watched()
        # The set last asked about (the very object), and those of it without a pidfd.
        self._known: Set[tuple[int, str]] | None = None
        self._unwatched: list[tuple[int, str]] = []

    def dead(self, identities: Set[tuple[int, str]]) -> set[tuple[int, str]]:
        """The processes of ``identities`` that have exited or whose PID was reused.

        Identities no longer asked about are forgotten (their pidfds closed).
        Asked again with the very same set (the ledger's unchanged reading),
        only the poll runs, and the start tokens of processes without a pidfd.
        """
        fds = self._fds
        if identities is not self._known:
            for identity in fds.keys() - identities:
                self._forget(identity)
            pending = [i for i in identities if i not in fds]
            self._unwatched = []
            while pending:
                identity = pending.pop()
                if not self._watch(identity, pending):
                    self._unwatched.append(identity)
            self._known = identities
        unwatched = self._unwatched
        dead = {i for i in unwatched if read_start_token(i[0]) != i[1]} if unwatched else set()
        if fds and self._poll is not None:
            for fd, _ in self._poll.poll(0):
                identity = self._names[fd]
                self._forget(identity)
                self._known = None  # asked next time as if anew: it is watched again if alive
                if read_start_token(identity[0]) != identity[1]:
                    dead.add(identity)  # confirmed: not a descriptor a task closed and reused
        return dead

    def close(self) -> None:
        """Close every pidfd (this object may still be used: it reopens them)."""
        for identity in list(self._fds):
            self._forget(identity)
        self._known = None

    def _watch(self, identity: tuple[int, str], pending: list[tuple[int, str]]) -> bool:
        """Open a pidfd on ``identity``'s process if it runs; whether one is now watched.

        A pidfd that comes back on the number of one still on the books was closed
        behind this object's back: the process that had it goes to ``pending``.
        """
        if not self._can_open or self._poll is None or _pidfd_open is None:
            return False
        if len(self._fds) >= self._most:
            return False
        pid, token = identity
        try:
            fd: int = _pidfd_open(pid)
        except ProcessLookupError:
            return False  # exited: the start token says so
        except OSError as exc:
            if exc.errno in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
                self._can_open = False  # no pidfds here (an old kernel, a sandbox)
            return False  # out of descriptors, say: its start token is read
        if read_start_token(pid) != token:
            os.close(fd)  # another process now has this PID, or it is a zombie
            return False
        stale = self._names.get(fd)
        if stale is not None:  # its pidfd was closed by someone else: this number is ours now
            self._forget(stale, close=False)
            pending.append(stale)
        self._fds[identity] = fd
        self._names[fd] = identity
        self._files[fd] = _file_of(fd)
        self._poll.register(fd, select.POLLIN)
        return True

    def _forget(self, identity: tuple[int, str], *, close: bool = True) -> None:
        """Stop watching ``identity``; close its pidfd if ``close`` and the number still
        holds that pidfd (a task may have closed it, and another file taken the number)."""
        fd = self._fds.pop(identity)
        del self._names[fd]
        file = self._files.pop(fd, None)
        if self._poll is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._poll.unregister(fd)
        if close and file is not None and _file_of(fd) == file:
            with contextlib.suppress(OSError):
                os.close(fd)


def _most_watched() -> int:
    """How many pidfds one :class:`Liveness` may hold: :data:`MAX_WATCHED`, or a quarter of
    this process's descriptor limit where that is less."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return MAX_WATCHED
    if soft == resource.RLIM_INFINITY:
        return MAX_WATCHED
    return min(MAX_WATCHED, soft // _SHARE_OF_LIMIT)


def _file_of(fd: int) -> tuple[int, int] | None:
    """``fd``'s device and inode, or ``None`` where it is closed."""
    try:
        status = os.fstat(fd)
    except OSError:
        return None
    return (status.st_dev, status.st_ino)
