"""Records that state what was true then (pure core, the time passed in): the card's samples
and their bound, whose bytes a reading shows, an out-of-memory's bookings, the width's move
after it, and a task larger than the card."""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from test_fit_rules import PARENT, card, planner_on, start_all

from gpupool._core.attribution import analyse_oom
from gpupool._core.events import Decision
from gpupool._core.peak import PeakReport
from gpupool._core.planner import (
    SAMPLE_INTERVAL_S,
    SAMPLE_MIN_GAP_S,
    CardReading,
    Fail,
    Retry,
)
from gpupool._core.planner.samples import split_reading
from gpupool._core.units import GiB, MiB


def oom_report(reached_bytes: int, requested_bytes: int) -> PeakReport:
    return PeakReport(
        device=0,
        device_peak_bytes=reached_bytes,
        device_source="simulator",
        oom=True,
        oom_requested_bytes=requested_bytes,
    )


def samples_of(records: list[Decision]) -> list[Decision]:
    return [r for r in records if r.event == "card_read"]


# -- the samples' bound --------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    tasks=st.integers(min_value=1, max_value=400),
    duration_s=st.floats(min_value=1.0, max_value=30.0),
    jumpy=st.booleans(),
)
def test_samples_grow_with_time_not_with_tasks(tasks: int, duration_s: float, jumpy: bool) -> None:
    """However many tasks start and end, and however often the card is read, a card is
    sampled at most once per SAMPLE_MIN_GAP_S between decisions."""
    records: list[Decision] = []
    planner = planner_on([card(40)], records, estimate_bytes=GiB, max_workers=4)
    for task in range(tasks):
        planner.submit(task, "a")
    step_s = duration_s / (tasks + 1)
    now_s = 0.0
    for i in range(tasks + 1):
        now_s = (i + 1) * step_s
        used = (20 if jumpy and i % 2 else 2) * GiB
        planner.readings.observe(0, CardReading(free_bytes=40 * GiB - used, used_bytes=used), now_s)
        for run_task in list(planner.state.cards[0].runs):
            planner.finished(run_task, None, now_s)
        start_all(planner, now_s)
        planner.readings.sample_cards(now_s)
    decisions = [r for r in records if r.event != "card_read" and r.device == 0]
    samples = samples_of(records)
    times = [s.time_s for s in samples]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    steady = [g for g in gaps if g > 0]
    bound = len(decisions) + 1 + duration_s / SAMPLE_MIN_GAP_S
    assert len(samples) <= bound + 1
    if len(decisions) <= 2:
        assert all(g >= SAMPLE_MIN_GAP_S - 1e-9 for g in steady[1:])


def test_an_idle_card_whose_reading_stands_still_is_not_sampled() -> None:
    records: list[Decision] = []
    planner = planner_on([card(40)], records, estimate_bytes=GiB, max_workers=4)
    for second in range(1, 20):
        planner.readings.observe(
            0, CardReading(free_bytes=38 * GiB, used_bytes=2 * GiB), float(second)
        )
        planner.readings.sample_cards(float(second))
    assert len(samples_of(records)) == 1  # the first reading, then nothing moved


def test_a_card_running_steadily_is_sampled_once_per_interval_and_a_start_soon() -> None:
    records: list[Decision] = []
    planner = planner_on([card(40)], records, estimate_bytes=GiB, max_workers=4)
    planner.readings.observe(0, CardReading(free_bytes=38 * GiB, used_bytes=2 * GiB), 0.0)
    planner.readings.sample_cards(0.0)
    planner.submit(0, "a")
    start_all(planner, 0.05)
    for step in range(1, 201):  # read every 50 ms for 10 s; nothing moves
        now_s = 0.05 * step
        planner.readings.observe(0, CardReading(free_bytes=37 * GiB, used_bytes=3 * GiB), now_s)
        planner.readings.sample_cards(now_s)
    samples = samples_of(records)
    # The start is sampled at the first turn SAMPLE_MIN_GAP_S after the last sample.
    assert samples[1].to_dict()["running"] == 1
    assert samples[1].time_s <= SAMPLE_MIN_GAP_S + 0.05 + 1e-9
    assert len(samples) <= 2 + 10 / SAMPLE_INTERVAL_S


def test_a_co_tenant_that_grows_between_decisions_is_sampled_with_its_bytes() -> None:
    records: list[Decision] = []
    planner = planner_on([card(44, 4)], records, estimate_bytes=5 * GiB, max_workers=4)
    planner.submit(0, "a")
    planner.readings.observe(0, CardReading(free_bytes=40 * GiB, used_bytes=4 * GiB), 0.1)
    start_all(planner, 0.1)
    rows = {100: 5 * GiB, 999: 10 * GiB}
    planner.readings.observe(
        0,
        CardReading(free_bytes=29 * GiB, used_bytes=15 * GiB, process_bytes=rows),
        0.1 + SAMPLE_MIN_GAP_S,
    )
    planner.readings.sample_cards(0.1 + SAMPLE_MIN_GAP_S)
    last = samples_of(records)[-1].to_dict()
    assert last["live_co_tenant_bytes"] == 10 * GiB
    assert last["live_pool_bytes"] == 5 * GiB
    assert last["live_own_bytes"] == 0  # the rows list no row for this process: it holds none
    assert last["booked_bytes"] == 5 * GiB
    assert last["keys"] == [{"key": "a", "running": 1, "booked_bytes": 5 * GiB}]


# -- whose bytes -----------------------------------------------------------------------------


def test_the_pools_idle_workers_and_their_tasks_children_are_never_co_tenants() -> None:
    records: list[Decision] = []
    planner = planner_on([card(30)], records, estimate_bytes=3 * GiB, max_workers=6)
    for task in range(2):
        planner.submit(task, "a")
    start_all(planner, 0.0)
    planner.finished(0, None, 0.5)  # worker 100 is idle now, its context still held
    rows = {PARENT: 1 * GiB, 100: 300 * MiB, 101: 2 * GiB, 555: 4 * GiB, 777: 5 * GiB}
    # 555 is a subprocess task 1 started (the process layer names it the pool's).
    reading = CardReading(
        free_bytes=30 * GiB - (12 * GiB + 300 * MiB),
        used_bytes=12 * GiB + 300 * MiB,
        process_bytes=rows,
        pool_pids=frozenset({100, 101, 555}),
    )
    split = split_reading(planner.state.cards[0], reading, PARENT)
    assert split.own_bytes == GiB
    assert split.pool_bytes == 300 * MiB + 2 * GiB + 4 * GiB
    assert split.running_bytes == 2 * GiB
    assert split.co_tenant_bytes == 5 * GiB


def test_rows_that_list_none_of_the_pools_processes_split_nothing() -> None:
    """In a container the driver lists other namespaces' PIDs: the rows name co-tenants but
    none of the pool's processes while its tasks run. The pool's bytes are then not read as
    0 (all of the card a co-tenant's): the reading is not split, as with no rows at all."""
    records: list[Decision] = []
    planner = planner_on([card(30)], records, estimate_bytes=3 * GiB, max_workers=6)
    for task in range(2):
        planner.submit(task, "a")
    start_all(planner, 0.0)
    used = 4 * GiB + 2 * (3 * GiB)  # the co-tenant's row, and the two tasks' unlisted bytes
    reading = CardReading(
        free_bytes=30 * GiB - used, used_bytes=used, process_bytes={7777: 4 * GiB}
    )
    split = split_reading(planner.state.cards[0], reading, PARENT)
    assert split.co_tenant_bytes is None and split.pool_bytes is None
    assert split.own_bytes is None and split.used_bytes == used
    outcome = planner.out_of_memory(0, oom_report(2 * GiB, 2 * GiB), reading, 1.0, error="OOM")
    assert isinstance(outcome, Retry)
    oom = next(r for r in records if r.event == "out_of_memory").to_dict()
    assert oom["live_pool_bytes"] is None and oom["live_co_tenant_bytes"] is None
    analysis = analyse_oom(oom)
    assert not analysis.pool_read and not analysis.own_separable


# -- an out-of-memory's record ------------------------------------------------------------


def _oom_wave(retry_oom: bool) -> tuple[list[Decision], list[Retry | Fail]]:
    """The 30 GiB card: six tasks priced 3.15 GiB start together and each needs 6.59 GiB;
    two run out one after the other."""
    records: list[Decision] = []
    planner = planner_on([card(30)], records, estimate_bytes=int(3.15 * GiB), max_workers=6)
    if not retry_oom:
        planner.state.config = dataclasses.replace(planner.state.config, retry_oom=False)
    for task in range(12):
        planner.submit(task, "k")
    assert len(start_all(planner, 0.0)) == 6
    rows = {100 + t: 300 * MiB + (6 * GiB if t > 1 else 0) for t in range(6)}
    outcomes = []
    for task, now_s in ((0, 1.0), (1, 1.01)):
        used = sum(rows.values())
        reading = CardReading(
            free_bytes=30 * GiB - used,
            used_bytes=used,
            process_bytes=rows,
            pool_pids=frozenset(rows),
        )
        outcomes.append(
            planner.out_of_memory(
                task, oom_report(300 * MiB, int(6.3 * GiB)), reading, now_s, error="OOM"
            )
        )
    return records, outcomes


def test_an_out_of_memory_states_each_tasks_booking_when_it_started() -> None:
    records, _ = _oom_wave(retry_oom=True)
    ooms = [r.to_dict() for r in records if r.event == "out_of_memory"]
    price = int(3.15 * GiB)
    # Not re-priced at the ask the first out-of-memory raised: 6 x 3.15, then 5 x 3.15.
    assert [o["booked_bytes"] for o in ooms] == [6 * price, 5 * price]
    assert all(o["booked_bytes"] <= 30 * GiB for o in ooms)
    second = ooms[1]["runs"]
    assert isinstance(second, list) and len(second) == 5
    assert second[0]["failed"] is True and second[0]["pid"] == 101
    assert {row["booked_bytes"] for row in second} == {price}
    assert all(row["booked_now_bytes"] > price for row in second[1:])  # re-priced since
    # The pool's own bytes are read, so nothing of them is a co-tenant's.
    assert [o["live_co_tenant_bytes"] for o in ooms] == [0, 0]
    for number, oom in enumerate(ooms):
        analysis = analyse_oom(oom, line=number)
        assert analysis.verdict == "ask"
        assert analysis.co_tenant_growth_bytes == 0 and analysis.own_separable
        assert analysis.runs_by_key[0][:2] == ("k", 6 - number)


def test_every_width_move_after_an_out_of_memory_is_a_record_with_retries_off() -> None:
    records, outcomes = _oom_wave(retry_oom=False)
    assert all(isinstance(o, Fail) for o in outcomes)
    events = [r.event for r in records if r.event != "card_read"]
    first = events.index("out_of_memory")
    assert events[first : first + 4] == ["out_of_memory", "narrowed"] * 2
    narrowed = [r for r in records if r.event == "narrowed"]
    # Never below the tasks still running (5, then 4); 4 fit at the raised ask.
    assert [(r.width_before, r.width_after) for r in narrowed] == [(6, 5), (5, 4)]


def test_a_task_larger_than_the_card_fails_saying_so() -> None:
    records: list[Decision] = []
    planner = planner_on([card(24)], records, estimate_bytes=4 * GiB, max_workers=4)
    planner.submit(0, "big")
    assert len(start_all(planner, 0.0)) == 1
    outcome = planner.out_of_memory(
        0, oom_report(300 * MiB, 30 * GiB), None, 1.0, error="CUDA out of memory"
    )
    assert isinstance(outcome, Fail) and outcome.kind == "larger_than_card"
    assert "more than the 24.00 GiB total of the largest card" in outcome.reason
    assert "30.29 GiB" in outcome.reason
    oom = next(r for r in records if r.event == "out_of_memory").to_dict()
    analysis = analyse_oom(oom)
    assert analysis.verdict == "larger_than_card"
    assert "more than the card can hold" in analysis.explanation
    assert "24.00 GiB card" in analysis.explanation


def test_a_postmortem_that_cannot_tell_own_from_co_tenant_names_the_reading_that_would() -> None:
    """On a card whose driver lists no process rows, the record has no split: growth of
    this process and of a co-tenant cannot be told apart, and the verdict says which
    reading would have told them apart."""
    record = {
        "event": "out_of_memory",
        "device": 0,
        "total_bytes": 40 * GiB,
        "census_co_tenant_bytes": 4 * GiB,
        "own_high_water_bytes": 0,
        "reserve_bytes": 256 * MiB,
        "booked_bytes": 20 * GiB,
        "running": 2,
        "task_ask_bytes": 10 * GiB,
        "reached_bytes": 9 * GiB,
        "requested_bytes": 1 * GiB,
        "live_used_bytes": 39 * GiB,
        "live_free_bytes": 1 * GiB,
        "live_own_bytes": None,
        "live_pool_bytes": None,
    }
    analysis = analyse_oom(record)
    assert analysis.verdict == "co_tenant" and not analysis.own_separable
    assert "cannot be told apart" in analysis.explanation
    assert "this process's own row (live_own_bytes)" in analysis.explanation


def test_tasks_booked_past_the_cards_room_name_the_width_not_unattributed() -> None:
    """A fixed width (``width=6``) runs five tasks booked at 3.47 GiB each on a 16 GiB card
    whose room is 15.75 GiB: no price was wrong, the width was. The verdict names it, with
    the bytes booked past the room, rather than leave the out-of-memory unattributed."""
    record = {
        "event": "out_of_memory",
        "device": 0,
        "total_bytes": 16 * GiB,
        "census_co_tenant_bytes": 0,
        "own_high_water_bytes": 0,
        "reserve_bytes": 256 * MiB,
        "booked_bytes": 5 * int(3.47 * GiB),
        "running": 5,
        "task_ask_bytes": int(3.38 * GiB),
        "reached_bytes": 300 * MiB,
        "requested_bytes": 3 * GiB,
        "live_used_bytes": int(13.46 * GiB),
        "live_free_bytes": int(2.54 * GiB),
        "live_own_bytes": 0,
        "live_pool_bytes": int(13.46 * GiB),
    }
    analysis = analyse_oom(record)
    room = 16 * GiB - 256 * MiB
    assert analysis.wrong_terms == (("over_room", 5 * int(3.47 * GiB) - room),)
    assert analysis.verdict == "over_room"
    assert "more than the card's room of 15.75 GiB" in analysis.explanation
