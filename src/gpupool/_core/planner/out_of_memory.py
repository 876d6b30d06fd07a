"""An out-of-memory carried out: the task's price raised, the cap, wait or card to avoid its
judgement names, its retry or failure, and a cap lifted once the readings show its room back.

The judgement itself is :func:`~gpupool._core.planner.oom.judge` (a rule on numbers);
this room applies it to the planner's state, and is the only writer of a card's
out-of-memory cap.
"""

from __future__ import annotations

from gpupool._core.peak import PeakReport
from gpupool._core.planner import records
from gpupool._core.planner.base import PlannerState
from gpupool._core.planner.oom import Facts, Judgement, cap_lift_terms, judge
from gpupool._core.planner.samples import Recorder, split_reading
from gpupool._core.planner.state import Card, Run, TaskState
from gpupool._core.planner.verdicts import CardReading, Fail, FailKind, Retry, TaskId
from gpupool._core.planner.views import Views
from gpupool._core.policy import Ask

__all__ = ["CAP_LIFT_AFTER_S", "OutOfMemory"]

#: A cap an out-of-memory set lifts once the live readings have shown its room
#: back this long without a break (one good reading during a spike is not enough).
CAP_LIFT_AFTER_S = 1.0


class OutOfMemory:
    """Out-of-memory errors and the caps they set (the widths reviewed where either moved)."""

    def __init__(self, state: PlannerState, views: Views, log: Recorder) -> None:
        self._state = state
        self._views = views
        self._log = log

    def handle(
        self,
        task: TaskId,
        report: PeakReport,
        reading: CardReading | None,
        now_s: float,
        *,
        error: str,
    ) -> Retry | Fail:
        """``task`` ran its card out of memory: judge it against its own price when it started
        (:func:`~gpupool._core.planner.oom.judge`), raise its key's price where it passed it,
        and retry or fail it. ``reading``: a live snapshot of its card taken after the report;
        ``error``: the error's text (truncated in the record)."""
        self._state.count("oom")
        run = self._state.end_run(task)
        assert run is not None
        task_state = self._state.tasks[task]
        task_state.retries += 1
        card = self._state.cards[run.device] if run.device is not None else None
        facts = self._oom_facts(run, task_state, card, report, reading)
        verdict = judge(facts, self._state.config, card)
        outcome = self._apply(verdict, task, task_state, run, card, now_s)
        bound = self._views.bound(card.index, facts.key_ask_after) if card is not None else None
        self._log.record(
            records.out_of_memory(
                facts,
                outcome,
                card,
                bound,
                self._state.ceiling,
                report,
                reading,
                parent_pid=self._state.config.parent_pid,
                error=error,
                now_s=now_s,
            )
        )
        if card is not None and self._state.config.fixed_width is None:
            # Whatever became of the task, a raised price or a cap moves the card's width:
            # the record of that move follows the out-of-memory's at once.
            self._views.review(now_s, cause=f"an out-of-memory of {run.key}", devices=(card.index,))
        if isinstance(outcome, Fail):
            self._state.forget(task)
        return outcome

    def _apply(
        self,
        verdict: Judgement,
        task: TaskId,
        task_state: TaskState,
        run: Run,
        card: Card | None,
        now_s: float,
    ) -> Retry | Fail:
        """Carry out an out-of-memory's judgement: the cap, the wait for room or the card to
        avoid it names, then the retry or the failure."""
        why = verdict.why
        if verdict.kind == "fixed_width":
            task_state.wait_below = verdict.cap
        elif verdict.cap is not None and card is not None:
            card.oom_cap = verdict.cap
            card.cap_clear_since_s = None
        elif verdict.kind == "held":
            if task_state.room_wait_until_s is None:
                task_state.room_wait_until_s = now_s + self._state.config.room_wait_s
            why += f" (until {task_state.room_wait_until_s:.1f} s)"
        elif verdict.kind == "elsewhere" and run.device is not None:
            task_state.avoid.add(run.device)
        if verdict.retry:
            self._state.count("retries")
            self._state.put_back(task)
            return Retry(task=task, reason=why)
        kind: FailKind = (
            verdict.kind
            if verdict.kind in ("retries_exhausted", "larger_than_card")
            else "out_of_memory"
        )
        return Fail(
            task=task,
            kind=kind,
            reason=why,
            device=run.device,
            booked_bytes=run.booked_at_start_bytes,
        )

    def _oom_facts(
        self,
        run: Run,
        task_state: TaskState,
        card: Card | None,
        report: PeakReport,
        reading: CardReading | None,
    ) -> Facts:
        """What was known when ``run`` ran out; its key's price raised where it passed it
        (evidence never lowers a price: the floor is at least the task's ask now)."""
        others = list(card.runs.values()) if card is not None else []
        # What each was booked at when it started (the price it was admitted at), never a
        # price an out-of-memory raised since.
        booked_then = sum(r.booked_at_start_bytes for r in others) + run.booked_at_start_bytes
        lower = (report.device_peak_bytes or 0) + (report.oom_requested_bytes or 0)
        before = self._state.asks.ask_for(run.key, run.size)
        floor = before.ask_bytes
        if lower > floor:
            floor = lower + self._state.asks.policy.margin_for(lower)
        self._state.asks.floor(run.key, floor)
        after = self._state.asks.ask_for(run.key, run.size)
        self._state.rebook(run.key)
        child_bytes = 0
        if reading is not None and reading.process_bytes is not None and run.pid is not None:
            child_bytes = reading.process_bytes.get(run.pid, 0)
        needed = after.ask_bytes + self._state.config.reserve_bytes
        return Facts(
            run=run,
            tries=task_state.retries,
            running_then=len(others) + 1,
            shared=run.shared or bool(others) or bool(card is not None and card.others_tasks),
            reached_bytes=report.device_peak_bytes,
            requested_bytes=report.oom_requested_bytes,
            key_ask_before=before,
            key_ask_after=after,
            # Held: the live free bytes do not cover its ask, yet the card without
            # its co-tenants (census or new) would: waiting for them can help.
            held=(
                reading is not None
                and card is not None
                and card.census.total_bytes is not None
                and reading.free_bytes + child_bytes < needed
                and card.census.total_bytes - card.own_high_water_bytes >= needed
            ),
            elsewhere=self._roomier_elsewhere(run.device, after),
            booked_bytes=booked_then,
            largest_total_bytes=max(
                (
                    c.census.total_bytes
                    for c in self._state.cards
                    if c.census.total_bytes is not None
                ),
                default=None,
            ),
            priced_own_high_water_bytes=(
                min([run.own_high_water_bytes] + [r.own_high_water_bytes for r in others])
                if card is not None
                else None
            ),
        )

    def _roomier_elsewhere(self, device: int | None, ask: Ask) -> int | None:
        """Another card where a task at ``ask`` fits alone with more room than on ``device``."""
        if device is None:
            return None
        here = self._views.bound(device, ask).room_bytes
        best: tuple[int, int] | None = None
        for index in range(len(self._state.cards)):
            if index == device or self._views.fit(index, ask, [], slots=1).more == 0:
                continue
            room = self._views.bound(index, ask).room_bytes
            if (
                room is not None
                and (here is None or room > here)
                and (best is None or room > best[1])
            ):
                best = (index, room)
        return best[0] if best else None

    def lift_cap(self, card: Card, reading: CardReading, now_s: float) -> None:
        """``card`` was read: its cap lifts once the readings have shown its room back for
        :data:`CAP_LIFT_AFTER_S` without a break."""
        cap = card.oom_cap
        if cap is None:
            return
        lift = cap_lift_terms(card, split_reading(card, reading, self._state.config.parent_pid))
        if lift is None or not lift.lifts:
            card.cap_clear_since_s = None
            return
        if card.cap_clear_since_s is None:
            card.cap_clear_since_s = now_s
        if now_s - card.cap_clear_since_s < CAP_LIFT_AFTER_S:
            return
        card.oom_cap = None
        card.cap_clear_since_s = None
        reason, extra = records.cap_lifted(card, cap, lift)
        self._views.review(
            now_s,
            cause=reason,
            devices=(card.index,),
            unchanged="cap_lifted",
            moved_event="cap_lifted",
            extra=extra
            | {
                "cap_lift_after_s": CAP_LIFT_AFTER_S,
                "live_free_bytes": reading.free_bytes,
                "live_used_bytes": reading.used_bytes,
            },
        )
