"""The planner's state: its cards, tasks, queue, runs, ceiling and counts (pure core).

:class:`PlannerState` is what one pool's planner knows, and the only writer of it:
the rules (:mod:`~.views`, :mod:`~.order`, :mod:`~.starts`, :mod:`~.queued`,
:mod:`~.learning`) read it, and change it through its methods (a task queued,
unqueued, put back, begun, ended; its key's runs booked at its price now).
"""

from __future__ import annotations

import collections
import itertools

from gpupool._core.bound import Ceiling, derive_ceiling
from gpupool._core.census import Census
from gpupool._core.planner.state import Card, Run, TaskState
from gpupool._core.planner.verdicts import LOOKAHEAD, PlannerConfig, Start, TaskId
from gpupool._core.policy import Ask, AskTable

__all__ = ["PlannerState"]

_NO_CARDS: frozenset[int] = frozenset()


class PlannerState:
    """What the planner holds: its cards (each holding its runs), its tasks, the pending
    queue, every run by task, the ceiling and the counts; built from the census (the cards
    and the host at construction), the per-key asks (the planner is their only writer) and
    the caller's config."""

    def __init__(self, *, census: Census, asks: AskTable, config: PlannerConfig) -> None:
        self.census = census
        self.asks = asks
        self.config = config
        self.cards = [
            Card(
                index=i,
                census=card,
                own_high_water_bytes=card.own_bytes or 0,
                recorded_own_bytes=card.own_bytes or 0,
            )
            for i, card in enumerate(census.cards)
        ]
        self.tasks: dict[TaskId, TaskState] = {}
        self.pending: collections.deque[TaskId] = collections.deque()
        # Pending tasks per key.
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
        return self.asks.ask_for(state.key, state.size)

    def add(self, task: TaskId, key: str, size: float | None) -> None:
        """A task was submitted: it is pending, at the back of the queue."""
        self.tasks[task] = TaskState(key=key, hint_bytes=None, size=size)
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
            # Another pool's task, or another of ours, on the card: not alone.
            shared=card is not None and bool(card.others_tasks or card.runs),
            started_s=now_s,
            size=state.size,
            own_high_water_bytes=card.own_high_water_bytes if card is not None else 0,
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
        """Book the running tasks of ``key`` at its price now: on each card they hold
        ``together_bytes(count)`` between them, the oldest at the full ask (a key's ask
        prices its running tasks as well as its next ones, whichever way it moved)."""
        ask = self.asks.ask(key)
        for card in self.cards:
            seen = 0
            for run in card.runs.values():
                if run.key != key:
                    continue
                before_bytes = run.booked_bytes
                if run.size is not None:
                    card.rebook(run, self.asks.ask_for(key, run.size).ask_bytes)
                else:
                    card.rebook(run, ask.next_bytes(seen))
                    seen += 1
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
