"""A short task queued behind a run, in the planner: who may be queued, and what it books."""

from __future__ import annotations

import pytest

from gpupool._core.peak import PeakReport
from gpupool._core.planner import Planner, PlannerConfig, Start
from gpupool._core.planner.base import (
    LONG_MEMORY_TASKS,
    LONG_TASK_S,
    QUEUE_DEPTH,
    QUEUE_DEPTH_LEAST,
    QUEUED_WORK_S,
    SHORT_MIN_TASKS,
    SHORT_TASK_S,
)
from gpupool._core.policy import AskTable, Policy
from gpupool._core.units import GiB
from support import card_census, census_of

PARENT = 4242


def _planner() -> Planner:
    census = census_of(
        [card_census(total_bytes=16 * GiB, free_bytes=16 * GiB)],
        cpus=8,
        available_ram_bytes=64 * GiB,
    )
    asks = AskTable(policy=Policy(reserve_bytes=0), default_estimate_bytes=3 * GiB)
    config = PlannerConfig(max_workers=2, reserve_bytes=0, parent_pid=PARENT)
    planner = Planner(census=census, asks=asks, config=config, emit=lambda _r: None)
    planner.construct(0.0)
    return planner


def _report(peak_bytes: int) -> PeakReport:
    return PeakReport(device=0, device_peak_bytes=peak_bytes, device_source="simulator")


def _run(planner: Planner, task: int, key: str, now_s: float) -> Start:
    planner.submit(task, key)
    verdict = planner.next_start(now_s)
    assert isinstance(verdict, Start) and verdict.task == task
    planner.started(task, verdict.device, 100 + task, now_s)
    return verdict


def _timed(planner: Planner, key: str, took_s: float) -> None:
    """``SHORT_MIN_TASKS`` tasks of ``key`` that each took ``took_s``."""
    for task in range(SHORT_MIN_TASKS):
        _run(planner, 1000 + task, key, 0.0)
        planner.finished(1000 + task, _report(GiB), took_s)


@pytest.mark.parametrize(
    ("mean_s", "depth"),
    [
        (0.0001, QUEUE_DEPTH),
        (QUEUED_WORK_S / QUEUE_DEPTH, QUEUE_DEPTH),
        (QUEUED_WORK_S / 4, 4),
        (QUEUED_WORK_S / 3, 3),
        (QUEUED_WORK_S / 2, 2),
        (QUEUED_WORK_S * 0.9, QUEUE_DEPTH_LEAST),
    ],
)
def test_as_many_wait_behind_a_run_as_the_keys_mean_run_time_fits(
    mean_s: float, depth: int
) -> None:
    """Tasks of a few milliseconds queue deeper than tasks of tens (the last queued waits
    about ``QUEUED_WORK_S``), never fewer than ``QUEUE_DEPTH_LEAST``; so many are queued."""
    planner = _planner()
    _timed(planner, "k", mean_s)
    assert planner.durations.queue_depth("k") == depth
    _run(planner, 1, "k", 1.0)
    for task in range(2, 2 + QUEUE_DEPTH + 2):
        planner.submit(task, "k")
    queued = [planner.queue_behind(1) for _ in range(QUEUE_DEPTH + 2)]
    assert queued == [*range(2, 2 + depth), *[None] * (QUEUE_DEPTH + 2 - depth)]


def test_the_queues_head_of_a_short_key_is_queued_in_the_runs_booking() -> None:
    planner = _planner()
    _timed(planner, "k", SHORT_TASK_S / 2)
    run = _run(planner, 1, "k", 1.0)
    for task in (2, 3, 4):
        planner.submit(task, "k")
    assert planner.durations.queue_depth("k") == 2
    assert planner.queue_behind(1) == 2
    assert planner.queue_behind(1) == 3
    assert planner.queue_behind(1) is None  # queue_depth behind each run
    assert list(planner.state.pending) == [4]
    assert planner.queue.queued == {2: 1, 3: 1}
    booked = sum(r.booked_bytes for r in planner.state.running.values())
    planner.finished(1, _report(GiB), 1.001)
    planner.run_queued(2, run.device, 101, 1.001)
    assert list(planner.state.running) == [2]
    assert planner.state.running[2].pid == 101
    assert (
        sum(r.booked_bytes for r in planner.state.running.values()) == booked
    )  # its run's booking
    assert planner.queue.queued == {3: 2}  # the one behind follows the new run
    assert planner.queue_behind(2) == 4  # room behind the new run for one more
    planner.finished(2, _report(GiB), 1.002)
    planner.run_queued(3, run.device, 101, 1.002)
    planner.finished(3, _report(GiB), 1.003)
    planner.run_queued(4, run.device, 101, 1.003)
    assert planner.queue.queued == {} and list(planner.state.running) == [4]


def test_a_long_key_another_key_or_a_larger_ask_is_not_queued() -> None:
    planner = _planner()
    _timed(planner, "long", SHORT_TASK_S * 2)
    _run(planner, 1, "long", 1.0)
    planner.submit(2, "long")
    assert planner.queue_behind(1) is None  # not short
    planner = _planner()
    _timed(planner, "k", 0.0)
    _run(planner, 1, "k", 1.0)
    planner.submit(2, "other")
    planner.submit(3, "k")
    assert planner.queue_behind(1) is None  # the head is of another key; no scan past it
    planner = _planner()
    _timed(planner, "k", 0.0)
    _run(planner, 1, "k", 1.0)
    planner.state.asks.floor("k", 5 * GiB)  # priced above the run's booking now
    planner.submit(2, "k")
    assert planner.queue_behind(1) is None


def test_a_task_queued_behind_a_lost_run_goes_back_to_the_head() -> None:
    planner = _planner()
    _timed(planner, "k", 0.0)
    _run(planner, 1, "k", 1.0)
    for task in (2, 3, 4):
        planner.submit(task, "k")
    assert planner.queue_behind(1) == 2
    assert planner.queue_behind(1) == 3
    planner.lost(1, 1.5, message="worker lost", extra={})
    planner.requeue(2)  # told in their queue order (a worker's lost queue, or its declines)
    planner.requeue(3)
    assert list(planner.state.pending) == [2, 3, 4]  # back at the head, in their order
    assert planner.queue.queued == {}
    assert planner.neighbours.waiting_count() == 2


def test_a_queued_task_failed_or_withdrawn_leaves_no_trace() -> None:
    planner = _planner()
    _timed(planner, "k", 0.0)
    _run(planner, 1, "k", 1.0)
    planner.submit(2, "k")
    assert planner.queue_behind(1) == 2
    planner.withdraw(2)
    assert planner.queue.queued == {} and 2 not in planner.state.tasks
    planner.submit(3, "k")
    assert planner.queue_behind(1) == 3  # the run may take another
    planner.finished(3, None, 1.2, failed=True)
    assert planner.queue.queued == {} and 3 not in planner.state.tasks


def test_a_short_key_with_a_long_task_among_its_last_is_not_queued() -> None:
    """Many short tasks keep a key's mean low; one long task among its last stops queueing
    behind its runs (a long task would wait behind a long one) until enough ended after it."""
    planner = _planner()
    for task in range(100):
        _run(planner, 1000 + task, "k", 0.0)
        planner.finished(1000 + task, _report(GiB), 0.001)
    _run(planner, 1, "k", 1.0)
    planner.finished(1, _report(GiB), 1.0 + LONG_TASK_S)
    assert planner.durations.short("k") is False  # the mean is still far under SHORT_TASK_S
    _run(planner, 2, "k", 2.0)
    planner.submit(3, "k")
    assert planner.queue_behind(2) is None
    planner.withdraw(3)
    planner.finished(2, _report(GiB), 2.001)
    for task in range(LONG_MEMORY_TASKS - 1):
        assert not planner.durations.short("k")
        _run(planner, 10 + task, "k", 3.0)
        planner.finished(10 + task, _report(GiB), 3.001)
    assert planner.durations.short("k")
    _run(planner, 4, "k", 4.0)
    planner.submit(5, "k")
    assert planner.queue_behind(4) == 5


def test_tasks_sent_back_from_two_runs_told_in_turn_keep_each_runs_order() -> None:
    """Two workers' queues go back at once (one worker's declines are read between another's):
    the tasks queued behind each run keep their order, whatever is told between them."""
    planner = _planner()
    _timed(planner, "k", 0.0)
    _run(planner, 1, "k", 1.0)
    _run(planner, 5, "k", 1.0)
    for task in (2, 3, 6, 7, 8):
        planner.submit(task, "k")
    assert [planner.queue_behind(1), planner.queue_behind(1)] == [2, 3]
    assert [planner.queue_behind(5), planner.queue_behind(5)] == [6, 7]
    planner.lost(1, 1.5, message="worker lost", extra={})
    planner.lost(5, 1.5, message="worker lost", extra={})
    for task in (2, 6, 3, 7):  # each run's in their queue order, the runs' in turn
        planner.requeue(task)
    pending = list(planner.state.pending)
    assert pending.index(2) < pending.index(3) and pending.index(6) < pending.index(7)
    assert pending[-1] == 8 and planner.queue.queued == {}


def test_a_key_whose_tasks_grow_slower_stops_queueing_deep_behind_them() -> None:
    """Many tasks of a millisecond, then tasks of 50 ms (under ``LONG_TASK_S``, so none is
    remembered as long): after ``LONG_MEMORY_TASKS`` of them the key is no longer short, and
    while it still is, no more of them wait behind a run than fit in ``QUEUED_WORK_S``
    (``QUEUE_DEPTH_LEAST`` at least); a mean over all its tasks would keep queueing 8 deep."""
    planner = _planner()
    for task in range(200):
        _run(planner, 1000 + task, "k", 0.0)
        planner.finished(1000 + task, _report(GiB), 0.001)
    assert planner.durations.queue_depth("k") == QUEUE_DEPTH
    slow_s = 0.05
    assert slow_s < LONG_TASK_S
    for task in range(LONG_MEMORY_TASKS):
        _run(planner, 2000 + task, "k", 1.0)
        planner.finished(2000 + task, _report(GiB), 1.0 + slow_s)
        assert planner.durations.queue_depth("k") <= max(
            QUEUE_DEPTH_LEAST, int(QUEUED_WORK_S / slow_s)
        )
    assert planner.durations.short("k") is False
    _run(planner, 1, "k", 2.0)
    planner.submit(2, "k")
    assert planner.queue_behind(1) is None


def test_no_task_is_queued_behind_a_run_whose_card_its_risen_price_overbooks() -> None:
    """Two runs of a short key share a 16 GiB card; one ends with a peak that prices the key
    past half the card. A start in the ended run's place is held back by the bound, and so
    is a task queued behind either run (it would keep both running, booked past the card)."""
    planner = _planner()
    _timed(planner, "k", 0.001)
    planner.settle(0.0)
    run = _run(planner, 1, "k", 1.0)
    _run(planner, 2, "k", 1.0)
    for task in range(3, 8):
        planner.submit(task, "k")
    assert planner.queue_behind(1) == 3  # priced low: queued in its run's booking
    planner.finished(1, _report(int(7.5 * GiB)), 1.001)
    planner.run_queued(3, run.device, 101, 1.001)
    planner.settle(1.001)
    ask_bytes = planner.state.asks.ask("k").ask_bytes
    assert 2 * ask_bytes > 16 * GiB  # two no longer fit
    assert planner.queue_behind(2) is None
    assert planner.queue_behind(3) is None
    assert (
        planner.queue.queued == {} and planner.state.pending[0] == 4
    )  # it waits for a checked start
