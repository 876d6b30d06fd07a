"""What a key's measurements support: the room its ask is held within, and the record that
tells the user its peaks vary a lot (pure core).

A learned ask is never priced past the room for one task of the tightest of the pool's
cards that holds its largest peak (:func:`rooms_alone_bytes`: each card's bound as if no
other pool booked anything there), and a key whose peaks vary a lot
(:func:`~gpupool._core.policy.peaks_vary`) is named once in a ``peaks_vary`` record with
the terms: its tasks are not one workload, and the advice is to give them ``size=`` or keys
of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpupool._core.bound import Ceiling, derive_bound
from gpupool._core.events import JsonValue
from gpupool._core.planner.fit import host_per_task_bytes
from gpupool._core.planner.state import Card
from gpupool._core.policy import VARY_RATIO, Ask, peaks_vary
from gpupool._core.units import format_size

__all__ = ["rooms_alone_bytes", "varied_peaks"]


def rooms_alone_bytes(
    cards: Sequence[Card], *, reserve_bytes: int, ceiling: Ceiling
) -> tuple[int, ...]:
    """The room one task has on each readable card of ``cards`` once the other pools there
    drained: ``total - co_tenant - own_high_water - reserve`` (less a task's child RSS on
    unified memory)."""
    rooms: list[int] = []
    for card in cards:
        bound = derive_bound(
            card.census,
            own_high_water_bytes=card.own_high_water_bytes,
            reserve_bytes=reserve_bytes,
            ask_bytes=1,
            ask_basis="estimated",
            other_pools_at_census_bytes=card.others_at_census_bytes,
        )
        if bound.room_bytes is not None:
            rooms.append(bound.room_bytes - host_per_task_bytes(card, ceiling))
    return tuple(rooms)


def varied_peaks(ask: Ask) -> tuple[str, dict[str, JsonValue]] | None:
    """The ``peaks_vary`` record's sentence and terms for a measured key whose peaks vary a
    lot, else ``None`` (also for a key whose tasks carry sizes: its asks are predicted per
    size, so the advice to give sizes is not for it)."""
    largest, least = ask.measured_peak_bytes, ask.least_peak_bytes
    if (
        ask.basis != "measured"
        or ask.size is not None
        or ask.sized_samples
        or largest is None
        or least is None
        or not peaks_vary(ask.samples, least, largest)
    ):
        return None
    reason = (
        f"{ask.key}: {ask.samples} measured peaks range from {format_size(least)} to "
        f"{format_size(largest)} (more than {VARY_RATIO:g}x): its tasks are not one workload, "
        f"so its margin is held to what was measured ({format_size(ask.margin_bytes)}, at most "
        f"the range {format_size(largest - least)}) and its ask is {ask.describe()}; give its "
        "tasks size= (the ask is then predicted per size) or split them into keys of their own"
    )
    return reason, {
        "samples": ask.samples,
        "least_peak_bytes": least,
        "largest_peak_bytes": largest,
        "peak_range_bytes": largest - least,
        "mean_peak_bytes": ask.mean_bytes,
        "stdev_bytes": ask.spread_bytes,
        "margin_bytes": ask.margin_bytes,
        "room_capped": ask.room_capped,
    }
