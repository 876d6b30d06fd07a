"""The fair share between pools never starves one: two planners read each other's rows."""

from __future__ import annotations

from gpupool._core.bookings import OtherPools, PoolBooking, TaskBooking
from gpupool._core.events import Decision
from gpupool._core.peak import PeakReport
from gpupool._core.planner import Planner, PlannerConfig, Start
from gpupool._core.planner.sharing import YIELD_S
from gpupool._core.policy import AskTable, Policy
from gpupool._core.units import GiB
from support import card_census, census_of, other_pools, start_all

UUID = "GPU-00000000-1111-2222-3333-444444444444"


def _planner(estimate: int, max_workers: int, pid: int) -> Planner:
    census = census_of(
        [card_census(total_bytes=40 * GiB, free_bytes=40 * GiB)],
        cpus=16,
        available_ram_bytes=128 * GiB,
    )
    asks = AskTable(policy=Policy(reserve_bytes=0), default_estimate_bytes=estimate)
    config = PlannerConfig(max_workers=max_workers, reserve_bytes=0, parent_pid=pid)
    records: list[Decision] = []
    planner = Planner(census=census, asks=asks, config=config, emit=records.append)
    planner.construct(0.0)
    return planner


def _row(planner: Planner, pid: int) -> OtherPools:
    return other_pools(planner, pid, UUID)


def _exchange(a: Planner, b: Planner, now_s: float) -> None:
    a.neighbours.observe_others(0, _row(b, 2), now_s)
    b.neighbours.observe_others(0, _row(a, 1), now_s)


def _starved(a_task: int, b_task: int) -> int:
    """Pool A (many a_task tasks) runs first; pool B (two b_task tasks) arrives and waits.
    A's tasks end one at a time, each time both pools start what they may.
    Returns how many tasks B started while A still had tasks to run."""
    a = _planner(a_task, 8, 1)
    b = _planner(b_task, 2, 2)
    for t in range(30):
        a.submit(t, "a")
    len(start_all(a, 0.0, 1000))  # alone: A takes what the bound admits
    for t in range(2):
        b.submit(t, "b")
    now = 0.0
    b_started = 0
    for _ in range(20):
        now += 1.0
        _exchange(a, b, now)
        b_started += len(start_all(b, now, 2000))
        if not a.state.running:
            break
        # A hears of its own task's end first and refills at once (same process);
        # B hears of the room only at its next exchange.
        oldest = next(iter(a.state.running))
        a.finished(oldest, None, now)
        _exchange(a, b, now)
        len(start_all(a, now, 1000))
    return b_started


def test_a_pool_whose_task_is_a_share_rounded_away_is_not_starved() -> None:
    """A's 8 GiB tasks: the share of 40 GiB is 20 GiB, and rounding to the nearest task would
    let A hold 3 (24 GiB), leaving B's 20 GiB task no room while A refills. B is owed the
    room for its next task: A stops at 2 and B runs while A still has tasks."""
    assert _starved(8 * GiB, 20 * GiB) >= 1


def test_a_pool_whose_task_is_larger_than_its_share_is_not_starved() -> None:
    """B's one task (25 GiB) is more than its equal share (20 GiB). Were A to keep at its
    share (about 20 GiB of 4 GiB tasks), B would never run while A has tasks; A leaves B the
    room it is owed, and B runs while A still has tasks."""
    assert _starved(4 * GiB, 25 * GiB) >= 1


def test_control_a_task_within_the_share_is_admitted() -> None:
    """Control: B's task (16 GiB) fits beside A's share: B runs while A has tasks left."""
    assert _starved(8 * GiB, 16 * GiB) >= 1


def test_a_pool_that_cannot_start_is_not_counted_as_waiting_for_room() -> None:
    """Pool B ran out of memory beside its own task (its card cap is now 1): it runs one task
    at a time for the rest of its run, so none of its tasks waits for room, and it tells the
    table so (pool A is not held at a share B cannot use)."""
    b = _planner(4 * GiB, 2, 2)
    for t in range(10):
        b.submit(t, "b")
    assert len(start_all(b, 0.0, 2000)) == 2
    first = next(iter(b.state.running))
    report = PeakReport(
        device=0,
        device_peak_bytes=3 * GiB,
        device_source="simulator",
        oom=True,
        oom_requested_bytes=256 * 2**20,
    )
    b.out_of_memory(first, report, None, 0.1, error="CUDA out of memory")
    while len(b.state.running) > 1:  # its other tasks end
        b.finished(next(iter(b.state.running)), None, 0.2)
    assert b.state.cards[0].cap.oom_cap == 1
    assert len(start_all(b, 0.3, 2000)) == 0  # B can start nothing more while one runs
    assert b.neighbours.waiting_count() == 0 and b.neighbours.need_bytes() == 0


def test_a_pool_whose_task_needs_the_card_gets_its_turn_while_the_other_has_tasks() -> None:
    """B's one task (36 GiB of a 40 GiB card) fits beside none of A's 8 GiB tasks: A stops
    starting while B waits, but its one task of its own used to start again each time its
    last ended, so B ran only once A was out of tasks. A yields (holds even that start)
    to B, a pool at the serial floor that came to wait before A ran nothing: B runs while
    A still has tasks."""
    assert _starved(8 * GiB, 36 * GiB) >= 1


def _idle_pair(now_s: float) -> tuple[Planner, Planner]:
    """A (8 GiB tasks, nothing running yet) and B (one 36 GiB task, waiting) on a 40 GiB card
    another pool's 8 GiB task holds, each having read the other's row at ``now_s``."""
    a = _planner(8 * GiB, 8, 1)
    b = _planner(36 * GiB, 2, 2)
    for t in range(5):
        a.submit(t, "a")
    b.submit(0, "b")
    held = OtherPools(
        card_uuid=UUID,
        pools=(
            PoolBooking(
                pool_id="3.1",
                pid=3,
                start="s",
                label="pool3",
                updated_s=0.0,
                tasks=(TaskBooking(worker_pid=30, key="c", booked_bytes=8 * GiB, reached_bytes=0),),
            ),
        ),
    )
    b.neighbours.observe_others(0, held, now_s)
    assert not isinstance(b.next_start(now_s), Start)  # B waits: 36 GiB beside the 8 GiB
    a.neighbours.observe_others(0, _row(b, 2), now_s)
    return a, b


def test_the_yield_to_a_pool_at_the_serial_floor_is_bounded() -> None:
    """A, running nothing on the card, yields to B (waiting there since before A ran
    nothing) with a share_wait record naming B, for at most YIELD_S from when it first saw
    B wait; then A starts as the bound lets it."""
    a, _b = _idle_pair(0.0)
    a.state.cards[0].turns.idle_since_s = 5.0  # A last ran something here after B came to wait
    assert not isinstance(a.next_start(6.0), Start)
    assert a.counts["share_waits"] >= 1
    assert isinstance(a.next_start(0.0 + YIELD_S), Start)


def test_two_pools_at_the_serial_floor_do_not_yield_to_each_other() -> None:
    """A pool that runs nothing yields only to a pool that came to wait before it ran
    nothing: B, waiting since A's idleness began, is not yielded to, so A starts."""
    a, _b = _idle_pair(1.0)
    a.state.cards[0].turns.idle_since_s = 0.5  # A ran nothing here before it saw B wait
    assert isinstance(a.next_start(2.0), Start)


def _claims_to_wait(now_s: int) -> OtherPools:
    """Rows that say their pool runs nothing on the card and waits for 36 GiB: a new pool id
    every 5 s, each row kept 30 s (the bound per pool does not hold them)."""
    return OtherPools(
        card_uuid=UUID,
        pools=tuple(
            PoolBooking(
                pool_id=f"900.{number}",
                pid=900,
                start="s",
                label="claims",
                updated_s=0.0,
                waiting=1,
                need_bytes=36 * GiB,
            )
            for number in range(max(0, now_s // 5 - 5), now_s // 5 + 1)
        ),
    )


def test_fresh_rows_claiming_to_wait_hold_a_pool_at_most_half_the_time() -> None:
    """Rows under a new pool id every 5 s say their pool runs nothing on the card and waits
    for 36 GiB, and never start: each is yielded to for at most YIELD_S, but together they
    held A (5 s tasks, room for four) idle most of 600 s. A yields on a card for at most
    YIELD_S at a time and then as long not at all: A runs a task at least half the time."""
    a = _planner(8 * GiB, 4, 1)
    for t in range(1000):
        a.submit(t, "a")
    idle_s = 0
    for now_s in range(600):
        a.neighbours.observe_others(0, _claims_to_wait(now_s), float(now_s))
        len(start_all(a, float(now_s), 1000))
        if not a.state.running:
            idle_s += 1
        for task, run in list(a.state.running.items()):
            if now_s - run.started_s >= 5:
                a.finished(task, None, float(now_s))
    assert idle_s <= 0.5 * 600


def _waiting_row(pool_id: str, *, running: bool) -> OtherPools:
    """Pool ``pool_id``: waiting for 36 GiB and running nothing, or running its 36 GiB task."""
    tasks = (TaskBooking(worker_pid=77, key="x", booked_bytes=36 * GiB, reached_bytes=0),)
    return OtherPools(
        card_uuid=UUID,
        pools=(
            PoolBooking(
                pool_id=pool_id,
                pid=int(pool_id.split(".")[0]),
                start="s",
                label=pool_id,
                updated_s=0.0,
                tasks=tasks if running else (),
                waiting=0 if running else 1,
                need_bytes=0 if running else 36 * GiB,
            ),
        ),
    )


def test_a_pool_that_got_its_turn_leaves_the_next_one_a_full_yield() -> None:
    """A runs an 8 GiB task for 25 s; pool X waits at the serial floor meanwhile (A yields:
    it starts nothing more), then runs its task; pool Y comes to wait right after. X had
    its turn, so A's yield to X was not one a stranger took: A yields to Y at once, not
    only after as long as it yielded to X."""
    a = _planner(8 * GiB, 4, 1)
    for t in range(10):
        a.submit(t, "a")
    assert len(start_all(a, 0.0, 1000)) >= 1
    for task in list(a.state.running)[1:]:
        a.finished(task, None, 0.0)  # one task of A left running
    for now_s in range(1, 25):
        a.neighbours.observe_others(0, _waiting_row("7.1", running=False), float(now_s))
        assert len(start_all(a, float(now_s), 1000)) == 0  # A yields to X
    a.neighbours.observe_others(0, _waiting_row("7.1", running=True), 25.0)  # X has its turn
    a.neighbours.observe_others(0, _waiting_row("8.1", running=False), 25.5)  # Y waits; X is done
    a.finished(next(iter(a.state.running)), None, 26.0)
    a.neighbours.observe_others(0, _waiting_row("8.1", running=False), 26.5)
    assert len(start_all(a, 27.0, 1000)) == 0  # A yields to Y, which waited before A ran nothing
    assert len(start_all(a, 25.5 + YIELD_S, 1000)) >= 1  # for at most YIELD_S
