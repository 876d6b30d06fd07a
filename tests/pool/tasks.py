"""Module-level task functions for the pool tests (children import them by name)."""

from __future__ import annotations

import os
import signal
import time

from gpupool.testing import hold

ENTRY_PEAK = "6.02GiB"


def entry(i: int, hold_s: float = 0.3) -> int:
    """The incident's entry child: hold 6.02 GiB for a short while."""
    with hold(ENTRY_PEAK):
        time.sleep(hold_s)
    return i * i


def sized(i: int, size: str, hold_s: float = 0.2) -> int:
    """Hold ``size`` for a short while."""
    with hold(size):
        time.sleep(hold_s)
    return i


def where(i: int, size: str = "1GiB", hold_s: float = 0.2) -> tuple[int, str]:
    """Hold ``size``, and say which device this worker is pinned to."""
    with hold(size):
        time.sleep(hold_s)
    return i, os.environ.get("CUDA_VISIBLE_DEVICES", "")


def kill_self_on(i: int, victim: int) -> int:
    """SIGKILL this worker when ``i == victim``; otherwise return ``i``."""
    if i == victim:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
    return i


def pid_of(_: object = None) -> int:
    """This worker's PID."""
    return os.getpid()


def fail(message: str) -> None:
    """Raise ValueError(message)."""
    raise ValueError(message)


def sleep_return(value: int, seconds: float) -> int:
    """Sleep, then return ``value``."""
    time.sleep(seconds)
    return value


def touch_and_sleep(path: str, seconds: float) -> None:
    """Create ``path`` (the task runs in its worker now), then sleep."""
    with open(path, "w"):
        pass
    time.sleep(seconds)


def touch_and_wait(path: str, release: str, value: int = 0) -> int:
    """Create ``path`` (the task runs in its worker now), wait until ``release`` exists (at most
    10 minutes), then return ``value``."""
    with open(path, "w"):
        pass
    deadline = time.monotonic() + 600.0
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


class Token:
    """A picklable object a test can hold a weak reference to."""


def init_with(*args: object) -> None:
    """An initializer that takes any initargs and keeps none of them."""


_initialized: list[str] = []


def init_marker(tag: str) -> None:
    """An initializer: remember ``tag`` in this worker."""
    _initialized.append(tag)
    os.environ["GPUPOOL_TEST_INIT"] = tag


def read_marker(_: object = None) -> str:
    """What the initializer left in this worker."""
    return os.environ.get("GPUPOOL_TEST_INIT", "")


def environ(_: object = None) -> dict[str, str]:
    """This worker's environment."""
    return dict(os.environ)
