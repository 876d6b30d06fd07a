"""Task functions for the review regressions (children import them by name)."""

from __future__ import annotations

import time

from gpupool.testing import hold


def hold_after(i: int, size: str, delay_s: float, hold_s: float, linger_s: float = 0.0) -> int:
    """Wait, hold ``size`` for a while; on failure linger before the error leaves the task."""
    time.sleep(delay_s)
    try:
        with hold(size):
            time.sleep(hold_s)
    except Exception:
        time.sleep(linger_s)
        raise
    return i


def sleep_for(seconds: float) -> float:
    """Sleep, then return the seconds slept."""
    time.sleep(seconds)
    return seconds


class BadStrError(Exception):
    """An exception whose own ``__str__`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def raise_bad_str() -> None:
    """Raise an exception that cannot be turned into text."""
    raise BadStrError()


def ignore_sigterm_and_sleep(seconds: float) -> float:
    """Ignore SIGTERM, then sleep: only SIGKILL ends this task early."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(seconds)
    return seconds
