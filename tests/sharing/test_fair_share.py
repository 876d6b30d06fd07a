"""Pools sharing a card share it: a pool holds no more than its share while another waits."""

from __future__ import annotations

from gpupool._core import AskTable, Policy
from gpupool._core.bookings import OtherPools, PoolBooking, TaskBooking
from gpupool._core.events import Decision
from gpupool._core.planner import Planner, PlannerConfig, Start, Wait
from gpupool._core.units import GiB
from support import card_census, census_of

UUID = "GPU-00000000-1111-2222-3333-444444444444"


def _planner(records: list[Decision]) -> Planner:
    """A 40 GiB card, tasks estimated at 6.5 GiB, width 6, no reserve."""
    census = census_of(
        [card_census(total_bytes=40 * GiB, free_bytes=40 * GiB)],
        cpus=8,
        available_ram_bytes=64 * GiB,
    )
    asks = AskTable(policy=Policy(reserve_bytes=0), default_estimate_bytes=int(6.5 * GiB))
    config = PlannerConfig(max_workers=6, reserve_bytes=0, parent_pid=1)
    planner = Planner(census=census, asks=asks, config=config, emit=records.append)
    planner.construct(0.0)
    return planner


def _other(tasks: int, waiting: int) -> OtherPools:
    row = PoolBooking(
        pool_id="9.1",
        pid=9,
        start="s",
        label="other.py",
        updated_s=0.0,
        tasks=tuple(
            TaskBooking(worker_pid=900 + i, key="k", booked_bytes=int(6.5 * GiB), reached_bytes=0)
            for i in range(tasks)
        ),
        waiting=waiting,
    )
    return OtherPools(card_uuid=UUID, pools=(row,))


def _start_all(planner: Planner, now_s: float) -> list[Start]:
    started = []
    while isinstance(verdict := planner.next_start(now_s), Start):
        planner.started(verdict.task, verdict.device, 100 + verdict.task, now_s)
        started.append(verdict)
    return started


def test_a_pool_stops_at_its_share_while_another_waits_and_takes_the_rest_when_none_does():
    """Another pool runs one task and waits with more: this pool starts three (its share of
    (33.5 + 6.5) GiB between two pools is 20 GiB), records why, and takes the free room
    once the other pool waits no more."""
    records: list[Decision] = []
    planner = _planner(records)
    for task in range(10):
        planner.submit(task, "k")
    planner.observe_others(0, _other(tasks=1, waiting=11), 0.0)
    started = _start_all(planner, 0.0)
    assert len(started) == 3  # 3 x 6.5 = 19.5 GiB <= 20 GiB; a fourth would pass it
    held = [r for r in records if r.event == "share_wait"]
    assert len(held) == 1
    assert held[0].extra["share_bytes"] == 20 * GiB
    assert held[0].extra["pool_booked_bytes"] == int(19.5 * GiB)
    assert planner.counts["share_waits"] >= 1
    # The bound alone would admit two more beside the other pool's one task.
    assert planner.bound(0, planner.asks.ask("k")).room_bytes == int(33.5 * GiB)
    wait = planner.next_start(0.1)
    assert isinstance(wait, Wait) and wait.poll_s is not None  # it polls the table
    # The other pool waits no more (its tasks all started): the bound alone decides.
    planner.observe_others(0, _other(tasks=1, waiting=0), 0.2)
    assert len(_start_all(planner, 0.2)) == 2


def test_a_pool_without_a_running_task_may_always_start_one():
    """The share never stops a pool's first task on a card (each pool makes progress)."""
    records: list[Decision] = []
    planner = _planner(records)
    planner.submit(0, "k")
    # The other pool books five tasks and waits with more: the share would be 3.25 GiB.
    planner.observe_others(0, _other(tasks=5, waiting=7), 0.0)
    started = _start_all(planner, 0.0)
    assert [s.task for s in started] == [0]
    assert not [r for r in records if r.event == "share_wait"]


def test_with_no_other_pool_waiting_the_share_does_not_bind():
    """Another pool runs two tasks and waits for none: this pool takes what the bound admits."""
    records: list[Decision] = []
    planner = _planner(records)
    for task in range(10):
        planner.submit(task, "k")
    planner.observe_others(0, _other(tasks=2, waiting=0), 0.0)
    assert len(_start_all(planner, 0.0)) == 4  # (40 - 13) // 6.5
    assert not [r for r in records if r.event == "share_wait"]
