"""This user's file of the booking table as this handle last read or wrote it (I/O edge).

One room of :class:`~gpupool._sensors.bookings.BookingTable`: per card, the
text of this user's file as this handle last read or wrote it and its rows
(so an unchanged file is not parsed again), the encoded text of each row (so
an unchanged row is not encoded again), and the last answer built from the
rows (so a pass that finds the file's text as it was builds nothing). The
file is read and written under its lock, which the table holds
(:class:`~gpupool._sensors.booking_files.TableFiles`); a file past
:data:`~gpupool._sensors.booking_rows.MAX_FILE_BYTES`, or one that does not
parse, is started afresh.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from gpupool._core.bookings import (
    OtherPools,
    PoolBooking,
    format_booking_table,
    parse_booking_table,
)
from gpupool._sensors.booking_rows import MAX_FILE_BYTES, write_in_place

if TYPE_CHECKING:
    from gpupool._sensors.booking_files import TableFiles
    from gpupool._sensors.booking_log import TableLog

__all__ = ["CardTexts"]


class CardTexts:
    """Per card: this user's file's text and rows as last read or written, each row's
    encoding, and the last answer built from the rows.

    Its fields are written here only, under the table's thread lock.
    """

    def __init__(self, files: TableFiles, log: TableLog) -> None:
        self._files = files
        self._log = log
        # Per card: the file's text as this handle last read or wrote it, its
        # rows, and the encoded text of each row (so an unchanged file is not
        # parsed again, and an unchanged row not encoded again).
        self._cache: dict[str, tuple[bytes, dict[str, PoolBooking]]] = {}
        self._fragments: dict[str, dict[int, tuple[PoolBooking, str]]] = {}
        # Per card: the rows of the last answer of others() or exchange(), and that answer.
        self._memo: dict[str, tuple[list[PoolBooking], OtherPools]] = {}

    def leave_parent(self) -> None:
        """In a forked child: the texts and answers are the parent's (the rows' encodings
        stand)."""
        self._cache = {}
        self._memo = {}

    def read(self, fd: int, size: int, card_uuid: str) -> dict[str, PoolBooking]:
        """The rows of the card's file (``size``: its length now), under its lock: parsed
        only where its text differs from the one this handle last read or wrote."""
        if size > MAX_FILE_BYTES:
            self._log.warn(
                f"large:{card_uuid}",
                f"the booking table file {self._files.path(card_uuid)} holds {size} bytes, more "
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
            self._log.warn(
                f"corrupt:{card_uuid}",
                f"the booking table file {self._files.path(card_uuid)} could not "
                f"be read ({exc}); it is started afresh",
            )
            pools = {}
        self._cache[card_uuid] = (data, dict(pools))
        return pools

    def write(self, fd: int, size: int, card_uuid: str, pools: dict[str, PoolBooking]) -> None:
        """Write ``pools`` over the card's file in place (``size``: its length now), under its
        lock; they are then the file's text as this handle last wrote it."""
        fragments = self._fragments.setdefault(card_uuid, {})
        data = format_booking_table(card_uuid, list(pools.values()), fragments)
        write_in_place(fd, data, size)
        self._cache[card_uuid] = (data, dict(pools))

    def answer(
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
