"""What the booking table tells the decision log, the logger and the warnings (I/O edge).

One room of :class:`~gpupool._sensors.bookings.BookingTable`: the steps it
passed over (a lock held past :data:`~gpupool._sensors.booking_files.LOCK_WAIT_S`,
an I/O error, part of a shared table left unread) counted, and noted at most
once per :data:`NOTE_EVERY_S`; why the table cannot be kept at all, once found;
and a warning once per process, directory and kind, on the ``gpupool`` logger
and as a ``RuntimeWarning``.
"""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING

from gpupool._core.bookings import TableNote
from gpupool._observe.log import LOGGER
from gpupool._sensors.booking_files import LOCK_WAIT_S
from gpupool._sensors.booking_foreign import MAX_DIRECTORY_ENTRIES, MAX_FOREIGN_FILE_BYTES

if TYPE_CHECKING:
    from gpupool._core.events import JsonValue
    from gpupool._sensors.booking_files import TableFiles, _Unavailable
    from gpupool._sensors.booking_foreign import ForeignReader, ForeignStep

__all__ = ["NOTE_EVERY_S", "RETRY_AFTER_S", "TableLog"]

#: After a lock held past the wait, the table is passed over for this long.
RETRY_AFTER_S = 2.0
#: At most one ``bookings_skipped`` note per this many seconds (the count covers the rest).
NOTE_EVERY_S = 60.0

#: (directory, kind) pairs this process has already warned about.
_WARNED: set[tuple[str, str]] = set()


class TableLog:
    """The table's notes for the decision log, its count of steps passed over, and why it
    cannot be kept, if so.

    Its fields are written here only; :attr:`unavailable` and :attr:`skipped_steps` are
    read by the table. A note is added under the table's thread lock.
    """

    def __init__(self, files: TableFiles) -> None:
        self._files = files
        #: Why the table cannot be kept here, once an operation has found out.
        self.unavailable: str | None = None
        self._next_note_s = 0.0
        self._unnoted_steps = 0
        self._notes: list[TableNote] = []
        #: Operations that answered ``None`` because the table was passed over.
        self.skipped_steps = 0

    def take_notes(self) -> list[TableNote]:
        """What the decision log should say about the table since the last call."""
        if not self._notes:
            return []  # a note added meanwhile is handed at the next call
        with self._files.lock:
            notes, self._notes = self._notes, []
        return notes

    def skipped(self, card_uuid: str, kind: str | None, error: OSError | None = None) -> None:
        """Count a step passed over; note it (at most once per :data:`NOTE_EVERY_S`) and
        warn the first time per process, directory and kind."""
        self.skipped_steps += 1
        self._unnoted_steps += 1
        if kind is None:
            return  # still within the pause after a busy lock: counted, noted with it
        if kind == "busy":
            cause = (
                f"another process held the lock of the booking table file "
                f"{self._files.path(card_uuid)} for more than {LOCK_WAIT_S} s"
            )
        else:
            cause = (
                f"the booking table in {self._files.directory} could not be read or written "
                f"({error})"
            )
        message = (
            f"{cause}; the pool went on without the other pools' bookings for that step "
            f"(pricing the card by its live readings alone) and tries the table again "
            f"after {RETRY_AFTER_S if kind == 'busy' else 0} s"
        )
        self.warn(kind.split(":")[0], message)
        now_s = time.monotonic()
        if now_s < self._next_note_s:
            return
        self._next_note_s = now_s + NOTE_EVERY_S
        terms: dict[str, JsonValue] = {
            "bookings_dir": str(self._files.directory),
            "card_uuid": card_uuid,
            "lock_wait_s": LOCK_WAIT_S if kind == "busy" else 0.0,
            "retry_after_s": RETRY_AFTER_S if kind == "busy" else 0.0,
            "skipped_steps": self._unnoted_steps,
            "cause": "lock" if kind == "busy" else "io",
        }
        self._unnoted_steps = 0
        with self._files.lock:
            self._notes.append(TableNote(event="bookings_skipped", reason=message, terms=terms))

    def passed_over(self, card_uuid: str, step: ForeignStep, reader: ForeignReader) -> None:
        """Count a step that left part of a shared table unread (another user's file refused,
        or left for the step's budget, or directory entries past the scan); warn once per
        process, directory and cause, and note it at most once per :data:`NOTE_EVERY_S`
        (``reader``: the table's reader of other users' files, whose budget it names)."""
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
            if (str(self._files.directory), cause) not in _WARNED:  # the message is built once
                self.warn(cause, self._passed_over_message(cause, step, reader))
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
            "bookings_dir": str(self._files.directory),
            "card_uuid": card_uuid,
            "cause": ",".join(causes),
            "files_refused": len(step.refused),
            "files_unread": len(step.unread),
            "scan_truncated": step.scan_truncated,
            "read_bytes": step.read_bytes,
            "read_s": round(step.spent_s, 6),
            "read_budget_bytes": reader.budget_bytes,
            "read_budget_s": reader.budget_s,
            "max_foreign_file_bytes": MAX_FOREIGN_FILE_BYTES,
            "max_directory_entries": MAX_DIRECTORY_ENTRIES,
            "skipped_steps": self._unnoted_steps,
        }
        self._unnoted_steps = 0
        # The caller (the table's _apply, through _foreign_rows) holds the thread lock.
        self._notes.append(TableNote(event="bookings_skipped", reason=reason, terms=terms))

    def _passed_over_message(self, cause: str, step: ForeignStep, reader: ForeignReader) -> str:
        """What the warning for a step passed over in part says, for ``cause`` (``reader``:
        the table's reader of other users' files, whose budget it names)."""
        if cause == "refused":
            refused = _worst_first(step.refused)
            said = "; ".join(f"{self._files.directory / name}: {why}" for name, why in refused[:3])
            more = f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""
            return (
                f"other users' files in the shared booking table are not read, as no pool "
                f"writes them so: {said}{more}. Their rows count for nothing; the pool goes "
                "on with the rest of the table (each step that passes a file over is counted "
                "in statistics().bookings_skipped and bookings_skipped records)"
            )
        if cause == "budget":
            return (
                f"other users' files in the shared booking table {self._files.directory} took more "
                f"than the read budget of a step ({reader.budget_bytes} bytes, "
                f"{reader.budget_s} s); {len(step.unread)} were left unread for that "
                "step (their last rows stand in for them) and are read first at the next"
            )
        return (
            f"the shared booking table {self._files.directory} holds more than "
            f"{reader.max_entries} entries; only the first {reader.max_entries} are looked "
            "at for other users' files at each step. Remove what does not belong there"
        )

    def stop(self, exc: _Unavailable) -> None:
        """The table cannot be kept here: say why, once, and note it."""
        self.unavailable = str(exc)
        self.warn(exc.kind, str(exc))
        terms: dict[str, JsonValue] = {
            "bookings_dir": str(self._files.directory),
            "shared": self._files.shared,
            "cause": exc.kind,
        }
        with self._files.lock:
            self._notes.append(
                TableNote(event="bookings_unavailable", reason=str(exc), terms=terms)
            )

    def warn(self, kind: str, message: str) -> None:
        """Say ``message`` once per process, directory and kind: on the ``gpupool`` logger,
        and as a ``RuntimeWarning`` that is seen where logging is not configured."""
        key = (str(self._files.directory), kind)
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
