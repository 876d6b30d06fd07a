"""The pool's options, checked once, and the pool built from them (process layer).

:func:`read_options` checks each argument where it reads it, with a message that names it
and the fix, and reads a variable (:mod:`gpupool._pool.environ`) only for an argument left
out, so a bad value there cannot fail a pool that does not use it. :func:`build_dispatcher`
builds the pool from the frozen :class:`PoolOptions`: it reads the cards once, before any
child of the pool exists (the census is never retaken), and checks only what needs them
(a reserve as large as a card).
"""

from __future__ import annotations

import math
import multiprocessing
import operator
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from gpupool._core.bound import MAX_WORKERS_LIMIT
from gpupool._core.events import JsonValue
from gpupool._core.planner import Planner, PlannerConfig
from gpupool._core.policy import DEFAULT_MARGIN_BYTES, DEFAULT_MARGIN_FRACTION, AskTable, Policy
from gpupool._core.units import format_size, parse_pool_size
from gpupool._errors import ConfigurationError
from gpupool._observe.log import DecisionLog, check_log_path
from gpupool._pool import environ as variables
from gpupool._pool.by_value import note_pool_made
from gpupool._pool.dispatcher import Dispatcher
from gpupool._pool.memory import PeakMemory, memory_path
from gpupool._pool.workers import DeviceState, WorkerOptions
from gpupool._sensors.select import default_sensor

if TYPE_CHECKING:
    from gpupool._core.census import Census
    from gpupool._sensors.base import DeviceInfo, Sensor

__all__ = ["PoolOptions", "WorkerOptions", "build_dispatcher", "read_options"]

#: What a sensor must answer (``gpupool._sensors.base.Sensor`` implements them all).
SENSOR_METHODS = ("read_devices", "read_memory", "read_host")

_A = TypeVar("_A")
_V = TypeVar("_V")

_parse_task_peak = partial(parse_pool_size, name="task_peak", allow_zero=False)
_parse_reserve = partial(parse_pool_size, name="reserve")


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolOptions:
    """The constructor's arguments of these names, checked, and where one was left out, its
    ``GPUPOOL_*`` variable's value, else its default (see :class:`~gpupool.GpuPoolExecutor`).
    ``task_peak`` is in bytes, ``margin``, ``margin_fraction`` and ``reserve`` are in ``policy``,
    and the arguments that say how workers start are in ``workers``.
    """

    max_workers: int | None
    width: int | None
    strict: bool
    retry_oom: bool
    max_retries: int
    room_wait_s: float
    task_peak_bytes: int | None
    policy: Policy
    devices: tuple[int | str, ...] | None
    sensor: Sensor | None
    share_bookings: bool | str
    bookings_dir: str | os.PathLike[str] | None
    log_path: Path | None
    progress: bool | None
    on_interrupt: variables.OnInterrupt
    workers: WorkerOptions
    #: Every task's deadline unless ``options(timeout_s=)`` gives one (``GPUPOOL_TASK_TIMEOUT_S``).
    task_timeout_s: float | None = None
    # Where the pool remembers its keys' peaks between runs (None: off; GPUPOOL_MEMORY).
    memory_path: Path | None = None

    def __post_init__(self) -> None:
        workers = self.max_workers
        if self.width is not None and workers is not None and self.width > workers:
            raise ConfigurationError(
                f"width={self.width} is more than max_workers={workers}: a fixed width runs "
                "exactly that many at once, so pass one of them, or a width of at most "
                "max_workers."
            )
        if self.strict and self.max_workers is None:
            raise ConfigurationError(
                "strict=True needs max_workers: the width that must not be narrowed."
            )

    def settings(self) -> dict[str, JsonValue]:
        """The options as the decision log's ``run_started`` record states them."""
        devices = None if self.devices is None else ",".join(str(d) for d in self.devices)
        return {
            "max_workers": self.max_workers,
            "task_peak_bytes": self.task_peak_bytes,
            "reserve_bytes": self.policy.reserve_bytes,
            "margin_bytes": self.policy.margin_bytes,
            "margin_fraction": self.policy.margin_fraction,
            "width": self.width,
            "strict": self.strict,
            "retry_oom": self.retry_oom,
            "max_tasks_per_child": self.workers.max_tasks_per_child,
            "devices": devices,
            "max_retries": self.max_retries,
            "room_wait_s": self.room_wait_s,
            "task_timeout_s": self.task_timeout_s,
            "learned_margin": self.policy.learned,
            "cap_allocator": self.workers.cap_allocator,
            "share_bookings": str(self.share_bookings),
        }


def read_options(
    environ: Mapping[str, str],
    *,
    max_workers: int | None,
    mp_context: Any,
    initializer: Callable[..., object] | None,
    initargs: tuple[Any, ...],
    max_tasks_per_child: int | None,
    task_peak: str | int | None,
    reserve: str | int | None,
    margin: str | int | None,
    margin_fraction: float | None,
    devices: Sequence[int | str] | None,
    width: int | None,
    strict: bool,
    retry_oom: bool,
    max_retries: int | None,
    room_wait_s: float | None,
    log_path: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None,
    sensor: Sensor | None,
    progress: bool | None,
    cap_allocator: bool,
    share_bookings: bool | str,
    bookings_dir: str | os.PathLike[str] | None,
    on_interrupt: str | None,
) -> PoolOptions:
    """The options of ``GpuPoolExecutor(...)``: each argument checked, each one left out
    (``None``) read from its ``GPUPOOL_*`` variable in ``environ``, else its default.

    Raises:
        ConfigurationError: an argument or a variable is wrong; the message names it and the
            fix. ``TypeError``/``ValueError`` for the arguments CPython's pool checks too.
    """
    _check_not_bootstrapping()
    _check_not_daemonic()
    variables.warn_mistyped_variables(environ)
    # The arguments are checked in this order (keywords are evaluated left to right, in steps too).
    return PoolOptions(
        max_workers=_resolve(max_workers, _check_max_workers, variables.read_max_workers, environ),
        workers=_read_workers(
            mp_context, initializer, initargs, max_tasks_per_child, env, cap_allocator
        ),
        width=_check_width(width),
        strict=_check_flag(strict, "strict"),
        retry_oom=_check_flag(retry_oom, "retry_oom"),
        devices=_check_devices(devices),
        **_read_prices(
            environ, max_retries, room_wait_s, task_peak, margin, margin_fraction, reserve
        ),
        **_read_upkeep(
            environ, log_path, progress, share_bookings, bookings_dir, sensor, on_interrupt
        ),
    )


class _Prices(TypedDict):
    """The options :func:`_read_prices` reads, by their :class:`PoolOptions` names."""

    max_retries: int
    room_wait_s: float
    task_peak_bytes: int | None
    policy: Policy


def _read_prices(
    environ: Mapping[str, str],
    max_retries: int | None,
    room_wait_s: float | None,
    task_peak: str | int | None,
    margin: str | int | None,
    margin_fraction: float | None,
    reserve: str | int | None,
) -> _Prices:
    """What a task is priced at and how the pool retries one that ran out of device memory,
    checked in :func:`read_options`'s order (each left out read from ``environ``)."""
    return _Prices(
        max_retries=_resolve(max_retries, _check_max_retries, variables.read_max_retries, environ),
        room_wait_s=_resolve(room_wait_s, _check_room_wait_s, variables.read_room_wait_s, environ),
        task_peak_bytes=_resolve(task_peak, _parse_task_peak, variables.read_task_peak, environ),
        policy=_read_policy(margin, margin_fraction, reserve, environ),
    )


class _Upkeep(TypedDict):
    """The options :func:`_read_upkeep` reads, by their :class:`PoolOptions` names."""

    log_path: Path | None
    progress: bool | None
    share_bookings: bool | str
    bookings_dir: str | os.PathLike[str] | None
    sensor: Sensor | None
    on_interrupt: variables.OnInterrupt
    task_timeout_s: float | None
    memory_path: Path | None


def _read_upkeep(
    environ: Mapping[str, str],
    log_path: str | os.PathLike[str] | None,
    progress: bool | None,
    share_bookings: bool | str,
    bookings_dir: str | os.PathLike[str] | None,
    sensor: Sensor | None,
    on_interrupt: str | None,
) -> _Upkeep:
    """What the pool keeps and tells beside its tasks: its decision log and progress bar, the
    bookings it shares with other pools, the sensor it reads, what Ctrl-C does, every task's
    deadline and the peaks it remembers between runs; checked in :func:`read_options`'s
    order (each left out read from ``environ``)."""
    return _Upkeep(
        log_path=variables.read_log_path(environ) if log_path is None else check_log_path(log_path),
        progress=_resolve(progress, _check_progress, variables.read_progress, environ),
        share_bookings=_check_share_bookings(share_bookings),
        bookings_dir=_check_bookings_dir(bookings_dir),
        sensor=None if sensor is None else _check_sensor(sensor),
        on_interrupt=_resolve(
            on_interrupt, _check_on_interrupt, variables.read_on_interrupt, environ
        ),
        task_timeout_s=variables.read_task_timeout_s(environ),
        memory_path=memory_path(environ),
    )


def _resolve(
    given: _A | None,
    check: Callable[[_A], _V],
    read: Callable[[Mapping[str, str]], _V],
    environ: Mapping[str, str],
) -> _V:
    """The argument, checked, when given; else its variable or default (read only then)."""
    return check(given) if given is not None else read(environ)


def _check_not_bootstrapping() -> None:
    """A worker importing the script runs its top level: a pool made there would start
    workers of its own, each importing the script again. Refused with the standard library's
    RuntimeError and its advice. A pool the script's own top level makes, unguarded, makes
    its workers take the script by value instead (``by_value.note_pool_made``)."""
    from multiprocessing import spawn

    spawn._check_not_importing_main()  # type: ignore[attr-defined]
    note_pool_made()


def _check_not_daemonic() -> None:
    if multiprocessing.current_process().daemon:
        raise ConfigurationError(
            "GpuPoolExecutor cannot start workers from a daemonic process (daemonic "
            "processes may not have children); run it from a non-daemonic process, e.g. "
            "set distributed.worker.daemon=False for Dask workers."
        )


def _whole(value: object) -> int | None:
    """``value`` as an int where it is one (numpy's integers too, never a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _check_max_workers(value: object) -> int:
    """As CPython's pool takes it (numpy's integers too), with its exception types and words."""
    count = _whole(value)
    if count is None:
        raise TypeError(f"max_workers must be an int, got {value!r}")
    if count <= 0:
        raise ValueError("max_workers must be greater than 0")
    if count > MAX_WORKERS_LIMIT:
        raise ValueError(
            f"max_workers must be <= {MAX_WORKERS_LIMIT}, got {count}: each worker is a process "
            "with a CUDA context of its own; pass the most tasks that should run at once."
        )
    return count


def _read_workers(
    mp_context: Any,
    initializer: object,
    initargs: tuple[Any, ...],
    max_tasks_per_child: object,
    env: object,
    cap_allocator: object,
) -> WorkerOptions:
    """How workers start; the compatibility arguments with CPython's exception types and words."""
    method = _start_method(mp_context)
    if method == "fork" and max_tasks_per_child is not None:
        raise ValueError(
            "max_tasks_per_child is incompatible with the 'fork' multiprocessing "
            "start method; supply a different mp_context."
        )
    if method not in (None, "spawn"):
        why = {
            "fork": "which CUDA does not survive",
            "forkserver": "whose workers would inherit the server's environment and imports "
            "instead of starting with their card's",
        }.get(method, "which gpupool does not know")
        raise ConfigurationError(
            f"mp_context uses {method!r}, {why}; gpupool starts every worker as a fresh "
            "interpreter (spawn), so only spawn is supported. Pass mp_context=None or "
            "multiprocessing.get_context('spawn')."
        )
    if initializer is not None and not callable(initializer):
        raise TypeError("initializer must be a callable")
    if initializer is not None and not isinstance(initargs, Iterable):
        # Every worker would die calling initializer(*initargs), and the pool break.
        raise TypeError(
            f"initargs={initargs!r}: pass the initializer's arguments as a tuple, such as "
            f"initargs=({initargs!r},), or () for none."
        )
    if max_tasks_per_child is not None:
        if not isinstance(max_tasks_per_child, int) or isinstance(max_tasks_per_child, bool):
            raise TypeError("max_tasks_per_child must be an integer")
        if max_tasks_per_child <= 0:
            raise ValueError("max_tasks_per_child must be >= 1")
    checked_env = _check_env(env)
    if not isinstance(cap_allocator, bool):
        raise ConfigurationError(f"cap_allocator={cap_allocator!r}: pass True or False.")
    return WorkerOptions(
        mp_context=mp_context,
        # Passed to each worker as a process argument, pickled while the worker is
        # spawned: multiprocessing queues and locks in initargs work, as in CPython.
        initializer=None if initializer is None else (initializer, tuple(initargs)),
        max_tasks_per_child=max_tasks_per_child,
        # JAX told not to preallocate 75 % of the card; env= wins (the sensor adds its own
        # pinning when a worker starts).
        env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **checked_env},
        cap_allocator=cap_allocator,
    )


def _start_method(mp_context: object) -> str | None:
    """The start method of ``mp_context`` (``None`` for none given); a value that is not a
    multiprocessing context (a string, any other object) is refused, naming the fix."""
    if mp_context is None:
        return None
    get = getattr(mp_context, "get_start_method", None)
    if not callable(get):
        hint = (
            f"get_context({mp_context!r})"
            if isinstance(mp_context, str)
            else "get_context('spawn')"
        )
        raise ConfigurationError(
            f"mp_context={mp_context!r}: pass a multiprocessing context, such as "
            f"multiprocessing.{hint}, or None (gpupool's workers start as spawn starts them)."
        )
    method: str = get(allow_none=False)
    return method


def _check_width(width: object) -> int | None:
    if width is None:
        return None
    count = _whole(width)
    if count is None or not 0 < count <= MAX_WORKERS_LIMIT:
        raise ConfigurationError(
            f"width={width!r}: a fixed width must be a positive int of at most "
            f"{MAX_WORKERS_LIMIT}, or None for the bound."
        )
    return count


def _read_policy(
    margin: object, margin_fraction: object, reserve: object, environ: Mapping[str, str]
) -> Policy:
    """The margin over measured peaks and the reserve (``reserve``, else its variable)."""
    if margin_fraction is not None and not (
        isinstance(margin_fraction, (int, float))
        and not isinstance(margin_fraction, bool)
        and math.isfinite(margin_fraction)
        and 0 <= margin_fraction <= 10
    ):
        raise ConfigurationError(
            f"margin_fraction={margin_fraction!r}: pass a fraction such as 0.10."
        )
    return Policy(
        margin_bytes=(
            DEFAULT_MARGIN_BYTES if margin is None else parse_pool_size(margin, name="margin")
        ),
        margin_fraction=(
            DEFAULT_MARGIN_FRACTION if margin_fraction is None else float(margin_fraction)
        ),
        reserve_bytes=_resolve(reserve, _parse_reserve, variables.read_reserve, environ),
        # An explicit margin keeps meaning what it says; by default the
        # margin is learned from the spread of each key's measurements.
        learned=margin is None and margin_fraction is None,
        outliers=True,
    )


def _check_flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(
            f"{name}={value!r}: pass True or False (a string such as 'no' would count as True)."
        )
    return value


def _check_vendor(sensor: Sensor, infos: Sequence[DeviceInfo]) -> None:
    """A sensor's vendor facts, checked once as ``env=`` is: what pins a worker to each card
    is a mapping of names to str values, and the factory each worker builds its own sensor
    with pickles (a worker is spawned with it)."""
    kind = type(sensor).__name__
    for info in infos:
        try:
            _check_env(sensor.worker_env(info))
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"{kind}.worker_env({info.uuid!r}) cannot pin a worker: {exc} A sensor's "
                "worker_env returns a dict of variable names to str values."
            ) from None
    if infos:
        import cloudpickle

        try:
            cloudpickle.dumps(sensor.worker_factory())
        except Exception as exc:
            raise ConfigurationError(
                f"{kind}.worker_factory() cannot reach a worker: {type(exc).__name__}: {exc}. "
                "Return a module-level class or function, or a functools.partial of one."
            ) from None


def _check_env_pinning(env: Mapping[str, str], sensor: Sensor, infos: Sequence[DeviceInfo]) -> None:
    """Refuse an ``env=`` value that the variables pinning each worker to its card would
    override (a worker pinned to another card than its bookings' is priced on the wrong one):
    the cards are chosen with ``devices=``."""
    for info in infos:
        for name, value in sensor.worker_env(info).items():
            if name in env and env[name] != value:
                raise ConfigurationError(
                    f"env[{name!r}]={env[name]!r}: the pool sets {name} in each worker to pin "
                    f"it to its card ({value!r} on card {info.index}), so this value would "
                    f"never reach a worker. Choose the cards with devices=[...], and leave "
                    f"{name!r} out of env."
                )


def _check_env(env: object) -> dict[str, str]:
    """The ``env=`` mapping, refused unless every key and value can reach a worker as given,
    and unless a ``PYTHONHOME`` in it names a Python (:func:`_check_python_home`)."""
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
    _check_python_home(checked)
    return checked


def _check_python_home(env: Mapping[str, str]) -> None:
    """Refuse an ``env`` ``PYTHONHOME`` under which no worker could start (every worker would
    die at boot, "exited with code 1").

    Python looks for its standard library in ``<prefix>/lib/pythonX.Y`` under the
    ``PYTHONHOME`` prefix (``prefix:exec_prefix``); without it the interpreter
    exits with code 1 before running any code of gpupool's. An empty ``PYTHONHOME``
    is accepted: Python ignores it, as it ignores every empty ``PYTHON*`` variable.
    """
    home = env.get("PYTHONHOME")
    if not home or os.name != "posix":
        return
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    fix = (
        f"no worker could start (Python looks for its standard library there). Pass the "
        f"prefix of this Python (sys.prefix is {sys.base_prefix!r}), or leave PYTHONHOME out."
    )
    for prefix in home.split(":"):
        if not os.path.isdir(prefix):
            raise ConfigurationError(
                f"env: PYTHONHOME={home!r}: the directory {prefix!r} does not exist; {fix}"
            )
        if not os.path.isdir(os.path.join(prefix, "lib", version)):
            raise ConfigurationError(
                f"env: PYTHONHOME={home!r}: {prefix!r} has no lib/{version}; {fix}"
            )


def _check_devices(devices: object) -> tuple[int | str, ...] | None:
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
        index = _whole(entry)
        if index is None and not isinstance(entry, str):
            raise ConfigurationError(
                f"devices entry {entry!r}: each entry is a device index (int) or UUID (str)."
            )
        entry = entry if index is None else index  # numpy's integers are indexes too
        if isinstance(entry, int) and entry < 0:
            raise ConfigurationError(f"devices entry {entry!r}: an index is 0 or more.")
        if entry in checked:
            raise ConfigurationError(
                f"devices={list(devices)!r} names {entry!r} twice: name each device once."
            )
        checked.append(entry)
    if not checked:
        raise ConfigurationError("devices=[]: name at least one device, or pass None for all.")
    return tuple(checked)


def _check_max_retries(value: object) -> int:
    count = _whole(value)
    if count is None or count < 0:
        raise ConfigurationError(
            f"max_retries={value!r}: pass a whole number of retries, 0 or more."
        )
    return count


def _check_room_wait_s(value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigurationError(
            f"room_wait_s={value!r}: pass a number of seconds, 0 or more (such as 120)."
        )
    return float(value)


def _check_progress(value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"progress={value!r}: pass True, False or None.")
    return value


def _check_share_bookings(value: object) -> bool | str:
    if value not in (True, False, "host") or not isinstance(value, (bool, str)):
        raise ConfigurationError(
            f"share_bookings={value!r}: pass True (this user's pools), 'host' "
            "(every user's pools) or False (no booking table)."
        )
    return value


def _check_bookings_dir(value: object) -> str | os.PathLike[str] | None:
    if value is not None and (not isinstance(value, (str, os.PathLike)) or not os.fspath(value)):
        raise ConfigurationError(
            f"bookings_dir={value!r}: pass a directory path, or None for the default."
        )
    return value


def _check_reserve(census: Census, reserve_bytes: int) -> None:
    for card in census.cards:
        if card.total_bytes is not None and reserve_bytes >= card.total_bytes:
            raise ConfigurationError(
                f"reserve={format_size(reserve_bytes)} is not smaller than card "
                f"{card.device}'s {format_size(card.total_bytes)}; pass a smaller reserve."
            )


def _check_sensor(sensor: Sensor) -> Sensor:
    """Refuse a ``sensor=`` that lacks a method the census calls (it would fail there, far from
    where it was given, with an ``AttributeError``), naming what is missing."""
    if isinstance(sensor, type):  # its methods are callable, but need an instance
        raise ConfigurationError(
            f"sensor={sensor!r} is a class: pass a sensor object, such as "
            f"{sensor.__name__}(...) or gpupool.testing.SimulatedHost(...).sensor(), or None "
            "for the default."
        )
    missing = [name for name in SENSOR_METHODS if not callable(getattr(sensor, name, None))]
    if missing:
        raise ConfigurationError(
            f"sensor={sensor!r}: not a sensor (it has no {', '.join(missing)}). Pass a "
            "gpupool sensor (a subclass of gpupool._sensors.base.Sensor, such as "
            "gpupool.testing.SimulatedHost(...).sensor()), or None for the default."
        )
    return sensor


def _check_on_interrupt(value: object) -> variables.OnInterrupt:
    """The ``on_interrupt=`` argument, refused unless it is one of ``INTERRUPT_CHOICES``."""
    for choice in variables.INTERRUPT_CHOICES:
        if value == choice:
            return choice
    raise ConfigurationError(
        f"on_interrupt={value!r}: pass 'terminate' (Ctrl-C stops the running tasks) or "
        "'wait' (Ctrl-C waits for them, as the standard pool does)."
    )


def build_dispatcher(options: PoolOptions) -> tuple[Dispatcher, Census, int]:
    """The pool's dispatcher, its first widths decided and recorded, started; with
    the census it priced and the ``max_workers`` it was given or chose (the CPUs).

    Raises:
        ConfigurationError: ``reserve`` is not smaller than a card, or the census refused
            the ``devices`` selection.
        WidthError: ``strict=True`` and the bound is narrower than ``max_workers``.
    """
    from gpupool._sensors.bookings import new_pool_id, open_booking_table

    sensor, census, infos = _read_cards(options)
    devices = [
        DeviceState(i, *pair) for i, pair in enumerate(zip(infos, census.cards, strict=True))
    ]
    peak_bytes = options.task_peak_bytes
    if peak_bytes is None:
        peak_bytes = Planner.price_without_peak(census, options.policy.reserve_bytes)
    config = _planner_config(options, census)
    share, directory = options.share_bookings, options.bookings_dir
    bookings = (
        open_booking_table(share=share, directory=directory, sensor=sensor) if devices else None
    )
    memory = _peak_memory(options, census)
    # Opened last, so that nothing above can leave its run (run_started) without an end; a
    # refusal from here on ends it (Dispatcher.refused).
    log = DecisionLog(options.log_path, settings=options.settings())
    try:
        dispatcher = Dispatcher(
            census=census,
            devices=devices,
            sensor=sensor,
            asks=AskTable(policy=options.policy, default_estimate_bytes=peak_bytes),
            config=config,
            workers=options.workers,
            log=log,
            bookings=bookings,
            pool_id=new_pool_id(),
            memory=memory,
        )
    except BaseException:  # out of descriptors, say: no planner to write the run's end
        log.close()
        if bookings is not None:
            bookings.close()
        raise
    try:
        dispatcher.start(priced=options.task_peak_bytes is not None)
    except BaseException as exc:
        dispatcher.refused(exc)  # the run its log opened ends; its descriptors given back
        raise
    return dispatcher, census, config.max_workers


def _read_cards(options: PoolOptions) -> tuple[Sensor, Census, tuple[DeviceInfo, ...]]:
    """The sensor, and the cards it reads once (before any child of the pool exists), checked
    where a check needs them: a reserve as large as a card, the vendor's facts, ``env=``."""
    from gpupool._sensors.census import read_census

    # The default: NVML, or the simulator inside a SimulatedHost.
    sensor = options.sensor if options.sensor is not None else default_sensor()
    visible = sensor.read_visible_devices()
    census, infos = read_census(
        sensor, devices=options.devices, visible_devices=visible, pid=os.getpid()
    )
    _check_reserve(census, options.policy.reserve_bytes)
    _check_vendor(sensor, infos)
    _check_env_pinning(options.workers.env, sensor, infos)
    return sensor, census, infos


def _planner_config(options: PoolOptions, census: Census) -> PlannerConfig:
    """The planner's settings; with no ``max_workers``, the host's CPUs bound the width."""
    return PlannerConfig(
        max_workers=options.max_workers or census.host.cpus,
        max_workers_given=options.max_workers is not None,
        fixed_width=options.width,
        strict=options.strict,
        retry_oom=options.retry_oom,
        max_retries=options.max_retries,
        room_wait_s=options.room_wait_s,
        reserve_bytes=options.policy.reserve_bytes,
        parent_pid=os.getpid(),
    )


def _peak_memory(options: PoolOptions, census: Census) -> PeakMemory | None:
    """Where the keys' peaks are remembered between runs, for these cards' models (``None``:
    off, and under a fixed width)."""
    if options.memory_path is None or options.width is not None:
        return None
    return PeakMemory(options.memory_path, tuple(sorted({card.name for card in census.cards})))
