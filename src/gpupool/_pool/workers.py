"""The worker set: a pool's worker processes, their channels, one selector (process layer).

It starts, writes to, reads from and reaps the workers, and says what happened
as events, in order: ``spawn(card) -> Worker | SpawnFailed | None`` (backing
off), ``serve(timeout_s) -> Answered | Exited``. It never touches a
future or the planner: what an answer or an exit means is the loop's
(:mod:`gpupool._pool.dispatcher`), and what it counts or retires by the loop's
decisions it asks of the callables it is given (``counts``, ``retire_idle``).
When a worker is ended for an unacknowledged frame, a deadline or a stop is
said by its clocks (:class:`WorkerClocks`), a room of the worker set's own.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import select
import selectors
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Pipe
from typing import TYPE_CHECKING, Any

from gpupool._child.probe import allocator_cap_message
from gpupool._core.planner import Workers
from gpupool._observe.log import LOGGER
from gpupool._pool import wire
from gpupool._pool.acks import ACK_BOUND_S, CellHandle, ReadCell
from gpupool._pool.by_value import sender_ids
from gpupool._pool.channel import Channel, ChannelClosed, ChannelCorrupt, ChildEnd
from gpupool._pool.launch import StartDataError, WorkerProcess
from gpupool._pool.reaper import (
    POLL_WITHOUT_PIDFD_S,
    ProcessWatch,
    is_stopped,
    kill_left_after,
    signal_tree,
    trees_below,
)
from gpupool._pool.worker import worker_main

if TYPE_CHECKING:
    from gpupool._core.census import CardCensus
    from gpupool._core.peak import PeakReport
    from gpupool._pool.inbox import WorkItem
    from gpupool._sensors.base import DeviceInfo, Sensor

__all__ = [
    "Answered",
    "Clock",
    "DeviceState",
    "Exited",
    "SpawnFailed",
    "Worker",
    "WorkerClocks",
    "WorkerSet",
]

#: Tries to start a worker for one task before that task fails with the start's
#: error (EMFILE, EAGAIN, ENOMEM...); the waits between them grow from the first
#: by a factor of four: 0.05, 0.2, 0.8, 3.2 s (4.25 s in all). Only the task that
#: needed the worker fails; the pool and its running tasks go on.
SPAWN_TRIES = 5
SPAWN_FIRST_WAIT_S = 0.05

#: How long the pool waits for a worker whose initializer raised to exit (it
#: exits right after saying so) before it reports itself broken.
INIT_EXIT_WAIT_S = 5.0

#: How long the processes of a task past its deadline get to exit on SIGTERM before SIGKILL.
TIMEOUT_GRACE_S = 2.0
#: A worker running a task that stays stopped (SIGSTOP, state ``T``) this long is killed and
#: its task fails (``shutdown()`` would otherwise wait for it for good); looked at every
#: :data:`STOP_CHECK_S` while it runs a task.
STOPPED_LOST_S = 10.0
STOP_CHECK_S = 1.0
#: Why the pool ends a worker such that nothing it sends after is read: it was SIGKILLed
#: (a task past its deadline may still answer within its grace: that answer is taken).
_UNHEARD = frozenset({"unread", "stopped"})


@dataclass(slots=True)
class DeviceState:
    """One card the pool uses: its index, how to reach it, and its census."""

    index: int
    info: DeviceInfo
    census: CardCensus
    # The context its workers are priced at until their own row is read, and its source
    # (gpupool._sensors.contexts: the host's largest measured on the card's model).
    context_estimate: tuple[int, str] | None = None


@dataclass(slots=True)
class Clock:
    """What the clocks hold for one worker. Only :class:`WorkerClocks` writes it."""

    # Since when (monotonic) the head is the head: when its ack is due from, and when its
    # deadline counts from.
    head_since_s: float = 0.0
    # Since when it is seen stopped (None: running, or not looked at yet).
    stopped_since_s: float | None = None
    # When the SIGKILL of its tree is due, with what was below it then.
    kill_at_s: float | None = None
    below: list[Any] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class Worker:
    """One worker process and the tasks handed to it: ``queue[0]`` runs (a worker runs one
    task at a time), and a short task of its key may wait behind it (planner/queued).
    Only the worker set changes a worker (``ending`` and ``clock``: its clocks,
    :class:`WorkerClocks`); the loop reads it."""

    process: Any
    conn: Any
    device: int | None
    channel: Channel = field(init=False)
    watch: ProcessWatch = field(init=False)
    pid: int = field(init=False)
    queue: collections.deque[WorkItem] = field(default_factory=collections.deque)
    # What it sent that broke the protocol (quoted), once it did: it is being killed.
    fault: str | None = None
    tasks_done: int = 0
    retiring: bool = False
    gone: bool = False
    # Its initializer returned and its probe is set up, holding this on its card then (a
    # model its initializer loaded, its context; None when unknown).
    ready: bool = False
    resident_bytes: int | None = None
    # Where it acknowledges each task frame it reads (acks), and how many task frames it
    # answered (the head's frame is the next one).
    cell: ReadCell | None = None
    answered: int = 0
    # At its exit: whether it had read its head's frame (None: it had no head).
    head_read: bool | None = None
    # Why the pool ends it ("timeout", "unread", "stopped"), once it does (the clocks'), and
    # the clocks' times for it: since when its head is the head, its SIGKILL, its stop.
    ending: str | None = None
    clock: Clock = field(default_factory=Clock)

    def __post_init__(self) -> None:
        self.channel = Channel(
            self.conn, magic=wire.ANSWER_MAGIC, min_frame_bytes=wire.MIN_ANSWER_BYTES
        )
        self.watch = ProcessWatch(self.process)
        self.pid = self.process.pid

    @property
    def task(self) -> WorkItem | None:
        """The task running now, or ``None`` when idle."""
        return self.queue[0] if self.queue else None

    @property
    def open(self) -> bool:
        """Whether it may be handed a task: ready, not retiring, not gone, not at fault."""
        return (
            self.ready
            and not self.retiring
            and not self.gone
            and self.fault is None
            and self.ending is None
        )

    def read_head(self) -> bool | None:
        """Whether it read its head's frame (:meth:`ReadCell.read`); ``None``: not yet, or
        it has no head."""
        if not self.queue or self.cell is None:
            return None
        return self.cell.read(self.answered, [item.task_id for item in self.queue])


@dataclass(frozen=True, slots=True)
class Answered:
    """``worker`` answered for ``item`` (taken off its queue): ``kind`` is ``ok``, ``error``,
    ``unpickle``, ``oom``, ``declined`` (queued behind a run that ran out of memory) or
    ``init`` (its initializer raised; it exits)."""

    worker: Worker
    item: WorkItem | None
    kind: str
    report: PeakReport | None
    payload: memoryview


@dataclass(frozen=True, slots=True)
class Exited:
    """``worker``'s process ended (it is forgotten; its queue is as it was). ``by_pool``:
    by a signal the pool sent; ``boot_deaths``: the workers in a row, this one the last,
    that died before they were ready (0 when it was ready, or the pool killed it)."""

    worker: Worker
    exitcode: int | None
    by_pool: bool
    boot_deaths: int


@dataclass(frozen=True, slots=True)
class SpawnFailed:
    """A worker could not be started, ``tries`` in a row over ``waited_s``; ``final``: at
    :data:`SPAWN_TRIES` (the task that needed it fails), else it is tried after a wait."""

    error: BaseException
    tries: int
    waited_s: float
    final: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerOptions:
    """How the pool's workers start and run: the constructor's arguments of these names,
    checked (``initializer``: with its ``initargs``; ``env``: with the pool's own variables).
    """

    mp_context: Any
    initializer: tuple[Callable[..., object], tuple[Any, ...]] | None
    max_tasks_per_child: int | None
    env: Mapping[str, str]
    cap_allocator: bool


class WorkerClocks:
    """The worker set's clocks: when each head's ack and deadline are due, when stopped
    workers are looked at, and the processes left below workers that ended within their
    grace. A room of its own because none of this reads a channel or starts a process: it
    keeps its own times and a :class:`Clock` per worker, and asks the worker set only to
    stop watching a socket. It writes ``Worker.ending``, ``Worker.retiring`` (set as a
    worker is ended, as the worker set sets it as one retires) and each worker's
    :class:`Clock`. Only the worker set calls it, on the dispatcher thread."""

    def __init__(self, unwatch: Callable[[int], None]) -> None:
        # Stops the worker set's selector watching a socket (a worker ended unheard). Given
        # the selector's function, not the worker set's method: the clocks hold no reference
        # back to the worker set, which holds the initializer's arguments.
        self.unwatch = unwatch
        # Processes below workers ended for a deadline that exited before their grace ended:
        # SIGKILLed then, when still there.
        self.leftovers: list[tuple[float, list[Any]]] = []
        # When due() next has something to look at (monotonic; inf: nothing).
        self.due_at_s = math.inf
        self.stop_check_at_s = 0.0

    def new_head(self, worker: Worker) -> None:
        """``worker``'s queue has a new head now: its frame is to be read, its deadline runs."""
        clock = worker.clock
        now_s = clock.head_since_s = time.monotonic()
        clock.stopped_since_s = None
        head_timeout_s = worker.queue[0].timeout_s if worker.queue else None
        at_s = now_s + min(ACK_BOUND_S, STOP_CHECK_S, head_timeout_s or math.inf)
        self.due_at_s = min(self.due_at_s, at_s)

    def due(self, now_s: float, workers: Callable[[], list[Worker]]) -> float | None:
        """Act on what is due at ``now_s`` (monotonic) among ``workers()`` (asked only when
        something is due): a head's frame not acknowledged within
        :data:`~gpupool._pool.acks.ACK_BOUND_S`, or another read in its place (the worker is
        SIGKILLed: ``ending`` is ``"unread"``), a task past its deadline (SIGTERM to the
        worker's tree, SIGKILL after :data:`TIMEOUT_GRACE_S`: ``"timeout"``), a worker running
        a task stopped for :data:`STOPPED_LOST_S` (SIGKILLed: ``"stopped"``). Their exits are
        events as any other. Returns how soon to call again (``None``: nothing to watch)."""
        if now_s < self.due_at_s:
            return None if self.due_at_s == math.inf else self.due_at_s - now_s
        next_s = math.inf
        check_stopped = now_s >= self.stop_check_at_s
        if check_stopped:
            self.stop_check_at_s = now_s + STOP_CHECK_S
        busy = False
        for worker in workers():
            if worker.gone:
                continue
            clock = worker.clock
            if clock.kill_at_s is not None:
                if now_s >= clock.kill_at_s:
                    self._kill_tree(worker)
                else:
                    next_s = min(next_s, clock.kill_at_s)
                continue
            head = worker.task
            if head is None or worker.ending is not None or worker.fault is not None:
                continue
            busy = True
            read = worker.read_head()
            if read is False or (read is None and now_s >= clock.head_since_s + ACK_BOUND_S):
                self.end(worker, "unread", signal.SIGKILL)
                continue
            if read is None:
                next_s = min(next_s, clock.head_since_s + ACK_BOUND_S)
            if head.timeout_s is not None:
                deadline_s = clock.head_since_s + head.timeout_s
                if now_s >= deadline_s:
                    self.end(worker, "timeout", signal.SIGTERM)
                    clock.kill_at_s = now_s + TIMEOUT_GRACE_S
                    next_s = min(next_s, clock.kill_at_s)
                    continue
                next_s = min(next_s, deadline_s)
            if check_stopped:
                self._check_stopped(worker, now_s)
        if busy:
            next_s = min(next_s, self.stop_check_at_s)
        for at_s, processes in list(self.leftovers):
            if now_s >= at_s:
                self.leftovers.remove((at_s, processes))
                kill_left_after(processes, 0.0)
            else:
                next_s = min(next_s, at_s)
        self.due_at_s = next_s
        return None if next_s == math.inf else max(0.01, next_s - now_s)

    def _check_stopped(self, worker: Worker, now_s: float) -> None:
        clock = worker.clock
        if not is_stopped(worker.pid):
            clock.stopped_since_s = None
        elif clock.stopped_since_s is None:
            clock.stopped_since_s = now_s
            LOGGER.warning(
                "gpupool: the worker process (pid %d) running a task is stopped (SIGSTOP); "
                "unless it is resumed (SIGCONT) within %.0f s it is killed and its task fails",
                worker.pid,
                STOPPED_LOST_S,
            )
        elif now_s - clock.stopped_since_s >= STOPPED_LOST_S:
            self.end(worker, "stopped", signal.SIGKILL)

    def end(self, worker: Worker, why: str, sig: int) -> None:
        """End ``worker`` for ``why``: it takes nothing more, and ``sig`` goes to it and to
        everything below it (listed first: a worker that ``sig`` ends is reaped at once)."""
        worker.ending = why
        worker.retiring = True
        if why in _UNHEARD:
            worker.channel.discard_output()
            self.unwatch(worker.channel.fd)
        worker.clock.below = trees_below([worker.pid])
        signal_tree(worker.pid, sig)
        if sig != signal.SIGKILL:
            signal_tree(worker.pid, signal.SIGCONT)  # a stopped process takes its SIGTERM
        else:
            kill_left_after(worker.clock.below, 0.0)

    def _kill_tree(self, worker: Worker) -> None:
        worker.clock.kill_at_s = None
        signal_tree(worker.pid, signal.SIGKILL)
        kill_left_after(worker.clock.below, 0.0)

    def reaped(self, worker: Worker) -> None:
        """``worker`` exited; one ended within its grace leaves what is below it to be
        SIGKILLed when that grace ends."""
        clock = worker.clock
        if clock.kill_at_s is not None:
            self.leftovers.append((clock.kill_at_s, clock.below))
            self.due_at_s = min(self.due_at_s, clock.kill_at_s)
            clock.kill_at_s = None

    def close(self) -> None:
        """The pool stops: no grace is waited for any more."""
        for _, processes in self.leftovers:
            kill_left_after(processes, 0.0)
        self.leftovers.clear()


class WorkerSet:
    """The pool's worker processes by card (``None``: pinned to none), one selector over
    their channels, their exits and ``wake_fd`` (the inbox's), the spawn back-off, the
    workers that died as they booted, and the signals the pool sent. When a worker is ended
    (an unacknowledged frame, a deadline, a stopped worker) is said by its clocks
    (``clocks``, :class:`WorkerClocks`). Only the dispatcher thread calls it."""

    #: What other threads may read (replaced whole, never changed in place).
    PUBLISHED = frozenset({"processes"})

    def __init__(
        self, cards: list[DeviceState], sensor: Sensor, options: WorkerOptions, wake_fd: int
    ) -> None:
        self.cards = cards
        self.sensor = sensor  # its vendor pins a worker and gives it a sensor of its own
        self.options = options
        self.by_card: dict[int | None, list[Worker]] = {None: []}
        self.by_card.update((card.index, []) for card in cards)
        # The processes by PID, as CPython's ``_processes``: replaced whole at each change.
        self.processes: dict[int, Any] = {}
        self.selector = selectors.DefaultSelector()
        self.selector.register(wake_fd, selectors.EVENT_READ, None)
        self.spawn_failures = 0  # in a row
        self.spawn_retry_at_s = 0.0
        self.boot_deaths = 0  # in a row, before they were ready (no task handed to them)
        # (pid, signal) the pool sent (terminate_workers, kill_workers).
        self.signalled: set[tuple[int, int]] = set()
        self.clocks = WorkerClocks(functools.partial(_unwatch, self.selector))

    def all(self) -> list[Worker]:
        """Every worker not forgotten, on every card."""
        if len(self.by_card) == 1:
            return self.by_card[None]
        return [w for workers in self.by_card.values() for w in workers]

    def on(self, card: int | None) -> list[Worker]:
        """The workers pinned to ``card`` (``None``: the pool's workers without one)."""
        return self.by_card[card]

    def counts(self, declining: Callable[[int], bool]) -> Workers:
        """The workers per card as the planner needs them: ready and idle, and booting. One
        whose head is ``declining`` (queued behind a run that ran out of device memory) runs
        nothing and is idle once it has declined it: it counts as booting, so that no other
        worker is started in its place."""
        ready: dict[int | None, int] = {}
        booting: dict[int | None, int] = {}
        for worker in self.all():
            if worker.gone or worker.retiring:
                continue
            head = worker.task
            if not worker.ready or (head is not None and declining(head.task_id)):
                booting[worker.device] = booting.get(worker.device, 0) + 1
            elif head is None:
                ready[worker.device] = ready.get(worker.device, 0) + 1
        return Workers(ready=ready, booting=booting)

    # -- starting --------------------------------------------------------------------

    def spawn(self, card: int | None) -> Worker | SpawnFailed | None:
        """Start a worker on ``card``; ``None`` while a failed start (EMFILE, EAGAIN, ENOMEM:
        the host is short of something, often briefly) is waited out.

        Raises:
            StartDataError: the initializer or its initargs cannot be pickled.
        """
        now = time.monotonic()
        if self.spawn_failures and now < self.spawn_retry_at_s:
            return None
        try:
            worker = self._spawn(card)
        except StartDataError:
            raise
        except Exception as exc:
            self.spawn_failures += 1
            tries = self.spawn_failures
            waited_s = sum(SPAWN_FIRST_WAIT_S * 4**i for i in range(tries - 1))
            if tries >= SPAWN_TRIES:
                self.spawn_failures = 0
                return SpawnFailed(exc, tries, waited_s, final=True)
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
            return SpawnFailed(exc, tries, waited_s, final=False)
        self.spawn_failures = 0
        self.by_card[card].append(worker)
        return worker

    def retry_in_s(self) -> float:
        """How long until the next start may be tried (at least 10 ms)."""
        return max(0.01, self.spawn_retry_at_s - time.monotonic())

    def _spawn(self, card: int | None) -> Worker:
        info = None if card is None else self.cards[card].info
        initializer = self.options.initializer
        cell, cell_fd = ReadCell.create()
        parent_conn, child_conn = Pipe(duplex=True)
        process = WorkerProcess(
            target=worker_main,
            args=(
                ChildEnd(child_conn.fileno()),
                os.getpid(),
                info,
                card,
                # With the ids of its globals here (what by_value's tasks send beside theirs).
                (*initializer, sender_ids(initializer[0])) if initializer is not None else None,
                self.options.max_tasks_per_child,
                None if info is None else self.sensor.worker_factory(),
                CellHandle(cell_fd),
                None if card is None else self.cards[card].context_estimate,
            ),
            env={**self.options.env, **self.sensor.worker_env(info)},
            name="gpupool-worker",
        )
        try:
            process.start()
        except BaseException:
            parent_conn.close()
            cell.close()
            raise
        finally:
            child_conn.close()
            os.close(cell_fd)
        worker = Worker(process, parent_conn, card, cell=cell)
        self.processes = {**self.processes, worker.pid: process}
        self.selector.register(worker.channel.fd, selectors.EVENT_READ, (worker, "conn"))
        self.selector.register(worker.watch.fd, selectors.EVENT_READ, (worker, "exit"))
        return worker

    # -- writing ---------------------------------------------------------------------

    def send(
        self,
        worker: Worker,
        item: WorkItem,
        payload: bytes,
        ask_bytes: int,
        *,
        queued: bool = False,
        now: bool = True,
    ) -> None:
        """Hand ``item`` (``payload``, its pickled call) to ``worker``; ``queued``: behind
        the task it runs (which it declines after a device out-of-memory); ``now=False``:
        written at :meth:`flush`."""
        worker.queue.append(item)
        if len(worker.queue) == 1:
            self.clocks.new_head(worker)
        if self.options.cap_allocator and worker.device is not None:
            # Before the call, on the same ordered channel: the cap is set when the task starts.
            self._write(worker, allocator_cap_message(ask_bytes), now=now)
        self._write(worker, payload, wire.task_prefix(item.task_id, queued=queued), now=now)

    def retire_idle(self, keep: Callable[[int], int]) -> None:
        """Retire the idle workers beyond ``keep(card)`` on each card (asked only of a card
        with idle ones); one that boots is not idle: it was started for a task that fits."""
        for card in self.cards:
            live = [w for w in self.by_card[card.index] if not w.retiring]
            idle = [w for w in live if w.task is None and w.ready]
            if idle:
                for worker in idle[: max(0, len(live) - keep(card.index))]:
                    self.retire(worker)

    def retire(self, worker: Worker) -> None:
        """Ask a worker to exit once idle; its exit is then an event."""
        worker.retiring = True
        if worker.task is None:
            self._write(worker, b"")

    def leaves(self, worker: Worker) -> None:
        """``worker`` exits by itself (it could not set up its next task): it takes nothing
        more, and is not asked to exit; its exit is then an event."""
        worker.retiring = True

    def take_queue(self, worker: Worker) -> list[WorkItem]:
        """What was handed to ``worker`` and not answered for, taken off it, in order."""
        items = list(worker.queue)
        worker.queue.clear()
        return items

    def kill(self, sig: int) -> None:
        """Signal every worker's process tree (each signal once per worker)."""
        for worker in self.all():
            sent = (worker.pid, sig)  # SIGKILL after SIGTERM is sent too
            if sent not in self.signalled:
                self.signalled.add(sent)
                signal_tree(worker.pid, sig)

    def _write(
        self, worker: Worker, payload: bytes, prefix: bytes = b"", *, now: bool = True
    ) -> None:
        """Queue one frame for ``worker``, written now or at :meth:`flush`."""
        worker.channel.send(payload, prefix, now=False)
        if now:
            self.flush(worker)

    def flush(self, worker: Worker) -> None:
        """Write what is queued for ``worker``; the selector writes what the socket cannot
        take now."""
        try:
            done = worker.channel.flush()
        except ChannelClosed:
            worker.channel.discard_output()  # the worker died: its exit will be seen
            done = True
        events = selectors.EVENT_READ | (0 if done else selectors.EVENT_WRITE)
        try:
            self.selector.modify(worker.channel.fd, events, (worker, "conn"))
        except (KeyError, ValueError):
            pass  # forgotten already

    # -- reading ---------------------------------------------------------------------

    def serve(self, timeout_s: float | None) -> Iterator[Answered | Exited]:
        """Wait for the selector (or the wake pipe), write what may be written, and yield what
        the workers said and which ended, in order; the loop has acted on each event (sent
        the worker its next task, say) before the next frame is read."""
        workers = self.all()
        unwatched = [w for w in workers if w.watch.pidfd is None]
        if unwatched:
            # No pidfd: the sentinel may be held by a grandchild, so ask waitpid too.
            timeout_s = (
                POLL_WITHOUT_PIDFD_S if timeout_s is None else min(timeout_s, POLL_WITHOUT_PIDFD_S)
            )
        ready = self.selector.select(timeout_s)
        ended: list[Worker] = []
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
                self.flush(worker)
            if events & selectors.EVENT_READ and not worker.gone:
                yield from self._receive(worker)
        ended.extend(w for w in unwatched if w not in ended and w.watch.exitcode() is not None)
        for worker in ended:
            if not worker.gone:
                # What it sent before it exited is in the socket still: that first.
                yield from self._receive(worker)
            if not worker.gone:
                yield self._reap(worker)

    def _receive(self, worker: Worker) -> Iterator[Answered]:
        """What ``worker`` sent, oldest first. At end of file the socket stops being watched:
        the worker's exit, seen from the process itself, is the next event."""
        if worker.fault is not None or worker.ending in _UNHEARD:
            return  # nothing it sends is read any more
        try:
            frames = worker.channel.receive()
        except ChannelCorrupt as exc:
            self._protocol_fault(worker, str(exc))
            return
        except ChannelClosed:
            frames = []
            _unwatch(self.selector, worker.channel.fd)
        frames.reverse()  # popped oldest first: nothing of a handled answer is kept
        while frames and not worker.gone and worker.fault is None and worker.ending not in _UNHEARD:
            event = self._answer(worker, frames.pop())
            if event is None:
                continue
            yield event
            if event.kind != "init" and worker.retiring:
                self.retire(worker)
            del event  # keep nothing of a finished task
        if worker.channel.corrupt is not None and worker.ending not in _UNHEARD:
            self._protocol_fault(worker, worker.channel.corrupt)

    def _answer(self, worker: Worker, frame: bytearray) -> Answered | None:
        """``frame`` as an event, the worker's state moved by it; ``None`` when it is
        ``ready`` (nothing for the loop: the next turn counts the worker), or when it is not
        an answer ``worker`` may send now (its protocol fault)."""
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
            if worker.read_head() is False:
                # It answers a frame it read in place of its head's: another reader of its
                # socket took the head's. Lost, as due() finds it; the head never ran.
                self.clocks.end(worker, "unread", signal.SIGKILL)
            else:
                self._protocol_fault(worker, str(fault))
            return None
        kind = answer.kind
        if kind == "ready":  # no task's answer: the worker's initializer returned
            worker.ready = True
            worker.resident_bytes = (answer.report or {}).get("resident_bytes")
            self.boot_deaths = 0
            return None
        item = worker.queue.popleft() if worker.queue else None
        if item is not None:
            worker.answered += 1
            if worker.queue:
                self.clocks.new_head(worker)
        if kind == "init":
            # It exits right after this answer; wait for it (bounded), so that what it
            # logged on its way out (through a multiprocessing queue, say) is flushed
            # before the pool reports itself broken, as the standard pool's order is.
            worker.process.join(timeout=INIT_EXIT_WAIT_S)
        elif kind != "declined":
            worker.tasks_done += 1
            limit = self.options.max_tasks_per_child
            if limit is not None and worker.tasks_done >= limit:
                worker.retiring = True
        return Answered(worker, item, kind, answer.peak, answer.payload)

    # -- the workers' clocks ---------------------------------------------------------

    def due(self, now_s: float) -> float | None:
        """Act on what is due at ``now_s`` (monotonic): unacknowledged frames, deadlines,
        stopped workers (:meth:`WorkerClocks.due`).
        Returns how soon to call again (``None``: nothing to watch)."""
        return self.clocks.due(now_s, self.all)

    def _protocol_fault(self, worker: Worker, what: str) -> None:
        """``worker`` sent what is not an answer it may send now (bytes that are not an
        answer, an answer from another PID, about a task it does not run, or a second one):
        nothing more of it is read, it takes no task, and it is SIGKILLed (only the worker:
        what its tasks started is left as a worker's death leaves it)."""
        if worker.fault is not None or worker.gone:
            return
        worker.fault = what
        worker.retiring = True
        worker.channel.discard_output()
        _unwatch(self.selector, worker.channel.fd)
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

    # -- ending ----------------------------------------------------------------------

    def _reap(self, worker: Worker) -> Exited:
        exitcode = worker.watch.wait(1.0)
        worker.head_read = worker.read_head()
        self.clocks.reaped(worker)  # ended within its grace: what is left, at its end
        self._forget(worker)
        by_pool = exitcode is not None and (worker.pid, -exitcode) in self.signalled
        boot_deaths = 0
        if not worker.ready and not by_pool:
            self.boot_deaths += 1
            boot_deaths = self.boot_deaths
        return Exited(worker, exitcode, by_pool, boot_deaths)

    def _forget(self, worker: Worker) -> None:
        if worker.gone:
            return
        worker.gone = True
        _unwatch(self.selector, worker.channel.fd)
        _unwatch(self.selector, worker.watch.fd)
        if worker.watch.exitcode() is not None:
            # Reaped: join returns at once, and multiprocessing lets the process
            # object go (its finalizer closes loky's sentinel).
            worker.process.join(timeout=0)
        worker.watch.close()
        if worker.cell is not None:
            worker.cell.close()
        worker.channel.discard_output()
        if worker.pid in self.processes:
            self.processes = {p: v for p, v in self.processes.items() if p != worker.pid}
        workers = self.by_card[worker.device]
        if worker in workers:
            workers.remove(worker)
        try:
            worker.conn.close()
        except OSError:
            pass

    def stop(self, wait_s: float) -> list[Worker]:
        """Ask every worker to exit, wait up to ``wait_s``, SIGKILL those left, and forget
        them all; returns them (their queues as they were)."""
        workers = list(self.all())
        for worker in workers:
            if not worker.retiring or worker.task is not None:
                worker.retiring = True
                self._write(worker, b"")
        self._await_exits(workers, wait_s)
        for worker in workers:
            if worker.watch.exitcode() is None:
                signal_tree(worker.pid, signal.SIGKILL)
                worker.watch.wait(5.0)
            self._forget(worker)
        return workers

    def _await_exits(self, workers: list[Worker], timeout_s: float) -> None:
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

    def close(self) -> None:
        self.clocks.close()  # the pool stops: no grace is waited for any more
        self.selector.close()


def _unwatch(selector: selectors.BaseSelector, fd: int) -> None:
    """Stop ``selector`` watching ``fd`` (not watched, or closed already: nothing)."""
    try:
        selector.unregister(fd)
    except (KeyError, ValueError):
        pass
