"""Module-level tasks for the sharing tests (children import them by name)."""

from __future__ import annotations

import time

from gpupool.testing import hold


def delayed_hold(i: int, size: str, delay_s: float, hold_s: float) -> int:
    """Wait ``delay_s``, then hold ``size`` for ``hold_s``."""
    time.sleep(delay_s)
    with hold(size):
        time.sleep(hold_s)
    return i


def hold_until(i: int, size: str, gate: str, patience_s: float = 120.0) -> int:
    """Hold ``size`` until the file ``gate`` exists (``patience_s`` is a safety net only)."""
    import os

    with hold(size):
        deadline = time.monotonic() + patience_s
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
    return i
