"""Pool defaults from the environment: the ``GPUPOOL_*`` variables.

Each reader takes the mapping the options are read from (``os.environ``, at construction,
never at import) and returns its variable's value, else its argument's default; a bad
value is refused with a message that names the variable and what to set it to. The
``LOKY_MAX_CPU_COUNT`` cap (:mod:`gpupool._sensors.host`) is re-exported here.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, TypeVar

from gpupool._core.bound import MAX_WORKERS_LIMIT
from gpupool._core.planner import DEFAULT_MAX_RETRIES, DEFAULT_ROOM_WAIT_S
from gpupool._core.policy import DEFAULT_RESERVE_BYTES
from gpupool._core.units import parse_pool_size
from gpupool._errors import ConfigurationError
from gpupool._observe.log import check_log_path
from gpupool._sensors.host import CPU_CAP_ENV, read_cpu_cap

__all__ = [
    "CPU_CAP_ENV",
    "INTERRUPT_CHOICES",
    "KNOWN_VARIABLES",
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
    "mistyped_variables",
    "warn_mistyped_variables",
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

#: Every ``GPUPOOL_*`` variable gpupool reads: the pool defaults above, the simulated
#: host's ledger (``gpupool.testing``), the booking table's directory and the file of peaks
#: remembered between runs.
KNOWN_VARIABLES = (
    MAX_WORKERS_ENV,
    TASK_PEAK_ENV,
    RESERVE_ENV,
    LOG_PATH_ENV,
    PROGRESS_ENV,
    ON_INTERRUPT_ENV,
    MAX_RETRIES_ENV,
    ROOM_WAIT_ENV,
    TASK_TIMEOUT_ENV,
    "GPUPOOL_SIMULATOR",
    "GPUPOOL_BOOKINGS",
    "GPUPOOL_MEMORY",
)

#: How alike a set name and a real one must be (``difflib``'s ratio) to be taken for a typo.
_TYPO_RATIO = 0.8

#: The mistyped names warned of in this process (each once, however many pools it builds).
_warned_names: set[str] = set()

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
    what = f"set it to a whole number from 1 to {MAX_WORKERS_LIMIT}, such as 4"
    workers = _number(environ, MAX_WORKERS_ENV, int, 1, what)
    if workers is not None and workers > MAX_WORKERS_LIMIT:
        raise _refuse(MAX_WORKERS_ENV, environ[MAX_WORKERS_ENV], what)
    return workers


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


def mistyped_variables(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """The ``GPUPOOL_*`` names set in ``environ`` that gpupool does not read but that look
    like one it does (a letter or an underscore off, or lower case: ``GPUPOOL_MAXWORKERS``),
    each with the closest real name. A name like none of them (a script's own ``GPUPOOL_TEST_X``) is
    left alone."""
    found = []
    for name in sorted(environ):
        if not name.upper().startswith("GPUPOOL_") or name in KNOWN_VARIABLES:
            continue
        closest = _closest(name)
        if closest is not None:
            found.append((name, closest))
    return found


def _closest(name: str) -> str | None:
    """The real name ``name`` is most like, when it is alike enough to be its typo."""
    import difflib

    squashed = {known.replace("_", ""): known for known in KNOWN_VARIABLES}
    same_letters = squashed.get(name.upper().replace("_", ""))
    if same_letters is not None:
        return same_letters
    matches = difflib.get_close_matches(name.upper(), KNOWN_VARIABLES, n=1, cutoff=_TYPO_RATIO)
    return matches[0] if matches else None


def warn_mistyped_variables(environ: Mapping[str, str]) -> None:
    """A ``UserWarning`` for each name of :func:`mistyped_variables`, once per process: a
    mistyped variable is otherwise ignored without a word."""
    for name, closest in mistyped_variables(environ):
        if name in _warned_names:
            continue
        _warned_names.add(name)
        warnings.warn(
            f"{name} is set but gpupool reads no such variable; did you mean {closest}? "
            f"(rename it, or unset {name})",
            UserWarning,
            stacklevel=4,
        )
