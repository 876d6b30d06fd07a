"""A learned price that stays on evidence: the margin of few, spread samples is held to the
range they were measured over, the ask to the card's room, and a key whose peaks vary a lot
is told to the user (pure core, hypothesis)."""

from __future__ import annotations

import math
import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool._core.bookings import OtherPools, PoolBooking, TaskBooking
from gpupool._core.events import Decision
from gpupool._core.peak import PeakReport
from gpupool._core.planner import CardReading, Planner, PlannerConfig, Start
from gpupool._core.planner.learning import varied_peaks
from gpupool._core.policy import MARGIN_FLOOR_BYTES, AskTable, Policy, _t_999, peaks_vary
from gpupool._core.units import GiB, MiB
from support import card_census, census_of

LEARNED = Policy(learned=True)
PEAKS = st.lists(st.integers(min_value=0, max_value=80 * GiB), min_size=3, max_size=40)
#: An estimate no peak reaches: the caller's task_peak holds nothing here.
NO_ESTIMATE = 1000 * GiB


def _table(peaks: list[int], room_bytes: int | None = None) -> AskTable:
    asks = AskTable(policy=LEARNED, default_estimate_bytes=NO_ESTIMATE)
    asks.limit_to_room(room_bytes)
    for peak in peaks:
        asks.measure("k", peak)
    return asks


def _t_term(peaks: list[int]) -> float:
    """ucb - max: how far the 99.9 % prediction bound of the next peak is above the largest."""
    n = len(peaks)
    ucb = statistics.fmean(peaks) + _t_999(n - 1) * statistics.stdev(peaks) * math.sqrt(1 + 1 / n)
    return ucb - max(peaks)


@given(PEAKS)
def test_the_margin_of_spread_samples_never_passes_their_range(peaks: list[int]) -> None:
    """From three samples on: where the t-bound would price the key more than max - min above
    its largest peak, the ask is at most the largest peak + the range (or the floor, or the
    prior's fading share, where either is larger); it is never below the largest peak."""
    ask = _table(peaks).ask("k")
    largest, spread = max(peaks), max(peaks) - min(peaks)
    faded_prior = LEARNED.margin_for(largest) / len(peaks) ** 2
    assert ask.ask_bytes >= largest + MARGIN_FLOOR_BYTES
    assert ask.least_peak_bytes == min(peaks)
    if _t_term(peaks) > spread:
        assert ask.ask_bytes <= largest + max(spread, MARGIN_FLOOR_BYTES, math.ceil(faded_prior))


@given(PEAKS)
def test_tight_samples_keep_the_t_bound(peaks: list[int]) -> None:
    """Where the t-bound stays within the range (many samples that agree), the margin is the
    one it was: max(floor, ucb - max, prior / n^2)."""
    if _t_term(peaks) > max(peaks) - min(peaks):
        return
    ask = _table(peaks).ask("k")
    faded_prior = LEARNED.margin_for(max(peaks)) / len(peaks) ** 2
    expected = max(MARGIN_FLOOR_BYTES, math.ceil(max(faded_prior, _t_term(peaks))))
    assert abs(ask.margin_bytes - expected) <= 1  # the mean and stdev: Welford against two-pass


def test_many_tight_samples_are_priced_by_the_t_bound() -> None:
    """Forty peaks 6.0-6.3 GiB (a tight workload): the t-bound's margin is below the range, so
    the range holds nothing and the ask is what the t-bound gives."""
    peaks = [int((6.0 + 0.3 * ((i * 7) % 11) / 10) * GiB) for i in range(40)]
    assert _t_term(peaks) < max(peaks) - min(peaks)
    ask = _table(peaks).ask("k")
    assert ask.margin_bytes == max(MARGIN_FLOOR_BYTES, math.ceil(_t_term(peaks)))


@given(PEAKS, st.integers(min_value=1 * GiB, max_value=100 * GiB))
def test_the_ask_never_passes_the_cards_room(peaks: list[int], room: int) -> None:
    """With the card's room for one task known: the ask is within it where the largest peak
    fits it, and never below the largest peak (a peak past the room is priced at that peak:
    the measurement wins, and its task runs alone at the serial floor)."""
    ask = _table(peaks, room).ask("k")
    unlimited = _table(peaks).ask("k").ask_bytes
    assert ask.ask_bytes >= max(peaks)
    assert ask.ask_bytes == min(unlimited, max(room, max(peaks)))
    assert ask.room_capped == (unlimited > room)
    if max(peaks) <= room:
        assert ask.ask_bytes <= room


@given(
    PEAKS,
    st.integers(min_value=1 * GiB, max_value=100 * GiB),
    st.integers(min_value=0, max_value=20 * GiB),
)
def test_more_room_never_lowers_the_ask(peaks: list[int], room: int, more: int) -> None:
    """A larger room never prices the key lower, and no room at all prices it highest."""
    smaller = _table(peaks, room).ask("k").ask_bytes
    larger = _table(peaks, room + more).ask("k").ask_bytes
    assert smaller <= larger <= _table(peaks).ask("k").ask_bytes


@given(
    st.integers(min_value=1 * GiB, max_value=40 * GiB),
    st.integers(min_value=0, max_value=8 * GiB),
    st.integers(min_value=0, max_value=8 * GiB),
)
def test_a_wider_range_never_lowers_the_ask(largest: int, gap: int, wider: int) -> None:
    """Three peaks, the largest fixed: moving the other two down (a wider range, a wider
    spread) never prices the key lower."""
    gap = min(gap, largest)
    narrow = [largest - gap, largest, largest - gap // 2]
    wide = [max(0, largest - gap - wider), largest, max(0, largest - (gap + wider) // 2)]
    assert _table(narrow).ask("k").ask_bytes <= _table(wide).ask("k").ask_bytes


@given(PEAKS)
def test_peaks_vary_is_max_over_twice_the_least(peaks: list[int]) -> None:
    """A key's peaks vary a lot exactly when, from three on, the largest is more than twice
    the least and more than the least learned margin above it."""
    assert peaks_vary(len(peaks), min(peaks), max(peaks)) == (
        max(peaks) > 2 * min(peaks) and max(peaks) - min(peaks) > MARGIN_FLOOR_BYTES
    )
    assert not peaks_vary(2, 1, 100)


def _planner(records: list[Decision], *, total_bytes: int, task_peak: int) -> Planner:
    census = census_of(
        [card_census(total_bytes=total_bytes, free_bytes=total_bytes - GiB // 2)],
        cpus=16,
        available_ram_bytes=128 * GiB,
    )
    asks = AskTable(policy=LEARNED, default_estimate_bytes=task_peak)
    config = PlannerConfig(max_workers=8, reserve_bytes=LEARNED.reserve_bytes, parent_pid=1)
    planner = Planner(census=census, asks=asks, config=config, emit=records.append)
    planner.construct(0.0)
    return planner


def _run_one(planner: Planner, task: int, peak_bytes: int, now_s: float) -> None:
    planner.submit(task, "spread")
    verdict = planner.next_start(now_s)
    assert isinstance(verdict, Start)
    planner.started(verdict.task, verdict.device, 100 + task, now_s)
    report = PeakReport(device=0, device_peak_bytes=peak_bytes, device_source="simulator")
    planner.finished(verdict.task, report, now_s + 0.5)


def test_three_spread_peaks_on_a_24_gib_card_run_two_at_once_and_are_told() -> None:
    """Peaks 0.5, 4.0 and 1.0 GiB (each with a 0.3 GiB context), task_peak 4.2 GiB, on a 24
    GiB card: the old 99.9 % bound priced the key at 50.9 GiB (alone, at the serial floor);
    now its ask is the largest peak + the range (7.8 GiB), within the card's room, two or more
    run at once, and one peaks_vary record says why, with its terms."""
    records: list[Decision] = []
    planner = _planner(records, total_bytes=24 * GiB, task_peak=int(4.2 * GiB))
    context = int(0.3 * GiB)
    peaks = [GiB // 2 + context, 4 * GiB + context, GiB + context]
    assert _t_term(peaks) > 46 * GiB  # what the key was priced off the card by
    for task, peak in enumerate(peaks):
        _run_one(planner, task, peak, float(task))
    ask = planner.state.asks.ask("spread")
    room = planner.views.bound(0, ask).room_bytes
    assert room is not None and ask.ask_bytes <= room
    assert ask.ask_bytes == max(peaks) + (max(peaks) - min(peaks))
    assert planner.views.decide(ask)[0].width >= 2
    [told] = [r for r in records if r.event == "peaks_vary"]
    fields = told.to_dict()
    assert fields["key"] == "spread"
    assert fields["samples"] == 3
    assert fields["least_peak_bytes"] == min(peaks)
    assert fields["largest_peak_bytes"] == max(peaks)
    assert fields["peak_range_bytes"] == max(peaks) - min(peaks)
    assert fields["margin_bytes"] == ask.margin_bytes
    assert "size=" in told.reason
    _run_one(planner, 3, 2 * GiB, 4.0)  # a fourth sample: told once per key, not again
    assert len([r for r in records if r.event == "peaks_vary"]) == 1


def test_agreeing_peaks_are_not_told() -> None:
    """Peaks within 2x of each other are one workload: no peaks_vary record."""
    records: list[Decision] = []
    planner = _planner(records, total_bytes=24 * GiB, task_peak=4 * GiB)
    for task, peak in enumerate([3 * GiB, 5 * GiB, 4 * GiB, 5.9 * GiB]):
        _run_one(planner, task, int(peak), float(task))
    assert not [r for r in records if r.event == "peaks_vary"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=64 * MiB, max_value=40 * GiB), min_size=3, max_size=8))
def test_a_planner_never_prices_a_measured_key_past_its_card(peaks: list[int]) -> None:
    """Through the planner, on a 24 GiB card: a key whose largest peak fits the card's room
    is never priced past that room, whatever its peaks."""
    records: list[Decision] = []
    planner = _planner(records, total_bytes=24 * GiB, task_peak=40 * GiB)
    for task, peak in enumerate(peaks):
        _run_one(planner, task, peak, float(task))
    ask = planner.state.asks.ask("spread")
    room = planner.views.bound(0, ask).room_bytes
    assert room is not None
    if max(peaks) <= room:
        assert ask.ask_bytes <= room


def _run_sized(planner: Planner, task: int, peak_bytes: int, size: float, now_s: float) -> None:
    planner.submit(task, "sized", size=size)
    verdict = planner.next_start(now_s)
    assert isinstance(verdict, Start)
    planner.started(verdict.task, verdict.device, 100 + task, now_s)
    report = PeakReport(device=0, device_peak_bytes=peak_bytes, device_source="simulator")
    planner.finished(verdict.task, report, now_s + 0.5)


def test_a_key_whose_tasks_carry_sizes_is_not_told_to_give_sizes() -> None:
    """Peaks 0.5, 2, 1 and 4 GiB of tasks given size=1, 4, 2 and 8: they vary more than 2x,
    but with the sizes (the ask is predicted per size, and its key's own ask is not what
    gates them). No peaks_vary record tells the caller to give size=, which they did."""
    records: list[Decision] = []
    planner = _planner(records, total_bytes=24 * GiB, task_peak=4 * GiB)
    for task, size in enumerate([1, 4, 2, 8]):
        _run_sized(planner, task, int(size * GiB // 2), float(size), float(task))
    assert not [r for r in records if r.event == "peaks_vary"]


def test_peaks_apart_by_less_than_the_least_margin_are_not_told() -> None:
    """Peaks of 1, 3 and 2 MiB (allocator granules: the margin is the 64 MiB floor whatever
    their ratio): no peaks_vary WARNING, whose sentence would say a 64 MiB margin is at most
    a 2 MiB range."""
    records: list[Decision] = []
    planner = _planner(records, total_bytes=24 * GiB, task_peak=4 * GiB)
    for task, peak in enumerate([1 * MiB, 3 * MiB, 2 * MiB]):
        _run_one(planner, task, peak, float(task))
    assert not [r for r in records if r.event == "peaks_vary"]


@given(PEAKS, st.one_of(st.none(), st.integers(min_value=1 * GiB, max_value=100 * GiB)))
def test_a_key_told_its_peaks_vary_has_its_margin_within_their_range(
    peaks: list[int], room: int | None
) -> None:
    """Whenever the record is given, what it says holds: the margin is at most the range the
    peaks were measured over, and the terms are the ask's."""
    ask = _table(peaks, room).ask("k")
    found = varied_peaks(ask)
    if found is None:
        return
    _reason, terms = found
    assert terms["margin_bytes"] == ask.margin_bytes <= max(peaks) - min(peaks)
    assert terms["peak_range_bytes"] == max(peaks) - min(peaks)


def test_a_peak_just_below_the_room_is_priced_at_the_room_not_past_it() -> None:
    """One peak 1 MiB below the card's room for one task: the least learned margin (64 MiB)
    would price it past the room; the room comes first, the margin is the 1 MiB left, and
    the ask says it is held there."""
    room = 16 * GiB
    ask = _table([room - MiB], room).ask("k")
    assert ask.ask_bytes == room
    assert ask.margin_bytes == MiB < MARGIN_FLOOR_BYTES
    assert ask.room_capped


def test_a_size_just_past_those_measured_is_priced_on_the_card() -> None:
    """Four sized tasks (sizes 1-4, peaks 1, 4, 1.5 and 4.5 GiB: a line with wide residuals)
    on a 24 GiB card: the fit's 99.9 % bound (t = 22.3 with two degrees of freedom) priced a
    size-4.2 task at 56.7 GiB and a size-5 one at 66 GiB, so each ran alone at the serial
    floor. Past the sizes measured a sized ask is at most the key's ask scaled by the size
    (the peak grows at most in proportion to its input), and never past the card's room
    for one task where its predicted peak fits there."""
    records: list[Decision] = []
    planner = _planner(records, total_bytes=24 * GiB, task_peak=4 * GiB)
    for task, (size, peak) in enumerate([(1, 1.0), (2, 4.0), (3, 1.5), (4, 4.5)]):
        _run_sized(planner, task, int(peak * GiB), float(size), float(task))
    key_ask = planner.state.asks.ask("sized")
    room = planner.views.bound(0, key_ask).room_bytes
    assert room is not None
    for size in (4.2, 5.0, 8.0):
        ask = planner.state.asks.ask_for("sized", size)
        assert key_ask.ask_bytes <= ask.ask_bytes <= math.ceil(key_ask.ask_bytes * size / 4)
        assert ask.ask_bytes <= room
    huge = planner.state.asks.ask_for("sized", 40.0)  # predicted past nothing the card cannot hold
    assert huge.measured_peak_bytes is not None
    if huge.measured_peak_bytes <= room:
        assert huge.ask_bytes <= room


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 64), st.integers(min_value=64 * MiB, max_value=20 * GiB)),
        min_size=4,
        max_size=12,
    ),
    st.floats(min_value=0.5, max_value=256.0),
    st.integers(min_value=4 * GiB, max_value=80 * GiB),
)
def test_a_sized_ask_stays_on_the_card_where_its_prediction_does(
    samples: list[tuple[int, int]], size: float, room: int
) -> None:
    """With the card's room known: a sized ask whose predicted peak (and every peak
    measured) fits the room is never priced past it, unless an out-of-memory floor says so."""
    asks = AskTable(policy=LEARNED, default_estimate_bytes=NO_ESTIMATE)
    asks.limit_to_room(room)
    for each_size, peak in samples:
        asks.measure("k", peak, size=float(each_size))
    ask = asks.ask_for("k", size)
    predicted = ask.measured_peak_bytes or 0
    if max(p for _, p in samples) <= room and predicted <= room:
        assert ask.ask_bytes <= room


def test_a_key_whose_peaks_fit_both_cards_runs_on_both() -> None:
    """Two 24 GiB cards, one with a 1.5 GiB co-tenant (rooms 21.75 and 23.25 GiB), and a key
    with peaks 1, 20 and 2 GiB: held at the larger card's room (23.25 GiB) the key ran on
    that card alone, one task at a time, while the other held its 20 GiB peak too. The ask
    is held at the room of the tightest card that holds its largest peak with the least
    margin: two start at once, one on each card."""
    census = census_of(
        [
            card_census(device=0, total_bytes=24 * GiB, free_bytes=22 * GiB),
            card_census(device=1, total_bytes=24 * GiB, free_bytes=int(23.5 * GiB)),
        ],
        cpus=16,
        available_ram_bytes=128 * GiB,
    )
    asks = AskTable(policy=LEARNED, default_estimate_bytes=4 * GiB)
    config = PlannerConfig(max_workers=8, reserve_bytes=LEARNED.reserve_bytes, parent_pid=1)
    planner = Planner(census=census, asks=asks, config=config, emit=lambda _r: None)
    planner.construct(0.0)
    for task, peak in enumerate([1 * GiB, 20 * GiB, 2 * GiB]):
        _run_one(planner, task, peak, float(task))
    ask = planner.state.asks.ask("spread")
    rooms = [planner.views.bound(device, ask).room_bytes for device in (0, 1)]
    assert ask.room_capped and ask.ask_bytes == min(r for r in rooms if r is not None)
    for task in range(10, 14):
        planner.submit(task, "spread")
    devices = []
    while isinstance(verdict := planner.next_start(10.0), Start):
        planner.started(verdict.task, verdict.device, 500 + verdict.task, 10.0)
        devices.append(verdict.device)
    assert sorted(devices) == [0, 1]


@given(PEAKS, st.lists(st.integers(min_value=1 * GiB, max_value=100 * GiB), min_size=1, max_size=4))
def test_the_ask_fits_every_card_that_holds_its_largest_peak(
    peaks: list[int], rooms: list[int]
) -> None:
    """With several cards' rooms known: the ask fits the room of every card that holds the
    largest peak with the least learned margin; it never passes the largest room unless
    the largest peak does, and is never below the largest peak."""
    asks = AskTable(policy=LEARNED, default_estimate_bytes=NO_ESTIMATE)
    asks.limit_to_room(rooms)
    for peak in peaks:
        asks.measure("k", peak)
    ask = asks.ask("k")
    assert ask.ask_bytes >= max(peaks)
    for room in rooms:
        if room >= max(peaks) + MARGIN_FLOOR_BYTES:
            assert ask.ask_bytes <= room
    assert ask.ask_bytes <= max(max(rooms), max(peaks))


def test_a_running_task_is_rebooked_when_its_cards_room_shrinks() -> None:
    """Peaks 1, 20 and 2 GiB on a 24 GiB card: the ask is held at the card's room and a task
    runs booked there. The parent then takes 1 GiB of the card (its own high-water): the
    room, and the ask held at it, fall by 1 GiB, and the running task is booked at the new
    ask (it was left at the old one, a booking the key's price no longer says)."""
    records: list[Decision] = []
    planner = _planner(records, total_bytes=24 * GiB, task_peak=4 * GiB)
    for task, peak in enumerate([1 * GiB, 20 * GiB, 2 * GiB]):
        _run_one(planner, task, peak, float(task))
    before = planner.state.asks.ask("spread")
    assert before.room_capped
    planner.submit(10, "spread")
    verdict = planner.next_start(5.0)
    assert isinstance(verdict, Start)
    planner.started(verdict.task, verdict.device, 500, 5.0)
    reading = CardReading(
        free_bytes=2 * GiB, used_bytes=22 * GiB, process_bytes={1: GiB, 500: 20 * GiB}
    )
    planner.readings.observe(0, reading, 6.0)
    after = planner.state.asks.ask("spread")
    assert after.ask_bytes == before.ask_bytes - GiB
    [run] = planner.state.running.values()
    assert run.booked_bytes == after.ask_bytes


def test_room_freed_by_another_pool_at_census_lifts_the_held_ask_at_the_next_measure() -> None:
    """Peaks 1, 20 and 2 GiB on a 24 GiB card whose census counted 0.5 GiB of co-tenant: the
    ask is held at the card's room. Another pool's task is found to hold that 0.5 GiB (the
    census' co-tenant bytes are that pool's, priced by its booking instead): the room for one
    task alone grows by 0.5 GiB, and the key's next measured peak is held at the new room."""
    records: list[Decision] = []
    planner = _planner(records, total_bytes=24 * GiB, task_peak=4 * GiB)
    for task, peak in enumerate([1 * GiB, 20 * GiB, 2 * GiB]):
        _run_one(planner, task, peak, float(task))
    before = planner.state.asks.ask("spread")
    assert before.room_capped
    uuid = planner.state.cards[0].census.uuid
    assert uuid is not None
    other = PoolBooking(
        pool_id="700.1",
        pid=700,
        start="s",
        label="other",
        updated_s=0.0,
        tasks=(TaskBooking(worker_pid=701, key="o", booked_bytes=GiB // 2, reached_bytes=0),),
    )
    planner.neighbours.observe_others(
        0, OtherPools(card_uuid=uuid, pools=(other,)), 4.0, census=True, rows={701: GiB // 2}
    )
    planner.neighbours.observe_others(0, OtherPools(card_uuid=uuid), 4.5)  # its task ended
    _run_one(planner, 3, 2 * GiB, 5.0)
    after = planner.state.asks.ask("spread")
    assert after.room_capped
    assert after.ask_bytes == before.ask_bytes + GiB // 2
