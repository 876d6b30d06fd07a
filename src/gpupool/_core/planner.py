"""The planner: every price, admission and width decision of one pool (pure core).

The dispatcher (:mod:`gpupool._pool.dispatcher`) keeps the thread, the pipes,
the workers and the futures; it tells the planner what happened and asks it
before every start. The planner touches no process, pipe, future or clock:
the time is passed in (``now_s``, seconds since the pool was constructed)
and readings are values the dispatcher took::

    events in                                   verdicts and records out
    ---------                                   ------------------------
    submit(task, key, hint)                     next_start(now) -> Start | Wait | Fail | None
    withdraw(task)            (cancelled)       out_of_memory(...) -> Retry | Fail
    observe(device, reading)  (one snapshot)    width, widths_by_key(), warm_limit(device)
    observe_error(device, error)                refusal (strict mode), counts
    started(task, device, pid)                  records -> emit(Decision)
    finished(task, report)    (a result or an error, with its peak report)
    out_of_memory(task, report, reading)
    lost(task, message)       (its worker died)

The invariant, checked at every start: on every device the booked asks of
the tasks running there plus the new one fit in ``room = total - co_tenant -
own_high_water - reserve``, the count fits the ceiling and any cap an
out-of-memory set, and the live reading covers the new ask plus what the
running tasks have not reached yet plus the reserve. The only start past the
bound is the serial floor (nothing of the pool runs anywhere and no card has
room for one task), logged as ``serial_start``. Explicit concurrency
(``fixed_width``) is authoritative: it skips the memory terms and says so.

Three rules the planner keeps: evidence never lowers a price (a key's ask
after an out-of-memory is at least its ask before); a task that runs out
alone while the live reading shows the card held by bytes that are not the
pool's waits for room (bounded by ``room_wait_s``) instead of failing; and
records grow with decisions, not with tasks (a live gate that shuts and
opens again is recorded at most once per :data:`GATE_RECORD_INTERVAL_S`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from gpupool._core.bookings import OtherPools
from gpupool._core.bound import (
    Bound,
    Ceiling,
    WidthDecision,
    admits,
    decide_widths,
    derive_bound,
    derive_ceiling,
    fits_together,
    live_gate_admits,
)
from gpupool._core.census import CardCensus, Census
from gpupool._core.events import Decision, EventName, JsonValue
from gpupool._core.peak import PeakReport
from gpupool._core.policy import Ask, AskTable
from gpupool._core.units import GiB, MiB, format_size

__all__ = [
    "DEFAULT_CHILD_RSS_PRIOR_BYTES",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_ROOM_WAIT_S",
    "GATE_RECORD_INTERVAL_S",
    "LIVE_POLL_S",
    "CardReading",
    "Fail",
    "Planner",
    "PlannerConfig",
    "Retry",
    "Start",
    "Wait",
]

TaskId = int

#: How long a task that ran out of memory alone waits for room while others'
#: bytes hold its card:
#: long enough to ride out another job's allocation spike or a co-tenant
#: restarting, short enough that a card taken for good fails the task within
#: minutes rather than hanging the pipeline.
DEFAULT_ROOM_WAIT_S = 120.0

#: Out-of-memory retries per task, in every mode, before the error reaches its
#: future. Each retry runs at a narrower width or after a wait for room; five
#: are enough to walk a pool of eight down to one.
DEFAULT_MAX_RETRIES = 5

#: The host RSS a child is priced at until a child of the pool has reported
#: its own: a spawned interpreter that imports a CUDA framework holds several
#: hundred MiB before its first allocation, and a CUDA context maps several
#: hundred more in host memory. A measurement replaces it.
DEFAULT_CHILD_RSS_PRIOR_BYTES = 1 * GiB

#: How often a waiting pool re-reads its cards while the live gate is shut.
LIVE_POLL_S = 0.05

#: At most one live-gate record per card in this many seconds; the record
#: counts the shut episodes it stands for.
GATE_RECORD_INTERVAL_S = 5.0

#: A gate shut this long retires idle warm workers (their contexts are bytes
#: the card needs); one shut reading never does.
RETIRE_AFTER_SHUT_S = 2.0

#: The own high-water is recorded when it has grown this much since the last
#: record (the bound always uses the exact figure).
OWN_RECORD_STEP_BYTES = 64 * MiB

#: A key's ask is recorded when it moved this fraction since the last record,
#: changed basis, or changed a width.
ASK_RECORD_STEP = 0.05

#: How far down the pending queue a blocked head lets the planner look for a
#: task of another key that fits (a large key does not serialise a small one).
LOOKAHEAD = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class CardReading:
    """One live snapshot of a card: free and per-process bytes read together.

    Attributes:
        free_bytes: free now.
        used_bytes: allocated now.
        process_bytes: device bytes per PID from the same snapshot, or ``None``
            where the driver lists no rows (containers, MIG).
    """

    free_bytes: int
    used_bytes: int
    process_bytes: Mapping[int, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    """What the caller asked for.

    Attributes:
        max_workers: the most tasks at once.
        max_workers_given: ``max_workers`` was explicit: the CPU count does
            not cap it (it is logged when it exceeds the usable CPUs).
        fixed_width: run exactly this many at once, whatever the bound says.
        strict: refuse to narrow below ``max_workers``.
        retry_oom: retry a task that ran out of device memory.
        max_retries: out-of-memory retries per task before it fails.
        room_wait_s: how long a task waits for room held by others' bytes.
        reserve_bytes: bytes kept free on every card.
        parent_pid: this process, to find its row in a reading.
        child_rss_prior_bytes: a child's host RSS until one is measured.
    """

    max_workers: int
    max_workers_given: bool = True
    fixed_width: int | None = None
    strict: bool = False
    retry_oom: bool = True
    max_retries: int = DEFAULT_MAX_RETRIES
    room_wait_s: float = DEFAULT_ROOM_WAIT_S
    reserve_bytes: int = 0
    parent_pid: int | None = None
    child_rss_prior_bytes: int = DEFAULT_CHILD_RSS_PRIOR_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class Start:
    """Start ``task`` on ``device`` (``None``: a host-bounded pool).

    ``past_bound`` marks the serial floor: nothing of the pool runs, and no
    card had room for the task or the live gate was shut.
    """

    task: TaskId
    device: int | None
    ask_bytes: int
    past_bound: bool = False
    booked_bytes: int | None = None

    @property
    def booking_bytes(self) -> int:
        """What the start books on its card: its share of its key's price together
        (:meth:`Ask.next_bytes`), or ``ask_bytes``."""
        return self.ask_bytes if self.booked_bytes is None else self.booked_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Wait:
    """Start nothing now; ask again after ``poll_s`` (``None``: after the next event)."""

    reason: str
    poll_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """Run ``task`` again: it is back at the head of the pending queue."""

    task: TaskId
    reason: str


FailKind = Literal["out_of_memory", "retries_exhausted", "room_wait_expired"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Fail:
    """``task``'s out-of-memory goes to its future.

    Attributes:
        task: the task.
        kind: ``"out_of_memory"`` (it ran out alone with its room free, or
            retries are off), ``"retries_exhausted"`` (``max_retries`` reached)
            or ``"room_wait_expired"`` (others held the card for
            ``room_wait_s``).
        reason: the sentence for the error, every number in it.
        device: where it last ran.
        ask_bytes: what it was booked at.
    """

    task: TaskId
    kind: FailKind
    reason: str
    device: int | None
    ask_bytes: int


@dataclass(slots=True)
class _Task:
    key: str
    hint_bytes: int | None
    # The size of the task's input the caller gave (the ask may be predicted from it).
    size: float | None = None
    retries: int = 0
    # Fixed width after an out-of-memory: start only while fewer than this run there.
    wait_below: int | None = None
    # Devices where it ran out alone although the room was free: not again.
    avoid: set[int] = field(default_factory=set)
    # Waiting for room that others' bytes hold: until then no serial start.
    room_wait_until_s: float | None = None
    last_device: int | None = None
    last_ask_bytes: int = 0
    last_error: str = ""


@dataclass(slots=True)
class _Run:
    key: str
    device: int | None
    pid: int | None
    booked_bytes: int
    priced_bytes: int
    shared: bool = False
    started_s: float = 0.0
    size: float | None = None
    # The own high-water its start was priced at (an out-of-memory names growth past it).
    own_high_water_bytes: int = 0


@dataclass(frozen=True, slots=True)
class _Critical:
    """The key whose pending work would take longest alone, and by how much."""

    key: str
    time_left_s: float
    runner_up_time_left_s: float
    width: int


@dataclass(slots=True)
class _Card:
    census: CardCensus
    own_high_water_bytes: int
    oom_cap: int | None = None
    reading: CardReading | None = None
    reading_error: str | None = None
    gate_shut_since_s: float | None = None
    gate_recorded_s: float | None = None
    gate_episodes: int = 0
    width: int = 0
    recorded_own_bytes: int = 0
    # The host's other pools on this card: their tasks at max(booked, held),
    # the part not reached yet, how many, and what they held at the census.
    others: OtherPools | None = None
    others_bytes: int = 0
    others_unreached_bytes: int = 0
    others_tasks: int = 0
    others_at_census_bytes: int = 0
    others_held_bytes: int = 0
    others_overrun_bytes: int = 0
    others_since_s: float | None = None
    share_recorded_s: float | None = None
    # Every worker the pool ran a task in on this card: an idle one's row is
    # bytes (its context) that the next task's ask already counts.
    worker_pids: set[int] = field(default_factory=set)

    @property
    def others_waiting(self) -> int:
        """Other pools with tasks waiting for room on this card."""
        return self.others.waiting_pools if self.others is not None else 0

    @property
    def others_active(self) -> int:
        """Other pools running a task or waiting for room on this card."""
        return self.others.active_pools if self.others is not None else 0


def _next_booking(ask: Ask, busy: list[_Run]) -> int:
    """What one more task at ``ask`` books beside ``busy`` (a card's running tasks): its share
    of its key's price together with the key's tasks among them."""
    return ask.next_bytes(sum(1 for r in busy if r.key == ask.key))


class Planner:
    """Owns every price, admission and width decision of one pool.

    Args:
        census: the cards and the host as they stood at construction.
        asks: the per-key asks (the planner is their only writer).
        config: what the caller asked for.
        emit: where decision records go (the decision log).
        now_s: the time of construction.
    """

    def __init__(
        self,
        *,
        census: Census,
        asks: AskTable,
        config: PlannerConfig,
        emit: Callable[[Decision], None],
        now_s: float = 0.0,
    ) -> None:
        self.census = census
        self.asks = asks
        self.config = config
        self._emit = emit
        self.cards = [
            _Card(census=card, own_high_water_bytes=card.own_bytes or 0) for card in census.cards
        ]
        for card in self.cards:
            card.recorded_own_bytes = card.own_high_water_bytes
        self.tasks: dict[TaskId, _Task] = {}
        self.pending: collections.deque[TaskId] = collections.deque()
        self.running: dict[TaskId, _Run] = {}
        self.child_rss_bytes: int | None = None
        self.ceiling = self._derive_ceiling()
        self.counts: collections.Counter[str] = collections.Counter()
        self.widths: list[tuple[float, int]] = []
        self.refusal: str | None = None
        self.refusal_decision: Decision | None = None
        self._recorded_asks: dict[str, Ask] = {}
        self._last_key: str = ""
        self._head_skips = 0
        # Pending tasks per key, and each key's measured task durations (count, mean seconds).
        self._pending_by_key: collections.Counter[str] = collections.Counter()
        self._durations_s: dict[str, tuple[int, float]] = {}
        self._critical_recorded_s: float | None = None
        self._sensor_errors: set[tuple[int, str]] = set()
        self.width = self._width_now()

    # -- construction -------------------------------------------------------------------

    def construct(
        self, now_s: float, *, note: str = "", extra: Mapping[str, JsonValue] | None = None
    ) -> tuple[WidthDecision, ...]:
        """Decide and record the first width of every card, from the same code as every later one.

        Returns:
            The per-card decisions (empty for a host-bounded pool); with
            ``strict`` the caller refuses a width below ``max_workers``.
        """
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
            return ()
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
        return decisions

    def _cpus_note(self) -> str:
        cpus = self.census.host.cpus
        if self.config.max_workers_given and self.config.max_workers > cpus:
            return (
                f"; max_workers={self.config.max_workers} is more than the {cpus} usable CPUs "
                f"({self.census.host.cpu_source}): kept, as the standard pool keeps it"
            )
        return ""

    def _check_fixed(self, decisions: tuple[WidthDecision, ...], now_s: float) -> None:
        fixed = self.config.fixed_width
        assert fixed is not None
        bound_width = sum(d.width for d in decisions)
        if bound_width < fixed:
            self.record(
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
                    extra={"bound_width": bound_width},
                )
            )

    # -- prices -------------------------------------------------------------------------

    def _derive_ceiling(self) -> Ceiling:
        host = self.census.host
        fixed = self.config.fixed_width
        rss = self.child_rss_bytes
        return derive_ceiling(
            max_workers=fixed or self.config.max_workers,
            cpus=None if fixed or self.config.max_workers_given else host.cpus,
            host_ram_bytes=None if fixed else host.available_ram_bytes,
            child_rss_bytes=rss if rss is not None else self.config.child_rss_prior_bytes,
        )

    def bound(self, device: int, ask: Ask) -> Bound:
        """``device``'s bound priced at ``ask``, with its own high-water so far."""
        card = self.cards[device]
        bound = derive_bound(
            card.census,
            own_high_water_bytes=card.own_high_water_bytes,
            reserve_bytes=self.config.reserve_bytes,
            ask_bytes=ask.ask_bytes,
            ask_basis=ask.basis,
            other_pools_bytes=card.others_bytes,
            other_pools_at_census_bytes=card.others_at_census_bytes,
        )
        if not ask.pooled or bound.room_bytes is None:
            return bound
        fits = fits_together(ask.together_bytes, bound.room_bytes, self.ceiling.value)
        return dataclasses.replace(
            bound, together_tasks=fits, together_bytes=ask.together_bytes(max(1, fits))
        )

    def decide(self, ask: Ask) -> tuple[WidthDecision, ...]:
        """Every card's width for tasks priced at ``ask`` (the cap an out-of-memory set holds)."""
        decisions = decide_widths(
            [self.bound(i, ask) for i in range(len(self.cards))], self.ceiling
        )
        capped = []
        for decision in decisions:
            cap = self.cards[decision.device].oom_cap
            if cap is not None and decision.width > cap:
                decision = WidthDecision(
                    device=decision.device,
                    width=cap,
                    limit="out_of_memory",
                    bound=decision.bound,
                    ceiling=decision.ceiling,
                )
            capped.append(decision)
        return tuple(capped)

    def ask_of(self, task: TaskId) -> Ask:
        """``task``'s price now (a per-task hint becomes its key's estimate first)."""
        state = self.tasks[task]
        if state.hint_bytes is not None:
            self.asks.hint(state.key, state.hint_bytes)
            state.hint_bytes = None
        return self.asks.ask_for(state.key, state.size)

    # -- events -------------------------------------------------------------------------

    def submit(
        self, task: TaskId, key: str, hint_bytes: int | None = None, size: float | None = None
    ) -> None:
        """A task was submitted (it is pending, at the back of the queue). ``size``: the size
        of its input, from which its ask may be predicted (:meth:`AskTable.ask_for`)."""
        if hint_bytes is not None:
            self.asks.hint(key, hint_bytes)  # the width prices it at once
            self._rebook(key)
        self.tasks[task] = _Task(key=key, hint_bytes=None, size=size)
        self.pending.append(task)
        self._pending_by_key[key] += 1
        self._last_key = key

    def withdraw(self, task: TaskId) -> None:
        """A pending task left the queue (cancelled, or failed by the pool)."""
        if task in self.tasks and task not in self.running:
            try:
                self.pending.remove(task)
            except ValueError:
                pass
            else:
                self._pending_by_key[self.tasks[task].key] -= 1
            del self.tasks[task]

    def waiting_count(self, *, starting: bool = False) -> int:
        """How many pending tasks the pool's own ceiling (or fixed width) would let start now:
        what other pools on its cards are told waits for room. ``starting``: one pending
        task is being started (it counts as running)."""
        pending = len(self.pending) - starting
        running = len(self.running) + starting
        count = min(pending, self.ceiling.value - running)
        if self.cards and all(card.oom_cap is not None for card in self.cards):
            # Every card runs at most its out-of-memory cap: no more can start than those.
            free = sum(
                max(0, (card.oom_cap or 0) - sum(1 for r in self.running.values() if r.device == i))
                for i, card in enumerate(self.cards)
            )
            count = min(count, free - starting)
        return max(0, count)

    def need_bytes(self, *, starting: bool = False) -> int:
        """The ask of the first pending task that waits for room (0 when none does): the room
        other pools are told this pool needs for its next task."""
        if self.waiting_count(starting=starting) == 0 or len(self.pending) <= starting:
            return 0
        state = self.tasks[self.pending[int(starting)]]
        return self.asks.ask_for(state.key, state.size).ask_bytes

    def waiting_for_room(self) -> tuple[TaskId, ...]:
        """Pending tasks that ran out of memory alone and wait for others to free the room."""
        return tuple(t for t in self.pending if self.tasks[t].room_wait_until_s is not None)

    def pending_tasks(self) -> tuple[TaskId, ...]:
        """The pending tasks, in the order they will be considered."""
        return tuple(self.pending)

    def observe(self, device: int, reading: CardReading, now_s: float) -> None:
        """A live snapshot of ``device``: the live gate reads it, and the parent's own row
        raises the own high-water (a term of the bound: recorded when it grows)."""
        card = self.cards[device]
        card.reading = reading
        card.reading_error = None
        if reading.process_bytes is not None and card.worker_pids:
            # A worker with no row holds nothing (or has exited): forget it.
            running = {r.pid for r in self.running.values() if r.device == device}
            card.worker_pids = {
                pid for pid in card.worker_pids if pid in reading.process_bytes or pid in running
            }
        own = None
        if reading.process_bytes is not None and self.config.parent_pid is not None:
            own = reading.process_bytes.get(self.config.parent_pid)
        if own is not None and own > card.own_high_water_bytes:
            card.own_high_water_bytes = own
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
        held = unreached = tasks = overrun = 0
        if others is not None:
            for pool in others.pools:
                for task in pool.tasks:
                    holding = rows.get(task.worker_pid, task.reached_bytes)
                    held += holding
                    unreached += max(0, task.booked_bytes - holding)
                    overrun += max(0, holding - task.booked_bytes)
                    tasks += 1
        before = card.others_bytes
        card.others = others
        card.others_bytes = held + unreached
        card.others_unreached_bytes = unreached
        card.others_tasks = tasks
        card.others_held_bytes = held
        card.others_overrun_bytes = overrun
        card.others_since_s = None if tasks == 0 else card.others_since_s or now_s
        if census:
            card.others_at_census_bytes = held
            return
        if card.others_bytes != before:
            self._review(
                now_s,
                cause=(
                    f"other pools on the card book {format_size(card.others_bytes)} over "
                    f"{tasks} task{'s' if tasks != 1 else ''} ({format_size(unreached)} not yet "
                    "reached)"
                ),
                devices=(device,),
                quiet=True,
                extra={
                    "other_pools_bytes": card.others_bytes,
                    "other_pools_unreached_bytes": unreached,
                    "other_pools_tasks": tasks,
                },
            )

    def observe_error(self, device: int, error: str, now_s: float) -> None:
        """A live reading of ``device`` failed: it runs one task of the pool at a time meanwhile."""
        card = self.cards[device]
        card.reading = None
        card.reading_error = error
        self.sensor_error(device, error, "the live gate runs one task at a time", now_s)

    def sensor_error(self, device: int | None, error: str, effect: str, now_s: float) -> None:
        """Record a failed reading, once per card and kind of error."""
        kind = (-1 if device is None else device, error.split(":", 1)[0])
        if kind in self._sensor_errors:
            return
        self._sensor_errors.add(kind)
        self.counts["sensor_errors"] += 1
        self.record(
            self._simple(
                "sensor_error",
                device,
                self.asks.ask(self._last_key),
                f"card {device}: a reading failed ({error}); {effect} while it fails; the "
                "static bound still applies",
                now_s,
                extra={"error": error[:500]},
            )
        )

    def started(self, task: TaskId, device: int | None, pid: int | None, now_s: float) -> None:
        """``task`` was handed to a worker (``pid``) on ``device``: its ask is booked there."""
        state = self.tasks[task]
        try:
            self.pending.remove(task)
        except ValueError:
            pass
        else:
            self._pending_by_key[state.key] -= 1
        ask = 0
        if device is not None:
            price = self.asks.ask_for(state.key, state.size)
            ask = price.next_bytes(self._same_key(state.key, device))
        run = _Run(
            key=state.key,
            device=device,
            pid=pid,
            booked_bytes=ask,
            priced_bytes=ask,
            started_s=now_s,
            size=state.size,
        )
        if device is not None:
            run.own_high_water_bytes = self.cards[device].own_high_water_bytes
        if device is not None:
            neighbours = [r for r in self.running.values() if r.device == device]
            if self.cards[device].others_tasks:
                run.shared = True  # another pool's task is on the card: not alone
            if neighbours:
                run.shared = True
                for other in neighbours:
                    other.shared = True
        self.running[task] = run
        if device is not None and pid is not None:
            self.cards[device].worker_pids.add(pid)
        state.last_device = device
        state.last_ask_bytes = ask
        if state.room_wait_until_s is not None:
            state.room_wait_until_s = None
        self._last_key = state.key

    def finished(
        self, task: TaskId, report: PeakReport | None, now_s: float, *, failed: bool = False
    ) -> None:
        """``task`` ended with a result or an ordinary error; learn from its peak report.

        A task that raised (``failed``) is no sample of its key's peaks: it may have stopped
        before allocating what the work needs. Its peak only raises the key's ask, where it
        passed it (as an out-of-memory's does)."""
        run = self.running.pop(task, None)
        self.tasks.pop(task, None)
        if run is not None:
            self._rebook(run.key)
        if run is not None and not failed:
            count, mean_s = self._durations_s.get(run.key, (0, 0.0))
            took_s = max(0.0, now_s - run.started_s)
            self._durations_s[run.key] = (count + 1, mean_s + (took_s - mean_s) / (count + 1))
        if run is None or report is None:
            return
        self._learn_rss(report, now_s)
        if report.device is None or run.device is None:
            return
        if report.device_peak_bytes is None:
            self.sensor_error(
                run.device,
                "NoMeasurement: a worker could not measure its task's device peak",
                f"{run.key}'s ask stays as it was",
                now_s,
            )
            return
        before = self.asks.ask(run.key)
        if failed:
            peak = report.device_peak_bytes
            if peak <= before.ask_bytes:
                return
            after = self.asks.floor(run.key, peak + self.asks.policy.margin_for(peak))
        else:
            after = self.asks.measure(run.key, report.device_peak_bytes, size=run.size)
        self._rebook(run.key)
        self._ask_changed(run.key, before, after, now_s, report)

    def lost(
        self, task: TaskId, now_s: float, *, message: str, extra: Mapping[str, JsonValue]
    ) -> None:
        """``task``'s worker died: the task failed; its booking is released."""
        run = self.running.pop(task, None)
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
        """``task`` ran its card out of memory: raise its key's price, and retry or fail it.

        Args:
            task: the task.
            report: its peak report (what it reached, what it asked for).
            reading: a live snapshot of its card taken after the report, or ``None``.
            now_s: the time.
            error: the error's text (truncated in the record).
        """
        self.counts["oom"] += 1
        run = self.running.pop(task)
        state = self.tasks[task]
        state.retries += 1
        device = run.device
        card = self.cards[device] if device is not None else None
        reached = report.device_peak_bytes
        requested = report.oom_requested_bytes
        lower = (reached or 0) + (requested or 0)
        # The task's own ask (a sized task's was predicted for its size, not the key's).
        before = self.asks.ask_for(run.key, run.size)
        floor = before.ask_bytes
        if lower > floor:
            floor = lower + self.asks.policy.margin_for(lower)
        self.asks.floor(run.key, floor)
        after = self.asks.ask_for(run.key, run.size)
        self._rebook(run.key)
        others = [r for r in self.running.values() if r.device == device]
        running_then = len(others) + 1
        shared = run.shared or bool(others) or bool(card is not None and card.others_tasks)
        child_bytes = 0
        if reading is not None and reading.process_bytes is not None and run.pid is not None:
            child_bytes = reading.process_bytes.get(run.pid, 0)
        pool_bytes = None
        if reading is not None and reading.process_bytes is not None:
            pids = [r.pid for r in self.running.values() if r.device == device] + [run.pid]
            pool_bytes = sum(reading.process_bytes.get(p or -1, 0) for p in pids)
        bound = self.bound(device, after) if device is not None else None
        needed = after.ask_bytes + self.config.reserve_bytes
        # Held: the live free bytes do not cover its ask, yet the card without
        # its co-tenants (census or new) would: waiting for them can help.
        held = (
            reading is not None
            and card is not None
            and card.census.total_bytes is not None
            and reading.free_bytes + child_bytes < needed
            and card.census.total_bytes - card.own_high_water_bytes >= needed
        )
        outcome: Retry | Fail
        new_cap: int | None = None
        where = f"card {device if device is not None else '-'}"
        if not self.config.retry_oom:
            outcome = self._fail(task, "out_of_memory", "retries are off", device, run)
        elif state.retries > self.config.max_retries:
            outcome = self._fail(
                task,
                "retries_exhausted",
                f"it ran out of memory {state.retries} times, more than max_retries="
                f"{self.config.max_retries}",
                device,
                run,
            )
        elif shared:
            new_cap = max(1, running_then - 1)
            if self.config.fixed_width is not None:
                state.wait_below = new_cap
                why = (
                    f"retrying once its card runs at most {new_cap - 1} other task(s) (the "
                    f"fixed width {self.config.fixed_width} stays)"
                )
            elif lower > before.ask_bytes:
                why = (
                    f"the ask was underestimated: booked at {format_size(run.priced_bytes)}, it "
                    f"reached {format_size(reached)} and asked for {format_size(requested)} "
                    f"more; {run.key}'s ask {before.describe()} -> {after.describe()}"
                )
            else:
                assert card is not None
                card.oom_cap = new_cap if card.oom_cap is None else min(card.oom_cap, new_cap)
                why = (
                    f"it stayed within its ask ({format_size(run.priced_bytes)}), so something "
                    f"else on the card grew; at most {card.oom_cap} at once there from now on"
                )
                if before.pooled:
                    why = (
                        f"it stayed within {run.key}'s ask, but {run.key}'s tasks were priced "
                        "together (their peaks counted on not coinciding): either they, or "
                        f"something else on the card, grew past that; {run.key} is priced "
                        f"{format_size(after.ask_bytes)} per task from now on, and at most "
                        f"{card.oom_cap} run at once there"
                    )
            outcome = self._retry(task, why)
        elif held:
            if state.room_wait_until_s is None:
                state.room_wait_until_s = now_s + self.config.room_wait_s
            outcome = self._retry(
                task,
                f"it ran out alone while the card's live free bytes "
                f"({format_size(reading.free_bytes if reading else None)}) did not cover its ask "
                f"{format_size(after.ask_bytes)} + {format_size(self.config.reserve_bytes)} "
                f"reserve: others' bytes hold the card, so it waits for room (until "
                f"{state.room_wait_until_s:.1f} s) and retries",
            )
        else:
            elsewhere = self._roomier_elsewhere(device, after)
            if elsewhere is not None and device is not None:
                state.avoid.add(device)
                outcome = self._retry(
                    task,
                    f"it ran out alone on {where}; card {elsewhere} has room for its ask "
                    f"{after.describe()}, so it is retried there",
                )
            else:
                outcome = self._fail(
                    task,
                    "out_of_memory",
                    "it ran out alone on the card with its ask's room free",
                    device,
                    run,
                )
        retry = isinstance(outcome, Retry)
        self.record(
            Decision(
                event="out_of_memory",
                time_s=now_s,
                device=device,
                width_before=running_then,
                width_after=(new_cap if new_cap is not None else running_then),
                reason=(
                    f"{where}: a task of {run.key} ran out of memory at {format_size(reached)} "
                    f"reached (asked for {format_size(requested)} more), booked at "
                    f"{format_size(run.priced_bytes)} beside {len(others)} other running; live "
                    f"{format_size(reading.used_bytes if reading else None)} used, "
                    f"{format_size(reading.free_bytes if reading else None)} free; "
                    f"{outcome.reason}"
                ),
                bound=bound,
                ceiling=self.ceiling,
                key=run.key,
                key_ask=after,
                limit="out_of_memory",
                extra={
                    "task_ask_bytes": run.priced_bytes,
                    "ask_before_bytes": before.ask_bytes,
                    "ask_after_bytes": after.ask_bytes,
                    "reached_bytes": reached,
                    "requested_bytes": requested,
                    "live_free_bytes": reading.free_bytes if reading else None,
                    "live_used_bytes": reading.used_bytes if reading else None,
                    "live_own_bytes": (
                        reading.process_bytes.get(self.config.parent_pid or -1)
                        if reading is not None and reading.process_bytes is not None
                        else None
                    ),
                    "live_pool_bytes": pool_bytes,
                    "census_co_tenant_bytes": bound.co_tenant_bytes if bound else None,
                    "priced_own_high_water_bytes": (
                        min([run.own_high_water_bytes] + [r.own_high_water_bytes for r in others])
                        if device is not None
                        else None
                    ),
                    "other_pools_bytes": card.others_bytes if card else None,
                    "other_pools_held_bytes": card.others_held_bytes if card else None,
                    "other_pools_overrun_bytes": card.others_overrun_bytes if card else None,
                    "other_pools_tasks": card.others_tasks if card else None,
                    "booked_bytes": sum(r.booked_bytes for r in others) + run.priced_bytes,
                    "running": running_then,
                    "tries": state.retries,
                    "retry": retry,
                    "outcome": outcome.kind if isinstance(outcome, Fail) else "retry",
                    "oom_cap": card.oom_cap if card else None,
                    "error": error[:500],
                },
            )
        )
        if retry and card is not None and self.config.fixed_width is None:
            self._review(
                now_s,
                cause=f"an out-of-memory of {run.key}",
                devices=(device,) if device is not None else (),
            )
        if isinstance(outcome, Fail):
            self.tasks.pop(task, None)
        return outcome

    def _retry(self, task: TaskId, reason: str) -> Retry:
        self.counts["retries"] += 1
        self.pending.appendleft(task)
        self._pending_by_key[self.tasks[task].key] += 1
        return Retry(task=task, reason=reason)

    def _fail(self, task: TaskId, kind: FailKind, why: str, device: int | None, run: _Run) -> Fail:
        return Fail(task=task, kind=kind, reason=why, device=device, ask_bytes=run.priced_bytes)

    def _roomier_elsewhere(self, device: int | None, ask: Ask) -> int | None:
        if device is None:
            return None
        here = self.bound(device, ask).room_bytes
        best: tuple[int, int] | None = None
        for index in range(len(self.cards)):
            if index == device:
                continue
            room = self.bound(index, ask).room_bytes
            if (
                room is not None
                and room >= ask.ask_bytes
                and (here is None or room > here)
                and (best is None or room > best[1])
            ):
                best = (index, room)
        return best[0] if best else None

    # -- learning -----------------------------------------------------------------------

    def _learn_rss(self, report: PeakReport, now_s: float) -> None:
        rss = report.rss_peak_bytes
        if rss is None or (self.child_rss_bytes is not None and rss <= self.child_rss_bytes):
            return
        self.child_rss_bytes = rss
        before = self.ceiling
        self.ceiling = self._derive_ceiling()
        if self.ceiling.value != before.value:
            event: EventName = "narrowed" if self.ceiling.value < before.value else "widened"
            self.record(
                Decision(
                    event=event,
                    time_s=now_s,
                    device=None,
                    width_before=before.value,
                    width_after=self.ceiling.value,
                    reason=(
                        f"the ceiling goes {before.value} -> {self.ceiling.value}: host RAM "
                        f"({format_size(self.ceiling.host_ram_bytes)} available) at "
                        f"{format_size(rss)} measured RSS per child (was "
                        f"{format_size(before.child_rss_bytes)}"
                        + (
                            ")"
                            if before.child_rss_bytes != self.config.child_rss_prior_bytes
                            else ", the prior)"
                        )
                        + f"; set by {self.ceiling.limit}"
                    ),
                    ceiling=self.ceiling,
                    limit=self.ceiling.limit,
                )
            )
            self.width = self._width_now()
            self._timeline(now_s)

    def _same_key(self, key: str, device: int) -> int:
        """How many tasks of ``key`` run on ``device``."""
        return sum(1 for r in self.running.values() if r.device == device and r.key == key)

    def _rebook(self, key: str) -> None:
        """Book the running tasks of ``key`` at its price now: on each card they hold
        ``together_bytes(count)`` between them, the oldest at the full ask (a key's ask
        prices its running tasks as well as its next ones, whichever way it moved)."""
        ask = self.asks.ask(key)
        seen: collections.Counter[int] = collections.Counter()
        for run in self.running.values():
            if run.key == key and run.device is not None:
                if run.size is not None:
                    run.booked_bytes = self.asks.ask_for(key, run.size).ask_bytes
                    continue
                run.booked_bytes = ask.next_bytes(seen[run.device])
                seen[run.device] += 1

    def _ask_changed(
        self, key: str, before: Ask, after: Ask, now_s: float, report: PeakReport
    ) -> None:
        last = self._recorded_asks.get(key, before)
        moved = abs(after.ask_bytes - last.ask_bytes) > ASK_RECORD_STEP * max(1, last.ask_bytes)
        changed_basis = last.basis != after.basis
        cause = (
            f"{key} measured {format_size(report.device_peak_bytes)} ({report.device_source}); "
            f"ask {before.describe()} -> {after.describe()}"
        )
        unchanged: EventName = "bound_changed"
        if changed_basis:
            unchanged = "measured"
        elif after.ask_bytes < last.ask_bytes:
            unchanged = "widen_refused"
        widths_moved = self._review(
            now_s,
            cause=cause,
            key=key,
            quiet=not (moved or changed_basis),
            unchanged=unchanged,
            extra={
                "peak_bytes": report.device_peak_bytes,
                "peak_source": report.device_source,
                "baseline_bytes": report.baseline_bytes,
                "rss_peak_bytes": report.rss_peak_bytes,
                "margin_bytes": after.margin_bytes,
                "spread_bytes": after.spread_bytes,
                "samples": after.samples,
            },
        )
        if widths_moved or moved or changed_basis:
            self._recorded_asks[key] = after

    # -- the width ----------------------------------------------------------------------

    def _present_keys(self) -> list[str]:
        keys: dict[str, None] = {}
        for run in self.running.values():
            keys[run.key] = None
        for i, task in enumerate(self.pending):
            if i >= LOOKAHEAD:
                break
            keys[self.tasks[task].key] = None
        return list(keys)

    def _review(
        self,
        now_s: float,
        *,
        cause: str,
        key: str | None = None,
        devices: tuple[int, ...] | None = None,
        quiet: bool = False,
        unchanged: EventName = "bound_changed",
        extra: Mapping[str, JsonValue] | None = None,
    ) -> bool:
        """A term of the bound changed: decide the widths again and record what moved.

        ``unchanged`` names the record of a card whose width did not move
        (``"measured"`` for a key's first measurement, ``"widen_refused"`` for
        a smaller ask the room does not let widen). Returns whether any card's
        width moved.
        """
        if not self.cards:
            return False
        priced = key if key is not None else (self._present_keys() or [self._last_key])[0]
        ask = self.asks.ask(priced)
        decisions = self.decide(ask)
        moved = False
        for decision in decisions:
            card = self.cards[decision.device]
            old, new = card.width, decision.width
            if devices is not None and decision.device not in devices and new == old:
                continue
            if new == old and quiet:
                continue
            if (
                new < old
                and self.config.strict
                and self.config.fixed_width is None
                and new < min(self.config.max_workers, self.ceiling.value)
            ):
                self._refuse(decision, old, now_s)
                return True
            event: EventName = "widened" if new > old else "narrowed" if new < old else unchanged
            if event == "widen_refused" and (
                decision.limit != "memory" or decision.width >= self.ceiling.value
            ):
                event = "bound_changed"
            if new != old:
                moved = True
            card.width = new
            self.record(
                Decision.from_width(
                    event,
                    decision,
                    time_s=now_s,
                    width_before=old,
                    reason=f"{decision.describe()}; {cause}; width {old} -> {new}",
                    key=priced or None,
                    key_ask=ask if priced else None,
                    extra=dict(extra or {}) | {"oom_cap": card.oom_cap},
                )
            )
        if self.config.fixed_width is not None and moved:
            self._check_fixed(decisions, now_s)
        self.width = self._width_now()
        self._timeline(now_s)
        return moved

    def _refuse(self, decision: WidthDecision, width_before: int, now_s: float) -> None:
        message = (
            f"strict mode: {decision.describe()}, below the requested width "
            f"{self.config.max_workers}; refusing to narrow. Free the card, lower max_workers, "
            "or drop strict=True."
        )
        record = Decision.from_width(
            "narrowed", decision, time_s=now_s, width_before=width_before, reason=message
        )
        self.record(record)
        self.refusal = message
        self.refusal_decision = record

    def _timeline(self, now_s: float) -> None:
        if not self.widths or self.widths[-1][1] != self.width:
            self.widths.append((round(now_s, 6), self.width))

    def _width_now(self) -> int:
        """How many tasks the planner admits at once now, for the work it holds."""
        if self.config.fixed_width is not None:
            return self.config.fixed_width
        if not self.cards:
            return self.ceiling.value
        booked = [0] * len(self.cards)
        count = [0] * len(self.cards)
        same: collections.Counter[tuple[int, str]] = collections.Counter()
        for run in self.running.values():
            if run.device is not None:
                booked[run.device] += run.booked_bytes
                count[run.device] += 1
                same[run.device, run.key] += 1
        total = sum(count)
        asks = [
            self.asks.ask_for(self.tasks[t].key, self.tasks[t].size)
            for t in itertools.islice(self.pending, LOOKAHEAD)
        ]
        # What the next submits could add: more of the last key seen.
        asks += [self.asks.ask(self._last_key)] * max(0, self.ceiling.value - total - len(asks))
        for ask in asks:
            if total >= self.ceiling.value:
                break
            placed = self._fit(ask, booked, count, same)
            if placed is not None:
                booked[placed] += ask.next_bytes(same[placed, ask.key])
                count[placed] += 1
                same[placed, ask.key] += 1
                total += 1
        return max(1, min(total, self.ceiling.value))

    def _fit(
        self,
        ask: Ask,
        booked: list[int],
        count: list[int],
        same: collections.Counter[tuple[int, str]],
    ) -> int | None:
        best: int | None = None
        best_left = 0
        for index, card in enumerate(self.cards):
            if card.oom_cap is not None and count[index] >= card.oom_cap:
                continue
            ask_bytes = ask.next_bytes(same[index, ask.key])
            room = derive_bound(
                card.census,
                own_high_water_bytes=card.own_high_water_bytes,
                reserve_bytes=self.config.reserve_bytes,
                ask_bytes=max(1, ask_bytes),
                ask_basis="estimated",
                other_pools_bytes=card.others_bytes,
                other_pools_at_census_bytes=card.others_at_census_bytes,
            ).room_bytes
            if room is None:
                if count[index] == 0:
                    return index
                continue
            left = room - booked[index] - ask_bytes
            if left >= 0 and (best is None or left > best_left):
                best, best_left = index, left
        return best

    def widths_by_key(self) -> dict[str, int]:
        """For each key with work pending or running: how many of its tasks could run at once
        beside the other keys' running tasks."""
        out: dict[str, int] = {}
        for key in self._present_keys():
            if self.config.fixed_width is not None:
                out[key] = self.config.fixed_width
                continue
            if not self.cards:
                out[key] = self.ceiling.value
                continue
            total = 0
            others = sum(1 for r in self.running.values() if r.key != key)
            for index, card in enumerate(self.cards):
                mine = sum(1 for r in self.running.values() if r.device == index and r.key == key)
                other_booked = sum(
                    r.booked_bytes
                    for r in self.running.values()
                    if r.device == index and r.key != key
                )
                room = self.bound(index, self.asks.ask(key)).room_bytes
                fits = (
                    1
                    if room is None
                    else fits_together(
                        self.asks.ask(key).together_bytes,
                        room - other_booked,
                        self.ceiling.value,
                    )
                )
                if card.oom_cap is not None:
                    fits = min(fits, card.oom_cap)
                total += max(mine, fits)
            out[key] = max(1, min(total, self.ceiling.value - others))
        return out

    def warm_limit(self, device: int, now_s: float) -> int:
        """How many workers ``device`` may keep (running and idle)."""
        card = self.cards[device]
        running = sum(1 for r in self.running.values() if r.device == device)
        if (
            card.gate_shut_since_s is not None
            and now_s - card.gate_shut_since_s >= RETIRE_AFTER_SHUT_S
        ) or self._owes_room(device):
            # An idle worker's context is bytes the card needs: this pool's gate has been
            # shut a while, or a waiting pool is owed room there that is not free.
            return running
        keys = self._present_keys() or [self._last_key]
        room = self.bound(device, self.asks.ask(keys[0])).room_bytes
        fits = (
            1
            if room is None
            else max(
                1,
                *(
                    fits_together(self.asks.ask(k).together_bytes, room, self.ceiling.value)
                    for k in keys
                ),
            )
        )
        if card.oom_cap is not None:
            fits = min(fits, card.oom_cap)
        return max(running, min(fits, self.ceiling.value))

    # -- the decision before every start ------------------------------------------------

    def next_start(self, now_s: float) -> Start | Wait | Fail | None:
        """What to start now: a task and its card, a wait (with why), a failure, or ``None``
        when nothing is pending. :attr:`width` is brought up to date with the work held."""
        verdict = self._next_start(now_s)
        self.width = self._width_now()
        return verdict

    def _next_start(self, now_s: float) -> Start | Wait | Fail | None:
        if not self.pending:
            return None
        running = len(self.running)
        if running >= self.ceiling.value:
            return Wait(reason=f"the ceiling ({self.ceiling.limit}) holds {self.ceiling.value}")
        head = self.pending[0]
        firsts: dict[str, TaskId] = {}
        for task in itertools.islice(self.pending, LOOKAHEAD):
            firsts.setdefault(self.tasks[task].key, task)
        candidates, critical = self._critical_first(list(firsts.values()))
        if self._head_skips >= max(1, self.ceiling.value):
            # The queue's head was passed a ceiling's worth of times in a row: it goes next.
            candidates, critical = [head], None
        gate_shut = False
        held: int | None = None
        for position, task in enumerate(candidates):
            if position == 1 and critical is not None:
                held = self._holds_for(self.ask_of(candidates[0]), candidates[0])
                if held is not None:
                    # The other keys leave that card's room to the critical key; a card it
                    # cannot use now still takes their tasks.
                    self._critical_wait(critical, self.tasks[task].key, held, now_s)
            verdict, shut = self._try_start(task, now_s, running, held=held)
            gate_shut = gate_shut or shut
            if verdict is not None:
                self._head_skips = 0 if task == head else self._head_skips + 1
                return verdict
        return self._blocked(head, now_s, running, gate_shut)

    def _critical_first(self, firsts: list[TaskId]) -> tuple[list[TaskId], _Critical | None]:
        """The keys' first pending tasks in queue order, or with the critical key's first.

        A key's time left is its pending count x its tasks' mean duration / how many of them
        fit at once alone. The key with the most is critical where it leads every other key by
        at least one of its tasks' duration: the run ends when it does, so it goes first. Until
        every key's tasks were timed, the queue's order stands."""
        if (
            len(firsts) < 2
            or not self.cards
            or self.config.fixed_width is not None
            or any(self.tasks[t].key not in self._durations_s for t in firsts)
        ):
            return firsts, None

        def time_left_s(task: TaskId) -> tuple[float, float, int]:
            key = self.tasks[task].key
            ask = self.asks.ask(key)
            alone = 0
            for index in range(len(self.cards)):
                fits = self.bound(index, ask).tasks_fit
                alone += 1 if fits is None else fits
            duration_s = self._durations_s[key][1]
            width = max(1, min(alone, self.ceiling.value))
            return self._pending_by_key[key] * duration_s / width, duration_s, width

        times = [time_left_s(t) for t in firsts]
        first = max(range(len(firsts)), key=lambda i: times[i][0])
        left_s, duration_s, width = times[first]
        runner_up_s = max(times[i][0] for i in range(len(firsts)) if i != first)
        if left_s - runner_up_s < duration_s:
            return firsts, None
        critical = _Critical(
            key=self.tasks[firsts[first]].key,
            time_left_s=left_s,
            runner_up_time_left_s=runner_up_s,
            width=width,
        )
        return [firsts[first], *firsts[:first], *firsts[first + 1 :]], critical

    def _holds_for(self, ask: Ask, task: TaskId) -> int | None:
        """The card where the other keys should leave room for ``task`` (the critical key's
        first, at ``ask``, not fitting now), or ``None``.

        A card qualifies where ending some of the other keys' tasks there lets it start
        without leaving the card less booked than now (the ended tasks' room refilled with
        as many of them as fit beside it): their ends make the room, at most one of their
        tasks' duration away, and the card's bytes do not go idle for it."""
        head = ask.key
        for index in range(len(self.cards)):
            if index in self.tasks[task].avoid and len(self.tasks[task].avoid) < len(self.cards):
                continue
            room = self.bound(index, ask).room_bytes
            busy = [r for r in self.running.values() if r.device == index]
            cap = self.cards[index].oom_cap
            mine = sum(1 for r in busy if r.key == head)
            if room is None or (cap is not None and mine >= cap):
                continue
            need = ask.next_bytes(mine)
            booked = sum(r.booked_bytes for r in busy)
            others = sorted((r.booked_bytes for r in busy if r.key != head), reverse=True)
            ended: list[int] = []
            while others and booked - sum(ended) + need > room:
                ended.append(others.pop(0))
            after = booked - sum(ended) + need
            if not ended or after > room:
                # It fits the bound here now (something else holds it back), or does not
                # even once the other keys' tasks end.
                continue
            for size in sorted(ended):
                if after + size <= room:
                    after += size
            if after >= booked:
                return index
        return None

    def _critical_wait(self, critical: _Critical, held: str, index: int, now_s: float) -> None:
        self.counts["critical_waits"] += 1
        if (
            self._critical_recorded_s is not None
            and now_s - self._critical_recorded_s < GATE_RECORD_INTERVAL_S
        ):
            return
        self._critical_recorded_s = now_s
        ask = self.asks.ask(critical.key)
        self.record(
            self._simple(
                "critical_wait",
                index,
                ask,
                f"card {index}: {critical.key}'s pending tasks would take "
                f"{critical.time_left_s:.1f} s at {critical.width} at once, the most of any key "
                f"(the next: {critical.runner_up_time_left_s:.1f} s); one more of it fits here "
                f"once tasks of other keys end, so {held} waits rather than take that room",
                now_s,
                extra={
                    "critical_key": critical.key,
                    "critical_time_left_s": round(critical.time_left_s, 3),
                    "runner_up_time_left_s": round(critical.runner_up_time_left_s, 3),
                    "critical_width": critical.width,
                    "held_key": held,
                },
            )
        )

    def _try_start(
        self, task: TaskId, now_s: float, running: int, *, held: int | None = None
    ) -> tuple[Start | Fail | None, bool]:
        """Start ``task`` on a card that admits it, never on ``held`` (a card whose room is
        left to the critical key; never set under a fixed width)."""
        state = self.tasks[task]
        if not self.cards:
            return Start(task=task, device=None, ask_bytes=0), False
        ask = self.ask_of(task)
        if self.config.fixed_width is not None:
            index = min(
                range(len(self.cards)),
                key=lambda i: (sum(1 for r in self.running.values() if r.device == i), i),
            )
            here = sum(1 for r in self.running.values() if r.device == index)
            if state.wait_below is not None and here >= state.wait_below:
                return None, False
            if state.room_wait_until_s is not None and not self._live_fits(index, ask, []):
                if now_s >= state.room_wait_until_s:
                    return self._expired(task, state, ask), False
                return None, True
            return Start(task=task, device=index, ask_bytes=ask.ask_bytes), False
        gate_shut = False
        order = sorted(
            range(len(self.cards)),
            key=lambda i: (
                -(
                    (self.bound(i, ask).room_bytes or 0)
                    - sum(r.booked_bytes for r in self.running.values() if r.device == i)
                )
            ),
        )
        for index in order:
            if index == held or (index in state.avoid and len(state.avoid) < len(self.cards)):
                continue
            verdict = self._admits_on(index, ask, now_s)
            if verdict == "no":
                continue
            card = self.cards[index]
            if verdict == "gate":
                gate_shut = True
                busy = [r for r in self.running.values() if r.device == index]
                self._gate_shut(index, ask, busy, now_s)
                continue
            card.gate_shut_since_s = None
            booked = ask.next_bytes(self._same_key(ask.key, index))
            start = Start(task=task, device=index, ask_bytes=ask.ask_bytes, booked_bytes=booked)
            return start, False
        if (
            held is None
            and state.room_wait_until_s is not None
            and now_s >= state.room_wait_until_s
        ):
            # (Not while a card was left to the critical key: that card may have its room.)
            return self._expired(task, state, ask), gate_shut
        return None, gate_shut

    def _admits_on(self, index: int, ask: Ask, now_s: float) -> Literal["yes", "no", "gate"]:
        """The bound on one card: the booked asks, the cap, the share of a card other pools
        wait on, then the live gate."""
        card = self.cards[index]
        busy = [r for r in self.running.values() if r.device == index]
        if card.oom_cap is not None and len(busy) >= card.oom_cap:
            return "no"
        room = self.bound(index, ask).room_bytes
        next_bytes = _next_booking(ask, busy)
        if not admits(next_bytes, [r.booked_bytes for r in busy], room):
            return "no"
        if not self._within_share(index, next_bytes, busy, room, now_s):
            return "no"
        if card.reading_error is not None and busy:
            return "no"
        if not self._live_fits(index, ask, busy):
            return "gate"
        return "yes"

    def _within_share(
        self, index: int, next_bytes: int, busy: list[_Run], room: int | None, now_s: float
    ) -> bool:
        """Pools sharing a card share it. While another pool has tasks waiting for room there,
        a start must keep two rules:

        * its share: this pool takes no more than an equal share of the room the pools have
          between them (``(room + other pools' bookings) / pools running or waiting there``),
          rounded to the nearest task (a start is admitted while the middle of its booking
          is within the share, so two pools that each stop just short of it do not leave a
          task's room idle);
        * the room it owes: a waiting pool that holds less than this pool and less than its
          share is owed the room for its next task (its ``need_bytes``), so this start must
          leave that much free; a task larger than a share waits for the others to shrink,
          not forever.

        One task of its own always may run; with no other pool waiting, the bound alone
        decides."""
        card = self.cards[index]
        if not card.others_waiting or not busy or room is None or card.others is None:
            return True
        share = self._share_bytes(index, room)
        mine = sum(r.booked_bytes for r in busy)
        owed = self._owed_bytes(index, room, mine, share)
        left = room - mine - next_bytes
        within = mine + next_bytes // 2 <= share
        if within and left >= owed:
            return True
        self.counts["share_waits"] += 1
        recorded = card.share_recorded_s
        if recorded is None or now_s - recorded >= GATE_RECORD_INTERVAL_S:
            card.share_recorded_s = now_s
            why = (
                f"one more ({format_size(next_bytes)}) would pass its share "
                f"{format_size(share)} (({format_size(room)} room + "
                f"{format_size(card.others_bytes)} other pools') / {1 + card.others_active} "
                "pools)"
                if not within
                else f"one more ({format_size(next_bytes)}) would leave {format_size(left)}, "
                f"less than the {format_size(owed)} a waiting pool below its share "
                f"({format_size(share)}) needs for its next task"
            )
            self.record(
                self._simple(
                    "share_wait",
                    index,
                    self.asks.ask(busy[-1].key),
                    f"card {index}: {card.others_waiting} other pool(s) wait for room here, and "
                    f"this pool's {len(busy)} running task(s) book {format_size(mine)}; {why}, "
                    "so it waits",
                    now_s,
                    extra={
                        "share_bytes": share,
                        "pool_booked_bytes": mine,
                        "next_bytes": next_bytes,
                        "owed_bytes": owed,
                        "other_pools_waiting": card.others_waiting,
                        "other_pools_active": card.others_active,
                    },
                )
            )
        return False

    def _share_bytes(self, index: int, room: int) -> int:
        """An equal share of the room the pools on ``index`` have between them."""
        card = self.cards[index]
        return (room + card.others_bytes) // (1 + card.others_active)

    def _owed_bytes(self, index: int, room: int, mine: int, share: int) -> int:
        """The most room a waiting pool on ``index`` is owed for its next task: one that holds
        less than this pool (``mine``) and less than its share, whose task could fit the
        room the pools have between them."""
        card = self.cards[index]
        if card.others is None:
            return 0
        pools_room = room + card.others_bytes + mine
        return max(
            (
                pool.need_bytes
                for pool in card.others.pools
                if pool.waiting
                and pool.booked_bytes < mine
                and pool.booked_bytes < share
                and pool.need_bytes <= pools_room
            ),
            default=0,
        )

    def _owes_room(self, index: int) -> bool:
        """A waiting pool is owed room on ``index`` that is not free now."""
        card = self.cards[index]
        if not card.others_waiting:
            return False
        ask = self.asks.ask(self._last_key)
        room = self.bound(index, ask).room_bytes
        if room is None:
            return False
        mine = sum(r.booked_bytes for r in self.running.values() if r.device == index)
        owed = self._owed_bytes(index, room, mine, self._share_bytes(index, room))
        return owed > 0 and room - mine < owed

    def still_admits(self, start: Start, now_s: float) -> bool:
        """After the other pools' bookings were read again in the same step that published
        this start's: does the start still fit? (Two pools deciding at once cannot both
        take the same room: whichever publishes second sees the first's booking.)"""
        if start.past_bound or start.device is None or self.config.fixed_width is not None:
            return True
        state = self.tasks[start.task]
        return (
            self._admits_on(start.device, self.asks.ask_for(state.key, state.size), now_s) == "yes"
        )

    def _expired(self, task: TaskId, state: _Task, ask: Ask) -> Fail:
        self.pending.remove(task)
        self._pending_by_key[state.key] -= 1
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
            ask_bytes=state.last_ask_bytes or ask.ask_bytes,
        )

    def _live_fits(self, index: int, ask: Ask, busy: list[_Run]) -> bool:
        """The live gate: the card's free bytes now cover the new ask, what the running tasks
        have not reached yet, and the reserve. No reading: the static bound alone decides."""
        reading = self.cards[index].reading
        if reading is None:
            return True
        rows = reading.process_bytes or {}
        unreached = sum(max(0, r.booked_bytes - rows.get(r.pid or -1, 0)) for r in busy)
        unreached += self.cards[index].others_unreached_bytes
        held = self._idle_worker_bytes(index, ask, busy)
        return live_gate_admits(
            live_free_bytes=reading.free_bytes + held,
            ask_bytes=_next_booking(ask, busy),
            unreached_bytes=unreached,
            reserve_bytes=self.config.reserve_bytes,
        )

    def _idle_worker_bytes(self, index: int, ask: Ask, busy: list[_Run]) -> int:
        """What the idle warm worker the task will run in already holds (its context), which
        its booking counts too: the least row of the card's idle workers, at most the
        booking; 0 when none is idle or rows are not listed (a fresh worker holds nothing
        yet)."""
        card = self.cards[index]
        reading = card.reading
        if reading is None or reading.process_bytes is None or not card.worker_pids:
            return 0
        running = {r.pid for r in busy}
        idle = [
            reading.process_bytes[pid]
            for pid in card.worker_pids
            if pid not in running and pid in reading.process_bytes
        ]
        if not idle:
            return 0
        next_bytes = _next_booking(ask, busy)
        return max(0, min(next_bytes, *idle))

    def _gate_shut(self, index: int, ask: Ask, busy: list[_Run], now_s: float) -> None:
        card = self.cards[index]
        reading = card.reading
        assert reading is not None
        if card.gate_shut_since_s is None:
            card.gate_shut_since_s = now_s
            card.gate_episodes += 1
            self.counts["gate_waits"] += 1
        if (
            card.gate_recorded_s is not None
            and now_s - card.gate_recorded_s < GATE_RECORD_INTERVAL_S
        ):
            return
        rows = reading.process_bytes or {}
        unreached = sum(max(0, r.booked_bytes - rows.get(r.pid or -1, 0)) for r in busy)
        unreached += card.others_unreached_bytes
        held = self._idle_worker_bytes(index, ask, busy)
        next_bytes = _next_booking(ask, busy)
        episodes = card.gate_episodes
        card.gate_recorded_s = now_s
        card.gate_episodes = 0
        self.record(
            self._simple(
                "live_gate_wait",
                index,
                ask,
                f"card {index}: {format_size(reading.free_bytes)} free now (+ "
                f"{format_size(held)} the idle worker it would run in holds) does not cover "
                f"{format_size(next_bytes)} ask + {format_size(unreached)} not yet reached by "
                f"{len(busy)} running here and {card.others_tasks} of other pools + "
                f"{format_size(self.config.reserve_bytes)} reserve; the "
                f"task waits ({episodes} shut episode{'s' if episodes != 1 else ''} since the "
                "last such record)",
                now_s,
                extra={
                    "live_free_bytes": reading.free_bytes,
                    "live_used_bytes": reading.used_bytes,
                    "idle_worker_bytes": held,
                    "unreached_bytes": unreached,
                    "running": len(busy),
                    "gate_episodes": episodes,
                    "other_pools_unreached_bytes": card.others_unreached_bytes,
                    "other_pools_tasks": card.others_tasks,
                },
            )
        )

    def _blocked(self, head: TaskId, now_s: float, running: int, gate_shut: bool) -> Wait | Start:
        state = self.tasks[head]
        if running > 0:
            # Another pool's tasks end without an event here: poll while they hold a card.
            others = any(card.others_tasks or card.others_waiting for card in self.cards)
            return Wait(
                reason="the bound or the live gate holds the pending tasks back",
                poll_s=LIVE_POLL_S if gate_shut or others else None,
            )
        # Nothing of the pool runs anywhere.
        ask = self.ask_of(head)
        if state.room_wait_until_s is not None:
            return Wait(reason="waiting for room after an out-of-memory", poll_s=LIVE_POLL_S)
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
        return Start(task=head, device=index, ask_bytes=ask.ask_bytes, past_bound=True)

    # -- records ------------------------------------------------------------------------

    def record(self, decision: Decision) -> None:
        """Write one record (the planner's only output besides its verdicts)."""
        self._emit(decision)

    def _simple(
        self,
        event: EventName,
        device: int | None,
        ask: Ask,
        reason: str,
        now_s: float,
        *,
        limit: str | None = None,
        extra: Mapping[str, JsonValue] | None = None,
    ) -> Decision:
        bound = self.bound(device, ask) if device is not None and self.cards else None
        width = self.cards[device].width if device is not None and self.cards else self.width
        return Decision(
            event=event,
            time_s=now_s,
            device=device,
            width_before=width,
            width_after=width,
            reason=reason,
            bound=bound,
            ceiling=self.ceiling,
            limit=limit,
            key=ask.key or None,
            extra=dict(extra or {}),
            key_ask=ask if ask.key else None,
        )

    def flush_asks(self, now_s: float) -> None:
        """Record each key's final ask where it moved since its last record (at most one record
        per key: a log read afterwards ends with every key's true price)."""
        for key in self.asks.keys():  # noqa: SIM118 (AskTable is not a dict)
            ask = self.asks.ask(key)
            last = self._recorded_asks.get(key)
            if last is None or last.ask_bytes == ask.ask_bytes or not self.cards:
                continue
            self._recorded_asks[key] = ask
            self.record(
                self._simple(
                    "bound_changed",
                    None,
                    ask,
                    f"{key}: final ask {ask.describe()} (last recorded "
                    f"{format_size(last.ask_bytes)})",
                    now_s,
                )
            )

    def shutdown_record(
        self, now_s: float, counts: Mapping[str, int], *, tasks_lost: int
    ) -> Decision:
        """The run's totals, as the last record."""
        totals = collections.Counter(self.counts)
        totals.update(counts)
        return Decision(
            event="shutdown",
            time_s=now_s,
            device=None,
            width_before=self.width,
            width_after=0,
            reason=(
                f"pool shut down after {totals['completed']} completed, {totals['failed']} "
                f"failed, {totals['cancelled']} cancelled tasks; {totals['oom']} out-of-memory, "
                f"{totals['retries']} retries, {totals['lost']} workers lost"
            ),
            extra={
                "tasks_completed": totals["completed"],
                "tasks_failed": totals["failed"],
                "tasks_cancelled": totals["cancelled"],
                "out_of_memory": totals["oom"],
                "retries": totals["retries"],
                "workers_lost": totals["lost"],
                # Futures the pool found unresolved when it stopped (it failed them).
                "tasks_lost": tasks_lost,
            },
        )
