"""A task that raised is no sample of its key's peaks."""

from __future__ import annotations

import failing_tasks

import gpupool.testing as gt
from gpupool import GpuPoolExecutor


def test_tasks_that_raise_early_do_not_price_their_key_below_task_peak() -> None:
    """Five tasks of a key raise before allocating anything. Learned as peaks, their 0 B
    would price the key at 64 MiB (far below task_peak=2GiB), and the next twelve 1.5 GiB
    tasks would start eight at once on an 8 GiB card. They are not learned from: the key
    stays at its estimate, and the twelve run without an out-of-memory."""
    with gt.SimulatedHost([gt.SimulatedDevice("8GiB")], cpus=16, host_ram="64GiB") as host:
        with GpuPoolExecutor(max_workers=8, task_peak="2GiB") as ex:
            for future in [ex.submit(failing_tasks.early_fail_or_hold, i, True) for i in range(5)]:
                assert isinstance(future.exception(timeout=120), ValueError)
            futures = [ex.submit(failing_tasks.early_fail_or_hold, i, False) for i in range(12)]
            assert [f.result(timeout=120) for f in futures] == list(range(12))
        assert host.out_of_memory_events == []
