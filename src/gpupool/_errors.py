"""The exception tree of gpupool (pure: imports nothing from the I/O layers).

::

    GpuPoolError
     +-- ConfigurationError (also ValueError)      a value given to gpupool is wrong
     |    +-- InvalidSizeError                     a byte size could not be parsed
     +-- SensorError                               a reading could not be taken
     |    +-- NoDriverError                        no NVIDIA driver or library: no device
     |    +-- DeviceUnreadableError                driver present, the reading failed
     +-- WidthError (also RuntimeError)            strict mode refused to narrow
     +-- DeviceOutOfMemoryError                    a task ran a card out of memory
     +-- TaskTimeoutError (also TimeoutError)      a task ran past its deadline (timeout_s)
     +-- WorkerLostError (also BrokenProcessPool)  a worker died while running a task
     |    +-- WorkerProtocolError                  it sent what is not its task's answer
     +-- InitializerError (also BrokenProcessPool) an initializer failed: the pool is broken

Configuration errors are also :class:`ValueError`, as CPython's are, so
existing ``except ValueError`` clauses keep working; a lost worker and a
failed initializer are a :class:`concurrent.futures.process.BrokenProcessPool`,
as the standard library and loky raise for a dead worker and a broken pool.
Those are defined in :mod:`gpupool._broken`, which builds on this module (their
base's module, :mod:`concurrent.futures.process`, is no import of a worker's);
``gpupool`` loads them on first use.

Every one of them pickles with its attributes (a task may raise one, and
it must reach the caller intact): ``GpuPoolError.__reduce__`` rebuilds
an instance without calling its ``__init__``, so keyword-only attributes
need no positional stand-in.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigurationError",
    "DeviceOutOfMemoryError",
    "DeviceUnreadableError",
    "GpuPoolError",
    "InvalidSizeError",
    "NoDriverError",
    "SensorError",
    "TaskTimeoutError",
    "WidthError",
]


class GpuPoolError(Exception):
    """Root of every error gpupool raises on its own account."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's own reduce calls ``type(self)(*self.args)``, which a
        # subclass with keyword-only attributes refuses: rebuild from the
        # args and the instance dict instead.
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(cls: type[GpuPoolError], args: tuple[Any, ...], state: dict[str, Any]) -> GpuPoolError:
    """Unpickle a gpupool exception: its args and attributes, without its ``__init__``."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class ConfigurationError(GpuPoolError, ValueError):
    """A value given to gpupool is wrong; the message names it and the fix."""


class InvalidSizeError(ConfigurationError):
    """A byte size could not be parsed.

    Attributes:
        value: the input exactly as given.
    """

    def __init__(self, message: str, *, value: object) -> None:
        super().__init__(message)
        self.value = value


class SensorError(GpuPoolError):
    """A reading could not be taken."""


class NoDriverError(SensorError):
    """No NVIDIA driver or management library: the host has no device for us."""


class DeviceUnreadableError(SensorError):
    """A driver is present but a device's reading failed (never read as empty)."""


class WidthError(GpuPoolError, RuntimeError):
    """Strict mode: the bound would narrow the pool below the width asked for.

    Attributes:
        decision: the decision record (a dict of terms) that would have narrowed.
    """

    def __init__(self, message: str, *, decision: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.decision = decision


class DeviceOutOfMemoryError(GpuPoolError):
    """A task ran its card out of memory and was not (or no longer) retried.

    Attributes:
        device: the device index the task ran on.
        ask_bytes: the ask the task was booked at.
        detail: the child's original error message.
    """

    def __init__(
        self,
        message: str,
        *,
        device: int | None = None,
        ask_bytes: int | None = None,
        detail: str = "",
    ) -> None:
        super().__init__(message)
        self.device = device
        self.ask_bytes = ask_bytes
        self.detail = detail


class TaskTimeoutError(GpuPoolError, TimeoutError):
    """A task ran past its deadline (``options(timeout_s=...)`` or
    ``GPUPOOL_TASK_TIMEOUT_S``): the pool ended its worker's process tree (SIGTERM, then
    SIGKILL after a grace) and replaced the worker; only this task failed.

    Attributes:
        task: the task, as the message names it (its key).
        timeout_s: the deadline it ran past, in seconds from its start.
        pid: the PID of the worker that ran it.
    """

    def __init__(
        self, message: str, *, task: str = "", timeout_s: float = 0.0, pid: int | None = None
    ) -> None:
        super().__init__(message)
        self.task = task
        self.timeout_s = timeout_s
        self.pid = pid
