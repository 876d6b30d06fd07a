"""The price of a pool given no ``task_peak``, asked of the planner: its roomiest card's room."""

from __future__ import annotations

from gpupool._core.planner import Planner
from gpupool._core.units import GiB, MiB
from support import card_census, census_of


def test_a_pool_without_task_peak_is_priced_at_the_room_of_its_roomiest_card() -> None:
    """``total - co_tenant - own - reserve`` of the card with the most room; a card whose total
    is unknown is passed over."""
    census = census_of(
        [
            card_census(device=0, total_bytes=16 * GiB, free_bytes=10 * GiB, own_bytes=GiB),
            card_census(device=1, total_bytes=12 * GiB, free_bytes=12 * GiB),
            card_census(device=2, total_bytes=None, free_bytes=None, own_bytes=None),
        ]
    )
    # Card 1: 12 GiB - 0 - 0 - 256 MiB beats card 0: 16 - 5 (co-tenant) - 1 (own) - 256 MiB.
    assert Planner.price_without_peak(census, 256 * MiB) == 12 * GiB - 256 * MiB


def test_the_price_without_task_peak_is_at_least_one_gib() -> None:
    """No card with a known total, or rooms under 1 GiB: the price is 1 GiB, never less."""
    unknown = census_of([card_census(total_bytes=None, free_bytes=None, own_bytes=None)])
    assert Planner.price_without_peak(unknown, 0) == GiB
    assert Planner.price_without_peak(census_of([]), 0) == GiB
    full = census_of([card_census(total_bytes=4 * GiB, free_bytes=512 * MiB)])
    assert Planner.price_without_peak(full, 256 * MiB) == GiB
