"""Module-level tasks for the failed-task pricing test (children import them by name)."""

from __future__ import annotations

import time

from gpupool.testing import hold


def early_fail_or_hold(i: int, fail: bool) -> int:
    """Raise at once (``fail``), or hold 1500 MiB for 0.8 s."""
    time.sleep(0.05)
    if fail:
        raise ValueError(f"bad input {i}")
    with hold("1500MiB"):
        time.sleep(0.8)
    return i
