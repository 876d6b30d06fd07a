"""The dispatcher: one thread per pool that owns every scheduling decision (process layer).

Data flow::

    caller threads             dispatcher thread                      workers (spawned processes)
    --------------             -----------------                      -----------------------
    submit(fn, *a) -> incoming -> planner.submit (PENDING)
                      deque       read each card once (one snapshot)
                                  planner.next_start -> Start/Wait/Fail
                                  Start: a warm or new worker         -> (task id, task)
                                  (RUNNING once handed over)             probe.start(); fn(*a)
                                                                         probe.stop() -> report
                    futures  <-   result / error / oom / worker death  <- (pid, task, kind, report)
                                  planner.ended (settled next turn) / oom /
                                  lost; its records -> DecisionLog
    statistics(), width  <-       snapshot (PoolSnapshot, replaced whole at the end
                                  of each turn and before a future changes state)

This module is mechanism only: the thread, the pipes, the workers and the
futures. Every price, admission and width decision is made by the planner
(:mod:`gpupool._core.planner`), which touches none of them. Tasks held back
for memory stay PENDING in the parent, so ``cancel()`` works on them; a task
becomes RUNNING only when it is handed to a worker, and a worker runs one
task at a time, so the pool always knows which task a dead worker was
running. Workers are started lazily (:mod:`gpupool._pool.launch`) with their
device pinned in the environment before any import, kept warm, and retired
when the planner's limit for their card falls below them.

Why not ``loky.ProcessPoolExecutor`` itself: it starts every worker at the
first submit, takes one environment per executor, hands queued work to
workers where it can no longer be cancelled, and breaks the whole executor
when one worker dies. gpupool needs the opposite on each count, so it starts
its workers itself (fork+exec with a per-process ``env``, cloudpickle:
:mod:`gpupool._pool.launch`) under a dispatcher of its own.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import os
import select
import selectors
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool, _RemoteTraceback
from typing import TYPE_CHECKING, Any, cast

import cloudpickle

from gpupool._broken import InitializerError, WorkerLostError, WorkerProtocolError
from gpupool._child.probe import allocator_cap_message
from gpupool._core.bookings import group_waits, last_decision
from gpupool._core.census import CardCensus, Census
from gpupool._core.events import Decision
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
    Wait,
    Warm,
    Workers,
)
from gpupool._core.policy import AskTable
from gpupool._core.units import format_size
from gpupool._errors import DeviceOutOfMemoryError, GpuPoolError, WidthError
from gpupool._observe.log import LOGGER, DecisionLog
from gpupool._pool import wire
from gpupool._pool.booking_link import BookingLink
from gpupool._pool.by_value import dumps_call, sender_ids
from gpupool._pool.channel import Channel, ChannelClosed, ChannelCorrupt
from gpupool._pool.launch import StartDataError, WorkerContext
from gpupool._pool.reaper import POLL_WITHOUT_PIDFD_S, ProcessWatch, signal_tree
from gpupool._pool.snapshot import PoolSnapshot, take_snapshot
from gpupool._pool.worker import worker_main
from gpupool._sensors.host import read_ancestors

if TYPE_CHECKING:
    from gpupool._sensors.base import DeviceInfo, Sensor
    from gpupool._sensors.bookings import BookingTable

__all__ = [
    "DeviceState",
    "Dispatcher",
    "WorkItem",
    "callable_name",
    "copy_broken",
    "interpreter_exiting",
]

#: How long shutdown waits for workers told to exit before it kills them.
STOP_WAIT_S = 10.0

#: Tries to start a worker for one task before that task fails with the start's
#: error (EMFILE, EAGAIN, ENOMEM...); the waits between them grow from the first
#: by a factor of four: 0.05, 0.2, 0.8, 3.2 s (4.25 s in all). Only the task that
#: needed the worker fails; the pool and its running tasks go on.
SPAWN_TRIES = 5
#: While tasks run, the cards are read at least this often (the planner samples
#: these readings into the decision log, coalesced: see ``card_read``).
READ_WHILE_RUNNING_S = SAMPLE_MIN_GAP_S
SPAWN_FIRST_WAIT_S = 0.05

#: How long the pool waits for a worker whose initializer raised to exit (it
#: exits right after saying so) before it reports itself broken.
INIT_EXIT_WAIT_S = 5.0

#: The most waiting tasks a row of the host's booking table describes by key (for people).
_WAITS_SCANNED = 64

_BROKEN_INIT = "A child process terminated abruptly, the process pool is not usable anymore"

_dispatchers: weakref.WeakSet[Dispatcher] = weakref.WeakSet()
_global_shutdown = False


def _python_exit() -> None:
    """At interpreter exit, let every pool finish its submitted work, as CPython's does."""
    global _global_shutdown
    _global_shutdown = True
    for dispatcher in list(_dispatchers):
        dispatcher.request_shutdown()
    for dispatcher in list(_dispatchers):
        dispatcher.join()


threading._register_atexit(_python_exit)  # type: ignore[attr-defined]


def interpreter_exiting() -> bool:
    """Whether the interpreter has begun to exit (``submit`` then refuses new work)."""
    return _global_shutdown


class WorkItem:
    """One submitted task: its future, its call, its key, and whether it started.

    ``call`` is ``(fn, args, kwargs)`` as given: it is pickled when it is sent to
    a worker (as CPython's pool pickles in its feeder thread), so the parent
    never holds a pickled copy of work that waits. Everything the pool prices
    about it (its booking, its retries, where it may run) is the planner's,
    under the item's ``task_id``.
    """

    __slots__ = ("call", "future", "hint_bytes", "key", "size", "started", "task_id", "tries")

    def __init__(
        self,
        future: Future[Any],
        call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]],
        key: str,
        hint_bytes: int | None,
        size: float | None = None,
    ) -> None:
        self.future = future
        self.call = call
        self.key = key
        self.hint_bytes = hint_bytes
        self.size = size
        self.started = False
        self.tries = 0
        self.task_id = next(_task_ids)


_task_ids = itertools.count()


class _Worker:
    """One worker process and the tasks handed to it: ``queue[0]`` runs (a worker runs one
    task at a time), and a short task of its key may wait behind it (planner/queued).

    ``ready`` turns true when the worker says so: its initializer returned and
    its probe is set up. ``resident_bytes`` is what it held on its card then
    (a model its initializer loaded, its context), ``None`` when unknown.
    """

    __slots__ = (
        "channel",
        "conn",
        "device",
        "fault",
        "frames",
        "gone",
        "pid",
        "process",
        "queue",
        "ready",
        "resident_bytes",
        "retiring",
        "started_s",
        "tasks_done",
        "watch",
    )

    def __init__(self, process: Any, conn: Any, device: int | None) -> None:
        self.process = process
        self.conn = conn
        self.channel = Channel(conn, magic=wire.ANSWER_MAGIC, min_frame_bytes=wire.MIN_ANSWER_BYTES)
        self.watch = ProcessWatch(process)
        # Frames read but not yet handled (one answer each).
        self.frames: collections.deque[bytearray] = collections.deque()
        # What it sent that broke the protocol (quoted), once it did: it is being killed.
        self.fault: str | None = None
        self.device = device
        self.pid: int = process.pid
        self.queue: collections.deque[WorkItem] = collections.deque()
        self.tasks_done = 0
        self.retiring = False
        self.gone = False
        self.started_s = 0.0
        self.ready = False
        self.resident_bytes: int | None = None

    @property
    def task(self) -> WorkItem | None:
        """The task running now, or ``None`` when idle."""
        return self.queue[0] if self.queue else None


class DeviceState:
    """One card the pool uses: how to reach it and the workers pinned to it."""

    __slots__ = ("census", "index", "info", "workers")

    def __init__(self, index: int, info: DeviceInfo, census: CardCensus) -> None:
        self.index = index
        self.info = info
        self.census = census
        self.workers: list[_Worker] = []


class Dispatcher:
    """Owns the workers, pipes and futures; only its thread changes them (submit only appends).

    Every price, admission and width decision is the planner's
    (:class:`gpupool._core.planner.Planner`): before every start the
    dispatcher reads each card once (free and per-process bytes in one
    snapshot), tells the planner, and does what its verdict says.
    """

    def __init__(
        self,
        *,
        census: Census,
        devices: list[DeviceState],
        sensor: Sensor,
        asks: AskTable,
        config: PlannerConfig,
        max_tasks_per_child: int | None,
        initializer: tuple[Callable[..., object], tuple[Any, ...]] | None,
        log: DecisionLog,
        env: Mapping[str, str],
        cap_allocator: bool = False,
        bookings: BookingTable | None = None,
        pool_id: str = "",
    ) -> None:
        self.census = census
        self.devices = devices
        self.sensor = sensor
        self.asks = asks
        self.config = config
        self.max_tasks_per_child = max_tasks_per_child
        self.initializer = initializer
        self.log = log
        self.env = dict(env)
        self.cap_allocator = cap_allocator
        self.context = WorkerContext()
        self.started_at_s = time.monotonic()
        # The log, not a method of self: a planner that held the dispatcher would be a
        # reference cycle, keeping initargs alive after shutdown until a GC pass.
        self.planner = Planner(census=census, asks=asks, config=config, emit=log.append, now_s=0.0)
        self.lock = threading.Lock()
        # Submitted by caller threads, not yet seen by the planner.
        self.incoming: collections.deque[WorkItem] = collections.deque()
        # Every task the planner holds (pending or running), by task id.
        self.items: dict[int, WorkItem] = {}
        # Every future not yet done: the shutdown record counts what is left (none, or a bug).
        self.unresolved: set[Future[Any]] = set()
        self.host_workers: list[_Worker] = []
        self.processes: dict[int, Any] = {}
        self.shutdown_requested = False
        self.cancel_requested = False
        self.stopped = False
        self.kill_signal: int | None = None
        self.signalled: set[tuple[int, int]] = set()
        self.broken: str | None = None
        self.broken_exc: BaseException | None = None
        # A non-blocking pipe wakes the dispatcher: one byte per wake-up, drained
        # with one read, so a burst of submits costs a burst of one-byte writes at most.
        self.wake_reader, self.wake_writer = os.pipe()
        os.set_blocking(self.wake_reader, False)
        os.set_blocking(self.wake_writer, False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.wake_reader, selectors.EVENT_READ, None)
        self.wake_flag = False
        self.counts = collections.Counter[str]()
        # Failed worker starts in a row, and when the next try may be made.
        self.spawn_failures = 0
        self.spawn_retry_at_s = 0.0
        # Workers in a row that died before they were ready (no task had been handed to them).
        self.boot_deaths = 0
        # The host-wide booking table (None: sharing is off), and this pool's exchanges
        # with it (per change, coalesced: see booking_link).
        self.bookings = bookings
        self.pool_id = pool_id
        self.link = (
            None
            if bookings is None
            else BookingLink(bookings, pool_id, devices, sensor, self.planner, _weak_notes(self))
        )
        # When the cards were last read (monotonic seconds).
        self.read_s = 0.0
        # Per card, the rows of its readings found not to be under any worker (_pool_pids).
        self.not_pool_pids: dict[int, set[int]] = {}
        # Tasks submitted (under ``lock``, by caller threads), and the snapshot readers on
        # other threads read: only the dispatcher thread replaces it, in one assignment.
        self.submitted_count = 0
        self.snapshot: PoolSnapshot = take_snapshot(
            self.planner, asks, self.counts, log_write_errors=0, last=None
        )
        self.publish_failed = False
        # Tasks handed to the planner since the last snapshot (one taken before any of their
        # futures is RUNNING, so that width and widths_by_key count them).
        self.unpublished_tasks = False
        # Results of this turn's tasks, set at its end (_deliver), after its snapshot.
        self.results: list[tuple[Future[Any], Any]] = []
        self.thread = threading.Thread(target=self._run, name="gpupool-dispatcher", daemon=True)

    # -- what the planner decided (read by the executor) -------------------------------

    @property
    def submitted(self) -> int:
        """Tasks handed to the pool, counted at submit (under the lock, in the caller's thread)."""
        with self.lock:
            return self.submitted_count

    def publish(self) -> None:
        """Replace :attr:`snapshot` with what the planner holds now, in one assignment.

        Called only where the planner is not shared: before the thread starts, then by the
        thread itself at the end of every turn, before a future becomes RUNNING or done (so a
        caller never sees a future newer than the statistics it reads), and at shutdown after
        the last record. A value that did not change is the same object as before.
        """
        self.unpublished_tasks = False
        try:
            self.snapshot = take_snapshot(
                self.planner,
                self.asks,
                self.counts,
                log_write_errors=self.log.write_errors,
                bookings_unavailable=None
                if self.bookings is None
                else self.bookings.unavailable_reason,
                last=self.snapshot,
            )
        except Exception:
            # A stale snapshot, never a future left pending: this runs as futures are set.
            if not self.publish_failed:
                self.publish_failed = True
                LOGGER.exception("gpupool could not take the statistics snapshot")

    # -- called from caller threads -------------------------------------------------

    def start(self) -> None:
        _dispatchers.add(self)
        self.publish()  # before the thread: the construction's width and records
        self.thread.start()

    def _wake_locked(self) -> None:
        """Wake the dispatcher; the caller holds ``self.lock`` (so the pipe is still open)."""
        if not self.wake_flag and not self.stopped:
            self.wake_flag = True
            try:
                os.write(self.wake_writer, b"\0")
            except BlockingIOError:
                pass  # full: the dispatcher has wake-ups to read anyway

    def enqueue(self, item: WorkItem) -> None:
        """Hand a task to the dispatcher.

        Raises:
            BrokenProcessPool: the pool broke (checked under the dispatcher's lock,
                so no task is appended after the dispatcher has stopped).
            RuntimeError: the dispatcher has stopped.
        """
        with self.lock:
            if self.broken is not None:
                raise copy_broken(self.broken_exc, self.broken)
            if self.stopped:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self.incoming.append(item)
            self.submitted_count += 1
            self.unresolved.add(item.future)
            self._wake_locked()
        # Outside the lock: a future already done runs the callback at once.
        item.future.add_done_callback(self.unresolved.discard)

    def request_shutdown(self, cancel_futures: bool = False) -> None:
        """Stop taking work; with ``cancel_futures`` the dispatcher cancels what it has not
        started, after it has started what fits now (as CPython's does with its call queue)."""
        with self.lock:
            self.shutdown_requested = True
            if cancel_futures:
                self.cancel_requested = True
            self._wake_locked()

    def request_kill(self, sig: int) -> None:
        """``terminate_workers``/``kill_workers``: cancel what has not started, fail what
        waits to be retried, start nothing more, and signal every worker (the dispatcher
        does it, so a worker being started right now is signalled too)."""
        with self.lock:
            self.shutdown_requested = True
            self.cancel_requested = True
            self.kill_signal = sig
            self._wake_locked()

    def _kill_workers(self) -> None:
        assert self.kill_signal is not None
        self._drain_incoming()
        for task in self.planner.pending_tasks():
            item = self.items.pop(task)
            self.planner.withdraw(task)
            if item.started:
                self._fail(item, WorkerLostError("the pool's workers were stopped before this ran"))
            elif item.future.cancel():
                item.future.set_running_or_notify_cancel()
                self.counts["cancelled"] += 1
        for worker in self._all_workers():
            sent = (worker.pid, self.kill_signal)  # SIGKILL after SIGTERM is sent too
            if sent not in self.signalled:
                self.signalled.add(sent)
                signal_tree(worker.pid, self.kill_signal)

    def _cancel_pending(self) -> None:
        with self.lock:
            self.cancel_requested = False
        self._drain_incoming()
        items = [self.items[t] for t in self.planner.pending_tasks() if not self.items[t].started]
        # A task waiting for room after a lone out-of-memory has started (its future is
        # RUNNING, so it cannot be cancelled), but nothing of it runs: it fails now rather
        # than hold the shutdown for up to room_wait_s.
        waiting = [self.items.pop(t) for t in self.planner.waiting_for_room()]
        for item in waiting:
            self.planner.withdraw(item.task_id)
            self._fail(
                item,
                DeviceOutOfMemoryError(
                    f"a task of {item.key} ran out of device memory alone and was waiting for "
                    "room when the pool was shut down with cancel_futures=True",
                    device=None,
                    ask_bytes=self.asks.ask(item.key).ask_bytes,
                    detail="shut down while waiting for room",
                ),
            )
        # Outside the lock: a cancelled future's callbacks may call shutdown().
        for item in items:
            item.future.cancel()

    def close(self) -> None:
        """Release the dispatcher's descriptors (its thread's last act, or a failed start)."""
        with self.lock:
            self.stopped = True
        self.log.close()
        if self.bookings is not None:
            self.bookings.close()
        self.selector.close()
        os.close(self.wake_reader)
        os.close(self.wake_writer)

    def join(self, timeout: float | None = None) -> None:
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    # -- the dispatcher thread --------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.started_at_s

    def record(self, decision: Decision) -> None:
        self.log.append(decision)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # never leave a future pending
            LOGGER.critical("the gpupool dispatcher thread crashed", exc_info=True)
            self._break(f"the gpupool dispatcher thread crashed: {exc!r}", exc)
        finally:
            with self.lock:
                self.stopped = True  # enqueue refuses from now on; what came before fails below
            self._stop_workers()
            if self.link is not None:
                self.link.withdraw_all()
            self._note_table()
            if self.results:  # results the turn that crashed had not delivered
                self.publish()
                try:
                    self._deliver()
                except BaseException:  # a callback's, again: the futures are set all the same
                    LOGGER.exception("a done-callback raised as the pool stopped")
            lost = list(self.unresolved)
            for future in lost:  # never leave a future pending, even after a bug
                self._resolve_error(future, WorkerLostError("the pool stopped and lost this task"))
            self.planner.flush_asks(self.now())
            self.record(self.planner.shutdown_record(self.now(), self.counts, tasks_lost=len(lost)))
            self.publish()  # the last one: what statistics() says from now on
            self.close()

    def _all_workers(self) -> list[_Worker]:
        if not self.devices:
            return self.host_workers
        workers = list(self.host_workers)
        for device in self.devices:
            workers.extend(device.workers)
        return workers

    def _loop(self) -> None:
        while True:
            try:
                while os.read(self.wake_reader, 4096):
                    pass
            except BlockingIOError:
                pass
            self.wake_flag = False
            if self.kill_signal is not None:
                self._kill_workers()
            self._settle_asks()
            poll_s = self._schedule()
            if self.cancel_requested:
                self._cancel_pending()
                poll_s = self._schedule()
            if self.broken is None and self.kill_signal is None:
                self._queue_behind_busy()
            self._retire_beyond_limits()
            workers = self._all_workers()
            busy = any(w.task is not None for w in workers)
            if busy:
                poll_s = self._read_while_running(poll_s)
            self.planner.sample_cards(self.now())
            if self.link is not None:
                due_s = self.link.flush(self.now())
                if due_s is not None:
                    poll_s = due_s if poll_s is None else min(poll_s, due_s)
            self._note_table()
            self.publish()  # the end of the turn
            self._deliver()  # the turn's results, counted by that snapshot
            with self.lock:
                idle_pool = not self.incoming and not self.items and not busy
                if self.shutdown_requested and idle_pool:
                    return
                if self.broken is not None and not busy:
                    return
            self._wait_and_serve(workers, poll_s)

    def _settle_asks(self) -> None:
        """Price what the tasks that ended last turn measured, once per key, before this
        turn reads a card, starts a task, publishes or delivers a result (a failure
        given mid-turn gives the results before it: :meth:`_resolve_error` settles first);
        then what moved is told (:meth:`_bookings_moved`)."""
        if self.planner.unsettled:
            self.planner.settle(self.now())
            self._bookings_moved(range(len(self.devices)))  # moved either way, on any card
        else:
            self._bookings_moved()  # where the planner settled by itself

    def _bookings_moved(self, cards: Iterable[int] = ()) -> None:
        """The host's table hears at once of ``cards`` and of those where a running task was
        booked higher (its key's price rose: at a settle, or when a failed task or an
        out-of-memory raised it); strict mode's refusal, made at any of them, breaks the
        pool before the results are delivered (the next submit raises)."""
        grown = self.planner.take_grown()
        if self.link is not None:
            for index in {*cards, *grown}:
                self.link.changed(index, self.now())
        refused = self.planner.strict_refusal()
        if refused is not None:
            self._refuse(refused)

    def _wait_and_serve(self, workers: list[_Worker], timeout_s: float | None) -> None:
        """Wait for the selector, then write, read and reap what it says is ready."""
        unwatched = [w for w in workers if w.watch.pidfd is None]
        if unwatched:
            # No pidfd: the sentinel may be held by a grandchild, so ask waitpid too.
            timeout_s = (
                POLL_WITHOUT_PIDFD_S if timeout_s is None else min(timeout_s, POLL_WITHOUT_PIDFD_S)
            )
        ready = self.selector.select(timeout_s)
        ended: list[_Worker] = []
        for key, events in ready:
            if not key.data:
                continue
            worker, what = key.data
            if worker.gone:
                continue
            if what == "exit":
                ended.append(worker)
                continue
            if events & selectors.EVENT_WRITE:
                self._flush(worker)
            if events & selectors.EVENT_READ and not worker.gone:
                self._receive(worker)
        ended.extend(w for w in unwatched if w not in ended and w.watch.exitcode() is not None)
        for worker in ended:
            if not worker.gone:
                self._reap(worker)

    # -- placing tasks ----------------------------------------------------------------

    def _drain_incoming(self) -> None:
        """Hand what callers submitted to the planner (cancelled ones are settled here)."""
        while True:
            with self.lock:
                if not self.incoming:
                    return
                item = self.incoming.popleft()
            if item.future.cancelled():
                # CANCELLED -> CANCELLED_AND_NOTIFIED: wakes wait() and as_completed().
                item.future.set_running_or_notify_cancel()
                self.counts["cancelled"] += 1
                continue
            self.items[item.task_id] = item
            self.planner.submit(item.task_id, item.key, item.hint_bytes, item.size)
            self.unpublished_tasks = True
            item.hint_bytes = None

    def _read_cards(self, *, census: bool = False) -> None:
        """One live snapshot of every readable card, for the planner's live gate and own term,
        and the other pools' bookings from the host's table."""
        now = self.now()
        self.read_s = time.monotonic()
        for device in self.devices:
            if not device.census.readable:
                continue
            reading = self._snapshot(device)
            if reading is not None:
                self.planner.observe(device.index, reading, now)
            if self.link is not None:
                self.link.read(device, now, census=census)

    def _read_while_running(self, poll_s: float | None) -> float | None:
        """While tasks run, read the cards every :data:`READ_WHILE_RUNNING_S` (the log's
        samples of what the cards held come from these readings); returns the turn's wait."""
        due_s = self.read_s + READ_WHILE_RUNNING_S - time.monotonic()
        if due_s <= 0:
            self._read_cards()
            due_s = READ_WHILE_RUNNING_S
        return due_s if poll_s is None else min(poll_s, due_s)

    def read_census_terms(self) -> None:
        """Before the first decision: what other pools hold now is in the census' co-tenant
        bytes; the planner prices them by their bookings instead."""
        self._read_cards(census=True)

    def _snapshot(self, device: DeviceState) -> CardReading | None:
        try:
            memory, rows = self.sensor.read_snapshot(device.info)
        except Exception as exc:
            # Unreadable is not empty: while the live reading fails, the card
            # runs one task of the pool at a time, as an unreadable card does.
            self.planner.observe_error(device.index, f"{type(exc).__name__}: {exc}", self.now())
            return None
        process_bytes = None
        pool_pids: frozenset[int] = frozenset()
        if rows is not None:
            process_bytes = {r.pid: r.used_bytes or 0 for r in rows}
            pool_pids = self._pool_pids(device.index, process_bytes)
        return CardReading(
            free_bytes=memory.free_bytes,
            used_bytes=memory.used_bytes,
            process_bytes=process_bytes,
            pool_pids=pool_pids,
        )

    def _pool_pids(self, device: int, rows: Mapping[int, int]) -> frozenset[int]:
        """The rows' PIDs that are the pool's workers (on any card) or were started under
        one (a task's subprocess): the pool's bytes, never a co-tenant's.

        A row found not to be under any worker is not walked again while it stays in the
        rows (a process is never re-parented under a worker), so the cards' readings every
        0.2 s walk ``/proc`` only for rows that are new."""
        workers = frozenset(w.pid for w in self._all_workers())
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

    def _schedule(self) -> float | None:
        """Start what the planner admits; returns how soon to ask again (``None``: on an event)."""
        self._drain_incoming()
        read = False
        while True:
            if self.broken is not None:
                self._fail_pending()
                return None
            if not read and self.planner.has_pending() and self.planner.may_start():
                self._read_cards()
                read = True
                continue
            verdict = self.planner.next_start(self.now(), self._worker_counts())
            if verdict is None:
                self._waiting_changed()
                return None
            if isinstance(verdict, Wait):
                self._waiting_changed()
                return verdict.poll_s
            if isinstance(verdict, Refuse):
                self._refuse(verdict)  # strict mode: the pool breaks
                continue
            item = self.items[verdict.task]
            if isinstance(verdict, Warm):
                # A task fits there now but no ready worker is idle: start one for it. Its
                # future is RUNNING from here, as a standard pool's is once handed to a
                # worker's queue (a shutdown that cancels pending work no longer takes it),
                # but the planner admits it only when a ready worker can run it (the ready
                # message is an event), against the readings of that moment.
                if not self._claim(item):
                    continue
                device = self.devices[verdict.device] if verdict.device is not None else None
                pool = device.workers if device is not None else self.host_workers
                if self._start_for(item, device, pool) is None:
                    if verdict.task not in self.items:
                        continue  # it failed: the start's error is in its future
                    return max(0.01, self.spawn_retry_at_s - time.monotonic())
                continue
            if isinstance(verdict, Fail):
                self.items.pop(verdict.task, None)
                self._fail_oom(item, verdict, None)
                continue
            device = self.devices[verdict.device] if verdict.device is not None else None
            pool = device.workers if device is not None else self.host_workers
            # The planner admitted it where a ready worker is idle: it runs now.
            worker = next(w for w in pool if w.task is None and w.ready and not w.retiring)
            if not self._claim(item):
                continue
            if self.link is not None and not self.link.book(
                verdict, worker.pid, item.key, self.now()
            ):
                # Another pool booked the room first: the planner now knows, and the
                # task waits (still RUNNING to its future) on a warm worker.
                continue
            payload = self._pickled(item)
            if payload is None:
                continue
            self.planner.started(verdict.task, verdict.device, worker.pid, self.now())
            self._send(item, worker, verdict.ask_bytes, payload)
            del payload

    def _queue_behind_busy(self) -> None:
        """Behind each busy worker, the next task of its key where the planner lets it wait
        there (short tasks, in the worker's booking: :mod:`gpupool._core.planner.queued`):
        the worker starts it without waiting for the parent. Its future is RUNNING from
        here, as a standard pool's queued call is."""
        limit = self.max_tasks_per_child
        for worker in self._all_workers():
            if not self.planner.has_pending():
                return
            head = worker.task
            if (
                head is None
                or not worker.ready
                or worker.retiring
                or worker.gone
                or worker.fault is not None
            ):
                continue
            queued = False
            while len(worker.queue) <= QUEUE_DEPTH and (
                limit is None or worker.tasks_done + len(worker.queue) < limit
            ):
                if not self._queue_one_behind(worker, head):
                    break
                queued = True
            if queued:  # the tasks queued behind it, written together
                self._write_queued(worker)

    def _queue_one_behind(self, worker: _Worker, head: WorkItem) -> bool:
        """Queue the next task behind ``worker``'s run ``head``, where the planner lets it;
        whether one was queued (or withdrawn: then the next may be)."""
        task = self.planner.queue_behind(head.task_id)
        if task is None:
            return False
        item = self.items[task]
        if not self._claim(item):
            return True  # cancelled first: withdrawn from the planner
        payload = self._pickled(item)
        if payload is None:
            return True  # failed its own future: withdrawn from the planner
        self._send(
            item, worker, self.planner.ask_of(task).ask_bytes, payload, queued=True, now=False
        )
        self.counts["queued_behind"] += 1  # handed to the worker (not one withdrawn above)
        return True

    def _pickled(self, item: WorkItem) -> bytes | None:
        """``item``'s call pickled to send; ``None`` when it cannot be pickled: as in CPython's
        pool, that fails its own future (withdrawn from the planner)."""
        try:
            return dumps_call(item.call)
        except BaseException as exc:
            self.items.pop(item.task_id, None)
            self.planner.withdraw(item.task_id)
            self._fail(item, _detached(exc))
            return None

    def _running_item(self, worker: _Worker) -> WorkItem | None:
        """The task ``worker`` was running when it was lost, taken off its queue; ``None`` when
        it ran none, or only a task queued behind one that ran out of memory, which it was
        to decline and so never ran (that one goes back to the queue with the others)."""
        if not worker.queue or self.planner.is_queued(worker.queue[0].task_id):
            return None
        return worker.queue.popleft()

    def _requeue_behind(self, worker: _Worker) -> None:
        """``worker`` is gone: the tasks queued behind its run never ran, so they go back to
        the planner's queue in their order (their futures stay RUNNING) and start
        elsewhere."""
        for item in worker.queue:
            self.planner.requeue(item.task_id)
        worker.queue.clear()

    def _claim(self, item: WorkItem) -> bool:
        """Make ``item``'s future RUNNING (once); ``False`` when the caller cancelled it first
        (it is withdrawn and counted)."""
        if item.started:
            return True
        if self.unpublished_tasks:
            self.publish()  # before its future is RUNNING: the width counts its task
        if not item.future.set_running_or_notify_cancel():
            self.items.pop(item.task_id, None)
            self.planner.withdraw(item.task_id)
            self.counts["cancelled"] += 1
            return False
        item.started = True
        return True

    def _worker_counts(self) -> Workers:
        """The workers per card as the planner needs them: ready and idle, and booting.

        A worker whose run ran out of device memory, with the tasks queued behind it yet to
        be declined, runs nothing and is idle once it has declined them (answers, so
        events): it counts as booting, so that no other worker is started in its place."""
        ready: dict[int | None, int] = {}
        booting: dict[int | None, int] = {}
        for worker in self._all_workers():
            if worker.gone or worker.retiring:
                continue
            head = worker.task
            if not worker.ready or (head is not None and self.planner.is_queued(head.task_id)):
                booting[worker.device] = booting.get(worker.device, 0) + 1
            elif head is None:
                ready[worker.device] = ready.get(worker.device, 0) + 1
        return Workers(ready=ready, booting=booting)

    def _start_for(
        self, item: WorkItem, device: DeviceState | None, pool: list[_Worker]
    ) -> _Worker | None:
        """Start a worker for ``item``; ``None`` when it could not start (yet).

        A start that fails (EMFILE, EAGAIN, ENOMEM: the host is short of
        something, often briefly) leaves ``item`` at the head of the planner's
        queue and is tried again after a growing wait; after
        :data:`SPAWN_TRIES` failures in a row, ``item`` alone fails with the
        start's error. No running task and no other queued task is affected.
        """
        now = time.monotonic()
        if self.spawn_failures and now < self.spawn_retry_at_s:
            return None
        try:
            worker = self._spawn(device)
        except StartDataError as exc:
            self._break_unpicklable_start(exc)
            return None
        except Exception as exc:
            self.spawn_failures += 1
            self.counts["spawn_failures"] += 1
            tries = self.spawn_failures
            if tries < SPAWN_TRIES:
                wait_s = SPAWN_FIRST_WAIT_S * 4 ** (tries - 1)
                self.spawn_retry_at_s = now + wait_s
                LOGGER.warning(
                    "gpupool could not start a worker process (%s: %s); trying again in "
                    "%.2f s (try %d of %d)",
                    type(exc).__name__,
                    exc,
                    wait_s,
                    tries,
                    SPAWN_TRIES,
                )
                return None
            self.spawn_failures = 0
            note = (
                f"gpupool could not start a worker process for this task in {tries} tries "
                f"over {sum(SPAWN_FIRST_WAIT_S * 4**i for i in range(tries - 1)):.2f} s; "
                "only this task failed and the pool goes on"
            )
            error: BaseException
            os_error = _os_error_in(exc)
            if os_error is not None:
                # The start's own error (OSError picks EMFILE's subclass, and so on).
                error = OSError(os_error.errno, f"{os_error.strerror} ({note})")
            else:
                error = BrokenProcessPool(f"{type(exc).__name__}: {exc} ({note})")
            error.__cause__ = _detached(exc)
            self.items.pop(item.task_id, None)
            self.planner.withdraw(item.task_id)
            self._fail(item, error)
            return None
        self.spawn_failures = 0
        pool.append(worker)
        return worker

    def _retire_beyond_limits(self) -> None:
        """Give back idle workers a card cannot use now (their contexts are its bytes)."""
        now = self.now()
        for device in self.devices:
            live = [w for w in device.workers if not w.retiring]
            # A worker that boots is not idle: it was started for a task that fits.
            idle = [w for w in live if w.task is None and w.ready]
            if not idle:
                continue
            keep = self.planner.warm_limit(device.index, now)
            for worker in idle[: max(0, len(live) - keep)]:
                self._retire(worker)

    def _spawn(self, device: DeviceState | None) -> _Worker:
        env = {**self.env, **self.sensor.worker_env(device.info if device is not None else None)}
        parent_conn, child_conn = self.context.Pipe(duplex=True)
        process = self.context.Process(
            target=worker_main,
            args=(
                child_conn,
                os.getpid(),
                device.info if device is not None else None,
                device.index if device is not None else None,
                # With the ids of its globals here (what by_value's tasks send beside theirs).
                (*self.initializer, sender_ids(self.initializer[0]))
                if self.initializer is not None
                else None,
                self.max_tasks_per_child,
                self.sensor.worker_factory() if device is not None else None,
            ),
            env=env,
            name="gpupool-worker",
        )
        try:
            process.start()
        except BaseException:
            parent_conn.close()
            raise
        finally:
            child_conn.close()
        self.counts["workers_started"] += 1
        worker = _Worker(process, parent_conn, device.index if device is not None else None)
        self.processes[worker.pid] = process
        self.selector.register(worker.channel.fd, selectors.EVENT_READ, (worker, "conn"))
        self.selector.register(worker.watch.fd, selectors.EVENT_READ, (worker, "exit"))
        return worker

    def _send(
        self,
        item: WorkItem,
        worker: _Worker,
        ask_bytes: int,
        payload: bytes,
        queued: bool = False,
        *,
        now: bool = True,
    ) -> None:
        """Hand ``item`` to ``worker``; ``queued``: behind the task it runs (which it declines
        after a device out-of-memory: :meth:`_declined`); ``now=False``: written at the
        caller's :meth:`_flush`."""
        if not worker.queue:
            worker.started_s = time.monotonic()
        worker.queue.append(item)
        item.tries += 1
        if self.cap_allocator and worker.device is not None:
            # Before the call, on the same ordered channel: the cap is set when the task starts.
            self._write(worker, allocator_cap_message(ask_bytes), now=now)
        self._write(worker, payload, wire.task_prefix(item.task_id, queued=queued), now=now)

    def _write(
        self, worker: _Worker, payload: bytes, prefix: bytes = b"", *, now: bool = True
    ) -> None:
        """Queue one frame for ``worker`` (written now, or at the caller's :meth:`_flush`); the
        selector writes what the socket cannot take now."""
        if not now:
            worker.channel.send(payload, prefix, now=False)
            return
        try:
            done = worker.channel.send(payload, prefix)
        except ChannelClosed:
            # The worker died before it could take the task: its exit will be seen.
            worker.channel.discard_output()
            return
        if not done:
            self._watch_writable(worker, True)

    def _write_queued(self, worker: _Worker) -> None:
        """Write the frames queued for ``worker`` (:meth:`_write` with ``now=False``)."""
        try:
            done = worker.channel.flush()
        except ChannelClosed:
            worker.channel.discard_output()  # the worker died: its exit will be seen
            return
        if not done:
            self._watch_writable(worker, True)

    def _flush(self, worker: _Worker) -> None:
        try:
            done = worker.channel.flush()
        except ChannelClosed:
            worker.channel.discard_output()
            done = True
        if done:
            self._watch_writable(worker, False)

    def _watch_writable(self, worker: _Worker, on: bool) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
        try:
            self.selector.modify(worker.channel.fd, events, (worker, "conn"))
        except (KeyError, ValueError):
            pass  # forgotten already

    # -- results ----------------------------------------------------------------------

    def _receive(self, worker: _Worker) -> None:
        """Read what ``worker`` sent; handle each complete answer, oldest first.

        At end of file the socket stops being watched: the worker's exit,
        seen from the process itself, then fails what it ran. What is not
        an answer of that worker's is its protocol fault (:meth:`_protocol_fault`).
        """
        if worker.fault is not None:
            return  # nothing it sends is read any more
        try:
            frames = worker.channel.receive()
        except ChannelCorrupt as exc:
            self._protocol_fault(worker, str(exc))
            return
        except ChannelClosed:
            frames = []
            try:
                self.selector.unregister(worker.channel.fd)
            except (KeyError, ValueError):
                pass
        worker.frames.extend(frames)
        del frames
        while worker.frames and not worker.gone and worker.fault is None:
            frame = worker.frames.popleft()
            head = worker.task
            try:
                self._receive_one(worker, frame)
            except BaseException as exc:
                # A crash here still ends the task's future.
                if head is not None and not head.future.done():
                    self._resolve_error(head.future, exc)
                raise
            del head, frame  # keep nothing of a finished task
        if worker.channel.corrupt is not None:
            self._protocol_fault(worker, worker.channel.corrupt)

    def _protocol_fault(self, worker: _Worker, what: str) -> None:
        """``worker`` sent what is not an answer it may send now (bytes that are not an
        answer, an answer from another PID, about a task it does not run, or a second one):
        nothing more of it is read, it takes no task, and it is SIGKILLed. Its exit then
        fails the task it ran with a :class:`WorkerProtocolError` (:meth:`_reap`), and a
        new worker is started as for any other lost one. Only the worker is killed: what
        its tasks started in the background is left as a worker's death leaves it."""
        if worker.fault is not None or worker.gone:
            return
        worker.fault = what
        worker.retiring = True
        worker.frames.clear()
        worker.channel.discard_output()
        try:
            self.selector.unregister(worker.channel.fd)
        except (KeyError, ValueError):
            pass
        LOGGER.warning(
            "gpupool: a worker process (pid %d) broke the protocol with the pool: it sent %s; "
            "it is killed and replaced",
            worker.pid,
            what,
        )
        try:
            os.kill(worker.pid, signal.SIGKILL)
        except OSError:
            pass  # gone already: its exit is seen all the same

    def _checked(self, worker: _Worker, frame: bytearray) -> wire.Answer | None:
        """``frame`` as an answer ``worker`` may send now; ``None`` (its protocol fault)
        when it is not one."""
        head = worker.task
        try:
            answer = wire.parse_answer(frame)
            wire.check_answer(
                answer,
                worker_pid=worker.pid,
                ready=worker.ready,
                running=head.task_id if head is not None else None,
            )
        except wire.ProtocolFault as fault:
            self._protocol_fault(worker, str(fault))
            return None
        return answer

    def _receive_one(self, worker: _Worker, frame: bytearray) -> None:
        answer = self._checked(worker, frame)
        if answer is None:
            return
        kind, report_fields, payload = answer.kind, answer.report, answer.payload
        report = answer.peak
        del answer
        if kind == "ready":  # no task's answer: the worker's initializer returned
            worker.ready = True
            self.boot_deaths = 0
            worker.resident_bytes = (report_fields or {}).get("resident_bytes")
            return
        item = worker.queue.popleft() if worker.queue else None
        worker.started_s = time.monotonic()
        if kind == "declined" and item is not None:
            self._declined(worker, item)
            return
        if kind == "init":
            # The worker exits right after this answer; wait for it (bounded), so that what
            # it logged on its way out (through a multiprocessing queue, say) is flushed
            # before the pool reports itself broken, as the standard pool's order is.
            worker.process.join(timeout=INIT_EXIT_WAIT_S)
            exc = _load_exception(payload)
            assert self.initializer is not None
            name = callable_name(self.initializer[0])
            error = InitializerError(
                f"{_BROKEN_INIT}: the initializer {name} raised {exc!r}", initializer=name
            )
            error.__cause__ = exc
            if item is not None:
                worker.queue.appendleft(item)
            self._fail_queued(worker, error)
            self._break(str(error), error)
            return
        worker.tasks_done += 1
        if item is None:
            return
        if self.max_tasks_per_child is not None and worker.tasks_done >= self.max_tasks_per_child:
            worker.retiring = True
        oom = kind == "oom" and report is not None
        if oom:
            assert report is not None
            self._on_oom(worker, item, report, payload)
        else:
            # The task never ran when it could not be unpickled: nothing to learn.
            self._settle(item)
            # Its peak is a sample now, priced at the top of the next turn (_settle_asks).
            self.planner.ended(item.task_id, report, self.now(), failed=kind != "ok")
        if kind != "oom" and worker.queue and self.planner.is_queued(worker.queue[0].task_id):
            # The task queued behind it runs now, in the booking it left (after a device
            # OOM the worker declines it instead: _declined).
            self.planner.run_queued(worker.queue[0].task_id, worker.device, worker.pid, self.now())
        self._booking_changed(worker)
        self._bookings_moved()  # a failed task's or an out-of-memory's peak raised its price
        if worker.retiring:
            self._retire(worker)
        if not oom:
            # Last, and nothing of the task kept after it: a caller that drops the
            # result frees it (CPython's gh-58614 test), with no I/O in between.
            self._finish(item, kind, payload)
            del item, payload

    def _declined(self, worker: _Worker, item: WorkItem) -> None:
        """The worker declined ``item``, queued behind a task of its that ran out of device
        memory: it never ran, so it goes back to the head of the queue (its future stays
        RUNNING; not a failure, not a retry) and starts again checked against the bound."""
        item.tries -= 1
        self.planner.requeue(item.task_id)
        self.counts["queued_declined"] += 1
        self._booking_changed(worker)
        if worker.retiring:
            self._retire(worker)

    def _resolve(self, future: Future[Any], result: Any) -> None:
        """Set ``future``'s result at the end of this turn (:meth:`_deliver`), after the
        turn's snapshot, which counts it, and after the turn's starts: a worker that sent
        it has its next task before the caller wakes."""
        self.results.append((future, result))

    def _deliver(self) -> None:
        """Set the results of the turn's tasks; the caller published the snapshot that
        counts them. Nothing of a result is kept here after it is set.

        A done-callback that raises what is not an ``Exception`` (``SystemExit``) crashes
        the dispatcher, but only after every other result of the turn is set: none of them
        is failed as lost for it."""
        results, self.results = self.results, []
        crash: BaseException | None = None
        while results:
            future, result = results.pop(0)
            try:
                _set_result(future, result)
            except BaseException as exc:  # raised by a callback, after the result was set
                crash = crash or exc
            del future, result
        if crash is not None:
            raise crash

    def _resolve_error(self, future: Future[Any], exc: BaseException) -> None:
        """Set ``future``'s exception and count its task failed, after a snapshot that counts
        it: every future the pool fails is counted here, once (one already done is left).

        The turn's results so far are set first: a failure never overtakes a result that
        answered before it (one worker's tasks are done in the order they ran)."""
        if self.results:
            self._settle_asks()  # the results' measurements priced before they are given
            self.publish()
            self._deliver()
        if future.done():
            return
        self.counts["failed"] += 1
        self.publish()
        _set_exception(future, exc)

    def _settle(self, item: WorkItem) -> None:
        self.items.pop(item.task_id, None)

    def _refuse(self, refused: Refuse) -> None:
        """Strict mode: the planner refused to narrow, so the pool breaks with a WidthError.

        What has not started fails with it; what runs is let finish and deliver, since it
        ran at the width asked for (the refusal is about the next starts).
        """
        if self.broken is not None:
            return
        error = WidthError(refused.reason, decision=refused.decision.to_dict())
        self._break(refused.reason, error, running_finish=True)

    def _finish(self, item: WorkItem, kind: str, payload: memoryview) -> None:
        if kind == "ok":
            try:
                result = cloudpickle.loads(payload)
            except BaseException as exc:
                self._fail(
                    item,
                    _broken_by(
                        "A result has failed to un-serialize in the parent. Please ensure "
                        "that the objects returned by the function are always picklable.",
                        _detached(exc),
                    ),
                )
                return
            self.counts["completed"] += 1
            self._resolve(item.future, result)
        elif kind == "unpickle":
            self._fail(
                item,
                _broken_by(
                    "A task has failed to un-serialize in the worker. Please ensure that the "
                    "arguments of the function are all picklable.",
                    _load_exception(payload),
                ),
            )
        else:
            self._fail(item, _load_exception(payload))

    def _fail(self, item: WorkItem, error: BaseException) -> None:
        self._resolve_error(item.future, error)

    def _on_oom(
        self, worker: _Worker, item: WorkItem, report: PeakReport, payload: memoryview
    ) -> None:
        exc = _load_exception(payload)
        device = self.devices[worker.device] if worker.device is not None else None
        reading = self._snapshot(device) if device is not None and device.census.readable else None
        if device is not None and reading is not None and self.link is not None:
            # Other pools' bookings as they stand now: terms of the record.
            self.link.read_for_record(device, reading.process_bytes or {}, self.now())
        verdict = self.planner.out_of_memory(
            item.task_id, report, reading, self.now(), error=f"{type(exc).__name__}: {exc}"
        )
        if device is not None and reading is not None:
            # After the record, which names the own high-water the tasks were priced at.
            self.planner.observe(device.index, reading, self.now())
        if isinstance(verdict, Retry):
            return  # the planner holds it pending again, at the head of its queue
        self._settle(item)
        self._fail_oom(item, verdict, exc)

    def _fail_oom(self, item: WorkItem, verdict: Fail, exc: BaseException | None) -> None:
        where = f"card {verdict.device}" if verdict.device is not None else "the pool"
        remedy = (
            "Run it on a larger card, or make it need less (a smaller batch or model shard)."
            if verdict.kind == "larger_than_card"
            else "Free the card, or give a larger task_peak."
        )
        error = DeviceOutOfMemoryError(
            f"{where}: a task of {item.key} ran out of device memory and failed: "
            f"{verdict.reason} (booked at {format_size(verdict.booked_bytes)}). {remedy}",
            device=verdict.device,
            ask_bytes=verdict.booked_bytes,
            detail=str(exc) if exc is not None else verdict.kind,
        )
        error.__cause__ = exc
        self._fail(item, error)

    # -- workers ending ---------------------------------------------------------------

    def _reap(self, worker: _Worker) -> None:
        """A worker's process ended: fail only the task it ran, and forget it.

        A worker that dies before it is ready while an initializer is set
        breaks the pool instead (:meth:`_break_at_start`): no task ran in it.
        """
        # What it sent before it exited is in the socket still: handle that first.
        self._receive(worker)
        if worker.gone:
            return
        exitcode = worker.watch.wait(1.0)
        self._forget(worker)
        signal_name = _signal_name(exitcode)
        how = f"was killed by {signal_name}" if signal_name else f"exited with code {exitcode}"
        by_pool = exitcode is not None and (worker.pid, -exitcode) in self.signalled
        if worker.fault is not None:
            if worker.ready:
                self._lost_to_fault(worker, worker.fault, exitcode, signal_name)
                return
            how = f"broke the protocol with the pool (it sent {worker.fault}) and was killed"
        if not worker.ready and not by_pool:
            # No task is handed to a worker before it is ready, so none is charged with it.
            # With an initializer the pool breaks, as the standard pool does; without one, a
            # worker that keeps dying as it boots breaks it after SPAWN_TRIES in a row. After
            # shutdown() too: the pending work still needs workers, and one that keeps dying
            # would otherwise be started again without end.
            self.boot_deaths += 1
            if self.initializer is not None or self.boot_deaths >= SPAWN_TRIES:
                self._break_at_start(worker, exitcode, how, signal_name)
            return
        item = self._lost_run(worker)
        if item is None:
            return
        if by_pool:
            how += (
                ", sent by the pool itself ("
                + ("kill_workers()" if exitcode == -signal.SIGKILL else "terminate_workers()")
                + ")"
            )
        hint = (
            " SIGKILL often means the host's out-of-memory killer; check host RAM."
            if signal_name == "SIGKILL" and not by_pool
            else ""
        )
        message = (
            f"A worker process (pid {worker.pid}) running a task of {item.key} {how}; "
            f"only this task failed and the pool goes on.{hint}"
        )
        self._fail_lost(
            worker,
            item,
            WorkerLostError(message, exitcode=exitcode, signal_name=signal_name),
            {"exitcode": exitcode, "signal": signal_name, "pid": worker.pid},
        )

    def _lost_to_fault(
        self, worker: _Worker, what: str, exitcode: int | None, signal_name: str | None
    ) -> None:
        """A ready worker killed for a protocol fault has exited: the task it ran fails with
        a :class:`WorkerProtocolError` saying what arrived, its booking is released, and the
        pool goes on (no task, when the fault came while it was idle)."""
        item = self._lost_run(worker)
        if item is None:
            return
        message = (
            f"A worker process (pid {worker.pid}) running a task of {item.key} broke the "
            f"protocol with the pool: it sent {what}. The worker was killed and replaced; "
            "only this task failed and the pool goes on. A process the task forked that "
            "writes on the worker's descriptors, or a library that does, causes this."
        )
        self._fail_lost(
            worker,
            item,
            WorkerProtocolError(
                message, pid=worker.pid, received=what, exitcode=exitcode, signal_name=signal_name
            ),
            {
                "exitcode": exitcode,
                "signal": signal_name,
                "pid": worker.pid,
                "protocol_fault": what,
            },
        )

    def _lost_run(self, worker: _Worker) -> WorkItem | None:
        """The lost ``worker``'s run, taken off it and settled (``None``: it ran none); the
        tasks queued behind it go back to the planner's queue."""
        item = self._running_item(worker)
        self._requeue_behind(worker)
        if item is not None:
            self._settle(item)
        return item

    def _fail_lost(
        self, worker: _Worker, item: WorkItem, error: BaseException, extra: dict[str, Any]
    ) -> None:
        """``item``, the lost ``worker``'s run, is recorded lost (``extra``: the record's
        terms beside ``error``'s message), its booking released, and its future fails."""
        self.planner.lost(item.task_id, self.now(), message=str(error), extra=extra)
        self._booking_changed(worker)
        self._resolve_error(item.future, error)

    def _booking_changed(self, worker: _Worker) -> None:
        """What ``worker`` holds booked on its card changed: the host's table hears of it."""
        if worker.device is not None and self.link is not None:
            self.link.changed(worker.device, self.now())

    def _break_unpicklable_start(self, exc: StartDataError) -> None:
        """The initializer or its initargs cannot be pickled: no worker can ever start, so
        the pool breaks at once, as when an initializer raises."""
        error: BrokenProcessPool
        if self.initializer is None:  # the pool's own arguments: not expected
            error = _broken_by(f"a worker process cannot be started ({exc})", exc)
            self._break(str(error), error)
            return
        name = callable_name(self.initializer[0])
        error = InitializerError(
            f"{_BROKEN_INIT}: the initializer {name} or its initargs cannot be sent to a "
            f"worker process ({exc}). Workers are spawned: pass initargs that pickle "
            "(multiprocessing queues, locks and events from "
            "multiprocessing.get_context('spawn'), or a Manager's proxies).",
            initializer=name,
        )
        error.__cause__ = _detached(exc.__cause__ or exc)
        self._break(str(error), error)

    def _break_at_start(
        self, worker: _Worker, exitcode: int | None, how: str, signal_name: str | None
    ) -> None:
        """A worker died before it was ready (with an initializer set, or SPAWN_TRIES in a row
        without one): the pool breaks, as the standard pool does, and what was pending fails
        with it (no task ran in such a worker: none is charged as if it had)."""
        error: BrokenProcessPool
        if self.initializer is not None:
            name = callable_name(self.initializer[0])
            error = InitializerError(
                f"{_BROKEN_INIT}: a worker process (pid {worker.pid}) {how} before it was "
                f"ready, in the initializer {name} or the start-up after it; no task ran in "
                "it. An initializer that kills its process (os._exit, a failed CUDA "
                "initialisation) breaks the pool as one that raises does.",
                initializer=name,
                exitcode=exitcode,
                signal_name=signal_name,
            )
        else:
            error = BrokenProcessPool(
                f"A process in the process pool was terminated abruptly while the future was "
                f"running or pending: {self.boot_deaths} worker processes in a row (the last, "
                f"pid {worker.pid}, {how}) died before they were ready; no task ran in them. "
                "Check that the workers can start (imports, the environment, host memory)."
            )
        self._fail_queued(worker, error)
        self._break(str(error), error)

    def _fail_queued(self, worker: _Worker, error: BaseException) -> None:
        """Fail what was handed to ``worker`` with a copy of ``error`` each; release its
        bookings (nothing is learned from a task that did not end by itself)."""
        for item in worker.queue:
            self._settle(item)
            self.planner.finished(item.task_id, None, self.now(), failed=True)
            self._fail(item, copy_broken(error, str(error)))
        worker.queue.clear()

    def _note_table(self) -> None:
        """Record what the booking table could not do since the last turn (steps it was
        passed over, a table that cannot be used), and count the steps."""
        if self.link is None:
            return
        skipped = self.link.note(self.record, self.now())
        if skipped:
            self.counts["bookings_skipped"] = skipped

    def _waiting_changed(self) -> None:
        if self.link is not None:
            self.link.waiting_changed()

    def _row_notes(self, waiting: int, starting: bool = False) -> dict[str, Any]:
        """What the pool's row in the host's table tells people (no pool prices by it): its
        first ``waiting`` tasks (at most ``_WAITS_SCANNED``) by key and ask, and its latest
        decision, stamped in seconds since the epoch. ``starting``: as in ``need_bytes``."""
        entries = self.planner.waiting_asks(int(starting), min(waiting, _WAITS_SCANNED))
        waits = group_waits(entries)
        last = self.log.last_decision
        if last is None:
            return {"waits": waits, "last": None}
        when_s = time.time() - (self.now() - last.time_s)
        return {"waits": waits, "last": last_decision(last.event, last.reason, when_s)}

    def _forget(self, worker: _Worker) -> None:
        if worker.gone:
            return
        worker.gone = True
        for fd in (worker.channel.fd, worker.watch.fd):
            try:
                self.selector.unregister(fd)
            except (KeyError, ValueError):
                pass
        if worker.watch.exitcode() is not None:
            # Reaped: join returns at once, and multiprocessing lets the process
            # object go (its finalizer closes loky's sentinel).
            worker.process.join(timeout=0)
        worker.watch.close()
        worker.channel.discard_output()
        worker.frames.clear()
        self.processes.pop(worker.pid, None)
        pool = self.host_workers if worker.device is None else self.devices[worker.device].workers
        if worker in pool:
            pool.remove(worker)
        try:
            worker.conn.close()
        except OSError:
            pass

    def _retire(self, worker: _Worker) -> None:
        """Ask a worker to exit once idle; its exit then tells the loop to forget it."""
        worker.retiring = True
        if worker.task is None:
            self._write(worker, b"")

    def _stop_workers(self) -> None:
        workers = list(self._all_workers())
        for worker in workers:
            if not worker.retiring or worker.task is not None:
                worker.retiring = True
                self._write(worker, b"")
        self._await_exits(workers, STOP_WAIT_S)
        for worker in workers:
            if worker.watch.exitcode() is None:
                signal_tree(worker.pid, signal.SIGKILL)
                worker.watch.wait(5.0)
            self._fail_queued(worker, WorkerLostError("the pool stopped before this task finished"))
            self._forget(worker)
        self._fail_pending()

    def _await_exits(self, workers: list[_Worker], timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for ``workers`` to exit, writing what they were sent and
        reading (and dropping) what they send, so none stays blocked on its socket."""
        deadline = time.monotonic() + timeout_s
        waiting = list(workers)
        while waiting:
            waiting = [w for w in waiting if w.watch.exitcode() is None]
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                return
            reads: list[int] = []
            writes: list[int] = []
            for worker in waiting:
                reads.append(worker.watch.fd)
                try:
                    if worker.channel.flush():
                        worker.channel.receive()
                        reads.append(worker.channel.fd)
                    else:
                        writes.append(worker.channel.fd)
                except ChannelClosed:
                    pass
            timeout = min(left, POLL_WITHOUT_PIDFD_S)
            select.select(reads, writes, [], timeout)

    def _break(self, message: str, exc: BaseException, *, running_finish: bool = False) -> None:
        """The pool is broken: ``submit`` raises from now on, and every task not handed to
        a worker fails with ``exc``. Tasks handed to workers fail too, unless
        ``running_finish`` (a strict refusal: they run to their end and deliver). The
        first break's error is the pool's."""
        with self.lock:
            if self.broken is None:
                self.broken = message
                self.broken_exc = exc
        self._fail_pending()
        if running_finish:
            return
        for worker in list(self._all_workers()):
            self._fail_queued(worker, exc)

    def _fail_pending(self) -> None:
        """End every task not handed to a worker: with the pool's error when it is broken,
        else cancelled (or, started to its future, failed as never run)."""
        self._drain_incoming()
        items = []
        for task in self.planner.pending_tasks():
            items.append(self.items.pop(task))
            self.planner.withdraw(task)
        for item in items:
            if self.broken is None and item.future.cancel():
                item.future.set_running_or_notify_cancel()
                self.counts["cancelled"] += 1
            elif not item.started and not item.future.set_running_or_notify_cancel():
                # Broken, but the caller cancelled it first: counted (and its waiters told) so.
                self.counts["cancelled"] += 1
            elif self.broken is not None:
                self._resolve_error(item.future, copy_broken(self.broken_exc, self.broken))
            else:
                self._resolve_error(
                    item.future, WorkerLostError("the pool stopped before this task ran")
                )


def copy_broken(exc: BaseException | None, message: str) -> BaseException:
    """A fresh copy of the pool's breaking error for one future or one ``submit`` (each
    raise adds its own traceback), with its attributes and cause."""
    if isinstance(exc, GpuPoolError):
        copy = type(exc).__new__(type(exc), *exc.args)
        copy.args = exc.args
        copy.__dict__.update(exc.__dict__)
        copy.__cause__ = exc.__cause__
        return copy
    if isinstance(exc, BrokenProcessPool):
        return type(exc)(*exc.args)
    error = BrokenProcessPool(message)
    error.__cause__ = exc
    return error


def _load_exception(payload: bytes | bytearray | memoryview) -> BaseException:
    try:
        exc, tb = cloudpickle.loads(payload)
    except BaseException as error:
        broken = BrokenProcessPool(
            "An exception raised by the task has failed to un-serialize in the parent."
        )
        broken.__cause__ = _detached(error)
        return broken
    exc.__cause__ = _RemoteTraceback(tb)
    return exc  # type: ignore[no-any-return]


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: itself, or one it was raised while handling.

    loky's start raises an ``UnboundLocalError`` from its cleanup when
    ``os.pipe()`` fails; the EMFILE behind it is that error's context.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno is not None:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _signal_name(exitcode: int | None) -> str | None:
    """The name of the signal that ended a process (``exitcode`` negative), else ``None``."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def callable_name(fn: Callable[..., object]) -> str:
    """``module.qualname`` of a callable (a partial's function): a task's default key, and
    the initializer's name in messages."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}"


def _broken_by(message: str, cause: BaseException) -> BrokenProcessPool:
    error = BrokenProcessPool(message)
    error.__cause__ = cause
    return error


def _detached(exc: BaseException) -> BaseException:
    """``exc`` with its traceback kept as text only.

    Its frames reach the dispatcher's loop, whose locals hold every worker
    (and each worker's process sentinel): a caller keeping the exception
    would keep those file descriptors open.
    """
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    exc = exc.with_traceback(None)
    if exc.__cause__ is None:
        exc.__cause__ = _RemoteTraceback(cast(Any, text))
    return exc


def _set_result(future: Future[Any], result: Any) -> None:
    try:
        future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _set_exception(future: Future[Any], exc: BaseException) -> None:
    try:
        future.set_exception(exc)
    except concurrent.futures.InvalidStateError:
        pass


def _weak_notes(dispatcher: Dispatcher) -> Callable[[int, bool], Mapping[str, Any]]:
    """The dispatcher's row notes, held weakly by its booking link: a bound method there
    would make a cycle through the dispatcher, which keeps the initargs alive past the
    executor until a garbage collection pass."""
    method = weakref.WeakMethod(dispatcher._row_notes)

    def notes(waiting: int, starting: bool) -> Mapping[str, Any]:
        row_notes = method()
        return {} if row_notes is None else row_notes(waiting, starting)

    return notes
