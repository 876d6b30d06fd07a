"""The incident that motivates gpupool, on its own numbers, through the real policy.

A 44.39 GiB card held a 9.54 GiB serving parent (a co-tenant) and this
process's own 16.20 GiB pipeline. Entry children were priced at an estimated
9.90 GiB; once measured, their peak was 6.02 GiB. The old rule divided a
free-memory sample taken before the children existed by that peak and widened
2 -> 4; four children plus the residents needed 53.81 GiB of a 44.39 GiB card,
and the run died at entry 2 of 36. The bound prices the card instead: 18.65
GiB of room, so width 1 on the estimate and 2 on the measurement, never 4.
"""

from __future__ import annotations

import pytest

from gpupool import format_size, parse_size
from gpupool._core.bound import Bound, Ceiling, WidthDecision, derive_ceiling
from gpupool._core.census import CardCensus
from gpupool._core.policy import AskTable, Policy
from gpupool._core.units import GiB
from support.fit import planner_width

TOTAL = parse_size("44.39GiB")
CO_TENANT = parse_size("9.54GiB")  # the eager-serving parent, resident
OWN_HIGH_WATER = parse_size("16.20GiB")  # this process's pipeline, resident
ESTIMATE = parse_size("9.90GiB")  # the per-entry task_peak guess
MEASURED_PEAK = 6_461_325_312  # peak_child_device_bytes from the incident log (6.02 GiB)
REQUESTED_WIDTH = 4  # what the widen asked for
FREE_AT_SAMPLE = parse_size("29.5GiB")  # the old rule's divisor: free before the children existed
KEY = "compile_entry"

# The policy the incident is replayed under: a 1 GiB margin over the measured
# peak and no tenant reserve (the pod had no serve goal), so each term below is
# exactly one of the incident's numbers.
INCIDENT_POLICY = Policy(margin_bytes=1 * GiB, margin_fraction=0.0, reserve_bytes=0)


def incident_card(total: int = TOTAL) -> CardCensus:
    """The card at construction: the residents present, none of the pool's children."""
    return CardCensus(
        device=0,
        uuid="GPU-00000000-0000-0000-0000-000000000000",
        name="incident card",
        total_bytes=total,
        free_bytes=total - CO_TENANT - OWN_HIGH_WATER,
        own_bytes=OWN_HIGH_WATER,
        source="given",
    )


def decide(census: CardCensus, table: AskTable) -> WidthDecision:
    """The planner's width for the incident key at the table's current ask (its fit on the
    card, within the ceiling)."""
    return planner_width(
        census,
        table.ask(KEY),
        ceiling=ceiling(),
        own_high_water_bytes=OWN_HIGH_WATER,
        reserve_bytes=INCIDENT_POLICY.reserve_bytes,
    )


def price(census: CardCensus, table: AskTable) -> Bound:
    """The bound the planner priced the incident key's width at."""
    return decide(census, table).bound


def ceiling() -> Ceiling:
    return derive_ceiling(max_workers=REQUESTED_WIDTH)


def fresh_table() -> AskTable:
    return AskTable(policy=INCIDENT_POLICY, default_estimate_bytes=ESTIMATE)


def test_the_census_names_the_incident_terms() -> None:
    """The census prices the co-tenant as total - free - own: the serving parent's 9.54 GiB."""
    census = incident_card()
    assert census.co_tenant_bytes == CO_TENANT
    assert format_size(census.co_tenant_bytes) == "9.54 GiB"
    assert format_size(census.total_bytes) == "44.39 GiB"


def test_the_estimated_ask_runs_one_at_a_time() -> None:
    """On the 9.90 GiB estimate the 18.65 GiB of room holds one task: width 1."""
    table = fresh_table()
    decision = decide(incident_card(), table)
    bound = decision.bound
    assert table.ask(KEY).basis == "estimated"
    assert format_size(bound.room_bytes) == "18.65 GiB"
    assert bound.tasks_fit == 1
    assert (decision.width, decision.limit) == (1, "memory")


def test_the_estimated_bound_reads_as_one_sentence_with_every_number() -> None:
    """describe() names room, every term and the ask: 18.65 GiB of room, 9.90 GiB estimated."""
    sentence = price(incident_card(), fresh_table()).describe()
    assert "18.65 GiB" in sentence
    assert "9.90 GiB" in sentence
    assert sentence == (
        "card 0: 18.65 GiB of room (44.39 GiB total - 9.54 GiB co-tenant - "
        "16.20 GiB own high-water - 0 B reserve) holds 1 task at 9.90 GiB (estimated)"
    )


def test_the_measured_ask_is_the_peak_plus_the_margin() -> None:
    """The measured 6.02 GiB peak plus the 1 GiB margin prices each task at 7.02 GiB."""
    ask = fresh_table().measure(KEY, MEASURED_PEAK)
    assert format_size(MEASURED_PEAK) == "6.02 GiB"
    assert ask.basis == "measured"
    assert ask.ask_bytes == MEASURED_PEAK + 1 * GiB
    assert format_size(ask.ask_bytes) == "7.02 GiB"


def test_the_measurement_widens_to_two_and_two_fit_the_card() -> None:
    """Measured at 7.02 GiB with max_workers 4, the width is 2: 39.77 GiB against 44.39 GiB."""
    table = fresh_table()
    table.measure(KEY, MEASURED_PEAK)
    decision = decide(incident_card(), table)
    bound = decision.bound
    assert (decision.width, decision.limit) == (2, "memory")
    priced = decision.width * bound.ask_bytes + CO_TENANT + OWN_HIGH_WATER
    assert priced <= TOTAL
    assert priced / GiB == pytest.approx(39.77, abs=0.01)


def test_the_requested_width_of_four_would_overflow_the_card() -> None:
    """Four children at 7.02 GiB plus the residents need 53.81 GiB of a 44.39 GiB card: the OOM."""
    ask = fresh_table().measure(KEY, MEASURED_PEAK)
    priced = REQUESTED_WIDTH * ask.ask_bytes + CO_TENANT + OWN_HIGH_WATER
    assert priced > TOTAL
    assert format_size(priced) == "53.81 GiB"


def test_the_old_divisor_reproduces_the_incident() -> None:
    """Control: free-before-the-children divided by the measured ask answers 4, which overflows."""
    ask = fresh_table().measure(KEY, MEASURED_PEAK)
    old_width = min(REQUESTED_WIDTH, FREE_AT_SAMPLE // ask.ask_bytes)
    assert old_width == REQUESTED_WIDTH
    assert old_width * ask.ask_bytes + CO_TENANT + OWN_HIGH_WATER > TOTAL


def test_the_same_measurement_on_an_80_gib_card_widens_to_four() -> None:
    """Not a revert: with the same residents, an 80 GiB card holds all four children."""
    table = fresh_table()
    table.measure(KEY, MEASURED_PEAK)
    decision = decide(incident_card(total=80 * GiB), table)
    bound = decision.bound
    assert (decision.width, decision.limit) == (REQUESTED_WIDTH, "max_workers")
    assert REQUESTED_WIDTH * bound.ask_bytes + CO_TENANT + OWN_HIGH_WATER <= 80 * GiB


def test_a_census_retaken_mid_run_would_price_our_children_as_co_tenants() -> None:
    """Why the census is taken once: with four children on the card, total-free-own counts them."""
    children = parse_size("18.61GiB")  # the four entry children at the OOM
    retaken = CardCensus(
        device=0,
        uuid="GPU-00000000-0000-0000-0000-000000000000",
        name="incident card",
        total_bytes=TOTAL,
        free_bytes=TOTAL - CO_TENANT - OWN_HIGH_WATER - children,
        own_bytes=OWN_HIGH_WATER,
        source="given",
    )
    assert retaken.co_tenant_bytes == CO_TENANT + children
    table = fresh_table()
    table.measure(KEY, MEASURED_PEAK)
    assert price(retaken, table).tasks_fit == 0
    assert price(incident_card(), table).tasks_fit == 2


@pytest.mark.parametrize("basis", ["estimated", "measured"])
def test_an_unreadable_incident_card_refuses_to_widen(basis: str) -> None:
    """With the card unreadable, neither basis widens past 1: unreadable is not empty."""
    table = fresh_table()
    if basis == "measured":
        table.measure(KEY, MEASURED_PEAK)
    unreadable = CardCensus(
        device=0,
        uuid="GPU-00000000-0000-0000-0000-000000000000",
        name="incident card",
        total_bytes=None,
        free_bytes=None,
        own_bytes=None,
        source="given",
        reason="NVML: memory info failed",
    )
    decision = decide(unreadable, table)
    assert table.ask(KEY).basis == basis
    assert (decision.width, decision.limit) == (1, "unreadable")


def test_the_learned_margin_packs_three_after_three_agreeing_measurements() -> None:
    """Default policy on the incident card: 18.40 GiB of room holds 2 after one 6.02 GiB
    measurement and 3 after three (the docs' table, ask by ask)."""
    policy = Policy(learned=True)
    table = AskTable(policy=policy, default_estimate_bytes=ESTIMATE)
    census = incident_card()

    def width() -> int:
        decision = planner_width(
            census,
            table.ask(KEY),
            ceiling=derive_ceiling(max_workers=4),
            own_high_water_bytes=OWN_HIGH_WATER,
            reserve_bytes=policy.reserve_bytes,
        )
        assert format_size(decision.bound.room_bytes) == "18.40 GiB"
        return decision.width

    widths = [width()]
    asks = []
    for _ in range(3):
        table.measure(KEY, MEASURED_PEAK)
        asks.append(format_size(table.ask(KEY).ask_bytes))
        widths.append(width())
    assert asks == ["6.62 GiB", "6.17 GiB", "6.08 GiB"]
    assert widths == [1, 2, 2, 3]
