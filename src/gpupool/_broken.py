"""The errors of :mod:`gpupool._errors` that are also a ``BrokenProcessPool``.

Apart so that importing :mod:`gpupool._errors` does not import
:mod:`concurrent.futures.process` (and with it :mod:`concurrent.futures`,
:mod:`logging`, :mod:`queue`): a worker process needs the other errors, not
these, and starts without them. ``gpupool._errors`` hands them out on first use.
"""

from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool

from gpupool._errors import GpuPoolError

__all__ = ["InitializerError", "WorkerLostError", "WorkerProtocolError"]


class WorkerLostError(GpuPoolError, BrokenProcessPool):
    """A worker process died while running a task; only that task fails.

    Attributes:
        exitcode: the worker's exit code (negative: killed by that signal).
        signal_name: e.g. ``"SIGKILL"`` when a signal ended it, else ``None``.
    """

    def __init__(
        self, message: str, *, exitcode: int | None = None, signal_name: str | None = None
    ) -> None:
        super().__init__(message)
        self.exitcode = exitcode
        self.signal_name = signal_name


class WorkerProtocolError(WorkerLostError):
    """A worker sent what is not the answer to the task it runs, so the pool killed it;
    only that task fails, and the worker is replaced.

    What came may be bytes that are not an answer, an answer from another
    process (a child the task forked, writing on the worker's socket), an
    answer about a task the worker was not running, or a second answer.

    Attributes:
        pid: the worker's PID.
        received: what arrived, as the pool saw it (its first bytes quoted).
        exitcode: the worker's exit code (the pool's SIGKILL: ``-9``).
        signal_name: ``"SIGKILL"`` when the pool's signal ended it, else ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        pid: int | None = None,
        received: str = "",
        exitcode: int | None = None,
        signal_name: str | None = None,
    ) -> None:
        super().__init__(message, exitcode=exitcode, signal_name=signal_name)
        self.pid = pid
        self.received = received


class InitializerError(GpuPoolError, BrokenProcessPool):
    """A worker's initializer raised, or its worker died before it was ready: the pool
    is broken, as the standard pool breaks when an initializer fails.

    Every pending task fails with it and ``submit`` raises it; no task is
    charged with the death as if it had run.

    Attributes:
        initializer: the initializer's name (``module.qualname``).
        exitcode: the worker's exit code (negative: killed by that signal);
            ``None`` when the initializer raised (the exception is the cause).
        signal_name: e.g. ``"SIGSEGV"`` when a signal ended the worker, else ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        initializer: str = "",
        exitcode: int | None = None,
        signal_name: str | None = None,
    ) -> None:
        super().__init__(message)
        self.initializer = initializer
        self.exitcode = exitcode
        self.signal_name = signal_name
