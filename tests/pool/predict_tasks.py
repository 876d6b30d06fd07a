"""Module-level tasks for the predicted-ask tests (children import them by name)."""

from __future__ import annotations

import time

from gpupool.testing import hold

GiB = 1024**3


def hold_items(i: int, items: list[int]) -> int:
    """Hold 1 GiB per item of ``items`` for 0.3 s (its context comes on top): the list's
    length predicts the peak, and nothing tells the pool so."""
    with hold(len(items) * GiB):
        time.sleep(0.3)
    return i


def hold_spec(i: int, spec: str) -> int:
    """Hold the bytes ``spec`` names (a fixed-width decimal string: its length says nothing)
    for 0.2 s."""
    with hold(int(spec)):
        time.sleep(0.2)
    return i
