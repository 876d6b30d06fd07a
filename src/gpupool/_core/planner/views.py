"""Every width the planner states, each a view of the one fit (pure core).

Admission, ``ex.width`` (:meth:`Views._width_now`), ``widths_by_key``, the warm-worker limit and
every record's width (:meth:`Views.decide`, used by :meth:`Views.review` and by records that move no
width) come from :func:`~gpupool._core.planner.fit.fit`, so the width a record states is what gated
the start beside it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping

from gpupool._core.bound import Bound, WidthDecision
from gpupool._core.events import Decision, EventName, JsonValue, TaskIdentity
from gpupool._core.planner.base import PlannerState
from gpupool._core.planner.fit import (
    Booked,
    Fit,
    Held,
    card_bound,
    card_widths,
    fit,
    fit_counts,
)
from gpupool._core.planner.order import Order
from gpupool._core.planner.samples import Recorder
from gpupool._core.planner.state import Card
from gpupool._core.planner.verdicts import (
    LOOKAHEAD,
    Refuse,
)
from gpupool._core.policy import Ask

__all__ = ["Views"]


@dataclasses.dataclass(slots=True)
class _Placed:
    """What one card holds while :meth:`Views._width_now` places the pending asks: its runs
    and the asks placed there, as the running sums a fit reads (how many, what they book,
    how many of each key were placed)."""

    running: int
    booked_bytes: int
    # By key: how many were placed, and how many of those at their own price (solo).
    keys: dict[str, tuple[int, int]] | None = None

    def place(self, key: str, booked_bytes: int, solo: bool) -> None:
        """One more task of ``key``, booked at ``booked_bytes`` (``solo``: at its own price),
        is placed here."""
        self.running += 1
        self.booked_bytes += booked_bytes
        if self.keys is None:
            self.keys = {}
        placed, alone = self.keys.get(key, (0, 0))
        self.keys[key] = (placed + 1, alone + solo)

    def counts(self, card: Card, key: str) -> tuple[int, int]:
        """How many tasks of ``key`` ``card`` holds with those placed, and how many of those
        at the key's price together (:meth:`Card.key_counts`)."""
        same, together = card.key_counts(key)
        placed, alone = self.keys.get(key, (0, 0)) if self.keys else (0, 0)
        return same + placed, together + placed - alone


class Views:
    """Every width the planner states, the reviews that record them, and strict mode's refusal
    (the only writer of :attr:`width` and :attr:`refused`); the order is read for the room
    held for the queue's head."""

    def __init__(self, state: PlannerState, order: Order, log: Recorder) -> None:
        self._state = state
        self._order = order
        self._log = log
        # Strict mode's refusal, once a narrowing was refused (``next_start`` returns it).
        self.refused: Refuse | None = None
        # The last widths decided (:meth:`decide`) and the fits they were shared out from:
        # the same fits (each card's, served by its memo) share out alike.
        self._decided: tuple[tuple[object, ...], tuple[WidthDecision, ...]] | None = None
        # Tasks were submitted since the width was last derived (a start then derives it).
        self._due = False
        self.width = self._width_now()

    def refresh(self, now_s: float | None = None) -> None:
        """Derive :attr:`width` again (and, given ``now_s``, note it on the timeline)."""
        self.width = self._width_now()
        if now_s is not None:
            self._log.timeline(now_s, self.width)

    def submitted(self) -> None:
        """Tasks were submitted: the next start derives the width again."""
        self._due = True

    def refresh_due(self, *, started: bool) -> None:
        """The end of a scheduling pass: the width is derived again unless the pass ``started``
        a task and nothing was submitted since it was last derived."""
        if self._due or not started:
            self._due = False
            self.width = self._width_now()

    def construct(
        self, now_s: float, *, note: str = "", extra: Mapping[str, JsonValue] | None = None
    ) -> Refuse | None:
        """Decide and record the first width of every card, from the same fit as every later
        one. Returns strict mode's refusal where the width is below ``max_workers``."""
        state = self._state
        ask = state.asks.ask("")
        cpus_note = self._cpus_note()
        if not state.cards:
            self.refresh(now_s)
            reason = state.census.reason or "no device"
            self._log.record(
                Decision(
                    event="constructed",
                    time_s=now_s,
                    device=None,
                    width_before=None,
                    width_after=self.width,
                    reason=(
                        f"{reason}; a host-bounded pool of width {self.width}, set by "
                        f"{state.ceiling.limit} ({state.ceiling.value}){cpus_note}"
                    ),
                    ceiling=state.ceiling,
                    limit=state.ceiling.limit,
                    extra={"driver": state.census.driver, "sensor": state.census.sensor},
                )
            )
            return None
        decisions = self.decide(ask)
        for decision in decisions:
            card = state.cards[decision.device]
            card.width = decision.width
            census = card.census
            reason_note = f"; {census.reason}" if census.reason else ""
            self._log.record(
                Decision.from_width(
                    "constructed",
                    decision,
                    time_s=now_s,
                    width_before=None,
                    reason=f"{decision.describe()}{note}{reason_note}{cpus_note}",
                    extra={
                        "uuid": census.uuid,
                        "census_free_bytes": census.free_bytes,
                        "census_own_bytes": census.own_bytes,
                        "reserved_bytes": census.reserved_bytes,
                        "source": census.source,
                        "own_source": census.own_source,
                        "unified": census.unified,
                        **(extra or {}),
                    },
                )
            )
        self.refresh(now_s)
        if state.config.fixed_width is not None:
            self._check_fixed(decisions, now_s)
        return self._refuse_at_construction(decisions, now_s)

    def _refuse_at_construction(
        self, decisions: tuple[WidthDecision, ...], now_s: float
    ) -> Refuse | None:
        config = self._state.config
        width = sum(d.width for d in decisions)
        wanted = min(config.max_workers, self._state.ceiling.value)
        if not config.strict or config.fixed_width is not None or width >= wanted:
            return None
        narrow = min(decisions, key=lambda d: d.width)
        reason = (
            f"strict mode: the bound gives width {width}, below the requested "
            f"{config.max_workers}: "
            + "; ".join(d.describe() for d in decisions)
            + ". Free the card, lower max_workers, or drop strict=True."
        )
        record = Decision.from_width(
            "narrowed", narrow, time_s=now_s, width_before=config.max_workers, reason=reason
        )
        self.refused = Refuse(reason=reason, decision=record)
        return self.refused

    def _cpus_note(self) -> str:
        host = self._state.census.host
        config = self._state.config
        if config.max_workers_given and config.max_workers > host.cpus:
            return (
                f"; max_workers={config.max_workers} is more than the {host.cpus} usable CPUs "
                f"({host.cpu_source}): kept, as the standard pool keeps it"
            )
        return ""

    def sensor_error(self, device: int | None, error: str, effect: str, now_s: float) -> None:
        """Record a failed reading, once per card and kind of error."""
        if not self._log.first_error(device, error):
            return
        self._state.count("sensor_errors")
        self.note(
            "sensor_error",
            device,
            self._state.asks.ask(self._state.last_key),
            f"card {device}: a reading failed ({error}); {effect} while it fails; the "
            "static bound still applies",
            now_s,
            extra={"error": error[:500]},
        )

    def bound(self, device: int, ask: Ask) -> Bound:
        """``device``'s bound priced at ``ask``, with its own high-water so far."""
        return card_bound(
            self._state.cards[device],
            ask,
            reserve_bytes=self._state.config.reserve_bytes,
            ceiling=self._state.ceiling,
        )

    def fit(
        self, device: int, ask: Ask, runs: list[Held] | None = None, *, slots: int | None = None
    ) -> Fit:
        """The one fit on ``device`` at ``ask`` beside ``runs`` (default: the card's runs),
        within ``slots`` (default: what the ceiling leaves the pool)."""
        if slots is None:
            slots = self._state.ceiling.value - len(self._state.running)
        return fit(
            self._state.cards[device],
            ask,
            runs,
            reserve_bytes=self._state.config.reserve_bytes,
            ceiling=self._state.ceiling,
            slots=slots,
        )

    def fit_beside(
        self,
        device: int,
        ask: Ask,
        runs: list[Held] | None,
        after: list[Held] | None,
        *,
        slots: int | None = None,
    ) -> Fit:
        """:meth:`fit` beside ``runs``; on the card a waiting head holds, ``after`` is what it
        holds once the runs the head waits for end, and the head: a task fits there only where
        it fits beside both (so it never delays the head), else ``more`` is 0."""
        found = self.fit(device, ask, runs, slots=slots)
        if after is not None and found.more and not self.fit(device, ask, after, slots=slots).more:
            return dataclasses.replace(found, more=0, limit="memory")
        return found

    def decide(self, ask: Ask) -> tuple[WidthDecision, ...]:
        """Every card's width for tasks priced at ``ask``: its runs plus the ones that fit
        beside them (the cap an out-of-memory set holds), within the ceiling.

        Shared out once per set of fits: where every card's fit is the one the last decision
        was shared out from (the same object, which its card's memo serves only while its
        terms hold) and the ceiling is the same, that decision is the answer."""
        fits = tuple(self.fit(i, ask) for i in range(len(self._state.cards)))
        last = self._decided
        if (
            last is not None
            and last[0][0] is self._state.ceiling
            and len(last[0]) == len(fits) + 1
            and all(a is b for a, b in zip(last[0][1:], fits, strict=True))
        ):
            return last[1]
        decisions = card_widths(fits, self._state.ceiling)
        self._decided = ((self._state.ceiling, *fits), decisions)
        return decisions

    def note(
        self,
        event: EventName,
        device: int | None,
        ask: Ask,
        reason: str,
        now_s: float,
        *,
        limit: str | None = None,
        extra: Mapping[str, JsonValue] | None = None,
        task: TaskIdentity | None = None,
    ) -> None:
        """Record what moves no width: the card's width as the fit states it now (``task``:
        the one task it is about)."""
        bound = None
        width = self.width
        if device is not None and self._state.cards:
            bound = self.bound(device, ask)
            width = self.decide(ask)[device].width
        self._log.record(
            Decision(
                event=event,
                time_s=now_s,
                device=device,
                width_before=width,
                width_after=width,
                reason=reason,
                bound=bound,
                ceiling=self._state.ceiling,
                limit=limit,
                key=ask.key or None,
                extra=dict(extra or {}),
                key_ask=ask if ask.key else None,
                task=task,
            )
        )

    def _check_fixed(self, decisions: tuple[WidthDecision, ...], now_s: float) -> None:
        fixed = self._state.config.fixed_width
        assert fixed is not None
        bound_width = sum(d.width for d in decisions)
        if bound_width >= fixed:
            return
        narrow = min(decisions, key=lambda d: d.width)
        self._log.record(
            Decision(
                event="fixed_width_over_bound",
                time_s=now_s,
                device=None,
                width_before=fixed,
                width_after=fixed,
                reason=(
                    f"fixed width {fixed} is wider than the bound allows ({bound_width}: "
                    + "; ".join(d.describe() for d in decisions)
                    + "); keeping the width you asked for"
                ),
                bound=narrow.bound,
                ceiling=self._state.ceiling,
                limit=narrow.limit,
                extra={
                    "bound_width": bound_width,
                    "bound_widths": ",".join(str(d.width) for d in decisions),
                },
            )
        )

    def review(
        self,
        now_s: float,
        *,
        cause: str | Callable[[], str],
        key: str | None = None,
        devices: tuple[int, ...] | None = None,
        quiet: bool = False,
        unchanged: EventName = "bound_changed",
        moved_event: EventName | None = None,
        extra: Mapping[str, JsonValue] | None = None,
    ) -> bool:
        """A term of the bound changed: decide the widths again and record what moved.

        ``cause`` is what changed, in words (or a function that words it, called only where a record
        is written). ``unchanged`` names the record of a card whose width did not move
        (``"measured"`` for a key's first measurement, ``"widen_refused"`` for a smaller ask the
        room does not let widen); ``moved_event`` names the record of one that moved (default:
        ``"widened"`` or ``"narrowed"``). Returns whether any card's width moved.
        """
        if not self._state.cards:
            return False
        priced = (
            key if key is not None else (self._state.present_keys() or [self._state.last_key])[0]
        )
        ask = self._state.asks.ask(priced)
        decisions = self.decide(ask)
        moved = False
        for decision in decisions:
            card = self._state.cards[decision.device]
            old, new = card.width, decision.width
            if devices is not None and decision.device not in devices and new == old:
                continue
            if new == old and quiet:
                continue
            if new < old and self._refuses(new, decision, old, ask, now_s):
                return True
            event = self._event(decision, old, unchanged, moved_event)
            moved = moved or new != old
            card.width = new
            self._log.record(
                Decision.from_width(
                    event,
                    decision,
                    time_s=now_s,
                    width_before=old,
                    reason=f"{decision.describe()}; {cause if isinstance(cause, str) else cause()}"
                    f"; width {old} -> {new}",
                    key=priced or None,
                    key_ask=ask if priced else None,
                    extra=dict(extra or {})
                    | {"oom_cap": card.cap.oom_cap, "running": len(card.runs)},
                )
            )
        if self._state.config.fixed_width is not None and moved:
            self._check_fixed(decisions, now_s)
        self.refresh(now_s)
        return moved

    def _event(
        self,
        decision: WidthDecision,
        old: int,
        unchanged: EventName,
        moved_event: EventName | None,
    ) -> EventName:
        """The record's event for a card's width going ``old`` -> ``decision.width``."""
        new = decision.width
        if new != old:
            return moved_event or ("widened" if new > old else "narrowed")
        if unchanged == "widen_refused" and (
            decision.limit != "memory" or new >= self._state.ceiling.value
        ):
            return "bound_changed"
        return unchanged

    def _refuses(self, new: int, decision: WidthDecision, old: int, ask: Ask, now_s: float) -> bool:
        """Strict mode: a narrowing below the requested width is refused (and recorded)."""
        config = self._state.config
        if (
            not config.strict
            or config.fixed_width is not None
            or sum(c.width for c in self._state.cards) - old + new
            >= min(config.max_workers, self._state.ceiling.value)
        ):
            return False
        message = (
            f"strict mode: {decision.describe()}, below the requested width "
            f"{config.max_workers}; refusing to narrow. Free the card, lower max_workers, "
            "or drop strict=True."
        )
        record = Decision.from_width(
            "narrowed",
            decision,
            time_s=now_s,
            width_before=old,
            reason=message,
            key=ask.key or None,
            key_ask=ask if ask.key else None,
        )
        self._log.record(record)
        self.refused = Refuse(reason=message, decision=record)
        return True

    def _width_now(self) -> int:
        """How many tasks the planner admits at once now, for the work it holds: the running
        tasks, plus the pending asks placed card by card where the fit admits them beside
        what runs (and, on the card a waiting head holds, beside what stays once the runs it
        waits for end, and the head)."""
        state, hold = self._state, self._order.hold
        if state.config.fixed_width is not None:
            return state.config.fixed_width
        if not state.cards:
            return state.ceiling.value
        placed = [_Placed(len(card.runs), card.sums.booked_bytes) for card in state.cards]
        after = hold.after(state.cards[hold.device]) if hold is not None else []
        total = len(state.running)
        # The held head's room is placed already. Priced one by one: the walk ends at the
        # ceiling, so a long queue costs no more than the width it could add.
        skip = 1 if hold is not None else 0
        pending = itertools.islice(state.pending, skip, LOOKAHEAD)
        asks = (state.price(state.tasks[t]) for t in pending)
        # What the next submits could add: more of the last key seen.
        placed_pending = max(0, min(len(state.pending), LOOKAHEAD) - skip)
        more = itertools.repeat(
            state.asks.ask(state.last_key), max(0, state.ceiling.value - total - placed_pending)
        )
        for ask in itertools.chain(asks, more):
            if total >= state.ceiling.value:
                break
            best = self._best_placed(ask, placed, after)
            if best is not None:
                # Booked without the child's RSS: the fit prices that beside each booking.
                placed[best.device].place(ask.key, best.next_booked_bytes, ask.individual)
                if hold is not None and best.device == hold.device:
                    after.append(Booked(ask.key, best.next_booked_bytes, ask.individual))
                total += 1
        return max(1, min(total, state.ceiling.value))

    def _best_placed(self, ask: Ask, placed: list[_Placed], after: list[Held]) -> Fit | None:
        """The card with the most room left once a task at ``ask`` is placed beside what each
        holds (``placed``), never one where it would delay the waiting head (``after``)."""
        state, hold = self._state, self._order.hold
        best: Fit | None = None
        for card, there in zip(state.cards, placed, strict=True):
            same, together = there.counts(card, ask.key)
            option = fit_counts(
                card,
                ask,
                running=there.running,
                booked_bytes=there.booked_bytes,
                same=same,
                together=together,
                reserve_bytes=state.config.reserve_bytes,
                ceiling=state.ceiling,
                slots=1,
            )
            if (
                hold is not None
                and card.index == hold.device
                and option.more
                and not self.fit(card.index, ask, after, slots=1).more
            ):
                continue  # it would delay the head (as :meth:`fit_beside` says)
            if option.more and (best is None or (option.left_bytes or 0) > (best.left_bytes or 0)):
                best = option
        return best
