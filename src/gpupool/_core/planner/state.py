"""What the planner holds: its tasks, their runs, and its cards, each card holding its own runs.

One name for each idea: a task's price on its card is its ``booked_bytes`` (its share of its key's
price together, :meth:`~gpupool._core.policy.Ask.next_bytes`); ``booked_at_start_bytes`` is what it
was booked at when it started (an out-of-memory is judged against that, not against a price raised
since); a card's runs are ``card.runs``, added and dropped through the card, which keeps their
running sums (``card.sums``: what they book, how many of each key, what each key books) so a start,
a finish and a fit read them without walking the runs. A card also keeps the bounds and fits worked
out on it (``card.memo``: see :func:`~gpupool._core.planner.fit.fit_counts`), each served only
while the terms it was worked out from are the card's terms still.

A card's other terms are small records of their own, each written by the one rule that owns it
(the live reading, the cap, the gate's clock, the last sample, the other pools, the turns between
them and this pool): see :class:`Card`.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpupool._core.bookings import OtherPools
from gpupool._core.bound import Bound, Ceiling, Limit
from gpupool._core.census import CardCensus
from gpupool._core.events import TaskIdentity
from gpupool._core.planner.verdicts import CardReading, TaskId
from gpupool._core.policy import PriceTerms
from gpupool._core.predict import Features

__all__ = [
    "Card",
    "CapTerms",
    "Critical",
    "Fit",
    "GateClock",
    "LastSample",
    "LiveTerms",
    "Memos",
    "PoolsHere",
    "Run",
    "RunSums",
    "TaskState",
    "Turns",
    "usable",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Fit:
    """What fits on one card (``device``) beside ``running`` runs at one ask: ``more`` tasks (within
    the memory, the out-of-memory cap and the slots the ceiling leaves), and what stops one more
    past them. ``booked_bytes`` (what the runs book) and ``next_bytes`` (what one more books) count
    each one's child RSS on unified memory (:func:`~.fit.host_per_task_bytes`)."""

    device: int
    bound: Bound
    running: int
    booked_bytes: int
    next_bytes: int
    more: int
    limit: Limit

    @property
    def width(self) -> int:
        """The runs there plus the ones that fit beside them."""
        return self.running + self.more

    @property
    def next_booked_bytes(self) -> int:
        """What one more task at the ask is booked at (its share of its key's price together),
        without its child's RSS: what a what-if booking of it (:class:`~.fit.Booked`) holds, as the
        fit prices each booking's child RSS beside it."""
        return self.next_bytes - self.bound.host_per_task_bytes

    @property
    def left_bytes(self) -> int | None:
        """The room left once one more task is booked (``None``: unreadable)."""
        room = self.bound.room_bytes
        return None if room is None else room - self.booked_bytes - self.next_bytes


#: What a bound or a fit on a card was worked out from besides the ask's price: the
#: ceiling, the census and the card's terms (``fit.card_bound``, ``fit.fit_counts``).
BoundMemo = tuple[Ceiling, CardCensus, tuple[int, ...], Bound]
FitMemo = tuple[Ceiling, CardCensus, tuple[int | None, ...], Fit]


@dataclass(slots=True)
class TaskState:
    """A task the planner holds, pending or running."""

    key: str
    hint_bytes: int | None
    # The size of the task's input the caller gave (the ask may be predicted from it).
    size: float | None = None
    # What its call's arguments say (the ask may be predicted from one of them).
    features: Features = ()
    # What an out-of-memory of this task alone proved, where its peak was an outlier of its
    # key's (the key's other tasks keep their price): its ask never falls below it.
    floor_bytes: int = 0
    retries: int = 0
    # Fixed width after an out-of-memory: start only while fewer than this run there.
    wait_below: int | None = None
    # Devices where it ran out alone although the room was free: not again.
    avoid: set[int] = field(default_factory=set)
    # Waiting for room that others' bytes hold: until then no serial start.
    room_wait_until_s: float | None = None
    last_device: int | None = None
    last_booked_bytes: int = 0
    # When it first had to wait at the queue's head for room (the order rule's clock).
    waiting_since_s: float | None = None
    # How many tasks started past it while it waited at the queue's head.
    passed: int = 0
    # Which task it is, for the records about it (its map position, its label).
    identity: TaskIdentity | None = None


@dataclass(slots=True)
class Run:
    """A task handed to a worker: where it runs and what it books there."""

    key: str
    device: int | None
    pid: int | None
    # The task's own ask when it started, and what it booked then (its share of its
    # key's price together): an out-of-memory is judged against these.
    ask_bytes: int
    booked_bytes: int
    booked_at_start_bytes: int
    shared: bool = False
    started_s: float = 0.0
    size: float | None = None
    features: Features = ()
    floor_bytes: int = 0
    # The own high-water its start was priced at (an out-of-memory names growth past it).
    own_high_water_bytes: int = 0
    # Which task it is, for the records about it (its map position, its label).
    identity: TaskIdentity | None = None
    # Booked at its own price (an individual ask: a size, a feature, an outlier's call, its
    # own floor), not at its share of its key's price together; the key's reserve for
    # outliers counts it all the same (:meth:`~gpupool._core.policy.Ask.next_bytes`).
    solo: bool = False


def usable(cards: Sequence[Card], avoid: set[int]) -> Sequence[Card]:
    """The cards a task may use: those it does not avoid (all, where it avoids every one)."""
    if not avoid:
        return cards
    return [card for card in cards if card.index not in avoid] or cards


@dataclass(frozen=True, slots=True)
class Critical:
    """The key whose pending work would take longest alone, and by how much."""

    key: str
    time_left_s: float
    runner_up_time_left_s: float
    width: int


@dataclass(slots=True, kw_only=True)
class RunSums:
    """The running sums of a card's runs, so a start, a finish and a fit read them without
    walking the runs: what they book between them, how many of each key, what each key's runs
    book, and how many of each key's runs are booked at their own price (``Run.solo``). Written
    by the card's own methods only (:meth:`Card.add_run`, :meth:`Card.drop_run`,
    :meth:`Card.rebook`)."""

    booked_bytes: int = 0
    runs_by_key: collections.Counter[str] = field(default_factory=collections.Counter)
    runs_booked_by_key: collections.Counter[str] = field(default_factory=collections.Counter)
    solo_by_key: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(slots=True, kw_only=True)
class LiveTerms:
    """What the live readings of a card say (written by the readings room,
    :class:`~gpupool._core.planner.readings.Readings`, only): the last reading, when, and why the
    last one failed; this process's own high-water on the card (a term of the bound: it only
    grows) and the own bytes last recorded (a width review is recorded each step past it)."""

    own_high_water_bytes: int = 0
    recorded_own_bytes: int = 0
    reading: CardReading | None = None
    reading_s: float = 0.0
    reading_error: str | None = None


@dataclass(slots=True, kw_only=True)
class CapTerms:
    """The out-of-memory cap on a card (written by the out-of-memory room,
    :mod:`~gpupool._core.planner.out_of_memory`, only): how many tasks an out-of-memory left
    it, and since when the live readings have shown the room the cap was set for back."""

    oom_cap: int | None = None
    cap_clear_since_s: float | None = None


@dataclass(slots=True, kw_only=True)
class GateClock:
    """The live gate's clock on a card (written by the starts, :mod:`~.starts`, only): since
    when the gate has held a start here shut, and how many shut episodes the next record
    of a wait states."""

    gate_shut_since_s: float | None = None
    gate_episodes: int = 0


@dataclass(slots=True, kw_only=True)
class LastSample:
    """The last reading of a card the log sampled (a ``card_read`` record): the reading,
    when, its used bytes and how many of the pool's runs were there (written by the recorder,
    :mod:`~.samples`, only)."""

    sampled_reading: CardReading | None = None
    sampled_s: float | None = None
    sampled_used_bytes: int | None = None
    sampled_running: int = 0


@dataclass(slots=True, kw_only=True)
class PoolsHere:
    """The host's other pools on a card (written by :func:`~.sharing.note_others` only): their
    rows, their tasks at max(booked, held), the part not reached yet, how many, what they held
    at the census, what they hold and past their bookings, and since when they run tasks here."""

    others: OtherPools | None = None
    others_bytes: int = 0
    others_unreached_bytes: int = 0
    others_tasks: int = 0
    others_at_census_bytes: int = 0
    others_held_bytes: int = 0
    others_overrun_bytes: int = 0
    others_since_s: float | None = None

    @property
    def others_waiting(self) -> int:
        """Other pools with tasks waiting for room on this card."""
        return self.others.waiting_pools if self.others is not None else 0

    @property
    def others_active(self) -> int:
        """Other pools running a task or waiting for room on this card."""
        return self.others.active_pools if self.others is not None else 0


@dataclass(slots=True, kw_only=True)
class Turns:
    """Who goes first on a card between this pool and the others (written by
    :mod:`~.sharing` only): the yields to a pool at the serial floor and the give-way of the
    room an ended task freed."""

    # Other pools that run nothing here and wait for room, by pool id: since when this pool
    # saw them so; and since when this pool runs nothing here (``sharing.yields_to``).
    starved_since_s: dict[str, float] = field(default_factory=dict)
    idle_since_s: float | None = None
    # Since when this pool yields here without a break, and until when it yields here no
    # more (after a yield, as long as it lasted: ``sharing.yields_to``).
    yield_began_s: float | None = None
    no_yield_until_s: float = float("-inf")
    # Until when the room this pool's ended task freed here goes first to a waiting pool
    # holding less than this pool booked before it ended, and no more than it books now,
    # and what it booked then (``sharing.gives_way``).
    give_way_until_s: float = float("-inf")
    give_way_below_bytes: int = 0
    # How long the last turn here lasts; until when no new turn opens here (a turn that held
    # a start and no pool took is followed by as long without one); and what each other pool
    # that waited here when the last turn opened booked then and waited for: one that books
    # half that more since took it (``sharing.note_freed``).
    give_way_turn_s: float = 0.0
    give_way_rest_until_s: float = float("-inf")
    give_way_booked: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class Memos:
    """The bounds and fits worked out on a card (written by :mod:`~.fit` only), by the ask's
    price terms and, for a fit, what it was placed beside (how many runs, what they book, how
    many of the key, the slots); each kept with the terms it was worked out from, and served only
    while those are the card's terms still."""

    bound_memo: dict[PriceTerms, BoundMemo] = field(default_factory=dict)
    fit_memo: dict[tuple[PriceTerms, int, int, int, int, int], FitMemo] = field(
        default_factory=dict
    )


@dataclass(slots=True)
class Card:
    """One card: its census, the pool's runs on it, and its parts, each a record written by
    the one rule that owns it (``tests/core/test_planner_rooms.py``): the runs, their workers
    and their sums (``sums``) by its own methods; the live reading and the own high-water
    (``live``) by the readings; the width by ``views``; the cap (``cap``) by ``out_of_memory``;
    the gate's clock (``gate``) by ``starts``; the last sample (``sample``) by ``samples``; the
    other pools (``pools``) and the turns between them and this pool (``turns``) by
    ``sharing``; the memos (``memo``) by ``fit``. Nothing else writes a card's fields."""

    index: int
    census: CardCensus
    runs: dict[TaskId, Run] = field(default_factory=dict)
    # Every worker the pool ran a task in on this card: an idle one's row is
    # bytes (its context) that the next task's ask already counts.
    worker_pids: set[int] = field(default_factory=set)
    sums: RunSums = field(default_factory=RunSums)
    live: LiveTerms = field(default_factory=LiveTerms)
    width: int = 0
    cap: CapTerms = field(default_factory=CapTerms)
    gate: GateClock = field(default_factory=GateClock)
    sample: LastSample = field(default_factory=LastSample)
    pools: PoolsHere = field(default_factory=PoolsHere)
    turns: Turns = field(default_factory=Turns)
    memo: Memos = field(default_factory=Memos, repr=False, compare=False)

    def add_run(self, task: TaskId, run: Run) -> None:
        """``run`` runs here now (in its worker, which the card keeps)."""
        self.runs[task] = run
        if run.pid is not None:
            self.worker_pids.add(run.pid)
        sums = self.sums
        sums.booked_bytes += run.booked_bytes
        sums.runs_by_key[run.key] += 1
        sums.runs_booked_by_key[run.key] += run.booked_bytes
        sums.solo_by_key[run.key] += run.solo

    def keep_workers(self, process_bytes: Mapping[int, int]) -> None:
        """A reading's per-process rows: a worker with no row holds nothing (or has exited),
        unless it runs a task here: forget it."""
        if self.worker_pids:
            running = {r.pid for r in self.runs.values()}
            self.worker_pids = {
                pid for pid in self.worker_pids if pid in process_bytes or pid in running
            }

    def drop_run(self, task: TaskId) -> Run | None:
        """``task``'s run ended here (``None``: it had none)."""
        run = self.runs.pop(task, None)
        if run is not None:
            sums = self.sums
            sums.booked_bytes -= run.booked_bytes
            sums.runs_by_key[run.key] -= 1
            sums.runs_booked_by_key[run.key] -= run.booked_bytes
            sums.solo_by_key[run.key] -= run.solo
        return run

    def rebook(self, run: Run, booked_bytes: int, solo: bool | None = None) -> None:
        """``run`` (one of this card's) is booked at ``booked_bytes`` from now on (``solo``: at
        its own price, or its share of its key's; ``None``: as before)."""
        sums = self.sums
        sums.booked_bytes += booked_bytes - run.booked_bytes
        sums.runs_booked_by_key[run.key] += booked_bytes - run.booked_bytes
        run.booked_bytes = booked_bytes
        if solo is not None and solo != run.solo:
            sums.solo_by_key[run.key] += 1 if solo else -1
            run.solo = solo

    def same_key(self, key: str) -> int:
        """How many of the pool's runs on this card are of ``key``."""
        return self.sums.runs_by_key.get(key, 0)

    def key_counts(self, key: str) -> tuple[int, int]:
        """How many of the pool's runs on this card are of ``key``, and how many of those are
        booked at their share of the key's price together (not ``solo``): what the next
        task's :meth:`~gpupool._core.policy.Ask.next_bytes` is placed after."""
        same = self.sums.runs_by_key.get(key, 0)
        return same, same - self.sums.solo_by_key.get(key, 0)
