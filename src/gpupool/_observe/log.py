"""Decision records to the ``gpupool`` logger, a JSON Lines file, and memory.

The log grows with decisions, not with tasks: a pool that runs 100,000
tasks at one width writes a handful of records.

The file (``log_path``):

* is opened with ``O_NOFOLLOW``: a symbolic link at ``log_path`` is refused,
  never followed (a link planted by another user cannot redirect the log),
  and anything but a regular file (a device, a FIFO) is refused;
* is created ``0600`` (an existing file keeps its mode); an existing file
  another user owns, or one group or others can write, is refused (checked
  with ``fstat`` on the opened descriptor): its owner, or anyone who can
  write it, could add records ``gpupool postmortem`` would report;
* is opened, and reopened, in the directory ``log_path`` named when the run
  started (a descriptor of it is kept): a directory above it that another
  user renames and replaces with a link cannot redirect the log;
* is compared with the file at ``log_path`` at most once a second
  (:data:`CHECK_EVERY_S`) and at close: a file deleted during the run is
  warned about once, the records in it are counted as write errors, and the
  log goes on in a new file (a moved file: the same, nothing counted);
* is appended to, one ``os.write`` per record, with no buffer: a record is
  on disk, or counted as not written;
* opens each run with a ``run_started`` record, and every record carries the
  run's ``run_id``, so a file appended by two pools reads as two runs.

A write that fails (a full disk, ``EFBIG`` past a file-size limit, an I/O
error) never reaches the pool: the first failure is reported once (a
``RuntimeWarning`` and a ``WARNING`` on the logger),
the file is closed (no descriptor is kept), and every record from then on is
counted in :attr:`DecisionLog.write_errors` and kept in memory only.

The ``gpupool`` logger has a :class:`logging.NullHandler`: a program that
configures no logging sees nothing. Levels: ``WARNING`` for what a user must
act on (:data:`WARNING_EVENTS`), ``INFO`` for every other decision. Messages
are short (``"gpupool narrowed: device 0 width 4 -> 2"``); the record's
terms are on the :class:`logging.LogRecord` as ``gpupool`` (the
:class:`~gpupool.Decision`) and ``gpupool_record`` (its JSON dict).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import stat
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path

from gpupool._core.events import Decision, JsonValue, run_record, truncate_text
from gpupool._errors import ConfigurationError

__all__ = [
    "LOGGER",
    "REASON_CHARS",
    "SAMPLE_EVENTS",
    "WARNING_EVENTS",
    "DecisionLog",
    "check_log_path",
    "level_for",
    "new_run_id",
]

LOGGER = logging.getLogger("gpupool")
LOGGER.addHandler(logging.NullHandler())

#: Events a user must act on: a card ran out, a task started past the bound
#: (the serial floor), a fixed width wider than the bound, a key whose peaks
#: vary a lot (give its tasks ``size=`` or keys of their own). Every other
#: event is ``INFO``.
WARNING_EVENTS = frozenset(
    {"out_of_memory", "serial_start", "fixed_width_over_bound", "peaks_vary", "unexplained_memory"}
)

#: Records that are samples, not decisions: not the pool's "last decision".
SAMPLE_EVENTS = frozenset({"card_read"})

#: The most characters of a record's ``reason`` the file keeps (the sentence
#: can quote an exception's message; see ``ERROR_TEXT_CHARS`` for the rest).
REASON_CHARS = 1000

_OPEN_FLAGS = (
    os.O_WRONLY
    | os.O_APPEND
    | os.O_CREAT
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NONBLOCK", 0)
)
_FILE_MODE = 0o600

#: How often, at most, the file at ``log_path`` is compared with the open
#: descriptor (two ``stat`` calls before a write): a log deleted or replaced
#: during the run is found within a second of its next record, and at close.
CHECK_EVERY_S = 1.0


def level_for(event: str) -> int:
    """The logging level of a record: ``WARNING`` for :data:`WARNING_EVENTS`, else ``INFO``."""
    return logging.WARNING if event in WARNING_EVENTS else logging.INFO


def new_run_id(now_s: float | None = None) -> str:
    """A run id: the UTC start time and 12 random hex digits (``20260101T120000Z-3f2a...``)."""
    started = time.gmtime(time.time() if now_s is None else now_s)
    return time.strftime("%Y%m%dT%H%M%SZ", started) + "-" + uuid.uuid4().hex[:12]


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _user(uid: int) -> str:
    try:
        import pwd

        return f" ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return ""


def _not_ours(st: os.stat_result, shown: str) -> str | None:
    """Why the opened file is not this user's own log to append to, or ``None``."""
    euid = os.geteuid() if hasattr(os, "geteuid") else st.st_uid
    if st.st_uid != euid:
        return (
            f"log_path={shown!r} is owned by uid {st.st_uid}{_user(st.st_uid)}, not by this "
            f"process's user (uid {euid}{_user(euid)}): its owner could read the log and add "
            "records that gpupool postmortem would report as this pool's. Pass a path of your "
            "own (a new file is created 0600), or remove that file first."
        )
    if st.st_mode & 0o022:
        who = " and ".join(
            name for bit, name in ((0o020, "group"), (0o002, "others")) if st.st_mode & bit
        )
        return (
            f"log_path={shown!r} has mode {stat.S_IMODE(st.st_mode):04o}: writable by {who}, "
            "who could add records that gpupool postmortem would report as this pool's. "
            f"Run chmod go-w {shown}, or pass a new path (a new file is created 0600)."
        )
    return None


def _linked(st: os.stat_result, shown: str) -> str | None:
    """Why a file with more than one name (a hard link) is not appended to, or ``None``."""
    if st.st_nlink <= 1:
        return None
    return (
        f"log_path={shown!r} has {st.st_nlink} links: it is a hard link, and the records "
        "would go into the file behind its other names too. Pass a path of its own (a new "
        "file is created 0600), or remove the other links first."
    )


def _open_directory(path: Path) -> int | None:
    """A descriptor of the directory ``path`` is in (where ``open`` takes ``dir_fd``), so
    that the log is reopened in that very directory: a link another user puts in place of a
    directory above it later cannot redirect it."""
    if os.open not in os.supports_dir_fd:
        return None
    flags = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        return os.open(path.parent if str(path.parent) else Path("."), flags)
    except OSError:
        return None


def _open_log(path: Path, shown: str, dir_fd: int | None = None) -> int:
    """Open ``path`` for appending (its name in ``dir_fd`` when given): no symlink followed,
    a regular file of this user's with one name that group and others cannot write,
    created 0600."""
    try:
        if dir_fd is None:
            fd = os.open(path, _OPEN_FLAGS, _FILE_MODE)
        else:
            fd = os.open(path.name, _OPEN_FLAGS, _FILE_MODE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigurationError(
                f"log_path={shown!r} is a symbolic link; gpupool does not follow a link it "
                "did not create. Pass the link's target, or a new path."
            ) from None
        if exc.errno == errno.ENXIO:
            raise ConfigurationError(
                f"log_path={shown!r} is a FIFO with no reader; pass a regular file path."
            ) from None
        raise ConfigurationError(
            f"log_path={shown!r} cannot be written ({exc.strerror}); "
            "pass a path in a writable directory."
        ) from None
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise ConfigurationError(
                f"log_path={shown!r} is {_kind(opened.st_mode)}, not a regular file; pass a "
                "file path such as run.jsonl (or log_path=None for no file)."
            )
        problem = _not_ours(opened, shown) or _linked(opened, shown)
        if problem is not None:
            raise ConfigurationError(problem)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_log_path(log_path: str | os.PathLike[str]) -> Path:
    """Validate ``log_path`` at construction: a regular file (or none yet) in a writable directory.

    Raises:
        ConfigurationError: naming the path and what is wrong with it (no such
            directory, a directory, a symbolic link, a device or FIFO such as
            ``/dev/full``, not writable, another user's file, a file group or
            others can write, a file with more than one hard link).
    """
    if not isinstance(log_path, (str, os.PathLike)):
        raise ConfigurationError(
            f"log_path={log_path!r}: pass a file path (str or os.PathLike), or None."
        )
    shown = os.fspath(log_path)
    if not isinstance(shown, str) or not shown or "\0" in shown:
        raise ConfigurationError(f"log_path={shown!r}: pass a non-empty file path.")
    path = Path(shown)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigurationError(
            f"log_path={shown!r}: the directory {str(parent)!r} does not exist; "
            "create it or pass a path in an existing directory."
        )
    if path.is_dir() and not path.is_symlink():
        raise ConfigurationError(
            f"log_path={shown!r} is a directory; pass a file path such as run.jsonl."
        )
    os.close(_open_log(path, shown))
    return path


class DecisionLog:
    """Keeps every decision; writes each to the logger and, if asked, a JSON Lines file.

    Args:
        path: a JSON Lines file to append to (checked by :func:`check_log_path`),
            or ``None``.
        settings: the pool's settings, written into the run's ``run_started``
            record (JSON scalars; sizes in bytes, named ``*_bytes``).
        run_id: the run's id (default: :func:`new_run_id`).
        check_every_s: how often, at most, the file at ``path`` is checked to
            still be the one written to (:data:`CHECK_EVERY_S`).

    Attributes:
        run_id: the id every record of this run carries.
        path: the file, or ``None``.
    """

    def __init__(
        self,
        path: Path | None = None,
        *,
        settings: Mapping[str, JsonValue] | None = None,
        run_id: str | None = None,
        check_every_s: float = CHECK_EVERY_S,
    ) -> None:
        self.run_id = run_id or new_run_id()
        self._check_every_s = check_every_s
        self._checked_at_s = time.monotonic()
        self._in_file = 0  # records written to the file the descriptor holds
        self._header: dict[str, JsonValue] = {}
        self._warned_gone = False
        self.path = path
        self._records: list[Decision] = []
        self._last: Decision | None = None
        self._lock = threading.Lock()
        self._write_errors = 0
        self._closed = False
        self._fd: int | None = None
        self._dir_fd: int | None = None
        if path is not None:
            self._dir_fd = _open_directory(path)
            try:
                self._fd = _open_log(path, str(path), self._dir_fd)
            except BaseException:
                self._close_directory()
                raise
            from gpupool import __version__

            header = run_record(
                run_id=self.run_id,
                started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                pid=os.getpid(),
                gpupool_version=__version__,
                settings={
                    "python": ".".join(str(v) for v in sys.version_info[:3]),
                    **(settings or {}),
                },
            )
            self._header = dict(header)
            with self._lock:
                self._write_line(header)

    @property
    def last_decision(self) -> Decision | None:
        """The latest record that is a decision (not a sample such as ``card_read``)."""
        with self._lock:
            return self._last

    @property
    def write_errors(self) -> int:
        """Records that could not be written to the file (0 without a file)."""
        with self._lock:
            return self._write_errors

    def append(self, decision: Decision) -> None:
        """Record one decision: in memory, to the file (if any), to the ``gpupool`` logger."""
        decision = dataclasses.replace(decision, run_id=self.run_id)
        with self._lock:
            self._records.append(decision)
            if decision.event not in SAMPLE_EVENTS:
                self._last = decision
            if self.path is not None and not self._closed:
                record = decision.to_dict()
                record["reason"] = truncate_text(decision.reason, REASON_CHARS)
                self._write_line(record)
        self._emit(decision)

    def _emit(self, decision: Decision) -> None:
        level = level_for(decision.event)
        if not LOGGER.isEnabledFor(level):
            return
        where = "pool" if decision.device is None else f"device {decision.device}"
        width = ""
        if decision.width_after is not None:
            before = "" if decision.width_before is None else f"{decision.width_before} -> "
            width = f" width {before}{decision.width_after}"
        key = f" key {decision.key}" if decision.key else ""
        LOGGER.log(
            level,
            "gpupool %s: %s%s%s",
            decision.event,
            where,
            width,
            key,
            extra={"gpupool": decision, "gpupool_record": decision.to_dict()},
        )

    def _write_line(self, record: Mapping[str, JsonValue]) -> None:
        """Write one record (the lock held); a failure closes the file and is counted."""
        if self._fd is None:
            if not self._closed:
                self._write_errors += 1
            return
        now_s = time.monotonic()
        if now_s - self._checked_at_s >= self._check_every_s:
            self._check_file(now_s, reopen=True)
            if self._fd is None:
                self._write_errors += 1
                return
        self._put(record)

    def _put(self, record: Mapping[str, JsonValue]) -> None:
        """Write one record to the open descriptor (the lock held)."""
        assert self._fd is not None
        data = (json.dumps(dict(record), sort_keys=False) + "\n").encode("utf-8")
        try:
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            self._in_file += 1
        except OSError as exc:
            self._write_errors += 1
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)
            self._close_directory()  # nothing is written from now on
            message = (
                f"gpupool: the decision log {self.path} cannot be written "
                f"({exc.strerror or exc}); the pool goes on, its records are kept in "
                "memory only (pool.decisions) and counted as log write errors"
            )
            self._warn(message)  # once: the file is closed from now on

    def _check_file(self, now_s: float, *, reopen: bool) -> None:
        """Is the file at ``path`` still the one the descriptor writes to (the lock held)?

        Deleted (its link count is 0): every record written to it is counted as
        a write error. Deleted, moved or replaced: the descriptor is closed, a
        warning says so (once a run) and, with ``reopen``, the log goes on in a
        new file at ``path`` (checked as at construction), opened by the run's
        ``run_started`` record again.
        """
        self._checked_at_s = now_s
        assert self._fd is not None and self.path is not None
        held = os.fstat(self._fd)
        try:
            found: os.stat_result | None = (
                os.stat(self.path, follow_symlinks=False)
                if self._dir_fd is None
                else os.stat(self.path.name, dir_fd=self._dir_fd, follow_symlinks=False)
            )
        except OSError:
            found = None
        same = found is not None and (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)
        if same and held.st_nlink > 0:
            return
        deleted = held.st_nlink == 0
        if deleted:
            self._write_errors += self._in_file
        what = (
            f"was deleted during the run ({self._in_file} records were in the deleted file; "
            "counted as log write errors)"
            if deleted
            else "was moved or replaced during the run (its records stay in the moved file)"
        )
        fd, self._fd = self._fd, None
        self._in_file = 0
        with contextlib.suppress(OSError):
            os.close(fd)
        then = "found as the pool shut down: nothing more is written (pool.decisions has all)"
        if reopen:
            try:
                self._fd = _open_log(self.path, str(self.path), self._dir_fd)
                self._put(self._header)
                then = f"the log goes on in a new file at {self.path}"
            except ConfigurationError as exc:
                self._close_directory()
                then = (
                    f"a new file cannot be opened there ({exc}); the records from now on are "
                    "kept in memory only (pool.decisions) and counted as log write errors"
                )
        if not self._warned_gone:
            self._warned_gone = True
            self._warn(f"gpupool: the decision log {self.path} {what}; {then}")

    def _warn(self, message: str) -> None:
        LOGGER.warning(message)
        try:
            # Seen even where logging is not configured.
            warnings.warn(message, RuntimeWarning, stacklevel=4)
        except Exception:  # warnings turned into errors must not break the pool
            pass

    def records(self) -> tuple[Decision, ...]:
        """Every decision so far, oldest first."""
        with self._lock:
            return tuple(self._records)

    def close(self) -> None:
        """Close the file, if any. Idempotent."""
        with self._lock:
            if self._fd is not None:
                self._check_file(time.monotonic(), reopen=False)
            fd, self._fd = self._fd, None
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._close_directory()
            # Records appended after close are kept in memory and not counted.
            self._closed = True

    def _close_directory(self) -> None:
        dir_fd, self._dir_fd = self._dir_fd, None
        if dir_fd is not None:
            with contextlib.suppress(OSError):
                os.close(dir_fd)
