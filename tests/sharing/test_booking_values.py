"""The booking table's values and text format (pure core)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool._core.bookings import (
    OtherPools,
    PoolBooking,
    TaskBooking,
    format_booking_table,
    parse_booking_table,
)
from gpupool._core.units import GiB

UUID = "GPU-00000000-1111-2222-3333-444444444444"

tasks = st.builds(
    TaskBooking,
    worker_pid=st.integers(1, 2**22),
    key=st.text(max_size=20),
    booked_bytes=st.integers(0, 2**45),
    reached_bytes=st.integers(0, 2**45),
)
pools = st.builds(
    PoolBooking,
    pool_id=st.text(min_size=1, max_size=12),
    pid=st.integers(1, 2**22),
    start=st.text(max_size=12),
    label=st.text(max_size=12),
    updated_s=st.floats(0, 2e9, allow_nan=False),
    tasks=st.lists(tasks, max_size=5).map(tuple),
    waiting=st.integers(0, 10_000),
)


@given(st.lists(pools, max_size=4, unique_by=lambda p: p.pool_id))
def test_the_text_round_trips(rows: list[PoolBooking]) -> None:
    """What is formatted parses back to the same rows."""
    parsed = parse_booking_table(format_booking_table(UUID, rows), card_uuid=UUID)
    assert parsed == {row.pool_id: row for row in rows}


@given(st.lists(pools, max_size=4))
def test_unreached_is_between_zero_and_booked(rows: list[PoolBooking]) -> None:
    """Unreached bytes never go negative and never exceed what is booked."""
    others = OtherPools(card_uuid=UUID, pools=tuple(rows))
    assert 0 <= others.unreached_bytes <= others.booked_bytes
    assert others.unreached_given({}) == others.unreached_bytes


def test_describe_and_terms_name_every_figure() -> None:
    """The words and the decision-log terms carry booked, reached and unreached bytes."""
    row = PoolBooking(
        pool_id="1.1",
        pid=1,
        start="9",
        label="train.py",
        updated_s=0.0,
        tasks=(TaskBooking(worker_pid=2, key="k", booked_bytes=6 * GiB, reached_bytes=2 * GiB),),
    )
    others = OtherPools(card_uuid=UUID, pools=(row,))
    assert (
        others.describe() == "1 other pool: 6.00 GiB booked, 2.00 GiB reached, 4.00 GiB unreached"
    )
    assert OtherPools(card_uuid=UUID).describe() == "no other pool"
    assert others.terms() == {
        "other_pools": 1,
        "other_pools_tasks": 1,
        "other_pools_booked_bytes": 6 * GiB,
        "other_pools_reached_bytes": 2 * GiB,
        "other_pools_unreached_bytes": 4 * GiB,
        "other_pools_overrun_bytes": 0,
    }


def test_overrun_counts_only_what_grew_past_its_booking() -> None:
    """A task past its booking adds reached - booked to the overrun; one within it adds nothing."""
    row = PoolBooking(
        pool_id="1.1",
        pid=1,
        start="9",
        label="x",
        updated_s=0.0,
        tasks=(
            TaskBooking(worker_pid=2, key="k", booked_bytes=4 * GiB, reached_bytes=7 * GiB),
            TaskBooking(worker_pid=3, key="k", booked_bytes=4 * GiB, reached_bytes=GiB),
        ),
    )
    others = OtherPools(card_uuid=UUID, pools=(row,))
    assert others.overrun_bytes == 3 * GiB
    assert others.unreached_bytes == 3 * GiB  # the second task's 4 - 1; the first's is 0


def test_a_blank_file_has_no_rows() -> None:
    """An empty or space-padded file is an empty table."""
    assert parse_booking_table(b"", card_uuid=UUID) == {}
    assert parse_booking_table(b"    ", card_uuid=UUID) == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"{not json", r"^not JSON"),
        (b"[]", r"^not a JSON object$"),
        (b'{"version": 2}', r"^version 2; this gpupool reads 1$"),
        (b'{"version": 1, "card_uuid": "GPU-x", "pools": {}}', r"^it is the table of 'GPU-x'"),
        (
            b'{"version": 1, "card_uuid": "%s", "pools": {"a": {"pid": -1, "tasks": [], '
            b'"updated_s": 0}}}' % UUID.encode(),
            r"^pool 'a': pid -1 is not a non-negative integer$",
        ),
        (
            b'{"version": 1, "card_uuid": "%s", "pools": {"a": {"pid": 1, "tasks": [[1, "k"]], '
            b'"updated_s": 0}}}' % UUID.encode(),
            r"^pool 'a': a task is not \[pid, key, booked, reached\]$",
        ),
    ],
)
def test_a_bad_file_is_refused_with_what_is_wrong(text: bytes, message: str) -> None:
    """A file that is not this version's table for this card raises ValueError naming the fault."""
    with pytest.raises(ValueError, match=message):
        parse_booking_table(text, card_uuid=UUID)
