"""The planner: every price, admission and width decision of one pool (pure core).

The dispatcher (:mod:`gpupool._pool.dispatcher`) keeps the thread, the pipes,
the workers and the futures; it tells the planner what happened (``submit``,
``started``, ``ended``, ``observe``, ``out_of_memory``, ``lost``, ...) and asks it
before every start (``next_start``). The planner touches no process, pipe, future
or clock: the time is passed in (``now_s``, seconds since the pool was constructed)
and readings are values the dispatcher took. :class:`Planner` is that surface and
nothing else (``PLANNER_SURFACE`` in ``tests/test_layering.py``): it composes rooms
that each own their fields, and passes each event to the rooms it concerns::

    state     PlannerState   cards (each with its runs), tasks, pending, running,
                             the ceiling, the counts               (:mod:`~.base`)
    log       Recorder       records, card samples, the width timeline (:mod:`~.samples`)
    durations Durations      each key's task durations            (:mod:`~.base`)
    order     Order          the start order, the room held for the head (:mod:`~.order`)
    views     Views          every width (views of the one fit), strict mode's refusal
                                                                   (:mod:`~.views`)
    learning  Learning       what ended tasks' peaks teach the asks (:mod:`~.learning`)
    queue     Queue          tasks queued behind a run on its worker (:mod:`~.queued`)
    starts    Starts         the next start                        (:mod:`~.starts`)
    oom       OutOfMemory    an out-of-memory carried out, the caps (:mod:`~.out_of_memory`)

A room reads the rooms built before it and writes only its own fields (and, for the state, through
the state's methods). The rules on numbers are functions in modules of their own:
:mod:`~gpupool._core.planner.fit` (the one fit every width is a view of, and the live gate),
:mod:`~.sharing` (other pools on a card), the out-of-memory's judgement
(:func:`~.out_of_memory.judge`, beside the room that carries it out) and :mod:`~.records` (what each
record says); :mod:`~.state` and :mod:`~.verdicts` hold the records and the verdicts.

The invariant, checked at every start: on every device the booked asks of the tasks running there
plus the new one fit in ``room = total - co_tenant - own_high_water - reserve``, the count fits the
ceiling and any cap an out-of-memory set, and the live reading covers the new ask plus what the
running tasks have not reached yet plus the reserve. The only start past the bound is the serial
floor (nothing of the pool runs anywhere and no card has room for one task), logged as
``serial_start``. Explicit concurrency (``fixed_width``) is authoritative: it skips the memory terms
and says so.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpupool._core.bookings import OtherPools, TaskBooking
from gpupool._core.bound import Ceiling, WidthDecision
from gpupool._core.census import Census
from gpupool._core.events import Decision, EventName, JsonValue, TaskIdentity
from gpupool._core.peak import PeakReport
from gpupool._core.planner import records
from gpupool._core.planner.base import Durations, PlannerState
from gpupool._core.planner.fit import fit_counts
from gpupool._core.planner.learning import Learning
from gpupool._core.planner.order import Order
from gpupool._core.planner.out_of_memory import OutOfMemory
from gpupool._core.planner.queued import Queue
from gpupool._core.planner.samples import Recorder
from gpupool._core.planner.sharing import (
    note_freed,
    note_others,
    owes_room,
    share_tasks,
    yields_to,
)
from gpupool._core.planner.starts import Starts
from gpupool._core.planner.verdicts import (
    OWN_RECORD_STEP_BYTES,
    RETIRE_AFTER_SHUT_S,
    CardReading,
    Fail,
    PlannerConfig,
    Refuse,
    Retry,
    TaskId,
)
from gpupool._core.planner.views import Views
from gpupool._core.policy import Ask, AskTable
from gpupool._core.predict import Features
from gpupool._core.units import GiB, format_size

__all__ = ["Planner", "WhatIf", "what_if"]


class Planner:
    """Owns every price, admission and width decision of one pool: its events, verdicts and
    views (the process layer's whole surface), each passed to the rooms it concerns.

    Past the house's ~25 methods and ~15 fields on purpose: the surface is fixed (the module
    docstring); a member that is a room's own method is that method, bound here, and the rest are a
    few lines over the rooms. ``now_s`` (the time of construction) is taken for the callers' sake:
    nothing is recorded until :meth:`construct`.
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
        self.state = PlannerState(census=census, asks=asks, config=config)
        self.log = Recorder(self.state, emit)
        self.durations = Durations()
        self.order = Order(self.state, self.durations)
        self.views = Views(self.state, self.order, self.log)
        self.learning = Learning(self.state, self.views, self.log)
        self.queue = Queue(self.state, self.durations, self.order, self.views)
        self.starts = Starts(self.state, self.views, self.order)
        self.oom = OutOfMemory(self.state, self.views, self.log)
        # The surface that is a room's own method (or a room's live record), bound.
        self.requeue = self.queue.requeue
        self.queue_behind = self.queue.queue_behind
        self.settle = self.learning.settle
        self.flush_asks = self.learning.flush_asks
        self.next_start = self.starts.next_start
        self.still_admits = self.starts.still_admits
        self.take_grown = self.state.take_grown
        self.ask_of = self.state.ask_of
        self.counts = self.state.counts
        self.widths = self.log.widths
        self.sample_cards = self.log.sample_cards

    # -- events in ---------------------------------------------------------------------------

    def construct(
        self, now_s: float, *, note: str = "", extra: Mapping[str, JsonValue] | None = None
    ) -> Refuse | None:
        """The first width of every card, decided and recorded (:meth:`~.views.Views.construct`),
        and the first ask as recorded."""
        refusal = self.views.construct(now_s, note=note, extra=extra)
        if self.state.cards:
            self.learning.recorded("", self.state.asks.ask(""))
        return refusal

    def submit(
        self,
        task: TaskId,
        key: str,
        hint_bytes: int | None = None,
        size: float | None = None,
        identity: TaskIdentity | None = None,
        features: Features = (),
    ) -> None:
        """A task was submitted (it is pending, at the back of the queue). ``size``: the size
        of its input, and ``features``: what its call's arguments say, from which its ask may
        be predicted (:meth:`AskTable.ask_for`); ``identity``: which task it is, on every
        record about it."""
        self.state.asks.priced(key)  # statistics().asks lists it, estimated or not
        if hint_bytes is not None:
            self.state.asks.hint(key, hint_bytes)  # the width prices it at once
            self.state.rebook(key)
        self.state.add(task, key, size, identity, features)
        self.views.submitted()

    def remember(self, key: str, peak_bytes: int, now_s: float) -> None:
        """An earlier run measured ``key`` at ``peak_bytes`` on these cards' model: the key is
        estimated from it until this run measures it (:meth:`AskTable.remember`)."""
        before = self.state.asks.ask(key)
        after = self.state.asks.remember(key, peak_bytes)
        if after.ask_bytes == before.ask_bytes:
            return
        self.state.rebook(key)
        self.views.note(
            "bound_changed",
            None,
            after,
            f"{key}: an earlier run on these cards measured {format_size(peak_bytes)}; "
            f"estimated at {format_size(after.ask_bytes)} until this run measures it "
            f"(was {before.describe()})",
            now_s,
            extra={"remembered_peak_bytes": peak_bytes},
        )

    def withdraw(self, task: TaskId) -> None:
        """A pending task left the queue (cancelled, or failed by the pool)."""
        self.starts.take_issued(task)
        self.queue.drop(task)
        if task in self.state.tasks and task not in self.state.running:
            self.state.unqueue(task)
            self.state.forget(task)

    def observe(self, device: int, reading: CardReading, now_s: float) -> None:
        """A live snapshot of ``device``: the live gate reads it, the parent's own row raises
        the own high-water (a term of the bound: recorded when it grows), and a cap an
        out-of-memory set lifts once the readings show its room back."""
        card = self.state.cards[device]
        card.reading = reading
        card.reading_s = now_s
        card.reading_error = None
        own, pid = None, self.state.config.parent_pid
        if reading.process_bytes is not None:
            card.keep_workers(reading.process_bytes)
            own = reading.process_bytes.get(pid) if pid is not None else None
        if own is not None and own > card.own_high_water_bytes:
            card.own_high_water_bytes = own
            self.learning.limit_asks()
            if own - card.recorded_own_bytes >= OWN_RECORD_STEP_BYTES:
                card.recorded_own_bytes = own
                self.views.review(
                    now_s,
                    cause=(
                        f"this process's own device bytes grew to {format_size(own)} "
                        "(a term of the bound)"
                    ),
                    devices=(device,),
                )
        self.oom.lift_cap(card, reading, now_s)

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
        card = self.state.cards[device]
        if rows is None:
            rows = {}
            if card.reading is not None and card.reading.process_bytes is not None:
                rows = card.reading.process_bytes
        before = card.others_bytes
        terms = note_others(card, others, rows, now_s, census=census)
        if census:
            self.learning.rooms_moved()
            return
        if card.others_bytes != before:
            self.views.review(
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
        card = self.state.cards[device]
        card.reading = None
        card.reading_error = error
        self.views.sensor_error(device, error, "the live gate runs one task at a time", now_s)

    def started(self, task: TaskId, device: int | None, pid: int | None, now_s: float) -> None:
        """``task`` was handed to a worker (``pid``) on ``device``: it books there what the
        :class:`Start` that admitted it carried."""
        self.state.unqueue(task)
        self.state.begin(task, device, pid, now_s, self.starts.take_issued(task))

    def run_queued(self, task: TaskId, device: int | None, pid: int | None, now_s: float) -> None:
        """The run ``task`` was queued behind has ended (and been told): ``task`` runs now on
        that worker, in the booking the run left (:meth:`~.queued.Queue.run_queued`)."""
        self.queue.run_queued(task)
        # Off the pending queue since it was queued.
        self.state.begin(task, device, pid, now_s, self.starts.take_issued(task))

    def finished(
        self, task: TaskId, report: PeakReport | None, now_s: float, *, failed: bool = False
    ) -> Refuse | None:
        """``task`` ended with a result or an ordinary error; learn from its peak report at
        once (:meth:`ended`, then :meth:`settle`). Returns strict mode's refusal where what it
        taught narrows the pool below ``max_workers``."""
        self.ended(task, report, now_s, failed=failed)
        return self.settle(now_s)

    def ended(
        self, task: TaskId, report: PeakReport | None, now_s: float, *, failed: bool = False
    ) -> None:
        """``task`` ended with a result or an ordinary error: its booking is released, its run
        time timed (unless it ``failed``), and its peak kept, a sample of its key's peaks from
        the next :meth:`settle` (:meth:`~.learning.Learning.learn`)."""
        run = self.state.end_run(task)
        self.state.forget(task)
        self.queue.drop(task)
        if run is None:
            return
        if run.device is not None:
            note_freed(self.state.cards[run.device], run, now_s)
        self.state.rebook(run.key)
        if not failed:
            self.durations.timed(run.key, max(0.0, now_s - run.started_s))
        if report is not None:
            self.learning.learn(run, report, now_s, failed=failed)

    def out_of_memory(
        self,
        task: TaskId,
        report: PeakReport,
        reading: CardReading | None,
        now_s: float,
        *,
        error: str,
    ) -> Retry | Fail:
        """``task`` ran its card out of memory (:meth:`~.out_of_memory.OutOfMemory.handle`),
        judged against the asks every measurement before it priced."""
        self.settle(now_s)
        device = self.state.running[task].device
        if device is not None and reading is not None:
            # The reading the record states (the own high-water is observed after it).
            card = self.state.cards[device]
            card.reading, card.reading_s = reading, now_s
        return self.oom.handle(task, report, reading, now_s, error=error)

    def lost(
        self,
        task: TaskId,
        now_s: float,
        *,
        message: str,
        extra: Mapping[str, JsonValue],
        event: EventName = "worker_lost",
    ) -> None:
        """``task``'s worker died (``event``: or the pool ended it, ``task_timeout``): the task
        failed; its booking is released."""
        run = self.state.end_run(task)
        state = self.state.forget(task)
        if run is not None:
            self.state.rebook(run.key)
        key = run.key if run else state.key if state else self.state.last_key
        self.state.count("lost")
        ask, device = self.state.asks.ask(key), run.device if run else None
        identity = run.identity if run else state.identity if state else None
        self.views.note(event, device, ask, message, now_s, extra=extra, task=identity)

    def not_run(
        self, task: TaskId, now_s: float, *, message: str, extra: Mapping[str, JsonValue]
    ) -> None:
        """``task`` was handed to a worker that could not set it up (a task before it used up
        the worker's descriptors or memory): it never ran, so its booking is released and it
        goes back to the head of the queue, for a fresh worker (not a retry)."""
        run = self.state.end_run(task)
        if run is None:
            return
        if run.device is not None:
            note_freed(self.state.cards[run.device], run, now_s)
        self.state.rebook(run.key)
        self.state.put_back(task)
        ask = self.state.asks.ask(run.key)
        self.views.note(
            "worker_replaced", run.device, ask, message, now_s, extra=extra, task=run.identity
        )

    # -- verdicts out ------------------------------------------------------------------------

    def strict_refusal(self) -> Refuse | None:
        """Strict mode's refusal to narrow, once made (the pool breaks with it)."""
        return self.views.refused

    def shutdown_record(
        self,
        now_s: float,
        counts: Mapping[str, int],
        *,
        tasks_lost: int,
        refused: str | None = None,
    ) -> Decision:
        """The run's totals, as the last record (``refused``: the error that refused the pool
        as it was built)."""
        totals = collections.Counter(self.state.counts)
        totals.update(counts)
        return records.shutdown(
            now_s, self.views.width, totals, tasks_lost=tasks_lost, refused=refused
        )

    # -- views out (never the state itself) --------------------------------------------------

    @property
    def width(self) -> int:
        """How many tasks the planner admits at once now, for the work it holds."""
        return self.views.width

    @property
    def unsettled(self) -> bool:
        """Whether tasks ended whose peaks :meth:`settle` has not priced yet."""
        return self.learning.unsettled

    def widths_by_key(self) -> dict[str, int]:
        """For each key with work pending or running: how many of its tasks could run at once
        beside the other keys' running tasks."""
        fixed = self.state.config.fixed_width
        if fixed is not None or not self.state.cards:
            width = fixed if fixed is not None else self.state.ceiling.value
            return dict.fromkeys(self.state.present_keys(), width)
        out: dict[str, int] = {}
        running_keys = collections.Counter(run.key for run in self.state.running.values())
        for key in self.state.present_keys():
            ask = self.state.asks.ask(key)
            others = len(self.state.running) - running_keys[key]
            total = 0
            for card in self.state.cards:
                # Beside the other keys' runs there, read off the card's running sums.
                same = card.same_key(key)
                alone = fit_counts(
                    card,
                    ask,
                    running=len(card.runs) - same,
                    booked_bytes=card.booked_bytes - card.runs_booked_by_key[key],
                    same=0,
                    reserve_bytes=self.state.config.reserve_bytes,
                    ceiling=self.state.ceiling,
                    slots=self.state.ceiling.value,
                )
                total += max(same, alone.more)
            out[key] = max(1, min(total, self.state.ceiling.value - others))
        return out

    def warm_limit(self, device: int, now_s: float) -> int:
        """How many workers ``device`` may keep (running and idle): its runs, as many tasks
        of a present key as fit there alone, or, while other pools wait there, as many as
        this pool's share holds (the room a pool's ended task frees goes round the pools
        by turns: ``sharing.gives_way``), whichever is more."""
        card = self.state.cards[device]
        running = len(card.runs)
        room = self.views.bound(device, self.state.asks.ask(self.state.last_key)).room_bytes
        if (
            (
                card.gate_shut_since_s is not None
                and now_s - card.gate_shut_since_s >= RETIRE_AFTER_SHUT_S
            )
            or owes_room(card, room)
            or yields_to(card, 0, room, now_s) is not None
        ):
            # An idle worker's context is bytes the card needs: this pool's gate has been
            # shut a while, or a waiting pool is owed room there that is not free (or this
            # pool yields to one at the serial floor there).
            return running
        keys = self.state.present_keys() or [self.state.last_key]
        fits = max(
            self.views.fit(device, self.state.asks.ask(k), [], slots=self.state.ceiling.value).more
            for k in keys
        )
        turns = share_tasks(card, room, self.state.asks.ask(self.state.last_key).ask_bytes)
        return max(running, min(max(1, fits, turns), self.state.ceiling.value))

    def waiting_count(self, *, starting: bool = False) -> int:
        """How many pending tasks the pool's own ceiling (or fixed width) would let start now:
        what other pools on its cards are told waits for room. ``starting``: one pending
        task is being started (it counts as running)."""
        pending = len(self.state.pending) - starting
        running = len(self.state.running) + starting
        count = min(pending, self.state.ceiling.value - running)
        if self.state.cards and all(card.oom_cap is not None for card in self.state.cards):
            # Every card runs at most its out-of-memory cap: no more can start than those.
            free = sum(max(0, (card.oom_cap or 0) - len(card.runs)) for card in self.state.cards)
            count = min(count, free - starting)
        return max(0, count)

    def need_bytes(self, *, starting: bool = False) -> int:
        """The ask of the first pending task that waits for room (0 when none does): the room
        other pools are told this pool needs for its next task."""
        if self.waiting_count(starting=starting) == 0 or len(self.state.pending) <= starting:
            return 0
        state = self.state.tasks[self.state.pending[int(starting)]]
        return self.state.price(state).ask_bytes

    def waiting_for_room(self) -> tuple[TaskId, ...]:
        """Pending tasks that ran out of memory alone and wait for others to free the room."""
        tasks = self.state.tasks
        return tuple(t for t in self.state.pending if tasks[t].room_wait_until_s is not None)

    def pending_tasks(self) -> tuple[TaskId, ...]:
        """The pending tasks, in the order they will be considered."""
        return tuple(self.state.pending)

    def has_pending(self) -> bool:
        """Whether any task waits to start (queued behind a run or not)."""
        return bool(self.state.pending)

    def may_start(self) -> bool:
        """Whether fewer tasks run than the ceiling (else the verdict is to wait, and a
        reading of the cards would gate nothing)."""
        return len(self.state.running) < self.state.ceiling.value

    def is_queued(self, task: TaskId) -> bool:
        """Whether ``task`` waits behind a run on that run's worker."""
        return task in self.queue.queued

    def waiting_asks(self, first: int, count: int) -> list[tuple[str, int]]:
        """The key and ask of the pending tasks ``first`` to ``first + count``, in order."""
        tasks = self.state.tasks
        # One price per key, size, features and floor.
        asks: dict[tuple[str, float | None, Features, int], int] = {}
        entries: list[tuple[str, int]] = []
        for task in itertools.islice(self.state.pending, first, first + count):
            state = tasks[task]
            slot = (state.key, state.size, state.features, state.floor_bytes)
            if slot not in asks:
                asks[slot] = self.state.price(state).ask_bytes
            entries.append((slot[0], asks[slot]))
        return entries

    def bookings_on(self, device: int) -> tuple[TaskBooking, ...]:
        """This pool's running tasks on ``device`` that have a worker, as booking-table rows
        (what each reached is not the planner's to know: 0)."""
        return tuple(
            TaskBooking(
                worker_pid=run.pid, key=run.key, booked_bytes=run.booked_bytes, reached_bytes=0
            )
            for run in self.state.running.values()
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


@dataclass(frozen=True, slots=True, kw_only=True)
class WhatIf:
    """The planner's answer for one ask: every card's decision and the ceiling."""

    decisions: tuple[WidthDecision, ...]
    ceiling: Ceiling

    @property
    def width(self) -> int:
        """The pool's width: its cards' widths together, or the ceiling without a card."""
        return sum(d.width for d in self.decisions) if self.decisions else self.ceiling.value


def what_if(census: Census, asks: AskTable, config: PlannerConfig, ask: Ask | None) -> WhatIf:
    """What a pool on ``census`` with ``config`` decides for tasks priced at ``ask`` (``None``:
    no price given, only the ceiling), before any of its tasks runs: ``gpupool plan`` prices
    nothing itself, it asks a planner built as a pool's would be, so the two cannot disagree
    (the planner's records of it are not kept)."""
    planner = Planner(census=census, asks=asks, config=config, emit=lambda _record: None)
    decisions = planner.views.decide(ask) if ask is not None and census.cards else ()
    return WhatIf(decisions=decisions, ceiling=planner.state.ceiling)
