"""Other users' files in a shared booking table: refused, cached, read within a budget (I/O edge).

In a table shared by every user (``share_bookings="host"``) each user writes
its own file per card, ``<uuid>.uid<N>.json``, and every pool reads the others'
at every step. Those files are a stranger's input, so what a step spends on
them is bounded, whatever they hold::

    directory entry   looked at     the first MAX_DIRECTORY_ENTRIES only (the rest: counted;
                                    files read before are then opened by their names)
    name              refused       unless uid<N> is N's canonical spelling (ASCII digits,
                                    no leading zero) and N is not this user
    opened file       refused       unless a regular file owned by N, with one link,
                                    of at most MAX_FOREIGN_FILE_BYTES
    unchanged file    not read      same inode, size, mtime and ctime as when last read
                                    (and that ctime older than SETTLED_S); else its
                                    bytes are read, and parsed only where they differ;
                                    its rows that failed the checks are not checked again
    text              refused       past MAX_POOLS_PER_FILE rows or MAX_TASKS_PER_POOL
                                    tasks a row: decoding stops at the first row past them
    a step            at most       READ_BUDGET_BYTES read, and READ_BUDGET_S spent reading
                                    and parsing changed files; the files left over keep
                                    their last rows for that step, and the least recently
                                    read go first at the next
    over time         at most       READ_SHARE of the time: a step that overran (a parse
                                    is not cut short) leaves the next ones reading nothing
                                    new until the time is paid back

Every refusal and every file left over is reported in the step's
:class:`ForeignStep`; the table counts and records them.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpupool._sensors.booking_rows import MAX_POOLS_PER_FILE, MAX_TASKS_PER_POOL

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpupool._core.bookings import PoolBooking

__all__ = [
    "MAX_DIRECTORY_ENTRIES",
    "MAX_FOREIGN_FILE_BYTES",
    "READ_BUDGET_BYTES",
    "READ_BUDGET_S",
    "READ_SHARE",
    "SETTLED_S",
    "ForeignReader",
    "ForeignStep",
    "canonical_uid",
]

#: The most entries of a shared table's directory looked at, per step.
MAX_DIRECTORY_ENTRIES = 4096
#: The largest other user's file that is read (an honest pool's row on a card is a few KiB:
#: about 100 bytes a running task, 4 KiB of waiting tasks and last decision).
MAX_FOREIGN_FILE_BYTES = 128 * 1024
#: What one step may spend reading other users' changed files: bytes read, and seconds.
READ_BUDGET_BYTES = 256 * 1024
READ_BUDGET_S = 0.02
#: The share of the time that reading other users' changed files may take in the long run.
READ_SHARE = 0.1
#: A file whose status changed less than this long ago is compared by its bytes (two
#: writes within one tick of the filesystem's clock can leave the same timestamps).
SETTLED_S = 0.1

#: Files remembered per reader; past this many the memory starts afresh.
_KNOWN_FILES = 1024


def canonical_uid(digits: str) -> int | None:
    """The uid that ``digits`` spells, where it is that uid's one spelling (``str(uid)``:
    ASCII digits, no sign, no leading zero); else ``None``."""
    if not (digits.isascii() and digits.isdigit()):
        return None
    uid = int(digits)
    return uid if str(uid) == digits else None


@dataclass
class ForeignStep:
    """What one step found in the other users' files of a card.

    Attributes:
        rows: the rows that passed the step's checks, every file's.
        refused: per refused file or name, why (a file refused at every step is in every
            step's answer).
        unread: files left unread because the step's budget was spent (their last rows,
            where they had any, stand in for them).
        scan_truncated: the directory holds more entries than are looked at.
        read_bytes: the bytes read from other users' files in the step.
        spent_s: the seconds the step spent reading and parsing changed files.
    """

    rows: list[PoolBooking] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    unread: list[str] = field(default_factory=list)
    scan_truncated: bool = False
    read_bytes: int = 0
    spent_s: float = 0.0

    @property
    def passed_over(self) -> bool:
        """Whether any part of the table was not read in the step."""
        return bool(self.refused or self.unread or self.scan_truncated)


@dataclass
class _Known:
    """A file as last read: what proves it unchanged, its bytes, its rows."""

    key: tuple[int, int, int, int]
    data: bytes
    pools: dict[str, PoolBooking]
    read_step: int
    uid: int
    refusal: str | None = None


class ForeignReader:
    """Reads the other users' files of a shared table, step by step, within a budget, and
    remembers each by what proves it unchanged (so an unchanged file is parsed once)."""

    def __init__(
        self,
        *,
        budget_bytes: int = READ_BUDGET_BYTES,
        budget_s: float = READ_BUDGET_S,
        share: float = READ_SHARE,
        max_entries: int = MAX_DIRECTORY_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.budget_s = budget_s
        self.share = share
        self.max_entries = max_entries
        self.clock = clock
        # Seconds of reading the next step may spend (negative: a debt still being paid back).
        self._allowance_s = budget_s
        self._refilled_s = clock()
        self._known: dict[str, _Known] = {}
        self._steps = 0
        #: How many times a file's text was parsed (for tests and benchmarks).
        self.parses = 0

    def read(
        self,
        dir_fd: int,
        card_uuid: str,
        prefix: str,
        own_uid: int,
        check: Callable[[dict[str, PoolBooking], int], None],
    ) -> ForeignStep:
        """One step: the other users' rows for ``card_uuid`` (files ``<prefix><uid>.json`` in
        the directory ``dir_fd``), each file's rows filtered by ``check(pools, owner_uid)``."""
        from gpupool._core.bookings import parse_booking_table

        self._steps += 1
        step = ForeignStep()
        started_s = self.clock()
        refill_s = (started_s - self._refilled_s) * self.share
        self._allowance_s = min(self.budget_s, self._allowance_s + refill_s)
        self._refilled_s = started_s
        files = self._scan(dir_fd, prefix, own_uid, step)
        if step.scan_truncated:
            # Files met before are opened by name: a flood cannot push them out of the scan.
            listed = {name for _, name in files} | set(step.refused)
            files.extend(
                (known.uid, name)
                for name, known in self._known.items()
                if name.startswith(prefix) and name not in listed
            )
        # The least recently read first: a file that changes at every step cannot keep
        # the others unread.
        files.sort(
            key=lambda pair: self._known[pair[1]].read_step if pair[1] in self._known else -1
        )
        for uid, name in files:
            read_before = step.read_bytes
            pools = self._one(dir_fd, uid, name, card_uuid, step, parse_booking_table)
            if pools:
                checking_s = self.clock()
                check(pools, uid)
                if step.read_bytes > read_before:  # rows met for the first time: charged
                    step.spent_s += self.clock() - checking_s
                self._forget_failed(name, pools)
                step.rows.extend(pools.values())
        if len(self._known) > _KNOWN_FILES:
            self._known.clear()
        self._allowance_s -= step.spent_s
        return step

    def _forget_failed(self, name: str, kept: dict[str, PoolBooking]) -> None:
        """Forget the file's rows that failed the checks until the file changes: a row whose
        process exited, or whose PID names another process, never counts again, and an
        honest pool whose row failed rewrites its file (so forged rows cost one check)."""
        known = self._known.get(name)
        if known is not None and len(known.pools) != len(kept):
            known.pools = {key: row for key, row in known.pools.items() if key in kept}

    def _scan(
        self, dir_fd: int, prefix: str, own_uid: int, step: ForeignStep
    ) -> list[tuple[int, str]]:
        found: list[tuple[int, str]] = []
        try:
            with os.scandir(dir_fd) as entries:
                for n, entry in enumerate(entries):
                    if n >= self.max_entries:
                        step.scan_truncated = True
                        break
                    name = entry.name
                    if not (name.startswith(prefix) and name.endswith(".json")):
                        continue
                    uid = canonical_uid(name[len(prefix) : -len(".json")])
                    if uid is None:
                        step.refused[name] = "its name does not spell a uid as a pool writes it"
                    elif uid != own_uid:
                        found.append((uid, name))
        except OSError:
            return []
        return found

    def _one(
        self,
        dir_fd: int,
        uid: int,
        name: str,
        card_uuid: str,
        step: ForeignStep,
        parse: Callable[..., dict[str, PoolBooking]],
    ) -> dict[str, PoolBooking]:
        """One file's rows (a copy: the caller's checks drop from it), or none."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symbolic link: never followed
                step.refused[name] = "it is a symbolic link (no pool writes one)"
                self._known.pop(name, None)
            return {}  # else removed meanwhile
        try:
            status = os.fstat(fd)
            why = file_refusal(status, uid)
            if why is not None:
                step.refused[name] = why
                self._known.pop(name, None)
                return {}
            key = (status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)
            known = self._known.get(name)
            settled = time.time_ns() - status.st_ctime_ns > SETTLED_S * 1e9
            if known is not None and known.key == key and settled:
                if known.refusal is not None:
                    step.refused[name] = known.refusal
                return dict(known.pools)
            over_bytes = step.read_bytes + status.st_size > self.budget_bytes
            if over_bytes or step.spent_s >= self._allowance_s:
                step.unread.append(name)
                return dict(known.pools) if known is not None else {}
            reading_s = self.clock()
            try:
                return self._parse(fd, uid, name, key, known, card_uuid, step, parse)
            finally:
                step.spent_s += self.clock() - reading_s
        except OSError:
            return {}
        finally:
            os.close(fd)

    def _parse(
        self,
        fd: int,
        uid: int,
        name: str,
        key: tuple[int, int, int, int],
        known: _Known | None,
        card_uuid: str,
        step: ForeignStep,
        parse: Callable[..., dict[str, PoolBooking]],
    ) -> dict[str, PoolBooking]:
        """Read the file's bytes and parse them where they differ from the last ones (read
        twice at most: a read torn by its writer's in-place write is read again once)."""
        pools: dict[str, PoolBooking] = {}
        refusal: str | None = None
        for attempt in range(2):
            data = os.pread(fd, MAX_FOREIGN_FILE_BYTES + 1, 0)
            step.read_bytes += len(data)
            if len(data) > MAX_FOREIGN_FILE_BYTES:
                step.refused[name] = f"it grew past {MAX_FOREIGN_FILE_BYTES} bytes"
                self._known.pop(name, None)
                return {}
            if known is not None and known.data == data:
                pools, refusal = known.pools, known.refusal
                break
            self.parses += 1
            try:
                pools = parse(
                    data,
                    card_uuid=card_uuid,
                    max_pools=MAX_POOLS_PER_FILE,
                    max_tasks=MAX_TASKS_PER_POOL,
                )
                break
            except ValueError as exc:
                if attempt:
                    refusal = f"its text is not a table a pool writes ({exc})"
        if refusal is not None:
            step.refused[name] = refusal
        self._known[name] = _Known(
            key=key, data=data, pools=pools, read_step=self._steps, uid=uid, refusal=refusal
        )
        return dict(pools)


def file_refusal(
    status: os.stat_result, uid: int, max_bytes: int = MAX_FOREIGN_FILE_BYTES
) -> str | None:
    """Why an opened file is not one an honest pool of ``uid`` writes (a regular file of
    that owner, one link, at most ``max_bytes``), or ``None``."""
    if not stat.S_ISREG(status.st_mode):
        return f"it is not a regular file (mode {stat.filemode(status.st_mode)})"
    if status.st_uid != uid:
        return f"its owner (uid {status.st_uid}) is not the uid its name spells ({uid})"
    if status.st_nlink > 1:
        return f"it has {status.st_nlink} hard links (a pool's file has one)"
    if status.st_size > max_bytes:
        return f"it holds {status.st_size} bytes, more than the {max_bytes} read"
    return None
