"""GpuPoolExecutor: the drop-in ``concurrent.futures`` pool that prices K children against the card.

The public class and its per-call options live here; the scheduling state
and the thread that owns it are in :mod:`gpupool._pool.dispatcher`, whose
docstring draws the data flow.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar

from gpupool._core.census import Census
from gpupool._core.events import Decision
from gpupool._core.planner import PlannerConfig
from gpupool._core.policy import (
    DEFAULT_MARGIN_BYTES,
    DEFAULT_MARGIN_FRACTION,
    DEFAULT_RESERVE_BYTES,
    Ask,
    AskTable,
    Policy,
)
from gpupool._core.units import GiB, format_size, parse_pool_size
from gpupool._errors import (
    ConfigurationError,
    WidthError,
)
from gpupool._log import DecisionLog, check_log_path
from gpupool._pool.dispatcher import (
    DeviceState,
    Dispatcher,
    WorkItem,
    callable_name,
    interpreter_exiting,
)
from gpupool._pool.environ import read_pool_defaults
from gpupool._pool.inbox import copy_broken
from gpupool._pool.inputs import check_python_home, check_sensor
from gpupool._pool.reaper import kill_left_after, trees_below
from gpupool._pool.worker import process_chunk
from gpupool._probe import ALLOCATOR_CAP_NOTE
from gpupool._sensors.select import SIMULATOR_ENV, default_sensor

if TYPE_CHECKING:
    from gpupool._sensors.base import Sensor

__all__ = ["GpuPoolExecutor", "PoolStatistics", "TaskOptions"]

#: How long running tasks get to exit on SIGTERM after Ctrl-C leaves a ``with`` block
#: (``on_interrupt="terminate"``) before their workers get SIGKILL: time for a task's
#: own SIGTERM handler, short enough that the terminal answers the key at once.
INTERRUPT_GRACE_S = 2.0

#: The submitted function's parameters and result: futures keep the function's types.
_P = ParamSpec("_P")
_R = TypeVar("_R")

#: Estimate used when no ``task_peak`` is given and no card is readable.
_UNKNOWN_ESTIMATE_BYTES = GiB


def _check_flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(
            f"{name}={value!r}: pass True or False (a string such as 'no' would count as True)."
        )
    return value


def _check_env(env: object) -> dict[str, str]:
    """The ``env=`` mapping, refused unless every key and value can reach a worker as given."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ConfigurationError(
            f"env={env!r}: pass a mapping of variable names to values, such as "
            "{'OMP_NUM_THREADS': '1'}."
        )
    checked: dict[str, str] = {}
    for key, value in env.items():
        if not isinstance(key, str) or not key:
            raise ConfigurationError(f"env: the key {key!r} is not a non-empty str.")
        if "=" in key or "\0" in key:
            raise ConfigurationError(
                f"env: the key {key!r} holds {'=' if '=' in key else 'a NUL byte'}, which no "
                "environment variable name can; the child would see another variable."
            )
        if not isinstance(value, str):
            raise ConfigurationError(
                f"env[{key!r}]={value!r}: values must be str (None would reach the worker as "
                f"'None'); pass str(value), or leave {key!r} out."
            )
        if "\0" in value:
            raise ConfigurationError(
                f"env[{key!r}]={value!r} holds a NUL byte, which no environment value can."
            )
        checked[key] = value
    return checked


def _check_devices(devices: object) -> list[int | str] | None:
    """The ``devices=`` selection: a sequence of indexes and UUIDs, never a bare one."""
    if devices is None:
        return None
    if isinstance(devices, (str, bytes, int)):
        raise ConfigurationError(
            f"devices={devices!r}: pass a list of device indexes or UUIDs, such as "
            f"devices=[{devices!r}]."
        )
    if not isinstance(devices, Sequence):
        raise ConfigurationError(
            f"devices={devices!r}: pass a list of device indexes or UUIDs, such as devices=[0, 1]."
        )
    checked: list[int | str] = []
    for entry in devices:
        if isinstance(entry, bool) or not isinstance(entry, (int, str)):
            raise ConfigurationError(
                f"devices entry {entry!r}: each entry is a device index (int) or UUID (str)."
            )
        if isinstance(entry, int) and entry < 0:
            raise ConfigurationError(f"devices entry {entry!r}: an index is 0 or more.")
        checked.append(entry)
    if not checked:
        raise ConfigurationError("devices=[]: name at least one device, or pass None for all.")
    return checked


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
            predicted from the key's measurements at their sizes.
    """

    key: str | None = None
    task_peak: str | int | None = None
    size: float | None = None


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
        asks: each task key's current ask, with its basis.
        widths_by_key: for each key with work pending or running, how many
            of its tasks could run at once beside the other keys' running tasks
            (each at the key's own ask, not at a size given with ``options``).
        serial_starts: starts past the bound (the serial floor).
        log_write_errors: decision records the log file could not take (a full
            disk, a file-size limit); they are still in the pool's ``decisions``.
        bookings_skipped: steps the host's booking table was passed over (its
            lock held by another process past the wait, or a failed read or
            write): the pool priced its cards by live readings alone then.
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


class _OptionsView:
    """``submit`` and ``map`` with per-call options; see :meth:`GpuPoolExecutor.options`."""

    def __init__(self, executor: GpuPoolExecutor, options: TaskOptions) -> None:
        self._executor = executor
        self._options = options

    def submit(self, fn: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_R]:
        """As :meth:`GpuPoolExecutor.submit`, with this view's key and peak hint."""
        return self._executor._submit(fn, args, kwargs, self._options)

    def map(
        self,
        fn: Callable[..., _R],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        buffersize: int | None = None,
    ) -> Iterator[_R]:
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
            usable CPUs. An explicit value is not capped by the CPU count (as
            in the standard pool); the construction record notes it.
        mp_context: accepted for compatibility; workers always start with
            spawn semantics (fork+exec), since CUDA does not survive
            ``fork``. A ``fork`` context is refused.
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
            the standard pool does.

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
        defaults = read_pool_defaults(
            os.environ,
            max_workers=max_workers,
            task_peak=task_peak,
            reserve=reserve,
            log_path=log_path,
            progress=progress,
            on_interrupt=on_interrupt,
            max_retries=max_retries,
            room_wait_s=room_wait_s,
        )
        max_workers, task_peak = defaults.max_workers, defaults.task_peak
        reserve, progress = defaults.reserve, defaults.progress
        max_retries, room_wait_s = defaults.max_retries, defaults.room_wait_s
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
        strict = _check_flag(strict, "strict")
        retry_oom = _check_flag(retry_oom, "retry_oom")
        worker_env_given = _check_env(env)
        check_python_home(worker_env_given)
        devices = _check_devices(devices)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ConfigurationError(
                f"max_retries={max_retries!r}: pass a whole number of retries, 0 or more."
            )
        if (
            isinstance(room_wait_s, bool)
            or not isinstance(room_wait_s, (int, float))
            or not math.isfinite(room_wait_s)
            or room_wait_s < 0
        ):
            raise ConfigurationError(
                f"room_wait_s={room_wait_s!r}: pass a number of seconds, 0 or more (such as 120)."
            )
        if width is not None and max_workers is not None and width > max_workers:
            raise ConfigurationError(
                f"width={width} is more than max_workers={max_workers}: a fixed width runs "
                "exactly that many at once, so pass one of them, or a width of at most "
                "max_workers."
            )
        if strict and max_workers is None:
            raise ConfigurationError(
                "strict=True needs max_workers: the width that must not be narrowed."
            )
        peak_bytes = (
            parse_pool_size(task_peak, name="task_peak", allow_zero=False)
            if task_peak is not None
            else None
        )
        policy = Policy(
            margin_bytes=(
                parse_pool_size(margin, name="margin")
                if margin is not None
                else DEFAULT_MARGIN_BYTES
            ),
            margin_fraction=(
                float(margin_fraction) if margin_fraction is not None else DEFAULT_MARGIN_FRACTION
            ),
            reserve_bytes=(
                parse_pool_size(reserve, name="reserve")
                if reserve is not None
                else DEFAULT_RESERVE_BYTES
            ),
            # An explicit margin keeps meaning what it says; by default the
            # margin is learned from the spread of each key's measurements.
            learned=margin is None and margin_fraction is None,
        )
        path = check_log_path(log_path) if log_path is not None else defaults.log_path

        if progress is not None and not isinstance(progress, bool):
            raise ConfigurationError(f"progress={progress!r}: pass True, False or None.")
        if not isinstance(cap_allocator, bool):
            raise ConfigurationError(f"cap_allocator={cap_allocator!r}: pass True or False.")
        if share_bookings not in (True, False, "host") or (
            not isinstance(share_bookings, (bool, str))
        ):
            raise ConfigurationError(
                f"share_bookings={share_bookings!r}: pass True (this user's pools), 'host' "
                "(every user's pools) or False (no booking table)."
            )
        if bookings_dir is not None and (
            not isinstance(bookings_dir, (str, os.PathLike)) or not os.fspath(bookings_dir)
        ):
            raise ConfigurationError(
                f"bookings_dir={bookings_dir!r}: pass a directory path, or None for the default."
            )
        self._progress = progress
        self._on_interrupt = defaults.on_interrupt
        self._mp_context = mp_context
        self._shutdown_lock = threading.Lock()
        self._shutdown = False
        if sensor is not None:
            check_sensor(sensor)
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
            DeviceState(i, info, card)
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
        worker_env.update(worker_env_given)
        # Passed to each worker as a process argument, pickled while the worker is
        # spawned: multiprocessing queues and locks in initargs work, as in CPython.
        init_call = (initializer, tuple(initargs)) if initializer is not None else None
        log = DecisionLog(
            path,
            settings={
                "max_workers": max_workers,
                "task_peak_bytes": peak_bytes,
                "reserve_bytes": policy.reserve_bytes,
                "margin_bytes": policy.margin_bytes,
                "margin_fraction": policy.margin_fraction,
                "width": width,
                "strict": bool(strict),
                "retry_oom": bool(retry_oom),
                "max_tasks_per_child": max_tasks_per_child,
                "devices": None if devices is None else ",".join(str(d) for d in devices),
                "max_retries": max_retries,
                "room_wait_s": float(room_wait_s),
                "learned_margin": policy.learned,
                "cap_allocator": bool(cap_allocator),
                "share_bookings": str(share_bookings),
            },
        )
        self._log = log
        config = PlannerConfig(
            max_workers=self._max_workers,
            max_workers_given=max_workers is not None,
            fixed_width=width,
            strict=strict,
            retry_oom=retry_oom,
            max_retries=max_retries,
            room_wait_s=float(room_wait_s),
            reserve_bytes=policy.reserve_bytes,
            parent_pid=os.getpid(),
        )
        from gpupool._sensors.bookings import new_pool_id, open_booking_table

        bookings = (
            open_booking_table(share=share_bookings, directory=bookings_dir, sensor=self._sensor)
            if device_states
            else None
        )
        self._dispatcher = Dispatcher(
            census=census,
            devices=device_states,
            sensor=self._sensor,
            asks=asks,
            config=config,
            max_tasks_per_child=max_tasks_per_child,
            initializer=init_call,
            log=log,
            env=worker_env,
            cap_allocator=cap_allocator,
            bookings=bookings,
            pool_id=new_pool_id(),
        )
        try:
            self._construct(peak_bytes)
        except BaseException:
            self._dispatcher.close()  # no thread will: give its descriptors back
            raise
        self._dispatcher.start()
        weakref.finalize(self, self._dispatcher.inbox.request_shutdown)

    def _construct(self, peak_bytes: int | None) -> None:
        planner = self._dispatcher.planner
        self._dispatcher.read_census_terms()
        note = "" if peak_bytes is not None else " (no task_peak: priced at the room)"
        cap_allocator = self._dispatcher.workers.cap_allocator
        extra = {"allocator_cap": ALLOCATOR_CAP_NOTE} if cap_allocator else {}
        # Time 0 is the census: the construction records say so, however long
        # the readings beside it took on a loaded host.
        refused = planner.construct(0.0, note=note, extra=extra)
        if refused is not None:
            raise WidthError(refused.reason, decision=refused.decision.to_dict())

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if (
            isinstance(exc_type, type)
            and issubclass(exc_type, KeyboardInterrupt)
            and self._on_interrupt == "terminate"
        ):
            self._stop_on_interrupt()
            return
        self.shutdown(wait=True)

    def _stop_on_interrupt(self) -> None:
        """Ctrl-C left the ``with`` block: SIGTERM now, SIGKILL after the grace, then wait.

        What the tasks started is listed before SIGTERM: a worker that SIGTERM ends
        is reaped and forgotten at once, and a child of its task that ignores
        SIGTERM would be out of the pool's reach at the grace's end.
        """
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        below = trees_below(self._processes)
        self.terminate_workers()
        try:
            self._dispatcher.join(INTERRUPT_GRACE_S)
            kill_left_after(below, deadline)
        finally:  # a second Ctrl-C during the grace kills at once
            if self._dispatcher.thread.is_alive():
                self.kill_workers()
            kill_left_after(below, 0.0)
            self._dispatcher.join()

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
            RuntimeError: the pool was shut down.
        """
        return self._submit(fn, args, kwargs, None)

    def options(
        self,
        *,
        key: str | None = None,
        task_peak: str | int | None = None,
        size: float | None = None,
    ) -> _OptionsView:
        """``submit``/``map`` with a task key, a peak hint and an input size, keeping
        CPython's signatures.

        ::

            big = ex.options(key="big-model", task_peak="12GiB")
            future = big.submit(compile_entry, entry)
            sized = ex.options(key="compile", size=len(entry.tokens))
            future = sized.submit(compile_entry, entry)

        Args:
            key: tasks with the same key share one learned ask.
            task_peak: this key's estimated peak until a child measures it.
            size: the size of this task's input (tokens, rows, bytes: one unit for every
                task of the key). Once tasks of the key were measured at their sizes, the
                task's ask is predicted from them, so small inputs are not priced at the
                largest one's peak and an input larger than any before is priced above
                them.

        Raises:
            ConfigurationError: ``task_peak`` is not a positive size, ``key`` is not a
                non-empty str, or ``size`` is not a positive, finite number.
        """
        if task_peak is not None:
            parse_pool_size(task_peak, name="task_peak", allow_zero=False)
        if key is not None and (not isinstance(key, str) or not key):
            raise ConfigurationError(
                f"key={key!r}: a task key must be a non-empty str (tasks of one key share "
                "one learned ask); pass a name such as 'embed', or leave key out for the "
                "function's own name."
            )
        value: float | None = None
        if size is not None:
            # Any real number (numpy's included) is a size, read as a float; one too large
            # for a float is refused as any other bad size is.
            value = math.nan
            if isinstance(size, numbers.Real) and not isinstance(size, bool):
                try:
                    value = float(size)
                except (ValueError, OverflowError):
                    pass
            if not math.isfinite(value) or value <= 0:
                raise ConfigurationError(
                    f"size={size!r}: a task's input size must be a positive, finite number "
                    "(tokens, rows, bytes: one unit for every task of the key)."
                )
        return _OptionsView(self, TaskOptions(key=key, task_peak=task_peak, size=value))

    def _submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: TaskOptions | None,
        key: str | None = None,
    ) -> Future[Any]:
        inbox = self._dispatcher.inbox
        with self._shutdown_lock:
            if inbox.broken is not None:
                raise copy_broken(inbox.broken_exc, inbox.broken)
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if interpreter_exiting():
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            future: Future[Any] = Future()
            task_key = (
                (options.key if options and options.key else None) or key or callable_name(fn)
            )
            hint = (
                parse_pool_size(options.task_peak, name="task_peak", allow_zero=False)
                if options is not None and options.task_peak is not None
                else None
            )
            # Pickled when it is sent to a worker: waiting work costs no pickled copy.
            size = options.size if options is not None else None
            inbox.put(WorkItem(future, (fn, args, kwargs), task_key, hint, size))
            return future

    def map(
        self,
        fn: Callable[..., _R],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        buffersize: int | None = None,
    ) -> Iterator[_R]:
        """Like :func:`map`, running ``fn`` in the pool; results come back in input order.

        Args:
            *iterables: the arguments of ``fn``.
            timeout: seconds from this call after which a result not yet
                ready raises :class:`concurrent.futures.TimeoutError`.
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
        key = callable_name(fn)
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
        self._dispatcher.inbox.request_shutdown(cancel_futures)
        if wait:
            self._dispatcher.join()

    def terminate_workers(self) -> None:
        """Shut down without waiting, cancel what has not started, and SIGTERM the workers."""
        self._force(signal.SIGTERM)

    def kill_workers(self) -> None:
        """Shut down without waiting, cancel what has not started, and SIGKILL the workers."""
        self._force(signal.SIGKILL)

    def _force(self, sig: signal.Signals) -> None:
        with self._shutdown_lock:
            self._shutdown = True
        self._dispatcher.inbox.request_kill(sig)

    # -- what the pool decided ----------------------------------------------------------

    @property
    def width(self) -> int:
        """How many tasks the planner admits at once, over every card, for the work it holds,
        as of the dispatcher's last snapshot (see :meth:`statistics`)."""
        return self._dispatcher.snapshot.width

    @property
    def census(self) -> Census:
        """The census taken at construction."""
        return self._census

    @property
    def decisions(self) -> tuple[Decision, ...]:
        """Every decision so far, oldest first."""
        return self._log.records()

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
        snapshot = d.snapshot
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
            log_write_errors=max(snapshot.log_write_errors, self._log.write_errors),
            bookings_skipped=counts.get("bookings_skipped", 0),
            bookings_unavailable=snapshot.bookings_unavailable,
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
