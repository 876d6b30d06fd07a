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
