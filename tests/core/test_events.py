"""Decision records: frozen data carrying every term, flattened to one JSON line each."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest

from gpupool._core.bound import derive_ceiling
from gpupool._core.census import CardCensus
from gpupool._core.events import EVENTS, SCHEMA_VERSION, Decision, EventName
from gpupool._core.units import GiB
from support.fit import flat_ask, planner_width

TERM_KEYS = {
    "event",
    "device",
    "width_before",
    "width_after",
    "reason",
    "total_bytes",
    "co_tenant_bytes",
    "own_high_water_bytes",
    "reserve_bytes",
    "ask_bytes",
    "ask_basis",
    "room_bytes",
    "schema",
}


def width_record(*, total: int | None = 44 * GiB, free: int | None = 20 * GiB) -> Decision:
    census = CardCensus(
        device=2,
        uuid="GPU-2",
        name="test card",
        total_bytes=total,
        free_bytes=free,
        own_bytes=4 * GiB,
        source="given",
    )
    decision = planner_width(
        census,
        flat_ask(7 * GiB, basis="measured"),
        ceiling=derive_ceiling(max_workers=4, cpus=16, pending_items=36),
        own_high_water_bytes=6 * GiB,
        reserve_bytes=GiB // 4,
    )
    return Decision.from_width(
        "widened",
        decision,
        time_s=12.5,
        width_before=1,
        reason=decision.describe(),
        key="compile_entry",
        extra={"live_free_bytes": 19 * GiB},
    )


def test_to_dict_carries_every_term_under_its_own_name() -> None:
    """A width record's dict has the event, the widths, the reason and each bound term."""
    record = width_record()
    out = record.to_dict()
    assert out.keys() >= TERM_KEYS
    assert out["schema"] == SCHEMA_VERSION
    assert out["event"] == "widened"
    assert out["device"] == 2
    assert (out["width_before"], out["width_after"]) == (1, 2)  # 17.75 GiB of room, 7 GiB asks
    assert out["total_bytes"] == 44 * GiB
    assert out["co_tenant_bytes"] == 44 * GiB - 20 * GiB - 4 * GiB
    assert out["own_high_water_bytes"] == 6 * GiB
    assert out["reserve_bytes"] == GiB // 4
    assert (out["ask_bytes"], out["ask_basis"]) == (7 * GiB, "measured")
    assert out["room_bytes"] == 44 * GiB - 20 * GiB - 6 * GiB - GiB // 4
    assert out["reason"] == record.reason
    assert out["key"] == "compile_entry"
    assert out["live_free_bytes"] == 19 * GiB


def test_to_dict_carries_the_ceiling_terms() -> None:
    """A width record's dict also names the ceiling, which term set it, and each term."""
    out = width_record().to_dict()
    assert (out["ceiling"], out["ceiling_limit"]) == (4, "max_workers")
    assert (out["max_workers"], out["cpus"], out["pending_items"]) == (4, 16, 36)
    assert out["host_ram_bytes"] is None


def test_to_dict_is_json() -> None:
    """json.dumps writes the dict as one line that loads back equal."""
    out = width_record().to_dict()
    line = json.dumps(out)
    assert "\n" not in line
    assert json.loads(line) == out


def test_an_unreadable_card_logs_null_room_not_a_sentinel() -> None:
    """Unreadable terms are JSON null in the log, never -1 or 0."""
    out = width_record(total=None, free=None).to_dict()
    assert out["room_bytes"] is None
    assert out["total_bytes"] is None
    assert out["co_tenant_bytes"] is None
    assert json.loads(json.dumps(out))["room_bytes"] is None


def test_extra_terms_cannot_overwrite_the_bound_terms() -> None:
    """An extra named like a bound term does not replace the term in the log line."""
    record = dataclasses.replace(width_record(), extra={"room_bytes": -1, "exitcode": -9})
    out = record.to_dict()
    assert out["room_bytes"] == 44 * GiB - 20 * GiB - 6 * GiB - GiB // 4
    assert out["exitcode"] == -9


def test_a_pool_wide_record_has_no_bound_terms() -> None:
    """A record without a bound (a shutdown) still has the schema, event, device and reason."""
    record = Decision(
        event="shutdown",
        time_s=99.0,
        device=None,
        width_before=None,
        width_after=None,
        reason="shut down after 36 tasks",
    )
    out = record.to_dict()
    assert out["schema"] == SCHEMA_VERSION
    assert (out["event"], out["device"], out["reason"]) == ("shutdown", None, record.reason)
    assert "room_bytes" not in out
    assert json.loads(json.dumps(out)) == out


def test_records_are_frozen() -> None:
    """A decision record cannot be changed after it is made."""
    record = width_record()
    with pytest.raises(
        dataclasses.FrozenInstanceError, match=r"^cannot assign to field 'width_after'$"
    ):
        record.width_after = 99  # type: ignore[misc]


def test_records_take_keywords_only() -> None:
    """Records refuse positional arguments, so two terms can never be swapped by position."""
    with pytest.raises(TypeError, match=r"takes 1 positional argument but \d+ were given"):
        Decision("shutdown", 0.0, None, None, None, "x")  # type: ignore[misc]


def test_every_event_is_documented() -> None:
    """EVENTS gives a meaning for exactly the event names a record can carry."""
    assert set(EVENTS) == set(typing.get_args(EventName))
    assert all(text.strip() for text in EVENTS.values())
