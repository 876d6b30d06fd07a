"""The next start: which task, on which card, or why none (pure core).

Candidates come in the order :mod:`~gpupool._core.planner.order` gives (queue
order, the critical key first, or the waiting head first with room held for
it); each is admitted on the first card whose fit, share and live gate let it
start; when none is and nothing of the pool runs, the serial floor starts one.
"""

from __future__ import annotations

import itertools
from typing import Literal

from gpupool._core.planner import order, records
from gpupool._core.planner.fit import (
    Fit,
    LiveGate,
    live_gate,
)
from gpupool._core.planner.order import Hold
from gpupool._core.planner.sharing import (
    ShareWait,
    share_wait,
    turn_record,
    turn_wait,
    yields_to,
)
from gpupool._core.planner.state import Card, Critical, Run, TaskState
from gpupool._core.planner.verdicts import (
    GATE_RECORD_INTERVAL_S,
    LIVE_POLL_S,
    LOOKAHEAD,
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


class Starts(Views):
    """The decision before every start."""

    def next_start(
        self, now_s: float, workers: Workers | None = None
    ) -> Start | Warm | Wait | Fail | Refuse | None:
        """What to start now: a task and its card, a worker to warm for it, a wait (with why),
        a failure, strict mode's refusal, or ``None`` when nothing is pending. :attr:`width`
        is brought up to date with the work held.

        ``workers``: the ready and booting workers per card. A task is admitted only where
        a ready worker is idle, so the bound is checked when the task runs, not when it is
        handed to a worker that still boots; where it fits but none is ready, the verdict
        is :class:`Warm` (start one). ``None``: every card has a ready worker (a planner
        driven without processes).

        The width is derived once per scheduling pass, at its end (a verdict that is not a
        start), and on a start only when tasks were submitted since it was last derived."""
        self._workers = workers
        if workers is not None and workers.booting_total:
            # How many more the pool admits now, for the work it holds: no more boot than that.
            self.width = self._width_now()
        verdict = self._next_start(now_s)
        if self._width_due or not isinstance(verdict, (Start, Warm)):
            self._width_due = False
            self.width = self._width_now()
        if isinstance(verdict, Start):
            self._issued[verdict.task] = verdict
        return verdict

    def _next_start(self, now_s: float) -> Start | Warm | Wait | Fail | Refuse | None:
        if self.refused is not None:
            return self.refused
        self.hold = None
        if not self.pending:
            return None
        if len(self.running) >= self.ceiling.value:
            return Wait(reason=f"the ceiling ({self.ceiling.limit}) holds {self.ceiling.value}")
        head = self.pending[0]
        firsts: dict[str, TaskId] = {self.tasks[head].key: head}
        if self._pending_by_key[self.tasks[head].key] < len(self.pending):
            # More than one key waits: each one's first within the lookahead (with one key,
            # the head is its first, and the queue is not walked).
            for task in itertools.islice(self.pending, LOOKAHEAD):
                firsts.setdefault(self.tasks[task].key, task)
        candidates, critical = self._critical_first(list(firsts.values()))
        passed = self.tasks[head].passed
        if passed >= max(1, self.ceiling.value) and self.cards:
            # The queue's head was passed a ceiling's worth of times in a row: it goes first,
            # and the others start only beside the room held for it.
            candidates, critical = [head, *(t for t in candidates if t != head)], None
            if self.config.fixed_width is None:
                self.hold = self._hold_for(head)
            if self.hold is None:
                candidates = [head]
        elif passed >= max(1, self.ceiling.value):
            candidates = [head]
        return self._first_admitted(candidates, critical, head, now_s)

    def _hold_for(self, head: TaskId) -> Hold | None:
        """The room held for ``head``: the hold it was given while the runs it names still make
        its room (the starts placed beside that hold left it room there, not beside another
        one), else a new one, on the card where the runs expected to end first free it."""
        ask = self.ask_of(head)
        hold: Hold | None = None
        if self._held_for is not None and self._held_for[0] == head:
            kept = self._held_for[1]
            hold = order.keep_hold(
                kept,
                self.cards[kept.device],
                ask,
                reserve_bytes=self.config.reserve_bytes,
                ceiling=self.ceiling,
            )
        if hold is None:
            hold = order.head_hold(
                self.cards,
                ask,
                self.tasks[head].avoid,
                reserve_bytes=self.config.reserve_bytes,
                ceiling=self.ceiling,
                expected_end_s=self._expected_end_s,
            )
        self._held_for = None if hold is None else (head, hold)
        return hold

    def _expected_end_s(self, run: Run) -> float:
        """When ``run`` is expected to end: its start plus its key's mean duration (its start
        alone until its key has a timed task, so the oldest ends first)."""
        return run.started_s + self._durations_s.get(run.key, (0, 0.0))[1]

    def _first_admitted(
        self, candidates: list[TaskId], critical: Critical | None, head: TaskId, now_s: float
    ) -> Start | Warm | Wait | Fail:
        if self.tasks[head].waiting_since_s is None:
            self.tasks[head].waiting_since_s = now_s
        gate_shut = False
        held: int | None = None
        for position, task in enumerate(candidates):
            if position == 1 and critical is not None:
                held = order.holds_for(
                    self.cards,
                    self.ask_of(candidates[0]),
                    self.tasks[candidates[0]].avoid,
                    reserve_bytes=self.config.reserve_bytes,
                    ceiling=self.ceiling,
                )
                if held is not None:
                    # The other keys leave that card's room to the critical key; a card it
                    # cannot use now still takes their tasks.
                    self._critical_wait(critical, self.tasks[task].key, held, now_s)
            if position == 1 and self.hold is not None:
                self._head_wait(self.hold, now_s)
            hold = self.hold if task != head else None
            verdict, shut = self._try_start(task, now_s, held=held, hold=hold)
            gate_shut = gate_shut or shut
            if isinstance(verdict, Start) and task != head:
                # Counted for the task passed (a retry put in front of it does not reset it).
                self.tasks[head].passed += 1
            if verdict is not None:
                return verdict
        return self._blocked(head, now_s, gate_shut)

    def _critical_first(self, firsts: list[TaskId]) -> tuple[list[TaskId], Critical | None]:
        """The keys' first pending tasks in queue order, or with the critical key's first."""
        if not self.cards or self.config.fixed_width is not None:
            return firsts, None
        keys = [self.tasks[t].key for t in firsts]
        found = order.critical(
            keys,
            pending_by_key=lambda key: self._pending_by_key[key],
            duration_s=lambda key: self._durations_s[key][1] if key in self._durations_s else None,
            width_alone=lambda key: order.alone_width(
                self.cards,
                self.asks.ask(key),
                reserve_bytes=self.config.reserve_bytes,
                ceiling=self.ceiling,
            ),
        )
        if found is None:
            return firsts, None
        first = keys.index(found.key)
        return [firsts[first], *firsts[:first], *firsts[first + 1 :]], found

    def _critical_wait(self, critical: Critical, held_key: str, index: int, now_s: float) -> None:
        self.counts["critical_waits"] += 1
        if (
            self._critical_recorded_s is not None
            and now_s - self._critical_recorded_s < GATE_RECORD_INTERVAL_S
        ):
            return
        self._critical_recorded_s = now_s
        reason, extra = records.critical_wait(critical, held_key, index)
        self.record(
            self._simple(
                "critical_wait", index, self.asks.ask(critical.key), reason, now_s, extra=extra
            )
        )

    def _head_wait(self, hold: Hold, now_s: float) -> None:
        self.counts["head_waits"] += 1
        if (
            self._hold_recorded_s is not None
            and now_s - self._hold_recorded_s < GATE_RECORD_INTERVAL_S
        ):
            return
        self._hold_recorded_s = now_s
        head = self.tasks[self.pending[0]]
        since_s = head.waiting_since_s if head.waiting_since_s is not None else now_s
        reason, extra = records.head_wait(
            hold, self.cards[hold.device], head.passed, now_s - since_s
        )
        self.record(
            self._simple(
                "head_wait", hold.device, self.asks.ask(hold.key), reason, now_s, extra=extra
            )
        )

    def _try_start(
        self, task: TaskId, now_s: float, *, held: int | None = None, hold: Hold | None = None
    ) -> tuple[Start | Warm | Fail | None, bool]:
        """Start ``task`` on a card that admits it, never on ``held`` (a card whose room is
        left to the critical key), and on ``hold``'s card only beside the room held there."""
        state = self.tasks[task]
        if not self.cards:
            if self._ready(None):
                return Start(task=task, device=None, ask_bytes=0, booked_bytes=0), False
            slots = self.ceiling.value - len(self.running)
            return (Warm(device=None, task=task) if self._may_warm(None, slots) else None), False
        ask = self.ask_of(task)
        if self.config.fixed_width is not None:
            return self._fixed_start(task, state, ask, now_s)
        gate_shut = False
        fits = self._fits_for(state, ask, held, hold)
        # The card with the most room left after it first; a card whose ready worker can run
        # it now before one where a worker must boot for it.
        warm: Warm | None = None
        for found in sorted(fits, key=lambda f: -(f.left_bytes or 0)):
            card = self.cards[found.device]
            verdict = self._admits_on(card, ask, found, now_s)
            if verdict == "no":
                continue
            if verdict == "gate":
                gate_shut = True
                continue
            card.gate_shut_since_s = None
            if not self._ready(found.device):
                if warm is None and self._may_warm(found.device, found.more):
                    warm = Warm(device=found.device, task=task)
                continue  # (its room may wait for the workers booting there)
            booked_bytes = ask.next_bytes(card.same_key(ask.key))
            start = Start(
                task=task, device=found.device, ask_bytes=ask.ask_bytes, booked_bytes=booked_bytes
            )
            return start, False
        if warm is not None:
            return warm, gate_shut
        if (
            held is None
            and state.room_wait_until_s is not None
            and now_s >= state.room_wait_until_s
        ):
            # (Not while a card was left to the critical key: that card may have its room.)
            return self._expired(task, state, ask), gate_shut
        return None, gate_shut

    def _fits_for(
        self, state: TaskState, ask: Ask, held: int | None, hold: Hold | None
    ) -> list[Fit]:
        """The fit of a task (``state``, at ``ask``) on every card it may use: not ``held``,
        not one it avoids, and on ``hold``'s card only where it also fits beside what stays
        once the runs the head waits for end, and the head (so it never delays the head)."""
        slots = self.ceiling.value - len(self.running)
        fits: list[Fit] = []
        for card in self.cards:
            if card.index == held or (
                card.index in state.avoid and len(state.avoid) < len(self.cards)
            ):
                continue
            after = hold.after(card) if hold is not None and hold.device == card.index else None
            found = self.fit_beside(card.index, ask, None, after, slots=slots)
            if after is not None and found.more == 0:
                continue
            fits.append(found)
        return fits

    def _ready(self, device: int | None) -> bool:
        """A ready worker is idle on ``device`` (always, without worker counts)."""
        return self._workers is None or self._workers.can_run(device)

    def _may_warm(self, device: int | None, more: int) -> bool:
        """Start one more worker on ``device``: fewer boot there than tasks fit there now
        (``more``), and fewer boot in the pool than tasks are pending and than the pool's
        width (:meth:`_width_now`: the pending tasks that fit together now) leaves beside
        its running tasks, so that no worker boots for a task that would not start."""
        workers = self._workers
        if workers is None:
            return False
        running = len(self.running)
        return workers.booting.get(device, 0) < more and workers.booting_total < min(
            len(self.pending), self.ceiling.value - running, max(1, self.width - running)
        )

    def _booting(self, device: int | None) -> int:
        return 0 if self._workers is None else self._workers.booting.get(device, 0)

    def _fixed_start(
        self, task: TaskId, state: TaskState, ask: Ask, now_s: float
    ) -> tuple[Start | Warm | Fail | None, bool]:
        """Under a fixed width: the card running fewest, whatever the bound says."""
        card = min(self.cards, key=lambda c: (len(c.runs) + self._booting(c.index), c.index))
        if state.wait_below is not None and len(card.runs) >= state.wait_below:
            return None, False
        # Waiting for room others hold: the live gate as if nothing of the pool ran.
        if (
            state.room_wait_until_s is not None
            and not live_gate(card, ask, [], reserve_bytes=self.config.reserve_bytes).admits
        ):
            if now_s >= state.room_wait_until_s:
                return self._expired(task, state, ask), False
            return None, True
        if not self._ready(card.index):
            slots = self.ceiling.value - len(self.running)
            warm = self._may_warm(card.index, slots)
            return (Warm(device=card.index, task=task) if warm else None), False
        booked_bytes = ask.next_bytes(card.same_key(ask.key))
        start = Start(
            task=task, device=card.index, ask_bytes=ask.ask_bytes, booked_bytes=booked_bytes
        )
        return start, False

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
        if card.reading_error is not None and card.runs:
            return "no"
        gate = live_gate(
            card, ask, list(card.runs.values()), reserve_bytes=self.config.reserve_bytes
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
        self.counts["share_waits"] += 1
        recorded = card.share_recorded_s
        if recorded is None or now_s - recorded >= GATE_RECORD_INTERVAL_S:
            card.share_recorded_s = now_s
            reason, extra = turn_record(card, found, room_bytes)
            self.record(self._simple("share_wait", card.index, ask, reason, now_s, extra=extra))
        return True

    def still_admits(self, start: Start, now_s: float) -> bool:
        """After the other pools' bookings were read again in the same step that published
        this start's: does the start still fit? (Two pools deciding at once cannot both
        take the same room: whichever publishes second sees the first's booking.)"""
        if start.past_bound or start.device is None or self.config.fixed_width is not None:
            return True
        card = self.cards[start.device]
        state = self.tasks[start.task]
        ask = self.asks.ask_for(state.key, state.size)
        admitted = self._admits_on(card, ask, self.fit(card.index, ask), now_s) == "yes"
        if not admitted:
            self._issued.pop(start.task, None)
        return admitted

    def _expired(self, task: TaskId, state: TaskState, ask: Ask) -> Fail:
        self._unqueue(task)
        self.tasks.pop(task, None)
        return Fail(
            task=task,
            kind="room_wait_expired",
            reason=(
                f"it ran out of memory alone on the card while others' bytes held it, and no "
                f"room for its ask {ask.describe()} came free within room_wait_s="
                f"{self.config.room_wait_s:g}"
            ),
            device=state.last_device,
            booked_bytes=state.last_booked_bytes or ask.ask_bytes,
        )

    def _share_wait(self, card: Card, wait: ShareWait, now_s: float) -> None:
        self.counts["share_waits"] += 1
        recorded = card.share_recorded_s
        if recorded is not None and now_s - recorded < GATE_RECORD_INTERVAL_S:
            return
        card.share_recorded_s = now_s
        reason, extra = records.share_wait(card, wait)
        last = list(card.runs.values())[-1]
        self.record(
            self._simple(
                "share_wait", card.index, self.asks.ask(last.key), reason, now_s, extra=extra
            )
        )

    def _gate_shut(self, card: Card, ask: Ask, gate: LiveGate, now_s: float) -> None:
        if card.gate_shut_since_s is None:
            card.gate_shut_since_s = now_s
            card.gate_episodes += 1
            self.counts["gate_waits"] += 1
        if (
            card.gate_recorded_s is not None
            and now_s - card.gate_recorded_s < GATE_RECORD_INTERVAL_S
        ):
            return
        episodes = card.gate_episodes
        card.gate_recorded_s = now_s
        card.gate_episodes = 0
        reason, extra = records.live_gate_wait(card, gate, episodes)
        self.record(self._simple("live_gate_wait", card.index, ask, reason, now_s, extra=extra))

    def _blocked(self, head: TaskId, now_s: float, gate_shut: bool) -> Wait | Warm | Start:
        state = self.tasks[head]
        if self._workers is not None and self._workers.booting_total:
            # A worker that boots reports ready (an event): admit then, against that reading.
            return Wait(reason="workers are starting", poll_s=LIVE_POLL_S if gate_shut else None)
        if self.running:
            # Another pool's tasks end without an event here: poll while they hold a card.
            others = any(card.others_tasks or card.others_waiting for card in self.cards)
            poll_s = LIVE_POLL_S if gate_shut or others else None
            if poll_s is None and any(card.oom_cap is not None for card in self.cards):
                # A cap lifts on the readings alone (no event says the room is back).
                poll_s = CAP_POLL_S
            return Wait(
                reason="the bound or the live gate holds the pending tasks back", poll_s=poll_s
            )
        if state.room_wait_until_s is not None:
            return Wait(reason="waiting for room after an out-of-memory", poll_s=LIVE_POLL_S)
        ask = self.ask_of(head)
        if any(
            yields_to(card, ask.ask_bytes, self.bound(card.index, ask).room_bytes, now_s)
            for card in self.cards
        ):
            # Not the serial floor: another pool waits at its own, and this one yields to it.
            return Wait(
                reason="this pool yields to another pool at the serial floor", poll_s=LIVE_POLL_S
            )
        return self._serial_floor(head, state, now_s, gate_shut)

    def _serial_floor(
        self, head: TaskId, state: TaskState, now_s: float, gate_shut: bool
    ) -> Wait | Warm | Start:
        """Nothing of the pool runs anywhere, and the head does not start: one task starts past
        the bound, on the card with the most room (logged), unless other pools hold it."""
        ask = self.ask_of(head)
        candidates = [i for i in range(len(self.cards)) if i not in state.avoid] or list(
            range(len(self.cards))
        )
        index = max(
            candidates,
            key=lambda i: (
                self.bound(i, ask).room_bytes is not None,
                self.bound(i, ask).room_bytes or 0,
                -i,
            ),
        )
        others_since = self.cards[index].others_since_s
        if others_since is not None and now_s - others_since < self.config.room_wait_s:
            # Another pool's tasks hold the room: they end, so wait for them
            # (bounded) rather than start past the bound beside them.
            return Wait(reason="other pools' bookings hold the card", poll_s=LIVE_POLL_S)
        if not self._ready(index):
            return Warm(device=index, task=head)
        self.counts["serial_starts"] += 1
        why = (
            "the live gate is shut (others' bytes fill the card; if the task runs out of "
            "memory it waits for room, it does not fail)"
            if gate_shut
            else "no card has room for one task"
        )
        self.record(
            self._simple(
                "serial_start",
                index,
                ask,
                f"card {index}: {why} and nothing of the pool is running, so one task of "
                f"{state.key} starts past the bound (the serial floor); ask {ask.describe()}",
                now_s,
                limit="floor",
            )
        )
        return Start(
            task=head,
            device=index,
            ask_bytes=ask.ask_bytes,
            booked_bytes=ask.ask_bytes,
            past_bound=True,
        )
