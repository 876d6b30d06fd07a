"""The planner's state: its cards, tasks, queue, runs, ceiling and counts, and each key's
task durations (pure core).

:class:`PlannerState` is what one pool's planner knows, and the only writer of it: the rules
(:mod:`~.views`, :mod:`~.order`, :mod:`~.starts`, :mod:`~.queued`, :mod:`~.learning`) read it, and
change it through its methods (a task queued, unqueued, put back, begun, ended; its key's runs
booked at its price now). :class:`Durations` is the only writer of the durations: the start order
reads their means (the critical key, when a running task is expected to end), and queueing behind a
run (:mod:`~.queued`) whether a key is short and how deep its tasks may queue.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

from gpupool._core.bound import Ceiling, derive_ceiling
from gpupool._core.census import Census
from gpupool._core.events import TaskIdentity
from gpupool._core.planner.state import Card, LiveTerms, Run, TaskState
from gpupool._core.planner.verdicts import LOOKAHEAD, PlannerConfig, Start, TaskId
from gpupool._core.policy import OUTLIER_FEATURE, Ask, AskTable
from gpupool._core.predict import Features

__all__ = [
    "LONG_MEMORY_TASKS",
    "LONG_TASK_S",
    "QUEUED_WORK_S",
    "QUEUE_DEPTH",
    "QUEUE_DEPTH_LEAST",
    "SHORT_MIN_TASKS",
    "SHORT_TASK_S",
    "Durations",
    "PlannerState",
]

_NO_CARDS: frozenset[int] = frozenset()

#: A key's tasks are short when their mean measured run time is under this: a task queued
#: behind one of them waits at most about that long while another worker may be idle.
SHORT_TASK_S = 0.02
#: At most this many tasks wait behind one worker's run, each starting as the one before ends
#: (tasks of a few milliseconds: the parent hands over a few per turn, not one) ...
QUEUE_DEPTH = 8
#: ... as many as the key's mean run time fits in this (the last waits about this long) ...
QUEUED_WORK_S = SHORT_TASK_S
#: ... and at least this many.
QUEUE_DEPTH_LEAST = 2
#: How many of a key's tasks are timed before it may be found short.
SHORT_MIN_TASKS = 3
#: A task of a key that took this long is a long one, whatever the key's mean ...
LONG_TASK_S = 0.1
#: ... and the key is not short until this many of its tasks ended after it.
LONG_MEMORY_TASKS = 8


class Durations:
    """Each key's measured task durations (the only writer of them)."""

    def __init__(self) -> None:
        # By key: how many of its tasks were timed, and their mean seconds.
        self._timed: dict[str, tuple[int, float]] = {}
        # By key, the mean run time of its last tasks (the last LONG_MEMORY_TASKS weigh most),
        # which decides whether it is short and how deep it queues.
        self._recent_s: dict[str, float] = {}
        # Keys with a long task among their last ones: how many more must end before it is
        # forgotten.
        self._long_left: dict[str, int] = {}

    def timed(self, key: str, took_s: float) -> None:
        """A task of ``key`` ended after ``took_s``: it joins the key's mean; a long one is
        remembered for the key's next :data:`LONG_MEMORY_TASKS` tasks; the key's recent mean
        follows ``took_s`` (the plain mean over its first :data:`LONG_MEMORY_TASKS`, a weight
        of 1/:data:`LONG_MEMORY_TASKS` after them)."""
        count, mean_s = self._timed.get(key, (0, 0.0))
        self._timed[key] = (count + 1, mean_s + (took_s - mean_s) / (count + 1))
        weight = 1.0 / min(count + 1, LONG_MEMORY_TASKS)
        recent_s = self._recent_s.get(key, took_s)
        self._recent_s[key] = recent_s + (took_s - recent_s) * weight
        if took_s >= LONG_TASK_S:
            self._long_left[key] = LONG_MEMORY_TASKS
        elif key in self._long_left:
            left = self._long_left[key] - 1
            if left > 0:
                self._long_left[key] = left
            else:
                del self._long_left[key]

    def mean_s(self, key: str) -> float | None:
        """The mean duration of ``key``'s timed tasks (``None``: none was timed)."""
        return self._timed[key][1] if key in self._timed else None

    def expected_end_s(self, run: Run) -> float:
        """When ``run`` is expected to end: its start plus its key's mean duration (its start
        alone until its key has a timed task, so the oldest ends first)."""
        return run.started_s + self._timed.get(run.key, (0, 0.0))[1]

    def short(self, key: str) -> bool:
        """Whether ``key``'s measured tasks are short (:data:`SHORT_TASK_S`), with no long one
        among the last of them (:data:`LONG_TASK_S`); the mean is of its recent tasks (each
        of the last :data:`LONG_MEMORY_TASKS` weighs 1/8 of it), so a key whose tasks grew
        slower stops being short within a few of them, whatever ran before."""
        count, _ = self._timed.get(key, (0, 0.0))
        return (
            count >= SHORT_MIN_TASKS
            and self._recent_s.get(key, 0.0) < SHORT_TASK_S
            and key not in self._long_left
        )

    def queue_depth(self, key: str) -> int:
        """How many tasks of ``key`` may wait behind one of its runs: as many as its recent
        mean measured run time (:meth:`timed`) fits in :data:`QUEUED_WORK_S`, within
        :data:`QUEUE_DEPTH_LEAST` and :data:`QUEUE_DEPTH`."""
        mean_s = self._recent_s.get(key, 0.0)
        if mean_s * QUEUE_DEPTH <= QUEUED_WORK_S:
            return QUEUE_DEPTH
        return max(QUEUE_DEPTH_LEAST, int(QUEUED_WORK_S / mean_s))


class PlannerState:
    """What the planner holds: its cards (each holding its runs), its tasks, the pending queue,
    every run by task, the ceiling and the counts; built from the census (the cards and the host at
    construction), the per-key asks (the planner is their only writer) and the caller's config."""

    def __init__(self, *, census: Census, asks: AskTable, config: PlannerConfig) -> None:
        self.census = census
        self.asks = asks
        self.config = config
        self.cards = [
            Card(
                index=i,
                census=card,
                live=LiveTerms(
                    own_high_water_bytes=card.own_bytes or 0,
                    recorded_own_bytes=card.own_bytes or 0,
                ),
            )
            for i, card in enumerate(census.cards)
        ]
        self.tasks: dict[TaskId, TaskState] = {}
        self.pending: collections.deque[TaskId] = collections.deque()
        self.pending_by_key: collections.Counter[str] = collections.Counter()
        # Every run, by task; each card holds its own too (``card.runs``).
        self.running: dict[TaskId, Run] = {}
        self.last_key: str = ""
        self.child_rss_bytes: int | None = None
        self.ceiling = self._derive_ceiling()
        # What happened, by kind; each rule counts its own kinds.
        self.counts: collections.Counter[str] = collections.Counter()
        # Cards where a running task was booked higher since the last take_grown().
        self._grown_cards: set[int] = set()

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

    def count(self, kind: str) -> None:
        """One more of ``kind`` happened (a retry, an out-of-memory, a wait, ...)."""
        self.counts[kind] += 1

    def learn_rss(self, rss_bytes: int | None) -> Ceiling | None:
        """A child reported ``rss_bytes`` of host RSS: where it is the largest yet, the ceiling
        is derived again at it. Returns the ceiling before, where the RSS grew."""
        if rss_bytes is None or (
            self.child_rss_bytes is not None and rss_bytes <= self.child_rss_bytes
        ):
            return None
        before = self.ceiling
        self.child_rss_bytes = rss_bytes
        self.ceiling = self._derive_ceiling()
        return before

    def ask_of(self, task: TaskId) -> Ask:
        """``task``'s price now (a per-task hint becomes its key's estimate first)."""
        state = self.tasks[task]
        if state.hint_bytes is not None:
            self.asks.hint(state.key, state.hint_bytes)
            state.hint_bytes = None
        return self.price(state)

    def price(self, state: TaskState | Run) -> Ask:
        """The price of a task (pending or running): its key's ask for its size and its call's
        features, never below what an out-of-memory of its own proved."""
        ask = self.asks.ask_for(state.key, state.size, state.features)
        if state.floor_bytes > ask.ask_bytes:
            ask = dataclasses.replace(
                ask,
                ask_bytes=state.floor_bytes,
                measured_peak_bytes=state.floor_bytes,
                margin_bytes=0,
                pooled=False,
                feature=OUTLIER_FEATURE,
            )
        return ask

    def add(
        self,
        task: TaskId,
        key: str,
        size: float | None,
        identity: TaskIdentity | None = None,
        features: Features = (),
    ) -> None:
        """A task was submitted: it is pending, at the back of the queue."""
        self.tasks[task] = TaskState(
            key=key, hint_bytes=None, size=size, identity=identity, features=features
        )
        self.pending.append(task)
        self.pending_by_key[key] += 1
        self.last_key = key

    def forget(self, task: TaskId) -> TaskState | None:
        """``task`` left the planner (ended, failed or withdrawn)."""
        return self.tasks.pop(task, None)

    def unqueue(self, task: TaskId) -> None:
        """``task`` left the pending queue (if it was there)."""
        if self.pending and self.pending[0] == task:
            self.pending.popleft()  # the usual case: a start takes the head
        else:
            try:
                self.pending.remove(task)
            except ValueError:
                return
        self.pending_by_key[self.tasks[task].key] -= 1

    def put_back(self, task: TaskId, after: TaskId | None = None) -> None:
        """``task`` is pending again: at the queue's head, or just after ``after`` where that
        one is pending."""
        if after is not None and after in self.pending:
            self.pending.insert(self.pending.index(after) + 1, task)
        else:
            self.pending.appendleft(task)
        self.pending_by_key[self.tasks[task].key] += 1

    def begin(
        self, task: TaskId, device: int | None, pid: int | None, now_s: float, issued: Start | None
    ) -> None:
        """``task``, off the pending queue, runs on ``device`` in worker ``pid``: it books there
        what ``issued`` (the start that admitted it) carried, else its next booking there."""
        state = self.tasks[task]
        price = self.price(state)
        card = self.cards[device] if device is not None else None
        booked_bytes = 0
        if card is not None:
            booked_bytes = (
                issued.booked_bytes
                if issued is not None and issued.device == device
                else price.next_bytes(*card.key_counts(state.key))
            )
        run = Run(
            key=state.key,
            device=device,
            pid=pid,
            ask_bytes=price.ask_bytes,
            booked_bytes=booked_bytes,
            booked_at_start_bytes=booked_bytes,
            # Another pool's task, or another of ours, on the card: not alone.
            shared=card is not None and bool(card.pools.others_tasks or card.runs),
            started_s=now_s,
            size=state.size,
            features=state.features,
            floor_bytes=state.floor_bytes,
            own_high_water_bytes=card.live.own_high_water_bytes if card is not None else 0,
            identity=state.identity,
            solo=price.individual,
        )
        if card is not None:
            for other in card.runs.values():
                other.shared = True
            card.add_run(task, run)
        self.running[task] = run
        state.last_device = device
        state.last_booked_bytes = booked_bytes
        state.room_wait_until_s = None
        state.waiting_since_s = None
        self.last_key = state.key

    def end_run(self, task: TaskId) -> Run | None:
        """``task``'s run ended (``None``: it had none); its card drops it."""
        run = self.running.pop(task, None)
        if run is not None and run.device is not None:
            self.cards[run.device].drop_run(task)
        return run

    def rebook(self, key: str) -> None:
        """Book the running tasks of ``key`` at its price now, in the order they started, each
        at its :meth:`~gpupool._core.policy.Ask.next_bytes` beside those before it: on each card
        the ones priced at the key's ask hold ``together_bytes(count)`` between them without
        the reserve, the oldest at the full ask; the others their own asks; and the key's
        tasks there, however priced, the reserve for the outliers expected among them all (a
        key's ask prices its running tasks as well as its next ones, whichever way it
        moved)."""
        ask = self.asks.ask(key)
        for card in self.cards:
            if not card.same_key(key):
                continue
            same = together = 0
            for run in card.runs.values():
                if run.key != key:
                    continue
                before_bytes = run.booked_bytes
                own = self.price(run) if run.size or run.features or run.floor_bytes else ask
                solo = own is not ask and own.individual
                card.rebook(run, (own if solo else ask).next_bytes(same, together), solo)
                same += 1
                together += not solo
                if run.booked_bytes > before_bytes:
                    self._grown_cards.add(card.index)

    def take_grown(self) -> frozenset[int]:
        """The cards where a running task was booked higher (its key's price rose) since the
        last call: the process layer tells the host's table of them before anything else."""
        if not self._grown_cards:
            return _NO_CARDS  # the usual answer, built once
        grown = frozenset(self._grown_cards)
        self._grown_cards.clear()
        return grown

    def present_keys(self) -> list[str]:
        """The keys running, then those pending within the lookahead, in order."""
        keys: dict[str, None] = {}
        for run in self.running.values():
            keys[run.key] = None
        head_key = self.tasks[self.pending[0]].key if self.pending else None
        if head_key is not None and self.pending_by_key[head_key] == len(self.pending):
            keys[head_key] = None  # one key pending: the queue is not walked
            return list(keys)
        for task in itertools.islice(self.pending, LOOKAHEAD):
            keys[self.tasks[task].key] = None
        return list(keys)
