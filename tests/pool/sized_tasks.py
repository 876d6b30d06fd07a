"""Module-level tasks for the sized-ask tests (children import them by name)."""

from __future__ import annotations

import time

from gpupool.testing import hold

GiB = 1024**3


def hold_for_size(i: int, size: float) -> int:
    """Hold 1 GiB per unit of input for 0.3 s (its context comes on top)."""
    with hold(int(size * GiB)):
        time.sleep(0.3)
    return i
