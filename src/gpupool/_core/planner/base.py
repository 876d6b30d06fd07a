"""The planner's state and the few steps every rule shares (pure core).

:class:`PlannerBase` holds what one pool's planner knows: its cards (each
holding its runs), its tasks, the pending queue, the asks, the ceiling and the
counts. The rules are built on it in layers: :class:`~.views.Views` (every
width, a view of the one fit), :class:`~.starts.Starts` (the next start) and
:class:`~.planner.Planner` (the events).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpupool._core.bound import Ceiling, WidthDecision, derive_ceiling
from gpupool._core.census import Census
from gpupool._core.events import Decision
from gpupool._core.planner import samples
from gpupool._core.planner.order import Hold
from gpupool._core.planner.state import Card, Run, TaskState
from gpupool._core.planner.verdicts import (
    LOOKAHEAD,
    PlannerConfig,
    Refuse,
    Retry,
    Start,
    TaskId,
    Workers,
)
from gpupool._core.policy import Ask, AskTable

if TYPE_CHECKING:
    from gpupool._core.planner.learning import Learned

__all__ = ["PlannerBase"]

_NO_CARDS: frozenset[int] = frozenset()


class PlannerBase:
    """What the planner holds, and the steps its rules share.

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
            Card(index=i, census=card, own_high_water_bytes=card.own_bytes or 0)
            for i, card in enumerate(census.cards)
        ]
        for card in self.cards:
            card.recorded_own_bytes = card.own_high_water_bytes
        self.tasks: dict[TaskId, TaskState] = {}
        self.pending: collections.deque[TaskId] = collections.deque()
        # Every run, by task; each card holds its own too (``card.runs``).
        self.running: dict[TaskId, Run] = {}
        self.child_rss_bytes: int | None = None
        self.ceiling = self._derive_ceiling()
        self.counts: collections.Counter[str] = collections.Counter()
        self.widths: list[tuple[float, int]] = []
        self.refused: Refuse | None = None
        # Room held for the queue's head once it was passed a ceiling's worth of times.
        self.hold: Hold | None = None
        # The head that hold is for: kept while that task waits at the head.
        self._held_for: tuple[TaskId, Hold] | None = None
        self._issued: dict[TaskId, Start] = {}
        # The workers the process layer reported with the last ``next_start``.
        self._workers: Workers | None = None
        self._recorded_asks: dict[str, Ask] = {}
        # Keys whose report of a descendant left running or a rejected reading was recorded.
        self._noted_reports: set[str] = set()
        # Keys told to the user as having peaks that vary a lot (a ``peaks_vary`` record).
        self._varied_keys: set[str] = set()
        # By key, what its tasks that ended since the last settle measured (planner/learning).
        self._learned: dict[str, Learned] = {}
        # Cards where a running task was booked higher since the last take_grown().
        self._grown_cards: set[int] = set()
        self._last_key: str = ""
        # Pending tasks per key, and each key's measured task durations (count, mean seconds).
        self._pending_by_key: collections.Counter[str] = collections.Counter()
        self._durations_s: dict[str, tuple[int, float]] = {}
        # Keys with a long task among their last ones: how many more must end before it is
        # forgotten (planner/queued).
        self._long_left: dict[str, int] = {}
        # By key, the mean run time of its last tasks (the last LONG_MEMORY_TASKS weigh most),
        # which decides whether it is short and how deep it queues (planner/queued).
        self._recent_s: dict[str, float] = {}
        self._critical_recorded_s: float | None = None
        self._hold_recorded_s: float | None = None
        self._sensor_errors: set[tuple[int, str]] = set()
        # Tasks queued behind a running one on its worker (queued -> the run it waits on).
        self.queued: dict[TaskId, TaskId] = {}
        # By run with tasks still queued behind it, the last of them sent back to the queue:
        # the next one sent back from that run goes after it (planner/queued).
        self._requeued_last: dict[TaskId, TaskId] = {}
        # Tasks were submitted since the width was last derived (a start then derives it).
        self._width_due = False
        # A term of the cards' rooms for one task moved (a co-tenant at census, the child's
        # RSS) since the asks were last held within them: the next measurement holds them.
        self._rooms_due = True
        # The last widths decided (:meth:`.views.Views.decide`) and the fits they were shared
        # out from: the same fits (each card's, served by its memo) share out alike.
        self._decided: tuple[tuple[object, ...], tuple[WidthDecision, ...]] | None = None
        self.width = self._width_now()

    @property
    def refusal(self) -> str | None:
        """Strict mode's refusal, once a narrowing was refused (``next_start`` returns it)."""
        return self.refused.reason if self.refused is not None else None

    @property
    def refusal_decision(self) -> Decision | None:
        """The record of the refused narrowing."""
        return self.refused.decision if self.refused is not None else None

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

    def ask_of(self, task: TaskId) -> Ask:
        """``task``'s price now (a per-task hint becomes its key's estimate first)."""
        state = self.tasks[task]
        if state.hint_bytes is not None:
            self.asks.hint(state.key, state.hint_bytes)
            state.hint_bytes = None
        return self.asks.ask_for(state.key, state.size)

    def _unqueue(self, task: TaskId) -> None:
        if self.pending and self.pending[0] == task:
            self.pending.popleft()  # the usual case: a start takes the head
        else:
            try:
                self.pending.remove(task)
            except ValueError:
                return
        self._pending_by_key[self.tasks[task].key] -= 1

    def _end_run(self, task: TaskId) -> Run | None:
        run = self.running.pop(task, None)
        if run is not None and run.device is not None:
            self.cards[run.device].drop_run(task)
        return run

    def _retry(self, task: TaskId, reason: str) -> Retry:
        self.counts["retries"] += 1
        self.pending.appendleft(task)
        self._pending_by_key[self.tasks[task].key] += 1
        return Retry(task=task, reason=reason)

    def _rebook(self, key: str) -> None:
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

    def _present_keys(self) -> list[str]:
        keys: dict[str, None] = {}
        for run in self.running.values():
            keys[run.key] = None
        head_key = self.tasks[self.pending[0]].key if self.pending else None
        if head_key is not None and self._pending_by_key[head_key] == len(self.pending):
            keys[head_key] = None  # one key pending: the queue is not walked
            return list(keys)
        for task in itertools.islice(self.pending, LOOKAHEAD):
            keys[self.tasks[task].key] = None
        return list(keys)

    def _timeline(self, now_s: float) -> None:
        if not self.widths or self.widths[-1][1] != self.width:
            self.widths.append((round(now_s, 6), self.width))

    def record(self, decision: Decision) -> None:
        """Write one record (the planner's only output besides its verdicts), after a sample
        of the reading its card's decision was made on."""
        if decision.device is not None and decision.device < len(self.cards):
            self._sample(self.cards[decision.device], decision.time_s, decision=True)
        self._emit(decision)

    def _sample(self, card: Card, now_s: float, *, decision: bool) -> None:
        """A ``card_read`` sample of ``card``'s last reading, where one is due
        (:func:`~gpupool._core.planner.samples.sample_due`)."""
        reading = card.reading
        if (
            reading is None
            or not self.widths  # not yet constructed: the census is the first record's
            or not samples.sample_due(card, now_s, decision=decision)
        ):
            return
        split = samples.split_reading(card, reading, self.config.parent_pid)
        card.sampled_reading = reading
        card.sampled_s = now_s
        card.sampled_used_bytes = reading.used_bytes
        card.sampled_running = len(card.runs)
        self._emit(samples.card_read(card, split, reading.free_bytes, now_s))

    def _width_now(self) -> int:
        """How many tasks the planner admits at once now (:meth:`.views.Views._width_now`)."""
        raise NotImplementedError
