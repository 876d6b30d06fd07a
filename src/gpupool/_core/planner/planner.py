"""The planner: every price, admission and width decision of one pool (pure core).

The dispatcher (:mod:`gpupool._pool.dispatcher`) keeps the thread, the pipes,
the workers and the futures; it tells the planner what happened (``submit``,
``started``, ``ended``, ``out_of_memory``, ``lost``, ...) and asks it before every
start (``next_start``). The planner touches no process, pipe, future
or clock: the time is passed in (``now_s``, seconds since the pool was constructed)
and readings are values the dispatcher took. :class:`Planner` is that surface and
nothing else (``PLANNER_SURFACE`` in ``tests/test_layering.py``): it composes rooms
that each own their fields, and passes each event to the rooms it concerns. Two of
them are asked directly, each by its own client, through the surface each lists
(``ROOM_SURFACES`` there): the card reader tells ``readings`` what it read, and the
booking link tells ``neighbours`` what the other pools book and asks what to tell them::

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
    readings  Readings       each card's live reading, or why it failed (:mod:`~.readings`)
    neighbours Neighbours    the other pools' bookings in, this pool's bookings and waits
                             out, the warm limit                  (:mod:`~.neighbours`)

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpupool._core.bound import Ceiling, WidthDecision
from gpupool._core.census import Census
from gpupool._core.events import Decision, EventName, JsonValue, TaskIdentity
from gpupool._core.peak import PeakReport
from gpupool._core.planner import records
from gpupool._core.planner.base import Durations, PlannerState
from gpupool._core.planner.fit import fit_counts
from gpupool._core.planner.learning import Learning
from gpupool._core.planner.neighbours import Neighbours
from gpupool._core.planner.order import Order
from gpupool._core.planner.out_of_memory import OutOfMemory
from gpupool._core.planner.queued import Queue
from gpupool._core.planner.readings import Readings
from gpupool._core.planner.samples import Recorder
from gpupool._core.planner.sharing import note_freed
from gpupool._core.planner.starts import Starts
from gpupool._core.planner.verdicts import (
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

    A member that is a room's own method is that method, bound here, and the rest are a few lines
    over the rooms; what the card reader and the booking link ask, they ask of :attr:`readings`
    and :attr:`neighbours` (the module docstring). ``now_s`` (the time of construction) is taken
    for the callers' sake: nothing is recorded until :meth:`construct`.
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
        self.readings = Readings(self.state, self.views, self.learning, self.oom, self.log)
        self.neighbours = Neighbours(self.state, self.views, self.learning)
        # The surface that is a room's own method, bound.
        self.requeue = self.queue.requeue
        self.queue_behind = self.queue.queue_behind
        self.settle = self.learning.settle
        self.flush_asks = self.learning.flush_asks
        self.next_start = self.starts.next_start
        self.still_admits = self.starts.still_admits
        self.take_grown = self.state.take_grown
        self.ask_of = self.state.ask_of

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
            self.readings.took(device, reading, now_s)
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

    @property
    def counts(self) -> collections.Counter[str]:
        """How many of each counted event the planner saw (the state's live count)."""
        return self.state.counts

    @property
    def widths(self) -> list[tuple[float, int]]:
        """The pool's width over time, where it moved (the recorder's live timeline)."""
        return self.log.widths

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
                    booked_bytes=card.sums.booked_bytes - card.sums.runs_booked_by_key[key],
                    same=0,
                    reserve_bytes=self.state.config.reserve_bytes,
                    ceiling=self.state.ceiling,
                    slots=self.state.ceiling.value,
                )
                total += max(same, alone.more)
            out[key] = max(1, min(total, self.state.ceiling.value - others))
        return out

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
