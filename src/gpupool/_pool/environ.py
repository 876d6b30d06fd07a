"""Pool defaults from the environment: the ``GPUPOOL_*`` variables.

Each reader takes the mapping the options are read from (``os.environ``, at construction,
never at import) and returns its variable's value, else its argument's default; a bad
value is refused with a message that names the variable and what to set it to. The
``LOKY_MAX_CPU_COUNT`` cap (:mod:`gpupool._sensors.host`) is re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, TypeVar

from gpupool._core.planner import DEFAULT_MAX_RETRIES, DEFAULT_ROOM_WAIT_S
from gpupool._core.policy import DEFAULT_RESERVE_BYTES
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
    "TASK_TIMEOUT_ENV",
    "OnInterrupt",
    "read_cpu_cap",
    "read_log_path",
    "read_max_retries",
    "read_max_workers",
    "read_on_interrupt",
    "read_progress",
    "read_reserve",
    "read_room_wait_s",
    "read_size",
    "read_task_peak",
    "read_task_timeout_s",
]

MAX_WORKERS_ENV = "GPUPOOL_MAX_WORKERS"
TASK_PEAK_ENV = "GPUPOOL_TASK_PEAK"
RESERVE_ENV = "GPUPOOL_RESERVE"
LOG_PATH_ENV = "GPUPOOL_LOG_PATH"
PROGRESS_ENV = "GPUPOOL_PROGRESS"
ON_INTERRUPT_ENV = "GPUPOOL_ON_INTERRUPT"
MAX_RETRIES_ENV = "GPUPOOL_MAX_RETRIES"
ROOM_WAIT_ENV = "GPUPOOL_ROOM_WAIT_S"
TASK_TIMEOUT_ENV = "GPUPOOL_TASK_TIMEOUT_S"

#: What leaving a ``with`` block by ``KeyboardInterrupt`` does (see ``on_interrupt=``).
OnInterrupt = Literal["terminate", "wait"]
INTERRUPT_CHOICES: tuple[OnInterrupt, ...] = ("terminate", "wait")

_N = TypeVar("_N", int, float)

_PROGRESS_WORDS: dict[str, bool | None] = {
    **dict.fromkeys(("1", "true", "yes", "on"), True),
    **dict.fromkeys(("0", "false", "no", "off"), False),
    "auto": None,
}


def _refuse(name: str, value: str, what: str) -> ConfigurationError:
    return ConfigurationError(f"{name}={value!r}: {what}; or unset {name} for the default.")


def _number(
    environ: Mapping[str, str], name: str, parse: Callable[[str], _N], least: _N, what: str
) -> _N | None:
    """Variable ``name`` read with ``parse`` (``None`` when unset), refused unless it is a finite
    number of at least ``least``."""
    value = environ.get(name)
    if value is None:
        return None
    try:
        number = parse(value)
    except ValueError:
        raise _refuse(name, value, what) from None
    if not number >= least or number == math.inf:  # NaN is never >= least
        raise _refuse(name, value, what)
    return number


def read_max_workers(environ: Mapping[str, str]) -> int | None:
    """``GPUPOOL_MAX_WORKERS``, the default for ``max_workers``, or ``None`` when unset."""
    what = "set it to a whole number of at least 1, such as 4"
    return _number(environ, MAX_WORKERS_ENV, int, 1, what)


def read_max_retries(environ: Mapping[str, str]) -> int:
    """``GPUPOOL_MAX_RETRIES``, the default for ``max_retries`` (0 or more), else 5."""
    what = "set it to a whole number of retries, 0 or more, such as 5"
    retries = _number(environ, MAX_RETRIES_ENV, int, 0, what)
    return DEFAULT_MAX_RETRIES if retries is None else retries


def read_room_wait_s(environ: Mapping[str, str]) -> float:
    """``GPUPOOL_ROOM_WAIT_S``, the default for ``room_wait_s`` in seconds, else 120."""
    what = "set it to a number of seconds, 0 or more, such as 120"
    seconds = _number(environ, ROOM_WAIT_ENV, float, 0.0, what)
    return DEFAULT_ROOM_WAIT_S if seconds is None else seconds


def read_task_timeout_s(environ: Mapping[str, str]) -> float | None:
    """``GPUPOOL_TASK_TIMEOUT_S``, every task's deadline in seconds unless ``options(timeout_s=)``
    gives its own, or ``None`` (no deadline) when unset."""
    value = environ.get(TASK_TIMEOUT_ENV)
    if value is None:
        return None
    what = "set it to a number of seconds above 0, such as 3600"
    try:
        seconds = float(value)
    except ValueError:
        raise _refuse(TASK_TIMEOUT_ENV, value, what) from None
    if not seconds > 0 or seconds == math.inf:  # NaN is never > 0
        raise _refuse(TASK_TIMEOUT_ENV, value, what)
    return seconds


def read_task_peak(environ: Mapping[str, str]) -> int | None:
    """``GPUPOOL_TASK_PEAK`` in bytes, the default for ``task_peak``, or ``None`` when unset."""
    return read_size(environ, TASK_PEAK_ENV, allow_zero=False)


def read_reserve(environ: Mapping[str, str]) -> int:
    """``GPUPOOL_RESERVE`` in bytes, the default for ``reserve``, else 256 MiB."""
    reserve = read_size(environ, RESERVE_ENV, allow_zero=True)
    return DEFAULT_RESERVE_BYTES if reserve is None else reserve


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


def read_on_interrupt(environ: Mapping[str, str]) -> OnInterrupt:
    """``GPUPOOL_ON_INTERRUPT``, the default for ``on_interrupt``, else ``"terminate"``."""
    value = environ.get(ON_INTERRUPT_ENV)
    if value is None:
        return "terminate"
    for choice in INTERRUPT_CHOICES:
        if value.strip().lower() == choice:
            return choice
    raise _refuse(ON_INTERRUPT_ENV, value, "set it to 'terminate' or 'wait'")
