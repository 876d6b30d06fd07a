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
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import stat
import sys
import threading
import time
import warnings
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
    format_booking_table,
    parse_booking_table,
)
from gpupool._observe.log import LOGGER
from gpupool._sensors.booking_foreign import (
    MAX_DIRECTORY_ENTRIES,
    MAX_FOREIGN_FILE_BYTES,
    ForeignReader,
    ForeignStep,
)
from gpupool._sensors.booking_rows import (
    HEARTBEAT_S,
    MAX_FILE_BYTES,
    RowChecks,
    directory_refusal,
    flock_within,
    read_start_token,
    write_in_place,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpupool._core.events import JsonValue
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

#: File mode of a private table (this user's pools only) and of this user's file in a
#: shared one (read by every user, written by this one).
PRIVATE_MODE = 0o600
SHARED_MODE = 0o644

#: How long an operation waits for the file's lock before it passes the table over.
LOCK_WAIT_S = 0.5
#: After a lock held past the wait, the table is passed over for this long.
RETRY_AFTER_S = 2.0
#: At most one ``bookings_skipped`` note per this many seconds (the count covers the rest).
NOTE_EVERY_S = 60.0

_T = TypeVar("_T")

#: (directory, kind) pairs this process has already warned about.
_WARNED: set[tuple[str, str]] = set()

_POOL_NUMBERS = itertools.count(1)


def new_pool_id() -> str:
    """A pool id unique among the live pools of the host: ``"<pid>.<n>"``."""
    return f"{os.getpid()}.{next(_POOL_NUMBERS)}"


def _program_label() -> str:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return Path(argv0).name or Path(sys.executable).name


def _file_name(card_uuid: str, uid: int | None = None) -> str:
    """``<uuid>.json`` (a private table) or ``<uuid>.uid<N>.json`` (user N's file in a shared
    one), each character outside ``[A-Za-z0-9-]`` (MIG names hold ``/``) as ``_``."""
    safe = "".join(c if (c.isascii() and (c.isalnum() or c == "-")) else "_" for c in card_uuid)
    return f"{safe}.json" if uid is None else f"{safe}.uid{uid}.json"


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


class _Busy(Exception):
    """The file's lock was held past :data:`LOCK_WAIT_S`."""


class _Unavailable(Exception):
    """The table cannot be kept here; the message says why (logged once)."""

    def __init__(self, message: str, *, kind: str = "unreachable") -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_unavailable, (str(self), self.kind))


def _rebuild_unavailable(message: str, kind: str) -> _Unavailable:
    return _Unavailable(message, kind=kind)


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
    """

    def __init__(self, directory: str | os.PathLike[str], *, shared: bool = False) -> None:
        self.directory = Path(directory)
        self.shared = bool(shared)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._uid = os.geteuid()
        self._fds: dict[str, tuple[int, int]] = {}
        # Per card: the file's text as this handle last read or wrote it, its
        # rows, and the encoded text of each row (so an unchanged file is not
        # parsed again, and an unchanged row not encoded again).
        self._cache: dict[str, tuple[bytes, dict[str, PoolBooking]]] = {}
        self._fragments: dict[str, dict[int, tuple[PoolBooking, str]]] = {}
        # Per card: the rows of the last answer of others() or exchange(), and that answer.
        self._memo: dict[str, tuple[list[PoolBooking], OtherPools]] = {}
        # The directory, opened once; every file is opened in it (a link later put in
        # place of a directory above it cannot redirect the table).
        self._dir_fd: int | None = None
        self._unavailable: str | None = None
        self._own_start: str | None = None
        self._label = _program_label()
        self._checks: RowChecks | None = None
        # Other users' files of a shared table: read within a budget, remembered.
        self._foreign = ForeignReader()
        # Each pool's last row per card, put back with a fresh stamp when it ages.
        self._rows: dict[tuple[str, str], PoolBooking] = {}
        self._busy_until_s = 0.0
        self._next_note_s = 0.0
        self._unnoted_steps = 0
        self._notes: list[TableNote] = []
        #: Operations that answered ``None`` because the table was passed over.
        self.skipped_steps = 0

    def __repr__(self) -> str:
        mode = "shared" if self.shared else "private"
        return f"<BookingTable {str(self.directory)!r} {mode}>"

    @property
    def unavailable_reason(self) -> str | None:
        """Why the table cannot be kept here, once an operation has found out; else ``None``."""
        return self._unavailable

    def take_notes(self) -> list[TableNote]:
        """What the decision log should say about the table since the last call."""
        if not self._notes:
            return []  # a note added meanwhile is handed at the next call
        with self._lock:
            notes, self._notes = self._notes, []
        return notes

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
            return self._others(card_uuid, pools, foreign, pool_id)

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
            return self._others(card_uuid, pools, foreign, pool_id)

        return self._apply(card_uuid, change, writes=True, total_bytes=total_bytes)

    def close(self) -> None:
        """Close this handle's files and directory (reopened on the next operation)."""
        with self._lock:
            fds, self._fds = self._fds, {}
            dir_fd, self._dir_fd = self._dir_fd, None
        kept = {fd for pair in fds.values() for fd in pair}
        for fd in kept if dir_fd is None else kept | {dir_fd}:
            with contextlib.suppress(OSError):
                os.close(fd)

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
        if self._unavailable is not None:
            return None
        if not always and time.monotonic() < self._busy_until_s:
            self._skipped(card_uuid, None)
            return None
        try:
            fd, lock_fd, size = self._lock_file(card_uuid)
            try:
                now_s = time.time()
                pools = self._read(fd, size, card_uuid)
                dropped = self._row_checks().keep(
                    pools, owner_uid=self._uid, now_s=now_s, total_bytes=total_bytes
                )
                refreshed = self._refresh(card_uuid, refresh, pools, now_s)
                foreign = self._foreign_rows(card_uuid, now_s, total_bytes)
                result = change(pools, foreign)
                if writes or dropped or refreshed or result is True:
                    fragments = self._fragments.setdefault(card_uuid, {})
                    data = format_booking_table(card_uuid, list(pools.values()), fragments)
                    write_in_place(fd, data, size)
                    self._cache[card_uuid] = (data, dict(pools))
                return result
            finally:
                self._unlock_file(lock_fd)
        except _Busy:
            self._busy_until_s = time.monotonic() + RETRY_AFTER_S
            self._skipped(card_uuid, "busy")
            return None
        except _Unavailable as exc:
            self._stop(exc)
            return None
        except OSError as exc:
            # A failure of one operation (a full /dev/shm, an I/O error): this
            # answer is unknown; the next operation tries again.
            self._skipped(card_uuid, f"io:{exc.errno}", exc)
            return None

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
        """The checks for this process (its pid as :meth:`_lock_file` last found it)."""
        if self._checks is None or self._checks.own_pid != self._pid:
            self._checks = RowChecks(
                start_token=read_start_token,
                own_pid=self._pid,
                own_start=self._own_start_token(),
                own_uid=self._uid,
            )
        return self._checks

    # -- what the decision log hears -------------------------------------------------------

    def _skipped(self, card_uuid: str, kind: str | None, error: OSError | None = None) -> None:
        """Count a step passed over; note it (at most once per :data:`NOTE_EVERY_S`) and
        warn the first time per process, directory and kind."""
        self.skipped_steps += 1
        self._unnoted_steps += 1
        if kind is None:
            return  # still within the pause after a busy lock: counted, noted with it
        if kind == "busy":
            cause = (
                f"another process held the lock of the booking table file "
                f"{self._path(card_uuid)} for more than {LOCK_WAIT_S} s"
            )
        else:
            cause = f"the booking table in {self.directory} could not be read or written ({error})"
        message = (
            f"{cause}; the pool went on without the other pools' bookings for that step "
            f"(pricing the card by its live readings alone) and tries the table again "
            f"after {RETRY_AFTER_S if kind == 'busy' else 0} s"
        )
        self._warn(kind.split(":")[0], message)
        now_s = time.monotonic()
        if now_s < self._next_note_s:
            return
        self._next_note_s = now_s + NOTE_EVERY_S
        terms: dict[str, JsonValue] = {
            "bookings_dir": str(self.directory),
            "card_uuid": card_uuid,
            "lock_wait_s": LOCK_WAIT_S if kind == "busy" else 0.0,
            "retry_after_s": RETRY_AFTER_S if kind == "busy" else 0.0,
            "skipped_steps": self._unnoted_steps,
            "cause": "lock" if kind == "busy" else "io",
        }
        self._unnoted_steps = 0
        with self._lock:
            self._notes.append(TableNote(event="bookings_skipped", reason=message, terms=terms))

    def _passed_over(self, card_uuid: str, step: ForeignStep) -> None:
        """Count a step that left part of a shared table unread (another user's file refused,
        or left for the step's budget, or directory entries past the scan); warn once per
        process, directory and cause, and note it at most once per :data:`NOTE_EVERY_S`."""
        self.skipped_steps += 1
        self._unnoted_steps += 1
        causes = [
            cause
            for cause, found in (
                ("refused", bool(step.refused)),
                ("budget", bool(step.unread)),
                ("scan_limit", step.scan_truncated),
            )
            if found
        ]
        for cause in causes:
            if (str(self.directory), cause) not in _WARNED:  # the message is built once
                self._warn(cause, self._passed_over_message(cause, step))
        now_s = time.monotonic()
        if now_s < self._next_note_s:
            return
        self._next_note_s = now_s + NOTE_EVERY_S
        refused = _worst_first(step.refused)[:8]
        reason = (
            f"part of the shared booking table was not read for a step ({', '.join(causes)}): "
            + "; ".join(f"{name} refused: {why}" for name, why in refused)
            + (f"; {len(step.unread)} file(s) left for the read budget" if step.unread else "")
            + ("; directory entries past the scan limit" if step.scan_truncated else "")
            + ". The rest of the table was read; such steps are counted, at most one note "
            f"per {NOTE_EVERY_S:g} s"
        )
        terms: dict[str, JsonValue] = {
            "bookings_dir": str(self.directory),
            "card_uuid": card_uuid,
            "cause": ",".join(causes),
            "files_refused": len(step.refused),
            "files_unread": len(step.unread),
            "scan_truncated": step.scan_truncated,
            "read_bytes": step.read_bytes,
            "read_s": round(step.spent_s, 6),
            "read_budget_bytes": self._foreign.budget_bytes,
            "read_budget_s": self._foreign.budget_s,
            "max_foreign_file_bytes": MAX_FOREIGN_FILE_BYTES,
            "max_directory_entries": MAX_DIRECTORY_ENTRIES,
            "skipped_steps": self._unnoted_steps,
        }
        self._unnoted_steps = 0
        # The caller (_apply, through _foreign_rows) holds self._lock.
        self._notes.append(TableNote(event="bookings_skipped", reason=reason, terms=terms))

    def _passed_over_message(self, cause: str, step: ForeignStep) -> str:
        """What the warning for a step passed over in part says, for ``cause``."""
        reader = self._foreign
        if cause == "refused":
            refused = _worst_first(step.refused)
            said = "; ".join(f"{self.directory / name}: {why}" for name, why in refused[:3])
            more = f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""
            return (
                f"other users' files in the shared booking table are not read, as no pool "
                f"writes them so: {said}{more}. Their rows count for nothing; the pool goes "
                "on with the rest of the table (each step that passes a file over is counted "
                "in statistics().bookings_skipped and bookings_skipped records)"
            )
        if cause == "budget":
            return (
                f"other users' files in the shared booking table {self.directory} took more "
                f"than the read budget of a step ({reader.budget_bytes} bytes, "
                f"{reader.budget_s} s); {len(step.unread)} were left unread for that "
                "step (their last rows stand in for them) and are read first at the next"
            )
        return (
            f"the shared booking table {self.directory} holds more than "
            f"{reader.max_entries} entries; only the first {reader.max_entries} are looked "
            "at for other users' files at each step. Remove what does not belong there"
        )

    def _stop(self, exc: _Unavailable) -> None:
        self._unavailable = str(exc)
        self._warn(exc.kind, str(exc))
        terms: dict[str, JsonValue] = {
            "bookings_dir": str(self.directory),
            "shared": self.shared,
            "cause": exc.kind,
        }
        with self._lock:
            self._notes.append(
                TableNote(event="bookings_unavailable", reason=str(exc), terms=terms)
            )

    def _path(self, card_uuid: str) -> Path:
        return self.directory / _file_name(card_uuid, self._uid if self.shared else None)

    # -- files -------------------------------------------------------------------------------

    def _lock_file(self, card_uuid: str) -> tuple[int, int, int]:
        """Take the thread lock and the card's file lock: the file's descriptor, the one
        locked, and the file's size (released by :meth:`_unlock_file`, only then)."""
        if self._pid != os.getpid():
            # A forked child: the inherited descriptors share the parent's flock.
            self._pid = os.getpid()
            self._uid = os.geteuid()
            self._lock = threading.Lock()
            self._fds = {}
            self._cache = {}
            self._memo = {}
            self._rows = {}
            self._own_start = None
            self._foreign = ForeignReader()
        self._lock.acquire()
        try:
            fd, lock_fd = self._open(card_uuid)
            _flock_or_busy(lock_fd)
            status = os.fstat(fd)
            if status.st_nlink == 0:
                # Someone removed the file while we held it open: open it afresh.
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
                for old in set(self._fds.pop(card_uuid)):
                    os.close(old)
                fd, lock_fd = self._open(card_uuid)
                _flock_or_busy(lock_fd)
                status = os.fstat(fd)
        except BaseException:
            self._lock.release()
            raise
        return fd, lock_fd, status.st_size

    def _unlock_file(self, lock_fd: int) -> None:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()

    def _open(self, card_uuid: str) -> tuple[int, int]:
        """This user's file for the card, and the descriptor to lock (the file itself in a
        private table; a lock file only this user can open in a shared one)."""
        pair = self._fds.get(card_uuid)
        if pair is not None:
            return pair
        dir_fd = self._dir_fd if self._dir_fd is not None else self._prepare()
        path = self._path(card_uuid)
        fd = self._open_own(path, SHARED_MODE if self.shared else PRIVATE_MODE, dir_fd)
        lock_fd = fd
        if self.shared:
            try:
                lock_fd = self._open_own(path.with_suffix(".lock"), PRIVATE_MODE, dir_fd)
            except BaseException:
                os.close(fd)
                raise
        self._fds[card_uuid] = (fd, lock_fd)
        return fd, lock_fd

    def _open_own(self, path: Path, mode: int, dir_fd: int) -> int:
        """This user's file ``path``, opened by its name in the table's directory ``dir_fd``."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(path.name, flags, mode, dir_fd=dir_fd)
        except OSError as exc:
            raise _Unavailable(
                f"the booking table file {path} cannot be opened for writing ({exc}); pools on "
                "this host will not see each other's bookings (each prices its cards by live "
                "readings alone). Pass bookings_dir= a writable directory, or "
                "share_bookings=False to silence this.",
                kind="open",
            ) from None
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise _Unavailable(
                    f"the booking table file {path} is not a regular file (mode "
                    f"{stat.filemode(status.st_mode)}); it is not used. Remove it, or pass "
                    "bookings_dir= a directory of your own.",
                    kind="foreign",
                )
            if status.st_uid != self._uid:
                raise _Unavailable(
                    f"the booking table file {path} is not this user's own file (owner uid "
                    f"{status.st_uid}); it is not used. Remove it, or pass bookings_dir= a "
                    "directory of your own.",
                    kind="foreign",
                )
            if stat.S_IMODE(status.st_mode) != mode:
                if stat.S_IMODE(status.st_mode) & ~mode & 0o077 and not self.shared:
                    raise _Unavailable(
                        f"the booking table file {path} is not private to this user (owner uid "
                        f"{status.st_uid}, mode {stat.S_IMODE(status.st_mode):o}); it is not "
                        "used. Remove it, or pass bookings_dir= a directory of your own.",
                        kind="foreign",
                    )
                os.fchmod(fd, mode)  # the umask narrowed it, or another version widened it
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _prepare(self) -> int:
        """Create the directory if missing, open it (no link followed), check that it is safe
        to use, and keep its descriptor."""
        directory = self.directory
        mode = 0o1777 if self.shared else 0o700
        try:
            directory.mkdir(mode=mode, parents=True)
            created = True
        except FileExistsError:
            created = False
        except OSError as exc:
            raise _Unavailable(
                f"the booking table directory {directory} cannot be created ({exc}); pools on "
                "this host will not see each other's bookings (each prices its cards by live "
                "readings alone). Pass bookings_dir= a writable directory, or "
                "share_bookings=False to silence this.",
                kind="directory",
            ) from None
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            dir_fd = os.open(directory, flags)
        except OSError as exc:
            linked = exc.errno in (errno.ELOOP, errno.ENOTDIR)  # a link, a file
            what = "is not a directory" if linked else f"cannot be opened ({exc})"
            raise _Unavailable(
                f"the booking table path {directory} {what}; pass bookings_dir= a directory.",
                kind="directory",
            ) from None
        try:
            if created and self.shared:
                os.fchmod(dir_fd, mode)  # the umask narrowed it
            status = os.fstat(dir_fd)
            refusal = directory_refusal(directory, status, shared=self.shared, uid=self._uid)
            if refusal is not None:
                raise _Unavailable(refusal, kind="foreign")
        except BaseException:
            os.close(dir_fd)
            raise
        self._dir_fd = dir_fd
        return dir_fd

    def _read(self, fd: int, size: int, card_uuid: str) -> dict[str, PoolBooking]:
        if size > MAX_FILE_BYTES:
            self._warn(
                f"large:{card_uuid}",
                f"the booking table file {self._path(card_uuid)} holds {size} bytes, more "
                f"than the {MAX_FILE_BYTES} read; it is not parsed, and is started afresh",
            )
            return {}
        data = os.pread(fd, size, 0) if size else b""
        cached = self._cache.get(card_uuid)
        if cached is not None and cached[0] == data:
            # The very bytes this handle last read or wrote (never judged by the file's
            # timestamps: two writes can share one): their rows, not parsed again.
            return dict(cached[1])
        try:
            pools = parse_booking_table(data, card_uuid=card_uuid)
        except ValueError as exc:
            # Written by another gpupool version, or damaged: start it afresh
            # (each live pool puts its row back at its next start, finish or heartbeat).
            self._warn(
                f"corrupt:{card_uuid}",
                f"the booking table file {self._path(card_uuid)} could not "
                f"be read ({exc}); it is started afresh",
            )
            pools = {}
        self._cache[card_uuid] = (data, dict(pools))
        return pools

    def _foreign_rows(
        self, card_uuid: str, now_s: float, total_bytes: int | None
    ) -> list[PoolBooking]:
        """In a shared table, the other users' believed rows for the card: each user's own
        file, read without its lock and within the step's budget
        (:mod:`gpupool._sensors.booking_foreign`), each row believed only under its writer's
        processes."""
        if not self.shared:
            return []
        checks = self._row_checks()
        prefix = _file_name(card_uuid)[: -len(".json")] + ".uid"
        assert self._dir_fd is not None  # opened by _open before any read

        def check(pools: dict[str, PoolBooking], uid: int) -> None:
            checks.keep(pools, owner_uid=uid, now_s=now_s, total_bytes=total_bytes)

        step = self._foreign.read(self._dir_fd, card_uuid, prefix, self._uid, check)
        if step.passed_over:
            self._passed_over(card_uuid, step)
        return step.rows

    def _others(
        self,
        card_uuid: str,
        pools: dict[str, PoolBooking],
        foreign: list[PoolBooking],
        pool_id: str | None,
    ) -> OtherPools:
        """The believed rows but ``pool_id``'s, oldest pool first: the last answer for the card
        again when its rows are the same objects (a pass that finds the file's text as it was
        builds nothing)."""
        rows = [row for key, row in pools.items() if key != pool_id]
        rows.extend(foreign)
        memo = self._memo.get(card_uuid)
        if (
            memo is not None
            and len(memo[0]) == len(rows)
            and all(a is b for a, b in zip(memo[0], rows, strict=True))
        ):
            return memo[
                1
            ]  # the very row objects (compared by identity: a value compare costs more)
        answer = OtherPools(
            card_uuid=card_uuid, pools=tuple(sorted(rows, key=lambda row: (row.pid, row.pool_id)))
        )
        self._memo[card_uuid] = (rows, answer)
        return answer

    def _own_start_token(self) -> str:
        if self._own_start is None:
            self._own_start = read_start_token(os.getpid()) or ""
        return self._own_start

    def _warn(self, kind: str, message: str) -> None:
        """Say ``message`` once per process, directory and kind: on the ``gpupool`` logger,
        and as a ``RuntimeWarning`` that is seen where logging is not configured."""
        key = (str(self.directory), kind)
        if key in _WARNED:
            return
        _WARNED.add(key)
        LOGGER.warning("gpupool: %s", message)
        try:
            warnings.warn(f"gpupool: {message}", RuntimeWarning, stacklevel=2)
        except Exception:  # warnings turned into errors must not break the pool
            pass


def _worst_first(refused: dict[str, str]) -> list[tuple[str, str]]:
    """Refused files by name, those refused for what they hold before those refused for
    their name alone (a hard link's other spellings)."""
    return sorted(refused.items(), key=lambda item: (item[1].startswith("its name"), item[0]))


def _flock_or_busy(fd: int) -> None:
    if not flock_within(fd, LOCK_WAIT_S):
        raise _Busy


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
