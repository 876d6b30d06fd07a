"""The largest CUDA context measured on each card model, kept beside the booking table (I/O edge).

A worker whose own device row can be read measures its context (its row less what
its frameworks hold). The pool keeps the largest measured on each card model in a
small file in the directory of the host's booking table, so that a pool that cannot
read its workers' rows (a container, rows of 0, MIG) prices their contexts at what
this host has measured on that model rather than at a constant
(:func:`gpupool._core.contexts.decide_context_estimate`)::

    pool A (rows listed)                <booking table's directory>/          pool B (rows hidden)
    a report's context_source   --note-> contexts.json                --read-> at construction:
    "process-row", larger than           (contexts.uid<N>.json in a            each card's estimate,
    the model's recorded one             table shared by every user)           told to its workers

What it costs, whatever the files hold:

* **reading**: once, when the pool is built: this user's file (a private table), or
  at most :data:`MAX_CONTEXT_FILES` users' files among the first
  :data:`~gpupool._sensors.booking_foreign.MAX_DIRECTORY_ENTRIES` entries (a shared
  one); each file at most :data:`~gpupool._core.contexts.MAX_CONTEXT_FILE_BYTES`.
* **writing**: only when a measured context is larger than any this pool knows on the
  model: one locked read-modify-write of this user's file, replaced whole by a rename
  (a reader sees the old text or the new, never a torn one).

Another user's file is untrusted input: opened without following links, refused
unless a regular file with one link owned by the uid its name spells, and at most
:data:`~gpupool._core.contexts.MAX_CONTEXT_FILE_BYTES`; its entries are refused where
implausible (:func:`gpupool._core.contexts.parse_context_file`). Every refusal is kept
with its reason (:attr:`ContextFile.refused`); nothing here ever raises.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpupool._core.contexts import (
    CONTEXT_ESTIMATE_BYTES,
    CONTEXT_PLAUSIBLE_MAX_BYTES,
    MAX_CONTEXT_FILE_BYTES,
    MAX_MODELS,
    ContextEstimate,
    ContextRecord,
    decide_context_estimate,
    format_context_file,
    parse_context_file,
)
from gpupool._sensors.booking_foreign import MAX_DIRECTORY_ENTRIES, canonical_uid
from gpupool._sensors.booking_rows import directory_refusal, flock_within

if TYPE_CHECKING:
    from gpupool._sensors.bookings import BookingTable

__all__ = ["CONTEXTS_PREFIX", "MAX_CONTEXT_FILES", "ContextFile", "open_context_file"]

#: The files' names: ``contexts.json`` (a private table), ``contexts.uid<N>.json`` (user N's,
#: in a table shared by every user).
CONTEXTS_PREFIX = "contexts"
#: The most users' files read in a shared table (one file per user).
MAX_CONTEXT_FILES = 64
#: How long a write waits for this user's lock before it gives up (it is tried again at the
#: next larger measurement).
LOCK_WAIT_S = 0.5


def _program_label() -> str:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return (Path(argv0).name or Path(sys.executable).name)[:64] or "python"


class ContextFile:
    """One pool's handle on the contexts files in ``directory`` (the booking table's).

    Args:
        directory: the booking table's directory.
        shared: the table is shared by every user (each writes its own file, reads all).
        pool_id: the pool's id, written beside what it measured.
    """

    def __init__(self, directory: str | os.PathLike[str], *, shared: bool, pool_id: str) -> None:
        self.directory = Path(directory)
        self.shared = shared
        self.pool_id = pool_id
        self._uid = os.geteuid()
        self._name = (
            f"{CONTEXTS_PREFIX}.uid{self._uid}.json" if shared else f"{CONTEXTS_PREFIX}.json"
        )
        #: Every record read, every user's.
        self.records: list[ContextRecord] = []
        #: Why a file, or an entry of one, was not taken, by file name.
        self.refused: dict[str, str] = {}
        #: Why the files could not be read or written, when they could not.
        self.problem: str | None = None
        # The largest context this pool knows on each model: a note at or below it writes nothing.
        self._known: dict[str, int] = {}
        self.writes = 0

    # -- reading -------------------------------------------------------------------------

    def read(self) -> None:
        """Read the files (this user's; in a shared table, every user's), once."""
        dir_fd = self._open_directory(create=False)
        if dir_fd is None:
            return
        try:
            names = self._names(dir_fd)
            for uid, name in names:
                entries = self._read_file(dir_fd, name, uid)
                self.records.extend(entries.values())
                if uid != self._uid:
                    continue
                # Only this user's own figures stop a note: another user's larger figure
                # must not keep this user from recording (it is what corroborates theirs).
                for model, record in entries.items():
                    self._known[model] = max(self._known.get(model, 0), record.context_bytes)
        finally:
            os.close(dir_fd)
        self._set_aside({record.model for record in self.records}, dict(names))

    def estimate(self, model: str) -> ContextEstimate:
        """The context a worker on a card of ``model`` is priced at until its row is read
        (:func:`~gpupool._core.contexts.decide_context_estimate`, for this user)."""
        return decide_context_estimate(self.records, model, CONTEXT_ESTIMATE_BYTES, uid=self._uid)

    def _set_aside(self, models: set[str], names: dict[int, str]) -> None:
        """Name, among the refusals, each other user's figure that no second user matched."""
        for model in sorted(models):
            for record in self.estimate(model).set_aside:
                name = names.get(record.uid, f"uid {record.uid}")
                why = (
                    f"{model!r}: context_bytes {record.context_bytes} is not corroborated "
                    "(no second user recorded as much; one user's figure alone never "
                    "raises another's)"
                )
                held = self.refused.get(name)
                self.refused[name] = why if held is None else f"{held}; {why}"

    def _names(self, dir_fd: int) -> list[tuple[int, str]]:
        """The files to read: ``(owner uid, name)``."""
        if not self.shared:
            return [(self._uid, self._name)]
        found: list[tuple[int, str]] = []
        prefix, suffix = f"{CONTEXTS_PREFIX}.uid", ".json"
        try:
            with os.scandir(dir_fd) as entries:
                for n, entry in enumerate(entries):
                    if n >= MAX_DIRECTORY_ENTRIES or len(found) >= MAX_CONTEXT_FILES:
                        break
                    name = entry.name
                    if not (name.startswith(prefix) and name.endswith(suffix)):
                        continue
                    uid = canonical_uid(name[len(prefix) : -len(suffix)])
                    if uid is None:
                        self.refused[name] = "its name does not spell a uid as a pool writes it"
                    else:
                        found.append((uid, name))
        except OSError as exc:
            self.problem = f"the directory {self.directory} cannot be listed ({exc})"
        return found

    def _read_file(self, dir_fd: int, name: str, uid: int) -> dict[str, ContextRecord]:
        """One file's entries, or none (the reason kept in :attr:`refused`)."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            self.refused[name] = f"it cannot be opened without following a link ({exc.strerror})"
            return {}
        try:
            why = _refusal(os.fstat(fd), uid)
            data = b"" if why is not None else os.pread(fd, MAX_CONTEXT_FILE_BYTES + 1, 0)
        except OSError as exc:
            why = f"it cannot be read ({exc.strerror})"
        finally:
            os.close(fd)
        if why is None:
            try:
                entries, refused = parse_context_file(data, uid=uid)
            except ValueError as exc:
                why = f"its text is not a contexts file ({exc})"
            else:
                if refused:
                    self.refused[name] = "entries refused: " + "; ".join(refused[:4])
                return entries
        self.refused[name] = why
        return {}

    # -- writing -------------------------------------------------------------------------

    def note(self, model: str, context_bytes: int) -> bool:
        """A worker on a card of ``model`` measured its context at ``context_bytes`` (from its
        own row): recorded in this user's file where it is larger than any this pool knows on
        the model; whether the file was written."""
        if (
            type(context_bytes) is not int
            or not 0 < context_bytes <= CONTEXT_PLAUSIBLE_MAX_BYTES
            or context_bytes <= self._known.get(model, 0)
        ):
            return False
        self._known[model] = context_bytes
        dir_fd = self._open_directory(create=True)
        if dir_fd is None:
            return False
        try:
            return self._write(dir_fd, model, context_bytes)
        except OSError as exc:
            self.problem = (
                f"the contexts file {self.directory / self._name} cannot be written ({exc})"
            )
            return False
        finally:
            os.close(dir_fd)

    def _write(self, dir_fd: int, model: str, context_bytes: int) -> bool:
        lock_name = self._name.removesuffix(".json") + ".lock"
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        lock_fd = os.open(lock_name, flags, 0o600, dir_fd=dir_fd)
        try:
            if not stat.S_ISREG(os.fstat(lock_fd).st_mode):
                self.problem = (
                    f"the contexts file {self.directory / self._name} is not written: its "
                    f"lock {lock_name} is not a regular file"
                )
                return False
            if not flock_within(lock_fd, LOCK_WAIT_S):
                return False
            entries = self._read_file(dir_fd, self._name, self._uid)
            self.refused.pop(self._name, None)  # this user's own file: started afresh if damaged
            old = entries.get(model)
            if old is not None and old.context_bytes >= context_bytes:
                self._known[model] = old.context_bytes
                return False
            if old is None and len(entries) >= MAX_MODELS:
                del entries[min(entries.values(), key=lambda r: r.time_s).model]
            entries[model] = ContextRecord(
                model=model,
                context_bytes=context_bytes,
                uid=self._uid,
                program=_program_label(),
                pool=self.pool_id,
                time_s=time.time(),
            )
            self._replace(dir_fd, format_context_file(entries))
            self.writes += 1
            return True
        finally:
            os.close(lock_fd)  # releases the lock

    def _replace(self, dir_fd: int, data: bytes) -> None:
        """Replace this user's file whole: a new file, renamed over the old one."""
        # A name no other user can guess and take first (in a shared directory they could).
        temporary = f".{self._name}.{os.getpid()}.{os.urandom(6).hex()}.tmp"
        mode = 0o644 if self.shared else 0o600
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temporary, flags, mode, dir_fd=dir_fd)
        try:
            os.fchmod(fd, mode)  # the umask may have narrowed it
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
        finally:
            os.close(fd)
        try:
            os.rename(temporary, self._name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=dir_fd)
            raise

    # -- the directory -------------------------------------------------------------------

    def _open_directory(self, *, create: bool) -> int | None:
        """The directory's descriptor, where it is safe to use (as the booking table judges
        it); ``None`` (the reason in :attr:`problem`, unless it does not exist yet)."""
        if create:
            mode = 0o1777 if self.shared else 0o700
            with contextlib.suppress(OSError):
                self.directory.mkdir(mode=mode, parents=True)
                if self.shared:
                    os.chmod(self.directory, mode)  # the umask narrowed it (as the table does)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            dir_fd = os.open(self.directory, flags)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.problem = f"the directory {self.directory} cannot be opened ({exc})"
            return None
        try:
            refusal = directory_refusal(
                self.directory, os.fstat(dir_fd), shared=self.shared, uid=self._uid
            )
        except OSError as exc:
            refusal = str(exc)
        if refusal is not None:
            self.problem = refusal
            os.close(dir_fd)
            return None
        return dir_fd


def _refusal(status: os.stat_result, uid: int) -> str | None:
    """Why an opened file is not one a pool of ``uid`` writes, or ``None``."""
    if not stat.S_ISREG(status.st_mode):
        return f"it is not a regular file (mode {stat.filemode(status.st_mode)})"
    if status.st_uid != uid:
        return f"its owner (uid {status.st_uid}) is not the uid its name spells ({uid})"
    if status.st_nlink > 1:
        return f"it has {status.st_nlink} hard links (a pool's file has one)"
    if status.st_size > MAX_CONTEXT_FILE_BYTES:
        return f"it holds {status.st_size} bytes, more than the {MAX_CONTEXT_FILE_BYTES} read"
    return None


def open_context_file(table: BookingTable | None, pool_id: str) -> ContextFile | None:
    """The contexts files beside ``table`` (read now), or ``None`` without a booking table."""
    if table is None:
        return None
    contexts = ContextFile(table.directory, shared=table.shared, pool_id=pool_id)
    contexts.read()
    return contexts
