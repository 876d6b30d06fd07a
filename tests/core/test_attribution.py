"""The out-of-memory attribution's steps on hand-built records: what a record lacks, the
verdict's order, and the rest left unattributed."""

from __future__ import annotations

from gpupool._core.attribution import analyse_oom
from gpupool._core.units import GiB

#: A card whose figures leave no term past its price: 10 GiB, 1 GiB co-tenant and 1 GiB own,
#: one task priced at 2 GiB that reached 1 GiB and was refused 0.5 GiB, 3 GiB in use.
PRICED_RIGHT: dict[str, object] = {
    "total_bytes": 10 * GiB,
    "census_co_tenant_bytes": 1 * GiB,
    "own_high_water_bytes": 1 * GiB,
    "reserve_bytes": 0,
    "booked_bytes": 2 * GiB,
    "running": 1,
    "task_ask_bytes": 2 * GiB,
    "reached_bytes": 1 * GiB,
    "requested_bytes": GiB // 2,
    "live_used_bytes": 3 * GiB,
    "live_own_bytes": 1 * GiB,
}


def test_a_record_without_its_terms_names_what_it_lacks() -> None:
    """No term is named from a record that lacks the figures; the sentence lists them."""
    analysis = analyse_oom({"total_bytes": 10 * GiB})
    assert analysis.verdict == "unattributed"
    assert analysis.wrong_terms == ()
    assert analysis.missing[-1] == "live_own_bytes"
    assert analysis.explanation == (
        "no term can be named: the record lacks census_co_tenant_bytes, own_high_water_bytes, "
        "booked_bytes, running, task_ask_bytes, reached_bytes, requested_bytes, live_used_bytes"
    )


def test_no_term_past_its_price_is_unattributed() -> None:
    """Every term within its price: the verdict is "unattributed", with the card's shortfall."""
    analysis = analyse_oom(PRICED_RIGHT)
    assert analysis.verdict == "unattributed"
    assert analysis.unattributed_bytes == 0
    assert analysis.own_separable
    assert analysis.explanation.startswith("no term went past its price by the record's figures")


def test_a_task_larger_than_the_card_is_named_before_a_larger_shortfall() -> None:
    """A task that needs more than the card is named first, though its ask was short by more."""
    record = {**PRICED_RIGHT, "task_ask_bytes": 1 * GiB, "reached_bytes": 8 * GiB}
    record["requested_bytes"] = 4 * GiB
    analysis = analyse_oom(record)
    assert analysis.wrong_terms[:2] == (("larger_than_card", 2 * GiB), ("ask", 11 * GiB))
    assert analysis.verdict == "larger_than_card"
    assert analysis.explanation.startswith("the task needs more than the card can hold")
