"""Pools sharing a card share it: a pool holds no more than its share while another waits."""

from __future__ import annotations

from pathlib import Path

import sharing_tasks

import gpupool.testing as gt
from gpupool import GpuPoolExecutor
from gpupool._core.bookings import OtherPools, PoolBooking, TaskBooking
from gpupool._core.events import Decision
from gpupool._core.planner import Planner, PlannerConfig, Wait
from gpupool._core.policy import AskTable, Policy
from gpupool._core.units import GiB
from gpupool._sensors.bookings import BookingTable
from support import card_census, census_of, start_all, wait_for

#: A safety net so that a broken test fails instead of hanging; never asserted on.
PATIENCE_S = 120.0

UUID = "GPU-00000000-1111-2222-3333-444444444444"


def _planner(records: list[Decision], estimate_bytes: int = int(6.5 * GiB)) -> Planner:
    """A 40 GiB card, tasks estimated at ``estimate_bytes`` (6.5 GiB), width 6, no reserve."""
    census = census_of(
        [card_census(total_bytes=40 * GiB, free_bytes=40 * GiB)],
        cpus=8,
        available_ram_bytes=64 * GiB,
    )
    asks = AskTable(policy=Policy(reserve_bytes=0), default_estimate_bytes=estimate_bytes)
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


def test_a_pool_stops_at_its_share_while_another_waits_and_takes_the_rest_when_none_does() -> None:
    """Another pool runs one task and waits with more: this pool starts three (its share of
    (33.5 + 6.5) GiB between two pools is 20 GiB), records why, and takes the free room
    once the other pool waits no more."""
    records: list[Decision] = []
    planner = _planner(records)
    for task in range(10):
        planner.submit(task, "k")
    planner.neighbours.observe_others(0, _other(tasks=1, waiting=11), 0.0)
    started = start_all(planner, 0.0)
    assert len(started) == 3  # 3 x 6.5 = 19.5 GiB <= 20 GiB; a fourth would pass it
    held = [r for r in records if r.event == "share_wait"]
    assert len(held) == 1
    assert held[0].extra["share_bytes"] == 20 * GiB
    assert held[0].extra["pool_booked_bytes"] == int(19.5 * GiB)
    assert planner.counts["share_waits"] >= 1
    # The bound alone would admit two more beside the other pool's one task.
    assert planner.views.bound(0, planner.state.asks.ask("k")).room_bytes == int(33.5 * GiB)
    wait = planner.next_start(0.1)
    assert isinstance(wait, Wait) and wait.poll_s is not None  # it polls the table
    # The other pool waits no more (its tasks all started): the bound alone decides.
    planner.neighbours.observe_others(0, _other(tasks=1, waiting=0), 0.2)
    assert len(start_all(planner, 0.2)) == 2


def test_a_pool_without_a_running_task_may_always_start_one() -> None:
    """The share never stops a pool's first task on a card (each pool makes progress)."""
    records: list[Decision] = []
    planner = _planner(records)
    planner.submit(0, "k")
    # The other pool books five tasks and waits with more: the share would be 3.25 GiB.
    planner.neighbours.observe_others(0, _other(tasks=5, waiting=7), 0.0)
    started = start_all(planner, 0.0)
    assert [s.task for s in started] == [0]
    assert not [r for r in records if r.event == "share_wait"]


def test_with_no_other_pool_waiting_the_share_does_not_bind() -> None:
    """Another pool runs two tasks and waits for none: this pool takes what the bound admits."""
    records: list[Decision] = []
    planner = _planner(records)
    for task in range(10):
        planner.submit(task, "k")
    planner.neighbours.observe_others(0, _other(tasks=2, waiting=0), 0.0)
    assert len(start_all(planner, 0.0)) == 4  # (40 - 13) // 6.5
    assert not [r for r in records if r.event == "share_wait"]


def test_a_pool_at_its_own_ceiling_is_not_waiting_for_room() -> None:
    """A pool held back by its own max_workers tells other pools nothing is waiting for room."""
    records: list[Decision] = []
    planner = _planner(records)
    for task in range(8):
        planner.submit(task, "k")
    assert planner.neighbours.waiting_count() == 6
    assert planner.neighbours.waiting_count(starting=True) == 5
    assert len(start_all(planner, 0.0)) == 6  # the bound and max_workers agree: 6
    assert isinstance(planner.next_start(0.1), Wait)
    assert len(planner.state.pending) == 2 and planner.neighbours.waiting_count() == 0


def test_the_share_rounds_to_the_nearest_task() -> None:
    """Two pools of 8 GiB tasks on 40 GiB, both waiting: the share is 20 GiB. Stopping at
    two tasks each (16 GiB) would leave 8 GiB idle; a start is admitted while the middle of
    its booking is within the share, so this pool takes a third and the card holds five."""
    records: list[Decision] = []
    planner = _planner(records, estimate_bytes=8 * GiB)
    for task in range(6):
        planner.submit(task, "k")
    row = PoolBooking(
        pool_id="9.1",
        pid=9,
        start="s",
        label="other.py",
        updated_s=0.0,
        tasks=tuple(
            TaskBooking(worker_pid=900 + i, key="k", booked_bytes=8 * GiB, reached_bytes=0)
            for i in range(2)
        ),
        waiting=4,
    )
    planner.neighbours.observe_others(0, OtherPools(card_uuid=UUID, pools=(row,)), 0.0)
    assert len(start_all(planner, 0.0)) == 3


def test_a_pool_tells_the_table_while_its_tasks_wait_for_room_and_stops_when_they_start(
    tmp_path: Path,
) -> None:
    """Real pools on one simulated card. Pool A holds 3 x 12 GiB; pool B (max_workers=2)
    finds no room for its three 12 GiB tasks, and its row says 2 wait (what its own
    ceiling would let start). Once A's tasks end, B runs two and its row says none waits:
    its ceiling holds the third, not the room."""
    gate_a, gate_b = tmp_path / "a", tmp_path / "b"
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")], cpus=8, host_ram="64GiB") as host:
        table = BookingTable(host.bookings_directory)
        uuid = host.device_uuid(0)

        def rows() -> tuple[PoolBooking, ...]:
            seen = table.others(uuid)
            assert seen is not None
            return seen.pools

        with (
            GpuPoolExecutor(4, task_peak="12GiB") as a,
            GpuPoolExecutor(2, task_peak="12GiB") as b,
        ):
            try:
                a_futures = [
                    a.submit(sharing_tasks.hold_until, i, "11GiB", str(gate_a)) for i in range(3)
                ]
                wait_for(
                    lambda: any(len(p.tasks) == 3 for p in rows()),
                    what="pool A's 3 tasks booked",
                )
                a_id = next(p.pool_id for p in rows() if len(p.tasks) == 3)

                def b_row() -> PoolBooking | None:
                    return next((p for p in rows() if p.pool_id != a_id), None)

                b_futures = [
                    b.submit(sharing_tasks.hold_until, i, "11GiB", str(gate_b)) for i in range(3)
                ]
                wait_for(
                    lambda: (row := b_row()) is not None and row.waiting == 2 and not row.tasks,
                    what="pool B's row saying two tasks wait for room",
                )
                gate_a.touch()
                assert [f.result(timeout=PATIENCE_S) for f in a_futures] == [0, 1, 2]
                wait_for(
                    lambda: (
                        (row := b_row()) is not None and len(row.tasks) == 2 and row.waiting == 0
                    ),
                    what="pool B running two tasks, its row saying none waits for room",
                )
                gate_b.touch()
                assert [f.result(timeout=PATIENCE_S) for f in b_futures] == [0, 1, 2]
            finally:
                gate_a.touch()
                gate_b.touch()


def test_idle_workers_go_while_a_waiting_pool_is_owed_room() -> None:
    """An idle worker's context is bytes on the card. While another pool waits for a 30 GiB
    task it is owed (it holds nothing; this pool runs 2 x 8 GiB, leaving 24 GiB), this pool
    keeps no worker beyond its running tasks; with no one waiting it keeps what fits."""
    records: list[Decision] = []
    planner = _planner(records, estimate_bytes=8 * GiB)
    for task in range(2):
        planner.submit(task, "k")
    assert len(start_all(planner, 0.0)) == 2
    assert planner.neighbours.warm_limit(0, 0.0) == 5  # 40 // 8
    waiting = PoolBooking(
        pool_id="9.1",
        pid=9,
        start="s",
        label="big.py",
        updated_s=0.0,
        waiting=1,
        need_bytes=30 * GiB,
    )
    planner.neighbours.observe_others(0, OtherPools(card_uuid=UUID, pools=(waiting,)), 0.1)
    assert planner.neighbours.warm_limit(0, 0.1) == 2
