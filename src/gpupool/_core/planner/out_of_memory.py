"""An out-of-memory: judged against the task's own booking, carried out, and recorded.

A task that ran its card out of memory either passed its own price (an underestimate: its key's ask
rises, and no card is capped for it), or stayed within it while it shared the card (something else
grew: the card runs fewer at once until the live reading shows the room back), or ran alone (it
waits for room others hold, moves to a roomier card, or fails). "Its own price" is the ask it was
started at, never a price an earlier out-of-memory of the same wave raised since. The judgement is a
rule on numbers (:func:`judge`); :class:`OutOfMemory` carries it out on the planner's state (the
only writer of a card's out-of-memory cap) and lifts a cap once the readings show its room back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from gpupool._core.bound import Bound, Ceiling
from gpupool._core.events import Decision, JsonTable, JsonValue
from gpupool._core.peak import PeakReport
from gpupool._core.planner.base import PlannerState
from gpupool._core.planner.samples import ReadingSplit, Recorder, pool_rows, split_reading
from gpupool._core.planner.state import Card, Run, TaskState
from gpupool._core.planner.verdicts import (
    CardReading,
    Fail,
    FailKind,
    PlannerConfig,
    Retry,
    TaskId,
)
from gpupool._core.planner.views import Views
from gpupool._core.policy import Ask
from gpupool._core.units import MiB, format_size

__all__ = ["CAP_LIFT_AFTER_S", "OutOfMemory", "judge"]

#: A cap an out-of-memory set lifts once the bytes on the card that are not the
#: pool's are back within this much of what the bound prices them at.
CAP_LIFT_MARGIN_BYTES = 256 * MiB

Kind = Literal[
    "larger_than_card",
    "retries_off",
    "retries_exhausted",
    "fixed_width",
    "underestimate",
    "something_grew",
    "pooled",
    "held",
    "elsewhere",
    "alone",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Judgement:
    """What an out-of-memory means (the rule it fell under), and what the planner does about
    it: run the task again (else its future fails), at most ``cap`` at once on its card from
    now on (``None``: no cap); ``why`` is the sentence for the record and the error."""

    kind: Kind
    retry: bool
    why: str
    cap: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Facts:
    """What was known when the task ran out."""

    run: Run
    tries: int
    running_then: int
    shared: bool
    reached_bytes: int | None
    requested_bytes: int | None
    key_ask_before: Ask
    key_ask_after: Ask
    held: bool
    elsewhere: int | None
    # What the card's runs were booked at when it ran out (before any re-pricing), and the
    # least own high-water they were priced at.
    booked_bytes: int
    priced_own_high_water_bytes: int | None
    # The largest total of the pool's cards: a task that needs more never runs.
    largest_total_bytes: int | None = None


def judge(facts: Facts, config: PlannerConfig, card: Card | None) -> Judgement:
    """The rule an out-of-memory falls under (the caller applies the cap and the retry)."""
    not_retried = _not_retried(facts, config)
    if not_retried is not None:
        return not_retried
    if facts.shared:
        return _shared(facts, config, card)
    return _alone(facts, config)


def _not_retried(facts: Facts, config: PlannerConfig) -> Judgement | None:
    """The rules that fail the task wherever it ran: larger than any card, retries off or spent
    (``None``: none applies)."""
    run = facts.run
    lower = (facts.reached_bytes or 0) + (facts.requested_bytes or 0)
    largest = facts.largest_total_bytes
    if largest is not None and lower > largest:
        return Judgement(
            kind="larger_than_card",
            retry=False,
            why=f"it needs at least {format_size(lower)} ({format_size(facts.reached_bytes)} "
            f"held + {format_size(facts.requested_bytes)} refused), more than the "
            f"{format_size(largest)} total of the largest card; it was priced at "
            f"{format_size(run.ask_bytes)}, but no price or width runs it on these cards, so "
            "it is not retried",
        )
    if not config.retry_oom:
        return Judgement(kind="retries_off", retry=False, why="retries are off")
    if facts.tries > config.max_retries:
        return Judgement(
            kind="retries_exhausted",
            retry=False,
            why=f"it ran out of memory {facts.tries} times, more than max_retries="
            f"{config.max_retries}",
        )
    return None


def _shared(facts: Facts, config: PlannerConfig, card: Card | None) -> Judgement:
    """It ran out sharing its card: its width held below the fixed width, its key's ask raised
    where it passed it, else its card capped."""
    run = facts.run
    lower = (facts.reached_bytes or 0) + (facts.requested_bytes or 0)
    cap = max(1, facts.running_then - 1)
    if config.fixed_width is not None:
        return Judgement(
            kind="fixed_width",
            retry=True,
            why=f"retrying once its card runs at most {cap - 1} other task(s) (the fixed "
            f"width {config.fixed_width} stays)",
            cap=cap,
        )
    if lower > run.ask_bytes:
        return Judgement(
            kind="underestimate",
            retry=True,
            why=f"the ask was underestimated: started at {format_size(run.ask_bytes)} "
            f"(booked {format_size(run.booked_at_start_bytes)}), it reached "
            f"{format_size(facts.reached_bytes)} and asked for "
            f"{format_size(facts.requested_bytes)} more; {run.key} is priced "
            f"{facts.key_ask_after.describe()} from now on (no card is capped for it)",
        )
    assert card is not None
    cap = cap if card.cap.oom_cap is None else min(card.cap.oom_cap, cap)
    return _capped(facts, cap)


def _capped(facts: Facts, cap: int) -> Judgement:
    """It stayed within its ask on a shared card: the card runs at most ``cap`` at once until
    the room is back (its key's tasks, priced together, priced apart from now on)."""
    run = facts.run
    if run.booked_at_start_bytes < run.ask_bytes:
        return Judgement(
            kind="pooled",
            retry=True,
            why=f"it stayed within its ask ({format_size(run.ask_bytes)}), but {run.key}'s "
            "tasks were priced together (their peaks counted on not coinciding): either "
            f"they, or something else on the card, grew past that; {run.key} is priced "
            f"{format_size(facts.key_ask_after.ask_bytes)} per task from now on, and at "
            f"most {cap} run at once there until the room is back",
            cap=cap,
        )
    return Judgement(
        kind="something_grew",
        retry=True,
        why=f"it stayed within its ask ({format_size(run.ask_bytes)}), so something else "
        f"on the card grew; at most {cap} at once there until the live reading shows the "
        "room back",
        cap=cap,
    )


def _alone(facts: Facts, config: PlannerConfig) -> Judgement:
    where = f"card {facts.run.device if facts.run.device is not None else '-'}"
    if facts.held:
        return Judgement(
            kind="held",
            retry=True,
            why=f"it ran out alone while the card's live free bytes did not cover its ask "
            f"{format_size(facts.key_ask_after.ask_bytes)} + "
            f"{format_size(config.reserve_bytes)} reserve: others' bytes hold the card, so it "
            "waits for room and retries",
        )
    if facts.elsewhere is not None:
        return Judgement(
            kind="elsewhere",
            retry=True,
            why=f"it ran out alone on {where}; card {facts.elsewhere} has room for its ask "
            f"{facts.key_ask_after.describe()}, so it is retried there",
        )
    return Judgement(
        kind="alone",
        retry=False,
        why="it ran out alone on the card with its ask's room free",
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CapLift:
    """Whether a card's out-of-memory cap may lift, with the terms."""

    lifts: bool
    not_pool_bytes: int
    priced_not_pool_bytes: int
    pool_bytes: int


def cap_lift_terms(card: Card, split: ReadingSplit) -> CapLift | None:
    """Whether the bytes on ``card`` that are not the pool's (its workers', the processes
    their tasks started) are back within :data:`CAP_LIFT_MARGIN_BYTES` of what the bound
    prices them at (co-tenants at the census, other pools, the own high-water). ``None``
    where the card's total or co-tenant bytes are unknown. The pool's bytes are its rows
    where the reading lists them, else its runs' bookings."""
    total = card.census.total_bytes
    co_tenant = card.census.co_tenant_bytes
    if total is None or co_tenant is None:
        return None
    pool = split.pool_bytes if split.pool_bytes is not None else card.sums.booked_bytes
    priced = (
        max(0, co_tenant - card.pools.others_at_census_bytes)
        + card.pools.others_bytes
        + card.live.own_high_water_bytes
    )
    not_pool = max(0, split.used_bytes - pool)
    return CapLift(
        lifts=not_pool <= priced + CAP_LIFT_MARGIN_BYTES,
        not_pool_bytes=not_pool,
        priced_not_pool_bytes=priced,
        pool_bytes=pool,
    )


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
        (:func:`judge`), raise its key's price where it passed it,
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
            _record(
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
            card.cap.oom_cap = verdict.cap
            card.cap.cap_clear_since_s = None
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
        before, after = self._raise_price(run, task_state, report)
        return Facts(
            run=run,
            tries=task_state.retries,
            running_then=len(others) + 1,
            shared=run.shared or bool(others) or bool(card is not None and card.pools.others_tasks),
            reached_bytes=report.device_peak_bytes,
            requested_bytes=report.oom_requested_bytes,
            key_ask_before=before,
            key_ask_after=after,
            held=self._held(run, card, reading, after),
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

    def _raise_price(self, run: Run, task_state: TaskState, report: PeakReport) -> tuple[Ask, Ask]:
        """Raise the price of ``run``'s key (an outlier's: its own) to what it reached where it
        passed it, and rebook the key's runs; the task's price before and after."""
        lower = (report.device_peak_bytes or 0) + (report.oom_requested_bytes or 0)
        before = self._state.price(task_state)
        floor = before.ask_bytes
        if lower > floor:
            floor = lower + self._state.asks.policy.margin_for(lower)
        # Evidence never lowers a price: the key's own ask stays at least what it was, also
        # where this task was priced on its own (a feature, a size, an outlier's call), without
        # raising its key's other tasks priced on their own to it.
        key_ask_bytes = self._state.asks.ask(run.key).ask_bytes
        if self._state.asks.is_outlier(run.key, lower, run.features):
            # Far outside its key's peaks: this task is priced for what it is, and the key's
            # other tasks keep the price their own evidence supports.
            task_state.floor_bytes = run.floor_bytes = max(task_state.floor_bytes, floor)
            self._state.count("outlier_out_of_memory")
        else:
            self._state.asks.floor(run.key, floor)
        self._state.asks.hold(run.key, key_ask_bytes)
        after = self._state.price(task_state)
        self._state.rebook(run.key)
        return before, after

    def _held(self, run: Run, card: Card | None, reading: CardReading | None, after: Ask) -> bool:
        """Whether the live free bytes do not cover the task's ask, yet the card without its
        co-tenants (census or new) would: waiting for them can help."""
        child_bytes = 0
        if reading is not None and reading.process_bytes is not None and run.pid is not None:
            child_bytes = reading.process_bytes.get(run.pid, 0)
        needed = after.ask_bytes + self._state.config.reserve_bytes
        return (
            reading is not None
            and card is not None
            and card.census.total_bytes is not None
            and reading.free_bytes + child_bytes < needed
            and card.census.total_bytes - card.live.own_high_water_bytes >= needed
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
        cap = card.cap.oom_cap
        if cap is None:
            return
        lift = cap_lift_terms(card, split_reading(card, reading, self._state.config.parent_pid))
        if lift is None or not lift.lifts:
            card.cap.cap_clear_since_s = None
            return
        if card.cap.cap_clear_since_s is None:
            card.cap.cap_clear_since_s = now_s
        if now_s - card.cap.cap_clear_since_s < CAP_LIFT_AFTER_S:
            return
        card.cap.oom_cap = None
        card.cap.cap_clear_since_s = None
        reason, extra = _cap_lifted(card, cap, lift)
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


def _cap_lifted(card: Card, cap: int, lift: CapLift) -> tuple[str, dict[str, JsonValue]]:
    """An out-of-memory cap lifted: the sentence and the terms."""
    reason = (
        f"card {card.index}: the live reading shows {format_size(lift.not_pool_bytes)} on the "
        f"card that is not the pool's workers', within the bound's "
        f"{format_size(lift.priced_not_pool_bytes)} (co-tenants at the census, other pools, "
        f"own high-water) and its margin: the room the cap of {cap} was set for is back, so "
        "the cap lifts"
    )
    return reason, {
        "oom_cap_before": cap,
        "live_not_pool_bytes": lift.not_pool_bytes,
        "priced_not_pool_bytes": lift.priced_not_pool_bytes,
        "live_pool_bytes": lift.pool_bytes,
    }


def _record(
    facts: Facts,
    outcome: Retry | Fail,
    card: Card | None,
    bound: Bound | None,
    ceiling: Ceiling,
    report: PeakReport,
    reading: CardReading | None,
    *,
    parent_pid: int | None,
    error: str,
    now_s: float,
) -> Decision:
    """An out-of-memory's record: what the task reached and was priced at, what the card held
    then, and what the planner does about it."""
    run = facts.run
    where = f"card {run.device if run.device is not None else '-'}"
    reason = (
        f"{where}: a task of {run.key} ran out of memory at "
        f"{format_size(facts.reached_bytes)} reached (asked for "
        f"{format_size(facts.requested_bytes)} more), started at its ask "
        f"{format_size(run.ask_bytes)} (booked {format_size(run.booked_at_start_bytes)}) "
        f"beside {facts.running_then - 1} other running; live "
        f"{format_size(reading.used_bytes if reading else None)} used, "
        f"{format_size(reading.free_bytes if reading else None)} free; {outcome.reason}"
    )
    # The card's width when it ran out: the record of the width's move (a raised price,
    # a cap) follows this one.
    width = card.width if card is not None else facts.running_then
    return Decision(
        event="out_of_memory",
        time_s=now_s,
        device=run.device,
        width_before=width,
        width_after=width,
        reason=reason,
        bound=bound,
        ceiling=ceiling,
        key=run.key,
        key_ask=facts.key_ask_after,
        limit="out_of_memory",
        task=run.identity,
        extra=_oom_terms(facts, outcome, card, bound, report, reading, parent_pid, error),
    )


def _oom_terms(
    facts: Facts,
    outcome: Retry | Fail,
    card: Card | None,
    bound: Bound | None,
    report: PeakReport,
    reading: CardReading | None,
    parent_pid: int | None,
    error: str,
) -> dict[str, JsonValue]:
    """An out-of-memory record's terms: the card's reading split by whose bytes they are
    (the pool's own never a co-tenant's), and each task running there with its booking."""
    run = facts.run
    split, rows = None, None
    if reading is not None and card is not None:
        extra = frozenset({run.pid}) if run.pid is not None else frozenset()
        split = split_reading(card, reading, parent_pid, extra_pids=extra)
        rows = pool_rows(card, reading, parent_pid, extra_pids=extra)
    return {
        "task_ask_bytes": run.ask_bytes,
        "task_booked_bytes": run.booked_at_start_bytes,
        "ask_before_bytes": facts.key_ask_before.ask_bytes,
        "ask_after_bytes": facts.key_ask_after.ask_bytes,
        "reached_bytes": report.device_peak_bytes,
        "requested_bytes": report.oom_requested_bytes,
        "oom_recognised": report.oom_recognised,
        "card_full_reason": report.card_full_reason,
        "live_free_bytes": reading.free_bytes if reading else None,
        "live_used_bytes": reading.used_bytes if reading else None,
        "live_own_bytes": split.own_bytes if split else None,
        "live_pool_bytes": split.pool_bytes if split else None,
        "live_running_bytes": split.running_bytes if split else None,
        "live_co_tenant_bytes": split.co_tenant_bytes if split else None,
        "census_co_tenant_bytes": bound.co_tenant_bytes if bound else None,
        "priced_own_high_water_bytes": facts.priced_own_high_water_bytes,
        "other_pools_bytes": card.pools.others_bytes if card else None,
        "other_pools_held_bytes": card.pools.others_held_bytes if card else None,
        "other_pools_overrun_bytes": card.pools.others_overrun_bytes if card else None,
        "other_pools_tasks": card.pools.others_tasks if card else None,
        # What the card's runs were booked at when each started (not re-priced at an ask
        # the out-of-memory raised), and each of them.
        "booked_bytes": facts.booked_bytes,
        "runs": _runs_table(run, card, rows),
        "running": facts.running_then,
        "tries": facts.tries,
        "retry": isinstance(outcome, Retry),
        "outcome": outcome.kind if isinstance(outcome, Fail) else "retry",
        "oom_cap": card.cap.oom_cap if card else None,
        "error": error[:500],
    }


def _runs_table(failed: Run, card: Card | None, rows: Mapping[int, int] | None) -> JsonTable:
    """Each task running on the card when ``failed`` ran out, ``failed`` first: its key, its
    ask and booking when it started, its booking now, and its row in the reading (``rows``;
    ``None`` where they cannot tell the pool's bytes)."""
    runs = [failed, *(card.runs.values() if card is not None else ())]
    return [
        {
            "key": run.key,
            "pid": run.pid,
            "failed": run is failed,
            "started_s": round(run.started_s, 6),
            "ask_bytes": run.ask_bytes,
            "booked_bytes": run.booked_at_start_bytes,
            "booked_now_bytes": run.booked_bytes,
            "held_bytes": rows.get(run.pid, 0)
            if rows is not None and run.pid is not None
            else None,
        }
        for run in runs
    ]
