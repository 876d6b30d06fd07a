"""The planner as a state machine: the bound holds at every start, whatever the events.

A hypothesis ``RuleBasedStateMachine`` drives random sequences of submits,
starts, peak reports above and below the ask, out-of-memory errors, growth
of this process and of co-tenants, finishes, lost workers and time steps,
and checks the planner's invariants after every step.
"""

from __future__ import annotations

import collections
import dataclasses

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from test_fit_memo import walked_fit

from gpupool._core.events import Decision, TaskIdentity
from gpupool._core.peak import PeakReport
from gpupool._core.planner import (
    GATE_RECORD_INTERVAL_S,
    QUEUE_DEPTH,
    RETIRE_AFTER_SHUT_S,
    CardReading,
    Fail,
    Planner,
    PlannerConfig,
    Refuse,
    Retry,
    Start,
    Wait,
    Warm,
    Workers,
)
from gpupool._core.planner.fit import _card_bound, card_bound, card_widths
from gpupool._core.planner.state import Run
from gpupool._core.policy import AskTable, Policy
from gpupool._core.units import GiB, MiB
from support import card_census, census_of, start_all

KEYS = ("small", "large", "medium")
PARENT = 1

#: Records whose width is the fit's at that moment (the rest state a count: an
#: out-of-memory's running tasks, a fixed width, the shutdown).
FIT_EVENTS = frozenset(
    {
        "constructed",
        "narrowed",
        "widened",
        "widen_refused",
        "bound_changed",
        "measured",
        "live_gate_wait",
        "share_wait",
        "critical_wait",
        "head_wait",
        "cap_lifted",
        "serial_start",
        "worker_lost",
        "worker_replaced",
        "sensor_error",
    }
)


class PlannerMachine(RuleBasedStateMachine):
    """Random event streams against one planner; invariants checked after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Decision] = []
        self.now_s = 0.0
        self.next_task = 0
        self.next_pid = 1000
        self.submitted = 0
        self.keys_submitted: set[str] = set()
        self.settled = 0
        self.pre_oom_ask: dict[str, int] = {}
        self.live_used: dict[int, int] = {}
        # Cold workers: each start needs a ready idle worker on its card; a worker boots
        # (a Warm verdict) and reports ready in a later step, while the card may change.
        self.cold = False
        self.ready: dict[int | None, int] = {}
        self.booting: dict[int | None, int] = {}
        self.worker_of: dict[int, int | None] = {}
        self.records_checked = 0
        # Tasks queued behind a run on its worker (queued task -> run).
        self.queued_on: dict[int, int] = {}
        # By key: the largest partial view (a peak flagged incomplete) and whether a whole
        # measurement was ever taken.
        self.partial_peak: dict[str, int] = {}
        self.whole_keys: set[str] = set()
        # How tasks peak (finish; build draws it): spread around their booking.
        self.peaks = "spread"

    @initialize(
        totals=st.lists(st.integers(20, 80), min_size=1, max_size=3),
        co_tenant_gib=st.integers(0, 10),
        estimate_gib=st.integers(1, 12),
        max_workers=st.integers(1, 8),
        fixed=st.booleans(),
        learned=st.booleans(),
        cold=st.booleans(),
        strict=st.booleans(),
        outliers=st.booleans(),
        peaks=st.sampled_from(["spread", "linear", "rare", "linear_rare"]),
    )
    def build(
        self,
        totals: list[int],
        co_tenant_gib: int,
        estimate_gib: int,
        max_workers: int,
        fixed: bool,
        learned: bool,
        cold: bool,
        strict: bool,
        outliers: bool,
        peaks: str,
    ) -> None:
        # How tasks peak (finish): spread around their booking; 1 GiB + 2 GiB per item of a
        # list argument (a feature to find); or at their booking but for a rare 5x outlier;
        # or on the line, but for a rare 3x outlier of it (a feature-priced key's outliers).
        self.peaks = peaks
        self.cold = cold
        cards = [
            card_census(
                device=i, total_bytes=t * GiB, free_bytes=(t - co_tenant_gib) * GiB, own_bytes=0
            )
            for i, t in enumerate(totals)
        ]
        self.census = census_of(cards, cpus=4, available_ram_bytes=64 * GiB)
        self.asks = AskTable(
            policy=Policy(reserve_bytes=256 * MiB, learned=learned, outliers=outliers),
            default_estimate_bytes=estimate_gib * GiB,
        )
        self.config = PlannerConfig(
            max_workers=max_workers,
            fixed_width=max_workers if fixed else None,
            reserve_bytes=256 * MiB,
            parent_pid=PARENT,
            room_wait_s=30.0,
            max_retries=3,
            strict=strict and not fixed,
        )
        self.planner = Planner(
            census=self.census, asks=self.asks, config=self.config, emit=self.emitted
        )
        self.planner.construct(0.0)
        self.live_used = {
            i: (t - (t - co_tenant_gib)) * GiB for i, t in enumerate(totals)
        }  # co-tenant bytes
        self.own_bytes = {i: 0 for i in range(len(totals))}

    # -- helpers --------------------------------------------------------------------------

    def emitted(self, record: Decision) -> None:
        """Every record, checked as it is written: the width it states is what the fit
        admits at that moment, and never fewer than the tasks running on its card."""
        self.records.append(record)
        if record.device is None or record.event not in FIT_EVENTS:
            return
        if self.config.fixed_width is not None:
            return
        ask = record.key_ask if record.key_ask is not None else self.asks.ask("")
        fit = self.planner.views.decide(ask)[record.device]
        assert record.width_after == fit.width, record.to_dict()
        runs = sum(1 for r in self.planner.state.running.values() if r.device == record.device)
        assert fit.width >= runs
        self.records_checked += 1

    def workers(self) -> Workers | None:
        return Workers(ready=dict(self.ready), booting=dict(self.booting)) if self.cold else None

    def reading(self, device: int) -> CardReading:
        card = self.census.cards[device]
        assert card.total_bytes is not None
        running = {
            r.pid: min(r.booked_bytes, r.booked_bytes // 2)
            for r in self.planner.state.running.values()
            if r.device == device and r.pid is not None
        }
        used = self.live_used[device] + self.own_bytes[device] + sum(running.values())
        rows = dict(running)
        rows[PARENT] = self.own_bytes[device]
        return CardReading(
            free_bytes=max(0, card.total_bytes - used), used_bytes=used, process_bytes=rows
        )

    def running_ids(self) -> list[int]:
        return sorted(self.planner.state.running)

    # -- rules ----------------------------------------------------------------------------

    @rule(
        key=st.sampled_from(KEYS),
        hint_gib=st.none() | st.integers(1, 30),
        items=st.none() | st.integers(1, 6),
    )
    def submit(self, key: str, hint_gib: int | None, items: int | None) -> None:
        """A task is submitted, its call's first argument a list of ``items`` (or none)."""
        features = () if items is None else (("arg0.len", float(items)),)
        identity = TaskIdentity(task_id=self.next_task, entry=self.next_task, label=key)
        self.planner.submit(
            self.next_task,
            key,
            None if hint_gib is None else hint_gib * GiB,
            identity=identity,
            features=features,
        )
        self.next_task += 1
        self.submitted += 1
        self.keys_submitted.add(key)

    @rule(
        data=st.data(),
        key=st.sampled_from(KEYS),
        items=st.integers(1, 6),
        rare=st.integers(0, 7),
    )
    def turn(self, data: st.DataObject, key: str, items: int, rare: int) -> None:
        """One task submitted, a start tried, and one running task ended (settled at once):
        enough measured tasks for a key's features to be found and its outliers seen."""
        self.submit(key, None, items)
        self.start()
        if self.planner.state.running:
            self.finish(data, 1.0, 500, True, False, rare)

    @precondition(lambda self: self.peaks in ("rare", "linear_rare"))
    @rule(
        data=st.data(),
        key=st.sampled_from(KEYS),
        items=st.lists(st.integers(1, 6), min_size=6, max_size=10),
        odd=st.integers(5, 9),
        then=st.lists(st.integers(1, 6), max_size=8),
    )
    def measured_run(
        self, data: st.DataObject, key: str, items: list[int], odd: int, then: list[int]
    ) -> None:
        """A run of turns of one key, the ``odd``-th an outlier (where there is one): a key
        measured past the outlier rule's first peaks, with one kept apart; then tasks of it
        submitted and started together (``then``: their lists' lengths), priced with a
        reserve for outliers at the rate measured."""
        for i, count in enumerate(items):
            self.turn(data, key, count, 0 if i == odd else 1)
        for count in then:
            self.submit(key, None, count)
            self.start()

    @rule()
    def start(self) -> None:
        for index in range(len(self.census.cards)):
            self.planner.readings.observe(index, self.reading(index), self.now_s)
        before = len(self.records)
        verdict = self.planner.next_start(self.now_s, self.workers())
        if verdict is None:
            assert not self.planner.state.pending
            return
        if isinstance(verdict, Wait):
            return
        if isinstance(verdict, Refuse):
            assert self.config.strict
            assert verdict.decision.width_after is not None
            assert verdict.decision.width_after < self.config.max_workers
            return
        if isinstance(verdict, Warm):
            # A worker is started where the task fits now; nothing is started yet.
            assert self.cold
            assert verdict.task in self.planner.state.pending
            assert self.ready.get(verdict.device, 0) == 0
            self.booting[verdict.device] = self.booting.get(verdict.device, 0) + 1
            assert sum(self.booting.values()) <= len(self.planner.state.pending)
            return
        if isinstance(verdict, Fail):
            assert verdict.kind == "room_wait_expired"
            assert verdict.task not in self.planner.state.pending
            self.settled += 1
            return
        assert isinstance(verdict, Start)
        task = verdict.task
        assert task in self.planner.state.pending
        if verdict.past_bound:
            # The only start past the bound: the logged serial floor, with nothing running.
            assert not self.planner.state.running
            assert any(r.event == "serial_start" for r in self.records[before:])
        elif self.config.fixed_width is not None:
            assert len(self.planner.state.running) < self.config.fixed_width
        else:
            device = verdict.device
            assert device is not None
            ask = self.planner.ask_of(task)
            busy = [r for r in self.planner.state.running.values() if r.device == device]
            bound = self.planner.views.bound(device, ask)
            mine = [r for r in busy if r.key == ask.key]
            booking = ask.next_bytes(len(mine), sum(1 for r in mine if not r.solo))
            # Its ask, or its step of its key's price together, and one outlier's extra where
            # the key's rate expects one more among its tasks there with this one.
            assert verdict.booked_bytes == booking <= max(ask.ask_bytes, ask.outlier_bytes)
            # DESIGN, "The bound": a task starts only while what the tasks there book plus
            # its own booking (each beside its child's RSS on unified memory) fits the room;
            # an unreadable card runs one task at a time.
            if bound.room_bytes is None:
                assert not busy
            else:
                host = bound.host_per_task_bytes
                booked = sum(r.booked_bytes + host for r in busy)
                assert booked + booking + host <= bound.room_bytes
            assert len(self.planner.state.running) < self.planner.state.ceiling.value
            cap = self.planner.state.cards[device].cap.oom_cap
            assert cap is None or len(busy) < cap
            reading = self.reading(device)
            rows = reading.process_bytes or {}
            unreached = sum(max(0, r.booked_bytes - rows.get(r.pid or -1, 0)) for r in busy)
            assert reading.free_bytes >= booking + unreached + self.config.reserve_bytes
        if self.cold:
            # Admitted only where a ready worker is idle: when the task runs, not at hand-off.
            assert self.ready.get(verdict.device, 0) > 0
            self.ready[verdict.device] -= 1
        self.worker_of[task] = verdict.device
        self.planner.started(task, verdict.device, self.next_pid, self.now_s)
        self.next_pid += 1

    @precondition(lambda self: self.cold and any(self.booting.values()))
    @rule(data=st.data())
    def worker_ready(self, data: st.DataObject) -> None:
        device = data.draw(st.sampled_from([d for d, n in self.booting.items() if n]))
        self.booting[device] -= 1
        self.ready[device] = self.ready.get(device, 0) + 1

    def worker_idle(self, task: int) -> None:
        """``task`` ended and its worker is idle again (and ready)."""
        device = self.worker_of.pop(task, None)
        if self.cold:
            self.ready[device] = self.ready.get(device, 0) + 1

    @rule()
    def read_statistics(self) -> None:
        """What statistics read (the width, the widths by key, the warm limits) changes
        nothing the planner decides from."""
        planner = self.planner
        before = (
            tuple(planner.state.pending),
            tuple(sorted(planner.state.running)),
            {k: self.asks.ask(k).ask_bytes for k in self.asks.keys()},  # noqa: SIM118
            [c.width for c in planner.state.cards],
            planner.width,
        )
        by_key = planner.widths_by_key()
        limits = [
            planner.neighbours.warm_limit(i, self.now_s) for i in range(len(planner.state.cards))
        ]
        after = (
            tuple(planner.state.pending),
            tuple(sorted(planner.state.running)),
            {k: self.asks.ask(k).ask_bytes for k in self.asks.keys()},  # noqa: SIM118
            [c.width for c in planner.state.cards],
            planner.width,
        )
        assert before == after
        assert all(1 <= width <= planner.state.ceiling.value for width in by_key.values())
        assert all(
            limit >= sum(1 for r in planner.state.running.values() if r.device == i)
            for i, limit in enumerate(limits)
        )

    @precondition(lambda self: self.planner.state.running)
    @rule(
        data=st.data(),
        factor=st.floats(0.3, 1.4),
        rss_mib=st.integers(100, 4000),
        settle=st.booleans(),
        partial=st.booleans(),
        rare=st.integers(0, 7),
    )
    def finish(
        self,
        data: st.DataObject,
        factor: float,
        rss_mib: int,
        settle: bool,
        partial: bool,
        rare: int,
    ) -> None:
        """A task ends; its peak is priced at once, or (as the dispatcher does, once per turn)
        at a later :meth:`settle`, other events coming between. A ``partial`` one could not
        read its descendants' bytes (rows hidden): its peak is flagged incomplete."""
        task = data.draw(st.sampled_from(self.running_ids()))
        run = self.planner.state.running[task]
        peak: int | None = int(run.booked_at_start_bytes * factor)
        if self.peaks in ("linear", "linear_rare") and run.features:
            peak = GiB + 2 * GiB * int(run.features[0][1])
            if self.peaks == "linear_rare" and rare == 0:
                peak *= 3
        elif self.peaks == "rare":
            peak = 3 * GiB * (5 if rare == 0 else 1)
        if run.device is None:
            peak = None
        report = PeakReport(
            device=run.device,
            device_peak_bytes=peak,
            device_source="nvml-sampled" if partial else "simulator",
            rss_peak_bytes=rss_mib * MiB,
            incomplete_reason="rows hidden" if partial else None,
        )
        if peak is not None and partial:
            self.partial_peak[run.key] = max(self.partial_peak.get(run.key, 0), peak)
        elif peak is not None:
            self.whole_keys.add(run.key)
        if settle:
            self.planner.finished(task, report, self.now_s)
        else:
            self.planner.ended(task, report, self.now_s)
        self.settled += 1
        self.run_queued_after(task, run)

    @precondition(lambda self: self.planner.learning.learned())
    @rule()
    def settle(self) -> None:
        """What the tasks that ended since measured is priced: each key's ask takes every
        peak kept for it (in its distribution, or apart as an outlier: outliers that join
        the distribution once they are not rare leave the count as it was)."""

        def measured(key: str) -> int:
            ask = self.asks.ask(key)
            return ask.samples + ask.outliers

        samples = {key: measured(key) for key in self.planner.learning.learned()}
        kept = {key: len(learned.peaks) for key, learned in self.planner.learning.learned().items()}
        self.planner.settle(self.now_s)
        assert not self.planner.learning.learned()
        for key, count in kept.items():
            if self.asks.ask(key).basis == "measured":
                assert measured(key) == samples[key] + count

    @precondition(lambda self: self.planner.state.running)
    @rule(
        data=st.data(),
        reached=st.floats(0.0, 1.5),
        requested_mib=st.integers(0, 8000),
        fill=st.booleans(),
    )
    def out_of_memory(
        self, data: st.DataObject, reached: float, requested_mib: int, fill: bool
    ) -> None:
        task = data.draw(st.sampled_from(self.running_ids()))
        run = self.planner.state.running[task]
        key = run.key
        # An out-of-memory is judged after the peaks of the tasks that ended before it are
        # priced (the planner settles them first): the ask before it is the settled one.
        self.planner.settle(self.now_s)
        ask_before = self.asks.ask(key).ask_bytes
        self.pre_oom_ask[key] = max(self.pre_oom_ask.get(key, 0), ask_before)
        report = PeakReport(
            device=run.device,
            device_peak_bytes=int(run.booked_at_start_bytes * reached),
            device_source="simulator",
            oom=True,
            oom_requested_bytes=requested_mib * MiB,
        )
        reading = None
        if run.device is not None:
            reading = self.reading(run.device)
            if fill:
                reading = CardReading(
                    free_bytes=0, used_bytes=reading.used_bytes, process_bytes=reading.process_bytes
                )
        caps_before = [c.cap.oom_cap for c in self.planner.state.cards]
        own_ask = run.ask_bytes
        verdict = self.planner.out_of_memory(task, report, reading, self.now_s, error="oom")
        lower = (report.device_peak_bytes or 0) + (report.oom_requested_bytes or 0)
        if lower > own_ask:
            # An underestimate (judged against the task's own ask when it started) raises
            # its key's ask and caps no card.
            assert [c.cap.oom_cap for c in self.planner.state.cards] == caps_before
        assert isinstance(verdict, (Retry, Fail))
        if isinstance(verdict, Retry):
            assert self.planner.state.pending[0] == task
        else:
            assert task not in self.planner.state.pending
            assert task not in self.planner.state.running
            self.settled += 1
        assert self.asks.ask(key).ask_bytes >= ask_before
        self.declined_after(task)

    @precondition(lambda self: self.planner.state.running)
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        task = data.draw(st.sampled_from(self.running_ids()))
        self.planner.lost(task, self.now_s, message="worker lost", extra={})
        self.worker_of.pop(task, None)  # its worker died: no idle worker comes back
        self.settled += 1
        self._requeued_in_order(task)

    @precondition(lambda self: self.planner.state.running)
    @rule(data=st.data())
    def not_set_up(self, data: st.DataObject) -> None:
        """A worker could not set up its task (a task before used up its descriptors): the
        task goes back to the head of the queue unrun, before what was queued behind it; the
        worker exits. The record names the task."""
        task = data.draw(st.sampled_from(self.running_ids()))
        behind = [q for q, run in self.queued_on.items() if run == task]
        self._requeued_in_order(task)  # the pool takes back what was queued behind it first
        before = len(self.records)
        self.planner.not_run(task, self.now_s, message="no descriptor left", extra={"pid": 1})
        assert task not in self.planner.state.running
        assert list(self.planner.state.pending)[: 1 + len(behind)] == [task, *behind]
        self.worker_of.pop(task, None)  # its worker exits: no idle worker comes back
        replaced = [r for r in self.records[before:] if r.event == "worker_replaced"]
        assert [r.task.task_id if r.task else None for r in replaced] == [task]
        event("a task handed back by a worker that could not set it up")

    @precondition(lambda self: self.planner.state.running)
    @rule(data=st.data())
    def queue_behind(self, data: st.DataObject) -> None:
        run_task = data.draw(st.sampled_from(self.running_ids()))
        run = self.planner.state.running[run_task]
        head = self.planner.state.pending[0] if self.planner.state.pending else None
        queued = self.planner.queue_behind(run_task)
        if queued is None:
            return
        # Only the queue's head, of the run's key, short, in the run's booking; counted apart.
        assert queued == head
        assert list(self.queued_on.values()).count(run_task) < self.planner.durations.queue_depth(
            run.key
        )
        assert self.planner.durations.queue_depth(run.key) <= QUEUE_DEPTH
        assert self.planner.state.tasks[queued].key == run.key
        assert self.planner.durations.short(run.key)
        assert run.device is None or self.asks.ask(run.key).ask_bytes <= run.booked_bytes
        assert queued not in self.planner.state.pending and queued not in self.planner.state.running
        self.queued_on[queued] = run_task
        event("a task queued behind a run")

    def declined_after(self, task: int) -> None:
        """``task`` ran out of memory: its worker declines what was queued behind it (booked
        before that was known), which goes back to the head of the queue; the worker idles."""
        self._requeued_in_order(task)
        self.worker_idle(task)

    def _requeued_in_order(self, task: int) -> None:
        """What was queued behind ``task`` never ran: back to the head of the queue, told in
        its queue order and kept in it."""
        behind = [q for q, run in self.queued_on.items() if run == task]
        for position, queued in enumerate(behind):
            del self.queued_on[queued]
            self.planner.requeue(queued)
            assert self.planner.state.pending[position] == queued
            assert queued not in self.planner.state.running

    def run_queued_after(self, task: int, run: Run) -> None:
        """``task`` (``run``) ended: what was queued behind it runs on its worker, in the
        booking it left, else the worker is idle."""
        queued = [q for q, behind in self.queued_on.items() if behind == task]
        if not queued:
            self.worker_idle(task)
            return
        next_task, *after = queued  # the first queued runs; the others follow it now
        del self.queued_on[next_task]
        for later in after:
            self.queued_on[later] = next_task
        device = self.worker_of.pop(task, None)
        self.worker_of[next_task] = device
        card = self.planner.state.cards[device] if device is not None else None
        self.planner.run_queued(next_task, device, run.pid, self.now_s)
        assert next_task in self.planner.state.running
        if card is not None and run.device is not None:
            runs = [r for r in card.runs.values() if r.key == run.key]
            # No start past the bound: the key's tasks there are booked together at its
            # price, as they were before the run ended (unless the price itself moved).
            assert sum(r.booked_bytes for r in runs) == self.key_bookings(run.key, runs)

    @precondition(lambda self: self.planner.state.pending)
    @rule(data=st.data())
    def withdraw(self, data: st.DataObject) -> None:
        task = data.draw(st.sampled_from(list(self.planner.state.pending)))
        self.planner.withdraw(task)
        self.settled += 1

    @rule(device=st.integers(0, 2), grow_gib=st.integers(-8, 12))
    def co_tenant(self, device: int, grow_gib: int) -> None:
        if device < len(self.census.cards):
            self.live_used[device] = max(0, self.live_used[device] + grow_gib * GiB)

    @rule(device=st.integers(0, 2), grow_mib=st.integers(0, 8000))
    def own_growth(self, device: int, grow_mib: int) -> None:
        if device < len(self.census.cards):
            self.own_bytes[device] += grow_mib * MiB
            self.planner.readings.observe(device, self.reading(device), self.now_s)

    @rule(step_s=st.floats(0.001, 20.0))
    def tick(self, step_s: float) -> None:
        self.now_s += step_s

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def no_task_is_lost(self) -> None:
        held = (
            len(self.planner.state.pending)
            + len(self.planner.state.running)
            + len(self.planner.queue.queued)
        )
        assert held + self.settled == self.submitted
        assert set(self.planner.state.pending).isdisjoint(self.planner.state.running)
        assert set(self.planner.queue.queued).isdisjoint(self.planner.state.pending)
        assert set(self.planner.queue.queued).isdisjoint(self.planner.state.running)
        assert set(self.planner.queue.queued.values()) <= set(self.planner.state.running)
        # What the next start reads instead of walking the queue: pending tasks per key.
        keys = collections.Counter(
            self.planner.state.tasks[t].key for t in self.planner.state.pending
        )
        assert keys == +self.planner.state.pending_by_key
        # What a start, a finish and a fit read instead of walking a card's runs.
        for card in self.planner.state.cards:
            assert card.sums.booked_bytes == sum(r.booked_bytes for r in card.runs.values())
            assert +card.sums.runs_by_key == collections.Counter(r.key for r in card.runs.values())

    @invariant()
    def the_surface_is_a_view_of_the_rooms(self) -> None:
        """What the process layer reads (the planner's views) says what the rooms hold, and
        the state's runs are the cards' runs."""
        if not hasattr(self, "planner"):
            return
        planner, state = self.planner, self.planner.state
        for card in state.cards:
            assert card.runs == {t: r for t, r in state.running.items() if r.device == card.index}
            assert [
                (b.worker_pid, b.key, b.booked_bytes)
                for b in planner.neighbours.bookings_on(card.index)
            ] == [(r.pid, r.key, r.booked_bytes) for r in card.runs.values() if r.pid is not None]
        assert planner.pending_tasks() == tuple(state.pending)
        assert planner.has_pending() == bool(state.pending)
        assert planner.may_start() == (len(state.running) < state.ceiling.value)
        assert all(planner.is_queued(t) for t in planner.queue.queued)
        assert not any(planner.is_queued(t) for t in state.pending)
        assert set(planner.waiting_for_room()) <= set(state.pending)
        assert [key for key, _ in planner.neighbours.waiting_asks(0, len(state.pending))] == [
            state.tasks[t].key for t in state.pending
        ]
        assert planner.counts is state.counts
        assert planner.strict_refusal() is planner.views.refused
        assert planner.unsettled == bool(planner.learning.learned())
        assert planner.widths is planner.log.widths

    @invariant()
    def the_memos_answer_as_a_fresh_computation(self) -> None:
        """What a card's memo serves (a bound, a fit), the decision shared out from its fits,
        and a key's price together are what the plain computation gives now."""
        if not hasattr(self, "planner"):
            return
        planner = self.planner
        terms = {"reserve_bytes": self.config.reserve_bytes, "ceiling": planner.state.ceiling}
        slots = planner.state.ceiling.value - len(planner.state.running)
        for key in {"", *self.asks.keys()}:
            ask = self.asks.ask(key)
            fresh = dataclasses.replace(ask)  # the same price, with no memo of its own
            fits = []
            for card in planner.state.cards:
                bound = _card_bound(card, fresh, **terms)
                assert card_bound(card, ask, **terms) == bound
                runs = list(card.runs.values())
                walked = walked_fit(card, fresh, runs, slots=slots, **terms)
                assert planner.views.fit(card.index, ask) == walked
                fits.append(walked)
            assert planner.views.decide(ask) == card_widths(fits, planner.state.ceiling)
            for count in range(planner.state.ceiling.value + 2):
                assert ask.together_bytes(count) == dataclasses.replace(ask).together_bytes(count)
        for card in planner.state.cards:
            by_key: collections.Counter[str] = collections.Counter()
            for run in card.runs.values():
                by_key[run.key] += run.booked_bytes
            assert +card.sums.runs_booked_by_key == +by_key

    @invariant()
    def no_partial_view_lowers_an_ask(self) -> None:
        """A peak flagged incomplete never prices its key below it, nor (before a whole
        measurement) below the key's estimate."""
        for key, peak in self.partial_peak.items():
            ask = self.asks.ask(key)
            assert ask.ask_bytes >= peak
            if key not in self.whole_keys:
                assert ask.ask_bytes >= ask.estimate_bytes

    @invariant()
    def no_ask_below_its_pre_oom_value(self) -> None:
        for key, before in self.pre_oom_ask.items():
            assert self.asks.ask(key).ask_bytes >= before

    @invariant()
    def a_keys_bookings_are_its_price_together(self) -> None:
        """On every card the running tasks of a key are booked, between them, at the key's
        price for those priced at its ask together (K x ask unless its peaks are pooled), the
        own asks of those priced on their own (a feature, an outlier's call, their own floor),
        and, however each is priced, the reserve for the outliers its measured rate expects
        among all of them: one outlier's extra (its price past the task's own) at each task,
        in the order they started, where the expected count steps up. Never more."""
        if not hasattr(self, "planner"):
            return
        for card in self.planner.state.cards:
            by_key: dict[str, list[Run]] = {}
            for run in card.runs.values():
                by_key.setdefault(run.key, []).append(run)
            for key, runs in by_key.items():
                assert sum(r.booked_bytes for r in runs) == self.key_bookings(key, runs)

    def key_bookings(self, key: str, runs: list[Run]) -> int:
        """What ``runs`` (all of ``key``'s on one card, in the order they started) book
        between them: the key's price together for those priced at its ask (without its
        reserve), the own asks of the others, and one outlier's extra over its own ask at
        each run where the count the key's rate expects steps up. Checks each run's terms."""
        ask = self.asks.ask(key)
        owns = [self.planner.state.price(run) for run in runs]
        together = sum(1 for own in owns if not own.individual)
        base = ask.together_bytes(together) - ask.outlier_reserve_bytes(together)
        solo_bytes = sum(own.ask_bytes for own in owns if own.individual)
        reserve = 0
        for i, (run, own) in enumerate(zip(runs, owns, strict=True)):
            assert run.solo == own.individual
            # Whatever prices it (a feature, an outlier's call, its own floor), it carries
            # its key's outlier rate: the fix for a feature-priced key's outliers.
            assert (own.outlier_rate, own.outlier_bytes) == (ask.outlier_rate, ask.outlier_bytes)
            steps = int((i + 1) * ask.outlier_rate + 0.5) - int(i * ask.outlier_rate + 0.5)
            extra = steps * max(0, ask.outlier_bytes - own.ask_bytes)
            reserve += extra
            assert run.booked_bytes <= own.ask_bytes + extra
        expected = int(len(runs) * ask.outlier_rate + 0.5)
        if expected and any(own.individual for own in owns):
            event("tasks priced on their own beside an outlier reserve of their key")
        # The reserve is for as many outliers as expected among all of them, at least the
        # least extra each.
        least = min((max(0, ask.outlier_bytes - own.ask_bytes) for own in owns), default=0)
        assert reserve >= expected * least
        return base + solo_bytes + reserve

    @invariant()
    def every_key_submitted_is_listed_with_its_price(self) -> None:
        """statistics().asks (the ask table's keys) lists every key submitted, estimated or
        measured, and never the construction's own "" key."""
        listed = set(self.asks.keys())
        assert self.keys_submitted <= listed
        assert "" not in listed

    @invariant()
    def the_width_is_honest(self) -> None:
        assert 1 <= self.planner.width <= self.planner.state.ceiling.value

    @invariant()
    def records_are_bounded(self) -> None:
        if not hasattr(self, "planner"):
            return
        gates = sum(1 for r in self.records if r.event == "live_gate_wait")
        cards = len(self.census.cards)
        assert gates <= cards * (self.now_s / GATE_RECORD_INTERVAL_S + 1)

    @invariant()
    def the_own_high_water_only_grows(self) -> None:
        for index, card in enumerate(self.planner.state.cards):
            assert card.live.own_high_water_bytes >= self.own_bytes[index]


PlannerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPlanner = PlannerMachine.TestCase


def _one_card_planner(records: list[Decision], *, total_gib: int = 16) -> Planner:
    census = census_of(
        [card_census(total_bytes=total_gib * GiB, free_bytes=total_gib * GiB)],
        cpus=8,
        available_ram_bytes=64 * GiB,
    )
    asks = AskTable(policy=Policy(reserve_bytes=0), default_estimate_bytes=3 * GiB)
    config = PlannerConfig(max_workers=4, reserve_bytes=0, parent_pid=PARENT)
    planner = Planner(census=census, asks=asks, config=config, emit=records.append)
    planner.construct(0.0)
    return planner


def test_the_reported_width_never_passes_an_out_of_memory_cap():
    """After an out-of-memory capped a card at 2, a smaller measured ask reports no wider."""
    records: list[Decision] = []
    planner = _one_card_planner(records)
    for task in range(4):
        planner.submit(task, "k")
    assert len(start_all(planner, 0.1)) == 4
    oom = PeakReport(device=0, device_peak_bytes=2 * GiB, device_source="simulator", oom=True)
    verdict = planner.out_of_memory(0, oom, None, 0.2, error="oom")
    assert isinstance(verdict, Retry)
    cap = planner.state.cards[0].cap.oom_cap
    assert cap == 3
    for task in (1, 2, 3):
        small = PeakReport(device=0, device_peak_bytes=256 * MiB, device_source="simulator")
        planner.finished(task, small, 0.3)
    for task in range(4, 12):
        planner.submit(task, "k")
    assert len(start_all(planner, 0.4)) == cap
    assert planner.width <= cap
    later = [r for r in records if r.time_s > 0.2 and r.event in {"widened", "narrowed"}]
    assert all(r.width_after is not None and r.width_after <= cap for r in later)


def test_retries_are_capped_in_every_mode_and_the_error_names_the_cap():
    """A task that keeps running out beside a neighbour fails after max_retries, naming it."""
    for fixed in (None, 2):
        records: list[Decision] = []
        census = census_of([card_census(total_bytes=16 * GiB, free_bytes=16 * GiB)])
        asks = AskTable(policy=Policy(reserve_bytes=0), default_estimate_bytes=2 * GiB)
        config = PlannerConfig(
            max_workers=4, fixed_width=fixed, reserve_bytes=0, parent_pid=PARENT, max_retries=3
        )
        planner = Planner(census=census, asks=asks, config=config, emit=records.append)
        planner.construct(0.0)
        planner.submit(0, "k")
        planner.submit(1, "neighbour")
        assert len(start_all(planner, 0.0)) == 2
        oom = PeakReport(device=0, device_peak_bytes=GiB, device_source="simulator", oom=True)
        outcomes = []
        for step in range(10):
            verdict = planner.out_of_memory(0, oom, None, float(step), error="oom")
            outcomes.append(verdict)
            if isinstance(verdict, Fail):
                break
            planner.started(0, 0, 100, float(step))  # run again beside the neighbour
        assert [isinstance(v, Retry) for v in outcomes] == [True, True, True, False]
        fail = outcomes[-1]
        assert isinstance(fail, Fail)
        assert fail.kind == "retries_exhausted"
        assert "max_retries=3" in fail.reason


def test_an_oom_on_a_small_card_is_retried_on_the_larger_one():
    """A task that overflows an 8 GiB card alone (its room free) is retried on a 24 GiB card."""
    records: list[Decision] = []
    census = census_of(
        [
            card_census(device=0, total_bytes=8 * GiB, free_bytes=8 * GiB),
            card_census(device=1, total_bytes=24 * GiB, free_bytes=24 * GiB),
        ]
    )
    asks = AskTable(policy=Policy(reserve_bytes=0), default_estimate_bytes=2 * GiB)
    config = PlannerConfig(max_workers=4, reserve_bytes=0, parent_pid=PARENT)
    planner = Planner(census=census, asks=asks, config=config, emit=records.append)
    planner.construct(0.0)
    planner.submit(0, "k")
    verdict = planner.next_start(0.0)
    assert isinstance(verdict, Start)
    planner.started(0, 0, 100, 0.0)  # it ran on the small card
    report = PeakReport(
        device=0,
        device_peak_bytes=2 * GiB,
        device_source="simulator",
        oom=True,
        oom_requested_bytes=10 * GiB,
    )
    free = CardReading(free_bytes=8 * GiB, used_bytes=0, process_bytes={})
    outcome = planner.out_of_memory(0, report, free, 0.1, error="oom")
    assert isinstance(outcome, Retry)
    again = planner.next_start(0.2)
    assert isinstance(again, Start)
    assert again.device == 1
    assert asks.ask("k").ask_bytes >= 12 * GiB


def test_a_gate_that_shuts_and_opens_a_thousand_times_is_recorded_once_and_keeps_warm():
    """1,000 shut/open alternations within 5 s: one live-gate record; no worker is retired on a
    shut reading, only after the gate stayed shut for RETIRE_AFTER_SHUT_S."""
    records: list[Decision] = []
    planner = _one_card_planner(records, total_gib=40)
    planner.submit(0, "k")
    planner.submit(1, "k")
    first = planner.next_start(0.0)
    assert isinstance(first, Start)
    planner.started(first.task, 0, 100, 0.0)
    full = CardReading(free_bytes=GiB // 2, used_bytes=39 * GiB, process_bytes={100: 0})
    empty = CardReading(free_bytes=39 * GiB, used_bytes=GiB, process_bytes={100: 0})
    for step in range(1000):
        now = step * 0.004
        planner.readings.observe(0, full, now)
        assert isinstance(planner.next_start(now), Wait)
        assert planner.neighbours.warm_limit(0, now) >= 2  # one shut reading retires nothing
        planner.readings.observe(0, empty, now + 0.001)
        planner.state.cards[0].gate.gate_shut_since_s = None  # the gate opened (as a start would)
    gates = [r for r in records if r.event == "live_gate_wait"]
    assert len(gates) == 1
    planner.readings.observe(0, full, 10.0)
    assert isinstance(planner.next_start(10.0), Wait)
    assert isinstance(planner.next_start(10.0 + RETIRE_AFTER_SHUT_S), Wait)
    assert planner.neighbours.warm_limit(0, 10.0 + RETIRE_AFTER_SHUT_S) == 1  # only the running one


def test_the_live_gate_counts_an_idle_workers_context_once():
    """The idle warm worker a task will run in holds its context, which the task's ask counts
    too: the gate credits those bytes, so a card packed to its bound refills after a task ends."""
    records: list[Decision] = []
    total, co_tenant, own, context = 40 * GiB, 7 * GiB, 3 * GiB, 300 * MiB
    census = census_of(
        [card_census(total_bytes=total, free_bytes=total - co_tenant - own, own_bytes=own)],
        cpus=16,
        available_ram_bytes=256 * GiB,
    )
    ask = int(5.9 * GiB)  # room 29.75 GiB: five fit
    asks = AskTable(
        policy=Policy(margin_bytes=0, margin_fraction=0.0, reserve_bytes=256 * MiB),
        default_estimate_bytes=ask,
    )
    config = PlannerConfig(max_workers=8, reserve_bytes=256 * MiB, parent_pid=PARENT)
    planner = Planner(census=census, asks=asks, config=config, emit=records.append)
    planner.construct(0.0)
    for task in range(7):
        planner.submit(task, "k")

    def observe(idle: dict[int, int]) -> None:
        rows = {r.pid or 0: r.booked_bytes for r in planner.state.running.values()} | idle
        used = co_tenant + own + sum(rows.values())
        planner.readings.observe(
            0,
            CardReading(free_bytes=total - used, used_bytes=used, process_bytes=rows | {1: own}),
            0.1,
        )

    observe({})
    assert len(start_all(planner, 0.1)) == 5
    done = min(planner.state.running)
    pid = planner.state.running[done].pid
    assert pid is not None
    planner.finished(
        done, PeakReport(device=0, device_peak_bytes=ask, device_source="simulator"), 0.2
    )
    # 40 - 7 - 3 - 4 x 5.9 - 0.3 = 6.1 GiB free; 5.9 GiB + 256 MiB reserve needed; the idle
    # worker's 0.3 GiB context is in the ask.
    observe({pid: context})
    verdict = planner.next_start(0.3)
    assert isinstance(verdict, Start)
    assert not verdict.past_bound
    # Without an idle worker of the pool (a stranger's 0.3 GiB), the gate stays shut.
    planner.started(verdict.task, verdict.device, pid, 0.3)
    planner.finished(
        verdict.task, PeakReport(device=0, device_peak_bytes=ask, device_source="simulator"), 0.4
    )
    planner.state.cards[0].worker_pids.discard(pid)
    observe({pid: context})
    assert isinstance(planner.next_start(0.5), Wait)


def test_a_settle_of_several_peaks_names_the_last_and_notes_a_descendant_once():
    """Two tasks of one key end in one turn, the first leaving a descendant running: the
    settle's one record names the peak measured last as the last, and the descendant once."""
    records: list[Decision] = []
    planner = _one_card_planner(records, total_gib=24)
    for task in range(2):
        planner.submit(task, "k")
    first, last = start_all(planner, 0.1)[:2]
    planner.ended(
        first.task,
        PeakReport(
            device=0,
            device_peak_bytes=1 * GiB,
            device_source="simulator",
            outliving_descendants=1,
            outliving_device_bytes=10 * MiB,
        ),
        0.2,
    )
    planner.ended(
        last.task, PeakReport(device=0, device_peak_bytes=5 * GiB, device_source="simulator"), 0.3
    )
    seen = len(records)
    planner.settle(0.4)
    told = [r for r in records[seen:] if "k measured" in r.reason]
    assert len(told) == 1
    assert "2 peaks, the last 5.00 GiB" in told[0].reason
    assert told[0].reason.count("outlived") == 1


def test_feature_priced_tasks_of_a_key_with_an_outlier_keep_a_reserve_for_one() -> None:
    """A key whose peaks follow a list argument (1 GiB + 2 GiB per item, eight tasks) and
    then one 9 GiB outlier of a one-item call: its one-item tasks are priced from the line
    (about 3 GiB each), and five of them running together on a card book room for the one
    outlier the rate (1 in 9) expects among five: one of them at the outlier's price. Tasks
    of the key without the argument, priced at its ask, started beside them, book the key's
    price together between them (the first at the full ask)."""
    census = census_of(
        [card_census(total_bytes=80 * GiB, free_bytes=80 * GiB)],
        cpus=16,
        available_ram_bytes=128 * GiB,
    )
    asks = AskTable(
        policy=Policy(reserve_bytes=0, learned=True, outliers=True),
        default_estimate_bytes=4 * GiB,
    )
    planner = Planner(
        census=census,
        asks=asks,
        config=PlannerConfig(max_workers=8, reserve_bytes=0, parent_pid=PARENT),
        emit=lambda record: None,
    )
    planner.construct(0.0)
    task = 0

    def started(items: int | None) -> int:
        nonlocal task
        features = () if items is None else (("arg0.len", float(items)),)
        planner.submit(task, "k", features=features)
        verdict = planner.next_start(0.1, None)
        assert isinstance(verdict, Start), verdict
        planner.started(verdict.task, verdict.device, 100 + task, 0.1)
        task += 1
        return verdict.task

    for items, peak in [(n, GiB + 2 * GiB * n) for n in (1, 2, 3, 4, 1, 2, 3, 4)] + [(1, 9 * GiB)]:
        done = started(items)
        report = PeakReport(device=0, device_peak_bytes=peak, device_source="simulator")
        planner.finished(done, report, 0.2)
    ask = asks.ask("k")
    assert asks.predictor("k") is not None and ask.outliers == 1
    one = asks.ask_for("k", None, (("arg0.len", 1.0),))
    assert one.feature == "arg0.len" and one.ask_bytes < 4 * GiB
    assert one.outlier_rate == ask.outlier_rate > 0
    runs = [started(1) for _ in range(5)]
    booked = [planner.state.running[t].booked_bytes for t in runs]
    extra = ask.outlier_bytes - one.ask_bytes
    assert sum(booked) == 5 * one.ask_bytes + extra  # one outlier expected among five
    assert booked.count(one.ask_bytes + extra) == 1
    plain = [started(None) for _ in range(2)]
    held = sum(planner.state.running[t].booked_bytes for t in plain)
    assert held == ask.together_bytes(2) - ask.outlier_reserve_bytes(2) + sum(
        max(0, ask.outlier_bytes - ask.ask_bytes) * step
        for step in (
            int(6 * ask.outlier_rate + 0.5) - int(5 * ask.outlier_rate + 0.5),
            int(7 * ask.outlier_rate + 0.5) - int(6 * ask.outlier_rate + 0.5),
        )
    )
    assert planner.state.running[plain[0]].booked_bytes >= ask.ask_bytes
