"""The host-wide booking table: every pool's bookings on every card, in small files (I/O edge).

A pool's census and its live readings see what other processes *hold*; they
cannot see what another pool on the same card has *booked* and not yet
reached. So every pool writes its bookings to a table that every gpupool
process of the host can read::

    pool A (train.py)                 /dev/shm/gpupool-<uid>/            pool B (eval.py)
    start / finish a task  --publish-> GPU-<uuid>.json  <-publish--  start / finish a task
    before a start         <--others--   (one file per card,  --others->  before a start
                                          flock, 0600)

One file per card UUID (in a table shared by every user: one per card and
user, ``GPU-<uuid>.uid<N>.json``, written only by that user, read by all). One
operation is one read-modify-write of this user's file under an exclusive
``flock`` taken with a bounded wait (plus a thread lock: ``flock`` does not
exclude two threads sharing one descriptor), written in place so that a
process killed at any instant leaves the old text or the new one. Every
operation first drops the rows that do not speak for a live pool of the file's
owner (:mod:`gpupool._sensors.booking_rows`): a pool that was killed, or a row
forged under a process that is not the writer's pool, counts for nothing.

A lock held past :data:`LOCK_WAIT_S` (by any process that can open the file)
makes the operation answer ``None`` ("unknown"), and the table is passed over
for :data:`RETRY_AFTER_S`; the pool prices its cards by live readings alone
meanwhile, and the table keeps a :class:`~gpupool._core.bookings.TableNote`
for its decision log. Where the table cannot be kept at all (no ``/dev/shm``,
a read-only filesystem, a directory others could swap), every operation
answers ``None``; a ``RuntimeWarning`` and the ``gpupool`` logger say why once
per process and directory, and a note says so in the pool's log. A pool never
fails for it.

A :class:`BookingTable` keeps its state in three rooms, each the only writer of
its fields::

    BookingTable   the operations; the process its rooms belong to, the pause after a
                   busy lock, this process's pools' rows, the row checks, the reader of
                   other users' files (booking_foreign.py)
      TableFiles   booking_files.py: the directory, this user's files, their locks
      CardTexts    booking_texts.py: each file's text as last read or written, its rows,
                   their encodings, the last answer built from them
      TableLog     booking_log.py: steps passed over, notes, warnings, why unavailable
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from gpupool._core.bookings import (
    LastDecision,
    OtherPools,
    PoolBooking,
    TableNote,
    TaskBooking,
    WaitBooking,
)
from gpupool._sensors.booking_files import LOCK_WAIT_S, TableFiles, _Busy, _file_name, _Unavailable
from gpupool._sensors.booking_foreign import ForeignReader
from gpupool._sensors.booking_log import RETRY_AFTER_S, TableLog
from gpupool._sensors.booking_rows import HEARTBEAT_S, RowChecks, read_start_token
from gpupool._sensors.booking_texts import CardTexts

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpupool._sensors.base import Sensor

__all__ = [
    "BOOKINGS_ENV",
    "LOCK_WAIT_S",
    "RETRY_AFTER_S",
    "BookingTable",
    "default_bookings_directory",
    "new_pool_id",
    "open_booking_table",
    "read_start_token",
]

#: A directory to keep the table in, for every pool of this process and its
#: children that is not given one (e.g. a directory that several containers mount).
BOOKINGS_ENV = "GPUPOOL_BOOKINGS"

_T = TypeVar("_T")

_POOL_NUMBERS = itertools.count(1)


def new_pool_id() -> str:
    """A pool id unique among the live pools of the host: ``"<pid>.<n>"``."""
    return f"{os.getpid()}.{next(_POOL_NUMBERS)}"


def _program_label() -> str:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return Path(argv0).name or Path(sys.executable).name


def default_bookings_directory(*, shared: bool = False, shm: Path = Path("/dev/shm")) -> Path:
    """Where the table lives unless told: ``/dev/shm``, else the user's runtime directory.

    ``/dev/shm/gpupool-<uid>`` (private) or ``/dev/shm/gpupool`` (shared by
    every user); where there is no ``/dev/shm``, ``$XDG_RUNTIME_DIR/gpupool``
    (private only: that directory belongs to one user).
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if not shm.is_dir() and runtime and not shared:
        return Path(runtime) / "gpupool"
    return shm / ("gpupool" if shared else f"gpupool-{os.geteuid()}")


class BookingTable:
    """This process's handle on the host's booking table in ``directory``.

    Args:
        directory: where the table's files live (created if missing: 0700, or
            1777 when shared).
        shared: ``False``: private to this user (files 0600; a directory or
            file that other users could write is refused). ``True``: every
            user's pools share it (each user writes its own files, 0644, and
            reads the others'; a directory owned by another user than root, or
            that others can write without the sticky bit, is refused).

    Every method answers ``None`` when the table cannot be used for that step
    (:attr:`unavailable_reason` says why when it never can); none raises for
    the filesystem. :meth:`take_notes` hands over what the decision log should
    say about it.

    Three rooms keep its state, each the only writer of its fields: this user's
    files and their locks (:class:`~gpupool._sensors.booking_files.TableFiles`),
    their text as last read or written (:class:`~gpupool._sensors.booking_texts.CardTexts`),
    and what the decision log hears (:class:`~gpupool._sensors.booking_log.TableLog`).
    The table itself keeps the process they belong to, the pause after a busy lock,
    this process's pools' rows, the checks rows must pass, and the reader of other
    users' files.
    """

    def __init__(self, directory: str | os.PathLike[str], *, shared: bool = False) -> None:
        self._files = TableFiles(directory, shared=shared)
        self._log = TableLog(self._files)
        self._texts = CardTexts(self._files, self._log)
        self._pid = os.getpid()
        self._own_start: str | None = None
        self._label = _program_label()
        self._checks: RowChecks | None = None
        # Other users' files of a shared table: read within a budget, remembered.
        self._foreign = ForeignReader()
        # Each pool's last row per card, put back with a fresh stamp when it ages.
        self._rows: dict[tuple[str, str], PoolBooking] = {}
        self._busy_until_s = 0.0

    def __repr__(self) -> str:
        mode = "shared" if self.shared else "private"
        return f"<BookingTable {str(self.directory)!r} {mode}>"

    @property
    def directory(self) -> Path:
        """Where the table's files live."""
        return self._files.directory

    @property
    def shared(self) -> bool:
        """Whether every user's pools share the table (else this user's only)."""
        return self._files.shared

    @property
    def unavailable_reason(self) -> str | None:
        """Why the table cannot be kept here, once an operation has found out; else ``None``."""
        return self._log.unavailable

    @property
    def skipped_steps(self) -> int:
        """Operations that answered ``None`` because the table was passed over."""
        return self._log.skipped_steps

    def take_notes(self) -> list[TableNote]:
        """What the decision log should say about the table since the last call."""
        return self._log.take_notes()

    # -- operations ----------------------------------------------------------------------

    def publish(self, card_uuid: str, pool_id: str, tasks: Sequence[TaskBooking]) -> bool:
        """Replace ``pool_id``'s row on ``card_uuid`` with its running ``tasks``.

        Returns:
            Whether the row was written (``False``: the table is unavailable).
        """
        return self.exchange(card_uuid, pool_id, tasks) is not None

    def withdraw(self, card_uuid: str, pool_id: str) -> bool:
        """Remove ``pool_id``'s row from ``card_uuid`` (the pool is shutting down); tried
        even while the table is passed over.

        Returns:
            Whether the table was reached.
        """
        self._rows.pop((card_uuid, pool_id), None)

        def change(pools: dict[str, PoolBooking], _foreign: list[PoolBooking]) -> bool:
            return pools.pop(pool_id, None) is not None

        return self._apply(card_uuid, change, always=True) is not None

    def others(
        self, card_uuid: str, pool_id: str | None = None, *, total_bytes: int | None = None
    ) -> OtherPools | None:
        """Every live pool's row on ``card_uuid`` except ``pool_id``'s (``None``: all of them).

        ``pool_id``'s own row, when it has one, gets a fresh stamp if it is
        older than :data:`~gpupool._sensors.booking_rows.HEARTBEAT_S`.

        Args:
            card_uuid: the card.
            pool_id: the reading pool.
            total_bytes: the card's total: a row booking more counts for nothing.

        Returns:
            The rows, oldest pool first; ``None`` when the table is unavailable
            ("unknown": price the card by its live readings alone).
        """

        def change(pools: dict[str, PoolBooking], foreign: list[PoolBooking]) -> OtherPools:
            return self._texts.answer(card_uuid, pools, foreign, pool_id)

        return self._apply(card_uuid, change, total_bytes=total_bytes, refresh=pool_id)

    def exchange(
        self,
        card_uuid: str,
        pool_id: str,
        tasks: Sequence[TaskBooking],
        waiting: int = 0,
        need_bytes: int = 0,
        *,
        total_bytes: int | None = None,
        waits: Sequence[WaitBooking] = (),
        last: LastDecision | None = None,
    ) -> OtherPools | None:
        """Publish ``pool_id``'s ``tasks`` (and how many of its tasks wait for room, and the
        first one's ask; for people: its waiting tasks by key and its latest decision) and
        read the other pools' rows, in one locked step."""
        row = PoolBooking(
            pool_id=pool_id,
            pid=os.getpid(),
            start=self._own_start_token(),
            label=self._label,
            updated_s=time.time(),
            tasks=tuple(tasks),
            waiting=waiting,
            need_bytes=need_bytes,
            waits=tuple(waits),
            last=last,
        )
        self._rows[(card_uuid, pool_id)] = row

        def change(pools: dict[str, PoolBooking], foreign: list[PoolBooking]) -> OtherPools:
            pools[pool_id] = row
            return self._texts.answer(card_uuid, pools, foreign, pool_id)

        return self._apply(card_uuid, change, writes=True, total_bytes=total_bytes)

    def close(self) -> None:
        """Close this handle's files and directory (reopened on the next operation)."""
        self._files.close()

    # -- the locked read-modify-write ------------------------------------------------------

    def _apply(
        self,
        card_uuid: str,
        change: Callable[[dict[str, PoolBooking], list[PoolBooking]], _T],
        *,
        writes: bool = False,
        always: bool = False,
        total_bytes: int | None = None,
        refresh: str | None = None,
    ) -> _T | None:
        """Run ``change`` on this user's believed rows of the card (and the other users'
        believed rows, in a shared table) under the lock; ``None`` when the table is passed
        over or unavailable.

        The rows are written back when ``writes`` is true, when ``change``
        returned ``True``, when a row was dropped, or when ``refresh``'s row
        was given a fresh stamp. ``always``: tried even while the table is
        passed over after a busy lock.
        """
        log = self._log
        if log.unavailable is not None:
            return None
        if not always and time.monotonic() < self._busy_until_s:
            log.skipped(card_uuid, None)
            return None
        files = self._files
        try:
            if self._pid != os.getpid():
                self._leave_parent()
            fd, lock_fd, size = files.lock_file(card_uuid)
            try:
                now_s = time.time()
                pools = self._texts.read(fd, size, card_uuid)
                dropped = self._row_checks().keep(
                    pools, owner_uid=files.uid, now_s=now_s, total_bytes=total_bytes
                )
                refreshed = self._refresh(card_uuid, refresh, pools, now_s)
                foreign = self._foreign_rows(card_uuid, now_s, total_bytes)
                result = change(pools, foreign)
                if writes or dropped or refreshed or result is True:
                    self._texts.write(fd, size, card_uuid, pools)
                return result
            finally:
                files.unlock_file(lock_fd)
        except _Busy:
            self._busy_until_s = time.monotonic() + RETRY_AFTER_S
            log.skipped(card_uuid, "busy")
            return None
        except _Unavailable as exc:
            log.stop(exc)
            return None
        except OSError as exc:
            # A failure of one operation (a full /dev/shm, an I/O error): this
            # answer is unknown; the next operation tries again.
            log.skipped(card_uuid, f"io:{exc.errno}", exc)
            return None

    def _leave_parent(self) -> None:
        """In a forked child (the pid :meth:`_apply` finds is not ``_pid``), start afresh: the
        inherited descriptors share the parent's flock, and what this handle read, answered
        and booked was the parent's."""
        self._pid = os.getpid()
        self._files.leave_parent()
        self._texts.leave_parent()
        self._rows = {}
        self._own_start = None
        self._foreign = ForeignReader()

    def _refresh(
        self, card_uuid: str, pool_id: str | None, pools: dict[str, PoolBooking], now_s: float
    ) -> bool:
        """Put ``pool_id``'s last row back with a fresh stamp where it aged or was dropped."""
        last = self._rows.get((card_uuid, pool_id)) if pool_id is not None else None
        if last is None or pool_id is None:
            return False
        row = pools.get(pool_id)
        if row is not None and now_s - row.updated_s < HEARTBEAT_S:
            return False
        fresh = replace(last, updated_s=now_s)
        self._rows[(card_uuid, pool_id)] = fresh
        pools[pool_id] = fresh
        return True

    def _row_checks(self) -> RowChecks:
        """The checks for this process (its pid as :meth:`_leave_parent` last found it)."""
        if self._checks is None or self._checks.own_pid != self._pid:
            self._checks = RowChecks(
                start_token=read_start_token,
                own_pid=self._pid,
                own_start=self._own_start_token(),
                own_uid=self._files.uid,
            )
        return self._checks

    def _foreign_rows(
        self, card_uuid: str, now_s: float, total_bytes: int | None
    ) -> list[PoolBooking]:
        """In a shared table, the other users' believed rows for the card: each user's own
        file, read without its lock and within the step's budget
        (:mod:`gpupool._sensors.booking_foreign`), each row believed only under its writer's
        processes."""
        files = self._files
        if not files.shared:
            return []
        checks = self._row_checks()
        prefix = _file_name(card_uuid)[: -len(".json")] + ".uid"
        assert files.dir_fd is not None  # opened by TableFiles.lock_file before any read

        def check(pools: dict[str, PoolBooking], uid: int) -> None:
            checks.keep(pools, owner_uid=uid, now_s=now_s, total_bytes=total_bytes)

        step = self._foreign.read(files.dir_fd, card_uuid, prefix, files.uid, check)
        if step.passed_over:
            self._log.passed_over(card_uuid, step, self._foreign)
        return step.rows

    def _own_start_token(self) -> str:
        if self._own_start is None:
            self._own_start = read_start_token(os.getpid()) or ""
        return self._own_start


def open_booking_table(
    *,
    share: bool | str,
    directory: str | os.PathLike[str] | None,
    sensor: Sensor,
) -> BookingTable | None:
    """The table a pool with these options uses, or ``None`` when sharing is off.

    Where it lives, first that applies: ``directory``; the sensor's own
    (:attr:`Sensor.bookings_directory`: a simulated host's), or inside a ``SimulatedHost``
    block whatever the sensor (a sensor wrapping the simulator's; simulated
    cards never book in the real host's table); the ``GPUPOOL_BOOKINGS``
    environment variable; :func:`default_bookings_directory`.

    Args:
        share: ``True`` (this user's pools), ``"host"`` (every user's), or ``False``.
        directory: an explicit directory, or ``None``.
        sensor: the pool's sensor.
    """
    if share is False:
        return None
    shared = share == "host"
    if directory is not None:
        return BookingTable(directory, shared=shared)
    from gpupool._sensors.select import read_simulator_ledger
    from gpupool._sensors.simulated import BOOKINGS_DIRECTORY

    own = sensor.bookings_directory
    if own is not None:
        return BookingTable(own, shared=shared)
    ledger = read_simulator_ledger()
    if ledger:
        return BookingTable(Path(ledger).parent / BOOKINGS_DIRECTORY, shared=shared)
    override = os.environ.get(BOOKINGS_ENV)
    if override:
        return BookingTable(override, shared=shared)
    return BookingTable(default_bookings_directory(shared=shared), shared=shared)
