"""Decision records to the ``gpupool`` logger, a JSON Lines file, and memory.

The log grows with decisions, not with tasks: a pool that runs 100,000
tasks at one width writes a handful of records.

The file (``log_path``):

* is opened with ``O_NOFOLLOW``: a symbolic link at ``log_path`` is refused,
  never followed (a link planted by another user cannot redirect the log),
  and anything but a regular file (a device, a FIFO) is refused;
* is created ``0600`` (an existing file keeps its mode);
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
    "WARNING_EVENTS",
    "DecisionLog",
    "check_log_path",
    "level_for",
    "new_run_id",
]

LOGGER = logging.getLogger("gpupool")
LOGGER.addHandler(logging.NullHandler())

#: Events a user must act on: a card ran out, a task started past the bound
#: (the serial floor), a fixed width wider than the bound. Every other event
#: is ``INFO``.
WARNING_EVENTS = frozenset({"out_of_memory", "serial_start", "fixed_width_over_bound"})

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


def _open_log(path: Path, shown: str) -> int:
    """Open ``path`` for appending: no symlink followed, a regular file, created 0600."""
    try:
        fd = os.open(path, _OPEN_FLAGS, _FILE_MODE)
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
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigurationError(
                f"log_path={shown!r} is {_kind(mode)}, not a regular file; pass a file "
                "path such as run.jsonl (or log_path=None for no file)."
            )
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
            ``/dev/full``, not writable).
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
    ) -> None:
        self.run_id = run_id or new_run_id()
        self.path = path
        self._records: list[Decision] = []
        self._lock = threading.Lock()
        self._write_errors = 0
        self._closed = False
        self._fd: int | None = None
        if path is not None:
            self._fd = _open_log(path, str(path))
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
            with self._lock:
                self._write_line(header)

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
        data = (json.dumps(dict(record), sort_keys=False) + "\n").encode("utf-8")
        try:
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError as exc:
            self._write_errors += 1
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)
            message = (
                f"gpupool: the decision log {self.path} cannot be written "
                f"({exc.strerror or exc}); the pool goes on, its records are kept in "
                "memory only (pool.decisions) and counted as log write errors"
            )
            LOGGER.warning(message)
            try:
                # Seen even where logging is not configured; once, at the first failure.
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            except Exception:  # warnings turned into errors must not break the pool
                pass

    def records(self) -> tuple[Decision, ...]:
        """Every decision so far, oldest first."""
        with self._lock:
            return tuple(self._records)

    def close(self) -> None:
        """Close the file, if any. Idempotent."""
        with self._lock:
            fd, self._fd = self._fd, None
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            # Records appended after close are kept in memory and not counted.
            self._closed = True
