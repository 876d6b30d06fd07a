"""An out-of-memory caused by another pool that grew past its booking is named as such."""

from __future__ import annotations

import sharing_tasks as st

from gpupool import GpuPoolExecutor
from gpupool._core.attribution import analyse_oom
from gpupool.testing import SimulatedDevice, SimulatedHost


def test_an_oom_caused_by_another_pools_overrun_names_another_pool():
    """Pool A books 1 GiB and holds 10; pool B's 6 GiB task runs out: "another pool" grew."""
    with SimulatedHost([SimulatedDevice("16GiB")], cpus=8, host_ram="64GiB") as host:
        with (
            GpuPoolExecutor(max_workers=2, task_peak="1GiB") as a,
            GpuPoolExecutor(max_workers=2, task_peak="6GiB") as b,
        ):
            greedy = a.submit(st.delayed_hold, 0, "10GiB", 0.3, 1.5)
            victim = b.submit(st.delayed_hold, 1, "6GiB", 0.9, 0.1)
            assert greedy.result(timeout=60) == 0
            assert victim.result(timeout=60) == 1  # retried once A's task had ended
            records = [d.to_dict() for d in b.decisions if d.event == "out_of_memory"]
    assert host.out_of_memory_events, "B's task ran out beside A's overrun"
    assert records
    analysis = analyse_oom(records[0])
    assert analysis.verdict == "another_pool", analysis.explanation
    assert "another pool on the card grew" in analysis.explanation
    assert records[0]["retry"] is True
