"""Task functions for the overhead and card benchmarks, in a module every worker imports.

The functions live here, not in the scripts' ``__main__``, so that every
executor finds them by module name alike (the standard library's spawn and
forkserver workers, loky's, gpupool's) and none pays for sending a function
by value. The scripts put ``bench/`` on ``PYTHONPATH`` before they start any
pool.
"""

from __future__ import annotations

import time

#: What a baseline task that ran its card out of memory returns: the run goes on
#: and the task counts as lost.
OOM_MARKER = "simulated-out-of-memory"


def noop(x: int) -> int:
    """Nothing: the figure is the executor's own cost."""
    return x


def echo(payload: bytes) -> bytes:
    """Return the argument: a payload crosses both ways."""
    return payload


def hold_for(i: int, size: int | str, hold_s: float, catch: bool) -> tuple[int, float, float] | str:
    """Hold ``size`` (bytes or ``"1GiB"``) of a simulated card for ``hold_s``: a short GPU task.

    Returns ``(i, start, end)`` in ``time.time()`` seconds (when the bytes were
    held). With ``catch`` a simulated out-of-memory is caught and
    :data:`OOM_MARKER` returned (for executors with no recovery of their own);
    without it the error propagates (gpupool classifies it and retries).
    """
    from gpupool.testing import SimulatedOutOfMemory, hold

    try:
        with hold(size):
            start = time.time()
            time.sleep(hold_s)
            end = time.time()
    except SimulatedOutOfMemory:
        if not catch:
            raise
        return OOM_MARKER
    return i, start, end


def spread(i: int, peaks_bytes: tuple[int, ...], hold_s: float) -> tuple[int, float, float]:
    """One task of a key whose peak depends on its input: ``peaks_bytes[i % len]``, held ``hold_s``.

    Returns ``(i, start, end)``: ``start`` is taken on entry, before the
    allocation, so that submit-to-start counts the pool's wait only.
    """
    from gpupool.testing import hold

    start = time.time()
    with hold(peaks_bytes[i % len(peaks_bytes)]):
        time.sleep(hold_s)
    return i, start, time.time()
