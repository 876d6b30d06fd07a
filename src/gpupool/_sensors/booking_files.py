"""This user's files of the host-wide booking table, and their locks (I/O edge).

One room of :class:`~gpupool._sensors.bookings.BookingTable`: the table's
directory, opened once and checked safe to use (no link followed, not
writable by others unless shared and sticky); this user's file per card,
opened by its name in that directory and refused unless a regular file of
this user's with the table's mode; and the locks one operation holds (a
thread lock, since ``flock`` does not exclude two threads sharing one
descriptor, and the file's ``flock``, taken with a bounded wait). What the
files say is :class:`~gpupool._sensors.booking_texts.CardTexts`'s.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
from pathlib import Path

from gpupool._sensors.booking_rows import directory_refusal, flock_within

__all__ = ["LOCK_WAIT_S", "PRIVATE_MODE", "SHARED_MODE", "TableFiles"]

#: File mode of a private table (this user's pools only) and of this user's file in a
#: shared one (read by every user, written by this one).
PRIVATE_MODE = 0o600
SHARED_MODE = 0o644

#: How long an operation waits for the file's lock before it passes the table over.
LOCK_WAIT_S = 0.5


def _file_name(card_uuid: str, uid: int | None = None) -> str:
    """``<uuid>.json`` (a private table) or ``<uuid>.uid<N>.json`` (user N's file in a shared
    one), each character outside ``[A-Za-z0-9-]`` (MIG names hold ``/``) as ``_``."""
    safe = "".join(c if (c.isascii() and (c.isalnum() or c == "-")) else "_" for c in card_uuid)
    return f"{safe}.json" if uid is None else f"{safe}.uid{uid}.json"


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


class TableFiles:
    """This user's files of the table in ``directory``, and the locks of one operation.

    Its fields are written here only; the table reads :attr:`directory`,
    :attr:`shared`, :attr:`uid`, :attr:`dir_fd` and :attr:`lock`.
    """

    def __init__(self, directory: str | os.PathLike[str], *, shared: bool) -> None:
        self.directory = Path(directory)
        self.shared = bool(shared)
        self.lock = threading.Lock()
        self.uid = os.geteuid()
        self._fds: dict[str, tuple[int, int]] = {}
        # The directory, opened once; every file is opened in it (a link later put in
        # place of a directory above it cannot redirect the table).
        self.dir_fd: int | None = None

    def leave_parent(self) -> None:
        """In a forked child: the inherited descriptors share the parent's flock, and the
        thread lock may have been held by another thread at the fork."""
        self.uid = os.geteuid()
        self.lock = threading.Lock()
        self._fds = {}

    def path(self, card_uuid: str) -> Path:
        """This user's file for the card."""
        return self.directory / _file_name(card_uuid, self.uid if self.shared else None)

    def close(self) -> None:
        """Close this handle's files and directory (reopened on the next operation)."""
        with self.lock:
            fds, self._fds = self._fds, {}
            dir_fd, self.dir_fd = self.dir_fd, None
        kept = {fd for pair in fds.values() for fd in pair}
        for fd in kept if dir_fd is None else kept | {dir_fd}:
            with contextlib.suppress(OSError):
                os.close(fd)

    def lock_file(self, card_uuid: str) -> tuple[int, int, int]:
        """Take the thread lock and the card's file lock: the file's descriptor, the one
        locked, and the file's size (released by :meth:`unlock_file`, only then).

        In a forked child, the table first has this room :meth:`leave_parent`."""
        self.lock.acquire()
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
            self.lock.release()
            raise
        return fd, lock_fd, status.st_size

    def unlock_file(self, lock_fd: int) -> None:
        """Give back the locks :meth:`lock_file` took."""
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
        finally:
            self.lock.release()

    def _open(self, card_uuid: str) -> tuple[int, int]:
        """This user's file for the card, and the descriptor to lock (the file itself in a
        private table; a lock file only this user can open in a shared one)."""
        pair = self._fds.get(card_uuid)
        if pair is not None:
            return pair
        dir_fd = self.dir_fd if self.dir_fd is not None else self._prepare()
        path = self.path(card_uuid)
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
            if status.st_uid != self.uid:
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
            refusal = directory_refusal(directory, status, shared=self.shared, uid=self.uid)
            if refusal is not None:
                raise _Unavailable(refusal, kind="foreign")
        except BaseException:
            os.close(dir_fd)
            raise
        self.dir_fd = dir_fd
        return dir_fd


def _flock_or_busy(fd: int) -> None:
    if not flock_within(fd, LOCK_WAIT_S):
        raise _Busy
