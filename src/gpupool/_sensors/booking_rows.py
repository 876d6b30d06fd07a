"""Which rows of the booking table to believe, and how much of a file to read (I/O edge).

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

A row that fails any test is dropped whole. These reads cost one ``/proc``
lookup per row and, the first time a worker is met, one per worker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpupool._sensors.host import read_parent_pid

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpupool._core.bookings import PoolBooking

__all__ = [
    "FUTURE_SLACK_S",
    "HEARTBEAT_S",
    "MAX_FILE_BYTES",
    "MAX_POOLS_PER_FILE",
    "MAX_TASKS_PER_POOL",
    "STALE_AFTER_S",
    "RowChecks",
    "process_owner",
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
#: Workers already found to be children of their pool: forgotten past this many.
_KNOWN_WORKERS = 16384


def process_owner(pid: int) -> int | None:
    """The user that owns process ``pid`` (its ``/proc`` entry's owner), or ``None``."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


@dataclass
class RowChecks:
    """The checks of :mod:`gpupool._sensors.booking_rows`, with what they learned.

    Args:
        start_token: a PID's start token, or ``None`` when it is not a live process.
        own_pid: this process (alive, owned by this user).
        own_start: its start token.
    """

    start_token: Callable[[int], str | None]
    own_pid: int
    own_start: str
    _workers: set[tuple[int, str, int]] = field(default_factory=set)

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
        return dropped

    def _believed(
        self,
        row: PoolBooking,
        tokens: dict[int, str | None],
        owner_uid: int,
        now_s: float,
        total_bytes: int | None,
    ) -> bool:
        if row.pid <= 1 or len(row.tasks) > MAX_TASKS_PER_POOL:
            return False
        if not now_s - STALE_AFTER_S <= row.updated_s <= now_s + FUTURE_SLACK_S:
            return False
        if total_bytes is not None and (
            row.booked_bytes > total_bytes or row.need_bytes > total_bytes
        ):
            return False
        if row.pid not in tokens:
            tokens[row.pid] = self.start_token(row.pid)
        if tokens[row.pid] != row.start:
            return False  # exited, a zombie, or the PID now names another process
        owner = os.geteuid() if row.pid == self.own_pid else process_owner(row.pid)
        if owner != owner_uid:
            return False
        return all(self._worker_of(task.worker_pid, row) for task in row.tasks)

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
        self._workers.add(known)
        return True
