"""The host-wide booking table: every pool's bookings on every card, in small files (I/O edge).

A pool's census and its live readings see what other processes *hold*; they
cannot see what another pool on the same card has *booked* and not yet
reached. So every pool writes its bookings to a table that every gpupool
process of the host can read::

    pool A (train.py)                 /dev/shm/gpupool-<uid>/            pool B (eval.py)
    start / finish a task  --publish-> GPU-<uuid>.json  <-publish--  start / finish a task
    before a start         <--others--   (one file per card,  --others->  before a start
                                          flock, 0600)

One file per card UUID. One operation is one read-modify-write under an
exclusive ``flock`` (plus a thread lock: ``flock`` does not exclude two
threads sharing one descriptor), written in place so that a process killed at
any instant leaves the old text or the new one. Every operation first drops
the rows of pools whose process has exited (zombies included) or whose PID
now names another process (the start time differs), so a pool that was
killed stops counting at the next read by anyone.

Where the table cannot be kept (no ``/dev/shm``, a read-only filesystem, a
directory that is not private), every operation answers ``None`` ("unknown")
and the ``gpupool`` logger says why once per process and directory; a pool
then falls back on its live gate alone and never fails for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from gpupool._core.bookings import (
    OtherPools,
    PoolBooking,
    TaskBooking,
    format_booking_table,
    parse_booking_table,
)
from gpupool._log import LOGGER

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from gpupool._sensors.base import Sensor

__all__ = [
    "BOOKINGS_ENV",
    "BookingTable",
    "default_bookings_directory",
    "new_pool_id",
    "open_booking_table",
    "read_start_token",
]

#: A directory to keep the table in, for every pool of this process and its
#: children that is not given one (e.g. a directory that several containers mount).
BOOKINGS_ENV = "GPUPOOL_BOOKINGS"

#: File mode of a private table (this user's pools only) and of a shared one.
PRIVATE_MODE = 0o600
SHARED_MODE = 0o666

_T = TypeVar("_T")

#: (directory, kind) pairs this process has already warned about.
_WARNED: set[tuple[str, str]] = set()

_POOL_NUMBERS = itertools.count(1)


def new_pool_id() -> str:
    """A pool id unique among the live pools of the host: ``"<pid>.<n>"``."""
    return f"{os.getpid()}.{next(_POOL_NUMBERS)}"


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


def _program_label() -> str:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return Path(argv0).name or Path(sys.executable).name


def _file_name(card_uuid: str) -> str:
    """``<uuid>.json``, each character outside ``[A-Za-z0-9-]`` (MIG names hold ``/``) as ``_``."""
    safe = "".join(c if (c.isascii() and (c.isalnum() or c == "-")) else "_" for c in card_uuid)
    return f"{safe}.json"


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
            user's pools share it (files 0666).

    Every method answers ``None`` when the table cannot be kept here (the
    ``gpupool`` logger says why, once per process and directory); none raises
    for the filesystem.
    """

    def __init__(self, directory: str | os.PathLike[str], *, shared: bool = False) -> None:
        self.directory = Path(directory)
        self.shared = bool(shared)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._fds: dict[str, int] = {}
        # Per card: the file's text as this handle last read or wrote it, its
        # rows, and the encoded text of each row (so an unchanged file is not
        # parsed again, and an unchanged row not encoded again).
        self._cache: dict[str, tuple[bytes, dict[str, PoolBooking]]] = {}
        self._fragments: dict[str, dict[int, tuple[PoolBooking, str]]] = {}
        self._prepared = False
        self._unavailable: str | None = None
        self._own_start: str | None = None
        self._label = _program_label()

    def __repr__(self) -> str:
        mode = "shared" if self.shared else "private"
        return f"<BookingTable {str(self.directory)!r} {mode}>"

    @property
    def unavailable_reason(self) -> str | None:
        """Why the table cannot be kept here, once an operation has found out; else ``None``."""
        return self._unavailable

    # -- operations ----------------------------------------------------------------------

    def publish(self, card_uuid: str, pool_id: str, tasks: Sequence[TaskBooking]) -> bool:
        """Replace ``pool_id``'s row on ``card_uuid`` with its running ``tasks``.

        Returns:
            Whether the row was written (``False``: the table is unavailable).
        """
        return self.exchange(card_uuid, pool_id, tasks) is not None

    def withdraw(self, card_uuid: str, pool_id: str) -> bool:
        """Remove ``pool_id``'s row from ``card_uuid`` (the pool is shutting down).

        Returns:
            Whether the table was reached.
        """

        def change(pools: dict[str, PoolBooking]) -> bool:
            return pools.pop(pool_id, None) is not None

        return self._apply(card_uuid, change) is not None

    def others(self, card_uuid: str, pool_id: str | None = None) -> OtherPools | None:
        """Every live pool's row on ``card_uuid`` except ``pool_id``'s (``None``: all of them).

        Returns:
            The rows, oldest pool first; ``None`` when the table is unavailable
            ("unknown": price the card by its live readings alone).
        """

        def change(pools: dict[str, PoolBooking]) -> OtherPools:
            return _others(card_uuid, pools, pool_id)

        return self._apply(card_uuid, change)

    def exchange(
        self,
        card_uuid: str,
        pool_id: str,
        tasks: Sequence[TaskBooking],
        waiting: int = 0,
        need_bytes: int = 0,
    ) -> OtherPools | None:
        """Publish ``pool_id``'s ``tasks`` (and how many of its tasks wait for room, and the
        first one's ask) and read the other pools' rows, in one locked step."""
        booked = tuple(tasks)

        def change(pools: dict[str, PoolBooking]) -> OtherPools:
            pools[pool_id] = PoolBooking(
                pool_id=pool_id,
                pid=os.getpid(),
                start=self._own_start_token(),
                label=self._label,
                updated_s=time.time(),
                tasks=booked,
                waiting=waiting,
                need_bytes=need_bytes,
            )
            return _others(card_uuid, pools, pool_id)

        return self._apply(card_uuid, change, writes=True)

    def close(self) -> None:
        """Close this handle's files (reopened on the next operation)."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- the locked read-modify-write ------------------------------------------------------

    def _apply(
        self,
        card_uuid: str,
        change: Callable[[dict[str, PoolBooking]], _T],
        *,
        writes: bool = False,
    ) -> _T | None:
        """Run ``change`` on the card's live rows under the lock; ``None`` when unavailable.

        The rows are written back when ``writes`` is true, when ``change``
        returned ``True``, or when a dead pool's row was dropped.
        """
        if self._unavailable is not None:
            return None
        try:
            with self._locked(card_uuid) as (fd, size):
                pools = self._read(fd, size, card_uuid)
                pruned = _drop_dead(pools, os.getpid(), self._own_start_token())
                result = change(pools)
                if writes or pruned or result is True:
                    fragments = self._fragments.setdefault(card_uuid, {})
                    data = format_booking_table(card_uuid, list(pools.values()), fragments)
                    _write(fd, data, size)
                    self._cache[card_uuid] = (data, dict(pools))
                return result
        except _Unavailable as exc:
            self._unavailable = str(exc)
            self._warn(exc.kind, str(exc))
            return None
        except OSError as exc:
            # A failure of one operation (a full /dev/shm, an I/O error): this
            # answer is unknown; the next operation tries again.
            self._warn(
                f"io:{exc.errno}",
                f"the booking table in {self.directory} could not be read or written "
                f"({exc}); pools on this host may not see each other's bookings while it fails",
            )
            return None

    @contextlib.contextmanager
    def _locked(self, card_uuid: str) -> Iterator[tuple[int, int]]:
        if self._pid != os.getpid():
            # A forked child: the inherited descriptors share the parent's flock.
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._fds = {}
            self._cache = {}
            self._own_start = None
        with self._lock:
            fd = self._open(card_uuid)
            fcntl.flock(fd, fcntl.LOCK_EX)
            status = os.fstat(fd)
            if status.st_nlink == 0:
                # Someone removed the file while we held it open: open it afresh.
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(self._fds.pop(card_uuid))
                fd = self._open(card_uuid)
                fcntl.flock(fd, fcntl.LOCK_EX)
                status = os.fstat(fd)
            try:
                yield fd, status.st_size
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _open(self, card_uuid: str) -> int:
        fd = self._fds.get(card_uuid)
        if fd is not None:
            return fd
        if not self._prepared:
            self._prepare()
        path = self.directory / _file_name(card_uuid)
        mode = SHARED_MODE if self.shared else PRIVATE_MODE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
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
            if self.shared:
                if status.st_uid == os.geteuid() and stat.S_IMODE(status.st_mode) != SHARED_MODE:
                    os.fchmod(fd, SHARED_MODE)  # the umask narrowed it
            elif status.st_uid != os.geteuid() or status.st_mode & 0o077:
                raise _Unavailable(
                    f"the booking table file {path} is not private to this user (owner uid "
                    f"{status.st_uid}, mode {stat.S_IMODE(status.st_mode):o}); it is not used. "
                    "Remove it, or pass bookings_dir= a directory of your own.",
                    kind="foreign",
                )
        except BaseException:
            os.close(fd)
            raise
        self._fds[card_uuid] = fd
        return fd

    def _prepare(self) -> None:
        """Create the directory if missing and check that it is safe to use."""
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
        try:
            status = directory.lstat()
            if created and self.shared:
                os.chmod(directory, mode)  # the umask narrowed it
        except OSError as exc:
            raise _Unavailable(
                f"the booking table directory {directory} cannot be read ({exc})", kind="directory"
            ) from None
        if not stat.S_ISDIR(status.st_mode):
            raise _Unavailable(
                f"the booking table path {directory} is not a directory; pass bookings_dir= "
                "a directory.",
                kind="directory",
            )
        if not self.shared and (
            status.st_uid != os.geteuid() or stat.S_IMODE(status.st_mode) & 0o022
        ):
            raise _Unavailable(
                f"the booking table directory {directory} is not private to this user (owner "
                f"uid {status.st_uid}, mode {stat.S_IMODE(status.st_mode):o}); it is not used. "
                "Pass bookings_dir= a directory of your own, or share_bookings='host' for a "
                "table shared by every user.",
                kind="foreign",
            )
        self._prepared = True

    def _read(self, fd: int, size: int, card_uuid: str) -> dict[str, PoolBooking]:
        data = os.pread(fd, size, 0) if size else b""
        cached = self._cache.get(card_uuid)
        if cached is not None and cached[0] == data.rstrip():
            # Unchanged since this handle last read or wrote it: parsing costs
            # more than the whole locked step otherwise.
            return dict(cached[1])
        try:
            pools = parse_booking_table(data, card_uuid=card_uuid)
            self._cache[card_uuid] = (data.rstrip(), dict(pools))
            return pools
        except ValueError as exc:
            # Written by another gpupool version, or damaged: start it afresh
            # (each live pool puts its row back at its next start or finish).
            self._warn(
                f"corrupt:{card_uuid}",
                f"the booking table file {self.directory / _file_name(card_uuid)} could not "
                f"be read ({exc}); it is started afresh",
            )
            return {}

    def _own_start_token(self) -> str:
        if self._own_start is None:
            self._own_start = read_start_token(os.getpid()) or ""
        return self._own_start

    def _warn(self, kind: str, message: str) -> None:
        key = (str(self.directory), kind)
        if key in _WARNED:
            return
        _WARNED.add(key)
        LOGGER.warning("gpupool: %s", message)


def _others(card_uuid: str, pools: dict[str, PoolBooking], pool_id: str | None) -> OtherPools:
    rows = sorted(
        (row for key, row in pools.items() if key != pool_id),
        key=lambda row: (row.pid, row.pool_id),
    )
    return OtherPools(card_uuid=card_uuid, pools=tuple(rows))


def _drop_dead(pools: dict[str, PoolBooking], own_pid: int, own_start: str) -> bool:
    """Drop the rows of pools whose process exited or whose PID was reused; whether any was."""
    tokens: dict[int, str | None] = {own_pid: own_start}  # this process is alive
    dead = []
    for key, row in pools.items():
        if row.pid not in tokens:
            tokens[row.pid] = read_start_token(row.pid)
        if tokens[row.pid] != row.start:
            dead.append(key)
    for key in dead:
        del pools[key]
    return bool(dead)


def _write(fd: int, data: bytes, size: int) -> None:
    """Overwrite the file in place, valid at every instant.

    The new text is padded with spaces to the old length (JSON ignores
    trailing whitespace) and written with one ``pwrite``, so a process
    killed at any point leaves the old text or the new; then the file is
    cut to the new length.
    """
    padded = data.ljust(size)
    written = os.pwrite(fd, padded, 0)
    while written < len(padded):  # only on a full disk or an odd filesystem
        written += os.pwrite(fd, padded[written:], written)
    if len(data) < size:
        os.ftruncate(fd, len(data))


def open_booking_table(
    *,
    share: bool | str,
    directory: str | os.PathLike[str] | None,
    sensor: Sensor,
) -> BookingTable | None:
    """The table a pool with these options uses, or ``None`` when sharing is off.

    Where it lives, first that applies: ``directory``; the simulated host's
    own directory when ``sensor`` reads one, or inside a ``SimulatedHost``
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
    from gpupool._sensors.select import SIMULATOR_ENV
    from gpupool._sensors.simulated import BOOKINGS_DIRECTORY, SimulatedSensor

    if isinstance(sensor, SimulatedSensor):
        return BookingTable(sensor.bookings_directory, shared=shared)
    ledger = os.environ.get(SIMULATOR_ENV)
    if ledger:
        return BookingTable(Path(ledger).parent / BOOKINGS_DIRECTORY, shared=shared)
    override = os.environ.get(BOOKINGS_ENV)
    if override:
        return BookingTable(override, shared=shared)
    return BookingTable(default_bookings_directory(shared=shared), shared=shared)
