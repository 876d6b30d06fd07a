"""GpuPoolExecutor: the drop-in ``concurrent.futures`` pool that prices K children against the card.

The public class and its per-call options live here; the scheduling state
and the thread that owns it are in :mod:`gpupool._pool.dispatcher`, whose
docstring draws the data flow.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import math
import numbers
import operator
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, Protocol, TypeVar

from gpupool._core.events import TASK_KEY_CHARS, TASK_LABEL_CHARS, truncate_text
from gpupool._core.units import parse_pool_size
from gpupool._errors import ConfigurationError
from gpupool._pool.features import call_features
from gpupool._pool.inbox import (
    Inbox,
    WorkItem,
    callable_name,
    copy_broken,
    interpreter_exiting,
)
from gpupool._pool.worker import process_chunk
from gpupool._sensors.own_pid import own_pid

# The machinery of a pool (its dispatcher, planner, policy, census and reaper, with
# psutil) is imported as the first pool is made, not with this module: a spawn worker
# imports the user's script, and with it this class, and makes no pool (the performance
# page, "A script's cold start").
if TYPE_CHECKING:
    from gpupool._core.census import Census
    from gpupool._core.events import Decision
    from gpupool._core.policy import Ask
    from gpupool._sensors.base import Sensor

__all__ = ["GpuPoolExecutor", "PoolStatistics", "SizeOf", "TaskOptions"]

#: ``size=`` as a callable: applied to a call's arguments at submit, in the caller's process,
#: it returns the call's input size (a positive, finite number), or ``None`` for none.
SizeOf = Callable[..., object]

#: How long running tasks get to exit on SIGTERM after Ctrl-C leaves a ``with`` block
#: (``on_interrupt="terminate"``) before their workers get SIGKILL: time for a task's
#: own SIGTERM handler, short enough that the terminal answers the key at once.
INTERRUPT_GRACE_S = 2.0

#: The submitted function's parameters and result: futures keep the function's types.
_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskOptions:
    """Per-call options: a task key, a peak hint and an input size (see
    :meth:`GpuPoolExecutor.options`).

    Attributes:
        key: tasks with the same key share one learned ask; by default the
            key is the function's module and qualified name.
        task_peak: an estimate of this key's device peak, used until a child
            of the key reports a measurement.
        size: the size of the task's input, in a unit of the caller's (tokens,
            rows, bytes), the same for every task of the key: its ask is
            predicted from the key's measurements at their sizes. Or a callable
            (``len``) that gives each call's size from its arguments at submit.
        timeout_s: the task's deadline, in seconds from when its worker starts
            it; past it the task's process tree is ended and its future fails
            with :class:`~gpupool.TaskTimeoutError`.
        label: a name for the task, on every record about it and in
            ``gpupool postmortem`` and ``gpupool plot``.
    """

    key: str | None = None
    task_peak: str | int | None = None
    size: float | SizeOf | None = None
    timeout_s: float | None = None
    label: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolStatistics:
    """An immutable summary of a pool's run so far, as a snapshot.

    The pool's dispatcher thread, which alone changes the pool's scheduling
    state, copies these figures into a snapshot at the end of each of its
    turns, before it makes a future RUNNING or done, and once more after
    shutdown; ``statistics()`` and ``width`` read the latest, so they are safe
    to call from any thread, and a future seen done is already counted. Only
    ``tasks_submitted`` is counted at submit, by the submitting thread, so
    the tasks ended never outnumber it; after ``shutdown(wait=True)`` the
    completed, failed and cancelled tasks add up to it.

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
        width: how many tasks the planner admits at once now, over every
            card, for the work it holds (with mixed keys: priced at each
            pending and running task's own ask).
        widths: ``(time_s, width)`` at each decision that changed the width.
        asks: every task key submitted so far: its current ask, with its basis
            (``estimated`` until a task of the key is measured).
        widths_by_key: for each key with work pending or running, how many
            of its tasks could run at once beside the other keys' running tasks
            (each at the key's own ask, not at a size given with ``options``).
        serial_starts: starts past the bound (the serial floor).
        log_write_errors: decision records the log file could not take (a full
            disk, a file-size limit); they are still in the pool's ``decisions``.
        bookings_skipped: steps the host's booking table was passed over (its
            lock held by another process past the wait, or a failed read or
            write): the pool priced its cards by live readings alone then; and
            steps that passed part of a shared table over (another user's file
            refused, or left for the step's read budget, or entries past the
            directory scan).
        bookings_unavailable: why the host's booking table cannot be used
            (the pool then no longer sees other pools' bookings), or ``None``.
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
    widths_by_key: Mapping[str, int] = field(default_factory=dict)
    serial_starts: int = 0
    log_write_errors: int = 0
    bookings_skipped: int = 0
    bookings_unavailable: str | None = None


_NO_OPTIONS = TaskOptions()


def _request_shutdown_here(inbox: Inbox, pid: int) -> None:
    """A pool dropped, or at the interpreter's exit: its dispatcher stops once its work is
    done. Not from a forked copy of the process (``pid`` made the pool): the copy's inbox
    is the parent's lock and wake pipe, copied."""
    if own_pid() == pid:
        inbox.request_shutdown()


def _check_label(label: object) -> str | None:
    """A task's label: ``None``, or a non-empty str of at most ``TASK_LABEL_CHARS`` characters
    without control characters (a label is printed on one line of a report)."""
    if label is None:
        return None
    fix = "pass a short name such as label='resnet-ckpt-7', or leave label out"
    if not isinstance(label, str):
        raise ConfigurationError(f"label={label!r}: a task's label is a str; {fix}.")
    if not label or len(label) > TASK_LABEL_CHARS:
        raise ConfigurationError(
            f"label={truncate_text(label, 40)!r} has {len(label)} characters: a task's label "
            f"has 1 to {TASK_LABEL_CHARS}; {fix}."
        )
    if any(not ch.isprintable() for ch in label):
        raise ConfigurationError(
            f"label={truncate_text(label, 40)!r} holds a control character (a newline, a "
            f"tab...): a label is printed on one line; {fix}."
        )
    return label


#: What ``size=`` must be, in every message that refuses one.
_SIZE_RULE = (
    "a task's input size must be a positive, finite number (tokens, rows, bytes: one unit "
    "for every task of the key)"
)


def check_size(size: object, *, callable_ok: bool = True) -> float | SizeOf | None:
    """``size=``: ``None``, a positive, finite number (read as a float), or (where
    ``callable_ok``) a callable of each call's arguments (:func:`size_of_calls`).

    Raises:
        ConfigurationError: it is none of those.
    """
    if size is None:
        return None
    if callable(size) and not isinstance(size, numbers.Real):
        if not callable_ok:
            raise ConfigurationError(
                f"size={size!r}: this executor takes a task's input size as a number; give "
                "each call its own (options(size=len(entry)).submit(fn, entry))."
            )
        return size
    # Any real number (numpy's included) is a size, read as a float; one too large for a
    # float is refused as any other bad size is.
    value = _real(size)
    if not math.isfinite(value) or value <= 0:
        calls = " or a callable that gives it from a call's arguments (size=len)"
        raise ConfigurationError(f"size={size!r}: {_SIZE_RULE}{calls if callable_ok else ''}.")
    return value


def size_of_calls(
    size_of: SizeOf,
    calls: Iterable[tuple[tuple[Any, ...], Mapping[str, Any]]],
    entry: int | None = None,
) -> float | None:
    """``size_of`` applied to each call's arguments (a ``map`` chunk's calls run one after
    another in one task: its size is their largest); ``None`` where it returns ``None`` for
    every one (the task is priced as an untold one).

    Raises:
        ConfigurationError: it raised (the error is the cause) or returned anything but
            ``None`` or a positive, finite number, for one of the calls.
    """
    name = getattr(size_of, "__qualname__", None) or repr(size_of)
    found: float | None = None
    for offset, (args, kwargs) in enumerate(calls):
        where = "" if entry is None else f" (map entry {entry + offset})"
        try:
            value = size_of(*args, **kwargs)
        except Exception as exc:
            raise ConfigurationError(
                f"size={name} raised {type(exc).__name__}: {truncate_text(str(exc), 200)} "
                f"for this call{where}; the task was not submitted. A size callable runs at "
                "submit in this process with the call's arguments: make it accept them and "
                "return a positive number, or None for a call it cannot size."
            ) from exc
        if value is None:
            continue
        number = _real(value)
        if not math.isfinite(number) or number <= 0:
            raise ConfigurationError(
                f"size={name} returned {truncate_text(repr(value), 80)} for this call"
                f"{where}; the task was not submitted. {_SIZE_RULE[0].upper()}{_SIZE_RULE[1:]}; "
                "return None for a call with no size, which is then priced by its key's "
                "measurements."
            )
        found = number if found is None else max(found, number)
    return found


def task_options(
    *,
    key: str | None,
    task_peak: str | int | None,
    size: object,
    label: str | None = None,
    timeout_s: float | None = None,
    size_callable: bool = False,
) -> tuple[TaskOptions, int | None]:
    """Per-call options checked once, with ``task_peak`` in bytes (see
    :meth:`GpuPoolExecutor.options`; ``gpupool.ray`` checks its own the same way, where
    ``size`` is a number: ``size_callable`` lets it be a callable of each call's arguments).

    Raises:
        ConfigurationError: ``task_peak`` is not a positive size, ``key`` is not a
            non-empty str of at most 1000 characters, ``size`` is not a positive, finite
            number (or a callable where that is allowed), ``timeout_s`` is not a positive,
            finite number of seconds, or ``label`` is not a non-empty str of at most 200
            characters without control characters.
    """
    hint_bytes = (
        None
        if task_peak is None
        else parse_pool_size(task_peak, name="task_peak", allow_zero=False)
    )
    if key is not None and (not isinstance(key, str) or not key):
        raise ConfigurationError(
            f"key={key!r}: a task key must be a non-empty str (tasks of one key share "
            "one learned ask); pass a name such as 'embed', or leave key out for the "
            "function's own name."
        )
    if key is not None and len(key) > TASK_KEY_CHARS:
        raise ConfigurationError(
            f"key={truncate_text(key, 40)!r} has {len(key)} characters: a task key is a name "
            f"of at most {TASK_KEY_CHARS} (it is on every record about its tasks); pass a "
            "short name such as 'embed', or a digest of what tells the tasks apart."
        )
    value = check_size(size, callable_ok=size_callable)
    options = TaskOptions(
        key=key,
        task_peak=task_peak,
        size=value,
        timeout_s=_check_timeout_s(timeout_s),
        label=_check_label(label),
    )
    return options, hint_bytes


class _Submitter(Protocol):
    """What an options view submits through (``GpuPoolExecutor``, ``gpupool.ray``'s executor)."""

    def _submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        view: _OptionsView | None,
        key: str | None = None,
    ) -> Future[Any]: ...

    def _map(
        self,
        fn: Callable[..., Any],
        iterables: Sequence[Iterable[Any]],
        timeout: float | None,
        chunksize: int,
        buffersize: int | None,
        view: _OptionsView | None,
    ) -> Iterator[Any]: ...


class _OptionsView:
    """``submit`` and ``map`` with per-call options; see :meth:`GpuPoolExecutor.options`."""

    def __init__(
        self,
        executor: _Submitter,
        options: TaskOptions,
        hint_bytes: int | None,
        *,
        size_callable: bool = False,
    ) -> None:
        self._executor = executor
        self._options = options
        # ``options.task_peak`` in bytes, parsed once (by ``options()``), not at each submit.
        self._hint_bytes = hint_bytes
        # Whether the executor takes ``size=`` as a callable of each call's arguments.
        self._size_callable = size_callable

    def submit(self, fn: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_R]:
        """As :meth:`GpuPoolExecutor.submit`, with this view's key and peak hint."""
        return self._executor._submit(fn, args, kwargs, self)

    def map(
        self,
        fn: Callable[..., _R],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        buffersize: int | None = None,
        size: float | SizeOf | None = None,
    ) -> Iterator[_R]:
        """As :meth:`GpuPoolExecutor.map`, with this view's key and peak hint (and its size,
        unless ``size`` is given here).

        Raises:
            ConfigurationError: ``size`` is not a positive, finite number (or a callable,
                where the executor takes one).
        """
        view = self
        if size is not None:
            checked = check_size(size, callable_ok=self._size_callable)
            view = _OptionsView(
                self._executor,
                dataclasses.replace(self._options, size=checked),
                self._hint_bytes,
                size_callable=self._size_callable,
            )
        return self._executor._map(fn, iterables, timeout, chunksize, buffersize, view)


class GpuPoolExecutor(concurrent.futures.Executor):
    """A process pool that runs as many tasks at once as the cards' memory holds.

    A drop-in for ``concurrent.futures.ProcessPoolExecutor``: the same
    positional parameters, ``submit``, ``map``, ``shutdown``, futures that work
    with ``concurrent.futures.wait`` and ``concurrent.futures.as_completed``,
    and exceptions re-raised with the child's traceback as their cause.
    Workers import the script as ``__mp_main__``, as spawn workers do (its
    top level runs in each, its functions and classes are theirs); lambdas,
    closures and what a worker cannot import travel by value (cloudpickle).

    Args:
        max_workers: a ceiling on the width, never a promise; default: the
            usable CPUs. An explicit value is not capped by the CPU count (as
            in the standard pool); the construction record notes it. At most
            4096.
        mp_context: ``None`` or a spawn context: workers always start as
            fresh interpreters (spawn), each with its card pinned in its
            environment. A ``fork`` context (CUDA does not survive
            ``fork``), a ``forkserver`` context and anything that is not a
            context are refused with a :class:`ConfigurationError`.
        initializer: called in each worker before its first task.
        initargs: arguments for ``initializer``.
        max_tasks_per_child: a worker exits after this many tasks and is
            replaced when needed.
        task_peak: the estimated device peak of one task (``"6GiB"``). Used
            until children report measurements. ``None``: the first task of
            each key runs alone until measured.
        reserve: bytes kept free on every card (default 256 MiB).
        margin: least margin over a measured peak. Left out together with
            ``margin_fraction``, the margin is learned from how much each key's
            measurements vary (from ``max(256 MiB, 10 %)`` with one sample
            toward a 64 MiB floor as they agree); given, every measured ask is
            the worst peak plus ``max(margin, margin_fraction * peak)``.
        margin_fraction: margin as a fraction of the measured peak, when larger
            (default 0.10 when only ``margin`` is given).
        devices: device indexes or UUIDs the pool may use (default: all that
            ``CUDA_VISIBLE_DEVICES`` leaves visible).
        width: fixed-width mode: run exactly this many at once, whatever the
            bound says (logged when it exceeds the bound).
        strict: refuse to let memory narrow the pool below ``max_workers``:
            raise :class:`~gpupool.WidthError` at construction, and break the
            pool with it if a later measurement, out-of-memory or reading would
            narrow: tasks not yet started fail with it, running ones finish
            and deliver. The host-RAM term of the ceiling still applies; the
            CPU count does not cap an explicit ``max_workers``.
        retry_oom: retry a task that ran out of device memory at a narrower
            width (default); it reaches its future only when it ran alone on
            its card with its ask's room free, when ``max_retries`` is
            reached, or when others held its card for ``room_wait_s``.
        max_retries: out-of-memory retries per task, in every mode (default
            ``GPUPOOL_MAX_RETRIES``, else 5); the error names the cap when it
            is reached.
        room_wait_s: how long a task that ran out of memory alone waits for
            room while bytes that are not the pool's hold its card (default
            ``GPUPOOL_ROOM_WAIT_S``, else 120 s); then its error goes to its
            future.
        log_path: append every decision to this JSON Lines file.
        env: extra environment variables for every worker.
        sensor: where readings come from (default: NVML, or the simulator
            inside a ``gpupool.testing.SimulatedHost``).
        progress: show a progress bar (tqdm, when installed) with the width
            and the asks while ``map`` results are consumed: ``None`` when
            standard error is a terminal or in a Jupyter kernel (see
            :func:`gpupool.track`), ``True`` always, ``False`` never.
        cap_allocator: cap each worker's PyTorch caching allocator at the
            booked ask of the task it runs less what the worker holds outside
            torch's allocator (its CUDA context, measured from its device row
            or estimated where it has none, and CuPy's and JAX's pools)
            (``torch.cuda.set_per_process_memory_fraction``, set when the task
            initialises CUDA, re-set when either changes), so a torch task
            that overruns its price fails inside itself. It binds torch's
            allocator only: what other libraries allocate during the task is
            not capped. Workers import torch when it is installed. Default
            ``False``.
        share_bookings: publish this pool's bookings to the host-wide booking
            table and read the other pools' (see ``docs/sharing.md``): ``True``
            (default) among this user's pools (files 0600), ``"host"`` among
            every user's, ``False`` not at all.
        bookings_dir: the directory of the booking table (default: the
            ``GPUPOOL_BOOKINGS`` environment variable, else
            ``/dev/shm/gpupool-<uid>``; inside a ``SimulatedHost``, the
            simulated host's own). Ignored when ``share_bookings=False``.
        on_interrupt: what leaving a ``with`` block by ``KeyboardInterrupt``
            (Ctrl-C) does: ``"terminate"`` (default) cancels the tasks not
            started, sends SIGTERM to the running tasks' workers and their
            processes, and SIGKILL to what is left after 2 s; ``"wait"`` waits for every task, as
            the standard pool does. With ``"terminate"``, SIGTERM to this
            process (what Slurm and Kubernetes send first) is handled as Ctrl-C
            is: it raises ``KeyboardInterrupt`` in the main thread, where
            SIGTERM had no handler of the program's own and the pool was made
            in the main thread; a program that exits on it stops its pools'
            tasks, ``with`` block or not. ``"wait"`` leaves SIGTERM alone (the
            process dies at once, and its workers end their tasks' processes
            as they do whenever the pool's process dies).

    Arguments left out are read from ``GPUPOOL_*`` environment variables
    where one is set (see ``docs/configuration.md``); ``LOKY_MAX_CPU_COUNT``
    caps the CPUs counted, as in loky.

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
        max_retries: int | None = None,
        room_wait_s: float | None = None,
        log_path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        sensor: Sensor | None = None,
        progress: bool | None = None,
        cap_allocator: bool = False,
        share_bookings: bool | str = True,
        bookings_dir: str | os.PathLike[str] | None = None,
        on_interrupt: Literal["terminate", "wait"] | None = None,
    ) -> None:
        # Every parameter as given, by name (nothing else is local yet).
        given = {k: v for k, v in locals().items() if k != "self"}
        try:
            from gpupool._pool.options import build_dispatcher, read_options
            from gpupool._pool.sigterm import watch_sigterm
        except RuntimeError as exc:
            if not interpreter_exiting():
                raise  # a RecursionError, a library's own: not the interpreter's exit
            # The first pool's modules import CPython's pool module, which registers an exit
            # hook that threading refuses once the interpreter exits (an ``atexit`` function).
            raise RuntimeError(
                "cannot schedule new futures after interpreter shutdown: this process's "
                "first pool was made as the interpreter exits"
            ) from exc

        options = read_options(os.environ, **given)
        self._progress = options.progress
        self._on_interrupt = options.on_interrupt
        self._mp_context = options.workers.mp_context
        self._task_timeout_s = options.task_timeout_s
        self._shutdown_lock = threading.Lock()
        self._shutdown = False
        self._dispatcher, self._census, self._max_workers = build_dispatcher(options)
        # The process that made the pool: a forked copy of it (``os.fork()`` beside an open
        # pool) holds the pool's objects but none of its threads or workers.
        self._owner_pid = own_pid()
        weakref.finalize(self, _request_shutdown_here, self._dispatcher.inbox, self._owner_pid)
        if self._on_interrupt == "terminate":
            watch_sigterm(self)

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self._in_a_fork():
            return  # a forked child leaving the block: the pool is its parent's
        if (
            isinstance(exc_type, type)
            and issubclass(exc_type, KeyboardInterrupt)
            and self._on_interrupt == "terminate"
        ):
            self._stop_on_interrupt()
            return
        try:
            self.shutdown(wait=True)
        except KeyboardInterrupt:  # Ctrl-C while the block's end waits: it leaves the block
            if self._on_interrupt == "terminate":
                self._stop_on_interrupt()
            raise

    def _stop_on_interrupt(self) -> None:
        """Ctrl-C left the ``with`` block: SIGTERM now, SIGKILL after the grace, then wait.

        What the tasks started is listed before SIGTERM: a worker that SIGTERM ends
        is reaped and forgotten at once, and a child of its task that ignores
        SIGTERM would be out of the pool's reach at the grace's end.
        """
        from gpupool._pool.reaper import kill_left_after, trees_below

        deadline = time.monotonic() + INTERRUPT_GRACE_S
        below = trees_below(self._processes)
        self.terminate_workers()
        finished = False
        try:
            finished = self._dispatcher.public.join(INTERRUPT_GRACE_S)
            kill_left_after(below, deadline)
        finally:  # a second Ctrl-C during the grace kills at once
            if not finished:
                self.kill_workers()
            kill_left_after(below, 0.0)
            self._dispatcher.public.join()

    # -- CPython compatibility attributes ------------------------------------------------

    @property
    def _processes(self) -> dict[int, Any]:
        # A copy (one step under the interpreter lock): the dispatcher thread changes its own.
        return dict(self._dispatcher.workers.processes)

    @property
    def _broken(self) -> str | bool:
        return self._dispatcher.inbox.broken or False

    # -- the executor contract ----------------------------------------------------------

    def submit(self, fn: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_R]:
        """Schedule ``fn(*args, **kwargs)``; returns a ``concurrent.futures.Future``.

        Raises:
            InitializerError: the pool is broken: an initializer raised or killed
                its worker (a ``BrokenProcessPool``).
            WidthError: the pool is broken: ``strict=True`` refused to narrow.
            RuntimeError: the pool was shut down, or this process is a fork of the one
                that made it.
        """
        return self._submit(fn, args, kwargs, None)

    def options(
        self,
        *,
        key: str | None = None,
        task_peak: str | int | None = None,
        size: float | None = None,
        timeout_s: float | None = None,
        label: str | None = None,
    ) -> _OptionsView:
        """``submit``/``map`` with a task key, a peak hint, an input size, a deadline and a label,
        keeping CPython's signatures.

        ::

            big = ex.options(key="big-model", task_peak="12GiB")
            future = big.submit(compile_entry, entry)
            sized = ex.options(key="compile", size=len(entry.tokens))
            future = sized.submit(compile_entry, entry)

        Args:
            key: tasks with the same key share one learned ask; a name of at most 1000
                characters.
            task_peak: this key's estimated peak until a child measures it.
            size: the size of this task's input (tokens, rows, bytes: one unit for every
                task of the key). Once tasks of the key were measured at their sizes, the
                task's ask is predicted from them, so small inputs are not priced at the
                largest one's peak and an input larger than any before is priced above
                them. Or a callable (``len``, ``lambda batch, model: batch.nbytes``)
                applied to each call's arguments at submit, in this process: it returns
                the call's size, or ``None`` for a call it cannot size (priced as one not
                told). Where it raises or returns anything else, that task's future fails
                with a :class:`~gpupool.ConfigurationError` (the callable's error its
                cause) and is never sent; the other tasks run.
            timeout_s: the task's deadline in seconds, counted from when its worker
                starts it (time queued in the pool does not count); default
                ``GPUPOOL_TASK_TIMEOUT_S``, else none. Past it, the task's worker and
                every process the task started get SIGTERM, then SIGKILL after 2 s; the
                future fails with :class:`~gpupool.TaskTimeoutError`, a
                ``task_timeout`` record says so, the worker is replaced and the pool
                goes on.
            label: a name for the task (a checkpoint, a file), at most 200 characters
                with no control characters. Every record about the task names it beside
                its ``map`` position, and so do ``gpupool postmortem`` and ``gpupool
                plot`` ("entry 25, label 'resnet-ckpt-7'").

        Raises:
            ConfigurationError: ``task_peak`` is not a positive size, ``key`` is not a
                non-empty str of at most 1000 characters, ``size`` is not a callable nor a
                positive, finite number, ``timeout_s`` is not a positive, finite number of
                seconds, or ``label`` is not a non-empty str of at most 200 characters
                without control characters.
        """
        options, hint_bytes = task_options(
            key=key,
            task_peak=task_peak,
            size=size,
            label=label,
            timeout_s=timeout_s,
            size_callable=True,
        )
        return _OptionsView(self, options, hint_bytes, size_callable=True)

    def _submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        view: _OptionsView | None,
        key: str | None = None,
        entry: int | None = None,
        entries: int = 1,
        chunk: Sequence[tuple[Any, ...]] | None = None,
    ) -> Future[Any]:
        if self._in_a_fork():
            raise RuntimeError(
                f"this pool was made by process {self._owner_pid}, and this process "
                f"({os.getpid()}) is a fork of it: it has none of the pool's threads or "
                "workers. Make a pool in the child, or submit from the parent."
            )
        inbox = self._dispatcher.inbox
        options = view._options if view is not None else _NO_OPTIONS
        # Run outside the lock, as the features are read: a size callable and an argument's
        # nbytes are a stranger's code. A size callable that fails fails this task alone.
        size, refused = options.size, None
        if callable(size):
            calls = [(args, kwargs)] if chunk is None else [(call, {}) for call in chunk]
            try:
                size = size_of_calls(size, calls, entry)
            except ConfigurationError as exc:
                size, refused = None, exc
        features = () if size is not None else call_features(args, kwargs)
        with self._shutdown_lock:
            if inbox.broken is not None:
                raise copy_broken(inbox.broken_exc, inbox.broken)
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if interpreter_exiting():
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            future: Future[Any] = Future()
            if refused is not None:
                # Never sent: its future fails now, and no other task is touched.
                future.set_exception(refused)
                return future
            hint = view._hint_bytes if view is not None else None
            key = options.key or key or callable_name(fn)
            # Pickled when it is sent to a worker: waiting work costs no pickled copy.
            item = WorkItem(future, (fn, args, kwargs), key, hint, size)
            item.timeout_s = options.timeout_s or self._task_timeout_s
            item.features = features
            item.entry, item.entries, item.label = entry, entries, options.label
            inbox.put(item)
            return future

    def map(
        self,
        fn: Callable[..., _R],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        buffersize: int | None = None,
        size: float | SizeOf | None = None,
    ) -> Iterator[_R]:
        """Like :func:`map`, running ``fn`` in the pool; results come back in input order.

        ::

            for out in ex.map(embed, batches, size=len):  # each task priced for its batch
                save(out)

        Args:
            *iterables: the arguments of ``fn``.
            timeout: seconds from this call after which a result not yet
                ready raises :class:`concurrent.futures.TimeoutError`; ``None``
                (or ``math.inf``) waits without a limit.
            chunksize: items per task; larger chunks cut per-task overhead.
            buffersize: at most this many tasks are submitted ahead of the
                results consumed (Python 3.14's parameter, on every version).
            size: each task's input size, as with :meth:`options`: a callable (``len``)
                is applied to each call's arguments at submit, in this process (a chunk
                of ``chunksize`` calls is sized by its largest). Where it raises, or
                returns anything but a positive, finite number or ``None``, that task's
                result raises a :class:`~gpupool.ConfigurationError` naming the entry,
                with the callable's error as its cause; the other tasks run.

        Raises:
            ValueError: ``chunksize < 1``, ``buffersize < 1``, or ``timeout`` is NaN.
            TypeError: ``buffersize`` is not an integer (as on CPython 3.14), nor
                ``chunksize``; ``timeout`` is not a number.
            ConfigurationError: ``size`` is not a callable nor a positive, finite number.

        An error an iterable raises reaches the caller from this call, or, with
        ``buffersize``, as the results are consumed; the tasks submitted before it that
        have not started are cancelled then.
        """
        view = None
        if size is not None:
            view = _OptionsView(self, TaskOptions(size=check_size(size)), None, size_callable=True)
        return self._map(fn, iterables, timeout, chunksize, buffersize, view)

    def _track(self, results: Iterator[Any], iterables: Sequence[Iterable[Any]]) -> Iterator[Any]:
        if self._progress is False:
            return results
        from gpupool._observe.progress import track

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
        view: _OptionsView | None,
    ) -> Iterator[Any]:
        key = callable_name(fn)

        def submit(
            call: Callable[..., Any], args: tuple[Any, ...], entry: int, entries: int
        ) -> Future[Any]:
            # A chunk's one argument is its calls' arguments (a size callable sizes each).
            chunk = args[0] if call is not fn else None
            return self._submit(call, args, {}, view, key, entry, entries, chunk)

        results = map_calls(submit, fn, iterables, timeout, chunksize, buffersize)
        return self._track(results, iterables)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; by default wait for what was submitted to finish.

        Args:
            wait: block until every running and pending task has finished and
                the workers have exited.
            cancel_futures: cancel every task that has not started yet.
        """
        if self._in_a_fork():
            return  # nothing of the pool runs here; the parent's goes on
        with self._shutdown_lock:
            self._shutdown = True
        self._dispatcher.inbox.request_shutdown(cancel_futures)
        if wait:
            self._dispatcher.public.join()

    def _in_a_fork(self) -> bool:
        """Whether this process is a fork of the one that made the pool (``os.fork()``
        beside an open pool): the pool's dispatcher and workers are the parent's, so here
        ``shutdown`` and the ``with`` block's end return at once, and ``submit`` raises."""
        return own_pid() != self._owner_pid

    def terminate_workers(self) -> None:
        """Shut down without waiting, cancel what has not started, and SIGTERM the workers.

        A task whose future is RUNNING fails with :class:`~gpupool.WorkerLostError` (a
        ``BrokenProcessPool``, as in the standard pool) naming this call and its signal,
        whether its worker was running it or was still starting for it.
        """
        self._force(signal.SIGTERM)

    def kill_workers(self) -> None:
        """Shut down without waiting, cancel what has not started, and SIGKILL the workers.

        A task whose future is RUNNING fails with :class:`~gpupool.WorkerLostError` (a
        ``BrokenProcessPool``, as in the standard pool) naming this call and its signal,
        whether its worker was running it or was still starting for it.
        """
        self._force(signal.SIGKILL)

    def _force(self, sig: signal.Signals) -> None:
        if self._in_a_fork():
            return  # the workers are the parent's pool's: not this copy's to signal
        with self._shutdown_lock:
            self._shutdown = True
        self._dispatcher.inbox.request_kill(sig)

    # -- what the pool decided ----------------------------------------------------------

    @property
    def width(self) -> int:
        """How many tasks the planner admits at once, over every card, for the work it holds,
        as of the dispatcher's last snapshot (see :meth:`statistics`)."""
        return self._dispatcher.public.snapshot.width

    @property
    def census(self) -> Census:
        """The census taken at construction."""
        return self._census

    @property
    def decisions(self) -> tuple[Decision, ...]:
        """Every decision so far, oldest first."""
        return self._dispatcher.log.records()

    def statistics(self) -> PoolStatistics:
        """An immutable summary of the run so far, safe to call from any thread.

        Every figure but ``tasks_submitted`` comes from one snapshot that the
        dispatcher thread publishes at the end of each of its turns, before it
        makes a future RUNNING or done, and once more after shutdown: a task
        whose future is done is counted, and nothing here reads the
        scheduler's live state. ``tasks_submitted`` is counted at submit, so
        the ended tasks never outnumber it.
        """
        d = self._dispatcher
        snapshot = d.public.snapshot
        # After the snapshot: every task it counts as ended was submitted before it.
        submitted = d.inbox.submitted
        counts = snapshot.counts
        return PoolStatistics(
            tasks_submitted=submitted,
            tasks_completed=counts.get("completed", 0),
            tasks_failed=counts.get("failed", 0),
            tasks_cancelled=counts.get("cancelled", 0),
            retries=counts.get("retries", 0),
            out_of_memory=counts.get("oom", 0),
            workers_started=counts.get("workers_started", 0),
            workers_lost=counts.get("lost", 0),
            live_gate_waits=counts.get("gate_waits", 0),
            width=snapshot.width,
            widths=snapshot.widths,
            asks=snapshot.asks,
            widths_by_key=snapshot.widths_by_key,
            serial_starts=counts.get("serial_starts", 0),
            # Read live: the log's last check, at close, comes after the last snapshot.
            log_write_errors=max(snapshot.log_write_errors, d.log.write_errors),
            bookings_skipped=counts.get("bookings_skipped", 0),
            bookings_unavailable=snapshot.bookings_unavailable,
        )


def _check_timeout_s(value: object) -> float | None:
    """``options(timeout_s=)``: ``None``, or a positive, finite number of seconds."""
    if value is None:
        return None
    seconds = _real(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(
            f"timeout_s={value!r}: a task's deadline must be a positive, finite number of "
            "seconds (such as 600), or None for no deadline."
        )
    return seconds


def map_calls(
    submit: Callable[[Callable[..., Any], tuple[Any, ...], int, int], Future[Any]],
    fn: Callable[..., Any],
    iterables: Sequence[Iterable[Any]],
    timeout: float | None,
    chunksize: int,
    buffersize: int | None,
) -> Iterator[Any]:
    """``Executor.map``'s body for an executor that submits through ``submit(fn, args,
    entry, entries)``: the arguments checked as CPython checks them, each call (or chunk of
    ``chunksize`` calls) submitted with its map position, at most ``buffersize`` ahead of the
    results, which come back in input order."""
    try:
        chunksize = operator.index(chunksize)  # an int, numpy's too
    except TypeError:
        raise TypeError(
            f"chunksize={chunksize!r}: pass a whole number of calls per task, 1 or more."
        ) from None
    if chunksize < 1:
        raise ValueError("chunksize must be >= 1.")
    if buffersize is not None:
        # As CPython 3.14 checks it: the wrong type is a TypeError, a bad value a ValueError.
        if not isinstance(buffersize, int):
            raise TypeError("buffersize must be an integer or None")
        if buffersize < 1:
            raise ValueError("buffersize must be None or >= 1.")
    end_time = None if timeout is None else _deadline(timeout)
    args_iter = zip(*iterables, strict=False)
    calls: Iterator[Future[Any]]
    # Each task knows its map position (a chunk: its first and how many).
    if chunksize == 1:
        calls = (submit(fn, args, entry, 1) for entry, args in enumerate(args_iter))
    else:
        chunk_fn = partial(process_chunk, fn)
        calls = (
            submit(chunk_fn, (list(chunk),), n * chunksize, len(chunk))
            for n, chunk in enumerate(_batched(args_iter, chunksize))
        )
    futures: collections.deque[Future[Any]] = collections.deque()
    try:
        futures.extend(calls if buffersize is None else itertools.islice(calls, buffersize))
    except BaseException:
        # An iterable raised (or a submit did): the caller holds none of these futures, so
        # what has not started is cancelled, as when a consumer of the results stops early.
        for future in futures:
            future.cancel()
        raise
    return _results(futures, calls if buffersize is not None else None, end_time, chunksize > 1)


def _deadline(timeout: object) -> float | None:
    """``map``'s ``timeout`` as a deadline on the monotonic clock, checked before any task is
    submitted; one no wait can hold (``math.inf``) is no deadline, as ``None`` is."""
    fix = (
        f"timeout={timeout!r}: pass a number of seconds after which a result not yet ready "
        "raises TimeoutError, or None to wait without a limit."
    )
    if not isinstance(timeout, numbers.Real) or isinstance(timeout, bool):
        raise TypeError(fix)
    try:
        seconds = float(timeout)
    except OverflowError:  # an int past any float: past any wait too
        return None
    if math.isnan(seconds):
        raise ValueError(fix)
    if seconds >= threading.TIMEOUT_MAX:
        return None
    return seconds + time.monotonic()


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


def _real(value: object) -> float:
    """``value`` as a float where it is a real number (numpy's included, and the one number
    of a 0-d array or tensor, as ``batch.sum()`` gives; never a bool), else NaN: a number
    too large for a float is NaN too, and refused as any other bad value is."""
    try:  # a stranger's object: its ndim may raise, or be an array with no one truth value
        if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
            value = value.item()  # type: ignore[attr-defined]
    except Exception:
        return math.nan
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except (ValueError, OverflowError):
            pass
    return math.nan
