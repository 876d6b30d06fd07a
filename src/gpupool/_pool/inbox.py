"""The inbox: the only part of a pool's dispatcher that caller threads touch (process layer).

Caller threads (``submit``, ``shutdown``, ``terminate_workers``, an exiting
interpreter, a collected executor) leave tasks and flags here under one lock and
wake the dispatcher thread through a pipe; the dispatcher thread says here that
the pool broke or stopped, and ``submit`` refuses from then on. This is loky's
``executor_flags``: the state that crosses threads, in one small object.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from gpupool._core.events import TaskIdentity
from gpupool._core.predict import Features
from gpupool._errors import GpuPoolError

__all__ = [
    "Inbox",
    "WorkItem",
    "at_interpreter_exit",
    "callable_name",
    "copy_broken",
    "interpreter_exiting",
]

_task_ids = itertools.count()

#: Set once, as the interpreter begins to exit (:func:`_run_exit_hooks`, before the pool's
#: hooks run): ``submit`` refuses new work from then on, as CPython's pool does.
_interpreter_exiting = False


def interpreter_exiting() -> bool:
    """Whether the interpreter has begun to exit (``submit`` then refuses new work)."""
    return _interpreter_exiting


#: The exit hooks of the pool's modules (the dispatcher's, sigterm's), run by
#: :func:`_run_exit_hooks` last registered first, as ``threading`` runs its own.
_exit_hooks: list[Callable[[], None]] = []


def at_interpreter_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` as the interpreter begins to exit: a module imported with the first pool
    registers here, not with ``threading``, whose turn this module took as the class was
    imported (and which refuses a hook once the interpreter exits)."""
    _exit_hooks.append(hook)


def _run_exit_hooks() -> None:
    global _interpreter_exiting
    _interpreter_exiting = True  # a pool made from now on is refused, and no task submitted
    try:
        for hook in reversed(_exit_hooks):
            hook()
    except KeyboardInterrupt:
        # SIGTERM (``on_interrupt="terminate"``: raised as Ctrl-C) while the exit waited for
        # the pools' work: sigterm's hook ran before the wait, when no SIGTERM had come, so
        # the hooks run again and it stops the tasks instead of waiting for them (after
        # Ctrl-C the wait goes on, as CPython's does). Raised again, as at any other moment.
        for hook in reversed(_exit_hooks):
            hook()
        raise


# Registered as the class is imported, with the script's imports, not as the first pool is
# made: ``threading`` runs its exit hooks last registered first, so a ``ThreadPoolExecutor``
# whose module the script imports after this one still finishes its tasks (which may submit
# to a pool) before the pools stop taking work, as before the pool's machinery was imported
# with its first pool, and as with CPython's pool module (which registers as it is imported).
threading._register_atexit(_run_exit_hooks)  # type: ignore[attr-defined]


def callable_name(fn: Callable[..., object]) -> str:
    """``module.qualname`` of a callable (a partial's function): a task's default key, and
    the initializer's name in messages."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}"


@dataclass(eq=False, slots=True)
class WorkItem:
    """One submitted task: its future, its call, its key, and whether it started.

    ``call`` is ``(fn, args, kwargs)`` as given, pickled when it is sent to a worker (as
    CPython's pool pickles in its feeder thread): the parent never holds a pickled copy of
    work that waits. What the pool prices about it is the planner's, under ``task_id``.
    """

    future: Future[Any]
    call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]
    key: str
    hint_bytes: int | None
    size: float | None = None
    started: bool = False
    # Seconds it may run once its worker read it (None: no deadline), and how many times a
    # worker was lost before it read this task's frame (the task then runs on another).
    timeout_s: float | None = None
    unread: int = 0
    # What the call's arguments say (gpupool._pool.features), read at submit.
    features: Features = ()
    task_id: int = field(default_factory=functools.partial(next, _task_ids))
    # Its map position (and how many positions a chunk covers) and the caller's label.
    entry: int | None = None
    entries: int = 1
    label: str | None = None

    def identity(self) -> TaskIdentity:
        """Which task this is, for the records about it."""
        return TaskIdentity(
            task_id=self.task_id, entry=self.entry, entries=self.entries, label=self.label
        )


class Inbox:
    """Tasks submitted and not yet taken, the flags callers raise, the break, the wake pipe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.incoming: collections.deque[WorkItem] = collections.deque()
        self.submitted_count = 0  # ended tasks never outnumber it (statistics())
        self.shutdown_requested = False
        self.cancel_requested = False
        self.kill_signal: int | None = None
        self.stopped = False  # the dispatcher takes nothing more (its descriptors close)
        self.broken: str | None = None  # the first break's, set once: submit raises a copy
        self.broken_exc: BaseException | None = None
        # Non-blocking: one byte per wake-up, drained with one read, so a burst of submits
        # costs a burst of one-byte writes at most.
        self.wake_reader, self.wake_writer = os.pipe()
        os.set_blocking(self.wake_reader, False)
        os.set_blocking(self.wake_writer, False)
        self.wake_flag = False

    # -- caller threads ------------------------------------------------------------------

    @property
    def submitted(self) -> int:
        with self.lock:
            return self.submitted_count

    def put(self, item: WorkItem) -> None:
        """Hand a task to the dispatcher.

        Raises:
            BrokenProcessPool: the pool broke (checked under the lock, so no task is
                appended after the dispatcher has stopped).
            RuntimeError: the dispatcher has stopped.
        """
        with self.lock:
            if self.broken is not None:
                raise copy_broken(self.broken_exc, self.broken)
            if self.stopped:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self.incoming.append(item)
            self.submitted_count += 1
            self._wake_locked()

    def request_shutdown(self, cancel_futures: bool = False) -> None:
        """Stop taking work; with ``cancel_futures`` the dispatcher cancels what it has not
        started, after it has started what fits now (as CPython's does with its call queue)."""
        with self.lock:
            self.shutdown_requested = True
            self.cancel_requested = self.cancel_requested or cancel_futures
            self._wake_locked()

    def request_kill(self, sig: int) -> None:
        """``terminate_workers``/``kill_workers``: cancel what has not started, fail what
        waits to be retried, start nothing more, and signal every worker (the dispatcher
        does it, so a worker being started right now is signalled too)."""
        with self.lock:
            self.shutdown_requested = self.cancel_requested = True
            self.kill_signal = sig
            self._wake_locked()

    def _wake_locked(self) -> None:
        if not self.wake_flag and not self.stopped:  # stopped: the pipe may be closed
            self.wake_flag = True
            try:
                os.write(self.wake_writer, b"\0")
            except BlockingIOError:
                pass  # full: the dispatcher has wake-ups to read anyway

    # -- the dispatcher thread -----------------------------------------------------------

    def woken(self) -> None:
        """Read the wake-ups so far (the next write wakes the dispatcher again)."""
        try:
            while os.read(self.wake_reader, 4096):
                pass
        except BlockingIOError:
            pass
        self.wake_flag = False

    def take(self) -> WorkItem | None:
        """The oldest task not yet taken, or ``None``."""
        with self.lock:
            return self.incoming.popleft() if self.incoming else None

    def take_cancel(self) -> bool:
        """Whether ``shutdown(cancel_futures=True)`` asked to cancel since the last call."""
        if not self.cancel_requested:
            return False
        with self.lock:
            self.cancel_requested = False
        return True

    def done(self, *, holding: bool, busy: bool) -> bool:
        """Whether the dispatcher may stop: shut down with nothing submitted, held
        (``holding``) or running (``busy``), or broken with nothing running."""
        with self.lock:
            if self.shutdown_requested and not self.incoming and not holding and not busy:
                return True
            return self.broken is not None and not busy

    def break_with(self, message: str, exc: BaseException) -> None:
        with self.lock:
            if self.broken is None:
                self.broken, self.broken_exc = message, exc

    def stop(self) -> None:
        with self.lock:
            self.stopped = True

    def close(self) -> None:
        self.stop()
        os.close(self.wake_reader)
        os.close(self.wake_writer)


def copy_broken(exc: BaseException | None, message: str) -> BaseException:
    """A fresh copy of the pool's breaking error for one future or one ``submit`` (each
    raise adds its own traceback), with its attributes and cause. ``BrokenProcessPool``'s
    module (``multiprocessing.connection``, ``tempfile``...) is imported here, where a pool
    broke and its dispatcher has loaded it long since: not by what imports the inbox (a
    worker, wherever the user's script imports the pool at its top level)."""
    from concurrent.futures.process import BrokenProcessPool

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
