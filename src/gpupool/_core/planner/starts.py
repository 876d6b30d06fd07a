"""The next start: which task, on which card, or why none (pure core).

Candidates come in the order :mod:`~gpupool._core.planner.order` gives (queue
order, the critical key first, or the waiting head first with room held for
it); each is admitted on the first card whose fit, share and live gate let it
start; when none is and nothing of the pool runs, the serial floor starts one.
"""

from __future__ import annotations

from typing import Literal

from gpupool._core.events import EventName
from gpupool._core.planner import order, records
from gpupool._core.planner.base import PlannerState
from gpupool._core.planner.fit import (
    Fit,
    LiveGate,
    live_gate,
)
from gpupool._core.planner.order import Hold, Order
from gpupool._core.planner.sharing import (
    ShareWait,
    share_record,
    share_wait,
    turn_record,
    turn_wait,
    yields_to,
)
from gpupool._core.planner.state import Card, Critical, TaskState, usable
from gpupool._core.planner.verdicts import (
    GATE_RECORD_INTERVAL_S,
    LIVE_POLL_S,
    Fail,
    Refuse,
    Start,
    TaskId,
    Wait,
    Warm,
    Workers,
)
from gpupool._core.planner.views import Views
from gpupool._core.policy import Ask

__all__ = ["Starts"]

Admission = Literal["yes", "no", "gate"]

#: How often a pool with tasks held back by an out-of-memory cap re-reads its cards, so the
#: cap can lift once the readings show its room back.
CAP_POLL_S = 0.25


def _start_on(task: TaskId, card: Card, ask: Ask) -> Start:
    """``task`` starts on ``card``, booked at its share of its key's price together there."""
    booked_bytes = ask.next_bytes(*card.key_counts(ask.key))
    return Start(task=task, device=card.index, ask_bytes=ask.ask_bytes, booked_bytes=booked_bytes)


class Starts:
    """The decision before every start (the only writer of the starts issued and the workers
    reported with the last ``next_start``), in the order :class:`Order` gives, by the fits,
    refusal and records of :class:`Views`."""

    def __init__(self, state: PlannerState, views: Views, order: Order) -> None:
        self._state = state
        self._views = views
        self._order = order
        # The starts issued and not yet begun (a start books what its verdict carried).
        self._issued: dict[TaskId, Start] = {}
        # The workers the process layer reported with the last ``next_start``.
        self._workers: Workers | None = None
        # When each kind of wait was last recorded (a share or gate wait: on each card).
        self._recorded_s: dict[tuple[EventName, int | None], float] = {}

    def take_issued(self, task: TaskId) -> Start | None:
        """The start issued for ``task`` (it begins now, or left the planner)."""
        return self._issued.pop(task, None)

    def next_start(
        self, now_s: float, workers: Workers | None = None
    ) -> Start | Warm | Wait | Fail | Refuse | None:
        """What to start now: a task and its card, a worker to warm for it, a wait (with why),
        a failure, strict mode's refusal, or ``None`` when nothing is pending. The width is
        brought up to date with the work held.

        ``workers``: the ready and booting workers per card. A task is admitted only where a ready
        worker is idle, so the bound is checked when the task runs, not when it is handed to a
        worker that still boots; where it fits but none is ready, the verdict is :class:`Warm`
        (start one). ``None``: every card has a ready worker (a planner driven without processes).

        The width is derived once per scheduling pass, at its end (a verdict that is not a
        start), and on a start only when tasks were submitted since it was last derived."""
        self._workers = workers
        if workers is not None and workers.booting_total:
            # How many more the pool admits now, for the work it holds: no more boot than that.
            self._views.refresh()
        verdict = self._next_start(now_s)
        self._views.refresh_due(started=isinstance(verdict, (Start, Warm)))
        if isinstance(verdict, Start):
            self._issued[verdict.task] = verdict
        return verdict

    def _next_start(self, now_s: float) -> Start | Warm | Wait | Fail | Refuse | None:
        state = self._state
        if self._views.refused is not None:
            return self._views.refused
        self._order.release()
        if not state.pending:
            return None
        if len(state.running) >= state.ceiling.value:
            return Wait(reason=f"the ceiling ({state.ceiling.limit}) holds {state.ceiling.value}")
        candidates, critical = self._order.candidates()
        return self._first_admitted(candidates, critical, state.pending[0], now_s)

    def _first_admitted(
        self, candidates: list[TaskId], critical: Critical | None, head: TaskId, now_s: float
    ) -> Start | Warm | Wait | Fail:
        if self._state.tasks[head].waiting_since_s is None:
            self._state.tasks[head].waiting_since_s = now_s
        gate_shut = False
        held: int | None = None
        for position, task in enumerate(candidates):
            if position == 1 and critical is not None:
                held = order.holds_for(
                    self._state.cards,
                    self._state.ask_of(candidates[0]),
                    self._state.tasks[candidates[0]].avoid,
                    reserve_bytes=self._state.config.reserve_bytes,
                    ceiling=self._state.ceiling,
                )
                if held is not None:
                    # The other keys leave that card's room to the critical key; a card it
                    # cannot use now still takes their tasks.
                    self._critical_wait(critical, self._state.tasks[task].key, held, now_s)
            if position == 1 and self._order.hold is not None:
                self._head_wait(self._order.hold, now_s)
            hold = self._order.hold if task != head else None
            verdict, shut = self._try_start(task, now_s, held=held, hold=hold)
            gate_shut = gate_shut or shut
            if isinstance(verdict, Start) and task != head:
                # Counted for the task passed (a retry put in front of it does not reset it).
                self._state.tasks[head].passed += 1
            if verdict is not None:
                return verdict
        return self._blocked(head, now_s, gate_shut)

    def _record_due(self, event: EventName, device: int | None, now_s: float) -> bool:
        """Whether a wait's record is due (at most one every :data:`GATE_RECORD_INTERVAL_S`);
        where it is, it is taken as made now."""
        last_s = self._recorded_s.get((event, device))
        if last_s is not None and now_s - last_s < GATE_RECORD_INTERVAL_S:
            return False
        self._recorded_s[(event, device)] = now_s
        return True

    def _critical_wait(self, critical: Critical, held_key: str, index: int, now_s: float) -> None:
        self._state.count("critical_waits")
        if self._record_due("critical_wait", None, now_s):
            reason, extra = records.critical_wait(critical, held_key, index)
            ask = self._state.asks.ask(critical.key)
            self._views.note("critical_wait", index, ask, reason, now_s, extra=extra)

    def _head_wait(self, hold: Hold, now_s: float) -> None:
        self._state.count("head_waits")
        if not self._record_due("head_wait", None, now_s):
            return
        head = self._state.tasks[self._state.pending[0]]
        since_s = head.waiting_since_s if head.waiting_since_s is not None else now_s
        reason, extra = records.head_wait(
            hold, self._state.cards[hold.device], head.passed, now_s - since_s
        )
        self._views.note(
            "head_wait", hold.device, self._state.asks.ask(hold.key), reason, now_s, extra=extra
        )

    def _try_start(
        self, task: TaskId, now_s: float, *, held: int | None = None, hold: Hold | None = None
    ) -> tuple[Start | Warm | Fail | None, bool]:
        """Start ``task`` on a card that admits it, never on ``held`` (a card whose room is
        left to the critical key), and on ``hold``'s card only beside the room held there."""
        task_state = self._state.tasks[task]
        if not self._state.cards:
            if self._ready(None):
                return Start(task=task, device=None, ask_bytes=0, booked_bytes=0), False
            return self._warm(None, task), False
        ask = self._state.ask_of(task)
        if self._state.config.fixed_width is not None:
            return self._fixed_start(task, task_state, ask, now_s)
        gate_shut = False
        fits = self._fits_for(task_state, ask, held, hold)
        # The card with the most room left after it first; a card whose ready worker can run
        # it now before one where a worker must boot for it.
        warm: Warm | None = None
        for found in sorted(fits, key=lambda f: -(f.left_bytes or 0)):
            card = self._state.cards[found.device]
            verdict = self._admits_on(card, ask, found, now_s)
            if verdict == "no":
                continue
            if verdict == "gate":
                gate_shut = True
                continue
            card.gate.gate_shut_since_s = None
            if not self._ready(found.device):
                warm = warm or self._warm(found.device, task, found.more)
                continue  # (its room may wait for the workers booting there)
            return _start_on(task, card, ask), False
        if warm is not None:
            return warm, gate_shut
        if (
            held is None
            and task_state.room_wait_until_s is not None
            and now_s >= task_state.room_wait_until_s
        ):
            # (Not while a card was left to the critical key: that card may have its room.)
            return self._expired(task, task_state, ask), gate_shut
        return None, gate_shut

    def _fits_for(
        self, task_state: TaskState, ask: Ask, held: int | None, hold: Hold | None
    ) -> list[Fit]:
        """The fit of a task (``task_state``, at ``ask``) on every card it may use: not ``held``,
        not one it avoids, and on ``hold``'s card only where it also fits beside what stays
        once the runs the head waits for end, and the head (so it never delays the head)."""
        slots = self._state.ceiling.value - len(self._state.running)
        fits: list[Fit] = []
        for card in usable(self._state.cards, task_state.avoid):
            if card.index == held:
                continue
            after = hold.after(card) if hold is not None and hold.device == card.index else None
            found = self._views.fit_beside(card.index, ask, None, after, slots=slots)
            if after is not None and found.more == 0:
                continue
            fits.append(found)
        return fits

    def _ready(self, device: int | None) -> bool:
        """A ready worker is idle on ``device`` (always, without worker counts)."""
        return self._workers is None or self._workers.can_run(device)

    def _warm(self, device: int | None, task: TaskId, more: int | None = None) -> Warm | None:
        """Start one more worker on ``device`` for ``task`` where fewer boot there than tasks fit
        there now (``more``; default: the slots the ceiling leaves), and fewer boot in the pool than
        tasks are pending and than the pool's width (the pending tasks that fit together now) leaves
        beside its running tasks, so that no worker boots for a task that would not start."""
        workers = self._workers
        running = len(self._state.running)
        slots = self._state.ceiling.value - running
        if workers is None or workers.booting.get(device, 0) >= (slots if more is None else more):
            return None
        room = min(len(self._state.pending), slots, max(1, self._views.width - running))
        return Warm(device=device, task=task) if workers.booting_total < room else None

    def _fixed_start(
        self, task: TaskId, task_state: TaskState, ask: Ask, now_s: float
    ) -> tuple[Start | Warm | Fail | None, bool]:
        """Under a fixed width: the card running fewest, whatever the bound says."""
        booting = self._workers.booting if self._workers is not None else {}
        card = min(
            self._state.cards, key=lambda c: (len(c.runs) + booting.get(c.index, 0), c.index)
        )
        if task_state.wait_below is not None and len(card.runs) >= task_state.wait_below:
            return None, False
        # Waiting for room others hold: the live gate as if nothing of the pool ran.
        if (
            task_state.room_wait_until_s is not None
            and not live_gate(card, ask, [], reserve_bytes=self._state.config.reserve_bytes).admits
        ):
            if now_s >= task_state.room_wait_until_s:
                return self._expired(task, task_state, ask), False
            return None, True
        if not self._ready(card.index):
            return self._warm(card.index, task), False
        return _start_on(task, card, ask), False

    def _admits_on(self, card: Card, ask: Ask, found: Fit, now_s: float) -> Admission:
        """Admission on one card: the fit (bound, cap, ceiling: ``found``), the share of a card
        other pools wait on, one at a time while readings fail, then the live gate."""
        if found.more == 0:
            return "no"
        if self._yields(card, ask, found.next_bytes, found.bound.room_bytes, now_s):
            return "no"
        wait = share_wait(card, found.next_bytes, found.bound.room_bytes)
        if wait is not None:
            self._share_wait(card, wait, now_s)
            return "no"
        if card.live.reading_error is not None and card.runs:
            return "no"
        gate = live_gate(
            card, ask, list(card.runs.values()), reserve_bytes=self._state.config.reserve_bytes
        )
        if not gate.admits:
            self._gate_shut(card, ask, gate, now_s)
            return "gate"
        return "yes"

    def _yields(
        self, card: Card, ask: Ask, next_bytes: int, room_bytes: int | None, now_s: float
    ) -> bool:
        """A start of ``next_bytes`` on ``card`` waits for another pool's turn there
        (:func:`~gpupool._core.planner.sharing.turn_wait`; recorded as a share wait)."""
        found = turn_wait(card, next_bytes, room_bytes, now_s)
        if found is None or room_bytes is None:
            return False
        self._state.count("share_waits")
        if self._record_due("share_wait", card.index, now_s):
            reason, extra = turn_record(card, found, room_bytes)
            self._views.note("share_wait", card.index, ask, reason, now_s, extra=extra)
        return True

    def still_admits(self, start: Start, now_s: float) -> bool:
        """After the other pools' bookings were read again in the same step that published
        this start's: does the start still fit? (Two pools deciding at once cannot both
        take the same room: whichever publishes second sees the first's booking.)"""
        if start.past_bound or start.device is None or self._state.config.fixed_width is not None:
            return True
        card = self._state.cards[start.device]
        task_state = self._state.tasks[start.task]
        ask = self._state.price(task_state)
        admitted = self._admits_on(card, ask, self._views.fit(card.index, ask), now_s) == "yes"
        if not admitted:
            self._issued.pop(start.task, None)
        return admitted

    def _expired(self, task: TaskId, task_state: TaskState, ask: Ask) -> Fail:
        self._state.unqueue(task)
        self._state.forget(task)
        return Fail(
            task=task,
            kind="room_wait_expired",
            reason=(
                f"it ran out of memory alone on the card while others' bytes held it, and no "
                f"room for its ask {ask.describe()} came free within room_wait_s="
                f"{self._state.config.room_wait_s:g}"
            ),
            device=task_state.last_device,
            booked_bytes=task_state.last_booked_bytes or ask.ask_bytes,
        )

    def _share_wait(self, card: Card, wait: ShareWait, now_s: float) -> None:
        self._state.count("share_waits")
        if self._record_due("share_wait", card.index, now_s):
            reason, extra = share_record(card, wait)
            ask = self._state.asks.ask(list(card.runs.values())[-1].key)
            self._views.note("share_wait", card.index, ask, reason, now_s, extra=extra)

    def _gate_shut(self, card: Card, ask: Ask, gate: LiveGate, now_s: float) -> None:
        if card.gate.gate_shut_since_s is None:
            card.gate.gate_shut_since_s = now_s
            card.gate.gate_episodes += 1
            self._state.count("gate_waits")
        if self._record_due("live_gate_wait", card.index, now_s):
            reason, extra = records.live_gate_wait(card, gate, card.gate.gate_episodes)
            card.gate.gate_episodes = 0
            self._views.note("live_gate_wait", card.index, ask, reason, now_s, extra=extra)

    def _blocked(self, head: TaskId, now_s: float, gate_shut: bool) -> Wait | Warm | Start:
        task_state = self._state.tasks[head]
        if self._workers is not None and self._workers.booting_total:
            # A worker that boots reports ready (an event): admit then, against that reading.
            return Wait(reason="workers are starting", poll_s=LIVE_POLL_S if gate_shut else None)
        if self._state.running:
            # Another pool's tasks end without an event here: poll while they hold a card.
            others = any(
                card.pools.others_tasks or card.pools.others_waiting for card in self._state.cards
            )
            poll_s = LIVE_POLL_S if gate_shut or others else None
            if poll_s is None and any(card.cap.oom_cap is not None for card in self._state.cards):
                # A cap lifts on the readings alone (no event says the room is back).
                poll_s = CAP_POLL_S
            return Wait(
                reason="the bound or the live gate holds the pending tasks back", poll_s=poll_s
            )
        if task_state.room_wait_until_s is not None:
            return Wait(reason="waiting for room after an out-of-memory", poll_s=LIVE_POLL_S)
        ask = self._state.ask_of(head)
        if any(
            yields_to(card, ask.ask_bytes, self._views.bound(card.index, ask).room_bytes, now_s)
            for card in self._state.cards
        ):
            # Not the serial floor: another pool waits at its own, and this one yields to it.
            return Wait(
                reason="this pool yields to another pool at the serial floor", poll_s=LIVE_POLL_S
            )
        return self._serial_floor(head, task_state, now_s, gate_shut)

    def _serial_floor(
        self, head: TaskId, task_state: TaskState, now_s: float, gate_shut: bool
    ) -> Wait | Warm | Start:
        """Nothing of the pool runs anywhere, and the head does not start: one task starts past
        the bound, on the card with the most room (logged), unless other pools hold it."""
        ask = self._state.ask_of(head)
        candidates = [card.index for card in usable(self._state.cards, task_state.avoid)]
        index = max(
            candidates,
            key=lambda i: (
                self._views.bound(i, ask).room_bytes is not None,
                self._views.bound(i, ask).room_bytes or 0,
                -i,
            ),
        )
        others_since = self._state.cards[index].pools.others_since_s
        if others_since is not None and now_s - others_since < self._state.config.room_wait_s:
            # Another pool's tasks hold the room: they end, so wait for them
            # (bounded) rather than start past the bound beside them.
            return Wait(reason="other pools' bookings hold the card", poll_s=LIVE_POLL_S)
        if not self._ready(index):
            return Warm(device=index, task=head)
        self._state.count("serial_starts")
        why = (
            "the live gate is shut (others' bytes fill the card; if the task runs out of "
            "memory it waits for room, it does not fail)"
            if gate_shut
            else "no card has room for one task"
        )
        self._views.note(
            "serial_start",
            index,
            ask,
            f"card {index}: {why} and nothing of the pool is running, so one task of "
            f"{task_state.key} starts past the bound (the serial floor); ask {ask.describe()}",
            now_s,
            limit="floor",
            task=task_state.identity,
        )
        return Start(
            task=head,
            device=index,
            ask_bytes=ask.ask_bytes,
            booked_bytes=ask.ask_bytes,
            past_bound=True,
        )
