"""Task functions for ``bench/packing.py``, in their own module so that every worker imports them.

The standard library's spawn workers and gpupool's loky workers both find a
function by its module name, so this module must be importable in the
children: ``bench/packing.py`` puts ``bench/`` on ``PYTHONPATH`` before it
starts any pool.
"""

from __future__ import annotations

import time

#: What a task that ran its card out of memory returns when the policy under
#: test has no recovery of its own (the baselines): the run goes on and the
#: task counts as lost.
OOM_MARKER = "simulated-out-of-memory"


#: The peak of :func:`entry_items` (context included): 1 GiB + 1.75 GiB per item.
ITEMS_BASE_BYTES = 1024**3
ITEM_BYTES = int(1.75 * 1024**3)
CONTEXT_BYTES = 300 * 1024**2


def spec(hold_bytes: int) -> str:
    """``hold_bytes`` as a fixed-width string: a task argument whose features (its length)
    say nothing about its peak, so that gpupool learns it from measurements alone."""
    return f"{hold_bytes:020d}"


def entry_items(
    i: int, items: list[int], sleep_s: float, device: int | None, catch: bool
) -> tuple[int, float, float] | str:
    """A task whose peak follows its first argument's length (1 GiB + 1.75 GiB per item,
    context included), which nobody tells the pool."""
    hold_bytes = ITEMS_BASE_BYTES + ITEM_BYTES * len(items) - CONTEXT_BYTES
    return entry(i, hold_bytes, sleep_s, device, catch)


def entry(
    i: int, hold_bytes: int | str, sleep_s: float, device: int | None, catch: bool
) -> tuple[int, float, float] | str:
    """One task: hold ``hold_bytes`` of simulated device memory for ``sleep_s`` (a
    :func:`spec` string, or an int).

    Returns ``(i * 7, start, end)``: the result the benchmark checks, and when
    the bytes were held (``time.time()``), from which it counts how many tasks
    really ran at once.

    ``device`` is the simulated card to allocate on (``None``: the card this
    process is pinned to, as gpupool pins its workers). With ``catch`` an
    out-of-memory is caught and :data:`OOM_MARKER` returned; without it the
    error propagates (gpupool classifies it and retries the task).
    """
    from gpupool.testing import SimulatedOutOfMemory, hold

    try:
        with hold(int(hold_bytes), device=device):
            start = time.time()
            time.sleep(sleep_s)
            end = time.time()
    except SimulatedOutOfMemory:
        if not catch:
            raise
        return OOM_MARKER
    return i * 7, start, end
