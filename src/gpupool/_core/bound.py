"""The bound and the ceiling, the terms of every width: the heart of gpupool (pure core).

For each device, from its census and the pool's measured terms::

    room  = total - co_tenant - other_pools - own_high_water - reserve
    width = clamp(floor(room / ask), 1, ceiling)

where ``other_pools`` is what the host's other gpupool pools have booked on
the card now (each task at the larger of its booking and what it holds; 0
when none, or when the booking table is unreachable), and ``co_tenant`` the
census' co-tenant bytes less what those pools held at the census.

with ``ceiling`` the least of ``max_workers``, usable CPUs, host RAM at the
children's RSS, and the work items still pending. The floor of 1 is for the
pool as a whole (the serial path); with several devices, a device without
room gets 0 while another has room. An unreadable device gets 1 with its
reason, never a width computed from a guess.

The width itself is worked out in one place, the planner's fit
(:mod:`gpupool._core.planner.fit`: ``fit`` per card, ``card_widths`` for the
pool); this module prices its terms and names them (:class:`WidthDecision`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gpupool._core.units import format_size

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpupool._core.census import CardCensus

__all__ = [
    "MAX_WORKERS_LIMIT",
    "AskBasis",
    "Bound",
    "Ceiling",
    "WidthDecision",
    "derive_bound",
    "derive_ceiling",
    "fits_together",
    "live_gate_admits",
]

AskBasis = Literal["estimated", "measured"]

#: The most workers a pool runs at once (``max_workers``, ``width``, ``GPUPOOL_MAX_WORKERS``,
#: ``gpupool plan``'s ``--max-workers`` and ``--cpus``), as CPython's pool has one on Windows
#: (61). A worker is a process with a CUDA context of its own, so no host runs more; and the
#: planner's fit places a width one task at a time, so a larger ceiling would hold each
#: decision for seconds (a what-if plan of 10**8 workers at 1 KiB did not end).
MAX_WORKERS_LIMIT = 4096

#: Which limit set a width: the memory bound, one of the ceiling's terms, an
#: unreadable card (width 1), the pool-wide floor of 1 (width 1 on the card
#: with the most room, 0 on the others, when no card has room for one task),
#: or no room on this device while another had it.
Limit = Literal[
    "memory",
    "max_workers",
    "cpus",
    "host_ram",
    "pending",
    "unreadable",
    "floor",
    "no_room",
    "out_of_memory",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Bound:
    """Every term of one device's memory bound.

    ``room_bytes`` is ``None`` when the card is unreadable, and may be
    negative: a card already oversubscribed by its residents is real, not
    unknown. ``host_per_task_bytes`` is what each task's child holds in host
    RAM where that is the card's memory too (unified memory: GB10, Jetson),
    priced beside its ask in the same room; 0 on a discrete card.
    """

    device: int
    total_bytes: int | None
    co_tenant_bytes: int | None
    own_high_water_bytes: int
    reserve_bytes: int
    ask_bytes: int
    ask_basis: AskBasis
    room_bytes: int | None
    other_pools_bytes: int = 0
    together_tasks: int | None = None
    together_bytes: int | None = None
    host_per_task_bytes: int = 0

    @property
    def tasks_fit(self) -> int | None:
        """``floor(room / ask)``, at least 0; ``None`` when unreadable. For a key whose tasks
        are priced together (``Ask.together_bytes``): the most tasks whose price
        together fits the room (``together_tasks``)."""
        if self.room_bytes is None:
            return None
        if self.together_tasks is not None:
            return self.together_tasks
        return max(0, self.room_bytes // (self.ask_bytes + self.host_per_task_bytes))

    def describe(self) -> str:
        """The bound in one sentence, every number in it."""
        if self.room_bytes is None:
            return f"card {self.device}: unreadable, so its room is unknown"
        fits = self.tasks_fit
        others = (
            f"{format_size(self.other_pools_bytes)} other pools - "
            if self.other_pools_bytes
            else ""
        )
        return (
            f"card {self.device}: {format_size(self.room_bytes)} of room "
            f"({format_size(self.total_bytes)} total - {format_size(self.co_tenant_bytes)} "
            f"co-tenant - {others}{format_size(self.own_high_water_bytes)} own high-water - "
            f"{format_size(self.reserve_bytes)} reserve) holds {fits} "
            f"task{'s' if fits != 1 else ''} at {format_size(self.ask_bytes)} ({self.ask_basis})"
            + (
                f" + {format_size(self.host_per_task_bytes)} child RSS (unified memory)"
                if self.host_per_task_bytes
                else ""
            )
            + (
                f", {format_size(self.together_bytes)} for the {fits} together"
                if self.together_bytes is not None and fits and fits > 1
                else ""
            )
        )


def derive_bound(
    census: CardCensus,
    *,
    own_high_water_bytes: int,
    reserve_bytes: int,
    ask_bytes: int,
    ask_basis: AskBasis,
    other_pools_bytes: int = 0,
    other_pools_at_census_bytes: int = 0,
) -> Bound:
    """Price one device: ``room = total - co_tenant - other_pools - own_high_water - reserve``.

    Args:
        census: the device as it stood at construction.
        own_high_water_bytes: this process's device high-water so far (it only
            grows; at least the census' own bytes).
        reserve_bytes: bytes kept free on purpose.
        ask_bytes: the per-task price (positive).
        ask_basis: ``"estimated"`` (the caller's ``task_peak``) or ``"measured"``.
        other_pools_bytes: what the host's other pools have booked on the card
            now (each task at the larger of its booking and its holding).
        other_pools_at_census_bytes: what those pools held at the census (in
            its co-tenant bytes; priced by their bookings instead).

    Returns:
        The bound, with ``room_bytes=None`` if the card is unreadable.
    """
    if ask_bytes <= 0:
        raise ValueError(f"ask_bytes must be positive, got {ask_bytes}")
    own_hw = max(own_high_water_bytes, census.own_bytes or 0)
    co_tenant = census.co_tenant_bytes
    if co_tenant is not None:
        co_tenant = max(0, co_tenant - other_pools_at_census_bytes)
    room: int | None = None
    if census.total_bytes is not None and co_tenant is not None:
        room = census.total_bytes - co_tenant - other_pools_bytes - own_hw - reserve_bytes
    return Bound(
        device=census.device,
        total_bytes=census.total_bytes,
        co_tenant_bytes=co_tenant,
        own_high_water_bytes=own_hw,
        reserve_bytes=reserve_bytes,
        ask_bytes=ask_bytes,
        ask_basis=ask_basis,
        room_bytes=room,
        other_pools_bytes=other_pools_bytes,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Ceiling:
    """The pool-wide cap on width, and which term set it.

    Unknown terms (``None``) do not cap.
    """

    max_workers: int
    cpus: int | None
    host_ram_bytes: int | None
    child_rss_bytes: int | None
    pending_items: int | None
    value: int
    limit: Literal["max_workers", "cpus", "host_ram", "pending"]


def derive_ceiling(
    *,
    max_workers: int,
    cpus: int | None = None,
    host_ram_bytes: int | None = None,
    child_rss_bytes: int | None = None,
    pending_items: int | None = None,
) -> Ceiling:
    """The least of ``max_workers``, CPUs, host RAM at the children's RSS, pending items.

    Each term is at least 1, so the ceiling never forbids the serial path.
    Ties go to the earlier term in that order.
    """
    if max_workers < 1:
        raise ValueError(f"max_workers must be at least 1, got {max_workers}")
    ram_fits = None
    if host_ram_bytes is not None and child_rss_bytes:
        ram_fits = max(1, host_ram_bytes // child_rss_bytes)
    terms: list[tuple[int, Literal["max_workers", "cpus", "host_ram", "pending"]]] = [
        (max_workers, "max_workers")
    ]
    if cpus is not None:
        terms.append((max(1, cpus), "cpus"))
    if ram_fits is not None:
        terms.append((ram_fits, "host_ram"))
    if pending_items is not None:
        terms.append((max(1, pending_items), "pending"))
    value, limit = min(terms, key=lambda term: term[0])
    return Ceiling(
        max_workers=max_workers,
        cpus=cpus,
        host_ram_bytes=host_ram_bytes,
        child_rss_bytes=child_rss_bytes,
        pending_items=pending_items,
        value=value,
        limit=limit,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class WidthDecision:
    """A device's width and every term it came from."""

    device: int
    width: int
    limit: Limit
    bound: Bound
    ceiling: Ceiling

    def describe(self) -> str:
        """The decision in one sentence, every number in it."""
        why = {
            "memory": "the memory bound",
            "max_workers": f"max_workers={self.ceiling.max_workers}",
            "cpus": f"{self.ceiling.cpus} usable CPUs",
            "host_ram": (
                f"host RAM ({format_size(self.ceiling.host_ram_bytes)} at "
                f"{format_size(self.ceiling.child_rss_bytes)} per child)"
            ),
            "pending": f"{self.ceiling.pending_items} pending items",
            "unreadable": "an unreadable card (width 1, never a guess)",
            "floor": (
                "the serial floor (no card has room for one task; running 1 at a time)"
                if self.width
                else "the serial floor (no card has room for one task; "
                "the one task runs on the card with the most room)"
            ),
            "no_room": "no room on this card while another card has room",
            "out_of_memory": "the cap an out-of-memory set on this card",
        }[self.limit]
        return f"{self.bound.describe()}; width {self.width}, set by {why}"


def fits_together(together_bytes: Callable[[int], int], room_bytes: int, most: int) -> int:
    """The most tasks, up to ``most``, whose price together (``together_bytes(k)``, growing
    with ``k``) fits in ``room_bytes``; 0 when not even one does.

    Found by bisection: as the price grows with ``k``, the counts that fit are ``1..answer``,
    so it is the count a walk from 1 would stop before, in ``log2(most)`` prices."""
    fits, fails = 0, max(0, most) + 1  # together_bytes(fits) fits; fails is past the answer
    while fails - fits > 1:
        middle = (fits + fails) // 2
        if together_bytes(middle) <= room_bytes:
            fits = middle
        else:
            fails = middle
    return fits


def live_gate_admits(
    *,
    live_free_bytes: int | None,
    ask_bytes: int,
    unreached_bytes: int,
    reserve_bytes: int,
) -> bool:
    """The live gate: does the card's free memory now cover a new task?

    The live free reading must cover the new ask, plus the part of every
    running task's ask that it has not reached yet, plus the reserve. This
    prices what the census cannot see: a co-tenant that grew after it. An
    unknown reading (``None``) does not gate: the static bound alone decides.
    """
    if live_free_bytes is None:
        return True
    return live_free_bytes >= ask_bytes + unreached_bytes + reserve_bytes


# Re-exported by gpupool, which may not have imported this module yet (it loads it on
# first use): the public path is set here, so reprs, docs and pickles name it whenever used.
Bound.__module__ = Ceiling.__module__ = "gpupool"
