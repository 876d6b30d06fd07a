"""This pool's side of the host's booking table: what it tells, when, and what it hears.

The table (:mod:`gpupool._sensors.bookings`) is a file per card, exchanged
under a lock; an exchange costs an open, a lock, a read and a write. The pool
exchanges it per *change*, not per task:

* **A start that books more than the table already shows** (a worker that had
  no booking there, or a larger one) is written before the task is sent, in one
  locked step that also reads the other pools' rows; the start goes ahead only
  if they still leave it room (:meth:`BookingLink.book`). So two pools never
  book the same bytes, however close together their starts are.
* **A start the table already covers** (the worker's last booking, not yet
  withdrawn, is at least as large) writes nothing: the other pools already
  price those bytes as this pool's.
* **A release** is written before the task's result is given when nothing of
  the pool is pending (and so is, at once, a running task's booking that grew
  because its key's price rose). While tasks are pending, the next start may take the
  worker's booking as it stands, so the release, like **a change of the
  waiting state** (tasks began or stopped waiting for room), is written at most
  :data:`COALESCE_S` after it happened, with every other change of that window
  in one write; a change undone within the window (a task ended and the next
  took its worker's booking) writes nothing. Meanwhile the other pools see this pool booking
  more than it does, never less: a release told late costs them at most
  :data:`COALESCE_S` of waiting, and a waiting state told late lets a pool
  beyond its share take at most that much longer to stop.
* **Reads** (in the card reading, once in each scheduling pass that may start a
  task) do not rewrite the file, except to refresh this pool's stamp after
  :data:`~gpupool._sensors.booking_rows.HEARTBEAT_S`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpupool._core.bookings import OtherPools, TaskBooking, group_waits, last_decision

if TYPE_CHECKING:
    from gpupool._core.events import Decision
    from gpupool._core.planner import Planner, Start
    from gpupool._observe.log import DecisionLog
    from gpupool._pool.workers import DeviceState
    from gpupool._sensors.base import Sensor
    from gpupool._sensors.bookings import BookingTable

__all__ = ["COALESCE_S", "WAITING_COUNT_S", "BookingLink"]

#: The longest a release or a waiting state change waits to be written to the table (the
#: changes of one window go in one write).
COALESCE_S = 0.05

#: The least time between two writes of a row that only a changed count of waiting tasks
#: calls for (the count is for people, ``gpupool top``; whether tasks wait at all, which
#: other pools share by, is told within :data:`COALESCE_S`).
WAITING_COUNT_S = 0.5

#: The most waiting tasks a row of the host's booking table describes by key (for people).
_WAITS_SCANNED = 64

_Row = tuple[tuple[TaskBooking, ...], int, int]


class BookingLink:
    """One pool's exchanges with the host's booking table (the dispatcher thread's only).

    ``sensor`` reads what each worker holds, for the rows written while other pools are on
    the card; ``log`` and ``started_at_s`` (the pool's clock) date its latest decision, in
    the row's fields for people (:meth:`_notes`).
    """

    def __init__(
        self,
        table: BookingTable,
        pool_id: str,
        devices: Sequence[DeviceState],
        sensor: Sensor,
        planner: Planner,
        log: DecisionLog,
        started_at_s: float,
    ) -> None:
        self.table = table
        self.pool_id = pool_id
        self.devices = devices
        self.sensor = sensor
        self.planner = planner
        self.log = log
        self.started_at_s = started_at_s
        # Per card: the row as last written (reached bytes as 0), and whether other pools
        # were on it at the last read.
        self.published: dict[int, _Row] = {}
        self.others_seen: dict[int, bool] = {}
        # Per card: the row last written, and per worker the largest booking it shows.
        self.shown: dict[int, tuple[_Row, dict[int, int]]] = {}
        # Per card: since when a change waits to be written (monotonic seconds).
        self.dirty_since_s: dict[int, float] = {}
        # Per card: when its row was last written (monotonic seconds).
        self.written_s: dict[int, float] = {}

    # -- reads ---------------------------------------------------------------------------

    def read(self, device: DeviceState, now_s: float, *, census: bool = False) -> None:
        """Hear the other pools on ``device`` (this pool's stamp refreshed when it aged)."""
        others = self.table.others(
            device.info.uuid, self.pool_id, total_bytes=device.census.total_bytes
        )
        self.others_seen[device.index] = bool(others is not None and others.pools)
        self.planner.neighbours.observe_others(device.index, others, now_s, census=census)

    def read_for_record(self, device: DeviceState, rows: Mapping[int, int], now_s: float) -> None:
        """The other pools as they stand now, priced by ``rows`` (an out-of-memory's record)."""
        others = self.table.others(
            device.info.uuid, self.pool_id, total_bytes=device.census.total_bytes
        )
        self.planner.neighbours.observe_others(device.index, others, now_s, rows=rows)

    # -- a start -------------------------------------------------------------------------

    def book(self, start: Start, worker_pid: int, key: str, now_s: float) -> bool:
        """Book ``start`` on its card before its task is sent; ``False`` (the booking
        withdrawn) when the other pools' rows, read in the same locked step, leave it no
        room. A start the table's row already covers is not written."""
        if start.device is None or start.past_bound:
            return True
        device = self.devices[start.device]
        if self._covered(
            device.index, [*self._running(device.index), (worker_pid, start.booked_bytes)]
        ):
            self._mark(device.index)  # its key, or the waiting state, may be new
            return True
        new = TaskBooking(
            worker_pid=worker_pid, key=key, booked_bytes=start.booked_bytes, reached_bytes=0
        )
        tasks = (*self.planner.neighbours.bookings_on(device.index), new)
        waiting = self.planner.neighbours.waiting_count(starting=True)
        row = (tasks, waiting, self.planner.neighbours.need_bytes(starting=True))
        others = self._exchange(device, row, self._told(device, tasks), starting=True)
        self.planner.neighbours.observe_others(start.device, others, now_s)
        if self.planner.still_admits(start, now_s):
            return True
        self.published.pop(start.device, None)
        self._write(device, now_s)
        return False

    def _covered(self, device: int, tasks: Iterable[tuple[int, int]]) -> bool:
        """Whether the row last written books at least ``tasks``' bytes (``(worker pid,
        booked bytes)`` pairs) for each of their workers (the other pools then price them
        all as this pool's already)."""
        shown = self._shown(device)
        if shown is None:
            return False
        wanted: dict[int, int] = {}
        for pid, booked in tasks:
            wanted[pid] = wanted.get(pid, 0) + booked
        return all(shown.get(pid, -1) >= booked for pid, booked in wanted.items())

    def _shown(self, device: int) -> dict[int, int] | None:
        """Per worker, the largest booking the row last written on ``device`` shows (``None``:
        none written), worked out once per row written."""
        published = self.published.get(device)
        if published is None:
            return None
        memo = self.shown.get(device)
        if memo is not None and memo[0] is published:
            return memo[1]
        shown: dict[int, int] = {}
        for task in published[0]:
            shown[task.worker_pid] = max(shown.get(task.worker_pid, 0), task.booked_bytes)
        self.shown[device] = (published, shown)
        return shown

    # -- changes ---------------------------------------------------------------------------

    def changed(self, device: int, now_s: float) -> None:
        """A task on ``device`` ended: its booking is released in the table before its result
        is given, unless tasks are pending (the next start may take the worker's booking as
        it stands; the release is then coalesced). A running task booked higher than the
        table shows (its key's price rose) is written at once: a late release only delays
        the other pools, a late growth could let them book those bytes."""
        if self.planner.has_pending() and self._covered(device, self._running(device)):
            self._mark(device)
        else:
            self._write(self.devices[device], now_s)

    def waiting_changed(self) -> None:
        """After a scheduling pass: where other pools are, whether tasks wait for room is
        told when it changed (within :data:`COALESCE_S`); on every card where this pool has
        a row, a changed count of them is told too, at most every :data:`WAITING_COUNT_S`."""
        count = self.planner.neighbours.waiting_count()
        for device in self.devices:
            published = self.published.get(device.index)
            if self.others_seen.get(device.index) and (
                published is not None and published[1] > 0
            ) != (count > 0):
                self._mark(device.index)
            elif published is not None and published[1] != count:
                self._mark_count(device.index)

    def _mark(self, device: int) -> None:
        self.dirty_since_s.setdefault(device, time.monotonic())

    def _mark_count(self, device: int) -> None:
        """A changed waiting count alone: written :data:`WAITING_COUNT_S` after the row's
        last write at the soonest."""
        soonest = self.written_s.get(device, -WAITING_COUNT_S) + WAITING_COUNT_S - COALESCE_S
        self.dirty_since_s.setdefault(device, max(time.monotonic(), soonest))

    def flush(self, now_s: float, *, force: bool = False) -> float | None:
        """Write the changes that have waited :data:`COALESCE_S` (all of them: ``force``);
        returns how soon the next is due (``None``: none waits)."""
        due_s: float | None = None
        clock = time.monotonic()
        for index, since in list(self.dirty_since_s.items()):
            left = since + COALESCE_S - clock
            if left > 0 and not force:
                due_s = left if due_s is None else min(due_s, left)
                continue
            del self.dirty_since_s[index]
            self._write(self.devices[index], now_s)
        return due_s

    def _write(self, device: DeviceState, now_s: float) -> None:
        """Write this pool's row on ``device`` if it differs from the last one written (or
        other pools are there, who read what its workers hold), and hear the others."""
        tasks = self.planner.neighbours.bookings_on(device.index)
        waiting = self.planner.neighbours.waiting_count()
        row = (tasks, waiting, self.planner.neighbours.need_bytes())
        seen = self.others_seen.get(device.index, False)
        last = self.published.get(device.index)
        same = last is not None and (last[0], last[1] > 0, last[2]) == (tasks, waiting > 0, row[2])
        if same and not seen:
            assert last is not None
            if last[1] == waiting:
                return  # the same booking, and no one to tell
            if time.monotonic() < self.written_s.get(device.index, 0.0) + WAITING_COUNT_S:
                self._mark_count(device.index)  # the count alone changed: told later
                return
        others = self._exchange(device, row, self._told(device, tasks))
        self.planner.neighbours.observe_others(device.index, others, now_s)

    def _told(self, device: DeviceState, tasks: tuple[TaskBooking, ...]) -> tuple[TaskBooking, ...]:
        """``tasks`` with what each worker holds now, read from the card only while another
        pool was on it at the last exchange (no one else reads it); else as not reached."""
        if not tasks or not self.others_seen.get(device.index) or not device.census.readable:
            return tasks
        try:
            rows = self.sensor.read_processes(device.info) or ()
        except Exception:
            rows = ()  # unreadable now: published as not yet reached (the safe side)
        held = {r.pid: r.used_bytes or 0 for r in rows}
        return tuple(
            TaskBooking(
                worker_pid=t.worker_pid,
                key=t.key,
                booked_bytes=t.booked_bytes,
                reached_bytes=held.get(t.worker_pid, 0),
            )
            for t in tasks
        )

    def _exchange(
        self,
        device: DeviceState,
        row: _Row,
        told: tuple[TaskBooking, ...],
        *,
        starting: bool = False,
    ) -> OtherPools | None:
        _, waiting, need_bytes = row
        notes = self._notes(waiting, starting)
        self.published[device.index] = row
        self.dirty_since_s.pop(device.index, None)
        self.written_s[device.index] = time.monotonic()
        others = self.table.exchange(
            device.info.uuid,
            self.pool_id,
            told,
            waiting,
            need_bytes,
            total_bytes=device.census.total_bytes,
            **notes,
        )
        self.others_seen[device.index] = bool(others is not None and others.pools)
        return others

    def _notes(self, waiting: int, starting: bool) -> dict[str, Any]:
        """What this pool's row tells people (no pool prices by it): its first ``waiting``
        tasks (at most ``_WAITS_SCANNED``) by key and ask, and its latest decision, stamped
        in seconds since the epoch. ``starting``: as in ``need_bytes``."""
        entries = self.planner.neighbours.waiting_asks(int(starting), min(waiting, _WAITS_SCANNED))
        waits = group_waits(entries)
        last = self.log.last_decision
        if last is None:
            return {"waits": waits, "last": None}
        when_s = time.time() - (time.monotonic() - self.started_at_s - last.time_s)
        return {"waits": waits, "last": last_decision(last.event, last.reason, when_s)}

    def _running(self, device: int) -> list[tuple[int, int]]:
        """This pool's running tasks on ``device`` as ``(worker pid, booked bytes)``."""
        return self.planner.neighbours.booked_on(device)

    # -- the end ---------------------------------------------------------------------------

    def withdraw_all(self) -> None:
        """The pool is shutting down: its rows leave every card."""
        self.dirty_since_s.clear()
        for device in self.devices:
            self.table.withdraw(device.info.uuid, self.pool_id)
        self.table.close()

    def note(self, record: Callable[[Decision], None], now_s: float) -> int:
        """Hand what the table could not do since the last call to ``record``; returns the
        steps it was passed over in all."""
        for note in self.table.take_notes():
            record(note.decision(now_s))
        return self.table.skipped_steps
