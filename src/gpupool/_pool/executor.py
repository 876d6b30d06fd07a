"""GpuPoolExecutor: the drop-in ``concurrent.futures`` pool that prices K children against the card.

Data flow (one dispatcher thread per pool owns every scheduling decision)::

    caller threads            dispatcher thread                      workers (loky processes)
    --------------            -----------------                      -----------------------
    submit(fn, *a) -> pending -> place: ceiling, byte bound per card, -> send_bytes(task)
      (PENDING)       deque      live gate, a warm or new worker         probe.start(); fn(*a)
                                 (RUNNING once handed over)              probe.stop() -> report
                   futures  <-  result / error / oom / worker death  <- send_bytes(kind, report)
                                 asks learn from reports; width
                                 decisions -> DecisionLog

Tasks held back for memory stay PENDING in the parent, so ``cancel()`` works
on them; a task becomes RUNNING only when it is handed to a worker, one task
per worker at a time, so the pool always knows which task a dead worker was
running. Workers are started lazily by loky's process backend with their
device pinned in the environment before any import, kept warm, and retired
when their device narrows.

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
import itertools
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import selectors
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool, _RemoteTraceback
from dataclasses import dataclass, field
from functools import partial
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
    DEFAULT_MARGIN_BYTES,
    DEFAULT_MARGIN_FRACTION,
    DEFAULT_RESERVE_BYTES,
    Ask,
    AskTable,
    Policy,
)
from gpupool._core.units import GiB, format_size, parse_size
from gpupool._errors import (
    ConfigurationError,
    DeviceOutOfMemoryError,
    WidthError,
    WorkerLostError,
)
from gpupool._log import DecisionLog, check_log_path
from gpupool._pool.worker import dumps_call, process_chunk, worker_main
from gpupool._sensors.select import SIMULATOR_ENV, default_sensor

if TYPE_CHECKING:
    from gpupool._sensors.base import DeviceInfo, Sensor

__all__ = ["GpuPoolExecutor", "PoolStatistics", "TaskOptions"]

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

#: Estimate used when no ``task_peak`` is given and no card is readable.
_UNKNOWN_ESTIMATE_BYTES = GiB

_BROKEN_INIT = "A child process terminated abruptly, the process pool is not usable anymore"

_dispatchers: weakref.WeakSet[_Dispatcher] = weakref.WeakSet()
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


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskOptions:
    """Per-call options: a task key and a peak hint (see :meth:`GpuPoolExecutor.options`).

    Attributes:
        key: tasks with the same key share one learned ask; by default the
            key is the function's qualified name.
        task_peak: an estimate of this key's device peak, used until a child
            of the key reports a measurement.
    """

    key: str | None = None
    task_peak: str | int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolStatistics:
    """An immutable summary of a pool's run so far.

    Attributes:
        tasks_submitted: tasks given to the pool.
        tasks_completed: tasks that returned a result.
        tasks_failed: tasks whose future holds an exception.
        tasks_cancelled: tasks cancelled before they started.
        retries: re-runs after a device out-of-memory.
        out_of_memory: device out-of-memory events.
        workers_started: worker processes started.
        workers_lost: workers that died while running a task.
        live_gate_waits: times a task was held back by the live gate.
        width: the current total width.
        widths: ``(time_s, width)`` at every change of the total width.
        asks: each task key's current ask, with its basis.
    """

    tasks_submitted: int
    tasks_completed: int
    tasks_failed: int
    tasks_cancelled: int
    retries: int
    out_of_memory: int
    workers_started: int
    workers_lost: int
    live_gate_waits: int
    width: int
    widths: tuple[tuple[float, int], ...]
    asks: Mapping[str, Ask] = field(default_factory=dict)


def _task_key(fn: Callable[..., Any]) -> str:
    while isinstance(fn, partial):
        fn = fn.func
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}"


class _WorkItem:
    __slots__ = (
        "booked_bytes",
        "call",
        "future",
        "hint_bytes",
        "key",
        "started",
        "task_id",
        "tries",
    )

    def __init__(
        self, task_id: int, future: Future[Any], call: bytes, key: str, hint_bytes: int | None
    ) -> None:
        self.task_id = task_id
        self.future = future
        self.call = call
        self.key = key
        self.hint_bytes = hint_bytes
        self.started = False
        self.tries = 0
        self.booked_bytes = 0


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
        self.queue: collections.deque[_WorkItem] = collections.deque()
        self.tasks_done = 0
        self.retiring = False
        self.gone = False
        self.started_s = 0.0

    @property
    def task(self) -> _WorkItem | None:
        """The task running now (the head of the queue), or ``None`` when idle."""
        return self.queue[0] if self.queue else None

    @property
    def ask_bytes(self) -> int:
        """Device bytes booked for this worker: the largest ask of its tasks."""
        return max((item.booked_bytes for item in self.queue), default=0)


class _Spawn:
    """An order to start a worker for a device (``None``: a host-bounded pool)."""

    __slots__ = ("device", "pool")

    def __init__(self, device: _Device | None, pool: list[_Worker]) -> None:
        self.device = device
        self.pool = pool


class _Device:
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


class _Dispatcher:
    """Owns the scheduling state; only its thread changes it (submit only appends)."""

    def __init__(
        self,
        *,
        census: Census,
        devices: list[_Device],
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
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.pending: collections.deque[_WorkItem] = collections.deque()
        self.host_workers: list[_Worker] = []
        self.processes: dict[int, Any] = {}
        self.own_high_water: dict[int, int] = {d.index: d.census.own_bytes or 0 for d in devices}
        self.last_own_read = self.t0
        self.child_rss_bytes: int | None = None
        self.shutdown_requested = False
        self.cancel_requested = False
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

    def wake(self) -> None:
        if not self.wake_flag:
            self.wake_flag = True
            try:
                os.write(self.wake_writer, b"\0")
            except OSError:
                pass  # full (the dispatcher is awake anyway) or closed (it has stopped)

    def enqueue(self, item: _WorkItem) -> None:
        with self.lock:
            self.pending.append(item)
            self.counts["submitted"] += 1
        self.wake()

    def request_shutdown(self, cancel_futures: bool = False) -> None:
        """Stop taking work; with ``cancel_futures`` the dispatcher cancels what it has not
        started, after it has started what fits now (as CPython's does with its call queue)."""
        with self.lock:
            self.shutdown_requested = True
            if cancel_futures:
                self.cancel_requested = True
        self.wake()

    def _cancel_pending(self) -> None:
        with self.lock:
            self.cancel_requested = False
            for item in self.pending:
                if not item.started:
                    item.future.cancel()

    def join(self, timeout: float | None = None) -> None:
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    # -- the dispatcher thread --------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def record(self, decision: Decision) -> None:
        self.log.append(decision)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # never leave a future pending
            self._break(f"the gpupool dispatcher thread crashed: {exc!r}", exc)
        finally:
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
            self.log.close()
            self.selector.close()
            os.close(self.wake_reader)
            os.close(self.wake_writer)

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

    def _own_high_water(self, device: _Device) -> int:
        return self.own_high_water.get(device.index, 0)

    def _bound(self, device: _Device, ask: Ask) -> Bound:
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
            worker = self._start(placement) if isinstance(placement, _Spawn) else placement
            self._send(item, worker)

    def _place(self, item: _WorkItem) -> _Worker | _Spawn | str | None:
        running = self._running_count()
        if running >= self.ceiling.value:
            return None
        if not self.devices:
            return self._worker_for(None, self.host_workers)
        ask = self._ask_for(item)
        if self.fixed_width is not None:
            device = min(self.devices, key=lambda d: (len(d.running()), d.index))
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

    def _queue_behind(self, item: _WorkItem) -> _Worker | None:
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

    def _ask_for(self, item: _WorkItem) -> Ask:
        if item.hint_bytes is not None:
            self.asks.hint(item.key, item.hint_bytes)
            item.hint_bytes = None
        return self.asks.ask(item.key)

    def _live_gate(self, device: _Device, ask: Ask, busy: list[_Worker]) -> bool | None:
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

    def _sensor_error(self, device: _Device, ask: Ask, exc: BaseException, effect: str) -> None:
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

    def _worker_for(self, device: _Device | None, pool: list[_Worker]) -> _Worker | _Spawn:
        """An idle warm worker for ``device``, or an order to start one."""
        for worker in pool:
            if worker.task is None and not worker.retiring:
                return worker
        return _Spawn(device, pool)

    def _start(self, order: _Spawn) -> _Worker:
        worker = self._spawn(order.device)
        order.pool.append(worker)
        return worker

    def _spawn(self, device: _Device | None) -> _Worker:
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

    def _send(self, item: _WorkItem, worker: _Worker) -> None:
        if worker.device is not None:
            item.booked_bytes = self.asks.ask(item.key).ask_bytes
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
        kind, report_tuple, payload = pickle.loads(message)
        item = worker.queue.popleft() if worker.queue else None
        ask_bytes = item.booked_bytes if item is not None else 0
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
                _set_exception(item.future, _copy_broken(error, str(error)))
            self._break(f"{_BROKEN_INIT}: a worker's initializer raised {exc!r}", error)
            return
        worker.tasks_done += 1
        if item is None:
            return
        if report_tuple is None:
            # The task never ran (it could not be unpickled): nothing to learn.
            self._finish(item, kind, payload)
            return
        report = PeakReport(
            device=report_tuple[0],
            device_peak_bytes=report_tuple[1],
            device_source=report_tuple[2],
            baseline_bytes=report_tuple[3],
            rss_peak_bytes=report_tuple[4],
            rss_source=report_tuple[5],
            oom=report_tuple[6],
            oom_requested_bytes=report_tuple[7],
        )
        if self.max_tasks_per_child is not None and worker.tasks_done >= self.max_tasks_per_child:
            worker.retiring = True
        if kind == "oom":
            self._on_oom(worker, item, report, payload, ask_bytes)
        else:
            self._learn(item, report)
            self._finish(item, kind, payload)
        if worker.retiring:
            self._retire(worker)

    def _finish(self, item: _WorkItem, kind: str, payload: bytes) -> None:
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

    def _fail(self, item: _WorkItem, error: BaseException) -> None:
        self.counts["failed"] += 1
        _set_exception(item.future, error)

    def _learn(self, item: _WorkItem, report: PeakReport) -> None:
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
        if report.device_peak_bytes is None or report.device is None:
            return
        before = self.asks.ask(item.key)
        after = self.asks.measure(item.key, report.device_peak_bytes)
        self._reread_own()
        if before.basis != after.basis or after.ask_bytes > before.ask_bytes:
            self._redecide(item.key, before, after, report)

    def _reread_own(self) -> None:
        now = time.monotonic()
        if now - self.last_own_read < OWN_REREAD_INTERVAL_S:
            return
        self.last_own_read = now
        pid = os.getpid()
        for device in self.devices:
            try:
                own = self.sensor.read_process_bytes(device.info, pid)
            except Exception as exc:
                self._sensor_error(
                    device, self._representative_ask(), exc, "own high-water keeps its last value"
                )
                continue
            if own is not None and own > self.own_high_water.get(device.index, 0):
                self.own_high_water[device.index] = own

    def _redecide(self, key: str, before: Ask, after: Ask, report: PeakReport) -> None:
        """A key's ask changed: decide every device's width again and log what moved."""
        decisions = self.decide()
        changed = False
        for decision in decisions:
            device = self.devices[decision.device]
            old = device.width
            new = decision.width
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
        item: _WorkItem,
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
        retry = self.retry_oom and bool(others)
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
                        f"retrying at width {new_cap}"
                        if retry
                        else "it ran alone, so the error goes to its future"
                        if self.retry_oom
                        else "retries are off"
                    )
                ),
                bound=bound,
                key=item.key,
                extra=extra,
            )
        )
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
            if self.strict and new_width < self.max_workers:
                self._strict_refusal(self.decide(after)[device.index], running_then)
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

    def _retire_idle(self, device: _Device, keep: int) -> None:
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
                _set_exception(item.future, _copy_broken(self.broken_exc, message))
            worker.queue.clear()

    def _fail_pending(self) -> None:
        with self.lock:
            items = list(self.pending)
            self.pending.clear()
        for item in items:
            if self.broken is not None:
                _set_exception(item.future, _copy_broken(self.broken_exc, self.broken))
            elif item.future.cancel():
                item.future.set_running_or_notify_cancel()
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
        device: _Device | None,
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


def _copy_broken(exc: BaseException | None, message: str) -> BaseException:
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


class _OptionsView:
    """``submit`` and ``map`` with per-call options; see :meth:`GpuPoolExecutor.options`."""

    def __init__(self, executor: GpuPoolExecutor, options: TaskOptions) -> None:
        self._executor = executor
        self._options = options

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """As :meth:`GpuPoolExecutor.submit`, with this view's key and peak hint."""
        return self._executor._submit(fn, args, kwargs, self._options)

    def map(
        self,
        fn: Callable[..., Any],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        buffersize: int | None = None,
    ) -> Iterator[Any]:
        """As :meth:`GpuPoolExecutor.map`, with this view's key and peak hint."""
        return self._executor._map(fn, iterables, timeout, chunksize, buffersize, self._options)


class GpuPoolExecutor(concurrent.futures.Executor):
    """A process pool that runs as many tasks at once as the cards' memory holds.

    A drop-in for ``concurrent.futures.ProcessPoolExecutor``: the same
    positional parameters, ``submit``, ``map``, ``shutdown``, futures that work
    with ``concurrent.futures.wait`` and ``concurrent.futures.as_completed``,
    and exceptions re-raised with the child's traceback as their cause.
    Functions and arguments travel with cloudpickle, so lambdas, closures and
    functions defined in ``__main__`` work.

    Args:
        max_workers: a ceiling on the width, never a promise; default: the
            usable CPUs.
        mp_context: accepted for compatibility; workers always start with
            spawn semantics (loky's fork+exec), since CUDA does not survive
            ``fork``. A ``fork`` context is refused.
        initializer: called in each worker before its first task.
        initargs: arguments for ``initializer``.
        max_tasks_per_child: a worker exits after this many tasks and is
            replaced when needed.
        task_peak: the estimated device peak of one task (``"6GiB"``). Used
            until children report measurements. ``None``: the first task of
            each key runs alone until measured.
        reserve: bytes kept free on every card (default 256 MiB).
        margin: least margin over a measured peak (default 256 MiB).
        margin_fraction: margin as a fraction of the measured peak, when larger
            (default 0.10).
        devices: device indexes or UUIDs the pool may use (default: all that
            ``CUDA_VISIBLE_DEVICES`` leaves visible).
        width: fixed-width mode: run exactly this many at once, whatever the
            bound says (logged when it exceeds the bound).
        strict: refuse to narrow below ``max_workers``: raise
            :class:`~gpupool.WidthError` at construction, and break the pool
            with it if a later measurement or out-of-memory would narrow.
        retry_oom: retry a task that ran out of device memory at a narrower
            width (default); it reaches its future only when it ran alone.
        log_path: append every decision to this JSON Lines file.
        env: extra environment variables for every worker.
        sensor: where readings come from (default: NVML, or the simulator
            inside a ``gpupool.testing.SimulatedHost``).
        progress: show a progress bar (tqdm, when installed) with the width
            and the asks while ``map`` results are consumed: ``None`` when
            standard error is a terminal, ``True`` always, ``False`` never.

    Raises:
        ConfigurationError: a value is wrong; the message names it (also a
            :class:`ValueError`).
        WidthError: ``strict=True`` and the bound is narrower than ``max_workers``.
    """

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: Any = None,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        *,
        max_tasks_per_child: int | None = None,
        task_peak: str | int | None = None,
        reserve: str | int | None = None,
        margin: str | int | None = None,
        margin_fraction: float | None = None,
        devices: Sequence[int | str] | None = None,
        width: int | None = None,
        strict: bool = False,
        retry_oom: bool = True,
        log_path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        sensor: Sensor | None = None,
        progress: bool | None = None,
    ) -> None:
        if max_workers is not None:
            if isinstance(max_workers, bool) or not isinstance(max_workers, int):
                raise TypeError(f"max_workers must be an int, got {max_workers!r}")
            if max_workers <= 0:
                raise ValueError("max_workers must be greater than 0")
        if mp_context is not None:
            method = mp_context.get_start_method(allow_none=False)
            if method == "fork":
                if max_tasks_per_child is not None:
                    raise ValueError(
                        "max_tasks_per_child is incompatible with the 'fork' multiprocessing "
                        "start method; supply a different mp_context."
                    )
                raise ConfigurationError(
                    "mp_context uses 'fork', which CUDA does not survive; gpupool starts "
                    "workers with spawn semantics. Pass mp_context=None or a spawn context."
                )
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if max_tasks_per_child is not None:
            if not isinstance(max_tasks_per_child, int) or isinstance(max_tasks_per_child, bool):
                raise TypeError("max_tasks_per_child must be an integer")
            if max_tasks_per_child <= 0:
                raise ValueError("max_tasks_per_child must be >= 1")
        if width is not None and (
            isinstance(width, bool) or not isinstance(width, int) or width <= 0
        ):
            raise ConfigurationError(
                f"width={width!r}: a fixed width must be a positive int, or None for the bound."
            )
        if margin_fraction is not None and not (
            isinstance(margin_fraction, (int, float))
            and not isinstance(margin_fraction, bool)
            and math.isfinite(margin_fraction)
            and 0 <= margin_fraction <= 10
        ):
            raise ConfigurationError(
                f"margin_fraction={margin_fraction!r}: pass a fraction such as 0.10."
            )
        if multiprocessing.current_process().daemon:
            raise ConfigurationError(
                "GpuPoolExecutor cannot start workers from a daemonic process (daemonic "
                "processes may not have children); run it from a non-daemonic process, e.g. "
                "set distributed.worker.daemon=False for Dask workers."
            )
        if strict and max_workers is None:
            raise ConfigurationError(
                "strict=True needs max_workers: the width that must not be narrowed."
            )
        peak_bytes = (
            parse_size(task_peak, name="task_peak", allow_zero=False)
            if task_peak is not None
            else None
        )
        policy = Policy(
            margin_bytes=(
                parse_size(margin, name="margin") if margin is not None else DEFAULT_MARGIN_BYTES
            ),
            margin_fraction=(
                float(margin_fraction) if margin_fraction is not None else DEFAULT_MARGIN_FRACTION
            ),
            reserve_bytes=(
                parse_size(reserve, name="reserve")
                if reserve is not None
                else DEFAULT_RESERVE_BYTES
            ),
        )
        path = check_log_path(log_path) if log_path is not None else None

        if progress is not None and not isinstance(progress, bool):
            raise ConfigurationError(f"progress={progress!r}: pass True, False or None.")
        self._progress = progress
        self._max_workers_given = max_workers
        self._mp_context = mp_context
        self._shutdown_lock = threading.Lock()
        self._shutdown = False
        self._task_ids = itertools.count()
        self._sensor = sensor if sensor is not None else default_sensor()

        from gpupool._sensors.census import read_census

        census, infos = read_census(
            self._sensor,
            devices=devices,
            visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            pid=os.getpid(),
        )
        self._census = census
        for card in census.cards:
            if card.total_bytes is not None and policy.reserve_bytes >= card.total_bytes:
                raise ConfigurationError(
                    f"reserve={format_size(policy.reserve_bytes)} is not smaller than card "
                    f"{card.device}'s {format_size(card.total_bytes)}; pass a smaller reserve."
                )
        device_states = [
            _Device(i, info, card)
            for i, (info, card) in enumerate(zip(infos, census.cards, strict=True))
        ]
        estimate = peak_bytes
        if estimate is None:
            # Priced at the whole room of the roomiest card: the first task of
            # each key runs alone until a child has measured it.
            rooms = [
                card.total_bytes
                - (card.co_tenant_bytes or 0)
                - (card.own_bytes or 0)
                - policy.reserve_bytes
                for card in census.cards
                if card.total_bytes is not None
            ]
            estimate = max([*rooms, _UNKNOWN_ESTIMATE_BYTES])
        self._max_workers = max_workers or census.host.cpus
        asks = AskTable(policy=policy, default_estimate_bytes=estimate)
        worker_env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        simulator = os.environ.get(SIMULATOR_ENV)
        if simulator:
            worker_env[SIMULATOR_ENV] = simulator
        worker_env.update(env or {})
        # Passed to each worker as a process argument, pickled while the worker is
        # spawned: multiprocessing queues and locks in initargs work, as in CPython.
        init_call = (initializer, tuple(initargs)) if initializer is not None else None
        log = DecisionLog(path)
        self._log = log
        self._dispatcher = _Dispatcher(
            census=census,
            devices=device_states,
            sensor=self._sensor,
            asks=asks,
            policy=policy,
            max_workers=self._max_workers,
            fixed_width=width,
            strict=strict,
            retry_oom=retry_oom,
            max_tasks_per_child=max_tasks_per_child,
            initializer=init_call,
            log=log,
            env=worker_env,
        )
        self._construct(peak_bytes)
        self._dispatcher.start()
        weakref.finalize(self, self._dispatcher.request_shutdown)

    def _construct(self, peak_bytes: int | None) -> None:
        d = self._dispatcher
        census = self._census
        ask = d._representative_ask()
        if not d.devices:
            d._update_width()
            reason = census.reason or "no device"
            d.record(
                Decision(
                    event="constructed",
                    time_s=d.now(),
                    device=None,
                    width_before=None,
                    width_after=d.width,
                    reason=(
                        f"{reason}; a host-bounded pool of width {d.width}, set by "
                        f"{d.ceiling.limit} ({d.ceiling.value})"
                    ),
                    ceiling=d.ceiling,
                    limit=d.ceiling.limit,
                    extra={"driver": census.driver, "sensor": census.sensor},
                )
            )
            return
        decisions = d.decide(ask)
        for decision in decisions:
            device = d.devices[decision.device]
            device.width = decision.width
            card = device.census
            note = f"; {card.reason}" if card.reason else ""
            basis = "" if peak_bytes is not None else " (no task_peak: priced at the room)"
            d.record(
                Decision.from_width(
                    "constructed",
                    decision,
                    time_s=d.now(),
                    width_before=None,
                    reason=f"{decision.describe()}{basis}{note}",
                    extra={
                        "uuid": card.uuid,
                        "census_free_bytes": card.free_bytes,
                        "census_own_bytes": card.own_bytes,
                        "reserved_bytes": card.reserved_bytes,
                        "source": card.source,
                        "own_source": card.own_source,
                        "unified": card.unified,
                    },
                )
            )
        d._update_width()
        if d.fixed_width is not None:
            d._check_fixed(decisions)
        elif d.strict and d.width < min(self._max_workers, d.ceiling.value):
            narrow = min(decisions, key=lambda x: x.width)
            message = (
                f"strict mode: the bound gives width {d.width}, below the requested "
                f"{self._max_workers}: "
                + "; ".join(x.describe() for x in decisions)
                + ". Free the card, lower max_workers, or drop strict=True."
            )
            d.log.close()
            raise WidthError(message, decision=decision_dict(narrow, self._max_workers))

    # -- CPython compatibility attributes ------------------------------------------------

    @property
    def _processes(self) -> dict[int, Any]:
        return self._dispatcher.processes

    @property
    def _broken(self) -> str | bool:
        return self._dispatcher.broken or False

    # -- the executor contract ----------------------------------------------------------

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Schedule ``fn(*args, **kwargs)``; returns a ``concurrent.futures.Future``.

        Raises:
            BrokenProcessPool: the pool is broken (a failing initializer).
            RuntimeError: the pool was shut down.
        """
        return self._submit(fn, args, kwargs, None)

    def options(
        self, *, key: str | None = None, task_peak: str | int | None = None
    ) -> _OptionsView:
        """``submit``/``map`` with a task key and a peak hint, keeping CPython's signatures.

        ::

            big = ex.options(key="big-model", task_peak="12GiB")
            future = big.submit(compile_entry, entry)

        Args:
            key: tasks with the same key share one learned ask.
            task_peak: this key's estimated peak until a child measures it.

        Raises:
            ConfigurationError: ``task_peak`` is not a positive size.
        """
        if task_peak is not None:
            parse_size(task_peak, name="task_peak", allow_zero=False)
        if key is not None and not isinstance(key, str):
            raise ConfigurationError(f"key={key!r}: a task key must be a str.")
        return _OptionsView(self, TaskOptions(key=key, task_peak=task_peak))

    def _submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: TaskOptions | None,
        key: str | None = None,
    ) -> Future[Any]:
        d = self._dispatcher
        with self._shutdown_lock:
            if d.broken is not None:
                raise _copy_broken(d.broken_exc, d.broken)
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if _global_shutdown:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            future: Future[Any] = Future()
            task_key = (options.key if options and options.key else None) or key or _task_key(fn)
            hint = (
                parse_size(options.task_peak, name="task_peak", allow_zero=False)
                if options is not None and options.task_peak is not None
                else None
            )
            try:
                call = dumps_call((fn, args, kwargs))
            except BaseException as exc:
                future.set_exception(exc)
                return future
            d.enqueue(_WorkItem(next(self._task_ids), future, call, task_key, hint))
            return future

    def map(
        self,
        fn: Callable[..., Any],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        buffersize: int | None = None,
    ) -> Iterator[Any]:
        """Like :func:`map`, running ``fn`` in the pool; results come back in input order.

        Args:
            fn: the function.
            *iterables: its arguments.
            timeout: seconds from this call after which a result not yet
                ready raises :class:`TimeoutError`.
            chunksize: items per task; larger chunks cut per-task overhead.
            buffersize: at most this many tasks are submitted ahead of the
                results consumed (Python 3.14's parameter, on every version).

        Raises:
            ValueError: ``chunksize < 1`` or ``buffersize < 1``.
        """
        return self._map(fn, iterables, timeout, chunksize, buffersize, None)

    def _track(self, results: Iterator[Any], iterables: Sequence[Iterable[Any]]) -> Iterator[Any]:
        if self._progress is False:
            return results
        from gpupool._progress import track

        sizes = [len(it) for it in iterables if isinstance(it, Sized)]
        total = min(sizes) if iterables and len(sizes) == len(iterables) else None
        return track(results, total=total, executor=self, enabled=self._progress)

    def _map(
        self,
        fn: Callable[..., Any],
        iterables: Sequence[Iterable[Any]],
        timeout: float | None,
        chunksize: int,
        buffersize: int | None,
        options: TaskOptions | None,
    ) -> Iterator[Any]:
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        if buffersize is not None and (not isinstance(buffersize, int) or buffersize < 1):
            raise ValueError("buffersize must be None or >= 1.")
        key = _task_key(fn)
        end_time = None if timeout is None else timeout + time.monotonic()
        args_iter = zip(*iterables, strict=False)
        if chunksize == 1:
            submit_one: Callable[[tuple[Any, ...]], Future[Any]] = partial(
                self._submit_args, fn, options, key
            )
            calls: Iterator[Future[Any]] = map(submit_one, args_iter)
        else:
            chunk_fn = partial(process_chunk, fn)
            calls = (
                self._submit(chunk_fn, (list(chunk),), {}, options, key)
                for chunk in _batched(args_iter, chunksize)
            )
        futures: collections.deque[Future[Any]] = collections.deque(
            calls if buffersize is None else itertools.islice(calls, buffersize)
        )
        results = _results(
            futures, calls if buffersize is not None else None, end_time, chunksize > 1
        )
        return self._track(results, iterables)

    def _submit_args(
        self, fn: Callable[..., Any], options: TaskOptions | None, key: str, args: tuple[Any, ...]
    ) -> Future[Any]:
        return self._submit(fn, args, {}, options, key)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; by default wait for what was submitted to finish.

        Args:
            wait: block until every running and pending task has finished and
                the workers have exited.
            cancel_futures: cancel every task that has not started yet.
        """
        with self._shutdown_lock:
            self._shutdown = True
        self._dispatcher.request_shutdown(cancel_futures)
        if wait:
            self._dispatcher.join()

    def terminate_workers(self) -> None:
        """Shut down without waiting, cancel what has not started, and SIGTERM the workers."""
        self._force(signal.SIGTERM)

    def kill_workers(self) -> None:
        """Shut down without waiting, cancel what has not started, and SIGKILL the workers."""
        self._force(signal.SIGKILL)

    def _force(self, sig: signal.Signals) -> None:
        processes = list(self._dispatcher.processes.values())
        self.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            try:
                os.kill(process.pid, sig)
            except (ProcessLookupError, ValueError, TypeError):
                pass

    # -- what the pool decided ----------------------------------------------------------

    @property
    def width(self) -> int:
        """How many tasks may run at once now, over every card."""
        return self._dispatcher.width

    @property
    def census(self) -> Census:
        """The census taken at construction."""
        return self._census

    @property
    def decisions(self) -> tuple[Decision, ...]:
        """Every decision so far, oldest first."""
        return self._log.records()

    def statistics(self) -> PoolStatistics:
        """An immutable summary of the run so far."""
        d = self._dispatcher
        counts = d.counts
        return PoolStatistics(
            tasks_submitted=counts["submitted"],
            tasks_completed=counts["completed"],
            tasks_failed=counts["failed"],
            tasks_cancelled=counts["cancelled"],
            retries=counts["retries"],
            out_of_memory=counts["oom"],
            workers_started=counts["workers_started"],
            workers_lost=counts["lost"],
            live_gate_waits=counts["gate_waits"],
            width=d.width,
            widths=tuple(d.widths),
            asks={k: d.asks.ask(k) for k in d.asks.keys()},  # noqa: SIM118
        )


def _batched(iterable: Iterator[tuple[Any, ...]], n: int) -> Iterator[tuple[tuple[Any, ...], ...]]:
    while True:
        chunk = tuple(itertools.islice(iterable, n))
        if not chunk:
            return
        yield chunk


def _results(
    futures: collections.deque[Future[Any]],
    more: Iterator[Future[Any]] | None,
    end_time: float | None,
    chunked: bool,
) -> Iterator[Any]:
    """Yield results in order; cancel what is left if the consumer stops early."""
    try:
        while futures:
            future = futures.popleft()
            if more is not None:
                nxt = next(more, None)
                if nxt is not None:
                    futures.append(nxt)
            try:
                box = [future.result(None if end_time is None else end_time - time.monotonic())]
            finally:
                future.cancel()
            del future
            # Yield without keeping a reference: a result the caller drops is freed.
            if chunked:
                chunk = box.pop()
                chunk.reverse()
                while chunk:
                    yield chunk.pop()
            else:
                yield box.pop()
    finally:
        for future in futures:
            future.cancel()
