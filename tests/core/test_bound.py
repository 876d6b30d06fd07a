"""The bound, the ceiling and the width decision, as properties over random censuses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool._core import (
    Bound,
    CardCensus,
    Ceiling,
    admits,
    decide_width,
    decide_widths,
    derive_bound,
    derive_ceiling,
    live_gate_admits,
)
from gpupool._core.units import GiB
from support import card_census

# Sizes are drawn in whole MiB-ish steps up to a few hundred GiB: the
# arithmetic is integer, so the scale only has to look like real cards.
_CARD_TOTAL = st.integers(min_value=1, max_value=300 * GiB)


def card(
    *,
    device: int = 0,
    total: int | None,
    free: int | None,
    own: int | None = 0,
) -> CardCensus:
    """A census row with only the terms the bound reads."""
    return card_census(device=device, total_bytes=total, free_bytes=free, own_bytes=own)


def bound_for(census: CardCensus, *, ask: int, own_high_water: int = 0, reserve: int = 0) -> Bound:
    return derive_bound(
        census,
        own_high_water_bytes=own_high_water,
        reserve_bytes=reserve,
        ask_bytes=ask,
        ask_basis="estimated",
    )


@st.composite
def readable_cards(draw: st.DrawFn, device: int = 0) -> CardCensus:
    """A readable card: total, then how much is used, then how much of that is us."""
    total = draw(_CARD_TOTAL)
    used = draw(st.integers(min_value=0, max_value=total))
    own = draw(st.integers(min_value=0, max_value=used))
    return card(device=device, total=total, free=total - used, own=own)


@st.composite
def bounds(draw: st.DrawFn, device: int = 0) -> Bound:
    """A bound over a readable card, with room anywhere from very negative to the whole card."""
    census = draw(readable_cards(device))
    assert census.total_bytes is not None
    total = census.total_bytes
    return bound_for(
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


@given(bounds(), ceilings())
def test_width_times_ask_plus_residents_fits_the_card(bound: Bound, ceiling: Ceiling) -> None:
    """Whenever width > 1: width*ask + co_tenant + own_high_water + reserve <= total."""
    decision = decide_width(bound, ceiling)
    assert bound.total_bytes is not None
    assert bound.co_tenant_bytes is not None
    if decision.width > 1:
        priced = (
            decision.width * bound.ask_bytes
            + bound.co_tenant_bytes
            + bound.own_high_water_bytes
            + bound.reserve_bytes
        )
        assert priced <= bound.total_bytes


@given(bounds(), ceilings())
def test_one_device_width_is_at_least_one(bound: Bound, ceiling: Ceiling) -> None:
    """A one-device pool always runs at least one task (the serial floor)."""
    assert decide_width(bound, ceiling).width >= 1


@given(bounds(), ceilings())
def test_width_never_exceeds_any_ceiling_term(bound: Bound, ceiling: Ceiling) -> None:
    """Width is within max_workers, CPUs, host RAM at child RSS, and pending items."""
    width = decide_width(bound, ceiling).width
    assert width <= ceiling.value
    assert width <= ceiling.max_workers
    if ceiling.cpus is not None:
        assert width <= max(1, ceiling.cpus)
    if ceiling.host_ram_bytes is not None and ceiling.child_rss_bytes:
        assert width <= max(1, ceiling.host_ram_bytes // ceiling.child_rss_bytes)
    if ceiling.pending_items is not None:
        assert width <= max(1, ceiling.pending_items)


@given(bounds(), ceilings())
def test_width_is_what_the_room_holds_within_the_ceiling(bound: Bound, ceiling: Ceiling) -> None:
    """One device: width is exactly clamp(floor(room / ask), 1, ceiling), and its limit says why."""
    decision = decide_width(bound, ceiling)
    assert bound.room_bytes is not None
    fits = max(0, bound.room_bytes // bound.ask_bytes)
    assert decision.width == max(1, min(fits, ceiling.value))
    if fits == 0:
        assert decision.limit == "floor"
    elif fits > ceiling.value:
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
    before = decide_width(bound_for(census, ask=ask), ceiling)
    after = decide_width(bound_for(grown, ask=ask), ceiling)
    assert grown.co_tenant_bytes is not None
    assert census.co_tenant_bytes is not None
    assert grown.co_tenant_bytes >= census.co_tenant_bytes
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
    before = decide_width(bound_for(census, ask=estimate, own_high_water=own_high_water), ceiling)
    bound = derive_bound(
        census,
        own_high_water_bytes=own_high_water,
        reserve_bytes=0,
        ask_bytes=measured,
        ask_basis="measured",
    )
    after = decide_width(bound, ceiling)
    assert bound.room_bytes is not None
    if after.width > 1:
        assert after.width * measured <= bound.room_bytes
    if measured < estimate:
        assert after.width >= before.width
    elif measured > estimate:
        assert after.width <= before.width


@given(readable_cards(), st.integers(min_value=0, max_value=300 * GiB))
def test_own_high_water_is_at_least_the_census_own_bytes(census: CardCensus, given: int) -> None:
    """The bound prices our own bytes at no less than the census saw, even if told less."""
    bound = bound_for(census, ask=1, own_high_water=given)
    assert census.own_bytes is not None
    assert bound.own_high_water_bytes == max(given, census.own_bytes)


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
    bound = bound_for(card(total=total, free=free, own=None), ask=1 * GiB)
    decision = decide_width(bound, derive_ceiling(max_workers=8))
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
    bound = bound_for(census, ask=ask, own_high_water=own_high_water, reserve=reserve)
    decision = decide_width(bound, ceiling)
    assert bound.room_bytes == (
        census.total_bytes - census.co_tenant_bytes - bound.own_high_water_bytes - reserve
    )
    assert bound.room_bytes <= -over
    assert (decision.width, decision.limit) == (1, "floor")


def test_one_byte_oversubscribed_is_negative_not_unreadable() -> None:
    """A card one byte over has room -1 byte and takes the floor, not the unreadable branch."""
    census = card(total=10 * GiB, free=4 * GiB, own=0)
    bound = bound_for(census, ask=GiB, own_high_water=4 * GiB + 1)
    decision = decide_width(bound, derive_ceiling(max_workers=4))
    assert bound.room_bytes == -1
    assert (decision.width, decision.limit) == (1, "floor")
    assert "-1 B of room" in decision.describe()


def test_derive_bound_refuses_a_non_positive_ask() -> None:
    """An ask of zero bytes would divide the room by nothing: refused by name."""
    with pytest.raises(ValueError, match=r"^ask_bytes must be positive, got 0$"):
        bound_for(card(total=GiB, free=GiB), ask=0)


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
    full = bound_for(card(device=0, total=24 * GiB, free=1 * GiB), ask=4 * GiB)
    roomy = bound_for(card(device=1, total=24 * GiB, free=20 * GiB), ask=4 * GiB)
    decisions = decide_widths((full, roomy), derive_ceiling(max_workers=16))
    assert [(d.device, d.width, d.limit) for d in decisions] == [
        (0, 0, "no_room"),
        (1, 5, "memory"),
    ]


def _unreadable_bound(device: int) -> Bound:
    return bound_for(card(device=device, total=None, free=None, own=None), ask=GiB)


@st.composite
def several_bounds(draw: st.DrawFn) -> list[Bound]:
    """One to eight devices, numbered in order, some of them unreadable."""
    count = draw(st.integers(min_value=1, max_value=8))
    return [
        _unreadable_bound(i) if draw(st.integers(0, 4)) == 0 else draw(bounds(i))
        for i in range(count)
    ]


@given(several_bounds(), ceilings())
def test_total_width_stays_within_the_ceiling_and_each_room(
    many: list[Bound], ceiling: Ceiling
) -> None:
    """Across devices the widths sum to between 1 and the ceiling, each within its own room."""
    decisions = decide_widths(many, ceiling)
    assert [d.device for d in decisions] == list(range(len(many)))
    assert 1 <= sum(d.width for d in decisions) <= ceiling.value
    for decision, bound in zip(decisions, many, strict=True):
        if bound.room_bytes is None:
            assert decision.width <= 1
            assert decision.limit == "unreadable"
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
    many = [
        bound_for(card(device=i, total=total, free=0, own=0), ask=GiB, own_high_water=over)
        for i, (total, over) in enumerate(rows)
    ]
    decisions = decide_widths(many, ceiling)
    rooms = [b.room_bytes for b in many]
    assert all(room is not None and room < 0 for room in rooms)
    best = max(range(len(many)), key=lambda i: (rooms[i], -i))
    assert [d.width for d in decisions] == [1 if i == best else 0 for i in range(len(many))]
    assert [d.limit for d in decisions] == ["floor"] * len(many)
    for decision in decisions:
        assert "another card has room" not in decision.describe()


def test_readable_cards_with_most_room_are_filled_first() -> None:
    """Under a tight ceiling, the card with the most room gets the width, not the first card."""
    small = bound_for(card(device=0, total=16 * GiB, free=8 * GiB), ask=2 * GiB)
    large = bound_for(card(device=1, total=80 * GiB, free=80 * GiB), ask=2 * GiB)
    decisions = decide_widths((small, large), derive_ceiling(max_workers=8, cpus=3))
    assert [(d.width, d.limit) for d in decisions] == [(0, "cpus"), (3, "cpus")]


def test_an_unreadable_card_beside_oversubscribed_ones_takes_the_serial_task() -> None:
    """An unreadable card gets its one task; oversubscribed readable cards get none."""
    over = bound_for(card(device=0, total=8 * GiB, free=0), ask=GiB, own_high_water=GiB)
    unknown = bound_for(card(device=1, total=None, free=None, own=None), ask=GiB)
    decisions = decide_widths((over, unknown), derive_ceiling(max_workers=4))
    assert [(d.width, d.limit) for d in decisions] == [(0, "no_room"), (1, "unreadable")]


def test_no_devices_means_no_device_widths() -> None:
    """A pool without devices has no per-device widths at all."""
    assert decide_widths((), derive_ceiling(max_workers=4)) == ()


# --- admission -------------------------------------------------------------------


@given(
    st.integers(min_value=1, max_value=64 * GiB),
    st.integers(min_value=0, max_value=40),
    st.integers(min_value=0),
)
def test_equal_asks_admit_exactly_floor_room_over_ask(ask: int, count: int, spare: int) -> None:
    """Admitting equal asks one by one stops after exactly floor(room / ask) tasks."""
    room = count * ask + spare % ask
    running: list[int] = []
    while admits(ask, running, room):
        running.append(ask)
        assert len(running) <= count  # a bug here would otherwise loop forever
    assert len(running) == room // ask


@given(
    st.lists(st.integers(min_value=1, max_value=16 * GiB), max_size=20),
    st.integers(min_value=-8 * GiB, max_value=64 * GiB),
)
def test_mixed_asks_are_admitted_only_while_their_sum_fits(asks: list[int], room: int) -> None:
    """A task starts only if booked asks plus its own fit the room; a refusal would overflow."""
    running: list[int] = []
    for ask in asks:
        if admits(ask, running, room):
            running.append(ask)
            assert sum(running) <= room
        else:
            assert sum(running) + ask > room


def test_an_unreadable_card_admits_one_task_at_a_time() -> None:
    """With no room known, a task is admitted only when nothing else runs there."""
    assert admits(GiB, [], None)
    assert not admits(1, [GiB], None)


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
