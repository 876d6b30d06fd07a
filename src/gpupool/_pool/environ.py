"""Pool defaults from the environment: the ``GPUPOOL_*`` variables.

``LOKY_MAX_CPU_COUNT`` caps the host's CPUs where the census is taken
(:func:`gpupool._sensors.host.cap_host_cpus`, shared with ``gpupool census``);
its name and reader are re-exported here.

Each reader takes the mapping the pool's options are read from (``os.environ``, at
construction, never at import) and returns its variable's value, or ``None`` when it is
unset. :func:`gpupool._pool.options.read_options` calls a reader only for an argument
left out: an argument given to the constructor, then its variable, then the built-in
default. A bad value is refused with a :class:`ConfigurationError` that names the
variable and what to set it to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from gpupool._core.units import parse_pool_size
from gpupool._errors import ConfigurationError
from gpupool._log import check_log_path
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
