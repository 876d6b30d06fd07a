"""The planner's one fit, asked the way the planner asks it, for tests that pin widths.

:meth:`Planner.decide <gpupool._core.planner.views.Views.decide>` prices every card at one
ask with one reserve: a :class:`~gpupool._core.planner.state.Card` per census row (its own
high-water so far), each card's :func:`~gpupool._core.planner.fit.fit` beside its runs
within the slots the ceiling leaves, then :func:`~gpupool._core.planner.fit.card_widths`
shares the ceiling out. :func:`planner_widths` does the same for cards with no runs, so a
test of "how many fit" asks the computation every record's width states, not a copy of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpupool._core.bound import AskBasis, Ceiling, WidthDecision
from gpupool._core.census import CardCensus
from gpupool._core.planner.fit import Fit, Held, card_widths, fit
from gpupool._core.planner.state import Card, LiveTerms
from gpupool._core.policy import Ask

__all__ = ["flat_ask", "planner_card", "planner_fit", "planner_width", "planner_widths"]


def flat_ask(ask_bytes: int, *, basis: AskBasis = "estimated", key: str = "task") -> Ask:
    """A key's price of ``ask_bytes`` a task, priced alone (not together)."""
    return Ask(
        key=key,
        ask_bytes=ask_bytes,
        basis=basis,
        estimate_bytes=ask_bytes if basis == "estimated" else None,
        measured_peak_bytes=ask_bytes if basis == "measured" else None,
        margin_bytes=0,
        samples=0 if basis == "estimated" else 1,
    )


def planner_card(census: CardCensus, *, index: int, own_high_water_bytes: int = 0) -> Card:
    """The planner's card for ``census``: its own high-water as the planner holds it (at
    least the census' own bytes, which the bound takes anyway)."""
    return Card(
        index=index,
        census=census,
        live=LiveTerms(own_high_water_bytes=max(own_high_water_bytes, census.own_bytes or 0)),
    )


def planner_fit(
    card: Card,
    ask: Ask | int,
    runs: Sequence[Held] = (),
    *,
    ceiling: Ceiling,
    reserve_bytes: int = 0,
    slots: int | None = None,
) -> Fit:
    """The fit on ``card`` at ``ask`` (bytes: :func:`flat_ask`) beside ``runs``, within
    ``slots`` (default: the ceiling's, as for a pool running nothing)."""
    return fit(
        card,
        flat_ask(ask) if isinstance(ask, int) else ask,
        runs,
        reserve_bytes=reserve_bytes,
        ceiling=ceiling,
        slots=ceiling.value if slots is None else slots,
    )


def planner_widths(
    censuses: Sequence[CardCensus],
    ask: Ask | int,
    *,
    ceiling: Ceiling,
    own_high_water_bytes: int | Sequence[int] = 0,
    reserve_bytes: int = 0,
) -> tuple[WidthDecision, ...]:
    """Every card's width, as the planner decides it for a pool running nothing yet: each
    card (the ``i``-th census row is card ``i``) priced at ``ask`` with its own high-water
    (one for all, or one per card) and ``reserve_bytes``, within ``ceiling``."""
    highs = (
        [own_high_water_bytes] * len(censuses)
        if isinstance(own_high_water_bytes, int)
        else list(own_high_water_bytes)
    )
    cards = [
        planner_card(census, index=i, own_high_water_bytes=high)
        for i, (census, high) in enumerate(zip(censuses, highs, strict=True))
    ]
    fits = [planner_fit(c, ask, ceiling=ceiling, reserve_bytes=reserve_bytes) for c in cards]
    return card_widths(fits, ceiling)


def planner_width(
    census: CardCensus,
    ask: Ask | int,
    *,
    ceiling: Ceiling,
    own_high_water_bytes: int = 0,
    reserve_bytes: int = 0,
) -> WidthDecision:
    """The width of a one-card pool, as the planner decides it (:func:`planner_widths`); the
    card is numbered as its census row is (``census.device``)."""
    card = planner_card(census, index=census.device, own_high_water_bytes=own_high_water_bytes)
    found = planner_fit(card, ask, ceiling=ceiling, reserve_bytes=reserve_bytes)
    (decision,) = card_widths([found], ceiling)
    return decision
