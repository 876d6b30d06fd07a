"""Which rows and files of the booking table to believe, how long to wait, how to write (I/O edge).

Anyone who can write a table file can write any row into it. A row counts only
where it speaks for a live pool of the file's owner::

    row (pid, start, updated_s, tasks)   kept when
      pid                                > 1, a live process (not a zombie) with that start
                                         time, owned by the file's owner (the writer)
      updated_s                          within STALE_AFTER_S before now, not in the future
      tasks                              at most MAX_TASKS_PER_POOL; each worker is the pid
                                         itself or one of its children
      booked bytes, need_bytes           within the card's total
    file                                 at most MAX_FILE_BYTES read; MAX_POOLS_PER_FILE rows
                                         (another user's file: see booking_foreign)

A row that fails any test is dropped whole. These reads cost one ``/proc``
lookup per row and, the first time a worker is met, one per worker.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from typing import TYPE_CHECKING

from gpupool._sensors.ancestry import read_parent_pid

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from gpupool._core.bookings import PoolBooking

__all__ = [
    "FUTURE_SLACK_S",
    "HEARTBEAT_S",
    "MAX_FILE_BYTES",
    "MAX_POOLS_PER_FILE",
    "MAX_TASKS_PER_POOL",
    "STALE_AFTER_S",
    "RowChecks",
    "directory_refusal",
    "flock_within",
    "process_owner",
    "read_start_token",
    "write_in_place",
]

#: A pool rewrites its row's stamp at least this often while it reads the table
#: (the dispatcher reads it every 0.2 s while tasks run or wait).
HEARTBEAT_S = 5.0
#: A row whose stamp is older than this is stale: its pool stopped writing.
STALE_AFTER_S = 30.0
#: How far in the future a stamp may be (the host's processes share one clock).
FUTURE_SLACK_S = 5.0
#: The most bytes of a table file that are read; a larger file is not parsed.
MAX_FILE_BYTES = 1 << 20
#: The most rows of one file that count, and the most tasks of one row.
MAX_POOLS_PER_FILE = 256
MAX_TASKS_PER_POOL = 1024
_LOCK_POLL_S = 0.002
#: Workers already found to be children of their pool: forgotten past this many.
_KNOWN_WORKERS = 16384
#: Rows whose own terms and workers were found good: forgotten past this many.
_KNOWN_ROWS = 1024


def process_owner(pid: int) -> int | None:
    """The user that owns process ``pid`` (its ``/proc`` entry's owner), or ``None``."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def read_start_token(pid: int) -> str | None:
    """A token naming the running process ``pid`` (its start time), or ``None`` if it has exited.

    A zombie counts as exited: the driver frees a process's memory when it
    exits, not when it is reaped. Read from ``/proc/<pid>/stat`` (field 22,
    start time in clock ticks), psutil where there is no ``/proc``.
    """
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return _start_token_psutil(pid)
    try:
        text = os.read(fd, 4096)
    except OSError:
        return None  # it exited while we read (ESRCH)
    finally:
        os.close(fd)
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = text[text.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X", b"x"):
        return None
    return fields[19].decode()


def _start_token_psutil(pid: int) -> str | None:
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return None
        return repr(process.create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


class RowChecks:
    """The checks of :mod:`gpupool._sensors.booking_rows`, with what they learned, for
    ``own_pid`` (alive, owned by ``own_uid``, this process's effective uid by default;
    ``start_token`` gives ``None`` for a dead PID)."""

    def __init__(
        self,
        *,
        start_token: Callable[[int], str | None],
        own_pid: int,
        own_start: str,
        own_uid: int | None = None,
    ) -> None:
        self.start_token = start_token
        self.own_pid = own_pid
        self.own_start = own_start
        self.own_uid = os.geteuid() if own_uid is None else own_uid
        self._workers: set[tuple[int, str, int]] = set()
        # Rows (by identity: a row parsed once is met again while its file's text is
        # unchanged) whose own terms and workers passed, for the card total they were
        # checked against.
        self._formed: dict[int, tuple[PoolBooking, int | None]] = {}

    def keep(
        self,
        pools: dict[str, PoolBooking],
        *,
        owner_uid: int,
        now_s: float,
        total_bytes: int | None,
    ) -> list[str]:
        """Drop from ``pools`` every row that does not speak for a live pool of ``owner_uid``
        (the file's owner); returns the dropped rows' ids."""
        tokens: dict[int, str | None] = {self.own_pid: self.own_start}
        dropped: list[str] = []
        kept = 0
        for key, row in pools.items():
            if kept >= MAX_POOLS_PER_FILE or not self._believed(
                row, tokens, owner_uid, now_s, total_bytes
            ):
                dropped.append(key)
            else:
                kept += 1
        for key in dropped:
            del pools[key]
        if len(self._formed) > _KNOWN_ROWS:
            self._formed.clear()
        return dropped

    def _believed(
        self,
        row: PoolBooking,
        tokens: dict[int, str | None],
        owner_uid: int,
        now_s: float,
        total_bytes: int | None,
    ) -> bool:
        known = self._formed.get(id(row))
        formed = known is not None and known[0] is row and known[1] == total_bytes
        if not formed and (
            row.pid <= 1
            or len(row.tasks) > MAX_TASKS_PER_POOL
            or (
                total_bytes is not None
                and (row.booked_bytes > total_bytes or row.need_bytes > total_bytes)
            )
        ):
            return False
        if not now_s - STALE_AFTER_S <= row.updated_s <= now_s + FUTURE_SLACK_S:
            return False
        if row.pid not in tokens:
            tokens[row.pid] = self.start_token(row.pid)
        if tokens[row.pid] != row.start:
            return False  # exited, a zombie, or the PID now names another process
        owner = self.own_uid if row.pid == self.own_pid else process_owner(row.pid)
        if owner != owner_uid:
            return False
        if formed:
            return True  # the row object met before, its workers found then
        if not all(self._worker_of(task.worker_pid, row) for task in row.tasks):
            return False
        self._formed[id(row)] = (row, total_bytes)
        return True

    def _worker_of(self, worker: int, row: PoolBooking) -> bool:
        """Whether ``worker`` is the row's process or one of its children."""
        if worker == row.pid:
            return True
        known = (row.pid, row.start, worker)
        if known in self._workers:
            return True
        if read_parent_pid(worker) != row.pid:
            return False
        if len(self._workers) >= _KNOWN_WORKERS:
            self._workers.clear()
            self._formed.clear()  # its rows' workers are looked up again
        self._workers.add(known)
        return True


def directory_refusal(
    directory: Path, status: os.stat_result, *, shared: bool, uid: int
) -> str | None:
    """Why a table directory is refused (another user could swap its files), or ``None``.

    Private: this user's own, writable by no one else. Shared: owned by root
    or this user, and writable by others only with the sticky bit (as ``/tmp``).
    """
    mode = stat.S_IMODE(status.st_mode)
    if not shared:
        if status.st_uid != uid or mode & 0o022:
            return (
                f"the booking table directory {directory} is not private to this user (owner "
                f"uid {status.st_uid}, mode {mode:o}); it is not used. Pass bookings_dir= a "
                "directory of your own, or share_bookings='host' for a table shared by every "
                "user."
            )
        return None
    if status.st_uid not in (0, uid):
        return (
            f"the shared booking table directory {directory} belongs to another user (owner "
            f"uid {status.st_uid}, mode {mode:o}), who could replace its files; it is not "
            "used. Pass bookings_dir= a directory owned by root or by you."
        )
    if mode & 0o022 and not mode & stat.S_ISVTX:
        return (
            f"the shared booking table directory {directory} is writable by other users "
            f"without the sticky bit (mode {mode:o}): anyone could replace the files in it; "
            "it is not used. Run chmod +t on it (mode 1777, as /tmp), or pass bookings_dir= "
            "another directory."
        )
    return None


def flock_within(fd: int, wait_s: float) -> bool:
    """Take an exclusive ``flock`` on ``fd``, waiting at most ``wait_s``; whether it was."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
        time.sleep(_LOCK_POLL_S)


def write_in_place(fd: int, data: bytes, size: int) -> None:
    """Overwrite the file in place, valid at every instant.

    The new text is padded with spaces to the old length (JSON ignores
    trailing whitespace) and written with one ``pwrite``, so a process
    killed at any point leaves the old text or the new; then the file is
    cut to the new length. A file past the size limit is not padded.
    """
    padded = data.ljust(size) if size <= MAX_FILE_BYTES else data
    written = os.pwrite(fd, padded, 0)
    while written < len(padded):  # only on a full disk or an odd filesystem
        written += os.pwrite(fd, padded[written:], written)
    if len(data) < size:
        os.ftruncate(fd, len(data))
