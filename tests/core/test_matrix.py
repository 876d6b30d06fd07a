"""The hardware matrix: capacity arithmetic over machine characteristics, never card names.

Each row is a host described only by what the planner may see: how many
devices, each one's total and free bytes and our own bytes on it, usable
CPUs, available host RAM, and the workload (the per-task ask, the children's
RSS, the work items pending). The ids make rows readable; the planner never
sees them, and ``test_a_card_name_never_changes_the_plan`` checks that.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from gpupool._core.bound import Ceiling, WidthDecision, derive_ceiling
from gpupool._core.census import CardCensus, Census, HostCensus
from gpupool._core.policy import DEFAULT_RESERVE_BYTES
from gpupool._core.units import GiB
from support.fit import planner_widths


def cards(*free_of_total: tuple[int | None, int | None]) -> tuple[CardCensus, ...]:
    """Cards from ``(free, total)`` pairs in GiB; ``None`` is an unreadable term."""
    return tuple(
        CardCensus(
            device=i,
            uuid=f"GPU-{i:08x}",
            name="any card",
            total_bytes=None if total is None else total * GiB,
            free_bytes=None if free is None else free * GiB,
            own_bytes=0,
            source="given",
        )
        for i, (free, total) in enumerate(free_of_total)
    )


@dataclass(frozen=True, kw_only=True)
class Row:
    """One host and workload, and the plan expected for it."""

    cards: tuple[CardCensus, ...]
    cpus: int
    ram_gib: int | None
    ask_gib: int
    child_rss_gib: int | None = None
    max_workers: int = 64
    pending: int | None = None
    widths: tuple[int, ...]
    limits: tuple[str, ...]
    ceiling: tuple[int, str]


def plan(census: Census, row: Row) -> tuple[Ceiling, tuple[WidthDecision, ...]]:
    """Census and workload in, ceiling and per-device widths out: the planner under test."""
    ceiling = derive_ceiling(
        max_workers=row.max_workers,
        cpus=census.host.cpus,
        host_ram_bytes=census.host.available_ram_bytes,
        child_rss_bytes=None if row.child_rss_gib is None else row.child_rss_gib * GiB,
        pending_items=row.pending,
    )
    # The planner's own widths: each card's fit at the row's ask, the ceiling shared out.
    return ceiling, planner_widths(
        census.cards, row.ask_gib * GiB, ceiling=ceiling, reserve_bytes=DEFAULT_RESERVE_BYTES
    )


def census_of(row: Row) -> Census:
    return Census(
        cards=row.cards,
        host=HostCensus(
            cpus=row.cpus,
            available_ram_bytes=None if row.ram_gib is None else row.ram_gib * GiB,
        ),
        driver=bool(row.cards),
        sensor="given",
        reason=None if row.cards else "no NVIDIA driver",
    )


MATRIX = [
    pytest.param(
        Row(
            cards=(),
            cpus=8,
            ram_gib=64,
            ask_gib=6,
            max_workers=16,
            widths=(),
            limits=(),
            ceiling=(8, "cpus"),
        ),
        id="cpu-only-host-bounded",
    ),
    pytest.param(
        Row(
            cards=cards((80, 80)),
            cpus=32,
            ram_gib=256,
            ask_gib=6,
            max_workers=8,
            widths=(8,),
            limits=("max_workers",),
            ceiling=(8, "max_workers"),
        ),
        id="one-gpu-roomy",
    ),
    pytest.param(
        Row(
            cards=cards((20, 24)),
            cpus=32,
            ram_gib=256,
            ask_gib=6,
            widths=(3,),
            limits=("memory",),
            ceiling=(32, "cpus"),
        ),
        id="one-gpu-memory-bound",
    ),
    pytest.param(
        Row(
            cards=cards((None, None)),
            cpus=32,
            ram_gib=256,
            ask_gib=6,
            widths=(1,),
            limits=("unreadable",),
            ceiling=(32, "cpus"),
        ),
        id="one-gpu-unreadable",
    ),
    pytest.param(
        Row(
            cards=cards(*[(24, 24)] * 4),
            cpus=64,
            ram_gib=512,
            ask_gib=5,
            widths=(4, 4, 4, 4),
            limits=("memory",) * 4,
            ceiling=(64, "max_workers"),
        ),
        id="four-gpus",
    ),
    pytest.param(
        Row(
            cards=cards(*[(80, 80)] * 3, (15, 80), *[(80, 80)] * 4),
            cpus=128,
            ram_gib=1024,
            ask_gib=20,
            widths=(3, 3, 3, 0, 3, 3, 3, 3),
            limits=("memory", "memory", "memory", "no_room", *["memory"] * 4),
            ceiling=(64, "max_workers"),
        ),
        id="eight-gpus-co-tenant-on-card-3",
    ),
    pytest.param(
        Row(
            cards=cards((80, 80)),
            cpus=2,
            ram_gib=256,
            ask_gib=6,
            widths=(2,),
            limits=("cpus",),
            ceiling=(2, "cpus"),
        ),
        id="cpu-constrained",
    ),
    pytest.param(
        Row(
            cards=cards((80, 80)),
            cpus=32,
            ram_gib=16,
            ask_gib=6,
            child_rss_gib=5,
            widths=(3,),
            limits=("host_ram",),
            ceiling=(3, "host_ram"),
        ),
        id="ram-constrained",
    ),
    pytest.param(
        Row(
            cards=cards(*[(80, 80)] * 2),
            cpus=64,
            ram_gib=8,
            ask_gib=6,
            child_rss_gib=12,
            widths=(1, 0),
            limits=("host_ram", "host_ram"),
            ceiling=(1, "host_ram"),
        ),
        id="ram-holds-less-than-one-child-still-runs-one",
    ),
    pytest.param(
        Row(
            cards=cards(*[(40, 40)] * 4),
            cpus=64,
            ram_gib=512,
            ask_gib=6,
            pending=3,
            widths=(3, 0, 0, 0),
            limits=("pending",) * 4,
            ceiling=(3, "pending"),
        ),
        id="few-work-items",
    ),
]


@pytest.mark.parametrize("row", MATRIX)
def test_matrix_row_plans_from_characteristics(row: Row) -> None:
    """Each host shape gets the widths its capacity arithmetic allows, and names the limit."""
    ceiling, decisions = plan(census_of(row), row)
    assert (ceiling.value, ceiling.limit) == row.ceiling
    assert tuple(d.width for d in decisions) == row.widths
    assert tuple(d.limit for d in decisions) == row.limits


@pytest.mark.parametrize("row", MATRIX)
def test_matrix_row_keeps_the_invariants(row: Row) -> None:
    """In every row the total width is within the ceiling and each card within its room."""
    ceiling, decisions = plan(census_of(row), row)
    assert sum(d.width for d in decisions) <= ceiling.value
    if decisions:
        assert sum(d.width for d in decisions) >= 1
    for decision in decisions:
        room = decision.bound.room_bytes
        if room is None:
            assert decision.width <= 1
        elif decision.limit != "floor":
            assert decision.width * decision.bound.ask_bytes <= max(0, room)


@pytest.mark.parametrize("row", MATRIX)
def test_a_card_name_never_changes_the_plan(row: Row) -> None:
    """Renaming every card (an H100, a GB10, anything) leaves every width unchanged."""
    renamed = dataclasses.replace(
        row, cards=tuple(dataclasses.replace(c, name="NVIDIA H100 80GB HBM3") for c in row.cards)
    )
    _, before = plan(census_of(row), row)
    _, after = plan(census_of(renamed), renamed)
    assert [d.width for d in after] == [d.width for d in before]
