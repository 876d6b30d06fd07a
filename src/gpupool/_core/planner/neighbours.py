"""The host's other pools on this pool's cards: what it hears of them and tells them (pure core).

The booking link (:mod:`gpupool._pool.booking_link`) exchanges this pool's row of the host's
booking table with the other pools' rows. What it reads of theirs comes here (each of their
tasks priced by :func:`~.sharing.note_others`, a term of every card's bound); what it writes of
this pool's is asked here: the bookings of its running tasks, how many of its pending tasks
wait for room and the ask of the first of them. How many workers a card may keep warm is asked
here too, because an idle worker's context is bytes a waiting pool may be owed.

A card's terms of its other pools (``card.pools``: ``others``, ``others_bytes`` and the rest
that :func:`~.sharing.note_others` sets) are written from here only; what the other pools are
told is read off the state as it stands, so that it is what this pool's next start would see.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from gpupool._core.bookings import OtherPools, TaskBooking
from gpupool._core.planner.base import PlannerState
from gpupool._core.planner.learning import Learning
from gpupool._core.planner.sharing import note_others, owes_room, share_tasks, yields_to
from gpupool._core.planner.verdicts import RETIRE_AFTER_SHUT_S
from gpupool._core.planner.views import Views
from gpupool._core.predict import Features
from gpupool._core.units import format_size

__all__ = ["Neighbours"]


class Neighbours:
    """The other pools' bookings in, this pool's bookings and waits out, and the warm limit
    that leaves the other pools their room. An other pools' reading that moves what they
    book reviews the widths (the views); one beside the census moves the rooms the asks are
    limited to (learning)."""

    def __init__(self, state: PlannerState, views: Views, learning: Learning) -> None:
        self._state = state
        self._views = views
        self._learning = learning

    def observe_others(
        self,
        device: int,
        others: OtherPools | None,
        now_s: float,
        *,
        census: bool = False,
        rows: Mapping[int, int] | None = None,
    ) -> None:
        """The host's other pools' bookings on ``device`` (``None``: the table is unreachable,
        so the live gate alone sees them). Each of their tasks is priced at the larger of its
        booking and what ``rows`` (default: the card's last reading) show its worker holding.
        ``census``: this reading stands beside the census, whose co-tenant bytes hold what
        those pools hold now (they are priced by their bookings instead)."""
        card = self._state.cards[device]
        if rows is None:
            rows = {}
            if card.live.reading is not None and card.live.reading.process_bytes is not None:
                rows = card.live.reading.process_bytes
        before = card.pools.others_bytes
        terms = note_others(card, others, rows, now_s, census=census)
        if census:
            self._learning.rooms_moved()
            return
        if card.pools.others_bytes != before:
            self._views.review(
                now_s,
                cause=(
                    f"other pools on the card book {format_size(card.pools.others_bytes)} over "
                    f"{terms.tasks} task{'s' if terms.tasks != 1 else ''} "
                    f"({format_size(terms.unreached_bytes)} not yet reached)"
                ),
                devices=(device,),
                quiet=True,
                extra={
                    "other_pools_bytes": card.pools.others_bytes,
                    "other_pools_unreached_bytes": terms.unreached_bytes,
                    "other_pools_tasks": terms.tasks,
                },
            )

    def warm_limit(self, device: int, now_s: float) -> int:
        """How many workers ``device`` may keep (running and idle): its runs, as many tasks
        of a present key as fit there alone, or, while other pools wait there, as many as
        this pool's share holds (the room a pool's ended task frees goes round the pools
        by turns: ``sharing.gives_way``), whichever is more."""
        state = self._state
        card = state.cards[device]
        running = len(card.runs)
        room = self._views.bound(device, state.asks.ask(state.last_key)).room_bytes
        if (
            (
                card.gate.gate_shut_since_s is not None
                and now_s - card.gate.gate_shut_since_s >= RETIRE_AFTER_SHUT_S
            )
            or owes_room(card, room)
            or yields_to(card, 0, room, now_s) is not None
        ):
            # An idle worker's context is bytes the card needs: this pool's gate has been
            # shut a while, or a waiting pool is owed room there that is not free (or this
            # pool yields to one at the serial floor there).
            return running
        keys = state.present_keys() or [state.last_key]
        fits = max(
            self._views.fit(device, state.asks.ask(k), [], slots=state.ceiling.value).more
            for k in keys
        )
        turns = share_tasks(card, room, state.asks.ask(state.last_key).ask_bytes)
        return max(running, min(max(1, fits, turns), state.ceiling.value))

    def waiting_count(self, *, starting: bool = False) -> int:
        """How many pending tasks the pool's own ceiling (or fixed width) would let start now:
        what other pools on its cards are told waits for room. ``starting``: one pending
        task is being started (it counts as running)."""
        state = self._state
        pending = len(state.pending) - starting
        running = len(state.running) + starting
        count = min(pending, state.ceiling.value - running)
        if state.cards and all(card.cap.oom_cap is not None for card in state.cards):
            # Every card runs at most its out-of-memory cap: no more can start than those.
            free = sum(max(0, (card.cap.oom_cap or 0) - len(card.runs)) for card in state.cards)
            count = min(count, free - starting)
        return max(0, count)

    def need_bytes(self, *, starting: bool = False) -> int:
        """The ask of the first pending task that waits for room (0 when none does): the room
        other pools are told this pool needs for its next task."""
        state = self._state
        if self.waiting_count(starting=starting) == 0 or len(state.pending) <= starting:
            return 0
        return state.price(state.tasks[state.pending[int(starting)]]).ask_bytes

    def waiting_asks(self, first: int, count: int) -> list[tuple[str, int]]:
        """The key and ask of the pending tasks ``first`` to ``first + count``, in order."""
        state = self._state
        # One price per key, size, features and floor.
        asks: dict[tuple[str, float | None, Features, int], int] = {}
        entries: list[tuple[str, int]] = []
        for task in itertools.islice(state.pending, first, first + count):
            task_state = state.tasks[task]
            slot = (task_state.key, task_state.size, task_state.features, task_state.floor_bytes)
            if slot not in asks:
                asks[slot] = state.price(task_state).ask_bytes
            entries.append((slot[0], asks[slot]))
        return entries

    def booked_on(self, device: int) -> list[tuple[int, int]]:
        """This pool's running tasks on ``device`` that have a worker, as ``(worker pid,
        booked bytes)``: what a task's end asks of them (no row is built)."""
        return [
            (run.pid, run.booked_bytes)
            for run in self._state.running.values()
            if run.device == device and run.pid is not None
        ]

    def bookings_on(self, device: int) -> tuple[TaskBooking, ...]:
        """This pool's running tasks on ``device`` that have a worker, as booking-table rows
        (what each reached is not the planner's to know: 0)."""
        return tuple(
            TaskBooking(
                worker_pid=run.pid, key=run.key, booked_bytes=run.booked_bytes, reached_bytes=0
            )
            for run in self._state.running.values()
            if run.device == device and run.pid is not None
        )
