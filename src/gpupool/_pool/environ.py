"""Pool defaults from the environment: the ``GPUPOOL_*`` variables.

``LOKY_MAX_CPU_COUNT`` caps the host's CPUs where the census is taken
(:func:`gpupool._sensors.host.cap_host_cpus`, shared with ``gpupool census``);
its name and reader are re-exported here.

Read once per pool, at construction (never at import), from the mapping the
executor passes (``os.environ``). Precedence: an argument given to the
constructor, then its variable, then the built-in default; a variable whose
argument was given is never read, so a bad value there cannot fail a pool that
does not use it. A bad value is refused with a :class:`ConfigurationError`
that names the variable and what to set it to.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from gpupool._core.planner import DEFAULT_MAX_RETRIES, DEFAULT_ROOM_WAIT_S
from gpupool._core.units import parse_pool_size
from gpupool._errors import ConfigurationError
from gpupool._observe.log import check_log_path
from gpupool._sensors.host import CPU_CAP_ENV, read_cpu_cap

__all__ = [
    "CPU_CAP_ENV",
    "INTERRUPT_CHOICES",
    "LOG_PATH_ENV",
    "MAX_RETRIES_ENV",
    "MAX_WORKERS_ENV",
    "ON_INTERRUPT_ENV",
    "PROGRESS_ENV",
    "RESERVE_ENV",
    "ROOM_WAIT_ENV",
    "TASK_PEAK_ENV",
    "OnInterrupt",
    "PoolDefaults",
    "check_on_interrupt",
    "read_pool_defaults",
    "read_cpu_cap",
    "read_log_path",
    "read_max_retries",
    "read_max_workers",
    "read_on_interrupt",
    "read_progress",
    "read_room_wait_s",
    "read_size",
]

MAX_WORKERS_ENV = "GPUPOOL_MAX_WORKERS"
TASK_PEAK_ENV = "GPUPOOL_TASK_PEAK"
RESERVE_ENV = "GPUPOOL_RESERVE"
LOG_PATH_ENV = "GPUPOOL_LOG_PATH"
PROGRESS_ENV = "GPUPOOL_PROGRESS"
ON_INTERRUPT_ENV = "GPUPOOL_ON_INTERRUPT"
MAX_RETRIES_ENV = "GPUPOOL_MAX_RETRIES"
ROOM_WAIT_ENV = "GPUPOOL_ROOM_WAIT_S"

#: What leaving a ``with`` block by ``KeyboardInterrupt`` does (see ``on_interrupt=``).
OnInterrupt = Literal["terminate", "wait"]
INTERRUPT_CHOICES: tuple[OnInterrupt, ...] = ("terminate", "wait")

_PROGRESS_WORDS: dict[str, bool | None] = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
    "auto": None,
}


def _refuse(name: str, value: str, what: str) -> ConfigurationError:
    return ConfigurationError(f"{name}={value!r}: {what}; or unset {name} for the default.")


def _whole_number(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise _refuse(name, value, "set it to a whole number of at least 1, such as 4")
    return number


def read_max_workers(environ: Mapping[str, str]) -> int | None:
    """``GPUPOOL_MAX_WORKERS``, the default for ``max_workers``, or ``None`` when unset."""
    value = environ.get(MAX_WORKERS_ENV)
    return None if value is None else _whole_number(MAX_WORKERS_ENV, value)


def read_max_retries(environ: Mapping[str, str]) -> int | None:
    """``GPUPOOL_MAX_RETRIES``, the default for ``max_retries`` (0 or more), or ``None``."""
    value = environ.get(MAX_RETRIES_ENV)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise _refuse(
            MAX_RETRIES_ENV, value, "set it to a whole number of retries, 0 or more, such as 5"
        )
    return number


def read_room_wait_s(environ: Mapping[str, str]) -> float | None:
    """``GPUPOOL_ROOM_WAIT_S``, the default for ``room_wait_s`` in seconds, or ``None``."""
    value = environ.get(ROOM_WAIT_ENV)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise _refuse(ROOM_WAIT_ENV, value, "set it to a number of seconds, 0 or more, such as 120")
    return seconds


def read_size(environ: Mapping[str, str], name: str, *, allow_zero: bool) -> int | None:
    """A byte size variable (``GPUPOOL_TASK_PEAK``, ``GPUPOOL_RESERVE``) in bytes, or ``None``."""
    value = environ.get(name)
    if value is None:
        return None
    try:
        return parse_pool_size(value, name=name, allow_zero=allow_zero)
    except ConfigurationError as exc:
        raise ConfigurationError(
            f"{exc} (read from the environment: fix or unset {name})"
        ) from None


def read_log_path(environ: Mapping[str, str]) -> Path | None:
    """``GPUPOOL_LOG_PATH``, checked as ``log_path=`` is, or ``None`` when unset."""
    value = environ.get(LOG_PATH_ENV)
    if value is None:
        return None
    if not value or "\0" in value:
        raise _refuse(LOG_PATH_ENV, value, "set it to a file path such as run.jsonl")
    try:
        return check_log_path(value)
    except ConfigurationError as exc:
        raise _refuse(LOG_PATH_ENV, value, str(exc).rstrip(".")) from None


def read_progress(environ: Mapping[str, str]) -> bool | None:
    """``GPUPOOL_PROGRESS``: on/off words, or ``auto`` (and unset) for ``None``."""
    value = environ.get(PROGRESS_ENV)
    if value is None:
        return None
    word = value.strip().lower()
    if word not in _PROGRESS_WORDS:
        raise _refuse(PROGRESS_ENV, value, "set it to 1, 0 or 'auto' (on, off, or on a terminal)")
    return _PROGRESS_WORDS[word]


def read_on_interrupt(environ: Mapping[str, str]) -> OnInterrupt | None:
    """``GPUPOOL_ON_INTERRUPT``, the default for ``on_interrupt``, or ``None`` when unset."""
    value = environ.get(ON_INTERRUPT_ENV)
    if value is None:
        return None
    for choice in INTERRUPT_CHOICES:
        if value.strip().lower() == choice:
            return choice
    raise _refuse(ON_INTERRUPT_ENV, value, "set it to 'terminate' or 'wait'")


def check_on_interrupt(value: object) -> OnInterrupt:
    """The ``on_interrupt=`` argument, refused unless it is one of :data:`INTERRUPT_CHOICES`."""
    for choice in INTERRUPT_CHOICES:
        if value == choice:
            return choice
    raise ConfigurationError(
        f"on_interrupt={value!r}: pass 'terminate' (Ctrl-C stops the running tasks) or "
        "'wait' (Ctrl-C waits for them, as the standard pool does)."
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolDefaults:
    """The constructor's arguments once the environment has filled those left out.

    Attributes:
        max_workers: as given, else ``GPUPOOL_MAX_WORKERS``, else ``None``.
        task_peak: as given, else ``GPUPOOL_TASK_PEAK`` in bytes, else ``None``.
        reserve: as given, else ``GPUPOOL_RESERVE`` in bytes, else ``None``.
        log_path: ``GPUPOOL_LOG_PATH``, checked, when ``log_path`` was not given.
        progress: as given, else ``GPUPOOL_PROGRESS``, else ``None``.
        on_interrupt: as given, else ``GPUPOOL_ON_INTERRUPT``, else ``"terminate"``.
        max_retries: as given, else ``GPUPOOL_MAX_RETRIES``, else 5.
        room_wait_s: as given, else ``GPUPOOL_ROOM_WAIT_S``, else 120 s.
    """

    max_workers: int | None
    task_peak: str | int | None
    reserve: str | int | None
    log_path: Path | None
    progress: bool | None
    on_interrupt: OnInterrupt
    max_retries: int
    room_wait_s: float


_V = TypeVar("_V")


def _first(
    given: _V | None,
    read: Callable[[Mapping[str, str]], _V | None],
    environ: Mapping[str, str],
    default: _V,
) -> _V:
    """The argument as given, else its variable (read only then), else the default."""
    if given is not None:
        return given
    from_environment = read(environ)
    return default if from_environment is None else from_environment


def read_pool_defaults(
    environ: Mapping[str, str],
    *,
    max_workers: int | None,
    task_peak: str | int | None,
    reserve: str | int | None,
    log_path: str | os.PathLike[str] | None,
    progress: bool | None,
    on_interrupt: object,
    max_retries: int | None = None,
    room_wait_s: float | None = None,
) -> PoolDefaults:
    """Fill the arguments left out (``None``) from ``environ``; a given one wins unread."""
    return PoolDefaults(
        max_workers=max_workers if max_workers is not None else read_max_workers(environ),
        task_peak=(
            task_peak
            if task_peak is not None
            else read_size(environ, TASK_PEAK_ENV, allow_zero=False)
        ),
        reserve=reserve
        if reserve is not None
        else read_size(environ, RESERVE_ENV, allow_zero=True),
        log_path=None if log_path is not None else read_log_path(environ),
        progress=progress if progress is not None else read_progress(environ),
        on_interrupt=(
            check_on_interrupt(on_interrupt)
            if on_interrupt is not None
            else (read_on_interrupt(environ) or "terminate")
        ),
        max_retries=_first(max_retries, read_max_retries, environ, DEFAULT_MAX_RETRIES),
        room_wait_s=_first(room_wait_s, read_room_wait_s, environ, DEFAULT_ROOM_WAIT_S),
    )
