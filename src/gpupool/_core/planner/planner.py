"""The planner: every price, admission and width decision of one pool (pure core).

The dispatcher (:mod:`gpupool._pool.dispatcher`) keeps the thread, the pipes,
the workers and the futures; it tells the planner what happened and asks it
before every start. The planner touches no process, pipe, future or clock:
the time is passed in (``now_s``, seconds since the pool was constructed)
and readings are values the dispatcher took::

    events in                                   verdicts and records out
    ---------                                   ------------------------
    submit(task, key, hint)                     next_start(now) -> Start|Wait|Fail|Refuse|None
    withdraw(task)            (cancelled)       out_of_memory(...) -> Retry | Fail
    observe(device, reading)  (one snapshot)    width, widths_by_key(), warm_limit(device)
    observe_error(device, error)                construct(now) -> Refuse | None (strict)
    started(task, device, pid)                  records -> emit(Decision)
    finished(task, report)    (a result or an error, with its peak report)
    ended(task, report)       (the same, priced at the next settle(now): once per turn)
    out_of_memory(task, report, reading)
    lost(task, message)       (its worker died)

Its rules live in rooms of their own: :mod:`~gpupool._core.planner.fit` (the one
fit every width is a view of, and the live gate), :mod:`~.sharing` (other pools
on a card), :mod:`~.order` (the start order and the room held for a waiting
task), :mod:`~.oom` (an out-of-memory judged against the task's own booking)
and :mod:`~.records` (what each record says). This module holds the state
and applies the events.

The invariant, checked at every start: on every device the booked asks of
the tasks running there plus the new one fit in ``room = total - co_tenant -
own_high_water - reserve``, the count fits the ceiling and any cap an
out-of-memory set, and the live reading covers the new ask plus what the
running tasks have not reached yet plus the reserve. The only start past the
bound is the serial floor (nothing of the pool runs anywhere and no card has
room for one task), logged as ``serial_start``. Explicit concurrency
(``fixed_width``) is authoritative: it skips the memory terms and says so.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping

from gpupool._core.bookings import OtherPools, TaskBooking
from gpupool._core.bound import WidthDecision
from gpupool._core.census import Census
from gpupool._core.events import Decision, JsonValue
from gpupool._core.peak import PeakReport
from gpupool._core.planner import records
from gpupool._core.planner.learning import Learning
from gpupool._core.planner.oom import Facts, Judgement, cap_lift_terms, judge
from gpupool._core.planner.samples import split_reading
from gpupool._core.planner.sharing import (
    note_starved,
    note_turn_taken,
    others_terms,
)
from gpupool._core.planner.state import Card, Run, TaskState
from gpupool._core.planner.verdicts import (
    OWN_RECORD_STEP_BYTES,
    CardReading,
    Fail,
    FailKind,
    Refuse,
    Retry,
    TaskId,
)
from gpupool._core.policy import Ask
from gpupool._core.units import GiB, format_size

__all__ = ["CAP_LIFT_AFTER_S", "Planner"]

#: A cap an out-of-memory set lifts once the live readings have shown its room
#: back this long without a break (one good reading during a spike is not enough).
CAP_LIFT_AFTER_S = 1.0


class Planner(Learning):
    """Owns every price, admission and width decision of one pool: the events. It is built
    as :class:`~gpupool._core.planner.base.PlannerBase` is (its arguments are listed there)."""

    def construct(
        self, now_s: float, *, note: str = "", extra: Mapping[str, JsonValue] | None = None
    ) -> Refuse | None:
        """Decide and record the first width of every card, from the same fit as every later
        one. Returns strict mode's refusal where the width is below ``max_workers``."""
        ask = self.asks.ask("")
        cpus_note = self._cpus_note()
        if not self.cards:
            self.width = self._width_now()
            reason = self.census.reason or "no device"
            self.record(
                Decision(
                    event="constructed",
                    time_s=now_s,
                    device=None,
                    width_before=None,
                    width_after=self.width,
                    reason=(
                        f"{reason}; a host-bounded pool of width {self.width}, set by "
                        f"{self.ceiling.limit} ({self.ceiling.value}){cpus_note}"
                    ),
                    ceiling=self.ceiling,
                    limit=self.ceiling.limit,
                    extra={"driver": self.census.driver, "sensor": self.census.sensor},
                )
            )
            self._timeline(now_s)
            return None
        decisions = self.decide(ask)
        for decision in decisions:
            card = self.cards[decision.device]
            card.width = decision.width
            census = card.census
            reason_note = f"; {census.reason}" if census.reason else ""
            self.record(
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
        self._recorded_asks[""] = ask
        self.width = self._width_now()
        self._timeline(now_s)
        if self.config.fixed_width is not None:
            self._check_fixed(decisions, now_s)
        return self._refuse_at_construction(decisions, now_s)

    def _refuse_at_construction(
        self, decisions: tuple[WidthDecision, ...], now_s: float
    ) -> Refuse | None:
        width = sum(d.width for d in decisions)
        wanted = min(self.config.max_workers, self.ceiling.value)
        if not self.config.strict or self.config.fixed_width is not None or width >= wanted:
            return None
        narrow = min(decisions, key=lambda d: d.width)
        reason = (
            f"strict mode: the bound gives width {width}, below the requested "
            f"{self.config.max_workers}: "
            + "; ".join(d.describe() for d in decisions)
            + ". Free the card, lower max_workers, or drop strict=True."
        )
        record = Decision.from_width(
            "narrowed", narrow, time_s=now_s, width_before=self.config.max_workers, reason=reason
        )
        self.refused = Refuse(reason=reason, decision=record)
        return self.refused

    def _cpus_note(self) -> str:
        cpus = self.census.host.cpus
        if self.config.max_workers_given and self.config.max_workers > cpus:
            return (
                f"; max_workers={self.config.max_workers} is more than the {cpus} usable CPUs "
                f"({self.census.host.cpu_source}): kept, as the standard pool keeps it"
            )
        return ""

    def submit(
        self, task: TaskId, key: str, hint_bytes: int | None = None, size: float | None = None
    ) -> None:
        """A task was submitted (it is pending, at the back of the queue). ``size``: the size
        of its input, from which its ask may be predicted (:meth:`AskTable.ask_for`)."""
        if hint_bytes is not None:
            self.asks.hint(key, hint_bytes)  # the width prices it at once
            self._rebook(key)
        self.tasks[task] = TaskState(key=key, hint_bytes=None, size=size)
        self.pending.append(task)
        self._pending_by_key[key] += 1
        self._last_key = key
        self._width_due = True

    def withdraw(self, task: TaskId) -> None:
        """A pending task left the queue (cancelled, or failed by the pool)."""
        self._issued.pop(task, None)
        self._drop_queued(task)
        if task in self.tasks and task not in self.running:
            self._unqueue(task)
            del self.tasks[task]

    def observe(self, device: int, reading: CardReading, now_s: float) -> None:
        """A live snapshot of ``device``: the live gate reads it, the parent's own row raises
        the own high-water (a term of the bound: recorded when it grows), and a cap an
        out-of-memory set lifts once the readings show its room back."""
        card = self.cards[device]
        card.reading = reading
        card.reading_s = now_s
        card.reading_error = None
        if reading.process_bytes is not None and card.worker_pids:
            # A worker with no row holds nothing (or has exited): forget it.
            running = {r.pid for r in card.runs.values()}
            card.worker_pids = {
                pid for pid in card.worker_pids if pid in reading.process_bytes or pid in running
            }
        own = None
        if reading.process_bytes is not None and self.config.parent_pid is not None:
            own = reading.process_bytes.get(self.config.parent_pid)
        if own is not None and own > card.own_high_water_bytes:
            card.own_high_water_bytes = own
            self._limit_asks()
            if own - card.recorded_own_bytes >= OWN_RECORD_STEP_BYTES:
                card.recorded_own_bytes = own
                self._review(
                    now_s,
                    cause=(
                        f"this process's own device bytes grew to {format_size(own)} "
                        "(a term of the bound)"
                    ),
                    devices=(device,),
                )
        self._lift_cap(card, reading, now_s)

    def sample_cards(self, now_s: float) -> None:
        """The end of a turn of the process layer (its starts made): a ``card_read`` sample
        of each card whose last reading is due one (:mod:`~gpupool._core.planner.samples`).
        Taken after the turn's starts, so a sample counts the tasks that run beside it."""
        for card in self.cards:
            self._sample(card, now_s, decision=False)

    def _lift_cap(self, card: Card, reading: CardReading, now_s: float) -> None:
        cap = card.oom_cap
        if cap is None:
            return
        lift = cap_lift_terms(card, split_reading(card, reading, self.config.parent_pid))
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
        self._review(
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
        booking and what the card's last reading shows its worker holding.

        Args:
            device: the card.
            others: the other pools' rows.
            now_s: the time.
            census: this reading stands beside the census: what those pools
                hold now is in the census' co-tenant bytes, and is priced by
                their bookings instead.
            rows: per-process bytes to read their holdings from (default: the
                card's last reading).
        """
        card = self.cards[device]
        if rows is None:
            rows = {}
            if card.reading is not None and card.reading.process_bytes is not None:
                rows = card.reading.process_bytes
        terms = others_terms(others, rows)
        before = card.others_bytes
        card.others = others
        card.others_bytes = terms.priced_bytes
        card.others_unreached_bytes = terms.unreached_bytes
        card.others_tasks = terms.tasks
        card.others_held_bytes = terms.held_bytes
        card.others_overrun_bytes = terms.overrun_bytes
        card.others_since_s = None if terms.tasks == 0 else card.others_since_s or now_s
        note_starved(card, now_s)
        note_turn_taken(card)
        if census:
            card.others_at_census_bytes = terms.held_bytes
            self._rooms_due = True
            return
        if card.others_bytes != before:
            self._review(
                now_s,
                cause=(
                    f"other pools on the card book {format_size(card.others_bytes)} over "
                    f"{terms.tasks} task{'s' if terms.tasks != 1 else ''} "
                    f"({format_size(terms.unreached_bytes)} not yet reached)"
                ),
                devices=(device,),
                quiet=True,
                extra={
                    "other_pools_bytes": card.others_bytes,
                    "other_pools_unreached_bytes": terms.unreached_bytes,
                    "other_pools_tasks": terms.tasks,
                },
            )

    def observe_error(self, device: int, error: str, now_s: float) -> None:
        """A live reading of ``device`` failed: it runs one task of the pool at a time meanwhile."""
        card = self.cards[device]
        card.reading = None
        card.reading_error = error
        self.sensor_error(device, error, "the live gate runs one task at a time", now_s)

    def started(self, task: TaskId, device: int | None, pid: int | None, now_s: float) -> None:
        """``task`` was handed to a worker (``pid``) on ``device``: it books there what the
        :class:`Start` that admitted it carried."""
        self._unqueue(task)
        self._begin(task, device, pid, now_s)

    def _begin(self, task: TaskId, device: int | None, pid: int | None, now_s: float) -> None:
        """``task``, off the pending queue, runs on ``device`` in worker ``pid``."""
        state = self.tasks[task]
        issued = self._issued.pop(task, None)
        price = self.asks.ask_for(state.key, state.size)
        card = self.cards[device] if device is not None else None
        booked_bytes = 0
        if card is not None:
            booked_bytes = (
                issued.booked_bytes
                if issued is not None and issued.device == device
                else price.next_bytes(card.same_key(state.key))
            )
        run = Run(
            key=state.key,
            device=device,
            pid=pid,
            ask_bytes=price.ask_bytes,
            booked_bytes=booked_bytes,
            booked_at_start_bytes=booked_bytes,
            started_s=now_s,
            size=state.size,
        )
        if card is not None:
            run.own_high_water_bytes = card.own_high_water_bytes
            # Another pool's task, or another of ours, on the card: not alone.
            run.shared = bool(card.others_tasks or card.runs)
            for other in card.runs.values():
                other.shared = True
            card.add_run(task, run)
            if pid is not None:
                card.worker_pids.add(pid)
        self.running[task] = run
        state.last_device = device
        state.last_booked_bytes = booked_bytes
        state.room_wait_until_s = None
        state.waiting_since_s = None
        self._last_key = state.key

    def lost(
        self, task: TaskId, now_s: float, *, message: str, extra: Mapping[str, JsonValue]
    ) -> None:
        """``task``'s worker died: the task failed; its booking is released."""
        run = self._end_run(task)
        state = self.tasks.pop(task, None)
        if run is not None:
            self._rebook(run.key)
        key = run.key if run else state.key if state else self._last_key
        self.counts["lost"] += 1
        self.record(
            self._simple(
                "worker_lost",
                run.device if run else None,
                self.asks.ask(key),
                message,
                now_s,
                extra=extra,
            )
        )

    def out_of_memory(
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
        and retry or fail it.

        Args:
            task: the task.
            report: its peak report (what it reached, what it asked for).
            reading: a live snapshot of its card taken after the report, or ``None``.
            now_s: the time.
            error: the error's text (truncated in the record).
        """
        self.settle(now_s)  # judged against the asks every measurement before it priced
        self.counts["oom"] += 1
        run = self._end_run(task)
        assert run is not None
        state = self.tasks[task]
        state.retries += 1
        card = self.cards[run.device] if run.device is not None else None
        if card is not None and reading is not None:
            # The reading the record states (the own high-water is observed after it).
            card.reading, card.reading_s = reading, now_s
        facts = self._oom_facts(run, state, card, report, reading)
        verdict = judge(facts, self.config, card)
        outcome = self._apply(verdict, task, state, run, card, now_s)
        bound = self.bound(card.index, facts.key_ask_after) if card is not None else None
        self.record(
            records.out_of_memory(
                facts,
                outcome,
                card,
                bound,
                self.ceiling,
                report,
                reading,
                parent_pid=self.config.parent_pid,
                error=error,
                now_s=now_s,
            )
        )
        if card is not None and self.config.fixed_width is None:
            # Whatever became of the task, a raised price or a cap moves the card's width:
            # the record of that move follows the out-of-memory's at once.
            self._review(now_s, cause=f"an out-of-memory of {run.key}", devices=(card.index,))
        if isinstance(outcome, Fail):
            self.tasks.pop(task, None)
        return outcome

    def _apply(
        self,
        verdict: Judgement,
        task: TaskId,
        state: TaskState,
        run: Run,
        card: Card | None,
        now_s: float,
    ) -> Retry | Fail:
        """Carry out an out-of-memory's judgement: the cap, the wait for room or the card to
        avoid it names, then the retry or the failure."""
        why = verdict.why
        if verdict.kind == "fixed_width":
            state.wait_below = verdict.cap
        elif verdict.cap is not None and card is not None:
            card.oom_cap = verdict.cap
            card.cap_clear_since_s = None
        elif verdict.kind == "held":
            if state.room_wait_until_s is None:
                state.room_wait_until_s = now_s + self.config.room_wait_s
            why += f" (until {state.room_wait_until_s:.1f} s)"
        elif verdict.kind == "elsewhere" and run.device is not None:
            state.avoid.add(run.device)
        if verdict.retry:
            return self._retry(task, why)
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
        state: TaskState,
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
        before = self.asks.ask_for(run.key, run.size)
        floor = before.ask_bytes
        if lower > floor:
            floor = lower + self.asks.policy.margin_for(lower)
        self.asks.floor(run.key, floor)
        after = self.asks.ask_for(run.key, run.size)
        self._rebook(run.key)
        child_bytes = 0
        if reading is not None and reading.process_bytes is not None and run.pid is not None:
            child_bytes = reading.process_bytes.get(run.pid, 0)
        needed = after.ask_bytes + self.config.reserve_bytes
        return Facts(
            run=run,
            tries=state.retries,
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
                (c.census.total_bytes for c in self.cards if c.census.total_bytes is not None),
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
        here = self.bound(device, ask).room_bytes
        best: tuple[int, int] | None = None
        for index in range(len(self.cards)):
            if index == device or self.fit(index, ask, [], slots=1).more == 0:
                continue
            room = self.bound(index, ask).room_bytes
            if (
                room is not None
                and (here is None or room > here)
                and (best is None or room > best[1])
            ):
                best = (index, room)
        return best[0] if best else None

    def shutdown_record(
        self, now_s: float, counts: Mapping[str, int], *, tasks_lost: int
    ) -> Decision:
        """The run's totals, as the last record."""
        totals = collections.Counter(self.counts)
        totals.update(counts)
        return records.shutdown(now_s, self.width, totals, tasks_lost=tasks_lost)

    # -- what the process layer reads (never the state itself) ------------------------------

    def has_pending(self) -> bool:
        """Whether any task waits to start (queued behind a run or not)."""
        return bool(self.pending)

    def may_start(self) -> bool:
        """Whether fewer tasks run than the ceiling (else the verdict is to wait, and a
        reading of the cards would gate nothing)."""
        return len(self.running) < self.ceiling.value

    def is_queued(self, task: TaskId) -> bool:
        """Whether ``task`` waits behind a run on that run's worker."""
        return task in self.queued

    def strict_refusal(self) -> Refuse | None:
        """Strict mode's refusal to narrow, once made (the pool breaks with it)."""
        return self.refused

    def waiting_asks(self, first: int, count: int) -> list[tuple[str, int]]:
        """The key and ask of the pending tasks ``first`` to ``first + count``, in order."""
        asks: dict[tuple[str, float | None], int] = {}  # one price per key and size
        entries: list[tuple[str, int]] = []
        for task in itertools.islice(self.pending, first, first + count):
            slot = (self.tasks[task].key, self.tasks[task].size)
            if slot not in asks:
                asks[slot] = self.asks.ask_for(*slot).ask_bytes
            entries.append((slot[0], asks[slot]))
        return entries

    def bookings_on(self, device: int) -> tuple[TaskBooking, ...]:
        """This pool's running tasks on ``device`` that have a worker, as booking-table rows
        (what each reached is not the planner's to know: 0)."""
        return tuple(
            TaskBooking(
                worker_pid=run.pid, key=run.key, booked_bytes=run.booked_bytes, reached_bytes=0
            )
            for run in self.running.values()
            if run.device == device and run.pid is not None
        )

    @staticmethod
    def price_without_peak(census: Census, reserve_bytes: int) -> int:
        """The estimate of a pool given no ``task_peak``: the whole room of its roomiest card
        at the census (``total - co_tenant - own - reserve``), so that the first task of each
        key runs alone until a child has measured it; at least 1 GiB, the estimate where no
        card's total is known."""
        rooms = [
            card.total_bytes - (card.co_tenant_bytes or 0) - (card.own_bytes or 0) - reserve_bytes
            for card in census.cards
            if card.total_bytes is not None
        ]
        return max([*rooms, GiB])
