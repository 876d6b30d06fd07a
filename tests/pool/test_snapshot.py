"""The snapshot readers on other threads read: sums, values shared with the last one, copies.

A real planner and ask table on a census of one card (no processes: the snapshot is taken
from the dispatcher's values as they stand).
"""

from __future__ import annotations

import collections

import pytest

from gpupool._core.events import Decision
from gpupool._core.planner import Planner, PlannerConfig, Start
from gpupool._core.policy import AskTable, Policy
from gpupool._core.units import GiB
from gpupool._pool.snapshot import ReadOnlyDict, take_snapshot
from support import card_census, census_of


def _planner() -> tuple[Planner, AskTable]:
    records: list[Decision] = []
    census = census_of(
        [card_census(total_bytes=16 * GiB, free_bytes=16 * GiB)],
        cpus=8,
        available_ram_bytes=64 * GiB,
    )
    asks = AskTable(policy=Policy(reserve_bytes=0), default_estimate_bytes=3 * GiB)
    config = PlannerConfig(max_workers=4, reserve_bytes=0, parent_pid=1)
    planner = Planner(census=census, asks=asks, config=config, emit=records.append)
    planner.construct(0.0)
    return planner, asks


def test_counts_are_the_dispatchers_and_the_planners_summed() -> None:
    """A name counted by both is their sum; a name counted by one is its count."""
    planner, asks = _planner()
    planner.counts["oom"] += 2
    planner.counts["lost"] += 1
    counts = collections.Counter({"completed": 5, "lost": 3})
    snapshot = take_snapshot(planner, asks, counts, log_write_errors=0, last=None)
    assert snapshot.counts["completed"] == 5
    assert snapshot.counts["lost"] == 4
    assert snapshot.counts["oom"] == 2


def test_nothing_changed_gives_the_last_snapshot_and_one_change_shares_the_rest() -> None:
    """The same values give back the last snapshot itself; a changed count gives a new one
    whose unchanged values are the last one's objects."""
    planner, asks = _planner()
    planner.submit(0, "k")
    counts = collections.Counter({"completed": 1})
    first = take_snapshot(planner, asks, counts, log_write_errors=0, last=None)
    assert take_snapshot(planner, asks, counts, log_write_errors=0, last=first) is first
    counts["completed"] += 1
    second = take_snapshot(planner, asks, counts, log_write_errors=0, last=first)
    assert second is not first
    assert second.counts["completed"] == 2
    assert second.asks is first.asks
    assert second.widths_by_key is first.widths_by_key
    assert second.widths is first.widths


def test_a_started_task_shows_in_the_widths_by_key_and_the_counts_stay_shared() -> None:
    """A task handed to the planner and started shows in the next snapshot's widths by key;
    the counts, unchanged, are the last snapshot's."""
    planner, asks = _planner()
    counts: collections.Counter[str] = collections.Counter()
    first = take_snapshot(planner, asks, counts, log_write_errors=0, last=None)
    assert dict(first.widths_by_key) == {}
    planner.submit(0, "k")
    start = planner.next_start(0.0)
    assert isinstance(start, Start)
    planner.started(start.task, start.device, 100, 0.0)
    second = take_snapshot(planner, asks, counts, log_write_errors=0, last=first)
    assert second.widths_by_key["k"] >= 1
    assert second.counts is first.counts


def test_a_snapshot_is_read_only_and_keeps_its_values_when_the_sources_change() -> None:
    """Its mappings cannot be written, and later counts do not reach it."""
    planner, asks = _planner()
    counts = collections.Counter({"completed": 1})
    snapshot = take_snapshot(planner, asks, counts, log_write_errors=0, last=None)
    assert isinstance(snapshot.counts, ReadOnlyDict)
    with pytest.raises(TypeError):
        snapshot.counts["completed"] = 9  # type: ignore[index]
    counts["completed"] += 1
    planner.counts["oom"] += 1
    assert snapshot.counts == {"completed": 1}
