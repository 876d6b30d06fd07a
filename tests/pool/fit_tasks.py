"""Module-level tasks for the fit-at-run tests (children import them by name).

A task (or a worker's initializer) leaves a marker file where the test can
count it, then holds its simulated bytes until a file appears: one the test
creates, or the markers of the tasks it runs beside. Each wait is bounded, so
a test that fails never leaves a worker waiting for ever.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from gpupool.testing import SimulatedOutOfMemory, hold

#: The longest any task or initializer waits for the test's file; a passing
#: test creates it within seconds.
WAIT_S = 60.0

#: How often a waiting child looks for the test's file.
POLL_S = 0.01


def wait_for_file(path: str | Path) -> None:
    """Return once ``path`` exists; raise ``TimeoutError`` after :data:`WAIT_S`."""
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT_S} s")
        time.sleep(POLL_S)


def mark(directory: str | Path, name: str) -> None:
    """Create the marker ``directory/name`` (the test counts markers)."""
    Path(directory, name).touch()


def boot(directory: str) -> None:
    """An initializer that loads slowly: say it is booting, then wait for ``directory/go``."""
    mark(directory, f"booting-{os.getpid()}")
    wait_for_file(Path(directory, "go"))


def count(directory: str | Path, *prefixes: str) -> int:
    """How many markers in ``directory`` start with one of ``prefixes``."""
    return sum(1 for name in os.listdir(directory) if name.startswith(prefixes))


def tried(directory: str | Path) -> set[int]:
    """The tasks that left ``holding-<i>`` or ``refused-<i>`` in ``directory``."""
    return {
        int(name.split("-")[1])
        for name in os.listdir(directory)
        if name.startswith(("holding-", "refused-"))
    }


def meet(i: int, size: str, directory: str, together: int, wait_s: float) -> int:
    """Hold ``size`` until ``together`` tasks have tried to allocate (markers ``holding-<i>``
    and ``refused-<i>``, counted over the whole run), or ``wait_s`` passed.

    Tasks that run at once allocate side by side whatever the order they reach
    the card in: one the card refuses leaves its marker and raises.
    """
    try:
        with hold(size):
            mark(directory, f"holding-{i}")
            deadline = time.monotonic() + wait_s
            while count(directory, "holding-", "refused-") < together:
                if time.monotonic() > deadline:
                    break
                time.sleep(POLL_S)
    except SimulatedOutOfMemory:
        mark(directory, f"refused-{i}")
        raise
    return i


def brief(i: int, size: str) -> int:
    """Hold ``size`` for a moment and return ``i``."""
    with hold(size):
        time.sleep(0.02)
    return i


def hold_until(i: int, size: str, directory: str, release: str) -> int:
    """Hold ``size``, leave the marker ``held-<i>-<device>``, and keep holding until
    ``directory/<release>`` exists."""
    with hold(size) as device:
        mark(directory, f"held-{i}-{device}")
        wait_for_file(Path(directory, release))
    return i


def two_step(i: int, first: str, second: str, directory: str) -> int:
    """Allocate in two steps: hold ``first`` (marker ``first-<i>``), wait for ``go``, then
    hold ``second`` as well (marker ``second-<i>``) until ``finish``."""
    with hold(first):
        mark(directory, f"first-{i}")
        wait_for_file(Path(directory, "go"))
        with hold(second):
            mark(directory, f"second-{i}")
            wait_for_file(Path(directory, "finish"))
    return i


def hold_or_refused(i: int, size: str, directory: str) -> int:
    """Hold ``size`` until ``directory/release``; leave ``holding-<i>`` once it is held, or
    ``refused-<i>`` when the card refused it (the out-of-memory still reaches the pool)."""
    try:
        with hold(size):
            mark(directory, f"holding-{i}")
            wait_for_file(Path(directory, "release"))
    except SimulatedOutOfMemory:
        mark(directory, f"refused-{i}")
        raise
    return i
