"""The child side of :mod:`gpupool.dask`: run one Dask task inside a pool child.

Kept apart from :mod:`gpupool.dask` so that a pool child unpickling the call
imports neither ``distributed`` nor the worker plugin: only ``dask`` itself,
which the task's own pickle needs anyway.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

__all__ = ["run_task"]


def run_task(
    task: Callable[[Mapping[str, Any]], Any], data: Mapping[str, Any]
) -> tuple[Any, float, float]:
    """Run a Dask task (a ``dask`` ``GraphNode``) on its dependencies' data.

    Exceptions propagate unchanged, so the pool classifies a device
    out-of-memory error in the child and retries the task at a narrower width;
    every other exception reaches the worker with its type.

    Args:
        task: the task's run spec, called as Dask's own worker calls it.
        data: the values of the task's dependencies, by key.

    Returns:
        The result, and the wall-clock start and stop of the call
        (``time.time()``), which Dask uses for its duration estimates.
    """
    start = time.time()
    result = task(data)
    return result, start, time.time()
