"""The dispatcher: one thread per pool that owns every scheduling decision (process layer).

Data flow::

    caller threads            dispatcher thread                      workers (loky processes)
    --------------            -----------------                      -----------------------
    submit(fn, *a) -> pending -> place: ceiling, byte bound per card, -> send_bytes(task)
      (PENDING)       deque      live gate, a warm or new worker         probe.start(); fn(*a)
                                 (RUNNING once handed over)              probe.stop() -> report
                   futures  <-  result / error / oom / worker death  <- send_bytes(kind, report)
                                 asks learn from reports; width
                                 decisions -> DecisionLog

Tasks held back for memory stay PENDING in the parent, so ``cancel()`` works
on them; a task becomes RUNNING only when it is handed to a worker, and a
worker runs one task at a time, so the pool always knows which task a dead
worker was running. Workers are started lazily by loky's process backend
with their device pinned in the environment before any import, kept warm,
and retired when their device narrows.

Why not ``loky.ProcessPoolExecutor`` itself: it starts every worker at the
first submit, takes one environment per executor, hands queued work to
workers where it can no longer be cancelled, and breaks the whole executor
when one worker dies. gpupool needs the opposite on each count, so it uses
loky's process backend (fork+exec with a per-process ``env``, cloudpickle)
under a dispatcher of its own.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import pickle
import selectors
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool, _RemoteTraceback
from typing import TYPE_CHECKING, Any, cast

import cloudpickle

from gpupool._core.bound import (
    Bound,
    Ceiling,
    WidthDecision,
    admits,
    decide_widths,
    derive_bound,
    derive_ceiling,
    live_gate_admits,
)
from gpupool._core.census import CardCensus, Census
from gpupool._core.events import Decision, EventName, JsonValue
from gpupool._core.peak import PeakReport
from gpupool._core.policy import (
    Ask,
    AskTable,
    Policy,
)
from gpupool._core.units import format_size
from gpupool._errors import (
    DeviceOutOfMemoryError,
    WidthError,
    WorkerLostError,
)
from gpupool._log import LOGGER, DecisionLog
from gpupool._pool.worker import worker_main

if TYPE_CHECKING:
    from gpupool._sensors.base import DeviceInfo, Sensor

__all__ = [
    "DeviceState",
    "Dispatcher",
    "WorkItem",
    "copy_broken",
    "decision_dict",
    "interpreter_exiting",
]

#: How often a dispatcher whose live gate is shut re-reads the card.
LIVE_GATE_POLL_S = 0.05

#: A task key whose tasks take less than this (a moving average) gets a second
#: task queued behind each busy worker, hiding the round trip between tasks
#: (about 0.2 ms here). Longer tasks are never queued behind one another: a
#: task queued behind a long one could wait while another worker sits idle,
#: and it could no longer be cancelled.
QUEUE_BEHIND_BELOW_S = 0.02

#: How often the parent's own device bytes are re-read (its high-water only grows).
OWN_REREAD_INTERVAL_S = 0.5


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
    """One submitted task: its future, its pickled call, its key, and where it stands."""

    __slots__ = (
        "booked_bytes",
        "call",
        "future",
        "hint_bytes",
        "key",
        "priced_bytes",
        "shared",
        "started",
        "tries",
        "wait_below",
    )

    def __init__(self, future: Future[Any], call: bytes, key: str, hint_bytes: int | None) -> None:
        self.future = future
        self.call = call
        self.key = key
        self.hint_bytes = hint_bytes
        self.started = False
        self.tries = 0
        # Booked: what admission counts (raised if the key's ask rises while it
        # runs). Priced: its ask when it started, which an out-of-memory judges.
        self.booked_bytes = 0
        self.priced_bytes = 0
        # Whether another task of the pool ran on its card while it did: only
        # then can an out-of-memory be someone else's doing, and be retried.
        self.shared = False
        # Fixed width after an out-of-memory: start only while fewer than this run.
        self.wait_below: int | None = None


class _Worker:
    """One worker process and the tasks handed to it (at most one waiting behind the running one).

    A worker runs one task at a time, so a second task queued behind the
    running one adds no simultaneous device memory as long as its ask is
    not larger than what the worker is booked at; that queue of two hides
    the round trip between tasks, as CPython's ``EXTRA_QUEUED_CALLS`` does.
    """

    __slots__ = (
        "conn",
        "device",
        "gone",
        "pid",
        "process",
        "queue",
        "retiring",
        "started_s",
        "tasks_done",
    )

    def __init__(self, process: Any, conn: Any, device: int | None) -> None:
        self.process = process
        self.conn = conn
        self.device = device
        self.pid: int = process.pid
        self.queue: collections.deque[WorkItem] = collections.deque()
        self.tasks_done = 0
        self.retiring = False
        self.gone = False
        self.started_s = 0.0

    @property
    def task(self) -> WorkItem | None:
        """The task running now (the head of the queue), or ``None`` when idle."""
        return self.queue[0] if self.queue else None

    @property
    def ask_bytes(self) -> int:
        """Device bytes booked for this worker: the largest ask of its tasks."""
        return max((item.booked_bytes for item in self.queue), default=0)


class _Spawn:
    """An order to start a worker for a device (``None``: a host-bounded pool)."""

    __slots__ = ("device", "pool")

    def __init__(self, device: DeviceState | None, pool: list[_Worker]) -> None:
        self.device = device
        self.pool = pool


class DeviceState:
    """One card the pool uses: its census, its workers, its current width and caps."""

    __slots__ = ("census", "gate_waiting", "index", "info", "oom_cap", "width", "workers")

    def __init__(self, index: int, info: DeviceInfo, census: CardCensus) -> None:
        self.index = index
        self.info = info
        self.census = census
        self.workers: list[_Worker] = []
        self.width = 0
        self.oom_cap: int | None = None
        self.gate_waiting = False

    def running(self) -> list[_Worker]:
        return [w for w in self.workers if w.task is not None]


class Dispatcher:
    """Owns the scheduling state; only its thread changes it (submit only appends)."""

    def __init__(
        self,
        *,
        census: Census,
        devices: list[DeviceState],
        sensor: Sensor,
        asks: AskTable,
        policy: Policy,
        max_workers: int,
        fixed_width: int | None,
        strict: bool,
        retry_oom: bool,
        max_tasks_per_child: int | None,
        initializer: tuple[Callable[..., object], tuple[Any, ...]] | None,
        log: DecisionLog,
        env: Mapping[str, str],
    ) -> None:
        self.census = census
        self.devices = devices
        self.sensor = sensor
        self.asks = asks
        self.policy = policy
        self.max_workers = max_workers
        self.fixed_width = fixed_width
        self.strict = strict
        self.retry_oom = retry_oom
        self.max_tasks_per_child = max_tasks_per_child
        self.initializer = initializer
        self.log = log
        self.env = dict(env)
        self.context = _loky_context()
        self.started_at_s = time.monotonic()
        self.lock = threading.Lock()
        self.pending: collections.deque[WorkItem] = collections.deque()
        self.host_workers: list[_Worker] = []
        self.processes: dict[int, Any] = {}
        self.own_high_water_bytes: dict[int, int] = {
            d.index: d.census.own_bytes or 0 for d in devices
        }
        self.last_own_read_s = self.started_at_s
        self.child_rss_bytes: int | None = None
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
        self.ceiling = self._ceiling()
        self.width = 0
        self.widths: list[tuple[float, int]] = []
        self.counts = collections.Counter[str]()
        self.durations_s: dict[str, float] = {}
        self.sensor_errors: set[tuple[int, str]] = set()
        self.thread = threading.Thread(target=self._run, name="gpupool-dispatcher", daemon=True)

    # -- called from caller threads -------------------------------------------------

    def start(self) -> None:
        _dispatchers.add(self)
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
            self.pending.append(item)
            self.counts["submitted"] += 1
            self._wake_locked()

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
        with self.lock:
            items = list(self.pending)
            self.pending.clear()
        for item in items:
            if item.started:
                self._fail(item, WorkerLostError("the pool's workers were stopped before this ran"))
            elif item.future.cancel():
                item.future.set_running_or_notify_cancel()
                self.counts["cancelled"] += 1
        for worker in self._all_workers():
            sent = (worker.pid, self.kill_signal)  # SIGKILL after SIGTERM is sent too
            if sent not in self.signalled:
                self.signalled.add(sent)
                try:
                    os.kill(worker.pid, self.kill_signal)
                except ProcessLookupError:
                    pass

    def _cancel_pending(self) -> None:
        with self.lock:
            self.cancel_requested = False
            items = [item for item in self.pending if not item.started]
        # Outside the lock: a cancelled future's callbacks may call shutdown().
        for item in items:
            item.future.cancel()

    def close(self) -> None:
        """Release the dispatcher's descriptors (its thread's last act, or a failed start)."""
        with self.lock:
            self.stopped = True
        self.log.close()
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
            self.record(
                Decision(
                    event="shutdown",
                    time_s=self.now(),
                    device=None,
                    width_before=self.width,
                    width_after=0,
                    reason=(
                        f"pool shut down after {self.counts['completed']} completed, "
                        f"{self.counts['failed']} failed, {self.counts['cancelled']} cancelled "
                        f"tasks; {self.counts['oom']} out-of-memory, {self.counts['retries']} "
                        f"retries, {self.counts['lost']} workers lost"
                    ),
                    extra={
                        "tasks_completed": self.counts["completed"],
                        "tasks_failed": self.counts["failed"],
                        "tasks_cancelled": self.counts["cancelled"],
                        "out_of_memory": self.counts["oom"],
                        "retries": self.counts["retries"],
                        "workers_lost": self.counts["lost"],
                        "tasks_lost": 0,
                    },
                )
            )
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
            gated = self._schedule()
            if self.cancel_requested:
                self._cancel_pending()
                gated = self._schedule()
            workers = self._all_workers()
            busy = any(w.task is not None for w in workers)
            with self.lock:
                idle_pool = not self.pending and not busy
                if self.shutdown_requested and idle_pool:
                    return
                if self.broken is not None and not busy:
                    return
            ready = self.selector.select(LIVE_GATE_POLL_S if gated else None)
            results = [key.data[0] for key, _ in ready if key.data and key.data[1] == "conn"]
            ended = [key.data[0] for key, _ in ready if key.data and key.data[1] == "sentinel"]
            for worker in results:
                if not worker.gone:
                    self._receive(worker)
            for worker in ended:
                if not worker.gone and worker not in results:
                    self._reap(worker)

    # -- placing tasks ----------------------------------------------------------------

    def _ceiling(self) -> Ceiling:
        host = self.census.host
        return derive_ceiling(
            max_workers=self.fixed_width or self.max_workers,
            cpus=None if self.fixed_width else host.cpus,
            host_ram_bytes=None if self.fixed_width else host.available_ram_bytes,
            child_rss_bytes=self.child_rss_bytes,
        )

    def _own_high_water(self, device: DeviceState) -> int:
        return self.own_high_water_bytes.get(device.index, 0)

    def _bound(self, device: DeviceState, ask: Ask) -> Bound:
        return derive_bound(
            device.census,
            own_high_water_bytes=self._own_high_water(device),
            reserve_bytes=self.policy.reserve_bytes,
            ask_bytes=ask.ask_bytes,
            ask_basis=ask.basis,
        )

    def _representative_ask(self) -> Ask:
        """The largest current ask over the keys seen: the pool's width is priced at it."""
        keys = self.asks.keys()
        if not keys:
            return self.asks.ask("")
        return max((self.asks.ask(k) for k in keys), key=lambda a: a.ask_bytes)

    def decide(self, ask: Ask | None = None) -> tuple[WidthDecision, ...]:
        ask = ask or self._representative_ask()
        return decide_widths([self._bound(d, ask) for d in self.devices], self.ceiling)

    def _running_count(self) -> int:
        return sum(1 for w in self._all_workers() if w.task is not None)

    def _schedule(self) -> bool:
        """Start what fits; returns whether the live gate holds something back."""
        gated = False
        while True:
            if self.broken is not None:
                self._fail_pending()
                return False
            with self.lock:
                if not self.pending:
                    return gated
                item = self.pending[0]
                if not item.started and item.future.cancelled():
                    self.pending.popleft()
                    # CANCELLED -> CANCELLED_AND_NOTIFIED: wakes wait() and as_completed().
                    item.future.set_running_or_notify_cancel()
                    self.counts["cancelled"] += 1
                    continue
            placement = self._place(item)
            if placement is None:
                placement = self._queue_behind(item)
                if placement is None:
                    return gated
            if isinstance(placement, str):
                return True
            with self.lock:
                self.pending.popleft()
            if not item.started:
                if not item.future.set_running_or_notify_cancel():
                    self.counts["cancelled"] += 1
                    continue
                item.started = True
            # RUNNING before a worker is started for it: a shutdown that cancels
            # pending work while the worker starts can no longer take this task.
            if isinstance(placement, _Spawn):
                try:
                    worker = self._start(placement)
                except BaseException as exc:
                    self._fail(item, _broken_by(f"could not start a worker process: {exc!r}", exc))
                    raise
            else:
                worker = placement
            self._send(item, worker)

    def _place(self, item: WorkItem) -> _Worker | _Spawn | str | None:
        running = self._running_count()
        if running >= self.ceiling.value:
            return None
        if not self.devices:
            return self._worker_for(None, self.host_workers)
        ask = self._ask_for(item)
        if self.fixed_width is not None:
            device = min(self.devices, key=lambda d: (len(d.running()), d.index))
            if item.wait_below is not None and len(device.running()) >= item.wait_below:
                return None  # a retried task waits for its card to run fewer than it did
            return self._worker_for(device, device.workers)
        decisions = {d.device: d for d in self.decide(ask)}
        candidates = sorted(
            self.devices,
            key=lambda d: (
                -(
                    (decisions[d.index].bound.room_bytes or 0)
                    - sum(w.ask_bytes for w in d.running())
                )
            ),
        )
        gate_shut = False
        for device in candidates:
            busy = device.running()
            cap = device.oom_cap
            if cap is not None and len(busy) >= cap:
                continue
            bound = decisions[device.index].bound
            if not admits(ask.ask_bytes, [w.ask_bytes for w in busy], bound.room_bytes):
                continue
            verdict = self._live_gate(device, ask, busy)
            if verdict is not None and not verdict:
                gate_shut = True
                continue
            device.gate_waiting = False
            return self._worker_for(device, device.workers)
        if running == 0:
            # The serial path: nothing of the pool runs, so one task starts regardless.
            device = candidates[0]
            if gate_shut:
                self.counts["serial_starts"] += 1
                self._record_simple(
                    "serial_start",
                    device,
                    ask,
                    f"card {device.index}: the live gate is shut but nothing of the pool is "
                    f"running, so one task of {item.key} starts regardless (the serial path is "
                    f"never blocked); ask {ask.describe()}",
                )
            return self._worker_for(device, device.workers)
        return "gated" if gate_shut else None

    def _queue_behind(self, item: WorkItem) -> _Worker | None:
        """A busy worker that can take ``item`` next without more device memory, if any."""
        if self.durations_s.get(item.key, QUEUE_BEHIND_BELOW_S) >= QUEUE_BEHIND_BELOW_S:
            return None
        ask = self._ask_for(item).ask_bytes if self.devices else 0
        limit = self.max_tasks_per_child
        for worker in self._all_workers():
            if (
                len(worker.queue) == 1
                and not worker.retiring
                and (limit is None or worker.tasks_done + 2 <= limit)
                and (worker.device is None or ask <= worker.ask_bytes)
            ):
                return worker
        return None

    def _ask_for(self, item: WorkItem) -> Ask:
        if item.hint_bytes is not None:
            self.asks.hint(item.key, item.hint_bytes)
            item.hint_bytes = None
        return self.asks.ask(item.key)

    def _live_gate(self, device: DeviceState, ask: Ask, busy: list[_Worker]) -> bool | None:
        """``None``: no live reading; else whether the card's free bytes cover the task."""
        if not device.census.readable:
            return None
        try:
            reading = self.sensor.read_memory(device.info)
            rows = (self.sensor.read_processes(device.info) or ()) if busy else ()
        except Exception as exc:
            # Unreadable is not empty: while the live reading fails, the card
            # runs one task of the pool at a time, as an unreadable card does.
            self._sensor_error(device, ask, exc, "the live gate runs one task at a time")
            return not busy
        current = {r.pid: r.used_bytes or 0 for r in rows}
        unreached = sum(max(0, w.ask_bytes - current.get(w.pid, 0)) for w in busy)
        ok = live_gate_admits(
            live_free_bytes=reading.free_bytes,
            ask_bytes=ask.ask_bytes,
            unreached_bytes=unreached,
            reserve_bytes=self.policy.reserve_bytes,
        )
        if not ok:
            idle = [w for w in device.workers if w.task is None]
            if idle:
                # An idle worker's context is memory the card needs: give it back.
                self._retire(idle[0])
            if not device.gate_waiting:
                device.gate_waiting = True
                self.counts["gate_waits"] += 1
                self._record_simple(
                    "live_gate_wait",
                    device,
                    ask,
                    f"card {device.index}: {format_size(reading.free_bytes)} free now does not "
                    f"cover {format_size(ask.ask_bytes)} ask + {format_size(unreached)} not yet "
                    f"reached by {len(busy)} running + {format_size(self.policy.reserve_bytes)} "
                    f"reserve; the task waits",
                    extra={
                        "live_free_bytes": reading.free_bytes,
                        "live_used_bytes": reading.used_bytes,
                        "unreached_bytes": unreached,
                        "running": len(busy),
                    },
                )
        return ok

    def _sensor_error(self, device: DeviceState, ask: Ask, exc: BaseException, effect: str) -> None:
        """Record a failed reading, once per card and kind of error."""
        kind = (device.index, type(exc).__name__)
        if kind in self.sensor_errors:
            return
        self.sensor_errors.add(kind)
        self.counts["sensor_errors"] += 1
        self._record_simple(
            "sensor_error",
            device,
            ask,
            f"card {device.index}: a live reading failed ({type(exc).__name__}: {exc}); "
            f"{effect} while it fails; the static bound still applies",
            extra={"error": f"{type(exc).__name__}: {exc}"[:500]},
        )

    def _worker_for(self, device: DeviceState | None, pool: list[_Worker]) -> _Worker | _Spawn:
        """An idle warm worker for ``device``, or an order to start one."""
        for worker in pool:
            if worker.task is None and not worker.retiring:
                return worker
        return _Spawn(device, pool)

    def _start(self, order: _Spawn) -> _Worker:
        worker = self._spawn(order.device)
        order.pool.append(worker)
        return worker

    def _spawn(self, device: DeviceState | None) -> _Worker:
        env = dict(self.env)
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device.info.uuid
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        parent_conn, child_conn = self.context.Pipe(duplex=True)
        process = self.context.Process(
            target=worker_main,
            args=(
                child_conn,
                os.getpid(),
                device.info if device is not None else None,
                device.index if device is not None else None,
                self.initializer,
                self.max_tasks_per_child,
            ),
            env=env,
            name="gpupool-worker",
        )
        process.start()
        child_conn.close()
        self.counts["workers_started"] += 1
        worker = _Worker(process, parent_conn, device.index if device is not None else None)
        self.processes[worker.pid] = process
        self.selector.register(parent_conn, selectors.EVENT_READ, (worker, "conn"))
        self.selector.register(process.sentinel, selectors.EVENT_READ, (worker, "sentinel"))
        return worker

    def _send(self, item: WorkItem, worker: _Worker) -> None:
        if worker.device is not None:
            item.booked_bytes = item.priced_bytes = self.asks.ask(item.key).ask_bytes
            neighbours = [w.task for w in self.devices[worker.device].running() if w is not worker]
            item.shared = bool(neighbours)
            for other in neighbours:
                if other is not None:
                    other.shared = True
        if not worker.queue:
            worker.started_s = time.monotonic()
        worker.queue.append(item)
        item.tries += 1
        try:
            worker.conn.send_bytes(item.call)
        except OSError:
            # The worker died before it could take the task: its sentinel will fire.
            pass
        self._update_width()

    # -- results ----------------------------------------------------------------------

    def _receive(self, worker: _Worker) -> None:
        """Read one answer from ``worker``; a crash here still ends the task's future."""
        head = worker.task
        try:
            self._receive_one(worker)
        except BaseException as exc:
            if head is not None and not head.future.done():
                _set_exception(head.future, exc)
            raise

    def _receive_one(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv_bytes()
        except (EOFError, OSError):
            self._reap(worker)
            return
        kind, report_fields, payload = pickle.loads(message)
        item = worker.queue.popleft() if worker.queue else None
        ask_bytes = item.priced_bytes if item is not None else 0
        now = time.monotonic()
        if item is not None:
            took = now - worker.started_s
            last = self.durations_s.get(item.key)
            self.durations_s[item.key] = took if last is None else 0.8 * last + 0.2 * took
        worker.started_s = now
        if kind == "init":
            exc = _load_exception(payload)
            error = BrokenProcessPool(f"{_BROKEN_INIT}: the initializer raised {exc!r}")
            error.__cause__ = exc
            if item is not None:
                self.counts["failed"] += 1
                _set_exception(item.future, copy_broken(error, str(error)))
            self._break(f"{_BROKEN_INIT}: a worker's initializer raised {exc!r}", error)
            return
        worker.tasks_done += 1
        if item is None:
            return
        if report_fields is None:
            # The task never ran (it could not be unpickled): nothing to learn.
            self._finish(item, kind, payload)
            return
        report = PeakReport(**report_fields)
        if self.max_tasks_per_child is not None and worker.tasks_done >= self.max_tasks_per_child:
            worker.retiring = True
        if kind == "oom":
            self._on_oom(worker, item, report, payload, ask_bytes)
        else:
            self._learn(item, report)
            self._finish(item, kind, payload)
        if worker.retiring:
            self._retire(worker)

    def _finish(self, item: WorkItem, kind: str, payload: bytes) -> None:
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
            _set_result(item.future, result)
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
        self.counts["failed"] += 1
        _set_exception(item.future, error)

    def _learn(self, item: WorkItem, report: PeakReport) -> None:
        if report.rss_peak_bytes is not None and (
            self.child_rss_bytes is None or report.rss_peak_bytes > self.child_rss_bytes
        ):
            self.child_rss_bytes = report.rss_peak_bytes
            ceiling_before = self.ceiling
            self.ceiling = self._ceiling()
            if self.ceiling.value < ceiling_before.value:
                self._record_simple(
                    "narrowed",
                    None,
                    self._representative_ask(),
                    f"host RAM holds {self.ceiling.value} children at "
                    f"{format_size(self.child_rss_bytes)} RSS each "
                    f"({format_size(self.ceiling.host_ram_bytes)} available); the ceiling "
                    f"goes {ceiling_before.value} -> {self.ceiling.value}",
                    width_before=ceiling_before.value,
                    width_after=self.ceiling.value,
                )
        if report.device is None:
            return
        if report.device_peak_bytes is None:
            self._sensor_error(
                self.devices[report.device],
                self.asks.ask(item.key),
                RuntimeError("a worker could not measure its task's device peak"),
                f"{item.key}'s ask stays as it was (no measurement)",
            )
            return
        before = self.asks.ask(item.key)
        after = self.asks.measure(item.key, report.device_peak_bytes)
        self._rebook(item.key, after.ask_bytes)
        self._reread_own()
        if before.basis != after.basis or after.ask_bytes > before.ask_bytes:
            self._redecide(item.key, before, after, report)

    def _rebook(self, key: str, ask_bytes: int) -> None:
        """Running tasks of ``key`` may reach its new, larger ask: book them at it."""
        for device in self.devices:
            for worker in device.workers:
                for queued in worker.queue:
                    if queued.key == key and queued.booked_bytes < ask_bytes:
                        queued.booked_bytes = ask_bytes

    def _reread_own(self) -> None:
        now = time.monotonic()
        if now - self.last_own_read_s < OWN_REREAD_INTERVAL_S:
            return
        self.last_own_read_s = now
        pid = os.getpid()
        for device in self.devices:
            try:
                own = self.sensor.read_process_bytes(device.info, pid)
            except Exception as exc:
                self._sensor_error(
                    device, self._representative_ask(), exc, "own high-water keeps its last value"
                )
                continue
            if own is not None and own > self.own_high_water_bytes.get(device.index, 0):
                self.own_high_water_bytes[device.index] = own

    def _redecide(self, key: str, before: Ask, after: Ask, report: PeakReport) -> None:
        """A key's ask changed: decide every device's width again and log what moved."""
        decisions = self.decide()
        changed = False
        for decision in decisions:
            device = self.devices[decision.device]
            old = device.width
            new = decision.width
            if device.oom_cap is not None:
                new = min(new, device.oom_cap)  # the cap an out-of-memory set still holds
            if new == old:
                continue
            changed = True
            event: EventName = "widened" if new > old else "narrowed"
            if new < old and self.strict and new < min(self.max_workers, self.ceiling.value):
                self._strict_refusal(decision, old)
                return
            capped = ""
            if decision.limit == "memory" and new < self.ceiling.value:
                capped = f" (the ceiling, {self.ceiling.limit}, allows {self.ceiling.value})"
            device.width = new
            self.record(
                Decision.from_width(
                    event,
                    decision,
                    time_s=self.now(),
                    width_before=old,
                    reason=(
                        f"{decision.describe()}{capped}; {key} measured "
                        f"{format_size(report.device_peak_bytes)} ({report.device_source}); "
                        f"ask {before.describe()} -> {after.describe()}; width {old} -> {new}"
                    ),
                    key=key,
                    extra=_report_extra(report),
                    key_ask=after,
                )
            )
            if new < old:
                self._retire_idle(device, new)
        if self.fixed_width is not None:
            self._check_fixed(decisions)
        for decision in decisions:
            device = self.devices[decision.device]
            if (
                not changed
                and decision.limit == "memory"
                and decision.width < self.ceiling.value
                and after.ask_bytes < before.ask_bytes
            ):
                self.record(
                    Decision.from_width(
                        "widen_refused",
                        decision,
                        time_s=self.now(),
                        width_before=device.width,
                        reason=(
                            f"{decision.describe()}; {key}'s smaller ask {after.describe()} "
                            f"would allow {self.ceiling.value} by the ceiling but the room "
                            f"holds {decision.width}"
                        ),
                        key=key,
                        key_ask=after,
                    )
                )
        if not changed and before.basis != after.basis:
            self._record_simple(
                "measured",
                None,
                after,
                f"{key}: ask {before.describe()} -> {after.describe()}; widths unchanged "
                f"({', '.join(str(d.width) for d in decisions) or self.ceiling.value})",
                extra=_report_extra(report),
            )
        self._update_width()

    def _on_oom(
        self,
        worker: _Worker,
        item: WorkItem,
        report: PeakReport,
        payload: bytes,
        ask_bytes: int,
    ) -> None:
        self.counts["oom"] += 1
        exc = _load_exception(payload)
        device = self.devices[worker.device] if worker.device is not None else None
        reached = report.device_peak_bytes
        lower_bound = (reached or 0) + (report.oom_requested_bytes or 0)
        before = self.asks.ask(item.key)
        if lower_bound > 0:
            self.asks.measure(item.key, lower_bound)
        after = self.asks.ask(item.key)
        self._rebook(item.key, after.ask_bytes)
        others = [w for w in device.running() if w is not worker] if device else []
        live_free: int | None = None
        live_used: int | None = None
        live_own: int | None = None
        live_pool: int | None = None
        if device is not None and device.census.readable:
            try:
                reading = self.sensor.read_memory(device.info)
                live_free, live_used = reading.free_bytes, reading.used_bytes
                rows = {r.pid: r.used_bytes for r in self.sensor.read_processes(device.info) or ()}
            except Exception as read_error:
                rows = {}
                self._sensor_error(
                    device, before, read_error, "the out-of-memory record lacks live terms"
                )
            live_own = rows.get(os.getpid())
            mine = [rows.get(w.pid) for w in device.workers]
            if mine and all(b is not None for b in mine):
                live_pool = sum(b or 0 for b in mine)
        # Retried when another task of the pool ran beside it at any time while it
        # ran (not only when the report arrives: a neighbour may have finished since).
        retry = self.retry_oom and (item.shared or bool(others))
        running_then = len(others) + 1
        new_cap = max(1, running_then - 1)
        bound = self._bound(device, before) if device is not None else None
        extra: dict[str, JsonValue] = {
            "task_ask_bytes": ask_bytes,
            "reached_bytes": reached,
            "requested_bytes": report.oom_requested_bytes,
            "live_free_bytes": live_free,
            "live_used_bytes": live_used,
            "live_own_bytes": live_own,
            "live_pool_bytes": live_pool,
            "census_co_tenant_bytes": device.census.co_tenant_bytes if device else None,
            "booked_bytes": sum(w.ask_bytes for w in others) + ask_bytes,
            "running": running_then,
            "tries": item.tries,
            "retry": retry,
            "error": f"{type(exc).__name__}: {exc}"[:500],
        }
        self.record(
            Decision(
                event="out_of_memory",
                time_s=self.now(),
                device=device.index if device else None,
                width_before=running_then,
                width_after=new_cap if retry else running_then,
                reason=(
                    f"card {device.index if device else '-'}: a task of {item.key} ran out of "
                    f"memory at {format_size(reached)} reached (asked for "
                    f"{format_size(report.oom_requested_bytes)} more), booked at "
                    f"{format_size(ask_bytes)} beside {len(others)} other running; live "
                    f"{format_size(live_used)} used, {format_size(live_free)} free; "
                    + (
                        (
                            f"retrying once its card runs at most {new_cap - 1} other "
                            f"task(s) (the fixed width {self.fixed_width} stays)"
                            if self.fixed_width is not None
                            else f"retrying at width {new_cap}"
                        )
                        if retry
                        else "it ran alone, so the error goes to its future"
                        if self.retry_oom
                        else "retries are off"
                    )
                ),
                bound=bound,
                ceiling=self.ceiling,
                key=item.key,
                extra=extra,
                key_ask=after,
            )
        )
        if retry and device is not None and self.fixed_width is not None:
            # Explicit concurrency is authoritative: the width stays, and the
            # retried task waits until its card runs fewer than it did.
            item.wait_below = new_cap
            self.counts["retries"] += 1
            with self.lock:
                self.pending.appendleft(item)
            return
        if retry and device is not None:
            old_width = device.width
            if lower_bound > ask_bytes:
                # The ask was the wrong term: the child needed more than it was
                # booked at. The larger ask narrows through the bound itself.
                decision = self.decide()[device.index]
                new_width = min(old_width, decision.width) if old_width else decision.width
                why = (
                    f"the ask was underestimated: booked at {format_size(ask_bytes)}, the "
                    f"task reached {format_size(reached)} and asked for "
                    f"{format_size(report.oom_requested_bytes)} more; {item.key}'s ask "
                    f"{before.describe()} -> {after.describe()}"
                )
                bound = decision.bound
            else:
                # The ask held; something the bound does not price grew (a
                # co-tenant, this process, fragmentation): cap the count.
                device.oom_cap = new_cap if device.oom_cap is None else min(device.oom_cap, new_cap)
                new_width = min(old_width, device.oom_cap) if old_width else device.oom_cap
                why = (
                    f"the task stayed within its ask ({format_size(ask_bytes)}), so something "
                    f"else on the card grew; at most {device.oom_cap} at once from now on"
                )
            if (
                self.strict
                and new_width < old_width
                and new_width < min(self.max_workers, self.ceiling.value)
            ):
                self._strict_refusal(self.decide(after)[device.index], running_then)
                _set_exception(item.future, copy_broken(self.broken_exc, self.broken or ""))
                return
            device.width = max(1, new_width)
            self.record(
                Decision(
                    event="narrowed",
                    time_s=self.now(),
                    device=device.index,
                    width_before=old_width,
                    width_after=device.width,
                    reason=(
                        f"card {device.index}: out of memory with {running_then} running; {why}"
                    ),
                    bound=bound,
                    ceiling=self.ceiling,
                    key=item.key,
                    limit="out_of_memory",
                    extra={"oom_cap": device.oom_cap},
                )
            )
            self._retire_idle(device, device.width)
            self.counts["retries"] += 1
            with self.lock:
                self.pending.appendleft(item)
            self._update_width()
            return
        self.counts["failed"] += 1
        error = DeviceOutOfMemoryError(
            f"card {device.index if device else '-'}: a task of {item.key} ran out of device "
            f"memory {'alone on the card' if not others else 'and retries are off'} "
            f"(booked at {format_size(ask_bytes)}, reached {format_size(reached)}); "
            f"{bound.describe() if bound else ''}. Free the card, or give a larger task_peak.",
            device=device.index if device else None,
            ask_bytes=ask_bytes,
            detail=str(exc),
        )
        error.__cause__ = exc
        _set_exception(item.future, error)

    # -- workers ending ---------------------------------------------------------------

    def _reap(self, worker: _Worker) -> None:
        """A worker's process ended: fail only the task it ran, and forget it."""
        process = worker.process
        process.join(timeout=1.0)
        exitcode = process.exitcode
        self._forget(worker)
        item = worker.queue.popleft() if worker.queue else None
        if worker.retiring and item is not None:
            worker.queue.appendleft(item)
            item = None
        with self.lock:
            # Tasks queued behind the running one never started: they run elsewhere.
            while worker.queue:
                self.pending.appendleft(worker.queue.pop())
        if item is None:
            return
        self.counts["lost"] += 1
        self.counts["failed"] += 1
        signal_name = None
        if exitcode is not None and exitcode < 0:
            try:
                signal_name = signal.Signals(-exitcode).name
            except ValueError:
                signal_name = f"signal {-exitcode}"
        how = f"was killed by {signal_name}" if signal_name else f"exited with code {exitcode}"
        hint = (
            " SIGKILL often means the host's out-of-memory killer; check host RAM."
            if signal_name == "SIGKILL"
            else ""
        )
        message = (
            f"A worker process (pid {worker.pid}) running a task of {item.key} {how}; "
            f"only this task failed and the pool goes on.{hint}"
        )
        self._record_simple(
            "worker_lost",
            self.devices[worker.device] if worker.device is not None else None,
            self.asks.ask(item.key),
            message,
            extra={"exitcode": exitcode, "signal": signal_name, "pid": worker.pid},
        )
        _set_exception(
            item.future, WorkerLostError(message, exitcode=exitcode, signal_name=signal_name)
        )
        self._update_width()

    def _forget(self, worker: _Worker) -> None:
        if worker.gone:
            return
        worker.gone = True
        for fileobj in (worker.conn, worker.process.sentinel):
            try:
                self.selector.unregister(fileobj)
            except (KeyError, ValueError):
                pass
        self.processes.pop(worker.pid, None)
        pool = self.host_workers if worker.device is None else self.devices[worker.device].workers
        if worker in pool:
            pool.remove(worker)
        try:
            worker.conn.close()
        except OSError:
            pass

    def _retire(self, worker: _Worker) -> None:
        """Ask a worker to exit once idle; its sentinel then tells the loop to forget it."""
        worker.retiring = True
        if worker.task is None:
            try:
                worker.conn.send_bytes(b"")
            except OSError:
                pass

    def _retire_idle(self, device: DeviceState, keep: int) -> None:
        idle = [w for w in device.workers if w.task is None and not w.retiring]
        excess = sum(1 for w in device.workers if not w.retiring) - keep
        for worker in idle[: max(0, excess)]:
            self._retire(worker)

    def _stop_workers(self) -> None:
        workers = list(self._all_workers())
        for worker in workers:
            worker.retiring = True
            try:
                worker.conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + 10.0
        for worker in workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.process.exitcode is None:
                worker.process.kill()
                worker.process.join(timeout=5.0)
            for item in worker.queue:
                _set_exception(
                    item.future, WorkerLostError("the pool stopped before this task finished")
                )
            worker.queue.clear()
            self._forget(worker)
        self._fail_pending()

    def _break(self, message: str, exc: BaseException) -> None:
        with self.lock:
            if self.broken is None:
                self.broken = message
                self.broken_exc = exc
        self._fail_pending()
        for worker in list(self._all_workers()):
            for item in worker.queue:
                _set_exception(item.future, copy_broken(self.broken_exc, message))
            worker.queue.clear()

    def _fail_pending(self) -> None:
        with self.lock:
            items = list(self.pending)
            self.pending.clear()
        for item in items:
            if self.broken is not None:
                _set_exception(item.future, copy_broken(self.broken_exc, self.broken))
            elif item.future.cancel():
                item.future.set_running_or_notify_cancel()
                self.counts["cancelled"] += 1
            else:
                _set_exception(
                    item.future, WorkerLostError("the pool stopped before this task ran")
                )

    def _strict_refusal(self, decision: WidthDecision, width_before: int) -> None:
        message = (
            f"strict mode: {decision.describe()}, below the requested width "
            f"{self.max_workers}; refusing to narrow. Free the card, lower max_workers, "
            "or drop strict=True."
        )
        error = WidthError(message, decision=decision_dict(decision, width_before))
        self._record_simple(
            "narrowed",
            self.devices[decision.device],
            self._representative_ask(),
            message,
            width_before=width_before,
            width_after=decision.width,
        )
        self._break(message, error)

    def _check_fixed(self, decisions: Sequence[WidthDecision]) -> None:
        assert self.fixed_width is not None
        bound_width = sum(d.width for d in decisions)
        if bound_width < self.fixed_width:
            self.record(
                Decision(
                    event="fixed_width_over_bound",
                    time_s=self.now(),
                    device=None,
                    width_before=self.fixed_width,
                    width_after=self.fixed_width,
                    reason=(
                        f"fixed width {self.fixed_width} is wider than the bound allows "
                        f"({bound_width}: "
                        + "; ".join(d.describe() for d in decisions)
                        + "); keeping the width you asked for"
                    ),
                    extra={"bound_width": bound_width},
                )
            )

    def _update_width(self) -> None:
        if self.fixed_width is not None:
            width = self.fixed_width
        elif self.devices:
            width = max(1, min(self.ceiling.value, sum(d.width for d in self.devices)))
        else:
            width = self.ceiling.value
        if width != self.width:
            self.width = width
            self.widths.append((round(self.now(), 6), width))

    def _record_simple(
        self,
        event: EventName,
        device: DeviceState | None,
        ask: Ask,
        reason: str,
        *,
        width_before: int | None = None,
        width_after: int | None = None,
        extra: Mapping[str, JsonValue] | None = None,
    ) -> None:
        bound = self._bound(device, ask) if device is not None else None
        width = device.width if device is not None else self.width
        self.record(
            Decision(
                event=event,
                time_s=self.now(),
                device=device.index if device is not None else None,
                width_before=width if width_before is None else width_before,
                width_after=width if width_after is None else width_after,
                reason=reason,
                bound=bound,
                ceiling=self.ceiling,
                key=ask.key or None,
                extra=dict(extra or {}),
                key_ask=ask if ask.key else None,
            )
        )


def decision_dict(decision: WidthDecision, width_before: int) -> dict[str, Any]:
    """A width decision as the decision log writes it."""
    return Decision.from_width(
        "narrowed", decision, time_s=0.0, width_before=width_before, reason=decision.describe()
    ).to_dict()


def _report_extra(report: PeakReport) -> dict[str, JsonValue]:
    return {
        "peak_bytes": report.device_peak_bytes,
        "peak_source": report.device_source,
        "baseline_bytes": report.baseline_bytes,
        "rss_peak_bytes": report.rss_peak_bytes,
    }


def copy_broken(exc: BaseException | None, message: str) -> BaseException:
    if isinstance(exc, BrokenProcessPool):
        return type(exc)(*exc.args)
    if isinstance(exc, WidthError):
        return WidthError(str(exc), decision=exc.decision)
    error = BrokenProcessPool(message)
    error.__cause__ = exc
    return error


def _load_exception(payload: bytes) -> BaseException:
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


def _loky_context() -> Any:
    from loky.backend.context import get_context

    return get_context("loky")
