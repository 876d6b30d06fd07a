"""A blocked head lets other keys start past it, but only a ceiling's worth of times."""

from __future__ import annotations

from gpupool._core.events import Decision
from gpupool._core.peak import PeakReport
from gpupool._core.planner import Planner, PlannerConfig, Start, Wait
from gpupool._core.policy import AskTable, Policy
from gpupool._core.units import GiB
from support import card_census, census_of


def test_small_tasks_pass_a_blocked_large_head_a_bounded_number_of_times():
    """A 20 GiB head waits for room; 1 GiB tasks behind it start, at most max_workers times in a
    row, then the head's room is kept: it starts once the running tasks end."""
    records: list[Decision] = []
    census = census_of([card_census(total_bytes=24 * GiB, free_bytes=24 * GiB)])
    asks = AskTable(policy=Policy(reserve_bytes=0), default_estimate_bytes=GiB)
    asks.hint("large", 20 * GiB)
    config = PlannerConfig(max_workers=4, reserve_bytes=0)
    planner = Planner(census=census, asks=asks, config=config, emit=records.append)
    planner.construct(0.0)
    planner.submit(0, "small")
    first = planner.next_start(0.0)
    assert isinstance(first, Start)
    planner.started(0, 0, 100, 0.0)
    planner.submit(1, "large")  # 20 GiB fits beside the running 1 GiB task
    for task in range(2, 12):
        planner.submit(task, "small")
    started = []
    pid = 101
    while True:
        verdict = planner.next_start(0.1)
        if not isinstance(verdict, Start):
            break
        planner.started(verdict.task, verdict.device, pid, 0.1)
        pid += 1
        started.append(verdict.task)
    # The large task started first (it fit beside one small), then the ceiling held.
    assert started[0] == 1
    assert len(started) <= config.max_workers - 1
    # Now block the head: finish the large task; a new large head arrives while smalls run.
    report = PeakReport(device=0, device_peak_bytes=20 * GiB, device_source="simulator")
    planner.finished(1, report, 0.2)
    planner.submit(50, "large")
    planner.state.pending.rotate(1)  # the new large task to the head of the queue
    assert planner.state.pending[0] == 50
    skipped = 0
    while True:
        verdict = planner.next_start(0.3)
        if not isinstance(verdict, Start):
            assert isinstance(verdict, Wait)
            break
        assert verdict.task != 50
        planner.started(verdict.task, verdict.device, pid, 0.3)
        pid += 1
        skipped += 1
        done = next(t for t in planner.state.running if t != verdict.task)
        planner.finished(done, None, 0.3)
    assert 1 <= skipped <= config.max_workers
