"""The planner's inputs and verdicts: what the caller asked for, a live reading, and what to do.

Every verdict is a frozen value: :class:`Start`, :class:`Wait`, :class:`Retry`,
:class:`Fail`, and :class:`Refuse` (strict mode will not narrow).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from gpupool._core.events import Decision
from gpupool._core.units import GiB, MiB

__all__ = [
    "ASK_RECORD_STEP",
    "DEFAULT_CHILD_RSS_PRIOR_BYTES",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_ROOM_WAIT_S",
    "GATE_RECORD_INTERVAL_S",
    "LIVE_POLL_S",
    "LOOKAHEAD",
    "OWN_RECORD_STEP_BYTES",
    "RETIRE_AFTER_SHUT_S",
    "CardReading",
    "Fail",
    "FailKind",
    "PlannerConfig",
    "Refuse",
    "Retry",
    "Start",
    "TaskId",
    "Wait",
    "Warm",
    "Workers",
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
        pool_pids: the PIDs among ``process_bytes`` that are the pool's workers
            or processes their tasks started (their bytes are the pool's, never
            a co-tenant's).
    """

    free_bytes: int
    used_bytes: int
    process_bytes: Mapping[int, int] | None = None
    pool_pids: frozenset[int] = frozenset()


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

    Attributes:
        task: the task.
        device: its card.
        ask_bytes: its key's ask now (the price of one task alone).
        booked_bytes: what it books on the card: its share of its key's price
            together (:meth:`~gpupool._core.policy.Ask.next_bytes`), what
            :meth:`Planner.started` books.
        past_bound: the serial floor: nothing of the pool runs, and no card had
            room for the task or the live gate was shut.
    """

    task: TaskId
    device: int | None
    ask_bytes: int
    booked_bytes: int
    past_bound: bool = False


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


FailKind = Literal["out_of_memory", "retries_exhausted", "room_wait_expired", "larger_than_card"]


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
        booked_bytes: what it was booked at when it last started.
    """

    task: TaskId
    kind: FailKind
    reason: str
    device: int | None
    booked_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Refuse:
    """Strict mode: a width below ``max_workers`` was decided, and the pool refuses it.

    Attributes:
        reason: the sentence for the error, every number in it.
        decision: the record of the refused narrowing.
    """

    reason: str
    decision: Decision


@dataclass(frozen=True, slots=True, kw_only=True)
class Warm:
    """Start a worker on ``device`` (``None``: a host-bounded pool) for ``task``: it fits there
    now, but no ready worker is idle there. The task stays pending; it is admitted once a
    ready worker can run it, against the readings of that moment (a worker boots, imports
    and runs the ``initializer`` first, for seconds, while the card may change)."""

    device: int | None
    task: TaskId


@dataclass(frozen=True, slots=True, kw_only=True)
class Workers:
    """The pool's workers per card (``None``: a host-bounded pool), as the process layer
    knows them when it asks for the next start.

    Attributes:
        ready: workers that reported ready (booted, ``initializer`` run) and are idle.
        booting: workers started that have not reported ready yet.
    """

    ready: Mapping[int | None, int]
    booting: Mapping[int | None, int]

    def can_run(self, device: int | None) -> bool:
        """A ready worker is idle on ``device``."""
        return self.ready.get(device, 0) > 0

    @property
    def booting_total(self) -> int:
        """Workers booting on every card."""
        return sum(self.booting.values())
