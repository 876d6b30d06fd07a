"""What the pool reads of its cards: each live snapshot, or why it failed (pure core).

The dispatcher's card reader takes a reading of each card and hands it here: the live gate
reads it, the parent's own row raises the own high-water (a term of the bound), and a cap an
out-of-memory set lifts once the readings show its room back. A reading that fails leaves the
card to run one task of the pool at a time. At the end of each turn the recorder samples the
cards whose readings are due one.

:class:`Readings` is the one writer of a card's reading terms, so that what a start, a record
and a sample read of a card is what the last reading said, whichever event brought it.
"""

from __future__ import annotations

from gpupool._core.planner.base import PlannerState
from gpupool._core.planner.learning import Learning
from gpupool._core.planner.out_of_memory import OutOfMemory
from gpupool._core.planner.samples import Recorder
from gpupool._core.planner.verdicts import OWN_RECORD_STEP_BYTES, CardReading
from gpupool._core.planner.views import Views
from gpupool._core.units import format_size

__all__ = ["Readings"]


class Readings:
    """The cards' live readings, in (the only writer of a card's ``live`` terms: its
    ``reading``, ``reading_s``, ``reading_error``, ``own_high_water_bytes`` and
    ``recorded_own_bytes``). A reading that raises the own high-water limits the asks (learning)
    and reviews the widths (the views); one that shows a capped card's room back lifts the cap
    (the out-of-memory room).
    :attr:`sample_cards` is the recorder's, bound: the card reader's end of a turn."""

    def __init__(
        self,
        state: PlannerState,
        views: Views,
        learning: Learning,
        oom: OutOfMemory,
        log: Recorder,
    ) -> None:
        self._state = state
        self._views = views
        self._learning = learning
        self._oom = oom
        self.sample_cards = log.sample_cards

    def observe(self, device: int, reading: CardReading, now_s: float) -> None:
        """A live snapshot of ``device``: the live gate reads it, the parent's own row raises
        the own high-water (a term of the bound: recorded when it grows), and a cap an
        out-of-memory set lifts once the readings show its room back."""
        card = self._state.cards[device]
        card.live.reading = reading
        card.live.reading_s = now_s
        card.live.reading_error = None
        own, pid = None, self._state.config.parent_pid
        if reading.process_bytes is not None:
            card.keep_workers(reading.process_bytes)
            own = reading.process_bytes.get(pid) if pid is not None else None
        if own is not None and own > card.live.own_high_water_bytes:
            card.live.own_high_water_bytes = own
            self._learning.limit_asks()
            if own - card.live.recorded_own_bytes >= OWN_RECORD_STEP_BYTES:
                card.live.recorded_own_bytes = own
                self._views.review(
                    now_s,
                    cause=(
                        f"this process's own device bytes grew to {format_size(own)} "
                        "(a term of the bound)"
                    ),
                    devices=(device,),
                )
        self._oom.lift_cap(card, reading, now_s)

    def observe_error(self, device: int, error: str, now_s: float) -> None:
        """A live reading of ``device`` failed: it runs one task of the pool at a time meanwhile."""
        card = self._state.cards[device]
        card.live.reading = None
        card.live.reading_error = error
        self._views.sensor_error(device, error, "the live gate runs one task at a time", now_s)

    def took(self, device: int, reading: CardReading, now_s: float) -> None:
        """``reading`` of ``device`` came with an out-of-memory: the reading its record states,
        kept without the rest of :meth:`observe` (the own high-water is observed after it)."""
        card = self._state.cards[device]
        card.live.reading, card.live.reading_s = reading, now_s
