"""The outcomes: the pool's futures, one ordered outbox, the counts, every error's wording.

The loop says how each task ended; this part words the error, counts it, and
queues it in one outbox in that order. The loop publishes the snapshot that
counts them, then delivers the outbox: a caller never sees a future newer than
the statistics it reads, and a failure never overtakes a result before it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import signal
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool, _RemoteTraceback
from typing import TYPE_CHECKING, Any, cast

import cloudpickle

from gpupool._broken import InitializerError, WorkerLostError, WorkerProtocolError
from gpupool._core.events import describe_task
from gpupool._core.units import format_size
from gpupool._errors import DeviceOutOfMemoryError, TaskTimeoutError, WidthError
from gpupool._observe.log import LOGGER
from gpupool._pool.acks import ACK_BOUND_S
from gpupool._pool.inbox import callable_name
from gpupool._pool.workers import STOPPED_LOST_S, TIMEOUT_GRACE_S
from gpupool._sensors.own_pid import own_pid

if TYPE_CHECKING:
    from gpupool._core.planner import Fail, Refuse
    from gpupool._pool.inbox import WorkItem
    from gpupool._pool.workers import Exited, SpawnFailed

__all__ = ["Outcomes", "callable_name"]

BROKEN_INIT = "A child process terminated abruptly, the process pool is not usable anymore"


class Outcomes:
    """The tasks the planner holds (pending or running) by task id, their futures, the
    outbox and the counts."""

    def __init__(self) -> None:
        self.items: dict[int, WorkItem] = {}
        # Every future taken, held weakly: at shutdown, those not done are lost (a bug).
        self.unresolved: weakref.WeakSet[Future[Any]] = weakref.WeakSet()
        self.counts = collections.Counter[str]()
        # How tasks ended this turn, in order: set at its end (deliver), after its snapshot.
        self.outbox: list[tuple[Future[Any], bool, Any]] = []
        self.in_outbox: set[Future[Any]] = set()
        # The process of the dispatcher thread: a done-callback may fork, and its child goes
        # on with a copy of that thread (see :meth:`forked`).
        self.pid = own_pid()

    def forked(self) -> bool:
        """Whether this is a child forked on the dispatcher thread (by a done-callback): its
        copy of the thread holds the parent's workers' sockets, log and bookings, none of
        them its own. It delivers nothing more and ends without the pool's clean-up."""
        return own_pid() != self.pid

    def take(self, item: WorkItem) -> bool:
        """Hold ``item``; ``False`` when its caller cancelled it first (then settled:
        CANCELLED_AND_NOTIFIED wakes ``wait()`` and ``as_completed()``)."""
        self.unresolved.add(item.future)
        if item.future.cancelled():
            item.future.set_running_or_notify_cancel()
            self.counts["cancelled"] += 1
            return False
        self.items[item.task_id] = item
        return True

    def claim(self, item: WorkItem) -> bool:
        """Make ``item``'s future RUNNING (once); ``False`` when the caller cancelled it first
        (let go and counted)."""
        if item.started:
            return True
        if not item.future.set_running_or_notify_cancel():
            self.items.pop(item.task_id, None)
            self.counts["cancelled"] += 1
            return False
        item.started = True
        return True

    def cancel(self, item: WorkItem) -> bool:
        """Cancel ``item``, not started, let go (``False``: its future is RUNNING already)."""
        if not item.future.cancel():
            return False
        item.future.set_running_or_notify_cancel()
        self.counts["cancelled"] += 1
        return True

    def answered(self, item: WorkItem, kind: str, payload: memoryview) -> None:
        """``item`` ended with a worker's answer (``ok``, ``error``, ``unpickle``)."""
        self.items.pop(item.task_id, None)
        error: BaseException
        if kind == "ok":
            try:
                result = cloudpickle.loads(payload)
            except BaseException as exc:
                error = broken_by(
                    "A result has failed to un-serialize in the parent. Please ensure "
                    "that the objects returned by the function are always picklable.",
                    detached(exc),
                )
            else:
                self.counts["completed"] += 1
                self._put(item.future, True, result)
                return
        elif kind == "unpickle":
            error = broken_by(
                "A task has failed to un-serialize in the worker. Please ensure that the "
                "arguments of the function are all picklable.",
                load_exception(payload),
            )
        else:
            error = load_exception(payload)
        self.fail(item, error)

    def fail(self, item: WorkItem, error: BaseException) -> None:
        """``item`` failed with ``error``: let go and counted, once."""
        self.items.pop(item.task_id, None)
        future = item.future
        if future.done() or future in self.in_outbox:
            return
        if not item.started and not future.set_running_or_notify_cancel():
            self.counts["cancelled"] += 1  # the caller cancelled it first: counted so
            return
        self.counts["failed"] += 1
        self._put(future, False, error)

    def fail_lost(self) -> int:
        """Fail every future neither done nor in the outbox (lost: a bug); how many."""
        lost = [f for f in self.unresolved if not f.done() and f not in self.in_outbox]
        for future in lost:
            self.counts["failed"] += 1
            self._put(future, False, WorkerLostError("the pool stopped and lost this task"))
        return len(lost)

    def _put(self, future: Future[Any], ok: bool, value: Any) -> None:
        self.outbox.append((future, ok, value))
        self.in_outbox.add(future)

    def deliver(self, *, stopping: bool = False) -> None:
        """Set the outbox's futures in order, keeping nothing of a result after it is set. A
        done-callback that raises a ``BaseException`` (``SystemExit``) crashes the
        dispatcher, but only after every other future of the outbox is set (``stopping``:
        it is only logged, as the dispatcher stops anyway). In a child a callback forked
        (:meth:`forked`), the rest is not set: those futures are the parent's."""
        outbox, self.outbox = self.outbox, []
        self.in_outbox.clear()
        crash: BaseException | None = None
        outbox.reverse()
        while outbox:
            future, ok, value = outbox.pop()
            try:
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)
            except concurrent.futures.InvalidStateError:
                pass
            except BaseException as exc:  # raised by a callback, after the future was set
                crash = crash or exc
            del future, value
            if self.forked():
                break
        if crash is not None and stopping:
            LOGGER.error("a done-callback raised as the pool stopped", exc_info=crash)
        elif crash is not None:
            raise crash


# -- the wording of every error the pool gives a future ----------------------------------


def task_named(item: WorkItem) -> str:
    """``item``'s key, and its ``map`` entry and label where it has them, for an error's
    message: ``pkg.embed (entry 25, label 'resnet-ckpt-7')``."""
    if item.entry is None and item.label is None:
        return item.key
    return f"{item.key} ({describe_task(item.identity().terms())})"


def oom_error(key: str, verdict: Fail, exc: BaseException | None) -> DeviceOutOfMemoryError:
    """A task of ``key`` ran out of device memory, and the planner will not try it again."""
    where = f"card {verdict.device}" if verdict.device is not None else "the pool"
    remedy = (
        "Run it on a larger card, or make it need less (a smaller batch or model shard)."
        if verdict.kind == "larger_than_card"
        else "Free the card, or give a larger task_peak."
    )
    error = DeviceOutOfMemoryError(
        f"{where}: a task of {key} ran out of device memory and failed: "
        f"{verdict.reason} (booked at {format_size(verdict.booked_bytes)}). {remedy}",
        device=verdict.device,
        ask_bytes=verdict.booked_bytes,
        detail=str(exc) if exc is not None else verdict.kind,
    )
    error.__cause__ = exc
    return error


def cancelled_waiting_error(key: str, ask_bytes: int) -> DeviceOutOfMemoryError:
    """A task that ran out of device memory alone waits for room at a cancelling shutdown."""
    return DeviceOutOfMemoryError(
        f"a task of {key} ran out of device memory alone and was waiting for "
        "room when the pool was shut down with cancel_futures=True",
        device=None,
        ask_bytes=ask_bytes,
        detail="shut down while waiting for room",
    )


def width_error(refused: Refuse) -> WidthError:
    """Strict mode: the planner refused to narrow the pool below ``max_workers``."""
    return WidthError(refused.reason, decision=refused.decision.to_dict())


def stopped_before_run_error(sig: int) -> WorkerLostError:
    """The error of a task handed to a worker (its future RUNNING) that had not run when
    ``terminate_workers()``/``kill_workers()`` (``sig``) stopped the pool: its worker was still
    starting, or it waited for room or for a retry. Named as a running task's is: the pool
    sent the signal itself."""
    name = signal.Signals(sig).name
    call = "kill_workers()" if sig == signal.SIGKILL else "terminate_workers()"
    return WorkerLostError(
        f"{call} stopped the pool before this task ran (its worker was still starting, or "
        f"it waited for room or a retry): {name}, sent by the pool itself.",
        signal_name=name,
    )


def lost_error(
    exited: Exited, key: str, *, timeout_s: float | None = None
) -> tuple[BaseException, dict[str, Any]]:
    """The error of the task of ``key`` that the ``exited`` worker ran (``timeout_s``: its
    deadline), and its record's terms beside the message."""
    pid, exitcode, by_pool = exited.worker.pid, exited.exitcode, exited.by_pool
    fault = exited.worker.fault if exited.worker.ready else None
    signal_name = _signal_name(exitcode)
    extra: dict[str, Any] = {"exitcode": exitcode, "signal": signal_name, "pid": pid}
    ended = _ending_error(exited, key, timeout_s, extra)
    if ended is not None:
        return ended, extra
    if fault is not None:
        extra["protocol_fault"] = fault
        message = (
            f"A worker process (pid {pid}) running a task of {key} broke the "
            f"protocol with the pool: it sent {fault}. The worker was killed and replaced; "
            "only this task failed and the pool goes on. A process the task forked that "
            "writes on the worker's descriptors, or a library that does, causes this."
        )
        return WorkerProtocolError(
            message, pid=pid, received=fault, exitcode=exitcode, signal_name=signal_name
        ), extra
    return _exit_error(pid, exitcode, signal_name, by_pool, key), extra


def _ending_error(
    exited: Exited, key: str, timeout_s: float | None, extra: dict[str, Any]
) -> BaseException | None:
    """The error where the pool ended the worker for its task's sake: past its deadline,
    stopped too long, or never reading the task's frame (``None``: none of these); its
    terms added to ``extra``."""
    pid, exitcode = exited.worker.pid, exited.exitcode
    signal_name = _signal_name(exitcode)
    ending = exited.worker.ending
    if ending == "timeout" and timeout_s is not None:
        extra["timeout_s"] = timeout_s
        message = (
            f"A task of {key} ran past its deadline of {timeout_s:g} s (timeout_s) in the "
            f"worker process pid {pid}: the pool sent SIGTERM to the worker and every "
            f"process below it, and SIGKILL to what was left after {TIMEOUT_GRACE_S:g} s "
            f"(the worker {exit_how(exitcode)}). Only this task failed; the worker is "
            "replaced and the pool goes on."
        )
        return TaskTimeoutError(message, task=key, timeout_s=timeout_s, pid=pid)
    if ending == "stopped":
        extra["stopped_s"] = STOPPED_LOST_S
        message = (
            f"A worker process (pid {pid}) running a task of {key} was stopped (SIGSTOP) "
            f"and not resumed for {STOPPED_LOST_S:g} s, so the pool killed it; only this "
            "task failed and the pool goes on. A task that stops its own process, or a "
            "kill -STOP left without its SIGCONT, causes this."
        )
        return WorkerLostError(message, exitcode=exitcode, signal_name=signal_name)
    if ending == "unread":
        extra["frame_unread"] = True
        message = (
            f"The worker process (pid {pid}) never read the frame of this task of {key} "
            f"(no acknowledgement within {ACK_BOUND_S:g} s: another reader of the worker's "
            "socket, such as a thread a task started, took it), on every worker it was "
            "sent to; the pool killed them. The task never ran."
        )
        return WorkerLostError(message, exitcode=exitcode, signal_name=signal_name)
    return None


def _exit_error(
    pid: int, exitcode: int | None, signal_name: str | None, by_pool: bool, key: str
) -> WorkerLostError:
    """The error of a worker that exited, or was killed: how, by whom where it was the pool,
    and the likely cause of a SIGKILL that was not."""
    how = exit_how(exitcode)
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
        f"A worker process (pid {pid}) running a task of {key} {how}; "
        f"only this task failed and the pool goes on.{hint}"
    )
    return WorkerLostError(message, exitcode=exitcode, signal_name=signal_name)


def unread_note(exited: Exited, key: str) -> tuple[str, dict[str, Any]]:
    """The record of a task of ``key`` whose frame the ``exited`` worker never acknowledged:
    it never ran, and runs on another worker."""
    pid = exited.worker.pid
    message = (
        f"The worker process (pid {pid}) did not acknowledge the frame of a task of {key} "
        f"within {ACK_BOUND_S:g} s (another reader of its socket took it?): the pool "
        "killed the worker; the task never ran, and runs on another worker."
    )
    return message, {
        "pid": pid,
        "exitcode": exited.exitcode,
        "signal": _signal_name(exited.exitcode),
        "frame_unread": True,
        "retried": True,
    }


def boot_error(exited: Exited, initializer: Callable[..., object] | None) -> BrokenProcessPool:
    """The ``exited`` worker died before it was ready (with an initializer set, or too many
    in a row without one): the pool's breaking error (no task ran in such a worker)."""
    pid, exitcode, fault = exited.worker.pid, exited.exitcode, exited.worker.fault
    how = (
        exit_how(exitcode)
        if fault is None
        else f"broke the protocol with the pool (it sent {fault}) and was killed"
    )
    if initializer is not None:
        name = callable_name(initializer)
        return InitializerError(
            f"{BROKEN_INIT}: a worker process (pid {pid}) {how} before it was "
            f"ready, in the initializer {name} or the start-up after it; no task ran in "
            "it. An initializer that kills its process (os._exit, a failed CUDA "
            "initialisation) breaks the pool as one that raises does.",
            initializer=name,
            exitcode=exitcode,
            signal_name=_signal_name(exitcode),
        )
    return BrokenProcessPool(
        f"A process in the process pool was terminated abruptly while the future was "
        f"running or pending: {exited.boot_deaths} worker processes in a row (the last, "
        f"pid {pid}, {how}) died before they were ready; no task ran in them. "
        "Check that the workers can start (imports, the environment, host memory, the "
        "script's top level, which each worker runs as the standard spawn pool's do: its "
        "stderr says why)."
    )


def initializer_error(initializer: Callable[..., object], payload: memoryview) -> InitializerError:
    """The initializer raised in a worker (its exception is ``payload``): the pool breaks."""
    exc = load_exception(payload)
    name = callable_name(initializer)
    error = InitializerError(
        f"{BROKEN_INIT}: the initializer {name} raised {exc!r}", initializer=name
    )
    error.__cause__ = exc
    return error


def start_data_error(
    initializer: Callable[..., object] | None, exc: BaseException
) -> BrokenProcessPool:
    """The initializer or its initargs cannot be pickled: no worker can ever start."""
    if initializer is None:  # the pool's own arguments: not expected
        return broken_by(f"a worker process cannot be started ({exc})", exc)
    name = callable_name(initializer)
    error = InitializerError(
        f"{BROKEN_INIT}: the initializer {name} or its initargs cannot be sent to a "
        f"worker process ({exc}). Workers are spawned: pass initargs that pickle "
        "(multiprocessing queues, locks and events from "
        "multiprocessing.get_context('spawn'), or a Manager's proxies).",
        initializer=name,
    )
    error.__cause__ = detached(exc.__cause__ or exc)
    return error


def spawn_error(failed: SpawnFailed) -> BaseException:
    """No worker could be started for a task: its error (the start's own OSError, if any)."""
    exc = failed.error
    note = (
        f"gpupool could not start a worker process for this task in {failed.tries} tries "
        f"over {failed.waited_s:.2f} s; only this task failed and the pool goes on"
    )
    error: BaseException
    os_error = _os_error_in(exc)
    if os_error is not None:
        # The start's own error (OSError picks EMFILE's subclass, and so on).
        error = OSError(os_error.errno, f"{os_error.strerror} ({note})")
    else:
        error = BrokenProcessPool(f"{type(exc).__name__}: {exc} ({note})")
    error.__cause__ = detached(exc)
    return error


def load_exception(payload: bytes | bytearray | memoryview) -> BaseException:
    """A task's exception as its worker sent it, with the remote traceback as its cause."""
    try:
        exc, tb = cloudpickle.loads(payload)
    except BaseException as error:
        broken = BrokenProcessPool(
            "An exception raised by the task has failed to un-serialize in the parent."
        )
        broken.__cause__ = detached(error)
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


def exit_how(exitcode: int | None) -> str:
    """How a process ended, for a message."""
    signal_name = _signal_name(exitcode)
    return f"was killed by {signal_name}" if signal_name else f"exited with code {exitcode}"


def _signal_name(exitcode: int | None) -> str | None:
    """The name of the signal that ended a process (``exitcode`` negative), else ``None``."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def broken_by(message: str, cause: BaseException) -> BrokenProcessPool:
    error = BrokenProcessPool(message)
    error.__cause__ = cause
    return error


def detached(exc: BaseException) -> BaseException:
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
