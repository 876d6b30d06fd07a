"""The planner's rules, each in its room: the one fit and its views, an out-of-memory judged
against the task's own booking, the cap that lifts, the room held for a waiting head, and
admission only where a ready worker is idle (pure core; no processes, the time passed in)."""

from __future__ import annotations

import heapq
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool._core.census import CardCensus
from gpupool._core.events import Decision
from gpupool._core.peak import PeakReport
from gpupool._core.planner import (
    CAP_LIFT_AFTER_S,
    CardReading,
    Planner,
    PlannerConfig,
    Retry,
    Start,
    Wait,
    Warm,
    Workers,
)
from gpupool._core.planner.fit import Booked, card_widths, fit
from gpupool._core.planner.order import head_hold, keep_hold
from gpupool._core.policy import AskTable, Policy
from gpupool._core.units import GiB, MiB
from support import card_census, census_of

PARENT = 1


def planner_on(
    cards: list[CardCensus],
    records: list[Decision],
    *,
    estimate_bytes: int,
    max_workers: int,
    reserve_bytes: int = 0,
    emit: Callable[[Decision], None] | None = None,
) -> Planner:
    """A constructed planner with a fixed margin (estimates are priced as given); its records
    go to ``records`` (or to ``emit``)."""
    planner = Planner(
        census=census_of(cards, cpus=64, available_ram_bytes=512 * GiB),
        asks=AskTable(
            policy=Policy(reserve_bytes=reserve_bytes), default_estimate_bytes=estimate_bytes
        ),
        config=PlannerConfig(
            max_workers=max_workers, reserve_bytes=reserve_bytes, parent_pid=PARENT
        ),
        emit=records.append if emit is None else emit,
    )
    planner.construct(0.0)
    return planner


def card(total_gib: float, co_tenant_gib: float = 0.0, device: int = 0) -> CardCensus:
    total = int(total_gib * GiB)
    return card_census(
        device=device, total_bytes=total, free_bytes=total - int(co_tenant_gib * GiB)
    )


def start_all(planner: Planner, now_s: float, pid: int = 100) -> list[Start]:
    """Start every task the planner admits now; returns the starts."""
    starts = []
    while isinstance(verdict := planner.next_start(now_s), Start):
        planner.started(verdict.task, verdict.device, pid + verdict.task, now_s)
        starts.append(verdict)
    return starts


# -- the one fit ----------------------------------------------------------------------------


def test_the_fit_counts_what_fits_beside_the_runs_and_names_what_stops_more() -> None:
    records: list[Decision] = []
    planner = planner_on([card(30, 6)], records, estimate_bytes=5 * GiB, max_workers=8)
    state = planner.state.cards[0]
    ask = planner.state.asks.ask("a")
    alone = fit(state, ask, [], reserve_bytes=0, ceiling=planner.state.ceiling, slots=8)
    assert (alone.more, alone.limit, alone.width) == (4, "memory", 4)  # 24 GiB room / 5 GiB
    beside = fit(
        state, ask, [Booked("b", 12 * GiB)], reserve_bytes=0, ceiling=planner.state.ceiling, slots=8
    )
    assert (beside.more, beside.width, beside.running) == (2, 3, 1)
    assert beside.next_bytes == 5 * GiB
    assert beside.left_bytes == 24 * GiB - 12 * GiB - 5 * GiB
    slots = fit(state, ask, [], reserve_bytes=0, ceiling=planner.state.ceiling, slots=2)
    assert (slots.more, slots.limit) == (2, "max_workers")
    state.cap.oom_cap = 2
    capped = fit(
        state, ask, [Booked("a", 5 * GiB)], reserve_bytes=0, ceiling=planner.state.ceiling, slots=8
    )
    assert (capped.more, capped.limit) == (1, "out_of_memory")


def test_on_unified_memory_the_width_counts_each_placed_tasks_child_rss_once() -> None:
    """On unified memory each task is priced at its ask plus its child's RSS in the card's
    room: 1 GiB + 1 GiB on 16 GiB is 8 at once. The width stated before any start places
    the pending asks as admission does, so it says the 8 that then start (not 5, as it would
    with each placed task's child RSS counted in its booking and again beside it)."""
    planner = Planner(
        census=census_of(
            [card_census(total_bytes=16 * GiB, free_bytes=16 * GiB, unified=True)],
            cpus=64,
            available_ram_bytes=512 * GiB,
        ),
        asks=AskTable(policy=Policy(reserve_bytes=0), default_estimate_bytes=GiB),
        config=PlannerConfig(
            max_workers=16, reserve_bytes=0, parent_pid=PARENT, child_rss_prior_bytes=GiB
        ),
        emit=lambda _record: None,
    )
    planner.construct(0.0)
    for task in range(16):
        planner.submit(task, "a")
    assert planner.views.fit(0, planner.state.asks.ask("a"), []).more == 8
    first = planner.next_start(0.0)
    assert isinstance(first, Start)
    assert planner.width == 8
    planner.started(first.task, first.device, 100, 0.0)
    assert len(start_all(planner, 0.0)) == 7


def test_on_unified_memory_a_kept_hold_books_the_head_as_its_hold_was_chosen() -> None:
    """A hold's booking is the head's share of its key's price (its child's RSS is priced
    beside each booking by the fit): kept, it books the same, so the room beside the head
    is not narrowed by its child's RSS twice."""
    planner = Planner(
        census=census_of(
            [card_census(total_bytes=16 * GiB, free_bytes=16 * GiB, unified=True)],
            cpus=64,
            available_ram_bytes=512 * GiB,
        ),
        asks=AskTable(policy=Policy(reserve_bytes=0), default_estimate_bytes=3 * GiB),
        config=PlannerConfig(
            max_workers=16, reserve_bytes=0, parent_pid=PARENT, child_rss_prior_bytes=GiB
        ),
        emit=lambda _record: None,
    )
    planner.construct(0.0)
    ask = planner.state.asks.ask("a")
    state = planner.state.cards[0]
    chosen = head_hold(
        [state],
        ask,
        set(),
        reserve_bytes=0,
        ceiling=planner.state.ceiling,
        expected_end_s=lambda run: run.started_s,
    )
    assert chosen is not None
    assert chosen.held_bytes == 3 * GiB
    kept = keep_hold(chosen, state, ask, reserve_bytes=0, ceiling=planner.state.ceiling)
    assert kept is not None
    assert kept.held_bytes == chosen.held_bytes
    # Beside the held head (3 GiB + 1 GiB): three more tasks of 4 GiB on 16 GiB.
    beside = fit(
        state, ask, kept.after(state), reserve_bytes=0, ceiling=planner.state.ceiling, slots=8
    )
    assert beside.more == 3


def test_unreadable_cards_run_one_at_a_time() -> None:
    records: list[Decision] = []
    cards = [card_census(device=0, total_bytes=None, free_bytes=None)]
    planner = planner_on(cards, records, estimate_bytes=GiB, max_workers=4)
    ask = planner.state.asks.ask("a")
    empty = fit(
        planner.state.cards[0], ask, [], reserve_bytes=0, ceiling=planner.state.ceiling, slots=4
    )
    busy = fit(
        planner.state.cards[0],
        ask,
        [Booked("a", GiB)],
        reserve_bytes=0,
        ceiling=planner.state.ceiling,
        slots=4,
    )
    assert (empty.more, empty.limit, busy.more) == (1, "unreadable", 0)


def test_card_widths_share_the_ceiling_and_keep_the_serial_floor() -> None:
    records: list[Decision] = []
    planner = planner_on(
        [card(40, device=0), card(12, device=1)], records, estimate_bytes=5 * GiB, max_workers=6
    )
    ask = planner.state.asks.ask("a")
    fits = [
        fit(c, ask, [], reserve_bytes=0, ceiling=planner.state.ceiling, slots=6)
        for c in planner.state.cards
    ]
    decisions = card_widths(fits, planner.state.ceiling)
    # 8 fit on the large card alone: the ceiling's 6 go there first, none is left for card 1.
    assert [(d.width, d.limit) for d in decisions] == [(6, "max_workers"), (0, "max_workers")]
    planner.state.asks.hint("huge", 100 * GiB)
    huge = planner.state.asks.ask("huge")
    fits = [
        fit(c, huge, [], reserve_bytes=0, ceiling=planner.state.ceiling, slots=6)
        for c in planner.state.cards
    ]
    floor = card_widths(fits, planner.state.ceiling)
    assert [(d.width, d.limit) for d in floor] == [(1, "floor"), (0, "floor")]


@settings(max_examples=60, deadline=None)
@given(
    totals=st.lists(st.integers(8, 60), min_size=1, max_size=3),
    small_gib=st.integers(1, 4),
    large_gib=st.integers(5, 30),
    order=st.lists(st.booleans(), min_size=4, max_size=30),
    max_workers=st.integers(1, 8),
)
def test_every_record_states_the_runs_on_its_card(
    totals: list[int], small_gib: int, large_gib: int, order: list[bool], max_workers: int
) -> None:
    """Per-card truth: a card's records never state fewer tasks than run there, whichever key
    a record prices (two keys of different sizes over several cards)."""
    records: list[Decision] = []
    cards = [card(t, device=i) for i, t in enumerate(totals)]
    # Each record with the runs on every card at the moment it is written.
    stated: list[tuple[Decision, dict[int, int]]] = []
    planner: Planner | None = None

    def emit(record: Decision) -> None:
        records.append(record)
        if planner is not None:
            stated.append((record, {c.index: len(c.runs) for c in planner.state.cards}))

    planner = planner_on(
        cards, records, estimate_bytes=small_gib * GiB, max_workers=max_workers, emit=emit
    )
    planner.state.asks.hint("large", large_gib * GiB)
    planner.state.asks.hint("small", small_gib * GiB)
    for task, large in enumerate(order):
        planner.submit(task, "large" if large else "small")
        start_all(planner, float(task))
        if task % 3 == 2 and planner.state.running:
            done = min(planner.state.running)
            run = planner.state.running[done]
            report = PeakReport(
                device=run.device,
                device_peak_bytes=run.booked_bytes,
                device_source="simulator",
            )
            planner.finished(done, report, float(task))
    assert stated
    for record, runs in stated:
        if record.device is None or record.event in ("out_of_memory", "shutdown"):
            continue
        assert record.width_after is not None
        assert record.width_after >= runs[record.device], record.to_dict()


# -- an out-of-memory, judged against the task's own booking ------------------------------


def oom_report(device: int, reached_bytes: int, requested_bytes: int) -> PeakReport:
    return PeakReport(
        device=device,
        device_peak_bytes=reached_bytes,
        device_source="simulator",
        oom=True,
        oom_requested_bytes=requested_bytes,
    )


def test_an_underestimate_raises_its_ask_and_caps_no_card() -> None:
    """A wave of tasks priced at 2 GiB that hold 6 GiB: every out-of-memory of the wave is an
    underestimate (each judged against the 2 GiB it started at, not the ask the first one
    raised), no card is capped, and another key then runs as wide as max_workers."""
    records: list[Decision] = []
    planner = planner_on([card(26, 3)], records, estimate_bytes=2 * GiB, max_workers=6)
    for task in range(6):
        planner.submit(task, "big")
    starts = start_all(planner, 0.0)
    assert len(starts) == 6
    for start in starts:
        verdict = planner.out_of_memory(
            start.task, oom_report(0, 5 * GiB, GiB), None, 1.0, error="oom"
        )
        assert isinstance(verdict, Retry)
        assert "underestimated" in verdict.reason
        assert "something else" not in verdict.reason
    assert planner.state.cards[0].cap.oom_cap is None
    assert planner.state.asks.ask("big").ask_bytes >= 6 * GiB
    for task in planner.pending_tasks():
        planner.withdraw(task)
    planner.state.asks.hint("small", 1300 * MiB)
    for task in range(100, 112):
        planner.submit(task, "small")
    assert len(start_all(planner, 2.0)) == 6


def test_something_that_grew_caps_the_card_until_the_reading_shows_the_room_back() -> None:
    """Tasks within their asks run out beside others: the card is capped; the cap lifts only
    once the live reading shows the bytes that are not the pool's back to the census for
    CAP_LIFT_AFTER_S (a record with its terms), and the card runs full width again."""
    records: list[Decision] = []
    total = 48 * GiB
    planner = planner_on([card(48, 2)], records, estimate_bytes=7 * GiB, max_workers=6)
    for task in range(12):
        planner.submit(task, "k")
    starts = start_all(planner, 0.0)
    assert len(starts) == 6
    spike = 20 * GiB

    def reading(co_tenant_bytes: int) -> CardReading:
        rows = {100 + r: 3 * GiB for r in planner.state.running}
        used = co_tenant_bytes + sum(rows.values())
        return CardReading(free_bytes=total - used, used_bytes=used, process_bytes=rows)

    verdict = planner.out_of_memory(
        starts[0].task, oom_report(0, 3 * GiB, 2 * GiB), reading(2 * GiB + spike), 1.0, error="oom"
    )
    assert isinstance(verdict, Retry)
    assert planner.state.cards[0].cap.oom_cap == 5
    # The spike goes on: readings show it, and the cap holds however long.
    for step in range(5):
        planner.readings.observe(0, reading(2 * GiB + spike), 2.0 + step)
    assert planner.state.cards[0].cap.oom_cap == 5
    # The spike ends: the cap lifts only after the room has been back CAP_LIFT_AFTER_S.
    planner.readings.observe(0, reading(2 * GiB), 10.0)
    assert planner.state.cards[0].cap.oom_cap == 5
    planner.readings.observe(0, reading(2 * GiB), 10.0 + CAP_LIFT_AFTER_S)
    assert planner.state.cards[0].cap.oom_cap is None
    lifted = [r for r in records if r.event == "cap_lifted"]
    assert len(lifted) == 1
    terms = lifted[0].to_dict()
    assert terms["oom_cap_before"] == 5
    assert terms["live_not_pool_bytes"] == 2 * GiB
    assert terms["width_after"] == 6
    while planner.state.running:
        planner.finished(min(planner.state.running), None, 11.0)
    planner.readings.observe(0, reading(2 * GiB), 12.0)
    assert len(start_all(planner, 12.0)) == 6


def test_a_cap_does_not_lift_on_one_good_reading_between_bad_ones() -> None:
    records: list[Decision] = []
    total = 24 * GiB
    planner = planner_on([card(24)], records, estimate_bytes=5 * GiB, max_workers=4)
    for task in range(4):
        planner.submit(task, "k")
    starts = start_all(planner, 0.0)

    def reading(co_tenant_bytes: int) -> CardReading:
        used = co_tenant_bytes + 2 * GiB * len(planner.state.running)
        rows = {100 + r: 2 * GiB for r in planner.state.running}
        return CardReading(free_bytes=total - used, used_bytes=used, process_bytes=rows)

    planner.out_of_memory(
        starts[0].task, oom_report(0, 2 * GiB, GiB), reading(8 * GiB), 0.5, error="oom"
    )
    assert planner.state.cards[0].cap.oom_cap == 3
    for step in range(10):  # good, bad, good, bad: never CAP_LIFT_AFTER_S of good in a row
        co_tenant = 0 if step % 2 == 0 else 8 * GiB
        planner.readings.observe(0, reading(co_tenant), 1.0 + step * CAP_LIFT_AFTER_S * 0.6)
    assert planner.state.cards[0].cap.oom_cap == 3


# -- the room held for a waiting head -------------------------------------------------------


def test_small_tasks_keep_starting_while_a_large_head_waits_and_never_delay_it() -> None:
    """3 large (18 GiB, 3 s) then 60 small (2 GiB, 0.5 s) tasks on 40 GiB, six at once, in
    simulated time: the third large cannot fit beside the first two; once small tasks have
    passed it a ceiling's worth of times its room is held, small tasks keep starting only
    where they fit beside what stays once the runs it waits for end, and it starts the
    moment the first two end (3 s), not later; a record says what is held and why."""
    records: list[Decision] = []
    planner = planner_on([card(40)], records, estimate_bytes=2 * GiB, max_workers=6)
    planner.state.asks.hint("large", 18 * GiB)
    planner.state.asks.hint("small", 2 * GiB)
    took_s = {"large": 3.0, "small": 0.5}
    for task in range(63):
        planner.submit(task, "large" if task < 3 else "small")
    ends: list[tuple[float, int]] = []
    now = 0.0
    started_s: dict[int, float] = {}
    beside_hold = 0
    while True:
        while isinstance(verdict := planner.next_start(now), Start):
            planner.started(verdict.task, verdict.device, 100 + verdict.task, now)
            run = planner.state.running[verdict.task]
            started_s[verdict.task] = now
            heapq.heappush(ends, (now + took_s[run.key], verdict.task))
            hold = planner.order.hold
            if run.key == "small" and hold is not None:
                beside_hold += 1
                kept = [r for t, r in planner.state.cards[0].runs.items() if t not in hold.ending]
                assert sum(r.booked_bytes for r in kept) + hold.held_bytes <= 40 * GiB
                assert planner.width <= len(planner.state.running) + 1
        if not ends:
            break
        now, done = heapq.heappop(ends)
        planner.finished(done, None, now)
    assert len(started_s) == 63
    assert started_s[2] == 3.0  # the moment the first two large tasks ended
    assert beside_hold > 0
    head_wait = next(r for r in records if r.event == "head_wait").to_dict()
    assert head_wait["held_key"] == "large"
    assert head_wait["held_bytes"] == 18 * GiB
    assert head_wait["ending_runs"] >= 1


def test_the_head_starts_when_the_runs_its_hold_first_named_end() -> None:
    """40 GiB, six at once: two 11 GiB tasks (1 s and 3 s) and a 14 GiB one (10 s), none of
    their keys timed yet, then a 20 GiB head, then quick tasks and slow 2 GiB ones. The hold
    names the two 11 GiB runs; once the first ends (its key is now timed, the 14 GiB key is
    not), the hold is kept rather than moved to the 14 GiB run, so the slow tasks started
    beside it leave the head its room: it starts when the second ends (3 s), not at 10 s
    (before: chosen again each turn, the hold moved, and the slow tasks took the room)."""
    records: list[Decision] = []
    planner = planner_on([card(40)], records, estimate_bytes=2 * GiB, max_workers=6)
    for key, size_gib in {"m": 11, "l": 14, "large": 20, "quick": 2, "slow": 2}.items():
        planner.state.asks.hint(key, size_gib * GiB)
    tasks = [("m", 1.0), ("m", 3.0), ("l", 10.0), ("large", 1.0)]
    tasks += [("quick", 0.25)] * 6 + [("slow", 5.0)] * 20
    for task, (key, _took_s) in enumerate(tasks):
        planner.submit(task, key)
    ends: list[tuple[float, int]] = []
    now = 0.0
    started_s: dict[int, float] = {}
    first_hold: frozenset[int] | None = None
    while True:
        while isinstance(verdict := planner.next_start(now), Start):
            planner.started(verdict.task, verdict.device, 100 + verdict.task, now)
            started_s[verdict.task] = now
            heapq.heappush(ends, (now + tasks[verdict.task][1], verdict.task))
            if first_hold is None and planner.order.hold is not None:
                first_hold = planner.order.hold.ending
        if not ends:
            break
        now, done = heapq.heappop(ends)
        planner.finished(done, None, now)
    assert first_hold == {0, 1}
    assert started_s[3] == 3.0


def test_a_retry_put_in_front_of_a_waiting_head_does_not_reset_its_turn() -> None:
    """46 GiB, six at once: a 14 GiB task ending at 3 s and one at 10 s, a 20 GiB head, quick
    tasks that pass it until its room is held, then slow 2 GiB ones. A slow task's
    out-of-memory (an underestimate) is retried in front of the head; once it starts, the
    head still has its turn and its hold, and starts when the 3 s task ends (before: the
    retry's start counted as the head's, the count of passes went back to 0, and slow tasks
    took the room until 10 s)."""
    records: list[Decision] = []
    planner = planner_on([card(46)], records, estimate_bytes=2 * GiB, max_workers=6)
    for key, size_gib in {"b": 14, "a": 14, "large": 20, "quick": 2, "slow": 2}.items():
        planner.state.asks.hint(key, size_gib * GiB)
    tasks = [("b", 3.0), ("a", 10.0), ("large", 1.0)]
    tasks += [("quick", 0.25)] * 6 + [("slow", 5.0)] * 20
    for task, (key, _took_s) in enumerate(tasks):
        planner.submit(task, key)
    ends: list[tuple[float, int]] = []
    now = 0.0
    started_s: dict[int, float] = {}
    retried: Retry | None = None
    while True:
        while isinstance(verdict := planner.next_start(now), Start):
            planner.started(verdict.task, verdict.device, 100 + verdict.task, now)
            started_s[verdict.task] = now
            heapq.heappush(ends, (now + tasks[verdict.task][1], verdict.task))
        if not ends:
            break
        now, done = heapq.heappop(ends)
        if done not in planner.state.running:
            continue  # its run ran out of memory and was retried
        planner.finished(done, None, now)
        if retried is None and now >= 0.5:
            slow = min(t for t, run in planner.state.running.items() if run.key == "slow")
            verdict = planner.out_of_memory(
                slow, oom_report(0, 3 * GiB, GiB), None, now, error="oom"
            )
            assert isinstance(verdict, Retry)
            retried = verdict
    assert retried is not None
    assert started_s[2] == 3.0


# -- admitted when a ready worker can run it ------------------------------------------------


def test_a_task_waits_for_a_ready_worker_and_is_admitted_against_that_moment() -> None:
    """With no ready worker the planner asks for one (Warm) and starts nothing; while it boots
    the parent grows; once it is ready, the start is priced with the parent's new bytes."""
    records: list[Decision] = []
    total = 24 * GiB
    planner = planner_on([card(24, 4)], records, estimate_bytes=5 * GiB, max_workers=6)
    for task in range(6):
        planner.submit(task, "k")
    none = Workers(ready={}, booting={})
    verdict = planner.next_start(0.0, none)
    assert isinstance(verdict, Warm) and verdict.device == 0
    booting = Workers(ready={}, booting={0: 4})
    assert isinstance(planner.next_start(0.1, booting), Wait)  # no more than fit, nothing starts
    # The parent takes 8 GiB while the workers boot.
    own = 8 * GiB
    planner.readings.observe(
        0,
        CardReading(
            free_bytes=total - 4 * GiB - own, used_bytes=4 * GiB + own, process_bytes={PARENT: own}
        ),
        1.0,
    )
    started = 0
    while isinstance(verdict := planner.next_start(2.0, Workers(ready={0: 4}, booting={})), Start):
        planner.started(verdict.task, verdict.device, 100 + verdict.task, 2.0)
        started += 1
    assert started == 2  # (24 - 4 co-tenant - 8 own) GiB // 5 GiB
    narrowed = [r for r in records if r.event == "narrowed"]
    assert narrowed and narrowed[-1].width_after == 2


def test_no_more_workers_boot_than_the_tasks_that_fit_now() -> None:
    """While workers boot, the planner asks for one per task that fits now (the pool's width
    for the work it holds), not one per pending task or per slot of max_workers: booting
    workers share the host's CPUs with each other."""
    records: list[Decision] = []
    planner = planner_on([card(40, 7)], records, estimate_bytes=2 * GiB, max_workers=8)
    planner.state.asks.hint("large", 11 * GiB)
    planner.state.asks.hint("small", 2500 * MiB)
    for task in range(40):
        planner.submit(task, "large" if task % 3 == 0 else "small")
    booting = 0
    while isinstance(
        verdict := planner.next_start(0.0, Workers(ready={}, booting={0: booting})), Warm
    ):
        booting += 1
    assert isinstance(verdict, Wait)
    # 33 GiB of room: 2 large (22 GiB) and 4 small (10 GiB) fit together now.
    assert booting == planner.width == 6
