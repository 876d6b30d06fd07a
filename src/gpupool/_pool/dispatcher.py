"""The dispatcher: one thread per pool that owns every scheduling decision (process layer).

Data flow::

    caller threads           dispatcher thread (the loop)                 workers (processes)
    --------------           ----------------------------                 -------------------
    submit(fn, *a) -> Inbox -> Outcomes.take -> planner.submit (PENDING)
                     (lock,    CardReader.read -> planner.readings.observe
                     flags,    planner.next_start -> Start / Warm / Wait / Fail
                     wake)     Start: WorkerSet.send (RUNNING)            -> (task id, task)
                                                                             fn(*a) -> report
                               WorkerSet.serve -> Answered / Exited         <- (pid, task, kind)
                               planner.ended / out_of_memory / lost
                               Outcomes: result or error -> one outbox
    statistics(), width  <-    end of turn: Public.publish (the snapshot), then deliver the outbox
    futures              <-

Each part owns its state. Caller threads touch the inbox only, and read what is
published whole (:class:`~gpupool._pool.snapshot.Public`: the snapshot, the thread's
end); what the pool keeps between runs is :class:`~gpupool._pool.memory.RunMemory`'s.
The loop (:class:`Dispatcher`) is the only code that asks the planner: the parts
return events and values, and the loop decides. Every price, admission and width
decision is the planner's (:mod:`gpupool._core.planner`).
Tasks held back for memory stay PENDING in the parent, so ``cancel()`` works on
them; a task becomes RUNNING only when it is handed to a worker, and a worker
runs one task at a time, so the pool always knows which task a dead worker ran.
Workers are started lazily with their card pinned in the environment before
any import, kept warm, and retired when their card's limit falls below them.

Why not ``loky.ProcessPoolExecutor`` itself: it starts every worker at the
first submit, takes one environment per executor, hands queued work to
workers where it can no longer be cancelled, and breaks the whole executor
when one worker dies. gpupool needs the opposite on each count, so it starts
its workers itself (fork+exec with a per-process ``env``, cloudpickle:
:mod:`gpupool._pool.launch`) under a dispatcher of its own.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gpupool._broken import WorkerLostError
from gpupool._child.probe import ALLOCATOR_CAP_NOTE
from gpupool._core.census import Census
from gpupool._core.events import truncate_text
from gpupool._core.peak import PeakReport
from gpupool._core.planner import (
    QUEUE_DEPTH,
    SAMPLE_MIN_GAP_S,
    CardReading,
    Fail,
    Planner,
    PlannerConfig,
    Refuse,
    Retry,
    Start,
    Wait,
    Warm,
)
from gpupool._core.policy import AskTable
from gpupool._observe.log import LOGGER, DecisionLog
from gpupool._pool import outcomes as said
from gpupool._pool.booking_link import BookingLink
from gpupool._pool.by_value import dumps_call
from gpupool._pool.inbox import (
    Inbox,
    WorkItem,
    at_interpreter_exit,
    callable_name,
    copy_broken,
    interpreter_exiting,
)
from gpupool._pool.launch import StartDataError
from gpupool._pool.memory import PeakMemory, RunMemory
from gpupool._pool.outcomes import Outcomes
from gpupool._pool.snapshot import Public
from gpupool._pool.workers import (
    SPAWN_TRIES,
    Answered,
    DeviceState,
    Exited,
    SpawnFailed,
    Worker,
    WorkerOptions,
    WorkerSet,
)
from gpupool._sensors.contexts import open_context_file
from gpupool._sensors.host import read_ancestors

if TYPE_CHECKING:
    from gpupool._sensors.base import Sensor
    from gpupool._sensors.bookings import BookingTable

__all__ = [
    "SPAWN_TRIES",
    "Dispatcher",
    "callable_name",
    "interpreter_exiting",
]

#: How long shutdown waits for workers told to exit before it kills them.
STOP_WAIT_S = 10.0

#: How many times a task runs on another worker after its frame went unacknowledged (read
#: by another reader of the worker's socket) before it fails with ``WorkerLostError``.
UNREAD_TRIES = 3

#: While tasks run, the cards are read at least this often (the planner samples
#: these readings into the decision log, coalesced: see ``card_read``).
READ_WHILE_RUNNING_S = SAMPLE_MIN_GAP_S

_dispatchers: weakref.WeakSet[Dispatcher] = weakref.WeakSet()


def _python_exit() -> None:
    """At interpreter exit (``submit`` refuses work by then: the inbox's hook, which runs this,
    says so first), let every pool finish its submitted work, as CPython's does."""
    for dispatcher in list(_dispatchers):
        dispatcher.inbox.request_shutdown()
    for dispatcher in list(_dispatchers):
        dispatcher.public.join()


# Run by the inbox's exit hook, which threading took as the class was imported.
at_interpreter_exit(_python_exit)


def _forget_dispatchers_in_forked_child() -> None:
    """A forked child (a ``fork`` ``Process``, a ``Pool`` worker) holds copies of the
    parent's dispatchers but none of their threads: its exit must not wait for them (it
    would for good, and so would whoever joins the child), nor wake the parent's through
    their copied pipes."""
    _dispatchers.clear()


os.register_at_fork(after_in_child=_forget_dispatchers_in_forked_child)


def _sooner(wait_s: float | None, other_s: float | None) -> float | None:
    """The shorter of two waits (``None``: no wait of that kind)."""
    if other_s is None:
        return wait_s
    return other_s if wait_s is None else min(wait_s, other_s)


class CardReader:
    """Reads the pool's cards (``devices``) through ``sensor`` (free and per-process bytes in
    one reading), and tells the pool's bytes from a co-tenant's; returns readings, asks
    nothing of the planner. It remembers when it last read every card, and per card the
    PIDs found not to be the pool's."""

    def __init__(self, devices: list[DeviceState], sensor: Sensor) -> None:
        self.devices = devices
        self.sensor = sensor
        # When every card was last read (monotonic seconds).
        self.read_s = 0.0
        # Per card, the rows of its readings found not to be under any worker (pool_pids).
        self.not_pool_pids: dict[int, set[int]] = {}

    def due_s(self) -> float:
        """How soon the cards are due to be read again while tasks run (<= 0: now)."""
        return self.read_s + READ_WHILE_RUNNING_S - time.monotonic()

    def reading_all(self) -> None:
        """The cards are being read, all of them, now."""
        self.read_s = time.monotonic()

    def read(self, device: DeviceState, workers: Collection[int]) -> CardReading | str:
        """One live snapshot of ``device``, its rows of ``workers`` (and of what they started)
        told as the pool's; the error's text when the sensor could not read it."""
        try:
            memory, rows = self.sensor.read_snapshot(device.info)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        process_bytes = None
        pool_pids: frozenset[int] = frozenset()
        if rows is not None:
            process_bytes = {r.pid: r.used_bytes or 0 for r in rows}
            pool_pids = self._pool_pids(device.index, process_bytes, frozenset(workers))
        return CardReading(
            free_bytes=memory.free_bytes,
            used_bytes=memory.used_bytes,
            process_bytes=process_bytes,
            pool_pids=pool_pids,
        )

    def _pool_pids(
        self, device: int, rows: Mapping[int, int], workers: frozenset[int]
    ) -> frozenset[int]:
        """The rows' PIDs that are the pool's workers (on any card) or were started under
        one (a task's subprocess): the pool's bytes, never a co-tenant's.

        A row found not to be under any worker is not walked again while it stays in the
        rows (a process is never re-parented under a worker), so the cards' readings every
        0.2 s walk ``/proc`` only for rows that are new."""
        strangers = self.not_pool_pids.setdefault(device, set())
        strangers &= rows.keys()
        ours = set()
        for pid in rows:
            if pid in workers:
                ours.add(pid)
            elif pid == os.getpid() or pid in strangers:
                continue
            elif workers.isdisjoint(read_ancestors(pid)):
                strangers.add(pid)
            else:
                ours.add(pid)
        return frozenset(ours)


class Dispatcher:
    """The loop: the dispatcher thread's turns over the parts, the only code that asks the
    planner. Caller threads reach what ``PUBLISHED`` names, and nothing else."""

    #: What other threads may reach: the inbox is theirs, the log has a lock of its own, the
    #: rest (what ``public`` and ``workers`` publish) is replaced whole.
    PUBLISHED = frozenset({"inbox", "log", "public", "workers"})

    def __init__(
        self,
        *,
        census: Census,
        devices: list[DeviceState],
        sensor: Sensor,
        asks: AskTable,
        config: PlannerConfig,
        workers: WorkerOptions,
        log: DecisionLog,
        bookings: BookingTable | None = None,
        pool_id: str = "",
        memory: PeakMemory | None = None,
    ) -> None:
        self.asks = asks
        self.initializer = None if workers.initializer is None else workers.initializer[0]
        self.log = log
        self.started_at_s = time.monotonic()
        # The log, not a method of self: a planner that held the dispatcher would be a
        # reference cycle, keeping initargs alive after shutdown until a GC pass.
        self.planner = Planner(census=census, asks=asks, config=config, emit=log.append, now_s=0.0)
        self.inbox = Inbox()
        self.outcomes = Outcomes()
        self.cards = CardReader(devices, sensor)
        self.workers = WorkerSet(devices, sensor, workers, self.inbox.wake_reader)
        # This pool's exchanges with the host-wide booking table (None: sharing is off).
        self.link = (
            None
            if bookings is None
            else BookingLink(
                bookings, pool_id, devices, sensor, self.planner, log, self.started_at_s
            )
        )
        # What earlier runs measured (gpupool._pool.memory), and the contexts file beside
        # the table, which prices each card's workers until their own row is read.
        self.memory = RunMemory(memory, open_context_file(bookings, pool_id), devices)
        # The snapshot other threads read, and the thread (gpupool._pool.snapshot).
        self.public = Public(
            self.planner,
            asks,
            self.outcomes.counts,
            log,
            None if self.link is None else self.link.table,
            self._run,
        )

    def close(self) -> None:
        """Release the dispatcher's descriptors (its thread's last act, or a failed start)."""
        self.inbox.stop()
        self.log.close()
        if self.link is not None:
            self.link.table.close()
        self.workers.close()
        self.inbox.close()

    def refused(self, exc: BaseException) -> None:
        """The pool was refused as it was built (``exc``: strict mode's first width, or any
        error of :meth:`start`): the run the log opened ends with its ``shutdown`` record,
        and the descriptors are given back (no thread will)."""
        try:
            record = self.planner.shutdown_record(
                self.now(),
                self.outcomes.counts,
                tasks_lost=0,
                refused=f"{type(exc).__name__}: {exc}",
            )
            self.log.append(record)
        finally:
            self.close()

    def now(self) -> float:
        return time.monotonic() - self.started_at_s

    def start(self, *, priced: bool) -> None:
        """Record each card's first width, from the census and the bookings other pools hold
        now (the census' co-tenant bytes hold them too: the planner prices them by their
        bookings instead), publish it, and start the thread; raises :class:`WidthError`
        where ``strict=True`` refuses the first width (no thread started)."""
        self._read_cards(census=True)
        note = "" if priced else " (no task_peak: priced at the room)"
        extra = {"allocator_cap": ALLOCATOR_CAP_NOTE} if self.workers.options.cap_allocator else {}
        # Time 0 is the census, however long the readings beside it took on a loaded host.
        refused = self.planner.construct(0.0, note=note, extra=extra)
        if refused is not None:
            raise said.width_error(refused)
        _dispatchers.add(self)
        self.public.start()  # published before the thread: the construction's width and records

    # -- the turn ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # never leave a future pending
            if self.outcomes.forked():
                raise  # a child's sys.exit() in a done-callback that forked: the child's own
            LOGGER.critical("the gpupool dispatcher thread crashed", exc_info=True)
            self._break(f"the gpupool dispatcher thread crashed: {exc!r}", exc)
        finally:
            if not self.outcomes.forked():
                self._wind_up()

    def _wind_up(self) -> None:
        """The dispatcher thread's end: every future settled, the workers stopped, the
        bookings withdrawn, the log's ``shutdown`` record written, the descriptors given
        back. Never in a child a done-callback forked (``Outcomes.forked``): there the
        workers, the log and the bookings are the parent's pool's."""
        self.inbox.stop()  # submit refuses from now on; what came before fails below
        self.public.publish()  # what the turn that crashed had not delivered, delivered
        self.outcomes.deliver(stopping=True)
        if self.outcomes.forked():
            return  # a done-callback forked here, and the child returned from it
        stopped = WorkerLostError("the pool stopped before this task finished")
        for worker in self.workers.stop(STOP_WAIT_S):
            self._fail_items(self.workers.take_queue(worker), stopped)
        self._fail_pending()
        if self.link is not None:
            self.link.withdraw_all()
        if self.link is not None and (skipped := self.link.note(self.log.append, self.now())):
            self.outcomes.counts["bookings_skipped"] = skipped
        lost = self.outcomes.fail_lost()  # never leave a future pending, even after a bug
        self.planner.flush_asks(self.now())
        try:
            self.memory.keep(self.asks)
        except Exception:  # a file of the user's: never a pool that cannot stop
            LOGGER.exception("gpupool could not remember this run's peaks")
        counts = self.outcomes.counts
        self.log.append(self.planner.shutdown_record(self.now(), counts, tasks_lost=lost))
        self.public.publish()  # the last snapshot: what statistics() says from now on
        self.outcomes.deliver(stopping=True)
        if self.outcomes.forked():
            return
        try:
            self.close()
        finally:
            self.public.ended()

    def _loop(self) -> None:
        while True:
            self.inbox.woken()
            kill_signal = self.inbox.kill_signal
            if kill_signal is not None:  # fail what waits to be retried, signal every worker
                self._fail_pending(said.stopped_before_run_error(kill_signal))
                self.workers.kill(kill_signal)
            # What the tasks that ended last turn measured is priced, once per key, before
            # this turn reads a card, starts a task, publishes or delivers a result.
            if self.planner.unsettled:
                self.planner.settle(self.now())
                self._bookings_moved(range(len(self.cards.devices)))  # on any card
            else:
                self._bookings_moved()  # where the planner settled by itself
            poll_s = self._schedule()
            if self.inbox.take_cancel():
                self._cancel_pending()
                poll_s = self._schedule()
            if self.inbox.broken is None and kill_signal is None:
                self._queue_behind_busy()
            # Idle workers a card cannot use now are given back (their contexts are its bytes).
            self.workers.retire_idle(
                functools.partial(self.planner.neighbours.warm_limit, now_s=self.now())
            )
            busy = any(w.task is not None for w in self.workers.all())
            if busy:  # the cards are read every READ_WHILE_RUNNING_S while tasks run
                due_s = self.cards.due_s()
                if due_s <= 0:
                    self._read_cards()
                    due_s = READ_WHILE_RUNNING_S
                poll_s = _sooner(poll_s, due_s)
            # Unacknowledged frames, deadlines, stopped workers (their exits are events).
            poll_s = _sooner(poll_s, self.workers.due(time.monotonic()))
            self.planner.readings.sample_cards(self.now())
            if self.link is not None:
                poll_s = _sooner(poll_s, self.link.flush(self.now()))
                # What the table could not do since the last turn: recorded, and counted.
                if skipped := self.link.note(self.log.append, self.now()):
                    self.outcomes.counts["bookings_skipped"] = skipped
            self.public.publish()  # the end of the turn
            self.outcomes.deliver()  # the turn's outcomes, counted by that snapshot
            if self.outcomes.forked():
                return  # a done-callback forked, and the child returned from it
            if self.inbox.done(holding=bool(self.outcomes.items), busy=busy):
                return
            # Wait for the workers (or a wake-up), and act on each event as it comes.
            for event in self.workers.serve(poll_s):
                if isinstance(event, Answered):
                    try:
                        self._answered(event)
                    except BaseException as exc:
                        if event.item is not None:  # a crash here still ends the task's future
                            self.outcomes.fail(event.item, exc)
                        raise
                elif isinstance(event, Exited):
                    self._exited(event)
                del event  # keep nothing of a finished task

    def _bookings_moved(self, cards: Iterable[int] = ()) -> None:
        """The host's table hears at once of ``cards`` and of those where a running task was
        booked higher (its key's price rose); strict mode's refusal, made at any of them,
        breaks the pool before the results are delivered (the next submit raises)."""
        grown = self.planner.take_grown()
        if self.link is not None:
            for index in {*cards, *grown}:
                self.link.changed(index, self.now())
        refused = self.planner.strict_refusal()
        if refused is not None and self.inbox.broken is None:
            self._break(refused.reason, said.width_error(refused), running_finish=True)

    # -- placing tasks ----------------------------------------------------------------

    def _drain_incoming(self) -> None:
        memory = self.memory
        submitted = False
        while (item := self.inbox.take()) is not None:
            if self.outcomes.take(item):  # else cancelled by its caller first
                if memory.peaks is not None and item.key not in memory.names:
                    # The first task of its key: priced from what earlier runs measured.
                    peak = memory.recall(item)
                    if peak is not None:
                        self.planner.remember(item.key, peak, self.now())
                self.planner.submit(
                    item.task_id,
                    item.key,
                    item.hint_bytes,
                    item.size,
                    item.identity(),
                    features=item.features,
                )
                submitted = True
                item.hint_bytes = None
        if submitted:  # once, after them: nothing between reads the flag
            self.public.tasks_added()

    def _read_cards(self, *, census: bool = False) -> None:
        """One live snapshot of every readable card, for the planner's live gate and own term,
        and the other pools' bookings from the host's table."""
        now = self.now()
        self.cards.reading_all()
        for device in self.cards.devices:
            if device.census.readable:
                reading = self._reading(device, now)
                if reading is not None:
                    self.planner.readings.observe(device.index, reading, now)
                if self.link is not None:
                    self.link.read(device, now, census=census)

    def _reading(self, device: DeviceState, now: float) -> CardReading | None:
        """``device`` read now, or ``None``. Unreadable is not empty: while the reading fails,
        the card runs one task of the pool at a time, as an unreadable card does."""
        reading = self.cards.read(device, [w.pid for w in self.workers.all()])
        if isinstance(reading, str):
            self.planner.readings.observe_error(device.index, reading, now)
            return None
        return reading

    def _schedule(self) -> float | None:
        """Start what the planner admits; returns how soon to ask again (``None``: on an event)."""
        self._drain_incoming()
        read = False
        while True:
            if self.inbox.broken is not None:
                self._fail_pending()
                return None
            if not read and self.planner.has_pending() and self.planner.may_start():
                self._read_cards()
                read = True
                continue
            verdict = self.planner.next_start(
                self.now(), self.workers.counts(self.planner.is_queued)
            )
            if verdict is None or isinstance(verdict, Wait):
                if self.link is not None:
                    self.link.waiting_changed()
                return None if verdict is None else verdict.poll_s
            if isinstance(verdict, Refuse):  # strict mode: the pool breaks
                self._break(verdict.reason, said.width_error(verdict), running_finish=True)
                continue
            item = self.outcomes.items[verdict.task]
            if isinstance(verdict, Fail):
                self.outcomes.fail(item, said.oom_error(said.task_named(item), verdict, None))
            elif isinstance(verdict, Warm):
                retry_s = self._warm(item, verdict.device)
                if retry_s is not None:
                    return retry_s
            else:
                self._start(item, verdict)

    def _warm(self, item: WorkItem, card: int | None) -> float | None:
        """A task fits on ``card`` now but no ready worker is idle: start one for it; how soon
        to try again, when the start failed and is to be tried again.

        Its future is RUNNING from here, as a standard pool's is once handed to a worker's
        queue (a shutdown that cancels pending work no longer takes it), but the planner
        admits it only when a ready worker can run it, against the readings of that moment.
        After ``SPAWN_TRIES`` failed starts in a row it alone fails with the start's error.
        """
        if not self._claim(item):
            return None
        try:
            started = self.workers.spawn(card)
        except StartDataError as exc:
            error = said.start_data_error(self.initializer, exc)
            self._break(str(error), error)
            return None
        if isinstance(started, SpawnFailed):
            self.outcomes.counts["spawn_failures"] += 1
            if started.final:
                self.planner.withdraw(item.task_id)
                self.outcomes.fail(item, said.spawn_error(started))
                return None
        if started is None or isinstance(started, SpawnFailed):
            return self.workers.retry_in_s()
        self.outcomes.counts["workers_started"] += 1
        return None

    def _start(self, item: WorkItem, start: Start) -> None:
        """The planner admitted ``item`` where a ready worker is idle: it runs now."""
        worker = next(w for w in self.workers.on(start.device) if w.task is None and w.open)
        if not self._claim(item):
            return
        if self.link is not None and not self.link.book(start, worker.pid, item.key, self.now()):
            # Another pool booked the room first: the planner now knows, and the
            # task waits (still RUNNING to its future) on a warm worker.
            return
        payload = self._pickled(item)
        if payload is not None:
            self.planner.started(start.task, start.device, worker.pid, self.now())
            self.workers.send(worker, item, payload, start.ask_bytes)

    def _queue_behind_busy(self) -> None:
        """Behind each busy worker, the next tasks of its key where the planner lets them wait
        there (short tasks, in the worker's booking: :mod:`gpupool._core.planner.queued`):
        the worker starts them without waiting for the parent. Their futures are RUNNING
        from here, as a standard pool's queued calls are."""
        limit = self.workers.options.max_tasks_per_child
        for worker in self.workers.all():
            if not self.planner.has_pending():
                return
            head = worker.task
            if head is None or not worker.open:
                continue
            queued = False
            while len(worker.queue) <= QUEUE_DEPTH and (
                limit is None or worker.tasks_done + len(worker.queue) < limit
            ):
                task = self.planner.queue_behind(head.task_id)
                if task is None:
                    break
                item = self.outcomes.items[task]
                # Cancelled first, or unpicklable (its own future failed): withdrawn.
                payload = self._pickled(item) if self._claim(item) else None
                if payload is not None:
                    ask_bytes = self.planner.ask_of(task).ask_bytes
                    self.workers.send(worker, item, payload, ask_bytes, queued=True, now=False)
                    self.outcomes.counts["queued_behind"] += 1
                    queued = True
            if queued:  # the tasks queued behind it, written together
                self.workers.flush(worker)

    def _pickled(self, item: WorkItem) -> bytes | None:
        """``item``'s call pickled to send; ``None`` when it cannot be pickled: as in CPython's
        pool, that fails its own future (withdrawn from the planner)."""
        try:
            return dumps_call(item.call)
        except BaseException as exc:
            self.planner.withdraw(item.task_id)
            self.outcomes.fail(item, said.detached(exc))
            return None

    def _claim(self, item: WorkItem) -> bool:
        """Make ``item``'s future RUNNING (once); ``False`` when the caller cancelled it first
        (it is withdrawn and counted)."""
        if item.started:
            return True
        if self.public.unpublished_tasks:
            self.public.publish()  # before its future is RUNNING: the width counts its task
        if self.outcomes.claim(item):
            return True
        self.planner.withdraw(item.task_id)
        return False

    # -- events ------------------------------------------------------------------------

    def _answered(self, event: Answered) -> None:
        """What the task measured goes to the planner, the task queued behind it runs, and
        its result or error goes to the outbox, last."""
        worker, item, kind = event.worker, event.item, event.kind
        if kind == "init":  # the initializer raised: the pool breaks, as the standard pool's
            assert self.initializer is not None
            error = said.initializer_error(self.initializer, event.payload)
            ran = [item] if item is not None else []
            self._fail_items([*ran, *self.workers.take_queue(worker)], error)
            self._break(str(error), error)
            return
        if item is None:
            return
        if kind == "declined":
            if self.planner.is_queued(item.task_id):
                # Queued behind a task that ran out of device memory, it never ran: back to
                # the head of the queue (RUNNING to its future; not a failure, not a retry).
                self.planner.requeue(item.task_id)
                self.outcomes.counts["queued_declined"] += 1
            else:
                self._not_set_up(worker, item, event.payload)
            if worker.device is not None and self.link is not None:
                self.link.changed(worker.device, self.now())
            return
        if event.report is not None and event.report.context_source == "process-row":
            self.memory.note_context(worker.device, event.report)
        oom = kind == "oom" and event.report is not None
        if oom:
            assert event.report is not None
            self._on_oom(worker, item, event.report, event.payload)
        else:
            # Its peak is a sample now, priced at the top of the next turn.
            self.planner.ended(item.task_id, event.report, self.now(), failed=kind != "ok")
        head = worker.task
        if kind != "oom" and head is not None and self.planner.is_queued(head.task_id):
            # The task queued behind it runs now, in the booking it left (after a device
            # OOM the worker declines it instead).
            self.planner.run_queued(head.task_id, worker.device, worker.pid, self.now())
        # Its card's booking changed, and a failed task's or an out-of-memory's peak raised
        # its key's price.
        self._bookings_moved(() if worker.device is None else (worker.device,))
        if not oom:
            # Last, and nothing of the task kept after it: a caller that drops the
            # result frees it (CPython's gh-58614 test), with no I/O in between.
            self.outcomes.answered(item, kind, event.payload)

    def _not_set_up(self, worker: Worker, item: WorkItem, payload: Any) -> None:
        """``worker`` could not set up the task it was handed (a task before it used up its
        descriptors or memory) and exits: the task never ran, so it goes back to the head of
        the queue for a fresh worker, and nothing more is sent to this one."""
        self.workers.leaves(worker)
        for behind in self.workers.take_queue(worker):  # never ran: back first, in order
            self.planner.requeue(behind.task_id)
        raw = payload if isinstance(payload, (bytes, bytearray, memoryview)) else b""
        why = bytes(raw).decode(errors="replace")
        self.outcomes.counts["workers_replaced"] += 1
        self.planner.not_run(
            item.task_id,
            self.now(),
            message=(
                f"worker {worker.pid} could not set up its next task ({truncate_text(why)}): "
                "a task before it used up the worker's descriptors or memory; the worker "
                "exits and the task runs on a fresh one"
            ),
            extra={"pid": worker.pid, "cause": truncate_text(why)},
        )

    def _on_oom(self, worker: Worker, item: WorkItem, report: PeakReport, payload: Any) -> None:
        exc = said.load_exception(payload)
        device = self.cards.devices[worker.device] if worker.device is not None else None
        readable = device is not None and device.census.readable
        reading = self._reading(device, self.now()) if device is not None and readable else None
        if device is not None and reading is not None and self.link is not None:
            # Other pools' bookings as they stand now: terms of the record.
            self.link.read_for_record(device, reading.process_bytes or {}, self.now())
        verdict = self.planner.out_of_memory(
            item.task_id, report, reading, self.now(), error=f"{type(exc).__name__}: {exc}"
        )
        if device is not None and reading is not None:
            # After the record, which names the own high-water the tasks were priced at.
            self.planner.readings.observe(device.index, reading, self.now())
        if not isinstance(verdict, Retry):  # else held pending again, at its queue's head
            if report.oom_recognised == "card-full":
                # Taken for an out-of-memory by the card's state, not by what it said: past
                # the retries the task's own error reaches its future, as it was raised.
                self.outcomes.fail(item, exc)
            else:
                self.outcomes.fail(item, said.oom_error(said.task_named(item), verdict, exc))

    def _exited(self, event: Exited) -> None:
        """A worker's process ended: only the task it ran fails, and the tasks queued behind
        it (which never ran) go back to the planner's queue in their order.

        A worker that dies before it is ready breaks the pool instead, when an initializer
        is set or after ``SPAWN_TRIES`` in a row (after shutdown() too: the pending work
        still needs workers): no task ran in it.
        """
        worker = event.worker
        queue = self.workers.take_queue(worker)
        if event.boot_deaths:
            if self.initializer is not None or event.boot_deaths >= SPAWN_TRIES:
                error = said.boot_error(event, self.initializer)
                self._fail_items(queue, error)
                self._break(str(error), error)
            return
        # Its run, unless it ran none, or only a task queued behind one that ran out of
        # memory, which it was to decline and so never ran.
        run = queue.pop(0) if queue and not self.planner.is_queued(queue[0].task_id) else None
        for behind in queue:
            self.planner.requeue(behind.task_id)
        if run is None:
            return
        # Its frame not acknowledged: the worker never read it (another reader took it, the
        # stream was garbled, or the worker died first), so it never ran.
        unread = worker.ending == "unread" or (
            worker.ending is None and worker.head_read is None and not event.by_pool
        )
        if unread and worker.fault is None and run.unread < UNREAD_TRIES:
            # Back to the head of the queue, for another worker (not a retry).
            run.unread += 1
            message, extra = said.unread_note(event, said.task_named(run))
            self.planner.not_run(run.task_id, self.now(), message=message, extra=extra)
        else:
            lost, extra = said.lost_error(event, said.task_named(run), timeout_s=run.timeout_s)
            timed_out = worker.ending == "timeout"
            self.planner.lost(
                run.task_id,
                self.now(),
                message=str(lost),
                extra=extra,
                event="task_timeout" if timed_out else "worker_lost",
            )
            self.outcomes.fail(run, lost)
        if worker.device is not None and self.link is not None:
            self.link.changed(worker.device, self.now())

    # -- ending ------------------------------------------------------------------------

    def _fail_items(self, items: Iterable[WorkItem], error: BaseException) -> None:
        """Fail ``items``, handed to a worker, with a copy of ``error`` each; release their
        bookings (nothing is learned from a task that did not end by itself)."""
        for item in items:
            self.planner.finished(item.task_id, None, self.now(), failed=True)
            self.outcomes.fail(item, copy_broken(error, str(error)))

    def _break(self, message: str, exc: BaseException, *, running_finish: bool = False) -> None:
        """The pool is broken: ``submit`` raises from now on, and every task not handed to
        a worker fails with ``exc``; those handed to workers too, unless ``running_finish``
        (strict mode's refusal to narrow: what runs ran at the width asked for, and is let
        finish and deliver). The first break's error is the pool's."""
        self.inbox.break_with(message, exc)
        self._fail_pending()
        if not running_finish:
            for worker in self.workers.all():
                self._fail_items(self.workers.take_queue(worker), exc)

    def _fail_pending(self, lost: WorkerLostError | None = None) -> None:
        """End every task not handed to a worker: with the pool's error when it is broken,
        else cancelled, or (started to its future) failed with a copy of ``lost`` (by
        default: the pool stopped before it ran)."""
        if lost is None:
            lost = WorkerLostError("the pool stopped before this task ran")
        self._drain_incoming()
        broken = self.inbox.broken
        for task in self.planner.pending_tasks():
            item = self.outcomes.items.pop(task)
            self.planner.withdraw(task)
            if broken is None and self.outcomes.cancel(item):
                continue
            # Broken, or started to its future (or, broken, cancelled by its caller first:
            # counted so by the outcomes).
            error = copy_broken(self.inbox.broken_exc, broken) if broken else copy_broken(lost, "")
            self.outcomes.fail(item, error)

    def _cancel_pending(self) -> None:
        """``shutdown(cancel_futures=True)``: cancel what has not started (after what fits now
        has started, as CPython's does with its call queue)."""
        self._drain_incoming()
        held = self.outcomes.items
        items = [held[t] for t in self.planner.pending_tasks() if not held[t].started]
        # A task waiting for room after a lone out-of-memory has started (its future is
        # RUNNING, so it cannot be cancelled), but nothing of it runs: it fails now rather
        # than hold the shutdown for up to room_wait_s.
        for item in [held[t] for t in self.planner.waiting_for_room()]:
            self.planner.withdraw(item.task_id)
            ask_bytes = self.asks.ask(item.key).ask_bytes
            self.outcomes.fail(item, said.cancelled_waiting_error(item.key, ask_bytes))
        # A cancelled future's callbacks may call shutdown(): the inbox's lock is not held.
        for item in items:
            item.future.cancel()  # then let go when the planner offers it (_claim)
