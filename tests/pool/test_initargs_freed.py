"""An executor's initargs die with it: no reference cycle keeps them (and what they hold, such
as semaphores) alive after ``shutdown()`` and ``del`` until a garbage-collection pass.

The cycle was the dispatcher's planner holding a bound method of the dispatcher."""

from __future__ import annotations

import gc
import weakref

import tasks

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost


def test_initargs_are_freed_at_del_without_a_gc_pass() -> None:
    """After shutdown() and del, a weak reference to an initarg is dead with the collector off."""
    with SimulatedHost([SimulatedDevice("10GiB")], cpus=2, host_ram="8GiB"):
        gc.collect()
        gc.disable()
        try:
            token = tasks.Token()
            ref = weakref.ref(token)
            ex = GpuPoolExecutor(
                max_workers=1, task_peak="1GiB", initializer=tasks.init_with, initargs=(token,)
            )
            assert ex.submit(abs, -1).result(timeout=60) == 1
            ex.shutdown()
            del ex, token
            alive = ref() is not None
        finally:
            gc.enable()
    assert not alive, "the initargs outlived the executor: a reference cycle holds them"
