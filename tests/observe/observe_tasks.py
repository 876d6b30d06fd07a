"""Module-level task functions for the observe tests (children import them by name)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from gpupool.testing import hold

#: How long a staged task waits for its go signal before going on regardless.
GATE_TIMEOUT_S = 30.0


def entry(i: int, size: str = "6.02GiB", hold_s: float = 0.1) -> int:
    """Hold ``size`` briefly, as the incident's entry children did."""
    with hold(size):
        time.sleep(hold_s)
    return i


def staged(i: int, first: str, second: str, gate: str) -> int:
    """Hold ``first``, say so, wait for ``gate/go``, then hold ``second`` more.

    The parent changes the card between the two stages (a co-tenant grows, or
    the parent itself holds more), so the second allocation meets a card the
    pool priced before the change.
    """
    gate_dir = Path(gate)
    with hold(first):
        (gate_dir / f"ready-{os.getpid()}-{i}").touch()
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not (gate_dir / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        with hold(second):
            time.sleep(0.05)
    return i


def entry_together(i: int, gate: str, together: int, size: str = "6.02GiB") -> int:
    """Wait until ``together`` tasks have started (or ``GATE_TIMEOUT_S``), then hold ``size``.

    The first tasks of a run then overlap on the card whatever the machine's
    load: under load a worker may start after its neighbour has finished.
    """
    gate_dir = Path(gate)
    (gate_dir / f"started-{i}").touch()
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while len(list(gate_dir.glob("started-*"))) < together and time.monotonic() < deadline:
        time.sleep(0.01)
    with hold(size):
        time.sleep(0.1)
    return i


def entry_or_oom(i: int, victim: int, size: str = "64GiB") -> int:
    """Hold 0.25 GiB briefly; entry ``victim`` asks ``size``, more than the card holds."""
    with hold(size if i == victim else "0.25GiB"):
        time.sleep(0.01)
    return i


def entry_or_die(i: int, victim: int) -> int:
    """Return ``i``; entry ``victim`` kills its worker (SIGKILL) instead."""
    if i == victim:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    return i


def hold_until(i: int, size: str, gate: str) -> int:
    """Hold ``size`` until ``gate/release`` appears (or ``GATE_TIMEOUT_S``)."""
    release = Path(gate) / "release"
    with hold(size):
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return i
