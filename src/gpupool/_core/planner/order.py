"""The start order: which pending task is tried first, and what room is left to whom.

Tasks start in queue order, with two exceptions, each of which holds room
rather than idling the card:

* **The critical key** (:func:`critical`): once every key with pending work has a timed task, the
  key whose pending work would take longest alone starts first where it leads every other key by at
  least one of its tasks' duration, and other keys leave it room on a card where their ends make it
  (:func:`holds_for`).
* **The head's hold** (:func:`head_hold`): a task at the queue's head that does not fit yet is
  passed by smaller tasks at most a ceiling's worth of times; from then on its room is held on the
  card where the running tasks expected to end first free it soonest (those runs are its ``ending``
  set). Other tasks still start there while they fit now *and* beside what stays once those runs end
  plus the head (:meth:`Hold.after`): no start can delay it, so it starts as soon as those runs'
  bookings free its room, and the rest of the card keeps working meanwhile. The hold is kept
  (:func:`keep_hold`) until the head starts: chosen again, it could name other runs, and the starts
  placed beside the first one would then stand in the head's way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpupool._core.bound import Ceiling
from gpupool._core.planner.base import Durations, PlannerState
from gpupool._core.planner.fit import (
    Booked,
    Held,
    card_bound,
    fit,
    host_per_task_bytes,
    key_counts,
)
from gpupool._core.planner.state import Card, Critical, Run, usable
from gpupool._core.planner.verdicts import LOOKAHEAD, TaskId
from gpupool._core.policy import Ask

__all__ = ["Hold", "Order", "alone_width", "critical", "head_hold", "holds_for", "keep_hold"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Hold:
    """Room held on ``device`` for the task at the queue's head (of ``key``, booked there at
    ``held_bytes``), which waits for it: the ``ending`` runs' ends make it (those expected
    to end first)."""

    device: int
    key: str
    held_bytes: int
    ending: frozenset[TaskId]
    # The head is priced on its own (an individual ask), not at its key's price together.
    solo: bool = False

    def after(self, card: Card) -> list[Held]:
        """What the card holds once the ``ending`` runs end and the head starts: another
        start must fit beside these too, so that it never delays the head."""
        kept: list[Held] = [r for t, r in card.runs.items() if t not in self.ending]
        return [*kept, Booked(self.key, self.held_bytes, self.solo)]


def alone_width(cards: Sequence[Card], ask: Ask, *, reserve_bytes: int, ceiling: Ceiling) -> int:
    """How many tasks at ``ask`` the pool's cards hold at once with nothing else running
    (an unreadable card holds one)."""
    alone = sum(
        fit(card, ask, (), reserve_bytes=reserve_bytes, ceiling=ceiling, slots=ceiling.value).more
        for card in cards
    )
    return max(1, min(alone, ceiling.value))


def critical(
    keys: Sequence[str],
    *,
    pending_by_key: Callable[[str], int],
    duration_s: Callable[[str], float | None],
    width_alone: Callable[[str], int],
) -> Critical | None:
    """The critical key among ``keys`` (each with pending work), or ``None``.

    A key's time left is its pending count x its tasks' mean duration / how many of them
    fit at once alone. The key with the most is critical where it leads every other key by
    at least one of its tasks' duration: the run ends when it does, so it goes first. Until
    every key's tasks were timed, the queue's order stands."""
    if len(keys) < 2:
        return None
    times: list[tuple[float, float, int]] = []
    for key in keys:
        took_s = duration_s(key)
        if took_s is None:
            return None
        width = width_alone(key)
        times.append((pending_by_key(key) * took_s / width, took_s, width))
    first = max(range(len(keys)), key=lambda i: times[i][0])
    left_s, took_s, width = times[first]
    runner_up_s = max(times[i][0] for i in range(len(keys)) if i != first)
    if left_s - runner_up_s < took_s:
        return None
    return Critical(
        key=keys[first], time_left_s=left_s, runner_up_time_left_s=runner_up_s, width=width
    )


def holds_for(
    cards: Sequence[Card],
    ask: Ask,
    avoid: set[int],
    *,
    reserve_bytes: int,
    ceiling: Ceiling,
) -> int | None:
    """The card where the other keys should leave room for the critical key's first task
    (at ``ask``, not fitting now), or ``None``.

    A card qualifies where ending some of the other keys' tasks there lets it start
    without leaving the card less booked than now (the ended tasks' room refilled with
    as many of them as fit beside it): their ends make the room, at most one of their
    tasks' duration away, and the card's bytes do not go idle for it."""

    def fits(runs: Sequence[Held], card: Card) -> bool:
        return fit(card, ask, runs, reserve_bytes=reserve_bytes, ceiling=ceiling, slots=1).more > 0

    for card in usable(cards, avoid):
        runs: list[Held] = list(card.runs.values())
        room = card_bound(card, ask, reserve_bytes=reserve_bytes, ceiling=ceiling).room_bytes
        if room is None or fits(runs, card):
            # The card's room is unknown, or it fits the bound here now (something else
            # holds it back).
            continue
        kept = sorted(runs, key=lambda r: (r.key != ask.key, r.booked_bytes))
        ended: list[Held] = []
        while kept and kept[-1].key != ask.key and not fits(kept, card):
            ended.append(kept.pop())
        if not ended or not fits(kept, card):
            continue
        host = host_per_task_bytes(card, ceiling)  # unified memory: each child's RSS too
        need = ask.next_bytes(*key_counts(kept, ask.key)) + host
        after = sum(r.booked_bytes + host for r in kept) + need
        for run in sorted(ended, key=lambda r: r.booked_bytes):
            if after + run.booked_bytes + host <= room:
                after += run.booked_bytes + host
        if after >= sum(r.booked_bytes + host for r in runs):
            return card.index
    return None


def head_hold(
    cards: Sequence[Card],
    ask: Ask,
    avoid: set[int],
    *,
    reserve_bytes: int,
    ceiling: Ceiling,
    expected_end_s: Callable[[Run], float],
) -> Hold | None:
    """Where to hold room for the waiting head task (at ``ask``), and which runs' ends make it:
    on each card where it fits alone, the runs expected to end first (``expected_end_s``)
    until their bookings free its room; the card where that happens soonest wins. ``None``
    where no card holds it even alone (the serial floor is for that)."""
    best: tuple[float, Hold] | None = None
    for card in usable(cards, avoid):
        alone = fit(card, ask, (), reserve_bytes=reserve_bytes, ceiling=ceiling, slots=1)
        if alone.more == 0 or alone.bound.room_bytes is None:
            continue
        held = ask.next_bytes(*card.key_counts(ask.key))
        host = alone.bound.host_per_task_bytes  # unified memory: each child's RSS too
        need = held + host
        free = alone.bound.room_bytes - card.sums.booked_bytes - host * len(card.runs)
        ending: list[TaskId] = []
        when_s = 0.0
        for task, run in sorted(card.runs.items(), key=lambda item: expected_end_s(item[1])):
            if free >= need:
                break
            ending.append(task)
            free += run.booked_bytes + host
            when_s = expected_end_s(run)
        if free < need:
            continue
        hold = Hold(
            device=card.index,
            key=ask.key,
            held_bytes=held,
            ending=frozenset(ending),
            solo=ask.individual,
        )
        if best is None or when_s < best[0]:
            best = (when_s, hold)
    return best[1] if best is not None else None


def keep_hold(
    hold: Hold, card: Card, ask: Ask, *, reserve_bytes: int, ceiling: Ceiling
) -> Hold | None:
    """``hold`` (on ``card``) as it stands now: the runs it waits for that still run, and the
    head's booking (at ``ask``) beside what stays once they end. ``None`` where their ends no
    longer make its room (a price or a cap moved): a new hold is chosen then."""
    ending = frozenset(task for task in hold.ending if task in card.runs)
    stays: list[Held] = [run for task, run in card.runs.items() if task not in ending]
    found = fit(card, ask, stays, reserve_bytes=reserve_bytes, ceiling=ceiling, slots=1)
    if found.more == 0 or found.bound.room_bytes is None:
        return None
    return Hold(
        device=hold.device,
        key=ask.key,
        held_bytes=found.next_booked_bytes,
        ending=ending,
        solo=ask.individual,
    )


class Order:
    """The start order of one planner: the candidates of each pass, the critical key among
    them, and the room held for the queue's head (the only writer of :attr:`hold`). Reads
    the state and the durations."""

    def __init__(self, state: PlannerState, durations: Durations) -> None:
        self._state = state
        self._durations = durations
        # Room held for the queue's head once it was passed a ceiling's worth of times.
        self.hold: Hold | None = None
        # The head that hold is for: kept while that task waits at the head.
        self._held_for: tuple[TaskId, Hold] | None = None

    def release(self) -> None:
        """A new scheduling pass: no room is held until :meth:`candidates` holds it again."""
        self.hold = None

    def candidates(self) -> tuple[list[TaskId], Critical | None]:
        """The pending tasks to try, in order (each key's first within the lookahead, the
        critical key's first; or the queue's head first, with room held for it once it was
        passed a ceiling's worth of times), and the critical key where it leads."""
        state = self._state
        head = state.pending[0]
        firsts: dict[str, TaskId] = {state.tasks[head].key: head}
        if state.pending_by_key[state.tasks[head].key] < len(state.pending):
            # More than one key waits: each one's first within the lookahead (with one key,
            # the head is its first, and the queue is not walked).
            for task in itertools.islice(state.pending, LOOKAHEAD):
                firsts.setdefault(state.tasks[task].key, task)
        candidates, found = self._critical_first(list(firsts.values()))
        passed = state.tasks[head].passed
        if passed >= max(1, state.ceiling.value) and state.cards:
            # The queue's head was passed a ceiling's worth of times in a row: it goes first,
            # and the others start only beside the room held for it.
            candidates, found = [head, *(t for t in candidates if t != head)], None
            if state.config.fixed_width is None:
                self.hold = self._hold_for(head)
            if self.hold is None:
                candidates = [head]
        elif passed >= max(1, state.ceiling.value):
            candidates = [head]
        return candidates, found

    def _hold_for(self, head: TaskId) -> Hold | None:
        """The room held for ``head``: the hold it was given while the runs it names still make
        its room (the starts placed beside that hold left it room there, not beside another
        one), else a new one, on the card where the runs expected to end first free it."""
        state = self._state
        ask = state.ask_of(head)
        reserve_bytes = state.config.reserve_bytes
        hold: Hold | None = None
        if self._held_for is not None and self._held_for[0] == head:
            kept, card = self._held_for[1], state.cards[self._held_for[1].device]
            hold = keep_hold(kept, card, ask, reserve_bytes=reserve_bytes, ceiling=state.ceiling)
        if hold is None:
            hold = head_hold(
                state.cards,
                ask,
                state.tasks[head].avoid,
                reserve_bytes=reserve_bytes,
                ceiling=state.ceiling,
                expected_end_s=self._durations.expected_end_s,
            )
        self._held_for = None if hold is None else (head, hold)
        return hold

    def _critical_first(self, firsts: list[TaskId]) -> tuple[list[TaskId], Critical | None]:
        """The keys' first pending tasks in queue order, or with the critical key's first."""
        state = self._state
        if not state.cards or state.config.fixed_width is not None:
            return firsts, None
        keys = [state.tasks[t].key for t in firsts]
        found = critical(
            keys,
            pending_by_key=lambda key: state.pending_by_key[key],
            duration_s=self._durations.mean_s,
            width_alone=lambda key: alone_width(
                state.cards,
                state.asks.ask(key),
                reserve_bytes=state.config.reserve_bytes,
                ceiling=state.ceiling,
            ),
        )
        if found is None:
            return firsts, None
        first = keys.index(found.key)
        return [firsts[first], *firsts[:first], *firsts[first + 1 :]], found
