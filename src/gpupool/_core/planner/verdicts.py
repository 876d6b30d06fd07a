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
#: How long a task that ran out of memory alone waits for room while others' bytes hold its card:
#: long enough to ride out another job's allocation spike or a co-tenant restarting, short enough
#: that a card taken for good fails the task within minutes rather than hanging the pipeline.
DEFAULT_ROOM_WAIT_S = 120.0

#: Out-of-memory retries per task, in every mode, before the error reaches its
#: future. Each retry runs at a narrower width or after a wait for room; five
#: are enough to walk a pool of eight down to one.
DEFAULT_MAX_RETRIES = 5

#: The host RSS a child is priced at until a child of the pool has reported its own: a spawned
#: interpreter that imports a CUDA framework holds several hundred MiB before its first allocation,
#: and a CUDA context maps several hundred more in host memory. A measurement replaces it.
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
    """One live snapshot of a card: free, used and per-process bytes read together."""

    free_bytes: int
    used_bytes: int
    # Device bytes per PID (``None``: the driver lists no rows, as in containers and MIG).
    process_bytes: Mapping[int, int] | None = None
    # The PIDs among them that are the pool's workers or processes their tasks started
    # (their bytes are the pool's, never a co-tenant's).
    pool_pids: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    """What the caller asked for (the pool's options, as the planner reads them)."""

    max_workers: int
    # Explicit: the CPU count does not cap it (it is logged where it exceeds them).
    max_workers_given: bool = True
    # Run exactly this many at once, whatever the bound says.
    fixed_width: int | None = None
    # Refuse to narrow below ``max_workers``.
    strict: bool = False
    retry_oom: bool = True
    max_retries: int = DEFAULT_MAX_RETRIES
    # How long a task waits for room that others' bytes hold.
    room_wait_s: float = DEFAULT_ROOM_WAIT_S
    reserve_bytes: int = 0
    # This process, to find its row in a reading.
    parent_pid: int | None = None
    child_rss_prior_bytes: int = DEFAULT_CHILD_RSS_PRIOR_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class Start:
    """Start ``task`` on ``device`` (``None``: a host-bounded pool), booked there at
    ``booked_bytes``: its share of its key's price together
    (:meth:`~gpupool._core.policy.Ask.next_bytes`; ``ask_bytes`` is one task's alone),
    what :meth:`Planner.started` books. ``past_bound``: the serial floor (nothing of the
    pool runs, and no card had room for the task or the live gate was shut)."""

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


#: Why a task fails: it ran out alone with its room free (or retries are off), ran out
#: ``max_retries`` times, waited ``room_wait_s`` for room others held, or needs more than
#: the largest card holds.
FailKind = Literal["out_of_memory", "retries_exhausted", "room_wait_expired", "larger_than_card"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Fail:
    """``task``'s out-of-memory goes to its future: ``reason`` is the error's sentence, every
    number in it; ``device`` and ``booked_bytes``, where it last ran and was booked then."""

    task: TaskId
    kind: FailKind
    reason: str
    device: int | None
    booked_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Refuse:
    """Strict mode: a width below ``max_workers`` was decided, and the pool refuses it
    (``reason``: the error's sentence; ``decision``: the record of the refused narrowing)."""

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
    knows them when it asks for the next start."""

    # Workers that reported ready (booted, ``initializer`` run) and are idle.
    ready: Mapping[int | None, int]
    # Workers started that have not reported ready yet.
    booting: Mapping[int | None, int]

    def can_run(self, device: int | None) -> bool:
        """A ready worker is idle on ``device``."""
        return self.ready.get(device, 0) > 0

    @property
    def booting_total(self) -> int:
        """Workers booting on every card."""
        return sum(self.booting.values())
