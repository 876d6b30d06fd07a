"""The planner's shortcuts answer as the plain computation does (pure core).

A fit's count found by division or bisection, a bound or a fit served from a
card's memo, a key's price together served from its ask's memo, and a sized
ask served from the table's cache, each against the walk or the fresh
derivation it stands for. The state machine in ``test_planner.py`` checks the
same after every step of random event streams.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from gpupool._core.bound import Ceiling, derive_ceiling, fits_together
from gpupool._core.planner.fit import Booked, Fit, Held, _card_bound, card_bound, fit, key_counts
from gpupool._core.planner.state import Card, LiveTerms
from gpupool._core.policy import Ask, AskTable, Policy
from gpupool._core.units import GiB, MiB
from support import card_census


def walked_fit(
    card: Card,
    ask: Ask,
    runs: Sequence[Held],
    *,
    reserve_bytes: int,
    ceiling: Ceiling,
    slots: int,
) -> Fit:
    """The fit as a walk: one more task at a time, each at ``next_bytes`` plus its child's
    RSS, until the next one does not fit (the computation :func:`fit` stands for)."""
    bound = _card_bound(card, ask, reserve_bytes=reserve_bytes, ceiling=ceiling)
    assert card_bound(card, ask, reserve_bytes=reserve_bytes, ceiling=ceiling) == bound
    host = bound.host_per_task_bytes
    running = len(runs)
    booked_now = sum(run.booked_bytes + host for run in runs)
    same, together = key_counts(runs, ask.key)
    room = bound.room_bytes
    if room is None:
        more, limit = (0 if running else 1), "unreadable"
    else:
        more, total = 0, booked_now
        while more < max(0, slots):
            step = ask.next_bytes(same + more, together + more) + host
            if total + step > room:
                break
            total += step
            more += 1
        limit = "memory"
        if more >= slots:
            limit = ceiling.limit
    if card.cap.oom_cap is not None:
        allowed = max(0, card.cap.oom_cap - running)
        if more > allowed or (more == allowed and limit != "memory"):
            more, limit = allowed, "out_of_memory"
    return Fit(
        device=card.index,
        bound=bound,
        running=running,
        booked_bytes=booked_now,
        next_bytes=ask.next_bytes(same, together) + host,
        more=more,
        limit=limit,  # type: ignore[arg-type]
    )


def walked_together(together_bytes: object, room_bytes: int, most: int) -> int:
    assert callable(together_bytes)
    count = 0
    while count < most and together_bytes(count + 1) <= room_bytes:
        count += 1
    return count


@given(
    steps=st.lists(st.integers(0, 5 * GiB), max_size=40),
    room_bytes=st.integers(-GiB, 100 * GiB),
    most=st.integers(-2, 50),
)
def test_the_bisected_count_together_is_the_walks(
    steps: list[int], room_bytes: int, most: int
) -> None:
    """A price that grows with the count: bisection stops where the walk from 1 stops."""
    prices = [sum(steps[:k]) for k in range(len(steps) + 1)]

    def together(k: int) -> int:
        return prices[k] if k < len(prices) else prices[-1] + k * GiB

    assert fits_together(together, room_bytes, most) == walked_together(together, room_bytes, most)


def priced(peaks: list[int], learned: bool, estimate_gib: int) -> Ask:
    asks = AskTable(
        policy=Policy(learned=learned, reserve_bytes=0), default_estimate_bytes=estimate_gib * GiB
    )
    for peak in peaks:
        asks.measure("k", peak)
    return asks.ask("k")


@given(
    peaks=st.lists(st.integers(0, 20 * GiB), max_size=8),
    learned=st.booleans(),
    estimate_gib=st.integers(0, 30),
    total_gib=st.integers(1, 160),
    unified=st.booleans(),
    rss_mib=st.integers(0, 4000),
    runs=st.lists(
        st.tuples(st.sampled_from(["k", "other"]), st.integers(0, 10 * GiB), st.booleans()),
        max_size=12,
    ),
    outlier=st.none() | st.tuples(st.sampled_from([0.05, 0.1, 1 / 6, 0.3]), st.integers(1, 40)),
    own_gib=st.integers(0, 20),
    others_gib=st.integers(0, 40),
    oom_cap=st.none() | st.integers(0, 6),
    slots=st.integers(-2, 64),
    max_workers=st.integers(1, 64),
)
def test_a_fit_and_its_memo_are_the_walks(
    peaks: list[int],
    learned: bool,
    estimate_gib: int,
    total_gib: int,
    unified: bool,
    rss_mib: int,
    runs: list[tuple[str, int, bool]],
    outlier: tuple[float, int] | None,
    own_gib: int,
    others_gib: int,
    oom_cap: int | None,
    slots: int,
    max_workers: int,
) -> None:
    """Whatever the ask (priced alone or together, with a reserve for outliers or not), the
    card's terms and what is booked there (some of its key's runs at their own price), the
    fit is the walk's, the first time and when its card serves it again; after a term of the
    card moves, it is the walk's at the new terms."""
    ask = priced(peaks, learned, estimate_gib)
    if outlier is not None and ask.basis == "measured":
        rate, outlier_gib = outlier
        ask = dataclasses.replace(
            ask, outliers=1, outlier_bytes=outlier_gib * GiB, outlier_rate=rate
        )
    census = card_census(total_bytes=total_gib * GiB, free_bytes=total_gib * GiB, unified=unified)
    card = Card(index=0, census=census, live=LiveTerms(own_high_water_bytes=own_gib * GiB))
    card.pools.others_bytes = others_gib * GiB
    card.cap.oom_cap = oom_cap
    ceiling = derive_ceiling(
        max_workers=max_workers, cpus=None, host_ram_bytes=None, child_rss_bytes=rss_mib * MiB
    )
    booked = [Booked(key, b, solo) for key, b, solo in runs]
    terms = {"reserve_bytes": 256 * MiB, "ceiling": ceiling, "slots": slots}
    for _ in range(2):  # worked out, then served by the memo
        assert fit(card, ask, booked, **terms) == walked_fit(card, ask, booked, **terms)
    fresh = dataclasses.replace(ask)  # the same price, with no memo of its own
    assert fit(card, fresh, booked, **terms) == walked_fit(card, fresh, booked, **terms)
    # Each term of the card moves in turn: the memo serves no fit worked out before.
    for move in ("oom_cap", "own", "others", "census"):
        if move == "oom_cap":
            card.cap.oom_cap = 1 if oom_cap is None else None
        elif move == "own":
            card.live.own_high_water_bytes += GiB
        elif move == "others":
            card.pools.others_bytes += GiB
        else:
            card.census = dataclasses.replace(census, total_bytes=census.total_bytes + GiB)
        assert fit(card, ask, booked, **terms) == walked_fit(card, ask, booked, **terms)


@given(
    peaks=st.lists(st.integers(0, 20 * GiB), min_size=1, max_size=8),
    counts=st.lists(st.integers(0, 80), max_size=20),
)
def test_a_price_together_is_worked_out_alike_from_the_memo(
    peaks: list[int], counts: list[int]
) -> None:
    ask = priced(peaks, True, 30)
    for count in counts:
        assert ask.together_bytes(count) == dataclasses.replace(ask).together_bytes(count)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("measure"), st.integers(0, 16 * GiB), st.none() | st.integers(1, 8)),
        st.tuples(st.just("floor"), st.integers(0, 24 * GiB), st.none()),
        st.tuples(st.just("hint"), st.integers(1, 24 * GiB), st.none()),
        st.tuples(st.just("room"), st.integers(GiB, 40 * GiB), st.none()),
        st.tuples(st.just("ask_for"), st.integers(0, 0), st.integers(1, 12)),
    ),
    max_size=40,
)


@given(ops=OPS, learned=st.booleans())
def test_a_cached_sized_ask_is_the_fresh_derivation(
    ops: list[tuple[str, int, int | None]], learned: bool
) -> None:
    """After every change to a key (a measurement, an out-of-memory's floor, a hint, the
    cards' rooms), its sized asks are what a table with no cache derives."""
    asks = AskTable(policy=Policy(learned=learned), default_estimate_bytes=4 * GiB)
    for op, value, size in ops:
        if op == "measure":
            asks.measure("k", value, size=None if size is None else float(size))
        elif op == "floor":
            asks.floor("k", value)
        elif op == "hint":
            asks.hint("k", value)
        elif op == "room":
            asks.limit_to_room(value)
        for probe in (1.0, 4.0, 9.5, float(size or 2)):
            fresh = dataclasses.replace(asks, _cache={}, _sized_cache={})
            assert asks.ask_for("k", probe) == fresh.ask_for("k", probe)
            assert asks.ask_for("k", probe) is asks.ask_for("k", probe)


@given(
    peaks=st.lists(st.sampled_from([GiB, 2 * GiB, 3 * GiB + 7]), min_size=1, max_size=8),
    learned=st.booleans(),
    more_samples=st.integers(0, 50),
    margin_bytes=st.integers(0, 4 * GiB),
    least_bytes=st.none() | st.integers(0, 4 * GiB),
    estimate_bytes=st.none() | st.integers(1, 30 * GiB),
)
def test_asks_with_the_same_price_terms_price_every_count_alike(
    peaks: list[int],
    learned: bool,
    more_samples: int,
    margin_bytes: int,
    least_bytes: int | None,
    estimate_bytes: int | None,
) -> None:
    """The memos are kept by an ask's price terms: two asks whose terms are equal price every
    count of their tasks alike, whatever their other figures (how many samples, where no
    spread counts them; the margin, the least peak, the estimate)."""
    ask = priced(peaks, learned, 30)
    other = dataclasses.replace(
        ask,
        samples=ask.samples + more_samples,
        margin_bytes=margin_bytes,
        least_peak_bytes=least_bytes,
        estimate_bytes=estimate_bytes,
    )
    if other.price_terms() != ask.price_terms():
        assert ask.pooled and ask.spread_bytes and more_samples
        return
    for count in range(40):
        assert other.together_bytes(count) == ask.together_bytes(count)
    assert (other.ask_bytes, other.basis) == (ask.ask_bytes, ask.basis)
