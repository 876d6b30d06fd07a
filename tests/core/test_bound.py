"""The bound, the ceiling and the width decision, as properties over random censuses.

Widths are the planner's own: each card priced by its fit and the ceiling shared out by
``card_widths`` (:mod:`support.fit` asks them as the planner's ``decide`` does), so these
properties hold of the computation every record's width states.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool._core.bound import (
    Ceiling,
    WidthDecision,
    derive_bound,
    derive_ceiling,
    live_gate_admits,
)
from gpupool._core.census import CardCensus
from gpupool._core.planner.fit import Booked
from gpupool._core.units import GiB
from support import card_census
from support.fit import flat_ask, planner_card, planner_fit, planner_width, planner_widths

# Sizes are drawn in whole MiB-ish steps up to a few hundred GiB: the
# arithmetic is integer, so the scale only has to look like real cards.
_CARD_TOTAL = st.integers(min_value=1, max_value=300 * GiB)


def card(
    *,
    device: int = 0,
    total: int | None,
    free: int | None,
    own: int | None = 0,
    unified: bool = False,
) -> CardCensus:
    """A census row with only the terms the bound reads."""
    return card_census(
        device=device, total_bytes=total, free_bytes=free, own_bytes=own, unified=unified
    )


@dataclass(frozen=True)
class Terms:
    """One card's census and the terms the planner prices it with."""

    census: CardCensus
    ask: int
    own_high_water: int = 0
    reserve: int = 0

    def width(self, ceiling: Ceiling) -> WidthDecision:
        """The planner's width for a one-card pool on these terms."""
        return planner_width(
            self.census,
            self.ask,
            ceiling=ceiling,
            own_high_water_bytes=self.own_high_water,
            reserve_bytes=self.reserve,
        )


def width_of(
    census: CardCensus, *, ask: int, own_high_water: int = 0, reserve: int = 0, ceiling: Ceiling
) -> WidthDecision:
    """The planner's width for a one-card pool on ``census`` at ``ask``."""
    return Terms(census, ask, own_high_water, reserve).width(ceiling)


@st.composite
def readable_cards(draw: st.DrawFn, device: int = 0) -> CardCensus:
    """A readable card: total, then how much is used, then how much of that is us."""
    total = draw(_CARD_TOTAL)
    used = draw(st.integers(min_value=0, max_value=total))
    own = draw(st.integers(min_value=0, max_value=used))
    return card(device=device, total=total, free=total - used, own=own)


@st.composite
def terms(draw: st.DrawFn, device: int = 0) -> Terms:
    """A readable card's terms, with room anywhere from very negative to the whole card."""
    census = draw(readable_cards(device))
    assert census.total_bytes is not None
    total = census.total_bytes
    return Terms(
        census,
        ask=draw(st.integers(min_value=1, max_value=total)),
        own_high_water=draw(st.integers(min_value=0, max_value=total)),
        reserve=draw(st.integers(min_value=0, max_value=total // 4)),
    )


@st.composite
def ceilings(draw: st.DrawFn) -> Ceiling:
    """A ceiling with each optional term either unknown or a plausible value."""
    return derive_ceiling(
        max_workers=draw(st.integers(min_value=1, max_value=64)),
        cpus=draw(st.none() | st.integers(min_value=1, max_value=256)),
        host_ram_bytes=draw(st.none() | st.integers(min_value=0, max_value=2048 * GiB)),
        child_rss_bytes=draw(st.none() | st.integers(min_value=1, max_value=64 * GiB)),
        pending_items=draw(st.none() | st.integers(min_value=0, max_value=10_000)),
    )


# --- one device --------------------------------------------------------------


@given(terms(), ceilings())
def test_width_times_ask_plus_residents_fits_the_card(card_terms: Terms, ceiling: Ceiling) -> None:
    """Whenever width > 1: width*ask + co_tenant + own_high_water + reserve <= total."""
    decision = card_terms.width(ceiling)
    bound = decision.bound
    assert bound.total_bytes is not None
    assert bound.co_tenant_bytes is not None
    assert bound.ask_bytes == card_terms.ask
    assert bound.reserve_bytes == card_terms.reserve
    if decision.width > 1:
        priced = (
            decision.width * bound.ask_bytes
            + bound.co_tenant_bytes
            + bound.own_high_water_bytes
            + bound.reserve_bytes
        )
        assert priced <= bound.total_bytes


@given(terms(), ceilings())
def test_one_device_width_is_at_least_one(card_terms: Terms, ceiling: Ceiling) -> None:
    """A one-device pool always runs at least one task (the serial floor)."""
    assert card_terms.width(ceiling).width >= 1


@given(terms(), ceilings())
def test_width_never_exceeds_any_ceiling_term(card_terms: Terms, ceiling: Ceiling) -> None:
    """Width is within max_workers, CPUs, host RAM at child RSS, and pending items."""
    width = card_terms.width(ceiling).width
    assert width <= ceiling.value
    assert width <= ceiling.max_workers
    if ceiling.cpus is not None:
        assert width <= max(1, ceiling.cpus)
    if ceiling.host_ram_bytes is not None and ceiling.child_rss_bytes:
        assert width <= max(1, ceiling.host_ram_bytes // ceiling.child_rss_bytes)
    if ceiling.pending_items is not None:
        assert width <= max(1, ceiling.pending_items)


@given(terms(), ceilings())
def test_width_is_what_the_room_holds_within_the_ceiling(
    card_terms: Terms, ceiling: Ceiling
) -> None:
    """One device: width is exactly clamp(floor(room / ask), 1, ceiling), and its limit says
    what stops one more: the floor when none fit, the ceiling when its slots are all taken
    (a room that holds exactly the ceiling names the ceiling), else the memory bound."""
    decision = card_terms.width(ceiling)
    bound = decision.bound
    assert bound.room_bytes is not None
    fits = max(0, bound.room_bytes // bound.ask_bytes)
    assert bound.tasks_fit == fits
    assert decision.width == max(1, min(fits, ceiling.value))
    if fits == 0:
        assert decision.limit == "floor"
    elif fits >= ceiling.value:
        assert decision.limit == ceiling.limit
    else:
        assert decision.limit == "memory"


@given(
    readable_cards(),
    st.integers(min_value=0, max_value=300 * GiB),
    st.integers(min_value=1, max_value=64 * GiB),
    ceilings(),
)
def test_a_growing_co_tenant_never_widens(
    census: CardCensus, growth: int, ask: int, ceiling: Ceiling
) -> None:
    """Less free memory at census (a larger co-tenant) never gives a wider pool."""
    assert census.free_bytes is not None
    grown = card(
        total=census.total_bytes,
        free=census.free_bytes - min(growth, census.free_bytes),
        own=census.own_bytes,
    )
    before = width_of(census, ask=ask, ceiling=ceiling)
    after = width_of(grown, ask=ask, ceiling=ceiling)
    assert grown.co_tenant_bytes is not None
    assert census.co_tenant_bytes is not None
    assert grown.co_tenant_bytes >= census.co_tenant_bytes
    assert after.bound.co_tenant_bytes == grown.co_tenant_bytes
    assert after.width <= before.width


@given(
    readable_cards(),
    st.integers(min_value=0, max_value=64 * GiB),
    st.integers(min_value=1, max_value=64 * GiB),
    st.integers(min_value=1, max_value=64 * GiB),
    ceilings(),
)
def test_a_measurement_moves_width_either_way_but_never_past_the_room(
    census: CardCensus, own_high_water: int, estimate: int, measured: int, ceiling: Ceiling
) -> None:
    """Replacing the estimated ask by a measured one moves width with the ask, within the room."""
    before = width_of(census, ask=estimate, own_high_water=own_high_water, ceiling=ceiling)
    after = planner_width(
        census,
        flat_ask(measured, basis="measured"),
        ceiling=ceiling,
        own_high_water_bytes=own_high_water,
    )
    bound = after.bound
    assert (bound.ask_bytes, bound.ask_basis) == (measured, "measured")
    assert bound.room_bytes is not None
    assert bound.room_bytes == before.bound.room_bytes
    if after.width > 1:
        assert after.width * measured <= bound.room_bytes
    if measured < estimate:
        assert after.width >= before.width
    elif measured > estimate:
        assert after.width <= before.width


@given(readable_cards(), st.integers(min_value=0, max_value=300 * GiB))
def test_own_high_water_is_at_least_the_census_own_bytes(census: CardCensus, given: int) -> None:
    """The bound prices our own bytes at no less than the census saw, even if told less."""
    bound = derive_bound(
        census, own_high_water_bytes=given, reserve_bytes=0, ask_bytes=1, ask_basis="estimated"
    )
    assert census.own_bytes is not None
    assert bound.own_high_water_bytes == max(given, census.own_bytes)
    planned = width_of(census, ask=1, own_high_water=given, ceiling=derive_ceiling(max_workers=1))
    assert planned.bound.own_high_water_bytes == max(given, census.own_bytes)


@pytest.mark.parametrize(
    ("total", "free"),
    [
        pytest.param(None, None, id="nothing-read"),
        pytest.param(80 * GiB, None, id="free-unreadable"),
        pytest.param(None, 40 * GiB, id="total-unreadable"),
    ],
)
def test_an_unreadable_card_runs_one_task_with_its_reason(
    total: int | None, free: int | None
) -> None:
    """Unreadable is not empty: width 1, limit "unreadable", room None (never -1 or 0)."""
    census = card(total=total, free=free, own=None)
    decision = width_of(census, ask=1 * GiB, ceiling=derive_ceiling(max_workers=8))
    bound = decision.bound
    assert bound.room_bytes is None
    assert bound.co_tenant_bytes is None
    assert bound.tasks_fit is None
    assert (decision.width, decision.limit) == (1, "unreadable")
    assert decision.describe().startswith("card 0: unreadable, so its room is unknown; width 1")


@given(
    readable_cards(),
    st.integers(min_value=1, max_value=64 * GiB),
    st.integers(min_value=1, max_value=64 * GiB),
    st.integers(min_value=0, max_value=GiB),
    ceilings(),
)
def test_an_oversubscribed_card_falls_to_the_floor_with_its_negative_room(
    census: CardCensus, over: int, ask: int, reserve: int, ceiling: Ceiling
) -> None:
    """Negative room is a real, oversubscribed card: width 1, limit "floor", room kept negative."""
    assert census.total_bytes is not None
    assert census.co_tenant_bytes is not None
    # Our own high-water grows past what the co-tenant left, by ``over`` bytes
    # (or by more, when the reserve alone already oversubscribes the card).
    own_high_water = max(0, census.total_bytes - census.co_tenant_bytes - reserve + over)
    decision = width_of(
        census, ask=ask, own_high_water=own_high_water, reserve=reserve, ceiling=ceiling
    )
    bound = decision.bound
    assert bound.room_bytes == (
        census.total_bytes - census.co_tenant_bytes - bound.own_high_water_bytes - reserve
    )
    assert bound.room_bytes <= -over
    assert (decision.width, decision.limit) == (1, "floor")


def test_one_byte_oversubscribed_is_negative_not_unreadable() -> None:
    """A card one byte over has room -1 byte and takes the floor, not the unreadable branch."""
    census = card(total=10 * GiB, free=4 * GiB, own=0)
    decision = width_of(
        census, ask=GiB, own_high_water=4 * GiB + 1, ceiling=derive_ceiling(max_workers=4)
    )
    assert decision.bound.room_bytes == -1
    assert (decision.width, decision.limit) == (1, "floor")
    assert "-1 B of room" in decision.describe()


def test_derive_bound_refuses_a_non_positive_ask() -> None:
    """An ask of zero bytes would divide the room by nothing: refused by name."""
    with pytest.raises(ValueError, match=r"^ask_bytes must be positive, got 0$"):
        derive_bound(
            card(total=GiB, free=GiB),
            own_high_water_bytes=0,
            reserve_bytes=0,
            ask_bytes=0,
            ask_basis="estimated",
        )


@given(
    readable_cards(),
    st.booleans(),
    st.integers(min_value=1, max_value=64 * GiB),
    st.integers(min_value=0, max_value=64 * GiB),
    st.integers(min_value=0, max_value=GiB),
    ceilings(),
    st.integers(min_value=1, max_value=10_000),
)
def test_the_bounds_count_is_the_fits_on_an_empty_card(
    census: CardCensus,
    unified: bool,
    ask: int,
    own_high_water: int,
    reserve: int,
    ceiling: Ceiling,
    slots: int,
) -> None:
    """``Bound.tasks_fit`` (the ``tasks_fit`` every record carries, the plot's limit line) is
    the fit's count on the card with nothing running, child RSS and all on unified memory."""
    on = card(
        total=census.total_bytes, free=census.free_bytes, own=census.own_bytes, unified=unified
    )
    found = planner_fit(
        planner_card(on, index=0, own_high_water_bytes=own_high_water),
        ask,
        ceiling=ceiling,
        reserve_bytes=reserve,
        slots=slots,
    )
    bound = found.bound
    assert bound.room_bytes is not None
    assert bound.tasks_fit is not None
    assert bound.host_per_task_bytes == ((ceiling.child_rss_bytes or 0) if unified else 0)
    assert found.more == min(slots, bound.tasks_fit)
    assert bound.tasks_fit == max(0, bound.room_bytes // (ask + bound.host_per_task_bytes))


# --- the ceiling ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("terms", "value", "limit"),
    [
        pytest.param({"max_workers": 4}, 4, "max_workers", id="max-workers-only"),
        pytest.param({"max_workers": 8, "cpus": 3}, 3, "cpus", id="cpus"),
        pytest.param(
            {"max_workers": 8, "host_ram_bytes": 10 * GiB, "child_rss_bytes": 4 * GiB},
            2,
            "host_ram",
            id="host-ram",
        ),
        pytest.param({"max_workers": 8, "pending_items": 5}, 5, "pending", id="pending"),
        pytest.param({"max_workers": 4, "cpus": 4}, 4, "max_workers", id="tie-to-earlier"),
        pytest.param({"max_workers": 8, "cpus": 0}, 1, "cpus", id="zero-cpus-floor-1"),
        pytest.param({"max_workers": 8, "pending_items": 0}, 1, "pending", id="no-pending-floor-1"),
        pytest.param(
            {"max_workers": 8, "host_ram_bytes": GiB, "child_rss_bytes": 4 * GiB},
            1,
            "host_ram",
            id="ram-short-floor-1",
        ),
        pytest.param(
            {"max_workers": 8, "host_ram_bytes": None, "child_rss_bytes": 4 * GiB},
            8,
            "max_workers",
            id="unknown-ram-does-not-cap",
        ),
        pytest.param(
            {"max_workers": 8, "host_ram_bytes": GiB, "child_rss_bytes": None},
            8,
            "max_workers",
            id="unmeasured-rss-does-not-cap",
        ),
    ],
)
def test_ceiling_is_its_least_term(terms: dict[str, int | None], value: int, limit: str) -> None:
    """The ceiling is the least known term, at least 1, and names which term it is."""
    ceiling = derive_ceiling(**terms)  # type: ignore[arg-type]
    assert (ceiling.value, ceiling.limit) == (value, limit)


def test_derive_ceiling_refuses_zero_workers() -> None:
    """max_workers below 1 is refused, as CPython's executors refuse it."""
    with pytest.raises(ValueError, match=r"^max_workers must be at least 1, got 0$"):
        derive_ceiling(max_workers=0)


# --- several devices -------------------------------------------------------------


def test_a_card_without_room_gets_zero_while_another_has_room() -> None:
    """With two cards, the oversubscribed one gets width 0 and the roomy one takes the work."""
    full = card(device=0, total=24 * GiB, free=1 * GiB)
    roomy = card(device=1, total=24 * GiB, free=20 * GiB)
    decisions = planner_widths((full, roomy), 4 * GiB, ceiling=derive_ceiling(max_workers=16))
    assert [(d.device, d.width, d.limit) for d in decisions] == [
        (0, 0, "no_room"),
        (1, 5, "memory"),
    ]


@dataclass(frozen=True)
class Cards:
    """A pool's cards (some unreadable) and the terms the planner prices them all with: one
    ask and one reserve for the pool, an own high-water per card."""

    censuses: list[CardCensus]
    own_high_waters: list[int]
    ask: int
    reserve: int

    def widths(self, ceiling: Ceiling) -> tuple[WidthDecision, ...]:
        return planner_widths(
            self.censuses,
            self.ask,
            ceiling=ceiling,
            own_high_water_bytes=self.own_high_waters,
            reserve_bytes=self.reserve,
        )


@st.composite
def several_cards(draw: st.DrawFn) -> Cards:
    """One to eight devices, numbered in order, some of them unreadable."""
    count = draw(st.integers(min_value=1, max_value=8))
    censuses = [
        card(device=i, total=None, free=None, own=None)
        if draw(st.integers(0, 4)) == 0
        else draw(readable_cards(i))
        for i in range(count)
    ]
    largest = max([c.total_bytes or 1 for c in censuses])
    return Cards(
        censuses,
        [draw(st.integers(min_value=0, max_value=c.total_bytes or 0)) for c in censuses],
        ask=draw(st.integers(min_value=1, max_value=largest)),
        reserve=draw(st.integers(min_value=0, max_value=largest // 4)),
    )


@given(several_cards(), ceilings())
def test_total_width_stays_within_the_ceiling_and_each_room(many: Cards, ceiling: Ceiling) -> None:
    """Across devices the widths sum to between 1 and the ceiling, each within its own room; an
    unreadable card runs its one task unless the ceiling's slots all went to other cards."""
    decisions = many.widths(ceiling)
    total = sum(d.width for d in decisions)
    assert [d.device for d in decisions] == list(range(len(many.censuses)))
    assert 1 <= total <= ceiling.value
    for decision in decisions:
        bound = decision.bound
        assert bound.ask_bytes == many.ask
        if bound.room_bytes is None:
            assert (decision.width, decision.limit) in {(1, "unreadable"), (0, ceiling.limit)}
            if decision.width == 0:
                assert total == ceiling.value
        elif decision.width > 0 and decision.limit != "floor":
            assert decision.width * bound.ask_bytes <= bound.room_bytes


@given(
    st.lists(
        st.tuples(
            st.integers(min_value=1, max_value=80 * GiB),  # total
            st.integers(min_value=1, max_value=40 * GiB),  # how far over
        ),
        min_size=1,
        max_size=8,
    ),
    ceilings(),
)
def test_all_oversubscribed_gives_one_task_to_the_card_with_most_room(
    rows: list[tuple[int, int]], ceiling: Ceiling
) -> None:
    """No card has room: exactly one gets width 1, the one with most room; all name the floor."""
    decisions = planner_widths(
        [card(device=i, total=total, free=0, own=0) for i, (total, _) in enumerate(rows)],
        GiB,
        ceiling=ceiling,
        own_high_water_bytes=[over for _, over in rows],
    )
    rooms = [d.bound.room_bytes for d in decisions]
    assert rooms == [-over for _, over in rows]
    best = max(range(len(rows)), key=lambda i: (-rows[i][1], -i))
    assert [d.width for d in decisions] == [1 if i == best else 0 for i in range(len(rows))]
    assert [d.limit for d in decisions] == ["floor"] * len(rows)
    for decision in decisions:
        assert "another card has room" not in decision.describe()


def test_readable_cards_with_most_room_are_filled_first() -> None:
    """Under a tight ceiling, the card with the most room gets the width, not the first card."""
    small = card(device=0, total=16 * GiB, free=8 * GiB)
    large = card(device=1, total=80 * GiB, free=80 * GiB)
    decisions = planner_widths(
        (small, large), 2 * GiB, ceiling=derive_ceiling(max_workers=8, cpus=3)
    )
    assert [(d.width, d.limit) for d in decisions] == [(0, "cpus"), (3, "cpus")]


def test_an_unreadable_card_beside_oversubscribed_ones_takes_the_serial_task() -> None:
    """An unreadable card gets its one task; oversubscribed readable cards get none."""
    over = card(device=0, total=8 * GiB, free=0)
    unknown = card(device=1, total=None, free=None, own=None)
    decisions = planner_widths(
        (over, unknown), GiB, ceiling=derive_ceiling(max_workers=4), own_high_water_bytes=GiB
    )
    assert [(d.width, d.limit) for d in decisions] == [(0, "no_room"), (1, "unreadable")]


def test_no_devices_means_no_device_widths() -> None:
    """A pool without devices has no per-device widths at all."""
    assert planner_widths((), GiB, ceiling=derive_ceiling(max_workers=4)) == ()


# --- admission -------------------------------------------------------------------


def _card_with_room(room: int) -> tuple[CardCensus, int]:
    """An empty card and the own high-water that leaves it ``room`` bytes."""
    total = max(0, room) + 8 * GiB
    return card(total=total, free=total), total - room


@given(
    st.integers(min_value=1, max_value=64 * GiB),
    st.integers(min_value=0, max_value=40),
    st.integers(min_value=0),
)
def test_equal_asks_admit_exactly_floor_room_over_ask(ask: int, count: int, spare: int) -> None:
    """Admitting equal asks one by one (the fit beside the ones placed, one slot at a time)
    stops after exactly floor(room / ask) tasks, the count the fit gives at once."""
    room = count * ask + spare % ask
    census, own_high_water = _card_with_room(room)
    on = planner_card(census, index=0, own_high_water_bytes=own_high_water)
    ceiling = derive_ceiling(max_workers=64)
    assert planner_fit(on, ask, ceiling=ceiling).bound.room_bytes == room
    running: list[Booked] = []
    while planner_fit(on, ask, running, ceiling=ceiling, slots=1).more:
        running.append(Booked("task", ask))
        assert len(running) <= count  # a bug here would otherwise loop forever
    assert len(running) == room // ask
    assert planner_fit(on, ask, ceiling=ceiling).more == room // ask


@given(
    st.lists(st.integers(min_value=1, max_value=16 * GiB), max_size=20),
    st.integers(min_value=-8 * GiB, max_value=64 * GiB),
)
def test_mixed_asks_are_admitted_only_while_their_sum_fits(asks: list[int], room: int) -> None:
    """A task starts only if booked asks plus its own fit the room; a refusal would overflow."""
    census, own_high_water = _card_with_room(room)
    on = planner_card(census, index=0, own_high_water_bytes=own_high_water)
    ceiling = derive_ceiling(max_workers=64)
    running: list[Booked] = []
    for i, ask in enumerate(asks):
        found = planner_fit(on, flat_ask(ask, key=f"k{i}"), running, ceiling=ceiling, slots=1)
        assert found.bound.room_bytes == room
        if found.more:
            running.append(Booked(f"k{i}", ask))
            assert sum(r.booked_bytes for r in running) <= room
        else:
            assert sum(r.booked_bytes for r in running) + ask > room


def test_an_unreadable_card_admits_one_task_at_a_time() -> None:
    """With no room known, a task is admitted only when nothing else runs there."""
    on = planner_card(card(total=None, free=None, own=None), index=0)
    ceiling = derive_ceiling(max_workers=8)
    alone = planner_fit(on, GiB, ceiling=ceiling, slots=1)
    assert (alone.more, alone.limit) == (1, "unreadable")
    assert planner_fit(on, 1, [Booked("other", GiB)], ceiling=ceiling, slots=1).more == 0


@pytest.mark.parametrize(
    ("live_free", "expected"),
    [
        pytest.param(None, True, id="unknown-reading-does-not-gate"),
        pytest.param(10 * GiB, True, id="exactly-covered"),
        pytest.param(10 * GiB - 1, False, id="one-byte-short"),
        pytest.param(0, False, id="card-full"),
    ],
)
def test_live_gate_covers_ask_unreached_and_reserve(live_free: int | None, expected: bool) -> None:
    """Live free bytes must cover the new ask, the in-flight unreached bytes and the reserve."""
    assert (
        live_gate_admits(
            live_free_bytes=live_free,
            ask_bytes=6 * GiB,
            unreached_bytes=3 * GiB,
            reserve_bytes=1 * GiB,
        )
        is expected
    )


@given(
    st.integers(min_value=0, max_value=200 * GiB),
    st.integers(min_value=0, max_value=64 * GiB),
    st.integers(min_value=0, max_value=64 * GiB),
    st.integers(min_value=0, max_value=GiB),
)
def test_live_gate_is_the_sum_inequality(free: int, ask: int, unreached: int, reserve: int) -> None:
    """live_gate_admits is exactly ``free >= ask + unreached + reserve``."""
    assert live_gate_admits(
        live_free_bytes=free, ask_bytes=ask, unreached_bytes=unreached, reserve_bytes=reserve
    ) == (free >= ask + unreached + reserve)
